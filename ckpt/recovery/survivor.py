"""A surviving rank's snapshot: what it saves when another rank died (`ckpt.recovery.mode: partial`).

CPR keeps the surviving parameter servers' state and rolls back only the failed ones. Here
every rank of the job exits when one dies (torchrun restarts them all), so a survivor
saves what it has before it exits, within `ckpt.recovery.survivor_timeout_s`:

1. frames of its shards' rows changed since the newest checkpoint it knew committed (its
   *base*), in the run's codecs, to partition = rank of generation S, S being the
   checkpoint id the attempt would have used next (a fresh id: the markers log counts it,
   so no later checkpoint reuses it; survivors that agree on S share its topic, one
   partition each), then the full mapping record of each of its managed-collision shards
   (a survivor's snapshot is replayed after links this rank's writer may never have known
   committed, so its mapping follows none of them);
2. a dense file: dense parameters and optimizer state, its loop state (step, reader, RNG)
   and the run's counters;
3. last, a SURVIVOR record in the markers log naming both.

No record, no snapshot: a survivor killed or out of time before step 3 leaves frames and a
file that nothing refers to, and its shards roll back like the dead rank's. The job's
process groups are broken by then, so nothing here talks to another rank: it opens a sink,
markers log and dense store of its own (docs/design/partial-recovery.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckpt.config import SinkConfig
from ckpt.dense.store import DenseStore
from ckpt.faults import maybe_die, maybe_hold
from ckpt.log.backend import open_backend
from ckpt.log.markers import ChainLink, SurvivorRecord, encode_marker
from ckpt.stream.mapping import MappingRecord
from ckpt.write.writer import WriteJob, write_rows
from common.errors import DeltarecError

logger = logging.getLogger(__name__)


class SurvivorError(DeltarecError, RuntimeError):
    """A survivor snapshot could not be saved in time; nothing a restore would use was left."""


def save_survivor(
    sink: SinkConfig,
    *,
    run_id: str,
    rank: int,
    job: WriteJob,
    attempt: str,
    world_size: int,
    base: int,
    dense_state: dict[str, Any],
    shards: list[list[Any]],
    deadline: float,
) -> SurvivorRecord:
    """Write one surviving rank's snapshot (`job`: its rows since checkpoint `base` and its
    managed-collision states, for generation and checkpoint id S; `dense_state`: what its dense
    file holds) and, only if all of it is durable before `deadline` (time.monotonic()), its
    SURVIVOR record."""
    left = _left(deadline, "before writing anything")
    backend = open_backend(run_id, replace(sink, flush_timeout_s=max(left, 0.1)), world_size)
    try:
        report = write_rows(
            job,
            run_id=run_id,
            rank=rank,
            sink=backend.sink,
            max_frame_bytes=sink.max_frame_bytes,
            flush_timeout_s=left,
            mapping=[MappingRecord.of_state(s) for s in job.mapping],
        )
        if not report.ok:
            raise SurvivorError(f"survivor snapshot of rank {rank}: {report.error}")
        _left(deadline, "after its frames")
        ref = DenseStore(Path(sink.dense_dir)).write_survivor(job.checkpoint_id, rank, dense_state)
        _left(deadline, "after its dense file")
        maybe_die("survivor", job.checkpoint_id, rank)
        maybe_hold("survivor", job.checkpoint_id)
        link = ChainLink(
            checkpoint_id=job.checkpoint_id,
            full=False,
            generation=job.generation,
            ranges=report.ranges,
            rows=report.rows,
            bytes=report.bytes,
            index=report.index,
            epoch=job.epoch,
        )
        record = SurvivorRecord(
            kind="survivor",
            run_id=run_id,
            attempt=attempt,
            rank=rank,
            world_size=world_size,
            base=base,
            step=job.step,
            link=link,
            dense=ref.as_json(),
            shards=shards,
            created_unix=time.time(),
        )
        _left(deadline, "before its record")
        backend.markers.append_marker(encode_marker(record))
        return record
    finally:
        backend.close()


def _left(deadline: float, when: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise SurvivorError(f"survivor snapshot out of time {when} (ckpt.recovery.survivor_timeout_s); it is not used")
    return left
