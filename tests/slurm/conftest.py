"""Fixtures for tests on a real Slurm cluster: the one-machine cluster of
launch/slurm/local_cluster.sh, started once per session.

Where it cannot run (not root, or Slurm missing and no apt-get to install it) the tests are
skipped with the reason. A cluster that was already up is left up at the end; one the
session started is stopped. Every job a test submits is cancelled when the test ends.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from launch.ranks import REPO
from tests.conftest import LAUNCHER_VARS

LOCAL_CLUSTER = REPO / "launch" / "slurm" / "local_cluster.sh"
TEMPLATE = REPO / "launch" / "slurm" / "deltarec.sbatch"
START_TIMEOUT_S = 480  # a first start installs slurm-wlm and munge with apt-get
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "STOPPED"}


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError as e:
        return f"(no output file: {e})"


@dataclass
class SlurmJob:
    """One batch job: its id, sbatch's exit status (the job's with --wait) and output file."""

    name: str
    job_id: int | None
    rc: int | None
    output: Path
    sbatch_out: str

    @property
    def text(self) -> str:
        """The job's output file (stdout and stderr of the script and its steps)."""
        return self.output.read_text(errors="replace") if self.output.is_file() else ""

    def describe(self) -> str:
        head = f"job {self.job_id} ({self.name}), sbatch rc {self.rc}"
        if self.sbatch_out.strip():
            head += f"\n--- sbatch ---\n{self.sbatch_out.strip()[-1500:]}"
        return f"{head}\n--- {self.output} (tail) ---\n{_tail(self.output)}"


@dataclass
class LocalSlurm:
    """The local cluster's client side: the environment for its commands, and helpers."""

    env: dict[str, str]
    started_here: bool
    jobs: list[SlurmJob] = field(default_factory=list)

    def run(self, *argv: str, timeout_s: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        try:
            p = subprocess.run(argv, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{' '.join(argv)} did not finish within {timeout_s:.0f}s", pytrace=False)
        if check and p.returncode != 0:
            pytest.fail(f"{' '.join(argv)} exited {p.returncode}:\n{p.stdout}{p.stderr}", pytrace=False)
        return p

    def sbatch(
        self,
        tmp_path: Path,
        args: Sequence[str],
        *,
        options: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        wait: bool = True,
        timeout_s: float = 180,
    ) -> SlurmJob:
        """Submit launch/slurm/deltarec.sbatch with `args` (config and overrides) from the repo
        root: one node, two tasks of one CPU, output in tmp_path. `wait`: until it ends
        (sbatch --wait; `timeout_s` bounds it), else return once it is queued."""
        name = f"deltarec-test-{uuid.uuid4().hex[:8]}"
        output = tmp_path / f"{name}.out"
        argv = [
            "sbatch", "--parsable", f"--job-name={name}", f"--chdir={REPO}", f"--output={output}",
            "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=5",
            *(["--wait"] if wait else []), *options, str(TEMPLATE), *map(str, args),
        ]  # fmt: skip
        job = SlurmJob(name, None, None, output, "")
        self.jobs.append(job)
        full_env = {**self.env, "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            p = subprocess.run(argv, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            job.job_id = _job_id(out)
            pytest.fail(f"sbatch --wait did not return within {timeout_s:.0f}s\n{job.describe()}", pytrace=False)
        job.rc, job.sbatch_out = p.returncode, p.stdout + p.stderr
        job.job_id = _job_id(p.stdout)
        if job.job_id is None:
            pytest.fail(f"sbatch submitted nothing (rc {p.returncode}):\n{job.sbatch_out}", pytrace=False)
        return job

    def state(self, job: SlurmJob) -> str | None:
        """The job's state in squeue, None once Slurm no longer lists it."""
        p = self.run("squeue", "-h", "-j", str(job.job_id), "-o", "%T", check=False)
        state = p.stdout.strip()
        return state or None if p.returncode == 0 else None

    def wait_gone(self, job: SlurmJob, timeout_s: float = 60) -> None:
        """Wait until the job is no longer active (finished, cancelled or forgotten)."""
        deadline = time.monotonic() + timeout_s
        while (state := self.state(job)) in ACTIVE:
            if time.monotonic() > deadline:
                pytest.fail(f"job still {state} after {timeout_s:.0f}s\n{job.describe()}", pytrace=False)
            time.sleep(0.5)  # polling squeue

    def cancel_leftovers(self) -> None:
        """Cancel every job of this test still queued or running (a failed or hung test)."""
        for job in self.jobs:
            self.run("scancel", f"--name={job.name}", check=False)
        for job in self.jobs:
            if job.job_id is not None:
                self.wait_gone(job, timeout_s=30)
        self.jobs.clear()


def _job_id(sbatch_stdout: str) -> int | None:
    m = re.search(r"^(\d+)", sbatch_stdout.strip())
    return int(m[1]) if m else None


def _client_env(conf: str) -> dict[str, str]:
    """This process's environment for Slurm's commands: this cluster's SLURM_CONF; no
    launcher identity and no Slurm or sbatch/srun settings of an allocation the tests run in."""
    env = {
        k: v for k, v in os.environ.items()
        if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))
    }  # fmt: skip
    env["SLURM_CONF"] = conf
    return env


def _script(command: str, timeout_s: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["bash", str(LOCAL_CLUSTER), command], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout_s)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"local_cluster.sh {command} did not finish within {timeout_s:.0f}s:\n{e.stdout}{e.stderr}",
                    pytrace=False)  # fmt: skip


@pytest.fixture(scope="session")
def slurm_cluster() -> LocalSlurm:
    """The local Slurm cluster, up (started and, the first time, installed by this fixture)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the local Slurm cluster runs on Linux only")
    if shutil.which("bash") is None:
        pytest.skip("launch/slurm/local_cluster.sh needs bash")
    installed = shutil.which("slurmctld") is not None and shutil.which("sbatch") is not None
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (to install slurm-wlm and to run slurmd); not root")
    if not installed and shutil.which("apt-get") is None:
        pytest.skip("Slurm is not installed and there is no apt-get to install slurm-wlm and munge")
    was_up = _script("status", 30).returncode == 0
    started = _script("start", START_TIMEOUT_S)
    if started.returncode != 0:
        if shutil.which("slurmctld") is None:  # apt-get could not install it (no network, no package)
            pytest.skip(f"could not install slurm-wlm: {(started.stdout + started.stderr).strip()[-500:]}")
        pytest.fail(f"local_cluster.sh start failed:\n{started.stdout}{started.stderr}", pytrace=False)
    m = re.search(r"^export SLURM_CONF=(\S+)$", started.stdout, re.M)
    assert m, f"local_cluster.sh start printed no SLURM_CONF line:\n{started.stdout}"
    cluster = LocalSlurm(_client_env(m[1]), started_here=not was_up)
    try:
        yield cluster
    finally:
        if cluster.started_here:
            stopped = _script("stop", 60)
            assert stopped.returncode == 0, f"local_cluster.sh stop failed:\n{stopped.stdout}{stopped.stderr}"


@pytest.fixture
def slurm(slurm_cluster: LocalSlurm) -> LocalSlurm:
    """The local cluster for one test; jobs the test leaves queued or running are cancelled."""
    try:
        yield slurm_cluster
    finally:
        slurm_cluster.cancel_leftovers()
