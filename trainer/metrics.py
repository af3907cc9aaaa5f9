"""Where training reports go: `<run_dir>/metrics.jsonl` (rank 0) and the progress display.

A tqdm bar when rank 0 writes to a terminal, plain periodic log lines otherwise (CI logs,
slurm output files), chosen by `train.progress`.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from tqdm import tqdm

from ckpt.events import Event
from common.errors import ConfigError

logger = logging.getLogger(__name__)


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
                    "pip install tensorboard (or set train.tensorboard=false)"
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


class Progress:
    """Rank 0's view of the loop: a bar on a terminal, a log line per update elsewhere
    (`train.progress`: auto, bar or log). Other ranks show nothing."""

    def __init__(self, total: int, start: int, mode: str, enabled: bool) -> None:
        use_bar = enabled and (mode == "bar" or (mode == "auto" and sys.stderr.isatty()))
        self.enabled = enabled
        self.total = total
        self._bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr) if use_bar else None

    @staticmethod
    def format_fields(fields: dict[str, float]) -> str:
        """`{"loss": 0.43217, "samples/s": 38012.4}` -> `loss 0.4322, samples/s 38,012`."""
        return ", ".join(f"{k} {v:,.0f}" if abs(v) >= 10_000 else f"{k} {v:.4g}" for k, v in fields.items())

    def advance(self, step: int) -> None:
        """Move the bar to `step` (every step; tqdm limits its own redraws). Log mode waits for `update`."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def update(self, step: int, fields: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix_str(self.format_fields(fields), refresh=True)
        else:
            logger.info("step %d/%d: %s", step, self.total, self.format_fields(fields))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
