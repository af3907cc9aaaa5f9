"""A rank that leaves while a gloo worker thread still has Python work to do (run by test_exit).

Rank 1 starts an all-reduce with a Python callback on its future and returns from `main` at
once; rank 0 joins the all-reduce `--late-s` later. Rank 1's gloo worker then completes the
collective and runs the callback, which takes the GIL. Rank 1's interpreter is meanwhile
finalizing (an object whose teardown sleeps keeps it there), unless the process left through
`run_main` (common/process.py `leave`). At exit rank 1's non-daemon thread and exit handler
append to `--log`, which shows they ran.

Usage: python -m tests.multirank.exit_worker RANK RDZV_FILE LOG {run_main,interpreter} [--late-s S]
"""

from __future__ import annotations

import argparse
import atexit
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.process import run_main


class _SlowTeardown:
    """Keeps an interpreter that tears its modules down finalizing for `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __del__(self) -> None:
        time.sleep(self.seconds)


def _append(log: Path, line: str) -> None:
    with log.open("a") as f:
        f.write(line + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("rank", type=int)
    p.add_argument("rdzv")
    p.add_argument("log", type=Path)
    p.add_argument("exit", choices=["run_main", "interpreter"])
    p.add_argument("--late-s", type=float, default=0.5)
    args = p.parse_args()
    dist.init_process_group("gloo", init_method=f"file://{args.rdzv}", rank=args.rank, world_size=2)
    t = torch.ones(1000)
    if args.rank == 0:
        time.sleep(args.late_s)
        try:
            dist.all_reduce(t)
        except RuntimeError:  # rank 1 may have left without it: its exit is what is tested
            pass
        return 0
    globals()["_teardown"] = _SlowTeardown(3 * args.late_s)
    atexit.register(_append, args.log, "exit handler ran")
    threading.Thread(target=lambda: (time.sleep(0.2), _append(args.log, "thread finished"))).start()
    dist.all_reduce(t, async_op=True).get_future().then(lambda fut: None)
    print("rank 1 returns", end="", flush=False)  # no newline, not flushed: the exit must not lose it
    return 0


if __name__ == "__main__":
    if "run_main" in sys.argv:
        run_main(main)
    raise SystemExit(main())
