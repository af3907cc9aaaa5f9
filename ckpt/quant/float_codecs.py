"""Float codecs: fp32 (lossless), fp16 and bf16 (round to nearest even).

Row layout: ``dim`` little-endian floats of the codec's width, nothing else.
Encoded rows never alias the caller's tensor (a snapshot buffer may be reused after encode),
except through `encode_owned`, for a caller that is done with them before the rows change.
"""

from __future__ import annotations

import torch

from .base import RowCodec, as_float_rows, check_encoded, check_finite_meta, view_bytes_as

__all__ = ["FloatCodec", "encode_owned"]


class FloatCodec:
    family = "float"

    def __init__(self, name: str, code: int, dtype: torch.dtype):
        self.name = name
        self.code = code
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.bits = 8 * self.itemsize

    def __repr__(self) -> str:
        return f"<codec {self.name} code={self.code}>"

    def row_bytes(self, dim: int) -> int:
        return dim * self.itemsize

    def encode(self, rows, *, table="?", row_ids=None):
        x = as_float_rows(rows, table, row_ids)
        if self.dtype == torch.float32:
            y = x.clone() if x.data_ptr() == rows.data_ptr() else x  # never alias the caller's rows
        else:
            y = x.to(self.dtype)
            if y.shape[0]:
                # a finite fp32 value can overflow to Inf in fp16 (|x| >= 65520) or bf16 (near fp32 max).
                # Row sums in fp32 find it in one pass; a sum that overflows on its own is re-checked exactly.
                s = y.sum(dim=1, dtype=torch.float32)
                if not bool(torch.isfinite(s).all()):
                    check_finite_meta(torch.isfinite(y).all(dim=1), table, row_ids, self.name)
        return y.view(torch.uint8)

    def decode(self, data, dim):
        check_encoded(data, self.row_bytes(dim), self.name)
        y = view_bytes_as(data, self.dtype)
        if self.dtype != torch.float32:
            return y.to(torch.float32)
        if y.data_ptr() == data.data_ptr():  # never alias the frame buffer
            return y.clone(memory_format=torch.contiguous_format)
        return y


def encode_owned(codec: RowCodec, rows: torch.Tensor, *, table: str = "?", row_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`codec.encode(rows)` for a caller that reads the result only while `rows` stay as they
    are (the writer, which owns its snapshot's rows until it releases them). fp32 rows are
    their own encoding: after the same checks, their bytes are returned as a view, without the
    copy `encode` makes so that its result outlives changes to the rows. For a snapshot of
    hundreds of MB that copy was freshly mapped memory, faulted in by the writer every checkpoint."""
    if isinstance(codec, FloatCodec) and codec.dtype == torch.float32:
        return as_float_rows(rows, table, row_ids).view(torch.uint8)
    return codec.encode(rows, table=table, row_ids=row_ids)
