"""The checkpoint stall: copy the chosen rows of every local shard to host memory.

At a checkpoint step, after the optimizer update, `SnapshotTaker.take` copies the rows the
tracker marked (or every row, for a full checkpoint) — weights *and* every optimizer-state
tensor of each shard — into freshly allocated host tensors, and returns. Training may then
go on updating the live tables: the snapshot is a copy and does not move.

Rows are addressed by (table, global row, column offset) (docs/design.md §3, invariant 3):
``global_rows = row_offset + local row``.

Host memory: `estimate_bytes` gives, from the bitmap counts and before any copy, exactly
the bytes `take` will hold in the returned `Snapshot` (`Snapshot.nbytes`); the checkpoint
manager bounds pending snapshots with it. `take` allocates nothing else that outlives it
(the local row indices become `global_rows` in place).

Devices: on CPU the copy is `index_select(..., out=host_buffer)` on the training thread.
On CUDA (UNTESTED here: no GPU on the development machines) the rows are gathered on a side
stream into device temporaries and copied into pinned host buffers with
``non_blocking=True``; the training stream waits only for the gather (so the next update
cannot overwrite a row before it is read), and the device-to-host copy overlaps the next
step. A consumer must call `Snapshot.wait()` before reading the host tensors (a no-op on
CPU).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # keep this module importable without torchrec (GPU unit tests use fakes)
    from ckpt.tracker import RowTracker
    from sharding.shard_views import ShardMap, ShardView


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class ShardRows:
    """One local shard's captured rows."""

    table: str
    row_offset: int  # the shard's first global row
    col_offset: int
    global_rows: torch.Tensor  # int64 [n], global row ids (row_offset + local), ascending
    weights: torch.Tensor  # [n, num_cols] host copy (the table's dtype, float32 here)
    optimizer: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> host copy [n] or [n, num_cols]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.global_rows) + _nbytes(self.weights) + sum(_nbytes(t) for t in self.optimizer.values())


@dataclass
class Snapshot:
    """Host copies of one checkpoint's rows on this rank."""

    checkpoint_id: int
    step: int
    full: bool
    shards: list[ShardRows]
    stall_s: float
    _ready: object | None = field(default=None, repr=False, compare=False)  # CUDA event of the host copies

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def rows(self) -> int:
        return sum(s.global_rows.numel() for s in self.shards)

    def wait(self) -> None:
        """Block until the host copies are complete (they already are on CPU)."""
        if self._ready is not None:
            self._ready.synchronize()  # type: ignore[attr-defined]
            self._ready = None


def _row_bytes(view: "ShardView") -> int:
    """Host bytes per captured row of `view`: global row id + weights + optimizer state."""
    per = 8 + view.num_cols * view.weight.element_size()
    for state in view.optimizer_states.values():
        per += math.prod(state.shape[1:]) * state.element_size()
    return per


class SnapshotTaker:
    """Copies tracked rows of every shard in `shard_map` to host memory."""

    def __init__(self, shard_map: "ShardMap", tracker: "RowTracker", device: torch.device) -> None:
        self.shard_map = shard_map
        self.tracker = tracker
        # The copy runs where the shards live; `device` is the job's compute device and must agree.
        live = {v.weight.device for v in shard_map.shards}
        self.device = live.pop() if len(live) == 1 else torch.device(device)
        if live:
            raise ValueError(f"SnapshotTaker: shards live on several devices {sorted(map(str, live | {self.device}))}")
        if self.device.type != torch.device(device).type:
            logger.warning("SnapshotTaker: shards live on %s, not %s: copying from %s", self.device, device, self.device)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._row_bytes = [_row_bytes(v) for v in shard_map.shards]

    def _counts(self, full: bool, since_base: bool) -> list[int]:
        if full:
            return [v.num_rows for v in self.shard_map.shards]
        return self.tracker.counts(since_base)

    def estimate_bytes(self, full: bool, since_base: bool) -> int:
        """Exactly the bytes `take(full=..., since_base=...)` would hold, from the bitmap counts."""
        return self.bytes_for(self._counts(full, since_base))

    def bytes_for(self, counts: list[int]) -> int:
        """Bytes a snapshot of `counts[i]` rows of shard i holds (counts from `RowTracker.counts`)."""
        return sum(n * b for n, b in zip(counts, self._row_bytes))

    def take(self, checkpoint_id: int, step: int, *, full: bool, since_base: bool) -> Snapshot:
        """Copy every row (`full`), or the rows of `since_base(i)` / `since_last(i)`, of every shard."""
        t0 = time.perf_counter()
        if self._cuda:
            shards, ready = self._take_cuda(full, since_base)
        else:
            shards, ready = [self._copy_cpu(v, i, full, since_base) for i, v in enumerate(self.shard_map.shards)], None
        return Snapshot(checkpoint_id, step, full, shards, time.perf_counter() - t0, ready)

    # -- CPU ------------------------------------------------------------------------------
    def _copy_cpu(self, view: "ShardView", i: int, full: bool, since_base: bool) -> ShardRows:
        if full:
            rows = torch.arange(view.row_offset, view.row_offset + view.num_rows, dtype=torch.int64)
            weights = torch.empty(view.weight.shape, dtype=view.weight.dtype).copy_(view.weight.detach())
            optimizer = {k: torch.empty(s.shape, dtype=s.dtype).copy_(s.detach()) for k, s in view.optimizer_states.items()}
            return ShardRows(view.table, view.row_offset, view.col_offset, rows, weights, optimizer)
        local = self.tracker.touched_rows(i, since_base)
        n = local.numel()
        weights = torch.empty((n, view.num_cols), dtype=view.weight.dtype)
        torch.index_select(view.weight.detach(), 0, local, out=weights)
        optimizer = {}
        for k, s in view.optimizer_states.items():
            out = torch.empty((n, *s.shape[1:]), dtype=s.dtype)
            torch.index_select(s.detach(), 0, local, out=out)
            optimizer[k] = out
        rows = local.add_(view.row_offset)  # the indices become the global ids, no second buffer
        return ShardRows(view.table, view.row_offset, view.col_offset, rows, weights, optimizer)

    # -- CUDA (untested here) ---------------------------------------------------------------
    def _take_cuda(self, full: bool, since_base: bool) -> tuple[list[ShardRows], object]:
        main = torch.cuda.current_stream(self.device)
        side = self._stream
        assert side is not None
        side.wait_stream(main)  # this step's optimizer update is done before any row is read
        out: list[ShardRows] = []
        with torch.cuda.stream(side):
            gathered = []
            for i, v in enumerate(self.shard_map.shards):
                if full:
                    local = torch.arange(v.num_rows, dtype=torch.int64, device=self.device)
                else:
                    local = self.tracker.touched_rows(i, since_base)  # nonzero syncs the host with `side`
                dev = [local + v.row_offset, v.weight.detach().index_select(0, local)]
                dev += [s.detach().index_select(0, local) for s in v.optimizer_states.values()]
                gathered.append((v, dev))
            main.wait_stream(side)  # the next update may overwrite rows only after they are gathered
            for v, dev in gathered:
                host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in dev]
                for h, t in zip(host, dev):
                    h.copy_(t, non_blocking=True)  # `dev` was allocated on `side`: freed only after this
                rows, weights, *states = host
                out.append(ShardRows(v.table, v.row_offset, v.col_offset, rows, weights, dict(zip(v.optimizer_states, states))))
            ready = side.record_event()
        return out, ready
