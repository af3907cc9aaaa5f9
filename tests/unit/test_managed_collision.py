"""The managed-collision (ZCH) state of sharding/managed_collision.py.

Pure functions on synthetic shard states (random, with the seed printed): diff/apply round
trips (the history kept across deltas between evictions included), tombstones, refusals, the
routing and row-wise layout against torchrec/fbgemm's own, and `to_global`/`rebucket`
invariants over world sizes. `capture`'s reuse of an earlier state's arrays on one unsharded
MCH module on the CPU. The real sharded modules on spawned ranks:
tests/multirank/test_managed_collision.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from sharding.managed_collision import (
    FREE,
    PINNED_COUNT,
    ManagedCollisionError,
    McDelta,
    McGlobal,
    McShard,
    McState,
    apply,
    capture,
    diff,
    load,
    rebucket,
    route,
    row_wise_segments,
    to_global,
)
from sharding.shard_views import ShardView

H = 2**40
POLICIES = {"lfu": (True, False), "lru": (False, True), "distance_lfu": (True, True)}  # keeps (counts, last access)


# --- synthetic states ----------------------------------------------------------------------------


def _states(rng: np.random.Generator, rows: int, world: int, policy: str, fill: float = 0.8) -> list[McState]:
    """One table's shard states as torchrec leaves them after some training: held ids routed to
    their shard, free slots, the miss slot pinned, a pending history."""
    has_counts, has_access = POLICIES[policy]
    segs = row_wise_segments(rows, world)
    pool = np.unique(rng.integers(0, H, size=6 * rows))
    current = int(rng.integers(10, 100))
    last_eviction = current - int(rng.integers(0, 3))
    out = []
    for r in range(world):
        size = segs[r + 1] - segs[r]
        mine = pool[route(pool, H, world) == r]
        k = min(mine.size, int((size - 1) * fill))
        slots = rng.choice(size - 1, size=k, replace=False)
        raw = np.full(size, FREE, dtype=np.int64)
        raw[slots] = rng.choice(mine, size=k, replace=False)
        counts = np.zeros(size, dtype=np.int64)
        counts[slots] = rng.integers(1, 50, size=k)
        counts[-1] = PINNED_COUNT
        access = np.zeros(size, dtype=np.int64)
        access[slots] = rng.integers(0, last_eviction + 1, size=k)
        access[-1] = last_eviction
        hist = mine[rng.integers(0, mine.size, size=int(rng.integers(0, 12)))] if mine.size else np.zeros(0, np.int64)
        out.append(
            McState(
                table="mc._embedding_module.embedding_bags.t",
                slot_offset=segs[r],
                raw_ids=raw,
                counts=counts if has_counts else None,
                last_access=access if has_access else None,
                current_iter=current,
                last_eviction_iter=last_eviction,
                history_ids=hist,
                history_last_access=rng.integers(last_eviction, current + 1, size=hist.size) if has_access else None,
                history_capacity=40,
                segments=segs,
                input_hash_size=H,
            )
        )
    return out


def _evolve(rng: np.random.Generator, s: McState, world: int, rank: int) -> McState:
    """The next capture of shard `s`: some held ids replaced by new ones, some free slots filled,
    counters moved on, now and then a slot freed (what a load may do), one more iteration."""
    raw = s.raw_ids.copy()
    size = s.size
    regular = np.arange(size - 1)
    fresh = rng.integers(0, H, size=4 * size)
    fresh = fresh[(route(fresh, H, world) == rank) & ~np.isin(fresh, raw)]
    fresh = np.unique(fresh)
    rng.shuffle(fresh)
    changing = rng.choice(regular, size=min(int(rng.integers(0, size)), size - 1, fresh.size), replace=False)
    raw[changing] = fresh[: changing.size]
    if rng.random() < 0.3 and size > 1:
        raw[rng.integers(0, size - 1)] = FREE

    def counters(values: np.ndarray | None, high: int) -> np.ndarray | None:
        if values is None:
            return None
        out = values.copy()
        touched = rng.random(size - 1) < 0.3
        out[:-1][touched] = rng.integers(0, high, size=int(touched.sum()))
        out[changing] = rng.integers(1, high, size=changing.size)
        return out

    hist = fresh[: int(rng.integers(0, 8))]
    return McState(
        table=s.table,
        slot_offset=s.slot_offset,
        raw_ids=raw,
        counts=counters(s.counts, 99),
        last_access=counters(s.last_access, s.current_iter + 2),
        current_iter=s.current_iter + 1,
        last_eviction_iter=s.current_iter + 1 if rng.random() < 0.5 else s.last_eviction_iter,
        history_ids=hist,
        history_last_access=None if s.history_last_access is None else np.full(hist.size, s.current_iter + 1),
        history_capacity=s.history_capacity,
        segments=s.segments,
        input_hash_size=s.input_hash_size,
    )


def _grow(rng: np.random.Generator, s: McState, world: int, rank: int) -> McState:
    """The next capture of shard `s` when no eviction came in between: the same slots and
    counters, one more iteration, the history grown by the ids that arrived (up to its capacity)."""
    more = rng.integers(0, H, size=int(rng.integers(0, 8)))
    more = more[route(more, H, world) == rank][: max(0, s.history_capacity - s.history_ids.size)]
    return replace(
        s,
        current_iter=s.current_iter + 1,
        history_ids=np.concatenate([s.history_ids, more]),
        history_last_access=None
        if s.history_last_access is None
        else np.concatenate([s.history_last_access, np.full(more.size, s.current_iter + 1)]),
    )


# --- diff and apply ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_apply_of_diff_rebuilds_every_random_state(replay_seed, policy: str) -> None:
    rng = np.random.default_rng(replay_seed.value)
    for world in (1, 2, 3):
        for rank, first in enumerate(_states(rng, int(rng.integers(8, 60)), world, policy)):
            chain = [first]
            for _ in range(6):
                chain.append(_evolve(rng, chain[-1], world, rank))
            rebuilt = first
            for old, new in zip(chain, chain[1:]):
                d = diff(old, new)
                assert apply(old, d) == new, f"{replay_seed}: world {world} rank {rank}"
                rebuilt = apply(rebuilt, d)
            assert rebuilt == chain[-1], f"{replay_seed}: the chain of deltas"
            assert apply(first, diff(first, chain[-1])) == chain[-1], f"{replay_seed}: one delta over the chain"
            assert diff(chain[-1], chain[-1]).empty


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_delta_between_evictions_carries_only_the_history_that_arrived(replay_seed, policy: str) -> None:
    rng = np.random.default_rng(replay_seed.value)
    for world in (1, 3):
        for rank, first in enumerate(_states(rng, int(rng.integers(8, 40)), world, policy)):
            chain = [first]
            for _ in range(10):
                step = _grow if rng.random() < 0.6 else _evolve
                chain.append(step(rng, chain[-1], world, rank))
            rebuilt = first
            for old, new in zip(chain, chain[1:]):
                d = diff(old, new)
                where = f"{replay_seed}: world {world} rank {rank}"
                if (
                    old.history_ids.size
                    and old.last_eviction_iter == new.last_eviction_iter
                    and new.history_ids.size >= old.history_ids.size
                    and np.array_equal(new.history_ids[: old.history_ids.size], old.history_ids)
                ):
                    assert d.history_keep == old.history_ids.size, where
                    assert d.history_ids.tolist() == new.history_ids[old.history_ids.size :].tolist(), where
                else:
                    assert d.history_keep == 0 and np.array_equal(d.history_ids, new.history_ids), where
                assert apply(old, d) == new, where
                rebuilt = apply(rebuilt, d)
            assert rebuilt == chain[-1], f"{replay_seed}: the chain of deltas"
            assert apply(first, diff(first, chain[-1])) == chain[-1], f"{replay_seed}: one delta over the chain"


def test_the_kept_history_must_be_there() -> None:
    raw = np.array([5, 7, FREE], dtype=np.int64)
    old = McState("t", 0, raw, np.array([1, 2, PINNED_COUNT]), None, 3, 2, np.array([5, 9]), None, 8, (0, 3), H)
    new = replace(old, current_iter=4, history_ids=np.array([5, 9, 7, 7]))
    d = diff(old, new)
    assert (d.history_keep, d.history_ids.tolist(), d.empty) == (2, [7, 7], True)
    assert apply(old, d) == new
    with pytest.raises(ManagedCollisionError, match="keeps 2 history ids of a state holding 1: it follows another checkpoint"):
        apply(replace(old, history_ids=np.array([5])), d)
    evicted = replace(new, last_eviction_iter=4, history_ids=np.array([5, 9, 1]))  # an eviction came in between
    assert diff(old, evicted).history_keep == 0
    assert diff(old, replace(new, history_ids=np.array([5, 8, 7]))).history_keep == 0  # not a prefix
    with pytest.raises(ManagedCollisionError, match="negative"):
        replace(d, history_keep=-1)
    assert d == replace(d) and d != replace(d, history_keep=1) and d != replace(d, counts=None)
    assert isinstance(d, McDelta)


def test_tombstones_name_the_slot_and_the_id_that_left() -> None:
    raw = np.array([5, 7, 9, 11, FREE, FREE], dtype=np.int64)
    old = McState(
        "t", 10, raw, np.array([1, 2, 3, 4, 0, PINNED_COUNT]), None, 3, 2, np.zeros(0, np.int64), None, -1, (0, 10, 16), H
    )
    new_raw = np.array([5, 8, FREE, 11, 13, FREE], dtype=np.int64)  # 7 -> 8, 9 left, 13 came into a free slot
    new = McState(
        "t", 10, new_raw, np.array([1, 1, 0, 6, 1, PINNED_COUNT]), None, 4, 4, np.array([8, 13]), None, 40, (0, 10, 16), H
    )
    d = diff(old, new)
    assert d.evicted_slots.tolist() == [11, 12] and d.evicted_raw_ids.tolist() == [7, 9]
    assert d.admitted_slots.tolist() == [11, 14] and d.admitted_raw_ids.tolist() == [8, 13]
    assert d.counter_slots.tolist() == [11, 12, 13, 14] and d.counts is not None and d.counts.tolist() == [1, 0, 6, 1]
    assert (d.current_iter, d.last_eviction_iter, d.history_ids.tolist(), d.history_capacity) == (4, 4, [8, 13], 40)
    assert apply(old, d) == new
    assert not d.evicted_slots.flags.writeable, "a delta's arrays are read-only"


def test_apply_refuses_a_delta_that_does_not_follow_the_state(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    (a,) = _states(rng, 30, 1, "distance_lfu")
    b = _evolve(rng, a, 1, 0)
    d = diff(a, b)
    if d.evicted_slots.size:
        other = replace(a, raw_ids=np.where(a.raw_ids == FREE, FREE, a.raw_ids + 1))
        with pytest.raises(ManagedCollisionError, match="follows another checkpoint"):
            apply(other, d)
    shifted = replace(a, slot_offset=a.slot_offset + 1)
    with pytest.raises(ManagedCollisionError, match="not of this shard"):
        apply(shifted, d)
    with pytest.raises(ManagedCollisionError, match="same shard and policy"):
        diff(a, replace(b, counts=None))
    admit_over = replace(a, raw_ids=np.where(np.arange(a.size) == a.size - 1, FREE, np.arange(a.size) + 1))
    with pytest.raises(ManagedCollisionError, match="without evicting"):
        apply(admit_over, diff(replace(admit_over, raw_ids=np.full(a.size, FREE)), admit_over))


def test_a_state_checks_its_shapes_and_round_trips_through_arrays(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    for policy in POLICIES:
        for s in _states(rng, 20, 2, policy):
            assert McState.from_arrays(s.table, s.as_arrays()) == s
            assert not s.raw_ids.flags.writeable
    (s,) = _states(rng, 20, 1, "distance_lfu")
    with pytest.raises(ManagedCollisionError, match="mismatched shapes"):
        replace(s, counts=np.zeros(3, np.int64))
    with pytest.raises(ManagedCollisionError, match="history's last access"):
        replace(s, history_last_access=None)
    with pytest.raises(ManagedCollisionError, match="exceed the capacity"):
        replace(s, history_capacity=0, history_ids=np.array([1]), history_last_access=np.array([1]))


# --- routing and layout, against torchrec and fbgemm ----------------------------------------------


def test_route_is_fbgemm_block_bucketization_with_one_block_per_rank(replay_seed) -> None:
    """The routing the sharded MC modules use: block_bucketize_sparse_features with W blocks
    and the original ids kept (torchrec's RwSparseFeaturesDist for MC tables)."""
    import torch
    import torchrec  # noqa: F401  loads fbgemm's operators

    rng = np.random.default_rng(replay_seed.value)
    for hash_size in (1000, 2**40, 2**63 - 1):
        for world in (1, 2, 3, 4, 5):
            block = -(-hash_size // world)
            edges = [0, block - 1, block, world * block - 1, hash_size - 1]
            high = min(2 * hash_size, 2**63 - 1)
            ids = np.concatenate([np.array([e for e in edges if 0 <= e < 2**63 - 1]), rng.integers(0, high, size=200)])
            lengths = torch.tensor([ids.size], dtype=torch.int64)
            out = torch.ops.fbgemm.block_bucketize_sparse_features(
                lengths,
                torch.from_numpy(ids),
                bucketize_pos=False,
                sequence=True,
                block_sizes=torch.tensor([block]),
                total_num_blocks=torch.tensor([world]),
                my_size=world,
                weights=None,
                batch_size_per_feature=None,
                max_B=-1,
                block_bucketize_pos=None,
                keep_orig_idx=True,
            )
            per_rank = np.split(out[1].numpy(), np.cumsum(out[0].numpy())[:-1])
            routed = route(ids, hash_size, world)
            for r in range(world):
                assert Counter(per_rank[r].tolist()) == Counter(ids[routed == r].tolist()), f"{replay_seed}: W={world}"


def test_row_wise_segments_are_torchrecs() -> None:
    from torchrec.distributed.sharding_plan import _calculate_rw_shard_sizes_and_offsets

    for rows in range(1, 41):
        for world in range(1, 7):
            sizes, offsets = _calculate_rw_shard_sizes_and_offsets(rows, world, 4)
            assert row_wise_segments(rows, world) == (*[o[0] for o in offsets], rows)
            assert [s[0] for s in sizes] == np.diff(row_wise_segments(rows, world)).tolist()


# --- to_global and rebucket ----------------------------------------------------------------------


def _check_rebucket(glob: McGlobal, world: int, seed: object) -> tuple[list[McState], list]:
    where = f"{seed}: {len(glob.segments) - 1} -> {world} ranks"
    by_id = dict(zip(glob.raw_ids.tolist(), range(glob.raw_ids.size)))
    states, all_moves = [], []
    kept_ids, dropped_ids, new_slots = [], [], []
    for rank in range(world):
        s, m = rebucket(glob, world, rank)
        states.append(s)
        all_moves.append(m)
        start, end = s.slot_offset, s.slot_offset + s.size
        assert (start, end) == (s.segments[rank], s.segments[rank + 1]), where
        assert s.raw_ids[-1] == FREE and m.miss_new_slot == end - 1, where
        held = s.raw_ids[s.raw_ids != FREE]
        assert np.all(route(held, H, world) == rank), f"{where}: an id on a shard it is not routed to"
        # a kept id's row comes from the slot that held that very id, and lands where the new state maps it
        for raw, old, new in zip(m.raw_ids.tolist(), m.old_slots.tolist(), m.new_slots.tolist()):
            i = by_id[raw]
            assert glob.slots[i] == old, f"{where}: id {raw} would take another id's row"
            assert start <= new < end - 1 and s.raw_ids[new - start] == raw, where
            for mine, theirs in ((s.counts, glob.counts), (s.last_access, glob.last_access)):
                assert (mine is None) == (theirs is None), where
                assert mine is None or theirs is None or mine[new - start] == theirs[i], where
        assert set(held.tolist()) == set(m.raw_ids.tolist()), where
        routed = int(np.sum(route(glob.raw_ids, H, world) == rank))
        assert m.raw_ids.size == min(routed, s.size - 1) and m.raw_ids.size + m.dropped_raw_ids.size == routed, where
        if m.dropped_raw_ids.size and glob.counts is not None:
            worst_kept = min(int(glob.counts[by_id[x]]) for x in m.raw_ids.tolist())
            assert all(int(glob.counts[by_id[x]]) <= worst_kept for x in m.dropped_raw_ids.tolist()), where
        assert glob.segments[0] <= m.miss_old_slot < glob.segments[-1] and m.miss_old_slot + 1 in glob.segments, where
        kept_ids += m.raw_ids.tolist()
        dropped_ids += m.dropped_raw_ids.tolist()
        new_slots += m.new_slots.tolist()
    assert sorted(kept_ids + dropped_ids) == glob.raw_ids.tolist(), f"{where}: every id kept or dropped, once"
    assert len(set(new_slots)) == len(new_slots), f"{where}: two ids on one row"
    assert Counter(np.concatenate([s.history_ids for s in states]).tolist()) == Counter(glob.history_ids.tolist()), where
    again = to_global(states)
    kept = np.isin(glob.raw_ids, np.array(kept_ids, dtype=np.int64))
    assert again.raw_ids.tolist() == glob.raw_ids[kept].tolist(), where
    for mine, theirs in ((again.counts, glob.counts), (again.last_access, glob.last_access)):
        assert mine is None or np.array_equal(mine, theirs[kept]), where  # type: ignore[index]
    return states, all_moves


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_rebucket_places_every_id_where_the_new_world_size_routes_it(replay_seed, policy: str) -> None:
    rng = np.random.default_rng(replay_seed.value)
    for old_world in (1, 2, 3):
        for rows in (12, 37, 64):
            old = _states(rng, rows, old_world, policy, fill=float(rng.uniform(0.3, 1.0)))
            glob = to_global(list(reversed(old)))  # any order
            assert glob.num_embeddings == rows and np.all(np.diff(glob.raw_ids) > 0)
            for world in (1, 2, 3, 4):
                if min(np.diff(row_wise_segments(rows, world))) < 1:
                    continue
                states, moves = _check_rebucket(glob, world, replay_seed)
                if world == old_world:  # the same layout: nothing moves, nothing is dropped
                    assert all(np.array_equal(m.old_slots, m.new_slots) and m.dropped_raw_ids.size == 0 for m in moves)
                    assert all(np.array_equal(a.raw_ids, b.raw_ids) for a, b in zip(states, old))


def test_rebucket_keeps_the_most_counted_ids_when_a_shard_overflows() -> None:
    ids = np.arange(1, 12, dtype=np.int64)  # all in the first block of any world size below H / 12
    raw = np.full(12, FREE, dtype=np.int64)
    raw[:11] = ids
    counts = np.array([5, 1, 9, 2, 7, 3, 8, 4, 6, 0, 10, PINNED_COUNT], dtype=np.int64)
    one = McState("t", 0, raw, counts, None, 7, 6, np.zeros(0, np.int64), None, -1, (0, 12), H)
    s, m = rebucket(to_global([one]), 2, 0)  # 6 slots, 5 regular, 11 ids routed here
    assert sorted(m.raw_ids.tolist()) == [3, 5, 7, 9, 11]  # counts 9, 7, 8, 6, 10
    assert sorted(m.dropped_raw_ids.tolist()) == [1, 2, 4, 6, 8, 10]
    assert all(int(slot) < 5 for slot in m.new_slots) and s.counts is not None and s.counts[-1] == PINNED_COUNT
    s1, m1 = rebucket(to_global([one]), 2, 1)
    assert m1.raw_ids.size == 0 and np.all(s1.raw_ids == FREE) and m1.miss_old_slot == 11


def test_to_global_refuses_states_that_do_not_make_up_the_table(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    a, b = _states(rng, 24, 2, "distance_lfu")
    with pytest.raises(ManagedCollisionError, match="once each"):
        to_global([a])
    with pytest.raises(ManagedCollisionError, match="once each"):
        to_global([a, a])
    with pytest.raises(ManagedCollisionError, match="different iterations"):
        to_global([a, replace(b, current_iter=b.current_iter + 1)])
    held = a.held
    if held.size:
        wrong = a.raw_ids.copy()
        wrong[held[0]] = H - 1  # routed to rank 1
        with pytest.raises(ManagedCollisionError, match="routed to another rank"):
            to_global([replace(a, raw_ids=wrong), b])
    with pytest.raises(ManagedCollisionError, match="gets no rows"):
        rebucket(to_global([a, b]), 30, 29)


# --- capture's reuse of an earlier state ---------------------------------------------------------


def _module(policy: str, zch: int = 24):
    """One unsharded MCH module on the CPU (slots 0..zch-1), evicting every 3 training forwards."""
    import torch
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        LFU_EvictionPolicy,
        LRU_EvictionPolicy,
        MCHManagedCollisionModule,
    )

    policies = {"lfu": LFU_EvictionPolicy, "lru": LRU_EvictionPolicy, "distance_lfu": DistanceLFU_EvictionPolicy}
    mch = MCHManagedCollisionModule(
        zch_size=zch, device=torch.device("cpu"), eviction_policy=policies[policy](), eviction_interval=3, input_hash_size=1000
    )
    mch.train()
    return McShard("mc.t", "mc", "t", mch, ShardView("mc.t", 0, 0, torch.zeros(zch, 2)))


def _step(shard: McShard, rng: np.random.Generator) -> None:
    import torch
    from torchrec.sparse.jagged_tensor import JaggedTensor

    ids = torch.from_numpy(rng.integers(0, 120, size=10))
    shard.mch({"f": JaggedTensor(values=ids, lengths=torch.tensor([10]))})
    if shard.mch._evicted:
        shard.mch.evict()  # what the sharded module does once it reset the rows


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_capture_like_an_earlier_state_shares_its_slots_until_an_eviction(replay_seed, policy: str) -> None:
    rng = np.random.default_rng(replay_seed.value)
    shard = _module(policy)
    prev = capture(shard)
    shared = copied = 0
    for step in range(12):
        _step(shard, rng)
        evicted = shard.mch._last_eviction_iter == shard.mch._current_iter
        cur = capture(shard, like=prev)
        assert cur == capture(shard), f"{replay_seed}: step {step}"
        assert (cur.raw_ids is prev.raw_ids) == (not evicted), f"{replay_seed}: step {step}, eviction {evicted}"
        if not evicted:
            assert cur.counts is prev.counts and cur.last_access is prev.last_access, f"{replay_seed}: step {step}"
        shared += cur.raw_ids is prev.raw_ids
        copied += cur.raw_ids is not prev.raw_ids
        assert apply(prev, diff(prev, cur)) == cur
        prev = cur
    assert shared and copied


def test_capture_ignores_a_like_it_cannot_vouch_for(replay_seed) -> None:
    import torch

    rng = np.random.default_rng(replay_seed.value)
    shard, other = _module("distance_lfu"), _module("distance_lfu")
    for _ in range(4):
        _step(shard, rng)
        _step(other, rng)
    state = capture(shard)
    assert capture(shard, like=state).raw_ids is state.raw_ids
    assert capture(shard, like=capture(other)).raw_ids is not state.raw_ids  # another module's
    assert capture(shard, like=replace(state)).raw_ids is not state.raw_ids  # not one it read
    # a state-dict load writes the buffers without an eviction: the next capture reads them again
    before = {k: v.clone() for k, v in shard.mch.state_dict().items()}
    _step(shard, rng)
    _step(shard, rng)
    _step(shard, rng)  # an eviction
    moved = capture(shard)
    shard.mch.load_state_dict(before)
    after = capture(shard, like=moved)
    assert after.raw_ids is not moved.raw_ids and np.array_equal(after.raw_ids, state.raw_ids), str(replay_seed)
    # `load` writes a state: a capture like it shares its arrays, and reads back exactly
    load(shard, moved)
    back = capture(shard, like=moved)
    assert back.raw_ids is moved.raw_ids and back == moved
    with torch.no_grad():
        shard.mch._mch_metadata["counts"][0] += 1  # any in-place write
    assert capture(shard, like=back).raw_ids is not back.raw_ids
