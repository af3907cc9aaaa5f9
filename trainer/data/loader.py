"""Batches read ahead of the loop, each carrying the reader position after it.

The loop's reader runs behind a `torch.utils.data.DataLoader` (`data.workers` processes per
rank, `data.prefetch_batches` each, pinned memory on CUDA), so parsing and generation leave
the training thread. Read-ahead breaks the reader's own `state_dict()` as the loop's position:
when step k ends, the reader has already produced batches k+1, k+2, ... (prefetched, or in the
train pipeline). So every item a worker yields is a `Positioned(batch, after)`, `after` being
the reader's state once that batch was read, and `PositionedBatches` keeps those states in
fetch order until the loop says a batch was trained (`trained_one`). Its `trained` is the state
to checkpoint: the batches in flight are read again after a restore (docs/design/invariants.md,
invariant 6).

Several workers split the batches round robin (worker w reads batches w, w+N, ...: the
DataLoader hands them out in that order), which needs a reader that skips a batch without
reading it (`SkipsBatches`: the synthetic stream). A reader error in a worker (a malformed
Criteo line) comes back as a `ReaderFailure` and is raised in the loop as the same one-line
`DataError`, not as the DataLoader's wrapped traceback.

Workers leave stop signals to their rank and die with it (`_worker_init`): torchrun and Slurm
signal a rank's whole process group, and a worker killed by that SIGTERM makes the DataLoader
raise in the rank before a survivor under partial recovery has saved (docs/design/invariants.md,
invariant 6).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainer.data.reader import Batch, DataError, Reader


class Positioned(NamedTuple):
    """One batch and the reader's state right after it (what a checkpoint saves once the
    loop has trained the batch)."""

    batch: Batch
    after: dict


class ReaderFailure(NamedTuple):
    """A reader's `DataError`, carried out of a worker process as its one-line message."""

    message: str


@runtime_checkable
class SkipsBatches(Protocol):
    """A reader that can move past its next batch without producing it."""

    def skip_batch(self) -> None: ...


class ReaderDataset(IterableDataset):
    """A reader as an endless iterable of `Positioned` batches, split among the workers."""

    def __init__(self, reader: Reader) -> None:
        super().__init__()
        self.reader = reader

    def __iter__(self) -> Iterator[Positioned | ReaderFailure]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        reader = self.reader
        if workers > 1 and not isinstance(reader, SkipsBatches):
            raise DataError(f"{type(reader).__name__} cannot skip batches, so it cannot be split among {workers} workers")
        k = 0
        while True:
            if k % workers == worker:
                try:
                    batch = reader.next_batch()
                except DataError as exc:
                    yield ReaderFailure(str(exc))
                    return
                yield Positioned(batch, reader.state_dict())
            else:
                reader.skip_batch()  # type: ignore[attr-defined]
            k += 1


def _worker_init(worker_id: int) -> None:
    """In each worker: ignore SIGTERM (the rank gets it too, finishes its step and stops its
    workers), and exit the moment the rank is gone. The DataLoader's own check of its parent
    runs only between batches and then exits through Python, which waits to flush the
    worker's queue to a rank that no longer reads it; a rank killed outright (SIGKILL) would
    leave its workers behind, holding its pipes open."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="deltarec-worker-watch", daemon=True).start()


def _exit_with_parent(parent: int, every_s: float = 0.2) -> None:
    while os.getppid() == parent:
        time.sleep(every_s)  # polling: Linux's parent-death signal follows the forking thread, not the process
    os._exit(0)


class PositionedBatches(Iterator[Batch]):
    """The loop's batch iterator: yields batches, remembers each one's `after` state until
    the loop has trained it, and knows the position of the last trained batch."""

    def __init__(self, items: Iterator[Positioned | ReaderFailure], start: dict) -> None:
        self._items = items
        self._in_flight: deque[dict] = deque()  # `after` of batches handed out, not yet trained
        self.trained = start  # the reader state after the last trained batch

    def __iter__(self) -> PositionedBatches:
        return self

    def __next__(self) -> Batch:
        item = next(self._items)
        if isinstance(item, ReaderFailure):
            raise DataError(item.message)
        self._in_flight.append(item.after)
        return item.batch

    def trained_one(self) -> None:
        """The oldest batch handed out has been trained: its position becomes `trained`."""
        self.trained = self._in_flight.popleft()

    @property
    def in_flight(self) -> int:
        """Batches handed out and not yet trained (prefetched by a pipeline)."""
        return len(self._in_flight)

    def close(self) -> None:
        """Stop the workers now. The DataLoader's iterator shuts them down when it goes, but an
        error a worker raised keeps it alive in its traceback, maybe until the process exits;
        multiprocessing then SIGTERMs the workers, which ignore it (`_worker_init`), and waits
        for them forever. So close calls the same shutdown itself (torch has no public one)."""
        items, self._items = self._items, iter(())
        shutdown = getattr(items, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()


def positioned_batches(reader: Reader, workers: int, prefetch: int, device: torch.device) -> PositionedBatches:
    """Batches of `reader` from its current position, read by `workers` processes (0: by
    `reader` itself, in this process, on demand; workers read forked copies). Either way the
    caller seeks `reader` to `trained` before building the next one."""
    start = reader.state_dict()
    close = getattr(reader, "close", None)
    if callable(close):
        close()  # a worker opens its own file handles
    if workers == 0:
        return PositionedBatches(iter(ReaderDataset(reader)), start)
    loader = DataLoader(
        ReaderDataset(reader),
        batch_size=None,
        num_workers=workers,
        prefetch_factor=prefetch,
        pin_memory=device.type == "cuda",
        generator=torch.Generator(),  # the loader's seed draw leaves the global RNG (saved with the loop) alone
        worker_init_fn=_worker_init,
    )
    return PositionedBatches(iter(loader), start)
