"""A rank that checks the shard views against the live sharded model (run by test_shard_views).

1. Coverage: the shards of every model-parallel table, gathered from all ranks, tile
   the table exactly once.
2. Weights alias: each rank writes a tag into local row 0 of each of its shards through
   the view; a collective lookup of those rows returns the tags.
3. Optimizer state aliases: a huge row-wise Adagrad sum written through the view freezes
   that row in the next step, while an untouched row moves.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch

from common.process import run_main
from sharding.dmp import shard_model
from sharding.process_group import destroy_process_group, detect_env, init_process_group
from sharding.shard_views import ShardMap
from trainer.config import load_config
from trainer.main import parse_args
from trainer.model import build_model


def main() -> int:
    args = parse_args(sys.argv[1:])
    cfg = load_config(args.config, args.overrides)
    env = detect_env()
    device = init_process_group(env, init_method=cfg.sharding.init_method)
    torch.manual_seed(0)
    sharded = shard_model(build_model(cfg.model, device), cfg.model.tables, cfg.sharding, cfg.optimizer, env, device)
    smap = ShardMap.from_model(sharded.model)
    key_of = {info.name: key for key, info in smap.table_info.items()}  # config name -> table key
    tables = {key_of[t.name]: t for t in cfg.model.tables}

    meta = [(s.table, s.row_offset, s.col_offset, s.num_rows, s.num_cols, env.rank) for s in smap.shards]
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, meta)
    all_shards = sorted(m for part in gathered for m in part)
    replicated = set(smap.replicated_tables)
    for name, t in tables.items():
        if name in replicated:
            continue
        cover = torch.zeros(t.num_embeddings, t.embedding_dim, dtype=torch.int32)
        for table, r0, c0, nr, nc, _ in all_shards:
            if table == name:
                cover[r0 : r0 + nr, c0 : c0 + nc] += 1
        assert bool((cover == 1).all()), f"table {name}: shards do not tile it exactly once"

    tag = {m[:3]: float(i + 1) for i, m in enumerate(all_shards)}
    with torch.no_grad():
        for s in smap.shards:
            s.weight[0].fill_(tag[(s.table, s.row_offset, s.col_offset)])

    features, rows_per_feature = [], []
    for t in cfg.model.tables:
        rows = sorted({r0 for table, r0, *_ in all_shards if table == key_of[t.name]}) or [0]
        for f in t.features:
            features.append((f, key_of[t.name]))
            rows_per_feature.append(rows)
    batch = max(len(r) for r in rows_per_feature)
    padded = [r + [r[-1]] * (batch - len(r)) for r in rows_per_feature]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f for f, _ in features],
        values=torch.tensor([row for rows in padded for row in rows]),
        lengths=torch.ones(batch * len(features), dtype=torch.int32),
    )
    ebc = sharded.model.module.model.sparse_arch.embedding_bag_collection
    pooled = ebc(kjt).wait().to_dict()
    for (f, table), rows in zip(features, padded):
        if table in replicated:
            continue
        for b, row in enumerate(rows):
            expected = torch.zeros(tables[table].embedding_dim)
            for t_name, r0, c0, _, nc, _ in all_shards:
                if t_name == table and r0 == row:
                    expected[c0 : c0 + nc] = tag[(t_name, r0, c0)]
            assert torch.equal(pooled[f][b], expected), f"{f} row {row}: lookup {pooled[f][b]} != tags {expected}"

    # Optimizer state: freeze local row 0 of every shard through the view, leave row 1 alone.
    with torch.no_grad():
        for s in smap.shards:
            for state in s.optimizer_states.values():
                state[0] = 1e30
    before = {(s.table, s.row_offset, s.col_offset): s.weight[:2].clone() for s in smap.shards}
    both = [sorted({r for r0 in rows for r in (r0, r0 + 1)}) for rows in rows_per_feature]
    n = max(len(r) for r in both)
    both = [r + [r[-1]] * (n - len(r)) for r in both]
    step_kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f for f, _ in features],
        values=torch.tensor([row for rows in both for row in rows]),
        lengths=torch.ones(n * len(features), dtype=torch.int32),
    )
    step_batch = Batch(
        dense_features=torch.randn(n, cfg.model.dense_in_features),
        sparse_features=step_kjt,
        labels=torch.ones(n),
    )
    loss, _ = sharded.model(step_batch)
    sharded.optimizer.zero_grad()
    loss.backward()
    sharded.optimizer.step()
    for s in smap.shards:
        if not s.optimizer_states:
            continue
        old = before[(s.table, s.row_offset, s.col_offset)]
        assert torch.equal(s.weight[0], old[0]), f"{s.table}: frozen row moved: state view is not live"
        assert not torch.equal(s.weight[1], old[1]), f"{s.table}: trained row did not move"
    print(f"rank {env.rank}: {len(smap.shards)} shard views verified")
    destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main)
