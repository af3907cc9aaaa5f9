"""SIGKILL during a restore, a `deltarec-ckpt gc` and an `export`: the next attempt succeeds and
nothing already saved is lost. Real gloo ranks, the real embedded broker,
real files; the kills are real SIGKILLs, through the crash points of ckpt/faults.py and from
outside the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt import cli as ckpt_cli
from ckpt.faults import ENV, SLOW_RESTORE_ENV
from ckpt.log.backend import open_backend
from ckpt.log.catalog import read_catalog
from launch.ranks import REPO, spawn_ranks, start_ranks
from tests.conftest import LAUNCHER_VARS
from trainer.ckpt_cli import load_job_ckpt_config

if TYPE_CHECKING:
    from tests.conftest import CliRunner, DebugConfig, ReplaySeed

pytestmark = pytest.mark.integration

STEPS = 60
SHAPE = ["train.save_params=true", "train.eval_batches=1", "sharding.default=row_wise"]
KILLED = -signal.SIGKILL


def _job(run_id: str, sink: str, bootstrap: str = "", policy: str = "incremental", steps: int = STEPS) -> list[str]:
    return [
        "ckpt.enabled=true",
        f"ckpt.sink.kind={sink}",
        f"ckpt.sink.bootstrap_servers={bootstrap}",
        f"ckpt.run_id={run_id}",
        f"ckpt.schedule.policy={policy}",
        "ckpt.schedule.interval_steps=10",
        "ckpt.sink.flush_timeout_s=20",
        f"train.steps={steps}",
        *SHAPE,
    ]


def _tool(debug_config: DebugConfig, tmp_path: Path, job: list[str]) -> list[str]:
    """`deltarec-ckpt`'s arguments before the command: the job's config and overrides."""
    return ["--config", str(debug_config.path), f"run.dir={tmp_path / 'run'}", *job]


def _in_process(argv: list[str]) -> int:
    """`deltarec-ckpt argv` in this process: the runs no test kills, without an interpreter's start."""
    return ckpt_cli.main(argv, load_job_ckpt_config)


def _state(debug_config: DebugConfig, tmp_path: Path, job: list[str]) -> tuple[Any, list[int], list[int]]:
    """The run's catalog, the generations its sink holds and the ids of its dense files."""
    cfg = debug_config.load([f"run.dir={tmp_path / 'run'}", *job], check_data=False).ckpt
    backend = open_backend(cfg.run_id, cfg.sink, world_size=1)
    try:
        catalog = read_catalog(backend.markers, cfg.run_id)
        generations = backend.sink.generations()
    finally:
        backend.close()
    return catalog, generations, sorted(int(p.stem.split("-")[1]) for p in Path(cfg.sink.dense_dir).glob("dense-*.pt"))


def _dumps(run_dir: Path, ranks: int = 2) -> list[dict[str, torch.Tensor]]:
    return [torch.load(run_dir / "params" / f"rank{r}.pt") for r in range(ranks)]


# --- restore ------------------------------------------------------------------------------------


def test_restore_killed_by_its_fault_hook_and_from_outside_then_resume_is_bit_exact(
    tmp_path, broker, unique_name, debug_config: DebugConfig, replay_seed: ReplaySeed
):
    reference = tmp_path / "reference"
    reference.mkdir()
    spawn_ranks(debug_config.path, [f"train.steps={STEPS}", *SHAPE], reference, timeout_s=120)
    job = _job(unique_name("restore"), "kafka", broker.bootstrap)
    crashed = spawn_ranks(debug_config.path, job, tmp_path, expect_ok=False, timeout_s=120,
                          env_extra={ENV: "committed:3@0"})  # fmt: skip
    assert crashed[0].returncode == KILLED
    catalog, _, _ = _state(debug_config, tmp_path, job)
    newest = 3  # restored from the chain [1, 2, 3]
    assert max(catalog.commits) == newest and [link.checkpoint_id for link in catalog.commits[newest].chain] == [1, 2, 3]
    records = catalog.records
    hook_rank = replay_seed.rng().randint(0, 1)
    outside_rank = 1 - hook_rank
    why = f"restore killed on rank {hook_rank} (crash point), then rank {outside_rank} (from outside), {replay_seed}"
    print(why)
    resume = [*job, "ckpt.restore.resume=latest"]

    # the crash point: the rank has written its first frame of the chain into its shards
    killed = spawn_ranks(debug_config.path, resume, tmp_path, expect_ok=False, timeout_s=120,
                         env_extra={ENV: f"restore:{newest}@{hook_rank}"})  # fmt: skip
    assert killed[hook_rank].returncode == KILLED, f"{why}: {killed[hook_rank].stderr[-2000:]}"

    # from outside: the rank holds in the same place and says so; the test SIGKILLs it there
    group = start_ranks(debug_config.path, resume, tmp_path, timeout_s=120,
                        env_extra={SLOW_RESTORE_ENV: f"{newest}:60"})  # fmt: skip
    err = Path(group.logs[outside_rank][1].name)
    deadline = time.monotonic() + 90
    while "holds its restore" not in err.read_text():
        assert group.running() and time.monotonic() < deadline, f"{why}: rank never reached its restore"
        time.sleep(0.05)
    os.kill(group.procs[outside_rank].pid, signal.SIGKILL)
    assert group.procs[outside_rank].wait(timeout=30) == KILLED
    for proc in group.procs:  # the other rank holds on; stop it as torchrun's agent would
        if proc.poll() is None:
            proc.kill()
    group.wait(expect_ok=False)

    after, _, _ = _state(debug_config, tmp_path, job)
    # an attempt announces itself in the background (ckpt/log/fencing.py), and wrote nothing else
    assert records <= after.records <= records + 2, f"{why}: a killed restore wrote to the markers log"
    assert after.commits.keys() == catalog.commits.keys() and after.failed.keys() == catalog.failed.keys(), why
    assert after.dropped == catalog.dropped and not after.fenced_commits, why
    resumed = spawn_ranks(debug_config.path, resume, tmp_path, timeout_s=120)
    assert f"deltarec: resumed from checkpoint {newest} at step {newest * 10}" in resumed[0].stdout, why
    for rank, (got, want) in enumerate(zip(_dumps(tmp_path / "run"), _dumps(reference / "run"))):
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), f"{why}: rank {rank} {key} differs from the uninterrupted run"


# --- gc -----------------------------------------------------------------------------------------


# gc --keep 1 of checkpoints 1..4 (policy full: one generation each) deletes g1, g2, g3, then
# dense files 1, 2, 3; `gc:N` kills it after its N-th deletion, once its DROPPED record is
# durable. On the filesystem the next gc is killed too, while it finishes the first one's work.
# Each kill: (N, generations and dense files left behind).
GC_KILLS = {
    "filesystem": [(2, [3, 4], [1, 2, 3, 4]), (3, [4], [3, 4])],
    "kafka": [(1, [2, 3, 4], [1, 2, 3, 4])],
}


@pytest.mark.parametrize("sink", sorted(GC_KILLS))
def test_gc_killed_midway_the_next_gc_finishes_and_the_newest_checkpoint_resumes(
    tmp_path, broker, unique_name, sink, debug_config: DebugConfig, run_cli: CliRunner, capsys
):
    job = _job(unique_name("gc"), sink, broker.bootstrap if sink == "kafka" else "", policy="full", steps=40)
    spawn_ranks(debug_config.path, job, tmp_path, world_size=1, timeout_s=120)  # one rank: gc is per generation
    tool = _tool(debug_config, tmp_path, job)
    catalog, generations, dense = _state(debug_config, tmp_path, job)
    assert sorted(catalog.commits) == generations == dense == [1, 2, 3, 4]

    for n, left, dense_left in GC_KILLS[sink]:
        run_cli("trainer.ckpt_cli", *tool, "gc", "--keep", "1", env={ENV: f"gc:{n}"}, expect_rc=KILLED, timeout_s=60)
        catalog, generations, dense = _state(debug_config, tmp_path, job)
        assert (generations, dense) == (left, dense_left), f"after gc:{n}"
        assert catalog.dropped == {1, 2, 3}, f"after gc:{n}"
        assert [m.checkpoint_id for m in catalog.restorable()] == [4], "a restore must never pick a dropped chain"

    capsys.readouterr()
    assert _in_process([*tool, "gc", "--keep", "1"]) == 0
    rerun = capsys.readouterr().out
    assert "kept checkpoints [4]; dropped generations []" in rerun, rerun
    if sink == "kafka":  # the generations the killed gc recorded as dropped and left behind
        assert "finished deleting ['g2', 'g3']" in rerun, rerun
    catalog, generations, dense = _state(debug_config, tmp_path, job)
    assert generations == dense == [4] and catalog.dropped == {1, 2, 3}

    assert _in_process([*tool, "verify"]) == 0
    assert "checkpoint 4 (step 40): OK" in capsys.readouterr().out
    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest", "train.steps=50"], tmp_path, world_size=1,
                          timeout_s=120)  # fmt: skip
    assert "deltarec: resumed from checkpoint 4 at step 40" in resumed[0].stdout


# --- export -------------------------------------------------------------------------------------


def _flat(payload: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of an export file under their DCP keys (ckpt/restore/export.py's `to_dcp`)."""
    flat = dict(payload["model"])
    flat.update({f"optim.{fqn}.{k}": v for fqn, states in payload["optim"].items() for k, v in states.items()})
    flat.update({f"buffers.{fqn}": v for fqn, v in payload["buffers"].items()})
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _load_dcp(dcp_dir: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    target = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(target, checkpoint_id=str(dcp_dir), no_dist=True)
    return target


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _leftovers(where: Path) -> list[str]:
    return sorted(p.name for p in where.iterdir() if p.name.startswith("."))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in this one process
def test_export_killed_midway_then_export_again_matches_an_uninterrupted_one(
    tmp_path, unique_name, debug_config: DebugConfig, run_cli: CliRunner, replay_seed: ReplaySeed
):
    job = _job(unique_name("export"), "filesystem", steps=30)
    spawn_ranks(debug_config.path, job, tmp_path, world_size=1, timeout_s=120)
    tool = _tool(debug_config, tmp_path, job)
    ref, out = tmp_path / "ref", tmp_path / "out"
    for d in (ref, out):
        d.mkdir()
    # never interrupted: checkpoint 3 (the newest) for comparison, and checkpoint 2 where the
    # killed exports write, as the export a user already has there
    assert _in_process([*tool, "export", "--out", str(ref / "m.pt"), "--dcp", str(ref / "m.dcp")]) == 0
    assert _in_process([*tool, "export", "--checkpoint", "2", "--out", str(out / "m.pt"), "--dcp", str(out / "m.dcp")]) == 0
    want = {cid: torch.load(d / "m.pt") for cid, d in [(3, ref), (2, out)]}
    flat = {cid: _flat(p) for cid, p in want.items()}
    export = ["trainer.ckpt_cli", *tool, "export", "--out", out / "m.pt", "--dcp", out / "m.dcp"]

    # stage 1: the new file is written under its temporary name; what was there is untouched
    run_cli(*export, env={ENV: "export:1"}, expect_rc=KILLED, timeout_s=60)
    assert torch.load(out / "m.pt")["checkpoint_id"] == 2
    assert _same(_load_dcp(out / "m.dcp", flat[2]), flat[2])
    assert [n.split("-")[0] for n in _leftovers(out)] == [".m.pt.tmp"]

    # stage 3: the file is in place, the old DCP directory moved aside, the new one not yet in
    t0 = time.monotonic()
    run_cli(*export, env={ENV: "export:3"}, expect_rc=KILLED, timeout_s=60)
    seconds = time.monotonic() - t0
    assert torch.load(out / "m.pt")["checkpoint_id"] == 3 and not (out / "m.dcp").exists()
    aside = [n for n in _leftovers(out) if n.startswith(".m.dcp.old-")]
    # the new DCP directory is still under its temporary name; stage 1's leftover is gone
    assert [n.split("-")[0] for n in _leftovers(out)] == [".m.dcp.old", ".m.dcp.tmp"]
    assert _same(_load_dcp(out / aside[0], flat[2]), flat[2]), "the previous DCP export is kept aside"

    # from outside, at a random moment (checkpoint 2 again, so old and new can be told apart)
    delay = replay_seed.rng().uniform(0.0, seconds * 1.2)
    why = f"export SIGKILLed {delay:.2f} s after its start, {replay_seed}"
    print(why)
    argv = [sys.executable, "-m", "trainer.ckpt_cli", *tool, "export", "--checkpoint", "2",
            "--out", str(out / "m.pt"), "--dcp", str(out / "m.dcp")]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={k: v for k, v in os.environ.items() if k not in (ENV, *LAUNCHER_VARS)})  # fmt: skip
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
    rc = proc.wait(timeout=60)
    print(f"{why}: exit status {rc}")
    assert rc in (0, KILLED), why
    assert torch.load(out / "m.pt")["checkpoint_id"] in (2, 3), why  # a whole export, old or new
    if (out / "m.dcp").exists():
        assert any(_same(_load_dcp(out / "m.dcp", flat[c]), flat[c]) for c in (2, 3)), why
    else:
        assert any(n.startswith(".m.dcp.old-") for n in _leftovers(out)), f"{why}: the previous DCP export is lost"

    # the next export succeeds and is exactly the uninterrupted one; nothing else is left
    assert _in_process([*tool, "export", "--out", str(out / "m.pt"), "--dcp", str(out / "m.dcp")]) == 0
    got = torch.load(out / "m.pt")
    assert got["checkpoint_id"] == 3 and _same(_flat(got), flat[3]), why
    assert _same(_load_dcp(out / "m.dcp", flat[3]), flat[3]), why
    assert _leftovers(out) == [] and sorted(p.name for p in out.iterdir()) == ["m.dcp", "m.pt"], why
