"""Every embedding optimizer fbgemm's CPU kernels run fused (row-wise Adagrad, Adagrad with its
per-element state, SGD) is captured and restored exactly through `ckpt.Checkpointer`:
examples/two_tower.py on 2 gloo ranks, killed by the fault hook (`DELTAREC_KILL_AT`: every rank
SIGKILLs itself after step 35, between checkpoints 3 and 4) and run again, ends bit-identical
to an uninterrupted run, optimizer state included. (Row-wise Adagrad is also killed from
outside in tests/integration/test_examples.py.) A fused optimizer with state outside the rows
(Adam, LAMB) does not run on fbgemm's CPU kernels at all; deltarec refuses it at start
(tests/unit/test_checkpointer.py).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from launch.ranks import start_command
from tests.integration.test_examples import export_run

STEPS = 50
JOB = [
    "ckpt.sink.kind=filesystem",
    "ckpt.schedule.interval_steps=10",
    "ckpt.encoding.weights=fp32",
    "ckpt.encoding.optimizer=fp32",
]


def _run(run_dir: Path, tmp: Path, optimizer: str, kill_at: str = "") -> list:
    rdzv = tmp / f"rdzv-{time.monotonic_ns()}"
    argv = [sys.executable, "examples/two_tower.py", "--run-dir", str(run_dir), "--steps", str(STEPS), "--plan", "row_wise"]
    argv += ["--optimizer", optimizer, "--init-method", f"file://{rdzv}", *JOB]
    env = {"DELTAREC_KILL_AT": kill_at} if kill_at else None
    return start_command(argv, tmp, world_size=2, timeout_s=240, env_extra=env).wait(expect_ok=not kill_at)


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_fused_optimizer_state_resumes_bit_identical(tmp_path: Path, optimizer: str) -> None:
    _run(tmp_path / "ref", tmp_path, optimizer)
    want = export_run(tmp_path / "ref", tmp_path / "ref.pt")
    killed = _run(tmp_path / "run", tmp_path, optimizer, kill_at="step:35")
    assert all(r.returncode == -signal.SIGKILL for r in killed), [r.returncode for r in killed]
    _run(tmp_path / "run", tmp_path, optimizer)
    got = export_run(tmp_path / "run", tmp_path / "run.pt")
    assert got["step"] == want["step"] == STEPS
    assert sorted(got["model"]) == sorted(want["model"])
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), f"{optimizer}: {key} differs after the resume"
    states = {(fqn, name) for fqn, st in want["optim"].items() for name in st}
    assert states == {(fqn, name) for fqn, st in got["optim"].items() for name in st}
    for fqn, name in states:
        a, b = want["optim"][fqn][name], got["optim"][fqn][name]
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b, f"{optimizer}: state {fqn}/{name} differs"
    if optimizer == "adagrad":  # per-element state: [rows, dim] beside each table's weight
        table = "user_tower.embedding_bags.id.weight"
        assert any(v.shape == want["model"][table].shape for v in want["optim"][table].values())
