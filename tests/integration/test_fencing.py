"""Zombie writers (docs/design/failures.md): two trainer attempts of one run at once, and two
`deltarec-ckpt gc` at once. The newest ATTEMPT record in the markers log holds the run
(ckpt/log/fencing.py): the older writer stops with one line and nothing it could still write is
ever restored. Real gloo ranks, the real embedded broker, real files, SIGSTOP/SIGCONT from
outside."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from ckpt.faults import HOLD_ENV
from ckpt.log.backend import open_backend
from ckpt.log.catalog import read_catalog
from ckpt.stream.filesystem import FsSink, scan_records
from launch.ranks import REPO, spawn_ranks, start_ranks
from tests.conftest import LAUNCHER_VARS
from trainer.ckpt_cli import load_job_ckpt_config

if TYPE_CHECKING:
    from tests.conftest import DebugConfig, MetricsReader

pytestmark = pytest.mark.integration

SHAPE = [
    "train.save_params=true",
    "train.eval_batches=1",
    "sharding.default=row_wise",
    "ckpt.schedule.interval_steps=10",
    "ckpt.sink.flush_timeout_s=20",
]


def _job(run_id: str, sink: str, bootstrap: str = "", policy: str = "incremental") -> list[str]:
    return [
        "ckpt.enabled=true",
        f"ckpt.sink.kind={sink}",
        f"ckpt.sink.bootstrap_servers={bootstrap}",
        f"ckpt.run_id={run_id}",
        f"ckpt.schedule.policy={policy}",
        *SHAPE,
    ]


def _catalog(debug_config: DebugConfig, tmp_path: Path, job: list[str]):
    cfg = debug_config.load([f"run.dir={tmp_path / 'run'}", *job], check_data=False).ckpt
    backend = open_backend(cfg.run_id, cfg.sink, world_size=1)
    try:
        return read_catalog(backend.markers, cfg.run_id)
    finally:
        backend.close()


def _dumps(run_dir: Path, ranks: int = 2) -> list[dict[str, torch.Tensor]]:
    return [torch.load(run_dir / "params" / f"rank{r}.pt") for r in range(ranks)]


def test_an_old_attempt_that_wakes_up_after_a_newer_one_started_stops_and_is_never_restored(
    tmp_path, broker, unique_name, debug_config: DebugConfig, metrics: MetricsReader
):
    """Attempt A is stopped (SIGSTOP, from outside) after its second checkpoint; attempt B of
    the same run resumes from it and finishes. A is continued: at its next checkpoint it finds
    B's ATTEMPT record, writes no dense file and no marker, and every rank stops with one line.
    B's newest checkpoint restores exactly B's final state."""
    job = _job(unique_name("zombie"), "kafka", broker.bootstrap)
    run = tmp_path / "run"
    a = start_ranks(debug_config.path, [*job, "train.steps=100000"], tmp_path, timeout_s=240)
    try:
        deadline = time.monotonic() + 120
        while not metrics(run, live=True, ckpt_id=2, ckpt_committed=True):
            assert a.running() and time.monotonic() < deadline, "attempt A never committed checkpoint 2"
            time.sleep(0.05)
        for proc in a.procs:
            os.kill(proc.pid, signal.SIGSTOP)
        # A may have written the dense file of a checkpoint whose COMMIT it had not appended yet
        # when it was stopped (it still held the run then): what it must not do is write one after
        dense_before_b = {int(p.stem.split("-")[1]) for p in (run / "dense").glob("dense-*.pt")}
        before = _catalog(debug_config, tmp_path, job)
        newest = max(before.commits)
        assert newest >= 2 and before.holder("trainer").epoch == 1  # the first record of the markers topic

        b = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest", f"train.steps={newest * 10 + 30}"],
                        tmp_path, timeout_s=180)  # fmt: skip
        assert f"deltarec: resumed from checkpoint {newest} at step {newest * 10}" in b[0].stdout
        b_state = _dumps(run)
        after_b = _catalog(debug_config, tmp_path, job)
        b_ids = sorted(set(after_b.commits) - set(before.commits))
        epoch_b = after_b.holder("trainer").epoch
        assert len(b_ids) == 3 and epoch_b > 1, b_ids

        for proc in a.procs:
            os.kill(proc.pid, signal.SIGCONT)
        results = a.wait(expect_ok=False)
    finally:
        for proc in a.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
    assert all(r.returncode not in (0, None) for r in results), [r.returncode for r in results]
    # Every rank learns of B from the same outcome at the end of a step; the first to read it
    # stops with the line, and a rank still in the next step's collective may stop on the lost
    # peer instead (the race is whose writer thread delivered the outcome first).
    lines = [ln for r in results for ln in r.stderr.splitlines() if "a newer trainer attempt" in ln]
    assert lines and all("took over this run's markers log" in ln and f"epoch {epoch_b}," in ln for ln in lines), "\n".join(
        r.stderr[-2000:] for r in results
    )

    final = _catalog(debug_config, tmp_path, job)
    assert sorted(final.commits) == sorted(after_b.commits), "attempt A committed after B started"
    assert {final.commits[i].attempt for i in b_ids} == {final.holder("trainer").attempt}
    assert all(link.epoch in (1, epoch_b) for m in final.commits.values() for link in m.chain)
    assert {link.epoch for i in b_ids for link in final.commits[i].chain if link.checkpoint_id in b_ids} == {epoch_b}
    dense_ids = sorted(int(p.stem.split("-")[1]) for p in (run / "dense").glob("dense-*.pt"))
    assert set(dense_ids) - dense_before_b == set(final.commits) - set(before.commits), (
        f"attempt A wrote a dense file after B started: {dense_ids}, before B {sorted(dense_before_b)}"
    )

    c = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest", f"train.steps={newest * 10 + 30}"],
                    tmp_path, timeout_s=180)  # fmt: skip
    assert f"deltarec: resumed from checkpoint {b_ids[-1]} at step {newest * 10 + 30}" in c[0].stdout
    for rank, (got, want) in enumerate(zip(_dumps(run), b_state)):
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), f"rank {rank} {key}: B's newest checkpoint is not B's state"


def _gc(tool: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    full_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS} | {"PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "trainer.ckpt_cli", *tool, "gc", "--keep", "1"],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _held(gc: subprocess.Popen[str], point: str) -> str:
    """What `gc` printed on stderr until it said it holds at `point` (within 60 s)."""
    deadline = time.monotonic() + 60
    err = ""
    while f"holding at {point}" not in err:
        assert gc.poll() is None and time.monotonic() < deadline, f"gc never held at {point}: {gc.communicate()}"
        assert gc.stderr is not None
        err += os.read(gc.stderr.fileno(), 4096).decode()
    return err


def test_of_two_gcs_at_once_exactly_one_deletes(tmp_path, unique_name, debug_config: DebugConfig):
    """gc A records what it drops, then holds (before deleting anything) while gc B runs: B,
    the newer, deletes what A recorded as well as its own share; A, let go, stops with one line
    and deletes nothing. Kept checkpoints stay restorable."""
    job = _job(unique_name("gc2"), "filesystem", policy="full")
    spawn_ranks(debug_config.path, [*job, "train.steps=40"], tmp_path, world_size=1, timeout_s=120)
    tool = ["--config", str(debug_config.path), f"run.dir={tmp_path / 'run'}", *job]
    cfg = load_job_ckpt_config(str(debug_config.path), tool[2:])
    stream = Path(cfg.sink.fs_root)
    generations = lambda: sorted(p.name for p in stream.iterdir() if ".rows." in p.name)  # noqa: E731
    assert generations() == [f"{cfg.run_id}.rows.g{i}" for i in (1, 2, 3, 4)]

    hold = tmp_path / "hold-gc-a"
    hold.touch()
    a = _gc(tool, {HOLD_ENV: f"gc:0={hold}"})
    try:
        err = _held(a, "gc:0")
        b = subprocess.run(
            [sys.executable, "-m", "trainer.ckpt_cli", *tool, "gc", "--keep", "1"],
            cwd=REPO,
            env={k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert b.returncode == 0, b.stderr[-2000:]
        assert "kept checkpoints [4]; dropped generations []; finished deleting ['g1', 'g2', 'g3']" in b.stdout, b.stdout
        assert generations() == [f"{cfg.run_id}.rows.g4"]
    finally:
        hold.unlink(missing_ok=True)
    out, rest = a.communicate(timeout=60)
    assert a.returncode == 1, (out, err + rest)
    assert "deltarec-ckpt: error: run" in rest and "a newer deltarec-ckpt gc" in rest, rest
    assert "kept checkpoints" not in out

    catalog = _catalog(debug_config, tmp_path, job)
    assert catalog.dropped == {1, 2, 3} and [m.checkpoint_id for m in catalog.restorable()] == [4]
    assert f"epoch {catalog.holder('gc').epoch}," in rest, rest  # gc B's
    # a checkpoint whose generation gc dropped: named, refused, never silently replaced by an older one
    refused = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=2", "train.steps=50"], tmp_path, world_size=1,
                          timeout_s=120, expect_ok=False)  # fmt: skip
    assert refused[0].returncode == 2, refused[0].stderr[-2000:]
    assert (
        f"checkpoint 2 of run {cfg.run_id}: every chain that restores it reads a generation deltarec-ckpt gc dropped ([1, 2, 3])"
    ) in refused[0].stderr, refused[0].stderr[-2000:]
    assert "resumed from" not in refused[0].stdout


def test_a_checkpoint_committed_while_gc_runs_keeps_its_dense_file(tmp_path, unique_name, debug_config: DebugConfig):
    """gc reads the log, chooses what it keeps and holds (`gc_read:0`) before its DROPPED record;
    meanwhile the trainer resumes and commits checkpoint 5. Let go, gc reads the log again before
    its record and each deletion (its fencing) and so learns of checkpoint 5, which it did not
    choose to keep: the dense files it deletes are still the ones it chose from its first read, so
    checkpoint 5 keeps its own and the run resumes from it."""
    job = _job(unique_name("gc-live"), "filesystem", policy="full")
    spawn_ranks(debug_config.path, [*job, "train.steps=40"], tmp_path, world_size=1, timeout_s=120)
    tool = ["--config", str(debug_config.path), f"run.dir={tmp_path / 'run'}", *job]
    dense = tmp_path / "run" / "dense"
    dense_ids = lambda: sorted(int(p.stem.split("-")[1]) for p in dense.glob("dense-*.pt"))  # noqa: E731
    assert dense_ids() == [1, 2, 3, 4]

    hold = tmp_path / "hold-gc"
    hold.touch()
    gc = _gc(tool, {HOLD_ENV: f"gc_read:0={hold}"})
    try:
        err = _held(gc, "gc_read:0")
        spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest", "train.steps=50"], tmp_path, world_size=1,
                    timeout_s=120)  # fmt: skip
        assert dense_ids() == [1, 2, 3, 4, 5]
    finally:
        hold.unlink(missing_ok=True)
    out, rest = gc.communicate(timeout=60)
    assert gc.returncode == 0 and "kept checkpoints [4]; dropped generations ['g1', 'g2', 'g3']" in out, (out, err + rest)
    assert dense_ids() == [4, 5]
    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest", "train.steps=60"], tmp_path,
                          world_size=1, timeout_s=120)  # fmt: skip
    assert "deltarec: resumed from checkpoint 5 at step 50" in resumed[0].stdout, resumed[0].stdout[-2000:]


def test_a_filesystem_segment_has_one_writer_at_a_time(tmp_path):
    """Two processes appending to one segment file would interleave their records: another
    process's append fails (that checkpoint fails) while this one holds the file open, and
    succeeds once it closed it."""
    code = (
        "import sys; from ckpt.stream.filesystem import FsSink, scan_records; from ckpt.stream.sink import SinkError\n"
        "s = FsSink(sys.argv[1], 'seg')\n"
        "try: s.write(b'y' * 64, generation=5, partition=0)\n"
        "except SinkError: pass\n"
        "r = s.flush(); print('ok' if r.ok else r.error)\n"
    )
    first = FsSink(tmp_path, "seg")
    first.write(b"x" * 64, generation=5, partition=0)
    assert first.flush().ok
    second = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "0.seg is being written by another process" in second.stdout, second.stdout + second.stderr
    first.write(b"z" * 64, generation=5, partition=0)  # the holder goes on undisturbed
    assert first.flush().ok
    first.close()
    after = FsSink(tmp_path, "seg")  # the lock went with the file
    after.write(b"w" * 64, generation=5, partition=0)
    assert after.flush().ok
    after.close()
    segment = tmp_path / "seg.rows.g5" / "0.seg"
    with open(segment, "rb") as f:
        payloads = [payload for _, _, payload in scan_records(f, segment)]
    assert payloads == [b"x" * 64, b"z" * 64, b"w" * 64]
