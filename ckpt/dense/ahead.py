"""The dense file of the checkpoint a restarted job will most likely restore, loaded while the
job builds its model (docs/design/kafka.md, "Loading the dense file ahead").

Loading a dense file is mostly `torch.load(weights_only=True)`, a Python unpickler, whose CPU a
restore would otherwise spend beside its rows, on the core that decodes them (its cost:
docs/BENCHMARKS.md, "Measured outside the suites"). Once the markers log is read ahead
(ckpt/log/catalog_ahead.py) the checkpoint to restore, and so its dense file, is known but for
what is appended since: `start` loads that file on a thread of its own, with `DenseStore.read`'s
checks (sha256, weights only). The restore `take`s it when it reads the same file (the same
path, sha256 and size); otherwise, or when the load ahead failed, it reads the file itself and
meets any failure with its own message.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

from ckpt.dense.store import DenseRef, DenseStore

logger = logging.getLogger(__name__)


class DenseAhead:
    """One dense file loaded ahead of the restore that reads it, taken at most once."""

    def __init__(self, store: DenseStore) -> None:
        self._store = store
        self._started: tuple[DenseRef, Future[dict[str, Any]]] | None = None  # the file and its load
        self._lock = threading.Lock()
        self._taken = False

    def start(self, ref: DenseRef) -> None:
        """Load `ref` on a daemon thread (a process that exits does not wait for it); once."""
        with self._lock:
            if self._started is not None or self._taken:
                return
            done: Future[dict[str, Any]] = Future()
            self._started = (ref, done)
        threading.Thread(target=self._load, args=(ref, done), name="deltarec-dense-ahead", daemon=True).start()

    def _load(self, ref: DenseRef, done: Future[dict[str, Any]]) -> None:
        try:
            done.set_result(self._store.read(ref))
        except BaseException as exc:  # noqa: BLE001 - handed to `take`, which gives None: the restore reads again
            done.set_exception(exc)

    def take(self, ref: DenseRef) -> dict[str, Any] | None:
        """The state loaded ahead when it is `ref`'s (waiting for the load if it is still running);
        None when none was started (nor will be after this), another file was, or the load failed.
        Later calls: None."""
        with self._lock:  # the state is handed over once, and not kept here
            started, self._started, self._taken = self._started, None, True
        if started is None or started[0] != ref:
            return None
        done = started[1]
        try:
            return done.result()
        except Exception as exc:  # noqa: BLE001 - the restore's own read meets it with its own message
            logger.debug("dense file %s loaded ahead failed (%s); the restore reads it", ref.path, exc)
            return None
