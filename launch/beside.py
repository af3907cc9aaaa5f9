"""What the quickstart runs beside its job: a follower, a prediction server and a light probe.

The follower (`deltarec-follow`) compacts the incremental chain as it grows; the server
(`deltarec-serve`) applies every checkpoint as it commits; the probe asks the server one
prediction every `probe_s` seconds while the job trains, so each checkpoint gets its first
answer (its freshness, docs/design/serving.md, "Freshness") as a client would give it. Their output goes to
`<run_dir>/follower.log` and `<run_dir>/server.log`; the console keeps the trainer's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from launch.ranks import REPO
from trainer.config import JobConfig
from trainer.serve.client import ServeClient
from trainer.serve.requests import FeatureLayout


class Answer(NamedTuple):
    """One prediction and what the server says of its freshness."""

    score: float
    checkpoint_id: int
    step: int
    freshness_p50_s: float
    freshness_p99_s: float
    checkpoints_timed: int


def one_sample(job: JobConfig) -> bytes:
    """A request of one sample in the job's layout: dense features 0.1, 0.2, ..., id 1 of every feature."""
    layout = FeatureLayout.of(job.model)
    sample = {
        "dense": [round(0.1 * (i + 1), 1) for i in range(layout.dense_in_features)],
        "sparse": {f: [1] for f in layout.features},
    }
    return json.dumps({"samples": [sample]}).encode()


class Beside:
    """The follower and the server of one job (`argv`: its config and overrides), started now."""

    def __init__(self, argv: list[str], run_dir: Path, body: bytes, probe_s: float = 0.25) -> None:
        self.run_dir, self.body, self.probe_s = run_dir, body, probe_s
        self.address = run_dir / "server.json"
        self.address.unlink(missing_ok=True)
        self.procs = {
            "follower": self._start("follower", "trainer.follow_cli", argv),
            "server": self._start("server", "trainer.serve_cli", [*argv, "serve.port=0", "--address-file", str(self.address)]),
        }
        self.client: ServeClient | None = None
        self.stop = threading.Event()
        self.probe = threading.Thread(target=self._probe, name="quickstart-probe", daemon=True)

    def _start(self, name: str, module: str, argv: list[str]) -> subprocess.Popen:
        with open(self.run_dir / f"{name}.log", "w") as log:
            return subprocess.Popen([sys.executable, "-m", module, *argv], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def wait_listening(self, timeout_s: float = 120) -> str:
        """The server's URL once it listens; starts the probe."""
        deadline = time.monotonic() + timeout_s
        while not self.address.exists():
            if self.procs["server"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the prediction server did not start; see {self.run_dir / 'server.log'}")
            time.sleep(0.2)  # polling the server's address file
        self.client = ServeClient(json.loads(self.address.read_text())["url"], timeout_s=10)
        self.probe.start()
        return self.client.url

    def _probe(self) -> None:
        assert self.client is not None
        while not self.stop.wait(self.probe_s):
            try:
                self.client.predict(self.body)
            except OSError:  # the server is restarting or gone; the next probe tries again
                continue

    def ask(self, checkpoint_id: int, timeout_s: float = 60) -> Answer:
        """Wait until the server serves `checkpoint_id`, then one prediction and its freshness."""
        assert self.client is not None, "wait_listening() first"
        deadline = time.monotonic() + timeout_s
        while True:
            ready, status = self.client.ready()
            if ready and status["checkpoint_id"] >= checkpoint_id:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not serve checkpoint {checkpoint_id} within {timeout_s:.0f} s")
            time.sleep(0.2)  # polling the server
        self.stop.set()
        code, doc = self.client.predict(self.body)
        if code != 200:
            raise RuntimeError(f"the server answered {code}: {doc}")
        answer: dict[str, Any] = doc
        return Answer(
            answer["scores"][0],
            answer["checkpoint_id"],
            answer["step"],
            self.client.metric("deltarec_serve_freshness_p50_seconds"),
            self.client.metric("deltarec_serve_freshness_p99_seconds"),
            int(self.client.metric("deltarec_serve_freshness_seconds_count")),
        )

    def close(self) -> None:
        """Stop the probe, then the server and the follower (SIGTERM, then SIGKILL after 30 s)."""
        self.stop.set()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
