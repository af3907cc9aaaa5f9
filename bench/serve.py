"""Serving while training: freshness, request latency and memory of `deltarec-serve` on this machine.

    python -m bench.run --suite serve [--steps 3000] [--interval-s 10] [--rate 20] [--big 512]
                                      [--big-rate 2] [--set key=value ...] [--out serve.json]
                                      [--sweep | --sweep-only] [--sweep-sizes 1,64,512] [--sweep-point-s 5] ...

The quickstart model trains on 2 gloo ranks with checkpoints every ``--interval-s`` seconds
(incremental deltas at 4 bits by default: the setup the README recommends) to a fresh
embedded broker, with a server beside it (no follower) and, from a second process over
loopback, a bounded load (bench/serve_load.py): one-sample requests at ``--rate`` per second
and ``--big``-sample ones at ``--big-rate``. All on the same cores as training.

Reported:

* time to COMMIT of each checkpoint: its COMMIT's time minus its step's (rank 0's clock);
* freshness: from a checkpoint's step to the first response computed with it, as the server
  records it (`/metrics`, p50/p99) and as the client sees it (the first answer naming it);
  goal: p99 <= time to COMMIT + 1 s (per checkpoint: freshness minus its own time to COMMIT);
* request latency p50/p99 per class as the client measures it; goals: one sample <= 20 ms,
  512 samples <= 50 ms (p99);
* slow clients: from ``--stall-after-s`` after the server is first ready, for ``--stall-s`` seconds, ``--stalled``
  connections each send a request's head and half its body and stall (opened again as the
  server answers 408 after `serve.body_timeout_s`); reported: the latency p99 of the requests
  sent meanwhile, the refusals among them, and how often readiness said 200 (goal: the latency
  goals above still met, no refusal, always ready);
* the server's memory: resident bytes grown from listening (tables allocated, untouched) to
  the end, per row of the model's tables, against the stated 2 x 4 x dim bytes and against
  what the server reports holding (`deltarec_serve_model_bytes`: both copies and the decoded
  rows kept for the copy behind); the difference is `memory_other_bytes`.

`--sweep` adds the load curve after that (`--sweep-only`: the load curve alone): the same job
trains again (a fresh broker and server, checkpoints every ``--interval-s``; stopped once the
curve is done) and, from a second process, an open-loop load (bench/serve_load.py `--sweep`)
offers each request size of ``--sweep-sizes`` in turn at rates doubling from
``--sweep-start-rps`` until the server is overloaded, then refines toward each goal. Reported
(`sweep` in the document, records `load_*`):

* per point (size x offered rate): p50/p99 from each request's scheduled send time (queueing is
  never hidden by a client waiting for answers), errors by kind, the rate answered, and how
  late the client itself sent (its share of the latency);
* per goal (1 sample: p99 <= 20 ms, 512 samples: p99 <= 50 ms, no error), the highest offered
  rate meeting it and the next rate swept (which did not): the capacity lies between;
* per size, where the time goes at the highest rate offered (saturation): the server's mean
  per stage of a request (read, queue, parse, lock, lookup, forward, resume, respond;
  `deltarec_serve_request_stage_seconds`) and the rest of the client's mean latency (HTTP
  framing, the event loop before the handler, loopback, the client).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Measurement, config_path, document_head, loadavg, log, machine_info, rounded, scalars
from bench.memory import proc_status
from bench.serve_load import LoadPoint, ServerTime, SweepResult, SweepSettings, add_sweep_options, highest_meeting, sweep_argv
from bench.serve_load import sweep_settings as sweep_settings_of
from ckpt.log.backend import open_backend
from ckpt.log.catalog import read_catalog
from common.process import run_main
from launch.broker import EmbeddedBroker
from launch.ranks import REPO, read_jsonl, start_ranks
from trainer.config import JobConfig, load_config
from trainer.serve.client import ServeClient
from trainer.serve.requests import FeatureLayout

DEFAULT_CONFIG = REPO / "configs" / "quickstart.yaml"
DEFAULT_SET = ["ckpt.schedule.policy=incremental", "ckpt.encoding.weights=adaptive4"]
SWEEP_TRAIN_STEPS = 10**7  # the load curve's job trains until the curve is done, then is stopped


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--interval-s", type=float, default=10.0, help="a checkpoint every T seconds")
    p.add_argument("--rate", type=float, default=20.0, help="one-sample requests per second")
    p.add_argument("--big", type=int, default=512, help="samples in a big request")
    p.add_argument("--big-rate", type=float, default=2.0, help="big requests per second")
    p.add_argument("--set", dest="overrides", action="append", default=list(DEFAULT_SET), help="config overrides (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="the requests' samples")
    p.add_argument("--stalled", type=int, default=200, help="uploads stalled mid-body at once (0: none)")
    p.add_argument("--stall-after-s", type=float, default=20.0, help="seconds after the server is ready the stalls begin")
    p.add_argument("--stall-s", type=float, default=15.0, help="how long they go on")
    p.add_argument("--timeout-s", type=float, default=1200)
    p.add_argument("--out", default="serve.json")
    p.add_argument("--work-dir", type=Path, help="keep the run here (default: a temporary directory, removed)")
    p.add_argument("--sweep", action="store_true", help="then the load curve, while the job trains again (see above)")
    p.add_argument("--sweep-only", action="store_true", help="the load curve alone")
    add_sweep_options(p, "sweep-")
    return p


def _samples(job: JobConfig, n: int, seed: int) -> dict[str, Any]:
    """`n` samples in the job's layout: one id per feature, Zipf-like toward low ids as training's."""
    rng = random.Random(seed)
    layout = FeatureLayout.of(job.model)
    return {
        "samples": [
            {
                "dense": [rng.uniform(0, 2) for _ in range(layout.dense_in_features)],
                "sparse": {
                    f: [min(int(rng.paretovariate(1.05)) - 1, rows - 1)] for f, rows in zip(layout.features, layout.cardinalities)
                },
            }
            for _ in range(n)
        ]
    }


def _wait(predicate: Any, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"bench serve: the server exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"bench serve: timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)  # polling other processes


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def _job(args: argparse.Namespace, work: Path, broker: EmbeddedBroker, steps: int) -> list[str]:
    """The overrides of the job trained (and served) under `work`."""
    return [
        f"run.dir={work / 'run'}",
        "ckpt.enabled=true",
        "ckpt.sink.kind=kafka",
        f"ckpt.sink.bootstrap_servers={broker.bootstrap}",
        f"ckpt.run_id=serve-bench-{os.getpid()}",
        "ckpt.schedule.interval_steps=0",
        f"ckpt.schedule.interval_s={args.interval_s}",
        f"train.steps={steps}",
        "train.eval_every=0",
        "serve.port=0",
        "serve.poll_s=0.2",
        *args.overrides,
    ]


def _start_server(args: argparse.Namespace, work: Path, job: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, Any]:
    """`deltarec-serve` of the job, its output in `work`/server.log (the log file, to close)."""
    address = work / "server.json"
    address.unlink(missing_ok=True)  # a kept --work-dir's: the server writes its own once it listens
    server_log = open(work / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "trainer.serve_cli", "--config", str(args.config), *job, "--address-file", str(address)],
        cwd=REPO, env=env, stdout=server_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    return server, server_log


def _stop_server(server: subprocess.Popen, server_log: Any) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        server.kill()
    server_log.close()


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    env = _env()
    with EmbeddedBroker() as broker:
        job = _job(args, work, broker, args.steps)
        cfg = load_config(args.config, job, check_data=False)
        samples = work / "samples.json"
        samples.write_text(json.dumps(_samples(cfg, max(args.big, 1), args.seed)))
        address = work / "server.json"
        server, server_log = _start_server(args, work, job, env)
        load: subprocess.Popen | None = None
        try:
            _wait(address.exists, 120, "the server to listen", server)
            client = ServeClient(json.loads(address.read_text())["url"], timeout_s=10)
            url = client.url
            rss_listening = proc_status(server.pid)
            load = subprocess.Popen(
                [sys.executable, "-m", "bench.serve_load", "--url", url, "--samples-file", str(samples),
                 "--out", str(work / "answers.json"), "--rate", str(args.rate), "--big", str(args.big),
                 "--big-rate", str(args.big_rate)],
                cwd=REPO, env=env,
            )  # fmt: skip
            log(f"server on {url}; training {args.steps} steps with a checkpoint every {args.interval_s:g} s")
            t0 = time.perf_counter()
            ranks = start_ranks(args.config, job, work, timeout_s=args.timeout_s)
            stalls = StalledUploads(client, args.stalled, args.stall_after_s, args.stall_s)
            ranks.wait()
            stall = stalls.finish()
            train_s = time.perf_counter() - t0
            backend = open_backend(cfg.ckpt.run_id, cfg.ckpt.sink, world_size=1)
            try:
                commits = read_catalog(backend.markers, cfg.ckpt.run_id).commits
            finally:
                backend.close()
            last = max(commits)
            _wait(lambda: client.ready()[1].get("checkpoint_id") == last, 120, f"checkpoint {last} served", server)
            time.sleep(2)  # answers from the last checkpoint too
            freshness = {q: client.metric(f"deltarec_serve_freshness_{q}_seconds") for q in ("p50", "p99")}
            held = int(client.metric("deltarec_serve_model_bytes"))  # both copies and the rows kept
            rss_end = proc_status(server.pid)
        finally:
            if load is not None:
                load.send_signal(signal.SIGTERM)
                load.wait(timeout=120)
            _stop_server(server, server_log)
    answers = json.loads((work / "answers.json").read_text())
    return {
        "cfg": cfg,
        "commits": commits,
        "answers": answers,
        "freshness": freshness,
        "held_bytes": held,
        "rss_listening": rss_listening,
        "rss_end": rss_end,
        "train_s": train_s,
        "applied": read_jsonl(work / "run" / "serve.jsonl"),
        "stall": stall,
    }


@dataclass(frozen=True)
class SweepRun:
    """The load curve's measurement: the load's points, and whether the job trained throughout."""

    result: SweepResult
    trained_throughout: bool
    seconds: float


def measure_sweep(args: argparse.Namespace, work: Path) -> SweepRun:
    """The load curve: the job trains (until the curve is done) with the server beside it, and
    bench/serve_load.py's open-loop sweep runs against it from its own process."""
    work.mkdir(parents=True, exist_ok=True)
    env = _env()
    settings = sweep_settings_of(args, "sweep-")
    with EmbeddedBroker() as broker:
        job = _job(args, work, broker, SWEEP_TRAIN_STEPS)
        cfg = load_config(args.config, job, check_data=False)
        samples = work / "samples.json"
        samples.write_text(json.dumps(_samples(cfg, max(settings.sizes), args.seed)))
        address, out = work / "server.json", work / "sweep.json"
        server, server_log = _start_server(args, work, job, env)
        ranks = None
        try:
            _wait(address.exists, 120, "the server to listen", server)
            url = json.loads(address.read_text())["url"]
            log(f"load curve: server on {url}; training with a checkpoint every {args.interval_s:g} s until it is done")
            t0 = time.perf_counter()
            ranks = start_ranks(args.config, job, work, timeout_s=args.timeout_s)
            load = subprocess.run(
                [sys.executable, "-m", "bench.serve_load", "--url", url, "--samples-file", str(samples), "--out", str(out),
                 "--sweep", *sweep_argv(settings)],
                cwd=REPO, env=env, timeout=args.timeout_s,
            )  # fmt: skip
            if load.returncode != 0:
                raise SystemExit(f"bench serve: the load curve's client failed ({load.returncode})")
            trained = all(p.poll() is None for p in ranks.procs)
            seconds = time.perf_counter() - t0
        finally:
            if ranks is not None:
                for proc in ranks.procs:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)
                ranks.wait(expect_ok=False)
            _stop_server(server, server_log)
    return SweepRun(SweepResult.from_json(json.loads(out.read_text())), trained, seconds)


@dataclass(frozen=True)
class GoalRate:
    """A latency goal and the highest offered rate meeting it (None: none swept did); the next
    rate swept above it did not, so the capacity for the goal lies between (None: none above)."""

    samples: int
    p99_ms: float
    highest_rps: float | None
    next_rps: float | None


@dataclass(frozen=True)
class Saturation:
    """Where the time goes at a size's highest offered rate: the client's view, the server's
    mean per stage, and the rest of the client's mean (`outside_ms`: HTTP framing, the event
    loop before the handler, loopback, the client; None without both means)."""

    samples: int
    offered_rps: float
    achieved_rps: float
    overload: str  # why the sweep stopped there ("": the highest rate allowed, not overloaded)
    p99_ms: float | None
    client_mean_ms: float | None
    server: ServerTime | None
    outside_ms: float | None


@dataclass
class SweepReport:
    """The load curve: every point, the highest rate meeting each goal, the saturation breakdowns."""

    settings: SweepSettings
    points: list[LoadPoint]
    goals: list[GoalRate] = field(default_factory=list)
    saturation: list[Saturation] = field(default_factory=list)
    trained_throughout: bool = True
    seconds: float = 0.0


def summarize_sweep(run: SweepRun) -> SweepReport:
    points, settings = run.result.points, run.result.settings
    goals = []
    for samples, p99_ms in settings.goals_ms:
        best = highest_meeting(points, samples, p99_ms)
        above = [p.offered_rps for p in points if p.samples == samples and (best is None or p.offered_rps > best)]
        goals.append(GoalRate(samples, p99_ms, best, min(above) if above else None))
    saturation = []
    for samples in settings.sizes:
        mine = [p for p in points if p.samples == samples]
        if not mine:
            continue
        top = max(mine, key=lambda p: p.offered_rps)
        outside = top.mean_ms - top.server.request_ms if top.mean_ms is not None and top.server is not None else None
        saturation.append(
            Saturation(samples, top.offered_rps, top.achieved_rps, top.overload, top.p99_ms, top.mean_ms, top.server, outside)
        )
    return SweepReport(settings, points, goals, saturation, run.trained_throughout, round(run.seconds, 1))


def log_sweep(report: SweepReport) -> None:
    """The load curve on stderr: a line per point, goal and saturation."""
    for p in report.points:
        log(
            f"load {p.samples:>4} x {p.offered_rps:>6g}/s: p50 {_fmt(p.p50_ms)} p99 {_fmt(p.p99_ms)} ms, "
            f"errors {p.errors}/{p.sent} {p.error_kinds or ''}, answered {p.achieved_rps:.1f}/s"
            + (f", overloaded ({p.overload})" if p.overload else "")
            + (f" (measured again after a p99 of {p.remeasured_p99_ms:.1f} ms)" if p.remeasured_p99_ms is not None else "")
        )
    for g in report.goals:
        log(f"highest rate with {g.samples}-sample p99 <= {g.p99_ms:g} ms: {g.highest_rps} /s (next swept: {g.next_rps})")
    for sat in report.saturation:
        stages = ", ".join(f"{k} {v:.2f}" for k, v in sat.server.stages_ms.items()) if sat.server else "-"
        log(
            f"at {sat.offered_rps:g}/s of {sat.samples} sample(s) ({sat.overload or 'not overloaded'}): client mean "
            f"{_fmt(sat.client_mean_ms)} ms = outside the handler {_fmt(sat.outside_ms)} + server ms: {stages}"
        )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


class StalledUploads:
    """`count` connections that send a request's head and half its body and stall, from
    `after_s` after the server is first ready on, for `for_s` seconds, each opened again when the server closes it (408); and
    readiness asked once a second meanwhile. A thread of the benchmark's own process."""

    def __init__(self, client: ServeClient, count: int, after_s: float, for_s: float) -> None:
        self.client, self.count, self.after_s, self.for_s = client, count, after_s, for_s
        host, port = client.url.removeprefix("http://").rsplit(":", 1)
        self.where = (host, int(port))
        self.window: tuple[float, float] = (0.0, 0.0)
        self.ready: list[bool] = []
        self.opened = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True) if count else None
        if self.thread is not None:
            self.thread.start()

    def _open(self) -> socket.socket:
        body = b'{"samples": [{"dense": [0.5, 0.5, 0.5, 0.5]}]}'
        head = f"POST /predict HTTP/1.1\r\nHost: {self.where[0]}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        conn = socket.create_connection(self.where, timeout=5)
        conn.sendall(head + body[: len(body) // 2])
        conn.setblocking(False)
        self.opened += 1
        return conn

    def _run(self) -> None:
        while not self.client.ready()[0]:  # a checkpoint served first: then only the stalls decide
            if self.stop.wait(0.2):
                return
        if self.stop.wait(self.after_s):
            return
        start = time.time()
        conns = [self._open() for _ in range(self.count)]
        next_probe = time.monotonic()
        while not self.stop.is_set() and time.time() - start < self.for_s:
            for i, conn in enumerate(conns):
                try:
                    if conn.recv(65536) == b"":  # closed: the server gave up on it (408)
                        raise ConnectionResetError
                except BlockingIOError:
                    continue
                except OSError:
                    conn.close()
                    conns[i] = self._open()
            if time.monotonic() >= next_probe:
                self.ready.append(self.client.ready()[0])
                next_probe += 1.0
            time.sleep(0.05)  # polling the stalled sockets
        self.window = (start, time.time())
        for conn in conns:
            conn.close()

    def finish(self) -> dict[str, Any]:
        if self.thread is not None:
            self.stop.set()
            self.thread.join(timeout=60)
        return {"window": self.window, "ready": self.ready, "opened": self.opened, "count": self.count}


def _apply_windows(applied: list[dict[str, Any]], commits: dict[int, Any]) -> list[tuple[float, float]]:
    """(start, end) wall times of the server's applies: each ended `follow_lag_s` after its COMMIT."""
    out = []
    for r in applied:
        marker = commits.get(r.get("follow_ckpt", -1))
        if marker is not None and r.get("event") == "follow_applied":
            end = marker.created_unix + r["follow_lag_s"]
            out.append((end - r["follow_apply_s"], end))
    return out


def _overlaps(sent: float, latency: float, windows: list[tuple[float, float]]) -> bool:
    return any(sent < end and sent + latency > start for start, end in windows)


def summarize(m: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    cfg: JobConfig = m["cfg"]
    commits = m["commits"]
    first_answer: dict[int, float] = {}
    for a in sorted(m["answers"], key=lambda a: a["sent_unix"] + a["latency_s"]):
        if a["status"] == 200:
            first_answer.setdefault(a["checkpoint_id"], a["sent_unix"] + a["latency_s"])
    first_id = min(first_answer) if first_answer else None
    ttc, client_fresh, margin = [], [], []
    for cid, marker in sorted(commits.items()):
        ttc.append(marker.created_unix - marker.step_unix)
        if cid in first_answer and cid != first_id:  # the first checkpoint served is the start's
            fresh = first_answer[cid] - marker.step_unix
            client_fresh.append(fresh)
            margin.append(fresh - ttc[-1])
    latency = {
        cls: [a["latency_s"] * 1e3 for a in m["answers"] if a["status"] == 200 and a["samples"] == n]
        for cls, n in (("1", 1), (str(args.big), args.big))
    }
    # where the tail is: requests that overlapped a checkpoint's apply on the server, and the others
    windows = _apply_windows(m["applied"], commits)
    quiet = {
        cls: [
            a["latency_s"] * 1e3
            for a in m["answers"]
            if a["status"] == 200 and a["samples"] == n and not _overlaps(a["sent_unix"], a["latency_s"], windows)
        ]
        for cls, n in (("1", 1), (str(args.big), args.big))
    }
    start, end = m["stall"]["window"]
    during = [a for a in m["answers"] if start <= a["sent_unix"] <= end]
    stalled = {
        cls: [a["latency_s"] * 1e3 for a in during if a["status"] == 200 and a["samples"] == n]
        for cls, n in (("1", 1), (str(args.big), args.big))
    }
    rows = sum(t.num_embeddings for t in cfg.model.tables)
    stated = sum(2 * 4 * t.num_embeddings * t.embedding_dim for t in cfg.model.tables)
    grown = m["rss_end"]["VmRSS"] - m["rss_listening"]["VmRSS"]
    summary = {
        "checkpoints": len(commits),
        "served_checkpoints": len(first_answer),
        # the newest checkpoint answered; one superseded before any request reached it never is
        "newest_served": bool(first_answer) and max(first_answer) == max(commits),
        "train_s": round(m["train_s"], 1),
        "time_to_commit_p50_s": _pct(ttc, 50),
        "time_to_commit_p99_s": _pct(ttc, 99),
        "freshness_server_p50_s": m["freshness"]["p50"],
        "freshness_server_p99_s": m["freshness"]["p99"],
        "freshness_client_p50_s": _pct(client_fresh, 50),
        "freshness_client_p99_s": _pct(client_fresh, 99),
        "freshness_minus_commit_p99_s": _pct(margin, 99),
        "latency_1_p50_ms": _pct(latency["1"], 50),
        "latency_1_p99_ms": _pct(latency["1"], 99),
        f"latency_{args.big}_p50_ms": _pct(latency[str(args.big)], 50),
        f"latency_{args.big}_p99_ms": _pct(latency[str(args.big)], 99),
        "latency_1_p99_outside_apply_ms": _pct(quiet["1"], 99),
        f"latency_{args.big}_p99_outside_apply_ms": _pct(quiet[str(args.big)], 99),
        "apply_share": round(sum(b - a for a, b in windows) / max(m["train_s"], 1e-9), 4),
        "requests_ok": sum(1 for a in m["answers"] if a["status"] == 200),
        "requests_refused": sum(1 for a in m["answers"] if a["status"] not in (200, 0)),
        "stalled_uploads": m["stall"]["count"],
        "stalled_connections_opened": m["stall"]["opened"],
        "stalled_window_s": round(end - start, 1),
        "stalled_requests": len(during),
        "stalled_requests_refused": sum(1 for a in during if a["status"] != 200),
        "stalled_latency_1_p99_ms": _pct(stalled["1"], 99),
        f"stalled_latency_{args.big}_p99_ms": _pct(stalled[str(args.big)], 99),
        "stalled_ready_fraction": round(sum(m["stall"]["ready"]) / len(m["stall"]["ready"]), 3) if m["stall"]["ready"] else None,
        "rows": rows,
        "memory_grown_bytes": grown,
        "memory_per_row_bytes": grown / rows,
        "memory_stated_per_row_bytes": stated / rows,
        # what the server says it holds at the end: both copies plus the rows kept for the copy
        # behind (docs/design/serving.md); the rest of the growth is the allocator's and the libraries'
        "memory_held_per_row_bytes": m["held_bytes"] / rows,
        "memory_other_bytes": grown - m["held_bytes"],
        "memory_peak_bytes": m["rss_end"]["VmHWM"],
    }
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()}


def run(argv: list[str], prog: str = "python -m bench.run --suite serve") -> dict[str, Any]:
    args = parser(prog).parse_args(argv)
    args.config = Path(config_path(args.config))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="deltarec-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    t0 = time.perf_counter()
    summary: dict[str, Any] = {}
    sweep: SweepReport | None = None
    try:
        if not args.sweep_only:
            summary = summarize(measure(args, work), args)
        if args.sweep or args.sweep_only:
            sweep = summarize_sweep(measure_sweep(args, work / "sweep"))
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    machine["loadavg_end"] = loadavg()
    res = {
        **document_head("serve", prog, argv, machine),
        "seconds": round(time.perf_counter() - t0, 1),
        "settings": {
            "config": str(args.config),
            "steps": args.steps,
            "interval_s": args.interval_s,
            "rate": args.rate,
            "big": args.big,
            "big_rate": args.big_rate,
            "stalled": args.stalled,
            "stall_after_s": args.stall_after_s,
            "stall_s": args.stall_s,
            "overrides": args.overrides,
            "sweep": args.sweep or args.sweep_only,
            "sweep_only": args.sweep_only,
        },
        "summary": summary,
    }
    if sweep is not None:
        res["sweep"] = rounded(asdict(sweep))
    for key, value in summary.items():
        log(f"{key}: {value}")
    if sweep is not None:
        log_sweep(sweep)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return res


def measurements(result: dict[str, Any]) -> list[Measurement]:
    interval = {"interval_s": result["settings"]["interval_s"]}
    out = scalars(result["summary"], interval)
    sweep = result.get("sweep")
    if sweep is None:
        return out
    for p in sweep["points"]:
        labels = {**interval, "samples": p["samples"], "offered_rps": p["offered_rps"]}
        for name in ("p50_ms", "p99_ms", "errors", "achieved_rps"):
            if p[name] is not None:
                out.append(Measurement(f"load_{name}", p[name], _LOAD_UNITS[name], labels))
    for g in sweep["goals"]:
        if g["highest_rps"] is not None:
            labels = {**interval, "samples": g["samples"], "p99_ms": g["p99_ms"]}
            out.append(Measurement("load_highest_rps_meeting_p99", g["highest_rps"], "requests/s", labels))
    for sat in sweep["saturation"]:
        if sat["server"] is None:
            continue
        labels = {**interval, "samples": sat["samples"], "offered_rps": sat["offered_rps"]}
        for stage, ms in sat["server"]["stages_ms"].items():
            out.append(Measurement("load_saturation_stage_ms", ms, "ms", {**labels, "stage": stage}))
        if sat["outside_ms"] is not None:
            out.append(Measurement("load_saturation_stage_ms", sat["outside_ms"], "ms", {**labels, "stage": "outside"}))
    return out


_LOAD_UNITS = {"p50_ms": "ms", "p99_ms": "ms", "errors": "", "achieved_rps": "requests/s"}


def main(argv: list[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv, "python -m bench.serve")
    return 0


if __name__ == "__main__":
    run_main(main)
