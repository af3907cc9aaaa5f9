"""`deltarec-follow`: tail a run's COMMITs, keep its model, compact its chain, publish snapshots.

One long-running process per run, on any machine that reaches the stream. For every new
COMMIT it applies that checkpoint's rows to its `RowStore` (encoded bytes, untouched); the
deltas it finds waiting in a round, in one pass (`_follow_deltas`: one read, then every frame
in chain order, leaving the store exactly as applying them one by one would). When
the deltas since its newest baseline grow past `ckpt.follow.compact_ratio` of the
baseline's bytes, or past `compact_links` links, and it holds the lease, it writes a
compacted baseline and then publishes a COMPACTED marker naming it. Restores, and the
trainer's next markers, then start from that baseline. It never talks to the trainer: a
follower that lags or dies costs the trainer nothing but longer chains.

On start it rebuilds the store from the newest COMMIT's cheapest chain, which begins at
the newest compacted baseline, then follows from there. SIGINT/SIGTERM stop it after the
step in progress; it releases the lease on the way out (docs/design/follower.md).

Given another `ApplyTarget` (the prediction server's model, trainer/serve/), it feeds that
instead of a `RowStore` and neither compacts nor exports: one stream, one way of following
it, several consumers (docs/design/serving.md).

Rewinds: when a trainer attempt resumes from an older checkpoint, the checkpoints after it
are an abandoned branch (ckpt/log/catalog.py, "Branches"). The follower never applies one
that the log already calls abandoned; when the checkpoint it holds becomes abandoned, it drops
it (`on_rewind`: the server stops answering from it at once; the store removes its serving
snapshots) and rebuilds the newest checkpoint of the live branch, the one the trainer resumed
from until the new branch commits, which it then follows by deltas. So it never compacts or
exports a link of an abandoned branch into the live one.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from ckpt.config import FollowConfig, SinkConfig
from ckpt.dense.store import DenseStore
from ckpt.events import FollowApplied, FollowCompacted, FollowExported, MetricsSink
from ckpt.follow.compact import write_compacted
from ckpt.follow.lease import LeaseKeeper
from ckpt.follow.serving import Publisher
from ckpt.follow.store import RowStore
from ckpt.log.backend import open_backend, open_sink
from ckpt.log.catalog import Catalog, catch_up, read_catalog
from ckpt.log.catalog_record import KEEP, prune, summarize
from ckpt.log.chain_reads import ChainRun, wanted_runs
from ckpt.log.fencing import new_writer_id
from ckpt.log.links import append_with_link
from ckpt.log.markers import ChainLink, Marker, MarkerError, chain_bytes
from ckpt.restore.replay import ChunkPlace, frame_of_link, iter_link_frames
from ckpt.stream.frames import Frame
from ckpt.stream.sink import compacted_generation, generation_label
from common.allocator import give_back_freed_memory
from common.errors import DeltarecError

logger = logging.getLogger(__name__)

#: The most link bytes one pass of deltas reads before it applies them (its frames are held
#: until the last one arrived, so they can be applied in chain order): a pass of one larger
#: link streams it instead.
MAX_PASS_BYTES = 64 << 20
#: Records folded between two prunes of the fold (`Follower._prune`)
PRUNE_EVERY = 256


class ApplyTarget(Protocol):
    """What the follower applies checkpoints to: `begin`, then the frames of its chain (a full
    link starts with `reset`; `check_complete` after the chain's base), then `finish`; or
    `abandon` when one failed part way. `RowStore` is one; the server's model is another."""

    @property
    def nbytes(self) -> int: ...

    def begin(self, marker: Marker, rebuild: bool) -> None: ...

    def reset(self) -> None: ...

    def apply(self, frame: Frame, partition: int, table_rows: int) -> None: ...

    def check_complete(self, checkpoint_id: int, untrained_ok: bool = False) -> None: ...

    def finish(self, marker: Marker) -> None: ...

    def abandon(self) -> None: ...


@dataclass
class FollowStats:
    applied: int = 0  # checkpoints applied: one by one, in passes of deltas, or rebuilt from a chain
    passes: int = 0  # applications: a rebuild, or a pass of one or more deltas (one record each)
    rebuilt: int = 0
    compacted: int = 0
    exported: int = 0
    failed: int = 0  # checkpoints not applied (the store was rebuilt from a base after each)
    rewinds: int = 0  # checkpoints held that a rewind abandoned (the store was rebuilt after each)
    bytes_read: int = 0
    bytes_compacted: int = 0

    @property
    def work_done(self) -> int:
        """Checkpoints applied, failed, compacted and exported so far: it moves when a round did work."""
        return self.applied + self.failed + self.compacted + self.exported


@dataclass(frozen=True)
class Rewind:
    """The checkpoint a follower held was abandoned: a newer trainer attempt resumed from an
    older one (or started fresh), as its ATTEMPT record said."""

    abandoned: int  # the checkpoint held
    resumed_from: int  # the checkpoint the attempt resumed from; 0: a fresh start
    newest: int  # the newest id when the attempt announced itself: its own checkpoints are above it
    attempt: str
    announced_unix: float  # the ATTEMPT record's time (the trainer's clock); 0.0: unknown
    seen_unix: float  # when this follower read it

    @classmethod
    def of(cls, catalog: Catalog, held: Marker) -> Rewind:
        branch = catalog.abandoned_by(held.checkpoint_id) or catalog.branches[-1]  # abandoned: there is a branch
        announced = next((h.created_unix for h in reversed(catalog.trainer_attempts) if h.attempt == branch.attempt), 0.0)
        return cls(held.checkpoint_id, branch.resumed_from, branch.newest, branch.attempt, announced, time.time())

    def describe(self) -> str:
        how = f"resumed from checkpoint {self.resumed_from}" if self.resumed_from else "started fresh"
        return f"checkpoint {self.abandoned} was abandoned: trainer attempt {self.attempt} {how}"


class CommitIds:
    """A catalog's COMMIT ids, ascending, kept up to date as the log's fold grows: its `commits`
    only gains keys, and a dict keeps them in the order they came, so the new ones are its last.
    A prune (or a whole fold read again) gives the catalog a new dict: its ids are sorted afresh."""

    def __init__(self) -> None:
        self.commits: dict[int, Marker] | None = None
        self.ids: list[int] = []

    def of(self, commits: dict[int, Marker]) -> list[int]:
        if commits is not self.commits or len(commits) < len(self.ids):
            self.commits, self.ids = commits, sorted(commits)
        for cid in itertools.islice(reversed(commits), len(commits) - len(self.ids)):
            bisect.insort(self.ids, cid)
        return self.ids


class Follower:
    """The follower of run `run_id` (`sink` and `follow`: the job's resolved `ckpt` sections). With a `target`,
    it applies checkpoints to that only: no lease, no compaction, no serving snapshots."""

    def __init__(
        self,
        run_id: str,
        sink: SinkConfig,
        follow: FollowConfig,
        metrics: MetricsSink,
        *,
        export_every: int | None = None,
        export_every_s: float | None = None,
        target: ApplyTarget | None = None,
        on_rewind: Callable[[Rewind], None] | None = None,
    ) -> None:
        self.sink = sink
        self.f = follow
        self.run_id = run_id
        self.metrics = metrics
        self.backend = open_backend(run_id, sink, world_size=1)
        self.catalog = Catalog(self.run_id)
        self.follower_id = new_writer_id()  # a restarted follower is a new follower
        self.lease = LeaseKeeper(self.catalog, self.backend.markers, follower_id=self.follower_id, lease_s=self.f.lease_s)
        store = RowStore() if target is None else None
        self.store = store  # what compaction and serving snapshots read; None with a target
        if store is not None:
            self.target: ApplyTarget = store
        else:
            assert target is not None
            self.target = target
        self.applied: Marker | None = None  # the checkpoint the store holds
        self.chain: list[ChainLink] = []  # how the store got there: a baseline, then deltas
        self.publisher = Publisher(
            Path(self.f.export_dir), DenseStore(Path(sink.dense_dir)), keep=self.f.export_keep, dcp=self.f.export_dcp
        )
        self.export_every = self.f.export_every if export_every is None else export_every
        self.export_every_s = self.f.export_every_s if export_every_s is None else export_every_s
        self._last_export = time.monotonic()
        self._since_export = 0
        self.stats = FollowStats()
        self._trim_next_round = False  # a round did work: the next one trims too (`poll`)
        self.last_error = ""  # why the last checkpoint failed to apply; "" once one applies
        self.on_rewind = on_rewind  # told first when the checkpoint held was abandoned (the server stops serving it)
        self._export_now = False  # a rewind dropped the snapshots of the abandoned branch: export the next one
        self.stop = threading.Event()
        self._ids = CommitIds()  # the catalog's COMMIT ids, sorted as they arrive (`_commit_ids`)
        self._pruned_at = 0  # `catalog.records` at the last `_prune`

    # -- the loop -----------------------------------------------------------------------
    def run(self, until: Callable[[Follower], bool] | None = None) -> None:
        """Follow until SIGINT/SIGTERM (or `until(self)` is true after a poll)."""
        previous = (
            {s: signal.signal(s, lambda *_: self.stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
            if threading.current_thread() is threading.main_thread()
            else {}
        )
        logger.info("following run %s in %s as %s", self.run_id, self.backend.where, self.follower_id)
        try:
            while not self.stop.is_set():
                started, rest = time.monotonic(), None
                try:
                    self.poll()
                except MarkerError:
                    raise  # a damaged markers log does not heal by waiting
                except DeltarecError as exc:  # the broker or the log is unreachable: try again later
                    logger.warning("markers log not read, retrying in %.0f s: %s", self.f.poll_s, exc)
                    rest = self.f.poll_s
                if until is not None and until(self):
                    break
                # rounds start every poll_s: one that took longer (a pass, a compaction) is
                # followed at once by the next, which finds what was committed meanwhile
                self.stop.wait(rest if rest is not None else max(0.0, started + self.f.poll_s - time.monotonic()))
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.close()

    def poll(self) -> None:
        """One round: the lease (or, without compaction, the log's new records), then every new
        COMMIT in order (the newest at once on start)."""
        if self.store is not None:
            self.lease.tend()  # reads the log's new records first
        else:
            catch_up(self.catalog, self.backend.markers)
        self._whole_if_inexact()
        work = self.stats.work_done
        try:
            self._check_rewind()
            self._follow_pending(self._pending())
            if self._check_rewind():  # the log said so while this round applied: rebuild now, not a round later
                self._follow_pending(self._pending())
            self._prune()
        finally:
            did_work = self.stats.work_done != work
            if did_work or self._trim_next_round:
                # the round's temporaries (frames, decoded rows, a compaction's windows) were
                # freed into each thread's malloc arena: give them back (docs/design/follower.md)
                give_back_freed_memory()
            # and once more a round later: each read's consumer closes on a thread of its own
            # after the read, freeing its fetch buffers into the Kafka client's threads' arenas
            # after this round's trim
            self._trim_next_round = did_work

    def _prune(self) -> None:
        """Every `PRUNE_EVERY` records folded, cut the fold down to what a catalog record of it
        would hold (ckpt/log/catalog_record.py, `prune`), keeping every COMMIT from the one
        applied on: a follower beside a job that checkpoints every step keeps the newest
        checkpoints in memory, not all of the run's. Nothing is pruned before one is applied."""
        catalog = self.catalog
        if self.applied is None or not catalog.exact or catalog.records - self._pruned_at < PRUNE_EVERY:
            return
        self._pruned_at = catalog.records
        # the newest `keep` restorable commits and every newer one: the one applied and those after it among them
        keep = KEEP + 1 + len(self._newer(self.applied.checkpoint_id))
        prune(catalog, summarize(catalog, keep=keep))

    def _whole_if_inexact(self) -> None:
        """A pruned fold that can no longer answer exactly (a new trainer attempt resumed from a
        checkpoint older than what it kept, whose chain it left out) is replaced by the whole
        log's fold, as a restore's fold from a catalog record is."""
        if self.catalog.exact:
            return
        logger.info("a checkpoint chains through a link this follower's fold left out; reading the whole markers log")
        self.catalog.become(read_catalog(self.backend.markers, self.run_id))
        self._pruned_at = self.catalog.records

    def _pending(self) -> list[Marker]:
        """The COMMITs of the live branch after the one held, in order; the newest alone (its
        cheapest chain) when none is held. Costs what is newer than the one held, not what the
        log holds (`_newer`)."""
        commits, abandoned = self.catalog.commits, self.catalog.abandoned
        if self.applied is None:
            newest = next((cid for cid in reversed(self._commit_ids()) if not abandoned(cid)), None)
            return [] if newest is None else [commits[newest]]
        return [commits[cid] for cid in self._newer(self.applied.checkpoint_id)]

    def _newer(self, checkpoint_id: int) -> list[int]:
        """The ids of the live branch's COMMITs newer than `checkpoint_id`, ascending."""
        ids = self._commit_ids()
        return [cid for cid in ids[bisect.bisect_right(ids, checkpoint_id) :] if not self.catalog.abandoned(cid)]

    def _commit_ids(self) -> list[int]:
        """The catalog's COMMIT ids, ascending (`CommitIds`)."""
        return self._ids.of(self.catalog.commits)

    def _check_rewind(self) -> bool:
        """When the checkpoint held is on a branch a newer trainer attempt abandoned: drop it
        (`on_rewind` first, then the store's serving snapshots of the abandoned branch) so the
        next apply rebuilds the newest checkpoint of the live branch. Whether it did."""
        held = self.applied
        if held is None or not self.catalog.abandoned(held.checkpoint_id):
            return False
        rewind = Rewind.of(self.catalog, held)
        logger.warning("%s; rebuilding from the newest checkpoint of the live branch", rewind.describe())
        if self.on_rewind is not None:
            self.on_rewind(rewind)
        self.stats.rewinds += 1
        self.applied, self.chain = None, []
        if self.store is not None:
            self.publisher.withdraw(self.catalog.abandoned)
            self._export_now = True
        return True

    def _follow_pending(self, pending: list[Marker]) -> None:
        """Apply `pending` in order: each run of deltas that extend what the store holds in one
        pass (`_deltas`), anything else (a full checkpoint, a start) rebuilt from its chain."""
        i = 0
        while i < len(pending):
            if self.stop.is_set():
                return
            marker = pending[i]
            if self.catalog.abandoned(marker.checkpoint_id):  # the log said so since `pending` was read
                return
            deltas, chain = self._deltas(pending[i:])
            try:
                if deltas:
                    self._follow_deltas(deltas, chain)
                else:
                    self._follow(marker)
            except DeltarecError as exc:  # the store is half-updated: rebuild on the next round
                error = f"{_named(deltas or [marker])} not applied: {exc}"
                if error != self.last_error:  # said once, not every round
                    logger.warning("%s; retrying every %.1f s", error, self.f.poll_s)
                self.stats.failed += 1
                self.last_error = error
                self.target.abandon()
                self.applied, self.chain = None, []
                return
            i += max(len(deltas), 1)
            self._maybe_compact()
            self._maybe_export()
            catch_up(self.catalog, self.backend.markers)
        self._maybe_compact()  # a chain that was due while another follower held the lease

    def close(self) -> None:
        try:
            self.lease.release()
        except DeltarecError as exc:
            logger.warning("could not release the compaction lease: %s", exc)
        self.backend.close()
        if self.store is None:
            logger.info("stopped following: %d checkpoints applied (%d rebuilds)", self.stats.applied, self.stats.rebuilt)
            return
        logger.info(
            "stopped: %d checkpoints applied in %d passes (%d rebuilds), %d compacted, %d serving snapshots",
            self.stats.applied,
            self.stats.passes,
            self.stats.rebuilt,
            self.stats.compacted,
            self.stats.exported,
        )

    # -- applying checkpoints -----------------------------------------------------------
    def _extended(self, marker: Marker) -> list[ChainLink] | None:
        """The store's chain with `marker`'s newest link on top, when that link applies to
        what the store holds (`extended`); None: the store must be rebuilt."""
        return extended(self.applied, self.chain, marker)

    def _deltas(self, pending: list[Marker]) -> tuple[list[Marker], list[ChainLink]]:
        """The longest run of `pending`'s first markers whose newest links extend what the store
        holds one after the other (each a delta of the one before it, or a one-shot diff of the
        same baseline), up to `MAX_PASS_BYTES` of links (at least one), and the store's chain
        after them; none when the first needs a rebuild."""
        held, chain = self.applied, self.chain
        run: list[Marker] = []
        size = 0
        for marker in pending:
            if self.catalog.abandoned(marker.checkpoint_id):
                break
            longer = extended(held, chain, marker)
            size += marker.chain[-1].bytes if longer is not None else 0
            if longer is None or (run and size > MAX_PASS_BYTES):
                break
            run.append(marker)
            held, chain = marker, longer
        return run, chain

    def _follow(self, marker: Marker) -> None:
        """Rebuild the store from `marker`'s cheapest chain."""
        t0 = time.perf_counter()
        best = self.catalog.cheapest(marker)
        if best is None:
            logger.warning("checkpoint %d: no complete chain (a generation was dropped); skipped", marker.checkpoint_id)
            return
        self.target.begin(marker, rebuild=True)
        read = 0
        for i, link in enumerate(best.chain):
            read += self._apply(link, marker)
            if i == 0:
                self.target.check_complete(link.checkpoint_id, untrained_ok=bool(marker.init))
        self.chain = list(best.chain)
        self.stats.rebuilt += 1
        self._applied([marker], read, t0, "rebuilt from " + "+".join(str(link.checkpoint_id) for link in self.chain))

    def _follow_deltas(self, deltas: list[Marker], chain: list[ChainLink]) -> None:
        """Apply the newest links of `deltas` (`_deltas`) in one pass: every link read at once,
        then their frames applied in chain order, each link's frames in the order a read of it
        alone gives, so the store ends exactly as it would applying them one by one."""
        t0 = time.perf_counter()
        newest = deltas[-1]
        self.target.begin(newest, rebuild=False)
        read = 0
        for marker, frame in self._pass_frames(deltas):
            self.target.apply(frame, frame.rank, int(marker.tables[frame.table][0]))
            read += _frame_bytes(frame)
        self.chain = chain
        how = "delta" if len(deltas) == 1 else f"{len(deltas)} deltas from checkpoint {deltas[0].checkpoint_id} on"
        self._applied(deltas, read, t0, how)

    def _pass_frames(self, deltas: list[Marker]) -> Iterator[tuple[Marker, Frame]]:
        """The frames of the newest link of each of `deltas`, in chain order. One link is
        streamed; several are read with one `read_ranges` (one consumer on a broker, every
        partition fetched at once), and since a backend may serve them in any order across
        ranges, held until the last arrived."""
        source, locate = self.backend.source, self.backend.locate
        if len(deltas) == 1:
            for frame in iter_link_frames(deltas[0].chain[-1], source, self.run_id, locate):
                yield deltas[0], frame
            return
        runs = [
            ChainRun(i, m.chain[-1], partition, entries)
            for i, m in enumerate(deltas)
            for partition, entries in wanted_runs(m.chain[-1], lambda entry: True)
        ]
        firsts = [[e.first for e in run.entries] for run in runs]
        chunks = [ChunkPlace() for _ in runs]
        got: list[list[Frame]] = [[] for _ in runs]
        for r, pos, frame in source.read_ranges([run.read() for run in runs]):
            run = runs[r]
            if frame_of_link(run.link, run.partition, run.entries, firsts[r], pos, frame, self.run_id, locate, chunks[r]):
                got[r].append(frame)  # a range's frames come in position order
        for run, frames in zip(runs, got):
            for frame in frames:
                yield deltas[run.link_index], frame
            frames.clear()

    def _applied(self, markers: list[Marker], read: int, t0: float, how: str) -> None:
        """`markers` (one rebuilt, or a pass of deltas) are in the store: finish and report."""
        marker = markers[-1]
        self.target.finish(marker)
        self.applied = marker
        self.last_error = ""
        self.stats.applied += len(markers)
        self.stats.passes += 1
        self.stats.bytes_read += read
        behind = len(self._newer(marker.checkpoint_id))
        lag_s = time.time() - marker.created_unix
        logger.info(
            "checkpoint %d (step %d) applied (%s): %.2f MB in %.2f s; %d behind the newest COMMIT, %.1f s after its COMMIT",
            marker.checkpoint_id,
            marker.step,
            how,
            read / 1e6,
            time.perf_counter() - t0,
            behind,
            lag_s,
        )
        self.metrics.write(
            FollowApplied(
                step=marker.step,
                follow_ckpt=marker.checkpoint_id,
                follow_read_bytes=read,
                follow_apply_s=time.perf_counter() - t0,
                follow_lag_ckpts=behind,
                follow_lag_s=lag_s,
                follow_chain=tuple(link.checkpoint_id for link in self.chain),
                follow_store_bytes=self.target.nbytes,
                follow_rebuilt=how.startswith("rebuilt"),
            )
        )

    def _apply(self, link: ChainLink, marker: Marker) -> int:
        """Keep one link's rows in the store; returns the bytes read."""
        if link.full:
            self.target.reset()
        read = 0
        shapes = marker.tables
        for frame in iter_link_frames(link, self.backend.source, self.run_id, self.backend.locate):
            self.target.apply(frame, frame.rank, int(shapes[frame.table][0]))
            read += _frame_bytes(frame)
        return read

    # -- compaction -----------------------------------------------------------------------
    def _due(self) -> bool:
        if self.applied is None or len(self.chain) < 2 or self.applied.policy != "incremental":
            return False  # only incremental chains run through an older checkpoint's baseline
        deltas = self.chain[1:]
        return (
            len(deltas) >= self.f.compact_links
            or sum(link.bytes for link in deltas) >= self.f.compact_ratio * self.chain[0].bytes
        )

    def _maybe_compact(self) -> None:
        if self.store is None or not self._due() or not self.lease.tend():
            return
        if self.applied is not None and self.catalog.abandoned(self.applied.checkpoint_id):
            return  # a rewind abandoned it (the lease's read just said so): never compacted
        marker = self.applied
        assert marker is not None
        t0 = time.perf_counter()
        generation = compacted_generation(self.lease.epoch, marker.checkpoint_id)
        sink = open_sink(self.run_id, self.sink, marker.world_size)
        try:
            link = write_compacted(
                self.store,
                sink=sink,
                run_id=self.run_id,
                checkpoint_id=marker.checkpoint_id,
                generation=generation,
                max_frame_bytes=self.sink.max_frame_bytes,
                flush_timeout_s=self.sink.flush_timeout_s,
            )
        except DeltarecError as exc:
            logger.warning("compaction of checkpoint %d failed (training is not affected): %s", marker.checkpoint_id, exc)
            return
        finally:
            sink.close()
        if not self.lease.tend():  # fenced while writing: the rows are never referenced
            logger.warning(
                "lost the compaction lease while compacting checkpoint %d; its rows in %s are unused",
                marker.checkpoint_id,
                generation_label(generation),
            )
            return
        record = replace(marker, kind="compacted", chain=[link], follower=self.follower_id, stall_ms=[], created_unix=time.time())
        append_with_link(self.backend.markers, record, self.follower_id)
        catch_up(self.catalog, self.backend.markers)
        accepted = self.catalog.compactions.get(marker.checkpoint_id)
        if accepted is None or accepted.follower != self.follower_id or accepted.chain[0] != link:
            logger.warning("compaction of checkpoint %d was fenced by another follower", marker.checkpoint_id)
            return
        replaced = self.chain
        self.chain = [link]
        self.store.mapping.rebase(marker.checkpoint_id)  # one-shot diffs of the new baseline apply to what is held
        self.stats.compacted += 1
        self.stats.bytes_compacted += link.bytes
        seconds = time.perf_counter() - t0
        logger.info(
            "checkpoint %d compacted into %s: %.2f MB replace a chain of %d links (%.2f MB) in %.2f s",
            marker.checkpoint_id,
            generation_label(generation),
            link.bytes / 1e6,
            len(replaced),
            sum(x.bytes for x in replaced) / 1e6,
            seconds,
        )
        self.metrics.write(
            FollowCompacted(
                step=marker.step,
                compacted_ckpt=marker.checkpoint_id,
                compact_bytes=link.bytes,
                compact_replaced_bytes=sum(x.bytes for x in replaced),
                compact_replaced_links=len(replaced),
                compact_s=seconds,
                compact_generation=generation_label(generation),
            )
        )

    # -- serving snapshots ----------------------------------------------------------------
    def _maybe_export(self) -> None:
        self._since_export += 1
        by_count = self.export_every > 0 and self._since_export >= self.export_every
        by_time = self.export_every_s > 0 and time.monotonic() - self._last_export >= self.export_every_s
        by_rewind = self._export_now and (self.export_every > 0 or self.export_every_s > 0)
        if not (by_count or by_time or by_rewind) or self.applied is None or self.store is None:
            return
        if self.catalog.abandoned(self.applied.checkpoint_id):
            return
        self._export_now = False
        try:
            snap = self.publisher.publish(self.store, self.applied, self.run_id)
        except (DeltarecError, OSError) as exc:
            logger.warning("serving snapshot of checkpoint %d failed: %s", self.applied.checkpoint_id, exc)
            return
        self._since_export, self._last_export = 0, time.monotonic()
        self.stats.exported += 1
        logger.info(
            "serving snapshot of checkpoint %d (step %d): %s in %.2f s", snap.checkpoint_id, snap.step, snap.path, snap.seconds
        )
        self.metrics.write(
            FollowExported(step=snap.step, export_ckpt=snap.checkpoint_id, export_path=str(snap.path), export_s=snap.seconds)
        )


def extended(held: Marker | None, chain: list[ChainLink], marker: Marker) -> list[ChainLink] | None:
    """How a store that came to hold checkpoint `held` by `chain` holds `marker` once `marker`'s
    newest link is applied, when that link applies to what the store holds: a delta of `held`
    (`chain` plus that link, or the marker's own chain when it reads fewer bytes: the trainer
    rebased it onto a baseline another follower compacted, so the chain that says when to
    compact, and the one the records show, stays as short as a restore's), or a one-shot diff of
    the same baseline (it holds every row changed since the baseline, so it overwrites the
    previous diff). None: the store must be rebuilt."""
    if held is None or marker.full or len(marker.chain) < 2:
        return None
    if marker.chain[-2].checkpoint_id == held.checkpoint_id:
        ours = [*chain, marker.chain[-1]]
        theirs = marker.chain
        return ours if (chain_bytes(ours), len(ours)) <= (chain_bytes(theirs), len(theirs)) else list(theirs)
    if len(marker.chain) == 2 and len(chain) == 2 and marker.chain[0] == chain[0]:
        return [chain[0], marker.chain[-1]]
    return None


def _frame_bytes(frame: Frame) -> int:
    """The bytes of rows (ids, weights, optimizer states) or of a mapping record's piece a frame holds."""
    if frame.mapping is not None:
        return len(frame.mapping)
    return frame.payload.numel() + frame.row_ids.numel() * 8 + sum(o.rows.numel() for o in frame.optim)


def _named(markers: list[Marker]) -> str:
    """For a message: `checkpoint 7`, or `checkpoints 7..9` for a pass of several."""
    first, last = markers[0].checkpoint_id, markers[-1].checkpoint_id
    return f"checkpoint {first}" if first == last else f"checkpoints {first}..{last}"
