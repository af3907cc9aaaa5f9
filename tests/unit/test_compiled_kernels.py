"""The CPU kernels compiled at setup (launch/kernels.py, common/compiled.py): built for every numba
source, the same bytes as the jitted source, the GIL released, no numba or LLVM in a process that
runs them, a stale or foreign build never loaded, and every argument checked before a built
function reads it."""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt.quant import adaptive_kernel, adaptive_numba
from ckpt.quant.adaptive import search_steps
from ckpt.quant.adaptive_kernel import block_rows, keep_factor
from ckpt.restore import kernel as restore_kernel
from ckpt.restore import kernel_numba
from common import compiled
from launch import kernels

from .test_quant_adaptive_kernel import _mixed

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / s for s in kernels.SOURCES]


def _built(source: Path):
    kernel = compiled.load(".".join(source.relative_to(ROOT).parent.parts), source)
    assert kernel is not None, f"{source.name}: no module built at setup, or its stamp does not hold (bash launch/setup.sh)"
    return kernel


def test_setup_built_every_numba_kernel_and_its_stamp_holds():
    # every *_numba.py of the product is one launch/kernels.py builds; setup built them (CI tests
    # the built modules, not only the jitted source)
    found = sorted(p for d in ("ckpt", "trainer", "sharding", "common") for p in (ROOT / d).rglob("*_numba.py"))
    assert found == sorted(SOURCES)
    for source in SOURCES:
        assert compiled.stamp_holds(source), f"{source}: not built for today's source (bash launch/setup.sh builds it)"
        stamp = compiled.BuildStamp.read(compiled.stamp_path(source))
        assert stamp is not None and dict(stamp.exports) == importlib.import_module(kernels._import_name(source)).AOT_EXPORTS


@pytest.mark.parametrize("dim", [1, 3, 16, 33, 64, 129])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_built_encoder_writes_the_jitted_bytes_and_checks(bits, dim):
    seed = 1000 * bits + dim
    print(f"seed {seed}")
    x = _mixed(3000, dim, seed)
    x[5, 0] = float("nan")
    x[9, -1] = float("inf")
    x[11] = 3e38  # from 2 columns on, the sum overflows
    steps = search_steps(200, 0.5)
    args = (bits, 200, steps, 3, np.float32(keep_factor(dim)), block_rows(dim))
    out_aot = np.zeros((3000, (dim * bits + 7) // 8 + 4), np.uint8)
    out_jit = out_aot.copy()
    checks_aot, checks_jit = np.zeros(3, np.int64), np.zeros(3, np.int64)
    _built(adaptive_kernel.SOURCE).encode(x.numpy(), out_aot, *args, checks_aot)
    adaptive_numba.encode(x.numpy(), out_jit, *args, checks_jit)
    assert np.array_equal(out_aot, out_jit)
    assert checks_aot.tolist() == checks_jit.tolist() and checks_aot[0] >= 2 + (dim > 1)


def _replay(k, ids: np.ndarray, payloads: dict[tuple[int, int], np.ndarray]) -> list[np.ndarray]:
    """Everything one kernel writes for a frame of rows `ids` (900 of them, local rows 0-3999 of a
    shard at offset 500): its choice, then N-bit and raw rows into the shard."""
    written = np.full(4000, -1, np.int32)
    written[::7] = 3  # rows a later link wrote
    covered = np.zeros(4000, np.int32)
    src, dst = np.empty(900, np.int64), np.empty(900, np.int64)
    kept, inside = k.select_rows(ids, -1, 900, 500, 4000, written, 2, covered, 8, src, dst)
    got = [np.array([kept, inside]), written, covered, src[:kept], dst[:kept]]
    for (bits, dim), data in payloads.items():
        out = np.zeros((4000, dim), np.float32)
        k.nbit_rows_into(data, bits, dim, src, dst, kept, out)
        raw = np.zeros((4000, 12), np.uint8)
        k.raw_rows_into(np.ascontiguousarray(data[:, :12]), src, dst, kept, raw)
        got += [out, raw]
    return got


def test_built_restore_kernel_writes_what_the_jitted_one_writes():
    print("seed 7")
    rng = np.random.default_rng(7)
    ids = rng.choice(5000, 900, replace=False).astype(np.int64)
    payloads = {}
    for bits, dim in ((2, 13), (3, 17), (4, 31)):
        data = rng.integers(0, 256, (900, (dim * bits + 7) // 8 + 4), dtype=np.uint8)
        data[:, -4:] = np.float16(rng.standard_normal((900, 2))).view(np.uint8)  # finite scale and bias
        payloads[bits, dim] = data
    built = _replay(_built(restore_kernel.SOURCE), ids, payloads)
    jitted = _replay(kernel_numba, ids, payloads)
    assert built[0][0] > 100  # rows kept
    for a, b in zip(built, jitted, strict=True):
        assert np.array_equal(a, b)


def test_built_encoder_releases_the_gil():
    # a Python thread runs while the built encoder works: samples of it fall in the middle half
    # of the call (held GIL: none can; the samples at its edges could be scheduling)
    x = _mixed(200_000, 64, seed=3).numpy()
    out = np.zeros((200_000, 36), np.uint8)
    encode = _built(adaptive_kernel.SOURCE).encode
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(time.perf_counter())

    t = threading.Thread(target=sample)
    t.start()
    try:
        start = time.perf_counter()
        encode(x, out, 4, 200, search_steps(200, 0.84), 3, np.float32(keep_factor(64)), block_rows(64), np.zeros(3, np.int64))
        end = time.perf_counter()
    finally:
        stop.set()
        t.join(timeout=60)
    quarter = (end - start) / 4
    inside = [s for s in samples if start + quarter < s < end - quarter]
    assert inside, f"no sample in the middle of a {end - start:.3f} s call: the GIL was held"


def _run(code: str, env: dict[str, str] | None = None) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=True, cwd=ROOT,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    return out.stdout.split()


CODE = (
    "import sys, torch; from ckpt.quant import warm_up_codecs, get_codec; from ckpt.restore import kernel\n"
    "warm_up_codecs(['adaptive4']); get_codec('adaptive4').encode(torch.randn(500, 64)); kernel.load()\n"
    "print('numba' in sys.modules, 'llvmlite' in sys.modules, type(kernel.load().select_rows).__name__)\n"
)


def test_a_process_that_encodes_and_restores_loads_neither_numba_nor_llvm():
    assert _run(CODE) == ["False", "False", "function"]
    # turned off, the jitted source runs (numba's dispatcher)
    assert _run(CODE, {compiled.ENV: "0"}) == ["True", "True", "CPUDispatcher"]


def test_an_up_to_date_build_does_nothing_and_imports_neither_numba_nor_torch():
    code = (
        "import sys; from launch import kernels; rc = kernels.main([]); print(rc, 'numba' in sys.modules, 'torch' in sys.modules)"
    )
    assert _run(code) == ["0", "False", "False"]


def test_a_failed_build_says_so_in_one_line_and_keeps_the_built_modules():
    before = {s: compiled.built_file(s).read_bytes() for s in SOURCES}  # type: ignore[union-attr]
    out = subprocess.run(
        [sys.executable, "-m", "launch.kernels", "--force"], capture_output=True, text=True, timeout=180, cwd=ROOT,
        env={**os.environ, "CC": "false"},
    )  # fmt: skip
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "not compiled ahead of time" in lines[0] and "jit numba instead" in lines[0], out.stderr
    for s in SOURCES:
        assert compiled.stamp_holds(s) and compiled.built_file(s).read_bytes() == before[s]  # type: ignore[union-attr]


def _fake_build(tmp_path: Path) -> Path:
    """A source, a module file and a holding stamp, as launch/kernels.py leaves them."""
    source = tmp_path / "thing_numba.py"
    source.write_text("x = 1\n")
    built = tmp_path / ("thing_aot" + importlib.machinery.EXTENSION_SUFFIXES[0])
    built.write_bytes(b"\x7fELF")
    flags = tuple(sorted(compiled.cpu_flags()))
    compiled.BuildStamp(compiled.source_digest(source), flags, "0.0", (("f", "void(i8)"),)).save(compiled.stamp_path(source))
    return source


def test_a_stamp_holds_only_for_todays_source_on_a_cpu_that_covers_the_build(tmp_path):
    source = _fake_build(tmp_path)
    assert compiled.stamp_holds(source)
    # the source edited: the build is stale
    source.write_text("x = 2\n")
    assert not compiled.stamp_holds(source)
    source = _fake_build(tmp_path)
    # built for a CPU with a flag this one lacks
    path = compiled.stamp_path(source)
    raw = json.loads(path.read_text())
    raw["cpu_flags"].append("deltarec_flag_no_cpu_has")
    path.write_text(json.dumps(raw))
    assert not compiled.stamp_holds(source)
    # built where /proc/cpuinfo named no flags: nothing vouches for this CPU
    raw["cpu_flags"] = []
    path.write_text(json.dumps(raw))
    assert not compiled.stamp_holds(source)
    # no stamp, a damaged one, no module
    path.write_text("{not json")
    assert not compiled.stamp_holds(source)
    source = _fake_build(tmp_path)
    compiled.built_file(source).unlink()  # type: ignore[union-attr]
    assert not compiled.stamp_holds(source)


def test_turned_off_nothing_built_is_loaded(monkeypatch):
    monkeypatch.setenv(compiled.ENV, "0")
    assert compiled.load("ckpt.quant", adaptive_kernel.SOURCE) is None
    monkeypatch.delenv(compiled.ENV)
    assert compiled.load("ckpt.quant", adaptive_kernel.SOURCE) is not None


def test_a_built_function_refuses_arguments_its_signature_does_not_take():
    built = _built(restore_kernel.SOURCE)
    ids = np.arange(4, dtype=np.int64)
    out = np.zeros((4, 2), np.float32)
    data = np.zeros((4, 5), np.uint8)
    built.nbit_rows_into(data, 4, 2, ids, ids, 4, out)  # the signature's types pass
    bad = [
        ((data, 4, 2, ids.astype(np.int32), ids, 4, out), "argument 3 is int32"),
        ((np.zeros((4, 10), np.uint8)[:, ::2], 4, 2, ids, ids, 4, out), "argument 0 is uint8 2-d, contiguous False"),
        ((data, 4, 2, ids, ids, 4, out.astype(np.float64)), "argument 6 is float64"),
        ((data, 4.0, 2, ids, ids, 4, out), "argument 1 is float"),
        ((data, True, 2, ids, ids, 4, out), "argument 1 is bool"),
        ((data, 4, 2, torch.from_numpy(ids), ids, 4, out), "argument 3 is Tensor"),
        ((data, 4, 2, ids, ids, 4), "6 arguments, its signature has 7"),
    ]
    for args, message in bad:
        with pytest.raises(TypeError, match=message):
            built.nbit_rows_into(*args)


def test_signatures_parse_into_the_argument_types():
    f4, u1, i8 = np.dtype(np.float32), np.dtype(np.uint8), np.dtype(np.int64)
    assert compiled.parse_signature("void(f4[:, ::1], u1[::1], i8, f4)") == (
        compiled.ArgType(f4, 2), compiled.ArgType(u1, 1), compiled.ArgType(i8, 0), compiled.ArgType(f4, 0),
    )  # fmt: skip
    assert compiled.parse_signature("UniTuple(i8, 2)(i8[::1], i8)") == (compiled.ArgType(i8, 1), compiled.ArgType(i8, 0))
    for signature in list(adaptive_numba.AOT_EXPORTS.values()) + list(kernel_numba.AOT_EXPORTS.values()):
        assert compiled.parse_signature(signature)
    with pytest.raises(ValueError, match="C-contiguous"):
        compiled.parse_signature("void(f4[:, :])")
    with pytest.raises(ValueError, match="c16"):
        compiled.parse_signature("void(c16)")
