"""deltarec in your own TorchRec training loop: `Checkpointer`, the public API.

    from ckpt import Checkpointer, load_ckpt_config

    cfg = load_ckpt_config("job.yaml")              # the `ckpt:` section, or CkptConfig(...) in code
    ckpt = Checkpointer(cfg, dmp, dense_optimizer=dense_opt, loop=loop, run_dir="runs/my_job")
    ckpt.restore()                                  # ckpt.resume: latest | none | <checkpoint id>
    for step in range(loop.step + 1, steps + 1):
        train_one_batch()                           # forward, backward, dense_opt.step()
        loop.step = step
        ckpt.save(step)                             # a checkpoint when one is due; else next to nothing
    ckpt.close(loop.step)                           # also right when the loop body never ran

What it takes (docs/design/layers.md, "Your own loop"):

- `model`: a `DistributedModelParallel` whose sharded `EmbeddingBagCollection` and
  `EmbeddingCollection` modules may sit anywhere in the module tree, on any sharding type,
  their optimizer fused into the kernels (`apply_optimizer_in_backward`). Tables are
  addressed by their FQN in the unsharded model (sharding/shard_views.py).
- `dense_optimizer`: the optimizer of every other parameter (anything with `state_dict()` and
  `load_state_dict()`); its state travels with the dense parameters in rank 0's dense file.
- `loop`: a `Stateful` holding the rest of the loop: its state dict must hold `step` (the last
  completed step, an int); the data position, RNG and anything else the user adds ride along
  and come back through `load_state_dict` at restore. Partial recovery also needs an int
  `samples_seen` and a `skip_batches(n)` method (`check_loop`); a `reader` entry, when the
  loop has one, decides whether its state carries over to another world size
  (ckpt/recovery/partial.py, `shared_reader`).
- `row_init`: the `RowInit` the rows were initialised with (`initialise_rows`), which lets
  checkpoints leave out rows never trained (`ckpt.untrained_rows=regenerate`); without it
  rows keep TorchRec's own initial values, so the first full checkpoint stores every row.

Refused at start, each with one line: a sharded module of another kind, a fused optimizer
whose state is not all in the rows, a loop whose state has no `step` or cannot be saved (or,
with partial recovery, lacks `samples_seen` or `skip_batches`), a dense optimizer without
`state_dict`/`load_state_dict`; at restore, a
checkpoint whose tables do not match the model's (ckpt/restore/replay.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.profiler import record_function

from ckpt.config import CkptConfig
from ckpt.dense.store import unloadable_reason
from ckpt.events import MetricsSink
from ckpt.handoff import JobIdentity
from ckpt.log.backend import Backend
from ckpt.log.markers import SurvivorRecord
from ckpt.manager import CheckpointManager
from ckpt.metrics_log import MetricsLog
from ckpt.outcomes import CheckpointStats
from ckpt.restore.restorer import RestoreReport
from common.errors import ConfigError, DeltarecError
from sharding.dmp import ShardedModel
from sharding.process_group import DistEnv, detect_env
from sharding.row_init import RowInit, initialise_shards
from sharding.shard_views import ShardMap, unwrapped

#: fbgemm's fused optimizers whose whole state is per row (`split_optimizer_states`), so rows carry it.
SUPPORTED_OPTIMIZERS = ("exact_row_wise_adagrad", "row_wise_adagrad", "exact_adagrad", "exact_sgd", "sgd")


class UnsupportedOptimizerError(DeltarecError, ValueError):
    """A fused embedding optimizer keeps state deltarec cannot capture."""


def initialise_rows(model: nn.Module, seed: int) -> RowInit:
    """Set every model-parallel row of `model` (a DMP) to deltarec's plan-independent initial
    value for `seed` (sharding/row_init.py: torchrec's default distribution) and its fused
    optimizer state to zero; pass the result as `Checkpointer(row_init=...)`. Call it on every
    rank, after DMP and before training: checkpoints then need not store rows never trained."""
    shard_map = ShardMap.from_model(model)
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


def check_loop(loop: Stateful, cfg: CkptConfig) -> None:
    """What deltarec reads from the loop's state, checked before training starts: an int `step`
    always (what a checkpoint is of, and where a restore resumes); with `ckpt.recovery=partial`
    also an int `samples_seen` (the samples trained so far over all ranks, which the portion of
    lost samples is counted against) and a `skip_batches(n)` method (a rolled-back rank's data
    moves past what its dead predecessor trained). Everything else in the state is the loop's own
    and rides along untouched (the loop-state table in README.md)."""
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
    if cfg.recovery != "partial":
        return
    if not _is_int(state.get("samples_seen")):
        raise ConfigError(
            f"loop {name}: ckpt.recovery=partial counts lost samples against the loop state's int 'samples_seen' "
            f"(samples trained so far, all ranks together), which it lacks; got keys {sorted(state)}"
        )
    if not callable(getattr(loop, "skip_batches", None)):
        raise ConfigError(
            f"loop {name}: ckpt.recovery=partial needs a skip_batches(n) method (a rolled-back rank's reader "
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


def dist_env() -> DistEnv:
    """This process's place in the initialised default process group: rank and world size
    from the group, the rest from the launcher's variables (`detect_env`)."""
    if not dist.is_initialized():
        raise ConfigError("Checkpointer needs torch.distributed initialised first (the process group DMP shards over)")
    launched = detect_env()
    return replace(launched, rank=dist.get_rank(), world_size=dist.get_world_size())


def _device_of(shard_map: ShardMap, model: nn.Module) -> torch.device:
    if shard_map.shards:
        return shard_map.shards[0].weight.device
    return next((p.device for p in model.parameters()), torch.device("cpu"))


class Checkpointer:
    """Continuous checkpoints of a user's DMP model and loop: `restore` once, `save` after
    every training step (torchtitan's `CheckpointManager.save` idiom), `close` at the end
    (module docstring). One per rank; every rank makes the same calls."""

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
        self.cfg = _resolve(cfg, run_dir)
        if run_dir is not None and self.env.rank == 0:  # what `deltarec-ckpt --config <run_dir>/ckpt.yaml` reads
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / "ckpt.yaml").write_text(self.cfg.to_yaml())
        shard_map = ShardMap.from_model(model)
        check_optimizers(shard_map)
        check_loop(loop, self.cfg)
        check_dense_optimizer(dense_optimizer)
        if callable(getattr(dense_optimizer, "save_param_groups", None)):
            # a torchrec KeyedOptimizer leaves its param groups (the learning rate a scheduler
            # set) out of state_dict() unless told to keep them: a restore would lose them
            dense_optimizer.save_param_groups(True)
        self._own_metrics: MetricsLog | None = None
        if metrics is None:
            self._own_metrics = MetricsLog(Path(self.cfg.dense_dir).parent / "metrics.jsonl", enabled=self.env.rank == 0)
            metrics = self._own_metrics
        plan = getattr(model, "plan", None)
        dense = _NoState() if dense_optimizer is None else dense_optimizer
        sharded = ShardedModel(model, None, plan, row_init, dense_optimizer=dense)
        if identity is None:
            config_digest = hashlib.sha256(json.dumps(asdict(self.cfg), sort_keys=True, default=str).encode()).hexdigest()
            identity = JobIdentity(config_digest, model_digest(shard_map, unwrapped(model)))
        self.manager = CheckpointManager(
            self.cfg,
            identity=identity,
            env=self.env,
            device=_device_of(shard_map, model),
            sharded=sharded,
            trainer=loop,
            metrics=metrics,
            backend=backend,
            shard_map=shard_map,
        )
        self._closed = False

    def restore(self) -> RestoreReport | None:
        """Bring back the checkpoint `ckpt.resume` names into the model, both optimizers and the
        loop (`loop.load_state_dict`); None when there is none (a fresh start). Call it once,
        before the first step, on every rank."""
        return self.manager.restore()

    def save(self, step: int) -> None:
        """After training step `step` (the loop's state already says `step`): a checkpoint when
        one is due (`ckpt.interval_steps` / `ckpt.interval_s`), else only the outcomes of
        earlier ones are collected. A profile shows it as `## deltarec checkpoint ##`."""
        with record_function("## deltarec checkpoint ##"):
            self.manager.save(step)

    def close(self, step: int) -> None:
        """Checkpoint the last step (`ckpt.final`), wait for every outcome, stop the writer."""
        if self._closed:
            return
        self._closed = True
        try:
            self.manager.finish(step)
        finally:
            if self._own_metrics is not None:
                self._own_metrics.close()

    def save_survivor(self, loop_state: dict[str, Any]) -> SurvivorRecord | None:
        """Another rank died (`ckpt.recovery: partial`): save this rank's work since the newest
        committed checkpoint, with `loop_state` as of its last completed step (CheckpointManager.save_survivor)."""
        return self.manager.save_survivor(loop_state)

    @property
    def stats(self) -> CheckpointStats:
        """Checkpoints committed, failed, skipped so far, with their stalls."""
        return self.manager.stats


class _NoState:
    """The dense optimizer of a model with no dense parameters."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _resolve(cfg: CkptConfig, run_dir: str | Path | None) -> CkptConfig:
    """`cfg` enabled and validated, its run id and directories filled from `run_dir`, every
    path absolute (the `ckpt.yaml` it leaves in the run directory works from any directory)."""
    if run_dir is None and not (cfg.run_id and cfg.dense_dir and (cfg.fs_root or cfg.sink == "kafka")):
        raise ConfigError(
            "Checkpointer: give run_dir, or set ckpt.run_id, ckpt.dense_dir (and ckpt.fs_root for the filesystem sink)"
        )
    if run_dir is not None:
        cfg = cfg.resolved(cfg.run_id or Path(run_dir).name, Path(run_dir))
    cfg = replace(cfg, enabled=True, fs_root=_absolute(cfg.fs_root), dense_dir=_absolute(cfg.dense_dir))
    follow = replace(cfg.follow, export_dir=_absolute(cfg.follow.export_dir), metrics=_absolute(cfg.follow.metrics))
    cfg = replace(cfg, follow=follow)
    cfg.validate("ckpt")
    return cfg


def _absolute(path: str) -> str:
    """`path` from the working directory, as an absolute path ("" stays unset)."""
    return str(Path(path).absolute()) if path else path
