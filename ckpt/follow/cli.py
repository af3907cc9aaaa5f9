"""`deltarec-follow`: the follower of one run, as a command.

    deltarec-follow --config CONFIG [key=value ...] [--export-every N] [--export-every-s T]

The job's own config and overrides find the stream, the dense files and the follower's
settings (`ckpt.follow`). Loading that config is the trainer layer's job: the console
script is `trainer.follow_cli`, which hands this module the resolved `ckpt` section and a
metrics sink.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from ckpt.config import CkptConfig
from ckpt.events import MetricsSink
from ckpt.follow.follower import Follower
from common.errors import DeltarecError


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="deltarec-follow",
        description="Follow a run's checkpoints: keep its model, compact its chain, publish serving snapshots.",
    )
    p.add_argument("--config", required=True, help="the job's YAML config")
    p.add_argument(
        "--export-every", type=int, metavar="N", help="a serving snapshot every N checkpoints (default: ckpt.follow.export_every)"
    )
    p.add_argument(
        "--export-every-s",
        type=float,
        metavar="T",
        help="a serving snapshot every T seconds (default: ckpt.follow.export_every_s)",
    )
    p.add_argument("--verbose", action="store_true", help="every library line too")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="the job's overrides")
    args = p.parse_intermixed_args(argv)  # overrides before, between or after the options
    if (args.export_every or 0) < 0 or (args.export_every_s or 0) < 0:
        p.error("--export-every and --export-every-s must be >= 0")
    return args


def main(argv: Sequence[str], load: Callable[[str, list[str]], tuple[CkptConfig, MetricsSink]]) -> int:
    """Run the follower until SIGINT/SIGTERM; `load(path, overrides)` gives the job's resolved
    `ckpt` section and the follower's metrics sink."""
    args = parse_args(argv)
    try:
        cfg, metrics = load(args.config, args.overrides)
        if not cfg.enabled:
            raise DeltarecError(f"{args.config}: ckpt.enabled is false: this job writes no checkpoints to follow")
        Follower(
            cfg.run_id, cfg.sink, cfg.follow, metrics, export_every=args.export_every, export_every_s=args.export_every_s
        ).run()
        return 0
    except DeltarecError as exc:
        print(f"deltarec-follow: error: {exc}", file=sys.stderr)
        return 2
