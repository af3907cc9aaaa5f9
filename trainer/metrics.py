"""Where training reports go: `<run_dir>/metrics.jsonl` (rank 0) and the progress display.

A tqdm bar when rank 0 writes to a terminal, plain periodic log lines otherwise (CI logs,
slurm output files), chosen by `train.progress`.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

logger = logging.getLogger(__name__)


class MetricsLog:
    """Appends one JSON record per line; only the writing rank opens the file."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self._file = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Progress:
    """Rank 0's view of the loop: a bar on a terminal, log lines elsewhere."""

    def __init__(self, total: int, start: int, mode: str, enabled: bool) -> None:
        use_bar = enabled and (mode == "bar" or (mode == "auto" and sys.stderr.isatty()))
        self.enabled = enabled
        self._bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True) if use_bar else None

    def update(self, step: int, fields: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in fields.items()}, refresh=True)
        else:
            logger.info("step %d %s", step, " ".join(f"{k}={v:.4g}" for k, v in fields.items()))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
