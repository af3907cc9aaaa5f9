"""Vectorised bit packing of b-bit codes (b = 1..8) into bytes.

Layout (the same as fbgemm's fused N-bit rows): element ``i`` of a row occupies bits
``[i*b, (i+1)*b)`` of the row's little-endian bit stream, i.e. byte ``k`` holds stream bits
``[8k, 8k+8)`` with the lowest bit first. A row of ``dim`` codes takes ``ceil(dim*b/8)`` bytes;
unused high bits of the last byte are zero.

3-bit (and other widths that do not divide 8) pack 8 codes into ``b`` bytes through one 32-bit
word per group of 8 -- all tensor ops, no Python loop over rows or elements.
"""

from __future__ import annotations

import torch

__all__ = ["packed_bytes", "pack_bits", "unpack_bits"]


def packed_bytes(dim: int, bits: int) -> int:
    return (dim * bits + 7) // 8


def _word_dtype(bits: int) -> torch.dtype:
    # a group of 8 codes spans 8*bits bits: 24 for 3-bit fits int32, 5..7-bit need int64
    return torch.int32 if 8 * bits <= 31 else torch.int64


def _check(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[n, dim]`` (each < 2**bits) -> uint8 ``[n, ceil(dim*bits/8)]``."""
    _check(bits)
    n, dim = codes.shape
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    nbytes = packed_bytes(dim, bits)
    if 8 % bits == 0:  # 1, 2, 4: whole codes per byte
        per = 8 // bits
        pad = (-dim) % per
        c = codes.to(torch.uint8)
        if pad:
            c = torch.nn.functional.pad(c, (0, pad))
        c = c.view(n, (dim + pad) // per, per)
        out = c[:, :, 0].clone()
        for j in range(1, per):  # at most 7 whole-tensor ops, not a loop over data
            out |= c[:, :, j] << (bits * j)
        return out
    # widths that straddle bytes: 8 codes -> `bits` bytes through an int32 word
    wt = _word_dtype(bits)
    pad = (-dim) % 8
    c = codes.to(wt)
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    groups = (dim + pad) // 8
    c = c.view(n, groups, 8)
    shifts = torch.arange(0, 8 * bits, bits, dtype=wt, device=codes.device)
    word = (c << shifts).sum(dim=2, dtype=wt)  # [n, groups]; disjoint bits: sum == or
    bshift = torch.arange(0, 8 * bits, 8, dtype=wt, device=codes.device)
    out = ((word.unsqueeze(2) >> bshift) & 0xFF).to(torch.uint8).view(n, groups * bits)
    return out[:, :nbytes].contiguous()


def unpack_bits(data: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """uint8 ``[n, ceil(dim*bits/8)]`` -> uint8 codes ``[n, dim]``."""
    _check(bits)
    n = data.shape[0]
    if bits == 8:
        return data[:, :dim]
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per = 8 // bits
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=data.device)
        c = (data.unsqueeze(2) >> shifts) & mask  # [n, nbytes, per]
        return c.view(n, data.shape[1] * per)[:, :dim]
    groups = (dim + 7) // 8
    full = groups * bits
    d = data
    if d.shape[1] < full:
        d = torch.nn.functional.pad(d, (0, full - d.shape[1]))
    wt = _word_dtype(bits)
    d = d.view(n, groups, bits).to(wt)
    bshift = torch.arange(0, 8 * bits, 8, dtype=wt, device=data.device)
    word = (d << bshift).sum(dim=2, dtype=wt)
    shifts = torch.arange(0, 8 * bits, bits, dtype=wt, device=data.device)
    c = ((word.unsqueeze(2) >> shifts) & mask).to(torch.uint8)
    return c.view(n, groups * 8)[:, :dim]
