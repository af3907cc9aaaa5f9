"""The numba code of the restore's fused replay (:mod:`ckpt.restore.kernel`); imported on first use.

Every value written is the one the torch path (:func:`ckpt.restore.replay.decode_rows` then
:func:`ckpt.restore.replay.scatter_rows`) writes: N-bit rows decode as ``bias + q * scale`` in fp32, where
``q * scale`` is exact (at most 8 + 11 significant bits), so the one rounding of the sum is the
same with or without a fused multiply-add; raw rows are copied byte for byte.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_SUB = np.float32(2.0**-24)  # fp16's smallest subnormal

# what launch/kernels.py compiles ahead of time (common/compiled.py): name -> the argument types
# its callers pass (ckpt/restore/kernel.py's FusedReplay: C-contiguous arrays, int64 indices)
AOT_EXPORTS = {
    "select_rows": "UniTuple(i8, 2)(i8[::1], i8, i8, i8, i8, i4[::1], i8, i4[::1], i8, i8[::1], i8[::1])",
    "nbit_rows_into": "void(u1[:, ::1], i8, i8, i8[::1], i8[::1], i8, f4[:, ::1])",
    "raw_rows_into": "void(u1[:, ::1], i8[::1], i8[::1], i8, u1[:, ::1])",
}


def _jit(fn):
    return njit(nogil=True, cache=True, error_model="numpy")(fn)


@_jit
def select_rows(ids, first, n, row_offset, num_rows, written, link, covered, cols, keep_src, keep_dst):
    """The frame's rows that fall in the shard (rows ``first..first+n-1`` when ``first >= 0``, else
    ``ids``): each one's ``covered`` count grows by ``cols``; those no later link than ``link`` has
    written are marked written by it and listed (position in the frame, local row) in
    ``keep_src``/``keep_dst``. Returns (rows listed, rows in the shard)."""
    kept = 0
    inside = 0
    for i in range(n):
        g = first + i if first >= 0 else ids[i]
        local = g - row_offset
        if local < 0 or local >= num_rows:
            continue
        inside += 1
        if cols:
            covered[local] += cols
        if written[local] < link:
            written[local] = link
            keep_src[kept] = i
            keep_dst[kept] = local
            kept += 1
    return kept, inside


@_jit
def _half(lo, hi):
    """The fp16 value of little-endian bytes ``lo, hi`` as a float32 (exact: every fp16 is one)."""
    h = np.int64(lo) | (np.int64(hi) << 8)
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:  # zero or subnormal: m * 2**-24, exact in fp32
        v = np.float32(m) * _SUB
        return -v if h & 0x8000 else v
    exp = np.int64(0xFF) if e == 0x1F else e + 112  # inf/nan keep their mantissa, as a conversion does
    return np.uint32(((h & 0x8000) << 16) | (exp << 23) | (m << 13)).view(np.float32)


@_jit
def nbit_rows_into(data, bits, dim, src, dst, kept, out):
    """``out[dst[j], :] = decode(data[src[j]])`` for ``j < kept``: rows of ``bits``-bit codes packed
    little-endian, then fp16 scale and fp16 bias (fbgemm's fused N-bit layout, ckpt/quant/bitpack.py)."""
    packed = (dim * bits + 7) // 8
    mask = (1 << bits) - 1
    for j in range(kept):
        r = src[j]
        o = dst[j]
        scale = _half(data[r, packed], data[r, packed + 1])
        bias = _half(data[r, packed + 2], data[r, packed + 3])
        k0 = 0  # codes before k0 are decoded by the whole-byte loops below, the rest one by one
        if bits == 4:
            for i in range(dim // 2):
                b = data[r, i]
                out[o, 2 * i] = np.float32(b & 15) * scale + bias
                out[o, 2 * i + 1] = np.float32(b >> 4) * scale + bias
            k0 = dim // 2 * 2
        elif bits == 2:
            for i in range(dim // 4):
                b = data[r, i]
                out[o, 4 * i] = np.float32(b & 3) * scale + bias
                out[o, 4 * i + 1] = np.float32((b >> 2) & 3) * scale + bias
                out[o, 4 * i + 2] = np.float32((b >> 4) & 3) * scale + bias
                out[o, 4 * i + 3] = np.float32(b >> 6) * scale + bias
            k0 = dim // 4 * 4
        elif bits == 3:  # 8 codes in 3 bytes
            for i in range(dim // 8):
                w = np.int64(data[r, 3 * i]) | (np.int64(data[r, 3 * i + 1]) << 8) | (np.int64(data[r, 3 * i + 2]) << 16)
                for t in range(8):
                    out[o, 8 * i + t] = np.float32((w >> (3 * t)) & 7) * scale + bias
            k0 = dim // 8 * 8
        for k in range(k0, dim):
            bit = k * bits
            byte = bit >> 3
            word = np.int64(data[r, byte])
            if byte + 1 < packed:
                word |= np.int64(data[r, byte + 1]) << 8
            out[o, k] = np.float32((word >> (bit & 7)) & mask) * scale + bias


@_jit
def raw_rows_into(data, src, dst, kept, out):
    """``out[dst[j], :] = data[src[j], :]`` for ``j < kept`` (uint8 rows of the same width)."""
    width = data.shape[1]
    for j in range(kept):
        r = src[j]
        o = dst[j]
        for k in range(width):
            out[o, k] = data[r, k]
