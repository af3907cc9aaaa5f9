"""The DLRM model from config: torchrec's DLRM (or DLRM_DCN) over tables declared in YAML."""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain

from trainer.config import ModelConfig


def feature_names(cfg: ModelConfig) -> list[str]:
    """Every sparse feature in table order: the key order of the model's KJT input."""
    return [f for t in cfg.tables for f in t.features]


def feature_cardinalities(cfg: ModelConfig) -> list[int]:
    """Rows of the table each feature looks up, in `feature_names` order."""
    return [t.num_embeddings for t in cfg.tables for _ in t.features]


def build_model(cfg: ModelConfig, dense_device: torch.device) -> DLRMTrain:
    """An unsharded DLRMTrain: embedding tables on the meta device (DMP materialises
    only each rank's shards), the MLPs on `dense_device`."""
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t.name,
                embedding_dim=t.embedding_dim,
                num_embeddings=t.num_embeddings,
                feature_names=list(t.features),
            )
            for t in cfg.tables
        ],
        device=torch.device("meta"),
    )
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
    return DLRMTrain(dlrm)
