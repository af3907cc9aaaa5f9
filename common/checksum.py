"""CRC-32 with zlib's polynomial and values (`zlib.crc32`'s, so every frame, record and marker
written before stays readable), computed by ISA-L's carry-less-multiply kernels (`isal`).

Every frame a checkpoint writes is checksummed once by its writer and once more by whoever
reads it (restore, follower, server); for fp32 rows stdlib zlib's CRC was the largest part of
encoding a frame, about a quarter of the writer thread's CPU (docs/history/BENCHMARKS-2026-12.md,
"What an fp32 checkpoint costs at full size, by thread"). Where the `isal` wheel is missing the
stdlib gives the same values, slower.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # a platform without its wheel: the same values from the stdlib
    from zlib import crc32

__all__ = ["crc32"]
