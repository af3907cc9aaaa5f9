"""Partial recovery (`ckpt.recovery.mode: partial`, CPR) with real ranks: a rank SIGKILLed from
outside under torchrun, a survivor SIGKILLed while it saves its snapshot, and a restart
with no usable survivor snapshot, which must be bit-exact full recovery."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from ckpt.log.backend import Backend, open_backend
from ckpt.log.catalog import Catalog
from ckpt.log.markers import SurvivorRecord
from ckpt.restore.replay import decode_rows, iter_link_frames
from ckpt.stream.filesystem import FsMarkers
from launch.ranks import REPO, rank_pids, read_jsonl, spawn_ranks, start_ranks
from trainer.ckpt_cli import load_job_ckpt_config

if TYPE_CHECKING:
    from tests.conftest import DebugConfig

pytestmark = pytest.mark.integration


def _job(run_id: str, *extra: str) -> list[str]:
    return [
        f"ckpt.run_id={run_id}",
        "ckpt.enabled=true",
        "ckpt.sink.kind=filesystem",
        "ckpt.schedule.interval_steps=10",
        "ckpt.recovery.mode=partial",
        "sharding.default=row_wise",
        "train.eval_batches=1",
        *extra,
    ]


def _catalog(run_dir: Path, run_id: str) -> Catalog:
    return Catalog(run_id).feed(FsMarkers(run_dir / "stream", run_id).read_markers())


def _wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Poll `predicate`; fail after `timeout_s`, or as soon as `proc` ends, with `log`'s tail."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        tail = log.read_text()[-3000:] if log is not None else ""
        assert proc is None or proc.poll() is None, f"{what}: the process ended first (rc {proc.returncode})\n{tail}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{tail}"
        time.sleep(0.1)  # polling a running job's files


def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every rank's parameter dump (trainer/param_dump.py), keys prefixed with the rank."""
    return {f"rank{r}/{k}": v for r in range(2) for k, v in torch.load(run_dir / "params" / f"rank{r}.pt").items()}


def _survivor_rows(backend: Backend, run_id: str, record: SurvivorRecord) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
    """(table, global row) -> {"weight": row, <optimizer state>: value} as the survivor saved them."""
    out: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for frame in iter_link_frames(record.link, backend.source, run_id, backend.locate):
        weights, optim = decode_rows(frame)
        ids = frame.row_ids if frame.first_row is None else torch.arange(frame.first_row, frame.first_row + frame.row_count)
        for i, row in enumerate(ids.tolist()):
            out[(frame.table, row)] = {"weight": weights[i], **{k: v[i].reshape(-1) for k, v in optim.items()}}
    return out


@pytest.mark.parametrize(("sink", "workers"), [("filesystem", 1), ("kafka", 0)])
def test_a_rank_killed_under_torchrun_rolls_back_alone_and_the_survivor_keeps_its_rows(
    tmp_path, unique_name, debug_config: DebugConfig, sink: str, workers: int, request
):
    """torchrun's SIGTERM reaches the survivor's whole process group, its loader worker too
    (`workers`=1): the survivor still finishes its step and saves."""
    run_id, run_dir = unique_name("partial"), tmp_path / "run"
    where = [f"ckpt.sink.kind={sink}", f"data.workers={workers}"]
    if sink == "kafka":
        where.append(f"ckpt.sink.bootstrap_servers={request.getfixturevalue('broker').bootstrap}")
    job = lambda *extra: _job(run_id, *where, *extra)  # noqa: E731
    cfg = load_job_ckpt_config(debug_config.path, [f"run.dir={run_dir}", *job()])
    backend = open_backend(cfg.run_id, cfg.sink, 2)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "launch.torchrun", "--nproc-per-node", "2", "--config", debug_config.path,
         f"run.dir={run_dir}", *job("train.steps=100000", "train.log_every=1000")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        committed = lambda: sum(1 for r in read_jsonl(run_dir / "metrics.jsonl", live=True) if r.get("ckpt_committed"))  # noqa: E731
        _wait_for(lambda: committed() >= 2, 180, "two committed checkpoints")
        os.kill(rank_pids(launcher.pid)[1], signal.SIGKILL)  # from outside; torchrun then SIGTERMs rank 0
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0, err[-3000:]
    assert "deltarec-train: rank 0 saved its survivor snapshot" in err, err[-3000:]
    catalog = Catalog(run_id).feed(backend.markers.read_markers())
    survivors = catalog.survivors[catalog.trainer_attempts[-1].attempt]
    assert set(survivors) == {0}, survivors
    record = survivors[0]
    # the newest checkpoint: the survivor's base, or a later one of the same attempt whose
    # outcome rank 0 had not learnt yet (its rows since the base include those since it)
    base = catalog.commits[max(catalog.commits)]
    assert record.base <= base.checkpoint_id and record.step >= base.step and record.link.rows > 0

    # Restart at the survivor's step without training: the dump is what the restore made.
    resumed = spawn_ranks(
        debug_config.path,
        job("ckpt.restore.resume=latest", f"train.steps={record.step}", "ckpt.schedule.final=false", "train.save_params=true"),
        tmp_path,
    )
    out = resumed[0].stdout
    assert f"resumed from checkpoint {base.checkpoint_id} at step {base.step}" in out, out
    assert f"partial recovery: ranks [0] of 2 kept step {record.step}, rank(s) [1] rolled back" in out, out
    assert f"deltarec: trained {record.step} steps" in out, out  # training goes on from the survivor's step
    partial = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("partial_restore")]
    assert partial[-1]["step"] == record.step and partial[-1]["partial_rolled_back_ranks"] == [1]
    assert partial[-1]["partial_lost_samples"] == pytest.approx(
        (record.step - base.step) * 2 * 256 * partial[-1]["partial_rolled_back_fraction"]
    )
    restored = _params(run_dir)
    (run_dir / "params").rename(tmp_path / "params-partial")

    # The checkpoint itself, restored the full way, for the rows that must equal it.
    spawn_ranks(debug_config.path, job(f"ckpt.restore.resume={base.checkpoint_id}", "ckpt.recovery.mode=full",
                                       f"train.steps={base.step}", "ckpt.schedule.final=false", "train.save_params=true"),
                tmp_path)  # fmt: skip
    at_base = _params(run_dir)
    saved = _survivor_rows(backend, run_id, record)
    backend.close()
    differs = 0
    for key, value in restored.items():
        if key.split("/")[1] != "emb":
            continue
        rank, _, table, row0, _col, name = key.split("/")
        if rank == "rank1":  # the dead rank's shards: exactly the checkpoint
            assert torch.equal(value, at_base[key]), key
            continue
        row0 = int(row0[1:])
        for local in range(value.shape[0]):
            got = value[local].reshape(-1)
            if (table, row0 + local) in saved:  # the survivor's rows: exactly what it saved
                want = saved[(table, row0 + local)][name].reshape(-1)
                differs += not torch.equal(want, at_base[key][local].reshape(-1))
            else:
                want = at_base[key][local].reshape(-1)
            assert torch.equal(got, want), (key, local)
    if record.step > base.step:  # trained past the checkpoint: keeping the survivor's rows is visible
        assert differs > 0


def test_a_survivor_killed_while_saving_is_ignored_and_recovery_is_bit_exact(tmp_path, unique_name, debug_config: DebugConfig):
    steps = "train.steps=80"
    (tmp_path / "reference").mkdir()
    spawn_ranks(debug_config.path, [*_job(unique_name("reference"), steps, "train.save_params=true")],
                tmp_path / "reference")  # fmt: skip
    run_id, run_dir, hold = unique_name("partial"), tmp_path / "run", tmp_path / "hold"
    hold.touch()
    group = start_ranks(
        debug_config.path,
        _job(run_id, steps),
        tmp_path,
        env_extra={
            # rank 1 dies once it learns checkpoint 1 committed (a step fixed in advance could come
            # before any commit on a loaded machine: writers run at low priority); rank 0 survives it ...
            "DELTAREC_KILL_AT": "committed:1@1",
            "DELTAREC_HOLD_AT": f"survivor:*={hold}",  # ... and holds with its frames and dense file durable
        },
    )
    err0 = Path(group.logs[0][1].name)
    _wait_for(lambda: "holding at survivor:" in err0.read_text(), 120, "rank 0 saving its survivor snapshot",
              group.procs[0], err0)  # fmt: skip
    os.kill(group.procs[0].pid, signal.SIGKILL)  # from outside, before its SURVIVOR record
    group.wait(expect_ok=False)
    held = re.search(r"holding at survivor:(\d+)", err0.read_text())
    assert held is not None
    assert (run_dir / "dense" / f"survivor-{int(held[1]):08d}-r0.pt").is_file()  # it had written all but the record
    assert not any(_catalog(run_dir, run_id).survivors.values())

    resumed = spawn_ranks(debug_config.path, [*_job(run_id, steps, "ckpt.restore.resume=latest", "train.save_params=true")],
                          tmp_path)  # fmt: skip
    assert "deltarec: resumed from checkpoint" in resumed[0].stdout, resumed[0].stdout
    assert "partial recovery" not in resumed[0].stdout  # nothing usable: every rank rolled back
    want = _params(tmp_path / "reference" / "run")
    got = _params(run_dir)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key


def test_a_pls_target_sets_the_checkpoint_interval(tmp_path, unique_name, debug_config: DebugConfig):
    # row_wise over 2 ranks: each holds half the embedding parameters, so 2 * 0.01 * 30 s / 0.5 = 1.2 s
    job = _job(unique_name("pls"), "ckpt.schedule.interval_steps=0", "ckpt.recovery.target_pls=0.01", "ckpt.recovery.mtbf_s=30")
    results = spawn_ranks(debug_config.path, [*job, "train.steps=30"], tmp_path)
    assert "checkpoint interval 1.2 s for PLS 0.01: mean time between failures 30 s (ckpt.recovery.mtbf_s)" in results[0].stderr


@pytest.mark.parametrize("mode", ["mfu", "ssu"])
def test_prioritized_checkpoints_stay_within_their_budget_and_count_what_they_left_out(
    tmp_path, unique_name, debug_config: DebugConfig, mode: str
):
    job = _job(
        unique_name(mode),
        "ckpt.schedule.policy=incremental",
        f"ckpt.recovery.priority={mode}",
        "ckpt.recovery.priority_full_every=4",
        "ckpt.recovery.priority_budget=0.1",
    )
    # checkpoints at 10 (full), 20, 30, 40, 50 (full), 60, 70, 80, 90 (full), ...; rank 1 dies as
    # soon as it learns checkpoint 6 committed (a loaded machine's writers can lag 15 steps, so a
    # step number would not say which is newest). By then 7 or 8 may have committed too: all
    # three are prioritized deltas
    group = start_ranks(debug_config.path, [*job, "train.steps=120"], tmp_path,
                        env_extra={"DELTAREC_KILL_AT": "committed:6@1"})  # fmt: skip
    assert [r.returncode for r in group.wait(expect_ok=False)][1] == -signal.SIGKILL
    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest", "train.steps=130"], tmp_path)
    assert "deltarec: trained 130 steps" in resumed[0].stdout, resumed[0].stdout
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    restore = next(i for i, r in enumerate(records) if "restored_ckpt" in r)
    assert records[restore]["restored_ckpt"] in (6, 7, 8)
    before = [r for r in records[:restore] if r.get("ckpt_committed")]
    after = [r for r in records[restore:] if r.get("ckpt_committed")]
    assert all(r["ckpt_full"] == ((r["ckpt_id"] - 1) % 4 == 0) for r in before), before  # every 4th is full
    assert [r["ckpt_full"] for r in after] == [i % 4 == 0 for i in range(len(after))], after  # a new base, then 3 deltas
    ckpts = before + after
    # a full snapshot of a rank: 1532 rows (row_wise over 2 ranks) x 76 bytes; 10% of it per rank
    budget_rows = 2 * int(0.1 * 1532 * 76) // 76
    assert all(0 < r["ckpt_rows"] <= budget_rows for r in ckpts if not r["ckpt_full"]), ckpts
    partial = next(r for r in records if r.get("partial_restore"))
    assert partial["partial_waiting_lost"] > 0  # rows the chain left waiting on rank 1 count as lost
    assert partial["partial_lost_samples"] == pytest.approx(
        partial["partial_samples_since_ckpt"] * partial["partial_rolled_back_fraction"] + partial["partial_waiting_lost"]
    )
