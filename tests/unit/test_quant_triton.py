"""The fused Triton kernel of the fast adaptive search (ckpt/quant/adaptive_triton.py).

Its bytes must be IDENTICAL to the torch reference (``fast_encode_torch``): the same IEEE fp32
operations in the same order. On CPU tensors the kernel runs in triton's interpreter (numpy), which
is what checks it here; the interpreter cannot show an FMA contraction or an approximate division,
so the CUDA tests (``-m gpu``) compare the compiled kernel with the CPU reference bit for bit over
large batches. Also: its per-row flags make the codec refuse what the torch path refuses, with the
same errors; the codec's impl switch; and that no encode waits for the GPU. No timing is asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
import torch

pytest.importorskip("triton", reason="triton not installed: the adaptive Triton kernel is unavailable")

from ckpt.quant import NonFiniteRowError, RowRangeError  # noqa: E402
from ckpt.quant import adaptive_triton as at  # noqa: E402
from ckpt.quant.adaptive import (  # noqa: E402
    FAST_NBINS,
    FAST_RATIO,
    FAST_REFITS,
    AdaptiveCodec,
    fast_encode_torch,
    search_steps,
)
from ckpt.quant.bitpack import packed_bytes  # noqa: E402
from ckpt.quant.uniform import set_force_torch  # noqa: E402
from tests.devices import CUDA, NEEDS_CUDA  # noqa: E402

if TYPE_CHECKING:
    from tests.conftest import ReplaySeed

BITS = [2, 3, 4]
DIMS = [1, 2, 3, 7, 16, 31, 32, 33, 64, 100, 128, 255, 256, 300]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _params(bits: int, nbins=None, ratio=None, refits=None) -> tuple[int, float, int]:
    return (
        FAST_NBINS[bits] if nbins is None else nbins,
        FAST_RATIO[bits] if ratio is None else ratio,
        FAST_REFITS[bits] if refits is None else refits,
    )


def _triton(x: torch.Tensor, bits: int, **params) -> tuple[torch.Tensor, torch.Tensor]:
    nbins, ratio, refits = _params(bits, **params)
    return at.encode_rows_device(x, bits, nbins, search_steps(nbins, ratio), refits)


def _reference(x: torch.Tensor, bits: int, **params) -> torch.Tensor:
    """fast_encode_torch on the CPU; large batches (the CUDA tests') on every core."""
    nbins, ratio, refits = _params(bits, **params)
    old = torch.get_num_threads()
    if x.numel() > 1 << 20:
        torch.set_num_threads(os.cpu_count() or 1)
    try:
        return fast_encode_torch(x.cpu(), bits, nbins, ratio, refits)
    finally:
        torch.set_num_threads(old)


def _assert_same_bytes(x: torch.Tensor, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bytes equal on every row without NaN/Inf (those are refused; their bytes mean nothing)."""
    got, x = got.cpu(), x.cpu()
    assert got.dtype == want.dtype == torch.uint8 and got.shape == want.shape, (what, got.shape, want.shape)
    differ = (got != want).any(1) & torch.isfinite(x).all(1)
    if not bool(differ.any()):
        return
    i = int(differ.nonzero()[0])
    raise AssertionError(
        f"{what}: {int(differ.sum())} rows differ; first row {i}:\n  x      = {x[i].tolist()}\n"
        f"  triton = {bytes(got[i].tolist()).hex()}\n  torch  = {bytes(want[i].tolist()).hex()}"
    )


def _expected_flags(x: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """The flags the kernel must give, from the rows and the reference's bytes."""
    x = x.cpu()
    sums = torch.zeros(x.shape[0])
    for j in range(x.shape[1]):  # the row sum in element order, as the kernel takes it
        sums += x[:, j]
    meta = want[:, -4:].contiguous().view(torch.float16)
    nonfinite = ~torch.isfinite(x).all(1)
    meta_bad = ~torch.isfinite(meta).all(1) | nonfinite  # a NaN row's fields are NaN
    return (
        (~torch.isfinite(sums)).to(torch.uint8) * at.FLAG_SUM
        | meta_bad.to(torch.uint8) * at.FLAG_META
        | nonfinite.to(torch.uint8) * at.FLAG_NON_FINITE
    )


def _check(x: torch.Tensor, bits: int, what: str, **params) -> tuple[torch.Tensor, torch.Tensor]:
    got, flags = _triton(x, bits, **params)
    want = _reference(x, bits, **params)
    _assert_same_bytes(x, got, want, what)
    assert torch.equal(flags.cpu(), _expected_flags(x, want)), (what, flags.tolist())
    return got, flags


def _mixed(n: int, dim: int, g: torch.Generator) -> torch.Tensor:
    """n finite rows within asymN's fp16 range, of several kinds in every block: gaussian,
    heavy-tailed (x**3), constant (not fp16-representable), -0.0/+0.0 mixes, tiny (fp16-subnormal
    scales), near fp16's maximum, small rows with one large outlier."""
    x = torch.randn(n, dim, generator=g)
    kind = torch.randint(0, 8, (n,), generator=g)
    x[kind == 1] = x[kind == 1] ** 3
    const = kind == 2
    x[const] = (torch.randn(int(const.sum()), 1, generator=g) * 3).expand(-1, dim)
    zeros = kind == 3
    x[zeros] = torch.where(torch.rand(int(zeros.sum()), dim, generator=g) < 0.5, -0.0, 0.0)
    negz = kind == 4  # -0.0 often the row's minimum, or a negative row's maximum +0.0
    r = torch.randn(int(negz.sum()), dim, generator=g).abs()
    r[torch.rand(r.shape, generator=g) < 0.3] = -0.0
    r[::2] = -r[::2]
    x[negz] = r
    x[kind == 5] *= 1e-6
    big = kind == 6
    x[big] = (torch.rand(int(big.sum()), dim, generator=g) * 2 - 1) * 30000.0
    out = kind == 7
    x[out] *= 0.01
    if int(out.sum()):
        rows = out.nonzero().flatten()
        x[rows, torch.randint(0, dim, (rows.numel(),), generator=g)] = 10.0 ** (torch.rand(rows.numel(), generator=g) * 2 + 2)
    return x


def _edge_rows(dim: int, g: torch.Generator) -> tuple[torch.Tensor, dict[str, slice]]:
    """Rows at the edges, named: finite rows the codec accepts, finite rows it refuses (fp16
    overflow; sums that overflow fp32; rows whose candidates' errors are inf), NaN/Inf rows."""
    parts: dict[str, torch.Tensor] = {
        "constant": torch.full((4, dim), 0.3),
        "zeros": torch.where(torch.rand(4, dim, generator=g) < 0.5, -0.0, 0.0),
        "subnormal_scale": torch.randn(8, dim, generator=g) * 1e-6,
        "fp16_edge": 60000.0 + torch.rand(8, dim, generator=g) * 5504.0,  # bias near fp16's max
        "fp16_edge_neg": -60000.0 - torch.rand(4, dim, generator=g) * 5504.0,
        "fp16_overflow": torch.randn(4, dim, generator=g),  # scale or bias overflows fp16 (below)
        "fp16_overflow_const": torch.full((2, dim), 1e30),
        "huge": torch.randn(4, dim, generator=g) * 1e19,  # every candidate's error is inf
        "sum_overflow": torch.full((2, dim), 1e38),  # finite, but the row sum overflows (dim >= 4)
        "nan": torch.randn(3, dim, generator=g),
        "inf": torch.randn(3, dim, generator=g),
    }
    parts["fp16_edge"][::2, 0] = 65504.0
    parts["fp16_overflow"][0, 0], parts["fp16_overflow"][1, -1] = -1e6, 1e6  # bias; scale
    parts["fp16_overflow"][2, 0], parts["fp16_overflow"][2, -1] = -1e6, 1e6  # both
    parts["fp16_overflow"][3, 0] = 65520.0 * 16  # the plain scale just past fp16 at every width
    parts["nan"][:, dim // 2] = float("nan")
    parts["inf"][0, 0], parts["inf"][1, -1], parts["inf"][2, dim // 2] = float("inf"), float("-inf"), float("inf")
    names, at_row = {}, 0
    for name, rows in parts.items():
        names[name] = slice(at_row, at_row + rows.shape[0])
        at_row += rows.shape[0]
    return torch.cat(list(parts.values())), names


def _raised(codec, x: torch.Tensor, row_ids: torch.Tensor | None) -> tuple[type, int, int, int, str]:
    with pytest.raises((NonFiniteRowError, RowRangeError)) as ei:
        codec.encode(x, table="t_item", row_ids=row_ids)
    e = ei.value
    return type(e), e.index, e.row, e.n_bad, str(e)


# ---------------------------------------------------------------------------------------------
# the interpreter (CPU tensors): bytes == torch reference
# ---------------------------------------------------------------------------------------------


# The interpreter's cost is per operation (about 0.1 ms each, whatever the row count), i.e. per
# column and pass. 2- and 3-bit rows skip the wide dims that fill whole groups of codes (4 and 8)
# and whole 4-column loads: 64 takes the same code path, and the CUDA tests cover them.
CASES = [(bits, dim) for bits in BITS for dim in DIMS if bits == 4 or dim < 128 or dim % (8 // (bits & -bits)) or dim % 4]


@pytest.mark.parametrize("bits,dim", CASES)
def test_bytes_match_reference(bits: int, dim: int, replay_seed: ReplaySeed):
    # every dim: tails of the 4-column loads (dim % 4) and of the packing groups (2, 4 or 8 codes)
    n = 97 + replay_seed.rng().randrange(64)  # not a power of two: the block's last rows are masked
    x = _mixed(n, dim, replay_seed.torch_generator())
    _check(x, bits, f"bits={bits} dim={dim} n={n} {replay_seed}")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", [5, 64])
def test_edge_rows_bytes_and_flags(bits: int, dim: int, replay_seed: ReplaySeed):
    x, names = _edge_rows(dim, replay_seed.torch_generator())
    got, flags = _check(x, bits, f"edge rows bits={bits} dim={dim} {replay_seed}")
    f = flags.tolist()

    def of(name):
        return set(f[names[name]])

    for name in ("constant", "zeros", "subnormal_scale", "fp16_edge", "fp16_edge_neg"):
        assert of(name) == {0}, (name, f, replay_seed)
    for name in ("fp16_overflow", "fp16_overflow_const", "huge"):
        assert of(name) == {at.FLAG_META}, (name, f, replay_seed)
    assert of("sum_overflow") == {at.FLAG_SUM | at.FLAG_META}, (f, replay_seed)
    assert of("nan") == of("inf") == {at.FLAG_SUM | at.FLAG_META | at.FLAG_NON_FINITE}, (f, replay_seed)
    # the cases are what they claim: fp16-subnormal scales, +0.0 biases for zero rows
    scales = got[names["subnormal_scale"], -4:-2].contiguous().view(torch.int16).int() & 0x7C00
    assert bool((scales == 0).all()), replay_seed
    assert got[names["zeros"], -2:].eq(0).all(), "zero rows store bias +0.0, not -0.0"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("nbins,ratio,refits", [(7, 0.3, 0), (1, 1.0, 1), (40, 0.6, 5)])
def test_bytes_match_reference_other_parameters(bits, nbins, ratio, refits, replay_seed: ReplaySeed):
    # no refit pass, no greedy step at all, many refits
    x = _mixed(64, 13, replay_seed.torch_generator())
    _check(x, bits, f"nbins={nbins} ratio={ratio} refits={refits} {replay_seed}", nbins=nbins, ratio=ratio, refits=refits)


# no greedy step, no refit: plain asymN, whose range the search cannot move off the ties
PLAIN_ONLY = {"nbins": 1, "ratio": 1.0, "refits": 0}


def _tie_rows(bits: int, dim: int) -> tuple[torch.Tensor, list[int]]:
    """Rows of integers 0..qmax (shifted by -40 in the second half: scale 1, bias 0 or -40) with one
    value exactly halfway between two levels, whose rounding decides a code. Returns (rows, the
    expected code of each row's tie at column 1: half to even)."""
    qmax = (1 << bits) - 1
    base = (torch.arange(dim) % (qmax + 1)).float()
    base[0], base[-1] = 0.0, float(qmax)
    rows, codes = [], []
    for shift in (0.0, -40.0):
        for level in range(qmax):
            r = base.clone()
            r[1] = level + 0.5
            rows.append(r + shift)
            codes.append(level + (level % 2))  # half to even
    return torch.stack(rows), codes


@pytest.mark.parametrize("bits", BITS)
def test_ties_round_half_to_even(bits: int):
    x, codes = _tie_rows(bits, 40)
    got, _ = _check(x, bits, f"ties bits={bits}", **PLAIN_ONLY)
    first = got[:, 0].int()  # codes 0 and 1 of the row: element 1 in the bits after element 0's
    assert ((first >> bits) & ((1 << bits) - 1)).tolist() == codes
    assert got[:, -4:-2].contiguous().view(torch.float16).flatten().tolist() == [1.0] * len(codes)  # scale 1


def test_empty_batch_and_argument_checks():
    for bits in BITS:
        out, flags = _triton(torch.empty(0, 9), bits)
        assert tuple(out.shape) == (0, packed_bytes(9, bits) + 4) and tuple(flags.shape) == (0,)
    with pytest.raises(ValueError, match="contiguous float32"):
        _triton(torch.zeros(4, 8, dtype=torch.float64), 4)
    with pytest.raises(ValueError, match="contiguous float32"):
        _triton(torch.zeros(8, 4).t(), 4)
    with pytest.raises(ValueError, match="bits"):
        at.encode_rows_device(torch.zeros(4, 8), 8, 50, 4, 1)


# ---------------------------------------------------------------------------------------------
# refusals: the flags make the codec raise what the torch path raises
# ---------------------------------------------------------------------------------------------


def test_refuse_flagged_reads_bits_2_then_1():
    ids = torch.arange(6) + 100
    at.refuse_flagged(torch.zeros(6, dtype=torch.uint8), "t", ids, "adaptive4")  # nothing flagged
    at.refuse_flagged(torch.tensor([0, at.FLAG_SUM, 0], dtype=torch.uint8), "t", None, "adaptive4")  # sum alone
    meta = torch.tensor([0, 0, at.FLAG_META, 0, at.FLAG_META | at.FLAG_SUM, 0], dtype=torch.uint8)
    with pytest.raises(RowRangeError) as er:
        at.refuse_flagged(meta, "t", ids, "adaptive4")
    assert (er.value.index, er.value.row, er.value.n_bad, er.value.codec) == (2, 102, 2, "adaptive4")
    both = meta.clone()
    both[3] = both[5] = at.FLAG_NON_FINITE | at.FLAG_SUM | at.FLAG_META
    with pytest.raises(NonFiniteRowError) as en:  # NaN/Inf first, whatever the row order
        at.refuse_flagged(both, "t", ids, "adaptive4")
    assert (en.value.index, en.value.row, en.value.n_bad) == (3, 103, 2)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("case", ["nan_and_overflow", "fp16_overflow", "sum_overflow", "huge"])
def test_codec_refuses_like_the_torch_path(bits: int, case: str, replay_seed: ReplaySeed):
    # the same rows refused, with the same error, index, count and message, as impl="torch"
    g = replay_seed.torch_generator()
    x = torch.randn(12, 8, generator=g)
    if case == "nan_and_overflow":  # NaN/Inf rows are refused first, even after an overflowing row
        x[2, 3], x[5, 0], x[9, 7] = 1e6, float("nan"), float("-inf")
    elif case == "fp16_overflow":
        x[4, 1], x[7, 2] = -1e6, 1.01 * 65520 * ((1 << bits) - 1)
    elif case == "sum_overflow":  # finite: refused for its fp16 fields, not as NaN/Inf
        x[6] = 1e38
    else:
        x[3] = x[3] * 1e19
    ids = torch.arange(12) + 40
    want = _raised(AdaptiveCodec(bits, impl="torch"), x, ids)
    got = _raised(AdaptiveCodec(bits, impl="triton"), x, ids)
    assert got == want, (got, want, replay_seed)


# ---------------------------------------------------------------------------------------------
# the codec
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
def test_codec_triton_impl_encodes_like_torch_and_encode_device_defers(bits: int, replay_seed: ReplaySeed):
    x = _mixed(50, 19, replay_seed.torch_generator())
    a = AdaptiveCodec(bits, impl="triton").encode(x.double(), table="t", row_ids=torch.arange(50))
    assert torch.equal(a, AdaptiveCodec(bits, impl="torch").encode(x)), replay_seed
    out, flags = AdaptiveCodec(bits).encode_device(x.t().contiguous().t())  # any float rows: made contiguous
    assert torch.equal(out, a) and not bool(flags.any()), replay_seed
    bad = x.clone()
    bad[7, 0] = float("nan")
    out, flags = AdaptiveCodec(bits).encode_device(bad)  # refuses nothing itself: the flags say
    assert flags.nonzero().flatten().tolist() == [7]
    with pytest.raises(NonFiniteRowError):
        at.refuse_flagged(flags, "t", None, f"adaptive{bits}")
    with pytest.raises(ValueError, match="fast search"):
        AdaptiveCodec(bits, search="greedy").encode_device(x)


def test_uses_triton_follows_impl_and_force_torch():
    x = torch.randn(3, 8)
    assert AdaptiveCodec(4, impl="triton").uses_triton(x) is True
    assert AdaptiveCodec(4, impl="triton").uses_kernel(x) is False  # not the numba kernel
    assert AdaptiveCodec(4).uses_triton(x) is False  # auto: CPU rows take the numba kernel / torch
    for impl in ("torch", "kernel"):
        assert AdaptiveCodec(4, impl=impl).uses_triton(x) is False
    assert AdaptiveCodec(4, search="greedy", impl="triton").uses_triton(x) is False
    old = set_force_torch(True)
    try:
        assert AdaptiveCodec(4, impl="triton").uses_triton(x) is True  # an explicit impl is forced
    finally:
        set_force_torch(old)


@pytest.mark.parametrize("impl,expect", [("triton", True), ("torch", False), ("auto", False)])
def test_encode_runs_the_impl_uses_triton_says(monkeypatch, impl: str, expect: bool):
    calls = []
    real = at.encode_rows_device

    def spy(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(at, "encode_rows_device", spy)
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(3))
    c = AdaptiveCodec(4, impl=impl)
    assert c.uses_triton(x) is expect
    enc = c.encode(x)
    assert calls == ([(5, 12)] if expect else [])
    assert torch.equal(enc, AdaptiveCodec(4, impl="torch").encode(x))


def test_interpreter_needs_no_environment_and_import_loads_no_triton():
    # triton reads TRITON_INTERPRET when it decorates; the module binds its kernel per device on
    # first use. A process that imported triton in interpreter mode first (its library's own jit
    # functions then interpreted) encodes CPU rows the same; importing the codec loads no triton.
    script = (
        "import sys, torch\n"
        "import ckpt.quant.adaptive as ad\n"
        "assert 'triton' not in sys.modules, 'importing the codec imported triton'\n"
        "import triton\n"
        "from ckpt.quant import adaptive_triton as at\n"
        "x = torch.randn(40, 9, generator=torch.Generator().manual_seed(1))\n"
        "out, flags = at.encode_rows_device(x, 3, 30, 6, 2)\n"
        "assert torch.equal(out, ad.fast_encode_torch(x, 3, 30, 0.8, 2)) and not flags.any()\n"
        "print('ok')\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": repo}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, cwd=repo)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# CUDA (-m gpu): the compiled kernel, bit for bit against the CPU reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize(
    "bits,dim,n",
    [
        (4, 32, 200_000),
        (4, 64, 200_000),
        (4, 128, 200_000),
        (4, 256, 200_000),
        (3, 128, 50_000),
        (2, 128, 50_000),
        (3, 33, 50_000),
        (2, 300, 20_000),
        (4, 7, 50_000),
        (4, 100, 50_000),
    ],
)
def test_cuda_bytes_match_cpu_reference(bits: int, dim: int, n: int, replay_seed: ReplaySeed):
    x = _mixed(n, dim, replay_seed.torch_generator())
    got, flags = _triton(x.cuda(), bits)
    assert got.device.type == "cuda" and flags.device.type == "cuda"
    _assert_same_bytes(x, got, _reference(x, bits), f"cuda bits={bits} dim={dim} n={n} {replay_seed}")
    assert not bool(flags.any()), replay_seed


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", [5, 64, 257])
def test_cuda_edge_rows_and_refusals(bits: int, dim: int, replay_seed: ReplaySeed):
    x, _ = _edge_rows(dim, replay_seed.torch_generator())
    x = torch.cat([x, _mixed(300, dim, replay_seed.torch_generator())])
    _check(x.cuda(), bits, f"cuda edge rows bits={bits} dim={dim} {replay_seed}")
    ids = torch.arange(x.shape[0]) + 7
    assert _raised(AdaptiveCodec(bits), x.cuda(), ids) == _raised(AdaptiveCodec(bits, impl="torch"), x, ids)
    finite = x[torch.isfinite(x).all(1)]
    assert _raised(AdaptiveCodec(bits), finite.cuda(), None) == _raised(AdaptiveCodec(bits, impl="torch"), finite, None)


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("bits", BITS)
def test_cuda_ties_round_half_to_even(bits: int):
    x, codes = _tie_rows(bits, 40)
    got, _ = _check(x.cuda(), bits, f"cuda ties bits={bits}", **PLAIN_ONLY)
    assert ((got[:, 0].int().cpu() >> bits) & ((1 << bits) - 1)).tolist() == codes


@pytest.mark.parametrize("device", [CUDA])
def test_cuda_codec_auto_uses_triton_without_host_sync(device: str, replay_seed: ReplaySeed):
    x = _mixed(4000, 64, replay_seed.torch_generator())
    xd = x.to(device)
    codec = AdaptiveCodec(4)
    assert codec.uses_triton(xd) is True and codec.uses_kernel(xd) is False
    old = set_force_torch(True)
    try:
        assert codec.uses_triton(xd) is False  # auto follows the package's switch
    finally:
        set_force_torch(old)
    codec.encode_device(xd)  # compiled before the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
    try:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # queued on the current stream, whichever it is
            out, flags = codec.encode_device(xd)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    side.synchronize()
    _assert_same_bytes(x, out, _reference(x, 4), f"side stream {replay_seed}")
    assert torch.equal(codec.encode(xd).cpu(), out.cpu())


# ---------------------------------------------------------------------------------------------
# bench/gpu_encode.py: importable anywhere, CUDA only
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_encode_bench_refuses_without_cuda():
    from bench import gpu_encode

    with pytest.raises(RuntimeError, match="needs CUDA"):
        gpu_encode.triton_throughput(16, [8], [4], 1)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        gpu_encode.device_vs_host(16, [8], 1)


@pytest.mark.parametrize("device", [CUDA])
def test_gpu_encode_bench_small_run(device: str):
    from bench import gpu_encode

    tp = gpu_encode.triton_throughput(5000, [32], [4, 2], 2, other_dim=48)
    assert [(r.codec, r.dim, r.rows) for r in tp] == [("adaptive4", 32, 5000), ("adaptive2", 48, 5000)]
    assert all(r.rows_differing == 0 and r.triton_GBps > 0 and r.torch_GBps > 0 for r in tp), tp
    assert set(tp[0].as_dict()) >= {"triton_GBps", "torch_GBps", "rows_differing"}
    (dh,) = gpu_encode.device_vs_host(5000, [24], 2)
    assert dh.same_bytes and dh.device_pcie_bytes == 5000 * (12 + 4 + 1) and dh.host_pcie_bytes == 5000 * 24 * 4, dh
