"""A restore on start (docs/design/restore.md, docs/design/failures.md): the checkpoint `ckpt.restore.resume` names, under
`ckpt.recovery.mode: partial` with the survivor snapshots a failed attempt left (ckpt/recovery/partial.py).

`Restorer.restore` replays the chosen chain into the shards (and the id mappings of the
managed-collision shards into their modules: ckpt/restore/mapping.py, moved to this world size
when the chain's writers had another), loads the dense and loop
state and marks the restored rows in the tracker, then returns what the rest of the job takes
over: a `Resumed` record (or `Fresh` when there is nothing to resume). The checkpointer adopts
it; nothing here sets another component's fields.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from ckpt.capture.tracker import RowTracker
from ckpt.config import RestoreConfig
from ckpt.dense import state as dense_state
from ckpt.dense.store import DenseRef, DenseStore, DenseStoreError
from ckpt.events import MetricsSink, PartialRestore, Restored
from ckpt.log.backend import Backend
from ckpt.log.catalog import Catalog
from ckpt.log.markers import ChainLink, Marker, SurvivorRecord
from ckpt.recovery.lost_samples import run_pls
from ckpt.recovery.partial import PartialOutcome, SkipsBatches, compose, shared_reader, with_survivors
from ckpt.restore.choice import ResumeChoice
from ckpt.restore.mapping import check_mapping
from ckpt.restore.replay import RowsRestored, restore_rows, row_init_of
from ckpt.stream.frames import FrameError
from ckpt.stream.sink import SourceError
from ckpt.types import RestoreError
from sharding.dmp import ShardedModel
from sharding.managed_collision import ManagedCollisionError, McShard, McState, load
from sharding.process_group import DistEnv
from sharding.row_init import RowInit
from sharding.shard_views import ShardMap

logger = logging.getLogger(__name__)


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
    read_ahead: int = 0  # ranks whose frames were being fetched before `restore()` (frames_ahead.py)
    dense_ahead: int = 0  # ranks that took the dense state loaded before `restore()` (ckpt/dense/ahead.py)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def parts(self) -> str:
        """Where the time went, for the resume line."""
        regen = f", regenerate {self.init_s:.2f} s" if self.regenerated else ""
        ahead = f" (+{self.markers_ahead_s:.2f} s read ahead)" if self.markers_ahead_s else ""
        early = f" (started ahead on {self.read_ahead} ranks)" if self.read_ahead else ""
        loaded = f" (loaded ahead on {self.dense_ahead} ranks)" if self.dense_ahead else ""
        return (
            f"markers {self.markers_s:.2f} s{ahead}, fetch {self.fetch_s:.2f} s{early}, decode {self.decode_s:.2f} s, "
            f"apply {self.apply_s:.2f} s{regen}, dense {self.dense_s:.2f} s{loaded}"
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
    read_ahead: int
    dense_ahead: int

    @classmethod
    def gather(cls, error: str, read: _Read | None, markers_s: float) -> _ReadStats:
        """All ranks at once (one all-gather): whether any failed (`error`), and their stats."""
        r = read.rows if read is not None else RowsRestored()
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
                r.read_ahead,
                float(read is not None and read.dense_ahead),
            ],
            dtype=torch.float64,
        )
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        t = torch.stack(every)
        sums, maxes = t.sum(0).tolist(), t.max(0).values.tolist()
        frames, n_rows, nbytes, written, regenerated, read_ahead, dense_ahead = (int(sums[i]) for i in (1, 2, 3, 4, 5, 11, 12))
        markers_s, fetch_s, decode_s, apply_s, init_s = maxes[6:11]
        return cls(
            maxes[0] > 0,
            frames,
            n_rows,
            nbytes,
            written,
            regenerated,
            markers_s,
            fetch_s,
            decode_s,
            apply_s,
            init_s,
            read_ahead,
            dense_ahead,
        )


class _Read(NamedTuple):
    """One checkpoint read on this rank (`Restorer._read`)."""

    rows: RowsRestored
    state: dict[str, Any]  # the dense state to load
    partial: PartialOutcome | None  # a partial recovery's outcome
    skips: list[int]  # per rank: the batches its reader skips (a partial recovery)
    dense_ahead: bool  # the dense state was the one loaded while the model was built


@dataclass(frozen=True)
class Fresh:
    """Nothing to resume: the job trains from step 0."""

    next_id: int  # checkpoint ids continue after every id the stream or the run directory has seen


@dataclass(frozen=True)
class Resumed:
    """What a restore brought back that the checkpointer and its collaborators take over."""

    report: RestoreReport
    links: list[ChainLink]  # the restored chain: the committed links the next checkpoints build on
    next_id: int
    generation: int  # the generation the next delta goes on in; 0: the next checkpoint opens one
    force_full: bool  # the next checkpoint is full
    have_base: bool  # the restored chain is the baseline the next delta builds on (`ckpt.schedule.policy: incremental`)
    row_init: RowInit | None  # the chain's row initialisation, now the job's (untrained rows regenerated); None: unchanged
    restores: int  # the job's restores so far, this one included
    lost_samples: float  # samples whose updates partial recoveries lost, over the run
    # this rank's managed-collision shards' id mappings as restored and loaded, by table key: the
    # state the next checkpoint's mapping records start from
    mapping: dict[str, McState] = field(default_factory=dict)
    # the managed-collision tables whose ids and rows moved from the chain's world size to this
    # job's (the same on every rank): their rows and mappings sit elsewhere than the chain put
    # them, so the next checkpoint is full (`force_full`) and nothing is a delta of the chain
    resharded: tuple[str, ...] = ()

    @property
    def chain(self) -> list[int]:
        """The restored chain's checkpoint ids."""
        return self.report.chain

    @property
    def checkpoint_id(self) -> int:
        """The restored checkpoint: the newest one this job knows committed."""
        return self.report.checkpoint_id

    @property
    def step(self) -> int:
        """The restored checkpoint's step."""
        return self.report.step


def check_tables(marker: Marker, model: dict[str, tuple[int, int]]) -> None:
    """Refuse, naming the first table that differs, a checkpoint whose tables (by key:
    sharding/shard_views.py) are not the model's: one missing on either side, or another row
    count or width. Not damage: an older checkpoint of the run would not match either."""
    if not marker.tables:  # written before markers carried table shapes
        return
    saved = {k: (int(rows), int(dim)) for k, (rows, dim) in marker.tables.items()}
    where = f"checkpoint {marker.checkpoint_id} of run {marker.run_id}"
    for key in sorted(model.keys() | saved.keys()):
        if key not in saved:
            raise RestoreError(f"{where} has no table {key}, which the model has (its tables: {', '.join(sorted(saved))})")
        if key not in model:
            raise RestoreError(f"{where} holds table {key}, which the model does not have (was it renamed or moved?)")
        if saved[key] != model[key]:
            (r0, d0), (r1, d1) = saved[key], model[key]
            raise RestoreError(f"table {key}: {where} has {r0} rows x {d0} columns, the model {r1} x {d1}")


def _moved_tables(marker: Marker, world_size: int) -> tuple[str, ...]:
    """The managed-collision tables (those whose base holds an id mapping) whose ids move because
    the chain was written by another world size than `world_size`."""
    if marker.world_size == world_size or not marker.chain:
        return ()
    return tuple(sorted({e.table for e in marker.chain[0].index if e.is_mapping}))


class Restorer:
    """Brings back one rank's shards, dense state and loop position, agreed by every rank."""

    def __init__(
        self,
        cfg: RestoreConfig,
        *,
        run_id: str,
        incremental: bool,
        regenerate: bool,
        env: DistEnv,
        backend: Backend,
        dense: DenseStore,
        choice: ResumeChoice,
        sharded: ShardedModel,
        shard_map: ShardMap,
        tracker: RowTracker,
        trainer: Stateful,
        metrics: MetricsSink,
        model_sha256: str,
        mc_shards: Sequence[McShard] = (),
    ) -> None:
        assert run_id
        self.cfg = cfg
        self.env = env
        self.run_id = run_id
        self.incremental = incremental  # `ckpt.schedule.policy: incremental`: the chain rebases
        self.regenerate = regenerate  # `ckpt.capture.untrained_rows: regenerate`
        self.backend, self.dense, self.choice = backend, dense, choice
        self.sharded, self.shard_map, self.tracker = sharded, shard_map, tracker
        self.trainer = trainer
        self.metrics = metrics
        self.model_sha256 = model_sha256
        self.mc_shards = list(mc_shards)  # this rank's managed-collision shards: their id mappings are restored too

    def restore(self, announce: Callable[[Catalog, int], None], shards_hold: RowInit | None) -> Resumed | Fresh:
        """Bring back the checkpoint `ckpt.restore.resume` names, or start fresh when there is none.

        Rank 0 calls `announce` once the checkpoint is chosen, with the log read and the id
        chosen (0: none; ckpt/restore/attempt.py). A fallback to an older checkpoint (below) is
        not announced again: the record names the one chosen first. `shards_hold`: the row
        initialisation the shards hold untouched (none written since the model was built).
        A damaged checkpoint (bad CRC, a frame that does not match its marker, missing data,
        a dense file with the wrong sha256) stops the job naming where, or with
        `ckpt.restore.on_corrupt: previous` falls back to the newest older one. Every rank agrees
        on the outcome before anyone falls back, so all restore the same checkpoint.
        """
        t0 = time.perf_counter()
        candidates = self.choice.newest(announce)
        markers_s = time.perf_counter() - t0
        if self.cfg.resume == "none":
            return self._fresh()
        if not candidates:  # `resume=latest` of a run without history (`ResumeChoice` refused the rest)
            if self.env.rank == 0:
                logger.info("no checkpoint of run %s in %s: starting from scratch", self.run_id, self.backend.where)
            return self._fresh()
        check_tables(candidates[0], self.shard_map.shapes())  # before any row is written
        check_mapping(candidates[0], self._managed(), self.env.world_size)
        pristine = shards_hold  # the shards hold exactly these initial values until a restore writes
        for marker, survivors in self.choice.tries(candidates[0]):
            error = ""
            try:
                read = self._read(marker, survivors, pristine)
            except (FrameError, SourceError, RestoreError, DenseStoreError) as exc:
                error = f"checkpoint {marker.checkpoint_id}{' with survivor snapshots' if survivors else ''}: {exc}"
            pristine = None
            stats = _ReadStats.gather(error, None if error else read, markers_s)
            if not stats.failed:
                return self._resume(marker, read, t0, stats)
            reason = self._first_error(error)
            if survivors:
                logger.warning("%s; every rank rolls back to the checkpoint instead (full recovery)", reason)
                continue
            if self.cfg.on_corrupt == "fail":
                raise RestoreError(reason + " (set ckpt.restore.on_corrupt=previous to fall back to an older checkpoint)")
            logger.warning("%s; falling back to the previous checkpoint", reason)
        raise RestoreError(f"no restorable checkpoint of run {self.run_id} in {self.backend.where}")

    def _fresh(self) -> Fresh:
        """Train from step 0 with checkpoint ids after every id the stream or the run directory
        has seen, so nothing earlier is overwritten."""
        next_id = self.choice.newest_id + 1
        if self.env.rank == 0 and next_id > 1:
            logger.info("run %s starts over; its checkpoint ids continue from %d (earlier files are kept)", self.run_id, next_id)
        return Fresh(next_id)

    def _read(self, marker: Marker, survivors: list[SurvivorRecord], pristine: RowInit | None) -> _Read:
        """Replay `marker`'s chain (and the survivors' links after it) into the shards and read
        the dense state beside the rows: the state to load, and for a partial recovery its
        outcome and the batches each rank's reader skips."""
        refs = {None: DenseRef.from_json(marker.dense)} | {r.rank: DenseRef.from_json(r.dense) for r in survivors}
        loaded = self._dense_loaded_ahead(refs[None])
        with ThreadPoolExecutor(2, thread_name_prefix="deltarec-dense-read") as pool:
            dense: dict[int | None, Future[dict[str, Any]]] = {}
            to_read = {rank: ref for rank, ref in refs.items() if rank is not None or loaded is None}

            def read_dense() -> None:  # beside the rows, once their first fetch is under way
                dense.update({rank: pool.submit(self.dense.read, ref) for rank, ref in to_read.items()})

            chain = with_survivors(marker, survivors) if survivors else marker
            check_mapping(chain, self._managed(), self.env.world_size)  # an older checkpoint's too
            rows = restore_rows(
                chain,
                self.backend.source,
                self.shard_map,
                self.run_id,
                self.backend.locate,
                shards_hold_init=pristine,
                while_fetching=read_dense,
                mc_shards=self.mc_shards,
                world_size=self.env.world_size,
            )
            self._load_mapping(rows)
            state = loaded if loaded is not None else dense.pop(None).result()
            if not survivors:
                return _Read(rows, state, None, [], loaded is not None)
            state, skips, partial = compose(
                marker,
                survivors,
                state,
                {r: f.result() for r, f in dense.items() if r is not None},
                world_now=self.env.world_size,
            )
            return _Read(rows, state, partial, skips, loaded is not None)

    def _managed(self) -> dict[str, int]:
        """Rows of each managed-collision table of the model, by key."""
        shapes = self.shard_map.shapes()
        return {s.key: shapes[s.key][0] for s in self.mc_shards}

    def _load_mapping(self, rows: RowsRestored) -> None:
        """The restored id mappings into the live managed-collision modules, after their rows
        and before the ranks agree on the outcome: a mapping that does not fit fails this try
        on every rank."""
        for shard in self.mc_shards:
            try:
                load(shard, rows.mapping[shard.key])
            except ManagedCollisionError as exc:
                raise RestoreError(f"table {shard.key}: the restored id mapping does not fit this job's module: {exc}") from None

    def _dense_loaded_ahead(self, ref: DenseRef) -> dict[str, Any] | None:
        """The dense state the job loaded while it built its model (ckpt/dense/ahead.py) when it
        is `ref`'s; taken once: a fallback to an older checkpoint reads its own."""
        ahead, self.backend.dense_ahead = self.backend.dense_ahead, None
        return ahead.take(ref) if ahead is not None else None

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

    def _resume(self, marker: Marker, read: _Read, t0: float, stats: _ReadStats) -> Resumed:
        """Load what every rank read, and say what the job takes over from it."""
        t_dense = time.perf_counter()
        row_init = self._load(marker, read)
        incremental = self.incremental
        restores = int(read.state.get("restores", 0)) + 1
        lost_samples = float(read.state.get("lost_samples", 0.0))
        now = time.perf_counter()
        slowest = torch.tensor([now - t0, now - t_dense], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds, dense_s = slowest.tolist()
        report = RestoreReport(
            checkpoint_id=marker.checkpoint_id,
            step=marker.step,
            chain=[link.checkpoint_id for link in marker.chain],
            frames=stats.frames,
            rows=stats.rows,
            bytes=stats.bytes,
            seconds=seconds,
            written=stats.written,
            markers_s=stats.markers_s,
            fetch_s=stats.fetch_s,
            decode_s=stats.decode_s,
            apply_s=stats.apply_s,
            dense_s=dense_s,
            regenerated=stats.regenerated,
            init_s=stats.init_s,
            partial=read.partial,
            # a loop without `samples_seen` runs full recovery only (ckpt/checkpointer.py), which loses none
            run_pls=run_pls(lost_samples, float(read.state["trainers"][0].get("samples_seen", 0))),
            markers_read=self.choice.markers_read,
            markers_ahead_s=self.choice.markers_ahead_s,
            read_ahead=stats.read_ahead,
            dense_ahead=stats.dense_ahead,
        )
        # the same on every rank (a rank may hold no shard of such a table)
        moved = _moved_tables(marker, self.env.world_size)
        if self.env.rank == 0:
            self._announce_report(report)
            if moved:
                logger.info(
                    "the id mappings of managed-collision tables %s moved from %d to %d ranks; the next checkpoint is full",
                    ", ".join(moved),
                    marker.world_size,
                    self.env.world_size,
                )
        return Resumed(
            report=report,
            links=list(marker.chain),
            next_id=max(marker.checkpoint_id, self.choice.newest_id) + 1,
            # The live rows are exactly what the chain restores, so under `incremental` the rows
            # changed from here on are a delta of it: the chain goes on, in a generation the next
            # checkpoint opens (this job may have another world size, so other partitions). Else
            # the tracker's history since the base died with the old process: the next is full,
            # and after a partial recovery too (no committed checkpoint holds the survivors' rows).
            # After managed-collision ids moved to this world size, their rows and mappings are
            # no longer where the chain holds them: the next checkpoint is full, of the new layout.
            generation=0 if incremental else marker.chain[0].generation,
            force_full=not incremental or read.partial is not None or bool(moved),
            have_base=incremental and not moved,
            row_init=row_init,
            restores=restores,
            lost_samples=lost_samples,
            mapping=dict(read.rows.mapping),
            resharded=moved,
        )

    def _load(self, marker: Marker, read: _Read) -> RowInit | None:
        """The dense state and this rank's loop state into the model and the loop, the restored
        rows into the tracker; the chain's row initialisation when the job adopts it."""
        state = read.state
        if self.env.rank == 0 and state.get("model_sha256") not in (None, self.model_sha256):
            logger.warning(
                "checkpoint %d was written with another model config (sha256 %s…, now %s…); restoring what matches",
                marker.checkpoint_id,
                str(state["model_sha256"])[:12],
                self.model_sha256[:12],
            )
        dense_state.load(self.sharded, state)
        self.trainer.load_state_dict(self._trainer_state(state, marker))
        row_init = self._mark_rows(marker, read.rows)
        if read.partial is not None:
            self._mark_partial(marker, read.rows, read.skips)
        return row_init

    def _mark_rows(self, marker: Marker, rows: RowsRestored) -> RowInit | None:
        """The restored rows become the rows trained so far, and the untrained ones follow the
        chain's row initialisation from here on (returned; the next markers name it, unless
        `ckpt.capture.untrained_rows=store`): a chain without one stored every row, so every row
        counts as trained."""
        assert rows.held is not None
        self.tracker.load_trained(rows.held)
        chain_init = row_init_of(marker)
        if chain_init is not None and self.regenerate:
            return chain_init
        return None

    def _mark_partial(self, marker: Marker, rows: RowsRestored, skips: Sequence[int]) -> None:
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

    def _trainer_state(self, state: dict[str, Any], marker: Marker) -> dict[str, Any]:
        """This rank's loop state; reader state carries over to another world size only
        when every rank's was the same (the synthetic stream's global position)."""
        trainers = state["trainers"]
        if len(trainers) == self.env.world_size:
            return trainers[self.env.rank]
        return shared_reader(trainers, marker, f" (e.g. Criteo line ranges); resume it with {len(trainers)} ranks")

    def _announce_report(self, report: RestoreReport) -> None:
        """Rank 0: the restore in the log and in metrics (the trainer prints the resume line)."""
        logger.debug(
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
            Restored(
                step=report.step,
                restored_ckpt=report.checkpoint_id,
                restore_s=report.seconds,
                restore_bytes=report.bytes,
                restore_chain=tuple(report.chain),
                restore_rows_written=report.written,
                restore_markers_s=report.markers_s,
                restore_markers_records=report.markers_read,
                restore_markers_ahead_s=report.markers_ahead_s,
                restore_read_ahead_ranks=report.read_ahead,
                restore_dense_ahead_ranks=report.dense_ahead,
                restore_fetch_s=report.fetch_s,
                restore_decode_s=report.decode_s,
                restore_apply_s=report.apply_s,
                restore_dense_s=report.dense_s,
                restore_regenerated_rows=report.regenerated,
                restore_regenerate_s=report.init_s,
                run_pls=report.run_pls,
            )
        )
        partial = report.partial
        if partial is not None:
            self.metrics.write(
                PartialRestore(
                    step=partial.step,
                    partial_kept_ranks=tuple(partial.kept),
                    partial_rolled_back_ranks=tuple(partial.rolled_back),
                    partial_rolled_back_fraction=partial.rolled_back_fraction,
                    partial_rolled_back_tables=dict(partial.rolled_back_tables),
                    partial_samples_since_ckpt=partial.samples_since,
                    partial_lost_samples=partial.lost_samples,
                    partial_waiting_lost=partial.waiting_lost,
                    run_pls=report.run_pls,
                )
            )
