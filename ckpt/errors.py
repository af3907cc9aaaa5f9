"""The errors of ckpt/ that more than one stage raises; each stage's own errors live beside it
(`SinkError` in ckpt/stream/sink.py, `MarkerError` in ckpt/log/markers.py)."""

from __future__ import annotations

from common.errors import DeltarecError


class RestoreError(DeltarecError, RuntimeError):
    """The checkpoint cannot be restored as recorded; the message says where and why."""
