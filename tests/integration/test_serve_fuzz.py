"""`deltarec-serve` under what the internet sends: a real server process over raw sockets, fed
random and structure-aware request bodies, methods, paths, headers and encodings.

After every case: no 5xx; a JSON answer is strict JSON (no NaN or Infinity); and a good
request still gets the same scores from the same checkpoint. Every answer the application
gives is counted in `deltarec_serve_requests_total`. The cases come from the test's seed
(printed; `DELTAREC_TEST_SEED` replays them), each named in a failure.
"""

from __future__ import annotations

import copy
import json
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from launch.ranks import spawn_ranks
from tests.conftest import DebugConfig, ReplaySeed
from tests.integration.test_serve import ServerProc, _job, _samples, _serving, _wait_for

pytestmark = pytest.mark.integration

CASES = 400
BODY_TIMEOUT_S = 1
HOSTILE: list[Any] = [
    10**400,
    -(10**40),
    1e39,
    -3.5e38,
    1e-320,
    float("nan"),
    float("inf"),
    float("-inf"),
    "7",
    "",
    "\u0000\ud800x",
    None,
    True,
    False,
    [],
    {},
    [[[[1]]]],
    {"dense": [1]},
    -1,
    2**63,
    0.5,
    "x" * 5000,
]


@dataclass(frozen=True)
class Case:
    name: str
    request: bytes


def _request(method: str, path: str, body: bytes, headers: dict[str, str] | None = None, length: int | None = None) -> bytes:
    head = {"Host": "127.0.0.1", "Content-Type": "application/json", "Connection": "close"}
    head |= headers or {}
    if "Transfer-Encoding" not in head:
        head["Content-Length"] = str(len(body) if length is None else length)
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    return f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode("latin-1") + body


def _mutate(doc: Any, rng: random.Random) -> Any:
    """`doc` with one value somewhere in it replaced by a hostile one (or a key added)."""
    doc = copy.deepcopy(doc)
    containers: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict | list):
            containers.append(node)
            for child in node.values() if isinstance(node, dict) else node:
                walk(child)

    walk(doc)
    node = rng.choice(containers)
    value = rng.choice(HOSTILE)
    if isinstance(node, dict):
        key = rng.choice([*node, "extra", "sparse", "dense", "\u00e9", "x" * 300]) if node else "samples"
        node[key] = value
    elif node:
        node[rng.randrange(len(node))] = value
    else:
        node.append(value)
    return doc


def _cases(good: dict, rng: random.Random) -> Iterator[Case]:
    good_text = json.dumps(good)
    for i in range(CASES):
        kind = rng.choice(["structure", "structure", "structure", "bytes", "nesting", "encoding", "method", "headers", "json"])
        if kind == "structure":
            body = json.dumps(_mutate(good, rng)).encode()  # NaN/Infinity literals included
            yield Case(f"{i} structure {body[:120]!r}", _request("POST", "/predict", body))
        elif kind == "bytes":
            body = rng.randbytes(rng.randrange(0, 3000))
            yield Case(f"{i} random bytes", _request("POST", "/predict", body))
        elif kind == "nesting":
            depth = rng.choice([100, 10_000, 100_000])
            opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}"), (b'{"samples":[', b"]}")])
            body = opener * depth + b"1" + closer * depth
            yield Case(f"{i} nesting {depth} {opener!r}", _request("POST", "/predict", body))
        elif kind == "encoding":
            encoding = rng.choice(["utf-16", "utf-32", "utf-8-sig", "latin-1", "utf-16-be"])
            text = good_text.replace("dense", "d\u00e9nse") if rng.random() < 0.5 else good_text
            body = text.encode(encoding, errors="replace")
            yield Case(f"{i} encoding {encoding}", _request("POST", "/predict", body))
        elif kind == "method":
            method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "FOO", "POST"])
            path = rng.choice(
                ["/predict", "/readyz", "/healthz", "/metrics", "/", "/x", "/predict/../metrics", "/%00", "/" + "a" * 5000]
            )
            yield Case(f"{i} {method} {path[:40]}", _request(method, path, good_text.encode()))
        elif kind == "headers":
            body = good_text.encode()
            choice = rng.randrange(7)
            if choice == 0:
                headers = {"Content-Encoding": rng.choice(["gzip", "deflate", "br", "zstd"])}
                yield Case(f"{i} content-encoding {headers}", _request("POST", "/predict", body, headers))
            elif choice == 1:
                chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
                if rng.random() < 0.5:
                    chunked = b"zz\r\n" + body  # a malformed chunk size
                yield Case(f"{i} chunked", _request("POST", "/predict", chunked, {"Transfer-Encoding": "chunked"}))
            elif choice == 2:
                yield Case(f"{i} short content-length", _request("POST", "/predict", body, length=len(body) // 2))
            elif choice == 3:
                yield Case(
                    f"{i} bad content-length",
                    _request("POST", "/predict", body, {"Content-Length": rng.choice(["-5", "x", "1e3"])}),
                )
            elif choice == 4:
                yield Case(
                    f"{i} huge header", _request("POST", "/predict", body, {"X-Big": "v" * rng.choice([100, 9000, 70000])})
                )
            elif choice == 5:
                many = {f"X-H{n}": "1" for n in range(rng.choice([10, 200]))}
                yield Case(f"{i} many headers", _request("POST", "/predict", body, many))
            else:
                content_type = rng.choice(["text/plain", "application/json; charset=utf-16", "multipart/form-data", ""])
                yield Case(
                    f"{i} content-type {content_type!r}", _request("POST", "/predict", body, {"Content-Type": content_type})
                )
        else:  # random JSON values of every type
            doc = (
                {"samples": [rng.choice(HOSTILE) for _ in range(rng.randrange(1, 4))]}
                if rng.random() < 0.5
                else rng.choice(HOSTILE)
            )
            yield Case(f"{i} json {str(doc)[:80]}", _request("POST", "/predict", json.dumps(doc).encode()))
    # a body that never arrives whole: 408 once serve.body_timeout_s passes
    yield Case("stalled body", _request("POST", "/predict", good_text.encode(), length=len(good_text) + 10))


def _send(where: dict, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of the answer to `request` on a new connection; status 0 when
    the server closed it without answering."""
    with socket.create_connection((where["host"], where["port"]), timeout=30) as conn:
        try:
            conn.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading (a head it refused): its answer may still be there
        data = b""
        try:
            while chunk := conn.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    if not data:
        return 0, {}, b""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split(" ", 2)[1]), {k.lower(): v for k, v in headers.items()}, body


def _counted(server: ServerProc) -> float:
    """Every answer `deltarec_serve_requests_total` counts, all statuses together."""
    lines = server.client.call("/metrics")[1].decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("deltarec_serve_requests_total{"))


def _strict_json(raw: bytes) -> Any:
    def refuse(literal: str) -> Any:
        raise ValueError(f"{literal} in a response")

    return json.loads(raw, parse_constant=refuse)


def test_no_input_gets_a_5xx_or_invalid_json(tmp_path: Path, debug_config: DebugConfig, replay_seed: ReplaySeed) -> None:
    job = [*_job("fuzz"), "serve.max_body_bytes=65536", f"serve.body_timeout_s={BODY_TIMEOUT_S}"]
    cfg = debug_config.load([*job, f"run.dir={tmp_path / 'run'}"], check_data=False)
    spawn_ranks(debug_config.path, [*job, "train.steps=10"], tmp_path, timeout_s=180)
    server = ServerProc(debug_config.path, job, tmp_path)
    try:
        _wait_for(_serving(server, 2), 60, "checkpoint 2 served", server)
        good_body = _samples(cfg, 2, replay_seed.value)
        status, want = server.predict(good_body)
        assert status == 200 and want["checkpoint_id"] == 2, want
        counted_before = _counted(server)
        statuses: dict[int, int] = {}
        app_answers = 0
        for case in _cases(json.loads(good_body), replay_seed.rng()):
            status, headers, body = _send(server.where, case.request)
            statuses[status] = statuses.get(status, 0) + 1
            assert status < 500, f"case {case.name}: {status} {body[:300]!r} ({replay_seed})"
            content_type = headers.get("content-type", "")
            if "version=" in content_type:  # /metrics (Prometheus' text format): the application's, counted
                app_answers += 1
            if content_type.startswith("application/json"):
                app_answers += 1  # the application's answer (aiohttp's own refusals of bad HTTP are plain text)
                if body:
                    doc = _strict_json(body)
                    if status != 200:
                        assert "\n" not in doc["error"] and len(doc["error"]) < 400, f"case {case.name}: {doc}"
            assert server.predict(good_body) == (200, want), f"after case {case.name} ({replay_seed})"
            assert server.alive(), server.tail()
        print(f"answers by status over {CASES + 1} cases: {dict(sorted(statuses.items()))}")
        assert statuses.get(408, 0) >= 1, statuses  # the stalled body
        # every answer of the application is counted: the cases', the good requests' after each
        # (CASES + 1 of them) and the /metrics read that took `counted_before`
        assert _counted(server) - counted_before == app_answers + CASES + 1 + 1, statuses
        assert server.stop() == 0, server.tail()
    finally:
        server.kill()
