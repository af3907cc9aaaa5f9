"""The quickstart: 2 CPU ranks, continuous checkpoints to the embedded broker, a crash, a
follower and a prediction server beside the job.

    python -m launch.quickstart [--verbose] [key=value ...]

Starts the embedded broker on loopback and runs configs/quickstart.yaml under `deltarec-launch`
(torchrun, `--max-restarts 1`, `ckpt.restore.resume=latest`) in the setup the README recommends:
incremental deltas, 4-bit rows, a follower compacting the chain (`deltarec-follow`), and a
server answering predictions from each checkpoint as it commits (`deltarec-serve`, probed
four times a second so each checkpoint's freshness is measured). The trainer's own fault
injection kills rank 1 once it learns checkpoint 3 committed (`DELTAREC_KILL_AT=committed:3@1`;
only the first attempt dies; set DELTAREC_KILL_AT to stage another crash), and torchrun brings
the job back from the newest COMMIT marker without a human. Then the quickstart asks the
server for a prediction, says which checkpoint answered and how fresh the served checkpoints
were, what the checkpoints weighed against full saves at the same interval, and
`deltarec-report` plots the run. `--verbose` shows every line of torchrun, the ranks and the
libraries.
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
from common.errors import DeltarecError
from common.process import run_main
from launch.beside import Beside, one_sample
from launch.broker import EmbeddedBroker
from launch.savings import full_checkpoint_bytes
from trainer.config import JobConfig, load_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "quickstart.yaml"
RUN_DIR = REPO / "runs" / "quickstart"
CRASH = "committed:3@1"
#: The setup the README recommends: incremental deltas, 4-bit rows (and a follower, started beside).
PRODUCT = [
    "ckpt.enabled=true",
    "ckpt.schedule.policy=incremental",
    "ckpt.encoding.weights=adaptive4",
    "ckpt.restore.resume=latest",
]


def restores(metrics: Path) -> list[dict]:
    """The restore records of a run's metrics.jsonl (one per resumed attempt)."""
    if not metrics.is_file():
        return []
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "restored_ckpt" in r]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def committed(metrics: Path) -> list[dict]:
    """The checkpoint_committed records of a run's metrics.jsonl, in order."""
    return [r for r in _records(metrics) if r.get("ckpt_committed")]


def summarize(beside: Beside, metrics: Path, job: JobConfig) -> None:
    """The server's answer for the newest checkpoint, its freshness, the follower's compactions,
    and the bytes written against full saves at the same interval."""
    commits = committed(metrics)
    if not commits:
        return
    answer = beside.ask(max(r["ckpt_id"] for r in commits))
    print(
        f"quickstart: the server answered {answer.score:.4f} from checkpoint {answer.checkpoint_id} (step {answer.step}); "
        f"checkpoints were served {answer.freshness_p50_s:.2f} s (p50) / {answer.freshness_p99_s:.2f} s (p99) after "
        f"their training step, over {answer.checkpoints_timed} checkpoints",
        flush=True,
    )
    compactions = [r for r in _records(RUN_DIR / "follower.jsonl") if "compacted_ckpt" in r]
    written, full = sum(r["ckpt_bytes"] for r in commits), full_checkpoint_bytes(job)
    print(
        f"quickstart: {len(commits)} checkpoints wrote {written / 1e6:,.1f} MB ({job.ckpt.schedule.policy}, "
        f"{job.ckpt.encoding.weights} rows; "
        f"the follower compacted the chain {len(compactions)} times); a full torch.save or dcp.save of the model and "
        f"its optimizer at each would have written {len(commits)} x {full / 1e6:,.1f} MB = {len(commits) * full / 1e6:,.0f} MB "
        f"({len(commits) * full / max(written, 1):,.0f}x more)",
        flush=True,
    )


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
    for log in ("metrics.jsonl", "follower.jsonl", "serve.jsonl"):
        (RUN_DIR / log).unlink(missing_ok=True)
    shutil.rmtree(RUN_DIR / "dense", ignore_errors=True)
    crash = os.environ.get(KILL_AT, CRASH)
    try:
        parse_kill_at(crash)
    except FaultSpecError as exc:
        print(f"quickstart: error: {exc}", file=sys.stderr)
        return 2
    with EmbeddedBroker(state_dir=RUN_DIR / "broker") as broker:
        print(f"quickstart: embedded broker on {broker.bootstrap}", flush=True)
        argv = [
            "--config",
            str(CONFIG),
            f"run.dir={RUN_DIR}",
            f"ckpt.sink.bootstrap_servers={broker.bootstrap}",
            *PRODUCT,
            *overrides,
        ]
        try:
            job_cfg = load_config(CONFIG, argv[2:], check_data=False)
        except DeltarecError as exc:
            print(f"quickstart: error: {exc}", file=sys.stderr)
            return 2
        beside = Beside(argv, RUN_DIR, one_sample(job_cfg))
        try:
            url = beside.wait_listening()
            print(
                f"quickstart: a follower compacts the chain (log: {_shown(RUN_DIR / 'follower.log')}) and a prediction server "
                f"on {url} applies each checkpoint as it commits (log: {_shown(RUN_DIR / 'server.log')})",
                flush=True,
            )
            print(
                f"quickstart: training {CONFIG.relative_to(REPO)} on 2 ranks under torchrun (incremental deltas, 4-bit rows); "
                f"a crash is staged ({KILL_AT}={crash}) and torchrun resumes the job",
                flush=True,
            )
            job = [
                sys.executable, "-m", "launch.torchrun", "--nproc-per-node", "2", "--max-restarts", "1",
                *(["--verbose"] if verbose else []), *argv,
            ]  # fmt: skip
            rc = run_child(job, env={**os.environ, KILL_AT: crash})
            if rc == 0:
                summarize(beside, metrics, job_cfg)
        except RuntimeError as exc:  # the follower or the server failed: their logs say why
            print(f"quickstart: {exc}", file=sys.stderr, flush=True)
            rc = rc if rc else 1
        finally:
            beside.close()
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


def _shown(path: Path) -> str:
    """`path` relative to the repository when it is inside (shorter on the console)."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


if __name__ == "__main__":
    run_main(main)
