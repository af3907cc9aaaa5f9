"""SnapshotTaker on hand-made shards: exact rows, exact bytes, a copy that training cannot move.

The shards are plain tensors laid out like `ShardView`s (weights [rows, cols], row-wise
Adagrad state [rows], Adagrad state [rows, cols], no state for SGD), and the tracker is a
stand-in holding the two bitmaps, so these run without torchrec (and on CUDA when a GPU
is there: the CUDA branch is otherwise untested).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from ckpt.capture.host_buffers import HostBufferPool, Slab
from ckpt.capture.snapshot import ShardRows, Snapshot, SnapshotTaker
from ckpt.quant.adaptive import AdaptiveCodec
from ckpt.quant.base import NonFiniteRowError, RowRangeError
from ckpt.write.writer import WriteJob, encode_frames
from common.errors import ConfigError
from tests.devices import DEVICES, NEEDS_CUDA, synchronize


@dataclass
class View:  # the fields of sharding.shard_views.ShardView that the taker reads
    table: str
    row_offset: int
    col_offset: int
    weight: torch.Tensor
    optimizer_states: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    @property
    def num_cols(self) -> int:
        return self.weight.shape[1]


class Map:
    def __init__(self, shards: list[View]) -> None:
        self.shards = shards


class Tracker:
    """RowTracker's bitmap semantics without the hook."""

    def __init__(self, smap: Map) -> None:
        self.last = [torch.zeros(s.num_rows, dtype=torch.bool, device=s.weight.device) for s in smap.shards]
        self.base = [torch.zeros_like(b) for b in self.last]

    def since_last(self, i: int) -> torch.Tensor:
        return self.last[i].clone()

    def since_base(self, i: int) -> torch.Tensor:
        return self.last[i] | self.base[i]

    def touched_rows(self, i: int, since_base: bool, count: int | None = None) -> torch.Tensor:
        mask = self.since_base(i) if since_base else self.last[i]  # as RowTracker.touched_rows does
        return mask.nonzero().view(-1) if count is None else torch.nonzero_static(mask, size=count).view(-1)

    def counts(self, since_base: bool) -> list[int]:
        return [int((self.since_base(i) if since_base else self.last[i]).sum()) for i in range(len(self.last))]

    def mark_checkpoint(self) -> None:
        for base, last in zip(self.base, self.last):
            base |= last
            last.zero_()

    def guard(self, fn: object) -> object:
        """RowTracker.guard: the registrations still in place are in `guards`."""
        self.guards = [*getattr(self, "guards", []), fn]

        def remove() -> None:
            self.guards = [g for g in self.guards if g is not fn]

        return remove


def make(device: str = "cpu") -> tuple[Map, Tracker]:
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    smap = Map(
        [
            View("t_user", 1000, 0, rnd(500, 8), {"sum": rnd(500).abs()}),  # row-wise Adagrad, a row_wise shard
            View("t_item", 0, 8, rnd(300, 8), {"sum": rnd(300, 8).abs()}),  # Adagrad, a column shard
            View("t_ctx", 0, 0, rnd(64, 8)),  # SGD: no state
            View("t_empty", 7, 0, rnd(0, 8), {"sum": rnd(0)}),
        ]
    )
    tracker = Tracker(smap)
    for bits, idx in zip(tracker.last, ([0, 3, 499, 250], [1, 2, 299], [63], [])):
        bits[torch.tensor(idx, dtype=torch.long)] = True
    return smap, tracker


def live_rows(view: View, global_rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    local = global_rows.to(view.weight.device) - view.row_offset
    return view.weight[local].cpu(), {k: s[local].cpu() for k, s in view.optimizer_states.items()}


def assert_equals_live(snap: Snapshot, smap: Map) -> None:
    for rows, view in zip(snap.shards, smap.shards):
        w, opt = live_rows(view, rows.global_rows)
        assert torch.equal(rows.weights, w), view.table
        assert rows.optimizer.keys() == opt.keys()
        for k in opt:
            assert torch.equal(rows.optimizer[k], opt[k]), (view.table, k)


def train(smap: Map) -> None:
    """What an optimizer step does to the shards: in-place updates of every row."""
    with torch.no_grad():
        for v in smap.shards:
            v.weight.add_(1.0)
            for s in v.optimizer_states.values():
                s.mul_(2.0).add_(1.0)


# CPU shards take the gather-then-copy path of GPU shards too when asked (`staged`): its logic
# is tested here without a GPU, and the CUDA cases below run it on the device
STAGED = [False, True]


@pytest.mark.parametrize("staged", STAGED)
@pytest.mark.parametrize("device", DEVICES)
def test_delta_snapshot_rows_values_and_bytes(device: str, staged: bool) -> None:
    smap, tracker = make(device)
    taker = SnapshotTaker(smap, tracker, torch.device(device), staged=staged or None)
    est = taker.estimate_bytes(full=False, since_base=False)
    snap = taker.take(5, 100, full=False, since_base=False)
    snap.wait()
    assert (snap.checkpoint_id, snap.step, snap.full) == (5, 100, False)
    assert snap.stall_s >= 0
    expected = [[1000, 1003, 1250, 1499], [1, 2, 299], [63], []]
    assert [s.global_rows.tolist() for s in snap.shards] == expected
    assert [(s.table, s.row_offset, s.col_offset) for s in snap.shards] == [
        (v.table, v.row_offset, v.col_offset) for v in smap.shards
    ]
    for s in snap.shards:
        assert s.global_rows.dtype == torch.int64 and s.weights.device.type == "cpu"
    assert snap.shards[0].optimizer["sum"].shape == (4,)
    assert snap.shards[1].optimizer["sum"].shape == (3, 8)
    assert snap.shards[2].optimizer == {}
    assert_equals_live(snap, smap)
    # 8 B row id + 32 B weights + state (4 B row-wise, 32 B element-wise) per row
    assert est == snap.nbytes == 4 * (8 + 32 + 4) + 3 * (8 + 32 + 32) + 1 * (8 + 32)


@pytest.mark.parametrize("staged", STAGED)
@pytest.mark.parametrize("device", DEVICES)
def test_snapshot_is_a_copy(device: str, staged: bool) -> None:
    smap, tracker = make(device)
    taker = SnapshotTaker(smap, tracker, torch.device(device), staged=staged or None)
    delta = taker.take(1, 1, full=False, since_base=False)
    full = taker.take(2, 1, full=True, since_base=False)
    delta.wait()
    full.wait()
    kept = [[t.clone() for t in (s.global_rows, s.weights, *s.optimizer.values())] for s in delta.shards + full.shards]
    train(smap)
    synchronize(device)
    now = [[s.global_rows, s.weights, *s.optimizer.values()] for s in delta.shards + full.shards]
    for a, b in zip(kept, now):
        for x, y in zip(a, b):
            assert torch.equal(x, y), "training after take changed the snapshot"
    # ...while the live rows did move, so the check above could have failed
    w, _ = live_rows(smap.shards[0], delta.shards[0].global_rows)
    assert not torch.equal(w, delta.shards[0].weights)


@pytest.mark.parametrize("staged", STAGED)
@pytest.mark.parametrize("device", DEVICES)
def test_full_snapshot_covers_every_row(device: str, staged: bool) -> None:
    smap, tracker = make(device)
    taker = SnapshotTaker(smap, tracker, torch.device(device), staged=staged or None)
    est = taker.estimate_bytes(full=True, since_base=False)
    snap = taker.take(1, 0, full=True, since_base=False)
    snap.wait()
    for s, v in zip(snap.shards, smap.shards):
        assert torch.equal(s.global_rows, torch.arange(v.row_offset, v.row_offset + v.num_rows))
    assert_equals_live(snap, smap)
    assert (
        est
        == snap.nbytes
        == sum(
            v.num_rows * 8 + v.weight.numel() * 4 + sum(t.numel() * 4 for t in v.optimizer_states.values()) for v in smap.shards
        )
    )


def test_since_base_takes_the_union_of_windows() -> None:
    smap, tracker = make()
    taker = SnapshotTaker(smap, tracker, torch.device("cpu"))
    tracker.mark_checkpoint()
    tracker.last[0][[3, 7]] = True  # 3 was in the first window, 7 is new
    assert taker.estimate_bytes(False, False) == 2 * (8 + 32 + 4)
    last = taker.take(1, 0, full=False, since_base=False)
    base_est = taker.estimate_bytes(False, True)
    base = taker.take(2, 0, full=False, since_base=True)
    assert [s.global_rows.tolist() for s in last.shards] == [[1003, 1007], [], [], []]
    assert [s.global_rows.tolist() for s in base.shards] == [[1000, 1003, 1007, 1250, 1499], [1, 2, 299], [63], []]
    assert base_est == base.nbytes
    assert_equals_live(base, smap)


def test_shard_rows_nbytes_counts_every_tensor() -> None:
    r = ShardRows(
        "t",
        0,
        0,
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(3, 4),
        {"a": torch.zeros(3), "b": torch.zeros(3, 4, dtype=torch.float16)},
    )
    assert r.nbytes == 24 + 48 + 12 + 24
    assert Snapshot(1, 1, False, [r, r], 0.0).nbytes == 2 * r.nbytes


@pytest.mark.parametrize("staged", STAGED)
@pytest.mark.parametrize("full", [False, True])
def test_pooled_snapshots_are_the_same_copy_and_reuse_the_memory_of_released_ones(full: bool, staged: bool) -> None:
    smap, tracker = make()
    pool = HostBufferPool(1 << 30)
    taker = SnapshotTaker(smap, tracker, torch.device("cpu"), pool=pool, staged=staged)
    plain = SnapshotTaker(smap, tracker, torch.device("cpu")).take(1, 0, full=full, since_base=False)

    def assert_same(snap: Snapshot) -> None:
        assert snap.nbytes == plain.nbytes
        for a, b in zip(snap.shards, plain.shards, strict=True):
            assert torch.equal(a.global_rows, b.global_rows) and torch.equal(a.weights, b.weights)
            assert a.optimizer.keys() == b.optimizer.keys()
            assert all(torch.equal(a.optimizer[k], b.optimizer[k]) for k in a.optimizer)

    first = taker.take(1, 0, full=full, since_base=False)
    assert_same(first)
    held = first.shards[0].weights.data_ptr()
    second = taker.take(2, 0, full=full, since_base=False)  # the first is not released: other memory
    assert pool.allocated == 2 and second.shards[0].weights.data_ptr() != held
    first.release()
    assert first.shards == [] and pool.free_bytes > 0
    train(smap)
    third = taker.take(3, 1, full=full, since_base=False)
    assert pool.allocated == 2 and third.shards[0].weights.data_ptr() == held  # the released slab again
    assert_equals_live(third, smap)
    assert_same(second)  # untouched by the third take and by training
    third.release()
    free = pool.free_bytes
    third.release()  # twice is harmless
    assert pool.free_bytes == free


class _ExactPool(HostBufferPool):
    """Lends slabs of exactly the bytes asked for: no headroom hides a short request."""

    def lend(self, nbytes: int) -> Slab:
        return Slab(nbytes)


@pytest.mark.parametrize("staged", STAGED)
def test_a_pooled_take_asks_for_every_tensors_aligned_bytes(staged: bool) -> None:
    # each shard's weights and optimizer state are carved apart, each aligned: t_item's 3 rows
    # are 96 B of weights and 96 B of state, 256 B once aligned apart, not 192 B rounded as one
    smap, tracker = make()
    taker = SnapshotTaker(smap, tracker, torch.device("cpu"), pool=_ExactPool(1 << 30), staged=staged)
    for full in (False, True):
        snap = taker.take(1, 0, full=full, since_base=False)
        assert_equals_live(snap, smap)


# --- weights encoded where they were gathered (ckpt.capture.encode_on) -------------------------------------


class _TorchEncoder:
    """A device encoder made of the adaptive codec's torch reference: what the snapshot asks of
    one (ckpt/quant/device.py), runnable on any device. Flags come back all clear."""

    def __init__(self) -> None:
        self.codec = AdaptiveCodec(4, impl="torch")
        self.name = self.codec.name
        self.calls = 0

    def row_bytes(self, dim: int) -> int:
        return self.codec.row_bytes(dim)

    def encode_device(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return self.codec.encode(rows), torch.zeros(rows.shape[0], dtype=torch.uint8, device=rows.device)


class _EncodingTaker(SnapshotTaker):
    def __init__(self, *args, encoder: _TorchEncoder, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.encoder = encoder

    def device_encoder(self, weight_codec: str | None):  # type: ignore[override]
        return self.encoder if weight_codec == self.encoder.name else None


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("full", [False, True])
def test_weights_encoded_before_the_copy_hold_the_codecs_bytes_of_the_same_rows(full: bool, pooled: bool) -> None:
    smap, tracker = make()
    enc = _TorchEncoder()
    pool = _ExactPool(1 << 30) if pooled else None
    taker = _EncodingTaker(smap, tracker, torch.device("cpu"), staged=True, encoder=enc, pool=pool)
    plain = SnapshotTaker(smap, tracker, torch.device("cpu")).take(1, 0, full=full, since_base=False)
    snap = taker.take(1, 0, full=full, since_base=False, weight_codec="adaptive4")
    assert enc.calls == len(smap.shards)
    for got, want in zip(snap.shards, plain.shards, strict=True):
        assert got.weights is None and got.encoded is not None and got.encoded.codec == "adaptive4"
        assert got.num_cols == want.num_cols == 8
        assert torch.equal(got.encoded.payload, enc.codec.encode(want.weights)), got.table
        assert got.encoded.flags.shape == (want.global_rows.numel(),) and not got.encoded.flags.any()
        assert torch.equal(got.global_rows, want.global_rows)
        assert all(torch.equal(got.optimizer[k], want.optimizer[k]) for k in want.optimizer)
    # the host holds the encoded rows (20 B a row here) instead of 32 B of fp32 weights a row
    rows = sum(s.global_rows.numel() for s in plain.shards)
    assert snap.nbytes == plain.nbytes - rows * 32 + rows * (enc.row_bytes(8) + 1)
    # another codec this checkpoint: the fp32 rows are copied as before
    other = taker.take(2, 0, full=full, since_base=False, weight_codec="fp32")
    assert all(s.encoded is None and s.weights is not None for s in other.shards)


def _encoded_delta(smap: Map, tracker: Tracker) -> Snapshot:
    """Checkpoint 3's delta with its weights encoded as adaptive4 where they were gathered."""
    taker = _EncodingTaker(smap, tracker, torch.device("cpu"), staged=True, encoder=_TorchEncoder())
    return taker.take(3, 10, full=False, since_base=False, weight_codec="adaptive4")


def _job(snap: Snapshot) -> WriteJob:
    return WriteJob(checkpoint_id=3, step=10, generation=1, chain=[3], snapshot=snap, trainer_state={},
                    weight_codec="adaptive4", optimizer_codec="fp32")  # fmt: skip


def test_the_writer_frames_rows_encoded_on_the_device_as_it_frames_rows_it_encodes() -> None:
    smap, tracker = make()
    encoded = _encoded_delta(smap, tracker)
    plain = SnapshotTaker(smap, tracker, torch.device("cpu")).take(3, 10, full=False, since_base=False)

    def frames(snap: Snapshot) -> list[bytes]:
        job = _job(snap)
        used: dict[str, str] = {}
        out = [f.data for s in snap.shards if s.global_rows.numel() for f in encode_frames(job, s, used, "run", 0, 1 << 20)]
        assert used["weights"] == "adaptive4"
        return out

    assert frames(encoded) == frames(plain) and frames(plain)


@pytest.mark.parametrize(("flag", "error"), [(0b100, NonFiniteRowError), (0b010, RowRangeError)])
def test_the_writer_refuses_a_row_the_device_encoder_flagged_as_the_codec_would(flag: int, error: type) -> None:
    smap, tracker = make()
    snap = _encoded_delta(smap, tracker)
    shard = snap.shards[0]
    assert shard.encoded is not None
    shard.encoded.flags[2] = flag  # the third row of t_user: global row 1250
    job = _job(snap)
    with pytest.raises(error, match=r"table 't_user' row 1250 \(global id\)"):
        list(encode_frames(job, shard, {}, "run", 0, 1 << 20))
    job.weight_codec = "adaptive2"  # a snapshot encoded for another codec is never framed as this one
    with pytest.raises(RuntimeError, match="encoded its rows as adaptive4"):
        encode_frames(job, snap.shards[1], {}, "run", 0, 1 << 20)


# --- CUDA: the side-stream copy into pinned host memory -------------------------------------------


@NEEDS_CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("full", [False, True])
def test_a_cuda_snapshot_is_bit_identical_to_the_cpu_copy_of_the_same_shards(full: bool) -> None:
    """`make` draws the shards on the CPU and moves them, so both devices hold the same bits."""
    cpu_map, cpu_tracker = make("cpu")
    cuda_map, cuda_tracker = make("cuda")
    want = SnapshotTaker(cpu_map, cpu_tracker, torch.device("cpu")).take(1, 0, full=full, since_base=False)
    got = SnapshotTaker(cuda_map, cuda_tracker, torch.device("cuda")).take(1, 0, full=full, since_base=False)
    got.wait()
    assert got.nbytes == want.nbytes
    for a, b in zip(got.shards, want.shards, strict=True):
        for x, y in zip((a.global_rows, a.weights, *a.optimizer.values()), (b.global_rows, b.weights, *b.optimizer.values())):
            assert x.device.type == "cpu" and x.dtype == y.dtype
            assert x.numel() == 0 or x.is_pinned(), (a.table, "host copies of CUDA rows must be pinned")
            assert torch.equal(x.view(torch.uint8) if x.numel() else x, y.view(torch.uint8) if y.numel() else y), a.table


def _big_cuda_shard(rows: int, cols: int) -> tuple[Map, Tracker]:
    smap = Map([View("big", 0, 0, torch.randn(rows, cols, device="cuda"), {"sum": torch.rand(rows, device="cuda")})])
    tracker = Tracker(smap)
    tracker.last[0][::2] = True
    return smap, tracker


@NEEDS_CUDA
@pytest.mark.gpu
def test_the_cuda_copy_is_not_queued_behind_later_training_work() -> None:
    """The device-to-host copy runs on the taker's side stream: a long kernel that training
    queues on the default stream after `take` does not delay the snapshot (were the copy on
    the default stream, `wait` would return only after that kernel)."""
    smap, tracker = _big_cuda_shard(1 << 16, 64)
    taker = SnapshotTaker(smap, tracker, torch.device("cuda"))
    taker.take(0, 0, full=False, since_base=False).wait()  # warm: side stream, pinned allocator
    snap = taker.take(1, 0, full=False, since_base=False)
    torch.cuda._sleep(2_000_000_000)  # about a second of the default stream's time
    snap.wait()
    try:
        assert not torch.cuda.current_stream().query(), "the snapshot waited for work queued after it"
    finally:
        torch.cuda.synchronize()
    assert_equals_live(snap, smap)


@NEEDS_CUDA
@pytest.mark.gpu
def test_training_waits_for_the_gather_only_not_for_the_copy_to_host() -> None:
    """The default stream waits for the device-side gather (so the next update cannot change a
    row before it is read), not for the much longer copy of 256 MiB to host memory."""
    smap, tracker = _big_cuda_shard(1 << 21, 64)  # 512 MiB of weights, half of its rows copied
    taker = SnapshotTaker(smap, tracker, torch.device("cuda"))
    taker.take(0, 0, full=False, since_base=False).wait()
    snap = taker.take(1, 0, full=False, since_base=False)
    torch.cuda.current_stream().synchronize()
    copying = not snap._ready.query()  # type: ignore[union-attr]
    snap.wait()
    assert copying, "the default stream was held until the copy to host memory ended"
    train(smap)  # training after the gather never reaches the snapshot
    torch.cuda.synchronize()
    w, _ = live_rows(smap.shards[0], snap.shards[0].global_rows[:4])
    assert torch.equal(snap.shards[0].weights[:4] + 1.0, w)


@NEEDS_CUDA
@pytest.mark.gpu
def test_a_cuda_snapshot_copies_into_page_locked_pool_slabs_and_reuses_them() -> None:
    """The checkpointer's pool for GPU shards registers its slabs (cudaHostRegister), the one made in
    a stall and the one reserved ahead on the helper thread alike; a released slab serves the
    next take, and what lands in it is the rows' bits."""
    cpu_map, cpu_tracker = make("cpu")
    cuda_map, cuda_tracker = make("cuda")
    pool = HostBufferPool(1 << 30, pin_for=torch.device("cuda"))
    taker = SnapshotTaker(cuda_map, cuda_tracker, torch.device("cuda"), pool=pool)
    want = SnapshotTaker(cpu_map, cpu_tracker, torch.device("cpu")).take(1, 0, full=True, since_base=False)
    first = taker.take(1, 0, full=True, since_base=False)
    first.wait()
    assert first._slab is not None and first._slab.pinned and first._slab.buffer.is_pinned()
    held = first.shards[0].global_rows.data_ptr()
    first.release()
    second = taker.take(2, 0, full=True, since_base=False)
    second.wait()
    assert pool.allocated == 1 and second.shards[0].global_rows.data_ptr() == held and second.new_bytes == 0
    for a, b in zip(second.shards, want.shards, strict=True):
        for x, y in zip((a.global_rows, a.weights, *a.optimizer.values()), (b.global_rows, b.weights, *b.optimizer.values())):
            assert torch.equal(x, y), a.table
    assert pool.reserve(64 << 20)  # as the helper thread reserves ahead: made, faulted in, then pinned
    assert all(s.pinned for s in pool._free)


def test_a_pool_for_cpu_shards_never_pins() -> None:
    pool = HostBufferPool(1 << 30, pin_for=torch.device("cpu"))
    assert not pool.pinned and not pool.lend(1 << 20).pinned


@pytest.mark.parametrize("full", [False, True])
def test_a_copy_on_write_snapshot_reads_the_rows_a_copy_holds(full: bool) -> None:
    # `ckpt.capture.copy_on_write`: nothing is copied at the take; the rows come from the live shards
    # when the writer reads them (`pieces`), the same rows, ids and bytes a copy would hold,
    # and the snapshot stays registered with the tracker until they are all read.
    smap, tracker = make()
    plain = SnapshotTaker(smap, tracker, torch.device("cpu")).take(1, 0, full=full, since_base=False)
    taker = SnapshotTaker(smap, tracker, torch.device("cpu"), copy_on_write=True)
    snap = taker.take(1, 0, full=full, since_base=False)
    assert snap.shards == [] and snap.new_bytes == 0
    assert (snap.rows, snap.nbytes) == (plain.rows, plain.nbytes)
    assert snap.nbytes == taker.estimate_bytes(full=full, since_base=False)
    assert len(tracker.guards) == 1
    read: dict[int, list[ShardRows]] = {}
    for i, piece in snap.pieces():
        read.setdefault(i, []).append(piece)
    assert tracker.guards == []  # every row read: no lookup saves rows aside for it any more
    assert sorted(read) == list(range(len(smap.shards)))
    for i, want in enumerate(plain.shards):
        got = read[i]
        assert torch.equal(torch.cat([p.global_rows for p in got]), want.global_rows)
        assert torch.equal(torch.cat([p.weights for p in got]), want.weights)
        for k in want.optimizer:
            assert torch.equal(torch.cat([p.optimizer[k] for p in got]), want.optimizer[k])


def test_a_copy_on_write_snapshot_read_through_frees_its_ids_without_the_garbage_collector() -> None:
    # its registration with the tracker made a cycle (snapshot -> unregister -> hook ->
    # snapshot): the row ids and states of the last checkpoint stayed resident beside
    # training until a full collection ran
    import gc
    import weakref

    smap, tracker = make()
    snap = SnapshotTaker(smap, tracker, torch.device("cpu"), copy_on_write=True).take(1, 0, full=False, since_base=False)
    cow = snap.lazy
    assert cow is not None
    ids = weakref.ref(next(s.local for s in cow.shards if s.local is not None and s.local.numel()))
    for _ in snap.pieces():
        pass
    assert ids() is None  # dropped at the registration's end, while the snapshot is still referenced
    gone = weakref.ref(cow)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del cow, snap
        assert gone() is None
    finally:
        if enabled:
            gc.enable()


def test_copy_on_write_refuses_shards_staged_on_the_device() -> None:
    smap, tracker = make()
    with pytest.raises(
        ConfigError, match=r"ckpt.capture.copy_on_write applies to CPU shards; .*set ckpt.capture.copy_on_write=false"
    ):
        SnapshotTaker(smap, tracker, torch.device("cpu"), staged=True, copy_on_write=True)
