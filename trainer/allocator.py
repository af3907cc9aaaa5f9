"""The C allocator of a training process: keep the memory a step frees for the next step.

Every training step allocates and frees tensors of the same sizes (batches, activations,
gradients, the writer's frames). With glibc's defaults a freed block above the mmap
threshold is handed back to the kernel (``munmap``), and the heap's free top is trimmed
beyond 128 KiB, so the next step faults the same pages in again, and identical jobs' throughput moved with their fault count
(docs/history/BENCHMARKS-2026-11.md, "The C allocator"). `keep_freed_memory` raises glibc's
thresholds with ``mallopt``, glibc's own interface for this (another allocator, such as
jemalloc, would need a preload in every launcher: torchrun, srun, the test spawner).

The cost: memory a step freed stays with the process (its resident size stays at its peak)
instead of going back to the kernel. A variable the user set (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``) wins over this module's value. Outside
glibc (musl, macOS) nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import NamedTuple

from common.allocator import glibc

logger = logging.getLogger(__name__)


class MallocSetting(NamedTuple):
    """One `mallopt` parameter: its number in glibc's malloc.h, the environment variable that
    sets it at start, and the value used here."""

    param: int
    env: str
    value: int


SETTINGS = (
    # blocks up to 32 MiB (glibc's largest mmap threshold on 64-bit) come from the heap
    MallocSetting(-3, "MALLOC_MMAP_THRESHOLD_", 32 << 20),  # M_MMAP_THRESHOLD
    # free memory at the heap's top is given back only beyond 1 GiB
    MallocSetting(-1, "MALLOC_TRIM_THRESHOLD_", 1 << 30),  # M_TRIM_THRESHOLD
    # and the heap grows by 64 MiB beyond each request, not 128 KiB
    MallocSetting(-2, "MALLOC_TOP_PAD_", 64 << 20),  # M_TOP_PAD
)


def keep_freed_memory() -> list[str]:
    """Set every `SETTINGS` entry the environment does not set; the variables it set (empty
    outside glibc)."""
    libc = glibc()
    if libc is None:
        logger.debug("not glibc: the C allocator keeps its defaults")
        return []
    done = []
    for s in SETTINGS:
        if os.environ.get(s.env) is not None:  # the user's own value, read by glibc at start
            continue
        if libc.mallopt(ctypes.c_int(s.param), ctypes.c_int(s.value)) != 1:
            logger.warning("mallopt(%s=%d) refused: the C allocator keeps its default", s.env, s.value)
            continue
        done.append(s.env)
    return done
