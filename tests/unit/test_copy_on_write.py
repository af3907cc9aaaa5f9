"""Copy-on-write snapshots (ckpt/capture/copy_on_write.py): whatever the interleaving of the
writer's reads and the training thread's lookups and updates, every row read is the row as
it was at the checkpoint step, each exactly once and in row order.

The training thread here does what a training step does to a shard: the lookup hook
(`before_update`) with the step's ids, then an in-place update of exactly those rows. Random
ids print their seed (`DELTAREC_TEST_SEED` replays one)."""

from __future__ import annotations

import threading

import pytest
import torch

from ckpt.capture import copy_on_write
from ckpt.capture.copy_on_write import CowRows
from ckpt.capture.tracker import LookupGroup
from sharding.shard_views import ShardView


def _views(g: torch.Generator) -> list[ShardView]:
    def view(table: str, rows: int, cols: int, row_offset: int) -> ShardView:
        w = torch.randn(rows, cols, generator=g)
        return ShardView(table, row_offset, 0, w, {"momentum1": torch.rand(rows, generator=g)})

    return [view("t0", 5000, 8, 0), view("t1", 3000, 4, 7000), view("t2", 0, 8, 0), view("t3", 2000, 16, 0)]


def _row_bytes(views: list[ShardView]) -> list[int]:
    """Host bytes of one copied row per shard: its id, fp32 weights, row-wise state."""
    return [8 + v.num_cols * 4 + 4 for v in views]


def _locals(views: list[ShardView], g: torch.Generator) -> list[torch.Tensor | None]:
    # t0: a delta's rows; t1: every row (a full checkpoint); t2: an empty shard; t3: a few rows
    picked = torch.randperm(5000, generator=g)[:1800].sort().values
    few = torch.randperm(2000, generator=g)[:40].sort().values
    return [picked, None, torch.empty(0, dtype=torch.int64), few]


@pytest.fixture
def small_windows(monkeypatch):
    monkeypatch.setattr(copy_on_write, "WINDOW_BYTES", 4096)  # a window: 4096 / row bytes, at least SUB_ROWS
    monkeypatch.setattr(copy_on_write, "SUB_ROWS", 64)


def _group(views: list[ShardView]) -> LookupGroup:
    return LookupGroup(tuple(v.table for v in views), list(range(len(views))), [None] * len(views), True)


def _step(views: list[ShardView], cow: CowRows, group: LookupGroup, g: torch.Generator) -> None:
    """One training step's lookup (with duplicate ids) and its update of exactly those rows."""
    ids = [
        torch.randint(0, max(v.num_rows, 1), (300,), generator=g) if v.num_rows else torch.empty(0, dtype=torch.int64)
        for v in views
    ]
    cow.before_update(group, ids)
    for v, i in zip(views, ids):
        v.weight.index_add_(0, i, torch.ones(i.numel(), v.num_cols))
        v.optimizer_states["momentum1"].index_add_(0, i, torch.ones(i.numel()))


def _expected(
    views: list[ShardView], locals_: list[torch.Tensor | None]
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    out = []
    for v, local in zip(views, locals_):
        rows = torch.arange(v.num_rows) if local is None else local
        out.append((rows + v.row_offset, v.weight[rows].clone(), v.optimizer_states["momentum1"][rows].clone()))
    return out


def test_rows_read_while_training_updates_them_are_the_checkpoint_steps(small_windows, replay_seed):
    seed = replay_seed
    g = torch.Generator().manual_seed(seed.value)
    views = _views(g)
    locals_ = _locals(views, g)
    want = _expected(views, locals_)
    unregistered = []
    cow = CowRows.of(views, locals_, _row_bytes(views))
    cow.unregister = lambda: unregistered.append(True)
    group = _group(views)
    for _ in range(5):  # steps before the writer starts: their rows must come from aside
        _step(views, cow, group, g)
    got: list[list] = [[] for _ in views]
    failure: list[BaseException] = []

    def write() -> None:
        try:
            for w in cow.windows():
                got[w.shard].append(w)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failure.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    while writer.is_alive():  # steps interleaved with the writer's reads
        _step(views, cow, group, g)
    writer.join()
    assert not failure, failure
    assert cow.stats.rows > 0 and cow.stats.peak_bytes > 0, f"seed {seed}: no row was saved aside"
    for i, (rows, weights, momentum) in enumerate(want):
        windows = got[i]
        assert windows, f"shard {i}: no window read"
        read_rows = torch.cat([w.global_rows for w in windows])
        assert torch.equal(read_rows, rows), f"seed {seed}: shard {i} rows not read once each, in order"
        assert torch.equal(torch.cat([w.weights for w in windows]), weights), f"seed {seed}: shard {i} weights"
        assert torch.equal(torch.cat([w.optimizer["momentum1"] for w in windows]), momentum), f"seed {seed}: shard {i} state"
    assert len(got[0]) > 1, "the delta's rows span several windows"
    assert unregistered == [True], "the registration ends once, after the last window"
    assert cow._held == 0, "every row saved aside was handed to the writer"
    # after the last window, a lookup saves nothing
    before = cow.stats.rows
    _step(views, cow, group, g)
    assert cow.stats.rows == before


def test_closing_early_drops_the_rows_aside_and_stops_saving(small_windows, replay_seed):
    seed = replay_seed
    g = torch.Generator().manual_seed(seed.value)
    views = _views(g)
    cow = CowRows.of(views, _locals(views, g), _row_bytes(views))
    unregistered = []
    cow.unregister = lambda: unregistered.append(True)
    group = _group(views)
    _step(views, cow, group, g)
    assert cow._held > 0
    windows = cow.windows()
    next(windows)  # a writer that fails after its first window
    windows.close()
    assert unregistered == [True] and cow._held == 0
    assert all(not s.aside for s in cow.shards)
    saved = cow.stats.rows
    _step(views, cow, group, g)
    assert cow.stats.rows == saved
    cow.close()  # the snapshot's release after the writer's own close: nothing more
    assert unregistered == [True]


def test_ids_outside_the_snapshot_are_not_saved(small_windows):
    g = torch.Generator().manual_seed(0)
    views = _views(g)
    locals_ = _locals(views, g)
    cow = CowRows.of(views, locals_, _row_bytes(views))
    group = _group(views)
    outside = torch.tensor([i for i in range(200) if i not in set(locals_[0].tolist())][:50])
    cow.before_update(
        group, [outside, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)]
    )
    assert cow.stats.rows == 0 and cow._held == 0
    inside = locals_[3][:5]
    cow.before_update(group, [torch.empty(0, dtype=torch.int64)] * 3 + [torch.cat([inside, inside]).int()])  # int32, twice: once
    assert cow.stats.rows == 5
    # what a copy would hold: t0's 1,800 rows, every row of t1, t3's 40 rows (id, fp32 weights, state)
    assert cow.rows == 1800 + 3000 + 40
    assert cow.nbytes == 1800 * (8 + 32 + 4) + 3000 * (8 + 16 + 4) + 40 * (8 + 64 + 4)


def test_a_row_updated_while_the_writer_reads_it_comes_from_its_copy_aside(small_windows, monkeypatch):
    # The writer has marked a sub-window READING and reads it without the lock; a lookup of
    # one of those rows saves it aside and its update lands before the writer's read: the
    # window must carry the row as it was at the checkpoint step, from the copy aside.
    g = torch.Generator().manual_seed(1)
    views = _views(g)
    locals_ = _locals(views, g)
    want = _expected(views, locals_)
    cow = CowRows.of(views, locals_, _row_bytes(views))
    group = _group(views)
    original = CowRows._copy_live
    hit = locals_[0][:3]  # rows of the first sub-window of shard 0
    raced = []

    def lookup_then_read(shard, live, at, weights, states):
        if shard is cow.shards[0] and not raced:
            raced.append(True)
            empty = torch.empty(0, dtype=torch.int64)
            cow.before_update(group, [hit, empty, empty, empty])
            views[0].weight[hit] += 100.0  # the update, before the writer's read
            views[0].optimizer_states["momentum1"][hit] += 100.0
        original(shard, live, at, weights, states)

    monkeypatch.setattr(CowRows, "_copy_live", staticmethod(lookup_then_read))
    windows = list(cow.windows())
    assert raced and cow.stats.rows == 3
    first = [w for w in windows if w.shard == 0]
    assert torch.equal(torch.cat([w.weights for w in first]), want[0][1])
    assert torch.equal(torch.cat([w.optimizer["momentum1"] for w in first]), want[0][2])
