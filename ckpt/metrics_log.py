"""Where events go: one JSON record per line in `<run_dir>/metrics.jsonl`, written by one rank,
and optionally TensorBoard scalars. The trainer's metrics and a `ckpt.Checkpointer` of a
user's own loop both write through it (the events: ckpt/events.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from ckpt.events import Event
from common.errors import ConfigError


class MetricsLog:
    """Appends one JSON record per line; only the writing rank opens the file.

    Each record is an event (ckpt/events.py), written as `event.to_record()`. With
    `tensorboard_dir` (`train.tensorboard`), the writing rank also logs every numeric field of
    every event as a TensorBoard scalar of the same name at the event's `step`
    (`Event.scalars`: bools as 0/1; strings, lists and nulls are left to the JSON file). Every rank checks
    that tensorboard is importable, so a missing package stops all ranks with the same
    error instead of leaving the others waiting in a collective."""

    def __init__(self, path: Path, enabled: bool, tensorboard_dir: Path | None = None) -> None:
        self.path = path
        self._file = None
        self._tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ConfigError(
                    "train.tensorboard is true but the tensorboard package is not installed: "
                    "pip install 'deltarec[report]' (or set train.tensorboard=false)"
                ) from exc
            if enabled:
                self._tb = SummaryWriter(log_dir=str(tensorboard_dir))
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)

    def write(self, event: Event) -> None:
        if self._file is not None:
            self._file.write(json.dumps(event.to_record(), sort_keys=True) + "\n")
        if self._tb is not None:
            for name, value in event.scalars().items():
                self._tb.add_scalar(name, value, global_step=event.step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()  # flushes the event file
            self._tb = None
