"""The quickstart: 2 CPU ranks, continuous checkpoints to the embedded broker, a crash.

    python -m launch.quickstart [--verbose] [key=value ...]

Starts the embedded broker on loopback and runs configs/quickstart.yaml under `deltarec-launch`
(torchrun, `--max-restarts 1`, `ckpt.resume=latest`). The trainer's own fault injection kills
rank 1 once it learns checkpoint 3 committed (`DELTAREC_KILL_AT=committed:3@1`; only the first
attempt dies; set DELTAREC_KILL_AT to stage another crash), and torchrun brings the job back
from the newest COMMIT marker without a human. Then `deltarec-report` plots the run and the
quickstart prints where. `--verbose` shows every line of torchrun, the ranks and the libraries.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from ckpt.faults import ENV as KILL_AT
from ckpt.faults import FaultSpecError, parse_kill_at
from launch.broker import EmbeddedBroker

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "quickstart.yaml"
RUN_DIR = REPO / "runs" / "quickstart"
CRASH = "committed:3@1"


def restores(metrics: Path) -> list[dict]:
    """The restore records of a run's metrics.jsonl (one per resumed attempt)."""
    if not metrics.is_file():
        return []
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "restored_ckpt" in r]


def run_child(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Run `cmd` on this terminal; SIGTERM to the quickstart is passed on to it, Ctrl-C
    reaches it from the terminal. Its exit status (130 when interrupted)."""
    child = subprocess.Popen(cmd, cwd=REPO, env=env)

    def forward(signum: int, _frame: FrameType | None) -> None:
        child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:  # the child got the same SIGINT: let it stop its ranks
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Broker, crashed-and-resumed job, report; the first non-zero exit status of the three."""
    args = list(sys.argv[1:] if argv is None else argv)
    verbose = "--verbose" in args
    overrides = [a for a in args if a != "--verbose"]
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    metrics = RUN_DIR / "metrics.jsonl"
    # The demo starts over every time: its broker keeps the stream in memory, so the previous
    # run's records and dense files describe checkpoints no stream holds any more (a job would
    # rightly refuse to resume over them, docs/reliability.md).
    metrics.unlink(missing_ok=True)
    shutil.rmtree(RUN_DIR / "dense", ignore_errors=True)
    crash = os.environ.get(KILL_AT, CRASH)
    try:
        parse_kill_at(crash)
    except FaultSpecError as exc:
        print(f"quickstart: error: {exc}", file=sys.stderr)
        return 2
    with EmbeddedBroker(state_dir=RUN_DIR / "broker") as broker:
        print(f"quickstart: embedded broker on {broker.bootstrap}", flush=True)
        print(
            f"quickstart: training {CONFIG.relative_to(REPO)} on 2 ranks under torchrun; a crash is staged "
            f"({KILL_AT}={crash}) and torchrun resumes the job",
            flush=True,
        )
        job = [
            sys.executable, "-m", "launch.torchrun", "--nproc-per-node", "2", "--max-restarts", "1",
            *(["--verbose"] if verbose else []),
            "--config", str(CONFIG), f"run.dir={RUN_DIR}", "ckpt.enabled=true",
            f"ckpt.bootstrap_servers={broker.bootstrap}", "ckpt.resume=latest", *overrides,
        ]  # fmt: skip
        rc = run_child(job, env={**os.environ, KILL_AT: crash})
    if rc != 0:
        if rc <= 128:  # above: stopped by a signal, which the launcher has said
            print(f"quickstart: training failed (exit {rc})", file=sys.stderr, flush=True)
        return rc
    if not restores(metrics):
        print(f"quickstart: the job finished before {KILL_AT}={crash} could crash it: nothing to resume", flush=True)
    rc = run_child([sys.executable, "-m", "trainer.report", "--config", str(CONFIG), f"run.dir={RUN_DIR}", *overrides])
    if rc != 0:
        print(f"quickstart: the report failed (exit {rc}); metrics in {metrics}", file=sys.stderr, flush=True)
        return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
