"""Which codecs encode rows on the GPU, before the copy to host (`ckpt.capture.encode_on`, docs/design/dataflow.md).

A GPU job's snapshot gathers the rows it copies on the device; for a codec with a device kernel
it encodes them there too, so only the encoded bytes cross to the host (docs/BENCHMARKS.md, "On an H100")
and the host's cores never encode them. Today that is the fast adaptive search
(``adaptive2/3/4``), whose Triton kernel (ckpt/quant/adaptive_triton.py) writes the same bytes as
the host's kernels. The encoder never waits for the device: it returns each row's refusal flags
with the bytes, and the writer checks them once the copy is on the host (`check_flags`), raising
what the codec's `encode` would have raised.
"""

from __future__ import annotations

from typing import Protocol

import torch

from . import adaptive_triton
from .adaptive import AdaptiveCodec
from .registry import get_codec

__all__ = ["DeviceEncoder", "device_encoder", "check_flags"]


class DeviceEncoder(Protocol):
    """A codec that encodes rows where they are, without a host synchronisation."""

    name: str

    def row_bytes(self, dim: int) -> int: ...

    def encode_device(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [n, dim] on the device -> (uint8 [n, row_bytes(dim)], uint8 flags [n]), both on the device."""
        ...


def device_encoder(name: str, device: torch.device) -> DeviceEncoder | None:
    """The device encoder of codec `name` for rows on `device`, or None where the host encodes."""
    if device.type != "cuda" or not adaptive_triton.AVAILABLE:
        return None
    codec = get_codec(name)
    if isinstance(codec, AdaptiveCodec) and codec.uses_triton(torch.empty(0, 1, device=device)):
        return codec  # its `encode_device` runs the Triton kernel
    return None


def check_flags(codec: str, flags: torch.Tensor, table: str, row_ids: torch.Tensor) -> None:
    """The refusals of rows encoded on the device (their flags, on the host): the error the
    codec's `encode` raises for the same rows, else nothing."""
    adaptive_triton.refuse_flagged(flags, table, row_ids, codec)
