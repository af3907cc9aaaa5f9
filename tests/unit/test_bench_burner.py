"""`bench.burner` keeps the share of the cores it is given busy, and no more (the every-step
suite's calibration prices CPU with it)."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.cpu import process_cpu_s
from tests.conftest import REPO


def test_the_burner_spends_about_its_share_of_a_core() -> None:
    cores = 0.3
    burner = subprocess.Popen([sys.executable, "-m", "bench.burner", "--cores", str(cores)], cwd=REPO)
    try:
        time.sleep(1.0)  # its interpreter's start is not part of the share
        cpu0, t0 = process_cpu_s(burner.pid), time.monotonic()
        time.sleep(2.0)
        cpu1, wall = process_cpu_s(burner.pid), time.monotonic() - t0
    finally:
        burner.kill()
        burner.wait()
    assert cpu0 is not None and cpu1 is not None
    share = (cpu1 - cpu0) / wall
    # never more than asked (a tick of /proc's 10 ms either side); less only when the cores are busy
    assert 0.05 < share <= cores + 0.05, share
