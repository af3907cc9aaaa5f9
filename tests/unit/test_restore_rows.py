"""`restore_rows` into live shard views: whole-width and column-split targets, the
optimizer state, last-write-wins deltas whatever order the frames arrive in, and the
base-coverage check (every (row, column) of every local shard exactly once in the base)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest
import torch

from ckpt.log.markers import ChainLink, IndexEntry, Marker, OffsetRange
from ckpt.restore.replay import restore_rows, scatter_rows
from ckpt.stream.frames import OptimState, decode_frame, encode_frame
from ckpt.types import RestoreError
from sharding.row_init import RowInit, fill_rows
from sharding.shard_views import ShardMap, ShardView
from tests.devices import DEVICES

if TYPE_CHECKING:
    from tests.conftest import ReplaySeed

RUN = "r"
FP32 = 1  # codec id of fp32 rows (ckpt/quant/registry.py)


class ListSource:
    """A FrameSource over in-memory frames: (generation, partition) -> [frame bytes].

    `read_ranges` serves its reads in `order`: "forward" (one after another, as given: a
    restore asks for the newest link first), "reversed" (the oldest first), or "shuffled" (a
    random interleaving of the reads, each still in position order) drawn from `rng`.
    """

    reads_ahead_used = 0

    def __init__(
        self, frames: dict[tuple[int, int], list[bytes]], order: str = "forward", rng: random.Random | None = None
    ) -> None:
        self.frames = frames
        self.order = order
        self.rng = rng or random.Random(0)

    def read_range(self, generation, partition, first, last):
        for pos in range(first, last + 1):
            yield pos, decode_frame(self.frames[(generation, partition)][pos])

    def read_ranges(self, reads):
        queues = [[(i, pos) for pos in range(r.first, r.last + 1)] for i, r in enumerate(reads)]
        if self.order == "reversed":
            served = [item for q in reversed(queues) for item in q]
        elif self.order == "shuffled":
            served = []
            while any(queues):
                q = self.rng.choice([q for q in queues if q])
                served.append(q.pop(0))
        else:
            served = [item for q in queues for item in q]
        for i, pos in served:
            yield i, pos, decode_frame(self.frames[(reads[i].generation, reads[i].partition)][pos])

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


def _view(rows: int, cols: int, row_offset: int = 0, col_offset: int = 0, device: str = "cpu") -> ShardView:
    return ShardView(
        "t", row_offset, col_offset, torch.zeros(rows, cols, device=device), {"momentum1": torch.zeros(rows, device=device)}
    )


def _restore(
    frames_by_link: list[tuple[bool, list[bytes], int, int, int, int]],
    views: list[ShardView],
    hold: RowInit | None = None,
    **marker_fields,
):
    chain, store = [], {}
    for cid, (full, frames, col, cols, lo, hi) in enumerate(frames_by_link, start=1):
        chain.append(_link(cid, full, frames, "t", col, cols, lo, hi))
        store[(cid, 0)] = frames
    marker = Marker(kind="commit", run_id=RUN, checkpoint_id=len(chain), step=10, world_size=1, chain=chain, **marker_fields)
    return restore_rows(
        marker, ListSource(store), ShardMap(views, []), RUN, lambda g, p, o: f"{g}/{p}@{o}", shards_hold_init=hold
    )


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
    with pytest.raises(
        RestoreError,
        match=r"table t rows 0\.\.4 cols 0\.\.2: 1 rows \(first: row 3\) are not covered "
        r"exactly once by the base checkpoint 1",
    ):
        _restore([(True, base, 0, 3, 0, 4)], [_view(5, 3)])


@pytest.mark.parametrize("field, value, says", [
    ("run_id", "another-run", "run id 'another-run' != 'r'"),
    ("checkpoint_id", 7, "checkpoint id 7 != 1"),
    ("rank", 3, "rank 3 != partition 0"),
    ("epoch", 5, "attempt epoch 5 != 0"),  # another trainer attempt's frame (ckpt/log/fencing.py)
])  # fmt: skip
def test_a_frame_that_does_not_match_its_marker_is_refused_before_anything_is_written(
    field, value, says, replay_seed: ReplaySeed
) -> None:
    """A frame from another run (a reused topic or directory), another checkpoint, another rank or
    another trainer attempt at the position the marker names is refused with its location; the shard keeps its values."""
    from ckpt.stream.frames import FrameError

    meta = dict(run_id=RUN, checkpoint_id=1, rank=0, table="t", col_offset=0, dim=4, encoding=FP32,
                row_ids=torch.arange(5), payload=torch.randn(5, 4, generator=replay_seed.torch_generator()),
                optim=[OptimState("momentum1", FP32, torch.ones(5, 1))])  # fmt: skip
    meta[field] = value
    view = _view(5, 4)
    view.weight.fill_(3.0)
    with pytest.raises(FrameError, match=f"1/0@0: frame does not match its COMMIT marker: {says}"):
        _restore([(True, [encode_frame(**meta)], 0, 4, 0, 4)], [view])
    assert bool((view.weight == 3.0).all())


# --- a random chain, its frames arriving in any order ------------------------------------------

ROWS, DIM = 40, 4


def random_rows(rng: random.Random, full: bool, rows: int, longest_run: int) -> torch.Tensor:
    """The rows of a random link of a table of `rows` rows, ascending: every row for a base;
    for a delta a run of at most `longest_run` rows (three times in ten) or a random set."""
    if full:
        return torch.arange(rows)
    if rng.random() < 0.3:
        lo = rng.randrange(rows - longest_run)
        return torch.arange(lo, lo + rng.randrange(1, longest_run + 1))
    return torch.tensor(sorted(rng.sample(range(rows), rng.randrange(1, rows // 2))))


def _random_link(
    cid: int, full: bool, rng: random.Random, g: torch.Generator, ref_w: torch.Tensor, ref_m: torch.Tensor
) -> tuple[ChainLink, list[bytes]]:
    """One link of table "t" in a column split of its own (the job may have been resharded
    between links): the base holds every row as runs of a few frames, a delta a random set
    of rows (sometimes one run). Applies it to the references, in chain order."""
    split = rng.choice([[0, DIM], [0, 2, DIM], [0, 1, DIM]])
    rows = random_rows(rng, full, ROWS, 5)
    frames, index = [], []
    for c0, c1 in zip(split, split[1:]):
        for chunk in torch.split(rows, rng.randrange(3, 17)):
            w = torch.randn(len(chunk), c1 - c0, generator=g)
            mom = torch.rand(len(chunk), generator=g)
            ref_w[chunk, c0:c1] = w
            ref_m[chunk, c0:c1] = mom.unsqueeze(1)  # row-wise state: one value per row per column shard
            index.append(IndexEntry(partition=0, first=len(frames), last=len(frames), table="t", col_offset=c0,
                                    min_row=int(chunk.min()), max_row=int(chunk.max()), cols=c1 - c0))  # fmt: skip
            frames.append(_frame(cid, "t", c0, chunk, w, mom))
    link = ChainLink(checkpoint_id=cid, full=full, generation=cid, ranges={0: [OffsetRange(0, len(frames) - 1)]},
                     rows=0, bytes=0, index=index)  # fmt: skip
    return link, frames


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["forward", "reversed", "shuffled"])
def test_any_arrival_order_gives_the_chain_replayed_in_order(order: str, device: str, replay_seed: ReplaySeed) -> None:
    """A base and 2-4 deltas, each in its own column split, restored into a random row and
    column split of the table while the frames arrive in `order`: every shard ends as the
    chain replayed link by link, and rows a later link replaces are not written twice. On
    CUDA the shards live on the GPU, as a GPU job's do: frames decode on the host and their
    rows go to the device."""
    rng, g = replay_seed.rng(), replay_seed.torch_generator()
    ref_w, ref_m = torch.zeros(ROWS, DIM), torch.zeros(ROWS, DIM)
    chain, store = [], {}
    for cid in range(1, rng.randrange(3, 6) + 1):
        link, frames = _random_link(cid, cid == 1, rng, g, ref_w, ref_m)
        chain.append(link)
        store[(cid, 0)] = frames
    row_cut, col_cut = rng.randrange(1, ROWS), rng.choice([DIM, 2, 1, 3])
    views = [
        ShardView("t", r0, c0, torch.zeros(r1 - r0, c1 - c0, device=device), {"momentum1": torch.zeros(r1 - r0, device=device)})
        for r0, r1 in ((0, row_cut), (row_cut, ROWS))
        for c0, c1 in ((0, col_cut), (col_cut, DIM))
        if c1 > c0
    ]
    marker = Marker(kind="commit", run_id=RUN, checkpoint_id=len(chain), step=10, world_size=1, chain=chain)
    out = restore_rows(marker, ListSource(store, order, rng), ShardMap(views, []), RUN, lambda g, p, o: f"{g}/{p}@{o}")
    for v in views:
        rows, cols = slice(v.row_offset, v.row_offset + v.num_rows), slice(v.col_offset, v.col_offset + v.num_cols)
        assert v.weight.device.type == device
        torch.testing.assert_close(
            v.weight.cpu(),
            ref_w[rows, cols],
            rtol=0,
            atol=0,
            msg=lambda m: f"{order}, view {v.row_offset}/{v.col_offset}: {m}\n{replay_seed}",
        )
        # a target shard's row-wise state comes from the source shard holding its first column
        torch.testing.assert_close(
            v.optimizer_states["momentum1"].cpu(),
            ref_m[rows, v.col_offset],
            rtol=0,
            atol=0,
            msg=lambda m: f"{order}, momentum {v.row_offset}/{v.col_offset}: {m}\n{replay_seed}",
        )
    assert out.frames == sum(len(f) for f in store.values()), replay_seed
    assert out.written <= out.rows, (out, replay_seed)


def test_rows_a_later_link_replaces_are_neither_decoded_nor_written(replay_seed: ReplaySeed) -> None:
    """Restore asks for the newest link first, so a source that serves reads in order (files,
    one Kafka partition) gives the delta before the base: the base's copies of the delta's
    rows are skipped, 10 + 3 rows read and 10 written (counts a restore reports)."""
    g = replay_seed.torch_generator()
    base = [_frame(1, "t", 0, torch.arange(10), torch.randn(10, 4, generator=g), torch.rand(10, generator=g))]
    delta_w = torch.randn(3, 4, generator=g)
    delta = [_frame(2, "t", 0, torch.tensor([1, 5, 9]), delta_w, torch.rand(3, generator=g))]
    chain = [_link(1, True, base, "t", 0, 4, 0, 9), _link(2, False, delta, "t", 0, 4, 1, 9)]
    marker = Marker(kind="commit", run_id=RUN, checkpoint_id=2, step=10, world_size=1, chain=chain)
    view = _view(10, 4)
    out = restore_rows(marker, ListSource({(1, 0): base, (2, 0): delta}, "forward"), ShardMap([view], []), RUN,
                       lambda g, p, o: f"{g}/{p}@{o}")  # fmt: skip
    assert (out.rows, out.written) == (13, 10), out
    torch.testing.assert_close(view.weight[[1, 5, 9]], delta_w, rtol=0, atol=0, msg=lambda m: f"{m}\n{replay_seed}")


@pytest.mark.parametrize("device", DEVICES)
def test_a_base_of_trained_rows_only_regenerates_every_other_row(device: str, replay_seed: ReplaySeed) -> None:
    """A marker with a row initialisation: rows no link holds get their initial values and a
    zero optimizer state, unless the caller says the shards hold exactly those already (on
    CUDA: regenerated on the host, bit for bit the same values)."""
    g = replay_seed.torch_generator()
    init = RowInit(seed=7)
    base_rows, delta_rows = torch.tensor([1, 4, 5]), torch.tensor([4, 7])
    w, dw = torch.randn(3, 4, generator=g), torch.randn(2, 4, generator=g)
    base = [_frame(1, "t", 0, base_rows, w, torch.tensor([1.0, 2.0, 3.0]))]
    delta = [_frame(2, "t", 0, delta_rows, dw, torch.tensor([4.0, 5.0]))]
    links = [(True, base, 0, 4, 1, 5), (False, delta, 0, 4, 4, 7)]
    want = torch.empty(10, 4)
    fill_rows(init, "t", 10, 4, want, 0, 0)
    want[base_rows], want[delta_rows] = w, dw
    held = torch.zeros(10, dtype=torch.bool)
    held[[1, 4, 5, 7]] = True
    for hold in (None, init):
        views = [_view(6, 4, device=device), _view(4, 4, row_offset=6, device=device)]
        for v in views:
            v.weight.fill_(9.0)
            v.optimizer_states["momentum1"].fill_(6.0)
        out = _restore(links, views, hold, tables={"t": [10, 4]}, init=init.to_json())
        weights = torch.cat([v.weight for v in views]).cpu()
        momentum = torch.cat([v.optimizer_states["momentum1"] for v in views]).cpu()
        assert torch.equal(torch.cat(out.held), held), replay_seed
        assert torch.equal(weights[held], want[held]), replay_seed
        assert momentum[held].tolist() == [1.0, 4.0, 3.0, 5.0]
        if hold is None:
            assert out.regenerated == 6
            assert torch.equal(weights, want), replay_seed
            assert momentum[~held].tolist() == [0.0] * 6
        else:  # the shards are trusted to hold the initial values: nothing regenerated
            assert out.regenerated == 0
            assert bool((weights[~held] == 9.0).all()) and bool((momentum[~held] == 6.0).all())


def test_a_marker_with_a_row_initialisation_must_name_every_table_it_restores() -> None:
    base = [_frame(1, "t", 0, torch.tensor([0]), torch.ones(1, 2), torch.ones(1))]
    with pytest.raises(RestoreError, match="checkpoint 1 has no table 't'"):
        _restore([(True, base, 0, 2, 0, 0)], [_view(3, 2)], tables={"u": [3, 2]}, init=RowInit(1).to_json())
    with pytest.raises(RestoreError, match="not covered exactly once"):  # without one, every row must be there
        _restore([(True, base, 0, 2, 0, 0)], [_view(3, 2)], tables={"t": [3, 2]})


def test_work_given_to_overlap_the_first_fetch_starts_after_the_reads_are_issued_and_before_a_frame_is_awaited() -> None:
    w, mom = torch.ones(4, 2), torch.zeros(4)
    events: list[str] = []

    class Recording(ListSource):
        def read_ranges(self, reads):
            events.append("issued")  # a Kafka source assigns its partitions here
            frames = super().read_ranges(reads)

            def awaited():
                events.append("first frame awaited")
                yield from frames

            return awaited()

    frames = [_frame(1, "t", 0, torch.arange(4), w, mom)]
    marker = Marker(
        kind="commit", run_id=RUN, checkpoint_id=1, step=10, world_size=1, chain=[_link(1, True, frames, "t", 0, 2, 0, 3)]
    )
    view = _view(4, 2)
    restore_rows(
        marker,
        Recording({(1, 0): frames}),
        ShardMap([view], []),
        RUN,
        lambda g, p, o: f"{g}/{p}@{o}",
        while_fetching=lambda: events.append("dense read started"),
    )
    assert events == ["issued", "dense read started", "first frame awaited"]
    assert torch.equal(view.weight, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
def test_scattered_rows_land_exactly_where_index_copy_puts_them(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    dst = (torch.rand(1000, 7, generator=gen) * 100).to(dtype)
    src = (torch.rand(300, 7, generator=gen) * 100).to(dtype)
    rows = torch.randperm(1000, generator=gen)[:300]
    want = dst.clone().index_copy_(0, rows, src)
    scatter_rows(dst, rows, src)
    assert torch.equal(dst, want)


def test_scattering_into_a_column_slice_or_a_parameter_writes_only_those_rows() -> None:
    table = torch.arange(100 * 10, dtype=torch.float32).reshape(100, 10)
    left = table[:, :5]  # rows not contiguous: the index_copy_ path
    src = -torch.ones(10, 5)
    rows = torch.arange(10) * 3
    scatter_rows(left, rows, src)
    assert torch.equal(table[rows, :5], src) and bool((table[:, 5:] >= 0).all())
    assert int((table < 0).sum()) == 50
    weight = torch.nn.Parameter(torch.zeros(50, 4))
    with torch.no_grad():
        scatter_rows(weight, torch.tensor([0, 7, 49]), torch.ones(3, 4))
    assert weight.sum().item() == 12 and weight[49].tolist() == [1.0] * 4
