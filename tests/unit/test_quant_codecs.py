"""Round trips, error bounds, shapes and edge cases of every row codec (ckpt/quant)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt.quant import NonFiniteRowError, codec_names, encode_owned, get_codec
from ckpt.quant.adaptive import DEFAULT_RATIO
from ckpt.quant.base import view_bytes_as
from ckpt.quant.bitpack import packed_bytes, unpack_bits
from ckpt.quant.uniform import fbgemm_available, set_force_torch

if TYPE_CHECKING:
    from tests.conftest import ReplaySeed

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALL = codec_names()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


@st.composite
def batches(draw, max_n: int = 10, max_dim: int = 40) -> torch.Tensor:
    """Random float32 [n, dim] batches with constant rows, all-zero rows, odd dims, n in {0, 1, ...}."""
    n = draw(st.integers(0, max_n))
    dim = draw(st.integers(1, max_dim))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-7, 1e-3, 0.05, 1.0, 30.0, 2000.0]))
    offset = draw(st.sampled_from([0.0, 0.37, -3.0, 100.0]))
    kind = draw(st.sampled_from(["normal", "uniform", "heavy", "ints"]))
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(n, dim, generator=g)
    elif kind == "uniform":
        x = torch.rand(n, dim, generator=g) * 2 - 1
    elif kind == "heavy":  # a few large outliers: what the adaptive range search is for
        x = torch.randn(n, dim, generator=g) ** 3
    else:
        x = torch.randint(-4, 5, (n, dim), generator=g).float()
    x = (x * scale + offset).clamp_(-30000.0, 30000.0)  # fp16 metadata range (RowRangeError tested apart)
    if n:
        special = torch.randint(0, 4, (n,), generator=g)
        x[special == 1] = draw(st.sampled_from([0.3, -7.25, 1e-5, 42.0]))  # constant rows
        x[special == 2] = 0.0  # all-zero rows
    return x.contiguous()


explicit_rows = (
    st.integers(1, 9)
    .flatmap(
        lambda d: st.lists(
            st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=d, max_size=d),
            min_size=1,
            max_size=4,
        )
    )
    .map(lambda rows: torch.tensor(rows, dtype=torch.float32))
)


# ---------------------------------------------------------------------------------------------
# error bounds
# ---------------------------------------------------------------------------------------------


def _rowstats(x: torch.Tensor):
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    return lo, hi, hi - lo, x.abs().amax(1, keepdim=True)


def max_abs_error_bound(name: str, x: torch.Tensor) -> torch.Tensor:
    """Per-row bound on |decode(encode(x)) - x|, [n, 1]."""
    lo, hi, rng, amax = _rowstats(x)
    if name == "fp32":
        return torch.zeros_like(amax)
    if name == "fp16":
        return amax * 2**-11 + 2**-25
    if name == "bf16":
        return amax * 2**-8 + 1e-38
    codec = get_codec(name)
    bits = codec.bits
    if name == "asym8":  # fp32 scale/bias; fbgemm's 1e-8 epsilon in the inverse scale
        return rng / 255 / 2 + 2**-20 * (rng + amax) + 2e-8
    if name.startswith("asym"):  # half a step + fp16 scale/bias slack
        return rng / ((1 << bits) - 1) / 2 + 2**-10 * (rng + amax) + 2**-18
    if name.startswith("sym"):
        Q = (1 << (bits - 1)) - 1
        if bits == 8:
            return amax / Q / 2 + 2**-20 * amax + 1e-30
        return amax / Q / 2 + 2**-10 * amax + 2**-18
    if name.startswith("adaptive"):  # clipped ends: at most (1-ratio) of the range, plus half a step
        return (1 - DEFAULT_RATIO[bits]) * rng + rng / ((1 << bits) - 1) / 2 + 2**-10 * (rng + amax) + 2**-18
    if name.startswith("kmeans"):  # centroids lie within [min, max] (up to fp16 rounding)
        return rng + 2**-10 * amax + 2**-18
    raise AssertionError(name)


def _roundtrip(name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = get_codec(name)
    enc = c.encode(x, table="t", row_ids=torch.arange(x.shape[0]) + 1000)
    assert enc.dtype == torch.uint8
    assert enc.is_contiguous()
    assert tuple(enc.shape) == (x.shape[0], c.row_bytes(x.shape[1]))
    dec = c.decode(enc, x.shape[1])
    assert dec.dtype == torch.float32 and dec.is_contiguous()
    assert tuple(dec.shape) == tuple(x.shape)
    return enc, dec


@pytest.mark.parametrize("name", ALL)
@FAST
@given(x=batches())
def test_roundtrip_within_bound(name, x):
    _, dec = _roundtrip(name, x)
    err = (dec - x).abs()
    bound = max_abs_error_bound(name, x)
    bad = err > bound
    assert not bad.any(), f"{name}: max error {err.max():.3g} above bound at {bad.nonzero()[:3].tolist()}"


@pytest.mark.parametrize("name", ["fp16", "bf16", "asym8", "asym4", "asym3", "asym2", "sym8", "sym4", "sym2"])
@settings(max_examples=30, deadline=None)
@given(x=explicit_rows)
def test_roundtrip_explicit_values(name, x):
    _, dec = _roundtrip(name, x)
    assert ((dec - x).abs() <= max_abs_error_bound(name, x)).all()


@pytest.mark.parametrize("name", ALL)
def test_empty_and_single_row(name):
    c = get_codec(name)
    for dim in (1, 7, 64):
        enc = c.encode(torch.empty(0, dim))
        assert tuple(enc.shape) == (0, c.row_bytes(dim)) and enc.dtype == torch.uint8
        assert tuple(c.decode(enc, dim).shape) == (0, dim)
        x = torch.linspace(-1, 2, dim).unsqueeze(0)
        _, dec = _roundtrip(name, x)
        assert ((dec - x).abs() <= max_abs_error_bound(name, x)).all()


@pytest.mark.parametrize("name", ALL)
def test_all_zero_rows_exact(name):
    x = torch.zeros(3, 13)
    _, dec = _roundtrip(name, x)
    assert torch.equal(dec, x)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("value", [0.25, -3.0, 1024.0])  # fp16-representable constants
def test_constant_rows_exact(name, value):
    x = torch.full((2, 11), value)
    _, dec = _roundtrip(name, x)
    assert torch.equal(dec, x), f"{name}: {dec[0, :3].tolist()}"


@pytest.mark.parametrize("name", ["fp32", "bf16", "asym8", "sym8"])
def test_constant_rows_exact_any_value(name):
    # fp32 metadata: any constant round-trips exactly (not only fp16-representable ones)
    x = torch.full((2, 9), 0.1) if name != "bf16" else torch.full((2, 9), 0.1).bfloat16().float()
    x[1] = -123.456 if name != "bf16" else torch.tensor(-123.456).bfloat16().float()
    _, dec = _roundtrip(name, x)
    assert torch.equal(dec, x)


def test_row_bytes_table():
    # stable on-stream sizes, dim 64 and an odd dim
    expect = {
        "fp32": (256, 28), "fp16": (128, 14), "bf16": (128, 14),
        "asym8": (72, 15), "asym4": (36, 8), "asym3": (28, 7), "asym2": (20, 6),
        "sym8": (68, 11), "sym4": (34, 6), "sym3": (26, 5), "sym2": (18, 4),
        "adaptive4": (36, 8), "adaptive3": (28, 7), "adaptive2": (20, 6),
        "kmeans4": (64, 36), "kmeans3": (40, 19), "kmeans2": (24, 10),
    }  # fmt: skip
    assert set(expect) == set(ALL)
    for name, (b64, b7) in expect.items():
        c = get_codec(name)
        assert (c.row_bytes(64), c.row_bytes(7)) == (b64, b7), name


@pytest.mark.parametrize("name", ALL)
def test_encode_does_not_alias_input(name, replay_seed: ReplaySeed):
    x = torch.randn(4, 8, generator=replay_seed.torch_generator())
    enc = get_codec(name).encode(x)
    before = enc.clone()
    x.fill_(5.0)
    assert torch.equal(enc, before), replay_seed


@pytest.mark.parametrize("name", ALL)
def test_encode_owned_gives_encodes_bytes_and_borrows_only_fp32_rows(name, replay_seed: ReplaySeed):
    """The writer owns its snapshot's rows until it releases them: fp32 frames are built from
    the rows themselves (no copy), every other codec's as `encode` makes them."""
    x = torch.randn(5, 8, generator=replay_seed.torch_generator())
    owned = encode_owned(get_codec(name), x, table="t")
    assert torch.equal(owned, get_codec(name).encode(x, table="t")), replay_seed
    assert (owned.data_ptr() == x.data_ptr()) == (name == "fp32"), replay_seed
    x[2, 3] = float("nan")
    with pytest.raises(NonFiniteRowError, match="table 't' row 2"):  # the same refusal as encode's
        encode_owned(get_codec(name), x, table="t")


@pytest.mark.parametrize("name", ["fp32", "asym4", "sym3", "kmeans2"])
def test_decode_does_not_alias_frame(name, replay_seed: ReplaySeed):
    c = get_codec(name)
    x = torch.randn(3, 8, generator=replay_seed.torch_generator())
    enc = c.encode(x)
    dec = c.decode(enc, 8)
    want = dec.clone()
    enc.fill_(0)
    assert torch.equal(dec, want), replay_seed


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("prefix", [3, 4, 8])
def test_decode_from_strided_frame_slice(name, prefix, replay_seed: ReplaySeed):
    # rows sliced out of a larger buffer (odd or aligned offsets, gaps between rows) still decode
    c = get_codec(name)
    x = torch.randn(3, 10, generator=replay_seed.torch_generator())
    enc = c.encode(x)
    frame = torch.cat([torch.zeros(3, prefix, dtype=torch.uint8), enc], 1)
    dec = c.decode(frame[:, prefix:], 10)
    assert dec.is_contiguous()
    torch.testing.assert_close(dec, c.decode(enc, 10), rtol=0, atol=0)
    frame.fill_(0)
    assert not torch.equal(dec, torch.zeros_like(dec)), replay_seed  # decoded rows do not alias the frame


@pytest.mark.parametrize("name", ALL)
def test_decode_rejects_wrong_width(name, replay_seed: ReplaySeed):
    c = get_codec(name)
    enc = c.encode(torch.randn(2, 16, generator=replay_seed.torch_generator()))
    with pytest.raises(ValueError, match="bytes"):
        c.decode(enc, 17)
    with pytest.raises(ValueError):
        c.decode(enc.float(), 16)


@pytest.mark.parametrize("name", ALL)
def test_encode_accepts_other_float_dtypes_and_strides(name, replay_seed: ReplaySeed):
    c = get_codec(name)
    x = torch.randn(8, 6, generator=replay_seed.torch_generator())
    ref = c.encode(x)
    assert torch.equal(c.encode(x.t().contiguous().t()), ref), replay_seed  # non-contiguous view
    assert torch.equal(c.encode(x.double()), ref), replay_seed  # float64 -> float32 first
    with pytest.raises(TypeError):
        c.encode(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError):
        c.encode(torch.ones(3))


# ---------------------------------------------------------------------------------------------
# fbgemm ops and the plain-torch (GPU / 3-bit) path agree
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not fbgemm_available(), reason="fbgemm_gpu not installed")
@pytest.mark.parametrize("name", ["asym8", "asym4", "asym2", "adaptive4", "adaptive2"])
@pytest.mark.parametrize("dim", [8, 16, 64, 96])
def test_fbgemm_and_torch_paths_match(name, dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(300, dim, generator=g) * torch.logspace(-4, 2, 300).unsqueeze(1)
    x[0] = 0.3
    x[1] = 0.0
    c = get_codec(name)
    fb = c.encode(x)
    old = set_force_torch(True)
    try:
        tq = c.encode(x)
        tdec = c.decode(fb, dim)
    finally:
        set_force_torch(old)
    fdec = c.decode(fb, dim)
    if name == "asym8":  # fbgemm's vectorised 8-bit kernel may round a tie the other way
        assert (fb.int() - tq.int()).abs().max() <= 1
        assert (fb != tq).float().mean() < 1e-3
    else:  # N-bit: bit-identical
        assert torch.equal(fb, tq)
    torch.testing.assert_close(tdec, fdec, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# family-specific properties
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_asym_codes_span_full_range(bits):
    # min maps to code 0 and max to the top code: the quantizer uses all 2^b levels
    c = get_codec(f"asym{bits}")
    x = torch.tensor([[-2.0, -0.5, 0.25, 1.0, 3.0, 0.0, 2.0, 1.5]])
    enc = c.encode(x)
    codes = unpack_bits(enc[:, : packed_bytes(8, bits)], bits, 8)
    assert codes[0, 0] == 0 and codes[0, 4] == (1 << bits) - 1


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_sym_zero_and_absmax_exact(bits):
    c = get_codec(f"sym{bits}")
    x = torch.tensor([[0.0, 0.5, -1.0, 0.2, 0.0, -0.3, 0.7], [4.0, -4.0, 0.0, 1.0, 2.0, 3.0, -1.0]])
    _, dec = _roundtrip(f"sym{bits}", x)
    assert dec[0, 0] == 0.0 and dec[1, 2] == 0.0  # zero exact (mid-tread)
    assert dec[0, 2] == -1.0 and dec[1, 0] == 4.0 and dec[1, 1] == -4.0  # +-absmax exact
    assert c.row_bytes(7) == packed_bytes(7, bits) + (4 if bits == 8 else 2)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_sym_is_worse_than_asym_on_skewed_rows(bits):
    # rows far from zero-centred: symmetric wastes half its levels, asymmetric does not
    x = torch.rand(256, 32, generator=torch.Generator().manual_seed(1)) + 1.0
    e = {}
    for fam in ("sym", "asym"):
        _, dec = _roundtrip(f"{fam}{bits}", x)
        e[fam] = (dec - x).norm(dim=1).mean().item()
    assert e["asym"] < 0.75 * e["sym"]


@pytest.mark.parametrize("bits", [2, 3, 4])
@settings(max_examples=25, deadline=None)
@given(x=batches(max_n=8, max_dim=33))
def test_kmeans_codes_pick_nearest_stored_centroid(bits, x):
    name = f"kmeans{bits}"
    enc, dec = _roundtrip(name, x)
    if x.shape[0] == 0:
        return
    P = packed_bytes(x.shape[1], bits)
    cents = view_bytes_as(enc[:, P:], torch.float16).float()  # [n, K]
    assert (cents[:, 1:] >= cents[:, :-1]).all(), "centroids must be ascending"
    nearest = (x.unsqueeze(2) - cents.unsqueeze(1)).abs().amin(2)
    assert ((dec - x).abs() <= nearest + 1e-6 * x.abs() + 1e-30).all()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_kmeans_beats_asym_on_average(bits):
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(2))
    e = {}
    for fam in ("kmeans", "asym"):
        _, dec = _roundtrip(f"{fam}{bits}", x)
        e[fam] = (dec - x).norm(dim=1)
    assert e["kmeans"].mean() < 0.97 * e["asym"].mean()
    assert (e["kmeans"] <= e["asym"] * 1.01 + 1e-6).float().mean() > 0.99


def test_l2_error_decreases_with_bits():
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(3))
    for fam, widths in (("asym", (2, 3, 4, 8)), ("sym", (2, 3, 4, 8)), ("adaptive", (2, 3, 4)), ("kmeans", (2, 3, 4))):
        errs = []
        for b in widths:
            _, dec = _roundtrip(f"{fam}{b}", x)
            errs.append((dec - x).norm(dim=1).mean().item())
        assert all(a > b for a, b in zip(errs, errs[1:])), (fam, errs)
        if fam in ("asym", "adaptive", "kmeans"):  # each extra bit roughly halves the error
            assert all(a / b > 1.6 for a, b in zip(errs, errs[1:3])), (fam, errs)


def test_codec_objects_are_stateless_across_calls():
    c = get_codec("adaptive3")
    x = torch.randn(50, 24, generator=torch.Generator().manual_seed(4))
    assert torch.equal(c.encode(x), c.encode(x))
    assert torch.equal(c.encode(x[:7]), c.encode(x)[:7])  # rows are independent


def test_bf16_fp16_bit_patterns():
    x = torch.tensor([[1.0, -2.5, 65504.0, 1e-8]])
    assert torch.equal(get_codec("fp16").encode(x), x.half().view(torch.uint8))
    assert torch.equal(get_codec("bf16").encode(x), x.bfloat16().view(torch.uint8))
    assert torch.equal(get_codec("fp32").encode(x), x.view(torch.uint8))


def test_large_batch_chunking_consistent():
    # the torch paths work in chunks; a batch larger than one chunk must equal row-by-row results
    x = torch.randn(9000, 40, generator=torch.Generator().manual_seed(5))
    for name in ("asym3", "sym4", "sym8"):
        c = get_codec(name)
        full = c.encode(x)
        assert torch.equal(full[-5:], c.encode(x[-5:]))
        assert torch.equal(full[:5], c.encode(x[:5]))
        assert math.isfinite(c.decode(full, 40).sum().item())
