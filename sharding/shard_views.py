"""The map between (table, global row, column) and this rank's local shards.

Each model-parallel shard of a fused embedding kernel is exposed as a `ShardView`: its
table, the global row and column where it starts, and zero-copy views of the live weights
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

from sharding.plan import EBC_PATH


@dataclass(frozen=True)
class ShardView:
    """One local shard: rows [row_offset, row_offset + num_rows) and columns
    [col_offset, col_offset + num_cols) of `table`, as live views."""

    table: str
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
    """All model-parallel shards held by this rank, by table."""

    def __init__(self, shards: list[ShardView], replicated_tables: list[str]) -> None:
        self.shards = shards
        self.replicated_tables = replicated_tables
        self._by_table: dict[str, list[ShardView]] = {}
        for s in shards:
            self._by_table.setdefault(s.table, []).append(s)

    def of_table(self, table: str) -> list[ShardView]:
        """This rank's shards of `table` (empty when another rank holds it)."""
        return self._by_table.get(table, [])

    @property
    def tables(self) -> list[str]:
        return list(self._by_table)

    @classmethod
    def from_model(cls, model: nn.Module) -> ShardMap:
        """Walk the sharded EmbeddingBagCollection inside a DMP-wrapped DLRMTrain."""
        sebc = find_sharded_ebc(model)
        shards: list[ShardView] = []
        replicated: list[str] = []
        for lookup in sebc._lookups:
            inner = getattr(lookup, "module", lookup)  # data_parallel lookups are DDP-wrapped
            for emb in inner._emb_modules:
                kernel = emb.emb_module
                tables = emb.config.embedding_tables
                if not hasattr(kernel, "split_optimizer_states"):
                    replicated.extend(t.name for t in tables)
                    continue
                weights = kernel.split_embedding_weights()
                states = kernel.split_optimizer_states()
                names = _state_names(kernel, len(states[0]) if states else 0)
                for t, w, st in zip(tables, weights, states):
                    row_off, col_off = t.local_metadata.shard_offsets
                    assert tuple(w.shape) == (t.local_rows, t.local_cols), (t.name, w.shape)
                    shards.append(ShardView(t.name, int(row_off), int(col_off), w, dict(zip(names, st)), kernel))
        return cls(shards, replicated)


def find_sharded_ebc(model: nn.Module) -> Any:
    """torchrec's ShardedEmbeddingBagCollection inside a DMP-wrapped DLRMTrain (typed Any: its
    lookups and hook API are not in nn.Module's type)."""
    module = getattr(model, "module", model)  # DMP wraps the DLRMTrain as .module
    ebc = module.get_submodule(EBC_PATH)
    assert hasattr(ebc, "_lookups"), f"{EBC_PATH} is not sharded: {type(ebc).__name__}"
    return ebc


def _state_names(kernel: Any, count: int) -> list[str]:
    """Names of the kernel's per-table optimizer states ('sum' for Adagrad variants)."""
    try:
        names = list(kernel.get_optimizer_state()[0].keys())
    except (IndexError, AttributeError, NotImplementedError, ValueError):
        names = []
    if len(names) != count:
        names = [f"state{i}" for i in range(count)]
    return names
