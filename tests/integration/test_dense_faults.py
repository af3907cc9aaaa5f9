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
        "ckpt.sink.kind=filesystem",
        f"ckpt.run_id={run_id}",
        "ckpt.schedule.policy=intermittent_diff",
        "ckpt.schedule.interval_steps=10",
        "ckpt.schedule.final=false",
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

    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest", "train.steps=50"], tmp_path)
    newest = 4 if failing != 4 else 3
    assert f"deltarec: resumed from checkpoint {newest} at step {newest * 10}" in resumed[0].stdout


@pytest.mark.parametrize("copy_on_write", [False, True])
def test_checkpoints_queued_behind_a_failed_one_are_left_unwritten_and_the_next_commits(
    tmp_path, unique_name, debug_config: DebugConfig, metrics: MetricsReader, copy_on_write
):
    """Checkpoint 3's writer is held 3 s and its dense write then fails; the incremental deltas
    decided meanwhile chain through it, so no restore could use them: every rank leaves them
    unwritten (no rows, no bytes) instead of writing in vain, the console says so in one line
    with their ids as a range, and the last checkpoint, decided once the failure is known, is
    full and commits on its own. With copy-on-write, a snapshot left unread ends its
    registration all the same (`Snapshot.release`)."""
    run_dir = tmp_path / "run"
    job = [
        *_job(unique_name("cascade"), 40),
        "ckpt.schedule.policy=incremental",
        "ckpt.schedule.interval_steps=2",
        "ckpt.schedule.final=true",
    ]
    job.append(f"ckpt.capture.copy_on_write={str(copy_on_write).lower()}")
    env = {"DELTAREC_DENSE_ERROR": "3:ENOSPC", "DELTAREC_SLOW_FLUSH": "3:3"}
    results = spawn_ranks(debug_config.path, job, tmp_path, env_extra=env)
    recs = {r["ckpt_id"]: r for r in metrics(run_dir, "ckpt_id")}
    assert [recs[i]["ckpt_committed"] for i in (1, 2, 3)] == [True, True, False], recs
    unwritten = [i for i in recs if "not written: its chain runs through checkpoint 3" in (recs[i].get("ckpt_error") or "")]
    assert len(unwritten) >= 2 and unwritten == list(range(4, 4 + len(unwritten))), sorted(recs)
    assert all(recs[i]["ckpt_bytes"] == 0 and recs[i]["ckpt_rows"] == 0 for i in unwritten)
    last = recs[max(recs)]
    assert last["ckpt_committed"] and last["ckpt_full"] and last["step"] == 40, last
    console = results[0].stdout + results[0].stderr
    said = [line for line in console.splitlines() if "not written" in line]
    assert len(said) == 1, said
    first, final = unwritten[0], unwritten[-1]
    assert f"checkpoint(s) {first}-{final} not written: their chain runs through checkpoint 3, which failed" in said[0]
    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest", "train.steps=44"], tmp_path)
    assert f"deltarec: resumed from checkpoint {max(recs)} at step 40" in resumed[0].stdout
