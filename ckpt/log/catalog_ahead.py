"""The markers log read while a restarted job builds its model (docs/design/kafka.md, "Reading the markers log ahead").

A restore's first step, on rank 0, is choosing the checkpoint: reading the markers log from
its newest catalog record on and folding it (ckpt/log/catalog_record.py), milliseconds on a short
log and more on one whose COMMITs name many links. None of it needs the model, so
`open_for_restore` starts it on a thread of its own beside the model's construction, as it
starts the readers' connects; the restore then folds only the records appended since
(`catch_up_recent`), one fetch of a connected reader. What it chooses is what reading the
whole log at that moment would choose: the read ahead is a prefix of the log, and the
catch-up reads the rest at restore time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from typing import NamedTuple

from ckpt.log.catalog import Catalog, catch_up, read_catalog
from ckpt.log.catalog_record import read_recent_catalog
from ckpt.stream.sink import MarkerLog

logger = logging.getLogger(__name__)


class ReadAhead(NamedTuple):
    """The fold read ahead, and how long that took (off the restore's path)."""

    catalog: Catalog
    seconds: float


class CatalogAhead:
    """`read_recent_catalog` of one run on a daemon thread, started now; `take` it once.
    `then` is called with the fold on that thread (the frames read ahead: frames_ahead.py);
    `catch_up`: connect a reader for the restore's catch-up read (rank 0, which chooses)."""

    def __init__(
        self,
        markers: MarkerLog,
        run_id: str,
        where: str,
        timeout_s: float,
        *,
        catch_up: bool = True,
        then: Callable[[Catalog], object] | None = None,
    ) -> None:
        self._markers, self._run_id, self._where, self._timeout_s = markers, run_id, where, timeout_s
        self._catch_up, self._then = catch_up, then
        self._done: Future[ReadAhead] = Future()
        self._lock = threading.Lock()
        self._closed = False
        # a daemon thread: a process that exits does not wait out a broker that is down
        threading.Thread(target=self._run, name="deltarec-markers-ahead", daemon=True).start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._markers.check_reachable(self._timeout_s)
            catalog = read_recent_catalog(self._markers, self._run_id, self._where)
            seconds = time.perf_counter() - t0
            if self._then is not None:
                self._call_then(catalog)
            with self._lock:
                if self._catch_up and not self._closed:  # a reader connected for the catch-up, as for the read itself
                    self._markers.prepare(self._timeout_s)
            self._done.set_result(ReadAhead(catalog, seconds))
        except BaseException as exc:  # noqa: BLE001 - handed to `take`, which reads again without it
            self._done.set_exception(exc)

    def _call_then(self, catalog: Catalog) -> None:
        """`then`, whose failure costs only what it would have saved (the fold stays usable)."""
        try:
            with self._lock:
                if self._closed:
                    return
            assert self._then is not None
            self._then(catalog)
        except Exception as exc:  # noqa: BLE001 - the restore does the same work itself
            logger.debug("work ahead of the restore failed (%s); the restore does it", exc)

    def wait(self) -> None:
        """Until the read is done or failed."""
        wait_for([self._done])

    def take(self) -> ReadAhead | None:
        """The fold once it is done; None when the read failed: the restore then reads the log
        itself and meets the failure, if it persists, with its own message."""
        try:
            return self._done.result()
        except Exception as exc:  # noqa: BLE001 - see above
            logger.debug("markers log read ahead failed (%s); the restore reads it", exc)
            return None

    def close(self) -> None:
        """No reader is connected for the catch-up from now on (the log is closing)."""
        with self._lock:
            self._closed = True


def catch_up_recent(catalog: Catalog, markers: MarkerLog, where: str = "markers") -> Catalog:
    """`catalog`, a `read_recent_catalog` fold, with the records appended since it was read;
    the whole log's fold when one of them chains through a link its catalog record left out
    (as `read_recent_catalog` answers then)."""
    catalog = catch_up(catalog, markers, where)
    if catalog.exact:
        return catalog
    logger.info(
        "%s: a checkpoint committed after the read ahead chains through a link the catalog record "
        "left out; reading the whole log",
        where,
    )
    return read_catalog(markers, catalog.run_id, where)
