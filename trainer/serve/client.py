"""A small client of `deltarec-serve` (urllib, the standard library's HTTP client): what the
quickstart, the benchmark's load and the tests ask a server."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any


class ServeClient:
    """Requests to one server at `url` (``http://host:port``)."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def call(self, path: str, body: bytes | None = None, method: str | None = None) -> tuple[int, bytes]:
        """(HTTP status, body) of one request; a POST when there is a body. An HTTP error
        status is returned, not raised; a connection that fails raises OSError."""
        request = urllib.request.Request(
            self.url + path,
            data=body,
            method=method or ("POST" if body is not None else "GET"),
            headers={"Content-Type": "application/json"} if body is not None else {},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def json(self, path: str, body: bytes | None = None, method: str | None = None) -> tuple[int, Any]:
        """(status, decoded JSON) of one request; the text when the answer is not JSON."""
        status, raw = self.call(path, body, method)
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def predict(self, body: bytes) -> tuple[int, Any]:
        """``POST /predict``: (status, the answer or the error)."""
        return self.json("/predict", body)

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """``GET /readyz``: (ready, what it says)."""
        status, doc = self.json("/readyz")
        return status == 200, doc if isinstance(doc, dict) else {}

    def metric(self, name: str) -> float:
        """One sample of ``GET /metrics`` (``name`` with its labels, as the text shows them:
        ``deltarec_serve_requests_total{status="400"}``); NaN when absent."""
        for line in self.call("/metrics")[1].decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return math.nan
