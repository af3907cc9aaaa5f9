"""Fencing: one follower of a run compacts; any others stand by.

The lease lives in the markers log itself, so it needs nothing a broker or filesystem
lacks: a follower appends a `claim`, renews it every third of `lease_s`, and appends a
`release` when it stops cleanly. Who holds the lease is decided by folding the log in
order (`ckpt.log.catalog.Catalog`): a claim is accepted when nobody holds the lease, when its
holder released it, or when the holder's last renewal is older than its `lease_s` at the
claim's time stamp. Every accepted claim starts a new epoch.

A COMPACTED marker counts only if its follower held the lease at that point of the log,
and the follower writes the compacted rows into a generation named by its epoch, so a
follower that lost the lease (it was stopped, then woke up) can neither overwrite the
holder's rows nor get its own baseline used.
"""

from __future__ import annotations

import logging
import time

from ckpt.log.catalog import Catalog, catch_up
from ckpt.log.markers import LeaseRecord, encode_marker
from ckpt.stream.sink import MarkerLog

logger = logging.getLogger(__name__)


class LeaseKeeper:
    """This follower's side of the lease: claim when free, renew while held, release at exit."""

    def __init__(self, catalog: Catalog, markers: MarkerLog, *, follower_id: str, lease_s: float) -> None:
        self.catalog = catalog
        self.markers = markers
        self.follower_id = follower_id
        self.lease_s = lease_s
        self._renewed = 0.0  # monotonic time of our last claim or renewal

    def _append(self, event: str) -> None:
        record = LeaseRecord(
            kind="lease",
            run_id=self.catalog.run_id,
            follower=self.follower_id,
            event=event,
            lease_s=self.lease_s,
            created_unix=time.time(),
        )
        self.markers.append_marker(encode_marker(record))
        self._renewed = time.monotonic()

    @property
    def held(self) -> bool:
        return self.catalog.holds(self.follower_id)

    @property
    def epoch(self) -> int:
        assert self.held and self.catalog.lease is not None
        return self.catalog.lease.epoch

    def tend(self) -> bool:
        """Keep or try to get the lease; True when this follower holds it afterwards.
        Reads the log's new records first (the caller's catalog is updated)."""
        catch_up(self.catalog, self.markers)
        lease = self.catalog.lease
        if self.held:
            if time.monotonic() - self._renewed >= self.lease_s / 3:
                self._append("renew")
                catch_up(self.catalog, self.markers)
        elif lease is None or lease.free_at(time.time()):
            self._append("claim")
            catch_up(self.catalog, self.markers)
            if self.held:
                logger.info("holding the compaction lease (epoch %d)", self.epoch)
        return self.held

    def release(self) -> None:
        """Give the lease up (clean exit), so the next follower need not wait `lease_s`."""
        if self.held:
            self._append("release")
