"""Fused CPU kernel of the fast adaptive search (the algorithm: :mod:`ckpt.quant.adaptive`).

Tool: numba (``@njit(nogil=True, cache=True)``) -- a wheel from the package index; it releases the
GIL, so the checkpoint writer thread encodes beside training. Setup compiles the same source ahead
of time (``launch/kernels.py``) into a module that needs neither numba nor LLVM at run time
(:mod:`common.compiled`; what it saves: docs/BENCHMARKS.md, "Measured outside the suites"); where that module is missing or stale,
the source is jitted, its on-disk cache making later processes load the machine code instead of
compiling it again.

One call encodes a batch, one block of ``block_rows(dim)`` rows at a time. The block is transposed
into an L1-sized ``[dim, rows]`` scratch so that every step of the search -- min/max, the greedy
candidates' fp16 parameters and errors, the greedy choice, the least-squares refits -- is a loop over
the rows of the block that the compiler vectorises (one row per SIMD lane), and each row's error sum
stays in its lane: no horizontal reductions, no per-row branches. The final codes are computed the
same way into a transposed byte scratch and packed from there.

The numba code lives in :mod:`ckpt.quant.adaptive_numba`; the built module or the jitted source is
loaded on the first encode (or :func:`warm_up`), by :func:`kernel`. Either produces bytes
identical to :func:`ckpt.quant.adaptive.fast_encode_torch`.

Callers pass C-contiguous float32 rows; the kernel reports what the codec must refuse (rows
whose sum is not finite, fp16 fields that overflow) instead of the codec reading the batch again.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch

from common import compiled

__all__ = ["AVAILABLE", "KernelChecks", "block_rows", "encode_rows", "encode_rows_checked", "keep_factor", "kernel", "warm_up"]

BLOCK_ELEMS = 4096  # floats per transposed block (16 KiB: half of L1d)
SOURCE = Path(__file__).with_name("adaptive_numba.py")
# the kernel is optional: without numba (and no module built at setup) the codec runs the torch
# reference on CPU too
AVAILABLE = compiled.runnable(SOURCE)


@functools.cache
def kernel() -> ModuleType:
    """The kernel's functions: the module built at setup when its stamp holds, else the numba
    source, jitted (imported here: numba's import is paid on first use only)."""
    built = compiled.load(__package__ or "ckpt.quant", SOURCE)
    if built is not None:
        return built
    from . import adaptive_numba  # noqa: PLC0415

    return adaptive_numba


def block_rows(dim: int) -> int:
    """Rows per transposed block: ``BLOCK_ELEMS // dim``, a multiple of 16 in [16, 256]."""
    return max(16, min(256, BLOCK_ELEMS // max(dim, 1)) // 16 * 16)


def keep_factor(dim: int) -> float:
    """A searched row replaces plain asymN only if its squared error is below plain's times this.

    The margin, 4*(dim+1) fp32 units, covers the rounding of any order of summing the row's
    squared errors, so "never worse than asymN" holds for whoever measures it (torch's norm,
    another reduction order), not just for our element order.
    """
    return float(np.float32(1.0 - (4 * dim + 4) * 2.0**-24))


class KernelChecks(NamedTuple):
    """What one kernel call found besides the codes."""

    sums_not_finite: int  # rows whose element sum is not finite: a NaN/Inf element, or an overflow
    meta_not_finite: int  # rows whose fp16 scale or bias overflowed
    first_meta_not_finite: int  # the first of those (0 when none)


def encode_rows_checked(x: torch.Tensor, bits: int, nbins: int, steps: int, refits: int) -> tuple[torch.Tensor, KernelChecks]:
    """float32 [n, dim] (CPU, C-contiguous) -> (asymN-layout rows uint8 [n, bytes], checks)."""
    n, dim = x.shape
    out = torch.empty(n, (dim * bits + 7) // 8 + 4, dtype=torch.uint8)
    checks = np.zeros(3, np.int64)
    if n:
        kernel().encode(x.numpy(), out.numpy(), bits, nbins, steps, refits, np.float32(keep_factor(dim)), block_rows(dim), checks)
    return out, KernelChecks(*(int(c) for c in checks))


def encode_rows(x: torch.Tensor, bits: int, nbins: int, steps: int, refits: int) -> torch.Tensor:
    """float32 [n, dim] (CPU, C-contiguous, finite) -> asymN-layout rows uint8 [n, bytes]."""
    return encode_rows_checked(x, bits, nbins, steps, refits)[0]


def warm_up() -> None:
    """Load the kernel now (the built module, or numba's cached or compiled machine code) rather
    than in the first checkpoint."""
    encode_rows(torch.zeros(1, 3), 4, 4, 1, 1)  # bits, dims, counts are run-time values: one signature
