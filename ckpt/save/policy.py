"""Which rows a checkpoint writes: Check-N-Run's policies.

- `full`: every checkpoint writes every row (every trained row, sharding/row_init.py) (the baseline to beat).
- `one_shot_diff`: one full baseline, then the rows changed since that baseline.
- `incremental`: the rows changed since the previous checkpoint; restore replays the chain.
- `intermittent_diff` (default): one-shot differential that starts a new full baseline
  when history says it is cheaper: with Sᵢ the i-th diff's size as a fraction of the
  model, write a full baseline instead of diff i when F + ΣS₁..ᵢ ≤ (i+1)·Sᵢ, where F is
  the size of a full baseline (1, or the fraction of rows trained so far when untrained rows
  are not stored; Check-N-Run's rule has F = 1).

Decisions are pure functions of numbers every rank agrees on (all-reduced row counts and
the shared checkpoint history), so every rank takes the same decision without talking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

PolicyName = Literal["full", "one_shot_diff", "incremental", "intermittent_diff"]
POLICIES: tuple[str, ...] = ("full", "one_shot_diff", "incremental", "intermittent_diff")

# The kinds of checkpoint: every row, the rows changed since the baseline (a one-shot diff),
# the rows changed since the previous checkpoint (an incremental delta).
FULL, SINCE_BASE, SINCE_LAST = "full", "since_base", "since_last"
KINDS = (FULL, SINCE_BASE, SINCE_LAST)


@dataclass(frozen=True)
class Decision:
    """What the next checkpoint writes.

    full: every row; otherwise `since_base` picks rows changed since the last full
    baseline (one-shot diff) over rows changed since the last checkpoint (incremental).
    """

    full: bool
    since_base: bool
    reason: str

    @property
    def kind(self) -> str:
        """Which of `KINDS` this checkpoint is."""
        return FULL if self.full else (SINCE_BASE if self.since_base else SINCE_LAST)


@dataclass
class CheckpointPolicy:
    """Decides full vs delta checkpoints and remembers what the chain looks like."""

    name: PolicyName = "intermittent_diff"
    diff_sizes: list[float] = field(default_factory=list)  # S₁..Sᵢ since the current baseline
    have_base: bool = False

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown checkpoint policy {self.name!r}; choose one of {', '.join(POLICIES)}")

    def decide(self, since_base_fraction: float, force_full: bool = False, full_fraction: float = 1.0) -> Decision:
        """The next checkpoint's kind. The fraction is rows changed since the baseline /
        all rows of the model, summed over every rank (Sᵢ of the reset rule); `full_fraction`
        is what a full checkpoint writes on the same scale (F). `force_full` after a failed
        checkpoint or a restore."""
        if force_full or not self.have_base:
            return Decision(True, False, "no usable baseline" if not self.have_base else "forced")
        if self.name == "full":
            return Decision(True, False, "policy full")
        if self.name == "incremental":
            return Decision(False, False, "incremental")
        if self.name == "one_shot_diff":
            return Decision(False, True, "one-shot diff")
        i = len(self.diff_sizes) + 1
        s_i = since_base_fraction
        cost = full_fraction + sum(self.diff_sizes) + s_i
        if cost <= (i + 1) * s_i:
            return Decision(True, False, f"reset: F + sum(S) = {cost:.3f} <= {i + 1} * S_{i} = {(i + 1) * s_i:.3f}")
        return Decision(False, True, "one-shot diff")

    def next_kinds(self, force_full: bool = False) -> tuple[str, ...]:
        """The kinds (`KINDS`) `decide` may choose next, for sizing memory ahead of it."""
        if force_full or not self.have_base or self.name == "full":
            return (FULL,)
        return {"incremental": (SINCE_LAST,), "one_shot_diff": (SINCE_BASE,)}.get(self.name, (FULL, SINCE_BASE))

    def record(self, decision: Decision, fraction: float) -> None:
        """Record a checkpoint as taken. Optimistic: the writer commits it later; after a
        failed checkpoint or a restore the caller passes `force_full` to `decide`, so the
        next checkpoint is full (and the committer refuses a checkpoint whose chain has a
        link that never committed)."""
        if decision.full:
            self.diff_sizes = []
            self.have_base = True
        else:
            self.diff_sizes.append(fraction)

    def adopt_base(self) -> None:
        """A restored chain is the baseline the next delta builds on (`ckpt.schedule.policy: incremental`,
        whose chain goes on after a restore)."""
        self.have_base = True

    def chain_after(self, chain: list[int], checkpoint_id: int, decision: Decision) -> list[int]:
        """Checkpoint ids a restore of `checkpoint_id` must replay, given the chain of the
        previous durable checkpoint: a full starts over, a one-shot diff needs only its
        baseline, an incremental delta needs the whole chain before it."""
        if decision.full:
            return [checkpoint_id]
        assert chain, "a delta checkpoint needs a durable baseline"
        if decision.since_base:
            return [chain[0], checkpoint_id]
        return [*chain, checkpoint_id]
