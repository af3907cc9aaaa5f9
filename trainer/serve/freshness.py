"""The server's measures, in Prometheus form (`prometheus-client`, a registry of its own).

Freshness of a checkpoint: from its step's wall time on rank 0 (the COMMIT's `step_unix`)
to the first response computed with it. Staleness: how old the served checkpoint's step is
now; it grows while the broker is away, and readiness fails past `serve.max_staleness_s`.
Prometheus histograms give buckets, so the p50/p99 of the newest checkpoints' freshness are
gauges too, computed at scrape time.

Where a prediction's time goes: `deltarec_serve_request_stage_seconds{stage, samples}`, one
observation per stage of every answered request (`STAGES`, in order; they add up to its
`deltarec_serve_request_seconds`). A stage's `_sum` over its `_count` is its mean; the
benchmark's load curve reads them around each load point (bench/serve.py).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import astuple, dataclass, fields

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Request sizes the latency histogram tells apart (samples per request).
SIZE_CLASSES = ((1, "1"), (64, "2-64"), (512, "65-512"))
_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_FRESHNESS_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


@dataclass(frozen=True)
class RequestStages:
    """Seconds of one answered prediction request in each stage, in order (they add up to the
    request's time, from its handler's start to its response's body encoded):

    - `read`: its body arriving (and the admission check);
    - `queue`: waiting for one of the `serve.max_concurrency` threads;
    - `parse`: the JSON parsed and checked into the model's input batch;
    - `lock`: taking the live copy of the model (waiting while a swap holds it);
    - `lookup`: the embedding collections' forwards (the rows gathered and pooled);
    - `forward`: the rest of the scoring (dense layers, interaction, the scores' check);
    - `resume`: the event loop taking the answer back from the thread;
    - `respond`: the answer encoded as JSON.
    """

    read: float
    queue: float
    parse: float
    lock: float
    lookup: float
    forward: float
    resume: float
    respond: float

    @property
    def total(self) -> float:
        return sum(astuple(self))


#: The stages of `RequestStages`, in order: the `stage` label of `deltarec_serve_request_stage_seconds`.
STAGES = tuple(f.name for f in fields(RequestStages))


def size_class(samples: int) -> str:
    """The `samples` label of a request of `samples` samples."""
    for limit, label in SIZE_CLASSES:
        if samples <= limit:
            return label
    return "513+"


class ServeMetrics:
    """Every measure of one server; `staleness()` and `version()` are read at scrape time."""

    def __init__(self, staleness: Callable[[], float], window: int = 1000) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("deltarec_serve_requests", "Requests answered, by HTTP status", ["status"], registry=r)
        self.latency = Histogram(
            "deltarec_serve_request_seconds",
            "Time from a prediction request's arrival to its response, by samples per request",
            ["samples"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stages = Histogram(
            "deltarec_serve_request_stage_seconds",
            "Time of an answered prediction request in each stage (read, queue, parse, lock, lookup, forward, "
            "resume, respond), by samples per request",
            ["stage", "samples"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.freshness = Histogram(
            "deltarec_serve_freshness_seconds",
            "From a checkpoint's step on rank 0 to the first response computed with it",
            buckets=_FRESHNESS_BUCKETS,
            registry=r,
        )
        self.apply = Histogram(
            "deltarec_serve_apply_seconds", "Time to apply one checkpoint and swap it in", buckets=_FRESHNESS_BUCKETS, registry=r
        )
        self.in_progress = Gauge(
            "deltarec_serve_requests_in_progress",
            "Prediction requests admitted and not yet answered (computing, or waiting for a thread)",
            registry=r,
        )
        self.follow_errors = Counter("deltarec_serve_follow_errors", "Rounds of following that failed", registry=r)
        self.checkpoint = Gauge("deltarec_serve_checkpoint_id", "The checkpoint served (-1: none yet)", registry=r)
        self.step = Gauge("deltarec_serve_step", "The training step of the checkpoint served", registry=r)
        self.model_bytes = Gauge("deltarec_serve_model_bytes", "Bytes of both copies of the tables and the rows kept", registry=r)
        Gauge("deltarec_serve_staleness_seconds", "Age of the served checkpoint's step", registry=r).set_function(staleness)
        self._recent: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        for q in (50, 99):
            Gauge(
                f"deltarec_serve_freshness_p{q}_seconds",
                f"p{q} of the freshness of the newest {window} checkpoints served",
                registry=r,
            ).set_function(functools.partial(self.freshness_quantile, q))
        self.checkpoint.set(-1)
        self.step.set(-1)

    def answered(self, samples: int, seconds: float, stages: RequestStages | None = None) -> None:
        """One prediction answered: its time and, when known, each stage's."""
        label = size_class(samples)
        self.latency.labels(label).observe(seconds)
        if stages is not None:
            for stage, value in zip(STAGES, astuple(stages)):
                self.stages.labels(stage, label).observe(value)

    def served_first(self, step_unix: float, now: float | None = None) -> float:
        """A checkpoint's first response: record and return its freshness."""
        fresh = (time.time() if now is None else now) - step_unix
        self.freshness.observe(fresh)
        with self._lock:
            self._recent.append(fresh)
        return fresh

    def freshness_quantile(self, q: float) -> float:
        """The q-th percentile of recent freshness, NaN before the first."""
        with self._lock:
            recent = list(self._recent)
        return float(np.percentile(recent, q)) if recent else float("nan")

    @property
    def freshness_count(self) -> int:
        with self._lock:
            return len(self._recent)
