"""What a `Checkpointer` is built from, checked, and its stages built: each stage from its own
config section (ckpt/config.py), in the order a checkpoint passes through them.

The checks refuse, each with one line, what deltarec cannot checkpoint before the first step: a
fused optimizer with state outside the rows, a loop whose state lacks `step` (or, with partial
recovery, `samples_seen` / `skip_batches`) or cannot be saved, a dense optimizer without
`state_dict` / `load_state_dict`, too small a pending-bytes budget.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from ckpt.capture.host_buffers import HostBufferPool
from ckpt.capture.mapping import MappingCapture
from ckpt.capture.overlapped_copy import CopyBehind
from ckpt.capture.snapshot import SnapshotTaker
from ckpt.capture.tracker import RowTracker
from ckpt.config import CkptConfig
from ckpt.dense import state as dense_state
from ckpt.dense.store import DenseStore, unloadable_reason
from ckpt.events import MetricsSink
from ckpt.log.backend import Backend, open_for_restore
from ckpt.recovery.priority import RowPriority
from ckpt.restore import kernel as restore_kernel
from ckpt.restore.attempt import Attempt
from ckpt.restore.choice import ResumeChoice
from ckpt.save.handoff import Handoff, StallTiming
from ckpt.save.outcomes import Outcomes
from ckpt.save.policy import CheckpointPolicy
from ckpt.save.schedule import Schedule
from ckpt.types import JobIdentity
from ckpt.write.committer import Committer
from ckpt.write.writer import RankWriter
from common.errors import ConfigError, DeltarecError
from sharding.dmp import ShardedModel
from sharding.managed_collision import McShard
from sharding.process_group import DistEnv, detect_env
from sharding.row_init import RowInit, initialise_shards
from sharding.shard_views import ShardMap

#: fbgemm's fused optimizers whose whole state is per row (`split_optimizer_states`), so rows carry it.
SUPPORTED_OPTIMIZERS = ("exact_row_wise_adagrad", "row_wise_adagrad", "exact_adagrad", "exact_sgd", "sgd")


class UnsupportedOptimizerError(DeltarecError, ValueError):
    """A fused embedding optimizer keeps state deltarec cannot capture."""


def initialise_rows(model: nn.Module, seed: int) -> RowInit:
    """Set every model-parallel row of `model` (a DMP) to deltarec's plan-independent initial
    value for `seed` (sharding/row_init.py: torchrec's default distribution) and its fused
    optimizer state to zero; pass the result as `Checkpointer(row_init=...)`. Call it on every
    rank, after DMP and before training: checkpoints then need not store rows never trained."""
    shard_map = ShardMap.from_model(model, managed_collision=True)
    init = RowInit(seed)
    initialise_shards(init, shard_map.shards, shard_map.shapes())
    return init


def check_optimizers(shard_map: ShardMap) -> None:
    """Refuse a fused optimizer with state outside the rows (Adam's and LAMB's step counter,
    counter-based row-wise Adagrad): restoring its rows alone would not restore it."""
    for s in shard_map.shards:
        kind = getattr(getattr(s.kernel, "optimizer", None), "value", None)
        if kind is None:
            continue
        if kind not in SUPPORTED_OPTIMIZERS or getattr(s.kernel, "_used_rowwise_adagrad_with_counter", False):
            raise UnsupportedOptimizerError(
                f"table {s.table}: its fused optimizer {kind} keeps a step counter outside the rows, which "
                f"deltarec does not capture yet; use one of {', '.join(SUPPORTED_OPTIMIZERS)}"
            )


def check_loop(loop: Stateful, partial: bool) -> None:
    """What deltarec reads from the loop's state, checked before training starts: an int `step`
    always (what a checkpoint is of, and where a restore resumes); with partial recovery
    (`partial`: `ckpt.recovery.mode=partial`) also an int `samples_seen` (the samples trained so
    far over all ranks, which the portion of lost samples is counted against) and a
    `skip_batches(n)` method (a rolled-back rank's data moves past what its dead predecessor
    trained). Everything else in the state is the loop's own and rides along untouched (the
    loop-state table in README.md)."""
    state = loop.state_dict()
    name = type(loop).__name__
    if not isinstance(state, dict) or not _is_int(state.get("step")):
        raise ConfigError(
            f"loop {name}: state_dict() must be a dict with an int 'step' (the last completed step); "
            f"got keys {sorted(state) if isinstance(state, dict) else type(state).__name__}"
        )
    unloadable = unloadable_reason(state)  # it rides in the dense file: refused now, not at the first restore
    if unloadable:
        raise ConfigError(
            f"loop {name}: its state_dict() cannot be checkpointed: {unloadable}; keep tensors and plain "
            "data in it (torch.get_rng_state(), ints, floats, strings, lists, dicts)"
        )
    if not partial:
        return
    if not _is_int(state.get("samples_seen")):
        raise ConfigError(
            f"loop {name}: ckpt.recovery.mode=partial counts lost samples against the loop state's int 'samples_seen' "
            f"(samples trained so far, all ranks together), which it lacks; got keys {sorted(state)}"
        )
    if not callable(getattr(loop, "skip_batches", None)):
        raise ConfigError(
            f"loop {name}: ckpt.recovery.mode=partial needs a skip_batches(n) method (a rolled-back rank's reader "
            "moves past the batches its dead predecessor trained; a no-op when the data follows 'step')"
        )


def check_dense_optimizer(dense_optimizer: Any) -> None:
    """The dense optimizer (or None: no dense parameters) travels through its own
    `state_dict()` / `load_state_dict()`, so it must have both."""
    if dense_optimizer is None:
        return
    lacks = [f"{m}()" for m in ("state_dict", "load_state_dict") if not callable(getattr(dense_optimizer, m, None))]
    if lacks:
        raise ConfigError(
            f"dense_optimizer {type(dense_optimizer).__name__} has no {' or '.join(lacks)}: pass the optimizer of "
            "the parameters outside the embedding tables (torch.optim, torchrec's KeyedOptimizerWrapper), or None"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def model_digest(shard_map: ShardMap, model: nn.Module) -> str:
    """sha256 of what rows and dense state depend on: every table's key and shape, every dense
    parameter's name and shape (the plan and world size are left out: restores reshard)."""
    tables = sorted((k, list(t.shape)) for k, t in shard_map.table_info.items())
    dense = sorted((n, list(p.shape)) for n, p in model.named_parameters() if not hasattr(p, "_in_backward_optimizers"))
    return hashlib.sha256(json.dumps([tables, dense]).encode()).hexdigest()


def config_digest(cfg: CkptConfig) -> str:
    """sha256 of the resolved `ckpt` section (a user's own loop has no job config to digest)."""
    return hashlib.sha256(json.dumps(cfg.to_data(), sort_keys=True, default=str).encode()).hexdigest()


def dist_env() -> DistEnv:
    """This process's place in the initialised default process group: rank and world size
    from the group, the rest from the launcher's variables (`detect_env`)."""
    if not dist.is_initialized():
        raise ConfigError("Checkpointer needs torch.distributed initialised first (the process group DMP shards over)")
    launched = detect_env()
    return replace(launched, rank=dist.get_rank(), world_size=dist.get_world_size())


def device_of(shard_map: ShardMap, model: nn.Module) -> torch.device:
    """Where the shards (else the dense parameters) live."""
    if shard_map.shards:
        return shard_map.shards[0].weight.device
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def resolve(cfg: CkptConfig, run_dir: str | Path | None) -> CkptConfig:
    """`cfg` enabled and validated, its run id and directories filled from `run_dir`, every
    path absolute (the `ckpt.yaml` it leaves in the run directory works from any directory)."""
    sink = cfg.sink
    if run_dir is None and not (cfg.run_id and sink.dense_dir and (sink.fs_root or sink.kind == "kafka")):
        raise ConfigError(
            "Checkpointer: give run_dir, or set ckpt.run_id, ckpt.sink.dense_dir (and ckpt.sink.fs_root for the filesystem sink)"
        )
    if run_dir is not None:
        cfg = cfg.resolved(cfg.run_id or Path(run_dir).name, Path(run_dir))
    cfg = replace(cfg, enabled=True).with_absolute_paths()
    cfg.validate("ckpt")
    return cfg


class NoDenseState:
    """The dense optimizer of a model with no dense parameters."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@dataclass
class Stages:
    """One rank's checkpoint stages, in the order a checkpoint passes through them: the rows a
    step changed (`tracker`), when and which kind (`schedule`, `policy`, `priority`), the copy
    to host memory (`taker`, `dense_capture`, `copier`) handed to the writer (`handoff`,
    `writer`, `committer` on rank 0), what came back (`outcomes`); and for a restore, the log
    (`backend`, `dense`, `attempt`) and what to resume (`choice`)."""

    shard_map: ShardMap
    tracker: RowTracker
    taker: SnapshotTaker
    policy: CheckpointPolicy
    backend: Backend
    dense: DenseStore
    dense_capture: dense_state.DenseCapture
    committer: Committer | None
    writer: RankWriter
    outcomes: Outcomes
    attempt: Attempt
    choice: ResumeChoice
    priority: RowPriority | None
    schedule: Schedule
    handoff: Handoff
    copier: CopyBehind[StallTiming]
    mapping: MappingCapture  # the id-to-slot state of managed-collision tables, captured in the stall
    full_bytes: int  # this rank's snapshot of every row (fixed by the plan)
    total_rows: int


def build_stages(
    cfg: CkptConfig,
    *,
    identity: JobIdentity,
    env: DistEnv,
    device: torch.device,
    sharded: ShardedModel,
    metrics: MetricsSink,
    backend: Backend | None,
    shard_map: ShardMap,
    mc_shards: Sequence[McShard],
    wants_full: Callable[[], bool],
) -> Stages:
    """Every stage of one rank, each given its own section of the resolved `cfg` and nothing
    else; `wants_full` is the checkpointer's answer to "must the next checkpoint be full?"."""
    assert cfg.run_id and cfg.sink.dense_dir, "CkptConfig.resolved() fills the run id and directories"
    check_managed_collision(cfg, mc_shards)
    run_id, rank = cfg.run_id, env.rank
    # Writers coordinate on their own gloo group so the training thread's collectives and
    # theirs never interleave (see ckpt/write/writer.py).
    group = dist.new_group(backend="gloo")
    tracker = RowTracker(shard_map)
    if cfg.recovery.mode == "partial":
        tracker.keep_uncommitted()
    taker = _make_taker(cfg, shard_map, tracker, device, regenerate=sharded.row_init is not None)
    full_bytes = taker.upper_bound_bytes()
    if full_bytes > cfg.write.max_pending_bytes:
        raise ConfigError(
            f"ckpt.write.max_pending_bytes={cfg.write.max_pending_bytes} is smaller than one full snapshot of this "
            f"rank ({full_bytes} bytes): raise it, or no full checkpoint could ever be taken"
        )
    policy = CheckpointPolicy(cfg.schedule.policy)
    # a restore comes next: its readers connect while the rest is built (or, given by the job,
    # while its model was built)
    if backend is None:
        backend = open_for_restore(run_id, cfg.sink, cfg.restore, env.world_size, rank)
    dense = DenseStore(Path(cfg.sink.dense_dir))
    committer = None
    if rank == 0:  # dense files and markers (ckpt/write/committer.py)
        committer = Committer(
            run_id=run_id,
            markers=backend.markers,
            dense=dense,
            marker_fields=marker_fields(cfg.schedule.policy, env.world_size, shard_map, sharded.row_init, taker.trained_only),
            rebase=cfg.schedule.policy == "incremental",
            where=backend.where,
            catalog_every=cfg.sink.catalog_every,
            connect_timeout_s=cfg.sink.connect_timeout_s,
            keep_dense=cfg.write.keep_dense,
        )
    writer = RankWriter(
        run_id=run_id,
        rank=rank,
        sink=backend.sink,
        group=group,
        max_frame_bytes=cfg.sink.max_frame_bytes,
        flush_timeout_s=cfg.sink.flush_timeout_s,
        committer=committer,
        nice=cfg.write.writer_nice,
    )
    choice = ResumeChoice(  # what a restore reads, agreed by every rank
        cfg.restore,
        run_id=run_id,
        backend=backend,
        dense=dense,
        partial=cfg.recovery.mode == "partial",
        connect_timeout_s=cfg.sink.connect_timeout_s,
    )
    priority = None
    if cfg.recovery.priority != "none":  # CPR's prioritized checkpoints (ckpt/recovery/priority.py)
        seed = zlib.crc32(f"{run_id}:{rank}".encode())
        priority = RowPriority(tracker, taker.row_bytes, cfg.recovery.priority, sample=cfg.recovery.ssu_sample, seed=seed)
    total_rows = sum(s.num_rows for s in shard_map.shards)
    schedule = Schedule(
        cfg.schedule,
        cfg.write,
        tracker=tracker,
        taker=taker,
        policy=policy,
        writer=writer,
        total_rows=total_rows,
        full_bytes=full_bytes,
        wants_full=wants_full,
        prioritized=priority is not None,
    )
    dense_capture = dense_state.DenseCapture(sharded)  # rank 0's stall; any rank's survivor
    handoff = Handoff(
        rank=rank,
        identity=identity,
        taker=taker,
        tracker=tracker,
        priority=priority,
        dense_capture=dense_capture,
        writer=writer,
        full_bytes=full_bytes,
        priority_budget=cfg.recovery.priority_budget,
    )
    if cfg.restore.resume != "none":
        restore_kernel.load()  # the restore's fused replay: compiled or loaded now, not in the restore
    return Stages(
        shard_map=shard_map,
        tracker=tracker,
        taker=taker,
        policy=policy,
        backend=backend,
        dense=dense,
        dense_capture=dense_capture,
        committer=committer,
        writer=writer,
        outcomes=Outcomes(metrics),
        attempt=Attempt(backend, run_id, env.world_size, committer),  # its epoch: in every frame
        choice=choice,
        priority=priority,
        schedule=schedule,
        handoff=handoff,
        copier=CopyBehind(),  # a checkpoint's copy beside the next step
        mapping=MappingCapture(mc_shards),
        full_bytes=full_bytes,
        total_rows=total_rows,
    )


def check_managed_collision(cfg: CkptConfig, mc_shards: Sequence[McShard]) -> None:
    """Refuse, with one line, the settings managed-collision tables are not checkpointed with
    yet: copy-on-write snapshots (an eviction redraws rows in the forward pass, which the
    copy-on-write guards do not see), CPR's prioritized checkpoints (they could leave an admitted
    slot's row unsaved while the mapping names it) and partial recovery (the survivors' mapping
    would run ahead of the rolled-back shards')."""
    if not mc_shards:
        return
    table = mc_shards[0].key
    if cfg.capture.copy_on_write:
        raise ConfigError(f"table {table} is a managed-collision table: set ckpt.capture.copy_on_write=false")
    if cfg.recovery.mode != "full":
        raise ConfigError(f"table {table} is a managed-collision table: set ckpt.recovery.mode=full")


def _make_taker(
    cfg: CkptConfig, shard_map: ShardMap, tracker: RowTracker, device: torch.device, regenerate: bool
) -> SnapshotTaker:
    """The copy of rows to host memory (ckpt/capture/snapshot.py). With a row initialisation the
    untrained rows need not be stored (sharding/row_init.py): full checkpoints hold the rows
    trained since, and markers say how to regenerate the rest. Snapshots reuse the memory of
    written ones, within the pending-snapshot budget (pinned for GPU shards, whose copies to
    host are asynchronous); copy-on-write copies none (and the taker refuses it for GPU shards)."""
    capture = cfg.capture
    pool = None
    if not capture.copy_on_write:
        pool = HostBufferPool(cfg.write.max_pending_bytes, nice=cfg.write.writer_nice, pin_for=torch.device(device))
    return SnapshotTaker(
        shard_map,
        tracker,
        device,
        trained_only=regenerate and capture.untrained_rows == "regenerate",
        pool=pool,
        encode_on=capture.encode_on,
        copy_on_write=capture.copy_on_write,
    )


def marker_fields(
    policy: str, world_size: int, shard_map: ShardMap, row_init: RowInit | None, trained_only: bool
) -> dict[str, Any]:
    """What every marker of this job says of it: tables by key (docs/design/formats.md, "Table keys"), their plan."""
    tables = shard_map.table_info.values()
    return {
        "policy": policy,
        "world_size": world_size,
        "plan": {t.key: t.sharding_type for t in tables},
        "tables": {t.key: [t.num_embeddings, t.embedding_dim] for t in tables},
        "init": row_init.to_json() if row_init is not None and trained_only else {},
    }
