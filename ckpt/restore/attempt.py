"""This trainer attempt in the markers log (ckpt/log/fencing.py, docs/design/failures.md, "Zombie writers"): rank 0
announces it as soon as the restore has chosen its checkpoint, and every rank learns its epoch
before the attempt's first checkpoint (or, under partial recovery, right after the restore)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from ckpt.log.backend import Backend
from ckpt.log.catalog import Catalog
from ckpt.log.fencing import Announced, announce
from ckpt.restore.choice import from_rank0
from ckpt.stream.sink import SinkError
from ckpt.write.committer import Committer
from common.errors import DeltarecError


class Attempt:
    """This attempt's id and epoch, which every frame carries; unknown (epoch 0) until `join`."""

    def __init__(self, backend: Backend, run_id: str, world_size: int, committer: Committer | None) -> None:
        self.backend = backend
        self.run_id = run_id
        self.world_size = world_size
        self.committer = committer  # rank 0's
        self.epoch = 0  # 0: not yet known
        self.id = ""  # known with the epoch
        self._announcing: tuple[Future[Announced], Catalog] | None = None  # rank 0, from the restore on

    def announce(self, catalog: Catalog) -> None:
        """Rank 0, once the checkpoint to resume is chosen from `catalog`: this attempt's ATTEMPT
        record is appended in the background. A fresh idempotent producer's first append takes
        about a second on the embedded broker, which the restore need not wait for; the first
        checkpoint does (`join`)."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="deltarec-announce")
        self._announcing = (pool.submit(announce, self.backend.markers, self.run_id, "trainer", self.world_size), catalog)
        pool.shutdown(wait=False)

    def join(self) -> None:
        """Rank 0 waits for its ATTEMPT record and hands it to the committer; every rank learns
        the epoch its frames carry."""

        def join() -> tuple[int, str]:
            assert self._announcing is not None and self.committer is not None
            future, catalog = self._announcing
            try:
                attempt, epoch = future.result()
            except DeltarecError:
                raise
            except Exception as exc:  # noqa: BLE001 - a client's own error: every rank stops with it
                raise SinkError(f"run {self.run_id}: cannot announce this attempt in the markers log: {exc}") from exc
            self.committer.start_attempt(attempt, epoch, catalog)
            return epoch, attempt.attempt

        self.epoch, self.id = from_rank0(join, SinkError)
