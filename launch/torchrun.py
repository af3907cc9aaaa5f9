"""`deltarec-launch`: torchrun on one node, with deltarec's defaults.

    deltarec-launch --nproc-per-node 2 [--max-restarts 3] --config configs/quickstart.yaml [key=value ...]

It replaces itself with `python -m torch.distributed.run --standalone ... -m trainer.main`,
so signals and the exit code are torchrun's own. For several nodes use
launch/slurm/deltarec.sbatch (one torchrun per node, c10d rendezvous on the first node).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence


def build_command(argv: Sequence[str]) -> list[str]:
    """The torchrun command line for `argv` (launcher flags first, trainer arguments after)."""
    p = argparse.ArgumentParser(prog="deltarec-launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks on this node (default 2)")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a rank dies")
    args, trainer_args = p.parse_known_args(argv)
    if args.nproc_per_node < 1:
        p.error("--nproc-per-node must be at least 1")
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc_per_node}",
        f"--max-restarts={args.max_restarts}",
        "-m", "trainer.main",
        *trainer_args,
    ]


def cli() -> None:
    cmd = build_command(sys.argv[1:])
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    cli()
