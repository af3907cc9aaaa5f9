"""Fused Triton kernel of the fast adaptive search (the algorithm: :mod:`ckpt.quant.adaptive`) for rows
on a GPU; its bytes are identical to :func:`ckpt.quant.adaptive.fast_encode_torch`'s.

Tool: Triton (the compiler torch already ships with on CUDA machines): one fused kernel written in
Python, no CUDA toolchain at install, and its interpreter runs the same kernel on CPU tensors with
numpy, which is how machines without a GPU (CI) check its bytes.

Layout of the work. One row per thread: a program takes ``BLOCK_R = 32 * num_warps`` rows, and every
pass of the search is a loop over the row's columns, 4 at a time (one 16-byte load per thread,
whose 4 values the thread adds to its sums one after the other). So each row's sums -- squared
errors, the refit's sums, the row sum -- are taken sequentially from +0.0 in element order, the
order of :func:`ckpt.quant.adaptive.row_sum`; a tree reduction across a row would give other bits.
Each greedy step evaluates both candidates in one pass. Every pass re-reads the rows from L1/L2;
HBM sees one read of the rows and one write of the encoded bytes. The last pass, the final codes,
depends only on each row's chosen (bias, 1/scale), so it runs on 2-D tiles [rows, groups of codes]
and packs in the kernel: a group is the codes that fill whole bytes (2 at 4 bits, 4 at 2 bits, 8 at
3 bits -> 3 bytes), built as one integer word and stored byte by byte in :mod:`ckpt.quant.bitpack`'s
layout; packing here writes the packed bytes once, where codes for ``pack_bits`` would be written
and read again at 8x the 4-bit size.

Exactness, operation by operation, as in the numba kernel (:mod:`ckpt.quant.adaptive_numba`):

* launched with ``enable_fp_fusion=False``: no multiply and add are contracted into an FMA, in LLVM
  or in ptxas (``--fmad=false``); the PTX has ``mul.rn``/``add.rn``, which ptxas never contracts.
* divisions are ``tl.div_rn`` (IEEE round to nearest, ``div.rn.f32``). Triton's ``/`` on fp32 lowers
  to ``div.full.f32`` on NVIDIA, an approximation that can differ in the last bit.
* round half to even is ``(t + 1.5*2**23) - 1.5*2**23``: exact for ``|t| < 2**22`` (the sum lies in
  [2**23, 2**24), where the fp32 spacing is 1, and the constant is even, so the sum's tie goes to
  the even integer exactly when ``t``'s does). For ``t >= 2**22`` it may be off by one and for
  ``t <= -2**22`` it stays negative, so after the clamp to [0, qmax] (qmax <= 15) the code equals
  ``rint``'s; +-inf and NaN pass unchanged; a zero comes out +0.0 where ``rint`` may give -0.0,
  which changes no byte (code 0 either way, and ``0*s + b - x`` squares to the same value). Compilers
  do not fold ``(t + c) - c`` without fast-math flags, which Triton does not set. (libdevice's
  ``rint`` would do on the GPU, but the interpreter cannot run libdevice.)
* the clamp is ``tl.maximum``/``tl.minimum`` with ``PropagateNan.ALL``, NaN kept as ``torch.clamp``
  keeps it (such a code, from non-finite candidate parameters, gives an inf error either way); the
  final codes map NaN to 0 (``nan_to_num``), which only rows the codec refuses have.
* fp16 rounding is the fp32 -> fp16 cast and back (round to nearest even, subnormals kept, overflow
  to inf: ``cvt.rn.f16.f32``; numpy's ``astype`` in the interpreter); ``lo + 0.0`` turns a -0.0
  minimum into +0.0.
* min/max propagate NaN (``PropagateNan.ALL``) as ``torch.aminmax`` does.
* squared-error sums that are not finite become +inf (``x <= FLT_MAX`` is false for NaN).

The interpreter cannot show an FMA (it evaluates every op with numpy) or an approximate division
(it divides with numpy whatever the op); the CUDA tests compare the compiled kernel with the
reference bit for bit over large batches, which catches both.

Triton decides interpreter or compiler when a function is decorated (``triton.knobs.runtime.
interpret``, i.e. ``TRITON_INTERPRET``), and the interpreter looks up a kernel's helpers by name in
the kernel's globals when it runs. So the kernel's functions below are plain functions, and
:func:`_kernel` binds copies of them into one namespace per mode on first use: the compiled kernel
for CUDA tensors, the interpreted one for CPU tensors, whatever the environment says and in
whatever order modules were imported. Importing this module imports no triton. The kernel calls
only triton.language builtins (``tl.full``, not ``tl.zeros``): the library's own jit functions were
bound to one mode when triton was imported.

Flags per row (uint8): bit 0 its sequential element sum is not finite (NaN/Inf in it, or an
overflow), bit 1 its stored fp16 scale or bias is not finite, bit 2 it holds a NaN/Inf element
(the exact test :func:`ckpt.quant.base.refuse_non_finite` makes wherever a sum is not finite; here
the NaN-propagating min or max is not finite). A finite row whose sum overflows has an element
beyond FLT_MAX / dim, far past fp16, so its fp16 fields overflow too: :func:`refuse_flagged` refuses
what the torch path refuses, with the same error.
"""

from __future__ import annotations

import importlib.util
import threading
import types
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .adaptive_kernel import keep_factor
from .base import NonFiniteRowError, RowRangeError
from .bitpack import packed_bytes

__all__ = ["AVAILABLE", "FLAG_SUM", "FLAG_META", "FLAG_NON_FINITE", "encode_rows_device", "refuse_flagged"]

AVAILABLE = importlib.util.find_spec("triton") is not None

FLAG_SUM = 1  # bit 0: the row's element sum is not finite
FLAG_META = 2  # bit 1: its fp16 scale or bias is not finite
FLAG_NON_FINITE = 4  # bit 2: it holds a NaN/Inf element

NUM_WARPS = 4  # per program on the GPU: BLOCK_R = 32 * NUM_WARPS rows, one per thread
COLS = 4  # columns per load in the search's passes: one 16-byte load per row
GROUPS_GPU = 32  # code groups per tile of the packing pass on the GPU
INTERPRET_ROWS = 4096  # rows per program in the interpreter (its cost is per op, not per row)

if TYPE_CHECKING:
    tl: Any  # triton.language, put in the kernel functions' namespace when a mode's kernel is built


# ----------------------------------------------------------------------------------------------
# kernel source: plain functions, bound to triton per mode by _kernel() (`tl` is in that namespace)
# ----------------------------------------------------------------------------------------------
# ruff: noqa: F821 (tl)


def _zeros(like):
    """+0.0 in the shape of ``like`` (``tl.zeros`` is a jit function of triton.language, bound to
    one mode when triton was imported; the kernel uses builtins only, which serve both)."""
    return tl.full(like.shape, 0.0, tl.float32)


def _h16(v):
    """fp16(v) as fp32: round to nearest even, overflow to inf."""
    return v.to(tl.float16).to(tl.float32)


def _div(a, b):
    """IEEE division of two fp32 blocks of one shape."""
    return tl.div_rn(a, b)


def _finite_or_inf(e):
    return tl.where(e <= 3.4028234663852886e38, e, float("inf"))


def _code(v, b, inv, QMAX: tl.constexpr):
    """round_half_even((v - b) * inv) clamped to [0, QMAX], NaN kept (as ``torch.clamp``)."""
    r = ((v - b) * inv + 12582912.0) - 12582912.0
    return _min(_max(r, 0.0), QMAX)


def _params(a, c, one, QMAX: tl.constexpr):
    """(scale, bias, 1/scale) of the asymN encodings of the ranges [a, c] (``nbit_qparams``)."""
    bias = _h16(a)
    rng = c - bias
    scale = _h16(_div(rng, one * QMAX))
    scale = tl.where((rng == 0.0) | (scale == 0.0), 1.0, scale)
    return scale, bias, _div(one, scale)


def _tile(x0, m0, j0, D: tl.constexpr, COLS: tl.constexpr):
    """Columns [j0, j0 + COLS) of the block's rows, ``x0`` the pointers [R, COLS] of columns
    [0, COLS) and ``m0`` the rows' mask [R, 1]: (x [R, COLS], 0.0 past D; the in-row mask [1, COLS])."""
    cm = (j0 + tl.arange(0, COLS)[None, :]) < D
    m = m0
    if D % COLS != 0:
        m = m0 & cm
    return tl.load(x0 + j0, mask=m, other=0.0), cm


def _split4(t):
    """The 4 columns of t [R, 4] in order: a row's 4 values are one thread's registers, handed out."""
    ev, od = tl.split(tl.reshape(t, [t.shape[0], 2, 2]))  # columns (0, 2) and (1, 3)
    c0, c2 = tl.split(ev)
    c1, c3 = tl.split(od)
    return c0, c1, c2, c3


def _acc(acc, t, cm, D: tl.constexpr, COLS: tl.constexpr):
    """acc + t[:, 0] + t[:, 1] + t[:, 2] + t[:, 3], in this order (``row_sum``'s). Columns past D add
    +0.0, which leaves a sum that started at +0.0 unchanged (such a sum is never -0.0)."""
    if D % COLS != 0:
        t = tl.where(cm, t, 0.0)
    c0, c1, c2, c3 = _split4(t)
    return (((acc + c0) + c1) + c2) + c3


def _min(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


def _max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


def _minmax(lo, hi, v, cm, D: tl.constexpr, COLS: tl.constexpr):
    """Running (min, max) of each row with the 4 columns of v [R, 4]; NaN propagates."""
    a = v
    z = v
    if D % COLS != 0:  # columns past D: +inf for the min, -inf for the max
        a = tl.where(cm, v, float("inf"))
        z = tl.where(cm, v, float("-inf"))
    c0, c1, c2, c3 = _split4(a)
    lo = _min(_min(lo, _min(c0, c1)), _min(c2, c3))
    c0, c1, c2, c3 = _split4(z)
    hi = _max(_max(hi, _max(c0, c1)), _max(c2, c3))
    return lo, hi


def _err(v, s, b, inv, QMAX: tl.constexpr):
    """Decoded minus original, ``(code*s + b) - v``, for the rows' params [R, 1] and values [R, COLS]."""
    return (_code(v, b, inv, QMAX) * s + b) - v


def _sse(x0, m0, D: tl.constexpr, COLS: tl.constexpr, s, b, inv, QMAX: tl.constexpr):
    """Squared L2 error of each row decoded with (s, b), summed in element order; non-finite -> inf."""
    acc = _zeros(s)
    s2 = s[:, None]
    b2 = b[:, None]
    i2 = inv[:, None]
    for j0 in range(0, D, COLS):
        v, cm = _tile(x0, m0, j0, D, COLS)
        e = _err(v, s2, b2, i2, QMAX)
        acc = _acc(acc, e * e, cm, D, COLS)
    return _finite_or_inf(acc)


def _sse2(x0, m0, D: tl.constexpr, COLS: tl.constexpr, s0, b0, i0, s1, b1, i1, QMAX: tl.constexpr):
    """``_sse`` of two candidate encodings in one pass."""
    a0 = _zeros(s0)
    a1 = _zeros(s1)
    s0 = s0[:, None]
    b0 = b0[:, None]
    i0 = i0[:, None]
    s1 = s1[:, None]
    b1 = b1[:, None]
    i1 = i1[:, None]
    for j0 in range(0, D, COLS):
        v, cm = _tile(x0, m0, j0, D, COLS)
        e0 = _err(v, s0, b0, i0, QMAX)
        e1 = _err(v, s1, b1, i1, QMAX)
        a0 = _acc(a0, e0 * e0, cm, D, COLS)
        a1 = _acc(a1, e1 * e1, cm, D, COLS)
    return _finite_or_inf(a0), _finite_or_inf(a1)


def _sse_stats(x0, m0, D: tl.constexpr, COLS: tl.constexpr, s, b, inv, QMAX: tl.constexpr):
    """``_sse`` and the sums the least-squares refit needs: sum q, sum q^2, sum q*x."""
    acc = _zeros(s)
    sq = _zeros(s)
    sqq = _zeros(s)
    sqx = _zeros(s)
    s2 = s[:, None]
    b2 = b[:, None]
    i2 = inv[:, None]
    for j0 in range(0, D, COLS):
        v, cm = _tile(x0, m0, j0, D, COLS)
        q = _code(v, b2, i2, QMAX)
        e = (q * s2 + b2) - v
        acc = _acc(acc, e * e, cm, D, COLS)
        sq = _acc(sq, q, cm, D, COLS)
        sqq = _acc(sqq, q * q, cm, D, COLS)
        sqx = _acc(sqx, q * v, cm, D, COLS)
    return _finite_or_inf(acc), sq, sqq, sqx


def _encode_kernel(
    x_ptr,
    out_ptr,
    flags_ptr,
    n,
    nbins,
    keep,
    D: tl.constexpr,
    BITS: tl.constexpr,
    QMAX: tl.constexpr,
    STEPS: tl.constexpr,
    REFITS: tl.constexpr,
    P: tl.constexpr,
    CPG: tl.constexpr,
    BPG: tl.constexpr,
    NG: tl.constexpr,
    COLS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """Encode rows [pid*BLOCK_R, +BLOCK_R) of x [n, D] into out [n, P + 4] and flags [n]. P: code
    bytes per row; CPG codes fill BPG whole bytes (a group); NG groups per row.

    One kernel of 130 lines, an exception to the project's ~80-line limit: a Triton kernel is one
    program whose row state (range, sums, codes) lives in registers across every pass; the passes
    it could share are already `tl` helpers above."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n
    xr = x_ptr + rows.to(tl.int64) * D
    x0 = xr[:, None] + tl.arange(0, COLS)[None, :]  # the passes' tiles: columns [j0, j0 + COLS)
    m0 = rmask[:, None]
    one = tl.full([BLOCK_R], 1.0, tl.float32)

    # row min/max (-0.0 -> +0.0), sequential sum
    lo = tl.full([BLOCK_R], float("inf"), tl.float32)
    hi = tl.full([BLOCK_R], float("-inf"), tl.float32)
    sx = tl.full([BLOCK_R], 0.0, tl.float32)
    for j0 in range(0, D, COLS):
        v, cm = _tile(x0, m0, j0, D, COLS)
        lo, hi = _minmax(lo, hi, v, cm, D, COLS)
        sx = _acc(sx, v, cm, D, COLS)
    # min and max propagate NaN, and an Inf element is the min or the max: both finite iff all are
    bad = ~((tl.abs(lo) <= 3.4028234663852886e38) & (tl.abs(hi) <= 3.4028234663852886e38))
    lo = lo + 0.0
    hi = hi + 0.0
    step = _div(hi - lo, one * nbins)

    # plain asymN: the encoding to beat
    ps, pb, pinv = _params(lo, hi, one, QMAX)
    sp = _sse(x0, m0, D, COLS, ps, pb, pinv, QMAX)
    best = sp
    bs = ps
    bb = pb

    # greedy: xmin one step up or xmax one step down, whichever decodes better; keep the best seen
    cl = lo
    ch = hi
    for _ in range(STEPS):
        up = cl + step
        down = ch - step
        s0, b0, i0 = _params(up, ch, one, QMAX)
        s1, b1, i1 = _params(cl, down, one, QMAX)
        e0, e1 = _sse2(x0, m0, D, COLS, s0, b0, i0, s1, b1, i1, QMAX)
        mv = e0 < e1
        cl = tl.where(mv, up, cl)
        ch = tl.where(mv, ch, down)
        e = tl.where(mv, e0, e1)
        better = e < best
        best = tl.where(better, e, best)
        bs = tl.where(better, tl.where(mv, s0, s1), bs)
        bb = tl.where(better, tl.where(mv, b0, b1), bb)

    # least-squares refits of (scale, bias) for the codes of the current encoding
    if REFITS > 0:
        nd = one * D
        _e, sq, sqq, sqx = _sse_stats(x0, m0, D, COLS, bs, bb, _div(one, bs), QMAX)
        alive = rows >= 0
        for it in tl.static_range(REFITS):
            det = nd * sqq - sq * sq
            s = _h16(_div(nd * sqx - sq * sx, det))
            b = _h16(_div(sx - s * sq, nd))
            alive = alive & (det > 0.0) & (s > 0.0) & (s <= 65504.0) & (tl.abs(b) <= 65504.0)
            s = tl.where(alive, s, 1.0)
            b = tl.where(alive, b, 0.0)
            if it + 1 < REFITS:
                e, nq, nqq, nqx = _sse_stats(x0, m0, D, COLS, s, b, _div(one, s), QMAX)
                sq = tl.where(alive, nq, sq)
                sqq = tl.where(alive, nqq, sqq)
                sqx = tl.where(alive, nqx, sqx)
            else:  # the last refit: no next one needs the sums
                e = _sse(x0, m0, D, COLS, s, b, _div(one, s), QMAX)
            better = alive & (e < best)
            best = tl.where(better, e, best)
            bs = tl.where(better, s, bs)
            bb = tl.where(better, b, bb)

    # the searched encoding, or plain asymN (whose overflowing fp16 fields the codec refuses)
    plain_ok = (tl.abs(ps) <= 65504.0) & (tl.abs(pb) <= 65504.0)
    use = plain_ok & (best < sp * keep)
    s = tl.where(use, bs, ps)
    b = tl.where(use, bb, pb)
    inv = _div(one, s)

    # flags, and the fp16 scale and bias after the codes
    meta_bad = ~((tl.abs(s) <= 65504.0) & (tl.abs(b) <= 65504.0))
    flags = tl.where(tl.abs(sx) <= 3.4028234663852886e38, 0, 1) | tl.where(meta_bad, 2, 0) | tl.where(bad, 4, 0)
    tl.store(flags_ptr + rows, flags.to(tl.uint8), mask=rmask)
    orow = out_ptr + rows.to(tl.int64) * (P + 4)
    hs = s.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hb = b.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    tl.store(orow + P, (hs & 0xFF).to(tl.uint8), mask=rmask)
    tl.store(orow + (P + 1), (hs >> 8).to(tl.uint8), mask=rmask)
    tl.store(orow + (P + 2), (hb & 0xFF).to(tl.uint8), mask=rmask)
    tl.store(orow + (P + 3), (hb >> 8).to(tl.uint8), mask=rmask)

    # the codes, packed: group g holds codes [g*CPG, (g+1)*CPG) in one word, bytes [g*BPG, (g+1)*BPG)
    m2 = rmask[:, None]
    x2 = xr[:, None]
    o2 = orow[:, None]
    b2 = b[:, None]
    i2 = inv[:, None]
    for g0 in range(0, NG, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)[None, :]
        word = tl.full([BLOCK_R, BLOCK_G], 0, tl.int32)
        for i in tl.static_range(CPG):
            j = g * CPG + i
            mj = m2 & (j < D)
            q = _code(tl.load(x2 + j, mask=mj, other=0.0), b2, i2, QMAX)
            q = tl.where(mj & (q == q), q, 0.0)
            word = word | (q.to(tl.int32) << (BITS * i))
        for t in tl.static_range(BPG):
            kb = g * BPG + t
            tl.store(o2 + kb, ((word >> (8 * t)) & 0xFF).to(tl.uint8), mask=m2 & (kb < P))


_SOURCES = (
    _zeros,
    _h16,
    _div,
    _finite_or_inf,
    _min,
    _max,
    _code,
    _params,
    _tile,
    _split4,
    _acc,
    _minmax,
    _err,
    _sse,
    _sse2,
    _sse_stats,
    _encode_kernel,
)
_BUILT: dict[bool, Any] = {}
_BUILD_LOCK = threading.Lock()


def _kernel(interpret: bool) -> Any:
    """The kernel for the interpreter (CPU tensors) or the compiler (CUDA tensors), built on first use.

    Copies of the source functions share one namespace per mode, so the kernel calls the helpers of
    its own mode; the knob is set only while decorating (triton reads it then), then restored.
    """
    with _BUILD_LOCK:
        if interpret not in _BUILT:
            import triton  # noqa: PLC0415 - paid by the first device encode only
            import triton.language as tl  # noqa: PLC0415

            ns: dict[str, Any] = {"tl": tl, "__name__": __name__, "__builtins__": __builtins__}
            with triton.knobs.runtime.scope():
                triton.knobs.runtime.interpret = interpret
                for f in _SOURCES:
                    g = types.FunctionType(f.__code__, ns, f.__name__, f.__defaults__, f.__closure__)
                    g.__annotations__ = dict(f.__annotations__)
                    g.__qualname__, g.__module__, g.__doc__ = f.__qualname__, f.__module__, f.__doc__
                    # interpreted, a jit helper re-patches triton.language on every call (a fraction
                    # of a ms, per tile per pass); plain, the helpers run the same numpy ops in the
                    # kernel's patch scope. Compiled, triton inlines them.
                    ns[f.__name__] = triton.jit(g) if f is _encode_kernel or not interpret else g
            _BUILT[interpret] = ns[_encode_kernel.__name__]
        return _BUILT[interpret]


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def encode_rows_device(
    x: torch.Tensor, bits: int, nbins: int, steps: int, refits: int, *, num_warps: int = NUM_WARPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: float32 [n, d] contiguous (CUDA, or CPU: the kernel then runs in triton's interpreter) ->
    (out uint8 [n, packed_bytes(d, bits) + 4] on x's device, flags uint8 [n] on x's device: bit 0 =
    the row's element sum is not finite (NaN/Inf in it, or an overflow), bit 1 = its fp16 scale or
    bias is not finite, bit 2 = it holds a NaN/Inf element). Queues work on the current stream and
    never synchronises with the host (no .item(), no bool(), no nonzero on the device).

    ``num_warps`` (rows per program / 32 on the GPU) tunes the launch (benchmarks); any value gives
    the same bytes. ``steps`` is ``adaptive.search_steps(nbins, ratio)``."""
    if not AVAILABLE:
        raise RuntimeError("the adaptive Triton kernel needs triton, which is not importable")
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be contiguous float32 [n, d], got {x.dtype} {tuple(x.shape)}")
    if bits not in (2, 3, 4):
        raise ValueError(f"bits must be 2, 3 or 4, got {bits}")
    if nbins < 1 or steps < 0 or refits < 0:
        raise ValueError(f"need nbins >= 1, steps >= 0, refits >= 0; got {nbins}, {steps}, {refits}")
    n, d = x.shape
    if d < 1:
        raise ValueError("rows must have dim >= 1")
    interpret = x.device.type == "cpu"
    if not interpret and x.device.type != "cuda":
        raise ValueError(f"the Triton kernel encodes CUDA tensors (or CPU ones, interpreted), got {x.device}")
    p = packed_bytes(d, bits)
    out = torch.empty(n, p + 4, dtype=torch.uint8, device=x.device)
    flags = torch.empty(n, dtype=torch.uint8, device=x.device)
    if n == 0:
        return out, flags
    cpg = 8 // (bits & -bits)  # codes per group of whole bytes: 2 at 4 bits, 4 at 2, 8 at 3
    groups = -(-d // cpg)
    if interpret:
        block_r, block_g, warps = min(INTERPRET_ROWS, _next_pow2(n)), _next_pow2(groups), 1
    else:
        block_r, block_g, warps = 32 * num_warps, min(GROUPS_GPU, _next_pow2(groups)), num_warps
    kernel = _kernel(interpret)
    launch = kernel[(-(-n // block_r),)]
    consts = dict(
        D=d,
        BITS=bits,
        QMAX=float((1 << bits) - 1),
        STEPS=steps,
        REFITS=refits,
        P=p,
        CPG=cpg,
        BPG=cpg * bits // 8,
        NG=groups,
        COLS=COLS,
        BLOCK_R=block_r,
        BLOCK_G=block_g,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    if interpret:
        with np.errstate(all="ignore"):  # inf/NaN in refused rows and masked lanes, as on the GPU
            launch(x, out, flags, n, float(nbins), keep_factor(d), **consts)
    else:
        with torch.cuda.device(x.device):
            launch(x, out, flags, n, float(nbins), keep_factor(d), **consts)
    return out, flags


def refuse_flagged(flags: torch.Tensor, table: str, row_ids: torch.Tensor | None, codec: str) -> None:
    """flags (host or device) as encode_rows_device returned them: raise NonFiniteRowError for the
    first row that holds NaN/Inf (bit 2; n_bad = their count), else RowRangeError for the first
    whose fp16 scale or bias is not finite (bit 1; n_bad = their count); nothing when all are 0.

    These are the torch path's refusals of the same rows (``check_finite_rows``: the exact
    per-element test wherever a sum is not finite; then ``check_finite_meta``). A finite row whose
    sum overflows (bit 0 without bit 2) is refused for its fp16 fields, as there."""
    f = flags.to("cpu", torch.int32)
    nonfinite = ((f & FLAG_NON_FINITE) != 0).nonzero().flatten()
    if nonfinite.numel():
        raise NonFiniteRowError(table, int(nonfinite[0]), row_ids, int(nonfinite.numel()))
    meta = ((f & FLAG_META) != 0).nonzero().flatten()
    if meta.numel():
        raise RowRangeError(table, int(meta[0]), row_ids, codec, int(meta.numel()))
