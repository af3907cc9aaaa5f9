"""The readers of a stream that carries managed-collision mapping frames beside the rows.

Chains are written to a filesystem sink as ranks would write them (each rank's rows, then its
shard's mapping record, indexed with ``cols`` 0), over random shard states (seed printed):
- the follower's `RowStore` fed them holds, after every link, the state the records give
  (full, incremental and one-shot-diff chains, a compaction's rebase), and refuses a delta
  that follows a checkpoint it does not hold, a record left part way and a missing shard;
- a compacted baseline writes the rows and one full record per shard, which read back equal;
- `assemble` (export, serving snapshots, `deltarec-ckpt verify`) gives the same tables with
  and without the mapping frames;
- the read ahead's reads are the restore's (`restore_rows`' own) on links with mapping entries;
- a stream without mapping frames is read exactly as before.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from ckpt.cli import _folding_mapping
from ckpt.follow.compact import write_compacted
from ckpt.follow.follower import _frame_bytes
from ckpt.follow.store import MappingStore, RowStore
from ckpt.log.frames_ahead import read_frames_ahead
from ckpt.log.markers import ChainLink, FrameMeta, IndexEntry, Marker, OffsetRange, index_frames
from ckpt.quant import get_codec
from ckpt.restore.export import assemble
from ckpt.restore.replay import iter_chain_frames, iter_link_frames, restore_rows
from ckpt.stream.filesystem import FsSink, FsSource
from ckpt.stream.frames import OptimState, chunk_rows
from ckpt.stream.mapping import MappingRecord, mapping_frames, record_for
from ckpt.stream.sink import RangeRead
from ckpt.types import RestoreError
from sharding.managed_collision import McShard, McState, diff
from sharding.shard_views import ShardMap, ShardView
from tests.unit.test_managed_collision import _evolve, _grow, _states

if TYPE_CHECKING:
    from tests.conftest import ReplaySeed

RUN = "r"
MC = "mc._embedding_module.embedding_bags.t"  # the table `_states` makes
PLAIN = "u"
WORLD = 2
MC_ROWS, PLAIN_ROWS, DIM = 200, 40, 4
TABLES = {MC: [MC_ROWS, DIM], PLAIN: [PLAIN_ROWS, DIM]}
FP32 = get_codec("fp32")
FRAME_BYTES = 1024  # small: a shard's mapping record spans several frames


def _locate(generation: int, partition: int, pos: int) -> str:
    return f"g{generation}/p{partition}@{pos}"


def _block(rows: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s row-wise block of a table (torchrec's: ceil(rows / world) a rank)."""
    size = -(-rows // WORLD)
    return min(rank * size, rows), min((rank + 1) * size, rows)


class Writer:
    """Checkpoints as `WORLD` ranks write them into one filesystem sink: per rank its rows of
    each table (random ids for a delta, all of its block for a full one; weights drawn from
    the checkpoint and rank alone, so two writers write the same rows), then, when `mapping`,
    its shard's mapping record; one generation per checkpoint."""

    def __init__(self, root: Path, mapping: bool = True) -> None:
        self.root = root
        self.mapping = mapping
        self.sink = FsSink(root, RUN)

    def link(self, cid: int, full: bool, records: dict[int, MappingRecord]) -> ChainLink:
        meta: dict[int, list[FrameMeta]] = {}
        rows = nbytes = 0
        for rank in range(WORLD):
            g = torch.Generator().manual_seed(1000 * cid + rank)
            for table, (n, dim) in TABLES.items():
                lo, hi = _block(n, rank)
                ids = torch.arange(lo, hi) if full else torch.unique(torch.randint(lo, hi, (5,), generator=g))
                weights = torch.randn(ids.numel(), dim, generator=g)
                momentum = torch.rand(ids.numel(), 1, generator=g)
                for encoded in chunk_rows(
                    run_id=RUN, checkpoint_id=cid, rank=rank, table=table, col_offset=0, dim=dim,
                    encoding=FP32.code, row_ids=ids, payload=FP32.encode(weights),
                    optim=(OptimState("momentum", FP32.code, FP32.encode(momentum)),), max_frame_bytes=FRAME_BYTES,
                ):  # fmt: skip
                    self.sink.write(encoded.data, generation=cid, partition=rank)
                    meta.setdefault(rank, []).append(FrameMeta(table, 0, encoded.first_row, encoded.last_row, dim))
                    nbytes += len(encoded.data)
                rows += ids.numel()
            if self.mapping:
                for encoded in mapping_frames(
                    records[rank], run_id=RUN, checkpoint_id=cid, rank=rank, max_frame_bytes=FRAME_BYTES
                ):
                    self.sink.write(encoded.data, generation=cid, partition=rank)
                    meta.setdefault(rank, []).append(FrameMeta(MC, 0, encoded.first_row, encoded.last_row, 0))
                    nbytes += len(encoded.data)
        result = self.sink.flush(10).raise_for_error()
        index = [e for p, m in sorted(meta.items()) for e in index_frames(p, result.positions[(cid, p)], m)]
        ranges = {p: [OffsetRange(*r) for r in result.ranges[(cid, p)]] for p in meta}
        return ChainLink(checkpoint_id=cid, full=full, generation=cid, ranges=ranges, rows=rows, bytes=nbytes, index=index)

    def source(self) -> FsSource:
        return FsSource(self.root, RUN)

    def close(self) -> None:
        self.sink.close()


def _history(rng: np.random.Generator, checkpoints: int) -> list[list[McState]]:
    """`states[c][rank]`: each rank's shard state at checkpoints 1..`checkpoints` (index 0 unused)."""
    first = _states(rng, MC_ROWS, WORLD, "distance_lfu")
    states: list[list[McState]] = [first, first]
    for _ in range(checkpoints - 1):
        states.append([(_grow if rng.random() < 0.5 else _evolve)(rng, s, WORLD, rank) for rank, s in enumerate(states[-1])])
    return states


def _marker(cid: int, chain: list[ChainLink]) -> Marker:
    return Marker(kind="commit", run_id=RUN, checkpoint_id=cid, step=cid, world_size=WORLD, chain=chain, tables=TABLES)


def _feed(store: RowStore, link: ChainLink, source: FsSource) -> None:
    """What the follower does with one link (`Follower._apply`)."""
    if link.full:
        store.reset()
    for frame in iter_link_frames(link, source, RUN, _locate):
        store.apply(frame, frame.rank, TABLES[frame.table][0])


def _held(store: RowStore) -> dict[int, tuple[McState, int]]:
    return {key.partition: (s.state, s.at) for key, s in store.mapping.shards.items() if key.table == MC}


def _rows(store: RowStore) -> dict[tuple[str, int], tuple[int, int, bytes, bytes]]:
    """Every row the store would compact: its partition, codec and encoded bytes."""
    out = {}
    for f in store.frames(RUN, 1):
        for j, i in enumerate(f.row_ids.tolist()):
            out[f.table, i] = (f.rank, f.encoding, f.payload[j].numpy().tobytes(), f.optim[0].rows[j].numpy().tobytes())
    return out


# --- the store -----------------------------------------------------------------------------------


def test_the_store_holds_the_mapping_an_incremental_chain_gives(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    states = _history(rng, 6)
    writer = Writer(tmp_path)
    store, chain, deltas = RowStore(), [], 0
    for cid in range(1, 7):
        records = {r: record_for(None if cid == 1 else states[cid - 1][r], states[cid][r], cid - 1) for r in range(WORLD)}
        deltas += sum(not rec.full for rec in records.values())
        chain.append(writer.link(cid, cid == 1, records))
        _feed(store, chain[-1], writer.source())
        if cid == 1:
            store.check_complete(1)
            assert store.mapping.base_id == 1
        assert _held(store) == {r: (states[cid][r], cid) for r in range(WORLD)}, f"checkpoint {cid}: {replay_seed}"
    writer.close()
    assert deltas, f"the chain wrote no delta record: {replay_seed}"
    store.check_complete(6)
    assert [rec.state for _, rec in store.mapping_records()] == states[6]
    assert store.nbytes > sum(s.nbytes for s in store.shards.values())  # the mapping counts


def test_a_one_shot_diff_applies_to_the_base_and_a_rebase_moves_it(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    states = _history(rng, 4)
    writer = Writer(tmp_path)

    def diff_of(cid: int, base: int) -> dict[int, MappingRecord]:
        return {r: _diff_record(states[base][r], states[cid][r], base) for r in range(WORLD)}

    full = writer.link(1, True, {r: MappingRecord.of_state(states[1][r]) for r in range(WORLD)})
    d2, d3 = writer.link(2, False, diff_of(2, 1)), writer.link(3, False, diff_of(3, 1))  # both from the base
    store = RowStore()
    for link in (full, d2, d3):  # the follower applies a diff of the same base over the previous one
        _feed(store, link, writer.source())
    assert _held(store) == {r: (states[3][r], 3) for r in range(WORLD)}, str(replay_seed)
    store.mapping.rebase(3)  # a compaction of checkpoint 3: the next diffs are of it
    _feed(store, writer.link(4, False, diff_of(4, 3)), writer.source())
    assert _held(store) == {r: (states[4][r], 4) for r in range(WORLD)}, str(replay_seed)
    # a full record in a delta link is the state, whatever came before
    _feed(store, writer.link(5, False, {r: MappingRecord.of_state(states[2][r]) for r in range(WORLD)}), writer.source())
    assert _held(store) == {r: (states[2][r], 5) for r in range(WORLD)}
    writer.close()


def _diff_record(old: McState, new: McState, follows: int) -> MappingRecord:
    """The delta record from `old` (the state of checkpoint `follows`) to `new`, whatever its size."""
    return MappingRecord.of_delta(diff(old, new), follows, new.segments, new.input_hash_size)


def test_a_delta_of_a_checkpoint_the_store_does_not_hold_is_refused(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    states = _history(rng, 3)
    writer = Writer(tmp_path)
    full = writer.link(1, True, {r: MappingRecord.of_state(states[1][r]) for r in range(WORLD)})
    skipping = writer.link(3, False, {r: _diff_record(states[2][r], states[3][r], 2) for r in range(WORLD)})
    store = RowStore()
    _feed(store, full, writer.source())
    with pytest.raises(RestoreError, match=f"table {MC} partition 0: its mapping is a delta from checkpoint 2, the store "
                                           "holds the mapping of checkpoint 1") as e:  # fmt: skip
        _feed(store, skipping, writer.source())
    assert "\n" not in str(e.value)
    writer.close()


def test_a_missing_shard_or_a_record_left_part_way_is_refused(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    states = _history(rng, 1)
    writer = Writer(tmp_path)
    link = writer.link(1, True, {r: MappingRecord.of_state(states[1][r]) for r in range(WORLD)})
    frames = list(iter_link_frames(link, writer.source(), RUN, _locate))
    writer.close()
    rank1 = [f for f in frames if f.is_mapping and f.rank == 1]
    assert len(rank1) > 1, "the record spans several frames"
    store = RowStore()
    for f in frames:
        if not (f.is_mapping and f.rank == 1):
            store.apply(f, f.rank, TABLES[f.table][0])
    lo, hi = _block(MC_ROWS, 1)
    with pytest.raises(RestoreError, match=f"table {MC}: the chain holds the mapping of slots 0..{lo - 1}, its shards are "
                                           f"0..{lo - 1}, {lo}..{hi - 1}"):  # fmt: skip
        store.check_complete(1)
    store.apply(rank1[0], 1, MC_ROWS)
    with pytest.raises(RestoreError, match=f"partition 1: the mapping record of checkpoint 1 has 1 of its {len(rank1)} frames"):
        store.check_complete(1)
    with pytest.raises(RestoreError, match="ended after 1 of its"):
        store.apply(rank1[0], 1, MC_ROWS)
    store.reset()
    assert not store.mapping.shards and store.mapping.base_id is None
    with pytest.raises(RestoreError, match=f"its mapping is of {MC_ROWS} slots, the table has 300 rows"):
        for f in rank1:
            store.apply(f, 1, 300)


def test_a_stream_without_mapping_frames_is_followed_and_compacted_as_before(tmp_path: Path) -> None:
    writer = Writer(tmp_path / "rows", mapping=False)
    store = RowStore()
    for cid in (1, 2, 3):
        _feed(store, writer.link(cid, cid == 1, {}), writer.source())
    writer.close()
    store.check_complete(3)
    assert store.mapping.shards == {} and store.mapping_records() == []
    assert store.nbytes == sum(s.nbytes for s in store.shards.values())
    sink = FsSink(tmp_path / "compacted", RUN)
    link = write_compacted(store, sink=sink, run_id=RUN, checkpoint_id=3, generation=9, max_frame_bytes=FRAME_BYTES,
                           flush_timeout_s=10)  # fmt: skip
    sink.close()
    assert not any(e.is_mapping for e in link.index)
    frames = list(iter_link_frames(link, FsSource(tmp_path / "compacted", RUN), RUN, _locate))
    assert frames and not any(f.is_mapping for f in frames)
    back = RowStore()
    _feed(back, link, FsSource(tmp_path / "compacted", RUN))
    assert _rows(back) == _rows(store) and back.mapping.shards == {}


# --- compaction ----------------------------------------------------------------------------------


def test_a_compacted_baseline_holds_the_rows_and_a_full_mapping_that_read_back_equal(
    tmp_path: Path, replay_seed: ReplaySeed
) -> None:
    rng = np.random.default_rng(replay_seed.value)
    states = _history(rng, 4)
    writer = Writer(tmp_path / "chain")
    store, chain = RowStore(), []
    for cid in range(1, 5):
        records = {r: record_for(None if cid == 1 else states[cid - 1][r], states[cid][r], cid - 1) for r in range(WORLD)}
        chain.append(writer.link(cid, cid == 1, records))
        _feed(store, chain[-1], writer.source())
    writer.close()
    sink = FsSink(tmp_path / "compacted", RUN)
    link = write_compacted(store, sink=sink, run_id=RUN, checkpoint_id=4, generation=99, max_frame_bytes=FRAME_BYTES,
                           flush_timeout_s=10)  # fmt: skip
    sink.close()
    mapping_entries = [e for e in link.index if e.is_mapping]
    assert [(e.partition, e.table, e.min_row, e.max_row) for e in mapping_entries] == [
        (r, MC, s.slot_offset, s.slot_offset + s.size - 1) for r, s in enumerate(states[4])
    ]
    compacted = FsSource(tmp_path / "compacted", RUN)
    back = RowStore()
    _feed(back, link, compacted)
    back.check_complete(4)
    assert _held(back) == {r: (states[4][r], 4) for r in range(WORLD)}, str(replay_seed)
    assert _rows(back) == _rows(store)
    assert all(rec.full for _, rec in back.mapping_records())
    # what `deltarec-ckpt verify` compares: the compacted baseline's tables and mapping, the chain's
    got_mapping, want_mapping = MappingStore(), MappingStore()
    source = FsSource(tmp_path / "chain", RUN)

    def tables(marker: Marker, src: FsSource, mapping: MappingStore) -> dict[str, dict[str, torch.Tensor]]:
        frames = ((lk.full, f) for lk, f in iter_chain_frames(marker, src, RUN, _locate))
        return assemble(marker, _folding_mapping(marker, frames, mapping))

    got, want = tables(_marker(4, [link]), compacted, got_mapping), tables(_marker(4, chain), source, want_mapping)
    _same_tables(got, want)
    assert got_mapping.records() == want_mapping.records() and len(want_mapping.records()) == WORLD


def test_the_follower_counts_a_mapping_frame_by_its_piece(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    states = _history(np.random.default_rng(replay_seed.value), 1)
    writer = Writer(tmp_path)
    record = MappingRecord.of_state(states[1][0])
    link = writer.link(1, True, {r: MappingRecord.of_state(states[1][r]) for r in range(WORLD)})
    frames = [f for f in iter_link_frames(link, writer.source(), RUN, _locate) if f.is_mapping and f.rank == 0]
    writer.close()
    assert sum(_frame_bytes(f) for f in frames) == record.nbytes


# --- export --------------------------------------------------------------------------------------


def _same_tables(got: dict[str, dict[str, torch.Tensor]], want: dict[str, dict[str, torch.Tensor]]) -> None:
    assert got.keys() == want.keys()
    for table, tensors in want.items():
        assert got[table].keys() == tensors.keys(), table
        for name, value in tensors.items():
            assert torch.equal(got[table][name], value), (table, name)


def test_a_chain_with_mapping_frames_exports_the_rows_of_the_same_chain_without(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    states = _history(rng, 3)
    markers = {}
    for name, mapping in (("with", True), ("without", False)):
        writer = Writer(tmp_path / name, mapping)
        chain = [
            writer.link(cid, cid == 1, {r: MappingRecord.of_state(states[cid][r]) for r in range(WORLD)}) for cid in (1, 2, 3)
        ]
        writer.close()
        markers[name] = _marker(3, chain)
    assert any(e.is_mapping for link in markers["with"].chain for e in link.index)

    def tables(name: str) -> dict[str, dict[str, torch.Tensor]]:
        frames = iter_chain_frames(markers[name], FsSource(tmp_path / name, RUN), RUN, _locate)
        return assemble(markers[name], ((link.full, f) for link, f in frames))

    _same_tables(tables("with"), tables("without"))


# --- the read ahead ------------------------------------------------------------------------------


def _shards(world: int, rank: int) -> list[ShardView]:
    out = []
    for table, (rows, cols) in TABLES.items():
        size = -(-rows // world)
        lo, hi = min(rank * size, rows), min((rank + 1) * size, rows)
        out.append(ShardView(table, lo, 0, torch.zeros(hi - lo, cols)))
    return out


def _entries_link(cid: int, rng: random.Random, mapping_at: Callable[[int], int]) -> ChainLink:
    """Checkpoint `cid` as ranks write it with a managed-collision table: each rank's row entries
    (one or more per table) with its mapping entry at position `mapping_at(rank)` among them."""
    index, ranges = [], {}
    for rank in range(WORLD):
        pos = first = rng.randint(0, 5)
        rows = []
        for s in _shards(WORLD, rank):
            for _ in range(rng.randint(1, 3)):
                lo = rng.randint(s.row_offset, s.row_offset + s.num_rows - 1)
                rows.append((s.table, lo, rng.randint(lo, s.row_offset + s.num_rows - 1), s.num_cols))
        mc = next(s for s in _shards(WORLD, rank) if s.table == MC)
        rows.insert(min(mapping_at(rank), len(rows)), (MC, mc.row_offset, mc.row_offset + mc.num_rows - 1, 0))
        for table, lo, hi, cols in rows:
            index.append(IndexEntry(rank, pos, pos, table, 0, lo, hi, cols))
            pos += 1
        ranges[rank] = [OffsetRange(first, pos - 1)]
    return ChainLink(checkpoint_id=cid, full=cid == 1, generation=cid, ranges=ranges, rows=0, bytes=0, index=index)


class _Issued(Exception):
    """Stops a restore once it issued its reads."""


class _ReadRecorder:
    """A FrameSource that records the reads it is asked for (ahead, or the restore's own) and
    stops the restore there."""

    reads_ahead_used = 0

    def __init__(self) -> None:
        self.ahead: list[list[RangeRead]] = []
        self.restore: list[RangeRead] = []

    def read_ahead(self, reads: list[RangeRead]) -> None:
        self.ahead.append(list(reads))

    def read_ranges(self, reads: list[RangeRead]) -> None:
        self.restore = list(reads)
        raise _Issued


def _restore_reads(marker: Marker, rank: int, managed: bool) -> list[RangeRead]:
    """The reads `restore_rows` issues for rank `rank` of the plan that wrote `marker` (with
    its managed-collision shard when `managed`)."""
    views = _shards(WORLD, rank)
    mc = [McShard(key=MC, module="mc", name="t", mch=None, rows=v) for v in views if v.table == MC] if managed else []
    source = _ReadRecorder()
    with pytest.raises(_Issued):
        restore_rows(marker, source, ShardMap(views, []), RUN, _locate, fused=False, mc_shards=mc)  # type: ignore[arg-type]
    return source.restore


def test_the_read_ahead_reads_what_the_restore_reads_on_links_with_mapping_entries(replay_seed: ReplaySeed) -> None:
    """The restore reads a rank's mapping entries in the same runs as its rows: the read ahead,
    every entry the rank wrote, is exactly that under the plan that wrote them."""
    rng = replay_seed.rng()
    for case in range(20):
        placement = rng.choice(["first", "last", "between"])
        at = {"first": lambda r: 0, "last": lambda r: 99, "between": lambda r: rng.randint(1, 4)}[placement]
        chain = [_entries_link(cid, rng, at) for cid in range(1, rng.randint(1, 4) + 1)]
        marker = _marker(len(chain), chain)
        why = f"case {case}: mapping entries {placement}, {replay_seed}"
        for rank in range(WORLD):
            source = _ReadRecorder()
            assert read_frames_ahead(marker, source, rank) == len(source.ahead[0])  # type: ignore[arg-type]
            assert source.ahead == [_restore_reads(marker, rank, managed=True)], why
            # a model without the mapping would read around the mapping entries: not what was read ahead
            assert source.ahead != [_restore_reads(marker, rank, managed=False)], why
