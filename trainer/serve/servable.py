"""What deltarec-serve serves: a model, how it scores a request, and the request's schema.

A `Servable` is the unsharded model of the run (the module whose state_dict names are the
checkpoint's FQNs) and its scoring function. deltarec-train's DLRM is one
(trainer/serve/versions.py `dlrm_servable`); a user's own model is another, returned by the
factory that `deltarec-serve --model package.module:function` names (docs/serving.md,
"Serving your own model"):

    def served_model() -> Servable:
        return Servable(TwoTower(), score=TwoTower.score)

`score(module, dense, sparse)` gets one copy of the module (the server keeps two), the
request's dense values (float32 ``[n, dense_in_features]``) and its ids as a
`KeyedJaggedTensor` of every feature of `features` (ids only: a weighted feature's weights
are the scoring function's to give), and returns ``n`` scores. It runs under
`torch.inference_mode`, on the CPU, with `serve.threads` threads.

The request schema comes from the module: each feature of its `EmbeddingBagCollection`s and
`EmbeddingCollection`s (at any depth) takes ids below its table's row count, and each feature
of a managed-collision (hashed-id) table takes raw ids, below its ``input_hash_size``
(trainer/serve/hashed.py). Its tables are the parameters of those collections, keyed as the
checkpoint keys them (their FQN without ``.weight``, after `fqn_prefix`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection, KeyedJaggedTensor

from common.errors import DeltarecError
from trainer.serve.hashed import HashedTable, hashed_tables, mapping_buffers
from trainer.serve.requests import Batch, FeatureLayout

#: The modules whose parameters are tables (rows in the stream) and whose features are the request's.
EMBEDDING_MODULES = (EmbeddingBagCollection, EmbeddingCollection)


class ServableError(DeltarecError):
    """A model the server cannot serve, or a scoring function that broke its contract."""


@dataclass(frozen=True)
class Servable:
    """A model to serve (see the module doc).

    `features` are the request's sparse features, in the order of the `KeyedJaggedTensor`
    `score` gets (default: every feature of the module's embedding collections, in module
    order). `fqn_prefix` is what the checkpoint's FQNs carry in front of the module's (``model.``
    for the DLRM inside deltarec-train's DLRMTrain); `root`, when set, the ``fqn_root`` a
    checkpoint must have."""

    module: nn.Module
    score: Callable[[Any, torch.Tensor, KeyedJaggedTensor], torch.Tensor]
    dense_in_features: int = 0
    features: Sequence[str] | None = None
    fqn_prefix: str = ""
    root: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise ServableError(f"Servable.module must be a torch.nn.Module, got {type(self.module).__name__}")
        if not callable(self.score):
            raise ServableError("Servable.score must be callable: score(module, dense, sparse) -> scores")
        if self.dense_in_features < 0:
            raise ServableError(f"Servable.dense_in_features = {self.dense_in_features} is negative")
        hashed_tables(self.module, self.fqn_prefix)  # refuses a managed-collision module it cannot serve
        rows = embedding_features(self.module)
        if not rows:
            raise ServableError(f"{type(self.module).__name__} has no EmbeddingBagCollection or EmbeddingCollection")
        unknown = [f for f in self.features or () if f not in rows]
        if unknown:
            raise ServableError(f"Servable.features: {unknown[0]!r} is no feature of the model's tables ({', '.join(rows)})")

    @property
    def name(self) -> str:
        return type(self.module).__name__

    @property
    def hashed(self) -> list[HashedTable]:
        """The module's managed-collision tables (their features take raw ids)."""
        return hashed_tables(self.module, self.fqn_prefix)

    def layout(self) -> FeatureLayout:
        """What a request's sample must look like: a hashed table's features take raw ids."""
        rows = embedding_features(self.module)
        rows.update({f: table.ids_below for table in self.hashed for f in table.features})
        features = tuple(self.features) if self.features is not None else tuple(rows)
        return FeatureLayout(self.dense_in_features, features, tuple(rows[f] for f in features))

    def fresh_module(self) -> nn.Module:
        """A copy of the module on the CPU in eval mode, every tensor on the meta device
        materialised uninitialised (a checkpoint fills it)."""
        return materialise(copy.deepcopy(self.module), unread=mapping_buffers(self.module))

    def table_weights(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Each table's weight in `module`, by its key in the stream (its FQN without ``.weight``)."""
        return {
            self.fqn_prefix + fqn.removesuffix(".weight"): p.data
            for path, sub in module.named_modules()
            if isinstance(sub, EMBEDDING_MODULES)
            for fqn, p in sub.named_parameters(prefix=path)
        }

    def predict(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        """The scores [n] of `batch` on `module` (a copy from `fresh_module`)."""
        with torch.inference_mode():
            out = self.score(module, batch.dense, batch.sparse)
        if not isinstance(out, torch.Tensor) or out.numel() != batch.size:
            got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ServableError(f"{self.name}'s score returned {got} for {batch.size} samples; expected {batch.size} scores")
        return out.reshape(-1)


def embedding_features(module: nn.Module) -> dict[str, int]:
    """Every feature of `module`'s embedding collections, in module order, and the rows of its
    table (the fewest, for a feature that two collections read)."""
    rows: dict[str, int] = {}
    for sub in module.modules():
        if isinstance(sub, EmbeddingBagCollection):
            configs: Sequence[Any] = sub.embedding_bag_configs()
        elif isinstance(sub, EmbeddingCollection):
            configs = sub.embedding_configs()
        else:
            continue
        for table in configs:
            for feature in table.feature_names:
                rows[feature] = min(rows.get(feature, table.num_embeddings), table.num_embeddings)
    return rows


def materialise(module: nn.Module, unread: Collection[str] = ()) -> nn.Module:
    """`module` with the tensors it holds on the meta device made real (uninitialised) on the
    CPU, one submodule at a time (a module's other tensors, such as buffers computed at
    construction and left out of its state_dict, keep their values), then in eval mode.
    `unread` are buffers a served copy never reads (a managed-collision module's own mapping)."""
    saved = set(module.state_dict(keep_vars=True)) | set(unread)
    for path, sub in module.named_modules():
        own = [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]
        if not any(t.is_meta for _, t in own):
            continue
        lost = [
            f"{path}.{name}" if path else name
            for name, b in sub.named_buffers(recurse=False)
            if b.is_meta and (f"{path}.{name}" if path else name) not in saved
        ]
        if lost:
            raise ServableError(f"buffer {lost[0]} is on the meta device and no checkpoint holds it: build it on the CPU")
        sub.to_empty(device="cpu", recurse=False)
    return module.to("cpu").eval()
