"""One rank's checkpoint without a process group: the writer frames a snapshot into a
filesystem sink and indexes it, the committer writes the dense file and the COMMIT
marker, and `restore_rows` reads it back through the marker's typed index."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt.capture.snapshot import ShardRows, Snapshot
from ckpt.dense.store import DenseRef, DenseStore
from ckpt.log.catalog import commits, read_catalog
from ckpt.log.catalog_record import read_recent_catalog
from ckpt.log.fencing import announce
from ckpt.log.markers import FrameMeta, IndexEntry, OffsetRange, decode_record, index_frames
from ckpt.quant import get_codec
from ckpt.restore.replay import restore_rows
from ckpt.stream.filesystem import FsMarkers, FsSink, FsSource
from ckpt.stream.frames import OptimState, chunk_rows, decode_frame
from ckpt.write.committer import Committer
from ckpt.write.writer import RankReport, RankWriter, WriteJob, encode_frames
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
