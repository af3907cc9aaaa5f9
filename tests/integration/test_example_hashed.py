"""examples/hashed_ids.py, the example with a hashed user id over 2^40 ids (a managed-collision
table evicting every 20 steps) beside an ordinary table, run as it is on 2 gloo ranks through
the public `ckpt.Checkpointer`: killed from outside with SIGKILL at a random point (its seed
printed; `DELTAREC_TEST_SEED` replays it) and resumed, its final model (exported with
`deltarec-ckpt export`) is bit-identical to an uninterrupted run's; its checkpoint resumes on
1 rank and trains on, with evictions."""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from launch.ranks import RankGroup, start_command
from tests.integration.test_examples import _assert_same, _committed, export_run

pytestmark = pytest.mark.multirank

STEPS = 60  # three evictions; a checkpoint every 10 steps
JOB = ["ckpt.sink.kind=filesystem", "ckpt.schedule.interval_steps=10"]


def _start(run_dir: Path, tmp: Path, world: int = 2, steps: int = STEPS) -> RankGroup:
    rdzv = tmp / f"rdzv-{time.monotonic_ns()}"
    argv = [sys.executable, "examples/hashed_ids.py", "--run-dir", str(run_dir), "--steps", str(steps)]
    argv += ["--batch-size", "128", "--init-method", f"file://{rdzv}", *JOB]
    return start_command(argv, tmp, world_size=world, timeout_s=300)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("hashed_ref")
    _start(tmp / "run", tmp).wait()
    return tmp / "run", export_run(tmp / "run", tmp / "final.pt")


def test_the_hashed_example_killed_from_outside_resumes_bit_identical(tmp_path: Path, uninterrupted: tuple[Path, dict]) -> None:
    _, reference = uninterrupted
    seed = int(os.environ.get("DELTAREC_TEST_SEED", time.time_ns() % 100_000))
    print(f"kill point seed {seed} (DELTAREC_TEST_SEED={seed} replays it)")
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    group = _start(run_dir, tmp_path)
    need = rng.randint(1, 4)
    deadline = time.monotonic() + 240
    while _committed(run_dir) < need and group.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 0.3))
    if not group.running():
        pytest.fail(f"the job ended before it could be killed (seed {seed}): make it longer")
    for p in group.procs:
        p.send_signal(signal.SIGKILL)
    results = group.wait(expect_ok=False)
    assert all(r.returncode == -signal.SIGKILL for r in results), [r.returncode for r in results]
    _start(run_dir, tmp_path).wait()
    resumed = export_run(run_dir, tmp_path / "final.pt")
    assert resumed["step"] == STEPS
    assert "users._embedding_module.embedding_bags.user.weight" in reference["model"], sorted(reference["model"])
    _assert_same(reference, resumed, f"hashed_ids, seed {seed}")


def test_the_hashed_example_resumes_on_one_rank_and_trains_on(tmp_path: Path, uninterrupted: tuple[Path, dict]) -> None:
    ref_dir, _ = uninterrupted
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    (result,) = _start(run_dir, tmp_path, world=1, steps=STEPS + 30).wait()
    assert f"hashed_ids: trained to step {STEPS + 30}" in result.stdout, result.stdout[-2000:]
    assert (run_dir / "metrics.jsonl").read_text().count('"event": "restore"') == 1  # from the 2 ranks' last checkpoint
    assert export_run(run_dir, tmp_path / "final.pt")["step"] == STEPS + 30
