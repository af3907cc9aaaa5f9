"""`deltarec-ckpt`: inspect and manage a run's checkpoints.

    deltarec-ckpt --config CONFIG [key=value ...] list
    deltarec-ckpt --config CONFIG [key=value ...] verify [--checkpoint N]
    deltarec-ckpt --config CONFIG [key=value ...] export --out model.pt [--dcp DIR] [--checkpoint N]
    deltarec-ckpt --config CONFIG [key=value ...] gc --keep N

The job's own config names the backend (Kafka or filesystem), the run id and the dense
store, so the same overrides that ran the job find its checkpoints. Loading that config is
the trainer layer's job: the console script is `trainer.ckpt_cli`, which hands this module
the resolved `ckpt` section.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path

import torch

from ckpt.config import CkptConfig
from ckpt.dense.store import DenseRef, DenseStore
from ckpt.faults import maybe_die, maybe_hold
from ckpt.follow.store import MappingStore
from ckpt.log.backend import open_backend
from ckpt.log.catalog import Catalog, catch_up, read_catalog
from ckpt.log.fencing import Fenced, announce, fenced_by, fenced_message
from ckpt.log.markers import AttemptRecord, DroppedRecord, Marker, encode_marker
from ckpt.restore.export import assemble, export, replicated_tables
from ckpt.restore.replay import iter_chain_frames
from ckpt.stream.frames import Frame
from ckpt.stream.sink import compacted_epoch, generation_label, is_compacted
from ckpt.types import RestoreError
from common.errors import DeltarecError

logger = logging.getLogger(__name__)


class CliError(DeltarecError):
    """A command-line argument that cannot be used."""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deltarec-ckpt", description="Inspect and manage deltarec checkpoints.")
    p.add_argument("--config", required=True, help="the job's YAML config")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="the job's overrides")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="checkpoints with step, kind, bytes, ranks, status")
    v = sub.add_parser("verify", help="re-read and check every frame of a checkpoint")
    v.add_argument("--checkpoint", type=int, help="default: the newest committed")
    e = sub.add_parser("export", help="write the full unsharded model")
    e.add_argument("--out", type=Path, required=True, help="torch.save file")
    e.add_argument("--dcp", type=Path, help="also a torch.distributed.checkpoint directory")
    e.add_argument("--checkpoint", type=int, help="default: the newest committed")
    g = sub.add_parser("gc", help="drop generations older than the newest N restorable checkpoints")
    g.add_argument("--keep", type=int, required=True)
    # Overrides may come after the subcommand too (argparse stops at the subcommand).
    args, extra = p.parse_known_args(argv)
    bad = [x for x in extra if "=" not in x]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    args.overrides = [*args.overrides, *extra]
    return args


def _choose(catalog: Catalog, checkpoint: int | None) -> Marker:
    """The newest restorable checkpoint, or the given one, with its cheapest chain."""
    if checkpoint is not None and checkpoint not in catalog.commits:
        raise RestoreError(f"no committed checkpoint with id {checkpoint}")
    found = catalog.restorable() if checkpoint is None else [catalog.cheapest(catalog.commits[checkpoint])]
    if not found or found[0] is None:
        raise RestoreError(
            "no restorable checkpoint"
            + (f" with id {checkpoint}: a generation of every chain of it was dropped by gc" if checkpoint is not None else "")
        )
    return found[0]


def cmd_list(catalog: Catalog) -> int:
    print(f"{'id':>5} {'step':>8} {'kind':<9} {'bytes':>12} {'restore':>12} {'ranks':>5}  status")
    rows = [
        *catalog.commits.values(),
        *catalog.failed.values(),
        *catalog.compactions.values(),
        *catalog.fenced,
        *catalog.fenced_commits,
    ]
    fenced_commits = {id(m) for m in catalog.fenced_commits}
    for m in sorted(rows, key=lambda m: (m.checkpoint_id, m.kind != "commit")):
        if id(m) in fenced_commits:
            print(
                f"{m.checkpoint_id:>5} {m.step:>8} {'-':<9} {m.bytes:>12,} {'-':>12} {m.world_size:>5}  "
                f"fenced {m.kind}: attempt {m.attempt or '(none)'} wrote it after a newer attempt started"
            )
        elif m.kind == "failed":
            print(f"{m.checkpoint_id:>5} {m.step:>8} {'-':<9} {'-':>12} {'-':>12} {m.world_size:>5}  failed: {m.error}")
        elif m.kind == "compacted":
            link = m.chain[0]
            fenced = catalog.compactions.get(m.checkpoint_id) is not m
            status = (
                "fenced (writer lost the lease)"
                if fenced
                else "dropped (gc)"
                if link.generation in catalog.dropped
                else "compacted baseline"
            )
            print(
                f"{m.checkpoint_id:>5} {m.step:>8} {'compacted':<9} {m.bytes:>12,} {m.bytes:>12,} "
                f"{m.world_size:>5}  {status} in {generation_label(link.generation)}"
            )
        else:
            best = catalog.cheapest(m)
            complete = best is not None and Path(m.dense.get("path", "")).is_file()
            # a chain through a dropped generation; or only the dense file gone (gc, or keep_dense as the job committed)
            gone = "dropped (gc)" if best is None else "dense file deleted (gc or ckpt.write.keep_dense)"
            status = "complete" if complete else gone
            if complete and best is not None and best is not m:
                status += " via compacted " + "+".join(str(link.checkpoint_id) for link in best.chain)
            if catalog.abandoned(m.checkpoint_id):
                status = _abandoned(catalog, m.checkpoint_id) + ("" if complete else f", {gone}")
            restore = f"{best.chain_bytes:>12,}" if best is not None else f"{'-':>12}"
            kind = "full" if m.full else "delta"
            print(f"{m.checkpoint_id:>5} {m.step:>8} {kind:<9} {m.bytes:>12,} {restore} {m.world_size:>5}  {status}")
    trainer = catalog.holder("trainer")
    if trainer is not None:
        branch = catalog.branches[-1] if catalog.branches and catalog.branches[-1].attempt == trainer.attempt else None
        started = ""
        if branch is not None and branch.resumed_from < branch.newest:  # a rewind: say what it left behind
            how = f"resumed from checkpoint {branch.resumed_from}" if branch.resumed_from else "started fresh"
            started = f", {how}; the checkpoints after it are abandoned"
        print(f"trainer attempt: {trainer.attempt} (epoch {trainer.epoch}{started})")
    if catalog.lease is not None:
        lease = catalog.lease
        print(f"follower lease: {lease.holder} (epoch {lease.epoch}{', released' if lease.released else ''})")
    return 0


def _abandoned(catalog: Catalog, cid: int) -> str:
    """The status of a checkpoint on an abandoned branch (ckpt/log/catalog.py, "Branches")."""
    by = catalog.abandoned_by(cid)
    if by is None:
        return "abandoned"
    how = f"resumed from checkpoint {by.resumed_from}" if by.resumed_from else "started fresh"
    return f"abandoned: attempt {by.attempt} {how}"


def _tables(marker: Marker, frames, dense_state) -> dict:
    return assemble(marker, frames, replicated_tables(marker, dense_state))


def _folding_mapping(marker: Marker, frames: Iterable[tuple[bool, Frame]], mapping: MappingStore) -> Iterator[tuple[bool, Frame]]:
    """`frames` as they are, each mapping frame (a managed-collision table's raw id -> slot
    record) also folded into `mapping` in chain order, so a chain whose records do not apply
    one after the other is refused."""
    for full, frame in frames:
        mapping.seen(frame.checkpoint_id)
        if frame.is_mapping and frame.table in marker.tables:
            mapping.apply(frame, frame.rank, int(marker.tables[frame.table][0]))
        yield full, frame


def cmd_verify(marker: Marker, catalog: Catalog, backend, dense: DenseStore, run_id: str) -> int:
    frames = rows = 0
    mapping = MappingStore()
    chain = ((link.full, f) for link, f in iter_chain_frames(marker, backend.source, run_id, backend.locate))
    for _, frame in _folding_mapping(marker, chain, mapping):
        frames += 1
        rows += frame.row_count
    mapping.check_complete(marker.checkpoint_id)
    dense.read(DenseRef.from_json(marker.dense))
    via = (
        ""
        if marker.chain == catalog.commits[marker.checkpoint_id].chain
        else " (chain " + "+".join(str(link.checkpoint_id) for link in marker.chain) + ", from a compacted baseline)"
    )
    mc = f", the mapping of {len(mapping.shards)} managed-collision shards" if mapping.shards else ""
    print(
        f"checkpoint {marker.checkpoint_id} (step {marker.step}): OK{via}, {frames} frames, {rows} rows{mc}, dense sha256 matches"
    )
    base = marker.chain[0]
    compacted = catalog.compactions.get(base.checkpoint_id)
    if compacted is not None and compacted.chain[0] == base:
        _verify_compaction(compacted, catalog, backend, dense, run_id)
    return 0


def _verify_compaction(compacted: Marker, catalog: Catalog, backend, dense: DenseStore, run_id: str) -> None:
    """A compacted baseline must restore exactly what the chain it replaces restores."""
    original = catalog.commits.get(compacted.checkpoint_id)
    cid = compacted.checkpoint_id
    if original is None or not catalog.complete(original.chain):
        print(f"compacted baseline of checkpoint {cid}: its original chain is gone (gc), nothing to compare with")
        return
    state = dense.read(DenseRef.from_json(original.dense))

    def frames(m: Marker):
        return ((link.full, f) for link, f in iter_chain_frames(m, backend.source, run_id, backend.locate))

    got_mapping, want_mapping = MappingStore(), MappingStore()
    got = _tables(compacted, _folding_mapping(compacted, frames(compacted), got_mapping), state)
    want = _tables(original, _folding_mapping(original, frames(original), want_mapping), state)
    if got_mapping.records() != want_mapping.records():
        raise RestoreError(
            f"compacted baseline of checkpoint {cid} differs from its chain "
            f"{[link.checkpoint_id for link in original.chain]}: the mapping of its managed-collision tables"
        )
    for table, tensors in want.items():
        for name, value in tensors.items():
            if not torch.equal(got[table][name], value):
                raise RestoreError(
                    f"compacted baseline of checkpoint {cid} differs from its chain "
                    f"{[link.checkpoint_id for link in original.chain]}: table {table} {name}"
                )
    print(
        f"compacted baseline of checkpoint {cid}: identical to its chain "
        f"{'+'.join(str(link.checkpoint_id) for link in original.chain)} "
        f"({compacted.bytes:,} bytes instead of {original.chain_bytes:,})"
    )


def _unused(generation: int, referenced: bool, catalog: Catalog) -> bool:
    """Whether a generation no kept chain needs may go. A trainer generation newer than the
    newest id belongs to a checkpoint in flight. A compacted one no marker names is a
    follower's unfinished compaction: it may go once that follower's epoch is over."""
    if not is_compacted(generation):
        return generation <= catalog.newest_id
    if referenced:
        return True
    lease = catalog.lease
    return lease is None or compacted_epoch(generation) < lease.epoch or lease.released


class GcGuard:
    """gc's fencing (ckpt/log/fencing.py): its ATTEMPT record went into the log before the log was
    read; before its DROPPED record and before each deletion it reads what the log gained and
    stops when a newer gc announced itself. That one read the log later, so it deletes what this
    one recorded as dropped; of two gcs at once exactly one deletes."""

    def __init__(self, catalog: Catalog, markers, mine: AttemptRecord) -> None:
        self.catalog, self.markers, self.mine = catalog, markers, mine

    def check(self, read: bool = True) -> None:
        """Stop (`Fenced`) when a newer gc announced itself; `read`: first read what the log gained."""
        if read:
            catch_up(self.catalog, self.markers)
        newer = fenced_by(self.catalog, self.mine)
        if newer is not None:
            raise Fenced(fenced_message(self.catalog.run_id, self.mine, newer))


def cmd_gc(catalog: Catalog, keep: int, backend, dense: DenseStore, guard: GcGuard) -> int:
    """Keep the newest `keep` restorable checkpoints of the live branch and what their cheapest
    chains read; drop every other generation (recorded in the markers log first) and dense file
    (checkpoints a rewind abandoned are never kept for themselves: ckpt/log/catalog.py, "Branches").

    Restartable: a gc killed after its DROPPED record leaves generations the log already calls
    dropped (restores never read them) but the sink still holds, whole or half deleted, and
    dense files; the next gc deletes them without recording them again."""
    if keep < 1:
        raise CliError("--keep must be at least 1: gc never drops the newest checkpoint")
    guard.check(read=False)  # the log was read through this gc's ATTEMPT record
    restorable = [m for m in catalog.restorable() if Path(m.dense.get("path", "")).is_file()]
    kept = restorable[:keep]
    needed = {link.generation for m in kept for link in m.chain}
    kept_bases = {m.checkpoint_id for m in kept}  # survivor snapshots on a kept checkpoint may still be restored
    survivors = [r for ranks in catalog.survivors.values() for r in ranks.values()]
    needed |= {r.link.generation for r in survivors if r.base in kept_bases}
    newest = max(catalog.commits.values(), key=lambda m: m.checkpoint_id, default=None)
    if newest is not None and newest.chain:  # (a COMMIT naming links the log lacks has no chain)
        needed.add(newest.chain[-1].generation)  # the trainer may still be writing deltas there
    known = {
        link.generation
        for m in [*catalog.commits.values(), *catalog.compactions.values(), *catalog.fenced, *catalog.fenced_commits]
        for link in m.chain
    } | {r.link.generation for r in survivors}
    present = set(backend.sink.generations())
    dropped = sorted(g for g in (known | present) - needed - catalog.dropped if _unused(g, g in known, catalog))
    unfinished = sorted((present & catalog.dropped) - needed)  # recorded by a gc that was killed
    # the dense files to delete, from the log as read above: the reads before each deletion
    # (`guard.check`) add checkpoints a live trainer committed since, which no kept chain
    # accounts for, so their dense files stay
    kept_ids = {m.checkpoint_id for m in kept}
    ids = {*catalog.commits, *(m.checkpoint_id for m in catalog.fenced_commits if m.kind == "commit")}
    stale = [cid for cid in sorted(ids) if cid not in kept_ids and dense.path_for(cid).exists()]
    # a survivor snapshot on a checkpoint gc drops can never be restored: its dense file goes too
    stale_survivors = [
        r for r in survivors if r.base not in kept_bases and dense.survivor_path(r.link.checkpoint_id, r.rank).exists()
    ]
    maybe_hold("gc_read", 0)  # a test's trainer commits here, after gc chose from its read
    if dropped:
        guard.check()
        record = DroppedRecord(kind="dropped", run_id=catalog.run_id, generations=dropped, created_unix=time.time())
        backend.markers.append_marker(encode_marker(record))  # first: no restore starts reading them
    maybe_die("gc", 0, 0)
    maybe_hold("gc", 0)
    deletions = [
        *(partial(backend.sink.drop_generation, g) for g in sorted([*unfinished, *dropped])),
        *(partial(dense.delete, [cid]) for cid in stale),
        *(partial(dense.delete_survivor, r.link.checkpoint_id, r.rank) for r in stale_survivors),
    ]
    for n, delete in enumerate(deletions, 1):
        guard.check()
        delete()
        maybe_die("gc", n, 0)
    finished = f"; finished deleting {[generation_label(g) for g in unfinished]} (an earlier gc was interrupted)"
    print(
        f"kept checkpoints {sorted(kept_ids)}; dropped generations {[generation_label(g) for g in dropped]}"
        + (finished if unfinished else "")
    )
    return 0


def main(argv: Sequence[str], load_ckpt_config: Callable[[str, list[str]], CkptConfig]) -> int:
    """Run one command; `load_ckpt_config(path, overrides)` gives the job's resolved `ckpt` section."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        cfg = load_ckpt_config(args.config, args.overrides)
        run_id = cfg.run_id
        backend = open_backend(run_id, cfg.sink, world_size=1)
        dense = DenseStore(Path(cfg.sink.dense_dir))
        try:
            mine = announce(backend.markers, run_id, "gc").record if args.command == "gc" else None
            catalog = read_catalog(backend.markers, run_id, f"{backend.where} markers")
            if args.command == "list":
                return cmd_list(catalog)
            if mine is not None:
                return cmd_gc(catalog, args.keep, backend, dense, GcGuard(catalog, backend.markers, mine))
            marker = _choose(catalog, args.checkpoint)
            if args.command == "verify":
                return cmd_verify(marker, catalog, backend, dense, run_id)
            model = export(marker, backend.source, dense, run_id, backend.locate, args.out, args.dcp)
            mc = f", {len(model['mc'])} of them also by raw id" if model.get("mc") else ""
            print(
                f"exported checkpoint {marker.checkpoint_id} (step {marker.step}, {len(model['tables'])} tables{mc}) "
                f"to {args.out}" + (f" and {args.dcp}" if args.dcp else "")
            )
            return 0
        finally:
            backend.close()
    except DeltarecError as exc:
        print(f"deltarec-ckpt: error: {exc}", file=sys.stderr)
        return 1
