"""Resident memory of processes, for the suites that report it (`serve`, `scale`).

`proc_status(pid)` reads VmRSS, VmHWM and the resident set's parts once; `RssSampler`
samples one process's resident set on a thread while a phase runs, for the peak inside that
phase (VmHWM is the process's peak since it started: a model's construction would hide the
phase's own peak behind it).
Linux only (/proc), like the machines the suites run on.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import TracebackType

PAGE = os.sysconf("SC_PAGE_SIZE")


STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM and the resident set's parts (RssAnon: private memory; RssFile: mapped
    files, shared libraries' code included, shared with every process that maps them) of
    `pid`, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in STATUS_KEYS:
            fields[key] = int(value.split()[0]) * 1024
    return fields


def rss_bytes(pid: int | None = None) -> int:
    """The resident set of `pid` (None: this process) from /proc/<pid>/statm, in bytes."""
    text = Path(f"/proc/{pid or 'self'}/statm").read_text().split()
    return int(text[1]) * PAGE


class RssSampler:
    """The largest resident set of one process between `start` and `stop`, sampled every
    `every_s` seconds on a daemon thread (a peak shorter than that can be missed; the
    suites' phases last seconds to minutes)."""

    def __init__(self, pid: int | None = None, every_s: float = 0.05) -> None:
        self.pid = pid
        self.every_s = every_s
        self.start_bytes = 0
        self.peak_bytes = 0
        self.samples: list[tuple[float, int]] = []  # (time.monotonic(), bytes)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RssSampler:
        self.start_bytes = self.peak_bytes = rss_bytes(self.pid)
        self.samples = [(time.monotonic(), self.start_bytes)]
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self._sample()
            except (FileNotFoundError, ProcessLookupError):  # the process has exited
                return

    def _sample(self) -> None:
        at = time.monotonic()  # stamped before it is read: a sample stamped after an event was read after it
        now = rss_bytes(self.pid)
        self.samples.append((at, now))
        self.peak_bytes = max(self.peak_bytes, now)

    def stop(self) -> int:
        """Stop sampling; the peak seen (bytes)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._sample()
        except (FileNotFoundError, ProcessLookupError):
            pass
        return self.peak_bytes

    def peak_after(self, fraction: float) -> int:
        """The peak over the last (1 - `fraction`) of the time sampled: a steady state that
        leaves out what happened first (a job's first, full checkpoint)."""
        if not self.samples:
            return 0
        t0, t1 = self.samples[0][0], self.samples[-1][0]
        cut = t0 + fraction * (t1 - t0)
        return max(b for t, b in self.samples if t >= cut)

    def __enter__(self) -> RssSampler:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
