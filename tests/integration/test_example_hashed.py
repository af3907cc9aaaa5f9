"""examples/hashed_ids.py, the example with a hashed user id over 2^40 ids (a managed-collision
table evicting every 20 steps) beside an ordinary table, run as it is on 2 gloo ranks through
the public `ckpt.Checkpointer`: killed from outside with SIGKILL at a random point (its seed
printed; `DELTAREC_TEST_SEED` replays it) and resumed, its final model (exported with
`deltarec-ckpt export`) is bit-identical to an uninterrupted run's; its checkpoint resumes on
1 rank and trains on, with evictions."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest

from launch.ranks import RankGroup, start_command
from tests.conformance.test_user_loops import kill_at_random
from tests.conftest import ReplaySeed
from tests.integration.test_examples import _assert_same, export_run

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


def test_the_hashed_example_killed_from_outside_resumes_bit_identical(
    tmp_path: Path, uninterrupted: tuple[Path, dict], replay_seed: ReplaySeed
) -> None:
    _, reference = uninterrupted
    run_dir = tmp_path / "run"
    kill_at_random(_start(run_dir, tmp_path), run_dir, replay_seed, 4, 0.3)
    _start(run_dir, tmp_path).wait()
    resumed = export_run(run_dir, tmp_path / "final.pt")
    assert resumed["step"] == STEPS
    assert "users._embedding_module.embedding_bags.user.weight" in reference["model"], sorted(reference["model"])
    _assert_same(reference, resumed, f"hashed_ids ({replay_seed})")


def test_the_hashed_example_resumes_on_one_rank_and_trains_on(tmp_path: Path, uninterrupted: tuple[Path, dict]) -> None:
    ref_dir, _ = uninterrupted
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    (result,) = _start(run_dir, tmp_path, world=1, steps=STEPS + 30).wait()
    assert f"hashed_ids: trained to step {STEPS + 30}" in result.stdout, result.stdout[-2000:]
    assert (run_dir / "metrics.jsonl").read_text().count('"event": "restore"') == 1  # from the 2 ranks' last checkpoint
    assert export_run(run_dir, tmp_path / "final.pt")["step"] == STEPS + 30
