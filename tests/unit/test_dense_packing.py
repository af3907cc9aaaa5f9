"""Dense files hold their tensors packed into one flat tensor per dtype: everything comes back
as it was given, a file of an older version (unpacked) reads as before, and a newer packing
is one clear error."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt.dense.packing import PACKED, pack, unpack
from ckpt.dense.store import DenseRef, DenseStore, DenseStoreError


def _state(g: torch.Generator) -> dict[str, Any]:
    """What a dense state holds: parameters, an optimizer's state (int keys, 0-dim steps), RNG
    states, loop states of every rank, plain values; odd tensors too (empty, non-contiguous,
    several dtypes)."""
    w = torch.randn(4, 6, generator=g)
    return {
        "params": OrderedDict([("mlp.weight", w), ("mlp.bias", torch.randn(4, generator=g))]),
        "optimizer": {
            "state": {0: {"step": torch.tensor(600.0), "sum": torch.rand(4, 6, generator=g)}, 1: {"step": torch.tensor(600.0)}},
            "param_groups": [{"lr": 0.05, "params": [0, 1]}],
        },
        "rng": torch.get_rng_state(),
        "trainers": [{"reader": {"next_global_batch": 14}, "seen": torch.arange(5)}, {"reader": {"next_global_batch": 15}}],
        "odd": (torch.zeros(0, 3), w.t(), torch.tensor([True, False]), torch.randn(3, generator=g).to(torch.bfloat16), "x", 7),
        "step": 7,
        "config_sha256": "ab" * 32,
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_a_packed_state_comes_back_as_it_was_given(tmp_path: Path, replay_seed) -> None:  # noqa: ANN001
    state = _state(replay_seed.torch_generator())
    store = DenseStore(tmp_path)
    ref = store.write(3, state)
    assert _same(store.read(ref), state), replay_seed
    # on disk: one tensor per dtype (float32, int64, uint8, bool, bfloat16), the rest its structure
    raw = torch.load(ref.path, weights_only=True)
    assert raw[PACKED] == 1 and sorted(raw["tensors"]) == ["bfloat16", "bool", "float32", "int64", "uint8"]
    assert _same(unpack(pack(state)), state)
    back = store.read(ref)["params"]["mlp.bias"]  # its own memory, as an unpacked file's tensor
    assert back.untyped_storage().nbytes() == back.numel() * back.element_size()


def test_a_dense_file_of_an_older_version_reads_as_before(tmp_path: Path, replay_seed) -> None:  # noqa: ANN001
    """Files written before packing: `torch.save` of the state itself."""
    state = _state(replay_seed.torch_generator())
    path = tmp_path / "dense-00000001.pt"
    torch.save(state, path)
    ref = DenseRef(str(path), hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size)
    assert _same(DenseStore(tmp_path).read(ref), state), replay_seed


def test_a_newer_packing_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "dense-00000002.pt"
    torch.save({**pack({"w": torch.zeros(2)}), PACKED: 2}, path)
    ref = DenseRef(str(path), hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size)
    with pytest.raises(DenseStoreError, match=r"dense-00000002\.pt: packed dense state of version 2, .*upgrade deltarec$"):
        DenseStore(tmp_path).read(ref)
