"""`deltarec-follow` as its own process beside a suite's training job (suite `scale`), where
its memory is measured: the follower thread of `bench.peers.FollowerThread` shares the
suite's process, whose resident set says nothing about the follower's.

The process is started before the trainer's ranks and the suite waits for its first line
("following run ..."), the moment it is ready and holds no rows: its resident set then is the
base the rows' memory is measured from. Once the ranks have exited, `finish(newest)` waits
until its metrics log (`<run_dir>/follower.jsonl`) shows the newest COMMIT applied, or
`grace_s`, reads its peak resident set and stops it with SIGTERM, as a user would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, log
from bench.memory import RssSampler, proc_status

READY_LINE = "following run"


class FollowerProcess:
    """`python -m trainer.follow_cli --config C overrides...`, its output in `log_path`."""

    def __init__(self, config: str, overrides: list[str], metrics: Path, log_path: Path, grace_s: float) -> None:
        self.argv = [sys.executable, "-m", "trainer.follow_cli", "--config", config, *overrides]
        self.metrics = metrics
        self.log_path = log_path
        self.grace_s = grace_s
        self.error: str | None = None
        self.stats: dict[str, Any] = {}
        self.caught_up = False
        self.catch_up_s: float | None = None  # ranks exited -> newest COMMIT applied
        self.rss_ready_bytes = 0  # resident once ready, before any row
        self.rss_peak_bytes = 0  # sampled peak while following
        self.hwm_bytes = 0  # VmHWM when stopped
        self.status_ready: dict[str, int] = {}  # `proc_status` once ready...
        self.status_end: dict[str, int] = {}  # ... and when stopped: which part grew (private, mapped files)
        self._proc: subprocess.Popen | None = None
        self._rss: RssSampler | None = None

    def start(self, timeout_s: float = 120) -> FollowerProcess:
        """Start it and wait for its first line."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = self.log_path.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._proc = subprocess.Popen(self.argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        out.close()
        deadline = time.monotonic() + timeout_s
        while READY_LINE not in self.log_path.read_text(errors="replace"):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"deltarec-follow did not start (rc {self._proc.poll()}): {self.tail()}")
            time.sleep(0.1)
        self._rss = RssSampler(self._proc.pid).start()
        self.rss_ready_bytes = self._rss.start_bytes
        self.status_ready = proc_status(self._proc.pid)
        return self

    def tail(self, n: int = 1500) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.is_file() else ""

    def _applied(self) -> int | None:
        """The newest checkpoint its metrics log says it applied."""
        if not self.metrics.is_file():
            return None
        found = [json.loads(line).get("follow_ckpt") for line in self.metrics.read_text().splitlines() if line.strip()]
        return max((c for c in found if c is not None), default=None)

    def finish(self, newest: int | None) -> None:
        """The ranks have exited, their newest COMMIT is `newest` (None: training failed): wait
        until it is applied (or `grace_s`), then stop the process."""
        assert self._proc is not None and self._rss is not None, "not started"
        done_at = time.monotonic()
        while newest is not None and time.monotonic() < done_at + self.grace_s and self._proc.poll() is None:
            applied = self._applied()
            if applied is not None and applied >= newest:
                self.caught_up, self.catch_up_s = True, time.monotonic() - done_at
                break
            time.sleep(0.1)
        self.rss_peak_bytes = self._rss.stop()
        if self._proc.poll() is None:
            self.status_end = proc_status(self._proc.pid)
            self.hwm_bytes = self.status_end["VmHWM"]
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
                self.error = "did not stop within 60 s of SIGTERM"
        rc = self._proc.returncode
        if rc not in (0, -signal.SIGTERM) and self.error is None:
            self.error = f"exited with {rc}: {self.tail(400)}"
        if newest is not None and not self.caught_up and self.error is None:
            self.error = f"checkpoint {newest} not applied {self.grace_s:.0f} s after training ended"
        if self.error:
            log(f"follower process: {self.error}")
