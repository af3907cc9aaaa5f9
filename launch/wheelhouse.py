"""Make a wheelhouse for `DELTAREC_WHEELHOUSE`: the wheels a machine without network lacks.

`python -m launch.wheelhouse 3.12 DIR` downloads, for that CPython on manylinux x86_64, what
`launch/setup.sh` installs on a CUDA torch (`launch.versions.COMMON`, torchmetrics, torchrec for
every row of the table) minus what the GPU machine already has (`GPU_MACHINE`), then the
dependencies of those wheels that it lacks too, until nothing is missing. fbgemm-gpu is left out
(hundreds of MB, one wheel per torch: fetch it separately into the same directory). A requirement
that a wheel in the wheelhouse or a version the machine has does not meet stops the script.

Run it on a machine with network; copy DIR over; then `DELTAREC_WHEELHOUSE=DIR bash launch/setup.sh`.
"""

from __future__ import annotations

import argparse
import email.parser
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

try:  # the library for requirement strings and markers; pip always carries a copy
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # pragma: no cover - a python with pip but no packaging
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename  # type: ignore[assignment]

from common.errors import DeltarecError
from launch.versions import COMMON, CUDA_TABLE, TORCHMETRICS_ANY

# The lent H100 (Python 3.12): what is installed there, with the version where it matters.
GPU_MACHINE: dict[str, str | None] = {
    "torch": "2.11.0+cu130", "torchmetrics": "1.9.0", "triton": "3.6.0", "numpy": None, "numba": None,
    "pyyaml": None, "matplotlib": None, "tensorboard": None, "pytest": None, "pytest-timeout": None,
    "pytest-xdist": None, "hypothesis": None, "tqdm": None, "pyre-extensions": None,
    "prometheus-client": None, "portalocker": None,
}  # fmt: skip
# Fetched separately (one 465 MB wheel per torch minor and CUDA major).
SEPARATE = frozenset({"fbgemm-gpu"})
# Installed --no-deps by setup.sh: their own requirements are not pip's to resolve.
NO_DEPS = frozenset({"torchrec"})
DEFAULT_PLATFORM = "manylinux_2_28_x86_64"


class WheelhouseError(DeltarecError):
    """A requirement the wheelhouse cannot meet: one line naming it."""


@dataclass(frozen=True)
class Wheel:
    """One wheel in the wheelhouse and what it asks for."""

    name: str  # canonical
    version: str
    requires: tuple[str, ...]  # Requires-Dist lines


def roots(has: dict[str, str | None]) -> list[str]:
    """What setup.sh asks pip for on a CUDA torch that the machine does not have."""
    wanted = [req for req in (*COMMON, TORCHMETRICS_ANY) if canonicalize_name(Requirement(req).name) not in has]
    return wanted + sorted({f"torchrec=={row.torchrec}" for row in CUDA_TABLE})


def read_wheels(where: Path) -> dict[str, list[Wheel]]:
    """The wheels in `where`, by canonical name."""
    found: dict[str, list[Wheel]] = {}
    for path in sorted(where.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        with zipfile.ZipFile(path) as archive:
            meta_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            meta = email.parser.Parser().parsestr(archive.read(meta_name).decode())
        requires = tuple(meta.get_all("Requires-Dist") or ())
        found.setdefault(str(name), []).append(Wheel(str(name), str(version), requires))
    return found


def missing(wheels: dict[str, list[Wheel]], has: dict[str, str | None], python: str) -> list[str]:
    """Requirements of the wheelhouse's wheels that neither it nor the machine meets yet.

    Raises when one is present but at a version that does not meet it (the wheelhouse cannot fix that).
    """
    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}  # fmt: skip
    wanted: dict[str, str] = {}
    for name, versions in wheels.items():
        if name in NO_DEPS:
            continue
        for wheel in versions:
            for line in wheel.requires:
                req = Requirement(line)
                if req.marker is not None and not req.marker.evaluate(env):
                    continue
                dep = canonicalize_name(req.name)
                if dep in SEPARATE:
                    continue
                if dep in wheels:
                    have = [w.version for w in wheels[dep]]
                elif dep in has:
                    known = has[dep]
                    if known is None:
                        continue  # on the machine, version unknown: pip will say if it does not fit
                    have = [known]
                else:
                    wanted.setdefault(dep, f"{req.name}{req.specifier}")
                    continue
                if not any(req.specifier.contains(v, prereleases=True) for v in have):
                    raise WheelhouseError(
                        f"wheelhouse: {wheel.name} {wheel.version} needs {line}, but only {dep} {', '.join(have)} is there"
                    )
    return sorted(wanted.values())


def platforms(platform: str) -> list[str]:
    """`platform` and the older manylinux tags a machine with it also runs (the pip here names only
    the one it is given; newer pips add them too)."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if match is None:
        return [platform]
    glibc, arch = int(match[1]), match[2]
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for minor, name in legacy.items() if minor <= glibc]


def download(requirements: list[str], dest: Path, python: str, platform: str) -> None:
    """pip download of binary wheels for the target, without their dependencies (we walk those)."""
    abi = "cp" + python.replace(".", "")
    tags = [arg for tag in platforms(platform) for arg in ("--platform", tag)]
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
        "--only-binary", ":all:", "--python-version", python, "--implementation", "cp", "--abi", abi,
        *tags, "--dest", str(dest), *requirements,
    ]  # fmt: skip
    done = subprocess.run(command)
    if done.returncode != 0:
        raise WheelhouseError(f"wheelhouse: pip download failed ({done.returncode}) for {' '.join(requirements)}")


def build(dest: Path, python: str, platform: str, has: dict[str, str | None]) -> dict[str, list[Wheel]]:
    """Download the roots, then whatever their wheels need that is not there, until nothing is."""
    dest.mkdir(parents=True, exist_ok=True)
    todo = roots(has)
    tried: set[str] = set()
    while todo:
        # one pip call cannot hold two versions of a name (torchrec's rows): one call per version
        batches: list[list[str]] = []
        for req in todo:
            name = canonicalize_name(Requirement(req).name)
            free = next((b for b in batches if all(canonicalize_name(Requirement(r).name) != name for r in b)), None)
            if free is None:
                batches.append(free := [])
            free.append(req)
        for batch in batches:
            download(batch, dest, python, platform)
        tried |= {canonicalize_name(Requirement(r).name) for r in todo}
        todo = missing(read_wheels(dest), has, python)
        again = [r for r in todo if canonicalize_name(Requirement(r).name) in tried]
        if again:
            raise WheelhouseError(f"wheelhouse: downloaded but still missing: {', '.join(again)}")
    return read_wheels(dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("python", help="target CPython version, e.g. 3.12")
    parser.add_argument("dest", type=Path, help="directory to fill (created if missing)")
    parser.add_argument("--platform", default=DEFAULT_PLATFORM, help=f"pip platform tag (default {DEFAULT_PLATFORM})")
    args = parser.parse_args(argv)
    try:
        wheels = build(args.dest, args.python, args.platform, GPU_MACHINE)
    except WheelhouseError as error:
        print(error, file=sys.stderr)
        return 2
    files = sorted(args.dest.glob("*.whl"))
    for path in files:
        print(f"{path.stat().st_size / 1e3:9.0f} kB  {path.name}")
    total = sum(p.stat().st_size for p in files)
    print(f"{total / 1e6:7.1f} MB  {len(files)} wheels ({len(wheels)} packages) in {args.dest}")
    print(
        f"fbgemm-gpu is not included: put the wheel for the machine's torch in {args.dest} or in a second "
        "directory (DELTAREC_WHEELHOUSE=DIR1:DIR2)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
