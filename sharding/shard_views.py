"""The map between (table, global row, column) and this rank's local shards.

Which modules: every `ShardedEmbeddingBagCollection` (pooled) and `ShardedEmbeddingCollection`
(sequence, unpooled) anywhere in a DMP-wrapped model (`embedding_modules`); any other sharded
module is refused, since its rows would go unsaved. A sharded managed-collision module
(`ManagedCollisionEmbeddingBagCollection` / `ManagedCollisionEmbeddingCollection`) is refused too
unless the caller asks for it (``managed_collision=True``): then its inner sharded collection is
listed like any other, with the managed-collision module that drives it (`ManagedCollision`),
since the rows are the inner collection's but only the outer module's ``compute`` looks them up
and evicts them (ckpt/capture/tracker.py hooks it there). A table is addressed by its **key**, the
FQN of its weight in the user's unsharded model without ``.weight``
(``<module FQN>.embedding_bags.<table>`` or ``<module FQN>.embeddings.<table>``, docs/design/formats.md,
"Table keys"): two modules with a table of the same name stay apart, and `model.load_state_dict` on the
unsharded model takes an export keyed by ``<key>.weight``.

Each model-parallel shard of a fused embedding kernel is exposed as a `ShardView`: its
table key, the global row and column where it starts, and zero-copy views of the live weights
and optimizer state (`split_embedding_weights()` / `split_optimizer_states()`). Writing
into a view changes the model, which is what restore needs; reading a view is what
snapshot needs. Data-parallel tables are plain replicated parameters trained by the
dense optimizer, so they travel with the dense state and are listed separately.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from common.errors import DeltarecError


class UnsupportedModelError(DeltarecError, ValueError):
    """The model holds a sharded module whose rows deltarec cannot checkpoint."""


@dataclass(frozen=True)
class TableInfo:
    """One embedding table of the model, whichever rank holds it."""

    key: str  # the table's address: FQN of its weight in the unsharded model, without ".weight"
    module: str  # FQN of the embedding module that holds it
    name: str  # its name inside that module
    num_embeddings: int
    embedding_dim: int
    pooled: bool  # an EmbeddingBagCollection's (True) or an EmbeddingCollection's
    sharding_type: str  # as the plan placed it ("" when no plan is known)

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.embedding_dim


@dataclass(frozen=True)
class ManagedCollision:
    """A sharded managed-collision module (torchrec's `BaseShardedManagedCollisionEmbeddingCollection`):
    it remaps raw ids to slots and evicts, then looks the slots up through its inner sharded
    collection's ``compute``, never through that collection's post-lookup hook; the tracker
    hooks the module itself (ckpt/capture/tracker.py, "Managed-collision tables")."""

    fqn: str  # relative to the DMP's wrapped module ("" for the root)
    sharded: Any  # ShardedManagedCollisionEmbedding(Bag)Collection (torchrec leaves the hook points untyped)


@dataclass(frozen=True)
class EmbeddingModule:
    """One sharded embedding module of the model and where it sits."""

    fqn: str  # relative to the DMP's wrapped module ("" for the root)
    sharded: Any  # ShardedEmbeddingBagCollection | ShardedEmbeddingCollection (hook API untyped)
    pooled: bool
    # the managed-collision module whose inner collection this is (its `_embedding_module`); None
    # for a collection torchrec drives itself, whose post-lookup hook sees every lookup
    managed_collision: ManagedCollision | None = None

    def key(self, table: str) -> str:
        """The key of the module's table `table`."""
        attr = "embedding_bags" if self.pooled else "embeddings"
        return f"{self.fqn}.{attr}.{table}" if self.fqn else f"{attr}.{table}"

    def configs(self) -> list[Any]:
        """The module's table configs (EmbeddingBagConfig / EmbeddingConfig), in its order."""
        return list(self.sharded._embedding_bag_configs if self.pooled else self.sharded._embedding_configs)


def unwrapped(model: nn.Module) -> nn.Module:
    """The module a DMP wraps (`DistributedModelParallel.module`), or `model` itself."""
    return getattr(model, "module", model)


def embedding_modules(model: nn.Module, managed_collision: bool = False) -> list[EmbeddingModule]:
    """Every sharded embedding collection in the model, in module order. Refuses (one line
    naming it) a sharded module of another kind, whose rows no checkpoint would hold.

    With `managed_collision`, a sharded managed-collision module is not refused: its inner
    collection (``<fqn>._embedding_module``, so its tables are keyed exactly as in the unsharded
    model) is listed with the module recorded (`EmbeddingModule.managed_collision`); its
    managed-collision collection (the raw id -> slot state, sharding/managed_collision.py) holds
    no rows and is not walked."""
    # torchrec on first use: what reads the stream without a model (the follower, the tools)
    # imports this module but never pays for torchrec's import
    from torchrec.distributed.embedding import ShardedEmbeddingCollection  # noqa: PLC0415
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection  # noqa: PLC0415
    from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection  # noqa: PLC0415
    from torchrec.distributed.types import ShardedModule  # noqa: PLC0415

    mc_types: tuple[type, ...] = ()
    if managed_collision:
        from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection  # noqa: PLC0415

        mc_types = (BaseShardedManagedCollisionEmbeddingCollection,)
    found: list[EmbeddingModule] = []
    skip: tuple[str, ...] = ()
    for fqn, m in unwrapped(model).named_modules():
        if skip and any(fqn.startswith(p) for p in skip):
            continue
        if isinstance(m, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)):
            found.append(EmbeddingModule(fqn, m, isinstance(m, ShardedEmbeddingBagCollection)))
            skip = (*skip, f"{fqn}." if fqn else "")
        elif mc_types and isinstance(m, mc_types):
            mc: Any = m  # BaseShardedManagedCollisionEmbeddingCollection: builds the inner one as a sharded EBC or EC
            inner = mc._embedding_module
            inner_fqn = f"{fqn}._embedding_module" if fqn else "_embedding_module"
            pooled = isinstance(inner, ShardedEmbeddingBagCollection)
            found.append(EmbeddingModule(inner_fqn, inner, pooled, ManagedCollision(fqn, m)))
            skip = (*skip, f"{fqn}." if fqn else "")
        elif isinstance(m, ShardedFeatureProcessedEmbeddingBagCollection):
            # its rows are its inner EmbeddingBagCollection's (`_embedding_bag_collection`, found
            # next, tables keyed under it as in the unsharded model); the feature processors'
            # weights are dense parameters
            continue
        elif isinstance(m, ShardedModule):
            raise UnsupportedModelError(
                f"module {fqn or '<root>'} is a {type(m).__name__}: deltarec checkpoints the rows of sharded "
                "EmbeddingBagCollection and EmbeddingCollection modules (and FeatureProcessedEmbeddingBagCollection's) only"
            )
    if not found:
        raise UnsupportedModelError(
            "the model has no sharded EmbeddingBagCollection or EmbeddingCollection: wrap it in "
            "DistributedModelParallel with embedding modules to checkpoint"
        )
    return found


@dataclass(frozen=True)
class ShardView:
    """One local shard: rows [row_offset, row_offset + num_rows) and columns
    [col_offset, col_offset + num_cols) of the table keyed `table`, as live views."""

    table: str  # the table's key (`TableInfo.key`)
    row_offset: int
    col_offset: int
    weight: torch.Tensor  # [num_rows, num_cols], aliases the kernel's weights
    optimizer_states: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [num_rows] or [num_rows, num_cols]
    kernel: nn.Module | None = field(default=None, compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    @property
    def num_cols(self) -> int:
        return self.weight.shape[1]

    def local_rows(self, global_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask of `global_rows` inside this shard, their local row indices)."""
        local = global_rows - self.row_offset
        mask = (local >= 0) & (local < self.num_rows)
        return mask, local[mask]


class ShardMap:
    """All model-parallel shards held by this rank, by table key; with `tables`, every table
    of the model (also those other ranks hold, and data-parallel ones) by key."""

    def __init__(
        self,
        shards: list[ShardView],
        replicated_tables: list[str],
        tables: dict[str, TableInfo] | None = None,
        modules: list[EmbeddingModule] | None = None,
    ) -> None:
        self.shards = shards
        self.replicated_tables = replicated_tables
        self.table_info: dict[str, TableInfo] = dict(tables or {})
        self.modules: list[EmbeddingModule] = list(modules or [])
        self._by_table: dict[str, list[ShardView]] = {}
        for s in shards:
            self._by_table.setdefault(s.table, []).append(s)

    def of_table(self, table: str) -> list[ShardView]:
        """This rank's shards of `table` (empty when another rank holds it)."""
        return self._by_table.get(table, [])

    @property
    def tables(self) -> list[str]:
        return list(self._by_table)

    def shapes(self) -> dict[str, tuple[int, int]]:
        """(rows, width) of every table of the model, by key."""
        return {k: t.shape for k, t in self.table_info.items()}

    @property
    def managed_collision(self) -> list[EmbeddingModule]:
        """The modules that are a managed-collision module's inner collection (empty unless
        `from_model` was asked for them)."""
        return [em for em in self.modules if em.managed_collision is not None]

    @classmethod
    def from_model(cls, model: nn.Module, managed_collision: bool = False) -> ShardMap:
        """Walk every sharded embedding collection of a DMP-wrapped model (`embedding_modules`;
        with `managed_collision`, the inner collections of managed-collision modules too)."""
        modules = embedding_modules(model, managed_collision)
        shards: list[ShardView] = []
        replicated: list[str] = []
        tables: dict[str, TableInfo] = {}
        for em in modules:
            plan = getattr(em.sharded, "module_sharding_plan", {}) or {}
            for c in em.configs():
                key = em.key(c.name)
                kind = str(plan[c.name].sharding_type) if c.name in plan else ""
                tables[key] = TableInfo(key, em.fqn, c.name, int(c.num_embeddings), int(c.embedding_dim), em.pooled, kind)
            _add_shards(em, shards, replicated)
        return cls(shards, replicated, tables, modules)


def _add_shards(em: EmbeddingModule, shards: list[ShardView], replicated: list[str]) -> None:
    """The local shards of one module's fused kernels, and its tables no fused kernel holds."""
    for lookup in em.sharded._lookups:
        inner = getattr(lookup, "module", lookup)  # data_parallel lookups are DDP-wrapped
        for emb in inner._emb_modules:
            kernel = emb.emb_module
            tables = emb.config.embedding_tables
            if not hasattr(kernel, "split_optimizer_states"):
                replicated.extend(em.key(t.name) for t in tables)
                continue
            weights = kernel.split_embedding_weights()
            states = kernel.split_optimizer_states()
            names = _state_names(kernel, len(states[0]) if states else 0)
            for t, w, st in zip(tables, weights, states or [[] for _ in tables]):
                row_off, col_off = t.local_metadata.shard_offsets
                assert tuple(w.shape) == (t.local_rows, t.local_cols), (t.name, w.shape)
                shards.append(ShardView(em.key(t.name), int(row_off), int(col_off), w, dict(zip(names, st)), kernel))


def _state_names(kernel: Any, count: int) -> list[str]:
    """Names of the kernel's per-table optimizer states ('sum' for Adagrad variants)."""
    try:
        names = list(kernel.get_optimizer_state()[0].keys())
    except (IndexError, AttributeError, NotImplementedError, ValueError):
        names = []
    if len(names) != count:
        names = [f"state{i}" for i in range(count)]
    return names
