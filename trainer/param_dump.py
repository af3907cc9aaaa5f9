"""Per-rank dump of every local parameter and optimizer state, keyed stably.

Used to check determinism (two runs, same config and seed, must end bit-identical) and to
compare runs by eye. It is not a checkpoint: it neither reshards nor restores.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer

from sharding.shard_views import ShardMap


def local_tensors(model: nn.Module, optimizer: CombinedOptimizer) -> dict[str, torch.Tensor]:
    """Copies of this rank's embedding shards (weights and fused optimizer state), its
    dense parameters and its dense optimizer state."""
    out: dict[str, torch.Tensor] = {}
    for s in ShardMap.from_model(model, managed_collision=True).shards:
        key = f"emb/{s.table}/r{s.row_offset}/c{s.col_offset}"
        out[f"{key}/weight"] = s.weight.detach().clone()
        for name, state in s.optimizer_states.items():
            out[f"{key}/{name}"] = state.detach().clone()
    for name, p in model.named_parameters():
        if not hasattr(p, "_in_backward_optimizers"):
            out[f"dense/{name}"] = p.detach().clone()
    dense_opt = optimizer.optimizers[-1][1]
    for pname, state in dense_opt.state_dict()["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                out[f"dense_opt/{pname}/{k}"] = v.detach().clone()
    return out


def dump(model: nn.Module, optimizer: CombinedOptimizer, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(local_tensors(model, optimizer), path)
