"""The numba code of the fused adaptive kernel; imported on first use by :mod:`ckpt.quant.adaptive_kernel`
(importing numba is slow, and no process should pay for it unless it encodes adaptive rows on CPU).

Every float operation is the one :func:`ckpt.quant.adaptive.fast_encode_torch` (the reference)
performs, in the same order: fp32 IEEE arithmetic (no fast-math: no reassociation, no contraction
into FMA), fp16 rounding done exactly in integer arithmetic, every row sum taken element by element
from +0.0 (:func:`ckpt.quant.adaptive.row_sum`), and ``error_model="numpy"`` (IEEE division, no
Python exceptions). So the encoded bytes are identical to the reference's (tested), not merely close.

The per-row choices (which candidate, whether it beats the best so far) load every operand before
choosing: ``a[r] if c else b[r]`` compiles to a branch around a load, which LLVM may not turn into
a select, so such a loop stays scalar and mispredicts on every data-dependent choice.
"""

from __future__ import annotations

import numpy as np
from numba import njit

FP16_MAX = 65504.0
PACK4_ROWS_MIN_DIM = 64  # 4-bit rows this wide are packed row by row, narrower ones transposed
TWO24 = 16777216.0  # 2**24: fp16's smallest subnormal is 2**-24

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_FMAX = np.float32(np.finfo(np.float32).max)
_FINF = np.float32(np.inf)
_H16MAX = np.float32(FP16_MAX)
_S24 = np.float32(TWO24)
_S24INV = np.float32(1.0 / TWO24)

# what launch/kernels.py compiles ahead of time (common/compiled.py): name -> the argument types
# its callers pass (ckpt/quant/adaptive_kernel.py)
AOT_EXPORTS = {"encode": "void(f4[:, ::1], u1[:, ::1], i8, i8, i8, i8, f4, i8, i8[::1])"}


def _jit(fn):
    return njit(nogil=True, cache=True, error_model="numpy")(fn)


@_jit
def _h16(v):
    """fp16(v) (round to nearest even, overflow to inf, nan kept) as a float32; branch-free so
    that loops calling it vectorise."""
    u = np.int64(np.float32(v).view(np.uint32))
    a = u & 0x7FFFFFFF
    normal = (a + 0xFFF + ((a >> 13) & 1)) & 0x7FFFE000  # keep 10 mantissa bits, half to even
    # fp16 subnormal: a multiple of 2**-24 (both scalings are exact)
    sub = np.int64(np.float32(np.float32(np.rint(np.float32(abs(v)) * _S24)) * _S24INV).view(np.uint32))
    r = sub if a < 0x38800000 else normal
    r = 0x7F800000 if a >= 0x477FF000 else r  # >= 65520 rounds past 65504
    r = a if a >= 0x7F800000 else r  # inf, nan
    return np.uint32(r | (u & 0x80000000)).view(np.float32)


@_jit
def _h16_bits(v):
    """The fp16 bit pattern of a float32 that holds an fp16 value (or inf/nan)."""
    u = np.int64(np.float32(v).view(np.uint32))
    a = u & 0x7FFFFFFF
    sign = (u >> 16) & 0x8000
    if a > 0x7F800000:
        return sign | 0x7E00
    if a == 0x7F800000:
        return sign | 0x7C00
    if a >= 0x38800000:
        return sign | ((a - 0x38000000) >> 13)
    return sign | np.int64(np.float32(abs(v)) * _S24)


@_jit
def _code(v, b, inv, qmax):
    """round_half_even((v - b) * inv) clamped to [0, qmax]; as the reference for every finite
    value (a nan code, which only non-finite parameters produce, gives an inf error anyway)."""
    return min(max(np.float32(np.rint((v - b) * inv)), _F0), qmax)


@_jit
def _finite_or_inf(e):
    return e if e <= _FMAX else _FINF


@_jit
def _range_params(lo, hi, qmax, m, s, b, inv):
    """(scale, bias, 1/scale) of the asymN encodings of the ranges [lo, hi] (``nbit_qparams``)."""
    for r in range(m):
        bias = _h16(lo[r])
        rng = hi[r] - bias
        scale = _h16(rng / qmax)
        scale = _F1 if (rng == _F0) | (scale == _F0) else scale
        s[r] = scale
        b[r] = bias
        inv[r] = _F1 / scale


@_jit
def _sse(xt, m, s, b, inv, qmax, acc):
    """Squared L2 error of each row of the block decoded with (s, b); non-finite -> inf."""
    for r in range(m):
        acc[r] = _F0
    for j in range(xt.shape[0]):
        xj = xt[j]
        for r in range(m):
            v = xj[r]
            e = (_code(v, b[r], inv[r], qmax) * s[r] + b[r]) - v
            acc[r] += e * e
    for r in range(m):
        acc[r] = _finite_or_inf(acc[r])


@_jit
def _sse2(xt, m, s0, b0, i0, s1, b1, i1, qmax, a0, a1):
    """``_sse`` of two candidate encodings in one pass."""
    for r in range(m):
        a0[r] = _F0
        a1[r] = _F0
    for j in range(xt.shape[0]):
        xj = xt[j]
        for r in range(m):
            v = xj[r]
            e0 = (_code(v, b0[r], i0[r], qmax) * s0[r] + b0[r]) - v
            e1 = (_code(v, b1[r], i1[r], qmax) * s1[r] + b1[r]) - v
            a0[r] += e0 * e0
            a1[r] += e1 * e1
    for r in range(m):
        a0[r] = _finite_or_inf(a0[r])
        a1[r] = _finite_or_inf(a1[r])


@_jit
def _sse_stats(xt, m, s, b, inv, qmax, acc, sq, sqq, sqx):
    """``_sse`` plus the sums the least-squares refit needs: sum q, sum q^2, sum q*x."""
    for r in range(m):
        acc[r] = _F0
        sq[r] = _F0
        sqq[r] = _F0
        sqx[r] = _F0
    for j in range(xt.shape[0]):
        xj = xt[j]
        for r in range(m):
            v = xj[r]
            q = _code(v, b[r], inv[r], qmax)
            e = (q * s[r] + b[r]) - v
            acc[r] += e * e
            sq[r] += q
            sqq[r] += q * q
            sqx[r] += q * v
    for r in range(m):
        acc[r] = _finite_or_inf(acc[r])


@_jit
def _codes_t(xt, m, b, inv, qmax, qt):
    """The codes of the block's rows under their final (bias, 1/scale), transposed like ``xt``:
    ``qt[j, r]`` is element j of row r. nan (only in rows the codec refuses) -> 0."""
    for j in range(xt.shape[0]):
        xj = xt[j]
        qj = qt[j]
        for r in range(m):
            q = _code(xj[r], b[r], inv[r], qmax)
            qj[r] = np.uint8(q if q == q else _F0)


@_jit
def _pack(qt, m, bits, out, row0, p, s, b, checks):
    """Pack each row's codes (element j takes bits [j*bits, (j+1)*bits) of the row's
    little-endian bit stream) into ``out[row0 + r, :p]``, then fp16 scale and bias. 4-bit rows
    are packed by ``_pack4_rows`` or ``_pack4_t`` instead."""
    d = qt.shape[0]
    if bits == 2:
        for j in range(d // 4):
            q0 = qt[4 * j]
            q1 = qt[4 * j + 1]
            q2 = qt[4 * j + 2]
            q3 = qt[4 * j + 3]
            for r in range(m):
                out[row0 + r, j] = q0[r] | (q1[r] << 2) | (q2[r] << 4) | (q3[r] << 6)
        if d % 4:
            for r in range(m):
                w = 0
                for j in range(d // 4 * 4, d):
                    w |= qt[j, r] << (2 * (j % 4))
                out[row0 + r, d // 4] = w
    else:
        for r in range(m):
            word = np.int64(0)
            nb = 0
            o = 0
            for j in range(d):
                word |= np.int64(qt[j, r]) << nb
                nb += bits
                if nb >= 8:
                    out[row0 + r, o] = word & 0xFF
                    o += 1
                    word >>= 8
                    nb -= 8
            if nb > 0:
                out[row0 + r, o] = word & 0xFF
    _put_meta(m, out, row0, p, s, b, checks)


@_jit
def _put_meta(m, out, row0, p, s, b, checks):
    """Each row's fp16 scale and bias after its ``p`` code bytes; a row whose fields are not
    finite fp16 is counted in ``checks[1]`` (the first one's index in ``checks[2]``)."""
    for r in range(m):
        hs = _h16_bits(s[r])
        hb = _h16_bits(b[r])
        out[row0 + r, p] = hs & 0xFF
        out[row0 + r, p + 1] = hs >> 8
        out[row0 + r, p + 2] = hb & 0xFF
        out[row0 + r, p + 3] = hb >> 8
        if (hs & 0x7C00) == 0x7C00 or (hb & 0x7C00) == 0x7C00:
            if checks[1] == 0:
                checks[2] = row0 + r
            checks[1] += 1


@_jit
def _pack4_t(qt, m, out, row0, p, s, b, checks, pk):
    """4-bit rows from the transposed codes ``qt`` (``_codes_t``): each output byte of every row
    of the block at once into the transposed scratch ``pk`` [p, rows], then a byte transpose into
    the rows. Below ``PACK4_ROWS_MIN_DIM`` columns this beats ``_pack4_rows``, whose per-row loop
    of dim / 2 steps is too short to vectorise."""
    d = qt.shape[0]
    h = d // 2
    for j in range(h):
        q0 = qt[2 * j]
        q1 = qt[2 * j + 1]
        pj = pk[j]
        for r in range(m):
            pj[r] = q0[r] | (q1[r] << 4)
    if d % 2:
        q0 = qt[d - 1]
        pj = pk[h]
        for r in range(m):
            pj[r] = q0[r]
    for r in range(m):
        o = out[row0 + r]
        for j in range(p):
            o[j] = pk[j, r]
    _put_meta(m, out, row0, p, s, b, checks)


@_jit
def _pack4_rows(x, row0, m, b, inv, qmax, out, p, s, checks):
    """4-bit codes and packing in one pass over the block's rows in their own (row-major)
    layout: the same codes as ``_codes_t`` + ``_pack``, without the transposed byte scratch
    whose strided stores made packing the slowest step of the kernel at ``PACK4_ROWS_MIN_DIM``
    columns and more."""
    d = x.shape[1]
    h = d // 2
    for r in range(m):
        xr = x[row0 + r]
        o = out[row0 + r]
        br = b[r]
        ir = inv[r]
        for j in range(h):
            q0 = _code(xr[2 * j], br, ir, qmax)
            q1 = _code(xr[2 * j + 1], br, ir, qmax)
            o[j] = np.uint8(q0 if q0 == q0 else _F0) | (np.uint8(q1 if q1 == q1 else _F0) << 4)
        if d % 2:
            q0 = _code(xr[d - 1], br, ir, qmax)
            o[h] = np.uint8(q0 if q0 == q0 else _F0)
    _put_meta(m, out, row0, p, s, b, checks)


@_jit
def encode(x, out, bits, nbins, steps, refits, keep, rows, checks):
    """Encode float32 rows ``x`` [n, d] into ``out`` [n, packed + 4], ``rows`` rows per block
    (see :func:`ckpt.quant.adaptive_kernel.encode_rows`). ``checks`` (int64 [3], zeroed): rows
    whose element sum is not finite (a non-finite element, or an overflowing sum), rows whose
    fp16 scale or bias is not finite, the first of those.

    One function of 127 lines, an exception to the project's ~80-line limit: numba compiles it
    into one loop nest whose per-row arrays stay in registers and the block's transpose in
    cache; split into calls, each would pass the block's scratch arrays again."""
    n, d = x.shape
    p = (d * bits + 7) // 8
    qmax = np.float32((1 << bits) - 1)
    nbf = np.float32(nbins)
    nd = np.float32(d)
    xt = np.empty((d, rows), np.float32)
    w = np.empty((26, rows), np.float32)  # per-row state of the block, one row of w each
    lo, hi, step, cl, ch, up, down = w[0], w[1], w[2], w[3], w[4], w[5], w[6]
    ps, pb, pinv, sp = w[7], w[8], w[9], w[10]
    best, bs, bb = w[11], w[12], w[13]
    s0, b0, i0, e0, s1, b1, i1, e1 = w[14], w[15], w[16], w[17], w[18], w[19], w[20], w[21]
    sx, sq, sqq, sqx = w[22], w[23], w[24], w[25]
    nsq = np.empty(rows, np.float32)
    nsqq = np.empty(rows, np.float32)
    nsqx = np.empty(rows, np.float32)
    alive = np.empty(rows, np.bool_)
    qt = np.empty((d, rows), np.uint8)
    pk = np.empty((p, rows), np.uint8)
    for i0_ in range(0, n, rows):
        m = min(rows, n - i0_)
        for r in range(m):
            xr = x[i0_ + r]
            for j in range(d):
                xt[j, r] = xr[j]
        # row min/max (-0.0 -> +0.0: which zero is "the minimum" is not defined) and sum
        for r in range(m):
            lo[r] = xt[0, r]
            hi[r] = xt[0, r]
            sx[r] = _F0
        for j in range(d):
            xj = xt[j]
            for r in range(m):
                v = xj[r]
                lo[r] = min(lo[r], v)
                hi[r] = max(hi[r], v)
                sx[r] += v
        for r in range(m):
            checks[0] += not (abs(sx[r]) <= _FMAX)
            lo[r] += _F0
            hi[r] += _F0
            step[r] = (hi[r] - lo[r]) / nbf
            cl[r] = lo[r]
            ch[r] = hi[r]
        # plain asymN: the encoding to beat
        _range_params(lo, hi, qmax, m, ps, pb, pinv)
        _sse(xt, m, ps, pb, pinv, qmax, sp)
        for r in range(m):
            best[r] = sp[r]
            bs[r] = ps[r]
            bb[r] = pb[r]
        # greedy: xmin one step up or xmax one step down, whichever decodes better
        for _ in range(steps):
            for r in range(m):
                up[r] = cl[r] + step[r]
                down[r] = ch[r] - step[r]
            _range_params(up, ch, qmax, m, s0, b0, i0)
            _range_params(cl, down, qmax, m, s1, b1, i1)
            _sse2(xt, m, s0, b0, i0, s1, b1, i1, qmax, e0, e1)
            for r in range(m):
                ea, eb, bst = e0[r], e1[r], best[r]
                sa, sb, ba, bbb = s0[r], s1[r], b0[r], b1[r]
                cur_s, cur_b = bs[r], bb[r]
                u, dn, c_lo, c_hi = up[r], down[r], cl[r], ch[r]
                mv = ea < eb
                cl[r] = u if mv else c_lo
                ch[r] = c_hi if mv else dn
                e = ea if mv else eb
                better = e < bst
                best[r] = e if better else bst
                bs[r] = (sa if mv else sb) if better else cur_s
                bb[r] = (ba if mv else bbb) if better else cur_b
        # least-squares refits of (scale, bias) for the codes of the current encoding
        if refits > 0:
            for r in range(m):
                s0[r] = bs[r]
                b0[r] = bb[r]
                i0[r] = _F1 / bs[r]
                alive[r] = True
            _sse_stats(xt, m, s0, b0, i0, qmax, e0, sq, sqq, sqx)
            for k in range(refits):
                for r in range(m):
                    det = nd * sqq[r] - sq[r] * sq[r]
                    s = _h16((nd * sqx[r] - sq[r] * sx[r]) / det)
                    b = _h16((sx[r] - s * sq[r]) / nd)
                    ok = alive[r] & (det > _F0) & (s > _F0) & (s <= _H16MAX) & (abs(b) <= _H16MAX)
                    alive[r] = ok
                    s0[r] = s if ok else _F1
                    b0[r] = b if ok else _F0
                    i0[r] = _F1 / s0[r]
                if k + 1 < refits:
                    _sse_stats(xt, m, s0, b0, i0, qmax, e0, nsq, nsqq, nsqx)
                else:  # the last refit: no next one needs the sums
                    _sse(xt, m, s0, b0, i0, qmax, e0)
                for r in range(m):
                    ok = alive[r]
                    n1, n2, n3, o1, o2, o3 = nsq[r], nsqq[r], nsqx[r], sq[r], sqq[r], sqx[r]
                    e, bst, s, b, cur_s, cur_b = e0[r], best[r], s0[r], b0[r], bs[r], bb[r]
                    sq[r] = n1 if ok else o1
                    sqq[r] = n2 if ok else o2
                    sqx[r] = n3 if ok else o3
                    better = ok & (e < bst)
                    best[r] = e if better else bst
                    bs[r] = s if better else cur_s
                    bb[r] = b if better else cur_b
        # the searched encoding or plain asymN (a row whose plain fp16 fields overflow is
        # refused by the codec): scale s1, bias b1, 1/scale i1
        for r in range(m):
            s_plain, b_plain, s_best, b_best = ps[r], pb[r], bs[r], bb[r]
            plain_ok = (abs(s_plain) <= _H16MAX) & (abs(b_plain) <= _H16MAX)
            use = plain_ok & (best[r] < sp[r] * keep)
            s = s_best if use else s_plain
            s1[r] = s
            b1[r] = b_best if use else b_plain
            i1[r] = _F1 / s
        if bits == 4 and d >= PACK4_ROWS_MIN_DIM:
            _pack4_rows(x, i0_, m, b1, i1, qmax, out, p, s1, checks)
        else:
            _codes_t(xt, m, b1, i1, qmax, qt)
            if bits == 4:
                _pack4_t(qt, m, out, i0_, p, s1, b1, checks, pk)
            else:
                _pack(qt, m, bits, out, i0_, p, s1, b1, checks)
