"""A checkpoint's copy and hand-off (docs/design/dataflow.md, steps 3-4): the agreed rows and the
dense state to host memory, the tracker's marks, then the writer's job.

It runs inside the stall on the training thread, or on the copier thread beside the next step
(`ckpt.capture.overlap_copy`, ckpt/capture/overlapped_copy.py). `StallTiming` says where each
checkpoint's stall went on this rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ckpt.capture.snapshot import PlannedSnapshot, SnapshotTaker
from ckpt.capture.tracker import RowTracker
from ckpt.dense import state as dense_state
from ckpt.faults import maybe_die, maybe_slow_copy
from ckpt.recovery.priority import RowPriority
from ckpt.save.policy import Decision
from ckpt.types import JobIdentity
from ckpt.write.writer import RankWriter, WriteJob
from sharding.managed_collision import McState


class StallTiming(NamedTuple):
    """Where one checkpoint's stall went on this rank (milliseconds). With the copy overlapping
    the next step (`overlapped`, ckpt/capture/overlapped_copy.py) `take_ms` and `dense_ms` ran on the copier
    thread, and the stall is the hand-off plus `wait_ms`; else all of it ran in the stall."""

    checkpoint_id: int
    step: int
    full: bool
    agree_ms: float  # collecting the small all-reduce (started a step early when it could), waiting included
    take_ms: float  # copying the chosen rows to host memory
    dense_ms: float  # tracker marks, dense state capture
    stall_ms: float  # what the training thread lost to this checkpoint
    rows: int  # rows this rank copied
    snapshot_bytes: int
    since_base: float  # fraction of all ranks' rows changed since the baseline
    since_last: float  # ... since the previous checkpoint
    cpu_ms: float = 0.0  # CPU time of the training thread during the stall (the rest of stall_ms is waiting)
    new_bytes: int = 0  # host memory the copy allocated fresh and faulted in (`Snapshot.new_bytes`)
    overlapped: bool = False  # the copy ran beside the next step
    wait_ms: float = 0.0  # of stall_ms: the next step waiting for that copy


class CopyOrder(NamedTuple):
    """What a checkpoint's copy needs from the training thread (`Handoff.copy`), as of its
    checkpoint step: the training thread goes on while the copy runs."""

    checkpoint_id: int
    step: int
    decision: Decision
    final: bool
    trainer_state: dict[str, Any]
    fractions: tuple[float, float]  # agreed rows changed since the base, since the last checkpoint
    generation: int
    chain: list[int]
    codecs: tuple[str, str]  # (weight codec, optimizer codec)
    overlapped: bool
    agree_ms: float
    epoch: int  # this attempt's (ckpt/log/fencing.py), written into every frame
    restores: int  # the job's restores so far, kept in the dense state
    lost_samples: float  # samples partial recoveries lost over the run, kept in the dense state
    # the managed-collision shards' states at the checkpoint step (`ckpt.capture.mapping.MappingCapture`),
    # captured on the training thread before the next step; empty without managed-collision tables
    mapping: tuple[McState, ...] = ()


class _Taken(NamedTuple):
    """A checkpoint's bookkeeping, done before its rows are copied (`Handoff._mark`)."""

    planned: PlannedSnapshot
    dense: dict[str, Any] | None  # rank 0's dense state
    trainer_state: dict[str, Any]


class Handoff:
    """Copies one checkpoint at a time and hands it to this rank's writer.

    Under `ckpt.recovery.priority` it also counts what prioritized checkpoints left waiting since the
    last full one (ckpt/recovery/priority.py), kept with the rank's loop state.
    """

    def __init__(
        self,
        *,
        rank: int,
        identity: JobIdentity,
        taker: SnapshotTaker,
        tracker: RowTracker,
        priority: RowPriority | None,
        dense_capture: dense_state.DenseCapture,
        writer: RankWriter,
        full_bytes: int,
        priority_budget: float,
    ) -> None:
        self.priority_budget = priority_budget  # `ckpt.recovery.priority_budget`
        self.rank = rank
        self.identity = identity
        self.taker, self.tracker, self.priority = taker, tracker, priority
        self.dense_capture = dense_capture
        self.writer = writer
        self.full_bytes = full_bytes
        self.since_full = 0  # checkpoints since the last full one (prioritized checkpoints)
        self._full_samples = 0  # samples seen at the last full checkpoint

    def copy(
        self,
        c: CopyOrder,
        handoff_s: float,
        blocked: Callable[[], float],
        cpu_s: float,
        release: Callable[[], None] = lambda: None,
    ) -> StallTiming:
        """The copy of checkpoint `c`: the bitmap scan, the tracker's marks and the dense state,
        then (after `release()`) the rows to host memory, then the writer's job. Inside the stall
        on the training thread, or on the copier thread beside the next step, whose first lookup
        waits for `release()` and whose backward pass waits for the rest (ckpt/capture/overlapped_copy.py).
        `blocked()`, called as its last step before the writer gets the job, says how long the
        training thread has been waiting for it (inside the stall: all of it) on top of
        `handoff_s`, the stall before the copy started."""
        cid, step = c.checkpoint_id, c.step
        maybe_slow_copy(cid, "start")
        step_unix = time.time()  # the step is done and nothing of the next has changed a row yet
        t_take = time.perf_counter()
        taken, t_planned = self._mark(c)
        release()  # bitmaps, priority counters and dense state are free again; no row has changed yet
        t_released = time.perf_counter()
        maybe_slow_copy(cid, "rows")
        snapshot = taken.planned.copy()
        maybe_die("snapshot", cid, self.rank)
        t_copied = time.perf_counter()
        waited = blocked()
        snapshot.stall_s = handoff_s + waited
        timing = StallTiming(
            checkpoint_id=cid,
            step=step,
            full=c.decision.full,
            agree_ms=c.agree_ms,
            take_ms=(t_planned - t_take + t_copied - t_released) * 1e3,
            dense_ms=(t_released - t_planned) * 1e3,
            stall_ms=snapshot.stall_s * 1e3,
            rows=snapshot.rows,
            snapshot_bytes=snapshot.nbytes,
            since_base=c.fractions[0],
            since_last=c.fractions[1],
            cpu_ms=cpu_s * 1e3,
            new_bytes=snapshot.new_bytes,
            overlapped=c.overlapped,
            wait_ms=waited * 1e3 if c.overlapped else 0.0,
        )
        weight_codec, optimizer_codec = c.codecs
        self.writer.submit(
            WriteJob(
                checkpoint_id=cid,
                step=step,
                generation=c.generation,
                chain=c.chain,
                snapshot=snapshot,
                trainer_state=taken.trainer_state,
                dense_state=taken.dense,
                weight_codec=weight_codec,
                optimizer_codec=optimizer_codec,
                epoch=c.epoch,
                step_unix=step_unix,
                mapping=c.mapping,
            )
        )
        return timing

    def _mark(self, c: CopyOrder) -> tuple[_Taken, float]:
        """Everything of checkpoint `c` that must happen before the next step's first lookup:
        which rows it copies (and the time that was chosen), the tracker's marks, rank 0's dense
        state, the priority counters."""
        decision, cid, step = c.decision, c.checkpoint_id, c.step
        saved = None  # a prioritized checkpoint's rows (ckpt/recovery/priority.py)
        if decision.full or self.priority is None:
            planned = self.taker.plan(cid, step, full=decision.full, since_base=decision.since_base, weight_codec=c.codecs[0])
        else:
            saved = self.priority.select(self.tracker.changed_since_last(), int(self.priority_budget * self.full_bytes))
            planned = PlannedSnapshot.of(self.taker.take_rows(cid, step, saved))
        t_planned = time.perf_counter()
        self.tracker.remember(cid)
        if decision.full:
            self.tracker.mark_base()
        elif saved is not None:
            self.tracker.mark_saved(saved)
        else:
            self.tracker.mark_checkpoint()
        dense = self.dense_capture() if self.rank == 0 else None
        if dense is not None:
            dense.update(restores=c.restores, lost_samples=c.lost_samples, step=step, **self.identity._asdict())
        trainer_state = c.trainer_state
        if self.priority is not None:
            trainer_state["priority"] = self._priority_accounting(decision.full, saved, int(trainer_state["samples_seen"]))
        return _Taken(planned, dense, trainer_state), t_planned

    def _priority_accounting(self, full: bool, saved: list[torch.Tensor] | None, samples_seen: int) -> dict[str, int]:
        """After a checkpoint's marks: restart the counters it saved, and what a restore of the
        chain so far would lose on this rank (kept with the rank's loop state, ckpt/recovery/partial.py)."""
        assert self.priority is not None
        if full:
            self.priority.full()
            self.since_full, self._full_samples = 0, samples_seen
        elif saved is not None:
            self.priority.saved(saved)
            self.since_full += 1
        return {**self.priority.accounting(self.tracker.changed_since_last()), "full_samples_seen": self._full_samples}
