"""COMMIT (and FAILED) markers: the records that make a checkpoint exist.

A checkpoint exists only once its COMMIT marker is durable, and rank 0 writes one only
after every rank's rows and the dense file are durable (invariant 1). The marker lists,
for every checkpoint of the chain a restore must replay (full baseline first, then the
deltas), the exact offset range of each partition, so recovery never asks the broker
where a partition ends. FAILED markers are informational: `deltarec-ckpt list` shows
them; restore ignores them.

A marker's size does not grow with its chain: the trainer and the follower write each link's
index once, in LINK records of their own (split into parts under the broker's message limit,
`ckpt/log/links.py`), and the marker names its chain by checkpoint ids (the baseline, then id
ranges) and its own link by its LINK records: their writer and count, appended in the same
write as the marker (format 3), or their positions (format 2); the log's fold puts the chain
back together (docs/design/formats.md, "Markers"). A marker may also carry its chain inline,
as every marker of format 1 does: old logs restore as they always did.

Wire form: b"DRM1" + crc32 (u32, little endian) of the JSON body + the JSON body (utf-8).
JSON keeps the record readable with any Kafka tool; the CRC catches a damaged record.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from common.checksum import crc32
from common.errors import DeltarecError

logger = logging.getLogger(__name__)

MAGIC = b"DRM1"
#: What this version writes; it reads every format in `FORMATS` (1: chains inline only; 2: a
#: marker names its own link's records by position only).
FORMAT_VERSION = 3
FORMATS = (1, 2, 3)
_HEAD = struct.Struct("<4sI")


class MarkerError(DeltarecError, ValueError):
    """A marker record that cannot be trusted (bad magic, CRC, JSON or fields)."""


class OffsetRange(NamedTuple):
    """Positions ``first``..``last`` of one partition, both inclusive (JSON: ``[first, last]``)."""

    first: int
    last: int


class IndexEntry(NamedTuple):
    """One run of consecutive frames of one shard in one partition (JSON: a list in this
    field order). Row ids ascend within a shard's frames, so the rows lie in
    ``min_row``..``max_row``; the frames hold columns ``col_offset``..``col_offset + cols - 1``.

    ``cols == 0``: the frames are the mapping frames of one shard of a managed-collision table
    (``ckpt.stream.frames.FLAG_MAPPING``), ``min_row``..``max_row`` its slots, ``col_offset``
    0. They overlap no columns, so a reader choosing entries by the columns they meet skips
    them, as readers written before mapping frames existed do."""

    partition: int
    first: int  # position of the run's first frame
    last: int  # position of its last frame
    table: str
    col_offset: int
    min_row: int
    max_row: int
    cols: int

    @property
    def is_mapping(self) -> bool:
        """Whether the entry indexes a shard's mapping frames (no rows, no columns)."""
        return self.cols == 0


@dataclass(kw_only=True)
class ChainLink:
    """One checkpoint's rows: where they are and how much there is."""

    checkpoint_id: int
    full: bool
    generation: int
    # partition (= writing rank) -> offset ranges. Usually one range; several when frames
    # of an earlier failed flush landed in between (they belong to no checkpoint and are
    # never read). A partition without frames is absent.
    ranges: dict[int, list[OffsetRange]]
    rows: int
    bytes: int
    # Where each shard's frames are, so a restoring rank reads only what overlaps its shards.
    index: list[IndexEntry] = field(default_factory=list)
    # The trainer attempt that wrote the link (its frames carry the same number; 0: written
    # before attempts were recorded, or by a follower's compaction).
    epoch: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChainLink:
        return cls(
            checkpoint_id=int(d["checkpoint_id"]),
            full=bool(d["full"]),
            generation=int(d["generation"]),
            ranges={int(p): [OffsetRange(int(a), int(b)) for a, b in rs] for p, rs in d["ranges"].items()},
            rows=int(d["rows"]),
            bytes=int(d["bytes"]),
            index=[_index_entry(e) for e in d.get("index", [])],
            epoch=int(d.get("epoch", 0)),
        )


def _index_entry(e: list[Any]) -> IndexEntry:
    partition, first, last, table, col_offset, min_row, max_row, cols = e
    # positional: faster than keywords, and the log's fold decodes thousands of these
    return IndexEntry(int(partition), int(first), int(last), str(table), int(col_offset), int(min_row), int(max_row), int(cols))


@dataclass(kw_only=True)
class Marker:
    """A COMMIT or FAILED record for one checkpoint."""

    kind: str  # "commit", "failed" or "compacted"
    run_id: str
    checkpoint_id: int
    step: int
    world_size: int
    # The links a restore replays, baseline first. On the wire either inline (format 1, and
    # records written without LINK records) or named by `base` and `links`, which the log's
    # fold resolves (ckpt/log/catalog.py); a marker decoded alone then has an empty chain.
    chain: Sequence[ChainLink] = field(default_factory=list)
    base: list[int] = field(default_factory=list)  # [checkpoint id, generation] of chain[0]
    links: list[list[int]] = field(default_factory=list)  # chain[1:] as checkpoint id runs [first, last]
    link_at: list[int] = field(default_factory=list)  # positions of chain[-1]'s LINK records, in part order
    # or, as written since format 3, those records named by who wrote them: the newest
    # `link_count` LINK records of `link_writer` for this checkpoint before the marker, appended
    # in the same write as it (`append_with_link`); the fold turns them into `link_at`
    link_writer: str = ""
    link_count: int = 0
    policy: str = ""
    plan: dict[str, str] = field(default_factory=dict)  # table -> sharding type of the writing job
    tables: dict[str, list[int]] = field(default_factory=dict)  # table -> [rows, dim]
    encodings: dict[str, str] = field(default_factory=dict)  # "weights"/"optimizer" -> codec name
    dense: dict[str, Any] = field(default_factory=dict)  # path, sha256, bytes
    stall_ms: list[float] = field(default_factory=list)  # per rank
    error: str = ""  # why a checkpoint failed
    created_unix: float = 0.0
    format: int = FORMAT_VERSION
    # commit records: when rank 0 snapshot the checkpoint's step (wall clock), the start of a
    # served model's freshness (docs/design/serving.md, "Freshness"); 0.0 in logs of older deltarec versions
    step_unix: float = 0.0
    follower: str = ""  # "compacted" records: the follower that wrote it (checked against the lease)
    attempt: str = ""  # commit and failed records: the trainer attempt that wrote it (ckpt/log/catalog.py)
    # How rows were initialised (sharding/row_init.py `RowInit.to_json`): the chain then holds
    # only rows trained since, and restore regenerates the others. Empty: every row is stored.
    init: dict[str, Any] = field(default_factory=dict)

    @property
    def full(self) -> bool:
        return bool(self.chain) and self.chain[-1].full

    @property
    def bytes(self) -> int:
        """Bytes this checkpoint itself wrote (rows of its own link)."""
        return self.chain[-1].bytes if self.chain else 0

    @property
    def chain_bytes(self) -> int:
        """Bytes a restore reads (the whole chain)."""
        return chain_bytes(self.chain)

    @property
    def by_reference(self) -> bool:
        """Whether the wire form names the chain instead of carrying it."""
        return bool(self.link_at) or self.link_count > 0


def chain_bytes(chain: Sequence[ChainLink]) -> int:
    """Bytes of every link of `chain` (a resolved chain keeps the sum: ckpt/log/links.py)."""
    total = getattr(chain, "total_bytes", None)
    return int(total) if total is not None else sum(link.bytes for link in chain)


@dataclass(kw_only=True)
class LinkRecord:
    """One part of one chain link, written before the marker that names it: the link's offset
    ranges and totals (part 0) and a run of its frame index (every part). A link of any size
    fits the broker's message limit as several parts (ckpt/log/links.py splits and reassembles)."""

    kind: str  # "link"
    run_id: str
    writer: str  # the trainer attempt or follower that wrote it
    checkpoint_id: int
    generation: int
    part: int  # 0 .. parts - 1
    parts: int
    # part 0: the link's own fields but its index (full, ranges, rows, bytes, epoch); else empty
    head: dict[str, Any] = field(default_factory=dict)
    tables: list[str] = field(default_factory=list)  # the table names `index` refers to, by position
    # IndexEntry fields in order, the table as its position in `tables`
    index: list[list[int]] = field(default_factory=list)
    created_unix: float = 0.0
    format: int = FORMAT_VERSION


@dataclass(kw_only=True)
class LeaseRecord:
    """A follower's claim, renewal or release of the right to compact (ckpt/follow/lease.py).
    Which claim holds is decided by folding the log in order (ckpt/log/catalog.py)."""

    kind: str  # "lease"
    run_id: str
    follower: str  # the follower's id (host, pid, random suffix)
    event: str  # "claim", "renew" or "release"
    lease_s: float  # a holder that has not renewed for this long may be replaced
    created_unix: float
    format: int = FORMAT_VERSION


@dataclass(kw_only=True)
class DroppedRecord:
    """`deltarec-ckpt gc` dropped these generations: no chain through them is restorable.
    Appended before the data is deleted, so a restore never starts reading a generation
    that is going away."""

    kind: str  # "dropped"
    run_id: str
    generations: list[int]
    created_unix: float
    format: int = FORMAT_VERSION


@dataclass(kw_only=True)
class AttemptRecord:
    """A writer announcing itself before it writes anything: every trainer attempt (rank 0,
    at start) and every `deltarec-ckpt gc`. Of each role, the newest record in the log holds
    the run; an older writer is fenced from that point on (its later COMMITs are ignored,
    and it stops when it sees the newer record). A writer's epoch is the record's position
    + 1 (ckpt/log/fencing.py).

    A trainer attempt says which checkpoint its restore chose (`resumed_from`): checkpoints
    of older attempts with higher ids are then an abandoned branch, never chosen by
    `ckpt.restore.resume=latest` nor served (ckpt/log/catalog.py, "Branches")."""

    kind: str  # "attempt"
    run_id: str
    role: str  # "trainer" or "gc"
    attempt: str  # host, pid and a random suffix
    world_size: int
    created_unix: float
    format: int = FORMAT_VERSION
    # trainer records: the checkpoint the restore chose, 0 for a fresh start (`ckpt.restore.resume=none`,
    # or nothing to resume); -1 (left out on the wire): not said (gc records, older versions)
    resumed_from: int = -1


@dataclass(kw_only=True)
class SurvivorRecord:
    """One surviving rank's snapshot after another rank died (`ckpt.recovery.mode: partial`,
    ckpt/recovery/survivor.py): the rows of its shards changed since checkpoint `base`, as one chain
    link of frames, and its dense and loop state in a dense file. Appended last, once the
    frames and the file are durable, so a snapshot whose writer died or ran out of time has
    no record and is never used (docs/design/partial-recovery.md)."""

    kind: str  # "survivor"
    run_id: str
    attempt: str  # the trainer attempt the rank belonged to
    rank: int
    world_size: int
    base: int  # the newest checkpoint this rank knew committed: the rows are a delta of it
    step: int  # the last step the rank completed: its rows, dense and loop state are of it
    link: ChainLink  # its frames (checkpoint id and generation: ckpt/recovery/survivor.py)
    dense: dict[str, Any]  # path, sha256, bytes of its dense file (dense and loop state)
    # its shards [table, row_offset, num_rows, col_offset, num_cols]: what it keeps, and so,
    # by elimination, what rolls back to `base`
    shards: list[list[Any]] = field(default_factory=list)
    created_unix: float = 0.0
    format: int = FORMAT_VERSION


@dataclass(kw_only=True)
class CatalogRecord:
    """The fold of the log (ckpt/log/catalog.py) as of position `upto`, summarised, so that a
    restore reads the log's tail instead of the whole log (docs/design/formats.md, "Catalog
    records"). Rank 0's committer appends one every few records. What it keeps is what a
    restore of one of the newest checkpoints needs: the newest `keep` restorable COMMIT
    markers of the live branch (and every commit of it newer than the oldest of them) with the
    compacted baselines their chains can start at, and everything the fold carries forward that
    stays small (attempts and the branches they resumed, lease, drops, the newest attempt's
    survivors, the newest id). Older and abandoned checkpoints are found by reading the whole log."""

    kind: str  # "catalog"
    run_id: str
    upto: int  # the position of the last record folded into it; a reader folds what follows
    records: int  # records folded, for diagnostics
    newest_id: int  # `Catalog.newest_id` as of `upto`
    commits: list[Marker]  # checkpoint id ascending
    compactions: list[Marker]  # accepted compacted baselines of the kept commits' links
    links: list[int]  # checkpoint ids of every link of the kept commits' chains
    holders: dict[str, list[Any]]  # role -> [attempt, epoch, created_unix]
    epochs_of: dict[str, int]  # every writer attempt -> its epoch
    trainer_attempts: list[list[Any]]  # [attempt, epoch, created_unix], log order
    survivors: list[SurvivorRecord]  # of the newest trainer attempt
    dropped: list[int]
    lease: dict[str, Any]  # `Lease` fields; empty: nobody ever claimed
    lease_epochs: int
    created_unix: float
    format: int = FORMAT_VERSION
    # checkpoint id -> positions of the LINK records of every link `links` names that was
    # written by reference (a reader reads them: ckpt/log/catalog_record.py)
    link_parts: dict[str, list[int]] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)  # positions of LINK records no marker had named yet
    # compacted baselines the kept chains start at that a newer compaction of the same
    # checkpoint replaced (not in `compactions`, which holds the newest of each)
    bases: list[Marker] = field(default_factory=list)
    # [newest id, resumed_from, attempt] of every trainer ATTEMPT record that said what it
    # resumed from, log order: the branches of the run (ckpt/log/catalog.py, "Branches")
    branches: list[list[Any]] = field(default_factory=list)


#: Every record of the markers log: checkpoint markers (kinds commit, failed, compacted),
#: follower leases, gc's drops, writers' attempts, survivor snapshots, catalog records and
#: the LINK records markers name.
LogRecord = Marker | LeaseRecord | DroppedRecord | AttemptRecord | SurvivorRecord | CatalogRecord | LinkRecord
_KINDS: dict[str, type] = {
    "commit": Marker,
    "failed": Marker,
    "compacted": Marker,
    "lease": LeaseRecord,
    "dropped": DroppedRecord,
    "attempt": AttemptRecord,
    "survivor": SurvivorRecord,
    "catalog": CatalogRecord,
    "link": LinkRecord,
}
ROLES = ("trainer", "gc")
# A catalog record's envelope has a magic of its own, so that a reader looking for the newest
# one tells it from the records around it without decoding them.
CATALOG_MAGIC = b"DRC1"


def _fields(record: LogRecord) -> dict[str, Any]:
    """A record's JSON object; empty optional fields of markers are left out (the wire form
    markers always had). A marker by reference leaves its chain out (the fold resolves it)."""
    if isinstance(record, Marker):
        assert record.format in FORMATS, record.format
        if record.by_reference:
            assert record.format > 1 and record.base, "a marker by reference names its baseline"
            record = dataclasses.replace(record, chain=[])  # before asdict, which would copy it
        else:
            record = dataclasses.replace(record, chain=list(record.chain))
    if isinstance(record, LinkRecord):  # JSON values already, and large: no deep copy
        return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    nested = ("commits", "compactions", "survivors", "bases")
    if isinstance(record, CatalogRecord):  # its markers' fields each by `_fields`, below
        fields = asdict(dataclasses.replace(record, commits=[], compactions=[], survivors=[], bases=[]))
        for name in nested:
            fields[name] = [_fields(r) for r in getattr(record, name)]
        for name in ("link_parts", "pending", "bases", "branches"):
            if not fields[name]:
                del fields[name]
        return fields
    fields = asdict(record)
    if isinstance(record, SurvivorRecord) and not fields["link"]["epoch"]:
        del fields["link"]["epoch"]
    if isinstance(record, AttemptRecord) and record.resumed_from < 0:
        del fields["resumed_from"]  # the wire form attempt records always had
    if isinstance(record, Marker):
        for name in ("follower", "attempt", "init", "step_unix", "base", "links", "link_at", "link_writer", "link_count"):
            if not fields[name]:
                del fields[name]
        if record.by_reference:
            del fields["chain"]
        for link in fields.get("chain", []):
            if not link["epoch"]:
                del link["epoch"]
    return fields


def encode_marker(marker: LogRecord) -> bytes:
    """Serialise any log record with the CRC envelope."""
    assert _KINDS.get(marker.kind) is type(marker), marker.kind
    body = json.dumps(_fields(marker), sort_keys=True, separators=(",", ":")).encode()
    return _HEAD.pack(CATALOG_MAGIC if marker.kind == "catalog" else MAGIC, crc32(body)) + body


def is_catalog_record(data: bytes) -> bool:
    """Whether `data` is enveloped as a catalog record (not yet verified: `decode_record` does)."""
    return data[:4] == CATALOG_MAGIC


def decode_marker(data: bytes) -> Marker:
    """Parse and verify one checkpoint marker (commit, failed, compacted)."""
    record = decode_record(data)
    if not isinstance(record, Marker):
        raise MarkerError(f"a {record.kind} record where a checkpoint marker was expected")
    return record


def decode_record(data: bytes) -> LogRecord:
    """Parse and verify one record of the markers log; raise MarkerError naming what is wrong."""
    if len(data) < _HEAD.size:
        raise MarkerError(f"marker record too short ({len(data)} bytes)")
    magic, crc = _HEAD.unpack_from(data)
    if magic not in (MAGIC, CATALOG_MAGIC):
        raise MarkerError(f"not a marker record (magic {magic!r})")
    body = bytes(data[_HEAD.size :])
    if crc32(body) != crc:
        raise MarkerError("marker record CRC mismatch")
    try:
        d = json.loads(body)
        if not isinstance(d, dict):
            raise MarkerError(f"marker record body is a JSON {type(d).__name__}, not an object")
        record = _record(d)
    except MarkerError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
        # OverflowError: a JSON `Infinity` where an integer belongs; AttributeError: a list
        # or number where the chain's `ranges` mapping belongs
        raise MarkerError(f"marker record has bad fields: {exc}") from exc
    if (magic == CATALOG_MAGIC) != isinstance(record, CatalogRecord):
        raise MarkerError(f"a {record.kind} record in a {magic!r} envelope")
    return record


def _record(d: dict[str, Any], nested_in: type | None = None) -> LogRecord:
    """The record a verified JSON object describes (a catalog record's nested ones: only the
    kinds it holds)."""
    if d.get("format") not in FORMATS:
        raise MarkerError(f"marker format {d.get('format')} is not one of {', '.join(map(str, FORMATS))}; upgrade deltarec")
    cls = _KINDS.get(str(d.get("kind")))
    if cls is None:
        raise MarkerError(f"unknown record kind {d.get('kind')!r}; upgrade deltarec")
    if nested_in is not None and cls is not nested_in:
        raise MarkerError(f"a {d.get('kind')} record where a catalog record holds {nested_in.__name__}s")
    _check_field_types(cls, d)
    if cls is AttemptRecord and d.get("role") not in ROLES:
        raise MarkerError(f"attempt record of unknown role {d.get('role')!r}")
    if cls is Marker:
        if "chain" not in d and not d.get("link_at") and not d.get("link_count"):
            raise MarkerError("marker record has neither a chain nor the records of its link")
        d["chain"] = [ChainLink.from_json(link) for link in d.get("chain", [])]
    if cls is SurvivorRecord:
        d["link"] = ChainLink.from_json(d["link"])
    if cls is CatalogRecord:
        nested = (("commits", Marker), ("compactions", Marker), ("survivors", SurvivorRecord), ("bases", Marker))
        for name, kind in nested:
            d[name] = [_record(r, kind) for r in d.get(name, [])]
    return cls(**d)


# The JSON type each annotation of a log record's own fields must arrive as (the nested chain
# links are converted, and checked, by `ChainLink.from_json`).
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "list": (list,),
    "dict": (dict,),
}


def _check_field_types(cls: type, d: dict[str, Any]) -> None:
    """Refuse a record whose top-level fields have the wrong JSON type (a string where the
    checkpoint id belongs, a list where the plan belongs), which `cls(**d)` would take as it
    is and a later comparison or lookup would trip over far from the record."""
    for f in dataclasses.fields(cls):
        kind = str(f.type).split("[", 1)[0]
        if f.name not in d or kind not in _JSON_TYPES:  # missing: cls() says so; an unlisted type: unchecked
            continue
        want, value = _JSON_TYPES[kind], d[f.name]
        if not isinstance(value, want) or (isinstance(value, bool) and bool not in want):
            raise MarkerError(f"marker record field {f.name!r} must be a JSON {kind}, got {type(value).__name__}")


def select(markers: list[tuple[Any, Marker]], checkpoint_id: int | None = None) -> Marker | None:
    """The newest COMMIT marker, or the one of `checkpoint_id`; None when there is none."""
    if checkpoint_id is None:
        return max((m for _, m in markers), key=lambda m: m.checkpoint_id, default=None)
    for _, m in markers:
        if m.checkpoint_id == checkpoint_id:
            return m
    return None


class FrameMeta(NamedTuple):
    """What the index needs of one written frame until the sink says where it landed (a
    mapping frame: col_offset 0, its shard's slots as rows, cols 0)."""

    table: str
    col_offset: int
    first_row: int
    last_row: int
    cols: int


def index_frames(partition: int, positions: list[int], meta: list[FrameMeta]) -> list[IndexEntry]:
    """The index of one partition's frames: consecutive frames of one shard (``meta`` and
    their ``positions``, both in write order) merged into one entry. Frames of one shard are
    those of one table, column offset and width: a shard's mapping frames (width 0) next to
    its row frames at column 0 get an entry of their own."""
    out: list[IndexEntry] = []
    for pos, m in zip(positions, meta, strict=True):
        last = out[-1] if out else None
        if last is not None and (last.table, last.col_offset, last.cols) == (m.table, m.col_offset, m.cols):
            out[-1] = last._replace(last=pos, min_row=min(last.min_row, m.first_row), max_row=max(last.max_row, m.last_row))
        else:
            out.append(
                IndexEntry(
                    partition=partition,
                    first=pos,
                    last=pos,
                    table=m.table,
                    col_offset=m.col_offset,
                    min_row=m.first_row,
                    max_row=m.last_row,
                    cols=m.cols,
                )
            )
    return out
