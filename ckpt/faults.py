"""Crash points for tests: SIGKILL this very process at a named point of a checkpoint.

`DELTAREC_KILL_AT=point:key[@rank]` (e.g. `rows:3@1`: rank 1 dies while writing the rows
of checkpoint 3). Points: `step` (after training step `key`), `snapshot` (inside the
stall of checkpoint `key`), `rows` (in the writer, after half the frames of checkpoint
`key`), `marker` (on rank 0, after the dense file and before the COMMIT marker),
`committed` (once this rank learns checkpoint `key` committed). Only
a job's first attempt dies (torchrun's TORCHELASTIC_RESTART_COUNT is 0 or unset), so a
restarted job runs on. Unset, every call is a dictionary lookup and returns. A real SIGKILL, not an exception, so the
tests see what a crash leaves behind.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "DELTAREC_KILL_AT"
SLOW_ENV = "DELTAREC_SLOW_FLUSH"  # "checkpoint_id:seconds": that checkpoint's writer sleeps before flushing


def maybe_die(point: str, key: int, rank: int) -> None:
    spec = os.environ.get(ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    target, _, only_rank = spec.partition("@")
    name, _, value = target.partition(":")
    if name == point and int(value) == key and (not only_rank or int(only_rank) == rank):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_slow(checkpoint_id: int) -> None:
    """Hold the writer of `checkpoint_id` (tests of back-pressure: a provably busy writer)."""
    spec = os.environ.get(SLOW_ENV)
    if spec:
        cid, _, seconds = spec.partition(":")
        if int(cid) == checkpoint_id:
            time.sleep(float(seconds))
