"""A user's loop through TorchRec's `TrainPipelineSparseDist` (examples/pipelined_ranking.py,
two batches in flight at every checkpoint), through the public `ckpt.Checkpointer` only:

- every rank SIGKILLed from outside at a random point, the same command run again: the final
  model (rows, row-wise Adagrad state, MLPs) equals an uninterrupted run's bit for bit;
- under `torchrun --max-restarts 1`, rank 1 SIGKILLed from outside: torchrun restarts the
  group, the loop resumes through `Checkpointer.restore()`, and ends bit-identical too.

The kill points are random: their seed is printed (`DELTAREC_TEST_SEED` replays them).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from launch.ranks import REPO, RankGroup, start_command
from tests.conftest import LAUNCHER_VARS, ReplaySeed
from tests.integration.test_examples import _assert_same, _committed, export_run

pytestmark = [pytest.mark.integration, pytest.mark.multirank]

STEPS = 80
JOB = ["ckpt.schedule.interval_steps=10", "ckpt.encoding.weights=fp32", "ckpt.encoding.optimizer=fp32"]
SCRIPT = ["examples/pipelined_ranking.py", "--steps", str(STEPS), "--plan", "row_wise"]


def _start(run_dir: Path, tmp: Path) -> RankGroup:
    rdzv = tmp / f"rdzv-{time.monotonic_ns()}"
    argv = [sys.executable, *SCRIPT, "--run-dir", str(run_dir), "--init-method", f"file://{rdzv}", *JOB]
    return start_command(argv, tmp, world_size=2, timeout_s=240)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The export of an uninterrupted run's last checkpoint."""
    tmp = tmp_path_factory.mktemp("pipelined_ref")
    _start(tmp / "run", tmp).wait()
    return export_run(tmp / "run", tmp / "final.pt")


def _wait_for_commits(run_dir: Path, need: int, running, seed: ReplaySeed) -> None:
    deadline = time.monotonic() + 180
    while _committed(run_dir) < need and running() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(seed.rng().uniform(0.0, 0.3))
    if not running():
        pytest.fail(f"the job ended before it could be killed ({seed}): make it longer")


def test_a_pipelined_loop_killed_from_outside_resumes_bit_identical(
    tmp_path: Path, reference: dict, replay_seed: ReplaySeed
) -> None:
    run_dir = tmp_path / "run"
    group = _start(run_dir, tmp_path)
    _wait_for_commits(run_dir, replay_seed.rng().randint(1, 4), group.running, replay_seed)
    for p in group.procs:
        p.send_signal(signal.SIGKILL)
    assert all(r.returncode == -signal.SIGKILL for r in group.wait(expect_ok=False))
    _start(run_dir, tmp_path).wait()
    resumed = export_run(run_dir, tmp_path / "final.pt")
    assert resumed["step"] == STEPS
    _assert_same(reference, resumed, f"pipelined, {replay_seed}")
    assert (run_dir / "metrics.jsonl").read_text().count('"event": "restore"') == 1


def _rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the first attempt's rank `rank` of the job writing `run_dir` (from /proc)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if str(run_dir).encode() in cmdline and b"TORCHELASTIC_RESTART_COUNT=0" in environ and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


def test_torchrun_restarts_a_killed_rank_and_the_loop_resumes_bit_identical(
    tmp_path: Path, reference: dict, replay_seed: ReplaySeed
) -> None:
    """`torchrun --max-restarts 1` as docs/own-loop.md runs a user's loop (with a fresh rendezvous
    store per attempt: torchrun's shared one hands a restarted gloo rank the dead attempt's
    addresses); a rank SIGKILLed from outside, not through deltarec's fault hook."""
    import os
    import subprocess

    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env |= {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:
        argv += [*SCRIPT, "--run-dir", str(run_dir), *JOB]
        torchrun = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for_commits(run_dir, replay_seed.rng().randint(1, 4), lambda: torchrun.poll() is None, replay_seed)
        pid = _rank_pid(run_dir, 1)
        assert pid is not None, f"rank 1 of the first attempt not found ({replay_seed})"
        os.kill(pid, signal.SIGKILL)
        assert torchrun.wait(timeout=240) == 0, log.read_text()[-4000:]
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait()
    text = log.read_text()
    assert "pipelined_ranking: trained to step 80" in text, text[-4000:]
    restores = (run_dir / "metrics.jsonl").read_text().count('"event": "restore"')
    assert restores == 1, f"{restores} restores: torchrun did not restart the group once ({replay_seed})"
    resumed = export_run(run_dir, tmp_path / "final.pt")
    assert resumed["step"] == STEPS
    _assert_same(reference, resumed, f"pipelined under torchrun, {replay_seed}")
