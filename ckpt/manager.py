"""The checkpoint manager: owns policy (when, which rows, what on failure) and restore.

The trainer calls `save(step)` after every step and `finish(step)` at the end; on start
`restore()` brings back the newest (or a chosen) checkpoint, under `ckpt.recovery: partial`
with the survivor snapshots a failed attempt left (ckpt/recovery/partial.py), which a surviving rank
writes with `save_survivor` (ckpt/recovery/survivor.py). At a checkpoint step the training thread:
agrees with the other ranks on the checkpoint's kind (small all-reduces of row counts and
flags, started at the end of the step before; never a wait on Kafka), copies the chosen
rows and the dense state to host memory, and hands them to its writer thread. On CPU the
copy runs beside the next step, whose first lookup waits for the tracker's marks and whose
backward pass waits for the rows (`ckpt.overlap_copy`, ckpt/capture/overlapped_copy.py); the stall is
the hand-off plus those waits.
Outcomes come back asynchronously and are logged, counted and written to metrics; a
failed checkpoint makes the next one full.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from ckpt.capture.host_buffers import HostBufferPool
from ckpt.capture.overlapped_copy import CopyBehind
from ckpt.capture.snapshot import PlannedSnapshot, SnapshotTaker
from ckpt.capture.tracker import RowTracker
from ckpt.checkpoint_policy import CheckpointPolicy, Decision
from ckpt.config import CkptConfig
from ckpt.dense import state as dense_state
from ckpt.dense.store import DenseRef, DenseStore, DenseStoreError
from ckpt.errors import RestoreError
from ckpt.events import MetricsSink
from ckpt.faults import maybe_die, maybe_slow_copy
from ckpt.log.backend import Backend, open_for_restore
from ckpt.log.catalog import Catalog
from ckpt.log.fencing import Announced, Fenced, announce
from ckpt.log.markers import Marker, SurvivorRecord
from ckpt.quant import BitWidthPolicy, warm_up_codecs
from ckpt.recovery.lost_samples import interval_for_pls, run_pls
from ckpt.recovery.partial import PartialOutcome, SkipsBatches, compose, shared_reader, with_survivors
from ckpt.recovery.priority import RowPriority
from ckpt.recovery.survivor import save_survivor
from ckpt.restore import kernel as restore_kernel
from ckpt.restore.choice import ResumeChoice, from_rank0
from ckpt.restore.replay import RowsRestored, restore_rows, row_init_of
from ckpt.stream.frames import FrameError
from ckpt.stream.sink import SinkError, SourceError
from ckpt.write.committer import Committer
from ckpt.write.writer import Outcome, RankWriter, WriteJob
from common.errors import ConfigError, DeltarecError
from sharding.config import TableConfig
from sharding.dmp import ShardedModel
from sharding.plan import EBC_PATH
from sharding.process_group import DistEnv
from sharding.shard_views import ShardMap

logger = logging.getLogger(__name__)

_TIME_CHECK_EVERY = 10  # steps between agreements on a time-based interval
_KINDS = ("full", "base", "last")  # a full checkpoint, a delta since the base, a delta since the last one


class JobIdentity(NamedTuple):
    """What ties a checkpoint to the job that wrote it (stored in every dense file)."""

    config_sha256: str  # the resolved job config
    model_sha256: str  # the model section: what rows and dense state depend on


class StallTiming(NamedTuple):
    """Where one checkpoint's stall went on this rank (milliseconds). With the copy overlapping
    the next step (`overlapped`, ckpt/capture/overlapped_copy.py) `take_ms` and `dense_ms` ran on the copier
    thread, and the stall is the hand-off plus `wait_ms`; else all of it ran in the stall."""

    checkpoint_id: int
    step: int
    full: bool
    agree_ms: float  # collecting the two small all-reduces (started a step early when it could), waiting included
    take_ms: float  # copying the chosen rows to host memory
    dense_ms: float  # tracker marks, dense state capture
    stall_ms: float  # what the training thread lost to this checkpoint
    rows: int  # rows this rank copied
    snapshot_bytes: int
    since_base: float  # fraction of all ranks' rows changed since the baseline
    since_last: float  # ... since the previous checkpoint
    cpu_ms: float = 0.0  # CPU time of the training thread during the stall (the rest of stall_ms is waiting)
    new_bytes: int = 0  # host memory the copy allocated fresh and faulted in (`Snapshot.new_bytes`)
    overlapped: bool = False  # the copy ran beside the next step
    wait_ms: float = 0.0  # of stall_ms: the next step waiting for that copy


class _Agreement(NamedTuple):
    """One checkpoint's agreement in flight: this rank's inputs, reduced in place by `works`."""

    step: int  # the checkpoint step it is for
    counts: torch.Tensor  # rows since the base, since the last checkpoint, in all, of a full one
    flags: torch.Tensor  # force a full checkpoint; the writers too far behind for a full / base / last one
    works: list[Any]  # the two async all-reduces
    forced: bool  # this rank asked for a full checkpoint


class _Copy(NamedTuple):
    """What a checkpoint's copy needs from the training thread (`CheckpointManager._copy`), as
    of its checkpoint step: the training thread goes on while the copy runs."""

    checkpoint_id: int
    step: int
    decision: Decision
    final: bool
    trainer_state: dict[str, Any]
    fractions: tuple[float, float]  # agreed rows changed since the base, since the last checkpoint
    generation: int
    chain: list[int]
    codecs: tuple[str, str]  # (weight codec, optimizer codec)
    overlapped: bool
    agree_ms: float


class _Pending(NamedTuple):
    """What the manager remembers of a checkpoint between its stall and its outcome."""

    started_unix: float
    weight_codec: str


@dataclass
class RestoreReport:
    """A restore, summed over ranks (frames, rows, bytes) and timed on the slowest rank:
    `seconds` from the start of `restore()` to training-ready, and its parts."""

    checkpoint_id: int
    step: int
    chain: list[int]
    frames: int
    rows: int
    bytes: int
    seconds: float
    written: int = 0  # rows written; the rest were replaced by a later link and skipped
    markers_s: float = 0.0  # reading the markers log (rank 0) and agreeing on the checkpoint
    fetch_s: float = 0.0  # waiting for frames
    decode_s: float = 0.0
    apply_s: float = 0.0
    dense_s: float = 0.0  # dense state and loop state, after the rows (its read overlaps them)
    regenerated: int = 0  # rows no link held, regenerated from the row initialisation
    init_s: float = 0.0  # regenerating them (slowest rank)
    partial: PartialOutcome | None = None  # a partial recovery: what it kept, rolled back and lost
    run_pls: float = 0.0  # the run's portion of lost samples so far (ckpt/recovery/lost_samples.py)
    markers_read: int = 0  # records of the markers log decoded to choose the checkpoint
    # rank 0: reading most of them while the model was built, before `restore()` (not in `seconds`)
    markers_ahead_s: float = 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def parts(self) -> str:
        """Where the time went, for the resume line."""
        regen = f", regenerate {self.init_s:.2f} s" if self.regenerated else ""
        ahead = f" (+{self.markers_ahead_s:.2f} s read ahead)" if self.markers_ahead_s else ""
        return (
            f"markers {self.markers_s:.2f} s{ahead}, fetch {self.fetch_s:.2f} s, decode {self.decode_s:.2f} s, "
            f"apply {self.apply_s:.2f} s{regen}, dense {self.dense_s:.2f} s"
        )


class _ReadStats(NamedTuple):
    """Every rank's chain replay, gathered in the one collective that also agrees on its
    outcome: counts summed over ranks, times of the slowest rank."""

    failed: bool
    frames: int
    rows: int
    bytes: int
    written: int
    regenerated: int
    markers_s: float
    fetch_s: float
    decode_s: float
    apply_s: float
    init_s: float

    @classmethod
    def gather(cls, error: str, rows: RowsRestored | None, markers_s: float) -> _ReadStats:
        """All ranks at once (one all-gather): whether any failed (`error`), and their stats."""
        r = rows or RowsRestored()
        mine = torch.tensor(
            [
                float(bool(error)),
                r.frames,
                r.rows,
                r.bytes,
                r.written,
                r.regenerated,
                markers_s,
                r.fetch_s,
                r.decode_s,
                r.apply_s,
                r.init_s,
            ],
            dtype=torch.float64,
        )
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        t = torch.stack(every)
        sums, maxes = t.sum(0).tolist(), t.max(0).values.tolist()
        return cls(maxes[0] > 0, *(int(v) for v in sums[1:6]), *maxes[6:])


def grown_estimate(previous: Mapping[str, int], now: Mapping[str, int], kinds: Sequence[str], cap: int) -> int:
    """The largest of `kinds`' snapshot bytes at the next checkpoint, guessed from two counts
    (`previous` at the last checkpoint, `now` half an interval later): each kind grows by as
    much again as it grew since `previous` (trained rows and one-shot diffs grow checkpoint
    after checkpoint); a kind `previous` lacks (none counted yet, or counted afresh since) is
    taken to double. Never past `cap` (every row)."""

    def grown(k: str) -> int:
        return now[k] + (max(0, now[k] - previous[k]) if k in previous else now[k])

    return min(cap, max(grown(k) for k in kinds))


@dataclass
class CheckpointStats:
    committed: int = 0
    failed: int = 0
    skipped: int = 0
    last: Outcome | None = None
    outcomes: list[Outcome] = field(default_factory=list)
    stalls: list[StallTiming] = field(default_factory=list)  # this rank's, one per checkpoint taken


class CheckpointManager:
    """Continuous checkpoints for one rank of a running job.

    It reads only its own config section (`cfg`, resolved: run id and directories filled)
    and the table declarations; the loop it checkpoints is any `Stateful` whose state
    dict holds this rank's loop position (`step`, and `reader`, the data reader's state).
    """

    def __init__(
        self,
        cfg: CkptConfig,
        *,
        tables: Sequence[TableConfig],
        identity: JobIdentity,
        env: DistEnv,
        device: torch.device,
        sharded: ShardedModel,
        trainer: Stateful,
        metrics: MetricsSink,
        backend: Backend | None = None,
    ) -> None:
        assert cfg.run_id and cfg.dense_dir, "CkptConfig.resolved() fills the run id and directories"
        self.c = cfg
        self.tables = list(tables)
        self.identity = identity
        self.env = env
        self.sharded = sharded
        self.trainer = trainer
        self.metrics = metrics
        self.run_id = cfg.run_id
        # Writers coordinate on their own gloo group so the training thread's collectives
        # and theirs never interleave (see ckpt/write/writer.py).
        self.group = dist.new_group(backend="gloo")
        self.shard_map = ShardMap.from_model(sharded.model)
        self.tracker = RowTracker(sharded.model, self.shard_map)
        # With a row initialisation the untrained rows need not be stored (sharding/row_init.py):
        # full checkpoints hold the rows trained since, and markers say how to regenerate the rest.
        self.row_init = sharded.row_init
        regenerate = self.row_init is not None and cfg.untrained_rows == "regenerate"
        # snapshots reuse the memory of written ones, within the pending-snapshot budget (pinned
        # for GPU shards, whose copies to host are asynchronous)
        pool = HostBufferPool(cfg.max_pending_bytes, nice=cfg.writer_nice, pin_for=torch.device(device))
        self.taker = SnapshotTaker(
            self.shard_map, self.tracker, device, trained_only=regenerate, pool=pool, encode_on=cfg.encode_on
        )
        self.policy = CheckpointPolicy(self.c.policy)
        # a restore comes next: its readers connect while the rest is built (or, given by the
        # job, while its model was built)
        self.backend: Backend = backend if backend is not None else open_for_restore(cfg, env.world_size, env.rank)
        self.dense = DenseStore(Path(cfg.dense_dir))
        self.dense_capture = dense_state.DenseCapture(sharded)  # rank 0's stall; any rank's survivor
        self.committer = None
        if env.rank == 0:
            self.committer = Committer(
                run_id=self.run_id,
                markers=self.backend.markers,
                dense=self.dense,
                marker_fields=self._marker_fields(),
                rebase=self.c.policy == "incremental",
                where=self.backend.where,
                catalog_every=self.c.catalog_every,
                connect_timeout_s=self.c.connect_timeout_s,
            )
        self.writer = RankWriter(
            run_id=self.run_id,
            rank=env.rank,
            sink=self.backend.sink,
            group=self.group,
            max_frame_bytes=self.c.max_frame_bytes,
            flush_timeout_s=self.c.flush_timeout_s,
            committer=self.committer,
            nice=self.c.writer_nice,
        )
        self.next_id = 1
        self.generation = 0
        self.chain: list[int] = []
        self.force_full = False
        self.last_step = -1
        self.last_time = time.monotonic()
        self.total_rows = sum(s.num_rows for s in self.shard_map.shards)
        self.stats = CheckpointStats()
        self.restores = 0  # restores of this job so far (persisted in the dense state)
        self.epoch = 0  # this attempt's epoch (ckpt/log/fencing.py), written into every frame; 0: not yet known
        self.attempt = ""  # this attempt's id, known with its epoch
        self.last_committed = 0  # the newest checkpoint this rank knows committed (restored or written)
        self.lost_samples = 0.0  # samples whose updates partial recoveries lost, over the run (ckpt/recovery/lost_samples.py)
        self.interval_s = cfg.interval_s  # or what `ckpt.target_pls` sets at start
        self.choice = ResumeChoice(cfg, self.backend, self.dense)  # what `restore` reads, agreed by every rank
        if cfg.recovery == "partial":
            self.tracker.keep_uncommitted()
        self.priority = (
            None
            if cfg.priority == "none"
            else RowPriority(
                self.tracker,
                self.taker.row_bytes,
                cfg.priority,
                sample=cfg.ssu_sample,
                seed=zlib.crc32(f"{self.run_id}:{env.rank}".encode()),
            )
        )
        self._since_full = 0  # checkpoints since the last full one (prioritized checkpoints)
        self._full_samples = 0  # samples seen at the last full checkpoint
        self._announcing: tuple[Future[Announced], Catalog] | None = None  # rank 0, from the start on
        self.agreed_fractions = (0.0, 0.0)  # rows changed since the base / the last checkpoint, all ranks
        self._ahead_step, self._ahead_due = -1, False  # a step whose checkpoint was decided a step early
        self._agreement: _Agreement | None = None  # its agreement, started then
        self._agreed_bytes: dict[str, int] = {}  # this rank's snapshot bytes per kind at the last agreement
        self._pending: dict[int, _Pending] = {}
        self._reserved = False  # the next snapshot's slab was asked for (`_reserve_next`)
        self.copier: CopyBehind[StallTiming] = CopyBehind()  # a checkpoint's copy beside the next step
        warm_up_codecs([self.codecs()[0]])  # before training, not in the first checkpoint's write
        if self.c.resume != "none":
            restore_kernel.load()  # the restore's fused replay: compiled or loaded now, not in the restore
        self.full_bytes = self.taker.upper_bound_bytes()  # fixed by the plan
        if self.full_bytes > self.c.max_pending_bytes:
            raise ConfigError(
                f"ckpt.max_pending_bytes={self.c.max_pending_bytes} is smaller than one full snapshot of this "
                f"rank ({self.full_bytes} bytes): raise it, or no full checkpoint could ever be taken"
            )

    def _marker_fields(self) -> dict[str, Any]:
        plan = self.sharded.plan.plan[EBC_PATH]
        return {
            "policy": self.c.policy,
            "world_size": self.env.world_size,
            "plan": {t: ps.sharding_type for t, ps in plan.items()},
            "tables": {t.name: [t.num_embeddings, t.embedding_dim] for t in self.tables},
            "init": self.row_init.to_json() if self.row_init is not None and self.taker.trained_only else {},
        }

    # -- restore ------------------------------------------------------------------------
    def restore(self) -> RestoreReport | None:
        """Bring back the checkpoint `ckpt.resume` names; None when there is none to resume.

        A damaged checkpoint (bad CRC, a frame that does not match its marker, missing data,
        a dense file with the wrong sha256) stops the job naming where, or with
        `ckpt.on_corrupt: previous` falls back to the newest older one. Every rank agrees
        on the outcome before anyone falls back, so all restore the same checkpoint.
        """
        report = self._restore()
        self._start_attempt()
        return report

    def _restore(self) -> RestoreReport | None:
        t0 = time.perf_counter()
        candidates = self.choice.newest(self._announce)
        markers_s = time.perf_counter() - t0
        if self.c.resume == "none":
            self._start_fresh()
            return None
        if not candidates:  # `resume=latest` of a run without history (`ResumeChoice` refused the rest)
            if self.env.rank == 0:
                logger.info("no checkpoint of run %s in %s: starting from scratch", self.run_id, self.backend.where)
            self._start_fresh()
            return None
        pristine = self.row_init  # the shards hold exactly these initial values until a restore writes
        for marker, survivors in self.choice.tries(candidates[0]):
            error = ""
            try:
                rows, state, partial, skips = self._read(marker, survivors, pristine)
            except (FrameError, SourceError, RestoreError, DenseStoreError) as exc:
                error = f"checkpoint {marker.checkpoint_id}{' with survivor snapshots' if survivors else ''}: {exc}"
            pristine = None
            read = _ReadStats.gather(error, None if error else rows, markers_s)
            if not read.failed:
                return self._finish_restore(marker, rows, state, t0, read, partial, skips)
            reason = self._first_error(error)
            if survivors:
                logger.warning("%s; every rank rolls back to the checkpoint instead (full recovery)", reason)
                continue
            if self.c.on_corrupt == "fail":
                raise RestoreError(reason + " (set ckpt.on_corrupt=previous to fall back to an older checkpoint)")
            logger.warning("%s; falling back to the previous checkpoint", reason)
        raise RestoreError(f"no restorable checkpoint of run {self.run_id} in {self.backend.where}")

    def _read(
        self, marker: Marker, survivors: list[SurvivorRecord], pristine: Any
    ) -> tuple[RowsRestored, dict[str, Any], PartialOutcome | None, list[int]]:
        """Replay `marker`'s chain (and the survivors' links after it) into the shards and read
        the dense state beside the rows: the state to load, and for a partial recovery its
        outcome and the batches each rank's reader skips."""
        refs = {None: DenseRef.from_json(marker.dense)} | {r.rank: DenseRef.from_json(r.dense) for r in survivors}
        with ThreadPoolExecutor(2, thread_name_prefix="deltarec-dense-read") as pool:
            dense: dict[int | None, Future[dict[str, Any]]] = {}

            def read_dense() -> None:  # beside the rows, once their first fetch is under way
                dense.update({rank: pool.submit(self.dense.read, ref) for rank, ref in refs.items()})

            chain = with_survivors(marker, survivors) if survivors else marker
            rows = restore_rows(
                chain,
                self.backend.source,
                self.shard_map,
                self.run_id,
                self.backend.locate,
                shards_hold_init=pristine,
                while_fetching=read_dense,
            )
            state = dense.pop(None).result()
            if not survivors:
                return rows, state, None, []
            state, skips, partial = compose(
                marker,
                survivors,
                state,
                {r: f.result() for r, f in dense.items() if r is not None},
                world_now=self.env.world_size,
            )
            return rows, state, partial, skips

    def _first_error(self, error: str) -> str:
        """Why a restore failed, on every rank: its own reason, or the first other rank's, so
        the line each rank stops with names the file and offset whichever rank read the damage
        (only on failure: the happy path pays one all-reduce, not this gather)."""
        errors: list[str] = [""] * self.env.world_size
        dist.all_gather_object(errors, error)
        if error:
            return error
        rank, first = next((r, e) for r, e in enumerate(errors) if e)
        return f"{first} (read by rank {rank})"

    def _finish_restore(
        self,
        marker: Marker,
        rows: RowsRestored,
        state: dict[str, Any],
        t0: float,
        read: _ReadStats,
        partial: PartialOutcome | None = None,
        skips: Sequence[int] = (),
    ) -> RestoreReport:
        t_dense = time.perf_counter()
        model_sha256 = self.identity.model_sha256
        if self.env.rank == 0 and state.get("model_sha256") not in (None, model_sha256):
            logger.warning(
                "checkpoint %d was written with another model config (sha256 %s…, now %s…); restoring what matches",
                marker.checkpoint_id,
                str(state["model_sha256"])[:12],
                model_sha256[:12],
            )
        dense_state.load(self.sharded, state)
        self.trainer.load_state_dict(self._trainer_state(state, marker))
        self._adopt_rows(marker, rows)
        if partial is not None:
            self._adopt_partial(marker, rows, skips)
        self.restores = int(state.get("restores", 0)) + 1
        self.lost_samples = float(state.get("lost_samples", 0.0))
        self.last_committed = marker.checkpoint_id
        self.next_id = max(marker.checkpoint_id, self.choice.newest_id) + 1
        self.chain = [link.checkpoint_id for link in marker.chain]
        if self.committer is not None:
            self.committer.links = {link.checkpoint_id: link for link in marker.chain}
        if self.c.policy == "incremental":
            # The live rows are exactly what the chain restores, so the rows changed from
            # here on are a delta of it: the chain goes on, in a generation the next
            # checkpoint opens (this job may have another world size, so other partitions).
            self.policy.have_base = True
            self.force_full = False
            self.generation = 0
        else:
            self.generation = marker.chain[0].generation
            self.force_full = True  # the tracker's history since the base died with the old process
        if partial is not None:
            self.force_full = True  # the next checkpoint is the new base: no committed one holds these rows
        self.last_step = marker.step
        now = time.perf_counter()
        slowest = torch.tensor([now - t0, now - t_dense], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds, dense_s = slowest.tolist()
        report = RestoreReport(
            marker.checkpoint_id,
            marker.step,
            self.chain,
            read.frames,
            read.rows,
            read.bytes,
            seconds,
            read.written,
            read.markers_s,
            read.fetch_s,
            read.decode_s,
            read.apply_s,
            dense_s,
            read.regenerated,
            read.init_s,
            partial,
            run_pls(self.lost_samples, float(state["trainers"][0]["samples_seen"])),
            self.choice.markers_read,
            self.choice.markers_ahead_s,
        )
        if self.env.rank == 0:
            logger.debug(  # the trainer prints the resume line
                "restored checkpoint %d (step %d, chain %s): %d frames, %d rows, %.1f MB in %.2f s (%s)",
                report.checkpoint_id,
                report.step,
                report.chain,
                report.frames,
                report.rows,
                report.bytes / 1e6,
                report.seconds,
                report.parts(),
            )
            self.metrics.write(
                {
                    "step": report.step,
                    "restored_ckpt": report.checkpoint_id,
                    "restore_s": report.seconds,
                    "restore_bytes": report.bytes,
                    "restore_chain": report.chain,
                    "restore_rows_written": report.written,
                    "restore_markers_s": report.markers_s,
                    "restore_markers_records": report.markers_read,
                    "restore_markers_ahead_s": report.markers_ahead_s,
                    "restore_fetch_s": report.fetch_s,
                    "restore_decode_s": report.decode_s,
                    "restore_apply_s": report.apply_s,
                    "restore_dense_s": dense_s,
                    "restore_regenerated_rows": report.regenerated,
                    "restore_regenerate_s": report.init_s,
                    "run_pls": report.run_pls,
                }
            )
            if partial is not None:
                self.metrics.write(
                    {
                        "step": partial.step,
                        "partial_restore": True,
                        "partial_kept_ranks": partial.kept,
                        "partial_rolled_back_ranks": partial.rolled_back,
                        "partial_rolled_back_fraction": partial.rolled_back_fraction,
                        "partial_rolled_back_tables": partial.rolled_back_tables,
                        "partial_samples_since_ckpt": partial.samples_since,
                        "partial_lost_samples": partial.lost_samples,
                        "partial_waiting_lost": partial.waiting_lost,
                        "run_pls": report.run_pls,
                    }
                )
        return report

    def _adopt_partial(self, marker: Marker, rows: RowsRestored, skips: Sequence[int]) -> None:
        """After a partial restore: rows the survivors' links wrote are changes no committed
        checkpoint holds (a survivor of this attempt saves them again), and this rank's reader
        moves past the batches its dead predecessor would have trained."""
        assert rows.link_of is not None
        self.tracker.touch([link >= len(marker.chain) for link in rows.link_of])
        skip = skips[self.env.rank] if len(skips) == self.env.world_size else 0
        if skip > 0:
            if not isinstance(self.trainer, SkipsBatches):
                raise RestoreError(
                    f"partial recovery: this rank's reader must skip {skip} batches, but the loop "
                    f"({type(self.trainer).__name__}) cannot"
                )
            self.trainer.skip_batches(skip)

    def _adopt_rows(self, marker: Marker, rows: RowsRestored) -> None:
        """The restored rows become the rows trained so far, and the untrained ones follow the
        chain's row initialisation from here on (the next markers name it, unless
        `ckpt.untrained_rows=store`): a chain without one stored every row, so every row
        counts as trained."""
        assert rows.held is not None
        self.tracker.load_trained(rows.held)
        chain_init = row_init_of(marker)
        if chain_init is not None and self.c.untrained_rows == "regenerate":
            self.row_init = chain_init
            self.taker.trained_only = True
            if self.committer is not None:
                self.committer.marker_fields["init"] = chain_init.to_json()

    def _start_fresh(self) -> None:
        """Train from step 0 with checkpoint ids after every id the stream or the run directory
        has seen, so nothing earlier is overwritten."""
        self.next_id = self.choice.newest_id + 1
        if self.env.rank == 0 and self.next_id > 1:
            logger.info(
                "run %s starts over; its checkpoint ids continue from %d (earlier files are kept)", self.run_id, self.next_id
            )
        return None

    def _announce(self, catalog: Catalog) -> None:
        """Rank 0, once the checkpoint to resume is chosen from `catalog`: this attempt's ATTEMPT
        record (ckpt/log/fencing.py) is appended in the background. A fresh idempotent producer's
        first append takes about a second on the embedded broker, which the restore need not
        wait for; the first checkpoint does (`_join_attempt`)."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="deltarec-announce")
        self._announcing = (pool.submit(announce, self.backend.markers, self.run_id, "trainer", self.env.world_size), catalog)
        pool.shutdown(wait=False)

    def _join_attempt(self) -> None:
        """Before this attempt's first checkpoint: rank 0 waits for its ATTEMPT record, hands it
        to the committer, and every rank learns the epoch its frames carry."""

        def join() -> tuple[int, str]:
            assert self._announcing is not None and self.committer is not None
            future, catalog = self._announcing
            try:
                attempt, epoch = future.result()
            except DeltarecError:
                raise
            except Exception as exc:  # noqa: BLE001 - a client's own error: every rank stops with it
                raise SinkError(f"run {self.run_id}: cannot announce this attempt in the markers log: {exc}") from exc
            self.committer.start_attempt(attempt, epoch, catalog)
            return epoch, attempt.attempt

        self.epoch, self.attempt = from_rank0(join, SinkError)

    def _start_attempt(self) -> None:
        """After the restore (or a fresh start): under partial recovery every rank learns its
        attempt now (a survivor's record names it), and `ckpt.target_pls` sets the interval."""
        if self.c.recovery == "partial" and not self.epoch:
            self._join_attempt()
        if self.c.target_pls > 0:
            self.interval_s = self._pls_interval()

    def _pls_interval(self) -> float:
        """CPR's interval for `ckpt.target_pls` (ckpt/recovery/lost_samples.py): the rank holding the largest share
        of the embedding parameters is the one whose failure loses the most."""
        local = float(sum(s.num_rows * s.num_cols for s in self.shard_map.shards))
        total, largest = torch.tensor([local], dtype=torch.float64), torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        share = largest.item() / max(total.item(), 1.0)
        mtbf = self.c.mtbf_s or self.choice.mtbf_s
        if not mtbf:
            raise ConfigError(
                "ckpt.target_pls needs ckpt.mtbf_s (seconds) until the run has restarted at least once "
                "(then its own attempts give the mean time between failures)"
            )
        interval = interval_for_pls(self.c.target_pls, mtbf, share)
        if self.env.rank == 0:
            logger.info(
                "checkpoint interval %.1f s for PLS %.4g: mean time between failures %.0f s (%s), a rank "
                "holds up to %.1f%% of the embedding parameters",
                interval,
                self.c.target_pls,
                mtbf,
                "ckpt.mtbf_s" if self.c.mtbf_s else "this run's attempts",
                share * 100,
            )
        return interval

    def _trainer_state(self, state: dict[str, Any], marker: Marker) -> dict[str, Any]:
        """This rank's loop state; reader state carries over to another world size only
        when every rank's was the same (the synthetic stream's global position)."""
        trainers = state["trainers"]
        if len(trainers) == self.env.world_size:
            return trainers[self.env.rank]
        return shared_reader(trainers, marker, f" (e.g. Criteo line ranges); resume it with {len(trainers)} ranks")

    # -- save -----------------------------------------------------------------------------
    def _due(self, step: int) -> bool:
        """Whether `step` takes a checkpoint: decided at the end of the step before (`_look_ahead`),
        or now for the first step of this process."""
        return self._ahead_due if self._ahead_step == step else self._due_at(step)

    def _due_at(self, step: int) -> bool:
        c = self.c
        due = c.interval_steps > 0 and step % c.interval_steps == 0
        if self.interval_s > 0 and step % _TIME_CHECK_EVERY == 0:
            flag = torch.tensor([float(time.monotonic() - self.last_time >= self.interval_s)])
            dist.broadcast(flag, src=0)  # rank 0's clock decides, so every rank agrees
            due = due or bool(flag.item())
        return due

    def save(self, step: int) -> None:
        """Called after every training step; takes a checkpoint when one is due."""
        maybe_die("step", step, self.env.rank)
        self._settle()  # done already: this step's backward pass waited for it
        self._collect()
        if self._due(step):
            self._checkpoint(step)
        if self._halfway(step):
            self._reserve_next()
        self._look_ahead(step + 1)

    def _halfway(self, step: int) -> bool:
        """Whether `step` ends half of the interval after the last checkpoint (or the start),
        once per interval: the next snapshot's slab is reserved then. With a checkpoint every
        step there is no step between two, and nothing is reserved: the slabs given back serve
        (counting the rows for an estimate would cost the training thread a pass every step)."""
        if self._reserved or self.taker.pool is None or self.priority is not None:
            return False
        every = self.c.interval_steps
        if every >= 2 and step % every == every // 2:
            return True
        return self.interval_s > 0 and time.monotonic() - self.last_time >= self.interval_s / 2

    def _reserve_next(self) -> None:
        """Fault in, on the pool's helper thread, a slab for the next snapshot, half an interval
        before it: the largest kind the policy may take next, its bytes now grown by as much
        again as since the last checkpoint's agreement (`grown_estimate`; a kind counted afresh
        since then, or before any agreement, is taken to double). Without it the first snapshot
        (a full one) and every one larger than the slabs kept fault their pages in inside the
        stall. Half an interval ahead, not at the checkpoint: the last snapshot's slab is then
        usually back in the pool to be reused, and the estimate looks half as far ahead."""
        self._reserved = True
        kinds = self.policy.next_kinds(self.force_full)
        now = {k: self.taker.estimate_bytes(full=k == "full", since_base=k != "last") for k in kinds}
        previous = dict(self._agreed_bytes)
        previous.pop("last", None)  # the rows changed since the last checkpoint start from none at each
        if self.stats.stalls and self.stats.stalls[-1].full:
            previous.pop("base", None)  # and those since the baseline, at a full one
        assert self.taker.pool is not None
        self.taker.pool.reserve_ahead(grown_estimate(previous, now, kinds, self.full_bytes))

    def _look_ahead(self, step: int) -> None:
        """Decide now whether the next step, `step`, checkpoints, and if so start its agreement:
        its all-reduces then run during that step's training, and the stall only collects them
        (the kind is chosen from the row counts of the step before it). Not after a checkpoint
        at this very step: its counts were just reset and would say nothing about `step`."""
        self._ahead_step, self._ahead_due = step, self._due_at(step)
        if self._ahead_due and self.last_step != step - 1:
            self._agreement = self._start_agreement(step)

    def finish(self, step: int) -> None:
        """Checkpoint the last step (ckpt.final), wait for every outcome, stop the writer."""
        self._settle()
        if self.c.final and self.last_step != step:
            self._checkpoint(step, final=True)
            self._settle()
        self.copier.close()
        if self._agreement is not None:  # started for a step that never came
            for work in self._agreement.works:
                work.wait()
            self._agreement = None
        for outcome in self.writer.close():
            self._record(outcome)
        if self.taker.pool is not None:
            self.taker.pool.close()
        self.backend.close()
        if self.env.rank == 0:
            logger.debug(  # the trainer prints the summary line
                "checkpoints: %d committed, %d failed, %d skipped", self.stats.committed, self.stats.failed, self.stats.skipped
            )

    def _collect(self) -> None:
        for outcome in self.writer.poll():
            self._record(outcome)

    def _record(self, o: Outcome) -> None:
        self.stats.outcomes.append(o)
        self.stats.last = o
        pending = self._pending.pop(o.checkpoint_id)
        if o.fenced:  # every rank learns it from the same outcome and stops
            raise Fenced(o.error)
        durable_s = o.commit_unix - pending.started_unix if o.committed else None
        if o.committed:
            self.stats.committed += 1
            self.last_committed = max(self.last_committed, o.checkpoint_id)
            self.tracker.committed(o.checkpoint_id)
            maybe_die("committed", o.checkpoint_id, self.env.rank)
        else:
            self.stats.failed += 1
            self.force_full = True
        if self.env.rank != 0:
            return
        kind = "full" if o.full else "delta"
        note = {  # for the console, which folds frequent checkpoints into one line
            "checkpoint_id": o.checkpoint_id,
            "step": o.step,
            "committed": o.committed,
            "full": o.full,
            "bytes": o.bytes,
            "stall_ms": max(o.stall_ms or [0]),
        }
        if o.committed:
            logger.info(
                "checkpoint %d (step %d, %s) committed: %s rows, %.2f MB, stall %.1f ms (max over ranks), written in %.2f s",
                o.checkpoint_id,
                o.step,
                kind,
                f"{o.rows:,}",
                o.bytes / 1e6,
                max(o.stall_ms or [0]),
                o.write_s,
                extra={"ckpt": note},
            )
        else:
            logger.warning("checkpoint %d (step %d) FAILED: %s", o.checkpoint_id, o.step, o.error, extra={"ckpt": note})
        self.metrics.write(
            {
                "step": o.step,
                "ckpt_id": o.checkpoint_id,
                "ckpt_committed": o.committed,
                "ckpt_full": o.full,
                "ckpt_rows": o.rows,
                "ckpt_bytes": o.bytes,
                "ckpt_stall_ms": max(o.stall_ms or [0]),
                "ckpt_stall_new_bytes": sum(o.stall_new_bytes),
                "ckpt_write_s": o.write_s,
                "ckpt_error": o.error,
                "ckpt_encoding": pending.weight_codec,
                "ckpt_durable_s": durable_s,
            }
        )

    def _start_agreement(self, step: int) -> _Agreement:
        """This rank's view, in one pair of small async all-reduces: the counts that choose the
        checkpoint's kind and the fraction of rows it writes, whether any rank asks for a full
        one, and whether any rank's writer is too far behind for each kind. Numbers only, so
        the training thread never waits on Kafka here."""
        if self.priority is not None and self._since_full + 1 >= self.c.priority_full_every:
            self.force_full = True  # the full checkpoint that saves what prioritized ones left waiting
        base, last = self.tracker.counts(since_base=True), self.tracker.counts(since_base=False)  # one pass each
        full = self.tracker.counts(since_base=True, trained=True) if self.taker.trained_only else None
        est = {
            "full": self.taker.bytes_for(full) if full is not None else self.full_bytes,
            "base": self.taker.bytes_for(base),
            "last": self.taker.bytes_for(last),
        }
        self._agreed_bytes = est
        pending = self.writer.pending_bytes
        counts = torch.tensor(
            [sum(base), sum(last), self.total_rows, sum(full) if full is not None else self.total_rows], dtype=torch.float64
        )
        flags = torch.tensor([float(self.force_full)] + [float(pending + est[k] > self.c.max_pending_bytes) for k in _KINDS])
        works = [dist.all_reduce(counts, async_op=True), dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)]
        return _Agreement(step, counts, flags, works, self.force_full)

    def _agree(self, step: int) -> tuple[Decision, float, dict[str, bool], bool]:
        """The checkpoint of `step`: its kind, the fraction of rows it writes, which kinds some
        rank's writer has no room for, and whether this rank's request for a full checkpoint
        was part of it (`_start_agreement`)."""
        a = self._agreement
        if a is not None and a.step == step:
            self._agreement = None
        else:  # not started a step ahead (the first step, the final checkpoint)
            a = self._start_agreement(step)
        for work in a.works:
            work.wait()
        counts, flags = a.counts, a.flags
        total = max(counts[2].item(), 1.0)
        self.agreed_fractions = (counts[0].item() / total, counts[1].item() / total)  # since base, since last
        full_fraction = counts[3].item() / total  # what a full checkpoint would write
        decision = self.policy.decide(self.agreed_fractions[0], force_full=bool(flags[0]), full_fraction=full_fraction)
        fraction = full_fraction if decision.full else (counts[0] if decision.since_base else counts[1]).item() / total
        overflow = {k: bool(f) for k, f in zip(_KINDS, flags[1:], strict=True)}
        return decision, fraction, overflow, a.forced

    def _checkpoint(self, step: int, final: bool = False) -> None:
        """Take the checkpoint of `step`: agree, copy (the stall), hand to the writer.
        Under back-pressure `skip` drops it (reported), `wait` blocks; the final one waits.
        Its callers have waited for the previous checkpoint's copy (`_settle`)."""
        assert not self.copier.busy, "the previous checkpoint's copy is still running"
        if not self.epoch:
            self._join_attempt()
        started_unix, t0, cpu0 = time.time(), time.perf_counter(), time.thread_time()
        decision, fraction, overflow, forced = self._agree(step)
        t_agreed = time.perf_counter()
        kind = "full" if decision.full else ("base" if decision.since_base else "last")
        if overflow[kind] and self.c.on_backpressure == "skip" and not final:
            self.stats.skipped += 1
            if self.env.rank == 0:
                logger.warning(
                    "checkpoint at step %d skipped: the writers are behind (ckpt.max_pending_bytes)",
                    step,
                    extra={"ckpt": {"step": step, "skipped": True}},
                )
                self.metrics.write({"step": step, "ckpt_skipped": True})
            return
        if self.writer.pending_bytes:  # the agreed counts are a step old: the bound uses this step's
            need = self.taker.estimate_bytes(decision.full, decision.since_base)
            self.writer.wait_for_room(need, self.c.max_pending_bytes)
        self.last_step, self.last_time = step, time.monotonic()
        self._reserved = False  # the next snapshot's slab: half an interval from now (`_reserve_next`)
        cid = self.next_id
        self.next_id += 1
        if decision.full or not self.generation:
            self.generation = cid  # a full checkpoint, or the first delta after a restore, opens one
        self.chain = self.policy.chain_after(self.chain, cid, decision)
        trainer_state = self.trainer.state_dict()  # this step's loop position, before the next step moves it
        self.policy.record(decision, fraction)
        self.force_full = self.force_full and not forced  # a request made after the agreement waits for the next
        codecs = self.codecs()
        self._pending[cid] = _Pending(started_unix=started_unix, weight_codec=codecs[0])
        overlap = self._overlap()
        copy = _Copy(
            cid,
            step,
            decision,
            final,
            trainer_state,
            self.agreed_fractions,
            self.generation,
            list(self.chain),
            codecs,
            overlap,
            agree_ms=(t_agreed - t0) * 1e3,
        )
        if overlap:
            handoff_s, handoff_cpu = time.perf_counter() - t0, time.thread_time() - cpu0
            self.copier.start(lambda finish, release: self._copy(copy, handoff_s, finish, handoff_cpu, release))
            self.tracker.hold_next_lookup(self.copier.wait_released, self._settle)
        else:
            timing = self._copy(copy, 0.0, lambda: time.perf_counter() - t0, 0.0)
            self.stats.stalls.append(timing._replace(cpu_ms=(time.thread_time() - cpu0) * 1e3))

    def _overlap(self) -> bool:
        """Whether this checkpoint's copy runs beside the next step (ckpt/capture/overlapped_copy.py)."""
        return self.c.overlap_copy and self.taker.device.type == "cpu" and self.tracker.attached

    def wait_for_copy(self) -> None:
        """Wait for a checkpoint's copy still running beside training (`ckpt.overlap_copy`):
        until then it reads the shards and changes the tracker's bitmaps, so a caller that reads
        either between steps (a benchmark) waits first. The manager's own calls do."""
        self._settle()

    def _settle(self) -> None:
        """Wait for the copy in flight, if any, and record its stall. Every call that reads or
        changes the tracker, the taker or the writer's queue comes here first, and so does the
        next step's backward pass, before its embedding kernels could change a row."""
        timing = self.copier.wait()
        if timing is not None:
            self.stats.stalls.append(timing)

    def _copy(
        self, c: _Copy, handoff_s: float, blocked: Callable[[], float], cpu_s: float, release: Callable[[], None] = lambda: None
    ) -> StallTiming:
        """The copy of checkpoint `c`: the bitmap scan, the tracker's marks and the dense state,
        then (after `release()`) the rows to host memory, then the writer's job. Inside the stall
        on the training thread, or on the copier thread beside the next step, whose first lookup
        waits for `release()` and whose backward pass waits for the rest (ckpt/capture/overlapped_copy.py).
        `blocked()`, called as its last step before the writer gets the job, says how long the
        training thread has been waiting for it (inside the stall: all of it) on top of
        `handoff_s`, the stall before the copy started."""
        decision, cid, step = c.decision, c.checkpoint_id, c.step
        maybe_slow_copy(cid, "start")
        t_take = time.perf_counter()
        saved = None  # a prioritized checkpoint's rows (ckpt/recovery/priority.py)
        if decision.full or self.priority is None:
            planned = self.taker.plan(cid, step, full=decision.full, since_base=decision.since_base, weight_codec=c.codecs[0])
        else:
            saved = self.priority.select(self.tracker.changed_since_last(), int(self.c.priority_budget * self.full_bytes))
            planned = PlannedSnapshot.of(self.taker.take_rows(cid, step, saved))
        t_planned = time.perf_counter()
        self.tracker.remember(cid)
        if decision.full:
            self.tracker.mark_base()
        elif saved is not None:
            self.tracker.mark_saved(saved)
        else:
            self.tracker.mark_checkpoint()
        dense = self.dense_capture() if self.env.rank == 0 else None
        if dense is not None:
            dense.update(restores=self.restores, lost_samples=self.lost_samples, step=step, **self.identity._asdict())
        weight_codec, optimizer_codec = c.codecs
        trainer_state = c.trainer_state
        if self.priority is not None:
            trainer_state["priority"] = self._priority_accounting(decision.full, saved, int(trainer_state["samples_seen"]))
        release()  # bitmaps, priority counters and dense state are free again; no row has changed yet
        t_released = time.perf_counter()
        maybe_slow_copy(cid, "rows")
        snapshot = planned.copy()
        maybe_die("snapshot", cid, self.env.rank)
        t_copied = time.perf_counter()
        waited = blocked()
        snapshot.stall_s = handoff_s + waited
        timing = StallTiming(
            checkpoint_id=cid,
            step=step,
            full=decision.full,
            agree_ms=c.agree_ms,
            take_ms=(t_planned - t_take + t_copied - t_released) * 1e3,
            dense_ms=(t_released - t_planned) * 1e3,
            stall_ms=snapshot.stall_s * 1e3,
            rows=snapshot.rows,
            snapshot_bytes=snapshot.nbytes,
            since_base=c.fractions[0],
            since_last=c.fractions[1],
            cpu_ms=cpu_s * 1e3,
            new_bytes=snapshot.new_bytes,
            overlapped=c.overlapped,
            wait_ms=waited * 1e3 if c.overlapped else 0.0,
        )
        self.writer.submit(
            WriteJob(
                checkpoint_id=cid,
                step=step,
                generation=c.generation,
                chain=c.chain,
                snapshot=snapshot,
                trainer_state=trainer_state,
                dense_state=dense,
                weight_codec=weight_codec,
                optimizer_codec=optimizer_codec,
                epoch=self.epoch,
            )
        )
        return timing

    def _priority_accounting(self, full: bool, saved: list[torch.Tensor] | None, samples_seen: int) -> dict[str, int]:
        """After a checkpoint's marks: restart the counters it saved, and what a restore of the
        chain so far would lose on this rank (kept with the rank's loop state, ckpt/recovery/partial.py)."""
        assert self.priority is not None
        if full:
            self.priority.full()
            self._since_full, self._full_samples = 0, samples_seen
        elif saved is not None:
            self.priority.saved(saved)
            self._since_full += 1
        return {**self.priority.accounting(self.tracker.changed_since_last()), "full_samples_seen": self._full_samples}

    # -- partial recovery -------------------------------------------------------------------
    def save_survivor(self, loop_state: dict[str, Any]) -> SurvivorRecord | None:
        """Another rank died: under `ckpt.recovery: partial` save this rank's rows changed since
        the newest checkpoint it knows committed, its dense and loop state (`loop_state`: as of
        its last completed step) within `ckpt.survivor_timeout_s` (ckpt/recovery/survivor.py). None when
        there is nothing a restore could use: full recovery, or no committed checkpoint yet."""
        if self.c.recovery != "partial" or not self.epoch:
            return None
        self._settle()  # a copy the failed step left in flight (no row changed since its checkpoint step)
        self._collect()  # outcomes the writer decided since the last step: the newest base there is
        if not self.last_committed:
            return None
        deadline = time.monotonic() + self.c.survivor_timeout_s
        step, sid = int(loop_state["step"]), self.next_id
        rows = [self.tracker.since_committed_rows(i) for i in range(len(self.shard_map.shards))]
        snapshot = self.taker.take_rows(sid, step, rows)
        weight_codec, optimizer_codec = self.codecs()
        job = WriteJob(
            checkpoint_id=sid,
            step=step,
            generation=sid,
            chain=[],
            snapshot=snapshot,
            trainer_state=loop_state,
            weight_codec=weight_codec,
            optimizer_codec=optimizer_codec,
            epoch=self.epoch,
        )
        dense = self.dense_capture()
        dense.update(
            restores=self.restores, lost_samples=self.lost_samples, step=step, trainer=loop_state, **self.identity._asdict()
        )
        shards = [[s.table, s.row_offset, s.num_rows, s.col_offset, s.num_cols] for s in self.shard_map.shards]
        return save_survivor(
            self.c,
            rank=self.env.rank,
            job=job,
            attempt=self.attempt,
            world_size=self.env.world_size,
            base=self.last_committed,
            dense_state=dense,
            shards=shards,
            deadline=deadline,
        )

    def codecs(self) -> tuple[str, str]:
        """(weight codec, optimizer codec) for the next checkpoint: `ckpt.encoding`, or the bit
        width `ckpt.restore_bit_widths` (deltarec's table by default) gives for
        `ckpt.expected_restores`, which falls back to 8 bits once the job has restored more
        often than expected."""
        if self.c.expected_restores <= 0:
            return self.c.encoding, self.c.optimizer_encoding
        policy = BitWidthPolicy(
            expected_restores=self.c.expected_restores, restores_so_far=self.restores, widths=self.c.bit_widths()
        )
        return policy.weight_codec(), policy.optimizer_codec()
