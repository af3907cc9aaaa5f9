"""A deterministic, learnable, unbounded synthetic click stream.

Why it exists: tests and benchmarks of the trainer and of the checkpointing need data
that (a) any rank can produce at any position without reading anything before it, so
reader state is one integer and survives a change of world size, (b) has the skew of
real recommendation traffic (a few hot ids take most lookups, which is what makes
differential checkpoints small), and (c) carries a signal a DLRM can learn, so a
restored model can be checked by its eval AUC and not only by its bytes.

How: global batch ``k`` of a stream is drawn from its own numpy ``Generator`` seeded by
``SeedSequence([seed, stream_id, k])``. Ids are Zipf-distributed popularity ranks
scattered over the table by a fixed affine bijection. Labels are Bernoulli draws from a
fixed random *teacher* derived from ``seed`` only (the same for the ``train`` and
``eval`` streams): per-id scalar effects, per-id low-dimensional vectors whose pairwise
dot products between features interact, and a linear term on the dense features. The
teacher stores no table-sized state: per-id values are hashes of the id.

A feature of a hashed table (`hash_sizes`, its table's `input_hash_size`) draws its ids from
`_HASHED_SPREAD` times as many ids as the table has rows, so ids compete for the rows and
cold ones are evicted, and sends them as raw ids spread over the whole hash range by a fixed
affine map derived from the seed (invertible, so the teacher still labels them by their id).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

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

__all__ = ["SyntheticClickStream"]

_OWNER = "SyntheticClickStream"
# Ids are computed as (a * rank + b) mod N in uint64; a, rank < N keeps a * rank < 2**64.
_MAX_NUM_EMBEDDINGS = 2**32
_TEACHER_DIM = 4  # size of the per-id interaction vectors
# Per-id teacher effects shrink with popularity rank as 1/sqrt(1 + rank / hot), with
# hot = max(_MIN_HOT_IDS, _HOT_FRACTION * N): rare ids behave like the average id, as
# in real data, so the signal sits on the ids a model sees often enough to learn.
_HOT_FRACTION = 1e-3
_MIN_HOT_IDS = 8
_CALIBRATION_ROWS = 8192  # fixed, so the teacher does not depend on batch size or rank
_TARGET_LOGIT_STD = 2.2  # teacher AUC ~0.88 with the component mix below
_TARGET_CLICK_RATE = 0.3
# Shares of the logit variance: per-id scalar effects, pairwise interactions, dense.
_COMPONENT_SHARES = (0.5, 0.3, 0.2)
_U64 = np.uint64
# A hashed table's feature draws its ids among this many times its rows.
_HASHED_SPREAD = 4


@dataclass(frozen=True)
class _IdSpace:
    """Per-feature constants that turn uniforms into Zipf ranks and ranks into ids."""

    sizes: np.ndarray  # uint64 [F]: N per feature
    log_span: np.ndarray  # float64 [F]: ln((N + 0.5) / 0.5), the support of the density
    cdf_scale: np.ndarray  # float64 [F]: expm1(t * log_span), t = 1 - exponent
    one_minus_s: float  # t
    mult: np.ndarray  # uint64 [F]: a, coprime with N
    mult_inv: np.ndarray  # uint64 [F]: a^-1 mod N
    offset: np.ndarray  # uint64 [F]: b
    hot: np.ndarray  # float64 [F]: popularity scale of teacher effects


@dataclass(frozen=True)
class _Teacher:
    """The fixed random model that labels every stream of one seed."""

    salts: np.ndarray  # uint64 [F, 1 + _TEACHER_DIM]: hash salt per feature and component
    feature_weight: np.ndarray  # float64 [F]: importance of each feature's scalar effect
    dense_weight: np.ndarray  # float64 [D]
    dense_mu: np.ndarray  # float64 [D]: dense raw value ~ floor(exp(mu + sigma * z))
    dense_sigma: np.ndarray  # float64 [D]
    center: np.ndarray  # float64 [3]: mean of each raw component on the calibration set
    coef: np.ndarray  # float64 [3]: scale of each centered raw component
    bias: float


@dataclass(frozen=True)
class _Draw:
    """One generated batch as numpy arrays, before wrapping into a torchrec Batch."""

    ranks: np.ndarray  # uint64 [B, F, L]
    ids: np.ndarray  # uint64 [B, F, L]
    dense: np.ndarray  # float32 [B, D]
    logits: np.ndarray  # float64 [B]
    labels: np.ndarray  # float32 [B]


class SyntheticClickStream(GlobalBatches):
    """Endless, seekable click stream for one rank (implements ``Reader``).

    Position and world size: the state is ``{"next_global_batch": n}``, the same on every
    rank at the same step. On rank ``r`` of ``world_size`` ranks, ``next_batch()``
    returns global batch ``n + r`` and sets ``n += world_size``. So after any number of
    steps, exactly the global batches ``< n`` have been handed out, whatever the world
    size; a state saved with ``W`` ranks restores into ``W'`` ranks with no batch trained
    twice and none skipped.

    Each sample has ``ids_per_feature`` ids per feature (fixed-length bags), ids in
    ``[0, num_embeddings[i])``; ``num_dense`` non-negative float32 dense features
    (log1p of log-normal counts); labels in {0., 1.}. A feature with a ``hash_sizes`` entry
    above 0 (a hashed table's) has raw ids in ``[0, hash_sizes[i])`` instead (module docstring).
    """

    def __init__(
        self,
        *,
        feature_names: Sequence[str],
        num_embeddings: Sequence[int],
        num_dense: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        zipf_exponent: float = 1.05,
        ids_per_feature: int = 1,
        stream: str = "train",
        hash_sizes: Sequence[int] | None = None,
    ) -> None:
        names, sizes = validate_features(feature_names, num_embeddings, _OWNER)
        _check_table_sizes(names, sizes)
        hashes = _check_hash_sizes(names, sizes, hash_sizes)
        validate_rank(rank, world_size, _OWNER)
        if isinstance(num_dense, bool) or not isinstance(num_dense, int) or num_dense < 0:
            raise DataError(f"{_OWNER}: num_dense must be an int >= 0, got {num_dense!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise DataError(f"{_OWNER}: seed must be an int >= 0, got {seed!r}")
        _check_exponent(zipf_exponent)
        if not isinstance(stream, str) or not stream:
            raise DataError(f"{_OWNER}: stream must be a non-empty string, got {stream!r}")
        self.feature_names = names
        self.num_embeddings = sizes
        self.num_dense = num_dense
        self.batch_size = validate_positive_int(batch_size, "batch_size", _OWNER)
        self.ids_per_feature = validate_positive_int(ids_per_feature, "ids_per_feature", _OWNER)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = seed
        self.zipf_exponent = float(zipf_exponent)
        self.stream = stream
        self._stream_id = _stream_id(stream)
        self.hash_sizes = hashes
        self._ids = _make_id_space(seed, _drawn_sizes(sizes, hashes), self.zipf_exponent)
        self._spread = _make_spread(seed, self._ids, hashes)
        self._teacher = _make_teacher(seed, self._ids, num_dense, self.ids_per_feature)
        self._next_global_batch = 0
        self.owner = _OWNER

    # -- random access and the teacher -------------------------------------------------

    def batch_at(self, global_batch: int) -> Batch:
        """Return global batch ``global_batch`` of this stream (no state change)."""
        draw = self._draw(global_batch)
        return self._to_batch(draw)

    def teacher_logits(self, batch: Batch) -> np.ndarray:
        """The teacher's true logit (float64 ``[B]``) for each sample of ``batch``.

        ``batch`` may come from any stream of the same seed and table sizes: the teacher
        is a function of the ids and dense features only. Labels were drawn as
        ``Bernoulli(sigmoid(logit))``, so these logits are the best possible scores.
        """
        ids, dense = self._unpack(batch)
        ranks = _ids_to_ranks(ids, self._ids)
        return _teacher_logits(self._teacher, self._ids, ids, ranks, dense)

    # -- internals ---------------------------------------------------------------------

    def _draw(self, global_batch: int) -> _Draw:
        """Generate global batch ``global_batch`` from its own seeded generator."""
        if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)):
            raise DataError(f"{_OWNER}: global_batch must be an int, got {global_batch!r}")
        if global_batch < 0:
            raise DataError(f"{_OWNER}: global_batch must be >= 0, got {global_batch}")
        seq = np.random.SeedSequence([self.seed, self._stream_id, int(global_batch)])
        rng = np.random.Generator(np.random.PCG64(seq))
        return _draw_samples(rng, self.batch_size, self.ids_per_feature, self._ids, self._teacher)

    def _to_batch(self, draw: _Draw) -> Batch:
        """Wrap a draw into a torchrec Batch (KJT values feature-major)."""
        n, f, length = draw.ids.shape
        values = _spread_ids(draw.ids, self._spread).transpose(1, 0, 2).reshape(-1).astype(np.int64)
        lengths = np.full(f * n, length, dtype=np.int32)
        return make_batch(draw.dense, values, lengths, draw.labels, self.feature_names)

    def _unpack(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """Recover ids ``[B, F, L]`` (uint64) and dense ``[B, D]`` from a Batch of this
        stream's shape; raise ``ValueError`` if the batch does not fit."""
        kjt = batch.sparse_features
        if list(kjt.keys()) != self.feature_names:
            raise DataError(f"{_OWNER}: batch keys {kjt.keys()} != {self.feature_names}")
        dense = batch.dense_features.detach().cpu().numpy()
        n = dense.shape[0]
        f, length = len(self.feature_names), self.ids_per_feature
        lengths = kjt.lengths().detach().cpu().numpy()
        if lengths.shape != (f * n,) or np.any(lengths != length):
            raise DataError(f"{_OWNER}: batch bags must all have {length} ids")
        values = kjt.values().detach().cpu().numpy().astype(np.int64)
        raw = values.reshape(f, n, length).transpose(1, 0, 2)
        if np.any(raw < 0):
            raise DataError(f"{_OWNER}: batch ids out of range of num_embeddings")
        ids = _unspread_ids(raw.astype(np.uint64), self._spread)
        if np.any(ids >= self._ids.sizes[None, :, None]):
            raise DataError(f"{_OWNER}: batch ids out of range of num_embeddings")
        return ids, dense


# -- argument checks ---------------------------------------------------------------------


def _check_table_sizes(names: list[str], sizes: list[int]) -> None:
    """Reject tables too large for the uint64 affine scatter."""
    for name, size in zip(names, sizes):
        if size > _MAX_NUM_EMBEDDINGS:
            raise DataError(f"{_OWNER}: num_embeddings for {name!r} is {size}; at most {_MAX_NUM_EMBEDDINGS} rows are supported")


def _check_hash_sizes(names: list[str], sizes: list[int], hash_sizes: Sequence[int] | None) -> list[int]:
    """One raw id space per feature (0: an ordinary table's), at least its table's rows."""
    if hash_sizes is None:
        return [0] * len(names)
    hashes = list(hash_sizes)
    if len(hashes) != len(names):
        raise DataError(f"{_OWNER}: hash_sizes has {len(hashes)} entries but feature_names has {len(names)}")
    for name, size, h in zip(names, sizes, hashes):
        if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or (h != 0 and not size <= h < 2**63):
            raise DataError(f"{_OWNER}: hash_sizes for {name!r} must be 0 or an int in [{size}, 2**63), got {h!r}")
    return [int(h) for h in hashes]


def _drawn_sizes(sizes: list[int], hashes: list[int]) -> list[int]:
    """How many distinct ids each feature draws: its table's rows, or for a hashed table's
    feature `_HASHED_SPREAD` times as many (at most its hash size and the scatter's limit)."""
    return [size if not h else min(h, size * _HASHED_SPREAD, _MAX_NUM_EMBEDDINGS) for size, h in zip(sizes, hashes)]


@dataclass(frozen=True)
class _Spread:
    """Per feature, raw id = id * stride + shift: the drawn ids spread over a hashed table's
    raw id range (stride 1, shift 0 for an ordinary table's feature, whose ids are rows)."""

    stride: np.ndarray  # uint64 [F]
    shift: np.ndarray  # uint64 [F]: in [0, stride)
    hashed: bool  # some feature's stride or shift is not the identity


def _make_spread(seed: int, space: _IdSpace, hashes: list[int]) -> _Spread:
    """The fixed spread of each hashed feature's ids over its hash range, from `seed`."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0x5BD])))
    strides, shifts = [], []
    for drawn, h in zip(space.sizes.tolist(), hashes):
        stride = h // drawn if h else 1
        strides.append(stride)
        shifts.append(int(rng.integers(0, stride)) if stride > 1 else 0)
    return _Spread(np.asarray(strides, dtype=np.uint64), np.asarray(shifts, dtype=np.uint64), any(hashes))


def _spread_ids(ids: np.ndarray, spread: _Spread) -> np.ndarray:
    """Drawn ids ``[B, F, L]`` to the raw ids a batch carries."""
    if not spread.hashed:
        return ids
    return ids * spread.stride[None, :, None] + spread.shift[None, :, None]


def _unspread_ids(raw: np.ndarray, spread: _Spread) -> np.ndarray:
    """Inverse of `_spread_ids`; a raw id off the spread's grid maps past every drawn id."""
    if not spread.hashed:
        return raw
    stride, shift = spread.stride[None, :, None], spread.shift[None, :, None]
    off_grid = (raw < shift) | ((raw - shift) % stride != 0)
    return np.where(off_grid, np.iinfo(np.uint64).max, (raw - shift) // stride).astype(np.uint64)


def _check_exponent(zipf_exponent: float) -> None:
    """The Zipf exponent must be a finite number > 0 (1 is allowed)."""
    if isinstance(zipf_exponent, bool) or not isinstance(zipf_exponent, (int, float)):
        raise DataError(f"{_OWNER}: zipf_exponent must be a number, got {zipf_exponent!r}")
    if not math.isfinite(zipf_exponent) or zipf_exponent <= 0:
        raise DataError(f"{_OWNER}: zipf_exponent must be finite and > 0, got {zipf_exponent}")


def _stream_id(stream: str) -> int:
    """A stable 64-bit id for a stream name (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(stream.encode(), digest_size=8).digest(), "little")


# -- hashing -----------------------------------------------------------------------------


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic): a cheap, well-mixed
    hash, used instead of N-sized tables for per-id teacher values."""
    z = x + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def _hash_normal(keys: np.ndarray) -> np.ndarray:
    """Approximately standard-normal float64 values, one per uint64 key: the sum of the
    four 16-bit uniforms of ``splitmix64(key)`` (Irwin-Hall, rescaled to variance 1)."""
    h = _splitmix64(keys)
    mask = _U64(0xFFFF)
    total = (h & mask).astype(np.float64)
    for shift in (16, 32, 48):
        total += ((h >> _U64(shift)) & mask).astype(np.float64)
    # Each term is uniform on {0..65535}: mean 32767.5, variance (65536**2 - 1) / 12.
    return (total - 4 * 32767.5) * (math.sqrt(3.0) / 65536.0)


# -- ids ---------------------------------------------------------------------------------


def _make_id_space(seed: int, sizes: list[int], exponent: float) -> _IdSpace:
    """Derive the per-feature Zipf and scatter constants from ``seed``."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0x1D5])))
    n = np.asarray(sizes, dtype=np.float64)
    t = 1.0 - exponent
    log_span = np.log((n + 0.5) / 0.5)
    mults = [_coprime_multiplier(size, rng) for size in sizes]
    offsets = [int(rng.integers(0, size)) for size in sizes]
    return _IdSpace(
        sizes=np.asarray(sizes, dtype=np.uint64),
        log_span=log_span,
        cdf_scale=np.expm1(t * log_span),
        one_minus_s=t,
        mult=np.asarray(mults, dtype=np.uint64),
        mult_inv=np.asarray([_mod_inverse(a, s) for a, s in zip(mults, sizes)], dtype=np.uint64),
        offset=np.asarray(offsets, dtype=np.uint64),
        hot=np.maximum(_MIN_HOT_IDS, _HOT_FRACTION * n),
    )


def _coprime_multiplier(size: int, rng: np.random.Generator) -> int:
    """A multiplier ``a`` in [1, size) coprime with ``size``, near ``size`` times the
    golden-ratio fraction (jittered by the seed): consecutive popularity ranks then land
    far apart (a low-discrepancy Weyl sequence), so hot ids cover the whole range."""
    if size <= 2:
        return 1
    fraction = 0.6180339887498949 + rng.uniform(-0.05, 0.05)
    a = max(1, int(size * fraction))
    while math.gcd(a, size) != 1:
        a = a + 1 if a + 1 < size else 1
    return a


def _mod_inverse(a: int, size: int) -> int:
    """``a^-1 mod size`` (0 for a table of one row, where every id is 0)."""
    return 0 if size == 1 else pow(a, -1, size)


def _zipf_ranks(u: np.ndarray, space: _IdSpace) -> np.ndarray:
    """Map uniforms ``u [B, F, L]`` to Zipf popularity ranks in ``[0, N_f)`` (uint64).

    Inverse CDF of the continuous density ``x^-s`` on ``[0.5, N + 0.5)``, rounded: rank
    ``k`` gets the mass of ``[k + 0.5, k + 1.5)``, close to the discrete Zipf law. With
    ``t = 1 - s``: ``ln(x / 0.5) = log1p(u * expm1(t * L)) / t``, which tends to ``u * L``
    as ``t -> 0`` (exponent 1), used below ``|t| < 1e-9``.
    """
    t = space.one_minus_s
    if abs(t) < 1e-9:
        log_x = u * space.log_span[None, :, None]
    else:
        log_x = np.log1p(u * space.cdf_scale[None, :, None]) / t
    x = 0.5 * np.exp(log_x)
    ranks = np.floor(x + 0.5) - 1.0
    upper = (space.sizes.astype(np.float64) - 1.0)[None, :, None]
    return np.clip(ranks, 0.0, upper).astype(np.uint64)


def _ranks_to_ids(ranks: np.ndarray, space: _IdSpace) -> np.ndarray:
    """Scatter popularity ranks over the table: ``(a * rank + b) mod N`` (a bijection)."""
    sizes = space.sizes[None, :, None]
    return (space.mult[None, :, None] * ranks + space.offset[None, :, None]) % sizes


def _ids_to_ranks(ids: np.ndarray, space: _IdSpace) -> np.ndarray:
    """Inverse of ``_ranks_to_ids``: ``a^-1 * (id - b) mod N``."""
    sizes = space.sizes[None, :, None]
    shifted = (ids + sizes - space.offset[None, :, None]) % sizes
    return (space.mult_inv[None, :, None] * shifted) % sizes


# -- teacher -----------------------------------------------------------------------------


def _make_teacher(seed: int, space: _IdSpace, num_dense: int, ids_per_feature: int) -> _Teacher:
    """Draw the teacher's parameters from ``seed``, then calibrate its logit scale and
    bias on a fixed sample so that AUC and click rate hit their targets."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0x7EAC])))
    num_features = len(space.sizes)
    raw = _Teacher(
        salts=rng.integers(0, 2**63, size=(num_features, 1 + _TEACHER_DIM), dtype=np.uint64),
        feature_weight=rng.uniform(0.3, 1.0, size=num_features),
        dense_weight=rng.standard_normal(num_dense),
        dense_mu=rng.uniform(0.0, 4.0, size=num_dense),
        dense_sigma=rng.uniform(0.5, 1.5, size=num_dense),
        center=np.zeros(3),
        coef=np.zeros(3),
        bias=0.0,
    )
    calib_rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0xCA1B])))
    ranks, ids, dense = _draw_inputs(calib_rng, _CALIBRATION_ROWS, ids_per_feature, space, raw)
    components = _raw_components(raw, ids, ranks, dense, space)
    center, coef = _component_scales(components)
    centered = (components - center[:, None]) * coef[:, None]
    bias = _solve_bias(centered.sum(axis=0), _TARGET_CLICK_RATE)
    logger.debug("synthetic teacher: coef=%s bias=%.3f", coef, bias)
    return dataclasses.replace(raw, center=center, coef=coef, bias=bias)


def _component_scales(components: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Center and scale each raw component so that its share of the logit variance is
    ``_COMPONENT_SHARES`` (components with no variance, e.g. no dense features, drop out
    and the others share their variance)."""
    center = components.mean(axis=1)
    std = components.std(axis=1)
    active = std > 1e-12
    shares = np.where(active, np.asarray(_COMPONENT_SHARES), 0.0)
    if shares.sum() == 0:
        return center, np.zeros(3)
    shares = shares / shares.sum()
    coef = np.where(active, _TARGET_LOGIT_STD * np.sqrt(shares) / np.where(active, std, 1.0), 0.0)
    return center, coef


def _solve_bias(centered_logit: np.ndarray, click_rate: float) -> float:
    """Bisect the bias so that the mean of sigmoid(bias + logit) equals ``click_rate``."""
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if _sigmoid(mid + centered_logit).mean() < click_rate:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """Numerically safe logistic function."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _raw_components(teacher: _Teacher, ids: np.ndarray, ranks: np.ndarray, dense: np.ndarray, space: _IdSpace) -> np.ndarray:
    """The three uncalibrated teacher terms, float64 ``[3, B]``: sum of per-id scalar
    effects, sum over feature pairs of dot products of per-id vectors (bags mean-pooled),
    and the linear dense term."""
    keys = ids[..., None] + teacher.salts[None, :, None, :]  # [B, F, L, 1 + K], wraps
    values = _hash_normal(keys)
    amplitude = 1.0 / np.sqrt(1.0 + ranks.astype(np.float64) / space.hot[None, :, None])
    pooled = (values * amplitude[..., None]).mean(axis=2)  # [B, F, 1 + K]
    scalar = pooled[..., 0] @ teacher.feature_weight
    vectors = pooled[..., 1:]
    summed = vectors.sum(axis=1)
    # sum_{f<g} <v_f, v_g> = (|sum_f v_f|^2 - sum_f |v_f|^2) / 2
    pairwise = 0.5 * ((summed**2).sum(axis=-1) - (vectors**2).sum(axis=(1, 2)))
    linear = dense.astype(np.float64) @ teacher.dense_weight
    return np.stack([scalar, pairwise, linear])


def _teacher_logits(teacher: _Teacher, space: _IdSpace, ids: np.ndarray, ranks: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """Calibrated teacher logit, float64 ``[B]``."""
    components = _raw_components(teacher, ids, ranks, dense, space)
    return teacher.bias + ((components - teacher.center[:, None]) * teacher.coef[:, None]).sum(0)


# -- sampling ----------------------------------------------------------------------------


def _draw_inputs(
    rng: np.random.Generator, n: int, ids_per_feature: int, space: _IdSpace, teacher: _Teacher
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw Zipf ranks, their ids ``[n, F, L]`` and dense features ``[n, D]``."""
    u = rng.random((n, len(space.sizes), ids_per_feature))
    ranks = _zipf_ranks(u, space)
    ids = _ranks_to_ids(ranks, space)
    z = rng.standard_normal((n, len(teacher.dense_mu)))
    counts = np.floor(np.exp(teacher.dense_mu + teacher.dense_sigma * z))
    dense = np.log1p(counts).astype(np.float32)
    return ranks, ids, dense


def _draw_samples(rng: np.random.Generator, n: int, ids_per_feature: int, space: _IdSpace, teacher: _Teacher) -> _Draw:
    """Draw one batch: inputs, then labels ~ Bernoulli(sigmoid(teacher logit))."""
    ranks, ids, dense = _draw_inputs(rng, n, ids_per_feature, space, teacher)
    logits = _teacher_logits(teacher, space, ids, ranks, dense)
    labels = (rng.random(n) < _sigmoid(logits)).astype(np.float32)
    return _Draw(ranks=ranks, ids=ids, dense=dense, logits=logits, labels=labels)
