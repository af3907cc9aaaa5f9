"""Wrap the model in DistributedModelParallel with the fused sparse optimizer and a dense one.

The sparse optimizer must be applied in backward *before* planning, otherwise the plan
silently picks the non-fused `dense` kernel (docs/design/environment.md, "Planning").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from sharding.config import OptimizerConfig, ShardingConfig, TableConfig
from sharding.plan import EBC_PATH, MC_PATH, build_plan
from sharding.process_group import DistEnv
from sharding.row_init import RowInit, initialise_shards
from sharding.shard_views import ShardMap

logger = logging.getLogger(__name__)

_SPARSE = {"row_wise_adagrad": RowWiseAdagrad, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD, "adam": torch.optim.Adam}
_DENSE = {"adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD, "adam": torch.optim.Adam}


def _optimizer_kwargs(name: str, lr: float, eps: float) -> dict:
    return {"lr": lr} if name == "sgd" else {"lr": lr, "eps": eps}


@dataclass
class ShardedModel:
    """The DMP-wrapped model, its optimizers and its plan: what checkpoints read and restore.

    deltarec's own loop steps `optimizer` (fused sparse and dense combined); a user's loop
    (`ckpt.Checkpointer`) steps its own, and gives only its `dense_optimizer` (the fused
    sparse optimizer's state lives in the kernels, beside the rows)."""

    model: DistributedModelParallel
    optimizer: CombinedOptimizer | None
    plan: ShardingPlan
    row_init: RowInit | None = None  # how the model-parallel rows were initialised; None: torchrec's own
    dense_optimizer: Any = None  # state_dict()/load_state_dict(); default: `optimizer`'s last (the dense one)

    def __post_init__(self) -> None:
        if self.dense_optimizer is None and self.optimizer is not None:
            self.dense_optimizer = self.optimizer.optimizers[-1][1]


def plan_model(
    model: nn.Module,
    tables: Sequence[TableConfig],
    sharding: ShardingConfig,
    optimizer: OptimizerConfig,
    env: DistEnv,
    device_type: str,
    collective: bool = True,
) -> tuple[ShardingPlan, list[ModuleSharder[nn.Module]]]:
    """Fuse the sparse optimizer into the tables, then plan (see `sharding.plan`); returns the
    plan and the sharders DMP needs for it (the managed-collision one only with hashed tables)."""
    sp = optimizer.sparse
    hashed = any(t.managed_collision is not None for t in tables)
    paths = [EBC_PATH] if not hashed else [p for p in (EBC_PATH, MC_PATH) if _has_submodule(model, p)]
    for path in paths:
        params = model.get_submodule(path).parameters()
        apply_optimizer_in_backward(_SPARSE[sp.name], params, _optimizer_kwargs(sp.name, sp.lr, sp.eps))
    sharder = EmbeddingBagCollectionSharder()
    mc_sharder = ManagedCollisionEmbeddingBagCollectionSharder() if hashed else None
    plan = build_plan(model, tables, sharding, optimizer, env, device_type, sharder, collective, mc_sharder)
    sharders: list[ModuleSharder[nn.Module]] = [sharder]
    if mc_sharder is not None:
        sharders.append(mc_sharder)
    return plan, sharders


def _has_submodule(model: nn.Module, path: str) -> bool:
    try:
        return model.get_submodule(path) is not None
    except AttributeError:
        return False


def shard_model(
    model: nn.Module,
    tables: Sequence[TableConfig],
    sharding: ShardingConfig,
    optimizer: OptimizerConfig,
    env: DistEnv,
    device: torch.device,
    row_init: RowInit | None = None,
) -> ShardedModel:
    """Plan, shard with DMP, and build the dense optimizer beside the fused one. With
    `row_init`, every model-parallel row is then set to its plan-independent initial value
    (sharding/row_init.py), which lets checkpoints leave out rows never trained."""
    plan, sharders = plan_model(model, tables, sharding, optimizer, env, device.type)
    dmp = DistributedModelParallel(
        module=model,
        device=device,
        plan=plan,
        sharders=sharders,
        env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
    )
    dp = optimizer.dense
    dense_cls: Callable = _DENSE[dp.name]
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: dense_cls(params, **_optimizer_kwargs(dp.name, dp.lr, dp.eps)),
    )
    if row_init is not None:
        shard_map = ShardMap.from_model(dmp, managed_collision=any(t.managed_collision is not None for t in tables))
        initialise_shards(row_init, shard_map.shards, shard_map.shapes())
    return ShardedModel(dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), plan, row_init)
