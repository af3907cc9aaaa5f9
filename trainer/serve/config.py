"""The job's `serve` section: where `deltarec-serve` listens and what it accepts."""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import ConfigError


@dataclass
class ServeConfig:
    """Limits of the prediction server (trainer/serve/). A request over a limit gets a 4xx or a
    503 and one line naming the limit; the server goes on."""

    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8470  # 0: any free port (the address file says which)
    max_body_bytes: int = 4 << 20  # a larger body: 413
    max_samples: int = 4096  # samples in one request; more: 413
    max_concurrency: int = 4  # requests computing at once
    max_queue: int = 64  # requests waiting for one of those; one more: 503
    threads: int = 1  # torch threads per request: leave the cores to training
    poll_s: float = 0.2  # how often the markers log is read for a new COMMIT
    # readiness fails when the served checkpoint's step is older than this (0: never)
    max_staleness_s: float = 0.0
    metrics: str = ""  # the server's JSON-lines log; "" = <run_dir>/serve.jsonl

    def validate(self, src: str) -> None:
        """Refuse values no server can run with, naming the key."""
        checks = {
            "serve.port": 0 <= self.port <= 65535,
            "serve.max_body_bytes": self.max_body_bytes >= 1024,
            "serve.max_samples": self.max_samples >= 1,
            "serve.max_concurrency": self.max_concurrency >= 1,
            "serve.max_queue": self.max_queue >= 0,
            "serve.threads": self.threads >= 1,
            "serve.poll_s": self.poll_s > 0,
            "serve.max_staleness_s": self.max_staleness_s >= 0,
        }
        for key, ok in checks.items():
            if not ok:
                raise ConfigError(f"{src}: {key} = {getattr(self, key.split('.')[1])!r} is out of range")
        if not self.host:
            raise ConfigError(f"{src}: serve.host is empty")
