"""A checkpoint every step: what it costs against the same job without checkpoints.

    python -m bench.run --suite every-step [--config configs/quickstart.yaml] [--steps 1200]
        [--pairs 2] [--follower] [--kill-at 600] [--out results.json] [key=value ...]

Alternates `--pairs` pairs of `deltarec-train` jobs of 2 ranks (spawned like trainer ranks) on
one embedded broker: without checkpoints, then with `ckpt.interval_steps=1` (incremental,
adaptive 4-bit rows unless overridden). Figures per pair: the throughput overhead (samples/s of
the logged windows after the first), the stall per checkpoint, the time from a checkpoint's
step to its durable COMMIT (p50 / p99, and the p99 of each half of the run: it must not grow),
checkpoints committed and coalesced (`ckpt.max_pending_checkpoints`), bytes per step, and the
exit's wait after the last step (the writers' drain and the final checkpoint). With
`--follower`, the first pair's checkpointed job runs beside `deltarec-follow`: its lag behind
the newest COMMIT at the end and its compactions. With `--kill-at N`, one more job SIGKILLs
rank 1 after step N (the fault hook) under `deltarec-launch --max-restarts 1`: the steps lost
are N minus the step it resumed from.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from statistics import median, quantiles
from typing import Any

from bench.common import Measurement, config_path, document_head, harmonic_of, log, machine_info, scalars
from launch.broker import EmbeddedBroker

REPO = Path(__file__).resolve().parents[1]


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--follower", action="store_true", help="run deltarec-follow beside the first checkpointed job")
    p.add_argument("--kill-at", type=int, default=0, help="a job killed after this step and resumed (0: none)")
    p.add_argument("--timeout-s", type=float, default=1200)
    p.add_argument("--out", type=Path)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every job")
    return p


def _p(xs: list[float], q: int) -> float:
    return quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]


def _job(args: argparse.Namespace, config: str, run_dir: Path, ckpt: list[str], env: dict[str, str] | None = None) -> float:
    """One job under deltarec-launch (torchrun, 2 ranks); returns the seconds its exit took after
    its last step's line."""
    train = [f"train.steps={args.steps}", f"train.log_every={args.log_every}", "train.eval_every=0", "train.eval_batches=1"]
    cmd = [sys.executable, "-m", "launch.torchrun", "--nproc-per-node", "2", "--max-restarts", "1", "--config", config,
           f"run.dir={run_dir}", "train.progress=log", *train, *ckpt, *args.overrides]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
    )
    assert proc.stdout is not None
    last, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if f"step {args.steps}/{args.steps}" in line:
            last = time.monotonic()
    rc = proc.wait(timeout=args.timeout_s)
    end = time.monotonic()
    (run_dir / "console.log").write_text("".join(lines))
    if rc != 0:
        raise RuntimeError(f"job in {run_dir} failed (exit {rc}):\n{''.join(lines)[-3000:]}")
    return end - last if last is not None else float("nan")


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _rate(records: list[dict[str, Any]]) -> float:
    rates = [r["samples_per_s"] for r in records if "samples_per_s" in r][1:]
    return harmonic_of(rates) or float("nan")


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
    }


def _every_step(bootstrap: str) -> list[str]:
    """A run of its own with a checkpoint every step: incremental 4-bit deltas to `bootstrap`."""
    return [
        "ckpt.enabled=true",
        f"ckpt.bootstrap_servers={bootstrap}",
        f"ckpt.run_id=every-step-{uuid.uuid4().hex[:8]}",
        "ckpt.interval_steps=1",
        "ckpt.policy=incremental",
        "ckpt.encoding=adaptive4",
    ]


def _follower(config: str, run_dir: Path, ckpt: list[str]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "trainer.follow_cli", "--config", config, f"run.dir={run_dir}", *ckpt]
    return subprocess.Popen(argv, cwd=REPO, stdout=open(run_dir.parent / "follower.log", "w"), stderr=subprocess.STDOUT)


def _follower_figures(log_path: Path) -> dict[str, Any]:
    text = log_path.read_text()
    behind = [int(m) for m in re.findall(r"; (\d+) behind the newest COMMIT", text)]
    lag = [float(m) for m in re.findall(r", ([\d.]+) s after its COMMIT", text)]
    stopped = re.search(r"stopped: (\d+) checkpoints applied .*?, (\d+) compacted", text)
    return {
        "follower_applied": int(stopped.group(1)) if stopped else len(behind),
        "follower_compacted": int(stopped.group(2)) if stopped else 0,
        "follower_behind_at_end": behind[-1] if behind else None,
        "follower_lag_s_at_end": lag[-1] if lag else None,
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
            base_exit = _job(args, config, base_dir, ["ckpt.enabled=false"])
            ckpt = _every_step(broker.bootstrap)
            every_dir = work / f"every{i}" / "run"
            every_dir.mkdir(parents=True)
            follower = _follower(config, every_dir, ckpt) if args.follower and i == 0 else None
            try:
                exit_s = _job(args, config, every_dir, ckpt)
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
                "exit_after_last_step_s": exit_s,
                "baseline_exit_after_last_step_s": base_exit,
                **_checkpointed(every, args.steps),
                **(_follower_figures(every_dir.parent / "follower.log") if follower is not None else {}),
            }
            log(
                f"pair {i}: overhead {row['overhead']:.1%}, "
                f"COMMIT p50/p99 {row['durable_s_p50']:.2f}/{row['durable_s_p99']:.2f} s, "
                f"{row['committed']} committed, {row['coalesced']} coalesced, exit {exit_s:.2f} s after the last step"
            )
            pairs.append(row)
        if args.kill_at:
            run_dir = work / "killed" / "run"
            ckpt = [*_every_step(broker.bootstrap), "ckpt.resume=latest"]
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
    }
    print("| pair | overhead | stall mean / p99 | step to COMMIT p50 / p99 (halves) | committed / coalesced | MB a step | exit |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in pairs:
        print(
            f"| {r['pair']} | {r['overhead']:.1%} | {r['stall_ms_mean']:.1f} / {r['stall_ms_p99']:.1f} ms | "
            f"{r['durable_s_p50']:.2f} / {r['durable_s_p99']:.2f} s ({r['durable_s_p99_first_half']:.2f}, "
            f"{r['durable_s_p99_second_half']:.2f}) | {r['committed']} / {r['coalesced']} | {r['mb_per_step']:.3f} | "
            f"{r['exit_after_last_step_s']:.2f} s |"
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
    return out
