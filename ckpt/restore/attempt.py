"""This trainer attempt in the markers log (ckpt/log/fencing.py, docs/design/failures.md, "Zombie writers"): rank 0
announces it as soon as the restore has chosen its checkpoint, and every rank learns its epoch
before the attempt's first checkpoint (or, under partial recovery, right after the restore).

The ATTEMPT record says which checkpoint the restore chose (`resumed_from`, 0 for a fresh
start): from the record on, the checkpoints of older attempts after that one are an abandoned
branch for every reader of the log (ckpt/log/catalog.py, "Branches"). The record is appended
after the choice, as it always was, so fencing is unchanged: it still precedes anything this
attempt writes."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from ckpt.log.backend import Backend
from ckpt.log.catalog import Catalog
from ckpt.log.fencing import Announced, new_writer_id
from ckpt.log.markers import AttemptRecord, encode_marker
from ckpt.restore.choice import from_rank0
from ckpt.stream.sink import MarkerLog, SinkError
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

    def announce(self, catalog: Catalog, resumed_from: int) -> None:
        """Rank 0, once the checkpoint to resume (`resumed_from`; 0: none, a fresh start) is
        chosen from `catalog`: this attempt's ATTEMPT record is appended in the background. A
        fresh idempotent producer's first append takes about a second on the embedded broker,
        which the restore need not wait for; the first checkpoint does (`join`)."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="deltarec-announce")
        future = pool.submit(announce_trainer, self.backend.markers, self.run_id, self.world_size, resumed_from)
        self._announcing = (future, catalog)
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


def announce_trainer(markers: MarkerLog, run_id: str, world_size: int, resumed_from: int) -> Announced:
    """Append a trainer attempt's ATTEMPT record, naming the checkpoint it resumed from
    (durable before it returns); `ckpt.log.fencing.announce` with `resumed_from`."""
    record = AttemptRecord(
        kind="attempt",
        run_id=run_id,
        role="trainer",
        attempt=new_writer_id(),
        world_size=world_size,
        created_unix=time.time(),
        resumed_from=max(resumed_from, 0),
    )
    return Announced(record, markers.append_marker(encode_marker(record)) + 1)
