"""Non-uniform per-row quantization: 1-D k-means (Lloyd) with 2^bits centroids per row.

Check-N-Run tried k-means and dropped it as too slow for production; it is here so that its
error and its measured cost can be compared (docs/quant.md), not as a default.

Row layout: ``[ceil(dim*N/8) bytes of N-bit codes][2^N fp16 centroids, ascending]``;
``x_i = centroid[code_i]``. At dim 64 a 4-bit row is 64 bytes (8 bits/element), against 36 for
``asym4`` -- the centroid table is the price of non-uniform levels.

Vectorised 1-D Lloyd: each row is sorted once with float64 prefix sums; in 1-D every cluster is a
contiguous run of the sorted row, so an iteration is a batched ``searchsorted`` of the K-1
midpoints plus prefix-sum differences -- O(K log dim) per row, no [rows, dim, K] distance tensor
and no per-row Python loop. Centroids start on the uniform [min, max] grid (the asymN levels), so
the first assignment is the plain asymmetric one and Lloyd's iterations can only lower the error
from there (up to fp16 rounding of the stored centroids). Empty clusters keep their centroid.
Codes are the nearest stored (fp16) centroid.
"""

from __future__ import annotations

import torch

from .base import as_float_rows, check_encoded, check_finite_meta, view_bytes_as
from .bitpack import pack_bits, packed_bytes, unpack_bits

__all__ = ["KMeansCodec", "kmeans_rows"]


def kmeans_rows(x: torch.Tensor, k: int, iters: int = 10) -> torch.Tensor:
    """float32 [R, D] -> centroids float32 [R, k], ascending per row."""
    R, D = x.shape
    xs, _ = torch.sort(x, dim=1)
    P = torch.zeros(R, D + 1, dtype=torch.float64, device=x.device)
    torch.cumsum(xs, dim=1, dtype=torch.float64, out=P[:, 1:])
    lo, hi = xs[:, :1], xs[:, -1:]
    grid = torch.arange(k, dtype=torch.float32, device=x.device) / (k - 1)
    c = torch.addcmul(lo, hi - lo, grid)  # [R, k] uniform grid: the asym levels
    first = torch.zeros(R, 1, dtype=torch.long, device=x.device)
    last = torch.full((R, 1), D, dtype=torch.long, device=x.device)
    for _ in range(iters):
        mid = (c[:, 1:] + c[:, :-1]).mul_(0.5)
        bounds = torch.cat([first, torch.searchsorted(xs, mid), last], dim=1)  # [R, k+1]
        cnt = bounds.diff(dim=1)
        sums = P.gather(1, bounds).diff(dim=1)
        new = torch.where(cnt > 0, (sums / cnt.clamp_min(1)).to(torch.float32), c)
        if torch.equal(new, c):
            break
        c = new
    return c


class KMeansCodec:
    family = "kmeans"

    def __init__(self, bits: int, iters: int = 10):
        if bits not in (2, 3, 4):
            raise ValueError(f"kmeans codec supports 2, 3 or 4 bits, got {bits}")
        self.bits = bits
        self.k = 1 << bits
        self.iters = iters
        self.name = f"kmeans{bits}"
        self.code = 0x40 | bits

    def __repr__(self) -> str:
        return f"<codec {self.name} code={self.code} iters={self.iters}>"

    def row_bytes(self, dim: int) -> int:
        return packed_bytes(dim, self.bits) + 2 * self.k

    def encode(self, rows, *, table="?", row_ids=None):
        x = as_float_rows(rows, table, row_ids)
        n, dim = x.shape
        P = packed_bytes(dim, self.bits)
        out = torch.empty(n, self.row_bytes(dim), dtype=torch.uint8, device=x.device)
        ok = torch.ones(n, dtype=torch.bool, device=x.device)
        step = max(1, ((1 << 18) if x.device.type == "cpu" else (1 << 24)) // dim)
        for i in range(0, n, step):
            xc = x[i : i + step]
            c16 = kmeans_rows(xc, self.k, self.iters).to(torch.float16)
            cf = c16.to(torch.float32)
            ok[i : i + step] = torch.isfinite(cf).all(dim=1)
            mid = (cf[:, 1:] + cf[:, :-1]).mul_(0.5).contiguous()
            codes = torch.searchsorted(mid, xc).to(torch.uint8)  # nearest stored centroid
            out[i : i + step, :P] = pack_bits(codes, self.bits)
            out[i : i + step, P:] = c16.contiguous().view(torch.uint8)
        check_finite_meta(ok, table, row_ids, self.name)
        return out

    def decode(self, data, dim):
        check_encoded(data, self.row_bytes(dim), self.name)
        P = packed_bytes(dim, self.bits)
        c = view_bytes_as(data[:, P:], torch.float16).to(torch.float32)
        codes = unpack_bits(data[:, :P], self.bits, dim).to(torch.long)
        return c.gather(1, codes)
