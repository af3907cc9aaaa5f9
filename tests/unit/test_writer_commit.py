"""One rank's checkpoint without a process group: the writer frames a snapshot into a
filesystem sink and indexes it, the committer writes the dense file and the COMMIT
marker, and `restore_rows` reads it back through the marker's typed index."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt.capture.snapshot import ShardRows, Snapshot
from ckpt.dense.store import DenseRef, DenseStore
from ckpt.log.catalog import commits, read_catalog
from ckpt.log.catalog_record import read_recent_catalog
from ckpt.log.fencing import announce
from ckpt.log.markers import ChainLink, FrameMeta, IndexEntry, Marker, OffsetRange, decode_record, index_frames
from ckpt.quant import get_codec
from ckpt.restore.replay import RowsRestored, restore_rows
from ckpt.stream.filesystem import FsMarkers, FsSink, FsSource
from ckpt.stream.frames import OptimState, chunk_rows, decode_frame
from ckpt.stream.mapping import MappingRecord, join_mapping, mapping_frames
from ckpt.stream.sink import RangeRead
from ckpt.write.committer import Committer
from ckpt.write.writer import RankReport, RankWriter, WriteJob, encode_frames
from sharding.managed_collision import FREE, PINNED_COUNT, McState
from sharding.shard_views import ShardMap, ShardView

RUN = "unit-run"
MAX_FRAME_BYTES = 2048  # small, so one shard takes several frames


def _snapshot() -> Snapshot:
    """A full snapshot of two shards: t_user (whole width, row-wise state) and t_item
    (the column shard 4..7, element-wise state)."""
    g = torch.Generator().manual_seed(3)
    user = ShardRows(
        "t_user", 0, 0, torch.arange(200), torch.randn(200, 8, generator=g), {"momentum1": torch.rand(200, generator=g)}
    )
    item = ShardRows("t_item", 0, 4, torch.arange(50), torch.randn(50, 4, generator=g), {"sum": torch.rand(50, 4, generator=g)})
    return Snapshot(1, 10, True, [user, item], 0.002)


def _job(snapshot: Snapshot) -> WriteJob:
    return WriteJob(
        checkpoint_id=1,
        step=10,
        generation=1,
        chain=[1],
        snapshot=snapshot,
        trainer_state={"step": 10, "reader": {"next_global_batch": 11}},
        dense_state={"params": {"mlp.w": torch.ones(2, 2)}},
    )


@pytest.fixture
def rank0(tmp_path: Path):
    sink = FsSink(tmp_path, RUN)
    markers = FsMarkers(tmp_path, RUN)
    committer = Committer(
        run_id=RUN,
        markers=markers,
        dense=DenseStore(tmp_path / "dense"),
        marker_fields={"policy": "full", "world_size": 1, "plan": {}, "tables": {}},
    )
    writer = RankWriter(
        run_id=RUN,
        rank=0,
        sink=sink,
        group=None,  # type: ignore[arg-type]
        max_frame_bytes=MAX_FRAME_BYTES,
        flush_timeout_s=10.0,
        committer=committer,
    )
    yield writer, committer, markers
    assert writer.close(10.0) == []
    sink.close()
    markers.close()


def test_a_written_and_committed_checkpoint_restores_exactly(tmp_path: Path, rank0) -> None:
    writer, committer, markers = rank0
    snap = _snapshot()
    job = _job(snap)
    report = writer._write(job)
    assert report.ok, report.error
    assert report.rows == 250 and report.encodings == {"weights": "fp32", "optimizer.momentum1": "fp32", "optimizer.sum": "fp32"}

    # frames of a shard are numbered 0..count-1; the report counts their bytes
    nbytes = sum(len(f.data) for shard in snap.shards for f in encode_frames(job, shard, {}, RUN, 0, writer.max_frame_bytes))
    assert report.bytes == nbytes
    source = FsSource(tmp_path, RUN)
    frames = list(source.read_range(1, 0, 0, report.ranges[0][-1].last))
    by_table: dict[str, list] = {}
    for _, f in frames:
        by_table.setdefault(f.table, []).append(f)
    for table, fs in by_table.items():
        assert [f.chunk_index for f in fs] == list(range(len(fs))) and {f.chunk_count for f in fs} == {len(fs)}, table
    assert len(by_table["t_user"]) > 1

    # the index: one entry per shard, typed, with the positions and rows of its frames
    positions = [pos for pos, _ in frames]
    n_user = len(by_table["t_user"])
    assert report.ranges == {0: [OffsetRange(first=0, last=positions[-1])]}
    assert report.index == [
        IndexEntry(
            partition=0, first=0, last=positions[n_user - 1], table="t_user", col_offset=0, min_row=0, max_row=199, cols=8
        ),
        IndexEntry(
            partition=0, first=positions[n_user], last=positions[-1], table="t_item", col_offset=4, min_row=0, max_row=49, cols=4
        ),
    ]

    outcome = committer(job, [report])
    assert outcome.committed and (outcome.rows, outcome.bytes, outcome.full) == (250, nbytes, True)
    ((_, marker),) = commits(markers.read_markers(), RUN)
    assert outcome.commit_unix >= marker.created_unix > 0  # once the marker is durable
    # the local history records the commit once every rank knows of it, not before
    history = DenseStore(tmp_path / "dense").history
    assert history().commits == []
    committer.settle(outcome)
    assert [(c.checkpoint_id, c.step, c.unix) for c in history().commits] == [(1, 10, marker.created_unix)]
    assert marker.chain[-1].index == report.index and marker.chain[-1].ranges == report.ranges
    dense = DenseStore(tmp_path / "dense").read(DenseRef.from_json(marker.dense))
    assert dense["trainers"] == [job.trainer_state] and "readers" not in dense
    assert torch.equal(dense["params"]["mlp.w"], torch.ones(2, 2))

    # a rank holding only t_item reads only t_item's frames, and gets back exactly what was written
    item = ShardView("t_item", 0, 4, torch.zeros(50, 4), {"sum": torch.zeros(50, 4)})
    got = restore_rows(marker, source, ShardMap([item], []), RUN, lambda g, p, o: f"{g}/{p}@{o}")
    assert got.frames == len(by_table["t_item"]) and got.rows == 50
    assert torch.equal(item.weight, snap.shards[1].weights) and torch.equal(
        item.optimizer_states["sum"], snap.shards[1].optimizer["sum"]
    )
    user = ShardView("t_user", 0, 0, torch.zeros(200, 8), {"momentum1": torch.zeros(200)})
    restore_rows(marker, source, ShardMap([user], []), RUN, lambda g, p, o: f"{g}/{p}@{o}")
    assert torch.equal(user.weight, snap.shards[0].weights)
    assert torch.equal(user.optimizer_states["momentum1"], snap.shards[0].optimizer["momentum1"])


def test_a_failed_rank_fails_the_checkpoint_without_a_commit_time(rank0) -> None:
    writer, committer, markers = rank0
    job = _job(_snapshot())
    failed = RankReport(
        rank=0,
        ok=False,
        error="rank 0: broker gone",
        ranges={},
        index=[],
        rows=0,
        bytes=0,
        stall_ms=2.0,
        write_s=0.1,
        trainer_state={},
    )
    outcome = committer(job, [failed])
    assert not outcome.committed and outcome.error == "rank 0: broker gone" and outcome.commit_unix == 0.0
    assert commits(markers.read_markers(), RUN) == [] and len(markers.read_markers()) == 1  # the FAILED record
    committer.settle(outcome)
    assert committer.dense.history().commits == []


def test_an_attempt_replaced_by_a_newer_one_writes_nothing_more_and_its_epoch_marks_its_frames(tmp_path: Path, rank0) -> None:
    """The committer of attempt A (epoch 1) commits with its attempt id and epoch in marker and
    frames; once attempt B announced itself, A's next checkpoint writes no dense file and no
    marker, and its outcome says it is fenced, naming B."""
    writer, committer, markers = rank0
    catalog = read_catalog(markers, RUN)
    mine, epoch = announce(markers, RUN, "trainer")
    committer.start_attempt(mine, epoch, catalog)
    job = _job(_snapshot())
    job.epoch = committer.epoch
    assert job.epoch == 1  # the record's byte offset 0, + 1
    report = writer._write(job)
    outcome = committer(job, [report])
    assert outcome.committed and not outcome.fenced
    marker = read_catalog(markers, RUN).commits[1]
    assert marker.attempt == mine.attempt and marker.chain[-1].epoch == 1
    assert {f.epoch for _, f in FsSource(tmp_path, RUN).read_range(1, 0, 0, report.ranges[0][-1].last)} == {1}

    newer, newer_epoch = announce(markers, RUN, "trainer")
    assert newer_epoch > 1
    second = WriteJob(**{**job.__dict__, "checkpoint_id": 2, "chain": [1, 2], "generation": 1})
    outcome = committer(second, [writer._write(second)])
    assert outcome.fenced and not outcome.committed
    assert f"a newer trainer attempt ({newer.attempt}, epoch {newer_epoch}," in outcome.error
    assert mine.attempt in outcome.error
    assert not DenseStore(tmp_path / "dense").path_for(2).exists()
    catalog = read_catalog(markers, RUN)
    assert sorted(catalog.commits) == [1] and not catalog.failed and catalog.holder("trainer").attempt == newer.attempt


def test_segments_merge_consecutive_frames_of_one_shard_only() -> None:
    meta = [FrameMeta("t", 0, 0, 4, 8), FrameMeta("t", 0, 5, 9, 8), FrameMeta("t", 8, 0, 9, 8), FrameMeta("t", 0, 10, 12, 8)]
    assert index_frames(3, [0, 100, 200, 300], meta) == [
        IndexEntry(partition=3, first=0, last=100, table="t", col_offset=0, min_row=0, max_row=9, cols=8),
        IndexEntry(partition=3, first=200, last=200, table="t", col_offset=8, min_row=0, max_row=9, cols=8),
        IndexEntry(partition=3, first=300, last=300, table="t", col_offset=0, min_row=10, max_row=12, cols=8),
    ]


def test_a_shards_mapping_frames_get_an_entry_of_their_own_beside_its_rows() -> None:
    """Mapping frames (cols 0) of a table written right after its row frames at column 0 are not
    merged into the rows' entry, nor rows into theirs: one entry per (table, column offset, cols) run."""
    meta = [
        FrameMeta("t", 0, 0, 4, 8),
        FrameMeta("t", 0, 5, 9, 8),
        FrameMeta("t", 0, 0, 9, 0),  # t's mapping: its slots 0..9, in two frames
        FrameMeta("t", 0, 0, 9, 0),
        FrameMeta("t", 0, 10, 12, 8),
        FrameMeta("u", 0, 0, 9, 0),
    ]
    index = index_frames(3, [0, 100, 200, 300, 400, 500], meta)
    assert index == [
        IndexEntry(partition=3, first=0, last=100, table="t", col_offset=0, min_row=0, max_row=9, cols=8),
        IndexEntry(partition=3, first=200, last=300, table="t", col_offset=0, min_row=0, max_row=9, cols=0),
        IndexEntry(partition=3, first=400, last=400, table="t", col_offset=0, min_row=10, max_row=12, cols=8),
        IndexEntry(partition=3, first=500, last=500, table="u", col_offset=0, min_row=0, max_row=9, cols=0),
    ]
    assert [e.is_mapping for e in index] == [False, True, False, True]


class _RecordingSource(FsSource):
    """FsSource that records the range reads asked of it."""

    def __init__(self, root: Path, run_id: str) -> None:
        super().__init__(root, run_id)
        self.reads: list[RangeRead] = []

    def read_ranges(self, reads):
        self.reads += list(reads)
        return super().read_ranges(reads)


def _mc_state(table: str, rows: int) -> McState:
    raw = np.full(rows, FREE, dtype=np.int64)
    raw[: rows - 1] = np.arange(rows - 1) * 11 + 3
    counts = np.arange(rows, dtype=np.int64)
    counts[-1] = PINNED_COUNT
    return McState(table, 0, raw, counts, None, 9, 6, np.array([3, 14, 3]), None, 16, (0, rows), 2**40)


def test_a_link_with_mapping_entries_restores_its_rows_exactly_as_one_without(tmp_path: Path) -> None:
    """Today's restore reads a link whose index holds mapping entries (cols 0) as it reads the
    same link without them: it chooses entries by the columns they meet, so it skips them and
    never reads their frames, which a reader of the mapping finds by the entry and joins."""
    snap = _snapshot()
    record = MappingRecord.of_state(_mc_state("t_user", 200))
    sink = FsSink(tmp_path, RUN)
    links = {}
    for generation, with_mapping in ((1, True), (2, False)):
        meta = []
        for shard in snap.shards:  # t_user's rows, its mapping, then t_item's rows: one partition
            job = replace(_job(snap), generation=generation)
            for f in encode_frames(job, shard, {}, RUN, 0, MAX_FRAME_BYTES):
                sink.write(f.data, generation=generation, partition=0)
                meta.append(FrameMeta(shard.table, shard.col_offset, f.first_row, f.last_row, shard.weights.shape[1]))
            if with_mapping and shard.table == "t_user":
                for f in mapping_frames(record, run_id=RUN, checkpoint_id=1, rank=0, max_frame_bytes=MAX_FRAME_BYTES):
                    sink.write(f.data, generation=generation, partition=0)
                    meta.append(FrameMeta(record.table, 0, f.first_row, f.last_row, 0))
        done = sink.flush().raise_for_error()
        index = index_frames(0, done.positions[(generation, 0)], meta)
        ranges = {0: [OffsetRange(*r) for r in done.ranges[(generation, 0)]]}
        links[generation] = ChainLink(
            checkpoint_id=1, full=True, generation=generation, ranges=ranges, rows=250, bytes=0, index=index
        )
    sink.close()
    with_map, without = links[1], links[2]
    assert [e.is_mapping for e in with_map.index] == [False, True, False] and not any(e.is_mapping for e in without.index)
    mapping_entry = with_map.index[1]
    assert (mapping_entry.table, mapping_entry.min_row, mapping_entry.max_row, mapping_entry.cols) == ("t_user", 0, 199, 0)
    assert mapping_entry.last > mapping_entry.first  # several frames under the limit

    def restore(link: ChainLink) -> tuple[list[ShardView], RowsRestored, list[RangeRead]]:
        marker = Marker(kind="commit", run_id=RUN, checkpoint_id=1, step=10, world_size=1, chain=[link])
        views = [
            ShardView("t_user", 0, 0, torch.zeros(200, 8), {"momentum1": torch.zeros(200)}),
            ShardView("t_item", 0, 4, torch.zeros(50, 4), {"sum": torch.zeros(50, 4)}),
        ]
        source = _RecordingSource(tmp_path, RUN)
        out = restore_rows(marker, source, ShardMap(views, []), RUN, lambda g, p, o: f"{g}/{p}@{o}")
        return views, out, source.reads

    got, out, reads = restore(with_map)
    want, out_without, _ = restore(without)
    for a, b, shard in zip(got, want, snap.shards):
        assert torch.equal(a.weight, shard.weights) and torch.equal(a.weight, b.weight)
        for name, value in a.optimizer_states.items():
            assert torch.equal(value, b.optimizer_states[name])
    assert (out.frames, out.rows, out.written, out.bytes) == (
        out_without.frames,
        out_without.rows,
        out_without.written,
        out_without.bytes,
    )
    # the rows' entries are read as two runs around the mapping entry, whose frames are never read
    assert sorted((r.first, r.last) for r in reads) == sorted((e.first, e.last) for e in with_map.index if not e.is_mapping)
    assert all(r.last < mapping_entry.first or r.first > mapping_entry.last for r in reads)
    # a reader of the mapping: the entry's frames, joined
    frames = [f for _, f in FsSource(tmp_path, RUN).read_range(1, 0, mapping_entry.first, mapping_entry.last)]
    assert join_mapping(frames) == record


def test_the_writer_frames_a_shard_with_the_frames_module_rule(rank0) -> None:
    """Frames are as full as `chunk_rows` makes them: the writer does not split on its own."""
    writer, _, _ = rank0
    snap = _snapshot()
    shard = snap.shards[0]
    got = list(encode_frames(_job(snap), shard, {}, RUN, 0, writer.max_frame_bytes))
    fp32 = get_codec("fp32")
    want = list(
        chunk_rows(
            run_id=RUN,
            checkpoint_id=1,
            rank=0,
            table="t_user",
            col_offset=0,
            dim=8,
            encoding=fp32.code,
            row_ids=shard.global_rows,
            payload=shard.weights,
            optim=[OptimState("momentum1", fp32.code, shard.optimizer["momentum1"].reshape(-1, 1))],
            max_frame_bytes=MAX_FRAME_BYTES,
        )
    )
    assert [f.data for f in got] == [f.data for f in want]
    assert len(got) > 1 and all(len(f.data) <= MAX_FRAME_BYTES for f in got)
    assert sum(f.row_count for f in got) == 200 and got[0].first_row == 0 and got[-1].last_row == 199
    assert decode_frame(got[0].data).chunk_count == len(got)


def test_the_committer_appends_a_catalog_record_every_catalog_every_records_and_a_restore_reads_from_it(
    tmp_path: Path, rank0, monkeypatch
) -> None:
    """With `catalog_every=3`, a catalog record follows each COMMIT whose read of the log
    before it found 3 records since the previous catalog record; it summarises the log as
    that read found it, and a restore reads the log from the newest one on (not from its
    first record)."""
    writer, committer, markers = rank0
    committer.catalog_every = 3
    mine, epoch = announce(markers, RUN, "trainer")
    committer.start_attempt(mine, epoch, read_catalog(markers, RUN))
    for cid in range(1, 9):
        job = WriteJob(
            **{
                **_job(_snapshot()).__dict__,
                "checkpoint_id": cid,
                "chain": [cid],
                "generation": cid,
                "step": 10 * cid,
                "epoch": epoch,
            }
        )
        assert committer(job, [writer._write(job)]).committed
    every = [decode_record(data).kind for _, data in markers.read_markers()]
    # each COMMIT follows the LINK record of its own link, which the catalog cadence does not count
    assert all(every[i - 1] == "link" for i, kind in enumerate(every) if kind == "commit"), every
    kinds = [kind for kind in every if kind != "link"]
    # the read before commit 3 has 3 records since the log's start (attempt, commits 1 and 2);
    # the one before commit 7 has 3 since the catalog record (commits 4, 5, 6)
    assert kinds == [
        "attempt",
        "commit",
        "commit",
        "commit",
        "catalog",
        "commit",
        "commit",
        "commit",
        "commit",
        "catalog",
        "commit",
    ], kinds
    record = decode_record(markers.read_markers()[every.index("catalog", every.index("catalog") + 1)][1])
    assert [m.checkpoint_id for m in record.commits] == [3, 4, 5, 6]  # as of the read before commit 7: KEEP = 4
    monkeypatch.setattr(markers, "read_markers", lambda start=0: pytest.fail("the whole log was read"))
    recent = read_recent_catalog(markers, RUN)
    assert recent.summary is not None and recent.read == 5  # commit 7 and its link, the catalog record, commit 8 and its link
    assert [m.checkpoint_id for m in recent.restorable()] == [8, 7, 6, 5, 4, 3]
    assert all(link.index for m in recent.restorable() for link in m.chain)  # a restore's fold reads the indexes
    # the committer's own fold (fencing, rebasing, these records) keeps the links without them,
    # and once it wrote a catalog record, only what the record holds (3-6) and what followed (7)
    assert sorted(committer.catalog.links) == sorted(committer.catalog.commits) == list(range(3, 8))
    assert not any(link.index for link in committer.catalog.links.values())
    # every checkpoint here is full: no later chain names an older link than the newest
    assert list(committer.links) == [8]


class _CountingMarkers(FsMarkers):
    """FsMarkers that counts `prepare` calls (files need none; a broker's reader connects there)."""

    prepared: list[float]

    def prepare(self, timeout_s: float) -> None:
        self.prepared.append(timeout_s)


def test_the_markers_reader_is_prepared_only_when_the_commit_will_read_the_log(tmp_path: Path) -> None:
    markers = _CountingMarkers(tmp_path, RUN)
    markers.prepared = []
    fields = {"policy": "full", "world_size": 1, "plan": {}, "tables": {}}
    plain = Committer(run_id=RUN, markers=markers, dense=DenseStore(tmp_path / "d1"), marker_fields=fields, connect_timeout_s=7.0)
    plain.prepare()  # no fencing, no rebasing: the commit reads nothing
    assert markers.prepared == []
    rebasing = Committer(
        run_id=RUN, markers=markers, dense=DenseStore(tmp_path / "d2"), marker_fields=fields, rebase=True, connect_timeout_s=7.0
    )
    rebasing.prepare()
    assert markers.prepared == [7.0]
    catalog = read_catalog(markers, RUN)
    plain.start_attempt(*announce(markers, RUN, "trainer"), catalog)  # fencing reads the log before the dense file
    plain.prepare()
    assert markers.prepared == [7.0, 7.0]


def test_keep_dense_deletes_the_dense_files_older_than_the_newest_n_once_committed(tmp_path: Path, rank0) -> None:
    """`ckpt.write.keep_dense=2`: after each COMMIT every rank knows of, the dense files of this
    attempt's checkpoints older than the newest two are deleted, the restored one's counted
    first; files it did not write or restore are left to gc."""
    writer, committer, _ = rank0
    committer.keep_dense = 2
    dense = DenseStore(tmp_path / "dense")
    foreign = dense.write(1, {"step": 1})  # an earlier attempt's, which this one never restored
    committer.adopt([], None, restored=2)
    dense.write(2, {"step": 2})

    def files() -> list[int]:
        return sorted(int(p.stem.split("-")[1]) for p in (tmp_path / "dense").glob("dense-*.pt"))

    for cid in (3, 4, 5):
        job = replace(_job(_snapshot()), checkpoint_id=cid, generation=cid, chain=[cid], step=cid * 10)
        outcome = committer(job, [writer._write(job)])
        assert outcome.committed, outcome.error
        assert cid in files()  # written before the COMMIT, kept until every rank knows of it
        committer.settle(outcome)
        assert files() == [1, *[c for c in (2, 3, 4, 5) if cid - 1 <= c <= cid]], cid
    assert Path(foreign.path).is_file()
