"""Readers from config: the training stream and the held-out evaluation stream."""

from __future__ import annotations

import logging
from typing import Any

from sharding.process_group import DistEnv
from trainer.config import JobConfig
from trainer.data.reader import Reader
from trainer.data.synthetic import SyntheticClickStream
from trainer.model import feature_cardinalities, feature_hash_sizes, feature_names

logger = logging.getLogger(__name__)


def make_reader(cfg: JobConfig, env: DistEnv, split: str) -> Reader | None:
    """This rank's reader of `split` ("train" or "eval"); None when there is no eval data."""
    assert split in ("train", "eval"), split
    common: dict[str, Any] = dict(
        feature_names=feature_names(cfg.model),
        num_embeddings=feature_cardinalities(cfg.model),
        batch_size=cfg.data.batch_size,
        rank=env.rank,
        world_size=env.world_size,
    )
    if cfg.data.kind == "synthetic":
        s = cfg.data.synthetic
        return SyntheticClickStream(
            num_dense=cfg.model.dense_in_features,
            seed=cfg.run.seed,
            zipf_exponent=s.zipf_exponent,
            ids_per_feature=s.ids_per_feature,
            stream=split,
            hash_sizes=feature_hash_sizes(cfg.model),
            **common,
        )
    if cfg.data.kind == "criteo_npy":
        from trainer.data.criteo_npy import CriteoNpyReader

        days = cfg.data.criteo_npy.train_days if split == "train" else cfg.data.criteo_npy.eval_days
        if not days:
            if env.rank == 0:
                logger.warning("data.criteo_npy.eval_days is empty: evaluation is skipped")
            return None
        return CriteoNpyReader(paths=days, **common)
    from trainer.data.criteo import CriteoTsvReader  # only Criteo jobs pay for its import

    c = cfg.data.criteo
    paths = c.train_paths if split == "train" else c.eval_paths
    if not paths:
        if env.rank == 0:
            logger.warning("data.criteo.eval_paths is empty: evaluation is skipped")
        return None
    return CriteoTsvReader(paths=paths, on_malformed=c.on_malformed, **common)
