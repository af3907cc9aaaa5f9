"""One rank's training job built in-process the way `trainer.main` builds it, for the rank
workers of the suites (`bench.ckpt_rank`, `bench.peers_rank`, `bench.ckpt_probe`,
`bench.tracker_overhead`), and what they do with it between barriers.

A worker is spawned like a trainer rank (`launch.ranks.spawn_ranks`: torchrun's variables and
a file rendezvous) so what it measures runs with the same config, seed, data, sharding plan
and thread count as `python -m trainer.main` would. The one-process suite (`bench.peers_gpu`)
runs several jobs on one built model: `Pristine` puts the model back as it was built and
`fresh_loop` gives it a new training loop, so each job starts as a new process would.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from sharding.dmp import ShardedModel
    from sharding.process_group import DistEnv
    from sharding.shard_views import ShardMap
    from trainer.config import JobConfig
    from trainer.metrics import MetricsLog
    from trainer.trainer import Trainer


class Job(NamedTuple):
    """This rank's part of a job: where it runs, its sharded model, its training loop and
    where the loop reports."""

    env: DistEnv
    device: torch.device
    sharded: ShardedModel
    trainer: Trainer
    metrics: MetricsLog


def start_job(cfg: JobConfig, metrics_path: Path | None = None, evaluate: bool = False) -> Job:
    """Join the process group and build this rank's model and loop with `trainer.main.build_job`
    (threads, seed, sharding, readers: what the trainer runs). `metrics_path`: the metrics.jsonl rank 0 writes
    (default: none is written); `evaluate`: give the loop the eval reader too."""
    from sharding.process_group import detect_env, init_process_group
    from trainer.main import build_job
    from trainer.metrics import MetricsLog

    env = detect_env()
    device = init_process_group(
        env, backend=cfg.sharding.backend, init_method=cfg.sharding.init_method, timeout_s=cfg.sharding.timeout_s
    )
    metrics = MetricsLog(metrics_path or Path("unused"), enabled=metrics_path is not None and env.rank == 0)
    sharded, trainer = build_job(cfg, env, device, metrics, evaluate=evaluate)
    return Job(env, device, sharded, trainer, metrics)


def stop_job() -> None:
    """Leave the process group. The caller drops its references to the job first: the model
    (gloo work of its collectives) must be gone before the group, or a joinable gloo thread
    aborts the process at exit."""
    from sharding.process_group import destroy_process_group

    gc.collect()
    destroy_process_group()


def sync(device: torch.device) -> None:
    """Wait for the work queued on `device` (CUDA runs kernels after the call that queued them
    returned: a timer read before this would miss them); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device | None = None) -> tuple[float, Any]:
    """(seconds of `fn` on the slowest rank, its result): a barrier on both sides, so every
    rank reports the same span; with a CUDA `device`, the work queued before is finished
    before the clock starts and `fn`'s own before it stops."""
    if device is not None:
        sync(device)
    dist.barrier()
    t = time.perf_counter()
    out = fn()
    if device is not None:
        sync(device)
    dist.barrier()
    return time.perf_counter() - t, out


def fingerprint(smap: ShardMap, sharded: ShardedModel) -> list[float]:
    """Sums of every local embedding shard (weights and optimizer states) and dense
    parameter: equal fingerprints after a load mean the state came back."""

    def total(t: torch.Tensor) -> float:  # accumulated in float64 without a float64 copy of the tensor
        return float(t.detach().sum(dtype=torch.float64))

    out = []
    for v in smap.shards:
        out.append(total(v.weight))
        out.extend(total(s) for s in v.optimizer_states.values())
    for _, p in sorted(sharded.model.named_parameters()):
        if not hasattr(p, "_in_backward_optimizers"):
            out.append(total(p))
    return out


@torch.no_grad()
def perturb(smap: ShardMap, sharded: ShardedModel) -> None:
    """Move every value a load must restore, so a load that silently does nothing is caught."""
    for v in smap.shards:
        v.weight.add_(0.5)
        for s in v.optimizer_states.values():
            s.add_(0.5)
    for _, p in sharded.model.named_parameters():
        if not hasattr(p, "_in_backward_optimizers"):
            p.add_(0.5)


class Pristine:
    """A job's model as it was built (every row at its initial value, the optimizers' states
    fresh) and the RNG's state then, to start several jobs from it in one process (the
    one-process peers suite): `reset` puts them back, as a new process building the same job
    would have them. The rows' copies stay where the rows live (on the GPU for GPU shards), so
    a reset is one device copy rather than regenerating every row from `sharding.row_init` on
    one host core; the dense state is `ckpt.dense.state`'s own capture."""

    @torch.no_grad()
    def __init__(self, sharded: ShardedModel, smap: ShardMap) -> None:
        from ckpt.dense.state import DenseCapture

        self.sharded, self.smap = sharded, smap
        self.rows = [[t.detach().clone() for t in (v.weight, *v.optimizer_states.values())] for v in smap.shards]
        self.dense = DenseCapture(sharded)()
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    @property
    def nbytes(self) -> int:
        """Bytes the rows' copies hold (on the rows' device)."""
        return sum(t.numel() * t.element_size() for ts in self.rows for t in ts)

    @torch.no_grad()
    def reset(self) -> None:
        """Every row, optimizer state, dense parameter and buffer, the dense optimizer's state
        and the RNG back to what they were at `Pristine(...)`."""
        from ckpt.dense import state as dense_state

        for v, saved in zip(self.smap.shards, self.rows):
            for live, t in zip((v.weight, *v.optimizer_states.values()), saved):
                live.copy_(t)
        dense_state.load(self.sharded, self.dense)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def fresh_loop(job: Job, cfg: JobConfig, metrics: MetricsLog) -> Job:
    """`job` with a new training loop for `cfg` (same model; its reader from the start of the
    stream, step 0) reporting to `metrics`: a second job on the model `Pristine.reset` put
    back, with what `trainer.main.build_job` would give it besides the model."""
    from trainer.data.factory import make_reader
    from trainer.trainer import Trainer

    loop = Trainer(cfg, job.env, job.device, job.sharded, make_reader(cfg, job.env, "train"), None, metrics)
    return Job(job.env, job.device, job.sharded, loop, metrics)
