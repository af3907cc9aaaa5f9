"""The restore's staged path (ckpt/restore/staging.py) writes exactly what the direct kernel and
the torch path write: the same bits in the weights and every optimizer state, for the codecs the
kernel takes and those it leaves to the torch path, frames of runs and of scattered ids, frames
partly outside a shard, links overwriting earlier ones in any arrival order, buffers that grow
and are reused.

On CPU the staged path runs over a queue that defers each frame's device work until the host
waits for it (`DeferredQueue`), as late as a GPU could run it: a staging buffer decoded into
again before its copies ran, or a torch-path write issued before the staged writes queued ahead
of it, shows as wrong bits. On CUDA (the `gpu` marker) the same chains go into GPU shards and must
match the CPU restore bit for bit; only there do the side stream, its events and pinned memory
run, and one test checks that the copies are queued without the host waiting for them."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from ckpt.log.markers import ChainLink, IndexEntry, Marker, OffsetRange
from ckpt.quant import get_codec
from ckpt.restore import kernel as restore_kernel
from ckpt.restore.kernel import FusedReplay
from ckpt.restore.replay import RowsRestored, restore_rows
from ckpt.restore.staging import CudaQueue, HostQueue, StagedReplay, run_start, to_device
from ckpt.stream.frames import Frame, FrameError, OptimState, decode_frame
from sharding.shard_views import ShardMap, ShardView
from tests.devices import CUDA, DEVICES
from tests.unit.test_restore_kernel import RUN, add_frame
from tests.unit.test_restore_kernel import link as chain_link
from tests.unit.test_restore_rows import ListSource, random_rows

if TYPE_CHECKING:
    from tests.conftest import ReplaySeed

pytestmark = pytest.mark.skipif(not restore_kernel.AVAILABLE, reason="numba is not installed")

ROWS = 80
FP32 = get_codec("fp32").code
CODECS = ["adaptive4", "asym4", "fp32", "fp16"]  # fp16: the kernel declines it, the torch path writes it


class DeferredQueue(HostQueue):
    """A host "device" that runs each frame's work only when the host waits for it (`wait`,
    `join`, `drain`): the latest a GPU could. `no_wait`: `wait` does nothing, a device the ring
    would not wait for (its work then runs at the end, from buffers decoded into since)."""

    def __init__(self, no_wait: bool = False) -> None:
        super().__init__()
        self.pending: list[Callable[[], None]] = []
        self.done = 0  # works run
        self.no_wait = no_wait

    def run(self, work: Callable[[], None]) -> None:
        self.pending.append(work)

    def mark(self) -> int:
        return self.done + len(self.pending)

    def wait(self, mark: object | None) -> None:
        while not self.no_wait and isinstance(mark, int) and self.done < mark:
            self._step()

    def join(self) -> None:
        while self.pending:
            self._step()

    def _step(self) -> None:
        work = self.pending.pop(0)
        with torch.no_grad():
            work()
        self.done += 1


def _staged(queue: HostQueue, slots: int = 3) -> StagedReplay:
    return StagedReplay(FusedReplay(restore_kernel.load()), queue, slots)


# --- chains -----------------------------------------------------------------------------------


def _frames(
    cid: int, codec: str, rows: torch.Tensor, sizes: list[int], dim: int, g: torch.Generator
) -> tuple[list[bytes], list[IndexEntry]]:
    """`rows` of table "t" in frames of `sizes` rows: weights in `codec`, a row-wise state
    (momentum1, one fp32 a row) and one a column (momentum2)."""
    c = get_codec(codec)
    frames, index = [], []
    for chunk in torch.split(rows, sizes):
        n = len(chunk)
        optim = [
            OptimState("momentum1", FP32, torch.rand(n, 1, generator=g)),
            OptimState("momentum2", FP32, torch.randn(n, dim, generator=g)),
        ]
        payload = c.encode(torch.randn(n, dim, generator=g) * float(torch.rand(1, generator=g)) * 10)
        add_frame(frames, index, cid, chunk, c.code, payload, optim, dim)
    return frames, index


def _sizes(rng: random.Random, n: int, growing: bool) -> list[int]:
    """Frame sizes adding up to n: random, or growing (each frame larger than the one before)."""
    sizes, left, size = [], n, 1
    while left:
        size = min(left, size + rng.randrange(1, 6) if growing else rng.randrange(1, 24))  # growing: from 2 rows
        sizes.append(size)
        left -= size
    return sizes


def _chain(links: list[tuple[str, torch.Tensor, list[int]]], dim: int, g: torch.Generator) -> tuple[Marker, dict]:
    """A marker over links of (weights codec, rows, frame sizes), the first one the base."""
    chain, store = [], {}
    for cid, (codec, rows, sizes) in enumerate(links, start=1):
        frames, index = _frames(cid, codec, rows, sizes, dim, g)
        chain.append(chain_link(cid, frames, index))
        store[(cid, 0)] = frames
    return Marker(kind="commit", run_id=RUN, checkpoint_id=len(chain), step=10, world_size=1, chain=chain), store


def _marker(rng: random.Random, g: torch.Generator, codecs: list[str], dim: int) -> tuple[Marker, dict]:
    """A base (every row, in order or shuffled: runs or scattered ids) and deltas (a run or a
    scattered set of rows each) in frames of random sizes, link i's weights in `codecs[i]`."""
    links = []
    for cid, codec in enumerate(codecs, start=1):
        rows = random_rows(rng, cid == 1, ROWS, 30)
        if cid == 1 and rng.random() < 0.5:
            rows = rows[torch.randperm(ROWS, generator=g)]
        links.append((codec, rows, _sizes(rng, len(rows), growing=False)))
    return _chain(links, dim, g)


def _growing(rng: random.Random, g: torch.Generator, codecs: list[str], dim: int) -> tuple[Marker, dict]:
    """A base of runs, a delta of every other row (scattered, ascending), then deltas of rows in
    random order, each link in frames that grow: the ring's buffers must grow with them."""
    links = [(codecs[0], torch.arange(ROWS)), (codecs[1], torch.arange(0, ROWS, 2))]
    links += [(c, torch.randperm(ROWS, generator=g)[: ROWS // 2]) for c in codecs[2:]]
    return _chain([(c, rows, _sizes(rng, len(rows), growing=True)) for c, rows in links], dim, g)


def _views(dim: int, cut: int, device: str = "cpu") -> list[ShardView]:
    """Table "t" in two row shards cut at `cut`: frames across the cut are partly outside each."""
    return [
        ShardView(
            "t",
            r0,
            0,
            torch.full((r1 - r0, dim), -7.0, device=device),
            {
                "momentum1": torch.full((r1 - r0,), -7.0, device=device),
                "momentum2": torch.full((r1 - r0, dim), -7.0, device=device),
            },
        )
        for r0, r1 in ((0, cut), (cut, ROWS))
    ]


def _restore(marker: Marker, store: dict, views: list[ShardView], order: str, seed: int, **kw) -> RowsRestored:
    return restore_rows(
        marker, ListSource(store, order, random.Random(seed)), ShardMap(views, []), RUN, lambda g, p, o: f"{g}/{p}@{o}", **kw
    )


def _bits(views: list[ShardView]) -> list[tuple[str, torch.Tensor]]:
    return [
        (f"{name} of rows {v.row_offset}..", t.cpu().view(torch.int32))
        for v in views
        for name, t in [("weights", v.weight), *v.optimizer_states.items()]
    ]


def _assert_same(got: list[ShardView], want: list[ShardView], what: str) -> None:
    for (name, a), (_, b) in zip(_bits(got), _bits(want)):
        differ = (a != b).reshape(a.shape[0], -1).any(dim=1)
        assert not bool(differ.any()), f"{what}: {name} differ in {int(differ.sum())} rows"


def _case(rng: random.Random, codec: str) -> list[str]:
    """Codecs of a chain of 3-5 links: all `codec`, or ("mixed") drawn per link."""
    links = rng.randrange(3, 6)
    return [rng.choice(CODECS) for _ in range(links)] if codec == "mixed" else [codec] * links


# --- on the host --------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", [*CODECS, "mixed"])
@pytest.mark.parametrize("dim", [1, 7, 32])
def test_staging_writes_the_bits_of_the_direct_kernel_and_of_the_torch_path(
    codec: str, dim: int, replay_seed: ReplaySeed
) -> None:
    rng, g = replay_seed.rng(), replay_seed.torch_generator()
    codecs = _case(rng, codec)
    marker, store = _marker(rng, g, codecs, dim)
    cut, order = rng.randrange(1, ROWS), rng.choice(["forward", "reversed", "shuffled"])
    what = f"{codecs} dim {dim} cut {cut} {order}: {replay_seed}"
    reference, direct, staged = _views(dim, cut), _views(dim, cut), _views(dim, cut)
    ref_out = _restore(marker, store, reference, order, replay_seed.value, fused=False)
    direct_out = _restore(marker, store, direct, order, replay_seed.value)
    writer = _staged(DeferredQueue(), slots=2)
    out = _restore(marker, store, staged, order, replay_seed.value, staging=writer)
    _assert_same(direct, reference, f"direct kernel against the torch path, {what}")
    _assert_same(staged, reference, f"staged against the torch path, {what}")
    assert (
        (out.rows, out.written, out.frames)
        == (ref_out.rows, ref_out.written, ref_out.frames)
        == (direct_out.rows, direct_out.written, direct_out.frames)
    ), what
    if codec != "mixed":  # (a mixed chain's staged links may all be overwritten by its torch-path ones)
        assert (out.staged > 0) == (codec != "fp16"), (out.staged, what)
    assert writer.frames == out.staged and not writer.queue.pending, what


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_buffers_grow_to_the_largest_frame_and_are_reused_once_their_copies_ran(slots: int, replay_seed: ReplaySeed) -> None:
    """Frames growing in size, many more than buffers, runs and scattered rows: each buffer is
    allocated again when a frame outgrows it and decoded into again only after its copies ran."""
    rng, g = replay_seed.rng(), replay_seed.torch_generator()
    marker, store = _growing(rng, g, ["adaptive4", "asym4", "fp32"], 16)
    cut = rng.randrange(1, ROWS)
    reference, staged = _views(16, cut), _views(16, cut)
    _restore(marker, store, reference, "reversed", replay_seed.value, fused=False)
    writer = _staged(DeferredQueue(), slots)
    out = _restore(marker, store, staged, "reversed", replay_seed.value, staging=writer)
    _assert_same(staged, reference, f"{slots} buffers: {replay_seed}")
    ring = writer.ring
    assert ring.grown > slots, (ring.grown, replay_seed)  # the first frames of each buffer, and then larger ones
    assert ring.waits == out.staged - slots, (ring.waits, out.staged, replay_seed)  # every take after the first round
    assert 0 < writer.runs < writer.frames, (writer.runs, writer.frames, replay_seed)  # slices and index copies


def test_a_ring_that_did_not_wait_for_its_copies_would_write_wrong_rows(replay_seed: ReplaySeed) -> None:
    """The deferred queue's check has teeth: with its waits ignored, one buffer's copies run
    after the next frames were decoded into it, and the shard gets their rows."""
    g = replay_seed.torch_generator()
    frames, index = _frames(1, "fp32", torch.arange(ROWS), [20, 20, 20, 20], 4, g)
    link = ChainLink(checkpoint_id=1, full=True, generation=1, ranges={0: [OffsetRange(0, 3)]}, rows=0, bytes=0, index=index)
    marker = Marker(kind="commit", run_id=RUN, checkpoint_id=1, step=1, world_size=1, chain=[link])
    reference, careless = _views(4, ROWS // 2), _views(4, ROWS // 2)
    _restore(marker, {(1, 0): frames}, reference, "forward", 0, fused=False)
    _restore(marker, {(1, 0): frames}, careless, "forward", 0, staging=_staged(DeferredQueue(no_wait=True), 1))
    assert not torch.equal(torch.cat([v.weight for v in careless]), torch.cat([v.weight for v in reference]))


@pytest.mark.parametrize("device", DEVICES)
def test_a_torch_path_frame_lands_after_the_staged_frames_before_it(device: str, replay_seed: ReplaySeed) -> None:
    """The base (staged) arrives first and a delta in fp16 (the torch path) over some of its rows
    after it: the delta's rows win, so its write must wait for the base's queued copies."""
    g = replay_seed.torch_generator()
    marker, store = _chain([("adaptive4", torch.arange(ROWS), [ROWS]), ("fp16", torch.arange(10, 30), [20])], 8, g)
    reference, staged = _views(8, 40, "cpu"), _views(8, 40, device)
    _restore(marker, store, reference, "reversed", 0, fused=False)
    queue = DeferredQueue() if device == "cpu" else CudaQueue(staged[0].weight.device)
    out = _restore(marker, store, staged, "reversed", 0, staging=_staged(queue))
    _assert_same(staged, reference, str(replay_seed))
    assert out.staged == 2, out  # the base's frame, into each shard


def test_a_failed_restore_leaves_no_staged_copy_behind(replay_seed: ReplaySeed) -> None:
    """A frame refused halfway through the chain: the writes staged before it are done when the
    error comes out, so none can land on the shards the next try writes."""
    rng, g = replay_seed.rng(), replay_seed.torch_generator()
    marker, store = _marker(rng, g, ["adaptive4", "adaptive4"], 8)
    store[(1, 0)][-1] = store[(2, 0)][0]  # a frame of the delta where the base's last one should be
    writer = _staged(DeferredQueue())
    with pytest.raises(FrameError, match="checkpoint id 2 != 1"):
        _restore(marker, store, _views(8, 40), "forward", 0, staging=writer)
    assert writer.frames > 0 and not writer.queue.pending, replay_seed


@pytest.mark.parametrize("rows, start", [
    ([5], 5), ([3, 4, 5, 6], 3), ([0, 1, 2], 0),
    ([3, 5, 6], None), ([4, 3, 5, 6], None), ([3, 5, 4, 6], None), ([6, 5, 4, 3], None), ([2, 9], None),
])  # fmt: skip
def test_destination_rows_are_one_slice_only_when_consecutive_and_ascending(rows: list[int], start: int | None) -> None:
    assert run_start(np.array(rows, dtype=np.int64)) == start


def test_host_tensors_stay_where_they_are_for_a_host_shard() -> None:
    t = torch.arange(6).reshape(2, 3)
    assert to_device(t, torch.device("cpu")) is t


# --- on CUDA ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("codec", [*CODECS, "mixed"])
@pytest.mark.parametrize("dim", [1, 7, 32, 128])
def test_into_gpu_shards_the_bits_of_the_cpu_restore(codec: str, dim: int, device: str, replay_seed: ReplaySeed) -> None:
    """The restore's own choice for GPU shards (a `StagedReplay` on a side stream; the torch
    path's copies through pinned memory) against the torch path into CPU shards."""
    rng, g = replay_seed.rng(), replay_seed.torch_generator()
    codecs = _case(rng, codec)
    marker, store = _marker(rng, g, codecs, dim)
    cut, order = rng.randrange(1, ROWS), rng.choice(["forward", "reversed", "shuffled"])
    reference, on_gpu = _views(dim, cut), _views(dim, cut, device)
    _restore(marker, store, reference, order, replay_seed.value, fused=False)
    out = _restore(marker, store, on_gpu, order, replay_seed.value)
    _assert_same(on_gpu, reference, f"{codecs} dim {dim} cut {cut} {order}: {replay_seed}")
    assert (out.staged > 0) == any(c != "fp16" for c in codecs), (out.staged, replay_seed)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("slots", [1, 2])
def test_into_gpu_shards_buffers_grow_and_are_reused(slots: int, device: str, replay_seed: ReplaySeed) -> None:
    rng, g = replay_seed.rng(), replay_seed.torch_generator()
    marker, store = _growing(rng, g, ["adaptive4", "asym4", "fp16", "fp32"], 16)
    cut = rng.randrange(1, ROWS)
    reference, on_gpu = _views(16, cut), _views(16, cut, device)
    _restore(marker, store, reference, "shuffled", replay_seed.value, fused=False)
    writer = _staged(CudaQueue(on_gpu[0].weight.device), slots)
    out = _restore(marker, store, on_gpu, "shuffled", replay_seed.value, staging=writer)
    _assert_same(on_gpu, reference, f"{slots} buffers: {replay_seed}")
    assert writer.ring.grown > slots and writer.ring.waits == out.staged - slots, (writer.ring.grown, replay_seed)
    assert all(b.is_pinned() for b in writer.ring.buffers), replay_seed


def _decoded(cid: int, codec: str, rows: torch.Tensor, sizes: list[int], dim: int, g: torch.Generator) -> list[Frame]:
    return [decode_frame(f) for f in _frames(cid, codec, rows, sizes, dim, g)[0]]


@pytest.mark.parametrize("device", [CUDA])
def test_staged_copies_are_queued_without_the_host_waiting_for_them(device: str, replay_seed: ReplaySeed) -> None:
    """With the GPU held busy, staging a frame per buffer (runs and scattered rows) returns while
    every copy is still queued: the host decodes the next frame instead of waiting for the last
    one's copy. Then `finish` waits for them, and the rows are right."""
    g = replay_seed.torch_generator()
    dim, n = 64, 3000
    view = ShardView("t", 0, 0, torch.zeros(n, dim, device=device), {"momentum1": torch.zeros(n, device=device)})
    ref = ShardView("t", 0, 0, torch.zeros(n, dim), {"momentum1": torch.zeros(n)})
    fused = FusedReplay(restore_kernel.load())
    writer = StagedReplay(fused, CudaQueue(view.weight.device))
    base = torch.cat([torch.randperm(1000, generator=g), torch.arange(1000, n)])  # scattered, then two runs
    warm = [(0, f) for f in _decoded(1, "adaptive4", base, [1000] * 3, dim, g)]
    frames = [(1, f) for f in _decoded(2, "adaptive4", torch.randperm(n, generator=g)[:1000], [1000], dim, g)]
    frames += [(2, f) for f in _decoded(3, "adaptive4", torch.arange(1000, 3000), [1000, 1000], dim, g)]
    written, covered = np.full(n, -1, np.int32), np.zeros(n, np.int32)
    written_ref, covered_ref = written.copy(), covered.copy()
    for link, f in warm:  # every buffer allocated (pinned, sized as the frames below need) before the GPU is held
        writer.write(f, view, link, written, covered, dim)
        fused.write(f, ref, link, written_ref, covered_ref, dim)
    writer.finish()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles on the current stream
    t = time.perf_counter()
    for link, f in frames:
        writer.write(f, view, link, written, covered, 0)
    host_s = time.perf_counter() - t
    assert not writer.queue.stream.query(), f"the copies were done after {host_s:.3f} s: the host waited for them"
    assert all(b.is_pinned() for b in writer.ring.buffers)
    writer.finish()
    assert writer.queue.stream.query() and torch.cuda.current_stream().query()
    for link, f in frames:
        fused.write(f, ref, link, written_ref, covered_ref, 0)
    assert (writer.runs, writer.frames, writer.ring.grown) == (4, 6, 3)  # scattered frames through indices
    assert torch.equal(view.weight.cpu().view(torch.int32), ref.weight.view(torch.int32)), replay_seed
    assert torch.equal(view.optimizer_states["momentum1"].cpu(), ref.optimizer_states["momentum1"]), replay_seed


@pytest.mark.parametrize("device", DEVICES)
def test_torch_path_copies_to_the_device_arrive_whole(device: str) -> None:
    """`to_device` (the torch path's copies into GPU shards, through pinned memory and queued):
    what the current stream reads next is the host tensor, column slices included."""
    t = torch.arange(4000 * 9, dtype=torch.float32).reshape(4000, 9)[:, 2:7]
    got = to_device(t, torch.device(device))
    assert got.device.type == device and torch.equal(got.cpu(), t)
