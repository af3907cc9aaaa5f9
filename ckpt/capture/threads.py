"""Background threads of a checkpoint that should yield the cores to training."""

from __future__ import annotations

import os
import threading


def lower_thread_priority(nice: int) -> None:
    """Add `nice` to the calling thread's niceness (Linux: per thread), so that its work
    yields the cores to the training thread when both want them. Raises ``OSError`` where a
    sandbox forbids it; nothing happens for `nice` <= 0 or where the OS has no per-thread
    priority."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
