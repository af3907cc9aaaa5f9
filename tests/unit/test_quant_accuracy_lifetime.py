"""bench.quant_accuracy's lifetime log loss: every trained step counted exactly once, whatever
the window layout of the segments that trained it."""

from __future__ import annotations

import pytest

from bench.quant_accuracy import lifetime_logloss


def test_windows_are_weighted_by_the_steps_they_cover() -> None:
    # log_every 20, a segment ending at 25 (partial window), a resumed segment's windows after it
    windows = [(20, 0.5), (25, 0.3), (40, 0.4)]
    assert lifetime_logloss(windows, 40) == pytest.approx((0.5 * 20 + 0.3 * 5 + 0.4 * 15) / 40)


def test_the_same_steps_in_a_different_window_layout_give_the_same_mean() -> None:
    per_step = [0.9 - 0.01 * i for i in range(30)]
    one = [(30, sum(per_step) / 30)]
    three = [(10, sum(per_step[:10]) / 10), (17, sum(per_step[10:17]) / 7), (30, sum(per_step[17:]) / 13)]
    assert lifetime_logloss(three, 30) == pytest.approx(lifetime_logloss(one, 30))


def test_a_replayed_window_is_refused() -> None:
    # a segment that resumed from an older checkpoint would train steps 21..40 a second time
    with pytest.raises(ValueError, match="overlap or repeat at step 40"):
        lifetime_logloss([(20, 0.5), (40, 0.4), (40, 0.4)], 40)
    with pytest.raises(ValueError, match="overlap or repeat at step 30"):
        lifetime_logloss([(20, 0.5), (40, 0.4), (30, 0.4)], 40)


def test_missing_steps_at_the_end_are_refused() -> None:
    with pytest.raises(ValueError, match="end at step 20, expected 40"):
        lifetime_logloss([(20, 0.5)], 40)
