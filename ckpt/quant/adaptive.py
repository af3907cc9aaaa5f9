"""Adaptive asymmetric quantization (Check-N-Run, NSDI'22, sec. 5): a greedy search of the
clipping range per row.

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
(plain torch ops; on CUDA the same code runs with one large slab).

The encoded row is an ``asymN`` row packed with the chosen range (fbgemm's
``...SBHalfWithRowwiseMinMax`` at 2/4 bits), so decode is ``asymN`` decode. Before emitting, each
row's real decoded L2 error is compared with plain ``asymN`` (the [min, max] range) and the
better encoding is kept, so an adaptive row is never worse than the plain asymmetric one.
"""

from __future__ import annotations

import math

import torch

from .base import as_float_rows, check_encoded, check_finite_meta
from .bitpack import packed_bytes
from .uniform import _half_ok, decode_nbit, encode_nbit_with_range

__all__ = ["AdaptiveCodec", "greedy_range_search", "DEFAULT_RATIO", "DEFAULT_NBINS"]

DEFAULT_NBINS = 200
SLAB_ELEMS = 1 << 16  # elements per candidate slab of the error evaluation (CPU)
CHUNK_SLABS = 16  # slabs per search chunk: amortises the per-step bookkeeping
# fraction of the original range at which the search stops, per bit width. 4-bit: fbgemm/torch's
# setting (0.16 removed); fewer levels want more clipping, so 3/2-bit search deeper (see docs/quant.md).
DEFAULT_RATIO = {4: 0.84, 3: 0.7, 2: 0.5}


def search_steps(nbins: int, ratio: float) -> int:
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


def _row_err(x: torch.Tensor, enc: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.linalg.vector_norm(decode_nbit(enc, bits, x.shape[1]).sub_(x), dim=1)


class AdaptiveCodec:
    """Adaptive asymmetric N-bit codec; on-stream identical to ``asymN`` (decode is the same)."""

    family = "adaptive"

    def __init__(self, bits: int, nbins: int = DEFAULT_NBINS, ratio: float | None = None):
        if bits not in (2, 3, 4):
            raise ValueError(f"adaptive codec supports 2, 3 or 4 bits, got {bits}")
        self.bits = bits
        self.nbins = nbins
        self.ratio = DEFAULT_RATIO[bits] if ratio is None else ratio
        self.name = f"adaptive{bits}"
        self.code = 0x30 | bits

    def __repr__(self) -> str:
        return f"<codec {self.name} code={self.code} nbins={self.nbins} ratio={self.ratio}>"

    def row_bytes(self, dim: int) -> int:
        return packed_bytes(dim, self.bits) + 4

    def encode(self, rows, *, table="?", row_ids=None):
        x = as_float_rows(rows, table, row_ids)
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
        check_finite_meta(_half_ok(out[:, -4:]), table, row_ids, self.name)
        return out

    def decode(self, data, dim):
        check_encoded(data, self.row_bytes(dim), self.name)
        return decode_nbit(data, self.bits, dim)
