"""A rank that checks the tracker and the loop's position under TorchRec's pipeline (run by
test_pipeline).

It trains through the real `Trainer.train_step` with `train.pipeline=sparse_dist`, which
reads two batches ahead (batch i+1's input all-to-all runs before step i ends). The synthetic
stream is random access, so the rank rebuilds every rank's batches itself: global batch g of
step k on rank r is `batch_at(k * world + r)`. After `--steps` steps it reports, per local
shard: the rows the trained batches name, the rows only the batches in flight name, what the
tracker marked since the start and the rows that changed; then one step more, and the same.
Also the loop's saved reader position and the batches in flight. One line ``RESULT <json>``.

Usage: python -m tests.multirank.pipeline_worker --config CFG [--steps N] [key=value ...]
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from ckpt.capture.tracker import RowTracker
from common.process import run_main
from sharding.dmp import shard_model
from sharding.process_group import destroy_process_group, detect_env, init_process_group
from sharding.shard_views import ShardMap
from tests.multirank.tracker_worker import _changed, _state
from trainer.config import load_config
from trainer.data.factory import make_reader
from trainer.metrics import MetricsLog
from trainer.model import build_model
from trainer.trainer import Trainer


def _rows_of(reader, smap: ShardMap, cfg, global_batches: range) -> list[torch.Tensor]:
    """Per local shard, bool [num_rows]: rows some rank's batch in `global_batches` looks up."""
    feats_of = {t.name: t.features for t in cfg.model.tables}
    out = []
    for s in smap.shards:
        rows = torch.zeros(s.num_rows, dtype=torch.bool)
        for g in global_batches:
            d = reader.batch_at(g).sparse_features.to_dict()
            for f in feats_of[smap.table_info[s.table].name]:
                _, local = s.local_rows(d[f].values())
                rows[local] = True
        out.append(rows)
    return out


def _report(trainer: Trainer, smap: ShardMap, tracker: RowTracker, cfg, before, steps: int) -> dict:
    world = trainer.env.world_size
    reader = trainer.train_reader
    in_flight = trainer._batches.in_flight if trainer._batches is not None else 0
    trained = _rows_of(reader, smap, cfg, range(0, steps * world))
    ahead = _rows_of(reader, smap, cfg, range(steps * world, (steps + in_flight) * world))
    changed = _changed(before, smap)
    shards = []
    for i, s in enumerate(smap.shards):
        tracked = tracker.since_last(i)
        only_ahead = ahead[i] & ~trained[i]
        shards.append(
            {
                "table": smap.table_info[s.table].name,
                "trained": int(trained[i].sum()),
                "tracked": int(tracked.sum()),
                "changed": int(changed[i].sum()),
                "tracked_not_trained": int((tracked & ~trained[i]).sum()),
                "trained_not_tracked": int((trained[i] & ~tracked).sum()),
                "only_in_flight": int(only_ahead.sum()),
                "only_in_flight_tracked": int((only_ahead & tracked).sum()),
                "only_in_flight_changed": int((only_ahead & changed[i]).sum()),
            }
        )
    return {"step": trainer.step, "in_flight": in_flight, "reader": trainer.state_dict()["reader"], "shards": shards}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(args.config, ["train.pipeline=sparse_dist", *args.overrides])
    env = detect_env()
    device = init_process_group(env, init_method=cfg.sharding.init_method)
    torch.set_num_threads(1)
    torch.manual_seed(cfg.run.seed)
    sharded = shard_model(build_model(cfg.model, device), cfg.model.tables, cfg.sharding, cfg.optimizer, env, device)
    smap = ShardMap.from_model(sharded.model)
    tracker = RowTracker(smap)
    metrics = MetricsLog(Path(cfg.run.run_dir) / "metrics.jsonl", enabled=False)
    trainer = Trainer(cfg, env, device, sharded, make_reader(cfg, env, "train"), None, metrics)
    tracker.mark_base()
    before = _state(smap)
    for _ in range(args.steps):
        trainer.train_step()
    first = _report(trainer, smap, tracker, cfg, before, args.steps)
    trainer.train_step()
    second = _report(trainer, smap, tracker, cfg, before, args.steps + 1)
    print("RESULT " + json.dumps({"rank": env.rank, "after": [first, second]}), flush=True)
    trainer.close()
    del trainer, tracker, smap, sharded
    gc.collect()
    destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main)
