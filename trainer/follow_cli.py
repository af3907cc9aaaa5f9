"""`deltarec-follow`: the follower of a run (commands and loop in ckpt/follow/).

    deltarec-follow --config CONFIG [key=value ...] [--export-every N] [--export-every-s T]
    python -m trainer.follow_cli ...   (the same)

This entry point loads the job's config (the trainer layer owns the whole config; a user's own
loop leaves `<run_dir>/ckpt.yaml`, which serves as well), sets up
the console and opens the follower's metrics log (`ckpt.follow.metrics`, default
`<run_dir>/follower.jsonl`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from ckpt.config import CkptConfig
from ckpt.follow import cli as follow_cli
from common.process import run_main
from trainer import console
from trainer.ckpt_cli import load_job_ckpt_config
from trainer.metrics import MetricsLog


def load(path: str, overrides: list[str]) -> tuple[CkptConfig, MetricsLog]:
    """The job's resolved `ckpt` section (a job config, or the `<run_dir>/ckpt.yaml` a user's
    own loop left: `load_job_ckpt_config`) and the follower's metrics log."""
    cfg = load_job_ckpt_config(path, overrides)
    return cfg, MetricsLog(Path(cfg.follow.metrics), enabled=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    console.setup_rank(0, verbose="--verbose" in argv, noise=(*console.TRAINER_NOISE, *console.EXPORT_NOISE))
    return follow_cli.main(argv, load)


def cli() -> None:
    """Console-script entry point."""
    run_main(main)


if __name__ == "__main__":
    cli()
