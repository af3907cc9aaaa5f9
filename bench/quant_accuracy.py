"""Model accuracy after L restores from quantized checkpoints (Check-N-Run, NSDI'22, Fig. 14).

    python -m bench.run --suite accuracy [--out results.json] [--plot-dir docs/img] [--steps 1500] ...

For every cell (a setting, L restores) one job of ``--steps`` steps is trained on 2 gloo ranks
(the synthetic learnable click stream, ``configs/debug_cpu.yaml`` with ``--set`` overrides, by
default ``optimizer.sparse.lr=0.2``), checkpointing continuously to the filesystem sink, and split
into L + 1 segments at ``s_i = round(i * steps / (L + 1))``: segment 0 trains from scratch to
``s_1``; segment i is a *new process* that resumes with ``ckpt.restore.resume=latest`` and trains to
``s_{i+1}``. ``ckpt.schedule.final`` checkpoints the last step of each segment, so restore i starts from the
quantized rows of step ``s_i``. Each restore is checked: the resumed rank 0 must print the expected
step, and the COMMIT marker it restored must name the expected weight codec.

Settings (``--settings``):

* ``default``: the bit-width policy, ``ckpt.encoding.expected_restores=L`` with the job's
  ``ckpt.encoding.restore_bit_widths`` (deltarec's default: 4-bit for L <= 3, 8-bit beyond; 8-bit once
  restored more often than expected); ``--set ckpt.encoding.restore_bit_widths=check_n_run`` measures
  Check-N-Run's table (2-bit for L = 1, 3-bit for L <= 3, 4-bit for L <= 20), ``--set
  "ckpt.encoding.restore_bit_widths=[[1,2],[10,4]]"`` any other.
* ``adaptive2|adaptive3|adaptive4|asym8`` (or any codec name): ``ckpt.encoding.weights=<name>``. A cell that
  is the same job as a default-policy cell (with deltarec's table ``adaptive4@1|3``, ``asym8@10|20``)
  is reported from that cell instead of being trained again (``--no-dedupe`` runs it anyway).
* controls (``--controls setting@L``): ``fp32`` (restores must be exact: zero degradation) and
  ``fp16`` (a near-lossless perturbation: how far any perturbed run drifts; the noise floor).

The reference is the same job never interrupted (one segment, fp32 checkpoints). Training is
deterministic (fp32 restores are bit-exact, docs/design/invariants.md, invariant 2), so every number repeats
exactly; the only differences between cells are the quantized restores. Reported per cell, from
``metrics.jsonl``: the final eval log loss and AUC (``train.eval_batches`` fixed held-out batches
of every rank) as ``(logloss_L - logloss_ref) / logloss_ref`` in percent and as an AUC difference,
the same averaged over the evals of the last ``--tail`` of the run (steadier), and the *lifetime*
log loss: the mean training loss over every step of the job, each batch scored just before the
model trains on it. Check-N-Run's Fig. 14 plots "lifetime accuracy"; read as this progressive
measure, a restore's damage counts for as long as it lasts, not only at the end. ``--work-dir``
with ``--keep-runs --reuse`` keeps the runs and re-summarizes (or completes) them without
re-training finished cells.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean, stdev
from typing import Any

from bench.common import Measurement, config_path, document_head, figure, loadavg, machine_info, scalars
from common.process import run_main

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "debug_cpu.yaml"
# Embedding lr 0.2 (debug_cpu has 0.05): the job leaves its fast-learning phase by ~1000 steps, so the
# final evals compare models near a plateau, not at different points of a steep learning curve.
DEFAULT_OVERRIDES = ("optimizer.sparse.lr=0.2",)
RESUMED = re.compile(r"deltarec: resumed from checkpoint (\d+) at step (\d+)")


@dataclass
class Cell:
    setting: str
    restores: int
    control: bool = False
    run_dir: Path | None = None
    boundaries: list[int] = field(default_factory=list)
    codecs: list[str] = field(default_factory=list)  # weight codec of each restored checkpoint
    restored: list[tuple[int, int]] = field(default_factory=list)  # (checkpoint id, step)
    evals: list[dict] = field(default_factory=list)  # eval records of every segment
    lifetime: float = float("nan")  # mean training log loss over every step (Check-N-Run's lifetime measure)
    seconds: float = 0.0
    same_as: Cell | None = None  # a cell whose job is identical (reported, not re-run)

    @property
    def name(self) -> str:
        return f"{self.setting}@L{self.restores}"


def setting_overrides(setting: str, restores: int) -> list[str]:
    if setting == "default":
        return [f"ckpt.encoding.expected_restores={restores}"]
    if setting == "reference":
        return ["ckpt.encoding.weights=fp32"]
    return [f"ckpt.encoding.weights={setting}"]


def expected_codec(setting: str, expected_restores: int, restores_so_far: int, widths) -> str:
    """The weight codec a checkpoint written after `restores_so_far` restores must carry
    (`widths`: the job's ckpt.encoding.restore_bit_widths)."""
    if setting == "default":
        from ckpt.quant import BitWidthPolicy

        policy = BitWidthPolicy(expected_restores=expected_restores, restores_so_far=restores_so_far, widths=widths)
        return policy.weight_codec()
    return "fp32" if setting == "reference" else setting


def boundaries(steps: int, restores: int) -> list[int]:
    """Segment ends s_1 < ... < s_L < steps, spread evenly."""
    b = [round(i * steps / (restores + 1)) for i in range(1, restores + 1)] + [steps]
    if len(set(b)) != len(b) or b[0] < 1:
        raise SystemExit(f"--steps {steps} is too short for {restores} restores")
    return b


def spawn(config: Path, overrides: list[str], run_dir: Path, world_size: int, timeout_s: float) -> str:
    """Run `world_size` ranks of `python -m trainer.main` in `run_dir` (file rendezvous); return
    rank 0's stdout. A failing or hung rank kills the others and raises."""
    from launch.ranks import start_ranks

    group = start_ranks(config, [*overrides, f"run.dir={run_dir}"], run_dir, world_size, timeout_s)
    return group.wait()[0].stdout


def marker_codecs(config: Path, overrides: list[str]) -> dict[int, dict]:
    """checkpoint id -> {step, weights, optimizer, full} of every COMMIT marker of the run."""
    from ckpt.log.backend import open_backend
    from ckpt.log.catalog import commits
    from trainer.config import load_config

    cfg = load_config(config, overrides, check_data=False)
    backend = open_backend(cfg.ckpt.run_id, cfg.ckpt.sink, world_size=1)
    try:
        found = commits(backend.markers.read_markers(), cfg.ckpt.run_id)
    finally:
        backend.close()
    return {m.checkpoint_id: {"step": m.step, "full": m.chain[-1].full if m.chain else None, **m.encodings} for _, m in found}


def read_evals(run_dir: Path) -> list[dict]:
    from launch.ranks import read_metrics

    keys = ("step", "eval_logloss", "eval_auc", "eval_samples")
    return [{k: r[k] for k in keys} for r in read_metrics(run_dir) if "eval_logloss" in r]


def read_train_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, mean training loss of the window ending there) of every segment, in order."""
    from launch.ranks import read_metrics

    return [(int(r["step"]), float(r["loss"])) for r in read_metrics(run_dir) if "loss" in r]


def lifetime_logloss(windows: list[tuple[int, float]], steps: int) -> float:
    """Mean training log loss over steps 1..`steps`, each step's batch scored by the model just
    before it trained on it (progressive validation, our reading of Check-N-Run's "lifetime
    accuracy"). The trainer logs a window mean every `train.log_every` steps and at the end of each
    segment, so window k covers the steps after window k-1; every step must be covered exactly once."""
    total, prev = 0.0, 0
    for step, loss in windows:
        if step <= prev:
            raise ValueError(f"training-loss windows overlap or repeat at step {step} (previous window ended at {prev})")
        total += loss * (step - prev)
        prev = step
    if prev != steps:
        raise ValueError(f"training-loss windows end at step {prev}, expected {steps}")
    return total / steps


def run_cell(cell: Cell, args, base: list[str], work: Path) -> None:
    run_dir = work / cell.name.replace("@", "-")
    done = run_dir / "cell.json"
    common = [*base, *setting_overrides(cell.setting, cell.restores)]
    if args.reuse and done.exists():
        d = json.loads(done.read_text())
        if d["overrides"] == common and d["steps"] == args.steps:
            cell.run_dir, cell.boundaries, cell.codecs = run_dir, d["boundaries"], d["codecs"]
            cell.restored, cell.seconds = [tuple(x) for x in d["restored"]], d["seconds"]
            cell.evals = read_evals(run_dir)
            cell.lifetime = lifetime_logloss(read_train_losses(run_dir), args.steps)
            print(f"  {cell.name:16s} reused from {run_dir}", flush=True)
            return
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cell.run_dir = run_dir
    L = 0 if cell.setting == "reference" else cell.restores
    cell.boundaries = boundaries(args.steps, L)
    t0 = time.perf_counter()
    prev = 0
    for i, end in enumerate(cell.boundaries):
        ov = [*common, f"train.steps={end}", f"ckpt.restore.resume={'latest' if i else 'none'}"]
        ts = time.perf_counter()
        out = spawn(args.config, ov, run_dir, 2, args.timeout)
        if i:
            m = RESUMED.search(out)
            if not m or int(m.group(2)) != prev:
                raise RuntimeError(
                    f"{cell.name} segment {i}: expected a restore at step {prev}, rank 0 printed: "
                    f"{m.group(0) if m else 'no resume line'}"
                )
            cell.restored.append((int(m.group(1)), int(m.group(2))))
        print(f"  {cell.name:16s} segment {i:2d}: steps {prev:5d} -> {end:5d}  {time.perf_counter() - ts:5.1f} s", flush=True)
        prev = end
    cell.seconds = time.perf_counter() - t0
    markers = marker_codecs(args.config, [f"run.dir={run_dir}", *common])
    for k, (cid, step) in enumerate(cell.restored):
        got = markers[cid]
        want = expected_codec(cell.setting, cell.restores, k, args.widths)
        if got["step"] != step or got.get("weights") != want:
            raise RuntimeError(
                f"{cell.name}: restore {k + 1} read checkpoint {cid} (step {got['step']}) written with "
                f"{got.get('weights')!r}, expected {want!r} at step {step}"
            )
        cell.codecs.append(got["weights"])
    cell.evals = read_evals(run_dir)
    cell.lifetime = lifetime_logloss(read_train_losses(run_dir), args.steps)
    if cell.evals[-1]["step"] != args.steps:
        raise RuntimeError(f"{cell.name}: last eval at step {cell.evals[-1]['step']}, expected {args.steps}")
    done.write_text(json.dumps({
        "overrides": common, "steps": args.steps, "boundaries": cell.boundaries, "codecs": cell.codecs,
        "restored": cell.restored, "seconds": cell.seconds,
    }))  # fmt: skip


def dedupe(cells: list[Cell], widths) -> None:
    """An explicit `adaptiveN@L` cell whose every checkpoint uses the codec the default policy
    picks for L is the same job as `default@L` (same config, same codec at every checkpoint,
    deterministic training): point it at that cell instead of running it again."""
    default = {c.restores: c for c in cells if c.setting == "default" and not c.control}
    for c in cells:
        d = default.get(c.restores)
        if c.setting == "default" or c.control or d is None:
            continue
        if all(expected_codec("default", c.restores, k, widths) == c.setting for k in range(c.restores + 1)):
            c.same_as = d


def summarize(cells: list[Cell], ref: Cell, tail_from: int) -> list[dict]:
    """One row per cell: final-step eval against the reference, the mean over the evals at
    steps >= `tail_from` that the reference also has (the steadier figure), and the lifetime
    (mean training) log loss against the reference's."""
    r0 = ref.evals[-1]
    ref_at = {e["step"]: e for e in ref.evals}
    rows = []
    for c in cells:
        if c.same_as is not None:
            same = c.same_as
            c.codecs, c.restored, c.evals, c.lifetime = same.codecs, same.restored, same.evals, same.lifetime
        e = c.evals[-1]
        tail = [(x, ref_at[x["step"]]) for x in c.evals if x["step"] >= tail_from and x["step"] in ref_at]
        tail = list({x["step"]: (x, y) for x, y in tail}.values())  # a segment end may repeat a step
        rows.append({
            "setting": c.setting, "restores": c.restores, "control": c.control,
            "codecs": sorted(set(c.codecs)), "restore_steps": [s for _, s in c.restored],
            "eval_logloss": e["eval_logloss"], "eval_auc": e["eval_auc"], "eval_samples": e["eval_samples"],
            "logloss_rel_pct": 100.0 * (e["eval_logloss"] - r0["eval_logloss"]) / r0["eval_logloss"],
            "auc_delta": e["eval_auc"] - r0["eval_auc"],
            "tail_steps": [x["step"] for x, _ in tail],
            "tail_logloss_rel_pct": sum(100.0 * (x["eval_logloss"] - y["eval_logloss"]) / y["eval_logloss"]
                                        for x, y in tail) / max(len(tail), 1),
            "tail_auc_delta": sum(x["eval_auc"] - y["eval_auc"] for x, y in tail) / max(len(tail), 1),
            "lifetime_logloss": c.lifetime,
            "lifetime_logloss_rel_pct": 100.0 * (c.lifetime - ref.lifetime) / ref.lifetime,
            "segment_evals": c.evals, "seconds": round(c.seconds, 1),
            "same_run_as": c.same_as.name if c.same_as is not None else None,
        })  # fmt: skip
    return rows


def table(rows: list[dict], restores: list[int], key: str = "logloss_rel_pct", auc: str | None = "auc_delta") -> str:
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    head = "| setting | codec | " + " | ".join(f"L = {L}" for L in restores) + " |"
    lines = [head, "|---|---|" + "---:|" * len(restores)]
    for s in settings:
        rs = {r["restores"]: r for r in rows if r["setting"] == s}
        codecs = ", ".join(dict.fromkeys(c for L in restores if L in rs for c in rs[L]["codecs"]))
        cells = []
        for L in restores:
            r = rs.get(L)
            value = f"{r[key]:+.4f}%" + (f" / {r[auc]:+.5f}" if auc else "") if r is not None else "–"
            cells.append(value + ("¹" if r is not None and r["same_run_as"] else ""))
        lines.append(f"| {s} | {codecs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(
    rows: list[dict], restores: list[int], goal_pct: float, floor: dict, plot_dir: Path, name: str = "quant_accuracy_restores.png"
) -> str:
    """Check-N-Run's Fig. 14 in shape: per measure, the degradation of every setting against
    the restores, the goal line and the fp16 control's band."""
    styles = {"default": ("k", "o", 2.2), "adaptive2": ("C3", "v", 1.4), "adaptive3": ("C1", "^", 1.4),
              "adaptive4": ("C2", "s", 1.4), "asym8": ("C0", "D", 1.4), "fp16": ("0.55", "x", 1.0),
              "fp32": ("0.75", "+", 1.0)}  # fmt: skip
    panels = [
        ("logloss_rel_pct", "final eval log loss vs uninterrupted (%)", "log loss, last step", floor.get("final_pct")),
        ("tail_logloss_rel_pct", "mean over the last 20% of evals (%)", "log loss, mean of last evals",
         floor.get("tail_pct")),
        ("lifetime_logloss_rel_pct", "mean training log loss over all steps (%)", "lifetime log loss (Check-N-Run)",
         floor.get("lifetime_pct")),
        ("auc_delta", "final eval AUC minus uninterrupted", "AUC, last step", None),
    ]  # fmt: skip
    f = plot_dir / name
    with figure(f, 1, 4, figsize=(20, 4.4)) as (fig, axes):
        for ax, (key, ylabel, title, band) in zip(axes, panels):
            for s in dict.fromkeys(r["setting"] for r in rows):
                pts = sorted((r["restores"], r[key], r.get(key + "_sd")) for r in rows if r["setting"] == s)
                color, marker, lw = styles.get(s, (None, "o", 1.2))
                control = any(r["control"] for r in rows if r["setting"] == s)
                label = "default policy (expected_restores = L)" if s == "default" else s + (" (control)" if control else "")
                sd = [p[2] for p in pts] if all(p[2] is not None for p in pts) else None  # mean +- sd over seeds
                ax.errorbar(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    yerr=sd,
                    ls=":" if control else "-",
                    color=color,
                    marker=marker,
                    lw=lw,
                    capsize=3,
                    label=label,
                )
            ax.set_xscale("log")
            ax.set_xticks(restores)
            ax.set_xticklabels([str(L) for L in restores])
            ax.minorticks_off()
            ax.set_xlabel("restores from a quantized checkpoint (L)")
            ax.set_ylabel(ylabel)
            ax.set_title(title)
            ax.grid(True, alpha=0.3)
            ax.axhline(0.0, color="0.3", lw=0.8)
            if key != "auc_delta":
                ax.set_yscale("symlog", linthresh=goal_pct)
                ax.axhline(goal_pct, color="r", ls="--", lw=1, label=f"goal: +{goal_pct}%")
                if band:
                    ax.axhspan(-band, band, color="0.85", alpha=0.6, lw=0, label=f"fp16 control: ±{band:.3f}%")
        axes[0].legend(fontsize=7.5)
    return str(f)


def make_cells(args) -> list[Cell]:
    # controls first (they say how far any perturbed run drifts), then by L, so that the longest
    # (optional) column comes last
    cells = [Cell(s, int(L), control=True) for s, L in (c.split("@") for c in args.controls)]
    cells += [Cell(s, L) for L in args.restores for s in args.settings if f"{s}@{L}" not in args.skip]
    if not args.no_dedupe:
        dedupe(cells, args.widths)
    return cells


def run_grid(args, base: list[str], work: Path) -> dict:
    """Train the reference and every cell in `work`; return the summary of this one grid."""
    cells = make_cells(args)
    ref = Cell("reference", 0)
    work.mkdir(parents=True, exist_ok=True)
    n_seg = 1 + sum(c.restores + 1 for c in cells if c.same_as is None)
    print(f"# {len(cells) + 1} jobs, {n_seg} segments (processes x 2 ranks), run dirs in {work}", flush=True)
    t0 = time.perf_counter()
    run_cell(ref, args, base, work)
    r0 = ref.evals[-1]
    print(
        f"  reference: eval log loss {r0['eval_logloss']:.6f}, AUC {r0['eval_auc']:.5f}, lifetime log loss {ref.lifetime:.6f}",
        flush=True,
    )
    for c in cells:
        if c.same_as is not None:
            print(f"  {c.name:16s} is the same job as {c.same_as.name}: not run again", flush=True)
            continue
        run_cell(c, args, base, work)
        e = c.evals[-1]
        rel = 100 * (e["eval_logloss"] - r0["eval_logloss"]) / r0["eval_logloss"]
        life = 100 * (c.lifetime - ref.lifetime) / ref.lifetime
        print(
            f"  {c.name:16s} codecs {sorted(set(c.codecs))}: log loss {e['eval_logloss']:.6f} ({rel:+.4f}%), "
            f"AUC {e['eval_auc']:.5f}, lifetime {life:+.4f}%  [{c.seconds:.0f} s, total {time.perf_counter() - t0:.0f} s]",
            flush=True,
        )
    rows = summarize(sorted(cells, key=lambda c: c.control), ref, round(args.steps * (1 - args.tail)))
    fp16 = [r for r in rows if r["setting"] == "fp16"]
    floor = {
        "final_pct": max((abs(r["logloss_rel_pct"]) for r in fp16), default=None),
        "tail_pct": max((abs(r["tail_logloss_rel_pct"]) for r in fp16), default=None),
        "lifetime_pct": max((abs(r["lifetime_logloss_rel_pct"]) for r in fp16), default=None),
    }
    res = {
        "segments": n_seg,
        "seconds_all_cells": round(ref.seconds + sum(c.seconds for c in cells if c.same_as is None), 1),
        "reference": {"eval_logloss": r0["eval_logloss"], "eval_auc": r0["eval_auc"], "lifetime_logloss": ref.lifetime,
                      "eval_samples": r0["eval_samples"], "seconds": round(ref.seconds, 1), "evals": ref.evals},
        "goal_pct": args.goal,
        "noise_floor_fp16": floor,
        "cells": rows,
    }  # fmt: skip
    main_rows = [r for r in rows if r["setting"] == "default"]
    if main_rows:
        res["goal_holds_default_policy"] = {
            "final": all(r["logloss_rel_pct"] < args.goal for r in main_rows),
            "tail_mean": all(r["tail_logloss_rel_pct"] < args.goal for r in main_rows),
            "lifetime": all(r["lifetime_logloss_rel_pct"] < args.goal for r in main_rows),
            # per measure: can a degradation of `goal` be told apart from the drift of a near-lossless (fp16) run?
            "resolvable": {
                k: None if floor[f] is None else floor[f] < args.goal
                for k, f in (("final", "final_pct"), ("tail_mean", "tail_pct"), ("lifetime", "lifetime_pct"))
            },
        }
    all_L = sorted({r["restores"] for r in rows})
    res["table_md"] = table(rows, all_L)
    res["table_tail_md"] = table(rows, all_L, "tail_logloss_rel_pct", "tail_auc_delta")
    res["table_lifetime_md"] = table(rows, all_L, "lifetime_logloss_rel_pct", None)
    print("final step: rel. log loss / AUC delta\n" + res["table_md"])
    print("mean of the last evals: rel. log loss / AUC delta\n" + res["table_tail_md"])
    print("lifetime (mean training log loss over all steps): rel. log loss\n" + res["table_lifetime_md"])
    print(f"fp16 control (noise floor): {floor}")
    return res


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (NaN for a single value)."""
    return fmean(xs), stdev(xs) if len(xs) > 1 else float("nan")


def combine_seeds(grids: dict[int, dict], goal: float) -> dict:
    """Per cell, the mean and sample standard deviation over seeds of the paired degradations
    (each seed's cell against that seed's own uninterrupted run). The fp16 controls' spread is
    the drift of a near-lossless run; its standard error over seeds is the resolution."""
    by_cell: dict[tuple[str, int], list[dict]] = {}
    for g in grids.values():
        for r in g["cells"]:
            by_cell.setdefault((r["setting"], r["restores"]), []).append(r)
    cells = []
    for (setting, L), rs in by_cell.items():
        out = {"setting": setting, "restores": L, "control": rs[0]["control"], "n": len(rs),
               "codecs": sorted({c for r in rs for c in r["codecs"]})}  # fmt: skip
        for key in ("logloss_rel_pct", "tail_logloss_rel_pct", "lifetime_logloss_rel_pct", "auc_delta", "tail_auc_delta"):
            out[key], out[key + "_sd"] = _mean_sd([r[key] for r in rs])
            out[key + "_per_seed"] = [r[key] for r in rs]
        cells.append(out)
    fp16 = [r for (setting, _), rs in by_cell.items() if setting == "fp16" for r in rs]
    n = len(grids)
    floor = {}
    for key in ("logloss_rel_pct", "tail_logloss_rel_pct", "lifetime_logloss_rel_pct"):
        vals = [r[key] for r in fp16]
        rms = (sum(v * v for v in vals) / len(vals)) ** 0.5 if vals else None
        floor[key] = {"rms_single_run": rms, "se_of_seed_mean": None if rms is None else rms / n**0.5}
    default = [c for c in cells if c["setting"] == "default"]
    return {
        "seeds": sorted(grids), "cells": cells, "noise_fp16": floor,
        "goal_holds_default_policy_mean": {
            "final": all(c["logloss_rel_pct"] < goal for c in default),
            "tail_mean": all(c["tail_logloss_rel_pct"] < goal for c in default),
            "lifetime": all(c["lifetime_logloss_rel_pct"] < goal for c in default),
        },
    }  # fmt: skip


def seeds_table(cells: list[dict], key: str) -> str:
    restores = sorted({c["restores"] for c in cells})
    lines = ["| setting | codec | " + " | ".join(f"L = {L}" for L in restores) + " |",
             "|---|---|" + "---:|" * len(restores)]  # fmt: skip
    for s in dict.fromkeys(c["setting"] for c in cells):
        rs = {c["restores"]: c for c in cells if c["setting"] == s}
        codecs = ", ".join(dict.fromkeys(x for L in restores if L in rs for x in rs[L]["codecs"]))
        vals = [f"{rs[L][key]:+.4f}% ± {rs[L][key + '_sd']:.4f}" if L in rs else "–" for L in restores]
        lines.append(f"| {s} | {codecs} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/quant_accuracy.json")
    p.add_argument("--plot-dir", default=None, help="write quant_accuracy_restores.png here")
    p.add_argument("--plot-name", default="quant_accuracy_restores.png", help="file name of the plot")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument(
        "--set",
        dest="overrides",
        nargs="*",
        default=list(DEFAULT_OVERRIDES),
        metavar="key=value",
        help=f"config overrides for every run (default: {' '.join(DEFAULT_OVERRIDES)})",
    )
    p.add_argument(
        "--seeds",
        type=int,
        nargs="*",
        default=[],
        help="run the whole grid once per run.seed and report mean +- sd of the paired degradations",
    )
    p.add_argument("--steps", type=int, default=1500, help="training steps of every job")
    p.add_argument("--eval-batches", type=int, default=100, help="held-out batches per rank at each eval")
    p.add_argument(
        "--eval-every",
        type=int,
        default=150,
        help="train.eval_every: the last 20%% of the run's evals are averaged as a second, steadier figure",
    )
    p.add_argument("--tail", type=float, default=0.2, help="fraction of the run whose evals are averaged")
    p.add_argument("--interval", type=int, default=100, help="ckpt.schedule.interval_steps")
    p.add_argument("--settings", nargs="*", default=["default", "adaptive2", "adaptive3", "adaptive4", "asym8"])
    p.add_argument("--restores", type=int, nargs="*", default=[1, 3, 10, 20])
    p.add_argument(
        "--skip", nargs="*", default=["adaptive2@20", "adaptive3@20"], help="cells (setting@L) not to run, to fit the time budget"
    )
    p.add_argument("--controls", nargs="*", default=["fp32@3", "fp16@1", "fp16@3", "fp16@10"], help="control cells (setting@L)")
    p.add_argument(
        "--no-dedupe", action="store_true", help="also run explicit cells that are the same job as a default-policy cell"
    )
    p.add_argument("--goal", type=float, default=0.01, help="goal: relative log-loss degradation in percent")
    p.add_argument("--work-dir", type=Path, default=None, help="run directories (default: a temporary one)")
    p.add_argument("--keep-runs", action="store_true", help="keep the run directories")
    p.add_argument(
        "--reuse", action="store_true", help="with --work-dir: reuse cells already finished there with the same overrides"
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per segment")
    return p


def run(argv: list[str], prog: str = "python -m bench.run --suite accuracy") -> dict[str, Any]:
    """Train the grid, print the tables, write `--out` (and the plot); return the result document."""
    args = parser(prog).parse_args(argv)
    args.config = Path(config_path(args.config))
    base = [
        "ckpt.enabled=true", "ckpt.sink.kind=filesystem", f"ckpt.schedule.interval_steps={args.interval}",
        "ckpt.schedule.final=true", f"train.eval_batches={args.eval_batches}", f"train.eval_every={args.eval_every}",
        *args.overrides,
    ]  # fmt: skip
    from trainer.config import load_config

    # the default policy's table, as the jobs will read it (a --set may override it)
    args.widths = load_config(args.config, base, check_data=False).ckpt.encoding.bit_widths()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="deltarec-quant-acc-"))
    machine = machine_info()
    settings = {"config": str(args.config), "overrides": base, "steps": args.steps, "world_size": 2}
    t0 = time.perf_counter()
    try:
        if args.seeds:
            grids = {}
            for seed in args.seeds:
                print(f"## run.seed={seed}", flush=True)
                grids[seed] = run_grid(args, [*base, f"run.seed={seed}"], work / f"seed-{seed}")
        else:
            res = run_grid(args, base, work)
    finally:
        if not args.keep_runs and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    machine["loadavg_end"] = loadavg()
    seconds = round(time.perf_counter() - t0, 1)  # this invocation (reused cells cost nothing)
    if args.seeds:
        res = {"per_seed": {str(k): v for k, v in grids.items()}, **combine_seeds(grids, args.goal)}
        res["goal_pct"] = args.goal
        res["table_md"] = seeds_table(res["cells"], "logloss_rel_pct")
        res["table_tail_md"] = seeds_table(res["cells"], "tail_logloss_rel_pct")
        res["table_lifetime_md"] = seeds_table(res["cells"], "lifetime_logloss_rel_pct")
        print(f"mean ± sd over seeds {args.seeds}, final step:\n" + res["table_md"])
        print("mean of the last evals:\n" + res["table_tail_md"])
        print("lifetime (mean training log loss over all steps):\n" + res["table_lifetime_md"])
        print(f"fp16 drift: {res['noise_fp16']}")
    res = {**document_head("accuracy", prog, argv, machine), "settings": settings, "seconds": seconds, **res}
    rows = res["cells"]
    if args.plot_dir:
        floor = res.get("noise_floor_fp16") or {
            "final_pct": res["noise_fp16"]["logloss_rel_pct"]["rms_single_run"],
            "tail_pct": res["noise_fp16"]["tail_logloss_rel_pct"]["rms_single_run"],
            "lifetime_pct": res["noise_fp16"]["lifetime_logloss_rel_pct"]["rms_single_run"],
        }
        res["plot"] = plot(rows, sorted({r["restores"] for r in rows}), args.goal, floor, Path(args.plot_dir), args.plot_name)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    holds = res.get("goal_holds_default_policy") or res.get("goal_holds_default_policy_mean")
    print(f"wrote {args.out} in {seconds:.0f} s; default policy under {args.goal}%: {holds}")
    return res


# what a cell reports against the uninterrupted job (and, over seeds, their standard deviations)
CELL_FIGURES = (
    "logloss_rel_pct",
    "tail_logloss_rel_pct",
    "lifetime_logloss_rel_pct",
    "auc_delta",
    "tail_auc_delta",
    "eval_logloss",
    "eval_auc",
    "lifetime_logloss",
)


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """Per cell (setting, restores): its degradations against the uninterrupted job (means
    and standard deviations when the grid ran over seeds)."""
    out = []
    seeds = result.get("seeds")
    for c in result["cells"]:
        labels = {
            "setting": c["setting"],
            "restores": c["restores"],
            "control": c["control"],
            "codecs": ",".join(c["codecs"]),
            **({"seeds": seeds} if seeds else {}),
        }
        keys = [k for name in CELL_FIGURES for k in (name, f"{name}_sd") if k in c]
        out += scalars({k: c[k] for k in keys}, labels)
    return out


def main(argv: list[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv, "python -m bench.quant_accuracy")
    return 0


if __name__ == "__main__":
    run_main(main)
