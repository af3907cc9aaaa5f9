"""Rank 0's half of a checkpoint: the dense file, then the COMMIT marker.

Called by rank 0's writer thread with every rank's report. A checkpoint commits only if
every rank's rows are durable, every earlier link of its chain committed, and the dense
file is durable; otherwise a FAILED marker (informational) records why. Nothing here
touches an older checkpoint, so a failure never harms one. Once every rank knows of the
COMMIT (`settle`), the dense store's local history records it (`DenseStore.record_commit`):
what tells a lost stream from a run that never committed.

When a job arrives (`prepare`), the markers log's reader starts connecting on a thread of its
own, so the read before the dense file finds it connected instead of paying a new Kafka
client's rate-limited connects before the COMMIT (docs/design/kafka.md, "Connecting ahead of a commit").

Fencing: before the dense file, rank 0 reads what the markers log gained since its last look;
when a newer trainer attempt announced itself there, this attempt writes nothing more (no
dense file, no marker) and every rank learns it from the outcome and stops (ckpt/log/fencing.py).
The same read, summarised every few records in a catalog record after the COMMIT, lets a
restore read only the log's tail (ckpt/log/catalog_record.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from ckpt.dense.store import CommitRecord, DenseRef, DenseStore, DenseStoreError
from ckpt.faults import maybe_die
from ckpt.log.catalog import Catalog, catch_up
from ckpt.log.catalog_record import prune, summarize
from ckpt.log.fencing import fenced_by, fenced_message
from ckpt.log.links import append_with_link
from ckpt.log.markers import AttemptRecord, ChainLink, IndexEntry, Marker, OffsetRange, encode_marker
from ckpt.stream.sink import MarkerLog
from ckpt.write.writer import Outcome, RankReport, WriteJob
from common.errors import DeltarecError
from common.id_ranges import id_ranges
from sharding.row_init import RowInit

logger = logging.getLogger(__name__)


class Committer:
    """Writes dense files and markers; remembers the committed links chains refer to."""

    def __init__(
        self,
        *,
        run_id: str,
        markers: MarkerLog,
        dense: DenseStore,
        marker_fields: dict[str, Any],
        committed: list[ChainLink] | None = None,
        rebase: bool = False,
        where: str = "",
        catalog_every: int = 32,
        connect_timeout_s: float = 10.0,
        keep_dense: int = 0,
    ) -> None:
        self.run_id = run_id
        self.where = where  # the stream, as the local history names it
        self.markers = markers
        self.dense = dense
        self.marker_fields = marker_fields  # policy, plan, tables, world_size
        self.links: dict[int, ChainLink] = {link.checkpoint_id: link for link in committed or []}
        self._oldest_link = 0  # links older than this one were forgotten (`_forget_links_before`)
        # Incremental chains grow by one link per checkpoint; with a follower compacting
        # them, each new marker starts from the newest compacted baseline it can use.
        self.rebase = rebase
        self.catalog_every = catalog_every  # records between catalog records (`_summarize`)
        self.catalog = Catalog(run_id, keep_index=False)  # fencing, rebasing and catalog records read no index
        self.attempt: AttemptRecord | None = None  # set by `start_attempt`; None: no fencing
        self.epoch = 0
        self._read_ok = False  # whether the last commit's read of the markers log succeeded
        self._journal: CommitRecord | None = None  # the last COMMIT, for `settle` to record
        self.connect_timeout_s = connect_timeout_s
        # `ckpt.write.keep_dense`: the dense files this attempt keeps, oldest first (0: all)
        self.keep_dense = keep_dense
        self._dense_kept: deque[int] = deque()

    def adopt(self, links: Sequence[ChainLink], row_init: RowInit | None, restored: int) -> None:
        """Take over a restored chain: the committed links the next checkpoints refer to, and,
        when the restore made the chain's row initialisation the job's, the one the next markers
        name. `restored`: the checkpoint restored, whose dense file `keep_dense` counts."""
        self.links = {link.checkpoint_id: link for link in links}
        self._oldest_link = 0
        self._dense_kept = deque([restored])
        if row_init is not None:
            self.marker_fields["init"] = row_init.to_json()

    def prepare(self) -> None:
        """A job arrived: connect the markers log's reader for `_fenced`, if it will read."""
        if self.attempt is not None or self.rebase:
            self.markers.prepare(self.connect_timeout_s)

    def start_attempt(self, attempt: AttemptRecord, epoch: int, catalog: Catalog) -> None:
        """This trainer attempt's record and epoch, and the log as the checkpointer read it at start
        (just before the record; the first commit reads the rest)."""
        self.attempt, self.epoch, self.catalog = attempt, epoch, catalog
        catalog.keep_index = False  # from here on it serves fencing, rebasing and catalog records, never a restore
        if self.keep_dense and self._dense_kept:  # the restored checkpoint's, and older committed ones: counted too
            restored = self._dense_kept[-1]
            self._dense_kept = deque([*sorted(c for c in catalog.commits if c < restored), restored])

    def __call__(self, job: WriteJob, reports: list[RankReport]) -> Outcome:
        """Commit `job` if every rank's rows, every earlier link of its chain and the dense file
        are durable and no newer attempt holds the run; else record why it failed."""
        totals = _Totals.of(job, reports)
        errors = list(dict.fromkeys(r.error for r in reports if not r.ok))  # every rank's reason, once each
        missing = [c for c in job.chain[:-1] if c not in self.links]
        if missing:
            errors.append(f"chain link(s) {id_ranges(missing)} never committed")
        if errors:
            self._failed(job, "; ".join(errors), totals.stall_ms)
            return totals.outcome(job, committed=False, error="; ".join(errors))
        # before the dense file: a replaced attempt writes nothing more (a failed checkpoint's
        # FAILED record above needs no read of the log; the fold ignores it all the same)
        fenced = self._fenced()
        if fenced:
            return totals.outcome(job, committed=False, error=fenced, fenced=True)
        try:
            ref = self._write_dense(job, reports)
        except DenseStoreError as exc:
            self._failed(job, str(exc), totals.stall_ms)
            return totals.outcome(job, committed=False, error=str(exc))
        durable_unix = self._append_commit(job, reports, totals, ref)
        return totals.outcome(job, committed=True, commit_unix=durable_unix)

    def _write_dense(self, job: WriteJob, reports: list[RankReport]) -> DenseRef:
        """Write the job's dense file, with every rank's loop state in it; raises `DenseStoreError`."""
        assert job.dense_state is not None, "rank 0 snapshots the dense state"
        dense_state = dict(job.dense_state)
        # every rank's loop state, each with its reader's position: what a restore resumes from
        dense_state["trainers"] = [r.trainer_state for r in reports]
        return self.dense.write(job.checkpoint_id, dense_state)

    def _append_commit(self, job: WriteJob, reports: list[RankReport], totals: _Totals, ref: DenseRef) -> float:
        """Append the COMMIT marker of `job` (dense file `ref`) and remember its link for later
        chains; returns the time the marker became durable."""
        cid = job.checkpoint_id
        link = _chain_link(job, reports, totals)
        marker = Marker(
            kind="commit",
            run_id=self.run_id,
            checkpoint_id=cid,
            step=job.step,
            chain=[self.links[c] for c in job.chain[:-1]] + [link],
            dense=ref.as_json(),
            stall_ms=totals.stall_ms,
            created_unix=time.time(),
            step_unix=job.step_unix,
            attempt=self.attempt.attempt if self.attempt else "",
            **{**self.marker_fields, "encodings": {k: v for r in reports for k, v in r.encodings.items()}},
        )
        marker = self._rebased(marker)
        # the link's index in LINK records of its own, then the marker naming them: its size
        # does not grow with the chain (ckpt/log/links.py)
        writer = self.attempt.attempt if self.attempt else "trainer"
        marker = append_with_link(self.markers, marker, writer, before_marker=lambda: maybe_die("marker", cid, 0))
        durable_unix = time.time()
        # later markers name it by id and the fold reads its index from its LINK records: kept
        # without the index, the links of a chain of thousands take little memory
        self.links[cid] = replace(link, index=[])
        self._forget_links_before(job.chain[0])
        self._journal = CommitRecord(cid, job.step, self.where, marker.created_unix)
        self._summarize()
        return durable_unix

    def _forget_links_before(self, first: int) -> None:
        """Drop the committed links older than `first`, the first link of the chain just
        committed: checkpoints are decided and committed in order, and a later one's chain
        extends that chain or starts at a newer full checkpoint (as the one after a failure
        does: docs/design/failures.md), so it never names them. Chains of `incremental` that
        never start over keep every link."""
        if first > self._oldest_link:
            self.links = {cid: link for cid, link in self.links.items() if cid >= first}
            self._oldest_link = first

    def settle(self, outcome: Outcome) -> None:
        """Every rank knows `outcome`: record a COMMIT in the run's local history. A crash
        before this loses only that entry, as a failed write does (the lost-stream check then
        knows one commit fewer)."""
        journal, self._journal = self._journal, None
        if journal is None or not outcome.committed or journal.checkpoint_id != outcome.checkpoint_id:
            return
        try:
            self.dense.record_commit(journal)
        except OSError as exc:  # committed all the same; only the lost-stream check loses this entry
            logger.warning("checkpoint %d: committed, but not recorded in %s: %s", outcome.checkpoint_id, self.dense.root, exc)
        self._retire_dense(outcome.checkpoint_id)

    def _retire_dense(self, committed: int) -> None:
        """`ckpt.write.keep_dense`: once every rank knows of `committed`, delete the dense files
        of the committed checkpoints older than the newest `keep_dense`: this attempt's, the one
        it restored and those committed before it (`start_attempt`). A restore of the newest, a
        server or a follower behind, read only the newest checkpoint's dense file; what an older
        one needs is gone, as after `deltarec-ckpt gc`. Checkpoints newer than the restored one
        (a rewind's abandoned branch) stay for gc. A failed deletion is logged, never retried."""
        if not self.keep_dense:
            return
        self._dense_kept.append(committed)
        while len(self._dense_kept) > self.keep_dense:
            old = self._dense_kept.popleft()
            try:
                self.dense.delete([old])
            except OSError as exc:
                logger.warning("checkpoint %d: dense file not deleted (ckpt.write.keep_dense): %s", old, exc)

    def _fenced(self) -> str:
        """Read what the markers log gained; the one-line reason to stop when a newer attempt
        holds the run, else "". Reading is best effort: a log that cannot be read now fences
        nothing here, and a marker this attempt writes after a newer ATTEMPT record is ignored
        by every reader all the same."""
        self._read_ok = False
        if self.attempt is None and not self.rebase:
            return ""
        try:
            catch_up(self.catalog, self.markers)
        except DeltarecError as exc:
            logger.debug("markers log not read before a commit: %s", exc)
            return ""
        self._read_ok = True
        attempt = self.attempt
        if attempt is None:
            return ""
        newer = fenced_by(self.catalog, attempt)
        return fenced_message(self.run_id, attempt, newer) if newer is not None else ""

    def _summarize(self) -> None:
        """Every `catalog_every` records, a catalog record of the log as `_fenced` read it (just
        before this commit's marker, which a reader folds after it): what lets a restore read
        only the log's tail (ckpt/log/catalog_record.py). Best effort: without it reads are slower."""
        if not self._read_ok or self.catalog.since_summary < self.catalog_every or not self.catalog.exact:
            return
        record = summarize(self.catalog)
        try:
            self.markers.append_marker(encode_marker(record))
        except DeltarecError as exc:
            logger.warning(
                "run %s: no catalog record appended (restores read more of the markers log until the next one): %s",
                self.run_id,
                exc,
            )
            return
        # from here on the fold holds what the record holds: a job that checkpoints every step
        # for days keeps the newest checkpoints in memory, not all of them
        prune(self.catalog, record)

    def _rebased(self, marker: Marker) -> Marker:
        """`marker` with its cheapest complete chain, which starts at a follower's compacted
        baseline when one of its links has one (docs/design/follower.md), as of the log `_fenced`
        just read. Without that read the marker keeps its full chain, which is always valid."""
        if not self.rebase or not self._read_ok or len(marker.chain) < 2:
            return marker
        return self.catalog.cheapest(marker) or marker

    def _failed(self, job: WriteJob, error: str, stall: list[float]) -> None:
        """Best effort: a FAILED record for `deltarec-ckpt list`; its own failure is only logged."""
        marker = Marker(
            kind="failed",
            run_id=self.run_id,
            checkpoint_id=job.checkpoint_id,
            step=job.step,
            error=error,
            stall_ms=stall,
            created_unix=time.time(),
            **self.marker_fields,
        )
        try:
            self.markers.append_marker(encode_marker(marker))
        except Exception as exc:  # noqa: BLE001 - the broker may be the reason it failed
            logger.warning("checkpoint %d: could not record its failure either: %s", job.checkpoint_id, exc)


class _Totals(NamedTuple):
    """What every rank's report adds up to for one checkpoint: the figures its outcome carries
    whether it commits or not."""

    rows: int
    bytes: int
    full: bool
    stall_ms: list[float]
    stall_new_bytes: list[int]
    aside_peak_bytes: list[int]
    write_s: float

    @classmethod
    def of(cls, job: WriteJob, reports: list[RankReport]) -> _Totals:
        return cls(
            rows=sum(r.rows for r in reports),
            bytes=sum(r.bytes for r in reports),
            full=len(job.chain) == 1,
            stall_ms=[r.stall_ms for r in reports],
            stall_new_bytes=[r.stall_new_bytes for r in reports],
            aside_peak_bytes=[r.aside_peak_bytes for r in reports],
            write_s=max(r.write_s for r in reports),
        )

    def outcome(self, job: WriteJob, **decided: Any) -> Outcome:
        """The outcome of `job` with these totals and what was `decided` (committed, error, ...)."""
        return Outcome(
            checkpoint_id=job.checkpoint_id,
            step=job.step,
            bytes=self.bytes,
            rows=self.rows,
            full=self.full,
            stall_ms=self.stall_ms,
            stall_new_bytes=self.stall_new_bytes,
            aside_peak_bytes=self.aside_peak_bytes,
            write_s=self.write_s,
            **decided,
        )


def _chain_link(job: WriteJob, reports: list[RankReport], totals: _Totals) -> ChainLink:
    """The link `job` adds to its chain: every rank's acknowledged ranges and frame index."""
    ranges: dict[int, list[OffsetRange]] = {}
    index: list[IndexEntry] = []
    for r in reports:
        assert all(e.partition == r.rank for e in r.index), "a rank indexes only its own partition"
        ranges.update(r.ranges)
        index.extend(r.index)
    return ChainLink(
        checkpoint_id=job.checkpoint_id,
        full=totals.full,
        generation=job.generation,
        ranges=ranges,
        rows=totals.rows,
        bytes=totals.bytes,
        index=index,
        epoch=job.epoch,
    )
