"""Criteo 1TB (or Kaggle) in TorchRec's preprocessed format: per-day `.npy` files.

TorchRec's `torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys` (what the TorchRec and
MLPerf DLRM reference trains from) turns each day's TSV into three arrays:
`<day>_dense.npy` float32 [N, 13] (log of the shifted counts), `<day>_sparse.npy` int [N, 26]
(the categorical hashes, optionally made contiguous by `sparse_to_contiguous`) and
`<day>_labels.npy` int32 [N, 1]. A day is named by its prefix, `<dir>/day_0`.

The days are read in order as one sequence of samples, memory-mapped (no copy of a day is
loaded). Like the synthetic stream, batches are numbered globally: global batch g holds
samples [g*B, (g+1)*B) of the sequence (wrapping into the next epoch at the end), and rank r
of W reads batches r, r+W, ... So the position, `{"next_global_batch": n}`, is the same on
every rank, restores into another world size, and a batch can be skipped without reading it
(several loader workers per rank). An id is `sparse % num_embeddings` of its table, as
TorchRec's reader applies its `hashes`. A value no model can train on (a label other than 0
or 1, such as the Kaggle test set's -1 filler; a NaN or infinite dense value; a negative id)
stops the run with one line naming `file:row`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from trainer.data.reader import (
    Batch,
    DataError,
    GlobalBatches,
    make_batch,
    validate_features,
    validate_positive_int,
    validate_rank,
)

logger = logging.getLogger(__name__)

NUM_DENSE = 13
NUM_SPARSE = 26
_OWNER = "CriteoNpyReader"


class _Day:
    """One day's three memory-mapped arrays."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.paths = {part: f"{prefix}_{part}.npy" for part in ("dense", "sparse", "labels")}
        arrays = {}
        for part, path in self.paths.items():
            if not Path(path).is_file():
                raise DataError(f"{_OWNER}: {path} not found (a day is a prefix of three files: _dense, _sparse, _labels.npy)")
            try:
                arrays[part] = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError) as exc:
                raise DataError(f"{_OWNER}: {path} is not a readable .npy file: {exc}") from None
        self.dense, self.sparse, self.labels = arrays["dense"], arrays["sparse"], arrays["labels"]
        self.rows = self._check_shapes()

    def _check_shapes(self) -> int:
        expected = {"dense": NUM_DENSE, "sparse": NUM_SPARSE, "labels": 1}
        rows = None
        for part, width in expected.items():
            a = getattr(self, part)
            if a.ndim != 2 or a.shape[1] != width:
                raise DataError(f"{_OWNER}: {self.paths[part]} has shape {a.shape}, expected [rows, {width}]")
            kind = "f" if part == "dense" else "iu"
            if a.dtype.kind not in kind:
                raise DataError(f"{_OWNER}: {self.paths[part]} holds {a.dtype}, expected {'floats' if kind == 'f' else 'ints'}")
            if rows is not None and a.shape[0] != rows:
                raise DataError(f"{_OWNER}: {self.paths[part]} has {a.shape[0]} rows, {self.paths['dense']} has {rows}")
            rows = a.shape[0]
        assert rows is not None
        return rows


class CriteoNpyReader(GlobalBatches):
    """Endless, seekable reader of TorchRec-format Criteo days for one rank (a `Reader`)."""

    def __init__(
        self,
        *,
        paths: Sequence[str],
        feature_names: Sequence[str],
        num_embeddings: Sequence[int],
        batch_size: int,
        rank: int,
        world_size: int,
    ) -> None:
        names, sizes = validate_features(feature_names, num_embeddings, _OWNER)
        if len(names) != NUM_SPARSE:
            raise DataError(f"{_OWNER}: the model has {len(names)} categorical features; Criteo has {NUM_SPARSE}")
        validate_positive_int(batch_size, "batch_size", _OWNER)
        validate_rank(rank, world_size, _OWNER)
        if not paths:
            raise DataError(f"{_OWNER}: no days given")
        self.feature_names, self.num_embeddings = names, sizes
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.days = [_Day(str(p)) for p in paths]
        self._starts = np.cumsum([0] + [d.rows for d in self.days])  # first sample of each day
        self.total_rows = int(self._starts[-1])
        if self.total_rows == 0:
            raise DataError(f"{_OWNER}: the days {list(paths)} hold no rows")
        self._sizes = np.asarray(sizes, dtype=np.int64)
        self._next_global_batch = 0
        self.owner = _OWNER

    # -- random access -------------------------------------------------------------------

    def batch_at(self, global_batch: int) -> Batch:
        """Samples [g*B, (g+1)*B) of the days' sequence, wrapping at its end."""
        first = global_batch * self.batch_size
        pieces: list[tuple[_Day, int, int]] = []  # (day, first row, rows)
        need, at = self.batch_size, first % self.total_rows
        while need:
            d = int(np.searchsorted(self._starts, at, side="right")) - 1
            day, row = self.days[d], at - int(self._starts[d])
            take = min(need, day.rows - row)
            pieces.append((day, row, take))
            need -= take
            at = (at + take) % self.total_rows
        dense = np.concatenate([d.dense[r : r + n] for d, r, n in pieces]).astype(np.float32, copy=False)
        sparse = np.concatenate([d.sparse[r : r + n] for d, r, n in pieces]).astype(np.int64, copy=False)
        labels = np.concatenate([d.labels[r : r + n, 0] for d, r, n in pieces])
        self._check(pieces, dense, sparse, labels)
        ids = (sparse % self._sizes).T.reshape(-1)
        lengths = np.ones(ids.shape[0], dtype=np.int32)
        return make_batch(dense, ids, lengths, labels.astype(np.float32), self.feature_names)

    def _check(self, pieces: list[tuple[_Day, int, int]], dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> None:
        """Refuse a value no model trains on, naming the first such row as `file:row`."""
        bad_rows = {
            "labels": (labels != 0) & (labels != 1),
            "dense": ~np.isfinite(dense).all(axis=1),
            "sparse": (sparse < 0).any(axis=1),
        }
        for part, bad in bad_rows.items():
            if bad.any():
                i = int(np.argmax(bad))
                for day, row, n in pieces:
                    if i < n:
                        value = {"labels": labels, "dense": dense, "sparse": sparse}[part][int(np.argmax(bad))]
                        raise DataError(f"{day.paths[part]}:{row + i}: {_REASONS[part]}, got {np.asarray(value).tolist()}")
                    i -= n


_REASONS = {
    "labels": "a label must be 0 or 1 (the Kaggle test set's -1 filler cannot be trained on)",
    "dense": "dense features must be finite",
    "sparse": "categorical ids must not be negative",
}
