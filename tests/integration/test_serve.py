"""`deltarec-serve` against real jobs: consistent answers while training and applying run under
load, a restart, a damaged frame, the broker going away, and requests it must refuse.

Everything is a real process: gloo ranks, the server as `python -m trainer.serve_cli`, real
stream files or the embedded broker, and a real HTTP client (urllib). Reference scores come
from `deltarec-ckpt export` of the checkpoint a response names, loaded into a fresh model and
run on the same samples with one torch thread, as the server runs them. Random samples come
from the test's seed; a failure names the command that replays it.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from ckpt import cli as ckpt_cli
from ckpt.config import CkptConfig
from ckpt.dense.store import DenseStore
from ckpt.log.backend import open_backend
from ckpt.log.catalog import Catalog, read_catalog
from ckpt.log.markers import ChainLink
from ckpt.restore.export import export
from launch.broker import EmbeddedBroker
from launch.ranks import RankGroup, spawn_ranks, start_ranks
from tests.background import BackgroundProc
from trainer.ckpt_cli import load_job_ckpt_config
from trainer.config import JobConfig
from trainer.serve.client import ServeClient
from trainer.serve.requests import FeatureLayout, parse_request
from trainer.serve.servable import Servable
from trainer.serve.versions import dlrm_servable, serving_module

if TYPE_CHECKING:
    from tests.conftest import CliRunner, DebugConfig, ReplaySeed

pytestmark = pytest.mark.integration


def _job(run_id: str, sink: str = "filesystem", bootstrap: str = "", encoding: str = "fp32") -> list[str]:
    job = [
        "ckpt.enabled=true",
        f"ckpt.sink.kind={sink}",
        f"ckpt.run_id={run_id}",
        "ckpt.schedule.policy=incremental",
        "ckpt.schedule.interval_steps=5",
        "ckpt.sink.flush_timeout_s=20",
        f"ckpt.encoding.weights={encoding}",
        "train.eval_batches=1",
        "serve.port=0",
        "serve.poll_s=0.1",
    ]
    return [*job, f"ckpt.sink.bootstrap_servers={bootstrap}"] if bootstrap else job


# --- the server as a process ------------------------------------------------------------------


class ServerProc(BackgroundProc):
    """One `python -m trainer.serve_cli` of the job, its output in `<tmp>/<name>.log`, and a
    client of it (`ServeClient`: the real HTTP client of urllib). With `model`, the server of
    a run of a user's own loop: `config` is its ckpt.yaml, `model` the `--model` factory."""

    def __init__(self, config: Path, job: list[str], tmp_path: Path, name: str = "server", model: str = "") -> None:
        self.address = tmp_path / f"{name}.address.json"
        self.address.unlink(missing_ok=True)
        run = ["--model", model] if model else [f"run.dir={tmp_path / 'run'}"]
        argv = ["--config", str(config), *run, *job, "--address-file", str(self.address)]
        super().__init__("trainer.serve_cli", argv, tmp_path, name)
        _wait_for(self.address.exists, 90, f"{name} to listen", self)
        self.where = json.loads(self.address.read_text())
        self.client = ServeClient(self.where["url"])

    def call(self, path: str, body: bytes | None = None, method: str | None = None) -> tuple[int, Any]:
        """(status, decoded JSON or text) of one request."""
        return self.client.json(path, body, method)

    def predict(self, body: bytes) -> tuple[int, Any]:
        return self.client.predict(body)

    def metric(self, name: str) -> float:
        value = self.client.metric(name)
        assert value == value, f"{name} not in /metrics"  # NaN: absent
        return value


def _wait_for(predicate: Callable[[], object], timeout_s: float, what: str, server: ServerProc | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if server is not None and not server.alive():
            pytest.fail(f"waiting for {what}: {server.name} exited\n{server.tail()}", pytrace=False)
        if time.monotonic() > deadline:
            pytest.fail(
                f"waiting for {what}: timed out after {timeout_s:.0f} s\n{server.tail() if server else ''}", pytrace=False
            )
        time.sleep(0.1)  # polling another process


def _serving(server: ServerProc, checkpoint_id: int) -> Callable[[], bool]:
    def check() -> bool:
        status, doc = server.call("/readyz")
        return status == 200 and doc["checkpoint_id"] == checkpoint_id

    return check


# --- samples and reference scores ---------------------------------------------------------------


def _samples(job: JobConfig | FeatureLayout, n: int, seed: int) -> bytes:
    """`n` random samples in the job's (or a model's) layout: 0-3 ids per feature (0: an empty bag)."""
    rng = random.Random(seed)
    layout = job if isinstance(job, FeatureLayout) else FeatureLayout.of(job.model)
    samples = []
    for _ in range(n):
        sparse = {
            f: [rng.randrange(rows) for _ in range(rng.randrange(4))] for f, rows in zip(layout.features, layout.cardinalities)
        }
        samples.append({"dense": [rng.uniform(-1, 3) for _ in range(layout.dense_in_features)], "sparse": sparse})
    return json.dumps({"samples": samples}).encode()


def _catalog(cfg: CkptConfig) -> Catalog:
    backend = open_backend(cfg.run_id, cfg.sink, world_size=1)
    try:
        return read_catalog(backend.markers, cfg.run_id)
    finally:
        backend.close()


def predict_as_served(served: Servable, module: torch.nn.Module, batch: Any) -> torch.Tensor:
    """`served`'s scores of `batch` with `module`, on one thread as the server computes them (serve.threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return served.predict(module, batch)
    finally:
        torch.set_num_threads(threads)


class Reference:
    """Scores of exported checkpoints on one request body, computed as the server computes them."""

    def __init__(self, job: JobConfig, body: bytes, tmp_path: Path) -> None:
        self.job, self.tmp = job, tmp_path
        self.served = dlrm_servable(job.model)
        self.batch = parse_request(body, self.served.layout(), 1 << 20)
        self.cache: dict[int, torch.Tensor] = {}

    def of_file(self, path: Path) -> torch.Tensor:
        state = torch.load(path, weights_only=True)["model"]
        module = serving_module(self.job.model)
        module.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
        return predict_as_served(self.served, module, self.batch)

    def __call__(self, checkpoint_id: int) -> torch.Tensor:
        """The export of `checkpoint_id` (ckpt/restore/export.py, what `deltarec-ckpt export` runs)."""
        if checkpoint_id not in self.cache:
            cfg = self.job.ckpt
            marker = _catalog(cfg).cheapest(_catalog(cfg).commits[checkpoint_id])
            assert marker is not None
            out = self.tmp / f"export-{checkpoint_id}.pt"
            backend = open_backend(cfg.run_id, cfg.sink, world_size=1)
            try:
                export(marker, backend.source, DenseStore(Path(cfg.sink.dense_dir)), cfg.run_id, backend.locate, out)
            finally:
                backend.close()
            self.cache[checkpoint_id] = self.of_file(out)
        return self.cache[checkpoint_id]


def _assert_matches(answers: list[tuple[int, list[float]]], reference: Reference) -> None:
    for checkpoint_id, got in answers:
        want = reference(checkpoint_id)
        got_t = torch.tensor(got, dtype=torch.float32)
        if not torch.equal(got_t, want):
            diff = (got_t - want).abs().max().item()
            pytest.fail(
                f"a response tagged checkpoint {checkpoint_id} differs from its export (max |diff| {diff:g})", pytrace=False
            )


# --- 1. consistency while training and applying run under load -----------------------------------


class Load:
    """Threads posting one body in a loop; keeps every 200's (checkpoint id, scores)."""

    def __init__(self, server: ServerProc, body: bytes, threads: int = 2) -> None:
        self.server, self.body = server, body
        self.answers: list[tuple[int, list[float]]] = []
        self.refused: list[tuple[int, Any]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            status, doc = self.server.predict(self.body)
            if status == 200:
                self.answers.append((doc["checkpoint_id"], doc["scores"]))
            else:
                self.refused.append((status, doc))
                time.sleep(0.05)  # not ready yet

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def test_every_answer_is_one_checkpoint_while_training_under_load(
    tmp_path: Path, debug_config: DebugConfig, broker, unique_name, replay_seed: ReplaySeed, run_cli: CliRunner
) -> None:
    """Kafka, 2 ranks, row-wise and column-wise tables, a checkpoint every 5 steps: the server
    starts before the trainer, two clients post the same batch throughout, and every answer
    equals, bit for bit (fp32 rows), the export of the checkpoint it names."""
    seed = replay_seed.value
    job = [
        *_job(unique_name("serve"), "kafka", broker.bootstrap),
        "model.tables.0.sharding=row_wise",
        "model.tables.1.sharding=column_wise",
        "train.steps=90",
    ]
    cfg = debug_config.load([*job, f"run.dir={tmp_path / 'run'}"], check_data=False)
    body = _samples(cfg, 24, seed)
    server = ServerProc(debug_config.path, job, tmp_path)
    group: RankGroup | None = None
    load = Load(server, body)
    try:
        _wait_for(lambda: len(load.refused) >= 2, 30, "a request refused before any checkpoint", server)
        status, ready = server.call("/readyz")
        assert status == 503 and ready["reason"] == "no checkpoint applied yet", ready
        group = start_ranks(debug_config.path, job, tmp_path, timeout_s=240)
        group.wait()
        last = max(_catalog(cfg.ckpt).commits)
        _wait_for(_serving(server, last), 60, f"checkpoint {last} served", server)
        _wait_for(lambda: any(cid == last for cid, _ in load.answers), 30, f"an answer from checkpoint {last}", server)
    finally:
        load.finish()
        if group is not None and group.running():
            group.wait(expect_ok=False)
    assert all(status == 503 for status, _ in load.refused), load.refused[:3]
    seen = sorted({cid for cid, _ in load.answers})
    assert len(seen) >= 3, f"answers came from checkpoints {seen} only: training and serving did not overlap"
    reference = Reference(cfg, body, tmp_path)
    _assert_matches(load.answers, reference)
    # the command users run gives the same model as the in-process export the test compared with
    out = tmp_path / "cli-export.pt"
    run_cli("trainer.ckpt_cli", "--config", debug_config.path, f"run.dir={tmp_path / 'run'}", *job, "export", "--out", out)
    assert torch.equal(reference.of_file(out), reference(last))
    # freshness: one figure per checkpoint first served after the start, in /metrics and the log
    assert server.metric("deltarec_serve_freshness_seconds_count") >= len(seen) - 1
    assert server.metric("deltarec_serve_freshness_p99_seconds") > 0
    assert "first served" in server.text()
    assert server.stop() == 0, server.tail()
    assert "stopped:" in server.text()


def test_a_server_beside_an_every_step_job_and_gc_ends_serving_the_newest_checkpoint(
    tmp_path: Path, debug_config: DebugConfig, unique_name, capsys
) -> None:
    """docs/checkpoints.md, "A checkpoint every step": gc run every little while beside the job
    deletes the dense files of all but the newest checkpoints. A server stopped for a while
    (SIGSTOP) falls behind them: let go, it applies the checkpoints waiting in one pass, which
    reads the dense file of the newest only, so the ones gc deleted meanwhile are not missed. It
    answers before and after, and once training ends it serves the run's newest checkpoint."""
    job = [*_job(unique_name("serve-gc")), "ckpt.schedule.interval_steps=1", "train.steps=300"]
    cfg = debug_config.load([*job, f"run.dir={tmp_path / 'run'}"], check_data=False)
    server = ServerProc(debug_config.path, job, tmp_path)
    tool = ["--config", str(debug_config.path), f"run.dir={tmp_path / 'run'}", *job]
    group = start_ranks(debug_config.path, job, tmp_path, timeout_s=240)
    rounds, answered, stopped_at, resumed = 0, 0, 0.0, False
    try:
        while group.running():
            rounds += ckpt_cli.main([*tool, "gc", "--keep", "2"], load_job_ckpt_config) == 0
            if not stopped_at and answered >= 2:  # serving: now behind while gc deletes what it would apply next
                os.kill(server.pid, signal.SIGSTOP)
                stopped_at = time.monotonic()
            elif stopped_at and not resumed and time.monotonic() - stopped_at > 1.5:
                os.kill(server.pid, signal.SIGCONT)
                resumed = True
            if not stopped_at or resumed:
                answered += server.predict(_samples(cfg, 2, rounds))[0] == 200
            time.sleep(0.2)  # gc every little while, as a cron job would
    finally:
        os.kill(server.pid, signal.SIGCONT)
        group.wait()
    capsys.readouterr()
    assert stopped_at and rounds >= 3, f"the server was never stopped behind the job: {rounds} gc rounds, {answered} answers"
    last = max(_catalog(cfg.ckpt).commits)
    _wait_for(_serving(server, last), 60, f"checkpoint {last} served", server)
    caught_up = [int(n) for n in re.findall(r"applied \((\d+) deltas from checkpoint", server.text())]
    assert max(caught_up, default=0) >= 15, f"no pass applied the checkpoints waiting after SIGCONT: {caught_up}"
    assert server.stop() == 0, server.tail()


# --- 2. restart, a damaged frame, bad requests (filesystem stream) --------------------------------


def _damage_first_frame(cfg: CkptConfig, link: ChainLink) -> Path:
    """Flip a payload byte of the link's first frame in a partition with more than one (a
    corrupt record, not a torn tail: ckpt/stream/filesystem.py); returns its segment file."""
    partition, rng = next((p, rs[0]) for p, rs in sorted(link.ranges.items()) if rs[0].last > rs[0].first)
    found = sorted(Path(cfg.sink.fs_root).glob(f"*.rows.g{link.generation}/{partition}.seg"))
    assert len(found) == 1, (cfg.sink.fs_root, link.generation, partition)
    data = bytearray(found[0].read_bytes())
    data[rng.first + 40] ^= 0xFF
    found[0].write_bytes(bytes(data))
    return found[0]


def test_restart_damaged_frame_and_bad_requests(tmp_path: Path, debug_config: DebugConfig, replay_seed: ReplaySeed) -> None:
    seed = replay_seed.value
    job = [*_job("servefs"), "serve.max_body_bytes=65536", "serve.max_samples=64", "serve.max_concurrency=1", "serve.max_queue=1"]
    job.append("serve.body_timeout_s=2")
    cfg = debug_config.load([*job, f"run.dir={tmp_path / 'run'}"], check_data=False)
    body = _samples(cfg, 16, seed)
    reference = Reference(cfg, body, tmp_path)
    spawn_ranks(debug_config.path, [*job, "train.steps=20"], tmp_path, timeout_s=180)
    assert max(_catalog(cfg.ckpt).commits) == 4

    # a server SIGKILLed and started again serves the newest checkpoint, from its chain
    first = ServerProc(debug_config.path, job, tmp_path, "first")
    _wait_for(_serving(first, 4), 60, "checkpoint 4 served", first)
    first.kill()
    server = ServerProc(debug_config.path, job, tmp_path)
    try:
        assert server.where["host"] == "127.0.0.1"
        _wait_for(_serving(server, 4), 60, "checkpoint 4 served after a restart", server)
        status, doc = server.predict(body)
        assert status == 200 and doc["checkpoint_id"] == 4, doc
        _assert_matches([(4, doc["scores"])], reference)
        assert "rebuilt from 1+2+3+4" in server.text()

        _refuses_bad_requests(server, cfg)
        _stalled_uploads_take_no_place(server, body)

        # a damaged frame in the next checkpoint: refused naming where; checkpoint 4 stays served
        server.proc.send_signal(signal.SIGSTOP)
        try:
            spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest", "train.steps=30"], tmp_path, timeout_s=180)
            commits = _catalog(cfg.ckpt).commits
            assert sorted(commits) == [1, 2, 3, 4, 5, 6], sorted(commits)
            seg = _damage_first_frame(cfg.ckpt, commits[5].chain[-1])
        finally:
            server.proc.send_signal(signal.SIGCONT)
        _wait_for(lambda: server.call("/healthz")[1]["last_error"], 60, "the damaged frame reported", server)
        error = server.call("/healthz")[1]["last_error"]
        assert f"{seg} at byte " in error and "CRC mismatch" in error, error
        status, doc = server.predict(body)
        assert status == 200 and doc["checkpoint_id"] == 4, doc
        _assert_matches([(4, doc["scores"])], reference)
        assert server.call("/readyz")[0] == 200
        assert server.metric("deltarec_serve_follow_errors_total") >= 1
        assert server.alive()

        # the trainer restores an older checkpoint (3): the server follows the new chain, which
        # does not run through the damaged one
        spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=3", "train.steps=30"], tmp_path, timeout_s=180)
        last = max(_catalog(cfg.ckpt).commits)
        assert _catalog(cfg.ckpt).commits[last].chain[-2].checkpoint_id > 6
        _wait_for(_serving(server, last), 60, f"checkpoint {last} of the new chain served", server)
        status, doc = server.predict(body)
        assert status == 200 and doc["checkpoint_id"] == last, doc
        _assert_matches([(last, doc["scores"])], reference)
        assert server.call("/healthz")[1]["last_error"] == ""
        assert server.stop() == 0, server.tail()
    finally:
        server.kill()


def _refuses_bad_requests(server: ServerProc, cfg: JobConfig) -> None:
    """Each bad request gets its 4xx and one line naming what is wrong; the server goes on."""
    good = json.loads(_samples(cfg, 1, 0))["samples"][0]

    def body(**sample: Any) -> bytes:
        return json.dumps({"samples": [{**good, **sample}]}).encode()

    feature = FeatureLayout.of(cfg.model).features[0]
    cases: list[tuple[bytes, int, str]] = [
        (body(sparse={"no_such_feature": [1]}), 400, "unknown feature 'no_such_feature'"),
        (body(sparse={feature: [10**9]}), 400, f"samples[0].sparse.{feature}: id 1000000000 out of range"),
        (body(sparse={feature: ["7"]}), 400, "is not an integer id"),
        (body(dense=[1.0]), 400, "samples[0].dense: expected a list of 13 numbers"),
        (b"{not json", 400, "body is not JSON"),
        (b'{"samples": []}', 400, "non-empty list"),
        (json.dumps({"samples": [good] * 65}).encode(), 413, "65 samples, more than serve.max_samples = 64"),
        (b"[" + b" " * 70000 + b"]", 413, "serve.max_body_bytes = 65536"),
    ]
    for data, want_status, want in cases:
        status, doc = server.predict(data)
        assert status == want_status and want in doc["error"] and "\n" not in doc["error"], (want, status, doc)
    assert server.call("/predict")[0] == 405
    assert server.call("/nowhere")[0] == 404
    status, doc = server.predict(body())
    assert status == 200 and len(doc["scores"]) == 1
    assert server.metric('deltarec_serve_requests_total{status="400"}') == 6


def _stalled_uploads_take_no_place(server: ServerProc, body: bytes) -> None:
    """With serve.max_concurrency + serve.max_queue = 2, two uploads stalled before their last
    byte leave a good request its answer (a body counts only once it has arrived); each
    stalled one gets 408 once serve.body_timeout_s passes, counted. The rest of admission
    (503 past the places) is tests/unit/test_serve_admission.py's."""
    head = (
        f"POST /predict HTTP/1.1\r\nHost: {server.where['host']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    held = [socket.create_connection((server.where["host"], server.where["port"]), timeout=30) for _ in range(2)]
    try:
        for conn in held:
            conn.sendall(head + body[:-1])
        status, doc = server.predict(body)
        assert status == 200 and len(doc["scores"]) == 16, doc
        assert server.call("/readyz")[0] == 200
        for conn in held:
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408") and b"serve.body_timeout_s" in answer, answer[:300]
    finally:
        for conn in held:
            conn.close()
    assert server.metric("deltarec_serve_requests_in_progress") == 0
    assert server.metric('deltarec_serve_requests_total{status="408"}') == 2


# --- 3. the broker away: the last version stays served, its staleness reported --------------------


STALE_S = 20  # more than the job takes from its last checkpoint to its exit, so readiness is seen to pass first


def test_broker_away_keeps_serving_and_reports_staleness(
    tmp_path: Path, debug_config: DebugConfig, replay_seed: ReplaySeed
) -> None:
    own = EmbeddedBroker().start()
    job = [*_job("serveaway", "kafka", own.bootstrap), f"serve.max_staleness_s={STALE_S}"]
    cfg = debug_config.load([*job, f"run.dir={tmp_path / 'run'}"], check_data=False)
    body = _samples(cfg, 4, replay_seed.value)
    server = None
    try:
        server = ServerProc(debug_config.path, job, tmp_path)
        spawn_ranks(debug_config.path, [*job, "train.steps=10"], tmp_path, timeout_s=180)
        _wait_for(_serving(server, 2), 60, "checkpoint 2 served, fresh (ready)", server)
        own.kill()
        _wait_for(lambda: server.call("/readyz")[0] == 503, 60, "readiness to fail on staleness", server)
        status, ready = server.call("/readyz")
        assert "serve.max_staleness_s" in ready["reason"] and ready["staleness_s"] > STALE_S, ready
        assert server.metric("deltarec_serve_staleness_seconds") > STALE_S
        status, doc = server.predict(body)
        assert status == 200 and doc["checkpoint_id"] == 2, doc
        assert server.call("/healthz")[0] == 200
        assert server.stop(timeout_s=60) == 0, server.tail()
    finally:
        if server is not None:
            server.kill()
        own.stop()
