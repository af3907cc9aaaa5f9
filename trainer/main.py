"""`deltarec-train`: the thin entry point. One process per rank.

    deltarec-train --config configs/debug_cpu.yaml [dotted.key=value ...] [--dry-run] [--verbose]

Works under torchrun, under srun without torchrun, and as a lone process (world size 1).
Rank 0 prints deltarec's lines (trainer/console.py); `--verbose` shows the libraries' too.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from ckpt.checkpointer import Checkpointer
from ckpt.log.backend import Backend, open_for_restore
from ckpt.restore.restorer import RestoreReport
from ckpt.types import JobIdentity
from common.errors import DeltarecError
from common.process import run_main
from sharding.dmp import ShardedModel, plan_model, shard_model
from sharding.plan import format_plan, summarize
from sharding.process_group import DistEnv, destroy_process_group, detect_env, init_process_group, pick_device
from sharding.row_init import RowInit
from trainer import console, param_dump
from trainer.allocator import keep_freed_memory
from trainer.config import JobConfig, load_config
from trainer.data.factory import make_reader
from trainer.metrics import MetricsLog
from trainer.model import build_model
from trainer.stop import SigtermStopsLoop, keeps_work, save_survivor
from trainer.trainer import StopRequested, Trainer


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deltarec-train", description="Train a sharded DLRM.")
    p.add_argument("--config", required=True, help="YAML job config (see configs/)")
    p.add_argument("--dry-run", action="store_true", help="print the sharding plan and exit")
    p.add_argument("--world-size", type=int, default=0, help="with --dry-run: plan for this many ranks")
    p.add_argument("--device", choices=["cpu", "cuda"], help="with --dry-run: plan for this device type")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="every rank's log lines and every library warning (by default known noise is filtered)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    return p.parse_intermixed_args(argv)  # overrides before, between or after the options


def setup_logging(rank: int, verbose: bool = False) -> None:
    """Rank 0 logs deltarec's progress; other ranks, and the libraries, only warnings; the
    libraries' known noise is filtered unless `verbose` (see trainer/console.py)."""
    console.setup_rank(rank, verbose)


def set_threads(cfg: JobConfig, env: DistEnv) -> None:
    """Keep ranks on one machine from oversubscribing its cores."""
    n = cfg.train.threads_per_rank or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(n)


def dry_run(cfg: JobConfig, env: DistEnv, device_type: str | None) -> int:
    """Plan without launching ranks: no process group, no memory for the tables."""
    device = torch.device(device_type) if device_type else pick_device(env)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, torch.device("meta"))
    plan, _ = plan_model(model, cfg.model.tables, cfg.sharding, cfg.optimizer, env, device.type, collective=False)
    print(f"sharding plan for {env.world_size} rank(s) on {device.type}:")
    print(format_plan(summarize(plan, cfg.model.tables, cfg.optimizer, env.world_size), env.world_size))
    return 0


def train(cfg: JobConfig, env: DistEnv) -> int:
    """Set up the process group, run the job, tear the group down."""
    device = init_process_group(
        env, backend=cfg.sharding.backend, init_method=cfg.sharding.init_method, timeout_s=cfg.sharding.timeout_s
    )
    # The model (DDP reducers, their gloo work) goes before the group is torn down; the
    # group's threads outlive it all the same, which is why the process leaves through
    # common.process.leave (docs/design/environment.md, "A rank's exit").
    try:
        run_job(cfg, env, device)
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # run_job's frame held the model
        gc.collect()
        destroy_process_group(clean=False)
        raise
    gc.collect()
    destroy_process_group()
    return 0


def build_job(
    cfg: JobConfig, env: DistEnv, device: torch.device, metrics: MetricsLog, evaluate: bool = True
) -> tuple[ShardedModel, Trainer]:
    """This rank's sharded model and training loop, built from the config (threads, the C
    allocator's settings, seed, plan, readers; `evaluate`: give the loop its eval reader). Benchmarks build their rank
    jobs with it too, so they measure exactly what the trainer runs."""
    set_threads(cfg, env)
    if cfg.train.keep_freed_memory:
        keep_freed_memory()
    torch.manual_seed(cfg.run.seed)
    sharded = shard_model(
        build_model(cfg.model, device), cfg.model.tables, cfg.sharding, cfg.optimizer, env, device, row_init=RowInit(cfg.run.seed)
    )
    train_reader = make_reader(cfg, env, "train")
    assert train_reader is not None, "every job has training data"
    eval_reader = make_reader(cfg, env, "eval") if evaluate else None
    return sharded, Trainer(cfg, env, device, sharded, train_reader, eval_reader, metrics)


def run_job(cfg: JobConfig, env: DistEnv, device: torch.device) -> None:
    """Build the sharded model and readers, train, report. Everything it builds is
    released when it returns."""
    run_dir = cfg.run.run_dir
    metrics = MetricsLog(
        run_dir / "metrics.jsonl",
        enabled=env.rank == 0,
        tensorboard_dir=run_dir / "tensorboard" if cfg.train.tensorboard else None,
    )
    # the checkpoint readers connect while the model is built: a restore finds them connected
    backend = (
        open_for_restore(cfg.ckpt.run_id, cfg.ckpt.sink, cfg.ckpt.restore, env.world_size, env.rank) if cfg.ckpt.enabled else None
    )
    try:
        sharded, trainer = build_job(cfg, env, device, metrics)
    except BaseException:
        if backend is not None:
            backend.close()
        raise
    if env.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.run_file_yaml())
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":  # torchrun's restarts have the same plan
            plan = format_plan(summarize(sharded.plan, cfg.model.tables, cfg.optimizer, env.world_size), env.world_size)
            console.say(f"sharding plan for {env.world_size} rank(s) on {device.type}:\n{plan}", err=True)
            console.say(loop_line(cfg), err=True)
    restored = None
    manager = None
    stopper = SigtermStopsLoop(trainer) if cfg.ckpt.enabled and cfg.ckpt.recovery.mode == "partial" else None
    try:
        manager = make_checkpointer(cfg, env, device, sharded, trainer, metrics, backend) if backend is not None else None
        if manager is not None:
            trainer.checkpointer = manager
            restored = manager.restore()
            if restored is not None and env.rank == 0:
                console.say(
                    f"deltarec: resumed from checkpoint {restored.checkpoint_id} at step {restored.step} "
                    f"(chain {restored.chain}: {restored.rows:,} rows, {restored.bytes / 1e6:.2f} MB read "
                    f"in {restored.seconds:.2f} s, {restored.mb_per_s:.0f} MB/s; {restored.parts()})"
                )
                if restored.partial is not None:
                    console.say(partial_line(restored))
        result = trainer.fit()
        if manager is not None:
            manager.close(trainer.step)
            if env.rank == 0:
                console.say(checkpoint_summary(manager, resumed=restored is not None))
    except BaseException as exc:
        if stopper is not None and manager is not None and keeps_work(exc):
            save_survivor(manager, trainer, env.rank)
        raise
    finally:
        metrics.close()
        if manager is None and backend is not None:  # the checkpointer that would own it was not built
            backend.close()
        if stopper is not None:
            stopper.release()
    if cfg.train.save_params and sharded.optimizer is not None:
        param_dump.dump(sharded.model, sharded.optimizer, run_dir / "params" / f"rank{env.rank}.pt")
    if env.rank == 0:
        final = f"eval AUC {result.auc:.4f}, log loss {result.logloss:.4f}" if result else "no evaluation"
        console.say(f"deltarec: trained {trainer.step} steps; {final}; metrics in {metrics.path}")


def loop_line(cfg: JobConfig) -> str:
    """One line: how steps run and how the data is read (trainer/step.py, trainer/data/loader.py)."""
    loop = "TorchRec's TrainPipelineSparseDist" if cfg.train.pipeline == "sparse_dist" else "plain (one batch at a time)"
    w = cfg.data.workers
    reading = f"{w} loader worker{'s' if w > 1 else ''} per rank" if w else "read in the training process"
    return f"deltarec: loop: {loop}; {cfg.data.kind} data, {reading}"


def make_checkpointer(
    cfg: JobConfig,
    env: DistEnv,
    device: torch.device,
    sharded: ShardedModel,
    trainer: Trainer,
    metrics: MetricsLog,
    backend: Backend | None = None,
) -> Checkpointer:
    """This rank's checkpointer, through the public API a user's own loop uses (ckpt/checkpointer.py),
    given only what it reads of the job (`backend`: one `open_for_restore` opened earlier, else
    it opens its own)."""
    return Checkpointer(
        cfg.ckpt,
        sharded.model,
        dense_optimizer=sharded.dense_optimizer,
        loop=trainer,
        metrics=metrics,
        row_init=sharded.row_init,
        identity=JobIdentity(cfg.digest(), cfg.model_digest()),
        backend=backend,
        env=env,
    )


def partial_line(restored: RestoreReport) -> str:
    """The resume line's sequel after a partial recovery: what was kept and what was lost."""
    p = restored.partial
    assert p is not None
    return (
        f"deltarec: partial recovery: {p.describe()}; {p.lost_samples:,.0f} of the {p.samples_since:,} samples "
        f"since the checkpoint lost their updates there (run PLS {restored.run_pls:.2e})"
    )


def checkpoint_summary(manager: Checkpointer, resumed: bool = False) -> str:
    """One line: how many checkpoints this process committed, their bytes and stall. A
    `resumed` job counts from its restore (deltarec-report counts every attempt's)."""
    st = manager.stats
    since = " since resuming" if resumed else ""
    line = f"deltarec: checkpoints{since}: {st.committed} committed, {st.failed} failed, {st.skipped} skipped"
    if st.coalesced:
        line += f", {st.coalesced} coalesced into the next"
    if st.committed:
        line += f" ({st.full} full, {st.committed - st.full} delta); {st.bytes / 1e6:.2f} MB written"
    if st.stalled:
        line += f"; stall per checkpoint mean {st.stall_ms_sum / st.stalled:.1f} ms, max {st.stall_ms_max:.1f} ms"
    risk = st.at_risk
    if risk.run_steps:
        line += (
            f"; a crash after a step would have lost {risk.run_sum / risk.run_steps:.1f} steps on average, at most {risk.run_max}"
        )
    return line


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Run the job; a user error (any `DeltarecError`) is one line on stderr and exit code 2.
    Another rank dying is one line (its traceback too with --verbose) and, unless torchrun's
    agent stops this rank first, `console.EXIT_PEER_LOST`; a collective timing out on a rank
    that does not answer is one line naming the collective and `console.EXIT_STALLED`; Ctrl-C is one line on rank 0 and
    130. `record` writes any other failure to torchrun's error file, so torchrun names it."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    env = detect_env()
    if args.dry_run and args.world_size:
        env = replace(env, world_size=args.world_size, local_world_size=args.world_size)
    setup_logging(env.rank, args.verbose)
    cfg: JobConfig | None = None
    try:
        cfg = load_config(args.config, args.overrides, check_data=not args.dry_run)
        return dry_run(cfg, env, args.device) if args.dry_run else train(cfg, env)
    except DeltarecError as exc:
        print(f"deltarec-train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if env.rank == 0:
            console.say("deltarec-train: interrupted", err=True)
        return 130
    except StopRequested:  # a SIGTERM under partial recovery that `release` did not turn into one
        console.say(f"deltarec-train: rank {env.rank} stopped (SIGTERM)", err=True)
        return 128 + 15
    except RuntimeError as exc:
        stalled = console.is_stalled_collective(exc)
        if env.world_size < 2 or not (stalled or console.is_peer_lost(exc)):
            raise
        if args.verbose:
            traceback.print_exc()
        timeout_s = cfg.sharding.timeout_s if cfg is not None else None
        console.say(
            console.stalled_line(env.rank, exc, timeout_s) if stalled else console.peer_lost_line(env.rank, exc), err=True
        )
        if not stalled:  # a silent rank has not exited, so no agent knows of a failure: exit now
            console.wait_for_agent()
        # Not stopped by an agent: this exit is the failure to report. `record` only writes
        # exceptions that escape; written earlier, its timestamp would name this rank first.
        get_error_handler().record_exception(exc)
        return console.EXIT_STALLED if stalled else console.EXIT_PEER_LOST


def cli() -> None:
    """Console-script entry point."""
    run_main(main)


if __name__ == "__main__":
    cli()
