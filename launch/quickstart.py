"""The quickstart: 2 CPU ranks, continuous checkpoints to the embedded broker, a crash.

    python -m launch.quickstart [key=value ...]

Starts the embedded broker on loopback, runs configs/quickstart.yaml under torchrun with
`--max-restarts 1` and `ckpt.resume=latest`, SIGKILLs rank 1 once a few checkpoints have
committed, and lets torchrun bring the job back from the newest COMMIT marker without a
human. The trainer prints what it restored and the checkpoints' bytes and stall.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from launch.broker import EmbeddedBroker

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "quickstart.yaml"
RUN_DIR = REPO / "runs" / "quickstart"


def find_rank(parent: int, rank: int) -> int | None:
    """The pid of the trainer process with RANK=`rank` among `parent`'s children."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != parent or b"trainer.main" not in (entry / "cmdline").read_bytes():
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


def committed_checkpoints(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("ckpt_committed")]


def main(argv: Sequence[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    metrics = RUN_DIR / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # this run's records only: the broker starts empty too
    with EmbeddedBroker(state_dir=RUN_DIR / "broker") as broker:
        print(f"quickstart: embedded broker on {broker.bootstrap}", flush=True)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
            "-m", "trainer.main", "--config", str(CONFIG), f"run.dir={RUN_DIR}", "ckpt.enabled=true",
            f"ckpt.bootstrap_servers={broker.bootstrap}", "ckpt.resume=latest", *overrides,
        ]
        job = subprocess.Popen(cmd, cwd=REPO)
        killed = False
        while job.poll() is None:
            time.sleep(0.5)  # watching the job's progress, not synchronising with it
            if not killed and len(committed_checkpoints(metrics)) >= 3:
                pid = find_rank(job.pid, 1)
                if pid is not None:
                    step = committed_checkpoints(metrics)[-1]["step"]
                    print(f"quickstart: SIGKILL rank 1 (pid {pid}) after checkpoint at step {step}", flush=True)
                    os.kill(pid, signal.SIGKILL)
                    killed = True
        if job.returncode != 0:
            print(f"quickstart: training failed (exit {job.returncode})", file=sys.stderr)
            return job.returncode
        if not killed:
            print("quickstart: the job finished before a crash could be staged", file=sys.stderr)
    print(f"quickstart: done; metrics in {metrics}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
