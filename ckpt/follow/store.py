"""The follower's materialised copy of every table: each row's newest *encoded* bytes.

Rows are kept exactly as the trainer's frames carried them (codec id plus the codec's
bytes, for the weights and for every optimizer state), addressed by (table, column offset,
global row) like everything in the stream (invariant 3). Nothing is decoded or re-encoded
here, so a compacted baseline cut from this store restores bit-identically to replaying
the chain it replaces, quantized rows included (docs/design/follower.md, "The store").

A chain whose marker names a row initialisation holds only the rows trained since it, so
rows may stay unwritten (codec 0); they are left out of compacted baselines, and restore
regenerates them.

Memory: per row of a shard, the widest encoded row seen for the weights and for each
optimizer state, plus one codec byte for each and two bytes for the writing partition.
A 4-bit-only stream of 64-dim rows with row-wise Adagrad costs 36 + 4 + 4 bytes a row
(fp32 rows: 256 + 4 + 4).

Managed-collision tables also carry, per shard, a mapping record (raw id -> slot:
ckpt/stream/mapping.py) that the rows mean nothing without. The store keeps each shard's
current mapping state (`MappingStore`), folded record by record in chain order: a full record
is the state, a delta applies to the state of the checkpoint it follows, which is the one the
store's mapping is at (an incremental chain) or the chain's base (a one-shot diff, which the
store also keeps). A compacted baseline writes each shard's state as one full record.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ckpt.log.markers import Marker
from ckpt.quant import get_codec
from ckpt.stream.frames import Frame, OptimState
from ckpt.stream.mapping import MappingRecord, full_nbytes, join_mapping
from ckpt.types import RestoreError
from sharding.managed_collision import McState

SLICE_ROWS = 1 << 18  # rows of one shard a compaction or a serving snapshot cuts into frames at a time


#: Rows of a shard as numpy indexes them: a run's slice, or the ids
RowIndex = slice | np.ndarray


def row_index(frame: Frame) -> RowIndex:
    """The frame's rows as numpy indexes a shard's arrays: a slice for a run (full checkpoints,
    compacted baselines), else its ids. The store writes through numpy, which copies rows on
    one thread: torch's indexed writes split even a few hundred rows over its intra-op threads,
    whose wake-ups cost milliseconds a frame on a machine whose cores the trainer keeps busy."""
    if frame.first_row is not None:
        return slice(frame.first_row, frame.first_row + frame.row_count)
    return frame.row_ids.numpy()


def _inside(ids: RowIndex, rows: int) -> bool:
    if isinstance(ids, slice):
        return 0 <= ids.start and ids.stop <= rows
    return bool(ids.min() >= 0) and bool(ids.max() < rows)


class ShardKey(NamedTuple):
    """Columns `col_offset`..`col_offset + dim - 1` of one table (one column shard)."""

    table: str
    col_offset: int
    dim: int


@dataclass
class EncodedRows:
    """One tensor kind (the weights, or one optimizer state) of one shard, row by row."""

    width: int  # values per row: the shard's dim, or 1 for row-wise state
    data: torch.Tensor  # uint8 [rows, widest row seen]
    code: torch.Tensor  # uint8 [rows]: the codec id of each row; 0 = not written yet

    @classmethod
    def empty(cls, rows: int, width: int) -> EncodedRows:
        return cls(width, torch.zeros(rows, 0, dtype=torch.uint8), torch.zeros(rows, dtype=torch.uint8))

    def put(self, ids: RowIndex, code: int, rows: torch.Tensor) -> None:
        """Keep `rows` (uint8 [n, bytes]) as rows `ids` (`row_index`), codec `code`."""
        nbytes = rows.shape[1]
        if nbytes > self.data.shape[1]:
            wider = torch.zeros(self.data.shape[0], nbytes, dtype=torch.uint8)
            wider[:, : self.data.shape[1]] = self.data
            self.data = wider
        self.data.numpy()[ids, :nbytes] = rows.numpy()
        self.code.numpy()[ids] = code

    def row_bytes(self, code: int) -> int:
        return get_codec(code).row_bytes(self.width)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.code.numel()


@dataclass
class ShardRows:
    """Every row of one column shard of a table: weights, optimizer states, writing partition."""

    weights: EncodedRows
    partition: torch.Tensor  # int16 [rows]: the rank whose frame wrote the row last
    optim: dict[str, EncodedRows] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes + self.partition.numel() * 2 + sum(o.nbytes for o in self.optim.values())


class MappingKey(NamedTuple):
    """One shard of a managed-collision table: the table and the partition (rank) that writes
    its mapping records."""

    table: str
    partition: int


@dataclass
class MappingShard:
    """The mapping of one shard as the chain applied so far leaves it."""

    state: McState
    at: int  # the checkpoint whose record left `state`
    base: McState | None  # its state at the chain's base checkpoint (a one-shot diff applies to it); None: not held

    @property
    def nbytes(self) -> int:
        base = 0 if self.base is None or self.base is self.state else full_nbytes(self.base)
        return full_nbytes(self.state) + base


class MappingStore:
    """The mapping of every managed-collision shard, fed mapping frames in chain order.

    A shard's record may span several frames (chunks 0..count-1, consecutive in its partition):
    they are held until the last one came, then joined and folded. A delta record names the
    checkpoint it follows (`MappingRecord.follows`): the store's own checkpoint for the shard
    in an incremental chain, the base for a one-shot diff (a diff of the same baseline as the
    previous one, which it replaces). The base is the first checkpoint applied after `reset`,
    or the one `rebase` names after a compaction."""

    def __init__(self) -> None:
        self.shards: dict[MappingKey, MappingShard] = {}
        self.base_id: int | None = None  # the chain's base checkpoint; None: nothing applied since `reset`
        self._pieces: dict[MappingKey, list[Frame]] = {}  # chunks of a record not yet whole

    def reset(self) -> None:
        self.shards, self.base_id, self._pieces = {}, None, {}

    def seen(self, checkpoint_id: int) -> None:
        """A frame of checkpoint `checkpoint_id` is being applied: the first after `reset` is the base's."""
        if self.base_id is None:
            self.base_id = checkpoint_id

    def rebase(self, checkpoint_id: int) -> None:
        """The chain now starts at checkpoint `checkpoint_id`, whose state the store holds (a
        compaction wrote it): one-shot diffs of that baseline apply to what is held now."""
        self.base_id = checkpoint_id
        for shard in self.shards.values():
            shard.base = shard.state

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values())

    def apply(self, frame: Frame, partition: int, table_rows: int) -> None:
        """Take one mapping frame of `partition`; fold its record in once whole."""
        key = MappingKey(frame.table, partition)
        pieces = self._pieces.setdefault(key, [])
        if pieces and frame.chunk_index == 0:
            raise RestoreError(
                f"checkpoint {frame.checkpoint_id}: table {frame.table} partition {partition}: the mapping record of "
                f"checkpoint {pieces[0].checkpoint_id} ended after {len(pieces)} of its {pieces[0].chunk_count} frames"
            )
        pieces.append(frame)
        if frame.chunk_index + 1 < frame.chunk_count:
            return
        del self._pieces[key]
        record = join_mapping(pieces)
        if record.segments[-1] != table_rows:
            raise RestoreError(
                f"checkpoint {frame.checkpoint_id}: table {frame.table}: its mapping is of {record.segments[-1]} slots, "
                f"the table has {table_rows} rows"
            )
        self._fold(key, record, frame.checkpoint_id)

    def _fold(self, key: MappingKey, record: MappingRecord, checkpoint_id: int) -> None:
        held = self.shards.get(key)
        if record.state is not None:
            state = record.state
        elif held is not None and held.at == record.follows:
            state = record.resolve(held.state, held.at)
        elif held is not None and held.base is not None and self.base_id == record.follows:
            state = record.resolve(held.base, record.follows)
        else:
            have = "no mapping" if held is None else f"the mapping of checkpoint {held.at} (base {self.base_id})"
            raise RestoreError(
                f"checkpoint {checkpoint_id}: table {key.table} partition {key.partition}: its mapping is a delta "
                f"from checkpoint {record.follows}, the store holds {have}"
            )
        if held is not None and (held.state.slot_offset, held.state.size) != (state.slot_offset, state.size):
            raise RestoreError(
                f"checkpoint {checkpoint_id}: table {key.table} partition {key.partition}: a mapping of slots "
                f"{state.slot_offset}..{state.slot_offset + state.size - 1}, the store holds "
                f"{held.state.slot_offset}..{held.state.slot_offset + held.state.size - 1}"
            )
        base = state if checkpoint_id == self.base_id else (held.base if held is not None else None)
        self.shards[key] = MappingShard(state, checkpoint_id, base)

    def check_complete(self, checkpoint_id: int) -> None:
        """No record left part way, and each managed-collision table's shards, together, hold
        a state for every slot of its row-wise layout."""
        for key, pieces in self._pieces.items():
            raise RestoreError(
                f"checkpoint {checkpoint_id}: table {key.table} partition {key.partition}: the mapping record of "
                f"checkpoint {pieces[0].checkpoint_id} has {len(pieces)} of its {pieces[0].chunk_count} frames"
            )
        tables: dict[str, list[McState]] = {}
        for key, shard in self.shards.items():
            tables.setdefault(key.table, []).append(shard.state)
        for table, states in tables.items():
            segments = states[0].segments
            held = sorted((s.slot_offset, s.slot_offset + s.size) for s in states)
            want = [(a, b) for a, b in zip(segments, segments[1:]) if b > a]
            if any(s.segments != segments for s in states) or held != want:
                raise RestoreError(
                    f"checkpoint {checkpoint_id}: table {table}: the chain holds the mapping of slots "
                    f"{', '.join(f'{a}..{b - 1}' for a, b in held)}, its shards are {', '.join(f'{a}..{b - 1}' for a, b in want)}"
                )

    def records(self) -> list[tuple[int, MappingRecord]]:
        """Every shard's state as a full record, with its partition, by table then partition."""
        return [(key.partition, MappingRecord.of_state(self.shards[key].state)) for key in sorted(self.shards)]


class RowStore:
    """Encoded rows of every table, fed frame by frame in chain order (last write wins), and
    the mapping of every managed-collision shard (`MappingStore`)."""

    def __init__(self) -> None:
        self.shards: dict[ShardKey, ShardRows] = {}
        self.mapping = MappingStore()

    def reset(self) -> None:
        """Forget everything: the next frames are a new full baseline."""
        self.shards = {}
        self.mapping.reset()

    # The follower's other hooks (ckpt/follow/follower.py `ApplyTarget`): the store keeps
    # every row as it lands, so a checkpoint needs no start or end, and a failed one is
    # rebuilt from its base by the follower.
    def begin(self, marker: Marker, rebuild: bool) -> None:
        """Nothing to prepare."""

    def finish(self, marker: Marker) -> None:
        """Nothing to publish: the rows are in place."""

    def abandon(self) -> None:
        """Nothing to undo: the follower rebuilds from a base next."""

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values()) + self.mapping.nbytes

    def apply(self, frame: Frame, partition: int, table_rows: int) -> None:
        """Keep `frame`'s rows (from `partition`) as they are encoded; a mapping frame goes to
        the shard's mapping (`MappingStore.apply`)."""
        self.mapping.seen(frame.checkpoint_id)
        if frame.is_mapping:
            self.mapping.apply(frame, partition, table_rows)
            return
        key = ShardKey(frame.table, frame.col_offset, frame.dim)
        shard = self.shards.get(key)
        if shard is None:
            shard = self.shards[key] = ShardRows(
                EncodedRows.empty(table_rows, frame.dim), torch.zeros(table_rows, dtype=torch.int16)
            )
        ids = row_index(frame)
        if frame.row_count and not _inside(ids, shard.partition.shape[0]):
            raise RestoreError(
                f"table {frame.table}: frame of checkpoint {frame.checkpoint_id} has rows outside "
                f"0..{shard.partition.shape[0] - 1}"
            )
        shard.weights.put(ids, frame.encoding, frame.payload)
        for o in frame.optim:
            state = shard.optim.get(o.name)
            if state is None:
                width = frame.dim if get_codec(o.encoding).row_bytes(frame.dim) == o.rows.shape[1] else 1
                state = shard.optim[o.name] = EncodedRows.empty(table_rows, width)
            state.put(ids, o.encoding, o.rows)
        shard.partition.numpy()[ids] = partition

    def check_complete(self, checkpoint_id: int, untrained_ok: bool = False) -> None:
        """Every row of every shard written (and every optimizer state of it): what a base
        needs. `untrained_ok` (a chain with a row initialisation): rows may be absent, but a
        row present has its weights and every optimizer state. Managed-collision tables: every
        shard's mapping whole (`MappingStore.check_complete`)."""
        self.mapping.check_complete(checkpoint_id)
        for key, shard in self.shards.items():
            present = shard.weights.code != 0
            for name, rows in [("weights", shard.weights), *shard.optim.items()]:
                missing = int(((rows.code == 0) & present).sum()) if untrained_ok else int((rows.code == 0).sum())
                if missing:
                    raise RestoreError(
                        f"checkpoint {checkpoint_id}: table {key.table} columns {key.col_offset}.."
                        f"{key.col_offset + key.dim - 1}: {missing} rows have no {name} in the chain"
                    )

    def mapping_records(self) -> list[tuple[int, MappingRecord]]:
        """Every managed-collision shard's mapping as a full record, with the partition that
        writes it: what a compacted baseline writes after the rows."""
        return self.mapping.records()

    def frames(self, run_id: str, checkpoint_id: int, slice_rows: int = SLICE_ROWS) -> Iterator[Frame]:
        """The whole store as frames of checkpoint `checkpoint_id`, unsized (the caller
        chunks them): per shard, per window of `slice_rows` rows, one per (writing partition,
        codecs) group, rows ascending. Each carries the rows' encoded bytes untouched. The
        window bounds what a compaction or a serving snapshot holds beside the store: a
        group's signature, sort and gathered rows, about 100 bytes per row of the window
        rather than of the largest table (docs/design/follower.md, "Compaction")."""
        for key, shard in sorted(self.shards.items()):
            states = sorted(shard.optim.items())
            assert len(states) <= 4, "a signature holds the weights, 4 optimizer states and the partition"
            for start in range(0, shard.partition.shape[0], slice_rows):
                yield from self._window(run_id, checkpoint_id, key, shard, states, slice(start, start + slice_rows))

    @staticmethod
    def _window(
        run_id: str, checkpoint_id: int, key: ShardKey, shard: ShardRows, states: list[tuple[str, EncodedRows]], rows: slice
    ) -> Iterator[Frame]:
        """The frames of rows `rows` of one shard (`frames`)."""
        signature = shard.partition.numpy()[rows].astype(np.int64)
        signature <<= 48
        signature |= shard.weights.code.numpy()[rows]
        for i, (_, state) in enumerate(states):
            signature |= state.code.numpy()[rows].astype(np.int64) << (8 * (i + 1))
        if not signature.size:
            return
        if (signature == signature[0]).all():  # the common case: one partition and codec throughout
            order, cuts = np.arange(signature.size, dtype=np.int64), np.zeros(0, dtype=np.int64)
        else:
            order = np.argsort(signature, kind="stable")  # stable: rows ascend within a group
            grouped = signature[order]
            cuts = np.flatnonzero(grouped[1:] != grouped[:-1]) + 1
        values = signature[order[np.concatenate(([0], cuts))]]
        del signature
        order += rows.start
        weights = shard.weights.data.numpy()
        for value, group in zip(values.tolist(), np.split(order, cuts)):
            ids = torch.from_numpy(group)
            code = value & 0xFF
            if code == 0:  # rows no frame held: never trained (a chain with a row initialisation)
                continue
            nbytes = shard.weights.row_bytes(code)
            optim = []
            for i, (name, state) in enumerate(states):
                ocode = (value >> (8 * (i + 1))) & 0xFF
                optim.append(OptimState(name, ocode, torch.from_numpy(state.data.numpy()[group, : state.row_bytes(ocode)])))
            yield Frame(
                run_id=run_id,
                checkpoint_id=checkpoint_id,
                rank=value >> 48,
                table=key.table,
                col_offset=key.col_offset,
                dim=key.dim,
                encoding=code,
                row_bytes=nbytes,
                chunk_index=0,
                chunk_count=1,
                row_ids=ids,
                payload=torch.from_numpy(weights[group, :nbytes]),
                optim=tuple(optim),
            )
