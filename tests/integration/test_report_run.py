"""`deltarec-report` on a real run: one process (world size 1) trains with filesystem
checkpoints, is resumed from its last checkpoint, and the report's printed summary must
agree with the records both attempts wrote to metrics.jsonl."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.conftest import CliRunner, DebugConfig, MetricsReader

pytestmark = pytest.mark.integration


def test_report_of_a_resumed_run_matches_its_metrics(
    tmp_path: Path, debug_config: DebugConfig, run_cli: CliRunner, metrics: MetricsReader
) -> None:
    run_dir = tmp_path / "run"
    job = [
        "--config", debug_config.path, f"run.dir={run_dir}", "ckpt.enabled=true", "ckpt.sink.kind=filesystem",
        "ckpt.schedule.interval_steps=10", "train.eval_batches=1",
    ]  # fmt: skip
    run_cli("trainer.main", *job, "train.steps=40", timeout_s=300)
    run_cli("trainer.main", *job, "train.steps=60", "ckpt.restore.resume=latest", timeout_s=300)
    lines = run_cli("trainer.report", *job).stdout.splitlines()

    restores = metrics(run_dir, "restored_ckpt")
    assert [(r["restored_ckpt"], r["step"]) for r in restores] == [(4, 40)]  # the final checkpoint of attempt 1
    committed = metrics(run_dir, ckpt_committed=True)
    assert [r["step"] for r in committed] == [10, 20, 30, 40, 50, 60]
    last_eval = metrics(run_dir, "eval_auc")[-1]
    assert lines[0] == "trained to step 60 over 2 attempts"
    auc, logloss = last_eval["eval_auc"], last_eval["eval_logloss"]
    assert lines[1] == f"final eval (step 60): AUC {auc:.4f}, log loss {logloss:.4f}"
    assert lines[2] == f"checkpoints: {len(committed)} committed, 0 failed, 0 skipped"
    (restore_line,) = [x for x in lines if x.startswith("restores: ")]
    r = restores[0]
    assert restore_line.startswith(f"restores: 1: checkpoint 4 at step 40 (chain {r['restore_chain']}, ")
    assert restore_line.endswith(f" in {r['restore_s']:.2f} s)")
    assert lines[-1] == f"report: {run_dir / 'report.png'}"
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tensorboard_mirrors_metrics_of_a_real_run(
    tmp_path: Path, debug_config: DebugConfig, run_cli: CliRunner, metrics: MetricsReader
) -> None:
    """`train.tensorboard=true` on the real trainer: every loss and eval scalar in metrics.jsonl
    is in <run_dir>/tensorboard at its step, and nothing else is."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    run_cli(
        "trainer.main",
        "--config",
        debug_config.path,
        f"run.dir={run_dir}",
        "train.steps=20",
        "train.log_every=5",
        "train.eval_batches=1",
        "train.tensorboard=true",
        timeout_s=300,
    )
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval_auc", "eval_logloss", "eval_samples", "loss", "samples_per_s"]
    for key in ("loss", "eval_auc"):
        written = [(r["step"], r[key]) for r in metrics(run_dir, key)]
        read = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in read] == [s for s, _ in written] and written
        assert [v for _, v in read] == pytest.approx([v for _, v in written], rel=1e-6)  # TensorBoard stores float32
