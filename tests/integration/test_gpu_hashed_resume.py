"""A hashed table (`managed_collision`) trained with fused row-wise Adagrad on one GPU, where
an eviction can run (fbgemm resets an evicted row's momentum with a CUDA-only kernel, so the
combination is refused on CPU): the job SIGKILLed while its writer ships a checkpoint's rows,
and from outside once a checkpoint drawn from the seed has committed, resumes and ends
bit-identical (rows, row-wise momentum, dense state) to the same job never interrupted.

The debug job with t_item hashed (raw ids over 2**40 into 200 slots, an eviction every 3 steps,
a checkpoint every 10: resumes land between two evictions), as tests/integration/test_hashed_tables.py
runs it on CPU with plain Adagrad.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from launch.ranks import spawn_ranks, start_ranks
from tests.devices import NEEDS_CUDA
from tests.integration.test_gpu_resume import kill_once_committed
from tests.integration.test_hashed_tables import hashed_config

if TYPE_CHECKING:
    from tests.conftest import DebugConfig, MetricsReader, ReplaySeed

pytestmark = [pytest.mark.integration, pytest.mark.gpu, NEEDS_CUDA]

STEPS = 40
BASE = [f"train.steps={STEPS}", "train.save_params=true", "train.eval_batches=1"]


def _job(run_id: str, sink: str, bootstrap: str = "") -> list[str]:
    job = [
        *BASE,
        "ckpt.enabled=true",
        f"ckpt.sink.kind={sink}",
        f"ckpt.run_id={run_id}",
        "ckpt.schedule.policy=incremental",
        "ckpt.schedule.interval_steps=10",
        "ckpt.sink.flush_timeout_s=20",
    ]
    return [*job, f"ckpt.sink.bootstrap_servers={bootstrap}"] if bootstrap else job


def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "params" / "rank0.pt")


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], why: str) -> None:
    assert got.keys() == want.keys()
    assert any("t_item" in k for k in want), "the hashed table's rows are in the dump"
    for key in want:
        assert torch.equal(got[key], want[key]), f"{why}: {key} differs from the uninterrupted run"


@pytest.fixture(scope="module")
def config(tmp_path_factory, debug_config: DebugConfig) -> Path:
    return hashed_config(debug_config, tmp_path_factory.mktemp("gpu-hashed"), sparse="row_wise_adagrad")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, config: Path) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("gpu-hashed-reference")
    out = spawn_ranks(config, BASE, tmp, world_size=1)
    assert "sharding plan for 1 rank(s) on cuda" in out[0].stderr, out[0].stderr[-2000:]
    return _params(tmp / "run")


def test_the_hashed_gpu_job_is_deterministic(tmp_path, config: Path, reference) -> None:
    """Bit-exact resume presumes the run, evictions included, repeats itself bit for bit."""
    spawn_ranks(config, BASE, tmp_path, world_size=1)
    _assert_identical(_params(tmp_path / "run"), reference, "a second uninterrupted run")


def test_killed_while_shipping_rows_resumes_bit_exact(tmp_path, unique_name, config: Path, reference) -> None:
    job = _job(unique_name("gpu-hashed"), "filesystem")
    crashed = spawn_ranks(config, job, tmp_path, world_size=1, expect_ok=False, env_extra={"DELTAREC_KILL_AT": "rows:3@0"})
    assert crashed[0].returncode == -signal.SIGKILL, crashed[0].stderr[-2000:]
    resumed = spawn_ranks(config, [*job, "ckpt.restore.resume=latest"], tmp_path, world_size=1)
    assert "deltarec: resumed from checkpoint 2 at step 20" in resumed[0].stdout, resumed[0].stdout[-2000:]
    _assert_identical(_params(tmp_path / "run"), reference, "killed while shipping rows of checkpoint 3")


def test_killed_from_outside_resumes_bit_exact(
    tmp_path, broker, unique_name, config: Path, reference, metrics: MetricsReader, replay_seed: ReplaySeed
) -> None:
    """SIGKILLed by pid once checkpoint k (drawn from the seed) is committed, on Kafka."""
    k = replay_seed.rng().randint(1, 3)
    why = f"SIGKILL from outside after checkpoint {k} committed, {replay_seed}"
    print(why)
    job = _job(unique_name("gpu-hashed-ext"), "kafka", broker.bootstrap)
    group = start_ranks(config, job, tmp_path, world_size=1, timeout_s=180)
    run = tmp_path / "run"
    kill_once_committed(group, run, metrics, k, why)
    resumed = spawn_ranks(config, [*job, "ckpt.restore.resume=latest"], tmp_path, world_size=1)
    lines = [x for x in resumed[0].stdout.splitlines() if x.startswith("deltarec: resumed from checkpoint")]
    assert lines and int(lines[0].split()[4]) >= k, f"{why}\n{resumed[0].stdout[-2000:]}"
    _assert_identical(_params(run), reference, why)
