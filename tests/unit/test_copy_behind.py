"""ckpt/capture/overlapped_copy.py: a checkpoint's copy on its own thread, its two waits (the bookkeeping,
then the rows), and how long the training thread waited for it (what the stall reports)."""

from __future__ import annotations

import threading
import time

import pytest

from ckpt.capture.overlapped_copy import CopyBehind, Finish, Release


def _set_once_waited_for(copier: CopyBehind, event: threading.Event, after_s: float = 0.0) -> None:
    """On another thread: once the training thread waits for the copy in flight, wait
    `after_s` more, then set `event` (which the copy is blocked on)."""
    inflight = copier._inflight
    assert inflight is not None

    def run() -> None:
        while inflight.waiting_since is None:
            time.sleep(0.001)
        time.sleep(after_s)
        event.set()

    threading.Thread(target=run).start()


def test_a_copy_done_before_anyone_waits_reports_no_wait() -> None:
    copier: CopyBehind[float] = CopyBehind()
    done = threading.Event()

    def copy(finish: Finish, release: Release) -> float:
        waited = finish()
        done.set()
        return waited

    copier.start(copy)
    assert done.wait(10)
    assert copier.busy
    assert copier.wait() == 0.0  # nobody was waiting when it finished
    assert not copier.busy and copier.wait() is None
    copier.close()


def test_a_copy_the_training_thread_waits_for_reports_that_wait_to_the_writer() -> None:
    copier: CopyBehind[float] = CopyBehind()
    go = threading.Event()

    def copy(finish: Finish, release: Release) -> float:
        assert go.wait(10)
        return finish()

    copier.start(copy)
    _set_once_waited_for(copier, go)  # the copy ends only after wait() has started waiting
    t = time.perf_counter()
    reported = copier.wait()
    assert reported is not None and 0.0 < reported <= time.perf_counter() - t  # the copy saw the wait so far
    copier.close()


# the checkpointer's wait, or the next lookup's (a copy that fails before its bookkeeping is done)
@pytest.mark.parametrize("waiter", ["wait", "wait_released"])
def test_a_failed_copy_raises_where_it_is_waited_for_and_the_next_one_runs(waiter: str) -> None:
    copier: CopyBehind[int] = CopyBehind()

    def broken(finish: Finish, release: Release) -> int:
        raise RuntimeError("slab lost")

    copier.start(broken)
    with pytest.raises(RuntimeError, match="slab lost"):
        getattr(copier, waiter)()
    assert not copier.busy
    copier.start(lambda finish, release: 7)
    assert copier.wait() == 7
    copier.close()


def test_a_second_copy_cannot_start_before_the_first_is_waited_for() -> None:
    copier: CopyBehind[int] = CopyBehind()
    copier.start(lambda finish, release: 1)
    with pytest.raises(AssertionError):
        copier.start(lambda finish, release: 2)
    copier.wait()
    copier.close()


def test_the_bookkeeping_is_waited_for_apart_and_both_waits_count_in_the_stall() -> None:
    copier: CopyBehind[float] = CopyBehind()
    bookkept, rows = threading.Event(), threading.Event()
    copied = threading.Event()

    def copy(finish: Finish, release: Release) -> float:
        assert bookkept.wait(10)
        release()
        assert rows.wait(10)
        copied.set()
        return finish()

    copier.start(copy)
    _set_once_waited_for(copier, bookkept, after_s=0.02)
    t = time.perf_counter()
    copier.wait_released()
    first = time.perf_counter() - t
    assert first >= 0.02 and not copied.is_set() and copier.busy  # the rows are still to copy
    copier.wait_released()  # released already: returns at once
    time.sleep(0.05)  # the training thread works: not a wait
    _set_once_waited_for(copier, rows, after_s=0.02)
    t = time.perf_counter()
    reported = copier.wait()
    second = time.perf_counter() - t
    assert reported is not None
    assert 0.04 <= reported <= first + second  # both waits, not the work between them
    copier.close()


def test_without_a_copy_in_flight_neither_wait_blocks() -> None:
    copier: CopyBehind[int] = CopyBehind()
    copier.wait_released()
    assert copier.wait() is None
    copier.start(lambda finish, release: finish() and 0)  # never calls release: finish releases
    copier.wait_released()
    assert copier.wait() == 0
    copier.close()
