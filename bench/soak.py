"""Soak: a long job SIGKILLed again and again from outside, resumed by torchrun each time, must
end bit-identical to the same job never interrupted.

    python -m bench.soak --sink filesystem --steps 20000 --kills 20 --seed 7 --out soak-fs.json
    python -m bench.soak --sink kafka --steps 20000 --kills 20 --seed 7 --out soak-kafka.json
    python -m bench.soak --sink kafka --set data.workers=1 --set ckpt.schedule.policy=incremental ...

The job is `--config` (configs/debug_cpu.yaml by default) on 2 CPU ranks under `deltarec-launch --max-restarts <kills>`
with `ckpt.restore.resume=latest` (on the embedded broker for `--sink kafka`). A killer outside the
job waits for each attempt to train (its first metrics record), then a random delay (drawn
from `--seed`), and SIGKILLs one random rank; torchrun restarts the job, which resumes from
the newest committed checkpoint. Kills land wherever the delay falls: in a training step, a
checkpoint's stall, its writer or its commit. At
the end every rank's parameters are compared with an uninterrupted run's (no checkpoints).
`--set KEY=VALUE` changes the job and its reference alike (a loader worker, another policy, the
plain loop), after the soak's own settings.

Figures (JSON to `--out`, and a summary line): kills survived, restores, steps re-trained
(per restore: the newest step the killed attempt logged minus the step restored, a lower
bound at `train.log_every` granularity), and wall times. Not part of CI (minutes per sink);
tests/integration/test_soak.py runs a short version.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.errors import ConfigError
from common.process import run_main
from launch.broker import EmbeddedBroker
from launch.ranks import REPO, kill_tree, rank_pids, spawn_ranks
from trainer.config import load_config
from trainer.report import read_metrics

CONFIG = REPO / "configs" / "debug_cpu.yaml"
RANKS = 2
LOG_EVERY = 10


@dataclass
class SoakResult:
    """What one soak run survived and what it cost."""

    sink: str
    seed: int
    steps: int
    kills: int
    restores: int
    steps_retrained: int
    identical: bool
    wall_s: float
    reference_wall_s: float
    kill_delays_s: list[float]
    overrides: list[str]  # `--set`: config overrides of the job and its reference


def _records(metrics: Path) -> int:
    return metrics.read_bytes().count(b"\n") if metrics.is_file() else 0


def _trains(metrics: Path, before: int, job: subprocess.Popen, deadline: float) -> bool:
    """Wait until the attempt logs training progress (a metrics record after `before`)."""
    while _records(metrics) <= before:
        if job.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # polling a file the job writes
    return True


def _params(run_dir: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(run_dir / "params" / f"rank{r}.pt") for r in range(RANKS)]


def _identical(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> bool:
    return all(g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w) for g, w in zip(got, want))


def _train_args(steps: int) -> list[str]:
    return [f"train.steps={steps}", "train.save_params=true", "train.eval_batches=1", f"train.log_every={LOG_EVERY}"]


def _retrained(metrics_path: Path) -> tuple[int, int]:
    """(restores, steps re-trained) from the job's metrics.jsonl."""
    attempts = read_metrics(metrics_path).attempts
    restores, lost = 0, 0
    for before, after in zip(attempts, attempts[1:]):
        if after.restore is None:
            continue
        restores += 1
        reached = max([w.step for w in before.windows] + [c.step for c in before.checkpoints] + [0])
        lost += max(0, reached - after.restore.step)
    return restores, lost


def soak(
    sink: str,
    steps: int,
    kills: int,
    seed: int,
    interval: int,
    delay_s: tuple[float, float],
    work: Path,
    timeout_s: float,
    overrides: Sequence[str] = (),
    config: Path = CONFIG,
) -> SoakResult:
    """One soak run in `work` (reference first); raises RuntimeError when the job fails.
    `overrides` (KEY=VALUE) apply to the reference and to the job alike."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    ref_dir = work / "reference"
    ref_dir.mkdir(parents=True)
    spawn_ranks(config, [*_train_args(steps), *overrides], ref_dir, timeout_s=timeout_s)
    reference = _params(ref_dir / "run")
    reference_wall_s = time.monotonic() - t0

    broker = EmbeddedBroker().start() if sink == "kafka" else None
    run_dir, log = work / "run", work / "launch.log"
    ckpt = [
        "ckpt.enabled=true",
        f"ckpt.sink.kind={sink}",
        f"ckpt.run_id=soak-{seed}",
        f"ckpt.schedule.interval_steps={interval}",
        "ckpt.restore.resume=latest",
        "ckpt.sink.flush_timeout_s=30",
    ]
    if broker is not None:
        ckpt.append(f"ckpt.sink.bootstrap_servers={broker.bootstrap}")
    cmd = [
        sys.executable,
        "-m",
        "launch.torchrun",
        "--nproc-per-node",
        str(RANKS),
        "--max-restarts",
        str(kills),
        "--config",
        str(config),
        f"run.dir={run_dir}",
        "train.progress=log",
        *_train_args(steps),
        *ckpt,
        *overrides,  # last, so they win
    ]
    t1 = time.monotonic()
    delays: list[float] = []
    try:
        with open(log, "w") as out:
            job = subprocess.Popen(
                cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
            )
        deadline = time.monotonic() + timeout_s
        killed: set[int] = set()
        while len(delays) < kills and job.poll() is None and time.monotonic() < deadline:
            ranks = rank_pids(job.pid)
            if len(ranks) < RANKS or killed & set(ranks.values()):
                time.sleep(0.05)  # waiting for the next attempt's ranks
                continue
            if not _trains(run_dir / "metrics.jsonl", _records(run_dir / "metrics.jsonl"), job, deadline):
                continue
            delay = rng.uniform(*delay_s)
            time.sleep(delay)
            ranks = rank_pids(job.pid)
            if len(ranks) < RANKS:
                continue  # the attempt ended meanwhile (finished, or failed on its own)
            victim = ranks[rng.randrange(RANKS)]
            os.kill(victim, signal.SIGKILL)
            killed.update(ranks.values())
            delays.append(round(delay, 2))
        rc = job.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
            job.wait()
        if broker is not None:
            broker.stop()
    wall_s = time.monotonic() - t1
    if rc != 0:
        raise RuntimeError(f"the soak job failed (exit {rc}) after {len(delays)} kill(s):\n{log.read_text()[-4000:]}")
    restores, retrained = _retrained(run_dir / "metrics.jsonl")
    return SoakResult(
        sink,
        seed,
        steps,
        len(delays),
        restores,
        retrained,
        _identical(_params(run_dir), reference),
        round(wall_s, 1),
        round(reference_wall_s, 1),
        delays,
        list(overrides),
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=CONFIG, help="the job's config (default: configs/debug_cpu.yaml)")
    p.add_argument("--sink", choices=("filesystem", "kafka"), default="filesystem")
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--seed", type=int, default=None, help="draws the kill delays and victims (default: random)")
    p.add_argument("--interval", type=int, default=50, help="checkpoint interval (steps)")
    p.add_argument(
        "--delay",
        type=float,
        nargs=2,
        default=(0.0, 10.0),
        metavar=("MIN", "MAX"),
        help="seconds from an attempt's first training record to the kill (uniform)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for the job and its reference alike (repeatable), e.g. data.workers=1",
    )
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:  # a wrong key or value is refused now, in one line, not by the ranks minutes later
        load_config(args.config, [*_train_args(args.steps), *args.overrides])
    except ConfigError as exc:
        print(f"python -m bench.soak: --set: {exc}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    sets = "".join(f" --set {o}" for o in args.overrides) + (f" --config {args.config}" if args.config != CONFIG else "")
    print(f"soak: sink {args.sink}, {args.steps} steps, {args.kills} kills, seed {seed}{sets} (replay: python -m "
          f"bench.soak --sink {args.sink} --steps {args.steps} --kills {args.kills} --seed {seed}{sets})",
          file=sys.stderr)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="deltarec-soak-") as tmp:
        work = args.keep or Path(tmp)
        result = soak(
            args.sink,
            args.steps,
            args.kills,
            seed,
            args.interval,
            tuple(args.delay),
            work,
            args.timeout_s,
            args.overrides,
            args.config,
        )
    if args.out:
        args.out.write_text(json.dumps(asdict(result), indent=1) + "\n")
    print(
        f"soak: {result.kills} kills survived, {result.restores} restores, {result.steps_retrained} steps "
        f"re-trained, {result.wall_s:.0f} s (uninterrupted run without checkpoints: {result.reference_wall_s:.0f} s); "
        f"{'bit-identical' if result.identical else 'DIFFERENT'} to the uninterrupted run"
    )
    return 0 if result.identical and result.kills == args.kills else 1


if __name__ == "__main__":
    run_main(main)
