"""The `deltarec-serve` process: a follower thread feeding the served model, and the HTTP server.

The HTTP server listens first (health answers while the first checkpoint loads; readiness
says 503 until it is live), then the follower's thread starts: the newest COMMIT's cheapest
chain (from the newest compacted baseline), then every COMMIT as it lands. A round that
fails (the broker away, a damaged frame) is logged and counted, the version before stays
served, and the next round tries again. When the trainer rewinds (resumes from an older
checkpoint), the checkpoint served is withdrawn as soon as the follower reads the rewind's
ATTEMPT record, readiness says 503 with the reason while the live branch's newest checkpoint
is rebuilt, and the rewind's durations are in /metrics and the log (docs/serving.md, "Rewinds").
SIGINT/SIGTERM stop both; a summary closes the run.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from prometheus_client import Gauge

from ckpt.dense.store import DenseStore
from ckpt.events import MetricsSink
from ckpt.follow.follower import Follower
from ckpt.log.markers import Marker
from common.errors import DeltarecError
from trainer.config import JobConfig
from trainer.serve.app import PredictionApp, Predictor
from trainer.serve.freshness import ServeMetrics
from trainer.serve.setup import Serving
from trainer.serve.versions import ServedModel, Version

logger = logging.getLogger(__name__)


class Server:
    """One run's prediction server: `serving` says what it serves (a deltarec-train job's config
    serves its DLRM: `Serving.of_job`), `sink` is the server's metrics log."""

    def __init__(self, serving: Serving | JobConfig, sink: MetricsSink) -> None:
        serving = Serving.of_job(serving) if isinstance(serving, JobConfig) else serving
        self.serving, self.cfg = serving, serving.serve
        torch.set_num_threads(self.cfg.threads)
        self.metrics = ServeMetrics(self.staleness)
        self.model = ServedModel(serving.model, DenseStore(Path(serving.ckpt.sink.dense_dir)), on_live=self._on_live)
        c = serving.ckpt
        follow = replace(c.follow, poll_s=self.cfg.poll_s)
        self.follower = Follower(c.run_id, c.sink, follow, sink, target=self.model, on_rewind=self.model.withdraw)
        registry = self.metrics.registry
        Gauge(
            "deltarec_serve_rewinds", "Served checkpoints withdrawn because a rewind abandoned them", registry=registry
        ).set_function(lambda: len(self.model.rewinds))
        Gauge(
            "deltarec_serve_rewind_seconds",
            "The last rewind: from its ATTEMPT record to the first response after it (NaN: none yet)",
            registry=registry,
        ).set_function(self.rewind_seconds)
        predictor = Predictor(self.model, serving.model.layout(), self.cfg, self.metrics)
        self.app = PredictionApp(predictor, self.cfg, self.metrics, self.status)
        self.stop = threading.Event()
        self.last_error = ""
        self.applied = 0
        self.url = ""

    # -- what is served ---------------------------------------------------------------------
    def staleness(self) -> float:
        """Seconds since the served checkpoint's step (NaN before the first)."""
        live = self.model.live
        return time.time() - live.step_unix if live is not None else math.nan

    def rewind_seconds(self) -> float:
        """The last rewind: from its ATTEMPT record to the first response after it (NaN: none, or none answered yet)."""
        last = self.model.rewinds[-1] if self.model.rewinds else None
        return last.since_record(last.first_answer_unix) if last is not None and last.first_answer_unix else math.nan

    def status(self) -> dict[str, Any]:
        """Health and readiness: the checkpoint served, its staleness, the last follow error."""
        live = self.model.live
        staleness = self.staleness()
        if live is None:
            ready, reason = False, self.model.not_ready
        elif self.cfg.max_staleness_s and staleness > self.cfg.max_staleness_s:
            ready, reason = False, f"checkpoint {live.checkpoint_id} is {staleness:.0f} s old (serve.max_staleness_s)"
        else:
            ready, reason = True, ""
        return {
            "ready": ready,
            "reason": reason,
            "run_id": self.follower.run_id,
            "checkpoint_id": live.checkpoint_id if live else None,
            "step": live.step if live else None,
            "staleness_s": None if math.isnan(staleness) else round(staleness, 3),
            "last_error": self.last_error,
        }

    def _on_live(self, version: Version, marker: Marker, apply_s: float) -> None:
        self.applied += 1
        self.metrics.apply.observe(apply_s)
        self.metrics.checkpoint.set(version.checkpoint_id)
        self.metrics.step.set(version.step)
        self.metrics.model_bytes.set(self.model.nbytes)
        logger.debug(  # the follower's line says it was applied; the first response's line, its freshness
            "serving checkpoint %d (step %d): swapped in %.2f s after its step, applied in %.2f s",
            version.checkpoint_id,
            version.step,
            version.live_unix - version.step_unix,
            apply_s,
        )

    # -- the follower's thread -------------------------------------------------------------
    def _follow(self) -> None:
        while not self.stop.is_set():
            failed = self.follower.stats.failed
            try:
                self.follower.poll()  # a checkpoint that fails to apply is logged there, once
                self.last_error = self.follower.last_error
            except DeltarecError as exc:  # the markers log unreadable
                if str(exc) != self.last_error:
                    logger.warning("following run %s: %s; still serving what was applied before", self.follower.run_id, exc)
                self.last_error = str(exc)
                failed -= 1
            if self.follower.stats.failed != failed:
                self.metrics.follow_errors.inc(self.follower.stats.failed - failed)
            self.stop.wait(self.cfg.poll_s)

    # -- the process -----------------------------------------------------------------------
    def run(self, address_file: Path | None = None) -> None:
        """Serve until SIGINT/SIGTERM; `address_file` gets ``{"host", "port", "pid"}`` once listening."""
        follower = threading.Thread(target=self._follow, name="deltarec-serve-follow", daemon=True)
        try:
            asyncio.run(self._serve(address_file, follower))
        finally:
            self.stop.set()
            if follower.is_alive():
                follower.join(timeout=30)
            self.follower.close()
            self.app.pool.shutdown(wait=False, cancel_futures=True)
            n = self.metrics.freshness_count
            fresh = (
                f"freshness p50 {self.metrics.freshness_quantile(50):.2f} s, p99 {self.metrics.freshness_quantile(99):.2f} s "
                f"over {n}"
                if n
                else "none served after the start"
            )
            rewinds = self.model.rewinds
            if rewinds:
                fresh += f"; {len(rewinds)} rewind(s), the last answered again {self.rewind_seconds():.2f} s after its record"
            logger.info(
                "stopped: %d checkpoints swapped in, the newest of each pass the follower applied (%s); %s",
                self.applied,
                fresh,
                self._request_counts(),
            )

    def _request_counts(self) -> str:
        counts = {
            sample.labels["status"]: int(sample.value)
            for metric in self.metrics.requests.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        }
        return ", ".join(f"{n} answered {status}" for status, n in sorted(counts.items())) or "no requests"

    async def _serve(self, address_file: Path | None, follower: threading.Thread) -> None:
        runner = self.app.runner()
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.cfg.host, self.cfg.port)
            try:
                await site.start()
            except OSError as exc:
                raise DeltarecError(f"cannot listen on {self.cfg.host}:{self.cfg.port}: {exc.strerror or exc}") from None
            host, port = runner.addresses[0][:2]
            self.url = f"http://{host}:{port}"
            if address_file is not None:
                _write_atomically(address_file, {"host": host, "port": port, "pid": os.getpid(), "url": self.url})
            logger.info(
                "serving %s of run %s on %s (POST /predict, GET /readyz /healthz /metrics)",
                self.serving.model.name,
                self.follower.run_id,
                self.url,
            )
            stopped = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stopped.set)
            freeze_startup_objects()
            follower.start()
            await stopped.wait()
            logger.info("stopping")
        finally:
            await runner.cleanup()


def freeze_startup_objects() -> int:
    """Move every object alive into the collector's permanent generation; how many.

    A full collection walks every object the collector tracks, and importing torch, torchrec
    and aiohttp leaves hundreds of thousands of them, so each full collection paused every
    request for as long as the walk took (docs/design/serving.md, "Pauses"). Frozen after
    start-up, they are never walked again; garbage made later is collected as before.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _write_atomically(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
