"""The fused numba kernel of the fast adaptive search (ckpt/quant/adaptive_kernel.py).

Its bytes must be IDENTICAL to the torch reference (``fast_encode_torch``), not merely close: both
are the same IEEE fp32 operations in the same order. Also: the codec refuses the same rows either
way, the kernel is thread-safe and releases the GIL, the fast search's quality, and the codec's
search/impl parameters. No timing is asserted anywhere.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import pytest
import torch
from hypothesis import HealthCheck, given, settings

pytest.importorskip("numba", reason="numba not installed: the fused adaptive kernel is unavailable")

from ckpt.quant import RowRangeError, adaptive_kernel, get_codec  # noqa: E402
from ckpt.quant.adaptive import (  # noqa: E402
    FAST_NBINS,
    FAST_RATIO,
    FAST_REFITS,
    AdaptiveCodec,
    fast_encode_torch,
    search_steps,
)
from ckpt.quant.adaptive_kernel import block_rows  # noqa: E402
from ckpt.quant.bitpack import packed_bytes  # noqa: E402
from ckpt.quant.uniform import set_force_torch  # noqa: E402

from .test_quant_codecs import batches  # noqa: E402

if TYPE_CHECKING:
    from tests.conftest import ReplaySeed

BITS = [2, 3, 4]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _kernel(x: torch.Tensor, bits: int, nbins=None, ratio=None, refits=None) -> torch.Tensor:
    nbins = FAST_NBINS[bits] if nbins is None else nbins
    ratio = FAST_RATIO[bits] if ratio is None else ratio
    refits = FAST_REFITS[bits] if refits is None else refits
    return adaptive_kernel.encode_rows(x.contiguous(), bits, nbins, search_steps(nbins, ratio), refits)


def _reference(x: torch.Tensor, bits: int, nbins=None, ratio=None, refits=None) -> torch.Tensor:
    nbins = FAST_NBINS[bits] if nbins is None else nbins
    ratio = FAST_RATIO[bits] if ratio is None else ratio
    refits = FAST_REFITS[bits] if refits is None else refits
    return fast_encode_torch(x, bits, nbins, ratio, refits)


def _assert_same_bytes(x: torch.Tensor, bits: int, kern: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """torch.equal, with the first differing row (input and both encodings) when it fails."""
    assert kern.dtype == ref.dtype == torch.uint8 and kern.shape == ref.shape, (kern.shape, ref.shape)
    if torch.equal(kern, ref):
        return
    bad = (kern != ref).any(1).nonzero().flatten()
    i = int(bad[0])
    raise AssertionError(
        f"{what} bits={bits} shape={tuple(x.shape)}: {bad.numel()} rows differ; first row {i}:\n"
        f"  x      = {x[i].tolist()}\n"
        f"  kernel = {bytes(kern[i].tolist()).hex()}\n"
        f"  torch  = {bytes(ref[i].tolist()).hex()}"
    )


def _check(x: torch.Tensor, bits: int, what: str = "", **params) -> torch.Tensor:
    kern = _kernel(x, bits, **params)
    _assert_same_bytes(x, bits, kern, _reference(x, bits, **params), what)
    return kern


def _scales_bits(enc: torch.Tensor) -> torch.Tensor:
    """The fp16 bit pattern (int) of each row's stored scale."""
    return enc[:, -4:-2].contiguous().view(torch.int16).flatten().int() & 0xFFFF


KINDS = ("normal", "cube", "student_t2", "tiny", "near_max", "near_max_edge", "neg_zero", "outlier", "constant", "zero")


def _rows(kind: str, n: int, dim: int, g: torch.Generator, seed: int) -> torch.Tensor:
    """n rows of one kind of input (every one within asymN's fp16 range)."""
    if kind == "normal":
        return torch.randn(n, dim, generator=g)
    if kind == "cube":  # heavy tails
        return torch.randn(n, dim, generator=g) ** 3
    if kind == "student_t2":  # heavier tails still (infinite variance)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return torch.distributions.StudentT(2.0).sample((n, dim)).clamp_(-30000.0, 30000.0)
    if kind == "tiny":  # ranges ~1e-6: fp16-subnormal scales (and biases)
        return torch.randn(n, dim, generator=g) * 1e-6
    if kind == "near_max":  # |x| up to 30000: scales in the thousands, biases near -30000
        x = (torch.rand(n, dim, generator=g) * 2 - 1) * 30000.0
        if dim > 1:
            x[::2, 0], x[::2, -1] = 30000.0, -30000.0
        return x
    if kind == "near_max_edge":  # rows within [60000, 65504] or [-65504, -60000]: fp16 bias at the edge
        x = 60000.0 + torch.rand(n, dim, generator=g) * 5504.0
        return torch.where(torch.rand(n, 1, generator=g) < 0.5, x, -x)
    if kind == "neg_zero":  # -0.0 entries, often the row's minimum; rows of mixed -0.0 / +0.0
        x = torch.randn(n, dim, generator=g).abs_()
        x[torch.rand(n, dim, generator=g) < 0.3] = -0.0
        x[::3] = torch.where(torch.rand(x[::3].shape, generator=g) < 0.5, -0.0, 0.0)
        x[1::5] = -x[1::5]  # negative rows with +0.0 as their maximum
        return x
    if kind == "outlier":  # small rows with one huge value each
        x = torch.randn(n, dim, generator=g) * 0.01
        pos = torch.randint(0, dim, (n,), generator=g)
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        x[torch.arange(n), pos] = sign * 10.0 ** (torch.rand(n, generator=g) * 2 + 2)  # 1e2 .. 1e4
        return x
    if kind == "constant":  # not fp16-representable constants
        return (torch.randn(n, 1, generator=g) * 3).expand(n, dim).clone()
    if kind == "zero":
        return torch.zeros(n, dim)
    raise AssertionError(kind)


def _mixed(n: int, dim: int, seed: int) -> torch.Tensor:
    """n rows, each of a random kind: every kind shares blocks (SIMD lanes) with the others."""
    g = torch.Generator().manual_seed(seed)
    which = torch.randint(0, len(KINDS), (n,), generator=g)
    x = torch.empty(n, dim)
    for k, kind in enumerate(KINDS):
        sel = (which == k).nonzero().flatten()
        if sel.numel():
            x[sel] = _rows(kind, int(sel.numel()), dim, g, seed + k)
    return x


# dims: where block_rows(dim) changes (and the dim before), its clamps, odd and packing-edge dims
_BOUNDARY_DIMS = {d for d in range(2, 301) if block_rows(d) != block_rows(d - 1)}
DIMS = sorted(
    _BOUNDARY_DIMS
    | {d - 1 for d in _BOUNDARY_DIMS}
    | {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 31, 63, 64, 96, 127, 200, 255, 256, 257, 300}
)


# ---------------------------------------------------------------------------------------------
# kernel bytes == torch reference bytes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=batches(max_n=20, max_dim=70))
def test_kernel_matches_reference_hypothesis(bits, x):
    _check(x, bits, "hypothesis batch")


@pytest.mark.parametrize("bits", BITS)
def test_kernel_matches_reference_seeded_dims(bits, replay_seed: ReplaySeed):
    # every dim of DIMS (1..300, block_rows boundaries), row counts block_rows*k +- 1 (a partial
    # last block, or one row past a full one), each row of a random kind
    seed = replay_seed.value
    print(f"seed={seed}")
    rng = replay_seed.rng()
    dims = DIMS + rng.sample(range(1, 301), 16)
    for dim in dims:
        n = max(1, block_rows(dim) * rng.choice([1, 2]) + rng.choice([-1, 1]))
        s = rng.randrange(1 << 31)
        _check(_mixed(n, dim, s), bits, f"seed={seed} dim={dim} n={n} batch_seed={s}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", BITS)
def test_kernel_matches_reference_each_kind(bits, kind, replay_seed: ReplaySeed):
    # one kind per batch, so each is certainly present
    seed = replay_seed.value
    print(f"seed={seed}")
    for dim in (3, 16, 17, 64, 129, 300):
        n = block_rows(dim) + 1
        g = torch.Generator().manual_seed(seed + dim)
        x = _rows(kind, n, dim, g, seed + dim)
        enc = _check(x, bits, f"seed={seed} kind={kind} dim={dim} n={n}")
        if kind == "tiny":  # the case is what it claims: fp16-subnormal scales (exponent field 0)
            assert ((_scales_bits(enc) & 0x7C00) == 0).float().mean() > 0.5, f"seed={seed}"
        if kind == "neg_zero" and dim >= 16:
            assert (x.signbit() & (x == 0)).any(1).float().mean() > 0.5, f"seed={seed}"


@pytest.mark.parametrize("bits", BITS)
def test_kernel_matches_reference_negative_zero_rows(bits):
    # which zero is "the minimum" is not defined: both must store bias +0.0 for zero rows, never
    # -0.0 (asymN stores -0.0 when a row's min is -0.0; both decode to the same values)
    x = torch.tensor(
        [
            [-0.0, -0.0, -0.0, -0.0, -0.0],
            [-0.0, 0.0, -0.0, 0.0, -0.0],
            [0.0, -0.0, 0.0, -0.0, 0.0],
            [-0.0, 0.5, 1.0, 0.25, 0.0],
            [0.0, -0.5, -1.0, -0.0, -0.25],
        ]
    )
    enc = _check(x, bits, "negative zeros")
    bias_bits = enc[:, -2:].contiguous().view(torch.int16).flatten().int() & 0xFFFF
    assert bias_bits[:3].tolist() == [0, 0, 0]  # +0.0, not 0x8000
    assert torch.equal(AdaptiveCodec(bits).decode(enc, 5)[:3], torch.zeros(3, 5))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("nbins,ratio,refits", [(7, 0.3, 0), (1, 1.0, 1), (40, 0.6, 5), (200, 0.84, 2)])
def test_kernel_matches_reference_other_parameters(bits, nbins, ratio, refits):
    # refits 0 (no refit pass), no greedy step at all, many refits, a long path
    x = _mixed(200, 37, seed=100 + bits)
    _check(x, bits, f"nbins={nbins} ratio={ratio} refits={refits}", nbins=nbins, ratio=ratio, refits=refits)


def test_kernel_empty_batch():
    for bits in BITS:
        for dim in (1, 9, 64):
            enc = _kernel(torch.empty(0, dim), bits)
            assert enc.dtype == torch.uint8 and tuple(enc.shape) == (0, packed_bytes(dim, bits) + 4)
            assert torch.equal(enc, _reference(torch.empty(0, dim), bits))


# ---------------------------------------------------------------------------------------------
# codec level: same bytes, same refusals
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
def test_codec_kernel_and_torch_impls_encode_the_same(bits, replay_seed: ReplaySeed):
    seed = replay_seed.value
    print(f"seed={seed}")
    kern, ref = AdaptiveCodec(bits, impl="kernel"), AdaptiveCodec(bits, impl="torch")
    for dim in (1, 5, 33, 64, 130):
        x = _mixed(3 * block_rows(dim) - 1, dim, seed + dim)
        a = kern.encode(x, table="t", row_ids=torch.arange(x.shape[0]))
        _assert_same_bytes(x, bits, a, ref.encode(x), f"seed={seed} dim={dim}")
        # the default codec (impl auto: the kernel on CPU) is the same codec
        assert torch.equal(get_codec(f"adaptive{bits}").encode(x), a), f"seed={seed} dim={dim}"
        # input conversions happen before either impl: float64, non-contiguous views
        assert torch.equal(kern.encode(x.double()), a) and torch.equal(ref.encode(x.t().contiguous().t()), a)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("bad", ["scale", "bias", "both", "scale_edge"])
def test_codec_fp16_overflow_refused_like_asym(bits, bad, replay_seed: ReplaySeed):
    # rows whose plain asymN fp16 scale or bias overflows: asymN refuses them, and so do both impls
    # of the fast search -- the same error for the same rows. scale_edge: the plain scale just
    # overflows (max = 1.01 x 65520 x qmax) where a clipped range would fit: refused all the same
    qmax = (1 << bits) - 1
    row = {"scale": [1e6], "bias": [-1e6], "both": [-1e6, 1e6], "scale_edge": [1.01 * 65520 * qmax]}[bad]
    x = torch.randn(6, 8, generator=replay_seed.torch_generator())
    x[2, : len(row)] = torch.tensor(row)
    x[4, -len(row) :] = torch.tensor(row)
    refused = []
    for c in (get_codec(f"asym{bits}"), AdaptiveCodec(bits, impl="kernel"), AdaptiveCodec(bits, impl="torch")):
        with pytest.raises(RowRangeError) as ei:
            c.encode(x, table="t_item", row_ids=torch.arange(6) + 40)
        e = ei.value
        assert "table 't_item' row 42 (global id)" in str(e) and c.name in str(e), (str(e), replay_seed)
        refused.append((e.table, e.index, e.row, e.n_bad, str(e).replace(c.name, "CODEC")))
    assert refused[0][1:4] == (2, 42, 2), (refused, replay_seed)
    assert refused[1] == refused[0] and refused[2] == refused[0], (refused, replay_seed)


def test_codec_accepts_what_asym_accepts_at_the_fp16_edge():
    # [0, 70000]: fp16 bias 0, scale 70000/15 = 4667 -- representable, so accepted by asym4 and by
    # both impls of adaptive4 (with the same bytes); the mirrored row's bias -70000 is not
    ok = torch.tensor([[0.0, 70000.0, 1.0, 2.0], [60000.0, 65504.0, 61000.0, 65000.0]])
    a = AdaptiveCodec(4, impl="kernel").encode(ok)
    assert torch.equal(a, AdaptiveCodec(4, impl="torch").encode(ok))
    get_codec("asym4").encode(ok)
    for impl in ("kernel", "torch"):
        with pytest.raises(RowRangeError):
            AdaptiveCodec(4, impl=impl).encode(-ok[:1])


# ---------------------------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------------------------


def test_kernel_is_thread_safe_and_compiled_nogil():
    from ckpt.quant import adaptive_numba

    # every jitted function of the kernel is compiled to release the GIL (nogil=True)
    jitted = [v for v in vars(adaptive_numba).values() if hasattr(v, "targetoptions")]
    assert adaptive_numba.encode in jitted and len(jitted) >= 5
    assert all(f.targetoptions.get("nogil") for f in jitted), [f.__name__ for f in jitted]

    # two different large batches encoded concurrently give the sequential results
    a = _mixed(20000, 64, seed=1)
    b = _mixed(9000, 129, seed=2)
    want = {"a": _kernel(a, 4), "b": _kernel(b, 2)}
    codec_a, codec_b = AdaptiveCodec(4, impl="kernel"), AdaptiveCodec(2, impl="kernel")
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(key, codec, x):
        try:
            start.wait()
            for _ in range(3):
                got[key].append(codec.encode(x))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [
        threading.Thread(target=work, args=("a", codec_a, a)),
        threading.Thread(target=work, args=("b", codec_b, b)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    for key in ("a", "b"):
        assert len(got[key]) == 3
        assert all(torch.equal(enc, want[key]) for enc in got[key]), key


# ---------------------------------------------------------------------------------------------
# quality (no timing)
# ---------------------------------------------------------------------------------------------


def _mean_l2(codec, x: torch.Tensor) -> float:
    return float((codec.decode(codec.encode(x), x.shape[1]) - x).norm(dim=1).mean())


def _student_t3(n: int, dim: int, seed: int) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.distributions.StudentT(3.0).sample((n, dim))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dist", ["gaussian", "student_t3"])
def test_fast_search_quality_vs_greedy_and_asym(bits, dist):
    # mean row L2 error, 4096 x 64 (seed 0), measured when written (fast / greedy / asym):
    #   gaussian   2-bit 2.5457 / 2.5598 / 3.5690   3-bit 1.3045 / 1.3071 / 1.5231   4-bit 0.6447 / 0.6476 / 0.7100
    #   student_t3 2-bit 5.4058 / 5.4463 / 8.0841   3-bit 2.9433 / 2.9606 / 3.4513   4-bit 1.4716 / 1.4809 / 1.6133
    # i.e. fast / greedy = 0.993 .. 0.998: the fast search is never worse than the greedy one here
    if dist == "gaussian":
        x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    else:
        x = _student_t3(4096, 64, seed=0)
    fast = _mean_l2(AdaptiveCodec(bits), x)
    greedy = _mean_l2(AdaptiveCodec(bits, search="greedy"), x)
    asym = _mean_l2(get_codec(f"asym{bits}"), x)
    assert fast <= greedy * 1.0, (fast, greedy)
    assert fast < asym, (fast, asym)


# ---------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------


def test_codec_parameters_validated():
    with pytest.raises(ValueError, match="impl"):
        AdaptiveCodec(4, impl="bogus")
    with pytest.raises(ValueError, match="search"):
        AdaptiveCodec(4, search="bogus")
    with pytest.raises(ValueError, match="refits"):
        AdaptiveCodec(4, refits=-1)
    with pytest.raises(ValueError):
        AdaptiveCodec(4, nbins=0)
    with pytest.raises(ValueError):
        AdaptiveCodec(4, ratio=0.0)
    c = AdaptiveCodec(3)
    defaults = ("fast", "auto", FAST_NBINS[3], FAST_RATIO[3], FAST_REFITS[3])
    assert (c.search, c.impl, c.nbins, c.ratio, c.refits) == defaults
    assert AdaptiveCodec(3, refits=0).refits == 0
    assert AdaptiveCodec(3, search="greedy", refits=4).refits == 0  # refits do not apply to greedy


def test_uses_kernel_follows_impl_and_force_torch():
    x = torch.randn(3, 8)
    assert AdaptiveCodec(4, impl="kernel").uses_kernel(x) is True
    assert AdaptiveCodec(4).uses_kernel(x) is True  # auto, numba present, CPU
    assert AdaptiveCodec(4, impl="torch").uses_kernel(x) is False
    assert AdaptiveCodec(4, search="greedy").uses_kernel(x) is False
    old = set_force_torch(True)
    try:
        assert AdaptiveCodec(4).uses_kernel(x) is False  # auto follows the package's switch
        assert AdaptiveCodec(4, impl="torch").uses_kernel(x) is False
        assert AdaptiveCodec(4, impl="kernel").uses_kernel(x) is True  # an explicit impl is forced
    finally:
        set_force_torch(old)


@pytest.mark.parametrize(
    "impl,force_torch,search,expect_kernel",
    [
        ("auto", False, "fast", True),
        ("auto", True, "fast", False),
        ("kernel", True, "fast", True),
        ("torch", False, "fast", False),
        ("auto", False, "greedy", False),
    ],
)
def test_encode_runs_the_impl_uses_kernel_says(monkeypatch, impl, force_torch, search, expect_kernel):
    # uses_kernel is what encode does: count the kernel's calls
    calls = []
    real = adaptive_kernel.encode_rows_checked

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(adaptive_kernel, "encode_rows_checked", spy)
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(3))
    old = set_force_torch(force_torch)
    try:
        c = AdaptiveCodec(4, search=search, impl=impl)
        assert c.uses_kernel(x) is expect_kernel
        enc = c.encode(x)
    finally:
        set_force_torch(old)
    assert calls == ([x.shape] if expect_kernel else [])
    if search == "fast":
        assert torch.equal(enc, AdaptiveCodec(4, impl="torch").encode(x))


def test_the_kernel_reports_non_finite_rows_and_fp16_overflow_for_the_codec_to_refuse():
    # the codec reads no row twice: the kernel's row sums and fp16 fields say what to refuse
    from ckpt.quant import NonFiniteRowError

    x = torch.randn(70, 8, generator=torch.Generator().manual_seed(5))  # two blocks at d = 8
    x[66, 1], x[68, 7] = float("nan"), float("-inf")
    _, checks = adaptive_kernel.encode_rows_checked(x, 4, 50, 4, 2)
    assert checks.sums_not_finite == 2
    with pytest.raises(NonFiniteRowError) as ei:
        AdaptiveCodec(4, impl="kernel").encode(x, table="t", row_ids=torch.arange(70) + 1000)
    assert (ei.value.row, ei.value.n_bad) == (1066, 2)
    huge = torch.full((3, 8), 1e38)  # finite, but the sums overflow and the fp16 fields cannot hold it
    huge[0] = 1.0
    _, checks = adaptive_kernel.encode_rows_checked(huge, 4, 50, 4, 2)
    assert checks == adaptive_kernel.KernelChecks(2, 2, 1)
    with pytest.raises(RowRangeError) as er:
        AdaptiveCodec(4, impl="kernel").encode(huge, table="t")
    assert (er.value.index, er.value.n_bad) == (1, 2)
    assert adaptive_kernel.encode_rows_checked(x[:60], 4, 50, 4, 2)[1] == adaptive_kernel.KernelChecks(0, 0, 0)
