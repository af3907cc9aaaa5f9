"""A checkpoint's copy running beside the start of the next step (CPU shards, `ckpt.overlap_copy`).

At a checkpoint step the training thread agrees on the checkpoint's kind and captures the loop
state; the copy of the rows and of the dense state (and the tracker's marks) then runs on this
module's thread while the training thread goes on with the next step: loading its batch, the
input all-to-all, the embedding lookup. Nothing changes a row or a dense parameter before the
next backward pass, so the copy reads the state of the checkpoint step as long as it is done
before then; the checkpoint manager makes sure of it by having the tracker's post-lookup hook,
which runs before any backward, wait for it (`RowTracker.hold_next_lookup`), and by waiting
for it at the start of each of its own calls. docs/design.md §2 has the sequence.

The stall is what the training thread loses: the hand-off, plus however long it later waits
for the copy. Both are measured here: as its last step (`Finish`) the copy learns how long the training thread has been blocked
waiting for it so far, so the stall it hands to the writer (and the COMMIT reports) includes it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, TypeVar

_T = TypeVar("_T")

# Called by a copy as its last step: marks it done and returns the seconds the training thread
# has been blocked waiting for it so far (0 when it was not waiting).
Finish = Callable[[], float]


class _InFlight(Generic[_T]):
    """One copy handed to the copier thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.waiting_since: float | None = None  # when the training thread started waiting for it
        self.future: Future[_T] | None = None

    def finish(self) -> float:
        with self.lock:
            self.done = True
            return time.perf_counter() - self.waiting_since if self.waiting_since is not None else 0.0


class CopyBehind(Generic[_T]):
    """One copy at a time on a thread of its own (`start`); `wait` blocks until it is done."""

    def __init__(self) -> None:
        # normal priority, unlike the writer's: the next step's backward waits for this thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deltarec-snapshot")
        self._inflight: _InFlight[_T] | None = None

    @property
    def busy(self) -> bool:
        """Whether a copy was started and not yet waited for."""
        return self._inflight is not None

    def start(self, copy: Callable[[Finish], _T]) -> None:
        """Run `copy(finish)` on the copier thread; it calls `finish()` as its last step."""
        assert self._inflight is None, "wait() for the copy in flight before starting another"
        inflight: _InFlight[_T] = _InFlight()
        inflight.future = self._pool.submit(copy, inflight.finish)
        self._inflight = inflight

    def wait(self) -> _T | None:
        """Block until the copy in flight is done and return what it returned; None when none is
        in flight. A copy's exception is raised here."""
        inflight = self._inflight
        if inflight is None:
            return None
        self._inflight = None
        with inflight.lock:
            if not inflight.done:
                inflight.waiting_since = time.perf_counter()
        assert inflight.future is not None
        return inflight.future.result()

    def close(self) -> None:
        """Stop the thread (a copy in flight finishes first)."""
        self._pool.shutdown(wait=True)
