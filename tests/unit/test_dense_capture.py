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
