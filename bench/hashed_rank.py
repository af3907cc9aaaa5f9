"""One rank of the hashed-table suite (bench/hashed.py): a managed-collision table beside an
ordinary one, trained on an eviction-heavy stream with a `ckpt.Checkpointer` on the filesystem
sink, and `torch.distributed.checkpoint.save` of the same state dict at every checkpoint step.

    python -m bench.hashed_rank --init-method file://... --work DIR [--slots N] [--intervals K] ...

The model (a copy of the test suite's managed-collision model, scaled up; bench never imports
the tests): a `ManagedCollisionEmbeddingBagCollection` of one table of `--slots` slots (row-wise
over the ranks, `MCHManagedCollisionModule` with DistanceLFU eviction every `--eviction-every`
training forwards, 2^40 raw ids) and an `EmbeddingBagCollection` of one ordinary table, both of
dimension `--dim`, fused SGD.

The stream (`interval_ids`): interval 0 draws `--fill` x slots fresh raw ids, enough to fill the
table; every later interval draws `--interval-ids` distinct ids of which a share `--new-share`
were never seen and the rest are drawn from the `--slots` most recently introduced ids (those
the table can hold). Every distinct id of an interval is read once, split over its steps and
the ranks (all ranks derive the same ids from the seed), plus `--hot` extra reads per step of a
Zipf-skewed few, so that the eviction policy's counters rank ids.

Per checkpoint the rank records the Checkpointer's stall (`stats.stalls`), the time
`MappingCapture.capture` took inside it (the method is wrapped on this Checkpointer's instance),
and what changed in its shard's mapping since the previous capture (admitted and evicted ids,
slots whose counters moved, whether an eviction ran). After the last step it writes
`<work>/rank<r>.json` (rank 0 adds the checkpoints' outcomes and the dcp.save byte counts).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from common.process import run_main
from sharding.managed_collision import FREE, McState, diff

HASH = 2**40
BAG = 8  # ids pooled per sample
META = torch.device("meta")


@dataclass(frozen=True)
class StreamShape:
    """How the raw ids of each interval are drawn (module docstring)."""

    slots: int
    interval_ids: int
    new_share: float
    fill: float
    steps: int  # per interval
    hot: int
    seed: int = 0


@dataclass(frozen=True)
class CaptureRecord:
    """One `MappingCapture.capture` on this rank: when, how long, and what changed in its
    shard since the previous capture."""

    step: int
    capture_ms: float
    eviction: bool  # an eviction ran since the previous capture (its `last_eviction_iter` moved)
    admitted: int
    evicted: int
    counter_slots: int  # slots whose eviction counters changed (kept, admitted or evicted)
    held: int
    history: int  # raw ids received since the last eviction


class McLoop(Stateful):
    """The loop's state: the step and the RNG an eviction redraws rows from."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"])


class Model(nn.Module):
    """A managed-collision table (`mc`, feature `f`) beside an ordinary one (`plain`, feature `g`)."""

    def __init__(self, slots: int, plain_rows: int, dim: int, eviction_every: int) -> None:
        super().__init__()
        mc = EmbeddingBagConfig(name="mc", num_embeddings=slots, embedding_dim=dim, feature_names=["f"])
        plain = EmbeddingBagConfig(name="plain", num_embeddings=plain_rows, embedding_dim=dim, feature_names=["g"])
        mch = MCHManagedCollisionModule(
            zch_size=slots,
            device=META,
            eviction_policy=DistanceLFU_EvictionPolicy(),
            eviction_interval=eviction_every,
            input_hash_size=HASH,
        )
        self.hashed = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=[mc], device=META), ManagedCollisionCollection({"mc": mch}, [mc])
        )
        self.ordinary = EmbeddingBagCollection(tables=[plain], device=META)

    def forward(self, f: KeyedJaggedTensor, g: KeyedJaggedTensor) -> torch.Tensor:
        pooled, _ = self.hashed(f)
        # means, not sums: a hot id or the miss slot read thousands of times a step then moves
        # by a bounded step (a sum's gradient grows with the reads and SGD diverges)
        return pooled.values().pow(2).mean() + self.ordinary(g).values().pow(2).mean()


def build(world: int, slots: int, plain_rows: int, dim: int, eviction_every: int, lr: float) -> DistributedModelParallel:
    torch.manual_seed(0)
    model = Model(slots, plain_rows, dim, eviction_every)
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": lr})
    mc_sharder, ebc_sharder = ManagedCollisionEmbeddingBagCollectionSharder(), EmbeddingBagCollectionSharder()
    plan = ShardingPlan(
        {
            name: construct_module_sharding_plan(
                module, {table: row_wise()}, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
            )
            for name, module, table, sharder in (
                ("hashed", model.hashed, "mc", mc_sharder),
                ("ordinary", model.ordinary, "plain", ebc_sharder),
            )
        }
    )
    return DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=plan,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        sharders=[mc_sharder, ebc_sharder],  # type: ignore[list-item]
    )


def _fresh(rng: np.random.Generator, n: int, seen: set[int]) -> np.ndarray:
    """`n` raw ids in [0, 2^40) never drawn before (recorded in `seen`)."""
    out: list[int] = []
    while len(out) < n:
        for x in rng.integers(0, HASH, size=n - len(out), dtype=np.int64).tolist():
            if x not in seen:
                seen.add(x)
                out.append(x)
    return np.array(out, dtype=np.int64)


def interval_ids(shape: StreamShape, intervals: int) -> list[tuple[np.ndarray, int]]:
    """Per interval: its distinct raw ids (shuffled) and how many of them were never seen before."""
    rng = np.random.default_rng(shape.seed)
    seen: set[int] = set()
    first = _fresh(rng, int(shape.fill * shape.slots), seen)
    order = [first]  # every id, in the order it was introduced
    out = [(first, first.size)]
    for _ in range(1, intervals):
        new = _fresh(rng, round(shape.new_share * shape.interval_ids), seen)
        recent = np.concatenate(order)[-shape.slots :]
        old = rng.choice(recent, size=min(shape.interval_ids - new.size, recent.size), replace=False)
        ids = np.concatenate([old, new])
        rng.shuffle(ids)
        order.append(new)
        out.append((ids, int(new.size)))
    return out


def _kjt(key: str, values: np.ndarray) -> KeyedJaggedTensor:
    values = values[: values.size - values.size % BAG] if values.size >= BAG else np.resize(values, BAG)
    lengths = np.full(values.size // BAG, BAG, dtype=np.int64)
    return KeyedJaggedTensor.from_lengths_sync([key], torch.from_numpy(values.copy()), torch.from_numpy(lengths))


def batch(
    ids: np.ndarray, shape: StreamShape, step_in_interval: int, rank: int, world: int, plain_rows: int, step: int
) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    """This rank's batch at one step of an interval: its share of the interval's ids, and the hot ids."""
    parts = np.array_split(ids, shape.steps * world)
    mine = parts[step_in_interval * world + rank]
    rng = np.random.default_rng((shape.seed + 1) * 1_000_003 + step * 7919 + rank)
    if shape.hot:
        p = 1.0 / np.arange(1, ids.size + 1) ** 1.1
        mine = np.concatenate([mine, ids[rng.choice(ids.size, size=shape.hot, p=p / p.sum())]])
    plain = rng.integers(0, plain_rows, size=mine.size, dtype=np.int64)
    return _kjt("f", mine), _kjt("g", plain)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _changes(prev: McState | None, new: McState) -> tuple[bool, int, int, int]:
    """(eviction since prev, admitted, evicted, slots whose counters changed)."""
    if prev is None:
        held = int(np.sum(new.raw_ids != FREE))
        return new.last_eviction_iter > 0, held, 0, held
    d = diff(prev, new)
    eviction = new.last_eviction_iter != prev.last_eviction_iter
    return eviction, int(d.admitted_slots.size), int(d.evicted_slots.size), int(d.counter_slots.size)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--init-method", required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--slots", type=int, default=200_000)
    p.add_argument("--plain-rows", type=int, default=50_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--intervals", type=int, default=8)
    p.add_argument("--steps-per-interval", type=int, default=4)
    p.add_argument("--eviction-every", type=int, default=8)
    p.add_argument("--interval-ids", type=int, default=50_000)
    p.add_argument("--new-share", type=float, default=0.2)
    p.add_argument("--fill", type=float, default=1.0)
    p.add_argument("--hot", type=int, default=1024)
    p.add_argument("--policy", default="incremental")
    p.add_argument("--encoding", default="fp32")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--no-dcp", action="store_true")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=args.init_method, rank=rank, world_size=world)
    torch.set_num_threads(1)
    from ckpt import Checkpointer, CkptConfig  # the engine, after the process group

    shape = StreamShape(
        slots=args.slots,
        interval_ids=args.interval_ids,
        new_share=args.new_share,
        fill=args.fill,
        steps=args.steps_per_interval,
        hot=args.hot,
    )
    stream = interval_ids(shape, args.intervals)
    dmp = build(world, args.slots, args.plain_rows, args.dim, args.eviction_every, args.lr)
    loop = McLoop()
    cfg = CkptConfig.from_dict(
        {
            "sink": {"kind": "filesystem"},
            "schedule": {"interval_steps": args.steps_per_interval, "policy": args.policy},
            "encoding": {"weights": args.encoding},
            "write": {"on_backpressure": "wait"},
        }
    )
    ckpt = Checkpointer(cfg, dmp, dense_optimizer=None, loop=loop, run_dir=args.work / "run")
    ckpt.restore()  # a fresh run (ckpt.restore.resume: none): joins it as its first attempt
    captures: list[tuple[int, float, tuple[McState, ...]]] = []
    mapping = ckpt.stages.mapping
    inner: Callable[[], tuple[McState, ...]] = mapping.capture

    def timed_capture() -> tuple[McState, ...]:
        t0 = time.perf_counter()
        states = inner()
        captures.append((loop.step, (time.perf_counter() - t0) * 1e3, states))
        return states

    mapping.capture = timed_capture  # type: ignore[method-assign]
    dcp_bytes: dict[int, int] = {}
    dcp_s: dict[int, float] = {}
    dmp.train()
    t_train = time.perf_counter()
    for interval, (ids, _) in enumerate(stream):
        for s in range(args.steps_per_interval):
            step = interval * args.steps_per_interval + s + 1
            f, g = batch(ids, shape, s, rank, world, args.plain_rows, step)
            dmp(f, g).backward()  # the fused optimizer updates the rows here
            loop.step = step
            if step % args.steps_per_interval == 0 and not args.no_dcp:
                where = args.work / "dcp" / f"step{step}"
                t0 = time.perf_counter()
                dcp.save(dmp.state_dict(), checkpoint_id=str(where))
                dist.barrier()
                dcp_s[step] = time.perf_counter() - t0
                if rank == 0:
                    dcp_bytes[step] = _dir_bytes(where)
                    shutil.rmtree(where)
            ckpt.save(step)
    ckpt.close(loop.step)
    train_s = time.perf_counter() - t_train

    records: list[CaptureRecord] = []
    prev: McState | None = None
    for step, ms, states in captures:
        (state,) = states  # one managed-collision shard per rank
        eviction, admitted, evicted, counters = _changes(prev, state)
        held = int(np.sum(state.raw_ids != FREE))
        records.append(CaptureRecord(step, ms, eviction, admitted, evicted, counters, held, int(state.history_ids.size)))
        prev = state
    stats = ckpt.stats
    result: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "train_s": train_s,
        "captures": [asdict(r) for r in records],
        "stalls": [s._asdict() for s in stats.stalls],
        "committed": stats.committed,
        "failed": stats.failed,
        "skipped": stats.skipped,
        "coalesced": stats.coalesced,
        "run_id": ckpt.run_id,
        "fs_root": ckpt.cfg.sink.fs_root,
        "dense_dir": ckpt.cfg.sink.dense_dir,
    }
    if rank == 0:
        result["outcomes"] = [
            {
                "checkpoint_id": o.checkpoint_id,
                "step": o.step,
                "committed": o.committed,
                "bytes": o.bytes,
                "full": o.full,
                "error": o.error,
            }
            for o in stats.outcomes
        ]
        result["dcp_bytes"] = {str(k): v for k, v in dcp_bytes.items()}
        result["dcp_s"] = {str(k): v for k, v in dcp_s.items()}
        result["stream"] = [{"ids": int(ids.size), "new": new} for ids, new in stream]
    (args.work / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main)
