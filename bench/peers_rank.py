"""One rank of `bench.peers`'s in-process peers (suites `quick` and `full`): the same
sharded job checkpointed by `dcp.save`, `dcp.async_save` (with a stager that clones local
shards) and `torch.save`.

    python -m bench.peers_rank --config C --out-dir DIR --steps N --interval K \
        [--restore RUN_ID=RUN_DIR ...] [--restore-override key=value ...] [--repeats R] [key=value ...]

Spawned like a trainer rank (`launch.ranks.spawn_ranks`), it builds the job exactly as
`trainer.main` does (`bench.job.start_job`) (same config, seed, data, world size), warms up, then trains in phases
of `--steps` steps each, in this order: no checkpointing, `dcp.save`, `dcp.async_save`,
`torch.save`, no checkpointing again. In a checkpointing phase the peer checkpoints every
`--interval` steps:

- `dcp.save`: `{"model": DMP.state_dict(), "optim": optimizer.state_dict()}` (sharded
  weights, row-wise momentum, dense params and dense optimizer) to a local directory;
  the training thread is blocked for the whole save.
- `dcp.async_save`: the same state with `CloningStager` (the default stager crashes on
  torchrec ShardedTensors) on its own gloo group (so its background collectives never
  interleave with training's); the training thread is blocked while the stager clones
  and the save is planned, and again if the previous save is still running at the next
  checkpoint (counted in that checkpoint's stall).
- `torch.save`: each rank pickles its local shards and dense state to its own file.

Per checkpoint: stall on the training thread (max over ranks), bytes on disk, and the step
at which it became durable (the next step end at which an async save's future is done).
Per phase: samples/s over the whole phase (stalls and background work included).

Then restore to training-ready, each into a perturbed model and checked to give back the
same state: `dcp.load` + `load_state_dict` of the newest `dcp.save` checkpoint,
`torch.load` + `load_state_dict` of the newest `torch.save` one, and
`CheckpointManager.restore()` of the newest checkpoint of each deltarec run given with
`--restore` (its marker lookup, chain replay, dense and loop state; its broker connections
made first, as a restarted job's are while it builds its model), `--repeats` rounds, order
rotating. Writes ``<out-dir>/peers_rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from bench.common import RESTORE_PARTS
from bench.job import fingerprint, perturb, start_job, stop_job, timed

WARMUP_STEPS = 5


# -- a stager for dcp.async_save that works on torchrec ShardedTensors -------------------------
def clone_state(obj: Any) -> Any:
    """A training-safe copy of a state dict: tensors cloned, ShardedTensors rebuilt from
    cloned local shards with the same global metadata (no collective)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    if isinstance(obj, ShardedTensor):
        shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in obj.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, obj.metadata(), process_group=obj._process_group)
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
        """Stage by cloning every local tensor (synchronously, on the training thread)."""

        _synchronize_after_execute = False

        def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            return clone_state(state_dict)

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            pass

    return CloningStager


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
    """Copy `saved` (from `local_state`) into the live state dict's tensors; returns what
    `load_state_dict` should get."""
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


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True, help="steps per phase")
    p.add_argument("--interval", type=int, required=True)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--restore", action="append", default=[], help="LABEL=RUN_ID=RUN_DIR of a deltarec run")
    p.add_argument("--restore-override", action="append", default=[], help="LABEL=key=value")
    args, overrides = p.parse_known_args(sys.argv[1:] if argv is None else argv)

    import torch.distributed.checkpoint as dcp

    from ckpt.backends import open_for_restore
    from sharding.shard_views import ShardMap
    from trainer.config import load_config
    from trainer.main import make_checkpoint_manager

    cfg = load_config(args.config, overrides)
    env, device, sharded, trainer, no_metrics = start_job(cfg)
    rank = env.rank
    smap = ShardMap.from_model(sharded.model)
    samples_per_step = cfg.data.batch_size * env.world_size
    async_group = dist.new_group(backend="gloo")
    stager = _stager_class()()
    work = args.out_dir / "peers-ckpt"
    dcp_dir, async_dir, torch_dir = work / "dcp_save", work / "dcp_async_save", work / "torch_save"
    for d in (dcp_dir, async_dir, torch_dir):
        d.mkdir(parents=True, exist_ok=True)

    def dcp_state() -> dict[str, Any]:
        return {"model": sharded.model.state_dict(), "optim": sharded.optimizer.state_dict()}

    for _ in range(WARMUP_STEPS):
        trainer.train_step()

    pending: list[Any] = [None]  # the async save in flight: (future, ckpt index)

    def async_done() -> bool:
        f = pending[0]
        return f is None or f.done()

    def peer_none(i: int) -> None:
        pass

    def peer_dcp(i: int) -> None:
        dcp.save(dcp_state(), checkpoint_id=str(dcp_dir / f"c{i}"))

    def peer_async(i: int) -> None:
        if pending[0] is not None:
            pending[0].result()  # the previous save must finish first (blocks training)
        resp = dcp.async_save(dcp_state(), checkpoint_id=str(async_dir / f"c{i}"), async_stager=stager,
                              process_group=async_group)
        pending[0] = getattr(resp, "upload_completion", resp)

    def peer_torch(i: int) -> None:
        torch.save(local_state(dcp_state()), torch_dir / f"c{i}_rank{rank}.pt")

    def run_phase(name: str, ckpt: Callable[[int], None]) -> dict[str, Any]:
        dist.barrier()
        ckpts: list[dict[str, Any]] = []
        awaiting: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        for s in range(1, args.steps + 1):
            trainer.train_step()
            if name == "dcp.async_save" and awaiting and async_done():
                for c in awaiting:
                    c["durable_at"] = s
                awaiting.clear()
            if s % args.interval == 0 and name != "none":
                i = len(ckpts) + 1
                t = time.perf_counter()
                ckpt(i)
                c = {"ckpt": i, "step": s, "stall_s": time.perf_counter() - t}
                if name == "dcp.async_save":
                    awaiting[:] = [c]  # the previous one, if any, finished inside ckpt()
                    for prev in ckpts:
                        prev.setdefault("durable_at", s)
                else:
                    c["durable_at"] = s
                ckpts.append(c)
        wall = time.perf_counter() - t0
        if pending[0] is not None:  # let the last async save finish (outside the timed phase)
            pending[0].result()
            pending[0] = None
            for c in awaiting:
                c.setdefault("durable_at", args.steps)
        wall = _max_over_ranks(wall)
        for c in ckpts:
            c["stall_ms"] = _max_over_ranks(c.pop("stall_s")) * 1e3
            c["durable_at"] = int(_max_over_ranks(float(c["durable_at"])))
        dist.barrier()
        d = {"dcp.save": dcp_dir, "dcp.async_save": async_dir}.get(name)
        for c in ckpts:
            if d is not None:
                c["bytes"] = _dir_bytes(d / f"c{c['ckpt']}") if rank == 0 else 0  # one directory for all ranks
            elif name == "torch.save":
                t = torch.tensor([float((torch_dir / f"c{c['ckpt']}_rank{rank}.pt").stat().st_size)], dtype=torch.float64)
                dist.all_reduce(t)
                c["bytes"] = int(t.item())
        return {"peer": name, "steps": args.steps, "wall_s": wall, "samples_per_s": args.steps * samples_per_step / wall,
                "checkpoints": ckpts}

    phases = [run_phase("none", peer_none), run_phase("dcp.save", peer_dcp), run_phase("dcp.async_save", peer_async),
              run_phase("torch.save", peer_torch), run_phase("none", peer_none)]
    end_step = trainer.step
    out: dict[str, Any] = {"rank": rank, "phases": phases, "threads": torch.get_num_threads()}

    # -- restore to training-ready ----------------------------------------------------------
    n = len(phases[1]["checkpoints"])
    
    def dcp_load() -> None:
        st = dcp_state()
        dcp.load(st, checkpoint_id=str(dcp_dir / f"c{n}"))
        sharded.model.load_state_dict(st["model"])
        sharded.optimizer.load_state_dict(st["optim"])

    def torch_load() -> None:
        saved = torch.load(torch_dir / f"c{n}_rank{rank}.pt", weights_only=False)
        st = copy_local_into(dcp_state(), saved)
        sharded.model.load_state_dict(st["model"])
        sharded.optimizer.load_state_dict(st["optim"])

    # the newest dcp.save / torch.save checkpoints hold an older state than the live one:
    # save both again from the live state, so every load can be checked against it
    dcp.save(dcp_state(), checkpoint_id=str(dcp_dir / f"c{n}"))
    torch.save(local_state(dcp_state()), torch_dir / f"c{n}_rank{rank}.pt")
    dist.barrier()
    reference = fingerprint(smap, sharded)

    restore_overrides: dict[str, list[str]] = {}
    for ov in args.restore_override:
        label, kv = ov.split("=", 1)
        restore_overrides.setdefault(label, []).append(kv)
    runs = []
    for spec in args.restore:
        label, run_id, run_dir = spec.split("=", 2)
        runs.append((label, run_id, run_dir))

    def deltarec_restore(label: str, run_id: str, run_dir: str) -> Callable[[], tuple[float, Any]]:
        """Build a manager for that run (not timed: a restarted job builds it anyway), then
        time `restore()` alone (marker lookup, chain replay, dense, reader and RNG state)."""
        def go() -> tuple[float, Any]:
            c = load_config(args.config, [*overrides, "ckpt.enabled=true", "ckpt.resume=latest", "ckpt.final=false",
                                          f"ckpt.run_id={run_id}", f"run.dir={run_dir}",
                                          *restore_overrides.get(label, [])])
            backend = open_for_restore(c.ckpt, env.world_size, rank)
            mgr = make_checkpoint_manager(c, env, device, sharded, trainer, no_metrics, backend)
            if backend.ahead is not None:  # a restarted job reads the markers log while it builds its model
                backend.ahead.wait()       # (trainer/main.py); its time is the report's `markers_ahead_s`
            try:
                t, rep = timed(mgr.restore)
                assert rep is not None, f"no checkpoint of run {run_id}"
                return t, {"checkpoint_id": rep.checkpoint_id, "step": rep.step, "chain": rep.chain, "rows": rep.rows,
                           "bytes": rep.bytes, "parts": {k: getattr(rep, k) for k in RESTORE_PARTS}}
            finally:
                mgr.tracker.detach()
                mgr.finish(trainer.step)
        return go

    kinds: list[tuple[str, Callable[[], Any]]] = [("dcp.load", dcp_load), ("torch.load", torch_load)]
    kinds += [(f"deltarec:{label}", deltarec_restore(label, run_id, run_dir)) for label, run_id, run_dir in runs]
    restore: dict[str, dict[str, Any]] = {k: {"restore_s": [], "same_state": []} for k, _ in kinds}
    for r in range(args.repeats):
        order = kinds[r % len(kinds):] + kinds[: r % len(kinds)]
        for name, fn in order:
            if name.startswith("deltarec:"):
                t, info = fn()  # restores that run's state: not comparable to the reference
                restore[name]["restore_s"].append(t)
                restore[name]["checkpoint"] = info
                restore[name].setdefault("parts", []).append(info["parts"])
                continue
            perturb(smap, sharded)
            t, _ = timed(fn)
            restore[name]["restore_s"].append(t)
            restore[name]["same_state"].append(fingerprint(smap, sharded) == reference)
    out["restore"] = restore
    out["dcp_bytes"] = _dir_bytes(dcp_dir / f"c{n}")
    out["end_step"] = end_step
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"peers_rank{rank}.json").write_text(json.dumps(out, indent=1) + "\n")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(work, ignore_errors=True)
    trainer = sharded = smap = None  # released before the process group goes (closures above hold them)
    stop_job()
    return 0


if __name__ == "__main__":
    sys.exit(main())
