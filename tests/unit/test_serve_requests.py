"""A prediction request's JSON as the model's batch, and every way one is refused (trainer/serve/requests.py)."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.serve.requests import FeatureLayout, RequestError, parse_request

LAYOUT = FeatureLayout(dense_in_features=3, features=("user", "item"), cardinalities=(10, 5))


def _body(*samples: object) -> bytes:
    return json.dumps({"samples": list(samples)}).encode()


def test_samples_become_a_batch_in_the_models_feature_order() -> None:
    batch = parse_request(
        _body(
            {"dense": [1, 2.5, -3], "sparse": {"item": [4, 0], "user": [9]}},
            {"dense": [0, 0, 0], "sparse": {"user": [1, 2, 3]}},  # item left out: an empty bag
            {"dense": [0.5, 0, 1]},
        ),
        LAYOUT,
        max_samples=3,
    )
    assert batch.size == 3
    assert torch.equal(batch.dense, torch.tensor([[1, 2.5, -3], [0, 0, 0], [0.5, 0, 1]]))
    kjt = batch.sparse
    assert kjt.keys() == ["user", "item"]
    assert kjt["user"].lengths().tolist() == [1, 3, 0] and kjt["user"].values().tolist() == [9, 1, 2, 3]
    assert kjt["item"].lengths().tolist() == [2, 0, 0] and kjt["item"].values().tolist() == [4, 0]


GOOD = {"dense": [1, 2, 3], "sparse": {"user": [1]}}


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"\xff", 400, "body is not JSON"),
        (b"{", 400, "body is not JSON"),
        (b"[]", 400, 'one key, "samples"'),
        (json.dumps({"samples": [GOOD], "extra": 1}).encode(), 400, 'one key, "samples"'),
        (json.dumps({"samples": {}}).encode(), 400, "non-empty list"),
        (_body(GOOD, GOOD, GOOD), 413, "3 samples, more than serve.max_samples = 2"),
        (_body(7), 400, "samples[0] must be an object"),
        (_body(GOOD, {**GOOD, "label": 1}), 400, "samples[1]: unknown field 'label'"),
        (_body({"sparse": {}}), 400, "samples[0].dense: expected a list of 3 numbers, got null"),
        (_body({"dense": [1, 2]}), 400, "samples[0].dense: expected a list of 3 numbers, got a list of 2"),
        (_body({"dense": [1, 2, "3"]}), 400, "samples[0].dense: '3' is not a finite float32 number"),
        (_body({"dense": [1, 2, True]}), 400, "samples[0].dense: True is not a finite float32 number"),
        (b'{"samples": [{"dense": [1, 2, NaN]}]}', 400, "nan is not a finite float32 number"),
        (_body({"dense": [1, 2, 3], "sparse": []}), 400, "samples[0].sparse must be an object"),
        (_body({"dense": [1, 2, 3], "sparse": {"usr": [1]}}), 400, "unknown feature 'usr' (the model's: user, item)"),
        (_body({"dense": [1, 2, 3], "sparse": {"user": 1}}), 400, "samples[0].sparse.user: expected a list of ids, got a number"),
        (_body({"dense": [1, 2, 3], "sparse": {"user": [1.0]}}), 400, "samples[0].sparse.user: 1.0 is not an integer id"),
        (_body({"dense": [1, 2, 3], "sparse": {"item": [5]}}), 400, "samples[0].sparse.item: id 5 out of range 0..4"),
        (_body({"dense": [1, 2, 3], "sparse": {"item": [-1]}}), 400, "id -1 out of range 0..4"),
        # what JSON holds and float32 or Python's parser cannot: refused, never a server error
        (
            _body({"dense": [1, 2, 10**400]}),
            400,
            "samples[0].dense: 10000000000000000000... (401 characters) is not a finite float32",
        ),
        (_body({"dense": [1, 2, 1e39]}), 400, "samples[0].dense: 1e+39 is not a finite float32 number"),
        (_body({"dense": [1, 2, -3.5e38]}), 400, "-3.5e+38 is not a finite float32 number"),
        (b'{"samples": [{"dense": [1, 2, ' + b"7" * 5000 + b"]}]}", 400, "body refused: Exceeds the limit"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "body refused: JSON nested too deeply"),
        (_body({"dense": [1, 2, 3], "sparse": {"user": [10**400]}}), 400, "samples[0].sparse.user: id 1000000000"),
    ],
)
def test_a_bad_request_is_refused_with_one_line_naming_it(body: bytes, status: int, message: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_request(body, LAYOUT, max_samples=2)
    assert info.value.status == status
    assert message in str(info.value) and "\n" not in str(info.value)
    assert len(str(info.value)) < 300, "a one-line message, not the client's input echoed"


def test_the_largest_float32_passes() -> None:
    batch = parse_request(_body({"dense": [3.4028234e38, -3.4028234e38, 0]}), LAYOUT, max_samples=1)
    assert bool(torch.isfinite(batch.dense).all())
