"""What a full checkpoint of a job weighs: the bytes a `torch.save` or `dcp.save` of the model
and its optimizer state (fp32) writes each time, against which the quickstart puts the bytes
deltarec wrote."""

from __future__ import annotations

import torch

from sharding.plan import shard_bytes
from trainer.config import JobConfig
from trainer.model import build_model

#: The dense optimizer's state values per parameter value.
_DENSE_STATE_PER_VALUE = {"adagrad": 1, "adam": 2, "sgd": 0}


def full_checkpoint_bytes(job: JobConfig) -> int:
    """fp32 bytes of every table and dense parameter and of their optimizer state."""
    tables = sum(shard_bytes(t.num_embeddings, t.embedding_dim, job.optimizer.sparse.name) for t in job.model.tables)
    model = build_model(job.model, torch.device("meta"))
    dense = sum(p.numel() for name, p in model.named_parameters() if "embedding_bag_collection" not in name)
    return tables + 4 * dense * (1 + _DENSE_STATE_PER_VALUE[job.optimizer.dense.name])
