"""Every codec on CUDA tensors against the CPU reference (the plain-torch path on the CPU).

Codecs whose math is element-wise (fp32/fp16/bf16 casts, asym/sym: min, max, one fp16-rounded
scale and bias per row, a rounded quotient per value) must give the same bytes on both devices.
The adaptive and k-means codecs compare sums (squared errors, prefix sums of sorted values);
the GPU adds in another order, so a near tie can go the other way. For those the bound is
on the result: each row's reconstruction error on CUDA is within `ADAPTIVE_ROW_SLACK` of the
CPU's, and k-means' mean error within `KMEANS_MEAN_SLACK`. Decoding is checked bit for bit
against the CPU decoder on the same bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from ckpt.quant import codec_names, get_codec
from ckpt.quant.uniform import set_force_torch
from tests.devices import NEEDS_CUDA

if TYPE_CHECKING:
    from tests.conftest import ReplaySeed

pytestmark = [pytest.mark.gpu, NEEDS_CUDA]

ALL = codec_names()
SEARCHED = {n for n in ALL if n.startswith(("adaptive", "kmeans"))}
ADAPTIVE_ROW_SLACK = 1e-3  # relative: a range chosen among near-equal candidates
KMEANS_MEAN_SLACK = 0.02  # relative, on the mean over rows: centroids converge a little differently
DIMS = [1, 7, 32, 64, 128, 256]


def _rows(g: torch.Generator, n: int, dim: int) -> torch.Tensor:
    """Gaussian rows, heavy-tailed rows, constant rows and zero rows, at several scales."""
    x = torch.randn(n, dim, generator=g)
    x[n // 4 : n // 2] = x[n // 4 : n // 2] ** 3
    x[n // 2 : n // 2 + 8] = 0.3
    x[n // 2 + 8 : n // 2 + 16] = 0.0
    scale = torch.tensor([1e-3, 0.05, 1.0, 30.0])[torch.randint(0, 4, (n, 1), generator=g)]
    return (x * scale).contiguous()


def _cpu_reference(name: str, x: torch.Tensor) -> torch.Tensor:
    old = set_force_torch(True)
    try:
        return get_codec(name).encode(x)
    finally:
        set_force_torch(old)


def _row_error(name: str, enc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(get_codec(name).decode(enc, x.shape[1]) - x, dim=1)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("name", ALL)
def test_encoding_on_cuda_matches_the_cpu_reference(name: str, dim: int, replay_seed: ReplaySeed) -> None:
    x = _rows(replay_seed.torch_generator(), 1031, dim)
    want = _cpu_reference(name, x)
    got = get_codec(name).encode(x.cuda())
    assert got.device.type == "cuda" and got.dtype == torch.uint8
    got = got.cpu()
    assert got.shape == want.shape
    if name not in SEARCHED:
        differ = (got != want).any(dim=1)
        assert not bool(differ.any()), (
            f"{name} d={dim}: {int(differ.sum())} rows differ, first {int(differ.nonzero()[0])}; {replay_seed}"
        )
        return
    e_got, e_want = _row_error(name, got, x), _row_error(name, want, x)
    if name.startswith("adaptive"):
        worse = e_got > e_want * (1 + ADAPTIVE_ROW_SLACK) + 1e-7
        assert not bool(worse.any()), (
            f"{name} d={dim}: {int(worse.sum())} rows worse on CUDA, e.g. {float(e_got[worse][0])} vs "
            f"{float(e_want[worse][0])}; {replay_seed}"
        )
    else:
        assert float(e_got.mean()) <= float(e_want.mean()) * (1 + KMEANS_MEAN_SLACK), (name, dim, replay_seed)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("name", ALL)
def test_decoding_on_cuda_gives_the_cpu_decoders_floats(name: str, dim: int, replay_seed: ReplaySeed) -> None:
    x = _rows(replay_seed.torch_generator(), 1031, dim)
    enc = _cpu_reference(name, x)
    old = set_force_torch(True)
    try:
        want = get_codec(name).decode(enc, dim)
    finally:
        set_force_torch(old)
    got = get_codec(name).decode(enc.cuda(), dim)
    assert got.device.type == "cuda"
    got = got.cpu()
    differ = (got.view(torch.int32) != want.view(torch.int32)).any(dim=1)
    assert not bool(differ.any()), (
        f"{name} d={dim}: {int(differ.sum())} rows differ, max |diff| {float((got - want).abs().max())}; {replay_seed}"
    )
