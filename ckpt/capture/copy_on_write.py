"""Copy-on-write snapshots (`ckpt.copy_on_write`, CPU shards): a checkpoint's rows are read
from the live tables by the writer, window by window, instead of copied at the checkpoint
step; only the rows the training goes on to update before the writer reaches them are
copied first, aside, by the tracker's lookup hook.

Why: a copied snapshot holds every row it names in fp32 on the host until the writer has
sent them (a delta's changed rows, or every trained row for a full checkpoint). Here the
host holds the rows saved aside (those updated while the writer runs: the hot ones) and
one window of rows being encoded. The point in time is the same: every row is read as it
was at the checkpoint step (docs/design.md §2, "Copy-on-write").

The invariant: a row of a pending snapshot that is neither read by the writer nor saved
aside has not changed since the checkpoint step. It holds because every row update of a
training step comes after that step's lookup of the row (the fused optimizer updates the
rows the backward pass reaches, which are the rows looked up), and the tracker's hook calls
`CowRows.before_update` with every training lookup's shard-local ids before any backward
pass can run; the snapshot is registered with the tracker before the next step's first
lookup may go on (`RowTracker.hold_next_lookup`). The writer's reads (`_read_live`) and the
hook's copies take the same lock and mark the rows they take, so each row is taken once,
and the writer never reads a row an update may be writing: an update's rows were taken by
its lookup's hook first.

Costs: the training thread pays for the rows it saves aside, in the lookups that run while
a snapshot is pending (counted into the checkpoint's stall: `aside_s`); the writer holds
the lock for one sub-window's gather at a time (`SUB_ROWS`), so a lookup waits at most that.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from ckpt.capture.tracker import LookupGroup
    from sharding.shard_views import ShardView

WINDOW_BYTES = 16 << 20  # host rows the writer reads, encodes and frames at a time, per shard
SUB_ROWS = 4096  # rows the writer gathers per hold of the lock: what a lookup may wait for


@dataclass
class _Aside:
    """Rows of one window saved aside before an update: their positions in the snapshot's row
    list, ascending, and their weights and optimizer state as of the checkpoint step."""

    positions: torch.Tensor
    weights: torch.Tensor
    optimizer: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.positions, self.weights, *self.optimizer.values()))


class Window(NamedTuple):
    """The rows of one window of one shard, as of the checkpoint step, in row order."""

    shard: int  # the shard's index in the shard map
    view: ShardView
    global_rows: torch.Tensor  # int64 [n], ascending
    weights: torch.Tensor  # [n, num_cols]
    optimizer: dict[str, torch.Tensor]  # name -> [n] or [n, num_cols]


@dataclass
class AsideStats:
    """What saving rows aside cost the training thread for one snapshot on this rank."""

    rows: int = 0  # rows saved aside
    seconds: float = 0.0  # the hook's time in `before_update`, the lock's wait included
    peak_bytes: int = 0  # the most bytes held aside at once


class _CowShard:
    """One local shard's rows of a pending snapshot: its sorted local rows (None: every row
    of the shard), which of them are taken, and the ones saved aside, by window."""

    def __init__(self, view: ShardView, local: torch.Tensor | None, window: int, row_bytes: int) -> None:
        self.view = view
        self.row_bytes = row_bytes  # host bytes of one row copied: id, weights, optimizer state
        self.local = local
        self.n = view.num_rows if local is None else int(local.numel())
        self.window = window
        self.taken = torch.zeros(self.n, dtype=torch.bool)
        self.aside: dict[int, list[_Aside]] = {}  # window index -> rows saved aside in it

    @property
    def windows(self) -> int:
        """Windows of rows the writer reads; an empty shard has one, empty."""
        return max(1, -(-self.n // self.window))

    def _rows(self, positions: torch.Tensor) -> torch.Tensor:
        return positions if self.local is None else self.local[positions]

    def positions_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Positions in this snapshot's rows of the shard-local `ids` it holds, unique, ascending."""
        if self.n == 0 or ids.numel() == 0:
            return ids.new_empty(0)
        if self.local is None:
            pos = ids
        else:
            pos = torch.searchsorted(self.local, ids).clamp_(max=self.n - 1)
            pos = pos[self.local[pos] == ids]
        return torch.unique(pos)

    def save_aside(self, ids: torch.Tensor) -> tuple[int, int]:
        """Copy the rows of `ids` not yet taken (caller holds the lock): (rows, bytes) saved."""
        pos = self.positions_of(ids)
        pos = pos[~self.taken[pos]]
        if pos.numel() == 0:
            return 0, 0
        self.taken[pos] = True
        rows = self._rows(pos)
        weights = self.view.weight.detach().index_select(0, rows)
        states = {k: s.detach().index_select(0, rows) for k, s in self.view.optimizer_states.items()}
        wins, counts = torch.unique_consecutive(torch.div(pos, self.window, rounding_mode="floor"), return_counts=True)
        split = counts.tolist()
        parts = zip(pos.split(split), weights.split(split), *(s.split(split) for s in states.values()))
        nbytes = 0
        for w, (p, wt, *st) in zip(wins.tolist(), parts):
            block = _Aside(p, wt, dict(zip(states, st)))
            self.aside.setdefault(w, []).append(block)
            nbytes += block.nbytes
        return int(pos.numel()), nbytes

    def read_live(self, start: int, stop: int, base: int, weights: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        """Positions [start, stop) not yet taken, from the live shard into a window's tensors
        (whose first row is position `base`; caller holds the lock), then taken."""
        free = (~self.taken[start:stop]).nonzero().squeeze(1)
        if free.numel() == 0:
            return
        pos = free + start
        self.taken[pos] = True
        rows = self._rows(pos)
        at = pos - base
        weights.index_copy_(0, at, self.view.weight.detach().index_select(0, rows))
        for k, s in self.view.optimizer_states.items():
            states[k].index_copy_(0, at, s.detach().index_select(0, rows))


@dataclass
class CowRows:
    """The rows of one copy-on-write snapshot on this rank, taken lazily (module docstring).

    The tracker calls `before_update` while the snapshot is registered with it; the writer
    reads the rows with `windows`, which ends the registration once every row is taken;
    `close` ends it early (a writer that failed, or stopped)."""

    shards: list[_CowShard]
    unregister: Callable[[], None] = lambda: None  # set by whoever registers `before_update`
    stats: AsideStats = field(default_factory=AsideStats)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _held: int = 0  # bytes saved aside and not yet read by the writer
    _open: bool = True

    @classmethod
    def of(cls, views: list[ShardView], local_rows: list[torch.Tensor | None]) -> CowRows:
        """A pending snapshot of `local_rows[i]` (sorted; None: every row) of each shard."""
        shards = []
        for v, local in zip(views, local_rows):
            row_bytes = v.num_cols * v.weight.element_size() + sum(
                math.prod(s.shape[1:]) * s.element_size() for s in v.optimizer_states.values()
            )
            shards.append(_CowShard(v, local, max(SUB_ROWS, WINDOW_BYTES // max(row_bytes, 1)), 8 + row_bytes))
        return cls(shards)

    @property
    def rows(self) -> int:
        return sum(s.n for s in self.shards)

    @property
    def nbytes(self) -> int:
        """Bytes a copy of every row would hold (row ids, weights, optimizer state): the most
        this snapshot may hold aside, for the bound on pending snapshots."""
        return sum(s.n * s.row_bytes for s in self.shards)

    def before_update(self, group: LookupGroup, ids: list[torch.Tensor]) -> None:
        """The tracker's hook, for one training lookup: save aside every row it looked up that
        this snapshot still needs, before the backward pass may update it."""
        t0 = time.perf_counter()
        with self._lock:
            if not self._open:
                return
            for i, part in zip(group.shards, ids):
                if i is None:
                    continue
                rows, nbytes = self.shards[i].save_aside(part)
                self.stats.rows += rows
                self._held += nbytes
            self.stats.peak_bytes = max(self.stats.peak_bytes, self._held)
        self.stats.seconds += time.perf_counter() - t0

    def windows(self) -> Iterator[Window]:
        """Every row, shard by shard and window by window in row order; the registration ends
        after the last (or when the caller stops early)."""
        try:
            for i, shard in enumerate(self.shards):
                for w in range(shard.windows):
                    yield Window(i, shard.view, *self._window(shard, w))
        finally:
            self.close()

    def _window(self, shard: _CowShard, w: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        start, stop = w * shard.window, min(shard.n, (w + 1) * shard.window)
        v = shard.view
        weights = torch.empty(stop - start, v.num_cols, dtype=v.weight.dtype)
        states = {k: torch.empty(stop - start, *s.shape[1:], dtype=s.dtype) for k, s in v.optimizer_states.items()}
        for sub in range(start, stop, SUB_ROWS):
            with self._lock:
                shard.read_live(sub, min(stop, sub + SUB_ROWS), start, weights, states)
        with self._lock:  # every position of the window is taken now: no more rows come aside for it
            blocks = shard.aside.pop(w, [])
            self._held -= sum(b.nbytes for b in blocks)
        for b in blocks:
            at = b.positions - start
            weights.index_copy_(0, at, b.weights)
            for k, s in b.optimizer.items():
                states[k].index_copy_(0, at, s)
        positions = torch.arange(start, stop, dtype=torch.int64)
        local = positions if shard.local is None else shard.local[start:stop]
        return local + v.row_offset, weights, states

    def close(self) -> None:
        """Stop saving rows aside and drop those held (idempotent)."""
        with self._lock:
            if not self._open:
                return
            self._open = False
            for s in self.shards:
                s.aside.clear()
            self._held = 0
        self.unregister()
