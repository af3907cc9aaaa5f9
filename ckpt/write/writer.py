"""The per-rank writer thread: quantize, frame and ship a snapshot; rank 0 commits it.

Each rank's writer takes snapshots in checkpoint order. For each it encodes every shard's
rows (weights and optimizer state, each with its codec) into frames, writes them to its
partition (= rank) of the generation's rows topic, and flushes. Then all writers meet:

Coordination (why a side process group): the writers report to rank 0 with a gather
(ckpt/write/exchange.py) on a dedicated gloo group that only writer threads use, in checkpoint
order. The training thread never takes part, so it never waits on Kafka; the writers
need no polling, no extra topic and no shared filesystem to find each other, and a
rank's report (offset ranges, frame index, loop state with the reader's position and
RNG, stall) travels with the same call. Rank 0 then writes the dense file and, only if
every rank's rows and the dense file are durable and every earlier link of the chain
committed, the COMMIT marker; it broadcasts the outcome back so every rank learns it in
the same order.

Managed-collision tables (docs/design/managed-collision.md): a job also carries the states of
this rank's MC shards at its checkpoint step (`WriteJob.mapping`). After the job's row frames
the writer writes one mapping record per shard (ckpt/stream/mapping.py), indexed with
``cols == 0``: the change since the state of the checkpoint the rows' delta is against, or the
whole state, as `MappingDiffer` decides. Rows and mapping of a shard thus travel in the same
link, and a restore that replays the rows' chain replays the mapping's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch.distributed as dist

from ckpt.capture.copy_on_write import AsideStats
from ckpt.capture.mapping import states_nbytes
from ckpt.capture.snapshot import ShardRows, Snapshot
from ckpt.capture.threads import lower_thread_priority
from ckpt.faults import maybe_die, maybe_slow, maybe_slow_copy
from ckpt.log.markers import FrameMeta, IndexEntry, OffsetRange, index_frames
from ckpt.quant import codec_for_width, encode_owned, get_codec
from ckpt.quant.device import check_flags
from ckpt.stream.frames import EncodedFrame, OptimState, chunk_rows
from ckpt.stream.mapping import MappingRecord, mapping_frames, record_for
from ckpt.stream.sink import FrameSink
from ckpt.write.exchange import Exchange
from sharding.managed_collision import ManagedCollisionError, McState

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class WriteJob:
    """What the training thread hands to its writer at a checkpoint step."""

    checkpoint_id: int
    step: int
    generation: int
    chain: list[int]  # checkpoint ids a restore replays, this one last
    snapshot: Snapshot
    trainer_state: dict[str, Any]  # step, samples_seen, reader position, RNG: this rank's loop state
    dense_state: dict[str, Any] | None = None  # rank 0 only: host copies of dense params and optimizer
    weight_codec: str = "fp32"
    optimizer_codec: str = "fp32"
    epoch: int = 0  # the trainer attempt's epoch, written into every frame (ckpt/log/fencing.py)
    step_unix: float = 0.0  # wall clock when the step's rows were snapshot (rank 0's is in the COMMIT)
    # the managed-collision shards' states at the checkpoint step, one per shard in shard order
    # (ckpt/capture/mapping.py); empty without managed-collision tables
    mapping: tuple[McState, ...] = ()

    @property
    def follows(self) -> int:
        """The checkpoint whose rows this one's rows are a delta of (the link before it in its
        chain); 0: a full checkpoint, or a survivor's snapshot (no chain)."""
        return self.chain[-2] if len(self.chain) > 1 else 0

    @property
    def nbytes(self) -> int:
        """Host bytes the job holds until it is written: its rows and its mapping states."""
        return self.snapshot.nbytes + states_nbytes(self.mapping)


@dataclass(kw_only=True)
class RankReport:
    """One rank's result for one checkpoint, gathered to rank 0."""

    rank: int
    ok: bool
    error: str
    ranges: dict[int, list[OffsetRange]]  # partition (= this rank) -> its acknowledged ranges
    index: list[IndexEntry]  # this rank's frames, one entry per run of one shard's frames
    rows: int
    bytes: int
    stall_ms: float  # the hand-off, the waits for the copy, and (copy-on-write) the rows saved aside
    write_s: float
    trainer_state: dict[str, Any]
    stall_new_bytes: int = 0  # host memory its stall allocated fresh (`Snapshot.new_bytes`)
    aside_peak_bytes: int = 0  # copy-on-write (ckpt/capture/copy_on_write.py): the most held aside at once
    encodings: dict[str, str] = field(default_factory=dict)  # "weights" / "optimizer.<state>" -> codec used


@dataclass(kw_only=True)
class Outcome:
    """What every rank learns about a checkpoint once rank 0 decided."""

    checkpoint_id: int
    step: int
    committed: bool
    error: str = ""
    bytes: int = 0
    rows: int = 0
    full: bool = False
    stall_ms: list[float] = field(default_factory=list)
    stall_new_bytes: list[int] = field(default_factory=list)  # per rank: host memory its stall allocated fresh
    aside_peak_bytes: list[int] = field(default_factory=list)  # per rank, copy-on-write: the most held aside
    write_s: float = 0.0
    commit_unix: float = 0.0  # time.time() once the COMMIT marker was durable; 0 when none was
    fenced: bool = False  # a newer attempt holds the run: this one must stop (`error` says which)
    # not written: its chain runs through this earlier checkpoint, which failed (0: not so)
    after_failed: int = 0


class Committer(Protocol):
    """Rank 0's half of a checkpoint (ckpt/write/committer.py), as rank 0's writer thread calls it."""

    def prepare(self) -> None:
        """A job arrived: start what the commit will wait on (connecting the markers log's
        reader) while the rows are encoded and written."""

    def __call__(self, job: WriteJob, reports: list[RankReport]) -> Outcome:
        """Every rank's report in: the dense file and the COMMIT (or FAILED) marker."""

    def settle(self, outcome: Outcome) -> None:
        """Every rank knows `outcome`: bookkeeping that need not delay them."""


class MappingDiffer:
    """Which mapping record each of a job's managed-collision states becomes, on one rank.

    A job's rows are a delta of checkpoint `WriteJob.follows`; its mapping follows the same
    checkpoint, so that a restore replaying the rows' chain finds the state each delta record
    applies to in the link before it. The differ keeps the states a later job can follow: the
    last checkpoint it knows committed and that checkpoint's chain[0] (the base a one-shot diff
    follows), or the states a restore loaded (`seed`). A state is kept only once its checkpoint
    committed: a failed checkpoint's state is never followed (the jobs whose chains run through
    it are left unwritten anyway). Where it lacks the state of `follows` (after a failure, or the
    first checkpoint after a restore of a one-shot diff), a job gets full records, which need
    nothing before them. Used by the writer thread; `seed` may come from another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[int, dict[tuple[str, int], McState]] = {}  # checkpoint id -> (table, slot offset) -> state

    @property
    def kept(self) -> list[int]:
        """The checkpoints whose states a later job may follow, ascending."""
        with self._lock:
            return sorted(self._kept)

    def records(self, job: WriteJob) -> list[MappingRecord]:
        """One record per state of `job.mapping`, in order: the change from the state of
        checkpoint `job.follows` when kept and smaller (`record_for`), else the full state."""
        follows = job.follows
        with self._lock:
            base = self._kept.get(follows, {}) if follows else {}
        out = []
        for cur in job.mapping:
            prev = base.get((cur.table, cur.slot_offset))
            try:
                out.append(record_for(prev, cur, follows if prev is not None else 0))
            except ManagedCollisionError:  # not a state of the same shard and policy: nothing to follow
                out.append(MappingRecord.of_state(cur))
        return out

    def committed(self, job: WriteJob) -> None:
        """`job`'s checkpoint committed: its states may be followed, with those of its
        chain[0]; every other kept state is let go."""
        with self._lock:
            keep = {job.checkpoint_id: {(s.table, s.slot_offset): s for s in job.mapping}}
            base = job.chain[0] if job.chain else 0
            if base != job.checkpoint_id and base in self._kept:
                keep[base] = self._kept[base]
            self._kept = keep

    def seed(self, checkpoint_id: int, states: Sequence[McState]) -> None:
        """A restore of checkpoint `checkpoint_id` loaded `states`: the first checkpoint after it
        may follow them (and nothing kept before)."""
        with self._lock:
            self._kept = {checkpoint_id: {(s.table, s.slot_offset): s for s in states}}


class RankWriter:
    """The writer thread of one rank. `submit` never blocks; `poll` returns outcomes."""

    def __init__(
        self,
        *,
        run_id: str,
        rank: int,
        sink: FrameSink,
        group: dist.ProcessGroup,
        max_frame_bytes: int,
        flush_timeout_s: float,
        committer: Committer | None,
        nice: int = 0,
    ) -> None:
        assert (committer is not None) == (rank == 0), "rank 0, and only rank 0, commits"
        self.run_id = run_id
        self.rank = rank
        self.sink = sink
        self.group = group
        self.max_frame_bytes = max_frame_bytes
        self.flush_timeout_s = flush_timeout_s
        self.committer = committer
        self.nice = nice
        self._jobs: queue.Queue[WriteJob | None] = queue.Queue()
        self._outcomes: queue.Queue[Outcome] = queue.Queue()
        # checkpoints whose outcome was a failure, as every rank's writer learns them, in the
        # same order: a queued checkpoint whose chain runs through one is not written
        self._failed: set[int] = set()
        self._pending_bytes = 0
        self.submitted = 0  # the id of the last checkpoint submitted (set once its job is queued)
        self.mapping = MappingDiffer()  # this rank's mapping records (`seed` it after a restore)
        self._lock = threading.Condition()
        self._exchange: Exchange[RankReport, Outcome] | None = None  # made by the writer thread
        self._thread = threading.Thread(target=self._run, name=f"deltarec-writer-{rank}", daemon=True)
        self._thread.start()

    # -- training-thread side ---------------------------------------------------------
    @property
    def pending_bytes(self) -> int:
        """Host bytes held by snapshots not yet written (the bounded quantity)."""
        with self._lock:
            return self._pending_bytes

    @property
    def pending_jobs(self) -> int:
        """Checkpoints submitted whose outcome is not decided yet (queued or being written)."""
        with self._jobs.mutex:
            return self._jobs.unfinished_tasks

    def submit(self, job: WriteJob) -> None:
        with self._lock:
            self._pending_bytes += job.nbytes
        self._jobs.put(job)
        self.submitted = max(self.submitted, job.checkpoint_id)

    def drain(self) -> None:
        """Block until every submitted job has its outcome (`poll` then returns them all)."""
        self._jobs.join()

    def poll(self) -> list[Outcome]:
        """Outcomes decided since the last poll, oldest first; never blocks."""
        out = []
        while True:
            try:
                out.append(self._outcomes.get_nowait())
            except queue.Empty:
                return out

    def wait_for_room(self, needed: int, budget: int, timeout_s: float | None = None) -> bool:
        """Block until `needed` more bytes fit in `budget` (the `wait` back-pressure)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self._pending_bytes and self._pending_bytes + needed > budget:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def wait_for_jobs_below(self, most: int) -> None:
        """Block until fewer than `most` checkpoints are undecided (`pending_jobs`): a checkpoint
        that may not be coalesced again waits here, and the training thread, blocked, leaves its
        core to the writer."""
        with self._lock:
            while self.pending_jobs >= most:
                self._lock.wait()

    def close(self, timeout_s: float | None = None) -> list[Outcome]:
        """Finish every submitted job, stop the thread, return the last outcomes."""
        self._jobs.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"checkpoint writer of rank {self.rank} did not finish within {timeout_s}s")
        return self.poll()

    # -- writer thread ----------------------------------------------------------------
    def _lower_priority(self) -> None:
        """Add `nice` to this thread's niceness (Linux: per thread), so that encoding and
        producing yield the cores to the training thread when both want them."""
        try:
            lower_thread_priority(self.nice)
        except OSError as exc:  # a sandbox may forbid it; the writer still works at normal priority
            logger.warning("checkpoint writer of rank %d: cannot lower its priority: %s", self.rank, exc)

    def _run(self) -> None:
        self._lower_priority()
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            try:
                if self.committer is not None:
                    self.committer.prepare()
                dead = next((c for c in job.chain[:-1] if c in self._failed), 0)
                report = self._write(job) if not dead else _unwritten(job, self.rank, dead)
                outcome = self._coordinate(job, report)
                if dead:
                    outcome = replace(outcome, after_failed=dead)
            except Exception as exc:  # noqa: BLE001 - a writer bug must reach the trainer, not kill the thread silently
                logger.error("checkpoint %d: writer failed: %s", job.checkpoint_id, traceback.format_exc())
                outcome = Outcome(
                    checkpoint_id=job.checkpoint_id,
                    step=job.step,
                    committed=False,
                    error=f"writer error on rank {self.rank}: {exc}",
                )
            finally:
                with self._lock:
                    self._pending_bytes -= job.nbytes
                    self._lock.notify_all()
                job.snapshot.release()  # its memory may now hold a later snapshot
            if not outcome.committed:
                self._failed.add(job.checkpoint_id)
            else:
                self.mapping.committed(job)
            self._outcomes.put(outcome)
            self._jobs.task_done()  # after the outcome is out: `drain` then finds it
            with self._lock:
                self._lock.notify_all()  # one job fewer (`wait_for_jobs_below`)

    def _write(self, job: WriteJob) -> RankReport:
        try:
            mapping = self.mapping.records(job)
        except Exception as exc:  # noqa: BLE001 - fails this checkpoint only; every rank must still report
            logger.error("checkpoint %d: mapping records failed: %s", job.checkpoint_id, traceback.format_exc())
            return _not_written(job, self.rank, f"rank {self.rank}: mapping records: {type(exc).__name__}: {exc}")
        return write_rows(
            job,
            run_id=self.run_id,
            rank=self.rank,
            sink=self.sink,
            max_frame_bytes=self.max_frame_bytes,
            flush_timeout_s=self.flush_timeout_s,
            mapping=mapping,
        )

    def _coordinate(self, job: WriteJob, report: RankReport) -> Outcome:
        if self._exchange is None:  # made here, on the writer thread, the group's only user
            self._exchange = Exchange(self.group)
        decided = self._exchange(report, partial(self._commit, job) if self.rank == 0 else None)
        if self.committer is not None:
            self.committer.settle(decided)
        return decided

    def _commit(self, job: WriteJob, reports: list[RankReport]) -> Outcome:
        """Rank 0: every rank's reports in, the outcome out; never raises (every rank waits for it)."""
        assert self.committer is not None
        try:
            return self.committer(job, reports)
        except Exception as exc:  # noqa: BLE001 - the outcome must still reach every rank
            logger.error("checkpoint %d: commit failed: %s", job.checkpoint_id, traceback.format_exc())
            error = f"commit failed on rank 0: {exc}"
            return Outcome(checkpoint_id=job.checkpoint_id, step=job.step, committed=False, error=error)


def _unwritten(job: WriteJob, rank: int, dead: int) -> RankReport:
    """This rank's report for a checkpoint left unwritten: its chain runs through checkpoint
    `dead`, which failed, so no restore could ever use its rows. Every rank's writer knows the
    same outcomes in the same order, so every rank leaves it unwritten, and the queue of
    checkpoints decided before the failure was known drains at once instead of writing rows in
    vain (the checkpointer makes the next checkpoint it decides full)."""
    return _not_written(job, rank, f"not written: its chain runs through checkpoint {dead}, which failed")


def _not_written(job: WriteJob, rank: int, error: str) -> RankReport:
    """This rank's report for a checkpoint it wrote nothing of, saying why (`error`)."""
    job.snapshot.wait()  # a GPU snapshot's copies to host end before its buffers are released
    return RankReport(
        rank=rank,
        ok=False,
        error=error,
        ranges={},
        index=[],
        rows=0,
        bytes=0,
        stall_ms=job.snapshot.stall_s * 1e3,
        write_s=0.0,
        trainer_state=job.trainer_state,
    )


def write_rows(
    job: WriteJob,
    *,
    run_id: str,
    rank: int,
    sink: FrameSink,
    max_frame_bytes: int,
    flush_timeout_s: float,
    mapping: Sequence[MappingRecord] = (),
) -> RankReport:
    """Encode the job's rows into frames, then its `mapping` records (`MappingDiffer.records`),
    write them to partition `rank` of the job's generation and flush: this rank's report
    (acknowledged ranges and frame index, or why not). The writer thread's work for each
    checkpoint, and a surviving rank's (ckpt/recovery/survivor.py).

    Each mapping record's frames follow all the row frames, indexed as a run of their own
    (``cols == 0``, the shard's slots as rows); their bytes count in the report's. A delta record
    whose admitted slots are not all among the job's rows of its table fails the checkpoint:
    an admission redraws its slot's row, so that row must be in the same checkpoint."""
    t0 = time.perf_counter()
    job.snapshot.wait()  # on CUDA the device-to-host copies finish after take() returned
    meta: list[FrameMeta] = []  # per frame written, in write order
    used: dict[str, str] = {}  # "weights" / "optimizer.<state>" -> codec this job's frames use
    rows = nbytes = 0
    error = ""
    try:
        _check_admitted(job.snapshot, mapping)  # before any frame: a failed check leaves none behind
        if job.snapshot.lazy is not None:
            maybe_slow_copy(job.checkpoint_id, "read")
        half, past_half = job.snapshot.shard_count // 2, False
        for i, shard in job.snapshot.pieces():  # copy-on-write: one window of a shard at a time
            if i >= half and not past_half:
                past_half = True
                maybe_die("rows", job.checkpoint_id, rank)
            if shard.global_rows.numel() == 0:
                continue
            for frame in encode_frames(job, shard, used, run_id, rank, max_frame_bytes):
                sink.write(frame.data, generation=job.generation, partition=rank)
                meta.append(
                    FrameMeta(
                        table=shard.table,
                        col_offset=shard.col_offset,
                        first_row=frame.first_row,
                        last_row=frame.last_row,
                        cols=shard.num_cols,
                    )
                )
                nbytes += len(frame.data)
            rows += shard.global_rows.numel()
        for record in mapping:
            for frame in mapping_frames(
                record,
                run_id=run_id,
                checkpoint_id=job.checkpoint_id,
                rank=rank,
                max_frame_bytes=max_frame_bytes,
                epoch=job.epoch,
            ):
                sink.write(frame.data, generation=job.generation, partition=rank)
                meta.append(FrameMeta(record.table, 0, frame.first_row, frame.last_row, 0))
                nbytes += len(frame.data)
        maybe_slow(job.checkpoint_id)
        result = sink.flush(flush_timeout_s)
        if result.error is not None:
            error = f"rank {rank}: {result.error}"
    except Exception as exc:  # noqa: BLE001 - encoding/sink errors fail this checkpoint only
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
        result = None
    aside = job.snapshot.lazy.stats if job.snapshot.lazy is not None else AsideStats()
    ranges: dict[int, list[OffsetRange]] = {}
    index: list[IndexEntry] = []
    if not error and result is not None:
        key = (job.generation, rank)
        positions = result.positions.get(key, [])
        if len(positions) != len(meta):
            error = f"rank {rank}: {len(meta)} frames written but {len(positions)} acknowledged"
        else:
            ranges = {rank: [OffsetRange(*r) for r in result.ranges.get(key, [])]} if positions else {}
            index = index_frames(rank, positions, meta)
    return RankReport(
        rank=rank,
        ok=not error,
        error=error,
        ranges=ranges,
        index=index,
        rows=rows,
        bytes=nbytes,
        stall_ms=job.snapshot.stall_s * 1e3 + aside.seconds * 1e3,
        aside_peak_bytes=aside.peak_bytes,
        write_s=time.perf_counter() - t0,
        trainer_state=job.trainer_state,
        encodings=used,
        stall_new_bytes=job.snapshot.new_bytes,
    )


def _snapshot_rows(snapshot: Snapshot, table: str) -> np.ndarray:
    """The global rows of `table` that `snapshot` holds (copy-on-write: the rows it will read)."""
    parts: list[np.ndarray] = []
    if snapshot.lazy is None:
        parts = [s.global_rows.cpu().numpy() for s in snapshot.shards if s.table == table]
    else:
        for s in snapshot.lazy.shards:
            if s.view.table == table:
                local = np.arange(s.view.num_rows) if s.local is None else s.local.cpu().numpy()
                parts.append(local + s.view.row_offset)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _check_admitted(snapshot: Snapshot, mapping: Sequence[MappingRecord]) -> None:
    """Refuse a delta record whose admitted slots are not all among the snapshot's rows of its
    table: an admission redraws its slot's row, so a restore of the chain needs that row from
    the same checkpoint (one line naming the table)."""
    for record in mapping:
        if record.delta is None or record.delta.admitted_slots.size == 0:
            continue
        admitted = record.delta.admitted_slots
        missing = admitted[~np.isin(admitted, _snapshot_rows(snapshot, record.table))]
        if missing.size:
            shown = ", ".join(str(int(x)) for x in missing[:5]) + (", ..." if missing.size > 5 else "")
            raise RuntimeError(
                f"table {record.table}: {missing.size} slots given new ids since checkpoint {record.follows} "
                f"({shown}) have no rows in this checkpoint, though an admission redraws its row"
            )


def encode_frames(
    job: WriteJob, shard: ShardRows, used: dict[str, str], run_id: str, rank: int, max_frame_bytes: int
) -> Iterator[EncodedFrame]:
    """Encode one shard's rows and split them into frames (lazily, in row order).
    Records the codecs it encodes with in `used`."""
    ids = shard.global_rows
    weight_codec = get_codec(job.weight_codec)
    if shard.encoded is not None:  # encoded on the device by the snapshot (ckpt.capture.encode_on)
        if shard.encoded.codec != weight_codec.name:
            raise RuntimeError(
                f"table {shard.table}: the snapshot encoded its rows as {shard.encoded.codec}, "
                f"the checkpoint writes {weight_codec.name}"
            )
        check_flags(weight_codec.name, shard.encoded.flags, shard.table, ids)
        payload = shard.encoded.payload
    else:
        assert shard.weights is not None, "a snapshot holds its weights, encoded or not"
        payload = encode_owned(weight_codec, shard.weights, table=shard.table, row_ids=ids)  # the job owns the rows
    used["weights"] = weight_codec.name
    optim = []
    for name, state in sorted(shard.optimizer.items()):
        rows = state.reshape(state.shape[0], -1).float()
        codec = get_codec(codec_for_width(job.optimizer_codec, rows.shape[1]))
        used[f"optimizer.{name}"] = codec.name
        optim.append(OptimState(name, codec.code, encode_owned(codec, rows, table=shard.table, row_ids=ids)))
    return chunk_rows(
        run_id=run_id,
        checkpoint_id=job.checkpoint_id,
        rank=rank,
        table=shard.table,
        col_offset=shard.col_offset,
        dim=shard.num_cols,
        encoding=weight_codec.code,
        row_ids=ids,
        payload=payload,
        optim=optim,
        max_frame_bytes=max_frame_bytes,
        epoch=job.epoch,
    )
