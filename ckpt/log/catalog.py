"""The run's checkpoints as the markers log says they are: one in-order fold of its records.

Every reader of the log (restore, the trainer's committer, the follower, `deltarec-ckpt`)
sees the same facts because they are derived from the records alone, in log order, never
from a reader's clock:

- COMMIT and FAILED markers of this run;
- which follower holds the compaction lease, and so which COMPACTED markers count: a
  compacted baseline is accepted only when its writer held the lease at that point of the
  log; one from a fenced follower (it lost the lease while it was writing) is ignored;
- the generations `deltarec-ckpt gc` dropped;
- which trainer attempt holds the run, and so which COMMIT and FAILED markers count: the
  newest trainer ATTEMPT record holds it from its position on, and a marker of an older
  attempt after that point (a zombie: an old attempt still alive after a restart, or a
  second job with the same run id) is fenced, never restored (docs/design/failures.md, "Zombie writers"). The same
  rule says which `deltarec-ckpt gc` may delete;
- the survivor snapshots each trainer attempt's ranks left when another rank died
  (`ckpt.recovery.mode: partial`, ckpt/recovery/partial.py chooses which a restore uses).

From these it gives, for any committed checkpoint, the cheapest complete chain: its own
chain, or an accepted compacted baseline of one of its links plus the links after it,
whichever reads fewer bytes, never one through a dropped generation (docs/design/follower.md).

Branches: a trainer attempt's ATTEMPT record says which checkpoint its restore chose
(`resumed_from`). Checkpoint ids never repeat, so after a restore of r while r+1..n exist the
attempt's checkpoints are n+1, n+2, ... with chains through r: r+1..n are an abandoned branch.
The fold keeps the run's live ids (`live`: the ids of the branch r was written on up to r, and
every id above n) and `restorable()`, `ckpt.restore.resume=latest`, followers and servers leave the
abandoned ones out; `deltarec-ckpt list` marks them. A fresh start (`resumed_from` 0)
abandons everything before it; a record that does not say (older versions) changes nothing.
Restoring an abandoned checkpoint by its id makes its branch live again, up to it.

Markers that name their chain instead of carrying it (ckpt/log/links.py) get it back here:
each accepted marker's own link is joined from the LINK records it names, and its chain is
the chain of the marker before it plus that link, shared, so the fold reads each link once.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ckpt.log.links import Chain, assemble, run_ids
from ckpt.log.markers import (
    AttemptRecord,
    CatalogRecord,
    ChainLink,
    DroppedRecord,
    LeaseRecord,
    LinkRecord,
    Marker,
    MarkerError,
    SurvivorRecord,
    chain_bytes,
    decode_record,
)
from ckpt.stream.sink import MarkerLog

logger = logging.getLogger(__name__)


@dataclass
class Lease:
    """The compaction lease as of some point of the log."""

    holder: str
    epoch: int  # 1 for the first accepted claim, +1 for each later one
    renewed_unix: float  # the holder's last claim or renewal (its own clock)
    lease_s: float
    released: bool = False

    def free_at(self, when_unix: float) -> bool:
        """Whether a claim stamped `when_unix` may take the lease over."""
        return self.released or when_unix - self.renewed_unix > self.lease_s


@dataclass(frozen=True)
class Holder:
    """The writer of one role that holds the run as of some point of the log."""

    attempt: str
    epoch: int  # the ATTEMPT record's position + 1: ordered like the log
    created_unix: float  # the holder's own clock, for messages


#: The open end of the live ids' last run: every id a later checkpoint takes.
OPEN = 1 << 62
# Marker fields every checkpoint of a job repeats, shared between the markers a fold keeps (`Catalog._shared`)
_REPEATED = ("run_id", "kind", "policy", "plan", "tables", "encodings", "init", "attempt", "follower")
#: Runs of checkpoint ids, each [first, last] inclusive, ascending and apart.
Runs = tuple[tuple[int, int], ...]
#: Every id live: no attempt said it resumed from an older checkpoint.
ALL_LIVE: Runs = ((1, OPEN),)


def within(runs: Runs, cid: int) -> bool:
    """Whether id `cid` is in `runs`."""
    i = bisect.bisect_right(runs, cid, key=lambda run: run[0]) - 1
    return i >= 0 and runs[i][0] <= cid <= runs[i][1]


def _upto(runs: Runs, last: int) -> Runs:
    return tuple((first, min(end, last)) for first, end in runs if first <= last)


def _joined(runs: Iterable[tuple[int, int]]) -> Runs:
    out: list[tuple[int, int]] = []
    for first, last in sorted(runs):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return tuple(out)


def _gains(before: Runs, after: Runs, first: int, last: int) -> bool:
    """Whether `after` holds an id in `first`..`last` that `before` does not."""
    for lo, hi in after:
        lo, hi = max(lo, first), min(hi, last)
        while lo <= hi:  # walk [lo, hi] over the runs of `before` that cover it
            run = next(((a, b) for a, b in before if a <= lo <= b), None)
            if run is None:
                return True
            lo = run[1] + 1
    return False


@dataclass(frozen=True)
class Branch:
    """A trainer ATTEMPT record that said which checkpoint it resumed from: from it on, the
    run's live checkpoint ids are `live` (module doc, "Branches")."""

    newest: int  # the newest id in the log at the record: the attempt's own ids are above it
    resumed_from: int  # 0: a fresh start
    attempt: str
    live: Runs

    def as_json(self) -> list[Any]:
        """As a catalog record carries it (`CatalogRecord.branches`); `live` is derived."""
        return [self.newest, self.resumed_from, self.attempt]


@dataclass(frozen=True)
class Summary:
    """What a catalog folded from a catalog record (ckpt/log/catalog_record.py) does not know:
    records before `upto` beyond what the record kept."""

    upto: int  # the record's `upto`
    newest_id: int  # the newest checkpoint id as of `upto`
    oldest_kept: int  # commits older than this one were left out
    links: frozenset[int]  # checkpoint ids whose compacted baselines the record kept


@dataclass
class Catalog:
    """Fold of one run's markers log; `feed` more records as the log grows.

    A catalog folded from a catalog record (`summary` set) knows the commits from the
    record's oldest kept one on and answers for them as the whole log's fold would, as long
    as it stays `exact`: a later commit whose chain runs through an older link (whose
    compacted baselines the record left out) makes it inexact, and its reader folds the
    whole log instead."""

    run_id: str
    commits: dict[int, Marker] = field(default_factory=dict)
    failed: dict[int, Marker] = field(default_factory=dict)
    compactions: dict[int, Marker] = field(default_factory=dict)  # checkpoint id -> newest accepted
    fenced: list[Marker] = field(default_factory=list)  # compactions by a follower without the lease
    # commit and failed markers of a trainer attempt that no longer held the run
    fenced_commits: list[Marker] = field(default_factory=list)
    holders: dict[str, Holder] = field(default_factory=dict)  # role -> newest ATTEMPT record
    epochs_of: dict[str, int] = field(default_factory=dict)  # attempt id -> its epoch
    trainer_attempts: list[Holder] = field(default_factory=list)  # every trainer ATTEMPT record, in log order
    survivors: dict[str, dict[int, SurvivorRecord]] = field(default_factory=dict)  # attempt -> rank -> record
    dropped: set[int] = field(default_factory=set)
    lease: Lease | None = None
    epochs: int = 0
    last_pos: int = -1  # position of the last record fed
    damaged: list[int] = field(default_factory=list)  # positions of records that failed to decode
    records: int = 0
    read: int = 0  # records this object decoded (a catalog folded from a catalog record: those after it)
    summary: Summary | None = None  # None: folded from the log's first record
    since_summary: int = 0  # records of this run since its newest catalog record
    exact: bool = True
    # Links by checkpoint id: the own link of every accepted COMMIT (what later chains name),
    # the positions of those written as LINK records, and accepted compacted baselines.
    links: dict[int, ChainLink] = field(default_factory=dict)
    link_at: dict[int, list[int]] = field(default_factory=dict)
    bases: dict[tuple[int, int], Marker] = field(default_factory=dict)  # accepted compactions by (id, generation)
    parts: dict[int, LinkRecord] = field(default_factory=dict)  # LINK records no marker named yet, by position
    last_marker: tuple[int, Marker] | None = None  # the last checkpoint marker fed, chain resolved
    branches: list[Branch] = field(default_factory=list)  # trainer attempts that said what they resumed from
    # False: links folded from now on leave out their frame index, which only a restore reads
    # (rank 0's committer folds the log to append to it; its memory then grows less a checkpoint)
    keep_index: bool = True
    _compaction_ids: list[int] = field(default_factory=list)  # sorted keys of `compactions`

    def become(self, other: Catalog) -> None:
        """Hold `other`'s fold from now on: whoever holds this object (a follower's lease
        keeper) reads the new one."""
        for f in fields(self):
            setattr(self, f.name, getattr(other, f.name))

    @property
    def read_from(self) -> int:
        """Where the next `read_markers` should start: the last record fed, which `feed`
        skips (a position is a Kafka offset or a byte offset, so "one past it" is not known)."""
        return max(self.last_pos, 0)

    def feed(self, records: Iterable[tuple[int, bytes]], where: str = "markers") -> Catalog:
        """Fold `(position, bytes)` records, in log order; records at or before the last
        position fed are skipped. A record that fails to decode (a damaged one) is skipped with
        a warning naming its position and kept in `damaged` (docs/design/failures.md, "Damaged markers log"): what it said is
        lost (a COMMIT: that checkpoint is not restorable; a DROPPED record: a restore through
        those generations fails on their missing data), never what the other records say."""
        for pos, data in records:
            if pos <= self.last_pos:
                continue
            self.last_pos = pos
            self.read += 1
            try:
                rec = decode_record(data)
            except MarkerError as exc:
                logger.warning("%s position %s: %s; record skipped", where, pos, exc)
                self.damaged.append(pos)
                continue
            self.records += 1
            if rec.run_id != self.run_id:
                continue
            if isinstance(rec, CatalogRecord):  # a summary of what was folded before it
                self.since_summary = 0
                continue
            if isinstance(rec, LinkRecord):  # named by a marker that follows it
                self.parts[pos] = rec
                continue
            self.since_summary += 1
            if isinstance(rec, Marker):
                try:
                    rec = self._shared(self._own_link(rec, pos, where))
                except MarkerError as exc:
                    logger.warning("%s position %s: %s; record skipped", where, pos, exc)
                    self.damaged.append(pos)
                    continue
            if isinstance(rec, LeaseRecord):
                self._lease_event(rec)
            elif isinstance(rec, AttemptRecord):
                self.holders[rec.role] = Holder(rec.attempt, pos + 1, rec.created_unix)
                self.epochs_of[rec.attempt] = pos + 1
                if rec.role == "trainer":
                    self.trainer_attempts.append(self.holders[rec.role])
                    if rec.resumed_from >= 0:
                        before = self.live
                        self.add_branch(self.newest_id, rec.resumed_from, rec.attempt)
                        summary = self.summary
                        if summary is not None and (
                            _gains(before, self.live, summary.oldest_kept, summary.newest_id)
                            or 0 < rec.resumed_from < summary.oldest_kept
                        ):
                            # an abandoned checkpoint restored by its id: its branch is live again,
                            # and a catalog record leaves abandoned commits out; or one older than
                            # every commit kept: the live branch's newest is one this fold left out
                            self.exact = False
            elif isinstance(rec, SurvivorRecord):
                self.survivors.setdefault(rec.attempt, {})[rec.rank] = rec
            elif isinstance(rec, DroppedRecord):  # honoured whoever wrote it: its deletions may have begun
                self.dropped.update(rec.generations)
            elif rec.kind in ("commit", "failed") and not self._from_holder(rec):
                self.fenced_commits.append(self._resolved(rec, pos, where, accepted=False))
                self.last_marker = (pos, self.fenced_commits[-1])
            elif rec.kind == "commit":
                self.commits[rec.checkpoint_id] = rec = self._resolved(rec, pos, where, accepted=True)
                self.exact = self.exact and self._knows_links_of(rec)
                self.last_marker = (pos, rec)
            elif rec.kind == "failed":
                self.failed[rec.checkpoint_id] = rec
                self.last_marker = (pos, rec)
            elif self.holds(rec.follower):
                self._accept_compaction(rec)
                self.last_marker = (pos, rec)
            else:
                self.fenced.append(rec)
                self.last_marker = (pos, rec)
        return self

    def _shared(self, marker: Marker) -> Marker:
        """`marker` holding the very objects of the marker folded before it for the fields a
        job repeats in every marker (`_REPEATED`: its plan, tables, codecs) where they are equal:
        a fold of a checkpoint every step then keeps one copy of them, not one per marker."""
        last = self.last_marker[1] if self.last_marker is not None else None
        if last is None:
            return marker
        same = {}
        for name in _REPEATED:
            mine, theirs = getattr(marker, name), getattr(last, name)
            if mine is not theirs and mine == theirs:
                same[name] = theirs
        return replace(marker, **same) if same else marker

    def _own_link(self, marker: Marker, pos: int, where: str) -> Marker:
        """`marker` with its own link joined from the LINK records it names (one link, the
        chain's last, until `_resolved` puts the chain together); as it is when it carries its
        chain. Records of the same writer before them that no marker named (a write cut short
        before its marker) are dropped."""
        if not marker.by_reference:
            return marker
        if marker.link_count:
            marker = self._named_by_writer(marker)
        found = [self.parts.pop(p, None) for p in marker.link_at]
        parts = [p for p in found if p is not None]
        if len(parts) < len(found):
            raise MarkerError(f"checkpoint {marker.checkpoint_id}'s link records at {marker.link_at} are not all in the log")
        writer, first = parts[0].writer, min(marker.link_at)
        for p in [p for p, r in self.parts.items() if r.writer == writer and p < first]:
            del self.parts[p]
        own = assemble(parts, marker.checkpoint_id, f"{where} position {pos}")
        return replace(marker, chain=[own if self.keep_index else replace(own, index=[])])

    def _named_by_writer(self, marker: Marker) -> Marker:
        """`marker` naming its own link's records by position: the newest `link_count` LINK
        records of `link_writer` for its checkpoint that no marker named yet (appended in the
        same write as it: ckpt/log/links.py). Too few: MarkerError, the checkpoint is not
        restorable."""
        cid, count = marker.checkpoint_id, marker.link_count
        mine = sorted(p for p, r in self.parts.items() if r.writer == marker.link_writer and r.checkpoint_id == cid)
        if len(mine) < count:
            raise MarkerError(
                f"checkpoint {cid}'s {count} link record(s) by {marker.link_writer} are not all in the log (found {len(mine)})"
            )
        return replace(marker, link_at=mine[len(mine) - count :], link_writer="", link_count=0)

    def _resolved(self, marker: Marker, pos: int, where: str, *, accepted: bool) -> Marker:
        """A COMMIT marker with its whole chain; an accepted one's own link is remembered for
        the chains that name it later. A chain naming a link this fold does not hold cannot be
        restored: in a fold from a catalog record that makes the fold inexact (its reader folds
        the whole log), else it is said once and the checkpoint is not restorable (its id still
        counts as used)."""
        if accepted and marker.chain:
            own = marker.chain[-1]
            self.links[own.checkpoint_id] = own
            if marker.by_reference:
                self.link_at[own.checkpoint_id] = marker.link_at
        if not marker.by_reference:
            return marker
        chain = self._chain_of(marker)
        if chain is None:
            if self.summary is None:
                logger.warning(
                    "%s position %s: checkpoint %d names chain links the log does not hold; it cannot be restored",
                    where,
                    pos,
                    marker.checkpoint_id,
                )
            self.exact = False if self.summary is not None else self.exact
            return replace(marker, chain=[])
        return replace(marker, chain=chain)

    def _chain_of(self, marker: Marker) -> Chain | None:
        """The chain `marker` names: its baseline, the links of `marker.links` and its own
        (already joined); the chain of the marker before it is reused when it is the prefix."""
        own = marker.chain[-1]
        if not marker.links:
            return Chain(None, own) if marker.base == [own.checkpoint_id, own.generation] else None
        runs = [list(r) for r in marker.links]
        if runs[-1][1] != own.checkpoint_id:
            return None
        if runs[-1][0] == runs[-1][1]:
            runs.pop()
        else:
            runs[-1][1] -= 1
        before = self.commits.get(runs[-1][1] if runs else marker.base[0])
        if before is not None and before.base == marker.base and before.links == runs and isinstance(before.chain, Chain):
            return Chain(before.chain, own)
        first = self._baseline(marker.base)
        rest = [self.links.get(cid) for cid in run_ids(runs)]
        if first is None or any(link is None for link in rest):
            return None
        return Chain(Chain.of([first, *(link for link in rest if link is not None)]), own)

    def _baseline(self, base: list[int]) -> ChainLink | None:
        """The link a chain starts at: a commit's own link, or an accepted compacted baseline."""
        cid, generation = base
        link = self.links.get(cid)
        if link is not None and link.generation == generation:
            return link
        compacted = self.bases.get((cid, generation))
        return compacted.chain[0] if compacted is not None and compacted.chain else None

    def _accept_compaction(self, marker: Marker) -> None:
        if marker.checkpoint_id not in self.compactions:
            bisect.insort(self._compaction_ids, marker.checkpoint_id)
        self.compactions[marker.checkpoint_id] = marker
        if marker.chain:
            link = marker.chain[0]
            self.bases[(link.checkpoint_id, link.generation)] = marker

    def _lease_event(self, r: LeaseRecord) -> None:
        lease = self.lease
        if r.event == "claim":
            if lease is None or lease.holder == r.follower or lease.free_at(r.created_unix):
                self.epochs += 1
                self.lease = Lease(holder=r.follower, epoch=self.epochs, renewed_unix=r.created_unix, lease_s=r.lease_s)
        elif lease is not None and lease.holder == r.follower and not lease.released:
            if r.event == "renew":
                lease.renewed_unix = max(lease.renewed_unix, r.created_unix)
            elif r.event == "release":
                lease.released = True

    def _knows_links_of(self, marker: Marker) -> bool:
        """Whether every compacted baseline `marker`'s chain may start at is known here (a
        chain by reference resolved here holds only links known here: `_resolved`)."""
        summary = self.summary
        return (
            summary is None
            or marker.by_reference
            or all(link.checkpoint_id in summary.links or link.checkpoint_id > summary.newest_id for link in marker.chain)
        )

    def _from_holder(self, marker: Marker) -> bool:
        """Whether a trainer marker counts at its point of the log: its attempt holds the run,
        or there is no ATTEMPT record yet (logs of older deltarec versions). A marker of an
        attempt whose own ATTEMPT record was damaged (skipped) counts too: nothing says a newer
        attempt started after it, and a damaged record must not cost that attempt's work."""
        held = self.holders.get("trainer")
        if held is None or marker.attempt == held.attempt:
            return True
        return bool(marker.attempt) and marker.attempt not in self.epochs_of

    def holder(self, role: str) -> Holder | None:
        """The newest writer of `role` ("trainer", "gc") as of the end of what was fed."""
        return self.holders.get(role)

    def holds(self, follower: str) -> bool:
        """Whether `follower` holds the lease as of the end of what was fed."""
        return bool(follower) and self.lease is not None and self.lease.holder == follower and not self.lease.released

    @property
    def newest_id(self) -> int:
        """The newest checkpoint id in the log, fenced markers and survivor snapshots included
        (their dense files and generations exist): the next id a trainer may use is one past it."""
        survivors = (r.link.checkpoint_id for ranks in self.survivors.values() for r in ranks.values())
        return max(
            [
                *self.commits,
                *self.failed,
                *(m.checkpoint_id for m in self.fenced_commits),
                *survivors,
                self.summary.newest_id if self.summary else 0,
            ]
        )

    def complete(self, chain: Sequence[ChainLink]) -> bool:
        return bool(chain) and chain[0].full and not (self.dropped and any(link.generation in self.dropped for link in chain))

    def chain_options(self, marker: Marker) -> list[Sequence[ChainLink]]:
        """Every complete chain that restores `marker`'s checkpoint: its own, and each
        accepted compacted baseline of one of its links followed by the links after it."""
        chain = marker.chain
        options = [chain] if self.complete(chain) else []
        for i, cid in self._compacted_links_of(marker):
            compacted = self.compactions[cid]
            if compacted.chain:
                option = [compacted.chain[0], *chain[i + 1 :]]
                if self.complete(option):
                    options.append(option)
        return options

    def _compacted_links_of(self, marker: Marker) -> list[tuple[int, int]]:
        """(position in the chain, checkpoint id) of each link of `marker`'s chain that has an
        accepted compacted baseline; for a chain by reference, found from its id runs (only the
        compactions inside its span are looked at), not by walking the chain."""
        chain = marker.chain
        if not self.compactions or not chain:
            return []
        if not isinstance(chain, Chain) or not marker.base:
            return [(i, link.checkpoint_id) for i, link in enumerate(chain) if link.checkpoint_id in self.compactions]
        lo = bisect.bisect_left(self._compaction_ids, marker.base[0])
        hi = bisect.bisect_right(self._compaction_ids, marker.checkpoint_id)
        out = []
        for cid in self._compaction_ids[lo:hi]:
            at = _position(marker, cid)
            if at is not None:
                out.append((at, cid))
        return out

    def cheapest(self, marker: Marker) -> Marker | None:
        """`marker` with the complete chain that reads the fewest bytes (fewest links on a
        tie); None when every chain of it runs through a dropped generation."""
        options = self.chain_options(marker)
        if not options:
            return None
        best = min(options, key=lambda chain: (chain_bytes(chain), len(chain)))
        return marker if best is marker.chain else replace(marker, chain=best)

    def restorable(self, abandoned: bool = False) -> list[Marker]:
        """Committed checkpoints that still have a complete chain, newest first, each with
        its cheapest chain: those of the run's live branch, or with `abandoned` every one."""
        out = [self.cheapest(m) for cid, m in sorted(self.commits.items(), reverse=True) if abandoned or not self.abandoned(cid)]
        return [m for m in out if m is not None]

    # -- branches (module doc) ------------------------------------------------------------
    def add_branch(self, newest: int, resumed_from: int, attempt: str) -> Branch:
        """A trainer attempt that resumed from `resumed_from` (0: started fresh) announced
        itself when `newest` was the newest id: the live ids are now those of the branch
        `resumed_from` was written on, up to it, and every id above `newest`."""
        kept = self.branch_of(resumed_from) if resumed_from > 0 else ()
        branch = Branch(newest, resumed_from, attempt, _joined([*kept, (newest + 1, OPEN)]))
        self.branches.append(branch)
        return branch

    @property
    def live(self) -> Runs:
        """The run's live checkpoint ids as of the end of what was fed."""
        return self.branches[-1].live if self.branches else ALL_LIVE

    def abandoned(self, cid: int) -> bool:
        """Whether checkpoint `cid` is on an abandoned branch: a later attempt resumed from an
        older checkpoint (or started fresh) and the run went on without it."""
        return bool(self.branches) and not within(self.branches[-1].live, cid)

    def branch_of(self, cid: int) -> Runs:
        """The ids of checkpoint `cid`'s own history: those live when it was written, up to it."""
        i = bisect.bisect_left(self.branches, cid, key=lambda b: b.newest)  # the first branch after `cid`
        return _upto(self.branches[i - 1].live if i else ALL_LIVE, cid)

    def abandoned_by(self, cid: int) -> Branch | None:
        """The attempt whose restore left checkpoint `cid` on an abandoned branch; None while it is live."""
        if not self.abandoned(cid):
            return None
        found, before = None, ALL_LIVE
        for branch in self.branches:
            if branch.newest >= cid and within(before, cid) and not within(branch.live, cid):
                found = branch
            before = branch.live
        return found


def _position(marker: Marker, cid: int) -> int | None:
    """Where link `cid` is in the chain `marker` names by reference (0: its baseline)."""
    if marker.base and marker.base[0] == cid:
        return 0
    at = 1
    for first, last in marker.links:
        if first <= cid <= last:
            return at + cid - first
        at += last - first + 1
    return None


def commits(records: Iterable[tuple[int, bytes]], run_id: str) -> list[tuple[int, Marker]]:
    """The COMMIT markers of `run_id` among raw (position, bytes) records, in log order, with
    their chains, fenced ones included (diagnostics and benchmarks; restores use the fold's
    `restorable`). A damaged record is skipped with a warning."""
    catalog = Catalog(run_id)
    out: list[tuple[int, Marker]] = []
    for pos, data in records:
        catalog.last_marker = None
        catalog.feed([(pos, data)])
        if catalog.last_marker is not None and catalog.last_marker[1].kind == "commit":
            out.append(catalog.last_marker)
    return out


def read_catalog(markers: MarkerLog, run_id: str, where: str = "markers") -> Catalog:
    """The whole log folded."""
    return Catalog(run_id).feed(markers.read_markers(), where)


def catch_up(catalog: Catalog, markers: MarkerLog, where: str = "markers") -> Catalog:
    """Fold what was appended since the last read."""
    return catalog.feed(markers.read_markers(catalog.read_from), where)
