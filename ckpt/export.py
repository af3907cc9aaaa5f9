"""Export a checkpoint as the full, unsharded model.

One dense tensor per table (weights [rows, dim], optimizer state [rows] or [rows, dim];
row-wise state written by column-wise shards gets one tensor per column shard, suffixed
`@c<col>`), plus the dense state. Written as a `torch.save` file and, optionally, a
`torch.distributed.checkpoint` directory, so other tools load it without deltarec.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

from ckpt.dense_store import DenseRef, DenseStore
from ckpt.markers import Marker
from ckpt.restore import RestoreError, decode_rows, iter_chain_frames
from ckpt.sink import FrameSource


def assemble(
    marker: Marker, source: FrameSource, run_id: str, locate: Callable[[int, int, int], str]
) -> dict[str, dict[str, torch.Tensor]]:
    """Replay the whole chain into full tables: {table: {"weight": ..., "<state>": ...}}."""
    if not marker.tables:
        raise RestoreError(f"checkpoint {marker.checkpoint_id}: its marker has no table shapes (written by an older deltarec)")
    tables: dict[str, dict[str, torch.Tensor]] = {
        name: {"weight": torch.zeros(rows, dim)} for name, (rows, dim) in marker.tables.items()
    }
    seen = {name: torch.zeros(rows, dim, dtype=torch.bool) for name, (rows, dim) in marker.tables.items()}
    for link, frame in iter_chain_frames(marker, source, run_id, locate):
        if frame.table not in tables:
            raise RestoreError(f"frame of unknown table {frame.table!r} in checkpoint {link.checkpoint_id}")
        weights, optim = decode_rows(frame)
        t = tables[frame.table]
        ids, c0, c1 = frame.row_ids, frame.col_offset, frame.col_offset + frame.dim
        t["weight"][ids, c0:c1] = weights
        if link.full:
            seen[frame.table][ids, c0:c1] = True
        rows = t["weight"].shape[0]
        for name, values in optim.items():
            if values.shape[1] == 1:
                key = name if frame.dim == t["weight"].shape[1] else f"{name}@c{c0}"
                t.setdefault(key, torch.zeros(rows))[ids] = values[:, 0]
            else:
                t.setdefault(name, torch.zeros(rows, t["weight"].shape[1]))[ids, c0:c1] = values
    for name, mask in seen.items():
        if not bool(mask.all()):
            raise RestoreError(f"checkpoint {marker.checkpoint_id}: table {name} is not fully covered by its base checkpoint")
    return tables


def export(marker: Marker, source: FrameSource, dense: DenseStore, run_id: str,
           locate: Callable[[int, int, int], str], out: Path, dcp_dir: Path | None = None) -> dict[str, Any]:
    """Write the unsharded model of `marker` to `out` (and `dcp_dir`); returns what was written."""
    tables = assemble(marker, source, run_id, locate)
    dense_state = dense.read(DenseRef.from_json(marker.dense))
    model = {
        "checkpoint_id": marker.checkpoint_id,
        "step": marker.step,
        "tables": tables,
        "dense": {"params": dense_state["params"], "buffers": dense_state["buffers"]},
        "dense_optimizer": dense_state["optimizer"],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model, out)
    if dcp_dir is not None:
        flat = {f"tables.{t}.{k}": v for t, d in tables.items() for k, v in d.items()}
        flat.update({f"dense.{k}": v for k, v in dense_state["params"].items()})
        dcp.save(flat, checkpoint_id=str(dcp_dir))
    return model
