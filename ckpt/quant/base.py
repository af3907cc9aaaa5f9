"""Codec protocol, errors and the input checks every codec shares.

Every codec turns float32 rows ``[n, dim]`` into fixed-size byte rows ``uint8 [n, row_bytes(dim)]``
(and back). Multi-byte fields are little-endian (the host order of every platform torch supports
in practice; ``view(torch.uint8)`` of a float tensor gives that order).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

__all__ = [
    "RowCodec",
    "NonFiniteRowError",
    "RowRangeError",
    "as_float_rows",
    "check_finite_rows",
    "refuse_non_finite",
    "check_encoded",
    "check_finite_meta",
    "FP16_MAX",
    "view_bytes_as",
]

FP16_MAX = 65504.0


@runtime_checkable
class RowCodec(Protocol):
    """Per-row codec. ``name`` and ``code`` are stable: they are written in frame headers."""

    name: str
    code: int

    def row_bytes(self, dim: int) -> int: ...

    def encode(self, rows: torch.Tensor, *, table: str = "?", row_ids: torch.Tensor | None = None) -> torch.Tensor: ...

    def decode(self, data: torch.Tensor, dim: int) -> torch.Tensor: ...


def _row_label(i: int, row_ids: torch.Tensor | None) -> str:
    if row_ids is None:
        return f"{i} (batch index)"
    return f"{int(row_ids[i])} (global id)"


class NonFiniteRowError(ValueError):
    """A row holds NaN or +-Inf; it is refused instead of being written."""

    def __init__(self, table: str, index: int, row_ids: torch.Tensor | None, n_bad: int = 1):
        self.table = table
        self.index = index  # position in the batch
        self.row = int(row_ids[index]) if row_ids is not None else index
        self.n_bad = n_bad  # rows of the batch that have NaN/Inf
        super().__init__(f"table '{table}' row {_row_label(index, row_ids)} has NaN/Inf; refusing to checkpoint it")


class RowRangeError(ValueError):
    """A finite row cannot be represented by the codec (its fp16 scale/bias/values overflow)."""

    def __init__(self, table: str, index: int, row_ids: torch.Tensor | None, codec: str, n_bad: int = 1):
        self.table = table
        self.index = index
        self.row = int(row_ids[index]) if row_ids is not None else index
        self.codec = codec
        self.n_bad = n_bad
        super().__init__(
            f"table '{table}' row {_row_label(index, row_ids)} is out of the fp16 range of codec "
            f"'{codec}' (|x| or its range > {FP16_MAX:g}); refusing to checkpoint it "
            f"(use 'asym8', 'bf16' or 'fp32' for such rows)"
        )


def as_float_rows(rows: torch.Tensor, table: str, row_ids: torch.Tensor | None, *, check_finite: bool = True) -> torch.Tensor:
    """Validate a batch of rows and return it as contiguous float32 ``[n, dim]``.

    NaN/Inf rows raise :class:`NonFiniteRowError` naming the table and the row. The check is one
    read pass (a sum, `check_finite_rows`). A caller that sums the rows itself passes
    ``check_finite=False`` and calls `refuse_non_finite` when a sum is not finite.
    """
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
    if rows.dim() != 2:
        raise ValueError(f"rows must be 2-D [n, dim], got shape {tuple(rows.shape)}")
    if not rows.is_floating_point():
        raise TypeError(f"rows must be floating point, got {rows.dtype}")
    if rows.shape[1] < 1:
        raise ValueError("rows must have dim >= 1")
    if row_ids is not None:
        if row_ids.dim() != 1 or row_ids.shape[0] != rows.shape[0]:
            raise ValueError(f"row_ids must be 1-D with one id per row ({rows.shape[0]}), got {tuple(row_ids.shape)}")
    x = rows.to(torch.float32).contiguous()
    if check_finite:
        check_finite_rows(x, table, row_ids)
    return x


def check_finite_rows(x: torch.Tensor, table: str, row_ids: torch.Tensor | None) -> None:
    """One flat sum (NaN and Inf always propagate through a sum); the exact per-element test
    runs only when it is not finite, so a finite batch whose sum overflows is not refused."""
    if not x.numel():
        return
    if x.device.type == "cpu" and not x.requires_grad:  # numpy's sum costs a fraction of torch's two small ops
        finite = bool(np.isfinite(x.numpy().sum()))
    else:
        finite = bool(torch.isfinite(x.sum()))
    if not finite:
        refuse_non_finite(x, table, row_ids)


def refuse_non_finite(x: torch.Tensor, table: str, row_ids: torch.Tensor | None) -> None:
    """The exact per-element test: :class:`NonFiniteRowError` naming the first NaN/Inf row."""
    bad = (~torch.isfinite(x).all(dim=1)).nonzero().flatten()
    if bad.numel():
        raise NonFiniteRowError(table, int(bad[0]), row_ids, int(bad.numel()))


def check_finite_meta(ok: torch.Tensor, table: str, row_ids: torch.Tensor | None, codec: str) -> None:
    """``ok``: bool ``[n]``, False where the row's fp16 metadata/values overflowed."""
    if ok.numel() and not bool(ok.all()):
        bad = (~ok).nonzero().flatten()
        raise RowRangeError(table, int(bad[0]), row_ids, codec, int(bad.numel()))


def check_encoded(data: torch.Tensor, expected_cols: int, codec: str) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 2:
        raise ValueError(f"codec '{codec}': encoded data must be uint8 [n, row_bytes]")
    if data.shape[1] != expected_cols:
        raise ValueError(f"codec '{codec}': encoded rows have {data.shape[1]} bytes, expected {expected_cols} for this dim")


def view_bytes_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 ``[n, k*itemsize]`` as ``dtype`` ``[n, k]``, copying only when the bytes are
    not aligned to the item size (e.g. a row slice at an odd offset of a frame)."""
    size = torch.empty((), dtype=dtype).element_size()
    if t.stride(-1) == 1 and t.storage_offset() % size == 0 and all(st % size == 0 for st in t.stride()[:-1]):
        try:
            return t.view(dtype)  # strided rows of a frame: no copy needed
        except RuntimeError:
            pass
    return t.clone(memory_format=torch.contiguous_format).view(dtype)
