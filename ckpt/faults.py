"""Crash points for tests and the quickstart: SIGKILL this very process at a named point.

`DELTAREC_KILL_AT=point:key[@rank]` (e.g. `rows:3@1`: rank 1 dies while writing the rows
of checkpoint 3; `*` as the key: the first time any key gets there). Points of a training
job: `step` (after training step `key`), `snapshot` (once checkpoint `key`'s rows are
copied to host memory, in the stall or beside the next step, before the writer has them),
`rows` (in the writer, after half the frames of checkpoint `key`), `marker` (on rank 0,
after the dense file and before the COMMIT marker),
`committed` (once this rank learns checkpoint `key` committed), `restore` (while this rank
restores checkpoint `key`: its first frame is written into the live shards, the rest of the
chain and the dense state are not). Points of the `deltarec-ckpt` tools, whose process is
rank 0: `gc` (after `key` deletions, generations first and then dense files; 0: once gc's
DROPPED record is durable, before it deletes anything), `export` (at stage `key` of writing
an export, also a follower's serving snapshot: 1 the `torch.save` file is written under its
temporary name, 2 the DCP directory too, 3 the file is in place and the old DCP directory
moved aside, the new one not yet in place). `survivor` (a surviving rank under
`ckpt.recovery.mode: partial`, once its snapshot's frames and dense file are durable and before
its SURVIVOR record; `key` is the snapshot's checkpoint id). Only a job's first attempt dies (torchrun's
TORCHELASTIC_RESTART_COUNT is 0 or unset), so a restarted job runs on. Unset, every call is a
dictionary lookup and returns. A real SIGKILL, not an exception, so the tests see what a crash
leaves behind.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import signal
import sys
import time
from typing import NamedTuple

from common.errors import DeltarecError

ENV = "DELTAREC_KILL_AT"
SLOW_ENV = "DELTAREC_SLOW_FLUSH"  # "checkpoint_id:seconds": that checkpoint's writer sleeps before flushing
# "checkpoint_id:seconds[:rows|:read]" (* for every checkpoint; several separated by commas): the copy
# of that checkpoint starts late, or with ":rows" its copy of the rows does, after the tracker's
# marks (tests that the next step waits for a copy running beside it, ckpt/capture/overlapped_copy.py);
# with ":read", under copy-on-write, the writer's read of the rows from the live shards starts late
# (tests that the steps meanwhile save aside the rows they update, ckpt/capture/copy_on_write.py)
SLOW_COPY_ENV = "DELTAREC_SLOW_COPY"
# "checkpoint_id:ERRNO" (e.g. "3:ENOSPC"): writing that checkpoint's dense file fails with that OSError
DENSE_ERROR_ENV = "DELTAREC_DENSE_ERROR"
# "checkpoint_id:seconds": a rank restoring that checkpoint holds where the `restore` point
# would kill it, and says so on stderr (a test then SIGKILLs it from outside)
SLOW_RESTORE_ENV = "DELTAREC_SLOW_RESTORE"
# "point:key=PATH" (a crash point's name and number, or * for any): the process holds there,
# saying so on stderr, for as long as the file PATH exists (a test of two writers at once lets
# the other go, then deletes it)
HOLD_ENV = "DELTAREC_HOLD_AT"
POINTS = ("step", "snapshot", "rows", "marker", "committed", "restore", "gc", "export", "survivor", "gc_read")


class FaultSpecError(DeltarecError):
    """DELTAREC_KILL_AT does not name a crash point."""


class KillAt(NamedTuple):
    """Where to die: at `point` number `key` (None: any), on `rank` (None: every rank that gets there)."""

    point: str
    key: int | None
    rank: int | None

    def matches(self, point: str, key: int) -> bool:
        return self.point == point and self.key in (None, key)


@functools.lru_cache(maxsize=4)
def parse_kill_at(spec: str) -> KillAt:
    """`committed:3@1` -> KillAt("committed", 3, 1), `survivor:*` -> KillAt("survivor", None, None);
    anything else is a `FaultSpecError`."""
    m = re.fullmatch(r"(\w+):(\d+|\*)(?:@(\d+))?", spec.strip())
    if m is None or m[1] not in POINTS:
        raise FaultSpecError(
            f"{ENV}={spec!r}: expected point:key[@rank] with point one of {', '.join(POINTS)} and key a number or *"
        )
    return KillAt(m[1], None if m[2] == "*" else int(m[2]), int(m[3]) if m[3] is not None else None)


def maybe_die(point: str, key: int, rank: int) -> None:
    """SIGKILL this process if DELTAREC_KILL_AT names `point` number `key` on `rank` and
    this is the job's first attempt."""
    spec = os.environ.get(ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    target = parse_kill_at(spec)
    if target.matches(point, key) and target.rank in (None, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_slow(checkpoint_id: int) -> None:
    """Hold the writer of `checkpoint_id` (tests of back-pressure: a provably busy writer)."""
    spec = os.environ.get(SLOW_ENV)
    if spec:
        cid, _, seconds = spec.partition(":")
        if int(cid) == checkpoint_id:
            time.sleep(float(seconds))


def maybe_slow_copy(checkpoint_id: int, part: str) -> None:
    """Delay a part ("start", "rows" or "read") of the copy of checkpoint `checkpoint_id` as
    DELTAREC_SLOW_COPY says."""
    for entry in filter(None, os.environ.get(SLOW_COPY_ENV, "").split(",")):
        cid, _, rest = entry.partition(":")
        seconds, _, where = rest.partition(":")
        if (cid == "*" or int(cid) == checkpoint_id) and (where or "start") == part:
            time.sleep(float(seconds))


def maybe_hold_restore(checkpoint_id: int, rank: int) -> None:
    """Hold this rank's restore of `checkpoint_id` as DELTAREC_SLOW_RESTORE says, announcing it
    on stderr first, so that a test can SIGKILL the rank from outside in the middle of a restore
    (which takes milliseconds on the tests' tables)."""
    spec = os.environ.get(SLOW_RESTORE_ENV)
    if not spec:
        return
    cid, _, seconds = spec.partition(":")
    if int(cid) == checkpoint_id:
        print(
            f"deltarec fault: rank {rank} holds its restore of checkpoint {checkpoint_id} for {seconds} s",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(float(seconds))


def maybe_hold(point: str, key: int) -> None:
    """Hold at crash point `point` number `key` while the file DELTAREC_HOLD_AT names exists."""
    spec = os.environ.get(HOLD_ENV)
    if not spec:
        return
    where, sep, path = spec.partition("=")
    target = parse_kill_at(where)
    if not sep or not path:
        raise FaultSpecError(f"{HOLD_ENV}={spec!r}: expected point:key=PATH")
    if not target.matches(point, key):
        return
    print(f"deltarec fault: holding at {point}:{key} while {path} exists", file=sys.stderr, flush=True)
    while os.path.exists(path):
        time.sleep(0.05)


def maybe_fail_dense_write(checkpoint_id: int, path: os.PathLike | str) -> None:
    """Raise the OSError DELTAREC_DENSE_ERROR names for `checkpoint_id`'s dense file (tests of a
    full disk or a permission error at the write, which root cannot provoke with chmod)."""
    spec = os.environ.get(DENSE_ERROR_ENV)
    if not spec:
        return
    cid, _, name = spec.partition(":")
    code = getattr(errno, name.strip(), None)
    if not cid.strip().isdigit() or not isinstance(code, int):
        raise FaultSpecError(f"{DENSE_ERROR_ENV}={spec!r}: expected checkpoint_id:ERRNO, e.g. 3:ENOSPC")
    if int(cid) == checkpoint_id:
        raise OSError(code, os.strerror(code), str(path))
