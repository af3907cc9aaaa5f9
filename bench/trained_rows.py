"""Embedding rows of a trained model, for the codec L2 benchmark (suite `codecs`, ``--rows``).

    python -m bench.run --suite trained-rows --out bench/results/trained_rows_d64.pt [--steps 2000] \
        [--set key=value ...]
    python -m bench.run --suite trained-rows --out rows.pt --no-train --run-dir DIR [--set <the job's overrides>]

Trains the job (2 gloo ranks, ``configs/debug_cpu.yaml`` plus ``--set`` overrides, fp32 checkpoints
to the filesystem sink, the last step checkpointed), exports its newest checkpoint with
``python -m trainer.ckpt_cli ... export`` and saves the weight rows that were trained, concatenated over
the tables, as one float32 ``[n, d]`` tensor. A row counts as trained when its optimizer state is
non-zero (row-wise Adagrad's accumulated squared gradient is > 0 exactly for rows that received a
gradient); rows still at their initial values are left out. Tables must share one width.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bench.common import Measurement, config_path, document_head, machine_info, scalars
from bench.quant_accuracy import DEFAULT_CONFIG, REPO, spawn
from common.process import run_main

CKPT = ["ckpt.enabled=true", "ckpt.sink.kind=filesystem", "ckpt.encoding.weights=fp32", "ckpt.encoding.optimizer=fp32"]


def trained_rows(model: dict) -> tuple[torch.Tensor, dict]:
    """(rows [n, d], per-table stats) of an exported model (`ckpt.restore.export`'s file: `tables`
    maps a table to the FQN of its weight in `model`; `optim` holds that weight's state, one
    tensor per state with a row per embedding row)."""
    parts, stats = [], {}
    for name, fqn in sorted(model["tables"].items()):
        w = model["model"][fqn].float()
        states = [
            v
            for v in model["optim"].get(fqn, {}).values()
            if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == w.shape[0]
        ]
        if states:
            touched = torch.zeros(w.shape[0], dtype=torch.bool)
            for v in states:
                touched |= (v.reshape(v.shape[0], -1) != 0).any(dim=1)
        else:  # no optimizer state exported: keep every row
            touched = torch.ones(w.shape[0], dtype=torch.bool)
        parts.append(w[touched])
        stats[name] = {"rows": w.shape[0], "trained": int(touched.sum()), "dim": w.shape[1]}
    dims = {p.shape[1] for p in parts}
    if len(dims) != 1:
        raise SystemExit(f"tables have different widths {sorted(dims)}: export them separately")
    return torch.cat(parts).contiguous(), stats


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="torch.save'd float32 [n, d] tensor")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="key=value")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--run-dir", type=Path, default=None, help="default: <out without suffix>.run")
    p.add_argument("--no-train", action="store_true", help="export an existing run in --run-dir")
    p.add_argument("--timeout", type=float, default=900)
    return p


def run(argv: list[str], prog: str = "python -m bench.run --suite trained-rows") -> dict[str, Any]:
    """Train (unless `--no-train`), export, save the trained rows; return what was saved."""
    args = parser(prog).parse_args(argv)
    config = config_path(args.config)
    run_dir = (args.run_dir or args.out.with_suffix(".run")).resolve()
    job = [*CKPT, *args.overrides]
    if not args.no_train:
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        spawn(
            Path(config),
            [*job, f"train.steps={args.steps}", "ckpt.schedule.final=true", "ckpt.restore.resume=none"],
            run_dir,
            2,
            args.timeout,
        )
    model_path = run_dir / "model.pt"
    cmd = [
        sys.executable,
        "-m",
        "trainer.ckpt_cli",
        "--config",
        config,
        f"run.dir={run_dir}",
        *job,
        "export",
        "--out",
        str(model_path),
    ]
    subprocess.run(cmd, cwd=REPO, check=True)
    model = torch.load(model_path, map_location="cpu", weights_only=False)
    rows, stats = trained_rows(model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rows, args.out)
    norms = rows.norm(dim=1)
    summary = {
        "out": str(args.out), "step": model["step"], "tables": stats, "rows": rows.shape[0], "dim": rows.shape[1],
        "mean_row_norm": norms.mean().item(), "value_min": rows.min().item(), "value_max": rows.max().item(),
        "value_std": rows.std().item(),
        "row_range_over_std": ((rows.amax(1) - rows.amin(1)) / rows.std(1)).mean().item(),
    }  # fmt: skip
    print(json.dumps(summary, indent=1))
    return {**document_head("trained-rows", prog, argv, machine_info()), "summary": summary}


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """What the saved rows are like (their count, width, norm and spread)."""
    s = result["summary"]
    figures = {k: s[k] for k in ("rows", "dim", "mean_row_norm", "value_min", "value_max", "value_std", "row_range_over_std")}
    return scalars(figures, {"out": s["out"], "step": s["step"]}, {"dim": "", "row_range_over_std": "ratio"})


def main(argv: list[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv, "python -m bench.trained_rows")
    return 0


if __name__ == "__main__":
    run_main(main)
