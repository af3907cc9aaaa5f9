"""A CPU burner: keeps a given share of the cores busy, to price CPU on this machine.

    python -m bench.burner --cores 0.45

Spins for `cores` of every 10 ms on one thread (split over several processes above one
core), and sleeps the rest, until killed. The every-step suite runs the job without
checkpoints beside it, with the share of the cores that checkpointing used: if the job slows
as much as checkpointing slowed it, the cost is that CPU, wherever it is spent.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import time

PERIOD_S = 0.01


def burn(duty: float) -> None:
    """Spin `duty` of every `PERIOD_S`, sleep the rest; never returns."""
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < duty * PERIOD_S:
            pass
        time.sleep(max(0.0, PERIOD_S - (time.perf_counter() - start)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.burner", description=__doc__.split("\n\n")[0])
    p.add_argument("--cores", type=float, required=True, help="the share of the cores to keep busy (1.0: one core)")
    cores = p.parse_args(argv).cores
    n = max(1, math.ceil(cores))
    workers = [multiprocessing.Process(target=burn, args=(cores / n,), daemon=True) for _ in range(n - 1)]
    for w in workers:
        w.start()
    burn(cores / n)


if __name__ == "__main__":
    main()
