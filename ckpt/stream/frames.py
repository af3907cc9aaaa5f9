"""Checkpoint frames: the binary unit that carries embedding rows to a sink.

One frame holds rows of one (table, column offset) shard of one rank for one
checkpoint, or a piece of one shard's managed-collision mapping record (``FLAG_MAPPING``,
below). Layout, version 1, all integers little-endian::

    prefix   magic "DRF1" | version u16 | flags u16 | header_len u32 | total_len u64
    meta     checkpoint_id u64 | rank u32 | col_offset u32 | row_count u32 | dim u32
             | row_bytes u32 | chunk_index u32 | chunk_count u32 | encoding u8 | n_optim u8
             | run_id (u16 length + utf-8) | table (u16 length + utf-8)
             | n_optim x [name (u16 length + utf-8) | encoding u8 | row_bytes u32]
             | zero padding to a multiple of 8                      (= header_len bytes)
    body     row ids int64[n] | payload uint8[n, row_bytes] | each optimizer state
             uint8[n, its row_bytes]; every section zero-padded to a multiple of 8
    trailer  crc32 u32 over every byte before it

``flags`` bit 0 (``FLAG_ROW_RUN``): the rows are the run ``first``..``first + n - 1``, and
the row-ids section holds only ``first`` (int64): full checkpoints and compacted baselines
write whole shards, whose ids would otherwise cost 8 bytes a row. Bit 1 (``FLAG_EPOCH``):
the header tail ends with the writing trainer attempt's epoch (u64) after the optimizer
layout; a restore checks it against the COMMIT marker's link (frames without it are epoch
0). Bit 2 (``FLAG_ROW_BITMAP``): the rows ascend, and the row-ids section holds ``first``
(int64), ``span`` (int64) and a bitmap of ``span`` bits (LSB first), bit i set for row
``first + i``: what a frame of scattered trained rows uses when that is smaller than 8 bytes
a row. Bit 3 (``FLAG_MAPPING``): a mapping frame, below. Other bits are refused, and so are
``FLAG_ROW_RUN`` with ``FLAG_ROW_BITMAP`` and either with ``FLAG_MAPPING``.

A mapping frame carries one piece of the raw-id -> slot mapping record of one shard of a
managed-collision table (``ckpt.stream.mapping``): the same prefix and header, with
``col_offset``, ``row_count``, ``dim`` and ``n_optim`` 0, ``row_bytes`` the piece's length L
and ``encoding`` the record format's version; its header tail is the run id, the table and
(``FLAG_EPOCH``) the epoch. Body: the piece, uint8[L] zero-padded to a multiple of 8, then the
CRC. A record larger than one frame is cut into pieces numbered ``chunk_index``
0..``chunk_count`` - 1 (`chunk_mapping`); the record is their concatenation in that order.
Frames without the flag are exactly what they were before mapping frames existed.

``encoding`` (of a frame of rows) is a codec id of ``ckpt.quant``'s registry (fp32=1, fp16=2, asym8=24, ...),
carried as an integer: this module never interprets payload bytes. Sections start
8-aligned, so a decoder can view them in place (``torch.frombuffer``) without copying.

CRC: zlib's CRC-32 (`common.checksum.crc32`: ISA-L's kernels, the stdlib's values; detects
every error burst up to 32 bits, so any single flipped byte). CRC32C would be what Kafka uses
for batches but buys no extra detection for our purpose and would change the format.

Decoding checks, in order: magic, version, total length (truncation / trailing bytes),
CRC, then internal consistency. Every failure raises :class:`FrameError`; the reader
that knows where the bytes came from adds it with ``where=`` (see :func:`kafka_where`,
:func:`file_where`).
"""

from __future__ import annotations

import math
import struct
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from common.checksum import crc32
from common.errors import DeltarecError

MAGIC = b"DRF1"
VERSION = 1
# librdkafka refuses messages over message.max.bytes (default 1,000,000) and Apache
# Kafka's broker default is 1,048,588 for a whole record batch: stay under both with
# room for the record/batch overhead (~100 bytes).
DEFAULT_MAX_FRAME_BYTES = 1_000_000 - 1024

_PREFIX = struct.Struct("<4sHHIQ")  # magic, version, flags, header_len, total_len
_META = struct.Struct("<QIIIIIIIBB")  # ckpt, rank, col, n, dim, row_bytes, idx, cnt, enc, n_opt
_STR_LEN = struct.Struct("<H")
_OPT = struct.Struct("<BI")  # encoding, row_bytes
_CRC = struct.Struct("<I")
_ALIGN = 8
_MAX_STR = 0xFFFF
FLAG_ROW_RUN = 0x1  # row ids are first..first+n-1; the ids section holds `first` alone
FLAG_EPOCH = 0x2  # the header tail ends with the writer's epoch (u64)
FLAG_ROW_BITMAP = 0x4  # the ids section holds first, span and a bitmap of the rows in first..first+span-1
FLAG_MAPPING = 0x8  # no rows: the body is a piece of a managed-collision mapping record
_FLAGS = FLAG_ROW_RUN | FLAG_EPOCH | FLAG_ROW_BITMAP | FLAG_MAPPING
_BITMAP_HEAD = struct.Struct("<qq")  # first, span
_EPOCH = struct.Struct("<Q")

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("ckpt.stream.frames writes tensors in native byte order and needs a little-endian host")

# torch warns once per process when it views a read-only buffer (bytes from Kafka or a
# file). The views are documented read-only; spend that one warning here, silently.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0" * 8, dtype=torch.uint8)


class FrameError(DeltarecError, ValueError):
    """A frame failed validation. ``reason`` says what, ``where`` where it came from."""

    def __init__(self, reason: str, where: str | None = None) -> None:
        self.reason = reason
        self.where = where
        super().__init__(f"{where}: {reason}" if where else reason)

    def located(self, where: str) -> FrameError:
        """The same error, naming its origin (topic/partition/offset, file/byte offset)."""
        return FrameError(self.reason, where)


def kafka_where(topic: str, partition: int, offset: int) -> str:
    return f"topic {topic} partition {partition} offset {offset}"


def file_where(path: object, byte_offset: int) -> str:
    return f"{path} at byte {byte_offset}"


@dataclass(frozen=True)
class OptimState:
    """Rows of one optimizer tensor (e.g. row-wise Adagrad momentum) matching the frame's rows.

    On encode ``rows`` may be any dtype with first dimension n (its bytes are stored as
    they are); on decode it is a read-only ``uint8 [n, row_bytes]`` view.
    """

    name: str
    encoding: int
    rows: torch.Tensor

    @property
    def row_bytes(self) -> int:
        return _row_bytes(self.rows)


@dataclass(frozen=True)
class Frame:
    run_id: str
    checkpoint_id: int
    rank: int
    table: str
    col_offset: int
    dim: int
    encoding: int
    row_bytes: int
    chunk_index: int
    chunk_count: int
    row_ids: torch.Tensor  # int64 [n], global row ids
    payload: torch.Tensor  # uint8 [n, row_bytes], read-only view
    optim: tuple[OptimState, ...] = ()
    first_row: int | None = None  # a run (FLAG_ROW_RUN): row_ids are first_row.. in order
    epoch: int = 0  # the writing trainer attempt (FLAG_EPOCH); 0: none recorded
    # a mapping frame (FLAG_MAPPING): its piece of the shard's mapping record, a read-only view
    # of the buffer; None for a frame of rows. A mapping frame has no rows: row_ids [0], payload
    # [0, 0], dim and col_offset 0, row_bytes the piece's length
    mapping: memoryview | None = None

    @property
    def row_count(self) -> int:
        return int(self.row_ids.shape[0])

    @property
    def is_mapping(self) -> bool:
        return self.mapping is not None


# --- encoding -------------------------------------------------------------------------


def _pad(n: int) -> int:
    return -n % _ALIGN


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _as_row_bytes(t: torch.Tensor, n: int, what: str) -> np.ndarray:
    """``t`` (first dim n, any dtype) as a contiguous uint8 numpy array [n, row_bytes]."""
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if t.dim() == 0 or t.shape[0] != n:
        raise ValueError(f"{what} has shape {tuple(t.shape)}, expected first dimension {n}")
    t = t.detach().cpu().contiguous().reshape(n, math.prod(t.shape[1:]))
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return t.numpy()


def _str_field(s: str, what: str) -> bytes:
    b = s.encode("utf-8")
    if len(b) > _MAX_STR:
        raise ValueError(f"{what} is {len(b)} bytes, at most {_MAX_STR}")
    return _STR_LEN.pack(len(b)) + b


def _header_tail(run_id: str, table: str, optim_layout: Sequence[tuple[str, int, int]], epoch: int = 0) -> bytes:
    parts = [_str_field(run_id, "run id"), _str_field(table, "table name")]
    for name, enc, rb in optim_layout:
        parts += [_str_field(name, "optimizer state name"), _OPT.pack(enc, rb)]
    if epoch:
        try:
            parts.append(_EPOCH.pack(epoch))
        except struct.error:
            raise ValueError(f"epoch {epoch} out of range") from None
    return b"".join(parts)


def _header_len(tail_len: int) -> int:
    n = _PREFIX.size + _META.size + tail_len
    return n + _pad(n)


def _frame_len(
    header_len: int, n: int, row_bytes: int, optim_row_bytes: Sequence[int], run: bool = False, span: int | None = None
) -> int:
    """Bytes of a frame; its ids are a run, a bitmap of `span` rows, or 8 bytes a row."""
    ids = 8 if run else _bitmap_len(span) if span is not None else 8 * n
    body = sum(s + _pad(s) for s in [ids, n * row_bytes, *(n * rb for rb in optim_row_bytes)])
    return header_len + body + _CRC.size


def _bitmap_len(span: int) -> int:
    return _BITMAP_HEAD.size + (span + 7) // 8


def _bitmap_span(ids: np.ndarray) -> int | None:
    """The span of a bitmap holding `ids` (1-D int64) when it is smaller than 8 bytes a row and
    the ids strictly ascend; else None."""
    n = int(ids.shape[0])
    if n < 2:
        return None
    span = int(ids[-1]) - int(ids[0]) + 1
    size = _bitmap_len(span)
    if size + _pad(size) >= 8 * n or not bool((ids[1:] > ids[:-1]).all()):
        return None
    return span


def _bitmap(ids: np.ndarray, span: int) -> np.ndarray:
    bits = np.zeros(span, dtype=np.uint8)
    bits[ids - ids[0]] = 1
    head = np.frombuffer(_BITMAP_HEAD.pack(int(ids[0]), span), dtype=np.uint8)
    return np.concatenate([head, np.packbits(bits, bitorder="little")])


def _is_run(ids: np.ndarray) -> bool:
    """Whether `ids` (1-D int64) are first, first+1, ..., first+n-1."""
    n = int(ids.shape[0])
    return n > 0 and int(ids[-1]) - int(ids[0]) == n - 1 and (n == 1 or bool((np.diff(ids) == 1).all()))


def _ids_array(row_ids: torch.Tensor | np.ndarray) -> np.ndarray:
    """Row ids as a 1-D int64 numpy array (ValueError otherwise): frames work on numpy, whose
    small operations cost a fraction of torch's per call."""
    ids = torch.as_tensor(row_ids)
    if ids.dim() != 1:
        raise ValueError(f"row_ids must be 1-D, got shape {tuple(ids.shape)}")
    return ids.detach().cpu().to(torch.int64).contiguous().numpy()


def encode_frame(
    *,
    run_id: str,
    checkpoint_id: int,
    rank: int,
    table: str,
    col_offset: int,
    dim: int,
    encoding: int,
    row_ids: torch.Tensor,
    payload: torch.Tensor,
    optim: Sequence[OptimState] = (),
    chunk_index: int = 0,
    chunk_count: int = 1,
    epoch: int = 0,
) -> bytes:
    """Encode one frame. ``payload`` is [n, ...] of any dtype (stored as its raw bytes:
    the quantizer's output, or ``rows`` themselves for fp32); so is each ``optim[i].rows``."""
    ids = _ids_array(row_ids)
    n = int(ids.shape[0])
    pay_np = _as_row_bytes(payload, n, "payload")
    opt_np = [_as_row_bytes(o.rows, n, f"optimizer state {o.name!r}") for o in optim]
    if len(optim) > 255:
        raise ValueError("at most 255 optimizer states per frame")
    if not 0 <= chunk_index < chunk_count:
        raise ValueError(f"chunk_index {chunk_index} not in [0, chunk_count={chunk_count})")
    tail = _header_tail(run_id, table, [(o.name, o.encoding, a.shape[1]) for o, a in zip(optim, opt_np)], epoch)
    meta = _FrameMeta(checkpoint_id, rank, col_offset, dim, encoding, len(optim), chunk_count, epoch)
    return _frame_bytes(meta, tail, chunk_index, ids, pay_np, opt_np)


class _FrameMeta(NamedTuple):
    """The header fields every frame of one shard shares (`_frame_bytes`)."""

    checkpoint_id: int
    rank: int
    col_offset: int
    dim: int
    encoding: int
    n_optim: int
    chunk_count: int
    epoch: int


def _frame_bytes(
    meta: _FrameMeta, tail: bytes, chunk_index: int, ids: np.ndarray, pay_np: np.ndarray, opt_np: Sequence[np.ndarray]
) -> bytes:
    """One frame from checked parts: the header `tail` (`_header_tail`), int64 `ids` [n] and
    each section as uint8 [n, row_bytes]."""
    n = int(ids.shape[0])
    run = _is_run(ids)
    span = None if run else _bitmap_span(ids)
    ids_np = ids[:1] if run else _bitmap(ids, span) if span is not None else ids
    row_bytes = pay_np.shape[1]
    header_len = _header_len(len(tail))
    total = _frame_len(header_len, n, row_bytes, [a.shape[1] for a in opt_np], run, span)
    flags = (FLAG_ROW_RUN if run else 0) | (FLAG_EPOCH if meta.epoch else 0) | (FLAG_ROW_BITMAP if span is not None else 0)
    try:
        head = (
            _PREFIX.pack(MAGIC, VERSION, flags, header_len, total)
            + _META.pack(
                meta.checkpoint_id,
                meta.rank,
                meta.col_offset,
                n,
                meta.dim,
                row_bytes,
                chunk_index,
                meta.chunk_count,
                meta.encoding,
                meta.n_optim,
            )
            + tail
        )
    except struct.error as e:
        raise ValueError(f"frame field out of range: {e}") from None
    parts: list = [head + b"\0" * (header_len - len(head))]
    for arr in (ids_np, pay_np, *opt_np):
        mv = arr.reshape(-1).view(np.uint8).data
        parts.append(mv)
        if _pad(mv.nbytes):
            parts.append(b"\0" * _pad(mv.nbytes))
    crc = 0
    for p in parts:
        crc = crc32(p, crc)
    parts.append(_CRC.pack(crc))
    out = b"".join(parts)
    assert len(out) == total, (len(out), total)
    return out


class EncodedFrame(NamedTuple):
    """One frame of a shard as :func:`chunk_rows` (or :func:`chunk_mapping`) made it, with what
    an index of it needs."""

    data: bytes
    row_count: int  # 0 for a mapping frame
    first_row: int  # row id of the frame's first row (a mapping frame: the shard's first slot)
    last_row: int  # row id of its last row (a mapping frame: the shard's last slot)


def chunk_rows(
    *,
    run_id: str,
    checkpoint_id: int,
    rank: int,
    table: str,
    col_offset: int,
    dim: int,
    encoding: int,
    row_ids: torch.Tensor,
    payload: torch.Tensor,
    optim: Sequence[OptimState] = (),
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    epoch: int = 0,
) -> Iterator[EncodedFrame]:
    """Split one shard's rows into frames of at most ``max_frame_bytes`` each: the one
    place that decides how many rows a frame holds.

    Each frame holds as many rows as fit. Frames are produced lazily, in row order,
    numbered ``chunk_index`` 0..count-1 with the same ``chunk_count``; every row is in
    exactly one frame. No rows: no frames. Raises ``ValueError`` (at the call, before any
    frame is made) if a single row does not fit.
    """
    ids = _ids_array(row_ids)
    n = int(ids.shape[0])
    if n == 0:
        return iter(())
    if len(optim) > 255:
        raise ValueError("at most 255 optimizer states per frame")
    # each section as uint8 [n, row_bytes] once; a frame takes a slice of each
    pay_np = _as_row_bytes(payload, n, "payload")
    opt_np = [_as_row_bytes(o.rows, n, f"optimizer state {o.name!r}") for o in optim]
    row_bytes = pay_np.shape[1]
    opt_rb = [a.shape[1] for a in opt_np]
    tail = _header_tail(run_id, table, [(o.name, o.encoding, rb) for o, rb in zip(optim, opt_rb)], epoch)
    header_len = _header_len(len(tail))
    run = _is_run(ids)  # a whole run: every frame is a run too, and its ids cost 8 bytes
    # Otherwise frames are sized for 8 bytes of id a row; a frame whose ids pack smaller as a
    # bitmap (`_frame_bytes` decides) comes out that much under max_frame_bytes.
    per_row = (0 if run else 8) + row_bytes + sum(opt_rb)
    # Largest row count whose frame fits; section padding can cost a few rows less.
    rows_per_frame = max(0, (max_frame_bytes - header_len - _CRC.size - (8 if run else 0)) // max(per_row, 1))
    while rows_per_frame and _frame_len(header_len, rows_per_frame, row_bytes, opt_rb, run) > max_frame_bytes:
        rows_per_frame -= 1
    if rows_per_frame < 1:
        raise ValueError(
            f"one row of table {table!r} needs {header_len + per_row + _CRC.size} "
            f"bytes with its frame header, more than max_frame_bytes={max_frame_bytes}"
        )
    count = -(-n // rows_per_frame)
    meta = _FrameMeta(checkpoint_id, rank, col_offset, dim, encoding, len(optim), count, epoch)

    def frames() -> Iterator[EncodedFrame]:
        for i in range(count):
            start, stop = i * rows_per_frame, min(n, (i + 1) * rows_per_frame)
            part = ids[start:stop]
            data = _frame_bytes(meta, tail, i, part, pay_np[start:stop], [a[start:stop] for a in opt_np])
            yield EncodedFrame(data=data, row_count=stop - start, first_row=int(part[0]), last_row=int(part[-1]))

    return frames()


def _mapping_len(header_len: int, piece_len: int) -> int:
    """Bytes of a mapping frame holding a piece of `piece_len` bytes."""
    return header_len + piece_len + _pad(piece_len) + _CRC.size


def encode_mapping_frame(
    *,
    run_id: str,
    checkpoint_id: int,
    rank: int,
    table: str,
    piece: bytes | bytearray | memoryview,
    encoding: int,
    chunk_index: int = 0,
    chunk_count: int = 1,
    epoch: int = 0,
) -> bytes:
    """Encode one mapping frame holding `piece` (chunk `chunk_index` of `chunk_count` of a
    mapping record whose format version is `encoding`)."""
    body = memoryview(piece).cast("B")
    size = body.nbytes
    if size == 0:
        raise ValueError(f"an empty piece of the mapping record of table {table!r}")
    if not 0 <= chunk_index < chunk_count:
        raise ValueError(f"chunk_index {chunk_index} not in [0, chunk_count={chunk_count})")
    tail = _header_tail(run_id, table, [], epoch)
    header_len = _header_len(len(tail))
    total = _mapping_len(header_len, size)
    flags = FLAG_MAPPING | (FLAG_EPOCH if epoch else 0)
    try:
        head = (
            _PREFIX.pack(MAGIC, VERSION, flags, header_len, total)
            + _META.pack(checkpoint_id, rank, 0, 0, 0, size, chunk_index, chunk_count, encoding, 0)
            + tail
        )
    except struct.error as e:
        raise ValueError(f"frame field out of range: {e}") from None
    parts: list[bytes | memoryview] = [head + b"\0" * (header_len - len(head)), body, b"\0" * _pad(size)]
    crc = 0
    for p in parts:
        crc = crc32(p, crc)
    parts.append(_CRC.pack(crc))
    out = b"".join(parts)
    assert len(out) == total, (len(out), total)
    return out


def chunk_mapping(
    *,
    run_id: str,
    checkpoint_id: int,
    rank: int,
    table: str,
    record: bytes | bytearray | memoryview,
    encoding: int,
    first_row: int,
    last_row: int,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    epoch: int = 0,
) -> Iterator[EncodedFrame]:
    """Cut one shard's mapping record into mapping frames of at most ``max_frame_bytes`` each,
    lazily, numbered ``chunk_index`` 0..count-1 with the same ``chunk_count``; each piece but
    the last is as large as fits and a multiple of 8 bytes. `first_row`..`last_row` (the
    shard's slots) go to the index with every frame. Raises ``ValueError`` at the call, before
    any frame is made, for an empty record or a limit no piece fits under."""
    data = memoryview(record).cast("B")
    size = data.nbytes
    if size == 0:
        raise ValueError(f"an empty mapping record of table {table!r}")
    header_len = _header_len(len(_header_tail(run_id, table, [], epoch)))
    room = (max_frame_bytes - header_len - _CRC.size) // _ALIGN * _ALIGN
    if room < _ALIGN:
        raise ValueError(
            f"a mapping frame of table {table!r} needs {header_len + _ALIGN + _CRC.size} bytes with its header, "
            f"more than max_frame_bytes={max_frame_bytes}"
        )
    count = -(-size // room)

    def frames() -> Iterator[EncodedFrame]:
        for i in range(count):
            frame = encode_mapping_frame(
                run_id=run_id,
                checkpoint_id=checkpoint_id,
                rank=rank,
                table=table,
                piece=data[i * room : (i + 1) * room],
                encoding=encoding,
                chunk_index=i,
                chunk_count=count,
                epoch=epoch,
            )
            yield EncodedFrame(data=frame, row_count=0, first_row=first_row, last_row=last_row)

    return frames()


# --- decoding -------------------------------------------------------------------------


def _u8(mv: memoryview, offset: int, nbytes: int) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mv, dtype=torch.uint8, count=nbytes, offset=offset)


def decode_frame(buf: bytes | bytearray | memoryview, *, where: str | None = None) -> Frame:
    """Verify and decode one frame. Tensors are read-only views into ``buf`` where
    alignment allows (keep ``buf`` alive; ``clone()`` before writing to them)."""
    try:
        return _decode(memoryview(buf).cast("B"))
    except FrameError as e:
        raise (e.located(where) if where else e) from None


def _decode(mv: memoryview) -> Frame:
    """`decode_frame` without the location: checks in the order the module docstring gives."""
    flags, header_len, total = _check_prefix(mv)
    if flags & FLAG_MAPPING:
        return _decode_mapping(mv, flags, header_len, total)
    (ckpt, rank, col, n, dim, row_bytes, idx, cnt, enc, n_opt) = _META.unpack_from(mv, _PREFIX.size)
    tail = _read_header_tail(mv, header_len, n_opt, flags)
    run = bool(flags & FLAG_ROW_RUN)
    span = _bitmap_span_of(mv, header_len, n) if flags & FLAG_ROW_BITMAP else None
    expect = _frame_len(header_len, n, row_bytes, [rb for _, _, rb in tail.layout], run, span)
    if expect != total:
        raise FrameError(
            f"body length mismatch: {n} rows x {row_bytes} bytes (+ optimizer) need a {expect}-byte frame, got {total}"
        )
    if not idx < cnt:
        raise FrameError(f"chunk index {idx} not below chunk count {cnt}")
    off = header_len
    id_bytes = 8 if run else _bitmap_len(span) if span is not None else 8 * n
    row_ids, first = _row_ids(mv, off, n, run, span, id_bytes)
    off += id_bytes + _pad(id_bytes)
    payload = _u8(mv, off, n * row_bytes).view(n, row_bytes)
    off += n * row_bytes + _pad(n * row_bytes)
    optim = []
    for name, o_enc, o_rb in tail.layout:
        optim.append(OptimState(name, o_enc, _u8(mv, off, n * o_rb).view(n, o_rb)))
        off += n * o_rb + _pad(n * o_rb)
    return Frame(
        run_id=tail.run_id,
        checkpoint_id=ckpt,
        rank=rank,
        table=tail.table,
        col_offset=col,
        dim=dim,
        encoding=enc,
        row_bytes=row_bytes,
        chunk_index=idx,
        chunk_count=cnt,
        row_ids=row_ids,
        payload=payload,
        optim=tuple(optim),
        first_row=first,
        epoch=tail.epoch,
    )


def _decode_mapping(mv: memoryview, flags: int, header_len: int, total: int) -> Frame:
    """A mapping frame (FLAG_MAPPING) whose prefix checked out: no rows, no optimizer state, no
    columns; the body is its piece of a mapping record."""
    (ckpt, rank, col, n, dim, size, idx, cnt, enc, n_opt) = _META.unpack_from(mv, _PREFIX.size)
    if (col, n, dim, n_opt) != (0, 0, 0, 0):
        raise FrameError(
            f"mapping frame with column offset {col}, {n} rows, dim {dim} and {n_opt} optimizer states (all must be 0)"
        )
    tail = _read_header_tail(mv, header_len, 0, flags)
    expect = _mapping_len(header_len, size)
    if size == 0 or expect != total:
        raise FrameError(f"body length mismatch: a mapping piece of {size} bytes needs a {expect}-byte frame, got {total}")
    if not idx < cnt:
        raise FrameError(f"chunk index {idx} not below chunk count {cnt}")
    return Frame(
        run_id=tail.run_id,
        checkpoint_id=ckpt,
        rank=rank,
        table=tail.table,
        col_offset=0,
        dim=0,
        encoding=enc,
        row_bytes=size,
        chunk_index=idx,
        chunk_count=cnt,
        row_ids=torch.empty(0, dtype=torch.int64),
        payload=torch.empty((0, 0), dtype=torch.uint8),
        first_row=None,
        epoch=tail.epoch,
        mapping=mv[header_len : header_len + size].toreadonly(),
    )


def _check_prefix(mv: memoryview) -> tuple[int, int, int]:
    """(flags, header length, total length) of a frame whose magic, version, length and CRC
    hold, and whose flags and header length are possible; else ``FrameError``."""
    size = mv.nbytes
    if size >= 4 and bytes(mv[:4]) != MAGIC:
        raise FrameError(f"bad magic {bytes(mv[:4])!r}, expected {MAGIC!r}")
    if size < _PREFIX.size + _CRC.size:
        raise FrameError(f"truncated: {size} bytes, shorter than any frame")
    _, version, flags, header_len, total = _PREFIX.unpack_from(mv, 0)
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version} (this reader knows {VERSION})")
    if total != size:
        what = "truncated" if size < total else "trailing bytes"
        raise FrameError(f"{what}: frame says {total} bytes, buffer has {size}")
    (stored,) = _CRC.unpack_from(mv, size - _CRC.size)
    computed = crc32(mv[: size - _CRC.size])
    if stored != computed:
        raise FrameError(f"CRC mismatch: stored {stored:#010x}, computed {computed:#010x}")
    # The bytes are what the writer wrote; what follows catches writer bugs and forgeries.
    if flags & ~_FLAGS or flags & FLAG_ROW_RUN and flags & FLAG_ROW_BITMAP:
        raise FrameError(f"unknown flags {flags:#x}")
    if flags & FLAG_MAPPING and flags & (FLAG_ROW_RUN | FLAG_ROW_BITMAP):
        raise FrameError(f"flags {flags:#x}: a mapping frame has no row ids to be a run or a bitmap")
    if not _PREFIX.size + _META.size <= header_len <= size - _CRC.size or header_len % _ALIGN:
        raise FrameError(f"bad header length {header_len}")
    return flags, header_len, total


class _HeaderTail(NamedTuple):
    """The variable part of a frame's header, after its fixed fields."""

    run_id: str
    table: str
    layout: list[tuple[str, int, int]]  # per optimizer state: name, encoding, row bytes
    epoch: int


class _HeaderCursor:
    """Reads the header's variable fields in order, refusing any that runs past the header."""

    def __init__(self, mv: memoryview, header_len: int) -> None:
        self.mv = mv
        self.header_len = header_len
        self.pos = _PREFIX.size + _META.size

    def unpack(self, field: struct.Struct, what: str) -> tuple:
        """The next fixed-size field; `what` names it in the error."""
        if self.pos + field.size > self.header_len:
            raise FrameError(f"header too short for {what}")
        values = field.unpack_from(self.mv, self.pos)
        self.pos += field.size
        return values

    def string(self, what: str) -> str:
        """The next string (u16 length + utf-8)."""
        (ln,) = self.unpack(_STR_LEN, what)
        if self.pos + ln > self.header_len:
            raise FrameError(f"{what} runs past the header")
        try:
            s = bytes(self.mv[self.pos : self.pos + ln]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise FrameError(f"{what} is not utf-8: {e}") from None
        self.pos += ln
        return s


def _read_header_tail(mv: memoryview, header_len: int, n_opt: int, flags: int) -> _HeaderTail:
    """Run id, table name, optimizer layout and epoch; the header must hold exactly these."""
    cursor = _HeaderCursor(mv, header_len)
    run_id = cursor.string("run id")
    table = cursor.string("table name")
    layout = []
    for i in range(n_opt):
        name = cursor.string(f"optimizer state {i} name")
        o_enc, o_rb = cursor.unpack(_OPT, f"optimizer state {name!r}")
        layout.append((name, o_enc, o_rb))
    epoch = 0
    if flags & FLAG_EPOCH:
        (epoch,) = cursor.unpack(_EPOCH, "the epoch")
        if not epoch:
            raise FrameError("epoch flag set with epoch 0")
    if _header_len(cursor.pos - _PREFIX.size - _META.size) != header_len:
        raise FrameError(f"header length {header_len} does not match its fields ({cursor.pos} bytes)")
    return _HeaderTail(run_id, table, layout, epoch)


def _bitmap_span_of(mv: memoryview, header_len: int, n: int) -> int:
    """The span of the row bitmap after the header, checked against the frame's `n` rows: a
    bitmap is written only when smaller than 8 bytes a row."""
    if header_len + _BITMAP_HEAD.size > mv.nbytes - _CRC.size:
        raise FrameError("frame too short for its row bitmap")
    first, span = _BITMAP_HEAD.unpack_from(mv, header_len)
    bitmap_bytes = _bitmap_len(span)
    if span < n or bitmap_bytes + _pad(bitmap_bytes) >= 8 * n or not 0 <= first <= 2**63 - 1 - span:
        raise FrameError(f"row bitmap of {span} rows from row {first} for {n} rows")
    return span


def _row_ids(mv: memoryview, off: int, n: int, run: bool, span: int | None, id_bytes: int) -> tuple[torch.Tensor, int | None]:
    """(row ids, first row when they are a run) from the ids section at `off`: a bitmap, a
    run's first id, or one int64 a row."""
    if span is not None:
        return _bitmap_rows(mv, off, n, span), None
    ids = _u8(mv, off, id_bytes)
    if ids.data_ptr() % 8:
        ids = ids.clone()  # buffer base not 8-aligned (a slice of a larger buffer)
    row_ids = ids.view(torch.int64)
    if not run:
        return row_ids, None
    first = int(row_ids[0])
    return torch.arange(first, first + n, dtype=torch.int64), first


def _bitmap_rows(mv: memoryview, off: int, n: int, span: int) -> torch.Tensor:
    """The row ids a FLAG_ROW_BITMAP section at `off` names: exactly `n`, the last at first + span - 1."""
    first, _ = _BITMAP_HEAD.unpack_from(mv, off)
    packed = np.frombuffer(mv, dtype=np.uint8, count=(span + 7) // 8, offset=off + _BITMAP_HEAD.size)
    offsets = np.flatnonzero(np.unpackbits(packed, count=span, bitorder="little"))
    if offsets.size != n or offsets[-1] != span - 1:
        raise FrameError(
            f"row bitmap names {offsets.size} rows (last {first + int(offsets[-1]) if offsets.size else None}), "
            f"the frame has {n} ending at row {first + span - 1}"
        )
    return torch.from_numpy(offsets).add_(first)
