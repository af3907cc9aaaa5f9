"""Where training reports go: `<run_dir>/metrics.jsonl` (rank 0, `ckpt.events.MetricsLog`) and the progress display.

A tqdm bar when rank 0 writes to a terminal, plain periodic log lines otherwise (CI logs,
slurm output files), chosen by `train.progress`.
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

from ckpt.events import MetricsLog

__all__ = ["MetricsLog", "Progress"]

logger = logging.getLogger(__name__)


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
