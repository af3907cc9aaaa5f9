"""Where checkpoint frames and markers go: the interfaces both backends implement.

Two backends, same semantics:

- Kafka (``ckpt.stream.kafka``): rows of full-checkpoint generation N in topic
  ``<run>.rows.g<N>`` (partitions = world size, partition = rank), positions are Kafka
  offsets; markers in ``<run>.markers`` (one partition).
- Filesystem (``ckpt.stream.filesystem``): the same frames in append-only segment files
  ``<root>/<run>.rows.g<N>/<partition>.seg``, positions are byte offsets of records;
  markers in ``<root>/<run>.markers.log``.

A *position* is what a reader needs to find a frame again; a *range* ``(first, last)``
is inclusive and names the positions of the first and the last frame. Ranges come only
from ``flush()`` results (delivery reports / fsync), never from broker watermarks, and
are what a COMMIT marker records.

Threading: a sink is used by one thread (the rank's writer thread); delivery callbacks
run inside its own ``write``/``flush`` calls.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ckpt.stream.frames import Frame
from common.errors import ConfigError, DeltarecError

Range = tuple[int, int]
Key = tuple[int, int]  # (generation, partition)

_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


class SinkError(DeltarecError, RuntimeError):
    """Writing failed: the checkpoint being written is lost; older ones are untouched."""


class SourceError(DeltarecError, RuntimeError):
    """Reading failed: data missing, unreachable, or not what was asked for."""


def check_run_id(run_id: str) -> str:
    """Run ids become Kafka topic and file names: ``[A-Za-z0-9._-]``, at most 200 chars."""
    if not _RUN_ID.match(run_id) or run_id in (".", ".."):
        raise ConfigError(
            f"run id {run_id!r} (ckpt.run_id, default run.name) must match [A-Za-z0-9._-]{{1,200}}: "
            "it names topics and directories"
        )
    return run_id


# Compacted generations (written by the follower, ckpt/follow) share the integer type of
# the trainer's generations but not their values: the trainer's are checkpoint ids (>= 0),
# a compacted one is -(epoch << 40 | checkpoint id), unique per follower lease epoch, so a
# fenced follower and the lease holder never write the same topic or directory.
_COMPACTED_SHIFT = 40


def compacted_generation(epoch: int, checkpoint_id: int) -> int:
    """The generation a follower of lease `epoch` writes its compacted baseline of `checkpoint_id` to."""
    assert epoch >= 1 and 0 < checkpoint_id < (1 << _COMPACTED_SHIFT), (epoch, checkpoint_id)
    return -((epoch << _COMPACTED_SHIFT) | checkpoint_id)


def is_compacted(generation: int) -> bool:
    return generation < 0


def rows_name(run_id: str, generation: int) -> str:
    """Topic (Kafka) or directory (filesystem) of one generation: ``<run>.rows.g<N>`` for the
    trainer's (opened by full checkpoint N), ``<run>.rows.e<epoch>.c<N>`` for a follower's
    compacted baseline of checkpoint N."""
    if is_compacted(generation):
        epoch, cid = -generation >> _COMPACTED_SHIFT, -generation & ((1 << _COMPACTED_SHIFT) - 1)
        return f"{run_id}.rows.e{epoch}.c{cid}"
    return f"{run_id}.rows.g{generation}"


_ROWS_SUFFIX = re.compile(r"^rows\.(?:g(\d+)|e(\d+)\.c(\d+))$")


def parse_rows_name(run_id: str, name: str) -> int | None:
    """The generation a topic or directory `name` holds (inverse of `rows_name`); None when
    it is not one of this run's generations."""
    prefix = f"{run_id}."
    m = _ROWS_SUFFIX.match(name[len(prefix) :]) if name.startswith(prefix) else None
    if m is None:
        return None
    if m.group(1) is not None:
        return int(m.group(1))
    return compacted_generation(int(m.group(2)), int(m.group(3)))


def compacted_epoch(generation: int) -> int:
    """The lease epoch of the follower that wrote a compacted generation."""
    assert is_compacted(generation)
    return -generation >> _COMPACTED_SHIFT


def generation_label(generation: int) -> str:
    """How `deltarec-ckpt` and logs name a generation: ``g7`` or ``e2.c41``."""
    return rows_name("", generation)[len(".rows.") :]


def markers_name(run_id: str) -> str:
    return f"{run_id}.markers"


@dataclass
class SinkResult:
    """Outcome of one ``flush()``: what became durable since the previous flush.

    ``ranges[(generation, partition)]`` lists the acknowledged position ranges in
    write order; consecutive positions merge, so one writer per partition gets one
    range. ``frames`` counts acknowledged frames per key; ``positions`` lists each
    acknowledged frame's position in acknowledgement order, which is write order (one
    writer per partition; the idempotent producer delivers a partition in order), so a
    writer can index its frames. ``error`` is the first failure;
    when set, the flushed writes must be treated as lost (some may still have landed).
    """

    ranges: dict[Key, list[Range]] = field(default_factory=dict)
    frames: dict[Key, int] = field(default_factory=dict)
    error: SinkError | None = None
    positions: dict[Key, list[int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

    def raise_for_error(self) -> SinkResult:
        if self.error is not None:
            raise self.error
        return self


class RangeRecorder:
    """Accumulates acknowledged positions into inclusive, merged ranges per key.

    ``add(key, position, next_position)``: ``next_position`` is where a directly
    following frame would be (offset + 1 for Kafka, end byte for files).
    """

    def __init__(self) -> None:
        self._runs: dict[Key, list[list[int]]] = {}  # [first, last, next]
        self._count: dict[Key, int] = {}
        self._positions: dict[Key, list[int]] = {}

    def add(self, key: Key, position: int, next_position: int) -> None:
        runs = self._runs.setdefault(key, [])
        if runs and runs[-1][2] == position:
            runs[-1][1:] = [position, next_position]
        else:
            runs.append([position, position, next_position])
        self._count[key] = self._count.get(key, 0) + 1
        self._positions.setdefault(key, []).append(position)

    def result(self, error: SinkError | None = None) -> SinkResult:
        return SinkResult(
            ranges={k: [(r[0], r[1]) for r in v] for k, v in self._runs.items()},
            frames=dict(self._count),
            error=error,
            positions={k: list(v) for k, v in self._positions.items()},
        )


class FrameSink(Protocol):
    def write(self, frame: bytes, *, generation: int, partition: int) -> None:
        """Queue one encoded frame. Returns quickly; waits (bounded) only when the local
        buffer is full. Raises ``SinkError`` when the frame cannot be queued."""

    def flush(self, timeout_s: float) -> SinkResult:
        """Wait until every write since the previous flush is durable or failed."""

    def generations(self) -> list[int]:
        """Every generation of this run that exists in the sink (topics or directories)."""

    def drop_generation(self, generation: int) -> None:
        """Delete all rows of ``generation``; later writes to it are refused."""

    def close(self) -> None:
        """Release resources. Unflushed writes are abandoned: flush first."""


class RangeRead(NamedTuple):
    """One inclusive position range of one partition of one generation, to read back."""

    generation: int
    partition: int
    first: int
    last: int


class FrameSource(Protocol):
    reads_ahead_used: int  # `read_ranges` calls that took over the reads `read_ahead` started

    def read_range(self, generation: int, partition: int, first: int, last: int) -> Iterator[tuple[int, Frame]]:
        """Yield ``(position, frame)`` for exactly the frames in ``[first, last]``,
        verified, streaming. Raises ``SourceError`` if data is missing and
        ``FrameError`` (with its location) if a frame is corrupt."""

    def read_ranges(self, reads: Sequence[RangeRead]) -> Iterator[tuple[int, int, Frame]]:
        """Yield ``(index into reads, position, frame)`` for every frame of every read, as
        ``read_range`` would: in position order within a read, in any order across reads (a
        backend may fetch them all at once). Same errors as ``read_range``."""

    def prepare(self) -> None:
        """A hint that a restore's `read_ranges` comes soon: start connecting (a broker),
        or nothing (files)."""

    def read_ahead(self, reads: Sequence[RangeRead]) -> None:
        """A hint that a restore's next `read_ranges` is probably `reads`: start fetching them
        (a broker, within its read buffer), or nothing (files). A `read_ranges` of other
        reads drops what was fetched."""

    def close(self) -> None: ...


def read_one_by_one(source: FrameSource, reads: Sequence[RangeRead]) -> Iterator[tuple[int, int, Frame]]:
    """``read_ranges`` as consecutive ``read_range`` calls: for a source whose reads gain
    nothing from running together (local files, memory)."""
    for i, r in enumerate(reads):
        for pos, frame in source.read_range(r.generation, r.partition, r.first, r.last):
            yield i, pos, frame


class MarkerLog(Protocol):
    def append_marker(self, payload: bytes) -> int:
        """Durably append one marker; returns its position. Raises ``SinkError``."""

    def append_markers(self, payloads: Sequence[bytes]) -> list[int]:
        """Durably append records in this order, in one write (one produce request and one
        acknowledgement, or one fsync); returns their positions. Raises ``SinkError``: then
        any of them may be in the log, those before a missing one included, as after a crash."""

    def prepare(self, timeout_s: float) -> None:
        """Start what `check_reachable` waits for (a broker's connect, on a thread of its own)
        so that it is done by then, or nothing (files)."""

    def check_reachable(self, timeout_s: float) -> None:
        """Raise a ``SinkError`` naming the address unless the log's storage answers within
        `timeout_s` (a broker); files always do."""

    def read_markers(self, start: int = 0) -> list[tuple[int, bytes]]:
        """Every durable marker at or after position `start` (0, or a position this log
        returned), in order, as ``(position, payload)``. Several processes may append (the
        trainer's rank 0, a follower, `deltarec-ckpt gc`)."""

    def read_tail(self, records: int) -> TailRead:
        """At least the last `records` durable markers (all of them when the log holds fewer),
        in order, without reading from the log's start (a broker) or without reading more
        than record headers before them (files)."""

    def close(self) -> None: ...


class TailRead(NamedTuple):
    """The end of a markers log: `records` as ``(position, payload)``, in order; `whole`: they
    start at the log's first record."""

    records: list[tuple[int, bytes]]
    whole: bool
