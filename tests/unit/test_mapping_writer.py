"""The writer side of managed-collision mappings: which record each checkpoint writes per shard
(`MappingDiffer` over full, incremental and one-shot-diff chains, failures and restores), the
mapping frames `write_rows` puts after a job's rows and indexes, the admitted-slot check, the
writer thread's bookkeeping (pending bytes, states kept only once committed), a survivor's full
records, and `MappingCapture` on an unsharded MCH module. Without managed-collision tables the
writer writes exactly what it wrote before: the same frames, index and bytes."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt.capture.copy_on_write import CowRows
from ckpt.capture.mapping import MappingCapture, states_nbytes
from ckpt.capture.snapshot import ShardRows, Snapshot
from ckpt.log.markers import FrameMeta, IndexEntry, index_frames
from ckpt.save.handoff import CopyOrder
from ckpt.stream.filesystem import FsSink, FsSource
from ckpt.stream.frames import Frame
from ckpt.stream.mapping import MappingRecord, join_mapping, mapping_frames
from ckpt.write.writer import MappingDiffer, Outcome, RankReport, RankWriter, WriteJob, encode_frames, write_rows
from sharding.managed_collision import FREE, PINNED_COUNT, ManagedCollisionError, McShard, McState, capture
from sharding.shard_views import ShardView

RUN = "mapping-run"
MAX_FRAME_BYTES = 2048  # small: a shard's rows and a full mapping record take several frames each
H = 2**40
SEGMENTS = (0, 200, 400)  # an MC table of 400 rows over two ranks; this rank holds slots 200..399


# --- synthetic states and jobs -------------------------------------------------------------------


def _state(table: str = "mc.t", offset: int = 200, size: int = 200, *, access: bool = False) -> McState:
    """A shard state after some training: three quarters of its slots held, the miss slot pinned."""
    raw = np.full(size, FREE, dtype=np.int64)
    held = size * 3 // 4
    raw[:held] = np.arange(held) * 7 + 1 + offset * 1000
    counts = np.arange(size, dtype=np.int64) % 13 + 1
    counts[-1] = PINNED_COUNT
    last = np.full(size, 5, dtype=np.int64) if access else None
    return McState(
        table=table,
        slot_offset=offset,
        raw_ids=raw,
        counts=counts,
        last_access=last,
        current_iter=10,
        last_eviction_iter=9,
        history_ids=np.array([3, 5], dtype=np.int64),
        history_last_access=np.array([10, 10], dtype=np.int64) if access else None,
        history_capacity=64,
        segments=SEGMENTS if size == 200 else (0, offset, offset + size),
        input_hash_size=H,
    )


def _next(s: McState, admit: Sequence[int] = (), bump: Sequence[int] = ()) -> McState:
    """The shard's state one step later: new ids in local slots `admit` (an eviction), counters
    of local slots `bump` moved on, one more history id."""
    raw, counts = s.raw_ids.copy(), None if s.counts is None else s.counts.copy()
    for i, slot in enumerate(admit):
        raw[slot] = 10**12 + s.current_iter * 1000 + i
    if counts is not None:
        counts[list(admit) + list(bump)] += 1
    evicted = bool(len(admit))
    hist = np.array([s.current_iter], dtype=np.int64)
    history = hist if evicted else np.concatenate([s.history_ids, hist])
    access = None if s.last_access is None else s.last_access.copy()
    return McState(
        table=s.table,
        slot_offset=s.slot_offset,
        raw_ids=raw,
        counts=counts,
        last_access=access,
        current_iter=s.current_iter + 1,
        last_eviction_iter=s.current_iter + 1 if evicted else s.last_eviction_iter,
        history_ids=history,
        history_last_access=None if s.history_last_access is None else np.full(history.size, s.current_iter + 1),
        history_capacity=s.history_capacity,
        segments=s.segments,
        input_hash_size=s.input_hash_size,
    )


def _rows(table: str, global_rows: list[int] | np.ndarray, seed: int = 0) -> ShardRows:
    ids = torch.as_tensor(np.asarray(global_rows, dtype=np.int64))
    g = torch.Generator().manual_seed(seed)
    return ShardRows(
        table, 200, 0, ids, torch.randn(ids.numel(), 4, generator=g), {"momentum1": torch.rand(ids.numel(), generator=g)}
    )


def _job(cid: int, chain: list[int], mapping: tuple[McState, ...] = (), rows: list[ShardRows] | None = None) -> WriteJob:
    """Checkpoint `cid` with chain `chain` (generation: its first link), rows of a dense table
    `t` and of the MC table's slots 200..209 unless given."""
    if rows is None:
        rows = [_rows("t", np.arange(0, 120, 3), seed=cid), _rows("mc.t", np.arange(200, 210), seed=cid + 1)]
    return WriteJob(
        checkpoint_id=cid,
        step=10 * cid,
        generation=chain[0] if chain else cid,
        chain=chain,
        snapshot=Snapshot(cid, 10 * cid, len(chain) == 1, rows, 0.0),
        trainer_state={"step": 10 * cid},
        mapping=mapping,
    )


def _kinds(records: list[MappingRecord]) -> list[tuple[str, int]]:
    return [("full" if r.full else "delta", r.follows) for r in records]


# --- which record each checkpoint writes ---------------------------------------------------------


def test_full_checkpoints_write_full_records() -> None:
    differ = MappingDiffer()
    s = _state()
    for cid in (1, 2, 3):
        job = _job(cid, [cid], (s,))
        assert _kinds(differ.records(job)) == [("full", 0)]
        differ.committed(job)
        assert differ.kept == [cid]
        s = _next(s, bump=[1])


def test_an_incremental_chain_writes_each_change_since_the_checkpoint_before() -> None:
    differ = MappingDiffer()
    s1 = _state()
    s2 = _next(s1, bump=[0, 1])
    s3 = _next(s2, admit=[150, 151], bump=[4])
    jobs = [_job(1, [1], (s1,)), _job(2, [1, 2], (s2,)), _job(3, [1, 2, 3], (s3,))]
    got = []
    for job in jobs:
        records = differ.records(job)
        got.append(_kinds(records))
        differ.committed(job)
        if len(got) == 1:
            state = records[0].resolve(None, 0)
        else:
            state = records[0].resolve(state, job.chain[-2])
        assert state == job.mapping[0]  # the chain's records replay to each checkpoint's state
    assert got == [[("full", 0)], [("delta", 1)], [("delta", 2)]]
    assert differ.kept == [1, 3]  # the last checkpoint and its chain's first


def test_one_shot_diffs_follow_their_base_not_the_checkpoint_before() -> None:
    differ = MappingDiffer()
    s1 = _state()
    s2 = _next(s1, bump=[0])
    s3 = _next(s2, admit=[7], bump=[1])
    base = differ.records(_job(1, [1], (s1,)))
    differ.committed(_job(1, [1], (s1,)))
    first = differ.records(_job(2, [1, 2], (s2,)))
    differ.committed(_job(2, [1, 2], (s2,)))
    second = differ.records(_job(3, [1, 3], (s3,)))
    assert _kinds(base + first + second) == [("full", 0), ("delta", 1), ("delta", 1)]
    assert second[0].resolve(base[0].resolve(None, 0), 1) == s3
    assert second[0].delta is not None and second[0].delta.admitted_slots.tolist() == [207]


def test_a_failed_checkpoints_state_is_never_followed() -> None:
    """Incremental: checkpoint 2 failed, so a delta after it finds no state of 2 and writes the
    full one. One-shot diff: a failed diff leaves the base kept, and the next diff follows it."""
    s1 = _state()
    s2, s3 = _next(s1, bump=[0]), _next(_next(s1, bump=[0]), bump=[2])
    differ = MappingDiffer()
    differ.committed(_job(1, [1], (s1,)))
    differ.records(_job(2, [1, 2], (s2,)))  # written, but its checkpoint failed: no `committed`
    assert differ.kept == [1]
    assert _kinds(differ.records(_job(3, [1, 2, 3], (s3,)))) == [("full", 0)]
    assert _kinds(differ.records(_job(3, [1, 3], (s3,)))) == [("delta", 1)]


def test_a_delta_without_its_base_writes_the_full_record_and_a_restore_seeds_the_base() -> None:
    s = _state()
    later = _next(s, bump=[3])
    differ = MappingDiffer()
    assert _kinds(differ.records(_job(8, [5, 8], (later,)))) == [("full", 0)]  # nothing kept: a fresh writer
    differ.seed(5, [s])
    assert differ.kept == [5]
    [record] = differ.records(_job(8, [5, 8], (later,)))
    assert _kinds([record]) == [("delta", 5)] and record.resolve(s, 5) == later
    # a restore's seed replaces whatever was kept
    differ.committed(_job(8, [5, 8], (later,)))
    differ.seed(9, [later])
    assert differ.kept == [9]


def test_a_state_of_another_shard_or_policy_is_not_followed() -> None:
    s = _state()
    differ = MappingDiffer()
    differ.seed(1, [s, _state("mc.u", access=False)])
    other_policy = _state("mc.u", access=True)  # keeps last access now: not the state it follows
    moved = _state(offset=0, size=200)  # same table, another slot range: matched by neither
    records = differ.records(_job(2, [1, 2], (_next(s, bump=[1]), other_policy, moved)))
    assert _kinds(records) == [("delta", 1), ("full", 0), ("full", 0)]


def test_a_delta_larger_than_the_full_record_is_written_full() -> None:
    s = _state(size=40, offset=0)
    changed = _next(s, admit=list(range(30)))  # most ids replaced: the change outweighs the state
    differ = MappingDiffer()
    differ.seed(1, [s])
    assert _kinds(differ.records(_job(2, [1, 2], (changed,), rows=[_rows("mc.t", np.arange(40))]))) == [("full", 0)]


# --- the frames write_rows writes ----------------------------------------------------------------


def _write(root: Path, job: WriteJob, **kwargs) -> RankReport:
    sink = FsSink(root, RUN)
    try:
        return write_rows(job, run_id=RUN, rank=0, sink=sink, max_frame_bytes=MAX_FRAME_BYTES, flush_timeout_s=10.0, **kwargs)
    finally:
        sink.close()


def _frames(root: Path, generation: int, first: int, last: int) -> list[Frame]:
    return [f for _, f in FsSource(root, RUN).read_range(generation, 0, first, last)]


def _segment(root: Path, generation: int) -> bytes:
    return (root / f"{RUN}.rows.g{generation}" / "0.seg").read_bytes()


def test_without_mapping_the_writer_writes_exactly_the_row_frames_as_before(tmp_path: Path) -> None:
    """No managed-collision table: the frames, their bytes and the index are those of the rows
    alone, whether the job goes through the differ or not."""
    job = _job(1, [1])
    plain = _write(tmp_path / "plain", job)
    differ = MappingDiffer()
    through = _write(tmp_path / "differ", job, mapping=differ.records(job))
    assert differ.records(job) == [] and plain.ok and through.ok

    # what the writer wrote before mappings existed: each shard's `encode_frames`, in order, then a flush
    sink = FsSink(tmp_path / "before", RUN)
    meta, nbytes = [], 0
    for shard in job.snapshot.shards:
        for f in encode_frames(job, shard, {}, RUN, 0, MAX_FRAME_BYTES):
            sink.write(f.data, generation=1, partition=0)
            meta.append(FrameMeta(shard.table, shard.col_offset, f.first_row, f.last_row, shard.num_cols))
            nbytes += len(f.data)
    done = sink.flush().raise_for_error()
    sink.close()
    before = index_frames(0, done.positions[(1, 0)], meta)

    assert _segment(tmp_path / "plain", 1) == _segment(tmp_path / "differ", 1) == _segment(tmp_path / "before", 1)
    for report in (plain, through):
        assert (report.index, report.bytes, report.rows) == (before, nbytes, 50)
        assert report.ranges == plain.ranges and not any(e.is_mapping for e in report.index)


def test_mapping_frames_follow_the_rows_each_shard_indexed_as_a_run_of_its_own(tmp_path: Path) -> None:
    a, b = _state("mc.t"), _state("mc.u", offset=0, size=120)
    a2 = _next(a, admit=[3, 9], bump=[20])
    differ = MappingDiffer()
    differ.seed(1, [a, b])
    rows = [_rows("t", np.arange(0, 120, 3)), _rows("mc.t", [200, 203, 209, 220]), _rows("mc.u", [5])]
    job = _job(2, [1, 2], (a2, b), rows=rows)
    records = differ.records(job)
    assert _kinds(records) == [("delta", 1), ("delta", 1)]  # b unchanged: a delta of its scalars alone
    report = _write(tmp_path / "m", job, mapping=records)
    bare = _write(tmp_path / "r", _job(2, [1, 2], (), rows=rows))
    assert report.ok, report.error

    # the rows' frames and entries are those of the job without mapping; the mapping's come after
    n_rows = len(bare.index)
    assert report.index[:n_rows] == bare.index and report.rows == bare.rows
    assert _segment(tmp_path / "m", 1).startswith(_segment(tmp_path / "r", 1))
    entries = report.index[n_rows:]
    assert [(e.table, e.col_offset, e.min_row, e.max_row, e.cols, e.is_mapping) for e in entries] == [
        ("mc.t", 0, 200, 399, 0, True),
        ("mc.u", 0, 0, 119, 0, True),
    ]
    assert bare.index[-1].last < entries[0].first <= entries[0].last < entries[1].first
    mapping_bytes = 0
    for entry, record in zip(entries, records):
        frames = _frames(tmp_path / "m", 1, entry.first, entry.last)
        assert all(f.is_mapping and f.checkpoint_id == 2 for f in frames)
        assert join_mapping(frames) == record
        mapping_bytes += sum(
            len(f.data) for f in mapping_frames(record, run_id=RUN, checkpoint_id=2, rank=0, max_frame_bytes=MAX_FRAME_BYTES)
        )
    assert report.bytes == bare.bytes + mapping_bytes


def test_a_full_record_larger_than_a_frame_is_cut_into_several(tmp_path: Path) -> None:
    s = _state(access=True)
    job = _job(1, [1], (s,))
    [record] = MappingDiffer().records(job)
    report = _write(tmp_path, job, mapping=[record])
    [entry] = [e for e in report.index if e.is_mapping]
    frames = _frames(tmp_path, 1, entry.first, entry.last)
    assert len(frames) > 1 and [f.chunk_index for f in frames] == list(range(len(frames)))
    encoded = mapping_frames(record, run_id=RUN, checkpoint_id=1, rank=0, max_frame_bytes=MAX_FRAME_BYTES)
    assert all(len(f.data) <= MAX_FRAME_BYTES for f in encoded)
    assert join_mapping(frames).state == s
    assert entry == IndexEntry(
        partition=0, first=entry.first, last=entry.last, table="mc.t", col_offset=0, min_row=200, max_row=399, cols=0
    )


def test_a_delta_admitting_slots_whose_rows_are_not_in_the_checkpoint_fails_it_and_writes_nothing(tmp_path: Path) -> None:
    s = _state()
    later = _next(s, admit=[5, 40, 41])  # slots 205, 240, 241 redrawn; the rows hold 200..209 only
    differ = MappingDiffer()
    differ.seed(1, [s])
    job = _job(2, [1, 2], (later,))
    records = differ.records(job)
    assert _kinds(records) == [("delta", 1)]
    report = _write(tmp_path, job, mapping=records)
    assert not report.ok and report.index == [] and report.bytes == 0
    assert "table mc.t: 2 slots given new ids since checkpoint 1 (240, 241)" in report.error and "\n" not in report.error
    assert not (tmp_path / f"{RUN}.rows.g1").exists() or _segment(tmp_path, 1) == b""
    # with the redrawn rows in the checkpoint it is written
    rows = [_rows("mc.t", [200, 205, 240, 241])]
    assert _write(tmp_path / "ok", _job(2, [1, 2], (later,), rows=rows), mapping=records).ok


def test_the_admitted_slot_check_reads_a_copy_on_write_snapshots_rows(tmp_path: Path) -> None:
    s = _state()
    later = _next(s, admit=[5])
    view = ShardView("mc.t", 200, 0, torch.zeros(200, 4), {"momentum1": torch.zeros(200)})
    differ = MappingDiffer()
    differ.seed(1, [s])
    for local, ok in ((torch.tensor([0, 5, 9]), True), (torch.tensor([0, 9]), False), (None, True)):
        job = _job(2, [1, 2], (later,), rows=[])
        job.snapshot = Snapshot(2, 20, False, [], 0.0, lazy=CowRows.of([view], [local], [24]))
        report = _write(tmp_path / str(local is None) / str(ok), job, mapping=differ.records(job))
        assert report.ok == ok, report.error
        if not ok:
            assert "table mc.t: 1 slots given new ids since checkpoint 1 (205)" in report.error


# --- the writer thread ---------------------------------------------------------------------------


class _SoloWriter(RankWriter):
    """The writer of rank 1 without a process group: a checkpoint commits when this rank's
    report is ok and its id is not in `fail`; the first coordination waits for `gate`."""

    def __init__(self, root: Path, fail: set[int]) -> None:
        self.fail = fail
        self.gate = threading.Event()
        self.reports: dict[int, RankReport] = {}
        super().__init__(
            run_id=RUN,
            rank=1,
            sink=FsSink(root, RUN),
            group=None,  # type: ignore[arg-type]
            max_frame_bytes=MAX_FRAME_BYTES,
            flush_timeout_s=10.0,
            committer=None,
        )

    def _coordinate(self, job: WriteJob, report: RankReport) -> Outcome:
        self.gate.wait(30)
        self.reports[job.checkpoint_id] = report
        ok = report.ok and job.checkpoint_id not in self.fail
        return Outcome(checkpoint_id=job.checkpoint_id, step=job.step, committed=ok, error=report.error or "failed")


def _records_written(root: Path, job: WriteJob, report: RankReport) -> list[MappingRecord]:
    out = []
    for e in report.index:
        if e.is_mapping:
            frames = [f for _, f in FsSource(root, RUN).read_range(job.generation, 1, e.first, e.last)]
            out.append(join_mapping(frames))
    return out


def test_the_writer_thread_keeps_a_state_once_committed_and_counts_the_mapping_as_pending(tmp_path: Path) -> None:
    writer = _SoloWriter(tmp_path, fail={3})
    try:
        s1 = _state()
        s2 = _next(s1, bump=[1])
        s3 = _next(s2, bump=[2])
        s4 = _next(s3, bump=[3])
        s5 = _next(s4, admit=[2])
        s6 = _next(s5, bump=[4])
        jobs = [
            _job(1, [1], (s1,)),
            _job(2, [1, 2], (s2,)),
            _job(3, [1, 2, 3], (s3,)),  # fails: its state is never followed
            _job(4, [1, 2, 3, 4], (s4,)),  # runs through 3: left unwritten
            _job(5, [5], (s5,)),
            _job(6, [5, 6], (s6,)),
        ]
        assert states_nbytes(jobs[0].mapping) == 200 * 8 * 2 + 2 * 8  # raw ids, counts, history
        writer.submit(jobs[0])  # its outcome waits for the gate: its bytes stay pending until then
        assert writer.pending_bytes == jobs[0].nbytes == jobs[0].snapshot.nbytes + states_nbytes(jobs[0].mapping)
        writer.gate.set()
        for job in jobs[1:]:
            writer.submit(job)
        writer.drain()
        outcomes = writer.poll()
        assert [(o.checkpoint_id, o.committed) for o in outcomes] == [(c, c not in (3, 4)) for c in range(1, 7)]
        assert outcomes[3].after_failed == 3 and writer.pending_bytes == 0
        got = {j.checkpoint_id: _kinds(_records_written(tmp_path, j, writer.reports[j.checkpoint_id])) for j in jobs}
        assert got == {1: [("full", 0)], 2: [("delta", 1)], 3: [("delta", 2)], 4: [], 5: [("full", 0)], 6: [("delta", 5)]}
        assert writer.mapping.kept == [5, 6]
    finally:
        writer.gate.set()
        assert [o.committed for o in writer.close(10.0)] == []
        writer.sink.close()


# --- a survivor's snapshot -----------------------------------------------------------------------


def test_a_survivor_writes_full_records(tmp_path: Path) -> None:
    from ckpt.config import SinkConfig
    from ckpt.recovery.survivor import save_survivor

    s = _next(_state(), admit=[1])
    job = _job(9, [], (s,))
    sink = SinkConfig(kind="filesystem", fs_root=str(tmp_path / "stream"), dense_dir=str(tmp_path / "dense"))
    record = save_survivor(
        sink,
        run_id=RUN,
        rank=0,
        job=job,
        attempt="a1",
        world_size=2,
        base=7,
        dense_state={"trainer": job.trainer_state},
        shards=[],
        deadline=time.monotonic() + 30,
    )
    [entry] = [e for e in record.link.index if e.is_mapping]
    frames = [f for _, f in FsSource(tmp_path / "stream", RUN).read_range(9, 0, entry.first, entry.last)]
    assert join_mapping(frames) == MappingRecord.of_state(s)


# --- the hand-off and the capture ----------------------------------------------------------------


def test_a_copy_order_carries_no_mapping_unless_given() -> None:
    assert CopyOrder._fields[-1] == "mapping" and CopyOrder._field_defaults == {"mapping": ()}


def _mc_shard(key: str = "mc.t", zch: int = 24) -> McShard:
    """One unsharded MCH module on the CPU (slots 0..zch-1), evicting every 3 training forwards."""
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, MCHManagedCollisionModule

    mch = MCHManagedCollisionModule(
        zch_size=zch, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(), eviction_interval=3, input_hash_size=1000
    )
    mch.train()
    return McShard(key, "mc", "t", mch, ShardView(key, 0, 0, torch.zeros(zch, 2)))


def _step(shard: McShard, rng: np.random.Generator) -> None:
    from torchrec.sparse.jagged_tensor import JaggedTensor

    ids = torch.from_numpy(rng.integers(0, 120, size=10))
    shard.mch({"f": JaggedTensor(values=ids, lengths=torch.tensor([10]))})
    if shard.mch._evicted:
        shard.mch.evict()  # what the sharded module does once it reset the rows


def test_mapping_capture_takes_each_shard_like_its_last_capture(replay_seed) -> None:
    rng = np.random.default_rng(replay_seed.value)
    shards = [_mc_shard("mc.a"), _mc_shard("mc.b", zch=16)]
    cap = MappingCapture(shards)
    assert len(cap) == 2 and not cap.empty and MappingCapture([]).empty and MappingCapture([]).capture() == ()
    prev = cap.capture()
    assert [s.table for s in prev] == ["mc.a", "mc.b"]
    shared = 0
    for step in range(7):
        for shard in shards:
            _step(shard, rng)
        cur = cap.capture()
        assert all(c == capture(sh) for c, sh in zip(cur, shards)), f"{replay_seed}: step {step}"
        evicted = shards[0].mch._last_eviction_iter == shards[0].mch._current_iter
        assert (cur[0].raw_ids is prev[0].raw_ids) == (not evicted), f"{replay_seed}: step {step}"
        shared += cur[0].raw_ids is prev[0].raw_ids
        prev = cur
    assert shared
    # after a restore's load, the next capture starts from the loaded states
    from sharding.managed_collision import load

    for shard, state in zip(shards, prev):
        load(shard, state)
    cap.adopt(prev)
    assert all(c.raw_ids is p.raw_ids for c, p in zip(cap.capture(), prev))
    with pytest.raises(ManagedCollisionError, match="are not this rank's managed-collision shards"):
        cap.adopt(prev[:1])
