"""Frame sinks, sources and marker logs against a real broker and real files.

The common behaviour runs against both backends (``backend`` fixture); broker loss is
Kafka-only, torn tails are filesystem-only.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from ckpt.log.catalog import Catalog
from ckpt.log.catalog_ahead import CatalogAhead, catch_up_recent
from ckpt.log.catalog_record import read_recent_catalog, summarize
from ckpt.log.markers import ChainLink, Marker, OffsetRange, encode_marker
from ckpt.stream.filesystem import REC_MAGIC, FsMarkers, FsSink, FsSource, encode_record
from ckpt.stream.frames import FrameError, OptimState, chunk_rows, decode_frame
from ckpt.stream.kafka import BrokerUnreachable, KafkaMarkers, KafkaSink, KafkaSource
from ckpt.stream.kafka import consumer as kafka_consumer
from ckpt.stream.kafka import markers as kafka_markers
from ckpt.stream.kafka.producer import MAX_OUTSTANDING, OUTSTANDING_STALL_S
from ckpt.stream.sink import RangeRead, SinkError, SourceError
from launch.broker import EmbeddedBroker, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

WORLD = 2


@dataclass
class Backend:
    name: str
    run: str
    sink: Callable[..., object]
    source: Callable[..., object]
    markers: Callable[..., object]


@pytest.fixture(params=["kafka", "fs"])
def backend(request, tmp_path, unique_name):
    run = unique_name("run")
    if request.param == "kafka":
        conf = {"bootstrap.servers": request.getfixturevalue("broker").bootstrap}
        b = Backend(
            "kafka",
            run,
            sink=lambda: KafkaSink(run, conf, num_partitions=WORLD, delivery_timeout_s=10),
            source=lambda: KafkaSource(run, conf, timeout_s=3),
            markers=lambda: KafkaMarkers(run, conf, timeout_s=10),
        )
    else:
        b = Backend(
            "fs",
            run,
            sink=lambda: FsSink(tmp_path, run),
            source=lambda: FsSource(tmp_path, run),
            markers=lambda: FsMarkers(tmp_path, run),
        )
    return b


def make_frames(
    run: str, ckpt: int, rank: int, n: int, *, table: str = "t0", seed: int = 0, max_frame_bytes: int = 4096
) -> list[bytes]:
    g = torch.Generator().manual_seed(seed * 1000 + ckpt * 10 + rank)
    ids = torch.randperm(100_000, generator=g)[:n]
    rows = torch.randn(n, 16, generator=g)
    mom = torch.rand(n, generator=g)
    return [
        f.data
        for f in chunk_rows(
            run_id=run,
            checkpoint_id=ckpt,
            rank=rank,
            table=table,
            col_offset=0,
            dim=16,
            encoding=0,
            row_ids=ids,
            payload=rows,
            optim=[OptimState("momentum1", 0, mom)],
            max_frame_bytes=max_frame_bytes,
        )
    ]


def same(a, b) -> bool:
    """Two decoded frames carry the same fields and bytes."""
    return (
        (a.run_id, a.checkpoint_id, a.rank, a.table, a.col_offset, a.dim, a.encoding, a.chunk_index, a.chunk_count)
        == (b.run_id, b.checkpoint_id, b.rank, b.table, b.col_offset, b.dim, b.encoding, b.chunk_index, b.chunk_count)
        and torch.equal(a.row_ids, b.row_ids)
        and torch.equal(a.payload, b.payload)
        and all(torch.equal(x.rows, y.rows) for x, y in zip(a.optim, b.optim))
    )


def read_all(source, gen, part, rng):
    return list(source.read_range(gen, part, rng[0], rng[1]))


def test_round_trip_reads_exactly_the_acknowledged_ranges(backend):
    sink, source = backend.sink(), backend.source()
    try:
        written = {p: make_frames(backend.run, 1, p, 300 + 50 * p) for p in range(WORLD)}
        assert all(len(v) > 3 for v in written.values())  # several frames per partition
        for i in range(max(map(len, written.values()))):  # interleave partitions
            for p in range(WORLD):
                if i < len(written[p]):
                    sink.write(written[p][i], generation=0, partition=p)
        r1 = sink.flush(30).raise_for_error()
        assert set(r1.ranges) == {(0, p) for p in range(WORLD)}
        assert all(len(r1.ranges[(0, p)]) == 1 for p in range(WORLD))
        assert r1.frames == {(0, p): len(written[p]) for p in range(WORLD)}

        # A second checkpoint lands after the first in the same partitions.
        later = {p: make_frames(backend.run, 2, p, 120) for p in range(WORLD)}
        for p in range(WORLD):
            for fr in later[p]:
                sink.write(fr, generation=0, partition=p)
        r2 = sink.flush(30).raise_for_error()

        for p in range(WORLD):
            (rng1,) = r1.ranges[(0, p)]
            (rng2,) = r2.ranges[(0, p)]
            assert rng2[0] > rng1[1]
            got = read_all(source, 0, p, rng1)  # stops at the range end: nothing of ckpt 2
            assert [pos for pos, _ in got][0] == rng1[0] and got[-1][0] == rng1[1]
            assert len(got) == len(written[p])
            assert all(same(f, decode_frame(b)) for (_, f), b in zip(got, written[p]))
            got2 = read_all(source, 0, p, rng2)
            assert [f.checkpoint_id for _, f in got2] == [2] * len(later[p])
            assert all(same(f, decode_frame(b)) for (_, f), b in zip(got2, later[p]))
            # a sub-range starting mid-checkpoint: exactly those frames
            sub = read_all(source, 0, p, (got[1][0], got[2][0]))
            assert [pos for pos, _ in sub] == [got[1][0], got[2][0]]
    finally:
        sink.close()


def test_empty_flush_and_separate_generations(backend):
    sink, source = backend.sink(), backend.source()
    try:
        assert sink.flush(10).ok and sink.flush(10).ranges == {}
        f0, f1 = make_frames(backend.run, 1, 0, 5), make_frames(backend.run, 1, 0, 7, seed=1)
        sink.write(f0[0], generation=0, partition=0)
        sink.write(f1[0], generation=1, partition=0)
        r = sink.flush(30).raise_for_error()
        assert set(r.ranges) == {(0, 0), (1, 0)}
        assert [f.row_count for _, f in read_all(source, 1, 0, r.ranges[(1, 0)][0])] == [7]
        assert [f.row_count for _, f in read_all(source, 0, 0, r.ranges[(0, 0)][0])] == [5]
    finally:
        sink.close()


def test_missing_data_is_a_clear_error(backend):
    sink, source = backend.sink(), backend.source()
    try:
        for fr in make_frames(backend.run, 1, 1, 10):
            sink.write(fr, generation=0, partition=1)
        ((first, last),) = sink.flush(30).raise_for_error().ranges[(0, 1)]
        t0 = time.monotonic()
        with pytest.raises(SourceError) as e:  # the partition ends before the range does
            read_all(source, 0, 1, (first, last + 1000))
        assert ("/1.seg ends at byte" if backend.name == "fs" else "partition 1 ends at offset") in str(e.value)
        with pytest.raises(SourceError, match="does not exist"):
            read_all(source, 7, 1, (0, 0))
        with pytest.raises(SourceError):  # nothing written to partition 0
            read_all(source, 0, 0, (0, 0))
        assert time.monotonic() - t0 < 15
    finally:
        sink.close()


def test_read_ranges_gives_every_read_in_order_whatever_the_interleaving(backend):
    """Reads of two generations and two partitions, two of them in one partition with a gap
    between: `read_ranges` yields exactly what `read_range` does for each, in position order
    within each read; a read of a missing generation is refused naming it."""
    sink, source = backend.sink(), backend.source()
    try:
        small = 700  # bytes a frame: several frames a partition
        written = {
            (0, 0): make_frames(backend.run, 1, 0, 60, max_frame_bytes=small),
            (0, 1): make_frames(backend.run, 1, 1, 30, max_frame_bytes=small),
            (1, 0): make_frames(backend.run, 2, 0, 20, max_frame_bytes=small),
        }
        for (gen, part), frames in written.items():
            for fr in frames:
                sink.write(fr, generation=gen, partition=part)
        res = sink.flush(30).raise_for_error()
        pos = {key: res.positions[key] for key in written}
        assert len(pos[(0, 0)]) >= 8, "the test needs a partition of at least 8 frames"
        reads = [
            RangeRead(0, 0, pos[(0, 0)][5], pos[(0, 0)][7]),
            RangeRead(1, 0, pos[(1, 0)][0], pos[(1, 0)][-1]),
            RangeRead(0, 0, pos[(0, 0)][0], pos[(0, 0)][2]),
            RangeRead(0, 1, pos[(0, 1)][0], pos[(0, 1)][-1]),
        ]
        got: dict[int, list] = {i: [] for i in range(len(reads))}
        for i, p, frame in source.read_ranges(reads):
            got[i].append((p, frame))
        for i, r in enumerate(reads):
            want = read_all(source, r.generation, r.partition, (r.first, r.last))
            assert [p for p, _ in got[i]] == [p for p, _ in want], (r, [p for p, _ in got[i]])
            assert all(same(a, b) for (_, a), (_, b) in zip(got[i], want)), r
        with pytest.raises(SourceError, match="does not exist"):
            list(source.read_ranges([reads[0], RangeRead(7, 0, 0, 0)]))
    finally:
        sink.close()


def test_corrupt_frame_is_reported_with_its_location(backend):
    sink, source = backend.sink(), backend.source()
    try:
        good = make_frames(backend.run, 1, 0, 3)[0]
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 1
        sink.write(good, generation=0, partition=0)
        sink.write(bytes(bad), generation=0, partition=0)
        ((first, last),) = sink.flush(30).raise_for_error().ranges[(0, 0)]
        it = source.read_range(0, 0, first, last)
        assert next(it)[0] == first
        with pytest.raises(FrameError, match="CRC mismatch") as e:
            next(it)
        where = f"offset {last}" if backend.name == "kafka" else f"0.seg at byte {last}"
        assert where in str(e.value)
        # A frame of another run in this run's stream is rejected too.
        sink.write(make_frames("other-run", 1, 0, 3)[0], generation=0, partition=0)
        ((pos, _),) = sink.flush(30).raise_for_error().ranges[(0, 0)]
        with pytest.raises(FrameError, match="run 'other-run'"):
            read_all(source, 0, 0, (pos, pos))
    finally:
        sink.close()


def test_drop_generation(backend):
    sink, source = backend.sink(), backend.source()
    try:
        for g in (0, 1):
            for fr in make_frames(backend.run, g, 0, 10):
                sink.write(fr, generation=g, partition=0)
        r = sink.flush(30).raise_for_error()
        sink.drop_generation(0)
        with pytest.raises(SourceError):
            read_all(source, 0, 0, r.ranges[(0, 0)][0])
        assert len(read_all(source, 1, 0, r.ranges[(1, 0)][0])) == r.frames[(1, 0)]
        with pytest.raises(SinkError, match="dropped"):
            sink.write(make_frames(backend.run, 5, 0, 1)[0], generation=0, partition=0)
        assert not sink.flush(10).ok  # the refused write failed this flush...
        sink.write(make_frames(backend.run, 6, 0, 1)[0], generation=1, partition=0)
        assert sink.flush(30).ok  # ...and the next one works
        sink.drop_generation(0)  # dropping twice is fine
    finally:
        sink.close()


def test_markers_append_and_read_back(backend):
    m = backend.markers()
    try:
        assert m.read_markers() == []
        payloads = [b"COMMIT 1", b"", b"COMMIT 2" * 1000]
        positions = [m.append_marker(p) for p in payloads]
        assert positions == sorted(set(positions))
        assert m.read_markers() == list(zip(positions, payloads))
        fresh = backend.markers()  # another process's view
        assert fresh.read_markers() == list(zip(positions, payloads))
        fresh.close()
    finally:
        m.close()


def test_markers_appended_in_one_write_keep_their_order_and_positions(backend):
    """`append_markers`: several records in one write (one produce request and flush, one
    fsync) land in order, at the positions it returns, between single appends."""
    m = backend.markers()
    try:
        first = m.append_marker(b"before")
        payloads = [b"LINK part 0" * 5000, b"LINK part 1", b"COMMIT"]
        positions = m.append_markers(payloads)
        last = m.append_marker(b"after")
        assert [first, *positions, last] == sorted(set([first, *positions, last]))
        fresh = backend.markers()  # another process's view
        try:
            assert fresh.read_markers() == list(zip([first, *positions, last], [b"before", *payloads, b"after"]))
        finally:
            fresh.close()
    finally:
        m.close()


def test_markers_tail_is_the_last_records_and_says_when_it_is_the_whole_log(backend):
    m = backend.markers()
    try:
        assert m.read_tail(5) == ([], True)
        payloads = [f"marker {i}".encode() * (1 + i % 7) for i in range(150)]
        positions = [m.append_marker(p) for p in payloads]
        everything = list(zip(positions, payloads))
        fresh = backend.markers()  # another process, as a restore is
        try:
            assert fresh.read_tail(40) == (everything[-40:], False)
            assert fresh.read_tail(150) == (everything, True)
            assert fresh.read_tail(1000) == (everything, True)
        finally:
            fresh.close()
    finally:
        m.close()


def test_a_restore_folds_a_markers_log_from_its_newest_catalog_record(backend):
    """Thousands of COMMIT markers with a catalog record every 32 records: the restore's fold
    reads about the last 64 records and answers as the whole log's fold does."""
    m = backend.markers()
    try:
        fold = Catalog(backend.run)
        chain = [ChainLink(checkpoint_id=1, full=True, generation=1, ranges={0: [OffsetRange(0, 0)]}, rows=1, bytes=9)]
        for cid in range(1, 301):
            if cid > 1:
                chain = [
                    chain[0],
                    ChainLink(checkpoint_id=cid, full=False, generation=1, ranges={0: [OffsetRange(cid, cid)]}, rows=1, bytes=1),
                ]
            record = encode_marker(
                Marker(kind="commit", run_id=backend.run, checkpoint_id=cid, step=cid, world_size=2, chain=chain)
            )
            fold.feed([(m.append_marker(record), record)])
            if fold.since_summary >= 32:
                summary = encode_marker(summarize(fold))
                fold.feed([(m.append_marker(summary), summary)])
        fresh = backend.markers()
        try:
            recent = read_recent_catalog(fresh, backend.run)
        finally:
            fresh.close()
        assert recent.summary is not None and recent.read <= 33
        assert [x.checkpoint_id for x in recent.restorable()] == [x.checkpoint_id for x in fold.restorable()][
            : len(recent.restorable())
        ]
        assert recent.restorable()[0].checkpoint_id == 300 and recent.newest_id == 300
    finally:
        m.close()


# --- Kafka only ---------------------------------------------------------------------


def test_killed_broker_fails_flush_then_sink_recovers_on_new_broker(tmp_path, unique_name):
    run = unique_name("run")
    delivery_timeout_s = 2.0
    with EmbeddedBroker(state_dir=tmp_path / "b1") as b:
        port = b.port
        conf = {"bootstrap.servers": b.bootstrap}
        sink = KafkaSink(run, conf, num_partitions=WORLD, delivery_timeout_s=delivery_timeout_s)
        markers = KafkaMarkers(run, conf, timeout_s=delivery_timeout_s)
        for fr in make_frames(run, 1, 0, 20):
            sink.write(fr, generation=0, partition=0)
        assert sink.flush(30).ok
        markers.append_marker(b"m1")

        b.kill()
        frames = make_frames(run, 2, 0, 400, max_frame_bytes=1024)
        assert len(frames) > 4 * MAX_OUTSTANDING
        t0 = time.monotonic()
        for fr in frames:
            # the first frames beyond MAX_OUTSTANDING wait for a report, one stall in all;
            # then every frame is queued at once: write never waits on a dead broker frame by frame
            sink.write(fr, generation=0, partition=0)
        assert time.monotonic() - t0 < OUTSTANDING_STALL_S + 1.0
        t0 = time.monotonic()
        res = sink.flush(30)
        took = time.monotonic() - t0
        assert not res.ok and "failed" in str(res.error)
        assert took < delivery_timeout_s + 3, took
        with pytest.raises(SinkError):
            markers.append_marker(b"m2")

    # A new (empty) broker on the same address: a fresh producer, topics recreated.
    with EmbeddedBroker(port=port, state_dir=tmp_path / "b2"):
        frames = make_frames(run, 3, 1, 20)
        for fr in frames:
            sink.write(fr, generation=0, partition=1)
        res = sink.flush(30).raise_for_error()
        got = read_all(KafkaSource(run, conf, timeout_s=5), 0, 1, res.ranges[(0, 1)][0])
        assert [f.checkpoint_id for _, f in got] == [3] * len(frames)
        assert markers.append_marker(b"m3") == 0
        assert markers.read_markers() == [(0, b"m3")]
        sink.close()
        markers.close()


def test_kafka_producer_keeps_at_most_the_idempotent_in_flight_limit_outstanding(broker, unique_name):
    """librdkafka busy-polls while a message waits behind the 5 an idempotent producer may have
    in flight, so a write waits (serving reports) until fewer are queued or in flight; every
    frame still arrives, in order, in one range."""
    run = unique_name("run")
    sink = KafkaSink(run, {"bootstrap.servers": broker.bootstrap}, num_partitions=1)
    frames = make_frames(run, 1, 0, 3000, max_frame_bytes=4096)
    assert len(frames) > 10 * MAX_OUTSTANDING
    outstanding = []
    for fr in frames:
        sink.write(fr, generation=0, partition=0)
        outstanding.append(len(sink._p.producer))
    res = sink.flush(30).raise_for_error()
    assert max(outstanding) <= MAX_OUTSTANDING, outstanding
    assert res.ranges[(0, 0)] == [(0, len(frames) - 1)]
    got = read_all(KafkaSource(run, {"bootstrap.servers": broker.bootstrap}, timeout_s=5), 0, 0, (0, len(frames) - 1))
    assert [f.chunk_index for _, f in got] == list(range(len(frames)))
    sink.close()


def test_kafka_producer_stops_waiting_on_a_stalled_broker_and_waits_again_after_the_flush(tmp_path, unique_name):
    """A broker paused (SIGSTOP) past OUTSTANDING_STALL_S: the writes stop waiting for it and
    queue the rest; once it resumes the flush delivers every frame, and the next checkpoint's
    writes keep to MAX_OUTSTANDING again."""
    run = unique_name("run")
    with EmbeddedBroker(state_dir=tmp_path / "b") as b:
        assert b.pid is not None
        sink = KafkaSink(run, {"bootstrap.servers": b.bootstrap}, num_partitions=1, delivery_timeout_s=30)
        sink.write(make_frames(run, 1, 0, 1)[0], generation=0, partition=0)
        sink.flush(30).raise_for_error()  # the topic exists and the producer is connected
        frames = make_frames(run, 2, 0, 3000, max_frame_bytes=4096)
        assert len(frames) > 10 * MAX_OUTSTANDING
        stalled = []
        os.kill(b.pid, signal.SIGSTOP)
        try:
            for fr in frames:
                sink.write(fr, generation=0, partition=0)
                stalled.append(len(sink._p.producer))
        finally:
            os.kill(b.pid, signal.SIGCONT)
        assert max(stalled) > MAX_OUTSTANDING, stalled  # stopped waiting on the paused broker
        res = sink.flush(30).raise_for_error()
        assert res.frames[(0, 0)] == len(frames)
        again = []
        for fr in make_frames(run, 3, 0, 3000, max_frame_bytes=4096):
            sink.write(fr, generation=0, partition=0)
            again.append(len(sink._p.producer))
        sink.flush(30).raise_for_error()
        assert max(again) <= MAX_OUTSTANDING, again
        sink.close()


def test_kafka_full_local_queue_is_back_pressure_not_an_error(broker, unique_name):
    run = unique_name("run")
    conf = {"bootstrap.servers": broker.bootstrap}
    sink = KafkaSink(
        run, conf, num_partitions=1, queue_full_timeout_s=20, producer_conf={"queue.buffering.max.messages": 2, "linger.ms": 5}
    )
    frames = make_frames(run, 1, 0, 2000, max_frame_bytes=1024)
    assert len(frames) > 50
    for fr in frames:
        sink.write(fr, generation=0, partition=0)  # BufferError inside: poll and retry
    res = sink.flush(30).raise_for_error()
    assert res.frames[(0, 0)] == len(frames)
    assert res.ranges[(0, 0)] == [(0, len(frames) - 1)]
    sink.close()


def test_kafka_range_starting_past_the_end_times_out_with_its_location(broker, unique_name):
    # Tansu answers a fetch past the end with nothing at all (Kafka: OFFSET_OUT_OF_RANGE).
    run = unique_name("run")
    conf = {"bootstrap.servers": broker.bootstrap}
    sink = KafkaSink(run, conf, num_partitions=1)
    sink.write(make_frames(run, 1, 0, 1)[0], generation=0, partition=0)
    sink.flush(30).raise_for_error()
    t0 = time.monotonic()
    with pytest.raises(
        SourceError,
        match=rf"topic {run}.rows.g0 partition 0: nothing at offset 5 "
        r"within 1s \(reading through offset 9\)",
    ):
        read_all(KafkaSource(run, conf, timeout_s=1), 0, 0, (5, 9))
    assert time.monotonic() - t0 < 5
    sink.close()


def test_kafka_prepared_read_serves_a_partitions_reads_in_offset_order(broker, unique_name):
    """A restore asks for the newest link first; two adjacent runs of one partition come back
    in offset order (one pass, no seek back), each exactly as `read_range` gives it, through
    the consumer `prepare` connected ahead; the next read connects its own."""
    run = unique_name("run")
    conf = {"bootstrap.servers": broker.bootstrap}
    sink, source = KafkaSink(run, conf, num_partitions=1), KafkaSource(run, conf, timeout_s=5)
    try:
        for ckpt in (1, 2):  # base, then the delta right after it
            for fr in make_frames(run, ckpt, 0, 40, max_frame_bytes=700):
                sink.write(fr, generation=0, partition=0)
        res = sink.flush(30).raise_for_error()
        ((first, last),) = res.ranges[(0, 0)]
        ids = [f.checkpoint_id for _, f in read_all(source, 0, 0, (first, last))]
        split = first + ids.index(2)
        newest_first = [RangeRead(0, 0, split, last), RangeRead(0, 0, first, split - 1)]
        for prepared in (True, False):
            if prepared:
                source.prepare()
            got = [(i, p, f.checkpoint_id) for i, p, f in source.read_ranges(newest_first)]
            assert [p for _, p, _ in got] == list(range(first, last + 1)), prepared
            assert {(i, c) for i, _, c in got} == {(1, 1), (0, 2)}, prepared
    finally:
        sink.close()
        source.close()


def test_kafka_read_ahead_is_taken_over_by_the_same_reads_and_fetched_before_they_are_asked(tmp_path, unique_name):
    """`read_ahead` (a restarted job, while it builds its model) starts the reads the restore
    will make: the restore's `read_ranges` of exactly those reads takes them over and gets
    what a plain read gets, even once the broker is gone (they were fetched ahead). Other
    reads drop it and are served as usual; a read ahead after the read, or of a topic that
    does not exist, changes nothing, and the read then says what is missing."""
    run = unique_name("run")
    with EmbeddedBroker(state_dir=tmp_path / "broker") as broker:
        conf = {"bootstrap.servers": broker.bootstrap}
        sink = KafkaSink(run, conf, num_partitions=2)
        source = KafkaSource(run, conf, timeout_s=5)
        try:
            for part in (0, 1):
                for fr in make_frames(run, 1, part, 60, seed=part, max_frame_bytes=900):
                    sink.write(fr, generation=0, partition=part)
            res = sink.flush(30).raise_for_error()
            reads = [RangeRead(0, p, *res.ranges[(0, p)][0]) for p in (0, 1)]
            plain = sorted((i, p, f.payload.sum().item()) for i, p, f in source.read_ranges(reads))
            assert len(plain) == sum(r.last - r.first + 1 for r in reads)

            source.prepare()
            source.read_ahead([reads[1]])  # another read than the restore's: dropped
            got = sorted((i, p, f.payload.sum().item()) for i, p, f in source.read_ranges(reads))
            assert got == plain and source.reads_ahead_used == 0
            source.read_ahead(reads)  # after the read: nothing is started
            assert source.reads_ahead_used == 0 and source._ahead is None

            source.prepare()
            source.read_ahead([RangeRead(7, 0, 0, 3)])  # no such topic: the read ahead is not started
            assert source._ahead is None
            with pytest.raises(SourceError, match="does not exist"):
                list(source.read_ranges([RangeRead(7, 0, 0, 3)]))

            source.prepare()
            source.read_ahead(reads)
            ahead = source._ahead
            assert ahead is not None
            deadline = time.monotonic() + 20  # a few KB: fetched and decoded in milliseconds; bounded on a loaded machine
            while ahead.frames.decoded < len(plain) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ahead.frames.decoded == len(plain)  # every frame decoded ahead, before the broker goes
            broker.kill()
            got = sorted((i, p, f.payload.sum().item()) for i, p, f in source.read_ranges(reads))
            assert got == plain and source.reads_ahead_used == 1
        finally:
            sink.close()
            source.close()


def test_kafka_read_ahead_meets_a_damaged_frame_or_a_short_partition_as_a_plain_read_does(broker, unique_name):
    """Frames decoded ahead (ckpt/stream/kafka/decoded_ahead.py) change nothing a restore sees
    when the stream is damaged: a corrupt frame raises its `FrameError` with its offset after
    the frames before it, and a read past a partition's end fails with the plain read's
    `SourceError` (the failed read ahead is dropped and the read made afresh)."""
    run = unique_name("run")
    conf = {"bootstrap.servers": broker.bootstrap}
    sink, source = KafkaSink(run, conf, num_partitions=1), KafkaSource(run, conf, timeout_s=3)
    try:
        frames = make_frames(run, 1, 0, 40, max_frame_bytes=700)
        bad = bytearray(frames[5])
        bad[len(bad) // 2] ^= 1
        for fr in frames[:5] + [bytes(bad)] + frames[6:]:
            sink.write(fr, generation=0, partition=0)
        ((first, last),) = sink.flush(30).raise_for_error().ranges[(0, 0)]
        reads = [RangeRead(0, 0, first, last)]

        def read(ahead: bool) -> tuple[list[int], str]:
            source.prepare()
            if ahead:
                source.read_ahead(reads)
                time.sleep(1)
            seen = []
            with pytest.raises(FrameError, match="CRC mismatch") as e:
                for _, pos, _ in source.read_ranges(reads):
                    seen.append(pos)
            return seen, str(e.value)

        plain, ahead = read(False), read(True)
        assert ahead == plain and plain[0] == list(range(first, first + 5)) and f"offset {first + 5}" in plain[1]
        assert source.reads_ahead_used == 1

        past_end = [RangeRead(0, 0, first + 6, last + 3)]  # behind the damaged frame
        source.prepare()
        source.read_ahead(past_end)
        time.sleep(1)
        with pytest.raises(SourceError) as e:
            list(source.read_ranges(past_end))
        assert source.reads_ahead_used == 1  # the failed read ahead was not taken over
        with pytest.raises(SourceError) as plain_e:
            list(source.read_ranges(past_end))
        assert str(e.value) == str(plain_e.value)
    finally:
        sink.close()
        source.close()


def test_kafka_prepared_read_of_an_unreachable_broker_is_a_bounded_error(unique_name):
    source = KafkaSource(unique_name("run"), {"bootstrap.servers": "127.0.0.1:1"}, timeout_s=1)
    source.prepare()
    t0 = time.monotonic()
    with pytest.raises(SourceError, match="cannot list topics"):
        list(source.read_ranges([RangeRead(0, 0, 0, 0)]))
    assert time.monotonic() - t0 < 5
    source.close()


def test_kafka_markers_topic_created_after_the_reachability_check_is_read(broker, unique_name):
    """`check_reachable` connects the consumer the next `read_markers` uses; the topic listing
    it got then is refreshed when it lacks the markers topic, so markers appended since (by
    another process: a fresh producer) are read, not taken for an empty log."""
    run = unique_name("run")
    conf = {"bootstrap.servers": broker.bootstrap}
    reader, writer = KafkaMarkers(run, conf, timeout_s=10), KafkaMarkers(run, conf, timeout_s=10)
    try:
        reader.check_reachable(5)  # no markers topic yet
        pos = writer.append_marker(b"COMMIT 1")
        assert reader.read_markers() == [(pos, b"COMMIT 1")]
        reader.check_reachable(5)
        assert reader.read_markers() == [(pos, b"COMMIT 1")]
    finally:
        reader.close()
        writer.close()


def test_kafka_markers_tail_read_after_prepare_starts_no_later_than_the_log_end_prepare_saw(broker, unique_name):
    """`prepare` asks for the markers log's watermarks on its connect, so the tail read asks
    nothing more; records appended after it (another writer) are read all the same."""
    run = unique_name("run")
    conf = {"bootstrap.servers": broker.bootstrap}
    reader, writer = KafkaMarkers(run, conf, timeout_s=10), KafkaMarkers(run, conf, timeout_s=10)
    try:
        first = [(writer.append_marker(b"m%d" % i), b"m%d" % i) for i in range(20)]
        reader.prepare(5)
        reader.check_reachable(5)
        later = [(writer.append_marker(b"n%d" % i), b"n%d" % i) for i in range(10)]
        tail = reader.read_tail(5)
        # from 5 before the end prepare saw (asking again would start at later[-5])
        assert tail.records == first[-5:] + later and not tail.whole
    finally:
        reader.close()
        writer.close()


class CountedMarkers(NamedTuple):
    run: str
    reader: KafkaMarkers
    writer: KafkaMarkers
    connects: list  # one entry per consumer connect (`_connect` call)


@pytest.fixture
def counted_markers(broker, unique_name, monkeypatch):
    """A reader and a writer of one run's markers log on the broker, the connects counted."""
    connects: list = []
    real = kafka_consumer._connect
    for module in (kafka_consumer, kafka_markers):  # where `_connect` is called: connects ahead, the markers log's own
        monkeypatch.setattr(module, "_connect", lambda *a: connects.append(a) or real(*a))
    run = unique_name("run")
    conf = {"bootstrap.servers": broker.bootstrap}
    pair = CountedMarkers(run, KafkaMarkers(run, conf, timeout_s=10), KafkaMarkers(run, conf, timeout_s=10), connects)
    yield pair
    pair.reader.close()
    pair.writer.close()


def test_kafka_markers_tail_reads_reuse_one_consumer_and_read_exactly_what_was_appended(counted_markers, monkeypatch):
    """A committer reads the log before every commit: after the first read found the topic,
    each later `read_markers` reads on with one consumer kept between reads (no connect, no
    connect ahead from `prepare`), gets exactly the records appended since (its own and another
    writer's), an empty list promptly when there are none, and a read from 0 still reads all."""
    m = counted_markers
    made: list = []
    real = kafka_markers.Consumer
    monkeypatch.setattr(kafka_markers, "Consumer", lambda conf: made.append(conf) or real(conf))
    log = [(m.writer.append_marker(b"m0"), b"m0")]
    assert m.reader.read_markers() == log
    for i in range(1, 6):
        mine = m.reader.append_marker(b"own%d" % i)
        theirs = m.writer.append_marker(b"their%d" % i)
        m.reader.prepare(5)
        got = m.reader.read_markers(mine)
        assert got == [(mine, b"own%d" % i), (theirs, b"their%d" % i)], got
        log += got
    assert len(made) == 1 and made[0]["fetch.wait.max.ms"] == kafka_markers.TAIL_FETCH_WAIT_MS, made
    t0 = time.monotonic()
    assert m.reader.read_markers(log[-1][0] + 1) == []
    assert time.monotonic() - t0 < 5, "an empty read waits for an end-of-partition, not the read's timeout"
    assert m.reader.read_markers() == log
    assert len(made) == 1 and len(m.connects) <= 1, (made, m.connects)  # the first read's connect only
    m.reader.close()
    assert m.reader._kept is None


def test_kafka_markers_read_ahead_is_caught_up_at_restore_time_by_the_reader_it_connected(counted_markers, broker):
    """`open_for_restore` reads the markers log while the model is built (`CatalogAhead`):
    a COMMIT appended after that read is the one the caught-up fold restores, read by the
    consumer the read ahead connected for it (no connect on the restore's path)."""
    run, reader, writer, connects = counted_markers

    def commit(cid: int) -> None:
        link = ChainLink(checkpoint_id=cid, full=True, generation=cid, ranges={0: [OffsetRange(0, 0)]}, rows=1, bytes=10)
        writer.append_marker(
            encode_marker(Marker(kind="commit", run_id=run, checkpoint_id=cid, step=cid, world_size=1, chain=[link]))
        )

    for cid in (1, 2, 3):
        commit(cid)
    reader.prepare(5)
    read = CatalogAhead(reader, run, broker.bootstrap, 5).take()
    assert read is not None and [m.checkpoint_id for m in read.catalog.restorable()] == [3, 2, 1]
    assert len(connects) == 2 and read.catalog.read == 3  # connects: the read's and the catch-up's
    commit(4)
    reader.check_reachable(5)  # as the restore does first
    caught = catch_up_recent(read.catalog, reader, broker.bootstrap)
    assert [m.checkpoint_id for m in caught.restorable()] == [4, 3, 2, 1]
    assert len(connects) == 2 and caught.read == 4  # the one appended record decoded


def test_kafka_markers_reachability_check_waits_for_the_connect_prepare_started(counted_markers):
    """`prepare` starts the check's connect ahead (a checkpointer does while it is being built):
    the check then takes that consumer, connecting no other, and the markers read uses it.
    Where nothing listens, the prepared check fails with the one-line error all the same."""
    run, reader, writer, connects = counted_markers
    pos = writer.append_marker(b"COMMIT 1")
    reader.prepare(5)
    reader.check_reachable(5)
    assert reader.read_markers() == [(pos, b"COMMIT 1")]
    assert len(connects) == 1
    address = f"127.0.0.1:{free_port()}"
    dead = KafkaMarkers(run, {"bootstrap.servers": address}, timeout_s=1)
    try:
        dead.prepare(1)
        with pytest.raises(BrokerUnreachable, match=rf"^no Kafka broker answered at {address} within 1 s "):
            dead.check_reachable(1)
    finally:
        dead.close()


def test_a_markers_read_prepared_while_the_broker_was_away_reads_once_it_answers(unique_name, tmp_path):
    """Rank 0's commit prepares its markers read when a job arrives (`Committer.prepare`) and
    reads without a reachability check: a connect that found no broker must not fail a read
    made once the broker answers, and a read while none answers fails with the sink's error."""
    run, port = unique_name("run"), free_port()
    conf = {"bootstrap.servers": f"127.0.0.1:{port}"}
    markers = KafkaMarkers(run, conf, timeout_s=1)
    try:
        markers.prepare(0.5)
        time.sleep(1.0)  # the connect has given up on the port nothing listens on
        with pytest.raises(SourceError, match="cannot list topics"):
            markers.read_markers()
        markers.prepare(0.5)
        time.sleep(1.0)
        with EmbeddedBroker(port=port, state_dir=tmp_path / "broker"):
            writer = KafkaMarkers(run, conf, timeout_s=10)
            try:
                pos = writer.append_marker(b"COMMIT 1")
            finally:
                writer.close()
            assert markers.read_markers() == [(pos, b"COMMIT 1")]
    finally:
        markers.close()


def test_kafka_readers_prepared_before_their_broker_started_read_once_it_answers(unique_name, tmp_path):
    """A job opens its readers before it builds its model (`ckpt.log.backend.open_for_restore`):
    a broker that comes up meanwhile (a restart of both) must not fail the restore."""
    run, port = unique_name("run"), free_port()
    conf = {"bootstrap.servers": f"127.0.0.1:{port}"}
    markers, source = KafkaMarkers(run, conf, timeout_s=10), KafkaSource(run, conf, timeout_s=1)
    try:
        markers.prepare(1)
        source.prepare()  # bounded by the source's timeout, 1 s
        time.sleep(1.5)  # both connects have given up on the port nothing listens on yet
        with EmbeddedBroker(port=port, state_dir=tmp_path / "broker") as broker:
            assert broker.bootstrap == conf["bootstrap.servers"]
            sink, writer = KafkaSink(run, conf, num_partitions=1), KafkaMarkers(run, conf, timeout_s=10)
            try:
                for fr in make_frames(run, 1, 0, 5):
                    sink.write(fr, generation=0, partition=0)
                ((first, last),) = sink.flush(30).raise_for_error().ranges[(0, 0)]
                pos = writer.append_marker(b"COMMIT 1")
            finally:
                sink.close()
                writer.close()
            markers.check_reachable(5)
            assert markers.read_markers() == [(pos, b"COMMIT 1")]
            assert [f.checkpoint_id for _, f in read_all(source, 0, 0, (first, last))] == [1] * (last - first + 1)
    finally:
        markers.close()
        source.close()


def test_kafka_conf_is_validated(broker, unique_name):
    conf = {"bootstrap.servers": broker.bootstrap}
    with pytest.raises(ValueError, match="idempotence"):
        KafkaSink(unique_name("r"), conf, num_partitions=1, producer_conf={"enable.idempotence": False})
    with pytest.raises(ValueError, match="acks"):
        KafkaSink(unique_name("r"), conf, num_partitions=1, producer_conf={"acks": 1})
    with pytest.raises(ValueError, match="bootstrap"):
        KafkaSink(unique_name("r"), {}, num_partitions=1)
    with pytest.raises(ValueError, match="run id"):
        KafkaSink("bad/run", conf, num_partitions=1)
    sink = KafkaSink(unique_name("r"), conf, num_partitions=1)
    with pytest.raises(SinkError, match="1 partitions"):
        sink.write(b"x", generation=0, partition=1)
    sink.close()


# --- filesystem only ----------------------------------------------------------------


def test_fs_torn_tail_is_ignored_and_cut_by_the_next_writer(tmp_path):
    run = "torn"
    sink, source = FsSink(tmp_path, run), FsSource(tmp_path, run)
    frames = make_frames(run, 1, 0, 400)
    for fr in frames:
        sink.write(fr, generation=0, partition=0)
    ((first, last),) = sink.flush().raise_for_error().ranges[(0, 0)]
    sink.close()
    seg = sink.segment_path(0, 0)
    good_size = seg.stat().st_size
    nxt = make_frames(run, 2, 0, 10)[0]
    head, _ = encode_record(nxt)

    tails = {
        "half a header": head[:5],
        "header, half a payload": head + nxt[: len(nxt) // 2],
        "complete record, bad CRC": head + nxt[:-1] + bytes([nxt[-1] ^ 1]),
        "zero fill": b"\0" * 300,
    }
    for what, tail in tails.items():
        with open(seg, "r+b") as f:
            f.truncate(good_size)
            f.seek(good_size)
            f.write(tail)
        assert [p for p, _ in source.scan(0, 0)] == [p for p, _ in read_all(source, 0, 0, (first, last))], what
        assert len(read_all(source, 0, 0, (first, last))) == len(frames), what
        with pytest.raises((SourceError, FrameError)):
            read_all(source, 0, 0, (first, good_size))  # the torn record is never returned

    # The next writer cuts the torn tail and appends after the last good record.
    w = FsSink(tmp_path, run)
    w.write(nxt, generation=0, partition=0)
    ((pos, _),) = w.flush().raise_for_error().ranges[(0, 0)]
    assert pos == good_size
    (got,) = read_all(source, 0, 0, (pos, pos))
    assert same(got[1], decode_frame(nxt))
    assert [p for p, _ in source.scan(0, 0)][-1] == pos
    w.close()


def test_fs_corruption_before_the_tail_is_an_error_not_a_tail(tmp_path):
    run = "corrupt"
    sink, source = FsSink(tmp_path, run), FsSource(tmp_path, run)
    for fr in make_frames(run, 1, 0, 400):
        sink.write(fr, generation=0, partition=0)
    ((first, last),) = sink.flush().raise_for_error().ranges[(0, 0)]
    assert last > first
    sink.close()
    seg = sink.segment_path(0, 0)
    data = bytearray(seg.read_bytes())
    data[first + 100] ^= 0xFF  # inside the first record, more records follow
    seg.write_bytes(bytes(data))
    with pytest.raises(FrameError, match="byte 0"):
        list(source.scan(0, 0))
    # A writer reads headers only and cuts nothing but an invalid *last* record:
    # it appends behind the damage instead of truncating the records after it.
    w = FsSink(tmp_path, run)
    w.write(b"x", generation=0, partition=0)
    assert w.flush().raise_for_error().ranges[(0, 0)] == [(len(data), len(data))]
    assert seg.read_bytes()[: len(data)] == bytes(data)


def test_fs_markers_torn_tail(tmp_path):
    m = FsMarkers(tmp_path, "mk")
    p0, p1 = m.append_marker(b"a"), m.append_marker(b"bb")
    m.close()
    head, _ = encode_record(b"ccc")
    with open(m.path, "ab") as f:
        f.write(head + b"c")  # crash in the middle of the third append
    assert FsMarkers(tmp_path, "mk").read_markers() == [(p0, b"a"), (p1, b"bb")]
    m2 = FsMarkers(tmp_path, "mk")
    p2 = m2.append_marker(b"ddd")
    assert m2.read_markers() == [(p0, b"a"), (p1, b"bb"), (p2, b"ddd")]
    assert Path(m2.path).read_bytes().count(REC_MAGIC) == 3
