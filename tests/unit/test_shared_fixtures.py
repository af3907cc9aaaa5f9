"""The shared fixtures of tests/conftest.py keep their promises: the debug config applies
overrides, the metrics reader filters, the CLI runner fails with the stderr tail and keeps a
launcher's identity out of commands, and a random seed is shown with a working replay command."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.conftest import CliRunner, DebugConfig, MetricsReader


def test_debug_config_loads_with_overrides(debug_config: DebugConfig) -> None:
    assert debug_config.path.name == "debug_cpu.yaml" and debug_config.path.is_file()
    default = debug_config.load(check_data=False)
    cfg = debug_config.load(["train.steps=7"], check_data=False)
    assert cfg.train.steps == 7 and default.train.steps == debug_config.raw()["train"]["steps"] != 7
    edited = debug_config.raw()
    edited["train"]["steps"] = 3
    assert debug_config.raw()["train"]["steps"] != 3  # every raw() is a fresh copy


def test_metrics_reader_filters_by_keys_and_values(tmp_path: Path, metrics: MetricsReader) -> None:
    records = [
        {"step": 10, "loss": 0.7, "samples_per_s": 100.0},
        {"step": 10, "ckpt_committed": True, "ckpt_full": True},
        {"step": 20, "loss": 0.6},
        {"step": 20, "ckpt_committed": False, "ckpt_error": "broker gone"},
        {"step": 20, "eval_auc": 0.71},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert metrics(tmp_path) == records
    assert metrics(tmp_path / "metrics.jsonl", "loss") == [records[0], records[2]]
    assert metrics(tmp_path, "loss", "samples_per_s") == [records[0]]
    assert metrics(tmp_path, ckpt_committed=True) == [records[1]]
    assert metrics(tmp_path, "ckpt_error", ckpt_committed=False) == [records[3]]
    assert metrics.values(tmp_path, "step", "loss") == [10, 20]
    assert metrics.values(tmp_path, "eval_auc") == [0.71]


def test_metrics_reader_live_skips_a_half_written_record(tmp_path: Path, metrics: MetricsReader) -> None:
    assert metrics(tmp_path, live=True) == []  # the job has not written the file yet
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    assert metrics(tmp_path, live=True) == [{"step": 1, "loss": 0.5}]
    with pytest.raises(json.JSONDecodeError):
        metrics(tmp_path)  # a finished job's file must parse whole


PROBE = """\
import os, sys, time
print("RANK=" + os.environ.get("RANK", "-"), "EXTRA=" + os.environ.get("PROBE_EXTRA", "-"))
print("probe says no", file=sys.stderr)
if len(sys.argv) > 1 and sys.argv[1] == "sleep":
    time.sleep(120)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "sleep" else 0)
"""


@pytest.fixture
def probe_env(tmp_path: Path) -> dict[str, str]:
    """An environment under which `python -m deltarec_cli_probe` is the module above."""
    (tmp_path / "deltarec_cli_probe.py").write_text(PROBE)
    return {"PYTHONPATH": str(tmp_path), "PROBE_EXTRA": "yes"}


def test_run_cli_returns_output_without_the_launchers_variables(
    run_cli: CliRunner, probe_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "3")  # as if pytest itself ran under torchrun
    r = run_cli("deltarec_cli_probe", env=probe_env)
    assert (r.rc, r.stdout.split()) == (0, ["RANK=-", "EXTRA=yes"])
    assert r.lines("probe says") == ["probe says no"] and r.lines("RANK=", stream="stdout")
    assert run_cli("deltarec_cli_probe", "4", env=probe_env, expect_rc=4).rc == 4
    assert run_cli("deltarec_cli_probe", "5", env=probe_env, expect_rc=None).rc == 5


def test_run_cli_fails_on_an_unexpected_status_showing_stderr(run_cli: CliRunner, probe_env: dict[str, str]) -> None:
    with pytest.raises(pytest.fail.Exception) as e:
        run_cli("deltarec_cli_probe", "2", env=probe_env)
    msg = str(e.value)
    assert "python -m deltarec_cli_probe 2" in msg and "exited 2, expected 0" in msg
    assert "probe says no" in msg.split("--- stderr tail ---")[1]


def test_run_cli_kills_a_command_past_its_timeout(run_cli: CliRunner, probe_env: dict[str, str]) -> None:
    with pytest.raises(pytest.fail.Exception, match="did not finish within 2s"):
        run_cli("deltarec_cli_probe", "sleep", env=probe_env, timeout_s=2)


DRAWS = """\
def test_draw(replay_seed):
    drawn = replay_seed.rng().randrange(10**9)
    assert drawn < 0, f"{replay_seed}: drew {drawn}"
"""


def _run_draw(run_cli: CliRunner, test_file: Path, env: dict[str, str]) -> tuple[int, int, str]:
    """Run the failing test above in a pytest of its own: (seed, drawn value, its output)."""
    r = run_cli("pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", test_file, env=env, expect_rc=1)
    seeds = set(re.findall(r"random seed (\d+) \(replay: ", r.stdout))
    drawn = set(re.findall(r"drew (\d+)$", r.stdout, re.M))  # not the truncated summary line
    assert len(seeds) == 1 and len(drawn) == 1, r.stdout
    return int(seeds.pop()), int(drawn.pop()), r.stdout


def test_replay_seed_is_shown_on_failure_and_replays(run_cli: CliRunner, tmp_path: Path) -> None:
    test_file = tmp_path / "test_draw.py"
    test_file.write_text(DRAWS)
    seed, drawn, out = _run_draw(run_cli, test_file, {"DELTAREC_TEST_SEED": ""})  # empty: draw a seed
    assert drawn == random.Random(seed).randrange(10**9), out  # the printed seed is the one used
    assert "Captured stdout setup" in out  # printed where pytest shows it with the failure
    (replay,) = set(re.findall(r"\(replay: (cd .*? -m pytest -q \S+)\)", out))
    assert f"DELTAREC_TEST_SEED={seed} " in replay and replay.endswith("test_draw.py::test_draw"), replay

    chosen = seed + 1
    again, drawn_again, out = _run_draw(run_cli, test_file, {"DELTAREC_TEST_SEED": str(chosen)})
    assert again == chosen and drawn_again == random.Random(chosen).randrange(10**9), out


def test_replay_seed_refuses_a_malformed_seed(run_cli: CliRunner, tmp_path: Path) -> None:
    test_file = tmp_path / "test_draw.py"
    test_file.write_text(DRAWS)
    r = run_cli(
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "tests.conftest",
        test_file,
        env={"DELTAREC_TEST_SEED": "twelve"},
        expect_rc=1,
    )
    assert "DELTAREC_TEST_SEED='twelve': not an integer seed" in r.stdout
