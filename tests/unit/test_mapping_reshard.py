"""A restore of managed-collision id mappings onto another world size (ckpt/restore/mapping.py,
ckpt/restore/replay.py) on fake chains written by 2 ranks (tests/unit/test_mapping_restore.py's
`FakeChain`: an ordinary table and a managed-collision table, rows and mapping records, full and
delta, cut into several frames), restored on 1 and on 3 ranks.

Every rank reads every old shard's mapping records, folds them, joins and rebuckets them: its
state is `rebucket`'s of the chain's final states; each kept id's row (and the miss row) is the
row its old slot held after the chain, whoever wrote it, and no other row of the shard is
written; every id the 2 ranks held is held by the rank it now routes to or reported dropped, in
one log line; only the rows entries holding those old slots are read. The same world size reads
and restores exactly as before. Refused in one line: a base whose mapping lacks a shard, a moved
id's row in no link. The restorer says which tables moved, and makes the next checkpoint full.
"""

from __future__ import annotations

import logging
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from ckpt.log.chain_reads import chain_runs
from ckpt.log.markers import IndexEntry, Marker
from ckpt.restore.mapping import check_mapping
from ckpt.restore.replay import RowsRestored, restore_rows
from ckpt.stream.mapping import MappingRecord
from ckpt.types import RestoreError
from sharding.managed_collision import FREE, McShard, McState, diff, rebucket, row_wise_segments, to_global
from sharding.shard_views import ShardMap, ShardView
from tests.unit.test_managed_collision import POLICIES, _evolve, _grow, _states
from tests.unit.test_mapping_restore import DIM, KEY, LOCATE, MC_ROWS, PLAIN, PLAIN_ROWS, RUN, WORLD, FakeChain, Recording

ROWS = {PLAIN: PLAIN_ROWS, KEY: MC_ROWS}


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


def _in_step(states: list[McState], like: McState) -> list[McState]:
    """The shards at one eviction phase, as every rank is after the same training step."""
    return [replace(s, last_eviction_iter=like.last_eviction_iter) for s in states]


def _chain(
    rng: np.random.Generator, g: torch.Generator, policy: str, links: int, fill: float = 0.8
) -> tuple[FakeChain, list[McState]]:
    """A base (full records) and `links - 1` deltas (the third link a full record), written by
    WORLD ranks in step; returns the chain and each old rank's final state."""
    states = _in_step(_states(rng, MC_ROWS, WORLD, policy, fill), _states(rng, MC_ROWS, WORLD, policy)[0])
    chain = FakeChain()
    chain.add(True, {r: MappingRecord.of_state(states[r]) for r in range(WORLD)}, g)
    for i in range(1, links):
        step = _grow if rng.random() < 0.4 else _evolve
        cur = [step(rng, s, WORLD, r) for r, s in enumerate(states)]
        cur = _in_step(cur, cur[0])
        records = {
            r: MappingRecord.of_state(cur[r])
            if i == 2
            else MappingRecord.of_delta(diff(states[r], cur[r]), i, cur[r].segments, cur[r].input_hash_size)
            for r in range(WORLD)
        }
        chain.add(False, records, g)
        states = cur
    return chain, states


def _views(world: int, rank: int, tables: tuple[str, ...] = (PLAIN, KEY)) -> list[ShardView]:
    """Rank `rank`'s shards of the tables over `world` ranks (torchrec's row-wise rule), zeroed."""
    views = []
    for table in tables:
        segs = row_wise_segments(ROWS[table], world)
        views.append(ShardView(table, segs[rank], 0, torch.zeros(segs[rank + 1] - segs[rank], DIM)))
    return views


def _restore(marker: Marker, store: dict, world: int, rank: int, tables: tuple[str, ...] = (PLAIN, KEY), order: str = "forward"):
    views = _views(world, rank, tables)
    mc = [McShard(KEY, "mc", "t", None, next(v for v in views if v.table == KEY))]
    source = Recording(store, order, random.Random(rank))
    out = restore_rows(marker, source, ShardMap(views, []), RUN, LOCATE, mc_shards=mc, world_size=world)
    return out, views, source


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_each_rank_of_another_world_size_holds_the_ids_routed_to_it_each_with_its_own_row(
    replay_seed, policy: str, world: int
) -> None:
    rng = np.random.default_rng(replay_seed.value)
    chain, finals = _chain(rng, torch.Generator().manual_seed(replay_seed.value), policy, 4)
    marker = chain.marker()
    check_mapping(marker, {KEY: MC_ROWS}, world)  # a whole mapping moves
    glob = to_global(finals)
    held: list[np.ndarray] = []
    dropped: list[np.ndarray] = []
    for rank in range(world):
        where = f"{replay_seed}: {policy}, rank {rank} of {world}"
        out, views, source = _restore(marker, chain.store, world, rank, order=("forward", "reversed", "shuffled")[rank % 3])
        want, moves = rebucket(glob, world, rank)
        assert out.resharded == [KEY] and set(out.mapping) == {KEY}, where
        assert out.mapping[KEY] == want, where
        assert out.dropped == {KEY: moves.dropped_raw_ids.size}, where
        plain, mc = views
        lo = plain.row_offset
        assert torch.equal(plain.weight, chain.weights[PLAIN][lo : lo + plain.num_rows]), f"{where}: the ordinary table"
        # each kept id's row from its old slot, the miss row from the old miss slot, nothing else written
        expected = torch.zeros_like(mc.weight)
        new = np.append(moves.new_slots, moves.miss_new_slot) - mc.row_offset
        old = np.append(moves.old_slots, moves.miss_old_slot)
        expected[torch.from_numpy(new)] = chain.weights[KEY][torch.from_numpy(old)]
        assert torch.equal(mc.weight, expected), f"{where}: rows of the moved ids"
        assert out.held is not None and out.link_of is not None
        want_held = torch.zeros(mc.num_rows, dtype=torch.bool)
        want_held[torch.from_numpy(new)] = True
        assert torch.equal(out.held[1], want_held), where
        assert torch.equal(out.held[0], torch.ones(plain.num_rows, dtype=torch.bool)), where

        # the rows read last: the ordinary shard's, and of the moved table only the entries holding an old slot
        def rows_wanted(e: IndexEntry, old: np.ndarray = old, lo: int = lo, n: int = plain.num_rows) -> bool:
            if e.is_mapping:
                return False
            if e.table == KEY:
                return bool(np.any((old >= e.min_row) & (old <= e.max_row)))
            return e.min_row < lo + n and e.max_row >= lo

        assert source.reads == [run.read() for run in chain_runs(marker, rows_wanted)], where
        assert out.rows >= old.size + plain.num_rows, where  # each moved row at least once (the base)
        state = out.mapping[KEY]
        held.append(state.raw_ids[state.raw_ids != FREE])
        dropped.append(moves.dropped_raw_ids)
    every = np.sort(np.concatenate(held + dropped))
    assert np.array_equal(every, glob.raw_ids), f"{replay_seed}: every id held by the 2 ranks is held or dropped once"


def test_ids_a_smaller_shard_has_no_room_for_are_dropped_in_one_log_line(replay_seed, caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(replay_seed.value)
    chain, finals = _chain(rng, torch.Generator().manual_seed(1), "lfu", 1, fill=1.0)  # 28 ids, 27 slots on 3 ranks
    glob = to_global(finals)
    assert glob.raw_ids.size > 3 * (MC_ROWS // 3 - 1)
    lines = []
    for rank in range(3):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ckpt.restore.mapping"):
            out, _, _ = _restore(chain.marker(), chain.store, 3, rank)
        _, moves = rebucket(glob, 3, rank)
        records = [r for r in caplog.records if r.name == "ckpt.restore.mapping"]
        if moves.dropped_raw_ids.size:
            assert len(records) == 1, replay_seed
            text = records[0].getMessage()
            assert text.startswith(f"table {KEY}: {moves.dropped_raw_ids.size} of the ids its mapping held are dropped"), text
            lines.append(text)
        else:
            assert not records, replay_seed
        assert out.dropped[KEY] == moves.dropped_raw_ids.size
    assert lines, f"{replay_seed}: some rank dropped ids"


def test_the_same_world_size_reads_and_restores_exactly_as_before(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    chain, finals = _chain(rng, torch.Generator().manual_seed(2), "distance_lfu", 3)
    implicit, views_a, reads_a = _restore(chain.marker(), chain.store, WORLD, 1)
    views = _views(WORLD, 1)
    mc = [McShard(KEY, "mc", "t", None, views[1])]
    reads_b = Recording(chain.store, "forward", None)
    before = restore_rows(chain.marker(), reads_b, ShardMap(views, []), RUN, LOCATE, mc_shards=mc)  # no world size given
    assert reads_a.reads == reads_b.reads
    assert all(r.partition == 1 for r in reads_a.reads)
    assert implicit.resharded == [] and implicit.dropped == {}
    assert implicit.mapping[KEY] == before.mapping[KEY] == finals[1]
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(views_a, views))


def test_a_mapping_that_cannot_move_is_refused_in_one_line(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    g = torch.Generator().manual_seed(3)
    states = _states(rng, MC_ROWS, WORLD, "lru")
    # a base whose mapping lacks rank 1's shard: refused before any row is written, and by the fold
    partial = FakeChain()
    partial.add(True, {0: MappingRecord.of_state(states[0])}, g)
    with pytest.raises(RestoreError) as exc:
        check_mapping(partial.marker(), {KEY: MC_ROWS}, 3)
    assert _one_line(exc) == (
        f"checkpoint 1 of run {RUN}: its base (checkpoint 1) lacks the id mapping of table {KEY} slots 15..29: the mapping "
        "is incomplete and cannot move from 2 to 3 ranks"
    )
    with pytest.raises(RestoreError) as exc:
        _restore(partial.marker(), partial.store, 3, 0)
    assert (
        _one_line(exc)
        == f"table {KEY} slots 15..29: link 0 of the chain (checkpoint 1), the base, holds no mapping record of the shard"
    )
    # shards out of step (one rank's state of another eviction phase): no whole mapping to move
    skew = FakeChain()
    skew.add(
        True, {0: MappingRecord.of_state(states[0]), 1: MappingRecord.of_state(replace(states[1], last_eviction_iter=-1))}, g
    )
    with pytest.raises(RestoreError) as exc:
        _restore(skew.marker(), skew.store, 1, 0)
    assert (
        _one_line(exc)
        == f"table {KEY}: its id mapping cannot move to 1 ranks: table {KEY}: the shards are at different iterations"
    )
    # a moved id whose row no link holds (rank 1 wrote its mapping but no rows)
    rowless = FakeChain()
    rowless.add(True, {r: MappingRecord.of_state(s) for r, s in enumerate(_in_step(states, states[0]))}, g, rows_of=(0,))
    with pytest.raises(RestoreError) as exc:
        _restore(rowless.marker(), rowless.store, 1, 0, tables=(KEY,))
    text = _one_line(exc)
    assert text.startswith(f"checkpoint 1: table {KEY}: ") and "rows of ids moving to this rank's shard" in text, text
    assert text.endswith("are in no link of the chain"), text


def test_the_restorer_names_the_moved_tables_and_makes_the_next_checkpoint_full(replay_seed) -> None:
    from ckpt.restore.restorer import _moved_tables

    rng = np.random.default_rng(replay_seed.value)
    chain, _ = _chain(rng, torch.Generator().manual_seed(4), "lfu", 2)
    marker = chain.marker()
    assert _moved_tables(marker, WORLD) == ()
    assert _moved_tables(marker, 3) == _moved_tables(marker, 1) == (KEY,)
    assert RowsRestored().resharded == [] and RowsRestored().dropped == {}
