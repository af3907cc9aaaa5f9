"""Which checkpoint a restore reads, agreed by every rank before any of them reads a row.

Rank 0 checks that the broker answers, reads the markers log (from its newest catalog record
on, ckpt/log/catalog_record.py; read while the model was built when `CatalogAhead` did, and
caught up with what was appended since) and the run directory's journal of COMMITs, and
chooses what `ckpt.restore.resume` asks for, each checkpoint with its cheapest complete chain
(docs/design/kafka.md, "Reading the markers log ahead"). Only the chosen checkpoint is broadcast: the older ones carry every
chain's frame index, so they go to the other ranks only once the chosen one failed
(`ResumeChoice.tries`). A start that must be refused (a lost stream, an id no chain
restores) raises the same `RestoreError` on every rank before anything is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import torch.distributed as dist

from ckpt.config import RestoreConfig
from ckpt.dense.store import DenseHistory, DenseStore
from ckpt.log.backend import Backend
from ckpt.log.catalog import Catalog, read_catalog, within
from ckpt.log.catalog_ahead import catch_up_recent
from ckpt.log.catalog_record import read_recent_catalog
from ckpt.log.markers import Marker, SurvivorRecord
from ckpt.recovery.lost_samples import estimate_mtbf
from ckpt.recovery.partial import usable_survivors
from ckpt.types import RestoreError
from common.errors import DeltarecError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class _Refused(NamedTuple):
    """Rank 0's refusal, broadcast in place of what it was reading."""

    reason: str


def from_rank0(read: Callable[[], _T], refused: type[DeltarecError] = RestoreError) -> _T:
    """`read()` on rank 0, its result on every rank; its `DeltarecError` raised on every rank
    (none waits at the broadcast): itself on rank 0, a `refused` with its message on the others."""
    box: list[Any] = [None]
    failure: DeltarecError | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = read()
        except DeltarecError as exc:
            failure = exc
            box[0] = _Refused(str(exc))
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], _Refused):
        raise failure or refused(box[0].reason)
    return box[0]


class _Candidates(NamedTuple):
    """What rank 0 reads of the markers log and the run directory at start, for every rank."""

    newest: list[Marker]  # the checkpoint to restore (none: start fresh); older ones stay on rank 0
    newest_id: int  # the newest checkpoint id the markers log or the run directory knows
    survivors: list[SurvivorRecord]  # usable with `newest` (ckpt/recovery/partial.py)
    mtbf_s: float | None  # estimated from the run's attempts (ckpt/recovery/lost_samples.py)
    summarized: bool  # read from a catalog record on: older checkpoints are in the rest of the log
    markers_read: int  # records of the markers log decoded


class ResumeChoice:
    """The checkpoint one job attempt resumes from, and the ones to fall back to.

    `newest()` first (every rank, together), then `tries()`. What every rank knows after
    `newest()`: `newest_id` (checkpoint ids of this attempt start after it, whether it
    restores or starts over), `survivors`, `mtbf_s` and `markers_read`; rank 0 alone knows
    `markers_ahead_s` and the fallbacks."""

    def __init__(
        self,
        cfg: RestoreConfig,
        *,
        run_id: str,
        backend: Backend,
        dense: DenseStore,
        partial: bool,
        connect_timeout_s: float,
    ) -> None:
        assert run_id, "CkptConfig.resolved() fills the run id"
        self.cfg = cfg
        self.run_id = run_id
        self.partial = partial  # `ckpt.recovery.mode: partial`: survivors' snapshots count
        self.connect_timeout_s = connect_timeout_s
        self.backend = backend
        self.dense = dense
        self.newest_id = 0  # newest checkpoint id in the markers log or the run directory (ids never repeat)
        self.survivors: list[SurvivorRecord] = []
        self.mtbf_s: float | None = None
        self.markers_read = 0  # records of the markers log rank 0 decoded to choose
        self.markers_ahead_s = 0.0  # rank 0: reading them while the model was built (`CatalogAhead`)
        self._summarized = False  # chosen from a catalog record on (`_older_than`)
        self._older: list[Marker] = []  # rank 0: the checkpoints to fall back to, newest first
        self._history = DenseHistory(0, [])  # rank 0: what the run directory remembers

    def newest(self, on_chosen: Callable[[Catalog, int], None]) -> list[Marker]:
        """The COMMIT marker to restore, with its cheapest chain ([] to start fresh), on every
        rank. Rank 0 reads and chooses, then calls `on_chosen` with what it read and the id
        chosen (0: a fresh start; the checkpointer announces the attempt with them, which makes the
        checkpoints after the chosen one an abandoned branch: ckpt/log/catalog.py, "Branches")
        unless the start is refused. With `resume=none` only `newest_id` matters."""
        found = from_rank0(lambda: self._read(on_chosen))
        self.newest_id, self.survivors, self.mtbf_s, self._summarized, self.markers_read = (
            found.newest_id,
            found.survivors,
            found.mtbf_s,
            found.summarized,
            found.markers_read,
        )
        return found.newest

    def tries(self, newest: Marker) -> Iterator[tuple[Marker, list[SurvivorRecord]]]:
        """What to restore, in order, each with the survivor snapshots it takes: the chosen
        checkpoint (with survivors first, if any), then the older ones. Every rank runs this
        in step (a try fails on all ranks or none), and the older checkpoints come from rank 0
        only once the chosen one failed."""
        if self.survivors:  # survivor snapshots that fail to read: the same checkpoint without them
            yield newest, self.survivors
        yield newest, []
        tried = newest.checkpoint_id
        for marker in from_rank0(lambda: self._older):
            tried = marker.checkpoint_id
            yield marker, []
        if self._summarized:  # every checkpoint a catalog record kept failed: the rest of the log has older ones
            yield from ((m, []) for m in from_rank0(lambda: self._older_than(tried)))

    def _read(self, on_chosen: Callable[[Catalog, int], None]) -> _Candidates:
        """Rank 0's part of `newest`: the broker answers (bounded), the markers log and the run
        directory are read and the checkpoint chosen, or the start refused before anything is
        written."""
        self.backend.markers.check_reachable(self.connect_timeout_s)
        history = self.dense.history()
        catalog = self._recent_catalog()
        ordered = self._choose(catalog, history)
        on_chosen(catalog, ordered[0].checkpoint_id if ordered else 0)
        survivors = usable_survivors(catalog, ordered[0]) if ordered and self.partial else []
        mtbf = estimate_mtbf([a.created_unix for a in catalog.trainer_attempts], time.time())
        self._older = ordered[1:]
        self._history = history
        return _Candidates(
            ordered[:1], max(catalog.newest_id, history.newest_id), survivors, mtbf, catalog.summary is not None, catalog.read
        )

    def _recent_catalog(self) -> Catalog:
        """The markers log from its newest catalog record on when that has the checkpoint
        `ckpt.restore.resume` asks for, else the whole log: read while the model was built
        (`CatalogAhead`) and caught up with what was appended since, or read now."""
        markers, where = self.backend.markers, self.backend.where
        ahead = self.backend.ahead.take() if self.backend.ahead is not None else None
        self.backend.ahead = None
        if ahead is not None:
            self.markers_ahead_s = ahead.seconds
            catalog = catch_up_recent(ahead.catalog, markers, where)
        else:
            catalog = read_recent_catalog(markers, self.run_id, where)
        if catalog.summary is None or self.cfg.resume == "none":
            return catalog
        found = {m.checkpoint_id for m in catalog.restorable(abandoned=self.cfg.resume != "latest")}
        if found if self.cfg.resume == "latest" else int(self.cfg.resume) in found:
            return catalog
        return read_catalog(markers, self.run_id, where)

    def _older_than(self, than: int) -> list[Marker]:
        """Rank 0: the checkpoints older than `than` to fall back to, from the whole markers log."""
        catalog = read_catalog(self.backend.markers, self.run_id, self.backend.where)
        return [m for m in self._choose(catalog, self._history) if m.checkpoint_id < than]

    def _choose(self, catalog: Catalog, history: DenseHistory) -> list[Marker]:
        """The checkpoints `ckpt.restore.resume` asks for, newest first, each with its cheapest complete
        chain: [] to start fresh; a `RestoreError` when the start must be refused. `latest`
        chooses from the run's live branch only (after a rewind, never the checkpoints the
        rewind abandoned); an id may name an abandoned checkpoint, and falls back along its
        own history."""
        if self.cfg.resume == "none":
            return []
        if self.cfg.resume == "latest":
            found = catalog.restorable()
            if not found and history.commits and not catalog.restorable(abandoned=True):
                raise RestoreError(self._lost_stream(history))
            return sorted(found, key=lambda m: m.checkpoint_id, reverse=True)
        chosen = int(self.cfg.resume)
        found = catalog.restorable(abandoned=True)
        ordered = [m for m in found if m.checkpoint_id == chosen]
        history_of = catalog.branch_of(chosen)
        older = sorted(
            (m for m in found if m.checkpoint_id < chosen and within(history_of, m.checkpoint_id)),
            key=lambda m: m.checkpoint_id,
            reverse=True,
        )
        if not ordered:
            why = (
                f"checkpoint {chosen} of run {self.run_id}: every chain that restores it reads a generation "
                f"deltarec-ckpt gc dropped ({sorted(catalog.dropped)}); `deltarec-ckpt list` shows what is left"
                if chosen in catalog.commits
                else f"checkpoint {chosen} of run {self.run_id} has no COMMIT marker in {self.backend.where}"
            )
            if self.cfg.on_corrupt == "fail" or not older:
                raise RestoreError(
                    why + (" (or set ckpt.restore.on_corrupt=previous to fall back to an older checkpoint)" if older else "")
                )
            logger.warning("%s; falling back to the previous checkpoint", why)
        return ordered + older

    def _lost_stream(self, history: DenseHistory) -> str:
        """The one-line refusal of `resume=latest` when the run directory has committed
        checkpoints that the stream does not."""
        newest = max(history.commits, key=lambda c: c.checkpoint_id)
        return (
            f"run {self.run_id}: {self.dense.root} records {len(history.commits)} committed checkpoint(s) "
            f"(newest {newest.checkpoint_id} at step {newest.step}, in {newest.where or 'an unnamed stream'}) but "
            f"{self.backend.where} has no COMMIT marker of this run: the stream was lost or this job points at "
            f"another one. Point ckpt.sink.kind / ckpt.sink.bootstrap_servers / ckpt.sink.fs_root at the stream that holds them, "
            f"or set ckpt.restore.resume=none to start over (earlier files are kept)"
        )
