"""`deltarec-launch`: torchrun with deltarec's defaults and console, on one node or several.

    deltarec-launch --nproc-per-node 2 [--max-restarts 3] [--verbose] --config configs/quickstart.yaml [key=value ...]

One node is torchrun's `--standalone`. For several nodes run it once per node with the same
`--nnodes`, `--rdzv-endpoint` (host:port of the first node, where torchrun's c10d store
listens) and `--rdzv-id`; `--local-addr` is the address this node's agent advertises:

    deltarec-launch --nnodes 2 --rdzv-endpoint 10.0.0.1:29500 --rdzv-id job7 --local-addr 10.0.0.2 \
        --nproc-per-node 8 --config configs/criteo_kaggle_8gpu.yaml

It runs torchrun (`torch.distributed.run --standalone ... -m trainer.main`) in this very
process: signals reach torchrun's agent as they would, and the ranks write straight to this
terminal (a progress bar stays a bar). Of the agent's own lines, the known noise is dropped
(trainer/console.py) and a rank's failure becomes one line, e.g.

    deltarec-launch: rank 1 exited (SIGKILL); torchrun restarts the job, attempt 2/2

Exit status: 0; 1 when the job failed (torchrun's own); 128+N when signal N stopped it.
With `--verbose` it replaces itself with plain torchrun and passes `--verbose` to the trainer,
so every line of torchrun, the ranks and the libraries shows. For several nodes use
launch/slurm/deltarec.sbatch (one torchrun per node, c10d rendezvous on the first node).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from common.process import run_main
from trainer import console

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

# The agent's record for a failed attempt (torch.distributed.elastic.multiprocessing.api);
# args: exitcode, local_rank, pid, entrypoint. Records that do not match pass through as they are.
AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
FAILED_RECORD = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
# torchrun shares its rendezvous store with the ranks unless this is "1"; a shared store
# outlives attempts, and ranks of different nodes cannot agree on which attempt they are in.
FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's own flags, and the trainer's arguments (everything else, in order)."""
    p = argparse.ArgumentParser(prog="deltarec-launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks on this node (default 2)")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a rank dies")
    p.add_argument("--verbose", action="store_true", help="plain torchrun, and every rank's and library's lines")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of the job (default 1: --standalone)")
    p.add_argument("--rdzv-endpoint", default="", help="host:port of the c10d rendezvous (several nodes)")
    p.add_argument("--rdzv-id", default="", help="the job's rendezvous id, the same on every node")
    p.add_argument("--local-addr", default="", help="address this node's agent advertises (default: host name)")
    args, trainer_args = p.parse_known_args(argv)
    if args.nproc_per_node < 1:
        p.error("--nproc-per-node must be at least 1")
    if args.nnodes < 1:
        p.error("--nnodes must be at least 1")
    if args.nnodes > 1 and not (args.rdzv_endpoint and args.rdzv_id):
        p.error("--nnodes > 1 needs --rdzv-endpoint (the first node's host:port) and --rdzv-id")
    return args, trainer_args


def rendezvous_flags(args: argparse.Namespace) -> list[str]:
    """torchrun's rendezvous flags: `--standalone` on one node, c10d on several."""
    if args.nnodes == 1 and not args.rdzv_endpoint:
        return ["--standalone"]
    flags = [
        f"--nnodes={args.nnodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={args.rdzv_endpoint}",
        f"--rdzv-id={args.rdzv_id or 'deltarec'}",
    ]
    return [*flags, f"--local-addr={args.local_addr}"] if args.local_addr else flags


def build_command(argv: Sequence[str]) -> list[str]:
    """The torchrun command line for `argv` (launcher flags first, trainer arguments after)."""
    args, trainer_args = parse(argv)
    return [
        sys.executable, "-m", "torch.distributed.run",
        *rendezvous_flags(args),
        f"--nproc-per-node={args.nproc_per_node}",
        f"--max-restarts={args.max_restarts}",
        "-m", "trainer.main",
        *(["--verbose"] if args.verbose else []),
        *trainer_args,
    ]  # fmt: skip


def rank_outcome(rank: int, exitcode: int, what: str = "rank") -> str:
    """How one rank's process ended, for a user: `rank 1 exited (SIGKILL)`; `what` is
    "local rank" where only the rank on this node is known (the agent's record, several nodes)."""
    if exitcode == console.EXIT_PEER_LOST:
        return f"{what} {rank} stopped (another rank of the job is gone)"
    if exitcode == console.EXIT_STALLED:
        return f"{what} {rank} stopped (a collective timed out: another rank does not answer)"
    return f"{what} {rank} exited ({console.exit_description(exitcode)})"


def root_cause(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The rank that failed first of its own accord: not one that only lost its peers, nor
    one the agent stopped (SIGTERM) because another had failed; by time, then rank."""

    def victim(f: ProcessFailure) -> bool:
        return f.exitcode in (console.EXIT_PEER_LOST, console.EXIT_STALLED, -signal.SIGTERM)

    return min(failures.items(), key=lambda item: (victim(item[1]), item[1].timestamp, item[0]))


class RankFailures(logging.Filter):
    """Turns the agent's record of a failed attempt into deltarec's line about the rank and
    the restart; the last attempt's failure is left to `launch` (it knows every rank's)."""

    def __init__(self, max_restarts: int, multi_node: bool = False) -> None:
        super().__init__()
        self.max_restarts = max_restarts
        self.failed_attempts = 0
        self.what = "local rank" if multi_node else "rank"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != FAILED_RECORD or not isinstance(record.args, tuple) or len(record.args) != 4:
            return True
        exitcode, local_rank = int(cast(Any, record.args[0])), int(cast(Any, record.args[1]))
        self.failed_attempts += 1
        if self.failed_attempts <= self.max_restarts:
            attempt, attempts = self.failed_attempts + 1, self.max_restarts + 1
            say(f"{rank_outcome(local_rank, exitcode, self.what)}; torchrun restarts the job, attempt {attempt}/{attempts}")
        return False


def say(line: str) -> None:
    """One launcher line on stderr, over what a stopped rank's progress bar left."""
    print(f"{console.clear_line(sys.stderr)}deltarec-launch: {line}", file=sys.stderr, flush=True)


def launch(argv: Sequence[str]) -> int:
    """Run torchrun in this process with deltarec's console; the exit status."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args, _ = parse(argv)
    console.quiet_launcher()
    failures = RankFailures(args.max_restarts, multi_node=args.nnodes > 1)
    logging.getLogger(AGENT_LOGGER).addFilter(failures)
    if args.rdzv_endpoint:
        say(f"c10d rendezvous at {args.rdzv_endpoint}, id {args.rdzv_id}, {args.nnodes} node(s) x {args.nproc_per_node} rank(s)")
    try:
        torchrun.run(torchrun.parse_args(build_command(argv)[3:]))
    except ChildFailedError as exc:
        rank, failure = root_cause(exc.failures)
        restarts = "no restarts left" if args.max_restarts else "no restarts"
        say(f"{rank_outcome(rank, failure.exitcode)}; the job failed, {restarts} (--max-restarts {args.max_restarts})")
        return 1
    except SignalException as exc:
        say(f"stopped by {exc.sigval.name}, and the ranks with it")
        return 128 + int(exc.sigval)
    return 0


def cli() -> None:
    """Console-script entry point."""
    argv = sys.argv[1:]
    # A fresh worker store per attempt, hosted by rank 0 (sharding/process_group.py says why).
    os.environ.setdefault(FRESH_STORE_ENV, "1")
    if parse(argv)[0].verbose:
        cmd = build_command(argv)
        os.execv(cmd[0], cmd)
    run_main(lambda: launch(argv))


if __name__ == "__main__":
    cli()
