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

Only the world size that wrote the chain can restore it for now: raw ids are routed to ranks
by the world size, and a shard's slots are its rows, so each shard's record is exactly one of
the chain's (`check_mapping` refuses the rest before any row is written).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckpt.log.markers import ChainLink, IndexEntry, Marker
from ckpt.stream.frames import Frame
from ckpt.stream.mapping import MappingError, join_mapping
from ckpt.types import RestoreError
from sharding.managed_collision import McShard, McState, row_wise_segments


class MappingReplay:
    """Collects the mapping frames of this rank's managed-collision shards while a chain
    streams in, then folds them into each shard's restored state (`finish`)."""

    def __init__(self, shards: Sequence[McShard]) -> None:
        # table key -> the shard's slot range (first, last): its rows
        self.slots = {s.key: (s.rows.row_offset, s.rows.row_offset + s.rows.num_rows - 1) for s in shards}
        if len(self.slots) != len(shards):
            raise RestoreError(f"two managed-collision shards of one table on this rank: {sorted(s.key for s in shards)}")
        # (link index, table) -> partition -> the frames of that shard's record, as they arrived
        self.pieces: dict[tuple[int, str], dict[int, list[Frame]]] = {}

    def wants(self, entry: IndexEntry) -> bool:
        """Whether `entry` indexes the mapping frames of one of this rank's shards: under the
        world size that wrote them, the entry's slot range is exactly the shard's."""
        return entry.is_mapping and self.slots.get(entry.table) == (entry.min_row, entry.max_row)

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
        return {table: self._fold(table, chain) for table in sorted(self.slots)}

    def _fold(self, table: str, chain: Sequence[ChainLink]) -> McState:
        first, last = self.slots[table]
        state: McState | None = None
        at = 0  # the checkpoint whose state `state` is
        home = -1  # the partition the shard's records come from (its writer's rank)
        for i, link in enumerate(chain):
            where = f"table {table} slots {first}..{last}: link {i} of the chain (checkpoint {link.checkpoint_id})"
            found = self.pieces.get((i, table), {})
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
    mapping (a checkpoint written before the model managed its ids), and mappings written by
    another world size or slot layout (moving them to this one is not built yet)."""
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
    if marker.world_size != world_size:
        raise RestoreError(
            f"{where} was written by {marker.world_size} ranks and the id mappings of its managed-collision tables "
            f"({', '.join(sorted(managed))}) cannot move to {world_size} ranks yet: restore it on {marker.world_size} ranks"
        )
    for table, rows in sorted(managed.items()):
        layout = _layout(rows, world_size)
        for i, link in enumerate(marker.chain):
            ranges = {(e.min_row, e.max_row) for e in link.index if e.is_mapping and e.table == table}
            if ranges <= layout:
                continue
            odd = min(ranges - layout)
            writers = max(link.ranges, default=-1) + 1  # every rank writes its shards' mappings
            ranks = f"{writers} ranks" if writers > 0 and ranges <= _layout(rows, writers) else "the ranks that wrote it"
            raise RestoreError(
                f"{where}: link {i} (checkpoint {link.checkpoint_id}) holds the id mapping of table {table} slots "
                f"{odd[0]}..{odd[1]}, no shard of its {rows} rows over {world_size} ranks: it was written by another "
                f"world size or slot layout; restore it on {ranks}"
            )


def _layout(rows: int, world_size: int) -> set[tuple[int, int]]:
    """The slot ranges (first, last) of a table's non-empty row-wise shards over `world_size` ranks."""
    segments = row_wise_segments(rows, world_size)
    return {(a, b - 1) for a, b in zip(segments, segments[1:]) if b > a}
