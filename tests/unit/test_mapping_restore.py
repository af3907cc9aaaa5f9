"""A restore's managed-collision id mappings (ckpt/restore/mapping.py, ckpt/restore/replay.py) on
fake chains written by 2 ranks, restored as rank 1: an ordinary table, a managed-collision table
whose rows and mapping records (full and delta, cut into several frames) each link holds.

The full record then deltas fold to the state `apply` gives, whatever order the frames arrive
in; only this rank's mapping entries are read, and exactly the ranges the read ahead guesses;
a delta that does not follow, a base without a full record, a link with the rank's frames but
no record refused in one line naming the table and the link; another rank's survivor link
leaves the shard as the chain left it; a model without managed-collision tables reads exactly
what it read before; `check_mapping`'s refusals before any row is written; the restorer loads
the restored mapping into a live module.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch

from ckpt.log.chain_reads import chain_runs, written_by
from ckpt.log.markers import ChainLink, IndexEntry, Marker, OffsetRange
from ckpt.restore.mapping import MappingReplay, check_mapping
from ckpt.restore.replay import RowsRestored, frame_overlaps, restore_rows
from ckpt.stream.frames import FrameError, decode_frame, encode_frame
from ckpt.stream.mapping import MappingRecord, mapping_frames
from ckpt.types import RestoreError
from sharding.managed_collision import McShard, McState, apply, diff
from sharding.shard_views import ShardMap, ShardView
from tests.unit.test_managed_collision import POLICIES, _evolve, _grow, _states
from tests.unit.test_restore_rows import FP32, RUN, ListSource

KEY = "mc._embedding_module.embedding_bags.t"  # the managed-collision table
PLAIN = "t"  # an ordinary table
DIM, PLAIN_ROWS, MC_ROWS, WORLD, RANK = 4, 20, 30, 2, 1
MAX_FRAME = 256  # cuts a record into several frames
LOCATE = lambda g, p, o: f"{g}/{p}@{o}"  # noqa: E731


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


def _block(table: str, rows: int, rank: int) -> tuple[int, int]:
    per = -(-rows // WORLD)
    return rank * per, min((rank + 1) * per, rows)


@dataclass
class FakeChain:
    """Links written by WORLD ranks, each its own generation: frames by (generation, partition)
    and the reference rows after the links so far."""

    links: list[ChainLink] = field(default_factory=list)
    store: dict[tuple[int, int], list[bytes]] = field(default_factory=dict)
    weights: dict[str, torch.Tensor] = field(
        default_factory=lambda: {PLAIN: torch.zeros(PLAIN_ROWS, DIM), KEY: torch.zeros(MC_ROWS, DIM)}
    )

    def add(
        self,
        full: bool,
        records: dict[int, MappingRecord | None],
        g: torch.Generator,
        *,
        rows_of: tuple[int, ...] = tuple(range(WORLD)),
    ) -> None:
        """The next link: for each rank in `rows_of`, rows of both tables (all of its shards for a
        full link, a few for a delta), then its mapping record (`records`; None: none written)."""
        cid = len(self.links) + 1
        ranges, index = {}, []
        for rank in sorted(set(rows_of) | set(records)):
            frames: list[bytes] = []
            for table, n in ((PLAIN, PLAIN_ROWS), (KEY, MC_ROWS)):
                if rank not in rows_of:
                    continue
                lo, hi = _block(table, n, rank)
                rows = torch.arange(lo, hi) if full else torch.arange(lo, hi, 3)
                w = torch.randn(len(rows), DIM, generator=g)
                self.weights[table][rows] = w
                index.append(IndexEntry(rank, len(frames), len(frames), table, 0, int(rows[0]), int(rows[-1]), DIM))
                frames.append(encode_frame(run_id=RUN, checkpoint_id=cid, rank=rank, table=table, col_offset=0, dim=DIM,
                                           encoding=FP32, row_ids=rows, payload=w))  # fmt: skip
            record = records.get(rank)
            if record is not None:
                pieces = [
                    f.data for f in mapping_frames(record, run_id=RUN, checkpoint_id=cid, rank=rank, max_frame_bytes=MAX_FRAME)
                ]
                lo, hi = record.slot_offset, record.slot_offset + record.size - 1
                index.append(IndexEntry(rank, len(frames), len(frames) + len(pieces) - 1, KEY, 0, lo, hi, 0))
                frames.extend(pieces)
            if frames:
                ranges[rank] = [OffsetRange(0, len(frames) - 1)]
                self.store[(cid, rank)] = frames
        self.links.append(ChainLink(checkpoint_id=cid, full=full, generation=cid, ranges=ranges, rows=0, bytes=0, index=index))

    def marker(self) -> Marker:
        return Marker(kind="commit", run_id=RUN, checkpoint_id=len(self.links), step=10, world_size=WORLD, chain=self.links)


def _views() -> list[ShardView]:
    """Rank 1's shards of both tables, zeroed."""
    views = []
    for table, n in ((PLAIN, PLAIN_ROWS), (KEY, MC_ROWS)):
        lo, hi = _block(table, n, RANK)
        views.append(ShardView(table, lo, 0, torch.zeros(hi - lo, DIM)))
    return views


def _mc(views: list[ShardView]) -> list[McShard]:
    return [McShard(KEY, "mc", "t", None, next(v for v in views if v.table == KEY))]


class Recording(ListSource):
    """Remembers the range reads a restore asks for."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads: list = []

    def read_ranges(self, reads):
        self.reads = list(reads)
        return super().read_ranges(reads)


def _restore(chain: FakeChain, order: str = "forward", rng: random.Random | None = None, mc: bool = True):
    views = _views()
    source = Recording(chain.store, order, rng)
    out = restore_rows(chain.marker(), source, ShardMap(views, []), RUN, LOCATE, mc_shards=_mc(views) if mc else ())
    return out, views, source


def _chain(rng: np.random.Generator, g: torch.Generator, policy: str, links: int) -> tuple[FakeChain, list[list[McState]]]:
    """A base (full records) and `links - 1` deltas, one of them (the third link) written as a
    full record instead; states[rank][i]: each rank's state after link i."""
    states = [[s] for s in _states(rng, MC_ROWS, WORLD, policy)]
    chain = FakeChain()
    chain.add(True, {r: MappingRecord.of_state(states[r][0]) for r in range(WORLD)}, g)
    for i in range(1, links):
        records: dict[int, MappingRecord | None] = {}
        for r in range(WORLD):
            prev = states[r][-1]
            cur = (_grow if rng.random() < 0.4 else _evolve)(rng, prev, WORLD, r)
            states[r].append(cur)
            records[r] = (
                MappingRecord.of_state(cur)
                if i == 2
                else MappingRecord.of_delta(diff(prev, cur), i, cur.segments, cur.input_hash_size)
            )
        chain.add(False, records, g)
    return chain, states


# --- the fold ------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_full_record_then_deltas_fold_to_the_state_apply_gives_in_any_arrival_order(replay_seed, policy: str) -> None:
    rng = np.random.default_rng(replay_seed.value)
    chain, states = _chain(rng, torch.Generator().manual_seed(replay_seed.value), policy, 5)
    mine = chain.links[0].index
    assert any(e.is_mapping and e.last > e.first for e in mine), "a record cut into several frames"
    want = states[RANK][0]
    for prev, cur in zip(states[RANK], states[RANK][1:]):
        want = apply(want, diff(prev, cur))
    assert want == states[RANK][-1] and want != states[RANK][0]
    got = {}
    for order in ("forward", "reversed", "shuffled"):
        out, views, source = _restore(chain, order, random.Random(replay_seed.value))
        where = f"{replay_seed}: {policy}, {order}"
        assert set(out.mapping) == {KEY}, where
        assert out.mapping[KEY] == want, where
        for v in views:
            rows = slice(v.row_offset, v.row_offset + v.num_rows)
            assert torch.equal(v.weight, chain.weights[v.table][rows]), f"{where}: rows of {v.table}"
        mapping_frames_read = sum(
            e.last - e.first + 1 for link in chain.links for e in link.index if e.is_mapping and e.partition == RANK
        )
        assert out.frames == 2 * len(chain.links) + mapping_frames_read, where  # rank 0's frames never read
        got[order] = out.mapping[KEY]
    assert got["forward"] == got["reversed"] == got["shuffled"]


def test_only_this_ranks_mapping_entries_are_read_exactly_as_the_read_ahead_guesses(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    chain, _ = _chain(rng, torch.Generator().manual_seed(1), "lfu", 3)
    _, _, source = _restore(chain)
    assert source.reads == [run.read() for run in chain_runs(chain.marker(), written_by(RANK))], replay_seed
    assert all(r.partition == RANK for r in source.reads)


def test_a_chain_without_managed_collision_tables_reads_exactly_as_before(replay_seed) -> None:
    """No managed-collision shards: the reads are those of the rows' overlap alone (mapping
    entries, whoever's, are not read), and nothing is restored beyond the rows."""
    rng = np.random.default_rng(replay_seed.value)
    chain, _ = _chain(rng, torch.Generator().manual_seed(2), "lru", 3)
    views = _views()
    shard_map = ShardMap(views, [])

    def before(e: IndexEntry) -> bool:  # the restore's choice before mapping entries existed
        return any(frame_overlaps(s, e.col_offset, e.cols, e.min_row, e.max_row) for s in shard_map.of_table(e.table))

    out, views, source = _restore(chain, mc=False)
    assert source.reads == [run.read() for run in chain_runs(chain.marker(), before)]
    assert out.mapping == {} and out.frames == 2 * len(chain.links)
    assert all(torch.equal(v.weight, chain.weights[v.table][v.row_offset : v.row_offset + v.num_rows]) for v in views)
    # a chain without any mapping entry: the same reads and rows with or without the new argument
    plain = FakeChain()
    g = torch.Generator().manual_seed(3)
    plain.add(True, {}, g)
    plain.add(False, {}, g)
    a, _, reads_a = _restore(plain, mc=False)
    assert reads_a.reads == [run.read() for run in chain_runs(plain.marker(), before)]
    assert (a.frames, a.rows, a.written, a.mapping) == (4, 25 + 9, 25, {})


# --- refusals ------------------------------------------------------------------------------------


def _refusal(chain: FakeChain) -> str:
    with pytest.raises(RestoreError) as exc:
        _restore(chain)
    return _one_line(exc)


def test_a_delta_that_does_not_follow_the_previous_link_is_refused(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    states = _states(rng, MC_ROWS, WORLD, "distance_lfu")
    s1 = [_evolve(rng, s, WORLD, r) for r, s in enumerate(states)]
    s2 = [_evolve(rng, s, WORLD, r) for r, s in enumerate(s1)]
    g = torch.Generator().manual_seed(4)
    chain = FakeChain()
    chain.add(True, {r: MappingRecord.of_state(states[r]) for r in range(WORLD)}, g)
    chain.add(
        False,
        {r: MappingRecord.of_delta(diff(states[r], s1[r]), 1, s1[r].segments, s1[r].input_hash_size) for r in range(WORLD)},
        g,
    )
    # checkpoint 3's delta says it follows checkpoint 1, but the chain's state is checkpoint 2's
    chain.add(
        False, {r: MappingRecord.of_delta(diff(s1[r], s2[r]), 1, s2[r].segments, s2[r].input_hash_size) for r in range(WORLD)}, g
    )
    text = _refusal(chain)
    assert f"table {KEY} slots 15..29: link 2 of the chain (checkpoint 3): " in text, text
    assert "a delta from checkpoint 1, but the chain has the state of checkpoint 2" in text, text


def test_a_base_without_a_full_record_is_refused(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    states = _states(rng, MC_ROWS, WORLD, "lfu")
    nxt = [_evolve(rng, s, WORLD, r) for r, s in enumerate(states)]
    g = torch.Generator().manual_seed(5)
    delta_base = FakeChain()
    delta_base.add(
        True,
        {r: MappingRecord.of_delta(diff(states[r], nxt[r]), 9, nxt[r].segments, nxt[r].input_hash_size) for r in range(WORLD)},
        g,
    )
    base = f"table {KEY} slots 15..29: link 0 of the chain (checkpoint 1), the base,"
    assert _refusal(delta_base) == f"{base} holds a delta of the mapping (from checkpoint 9)"
    no_base = FakeChain()
    no_base.add(True, {0: MappingRecord.of_state(states[0])}, g)  # rank 1 wrote none
    assert _refusal(no_base) == f"{base} holds no mapping record of the shard"


def test_a_link_with_the_ranks_frames_but_no_record_is_refused_and_another_ranks_survivor_link_is_not(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    states = _states(rng, MC_ROWS, WORLD, "lru")
    g = torch.Generator().manual_seed(6)
    chain = FakeChain()
    chain.add(True, {r: MappingRecord.of_state(states[r]) for r in range(WORLD)}, g)
    # a survivor snapshot of rank 0 (its partition only): rank 1's shard stays as the chain left it
    chain.add(False, {0: MappingRecord.of_state(_evolve(rng, states[0], WORLD, 0))}, g, rows_of=(0,))
    out, _, _ = _restore(chain)
    assert out.mapping[KEY] == states[RANK]
    chain.add(False, {0: MappingRecord.of_state(states[0]), 1: None}, g)  # rank 1 wrote rows but no mapping
    assert _refusal(chain) == (
        f"table {KEY} slots 15..29: link 2 of the chain (checkpoint 3) holds frames of rank 1 but no mapping record of the shard"
    )


def test_a_mapping_frame_where_the_index_has_rows_is_refused_where_it_is(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    chain, _ = _chain(rng, torch.Generator().manual_seed(7), "lfu", 1)
    link = chain.links[0]
    mapping_entry = next(e for e in link.index if e.is_mapping and e.partition == RANK)
    link.index = [e._replace(cols=DIM) if e is mapping_entry else e for e in link.index]  # the index says rows there
    with pytest.raises(FrameError) as exc:
        _restore(chain)
    held = f"frame holds a piece of an id mapping of table {KEY}"
    assert _one_line(exc) == f"1/1@{mapping_entry.first}: {held}, where its COMMIT marker's index has rows"


def test_the_replay_refuses_a_frame_it_does_not_restore() -> None:
    views = _views()
    replay = MappingReplay(_mc(views))
    rows = decode_frame(encode_frame(run_id=RUN, checkpoint_id=1, rank=1, table=KEY, col_offset=0, dim=DIM, encoding=FP32,
                                     row_ids=torch.arange(2), payload=torch.ones(2, DIM)))  # fmt: skip
    link = ChainLink(checkpoint_id=1, full=True, generation=1, ranges={}, rows=0, bytes=0)
    with pytest.raises(RestoreError) as exc:
        replay.add(0, link, 1, rows)
    assert _one_line(exc) == f"checkpoint 1: a frame of rows of table {KEY} in partition 1 is not a mapping this rank restores"


# --- check_mapping: before any row is written ---------------------------------------------------


def test_check_mapping_refuses_what_this_job_cannot_restore_in_one_line(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    chain, _ = _chain(rng, torch.Generator().manual_seed(8), "lfu", 2)
    marker = chain.marker()
    check_mapping(marker, {KEY: MC_ROWS}, WORLD)  # fine
    where = f"checkpoint 2 of run {RUN}"
    cases = {
        # a mapping of a table this model does not manage
        f"{where} holds the id mapping of table {KEY}, which this model does not manage "
        "(a managed-collision table there, an ordinary one or none here)": (marker, {}, WORLD),
    }
    # a managed table whose base holds no mapping: written before the model managed its ids
    plain = FakeChain()
    plain.add(True, {}, torch.Generator().manual_seed(9))
    cases[
        f"checkpoint 1 of run {RUN} holds no id mapping of table {KEY}, whose ids this model manages, in its base "
        "(checkpoint 1): it was written before the model managed them"
    ] = (plain.marker(), {KEY: MC_ROWS}, WORLD)
    # a later link of another slot layout (the chain crossed a world size change): 3 ranks wrote it
    moved = replace(marker, chain=[*marker.chain[:1], replace(marker.chain[1], ranges={0: [], 1: [], 2: []}, index=[
        IndexEntry(p, 0, 0, KEY, 0, lo, hi, 0) for p, (lo, hi) in enumerate([(0, 9), (10, 19), (20, 29)])])])  # fmt: skip
    cases[
        f"{where}: link 1 (checkpoint 2) holds the id mapping of table {KEY} slots 0..9, no shard of its 30 rows over "
        "2 ranks: it was written by another world size or slot layout; restore it on 3 ranks"
    ] = (moved, {KEY: MC_ROWS}, WORLD)
    for says, (m, managed, world) in cases.items():
        with pytest.raises(RestoreError) as exc:
            check_mapping(m, managed, world)
        assert _one_line(exc) == says


# --- the restorer loads what the replay restored ---------------------------------------------------


def test_the_restorer_loads_the_restored_mapping_into_the_live_module_and_refuses_one_that_does_not_fit(replay_seed) -> None:
    from ckpt.restore.restorer import Restorer
    from sharding.managed_collision import capture
    from tests.unit.test_managed_collision import _module, _step

    rng = np.random.default_rng(replay_seed.value)
    trained, fresh = _module("lfu"), _module("lfu")
    for _ in range(7):
        _step(trained, rng)
    state = capture(trained)
    restorer = object.__new__(Restorer)  # only what `_load_mapping` reads
    restorer.mc_shards = [fresh]
    restorer._load_mapping(RowsRestored(mapping={fresh.key: state}))
    assert capture(fresh) == state, replay_seed
    other = _module("lfu", zch=16)
    restorer.mc_shards = [other]
    with pytest.raises(RestoreError) as exc:
        restorer._load_mapping(RowsRestored(mapping={other.key: state}))
    assert _one_line(exc).startswith("table mc.t: the restored id mapping does not fit this job's module: state of table mc.t")
