"""A rank's history of checkpoints keeps its newest outcomes and stalls and the run's totals:
its memory stays bounded however many checkpoints a job takes (tens a second with one every
step), and the summary line still counts every one."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from ckpt.events import MetricsSink
from ckpt.save.outcomes import Outcomes, Recent
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
