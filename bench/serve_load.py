"""A request load on a `deltarec-serve`, from its own process (the `serve` suite's client).

    python -m bench.serve_load --url URL --samples-file F --out F [--rate 20] [--big-rate 2] [--big 512]
    python -m bench.serve_load --url URL --samples-file F --out F --sweep [--sizes 1,64,512] [--start-rps 8]
                               [--max-rps 2048] [--point-s 5] [--goal 1=20 --goal 512=50] ...

Bounded (the default): posts one-sample requests at `--rate` per second and `--big`-sample
requests at `--big-rate` per second (each class on a fixed schedule, so a slow answer delays,
never multiplies, the load) until SIGTERM, then writes every answer it got: the class, when it
was sent and answered (wall clock), its status and the checkpoint that computed it. Latency is
measured here, as a client sees it, over loopback.

`--sweep`: the load curve. Open loop: for each request size in turn, requests are sent on a
schedule at the offered rate whatever the answers (each on its own task, over as many
connections as it takes), and a request's latency runs from its scheduled send time, so
queueing anywhere (the server's, the connection's, this process's own lateness) is counted and
never hidden by a client that waits. Each load point lasts `--point-s` seconds; the offered rate
starts at `--start-rps` and doubles until the point overloads the server (errors over
`--stop-errors` of those sent, p99 over `--stop-p99-ms`, or answers coming back slower than
`--behind` times the offered rate; a point over the p99 alone is measured once more first) or
reaches `--max-rps`; then, for a size with a `--goal`, `--refine` points bisect between the
highest rate meeting it and the next one (or halve the lowest rate while none meets it). Each
size starts with `--warmup` requests one by one, not measured. Before and after each point the server's `/metrics`
are read (once it has nothing in progress): their difference is the server's own account of
the point, where each answered request's time went. Writes every point (`LoadPoint`) to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from trainer.serve.client import ServeClient
from trainer.serve.freshness import STAGES, size_class


class Answer(NamedTuple):
    samples: int
    sent_unix: float
    latency_s: float
    status: int
    checkpoint_id: int  # -1: not a 200


def client(server: ServeClient, body: bytes, samples: int, rate: float, stop: threading.Event, out: list[Answer]) -> None:
    """Requests of one class on a fixed schedule of `rate` per second."""
    period, due = 1.0 / rate, time.monotonic()
    while not stop.is_set():
        wait = due - time.monotonic()
        if wait > 0 and stop.wait(wait):
            break
        due = max(due + period, time.monotonic() - period)  # behind schedule: no burst to catch up
        sent, t0 = time.time(), time.perf_counter()
        try:
            status, doc = server.predict(body)
        except OSError:  # the server is gone: the suite is stopping it
            status, doc = 0, {}
        checkpoint_id = doc.get("checkpoint_id", -1) if status == 200 else -1
        out.append(Answer(samples, sent, time.perf_counter() - t0, status, int(checkpoint_id)))


# -- the load curve -----------------------------------------------------------------------------
#: Samples of a Prometheus page, by name and sorted labels.
Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass(frozen=True)
class SweepSettings:
    """What `--sweep` offers (see the module doc)."""

    sizes: tuple[int, ...] = (1, 64, 512)
    start_rps: float = 8.0
    max_rps: float = 2048.0
    point_s: float = 5.0
    timeout_s: float = 2.0  # from a request's scheduled send: later is an error ("timeout")
    stop_p99_ms: float = 500.0
    stop_errors: float = 0.01  # a fraction of the requests sent
    behind: float = 0.8  # answered / offered below this: the server cannot keep up
    goals_ms: tuple[tuple[int, float], ...] = ((1, 20.0), (512, 50.0))  # (samples, p99 goal)
    refine: int = 2
    warmup: int = 10  # requests of each size sent one by one before its first point, not measured

    def goal(self, samples: int) -> float | None:
        return dict(self.goals_ms).get(samples)


@dataclass(frozen=True)
class ServerTime:
    """The server's account of the requests it answered during one load point (differences of
    its `/metrics`): how many, their mean time, and each stage's mean (trainer/serve/freshness.py
    `RequestStages`: they add up to the mean time)."""

    requests: int
    request_ms: float
    stages_ms: dict[str, float]

    @property
    def stages_total_ms(self) -> float:
        return sum(self.stages_ms.values())

    @classmethod
    def between(cls, before: Metrics, after: Metrics, samples: int) -> ServerTime | None:
        """From two scrapes around a point of `samples`-sample requests; None when none was answered."""
        label = (("samples", size_class(samples)),)

        def delta(name: str, labels: tuple[tuple[str, str], ...] = label) -> float:
            return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

        count = delta("deltarec_serve_request_seconds_count")
        if count <= 0:
            return None
        stages = {
            stage: 1e3 * delta("deltarec_serve_request_stage_seconds_sum", (("samples", size_class(samples)), ("stage", stage)))
            for stage in STAGES
        }
        return cls(
            requests=int(count),
            request_ms=1e3 * delta("deltarec_serve_request_seconds_sum") / count,
            stages_ms={stage: total / count for stage, total in stages.items()},
        )


@dataclass(frozen=True)
class LoadPoint:
    """One load point: `offered_rps` requests of `samples` samples a second for `duration_s`.

    `sent`: requests scheduled; `ok`: answered 200 in time; `errors` the rest, by kind (an HTTP
    status, "timeout" past `SweepSettings.timeout_s`, "connection"); latency percentiles (ms) of
    the 200s, from their scheduled send time; `achieved_rps`: 200s a second, over the point's
    span or until its last answer if later; `send_lag_p99_ms`: how late this process started its
    requests (its own share of the latency); `server`: the server's account; `overload`: why the
    sweep stopped doubling here ("" when it did not; "p99" only when measured twice)."""

    samples: int
    offered_rps: float
    duration_s: float
    sent: int
    ok: int
    errors: int
    error_kinds: dict[str, int]
    achieved_rps: float
    p50_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    send_lag_p99_ms: float | None
    server: ServerTime | None
    overload: str = ""
    # a first measure overloaded by its p99 alone is taken again once (one stall of a shared
    # machine is not an overload): that first p99, which this point replaces; None when not
    remeasured_p99_ms: float | None = None

    def meets(self, p99_ms: float) -> bool:
        """Every request answered 200 in time, and their p99 within `p99_ms`."""
        return self.ok > 0 and self.errors == 0 and self.p99_ms is not None and self.p99_ms <= p99_ms

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> LoadPoint:
        server = doc.get("server")
        return cls(**{**doc, "server": ServerTime(**server) if server is not None else None})


class Outcome(NamedTuple):
    """One request of a load point: its scheduled send, when it was started and done (the event
    loop's clock), and what went wrong ("" for a 200)."""

    due: float
    started: float
    done: float
    error: str


@dataclass
class SweepResult:
    """What `--sweep` writes: its settings and every point, by size then offered rate."""

    settings: SweepSettings
    points: list[LoadPoint] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SweepResult:
        s = doc["settings"]
        settings = SweepSettings(
            **{**s, "sizes": tuple(s["sizes"]), "goals_ms": tuple((int(n), float(ms)) for n, ms in s["goals_ms"])}
        )
        return cls(settings, [LoadPoint.from_json(p) for p in doc["points"]])


def parse_metrics(text: str) -> Metrics:
    """Every sample of a Prometheus text page, by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _pct(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def point_of(
    samples: int, rate: float, outcomes: Sequence[Outcome], server: ServerTime | None, settings: SweepSettings
) -> LoadPoint:
    """A load point's figures from its requests' outcomes, and why it overloads ("" if not)."""
    t0 = min(o.due for o in outcomes)
    span = max(len(outcomes) / rate, max(o.done for o in outcomes) - t0)
    ok = [(o.done - o.due) * 1e3 for o in outcomes if not o.error]
    kinds: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            kinds[o.error] = kinds.get(o.error, 0) + 1
    errors = len(outcomes) - len(ok)
    achieved = len(ok) / span
    p99 = _pct(ok, 99)
    if errors > settings.stop_errors * len(outcomes):
        overload = "errors"
    elif p99 is None or p99 > settings.stop_p99_ms:
        overload = "p99"
    elif achieved < settings.behind * rate:
        overload = "behind"
    else:
        overload = ""
    return LoadPoint(
        samples=samples,
        offered_rps=rate,
        duration_s=span,
        sent=len(outcomes),
        ok=len(ok),
        errors=errors,
        error_kinds=kinds,
        achieved_rps=achieved,
        p50_ms=_pct(ok, 50),
        p99_ms=p99,
        mean_ms=float(np.mean(ok)) if ok else None,
        send_lag_p99_ms=_pct([(o.started - o.due) * 1e3 for o in outcomes], 99),
        server=server,
        overload=overload,
    )


def highest_meeting(points: Iterable[LoadPoint], samples: int, p99_ms: float) -> float | None:
    """The highest offered rate of `samples`-sample points that meets the goal; None if none does."""
    return max((p.offered_rps for p in points if p.samples == samples and p.meets(p99_ms)), default=None)


def refine_rate(points: Sequence[LoadPoint], samples: int, p99_ms: float) -> float | None:
    """The next rate to try for the goal: halfway between the highest rate meeting it and the
    lowest higher one that does not (rounded to a whole rate), or half the lowest rate swept
    when none meets it (not under 1/s); None when there is no such pair or nothing is left
    between them."""
    lo = highest_meeting(points, samples, p99_ms)
    if lo is None:
        lowest = min((p.offered_rps for p in points if p.samples == samples), default=None)
        return lowest / 2 if lowest is not None and lowest >= 2 else None
    hi = min((p.offered_rps for p in points if p.samples == samples and p.offered_rps > lo), default=None)
    if hi is None:
        return None
    mid = float(round((lo + hi) / 2))
    return mid if lo < mid < hi else None


class Sweep:
    """The open-loop sweep against one server (see the module doc)."""

    def __init__(self, url: str, bodies: dict[int, bytes], settings: SweepSettings) -> None:
        self.url, self.bodies, self.settings = url.rstrip("/"), bodies, settings
        self.session: aiohttp.ClientSession | None = None

    async def run(self, ready_timeout_s: float) -> list[LoadPoint]:
        connector = aiohttp.TCPConnector(limit=512)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            self.session = session
            await self._ready(ready_timeout_s)
            points: list[LoadPoint] = []
            for size in self.settings.sizes:
                points += await self._size(size)
            return points

    async def _size(self, size: int) -> list[LoadPoint]:
        s = self.settings
        points: list[LoadPoint] = []
        for _ in range(s.warmup):  # the first answers of a size (allocations, caches) are no load's
            await self._one(self.bodies[size], asyncio.get_running_loop().time())
        rate = s.start_rps
        while True:
            point = await self._point(size, rate)
            if point.overload == "p99":
                point = replace(await self._point(size, rate), remeasured_p99_ms=point.p99_ms)
            points.append(point)
            if point.overload or rate * 2 > s.max_rps:
                break
            rate *= 2
        goal = s.goal(size)
        for _ in range(s.refine if goal is not None else 0):
            assert goal is not None
            mid = refine_rate(points, size, goal)
            if mid is None:
                break
            points.append(await self._point(size, mid))
        return sorted(points, key=lambda p: p.offered_rps)

    async def _point(self, size: int, rate: float) -> LoadPoint:
        await self._idle()
        before = await self._metrics()
        loop = asyncio.get_running_loop()
        body = self.bodies[size]
        n = max(1, round(rate * self.settings.point_s))
        t0 = loop.time() + 0.01
        tasks = []
        for k in range(n):
            due = t0 + k / rate
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self._one(body, due)))
        outcomes = await asyncio.gather(*tasks)
        await self._idle()  # the server's account complete: requests given up on here may still compute
        server = ServerTime.between(before, await self._metrics(), size)
        point = point_of(size, rate, outcomes, server, self.settings)
        print(
            f"bench: load curve, {size} sample(s) at {rate:g}/s: p50 {_ms(point.p50_ms)} p99 {_ms(point.p99_ms)}, "
            f"{point.errors} errors of {point.sent}, {point.achieved_rps:.1f}/s answered"
            + (f" (overloaded: {point.overload})" if point.overload else ""),
            file=sys.stderr,
            flush=True,
        )
        return point

    async def _one(self, body: bytes, due: float) -> Outcome:
        assert self.session is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        error = ""
        try:
            async with asyncio.timeout_at(due + self.settings.timeout_s):
                async with self.session.post(
                    self.url + "/predict", data=body, headers={"Content-Type": "application/json"}
                ) as response:
                    await response.read()
                    if response.status != 200:
                        error = str(response.status)
        except TimeoutError:
            error = "timeout"
        except (aiohttp.ClientError, OSError):
            error = "connection"
        return Outcome(due, started, loop.time(), error)

    async def _get(self, path: str) -> tuple[int, str]:
        assert self.session is not None
        async with self.session.get(self.url + path, timeout=aiohttp.ClientTimeout(total=30)) as response:
            return response.status, await response.text()

    async def _metrics(self) -> Metrics:
        return parse_metrics((await self._get("/metrics"))[1])

    async def _idle(self, timeout_s: float = 60.0) -> None:
        """Until the server has no prediction in progress (or `timeout_s` passed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (await self._metrics()).get(("deltarec_serve_requests_in_progress", ()), 0.0) == 0:
                return
            await asyncio.sleep(0.1)  # polling the server's gauge

    async def _ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if (await self._get("/readyz"))[0] == 200:
                    return
            except (aiohttp.ClientError, OSError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"bench.serve_load: the server at {self.url} not ready after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)  # polling readiness


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def _goal(text: str) -> tuple[int, float]:
    samples, ms = text.split("=")
    return int(samples), float(ms)


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def add_sweep_options(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The sweep's options (`prefix` "sweep-" in the suite's parser, "" here)."""
    d = SweepSettings()
    p.add_argument(f"--{prefix}sizes", type=_sizes, default=d.sizes, help="samples per request, one size after another")
    p.add_argument(f"--{prefix}start-rps", type=float, default=d.start_rps, help="the first offered rate (requests/s)")
    p.add_argument(f"--{prefix}max-rps", type=float, default=d.max_rps, help="no offered rate above this")
    p.add_argument(f"--{prefix}point-s", type=float, default=d.point_s, help="seconds of each load point")
    p.add_argument(f"--{prefix}timeout-s", type=float, default=d.timeout_s, help="a request later than this is an error")
    p.add_argument(f"--{prefix}stop-p99-ms", type=float, default=d.stop_p99_ms, help="overloaded: p99 over this")
    p.add_argument(f"--{prefix}stop-errors", type=float, default=d.stop_errors, help="overloaded: errors over this fraction")
    p.add_argument(f"--{prefix}behind", type=float, default=d.behind, help="overloaded: answered/offered under this")
    p.add_argument(
        f"--{prefix}goal", type=_goal, action="append", help="SAMPLES=MS: a p99 goal (repeatable; default 1=20, 512=50)"
    )
    p.add_argument(f"--{prefix}refine", type=int, default=d.refine, help="more points toward each goal's highest rate")
    p.add_argument(f"--{prefix}warmup", type=int, default=d.warmup, help="unmeasured requests of each size first")


def sweep_settings(args: argparse.Namespace, prefix: str = "") -> SweepSettings:
    """The settings from `add_sweep_options`' options."""
    dest = prefix.replace("-", "_")

    def a(name: str) -> Any:
        return getattr(args, dest + name)

    return SweepSettings(
        sizes=a("sizes"),
        start_rps=a("start_rps"),
        max_rps=a("max_rps"),
        point_s=a("point_s"),
        timeout_s=a("timeout_s"),
        stop_p99_ms=a("stop_p99_ms"),
        stop_errors=a("stop_errors"),
        behind=a("behind"),
        goals_ms=tuple(a("goal")) if a("goal") else SweepSettings().goals_ms,
        refine=a("refine"),
        warmup=a("warmup"),
    )


def sweep_argv(settings: SweepSettings) -> list[str]:
    """`settings` as this module's command-line options."""
    return [
        "--sizes", ",".join(map(str, settings.sizes)), "--start-rps", str(settings.start_rps),
        "--max-rps", str(settings.max_rps), "--point-s", str(settings.point_s), "--timeout-s", str(settings.timeout_s),
        "--stop-p99-ms", str(settings.stop_p99_ms), "--stop-errors", str(settings.stop_errors),
        "--behind", str(settings.behind), "--refine", str(settings.refine), "--warmup", str(settings.warmup),
        *[a for n, ms in settings.goals_ms for a in ("--goal", f"{n}={ms:g}")],
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server's base URL")
    p.add_argument(
        "--samples-file", type=Path, required=True, help='JSON {"samples": [...]}: a request of n samples uses the first n'
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rate", type=float, default=20.0, help="one-sample requests per second")
    p.add_argument("--big", type=int, default=512, help="samples in a big request")
    p.add_argument("--big-rate", type=float, default=2.0, help="big requests per second")
    p.add_argument("--sweep", action="store_true", help="the open-loop load curve instead (options below)")
    p.add_argument("--ready-timeout-s", type=float, default=300.0, help="--sweep: how long to wait for readiness")
    add_sweep_options(p)
    args = p.parse_args(argv)
    samples = json.loads(args.samples_file.read_text())["samples"]
    if args.sweep:
        settings = sweep_settings(args)
        if max(settings.sizes) > len(samples):
            raise SystemExit(
                f"bench.serve_load: {args.samples_file} holds {len(samples)} samples, fewer than {max(settings.sizes)}"
            )
        bodies = {n: json.dumps({"samples": samples[:n]}).encode() for n in settings.sizes}
        points = asyncio.run(Sweep(args.url, bodies, settings).run(args.ready_timeout_s))
        args.out.write_text(json.dumps(SweepResult(settings, points).to_json()))
        return 0
    one = json.dumps({"samples": samples[:1]}).encode()
    big = json.dumps({"samples": samples[: args.big]}).encode()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    answers: list[Answer] = []
    server = ServeClient(args.url)
    threads = [
        threading.Thread(target=client, args=(server, one, 1, args.rate, stop, answers)),
        threading.Thread(target=client, args=(server, big, args.big, args.big_rate, stop, answers)),
    ]
    for t in threads:
        t.start()
    while not stop.wait(0.5):
        pass
    for t in threads:
        t.join(timeout=60)
    args.out.write_text(json.dumps([a._asdict() for a in answers]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
