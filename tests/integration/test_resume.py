"""Exact recovery: a run SIGKILLed anywhere and resumed ends bit-identical to one never
interrupted (fp32 rows), for every policy, on the real embedded broker and on files.

Per policy, one job is killed at every crash point in turn, each attempt resuming the last;
the order, the ranks and the steps or checkpoints are drawn from the test's seed: a failure
names them with the command that replays it (`DELTAREC_TEST_SEED=<seed> ...`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from ckpt.log.backend import open_backend
from ckpt.log.catalog import read_catalog
from ckpt.log.markers import decode_record
from ckpt.stream.filesystem import FsMarkers
from launch.ranks import RankResult, spawn_ranks

if TYPE_CHECKING:
    from tests.conftest import DebugConfig, MetricsReader, ReplaySeed

STEPS = 60
pytestmark = pytest.mark.integration


def _job(run_id: str, sink: str, bootstrap: str, policy: str) -> list[str]:
    return [
        "ckpt.enabled=true",
        f"ckpt.sink.kind={sink}",
        f"ckpt.sink.bootstrap_servers={bootstrap}",
        f"ckpt.run_id={run_id}",
        f"ckpt.schedule.policy={policy}",
        "ckpt.schedule.interval_steps=10",
        "ckpt.sink.flush_timeout_s=20",
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
POINTS = ("step", "snapshot", "rows", "marker")  # training, inside the stall, the writer shipping rows,
# rows and dense file durable with no COMMIT marker yet


def _newest_commit(debug_config: DebugConfig, job: list[str], run_dir: Path) -> tuple[int, int]:
    """(newest committed checkpoint id, its step)."""
    cfg = debug_config.load([*job, f"run.dir={run_dir}"], check_data=False).ckpt
    backend = open_backend(cfg.run_id, cfg.sink, world_size=1)
    try:
        catalog = read_catalog(backend.markers, cfg.run_id)
    finally:
        backend.close()
    newest = max(catalog.commits, default=0)
    return newest, catalog.commits[newest].step if newest else 0


@pytest.mark.parametrize("policy", POLICIES)
def test_sigkill_anywhere_then_resume_is_bit_exact(
    tmp_path,
    broker,
    unique_name,
    reference,
    policy,
    debug_config: DebugConfig,
    replay_seed: ReplaySeed,
):
    """One job crashed at every point in turn (in an order and at places drawn from the seed),
    each attempt resuming the previous one's newest checkpoint, ends bit-identical. The first
    attempt dies at checkpoint 2 or 3 (one is committed before), a resumed one at its first
    checkpoint (ids after a crash are the trainer's to choose) or during a step. Every resume
    read its frames through the reads each rank started while it built its model (the same
    world size and plan: the guess of frames_ahead.py is right), and took the dense state each
    rank loaded meanwhile (ckpt/dense/ahead.py)."""
    rng = replay_seed.rng()
    job = _job(unique_name("resume"), "kafka", broker.bootstrap, policy)
    run_dir = tmp_path / "run"
    crashes = []
    resume: list[str] = []
    for point in rng.sample(POINTS, len(POINTS)):
        committed, restored_step = _newest_commit(debug_config, job, run_dir)
        if point == "step":
            key: int | str = rng.randint(restored_step + 3, restored_step + 9)
        else:
            key = rng.randint(2, 3) if not crashes else "*"
        rank = 0 if point == "marker" else rng.randint(0, 1)
        crashes.append(f"{point}:{key}@{rank}")
        why = f"crashes {crashes}, {replay_seed}"
        print(why)
        crashed = spawn_ranks(
            debug_config.path, [*job, *resume], tmp_path, expect_ok=False, timeout_s=180,
            env_extra={"DELTAREC_KILL_AT": crashes[-1]},
        )  # fmt: skip
        assert crashed[rank].returncode == -9, f"{why}: rank did not die by SIGKILL ({crashed[rank].returncode})"
        _check_resumed_from(crashed[0], committed, why)
        if point != "step":
            newest = _newest_commit(debug_config, job, run_dir)[0]
            ok = newest < key if isinstance(key, int) else newest == committed  # the killed checkpoint never commits
            assert ok, f"{why}: checkpoint {newest} committed"
        resume = ["ckpt.restore.resume=latest"]
    newest, _ = _newest_commit(debug_config, job, run_dir)
    resumed = spawn_ranks(debug_config.path, [*job, *resume], tmp_path, timeout_s=180)
    _check_resumed_from(resumed[0], newest, f"crashes {crashes}, {replay_seed}")
    _assert_identical(_dumps(run_dir), reference, f"crashes {crashes}, {replay_seed}")
    lines = [x for x in resumed[0].stdout.splitlines() if x.startswith("deltarec: resumed from checkpoint")]
    assert not newest or "(started ahead on 2 ranks)" in lines[0], (crashes, lines)
    assert not newest or "(loaded ahead on 2 ranks)" in lines[0], (crashes, lines)  # the dense state (ckpt/dense/ahead.py)


def _check_resumed_from(rank0: RankResult, newest: int, why: str) -> None:
    """Rank 0 resumed from `newest`, the newest checkpoint committed before it started (or
    started from scratch when there was none)."""
    lines = [x for x in rank0.stdout.splitlines() if x.startswith("deltarec: resumed from checkpoint")]
    if newest:
        assert lines and int(lines[0].split()[4]) == newest, f"{why}: resumed {lines[:1]}, not from checkpoint {newest}"
    else:
        assert not lines, f"{why}: resumed {lines[:1]} with no checkpoint committed"


def test_filesystem_sink_resumes_bit_exact(tmp_path, unique_name, reference, debug_config: DebugConfig, metrics: MetricsReader):
    job = _job(unique_name("fs"), "filesystem", "", "incremental")
    spawn_ranks(debug_config.path, job, tmp_path, expect_ok=False, env_extra={"DELTAREC_KILL_AT": "rows:4@1"})
    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest"], tmp_path)
    assert "deltarec: resumed from checkpoint 3 at step 30" in resumed[0].stdout
    _assert_identical(_dumps(tmp_path / "run"), reference, "filesystem sink")
    assert metrics(tmp_path / "run", ckpt_committed=True)
    # the debug config's catalog_every=2: the log is [attempt, commits 1, 2, a catalog record
    # of the log before commit 2, commit 3], and the resume read it from that record on
    # (each COMMIT after the LINK record of its own link)
    first_attempt_log = FsMarkers(tmp_path / "run" / "stream", job[3].split("=", 1)[1]).read_markers()
    kinds = [decode_record(data).kind for _, data in first_attempt_log]
    assert [k for k in kinds if k != "link"][:5] == ["attempt", "commit", "commit", "catalog", "commit"], kinds
    # commit 2 and its link, the catalog record, commit 3 and its link
    assert metrics.values(tmp_path / "run", "restore_markers_records", restored_ckpt=3) == [5]
    # every rank read the log ahead and loaded checkpoint 3's dense file while it built its model
    assert metrics.values(tmp_path / "run", "restore_dense_ahead_ranks", restored_ckpt=3) == [2]
    assert metrics.values(tmp_path / "run", "restore_read_ahead_ranks", restored_ckpt=3) == [0]  # files: no frames ahead


# with the overlap: the chain's base (1) copied late from its start, the restored delta (3) its rows
@pytest.mark.parametrize("overlap,late", [("true", "1:0.3,3:0.3:rows"), ("false", "*:0.3")])
def test_a_late_copy_still_holds_the_rows_of_its_checkpoint_step(
    tmp_path, unique_name, reference, debug_config: DebugConfig, overlap, late
):
    # A checkpoint's copy starts 0.3 s late (DELTAREC_SLOW_COPY), or only its copy of the rows
    # does, after the tracker's marks. With ckpt.capture.overlap_copy the training thread has gone
    # on to the next step meanwhile: its first lookup must wait for the marks, and its backward
    # pass for the rows, or the fused kernels update rows before they are copied and the
    # resumed run differs from the uninterrupted one. Without the overlap the stall simply
    # lasts longer.
    job = [*_job(unique_name("late-copy"), "filesystem", "", "one_shot_diff"), f"ckpt.capture.overlap_copy={overlap}"]
    spawn_ranks(
        debug_config.path, job, tmp_path, expect_ok=False, env_extra={"DELTAREC_KILL_AT": "rows:4@1", "DELTAREC_SLOW_COPY": late}
    )
    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest"], tmp_path)
    assert "deltarec: resumed from checkpoint 3 at step 30" in resumed[0].stdout
    _assert_identical(_dumps(tmp_path / "run"), reference, f"copies late ({late}), ckpt.capture.overlap_copy={overlap}")


# full: every checkpoint holds every trained row; one_shot_diff: deltas since the base
@pytest.mark.parametrize("sink,policy", [("kafka", "full"), ("filesystem", "one_shot_diff")])
def test_copy_on_write_reads_the_rows_of_the_checkpoint_step_while_training_updates_them(
    tmp_path, broker, unique_name, reference, debug_config: DebugConfig, metrics: MetricsReader, sink, policy
):
    # With ckpt.capture.copy_on_write no row is copied at the checkpoint step: each writer reads its
    # rows from the live shards, here 0.3 s late (DELTAREC_SLOW_COPY ":read"), while the job
    # trains on. The steps meanwhile must save aside, in their lookups, the rows they are about
    # to update, or the restore gets rows of a later step and the resumed run differs from the
    # uninterrupted one. Rank 1 dies while it writes checkpoint 4's rows.
    bootstrap = broker.bootstrap if sink == "kafka" else ""
    job = [*_job(unique_name("cow"), sink, bootstrap, policy), "ckpt.capture.copy_on_write=true"]
    crashed = spawn_ranks(
        debug_config.path, job, tmp_path, expect_ok=False,
        env_extra={"DELTAREC_KILL_AT": "rows:4@1", "DELTAREC_SLOW_COPY": "*:0.3:read"},
    )  # fmt: skip
    assert crashed[1].returncode == -9
    run = tmp_path / "run"
    aside = metrics.values(run, "ckpt_aside_bytes", ckpt_committed=True)
    assert len(aside) == 3 and all(b > 0 for b in aside), f"rows saved aside per committed checkpoint: {aside}"
    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest"], tmp_path)
    assert "deltarec: resumed from checkpoint 3 at step 30" in resumed[0].stdout
    _assert_identical(_dumps(run), reference, f"copy-on-write, {sink}, {policy}")
