"""A rank that restores a checkpoint of an example (examples/) into another world size and plan,
through the public `ckpt.Checkpointer`, and saves what the model then holds, as unsharded
tables keyed by FQN (run by tests/integration/test_examples.py, on one rank).

    python -m tests.multirank.example_restore_worker --example two_tower --ckpt-config RUN/ckpt.yaml --checkpoint K \
        --plan row_wise --run-dir DIR --init-method file://... --out restored.pt
"""

from __future__ import annotations

import argparse
import importlib

import torch
import torch.distributed as dist
from torchrec.optim.optimizers import in_backward_optimizer_filter

from ckpt import Checkpointer, load_ckpt_config
from common.process import run_main
from sharding.shard_views import ShardMap


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--example", required=True, help="a module of examples/: two_tower, sequence_ranking")
    p.add_argument("--ckpt-config", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--plan", default="row_wise")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo", init_method=args.init_method, rank=0, world_size=1)
    torch.manual_seed(123)  # not the training run's seed: every restored value must come from the checkpoint
    example = importlib.import_module(f"examples.{args.example}")
    dmp, dense = example.build(args.plan, 1)
    cfg = load_ckpt_config(args.ckpt_config).override([f"resume={args.checkpoint}"])
    loop = example.Loop()
    ckpt = Checkpointer(cfg, dmp, dense_optimizer=dense, loop=loop, run_dir=args.run_dir)
    report = ckpt.restore()
    assert report is not None and report.checkpoint_id == int(args.checkpoint), report
    shard_map = ShardMap.from_model(dmp)
    tables: dict[str, torch.Tensor] = {}
    for s in shard_map.shards:
        rows, dim = shard_map.table_info[s.table].shape
        full = tables.setdefault(f"{s.table}.weight", torch.full((rows, dim), float("nan")))
        full[s.row_offset : s.row_offset + s.num_rows, s.col_offset : s.col_offset + s.num_cols] = s.weight
        for name, state in s.optimizer_states.items():
            st = tables.setdefault(f"{s.table}.weight/{name}", torch.full((rows, *state.shape[1:]), float("nan")))
            st[s.row_offset : s.row_offset + s.num_rows] = state
    dense_params = {n: q.detach().clone() for n, q in in_backward_optimizer_filter(dmp.named_parameters())}
    torch.save({"step": loop.step, "tables": tables, "dense": dense_params}, args.out)
    ckpt.close(loop.step)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main)
