"""The DLRM model from config: torchrec's DLRM (or DLRM_DCN) over tables declared in YAML.

Hashed tables (`managed_collision`) sit in their own ManagedCollisionEmbeddingBagCollection
beside the ordinary EmbeddingBagCollection (`HashedSparseArch`); the interaction sees every
feature's pooled vector in table order, as with ordinary tables only. A model without hashed
tables is torchrec's DLRM unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHEvictionPolicy,
    MCHManagedCollisionModule,
)

from sharding.config import ManagedCollisionConfig, TableConfig
from trainer.config import ModelConfig

_POLICIES: dict[str, type[MCHEvictionPolicy]] = {
    "distance_lfu": DistanceLFU_EvictionPolicy,
    "lfu": LFU_EvictionPolicy,
    "lru": LRU_EvictionPolicy,
}


def feature_names(cfg: ModelConfig) -> list[str]:
    """Every sparse feature in table order: the key order of the model's KJT input."""
    return [f for t in cfg.tables for f in t.features]


def feature_cardinalities(cfg: ModelConfig) -> list[int]:
    """Rows of the table each feature looks up, in `feature_names` order."""
    return [t.num_embeddings for t in cfg.tables for _ in t.features]


def feature_hash_sizes(cfg: ModelConfig) -> list[int]:
    """Per feature in `feature_names` order, the raw id space of its hashed table; 0 for an
    ordinary table's feature (ids are rows)."""
    return [t.managed_collision.input_hash_size if t.managed_collision else 0 for t in cfg.tables for _ in t.features]


def _bag_config(t: TableConfig) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name=t.name, embedding_dim=t.embedding_dim, num_embeddings=t.num_embeddings, feature_names=list(t.features)
    )


def _mch(t: TableConfig, mc: ManagedCollisionConfig) -> MCHManagedCollisionModule:
    """The table's managed-collision module: raw ids of `input_hash_size` onto its rows."""
    return MCHManagedCollisionModule(
        zch_size=t.num_embeddings,
        device=torch.device("meta"),
        eviction_policy=_POLICIES[mc.eviction_policy](),
        eviction_interval=mc.eviction_interval,
        input_hash_size=mc.input_hash_size,
    )


def managed_collision_collection(tables: list[TableConfig]) -> ManagedCollisionEmbeddingBagCollection:
    """The hashed tables (each with `managed_collision`) as one managed-collision bag collection
    on the meta device (DMP materialises each rank's shards)."""
    configs = [_bag_config(t) for t in tables]
    mchs: dict[str, MCHManagedCollisionModule] = {}
    for t in tables:
        assert t.managed_collision is not None, t.name
        mchs[t.name] = _mch(t, t.managed_collision)
    return ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables=configs, device=torch.device("meta")),
        ManagedCollisionCollection(mchs, configs),
    )


class HashedSparseArch(nn.Module):
    """DLRM's sparse arch over ordinary and hashed tables: the ordinary ones in
    `embedding_bag_collection` (absent when every table is hashed), the hashed ones in
    `managed_collision`; both read the whole input KJT (each takes its own features) and the
    pooled vectors are stacked in `feature_names` order into B x F x D, as torchrec's
    SparseArch does."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        ordinary = [t for t in cfg.tables if t.managed_collision is None]
        hashed = [t for t in cfg.tables if t.managed_collision is not None]
        self.embedding_bag_collection: EmbeddingBagCollection | None = (
            EmbeddingBagCollection(tables=[_bag_config(t) for t in ordinary], device=torch.device("meta")) if ordinary else None
        )
        self.managed_collision = managed_collision_collection(hashed)
        self._sparse_feature_names = feature_names(cfg)
        self._hashed_features = frozenset(f for t in hashed for f in t.features)
        self.F = len(self._sparse_feature_names)
        self.D = cfg.tables[0].embedding_dim

    @property
    def sparse_feature_names(self) -> list[str]:
        return self._sparse_feature_names

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        # written to trace with torch.fx (TrainPipelineSparseDist finds the sharded modules'
        # inputs so): outputs are indexed, never iterated or unpacked
        hashed = self.managed_collision(features)[0].to_dict()
        ordinary = self.embedding_bag_collection(features).to_dict() if self.embedding_bag_collection is not None else {}
        pooled = [hashed[f] if f in self._hashed_features else ordinary[f] for f in self._sparse_feature_names]
        return torch.cat(pooled, dim=1).reshape(-1, self.F, self.D)


def build_model(cfg: ModelConfig, dense_device: torch.device) -> DLRMTrain:
    """An unsharded DLRMTrain: embedding tables on the meta device (DMP materialises
    only each rank's shards), the MLPs on `dense_device`. With hashed tables, its sparse arch
    is a `HashedSparseArch` (the MLPs, drawn first, are those of the same model without them)."""
    ebc = EmbeddingBagCollection(tables=[_bag_config(t) for t in cfg.tables], device=torch.device("meta"))
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=cfg.dense_in_features,
        dense_arch_layer_sizes=list(cfg.dense_arch_layer_sizes),
        over_arch_layer_sizes=list(cfg.over_arch_layer_sizes),
        dense_device=dense_device,
    )
    if cfg.kind == "dlrm_dcn":
        dlrm = DLRM_DCN(dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim, **common)
    else:
        dlrm = DLRM(**common)
    if any(t.managed_collision is not None for t in cfg.tables):
        dlrm.sparse_arch = HashedSparseArch(cfg)
    return DLRMTrain(dlrm)
