"""Check-N-Run checkpoint policies: which checkpoints are full, and what a restore replays."""

from __future__ import annotations

import pytest

from ckpt.save.policy import CheckpointPolicy


def _run(policy: CheckpointPolicy, sizes: list[float]) -> list[tuple[bool, list[int]]]:
    """Decide a checkpoint per diff size; return (full?, chain) per checkpoint."""
    out, chain = [], []
    for cid, s in enumerate(sizes, start=1):
        d = policy.decide(since_base_fraction=s)
        chain = policy.chain_after(chain, cid, d)
        policy.record(d, s)
        out.append((d.full, chain))
    return out


def test_first_checkpoint_is_always_full() -> None:
    for name in ("full", "one_shot_diff", "incremental", "intermittent_diff"):
        assert _run(CheckpointPolicy(name), [0.1])[0] == (True, [1])


def test_full_policy_never_writes_deltas() -> None:
    assert [f for f, _ in _run(CheckpointPolicy("full"), [0.1] * 4)] == [True] * 4


def test_incremental_chain_grows_from_the_baseline() -> None:
    res = _run(CheckpointPolicy("incremental"), [0.1] * 4)
    assert res[-1] == (False, [1, 2, 3, 4])


def test_one_shot_diff_needs_only_its_baseline() -> None:
    res = _run(CheckpointPolicy("one_shot_diff"), [0.1, 0.2, 0.3, 0.9])
    assert [f for f, _ in res] == [True, False, False, False]
    assert res[-1][1] == [1, 4]


def test_intermittent_resets_by_check_n_run_rule() -> None:
    # Baseline, then S1 = 0.3: 1 + 0.3 <= 2 * 0.3? no -> diff. S2 = 0.5: 1 + 0.8 <= 3 * 0.5? no.
    # S3 = 0.7: 1 + 1.5 = 2.5 <= 4 * 0.7 = 2.8 -> reset to a full baseline.
    res = _run(CheckpointPolicy("intermittent_diff"), [1.0, 0.3, 0.5, 0.7, 0.1])
    assert [f for f, _ in res] == [True, False, False, True, False]
    assert res[-1][1] == [4, 5]


def test_small_diffs_never_reset() -> None:
    res = _run(CheckpointPolicy("intermittent_diff"), [1.0] + [0.05] * 10)
    assert [f for f, _ in res] == [True] + [False] * 10


def test_force_full_overrides_a_usable_baseline() -> None:
    p = CheckpointPolicy("incremental")
    _run(p, [0.1, 0.1])
    assert not p.decide(0.1).full
    forced = p.decide(0.1, force_full=True)
    assert forced.full and forced.reason == "forced"


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown checkpoint policy 'sometimes'"):
        CheckpointPolicy("sometimes")  # type: ignore[arg-type]


def test_a_baseline_of_trained_rows_only_costs_its_fraction_in_the_reset_rule() -> None:
    # F = 0.4 (untrained rows not stored), S1 = 0.3: 0.4 + 0.3 = 0.7 > 0.6 -> diff; S2 = 0.35:
    # 0.4 + 0.65 = 1.05 <= 3 * 0.35 = 1.05 -> reset. With F = 1 the same diffs never reset.
    p = CheckpointPolicy("intermittent_diff")
    p.record(p.decide(0.0), 1.0)
    first = p.decide(0.3, full_fraction=0.4)
    assert not first.full
    p.record(first, 0.3)
    second = p.decide(0.35, full_fraction=0.4)
    assert second.full and second.reason == "reset: F + sum(S) = 1.050 <= 3 * S_2 = 1.050"
    assert not p.decide(0.35).full


def test_next_kinds_are_what_decide_may_choose_after_the_baseline() -> None:
    for name in ("full", "incremental", "one_shot_diff", "intermittent_diff"):
        assert CheckpointPolicy(name).next_kinds() == ("full",)  # no baseline yet
    kinds = {}
    for name in ("full", "incremental", "one_shot_diff", "intermittent_diff"):
        p = CheckpointPolicy(name)
        p.record(p.decide(0.0), 1.0)
        kinds[name] = p.next_kinds()
        assert p.next_kinds(force_full=True) == ("full",)
    assert kinds == {
        "full": ("full",),
        "incremental": ("since_last",),
        "one_shot_diff": ("since_base",),
        "intermittent_diff": ("full", "since_base"),
    }
