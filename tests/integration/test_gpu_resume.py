"""A one-GPU job (nccl, fbgemm-gpu's CUDA kernels) checkpointing to the embedded broker,
SIGKILLed and resumed, ends bit-identical to the same job never interrupted.

The ranks pick the GPU themselves (sharding/process_group.py: CUDA when visible, nccl with
it), so this runs the trainer exactly as a GPU user does. The crash is a SIGKILL through the
trainer's fault hook while the writer ships rows of a checkpoint, and, in a second job, a
SIGKILL by pid from outside once a checkpoint drawn from the seed has committed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from launch.ranks import RankGroup, spawn_ranks, start_ranks
from tests.devices import NEEDS_CUDA

if TYPE_CHECKING:
    from tests.conftest import DebugConfig, MetricsReader, ReplaySeed

pytestmark = [pytest.mark.integration, pytest.mark.gpu, NEEDS_CUDA]

STEPS = 60
BASE = [f"train.steps={STEPS}", "train.save_params=true", "train.eval_batches=1", "sharding.default=row_wise"]


def _job(run_id: str, bootstrap: str) -> list[str]:
    return [
        *BASE,
        "ckpt.enabled=true",
        "ckpt.sink.kind=kafka",
        f"ckpt.sink.bootstrap_servers={bootstrap}",
        f"ckpt.run_id={run_id}",
        "ckpt.schedule.policy=one_shot_diff",
        "ckpt.schedule.interval_steps=10",
        "ckpt.sink.flush_timeout_s=20",
    ]


def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "params" / "rank0.pt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, debug_config: DebugConfig) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("gpu-reference")
    out = spawn_ranks(debug_config.path, BASE, tmp, world_size=1)
    assert "sharding plan for 1 rank(s) on cuda" in out[0].stderr, out[0].stderr[-2000:]
    return _params(tmp / "run")


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], why: str) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), f"{why}: {key} differs from the uninterrupted run"


def kill_once_committed(group: RankGroup, run: Path, metrics: MetricsReader, k: int, why: str) -> None:
    """SIGKILL the one-rank job `group` by pid, from outside, once its checkpoint `k` has
    committed (within 150 s), and wait for it to die of that."""
    try:
        deadline = time.monotonic() + 150
        while not metrics(run, live=True, ckpt_id=k, ckpt_committed=True):
            assert group.running() and time.monotonic() < deadline, f"{why}: checkpoint {k} was never committed"
            time.sleep(0.01)
        os.kill(group.procs[0].pid, signal.SIGKILL)
    finally:
        results = group.wait(expect_ok=False)
    assert results[0].returncode == -signal.SIGKILL, f"{why}: the job ended before the kill ({results[0].returncode})"


def test_the_gpu_job_is_deterministic(tmp_path, debug_config: DebugConfig, reference) -> None:
    """Bit-exact resume presumes a run repeats itself bit for bit on the GPU."""
    spawn_ranks(debug_config.path, BASE, tmp_path, world_size=1)
    _assert_identical(_params(tmp_path / "run"), reference, "a second uninterrupted run")


def test_sigkill_while_shipping_rows_then_resume_is_bit_exact(
    tmp_path, broker, unique_name, reference, debug_config: DebugConfig, metrics: MetricsReader
) -> None:
    job = _job(unique_name("gpu"), broker.bootstrap)
    crashed = spawn_ranks(
        debug_config.path, job, tmp_path, world_size=1, expect_ok=False, env_extra={"DELTAREC_KILL_AT": "rows:4@0"}
    )
    assert crashed[0].returncode == -signal.SIGKILL, crashed[0].stderr[-2000:]
    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest"], tmp_path, world_size=1)
    assert "deltarec: resumed from checkpoint 3 at step 30" in resumed[0].stdout, resumed[0].stdout[-2000:]
    _assert_identical(_params(tmp_path / "run"), reference, "killed while shipping rows of checkpoint 4")
    assert metrics(tmp_path / "run", ckpt_committed=True)


def test_sigkill_from_outside_then_resume_is_bit_exact(
    tmp_path,
    broker,
    unique_name,
    reference,
    debug_config: DebugConfig,
    metrics: MetricsReader,
    replay_seed: ReplaySeed,
) -> None:
    """The rank is SIGKILLed by pid, not through its own hook, once checkpoint k (drawn from the
    seed) is committed: wherever training then is, the resume restores k or a later one."""
    k = replay_seed.rng().randint(2, 4)
    why = f"SIGKILL from outside after checkpoint {k} committed, {replay_seed}"
    print(why)
    job = _job(unique_name("gpu-ext"), broker.bootstrap)
    group = start_ranks(debug_config.path, job, tmp_path, world_size=1, timeout_s=180)
    run = tmp_path / "run"
    kill_once_committed(group, run, metrics, k, why)
    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest"], tmp_path, world_size=1)
    lines = [x for x in resumed[0].stdout.splitlines() if x.startswith("deltarec: resumed from checkpoint")]
    assert lines and int(lines[0].split()[4]) >= k, f"{why}\n{resumed[0].stdout[-2000:]}"
    _assert_identical(_params(run), reference, why)
