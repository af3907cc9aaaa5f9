"""Exact recovery: a run SIGKILLed anywhere and resumed ends bit-identical to one never
interrupted (fp32 rows), for every policy, on the real embedded broker and on files.

The crash point (rank, and the step or checkpoint id) is drawn from the test's seed: a
failure names it with the command that replays it (`DELTAREC_TEST_SEED=<seed> ...`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from ckpt.log.markers import decode_record
from ckpt.stream.filesystem import FsMarkers
from launch.ranks import spawn_ranks

if TYPE_CHECKING:
    from tests.conftest import DebugConfig, MetricsReader, ReplaySeed

STEPS = 60
pytestmark = pytest.mark.integration


def _job(run_id: str, sink: str, bootstrap: str, policy: str) -> list[str]:
    return [
        "ckpt.enabled=true",
        f"ckpt.sink={sink}",
        f"ckpt.bootstrap_servers={bootstrap}",
        f"ckpt.run_id={run_id}",
        f"ckpt.policy={policy}",
        "ckpt.interval_steps=10",
        "ckpt.flush_timeout_s=20",
        f"train.steps={STEPS}",
        "train.save_params=true",
        "train.eval_batches=1",
        "sharding.default=row_wise",
    ]


def _dumps(run_dir: Path, ranks: int = 2) -> list[dict[str, torch.Tensor]]:
    return [torch.load(run_dir / "params" / f"rank{r}.pt") for r in range(ranks)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, debug_config: DebugConfig) -> list[dict[str, torch.Tensor]]:
    """The same job never interrupted, without checkpoints at all."""
    tmp = tmp_path_factory.mktemp("reference")
    overrides = [f"train.steps={STEPS}", "train.save_params=true", "train.eval_batches=1", "sharding.default=row_wise"]
    spawn_ranks(debug_config.path, overrides, tmp)
    return _dumps(tmp / "run")


def _assert_identical(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]], what: str) -> None:
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for key in w:
            assert torch.equal(g[key], w[key]), f"{what}: rank {rank} {key} differs from the uninterrupted run"


POLICIES = ["full", "one_shot_diff", "incremental", "intermittent_diff"]
POINTS = {  # crash point -> range of its key: a step for "step", else a checkpoint id
    "step": (23, 47),  # during training
    "snapshot": (2, 5),  # inside the stall
    "rows": (2, 5),  # while the writer ships rows
    "marker": (2, 5),  # rows and dense file durable, COMMIT marker not yet written
}
CASES = [(policy, point, span) for policy in POLICIES for point, span in POINTS.items()]


@pytest.mark.parametrize("policy, point, span", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_sigkill_anywhere_then_resume_is_bit_exact(
    tmp_path, broker, unique_name, reference, policy, point, span, debug_config: DebugConfig, replay_seed: ReplaySeed
):
    rng = replay_seed.rng()
    key = rng.randint(*span)
    rank = 0 if point == "marker" else rng.randint(0, 1)
    why = f"killed rank {rank} at {point}:{key}, {replay_seed}"
    print(why)
    job = _job(unique_name("resume"), "kafka", broker.bootstrap, policy)
    crashed = spawn_ranks(
        debug_config.path, job, tmp_path, expect_ok=False, timeout_s=180, env_extra={"DELTAREC_KILL_AT": f"{point}:{key}@{rank}"}
    )
    assert crashed[rank].returncode == -9, f"{why}: rank did not die by SIGKILL ({crashed[rank].returncode})"
    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.resume=latest"], tmp_path, timeout_s=180)
    lines = [x for x in resumed[0].stdout.splitlines() if x.startswith("deltarec: resumed from checkpoint")]
    if lines:
        restored_id = int(lines[0].split()[4])
        if point != "step":
            assert restored_id < key, f"{why}: restored checkpoint {restored_id}, which had no COMMIT marker"
    else:  # killed before any COMMIT marker was durable: a fresh start is the right answer
        assert "starting from scratch" in resumed[0].stderr, f"{why}: neither resumed nor started fresh"
    _assert_identical(_dumps(tmp_path / "run"), reference, why)


def test_filesystem_sink_resumes_bit_exact(tmp_path, unique_name, reference, debug_config: DebugConfig, metrics: MetricsReader):
    job = _job(unique_name("fs"), "filesystem", "", "incremental")
    spawn_ranks(debug_config.path, job, tmp_path, expect_ok=False, env_extra={"DELTAREC_KILL_AT": "rows:4@1"})
    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.resume=latest"], tmp_path)
    assert "deltarec: resumed from checkpoint 3 at step 30" in resumed[0].stdout
    _assert_identical(_dumps(tmp_path / "run"), reference, "filesystem sink")
    assert metrics(tmp_path / "run", ckpt_committed=True)
    # the debug config's catalog_every=2: the log is [attempt, commits 1, 2, a catalog record
    # of the log before commit 2, commit 3], and the resume read it from that record on
    first_attempt_log = FsMarkers(tmp_path / "run" / "stream", job[3].split("=", 1)[1]).read_markers()[:5]
    assert [decode_record(data).kind for _, data in first_attempt_log] == ["attempt", "commit", "commit", "catalog", "commit"]
    assert metrics.values(tmp_path / "run", "restore_markers_records", restored_ckpt=3) == [3]


# with the overlap: the chain's base (1) copied late from its start, the restored delta (3) its rows
@pytest.mark.parametrize("overlap,late", [("true", "1:0.3,3:0.3:rows"), ("false", "*:0.3")])
def test_a_late_copy_still_holds_the_rows_of_its_checkpoint_step(
    tmp_path, unique_name, reference, debug_config: DebugConfig, overlap, late
):
    # A checkpoint's copy starts 0.3 s late (DELTAREC_SLOW_COPY), or only its copy of the rows
    # does, after the tracker's marks. With ckpt.overlap_copy the training thread has gone
    # on to the next step meanwhile: its first lookup must wait for the marks, and its backward
    # pass for the rows, or the fused kernels update rows before they are copied and the
    # resumed run differs from the uninterrupted one. Without the overlap the stall simply
    # lasts longer.
    job = [*_job(unique_name("late-copy"), "filesystem", "", "one_shot_diff"), f"ckpt.overlap_copy={overlap}"]
    spawn_ranks(
        debug_config.path, job, tmp_path, expect_ok=False, env_extra={"DELTAREC_KILL_AT": "rows:4@1", "DELTAREC_SLOW_COPY": late}
    )
    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.resume=latest"], tmp_path)
    assert "deltarec: resumed from checkpoint 3 at step 30" in resumed[0].stdout
    _assert_identical(_dumps(tmp_path / "run"), reference, f"copies late ({late}), ckpt.overlap_copy={overlap}")
