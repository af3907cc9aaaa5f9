"""Stable codec names and ids.

The id (``code``) is the uint8 written in every frame header; a restore looks the codec up by it.
Never renumber or reuse an id: add new codecs with new ids. Scheme: high nibble = family,
low nibble = bits (floats: 1..3).

====  ==========  =================================================
code  name        row layout (see the module of each family)
====  ==========  =================================================
1     fp32        dim x fp32
2     fp16        dim x fp16
3     bf16        dim x bf16
18    asym2       2-bit codes, fp16 scale, fp16 bias (fbgemm N-bit)
19    asym3       3-bit codes, fp16 scale, fp16 bias
20    asym4       4-bit codes, fp16 scale, fp16 bias (fbgemm N-bit)
24    asym8       8-bit codes, fp32 scale, fp32 bias (fbgemm 8-bit)
34    sym2        2-bit codes, fp16 absmax
35    sym3        3-bit codes, fp16 absmax
36    sym4        4-bit codes, fp16 absmax
40    sym8        8-bit codes, fp32 absmax
50    adaptive2   as asym2 (greedy clipping range)
51    adaptive3   as asym3
52    adaptive4   as asym4
66    kmeans2     2-bit codes, 4 fp16 centroids
67    kmeans3     3-bit codes, 8 fp16 centroids
68    kmeans4     4-bit codes, 16 fp16 centroids
====  ==========  =================================================
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import torch

from .adaptive import AdaptiveCodec
from .base import RowCodec
from .float_codecs import FloatCodec
from .kmeans import KMeansCodec
from .uniform import AsymCodec, SymCodec

__all__ = ["get_codec", "codec_names", "register_codec", "warm_up_codecs", "CODE_TABLE"]

# The frozen table: tests assert it, so a renumbering fails loudly.
CODE_TABLE: dict[str, int] = {
    "fp32": 1,
    "fp16": 2,
    "bf16": 3,
    "asym2": 18,
    "asym3": 19,
    "asym4": 20,
    "asym8": 24,
    "sym2": 34,
    "sym3": 35,
    "sym4": 36,
    "sym8": 40,
    "adaptive2": 50,
    "adaptive3": 51,
    "adaptive4": 52,
    "kmeans2": 66,
    "kmeans3": 67,
    "kmeans4": 68,
}

_BY_NAME: dict[str, RowCodec] = {}
_BY_CODE: dict[int, RowCodec] = {}


def register_codec(codec: RowCodec) -> RowCodec:
    if not (0 < codec.code < 256):
        raise ValueError(f"codec code must fit a uint8 and be non-zero, got {codec.code}")
    if codec.name in _BY_NAME or codec.code in _BY_CODE:
        raise ValueError(f"codec {codec.name!r} / code {codec.code} is already registered")
    if CODE_TABLE.get(codec.name, codec.code) != codec.code:
        raise ValueError(f"codec {codec.name!r} must keep its code {CODE_TABLE[codec.name]}")
    _BY_NAME[codec.name] = codec
    _BY_CODE[codec.code] = codec
    return codec


def _register_builtins() -> None:
    builtins: tuple[RowCodec, ...] = (
        FloatCodec("fp32", 1, torch.float32),
        FloatCodec("fp16", 2, torch.float16),
        FloatCodec("bf16", 3, torch.bfloat16),
        *(AsymCodec(b) for b in (2, 3, 4, 8)),
        *(SymCodec(b) for b in (2, 3, 4, 8)),
        *(AdaptiveCodec(b) for b in (2, 3, 4)),
        *(KMeansCodec(b) for b in (2, 3, 4)),
    )
    for c in builtins:
        register_codec(c)
    assert {n: c.code for n, c in _BY_NAME.items()} == CODE_TABLE


def codec_names() -> list[str]:
    """Known codec names, ordered by code."""
    return [c.name for _, c in sorted(_BY_CODE.items())]


def get_codec(name_or_code: str | int) -> RowCodec:
    """Codec by stable name (``"asym4"``) or by its frame-header id (``20``)."""
    if isinstance(name_or_code, str):
        c = _BY_NAME.get(name_or_code)
    elif isinstance(name_or_code, numbers.Integral) and not isinstance(name_or_code, bool):
        c = _BY_CODE.get(int(name_or_code))  # int, numpy integer, ...
    else:
        raise TypeError(f"codec must be a name or an integer code, got {type(name_or_code).__name__}")
    if c is None:
        known = ", ".join(f"{n} ({c.code})" for n, c in sorted(_BY_NAME.items(), key=lambda kv: kv[1].code))
        raise ValueError(f"unknown codec {name_or_code!r}; known codecs: {known}")
    return c


def warm_up_codecs(names: Iterable[str | int]) -> None:
    """Prepare now what encoding CPU rows with these codecs needs (the adaptive codecs' compiled
    kernel), so that a job pays it before training rather than in its first checkpoint."""
    for name in set(names):
        warm_up = getattr(get_codec(name), "warm_up", None)
        if warm_up is not None:
            warm_up()


_register_builtins()
