"""Adaptive asymmetric quantization (Check-N-Run, NSDI'22, sec. 5): a search of the clipping
range per row. Two searches, one on-stream layout (an ``asymN`` row: decode is ``asymN`` decode):

**fast** (the default of ``adaptive2/3/4``) -- a coarse greedy search, then least-squares refits:

1. Plain asymN: bias = fp16(min), scale = fp16((max - bias)/(2^N-1)); its decoded squared L2
   error is the one to beat.
2. Greedy over ``[min, max]`` with ``nbins`` steps (50 / 30 / 25 at 4 / 3 / 2 bits) until the range
   is ``ratio`` x the original (0.92 / 0.8 / 0.5): at each step try xmin one step up and xmax one
   step down, move to the lower error; remember the best encoding seen.
3. ``refits`` (1 / 2 / 3) closed-form least-squares refits: with the codes q of the current
   encoding fixed, the (scale, bias) minimising ``sum (q*scale + bias - x)^2`` is a 2x2 linear
   solve from sum q, sum q^2, sum q*x, sum x. The scale is rounded to fp16, the bias re-solved
   for that scale and rounded; the row is re-quantised (nearest level, clamped) and its error
   measured; the next refit starts from those codes. Non-positive, non-finite or degenerate fits
   stop the refits of that row.
4. The best encoding seen replaces plain asymN only if its squared error is lower by more than
   the float rounding of any summation order (``adaptive_kernel.keep_factor``), so a row is never
   worse than plain asymN whoever measures it. A row whose plain fp16 scale/bias overflow is
   emitted as plain asymN, and the codec refuses it exactly as ``asymN`` does.

Every error is that of the real decoded row: fp16 scale and bias, codes
``round_half_even((x - bias) * (1/scale))`` clamped to [0, 2^N-1], ``x' = code*scale + bias``
(``code*scale`` is exact in fp32, so this is every decoder's result, FMA or not).
:func:`fast_encode_torch` is the reference implementation: plain device-agnostic torch ops, the
GPU path when triton is missing, and the CPU path when numba is missing. Two fused kernels of the
same algorithm produce identical bytes (all use only IEEE fp32 operations in the same order, every
row sum in the fixed order of :func:`row_sum`; tested bit for bit): :mod:`ckpt.quant.adaptive_kernel`
for CPU rows (numba) and :mod:`ckpt.quant.adaptive_triton` for CUDA rows (Triton).

**greedy** (``search="greedy"``) -- Check-N-Run's greedy search as fbgemm implements it:

Per row: split ``[min, max]`` into ``nbins`` steps of ``(max-min)/nbins``. At each step evaluate
the two neighbours of the current range -- ``xmin`` one step up, or ``xmax`` one step down -- and
move to the one with the lower L2 quantization error. Stop once the range has shrunk to
``ratio`` x the original range (``ceil(nbins*(1-ratio))`` steps); return the best range seen
(the starting ``[min, max]`` included). The error of a candidate is that of the real encoding:
fp16-rounded bias and scale, round half to even, codes clamped (fbgemm's N-bit rules), so the
search at 4 bits, nbins=200, ratio=0.84 is fbgemm's ``param_search_greedy`` behind torch's
``embedding_bag_4bit_prepack(optimized_qparams=True)`` (its ``ratio=0.16`` is the fraction removed;
ours is the fraction kept) and gives byte-identical rows in our tests (it keeps the best point of
the whole path where fbgemm keeps the best local optimum, so it can only be lower).

Vectorised across rows: all rows of a chunk take their steps together (the step count is the same
for every row); the per-step bookkeeping (candidate ranges, fp16 rounding, the greedy choice) is a
handful of ops on ``[2, rows]`` tensors per chunk, and the error of both candidates is evaluated as
``[2, slab, dim]`` tensors in reused, L2-sized buffers. No per-row Python loop. Device-agnostic
(plain torch ops; on CUDA the same code runs with one large slab). The encoded row is an ``asymN``
row packed with the chosen range (fbgemm's ``...SBHalfWithRowwiseMinMax`` at 2/4 bits); each row's
real decoded L2 error is compared with plain ``asymN`` and the better encoding is kept.
"""

from __future__ import annotations

import math

import torch

from . import adaptive_kernel, adaptive_triton, uniform
from .base import FP16_MAX, RowRangeError, as_float_rows, check_encoded, check_finite_meta, check_finite_rows, refuse_non_finite
from .bitpack import pack_bits, packed_bytes
from .uniform import decode_nbit, encode_nbit_with_range, fp16_meta_finite

__all__ = [
    "AdaptiveCodec",
    "greedy_range_search",
    "fast_encode_torch",
    "row_sum",
    "DEFAULT_RATIO",
    "DEFAULT_NBINS",
    "FAST_NBINS",
    "FAST_RATIO",
    "FAST_REFITS",
]

# greedy search (fbgemm's): bins, and the fraction of the original range at which it stops, per bit
# width. 4-bit: fbgemm/torch's setting (0.16 removed); fewer levels want more clipping, so 3/2-bit
# search deeper (see docs/quant.md).
DEFAULT_NBINS = 200
DEFAULT_RATIO = {4: 0.84, 3: 0.7, 2: 0.5}
# fast search (the default): a coarse greedy path, then least-squares refits (docs/quant.md)
FAST_NBINS = {4: 50, 3: 30, 2: 25}
FAST_RATIO = {4: 0.92, 3: 0.8, 2: 0.5}
FAST_REFITS = {4: 1, 3: 2, 2: 3}
SEARCHES = ("fast", "greedy")
IMPLS = ("auto", "kernel", "triton", "torch")

SLAB_ELEMS = 1 << 16  # elements per candidate slab of the error evaluation (CPU)
CHUNK_SLABS = 16  # slabs per search chunk: amortises the per-step bookkeeping


def search_steps(nbins: int, ratio: float) -> int:
    """Greedy steps until the range is ``ratio`` x the original (``ceil(nbins*(1-ratio))``)."""
    return max(0, math.ceil(nbins * (1.0 - ratio) - 1e-9))


def _chunk_rows(dim: int, device: torch.device) -> tuple[int, int]:
    """(rows per search chunk, rows per slab of the elementwise work).

    The per-step bookkeeping (candidate ranges, fp16 rounding, the greedy choice) runs once per
    chunk on [2, rows] tensors; the elementwise error evaluation runs slab by slab so that its
    [2, slab, dim] fp32 buffers (~64k elements each) stay in a 2 MiB L2.
    """
    if device.type != "cpu":
        r = max(16, (1 << 22) // max(dim, 1))
        return r, r
    slab = max(16, SLAB_ELEMS // max(dim, 1))
    return CHUNK_SLABS * slab, slab


def _search_chunk(x: torch.Tensor, bits: int, nbins: int, steps: int, slab: int):
    qmax = float((1 << bits) - 1)
    R, D = x.shape
    slab = min(slab, R)
    lo, hi = torch.aminmax(x, dim=1)
    step = (hi - lo).div_(nbins)
    t = torch.empty(2, slab, D, dtype=x.dtype, device=x.device)
    q = torch.empty(2, slab, D, dtype=x.dtype, device=x.device)
    L = torch.empty(2, R, dtype=x.dtype, device=x.device)

    def loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """L2 error of quantizing x with ranges [a, b] ([C, R] each) -> [C, R]."""
        C = a.shape[0]
        bias = a.to(torch.float16).to(torch.float32)
        # fp16 scale as the encoder stores it; a zero/negative scale only arises for near-constant
        # rows (the final check against plain asym covers the encoder's scale=1 special case)
        scale = torch.sub(b, bias).div_(qmax).to(torch.float16).to(torch.float32).clamp_min_(2.0**-24)
        bias3 = bias.unsqueeze(-1)
        inv3 = scale.reciprocal().unsqueeze(-1)
        for j in range(0, R, slab):
            k = min(j + slab, R)
            tt, qq = t[:C, : k - j], q[:C, : k - j]
            torch.sub(x[j:k].unsqueeze(0), bias3[:, j:k], out=tt)
            tt.mul_(inv3[:, j:k])  # (x - bias) * (1/scale), as fbgemm computes it
            torch.clamp(tt, 0.0, qmax, out=qq)
            qq.round_().sub_(tt)  # code - exact position, in units of scale
            torch.linalg.vector_norm(qq, dim=-1, out=L[:C, j:k])
        return L[:C].mul(scale)

    cur_lo, cur_hi = lo, hi
    best_lo, best_hi = lo, hi
    best = loss(lo.unsqueeze(0), hi.unsqueeze(0))[0]
    for _ in range(steps):
        up_lo = cur_lo + step  # candidate 0: xmin one step up
        down_hi = cur_hi - step  # candidate 1: xmax one step down
        l0, l1 = loss(torch.stack([up_lo, cur_lo]), torch.stack([cur_hi, down_hi]))
        move_lo = l0 < l1  # the greedy move
        cur_lo = torch.where(move_lo, up_lo, cur_lo)
        cur_hi = torch.where(move_lo, cur_hi, down_hi)
        now = torch.minimum(l0, l1)
        better = now < best
        best = torch.minimum(best, now)
        best_lo = torch.where(better, cur_lo, best_lo)
        best_hi = torch.where(better, cur_hi, best_hi)
    return best_lo, best_hi


def greedy_range_search(
    x: torch.Tensor,
    bits: int,
    nbins: int = DEFAULT_NBINS,
    ratio: float | None = None,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best clipping range per row: float32 [n, dim] -> (xmin [n], xmax [n]). Input must be finite."""
    if ratio is None:
        ratio = DEFAULT_RATIO[bits]
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if nbins < 1:
        raise ValueError(f"nbins must be >= 1, got {nbins}")
    n, dim = x.shape
    steps = search_steps(nbins, ratio)
    lo = torch.empty(n, dtype=torch.float32, device=x.device)
    hi = torch.empty(n, dtype=torch.float32, device=x.device)
    R, slab = _chunk_rows(dim, x.device)
    if chunk_rows:
        R = chunk_rows
    for i in range(0, n, R):
        lo[i : i + R], hi[i : i + R] = _search_chunk(x[i : i + R], bits, nbins, steps, slab)
    return lo, hi


# ----------------------------------------------------------------------------------------------
# fast search: torch reference (and GPU path) of the fused kernel in adaptive_kernel.py
# ----------------------------------------------------------------------------------------------


def row_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in a fixed order, [..., d] -> [...]: from +0.0, element 0, 1, 2, ...

    The kernel sums each row in exactly this order (one row per SIMD lane), which is what makes its
    bytes identical to ours: a torch reduction's order is an implementation detail (and differs
    between CPU and CUDA).
    """
    acc = torch.zeros(v.shape[:-1], dtype=v.dtype, device=v.device)
    for j in range(v.shape[-1]):
        acc += v[..., j]
    return acc


class _Consts:
    """fp32 scalars as 0-dim tensors on the data's device: dividing a CUDA tensor by a Python or
    CPU scalar multiplies by its reciprocal instead (one rounding more than the kernel's division)."""

    def __init__(self, bits: int, nbins: int, dim: int, device: torch.device):
        def t(v: float) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.float32, device=device)

        self.qmax = float((1 << bits) - 1)
        self.qmax_t = t(self.qmax)
        self.nbins = t(float(nbins))
        self.dim = t(float(dim))
        self.one = t(1.0)
        self.keep = t(adaptive_kernel.keep_factor(dim))


def _h16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(torch.float32)


def _range_params(a: torch.Tensor, c: torch.Tensor, k: _Consts) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, bias) of the asymN encoding of range [a, c] (``uniform.nbit_qparams``)."""
    bias = _h16(a)
    rng = c - bias
    scale = _h16(rng / k.qmax_t)
    scale = torch.where((rng == 0) | (scale == 0), k.one, scale)
    return scale, bias


def _codes(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, k: _Consts) -> torch.Tensor:
    """Codes (as float) of rows x [R, d] under per-row params [..., R] -> [..., R, d]."""
    inv = (k.one / scale).unsqueeze(-1)
    return (x - bias.unsqueeze(-1)).mul_(inv).round_().clamp_(0.0, k.qmax)


def _finite_or_inf(e: torch.Tensor) -> torch.Tensor:
    return torch.where(e <= torch.finfo(torch.float32).max, e, torch.inf)


def _sse(x, scale, bias, k: _Consts, stats: bool = False):
    """Squared L2 error of the decoded rows (non-finite -> inf); with ``stats`` also the sums the
    refit needs: sum q, sum q^2, sum q*x."""
    q = _codes(x, scale, bias, k)
    e = q * scale.unsqueeze(-1) + bias.unsqueeze(-1) - x
    sse = _finite_or_inf(row_sum(e.mul_(e)))
    if not stats:
        return sse
    return sse, row_sum(q), row_sum(q * q), row_sum(q * x)


def _fast_chunk(x: torch.Tensor, bits: int, steps: int, refits: int, k: _Consts) -> torch.Tensor:
    lo, hi = torch.aminmax(x, dim=1)
    lo, hi = lo + 0.0, hi + 0.0  # -0.0 -> +0.0: which zero is "the minimum" is not defined
    ps, pb = _range_params(lo, hi, k)
    sp = _sse(x, ps, pb, k)
    best, bs, bb = sp, ps, pb
    step = (hi - lo) / k.nbins
    cl, ch = lo, hi
    for _ in range(steps):
        up, down = cl + step, ch - step
        s2, b2 = _range_params(torch.stack([up, cl]), torch.stack([ch, down]), k)
        e2 = _sse(x, s2, b2, k)
        mv = e2[0] < e2[1]  # the greedy move: xmin up, else xmax down
        cl, ch = torch.where(mv, up, cl), torch.where(mv, ch, down)
        e, s, b = torch.where(mv, e2[0], e2[1]), torch.where(mv, s2[0], s2[1]), torch.where(mv, b2[0], b2[1])
        better = e < best
        best, bs, bb = torch.where(better, e, best), torch.where(better, s, bs), torch.where(better, b, bb)
    if refits:
        sx = row_sum(x)
        _, sq, sqq, sqx = _sse(x, bs, bb, k, stats=True)
        alive = torch.ones_like(sx, dtype=torch.bool)
        for _ in range(refits):
            det = k.dim * sqq - sq * sq
            s = _h16((k.dim * sqx - sq * sx) / det)
            b = _h16((sx - s * sq) / k.dim)
            alive &= (det > 0) & (s > 0) & (s <= FP16_MAX) & (b.abs() <= FP16_MAX)
            s, b = torch.where(alive, s, k.one), torch.where(alive, b, 0.0)
            e, nq, nqq, nqx = _sse(x, s, b, k, stats=True)
            sq, sqq, sqx = torch.where(alive, nq, sq), torch.where(alive, nqq, sqq), torch.where(alive, nqx, sqx)
            better = alive & (e < best)
            best, bs, bb = torch.where(better, e, best), torch.where(better, s, bs), torch.where(better, b, bb)
    plain_ok = (ps.abs() <= FP16_MAX) & (pb.abs() <= FP16_MAX)
    keep = plain_ok & (best < sp * k.keep)
    scale, bias = torch.where(keep, bs, ps), torch.where(keep, bb, pb)
    q = _codes(x, scale, bias, k).nan_to_num_(0.0)  # nan only in rows the codec refuses
    meta = torch.stack([scale, bias], 1).to(torch.float16).view(torch.uint8)
    return torch.cat([pack_bits(q.to(torch.uint8), bits), meta], 1)


def fast_encode_torch(x: torch.Tensor, bits: int, nbins: int, ratio: float, refits: int) -> torch.Tensor:
    """Fast adaptive search, reference implementation: float32 [n, dim] (finite) -> asymN rows.

    Plain torch ops on any device; the kernel (``adaptive_kernel.encode_rows``) gives the same bytes.
    """
    n, dim = x.shape
    k = _Consts(bits, nbins, dim, x.device)
    steps = search_steps(nbins, ratio)
    out = torch.empty(n, packed_bytes(dim, bits) + 4, dtype=torch.uint8, device=x.device)
    R = max(1, (SLAB_ELEMS if x.device.type == "cpu" else 1 << 22) // dim)
    for i in range(0, n, R):
        out[i : i + R] = _fast_chunk(x[i : i + R], bits, steps, refits, k)
    return out


def _row_err(x: torch.Tensor, enc: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.linalg.vector_norm(decode_nbit(enc, bits, x.shape[1]).sub_(x), dim=1)


def _check_params(nbins: int, ratio: float, refits: int) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if nbins < 1:
        raise ValueError(f"nbins must be >= 1, got {nbins}")
    if refits < 0:
        raise ValueError(f"refits must be >= 0, got {refits}")


class AdaptiveCodec:
    """Adaptive asymmetric N-bit codec; on-stream identical to ``asymN`` (decode is the same).

    ``search``: ``"fast"`` (coarse greedy + least-squares refits; the default) or ``"greedy"``
    (fbgemm's search; ``refits`` does not apply). ``impl`` (fast search only): ``"auto"`` runs the
    numba kernel for CPU tensors when numba is importable, the Triton kernel for CUDA tensors when
    triton is importable, and the torch reference otherwise (or under
    ``uniform.set_force_torch(True)``); ``"kernel"`` (numba, CPU tensors), ``"triton"`` (any
    tensor: CPU ones run in triton's interpreter) and ``"torch"`` force one (benchmarks, tests).
    All give the same bytes. Parameters left ``None`` take the defaults of the search at this width.
    """

    family = "adaptive"

    def __init__(
        self,
        bits: int,
        nbins: int | None = None,
        ratio: float | None = None,
        *,
        search: str = "fast",
        refits: int | None = None,
        impl: str = "auto",
    ):
        if search not in SEARCHES:
            raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if bits not in (2, 3, 4):
            raise ValueError(f"adaptive codec supports 2, 3 or 4 bits, got {bits}")
        fast = search == "fast"
        self.bits = bits
        self.search = search
        self.impl = impl
        self.nbins = nbins if nbins is not None else (FAST_NBINS if fast else {bits: DEFAULT_NBINS})[bits]
        self.ratio = ratio if ratio is not None else (FAST_RATIO if fast else DEFAULT_RATIO)[bits]
        self.refits = (refits if refits is not None else FAST_REFITS[bits]) if fast else 0
        _check_params(self.nbins, self.ratio, self.refits)
        self.name = f"adaptive{bits}"
        self.code = 0x30 | bits

    def __repr__(self) -> str:
        extra = f" refits={self.refits}" if self.search == "fast" else ""
        return f"<codec {self.name} code={self.code} search={self.search} nbins={self.nbins} ratio={self.ratio}{extra}>"

    def row_bytes(self, dim: int) -> int:
        return packed_bytes(dim, self.bits) + 4

    def uses_kernel(self, x: torch.Tensor) -> bool:
        """Whether :meth:`encode` of ``x`` runs the fused numba kernel."""
        if self.search != "fast" or self.impl in ("torch", "triton") or x.device.type != "cpu":
            return False
        if self.impl == "kernel":
            if not adaptive_kernel.AVAILABLE:
                raise RuntimeError("adaptive kernel requested but numba is not importable")
            return True
        return adaptive_kernel.AVAILABLE and not uniform.torch_forced()

    def uses_triton(self, x: torch.Tensor) -> bool:
        """Whether :meth:`encode` of ``x`` runs the fused Triton kernel."""
        if self.search != "fast" or self.impl in ("torch", "kernel"):
            return False
        if self.impl == "triton":
            if not adaptive_triton.AVAILABLE:
                raise RuntimeError("adaptive Triton kernel requested but triton is not importable")
            return True
        return x.device.type == "cuda" and adaptive_triton.AVAILABLE and not uniform.torch_forced()

    def warm_up(self) -> None:
        """Load the CPU kernel now (numba's import and its cached machine code, a few seconds the
        first time in a process) if encoding CPU rows would use it."""
        if self.uses_kernel(torch.empty(0, 1)):
            adaptive_kernel.warm_up()

    def encode(self, rows, *, table="?", row_ids=None):
        x = as_float_rows(rows, table, row_ids, check_finite=False)
        if self.search == "fast" and self.uses_kernel(x):  # the kernel checks as it reads the rows
            out, checks = adaptive_kernel.encode_rows_checked(
                x, self.bits, self.nbins, search_steps(self.nbins, self.ratio), self.refits
            )
            if checks.sums_not_finite:
                refuse_non_finite(x, table, row_ids)
            if checks.meta_not_finite:
                raise RowRangeError(table, checks.first_meta_not_finite, row_ids, self.name, checks.meta_not_finite)
            return out
        if self.uses_triton(x):  # the kernel's flags say what to refuse, as the torch path would
            out, flags = self.encode_device(x)
            adaptive_triton.refuse_flagged(flags, table, row_ids, self.name)
            return out
        check_finite_rows(x, table, row_ids)
        if self.search == "greedy":
            out = self._encode_greedy(x)
        else:
            out = fast_encode_torch(x, self.bits, self.nbins, self.ratio, self.refits)
        check_finite_meta(fp16_meta_finite(out[:, -4:]), table, row_ids, self.name)
        return out

    def encode_device(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode float32 rows with the Triton kernel without waiting for it: (encoded uint8
        [n, row_bytes] on the rows' device, flags uint8 [n]). Nothing is refused here: whoever
        holds the bytes later passes the flags to ``adaptive_triton.refuse_flagged``, which raises
        what :meth:`encode` would raise for these rows. Fast search only; CUDA rows (CPU rows run
        in triton's interpreter)."""
        if self.search != "fast":
            raise ValueError(f"{self.name}: encode_device runs the fast search only, not {self.search!r}")
        x = rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.to(torch.float32).contiguous()
        return adaptive_triton.encode_rows_device(x, self.bits, self.nbins, search_steps(self.nbins, self.ratio), self.refits)

    def _encode_greedy(self, x: torch.Tensor) -> torch.Tensor:
        n, dim = x.shape
        out = torch.empty(n, self.row_bytes(dim), dtype=torch.uint8, device=x.device)
        big = max(1, (1 << 20) // dim)  # verification chunks: a few MiB of temporaries
        for i in range(0, n, big):
            xc = x[i : i + big]
            lo, hi = greedy_range_search(xc, self.bits, self.nbins, self.ratio)
            best = encode_nbit_with_range(xc, self.bits, lo, hi)
            plain = encode_nbit_with_range(xc, self.bits)
            keep = _row_err(xc, best, self.bits) <= _row_err(xc, plain, self.bits)
            torch.where(keep.unsqueeze(1), best, plain, out=out[i : i + big])
        return out

    def decode(self, data, dim):
        check_encoded(data, self.row_bytes(dim), self.name)
        return decode_nbit(data, self.bits, dim)
