"""Serving snapshots: the follower's current model, published as files a server can load.

Each snapshot is what `deltarec-ckpt export` writes (ckpt/restore/export.py), keyed relative to the
inner `DLRM` a server runs (``"fqn_root": "DLRM"``): a `torch.save` file whose ``"model"``
loads with `DLRM.load_state_dict`, and a DCP directory beside it that `dcp.load` fills,
both tagged with checkpoint id and step and written atomically. Rows are dequantized here
(never in compaction). The newest `keep` snapshots stay; older ones are removed after a
newer one is complete. After a rewind the snapshots of the abandoned branch are removed
(`withdraw`) and the rebuilt checkpoint of the live branch is published at once.

Managed-collision tables come out as an export gives them: by slot in ``"model"``, and keyed by
raw id under ``"mc"`` (`ckpt.restore.export.McTable`), from the mapping the store folded
(`RowStore.mapping_records`) and the rows it holds.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from ckpt.dense.store import DenseRef, DenseStore
from ckpt.follow.store import RowStore
from ckpt.log.markers import Marker
from ckpt.restore.export import assemble, build_export, replicated_tables, write_export
from sharding.managed_collision import McState

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^model-(\d{8})-step-(\d+)\.pt$")


class Snapshot(NamedTuple):
    checkpoint_id: int
    step: int
    path: Path
    dcp_dir: Path | None
    seconds: float


def snapshot_paths(export_dir: Path, checkpoint_id: int, step: int) -> tuple[Path, Path]:
    """`model-<id>-step-<step>.pt` and its DCP directory `model-<id>-step-<step>.dcp`."""
    stem = f"model-{checkpoint_id:08d}-step-{step}"
    return export_dir / f"{stem}.pt", export_dir / f"{stem}.dcp"


def list_snapshots(export_dir: Path) -> list[tuple[int, Path]]:
    """Complete snapshots in `export_dir`, oldest first, as (checkpoint id, file)."""
    if not export_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in export_dir.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def store_mapping(store: RowStore) -> dict[str, list[McState]]:
    """Every managed-collision table's shard states as the store folded them, by table key."""
    out: dict[str, list[McState]] = {}
    for _, record in store.mapping_records():
        assert record.state is not None  # the store gives each shard's state as a full record
        out.setdefault(record.table, []).append(record.state)
    return out


class Publisher:
    """Writes serving snapshots from a `RowStore` and keeps the newest `keep`."""

    def __init__(self, export_dir: Path, dense: DenseStore, *, keep: int, dcp: bool) -> None:
        self.export_dir = export_dir
        self.dense = dense
        self.keep = keep
        self.dcp = dcp

    def publish(self, store: RowStore, marker: Marker, run_id: str) -> Snapshot:
        t0 = time.perf_counter()
        dense_state = self.dense.read(DenseRef.from_json(marker.dense))
        frames = ((True, frame) for frame in store.frames(run_id, marker.checkpoint_id))
        tables = assemble(marker, frames, replicated_tables(marker, dense_state))
        path, dcp_dir = snapshot_paths(self.export_dir, marker.checkpoint_id, marker.step)
        exported = build_export(marker, tables, dense_state, store_mapping(store))
        write_export(exported.for_serving(), path, dcp_dir if self.dcp else None)
        self._trim()
        return Snapshot(marker.checkpoint_id, marker.step, path, dcp_dir if self.dcp else None, time.perf_counter() - t0)

    def withdraw(self, abandoned: Callable[[int], bool]) -> list[int]:
        """Remove the snapshots of checkpoints a rewind abandoned (ckpt/log/catalog.py,
        "Branches"), so that the newest snapshot here is never one of them and the live
        branch's next one is not trimmed in their favour (ids of an abandoned branch can be
        higher than the live branch's until it commits); returns their ids."""
        gone = [cid for cid, path in list_snapshots(self.export_dir) if abandoned(cid)]
        for cid, path in list_snapshots(self.export_dir):
            if cid in gone:
                path.unlink(missing_ok=True)
                shutil.rmtree(path.with_suffix(".dcp"), ignore_errors=True)
        if gone:
            logger.info("removed the serving snapshots of abandoned checkpoints %s from %s", gone, self.export_dir)
        return gone

    def _trim(self) -> None:
        for _, path in list_snapshots(self.export_dir)[: -self.keep]:
            path.unlink(missing_ok=True)
            shutil.rmtree(path.with_suffix(".dcp"), ignore_errors=True)
