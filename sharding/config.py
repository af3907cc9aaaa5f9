"""The config sections sharding reads: the tables to place, how to place them, the optimizers
fused into (and beside) the sharded kernels.

`trainer/config.py` assembles these into the job config; sharding never sees the rest of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ShardingType = Literal["auto", "table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]
SparseOptimizer = Literal["row_wise_adagrad", "adagrad", "sgd", "adam"]
DenseOptimizer = Literal["adagrad", "sgd", "adam"]
#: torchrec's MCH eviction policies by their config name (checked at load, naming the table)
EVICTION_POLICIES = ("distance_lfu", "lfu", "lru")


@dataclass
class ManagedCollisionConfig:
    """A hashed table: raw ids of `input_hash_size` values share the table's rows, torchrec's
    managed-collision module (MCH) admitting new ids and evicting cold ones every
    `eviction_interval` training steps by `eviction_policy` (docs/design/managed-collision.md)."""

    input_hash_size: int
    eviction_interval: int = 100
    eviction_policy: str = "distance_lfu"  # one of EVICTION_POLICIES


@dataclass(repr=False)
class TableConfig:
    """One embedding table: its rows, width, the features that look it up, its sharding."""

    name: str
    num_embeddings: int
    embedding_dim: int
    features: list[str]
    sharding: ShardingType | None = None  # None: take sharding.default
    # None: an ordinary table, ids in [0, num_embeddings); else a hashed one (row_wise only)
    managed_collision: ManagedCollisionConfig | None = None

    def __repr__(self) -> str:
        """The dataclass repr, `managed_collision` only when set: the job's model digest (the
        repr of its model section) of an ordinary table stays what it was before hashed tables."""
        fields = f"name={self.name!r}, num_embeddings={self.num_embeddings!r}, embedding_dim={self.embedding_dim!r}, "
        fields += f"features={self.features!r}, sharding={self.sharding!r}"
        if self.managed_collision is not None:
            fields += f", managed_collision={self.managed_collision!r}"
        return f"TableConfig({fields})"


@dataclass
class ShardingConfig:
    """How tables are placed on ranks and how ranks find each other."""

    default: ShardingType = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # env:// under torchrun/slurm; tests use file:///<tmp>/rdzv for a file rendezvous.
    init_method: str = "env://"
    timeout_s: int = 300

    def type_of(self, table: TableConfig) -> ShardingType:
        """The table's own sharding type, else this section's default."""
        return table.sharding or self.default


@dataclass
class SparseOptimizerConfig:
    """The optimizer fused into the embedding kernels (applied in backward)."""

    name: SparseOptimizer = "row_wise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8


@dataclass
class DenseOptimizerConfig:
    """The optimizer of the MLPs and of data-parallel tables."""

    name: DenseOptimizer = "adagrad"
    lr: float = 0.05
    eps: float = 1e-8


@dataclass
class OptimizerConfig:
    sparse: SparseOptimizerConfig = field(default_factory=SparseOptimizerConfig)
    dense: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)
