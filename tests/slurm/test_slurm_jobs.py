"""deltarec's Slurm path on a real (one-machine) Slurm cluster: launch/slurm/deltarec.sbatch
in both forms trains the debug job with continuous checkpoints to the same parameters as a
plain torchrun run, and a job cancelled mid-run resumes from its newest checkpoint when it is
submitted again.

Each job: 2 ranks on one node (`--ntasks-per-node=2 --cpus-per-task=1`), 60 steps, a
checkpoint every 10 steps to the filesystem sink in the job's run dir under tmp_path."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from launch.ranks import REPO

if TYPE_CHECKING:
    from tests.conftest import CliRunner, DebugConfig, MetricsReader
    from tests.slurm.conftest import LocalSlurm, SlurmJob

pytestmark = pytest.mark.integration

STEPS = 60
RANKS = 2
# Every run the same thread count (torchrun's default for several ranks): bit-identical floats.
THREADS = {"OMP_NUM_THREADS": "1"}


def _job(run_dir: Path, *extra: str) -> list[str]:
    """The debug job's overrides: row-wise tables, checkpoints every 10 steps on files."""
    return [
        f"run.dir={run_dir}", f"train.steps={STEPS}", "train.save_params=true", "train.eval_batches=1",
        "sharding.default=row_wise", "ckpt.enabled=true", "ckpt.sink.kind=filesystem", "ckpt.run_id=slurm",
        "ckpt.schedule.interval_steps=10", "ckpt.sink.flush_timeout_s=20", *extra,
    ]  # fmt: skip


def _dumps(run_dir: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(run_dir / "params" / f"rank{r}.pt") for r in range(RANKS)]


def _assert_same_params(run_dir: Path, reference: list[dict[str, torch.Tensor]], what: str) -> None:
    got = _dumps(run_dir)
    for rank, (g, w) in enumerate(zip(got, reference)):
        assert g.keys() == w.keys(), f"{what}: rank {rank} dumped other parameters"
        for key in w:
            assert torch.equal(g[key], w[key]), f"{what}: rank {rank} {key} differs from the plain torchrun run"


def _python_env() -> dict[str, str]:
    """DELTAREC_PYTHON only where the template's default ($SLURM_SUBMIT_DIR/.venv) is not this venv."""
    default = REPO / ".venv" / "bin" / "python"
    return {} if default.exists() and Path(sys.prefix) == default.parent.parent else {"DELTAREC_PYTHON": sys.executable}


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory, debug_config: DebugConfig, run_cli: CliRunner):
    """The same job run by a plain torchrun (deltarec-launch, 2 ranks), no Slurm involved."""
    run_dir = tmp_path_factory.mktemp("torchrun") / "run"
    p = run_cli("launch.torchrun", "--nproc-per-node", str(RANKS), "--config", debug_config.path, *_job(run_dir),
                env=THREADS, timeout_s=180)  # fmt: skip
    assert f"deltarec: trained {STEPS} steps" in p.stdout, p.stderr[-3000:]
    return _dumps(run_dir)


def _ok(job: SlurmJob) -> str:
    """The output of a job that must have succeeded."""
    assert job.rc == 0, f"the job failed\n{job.describe()}"
    text = job.text
    assert f"deltarec: trained {STEPS} steps" in text, job.describe()
    return text


def _committed(metrics: MetricsReader, run_dir: Path, live: bool = False) -> list[tuple[int, int]]:
    """(checkpoint id, step) of every committed checkpoint, in order."""
    return [(r["ckpt_id"], r["step"]) for r in metrics(run_dir, "ckpt_id", live=live, ckpt_committed=True)]


def test_torchrun_form_trains_like_plain_torchrun(
    tmp_path, slurm: LocalSlurm, reference, debug_config: DebugConfig, metrics: MetricsReader
):
    run_dir = tmp_path / "run"
    env = {**THREADS, **_python_env()}
    job = slurm.sbatch(tmp_path, [debug_config.path, *_job(run_dir)], env=env)
    text = _ok(job)
    assert "torchrun form: 1 node(s) x 2 rank(s) (one per task)" in text, job.describe()
    # one torchrun on the node, c10d rendezvous, the job id as rendezvous id
    rendezvous = re.findall(r"^deltarec-launch: c10d rendezvous at \S+, id (\S+), 1 node\(s\) x 2 rank\(s\)$", text, re.M)
    assert rendezvous == [str(job.job_id)], job.describe()
    assert "process group: gloo, 2 ranks (torchrun)" in text, job.describe()
    assert _committed(metrics, run_dir) == [(i, 10 * i) for i in range(1, 7)], job.describe()
    _assert_same_params(run_dir, reference, "sbatch, torchrun form")


def test_srun_form_trains_like_plain_torchrun(
    tmp_path, slurm: LocalSlurm, reference, debug_config: DebugConfig, metrics: MetricsReader
):
    run_dir = tmp_path / "run"
    env = {**THREADS, **_python_env(), "DELTAREC_LAUNCH": "srun"}
    job = slurm.sbatch(tmp_path, [debug_config.path, *_job(run_dir)], env=env)
    text = _ok(job)
    assert "srun form: 1 node(s) x 2 rank(s) (one per task)" in text, job.describe()
    # one srun task per rank: deltarec found its place from SLURM_PROCID / SLURM_NTASKS
    assert "process group: gloo, 2 ranks (slurm)" in text, job.describe()
    assert _committed(metrics, run_dir) == [(i, 10 * i) for i in range(1, 7)], job.describe()
    _assert_same_params(run_dir, reference, "sbatch, srun form")


def _wait_while_running(slurm: LocalSlurm, job: SlurmJob, done, timeout_s: float, what: str) -> None:
    """Poll until `done()`; fail if the job ends first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert slurm.state(job) in ("PENDING", "CONFIGURING", "RUNNING"), f"job ended before {what}\n{job.describe()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{job.describe()}"
        time.sleep(0.3)  # polling the job's metrics file


def test_scancel_mid_run_then_resubmit_resumes_from_newest_checkpoint(
    tmp_path, slurm: LocalSlurm, reference, debug_config: DebugConfig, metrics: MetricsReader
):
    run_dir = tmp_path / "run"
    args = [debug_config.path, *_job(run_dir, "ckpt.restore.resume=latest")]  # the same command, both times
    env = {**THREADS, **_python_env()}
    # Checkpoint 3's writers hold on for 300 s: the job cannot end before the cancel, which
    # lands once checkpoints 1 and 2 are committed, however fast this machine trains.
    first = slurm.sbatch(tmp_path, args, env={**env, "DELTAREC_SLOW_FLUSH": "3:300"}, wait=False)
    _wait_while_running(slurm, first, lambda: len(_committed(metrics, run_dir, live=True)) >= 2, 120,
                        "checkpoint 2 to commit")  # fmt: skip
    assert slurm.state(first) == "RUNNING", first.describe()
    slurm.run("scancel", str(first.job_id))
    slurm.wait_gone(first)
    text = first.text
    assert "CANCELLED" in text and "deltarec: trained" not in text, first.describe()
    committed = _committed(metrics, run_dir)
    assert committed == [(1, 10), (2, 20)], f"{committed}\n{first.describe()}"

    again = slurm.sbatch(tmp_path, args, env=env)
    text = _ok(again)
    newest, step = committed[-1]
    assert f"deltarec: resumed from checkpoint {newest} at step {step}" in text, again.describe()
    _assert_same_params(run_dir, reference, "cancelled and resubmitted")


# --- the allocation rule, without a cluster ---------------------------------------------------

FAKE_SCONTROL = """#!/bin/sh
if [ "$2" = hostnames ]; then echo node1; echo node2; exit 0; fi
printf 'NodeName=%s Arch=x86_64 CoresPerSocket=8\\n   NodeAddr=10.1.2.3 NodeHostName=%s\\n' "$3" "$3"
"""
FAKE_SRUN = """#!/bin/sh
echo "srun $* MASTER_ADDR=${MASTER_ADDR:-unset} OMP_NUM_THREADS=$OMP_NUM_THREADS"
"""
TEMPLATE_KNOBS = ("NPROC_PER_NODE", "GPUS_PER_NODE", "CPUS_PER_RANK", "OMP_NUM_THREADS", "MASTER_ADDR", "HEAD_NODE",
                  "RDZV_PORT", "DELTAREC_LAUNCH", "DELTAREC_PYTHON", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")  # fmt: skip
JOB_ENV = {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2"}
# (case, the job's Slurm variables (and overrides), ranks per node, CPUs per rank, CPUs per node)
ALLOCATIONS = [
    ("gpus-on-node", {"SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_CPUS_PER_NODE": "64(x2)", "SLURM_TASKS_PER_NODE": "1(x2)"},
     8, 8, 64),
    ("gpus-per-node-typed", {"SLURM_GPUS_PER_NODE": "a100:4", "SLURM_JOB_CPUS_PER_NODE": "32,16",
                             "SLURM_TASKS_PER_NODE": "1(x2)"}, 4, 4, 16),
    ("cpu-tasks", {"SLURM_GPUS_PER_NODE": "0", "SLURM_JOB_CPUS_PER_NODE": "4(x2)", "SLURM_TASKS_PER_NODE": "2(x2)"},
     2, 2, 4),
    ("former-override", {"GPUS_PER_NODE": "2", "SLURM_GPUS_PER_NODE": "0", "SLURM_JOB_CPUS_PER_NODE": "2(x2)",
                         "SLURM_TASKS_PER_NODE": "1(x2)"}, 2, 1, 2),
    ("override-cpus", {"NPROC_PER_NODE": "3", "CPUS_PER_RANK": "5", "SLURM_JOB_CPUS_PER_NODE": "16(x2)",
                       "SLURM_TASKS_PER_NODE": "1(x2)"}, 3, 5, 16),
    ("more-ranks-than-cpus", {"NPROC_PER_NODE": "4", "SLURM_JOB_CPUS_PER_NODE": "2(x2)",
                              "SLURM_TASKS_PER_NODE": "1(x2)"}, 4, 1, 2),
]  # fmt: skip


@pytest.mark.parametrize("case, slurm_env, ranks, cpus_per_rank, node_cpus", ALLOCATIONS,
                         ids=[a[0] for a in ALLOCATIONS])  # fmt: skip
@pytest.mark.parametrize("form", ["torchrun", "srun"])
def test_template_takes_ranks_and_cpus_from_the_allocation(tmp_path, form, case, slurm_env, ranks, cpus_per_rank, node_cpus):
    """Both forms of the template against stub srun/scontrol on two nodes: GPUs, else tasks,
    decide the ranks per node; the node's CPUs are split between them; overrides win."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k not in TEMPLATE_KNOBS}  # fmt: skip
    env.update(JOB_ENV, **slurm_env, PATH=f"{bin_dir}:{env['PATH']}", DELTAREC_LAUNCH=form,
               DELTAREC_PYTHON=sys.executable, SLURM_SUBMIT_DIR=str(tmp_path))  # fmt: skip
    p = subprocess.run(["bash", str(REPO / "launch" / "slurm" / "deltarec.sbatch"), "configs/debug_cpu.yaml", "a=1"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert p.returncode == 0, p.stderr
    (srun,) = [line for line in p.stdout.splitlines() if line.startswith("srun ")]
    assert "--config configs/debug_cpu.yaml a=1" in srun and f"OMP_NUM_THREADS={cpus_per_rank}" in srun
    if form == "torchrun":
        assert "--nodes=2 --ntasks=2 --ntasks-per-node=1" in srun and f"--cpus-per-task={node_cpus} " in srun, srun
        assert f"-m launch.torchrun --nnodes=2 --nproc-per-node={ranks} " in srun, srun
        assert f"--rdzv-endpoint=10.1.2.3:{29500 + 1234 % 1000} --rdzv-id=1234" in srun, srun
    else:
        assert f"--ntasks={2 * ranks} --ntasks-per-node={ranks} --cpus-per-task={cpus_per_rank} " in srun, srun
        assert "-m trainer.main --config" in srun and "MASTER_ADDR=10.1.2.3" in srun, srun
        assert ("--overcommit" in srun) == (ranks * cpus_per_rank > node_cpus), srun
