"""Managed-collision mapping records: one shard's raw-id -> slot state on the stream, beside
its rows.

A managed-collision (ZCH) table maps raw ids to slots (sharding/managed_collision.py); rows
alone restore nothing without it. Each checkpoint writes, per shard of such a table, one
*mapping record*: the shard's whole `McState` (a full record), or the `McDelta` from the state
of the checkpoint its rows' delta is against (a delta record, `follows` naming that
checkpoint). The record travels in mapping frames (``ckpt.stream.frames.FLAG_MAPPING``, cut
under the frame size limit by `mapping_frames`, joined back by `join_mapping`), indexed in its
link with ``cols == 0`` (``ckpt.log.markers.IndexEntry.is_mapping``). A restore replays the
chain's records in order: a full record is the state, a delta applies to the state the
previous link left (`MappingRecord.resolve`).

Record layout, "DMC1", every integer little-endian int64 unless said, every section 8-aligned::

    header   magic "DMC1" | version u16 | kind u8 (1 full, 2 delta)
             | meta u8 (bit 0: counts kept, bit 1: last access kept)
    fields   follows | slot_offset | size | current_iter | last_eviction_iter
             | history_capacity | input_hash_size | n_segments | n_evicted | n_admitted
             | n_counter | n_history | history_keep
    sections segments[n_segments]
             full:  raw_ids[size] | counts[size]? | last_access[size]?
             delta: evicted_slots[n_evicted] | evicted_raw_ids[n_evicted]
                    | admitted_slots[n_admitted] | admitted_raw_ids[n_admitted]
                    | counter_slots[n_counter] | counts[n_counter]? | last_access[n_counter]?
             then:  history_ids[n_history] | history_last_access[n_history]?

(``?``: present when the meta bit says the policy keeps it.) A full record has ``follows``,
the three delta counts and ``history_keep`` 0; a delta record's ``n_history`` ids are the
ones after the first ``history_keep`` of the state it follows (`McDelta.history_keep`). The
record's length is exactly what its fields say. The table is not in the record: the frames
carry it. Integrity is the frames' CRC; decoding checks structure (magic, version, kind,
lengths, the shard's place in its segments) and the state's own invariants.

Versions: this module writes and reads version 1; a record of a higher version is refused
with a line saying a newer deltarec wrote it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ckpt.stream.frames import DEFAULT_MAX_FRAME_BYTES, EncodedFrame, Frame, FrameError, chunk_mapping
from sharding.managed_collision import ManagedCollisionError, McDelta, McState, apply, diff

MAGIC = b"DMC1"
VERSION = 1
KIND_FULL = 1
KIND_DELTA = 2
META_COUNTS = 0x1
META_LAST_ACCESS = 0x2

_HEAD = struct.Struct("<4sHBB")  # magic, version, kind, meta
# follows, slot_offset, size, current_iter, last_eviction_iter, history_capacity, input_hash_size,
# n_segments, n_evicted, n_admitted, n_counter, n_history, history_keep
_FIELDS = struct.Struct("<13q")
_I64 = np.dtype("<i8")


class MappingError(FrameError):
    """A mapping record (or the mapping frames that carry it) that cannot be read: one line
    naming the table and what is wrong."""

    def located(self, where: str) -> MappingError:
        return MappingError(self.reason, where)


@dataclass(frozen=True, eq=False)
class MappingRecord:
    """One shard's mapping as one checkpoint writes it: the whole `state` (a full record,
    `follows` 0) or the `delta` from the state of checkpoint `follows`. Exactly one of the two
    is set. `segments` and `input_hash_size` are the table's (a delta does not hold them);
    `==` compares every field exactly."""

    table: str
    follows: int  # the checkpoint whose state `delta` applies to; 0: a full record
    segments: tuple[int, ...]  # the table's row-wise shard starts, then its row count
    input_hash_size: int
    state: McState | None = None
    delta: McDelta | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(int(x) for x in self.segments))
        what = f"mapping record of table {self.table}"
        if (self.state is None) == (self.delta is None):
            raise MappingError(f"{what}: holds {'both' if self.state is not None else 'neither'} a state and a delta")
        if self.state is not None:
            s = self.state
            if self.follows != 0:
                raise MappingError(f"{what}: a full record follows no checkpoint (follows {self.follows})")
            if (s.table, s.segments, s.input_hash_size) != (self.table, self.segments, self.input_hash_size):
                raise MappingError(
                    f"{what}: its state is of table {s.table} (segments {s.segments}, hash size {s.input_hash_size})"
                )
        elif self.delta is not None:
            if self.follows < 1:
                raise MappingError(f"{what}: a delta record must name the checkpoint it follows (follows {self.follows})")
            if self.delta.table != self.table:
                raise MappingError(f"{what}: its delta is of table {self.delta.table}")
            if (self.delta.history_last_access is None) != (self.delta.last_access is None):
                raise MappingError(f"{what}: the history's last access must come with the slots' last access")
        if self.size < 1:
            raise MappingError(f"{what}: a shard of {self.size} slots")
        if len(self.segments) < 2 or self.segments[0] != 0 or any(b < a for a, b in zip(self.segments, self.segments[1:])):
            raise MappingError(f"{what}: segments {self.segments} are not a row-wise layout")
        if not any(a == self.slot_offset and b == self.slot_offset + self.size for a, b in zip(self.segments, self.segments[1:])):
            raise MappingError(
                f"{what}: slots {self.slot_offset}..{self.slot_offset + self.size - 1} are no shard of segments {self.segments}"
            )
        if self.input_hash_size < 1:
            raise MappingError(f"{what}: input hash size {self.input_hash_size}")

    @classmethod
    def of_state(cls, state: McState) -> MappingRecord:
        """The full record of `state`."""
        return cls(state.table, 0, state.segments, state.input_hash_size, state=state)

    @classmethod
    def of_delta(cls, delta: McDelta, follows: int, segments: Sequence[int], input_hash_size: int) -> MappingRecord:
        """The delta record of `delta`, which applies to the state of checkpoint `follows`."""
        return cls(delta.table, follows, tuple(segments), input_hash_size, delta=delta)

    @property
    def full(self) -> bool:
        return self.state is not None

    @property
    def slot_offset(self) -> int:
        """The shard's first slot (global row)."""
        return self._content.slot_offset

    @property
    def size(self) -> int:
        """The shard's slots (rows), its miss slot included."""
        return self._content.size

    @property
    def _content(self) -> McState | McDelta:
        content = self.state if self.state is not None else self.delta
        assert content is not None  # `__post_init__` says exactly one is set
        return content

    @property
    def nbytes(self) -> int:
        """Bytes of the encoded record (`encode_mapping`), computed from the counts alone."""
        if self.state is not None:
            return full_nbytes(self.state)
        assert self.delta is not None
        return _delta_nbytes(self.delta, len(self.segments))

    def resolve(self, prev: McState | None, prev_checkpoint: int) -> McState:
        """The shard's state after this record: a full record's state, or the delta applied to
        `prev`, the state checkpoint `prev_checkpoint` left (None: no state yet). Refuses a delta
        that follows another checkpoint than `prev_checkpoint`, or that does not fit `prev`."""
        if self.state is not None:
            return self.state
        assert self.delta is not None
        what = f"mapping record of table {self.table}"
        if prev is None or prev_checkpoint != self.follows:
            have = "no state before it" if prev is None else f"the state of checkpoint {prev_checkpoint}"
            raise MappingError(f"{what}: a delta from checkpoint {self.follows}, but the chain has {have}")
        if (prev.segments, prev.input_hash_size) != (self.segments, self.input_hash_size):
            raise MappingError(f"{what}: a delta for segments {self.segments}, the state before it has {prev.segments}")
        try:
            return apply(prev, self.delta)
        except ManagedCollisionError as exc:
            raise MappingError(f"{what} does not apply: {exc}") from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MappingRecord):
            return NotImplemented
        scalars = ("table", "follows", "segments", "input_hash_size")
        if any(getattr(self, f) != getattr(other, f) for f in scalars):
            return False
        if (self.state is None) != (other.state is None):
            return False
        return self.state == other.state if self.state is not None else self.delta == other.delta

    __hash__ = None  # type: ignore[assignment]  # equal by value, like the state it holds


# --- sizes ---------------------------------------------------------------------------------------


def _meta(counts: object, last_access: object) -> int:
    return (META_COUNTS if counts is not None else 0) | (META_LAST_ACCESS if last_access is not None else 0)


def _nbytes(n_segments: int, slot_values: int, n_history: int, has_access: bool) -> int:
    return _HEAD.size + _FIELDS.size + 8 * (n_segments + slot_values + n_history * (2 if has_access else 1))


def full_nbytes(state: McState) -> int:
    """Bytes of `state`'s full record."""
    per_slot = 1 + (state.counts is not None) + (state.last_access is not None)
    return _nbytes(len(state.segments), state.size * per_slot, state.history_ids.shape[0], state.last_access is not None)


def _delta_nbytes(delta: McDelta, n_segments: int) -> int:
    per_counter = 1 + (delta.counts is not None) + (delta.last_access is not None)
    values = 2 * delta.evicted_slots.shape[0] + 2 * delta.admitted_slots.shape[0] + per_counter * delta.counter_slots.shape[0]
    return _nbytes(n_segments, values, delta.history_ids.shape[0], delta.last_access is not None)


def record_for(prev: McState | None, cur: McState, follows: int) -> MappingRecord:
    """The record a checkpoint writes for shard state `cur`: the full record when there is no
    `prev` (the state of checkpoint `follows`, which the checkpoint's rows are a delta of) or
    `follows` is 0 (a full checkpoint); else the smaller of the delta from `prev` and the full
    record, the full one when they are the same size (it needs nothing before it)."""
    full = MappingRecord.of_state(cur)
    if prev is None or follows == 0:
        return full
    delta = MappingRecord.of_delta(diff(prev, cur), follows, cur.segments, cur.input_hash_size)
    return delta if delta.nbytes < full.nbytes else full


# --- encoding and decoding -----------------------------------------------------------------------


def encode_mapping(record: MappingRecord) -> bytes:
    """The record's bytes (layout: the module docstring)."""
    segments = np.asarray(record.segments, dtype=_I64)
    if record.state is not None:
        s = record.state
        kind, meta = KIND_FULL, _meta(s.counts, s.last_access)
        counts = (0, 0, 0, s.history_ids.shape[0], 0)
        scalars = (s.current_iter, s.last_eviction_iter, s.history_capacity)
        sections = [segments, s.raw_ids, s.counts, s.last_access, s.history_ids, s.history_last_access]
    else:
        d = record.delta
        assert d is not None
        kind, meta = KIND_DELTA, _meta(d.counts, d.last_access)
        n_evicted, n_admitted, n_counter = d.evicted_slots.shape[0], d.admitted_slots.shape[0], d.counter_slots.shape[0]
        counts = (n_evicted, n_admitted, n_counter, d.history_ids.shape[0], d.history_keep)
        scalars = (d.current_iter, d.last_eviction_iter, d.history_capacity)
        sections = [
            segments,
            d.evicted_slots,
            d.evicted_raw_ids,
            d.admitted_slots,
            d.admitted_raw_ids,
            d.counter_slots,
            d.counts,
            d.last_access,
            d.history_ids,
            d.history_last_access,
        ]
    n_evicted, n_admitted, n_counter, n_history, keep = counts
    try:
        head = _HEAD.pack(MAGIC, VERSION, kind, meta) + _FIELDS.pack(
            record.follows,
            record.slot_offset,
            record.size,
            *scalars,
            record.input_hash_size,
            segments.shape[0],
            n_evicted,
            n_admitted,
            n_counter,
            n_history,
            keep,
        )
    except struct.error as exc:
        raise MappingError(f"mapping record of table {record.table}: a field out of range: {exc}") from None
    out = head + b"".join(np.ascontiguousarray(a, dtype=_I64).tobytes() for a in sections if a is not None)
    assert len(out) == record.nbytes, (len(out), record.nbytes)
    return out


def decode_mapping(table: str, data: bytes | bytearray | memoryview) -> MappingRecord:
    """The record `encode_mapping` wrote for shard of table `table`; raises `MappingError` (one
    line) for anything else: another magic, a newer version, a length other than its fields
    say, counts or a layout no shard has."""
    buf = data if isinstance(data, bytes) else bytes(data)  # the arrays are views of it: immutable
    what = f"mapping record of table {table}"
    if len(buf) < _HEAD.size:
        raise MappingError(f"{what}: truncated to {len(buf)} bytes")
    magic, version, kind, meta = _HEAD.unpack_from(buf)
    if magic != MAGIC:
        raise MappingError(f"{what}: bad magic {magic!r}, expected {MAGIC!r}")
    if version > VERSION:
        raise MappingError(f"{what} is version {version}, written by a newer deltarec (this one reads {VERSION}): upgrade")
    if version != VERSION:
        raise MappingError(f"{what}: unknown version {version} (this reader knows {VERSION})")
    if kind not in (KIND_FULL, KIND_DELTA) or meta & ~(META_COUNTS | META_LAST_ACCESS):
        raise MappingError(f"{what}: unknown kind {kind} or metadata bits {meta:#x}")
    if len(buf) < _HEAD.size + _FIELDS.size:
        raise MappingError(f"{what}: truncated to {len(buf)} bytes")
    fields = _FIELDS.unpack_from(buf, _HEAD.size)
    (follows, slot_offset, size, current_iter, last_eviction_iter, history_capacity, input_hash_size) = fields[:7]
    n_segments, n_evicted, n_admitted, n_counter, n_history, keep = fields[7:]
    has_counts, has_access = bool(meta & META_COUNTS), bool(meta & META_LAST_ACCESS)
    if min(size, n_segments, n_evicted, n_admitted, n_counter, n_history, keep) < 0:
        raise MappingError(f"{what}: negative counts {fields[7:]} or size {size}")
    if kind == KIND_FULL and (n_evicted or n_admitted or n_counter or keep or follows):
        raise MappingError(f"{what}: a full record with delta fields (follows {follows}, counts {fields[8:]})")
    per_counter = 1 + has_counts + has_access
    values = size * per_counter if kind == KIND_FULL else 2 * n_evicted + 2 * n_admitted + per_counter * n_counter
    expect = _nbytes(n_segments, values, n_history, has_access)
    if expect != len(buf):
        what_len = "truncated" if len(buf) < expect else "trailing bytes"
        raise MappingError(f"{what}: {what_len}: its fields say {expect} bytes, it has {len(buf)}")
    cursor = _Cursor(buf, _HEAD.size + _FIELDS.size)
    segments = tuple(int(x) for x in cursor.take(n_segments))
    try:
        if kind == KIND_FULL:
            raw_ids = cursor.take(size)
            counts = cursor.take(size) if has_counts else None
            last_access = cursor.take(size) if has_access else None
            history = cursor.take(n_history)
            state = McState(
                table=table,
                slot_offset=slot_offset,
                raw_ids=raw_ids,
                counts=counts,
                last_access=last_access,
                current_iter=current_iter,
                last_eviction_iter=last_eviction_iter,
                history_ids=history,
                history_last_access=cursor.take(n_history) if has_access else None,
                history_capacity=history_capacity,
                segments=segments,
                input_hash_size=input_hash_size,
            )
            return MappingRecord(table, follows, segments, input_hash_size, state=state)
        delta = McDelta(
            table=table,
            slot_offset=slot_offset,
            size=size,
            evicted_slots=cursor.take(n_evicted),
            evicted_raw_ids=cursor.take(n_evicted),
            admitted_slots=cursor.take(n_admitted),
            admitted_raw_ids=cursor.take(n_admitted),
            counter_slots=cursor.take(n_counter),
            counts=cursor.take(n_counter) if has_counts else None,
            last_access=cursor.take(n_counter) if has_access else None,
            current_iter=current_iter,
            last_eviction_iter=last_eviction_iter,
            history_ids=cursor.take(n_history),
            history_last_access=cursor.take(n_history) if has_access else None,
            history_capacity=history_capacity,
            history_keep=keep,
        )
        return MappingRecord(table, follows, segments, input_hash_size, delta=delta)
    except ManagedCollisionError as exc:
        raise MappingError(f"{what} is inconsistent: {exc}") from None


class _Cursor:
    """Reads consecutive int64 sections of a record (its length already checked)."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf = buf
        self.pos = pos

    def take(self, n: int) -> np.ndarray:
        out = np.frombuffer(self.buf, dtype=_I64, count=n, offset=self.pos)
        self.pos += 8 * n
        return out


# --- frames --------------------------------------------------------------------------------------


def mapping_frames(
    record: MappingRecord,
    *,
    run_id: str,
    checkpoint_id: int,
    rank: int,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    epoch: int = 0,
) -> Iterator[EncodedFrame]:
    """The mapping frames of `record` as one rank writes them for one checkpoint, each under
    ``max_frame_bytes``, indexed with the shard's slot range as their rows."""
    return chunk_mapping(
        run_id=run_id,
        checkpoint_id=checkpoint_id,
        rank=rank,
        table=record.table,
        record=encode_mapping(record),
        encoding=VERSION,
        first_row=record.slot_offset,
        last_row=record.slot_offset + record.size - 1,
        max_frame_bytes=max_frame_bytes,
        epoch=epoch,
    )


def join_mapping(frames: Sequence[Frame]) -> MappingRecord:
    """The record that the mapping frames of one shard carry (chunks 0..count-1, in order, of
    one run, checkpoint, rank, table and epoch). Refuses, in one line naming the table, frames
    of rows, a chunk missing, doubled or out of place, frames of different records, and a
    record version this deltarec does not read."""
    if not frames:
        raise MappingError("no mapping frames to join")
    first = frames[0]
    what = f"mapping frames of table {first.table}"
    for i, f in enumerate(frames):
        if f.mapping is None:
            raise MappingError(f"{what}: frame {i} holds rows of table {f.table}, not a piece of a mapping record")
        key = (f.run_id, f.checkpoint_id, f.rank, f.table, f.epoch, f.encoding)
        if key != (first.run_id, first.checkpoint_id, first.rank, first.table, first.epoch, first.encoding):
            raise MappingError(
                f"{what}: frame {i} is of another record ({f.table} of rank {f.rank}, checkpoint {f.checkpoint_id})"
            )
        if (f.chunk_index, f.chunk_count) != (i, len(frames)):
            raise MappingError(f"{what}: frame {i} is chunk {f.chunk_index} of {f.chunk_count}, expected {i} of {len(frames)}")
    if first.encoding > VERSION:
        raise MappingError(
            f"{what} hold a record of version {first.encoding}, written by a newer deltarec (this one reads {VERSION}): upgrade"
        )
    if first.encoding != VERSION:
        raise MappingError(f"{what}: unknown record version {first.encoding} (this reader knows {VERSION})")
    return decode_mapping(first.table, b"".join(f.mapping for f in frames if f.mapping is not None))
