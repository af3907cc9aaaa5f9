"""A long-running deltarec command as a real background process of a test (the follower, the
prediction server): its output in a log file, SIGTERM or SIGKILL from outside."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch import warm
from launch.ranks import REPO
from tests.conftest import LAUNCHER_VARS


class BackgroundProc:
    """`python -m <module> <argv>` from the repository root, its output in `<tmp>/<name>.log`,
    without the launcher's variables or a staged crash of the test process."""

    def __init__(self, module: str, argv: list[str], tmp_path: Path, name: str) -> None:
        self.name = name
        self.log = tmp_path / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if k not in (*LAUNCHER_VARS, "DELTAREC_KILL_AT")}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(self.log, "w") as out:  # started warm as the suite's ranks are (launch/warm.py)
            self.proc = warm.popen([sys.executable, "-m", module, *argv], REPO, env, out, out)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, n: int = 2500) -> str:
        return f"--- {self.name} (pid {self.pid}, rc {self.proc.poll()}) ---\n{self.text()[-n:]}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: nothing released, nothing flushed."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM and the exit status (a process that does not exit fails the test)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.name} did not exit within {timeout_s:.0f} s of SIGTERM\n{self.tail()}", pytrace=False)
