"""Raw ids in, slots out: how a served copy of a model with managed-collision (hashed-id)
tables answers a request as training would.

A managed-collision table's rows are stored by slot; which slot a raw id reads is the
mapping the trainer's shards held at the checkpoint, written beside the rows as mapping
records (docs/design/managed-collision.md). The served module is unsharded, and torchrec's
unsharded `MCHManagedCollisionModule.remap` would read its own buffers (which no checkpoint
fills: the mapping is not in the dense file) and send every id it does not hold to one miss
row, where the sharded module sends it to the miss row of the shard it is routed to. So each
served copy replaces every MCH module's ``remap`` with a `SlotRemap` that reads the copy's
own `McGlobal` (the shards' records folded to the copy's checkpoint and joined), swapped in
with the copy: a response never mixes one checkpoint's rows with another's mapping.

The request's ids for such a feature are raw ids: below the module's ``input_hash_size``, or
any non-negative int64 when the module hashes its input (its ``input_hash_func`` still runs
first, in the module's forward, as in training).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import JaggedTensor

from common.errors import DeltarecError
from sharding.managed_collision import McGlobal

#: A feature of a module that hashes its input takes any non-negative int64.
ANY_ID = 2**63 - 1


class HashedServingError(DeltarecError):
    """A managed-collision module the server cannot answer by raw id."""


@dataclass(frozen=True)
class HashedTable:
    """One managed-collision table of the served module."""

    key: str  # its key in the stream: FQN of its weight (with the servable's prefix), without ".weight"
    path: str  # FQN of its MCH module in the served module
    features: tuple[str, ...]  # the request features it reads
    ids_below: int  # a raw id must be below this


def _collections(module: nn.Module) -> Iterator[tuple[str, nn.Module, ManagedCollisionCollection]]:
    """Each managed-collision collection of `module` (`_managed_collision_collection` of a
    ManagedCollisionEmbedding(Bag)Collection), with the embedding module it feeds."""
    for path, sub in module.named_modules():
        mcc = getattr(sub, "_managed_collision_collection", None)
        inner = getattr(sub, "_embedding_module", None)
        if isinstance(mcc, ManagedCollisionCollection) and isinstance(inner, nn.Module):
            yield path, inner, mcc


def hashed_tables(module: nn.Module, fqn_prefix: str = "") -> list[HashedTable]:
    """Every managed-collision table of `module`, in module order. Refuses, in one line, a
    managed-collision module other than MCH (its mapping is not checkpointed) and one outside
    a ManagedCollisionEmbedding(Bag)Collection."""
    out: list[HashedTable] = []
    found: set[int] = set()
    for path, inner, mcc in _collections(module):
        found.add(id(mcc))
        weights = {fqn.removesuffix(".weight").rsplit(".", 1)[-1]: fqn for fqn, _ in inner.named_parameters()}
        prefix = f"{path}." if path else ""
        features = {cfg.name: tuple(cfg.feature_names) for cfg in mcc.embedding_configs()}
        for name, mch in mcc._managed_collision_modules.items():
            where = f"{prefix}_managed_collision_collection._managed_collision_modules.{name}"
            if not isinstance(mch, MCHManagedCollisionModule):
                raise HashedServingError(
                    f"module {where} is a {type(mch).__name__}: deltarec serves MCHManagedCollisionModule tables only"
                )
            if name not in weights:
                raise HashedServingError(f"module {where} names table {name}, which {prefix}_embedding_module lacks")
            key = fqn_prefix + prefix + "_embedding_module." + weights[name].removesuffix(".weight")
            below = ANY_ID if mch._input_hash_func is not None else int(mch.input_size())
            out.append(HashedTable(key, where, features.get(name, ()), below))
    stray = [p or "<root>" for p, m in module.named_modules() if isinstance(m, ManagedCollisionCollection) and id(m) not in found]
    if stray:
        raise HashedServingError(
            f"module {stray[0]} is a managed-collision collection outside a ManagedCollisionEmbedding(Bag)Collection"
        )
    return out


@dataclass
class SlotMaps:
    """One served copy's mapping of every managed-collision table: the table key -> its shards
    joined at the copy's checkpoint (`McGlobal`); empty until the copy holds one."""

    tables: dict[str, McGlobal] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(g.raw_ids.nbytes + g.slots.nbytes for g in self.tables.values())

    def slots(self, key: str, raw_ids: torch.Tensor) -> torch.Tensor:
        """The slots `raw_ids` of table `key` read at the copy's checkpoint."""
        table = self.tables.get(key)
        if table is None:
            raise HashedServingError(f"table {key}: the served checkpoint holds no id mapping for it")
        ids = raw_ids.detach().to("cpu", torch.int64).numpy()
        return torch.from_numpy(np.ascontiguousarray(table.slots_of(ids))).to(raw_ids.dtype)


@dataclass(frozen=True)
class SlotRemap:
    """What a served copy's MCH module calls in place of its own ``remap`` (the module doc)."""

    maps: SlotMaps
    key: str

    def __call__(self, features: dict[str, JaggedTensor], *_: Any, **__: Any) -> dict[str, JaggedTensor]:
        return {
            name: JaggedTensor(
                values=self.maps.slots(self.key, jt.values()),
                lengths=jt.lengths(),
                offsets=jt.offsets(),
                weights=jt.weights_or_none(),
            )
            for name, jt in features.items()
        }


def install(module: nn.Module, tables: list[HashedTable], maps: SlotMaps) -> None:
    """Make every MCH module of `tables` in `module` (one served copy) read `maps`."""
    for table in tables:  # an instance attribute: this copy's module only
        module.get_submodule(table.path).remap = SlotRemap(maps, table.key)  # type: ignore[assignment]


def mapping_buffers(module: nn.Module) -> set[str]:
    """FQNs of the buffers of `module`'s managed-collision collections: the mapping, which the
    stream's records carry and the dense file leaves out."""
    out: set[str] = set()
    for path, _, mcc in _collections(module):
        prefix = f"{path}._managed_collision_collection." if path else "_managed_collision_collection."
        out.update(prefix + name for name, _ in mcc.named_buffers())
    return out
