"""The C library's allocator, reached through ctypes: finding glibc, and giving its free pages
back to the kernel.

A long-running process whose work comes in bursts (the follower and the server applying a
checkpoint every few seconds, a compaction) frees each burst's temporaries into the malloc
arena of the thread that freed them, and every thread has its own arena: the resident set
then stays at the sum of each arena's peak, not at what is live. `give_back_freed_memory`
after a burst brings it back to what the process holds (docs/design/follower.md and docs/design/serving.md). The
training process does the opposite on purpose (trainer/allocator.py): it frees and
reallocates the same sizes every step, where keeping is cheaper.
"""

from __future__ import annotations

import ctypes
import os


def glibc() -> ctypes.CDLL | None:
    """This process's C library if it is glibc (which has `mallopt` and `malloc_trim`), else None."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    if not version:
        return None
    libc = ctypes.CDLL(None)  # the symbols already loaded: glibc's
    return libc if hasattr(libc, "mallopt") else None


def give_back_freed_memory() -> bool:
    """Return the free pages of every malloc arena to the kernel (glibc's ``malloc_trim(0)``);
    False outside glibc. ctypes releases the GIL for the call, so other threads run meanwhile."""
    libc = glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(ctypes.c_size_t(0))
    return True
