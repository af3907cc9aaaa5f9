"""Adaptive asymmetric quantization: the range searches (fast: the default; greedy: fbgemm's) and their
guarantees. Kernel-vs-reference byte identity of the fast search: test_quant_adaptive_kernel.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt.quant import adaptive_kernel, get_codec
from ckpt.quant.adaptive import AdaptiveCodec, greedy_range_search, search_steps
from ckpt.quant.uniform import decode_nbit, encode_nbit_with_range

from .test_quant_codecs import batches

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _row_l2(name: str, x: torch.Tensor) -> torch.Tensor:
    c = get_codec(name)
    return (c.decode(c.encode(x), x.shape[1]) - x).norm(dim=1)


@pytest.mark.parametrize("bits", [2, 3, 4])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=batches(max_n=12, max_dim=48))
def test_adaptive_never_worse_than_asym_on_any_row(bits, x):
    ea, ep = _row_l2(f"adaptive{bits}", x), _row_l2(f"asym{bits}", x)
    assert (ea <= ep).all(), (ea - ep).max()


@pytest.mark.parametrize("impl", ["kernel", "torch"])
@pytest.mark.parametrize("bits", [2, 3, 4])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=batches(max_n=12, max_dim=48))
def test_fast_search_never_worse_than_asym_on_any_row(bits, impl, x):
    # the fast search, each implementation (the kernel and the torch reference), measured by
    # torch's norm (another summation order than the search's own): never above plain asymN
    if impl == "kernel" and not adaptive_kernel.AVAILABLE:
        pytest.skip("numba not installed: the adaptive kernel is unavailable")
    c, asym = AdaptiveCodec(bits, impl=impl), get_codec(f"asym{bits}")
    assert c.search == "fast"
    ea = (c.decode(c.encode(x), x.shape[1]) - x).norm(dim=1)
    ep = (asym.decode(asym.encode(x), x.shape[1]) - x).norm(dim=1)
    assert (ea <= ep).all(), (ea - ep).max()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_adaptive_never_worse_and_mostly_better_large(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.cat([torch.randn(1500, 64, generator=g), torch.randn(500, 37, generator=g)[:, :37].repeat(1, 2)[:, :64]])
    x[::9] *= 50.0
    ea, ep = _row_l2(f"adaptive{bits}", x), _row_l2(f"asym{bits}", x)
    assert (ea <= ep).all()
    assert (ea < ep).float().mean() > 0.8  # the search does find better ranges
    assert ea.mean() < {2: 0.8, 3: 0.92, 4: 0.95}[bits] * ep.mean()


def test_adaptive4_matches_torch_optimized_qparams():
    # torch's embedding_bag_4bit_prepack(optimized_qparams=True) runs fbgemm's greedy search with
    # nbins=200 and ratio 0.16 removed: our greedy search's defaults are the same search, vectorised
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(7))
    ref = torch.ops.quantized.embedding_bag_4bit_prepack(x, True)
    c = AdaptiveCodec(4, search="greedy")
    assert (c.nbins, c.ratio) == (200, 0.84)
    ours = c.encode(x)
    e_ref = (torch.ops.quantized.embedding_bag_4bit_unpack(ref) - x).norm(dim=1)
    e_ours = (c.decode(ours, 64) - x).norm(dim=1)
    assert (e_ours <= e_ref * (1 + 1e-6)).all()
    assert torch.equal(ours, ref)  # same layout, same ranges


def _greedy_reference(row: torch.Tensor, bits: int, nbins: int, ratio: float):
    """Per-row scalar transcription of Check-N-Run's greedy search (slow; for testing)."""

    def err(a: float, b: float) -> float:
        enc = encode_nbit_with_range(row[None], bits, torch.tensor([a]), torch.tensor([b]))
        return float((decode_nbit(enc, bits, row.numel())[0] - row).norm())

    lo, hi = float(row.min()), float(row.max())
    step = (hi - lo) / nbins
    best = (err(lo, hi), lo, hi)
    a, b = lo, hi
    for _ in range(search_steps(nbins, ratio)):
        e_up, e_down = err(a + step, b), err(a, b - step)
        if e_up < e_down:
            a, cur = a + step, e_up
        else:
            b, cur = b - step, e_down
        if cur < best[0]:
            best = (cur, a, b)
    return best


@pytest.mark.parametrize("bits,nbins,ratio", [(4, 200, 0.84), (3, 50, 0.7), (2, 40, 0.5)])
def test_vectorised_search_matches_scalar_reference(bits, nbins, ratio):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(6, 24, generator=g) ** 3
    lo, hi = greedy_range_search(x, bits, nbins, ratio)
    for i in range(x.shape[0]):
        e_ref, a, b = _greedy_reference(x[i], bits, nbins, ratio)
        enc = encode_nbit_with_range(x[i : i + 1], bits, lo[i : i + 1], hi[i : i + 1])
        e_vec = float((decode_nbit(enc, bits, 24)[0] - x[i]).norm())
        assert e_vec == pytest.approx(e_ref, rel=1e-5, abs=1e-7), (i, (a, b), (lo[i], hi[i]))


def test_search_range_limits():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(9))
    mn, mx = x.amin(1), x.amax(1)
    lo, hi = greedy_range_search(x, 2, nbins=100, ratio=0.5)
    assert (lo >= mn).all() and (hi <= mx).all()
    assert ((hi - lo) >= 0.5 * (mx - mn) - 1e-5).all()  # never below ratio x range
    assert ((lo > mn) | (hi < mx)).float().mean() > 0.9  # 2-bit: almost every row clips
    # ratio 1: no step is taken, the range is the plain [min, max]
    lo1, hi1 = greedy_range_search(x, 4, nbins=200, ratio=1.0)
    assert torch.equal(lo1, mn) and torch.equal(hi1, mx)
    assert search_steps(200, 0.84) == 32 and search_steps(200, 1.0) == 0 and search_steps(10, 0.05) == 10


def test_search_chunking_is_invisible():
    x = torch.randn(700, 16, generator=torch.Generator().manual_seed(10))
    a = greedy_range_search(x, 3, chunk_rows=64)
    b = greedy_range_search(x, 3, chunk_rows=4096)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_adaptive_decodes_as_asym():
    x = torch.randn(20, 12, generator=torch.Generator().manual_seed(11))
    for bits in (2, 3, 4):
        enc = get_codec(f"adaptive{bits}").encode(x)
        assert torch.equal(get_codec(f"adaptive{bits}").decode(enc, 12), get_codec(f"asym{bits}").decode(enc, 12))


def test_adaptive_parameters_validated():
    with pytest.raises(ValueError):
        AdaptiveCodec(8)
    with pytest.raises(ValueError):
        greedy_range_search(torch.randn(2, 4), 4, ratio=0.0)
    with pytest.raises(ValueError):
        greedy_range_search(torch.randn(2, 4), 4, nbins=0)


@settings(max_examples=20, deadline=None)
@given(scale=st.sampled_from([1e-6, 1e-3, 1.0, 1e3]), seed=st.integers(0, 1000))
def test_deeper_search_never_hurts(scale, seed):
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed)) * scale
    # the greedy search only: the fast one's refits start from the path's best point, so a longer
    # path does not bound its result
    shallow = AdaptiveCodec(2, ratio=0.9, search="greedy")
    deep = AdaptiveCodec(2, ratio=0.4, search="greedy")
    es = (shallow.decode(shallow.encode(x), 32) - x).norm(dim=1)
    ed = (deep.decode(deep.encode(x), 32) - x).norm(dim=1)
    # the deeper search walks the same greedy path further and keeps the best point seen
    assert (ed <= es * (1 + 1e-6) + 1e-12).all()
