"""Catalog records: the markers log's fold, summarised in the log, so that a restore reads
the log's tail instead of all of it (docs/design/formats.md, "Catalog records").

A run that checkpoints every minute for a week has 10,000 COMMIT markers; each names every
shard's frames, and folding them all costs more than restoring the model (`python -m bench.run
--suite markers` measures it). So rank 0's committer appends a catalog record every
`ckpt.sink.catalog_every` records (`Committer`), and a restore (`read_recent_catalog`) reads the
tail of the log, folds from the newest catalog record in it and feeds the records after it. The
result answers for the newest checkpoints exactly as the whole fold would: the record keeps the
newest `KEEP` restorable commits and every newer one, and the compacted baselines their chains
can start at. Anything it cannot answer for (an older checkpoint asked for, every kept one
failing to restore, a later chain through a link it left out) is answered by reading the whole
log, as before."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from ckpt.log.catalog import Catalog, Holder, Lease, Summary, read_catalog
from ckpt.log.links import assemble
from ckpt.log.markers import CatalogRecord, LinkRecord, MarkerError, decode_record, is_catalog_record
from ckpt.stream.sink import MarkerLog, TailRead

logger = logging.getLogger(__name__)

#: Records a restore reads from the log's end first; 8 times as many each time that holds
#: no catalog record (the writer's `ckpt.sink.catalog_every` is 32 by default).
TAIL_READ = 64
#: Restorable checkpoints a catalog record keeps: the fallbacks a restore has before it
#: reads the whole log.
KEEP = 4


def summarize(catalog: Catalog, keep: int = KEEP) -> CatalogRecord:
    """`catalog` (which must be exact) as a catalog record."""
    assert catalog.exact, "an inexact fold is not summarised"
    restorable: list[int] = []
    for cid in sorted(catalog.commits, reverse=True):
        if len(restorable) == keep:
            break
        if not catalog.abandoned(cid) and catalog.cheapest(catalog.commits[cid]) is not None:
            restorable.append(cid)
    # every commit of the live branch from the oldest kept restorable one on; none when nothing
    # is restorable (an abandoned one restored by its id is found in the whole log)
    oldest = restorable[-1] if restorable else catalog.newest_id + 1
    kept = [m for cid, m in sorted(catalog.commits.items()) if cid >= oldest and not catalog.abandoned(cid)]
    survivors = list(catalog.survivors.get(catalog.trainer_attempts[-1].attempt, {}).values() if catalog.trainer_attempts else [])
    links = sorted({link.checkpoint_id for m in kept for link in m.chain} | {r.link.checkpoint_id for r in survivors})
    lease = catalog.lease
    link_parts = {str(cid): catalog.link_at[cid] for cid in links if cid in catalog.link_at}
    # compacted baselines kept chains start at that a newer compaction of the same link replaced
    bases = {}
    for m in kept:
        base = catalog.bases.get((m.chain[0].checkpoint_id, m.chain[0].generation)) if m.chain else None
        if base is not None and base is not catalog.compactions.get(base.checkpoint_id):
            bases[(m.chain[0].checkpoint_id, m.chain[0].generation)] = base
    return CatalogRecord(
        kind="catalog",
        run_id=catalog.run_id,
        upto=catalog.last_pos,
        records=catalog.records,
        newest_id=catalog.newest_id,
        commits=kept,
        compactions=[catalog.compactions[cid] for cid in links if cid in catalog.compactions],
        links=links,
        holders={role: [h.attempt, h.epoch, h.created_unix] for role, h in catalog.holders.items()},
        epochs_of=dict(catalog.epochs_of),
        trainer_attempts=[[h.attempt, h.epoch, h.created_unix] for h in catalog.trainer_attempts],
        survivors=survivors,
        dropped=sorted(catalog.dropped),
        lease={}
        if lease is None
        else {
            "holder": lease.holder,
            "epoch": lease.epoch,
            "renewed_unix": lease.renewed_unix,
            "lease_s": lease.lease_s,
            "released": lease.released,
        },
        lease_epochs=catalog.epochs,
        created_unix=time.time(),
        link_parts=link_parts,
        pending=sorted(catalog.parts),
        bases=list(bases.values()),
        branches=[b.as_json() for b in catalog.branches],
    )


def from_record(record: CatalogRecord, read_from: Callable[[int], list[tuple[int, bytes]]] | None = None) -> Catalog:
    """The fold a catalog record summarises, ready to `feed` the records after `record.upto`.
    The links its markers name by reference are read from the log (`read_from(position)`
    gives the records from a position on); raises MarkerError when one cannot be."""
    oldest = min((m.checkpoint_id for m in record.commits), default=record.newest_id + 1)
    catalog = Catalog(
        run_id=record.run_id,
        holders={role: Holder(str(a), int(e), float(t)) for role, (a, e, t) in record.holders.items()},
        epochs_of={a: int(e) for a, e in record.epochs_of.items()},
        trainer_attempts=[Holder(str(a), int(e), float(t)) for a, e, t in record.trainer_attempts],
        survivors={record.survivors[0].attempt: {r.rank: r for r in record.survivors}} if record.survivors else {},
        dropped=set(record.dropped),
        lease=Lease(**record.lease) if record.lease else None,
        epochs=record.lease_epochs,
        last_pos=record.upto,
        records=record.records,
        summary=Summary(upto=record.upto, newest_id=record.newest_id, oldest_kept=oldest, links=frozenset(record.links)),
    )
    for newest, resumed_from, attempt in record.branches:
        catalog.add_branch(int(newest), int(resumed_from), str(attempt))
    catalog.parts = _link_records(record, read_from)
    where = f"catalog record at {record.upto}"
    for newest, m in [*((False, m) for m in record.bases), *((True, m) for m in record.compactions)]:
        if m.by_reference:
            parts = [catalog.parts.pop(p) for p in m.link_at if p in catalog.parts]
            m = replace(m, chain=[assemble(parts, m.checkpoint_id, where)])
        if newest:
            catalog._accept_compaction(m)
        elif m.chain:
            catalog.bases[(m.chain[0].checkpoint_id, m.chain[0].generation)] = m
    for cid, positions in record.link_parts.items():
        parts = [catalog.parts.pop(p) for p in positions if p in catalog.parts]
        catalog.links[int(cid)] = assemble(parts, int(cid), where)
        catalog.link_at[int(cid)] = positions
    for m in sorted(record.commits, key=lambda m: m.checkpoint_id):
        if not m.by_reference:  # carried inline: its links are what later chains by reference name
            for link in m.chain:
                if (link.checkpoint_id, link.generation) not in catalog.bases:
                    catalog.links.setdefault(link.checkpoint_id, link)
            catalog.commits[m.checkpoint_id] = m
            continue
        own = catalog.links.get(m.checkpoint_id)
        chain = catalog._chain_of(replace(m, chain=[own])) if own is not None else None
        if chain is None:
            raise MarkerError(f"{where}: checkpoint {m.checkpoint_id}'s chain names links the record does not hold")
        catalog.commits[m.checkpoint_id] = replace(m, chain=chain)
    return catalog


def prune(catalog: Catalog, record: CatalogRecord) -> None:
    """Cut `catalog` down to what `record` (its own `summarize`, with nothing fed since; written
    to the log or not) keeps: the fold `from_record` would give, without reading the log again.
    A reader that folds the log for as long as it runs (rank 0's committer, a follower) then
    holds the newest checkpoints, not every checkpoint of the run (docs/design/formats.md,
    "Catalog records"). Records fed afterwards fold as they would after `from_record`,
    exactness included."""
    assert record.upto == catalog.last_pos, "prune with the catalog record of the fold as it is"
    commits = {m.checkpoint_id for m in record.commits}
    links = set(record.links)
    keep = {id(m) for m in [*record.compactions, *record.bases]}
    catalog.commits = {cid: m for cid, m in catalog.commits.items() if cid in commits}
    catalog.failed, catalog.fenced, catalog.fenced_commits = {}, [], []
    catalog.links = {cid: link for cid, link in catalog.links.items() if cid in links}
    catalog.link_at = {cid: at for cid, at in catalog.link_at.items() if cid in links}
    catalog.bases = {key: m for key, m in catalog.bases.items() if id(m) in keep}
    compactions = [catalog.compactions[cid] for cid in sorted(catalog.compactions) if cid in links]
    catalog.compactions, catalog._compaction_ids = {}, []
    for m in compactions:
        catalog._accept_compaction(m)
    catalog.survivors = {record.survivors[0].attempt: {r.rank: r for r in record.survivors}} if record.survivors else {}
    oldest = min(commits, default=record.newest_id + 1)
    catalog.summary = Summary(upto=record.upto, newest_id=record.newest_id, oldest_kept=oldest, links=frozenset(links))


def _link_records(record: CatalogRecord, read_from: Callable[[int], list[tuple[int, bytes]]] | None) -> dict[int, LinkRecord]:
    """The LINK records `record` names (its links', its compactions' and those no marker had
    named yet), by position."""
    want = {p for ps in record.link_parts.values() for p in ps}
    want |= {p for m in [*record.compactions, *record.bases] for p in m.link_at}
    want |= set(record.pending)
    if not want:
        return {}
    if read_from is None:
        raise MarkerError("a catalog record naming link records, read without its log")
    found: dict[int, LinkRecord] = {}
    last = max(want)
    for pos, data in read_from(min(want)):
        if pos in want:
            rec = decode_record(data)
            if not isinstance(rec, LinkRecord):
                raise MarkerError(f"position {pos} holds a {rec.kind} record where a link record was named")
            found[pos] = rec
        if pos >= last:
            break
    missing = want - set(found)
    if missing - set(record.pending):
        raise MarkerError(f"link records at {sorted(missing)[:5]} are not in the log")
    return found


def read_recent_catalog(markers: MarkerLog, run_id: str, where: str = "markers") -> Catalog:
    """The log folded from its newest catalog record on, or from its start when it has none,
    or when what follows the record cannot be folded exactly from it."""
    want = TAIL_READ
    while True:
        tail = markers.read_tail(want)
        first = tail.records[0][0] if tail.records else 0

        def read_from(pos: int, tail: TailRead = tail) -> list[tuple[int, bytes]]:
            return (
                [r for r in tail.records if r[0] >= pos]
                if tail.records and pos >= tail.records[0][0]
                else markers.read_markers(pos)
            )

        for pos, record in _catalog_records(tail.records, run_id, where):
            upto = record.upto
            if upto < first and not tail.whole:
                break  # records it did not fold lie before what was read: read more
            try:
                catalog = from_record(record, read_from)
            except (MarkerError, TypeError, ValueError) as exc:  # the last two: nested fields of the wrong shape
                logger.warning("%s position %s: %s; an older catalog record serves", where, pos, exc)
                continue
            catalog.feed(((p, d) for p, d in tail.records if p > upto), where)
            if catalog.exact:
                return catalog
            logger.info(
                "%s: a checkpoint after position %d chains through a link its catalog record at %d "
                "left out; reading the whole log",
                where,
                upto,
                pos,
            )
            return read_catalog(markers, run_id, where)
        else:
            if tail.whole:
                return Catalog(run_id).feed(tail.records, where)
        want *= 8


def _catalog_records(records: list[tuple[int, bytes]], run_id: str, where: str) -> Iterator[tuple[int, CatalogRecord]]:
    """The catalog records of `run_id` among `records`, newest first, decoding nothing else; a
    damaged one is skipped with a warning (an older one serves)."""
    for pos, data in reversed(records):
        if not is_catalog_record(data):
            continue
        try:
            record = decode_record(data)
        except MarkerError as exc:
            logger.warning("%s position %s: %s; an older catalog record serves", where, pos, exc)
            continue
        assert isinstance(record, CatalogRecord)
        if record.run_id == run_id:
            yield pos, record
