"""What ckpt/ reports as it runs: the records of checkpoints, restores, skips and failures,
and where they go."""

from __future__ import annotations

from typing import Any, Protocol


class MetricsSink(Protocol):
    """Where the manager reports checkpoint outcomes and restores (the trainer's metrics log)."""

    def write(self, record: dict[str, Any]) -> None: ...
