"""A checkpoint every step: what it costs against the same job without checkpoints.

    python -m bench.run --suite every-step [--config configs/quickstart.yaml] [--steps 1200]
        [--pairs 2] [--follower] [--kill-at 600] [--calibrate] [--out results.json] [key=value ...]

Alternates `--pairs` pairs of `deltarec-train` jobs of 2 ranks (spawned like trainer ranks) on
one embedded broker: without checkpoints, then with `ckpt.schedule.interval_steps=1` (incremental,
adaptive 4-bit rows unless overridden). Figures per pair: the throughput overhead (samples/s of
the logged windows after the first), the stall per checkpoint, the time from a checkpoint's
step to its durable COMMIT (p50 / p99, and the p99 of each half of the run: it must not grow),
checkpoints committed and coalesced (`ckpt.write.max_pending_checkpoints`), bytes per step, the
exit's wait after the last step (the writers' drain and the final checkpoint), and the steps a
crash right after a step would have lost, mean and worst over every step (as rank 0 counted them:
`TrainWindow.steps_at_risk_mean`). With
`--follower`, the first pair's checkpointed job runs beside `deltarec-follow`: the checkpoints it
applied (and in how many passes), its lag behind the newest COMMIT in seconds and in checkpoints
(at the end; median and worst of its passes: the COMMITs in the log newer than the one a pass
applied when it ended, and as the follower counted them), its compactions (and per minute of
the job's checkpoints), and the chain a restore reads: the cheapest chain of the newest COMMIT
right after each COMMIT, folding the markers log as a restore would then (median, worst, at the
end). With
`--kill-at N`, one more job SIGKILLs
rank 1 after step N (the fault hook) under `deltarec-launch --max-restarts 1`: the steps lost
are N minus the step it resumed from.

CPU, per pair: the CPU seconds of each job's processes (the launcher and its ranks, from
/proc) and of the broker over the logged window the throughput is of, per step, and the
cores checkpointing used beyond the job without checkpoints (the broker's among them). Memory,
per pair: how much the resident set of the job's process that grew most (a rank) grew a step
over the second half of that window, without and with checkpoints (a job that checkpoints every
step for days must not grow with its checkpoints; the first half holds the warm-up: buffers
that grow with the rows trained, the allocator's arenas). With
`--calibrate` the job without checkpoints runs three more times: alone, beside `bench.burner`
keeping that many cores busy (the pairs' mean), and beside one keeping the broker's share
busy. When the burner slows the job about as much as checkpointing did, the overhead is the
CPU the writers and the broker take from training on a machine without spare cores, not
waiting on checkpoints; the slowdown of the broker's share is what the co-located broker
alone costs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from statistics import median, quantiles
from typing import Any

from bench.common import Measurement, config_path, document_head, harmonic_of, log, machine_info, scalars
from bench.cpu import process_cpu_s
from bench.memory import rss_bytes
from ckpt.log.backend import open_backend
from ckpt.log.catalog import Catalog
from launch.broker import EmbeddedBroker
from launch.ranks import descendant_pids
from trainer.ckpt_cli import load_job_ckpt_config

REPO = Path(__file__).resolve().parents[1]


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--follower", action="store_true", help="run deltarec-follow beside the first checkpointed job")
    p.add_argument("--kill-at", type=int, default=0, help="a job killed after this step and resumed (0: none)")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="then the job without checkpoints beside a CPU burner of the cores checkpointing used, and of the broker's alone",
    )
    p.add_argument("--timeout-s", type=float, default=1200)
    p.add_argument("--out", type=Path)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every job")
    return p


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _p(xs: list[float], q: int) -> float:
    return quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]


@dataclass
class JobRun:
    """What one job cost: the seconds its exit took after its last step's line, and between the
    first logged step's line and the last one's (the window its throughput is of), the wall
    time, the CPU seconds of its processes (the launcher and the ranks) and of the broker, and
    the most one of its processes' resident set grew a step over the window's second half."""

    exit_s: float
    window_s: float
    cpu_s: float
    broker_cpu_s: float
    rss_b_per_step: float


def _job(
    args: argparse.Namespace,
    config: str,
    run_dir: Path,
    ckpt: list[str],
    env: dict[str, str] | None = None,
    broker: int | None = None,
) -> JobRun:
    """One job under deltarec-launch (torchrun, 2 ranks), with its CPU over the logged window
    (`broker`: the broker's pid, whose CPU is read over the same window)."""
    train = [f"train.steps={args.steps}", f"train.log_every={args.log_every}", "train.eval_every=0", "train.eval_batches=1"]
    cmd = [sys.executable, "-m", "launch.torchrun", "--nproc-per-node", "2", "--max-restarts", "1", "--config", config,
           f"run.dir={run_dir}", "train.progress=log", *train, *ckpt, *args.overrides]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
    )
    assert proc.stdout is not None
    last, lines = None, []
    window: _Window | None = None
    # the logged step that starts the window's second half (its first step when it has no middle line)
    middle = args.log_every * math.ceil((args.log_every + args.steps) / 2 / args.log_every)
    middle = middle if middle < args.steps else args.log_every
    for line in proc.stdout:
        lines.append(line)
        if window is None and f"step {args.log_every}/{args.steps}" in line:
            window = _Window.open(proc.pid, broker)
        if window is not None and f"step {middle}/{args.steps}" in line:
            window.middle()
        if f"step {args.steps}/{args.steps}" in line:
            last = time.monotonic()
            if window is not None:
                window.close()
    rc = proc.wait(timeout=args.timeout_s)
    end = time.monotonic()
    (run_dir / "console.log").write_text("".join(lines))
    if rc != 0:
        raise RuntimeError(f"job in {run_dir} failed (exit {rc}):\n{''.join(lines)[-3000:]}")
    exit_s = end - last if last is not None else float("nan")
    if window is None or window.wall_s is None:
        return JobRun(exit_s, float("nan"), float("nan"), float("nan"), float("nan"))
    return JobRun(exit_s, window.wall_s, window.cpu_s, window.broker_cpu_s, window.rss_growth_b / (args.steps - middle))


@dataclass
class _Window:
    """CPU of a job's processes and of the broker between two of its console lines, and how much
    its processes' resident sets grew from a third (`middle`) to the last."""

    processes: dict[int, float]
    rss: dict[int, int]
    broker: int | None
    broker_at: float
    started: float
    wall_s: float | None = None
    cpu_s: float = 0.0
    broker_cpu_s: float = 0.0
    rss_growth_b: float = 0.0

    @classmethod
    def open(cls, pid: int, broker: int | None) -> _Window:
        pids = [pid, *descendant_pids(pid)]
        at = {p: cpu for p in pids if (cpu := process_cpu_s(p)) is not None}
        rss = {p: b for p in pids if (b := _rss(p)) is not None}
        broker_at = (process_cpu_s(broker) or 0.0) if broker is not None else 0.0
        return cls(at, rss, broker, broker_at, time.monotonic())

    def close(self) -> None:
        self.wall_s = time.monotonic() - self.started
        # a process gone before the window closed counts nothing (none should be: ranks live on)
        self.cpu_s = sum((process_cpu_s(p) or cpu) - cpu for p, cpu in self.processes.items())
        self.rss_growth_b = max(((_rss(p) or b) - b for p, b in self.rss.items()), default=0)

    def middle(self) -> None:
        self.rss = {p: b for p in self.rss if (b := _rss(p)) is not None}
        if self.broker is not None:
            self.broker_cpu_s = (process_cpu_s(self.broker) or self.broker_at) - self.broker_at


def _rss(pid: int) -> int | None:
    """The resident set of `pid` in bytes; None once it is gone."""
    try:
        return rss_bytes(pid)
    except OSError:
        return None


def _records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines metrics file (a run directory: its `metrics.jsonl`)."""
    path = path / "metrics.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rate(records: list[dict[str, Any]]) -> float:
    rates = [r["samples_per_s"] for r in records if "samples_per_s" in r][1:]
    return harmonic_of(rates) or float("nan")


def _at_risk(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The steps a crash right after a step would have lost, over every step of the run (each
    logged window's mean weighted by its steps; the worst of any window), as rank 0 counted them
    (`TrainWindow.steps_at_risk_mean`, an upper bound)."""
    windows = [r for r in records if r.get("event") == "train" and r.get("steps_at_risk_max") is not None]
    ends = [0, *(int(r["step"]) for r in windows)]
    weights = [b - a for a, b in zip(ends, ends[1:])]
    if not windows or not sum(weights):
        return {"at_risk_mean": None, "at_risk_max": None}
    mean = sum(w * r["steps_at_risk_mean"] for w, r in zip(weights, windows)) / sum(weights)
    return {"at_risk_mean": mean, "at_risk_max": max(int(r["steps_at_risk_max"]) for r in windows)}


def _checkpointed(records: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    done = [r for r in records if r.get("event") == "checkpoint_committed"]
    durable = [r["ckpt_durable_s"] for r in done]
    half = len(durable) // 2
    return {
        "committed": len(done),
        "coalesced": sum(1 for r in records if r.get("ckpt_coalesced")),
        "stall_ms_mean": sum(r["ckpt_stall_ms"] for r in done) / len(done),
        "stall_ms_p99": _p([r["ckpt_stall_ms"] for r in done], 99),
        "durable_s_p50": median(durable),
        "durable_s_p99": _p(durable, 99),
        "durable_s_p99_first_half": _p(durable[:half], 99),
        "durable_s_p99_second_half": _p(durable[half:], 99),
        "mb_per_step": sum(r["ckpt_bytes"] for r in done) / 1e6 / steps,
        **_at_risk(records),
    }


def _dense_bytes(run_dir: Path) -> int:
    """Bytes of the dense files a run left in its run directory (`ckpt.sink.dense_dir`'s default):
    written once a checkpoint beside its rows, and kept until `deltarec-ckpt gc` drops them."""
    return sum(p.stat().st_size for p in (run_dir / "dense").glob("dense-*.pt"))


def _every_step(bootstrap: str) -> list[str]:
    """A run of its own with a checkpoint every step: incremental 4-bit deltas to `bootstrap`."""
    return [
        "ckpt.enabled=true",
        f"ckpt.sink.bootstrap_servers={bootstrap}",
        f"ckpt.run_id=every-step-{uuid.uuid4().hex[:8]}",
        "ckpt.schedule.interval_steps=1",
        "ckpt.schedule.policy=incremental",
        "ckpt.encoding.weights=adaptive4",
    ]


def _follower(config: str, run_dir: Path, ckpt: list[str]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "trainer.follow_cli", "--config", config, f"run.dir={run_dir}", *ckpt]
    with open(run_dir.parent / "follower.log", "wb") as out:  # the child holds its own descriptor
        return subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


def _follower_figures(log_path: Path, metrics_path: Path) -> dict[str, Any]:
    """What the follower's log and its metrics (`follower.jsonl`) say: checkpoints applied (one
    record per pass: a rebuild, or the deltas it found waiting, applied at once), its lag at each
    pass, its compactions."""
    text = log_path.read_text()
    stopped = re.search(r"stopped: (\d+) checkpoints applied in (\d+) passes .*?, (\d+) compacted", text)
    records = _records(metrics_path) if metrics_path.is_file() else []
    passes = [r for r in records if "follow_ckpt" in r]
    lag_c = [r["follow_lag_ckpts"] for r in passes]
    lag_s = [r["follow_lag_s"] for r in passes]
    return {
        "follower_applied": int(stopped.group(1)) if stopped else None,
        "follower_passes": len(passes),
        "follower_compacted": sum(1 for r in records if "compacted_ckpt" in r),
        "follower_behind_at_end": lag_c[-1] if lag_c else None,
        "follower_lag_s_at_end": lag_s[-1] if lag_s else None,
        "follower_lag_ckpts_p50": median(lag_c) if lag_c else None,
        "follower_lag_ckpts_max": max(lag_c, default=None),
        "follower_lag_s_p50": median(lag_s) if lag_s else None,
        "follower_lag_s_max": max(lag_s, default=None),
        "follower_compact_s_p50": median([r["compact_s"] for r in records if "compact_s" in r] or [math.nan]),
    }


def _log_figures(config: str, run_dir: Path, ckpt: list[str]) -> dict[str, Any]:
    """`restore_chains` and `behind_at_passes` of the run's markers log."""
    cfg = load_job_ckpt_config(config, [f"run.dir={run_dir}", *ckpt])
    backend = open_backend(cfg.run_id, cfg.sink, world_size=1)
    try:
        records = backend.markers.read_markers()
    finally:
        backend.close()
    metrics = run_dir / "follower.jsonl"
    passes = [r for r in _records(metrics) if "follow_ckpt" in r] if metrics.is_file() else []
    return {**restore_chains(records, cfg.run_id), **behind_at_passes(records, cfg.run_id, passes)}


def restore_chains(records: list[tuple[int, bytes]], run_id: str) -> dict[str, Any]:
    """A markers log folded one record at a time, as a restore right after each COMMIT would
    fold it: the links of that COMMIT's cheapest chain then (a compacted baseline and the deltas
    after it, or the trainer's own chain: what a restore reads), and the accepted compactions
    per minute of the span the COMMITs cover."""
    catalog = Catalog(run_id)
    chains: list[int] = []
    times: list[float] = []
    for pos, data in records:
        catalog.last_marker = None
        catalog.feed([(pos, data)])
        if catalog.last_marker is not None and catalog.last_marker[1].kind == "commit":
            commit = catalog.last_marker[1]
            times.append(commit.created_unix)
            best = catalog.cheapest(commit)
            chains.append(len(best.chain) if best is not None else 0)
    minutes = (times[-1] - times[0]) / 60 if len(times) > 1 else math.nan
    return {
        "restore_chain_links_p50": median(chains) if chains else None,
        "restore_chain_links_p99": _p([float(c) for c in chains], 99) if chains else None,
        "restore_chain_links_max": max(chains, default=None),
        "restore_chain_links_at_end": chains[-1] if chains else None,
        "compactions_accepted": len(catalog.compactions),
        "compactions_per_min": len(catalog.compactions) / minutes if minutes > 0 else None,
    }


def behind_at_passes(records: list[tuple[int, bytes]], run_id: str, passes: list[dict[str, Any]]) -> dict[str, Any]:
    """How many COMMITs newer than the one each pass applied were in the log when the pass ended
    (its COMMIT's time plus its `follow_lag_s`): the follower's own `follow_lag_ckpts` counts
    those it had read, as of its last read of the log."""
    committed = sorted((m.created_unix, m.checkpoint_id) for m in Catalog(run_id).feed(records).commits.values())
    behind = []
    for p in passes:
        at = next((t for t, cid in committed if cid == p["follow_ckpt"]), None)
        if at is not None:
            ended = at + p["follow_lag_s"]
            behind.append(sum(1 for t, cid in committed if cid > p["follow_ckpt"] and t <= ended))
    return {
        "follower_behind_ckpts_p50": median(behind) if behind else None,
        "follower_behind_ckpts_max": max(behind, default=None),
    }


def _cpu_figures(base: JobRun, every: JobRun, steps: int) -> dict[str, float]:
    """CPU a step over the logged window, without and with checkpoints (the job's processes),
    the broker's, the cores checkpointing used beyond the baseline (the broker's among them),
    and the growth a step of the resident set that grew most (the window's second half), without
    and with checkpoints."""
    extra_s = every.cpu_s - base.cpu_s + every.broker_cpu_s - base.broker_cpu_s
    return {
        "cpu_ms_per_step_baseline": base.cpu_s / steps * 1e3,
        "cpu_ms_per_step": every.cpu_s / steps * 1e3,
        "broker_cpu_ms_per_step": every.broker_cpu_s / steps * 1e3,
        "extra_cores": extra_s / every.window_s,
        "broker_cores": every.broker_cpu_s / every.window_s,
        "rss_kb_per_step_baseline": base.rss_b_per_step / 1024,
        "rss_kb_per_step": every.rss_b_per_step / 1024,
    }


def _burned(args: argparse.Namespace, config: str, run_dir: Path, cores: float) -> float:
    """The rate of the job without checkpoints beside `bench.burner` keeping `cores` busy (none: 0)."""
    burner = None
    if cores > 0:
        cmd = [sys.executable, "-m", "bench.burner", "--cores", f"{cores:.4f}"]
        burner = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    try:
        _job(args, config, run_dir, ["ckpt.enabled=false"])
    finally:
        if burner is not None:
            os.killpg(burner.pid, signal.SIGKILL)
            burner.wait()
    return _rate(_records(run_dir))


def _calibrate(args: argparse.Namespace, config: str, work: Path, pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """Price the cores checkpointing used (the pairs' mean, and the broker's part alone): the job
    without checkpoints, then beside a burner of each, and their slowdowns against it."""
    cores = sum(r["extra_cores"] for r in pairs) / len(pairs)
    broker = sum(r["broker_cores"] for r in pairs) / len(pairs)
    base = _burned(args, config, work / "calibrate-base" / "run", 0.0)
    burned = _burned(args, config, work / "calibrate-burn" / "run", cores)
    broker_burned = _burned(args, config, work / "calibrate-broker" / "run", broker)
    log(
        f"calibrated: {cores:.2f} cores burnt: {1 - burned / base:.1%} slower; the broker's {broker:.2f}: "
        f"{1 - broker_burned / base:.1%}"
    )
    return {
        "baseline_samples_per_s": base,
        "burn_cores": cores,
        "burn_slowdown": 1 - burned / base,
        "broker_burn_cores": broker,
        "broker_burn_slowdown": 1 - broker_burned / base,
    }


def run(argv: list[str], prog: str = "python -m bench.run --suite every-step") -> dict[str, Any]:
    args = parser(prog).parse_args(argv)
    config = config_path(args.config)
    pairs: list[dict[str, Any]] = []
    killed: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="every-step-") as tmp, EmbeddedBroker() as broker:
        work = Path(tmp)
        for i in range(args.pairs):
            base_dir = work / f"base{i}" / "run"
            base_job = _job(args, config, base_dir, ["ckpt.enabled=false"], broker=broker.pid)
            ckpt = _every_step(broker.bootstrap)
            every_dir = work / f"every{i}" / "run"
            every_dir.mkdir(parents=True)
            follower = _follower(config, every_dir, ckpt) if args.follower and i == 0 else None
            try:
                every_job = _job(args, config, every_dir, ckpt, broker=broker.pid)
            finally:
                if follower is not None:
                    time.sleep(2.0)  # what it applies right after the job ends counts
                    follower.send_signal(signal.SIGINT)
                    follower.wait(timeout=60)
            base, every = _rate(_records(base_dir)), _records(every_dir)
            row = {
                "pair": i,
                "baseline_samples_per_s": base,
                "samples_per_s": _rate(every),
                "overhead": 1 - _rate(every) / base,
                "exit_after_last_step_s": every_job.exit_s,
                "baseline_exit_after_last_step_s": base_job.exit_s,
                **_checkpointed(every, args.steps),
                "dense_mb_per_step": _dense_bytes(every_dir) / 1e6 / args.steps,
                **_cpu_figures(base_job, every_job, args.steps - args.log_every),
            }
            if follower is not None:
                row.update(_follower_figures(every_dir.parent / "follower.log", every_dir / "follower.jsonl"))
                row.update(_log_figures(config, every_dir, ckpt))
            log(
                f"pair {i}: overhead {row['overhead']:.1%}, "
                f"COMMIT p50/p99 {row['durable_s_p50']:.2f}/{row['durable_s_p99']:.2f} s, "
                f"{row['committed']} committed, {row['coalesced']} coalesced, exit {every_job.exit_s:.2f} s after the last step, "
                f"{row['extra_cores']:.2f} cores more ({row['broker_cores']:.2f} of them the broker's)"
            )
            pairs.append(row)
        calibrated = _calibrate(args, config, work, pairs) if args.calibrate and pairs else {}
        if args.kill_at:
            run_dir = work / "killed" / "run"
            ckpt = [*_every_step(broker.bootstrap), "ckpt.restore.resume=latest"]
            _job(args, config, run_dir, ckpt, env={"DELTAREC_KILL_AT": f"step:{args.kill_at}@1"})
            found = re.search(r"resumed from checkpoint (\d+) at step (\d+)", (run_dir / "console.log").read_text())
            resumed_step = int(found.group(2)) if found else None
            killed = {
                "kill_at_step": args.kill_at,
                "resumed_step": resumed_step,
                "steps_lost": args.kill_at - resumed_step if resumed_step is not None else None,
            }
            log(f"killed after step {args.kill_at}: resumed from step {resumed_step}")
    result = {
        **document_head("every-step", prog, argv, machine_info()),
        "settings": {"config": args.config, "steps": args.steps, "pairs": args.pairs, "overrides": args.overrides},
        "pairs": pairs,
        "killed": killed,
        "calibrated": calibrated,
    }
    print(
        "| pair | overhead | stall mean / p99 | step to COMMIT p50 / p99 (halves) | committed / coalesced "
        "| MB a step: rows, dense files | exit | steps a crash after a step loses: mean / max |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in pairs:
        print(
            f"| {r['pair']} | {r['overhead']:.1%} | {r['stall_ms_mean']:.1f} / {r['stall_ms_p99']:.1f} ms | "
            f"{r['durable_s_p50']:.2f} / {r['durable_s_p99']:.2f} s ({r['durable_s_p99_first_half']:.2f}, "
            f"{r['durable_s_p99_second_half']:.2f}) | {r['committed']} / {r['coalesced']} | "
            f"{r['mb_per_step']:.3f}, {r['dense_mb_per_step']:.3f} | {r['exit_after_last_step_s']:.2f} s | "
            f"{_f(r['at_risk_mean'])} / {r['at_risk_max']} |"
        )
    followed = [r for r in pairs if "follower_passes" in r]
    if followed:
        print(
            "\n| pair | follower applied / committed (passes) | behind at the end: checkpoints, s | lag p50 / max: "
            "checkpoints; s | compactions (per min) | chain a restore reads p50 / p99 / max (at the end) |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in followed:
        print(
            f"| {r['pair']} | {r['follower_applied']} / {r['committed']} ({r['follower_passes']}) | "
            f"{r['follower_behind_at_end']}, {_f(r['follower_lag_s_at_end'])} | "
            f"{_f(r['follower_behind_ckpts_p50'])} / {r['follower_behind_ckpts_max']}; "
            f"{_f(r['follower_lag_s_p50'])} / {_f(r['follower_lag_s_max'])} s | "
            f"{r['compactions_accepted']} ({_f(r['compactions_per_min'])}) | "
            f"{_f(r['restore_chain_links_p50'])} / {_f(r['restore_chain_links_p99'])} / {r['restore_chain_links_max']} "
            f"({r['restore_chain_links_at_end']}) |"
        )
    print(
        "\n| pair | CPU a step: without / with checkpoints (ranks) | the broker's | cores more (the broker's) "
        "| a rank's memory growth a step, second half: without / with |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in pairs:
        print(
            f"| {r['pair']} | {r['cpu_ms_per_step_baseline']:.1f} / {r['cpu_ms_per_step']:.1f} ms | "
            f"{r['broker_cpu_ms_per_step']:.1f} ms | {r['extra_cores']:.2f} ({r['broker_cores']:.2f}) | "
            f"{r['rss_kb_per_step_baseline']:.1f} / {r['rss_kb_per_step']:.1f} KB |"
        )
    if calibrated:
        print(
            f"\nthe job without checkpoints ({calibrated['baseline_samples_per_s']:,.0f} samples/s) beside a burner of "
            f"{calibrated['burn_cores']:.2f} cores: {calibrated['burn_slowdown']:.1%} slower; of the broker's "
            f"{calibrated['broker_burn_cores']:.2f}: {calibrated['broker_burn_slowdown']:.1%}"
        )
    if killed:
        print(f"\nSIGKILL after step {killed['kill_at_step']}: resumed from step {killed['resumed_step']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


def measurements(result: dict[str, Any]) -> list[Measurement]:
    out = []
    for r in result["pairs"]:
        out += scalars({k: v for k, v in r.items() if k != "pair"}, {"pair": r["pair"]})
    if result["killed"]:
        out += scalars(result["killed"])
    if result.get("calibrated"):
        out += scalars(result["calibrated"])
    return out
