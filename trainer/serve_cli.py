"""`deltarec-serve`: predictions over HTTP from a run's live model (trainer/serve/).

    deltarec-serve --config CONFIG [key=value ...] [--address-file F] [--verbose]
    deltarec-serve --config RUN_DIR/ckpt.yaml --model package.module:function [serve.key=value ...]
    python -m trainer.serve_cli ...   (the same)

The job's own config and overrides find its checkpoints and say how to serve
(`serve.host`, `serve.port`, limits: `ServeConfig` in trainer/config.py); with `--model`, a run
of a user's own loop and its model's factory (trainer/serve/setup.py). Runs until SIGINT/SIGTERM.

The server's packages are the `serve` extra (setup.cfg), not the core install: without them the
command stops in one line naming the extra, before it imports the server.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from common.errors import DeltarecError
from common.process import run_main
from trainer import console
from trainer.metrics import MetricsLog

#: what the server (trainer/serve/) imports from the `serve` extra
SERVE_EXTRA = ("aiohttp", "prometheus_client")


class ServeExtraMissing(DeltarecError):
    """The `serve` extra is not installed: which of its modules are missing, and the pip command."""


def require_serve_extra() -> None:
    """Raise ServeExtraMissing unless every module of the `serve` extra can be imported (found, not imported)."""
    missing = [name for name in SERVE_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise ServeExtraMissing(f"needs the serve extra ({', '.join(missing)} not installed): pip install 'deltarec[serve]'")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="deltarec-serve",
        description="Serve predictions from a run's newest checkpoint, applying each new one as it commits.",
    )
    p.add_argument("--config", required=True, help="the job's YAML config (with --model: the run's ckpt.yaml)")
    p.add_argument("--model", metavar="MODULE:FUNCTION", help="your own loop's model: the function returning its Servable")
    p.add_argument("--address-file", type=Path, metavar="F", help='write {"host", "port", "pid", "url"} here once listening')
    p.add_argument("--verbose", action="store_true", help="every library line too")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="the job's overrides (serve.port=8471, ...)")
    return p.parse_intermixed_args(argv)  # overrides before, between or after the options


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    console.setup_rank(0, verbose=args.verbose, noise=(*console.TRAINER_NOISE, *console.EXPORT_NOISE))
    try:
        require_serve_extra()
        from trainer.serve.server import Server  # the serve extra's packages, found above
        from trainer.serve.setup import load_serving

        serving = load_serving(args.config, args.overrides, args.model)
        Server(serving, MetricsLog(serving.metrics_path, enabled=True)).run(args.address_file)
        return 0
    except DeltarecError as exc:
        print(f"deltarec-serve: error: {exc}", file=sys.stderr)
        return 2


def cli() -> None:
    """Console-script entry point."""
    run_main(main)


if __name__ == "__main__":
    cli()
