"""Who gets a place in the prediction server (trainer/serve/app.py), over real sockets on
loopback against the real aiohttp application, with a predictor the test holds or releases:

- only a request whose whole body arrived takes a place: 200 uploads stalled mid-body leave a
  good request its answer and readiness true, and each stalled one gets 408 and its connection
  closed once `serve.body_timeout_s` passes (not held while the server reads on);
- places really run out: with `max_concurrency + max_queue` requests computing, one more gets
  503 at once, and the held ones are answered once released;
- a bug of the server's is a counted 500 with one JSON line, never a bare traceback page.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from trainer.config import ServeConfig
from trainer.serve.app import Answer, PredictionApp
from trainer.serve.freshness import ServeMetrics

BODY = b'{"samples": [{"dense": [1]}]}'


class HeldPredictor:
    """Answers every body with one score once `release` is set (or at once when it is)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.release.set()
        self.computing = 0
        self.fail = False

    def __call__(self, body: bytes) -> Answer:
        if self.fail:
            raise KeyError("a bug")
        self.computing += 1
        try:
            assert self.release.wait(30)
            return Answer([0.5], 7, 70, 1)
        finally:
            self.computing -= 1


class Served:
    """The app on 127.0.0.1 (a free port), its event loop on a thread of its own; its predictor
    a `HeldPredictor` unless one is given (a context manager: closed on exit)."""

    def __init__(self, cfg: ServeConfig, predictor: Any = None, metrics: ServeMetrics | None = None) -> None:
        self.predictor = HeldPredictor() if predictor is None else predictor
        self.metrics = metrics or ServeMetrics(staleness=lambda: 0.0)
        self.app = PredictionApp(self.predictor, cfg, self.metrics, lambda: {"ready": True, "checkpoint_id": 7})
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = self.app.runner()
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.runner = runner
        self.started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.app.pool.shutdown(wait=False, cancel_futures=True)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, dict]:
        """One whole request on its own connection: (status, its JSON)."""
        with self.connect() as conn:
            conn.sendall(_head(method, path, len(body)) + body)
            status, payload = _read_response(conn)
        return status, json.loads(payload) if payload else {}

    def counted(self, status: int) -> float:
        return self.metrics.registry.get_sample_value("deltarec_serve_requests_total", {"status": str(status)}) or 0.0


def _head(method: str, path: str, length: int) -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode()


def _read_response(conn: socket.socket) -> tuple[int, bytes]:
    """(status, body) of the response on `conn`, read to its close; (0, b"") when the server
    closed without answering."""
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    if not data:
        return 0, b""
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    cfg = ServeConfig(max_concurrency=1, max_queue=1, body_timeout_s=getattr(request, "param", 1.0))
    server = Served(cfg)
    try:
        yield server
    finally:
        server.predictor.release.set()
        server.close()


def test_stalled_uploads_take_no_place_and_get_408(served: Served) -> None:
    stalled = [served.connect() for _ in range(200)]
    try:
        for conn in stalled:
            conn.sendall(_head("POST", "/predict", len(BODY)) + BODY[: len(BODY) // 2])
        time.sleep(0.2)  # the server has read every head and waits for the bodies
        status, doc = served.request("POST", "/predict", BODY)
        assert (status, doc["scores"]) == (200, [0.5]), doc
        assert served.request("GET", "/readyz")[0] == 200
        assert served.metrics.in_progress._value.get() == 0  # noqa: SLF001 - the gauge /metrics shows
        answers = []
        for conn in stalled:
            # closed with its 408, not kept open while aiohttp lingers 10 s for the rest of the body
            conn.settimeout(6.0)
            status, payload = _read_response(conn)
            answers.append(status)
            if status:
                assert "serve.body_timeout_s = 1 s" in json.loads(payload)["error"]
        assert set(answers) <= {408, 0} and answers.count(408) >= 190, answers
    finally:
        for conn in stalled:
            conn.close()
    assert served.counted(408) == answers.count(408)
    assert served.request("POST", "/predict", BODY)[0] == 200


def test_places_run_out_at_max_concurrency_plus_max_queue(served: Served) -> None:
    served.predictor.release.clear()
    held = [served.connect() for _ in range(2)]
    try:
        for conn in held:
            conn.sendall(_head("POST", "/predict", len(BODY)) + BODY)
        deadline = time.monotonic() + 30
        while served.metrics.in_progress._value.get() < 2:  # noqa: SLF001
            assert time.monotonic() < deadline, "two requests never took their places"
            time.sleep(0.01)  # polling the server's thread
        status, doc = served.request("POST", "/predict", BODY)
        assert status == 503 and "busy: 2 requests in progress" in doc["error"], doc
        served.predictor.release.set()
        assert [_read_response(conn)[0] for conn in held] == [200, 200]
    finally:
        for conn in held:
            conn.close()
    assert served.counted(503) == 1 and served.counted(200) == 2


def test_a_server_bug_is_a_counted_500_with_one_json_line(served: Served) -> None:
    served.predictor.fail = True
    status, doc = served.request("POST", "/predict", BODY)
    assert status == 500 and doc == {"error": "internal error: KeyError"}
    assert served.counted(500) == 1
    served.predictor.fail = False
    assert served.request("POST", "/predict", BODY)[0] == 200
