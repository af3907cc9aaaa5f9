"""A bounded request load on a `deltarec-serve`, from its own process (the `serve` suite's client).

    python -m bench.serve_load --url URL --samples-file F --out F [--rate 20] [--big-rate 2]
                               [--big 512] [--clients 2]

Posts one-sample requests at `--rate` per second and `--big`-sample requests at `--big-rate`
per second (each class on a fixed schedule, so a slow answer delays, never multiplies, the
load) until SIGTERM, then writes every answer it got: the class, when it was sent and
answered (wall clock), its status and the checkpoint that computed it. Latency is measured
here, as a client sees it, over loopback.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from pathlib import Path
from typing import NamedTuple

from trainer.serve.client import ServeClient


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server's base URL")
    p.add_argument(
        "--samples-file", type=Path, required=True, help='JSON {"samples": [...]}: the big requests use the first --big'
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rate", type=float, default=20.0, help="one-sample requests per second")
    p.add_argument("--big", type=int, default=512, help="samples in a big request")
    p.add_argument("--big-rate", type=float, default=2.0, help="big requests per second")
    args = p.parse_args(argv)
    samples = json.loads(args.samples_file.read_text())["samples"]
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
