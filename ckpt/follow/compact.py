"""Write a compacted baseline: the follower's store as one full chain link.

The rows go, still encoded as the trainer wrote them, into a generation of the follower's
own (`compacted_generation(epoch, checkpoint id)`), one partition per rank of the writing
job, each row into the partition that wrote it. The link is returned only when the sink
acknowledged every frame; the caller publishes the COMPACTED marker after that, so a
half-written compaction is never referenced (docs/design/follower.md, "Compaction"). The sink is flushed every
`max_unflushed_bytes`, so the frames queued in the producer stay that small instead of a
second copy of the whole store (each flush's ranges are kept as they come: one range per
flush and partition).

After the rows come the mapping records of managed-collision tables: each shard's state as
one full record (`RowStore.mapping_records`), in its partition, indexed with ``cols`` 0, so a
restore or a follower reading the baseline gets the mapping without the chain before it.
"""

from __future__ import annotations

from ckpt.follow.store import RowStore
from ckpt.log.markers import ChainLink, FrameMeta, IndexEntry, OffsetRange, index_frames
from ckpt.stream.frames import EncodedFrame, chunk_rows
from ckpt.stream.mapping import mapping_frames
from ckpt.stream.sink import FrameSink, Key, Range, SinkError

MAX_UNFLUSHED_BYTES = 64 << 20  # frames queued in the sink before the compaction waits for them


class _Acknowledged:
    """What every flush of one compaction acknowledged, in write order."""

    def __init__(self) -> None:
        self.ranges: dict[Key, list[Range]] = {}
        self.positions: dict[Key, list[int]] = {}

    def add(self, sink: FrameSink, timeout_s: float) -> None:
        result = sink.flush(timeout_s).raise_for_error()
        for key, ranges in result.ranges.items():
            self.ranges.setdefault(key, []).extend(ranges)
        for key, positions in result.positions.items():
            self.positions.setdefault(key, []).extend(positions)


def write_compacted(
    store: RowStore,
    *,
    sink: FrameSink,
    run_id: str,
    checkpoint_id: int,
    generation: int,
    max_frame_bytes: int,
    flush_timeout_s: float,
    max_unflushed_bytes: int = MAX_UNFLUSHED_BYTES,
) -> ChainLink:
    """Write every row of `store`, then every managed-collision shard's mapping as a full
    record, as checkpoint `checkpoint_id` into `generation`; raises `SinkError` when any frame
    is not durable."""
    meta: dict[int, list[FrameMeta]] = {}  # partition -> frames in write order
    acked = _Acknowledged()
    rows = nbytes = unflushed = 0

    def put(partition: int, encoded: EncodedFrame, table: str, col_offset: int, cols: int) -> None:
        nonlocal nbytes, unflushed
        sink.write(encoded.data, generation=generation, partition=partition)
        meta.setdefault(partition, []).append(
            FrameMeta(table=table, col_offset=col_offset, first_row=encoded.first_row, last_row=encoded.last_row, cols=cols)
        )
        nbytes += len(encoded.data)
        unflushed += len(encoded.data)
        if unflushed >= max_unflushed_bytes:
            acked.add(sink, flush_timeout_s)
            unflushed = 0

    for frame in store.frames(run_id, checkpoint_id):
        partition = frame.rank
        for encoded in chunk_rows(
            run_id=run_id,
            checkpoint_id=checkpoint_id,
            rank=partition,
            table=frame.table,
            col_offset=frame.col_offset,
            dim=frame.dim,
            encoding=frame.encoding,
            row_ids=frame.row_ids,
            payload=frame.payload,
            optim=frame.optim,
            max_frame_bytes=max_frame_bytes,
        ):
            put(partition, encoded, frame.table, frame.col_offset, frame.dim)
        rows += frame.row_count
    for partition, record in store.mapping_records():
        for encoded in mapping_frames(
            record, run_id=run_id, checkpoint_id=checkpoint_id, rank=partition, max_frame_bytes=max_frame_bytes
        ):
            put(partition, encoded, record.table, 0, 0)
    acked.add(sink, flush_timeout_s)
    ranges: dict[int, list[OffsetRange]] = {}
    index: list[IndexEntry] = []
    for partition, frames in sorted(meta.items()):
        positions = acked.positions.get((generation, partition), [])
        if len(positions) != len(frames):
            raise SinkError(
                f"compaction of checkpoint {checkpoint_id}: partition {partition}: {len(frames)} frames "
                f"written but {len(positions)} acknowledged"
            )
        ranges[partition] = [OffsetRange(*r) for r in acked.ranges[(generation, partition)]]
        index.extend(index_frames(partition, positions, frames))
    return ChainLink(
        checkpoint_id=checkpoint_id, full=True, generation=generation, ranges=ranges, rows=rows, bytes=nbytes, index=index
    )
