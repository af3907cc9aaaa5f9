"""Chain links by reference: each link's index written once, in LINK records of its own, and
chains named by checkpoint ids (docs/design/formats.md, "Markers").

A link's frame index has an entry per shard run per partition: O(ranks x tables), megabytes
at a thousand ranks. Carrying every link of the chain in every marker made a marker
O(links x ranks x tables), past the broker's message limit after a few hundred links. So:

- `link_records` splits one link into LINK records of at most `PART_BYTES` each, appended
  right before the marker, in the same write (`append_with_link`); `assemble` checks and joins
  them back;
- `by_writer` gives the marker that names them: its chain's baseline ([id, generation]), the
  later links as runs of checkpoint ids, and its own link's records by their writer and count
  (`by_reference`: by their positions, as format 2 did): a size independent of the chain's
  length;
- `Chain` is the chain the log's fold puts back (ckpt/log/catalog.py): each marker's chain is
  its predecessor's plus one link, shared, so that folding ten thousand one-step links costs
  ten thousand links, not fifty million.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any, overload

from ckpt.log.markers import ChainLink, IndexEntry, LinkRecord, Marker, MarkerError, OffsetRange, encode_marker
from ckpt.stream.sink import MarkerLog

#: The most bytes of index one LINK record carries: half of Kafka's default message limit
#: (1,000,000 bytes at the producer), leaving room for the envelope and the head.
PART_BYTES = 512 * 1024


class Chain(Sequence[ChainLink]):
    """An immutable chain of links that shares its prefix with the chain it extends: length,
    first and last link and total bytes in O(1), a link from the end in O(distance)."""

    __slots__ = ("prefix", "last", "first", "length", "total_bytes")

    def __init__(self, prefix: Chain | None, last: ChainLink) -> None:
        self.prefix = prefix
        self.last = last
        self.first: ChainLink = prefix.first if prefix is not None else last
        self.length: int = (prefix.length if prefix is not None else 0) + 1
        self.total_bytes: int = (prefix.total_bytes if prefix is not None else 0) + last.bytes

    @classmethod
    def of(cls, links: Iterable[ChainLink]) -> Chain:
        chain: Chain | None = None
        for link in links:
            chain = cls(chain, link)
        if chain is None:
            raise ValueError("a chain has at least one link")
        return chain

    def __len__(self) -> int:
        return self.length

    def _from_end(self, back: int) -> Iterator[ChainLink]:
        """The last `back` links, newest first."""
        node: Chain | None = self
        while node is not None and back > 0:
            yield node.last
            node, back = node.prefix, back - 1

    @overload
    def __getitem__(self, i: int) -> ChainLink: ...
    @overload
    def __getitem__(self, i: slice) -> list[ChainLink]: ...
    def __getitem__(self, i: int | slice) -> ChainLink | list[ChainLink]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self.length)
            if step == 1 and stop == self.length:  # a suffix: walk only that far
                return list(self._from_end(max(stop - start, 0)))[::-1]
            return list(self)[i]
        if i < 0:
            i += self.length
        if not 0 <= i < self.length:
            raise IndexError("chain index out of range")
        if i == 0:
            return self.first
        return list(self._from_end(self.length - i))[-1]

    def __iter__(self) -> Iterator[ChainLink]:
        return iter(list(self._from_end(self.length))[::-1])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(other) == self.length and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, tuple[list[ChainLink]]]:
        """Pickled (and deep-copied) flat: a chain of ten thousand links is no ten thousand
        nested objects to the pickler, whose recursion would overflow."""
        return (Chain.of, (list(self),))

    def __repr__(self) -> str:
        return f"Chain({[link.checkpoint_id for link in self]})"


def id_runs(ids: Iterable[int]) -> list[list[int]]:
    """Ascending ids as runs `[first, last]` of consecutive ones, in order."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return runs


def run_ids(runs: Iterable[Sequence[int]]) -> Iterator[int]:
    for first, last in runs:
        yield from range(first, last + 1)


def by_reference(marker: Marker, link_at: list[int]) -> Marker:
    """`marker` naming its chain instead of carrying it; its own link (the chain's last) is in
    the LINK records at `link_at`."""
    chain = marker.chain
    return replace(
        marker,
        base=[chain[0].checkpoint_id, chain[0].generation],
        links=id_runs(link.checkpoint_id for link in chain[1:]),
        link_at=list(link_at),
    )


def by_writer(marker: Marker, writer: str, count: int) -> Marker:
    """`marker` naming its chain instead of carrying it; its own link (the chain's last) is in
    the newest `count` LINK records of `writer` for its checkpoint before it. Appended in one
    write with them, it needs no positions, which only that write's acknowledgement gives."""
    return replace(by_reference(marker, []), link_writer=writer, link_count=count)


def link_records(link: ChainLink, *, run_id: str, writer: str, part_bytes: int = PART_BYTES) -> list[LinkRecord]:
    """`link` as LINK records whose index parts encode to at most about `part_bytes` each."""
    head = {
        "full": link.full,
        "ranges": {str(p): [list(r) for r in rs] for p, rs in link.ranges.items()},
        "rows": link.rows,
        "bytes": link.bytes,
        "epoch": link.epoch,
    }
    chunks = _split(link.index, part_bytes)
    now = time.time()
    out = []
    for part, chunk in enumerate(chunks):
        tables = list(dict.fromkeys(e.table for e in chunk))
        position = {t: i for i, t in enumerate(tables)}
        out.append(
            LinkRecord(
                kind="link",
                run_id=run_id,
                writer=writer,
                checkpoint_id=link.checkpoint_id,
                generation=link.generation,
                part=part,
                parts=len(chunks),
                head=head if part == 0 else {},
                tables=tables,
                index=[
                    [e.partition, e.first, e.last, position[e.table], e.col_offset, e.min_row, e.max_row, e.cols] for e in chunk
                ],
                created_unix=now,
            )
        )
    return out


def _split(index: list[IndexEntry], part_bytes: int) -> list[list[IndexEntry]]:
    """`index` in consecutive chunks of about `part_bytes` encoded each (at least one chunk);
    sized from the encoding of a sample, and halved where a chunk came out larger."""
    if not index:
        return [[]]
    sample = index[: min(len(index), 256)]
    per_entry = len(json.dumps([list(e) for e in sample])) / len(sample) + 1
    todo = [index[i : i + max(1, int(part_bytes / per_entry))] for i in range(0, len(index), max(1, int(part_bytes / per_entry)))]
    out = []
    while todo:
        chunk = todo.pop(0)
        if len(chunk) > 1 and len(json.dumps([list(e) for e in chunk])) > part_bytes:
            half = len(chunk) // 2
            todo[:0] = [chunk[:half], chunk[half:]]
        else:
            out.append(chunk)
    return out


def assemble(parts: list[LinkRecord], checkpoint_id: int, where: str) -> ChainLink:
    """The link `parts` (in part order) hold; MarkerError naming what is wrong."""
    if not parts or parts[0].part != 0 or parts[0].parts != len(parts):
        raise MarkerError(f"{where}: its link's records are incomplete")
    head = parts[0]
    want = (head.parts, checkpoint_id, head.generation, head.writer)
    for i, p in enumerate(parts):
        if p.part != i or (p.parts, p.checkpoint_id, p.generation, p.writer) != want:
            raise MarkerError(f"{where}: link record part {p.part} of checkpoint {p.checkpoint_id} does not belong to it")
    try:
        h: dict[str, Any] = head.head
        return ChainLink(
            checkpoint_id=checkpoint_id,
            full=bool(h["full"]),
            generation=head.generation,
            ranges={int(k): [OffsetRange(int(a), int(b)) for a, b in rs] for k, rs in h["ranges"].items()},
            rows=int(h["rows"]),
            bytes=int(h["bytes"]),
            epoch=int(h.get("epoch", 0)),
            index=[
                IndexEntry(int(e[0]), int(e[1]), int(e[2]), p.tables[e[3]], int(e[4]), int(e[5]), int(e[6]), int(e[7]))
                for p in parts
                for e in p.index
            ],
        )
    except (KeyError, ValueError, TypeError, IndexError, AttributeError) as exc:
        raise MarkerError(f"{where}: its link records have bad fields: {exc}") from None


def append_with_link(markers: MarkerLog, marker: Marker, writer: str, before_marker: Any = None) -> Marker:
    """Append `marker`'s own link (its chain's last) as LINK records and `marker` naming them
    by `writer` and count, in one write (one produce request, one fsync: a checkpoint every
    step pays one round trip, not two); returns the marker as the fold reads it, its records
    by position. `before_marker()` runs first (a fault point). A write cut short leaves LINK
    records no marker names (readers pass over them), or, had the log kept a marker and lost
    a record before it, a marker the fold refuses: never a COMMIT with part of its link."""
    parts = link_records(marker.chain[-1], run_id=marker.run_id, writer=writer)
    written = by_writer(marker, writer, len(parts))
    if before_marker is not None:
        before_marker()
    positions = markers.append_markers([*(encode_marker(r) for r in parts), encode_marker(written)])
    return replace(written, link_at=positions[:-1], link_writer="", link_count=0)
