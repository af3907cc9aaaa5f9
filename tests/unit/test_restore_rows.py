"""`restore_rows` into live shard views: whole-width and column-split targets, the
optimizer state, last-write-wins deltas, and the base-coverage check (every (row, column)
of every local shard exactly once in the base)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from ckpt.frames import OptimState, decode_frame, encode_frame
from ckpt.markers import ChainLink, IndexEntry, Marker, OffsetRange
from ckpt.restore import RestoreError, restore_rows
from sharding.shard_views import ShardMap, ShardView

if TYPE_CHECKING:
    from tests.conftest import ReplaySeed

RUN = "r"
FP32 = 1  # codec id of fp32 rows (ckpt/quant/registry.py)


class ListSource:
    """A FrameSource over in-memory frames: (generation, partition) -> [frame bytes]."""

    def __init__(self, frames: dict[tuple[int, int], list[bytes]]) -> None:
        self.frames = frames

    def read_range(self, generation, partition, first, last):
        for pos in range(first, last + 1):
            yield pos, decode_frame(self.frames[(generation, partition)][pos])

    def close(self) -> None:
        pass


def _frame(cid: int, table: str, col: int, rows: torch.Tensor, w: torch.Tensor, mom: torch.Tensor) -> bytes:
    return encode_frame(run_id=RUN, checkpoint_id=cid, rank=0, table=table, col_offset=col, dim=w.shape[1],
                        encoding=FP32, row_ids=rows, payload=w,
                        optim=[OptimState("momentum1", FP32, mom.reshape(-1, 1))])  # fmt: skip


def _link(cid: int, full: bool, frames: list[bytes], table: str, col: int, cols: int, lo: int, hi: int) -> ChainLink:
    """Checkpoint `cid` of generation `cid`: `frames` at positions 0.. of partition 0, one index entry."""
    return ChainLink(checkpoint_id=cid, full=full, generation=cid, ranges={0: [OffsetRange(0, len(frames) - 1)]},
                     rows=0, bytes=0,
                     index=[IndexEntry(partition=0, first=0, last=len(frames) - 1, table=table, col_offset=col,
                                       min_row=lo, max_row=hi, cols=cols)])  # fmt: skip


def _view(rows: int, cols: int, row_offset: int = 0, col_offset: int = 0) -> ShardView:
    return ShardView("t", row_offset, col_offset, torch.zeros(rows, cols), {"momentum1": torch.zeros(rows)})


def _restore(frames_by_link: list[tuple[bool, list[bytes], int, int, int, int]], views: list[ShardView]):
    chain, store = [], {}
    for cid, (full, frames, col, cols, lo, hi) in enumerate(frames_by_link, start=1):
        chain.append(_link(cid, full, frames, "t", col, cols, lo, hi))
        store[(cid, 0)] = frames
    marker = Marker(kind="commit", run_id=RUN, checkpoint_id=len(chain), step=10, world_size=1, chain=chain)
    return restore_rows(marker, ListSource(store), ShardMap(views, []), RUN, lambda g, p, o: f"{g}/{p}@{o}")


def test_base_then_delta_whole_width_and_row_split(replay_seed: ReplaySeed) -> None:
    g = replay_seed.torch_generator()
    w = torch.randn(10, 4, generator=g)
    mom = torch.rand(10, generator=g)
    delta_rows = torch.tensor([2, 7])
    dw = torch.randn(2, 4, generator=g)
    base = [_frame(1, "t", 0, torch.arange(10), w, mom)]
    delta = [_frame(2, "t", 0, delta_rows, dw, torch.tensor([9.0, 8.0]))]
    a, b = _view(6, 4), _view(4, 4, row_offset=6)  # this rank holds the table split in two row shards
    out = _restore([(True, base, 0, 4, 0, 9), (False, delta, 0, 4, 2, 7)], [a, b])
    want = w.clone()
    want[delta_rows] = dw
    torch.testing.assert_close(torch.cat([a.weight, b.weight]), want, rtol=0, atol=0,
                               msg=lambda m: f"{m}\n{replay_seed}")  # fmt: skip
    want_mom = mom.clone()
    want_mom[delta_rows] = torch.tensor([9.0, 8.0])
    torch.testing.assert_close(torch.cat([a.optimizer_states["momentum1"], b.optimizer_states["momentum1"]]),
                               want_mom, rtol=0, atol=0, msg=lambda m: f"{m}\n{replay_seed}")  # fmt: skip
    assert out.rows == 12 and out.frames == 2


def test_into_a_narrower_column_split(replay_seed: ReplaySeed) -> None:
    w = torch.randn(5, 4, generator=replay_seed.torch_generator())
    base = [_frame(1, "t", 0, torch.arange(5), w, torch.ones(5))]
    right = _view(5, 2, col_offset=2)
    _restore([(True, base, 0, 4, 0, 4)], [right])
    torch.testing.assert_close(right.weight, w[:, 2:], rtol=0, atol=0, msg=lambda m: f"{m}\n{replay_seed}")


@pytest.mark.parametrize("rows", [[0, 1, 2, 4], [0, 1, 2, 3, 4, 3]])
def test_base_must_cover_every_row_exactly_once(rows: list[int], replay_seed: ReplaySeed) -> None:
    r = torch.tensor(rows)
    w = torch.randn(len(rows), 3, generator=replay_seed.torch_generator())
    base = [_frame(1, "t", 0, r, w, torch.ones(len(rows)))]
    with pytest.raises(RestoreError, match=r"table t rows 0\.\.4 cols 0\.\.2: 1 rows \(first: row 3\) are not covered "
                                           r"exactly once by the base checkpoint 1"):
        _restore([(True, base, 0, 3, 0, 4)], [_view(5, 3)])


@pytest.mark.parametrize("field, value, says", [
    ("run_id", "another-run", "run id 'another-run' != 'r'"),
    ("checkpoint_id", 7, "checkpoint id 7 != 1"),
    ("rank", 3, "rank 3 != partition 0"),
])  # fmt: skip
def test_a_frame_that_does_not_match_its_marker_is_refused_before_anything_is_written(
    field, value, says, replay_seed: ReplaySeed
) -> None:
    """A frame from another run (a reused topic or directory), another checkpoint or another rank
    at the position the marker names is refused with its location; the shard keeps its values."""
    from ckpt.frames import FrameError

    meta = dict(run_id=RUN, checkpoint_id=1, rank=0, table="t", col_offset=0, dim=4, encoding=FP32,
                row_ids=torch.arange(5), payload=torch.randn(5, 4, generator=replay_seed.torch_generator()),
                optim=[OptimState("momentum1", FP32, torch.ones(5, 1))])  # fmt: skip
    meta[field] = value
    view = _view(5, 4)
    view.weight.fill_(3.0)
    with pytest.raises(FrameError, match=f"1/0@0: frame does not match its COMMIT marker: {says}"):
        _restore([(True, [encode_frame(**meta)], 0, 4, 0, 4)], [view])
    assert bool((view.weight == 3.0).all())
