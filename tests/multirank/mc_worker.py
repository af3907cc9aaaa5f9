"""A rank that trains managed-collision tables (sharding/managed_collision.py) and checks their
state capture (run by tests/unit/test_managed_collision.py).

The model: a ManagedCollisionEmbeddingBagCollection (pooled) and a
ManagedCollisionEmbeddingCollection (sequence), one table each, row-wise over the ranks, each
with an MCHManagedCollisionModule (DistanceLFU, eviction every 2 steps, input hash size
2**40), fewer slots than the raw ids the batches draw (spread over the whole hash range, so
both ranks receive some), and a fused SGD or Adagrad optimizer. Modes:

- ``resume``: train `--steps` steps capturing every step; check that each diff applies; then
  load the state, rows, optimizer state and torch RNG state of step `--capture-at` into a fresh
  model, train the same batches and compare with the uninterrupted run; and again with only
  what torchrec's state dict keeps (no eviction phase, no history), and without the torch RNG
  state (evicted rows are drawn again from it), which must both differ.
- ``save``: train, then write each rank's states, rows and optimizer state, and the lookups of
  a probe batch (every raw id of the pool), to `--dir`.
- ``reshard`` (any world size): join the saved states (`to_global`), rebucket them onto this
  world size, move the rows, check that the probe batch reads the same row for every id still
  held and its rank's miss row for every other, and train on with evictions.

Each rank prints one line ``RESULT <json>``.

Usage: python -m tests.multirank.mc_worker --init-method file://... --mode resume [...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from common.process import run_main
from sharding.managed_collision import (
    FREE,
    McShard,
    McState,
    apply,
    capture,
    diff,
    load,
    mc_shards,
    rebucket,
    route,
    to_global,
)

HASH = 2**40
ROWS = {"bag": 24, "seq": 16}  # slots per table (over all ranks)
POOL = 64  # distinct raw ids the batches draw from
DIM = 4
IDS = np.array([i * (HASH // POOL) + 12345 for i in range(POOL)], dtype=np.int64)
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.5}), "adagrad": (torch.optim.Adagrad, {"lr": 0.5, "eps": 1e-8})}


def _mch(rows: int) -> MCHManagedCollisionModule:
    return MCHManagedCollisionModule(
        zch_size=rows,
        device=torch.device("meta"),
        eviction_policy=DistanceLFU_EvictionPolicy(),
        eviction_interval=2,
        input_hash_size=HASH,
    )


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        meta = torch.device("meta")
        bag = EmbeddingBagConfig(name="t", num_embeddings=ROWS["bag"], embedding_dim=DIM, feature_names=["f"])
        seq = EmbeddingConfig(name="t", num_embeddings=ROWS["seq"], embedding_dim=DIM, feature_names=["g"])
        self.bag = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=[bag], device=meta), ManagedCollisionCollection({"t": _mch(ROWS["bag"])}, [bag])
        )
        self.seq = ManagedCollisionEmbeddingCollection(
            EmbeddingCollection(tables=[seq], device=meta), ManagedCollisionCollection({"t": _mch(ROWS["seq"])}, [seq])
        )

    def forward(self, f: KeyedJaggedTensor, g: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled, _ = self.bag(f)
        seq, _ = self.seq(g)
        return pooled.values(), seq["g"].values()


def _kjt(key: str, values: np.ndarray, lengths: np.ndarray) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync([key], torch.from_numpy(values), torch.from_numpy(lengths))


def batch(step: int, part: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    """Batch `part` of step `step`: ids drawn with a skew (some ids far more often), so the
    eviction policy has counts to rank."""
    rng = np.random.default_rng(1000 * step + part)
    p = 1.0 / np.arange(1, POOL + 1) ** 0.7
    p = p[rng.permutation(POOL)] if step % 5 == 4 else p  # now and then another id is the frequent one
    out = []
    for key in ("f", "g"):
        lengths = rng.integers(1, 4, size=8).astype(np.int64)
        values = IDS[rng.choice(POOL, size=int(lengths.sum()), p=p / p.sum())]
        out.append(_kjt(key, values, lengths))
    return out[0], out[1]


def build(world: int, optimizer: str) -> DistributedModelParallel:
    torch.manual_seed(0)
    model = Model()
    cls, kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(cls, model.parameters(), dict(kwargs))  # it writes into the dict
    bag_sharder, seq_sharder = ManagedCollisionEmbeddingBagCollectionSharder(), ManagedCollisionEmbeddingCollectionSharder()
    plan = ShardingPlan(
        {
            name: construct_module_sharding_plan(
                getattr(model, name), {"t": row_wise()}, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
            )
            for name, sharder in (("bag", bag_sharder), ("seq", seq_sharder))
        }
    )
    return DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=plan,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        sharders=[bag_sharder, seq_sharder],  # type: ignore[list-item]
    )


def _train(dmp: DistributedModelParallel, steps: range, part: int, parts: int = 1) -> list[float]:
    losses = []
    for step in steps:
        batches = [batch(step, part + i) for i in range(parts)]
        f = KeyedJaggedTensor.concat([b[0] for b in batches]) if parts > 1 else batches[0][0]
        g = KeyedJaggedTensor.concat([b[1] for b in batches]) if parts > 1 else batches[0][1]
        if parts > 1:  # one key per KJT: concatenating batches is concatenating values and lengths
            f = _kjt("f", f.values().numpy(), f.lengths().numpy())
            g = _kjt("g", g.values().numpy(), g.lengths().numpy())
        pooled, seq = dmp(f, g)
        loss = pooled.pow(2).sum() + seq.pow(2).sum()
        loss.backward()
        losses.append(float(loss.detach()))
    return losses


def _rows(shard: McShard) -> dict[str, torch.Tensor]:
    v = shard.rows
    return {"weight": v.weight.detach().clone(), **{k: t.detach().clone() for k, t in v.optimizer_states.items()}}


def _put_rows(shard: McShard, rows: dict[str, torch.Tensor]) -> None:
    v = shard.rows
    with torch.no_grad():
        v.weight.copy_(rows["weight"])
        for k, t in v.optimizer_states.items():
            t.copy_(rows[k])


def _same_rows(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _resume(args: argparse.Namespace, rank: int, world: int) -> dict:
    k, m = args.capture_at, args.steps
    a = build(world, args.optimizer)
    shards = mc_shards(a)
    layout = {
        s.key: {
            "slots": [s.rows.row_offset, s.rows.row_offset + s.rows.num_rows],
            "segments": list(capture(s).segments),
            "opt_states": sorted(s.rows.optimizer_states),
        }
        for s in shards
    }
    states = [[capture(s) for s in shards]]
    at_k: tuple[list[McState], list[dict[str, torch.Tensor]], torch.Tensor] | None = None
    for step in range(m):
        if step == k:
            at_k = (states[-1], [_rows(s) for s in shards], torch.get_rng_state())
        _train(a, range(step, step + 1), rank)
        states.append([capture(s) for s in shards])
    assert at_k is not None
    final_rows = [_rows(s) for s in shards]
    tables: dict[str, dict] = {}
    for i, s in enumerate(shards):
        deltas = [diff(old[i], new[i]) for old, new in zip(states, states[1:])]
        chained = states[0][i]
        chain_ok = True
        for d, new in zip(deltas, states[1:]):
            chained = apply(chained, d)
            chain_ok = chain_ok and chained == new[i]
        real_evictions = sum(int(d.evicted_slots.size) for d in deltas)
        admissions = sum(int(d.admitted_slots.size) for d in deltas)
        held = states[-1][i].raw_ids[states[-1][i].raw_ids != FREE]
        tables[s.key] = {
            **layout[s.key],
            "chain_ok": chain_ok,
            "jump_ok": apply(states[k][i], diff(states[k][i], states[m][i])) == states[m][i],
            "admissions": admissions,
            "evictions": real_evictions,
            "held": int(held.size),
            "routed_here": bool(np.all(route(held, HASH, world) == rank)),
            "history_at_k": int(states[k][i].history_ids.size),
            "iters": [states[k][i].current_iter, states[k][i].last_eviction_iter, states[m][i].current_iter],
        }

    def rerun(strip: bool = False, rng: bool = True) -> list[tuple[bool, bool]]:
        fresh = build(world, args.optimizer)
        shards_b = mc_shards(fresh)
        assert at_k is not None
        for s, st, rows in zip(shards_b, at_k[0], at_k[1]):
            if strip:  # what torchrec's state dict keeps: no eviction phase, no pending history
                empty = np.zeros(0, dtype=np.int64)
                st = dataclasses.replace(
                    st, last_eviction_iter=-1, history_ids=empty, history_last_access=empty, history_capacity=-1
                )
            load(s, st)
            _put_rows(s, rows)
        if rng:
            torch.set_rng_state(at_k[2])
        _train(fresh, range(k, m), rank)
        return [(capture(s) == states[m][i], _same_rows(_rows(s), final_rows[i])) for i, s in enumerate(shards_b)]

    for s, (state_ok, rows_ok) in zip(shards, rerun()):
        tables[s.key].update(resume_state=state_ok, resume_rows=rows_ok)
    for s, (state_ok, rows_ok) in zip(shards, rerun(strip=True)):
        tables[s.key].update(stripped_same=state_ok and rows_ok)
    for s, (state_ok, rows_ok) in zip(shards, rerun(rng=False)):
        tables[s.key].update(no_rng_state=state_ok, no_rng_rows=rows_ok)
    return {"tables": tables}


def _probe() -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    """Every raw id of the pool once, one per sample (a bag of one id pools to its row)."""
    ones = np.ones(POOL, dtype=np.int64)
    return _kjt("f", IDS, ones), _kjt("g", IDS, ones)


def _lookup(dmp: DistributedModelParallel) -> list[np.ndarray]:
    """The rows the probe batch reads, per table, without training (eval: no profiling, no eviction)."""
    dmp.eval()
    with torch.no_grad():
        pooled, seq = dmp(*_probe())
    dmp.train()
    return [pooled.reshape(POOL, DIM).numpy().copy(), seq.reshape(POOL, DIM).numpy().copy()]


def _save(args: argparse.Namespace, rank: int, world: int) -> dict:
    dmp = build(world, args.optimizer)
    shards = mc_shards(dmp)
    _train(dmp, range(args.steps), rank)
    arrays: dict[str, np.ndarray] = {}
    for s in shards:
        for name, value in capture(s).as_arrays().items():
            arrays[f"{s.key}|state|{name}"] = value
        for name, t in _rows(s).items():
            arrays[f"{s.key}|rows|{name}"] = t.numpy()
    if rank == 0:
        for s, out in zip(shards, _lookup(dmp)):
            arrays[f"{s.key}|probe"] = out
    else:
        _lookup(dmp)  # the lookup is collective
    np.savez(Path(args.dir) / f"rank{rank}.npz", **arrays)  # type: ignore[arg-type]
    return {"keys": [s.key for s in shards]}


def _reshard(args: argparse.Namespace, rank: int, world: int) -> dict:
    files = sorted(Path(args.dir).glob("rank*.npz"))
    saved = [dict(np.load(f)) for f in files]
    dmp = build(world, args.optimizer)
    shards = mc_shards(dmp)
    tables: dict[str, dict] = {}
    for s in shards:
        olds = [
            McState.from_arrays(s.key, {n.split("|")[2]: v for n, v in d.items() if n.startswith(f"{s.key}|state|")})
            for d in saved
        ]
        by_offset = sorted(saved, key=lambda d: int(d[f"{s.key}|state|slot_offset"]))
        old_rows = {
            name: torch.from_numpy(np.concatenate([d[f"{s.key}|rows|{name}"] for d in by_offset]))
            for name in ["weight", *s.rows.optimizer_states]
        }
        glob = to_global(olds)
        state, moves = rebucket(glob, world, rank)
        load(s, state)
        with torch.no_grad():  # every row of a kept id, with its optimizer state, from its old slot to its new one
            for name, t in zip(["weight", *s.rows.optimizer_states], [s.rows.weight, *s.rows.optimizer_states.values()]):
                t[moves.new_slots - state.slot_offset] = old_rows[name][moves.old_slots]
                t[moves.miss_new_slot - state.slot_offset] = old_rows[name][moves.miss_old_slot]
        tables[s.key] = {
            "old_held": int(glob.raw_ids.size),
            "kept": int(moves.raw_ids.size),
            "dropped": int(moves.dropped_raw_ids.size),
            "moved": int(np.sum(moves.old_slots != moves.new_slots)),
        }
    looked = _lookup(dmp)
    for s, out in zip(shards, looked):
        expected = saved[0][f"{s.key}|probe"]
        st = capture(s)
        every: list[tuple[np.ndarray, np.ndarray]] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(every, (st.raw_ids, s.rows.weight[st.size - 1].detach().numpy().copy()))
        held = np.isin(IDS, np.concatenate([raw for raw, _ in every]))
        miss_rows = np.stack([every[int(r)][1] for r in route(IDS[~held], HASH, world)]) if (~held).any() else out[~held]
        tables[s.key].update(
            probe_held=int(held.sum()),
            held_rows_same=bool(np.array_equal(out[held], expected[held])),
            misses_read_miss_row=bool(np.array_equal(out[~held], miss_rows)),
        )
    before = [capture(s) for s in shards]
    losses = _train(dmp, range(args.steps, args.steps + args.more), 2 * rank, parts=2)
    for s, old in zip(shards, before):
        new = capture(s)  # refuses a state out of torchrec's order
        d = diff(old, new)
        tables[s.key].update(
            trained_on=bool(np.isfinite(losses).all()),
            admissions_after=int(d.admitted_slots.size),
            evictions_after=int(d.evicted_slots.size),
            iters=[old.current_iter, new.current_iter],
            apply_ok=apply(old, d) == new,
        )
    return {"tables": tables, "losses": losses}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--init-method", required=True)
    p.add_argument("--mode", choices=["resume", "save", "reshard"], required=True)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--capture-at", type=int, default=5)
    p.add_argument("--more", type=int, default=4)
    p.add_argument("--dir", default="")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=args.init_method, rank=rank, world_size=world)
    torch.set_num_threads(1)
    run = {"resume": _resume, "save": _save, "reshard": _reshard}[args.mode]
    result = {"rank": rank, "world": world, **run(args, rank, world)}
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main)
