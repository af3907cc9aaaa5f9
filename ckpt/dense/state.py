"""Capture and load the dense half of the model: MLPs, data-parallel tables, dense optimizer.

Captured as detached host copies during the checkpoint stall (so training can go on
changing the live tensors) and keyed by parameter name, which does not depend on the
world size or sharding plan, so a dense file restores into any of them.
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt.types import RestoreError
from sharding.dmp import ShardedModel
from sharding.shard_views import unwrapped


def _dense_params(sharded: ShardedModel) -> dict[str, torch.Tensor]:
    """Parameters not owned by a fused embedding kernel (those travel as rows)."""
    return {n: p for n, p in sharded.model.named_parameters() if not hasattr(p, "_in_backward_optimizers")}


def _dense_optimizer(sharded: ShardedModel) -> Any:
    return sharded.dense_optimizer


def _copy(tree: Any) -> Any:
    if torch.is_tensor(tree):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_copy(v) for v in tree]
    return tree


class DenseCapture:
    """Host copies of dense parameters, buffers and the dense optimizer's state, for rank 0's
    stall. The parameters and buffers are found once, not at every capture
    (docs/history/BENCHMARKS-2026-11.md, "The first snapshot's slab, rank 0's dense capture"); their tensors stay
    the same for the model's life, as `load` copies into them. The optimizer's state is read
    at each capture (it may add tensors as training goes)."""

    def __init__(self, sharded: ShardedModel) -> None:
        self.sharded = sharded
        self._params = _dense_params(sharded)
        self._buffers = dense_buffers(sharded.model)
        self._root = type(unwrapped(sharded.model)).__name__
        self._param_names = _optimizer_param_names(_dense_optimizer(sharded), sharded.model)

    def __call__(self) -> dict[str, Any]:
        return {
            "params": _copy(self._params),
            "buffers": _copy(self._buffers),
            "optimizer": _copy(_dense_optimizer(self.sharded).state_dict()),
            "root": self._root,  # the class every name is relative to (an export's `fqn_root`)
            "optimizer_param_names": self._param_names,
        }


def dense_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's buffers but the id-to-slot state of managed-collision tables: that is per
    rank (each holds its own shard's mapping), travels on each rank's stream
    (ckpt/stream/mapping.py), and rank 0's copy loaded on every rank would give each the wrong
    slots."""
    from torchrec.distributed.mc_modules import ShardedManagedCollisionCollection  # noqa: PLC0415

    modules = unwrapped(model).named_modules()  # named as `model.named_buffers()` names them (DMP strips its `module.`)
    per_rank = tuple(f"{n}." for n, m in modules if isinstance(m, ShardedManagedCollisionCollection))
    return {n: b for n, b in model.named_buffers() if not (per_rank and n.startswith(per_rank))}


def _optimizer_param_names(optimizer: Any, model: torch.nn.Module) -> list[str]:
    """A plain `torch.optim` optimizer keys its state by position (over its param groups, in
    order): the parameter FQN of each position, so an export can name them. Empty for an
    optimizer keyed by name already (torchrec's KeyedOptimizer) or without param groups."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups or any(isinstance(p, str) for g in groups for p in g.get("params", [])):
        return []
    names = {id(p): n for n, p in model.named_parameters()}
    return [names.get(id(p), f"param{i}") for i, p in enumerate(p for g in groups for p in g["params"])]


def _create_lazy_state(optimizer: Any, saved: dict[str, Any]) -> None:
    """A torchrec `KeyedOptimizer` loads only into state it already has, which a fresh one
    creates at its first step (SGD's momentum, Adam's moments): torchrec's `init_state()` takes a
    step with zero gradients to create it. Run before the parameters are copied in (a decaying
    step with zero gradients would move them); the load then overwrites every state it created."""
    init_state = getattr(optimizer, "init_state", None)
    if callable(init_state) and len(getattr(optimizer, "state", {})) < len(saved.get("state", {})):
        with torch.enable_grad():
            init_state()
        optimizer.zero_grad(set_to_none=True)


def _load_optimizer(optimizer: Any, saved: dict[str, Any]) -> None:
    """`optimizer.load_state_dict(saved)`; a torchrec `KeyedOptimizer` that keeps its param
    groups (the Checkpointer turns that on) still loads a state saved without them (a
    checkpoint of an older deltarec, or a state captured before the Checkpointer was built)."""
    keeps_groups = bool(getattr(optimizer, "defaults", {}).get("_save_param_groups"))
    if keeps_groups and "param_groups" not in saved:
        optimizer.save_param_groups(False)
        try:
            optimizer.load_state_dict(saved)
        finally:
            optimizer.save_param_groups(True)
        return
    optimizer.load_state_dict(saved)


@torch.no_grad()
def load(sharded: ShardedModel, state: dict[str, Any]) -> None:
    """Copy a captured dense state into the live model; names must match exactly."""
    _create_lazy_state(_dense_optimizer(sharded), state["optimizer"])
    params = _dense_params(sharded)
    missing = sorted(set(params) - set(state["params"]))
    extra = sorted(set(state["params"]) - set(params))
    if missing or extra:
        raise RestoreError(
            f"dense state does not match this model: missing {missing[:3]}, unexpected {extra[:3]} "
            "(was the checkpoint written with another model config?)"
        )
    for name, p in params.items():
        src = state["params"][name]
        if src.shape != p.shape:
            raise RestoreError(f"dense parameter {name}: checkpoint shape {tuple(src.shape)} != model {tuple(p.shape)}")
        p.copy_(src)
    buffers = dense_buffers(sharded.model)
    for name, b in state["buffers"].items():
        if name in buffers:
            buffers[name].copy_(b)
    _load_optimizer(_dense_optimizer(sharded), state["optimizer"])
