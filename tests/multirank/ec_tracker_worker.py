"""A rank that checks the tracker and the snapshot on EmbeddingCollection (sequence, unpooled)
modules of every model-parallel sharding type torchrec offers them (table_wise, row_wise,
column_wise: torchrec 1.8's ShardedEmbeddingCollection has no table_row_wise, and its
data_parallel lookup fails on CPU inside torchrec, returning one row per sample to
`construct_jagged_tensors`), one module per type, beside a
weighted EmbeddingBagCollection (run by tests/multirank/test_ec_sharding.py).

It trains a few steps of a small model with fused row-wise Adagrad and prints one line
``RESULT <json>``: per shard, the rows whose weight or optimizer state changed against the
rows the tracker marked; per table, which sharding type the plan gave it; and whether a
snapshot of the marked rows holds exactly the live values.

Usage: python -m tests.multirank.ec_tracker_worker --init-method file://... [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from ckpt.capture.snapshot import SnapshotTaker
from ckpt.capture.tracker import RowTracker
from common.process import run_main
from sharding.shard_views import ShardMap

ROWS, DIM = 97, 8
#: one EmbeddingCollection per sharding type (each module's single table is named "t")
TYPES = {
    "tw": lambda: table_wise(rank=1),
    "rw": row_wise,
    "cw": lambda: column_wise(ranks=[0, 1]),
}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        meta = torch.device("meta")
        self.seq = nn.ModuleDict(
            {
                k: EmbeddingCollection(
                    tables=[EmbeddingConfig(name="t", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f"f_{k}"])],
                    device=meta,
                )
                for k in TYPES
            }
        )
        self.pooled = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t", num_embeddings=ROWS, embedding_dim=DIM, feature_names=["g"])],
            is_weighted=True,
            device=meta,
        )

    def forward(self, seq: dict[str, KeyedJaggedTensor], pooled: KeyedJaggedTensor) -> torch.Tensor:
        loss = self.pooled(pooled).values().pow(2).sum()
        for k, module in self.seq.items():
            loss = loss + module(seq[k])[f"f_{k}"].values().pow(2).sum()
        return loss


def _batch(step: int, rank: int) -> tuple[dict[str, KeyedJaggedTensor], KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    seq = {}
    for k in TYPES:
        lengths = torch.randint(0, 4, (8,), generator=g)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        seq[k] = KeyedJaggedTensor.from_lengths_sync([f"f_{k}"], values, lengths)
    lengths = torch.randint(1, 3, (8,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    pooled = KeyedJaggedTensor.from_lengths_sync(["g"], values, lengths, weights=torch.rand(len(values), generator=g))
    return seq, pooled


def _plan(model: Model, world: int) -> ShardingPlan:
    plans = {
        f"seq.{k}": construct_module_sharding_plan(
            model.seq[k],
            {"t": gen()},
            sharder=EmbeddingCollectionSharder(),
            local_size=world,
            world_size=world,
            device_type="cpu",
        )
        for k, gen in TYPES.items()
    }
    plans["pooled"] = construct_module_sharding_plan(
        model.pooled,
        {"t": row_wise()},
        sharder=EmbeddingBagCollectionSharder(),
        local_size=world,
        world_size=world,
        device_type="cpu",
    )
    return ShardingPlan(plans)


def _state(smap: ShardMap) -> list[torch.Tensor]:
    return [
        torch.cat(
            [s.weight.detach().clone(), *(v.detach().reshape(s.num_rows, -1).clone() for v in s.optimizer_states.values())], 1
        )
        for s in smap.shards
    ]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--init-method", required=True)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=args.init_method, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Model()
    apply_optimizer_in_backward(RowWiseAdagrad, model.parameters(), {"lr": 0.1})
    dmp = DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=_plan(model, world),
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        sharders=[EmbeddingCollectionSharder(), EmbeddingBagCollectionSharder()],  # type: ignore[list-item]
    )
    smap = ShardMap.from_model(dmp)
    tracker = RowTracker(smap)
    before = _state(smap)
    for step in range(args.steps):
        dmp(*_batch(step, rank)).backward()
    shards = []
    for i, (s, old, new) in enumerate(zip(smap.shards, before, _state(smap))):
        changed = (old != new).any(1)
        tracked = tracker.since_last(i)
        shards.append(
            {
                "table": s.table,
                "rows": s.num_rows,
                "changed": int(changed.sum()),
                "changed_not_tracked": int((changed & ~tracked).sum()),
                "tracked_not_changed": int((tracked & ~changed).sum()),
            }
        )
    taker = SnapshotTaker(smap, tracker, torch.device("cpu"))
    snap = taker.take(1, args.steps, full=False, since_base=True)
    exact = all(
        r.weights is not None and torch.equal(r.weights, s.weight[r.global_rows - s.row_offset])
        for r, s in zip(snap.shards, smap.shards)
    )
    exact = exact and sum(r.global_rows.numel() for r in snap.shards) == tracker.count_since_base()
    kinds = {t.key: t.sharding_type for t in smap.table_info.values()}
    result = {"rank": rank, "shards": shards, "replicated": smap.replicated_tables, "types": kinds, "snapshot_exact": exact}
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main)
