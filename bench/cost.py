"""What a checkpoint costs the trainer, apart from the broker it shares the cores with:
`python -m bench.run --suite cost`.

    python -m bench.run --suite cost [--size quick|full] [--interval-s S] [--steps N] [--log-every N] [--rounds R]
                                     [--encoding CODEC] [--tmpfs DIR] [--out results.json]

On the model of `bench.peers`'s suite of that size, the default policy at 4 bits
(`intermittent_diff`, `adaptive4`; ``--encoding fp32`` for the trainer's own default, bit-exact
rows) checkpoints every ``--interval-s`` seconds of wall time
(`ckpt.schedule.interval_s`: a true time interval, rank 0's clock; the full size's default is one
minute). Each job is 2 gloo ranks through `bench.ckpt_rank`, in rounds of:

1. ``none``: the same job without checkpoints (the baseline);
2. ``kafka``: to a *fresh* embedded broker started for this job alone and stopped after it,
   whose process CPU is read before and after;
3. ``tmpfs``: to the filesystem sink on a tmpfs (``--tmpfs``, default /dev/shm): the same
   checkpoints with no broker at all, the broker-free reference;

and a closing ``none`` job, so that the baseline brackets the checkpointing jobs (its rate is
the harmonic mean of every ``none`` job). Odd rounds run the sinks in reverse order (``none,
kafka, tmpfs, none, tmpfs, kafka, none``), so a drift of the machine reaches both sinks alike.
Per job: training throughput from ``metrics.jsonl`` (every logging window but the first) and
its overhead against the baseline; checkpoints, stall and time to COMMIT; and from `bench.cpu`
the CPU seconds per checkpoint beyond the baseline, by thread class (training thread and its
part inside stalls, writer thread, librdkafka's threads, the rest), of the trainer process as a
whole, and of the broker process. ``cpu_trainer_overhead`` (the trainer's extra CPU as a
fraction of the baseline's) is what checkpointing costs where the broker runs elsewhere and the
writer has a core of its own; ``cpu_direct_overhead`` counts only the CPU of the stalls, the
writer and librdkafka, which needs no subtraction of two noisy jobs
(`bench.cpu.checkpoint_cpu`).

Each job's *pace excess* (`pace_excess`) is the share of its time beyond what its windows take
at its own median pace; a sink's ``throughput_overhead_within`` is its pace excess less the
baseline's. That overhead compares no two jobs' rates, which drift apart here by more than the
goal: it counts what checkpoints cost the windows around them, misses a cost spread evenly over
every step (the tracker's hook, `--suite tracker`), and holds while a checkpoint's activity
covers well under half the windows (an interval far longer than the time to COMMIT).

Per job in run order, its throughput, pace excess and how much the kernel's memory counters
grew while it ran (/proc/vmstat: page faults, reclaim scans, compaction stalls, transparent huge
pages), to tell a sink's cost from memory pressure. A benchmark, not a test: it asserts nothing about the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from argparse import Namespace
from collections.abc import Callable
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
    mean_of,
    median_of,
    scalars,
)
from bench.cpu import checkpoint_cpu
from bench.peers import DEFAULT_POLICY, DEFAULT_QUANT, SIZES, broker_cpu_s, full_config
from ckpt.quant import codec_names
from common.process import run_main
from launch.broker import EmbeddedBroker

# per size: steps of every job and the checkpoint interval in seconds (full: a checkpoint
# a minute)
COST_SIZES: dict[str, dict[str, Any]] = {
    "quick": {"steps": 1200, "interval_s": 5.0, "log_every": 50},
    "full": {"steps": 1500, "interval_s": 60.0, "log_every": 20},
}
SINKS = ("kafka", "tmpfs")


def is_tmpfs(path: Path) -> bool:
    """Whether `path` lies on a tmpfs (the longest mount point of /proc/mounts that holds it)."""
    best, fstype = "", ""
    resolved = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and (resolved == parts[1] or resolved.startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) > len(best):
                best, fstype = parts[1], parts[2]
    return fstype == "tmpfs"


def window_rates(run_dir: Path) -> list[float]:
    """Samples/s of each logging window of a job's ``metrics.jsonl`` but the first (warm-up)."""
    from launch.ranks import read_metrics

    rates = [m["samples_per_s"] for m in read_metrics(run_dir) if "samples_per_s" in m]
    return rates[1:] or rates


def pace_excess(rates: list[float]) -> float | None:
    """The share of a job's time beyond what its windows would have taken at the job's own
    median pace: ``1 - harmonic(rates) / median(rates)``. A slow machine slows every window
    alike and cancels out; what a checkpoint costs for a few windows after it does not."""
    whole, typical = harmonic_of(rates), median_of(rates)
    return 1 - whole / typical if whole and typical else None


def none_job(s: dict[str, Any], work: Path, n: int, timeout_s: float) -> dict[str, Any]:
    """The job without checkpoints, the `n`th time."""
    from bench.ckpt_bench import read_cpus
    from launch.ranks import spawn_ranks

    tmp = work / f"none-{n}"
    tmp.mkdir(parents=True)
    log(f"cost: job without checkpoints ({n}), {s['steps']} steps")
    t = time.perf_counter()
    spawn_ranks(
        s["config"],
        [*_common(s), "ckpt.enabled=false"],
        tmp,
        world_size=2,
        timeout_s=timeout_s,
        module="bench.ckpt_rank",
        extra_args=["--side", str(tmp / "side")],
    )
    rates = window_rates(tmp / "run")
    return {
        "sink": "none",
        "round": n,
        "wall_s": time.perf_counter() - t,
        "samples_per_s": harmonic_of(rates),
        "window_rates": rates,
        "pace_excess": pace_excess(rates),
        "cpu": read_cpus(tmp / "side", 2),
    }


def _common(s: dict[str, Any]) -> list[str]:
    return [
        f"train.steps={s['steps']}",
        "train.eval_every=0",
        "train.eval_batches=0",
        f"train.log_every={s['log_every']}",
        *s["overrides"],
    ]


def ckpt_job(sink: str, s: dict[str, Any], work: Path, n: int, tmpfs: Path, timeout_s: float) -> dict[str, Any]:
    """The default policy in `s["encoding"]` every `interval_s` seconds, to a fresh broker
    (`kafka`) or the filesystem sink on a tmpfs (`tmpfs`), the `n`th time."""
    from bench.ckpt_bench import train_run

    label = f"{sink}-{n}"
    ns = Namespace(
        policy=DEFAULT_POLICY,
        interval=0,
        steps=s["steps"],
        config=s["config"],
        ranks=2,
        timeout_s=timeout_s,
        overrides=[
            "ckpt.schedule.final=false",
            f"ckpt.schedule.interval_s={s['interval_s']}",
            f"train.log_every={s['log_every']}",
            *s["overrides"],
        ],
    )
    extra = [f"ckpt.encoding.weights={s['encoding']}"]
    prefix = f"bench-cost-{uuid.uuid4().hex[:8]}"
    if sink == "kafka":
        with EmbeddedBroker() as broker:
            cpu0 = broker_cpu_s(broker)
            run = train_run(label, extra, ns, work, broker.bootstrap, prefix)
            run["broker_cpu_s"] = broker_cpu_s(broker) - cpu0
    else:
        root = Path(tempfile.mkdtemp(prefix="deltarec-cost-", dir=tmpfs))
        try:
            run = train_run(
                label,
                [*extra, "ckpt.sink.kind=filesystem", f"ckpt.sink.fs_root={root / 'stream'}"],
                ns,
                work,
                "127.0.0.1:1",
                prefix,
            )
            run["broker_cpu_s"] = None
        finally:
            shutil.rmtree(root, ignore_errors=True)
    rates = window_rates(work / label / "run")
    run.update(sink=sink, round=n, samples_per_s=harmonic_of(rates), window_rates=rates, pace_excess=pace_excess(rates))
    return run


def round_order(sinks: list[str], n: int) -> list[str]:
    """The sinks of round `n`: odd rounds reversed, so that a drift of the machine over the run
    (identical jobs drift apart by more than the goal: docs/BENCHMARKS.md) reaches every sink alike."""
    return list(reversed(sinks)) if n % 2 else list(sinks)


# /proc/vmstat counters that say whether a job ran under memory pressure (reclaim, compaction,
# major faults, swap): the whole machine's, which is this job alone when nothing else runs
VMSTAT_KEYS = (
    "pgfault",
    "pgmajfault",
    "pswpin",
    "pswpout",
    "pgscan_kswapd",
    "pgscan_direct",
    "pgsteal_kswapd",
    "pgsteal_direct",
    "compact_stall",
    "thp_fault_alloc",
    "thp_fault_fallback",
)


def vmstat() -> dict[str, int]:
    """The `VMSTAT_KEYS` counters now (those the kernel has)."""
    counters = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines() if " " in line)
    return {k: int(counters[k]) for k in VMSTAT_KEYS if k in counters}


def counted(job: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`job()`'s result with how much each `VMSTAT_KEYS` counter grew while it ran."""
    before = vmstat()
    out = job()
    after = vmstat()
    out["vmstat"] = {k: after[k] - before[k] for k in before if k in after}
    return out


def summarize(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per sink: throughput and its overhead against the bracketing baseline, the checkpoints,
    and the CPU per checkpoint (`bench.cpu.checkpoint_cpu`), each over all rounds."""
    nones = [j for j in jobs if j["sink"] == "none"]
    base_rate = harmonic_of(j["samples_per_s"] for j in nones)
    base_cpu = [r for j in nones for r in j["cpu"]]
    base_excess = mean_of(j.get("pace_excess") for j in nones)
    out: dict[str, Any] = {
        "none": {
            "samples_per_s": base_rate,
            "jobs": len(nones),
            "samples_per_s_jobs": [j["samples_per_s"] for j in nones],
            "pace_excess": base_excess,
            "pace_excess_jobs": [j.get("pace_excess") for j in nones],
        }
    }
    for sink in SINKS:
        mine = [j for j in jobs if j["sink"] == sink]
        if not mine:
            continue
        cks = [c for j in mine for c in j["checkpoints"]]
        ok = [c for c in cks if c["committed"]]
        rate = harmonic_of(j["samples_per_s"] for j in mine)
        broker = [j["broker_cpu_s"] for j in mine]
        excess = mean_of(j.get("pace_excess") for j in mine)
        agg: dict[str, Any] = {
            "samples_per_s": rate,
            "throughput_overhead": 1 - rate / base_rate if rate and base_rate else None,
            "throughput_overhead_jobs": [1 - j["samples_per_s"] / base_rate if base_rate else None for j in mine],
            "samples_per_s_jobs": [j["samples_per_s"] for j in mine],
            "pace_excess": excess,
            "pace_excess_jobs": [j.get("pace_excess") for j in mine],
            "throughput_overhead_within": excess - base_excess if excess is not None and base_excess is not None else None,
            "checkpoints": len(cks),
            "committed": len(ok),
            "full_checkpoints": sum(1 for c in ok if c["kind"] == "full"),
            "stall_ms": median_of(c["stall_ms"] for c in ok),
            "durable_s": median_of(c.get("durable_s") for c in ok),
            "bytes_written": mean_of(c["bytes"] for c in ok),
            # the baseline's CPU is scaled to these jobs' steps (all rounds of each)
            **checkpoint_cpu(
                [r for j in mine for r in j["cpu"]], base_cpu, len(cks), sum(broker) if None not in broker else None
            ),
        }
        out[sink] = agg
    return out


def table(summary: dict[str, Any]) -> str:
    head = (
        "| job | samples/s | overhead | pace excess | overhead within jobs | checkpoints (full) | stall ms | durable s "
        "| training thread s/ckpt (in stalls) | writer | librdkafka | other | trainer process s/ckpt | broker s/ckpt "
        "| trainer CPU overhead "
        "| direct s/ckpt | direct CPU overhead |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]

    def f(x: Any, nd: int = 3, scale: float = 1.0) -> str:
        return "" if x is None else f"{x * scale:.{nd}f}"

    none = summary["none"]
    lines.append(
        f"| none | {f(none['samples_per_s'], 0)} | 0% | {f(none.get('pace_excess'), 1, 100)}% | 0% | | | | | | | | | | | | |"
    )
    for sink in SINKS:
        a = summary.get(sink)
        if a is None:
            continue
        lines.append(
            f"| {sink} | {f(a['samples_per_s'], 0)} | {f(a['throughput_overhead'], 1, 100)}% | "
            f"{f(a.get('pace_excess'), 1, 100)}% | {f(a.get('throughput_overhead_within'), 1, 100)}% | {a['committed']} "
            f"({a['full_checkpoints']}) | {f(a['stall_ms'], 1)} | {f(a['durable_s'], 2)} | "
            f"{f(a.get('cpu_train_s_per_ckpt'))} ({f(a.get('cpu_stall_s_per_ckpt'))}) | {f(a.get('cpu_writer_s_per_ckpt'))} | "
            f"{f(a.get('cpu_kafka_s_per_ckpt'))} | {f(a.get('cpu_other_s_per_ckpt'))} | "
            f"{f(a.get('cpu_trainer_s_per_ckpt'))} | {f(a.get('cpu_broker_s_per_ckpt'))} | "
            f"{f(a.get('cpu_trainer_overhead'), 1, 100)}% | {f(a.get('cpu_direct_s_per_ckpt'))} | "
            f"{f(a.get('cpu_direct_overhead'), 1, 100)}% |"
        )
    return "\n".join(lines)


def jobs_table(jobs: list[dict[str, Any]]) -> str:
    """Each job in the order it ran: its throughput, its pace excess and what the kernel's
    memory counters did meanwhile (`counted`)."""
    keys = [k for k in VMSTAT_KEYS if any(k in (j.get("vmstat") or {}) for j in jobs)]
    head = "| job (in run order) | round | samples/s | pace excess | " + " | ".join(keys) + " |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for j in jobs:
        v = j.get("vmstat") or {}
        rate = "" if j["samples_per_s"] is None else f"{j['samples_per_s']:.0f}"
        excess = "" if j.get("pace_excess") is None else f"{100 * j['pace_excess']:.1f}%"
        lines.append(f"| {j['sink']} | {j['round']} | {rate} | {excess} | " + " | ".join(f"{v.get(k, '')}" for k in keys) + " |")
    return "\n".join(lines)


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(COST_SIZES), default="full", help="the model (bench.peers's suites)")
    p.add_argument("--interval-s", type=float, help="checkpoint interval, seconds (default: the size's)")
    p.add_argument("--steps", type=int, help="steps of every job (default: the size's)")
    p.add_argument("--log-every", type=int, help="steps per logging window, whose rates the figures are of (default: the size's)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of none, kafka, tmpfs (then a closing none)")
    p.add_argument("--sinks", nargs="+", choices=SINKS, default=list(SINKS))
    p.add_argument(
        "--encoding",
        default=DEFAULT_QUANT,
        choices=codec_names(),
        help="the rows' codec (ckpt.encoding.weights; fp32 is the trainer's default)",
    )
    p.add_argument("--tmpfs", type=Path, default=Path("/dev/shm"), help="a tmpfs for the filesystem sink's reference")
    p.add_argument("--out", type=Path, help="write the JSON result here")
    p.add_argument("--keep", type=Path, help="keep run directories here (default: a temporary directory)")
    p.add_argument("--timeout-s", type=float, default=1800)
    return p


def run(argv: list[str], prog: str = "python -m bench.run --suite cost") -> dict[str, Any]:
    args = parser(prog).parse_args(argv)
    if "tmpfs" in args.sinks and not (args.tmpfs.is_dir() and is_tmpfs(args.tmpfs)):
        raise SystemExit(f"bench cost: --tmpfs {args.tmpfs} is not a directory on a tmpfs (see /proc/mounts)")
    started, machine = time.perf_counter(), machine_info()
    peer = SIZES[args.size]
    s = {**COST_SIZES[args.size], "overrides": list(peer["overrides"]), "encoding": args.encoding}
    s.update({k: v for k, v in (("steps", args.steps), ("interval_s", args.interval_s), ("log_every", args.log_every)) if v})
    jobs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-cost-") as tmpdir:
        work = args.keep / f"cost-{uuid.uuid4().hex[:8]}" if args.keep else Path(tmpdir)
        work.mkdir(parents=True, exist_ok=True)
        s["config"] = (
            str(full_config(work / "full.yaml", peer["cap"], peer["dim"]))
            if peer["config"] is None
            else config_path(peer["config"])
        )
        log(
            f"suite cost ({args.size}): {s['config']}, {s['steps']} steps a job, a checkpoint every "
            f"{s['interval_s']:g} s in {s['encoding']}; sinks {', '.join(args.sinks)}; work dir {work}"
        )
        for n in range(args.rounds):
            jobs.append(counted(lambda: none_job(s, work, n, args.timeout_s)))
            for sink in round_order(args.sinks, n):
                jobs.append(counted(lambda: ckpt_job(sink, s, work, n, args.tmpfs, args.timeout_s)))
        jobs.append(counted(lambda: none_job(s, work, args.rounds, args.timeout_s)))
    machine["loadavg_end"] = loadavg()
    summary = summarize(jobs)
    result = {
        **document_head("cost", prog, argv, machine),
        "size": args.size,
        "settings": {k: s[k] for k in ("config", "steps", "interval_s", "log_every", "overrides")}
        | {"policy": DEFAULT_POLICY, "encoding": args.encoding, "rounds": args.rounds, "sinks": args.sinks},
        "summary": summary,
        "jobs": jobs,
        "wall_s": time.perf_counter() - started,
    }
    print(table(summary))
    print()
    print(jobs_table(jobs))
    print(f"wall {result['wall_s']:.0f} s")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """One record per figure of every sink's summary (labels: sink, size, interval_s)."""
    out: list[Measurement] = []
    for sink, agg in result["summary"].items():
        out += scalars(agg, {"sink": sink, "size": result["size"], "interval_s": result["settings"]["interval_s"]})
    return out


def main(argv: list[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv, "python -m bench.cost")
    return 0


if __name__ == "__main__":
    run_main(main)
