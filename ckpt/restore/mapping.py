"""A restore's managed-collision mappings (docs/design/managed-collision.md): the raw-id -> slot
state of each of this rank's managed-collision shards, replayed from the chain's mapping records.

Every checkpoint writes, per shard of a managed-collision table, one mapping record
(ckpt/stream/mapping.py): the shard's whole state, or its change since the state of the
checkpoint named by the record's `follows`. The record travels in mapping frames that a link
indexes with ``cols == 0`` (`IndexEntry.is_mapping`). The restore reads the entries of this
rank's shards beside their rows (`MappingReplay.wants`), hands their frames to a
`MappingReplay` in whatever order they arrive, and after the stream folds each shard's records
in chain order (`MappingReplay.finish`): the base link's record must be full, a later full
record replaces the state, a delta applies to the state the link before it left. Any other
chain is refused naming the table and the link, since rows restored under another mapping
would be read by other ids.

On the world size that wrote the chain each shard's record is exactly one of the chain's. On
another world size (`MappingReplay.resharded`: raw ids are routed to ranks by the world size,
and a shard's slots are its rows) every rank reads every old shard's records of the table
(they are small: `wants_moved`), before the rows, folds each old shard's chain the same way,
joins the old shards (`to_global`) and places the ids this rank's shard receives
(`rebucket`): its new state, and the slot moves that say which old rows its rows come from
(`finish_moved`; the rows' replay then reads those, ckpt/restore/replay.py). Ids a new shard
has no room for are dropped, in one log line: they start over as misses. `check_mapping`
refuses, before any row is written, a chain whose mappings no world size can fold: of a
layout other than torchrec's row-wise one over its writers, or, to move, missing a shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from ckpt.log.markers import ChainLink, IndexEntry, Marker
from ckpt.stream.frames import Frame
from ckpt.stream.mapping import MappingError, join_mapping
from ckpt.types import RestoreError
from sharding.managed_collision import ManagedCollisionError, McShard, McState, SlotMoves, rebucket, row_wise_segments, to_global

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Moved:
    """A managed-collision shard restored onto another world size: its new state and where its
    rows come from (`SlotMoves`: old global slot -> new global slot, the miss row included)."""

    state: McState
    moves: SlotMoves


class MappingReplay:
    """Collects the mapping frames of this rank's managed-collision shards while a chain
    streams in, then folds them into each shard's restored state (`finish`)."""

    def __init__(self, shards: Sequence[McShard], marker: Marker | None = None, world_size: int | None = None) -> None:
        # table key -> the shard's slot range (first, last): its rows
        self.slots = {s.key: (s.rows.row_offset, s.rows.row_offset + s.rows.num_rows - 1) for s in shards}
        if len(self.slots) != len(shards):
            raise RestoreError(f"two managed-collision shards of one table on this rank: {sorted(s.key for s in shards)}")
        # (link index, table) -> partition -> the frames of that shard's record, as they arrived
        self.pieces: dict[tuple[int, str], dict[int, list[Frame]]] = {}
        self.world_size = world_size if world_size is not None else (marker.world_size if marker is not None else 0)
        # the tables whose mappings move to this world size (another than the chain's writers'): each
        # old shard's slot range (first, last) -> the partition (its writer) of the base's record of it
        self.old_ranges: dict[str, dict[tuple[int, int], int]] = {}
        if marker is not None and marker.chain and self.world_size != marker.world_size:
            for table in sorted(self.slots):
                base = [e for e in marker.chain[0].index if e.is_mapping and e.table == table]
                self.old_ranges[table] = {(e.min_row, e.max_row): e.partition for e in sorted(base, key=lambda e: e.min_row)}

    @property
    def resharded(self) -> list[str]:
        """The tables whose mappings (and rows) move from the chain's world size to this one."""
        return sorted(self.old_ranges)

    def wants(self, entry: IndexEntry) -> bool:
        """Whether `entry` indexes the mapping frames of one of this rank's shards: under the
        world size that wrote them, the entry's slot range is exactly the shard's."""
        return (
            entry.is_mapping
            and entry.table not in self.old_ranges
            and self.slots.get(entry.table) == (entry.min_row, entry.max_row)
        )

    def wants_moved(self, entry: IndexEntry) -> bool:
        """Whether `entry` indexes mapping frames of a table that moves to this world size: every
        old shard's, since any of them may hold ids this rank now receives."""
        return entry.is_mapping and entry.table in self.old_ranges

    def add(self, link_index: int, link: ChainLink, partition: int, frame: Frame) -> None:
        """Keep one mapping frame of link `link_index` of the chain, read from `partition`."""
        if not frame.is_mapping or frame.table not in self.slots:
            kind = "a mapping frame" if frame.is_mapping else "a frame of rows"
            raise RestoreError(
                f"checkpoint {link.checkpoint_id}: {kind} of table {frame.table} in partition {partition} "
                "is not a mapping this rank restores"
            )
        self.pieces.setdefault((link_index, frame.table), {}).setdefault(partition, []).append(frame)

    def finish(self, chain: Sequence[ChainLink]) -> dict[str, McState]:
        """Each shard's state after the chain (`chain`: the links the frames came from, base
        first), by table key. Refuses, naming the table and the link: a base without a full
        record of the shard, a delta that does not follow the state the link before it left,
        a link that holds frames of the shard's writer but no record of it, a record that is
        damaged or of other slots."""
        return {
            table: self._fold(table, *self.slots[table], chain, partial(self._found, table, None))
            for table in sorted(self.slots)
            if table not in self.old_ranges
        }

    def finish_moved(self, chain: Sequence[ChainLink]) -> dict[str, Moved]:
        """Each moved table's new state on this rank and its slot moves, by table key: every old
        shard's records folded as `finish` folds them, joined and placed on this world size.
        Refuses in one line a table whose old shards do not fold into one whole mapping (a shard
        missing, a record of other slots, ranks out of step). Logs the ids dropped for want of
        room, one line per table."""
        out: dict[str, Moved] = {}
        for table, ranges in sorted(self.old_ranges.items()):
            states = [self._fold(table, a, b, chain, partial(self._found, table, p)) for (a, b), p in ranges.items()]
            segments = states[0].segments  # the writers' layout, which every old shard's record must be of
            for a, b in zip(segments, segments[1:]):
                if b > a and (a, b - 1) not in ranges:  # refused as the base missing that shard's record
                    self._fold(table, a, b - 1, chain, partial(self._found, table, -1))
            extra = sorted({p for (i, t), parts in self.pieces.items() if t == table for p in parts} - set(ranges.values()))
            if extra:
                raise RestoreError(
                    f"table {table}: partitions {extra} hold mapping records of the table, whose base has {len(ranges)} shards"
                )
            first, last = self.slots[table]
            try:
                glob = to_global(states)
                segments = row_wise_segments(glob.num_embeddings, self.world_size)
                rank = next((r for r in range(self.world_size) if (segments[r], segments[r + 1] - 1) == (first, last)), -1)
                if rank < 0:
                    raise RestoreError(
                        f"table {table}: this rank's shard (slots {first}..{last}) is no row-wise shard of its "
                        f"{glob.num_embeddings} rows over {self.world_size} ranks"
                    )
                state, moves = rebucket(glob, self.world_size, rank)
            except ManagedCollisionError as exc:
                raise RestoreError(f"table {table}: its id mapping cannot move to {self.world_size} ranks: {exc}") from None
            if moves.dropped_raw_ids.size:
                logger.warning(
                    "table %s: %d of the ids its mapping held are dropped on rank %d of %d (its shard has %d slots): "
                    "they start over as misses",
                    table,
                    moves.dropped_raw_ids.size,
                    rank,
                    self.world_size,
                    state.size,
                )
            out[table] = Moved(state, moves)
        return out

    def _found(self, table: str, partition: int | None, link_index: int) -> dict[int, list[Frame]]:
        """The frames of `table`'s mapping records in link `link_index`, by partition (`partition`:
        only that one's, the writer of one old shard)."""
        found = self.pieces.get((link_index, table), {})
        return found if partition is None else {p: f for p, f in found.items() if p == partition}

    def _fold(
        self, table: str, first: int, last: int, chain: Sequence[ChainLink], found_at: Callable[[int], dict[int, list[Frame]]]
    ) -> McState:
        state: McState | None = None
        at = 0  # the checkpoint whose state `state` is
        home = -1  # the partition the shard's records come from (its writer's rank)
        for i, link in enumerate(chain):
            where = f"table {table} slots {first}..{last}: link {i} of the chain (checkpoint {link.checkpoint_id})"
            found = found_at(i)
            if len(found) > 1:
                raise RestoreError(f"{where} holds a mapping record of the shard in partitions {sorted(found)}")
            if not found:
                if i == 0:
                    raise RestoreError(f"{where}, the base, holds no mapping record of the shard")
                if home in link.ranges:
                    raise RestoreError(f"{where} holds frames of rank {home} but no mapping record of the shard")
                continue  # another rank's survivor snapshot: this shard stays as the chain left it
            ((partition, frames),) = found.items()
            try:
                record = join_mapping(sorted(frames, key=lambda f: f.chunk_index))
                if (record.slot_offset, record.slot_offset + record.size - 1) != (first, last):
                    raise RestoreError(
                        f"{where}: its mapping record is of slots {record.slot_offset}..{record.slot_offset + record.size - 1}"
                    )
                if i == 0 and not record.full:
                    raise RestoreError(f"{where}, the base, holds a delta of the mapping (from checkpoint {record.follows})")
                state = record.resolve(state, at)
            except MappingError as exc:
                raise RestoreError(f"{where}: {exc}") from None
            at, home = link.checkpoint_id, partition
        assert state is not None  # the base's record is full
        return state


def check_mapping(marker: Marker, managed: Mapping[str, int], world_size: int) -> None:
    """Refuse, in one line naming the table, a chain whose mappings this job cannot restore,
    before any row is written: a mapping of a table the model does not manage (`managed`:
    table key -> rows of each managed-collision table), a managed table whose base holds no
    mapping (a checkpoint written before the model managed its ids), mappings of slot ranges
    that are no row-wise shards of the table over the ranks that wrote the chain, and, to move
    to another world size, a base that lacks one of those shards' mappings."""
    where = f"checkpoint {marker.checkpoint_id} of run {marker.run_id}"
    for link in marker.chain:
        for e in link.index:
            if e.is_mapping and e.table not in managed:
                raise RestoreError(
                    f"{where} holds the id mapping of table {e.table}, which this model does not manage "
                    "(a managed-collision table there, an ordinary one or none here)"
                )
    if not managed or not marker.chain:
        return
    base = marker.chain[0]
    for table in sorted(managed):
        if not any(e.is_mapping and e.table == table for e in base.index):
            raise RestoreError(
                f"{where} holds no id mapping of table {table}, whose ids this model manages, in its base (checkpoint "
                f"{base.checkpoint_id}): it was written before the model managed them"
            )
    writers = marker.world_size
    for table, rows in sorted(managed.items()):
        layout = _layout(rows, writers)
        for i, link in enumerate(marker.chain):
            ranges = {(e.min_row, e.max_row) for e in link.index if e.is_mapping and e.table == table}
            if ranges <= layout:
                continue
            odd = min(ranges - layout)
            wrote = max(link.ranges, default=-1) + 1  # every rank writes its shards' mappings
            ranks = f"{wrote} ranks" if wrote > 0 and ranges <= _layout(rows, wrote) else "the ranks that wrote it"
            raise RestoreError(
                f"{where}: link {i} (checkpoint {link.checkpoint_id}) holds the id mapping of table {table} slots "
                f"{odd[0]}..{odd[1]}, no shard of its {rows} rows over {writers} ranks: it was written by another "
                f"world size or slot layout; restore it on {ranks}"
            )
        if writers != world_size:
            held = {(e.min_row, e.max_row) for e in base.index if e.is_mapping and e.table == table}
            if held != layout:
                lost = min(layout - held)
                raise RestoreError(
                    f"{where}: its base (checkpoint {base.checkpoint_id}) lacks the id mapping of table {table} slots "
                    f"{lost[0]}..{lost[1]}: the mapping is incomplete and cannot move from {writers} to {world_size} ranks"
                )


def _layout(rows: int, world_size: int) -> set[tuple[int, int]]:
    """The slot ranges (first, last) of a table's non-empty row-wise shards over `world_size` ranks."""
    segments = row_wise_segments(rows, world_size)
    return {(a, b - 1) for a, b in zip(segments, segments[1:]) if b > a}
