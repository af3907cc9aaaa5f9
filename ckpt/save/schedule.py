"""When a checkpoint is due, and which kind every rank agrees it is (docs/design/dataflow.md, steps 1-2).

A checkpoint is due every `ckpt.schedule.interval_steps` steps and/or after `ckpt.schedule.interval_s` (rank 0's
clock decides, broadcast every few steps). Whether the next step is due is decided at the end
of the step before (`look_ahead`), which also starts that checkpoint's agreement: one small
async all-reduce of every rank's row counts and flags, so it runs under the step's training
and the stall only collects it (`agree`); with a checkpoint every step too, from the counts the
checkpoint before was taken from (`counted`). Half an interval before a checkpoint the next
snapshot's slab is reserved (`reserve_next`, ckpt/capture/host_buffers.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ckpt.capture.snapshot import SnapshotTaker
from ckpt.capture.tracker import RowTracker
from ckpt.config import RecoveryConfig, ScheduleConfig, WriteConfig
from ckpt.recovery.lost_samples import interval_for_pls
from ckpt.save.policy import FULL, KINDS, SINCE_BASE, SINCE_LAST, CheckpointPolicy, Decision
from ckpt.write.writer import RankWriter
from common.errors import ConfigError
from sharding.shard_views import ShardMap

logger = logging.getLogger(__name__)

_TIME_CHECK_EVERY = 10  # steps between agreements on a time-based interval


class Agreed(NamedTuple):
    """One checkpoint as every rank agreed it (`Schedule.agree`)."""

    decision: Decision
    fraction: float  # of all rows, what it writes
    fractions: tuple[float, float]  # rows changed since the baseline, since the last checkpoint (all ranks)
    overflow: dict[str, bool]  # per kind (`KINDS`): some rank's writer has no room for it
    forced: bool  # this rank's request for a full checkpoint was part of it
    behind: bool = False  # some rank's writer holds `ckpt.write.max_pending_checkpoints` checkpoints already


class _Counts(NamedTuple):
    """This rank's row counts per shard, as an agreement reports them, and the snapshot bytes
    of each kind (`KINDS`) they give."""

    base: list[int]  # rows changed since the baseline
    last: list[int]  # rows changed since the last checkpoint
    full: list[int] | None  # rows a full checkpoint writes (None: every row)
    est: dict[str, int]  # snapshot bytes per kind


class _Taken(NamedTuple):
    """A checkpoint just taken whose next step is due as well (`Schedule.counted`): the counts it
    was taken from, which the next step's agreement reports, and the bytes of its own snapshot,
    which the writer may not hold yet when that agreement starts."""

    step: int
    counts: _Counts
    nbytes: int
    checkpoint_id: int = 0  # set by `took` (`counted` runs before the id is drawn)


class _InFlight(NamedTuple):
    """One checkpoint's agreement in flight: this rank's inputs, reduced in place by `works`."""

    step: int  # the checkpoint step it is for
    counts: torch.Tensor  # rows since the base, since the last checkpoint, in all, of a full one
    flags: torch.Tensor  # force a full checkpoint; the writers too far behind for each of `KINDS`; behind in count
    works: list[Any]  # the async all-reduce (a sum) of both, which are views of one tensor
    forced: bool  # this rank asked for a full checkpoint


def grown_estimate(previous: Mapping[str, int], now: Mapping[str, int], kinds: Sequence[str], cap: int) -> int:
    """The largest of `kinds`' snapshot bytes at the next checkpoint, guessed from two counts
    (`previous` at the last checkpoint, `now` half an interval later): each kind grows by as
    much again as it grew since `previous` (trained rows and one-shot diffs grow checkpoint
    after checkpoint); a kind `previous` lacks (none counted yet, or counted afresh since) is
    taken to double. Never past `cap` (every row)."""

    def grown(k: str) -> int:
        return now[k] + (max(0, now[k] - previous[k]) if k in previous else now[k])

    return min(cap, max(grown(k) for k in kinds))


def interval_for_target_pls(cfg: RecoveryConfig, shard_map: ShardMap, mtbf_s: float | None, rank: int) -> float:
    """CPR's interval for `ckpt.recovery.target_pls` (ckpt/recovery/lost_samples.py): the rank holding the largest share
    of the embedding parameters is the one whose failure loses the most. `mtbf_s`: the run's own
    estimate, when `ckpt.recovery.mtbf_s` is not set."""
    local = float(sum(s.num_rows * s.num_cols for s in shard_map.shards))
    total, largest = torch.tensor([local], dtype=torch.float64), torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    share = largest.item() / max(total.item(), 1.0)
    mtbf = cfg.mtbf_s or mtbf_s
    if not mtbf:
        raise ConfigError(
            "ckpt.recovery.target_pls needs ckpt.recovery.mtbf_s (seconds) until the run has restarted at least once "
            "(then its own attempts give the mean time between failures)"
        )
    interval = interval_for_pls(cfg.target_pls, mtbf, share)
    if rank == 0:
        logger.info(
            "checkpoint interval %.1f s for PLS %.4g: mean time between failures %.0f s (%s), a rank "
            "holds up to %.1f%% of the embedding parameters",
            interval,
            cfg.target_pls,
            mtbf,
            "ckpt.recovery.mtbf_s" if cfg.mtbf_s else "this run's attempts",
            share * 100,
        )
    return interval


class Schedule:
    """Which steps checkpoint, and the kind each one is, agreed by every rank.

    `wants_full()` says, when an agreement starts, whether this rank asks for a full checkpoint
    (the checkpointer's: a failed outcome, a restore, the priority rule).
    """

    def __init__(
        self,
        cfg: ScheduleConfig,
        write: WriteConfig,
        *,
        tracker: RowTracker,
        taker: SnapshotTaker,
        policy: CheckpointPolicy,
        writer: RankWriter,
        total_rows: int,
        full_bytes: int,
        wants_full: Callable[[], bool],
        prioritized: bool,
    ) -> None:
        self.cfg, self.write = cfg, write
        self.tracker, self.taker, self.policy, self.writer = tracker, taker, policy, writer
        self.total_rows = total_rows
        self.full_bytes = full_bytes  # this rank's snapshot of every row
        self.wants_full = wants_full
        self.prioritized = prioritized  # prioritized checkpoints reserve no slab ahead
        self.interval_s = cfg.interval_s  # or what `ckpt.recovery.target_pls` sets at start (`use_interval`)
        self.last_step = -1  # the last checkpoint's step (taken, or restored)
        self.last_time = time.monotonic()
        self._ahead_step, self._ahead_due = -1, False  # a step whose checkpoint was decided a step early
        self._in_flight: _InFlight | None = None  # its agreement, started then
        self._agreed_bytes: dict[str, int] = {}  # this rank's snapshot bytes per kind at the last agreement
        self._reserved = False  # the next snapshot's slab was asked for (`reserve_next`)
        self._counted: _Taken | None = None  # `counted`'s, before `took` gives it its id
        self._taken: _Taken | None = None  # the last checkpoint, when the step after it is due too

    def use_interval(self, seconds: float) -> None:
        """Checkpoint every `seconds` from now on (`ckpt.recovery.target_pls`)."""
        self.interval_s = seconds

    def resumed_at(self, step: int) -> None:
        """A restore brought back the checkpoint of `step`: it counts as the last one taken."""
        self.last_step = step

    def due(self, step: int) -> bool:
        """Whether `step` takes a checkpoint: decided at the end of the step before (`look_ahead`),
        or now for the first step of this process."""
        return self._ahead_due if self._ahead_step == step else self._due_at(step)

    def _due_at(self, step: int) -> bool:
        cfg = self.cfg
        due = cfg.interval_steps > 0 and step % cfg.interval_steps == 0
        if self.interval_s > 0 and step % _TIME_CHECK_EVERY == 0:
            flag = torch.tensor([float(time.monotonic() - self.last_time >= self.interval_s)])
            dist.broadcast(flag, src=0)  # rank 0's clock decides, so every rank agrees
            due = due or bool(flag.item())
        return due

    def counted(self, step: int, kind: str) -> int | None:
        """The snapshot bytes of the checkpoint of `step` about to be taken, of `kind`, when the
        step after it is due by `ckpt.schedule.interval_steps` too: the counts are taken now,
        before its copy marks the bitmaps, and kept for that step's agreement (`took`,
        `look_ahead`). None (nothing counted) otherwise."""
        every = self.cfg.interval_steps
        self._counted = None
        if every <= 0 or (step + 1) % every:
            return None
        counts = self._counts()
        self._counted = _Taken(step, counts, counts.est[kind])
        return counts.est[kind]

    def took(self, step: int, checkpoint_id: int) -> None:
        """A checkpoint of `step` (`checkpoint_id`) is being taken: the intervals count from now,
        and the next snapshot's slab is reserved half an interval from now (`reserve_next`)."""
        self.last_step, self.last_time = step, time.monotonic()
        self._reserved = False
        counted, self._counted = self._counted, None
        self._taken = counted._replace(checkpoint_id=checkpoint_id) if counted and counted.step == step else None

    def look_ahead(self, step: int) -> None:
        """Decide now whether the next step, `step`, checkpoints, and if so start its agreement:
        its all-reduce then runs during that step's training, and the stall only collects it
        (the kind is chosen from the row counts of the step before it). After a checkpoint at
        the step before, whose copy may be marking the bitmaps now, the counts are those it was
        taken from (`counted`, kept when `step` is due by `ckpt.schedule.interval_steps`); without
        them (a checkpoint due by time right after another) the agreement starts in the stall."""
        self._ahead_step, self._ahead_due = step, self._due_at(step)
        taken, self._taken = self._taken, None
        if not self._ahead_due:
            return
        if self.last_step != step - 1:
            self._in_flight = self._start_agreement(step)
        elif taken is not None and taken.step == step - 1:
            self._in_flight = self._start_agreement(step, taken)

    def _counts(self) -> _Counts:
        """This rank's row counts now and the bytes they give."""
        base, last, full = self.tracker.all_counts(trained=self.taker.trained_only)
        est = {
            FULL: self.taker.bytes_for(full) if full is not None else self.full_bytes,
            SINCE_BASE: self.taker.bytes_for(base),
            SINCE_LAST: self.taker.bytes_for(last),
        }
        return _Counts(base, last, full, est)

    def _start_agreement(self, step: int, taken: _Taken | None = None) -> _InFlight:
        """This rank's view, in one small async all-reduce: the counts that choose the
        checkpoint's kind and the fraction of rows it writes, whether any rank asks for a full
        one, and whether any rank's writer is too far behind for each kind. Numbers only, so
        the training thread never waits on Kafka here. With `taken` (the checkpoint of the
        step before, whose copy may still run) its counts are reported, and its snapshot counts
        as the writer's until the copy hands it over."""
        forced = self.wants_full()
        handed = taken is None or self.writer.submitted >= taken.checkpoint_id  # read before the writer's figures below
        c = self._counts() if taken is None else taken.counts
        self._agreed_bytes = c.est
        pending, jobs = self.writer.pending_bytes, self.writer.pending_jobs
        if not handed:
            assert taken is not None
            pending, jobs = pending + taken.nbytes, jobs + 1
        most = self.write.pending_checkpoints(self.cfg.interval_steps)
        behind = float(most > 0 and jobs >= most)
        full = sum(c.full) if c.full is not None else self.total_rows
        over = [float(pending + c.est[k] > self.write.max_pending_bytes) for k in KINDS]
        # one all-reduce (a sum) for both: a flag summed over the ranks is set when any rank's is
        both = torch.tensor([sum(c.base), sum(c.last), self.total_rows, full, float(forced), *over, behind], dtype=torch.float64)
        works = [dist.all_reduce(both, async_op=True)]
        return _InFlight(step, both[:4], both[4:], works, forced)

    def agree(self, step: int) -> Agreed:
        """The checkpoint of `step` as every rank agrees it: collected from the agreement started
        a step ahead, or started now (the first step, the final checkpoint)."""
        a = self._in_flight
        if a is not None and a.step == step:
            self._in_flight = None
        else:
            a = self._start_agreement(step)
        for work in a.works:
            work.wait()
        counts, flags = a.counts.tolist(), [f > 0 for f in a.flags.tolist()]
        total = max(counts[2], 1.0)
        fractions = (counts[0] / total, counts[1] / total)  # since base, since last
        full_fraction = counts[3] / total  # what a full checkpoint would write
        decision = self.policy.decide(fractions[0], force_full=flags[0], full_fraction=full_fraction)
        fraction = full_fraction if decision.full else (counts[0] if decision.since_base else counts[1]) / total
        overflow = dict(zip(KINDS, flags[1:-1], strict=True))
        return Agreed(decision, fraction, fractions, overflow, a.forced, behind=flags[-1])

    def close(self) -> None:
        """Wait for an agreement started for a step that never came (the job ends)."""
        if self._in_flight is not None:
            for work in self._in_flight.works:
                work.wait()
            self._in_flight = None

    def time_to_reserve(self, step: int) -> bool:
        """Whether `step` ends half of the interval after the last checkpoint (or the start),
        once per interval: the next snapshot's slab is reserved then. With a checkpoint every
        step there is no step between two, and nothing is reserved: the slabs given back serve
        (counting the rows for an estimate would cost the training thread a pass every step)."""
        if self._reserved or self.taker.pool is None or self.prioritized:
            return False
        every = self.cfg.interval_steps
        if every >= 2 and step % every == every // 2:
            return True
        return self.interval_s > 0 and time.monotonic() - self.last_time >= self.interval_s / 2

    def reserve_next(self, force_full: bool, last_was_full: bool) -> None:
        """Fault in, on the pool's helper thread, a slab for the next snapshot, half an interval
        before it: the largest kind the policy may take next, its bytes now grown by as much
        again as since the last checkpoint's agreement (`grown_estimate`; a kind counted afresh
        since then, or before any agreement, is taken to double). Without it the first snapshot
        (a full one) and every one larger than the slabs kept fault their pages in inside the
        stall. Half an interval ahead, not at the checkpoint: the last snapshot's slab is then
        usually back in the pool to be reused, and the estimate looks half as far ahead."""
        self._reserved = True
        kinds = self.policy.next_kinds(force_full)
        now = {k: self.taker.estimate_bytes(full=k == FULL, since_base=k != SINCE_LAST) for k in kinds}
        previous = dict(self._agreed_bytes)
        previous.pop(SINCE_LAST, None)  # the rows changed since the last checkpoint start from none at each
        if last_was_full:
            previous.pop(SINCE_BASE, None)  # and those since the baseline, at a full one
        assert self.taker.pool is not None
        self.taker.pool.reserve_ahead(grown_estimate(previous, now, kinds, self.full_bytes))
