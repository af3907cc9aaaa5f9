"""The frames a resuming rank fetches while its model is built (`ckpt.log.frames_ahead`): its
guess, the frames it wrote, is exactly what the restore asks for under the sharding plan that
wrote them (the same list, so `KafkaSource.read_ranges` takes the reads over), and not under
another plan (so it reads as usual); the checkpoint guessed is the one `ckpt.restore.resume` names."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ckpt.log.chain_reads import chain_runs, written_by
from ckpt.log.frames_ahead import checkpoint_to_read, read_frames_ahead
from ckpt.log.markers import ChainLink, IndexEntry, Marker, OffsetRange
from ckpt.restore.replay import frame_overlaps
from ckpt.stream.sink import RangeRead
from sharding.shard_views import ShardView

RUN = "ahead"
TABLES = {"t": (1000, 8), "u": (300, 16)}  # rows, columns


def _shards(world: int, rank: int, column_wise: set[str]) -> list[ShardView]:
    """`rank`'s shards of every table: row-wise in `world` even blocks, or column-wise."""
    out = []
    for table, (rows, cols) in TABLES.items():
        if table in column_wise:
            c0, c1 = rank * cols // world, (rank + 1) * cols // world
            out.append(ShardView(table, 0, c0, torch.zeros(rows, c1 - c0)))
        else:
            r0, r1 = rank * rows // world, (rank + 1) * rows // world
            out.append(ShardView(table, r0, 0, torch.zeros(r1 - r0, cols)))
    return out


def _link(cid: int, rng: random.Random, world: int, column_wise: set[str]) -> ChainLink:
    """Checkpoint `cid` as `world` ranks write it: each rank's frames in its partition, one index
    entry per frame (rows of the rank's shard, ordered by table), at consecutive offsets."""
    index, ranges = [], {}
    for rank in range(world):
        pos = rng.randint(0, 5)
        first = pos
        for s in _shards(world, rank, column_wise):
            for _ in range(rng.randint(1, 3)):
                lo = rng.randint(s.row_offset, s.row_offset + s.num_rows - 1)
                hi = rng.randint(lo, s.row_offset + s.num_rows - 1)
                index.append(IndexEntry(rank, pos, pos, s.table, s.col_offset, lo, hi, s.num_cols))
                pos += 1
        ranges[rank] = [OffsetRange(first, pos - 1)]
    return ChainLink(checkpoint_id=cid, full=cid == 1, generation=cid, ranges=ranges, rows=0, bytes=0, index=index)


def _marker(cid: int, rng: random.Random, world: int, column_wise: set[str]) -> Marker:
    chain = [_link(c, rng, world, column_wise) for c in range(1, cid + 1)]
    return Marker(kind="commit", run_id=RUN, checkpoint_id=cid, step=cid * 10, world_size=world, chain=chain)


def _restore_reads(marker: Marker, shards: list[ShardView]) -> list[RangeRead]:
    """The reads `restore_rows` makes for a rank holding `shards` (its `want`)."""

    def want(e: IndexEntry) -> bool:
        return any(frame_overlaps(s, e.col_offset, e.cols, e.min_row, e.max_row) for s in shards if s.table == e.table)

    return [run.read() for run in chain_runs(marker, want)]


def test_a_ranks_guess_is_the_restores_reads_under_the_plan_that_wrote_them_and_not_under_another(replay_seed) -> None:
    rng = replay_seed.rng()
    for case in range(20):
        world = rng.choice([2, 3, 4])
        column_wise = {t for t in TABLES if rng.random() < 0.3}
        marker = _marker(rng.randint(1, 4), rng, world, column_wise)
        why = f"case {case}: world {world}, column-wise {sorted(column_wise)}, {replay_seed}"
        for rank in range(world):
            guess = [run.read() for run in chain_runs(marker, written_by(rank))]
            assert guess and guess == _restore_reads(marker, _shards(world, rank, column_wise)), why
        # restored into one rank: rank 0 now holds the rows every rank wrote, and reads them all
        guess = [run.read() for run in chain_runs(marker, written_by(0))]
        assert guess != _restore_reads(marker, _shards(1, 0, column_wise)), why


class _Catalog(NamedTuple):
    markers: list[Marker]

    def restorable(self, abandoned: bool = False) -> list[Marker]:
        return self.markers


class _Recorder:
    def __init__(self) -> None:
        self.started: list[list[RangeRead]] = []

    def read_ahead(self, reads: Sequence[RangeRead]) -> None:
        self.started.append(list(reads))


def test_the_checkpoint_read_ahead_is_the_one_resume_names() -> None:
    rng = random.Random(3)
    markers = [_marker(cid, rng, 2, set()) for cid in (1, 2, 3)]
    catalog = _Catalog([markers[2], markers[0], markers[1]])
    assert checkpoint_to_read(catalog, "latest") is markers[2]  # type: ignore[arg-type]
    assert checkpoint_to_read(catalog, "2") is markers[1]  # type: ignore[arg-type]
    assert checkpoint_to_read(catalog, "9") is None  # type: ignore[arg-type]
    assert checkpoint_to_read(catalog, "none") is None  # type: ignore[arg-type]
    assert checkpoint_to_read(_Catalog([]), "latest") is None  # type: ignore[arg-type]

    source = _Recorder()
    assert read_frames_ahead(markers[1], source, rank=1) == len(source.started[0])  # type: ignore[arg-type]
    assert source.started == [[run.read() for run in chain_runs(markers[1], written_by(1))]]
