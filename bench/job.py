"""One rank's training job built in-process the way `trainer.main` builds it, for the rank
workers of the suites (`bench.ckpt_rank`, `bench.peers_rank`, `bench.ckpt_probe`,
`bench.tracker_overhead`), and what they do with it between barriers.

A worker is spawned like a trainer rank (`launch.ranks.spawn_ranks`: torchrun's variables and
a file rendezvous) so what it measures runs with the same config, seed, data, sharding plan
and thread count as `python -m trainer.main` would.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

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
    device = init_process_group(env, backend=cfg.sharding.backend, init_method=cfg.sharding.init_method,
                                timeout_s=cfg.sharding.timeout_s)
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


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds of `fn` on the slowest rank, its result): a barrier on both sides, so every
    rank reports the same span."""
    dist.barrier()
    t = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t, out


def fingerprint(smap: ShardMap, sharded: ShardedModel) -> list[float]:
    """Sums of every local embedding shard (weights and optimizer states) and dense
    parameter: equal fingerprints after a load mean the state came back."""
    out = []
    for v in smap.shards:
        out.append(float(v.weight.double().sum()))
        out.extend(float(s.double().sum()) for s in v.optimizer_states.values())
    for _, p in sorted(sharded.model.named_parameters()):
        if not hasattr(p, "_in_backward_optimizers"):
            out.append(float(p.detach().double().sum()))
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
