"""DELTAREC_KILL_AT: what it names, what it refuses, and that it really SIGKILLs (first attempt only)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ckpt.faults import ENV, SLOW_RESTORE_ENV, FaultSpecError, KillAt, maybe_hold_restore, parse_kill_at
from launch.ranks import REPO


def test_a_spec_names_point_key_and_maybe_rank() -> None:
    assert parse_kill_at("committed:3@1") == KillAt("committed", 3, 1)
    assert parse_kill_at("rows:12") == KillAt("rows", 12, None)


def test_a_star_key_matches_any_key() -> None:
    target = parse_kill_at("survivor:*@0")
    assert target == KillAt("survivor", None, 0)
    assert target.matches("survivor", 3) and target.matches("survivor", 7) and not target.matches("committed", 3)
    assert not parse_kill_at("survivor:3").matches("survivor", 4)


def test_the_points_of_restore_and_the_tools() -> None:
    assert parse_kill_at("restore:3@1") == KillAt("restore", 3, 1)  # rank 1 restoring checkpoint 3
    assert parse_kill_at("gc:0") == KillAt("gc", 0, None)  # after gc's DROPPED record, before any deletion
    assert parse_kill_at("export:2@0") == KillAt("export", 2, 0)  # the CLI process is rank 0
    with pytest.raises(FaultSpecError, match="restore, gc, export"):
        parse_kill_at("verify:1")


def test_a_held_restore_says_so_on_stderr(monkeypatch, capsys) -> None:
    monkeypatch.setenv(SLOW_RESTORE_ENV, "3:0.01")
    maybe_hold_restore(2, 0)  # another checkpoint: no hold, no line
    assert capsys.readouterr().err == ""
    maybe_hold_restore(3, 1)
    assert capsys.readouterr().err == "deltarec fault: rank 1 holds its restore of checkpoint 3 for 0.01 s\n"


@pytest.mark.parametrize("spec", ["bogus", "commit:3@1", "committed:x", "committed:3@", "committed3"])
def test_a_malformed_spec_is_one_user_error(spec: str) -> None:
    with pytest.raises(FaultSpecError, match=rf"{ENV}=.*expected point:key\[@rank\] with point one of step,"):
        parse_kill_at(spec)


def _die_at(point: str, key: int, rank: int, **env: str) -> int:
    """The exit status of a process that calls maybe_die(point, key, rank) under `env`."""
    code = f"from ckpt.faults import maybe_die; maybe_die({point!r}, {key}, {rank})"
    full_env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RESTART_COUNT"} | env
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=full_env, timeout=60).returncode


def test_the_named_point_kills_the_named_rank_on_the_first_attempt_only() -> None:
    assert _die_at("committed", 3, 1, **{ENV: "committed:3@1"}) == -signal.SIGKILL
    assert _die_at("committed", 3, 0, **{ENV: "committed:3@1"}) == 0  # another rank
    assert _die_at("committed", 2, 1, **{ENV: "committed:3@1"}) == 0  # another checkpoint
    assert _die_at("rows", 3, 1, **{ENV: "committed:3@1"}) == 0  # another point
    assert _die_at("committed", 3, 1, **{ENV: "committed:3@1", "TORCHELASTIC_RESTART_COUNT": "1"}) == 0
    assert _die_at("committed", 3, 5, **{ENV: "committed:3"}) == -signal.SIGKILL  # every rank
    assert _die_at("gc", 2, 0, **{ENV: "gc:2"}) == -signal.SIGKILL  # a tool's process is rank 0
    assert _die_at("gc", 1, 0, **{ENV: "gc:2"}) == 0


def test_dense_write_error_injection(tmp_path, monkeypatch) -> None:
    from ckpt.dense.store import DenseStore, DenseStoreError
    from ckpt.faults import DENSE_ERROR_ENV

    store = DenseStore(tmp_path)
    monkeypatch.setenv(DENSE_ERROR_ENV, "2:ENOSPC")
    store.write(1, {"step": 1})  # another checkpoint: untouched
    with pytest.raises(DenseStoreError, match=r"dense-00000002\.pt: cannot write it: No space left on device \(ENOSPC\)"):
        store.write(2, {"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense-00000001.pt"]  # no temp file left
    monkeypatch.setenv(DENSE_ERROR_ENV, "2:ENOTANERRNO")
    with pytest.raises(FaultSpecError, match="checkpoint_id:ERRNO"):
        store.write(3, {"step": 3})
