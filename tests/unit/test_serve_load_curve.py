"""The serving load curve's parts, without training: where a prediction's time goes on the server
(trainer/serve/app.py, freshness.py), the column check of a request against the value-by-value
one (trainer/serve/requests.py), and the open-loop sweep and its report (bench/serve_load.py,
bench/serve.py) against a real aiohttp server on loopback. Behaviour only: no figure is judged.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from bench.serve import SweepRun, measurements, summarize_sweep
from bench.serve_load import (
    LoadPoint,
    Outcome,
    ServerTime,
    Sweep,
    SweepResult,
    SweepSettings,
    highest_meeting,
    parse_metrics,
    point_of,
    refine_rate,
)
from ckpt.dense.store import DenseStore
from tests.unit.test_serve_admission import Served
from trainer.config import ServeConfig
from trainer.serve.app import Answer, Computed, LookupClock, Predictor
from trainer.serve.client import ServeClient
from trainer.serve.freshness import STAGES, RequestStages, ServeMetrics
from trainer.serve.requests import FLOAT32_MAX, FeatureLayout, RequestError, _checked_batch, _fast_batch, parse_request
from trainer.serve.versions import ServedModel

LAYOUT = FeatureLayout(dense_in_features=3, features=("user", "item", "ctx"), cardinalities=(10, 5, 1))


# -- the request's column check --------------------------------------------------------------------
def _random_sample(rng: random.Random, layout: FeatureLayout) -> dict[str, Any]:
    sample: dict[str, Any] = {}
    if layout.dense_in_features or rng.random() < 0.5:
        sample["dense"] = [
            rng.choice([rng.uniform(-1e6, 1e6), rng.randint(-1000, 1000), rng.randint(-(2**70), 2**70), 0, -0.0, 1e-320, 3.3e37])
            for _ in range(layout.dense_in_features)
        ]
    if rng.random() < 0.8:
        sample["sparse"] = {
            f: [rng.randrange(rows) for _ in range(rng.randint(0, 3))]
            for f, rows in zip(layout.features, layout.cardinalities)
            if rng.random() < 0.7
        }
    return sample


def _same(a: Any, b: Any) -> bool:
    return (
        a.dense.dtype == b.dense.dtype
        and torch.equal(a.dense, b.dense)
        and a.sparse.keys() == b.sparse.keys()
        and torch.equal(a.sparse.values(), b.sparse.values())
        and torch.equal(a.sparse.lengths(), b.sparse.lengths())
        and a.sparse.values().dtype == b.sparse.values().dtype
        and a.sparse.lengths().dtype == b.sparse.lengths().dtype
    )


@pytest.mark.parametrize("layout", [LAYOUT, FeatureLayout(0, ("user",), (7,))])
def test_the_column_check_builds_the_same_batch_as_the_value_by_value_one(layout: FeatureLayout) -> None:
    rng = random.Random(3)
    for _ in range(200):
        samples = json.loads(json.dumps([_random_sample(rng, layout) for _ in range(rng.randint(1, 9))]))
        fast = _fast_batch(samples, layout)
        assert fast is not None, samples
        assert _same(fast, _checked_batch(samples, layout)), samples


@pytest.mark.parametrize(
    "value",
    [FLOAT32_MAX, -FLOAT32_MAX, int(FLOAT32_MAX), 3.4028235e38, int(FLOAT32_MAX) + 1, 1e39, 10**400, float("nan"), True, "1"],
)
def test_values_at_float32s_limit_are_left_to_the_value_by_value_check(value: Any) -> None:
    """Past the column check's bound the value-by-value check decides: the same answer as before."""
    samples = [{"dense": [1.0, 2, value], "sparse": {"user": [1]}}]
    assert _fast_batch(samples, LAYOUT) is None
    body = json.dumps({"samples": samples}).encode()
    try:
        expected = _checked_batch(samples, LAYOUT)
    except RequestError as exc:
        with pytest.raises(RequestError) as info:
            parse_request(body, LAYOUT, 4)
        assert str(info.value) == str(exc)
    else:
        assert _same(parse_request(body, LAYOUT, 4), expected)


@pytest.mark.parametrize(
    "sample",
    [
        {"dense": [1, 2, 3], "sparse": {"user": [10]}},
        {"dense": [1, 2, 3], "sparse": {"user": [-1]}},
        {"dense": [1, 2, 3], "sparse": {"user": [True]}},
        {"dense": [1, 2, 3], "sparse": {"user": [2**70]}},
        {"dense": [1, 2, 3], "sparse": {"nope": [1]}},
        {"dense": [1, 2, 3], "sparse": {"user": 1}},
        {"dense": [1, 2, 3], "sparse": []},
        {"dense": [1, 2], "sparse": {}},
        {"dense": [1, 2, None]},
        {"dense": [1, 2, 3], "label": 1},
        {"sparse": {}},
    ],
)
def test_the_column_check_accepts_nothing_the_value_by_value_check_refuses(sample: dict[str, Any]) -> None:
    samples = [{"dense": [0, 0, 0]}, sample]
    assert _fast_batch(samples, LAYOUT) is None
    with pytest.raises(RequestError):
        parse_request(json.dumps({"samples": samples}).encode(), LAYOUT, 4)


# -- where a prediction's time goes --------------------------------------------------------------
def test_the_lookup_clock_counts_the_embedding_forwards_of_this_thread_once() -> None:
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])], device=torch.device("cpu")
    )
    outer = torch.nn.Sequential(ebc)  # a module holding the collection
    clock = LookupClock()
    clock.watch(outer)
    clock.watch(outer)  # once only: the hooks are not doubled
    assert clock.take() == 0.0
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1], dtype=torch.int32))
    ebc(kjt)
    first = clock.take()
    assert first > 0.0 and clock.take() == 0.0
    seen: list[float] = []
    other = threading.Thread(target=lambda: seen.append(clock.take()))
    ebc(kjt)  # on this thread: not another's
    other.start()
    other.join()
    assert seen == [0.0] and clock.take() > 0.0


def test_a_prediction_is_split_into_stages_that_add_up_to_its_time(tmp_path: Path, debug_config: Any) -> None:
    """The real Predictor on the debug model (both copies' rows left as allocated: no checkpoint
    is needed to time a forward), behind the real application."""
    cfg = debug_config.load(check_data=False)
    model = ServedModel(cfg.model, DenseStore(tmp_path))
    version = model.standby
    version.checkpoint_id, version.first_served_unix = 3, time.time()  # served, its first answer long given
    for weight in version.weights.values():
        weight.zero_()
    model.live = version
    metrics = ServeMetrics(staleness=lambda: 0.0)
    predictor = Predictor(model, model.servable.layout(), ServeConfig(), metrics)
    layout = model.servable.layout()
    body = json.dumps(
        {"samples": [{"dense": [0.5] * layout.dense_in_features, "sparse": {f: [1] for f in layout.features}}] * 4}
    ).encode()
    answer = predictor(body)
    c = answer.computed
    assert answer.samples == 4 and answer.checkpoint_id == 3 and c is not None
    assert c.start <= c.parsed <= c.locked <= c.done and 0 < c.lookup_s <= c.done - c.locked
    with Served(ServeConfig(), predictor, metrics) as served:
        for _ in range(3):
            status, doc = _post(served, body)
            assert status == 200 and len(doc["scores"]) == 4
        sample = metrics.registry.get_sample_value
        count = sample("deltarec_serve_request_seconds_count", {"samples": "2-64"})
        total = sample("deltarec_serve_request_seconds_sum", {"samples": "2-64"})
        stages = {s: sample("deltarec_serve_request_stage_seconds_sum", {"samples": "2-64", "stage": s}) or 0.0 for s in STAGES}
        assert count == 3 and all(v >= 0 for v in stages.values()), stages
        assert stages["lookup"] > 0 and stages["parse"] > 0 and stages["forward"] > 0
        # the stages partition the request's time: equal up to the rounding of float sums
        assert sum(stages.values()) == pytest.approx(total, rel=1e-6)
        # the page the benchmark reads says the same
        server = ServerTime.between({}, parse_metrics(generate_latest(metrics.registry).decode()), 64)
        assert server is not None and server.requests == 3
        assert server.stages_total_ms == pytest.approx(server.request_ms, rel=1e-6)


def test_request_stages_are_named_in_order_and_add_up() -> None:
    stages = RequestStages(1, 2, 3, 4, 5, 6, 7, 8)
    assert STAGES == ("read", "queue", "parse", "lock", "lookup", "forward", "resume", "respond")
    assert stages.total == 36


def _post(served: Served, body: bytes) -> tuple[int, Any]:
    return ServeClient(served.url).predict(body)


class SleepyPredictor:
    """Answers each body after `service_s` on its thread, saying where the time went."""

    def __init__(self, service_s: float) -> None:
        self.service_s = service_s

    def __call__(self, body: bytes) -> Answer:
        start = time.perf_counter()
        samples = len(json.loads(body)["samples"])
        parsed = time.perf_counter()
        time.sleep(self.service_s)
        done = time.perf_counter()
        return Answer([0.5] * samples, 7, 70, samples, Computed(start, parsed, parsed, (done - parsed) / 2, done))


# -- the open-loop sweep -------------------------------------------------------------------------
def test_the_sweep_offers_doubling_rates_per_size_until_overloaded_and_accounts_the_servers_time() -> None:
    """One server thread busy 30 ms a request and no queue: the doubling rates overload it (503s),
    and every point says where the server's time went."""
    settings = SweepSettings(
        sizes=(1, 4), start_rps=10, max_rps=160, point_s=0.4, timeout_s=1.0, goals_ms=((1, 200.0),), refine=1
    )
    metrics = ServeMetrics(staleness=lambda: 0.0)
    with Served(ServeConfig(max_concurrency=1, max_queue=0), SleepyPredictor(0.03), metrics) as served:
        bodies = {n: json.dumps({"samples": [{"dense": [1.0]}] * n}).encode() for n in settings.sizes}
        points = asyncio.run(Sweep(served.url, bodies, settings).run(ready_timeout_s=30))
    assert {p.samples for p in points} == {1, 4}
    for size in (1, 4):
        mine = [p for p in points if p.samples == size]
        rates = [p.offered_rps for p in mine]
        assert rates == sorted(rates) and len(set(rates)) == len(rates), rates  # one point per (rate, size)
        doubled = [r for r in rates if r in (10, 20, 40, 80, 160)]
        assert doubled == [10 * 2**i for i in range(len(doubled))], rates
        # the doubling stopped at its first overloaded point, or at the highest rate allowed
        overloaded = [p.offered_rps for p in mine if p.overload and p.offered_rps in doubled]
        assert overloaded == [doubled[-1]] or (not overloaded and doubled[-1] == 160), mine
        # over the p99 alone: measured twice before the doubling stops
        assert all(p.remeasured_p99_ms is not None for p in mine if p.overload == "p99" and p.offered_rps in doubled)
        for p in mine:
            assert p.sent == round(p.offered_rps * settings.point_s) and p.ok + p.errors == p.sent, p
            assert sum(p.error_kinds.values()) == p.errors
            if p.ok:
                assert p.p50_ms is not None and p.p99_ms is not None and 0 < p.p50_ms <= p.p99_ms, p
                assert p.server is not None and p.server.requests >= p.ok
                assert p.server.stages_total_ms == pytest.approx(p.server.request_ms, rel=1e-3)
                assert p.server.stages_ms["parse"] > 0 and p.server.stages_ms["forward"] > 0
    # a refinement lies between a rate meeting the goal and the next one swept, which did not
    ones = [p for p in points if p.samples == 1]
    assert highest_meeting(ones, 1, 200.0) in {p.offered_rps for p in ones if p.meets(200.0)} | {None}
    result = SweepResult(settings, points)
    assert SweepResult.from_json(json.loads(json.dumps(result.to_json()))) == result


# -- the report ----------------------------------------------------------------------------------
def _point(samples: int, rate: float, p99: float | None, errors: int = 0, overload: str = "") -> LoadPoint:
    server = ServerTime(10, 3.0, dict.fromkeys(STAGES, 3.0 / len(STAGES)))
    ok = 10 - errors
    return LoadPoint(
        samples, rate, 1.0, 10, ok, errors, {"503": errors} if errors else {}, float(ok), p99, p99, p99, 0.1, server, overload
    )


def test_point_figures_come_from_the_schedule_and_overload_is_named() -> None:
    settings = SweepSettings(stop_p99_ms=100, stop_errors=0.1, behind=0.8)
    # 10 requests scheduled at 10/s, each 5 ms late to start and answered 20 ms after its schedule
    outcomes = [Outcome(k / 10, k / 10 + 0.005, k / 10 + 0.02, "") for k in range(10)]
    p = point_of(1, 10.0, outcomes, None, settings)
    assert p.sent == 10 and p.ok == 10 and p.errors == 0 and p.overload == ""
    assert p.p50_ms == pytest.approx(20) and p.p99_ms == pytest.approx(20) and p.send_lag_p99_ms == pytest.approx(5)
    assert p.achieved_rps == pytest.approx(10.0) and p.duration_s == pytest.approx(1.0)
    # queueing behind the schedule counts: answers 0.3 s late each
    late = [Outcome(o.due, o.started, o.due + 0.3, "") for o in outcomes]
    assert point_of(1, 10.0, late, None, settings).overload == "p99"
    errors = [o._replace(error="503" if k < 2 else "") for k, o in enumerate(outcomes)]
    e = point_of(1, 10.0, errors, None, settings)
    assert e.overload == "errors" and e.errors == 2 and e.error_kinds == {"503": 2} and e.ok == 8
    slow = [Outcome(k / 10, k / 10, 3.0 + k * 0.05, "") for k in range(10)]  # answered 3 s late: 10 in 3.45 s
    assert point_of(1, 10.0, slow, None, SweepSettings(stop_p99_ms=1e6)).overload == "behind"


def test_the_highest_rate_meeting_a_goal_is_consistent_with_the_points() -> None:
    points = [
        _point(1, 8, 5),
        _point(1, 16, 9),
        _point(1, 24, 30),  # a refinement that missed
        _point(1, 32, 15, errors=1),  # within the p99 but an error: misses
        _point(1, 64, 900, overload="p99"),
        _point(512, 8, 60),
        _point(512, 16, 400, overload="p99"),
    ]
    assert highest_meeting(points, 1, 20) == 16
    assert highest_meeting(points, 512, 50) is None
    assert refine_rate(points, 1, 20) == 20  # between 16 and 24
    assert refine_rate([_point(1, 16, 9), _point(1, 17, 30)], 1, 20) is None  # nothing left between
    assert refine_rate(points, 512, 50) == 4  # none meets it: half the lowest rate
    assert refine_rate([_point(512, 1, 60)], 512, 50) is None  # not under 1/s
    settings = SweepSettings(sizes=(1, 512), goals_ms=((1, 20.0), (512, 50.0)))
    report = summarize_sweep(SweepRun(SweepResult(settings, points), True, 12.0))
    goals = {g.samples: g for g in report.goals}
    assert (goals[1].highest_rps, goals[1].next_rps) == (16, 24)
    assert (goals[512].highest_rps, goals[512].next_rps) == (None, 8)
    for g in report.goals:  # every point above the highest rate meeting it misses the goal
        above = [p for p in points if p.samples == g.samples and p.offered_rps > (g.highest_rps or 0)]
        assert not any(p.meets(g.p99_ms) for p in above)
    sat = {s.samples: s for s in report.saturation}
    assert sat[1].offered_rps == 64 and sat[1].overload == "p99" and sat[512].offered_rps == 16
    assert sat[1].outside_ms == pytest.approx(900 - 3.0)
    doc = {"settings": {"interval_s": 10.0}, "summary": {}, "sweep": asdict(report)}
    names = {m.metric for m in measurements(doc)}
    assert {"load_p99_ms", "load_highest_rps_meeting_p99", "load_saturation_stage_ms"} <= names
