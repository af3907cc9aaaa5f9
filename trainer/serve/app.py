"""The HTTP endpoints, on aiohttp (asyncio server with a request-body limit built in, and a
well-kept client for the tests and the benchmark).

- ``POST /predict``: a JSON request (trainer/serve/requests.py) -> ``{"scores": [...],
  "checkpoint_id": k, "step": s}``, every score computed on checkpoint k.
- ``GET /healthz``: 200 while the process runs, with what it follows.
- ``GET /readyz``: 200 once a checkpoint is served and its step is no older than
  `serve.max_staleness_s` (when set); 503 otherwise, and while the server rebuilds after a
  rewind (the checkpoint it served was abandoned). Both say the checkpoint and staleness.
- ``GET /metrics``: Prometheus text (trainer/serve/freshness.py).

Errors are ``{"error": "<one line>"}`` with a 4xx (the request) or 503 (busy, not ready).
A request's body must arrive whole within `serve.body_timeout_s` (else 408 and the connection
closes), before the request counts against the limits: at most `serve.max_concurrency`
requests compute at once, on a thread pool; up to `serve.max_queue` more wait; past that a
request gets 503 at once. So clients that stall mid-upload hold only their own connections.

Each answered prediction's time is split into its stages (trainer/serve/freshness.py
`RequestStages`): stamps on the event loop and on its thread, and the embedding collections'
forwards timed by hooks on both copies of the model (`LookupClock`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from torch import nn

from trainer.config import ServeConfig
from trainer.serve.freshness import RequestStages, ServeMetrics
from trainer.serve.requests import Batch, FeatureLayout, RequestError, parse_request
from trainer.serve.servable import EMBEDDING_MODULES
from trainer.serve.versions import NotReady, ServedModel, Version

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Computed:
    """Where a prediction's time went on its thread: `time.perf_counter()` when the thread took
    it, had parsed it, had the live copy and was done; the embedding lookups' seconds between."""

    start: float
    parsed: float
    locked: float
    lookup_s: float
    done: float


@dataclass(frozen=True)
class Answer:
    """One prediction: its scores and the checkpoint that computed all of them."""

    scores: list[float]
    checkpoint_id: int
    step: int
    samples: int
    computed: Computed | None = None  # None: a predictor that does not say


class LookupClock:
    """Seconds the embedding collections' forwards take on the calling thread: hooks on each
    module `watch` is given (once per module; nested collections count once)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._lock = threading.Lock()

    def watch(self, module: nn.Module) -> None:
        if module in self._watched:
            return
        with self._lock:
            if module in self._watched:
                return
            for sub in module.modules():
                if isinstance(sub, EMBEDDING_MODULES):
                    sub.register_forward_pre_hook(self._enter)
                    sub.register_forward_hook(self._leave)
            self._watched.add(module)

    def _enter(self, module: nn.Module, args: Any) -> None:
        local = self._local
        depth = getattr(local, "depth", 0)
        if not depth:
            local.since = time.perf_counter()
        local.depth = depth + 1

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        local = self._local
        local.depth -= 1
        if not local.depth:
            local.total = getattr(local, "total", 0.0) + time.perf_counter() - local.since

    def take(self) -> float:
        """The seconds counted on this thread since the last `take`."""
        local = self._local
        total, local.total, local.depth = getattr(local, "total", 0.0), 0.0, 0
        return total


class Predictor:
    """Parses a body and scores it on the live copy (runs on the pool's threads)."""

    def __init__(self, model: ServedModel, layout: FeatureLayout, cfg: ServeConfig, metrics: ServeMetrics) -> None:
        self.model, self.layout, self.cfg, self.metrics = model, layout, cfg, metrics
        self.lookups = LookupClock()

    def __call__(self, body: bytes) -> Answer:
        start = time.perf_counter()
        batch = parse_request(body, self.layout, self.cfg.max_samples)
        parsed = time.perf_counter()
        with self.model.acquire() as version:
            locked = time.perf_counter()
            self.lookups.watch(version.module)
            self.lookups.take()  # a forward that raised leaves nothing behind
            answer = self._score(version, batch)
        lookup_s = self.lookups.take()
        return replace(answer, computed=Computed(start, parsed, locked, lookup_s, time.perf_counter()))

    def _score(self, version: Version, batch: Batch) -> Answer:
        """The scores of `batch` on `version` (held), and its first response recorded."""
        out = self.model.servable.predict(version.module, batch)
        bad = (~torch.isfinite(out)).nonzero().flatten().tolist()
        if bad:  # JSON has no NaN: the inputs drove this checkpoint's forward out of float32's range
            raise RequestError(
                f"samples{bad[:5]}: checkpoint {version.checkpoint_id} scores them as NaN (dense values too large?)"
            )
        if not version.first_served_unix:  # racing requests may both see 0: the first to set it wins
            with self.model.first_lock:
                first = not version.first_served_unix
                if first:
                    version.first_served_unix = time.time()
            if first and version.at_start:
                logger.info(
                    "first response from checkpoint %d (step %d), the one this server started from "
                    "(%.1f s old; not counted as freshness)",
                    version.checkpoint_id,
                    version.step,
                    version.first_served_unix - version.step_unix,
                )
            elif first and version.rewind is not None and version.rewind.resumed(version.checkpoint_id):
                self._after_rewind(version)
            elif first:
                fresh = self.metrics.served_first(version.step_unix, version.first_served_unix)
                logger.info(
                    "checkpoint %d (step %d) first served %.2f s after its step (freshness p50 %.2f s, p99 %.2f s of %d)",
                    version.checkpoint_id,
                    version.step,
                    fresh,
                    self.metrics.freshness_quantile(50),
                    self.metrics.freshness_quantile(99),
                    self.metrics.freshness_count,
                )
                if version.rewind is not None:
                    self._after_rewind(version)
        return Answer(out.tolist(), version.checkpoint_id, version.step, batch.size)

    @staticmethod
    def _after_rewind(version: Version) -> None:
        """The first response of a version swapped in after a rewind: the rewind's times, and one
        line (a checkpoint from before the rewind is not counted as freshness: its age is the
        rewind's, not the stream's lag)."""
        rewind, now = version.rewind, version.first_served_unix
        assert rewind is not None
        if not rewind.first_answer_unix:
            rewind.first_answer_unix = now
        if rewind.resumed(version.checkpoint_id):
            logger.info(
                "first response after the rewind, from checkpoint %d (step %d, the live branch's newest): %.2f s after "
                "the rewind's ATTEMPT record, %.2f s after checkpoint %d stopped being served (not counted as freshness)",
                version.checkpoint_id,
                version.step,
                rewind.since_record(now),
                now - rewind.withdrawn_unix,
                rewind.rewind.abandoned,
            )
        elif not rewind.new_branch_unix:
            rewind.new_branch_unix = now
            logger.info(
                "first response from the new branch, checkpoint %d (step %d): %.2f s after the rewind's ATTEMPT record",
                version.checkpoint_id,
                version.step,
                rewind.since_record(now),
            )


def _clip(text: str, most: int = 80) -> str:
    """A client's string (a path, a parser's complaint) for a one-line message."""
    text = " ".join(text.split())
    return text if len(text) <= most else f"{text[:most]}..."


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class PredictionApp:
    """The aiohttp application of one server. `status()` says what is served (health, readiness)."""

    def __init__(
        self, predictor: Predictor, cfg: ServeConfig, metrics: ServeMetrics, status: Callable[[], dict[str, Any]]
    ) -> None:
        self.predictor, self.cfg, self.metrics, self.status = predictor, cfg, metrics, status
        self.pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="deltarec-serve")
        self.waiting = 0  # requests admitted and not answered (the event loop's thread only)
        self.app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[self._errors])
        self.app.add_routes(
            [
                web.post("/predict", self.predict),
                web.get("/healthz", self.healthz),
                web.get("/readyz", self.readyz),
                web.get("/metrics", self.prometheus),
            ]
        )

    def runner(self) -> web.AppRunner:
        """The server around the application. `lingering_time=0`: a request refused before its
        body ended (408, 413) has its connection closed at once; aiohttp would otherwise keep
        reading the rest of the body for 10 s, and a stalled client would keep its connection."""
        return web.AppRunner(self.app, access_log=None, handle_signals=False, lingering_time=0)

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every answer counted by status; aiohttp's own errors (404, 405, 413) as one JSON line."""
        try:
            response = await handler(request)
        except web.HTTPRequestEntityTooLarge:
            response = _error(413, f"body over serve.max_body_bytes = {self.cfg.max_body_bytes}")
        except web.HTTPException as exc:
            response = _error(exc.status, f"{request.method} {_clip(request.path)}: {exc.reason}")
        except Exception as exc:  # a bug of the server's: counted, one JSON line, the traceback in its log
            logger.exception("%s %s: internal error", request.method, _clip(request.path))
            response = _error(500, f"internal error: {type(exc).__name__}")
        self.metrics.requests.labels(str(response.status)).inc()
        return response

    async def predict(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        try:  # before admission: a client that stalls mid-body holds its connection, never a place
            body = await asyncio.wait_for(request.read(), self.cfg.body_timeout_s)
        except TimeoutError:
            response = _error(408, f"body not received within serve.body_timeout_s = {self.cfg.body_timeout_s:g} s")
            response.force_close()
            return response
        except (RequestPayloadError, HttpProcessingError) as exc:  # a body its headers misdescribe (gzip that is not)
            cause = exc.__cause__ or exc
            response = _error(400, f"body cannot be read: {_clip(str(getattr(cause, 'message', cause)))}")
            response.force_close()
            return response
        if self.waiting >= self.cfg.max_concurrency + self.cfg.max_queue:
            return _error(503, f"busy: {self.waiting} requests in progress (serve.max_concurrency + serve.max_queue)")
        read = time.perf_counter()
        self.waiting += 1
        self.metrics.in_progress.set(self.waiting)
        try:
            answer = await asyncio.get_running_loop().run_in_executor(self.pool, self.predictor, body)
        except RequestError as exc:
            return _error(exc.status, str(exc))
        except NotReady as exc:
            return _error(503, f"not ready: {exc}")
        finally:
            self.waiting -= 1
            self.metrics.in_progress.set(self.waiting)
        resumed = time.perf_counter()
        response = web.json_response({"scores": answer.scores, "checkpoint_id": answer.checkpoint_id, "step": answer.step})
        end = time.perf_counter()
        c = answer.computed
        stages = (
            RequestStages(
                read=read - t0,
                queue=c.start - read,
                parse=c.parsed - c.start,
                lock=c.locked - c.parsed,
                lookup=c.lookup_s,
                forward=c.done - c.locked - c.lookup_s,
                resume=resumed - c.done,
                respond=end - resumed,
            )
            if c is not None
            else None
        )
        self.metrics.answered(answer.samples, end - t0, stages)
        return response

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"alive": True, **self.status()})

    async def readyz(self, request: web.Request) -> web.Response:
        status = self.status()
        return web.json_response(status, status=200 if status["ready"] else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
