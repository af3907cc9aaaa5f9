"""A hung rank: one rank of a torchrun job is SIGSTOPped from outside mid-run. The other rank's
next collective times out after `sharding.timeout_s` and it stops with one line naming the
collective; torchrun restarts the job, which resumes from the newest checkpoint and ends
bit-identical to a run never interrupted.

torchrun stops a failed job's ranks with SIGTERM and, 30 s later, SIGKILL; a stopped process
only takes the SIGKILL. The test continues the stopped rank once the survivor has reported,
so the SIGTERM lands at once and the test does not spend those 30 s (the hang itself, and how
the job learns of it, are what is under test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from launch.ranks import REPO, kill_tree, rank_pids, read_jsonl, spawn_ranks

if TYPE_CHECKING:
    from tests.conftest import DebugConfig

pytestmark = [pytest.mark.integration, pytest.mark.multirank]

STEPS = 400
TIMEOUT_S = 5  # sharding.timeout_s: how long a collective waits for a silent rank
DEADLINE_S = 240
TRAIN = [f"train.steps={STEPS}", "train.save_params=true", "train.eval_batches=1", "train.log_every=100"]


def _wait_for(what: str, done, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        if proc.poll() is not None:
            pytest.fail(f"the job ended (exit {proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {DEADLINE_S} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)  # polling files another process writes


def test_a_stopped_rank_fails_the_job_naming_the_collective_and_torchrun_resumes_it(tmp_path, debug_config: DebugConfig):
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    spawn_ranks(debug_config.path, TRAIN, reference_dir)
    reference = [torch.load(reference_dir / "run" / "params" / f"rank{r}.pt") for r in range(2)]

    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    job = [*TRAIN, f"run.dir={run_dir}", "train.progress=log", f"sharding.timeout_s={TIMEOUT_S}",
           "ckpt.enabled=true", "ckpt.sink.kind=filesystem", "ckpt.run_id=hung", "ckpt.schedule.interval_steps=50",
           "ckpt.restore.resume=latest"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launch.torchrun", "--nproc-per-node", "2", "--max-restarts", "1",
             "--config", str(debug_config.path), *job],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    stopped = None
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for("first checkpoint", lambda: any(r.get("ckpt_committed") for r in read_jsonl(metrics, live=True)),
                  proc, log)  # fmt: skip
        stopped = rank_pids(proc.pid).get(1)
        assert stopped is not None, "rank 1 is not running"
        os.kill(stopped, signal.SIGSTOP)
        _wait_for("stall line", lambda: "deltarec-train: rank 0 stopped: a collective" in log.read_text(), proc, log)
        os.kill(stopped, signal.SIGCONT)
        proc.wait(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait(timeout=30)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]

    (stall,) = [line for line in text.splitlines() if line.startswith("deltarec-train: rank 0 stopped: a collective")]
    # the configured timeout, the collective (torchrec's or torch's code) and what deltarec was doing
    assert f"waited {TIMEOUT_S} s (sharding.timeout_s) for a rank that does not answer: " in stall, stall
    # the backward pass's collectives (DDP's C++ reducer) leave only autograd's frame to name
    assert ("comm_ops.py" in stall or "dist_data.py" in stall or "distributed.py" in stall
            or "distributed_c10d.py" in stall or "the backward pass's gradient all-reduce" in stall), stall  # fmt: skip
    assert "trainer/" in stall or "ckpt/" in stall, stall
    assert "Traceback" not in text, text[-4000:]
    assert "torchrun restarts the job, attempt 2/2" in text, text[-4000:]
    resumed = [line for line in text.splitlines() if line.startswith("deltarec: resumed from checkpoint")]
    assert len(resumed) == 1, text[-4000:]
    assert f"deltarec: trained {STEPS} steps" in text
    for rank, want in enumerate(reference):
        got = torch.load(run_dir / "params" / f"rank{rank}.pt")
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), f"rank {rank} {key} differs from the uninterrupted run"
