"""The follower gives its malloc arenas' free pages back after a round that did work and once
more after the round that follows it (a read's consumer closes after the round, on a thread
of its own), and not after further idle rounds (ckpt/follow/follower.py `poll`,
docs/design/follower.md): the rounds' control flow, with the stream and the apply stubbed out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import ckpt.follow.follower as follower_mod
from ckpt.follow.follower import CommitIds, Follower, FollowStats


def _follower(commits: dict[int, SimpleNamespace], fail: bool = False) -> Follower:
    f = Follower.__new__(Follower)  # no backend: poll's reads are stubbed below
    f.store, f.applied, f.stats, f._trim_next_round, f._ids = None, None, FollowStats(), False, CommitIds()
    # no rewind in these rounds, and too few records to prune the fold
    f.catalog = SimpleNamespace(commits=commits, abandoned=lambda cid: False, exact=True, records=0)
    f._pruned_at = 0
    f.backend = SimpleNamespace(markers=None)

    def follow_pending(pending: list) -> None:
        for marker in pending:
            if fail:
                f.stats.failed += 1
                raise RuntimeError("the round broke off")
            f.stats.applied += 1
            f.applied = marker

    f._follow_pending = follow_pending  # type: ignore[method-assign]
    return f


def test_a_round_that_applied_gives_memory_back_then_once_more_and_idle_rounds_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[int] = []
    monkeypatch.setattr(follower_mod, "catch_up", lambda *_: None)
    monkeypatch.setattr(follower_mod, "give_back_freed_memory", lambda: trims.append(1) or True)
    f = _follower({1: SimpleNamespace(checkpoint_id=1), 2: SimpleNamespace(checkpoint_id=2)})
    f.poll()
    assert f.applied.checkpoint_id == 2 and len(trims) == 1  # the newest at once, then one trim
    f.poll()
    assert len(trims) == 2  # nothing new, but the round after work trims again (the consumers' close)
    f.poll()
    assert len(trims) == 2  # idle after idle: no trim
    f.catalog.commits[3] = SimpleNamespace(checkpoint_id=3)
    f.poll()
    assert f.applied.checkpoint_id == 3 and len(trims) == 3


def test_a_round_that_broke_off_after_work_still_gives_memory_back(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[int] = []
    monkeypatch.setattr(follower_mod, "catch_up", lambda *_: None)
    monkeypatch.setattr(follower_mod, "give_back_freed_memory", lambda: trims.append(1) or True)
    f = _follower({1: SimpleNamespace(checkpoint_id=1)}, fail=True)
    with pytest.raises(RuntimeError):
        f.poll()
    assert trims == [1]
    f._follow_pending = lambda pending: None  # type: ignore[method-assign]
    f.poll()
    assert trims == [1, 1]  # the round after it trims once more
