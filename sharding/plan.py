"""The sharding plan from config: per table `table_wise`, `row_wise`, `column_wise`,
`table_row_wise`, `data_parallel`, or `auto` (torchrec's planner).

Explicit types are built with torchrec's generators (`table_wise()`, `row_wise()`, ...),
which also run row_wise and table_row_wise on CPU, where the stock planner refuses them.
`auto` tables are placed by `EmbeddingShardingPlanner`; explicit tables then override its
choice. Impossible combinations are refused before any memory is allocated.

Hashed tables (`managed_collision`) live in their own ManagedCollisionEmbeddingBagCollection
(`MC_PATH`), planned row_wise with torchrec's managed-collision sharder, the only placement it
shards; the planner never sees them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import (
    column_wise,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan

from common.errors import DeltarecError
from sharding.config import OptimizerConfig, ShardingConfig, TableConfig
from sharding.process_group import DistEnv

logger = logging.getLogger(__name__)

#: Where the EmbeddingBagCollection sits inside DLRMTrain (the module the plan shards).
EBC_PATH = "model.sparse_arch.embedding_bag_collection"
#: Where the ManagedCollisionEmbeddingBagCollection of the hashed tables sits (only when there are some).
MC_PATH = "model.sparse_arch.managed_collision"


def table_key(name: str) -> str:
    """The key (sharding/shard_views.py) of DLRMTrain's table `name`: its weight's FQN without ``.weight``."""
    return f"{EBC_PATH}.embedding_bags.{name}"


#: Sharding types the stock planner proposes on CPU; the rest need a manual plan there.
PLANNER_CPU_TYPES = ("table_wise", "column_wise", "table_column_wise", "data_parallel")


class PlanError(DeltarecError, ValueError):
    """The requested placement cannot work; the message says what to change."""


def validate_sharding(
    tables: Sequence[TableConfig], sharding: ShardingConfig, optimizer: OptimizerConfig, env: DistEnv, device_type: str
) -> None:
    """Refuse impossible combinations at start-up, naming the table and the fix."""
    if optimizer.sparse.name == "adam" and device_type == "cpu":
        raise PlanError(
            "optimizer.sparse.name=adam: the fused CPU embedding kernel supports only "
            "row_wise_adagrad, adagrad and sgd; pick one of those or run on GPU"
        )
    if sharding.backend == "nccl" and device_type == "cpu":
        raise PlanError("sharding.backend=nccl needs GPUs; use gloo (or auto) on CPU")
    for t in tables:
        kind = sharding.type_of(t)
        if t.managed_collision is not None and optimizer.sparse.name == "row_wise_adagrad" and device_type == "cpu":
            # an eviction zeroes the evicted rows' momentum with an fbgemm kernel built for CUDA only
            raise PlanError(
                f"table {t.name}: a hashed table (managed_collision) cannot train with optimizer.sparse.name="
                f"row_wise_adagrad on CPU (its eviction resets momentum with a CUDA-only kernel); use sgd or adagrad, or a GPU"
            )
        if t.managed_collision is not None and kind != "row_wise":
            raise PlanError(f"table {t.name}: a hashed table (managed_collision) is sharded row_wise only, not {kind}")
        if kind == "row_wise" and t.num_embeddings < env.world_size:
            raise PlanError(
                f"table {t.name}: row_wise needs at least one row per rank "
                f"({t.num_embeddings} rows < {env.world_size} ranks); use table_wise"
            )
        if kind == "table_row_wise" and t.num_embeddings < env.local_world_size:
            raise PlanError(
                f"table {t.name}: table_row_wise needs at least one row per local rank "
                f"({t.num_embeddings} rows < {env.local_world_size})"
            )
        if kind == "column_wise" and env.world_size > 1 and _column_shards(t.embedding_dim, env.world_size) < 2:
            raise PlanError(
                f"table {t.name}: column_wise cannot split embedding_dim {t.embedding_dim} into "
                f"column shards of a multiple of 4 over {env.world_size} ranks; use table_wise or row_wise"
            )


def _column_shards(dim: int, world_size: int) -> int:
    """Most column shards (≤ world size) that split `dim` into widths divisible by 4."""
    for n in range(min(world_size, dim // 4), 0, -1):
        if dim % n == 0 and (dim // n) % 4 == 0:
            return n
    return 1


def _table_bytes(t: TableConfig) -> int:
    return t.num_embeddings * t.embedding_dim * 4


def _manual_generators(tables: Sequence[TableConfig], sharding: ShardingConfig, env: DistEnv) -> dict:
    """torchrec sharding generators for every explicitly typed table.

    table_wise tables go to the least-loaded rank (largest first) so ranks balance;
    table_row_wise tables go to hosts in turn.
    """
    load = [0] * env.world_size
    gens = {}
    explicit = [t for t in tables if sharding.type_of(t) != "auto" and t.managed_collision is None]
    for t in sorted(explicit, key=_table_bytes, reverse=True):
        kind = sharding.type_of(t)
        if kind == "table_wise":
            rank = min(range(env.world_size), key=lambda r: (load[r], r))
            load[rank] += _table_bytes(t)
            gens[t.name] = table_wise(rank=rank)
        elif kind == "row_wise":
            gens[t.name] = row_wise()
        elif kind == "column_wise":
            n = _column_shards(t.embedding_dim, env.world_size)
            gens[t.name] = column_wise(ranks=list(range(n)))
        elif kind == "table_row_wise":
            gens[t.name] = table_row_wise(host_index=len(gens) % env.num_nodes)
        elif kind == "data_parallel":
            gens[t.name] = data_parallel()
        else:  # pragma: no cover - Literal checked at load
            raise AssertionError(kind)
    return gens


def build_plan(
    model: nn.Module,
    tables: Sequence[TableConfig],
    sharding: ShardingConfig,
    optimizer: OptimizerConfig,
    env: DistEnv,
    device_type: str,
    sharder: EmbeddingBagCollectionSharder,
    collective: bool = True,
    mc_sharder: ManagedCollisionEmbeddingBagCollectionSharder | None = None,
) -> ShardingPlan:
    """The ShardingPlan for `model` (a DLRMTrain whose optimizer is already applied in backward).

    With `collective`, rank 0 plans `auto` tables and broadcasts the result (the normal
    case); without, this process plans alone (`--dry-run` for a world size not launched).
    Hashed tables are planned row_wise in `MC_PATH` with `mc_sharder` (required when there are some).
    """
    validate_sharding(tables, sharding, optimizer, env, device_type)
    ordinary = [t for t in tables if t.managed_collision is None]
    hashed = [t for t in tables if t.managed_collision is not None]
    plans: dict[str, EmbeddingModuleShardingPlan] = {}
    if ordinary:
        ebc = model.get_submodule(EBC_PATH)
        params = sharder.shardable_parameters(ebc)
        module_plan = EmbeddingModuleShardingPlan()
        if any(sharding.type_of(t) == "auto" for t in ordinary):
            module_plan.update(_planner_plan(model, ordinary, sharding, env, device_type, sharder, collective))
        for name, gen in _manual_generators(ordinary, sharding, env).items():
            module_plan[name] = gen(params[name], env.local_world_size, env.world_size, device_type, sharder)
        missing = set(params) - set(module_plan)
        assert not missing, f"tables without a sharding: {sorted(missing)}"
        plans[EBC_PATH] = module_plan
    if hashed:
        assert mc_sharder is not None, "hashed tables are sharded by the managed-collision sharder"
        mc_params = mc_sharder.shardable_parameters(model.get_submodule(MC_PATH))
        mc_plan = EmbeddingModuleShardingPlan()
        for t in hashed:
            mc_plan[t.name] = row_wise()(mc_params[t.name], env.local_world_size, env.world_size, device_type, mc_sharder)
        plans[MC_PATH] = mc_plan
    return ShardingPlan(plans)


def _planner_plan(
    model: nn.Module,
    tables: Sequence[TableConfig],
    sharding: ShardingConfig,
    env: DistEnv,
    device_type: str,
    sharder: EmbeddingBagCollectionSharder,
    collective: bool,
) -> EmbeddingModuleShardingPlan:
    """Ask torchrec's planner; explicit tables are pinned to a type it accepts here
    (and replaced afterwards by the manual plan), so its balancing accounts for them."""
    constraints = {}
    for t in tables:
        kind = sharding.type_of(t)
        if kind == "auto":
            constraints[t.name] = ParameterConstraints(min_partition=min(32, t.embedding_dim))
        else:
            pinned = kind if device_type != "cpu" or kind in PLANNER_CPU_TYPES else "table_wise"
            constraints[t.name] = ParameterConstraints(sharding_types=[pinned], min_partition=min(32, t.embedding_dim))
    topology = Topology(world_size=env.world_size, local_world_size=env.local_world_size, compute_device=device_type)
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    if collective:
        plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    else:
        plan = planner.plan(model, [sharder])
    return plan.plan[EBC_PATH]


@dataclass(frozen=True)
class TablePlacement:
    """One table in the plan: its type and how many bytes each rank holds of it."""

    table: str
    sharding_type: str
    ranks: tuple[int, ...]
    bytes_per_rank: dict[int, int]


def summarize(
    plan: ShardingPlan, tables: Sequence[TableConfig], optimizer: OptimizerConfig, world_size: int
) -> list[TablePlacement]:
    """Per table: sharding type, ranks, and weight + optimizer-state bytes per rank (the
    hashed tables' after the ordinary ones)."""
    module_plans = [plan.plan[path] for path in (EBC_PATH, MC_PATH) if path in plan.plan]
    by_name = {t.name: t for t in tables}
    out = []
    for name, ps in ((n, ps) for mp in module_plans for n, ps in mp.items()):
        t = by_name[name]
        per_rank: dict[int, int] = {}
        if ps.sharding_spec is None:  # data_parallel: a full replica on every rank
            for r in range(world_size):
                per_rank[r] = shard_bytes(t.num_embeddings, t.embedding_dim, optimizer.sparse.name)
        else:
            for shard in ps.sharding_spec.shards:
                rows, cols = shard.shard_sizes
                r = shard.placement.rank()
                per_rank[r] = per_rank.get(r, 0) + shard_bytes(rows, cols, optimizer.sparse.name)
        out.append(TablePlacement(name, ps.sharding_type, tuple(sorted(per_rank)), per_rank))
    return out


def shard_bytes(rows: int, cols: int, sparse_optimizer: str) -> int:
    """fp32 bytes of `rows` x `cols` of a table and of its sparse optimizer's state."""
    state = {"row_wise_adagrad": rows, "adagrad": rows * cols, "sgd": 0, "adam": 2 * rows * cols}[sparse_optimizer]
    return 4 * (rows * cols + state)


def format_plan(placements: list[TablePlacement], world_size: int) -> str:
    """The dry-run table: table → sharding type → ranks, then bytes per rank."""
    lines = [f"{'table':<24} {'sharding':<15} ranks"]
    totals = [0] * world_size
    for p in placements:
        lines.append(f"{p.table:<24} {p.sharding_type:<15} {','.join(map(str, p.ranks))}")
        for r, b in p.bytes_per_rank.items():
            totals[r] += b
    lines.append("bytes per rank (weights + optimizer state):")
    for r, b in enumerate(totals):
        lines.append(f"  rank {r}: {b:,} ({b / 2**20:.1f} MiB)")
    return "\n".join(lines)
