"""Copy-on-write snapshots (`ckpt.capture.copy_on_write`, CPU shards): a checkpoint's rows are read
from the live tables by the writer, window by window, instead of copied at the checkpoint
step; only the rows the training goes on to update before the writer reaches them are
copied first, aside, by the tracker's lookup hook.

Why: a copied snapshot holds every row it names in fp32 on the host until the writer has
sent them (a delta's changed rows, or every trained row for a full checkpoint). Here the
host holds the rows saved aside (those updated while the writer runs: the hot ones) and
one window of rows being encoded. The point in time is the same: every row is read as it
was at the checkpoint step (docs/design/dataflow.md, "Copy-on-write").

The invariant: a row of a pending snapshot that is neither read by the writer nor saved
aside has not changed since the checkpoint step. It holds because every row update of a
training step comes after that step's lookup of the row (the fused optimizer updates the
rows the backward pass reaches, which are the rows looked up), and the tracker's hook calls
`CowRows.before_update` with every training lookup's shard-local ids before any backward
pass can run; the snapshot is registered with the tracker before the next step's first
lookup may go on (`RowTracker.hold_next_lookup`). One byte per shard row says where each
row is (`PENDING`, `READING`, `READING_ASIDE`, `DONE`), changed only under the snapshot's
lock. The writer marks a sub-window's pending rows `READING`, reads them without the lock
and marks them `DONE`; a lookup saves aside the rows it names that are `PENDING` or
`READING` (the latter may be read while the update writes them: the copy aside, taken
before the update, replaces that read). So each row's value is the checkpoint step's, and
the training thread never waits for the writer's reads, only for its marks.

Costs: the training thread pays in the lookups that run while a snapshot is pending: a
byte gathered per id, and a copy of the rows the snapshot still needs (counted into the
checkpoint's stall: `AsideStats.seconds`). The host holds one byte per shard row while the
snapshot is pending, the rows saved aside until the writer is done with their shard, and
one window.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from ckpt.capture.tracker import LookupGroup
    from sharding.shard_views import ShardView

# WINDOW_BYTES: host rows the writer reads, encodes and frames at a time, per shard (docs/history/BENCHMARKS-2026-12.md,
# "The suite's own memory taken out"); SUB_ROWS: rows the writer marks and reads at a time, its gather buffer, kept
# small (the same page, "Copy-on-write snapshots").
WINDOW_BYTES = 4 << 20
SUB_ROWS = 4096

# A shard row's state while a snapshot is pending (one byte per row of the shard). The two
# states a lookup must save aside have bit 1 set, so the hook tests a lookup's states with a max
# and a shift (torch's uint8 comparisons cost ~20x as much per element on CPU)
DONE = 0  # not in the snapshot, or read or saved aside already
READING_ASIDE = 1  # the writer is reading it, and a lookup saved it aside meanwhile: the writer uses that copy
PENDING = 2  # in the snapshot, untouched: the live row is the checkpoint step's
READING = 3  # the writer is reading it from the live shard
NEEDED = 2  # states >= NEEDED (PENDING, READING) are the ones a lookup saves aside


class Window(NamedTuple):
    """The rows of one window of one shard, as of the checkpoint step, in row order."""

    shard: int  # the shard's index in the shard map
    view: ShardView
    global_rows: torch.Tensor  # int64 [n], ascending
    weights: torch.Tensor  # [n, num_cols]
    optimizer: dict[str, torch.Tensor]  # name -> [n] or [n, num_cols]


@dataclass
class _Aside:
    """Rows saved aside by one lookup before its update: shard-local rows, ascending, with
    their weights and optimizer state as of the checkpoint step."""

    rows: torch.Tensor
    weights: torch.Tensor
    optimizer: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.rows, self.weights, *self.optimizer.values()))


@dataclass
class AsideStats:
    """What saving rows aside cost the training thread for one snapshot on this rank."""

    rows: int = 0  # rows saved aside
    seconds: float = 0.0  # the hook's time in `before_update`, the lock's wait included
    peak_bytes: int = 0  # the most bytes held aside at once


class _CowShard:
    """One local shard's rows of a pending snapshot: its sorted local rows (None: every row
    of the shard), each shard row's state, and the rows saved aside."""

    def __init__(self, view: ShardView, local: torch.Tensor | None, window: int, row_bytes: int, state: torch.Tensor) -> None:
        self.view = view
        self.local = local
        self.n = view.num_rows if local is None else int(local.numel())
        self.window = window
        self.row_bytes = row_bytes  # host bytes of one row copied: id, weights, optimizer state
        self.state = state  # uint8 [num_rows]: this shard's slice of the snapshot's states
        if local is None:
            state.fill_(PENDING)
        else:
            state.index_fill_(0, local, PENDING)
        self.aside: list[_Aside] = []

    @property
    def windows(self) -> int:
        """Windows of rows the writer reads; an empty shard has one, empty."""
        return max(1, -(-self.n // self.window))

    def rows_at(self, start: int, stop: int) -> torch.Tensor:
        """The shard-local rows at positions [start, stop) of the snapshot's sorted rows."""
        return torch.arange(start, stop, dtype=torch.int64) if self.local is None else self.local[start:stop]

    def save_aside(self, rows: torch.Tensor) -> int:
        """Copy the shard-local `rows` (unique, ascending, each PENDING or READING, already
        marked taken) from the live shard (caller holds the lock): the bytes saved."""
        weights = self.view.weight.detach().index_select(0, rows)
        states = {k: s.detach().index_select(0, rows) for k, s in self.view.optimizer_states.items()}
        block = _Aside(rows, weights, states)
        self.aside.append(block)
        return block.nbytes


def _registered_nowhere() -> None:
    """`CowRows.unregister` before it is registered and once it is not any more."""


@dataclass
class CowRows:
    """The rows of one copy-on-write snapshot on this rank, taken lazily (module docstring).

    The tracker calls `before_update` while the snapshot is registered with it; the writer
    reads the rows with `windows`, which ends the registration once every row is read;
    `close` ends it early (a writer that failed, or stopped)."""

    shards: list[_CowShard]
    state: torch.Tensor  # uint8: every shard's row states back to back, in shard order
    starts: torch.Tensor  # int64 [shards]: where each shard's rows start in `state`
    unregister: Callable[[], None] = _registered_nowhere  # set by whoever registers `before_update`
    stats: AsideStats = field(default_factory=AsideStats)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _held: int = 0  # bytes saved aside and not yet dropped
    _open: bool = True
    _start: list[int] = field(init=False)  # `starts` as Python ints, for the hook

    def __post_init__(self) -> None:
        self._start = self.starts.tolist()

    @classmethod
    def of(cls, views: list[ShardView], local_rows: list[torch.Tensor | None], row_bytes: list[int]) -> CowRows:
        """A pending snapshot of `local_rows[i]` (sorted; None: every row) of each shard, whose
        copied rows take `row_bytes[i]` host bytes each (`SnapshotTaker.row_bytes`)."""
        state = torch.zeros(sum(v.num_rows for v in views), dtype=torch.uint8)
        starts: list[int] = []
        shards = []
        start = 0
        for v, local, nbytes in zip(views, local_rows, row_bytes):
            starts.append(start)
            window = max(SUB_ROWS, WINDOW_BYTES // max(nbytes, 1))
            shards.append(_CowShard(v, local, window, nbytes, state[start : start + v.num_rows]))
            start += v.num_rows
        return cls(shards, state, torch.tensor(starts, dtype=torch.int64))

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
        this snapshot still needs, before the backward pass may update it. Each key's ids are
        checked in its shard's states (`index_select`: advanced indexing costs ~3x as much per
        id on CPU); the ids' positions in the states are built only when a row is hit."""
        t0 = time.perf_counter()
        keyed = [(i, part) for i, part in zip(group.shards, ids) if i is not None and part.numel()]
        if not keyed:
            return
        with self._lock:
            if not self._open:
                return
            st = torch.cat([self.shards[i].state.index_select(0, part) for i, part in keyed])
            if int(st.max()) >= NEEDED:
                flat = torch.cat([part.to(torch.int64) + self._start[i] for i, part in keyed])
                self._save_aside(torch.unique(flat.masked_select(st.bitwise_right_shift(1).bool())))
        self.stats.seconds += time.perf_counter() - t0

    def _save_aside(self, rows: torch.Tensor) -> None:
        """Rows (positions in `state`, unique, ascending, each PENDING or READING): taken, and
        copied aside shard by shard (caller holds the lock)."""
        st = self.state.index_select(0, rows)
        self.state.index_copy_(0, rows, torch.where(st == PENDING, DONE, READING_ASIDE).to(torch.uint8))
        owner = torch.searchsorted(self.starts, rows, right=True) - 1
        shards, counts = torch.unique_consecutive(owner, return_counts=True)
        for i, part in zip(shards.tolist(), rows.split(counts.tolist())):
            self._held += self.shards[i].save_aside(part - self._start[i])
        self.stats.rows += int(rows.numel())
        self.stats.peak_bytes = max(self.stats.peak_bytes, self._held)

    def windows(self) -> Iterator[Window]:
        """Every row, shard by shard and window by window in row order; the registration ends
        after the last (or when the caller stops early)."""
        try:
            for i, shard in enumerate(self.shards):
                for w in range(shard.windows):
                    yield Window(i, shard.view, *self._window(shard, w))
                with self._lock:  # every row of the shard is read: what was saved aside is used
                    self._held -= sum(b.nbytes for b in shard.aside)
                    shard.aside = []
        finally:
            self.close()

    def _window(self, shard: _CowShard, w: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        start, stop = w * shard.window, min(shard.n, (w + 1) * shard.window)
        v = shard.view
        weights = torch.empty(stop - start, v.num_cols, dtype=v.weight.dtype)
        states = {k: torch.empty(stop - start, *s.shape[1:], dtype=s.dtype) for k, s in v.optimizer_states.items()}
        for sub in range(start, stop, SUB_ROWS):
            self._read_live(shard, sub, min(stop, sub + SUB_ROWS), start, weights, states)
        rows = shard.rows_at(start, stop)
        with self._lock:  # every row of the window is DONE now: no lookup saves one aside any more
            blocks = list(shard.aside)
        if rows.numel():
            for b in blocks:  # rows saved aside before the writer read them (or while it did)
                lo = int(torch.searchsorted(b.rows, rows[0]))
                hi = int(torch.searchsorted(b.rows, rows[-1], right=True))
                if lo == hi:
                    continue
                at = torch.searchsorted(rows, b.rows[lo:hi])
                weights.index_copy_(0, at, b.weights[lo:hi])
                for k, s in b.optimizer.items():
                    states[k].index_copy_(0, at, s[lo:hi])
        return rows + v.row_offset, weights, states

    def _read_live(
        self, shard: _CowShard, start: int, stop: int, base: int, weights: torch.Tensor, states: dict[str, torch.Tensor]
    ) -> None:
        """Positions [start, stop) into the window's tensors (whose first row is position
        `base`): the rows still PENDING are marked READING, read from the live shard without
        the lock (a lookup that updates one meanwhile saves it aside first: READING_ASIDE, and
        that copy replaces the read), then marked DONE."""
        rows = shard.rows_at(start, stop)
        with self._lock:
            free = shard.state.index_select(0, rows) == PENDING
            live = rows.masked_select(free)
            shard.state.index_fill_(0, live, READING)
        self._copy_live(shard, live, free.nonzero().squeeze(1) + (start - base), weights, states)
        with self._lock:
            shard.state.index_fill_(0, rows, DONE)

    @staticmethod
    def _copy_live(
        shard: _CowShard, live: torch.Tensor, at: torch.Tensor, weights: torch.Tensor, states: dict[str, torch.Tensor]
    ) -> None:
        """Shard rows `live` into rows `at` of a window's tensors."""
        if live.numel():
            weights.index_copy_(0, at, shard.view.weight.detach().index_select(0, live))
            for k, s in shard.view.optimizer_states.items():
                states[k].index_copy_(0, at, s.detach().index_select(0, live))

    def close(self) -> None:
        """Stop saving rows aside and drop what the snapshot held: the rows aside, the row
        states and the snapshot's row ids (idempotent). The registration goes too, and with it
        the cycle it makes (this object -> `unregister` -> the tracker's hook -> this object),
        so nothing of the snapshot waits for the garbage collector while training goes on."""
        with self._lock:
            if not self._open:
                return
            self._open = False
            empty = torch.empty(0, dtype=torch.uint8)  # the states' storage goes
            for s in self.shards:
                s.aside = []
                s.state = empty
                if s.local is not None:
                    s.local = torch.empty(0, dtype=torch.int64)
            self.state = empty
            self._held = 0
        unregister, self.unregister = self.unregister, _registered_nowhere
        unregister()
