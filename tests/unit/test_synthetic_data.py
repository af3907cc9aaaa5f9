"""Tests of the synthetic click stream: determinism, exact resume (also across world
sizes), Zipf skew and its spread over the id range, and a teacher that is both good
(AUC) and learnable by a plain model."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from trainer.data.reader import Batch, Reader
from trainer.data.synthetic import SyntheticClickStream

NAMES = [f"cat_{i}" for i in range(8)]
SIZES = [100, 1_000, 10_000, 100_000, 100, 1_000, 10_000, 40_000_000]


def make_reader(**overrides: object) -> SyntheticClickStream:
    """A small stream; keyword overrides replace the defaults."""
    kwargs: dict[str, object] = dict(
        feature_names=NAMES,
        num_embeddings=SIZES,
        num_dense=13,
        batch_size=256,
        rank=0,
        world_size=1,
        seed=7,
    )
    kwargs.update(overrides)
    return SyntheticClickStream(**kwargs)  # type: ignore[arg-type]


def assert_batches_equal(a: Batch, b: Batch) -> None:
    """Exact equality of every tensor of two batches."""
    assert a.sparse_features.keys() == b.sparse_features.keys()
    assert torch.equal(a.dense_features, b.dense_features)
    assert torch.equal(a.labels, b.labels)
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())


def batches_equal(a: Batch, b: Batch) -> bool:
    """True when two batches are exactly equal."""
    try:
        assert_batches_equal(a, b)
    except AssertionError:
        return False
    return True


def fingerprint(batch: Batch) -> bytes:
    """Bytes that identify a batch's content."""
    return (
        batch.sparse_features.values().numpy().tobytes() + batch.dense_features.numpy().tobytes() + batch.labels.numpy().tobytes()
    )


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula, ties averaged."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    ranks[order] = np.arange(1, len(scores) + 1)
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    for start, count in zip(first[counts > 1], counts[counts > 1]):
        ranks[order[start : start + count]] = start + (count + 1) / 2
    positives = labels.sum()
    negatives = len(labels) - positives
    return float((ranks[labels == 1].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def test_auc_helper_is_right() -> None:
    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auc(np.array([1.0, 1.0]), np.array([0, 1])) == pytest.approx(0.5)


def test_batch_format() -> None:
    reader = make_reader(ids_per_feature=3, batch_size=64)
    assert isinstance(reader, Reader)
    batch = reader.next_batch()
    assert batch.dense_features.dtype == torch.float32
    assert batch.dense_features.shape == (64, 13)
    assert bool((batch.dense_features >= 0).all())
    assert batch.labels.dtype == torch.float32 and batch.labels.shape == (64,)
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    kjt = batch.sparse_features
    assert kjt.keys() == NAMES
    assert kjt.values().dtype == torch.int64
    assert kjt.lengths().dtype in (torch.int32, torch.int64)
    assert kjt.lengths().tolist() == [3] * (64 * len(NAMES))
    for name, size in zip(NAMES, SIZES):
        values = kjt[name].values()
        assert values.numel() == 64 * 3
        assert int(values.min()) >= 0 and int(values.max()) < size


def test_same_seed_gives_identical_batches() -> None:
    a, b = make_reader(), make_reader()
    for _ in range(3):
        assert_batches_equal(a.next_batch(), b.next_batch())


def test_different_seed_gives_different_batches() -> None:
    assert not batches_equal(make_reader(seed=7).next_batch(), make_reader(seed=8).next_batch())


def test_ranks_read_different_batches() -> None:
    rank0 = make_reader(rank=0, world_size=2)
    rank1 = make_reader(rank=1, world_size=2)
    first0, first1 = rank0.next_batch(), rank1.next_batch()
    assert not batches_equal(first0, first1)
    assert_batches_equal(first0, rank0.batch_at(0))
    assert_batches_equal(first1, rank0.batch_at(1))
    assert rank0.state_dict() == rank1.state_dict() == {"next_global_batch": 2}


def test_state_restore_mid_stream_yields_identical_batches() -> None:
    reader = make_reader(rank=1, world_size=3)
    for _ in range(5):
        reader.next_batch()
    state = json.loads(json.dumps(reader.state_dict()))
    expected = [reader.next_batch() for _ in range(3)]
    restored = make_reader(rank=1, world_size=3)
    restored.next_batch()  # somewhere else first: load must seek, not just continue
    restored.load_state_dict(state)
    for want in expected:
        assert_batches_equal(restored.next_batch(), want)


@pytest.mark.parametrize("new_world_size", [1, 4])
def test_state_restores_into_another_world_size(new_world_size: int) -> None:
    reference = make_reader(batch_size=32)
    ids_of = {fingerprint(reference.batch_at(k)): k for k in range(64)}
    assert len(ids_of) == 64
    seen: list[int] = []
    old = [make_reader(batch_size=32, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):  # three steps at world size 2
        seen += [ids_of[fingerprint(reader.next_batch())] for reader in old]
    state = old[0].state_dict()
    assert old[1].state_dict() == state
    new = [make_reader(batch_size=32, rank=r, world_size=new_world_size) for r in range(new_world_size)]
    for reader in new:
        reader.load_state_dict(state)
    for _ in range(12 // new_world_size):
        seen += [ids_of[fingerprint(reader.next_batch())] for reader in new]
    assert sorted(seen) == list(range(len(seen)))  # no duplicates, no gaps
    assert len(seen) == 18


def test_zipf_skew_and_hot_ids_spread_over_range() -> None:
    reader = make_reader(batch_size=1024)
    batches = [reader.next_batch() for _ in range(30)]
    for name, size in zip(NAMES, SIZES):
        if size < 1000:
            continue
        ids = torch.cat([b.sparse_features[name].values() for b in batches]).numpy()
        low_half = float(np.mean(ids < size // 2))
        assert 0.3 <= low_half <= 0.7, (name, low_half)
        if size > 100_000:
            continue  # 30k lookups cannot show the top 1% of 40M ids
        counts = np.bincount(ids, minlength=size)
        top = np.sort(counts)[::-1][: size // 100].sum() / len(ids)
        assert top > 0.4, (name, top)  # uniform ids would give 0.01
        hottest = np.argsort(counts)[::-1][:10]
        assert np.ptp(hottest) > size // 4, (name, hottest)  # not clustered at low ids


def test_zipf_exponent_controls_skew_and_exponent_one_is_allowed() -> None:
    def top_share(exponent: float) -> float:
        reader = make_reader(zipf_exponent=exponent, batch_size=2048)
        ids = reader.next_batch().sparse_features["cat_2"].values().numpy()
        counts = np.sort(np.bincount(ids, minlength=10_000))[::-1]
        return float(counts[:100].sum() / len(ids))

    shares = [top_share(e) for e in (0.5, 1.0, 1.5)]
    assert shares[0] < shares[1] < shares[2]
    assert shares[0] < 0.2 and shares[2] > 0.8


def collect_teacher(reader: SyntheticClickStream, num_batches: int) -> tuple[np.ndarray, np.ndarray]:
    """Teacher logits and labels of the first batches of a stream."""
    logits, labels = [], []
    for k in range(num_batches):
        batch = reader.batch_at(k)
        logits.append(reader.teacher_logits(batch))
        labels.append(batch.labels.numpy())
    return np.concatenate(logits), np.concatenate(labels)


def test_teacher_auc_and_click_rate() -> None:
    reader = make_reader(batch_size=512)
    logits, labels = collect_teacher(reader, 20)
    assert auc(logits, labels) >= 0.8
    click_rate = float(labels.mean())
    assert 0.2 <= click_rate <= 0.5
    # labels are Bernoulli(sigmoid(logit)): predicted and observed click rates agree
    expected = 1.0 / (1.0 + np.exp(-logits))
    assert abs(expected.mean() - click_rate) < 0.02
    high = logits > np.median(logits)
    assert labels[high].mean() > 2 * labels[~high].mean()


def test_train_and_eval_streams_differ_but_share_the_teacher() -> None:
    train, evaluation = make_reader(), make_reader(stream="eval")
    eval_batch = evaluation.batch_at(0)
    assert not batches_equal(train.batch_at(0), eval_batch)
    np.testing.assert_array_equal(train.teacher_logits(eval_batch), evaluation.teacher_logits(eval_batch))
    other_seed = make_reader(seed=8)
    assert not np.allclose(other_seed.teacher_logits(eval_batch), train.teacher_logits(eval_batch))


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Train on one thread: tiny ops on two contended threads run 10-20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("use_dense", [True, False])
@pytest.mark.usefixtures("one_torch_thread")
def test_a_plain_logistic_regression_learns_the_stream(use_dense: bool) -> None:
    """Logistic regression on one-hot ids (+ dense) learns the teacher; without the dense
    features too, since the per-id effects carry most of the signal."""
    torch.manual_seed(0)
    train = make_reader(batch_size=512)
    evaluation = make_reader(batch_size=512, stream="eval")
    tables = torch.nn.ModuleList(torch.nn.EmbeddingBag(min(s, 200_000), 1, mode="sum") for s in SIZES)
    for table in tables:
        torch.nn.init.zeros_(table.weight)
    dense = torch.nn.Linear(13, 1)
    params = list(tables.parameters()) + list(dense.parameters())
    optimizer = torch.optim.Adagrad(params, lr=0.1)

    def score(batch: Batch) -> torch.Tensor:
        out = dense(batch.dense_features * use_dense).squeeze(1)
        for name, table in zip(NAMES, tables):
            jt = batch.sparse_features[name]
            ids = jt.values() % table.num_embeddings  # hash the 40M table down
            out = out + table(ids, jt.offsets()[:-1]).squeeze(1)
        return out

    for _ in range(150):
        batch = train.next_batch()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(score(batch), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        batches = [evaluation.batch_at(k) for k in range(10)]
        scores = torch.cat([score(b) for b in batches]).numpy()
    labels = torch.cat([b.labels for b in batches]).numpy()
    assert auc(scores, labels) > 0.65


@pytest.mark.parametrize(
    ("overrides", "argument"),
    [
        (dict(zipf_exponent=0.0), "zipf_exponent"),
        (dict(zipf_exponent=-1.0), "zipf_exponent"),
        (dict(zipf_exponent=math.nan), "zipf_exponent"),
        (dict(feature_names=[], num_embeddings=[]), "feature_names"),
        (dict(feature_names=["a", "a"], num_embeddings=[2, 2]), "feature_names"),
        (dict(num_embeddings=SIZES[:-1]), "num_embeddings"),
        (dict(num_embeddings=[0] + SIZES[1:]), "num_embeddings"),
        (dict(num_embeddings=[2**33] + SIZES[1:]), "num_embeddings"),
        (dict(rank=2, world_size=2), "rank"),
        (dict(rank=-1, world_size=2), "rank"),
        (dict(world_size=0), "world_size"),
        (dict(batch_size=0), "batch_size"),
        (dict(ids_per_feature=0), "ids_per_feature"),
        (dict(num_dense=-1), "num_dense"),
        (dict(seed=-1), "seed"),
        (dict(stream=""), "stream"),
    ],
)
def test_bad_arguments_are_rejected(overrides: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        make_reader(**overrides)


@pytest.mark.parametrize(
    ("state", "named"),
    [
        ({}, "next_global_batch"),
        ({"next_global_batch": 1, "epoch": 0}, "epoch"),
        ({"next_global_batch": "3"}, "next_global_batch"),
        ({"next_global_batch": 1.5}, "next_global_batch"),
        ({"next_global_batch": True}, "next_global_batch"),
        ({"next_global_batch": -1}, "next_global_batch"),
        ([("next_global_batch", 1)], "dict"),
    ],
)
def test_bad_state_is_rejected(state: object, named: str) -> None:
    reader = make_reader()
    with pytest.raises(ValueError, match=named):
        reader.load_state_dict(state)  # type: ignore[arg-type]
    assert reader.state_dict() == {"next_global_batch": 0}
