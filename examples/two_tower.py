"""Two-tower retrieval on TorchRec, checkpointed continuously by deltarec.

A plain TorchRec training loop: a user tower and an item tower, each over its own
EmbeddingBagCollection (both have a table named "id": deltarec tells them apart by module;
the user's history is a weighted feature, pooled with recency weights),
trained with an in-batch softmax loss; the embedding optimizer is fused into the kernels and
Adagrad trains the MLPs. The lines that add deltarec are marked `# deltarec`; `served_model`
is what `deltarec-serve --model examples.two_tower:served_model` serves.

    torchrun --nproc-per-node 2 examples/two_tower.py --run-dir runs/two_tower --steps 300
    # kill it at any point and run the same command again: it resumes where its newest
    # checkpoint left it, bit for bit. Checkpoint settings are the `ckpt` config keys:
    torchrun --nproc-per-node 2 examples/two_tower.py --run-dir runs/two_tower ckpt.schedule.interval_steps=25

Without torchrun, on one process: `python examples/two_tower.py --run-dir runs/two_tower`.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from ckpt import Checkpointer, CkptConfig, load_ckpt_config  # deltarec
from common.process import run_main  # deltarec
from trainer.serve.servable import Servable  # deltarec: serving

USERS, ITEMS, CATEGORIES, DIM = 5_000, 2_000, 50, 16


class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user_tower = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="id", num_embeddings=USERS, embedding_dim=DIM, feature_names=["user_id"]),
                EmbeddingBagConfig(name="history", num_embeddings=ITEMS, embedding_dim=DIM, feature_names=["user_history"]),
            ],
            is_weighted=True,  # the history is pooled with recency weights (weighted features)
            device=torch.device("meta"),
        )
        self.item_tower = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="id", num_embeddings=ITEMS, embedding_dim=DIM, feature_names=["item_id"]),
                EmbeddingBagConfig(name="category", num_embeddings=CATEGORIES, embedding_dim=DIM, feature_names=["item_cat"]),
            ],
            device=torch.device("meta"),
        )
        self.user_mlp = nn.Sequential(nn.Linear(2 * DIM, 32), nn.ReLU(), nn.Linear(32, DIM))
        self.item_mlp = nn.Sequential(nn.Linear(2 * DIM, 32), nn.ReLU(), nn.Linear(32, DIM))

    def towers(self, users: KeyedJaggedTensor, items: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.user_mlp(self.user_tower(users).values()), self.item_mlp(self.item_tower(items).values())

    def forward(self, users: KeyedJaggedTensor, items: KeyedJaggedTensor) -> torch.Tensor:
        u, i = self.towers(users, items)
        logits = u @ i.T  # in-batch softmax: each user's own item is the positive
        return nn.functional.cross_entropy(logits, torch.arange(len(u)))

    def score(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Serving: each sample's (user, item) affinity, the dot product of its two towers.
        `sparse` holds the four features' ids; the history gets its recency weights here."""
        f = sparse.to_dict()
        user, history = f["user_id"], f["user_history"]
        users = KeyedJaggedTensor.from_lengths_sync(
            ["user_id", "user_history"],
            torch.cat([user.values(), history.values()]),
            torch.cat([user.lengths(), history.lengths()]),
            weights=torch.cat([torch.ones(user.values().numel()), recency(history.lengths())]),
        )
        items = KeyedJaggedTensor.from_jt_dict({"item_id": f["item_id"], "item_cat": f["item_cat"]})
        u, i = self.towers(users, items)
        return (u * i).sum(1)


def recency(lengths: torch.Tensor) -> torch.Tensor:
    """The history's weights, newest first: 1, 1/2, 1/4, ... in each bag."""
    return torch.cat([torch.zeros(0), *(0.5 ** torch.arange(int(n), dtype=torch.float32) for n in lengths)])


def served_model() -> Servable:  # deltarec: serving
    """The unsharded model, for `deltarec-serve --model examples.two_tower:served_model`: a
    request's sample is a user (id, history) and an item (id, category), scored by `score`."""
    return Servable(TwoTower(), score=TwoTower.score)


def batch(step: int, rank: int, size: int, seed: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    """This rank's batch of `step`: a function of (seed, step, rank), so the data position is the step."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    user = (torch.rand(size, generator=g) ** 3 * USERS).long()  # a few heavy users
    item = (user * 7 + torch.randint(0, 40, (size,), generator=g)) % ITEMS
    hist_len = torch.randint(1, 6, (size,), generator=g)
    history = (item.repeat_interleave(hist_len) + torch.randint(0, 30, (int(hist_len.sum()),), generator=g)) % ITEMS
    ones = torch.ones(size, dtype=torch.int64)
    users = KeyedJaggedTensor.from_lengths_sync(
        ["user_id", "user_history"],
        torch.cat([user, history]),
        torch.cat([ones, hist_len]),
        weights=torch.cat([ones.float(), recency(hist_len)]),
    )
    items = KeyedJaggedTensor.from_lengths_sync(
        ["item_id", "item_cat"], torch.cat([item, item % CATEGORIES]), torch.cat([ones, ones])
    )
    return users, items


class Loop(Stateful):  # deltarec: the loop's own state (step, data position, RNG) rides with every checkpoint
    def __init__(self) -> None:
        self.step, self.samples_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "samples_seen": self.samples_seen, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.samples_seen = state["step"], state["samples_seen"]
        torch.set_rng_state(state["rng"])


def plan_for(model: TwoTower, kind: str, world: int) -> ShardingPlan:
    """torchrec's planner (`auto`), or every table row_wise / table_wise."""
    if kind == "auto":
        return EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu")).collective_plan(model)

    def gen(i: int):
        return row_wise() if kind == "row_wise" else table_wise(rank=i % world)

    return ShardingPlan(
        {
            name: construct_module_sharding_plan(
                getattr(model, name),
                {t: gen(i) for i, t in enumerate(getattr(model, name).embedding_bags)},
                local_size=world,
                world_size=world,
                device_type="cpu",
            )
            for name in ("user_tower", "item_tower")
        }
    )


#: the embedding optimizers fbgemm's CPU kernels run fused, with their arguments
OPTIMIZERS = {
    "row_wise_adagrad": (RowWiseAdagrad, {"lr": 0.05}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
}


def build(plan: str, world: int, optimizer: str = "row_wise_adagrad") -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    """The sharded model (its embedding optimizer fused into the kernels) and the MLPs' optimizer."""
    model = TwoTower()
    embeddings = [*model.user_tower.parameters(), *model.item_tower.parameters()]
    optimizer_class, optimizer_kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(optimizer_class, embeddings, optimizer_kwargs)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan_for(model, plan, world), env=env)
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, torch.optim.Adagrad(dense, lr=0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan", choices=["auto", "row_wise", "table_wise"], default="auto")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="row_wise_adagrad", help="fused into the embedding kernels")
    p.add_argument("--config", help="a YAML file whose `ckpt:` section configures deltarec")
    p.add_argument("--init-method", default="env://" if "MASTER_ADDR" in os.environ else None)
    p.add_argument("overrides", nargs="*", help="ckpt.<key>=<value> settings")
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    init = args.init_method or f"file://{tempfile.mkdtemp()}/rdzv"  # one process without torchrun
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(args.seed)  # the MLPs start the same on every rank

    dmp, dense_optimizer = build(args.plan, world, args.optimizer)

    # deltarec: its config (a `ckpt:` YAML section, or built in code), then restore and save
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
    ckpt.restore()  # deltarec: the newest checkpoint, if any (ckpt.restore.resume)

    dmp.train()
    for step in range(loop.step + 1, args.steps + 1):
        users, items = batch(step, rank, args.batch_size, args.seed)
        loss = dmp(users, items)
        dense_optimizer.zero_grad()
        loss.backward()  # the fused optimizer updates the embedding rows here
        dense_optimizer.step()
        loop.step, loop.samples_seen = step, loop.samples_seen + args.batch_size * world
        ckpt.save(step)  # deltarec: a checkpoint when one is due
        if rank == 0 and step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    ckpt.close(loop.step)  # deltarec: the last step checkpointed, every write finished
    if rank == 0:
        print(f"two_tower: trained to step {loop.step}; {ckpt.stats.committed} checkpoints committed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    # deltarec: an exit that gloo's threads, alive past the process group, cannot abort
    # (docs/design/environment.md, "A rank's exit")
    run_main(main)
