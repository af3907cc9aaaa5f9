"""The restore's fused replay (ckpt/restore/kernel.py) writes exactly what the torch path writes:
the same bits in every shard, the same row counts, for every codec it takes, whatever order
the links' frames arrive in; and the frames it does not fit go through the torch path."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from ckpt.log.markers import ChainLink, IndexEntry, Marker, OffsetRange
from ckpt.quant import get_codec
from ckpt.quant.uniform import decode_nbit
from ckpt.restore import kernel as restore_kernel
from ckpt.restore.kernel import FusedReplay
from ckpt.restore.replay import restore_rows
from ckpt.stream.frames import OptimState, encode_frame
from sharding.shard_views import ShardMap, ShardView
from tests.unit.test_restore_rows import ListSource, random_rows

if TYPE_CHECKING:
    from tests.conftest import ReplaySeed

pytestmark = pytest.mark.skipif(not restore_kernel.AVAILABLE, reason="numba is not installed")

RUN = "r"
ROWS = 60
TAKEN = ["fp32", "asym2", "asym3", "asym4", "adaptive2", "adaptive3", "adaptive4"]
DECLINED = ["asym8", "sym4", "fp16", "bf16"]  # the torch path decodes these


def add_frame(
    frames: list[bytes], index: list[IndexEntry], cid: int, chunk: torch.Tensor, codec: int, payload: torch.Tensor,
    optim: list[OptimState], dim: int,
) -> None:  # fmt: skip
    """Append one frame of table "t" (rows `chunk`, encoded `payload` and `optim`) at the next
    position of partition 0, and its index entry."""
    index.append(
        IndexEntry(partition=0, first=len(frames), last=len(frames), table="t", col_offset=0,
                   min_row=int(chunk.min()), max_row=int(chunk.max()), cols=dim)
    )  # fmt: skip
    frames.append(
        encode_frame(run_id=RUN, checkpoint_id=cid, rank=0, table="t", col_offset=0, dim=dim, encoding=codec,
                     row_ids=chunk, payload=payload, optim=optim)
    )  # fmt: skip


def link(cid: int, frames: list[bytes], index: list[IndexEntry]) -> ChainLink:
    """Checkpoint `cid` as a link of generation `cid` holding `frames` at positions 0.. of
    partition 0 (the first checkpoint is the base)."""
    return ChainLink(checkpoint_id=cid, full=cid == 1, generation=cid, ranges={0: [OffsetRange(0, len(frames) - 1)]},
                     rows=0, bytes=0, index=index)  # fmt: skip


def _chain(codec: str, dim: int, rng: random.Random, g: torch.Generator) -> tuple[list[ChainLink], dict]:
    """A base of every row and 2-3 deltas of table "t", rows encoded with `codec`: scattered rows,
    runs, frames of a few rows each; a row-wise state (one fp32 a row) and a full-width one."""
    fp32 = get_codec("fp32").code
    c = get_codec(codec)
    chain, store = [], {}
    for cid in range(1, rng.randrange(3, 5) + 1):
        rows = random_rows(rng, cid == 1, ROWS, 8)
        frames, index = [], []
        for chunk in torch.split(rows, rng.randrange(3, 23)):
            n = len(chunk)
            payload = c.encode(torch.randn(n, dim, generator=g) * rng.choice([1e-3, 1.0, 30.0]))
            optim = [
                OptimState("momentum1", fp32, torch.rand(n, 1, generator=g)),
                OptimState("momentum2", fp32, torch.rand(n, dim, generator=g)),
            ]
            add_frame(frames, index, cid, chunk, c.code, payload, optim, dim)
        chain.append(link(cid, frames, index))
        store[(cid, 0)] = frames
    return chain, store


def _views(dim: int, cut: int) -> list[ShardView]:
    return [
        ShardView(
            "t",
            r0,
            0,
            torch.full((r1 - r0, dim), -7.0),
            {"momentum1": torch.full((r1 - r0,), -7.0), "momentum2": torch.full((r1 - r0, dim), -7.0)},
        )
        for r0, r1 in ((0, cut), (cut, ROWS))
    ]


@pytest.mark.parametrize("codec", TAKEN + DECLINED)
@pytest.mark.parametrize("dim", [1, 5, 13, 32])
def test_the_kernel_writes_the_bits_the_torch_path_writes(
    codec: str, dim: int, replay_seed: ReplaySeed, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng, g = replay_seed.rng(), replay_seed.torch_generator()
    chain, store = _chain(codec, dim, rng, g)
    marker = Marker(kind="commit", run_id=RUN, checkpoint_id=len(chain), step=10, world_size=1, chain=chain)
    cut = rng.randrange(1, ROWS)
    order = rng.choice(["forward", "reversed", "shuffled"])
    fused_writes = []
    write = FusedReplay.write
    monkeypatch.setattr(FusedReplay, "write", lambda self, *a: fused_writes.append(1) or write(self, *a))
    results = {}
    for fused in (False, True):
        views = _views(dim, cut)
        out = restore_rows(
            marker,
            ListSource(store, order, random.Random(replay_seed.value)),
            ShardMap(views, []),
            RUN,
            lambda g, p, o: f"{g}/{p}@{o}",
            fused=fused,
        )
        results[fused] = (views, out)
    (ref, ref_out), (got, got_out) = results[False], results[True]
    for a, b in zip(ref, got):
        for name, x, y in [
            ("weights", a.weight, b.weight),
            *((n, a.optimizer_states[n], b.optimizer_states[n]) for n in a.optimizer_states),
        ]:
            assert torch.equal(x.view(torch.int32), y.view(torch.int32)), (
                f"{codec} dim {dim} {order}: {name} of rows {a.row_offset}..: {replay_seed}"
            )
    assert (got_out.rows, got_out.written, got_out.frames) == (ref_out.rows, ref_out.written, ref_out.frames)
    assert bool(fused_writes) == (codec in TAKEN), f"{codec}: the kernel wrote {len(fused_writes)} frames"


def test_a_column_split_or_a_gpu_shard_is_left_to_the_torch_path() -> None:
    frame_meta = dict(
        run_id=RUN,
        checkpoint_id=1,
        rank=0,
        table="t",
        col_offset=0,
        dim=4,
        encoding=get_codec("adaptive4").code,
        row_ids=torch.arange(3),
        payload=get_codec("adaptive4").encode(torch.randn(3, 4)),
        optim=[OptimState("momentum1", get_codec("fp32").code, torch.rand(3, 1))],
    )
    from ckpt.stream.frames import decode_frame

    frame = decode_frame(encode_frame(**frame_meta))
    fused = FusedReplay(restore_kernel.load())
    whole = ShardView("t", 0, 0, torch.zeros(3, 4), {"momentum1": torch.zeros(3)})
    assert fused.fits(frame, whole)
    assert not fused.fits(frame, ShardView("t", 0, 2, torch.zeros(3, 2), {"momentum1": torch.zeros(3)}))
    assert not fused.fits(frame, ShardView("t", 0, 0, torch.zeros(3, 4), {"other": torch.zeros(3)}))
    assert not fused.fits(frame, ShardView("t", 0, 0, torch.zeros(4, 3).t(), {"momentum1": torch.zeros(3)}))
    if torch.cuda.is_available():
        assert not fused.fits(
            frame, ShardView("t", 0, 0, torch.zeros(3, 4, device="cuda"), {"momentum1": torch.zeros(3, device="cuda")})
        )


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_every_finite_fp16_scale_and_bias_decodes_exactly(bits: int, replay_seed: ReplaySeed) -> None:
    """Scale and bias drawn from every finite fp16 bit pattern (subnormals, signed zeros,
    the largest values): the kernel's decode equals `decode_nbit`'s bit for bit."""
    rs = np.random.default_rng(replay_seed.value)
    dim, n = 11, 4096
    packed = (dim * bits + 7) // 8
    data = rs.integers(0, 256, (n, packed + 4), dtype=np.uint8)
    data[:, packed - 1] &= (1 << (dim * bits - 8 * (packed - 1))) - 1  # unused high bits are zero
    halves = rs.integers(0, 1 << 16, (n, 2), dtype=np.uint16)
    halves[(halves & 0x7C00) == 0x7C00] &= 0x83FF  # inf/nan -> a subnormal: encoders refuse non-finite fields
    halves[:8] = [
        [0x0001, 0x8001],
        [0x8000, 0x0000],
        [0x7BFF, 0xFBFF],
        [0x03FF, 0x0400],
        [0x3C00, 0xBC00],
        [0x0000, 0x8000],
        [0x8001, 0x7BFF],
        [0x0400, 0x03FF],
    ]
    data[:, packed:] = halves.view(np.uint8).reshape(n, 4)
    want = decode_nbit(torch.from_numpy(data), bits, dim)
    got = np.full((n + 3, dim), np.nan, np.float32)
    dst = rs.permutation(n + 3)[:n].astype(np.int64)
    restore_kernel.load().nbit_rows_into(data, bits, dim, np.arange(n, dtype=np.int64), dst, n, got)
    assert np.array_equal(got[dst].view(np.int32), want.numpy().view(np.int32)), replay_seed
