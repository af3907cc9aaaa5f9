"""How many of a checkpoint's rows the next steps update again (suite `retouch`): what a
copy-on-write snapshot holds aside (`ckpt.capture.copy_on_write`, docs/scale.md).

    python -m bench.run --suite retouch [--cap 1000000] [--interval 170] [--batch 2048] [--ranks 2]

The scale suite's Criteo-shaped synthetic stream (`bench.peers.CRITEO_KAGGLE` capped at
`--cap` rows per table, `trainer.data.synthetic.SyntheticClickStream`, seed 0), counted from
its batches without training: the rows one interval touches (steps `interval` to
`2 * interval`: a delta) and every row the first two intervals touch (what a full checkpoint
holds of the trained rows), then, step by step over the next interval, the share of each that
those steps touch again. A copy-on-write snapshot holds aside the rows touched again before
its writer reads them: this share at the steps the writer takes.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from bench.common import Measurement, document_head, machine_info
from bench.peers import CRITEO_KAGGLE
from common.process import run_main
from trainer.data.synthetic import SyntheticClickStream

REPORT_STEPS = (1, 2, 4, 8, 16, 32, 64, 128)


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--cap", type=int, default=1_000_000, help="rows per table at most (the scale suite's `full`: 1000000)")
    p.add_argument("--interval", type=int, default=170, help="steps between checkpoints")
    p.add_argument("--batch", type=int, default=2048, help="samples per rank and step")
    p.add_argument("--ranks", type=int, default=2, help="global batches per step")
    return p


def retouched(cap: int, interval: int, batch: int, ranks: int) -> dict[str, Any]:
    """The shares of a delta's rows and of the trained rows touched again within 1..interval steps."""
    sizes = [min(n, cap) for n in CRITEO_KAGGLE]
    names = [f"t{i}" for i in range(len(sizes))]
    stream = SyntheticClickStream(
        feature_names=names, num_embeddings=sizes, num_dense=13, batch_size=batch, rank=0, world_size=1, seed=0
    )
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)

    def rows_of_step(step: int) -> np.ndarray:
        kjts = [stream.batch_at(g).sparse_features for g in range(step * ranks, (step + 1) * ranks)]
        flat = [
            kjt.values().numpy().reshape(len(sizes), -1) + offsets[:, None]  # values are feature-major
            for kjt in kjts
        ]
        return np.unique(np.concatenate(flat, axis=1))

    total = int(sum(sizes))
    delta = np.zeros(total, dtype=bool)
    trained = np.zeros(total, dtype=bool)
    for step in range(interval):
        trained[rows_of_step(step)] = True
    for step in range(interval, 2 * interval):
        delta[rows_of_step(step)] = True
    trained |= delta
    again = np.zeros(total, dtype=bool)
    shares: dict[int, tuple[float, float]] = {}
    for k in range(1, interval + 1):
        again[rows_of_step(2 * interval + k - 1)] = True
        if k in REPORT_STEPS or k == interval:
            shares[k] = (float((again & delta).sum() / delta.sum()), float((again & trained).sum() / trained.sum()))
    return {
        "table_rows": total,
        "delta_rows": int(delta.sum()),
        "trained_rows": int(trained.sum()),
        "touched_again": {str(k): {"delta": d, "trained": t} for k, (d, t) in shares.items()},
    }


def run(argv: list[str], prog: str = "python -m bench.run --suite retouch") -> dict[str, Any]:
    """Count, print the shares, return the document."""
    args = parser(prog).parse_args(argv)
    summary = retouched(args.cap, args.interval, args.batch, args.ranks)
    print(f"table rows {summary['table_rows']:,}, a delta's rows {summary['delta_rows']:,}, trained {summary['trained_rows']:,}")
    for k, v in summary["touched_again"].items():
        print(
            f"  within {k:>4} steps: {v['delta']:6.1%} of the delta's rows, {v['trained']:6.1%} of the trained rows touched again"
        )
    return {**document_head("retouch", prog, argv, machine_info()), "settings": vars(args), "summary": summary}


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """One record per step count and kind: the share touched again."""
    out = []
    for k, v in result["summary"]["touched_again"].items():
        for kind in ("delta", "trained"):
            out.append(Measurement(f"touched_again_{kind}", v[kind], "ratio", {"steps": int(k), **result["settings"]}))
    return out


def main(argv: list[str] | None = None) -> int:
    result = run(sys.argv[1:] if argv is None else argv, "python -m bench.retouch")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    run_main(main)
