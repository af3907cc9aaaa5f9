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


@dataclass
class TableConfig:
    """One embedding table: its rows, width, the features that look it up, its sharding."""

    name: str
    num_embeddings: int
    embedding_dim: int
    features: list[str]
    sharding: ShardingType | None = None  # None: take sharding.default


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
