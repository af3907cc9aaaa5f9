"""Training throughput of a config: samples/s on N ranks against 1 rank of the same model.

    python -m bench.train_throughput --config configs/quickstart.yaml --steps 1500 [--out results.json]

Each measurement is a real torchrun job (the quickstart's own launcher); samples/s is read
from its metrics.jsonl, skipping the first logged window (start-up, allocator warm-up).
Both runs happen in one invocation so their ratio is comparable on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]


def measure(config: str, ranks: int, steps: int, log_every: int, workdir: Path) -> dict:
    run_dir = workdir / f"ranks{ranks}"
    cmd = [
        sys.executable, "-m", "launch.torchrun", f"--nproc-per-node={ranks}", "--config", config,
        f"run.dir={run_dir}", f"train.steps={steps}", f"train.log_every={log_every}",
        "train.eval_every=0", "train.eval_batches=0", "train.progress=log",
    ]
    if ranks == 1:
        # table_row_wise / row_wise / column_wise all degenerate to one shard on one rank.
        cmd.append("sharding.default=table_wise")
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in records if "samples_per_s" in r][1:]
    return {"ranks": ranks, "samples_per_s_median": median(rates), "windows": len(rates), "steps": steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        multi = measure(args.config, args.ranks, args.steps, args.log_every, Path(tmp))
        single = measure(args.config, 1, args.steps, args.log_every, Path(tmp))
    result = {
        "benchmark": "train_throughput",
        "config": args.config,
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "multi": multi,
        "single": single,
        "speedup_vs_1_rank": multi["samples_per_s_median"] / single["samples_per_s_median"],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
