"""Compiles deltarec's CPU kernels ahead of time, once per install (``launch/setup.sh`` runs it).

    python -m launch.kernels [--force]

Each kernel's numba source (:data:`SOURCES`) becomes an extension module beside it, named by
:func:`common.compiled.module_name` (``adaptive_numba.py`` -> ``adaptive_aot``), with a stamp of
what it was built from; :func:`common.compiled.load` imports it only while the stamp holds. The
compiler is numba's own ahead-of-time one (``numba.pycc``): the same source and the same LLVM
code generation as the jitted kernel, so the same bytes (tested), but the module it writes needs
neither numba nor LLVM at run time (the point: numba's LLVM stays out of every process, docs/BENCHMARKS.md,
"Measured outside the suites"). It needs a C compiler to link, as any extension does; without one,
or with any other failure, this prints one line and every process jits the source as before.

Two settings differ from a plain ``numba.pycc`` build, both to match the jitted kernels:
the target is this machine's CPU (``host``, as numba's JIT; the stamp records the CPU's flags so
that another CPU falls back), and the exported functions release the GIL (``nogil=True`` in the
jitted kernels: the checkpoint writer encodes beside training). numba's ahead-of-time compiler has
no switch for the second, so :func:`_releasing_the_gil` sets the flag on the compiler's options
while it runs.

Up to date (every stamp holds), it does nothing, in well under a second: it reads two files and
/proc/cpuinfo, imports neither numba nor torch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from common.compiled import BuildStamp, cpu_flags, module_name, source_digest, stamp_holds, stamp_path

ROOT = Path(__file__).resolve().parent.parent
# every kernel's numba source; each declares AOT_EXPORTS: exported name -> numba signature
SOURCES = ("ckpt/quant/adaptive_numba.py", "ckpt/restore/kernel_numba.py")


def _import_name(source: Path) -> str:
    return ".".join(source.relative_to(ROOT).with_suffix("").parts)


@contextlib.contextmanager
def _releasing_the_gil() -> Iterator[None]:
    """numba.pycc compiles its exported functions with these options: release the GIL, numpy's
    error model (IEEE division, no Python exceptions), as the jitted kernels' ``njit`` options."""
    from numba.pycc import compiler  # noqa: PLC0415 - numba is imported only to build

    plain = compiler.Flags

    class Flags(plain):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            self.release_gil = True
            self.error_model = "numpy"

    setattr(compiler, "Flags", Flags)  # noqa: B010 - the compiler's module global, swapped for the build
    try:
        yield
    finally:
        setattr(compiler, "Flags", plain)  # noqa: B010


def build(source: Path) -> Path:
    """Compile `source`'s AOT_EXPORTS into its module beside it (replacing any older one whole),
    then write its stamp; returns the module's file."""
    import numba  # noqa: PLC0415 - only a build pays numba's import
    from numba.pycc import CC  # noqa: PLC0415

    digest = source_digest(source)  # of the source as it is imported and compiled
    kernel = importlib.import_module(_import_name(source))
    name = module_name(source)
    # built in a folder beside the target, so that the module replaces the old one in one rename
    with tempfile.TemporaryDirectory(prefix=".build-", dir=source.parent) as tmp, _releasing_the_gil():
        cc = CC(name, source_module=kernel)
        cc.output_dir = tmp
        cc.target_cpu = "host"
        for exported, signature in kernel.AOT_EXPORTS.items():
            cc.export(exported, signature)(getattr(kernel, exported).py_func)
        cc.compile()
        (made,) = Path(tmp).glob(name + ".*")
        target = source.with_name(made.name)
        os.replace(made, target)  # a process that has the old one mapped keeps it
    exports = tuple(kernel.AOT_EXPORTS.items())
    BuildStamp(digest, tuple(sorted(cpu_flags())), numba.__version__, exports).save(stamp_path(source))
    return target


def stale(sources: list[Path]) -> list[Path]:
    """The sources whose built module is missing or no longer matches them or this CPU."""
    return [s for s in sources if not stamp_holds(s)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="build every kernel, up to date or not")
    args = parser.parse_args(argv)
    sources = [ROOT / s for s in SOURCES]
    todo = sources if args.force else stale(sources)
    if not todo:
        return 0
    t = time.perf_counter()
    try:
        for source in todo:
            build(source)
    except Exception as error:  # noqa: BLE001 - any failure leaves the jitted kernels, in one line
        first = (str(error).strip().splitlines() or [""])[0]
        print(
            f"deltarec setup: the CPU kernels were not compiled ahead of time ({type(error).__name__}: {first}); "
            'processes that run them jit numba instead, with its LLVM in memory (docs/scale.md, "Host memory")',
            file=sys.stderr,
        )
        return 1
    names = ", ".join(module_name(s) for s in todo)
    print(f"deltarec setup: CPU kernels compiled ahead of time: {names} ({time.perf_counter() - t:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
