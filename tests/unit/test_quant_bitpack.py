"""Bit packing: layout and round trip for every width."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.quant.bitpack import pack_bits, packed_bytes, unpack_bits


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(0, 6), dim=st.integers(1, 41), seed=st.integers(0, 10_000))
def test_roundtrip(bits, n, dim, seed):
    codes = torch.randint(0, 1 << bits, (n, dim), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (n, packed_bytes(dim, bits))
    assert torch.equal(unpack_bits(packed, bits, dim), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_layout_is_little_endian_bit_stream(bits):
    # element i occupies stream bits [i*bits, (i+1)*bits), byte k = stream bits [8k, 8k+8)
    dim = 11
    codes = torch.tensor([[(3 * i + 1) % (1 << bits) for i in range(dim)]], dtype=torch.uint8)
    stream = 0
    for i, c in enumerate(codes[0].tolist()):
        stream |= c << (i * bits)
    want = list(stream.to_bytes(packed_bytes(dim, bits), "little"))
    assert pack_bits(codes, bits)[0].tolist() == want


def test_3bit_example():
    # 8 codes 0..7 -> 24 bits 0b111_110_101_100_011_010_001_000 -> bytes 0x88 0xc6 0xfa
    codes = torch.arange(8, dtype=torch.uint8).unsqueeze(0)
    assert pack_bits(codes, 3)[0].tolist() == [0x88, 0xC6, 0xFA]
    assert pack_bits(codes[:, :3], 3)[0].tolist() == [0x88, 0x00]  # 9 bits -> 2 bytes, high bits zero


def test_bad_width():
    with pytest.raises(ValueError):
        pack_bits(torch.zeros(1, 4, dtype=torch.uint8), 0)
    with pytest.raises(ValueError):
        unpack_bits(torch.zeros(1, 4, dtype=torch.uint8), 9, 4)
