"""`deltarec-ckpt`: list, verify, export and trim a run's checkpoints.

    deltarec-ckpt --config CONFIG [key=value ...] list | verify | export --out F [--dcp D] | gc --keep N
    python -m trainer.ckpt_cli ...   (the same)

The commands live in `ckpt/cli.py`; this entry point only loads the job's config (the
trainer layer owns the whole config) and hands the commands its resolved `ckpt` section,
so the same file and overrides that ran a job find its checkpoints.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ckpt import cli as ckpt_cli
from ckpt.config import CkptConfig, load_ckpt_config
from common.config_loader import load_yaml
from common.process import run_main
from trainer import console
from trainer.config import load_config


def load_job_ckpt_config(path: str, overrides: list[str]) -> CkptConfig:
    """The job's `ckpt` section, with run id and directories resolved (no data files checked).
    A file with only a `ckpt` section is the one a user's own loop left in its run directory
    (`ckpt.Checkpointer` writes `<run_dir>/ckpt.yaml`, resolved already)."""
    if set(load_yaml(path)) == {"ckpt"}:
        return load_ckpt_config(path, overrides)
    return load_config(path, overrides, check_data=False).ckpt


def main(argv: Sequence[str] | None = None) -> int:
    console.install_noise_filters(console.EXPORT_NOISE)
    return ckpt_cli.main(sys.argv[1:] if argv is None else argv, load_job_ckpt_config)


def cli() -> None:
    """Console-script entry point."""
    run_main(main)


if __name__ == "__main__":
    cli()
