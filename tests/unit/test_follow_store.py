"""The follower's RowStore keeps every row's encoded bytes as written, last write wins, and its
frames restore exactly what replaying the original frames restores, quantized rows included."""

from __future__ import annotations

import pytest
import torch

from ckpt.follow.store import RowStore
from ckpt.quant import get_codec
from ckpt.restore.replay import decode_rows
from ckpt.stream.frames import Frame, OptimState
from ckpt.types import RestoreError

ROWS, DIM = 50, 8


def _frame(ids: list[int], codec: str, seed: int, col: int = 0, dim: int = DIM, cid: int = 1) -> Frame:
    g = torch.Generator().manual_seed(seed)
    ids_t = torch.tensor(ids, dtype=torch.int64)
    weights = torch.randn(len(ids), dim, generator=g)
    c = get_codec(codec)
    momentum = get_codec("fp32")
    return Frame(
        run_id="r",
        checkpoint_id=cid,
        rank=seed % 2,
        table="t",
        col_offset=col,
        dim=dim,
        encoding=c.code,
        row_bytes=c.row_bytes(dim),
        chunk_index=0,
        chunk_count=1,
        row_ids=ids_t,
        payload=c.encode(weights),
        optim=(OptimState("momentum", momentum.code, momentum.encode(torch.rand(len(ids), 1, generator=g))),),
    )


def _replay(frames: list[Frame]) -> tuple[torch.Tensor, torch.Tensor]:
    """What a restore of these frames, in order, leaves: decoded weights and momentum."""
    w, m = torch.zeros(ROWS, DIM), torch.zeros(ROWS)
    for f in frames:
        weights, optim = decode_rows(f)
        w[f.row_ids] = weights
        m[f.row_ids] = optim["momentum"][:, 0]
    return w, m


@pytest.mark.parametrize("codecs", [("fp32", "fp32"), ("adaptive4", "adaptive4"), ("adaptive4", "fp32"), ("fp32", "adaptive2")])
def test_store_frames_restore_exactly_what_the_chain_restores(codecs: tuple[str, str]) -> None:
    base = _frame(list(range(ROWS)), codecs[0], seed=0)
    delta = _frame([3, 4, 17, 49], codecs[1], seed=1)
    delta2 = _frame([4, 5], codecs[1], seed=2)
    store = RowStore()
    for f in (base, delta, delta2):
        store.apply(f, f.rank, ROWS)
    store.check_complete(3)
    compacted = list(store.frames("r", 3))
    assert sorted(int(i) for f in compacted for i in f.row_ids) == list(range(ROWS))  # each row once
    for f in compacted:
        assert bool((f.row_ids[1:] > f.row_ids[:-1]).all())  # ascending within a frame
    want, got = _replay([base, delta, delta2]), _replay(compacted)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_frames_cut_in_windows_hold_the_same_rows_each_inside_its_window() -> None:
    """A compaction cuts each shard into windows of rows (what it holds beside the store stays
    that size): the frames of small windows carry exactly the rows, bytes and partitions of one
    window over the whole table, and no frame reaches past its window."""
    store = RowStore()
    for f in (
        _frame(list(range(ROWS)), "adaptive4", seed=0),
        _frame([3, 4, 17, 49], "fp32", seed=1),
        _frame([20], "fp32", seed=2),
    ):
        store.apply(f, f.rank, ROWS)
    whole, windowed = list(store.frames("r", 3)), list(store.frames("r", 3, slice_rows=16))
    assert len(windowed) > len(whole)
    for f in windowed:
        assert int(f.row_ids.min()) // 16 == int(f.row_ids.max()) // 16
        assert bool((f.row_ids[1:] > f.row_ids[:-1]).all())

    def rows(frames: list[Frame]) -> dict[int, tuple[int, int, bytes, bytes]]:
        out = {}
        for f in frames:
            for j, i in enumerate(f.row_ids.tolist()):
                out[i] = (f.rank, f.encoding, f.payload[j].numpy().tobytes(), f.optim[0].rows[j].numpy().tobytes())
        return out

    assert rows(windowed) == rows(whole) and len(rows(whole)) == ROWS


def test_rows_keep_the_partition_that_wrote_them_last() -> None:
    store = RowStore()
    base = _frame(list(range(ROWS)), "fp32", seed=0)  # rank 0
    store.apply(base, 0, ROWS)
    store.apply(_frame([7], "fp32", seed=1), 1, ROWS)
    by_partition = {f.rank: sorted(f.row_ids.tolist()) for f in store.frames("r", 2)}
    assert by_partition == {0: [i for i in range(ROWS) if i != 7], 1: [7]}


def test_narrower_rows_widen_the_store_and_keep_their_own_byte_count() -> None:
    store = RowStore()
    store.apply(_frame(list(range(ROWS)), "adaptive4", seed=0), 0, ROWS)
    narrow = store.nbytes
    store.apply(_frame([1], "fp32", seed=3), 0, ROWS)
    assert store.nbytes > narrow
    sizes = {f.encoding: f.payload.shape[1] for f in store.frames("r", 2)}
    assert sizes == {get_codec("adaptive4").code: get_codec("adaptive4").row_bytes(DIM), get_codec("fp32").code: 4 * DIM}


def test_a_base_that_misses_rows_is_refused_and_rows_outside_the_table_too() -> None:
    store = RowStore()
    store.apply(_frame(list(range(ROWS - 1)), "fp32", seed=0), 0, ROWS)
    with pytest.raises(RestoreError, match="1 rows have no weights"):
        store.check_complete(1)
    with pytest.raises(RestoreError, match="rows outside 0..49"):
        store.apply(_frame([ROWS], "fp32", seed=0), 0, ROWS)


def test_column_shards_are_kept_apart() -> None:
    store = RowStore()
    store.apply(_frame(list(range(ROWS)), "fp32", seed=0, col=0, dim=4), 0, ROWS)
    store.apply(_frame(list(range(ROWS)), "fp32", seed=1, col=4, dim=4), 1, ROWS)
    assert sorted((f.col_offset, f.dim) for f in store.frames("r", 1)) == [(0, 4), (4, 4)]


def test_untrained_rows_stay_out_of_compacted_frames_but_a_half_written_row_is_refused() -> None:
    """A chain with a row initialisation holds only trained rows: the rest stay absent from the
    store's frames (restore regenerates them), while a row without its optimizer state is damage."""
    store = RowStore()
    store.apply(_frame([3, 9, 10], "fp32", seed=0), 0, ROWS)
    with pytest.raises(RestoreError, match="47 rows have no weights"):
        store.check_complete(1)
    store.check_complete(1, untrained_ok=True)
    assert sorted(int(i) for f in store.frames("r", 1) for i in f.row_ids) == [3, 9, 10]
    shard = next(iter(store.shards.values()))
    shard.optim["momentum"].code[9] = 0
    with pytest.raises(RestoreError, match="1 rows have no momentum"):
        store.check_complete(1, untrained_ok=True)


def test_a_compaction_flushed_in_slices_reads_back_every_row_from_its_ranges(tmp_path) -> None:  # noqa: ANN001
    from ckpt.follow.compact import write_compacted
    from ckpt.stream.filesystem import FsSink, FsSource

    rows = 2000  # 72 KB of fp32 rows: several 16 KB frames per partition
    base = _frame(list(range(rows)), "fp32", seed=0)
    delta = _frame([3, 4, 17, 1999], "adaptive4", seed=1)
    store = RowStore()
    for f in (base, delta):
        store.apply(f, f.rank, rows)
    store.check_complete(2)
    links = {}
    for label, bound in (("one flush", 1 << 30), ("a flush per frame", 1)):
        sink = FsSink(tmp_path / label, "r")
        try:
            links[label] = write_compacted(
                store, sink=sink, run_id="r", checkpoint_id=2, generation=7, max_frame_bytes=16384, flush_timeout_s=10,
                max_unflushed_bytes=bound,
            )  # fmt: skip
        finally:
            sink.close()
    one, sliced = links["one flush"], links["a flush per frame"]
    assert sum(map(len, sliced.ranges.values())) > sum(map(len, one.ranges.values()))  # a range per flush
    assert (sliced.rows, sliced.bytes, len(sliced.index)) == (one.rows, one.bytes, len(one.index))
    source = FsSource(tmp_path / "a flush per frame", "r")
    frames = [f for p, rs in sliced.ranges.items() for r in rs for _, f in source.read_range(7, p, r.first, r.last)]
    assert sorted(int(i) for f in frames for i in f.row_ids) == list(range(rows))
    want = torch.zeros(rows, DIM)
    got = torch.zeros(rows, DIM)
    for frames_, out in (([base, delta], want), (frames, got)):
        for f in frames_:
            out[f.row_ids] = decode_rows(f)[0]
    assert torch.equal(want, got)
