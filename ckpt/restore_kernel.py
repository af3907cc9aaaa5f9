"""The restore's fused replay of one frame into one CPU shard: choose, decode and copy in one pass.

The torch path (:class:`ckpt.restore._Replay`) handles a frame in about ten tensor operations:
the rows inside the shard, the rows no later link wrote, a decode into a temporary, a scatter
of the weights and one of each optimizer state. Each is a pass over the frame's rows with its
own temporaries, and for scattered rows the passes, not the bytes, dominate: the kernel decodes
each kept row straight into its shard row. Tool: numba, as for the adaptive encoder
(:mod:`ckpt.quant.adaptive_kernel`): a wheel, no compiler at install, cached machine code.

It covers what a restore meets in practice: CPU shards, a frame holding exactly the shard's
columns, weights in fp32 or in the N-bit layout with fp16 scale and bias (asym2-4, adaptive2-4),
optimizer states in fp32. Everything else (GPU shards, another column split, the other codecs)
takes the torch path, which stays the reference: both write the same bits (tested).

The numba code (:mod:`ckpt.restore_numba`) is imported by :func:`load`; the checkpoint manager
loads it while the job is built, before a restore is timed, as it connects its readers.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch

from ckpt.frames import Frame
from ckpt.quant import get_codec
from sharding.shard_views import ShardView

__all__ = ["AVAILABLE", "FusedReplay", "Written", "load"]

# optional: without numba every frame takes the torch path
AVAILABLE = importlib.util.find_spec("numba") is not None
_RAW = 0  # weights layout: fp32 rows copied as they are (else: the N-bit codes' width)
_FP32 = get_codec("fp32").code


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernel, or None without numba. The first call in a process imports numba and
    loads the kernel's cached machine code (compiling it when there is none), about 0.5 s here."""
    if not AVAILABLE:
        return None
    from ckpt import restore_numba as k  # noqa: PLC0415 - numba's import is paid on first use only

    # numba compiles per argument types: these are a restore's (C-contiguous arrays, int64 indices)
    ids, i32, u8, f32 = np.zeros(1, np.int64), np.zeros(1, np.int32), np.zeros((1, 4), np.uint8), np.zeros((1, 1), np.float32)
    k.select_rows(ids, -1, 1, 0, 1, i32, 0, i32.copy(), 1, ids.copy(), ids.copy())
    k.nbit_rows_into(np.zeros((1, 5), np.uint8), 4, 1, ids, ids, 1, f32)
    k.raw_rows_into(u8, ids, ids, 1, u8.copy())
    return k


def _weights_layout(encoding: int) -> int | None:
    codec = get_codec(encoding)
    family = getattr(codec, "family", "")
    if codec.code == _FP32:
        return _RAW
    if family in ("asym", "adaptive") and codec.bits < 8:
        return codec.bits
    return None


def _as_u8_rows(t: torch.Tensor) -> np.ndarray:
    """A contiguous float32 shard tensor ([rows] or [rows, cols]) as uint8 [rows, row bytes],
    sharing its memory."""
    return t.view(t.shape[0], -1).view(torch.uint8).numpy()


class Written(NamedTuple):
    """What one fused write did."""

    kept: int  # rows written
    inside: int  # rows of the frame in the shard
    decode_s: float  # seconds spent decoding the weights into the shard


class FusedReplay:
    """One restore's use of the kernel: which (frame, shard) pairs it takes, and the writes."""

    def __init__(self, kernel: ModuleType) -> None:
        self.k = kernel
        self._src = np.empty(0, np.int64)  # scratch: positions in the frame of the rows kept ...
        self._dst = np.empty(0, np.int64)  # ... and their local rows in the shard
        self._no_ids = np.empty(0, np.int64)

    def fits(self, frame: Frame, s: ShardView) -> bool:
        """Whether the kernel writes this frame into shard `s` (else the torch path does)."""
        if frame.col_offset != s.col_offset or frame.dim != s.num_cols:
            return False
        if _weights_layout(frame.encoding) is None or not _host_f32(s.weight):
            return False
        widths = {o.name: o.rows.shape[1] for o in frame.optim if o.encoding == _FP32}
        for name, state in s.optimizer_states.items():
            if name not in widths or not _host_f32(state):
                return False  # the torch path names a missing state, or handles the encoding
            if widths[name] != (4 if state.dim() == 1 else 4 * frame.dim):  # row-wise, or one value a column
                return False
        return True

    def write(self, frame: Frame, s: ShardView, link: int, written: np.ndarray, covered: np.ndarray,
              cols: int) -> Written:
        """Write the frame's rows that no later link than `link` wrote into `s` (marking them in
        `written`, and counting `cols` columns of every row in the shard in `covered`)."""
        n = frame.row_count
        if self._src.shape[0] < n:
            self._src, self._dst = np.empty(n, np.int64), np.empty(n, np.int64)
        first = frame.first_row if frame.first_row is not None else -1
        ids = self._no_ids if first >= 0 else frame.row_ids.numpy()
        kept, inside = self.k.select_rows(ids, first, n, s.row_offset, s.num_rows, written, link, covered, cols,
                                          self._src, self._dst)
        if not kept:
            return Written(0, inside, 0.0)
        t = time.perf_counter()
        layout = _weights_layout(frame.encoding)
        payload = frame.payload.numpy()
        if layout == _RAW:
            self.k.raw_rows_into(payload, self._src, self._dst, kept, _as_u8_rows(s.weight))
        else:
            self.k.nbit_rows_into(payload, layout, frame.dim, self._src, self._dst, kept, s.weight.numpy())
        decode_s = time.perf_counter() - t
        rows = {o.name: o.rows for o in frame.optim}
        for name, state in s.optimizer_states.items():
            self.k.raw_rows_into(rows[name].numpy(), self._src, self._dst, kept, _as_u8_rows(state))
        return Written(kept, inside, decode_s)


def _host_f32(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
