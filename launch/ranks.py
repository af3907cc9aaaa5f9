"""The launcher of local ranks without torchrun, used by tests/ and bench/.

Each rank is a separate `python -m trainer.main` process (or another module given) started
with torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) and a
file rendezvous under the caller's directory, so the code under test or measured is exactly
what torchrun runs, without torchrun's agent in the way. Any rank failing, or the group
outliving its deadline, kills every rank and fails with each rank's stderr tail. Under the
test suite the ranks are forked warm from a process that imported torch once (launch/warm.py).

It lives in launch/ (not tests/) because bench/ spawns ranks the same way and must not import
the test suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from launch import warm

REPO = Path(__file__).resolve().parents[1]
PEER_GRACE_S = 15.0  # how long the other ranks may take to end after one failed, when failure is expected


@dataclass
class RankResult:
    """One rank's exit status (negative: killed by that signal) and its whole output."""

    rank: int
    returncode: int
    stdout: str
    stderr: str


class RankGroup:
    """Ranks started by `start_ranks`; `wait` reaps them within a deadline."""

    def __init__(self, procs: list[subprocess.Popen | warm.WarmProcess], logs: list[tuple], timeout_s: float) -> None:
        self.procs = procs
        self.logs = logs
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def wait(self, expect_ok: bool = True) -> list[RankResult]:
        """Wait for every rank; the deadline kills the rest, and so does a failing rank: at
        once when every rank should succeed, else once the others had `PEER_GRACE_S` to end on
        their own (a test expecting a failure wants each rank's own exit status)."""
        failed, failed_at = None, None
        while True:
            codes = [p.poll() for p in self.procs]  # every rank polled (any() would stop early)
            if all(code is not None for code in codes):
                break
            now = time.monotonic()
            if now > self.deadline:
                failed = f"ranks still running after {self.timeout_s:.0f}s"
                break
            if any(code not in (None, 0) for code in codes):
                failed_at = failed_at or now
                if expect_ok or now - failed_at > PEER_GRACE_S:
                    failed = "a rank failed"
                    break
            time.sleep(0.2)  # polling process exit, not synchronising ranks
        if failed:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
            for p in self.procs:
                p.wait()
        results = []
        for rank, (p, (out, err)) in enumerate(zip(self.procs, self.logs)):
            out.seek(0)
            err.seek(0)
            results.append(RankResult(rank, p.wait(), out.read(), err.read()))
            out.close()
            err.close()
        if failed and expect_ok:
            tails = "\n".join(f"--- rank {r.rank} (rc {r.returncode}) ---\n{r.stderr[-3000:]}" for r in results)
            raise AssertionError(f"{failed}\n{tails}")
        if expect_ok:
            bad = [r for r in results if r.returncode != 0]
            assert not bad, "\n".join(f"rank {r.rank} rc {r.returncode}:\n{r.stderr[-3000:]}" for r in bad)
        return results


def start_ranks(
    config: str | Path,
    overrides: Sequence[str],
    tmp_path: Path,
    world_size: int = 2,
    timeout_s: float = 240,
    module: str = "trainer.main",
    extra_args: Sequence[str] = (),
    env_extra: dict[str, str] | None = None,
) -> RankGroup:
    """Start `world_size` ranks (torchrun's variables, a file rendezvous, run dir tmp_path/run)."""
    rdzv = tmp_path / f"rdzv-{time.monotonic_ns()}"
    run_dir = tmp_path / "run"
    base = [
        sys.executable,
        "-m",
        module,
        "--config",
        str(config),
        *extra_args,
        f"sharding.init_method=file://{rdzv}",
        f"run.dir={run_dir}",
        "train.progress=log",
        *overrides,
    ]
    return start_command(base, tmp_path, world_size, timeout_s, env_extra)


def start_command(
    argv: Sequence[str],
    tmp_path: Path,
    world_size: int = 2,
    timeout_s: float = 240,
    env_extra: dict[str, str] | None = None,
) -> RankGroup:
    """Start `world_size` copies of `argv` (from the repository root) as the ranks of one job,
    with torchrun's variables; the command brings its own rendezvous (`start_ranks` gives
    deltarec's jobs a file rendezvous; an example script takes `--init-method file://...`)."""
    procs: list[subprocess.Popen | warm.WarmProcess] = []
    logs = []
    tag = time.monotonic_ns()
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
        )
        env.update(env_extra or {})
        out = open(tmp_path / f"rank{rank}-{tag}.out", "w+")
        err = open(tmp_path / f"rank{rank}-{tag}.err", "w+")
        logs.append((out, err))
        procs.append(warm.popen(argv, REPO, env, out, err))
    return RankGroup(procs, logs, timeout_s)


def spawn_ranks(
    config: str | Path,
    overrides: Sequence[str],
    tmp_path: Path,
    world_size: int = 2,
    timeout_s: float = 240,
    module: str = "trainer.main",
    extra_args: Sequence[str] = (),
    expect_ok: bool = True,
    env_extra: dict[str, str] | None = None,
) -> list[RankResult]:
    """Run `world_size` ranks to completion within `timeout_s` and return their outputs."""
    group = start_ranks(config, overrides, tmp_path, world_size, timeout_s, module, extra_args, env_extra)
    return group.wait(expect_ok)


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started that are still alive (from /proc; empty once it ended)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []
    children: list[int] = []
    for task in tasks:
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return children


def descendant_pids(pid: int) -> list[int]:
    """Every process below `pid`: what to SIGKILL, by pid, to leave nothing of a launcher behind
    (torchrun starts each rank in a session of its own, so no process group holds them all)."""
    return [d for child in child_pids(pid) for d in (child, *descendant_pids(child))]


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (a launcher and its ranks), leaving nothing behind."""
    for p in [*descendant_pids(pid), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def rank_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the trainer ranks a launcher runs now (torchrun's agent, in it or below
    it, gives each its RANK): what a test or the soak script kills from outside."""
    ranks: dict[int, int] = {}
    for pid in descendant_pids(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            ranks.setdefault(rank, pid)
    return ranks


def read_jsonl(path: Path, live: bool = False) -> list[dict]:
    """The records of a JSON-lines file, in file order.

    `live=True` reads a file a running job is still writing: a missing file is no records
    yet, and a last line without its newline is a record not yet complete, so it is left out
    rather than failing to parse.
    """
    path = Path(path)
    if live and not path.is_file():
        return []
    text = path.read_text()
    lines = text.split("\n")
    if live and lines and lines[-1]:
        lines.pop()  # unterminated: the writer has not finished this record
    return [json.loads(line) for line in lines if line.strip()]


def read_metrics(run_dir: Path) -> list[dict]:
    """The records rank 0 wrote to `run_dir`/metrics.jsonl, in order."""
    return read_jsonl(Path(run_dir) / "metrics.jsonl")
