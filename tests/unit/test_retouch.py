"""Suite `retouch` (bench/retouch.py): the shares it counts behave as shares of growing sets."""

from __future__ import annotations

from bench.retouch import retouched


def test_shares_touched_again_grow_with_the_steps_and_stay_within_their_sets():
    s = retouched(cap=2000, interval=6, batch=64, ranks=2)
    assert 0 < s["delta_rows"] <= s["trained_rows"] <= s["table_rows"]
    steps = sorted(s["touched_again"], key=int)
    assert steps == ["1", "2", "4", "6"]  # the report's steps up to the interval, and the interval
    for kind in ("delta", "trained"):
        shares = [s["touched_again"][k][kind] for k in steps]
        assert all(0 < a <= b <= 1 for a, b in zip(shares, shares[1:])), (kind, shares)
    # skewed ids: a delta's rows are hotter than the trained rows on the whole
    assert s["touched_again"]["6"]["delta"] > s["touched_again"]["6"]["trained"]
