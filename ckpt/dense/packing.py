"""A dense state's tensors packed into one flat tensor per dtype before `torch.save`.

`torch.save` pickles every tensor through Python callbacks (its storage, offset, shape,
stride, hooks): for the few dozen small tensors of a dense state (MLP weights, their optimizer
state, RNG states) that is most of a dense file's cost, paid once a step by a job that
checkpoints every step. Packed, the file holds one tensor per dtype and the state's structure
with each tensor replaced by a reference tuple (`deltarec_tensor`, dtype, offset, shape), plain
data that `torch.load(weights_only=True)` reads as it reads any state (docs/design/formats.md,
"Dense file"). A file written before packing existed loads as it always did. (A user's state
holding a 4-tuple that starts with the string `deltarec_tensor` would be misread: none does.)
Unpacked tensors own their memory, contiguous, with the values and shapes saved, as a file's
tensors did: an export or a pickle of some of them carries only theirs.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

#: The key of a packed state; its value is the packing's version.
PACKED = "deltarec_packed_dense"
VERSION = 1
_REF = "deltarec_tensor"  # first item of a tensor's reference tuple


def pack(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with every tensor (CPU, in dicts, lists and tuples at any depth) moved into one
    flat tensor per dtype."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}

    def ref(t: torch.Tensor) -> tuple[Any, ...]:
        offset = sizes.get(t.dtype, 0)
        groups.setdefault(t.dtype, []).append(t.detach().reshape(-1))
        sizes[t.dtype] = offset + t.numel()
        return (_REF, str(t.dtype).removeprefix("torch."), offset, tuple(t.shape))

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ref(x) if x.device.type == "cpu" and not x.is_sparse else x
        return _DESCEND

    skeleton = _walk(state, leaf)
    flat = {str(dt).removeprefix("torch."): torch.cat(ts) for dt, ts in groups.items()}
    return {PACKED: VERSION, "tensors": flat, "state": skeleton}


def unpack(saved: Any) -> Any:
    """What `pack` was given, from what it returned (and a file's unpacked state as it is)."""
    if not isinstance(saved, dict) or PACKED not in saved:
        return saved
    if saved[PACKED] != VERSION:
        raise ValueError(f"packed dense state of version {saved[PACKED]}, this deltarec reads {VERSION}: upgrade deltarec")
    flat: dict[str, torch.Tensor] = saved["tensors"]

    def tensor(item: tuple[Any, ...]) -> torch.Tensor:
        _, dtype, offset, shape = item
        return flat[dtype][offset : offset + math.prod(shape)].view(shape).clone()

    return _walk(saved["state"], lambda x: tensor(x) if type(x) is tuple and len(x) == 4 and x[0] == _REF else _DESCEND)


_DESCEND = object()  # a `_walk` leaf function's answer: not a leaf, go into it


def _walk(x: Any, leaf: Callable[[Any], Any]) -> Any:
    """`x` with each part `leaf` maps replaced by what it returns, through dicts, lists and
    tuples (their own types kept); what `leaf` does not map and is none of those stays whole."""
    mapped = leaf(x)
    if mapped is not _DESCEND:
        return mapped
    if type(x) is dict or type(x) is OrderedDict:
        return type(x)((k, _walk(v, leaf)) for k, v in x.items())
    if type(x) is list:
        return [_walk(v, leaf) for v in x]
    if type(x) is tuple:
        return tuple(_walk(v, leaf) for v in x)
    return x
