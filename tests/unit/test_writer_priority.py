"""The checkpoint writer thread lowers its own priority (Linux niceness, per thread), so
that on a CPU host the encoder yields the cores to the training thread."""

from __future__ import annotations

import os
import threading
import time

import pytest

from ckpt.write.writer import RankWriter

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="needs os.setpriority (Linux)")


def _writer(nice: int) -> RankWriter:
    # rank 1 (no committer); the thread only waits for jobs, so no sink or group is touched
    return RankWriter(
        run_id="r",
        rank=1,
        sink=None,
        group=None,
        max_frame_bytes=1 << 20,  # type: ignore[arg-type]
        flush_timeout_s=1.0,
        committer=None,
        nice=nice,
    )


def _thread_nice(w: RankWriter, want: int) -> int:
    """The writer thread's niceness once it equals `want`, or its value after 10 s."""
    deadline = time.monotonic() + 10.0
    while True:
        got = os.getpriority(os.PRIO_PROCESS, w._thread.native_id)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.01)  # the thread sets it as its first action


@pytest.mark.parametrize("nice", [0, 7])
def test_writer_thread_adds_its_niceness_and_leaves_the_caller_alone(nice: int) -> None:
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    w = _writer(nice)
    try:
        assert _thread_nice(w, min(19, caller + nice)) == min(19, caller + nice)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller
    finally:
        assert w.close(10.0) == []
