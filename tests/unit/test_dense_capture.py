"""Rank 0's dense capture (ckpt/dense/state.py `DenseCapture`): it finds the parameters once,
so each capture must still hold the values of that moment, in tensors of its own."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from ckpt.dense.state import DenseCapture, load


def _sharded(seed: int) -> SimpleNamespace:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    return SimpleNamespace(model=model, optimizer=SimpleNamespace(optimizers=[("dense", opt)]), dense_optimizer=opt)


def _step(sharded: SimpleNamespace) -> None:
    opt = sharded.optimizer.optimizers[-1][1]
    opt.zero_grad()
    sharded.model(torch.randn(8, 5)).square().mean().backward()
    opt.step()


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_each_capture_holds_the_values_of_its_moment_in_its_own_tensors():
    sharded = _sharded(0)
    capture = DenseCapture(sharded)
    _step(sharded)
    first = capture()
    _step(sharded)
    second = capture()
    live = dict(sharded.model.named_parameters())
    assert all(torch.equal(second["params"][n], p) for n, p in live.items())
    assert not any(torch.equal(first["params"][n], p) for n, p in live.items()), "a capture aliases the live tensors"
    assert _same(second["optimizer"], sharded.optimizer.optimizers[-1][1].state_dict())
    assert second["optimizer"]["state"][0]["sum"].data_ptr() != first["optimizer"]["state"][0]["sum"].data_ptr()
    assert torch.equal(second["buffers"]["1.running_mean"], sharded.model[1].running_mean)


def test_a_capture_loaded_into_another_model_makes_it_train_like_the_original():
    a, b = _sharded(1), _sharded(2)
    capture = DenseCapture(a)
    _step(a)
    load(b, capture())  # into b's own tensors: a's capture keeps finding a's
    torch.manual_seed(3)
    _step(a)
    torch.manual_seed(3)
    _step(b)
    assert _same(DenseCapture(b)(), capture())


def _keyed(seed: int) -> SimpleNamespace:
    """A model whose dense optimizer is torchrec's CombinedOptimizer of KeyedOptimizerWrappers
    (Adagrad; SGD with momentum, whose state a fresh optimizer creates only at its first step)."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 1))
    params = dict(model.named_parameters())
    first = {k: p for k, p in params.items() if k.startswith("0.")}
    second = {k: p for k, p in params.items() if k.startswith("1.")}
    opt = CombinedOptimizer(
        [
            ("a", KeyedOptimizerWrapper(first, lambda ps: torch.optim.Adagrad(ps, lr=0.1))),
            ("b", KeyedOptimizerWrapper(second, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1))),
        ]
    )
    opt.save_param_groups(True)  # what the Checkpointer turns on
    return SimpleNamespace(model=model, optimizer=SimpleNamespace(optimizers=[("dense", opt)]), dense_optimizer=opt)


def test_a_keyed_optimizer_restores_into_a_fresh_one_with_its_learning_rate():
    """A fresh KeyedOptimizer has no momentum yet, and torchrec's strict load refuses to load
    into state that does not exist: `load` creates it first (a step with zero gradients, before
    the parameters are copied in, so weight decay moves nothing), then loads. The learning rate
    a scheduler set comes back with the param groups."""
    a, b = _keyed(1), _keyed(2)
    for _ in range(3):
        _step(a)
    for group in a.dense_optimizer.param_groups:
        group["lr"] = 0.025  # as an LR scheduler leaves it
    load(b, DenseCapture(a)())
    assert _same(b.dense_optimizer.state_dict(), a.dense_optimizer.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert [g["lr"] for g in b.dense_optimizer.param_groups] == [0.025, 0.025]
    assert all(p.grad is None for p in b.model.parameters())
    torch.manual_seed(3)
    _step(a)
    torch.manual_seed(3)
    _step(b)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


def test_a_state_saved_without_param_groups_still_loads_into_a_keyed_optimizer_that_keeps_them():
    a, b = _keyed(1), _keyed(2)
    _step(a)
    a.dense_optimizer.save_param_groups(False)  # an older checkpoint, or captured before the Checkpointer
    saved = DenseCapture(a)()
    assert "param_groups" not in saved["optimizer"]
    load(b, saved)
    assert _same(b.dense_optimizer.state_dict()["state"], a.dense_optimizer.state_dict()["state"])
    assert b.dense_optimizer.defaults["_save_param_groups"] is True
