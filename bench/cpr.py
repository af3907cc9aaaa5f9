"""CPR's comparison on this machine: full against partial recovery under injected failures.

    python -m bench.run --suite cpr [--steps 2000] [--kills 5] [--seeds 1 2 3] [--interval 100]
                                    [--modes full partial] [--out cpr.json] [--plot-dir docs/img]

CPR (MLSys'21) measured, on production recommendation jobs, that full recovery (every rank
rolls back to the checkpoint and trains again) costs 8.2-8.5% of training time and that
restoring only the failed shards cuts the checkpoint-related overhead to 0.53-0.68% with
on-par model quality. Here, per seed and per mode, one job of ``--steps`` steps (the learnable
synthetic click stream of ``configs/debug_cpu.yaml``, embedding lr 0.2, ``row_wise`` tables so
every rank holds part of every table, as CPR's embedding servers do) runs on 2 gloo ranks
under ``deltarec-launch --max-restarts K`` with ``ckpt.restore.resume=latest``, checkpointing every
``--interval`` steps to the filesystem sink, and is SIGKILLed K times from outside: kill i
lands once the running attempt has logged step >= s_i, on rank r_i, both drawn from the seed
(s_1 < ... < s_K at least ``--kill-gap`` apart, by default an interval + 20), so every mode
fails at the same points, and runs with one seed and gap at the same points whatever their
interval.

Reported per mode (means over seeds), each against the same job never interrupted (the
reference, checkpoints on):

* re-trained steps: per restore, the newest step the killed attempt logged (``--log-every``
  granularity, a lower bound) minus the step training resumed at (the checkpoint's under
  full recovery, the survivors' under partial);
* overhead fraction: (re-trained steps x the reference's seconds per step + checkpoint stalls
  + restores) / the reference's training time: CPR's "checkpoint-related overhead", without
  the restart cost (process start and rendezvous, the same in every mode: the wall-time
  overhead shows it);
* PLS: samples whose updates a partial recovery lost / samples trained (ckpt/recovery/lost_samples.py);
* final eval log loss (relative, %) and AUC against the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import fmean
from typing import Any

from bench.common import Measurement, config_path, document_head, figure, loadavg, log, machine_info, scalars
from common.process import run_main
from launch.ranks import REPO, kill_tree, rank_pids, read_jsonl, spawn_ranks

DEFAULT_CONFIG = REPO / "configs" / "debug_cpu.yaml"
RANKS = 2
_PRIORITY = [
    "ckpt.recovery.mode=partial",
    "ckpt.schedule.policy=incremental",
    "ckpt.recovery.priority_budget=0.1",
    "ckpt.recovery.priority_full_every=5",
]
MODES = {  # mode -> its overrides
    "full": ["ckpt.recovery.mode=full"],
    "partial": ["ckpt.recovery.mode=partial"],
    "partial+mfu": [*_PRIORITY, "ckpt.recovery.priority=mfu"],
    "partial+ssu": [*_PRIORITY, "ckpt.recovery.priority=ssu"],
}


def schedule(seed: int, steps: int, kills: int, gap: int) -> list[tuple[int, int]]:
    """(step, rank) of each kill: steps in the middle 80% of the run, at least `gap` steps apart
    (more than an interval: every attempt commits a checkpoint before it dies), ranks at random."""
    rng = random.Random(seed)
    lo, hi = steps // 10, steps * 9 // 10
    if hi - lo < kills * gap:
        raise SystemExit(f"--steps {steps} is too short for {kills} kills {gap} steps apart")
    picks = sorted(rng.sample(range(hi - lo - (kills - 1) * gap), kills))
    return [(lo + p + i * gap, rng.randrange(RANKS)) for i, p in enumerate(picks)]


def _job_args(args: argparse.Namespace, run_dir: Path, seed: int) -> list[str]:
    return [
        f"run.dir={run_dir}",
        f"run.seed={seed}",
        f"train.steps={args.steps}",
        f"train.log_every={args.log_every}",
        f"train.eval_batches={args.eval_batches}",
        "train.eval_every=0",
        "train.progress=log",
        "sharding.default=row_wise",
        "ckpt.enabled=true",
        "ckpt.sink.kind=filesystem",
        f"ckpt.schedule.interval_steps={args.interval}",
        f"ckpt.run_id=cpr-{seed}",
        *args.overrides,
    ]


def _records(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path, live=True)


def run_mode(mode: str, seed: int, kills: list[tuple[int, int]], args: argparse.Namespace, work: Path) -> dict:
    """One job of `mode` killed at `kills`; its figures from metrics.jsonl."""
    run_dir = work / f"{mode}-seed{seed}" / "run"
    cmd = [
        sys.executable,
        "-m",
        "launch.torchrun",
        "--nproc-per-node",
        str(RANKS),
        "--max-restarts",
        str(len(kills)),
        "--config",
        str(args.config),
        *_job_args(args, run_dir, seed),
        *MODES[mode],
        "ckpt.restore.resume=latest",
    ]
    metrics = run_dir / "metrics.jsonl"
    log_path = work / f"{mode}-seed{seed}.log"
    t0 = time.monotonic()
    deadline = t0 + args.timeout_s
    with open(log_path, "w") as out:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        killed: set[int] = set()
        for step, victim in kills:
            while True:  # the next attempt's ranks
                ranks = rank_pids(job.pid)
                if len(ranks) == RANKS and not killed & set(ranks.values()):
                    break
                _check_alive(job, deadline, log_path)
                time.sleep(0.05)  # polling the launcher's children
            start = len(_records(metrics))
            while not any(r.get("loss") is not None and r["step"] >= step for r in _records(metrics)[start:]):
                _check_alive(job, deadline, log_path)
                time.sleep(0.05)  # polling the job's metrics file
            os.kill(ranks[victim], signal.SIGKILL)
            killed.update(ranks.values())
        rc = job.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
            job.wait()
    if rc != 0:
        raise RuntimeError(f"{mode} job of seed {seed} failed (exit {rc}):\n{log_path.read_text()[-4000:]}")
    return {"mode": mode, "seed": seed, "wall_s": time.monotonic() - t0, **figures(_records(metrics), args)}


def _check_alive(job: subprocess.Popen, deadline: float, log_path: Path) -> None:
    if job.poll() is not None or time.monotonic() > deadline:
        raise RuntimeError(f"the job ended or timed out before its kills were done:\n{log_path.read_text()[-4000:]}")


def figures(records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Re-trained steps, stalls, restores, lost samples and the final eval of one job's records."""
    attempts: list[list[dict[str, Any]]] = [[]]
    for r in records:
        if "restored_ckpt" in r:
            attempts.append([])
        attempts[-1].append(r)
    retrained = []
    for before, after in zip(attempts, attempts[1:]):
        reached = max([r["step"] for r in before if "loss" in r or "ckpt_id" in r] + [0])
        partial = [r for r in after if r.get("partial_restore")]
        resumed = partial[0]["step"] if partial else after[0]["step"]
        retrained.append(max(0, reached - resumed))
    samples = args.steps * args.batch * RANKS
    evals = [r for r in records if "eval_logloss" in r]
    return {
        "restores": len(attempts) - 1,
        "partial_restores": sum(1 for r in records if r.get("partial_restore")),
        "retrained_steps": sum(retrained),
        "retrained_per_restore": retrained,
        "stall_s": sum(r["ckpt_stall_ms"] for r in records if "ckpt_stall_ms" in r) / 1e3,
        "ckpt_mb": sum(r["ckpt_bytes"] for r in records if r.get("ckpt_committed")) / 1e6,
        "restore_s": sum(r["restore_s"] for r in records if "restore_s" in r),
        "lost_samples": sum(r.get("partial_lost_samples", 0.0) for r in records),
        "pls": sum(r.get("partial_lost_samples", 0.0) for r in records) / samples,
        "rates": [r["samples_per_s"] for r in records if "samples_per_s" in r],
        "eval_logloss": evals[-1]["eval_logloss"],
        "eval_auc": evals[-1]["eval_auc"],
    }


def run_reference(seed: int, args: argparse.Namespace, work: Path) -> dict:
    """The same job never interrupted (checkpoints on, full recovery: nothing to recover)."""
    run_dir = work / f"reference-seed{seed}" / "run"
    run_dir.parent.mkdir(parents=True)
    t0 = time.monotonic()
    spawn_ranks(args.config, _job_args(args, run_dir, seed), run_dir.parent, timeout_s=args.timeout_s)
    return {
        "mode": "reference",
        "seed": seed,
        "wall_s": time.monotonic() - t0,
        **figures(read_jsonl(run_dir / "metrics.jsonl"), args),
    }


def compare(job: dict, ref: dict, args: argparse.Namespace) -> dict:
    """A job's figures against its seed's reference."""
    step_s = args.batch * RANKS * fmean(1 / r for r in ref["rates"])  # harmonic mean of the rates
    train_s = args.steps * step_s
    retrain_s = job["retrained_steps"] * step_s
    return {
        "mode": job["mode"],
        "seed": job["seed"],
        "restores": job["restores"],
        "partial_restores": job["partial_restores"],
        "retrained_steps": job["retrained_steps"],
        "retrain_s": retrain_s,
        "stall_s": job["stall_s"],
        "restore_s": job["restore_s"],
        "ckpt_mb": job["ckpt_mb"],
        "overhead_pct": 100 * (retrain_s + job["stall_s"] + job["restore_s"]) / train_s,
        "retrain_pct": 100 * retrain_s / train_s,
        "ckpt_pct": 100 * (job["stall_s"] + job["restore_s"]) / train_s,
        "wall_overhead_pct": 100 * (job["wall_s"] - ref["wall_s"]) / ref["wall_s"],
        "pls": job["pls"],
        "lost_samples": job["lost_samples"],
        "logloss_rel_pct": 100 * (job["eval_logloss"] - ref["eval_logloss"]) / ref["eval_logloss"],
        "auc_delta": job["eval_auc"] - ref["eval_auc"],
        "eval_logloss": job["eval_logloss"],
        "eval_auc": job["eval_auc"],
        "reference_logloss": ref["eval_logloss"],
        "reference_auc": ref["eval_auc"],
        "reference_step_s": step_s,
        "wall_s": job["wall_s"],
        "reference_wall_s": ref["wall_s"],
    }


SUMMED = (
    "retrained_steps",
    "ckpt_mb",
    "overhead_pct",
    "retrain_pct",
    "ckpt_pct",
    "wall_overhead_pct",
    "pls",
    "logloss_rel_pct",
    "auc_delta",
    "restore_s",
    "stall_s",
    "partial_restores",
)


def summarize(rows: list[dict], modes: list[str]) -> list[dict]:
    """Per mode, the mean over seeds of every compared figure."""
    return [
        {"mode": m, "seeds": len(rs), **{k: fmean(r[k] for r in rs) for k in SUMMED}}
        for m in modes
        if (rs := [r for r in rows if r["mode"] == m])
    ]


def table(summary: list[dict]) -> str:
    lines = [
        "| mode | re-trained steps | checkpoint MB written | overhead (re-train + ckpt) | of which ckpt | "
        "wall vs uninterrupted | PLS | log loss vs uninterrupted | AUC vs uninterrupted |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summary:
        lines.append(
            f"| {s['mode']} | {s['retrained_steps']:.1f} | {s['ckpt_mb']:.1f} | {s['overhead_pct']:.2f}% | "
            f"{s['ckpt_pct']:.2f}% | "
            f"{s['wall_overhead_pct']:+.1f}% | {s['pls']:.4f} | {s['logloss_rel_pct']:+.3f}% | "
            f"{s['auc_delta']:+.4f} |"
        )
    return "\n".join(lines)


def plot(summary: list[dict], rows: list[dict], path: Path) -> str:
    """Overhead (re-training and checkpointing) and log-loss change per mode, seeds as dots."""
    with figure(path, 1, 2, figsize=(9.5, 3.6)) as (fig, (ax1, ax2)):
        modes = [s["mode"] for s in summary]
        x = range(len(modes))
        ax1.bar(x, [s["retrain_pct"] for s in summary], label="re-training", color="#c44e52")
        ax1.bar(
            x,
            [s["ckpt_pct"] for s in summary],
            bottom=[s["retrain_pct"] for s in summary],
            label="checkpoint stalls + restores",
            color="#4c72b0",
        )
        ax1.set_xticks(list(x), modes)
        ax1.set_ylabel("% of training time")
        ax1.set_title("failure-handling overhead")
        ax1.legend(fontsize=8)
        for i, m in enumerate(modes):
            ys = [r["logloss_rel_pct"] for r in rows if r["mode"] == m]
            ax2.scatter([i] * len(ys), ys, color="#555555", s=14, zorder=3)
            ax2.bar(i, fmean(ys), color="#8172b2", alpha=0.6)
        ax2.axhline(0, color="black", lw=0.8)
        ax2.set_xticks(list(x), modes)
        ax2.set_ylabel("final eval log loss vs uninterrupted (%)")
        ax2.set_title("model quality (dots: seeds)")
        fig.suptitle(f"{rows[0]['restores']} SIGKILLs of a random rank per job, 2 CPU ranks", fontsize=9)
    return str(path)


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--interval", type=int, default=100, help="checkpoint every N steps")
    p.add_argument(
        "--kill-gap",
        type=int,
        default=0,
        help="least steps between kills (default interval + 20); the same gap gives the same kill points",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="run.seed and the kill schedule's seed")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--batch", type=int, default=256, help="data.batch_size of the config (for sample counts)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument(
        "--set", dest="overrides", action="append", default=["optimizer.sparse.lr=0.2"], help="more config overrides (repeatable)"
    )
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--out", default="cpr.json")
    p.add_argument("--plot-dir", type=Path)
    p.add_argument("--work-dir", type=Path, help="keep the runs here (default: a temporary directory, removed)")
    return p


def run(argv: list[str], prog: str = "python -m bench.run --suite cpr") -> dict[str, Any]:
    args = parser(prog).parse_args(argv)
    args.config = Path(config_path(args.config))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="deltarec-cpr-"))
    machine = machine_info()
    t0 = time.perf_counter()
    rows, schedules = [], {}
    try:
        for seed in args.seeds:
            kills = schedule(seed, args.steps, args.kills, args.kill_gap or args.interval + 20)
            schedules[seed] = kills
            log(f"seed {seed}: kills at (step, rank) {kills}")
            ref = run_reference(seed, args, work)
            for mode in args.modes:
                job = run_mode(mode, seed, kills, args, work)
                rows.append(compare(job, ref, args))
                r = rows[-1]
                log(
                    f"seed {seed} {mode}: {r['restores']} restores, {r['retrained_steps']} steps re-trained, overhead "
                    f"{r['overhead_pct']:.2f}%, PLS {r['pls']:.4f}, log loss {r['logloss_rel_pct']:+.3f}%"
                )
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    machine["loadavg_end"] = loadavg()
    summary = summarize(rows, args.modes)
    res = {
        **document_head("cpr", prog, argv, machine),
        "seconds": round(time.perf_counter() - t0, 1),
        "settings": {
            "config": str(args.config),
            "steps": args.steps,
            "kills": args.kills,
            "interval": args.interval,
            "seeds": args.seeds,
            "overrides": args.overrides,
            "world_size": RANKS,
        },
        "schedules": {str(k): v for k, v in schedules.items()},
        "rows": rows,
        "summary": summary,
        "table_md": table(summary),
    }
    print(res["table_md"])
    if args.plot_dir:
        res["plot"] = plot(summary, rows, Path(args.plot_dir) / "cpr_overhead_quality.png")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return res


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """Per mode, the means over seeds."""
    out = []
    for s in result["summary"]:
        out += scalars({k: v for k, v in s.items() if k != "mode"}, {"mode": s["mode"], "kills": result["settings"]["kills"]})
    return out


def main(argv: list[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv, "python -m bench.cpr")
    return 0


if __name__ == "__main__":
    run_main(main)
