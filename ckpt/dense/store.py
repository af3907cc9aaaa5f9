"""The dense half of a checkpoint: written by rank 0, atomically, with its sha256.

Holds the dense parameters (MLPs and data-parallel tables), the dense optimizer state,
every rank's reader state, RNG states, the step and the config digest, its tensors packed into
one per dtype (ckpt/dense/packing.py). Written to a
temporary file, fsynced, renamed into place and the directory fsynced, so a crash leaves
either the old file set or the new one. Loading verifies the sha256 first and uses
`torch.load(weights_only=True)`, which never unpickles arbitrary objects. A dense file is
never replaced: checkpoint ids never repeat within a run directory (docs/design/failures.md, "Lost stream, history present").

The store also keeps the run's local history: `commits.jsonl`, one line per COMMIT marker rank 0
appended (id, step, where the stream is). A stream that was lost (a broker restarted empty, a
wrong address, an emptied filesystem sink) is then told apart from a run that never committed.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ckpt.dense.packing import pack, unpack
from ckpt.faults import maybe_fail_dense_write
from common.errors import DeltarecError
from common.files import fsync_dir


class DenseStoreError(DeltarecError, RuntimeError):
    """The dense file is missing, does not match the sha256 its marker recorded or holds pickled
    objects a weights-only load refuses, or a write would replace an existing one."""


JOURNAL = "commits.jsonl"
_DENSE_NAME = re.compile(r"dense-(\d{8,})\.pt")


class CommitRecord(NamedTuple):
    """One line of the local history: a COMMIT marker rank 0 appended."""

    checkpoint_id: int
    step: int
    where: str  # the stream the marker went to (a Kafka bootstrap + run, or a directory)
    unix: float


class DenseHistory(NamedTuple):
    """What a run directory says about earlier checkpoints, whatever the stream says."""

    newest_file_id: int  # highest checkpoint id with a dense file (committed or not); 0: none
    commits: list[CommitRecord]

    @property
    def newest_id(self) -> int:
        return max([self.newest_file_id, *(c.checkpoint_id for c in self.commits)])


@dataclass(frozen=True)
class DenseRef:
    """Where a dense file is and what it must hash to (recorded in the COMMIT marker)."""

    path: str
    sha256: str
    bytes: int

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "bytes": self.bytes}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DenseRef:
        return cls(str(d["path"]), str(d["sha256"]), int(d["bytes"]))


class DenseStore:
    """Dense files under one directory (a shared filesystem when ranks span nodes)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path_for(self, checkpoint_id: int) -> Path:
        return self.root / f"dense-{checkpoint_id:08d}.pt"

    def survivor_path(self, checkpoint_id: int, rank: int) -> Path:
        return self.root / f"survivor-{checkpoint_id:08d}-r{rank}.pt"

    def write(self, checkpoint_id: int, state: dict[str, Any]) -> DenseRef:
        """Serialise `state` (tensors, numbers, strings, lists, dicts) durably."""
        return self._write_new_file(self.path_for(checkpoint_id), checkpoint_id, state)

    def write_survivor(self, checkpoint_id: int, rank: int, state: dict[str, Any]) -> DenseRef:
        """The dense file of a surviving rank's snapshot (ckpt/recovery/survivor.py), as durably."""
        return self._write_new_file(self.survivor_path(checkpoint_id, rank), checkpoint_id, state)

    def _write_new_file(self, final: Path, checkpoint_id: int, state: dict[str, Any]) -> DenseRef:
        """Write `state` to `final` durably (temporary file, fsync, link, directory fsync); a
        file already at `final` is never replaced."""
        buf = io.BytesIO()
        torch.save(pack(state), buf)
        data = buf.getvalue()
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                maybe_fail_dense_write(checkpoint_id, tmp)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, final)  # atomic and never replaces: an existing file raises
            fsync_dir(final.parent)
        except FileExistsError:
            raise DenseStoreError(
                f"dense file {final} already exists: checkpoint ids never repeat in a run directory, "
                f"so this would overwrite an earlier checkpoint"
            ) from None
        except OSError as exc:  # a full disk, a permission error: this checkpoint fails, nothing older
            raise DenseStoreError(
                f"dense file {final}: cannot write it: {exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)
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
        try:
            saved = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as exc:
            raise DenseStoreError(
                f"dense file {path}: refused: it holds pickled objects that are not tensors or plain data "
                f"({_unpickling_reason(exc)}); deltarec loads dense files weights-only and never runs code from them"
            ) from None
        try:
            return unpack(saved)
        except ValueError as exc:  # packed by a newer deltarec
            raise DenseStoreError(f"dense file {path}: {exc}") from None

    def record_commit(self, record: CommitRecord) -> None:
        """Append a COMMIT to the local history, durably."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / JOURNAL, "a", encoding="utf-8") as f:
            f.write(json.dumps(record._asdict(), sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def history(self) -> DenseHistory:
        """Dense files and recorded COMMITs of this directory. A torn or damaged journal line (a
        crash mid-append) is skipped: the dense files still count."""
        if not self.root.is_dir():
            return DenseHistory(0, [])
        ids = [int(m.group(1)) for p in self.root.iterdir() if (m := _DENSE_NAME.fullmatch(p.name))]
        commits = []
        journal = self.root / JOURNAL
        if journal.is_file():
            for line in journal.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    commits.append(CommitRecord(**json.loads(line)))
                except (ValueError, TypeError):
                    continue
        return DenseHistory(max(ids, default=0), commits)

    def delete(self, checkpoint_ids: list[int]) -> None:
        """Remove the dense files of dropped checkpoints (gc)."""
        for cid in checkpoint_ids:
            self.path_for(cid).unlink(missing_ok=True)

    def delete_survivor(self, checkpoint_id: int, rank: int) -> None:
        """Remove the dense file of a survivor snapshot no restore can use any more (gc)."""
        self.survivor_path(checkpoint_id, rank).unlink(missing_ok=True)


def unloadable_reason(state: Any) -> str:
    """Why `state` could not come back from a dense file ("" when it can): torch.save fails on
    it, or the weights-only load refuses what it pickled (a numpy array, a class of the user's)."""
    buf = io.BytesIO()
    try:
        torch.save(state, buf)
    except Exception as exc:  # noqa: BLE001 - pickling fails with whatever the state's objects raise
        return f"torch.save cannot write it: {exc}"
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except pickle.UnpicklingError as exc:
        return f"it holds objects a weights-only load refuses ({_unpickling_reason(exc)})"
    return ""


def _unpickling_reason(exc: pickle.UnpicklingError) -> str:
    """What torch's weights-only loader refused (`GLOBAL posix.system`, `Unsupported operand
    149`), without the rest of its many-line message, whose advice to retry with
    `weights_only=False` is exactly what must not be done with such a file."""
    found = re.search(r"GLOBAL [\w.]+|Unsupported operand \S+", str(exc))
    return found.group(0) if found else "not a weights-only file"
