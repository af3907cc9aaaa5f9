"""The reader protocol shared by every data source, and helpers both readers use.

A reader is an endless, per-rank source of training batches whose position can be
saved and restored exactly. The checkpoint stores ``state_dict()`` next to the model
(docs/design/invariants.md, invariant 2: after a restore no sample is trained twice or skipped), so
the state must be plain JSON and must pin the *exact* next batch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from common.errors import DeltarecError

logger = logging.getLogger(__name__)

__all__ = [
    "Batch",
    "DataError",
    "GlobalBatches",
    "Reader",
    "make_batch",
    "validate_features",
    "validate_positive_int",
    "validate_rank",
    "validate_state",
]


class DataError(DeltarecError, ValueError):
    """Input data or a saved reader position that cannot be used; names the file or key."""


@runtime_checkable
class Reader(Protocol):
    """An endless, resumable source of batches for one rank.

    ``next_batch`` returns a ``torchrec.datasets.utils.Batch``: ``dense_features``
    float32 ``[B, num_dense]``, ``sparse_features`` a ``KeyedJaggedTensor`` keyed by the
    reader's feature names (int64 values), ``labels`` float32 ``[B]``.
    """

    def next_batch(self) -> Batch:
        """Return the next batch of this rank and advance the position."""
        ...

    def state_dict(self) -> dict:
        """Return the exact position as JSON-serialisable data (ints/floats/strs/lists)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Seek to ``state``: the following ``next_batch()`` yields exactly the batch
        that would have come next when ``state`` was taken. Raises ``ValueError`` when
        ``state`` has wrong keys, wrong types or an impossible position."""
        ...


class GlobalBatches:
    """The position of a reader whose batches are numbered globally (the synthetic stream,
    TorchRec's .npy days): rank r of W reads global batches n + r, n + r + W, ...; the state,
    ``{"next_global_batch": n}``, is the first global batch no rank has been handed at this
    step, the same on every rank, so it restores into any world size. A subclass sets `rank`,
    `world_size` and `owner` (its name in errors) and implements `batch_at`."""

    rank: int
    world_size: int
    owner: str
    _next_global_batch: int = 0

    def batch_at(self, global_batch: int) -> Batch:
        """Global batch `global_batch` (no state change)."""
        raise NotImplementedError

    def next_batch(self) -> Batch:
        """Return global batch ``next_global_batch + rank``; advance by ``world_size``."""
        batch = self.batch_at(self._next_global_batch + self.rank)
        self._next_global_batch += self.world_size
        return batch

    def skip_batch(self) -> None:
        """Move past the next batch without producing it: a loader worker skips the batches its
        siblings read (trainer/data/loader.py)."""
        self._next_global_batch += self.world_size

    def state_dict(self) -> dict:
        """Return ``{"next_global_batch": n}``."""
        return {"next_global_batch": self._next_global_batch}

    def load_state_dict(self, state: dict) -> None:
        """Seek to ``state`` (possibly saved with another world size). Raises ``DataError`` on
        wrong keys, a non-int or a negative position."""
        position = validate_state(state, {"next_global_batch": int}, self.owner)["next_global_batch"]
        if position < 0:
            raise DataError(f"{self.owner} state key 'next_global_batch' must be >= 0, got {position}")
        self._next_global_batch = position


def validate_state(state: object, schema: Mapping[str, type], owner: str) -> dict:
    """Check that ``state`` is a dict with exactly the keys of ``schema`` and values of
    the given types; return it as a plain dict.

    ``bool`` is rejected where ``int`` is expected (it is an ``int`` subclass, but a
    ``True`` position is always a bug), and a float is accepted where a float is expected
    only if it is a real ``float``/``int``. Raises ``DataError`` naming the offending key.
    """
    if not isinstance(state, Mapping):
        raise DataError(f"{owner} state must be a dict, got {type(state).__name__}")
    missing = sorted(set(schema) - set(state))
    unexpected = sorted(str(k) for k in set(state) - set(schema))
    if missing or unexpected:
        raise DataError(f"{owner} state has wrong keys: missing {missing}, unexpected {unexpected}")
    for key, expected in schema.items():
        value = state[key]
        if not _has_type(value, expected):
            raise DataError(f"{owner} state key {key!r} must be {expected.__name__}, got {type(value).__name__} ({value!r})")
    return dict(state)


def _has_type(value: object, expected: type) -> bool:
    """isinstance, except that bools are never ints and ints are acceptable floats."""
    if isinstance(value, bool) and expected is not bool:
        return False
    if expected is float:
        return isinstance(value, (int, float))
    return isinstance(value, expected)


def validate_features(feature_names: Sequence[str], num_embeddings: Sequence[int], owner: str) -> tuple[list[str], list[int]]:
    """Check feature names (non-empty, unique strings) and one positive table size per
    feature; return them as lists. Raises ``DataError`` naming the argument."""
    if isinstance(feature_names, (str, bytes)) or not isinstance(feature_names, Sequence):
        raise DataError(f"{owner}: feature_names must be a sequence of strings")
    names = list(feature_names)
    if not names:
        raise DataError(f"{owner}: feature_names must not be empty")
    if not all(isinstance(n, str) and n for n in names):
        raise DataError(f"{owner}: feature_names must be non-empty strings, got {names!r}")
    if len(set(names)) != len(names):
        raise DataError(f"{owner}: feature_names must be unique, got {names!r}")
    if isinstance(num_embeddings, (str, bytes)) or not isinstance(num_embeddings, Sequence):
        raise DataError(f"{owner}: num_embeddings must be a sequence of ints")
    sizes = list(num_embeddings)
    if len(sizes) != len(names):
        raise DataError(
            f"{owner}: num_embeddings has {len(sizes)} entries but feature_names has "
            f"{len(names)}; give one table size per feature"
        )
    for name, size in zip(names, sizes):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise DataError(f"{owner}: num_embeddings for feature {name!r} must be a positive int, got {size!r}")
    return names, [int(s) for s in sizes]


def make_batch(
    dense: np.ndarray,
    values: np.ndarray,
    lengths: np.ndarray,
    labels: np.ndarray,
    feature_names: Sequence[str],
) -> Batch:
    """Wrap numpy arrays into a torchrec ``Batch`` without copying.

    ``values``/``lengths`` are in KJT order: feature-major, then sample (all bags of
    feature 0 for samples 0..B-1, then feature 1, ...).
    """
    kjt = KeyedJaggedTensor(
        keys=list(feature_names),
        values=torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)),
        lengths=torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int32)),
    )
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
        sparse_features=kjt,
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32)),
    )


def validate_rank(rank: int, world_size: int, owner: str) -> None:
    """Check ``0 <= rank < world_size`` (both ints); raise ``ValueError`` naming them."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise DataError(f"{owner}: {name} must be an int, got {value!r}")
    if world_size < 1:
        raise DataError(f"{owner}: world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise DataError(f"{owner}: rank must be in [0, world_size={world_size}), got {rank}")


def validate_positive_int(value: object, name: str, owner: str) -> int:
    """Return ``value`` as an int if it is a positive int; else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise DataError(f"{owner}: {name} must be a positive int, got {value!r}")
    return int(value)
