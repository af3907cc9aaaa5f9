"""The dense half of a checkpoint: written by rank 0, atomically, with its sha256.

Holds the dense parameters (MLPs and data-parallel tables), the dense optimizer state,
every rank's reader state, RNG states, the step and the config digest. Written to a
temporary file, fsynced, renamed into place and the directory fsynced, so a crash leaves
either the old file set or the new one. Loading verifies the sha256 first and uses
`torch.load(weights_only=True)`, which never unpickles arbitrary objects.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.errors import DeltarecError


class DenseStoreError(DeltarecError, RuntimeError):
    """The dense file is missing or does not match the sha256 its marker recorded."""


@dataclass(frozen=True)
class DenseRef:
    """Where a dense file is and what it must hash to (recorded in the COMMIT marker)."""

    path: str
    sha256: str
    bytes: int

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "bytes": self.bytes}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DenseRef":
        return cls(str(d["path"]), str(d["sha256"]), int(d["bytes"]))


class DenseStore:
    """Dense files under one directory (a shared filesystem when ranks span nodes)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path_for(self, checkpoint_id: int) -> Path:
        return self.root / f"dense-{checkpoint_id:08d}.pt"

    def write(self, checkpoint_id: int, state: dict[str, Any]) -> DenseRef:
        """Serialise `state` (tensors, numbers, strings, lists, dicts) durably."""
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        final = self.path_for(checkpoint_id)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return DenseRef(str(final), hashlib.sha256(data).hexdigest(), len(data))

    def read(self, ref: DenseRef) -> dict[str, Any]:
        """Load a dense file after checking its sha256; never unpickles code."""
        path = Path(ref.path)
        if not path.is_file():
            raise DenseStoreError(f"dense file {path} is missing (dense store {self.root})")
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != ref.sha256:
            raise DenseStoreError(f"dense file {path}: sha256 {digest[:12]}… does not match its marker ({ref.sha256[:12]}…)")
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")

    def delete(self, checkpoint_ids: list[int]) -> None:
        """Remove the dense files of dropped checkpoints (gc)."""
        for cid in checkpoint_ids:
            self.path_for(cid).unlink(missing_ok=True)
