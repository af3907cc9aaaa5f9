"""Training throughput of a config: samples/s on N ranks against 1 rank of the same model.

    python -m bench.run --suite throughput [--config configs/quickstart.yaml] [--steps 1500] [--out results.json]

Each measurement is a real torchrun job (the quickstart's own launcher); samples/s is read
from its metrics.jsonl, skipping the first logged window (start-up, allocator warm-up).
Both runs happen in one invocation so their ratio is comparable on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import REPO, Measurement, config_path, document_head, loadavg, machine_info, median_of, scalars


def measure(config: str, ranks: int, steps: int, log_every: int, workdir: Path) -> dict:
    """One torchrun job of `ranks` ranks: its median samples/s over the windows after the first."""
    from launch.ranks import read_metrics

    run_dir = workdir / f"ranks{ranks}"
    cmd = [
        sys.executable,
        "-m",
        "launch.torchrun",
        f"--nproc-per-node={ranks}",
        "--config",
        config,
        f"run.dir={run_dir}",
        f"train.steps={steps}",
        f"train.log_every={log_every}",
        "train.eval_every=0",
        "train.eval_batches=0",
        "train.progress=log",
    ]
    if ranks == 1:
        # table_row_wise / row_wise / column_wise all degenerate to one shard on one rank.
        cmd.append("sharding.default=table_wise")
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    rates = [r["samples_per_s"] for r in read_metrics(run_dir) if "samples_per_s" in r][1:]
    return {"ranks": ranks, "samples_per_s_median": median_of(rates), "windows": len(rates), "steps": steps}


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--out", type=Path)
    return p


def run(argv: list[str], prog: str = "python -m bench.run --suite throughput") -> dict[str, Any]:
    """Run both jobs, print and (`--out`) write the result document; return it."""
    args = parser(prog).parse_args(argv)
    config = config_path(args.config)
    machine = machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        multi = measure(config, args.ranks, args.steps, args.log_every, Path(tmp))
        single = measure(config, 1, args.steps, args.log_every, Path(tmp))
    machine["loadavg_end"] = loadavg()
    result = {
        **document_head("throughput", prog, argv, machine),
        "config": config,
        "multi": multi,
        "single": single,
        "speedup_vs_1_rank": multi["samples_per_s_median"] / single["samples_per_s_median"],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """samples/s of each job and their ratio."""
    out = []
    for job in (result["multi"], result["single"]):
        out += scalars({"samples_per_s": job["samples_per_s_median"]}, {"config": result["config"], "ranks": job["ranks"]})
    speedup = {"speedup_vs_1_rank": result["speedup_vs_1_rank"]}
    return out + scalars(speedup, {"config": result["config"]}, {"speedup_vs_1_rank": "ratio"})


def main(argv: list[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv, "python -m bench.train_throughput")
    return 0


if __name__ == "__main__":
    sys.exit(main())
