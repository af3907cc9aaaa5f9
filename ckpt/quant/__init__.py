"""Per-row quantization codecs for embedding-row checkpoints (Check-N-Run).

    codec = get_codec("adaptive4")            # or get_codec(52), the id in the frame header
    data = codec.encode(rows, table="t_user", row_ids=global_ids)   # float32 [n, d] -> uint8 [n, codec.row_bytes(d)]
    rows2 = get_codec(code_from_header).decode(data, d)             # -> float32 [n, d]

Rows with NaN/Inf raise :class:`NonFiniteRowError`; finite rows that overflow a codec's fp16
fields raise :class:`RowRangeError` (both ``ValueError``). See docs/quant.md for layouts,
accuracy and speed, and :mod:`ckpt.quant.bit_widths` for choosing the bit width.
"""

from .base import NonFiniteRowError, RowCodec, RowRangeError
from .bit_widths import (
    CHECK_N_RUN_WIDTHS,
    DELTAREC_WIDTHS,
    WIDTH_PRESETS,
    BitWidthPolicy,
    bits_for_expected_restores,
    check_widths,
    codec_for_width,
    resolve_widths,
)
from .float_codecs import encode_owned
from .registry import CODE_TABLE, codec_names, get_codec, register_codec, warm_up_codecs

__all__ = [
    "RowCodec",
    "NonFiniteRowError",
    "RowRangeError",
    "get_codec",
    "encode_owned",
    "codec_names",
    "register_codec",
    "warm_up_codecs",
    "CODE_TABLE",
    "BitWidthPolicy",
    "bits_for_expected_restores",
    "check_widths",
    "CHECK_N_RUN_WIDTHS",
    "DELTAREC_WIDTHS",
    "WIDTH_PRESETS",
    "resolve_widths",
    "codec_for_width",
]
