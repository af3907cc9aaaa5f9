"""A ranking model trained through TorchRec's `TrainPipelineSparseDist`, checkpointed by deltarec.

The pipeline keeps two batches beyond the one it trains: while step i runs, batch i+1's
input all-to-all and batch i+2's copy are under way. A checkpoint after step i is still exact
because of two things, the only ones a pipelined loop must get right:

1. The loop's position is the last *trained* step, never the batches the pipeline read ahead:
   the data iterator is a function of the step, rebuilt from `loop.step + 1` after `restore()`,
   so the batches in flight at a crash are read again.
2. `restore()` runs before the pipeline takes its first batch, and `save(step)` right after
   `progress()` returns: deltarec marks rows in the embedding lookup of the step that trains
   them, never in the input distribution of a batch in flight (docs/design/invariants.md, invariant 6).

The lines that add deltarec are marked `# deltarec`.

    torchrun --nproc-per-node 2 examples/pipelined_ranking.py --run-dir runs/pipelined --steps 300
    # kill it at any point and run the same command again: it resumes bit for bit
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from ckpt import Checkpointer, CkptConfig, load_ckpt_config  # deltarec
from common.process import run_main  # deltarec

TABLES = {"user": 4_000, "item": 1_500, "category": 40}  # rows; each read by the feature of its name
DENSE, DIM = 8, 16


class Ranker(nn.Module):
    """Pooled user, item and category embeddings beside an MLP over dense features; forward
    takes torchrec's `Batch` and returns (loss, output), as the pipeline expects: it runs
    backward on the loss and hands the output back from `progress`."""

    def __init__(self) -> None:
        super().__init__()
        tables = [EmbeddingBagConfig(name=t, num_embeddings=n, embedding_dim=DIM, feature_names=[t]) for t, n in TABLES.items()]
        self.sparse = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.dense = nn.Sequential(nn.Linear(DENSE, DIM), nn.ReLU())
        self.over = nn.Sequential(nn.Linear(DIM * (1 + len(TABLES)), 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        pooled = self.sparse(batch.sparse_features).values()
        logits = self.over(torch.cat([self.dense(batch.dense_features), pooled], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach())


def batch(step: int, rank: int, size: int, seed: int) -> Batch:
    """This rank's batch of `step`: a function of (seed, step, rank), so the data position is the step."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    user = (torch.rand(size, generator=g) ** 3 * TABLES["user"]).long()  # a few heavy users
    item = (user * 7 + torch.randint(0, 50, (size,), generator=g)) % TABLES["item"]
    ones = torch.ones(size, dtype=torch.int64)
    sparse = KeyedJaggedTensor.from_lengths_sync(
        list(TABLES), torch.cat([user, item, item % TABLES["category"]]), torch.cat([ones, ones, ones])
    )
    dense = torch.randn(size, DENSE, generator=g)
    labels = ((user + item) % 3 == 0).float()
    return Batch(dense_features=dense, sparse_features=sparse, labels=labels)


def batches_from(step: int, rank: int, size: int, seed: int) -> Iterator[Batch]:
    """The batches of `step` and every later step: after a restore, from the step after the
    last trained one (what the pipeline had read ahead is read again)."""
    return (batch(s, rank, size, seed) for s in itertools.count(step))


class Loop(Stateful):  # deltarec: the loop's state; its data position follows `step`
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def build(plan: str, world: int) -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    """The sharded model (row-wise Adagrad fused into its kernels) and the MLPs' optimizer."""
    model = Ranker()
    apply_optimizer_in_backward(RowWiseAdagrad, list(model.sparse.parameters()), {"lr": 0.05})
    per_table = {t: row_wise() if plan == "row_wise" else table_wise(rank=i % world) for i, t in enumerate(TABLES)}
    module_plan = construct_module_sharding_plan(model.sparse, per_table, local_size=world, world_size=world, device_type="cpu")
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=ShardingPlan({"sparse": module_plan}), env=env)
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, torch.optim.Adagrad(dense, lr=0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan", choices=["row_wise", "table_wise"], default="row_wise")
    p.add_argument("--config", help="a YAML file whose `ckpt:` section configures deltarec")
    p.add_argument("--init-method", default="env://" if "MASTER_ADDR" in os.environ else None)
    p.add_argument("overrides", nargs="*", help="ckpt.<key>=<value> settings")
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    init = args.init_method or f"file://{tempfile.mkdtemp()}/rdzv"  # one process without torchrun
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(args.seed)  # the MLPs start the same on every rank

    dmp, dense_optimizer = build(args.plan, world)
    cfg = (
        load_ckpt_config(args.config)
        if args.config
        else CkptConfig.from_dict(
            {"sink": {"kind": "filesystem"}, "schedule": {"interval_steps": 50}, "restore": {"resume": "latest"}}
        )
    )
    cfg = cfg.override(args.overrides)
    loop = Loop()
    ckpt = Checkpointer(cfg, dmp, dense_optimizer=dense_optimizer, loop=loop, run_dir=args.run_dir)  # deltarec
    ckpt.restore()  # deltarec: before the pipeline takes its first batch

    dmp.train()
    pipeline = TrainPipelineSparseDist(dmp, dense_optimizer, torch.device("cpu"))
    batches = batches_from(loop.step + 1, rank, args.batch_size, args.seed)  # from the last trained step on
    for step in range(loop.step + 1, args.steps + 1):
        loss, _logits = pipeline.progress(batches)  # forward, backward, both optimizers; two batches in flight
        loop.step = step
        ckpt.save(step)  # deltarec: right after the step, before the next progress()
        if rank == 0 and step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    ckpt.close(loop.step)  # deltarec: the last step checkpointed, every write finished
    if rank == 0:
        print(f"pipelined_ranking: trained to step {loop.step}; {ckpt.stats.committed} checkpoints committed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    # deltarec: an exit that gloo's threads, alive past the process group, cannot abort
    # (docs/design/environment.md, "A rank's exit")
    run_main(main)
