"""A checkpoint every step starts the next step's agreement a step ahead (ckpt/save/schedule.py).

No process group: the all-reduce is replaced by one that records its input and leaves it as it
is (one rank's view is then what every rank agrees)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from ckpt.config import ScheduleConfig, WriteConfig
from ckpt.save import schedule as schedule_module
from ckpt.save.policy import SINCE_LAST, CheckpointPolicy
from ckpt.save.schedule import Schedule


@dataclass
class _Tracker:
    """Row counts per shard: since the base, since the last checkpoint."""

    base: list[int]
    last: list[int]

    def all_counts(self, trained: bool) -> tuple[list[int], list[int], list[int] | None]:
        return list(self.base), list(self.last), list(self.base) if trained else None


class _Taker:
    trained_only = False
    pool = None

    def bytes_for(self, counts: list[int]) -> int:
        return 10 * sum(counts)


@dataclass
class _Writer:
    pending_bytes: int = 0
    pending_jobs: int = 0
    submitted: int = 0


class _Done:
    def wait(self) -> None:
        pass


@dataclass
class _Reduces:
    """Every all-reduce started: its tensor's values when it started."""

    started: list[list[float]] = field(default_factory=list)

    def __call__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> _Done:
        self.started.append(tensor.tolist())
        return _Done()


@pytest.fixture
def reduces(monkeypatch: pytest.MonkeyPatch) -> _Reduces:
    fake = _Reduces()
    monkeypatch.setattr(schedule_module.dist, "all_reduce", fake)
    return fake


def _schedule(tracker: _Tracker, writer: _Writer, every: int = 1, most: int = 8) -> Schedule:
    policy = CheckpointPolicy("incremental")
    policy.adopt_base()
    return Schedule(
        ScheduleConfig(policy="incremental", interval_steps=every),
        WriteConfig(max_pending_checkpoints=most),
        tracker=tracker,  # type: ignore[arg-type]
        taker=_Taker(),  # type: ignore[arg-type]
        policy=policy,
        writer=writer,  # type: ignore[arg-type]
        total_rows=1000,
        full_bytes=10_000,
        wants_full=lambda: False,
        prioritized=False,
    )


def _take(s: Schedule, step: int, checkpoint_id: int) -> None:
    """What the checkpointer does around a checkpoint of `step`: agree, count, mark as taken."""
    s.agree(step)
    s.counted(step, SINCE_LAST)
    s.took(step, checkpoint_id)


def test_after_a_checkpoint_the_next_steps_agreement_starts_a_step_ahead_from_its_counts(reduces: _Reduces) -> None:
    """The counts a checkpoint was taken from are what the next step's agreement reports, also
    after the copy marked the bitmaps, and its stall only collects it."""
    tracker, writer = _Tracker(base=[30, 10], last=[20, 5]), _Writer()
    s = _schedule(tracker, writer)
    _take(s, 5, checkpoint_id=7)
    assert len(reduces.started) == 1  # step 5's own agreement, started in its stall (no step before it)
    tracker.base, tracker.last = [55, 15], [0, 0]  # the copy marked the bitmaps
    s.look_ahead(6)
    assert len(reduces.started) == 2 and reduces.started[1] == [40.0, 25.0, 1000.0, 1000.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    agreed = s.agree(6)
    assert len(reduces.started) == 2  # collected, not started again
    assert agreed.fractions == (0.04, 0.025) and not agreed.behind and not agreed.decision.full


def test_the_checkpoint_still_being_copied_counts_as_the_writers(reduces: _Reduces) -> None:
    """Until its copy hands it to the writer, the checkpoint just taken counts among the
    writer's checkpoints and bytes: with one slot left, the next one is behind."""
    writer = _Writer(pending_jobs=1, submitted=6)
    s = _schedule(_Tracker(base=[30], last=[20]), writer, most=2)
    _take(s, 5, checkpoint_id=7)
    s.look_ahead(6)
    assert s.agree(6).behind
    writer.submitted, writer.pending_jobs = 7, 1  # handed over, and the one before it written
    _take(s, 6, checkpoint_id=8)
    writer.submitted = 8
    s.look_ahead(7)
    assert not s.agree(7).behind


def test_no_counts_are_kept_when_the_next_step_is_not_due(reduces: _Reduces) -> None:
    s = _schedule(_Tracker(base=[30], last=[20]), _Writer(), every=2)
    s.agree(4)
    assert s.counted(4, SINCE_LAST) is None
    s.took(4, 1)
    s.look_ahead(5)
    assert len(reduces.started) == 1  # only step 4's own


def test_all_counts_are_the_counts_of_each_kind() -> None:
    """`RowTracker.all_counts` (one OR of the flat bitmaps) gives per shard what `counts` gives
    for each kind."""
    from types import SimpleNamespace

    from ckpt.capture.tracker import RowTracker

    sizes = [7, 1, 12]
    tracker = RowTracker.__new__(RowTracker)  # the bitmaps alone: no model to hook
    tracker.shard_map = SimpleNamespace(shards=[SimpleNamespace(num_rows=n) for n in sizes])  # type: ignore[assignment]
    tracker._starts = [0, 7, 8]
    gen = torch.Generator().manual_seed(3)
    tracker._last, tracker._base, tracker._trained = (torch.rand(20, generator=gen) < 0.3 for _ in range(3))
    tracker._scratch = None
    for _ in range(2):  # the scratch buffer, made by the first call, serves the second
        base, last, full = tracker.all_counts(trained=True)
        assert base == tracker.counts(since_base=True) and last == tracker.counts(since_base=False)
        assert full == tracker.counts(since_base=True, trained=True)
        assert tracker.all_counts(trained=False) == (base, last, None)


def test_a_flag_any_rank_sets_is_agreed_and_counts_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counts and flags travel in one summed all-reduce: another rank whose writer is behind
    and which asks for a full checkpoint (summed with this rank's unset flags) sets both."""
    other = torch.tensor([5.0, 3.0, 1000.0, 1000.0, 1.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64)

    def two_ranks(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> _Done:
        tensor += other
        return _Done()

    monkeypatch.setattr(schedule_module.dist, "all_reduce", two_ranks)
    agreed = _schedule(_Tracker(base=[30], last=[20]), _Writer()).agree(3)
    assert agreed.behind and agreed.decision.full and not agreed.forced
    assert agreed.fractions == (35 / 2000, 23 / 2000) and not any(agreed.overflow.values())
