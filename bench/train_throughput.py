"""Training throughput against TorchRec's own pipelined loop, and where a step's time goes.

    python -m bench.run --suite throughput [--config configs/quickstart.yaml] [--steps 3000]
        [--interval-s 60] [--rounds 1] [--profile-steps 100] [--out results.json]

In one invocation, on the same model, data and ranks (`--ranks` spawned like trainer ranks):
- `torchrec`: TorchRec's loop as its DLRM example runs it, `TrainPipelineSparseDist` over a
  DataLoader with `--peer-workers` (1) worker per rank (`bench.throughput_rank --mode peer`);
- `deltarec_plain`: `deltarec-train` with `train.pipeline=plain`, no checkpoints;
- `deltarec`: `deltarec-train` as configured (pipelined), no checkpoints;
- `deltarec_ckpt`: the same with checkpoints (the config's policy and encoding) every
  `--interval-s` seconds to an embedded broker;
- the profile: ms per step in each stage of deltarec's step, pipelined and plain, with
  checkpoints every `--profile-interval` steps (`bench.throughput_rank --mode profile`);
- the readers: samples/s one loader worker reads from Criteo TSV lines and from the same
  lines in TorchRec's `.npy` format, against the loop's samples/s per rank.

A job's samples/s is its samples over its seconds after the first logged window (start-up;
the peer: after its `--warmup` steps), checkpoint stalls included (`--steps` a multiple of
`--log-every`); `--rounds` repeats the `--jobs` in rotated order and reports each job's
median round. Ratios are against `torchrec` and against `deltarec` in the same run (the
machine is noisy).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench.common import (
    Measurement,
    config_path,
    document_head,
    harmonic_of,
    loadavg,
    log,
    machine_info,
    median_of,
    ratio,
    scalars,
)
from common.process import run_main

JOBS = ("torchrec", "deltarec_plain", "deltarec", "deltarec_ckpt")


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        default="configs/quickstart.yaml",
        help="a job config, or `full`: the full suite's model (26 Criteo Kaggle tables capped at 1M rows, d 64, batch 2048)",
    )
    p.add_argument("--steps", type=int, default=3000, help="steps per training job")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--interval-s", type=float, default=60.0, help="deltarec_ckpt: seconds between checkpoints")
    p.add_argument("--rounds", type=int, default=1, help="times each job runs (rotated order)")
    p.add_argument(
        "--jobs", type=lambda v: v.split(","), default=list(JOBS), help=f"comma-separated, of {','.join(JOBS)} (default: all)"
    )
    p.add_argument(
        "--warmup", type=int, default=20, help="steps the peer and the profile run before their timed steps (not counted)"
    )
    p.add_argument("--profile-steps", type=int, default=100, help="profiled steps (0: no profile)")
    p.add_argument("--profile-interval", type=int, default=25, help="profile: steps between checkpoints")
    p.add_argument("--reader-lines", type=int, default=200_000, help="Criteo lines one worker reads (0: skip)")
    p.add_argument("--reader-batch", type=int, default=8192)
    p.add_argument(
        "--peer-workers", type=int, default=1, choices=[0, 1], help="torchrec: DataLoader workers per rank (its DLRM example: 1+)"
    )
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--out", type=Path)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every job")
    return p


def _rates(run_dir: Path) -> list[float]:
    """A job's logged windows' samples/s after the first (start-up)."""
    from launch.ranks import read_metrics

    return [r["samples_per_s"] for r in read_metrics(run_dir) if "samples_per_s" in r][1:]


def train_job(name: str, args: argparse.Namespace, config: str, work: Path, bootstrap: str) -> dict[str, Any]:
    """One `deltarec-train` job of `args.ranks` ranks: its median samples/s."""
    from launch.ranks import spawn_ranks

    tmp = work / f"{name}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir(parents=True)
    overrides = [f"train.steps={args.steps}", f"train.log_every={args.log_every}", "train.eval_every=0", "train.eval_batches=0"]
    if name == "deltarec_plain":
        overrides += ["train.pipeline=plain", "ckpt.enabled=false"]
    elif name == "deltarec":
        overrides += ["ckpt.enabled=false"]
    else:
        overrides += [
            "ckpt.enabled=true",
            f"ckpt.sink.bootstrap_servers={bootstrap}",
            f"ckpt.run_id=bench-throughput-{uuid.uuid4().hex[:8]}",
            f"ckpt.schedule.interval_s={args.interval_s}",
            "ckpt.schedule.interval_steps=0",
        ]
    spawn_ranks(config, [*overrides, *args.overrides], tmp, world_size=args.ranks, timeout_s=args.timeout_s)
    rates = _rates(tmp / "run")
    # the windows' samples over their seconds: a checkpoint's stall counts in full (a median would drop it)
    return {"job": name, "samples_per_s": harmonic_of(rates), "windows": len(rates)}


def rank_job(mode: str, args: argparse.Namespace, config: str, work: Path, extra: list[str]) -> dict[str, Any]:
    """One `bench.throughput_rank` job: rank 0's result document."""
    from launch.ranks import spawn_ranks

    tmp = work / f"{mode}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir(parents=True)
    out = tmp / "result.json"
    steps = args.steps if mode == "peer" else args.profile_steps
    spawn_ranks(
        config,
        [*args.overrides, *extra],
        tmp,
        world_size=args.ranks,
        timeout_s=args.timeout_s,
        module="bench.throughput_rank",
        extra_args=["--mode", mode, "--steps", str(steps), "--warmup", str(args.warmup), "--out", str(out)],
    )
    return json.loads(out.read_text())


def _criteo_lines(n: int, seed: int = 0) -> str:
    """`n` Criteo TSV lines with the Kaggle set's shape: a label, 13 counts, 26 hex hashes,
    about 1 field in 20 empty (the files' missing values)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 1000, size=(n, 13))
    hashes = rng.integers(0, 2**32, size=(n, 26), dtype=np.uint64)
    empty = rng.random((n, 39)) < 0.05
    out = []
    for i in range(n):
        fields = [str(int(rng.random() < 0.25))]
        fields += ["" if empty[i, j] else str(c) for j, c in enumerate(counts[i])]
        fields += ["" if empty[i, 13 + j] else f"{h:08x}" for j, h in enumerate(hashes[i])]
        out.append("\t".join(fields))
    return "\n".join(out) + "\n"


def reader_rates(work: Path, lines: int, batch_size: int) -> dict[str, Any]:
    """Samples/s one worker reads from a Criteo TSV and from the same lines in TorchRec's .npy
    format (batches of `batch_size`), in this process: what one `data.workers` process gives."""
    import time

    from torchrec.datasets.criteo import BinaryCriteoUtils

    from trainer.data.criteo import CriteoTsvReader
    from trainer.data.criteo_npy import CriteoNpyReader

    tsv = work / "day_0.tsv"
    tsv.write_text(_criteo_lines(lines))
    prefix = str(work / "day_0")
    BinaryCriteoUtils.tsv_to_npys(str(tsv), f"{prefix}_dense.npy", f"{prefix}_sparse.npy", f"{prefix}_labels.npy")
    common: dict[str, Any] = dict(
        feature_names=[f"C{i}" for i in range(1, 27)], num_embeddings=[10**7] * 26, batch_size=batch_size, rank=0, world_size=1
    )
    readers: dict[str, Any] = {
        "criteo_tsv": CriteoTsvReader(paths=[str(tsv)], **common),
        "criteo_npy": CriteoNpyReader(paths=[prefix], **common),
    }
    out: dict[str, Any] = {"lines": lines, "batch_size": batch_size}
    for name, reader in readers.items():
        batches = max(1, lines // batch_size)
        t = time.perf_counter()
        for _ in range(batches):
            reader.next_batch()
        out[f"{name}_samples_per_s"] = batches * batch_size / (time.perf_counter() - t)
    return out


def run(argv: list[str], prog: str = "python -m bench.run --suite throughput") -> dict[str, Any]:
    """Run the jobs and the profiles, print and (`--out`) write the result document; return it."""
    from launch.broker import EmbeddedBroker

    args = parser(prog).parse_args(argv)
    machine = machine_info()
    if unknown := set(args.jobs) - set(JOBS):
        raise SystemExit(f"--jobs: no job {sorted(unknown)[0]!r}; the jobs are {', '.join(JOBS)}")
    jobs = [j for j in JOBS if j in args.jobs]
    runs: dict[str, list[float | None]] = {j: [] for j in JOBS}
    profiles: list[dict[str, Any]] = []
    readers: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker() as broker:
        work = Path(tmp)
        if args.config == "full":
            from bench.peers import full_config

            config = str(full_config(work / "full.yaml", cap=1_000_000, dim=64))
            args.overrides = ["data.batch_size=2048", *args.overrides]
        else:
            config = config_path(args.config)
        for r in range(args.rounds):
            for name in jobs[r % len(jobs) :] + jobs[: r % len(jobs)]:
                log(f"throughput: {name}, round {r + 1} of {args.rounds}, {args.steps} steps")
                if name == "torchrec":
                    rate = rank_job("peer", args, config, work, [f"data.workers={args.peer_workers}"])["samples_per_s"]
                else:
                    rate = train_job(name, args, config, work, broker.bootstrap)["samples_per_s"]
                runs[name].append(rate)
        if args.profile_steps:
            for pipeline in ("sparse_dist", "plain"):
                log(f"throughput: profile of {args.profile_steps} steps, train.pipeline={pipeline}")
                extra = [
                    f"train.pipeline={pipeline}",
                    "ckpt.enabled=true",
                    f"ckpt.sink.bootstrap_servers={broker.bootstrap}",
                    f"ckpt.run_id=bench-profile-{uuid.uuid4().hex[:8]}",
                    f"ckpt.schedule.interval_steps={args.profile_interval}",
                    "ckpt.schedule.final=false",
                ]
                profiles.append(rank_job("profile", args, config, work, extra))
        if args.reader_lines:
            log(f"throughput: one worker reading {args.reader_lines:,} Criteo lines, TSV and TorchRec .npy")
            readers = reader_rates(work, args.reader_lines, args.reader_batch)
    machine["loadavg_end"] = loadavg()
    rates = {j: median_of(v) for j, v in runs.items()}
    result = {
        **document_head("throughput", prog, argv, machine),
        "config": config,
        "ranks": args.ranks,
        "steps": args.steps,
        "interval_s": args.interval_s,
        "samples_per_s": rates,
        "runs": runs,
        "vs_torchrec": {j: ratio(rates[j], rates["torchrec"]) for j in JOBS},
        "ckpt_overhead": 1 - kept if (kept := ratio(rates["deltarec_ckpt"], rates["deltarec"])) is not None else None,
        "pipeline_speedup": ratio(rates["deltarec"], rates["deltarec_plain"]),
        "profiles": profiles,
        "readers": readers,
        # a worker keeps up when it reads at least what its rank trains
        "loop_samples_per_s_per_rank": rates["deltarec"] / args.ranks if rates["deltarec"] else None,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """The figures of a throughput document, one per record."""
    context = {"config": result["config"], "ranks": result["ranks"]}
    out: list[Measurement] = []
    for job, rate in result["samples_per_s"].items():
        figures = {"samples_per_s": rate, "vs_torchrec": result["vs_torchrec"][job]}
        out += scalars(figures, {**context, "job": job}, {"vs_torchrec": "ratio"})
    for p in result["profiles"]:
        labels = {**context, "pipeline": p["pipeline"]}
        out += scalars({"step_ms": p["step_ms"], "other_ms": p["other_ms"]}, labels, {"other_ms": "ms"})
        for stage, ms in p["stage_ms"].items():
            out += scalars({"stage_ms": ms}, {**labels, "stage": stage}, {"stage_ms": "ms"})
    readers = {k: v for k, v in result["readers"].items() if k.endswith("_samples_per_s")}
    out += scalars(readers, {**context, "batch_size": result["readers"].get("batch_size")})
    ratios = {"ckpt_overhead": result["ckpt_overhead"], "pipeline_speedup": result["pipeline_speedup"]}
    return out + scalars(ratios, context, dict.fromkeys(ratios, "ratio"))


def main(argv: list[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv, "python -m bench.train_throughput")
    return 0


if __name__ == "__main__":
    run_main(main)
