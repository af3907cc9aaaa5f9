"""A ranking model over a user's history sequence, checkpointed continuously by deltarec.

A plain TorchRec training loop: the user's recent items are a sequence feature looked up
unpooled in an EmbeddingCollection; the user and the candidate item are pooled features of an
EmbeddingBagCollection (both modules have a table named "item": deltarec tells them apart by
module). The candidate attends over the history; an MLP scores the pair with a click loss.
The embedding optimizer is fused into the kernels and Adagrad trains the rest. The lines
that add deltarec are marked `# deltarec`; `served_model` is what
`deltarec-serve --model examples.sequence_ranking:served_model` serves.

    torchrun --nproc-per-node 2 examples/sequence_ranking.py --run-dir runs/ranking --steps 300
    # kill it at any point and run the same command again: it resumes bit for bit.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from ckpt import Checkpointer, CkptConfig, load_ckpt_config  # deltarec
from common.process import run_main  # deltarec
from trainer.serve.servable import Servable  # deltarec: serving

USERS, ITEMS, DIM, MAX_HISTORY = 3_000, 4_000, 16, 8


class Ranker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.history = EmbeddingCollection(
            tables=[EmbeddingConfig(name="item", num_embeddings=ITEMS, embedding_dim=DIM, feature_names=["history"])],
            device=torch.device("meta"),
        )
        self.context = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="user", num_embeddings=USERS, embedding_dim=DIM, feature_names=["user_id"]),
                EmbeddingBagConfig(name="item", num_embeddings=ITEMS, embedding_dim=DIM, feature_names=["candidate"]),
            ],
            device=torch.device("meta"),
        )
        self.score = nn.Sequential(nn.Linear(3 * DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def logits(self, sequence: KeyedJaggedTensor, context: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.context(context).to_dict()
        user, candidate = pooled["user_id"], pooled["candidate"]
        history = self.history(sequence)["history"].to_padded_dense(desired_length=MAX_HISTORY)  # [B, L, D], zeros pad
        weights = torch.softmax((history @ candidate.unsqueeze(-1)).squeeze(-1), dim=-1)  # attention over the sequence
        attended = (weights.unsqueeze(-1) * history).sum(1)
        return self.score(torch.cat([user, candidate, attended], dim=1)).squeeze(-1)

    def forward(self, sequence: KeyedJaggedTensor, context: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(self.logits(sequence, context), labels)

    def click(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Serving: each sample's click probability; `sparse` holds the history (its first
        MAX_HISTORY ids count), the user and the candidate."""
        f = sparse.to_dict()
        sequence = KeyedJaggedTensor.from_jt_dict({"history": f["history"]})
        context = KeyedJaggedTensor.from_jt_dict({"user_id": f["user_id"], "candidate": f["candidate"]})
        return torch.sigmoid(self.logits(sequence, context))


def served_model() -> Servable:  # deltarec: serving
    """The unsharded model, for `deltarec-serve --model examples.sequence_ranking:served_model`."""
    return Servable(Ranker(), score=Ranker.click)


def batch(step: int, rank: int, size: int, seed: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor, torch.Tensor]:
    """This rank's batch of `step`: a function of (seed, step, rank), so the data position is the step."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    user = (torch.rand(size, generator=g) ** 2 * USERS).long()
    lengths = torch.randint(1, MAX_HISTORY + 1, (size,), generator=g)
    base = (user * 13).repeat_interleave(lengths)
    history = (base + torch.randint(0, 50, (int(lengths.sum()),), generator=g)) % ITEMS
    candidate = (user * 13 + torch.randint(0, 200, (size,), generator=g)) % ITEMS
    labels = ((candidate - user * 13) % ITEMS < 50).float()  # near the user's taste: a click
    ones = torch.ones(size, dtype=torch.int64)
    sequence = KeyedJaggedTensor.from_lengths_sync(["history"], history, lengths)
    context = KeyedJaggedTensor.from_lengths_sync(["user_id", "candidate"], torch.cat([user, candidate]), torch.cat([ones, ones]))
    return sequence, context, labels


class Loop(Stateful):  # deltarec: the loop's own state (step, data position, RNG) rides with every checkpoint
    def __init__(self) -> None:
        self.step, self.samples_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "samples_seen": self.samples_seen, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.samples_seen = state["step"], state["samples_seen"]
        torch.set_rng_state(state["rng"])


def plan_for(model: Ranker, kind: str, world: int) -> ShardingPlan:
    """Every table row_wise, or table_wise spread over the ranks."""

    def gen(i: int):
        return row_wise() if kind == "row_wise" else table_wise(rank=i % world)

    plans = {}
    for i, (name, module, sharder) in enumerate(
        [("history", model.history, EmbeddingCollectionSharder()), ("context", model.context, EmbeddingBagCollectionSharder())]
    ):
        tables = [c.name for c in (module.embedding_configs() if name == "history" else module.embedding_bag_configs())]
        per_table = {t: gen(i + j) for j, t in enumerate(tables)}
        plans[name] = construct_module_sharding_plan(
            module, per_table, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
        )
    return ShardingPlan(plans)


def build(plan: str, world: int) -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    """The sharded model (its embedding optimizer fused into the kernels) and the MLP's optimizer."""
    model = Ranker()
    apply_optimizer_in_backward(RowWiseAdagrad, [*model.history.parameters(), *model.context.parameters()], {"lr": 0.05})
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharders = [EmbeddingCollectionSharder(), EmbeddingBagCollectionSharder()]
    dmp = DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=plan_for(model, plan, world),
        env=env,
        sharders=sharders,  # type: ignore[arg-type]
    )
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
    torch.manual_seed(args.seed)  # the MLP starts the same on every rank
    dmp, dense_optimizer = build(args.plan, world)

    # deltarec: its config (a `ckpt:` YAML section, or built in code), then restore and save
    cfg = (
        load_ckpt_config(args.config)
        if args.config
        else CkptConfig.from_dict(
            {"sink": {"kind": "filesystem"}, "schedule": {"interval_steps": 50}, "restore": {"resume": "latest"}}
        )
    )
    loop = Loop()
    ckpt = Checkpointer(cfg.override(args.overrides), dmp, dense_optimizer=dense_optimizer, loop=loop, run_dir=args.run_dir)
    ckpt.restore()  # deltarec: the newest checkpoint, if any (ckpt.restore.resume)

    dmp.train()
    for step in range(loop.step + 1, args.steps + 1):
        loss = dmp(*batch(step, rank, args.batch_size, args.seed))
        dense_optimizer.zero_grad()
        loss.backward()  # the fused optimizer updates the embedding rows here
        dense_optimizer.step()
        loop.step, loop.samples_seen = step, loop.samples_seen + args.batch_size * world
        ckpt.save(step)  # deltarec: a checkpoint when one is due
        if rank == 0 and step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    ckpt.close(loop.step)  # deltarec: the last step checkpointed, every write finished
    if rank == 0:
        print(f"sequence_ranking: trained to step {loop.step}; {ckpt.stats.committed} checkpoints committed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    # deltarec: an exit that gloo's threads, alive past the process group, cannot abort
    # (docs/design/environment.md, "A rank's exit")
    run_main(main)
