"""`deltarec-ckpt`: list, verify, export and trim a run's checkpoints.

    deltarec-ckpt --config CONFIG [key=value ...] list | verify | export --out F [--dcp D] | gc --keep N
    python -m trainer.ckpt_cli ...   (the same)

The commands live in `ckpt/cli.py`; this entry point only loads the job's config (the
trainer layer owns the whole config) and hands the commands its resolved `ckpt` section,
so the same file and overrides that ran a job find its checkpoints.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

from ckpt import cli as ckpt_cli
from ckpt.config import CkptConfig, load_ckpt_config
from common.config_loader import load_yaml
from common.process import run_main
from trainer import console
from trainer.config import load_config

# `dotted.key=value`: what a job's override looks like on a command line (common/config_loader.py)
_OVERRIDE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*=")


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(every other argument in its order, the `dotted.key=value` overrides in theirs), wherever
    the overrides stand among the options: argparse gives a `nargs="*"` positional only one run
    of arguments, so `--config job.yaml a=1 --export-every 10 b=2` would leave `b=2` unrecognized.
    argparse's `parse_intermixed_args` does this for a parser without subcommands (deltarec-train,
    -follow, -serve); `deltarec-ckpt` has subcommands, which it refuses. A token right after an
    option (every option of `ckpt/cli.py` but `-h`/`--help` takes a value) is that option's
    value, whatever it looks like; after `--` nothing moves."""
    rest: list[str] = []
    overrides: list[str] = []
    takes_value = False
    for i, token in enumerate(argv):
        if token == "--":
            rest.extend(argv[i:])
            break
        if not takes_value and _OVERRIDE.match(token):
            overrides.append(token)
            continue
        rest.append(token)
        takes_value = token.startswith("-") and "=" not in token and token not in ("-h", "--help") and not takes_value
    return rest, overrides


def overrides_before_command(argv: Sequence[str]) -> list[str]:
    """`argv` with every override moved before the subcommand (`list`, `export` ...), where
    `ckpt/cli.py`'s parser takes them: `--config C list a=1` as `--config C a=1 list`."""
    rest, overrides = split_overrides(argv)
    i = 0
    while i < len(rest) and rest[i].startswith("-") and rest[i] != "--":
        i += 1 if "=" in rest[i] or rest[i] in ("-h", "--help") else 2  # an option and its value
    return [*rest[:i], *overrides, *rest[i:]]


def load_job_ckpt_config(path: str, overrides: list[str]) -> CkptConfig:
    """The job's `ckpt` section, with run id and directories resolved (no data files checked).
    A file with only a `ckpt` section is the one a user's own loop left in its run directory
    (`ckpt.Checkpointer` writes `<run_dir>/ckpt.yaml`, resolved already)."""
    if set(load_yaml(path)) == {"ckpt"}:
        return load_ckpt_config(path, overrides)
    return load_config(path, overrides, check_data=False).ckpt


def main(argv: Sequence[str] | None = None) -> int:
    console.install_noise_filters(console.EXPORT_NOISE)
    argv = sys.argv[1:] if argv is None else argv
    return ckpt_cli.main(overrides_before_command(argv), load_job_ckpt_config)


def cli() -> None:
    """Console-script entry point."""
    run_main(main)


if __name__ == "__main__":
    cli()
