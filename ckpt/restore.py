"""Restore: the newest COMMIT marker's chain, replayed into the *current* shards.

Each rank reads only the shard segments (from the marker's frame index) that overlap its
own shards, exactly the offset ranges the marker lists, verifies every frame's run id,
checkpoint id, rank and CRC, dequantizes, and writes base then deltas (last write wins)
into its live shard views, whatever the world size or sharding plan. Rows are addressed
by (table, global row, column), never by rank-local index (invariant 3).

Row-wise optimizer state (one value per row) under column-wise sharding is one value
per row per column shard; restoring into a different column split takes the value of
the source shard that holds the target shard's first column (exact when the splits
match, the same trade-off DCP makes).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from common.errors import DeltarecError
from ckpt.frames import Frame, FrameError
from ckpt.markers import ChainLink, IndexEntry, Marker, OffsetRange
from ckpt.quant import get_codec
from ckpt.sink import FrameSource
from sharding.shard_views import ShardMap, ShardView

logger = logging.getLogger(__name__)


class RestoreError(DeltarecError, RuntimeError):
    """The checkpoint cannot be restored as recorded; the message says where and why."""


@dataclass
class RowsRestored:
    """What this rank's restore read and wrote; the manager sums it over ranks for its report."""

    frames: int = 0
    rows: int = 0
    bytes: int = 0
    seconds: float = 0.0


def _in_ranges(pos: int, ranges: list[OffsetRange]) -> bool:
    return any(r.first <= pos <= r.last for r in ranges)


def _overlaps(s: ShardView, col_offset: int, cols: int, min_row: int, max_row: int) -> bool:
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
    if not marker.chain or not marker.chain[0].full:
        raise RestoreError(f"checkpoint {marker.checkpoint_id}: its chain does not start with a full checkpoint")
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
    for partition, run in _wanted_runs(link, want):
        firsts = [entry.first for entry in run]
        for pos, frame in source.read_range(link.generation, partition, run[0].first, run[-1].last):
            if not _in_ranges(pos, link.ranges.get(partition, [])):
                continue  # a frame of an earlier failed flush that landed in between
            entry = run[bisect.bisect_right(firsts, pos) - 1]
            if not entry.first <= pos <= entry.last:
                raise FrameError("frame outside every indexed segment of its COMMIT marker",
                                 locate(link.generation, partition, pos))
            verify_frame(frame, link, partition, entry.table, entry.col_offset, run_id,
                         locate(link.generation, partition, pos))
            yield frame


def _wanted_runs(link: ChainLink, want: Callable[[IndexEntry], bool]) -> list[tuple[int, list[IndexEntry]]]:
    """Per partition, maximal runs of consecutive index entries that `want` accepts."""
    runs: list[tuple[int, list[IndexEntry]]] = []
    previous: dict[int, bool] = {}
    for entry in link.index:
        wanted = want(entry)
        if wanted and previous.get(entry.partition) and runs and runs[-1][0] == entry.partition:
            runs[-1][1].append(entry)
        elif wanted:
            runs.append((entry.partition, [entry]))
        previous[entry.partition] = wanted
    return runs


def decode_rows(frame: Frame) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dequantized weights [n, dim] and optimizer states [n, dim or 1] of one frame."""
    weights = get_codec(frame.encoding).decode(frame.payload, frame.dim)
    optim = {}
    for o in frame.optim:
        oc = get_codec(o.encoding)
        width = frame.dim if oc.row_bytes(frame.dim) == o.rows.shape[1] else 1
        if oc.row_bytes(width) != o.rows.shape[1]:
            raise RestoreError(f"table {frame.table}: optimizer state {o.name} has rows of an unknown width")
        optim[o.name] = oc.decode(o.rows, width)
    return weights, optim


def restore_rows(
    marker: Marker, source: FrameSource, shard_map: ShardMap, run_id: str, locate: Callable[[int, int, int], str]
) -> RowsRestored:
    """Replay the marker's chain into this rank's shards; verify the base covered them."""
    t0 = time.perf_counter()
    out = RowsRestored()
    # columns of each local row the base wrote: a base holds every (row, column) exactly once,
    # so a complete base leaves exactly num_cols per row (an int per row, not a row x column mask)
    covered = {id(s): torch.zeros(s.num_rows, dtype=torch.int32) for s in shard_map.shards}

    def want(e: IndexEntry) -> bool:
        return any(_overlaps(s, e.col_offset, e.cols, e.min_row, e.max_row) for s in shard_map.of_table(e.table))

    for link, frame in iter_chain_frames(marker, source, run_id, locate, want):
        min_row, max_row = int(frame.row_ids.min()), int(frame.row_ids.max())
        targets = [s for s in shard_map.of_table(frame.table)
                   if _overlaps(s, frame.col_offset, frame.dim, min_row, max_row)]
        out.rows += _apply(frame, targets, covered if link.full else None)
        out.frames += 1
        out.bytes += frame.payload.numel() + frame.row_ids.numel() * 8 + sum(o.rows.numel() for o in frame.optim)
    for s in shard_map.shards:
        wrong = covered[id(s)] != s.num_cols
        if bool(wrong.any()):
            first = s.row_offset + int(wrong.nonzero()[0])
            raise RestoreError(
                f"checkpoint {marker.checkpoint_id}: table {s.table} rows {s.row_offset}..{s.row_offset + s.num_rows - 1} "
                f"cols {s.col_offset}..{s.col_offset + s.num_cols - 1}: {int(wrong.sum())} rows (first: row {first}) are "
                f"not covered exactly once by the base checkpoint {marker.chain[0].checkpoint_id}"
            )
    out.seconds = time.perf_counter() - t0
    return out


def verify_frame(frame: Frame, link: ChainLink, partition: int, table: str, col: int, run_id: str, where: str) -> None:
    """A frame must be exactly what the marker says is at its position (invariant 4)."""
    problems = []
    if frame.run_id != run_id:
        problems.append(f"run id {frame.run_id!r} != {run_id!r}")
    if frame.checkpoint_id != link.checkpoint_id:
        problems.append(f"checkpoint id {frame.checkpoint_id} != {link.checkpoint_id}")
    if frame.rank != partition:
        problems.append(f"rank {frame.rank} != partition {partition}")
    if frame.table != table or frame.col_offset != col:
        problems.append(f"shard {frame.table}@{frame.col_offset} != index {table}@{col}")
    if problems:
        raise FrameError("frame does not match its COMMIT marker: " + ", ".join(problems), where)


@torch.no_grad()
def _apply(frame: Frame, targets: list[ShardView], covered: dict[int, torch.Tensor] | None) -> int:
    """Write one frame's rows into every overlapping local shard; returns rows written.
    Whole-width rows go in with `index_copy_`; a column overlap narrower than the shard
    (restoring into another column split) with an indexed slice assignment."""
    weights, optim = decode_rows(frame)
    ids = frame.row_ids
    written = 0
    for s in targets:
        local = ids - s.row_offset
        mask = (local >= 0) & (local < s.num_rows)
        if bool(mask.all()):
            rows, w, opt = local, weights, optim  # the usual case: every row of the frame is this shard's
        elif bool(mask.any()):
            rows, w, opt = local[mask], weights[mask], {k: v[mask] for k, v in optim.items()}
        else:
            continue
        c0 = max(frame.col_offset, s.col_offset)
        c1 = min(frame.col_offset + frame.dim, s.col_offset + s.num_cols)
        _put(s.weight, rows, w, c0 - s.col_offset, c0 - frame.col_offset, c1 - c0)
        for name, state in s.optimizer_states.items():
            if name not in opt:
                raise RestoreError(
                    f"table {s.table}: optimizer state {name!r} is not in the checkpoint (it has {sorted(opt)}); "
                    "was it written with another optimizer?"
                )
            src = opt[name]
            if state.dim() == 1:
                if frame.col_offset <= s.col_offset < frame.col_offset + frame.dim:
                    state.index_copy_(0, rows, src[:, 0] if src.shape[1] == 1 else src[:, s.col_offset - frame.col_offset])
            else:
                _put(state, rows, src, c0 - s.col_offset, c0 - frame.col_offset, c1 - c0)
        if covered is not None:
            counts = covered[id(s)]
            counts.index_add_(0, rows, torch.full((rows.numel(),), c1 - c0, dtype=counts.dtype))
        written += rows.numel()
    return written


def _put(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, dst_col: int, src_col: int, cols: int) -> None:
    """dst[rows, dst_col:dst_col+cols] = src[:, src_col:src_col+cols]."""
    if dst_col == 0 and src_col == 0 and cols == dst.shape[1] == src.shape[1]:
        dst.index_copy_(0, rows, src)
    else:
        dst[rows, dst_col : dst_col + cols] = src[:, src_col : src_col + cols]
