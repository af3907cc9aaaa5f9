"""Kernels compiled ahead of time: load one only if it was built from today's source for this CPU.

deltarec's CPU kernels are numba code (``ckpt/quant/adaptive_numba.py``, ``ckpt/restore/kernel_numba.py``).
Jitted, every process that runs one pays numba's import and LLVM's resident code (its size:
docs/BENCHMARKS.md, "Measured outside the suites"); so setup compiles the same source once
into an extension module (``launch/kernels.py``, numba's ahead-of-time compiler) that needs neither
at run time. Beside each built module lies a stamp (:class:`BuildStamp`, JSON) saying what it was
built from; :func:`load` imports the module only when the stamp still holds: the source's digest
is today's file's (an edited kernel is never run stale) and this CPU has every instruction-set flag
of the CPU it was built for (a checkout shared by nodes of older CPUs does not die of SIGILL; where
/proc/cpuinfo names no flags, nothing built is loaded). In any other case it returns None and the
caller runs the numba source jitted, as before.

A built function trusts its arguments: given an int32 array where its signature says int64, or a
strided one where it says contiguous, it reads the wrong memory (numba's ahead-of-time wrappers
check neither, unlike its jitted dispatchers). So :func:`load` hands out each function behind
:func:`guarded`, which checks every argument against the signature in the stamp first (a few
microseconds a call; the kernels are called per batch or per frame) and raises TypeError naming
the argument.

``DELTAREC_AOT_KERNELS=0`` turns the built modules off (the jitted source runs): for comparing
the two, and for a user who suspects the build.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "BuildStamp",
    "built_file",
    "cpu_flags",
    "enabled",
    "guarded",
    "holding_stamp",
    "load",
    "module_name",
    "parse_signature",
    "runnable",
    "source_digest",
    "stamp_holds",
    "stamp_path",
]

ENV = "DELTAREC_AOT_KERNELS"
_CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class BuildStamp:
    """What one built module was compiled from (its JSON file beside the module)."""

    source_sha256: str  # digest of the numba source file it was compiled from
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags of the CPU it was compiled for (sorted)
    numba: str  # the numba version that compiled it (information only)
    exports: tuple[tuple[str, str], ...]  # (function, numba signature) of each exported function

    def save(self, path: Path) -> None:
        """Write the stamp (replacing any older one in one rename)."""
        raw = {
            "source_sha256": self.source_sha256,
            "cpu_flags": list(self.cpu_flags),
            "numba": self.numba,
            "exports": dict(self.exports),
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(raw, indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> BuildStamp | None:
        """The stamp at `path`, or None when there is none or it is not one."""
        try:
            raw = json.loads(path.read_text())
            flags = tuple(str(f) for f in raw["cpu_flags"])
            exports = tuple((str(k), str(v)) for k, v in raw["exports"].items())
            return cls(str(raw["source_sha256"]), flags, str(raw["numba"]), exports)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None


class ArgType(NamedTuple):
    """One argument of an exported function's signature."""

    dtype: np.dtype[Any]
    ndim: int  # 0: a scalar; else a C-contiguous array of this many dimensions


# numba's names of the types the kernels' signatures use
_DTYPES = {"f4": np.float32, "f8": np.float64, "u1": np.uint8, "i4": np.int32, "i8": np.int64}


def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside brackets and parentheses."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "[(":
            depth += 1
        elif c in "])":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def parse_signature(signature: str) -> tuple[ArgType, ...]:
    """The argument types of a numba signature such as ``void(f4[:, ::1], i8)``: scalars and
    C-contiguous arrays (``[::1]`` last) of the types in ``_DTYPES``."""
    open_at = signature.rindex(")(") + 1 if ")(" in signature else signature.index("(")
    args = []
    for part in _split_top(signature[open_at + 1 : signature.rindex(")")]):
        name, _, dims = part.partition("[")
        if name.strip() not in _DTYPES or (dims and not dims.replace(" ", "").endswith("::1]")):
            raise ValueError(f"signature {signature!r}: {part!r} is not a scalar or a C-contiguous array it knows")
        args.append(ArgType(np.dtype(_DTYPES[name.strip()]), len(dims.split(",")) if dims else 0))
    return tuple(args)


def _check(name: str, want: tuple[ArgType, ...], args: tuple[object, ...]) -> None:
    if len(args) != len(want):
        raise TypeError(f"{name}: {len(args)} arguments, its signature has {len(want)}")
    for i, (arg, t) in enumerate(zip(args, want, strict=True)):
        if t.ndim == 0:
            kind = (int, np.integer) if t.dtype.kind in "iu" else (float, int, np.floating)
            if isinstance(arg, bool) or not isinstance(arg, kind):
                raise TypeError(f"{name}: argument {i} is {type(arg).__name__}, not a {t.dtype} scalar")
        elif not (isinstance(arg, np.ndarray) and arg.dtype == t.dtype and arg.ndim == t.ndim and arg.flags.c_contiguous):
            got = (
                f"{arg.dtype} {arg.ndim}-d, contiguous {arg.flags.c_contiguous}"
                if isinstance(arg, np.ndarray)
                else type(arg).__name__
            )
            raise TypeError(f"{name}: argument {i} is {got}, not a C-contiguous {t.dtype} array of {t.ndim} dimensions")


def guarded(fn: Callable[..., Any], name: str, signature: str) -> Callable[..., Any]:
    """`fn` behind a check of every argument against `signature` (TypeError naming the first
    that does not match): a built function given the wrong type reads the wrong memory."""
    want = parse_signature(signature)

    def call(*args: object) -> Any:
        _check(name, want, args)
        return fn(*args)

    call.__name__ = call.__qualname__ = name
    return call


def enabled() -> bool:
    """Whether built modules may be loaded (``DELTAREC_AOT_KERNELS`` is not ``0``)."""
    return os.environ.get(ENV, "1") != "0"


def source_digest(source: Path) -> str:
    """sha256 of a kernel's source file."""
    return hashlib.sha256(source.read_bytes()).hexdigest()


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this machine's first CPU (empty where /proc/cpuinfo has none)."""
    try:
        for line in _CPUINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def module_name(source: Path) -> str:
    """The built module's name for a numba source ``X_numba.py``: ``X_aot``, in the same package."""
    stem = source.stem
    if not stem.endswith("_numba"):
        raise ValueError(f"{source}: a kernel's numba source is named X_numba.py")
    return stem[: -len("_numba")] + "_aot"


def stamp_path(source: Path) -> Path:
    """Where the stamp of the module built from `source` lies: beside the source."""
    return source.with_name(module_name(source) + ".json")


def built_file(source: Path) -> Path | None:
    """The extension module file built from `source`, if one lies beside it."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = source.with_name(module_name(source) + suffix)
        if path.is_file():
            return path
    return None


def holding_stamp(source: Path) -> BuildStamp | None:
    """The stamp of a module built from today's `source`, for a CPU this one covers, when one
    lies beside it; else None."""
    stamp = BuildStamp.read(stamp_path(source))
    if stamp is None or built_file(source) is None:
        return None
    # no flags (no /proc/cpuinfo where it was built): nothing vouches for this CPU
    if stamp.source_sha256 != source_digest(source) or not stamp.cpu_flags or not set(stamp.cpu_flags) <= cpu_flags():
        return None
    return stamp


def stamp_holds(source: Path) -> bool:
    """Whether a module built from today's `source`, for a CPU this one covers, lies beside it."""
    return holding_stamp(source) is not None


def runnable(source: Path) -> bool:
    """Whether the kernel of `source` can run here: built and loadable, or numba importable to jit it."""
    return importlib.util.find_spec("numba") is not None or (enabled() and stamp_holds(source))


def load(package: str, source: Path) -> ModuleType | None:
    """The functions of the module built from `source` (in `package`), each :func:`guarded`, when
    built modules are enabled and its stamp holds; else None."""
    stamp = holding_stamp(source) if enabled() else None
    if stamp is None:
        return None
    name = module_name(source)
    built = importlib.import_module(f"{package}.{name}")
    kernel = ModuleType(f"{package}.{name}", f"the guarded functions of {built.__file__}")
    for fn, signature in stamp.exports:
        setattr(kernel, fn, guarded(getattr(built, fn), fn, signature))
    return kernel
