"""The bit-width policy end to end, on 2 real ranks and the filesystem sink: every COMMIT marker
names the weight codec that `ckpt.encoding.restore_bit_widths` gives for `ckpt.encoding.expected_restores`, and
checkpoints written after more restores than expected fall back to 8-bit."""

from __future__ import annotations

import pytest

from ckpt.log.backend import open_backend
from ckpt.log.catalog import commits
from launch.ranks import spawn_ranks

pytestmark = [pytest.mark.integration, pytest.mark.multirank]


def test_a_calibrated_table_then_8_bit_once_restored_more_often_than_expected(tmp_path, debug_config) -> None:
    job = ["ckpt.enabled=true", "ckpt.sink.kind=filesystem", "ckpt.schedule.interval_steps=10", "train.eval_batches=1"]
    job += ["ckpt.encoding.expected_restores=1", "ckpt.encoding.restore_bit_widths=[[1,3]]"]
    spawn_ranks(debug_config.path, [*job, "train.steps=20"], tmp_path)
    for step, steps in [(20, 30), (30, 40)]:
        out = spawn_ranks(debug_config.path, [*job, f"train.steps={steps}", "ckpt.restore.resume=latest"], tmp_path)[0].stdout
        assert f"at step {step}" in out, out[-2000:]

    cfg = debug_config.load([*job, f"run.dir={tmp_path / 'run'}"], check_data=False)
    backend = open_backend(cfg.ckpt.run_id, cfg.ckpt.sink, world_size=1)
    try:
        found = commits(backend.markers.read_markers(), cfg.ckpt.run_id)
    finally:
        backend.close()
    weights = {m.step: m.encodings["weights"] for _, m in found}
    # 3-bit from the table for one expected restore, kept after the first restore; the second
    # restore is one more than expected, so from then on rows are written at 8 bits
    assert weights == {10: "adaptive3", 20: "adaptive3", 30: "adaptive3", 40: "asym8"}
    # row-wise Adagrad's state is one float per row: asym8's scale and bias would make it bigger,
    # so it stays fp32 (never below the 8-bit floor either way)
    assert {m.encodings["optimizer.sum"] for _, m in found} == {"fp32"}
