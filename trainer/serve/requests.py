"""A prediction request: JSON in the model's feature layout, checked, as the model's input batch.

    {"samples": [{"dense": [13 numbers], "sparse": {"user_id": [17], "item_id": [4, 9]}}, ...]}

`dense` holds the model's `dense_in_features` finite numbers (a model without dense input
takes `[]` or no `dense`); `sparse` maps feature names (the features of the model's tables)
to lists of ids in ``0..num_embeddings - 1`` of the feature's table. A feature left out is
an empty bag (its pooled embedding is zero), as in training data with a missing value.
Anything else is refused with one line naming the sample, the field and what is wrong. Only
JSON is read: nothing a client sends is ever unpickled.

A well-formed request is checked a column at a time (`_fast_batch`: the types of all its values
at once, then their range on arrays) rather than value by value, which dominated a large
request's time on the server (docs/serving.md). Anything that column check does not accept
(including values near float32's limit) goes through the value-by-value path, which accepts or
refuses it, naming the first thing wrong: both paths accept the same requests, with the same batch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from itertools import chain
from operator import methodcaller
from typing import Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from common.errors import DeltarecError
from trainer.config import ModelConfig
from trainer.model import feature_cardinalities, feature_names

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
#: Dense values the column check accepts are below this in magnitude; the others (float32's
#: limit, where a double's rounding could decide) are left to the value-by-value check.
_FAST_DENSE_LIMIT = 1e38
_FIELDS = frozenset(("dense", "sparse"))
_NO_IDS: list[int] = []  # a feature left out (never written)
_NO_FEATURES: dict[str, Any] = {}  # a sample without "sparse" (never written)


class RequestError(DeltarecError):
    """A request the server refuses; `status` is its HTTP status (400, 413)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Batch:
    """The model's input for a request's samples."""

    dense: torch.Tensor  # float32 [n, dense_in_features]
    sparse: KeyedJaggedTensor  # every feature of the model, in its order

    @property
    def size(self) -> int:
        return int(self.dense.shape[0])


@dataclass(frozen=True)
class FeatureLayout:
    """What a sample must look like: the job's dense width, features and their tables' rows."""

    dense_in_features: int
    features: tuple[str, ...]
    cardinalities: tuple[int, ...]

    @classmethod
    def of(cls, cfg: ModelConfig) -> FeatureLayout:
        return cls(cfg.dense_in_features, tuple(feature_names(cfg)), tuple(feature_cardinalities(cfg)))


def parse_request(body: bytes, layout: FeatureLayout, max_samples: int) -> Batch:
    """The batch a request body asks for; `RequestError` naming the first thing wrong."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"body is not JSON: {exc}") from None
    except ValueError as exc:  # an integer literal over Python's digit limit
        raise RequestError(f"body refused: {exc}") from None
    except RecursionError:
        raise RequestError("body refused: JSON nested too deeply") from None
    if not isinstance(doc, dict) or set(doc) != {"samples"}:
        raise RequestError('body must be a JSON object with one key, "samples"')
    samples = doc["samples"]
    if not isinstance(samples, list) or not samples:
        raise RequestError('"samples" must be a non-empty list')
    if len(samples) > max_samples:
        raise RequestError(f"{len(samples)} samples, more than serve.max_samples = {max_samples}", status=413)
    fast = _fast_batch(samples, layout)
    return fast if fast is not None else _checked_batch(samples, layout)


def _fast_batch(samples: list[Any], layout: FeatureLayout) -> Batch | None:
    """The batch of well-formed `samples`, checked a column at a time (the loops in C: `map`,
    `set`, numpy); None when anything is off (or merely unusual), for `_checked_batch` to accept
    or refuse value by value."""
    if set(map(type, samples)) != {dict} or not all(map(_FIELDS.issuperset, samples)):
        return None
    n = layout.dense_in_features
    dense = list(map(methodcaller("get", "dense", [] if n == 0 else None), samples))
    if set(map(type, dense)) != {list} or set(map(len, dense)) != {n}:
        return None
    if not set(map(type, chain.from_iterable(dense))) <= {float, int}:  # bool is neither, as in `_dense`
        return None
    try:
        wide = np.array(dense, dtype=np.float64)
    except OverflowError:  # an integer past a double's range
        return None
    if wide.size and not float(np.abs(wide).max()) < _FAST_DENSE_LIMIT:  # NaN and infinities too
        return None
    sparse = list(map(methodcaller("get", "sparse", _NO_FEATURES), samples))
    if set(map(type, sparse)) != {dict} or not all(map(frozenset(layout.features).issuperset, sparse)):
        return None
    ids: list[int] = []
    lengths: list[int] = []
    for name, rows in zip(layout.features, layout.cardinalities):
        column = list(map(methodcaller("get", name, _NO_IDS), sparse))
        if set(map(type, column)) != {list}:
            return None
        flat = list(chain.from_iterable(column))
        if flat and (not set(map(type, flat)) <= {int} or min(flat) < 0 or max(flat) >= rows):  # bool is no int here
            return None
        ids += flat
        lengths += map(len, column)
    kjt = KeyedJaggedTensor(
        keys=list(layout.features),
        values=torch.from_numpy(np.array(ids, dtype=np.int64)),  # numpy reads a list of ints faster than torch
        lengths=torch.from_numpy(np.array(lengths, dtype=np.int32)),
    )
    return Batch(torch.from_numpy(wide.astype(np.float32)), kjt)


def _checked_batch(samples: list[Any], layout: FeatureLayout) -> Batch:
    """The batch of `samples`, checked value by value; `RequestError` naming the first thing wrong."""
    dense = [_dense(i, s, layout) for i, s in enumerate(samples)]
    ids: list[list[int]] = [[] for _ in layout.features]
    lengths: list[list[int]] = [[] for _ in layout.features]
    index = {f: j for j, f in enumerate(layout.features)}
    for i, sample in enumerate(samples):
        sparse = sample.get("sparse", {})
        if not isinstance(sparse, dict):
            raise RequestError(f"samples[{i}].sparse must be an object of feature: [ids]")
        for name, values in sparse.items():
            j = index.get(name)
            if j is None:
                raise RequestError(
                    f"samples[{i}].sparse: unknown feature {_short(name)} (the model's: {', '.join(layout.features)})"
                )
            _check_ids(i, name, values, layout.cardinalities[j])
            ids[j].extend(values)
        for j, name in enumerate(layout.features):
            values = sparse.get(name, [])
            lengths[j].append(len(values))
    kjt = KeyedJaggedTensor(
        keys=list(layout.features),
        values=torch.tensor([v for per in ids for v in per], dtype=torch.int64),
        lengths=torch.tensor([n for per in lengths for n in per], dtype=torch.int32),
    )
    return Batch(torch.tensor(dense, dtype=torch.float32), kjt)


def _dense(i: int, sample: Any, layout: FeatureLayout) -> list[float]:
    if not isinstance(sample, dict):
        raise RequestError(f"samples[{i}] must be an object with dense and sparse")
    unknown = set(sample) - {"dense", "sparse"}
    if unknown:
        raise RequestError(f"samples[{i}]: unknown field {_short(sorted(unknown)[0])} (expected dense, sparse)")
    n = layout.dense_in_features
    values = sample.get("dense", [] if n == 0 else None)
    if not isinstance(values, list) or len(values) != n:
        got = f"a list of {len(values)}" if isinstance(values, list) else json_type(values)
        raise RequestError(f"samples[{i}].dense: expected a list of {n} numbers, got {got}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not _finite_float32(v):
            raise RequestError(f"samples[{i}].dense: {_short(v)} is not a finite float32 number")
    return values


def _finite_float32(v: int | float) -> bool:
    """Whether `v` becomes a finite float32 (the model's dtype): 1e39 is a finite double and
    infinite there; a 400-digit integer is not even a double."""
    return math.isfinite(v) and abs(v) <= FLOAT32_MAX if isinstance(v, float) else abs(v) <= FLOAT32_MAX


def _short(v: Any) -> str:
    """`v` for a message: a huge number as its first digits and its length."""
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def _check_ids(i: int, name: str, values: Any, rows: int) -> None:
    if not isinstance(values, list):
        raise RequestError(f"samples[{i}].sparse.{name}: expected a list of ids, got {json_type(values)}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise RequestError(f"samples[{i}].sparse.{name}: {_short(v)} is not an integer id")
        if not 0 <= v < rows:
            raise RequestError(f"samples[{i}].sparse.{name}: id {_short(v)} out of range 0..{rows - 1}")


def json_type(value: Any) -> str:
    """What a JSON value is, in JSON's words (for messages)."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
