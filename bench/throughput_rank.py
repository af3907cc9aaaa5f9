"""One rank of `--suite throughput`'s in-process jobs (spawned by `bench.train_throughput`).

    python -m bench.throughput_rank --config C --mode peer|profile --steps N --warmup W --out F [overrides]

- `peer`: TorchRec's own loop on the job's model, data and ranks, as TorchRec's DLRM example
  (torchrec/examples/dlrm) runs it: `TrainPipelineSparseDist.progress` over a
  `torch.utils.data.DataLoader` whose workers read the job's reader (`data.workers` of them,
  `data.prefetch_batches` each, pinned memory on CUDA). No checkpoints, no positions kept.
- `profile`: deltarec's own loop (`Trainer.train_step`, `train.pipeline` as configured) with
  its checkpointer when `ckpt.enabled`, `Checkpointer.save` after every step, under
  `torch.profiler`: milliseconds per step in each labelled stage (TorchRec's pipeline labels,
  deltarec's plain loop uses the same names; `## deltarec checkpoint ##` is the save call),
  the stages no other encloses apart from those inside one (`## deltarec tracker ##` and
  TorchRec's awaitables run inside `## forward ##`). The profiler slows every step; compare
  the stages with each other, and samples/s with the training jobs'.

Rank 0 writes the result (JSON) to `--out`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.process import run_main

STAGE = re.compile(r"^## (.+?)(?: \d+)? ##$")  # "## forward 12 ##" -> "forward"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.throughput_rank", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--mode", choices=["peer", "profile"], required=True)
    p.add_argument("--steps", type=int, required=True, help="timed steps")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--out", type=Path, required=True)
    return p


class _Batches(torch.utils.data.IterableDataset):
    """A reader as the IterableDataset TorchRec's example loops read: batches, nothing else."""

    def __init__(self, reader: Any) -> None:
        super().__init__()
        self.reader = reader

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self.reader.next_batch()


def peer(job: Any, cfg: Any, steps: int, warmup: int) -> dict[str, Any]:
    """TorchRec's pipelined loop: samples/s over `steps` steps after `warmup`."""
    from torch.utils.data import DataLoader
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from bench.job import timed

    d = cfg.data
    if d.workers > 1:
        raise SystemExit("the peer reads one stream per rank: run it with data.workers <= 1")
    loader = DataLoader(
        _Batches(job.trainer.train_reader),
        batch_size=None,
        num_workers=d.workers,
        prefetch_factor=d.prefetch_batches if d.workers else None,
        pin_memory=job.device.type == "cuda",
    )
    pipeline = TrainPipelineSparseDist(job.sharded.model, job.sharded.optimizer, job.device)
    it = iter(loader)
    job.sharded.model.train()
    for _ in range(warmup):
        pipeline.progress(it)

    def run() -> None:
        for _ in range(steps):
            pipeline.progress(it)

    seconds, _ = timed(run, job.device)
    samples = steps * d.batch_size * job.env.world_size
    pipeline.detach()
    return {"mode": "peer", "steps": steps, "seconds": seconds, "samples_per_s": samples / seconds}


def profile(job: Any, cfg: Any, steps: int, warmup: int) -> dict[str, Any]:
    """deltarec's loop (and checkpointer) under torch.profiler: ms per step by stage."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from bench.job import sync
    from trainer.main import make_checkpointer

    trainer = job.trainer
    ckpt = make_checkpointer(cfg, job.env, job.device, job.sharded, trainer, job.metrics) if cfg.ckpt.enabled else None
    if ckpt is not None:
        trainer.checkpointer = ckpt
        ckpt.restore()

    def step() -> None:
        trainer.train_step()
        if ckpt is not None:
            ckpt.save(trainer.step)

    for _ in range(warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if job.device.type == "cuda" else [])
    sync(job.device)
    dist.barrier()
    t0 = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(job.device)
    wall = time.perf_counter() - t0
    top, inside = stage_times(prof.events(), steps)
    if ckpt is not None:
        ckpt.close(trainer.step)
    trainer.close()
    return {
        "mode": "profile",
        "pipeline": cfg.train.pipeline,
        "checkpoints": cfg.ckpt.enabled,
        "steps": steps,
        "step_ms": wall * 1e3 / steps,
        "stage_ms": top,
        "other_ms": wall * 1e3 / steps - sum(top.values()),
        "inside_ms": inside,
    }


def stage_times(events: Any, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """ms per step of each labelled stage: (the stages no other labelled stage encloses, the
    ones inside another: `## deltarec tracker ##` and TorchRec's awaitables inside `## forward ##`)."""
    top: dict[str, float] = {}
    inside: dict[str, float] = {}
    for e in events:
        m = STAGE.match(e.name)
        if not m:
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None and not nested:
            nested = STAGE.match(parent.name) is not None
            parent = parent.cpu_parent
        into = inside if nested else top
        into[m.group(1)] = into.get(m.group(1), 0.0) + e.cpu_time_total / 1e3 / steps

    def ordered(d: dict[str, float]) -> dict[str, float]:
        return dict(sorted(d.items(), key=lambda kv: -kv[1]))

    return ordered(top), ordered(inside)


def main(argv: list[str] | None = None) -> int:
    from bench.job import start_job, stop_job
    from trainer.config import load_config

    args, overrides = parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(args.config, ["train.eval_batches=0", *overrides])
    job = start_job(cfg, cfg.run.run_dir / "metrics.jsonl")
    run = peer if args.mode == "peer" else profile
    result = run(job, cfg, args.steps, args.warmup)
    if job.env.rank == 0:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    job.metrics.close()
    del job
    stop_job()
    return 0


if __name__ == "__main__":
    run_main(main)
