"""The checkpoint manager: decides when and what to checkpoint, and hands the work on.

The trainer calls `save(step)` after every step and `finish(step)` at the end; on start
`restore()` brings back the newest (or a chosen) checkpoint (ckpt/restore/restorer.py), under
`ckpt.recovery: partial` with the survivor snapshots a failed attempt left (ckpt/recovery/partial.py),
which a surviving rank writes with `save_survivor` (ckpt/recovery/survivor.py). At a checkpoint
step the training thread: agrees with the other ranks on the checkpoint's kind (small
all-reduces of row counts and flags, started at the end of the step before; never a wait on
Kafka; ckpt/schedule.py), copies the chosen rows and the dense state to host memory, and hands
them to its writer thread (ckpt/handoff.py). On CPU the copy runs beside the next step, whose
first lookup waits for the tracker's marks and whose backward pass waits for the rows
(`ckpt.overlap_copy`, ckpt/capture/overlapped_copy.py); the stall is the hand-off plus those waits.
Outcomes come back asynchronously and are logged, counted and written to metrics; a
failed checkpoint makes the next one full.
"""

from __future__ import annotations

import copy
import logging
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from ckpt.capture.host_buffers import HostBufferPool
from ckpt.capture.overlapped_copy import CopyBehind
from ckpt.capture.snapshot import SnapshotTaker
from ckpt.capture.tracker import RowTracker
from ckpt.checkpoint_policy import CheckpointPolicy
from ckpt.config import CkptConfig
from ckpt.dense import state as dense_state
from ckpt.dense.store import DenseStore
from ckpt.events import MetricsSink
from ckpt.faults import maybe_die
from ckpt.handoff import CopyOrder, Handoff, JobIdentity, StallTiming
from ckpt.log.backend import Backend, open_for_restore
from ckpt.log.markers import SurvivorRecord
from ckpt.outcomes import CheckpointStats, Outcomes
from ckpt.quant import BitWidthPolicy, warm_up_codecs
from ckpt.recovery.priority import RowPriority
from ckpt.recovery.survivor import save_survivor
from ckpt.restore import kernel as restore_kernel
from ckpt.restore.attempt import Attempt
from ckpt.restore.choice import ResumeChoice
from ckpt.restore.restorer import Fresh, Restorer, RestoreReport, Resumed
from ckpt.schedule import Schedule, interval_for_target_pls
from ckpt.write.committer import Committer
from ckpt.write.writer import Outcome, RankWriter, WriteJob
from common.errors import ConfigError
from sharding.dmp import ShardedModel
from sharding.process_group import DistEnv
from sharding.shard_views import ShardMap

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Continuous checkpoints for one rank of a running job.

    It reads only its own config section (`cfg`, resolved: run id and directories filled)
    and the model (its tables are found in it: sharding/shard_views.py); the loop it
    checkpoints is any `Stateful` whose state dict holds this rank's loop position (`step`,
    and for deltarec's loop `reader`, the data reader's state). Built by `ckpt.Checkpointer`.
    """

    def __init__(
        self,
        cfg: CkptConfig,
        *,
        identity: JobIdentity,
        env: DistEnv,
        device: torch.device,
        sharded: ShardedModel,
        trainer: Stateful,
        metrics: MetricsSink,
        backend: Backend | None = None,
        shard_map: ShardMap | None = None,
    ) -> None:
        assert cfg.run_id and cfg.dense_dir, "CkptConfig.resolved() fills the run id and directories"
        self.cfg = cfg
        self.identity = identity
        self.env = env
        self.sharded = sharded
        self.trainer = trainer
        self.metrics = metrics
        self.run_id = cfg.run_id
        # Writers coordinate on their own gloo group so the training thread's collectives
        # and theirs never interleave (see ckpt/write/writer.py).
        self.group = dist.new_group(backend="gloo")
        self.shard_map = shard_map if shard_map is not None else ShardMap.from_model(sharded.model)
        self.tracker = RowTracker(self.shard_map)
        # With a row initialisation the untrained rows need not be stored (sharding/row_init.py):
        # full checkpoints hold the rows trained since, and markers say how to regenerate the rest.
        self.row_init = sharded.row_init
        regenerate = self.row_init is not None and cfg.untrained_rows == "regenerate"
        # snapshots reuse the memory of written ones, within the pending-snapshot budget (pinned
        # for GPU shards, whose copies to host are asynchronous); copy-on-write copies none (and
        # the taker refuses it for GPU shards)
        pool = None
        if not cfg.copy_on_write:
            pool = HostBufferPool(cfg.max_pending_bytes, nice=cfg.writer_nice, pin_for=torch.device(device))
        self.taker = SnapshotTaker(
            self.shard_map,
            self.tracker,
            device,
            trained_only=regenerate,
            pool=pool,
            encode_on=cfg.encode_on,
            copy_on_write=cfg.copy_on_write,
        )
        self.full_bytes = self.taker.upper_bound_bytes()  # fixed by the plan
        self.policy = CheckpointPolicy(cfg.policy)
        # a restore comes next: its readers connect while the rest is built (or, given by the
        # job, while its model was built)
        self.backend: Backend = backend if backend is not None else open_for_restore(cfg, env.world_size, env.rank)
        self.dense = DenseStore(Path(cfg.dense_dir))
        self.dense_capture = dense_state.DenseCapture(sharded)  # rank 0's stall; any rank's survivor
        self.committer = self._make_committer() if env.rank == 0 else None
        self.writer = RankWriter(
            run_id=self.run_id,
            rank=env.rank,
            sink=self.backend.sink,
            group=self.group,
            max_frame_bytes=cfg.max_frame_bytes,
            flush_timeout_s=cfg.flush_timeout_s,
            committer=self.committer,
            nice=cfg.writer_nice,
        )
        self.next_id = 1
        self.generation = 0
        self.chain: list[int] = []
        self.force_full = False
        self.total_rows = sum(s.num_rows for s in self.shard_map.shards)
        self.outcomes = Outcomes(metrics)
        self.stats: CheckpointStats = self.outcomes.stats
        self.restores = 0  # restores of this job so far (persisted in the dense state)
        self.attempt = Attempt(self.backend, self.run_id, env.world_size, self.committer)  # its epoch: in every frame
        self.last_committed = 0  # the newest checkpoint this rank knows committed (restored or written)
        self.lost_samples = 0.0  # samples whose updates partial recoveries lost, over the run (ckpt/recovery/lost_samples.py)
        self.choice = ResumeChoice(cfg, self.backend, self.dense)  # what `restore` reads, agreed by every rank
        if cfg.recovery == "partial":
            self.tracker.keep_uncommitted()
        self.priority = self._make_priority()
        self.schedule, self.handoff = self._make_schedule(), self._make_handoff()
        self.copier: CopyBehind[StallTiming] = CopyBehind()  # a checkpoint's copy beside the next step
        warm_up_codecs([self.codecs()[0]])  # before training, not in the first checkpoint's write
        if cfg.resume != "none":
            restore_kernel.load()  # the restore's fused replay: compiled or loaded now, not in the restore
        if self.full_bytes > cfg.max_pending_bytes:
            raise ConfigError(
                f"ckpt.max_pending_bytes={cfg.max_pending_bytes} is smaller than one full snapshot of this "
                f"rank ({self.full_bytes} bytes): raise it, or no full checkpoint could ever be taken"
            )

    def _make_committer(self) -> Committer:
        """Rank 0's committer: dense files and markers (ckpt/write/committer.py)."""
        return Committer(
            run_id=self.run_id,
            markers=self.backend.markers,
            dense=self.dense,
            marker_fields=self._marker_fields(),
            rebase=self.cfg.policy == "incremental",
            where=self.backend.where,
            catalog_every=self.cfg.catalog_every,
            connect_timeout_s=self.cfg.connect_timeout_s,
        )

    def _make_schedule(self) -> Schedule:
        """When checkpoints are due and which kind every rank agrees on (ckpt/schedule.py)."""
        return Schedule(
            self.cfg,
            tracker=self.tracker,
            taker=self.taker,
            policy=self.policy,
            writer=self.writer,
            total_rows=self.total_rows,
            full_bytes=self.full_bytes,
            wants_full=self._wants_full,
            prioritized=self.priority is not None,
        )

    def _make_handoff(self) -> Handoff:
        """Each checkpoint's copy and hand-off to the writer (ckpt/handoff.py)."""
        return Handoff(
            self.cfg,
            rank=self.env.rank,
            identity=self.identity,
            taker=self.taker,
            tracker=self.tracker,
            priority=self.priority,
            dense_capture=self.dense_capture,
            writer=self.writer,
            full_bytes=self.full_bytes,
        )

    def _make_priority(self) -> RowPriority | None:
        """`ckpt.priority`'s row priorities (ckpt/recovery/priority.py), or None."""
        if self.cfg.priority == "none":
            return None
        return RowPriority(
            self.tracker,
            self.taker.row_bytes,
            self.cfg.priority,
            sample=self.cfg.ssu_sample,
            seed=zlib.crc32(f"{self.run_id}:{self.env.rank}".encode()),
        )

    def _marker_fields(self) -> dict[str, Any]:
        """What every marker of this job says of it: tables by key (docs/design/formats.md, "Table keys"), their plan."""
        tables = self.shard_map.table_info.values()
        return {
            "policy": self.cfg.policy,
            "world_size": self.env.world_size,
            "plan": {t.key: t.sharding_type for t in tables},
            "tables": {t.key: [t.num_embeddings, t.embedding_dim] for t in tables},
            "init": self.row_init.to_json() if self.row_init is not None and self.taker.trained_only else {},
        }

    # -- restore ------------------------------------------------------------------------
    def restore(self) -> RestoreReport | None:
        """Bring back the checkpoint `ckpt.resume` names (ckpt/restore/restorer.py); None when
        there is none to resume. Then, under partial recovery, every rank learns its attempt
        (a survivor's record names it), and `ckpt.target_pls` sets the interval."""
        restorer = Restorer(
            self.cfg,
            env=self.env,
            backend=self.backend,
            dense=self.dense,
            choice=self.choice,
            sharded=self.sharded,
            shard_map=self.shard_map,
            tracker=self.tracker,
            trainer=self.trainer,
            metrics=self.metrics,
            model_sha256=self.identity.model_sha256,
        )
        outcome = restorer.restore(self.attempt.announce, shards_hold=self.row_init)
        if isinstance(outcome, Fresh):
            self.next_id = outcome.next_id
        else:
            self._adopt(outcome)
        if self.cfg.recovery == "partial" and not self.attempt.epoch:
            self.attempt.join()
        if self.cfg.target_pls > 0:
            self.schedule.use_interval(interval_for_target_pls(self.cfg, self.shard_map, self.choice.mtbf_s, self.env.rank))
        return None if isinstance(outcome, Fresh) else outcome.report

    def _adopt(self, resumed: Resumed) -> None:
        """The manager and its collaborators take over what a restore brought back."""
        self.restores, self.lost_samples = resumed.restores, resumed.lost_samples
        self.last_committed = resumed.checkpoint_id
        self.next_id = resumed.next_id
        self.chain = resumed.chain
        self.generation = resumed.generation
        self.force_full = resumed.force_full
        if resumed.row_init is not None:
            self.row_init = resumed.row_init
            self.taker.adopt(trained_only=True)
        if self.committer is not None:
            self.committer.adopt(resumed.links, resumed.row_init)
        if resumed.have_base:
            self.policy.adopt_base()
        self.schedule.resumed_at(resumed.step)

    # -- save -----------------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Called after every training step; takes a checkpoint when one is due."""
        maybe_die("step", step, self.env.rank)
        self.wait_for_copy()  # done already: this step's backward pass waited for it
        self._record_outcomes()
        if self.schedule.due(step):
            self._checkpoint(step)
        if self.schedule.time_to_reserve(step):
            self.schedule.reserve_next(self.force_full, last_was_full=bool(self.stats.stalls) and self.stats.stalls[-1].full)
        self.schedule.look_ahead(step + 1)

    def finish(self, step: int) -> None:
        """Checkpoint the last step (ckpt.final), wait for every outcome, stop the writer."""
        self.wait_for_copy()
        if self.cfg.final:
            # every earlier outcome first: after a failure the last checkpoint must be one that
            # commits on its own (full), not a delta of a chain that can no longer commit; and
            # when the last step's own checkpoint failed, it is taken again, full
            self.writer.drain()
            self._record_outcomes()
            last = self.stats.last
            if self.schedule.last_step != step or (last is not None and not last.committed and last.step == step):
                self._checkpoint(step, final=True)
            self.wait_for_copy()
        self.copier.close()
        self.schedule.close()
        for outcome in self.writer.close():
            self._record(outcome)
        if self.env.rank == 0:
            self.outcomes.say_unwritten()
        if self.taker.pool is not None:
            self.taker.pool.close()
        self.backend.close()
        if self.env.rank == 0:
            logger.debug(  # the trainer prints the summary line
                "checkpoints: %d committed, %d failed, %d skipped", self.stats.committed, self.stats.failed, self.stats.skipped
            )

    def _record_outcomes(self) -> None:
        """Record the outcomes the writer decided since the last look (never blocks)."""
        for outcome in self.writer.poll():
            self._record(outcome)

    def _wants_full(self) -> bool:
        """Whether this rank asks for a full checkpoint, as an agreement starts: after a failed
        checkpoint or a restore, or (prioritized checkpoints) the full one that saves what
        prioritized ones left waiting, every `ckpt.priority_full_every` checkpoints."""
        if self.priority is not None and self.handoff.since_full + 1 >= self.cfg.priority_full_every:
            self.force_full = True
        return self.force_full

    def _checkpoint(self, step: int, final: bool = False) -> None:
        """Take the checkpoint of `step`: agree, copy (the stall), hand to the writer.
        Under back-pressure `skip` drops it (reported), `wait` blocks; the final one waits.
        Its callers have waited for the previous checkpoint's copy (`wait_for_copy`)."""
        assert not self.copier.busy, "the previous checkpoint's copy is still running"
        if not self.attempt.epoch:
            self.attempt.join()
        started_unix, t0, cpu0 = time.time(), time.perf_counter(), time.thread_time()
        agreed = self.schedule.agree(step)
        t_agreed = time.perf_counter()
        decision = agreed.decision
        if agreed.behind and not final:  # its rows go into the next checkpoint taken
            self.outcomes.coalesced(step, self.env.rank)
            return
        if agreed.overflow[decision.kind] and self.cfg.on_backpressure == "skip" and not final:
            self.outcomes.skipped(step, self.env.rank)
            return
        if self.writer.pending_bytes:  # the agreed counts are a step old: the bound uses this step's
            need = self.taker.estimate_bytes(decision.full, decision.since_base)
            self.writer.wait_for_room(need, self.cfg.max_pending_bytes)
        self.schedule.took(step)
        cid = self.next_id
        self.next_id += 1
        if decision.full or not self.generation:
            self.generation = cid  # a full checkpoint, or the first delta after a restore, opens one
        self.chain = self.policy.chain_after(self.chain, cid, decision)
        # this step's loop position, copied: the loop may change what its state dict refers to
        # before the writer serialises it
        trainer_state = copy.deepcopy(self.trainer.state_dict())
        self.policy.record(decision, agreed.fraction)
        self.force_full = self.force_full and not agreed.forced  # a request made after the agreement waits for the next
        codecs = self.codecs()
        self.outcomes.started(cid, started_unix, codecs[0])
        overlap = self._overlap()
        order = CopyOrder(
            checkpoint_id=cid,
            step=step,
            decision=decision,
            final=final,
            trainer_state=trainer_state,
            fractions=agreed.fractions,
            generation=self.generation,
            chain=list(self.chain),
            codecs=codecs,
            overlapped=overlap,
            agree_ms=(t_agreed - t0) * 1e3,
            epoch=self.attempt.epoch,
            restores=self.restores,
            lost_samples=self.lost_samples,
        )
        if overlap:
            handoff_s, handoff_cpu = time.perf_counter() - t0, time.thread_time() - cpu0
            self.copier.start(lambda finish, release: self.handoff.copy(order, handoff_s, finish, handoff_cpu, release))
            self.tracker.hold_next_lookup(self.copier.wait_released, self.wait_for_copy)
        else:
            timing = self.handoff.copy(order, 0.0, lambda: time.perf_counter() - t0, 0.0)
            self.stats.stalls.append(timing._replace(cpu_ms=(time.thread_time() - cpu0) * 1e3))

    def _overlap(self) -> bool:
        """Whether this checkpoint's copy runs beside the next step (ckpt/capture/overlapped_copy.py)."""
        return self.cfg.overlap_copy and self.taker.device.type == "cpu" and self.tracker.attached

    def wait_for_copy(self) -> None:
        """Wait for a checkpoint's copy still running beside training (`ckpt.overlap_copy`), if
        any, and record its stall: until then it reads the shards and changes the tracker's
        bitmaps. Every call that reads or changes the tracker, the taker or the writer's queue
        comes here first (the manager's own, a benchmark's between steps), and so does the next
        step's backward pass, before its embedding kernels could change a row."""
        timing = self.copier.wait()
        if timing is not None:
            self.stats.stalls.append(timing)

    def _record(self, o: Outcome) -> None:
        """One checkpoint's outcome: counted (a fenced one stops this attempt), logged and written
        to metrics on rank 0; a committed one is what a survivor builds on, a failed one makes
        the next checkpoint full."""
        pending = self.outcomes.count(o)
        if o.committed:
            self.last_committed = max(self.last_committed, o.checkpoint_id)
            self.tracker.committed(o.checkpoint_id)
            maybe_die("committed", o.checkpoint_id, self.env.rank)
        else:
            self.force_full = True
        if self.env.rank == 0:
            self.outcomes.report(o, pending)

    # -- partial recovery -------------------------------------------------------------------
    def save_survivor(self, loop_state: dict[str, Any]) -> SurvivorRecord | None:
        """Another rank died: under `ckpt.recovery: partial` save this rank's rows changed since
        the newest checkpoint it knows committed, its dense and loop state (`loop_state`: as of
        its last completed step) within `ckpt.survivor_timeout_s` (ckpt/recovery/survivor.py). None when
        there is nothing a restore could use: full recovery, or no committed checkpoint yet."""
        if self.cfg.recovery != "partial" or not self.attempt.epoch:
            return None
        self.wait_for_copy()  # a copy the failed step left in flight (no row changed since its checkpoint step)
        self._record_outcomes()  # outcomes the writer decided since the last step: the newest base there is
        if not self.last_committed:
            return None
        deadline = time.monotonic() + self.cfg.survivor_timeout_s
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
            epoch=self.attempt.epoch,
        )
        dense = self.dense_capture()
        dense.update(
            restores=self.restores, lost_samples=self.lost_samples, step=step, trainer=loop_state, **self.identity._asdict()
        )
        shards = [[s.table, s.row_offset, s.num_rows, s.col_offset, s.num_cols] for s in self.shard_map.shards]
        return save_survivor(
            self.cfg,
            rank=self.env.rank,
            job=job,
            attempt=self.attempt.id,
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
        if self.cfg.expected_restores <= 0:
            return self.cfg.encoding, self.cfg.optimizer_encoding
        policy = BitWidthPolicy(
            expected_restores=self.cfg.expected_restores, restores_so_far=self.restores, widths=self.cfg.bit_widths()
        )
        return policy.weight_codec(), policy.optimizer_codec()
