"""Writer attempts and fencing: one trainer and one `deltarec-ckpt gc` write a run at a time.

A writer appends an ATTEMPT record to the markers log before it writes anything (ckpt/log/catalog.py
folds them). Of each role the newest record holds the run: markers of an older trainer attempt
that land after it are ignored by every reader, whatever their ids, and an older writer that
reads the log and finds a newer record stops with one line (`Fenced`). The log's own order
decides, so this needs no lock, lease timeout or clock: it works the same on Kafka and on the
filesystem sink (docs/design/failures.md, "Zombie writers"). A writer's epoch is its record's position + 1 (a Kafka
offset or a byte offset): unique, ordered like the log, and known from the append alone.

Two writers started at once both append; the older learns it at its next read of the log (a
trainer before its first dense file, gc at once), so exactly one goes on. A writer that was
SIGKILLed needs no cleanup: the next one's record is newer. Followers hold a lease instead
(ckpt/follow/lease.py): a second follower is a standby that must not displace a live one,
whereas a new trainer attempt or gc is always the one to keep.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import uuid
from typing import NamedTuple

from ckpt.log.catalog import Catalog, Holder
from ckpt.log.markers import AttemptRecord, encode_marker
from ckpt.stream.sink import MarkerLog
from common.errors import DeltarecError


class Fenced(DeltarecError):
    """A newer writer of the same role announced itself: this one must stop writing."""


def new_writer_id() -> str:
    """host:pid:random, unique per process (a restarted process is a new writer)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Announced(NamedTuple):
    """A writer's ATTEMPT record and its epoch (the record's position + 1)."""

    record: AttemptRecord
    epoch: int


def announce(markers: MarkerLog, run_id: str, role: str, world_size: int = 1) -> Announced:
    """Append this writer's ATTEMPT record (durable before it returns)."""
    record = AttemptRecord(
        kind="attempt", run_id=run_id, role=role, attempt=new_writer_id(), world_size=world_size, created_unix=time.time()
    )
    return Announced(record, markers.append_marker(encode_marker(record)) + 1)


def fenced_by(catalog: Catalog, mine: AttemptRecord) -> Holder | None:
    """The newer writer of `mine`'s role that holds the run, or None while `mine` holds it (or
    while `catalog` was not fed as far as `mine`'s record; when that record cannot be read back,
    damaged, nothing can tell, and the fold counts this writer's markers: ckpt/log/catalog.py)."""
    holder = catalog.holder(mine.role)
    if holder is None or holder.attempt == mine.attempt or mine.attempt not in catalog.epochs_of:
        return None
    return holder


def fenced_message(run_id: str, mine: AttemptRecord, newer: Holder) -> str:
    """The one line a fenced writer stops with."""
    when = datetime.datetime.fromtimestamp(newer.created_unix).strftime("%Y-%m-%d %H:%M:%S")
    what = "trainer attempt" if mine.role == "trainer" else "deltarec-ckpt gc"
    return (
        f"run {run_id}: a newer {what} ({newer.attempt}, epoch {newer.epoch}, started {when}) took over "
        f"this run's markers log, so this one ({mine.attempt}) stops: what it would write from here on "
        f"is ignored. Two jobs with one run id, or an old attempt that outlived its restart"
    )
