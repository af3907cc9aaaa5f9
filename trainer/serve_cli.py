"""`deltarec-serve`: predictions over HTTP from a run's live model (trainer/serve/).

    deltarec-serve --config CONFIG [key=value ...] [--address-file F] [--verbose]
    python -m trainer.serve_cli ...   (the same)

The job's own config and overrides find its checkpoints and say how to serve
(`serve.host`, `serve.port`, limits: `ServeConfig` in trainer/config.py). Runs until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from common.errors import DeltarecError
from common.process import run_main
from trainer import console
from trainer.config import load_config
from trainer.metrics import MetricsLog
from trainer.serve.server import Server


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="deltarec-serve",
        description="Serve predictions from a run's newest checkpoint, applying each new one as it commits.",
    )
    p.add_argument("--config", required=True, help="the job's YAML config")
    p.add_argument("--address-file", type=Path, metavar="F", help='write {"host", "port", "pid", "url"} here once listening')
    p.add_argument("--verbose", action="store_true", help="every library line too")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="the job's overrides (serve.port=8471, ...)")
    return p.parse_intermixed_args(argv)  # overrides before, between or after the options


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    console.setup_rank(0, verbose=args.verbose, noise=(*console.TRAINER_NOISE, *console.EXPORT_NOISE))
    try:
        job = load_config(args.config, args.overrides, check_data=False)
        if not job.ckpt.enabled:
            raise DeltarecError(f"{args.config}: ckpt.enabled is false: this job writes no checkpoints to serve")
        path = Path(job.serve.metrics) if job.serve.metrics else job.run.run_dir / "serve.jsonl"
        Server(job, MetricsLog(path, enabled=True)).run(args.address_file)
        return 0
    except DeltarecError as exc:
        print(f"deltarec-serve: error: {exc}", file=sys.stderr)
        return 2


def cli() -> None:
    """Console-script entry point."""
    run_main(main)


if __name__ == "__main__":
    cli()
