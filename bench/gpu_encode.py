"""Adaptive encoding of rows that sit on a GPU: the fused Triton kernel against the torch reference,
and the two ways a GPU job's checkpoint can encode its rows.

    python -m bench.gpu_encode [--rows 1048576] [--dims 32,64,128,256] [--bits 4,3,2] [--repeats 5]
                               [--host-rows 1048576] [--out F]

* :func:`triton_throughput`: GB/s of fp32 input for ``adaptive_triton.encode_rows_device`` and for the
  torch reference (``fast_encode_torch``) on the same CUDA rows, adaptive4 at every width of ``dims``
  and the other widths at d=128; and how many rows' bytes differ between the two (must be 0).
* :func:`device_vs_host`: adaptive4 rows on the GPU encoded (a) on the device by the Triton kernel,
  the encoded bytes and flags then copied into pinned host memory, or (b) copied as fp32 into pinned
  host memory and encoded there by the numba kernel on one thread (as the checkpoint writer does).
  Seconds and GB/s of fp32 rows for each, their ratio, the bytes crossing PCIe in each.

Timing: CUDA events around work queued on the current stream (for (b), wall time: the host part
runs on the CPU), one warm-up call first (Triton's compile, numba's load), the median of
``repeats``, each on fresh random rows (a quarter of them heavy-tailed, as ``bench/gpu.py``'s codec
rows). CUDA only: importable anywhere, and each function fails with a clear message without a GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any

import torch

from ckpt.quant import adaptive_kernel, adaptive_triton
from ckpt.quant.adaptive import FAST_NBINS, FAST_RATIO, FAST_REFITS, fast_encode_torch, search_steps
from ckpt.quant.bitpack import packed_bytes

OTHER_WIDTH_DIM = 128  # the width at which adaptive2/3 are measured


@dataclass(frozen=True)
class TritonThroughput:
    """One codec and width: the Triton kernel against the torch reference on the same CUDA rows."""

    codec: str
    bits: int
    rows: int
    dim: int
    triton_s: float  # median seconds per encode
    triton_GBps: float  # fp32 input per second
    torch_s: float
    torch_GBps: float
    speedup: float  # torch_s / triton_s
    rows_differing: int  # rows whose Triton bytes differ from the reference's (must be 0)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DeviceVsHost:
    """adaptive4 rows on the GPU: encoded on the device and copied, or copied and encoded on the host."""

    rows: int
    dim: int
    device_s: float  # (a) Triton encode + copy of the encoded bytes and flags into pinned memory
    device_GBps: float  # fp32 rows per second
    host_s: float  # (b) copy of the fp32 rows into pinned memory + numba encode on one thread
    host_GBps: float
    host_copy_s: float  # the copy part of host_s
    host_over_device: float  # host_s / device_s
    device_pcie_bytes: int  # encoded bytes and flags
    host_pcie_bytes: int  # fp32 rows
    same_bytes: bool  # both ways wrote the same encoded rows

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _need_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("bench.gpu_encode needs CUDA, and torch sees no GPU")
    if not adaptive_triton.AVAILABLE:
        raise RuntimeError("bench.gpu_encode needs triton, which is not importable")
    return torch.device("cuda")


def _rows(n: int, dim: int, seed: int, device: torch.device) -> torch.Tensor:
    """Gaussian rows, the first quarter cubed (heavy tails)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, dim, device=device, generator=g)
    x[: n // 4] = x[: n // 4] ** 3
    return x


def _search(bits: int) -> tuple[int, float, int, int]:
    """(nbins, ratio, steps, refits) of the default fast search at this width."""
    return FAST_NBINS[bits], FAST_RATIO[bits], search_steps(FAST_NBINS[bits], FAST_RATIO[bits]), FAST_REFITS[bits]


def _event_time(fn: Callable[[], object]) -> float:
    """Seconds of the GPU work ``fn`` queues on the current stream (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def triton_throughput(
    rows: int, dims: Sequence[int], bits_list: Sequence[int], repeats: int, other_dim: int = OTHER_WIDTH_DIM
) -> list[TritonThroughput]:
    """adaptive4 (if 4 is in ``bits_list``) at every width of ``dims``, each other width at
    ``other_dim``: the Triton encode's and the torch reference's median time over ``repeats`` fresh
    batches of ``rows`` rows, and the rows whose bytes differ between them (over every batch)."""
    dev = _need_cuda()
    cases = [(bits, d) for bits in bits_list for d in (dims if bits == 4 else [other_dim])]
    out: list[TritonThroughput] = []
    for bits, dim in cases:
        nbins, ratio, steps, refits = _search(bits)
        fresh = _rows(rows, dim, 0, dev)
        adaptive_triton.encode_rows_device(fresh, bits, nbins, steps, refits)  # warm-up: compile
        fast_encode_torch(fresh[:1024], bits, nbins, ratio, refits)
        t_triton, t_torch, differing = [], [], 0
        for r in range(repeats):
            x = _rows(rows, dim, 1 + r, dev)
            got: list[torch.Tensor] = []
            t_triton.append(_event_time(lambda: got.append(adaptive_triton.encode_rows_device(x, bits, nbins, steps, refits)[0])))
            want: list[torch.Tensor] = []
            t_torch.append(_event_time(lambda: want.append(fast_encode_torch(x, bits, nbins, ratio, refits))))
            differing += int((got[0] != want[0]).any(1).sum())
        a, b = median(t_triton), median(t_torch)
        nbytes = rows * dim * 4
        out.append(
            TritonThroughput(
                codec=f"adaptive{bits}",
                bits=bits,
                rows=rows,
                dim=dim,
                triton_s=a,
                triton_GBps=nbytes / a / 1e9,
                torch_s=b,
                torch_GBps=nbytes / b / 1e9,
                speedup=b / a,
                rows_differing=differing,
            )
        )
        torch.cuda.empty_cache()
    return out


def device_vs_host(rows: int, dims: Sequence[int], repeats: int) -> list[DeviceVsHost]:
    """adaptive4 rows on the GPU, for each width: (a) Triton encode on the device, then the encoded
    bytes and flags copied into pinned host memory; (b) the fp32 rows copied into pinned host
    memory, then encoded by the numba kernel on this thread. Medians of ``repeats`` fresh batches
    after one warm-up of each."""
    dev = _need_cuda()
    if not adaptive_kernel.AVAILABLE:
        raise RuntimeError("device_vs_host's host side needs numba (ckpt.quant.adaptive_kernel)")
    bits = 4
    nbins, _ratio, steps, refits = _search(bits)
    out: list[DeviceVsHost] = []
    for dim in dims:
        row_bytes = packed_bytes(dim, bits) + 4
        enc_host = torch.empty(rows, row_bytes, dtype=torch.uint8, pin_memory=True)
        flags_host = torch.empty(rows, dtype=torch.uint8, pin_memory=True)
        x_host = torch.empty(rows, dim, pin_memory=True)

        def on_device(x: torch.Tensor) -> None:
            enc, flags = adaptive_triton.encode_rows_device(x, bits, nbins, steps, refits)
            enc_host.copy_(enc, non_blocking=True)
            flags_host.copy_(flags, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        def on_host(x: torch.Tensor) -> tuple[float, torch.Tensor]:
            x_host.copy_(x, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            copied = time.perf_counter()
            return copied, adaptive_kernel.encode_rows(x_host, bits, nbins, steps, refits)

        warm = _rows(rows, dim, 0, dev)
        on_device(warm)
        on_host(warm)
        t_dev, t_host, t_copy, same = [], [], [], True
        for r in range(repeats):
            x = _rows(rows, dim, 1 + r, dev)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            on_device(x)
            t1 = time.perf_counter()
            copied, enc = on_host(x)
            t2 = time.perf_counter()
            t_dev.append(t1 - t0)
            t_host.append(t2 - t1)
            t_copy.append(copied - t1)
            same = same and torch.equal(enc, enc_host)
        a, b = median(t_dev), median(t_host)
        nbytes = rows * dim * 4
        out.append(
            DeviceVsHost(
                rows=rows,
                dim=dim,
                device_s=a,
                device_GBps=nbytes / a / 1e9,
                host_s=b,
                host_GBps=nbytes / b / 1e9,
                host_copy_s=median(t_copy),
                host_over_device=b / a,
                device_pcie_bytes=rows * (row_bytes + 1),
                host_pcie_bytes=nbytes,
                same_bytes=same,
            )
        )
        torch.cuda.empty_cache()
    return out


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_encode", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1 << 20, help="rows per batch of the throughput part")
    p.add_argument("--dims", default="32,64,128,256")
    p.add_argument("--bits", default="4,3,2")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--host-rows", type=int, default=1 << 20, help="rows per batch of the device-vs-host part")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    dims = _ints(args.dims)
    result = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "triton_throughput": [r.as_dict() for r in triton_throughput(args.rows, dims, _ints(args.bits), args.repeats)],
        "device_vs_host": [r.as_dict() for r in device_vs_host(args.host_rows, dims, args.repeats)],
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
