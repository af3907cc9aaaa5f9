"""The restore's fused replay of one frame into one shard: choose, decode and copy in one pass.

The torch path (:class:`ckpt.restore.replay._Replay`) handles a frame in about ten tensor operations:
the rows inside the shard, the rows no later link wrote, a decode into a temporary, a scatter
of the weights and one of each optimizer state. Each is a pass over the frame's rows with its
own temporaries, and for scattered rows the passes, not the bytes, dominate: the kernel decodes
each kept row straight into its shard row. Tool: numba, as for the adaptive encoder
(:mod:`ckpt.quant.adaptive_kernel`): compiled at setup into a module that needs neither numba nor
LLVM at run time (:mod:`common.compiled`), jitted where that module is missing or stale.

It covers what a restore meets in practice: a frame holding exactly the shard's columns, weights
in fp32 or in the N-bit layout with fp16 scale and bias (asym2-4, adaptive2-4), optimizer states
in fp32 (`fits_on`). Into a CPU shard it decodes each kept row straight into its shard row
(`FusedReplay.write`); into a GPU shard it decodes them into a pinned staging buffer that is
copied to the device behind the host's back (:mod:`ckpt.restore.staging`). Everything else
(another column split, the other codecs) takes the torch path, which stays the reference: all
write the same bits (tested).

The numba code is :mod:`ckpt.restore.kernel_numba`; :func:`load` loads the built module, or jits the
source; the checkpointer loads it while the job is built, before a restore is timed, as it
connects its readers.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch

from ckpt.quant import get_codec
from ckpt.stream.frames import Frame
from common import compiled
from sharding.shard_views import ShardView

__all__ = ["AVAILABLE", "FusedReplay", "Written", "fits_on", "load"]

SOURCE = Path(__file__).with_name("kernel_numba.py")
# optional: without numba (and no module built at setup) every frame takes the torch path
AVAILABLE = compiled.runnable(SOURCE)
_RAW = 0  # weights layout: fp32 rows copied as they are (else: the N-bit codes' width)
_FP32 = get_codec("fp32").code
_CPU = torch.device("cpu")


@functools.cache
def load() -> ModuleType | None:
    """The kernel's functions, or None without it: the module built at setup when its stamp holds;
    else the first call in a process imports numba and loads the kernel's cached machine code
    (compiling it when there is none)."""
    built = compiled.load("ckpt.restore", SOURCE)
    if built is not None:
        return built
    if importlib.util.find_spec("numba") is None:
        return None
    from ckpt.restore import kernel_numba as k  # noqa: PLC0415 - numba's import is paid on first use only

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
    bits = getattr(codec, "bits", 32)  # the N-bit families' width
    if family in ("asym", "adaptive") and bits < 8:
        return bits
    return None


def _as_u8_rows(t: torch.Tensor) -> np.ndarray:
    """A contiguous float32 shard tensor ([rows] or [rows, cols]) as uint8 [rows, row bytes],
    sharing its memory."""
    return t.view(t.shape[0], -1).view(torch.uint8).numpy()


class Written(NamedTuple):
    """What one fused write did."""

    kept: int  # rows written
    inside: int  # rows of the frame in the shard
    decode_s: float  # seconds spent decoding the weights (into the shard, or a staging buffer)
    wait_s: float = 0.0  # seconds the host waited for earlier staged copies (ckpt/restore/staging.py)


class FusedReplay:
    """One restore's use of the kernel: which (frame, shard) pairs it takes, and the writes."""

    def __init__(self, kernel: ModuleType) -> None:
        self.k = kernel
        self._src = np.empty(0, np.int64)  # scratch: positions in the frame of the rows kept ...
        self._dst = np.empty(0, np.int64)  # ... and their local rows in the shard
        self._no_ids = np.empty(0, np.int64)

    def fits(self, frame: Frame, s: ShardView) -> bool:
        """Whether the kernel writes this frame into host shard `s` (else the torch path does)."""
        return fits_on(frame, s, _CPU)

    @property
    def src(self) -> np.ndarray:
        """After `select`: the positions in the frame of the rows kept (the first `kept`)."""
        return self._src

    @property
    def dst(self) -> np.ndarray:
        """After `select`: the shard's local rows of the rows kept (the first `kept`)."""
        return self._dst

    def select(
        self, frame: Frame, s: ShardView, link: int, written: np.ndarray, covered: np.ndarray, cols: int
    ) -> tuple[int, int]:
        """(rows kept, rows of the frame in the shard): the frame's rows in `s` that no later link
        than `link` wrote, listed in `src`/`dst` and marked in `written`; `covered` counts `cols`
        columns of every row in the shard."""
        n = frame.row_count
        if self._src.shape[0] < n:
            self._src, self._dst = np.empty(n, np.int64), np.empty(n, np.int64)
        first = frame.first_row if frame.first_row is not None else -1
        ids = self._no_ids if first >= 0 else frame.row_ids.numpy()
        return self.k.select_rows(ids, first, n, s.row_offset, s.num_rows, written, link, covered, cols, self._src, self._dst)

    def decode_into(self, frame: Frame, kept: int, rows: np.ndarray, weight: np.ndarray, states: dict[str, np.ndarray]) -> float:
        """Decode the `kept` rows `select` listed into rows `rows[:kept]` of `weight` (float32
        [rows, dim]) and copy their optimizer states into `states` (name -> uint8 [rows, row
        bytes]); returns the seconds spent decoding the weights."""
        t = time.perf_counter()
        layout = _weights_layout(frame.encoding)
        payload = frame.payload.numpy()
        if layout == _RAW:
            self.k.raw_rows_into(payload, self._src, rows, kept, weight.view(np.uint8))
        else:
            self.k.nbit_rows_into(payload, layout, frame.dim, self._src, rows, kept, weight)
        decode_s = time.perf_counter() - t
        optim = {o.name: o.rows for o in frame.optim}
        for name, out in states.items():
            self.k.raw_rows_into(optim[name].numpy(), self._src, rows, kept, out)
        return decode_s

    def write(self, frame: Frame, s: ShardView, link: int, written: np.ndarray, covered: np.ndarray, cols: int) -> Written:
        """Write the frame's rows that no later link than `link` wrote into `s` (marking them in
        `written`, and counting `cols` columns of every row in the shard in `covered`)."""
        kept, inside = self.select(frame, s, link, written, covered, cols)
        if not kept:
            return Written(0, inside, 0.0)
        states = {name: _as_u8_rows(state) for name, state in s.optimizer_states.items()}
        return Written(kept, inside, self.decode_into(frame, kept, self._dst, s.weight.numpy(), states))


def fits_on(frame: Frame, s: ShardView, device: torch.device) -> bool:
    """Whether the kernel decodes this frame for shard `s` on `device`: the frame holds exactly
    the shard's columns, in a weights layout it decodes, with every optimizer state of the shard
    in fp32 (one value a row or one a column), and the shard's tensors are contiguous float32 on
    `device`."""
    if frame.col_offset != s.col_offset or frame.dim != s.num_cols:
        return False
    if _weights_layout(frame.encoding) is None or not _f32_on(s.weight, device):
        return False
    widths = {o.name: o.rows.shape[1] for o in frame.optim if o.encoding == _FP32}
    for name, state in s.optimizer_states.items():
        if name not in widths or not _f32_on(state, device):
            return False  # the torch path names a missing state, or handles the encoding
        if widths[name] != (4 if state.dim() == 1 else 4 * frame.dim):  # row-wise, or one value a column
            return False
    return True


def _f32_on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device == device and t.dtype == torch.float32 and t.is_contiguous()
