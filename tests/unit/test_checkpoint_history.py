"""A rank's history of checkpoints keeps its newest outcomes and stalls and the run's totals:
its memory stays bounded however many checkpoints a job takes (tens a second with one every
step), and the summary line still counts every one."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from ckpt.events import MetricsSink
from ckpt.save.outcomes import AtRisk, Outcomes, Recent
from ckpt.write.writer import Outcome
from trainer.main import checkpoint_summary


def test_recent_keeps_the_newest_and_counts_them_all() -> None:
    r: Recent[int] = Recent(keep=3)
    for i in range(1, 6):
        r.append(i)
    assert (list(r), len(r), r.total, r[-1]) == ([3, 4, 5], 3, 5, 5)
    assert r.since(2) == [3, 4, 5] and r.since(4) == [5] and r.since(5) == []
    assert r.since(0) == [3, 4, 5]  # what was dropped is gone; the newest are still there


def test_the_summary_counts_every_outcome_beyond_the_history_kept() -> None:
    outcomes = Outcomes(cast(MetricsSink, SimpleNamespace(write=lambda event: None)))
    outcomes.stats.outcomes = Recent(keep=4)
    for cid in range(1, 101):
        outcomes.started(cid, 0.0, "fp32")
        committed = cid % 10 != 0  # every tenth fails
        o = Outcome(checkpoint_id=cid, step=cid, committed=committed, full=cid == 1, bytes=1000, stall_ms=[1.0, float(cid)])
        outcomes.count(o)
    st = outcomes.stats
    assert (len(st.outcomes), st.outcomes.total, st.committed, st.failed, st.full) == (4, 100, 90, 10, 1)
    manager = cast(Any, SimpleNamespace(stats=st))
    stalls = [float(c) for c in range(1, 101) if c % 10]
    assert checkpoint_summary(manager) == (
        "deltarec: checkpoints: 90 committed, 10 failed, 0 skipped (1 full, 89 delta); 0.09 MB written; "
        f"stall per checkpoint mean {sum(stalls) / 90:.1f} ms, max 99.0 ms"
    )


def test_steps_at_risk_count_from_the_newest_step_known_committed() -> None:
    """After each step, the steps since the newest committed checkpoint's step: per logged
    window (mean, most) and for the run; the summary line says the run's."""
    risk = AtRisk()
    for step, committed in [(1, None), (2, 1), (3, None), (4, 3), (5, None)]:
        if committed is not None:
            risk.committed(committed)
        risk.after(step)
    assert risk.take() == ((1 + 1 + 2 + 1 + 2) / 5, 2) and risk.take() is None
    risk.committed(2)  # an older outcome learnt late changes nothing
    risk.after(6)
    assert risk.take() == (3.0, 3) and (risk.run_sum, risk.run_steps, risk.run_max) == (10, 6, 3)
    outcomes = Outcomes(cast(MetricsSink, SimpleNamespace(write=lambda event: None)))
    outcomes.stats.at_risk = risk
    line = checkpoint_summary(cast(Any, SimpleNamespace(stats=outcomes.stats)))
    assert line.endswith("; a crash after a step would have lost 1.7 steps on average, at most 3"), line
