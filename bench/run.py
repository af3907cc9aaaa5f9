"""deltarec's benchmarks, one entry point: `python -m bench.run --suite NAME [options]`.

    python -m bench.run --list                          # every suite, what it measures, how long
    python -m bench.run --suite NAME --help             # that suite's options
    python -m bench.run --suite NAME [--records FILE] [suite options]

Each suite measures one thing against a baseline taken in the same invocation (the machines
are shared and noisy: only ratios within one run compare) and prints its figures; most also
write a detailed JSON document with `--out`. Whatever the suite, every figure is appended to
`--records` (default `bench/results/records.jsonl`) as one JSON line per measurement, with
the machine, the load and the git commit (`bench.common.write_records`). Suite options are
the suite module's own and pass through unchanged. A benchmark, not a test: nothing here
asserts anything about a figure.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from bench.common import REPO, Measurement, Provenance, log, write_records
from common.process import run_main

DEFAULT_RECORDS = REPO / "bench" / "results" / "records.jsonl"  # bench/results/ is ignored by git


class SuiteModule(Protocol):
    """What a suite's module offers the entry point."""

    def run(self, argv: list[str], prog: str) -> dict[str, Any]:
        """Parse `argv`, measure, print, write `--out`; return the result document (with
        `machine` and `commit`)."""

    def measurements(self, result: dict[str, Any]) -> list[Measurement]:
        """The figures of a result document, one per record."""


class Suite(NamedTuple):
    """A named measurement: the module that runs it and the options it always passes."""

    name: str
    module: str
    fixed: tuple[str, ...]
    measures: str


SUITES = (
    Suite(
        "quick",
        "bench.peers",
        ("--size", "quick"),
        "deltarec (4 policies x fp32/adaptive4, and incremental + a follower compacting its chain) against "
        "dcp.save, dcp.async_save and torch.save on the quickstart model: stall, bytes (the trainer's and the "
        "follower's), capacity, throughput, restore, steps lost, follower lag (~4.5 min; CI smoke)",
    ),
    Suite(
        "full",
        "bench.peers",
        ("--size", "full"),
        "the same on 26 Criteo-cardinality tables (5.6M rows, 1.43 GB; ~21 min, "
        "plus 2 follower jobs of 8 intervals: ~6-16 min more)",
    ),
    Suite(
        "gpu-peers",
        "bench.peers_gpu",
        (),
        "deltarec (intermittent_diff and incremental x fp32/adaptive4) against dcp.save, dcp.async_save with "
        "pinned staging and dcp.load, at world size 1 on one GPU (one process per size: --sizes full,big; "
        "--device cpu --sizes tiny on the CPU, ~1 min): stall, time to durable, bytes, capacity, restore, "
        "throughput (~4-5 min on an H100, estimate printed at the start)",
    ),
    Suite(
        "scale",
        "bench.scale",
        (),
        "how the cost grows with the model: the same job at 0.06, 0.2, 1.4 and 4.3 GB (--sizes) against dcp.save, "
        "dcp.async_save and dcp.load: stall, bytes, time to COMMIT, restore, the tracker, memory per rank with and "
        "without checkpoints, the follower's memory, compaction and export, per GB and per changed row, with "
        "their log-log slopes (~1 h for every size)",
    ),
    Suite(
        "cost",
        "bench.cost",
        (),
        "what a checkpoint costs apart from the broker: the default policy at 4 bits every --interval-s (full "
        "size: a true minute) to a fresh broker and to the filesystem sink on a tmpfs, against the job without "
        "checkpoints: throughput overhead, CPU seconds per checkpoint by thread class and of the broker "
        "(--size full ~20 min; --size quick ~3 min)",
    ),
    Suite(
        "checkpoint",
        "bench.ckpt_bench",
        (),
        "per checkpoint on the quickstart model: rows, bytes, stall and its parts against a bare copy, "
        "writer against a raw Kafka producer, restore against dcp.load (~3 min)",
    ),
    Suite(
        "tracker",
        "bench.tracker_overhead",
        (),
        "the row tracker's hook per training step (against no hook, a no-op hook and TorchRec's "
        "ModelDeltaTracker in ID_ONLY mode), what each lists for a checkpoint, and the snapshot stall "
        "against a bare copy (~3 min)",
    ),
    Suite(
        "throughput",
        "bench.train_throughput",
        (),
        "training samples/s against TorchRec's pipelined loop (DataLoader workers) on the same model and ranks: "
        "deltarec plain, pipelined, with checkpoints every --interval-s; a profile of the step's stages (~15 min)",
    ),
    Suite(
        "serve",
        "bench.serve",
        (),
        "deltarec-serve beside the quickstart job (checkpoints every 10 s, incremental 4-bit) under a bounded "
        "request load from a second process: freshness against time to COMMIT, request latency for 1 and 512 "
        "samples, the server's memory per row (~4 min); --sweep: the load curve, open loop, per rate and size (~3 min more)",
    ),
    Suite(
        "codecs",
        "bench.quant_bench",
        (),
        "quantization codecs: encode/decode MB/s against torch's 4-bit prepack, L2 error per bit width (~2.5 min)",
    ),
    Suite(
        "accuracy",
        "bench.quant_accuracy",
        (),
        "model log loss and AUC after L restores from quantized checkpoints against the uninterrupted job "
        "(Check-N-Run Fig. 14; the default grid ~30 min)",
    ),
    Suite(
        "cpr",
        "bench.cpr",
        (),
        "CPR's comparison: full against partial recovery under 5 SIGKILLs of a random rank per job, same "
        "failure points per mode: re-training and checkpoint overhead, PLS, final log loss and AUC against the "
        "uninterrupted job (3 seeds, ~15 min)",
    ),
    Suite(
        "markers",
        "bench.markers_log",
        (),
        "a restore's read of the markers log against its length (100 to 10,000 COMMIT markers of the full "
        "suite's size): the whole log against the log from its newest catalog record, on the embedded broker "
        "and on files (~2 min)",
    ),
    Suite(
        "marker-scale",
        "bench.marker_scale",
        (),
        "marker bytes and the markers log's fold time against ranks x tables (2 x 8 to 1,024 x 1,000, one full "
        "checkpoint) and against the chain's length (10 to 10,000 one-step links at 8 x 26), simulated writers, "
        "in memory (~2 min)",
    ),
    Suite(
        "every-step",
        "bench.every_step",
        (),
        "a checkpoint every step (ckpt.schedule.interval_steps=1) against the same job without checkpoints, alternated: "
        "throughput overhead, stall, step to COMMIT p50/p99, coalesced checkpoints, bytes per step, the exit's "
        "drain, the CPU it used (the job's processes and the broker); --follower: its lag; --kill-at: steps lost on "
        "a SIGKILL; --calibrate: the job without checkpoints beside a CPU burner of that share (~6 min at the defaults)",
    ),
    Suite(
        "gpu",
        "bench.gpu",
        (),
        "needs CUDA: the snapshot stall against a bare device-to-host copy (10^4-10^7 rows, d 32-256), every "
        "codec's encode and decode on the GPU, a restore into GPU shards against CPU shards (~1.5 min on an H100), "
        "a one-GPU job's throughput with checkpoints every --interval-s against none (~6 min)",
    ),
    Suite(
        "hashed",
        "bench.hashed",
        (),
        "managed-collision (ZCH) tables on an eviction-heavy stream (20% new ids an interval): bytes per incremental "
        "checkpoint, rows and id-to-slot mapping apart, against dcp.save and the intervals one dcp.save holds; the stall "
        "and the mapping's capture in it with and without an eviction; mapping bytes and capture time per admitted or "
        "evicted id (~1 min; --quick ~10 s)",
    ),
    Suite(
        "retouch",
        "bench.retouch",
        (),
        "of a checkpoint's rows, the share the next 1..170 steps update again (what a copy-on-write snapshot "
        "holds aside), counted from the scale suite's synthetic stream without training (~15 s)",
    ),
    Suite(
        "trained-rows",
        "bench.trained_rows",
        (),
        "not a measurement: trains a job and saves its trained embedding rows for `codecs --rows`",
    ),
)


def suite_named(name: str) -> Suite:
    """The suite called `name` (argparse has checked it exists)."""
    return next(s for s in SUITES if s.name == name)


def listing(columns: int = 100) -> str:
    """Every suite: its name and what it measures, wrapped to `columns`."""
    width = max(len(s.name) for s in SUITES)
    indent = " " * (width + 4)
    return "\n".join(
        textwrap.fill(s.measures, columns, initial_indent=f"  {s.name:<{width}}  ", subsequent_indent=indent) for s in SUITES
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.run",
        add_help=False,
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="suites:\n" + listing(),
    )
    p.add_argument("--suite", choices=[s.name for s in SUITES], help="what to measure (see below)")
    p.add_argument(
        "--records",
        type=Path,
        default=DEFAULT_RECORDS,
        help=f"append every figure here, one JSON line each (default {DEFAULT_RECORDS.relative_to(REPO)})",
    )
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("-h", "--help", action="store_true", help="this help, or with --suite that suite's options")
    return p


def run_suite(suite: Suite, argv: list[str], records: Path) -> dict[str, Any]:
    """Run `suite` with its own options `argv`; append its figures to `records`; return its
    result document."""
    module: SuiteModule = importlib.import_module(suite.module)  # type: ignore[assignment]
    prog = f"python -m bench.run --suite {suite.name}"
    started = time.time()
    result = module.run([*suite.fixed, *argv], prog)
    commit = result.get("commit") or {}
    provenance = Provenance(
        suite=suite.name,
        command=f"{prog} {shlex.join(argv)}".strip(),
        commit=commit.get("sha"),
        dirty=bool(commit.get("dirty")),
        unix=round(started, 3),
        machine=result.get("machine", {}),
    )
    n = write_records(records, provenance, module.measurements(result))
    log(f"{n} records of suite {suite.name} appended to {records}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if args.list:
        print(listing())
        return 0
    if args.suite is None:
        if args.help:
            p.print_help()
            return 0
        p.error("--suite is required (--list names them)")
    if args.help:
        rest = [*rest, "--help"]  # the suite's module prints its own options
    run_suite(suite_named(args.suite), rest, args.records)
    return 0


if __name__ == "__main__":
    run_main(main)
