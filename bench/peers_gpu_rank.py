"""The one process of suite `gpu-peers` (bench/peers_gpu.py): every job of the comparison on the
one model it builds, at world size 1 (on CUDA when there is a GPU).

    python -m bench.peers_gpu_rank --config C --out-dir DIR --checkpoints N (--interval K | --interval-s S) \
        --jobs POLICY/ENCODING,... --bootstrap HOST:PORT [--peers dcp.save,dcp.async_save] [key=value ...]

Each job starts from the model as built (`bench.job.Pristine`) with a new training loop
(`bench.job.fresh_loop`), all through `Trainer.fit` so every figure is taken the same way:

1. a short probe of the step time, which sets the interval from `--interval-s` unless
   `--interval` is given;
2. the job without checkpoints (the throughput baseline);
3. each deltarec job of `--jobs` (`bench.ckpt_rank.train`: the trainer's checkpointer to
   the broker at `--bootstrap`);
4. each peer of `--peers` (`bench.peers_rank.PeerCheckpointer` as the loop's checkpointer);
5. the restores, `--repeats` rounds with the order rotating: `dcp.load`, and deltarec's restore
   of each job's newest checkpoint into the model as built (its fp32 jobs' checked to give
   back the state the job ended with).

Each finished phase is appended to `--events` as a JSON line, so a run cut off keeps what
finished; the whole result goes to ``<out-dir>/one_process.json``. Why one process rather than
a process per job: a process spends its start (imports, CUDA, the process group) and the
model's initialisation (every row generated on the host) before its first step, and a GPU
session's device time is short.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import harmonic_of, median_of
from bench.job import Pristine, fingerprint, fresh_loop, perturb, start_job, stop_job, sync, timed
from bench.peers_rank import LOADS, WARMUP_STEPS, DcpPeers, PeerCheckpointer, deltarec_restore, max_over_ranks
from common.process import run_main

PROBE_STEPS = 20
Restore = Callable[[], "tuple[float, dict[str, Any], bool | None]"]  # seconds, what it restored, same state?


class Events:
    """The run's progress: each event a JSON line appended to `path` as it happens (rank 0; a
    run cut off keeps every line written) and a timestamped line on stderr."""

    def __init__(self, path: Path | None, rank: int, size: str) -> None:
        self.path, self.rank, self.size = path, rank, size

    def __call__(self, event: str, msg: str, **fields: Any) -> None:
        if self.rank != 0:
            return
        print(f"bench: {time.strftime('%H:%M:%S')} [{self.size}] {msg}", file=sys.stderr, flush=True)
        if self.path is not None:
            rec = {"event": event, "size": self.size, "unix": round(time.time(), 3), "msg": msg, **fields}
            with self.path.open("a") as f:
                f.write(json.dumps(rec, default=str) + "\n")


def _rate(run_dir: Path) -> float | None:
    """Samples/s of a run: its `log_every` windows after the first (start-up, first checkpoint)."""
    from launch.ranks import read_metrics

    rates = [m["samples_per_s"] for m in read_metrics(run_dir) if "samples_per_s" in m]
    return harmonic_of(rates[1:] or rates)


@dataclass(frozen=True)
class Phase:
    """One training job of the run: no checkpoints, a deltarec policy and encoding, or a peer."""

    kind: str  # "none", "deltarec", or a peer's name
    policy: str | None = None
    encoding: str | None = None

    @property
    def label(self) -> str:
        return f"{self.policy}-{self.encoding}" if self.kind == "deltarec" else self.kind


class OneProcessRun:
    """The jobs of one size on one built model, in order (module docstring)."""

    def __init__(self, args: argparse.Namespace, overrides: list[str]) -> None:
        from sharding.shard_views import ShardMap
        from trainer.config import load_config

        self.args = args
        self.started = time.perf_counter()
        self.base = [*overrides, "train.eval_every=0", "train.eval_batches=0"]
        self.job0 = start_job(load_config(args.config, [*self.base, "ckpt.enabled=false"]))
        self.env, self.device, self.sharded = self.job0.env, self.job0.device, self.job0.sharded
        self.events = Events(args.events, self.env.rank, args.size)
        self.smap = ShardMap.from_model(self.sharded.model)
        self.pristine = Pristine(self.sharded, self.smap)
        rows = sum(v.num_rows for v in self.smap.shards)
        self.events(
            "built",
            f"job built on {self.device} ({self.env.world_size} rank(s)) in "
            f"{time.perf_counter() - self.started:.1f} s: {rows:,} rows, "
            f"{self.pristine.nbytes / 1e9:.2f} GB of rows and optimizer state",
            device=str(self.device),
            rows=rows,
            state_bytes=self.pristine.nbytes,
        )
        self.out: dict[str, Any] = {
            "rank": self.env.rank,
            "world_size": self.env.world_size,
            "device": str(self.device),
            "model_rows": rows,
            "state_bytes": self.pristine.nbytes,
            "none": None,
            "jobs": {},
            "phases": [],
            "restore": {},
            "errors": {},
        }
        peer_names = [p for p in args.peers.split(",") if p]
        self.phases = (
            [Phase("none")]
            + [Phase("deltarec", *j.split("/")) for j in args.jobs.split(",") if j]
            + [Phase(p) for p in peer_names]
        )
        self.peers = (
            DcpPeers(self.sharded, self.env.rank, args.peers_dir or args.out_dir / "peers-ckpt", self.device, args.stager)
            if peer_names
            else None
        )
        self.final_fp: dict[str, list[float]] = {}  # deltarec job -> the model's fingerprint when it ended
        self.references: dict[str, tuple[int, list[float] | None]] = {}  # load -> (checkpoint, fingerprint at it)
        self.interval = self.steps = 0

    # -- 1. the probe -----------------------------------------------------------------------------
    def probe(self) -> None:
        """Time the step; the interval follows from it unless given."""
        trainer = self.job0.trainer
        for _ in range(self.args.warmup):
            trainer.train_step()
        sync(self.device)
        t = time.perf_counter()
        for _ in range(PROBE_STEPS):
            trainer.train_step()
        sync(self.device)
        step_s = max_over_ranks((time.perf_counter() - t) / PROBE_STEPS)
        self.interval = self.args.interval or max(2, round(self.args.interval_s / step_s))
        self.steps = self.interval * self.args.checkpoints
        train_s = len(self.phases) * self.steps * step_s
        self.out.update(interval=self.interval, steps=self.steps, step_s=step_s)
        self.events(
            "probe",
            f"{step_s * 1e3:.1f} ms/step; interval {self.interval} steps (~{self.interval * step_s:.1f} s), "
            f"{self.args.checkpoints} checkpoints per job: {len(self.phases)} phases of {self.steps} "
            f"steps, ~{train_s:.0f} s of training, then the peers' saves and {self.args.repeats} "
            f"round(s) of restores",
            step_s=step_s,
            interval=self.interval,
            steps=self.steps,
            training_s_estimate=train_s,
        )

    # -- 2-4. the jobs ----------------------------------------------------------------------------
    def train_all(self) -> None:
        """Every phase from the model as built; one that fails is reported and the others run."""
        for phase in self.phases:
            self.pristine.reset()
            gc.collect()
            try:
                if phase.kind == "none":
                    self._baseline(phase)
                elif phase.kind == "deltarec":
                    self._deltarec(phase)
                else:
                    self._peer(phase)
            except Exception as exc:  # noqa: BLE001 - reported, and the other phases still run
                traceback.print_exc()
                self.out["errors"][phase.label] = f"{type(exc).__name__}: {exc}"
                self.events("error", f"{phase.label} failed: {type(exc).__name__}: {exc}", phase=phase.label)
            finally:
                gc.collect()
        if self.out["none"] is not None:  # the peers' baseline is the same job without checkpoints
            self.out["phases"].insert(
                0, {"peer": "none", "steps": self.steps, "samples_per_s": self.out["none"]["samples_per_s"], "checkpoints": []}
            )

    def _loop(self, label: str, extra: list[str]) -> tuple[Any, Any, Path]:
        """A fresh training loop on the built model: (job, its config, its run directory)."""
        from trainer.config import load_config
        from trainer.metrics import MetricsLog

        run_dir = self.args.out_dir / label / "run"
        cfg = load_config(
            self.args.config,
            [*self.base, f"run.dir={run_dir}", f"train.steps={self.steps}", f"train.log_every={self.interval}", *extra],
        )
        log = MetricsLog(run_dir / "metrics.jsonl", enabled=self.env.rank == 0)
        return fresh_loop(self.job0, cfg, log), cfg, run_dir

    def _broker_cpu(self) -> float | None:
        from bench.cpu import process_cpu_s

        return process_cpu_s(self.args.broker_pid) if self.args.broker_pid else None

    def _trained(self, phase: Phase, extra: list[str]) -> dict[str, Any]:
        """Train one job through `bench.ckpt_rank.train`: its run record."""
        from bench.ckpt_rank import BareCopier, read_cpu, train

        t0 = time.perf_counter()
        job, cfg, run_dir = self._loop(phase.label, extra)
        side = self.args.out_dir / phase.label / "side"
        cpu0 = self._broker_cpu()
        train(job, cfg, side, BareCopier(), self.args.bare_repeats)
        cpu1 = self._broker_cpu()
        return {
            "run_id": f"{self.args.run_prefix}-{phase.label}",
            "run_dir": str(run_dir),
            "bootstrap": self.args.bootstrap,
            "steps": self.steps,
            "wall_s": time.perf_counter() - t0,
            "samples_per_s": _rate(run_dir),
            "broker_cpu_s": cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None,
            "cpu": [asdict(read_cpu(side / f"cpu_rank{r}.json")) for r in range(self.env.world_size)]
            if self.env.rank == 0
            else [],
        }

    def _baseline(self, phase: Phase) -> None:
        run = self._trained(phase, ["ckpt.enabled=false"])
        self.out["none"] = run
        self.events(
            "phase",
            f"no checkpoints: {run['samples_per_s'] or 0:,.0f} samples/s ({run['wall_s']:.1f} s)",
            phase=phase.label,
            result=run,
        )

    def _deltarec(self, phase: Phase) -> None:
        from bench.ckpt_rank import checkpoint_rows, read_sides
        from bench.peers import capacity
        from launch.ranks import read_metrics

        a = self.args
        run_id = f"{a.run_prefix}-{phase.label}"
        run = self._trained(
            phase,
            [
                "ckpt.enabled=true",
                f"ckpt.sink.bootstrap_servers={a.bootstrap}",
                f"ckpt.run_id={run_id}",
                f"ckpt.schedule.policy={phase.policy}",
                f"ckpt.schedule.interval_steps={self.interval}",
                f"ckpt.encoding.weights={phase.encoding}",
                "ckpt.schedule.final=false",
            ],
        )
        rank0 = self.env.rank == 0
        metrics = read_metrics(Path(run["run_dir"])) if rank0 else []
        side = a.out_dir / phase.label / "side"
        run["skipped"] = sum(1 for m in metrics if m.get("ckpt_skipped"))
        run["checkpoints"] = checkpoint_rows(metrics, read_sides(side, self.env.world_size)) if rank0 else []
        run["capacity"] = capacity(
            a.config, [*self.base, f"ckpt.encoding.weights={phase.encoding}"], a.bootstrap, run_id, self.env.world_size
        )
        run["policy"], run["encoding"] = phase.policy, phase.encoding
        self.final_fp[phase.label] = fingerprint(self.smap, self.sharded)
        self.out["jobs"][phase.label] = run
        cks = run["checkpoints"]
        self.events(
            "phase",
            f"deltarec {phase.policy}/{phase.encoding}: "
            f"{sum(bool(c['committed']) for c in cks)}/{len(cks)} committed, "
            f"stall ms {[round(c['stall_ms'], 1) for c in cks]}, durable s "
            f"{[round(c['durable_s'] or 0, 2) for c in cks]}, MB {[round(c['bytes'] / 1e6, 1) for c in cks]}, "
            f"{run['samples_per_s'] or 0:,.0f} samples/s ({run['wall_s']:.1f} s)",
            phase=phase.label,
            result={k: v for k, v in run.items() if k != "cpu"},
        )

    def _peer(self, phase: Phase) -> None:
        assert self.peers is not None
        t0 = time.perf_counter()
        job, _, run_dir = self._loop(phase.label.replace(".", "_"), ["ckpt.enabled=false"])
        pc = PeerCheckpointer(self.peers, phase.kind, self.interval, self.args.checkpoints, self.smap)
        job.trainer.checkpointer = pc
        try:
            job.trainer.fit()
        finally:
            job.trainer.checkpointer = None
            job.metrics.close()
        ckpts = pc.finish(job.trainer.step)
        if phase.kind != "dcp.async_save":
            self.references[LOADS[phase.kind]] = (pc.last, pc.reference)
        ph = {
            "peer": phase.kind,
            "steps": self.steps,
            "wall_s": time.perf_counter() - t0,
            "samples_per_s": _rate(run_dir),
            "checkpoints": ckpts,
        }
        self.out["phases"].append(ph)
        self.events(
            "phase",
            f"{phase.kind}: stall ms {[round(c['stall_ms'], 1) for c in ckpts]}, durable s "
            f"{[round(c['durable_s'], 2) for c in ckpts]}, MB {[round(c['bytes'] / 1e6, 1) for c in ckpts]}, "
            f"{ph['samples_per_s'] or 0:,.0f} samples/s ({ph['wall_s']:.1f} s)",
            phase=phase.label,
            result=ph,
        )

    # -- 5. the restores --------------------------------------------------------------------------
    def _load(self, load: str, n: int, reference: list[float] | None) -> tuple[float, dict[str, Any], bool | None]:
        """A peer's load of its newest checkpoint into a perturbed model."""
        assert self.peers is not None
        peers = self.peers
        perturb(self.smap, self.sharded)
        t, _ = timed(lambda: peers.load(load, n), self.device)
        return t, {"checkpoint": n}, fingerprint(self.smap, self.sharded) == reference

    def _restore(self, label: str, run: dict[str, Any]) -> tuple[float, dict[str, Any], bool | None]:
        """deltarec's restore of a job's newest checkpoint into the model as built (what a
        restarted job restores into)."""
        from trainer.config import load_config
        from trainer.metrics import MetricsLog

        self.pristine.reset()
        cfg = load_config(self.args.config, [*self.base, "ckpt.enabled=false"])
        loop = fresh_loop(self.job0, cfg, MetricsLog(Path("unused"), enabled=False)).trainer
        t, info = deltarec_restore(
            self.args.config,
            [
                *self.base,
                f"ckpt.run_id={run['run_id']}",
                f"run.dir={run['run_dir']}",
                f"ckpt.encoding.weights={run['encoding']}",
                f"ckpt.sink.bootstrap_servers={run['bootstrap']}",
            ],
            self.env,
            self.device,
            self.sharded,
            loop,
        )
        # fp32 rows give back the state the job ended with (its last checkpoint is at its last step)
        exact = run["encoding"] == "fp32" and info["step"] == self.steps
        return t, info, fingerprint(self.smap, self.sharded) == self.final_fp[label] if exact else None

    def restores(self) -> None:
        kinds: list[tuple[str, Restore]] = [
            (load, lambda load=load, n=n, ref=ref: self._load(load, n, ref)) for load, (n, ref) in self.references.items()
        ]
        kinds += [
            (f"deltarec:{label}", lambda label=label, run=run: self._restore(label, run))
            for label, run in self.out["jobs"].items()
            if any(c["committed"] for c in run["checkpoints"])
        ]
        restore: dict[str, dict[str, Any]] = {k: {"restore_s": [], "same_state": []} for k, _ in kinds}
        for r in range(self.args.repeats):
            shift = r % max(1, len(kinds))
            for name, fn in kinds[shift:] + kinds[:shift]:
                try:
                    t, info, same = fn()
                except Exception as exc:  # noqa: BLE001 - reported with the figures
                    traceback.print_exc()
                    self.out["errors"][f"restore {name}"] = f"{type(exc).__name__}: {exc}"
                    self.events("error", f"restore {name} failed: {type(exc).__name__}: {exc}", phase=f"restore {name}")
                    continue
                rs = restore[name]
                rs["restore_s"].append(t)
                if same is not None:
                    rs["same_state"].append(same)
                if "parts" in info:
                    rs["checkpoint"] = info
                    rs.setdefault("parts", []).append(info["parts"])
        self.out["restore"] = restore
        self.events(
            "restore",
            f"restore s (median of {self.args.repeats}): "
            + ", ".join(
                f"{k} {median_of(v['restore_s']) or float('nan'):.3f}" + ("" if all(v["same_state"]) else " (NOT the same state)")
                for k, v in restore.items()
            ),
            result=restore,
        )

    def write(self) -> None:
        if self.env.rank == 0:
            self.args.out_dir.mkdir(parents=True, exist_ok=True)
            (self.args.out_dir / "one_process.json").write_text(json.dumps(self.out, indent=1) + "\n")
        self.events("done", f"one process: {time.perf_counter() - self.started:.0f} s", wall_s=time.perf_counter() - self.started)

    def close(self) -> None:
        """Release the model and the peers before the process group goes."""
        if self.peers is not None:
            self.peers.close()
        self.peers = None
        self.references.clear()
        del self.job0, self.sharded, self.smap, self.pristine
        gc.collect()
        stop_job()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.peers_gpu_rank", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--interval", type=int, default=0, help="checkpoint interval in steps (0: from --interval-s)")
    p.add_argument("--interval-s", type=float, default=3.0, help="the interval's target seconds")
    p.add_argument("--checkpoints", type=int, default=3, help="checkpoints per job")
    p.add_argument("--repeats", type=int, default=2, help="rounds of restores")
    p.add_argument("--stager", choices=("clone", "pinned"), default="pinned", help="dcp.async_save's stager")
    p.add_argument("--jobs", default="", help="deltarec jobs, POLICY/ENCODING,...")
    p.add_argument("--peers", default="dcp.save,dcp.async_save", help="peers, comma-separated")
    p.add_argument("--bootstrap", default="", help="the broker deltarec's jobs checkpoint to")
    p.add_argument("--broker-pid", type=int, default=0, help="the broker's pid (its CPU per job)")
    p.add_argument("--run-prefix", default="bench", help="run ids are PREFIX-POLICY-ENCODING")
    p.add_argument("--events", type=Path, help="append progress events here (JSON lines)")
    p.add_argument("--size", default="", help="the size's name, in the events")
    p.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="steps before the probe")
    p.add_argument("--bare-repeats", type=int, default=1, help="bare copies per checkpoint")
    p.add_argument("--peers-dir", type=Path, help="where the peers checkpoint (default: under --out-dir)")
    return p


def main(argv: list[str] | None = None) -> int:
    args, overrides = parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    run = OneProcessRun(args, overrides)
    try:
        run.probe()
        run.train_all()
        run.restores()
        run.write()
    finally:
        run.close()
    return 0


if __name__ == "__main__":
    run_main(main)
