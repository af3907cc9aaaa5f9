"""deltarec in your own TorchRec training loop: `Checkpointer`, the public API.

    from ckpt import Checkpointer, load_ckpt_config

    cfg = load_ckpt_config("job.yaml")              # the `ckpt:` section, or CkptConfig(...) in code
    ckpt = Checkpointer(cfg, dmp, dense_optimizer=dense_opt, loop=loop, run_dir="runs/my_job")
    ckpt.restore()                                  # ckpt.restore.resume: latest | none | <checkpoint id>
    for step in range(loop.step + 1, steps + 1):
        train_one_batch()                           # forward, backward, dense_opt.step()
        loop.step = step
        ckpt.save(step)                             # a checkpoint when one is due; else next to nothing
    ckpt.close(loop.step)                           # also right when the loop body never ran

What it takes (docs/design/layers.md, "Your own loop"):

- `model`: a `DistributedModelParallel` whose sharded `EmbeddingBagCollection` and
  `EmbeddingCollection` modules may sit anywhere in the module tree, on any sharding type,
  their optimizer fused into the kernels (`apply_optimizer_in_backward`), and managed-collision
  ones (row-wise: their id-to-slot mapping is captured in the stall and written beside the
  rows, docs/design/managed-collision.md). Tables are addressed by their FQN in the unsharded
  model (sharding/shard_views.py).
- `dense_optimizer`: the optimizer of every other parameter (anything with `state_dict()` and
  `load_state_dict()`); its state travels with the dense parameters in rank 0's dense file.
- `loop`: a `Stateful` holding the rest of the loop: its state dict must hold `step` (the last
  completed step, an int); the data position, RNG and anything else the user adds ride along
  and come back through `load_state_dict` at restore. Partial recovery also needs an int
  `samples_seen` and a `skip_batches(n)` method (`check_loop`); a `reader` entry, when the
  loop has one, decides whether its state carries over to another world size
  (ckpt/recovery/partial.py, `shared_reader`).
- `row_init`: the `RowInit` the rows were initialised with (`initialise_rows`), which lets
  checkpoints leave out rows never trained (`ckpt.capture.untrained_rows=regenerate`); without it
  rows keep TorchRec's own initial values, so the first full checkpoint stores every row.

Refused at start, each with one line: a sharded module of another kind, a fused optimizer
whose state is not all in the rows, a loop whose state has no `step` or cannot be saved (or,
with partial recovery, lacks `samples_seen` or `skip_batches`), a dense optimizer without
`state_dict`/`load_state_dict`; at restore, a
checkpoint whose tables do not match the model's (ckpt/restore/replay.py).

One checkpoint, as the training thread takes it in `save(step)`: agree with the other ranks on
its kind (a small all-reduce of row counts and flags, started at the end of the step before;
never a wait on Kafka; ckpt/save/schedule.py), copy the chosen rows and the dense state to host
memory, and hand them to the writer thread (ckpt/save/handoff.py). On CPU the copy runs beside
the next step, whose first lookup waits for the tracker's marks and whose backward pass waits
for the rows (`ckpt.capture.overlap_copy`, ckpt/capture/overlapped_copy.py); the stall is the
hand-off plus those waits. Outcomes come back asynchronously and are logged, counted and
written to metrics (ckpt/save/outcomes.py); a failed checkpoint makes the next one full. The
stages are built by ckpt/build.py, each from its own config section; this class holds them and
the chain's state (`ChainState`).
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.profiler import record_function

from ckpt.build import (
    NoDenseState,
    Stages,
    build_stages,
    check_dense_optimizer,
    check_loop,
    check_optimizers,
    config_digest,
    device_of,
    dist_env,
    model_digest,
    resolve,
)
from ckpt.config import CkptConfig, EncodingConfig
from ckpt.events import MetricsLog, MetricsSink
from ckpt.faults import maybe_die
from ckpt.log.backend import Backend
from ckpt.log.markers import SurvivorRecord
from ckpt.quant import BitWidthPolicy, warm_up_codecs
from ckpt.recovery.survivor import save_survivor
from ckpt.restore.restorer import Fresh, Restorer, RestoreReport, Resumed
from ckpt.save.handoff import CopyOrder
from ckpt.save.outcomes import CheckpointStats
from ckpt.save.schedule import interval_for_target_pls
from ckpt.types import ChainState, JobIdentity
from ckpt.write.writer import Outcome, WriteJob
from sharding.dmp import ShardedModel
from sharding.managed_collision import mc_shards
from sharding.process_group import DistEnv
from sharding.row_init import RowInit
from sharding.shard_views import ShardMap, unwrapped

logger = logging.getLogger(__name__)


class Checkpointer:
    """Continuous checkpoints of a user's DMP model and loop, one per rank: `restore` once,
    `save` after every training step (torchtitan's `CheckpointManager.save` idiom), `close` at
    the end (module docstring); every rank makes the same calls.

    It reads its config section (`cfg`, resolved here: run id and directories filled from
    `run_dir`) and the model (its tables are found in it: sharding/shard_views.py); the loop it
    checkpoints is any `Stateful` whose state dict holds this rank's loop position (`step`, and
    for deltarec's loop `reader`, the data reader's state)."""

    def __init__(
        self,
        cfg: CkptConfig,
        model: nn.Module,
        *,
        dense_optimizer: Any,
        loop: Stateful,
        run_dir: str | Path | None = None,
        metrics: MetricsSink | None = None,
        row_init: RowInit | None = None,
        identity: JobIdentity | None = None,
        backend: Backend | None = None,
        env: DistEnv | None = None,
    ) -> None:
        self.env = env if env is not None else dist_env()
        self.cfg = resolve(cfg, run_dir)
        self.run_id = self.cfg.run_id
        if run_dir is not None and self.env.rank == 0:  # what `deltarec-ckpt --config <run_dir>/ckpt.yaml` reads
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / "ckpt.yaml").write_text(self.cfg.to_yaml())
        shard_map = ShardMap.from_model(model, managed_collision=True)
        check_optimizers(shard_map)
        check_loop(loop, partial=self.cfg.recovery.mode == "partial")
        check_dense_optimizer(dense_optimizer)
        if callable(getattr(dense_optimizer, "save_param_groups", None)):
            # a torchrec KeyedOptimizer leaves its param groups (the learning rate a scheduler
            # set) out of state_dict() unless told to keep them: a restore would lose them
            dense_optimizer.save_param_groups(True)
        self._own_metrics: MetricsLog | None = None
        if metrics is None:
            path = Path(self.cfg.sink.dense_dir).parent / "metrics.jsonl"
            self._own_metrics = MetricsLog(path, enabled=self.env.rank == 0)
            metrics = self._own_metrics
        self.metrics = metrics
        dense = NoDenseState() if dense_optimizer is None else dense_optimizer
        self.sharded = ShardedModel(model, None, getattr(model, "plan", None), row_init, dense_optimizer=dense)
        self.row_init = row_init
        if identity is None:
            identity = JobIdentity(config_digest(self.cfg), model_digest(shard_map, unwrapped(model)))
        self.identity = identity
        self.loop = loop
        self.stages: Stages = build_stages(
            self.cfg,
            identity=identity,
            env=self.env,
            device=device_of(shard_map, model),
            sharded=self.sharded,
            metrics=metrics,
            backend=backend,
            shard_map=shard_map,
            mc_shards=mc_shards(model) if shard_map.managed_collision else [],
            wants_full=self._wants_full,
        )
        self.chain = ChainState()
        warm_up_codecs([self.codecs()[0]])  # before training, not in the first checkpoint's write
        self._closed = False

    @property
    def stats(self) -> CheckpointStats:
        """Checkpoints committed, failed, skipped so far, with their stalls."""
        return self.stages.outcomes.stats

    # -- restore ------------------------------------------------------------------------
    def restore(self) -> RestoreReport | None:
        """Bring back the checkpoint `ckpt.restore.resume` names into the model, both optimizers
        and the loop (`loop.load_state_dict`; ckpt/restore/restorer.py); None when there is none
        (a fresh start). Call it once, before the first step, on every rank. Then, under partial
        recovery, every rank learns its attempt (a survivor's record names it), and
        `ckpt.recovery.target_pls` sets the interval."""
        st, cfg = self.stages, self.cfg
        restorer = Restorer(
            cfg.restore,
            run_id=self.run_id,
            incremental=cfg.schedule.policy == "incremental",
            regenerate=cfg.capture.untrained_rows == "regenerate",
            env=self.env,
            backend=st.backend,
            dense=st.dense,
            choice=st.choice,
            sharded=self.sharded,
            shard_map=st.shard_map,
            tracker=st.tracker,
            trainer=self.loop,
            metrics=self.metrics,
            model_sha256=self.identity.model_sha256,
            mc_shards=st.mapping.shards,
        )
        outcome = restorer.restore(st.attempt.announce, shards_hold=self.row_init)
        if isinstance(outcome, Fresh):
            self.chain.next_id = outcome.next_id
        else:
            self._adopt(outcome)
        if cfg.recovery.mode == "partial" and not st.attempt.epoch:
            st.attempt.join()
        if cfg.recovery.target_pls > 0:
            st.schedule.use_interval(interval_for_target_pls(cfg.recovery, st.shard_map, st.choice.mtbf_s, self.env.rank))
        return None if isinstance(outcome, Fresh) else outcome.report

    def _adopt(self, resumed: Resumed) -> None:
        """The chain's state and the stages take over what a restore brought back."""
        st = self.stages
        self.chain = ChainState(
            next_id=resumed.next_id,
            generation=resumed.generation,
            ids=resumed.chain,
            force_full=resumed.force_full,
            last_committed=resumed.checkpoint_id,
            restores=resumed.restores,
            lost_samples=resumed.lost_samples,
        )
        if st.mapping.shards:  # the loaded states: what the next capture and the next delta start from
            states = tuple(resumed.mapping[s.key] for s in st.mapping.shards)
            st.mapping.adopt(states)
            if not resumed.resharded:  # moved to another layout: no checkpoint holds these states
                st.writer.mapping.seed(resumed.checkpoint_id, states)
        if resumed.row_init is not None:
            self.row_init = resumed.row_init
            st.taker.adopt(trained_only=True)
        if st.committer is not None:
            st.committer.adopt(resumed.links, resumed.row_init, restored=resumed.checkpoint_id)
        if resumed.have_base:
            st.policy.adopt_base()
        st.schedule.resumed_at(resumed.step)
        self.stats.at_risk.committed(resumed.step)

    # -- save -----------------------------------------------------------------------------
    def save(self, step: int) -> None:
        """After training step `step` (the loop's state already says `step`): a checkpoint when
        one is due (`ckpt.schedule.interval_steps` / `interval_s`), else only the outcomes of
        earlier ones are collected. A profile shows it as `## deltarec checkpoint ##`."""
        with record_function("## deltarec checkpoint ##"):
            schedule = self.stages.schedule
            maybe_die("step", step, self.env.rank)
            self.wait_for_copy()  # done already: this step's backward pass waited for it
            self._record_outcomes()
            if schedule.due(step):
                self._checkpoint(step)
            if schedule.time_to_reserve(step):
                stalls = self.stats.stalls
                schedule.reserve_next(self.chain.force_full, last_was_full=bool(stalls) and stalls[-1].full)
            schedule.look_ahead(step + 1)
            self.stats.at_risk.after(step)

    def steps_at_risk(self) -> tuple[float, int] | None:
        """The steps a crash right after each step since the last call would have lost: mean
        and most (`AtRisk`, ckpt/save/outcomes.py); None when no step ended since."""
        return self.stats.at_risk.take()

    def close(self, step: int) -> None:
        """Checkpoint the last step (`ckpt.schedule.final`), wait for every outcome, stop the
        writer. Right also when the loop body never ran; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish(step)
        finally:
            if self._own_metrics is not None:
                self._own_metrics.close()

    def _finish(self, step: int) -> None:
        st = self.stages
        self.wait_for_copy()
        if self.cfg.schedule.final:
            # every earlier outcome first: after a failure the last checkpoint must be one that
            # commits on its own (full), not a delta of a chain that can no longer commit; and
            # when the last step's own checkpoint failed, it is taken again, full
            st.writer.drain()
            self._record_outcomes()
            last = self.stats.last
            if st.schedule.last_step != step or (last is not None and not last.committed and last.step == step):
                self._checkpoint(step, final=True)
            self.wait_for_copy()
        st.copier.close()
        st.schedule.close()
        for outcome in st.writer.close():
            self._record(outcome)
        if self.env.rank == 0:
            st.outcomes.say_unwritten()
        if st.taker.pool is not None:
            st.taker.pool.close()
        st.backend.close()
        if self.env.rank == 0:
            logger.debug(  # the trainer prints the summary line
                "checkpoints: %d committed, %d failed, %d skipped", self.stats.committed, self.stats.failed, self.stats.skipped
            )

    def _record_outcomes(self) -> None:
        """Record the outcomes the writer decided since the last look (never blocks)."""
        for outcome in self.stages.writer.poll():
            self._record(outcome)

    def _wants_full(self) -> bool:
        """Whether this rank asks for a full checkpoint, as an agreement starts: after a failed
        checkpoint or a restore, or (prioritized checkpoints) the full one that saves what
        prioritized ones left waiting, every `ckpt.recovery.priority_full_every` checkpoints."""
        st = self.stages
        if st.priority is not None and st.handoff.since_full + 1 >= self.cfg.recovery.priority_full_every:
            self.chain.force_full = True
        return self.chain.force_full

    def _checkpoint(self, step: int, final: bool = False) -> None:
        """Take the checkpoint of `step`: agree, copy (the stall), hand to the writer.
        Under back-pressure `skip` drops it (reported), `wait` blocks; the final one waits.
        Its callers have waited for the previous checkpoint's copy (`wait_for_copy`)."""
        st, chain = self.stages, self.chain
        assert not st.copier.busy, "the previous checkpoint's copy is still running"
        if not st.attempt.epoch:
            st.attempt.join()
        started_unix, t0, cpu0 = time.time(), time.perf_counter(), time.thread_time()
        agreed = st.schedule.agree(step)
        t_agreed = time.perf_counter()
        decision = agreed.decision
        if agreed.behind and not final:
            most = self.cfg.write.max_coalesced
            if not most or chain.coalesced < most:  # its rows go into the next checkpoint taken
                chain.coalesced += 1
                st.outcomes.coalesced(step, self.env.rank)
                return
            # coalesced as often as allowed: wait for the writers (every rank does, as every
            # rank counts the same agreed checkpoints), leaving them this thread's core
            st.writer.wait_for_jobs_below(self.cfg.write.pending_checkpoints(self.cfg.schedule.interval_steps))
        if agreed.overflow[decision.kind] and self.cfg.write.on_backpressure == "skip" and not final:
            st.outcomes.skipped(step, self.env.rank)
            return
        # this step's counts, when the next step's agreement needs them too (a checkpoint every step)
        counted = st.schedule.counted(step, decision.kind)
        if st.writer.pending_bytes:  # the agreed counts are a step old: the bound uses this step's
            need = counted if counted is not None else st.taker.estimate_bytes(decision.full, decision.since_base)
            st.writer.wait_for_room(need, self.cfg.write.max_pending_bytes)
        cid = chain.next_id
        chain.coalesced = 0
        st.schedule.took(step, cid)
        chain.next_id += 1
        if decision.full or not chain.generation:
            chain.generation = cid  # a full checkpoint, or the first delta after a restore, opens one
        chain.ids = st.policy.chain_after(chain.ids, cid, decision)
        # this step's loop position, copied: the loop may change what its state dict refers to
        # before the writer serialises it
        trainer_state = copy.deepcopy(self.loop.state_dict())
        st.policy.record(decision, agreed.fraction)
        chain.force_full = chain.force_full and not agreed.forced  # a request made after the agreement waits for the next
        codecs = self.codecs()
        # the id-to-slot state of managed-collision tables, here on the training thread: the
        # next step's forward remaps and evicts, while the copy may still run beside it
        mapping = st.mapping.capture()
        st.outcomes.started(cid, started_unix, codecs[0])
        overlap = self._overlap()
        order = CopyOrder(
            checkpoint_id=cid,
            step=step,
            decision=decision,
            final=final,
            trainer_state=trainer_state,
            fractions=agreed.fractions,
            generation=chain.generation,
            chain=list(chain.ids),
            codecs=codecs,
            overlapped=overlap,
            agree_ms=(t_agreed - t0) * 1e3,
            epoch=st.attempt.epoch,
            restores=chain.restores,
            lost_samples=chain.lost_samples,
            mapping=mapping,
        )
        if overlap:
            handoff_s, handoff_cpu = time.perf_counter() - t0, time.thread_time() - cpu0
            st.copier.start(lambda finish, release: st.handoff.copy(order, handoff_s, finish, handoff_cpu, release))
            st.tracker.hold_next_lookup(st.copier.wait_released, self.wait_for_copy)
        else:
            timing = st.handoff.copy(order, 0.0, lambda: time.perf_counter() - t0, 0.0)
            self.stats.stalls.append(timing._replace(cpu_ms=(time.thread_time() - cpu0) * 1e3))

    def _overlap(self) -> bool:
        """Whether this checkpoint's copy runs beside the next step (ckpt/capture/overlapped_copy.py)."""
        return self.cfg.capture.overlap_copy and self.stages.taker.device.type == "cpu" and self.stages.tracker.attached

    def wait_for_copy(self) -> None:
        """Wait for a checkpoint's copy still running beside training (`ckpt.capture.overlap_copy`),
        if any, and record its stall: until then it reads the shards and changes the tracker's
        bitmaps. Every call that reads or changes the tracker, the taker or the writer's queue
        comes here first (the checkpointer's own, a benchmark's between steps), and so does the
        next step's backward pass, before its embedding kernels could change a row."""
        timing = self.stages.copier.wait()
        if timing is not None:
            self.stats.stalls.append(timing)

    def _record(self, o: Outcome) -> None:
        """One checkpoint's outcome: counted (a fenced one stops this attempt), logged and written
        to metrics on rank 0; a committed one is what a survivor builds on, a failed one makes
        the next checkpoint full."""
        st = self.stages
        pending = st.outcomes.count(o)
        if o.committed:
            self.chain.last_committed = max(self.chain.last_committed, o.checkpoint_id)
            self.stats.at_risk.committed(o.step)
            st.tracker.committed(o.checkpoint_id)
            maybe_die("committed", o.checkpoint_id, self.env.rank)
        else:
            self.chain.force_full = True
        if self.env.rank == 0:
            st.outcomes.report(o, pending)

    # -- partial recovery -------------------------------------------------------------------
    def save_survivor(self, loop_state: dict[str, Any]) -> SurvivorRecord | None:
        """Another rank died: under `ckpt.recovery.mode: partial` save this rank's rows changed
        since the newest checkpoint it knows committed, its dense and loop state (`loop_state`:
        as of its last completed step) within `ckpt.recovery.survivor_timeout_s`
        (ckpt/recovery/survivor.py). None when there is nothing a restore could use: full
        recovery, or no committed checkpoint yet."""
        st, chain = self.stages, self.chain
        if self.cfg.recovery.mode != "partial" or not st.attempt.epoch:
            return None
        self.wait_for_copy()  # a copy the failed step left in flight (no row changed since its checkpoint step)
        self._record_outcomes()  # outcomes the writer decided since the last step: the newest base there is
        if not chain.last_committed:
            return None
        deadline = time.monotonic() + self.cfg.recovery.survivor_timeout_s
        step, sid = int(loop_state["step"]), chain.next_id
        rows = [st.tracker.since_committed_rows(i) for i in range(len(st.shard_map.shards))]
        snapshot = st.taker.take_rows(sid, step, rows)
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
            epoch=st.attempt.epoch,
        )
        dense = st.dense_capture()
        dense.update(
            restores=chain.restores, lost_samples=chain.lost_samples, step=step, trainer=loop_state, **self.identity._asdict()
        )
        shards = [[s.table, s.row_offset, s.num_rows, s.col_offset, s.num_cols] for s in st.shard_map.shards]
        return save_survivor(
            self.cfg.sink,
            run_id=self.run_id,
            rank=self.env.rank,
            job=job,
            attempt=st.attempt.id,
            world_size=self.env.world_size,
            base=chain.last_committed,
            dense_state=dense,
            shards=shards,
            deadline=deadline,
        )

    def codecs(self) -> tuple[str, str]:
        """(weight codec, optimizer codec) for the next checkpoint: `ckpt.encoding.weights` and
        `.optimizer`, or the bit width `ckpt.encoding.restore_bit_widths` (deltarec's table by
        default) gives for `ckpt.encoding.expected_restores`, which falls back to 8 bits once the
        job has restored more often than expected."""
        return codecs_for(self.cfg.encoding, self.chain.restores)


def codecs_for(encoding: EncodingConfig, restores: int) -> tuple[str, str]:
    """(weight codec, optimizer codec) of a job that has restored `restores` times (`Checkpointer.codecs`)."""
    if encoding.expected_restores <= 0:
        return encoding.weights, encoding.optimizer
    policy = BitWidthPolicy(expected_restores=encoding.expected_restores, restores_so_far=restores, widths=encoding.bit_widths())
    return policy.weight_codec(), policy.optimizer_codec()
