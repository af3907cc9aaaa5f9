"""Portion of lost samples (PLS, CPR) and the checkpoint interval that meets a PLS target.

Under partial recovery (`ckpt.recovery.mode: partial`) a failure at step s rolls the dead ranks'
shards back to checkpoint k (step s_k) and keeps every other row: the updates those shards
got from the samples of steps s_k+1..s are lost, and those samples are not trained again.

- lost samples of one failure = samples trained between s_k and s, times f, the share of
  the embedding parameters that rolled back;
- PLS of a run = the lost samples of all its failures / the samples it trained.

The interval (docs/design/partial-recovery.md, "Interval from a target", derives it): failures arrive at rate 1/MTBF and fall
uniformly inside a checkpoint interval of T seconds, so at a failure T/2 seconds of samples
are unsaved on average, and a fraction f of their updates is lost. A run of W seconds has
W/MTBF failures: E[PLS] = (W / MTBF) * f * T/2 / W = f * T / (2 * MTBF), so

    T = 2 * PLS * MTBF / f        (N equal ranks, one dies: f = 1/N, T = 2 * PLS * N * MTBF)

which is CPR's formula. The failed time itself is left out: T is short against MTBF
whenever the target is met at all.
"""

from __future__ import annotations


def lost_samples(samples_since_checkpoint: float, rolled_back_fraction: float) -> float:
    """Samples whose updates one partial recovery loses (see the module docstring)."""
    assert samples_since_checkpoint >= 0 and 0 <= rolled_back_fraction <= 1
    return samples_since_checkpoint * rolled_back_fraction


def run_pls(lost_total: float, samples_seen: float) -> float:
    """The run's PLS so far: lost samples over samples trained (0 before any)."""
    return lost_total / samples_seen if samples_seen > 0 else 0.0


def expected_pls(interval_s: float, mtbf_s: float, lost_fraction: float) -> float:
    """E[PLS] of checkpoints every `interval_s` seconds, failures every `mtbf_s` on average,
    each losing `lost_fraction` of the embedding parameters' updates since the checkpoint."""
    assert interval_s >= 0 and mtbf_s > 0 and 0 < lost_fraction <= 1
    return lost_fraction * interval_s / (2 * mtbf_s)


def interval_for_pls(target_pls: float, mtbf_s: float, lost_fraction: float) -> float:
    """The checkpoint interval (seconds) whose expected PLS is `target_pls`."""
    assert 0 < target_pls < 1 and mtbf_s > 0 and 0 < lost_fraction <= 1
    return 2 * target_pls * mtbf_s / lost_fraction


def estimate_mtbf(attempt_starts_unix: list[float], now_unix: float) -> float | None:
    """Mean time between failures from a run's own history: every earlier trainer attempt
    ended (each end counts as a failure), so with k earlier attempts the first of which
    started at t0, MTBF = (now - t0) / k. None for a run that never restarted."""
    if not attempt_starts_unix:
        return None
    return max(now_unix - min(attempt_starts_unix), 1e-9) / len(attempt_starts_unix)
