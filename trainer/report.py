"""`deltarec-report`: one picture and a few lines about a run, read from its metrics.jsonl.

    deltarec-report --config CONFIG [key=value ...] [--out PATH]

The job's own config (with the same overrides) names the run directory; the report reads
`<run_dir>/metrics.jsonl` and writes one PNG (default `<run_dir>/report.png`) with, over
training steps: the training loss and eval AUC; the bytes of every checkpoint (full or
delta, by weight encoding); the stall each checkpoint cost training; the time from a
checkpoint's step to its COMMIT marker (when it became restorable). Restores are vertical
lines on every panel. It then prints a short summary and the PNG's path.

A resumed run appends the records of every attempt to the same file, and after a restore
the steps go back to the restored checkpoint's. Records are therefore grouped into attempts
in file order and each attempt is drawn as its own line, so a line restarts at its restore.

matplotlib is the `report` extra (setup.cfg), not the core install: it is imported by the
functions that draw, so reading and summarizing metrics (`read_metrics`, `summarize`) need only
the core, and the command without it stops in one line naming the extra.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt.events import (
    CheckpointOutcome,
    CheckpointSkipped,
    Evaluation,
    Event,
    EventError,
    Restored,
    TrainWindow,
    read_event,
)
from common.errors import DeltarecError
from common.process import run_main
from trainer.config import load_config

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

#: what drawing imports from the `report` extra
REPORT_EXTRA = ("matplotlib",)


class ReportError(DeltarecError):
    """The run's metrics cannot be read: no file, or a line that is not a metrics record."""


class ReportExtraMissing(DeltarecError):
    """The `report` extra is not installed: which of its modules are missing, and the pip command."""


def require_report_extra() -> None:
    """Raise ReportExtraMissing unless every module of the `report` extra can be imported (found, not imported)."""
    missing = [name for name in REPORT_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise ReportExtraMissing(f"needs the report extra ({', '.join(missing)} not installed): pip install 'deltarec[report]'")


@dataclass
class Attempt:
    """What one process lifetime of the job logged, in file order. Every attempt but the
    first starts with its restore, when it had one."""

    restore: Restored | None = None
    windows: list[TrainWindow] = field(default_factory=list)
    evals: list[Evaluation] = field(default_factory=list)
    checkpoints: list[CheckpointOutcome] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # steps of checkpoints dropped under back-pressure
    coalesced: list[int] = field(default_factory=list)  # steps of checkpoints left to the next one


@dataclass
class RunMetrics:
    """Every record of a run's metrics.jsonl, grouped by attempt."""

    path: Path
    attempts: list[Attempt]

    def _all(self, pick: Callable[[Attempt], list[Any]]) -> list[Any]:
        return [x for a in self.attempts for x in pick(a)]

    @property
    def windows(self) -> list[TrainWindow]:
        return self._all(lambda a: a.windows)

    @property
    def evals(self) -> list[Evaluation]:
        return self._all(lambda a: a.evals)

    @property
    def checkpoints(self) -> list[CheckpointOutcome]:
        return self._all(lambda a: a.checkpoints)

    @property
    def skipped(self) -> list[int]:
        return self._all(lambda a: a.skipped)

    @property
    def coalesced(self) -> list[int]:
        return self._all(lambda a: a.coalesced)

    @property
    def restores(self) -> list[Restored]:
        return [a.restore for a in self.attempts if a.restore is not None]


# ---------------------------------------------------------------------------- reading


def read_metrics(path: Path) -> RunMetrics:
    """Parse a metrics.jsonl into attempts; each line is read as its event (ckpt/events.py).

    A new attempt starts at a restore, or (runs written before restores were recorded, or
    restarted without resuming) when a training window's step does not move past the previous
    window's. Events this report does not draw (partial restores, kinds a newer deltarec
    writes) are passed over, so newer runs still get a report; a line that is not an event
    (no integer `step`, a field missing or of the wrong type) is an error naming the line."""
    if not path.is_file():
        raise ReportError(f"{path}: no metrics file; has the run started? (check run.dir / run.name)")
    attempts = [Attempt()]
    last_window_step: int | None = None
    for lineno, text in enumerate(path.read_text().splitlines(), start=1):
        event = _read_line(path, lineno, text)
        if isinstance(event, Restored):
            attempts.append(Attempt(restore=event))
            last_window_step = None
        elif isinstance(event, CheckpointSkipped):
            (attempts[-1].coalesced if event.ckpt_coalesced else attempts[-1].skipped).append(event.step)
        elif isinstance(event, CheckpointOutcome):
            attempts[-1].checkpoints.append(event)
        elif isinstance(event, Evaluation):
            attempts[-1].evals.append(event)
        elif isinstance(event, TrainWindow):
            if last_window_step is not None and event.step <= last_window_step:
                attempts.append(Attempt())
            attempts[-1].windows.append(event)
            last_window_step = event.step
    first = attempts[0]
    if len(attempts) == 1 and not (first.windows or first.evals or first.checkpoints or first.skipped):
        raise ReportError(f"{path}: no metrics records yet (the run logs every train.log_every steps)")
    if attempts[0] == Attempt():  # the file began with a restore
        attempts.pop(0)
    return RunMetrics(path, attempts)


def _read_line(path: Path, lineno: int, text: str) -> Event:
    if not text.strip():
        raise ReportError(f"{path}:{lineno}: empty line; every line must be one JSON record")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}:{lineno}: not a JSON record ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(record, dict):
        raise ReportError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
    try:
        return read_event(record)
    except EventError as exc:
        raise ReportError(f"{path}:{lineno}: {exc}") from exc


# ---------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class Summary:
    """The numbers the report prints. Bytes count committed checkpoints; the stall counts
    every checkpoint taken (a failed one stalled training too); skipped ones took nothing."""

    final_step: int | None
    attempts: int
    final_eval: Evaluation | None
    committed: int
    failed: int
    skipped: int
    full_bytes: int
    delta_bytes: int
    bytes_by_encoding: dict[str, int]  # only checkpoints that recorded their encoding
    stall_ms: tuple[float, float] | None  # (median, max)
    durable_s: tuple[float, float] | None  # (median, max); None when no checkpoint recorded it
    restores: tuple[Restored, ...]
    coalesced: int = 0

    @property
    def total_bytes(self) -> int:
        return self.full_bytes + self.delta_bytes


def summarize(metrics: RunMetrics) -> Summary:
    """Reduce a run's records to the numbers the report prints."""
    ckpts = metrics.checkpoints
    done = [c for c in ckpts if c.ckpt_committed]
    by_encoding: dict[str, int] = {}
    for c in done:
        if c.ckpt_encoding is not None:
            by_encoding[c.ckpt_encoding] = by_encoding.get(c.ckpt_encoding, 0) + c.ckpt_bytes
    windows, evals = metrics.windows, metrics.evals
    return Summary(
        final_step=windows[-1].step if windows else None,
        attempts=len(metrics.attempts),
        final_eval=evals[-1] if evals else None,
        committed=len(done),
        failed=len(ckpts) - len(done),
        skipped=len(metrics.skipped),
        coalesced=len(metrics.coalesced),
        full_bytes=sum(c.ckpt_bytes for c in done if c.ckpt_full),
        delta_bytes=sum(c.ckpt_bytes for c in done if not c.ckpt_full),
        bytes_by_encoding=by_encoding,
        stall_ms=_median_max(c.ckpt_stall_ms for c in ckpts),
        durable_s=_median_max(c.ckpt_durable_s for c in done if c.ckpt_durable_s is not None),
        restores=tuple(metrics.restores),
    )


def _median_max(values: Iterable[float]) -> tuple[float, float] | None:
    vs = list(values)
    return (statistics.median(vs), max(vs)) if vs else None


def _size(n: float) -> str:
    """Bytes in the unit that keeps a small run's numbers readable."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_summary(s: Summary) -> str:
    """A few lines for a terminal."""
    attempts = f" over {s.attempts} attempts" if s.attempts > 1 else ""
    lines = [f"trained to step {s.final_step}{attempts}" if s.final_step is not None else "no training windows logged"]
    e = s.final_eval
    lines.append(f"final eval (step {e.step}): AUC {e.eval_auc:.4f}, log loss {e.eval_logloss:.4f}" if e else "no evaluation")
    if s.committed + s.failed + s.skipped == 0:
        lines.append("checkpoints: no checkpoints")
    else:
        coalesced = f", {s.coalesced} coalesced into the next" if s.coalesced else ""
        lines.append(f"checkpoints: {s.committed} committed, {s.failed} failed, {s.skipped} skipped{coalesced}")
        detail = f"full {_size(s.full_bytes)}, delta {_size(s.delta_bytes)}"
        if s.bytes_by_encoding:
            detail += "; " + ", ".join(f"{k} {_size(v)}" for k, v in sorted(s.bytes_by_encoding.items()))
        lines.append(f"bytes committed: {_size(s.total_bytes)} ({detail})")
        if s.stall_ms is not None:
            lines.append(f"stall per checkpoint: median {s.stall_ms[0]:.1f} ms, max {s.stall_ms[1]:.1f} ms")
        if s.durable_s is not None:
            lines.append(f"time to COMMIT: median {s.durable_s[0]:.2f} s, max {s.durable_s[1]:.2f} s")
    if s.restores:
        each = "; ".join(
            f"checkpoint {r.restored_ckpt} at step {r.step} (chain {list(r.restore_chain)}, {_size(r.restore_bytes)} in "
            f"{r.restore_s:.2f} s)"
            for r in s.restores
        )
        lines.append(f"restores: {len(s.restores)}: {each}")
    else:
        lines.append("restores: none")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- picture

_FULL, _DELTA, _FAILED, _RESTORE, _SKIP = "tab:blue", "tab:cyan", "tab:red", "tab:purple", "tab:gray"
_LOSS, _AUC = "tab:blue", "tab:orange"
_HATCHES = ["", "///", "xxx", "...", "\\\\\\", "+++", "ooo"]


def plot(metrics: RunMetrics, out: Path, title: str) -> None:
    """Write the report's figure to the PNG `out`."""
    try:
        figure(metrics, title).savefig(out, dpi=100)
    except OSError as exc:
        raise ReportError(f"cannot write the report to {out}: {exc.strerror or exc}") from exc


def figure(metrics: RunMetrics, title: str) -> Figure:
    """The report's panels on one Agg figure (no display needed): loss and AUC, then, when
    the run took checkpoints, bytes, stall and time to COMMIT; all over training steps."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    has_ckpts = bool(metrics.checkpoints or metrics.skipped)
    fig = Figure(figsize=(11, 13 if has_ckpts else 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(4 if has_ckpts else 1, 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(title, fontsize=13)
    _loss_auc_panel(axes[0], metrics, has_ckpts)
    if has_ckpts:
        _bytes_panel(axes[1], metrics)
        _stall_panel(axes[2], metrics)
        _durable_panel(axes[3], metrics)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        for r in metrics.restores:
            ax.axvline(r.step, color=_RESTORE, linestyle="--", linewidth=1.5)
    for r in metrics.restores:
        axes[0].annotate(
            f"restore of ckpt {r.restored_ckpt}",
            xy=(r.step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3),
            textcoords="offset points",
            ha="left",
            va="top",
            fontsize=8,
            color=_RESTORE,
        )
    axes[-1].set_xlabel("training step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def _legend(ax: Axes, handles: list[Any], right_axis: bool = False) -> None:
    """Beside the panel, where it hides no data."""
    if not handles:
        return
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.09 if right_axis else 1.01, 1.0), fontsize=8, borderaxespad=0)


def _zero_based(ax: Axes, values: list[float]) -> None:
    """A y axis from 0 with room above the highest value."""
    top = max(values, default=0)
    ax.set_ylim(0, top * 1.12 if top > 0 else 1)


def _restore_handle() -> list[Line2D]:
    from matplotlib.lines import Line2D

    return [Line2D([], [], color=_RESTORE, linestyle="--", label="restore (training resumed here)")]


def _loss_auc_panel(ax: Axes, m: RunMetrics, has_ckpts: bool) -> None:
    from matplotlib.lines import Line2D

    ax.set_title(
        "Training loss (left axis) and eval AUC (right axis)" + ("" if has_ckpts else ": no checkpoints in this run"), loc="left"
    )
    auc_ax = ax.twinx()
    redone = False
    for a, after in zip(m.attempts, m.attempts[1:] + [None]):
        # What an attempt logged past the step the next one restored was trained again: faded.
        cut = after.restore.step if after is not None and after.restore is not None else None
        for points, axis, value, color, marker in (
            (a.windows, ax, lambda w: w.loss, _LOSS, "."),
            (a.evals, auc_ax, lambda e: e.eval_auc, _AUC, "o"),
        ):
            kept = [p for p in points if cut is None or p.step <= cut]
            lost = [p for p in points if cut is not None and p.step >= cut]  # joined to `kept` at the cut
            if kept:
                axis.plot([p.step for p in kept], [value(p) for p in kept], color=color, marker=marker)
            if cut is not None and any(p.step > cut for p in lost):
                axis.plot([p.step for p in lost], [value(p) for p in lost], color=color, marker=marker, alpha=0.35, linestyle=":")
                redone = True
    ax.set_ylabel("training loss", color=_LOSS)
    auc_ax.set_ylabel("eval AUC", color=_AUC)
    handles = [
        Line2D([], [], color=_LOSS, marker=".", label="training loss (mean over the logging window)"),
        Line2D([], [], color=_AUC, marker="o", label="eval AUC"),
    ]
    if redone:
        handles.append(
            Line2D(
                [],
                [],
                color="gray",
                marker=".",
                alpha=0.5,
                linestyle=":",
                label="logged before a crash, past the restored step (trained again)",
            )
        )
    if not m.windows and not m.evals:
        ax.text(0.5, 0.5, "no training windows or evaluations logged", transform=ax.transAxes, ha="center")
    _legend(ax, handles + (_restore_handle() if m.restores else []), right_axis=True)


def _bytes_panel(ax: Axes, m: RunMetrics) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import EngFormatter

    ckpts = m.checkpoints
    encodings = sorted({c.ckpt_encoding for c in ckpts if c.ckpt_encoding is not None})
    hatched = "; hatch: weight encoding" if encodings else ""
    ax.set_title(f"Bytes written per checkpoint (colour: full or delta{hatched})", loc="left")
    hatch = {e: _HATCHES[i % len(_HATCHES)] for i, e in enumerate(encodings)}
    width = _bar_width([c.step for c in ckpts] + m.skipped, [w.step for w in m.windows])
    for c in ckpts:
        color = _FULL if c.ckpt_full else _DELTA
        ax.bar(
            c.step,
            c.ckpt_bytes,
            width=width,
            color=color if c.ckpt_committed else "none",
            edgecolor=color if c.ckpt_committed else _FAILED,
            linewidth=0.8 if c.ckpt_committed else 2,
            hatch=hatch.get(c.ckpt_encoding, "") if c.ckpt_encoding is not None else "",
            hatchcolor="black",
        )
    if m.skipped:
        ax.plot(
            m.skipped,
            [0] * len(m.skipped),
            linestyle="none",
            marker="x",
            color=_SKIP,
            markersize=10,
            markeredgewidth=2,
            clip_on=False,
        )
    ax.yaxis.set_major_formatter(EngFormatter(unit="B"))
    ax.set_ylabel("bytes")
    handles: list[Any] = [Patch(color=_FULL, label="full"), Patch(color=_DELTA, label="delta")]
    handles += [Patch(facecolor="white", edgecolor="black", hatch=hatch[e], label=f"encoding {e}") for e in encodings]
    if any(not c.ckpt_committed for c in ckpts):
        handles.append(Patch(facecolor="none", edgecolor=_FAILED, linewidth=2, label="failed (never committed)"))
    if m.skipped:
        handles.append(Line2D([], [], linestyle="none", marker="x", color=_SKIP, label="skipped (writers behind)"))
    if m.restores:
        handles += _restore_handle()
    _zero_based(ax, [c.ckpt_bytes for c in ckpts])
    _legend(ax, handles)


def _bar_width(ckpt_steps: list[int], window_steps: list[int]) -> float:
    steps = sorted(set(ckpt_steps))
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    if gaps:
        return 0.6 * min(gaps)
    span = max(steps + window_steps) - min(steps + window_steps)
    return max(1.0, 0.02 * span)


def _per_checkpoint(ax: Axes, m: RunMetrics, value: Callable[[CheckpointOutcome], float | None]) -> None:
    """Committed checkpoints' markers, coloured full/delta, joined in file order within each attempt."""
    for a in m.attempts:
        pts = [(c, v) for c in a.checkpoints if c.ckpt_committed for v in [value(c)] if v is not None]
        if pts:
            ax.plot([c.step for c, _ in pts], [v for _, v in pts], color="lightgray", linewidth=1, zorder=1)
            ax.scatter(
                [c.step for c, _ in pts],
                [v for _, v in pts],
                c=[_FULL if c.ckpt_full else _DELTA for c, _ in pts],
                edgecolors="black",
                linewidths=0.5,
                zorder=2,
            )


def _kind_handles(m: RunMetrics, failed_label: str) -> list[Any]:
    from matplotlib.lines import Line2D

    handles: list[Any] = [
        Line2D([], [], linestyle="none", marker="o", markerfacecolor=_FULL, markeredgecolor="black", label="full"),
        Line2D([], [], linestyle="none", marker="o", markerfacecolor=_DELTA, markeredgecolor="black", label="delta"),
    ]
    if any(not c.ckpt_committed for c in m.checkpoints):
        handles.append(Line2D([], [], linestyle="none", marker="x", color=_FAILED, label=failed_label))
    return handles + (_restore_handle() if m.restores else [])


def _stall_panel(ax: Axes, m: RunMetrics) -> None:
    ax.set_title("Stall per checkpoint: time training paused to copy the rows (max over ranks)", loc="left")
    _per_checkpoint(ax, m, lambda c: c.ckpt_stall_ms)
    failed = [c for c in m.checkpoints if not c.ckpt_committed]
    if failed:
        ax.plot(
            [c.step for c in failed], [c.ckpt_stall_ms for c in failed], linestyle="none", marker="x", color=_FAILED, markersize=9
        )
    ax.set_ylabel("stall (ms)")
    _zero_based(ax, [c.ckpt_stall_ms for c in m.checkpoints])
    _legend(ax, _kind_handles(m, "failed checkpoint"))


def _durable_panel(ax: Axes, m: RunMetrics) -> None:
    ax.set_title("Time to COMMIT: from the checkpoint's stall to its COMMIT marker (restorable from then)", loc="left")
    ax.set_ylabel("time to COMMIT (s)")
    if not any(c.ckpt_durable_s is not None for c in m.checkpoints):
        msg = (
            "no checkpoint committed"
            if not any(c.ckpt_committed for c in m.checkpoints)
            else ("not recorded in this run's metrics (written by an older deltarec)")
        )
        ax.text(0.5, 0.5, msg, transform=ax.transAxes, ha="center", va="center", color="dimgray")
    _per_checkpoint(ax, m, lambda c: c.ckpt_durable_s)
    failed = [c for c in m.checkpoints if not c.ckpt_committed]
    if failed:
        ax.plot(
            [c.step for c in failed], [0] * len(failed), linestyle="none", marker="x", color=_FAILED, markersize=9, clip_on=False
        )
    durable = [c.ckpt_durable_s for c in m.checkpoints if c.ckpt_durable_s is not None]
    _zero_based(ax, durable)
    handles = _kind_handles(m, "failed (no COMMIT)")
    _legend(ax, handles if durable else handles[2:])


# ---------------------------------------------------------------------------- entry point


def report(metrics_path: Path, out: Path, title: str) -> str:
    """Read the metrics, write the PNG, return the text summary (ending with the PNG path)."""
    metrics = read_metrics(metrics_path)
    plot(metrics, out, title)
    return f"{format_summary(summarize(metrics))}\nreport: {out}"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deltarec-report", description="Plot and summarize a run from its metrics.jsonl.")
    p.add_argument("--config", required=True, help="the job's YAML config")
    p.add_argument("--out", type=Path, help="PNG to write (default: <run_dir>/report.png)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="the job's overrides")
    return p.parse_intermixed_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        require_report_extra()
        cfg = load_config(args.config, args.overrides, check_data=False)
        run_dir = cfg.run.run_dir
        out = args.out or run_dir / "report.png"
        print(report(run_dir / "metrics.jsonl", out, f"deltarec run {cfg.run.name}: {run_dir}"))
    except DeltarecError as exc:
        print(f"deltarec-report: error: {exc}", file=sys.stderr)
        return 2
    return 0


def cli() -> None:
    """Console-script entry point."""
    run_main(main)


if __name__ == "__main__":
    cli()
