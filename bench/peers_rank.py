"""One rank of the peers suites' in-process jobs: the same sharded job checkpointed by
`dcp.save`, `dcp.async_save` and `torch.save`, restored by `dcp.load`, `torch.load` and
deltarec's `Checkpointer.restore`.

    python -m bench.peers_rank --config C --out-dir DIR --steps N --interval K \
        [--restore LABEL=RUN_ID=RUN_DIR ...] [--restore-override LABEL=key=value ...] [--repeats R] [--build-s S] \
        [key=value ...]

Spawned like a trainer rank (`launch.ranks.spawn_ranks`), it builds the job exactly as
`trainer.main` does (`bench.job.start_job`: same config, seed, data, world size).

**Phases** (suites `quick`, `full` and `scale`, 2 ranks): warm-up, then phases of `--steps`
steps each, in this order: no checkpointing, `dcp.save`, `dcp.async_save`, `torch.save`
(`--peers`: those named), no checkpointing again (`--restore-only`: no phase; suite `scale`
restores runs of 4 ranks into 2 this way). Each phase and each restore records this
rank's resident set at its start and its sampled peak (`bench.memory.RssSampler`).
In a checkpointing phase the peer checkpoints every `--interval` steps (`DcpPeers`):

- `dcp.save`: `{"model": DMP.state_dict(), "optim": optimizer.state_dict()}` (sharded
  weights, row-wise momentum, dense params and dense optimizer) to a local directory;
  the training thread is blocked for the whole save.
- `dcp.async_save`: the same state, staged by `--stager`: `clone` (`CloningStager`: clones
  the local shards where they are, the quick and full suites') or `pinned` (torch's
  `BlockingAsyncStager` keeping its staged copy in pinned host memory, reused from one save
  to the next; the default `DefaultStager` refuses torchrec's ShardedTensors), on its own gloo
  group (so its background collectives never interleave with training's); the training
  thread is blocked while the stager copies and the save is planned, and again if the
  previous save is still running at the next checkpoint (counted in that checkpoint's stall).
- `torch.save`: each rank pickles its local shards and dense state to its own file.

Per checkpoint (`PeerCheckpointer`): stall on the training thread (max over ranks), bytes on
disk, the step at which it became durable (the next step end at which an async save's future
is done) and the seconds from its step to durable (`dcp.save`: its stall; `dcp.async_save`:
until its future completed). Only each peer's newest checkpoint is kept on disk. Per phase:
samples/s over the whole phase (stalls and background work included).

Then restore to training-ready, each into a perturbed model and checked to give back the
state saved at its checkpoint: `dcp.load` + `load_state_dict` of the newest `dcp.save`
checkpoint, `torch.load` + `load_state_dict` of the newest `torch.save` one, and
`Checkpointer.restore()` of the newest checkpoint of each deltarec run given with
`--restore` (its marker lookup, chain replay, dense and loop state; its broker connections
made first, as a restarted job's are while it builds its model), `--repeats` rounds, order
rotating. Writes ``<out-dir>/peers_rank<r>.json``.

The one-process run of suite `gpu-peers` (world size 1) is `bench.peers_gpu_rank`, which uses
this module's `DcpPeers`, `PeerCheckpointer` and `deltarec_restore`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from bench.common import RESTORE_PARTS
from bench.job import fingerprint, perturb, start_job, stop_job, sync, timed
from bench.memory import RssSampler
from common.process import run_main

if TYPE_CHECKING:
    from sharding.dmp import ShardedModel
    from sharding.process_group import DistEnv
    from sharding.shard_views import ShardMap
    from trainer.trainer import Trainer

WARMUP_STEPS = 5
PEERS = ("dcp.save", "dcp.async_save", "torch.save")
LOADS = {"dcp.save": "dcp.load", "dcp.async_save": "dcp.load", "torch.save": "torch.load"}


# -- stagers for dcp.async_save that work on torchrec ShardedTensors ----------------------------
def clone_state(obj: Any) -> Any:
    """A training-safe copy of a state dict: tensors cloned, ShardedTensors rebuilt from
    cloned local shards with the same global metadata (no collective)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    if isinstance(obj, ShardedTensor):
        shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in obj.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, obj.metadata(), process_group=obj._process_group)
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_state(v) for v in obj)
    return obj


def _stager_class() -> type:
    from torch.distributed.checkpoint.staging import AsyncStager

    class CloningStager(AsyncStager):
        """Stage by cloning every local tensor where it lives (synchronously, on the training
        thread): on GPU shards a copy in device memory."""

        _synchronize_after_execute = False

        def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            return clone_state(state_dict)

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            pass

    return CloningStager


def pinned_stager(device: torch.device) -> Any:
    """dcp.async_save's stager with pinned-memory staging: torch's `BlockingAsyncStager` with
    `cache_staged_state_dict=True`. At the first save it makes a host copy of the state dict's
    structure in page-locked memory (`_create_cpu_state_dict(pin_memory=True)`; ShardedTensors
    keep their metadata, their local shards become pinned host tensors), and every save copies
    the live state into it (`_copy_state_dict`) and returns it; `async_save` writes it on its
    thread. Training waits for that copy. The cache is reused, so a save must be done before
    the next one stages (`DcpPeers.async_save` waits for it).

    Not `DefaultStager(StagingOptions(use_pinned_memory=True, ...))`: its `StateDictStager`
    deep-copies every tensor through `Tensor.data_ptr()`, which torchrec's ShardedTensor
    refuses (checked on torch 2.13; torch 2.11's `StateDictStager` works the same way, and its
    `StagingOptions` names its last field `use_cuda_non_blocking_copy` where 2.13 has
    `use_non_blocking_copy`). What this relies on exists unchanged in torch 2.4 through 2.13:
    `BlockingAsyncStager(cache_staged_state_dict=..., type_check=...)` and its
    `state_dict_cache` attribute. Without CUDA, where memory cannot be page-locked, the same
    cache is made unpinned before the first save (the CPU variant of the suite)."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    class PinnedStager(BlockingAsyncStager):
        def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            if self.state_dict_cache is None and device.type != "cuda":
                from torch.distributed._state_dict_utils import _create_cpu_state_dict

                self.state_dict_cache = _create_cpu_state_dict(state_dict)  # as torch's, not page-locked
            return super().stage(state_dict)

    return PinnedStager(cache_staged_state_dict=True)


# -- torch.save per rank -----------------------------------------------------------------------
def local_state(obj: Any) -> Any:
    """This rank's part of a state dict: a ShardedTensor becomes the list of its local shard
    tensors (views, not copies); everything else as is."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(obj, ShardedTensor):
        return [s.tensor for s in obj.local_shards()]
    if isinstance(obj, dict):
        return {k: local_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_state(v) for v in obj]
    return obj


@torch.no_grad()
def copy_local_into(live: Any, saved: Any) -> Any:
    """Copy `saved` (from `local_state`, on whatever device `torch.load` put it) into the live
    state dict's tensors, where they live; returns what `load_state_dict` should get."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(live, ShardedTensor):
        for s, t in zip(live.local_shards(), saved):
            s.tensor.copy_(t)
        return live
    if isinstance(live, torch.Tensor):
        live.copy_(saved)
        return live
    if isinstance(live, dict):
        return {k: copy_local_into(live[k], saved[k]) for k in live}
    if isinstance(live, list):
        return [copy_local_into(a, b) for a, b in zip(live, saved)]
    return saved


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)  # a CPU tensor: gloo carries it (the group is cpu:gloo,cuda:nccl on GPUs)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sum_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


# -- the peers' checkpoints ----------------------------------------------------------------------
class DcpPeers:
    """One job's peer checkpoints (`dcp.save`, `dcp.async_save`, `torch.save`) under `work`,
    their loads, and their bytes on disk. DCP coordinates on a gloo group of its own (CPU
    collectives whatever the device; `async_save` needs a CPU backend)."""

    def __init__(self, sharded: ShardedModel, rank: int, work: Path, device: torch.device, stager: str) -> None:
        self.sharded, self.rank, self.device, self.work = sharded, rank, device, work
        self.group = dist.new_group(backend="gloo")
        self.stager = pinned_stager(device) if stager == "pinned" else _stager_class()()
        self.dirs = {name: work / name.replace(".", "_") for name in PEERS}
        for d in self.dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        self.pending: Future | None = None  # the async save in flight
        self.done_at: dict[int, float] = {}  # async save -> perf_counter() when its future completed
        self.waited_s = 0.0  # the last async save's wait for the one before it

    def state(self) -> dict[str, Any]:
        return {"model": self.sharded.model.state_dict(), "optim": self.sharded.optimizer.state_dict()}

    def path(self, name: str, i: int) -> Path:
        """Checkpoint `i` of peer `name` (a directory for DCP, this rank's file for torch.save)."""
        return self.dirs[name] / (f"c{i}_rank{self.rank}.pt" if name == "torch.save" else f"c{i}")

    def save(self, name: str, i: int) -> None:
        """Peer `name`'s checkpoint `i` of the live state; returns when training may go on."""
        if name == "dcp.save":
            import torch.distributed.checkpoint as dcp

            dcp.save(self.state(), checkpoint_id=str(self.path(name, i)), process_group=self.group)
        elif name == "dcp.async_save":
            self.async_save(i)
        elif name == "torch.save":
            torch.save(local_state(self.state()), self.path(name, i))
        else:
            raise ValueError(f"unknown peer {name!r}")

    def async_save(self, i: int) -> None:
        import torch.distributed.checkpoint as dcp

        t = time.perf_counter()
        self.wait_async()  # the previous save must finish first (blocks training), its staged copy reused
        self.waited_s = time.perf_counter() - t
        resp = dcp.async_save(
            self.state(), checkpoint_id=str(self.path("dcp.async_save", i)), async_stager=self.stager, process_group=self.group
        )
        # torch >= 2.9 may answer an AsyncSaveResponse (staging and upload futures) where a stager
        # stages asynchronously; a blocking stager's answer is the upload's Future
        future: Future = getattr(resp, "upload_completion", resp)
        future.add_done_callback(lambda _f, i=i: self.done_at.__setitem__(i, time.perf_counter()))
        self.pending = future

    def async_done(self) -> bool:
        return self.pending is None or self.pending.done()

    def wait_async(self, timeout_s: float = 600.0) -> None:
        if self.pending is not None:
            self.pending.result(timeout=timeout_s)
            self.pending = None

    def load(self, load: str, i: int) -> None:
        """`dcp.load` or `torch.load` of checkpoint `i` into the live model, then `load_state_dict`."""
        if load == "dcp.load":
            import torch.distributed.checkpoint as dcp

            st = self.state()
            dcp.load(st, checkpoint_id=str(self.path("dcp.save", i)), process_group=self.group)
        else:
            saved = torch.load(self.path("torch.save", i), weights_only=False)
            st = copy_local_into(self.state(), saved)
        self.sharded.model.load_state_dict(st["model"])
        self.sharded.optimizer.load_state_dict(st["optim"])

    def nbytes(self, name: str, i: int) -> int:
        """Bytes of checkpoint `i` on disk, all ranks (a collective for torch.save)."""
        if name == "torch.save":
            return int(_sum_over_ranks(float(self.path(name, i).stat().st_size)))
        return _dir_bytes(self.path(name, i)) if self.rank == 0 else 0  # one directory for all ranks

    def drop(self, name: str, i: int) -> None:
        """Delete checkpoint `i` (a newer one is durable): the disk holds one per peer."""
        p = self.path(name, i)
        if name == "torch.save":
            p.unlink(missing_ok=True)
        elif self.rank == 0:
            shutil.rmtree(p, ignore_errors=True)

    def close(self) -> None:
        try:
            self.wait_async()
        except Exception as exc:  # noqa: BLE001 - a failed save was reported where it failed
            print(f"bench: the last dcp.async_save failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        getattr(self.stager, "close", lambda: None)()  # AsyncStager.close: torch >= 2.8
        self.stager = None  # and with it the pinned staging copy
        if self.rank == 0:
            shutil.rmtree(self.work, ignore_errors=True)


class PeerCheckpointer:
    """The training loop's checkpointer for one peer (`Trainer.checkpointer`, or called after each
    step of a plain loop): every `interval` steps, the peer's checkpoint; per checkpoint its stall
    (the device idle before the clock starts and after it stops, so it holds the checkpoint's own
    device work and none queued by training before; for `dcp.async_save`, `wait_ms` of it waited
    for the previous save), the step end at which it was durable, the
    seconds from its step to durable, its bytes on disk; and after the checkpoint numbered `last`,
    the model's fingerprint (what a load of it must give back)."""

    def __init__(self, peers: DcpPeers, name: str, interval: int, last: int, smap: ShardMap) -> None:
        self.peers, self.name, self.interval, self.last, self.smap = peers, name, interval, last, smap
        self.checkpoints: list[dict[str, Any]] = []
        self.awaiting: list[dict[str, Any]] = []  # async: the save in flight, not yet durable
        self.reference: list[float] | None = None
        self._started: dict[int, float] = {}

    def steps_at_risk(self) -> None:
        """Not measured for the peers (their durability is `durable_at_step`)."""
        return None

    def save(self, step: int) -> None:
        if self.awaiting and self.peers.async_done():
            self._durable(step)
        if step % self.interval:
            return
        i = len(self.checkpoints) + 1
        sync(self.peers.device)
        t = time.perf_counter()
        self.peers.save(self.name, i)
        sync(self.peers.device)
        stall = time.perf_counter() - t
        c = {"ckpt": i, "step": step, "stall_s": stall}
        self.checkpoints.append(c)
        if self.name == "dcp.async_save":
            c["wait_s"] = self.peers.waited_s  # of the stall: waiting for the previous save (the rest staged it)
            if self.awaiting:  # the previous save finished inside this one's call
                self._durable(step)
            self._started[i] = t
            self.awaiting = [c]
        else:
            c["durable_at"], c["durable_s"] = step, stall
            self._measure(c)
        if i == self.last:
            self.reference = fingerprint(self.smap, self.peers.sharded)

    def _durable(self, step: int) -> None:
        """The async save awaited completed (seen at this step end)."""
        for c in self.awaiting:
            c["durable_at"] = step
            # the future's callback records when it completed; one that has not run yet runs now
            c["durable_s"] = self.peers.done_at.get(c["ckpt"], time.perf_counter()) - self._started[c["ckpt"]]
            self._measure(c)
        self.awaiting.clear()

    def _measure(self, c: dict[str, Any]) -> None:
        """Bytes of a durable checkpoint; the one before it is deleted (the newest stays)."""
        c["bytes"] = self.peers.nbytes(self.name, c["ckpt"])
        if c["ckpt"] > 1:
            self.peers.drop(self.name, c["ckpt"] - 1)

    def finish(self, step: int) -> list[dict[str, Any]]:
        """Let the last async save complete (outside the timed training); every checkpoint's
        figures, the slowest rank's."""
        if self.awaiting:
            self.peers.wait_async()
            self._durable(step)
        for c in self.checkpoints:
            c["stall_ms"] = max_over_ranks(c.pop("stall_s")) * 1e3
            if "wait_s" in c:
                c["wait_ms"] = max_over_ranks(c.pop("wait_s")) * 1e3
            c["durable_at"] = int(max_over_ranks(float(c["durable_at"])))
            c["durable_s"] = max_over_ranks(c["durable_s"])
        return self.checkpoints


def _busy_building(sharded: ShardedModel, until: float) -> None:
    """Stand in for a restarted job's model build until `until` (`time.perf_counter()`): pass
    over every row and parameter of the model, as the build's initialisation does, so the
    machine is as busy as it is then (one pass may run past `until`). A sleep here left the VM
    idle, and a restore after an idle spell ran about twice as slow as after a busy one
    (docs/history/BENCHMARKS-2026-12.md, "After the producer's cap, on a slower day")."""
    from sharding.shard_views import ShardMap

    smap = ShardMap.from_model(sharded.model)
    while time.perf_counter() < until:
        perturb(smap, sharded)


def deltarec_restore(
    config: str,
    overrides: list[str],
    env: DistEnv,
    device: torch.device,
    sharded: ShardedModel,
    trainer: Trainer,
    build_s: float = 0.0,
) -> tuple[float, dict[str, Any]]:
    """`Checkpointer.restore()` of the newest checkpoint of the run `overrides` name, into
    the live model (`trainer`: the loop whose state it restores): the checkpointer built first (not
    timed: a restarted job builds it anyway, its broker connections made, the markers log read
    and, with `ckpt.restore.read_ahead`, its frames' fetch started while its model is built) `build_s`
    after the backend was opened (this job's own model build: what a restarted job spends
    between the two, trainer/main.py; the process kept busy meanwhile, `_busy_building`), then
    `restore()` alone (marker lookup, chain replay,
    dense, reader and RNG state), timed with barriers on both sides and, on a GPU, the device's
    work finished. Returns (seconds, what it restored)."""
    from ckpt.log.backend import open_for_restore
    from trainer.config import load_config
    from trainer.main import make_checkpointer
    from trainer.metrics import MetricsLog

    c = load_config(config, [*overrides, "ckpt.enabled=true", "ckpt.restore.resume=latest", "ckpt.schedule.final=false"])
    opened = time.perf_counter()
    backend = open_for_restore(c.ckpt.run_id, c.ckpt.sink, c.ckpt.restore, env.world_size, env.rank)
    _busy_building(sharded, opened + build_s)  # the model's build (trainer/main.py)
    mgr = make_checkpointer(c, env, device, sharded, trainer, MetricsLog(Path("unused"), enabled=False), backend)
    if backend.ahead is not None:  # a restarted job reads the markers log while it builds its model
        backend.ahead.wait()  # (trainer/main.py); its time is the report's `markers_ahead_s`
    try:
        t, rep = timed(mgr.restore, device)
        assert rep is not None, f"no checkpoint of run {c.ckpt.run_id}"
        return t, {
            "checkpoint_id": rep.checkpoint_id,
            "step": rep.step,
            "chain": rep.chain,
            "rows": rep.rows,
            "bytes": rep.bytes,
            "parts": {k: getattr(rep, k) for k in RESTORE_PARTS},
        }
    finally:
        mgr.stages.tracker.detach()
        mgr.close(trainer.step)


# -- suites quick and full: phases of one loop --------------------------------------------------
def run_phases(args: argparse.Namespace, overrides: list[str]) -> int:
    from sharding.shard_views import ShardMap
    from trainer.config import load_config

    cfg = load_config(args.config, overrides)
    t0 = time.perf_counter()
    env, device, sharded, trainer, _ = start_job(cfg)
    build_s = max_over_ranks(time.perf_counter() - t0)  # what a restarted job spends building its model
    restore_build_s = build_s if args.build_s is None else args.build_s  # each deltarec restore's stand-in for it
    rank = env.rank
    smap = ShardMap.from_model(sharded.model)
    samples_per_step = cfg.data.batch_size * env.world_size
    peers = DcpPeers(sharded, rank, args.out_dir / "peers-ckpt", device, args.stager)
    for _ in range(WARMUP_STEPS):
        trainer.train_step()

    def run_phase(name: str) -> tuple[dict[str, Any], PeerCheckpointer | None]:
        dist.barrier()
        pc = PeerCheckpointer(peers, name, args.interval, args.steps // args.interval, smap) if name != "none" else None
        rss = RssSampler().start()
        t0 = time.perf_counter()
        for s in range(1, args.steps + 1):
            trainer.train_step()
            if pc is not None:
                pc.save(s)
        sync(device)
        wall = max_over_ranks(time.perf_counter() - t0)
        ckpts = pc.finish(args.steps) if pc is not None else []
        dist.barrier()
        return (
            {
                "peer": name,
                "rss_start_bytes": rss.start_bytes,
                "rss_peak_bytes": rss.stop(),
                "steps": args.steps,
                "wall_s": wall,
                "samples_per_s": args.steps * samples_per_step / wall,
                "checkpoints": ckpts,
            },
            pc,
        )

    done = [] if args.restore_only else [run_phase(name) for name in ("none", *args.peers, "none")]
    phases = [ph for ph, _ in done]
    references = {LOADS[pc.name]: (pc.last, pc.reference) for _, pc in done if pc is not None and pc.name != "dcp.async_save"}
    end_step = trainer.step
    out: dict[str, Any] = {"rank": rank, "phases": phases, "threads": torch.get_num_threads(), "build_s": build_s}

    # -- restore to training-ready ----------------------------------------------------------
    restore_overrides: dict[str, list[str]] = {}
    for ov in args.restore_override:
        label, kv = ov.split("=", 1)
        restore_overrides.setdefault(label, []).append(kv)
    kinds: list[tuple[str, Callable[[], Any]]] = [
        (load, lambda load=load, n=n: peers.load(load, n)) for load, (n, _) in references.items()
    ]
    for spec in args.restore:
        label, run_id, run_dir = spec.split("=", 2)
        kinds.append(
            (
                f"deltarec:{label}",
                lambda label=label, run_id=run_id, run_dir=run_dir: deltarec_restore(
                    args.config,
                    [*overrides, f"ckpt.run_id={run_id}", f"run.dir={run_dir}", *restore_overrides.get(label, [])],
                    env,
                    device,
                    sharded,
                    trainer,
                    restore_build_s,
                ),
            )
        )
    restore: dict[str, dict[str, Any]] = {k: {"restore_s": [], "same_state": [], "rss_peak_bytes": []} for k, _ in kinds}
    for r in range(args.repeats):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        for name, fn in order:
            if name.startswith("deltarec:"):
                with RssSampler() as rss:
                    t, info = fn()  # restores that run's state: not comparable to a reference
                restore[name]["rss_peak_bytes"].append(rss.peak_bytes)
                restore[name]["restore_s"].append(t)
                restore[name]["checkpoint"] = info
                restore[name].setdefault("parts", []).append(info["parts"])
                continue
            perturb(smap, sharded)
            with RssSampler() as rss:
                t, _ = timed(fn, device)
            restore[name]["rss_peak_bytes"].append(rss.peak_bytes)
            restore[name]["restore_s"].append(t)
            restore[name]["same_state"].append(fingerprint(smap, sharded) == references[name][1])
    out["restore"] = restore
    out["dcp_bytes"] = next((c["bytes"] for ph in phases if ph["peer"] == "dcp.save" for c in ph["checkpoints"][-1:]), 0)
    out["end_step"] = end_step
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"peers_rank{rank}.json").write_text(json.dumps(out, indent=1) + "\n")
    dist.barrier()
    peers.close()
    trainer = sharded = smap = peers = None  # released before the process group goes (closures above hold them)
    kinds = []
    stop_job()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers_rank", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True, help="steps per phase")
    p.add_argument("--interval", type=int, required=True, help="checkpoint interval in steps")
    p.add_argument("--repeats", type=int, default=2, help="rounds of restores")
    p.add_argument(
        "--peers",
        nargs="+",
        choices=("dcp.save", "dcp.async_save", "torch.save"),
        default=["dcp.save", "dcp.async_save", "torch.save"],
        help="the checkpointing phases, in order, between the two without checkpoints",
    )
    p.add_argument(
        "--restore-only",
        action="store_true",
        help="no phases: only deltarec's restores (of runs trained on another world size, suite scale)",
    )
    p.add_argument(
        "--build-s",
        type=float,
        help="seconds each deltarec restore keeps the process busy between opening its backend and building its "
        "manager, standing in for a restarted job's model build (default: this job's own build, measured)",
    )
    p.add_argument("--stager", choices=("clone", "pinned"), default="clone", help="dcp.async_save's stager")
    p.add_argument("--restore", action="append", default=[], help="LABEL=RUN_ID=RUN_DIR of a deltarec run")
    p.add_argument("--restore-override", action="append", default=[], help="LABEL=key=value")
    args, overrides = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    return run_phases(args, overrides)


if __name__ == "__main__":
    run_main(main)
