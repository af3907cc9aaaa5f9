"""ckpt/copy_behind.py: a checkpoint's copy on its own thread, and how long the training thread
waited for it (what the stall reports)."""

from __future__ import annotations

import threading
import time

import pytest

from ckpt.copy_behind import CopyBehind, Finish


def test_a_copy_done_before_anyone_waits_reports_no_wait() -> None:
    copier: CopyBehind[float] = CopyBehind()
    done = threading.Event()

    def copy(finish: Finish) -> float:
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

    def copy(finish: Finish) -> float:
        assert go.wait(10)
        return finish()

    copier.start(copy)
    inflight = copier._inflight
    assert inflight is not None

    def release_once_waited_for() -> None:  # the copy ends only after wait() has started waiting
        while inflight.waiting_since is None:
            time.sleep(0.001)
        go.set()

    threading.Thread(target=release_once_waited_for).start()
    t = time.perf_counter()
    reported = copier.wait()
    assert reported is not None and 0.0 < reported <= time.perf_counter() - t  # the copy saw the wait so far
    copier.close()


def test_a_failed_copy_raises_where_it_is_waited_for_and_the_next_one_runs() -> None:
    copier: CopyBehind[int] = CopyBehind()

    def broken(finish: Finish) -> int:
        raise RuntimeError("slab lost")

    copier.start(broken)
    with pytest.raises(RuntimeError, match="slab lost"):
        copier.wait()
    copier.start(lambda finish: 7)
    assert copier.wait() == 7
    copier.close()


def test_a_second_copy_cannot_start_before_the_first_is_waited_for() -> None:
    copier: CopyBehind[int] = CopyBehind()
    copier.start(lambda finish: 1)
    with pytest.raises(AssertionError):
        copier.start(lambda finish: 2)
    copier.wait()
    copier.close()
