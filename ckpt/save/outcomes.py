"""Checkpoint outcomes as the writer reports them (ckpt/write/writer.py): counted on every rank,
logged and written to metrics on rank 0 (docs/design/dataflow.md, steps 5-6)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Generic, NamedTuple, TypeVar

from ckpt.events import CheckpointCommitted, CheckpointFailed, CheckpointSkipped, MetricsSink
from ckpt.log.fencing import Fenced
from ckpt.save.handoff import StallTiming
from ckpt.write.writer import Outcome
from common.id_ranges import id_ranges

logger = logging.getLogger(__name__)


#: outcomes and stalls a rank keeps (`Recent`): a checkpoint every step decides tens a second
HISTORY = 10_000

T = TypeVar("T")


class Recent(Generic[T]):
    """The newest `keep` items appended, and how many ever were (`total`): a run's history of
    checkpoints whose memory does not grow with every checkpoint of a job that runs for weeks."""

    def __init__(self, keep: int = HISTORY) -> None:
        self._items: deque[T] = deque(maxlen=keep)
        self.total = 0

    def append(self, item: T) -> None:
        self._items.append(item)
        self.total += 1

    def since(self, seen: int) -> list[T]:
        """The items appended after the first `seen` of all, those still kept."""
        start = max(len(self._items) - (self.total - seen), 0)
        return list(islice(self._items, start, None))

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> T:
        return self._items[i]


@dataclass
class AtRisk:
    """Steps a crash right after a step would lose: the step less the newest step whose
    checkpoint this rank knows committed (or restored) as the step ends. An upper bound: a
    COMMIT may be durable before its outcome reaches the rank. Kept for the run and for the
    window the trainer logs next (`take`)."""

    committed_step: int = 0  # the newest step known committed; 0: none (every step since the start is at risk)
    run_max: int = 0
    run_sum: int = 0
    run_steps: int = 0
    _sum: int = 0
    _steps: int = 0
    _max: int = 0

    def committed(self, step: int) -> None:
        """The checkpoint of `step` committed (or was restored)."""
        self.committed_step = max(self.committed_step, step)

    def after(self, step: int) -> None:
        """Step `step` ended (its checkpoint, if any, taken but not committed yet)."""
        n = max(0, step - self.committed_step)
        self._sum, self._steps, self._max = self._sum + n, self._steps + 1, max(self._max, n)
        self.run_sum, self.run_steps, self.run_max = self.run_sum + n, self.run_steps + 1, max(self.run_max, n)

    def take(self) -> tuple[float, int] | None:
        """(mean, max) over the steps since the last `take`; None when no step ended since."""
        if not self._steps:
            return None
        window = (self._sum / self._steps, self._max)
        self._sum = self._steps = self._max = 0
        return window


@dataclass
class CheckpointStats:
    """This rank's checkpoints so far: counts, totals of the committed ones, and the newest
    outcomes (as the writer reported them) and stalls."""

    committed: int = 0
    failed: int = 0
    skipped: int = 0
    coalesced: int = 0  # checkpoints due while the writers were behind, taken in the next one
    last: Outcome | None = None
    outcomes: Recent[Outcome] = field(default_factory=Recent)
    stalls: Recent[StallTiming] = field(default_factory=Recent)  # this rank's, one per checkpoint taken
    # the committed ones: full among them, bytes, and their stalls (the slowest rank's): how many
    # reported one, summed, the largest
    full: int = 0
    bytes: int = 0
    stalled: int = 0
    stall_ms_sum: float = 0.0
    stall_ms_max: float = 0.0
    at_risk: AtRisk = field(default_factory=AtRisk)


class Pending(NamedTuple):
    """What is remembered of a checkpoint between its stall and its outcome."""

    started_unix: float
    weight_codec: str


class Outcomes:
    """Every checkpoint from its stall to its outcome, and what became of it (`stats`)."""

    def __init__(self, metrics: MetricsSink) -> None:
        self.metrics = metrics
        self.stats = CheckpointStats()
        self._pending: dict[int, Pending] = {}
        # rank 0: checkpoints left unwritten behind a failed one (`Outcome.after_failed`), said
        # in one line once the run of them ends, not one line each
        self._unwritten: list[int] = []
        self._unwritten_after = 0

    def started(self, checkpoint_id: int, started_unix: float, weight_codec: str) -> None:
        """Checkpoint `checkpoint_id`'s stall began at `started_unix` (its time to durable counts from there)."""
        self._pending[checkpoint_id] = Pending(started_unix=started_unix, weight_codec=weight_codec)

    def skipped(self, step: int, rank: int) -> None:
        """The checkpoint of `step` dropped under back-pressure (`ckpt.write.on_backpressure: skip`)."""
        self.stats.skipped += 1
        if rank == 0:
            event = CheckpointSkipped(step=step)
            logger.warning(
                "checkpoint at step %d skipped: the writers are behind (ckpt.write.max_pending_bytes)",
                step,
                extra={"ckpt": event},
            )
            self.metrics.write(event)

    def coalesced(self, step: int, rank: int) -> None:
        """The checkpoint due at `step` is left to the next one, which writes its rows: the
        writers hold `ckpt.write.max_pending_checkpoints` checkpoints already. Counted, and said in
        the checkpoint lines (folded), not warned: nothing is lost."""
        self.stats.coalesced += 1
        if rank == 0:
            event = CheckpointSkipped(step=step, ckpt_coalesced=True)
            logger.info(
                "checkpoint at step %d coalesced into the next: the writers are behind (ckpt.write.max_pending_checkpoints)",
                step,
                extra={"ckpt": event},
            )
            self.metrics.write(event)

    def count(self, o: Outcome) -> Pending:
        """Count outcome `o`: what was remembered of its checkpoint (for `report`). A fenced one
        stops this attempt (every rank learns it from the same outcome)."""
        self.stats.outcomes.append(o)
        self.stats.last = o
        pending = self._pending.pop(o.checkpoint_id)
        if o.fenced:
            raise Fenced(o.error)
        if o.committed:
            st = self.stats
            st.committed += 1
            st.full += o.full
            st.bytes += o.bytes
            if o.stall_ms:
                stall = max(o.stall_ms)  # the slowest rank's
                st.stalled += 1
                st.stall_ms_sum += stall
                st.stall_ms_max = max(st.stall_ms_max, stall)
        else:
            self.stats.failed += 1
        return pending

    def report(self, o: Outcome, pending: Pending) -> None:
        """Rank 0: outcome `o` of the checkpoint `pending` remembers, in the log and in metrics."""
        if not o.after_failed or o.after_failed != self._unwritten_after:
            self.say_unwritten()
        durable_s = o.commit_unix - pending.started_unix if o.committed else None
        kind = "full" if o.full else "delta"
        outcome = CheckpointCommitted if o.committed else CheckpointFailed
        event = outcome(  # also for the console, which folds frequent checkpoints into one line
            step=o.step,
            ckpt_id=o.checkpoint_id,
            ckpt_full=o.full,
            ckpt_rows=o.rows,
            ckpt_bytes=o.bytes,
            ckpt_stall_ms=float(max(o.stall_ms or [0])),
            ckpt_write_s=o.write_s,
            ckpt_error=o.error,
            ckpt_stall_new_bytes=sum(o.stall_new_bytes),
            ckpt_encoding=pending.weight_codec,
            ckpt_durable_s=durable_s,
            ckpt_aside_bytes=max(o.aside_peak_bytes or [0]),
        )
        if o.committed:
            logger.info(
                "checkpoint %d (step %d, %s) committed: %s rows, %.2f MB, stall %.1f ms (max over ranks), written in %.2f s",
                o.checkpoint_id,
                o.step,
                kind,
                f"{o.rows:,}",
                o.bytes / 1e6,
                max(o.stall_ms or [0]),
                o.write_s,
                extra={"ckpt": event},
            )
        elif o.after_failed:  # in metrics each; on the console one line for the run of them
            self._unwritten.append(o.checkpoint_id)
            self._unwritten_after = o.after_failed
            logger.debug("checkpoint %d (step %d) FAILED: %s", o.checkpoint_id, o.step, o.error, extra={"ckpt": event})
        else:
            logger.warning("checkpoint %d (step %d) FAILED: %s", o.checkpoint_id, o.step, o.error, extra={"ckpt": event})
        self.metrics.write(event)

    def say_unwritten(self) -> None:
        """Rank 0: one line for the checkpoints left unwritten since the last one said, if any."""
        if self._unwritten:
            logger.warning(
                "checkpoint(s) %s not written: their chain runs through checkpoint %d, which failed; "
                "the next checkpoint decided is full",
                id_ranges(self._unwritten),
                self._unwritten_after,
            )
        self._unwritten, self._unwritten_after = [], 0
