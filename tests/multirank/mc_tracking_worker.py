"""A rank that checks RowTracker's marks on managed-collision tables against the rows each step
really changes (run by tests/multirank/test_mc_tracking.py).

The model: a ManagedCollisionEmbeddingBagCollection ``mc`` (pooled, table ``t``, feature ``f``)
and a ManagedCollisionEmbeddingCollection ``mcseq`` (sequence, table ``t``, feature ``g``), each
with tests/multirank/mc_worker.py's MCH module (DistanceLFU, eviction every 2 training forwards,
input hash size 2**40), beside an ordinary EmbeddingBagCollection ``ebc`` (table ``u``, feature
``h``); every table row-wise over the ranks, fused SGD. The loss, ``sum(v + v**2)`` over every
output value ``v``, gives each looked-up row a gradient that is not 0 (a sum of squares alone
with a large step zeroes a row looked up once, which later lookups then leave unchanged), so the
rows a step changes are exactly the rows it looks up or redraws. The batches draw from the same
skewed raw-id pool as mc_worker.py, from a seeded generator per (step, rank).

What it reports (one line ``RESULT <json>``):

- ``refused``: what `ShardMap.from_model` says without ``managed_collision``.
- ``keys``: the table keys `ShardMap.from_model(..., managed_collision=True)` finds, and the
  weight keys of the unsharded model.
- ``steps``: per training step and local shard, the rows whose weight or optimizer state bytes
  changed, the rows the tracker marked, and the rows the step looked up or redrew, worked out
  apart from the tracker: for an MC table the slots the raw ids routed to this rank map to in
  the state after the step (`capture`; the miss slot for an id not held) plus the slots an
  eviction filled (`diff(...).admitted_slots`), for the ordinary table the ids of every rank's
  batch in this rank's row block.
- ``forwards``: the same for an eval forward, a training-mode forward under ``no_grad`` between
  evictions, and one at an eviction step (its redraws change rows though no gradient flows).
- ``detached``: marks of a training step while the tracker is detached (none), and whether
  `detach` put the module's own methods back and `attach` wrapped them again.
- ``held``: for a training step with an eviction and one without, the order of
  `hold_next_lookup`'s two calls and of a `guard`'s calls, each with the rows changed so far,
  the rows a guard call named that had changed before any guard call named them (a
  copy-on-write snapshot would have saved them aside too late), and the changed rows no guard
  call named (never saved aside).

Usage: python -m tests.multirank.mc_tracking_worker --init-method file://... [--steps N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import ManagedCollisionCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from ckpt.capture.tracker import LookupGroup, RowTracker
from common.errors import DeltarecError
from common.process import run_main
from sharding.managed_collision import FREE, McState, capture, diff, mc_shards, route
from sharding.shard_views import ShardMap
from tests.multirank.mc_worker import DIM, HASH, IDS, POOL, ROWS, _kjt, _mch

PLAIN_ROWS = 40  # rows of the ordinary table
BATCH = 8  # samples per rank per step
LR = 0.05  # fused SGD's step: small enough that the loss stays finite


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        meta = torch.device("meta")
        bag = EmbeddingBagConfig(name="t", num_embeddings=ROWS["bag"], embedding_dim=DIM, feature_names=["f"])
        seq = EmbeddingConfig(name="t", num_embeddings=ROWS["seq"], embedding_dim=DIM, feature_names=["g"])
        plain = EmbeddingBagConfig(name="u", num_embeddings=PLAIN_ROWS, embedding_dim=DIM, feature_names=["h"])
        self.mc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=[bag], device=meta), ManagedCollisionCollection({"t": _mch(ROWS["bag"])}, [bag])
        )
        self.mcseq = ManagedCollisionEmbeddingCollection(
            EmbeddingCollection(tables=[seq], device=meta), ManagedCollisionCollection({"t": _mch(ROWS["seq"])}, [seq])
        )
        self.ebc = EmbeddingBagCollection(tables=[plain], device=meta)

    def forward(self, f: KeyedJaggedTensor, g: KeyedJaggedTensor, h: KeyedJaggedTensor) -> torch.Tensor:
        pooled, _ = self.mc(f)
        seq, _ = self.mcseq(g)
        return sum((v + v * v).sum() for v in (pooled.values(), seq["g"].values(), self.ebc(h).values()))  # type: ignore[return-value]


def _build(world: int) -> DistributedModelParallel:
    torch.manual_seed(0)
    model = Model()
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": LR})
    sharders = {
        "mc": ManagedCollisionEmbeddingBagCollectionSharder(),
        "mcseq": ManagedCollisionEmbeddingCollectionSharder(),
        "ebc": EmbeddingBagCollectionSharder(),
    }
    tables = {"mc": "t", "mcseq": "t", "ebc": "u"}
    plan = ShardingPlan(
        {
            name: construct_module_sharding_plan(
                getattr(model, name),
                {tables[name]: row_wise()},
                sharder=sharder,  # type: ignore[arg-type]
                local_size=world,
                world_size=world,
                device_type="cpu",
            )
            for name, sharder in sharders.items()
        }
    )
    return DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=plan,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        sharders=list(sharders.values()),  # type: ignore[arg-type]
    )


Batch = dict[str, tuple[np.ndarray, np.ndarray]]  # feature -> (values, lengths)


def _batch(seed: int, step: int, part: int) -> Batch:
    """Rank `part`'s batch of step `step`: raw ids from the pool with a skew (another id the
    frequent one now and then), ordinary ids uniform."""
    rng = np.random.default_rng([seed, step, part])
    p = 1.0 / np.arange(1, POOL + 1) ** 0.7
    p = p[rng.permutation(POOL)] if step % 5 == 4 else p
    out: Batch = {}
    for key in ("f", "g", "h"):
        lengths = rng.integers(1, 4, size=BATCH).astype(np.int64)
        n = int(lengths.sum())
        values = rng.integers(0, PLAIN_ROWS, size=n) if key == "h" else IDS[rng.choice(POOL, size=n, p=p / p.sum())]
        out[key] = (values.astype(np.int64), lengths)
    return out


def _forward(dmp: DistributedModelParallel, b: Batch) -> torch.Tensor:
    return dmp(*(_kjt(k, *b[k]) for k in ("f", "g", "h")))


def _state(smap: ShardMap) -> list[list[torch.Tensor]]:
    return [[s.weight.detach().clone(), *(t.detach().clone() for t in s.optimizer_states.values())] for s in smap.shards]


def _changed(before: list[list[torch.Tensor]], smap: ShardMap) -> list[np.ndarray]:
    """Per shard, the local rows whose weight or any optimizer state bytes differ from `before`."""
    out = []
    for old, s in zip(before, smap.shards):
        new = [s.weight.detach(), *(t.detach() for t in s.optimizer_states.values())]
        diff_rows = torch.zeros(s.num_rows, dtype=torch.bool)
        for a, b in zip(old, new):
            d = a.view(torch.uint8) != b.view(torch.uint8) if a.dtype.is_floating_point else a != b
            diff_rows |= d.reshape(s.num_rows, -1).any(dim=1)
        out.append(np.flatnonzero(diff_rows.numpy()))
    return out


class Truth:
    """The rows a step looks up or redraws, per local shard, worked out without the tracker."""

    def __init__(self, smap: ShardMap, dmp: DistributedModelParallel, rank: int, world: int) -> None:
        self.smap, self.rank, self.world = smap, rank, world
        self.mc = {s.key: s for s in mc_shards(dmp)}
        self.feature = {
            "mc._embedding_module.embedding_bags.t": "f",
            "mcseq._embedding_module.embeddings.t": "g",
            "ebc.embedding_bags.u": "h",
        }

    def states(self) -> dict[str, McState]:
        return {k: capture(s) for k, s in self.mc.items()}

    def expected(
        self, batches: list[Batch], before: dict[str, McState], after: dict[str, McState], looked_up: bool
    ) -> list[dict[str, list[int]]]:
        """Per shard: {"looked_up", "redrawn"} local rows (sorted lists)."""
        out = []
        for s in self.smap.shards:
            ids = np.concatenate([b[self.feature[s.table]][0] for b in batches]) if looked_up else np.zeros(0, np.int64)
            if s.table in self.mc:
                old, new = before[s.table], after[s.table]
                here = ids[route(ids, HASH, self.world) == self.rank]
                held = {int(r): i for i, r in enumerate(new.raw_ids) if r != FREE}
                slots = np.array([held.get(int(r), new.size - 1) for r in here], dtype=np.int64)
                redrawn = diff(old, new).admitted_slots - new.slot_offset
            else:
                local = ids - s.row_offset
                slots = local[(local >= 0) & (local < s.num_rows)]
                redrawn = np.zeros(0, np.int64)
            out.append({"looked_up": sorted(set(slots.tolist())), "redrawn": sorted(set(redrawn.tolist()))})
        return out


def _observe(
    smap: ShardMap, tracker: RowTracker, truth: Truth, run: Callable[[], None], batches: list[Batch], looked_up: bool
) -> list[dict]:
    """Run one forward (and backward) `run`; per shard: changed, marked, looked up, redrawn rows."""
    rows = _state(smap)
    states = truth.states()
    tracker.mark_checkpoint()  # since_last: this forward's marks only
    run()
    changed = _changed(rows, smap)
    expected = truth.expected(batches, states, truth.states(), looked_up)
    out = []
    for i, s in enumerate(smap.shards):
        marked = np.flatnonzero(tracker.since_last(i).numpy())
        out.append(
            {
                "table": s.table,
                "changed": changed[i].tolist(),
                "marked": marked.tolist(),
                **expected[i],
            }
        )
    return out


def _held_step(smap: ShardMap, tracker: RowTracker, truth: Truth, run: Callable[[], None]) -> dict:
    """One training step with `hold_next_lookup` and a `guard` registered: each call with the
    rows changed when it ran; the rows guard calls named after they had changed; the slots
    the step's evictions redrew on this rank."""
    before = _state(smap)
    states = truth.states()
    events: list[list] = []
    guarded: list[set[int]] = [set() for _ in smap.shards]  # rows a guard call named so far, per shard
    late: list[list] = []

    def changed_now() -> int:
        return sum(len(c) for c in _changed(before, smap))

    def guard(group: LookupGroup, ids: list[torch.Tensor]) -> None:
        events.append(["guard", changed_now()])
        changed = _changed(before, smap)
        for i, part in zip(group.shards, ids):
            if i is None:
                continue
            named = set(part.tolist())
            late.extend([smap.shards[i].table, r] for r in sorted((named - guarded[i]) & set(changed[i].tolist())))
            guarded[i] |= named

    tracker.hold_next_lookup(
        lambda: events.append(["hold", changed_now()]), lambda: events.append(["before_update", changed_now()])
    )
    remove = tracker.guard(guard)
    try:
        run()
    finally:
        remove()
    unguarded = [
        [s.table, r] for s, g, c in zip(smap.shards, guarded, _changed(before, smap)) for r in sorted(set(c.tolist()) - g)
    ]
    redrawn = sum(int(diff(states[k], new).admitted_slots.size) for k, new in truth.states().items())
    return {"events": events, "late": late, "unguarded": unguarded, "changed": changed_now(), "redrawn": redrawn}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--init-method", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, required=True)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    print(f"rank {rank}: seed {args.seed}", flush=True)
    dist.init_process_group("gloo", init_method=args.init_method, rank=rank, world_size=world)
    torch.set_num_threads(1)
    dmp = _build(world)

    try:
        ShardMap.from_model(dmp)
        refused = ""
    except DeltarecError as e:
        refused = str(e)
    smap = ShardMap.from_model(dmp, managed_collision=True)
    tracker = RowTracker(smap)
    truth = Truth(smap, dmp, rank, world)
    unsharded = sorted(k[: -len(".weight")] for k in Model().state_dict() if k.endswith(".weight"))
    result: dict = {
        "rank": rank,
        "world": world,
        "refused": refused,
        "keys": {"shard_map": sorted(smap.table_info), "unsharded": unsharded, "local": [s.table for s in smap.shards]},
        "mc_modules": sorted(em.managed_collision.fqn for em in smap.managed_collision if em.managed_collision),
        "sharding": {k: t.sharding_type for k, t in smap.table_info.items()},
    }

    def train(step: int) -> tuple[Callable[[], None], list[Batch]]:
        batches = [_batch(args.seed, step, r) for r in range(world)]

        def run() -> None:
            _forward(dmp, batches[rank]).backward()

        return run, batches

    steps = []
    for step in range(args.steps):
        run, batches = train(step)
        steps.append(_observe(smap, tracker, truth, run, batches, True))
    result["steps"] = steps

    # forwards that train nothing: eval (no profiling, no eviction); training mode under no_grad,
    # between evictions and then at one (its redraws change rows)
    forwards: dict[str, list[dict]] = {}
    batches = [_batch(args.seed, 1000, r) for r in range(world)]

    def eval_forward() -> None:
        dmp.eval()
        with torch.no_grad():
            _forward(dmp, batches[rank])
        dmp.train()

    def no_grad_forward() -> None:
        with torch.no_grad():
            _forward(dmp, batches[rank])

    forwards["eval"] = _observe(smap, tracker, truth, eval_forward, batches, False)
    mch = next(iter(truth.mc.values())).mch
    for _ in range(2):
        name = "no_grad_eviction" if mch._current_iter + 1 - mch._last_eviction_iter == mch._eviction_interval else "no_grad"
        forwards[name] = _observe(smap, tracker, truth, no_grad_forward, batches, False)
    result["forwards"] = forwards

    # detach: torchrec's own methods again, and nothing marked; attach: wrapped again
    mc_modules = [em.managed_collision.sharded for em in smap.managed_collision if em.managed_collision]
    tracker.detach()
    own = all("compute" not in m.__dict__ and "_evict" not in m.__dict__ for m in mc_modules)
    run, batches = train(args.steps)
    tracker.mark_checkpoint()
    run()
    marked_detached = tracker.count_since_last()
    tracker.attach()
    wrapped = all("compute" in m.__dict__ and "_evict" in m.__dict__ for m in mc_modules)
    run, batches = train(args.steps + 1)
    after_attach = _observe(smap, tracker, truth, run, batches, True)
    result["detached"] = {"own_methods": own, "marked": marked_detached, "rewrapped": wrapped, "after_attach": after_attach}

    held = {}
    for _ in range(2):
        evicts = mch._current_iter + 1 - mch._last_eviction_iter == mch._eviction_interval
        run, batches = train(int(mch._current_iter) + 100)
        held["eviction" if evicts else "lookups_only"] = _held_step(smap, tracker, truth, run)
    result["held"] = held

    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main)
