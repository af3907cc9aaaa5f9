"""Uniform per-row codecs: asymmetric (min/max) and symmetric (zero-centred) at 8, 4, 3 and 2 bits.

On-stream row layouts (little-endian):

* ``asym8``  -- ``[dim x uint8 code][fp32 scale][fp32 bias]``; ``x = code*scale + bias``.
  This is fbgemm's ``Fused8BitRowwiseQuantized`` row (scale = range/255, bias = row min).
* ``asymN`` (N = 2, 3, 4) -- ``[ceil(dim*N/8) bytes of N-bit codes][fp16 scale][fp16 bias]``,
  codes packed as in :mod:`ckpt.quant.bitpack`; ``x = code*scale + bias``. This is fbgemm's
  ``FusedNBitRowwiseQuantizedSBHalf`` row (bias = fp16(min), scale = fp16((max-bias)/(2^N-1)),
  round half to even, codes clamped to [0, 2^N-1]); 3-bit follows the same rules with our own
  packing because fbgemm has no 3-bit op.
* ``symN`` (N = 8, 4, 3, 2) -- ``[ceil(dim*N/8) bytes of codes][absmax]``, absmax fp32 for N = 8
  and fp16 below. Codes are ``q + Q`` with ``q = round(x*Q/absmax)`` in ``[-Q, Q]``,
  ``Q = 2^(N-1)-1`` (mid-tread: zero and +-absmax are exact); ``x = (q/Q)*absmax``.

The fbgemm ops are used on CPU where they exist (asym 8/4/2-bit); the same semantics are
implemented in plain torch for 3-bit, for dims fbgemm's N-bit op refuses (dim must be a multiple of
16/N), and for non-CPU tensors (GPU machines have no fbgemm-gpu build), so every
path is device-agnostic. The torch N-bit path is bit-identical to fbgemm's; the 8-bit one can
differ by one code where (x-min)*255/range is an exact .5 tie (both tested).
Symmetric codecs are our own vectorised torch code: fbgemm has no zero-point-free rowwise op
(its rowwise ops always quantise [min, max] and store a bias).
"""

from __future__ import annotations

import torch

from .base import as_float_rows, check_encoded, check_finite_meta, view_bytes_as
from .bitpack import pack_bits, packed_bytes, unpack_bits

__all__ = [
    "AsymCodec",
    "SymCodec",
    "encode_nbit_with_range",
    "decode_nbit",
    "fbgemm_available",
    "fp16_meta_finite",
    "set_force_torch",
    "torch_forced",
]

_FORCE_TORCH = False
_FB = None


def _fb():
    """torch.ops.fbgemm if fbgemm_gpu is importable, else None."""
    global _FB
    if _FB is None:
        try:
            import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm.*)

            _FB = torch.ops.fbgemm
            _FB.FloatToFused8BitRowwiseQuantized  # noqa: B018  (raise now if missing)
        except Exception:  # noqa: BLE001 - any import or op failure means no fbgemm (depends on the install)
            _FB = False
    return _FB or None


def fbgemm_available() -> bool:
    return _fb() is not None


def set_force_torch(flag: bool) -> bool:
    """Route every codec through the plain-torch implementation (tests, GPU parity). Returns the old value."""
    global _FORCE_TORCH
    old, _FORCE_TORCH = _FORCE_TORCH, bool(flag)
    return old


def torch_forced() -> bool:
    """Whether `set_force_torch` routes every codec through plain torch (no fbgemm, no kernel)."""
    return _FORCE_TORCH


def _use_fbgemm(t: torch.Tensor) -> bool:
    return not _FORCE_TORCH and t.device.type == "cpu" and _fb() is not None


def _fbgemm_nbit_dim(dim: int, bits: int) -> bool:
    # fbgemm's N-bit ops need the packed row to be a whole number of fp16 words:
    # dim a multiple of 4 (4-bit) / 8 (2-bit); other dims take the (bit-identical) torch path
    return bits in (2, 4) and dim % (16 // bits) == 0


def rows_per_chunk(dim: int, device: torch.device, elems: int = 1 << 18) -> int:
    """Rows per chunk for the torch paths: ~1 MiB of fp32 temporaries on CPU (stays in L2)."""
    if device.type != "cpu":
        elems = 1 << 24
    return max(1, elems // max(dim, 1))


def _meta_bytes(t: torch.Tensor) -> torch.Tensor:
    """[n] or [n, k] float tensor -> its bytes [n, k*itemsize] (little-endian)."""
    if t.dim() == 1:
        t = t.unsqueeze(1)
    return t.contiguous().view(torch.uint8)


def fp16_meta_finite(meta: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 2k] holding k fp16 values per row -> bool [n]: all finite. What
    `check_finite_meta` is given for the fp16 scale and bias an N-bit asymmetric row ends with."""
    h = view_bytes_as(meta, torch.float16)
    return torch.isfinite(h).all(dim=1)


# ----------------------------------------------------------------------------------------------
# N-bit asymmetric with fp16 scale/bias (fbgemm "SBHalf" semantics)
# ----------------------------------------------------------------------------------------------


def _divide(t: torch.Tensor, number: float) -> torch.Tensor:
    """``t / number`` rounded as a true division on every device: CUDA divides by a Python
    number as a multiplication by its reciprocal, which can differ from the CPU's quotient
    (and fbgemm's) in the last bit."""
    return t / torch.full((), float(number), dtype=t.dtype, device=t.device)


def nbit_qparams(mn: torch.Tensor, mx: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16-rounded (scale, bias) as float32, following fbgemm's FloatOrHalfToFusedNBit... rules."""
    qmax = (1 << bits) - 1
    bias = mn.to(torch.float16).to(torch.float32)
    rng = mx - bias
    scale = _divide(rng, qmax).to(torch.float16).to(torch.float32)
    # fbgemm: range == 0 -> scale 1; fp16 scale underflow (== 0) -> scale 1
    scale = torch.where((rng == 0) | (scale == 0), torch.ones_like(scale), scale)
    return scale, bias


def _nbit_encode_torch(x: torch.Tensor, bits: int, mn, mx) -> torch.Tensor:
    n, dim = x.shape
    qmax = (1 << bits) - 1
    P = packed_bytes(dim, bits)
    out = torch.empty(n, P + 4, dtype=torch.uint8, device=x.device)
    step = rows_per_chunk(dim, x.device)
    for i in range(0, n, step):
        xc = x[i : i + step]
        if mn is None:
            lo, hi = torch.aminmax(xc, dim=1)
        else:
            lo, hi = mn[i : i + step], mx[i : i + step]
        scale, bias = nbit_qparams(lo, hi, bits)
        inv = 1.0 / scale
        q = (xc - bias.unsqueeze(1)).mul_(inv.unsqueeze(1)).round_().clamp_(0, qmax).to(torch.uint8)
        out[i : i + step, :P] = pack_bits(q, bits)
        out[i : i + step, P:] = _meta_bytes(torch.stack([scale, bias], 1).to(torch.float16))
    return out


def encode_nbit_with_range(
    x: torch.Tensor, bits: int, mn: torch.Tensor | None = None, mx: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 [n, dim] -> asymN rows; range per row = [mn, mx] (row min/max when None).

    No input validation (callers validate); the fp16 metadata may be non-finite for huge rows.
    """
    n, dim = x.shape
    if n and _fbgemm_nbit_dim(dim, bits) and _use_fbgemm(x):
        fb = _fb()
        if mn is None:
            return fb.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(x, bits)
        assert mx is not None, "a range needs both ends"
        mm = torch.stack([mn.to(torch.float32), mx.to(torch.float32)], 1)
        return fb.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalfWithRowwiseMinMax(x, bits, mm)
    return _nbit_encode_torch(x, bits, mn, mx)


def decode_nbit(data: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    n = data.shape[0]
    P = packed_bytes(dim, bits)
    if n and _fbgemm_nbit_dim(dim, bits) and _use_fbgemm(data):
        return _fb().FusedNBitRowwiseQuantizedSBHalfToFloat(data.contiguous(), bits)
    out = torch.empty(n, dim, dtype=torch.float32, device=data.device)
    step = rows_per_chunk(dim, data.device)
    for i in range(0, n, step):
        d = data[i : i + step]
        sb = view_bytes_as(d[:, P:], torch.float16).to(torch.float32)
        q = unpack_bits(d[:, :P], bits, dim).to(torch.float32)
        torch.addcmul(sb[:, 1:2], q, sb[:, 0:1], out=out[i : i + step])
    return out


# ----------------------------------------------------------------------------------------------
# 8-bit asymmetric with fp32 scale/bias (fbgemm Fused8BitRowwise)
# ----------------------------------------------------------------------------------------------


def _asym8_encode_torch(x: torch.Tensor) -> torch.Tensor:
    n, dim = x.shape
    out = torch.empty(n, dim + 8, dtype=torch.uint8, device=x.device)
    step = rows_per_chunk(dim, x.device)
    for i in range(0, n, step):
        xc = x[i : i + step]
        lo, hi = torch.aminmax(xc, dim=1)
        rng = hi - lo
        inv = 255.0 / (rng + 1e-8)  # fbgemm's kEpsilon: never divides by zero
        q = (xc - lo.unsqueeze(1)).mul_(inv.unsqueeze(1)).round_().clamp_(0, 255).to(torch.uint8)
        out[i : i + step, :dim] = q
        out[i : i + step, dim:] = _meta_bytes(torch.stack([_divide(rng, 255.0), lo], 1))
    return out


def _asym8_decode_torch(data: torch.Tensor, dim: int) -> torch.Tensor:
    sb = view_bytes_as(data[:, dim:], torch.float32)
    return torch.addcmul(sb[:, 1:2], data[:, :dim].to(torch.float32), sb[:, 0:1])


class AsymCodec:
    """Uniform asymmetric codec: the row's [min, max] split into 2^bits levels."""

    family = "asym"

    def __init__(self, bits: int):
        if bits not in (2, 3, 4, 8):
            raise ValueError(f"asym codec supports 2, 3, 4 or 8 bits, got {bits}")
        self.bits = bits
        self.name = f"asym{bits}"
        self.code = 0x10 | bits

    def __repr__(self) -> str:
        return f"<codec {self.name} code={self.code}>"

    def row_bytes(self, dim: int) -> int:
        if self.bits == 8:
            return dim + 8
        return packed_bytes(dim, self.bits) + 4

    def encode(self, rows, *, table="?", row_ids=None):
        x = as_float_rows(rows, table, row_ids)
        n, dim = x.shape
        if self.bits == 8:
            if n and _use_fbgemm(x):
                out = _fb().FloatToFused8BitRowwiseQuantized(x)
            else:
                out = _asym8_encode_torch(x)
            meta = view_bytes_as(out[:, dim:], torch.float32)
            check_finite_meta(torch.isfinite(meta).all(dim=1), table, row_ids, self.name)
            return out
        out = encode_nbit_with_range(x, self.bits)
        check_finite_meta(fp16_meta_finite(out[:, -4:]), table, row_ids, self.name)
        return out

    def decode(self, data, dim):
        check_encoded(data, self.row_bytes(dim), self.name)
        if self.bits == 8:
            if data.shape[0] and _use_fbgemm(data):
                return _fb().Fused8BitRowwiseQuantizedToFloat(data.contiguous())
            return _asym8_decode_torch(data, dim)
        return decode_nbit(data, self.bits, dim)


# ----------------------------------------------------------------------------------------------
# Symmetric (zero-point-free) codecs
# ----------------------------------------------------------------------------------------------


class SymCodec:
    """Uniform symmetric codec: levels ``k*absmax/Q`` for k in [-Q, Q], Q = 2^(bits-1)-1."""

    family = "sym"

    def __init__(self, bits: int):
        if bits not in (2, 3, 4, 8):
            raise ValueError(f"sym codec supports 2, 3, 4 or 8 bits, got {bits}")
        self.bits = bits
        self.q = (1 << (bits - 1)) - 1
        self.name = f"sym{bits}"
        self.code = 0x20 | bits
        self.meta_dtype = torch.float32 if bits == 8 else torch.float16
        self.meta_size = 4 if bits == 8 else 2

    def __repr__(self) -> str:
        return f"<codec {self.name} code={self.code}>"

    def row_bytes(self, dim: int) -> int:
        return packed_bytes(dim, self.bits) + self.meta_size

    def encode(self, rows, *, table="?", row_ids=None):
        x = as_float_rows(rows, table, row_ids)
        n, dim = x.shape
        P = packed_bytes(dim, self.bits)
        Q = self.q
        out = torch.empty(n, P + self.meta_size, dtype=torch.uint8, device=x.device)
        ok = torch.ones(n, dtype=torch.bool, device=x.device)
        step = rows_per_chunk(dim, x.device)
        for i in range(0, n, step):
            xc = x[i : i + step]
            lo, hi = torch.aminmax(xc, dim=1)
            # stored absmax (fp16 may round/overflow); abs_ turns max(-0.0, 0.0) = -0.0 into +0.0
            m = torch.maximum(-lo, hi).abs_().to(self.meta_dtype)
            mf = m.to(torch.float32)
            ok[i : i + step] = torch.isfinite(mf)
            inv = torch.where(mf > 0, Q / mf, torch.zeros_like(mf))  # all-zero row -> codes Q (= 0.0)
            q = (xc * inv.unsqueeze(1)).round_().clamp_(-Q, Q).add_(Q).to(torch.uint8)
            out[i : i + step, :P] = pack_bits(q, self.bits)
            out[i : i + step, P:] = _meta_bytes(m)
        check_finite_meta(ok, table, row_ids, self.name)
        return out

    def decode(self, data, dim):
        check_encoded(data, self.row_bytes(dim), self.name)
        n = data.shape[0]
        P = packed_bytes(dim, self.bits)
        Q = self.q
        out = torch.empty(n, dim, dtype=torch.float32, device=data.device)
        step = rows_per_chunk(dim, data.device)
        for i in range(0, n, step):
            d = data[i : i + step]
            m = view_bytes_as(d[:, P:], self.meta_dtype).to(torch.float32)  # [r, 1]
            q = unpack_bits(d[:, :P], self.bits, dim).to(torch.float32).sub_(Q)
            # (q / Q) * absmax: q = +-Q gives exactly +-absmax (division, not a rounded reciprocal)
            torch.mul(_divide(q, Q), m, out=out[i : i + step])
        return out
