"""`deltarec-train`: the thin entry point. One process per rank.

    deltarec-train --config configs/debug_cpu.yaml [dotted.key=value ...] [--dry-run]

Works under torchrun, under srun without torchrun, and as a lone process (world size 1).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from dataclasses import replace
from typing import Sequence

import torch

from ckpt.dense_store import DenseStoreError
from ckpt.frames import FrameError
from ckpt.manager import CheckpointManager
from ckpt.markers import MarkerError
from ckpt.restore import RestoreError
from ckpt.sink import SourceError
from sharding.dmp import plan_model, shard_model
from sharding.plan import PlanError, format_plan, summarize
from sharding.process_group import DistEnv, destroy_process_group, detect_env, init_process_group, pick_device
from trainer.config import ConfigError, JobConfig, load_config
from trainer.data.criteo import MalformedLineError
from trainer.data.factory import make_reader
from trainer import param_dump
from trainer.metrics import MetricsLog
from trainer.model import build_model
from trainer.trainer import Trainer

logger = logging.getLogger("deltarec")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deltarec-train", description="Train a sharded DLRM.")
    p.add_argument("--config", required=True, help="YAML job config (see configs/)")
    p.add_argument("--dry-run", action="store_true", help="print the sharding plan and exit")
    p.add_argument("--world-size", type=int, default=0, help="with --dry-run: plan for this many ranks")
    p.add_argument("--device", choices=["cpu", "cuda"], help="with --dry-run: plan for this device type")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    return p.parse_args(argv)


def setup_logging(rank: int) -> None:
    """Rank 0 logs deltarec's progress; other ranks, and the libraries, only warnings."""
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,  # an import may already have configured the root logger
    )
    for name in ("deltarec", "trainer", "sharding", "ckpt", "launch"):
        logging.getLogger(name).setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # torchrec's planner warns at length about dry-run estimates; our plan table replaces it.
    logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)


def set_threads(cfg: JobConfig, env: DistEnv) -> None:
    """Keep ranks on one machine from oversubscribing its cores."""
    n = cfg.train.threads_per_rank or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(n)


def dry_run(cfg: JobConfig, env: DistEnv, device_type: str | None) -> int:
    """Plan without launching ranks: no process group, no memory for the tables."""
    device = torch.device(device_type) if device_type else pick_device(env)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, torch.device("meta"))
    plan, _ = plan_model(model, cfg, env, device.type, collective=False)
    print(f"sharding plan for {env.world_size} rank(s) on {device.type}:")
    print(format_plan(summarize(plan, cfg, env.world_size), env.world_size))
    return 0


def train(cfg: JobConfig, env: DistEnv) -> int:
    """Set up the process group, run the job, tear the group down."""
    device = init_process_group(
        env, backend=cfg.sharding.backend, init_method=cfg.sharding.init_method, timeout_s=cfg.sharding.timeout_s
    )
    try:
        run_job(cfg, env, device)
    except BaseException:
        destroy_process_group(clean=False)
        raise
    # The model (DDP reducers, gloo work) must be gone before the group: freed at
    # interpreter exit instead, a joinable gloo thread aborts the process.
    gc.collect()
    destroy_process_group()
    return 0


def run_job(cfg: JobConfig, env: DistEnv, device: torch.device) -> None:
    """Build the sharded model and readers, train, report. Everything it builds is
    released when it returns."""
    set_threads(cfg, env)
    torch.manual_seed(cfg.run.seed)
    sharded = shard_model(build_model(cfg.model, device), cfg, env, device)
    run_dir = cfg.run.run_dir
    if env.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
        print(format_plan(summarize(sharded.plan, cfg, env.world_size), env.world_size), file=sys.stderr)
    metrics = MetricsLog(run_dir / "metrics.jsonl", enabled=env.rank == 0)
    trainer = Trainer(cfg, env, device, sharded, make_reader(cfg, env, "train"), make_reader(cfg, env, "eval"), metrics)
    try:
        manager = CheckpointManager(cfg, env, device, sharded, trainer, metrics) if cfg.ckpt.enabled else None
        if manager is not None:
            trainer.checkpointer = manager
            restored = manager.restore()
            if restored is not None and env.rank == 0:
                print(
                    f"deltarec: resumed from checkpoint {restored.checkpoint_id} at step {restored.step} "
                    f"(chain {restored.chain}: {restored.rows} rows, {restored.bytes / 1e6:.2f} MB read "
                    f"in {restored.seconds:.2f} s)",
                    flush=True,
                )
        result = trainer.fit()
        if manager is not None:
            manager.finish(trainer.step)
            if env.rank == 0:
                print(checkpoint_summary(manager), flush=True)
    finally:
        metrics.close()
    if cfg.train.save_params:
        param_dump.dump(sharded.model, sharded.optimizer, run_dir / "params" / f"rank{env.rank}.pt")
    if env.rank == 0:
        final = f"eval AUC {result.auc:.4f}, log loss {result.logloss:.4f}" if result else "no evaluation"
        print(f"deltarec: trained {trainer.step} steps; {final}; metrics in {metrics.path}", flush=True)


def checkpoint_summary(manager: "CheckpointManager") -> str:
    """One line: how many checkpoints committed, their bytes and stall."""
    st = manager.stats
    done = [o for o in st.outcomes if o.committed]
    stalls = [max(o.stall_ms) for o in done if o.stall_ms]
    line = f"deltarec: checkpoints {st.committed} committed, {st.failed} failed, {st.skipped} skipped"
    if done:
        line += (
            f"; {sum(o.bytes for o in done) / 1e6:.2f} MB written; stall per checkpoint "
            f"mean {sum(stalls) / len(stalls):.1f} ms, max {max(stalls):.1f} ms"
        )
    return line


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    env = detect_env()
    if args.dry_run and args.world_size:
        env = replace(env, world_size=args.world_size, local_world_size=args.world_size)
    setup_logging(env.rank)
    try:
        cfg = load_config(args.config, args.overrides, check_data=not args.dry_run)
        return dry_run(cfg, env, args.device) if args.dry_run else train(cfg, env)
    except (ConfigError, PlanError, MalformedLineError, RestoreError, FrameError, SourceError, DenseStoreError, MarkerError) as exc:
        print(f"deltarec-train: error: {exc}", file=sys.stderr)
        return 2


def cli() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
