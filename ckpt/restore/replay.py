"""Restore: the newest COMMIT marker's chain, replayed into the *current* shards.

Each rank reads only the shard segments (from the marker's frame index) that overlap its
own shards, exactly the offset ranges the marker lists, verifies every frame's run id,
checkpoint id, rank and CRC, dequantizes, and writes the rows into its live shard views,
whatever the world size or sharding plan. Rows are addressed by (table, global row,
column), never by rank-local index (invariant 3).

Every link of the chain is fetched at once (`FrameSource.read_ranges`: one Kafka consumer
for all partitions, decoding while the next frames arrive), so frames come in any order
across links. The last write still wins by chain position: a row is written only by the
newest link that holds it, and the older copies are skipped before they are decoded
(`_Replay`). Rows of a contiguous run are copied straight into the shard's slice. A frame of
the shard's columns in the common codecs is chosen and decoded row by row by a compiled kernel
(ckpt/restore/kernel.py), which writes the same bits: on CPU shards straight into the shard, on
GPU shards into pinned staging buffers copied to the device while the next frame decodes
(ckpt/restore/staging.py).

A chain whose marker names a row initialisation (`Marker.init`, sharding/row_init.py) holds
only the rows trained since the model was initialised: every other row of the shards is
regenerated from it bit-exactly (weights; optimizer state zero), unless the caller says the
shards already hold exactly those values (a model just initialised with the same
`RowInit`, as the trainer's is).

The shards of managed-collision tables also restore their id mappings (raw id -> slot): the
mapping frames of this rank's shards are read with the rows and folded in chain order after
the stream (ckpt/restore/mapping.py) into `RowsRestored.mapping`; the caller loads them. On
another world size than the chain's writers' a managed-collision table's ids move to other
ranks and slots: its mapping frames (every old shard's) are read first, on their own, to learn
this rank's new state and slot moves; its rows are then read where the moved ids' old slots
were written, whichever rank wrote them, and each goes to its new slot (`_MovedRows`). Its other
rows are free slots, drawn anew when an id is admitted, so they need no row.

Row-wise optimizer state (one value per row) under column-wise sharding is one value
per row per column shard; restoring into a different column split takes the value of
the source shard that holds the target shard's first column (exact when the splits
match, the same trade-off DCP makes).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ckpt.faults import maybe_die, maybe_hold_restore
from ckpt.log.chain_reads import chain_runs, wanted_runs
from ckpt.log.markers import ChainLink, IndexEntry, Marker, OffsetRange
from ckpt.quant import get_codec
from ckpt.quant.base import check_encoded, view_bytes_as
from ckpt.restore import kernel as restore_kernel
from ckpt.restore.kernel import FusedReplay
from ckpt.restore.mapping import MappingReplay, Moved
from ckpt.restore.staging import StagedReplay, staged_for, to_device
from ckpt.stream.frames import Frame, FrameError
from ckpt.stream.sink import FrameSource
from ckpt.types import RestoreError
from sharding.managed_collision import McShard, McState
from sharding.row_init import RowInit, fill_rows, initialise_shards
from sharding.shard_views import ShardMap, ShardView

logger = logging.getLogger(__name__)


@dataclass
class RowsRestored:
    """What this rank's restore read and wrote, and where its time went; the checkpointer sums it
    over ranks for its report."""

    frames: int = 0
    rows: int = 0  # rows of the chain's frames that fall in this rank's shards
    written: int = 0  # of those, rows written: the others hold values a later link replaces
    bytes: int = 0
    seconds: float = 0.0
    fetch_s: float = 0.0  # issuing the reads, then waiting for each next frame: reading, the CRC check
    decode_s: float = 0.0  # dequantizing the rows written (by the kernel: straight into the shards)
    apply_s: float = 0.0  # choosing the rows and copying them into the shards (or queueing the copies)
    staged: int = 0  # frame writes into device shards through staging buffers (ckpt/restore/staging.py)
    copy_wait_s: float = 0.0  # of apply_s, the host waiting for those copies: a staging buffer's, the last ones
    regenerated: int = 0  # rows no link holds, set to their initial values (sharding/row_init.py)
    init_s: float = 0.0  # regenerating them
    read_ahead: int = 0  # 1: the frames' read was started ahead, while the model was built (frames_ahead.py)
    held: list[torch.Tensor] | None = None  # per shard (shard order): bool mask of the rows the chain holds
    link_of: list[torch.Tensor] | None = (
        None  # per shard: int32, the newest chain link that wrote any column of each row (-1: none)
    )
    # per managed-collision shard of this rank (by table key): its id mapping after the chain
    # (ckpt/restore/mapping.py); empty when the restore was given none
    mapping: dict[str, McState] = field(default_factory=dict)
    # the managed-collision tables whose ids and rows moved from the chain's world size to this one
    resharded: list[str] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)  # of those, ids this rank's shard had no room for


def row_init_of(marker: Marker) -> RowInit | None:
    """How the rows the marker's chain leaves out were initialised (None: it stores every row)."""
    try:
        return RowInit.from_json(marker.init)
    except ValueError as exc:
        raise RestoreError(f"checkpoint {marker.checkpoint_id}: {exc}") from None


def _in_ranges(pos: int, ranges: list[OffsetRange]) -> bool:
    return any(r.first <= pos <= r.last for r in ranges)


def frame_overlaps(s: ShardView, col_offset: int, cols: int, min_row: int, max_row: int) -> bool:
    """Whether rows min_row..max_row, columns col_offset..col_offset+cols-1 meet shard `s`."""
    rows_ok = min_row < s.row_offset + s.num_rows and max_row >= s.row_offset
    cols_ok = col_offset < s.col_offset + s.num_cols and col_offset + cols > s.col_offset
    return rows_ok and cols_ok


def iter_chain_frames(
    marker: Marker,
    source: FrameSource,
    run_id: str,
    locate: Callable[[int, int, int], str],
    want: Callable[[IndexEntry], bool] = lambda entry: True,
) -> Iterator[tuple[ChainLink, Frame]]:
    """Every verified frame of the marker's chain, base first (see `iter_link_frames`)."""
    _check_base(marker)
    for link in marker.chain:
        for frame in iter_link_frames(link, source, run_id, locate, want):
            yield link, frame


def iter_link_frames(
    link: ChainLink,
    source: FrameSource,
    run_id: str,
    locate: Callable[[int, int, int], str],
    want: Callable[[IndexEntry], bool] = lambda entry: True,
) -> Iterator[Frame]:
    """Every verified frame of one chain link, reading only the shard segments (index
    entries) `want` accepts, and only positions inside the link's ranges. Consecutive
    wanted segments of a partition are read with one `read_range`, so a rank that needs a
    whole partition opens it once."""
    for partition, run in wanted_runs(link, want):
        firsts = [entry.first for entry in run]
        chunks = ChunkPlace()
        for pos, frame in source.read_range(link.generation, partition, run[0].first, run[-1].last):
            if frame_of_link(link, partition, run, firsts, pos, frame, run_id, locate, chunks):
                yield frame


def iter_chain_frames_fetched_together(
    marker: Marker,
    source: FrameSource,
    run_id: str,
    locate: Callable[[int, int, int], str],
    want: Callable[[IndexEntry], bool] = lambda entry: True,
) -> Iterator[tuple[int, ChainLink, Frame]]:
    """``(link index in the chain, link, frame)`` for every verified frame of the chain, as
    `iter_chain_frames` reads them, but with one `read_ranges` for the whole chain, issued
    when this is called, reads given newest link first: frames arrive in position order
    within a segment run and in any order across runs. Files serve the runs in that order;
    Kafka serves a partition's runs in offset order (consecutive links are one sequential
    read there)."""
    _check_base(marker)
    chain = chain_runs(marker, want)
    runs = [(r.link_index, r.link, r.partition, r.entries, [e.first for e in r.entries], ChunkPlace()) for r in chain]
    return _verified(source.read_ranges([r.read() for r in chain]), runs, run_id, locate)


def _verified(
    frames: Iterator[tuple[int, int, Frame]],
    runs: list[tuple[int, ChainLink, int, list[IndexEntry], list[int], ChunkPlace]],
    run_id: str,
    locate: Callable[[int, int, int], str],
) -> Iterator[tuple[int, ChainLink, Frame]]:
    for r, pos, frame in frames:
        i, link, partition, run, firsts, chunks = runs[r]
        if frame_of_link(link, partition, run, firsts, pos, frame, run_id, locate, chunks):
            yield i, link, frame


def _check_base(marker: Marker) -> None:
    if not marker.chain or not marker.chain[0].full:
        raise RestoreError(f"checkpoint {marker.checkpoint_id}: its chain does not start with a full checkpoint")


class ChunkPlace:
    """Where one range read is in the chunk sequences of its index entries (see `_check_chunk`)."""

    def __init__(self) -> None:
        self.entry = -1  # first position of the entry of the previous frame read; -1: none yet
        self.index = 0  # that frame's chunk index ...
        self.count = 0  # ... and chunk count


def _check_chunk(entry: IndexEntry, pos: int, frame: Frame, chunks: ChunkPlace, where: str) -> None:
    """The frames of an index entry must be whole chunk sequences (0..count-1, as
    `chunk_rows` numbers one shard's frames), in order, ending with a last chunk at the
    entry's last position. A duplicated frame inside the range keeps every other check
    happy when the frames are of one size (table, checkpoint id, rank all match, and the
    range end lands on a record start), but the restore would write that frame's rows twice
    and skip the frame the range end now falls short of: refused here, where it is."""
    index, count = frame.chunk_index, frame.chunk_count
    follows = pos != entry.first and chunks.entry == entry.first and chunks.index + 1 < chunks.count
    expected = (chunks.index + 1, chunks.count) if follows else (0, count)  # the next chunk, or a new sequence
    if (index, count) != expected:
        want = f"chunk {expected[0]} of {expected[1]}" if follows else "chunk 0"
        raise FrameError(
            f"frame is chunk {index} of {count} of shard {frame.table}@{frame.col_offset}, expected {want}: "
            "a frame duplicated, missing or out of order in the range its COMMIT marker names",
            where,
        )
    if pos == entry.last and index != count - 1:
        raise FrameError(
            f"frame is chunk {index} of {count} of shard {frame.table}@{frame.col_offset}, but the COMMIT "
            "marker's index ends the shard here: a frame duplicated or missing in the range it names",
            where,
        )
    chunks.entry, chunks.index, chunks.count = entry.first, index, count


def frame_of_link(
    link: ChainLink,
    partition: int,
    run: list[IndexEntry],
    firsts: list[int],
    pos: int,
    frame: Frame,
    run_id: str,
    locate: Callable[[int, int, int], str],
    chunks: ChunkPlace,
) -> bool:
    """Whether the frame at `pos` of a run of index entries (`firsts`: their first positions)
    is one of the link's (False: a frame of an earlier failed flush that landed in between);
    raises if it is not what the marker's index says is there. `chunks`: the read's place in
    its entries' chunk sequences (the frames of one read, in position order)."""
    if not _in_ranges(pos, link.ranges.get(partition, [])):
        return False
    entry = run[bisect.bisect_right(firsts, pos) - 1]
    if not entry.first <= pos <= entry.last:
        raise FrameError("frame outside every indexed segment of its COMMIT marker", locate(link.generation, partition, pos))
    where = locate(link.generation, partition, pos)
    verify_frame(frame, link, partition, entry.table, entry.col_offset, run_id, where)
    if frame.is_mapping != entry.is_mapping:
        held, indexed = ("a piece of an id mapping", "rows") if frame.is_mapping else ("rows", "an id mapping")
        raise FrameError(f"frame holds {held} of table {frame.table}, where its COMMIT marker's index has {indexed}", where)
    _check_chunk(entry, pos, frame, chunks, where)
    return True


Rows = slice | torch.Tensor  # rows of a frame or of a shard: a contiguous slice, or indices


def decode_rows(frame: Frame, rows: Rows = slice(None), *, copy: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dequantized weights [n, dim] and optimizer states [n, dim or 1] of the frame's `rows`
    (all of them by default); only those rows are decoded. `copy=False`: fp32 rows may come
    back as read-only views of the frame's bytes, for a caller that only copies from them."""
    weights = _decode(frame.encoding, frame.payload[rows], frame.dim, copy)
    optim = {}
    for o in frame.optim:
        oc = get_codec(o.encoding)
        width = frame.dim if oc.row_bytes(frame.dim) == o.rows.shape[1] else 1
        if oc.row_bytes(width) != o.rows.shape[1]:
            raise RestoreError(f"table {frame.table}: optimizer state {o.name} has rows of an unknown width")
        optim[o.name] = _decode(o.encoding, o.rows[rows], width, copy)
    return weights, optim


def _decode(encoding: int, data: torch.Tensor, width: int, copy: bool) -> torch.Tensor:
    codec = get_codec(encoding)
    if codec.name == "fp32" and not copy:
        check_encoded(data, codec.row_bytes(width), codec.name)
        return view_bytes_as(data, torch.float32)
    return codec.decode(data, width)


class _Span(NamedTuple):
    """Rows of one frame that fall in one shard: their positions in the frame (`src`) and
    the shard's local rows (`dst`), slices where the rows are contiguous."""

    src: Rows
    dst: Rows
    rows: int  # how many


def _span(frame: Frame, s: ShardView) -> _Span | None:
    n = frame.row_count
    if frame.first_row is not None:  # a run of rows: no index arithmetic at all
        lo = max(frame.first_row, s.row_offset)
        hi = min(frame.first_row + n, s.row_offset + s.num_rows)
        if lo >= hi:
            return None
        return _Span(slice(lo - frame.first_row, hi - frame.first_row), slice(lo - s.row_offset, hi - s.row_offset), hi - lo)
    local = frame.row_ids - s.row_offset
    inside = (local >= 0) & (local < s.num_rows)
    if bool(inside.all()):
        return _Span(slice(0, n), local, n)
    pos = inside.nonzero().flatten()
    return _Span(pos, local[pos], pos.numel()) if pos.numel() else None


def _indices(rows: Rows) -> torch.Tensor:
    return torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows


def _newer(span: _Span, written: torch.Tensor, link: int) -> _Span | None:
    """The part of `span` whose shard rows no later link than `link` has written."""
    keep = written[span.dst] < link
    if bool(keep.all()):
        return span
    at = keep.nonzero().flatten()
    return _Span(_indices(span.src)[at], _indices(span.dst)[at], at.numel()) if at.numel() else None


class _MovedRows:
    """The rows of one managed-collision shard whose ids moved here from another world size
    (ckpt/restore/mapping.py `Moved`): each kept id's row and optimizer state come from its old
    global slot, the miss row from the old miss slot `rebucket` names, wherever a link wrote
    them; the newest link holding an old slot wins, as for any row. The shard's other rows are
    free slots: no id reads them before an admission draws them anew."""

    def __init__(self, shard: ShardView, moved: Moved) -> None:
        m = moved.moves
        src = np.concatenate([m.old_slots, [m.miss_old_slot]]).astype(np.int64)
        dst = np.concatenate([m.new_slots, [m.miss_new_slot]]).astype(np.int64) - shard.row_offset
        order = np.argsort(src, kind="stable")
        self.shard = shard
        self.src = src[order]  # the old global slots, ascending
        self.dst = dst[order]  # the local row of the new shard each goes to
        if np.any(self.src[1:] == self.src[:-1]) or np.any((self.dst < 0) | (self.dst >= shard.num_rows)):
            raise RestoreError(f"table {shard.table}: the slot moves of its id mapping are not one row to one slot")
        self.written = np.full(src.size, -1, dtype=np.int32)  # the link each moved row was taken from

    def wants(self, entry: IndexEntry) -> bool:
        """Whether a rows entry holds an old slot this shard takes a row from."""
        s = self.shard
        if entry.is_mapping or entry.table != s.table:
            return False
        if not (entry.col_offset < s.col_offset + s.num_cols and entry.col_offset + entry.cols > s.col_offset):
            return False
        i = int(np.searchsorted(self.src, entry.min_row))
        return i < self.src.size and int(self.src[i]) <= entry.max_row

    def span(self, frame: Frame, link_index: int) -> tuple[int, _Span | None]:
        """How many of the frame's rows are old slots this shard takes, and those no later link
        than `link_index` has given: frame rows -> local rows of the new shard."""
        s = self.shard
        if (frame.col_offset, frame.dim) != (s.col_offset, s.num_cols):
            raise RestoreError(
                f"table {s.table}: a frame of columns {frame.col_offset}..{frame.col_offset + frame.dim - 1} of a "
                f"managed-collision table moving to another world size, whose shards here hold columns "
                f"{s.col_offset}..{s.col_offset + s.num_cols - 1}: its rows move whole only"
            )
        n = frame.row_count
        rows = np.arange(frame.first_row, frame.first_row + n) if frame.first_row is not None else frame.row_ids.numpy()
        pos = np.searchsorted(self.src, rows)
        hit = pos < self.src.size
        hit[hit] = self.src[pos[hit]] == rows[hit]
        at = np.flatnonzero(hit)
        k = pos[at]
        newer = self.written[k] < link_index
        at, k = at[newer], k[newer]
        if not at.size:
            return int(hit.sum()), None
        self.written[k] = link_index
        return int(hit.sum()), _Span(torch.from_numpy(at.astype(np.int64)), torch.from_numpy(self.dst[k].copy()), int(at.size))

    @torch.no_grad()
    def finish(self, marker: Marker, init: RowInit | None) -> int:
        """Every moved row found in the chain, or (a chain with a row initialisation, which leaves
        out rows never trained) drawn from its old slot's initial value with its optimizer state
        zero; returns the rows so drawn. Sets `written` for them to the base."""
        s = self.shard
        missing = np.flatnonzero(self.written < 0)
        if not missing.size:
            return 0
        if init is None or s.table not in marker.tables:
            raise RestoreError(
                f"checkpoint {marker.checkpoint_id}: table {s.table}: {missing.size} rows of ids moving to this rank's "
                f"shard (first: old slot {int(self.src[missing[0]])}) are in no link of the chain"
            )
        rows, dim = (int(x) for x in marker.tables[s.table])
        for k in missing:
            value = torch.empty(1, s.num_cols, dtype=s.weight.dtype)
            fill_rows(init, s.table, rows, dim, value, int(self.src[k]), s.col_offset)
            at = int(self.dst[k])
            s.weight[at : at + 1].copy_(value.to(s.weight.device))
            for state in s.optimizer_states.values():
                state[at : at + 1].zero_()
        self.written[missing] = 0
        return int(missing.size)

    def link_of(self) -> torch.Tensor:
        """Per local row: the link its row came from (-1: a free slot, no row)."""
        out = torch.full((self.shard.num_rows,), -1, dtype=torch.int32)
        out[torch.from_numpy(self.dst)] = torch.from_numpy(self.written)
        return out


class _Replay:
    """Writes a chain's frames into this rank's shards in whatever order they arrive.

    Last write wins by chain position, not by arrival: for each local row, `written` holds
    the newest link that wrote all of the shard's columns, and a frame writes only rows no
    later link has, so the rows a later link replaces are neither decoded nor copied. A
    frame that covers only some of a shard's columns (restoring into another column split)
    waits, and is applied after the stream in chain order under the same rule.

    While the stream lasts only whole-width frames write, so the newest link that wrote any
    column of a row is `written` itself; `finish` starts `link_of` from it. A row the chain
    holds is one some link wrote: every row of a frame is written by it or by a later link.

    Mapping frames (the id mappings of managed-collision shards) hold no rows: they go to
    `mapping`, which folds them after the stream (ckpt/restore/mapping.py). The rows of a
    managed-collision table moving to another world size go to its `moved` shard instead, each
    old slot's newest copy to the new slot its id took (`_MovedRows`).
    """

    def __init__(
        self,
        marker: Marker,
        shard_map: ShardMap,
        out: RowsRestored,
        fused: FusedReplay | None = None,
        staged: StagedReplay | None = None,
        mapping: MappingReplay | None = None,
        moved: dict[str, _MovedRows] | None = None,
    ) -> None:
        self.marker = marker
        self.mapping = mapping
        self.moved = moved or {}  # managed-collision tables whose rows move (not in `shard_map`)
        self.shard_map = shard_map
        self.out = out
        self.init = row_init_of(marker)
        self.written = {id(s): torch.full((s.num_rows,), -1, dtype=torch.int32) for s in shard_map.shards}
        # columns of each local row the base wrote: a base holds every (row, column) exactly
        # once, so a complete base leaves exactly num_cols per row (not a row x column mask)
        self.covered = {id(s): torch.zeros(s.num_rows, dtype=torch.int32) for s in shard_map.shards}
        self.partial: list[tuple[int, Frame, ShardView, _Span, int, int]] = []  # + columns c0..c1
        self.fused = fused  # the kernel's path for the frames it fits (ckpt/restore/kernel.py) ...
        self.staged = staged  # ... into shards on a device: through staging buffers (ckpt/restore/staging.py)
        self.kernels = [k for k in (staged, fused) if k is not None]
        self._closed = False  # whether the staged writes are done (`close`)

    @torch.no_grad()
    def add(self, link_index: int, link: ChainLink, frame: Frame) -> None:
        t0 = time.perf_counter()
        decode_s = 0.0
        self.out.frames += 1
        if frame.mapping is not None:
            if self.mapping is None:
                raise RestoreError(
                    f"checkpoint {link.checkpoint_id}: a mapping frame of table {frame.table}, which this restore did not ask for"
                )
            self.out.bytes += len(frame.mapping)
            self.mapping.add(link_index, link, frame.rank, frame)
            self.out.apply_s += time.perf_counter() - t0
            return
        self.out.bytes += frame.payload.numel() + frame.row_ids.numel() * 8 + sum(o.rows.numel() for o in frame.optim)
        moving = self.moved.get(frame.table)
        if moving is not None:
            inside, span = moving.span(frame, link_index)
            self.out.rows += inside
            if span is not None:
                s = moving.shard
                decode_s += self._write(frame, s, span, s.col_offset, s.col_offset + s.num_cols)
        for s in self.shard_map.of_table(frame.table):
            if not (frame.col_offset < s.col_offset + s.num_cols and frame.col_offset + frame.dim > s.col_offset):
                continue
            kernel = next((k for k in self.kernels if k.fits(frame, s)), None)
            if kernel is not None:
                done = kernel.write(
                    frame, s, link_index, self.written[id(s)].numpy(), self.covered[id(s)].numpy(), s.num_cols if link.full else 0
                )
                self.out.rows += done.inside
                self.out.written += done.kept
                self.out.staged += int(kernel is self.staged and done.kept > 0)
                self.out.copy_wait_s += done.wait_s
                decode_s += done.decode_s
                continue
            span = _span(frame, s)
            if span is None:
                continue
            c0, c1 = max(frame.col_offset, s.col_offset), min(frame.col_offset + frame.dim, s.col_offset + s.num_cols)
            self.out.rows += span.rows
            if link.full:
                _count(self.covered[id(s)], span.dst, c1 - c0)
            if (c0, c1) != (s.col_offset, s.col_offset + s.num_cols):
                self.partial.append((link_index, frame, s, span, c0, c1))
                continue
            fresh = _newer(span, self.written[id(s)], link_index)
            if fresh is not None:
                self.written[id(s)][fresh.dst] = link_index
                decode_s += self._write(frame, s, fresh, c0, c1)
        self.out.decode_s += decode_s
        self.out.apply_s += time.perf_counter() - t0 - decode_s

    @torch.no_grad()
    def finish(self, fill: bool) -> None:
        """Apply the frames that covered part of a shard's columns, check the base, and
        (`fill`) regenerate the rows no link holds."""
        t0 = time.perf_counter()
        decode_s = 0.0
        self.close()  # the staged writes land before the torch path's and the regenerated rows
        link_of = {key: written.clone() for key, written in self.written.items()}  # any column
        for link_index, frame, s, span, c0, c1 in sorted(self.partial, key=lambda p: p[0]):
            fresh = _newer(span, self.written[id(s)], link_index)
            if fresh is not None:
                newest = link_of[id(s)]
                newest[fresh.dst] = newest[fresh.dst].clamp_min(link_index)
                decode_s += self._write(frame, s, fresh, c0, c1)
        self.out.decode_s += decode_s
        self.out.apply_s += time.perf_counter() - t0 - decode_s
        for s in self.shard_map.shards:
            covered = self.covered[id(s)]
            wrong = covered != s.num_cols
            if self.init is not None:  # a base holds the rows trained so far, each exactly once
                wrong &= covered != 0
            if bool(wrong.any()):
                first = s.row_offset + int(wrong.nonzero()[0])
                raise RestoreError(
                    f"checkpoint {self.marker.checkpoint_id}: table {s.table} "
                    f"rows {s.row_offset}..{s.row_offset + s.num_rows - 1} cols {s.col_offset}..{s.col_offset + s.num_cols - 1}: "
                    f"{int(wrong.sum())} rows (first: row {first}) are "
                    f"not covered exactly once by the base checkpoint {self.marker.chain[0].checkpoint_id}"
                )
        self.out.link_of = [link_of[id(s)] for s in self.shard_map.shards]
        self.out.held = [newest >= 0 for newest in self.out.link_of]
        unknown = sorted({s.table for s in self.shard_map.shards} - set(self.marker.tables))
        if self.init is not None and unknown:
            raise RestoreError(
                f"checkpoint {self.marker.checkpoint_id} has no table {unknown[0]!r}; it holds {sorted(self.marker.tables)}"
            )
        if self.init is not None and fill:
            t = time.perf_counter()
            tables = {name: (rows, dim) for name, (rows, dim) in self.marker.tables.items()}
            masks = {id(s): ~held for s, held in zip(self.shard_map.shards, self.out.held)}
            self.out.regenerated = initialise_shards(self.init, self.shard_map.shards, tables, masks)
            self.out.init_s = time.perf_counter() - t

    def close(self) -> None:
        """Every staged write done (also when the restore fails: the next try writes the same
        shards, and no copy of this one may land after its writes)."""
        if self.staged is not None and not self._closed:
            self.out.copy_wait_s += self.staged.finish()
        self._closed = True

    def _write(self, frame: Frame, s: ShardView, span: _Span, c0: int, c1: int) -> float:
        """Decode the span's rows and copy columns c0..c1 of them into shard `s`; returns the
        seconds spent decoding."""
        t = time.perf_counter()
        weights, optim = decode_rows(frame, span.src, copy=False)
        decode_s = time.perf_counter() - t
        if self.staged is not None and s.weight.device == self.staged.device:
            self.staged.join()  # after the staged writes queued so far, as the links' order needs
        _put(s.weight, span.dst, weights, c0 - s.col_offset, c0 - frame.col_offset, c1 - c0)
        for name, state in s.optimizer_states.items():
            if name not in optim:
                raise RestoreError(
                    f"table {s.table}: optimizer state {name!r} is not in the checkpoint (it has {sorted(optim)}); "
                    "was it written with another optimizer?"
                )
            src = optim[name]
            if state.dim() == 1:
                if frame.col_offset <= s.col_offset < frame.col_offset + frame.dim:
                    col = src[:, 0] if src.shape[1] == 1 else src[:, s.col_offset - frame.col_offset]
                    _put(state.unsqueeze(1), span.dst, col.unsqueeze(1), 0, 0, 1)
            else:
                _put(state, span.dst, src, c0 - s.col_offset, c0 - frame.col_offset, c1 - c0)
        self.out.written += span.rows
        return decode_s


def _count(counts: torch.Tensor, rows: Rows, cols: int) -> None:
    if isinstance(rows, slice):
        counts[rows] += cols
    else:
        counts.index_add_(0, rows, torch.full((rows.numel(),), cols, dtype=counts.dtype))


def restore_rows(
    marker: Marker,
    source: FrameSource,
    shard_map: ShardMap,
    run_id: str,
    locate: Callable[[int, int, int], str],
    *,
    shards_hold_init: RowInit | None = None,
    while_fetching: Callable[[], object] | None = None,
    fused: bool = True,
    staging: StagedReplay | None = None,
    mc_shards: Sequence[McShard] = (),
    world_size: int | None = None,
) -> RowsRestored:
    """Replay the marker's chain into this rank's shards (every link fetched at once, rows
    of older links that a later one replaces skipped); verify the base covered them, and
    regenerate the rows the chain leaves out from its row initialisation unless
    `shards_hold_init` says the shards hold exactly those initial values already.
    `while_fetching` is called once the reads are issued, before the first frame is waited
    for: work to start while the first fetch is in flight, not before it (the dense state's
    read: docs/design/restore.md). `fused`: the frames the kernel fits are written by it
    (ckpt/restore/kernel.py, when numba is installed), into shards on a GPU through
    `staging` (default: a `StagedReplay` for their device; a test passes one over a host
    queue to take that path into CPU shards); False: every frame takes the torch path, the
    reference. `mc_shards`: this rank's managed-collision shards, whose id mappings the chain's
    mapping frames restore into `RowsRestored.mapping` (ckpt/restore/mapping.py; none: the
    mapping frames are not read). `world_size`: this job's (default: the chain's); on another,
    the managed-collision tables' ids and rows move to it (`RowsRestored.resharded`)."""
    t0 = time.perf_counter()
    out = RowsRestored()
    kernel = restore_kernel.load() if fused else None
    direct = FusedReplay(kernel) if kernel is not None else None
    if staging is None and direct is not None:
        staging = staged_for(shard_map.shards, direct)
    mapping = MappingReplay(mc_shards, marker, world_size) if mc_shards else None
    moved: dict[str, _MovedRows] = {}
    if mapping is not None and mapping.resharded:
        # the moving tables' mappings first, on their own: they say which rows to read
        t = time.perf_counter()
        early = _Replay(marker, ShardMap([], []), out, mapping=mapping)
        for i, link, frame in iter_chain_frames_fetched_together(marker, source, run_id, locate, mapping.wants_moved):
            early.add(i, link, frame)
        news = mapping.finish_moved(marker.chain)
        by_table = {m.key: m.rows for m in mc_shards}
        moved = {table: _MovedRows(by_table[table], news[table]) for table in sorted(news)}
        out.mapping.update({table: news[table].state for table in sorted(news)})
        out.resharded = sorted(news)
        out.dropped = {table: int(news[table].moves.dropped_raw_ids.size) for table in sorted(news)}
        out.fetch_s += time.perf_counter() - t
        kept = [s for s in shard_map.shards if s.table not in moved]
        rows_map = ShardMap(kept, shard_map.replicated_tables, shard_map.table_info, shard_map.modules)
    else:
        rows_map = shard_map
    replay = _Replay(marker, rows_map, out, direct, staging, mapping, moved)

    def want(e: IndexEntry) -> bool:
        if e.is_mapping:  # no columns: `frame_overlaps` is False for it
            return mapping is not None and mapping.wants(e)
        if e.table in moved:
            return moved[e.table].wants(e)
        return any(frame_overlaps(s, e.col_offset, e.cols, e.min_row, e.max_row) for s in shard_map.of_table(e.table))

    taken_over = source.reads_ahead_used
    t = time.perf_counter()  # issuing the reads, or taking over those read ahead (their thread stops)
    frames = iter_chain_frames_fetched_together(marker, source, run_id, locate, want)
    out.fetch_s += time.perf_counter() - t
    out.read_ahead = int(source.reads_ahead_used > taken_over)
    if while_fetching is not None:
        while_fetching()
    try:
        while True:
            t = time.perf_counter()
            item = next(frames, None)
            out.fetch_s += time.perf_counter() - t
            if item is None:
                break
            replay.add(*item)
            if out.frames == 1:  # crash points: the shards hold part of the chain (ckpt/faults.py)
                rank = dist.get_rank() if dist.is_initialized() else 0
                maybe_hold_restore(marker.checkpoint_id, rank)
                maybe_die("restore", marker.checkpoint_id, rank)
        if mapping is not None:
            t = time.perf_counter()
            out.mapping = {**mapping.finish(marker.chain), **out.mapping}
            out.apply_s += time.perf_counter() - t
        replay.finish(fill=replay.init is not None and replay.init != shards_hold_init)
        if moved:
            out.regenerated += sum(m.finish(marker, replay.init) for m in moved.values())
            _splice_moved(shard_map, out, rows_map, moved)
    finally:
        replay.close()
    out.seconds = time.perf_counter() - t0
    return out


def _splice_moved(shard_map: ShardMap, out: RowsRestored, rows_map: ShardMap, moved: dict[str, _MovedRows]) -> None:
    """`RowsRestored.held` and `link_of` over every shard of `shard_map`, in its order: the
    replay's for the shards it wrote, the moved rows' for the moving tables' shards."""
    assert out.link_of is not None
    replayed = {id(s): link for s, link in zip(rows_map.shards, out.link_of)}
    link_of = [replayed[id(s)] if id(s) in replayed else moved[s.table].link_of() for s in shard_map.shards]
    out.link_of = link_of
    out.held = [link >= 0 for link in link_of]


def verify_frame(frame: Frame, link: ChainLink, partition: int, table: str, col: int, run_id: str, where: str) -> None:
    """A frame must be exactly what the marker says is at its position (invariant 4)."""
    problems = []
    if frame.run_id != run_id:
        problems.append(f"run id {frame.run_id!r} != {run_id!r}")
    if frame.checkpoint_id != link.checkpoint_id:
        problems.append(f"checkpoint id {frame.checkpoint_id} != {link.checkpoint_id}")
    if frame.epoch != link.epoch:  # a frame of another trainer attempt (ckpt/log/fencing.py)
        problems.append(f"attempt epoch {frame.epoch} != {link.epoch}")
    if frame.rank != partition:
        problems.append(f"rank {frame.rank} != partition {partition}")
    if frame.table != table or frame.col_offset != col:
        problems.append(f"shard {frame.table}@{frame.col_offset} != index {table}@{col}")
    if problems:
        raise FrameError("frame does not match its COMMIT marker: " + ", ".join(problems), where)


def _put(dst: torch.Tensor, rows: Rows, src: torch.Tensor, dst_col: int, src_col: int, cols: int) -> None:
    """dst[rows, dst_col:dst_col+cols] = src[:, src_col:src_col+cols]; a plain copy into the
    slice where the rows are contiguous. `src` (decoded on the host) and `rows` move to the
    device of `dst` (a GPU job's shards) first, through pinned memory, the columns taken before
    the copy."""
    whole = dst_col == 0 and src_col == 0 and cols == dst.shape[1] == src.shape[1]
    if src.device != dst.device:
        src = to_device(src if whole else src[:, src_col : src_col + cols], dst.device)
        src_col = 0
        rows = rows if isinstance(rows, slice) else to_device(rows, dst.device)
    if isinstance(rows, slice):
        dst[rows, dst_col : dst_col + cols].copy_(src[:, src_col : src_col + cols])
    elif whole:
        scatter_rows(dst, rows, src)
    else:
        dst[rows, dst_col : dst_col + cols] = src[:, src_col : src_col + cols]


def scatter_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """dst[rows] = src, whole rows (`rows`: int64 indices). On the host, with both sides' rows
    contiguous, numpy copies each row as one element of the row's bytes, faster than `index_copy_`,
    which loops over the columns of every row
    (docs/history/BENCHMARKS-2026-11.md, "The restore's scattered rows, its readers connected before the model")."""
    row_bytes = dst.shape[1] * dst.element_size() if dst.dim() == 2 else 0
    if (
        row_bytes
        and dst.device.type == src.device.type == rows.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape[1] == src.shape[1]
        and dst.is_contiguous()
        and src.is_contiguous()
    ):

        def as_rows(t: torch.Tensor) -> np.ndarray:  # [n] elements of row_bytes bytes, sharing t's memory
            return t.detach().view(torch.uint8).numpy().view(np.dtype((np.void, row_bytes))).reshape(-1)

        np.put(as_rows(dst), rows.numpy(), as_rows(src))
    else:  # index_copy_ does not cast: rows decode to fp32, a table may be fp16
        dst.index_copy_(0, rows, src.to(dst.dtype))
