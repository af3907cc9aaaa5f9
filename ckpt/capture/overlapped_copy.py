"""A checkpoint's copy running beside the next step (CPU shards, `ckpt.capture.overlap_copy`).

At a checkpoint step the training thread agrees on the checkpoint's kind and captures the loop
state; the rest runs on this module's thread while the training thread goes on with the next
step, in two parts:

1. the bookkeeping: the bitmap scan that chooses the rows, the tracker's marks, the dense
   state. The next step's first lookup marks the bitmaps, so it waits for this part
   (`wait_released`, through `RowTracker.hold_next_lookup`); it takes milliseconds.
2. the copy of the chosen rows. No row changes before the next step's backward pass reaches
   the embedding kernels, whose fused optimizer updates the rows in place; a gradient hook
   on each lookup's output waits for this part there (`wait`), as torchrec's own weight
   stashing waits for its restore (docs/design/dataflow.md, step 3, has the sequence). Until then the copy
   has the rest of the forward pass and the dense part of the backward pass to run in.

The stall is what the training thread loses: the hand-off, plus however long it waits for
either part. Both waits are measured here: the copy's last step (`Finish`) learns how long
the training thread has been blocked on it so far, so the stall it hands to the writer (and
the COMMIT reports) includes them. The checkpointer waits for the whole copy at the
start of each of its own calls as well.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

_T = TypeVar("_T")

# Called by a copy as its last step: marks it done and returns the seconds the training thread
# has been blocked waiting for it so far (0 when it never waited).
Finish = Callable[[], float]
# Called by a copy when its bookkeeping is done (part 1): a lookup waiting for it goes on.
Release = Callable[[], None]


class _InFlight(Generic[_T]):
    """One copy handed to the copier thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.released = threading.Event()  # part 1 done (set too when the copy ends, or fails)
        self.done = False
        self.waiting_since: float | None = None  # when the training thread started its current wait
        self.blocked_s = 0.0  # the training thread's waits that have ended
        self.future: Future[_T] | None = None

    def _end_wait(self, now: float) -> None:
        if self.waiting_since is not None:
            self.blocked_s += now - self.waiting_since
            self.waiting_since = None

    def release(self) -> None:
        with self.lock:
            if not self.released.is_set():
                self._end_wait(time.perf_counter())
                self.released.set()

    def finish(self) -> float:
        with self.lock:
            self.done = True
            self.released.set()
            waiting = time.perf_counter() - self.waiting_since if self.waiting_since is not None else 0.0
            return self.blocked_s + waiting


class CopyBehind(Generic[_T]):
    """One copy at a time on a thread of its own (`start`); `wait_released` blocks until its
    bookkeeping is done, `wait` until all of it is."""

    def __init__(self) -> None:
        # normal priority, unlike the writer's: the next step's backward waits for this thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deltarec-snapshot")
        self._inflight: _InFlight[_T] | None = None

    @property
    def busy(self) -> bool:
        """Whether a copy was started and not yet waited for."""
        return self._inflight is not None

    def start(self, copy: Callable[[Finish, Release], _T]) -> None:
        """Run `copy(finish, release)` on the copier thread: it calls `release()` once its
        bookkeeping is done and `finish()` as its last step."""
        assert self._inflight is None, "wait() for the copy in flight before starting another"
        inflight: _InFlight[_T] = _InFlight()
        inflight.future = self._pool.submit(copy, inflight.finish, inflight.release)
        inflight.future.add_done_callback(lambda _: inflight.released.set())  # a failed copy wakes a waiter
        self._inflight = inflight

    def wait_released(self) -> None:
        """Block until the copy in flight, if any, has done its bookkeeping (or ended). A copy
        that failed before then raises here."""
        inflight = self._inflight
        if inflight is None:
            return
        with inflight.lock:
            if not inflight.released.is_set():
                inflight.waiting_since = time.perf_counter()
        inflight.released.wait()
        assert inflight.future is not None
        if inflight.future.done() and inflight.future.exception() is not None:
            self.wait()  # raises it, and the copy is no longer in flight

    def wait(self) -> _T | None:
        """Block until the copy in flight is done and return what it returned; None when none is
        in flight. A copy's exception is raised here."""
        inflight = self._inflight
        if inflight is None:
            return None
        self._inflight = None
        with inflight.lock:
            if not inflight.done and inflight.waiting_since is None:
                inflight.waiting_since = time.perf_counter()
        assert inflight.future is not None
        return inflight.future.result()

    def close(self) -> None:
        """Stop the thread (a copy in flight finishes first)."""
        self._pool.shutdown(wait=True)
