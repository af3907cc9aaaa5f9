"""Dense store faults: a full disk or a permission error while rank 0 writes a
checkpoint's dense file fails that checkpoint only, reported naming the file; training goes on, the
next checkpoint is full, older checkpoints stay restorable, and no temporary file is left behind.
The OSError is injected at the write (`DELTAREC_DENSE_ERROR`): the tests run as root, which
chmod cannot stop, and mounting a small tmpfs needs privileges CI may not have."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from launch.ranks import spawn_ranks

if TYPE_CHECKING:
    from tests.conftest import DebugConfig, MetricsReader

pytestmark = pytest.mark.integration


def _job(run_id: str, steps: int) -> list[str]:
    return [
        "ckpt.enabled=true",
        "ckpt.sink=filesystem",
        f"ckpt.run_id={run_id}",
        "ckpt.policy=intermittent_diff",
        "ckpt.interval_steps=10",
        "ckpt.final=false",
        f"train.steps={steps}",
        "train.eval_batches=1",
    ]


@pytest.mark.parametrize(
    "failing, code, message",
    [
        (2, "ENOSPC", "No space left on device"),  # mid-run: the next checkpoint is full
        (4, "EACCES", "Permission denied"),  # the newest: resume takes the one before
    ],
)
def test_a_failed_dense_write_fails_that_checkpoint_only(
    tmp_path, unique_name, debug_config: DebugConfig, metrics: MetricsReader, failing, code, message
):
    run_dir = tmp_path / "run"
    job = _job(unique_name("dense"), 40)
    spawn_ranks(debug_config.path, job, tmp_path, env_extra={"DELTAREC_DENSE_ERROR": f"{failing}:{code}"})
    recs = {r["ckpt_id"]: r for r in metrics(run_dir, "ckpt_id")}
    assert sorted(recs) == [1, 2, 3, 4]
    bad = recs[failing]
    assert bad["ckpt_committed"] is False
    assert f"dense-{failing:08d}.pt: cannot write it: {message} ({code})" in bad["ckpt_error"], bad["ckpt_error"]
    assert all(recs[i]["ckpt_committed"] for i in recs if i != failing)
    if failing < 4:
        assert recs[failing + 1]["ckpt_full"], "a failed checkpoint makes the next one full"
    names = sorted(p.name for p in (run_dir / "dense").iterdir())
    assert names == sorted([f"dense-{i:08d}.pt" for i in recs if i != failing] + ["commits.jsonl"])  # no temp file

    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.resume=latest", "train.steps=50"], tmp_path)
    newest = 4 if failing != 4 else 3
    assert f"deltarec: resumed from checkpoint {newest} at step {newest * 10}" in resumed[0].stdout
