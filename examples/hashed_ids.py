"""Click prediction with a hashed user id over 2^40 ids, checkpointed continuously by deltarec.

A plain TorchRec training loop: the user id is a raw id of a huge space (2^40: ids are never
dense), mapped into 4,096 slots by TorchRec's managed-collision module (ZCH:
`ManagedCollisionEmbeddingBagCollection` with `MCHManagedCollisionModule`), which admits new
users and evicts cold ones every 20 steps; the item id is an ordinary table beside it. The
embedding optimizer (SGD) is fused into the kernels and Adagrad trains the MLP. deltarec's
checkpoints carry each slot's rows and the id-to-slot mapping's changes (admissions, evictions)
beside them; a restore on another number of ranks moves each id to the rank that now owns it.
The lines that add deltarec are marked `# deltarec`.

    torchrun --nproc-per-node 2 examples/hashed_ids.py --run-dir runs/hashed_ids --steps 300
    # kill it at any point and run the same command again: it resumes where its newest
    # checkpoint left it, bit for bit (the loop's RNG rides along: an eviction draws the new
    # users' rows from it). Checkpoint settings are the `ckpt` config keys:
    torchrun --nproc-per-node 2 examples/hashed_ids.py --run-dir runs/hashed_ids ckpt.schedule.interval_steps=25

Without torchrun, on one process: `python examples/hashed_ids.py --run-dir runs/hashed_ids`.
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
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from ckpt import Checkpointer, CkptConfig, load_ckpt_config  # deltarec
from common.process import run_main  # deltarec
from trainer.serve.servable import Servable  # deltarec: serving

USER_SPACE, USER_SLOTS, ITEMS, DIM = 2**40, 4_096, 2_000, 16
EVICTION_INTERVAL = 20  # training steps between evictions


class HashedRanker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        meta = torch.device("meta")
        user = EmbeddingBagConfig(name="user", num_embeddings=USER_SLOTS, embedding_dim=DIM, feature_names=["user_id"])
        self.users = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=[user], device=meta),
            ManagedCollisionCollection(
                {
                    "user": MCHManagedCollisionModule(
                        zch_size=USER_SLOTS,
                        device=meta,
                        eviction_policy=DistanceLFU_EvictionPolicy(),
                        eviction_interval=EVICTION_INTERVAL,
                        input_hash_size=USER_SPACE,
                    )
                },
                [user],
            ),
        )
        self.items = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="item", num_embeddings=ITEMS, embedding_dim=DIM, feature_names=["item_id"])],
            device=meta,
        )
        self.mlp = nn.Sequential(nn.Linear(2 * DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def logits(self, users: KeyedJaggedTensor, items: KeyedJaggedTensor) -> torch.Tensor:
        pooled_users, _ = self.users(users)  # (pooled embeddings, the remapped ids: not needed here)
        x = torch.cat([pooled_users.values(), self.items(items).values()], dim=1)
        return self.mlp(x).squeeze(1)

    def forward(self, users: KeyedJaggedTensor, items: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(self.logits(users, items), labels)

    def score(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Serving: each sample's click probability. `sparse` holds its raw user id (the server
        maps it to its slot as training did at the checkpoint served) and its item id."""
        f = sparse.to_dict()
        users = KeyedJaggedTensor.from_jt_dict({"user_id": f["user_id"]})
        items = KeyedJaggedTensor.from_jt_dict({"item_id": f["item_id"]})
        return torch.sigmoid(self.logits(users, items))


def served_model() -> Servable:  # deltarec: serving
    """The unsharded model, for `deltarec-serve --config <run-dir>/ckpt.yaml --model
    examples.hashed_ids:served_model`: a request's sample is a raw user id (below 2^40) and an
    item id, scored by `score`."""
    return Servable(HashedRanker(), score=HashedRanker.score)


def batch(step: int, rank: int, size: int, seed: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor, torch.Tensor]:
    """This rank's batch of `step`, a function of (seed, step, rank): users drawn from a
    population that drifts (every 50 steps a fifth of it is new), so ids come and go."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    population = torch.arange(8_000) + (step // 50) * 1_600  # drifting: old users leave, new ones arrive
    user = population[(torch.rand(size, generator=g) ** 2 * len(population)).long()]  # a few heavy users
    raw = (user * 0x9E3779B97F4A7C15) % USER_SPACE  # spread over the whole 2^40 space
    item = (user * 7 + torch.randint(0, 40, (size,), generator=g)) % ITEMS
    labels = ((user + item) % 3 == 0).float()
    ones = torch.ones(size, dtype=torch.int64)
    users = KeyedJaggedTensor.from_lengths_sync(["user_id"], raw, ones)
    items = KeyedJaggedTensor.from_lengths_sync(["item_id"], item, ones)
    return users, items, labels


class Loop(Stateful):  # deltarec: the loop's own state (step, RNG) rides with every checkpoint
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "rng": torch.get_rng_state()}  # an eviction draws new users' rows from it

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        torch.set_rng_state(state["rng"])


def build(world: int) -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    """The sharded model (row-wise: the only sharding of a managed-collision table; its
    embedding optimizer, SGD, fused into the kernels) and the MLP's optimizer."""
    model = HashedRanker()
    apply_optimizer_in_backward(torch.optim.SGD, [*model.users.parameters(), *model.items.parameters()], {"lr": 0.1})
    mc_sharder = ManagedCollisionEmbeddingBagCollectionSharder()
    plan = ShardingPlan(
        {
            "users": construct_module_sharding_plan(
                model.users, {"user": row_wise()}, sharder=mc_sharder, local_size=world, world_size=world, device_type="cpu"
            ),
            "items": construct_module_sharding_plan(
                model.items, {"item": row_wise()}, local_size=world, world_size=world, device_type="cpu"
            ),
        }
    )
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharders = [mc_sharder, EmbeddingBagCollectionSharder()]
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, env=env, sharders=sharders)  # type: ignore[arg-type]
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, torch.optim.Adagrad(dense, lr=0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", help="a YAML file whose `ckpt:` section configures deltarec")
    p.add_argument("--init-method", default="env://" if "MASTER_ADDR" in os.environ else None)
    p.add_argument("overrides", nargs="*", help="ckpt.<key>=<value> settings")
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    init = args.init_method or f"file://{tempfile.mkdtemp()}/rdzv"  # one process without torchrun
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(args.seed)  # the MLP starts the same on every rank

    dmp, dense_optimizer = build(world)

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
    ckpt.restore()  # deltarec: the newest checkpoint, if any (ckpt.restore.resume), on any number of ranks

    dmp.train()
    for step in range(loop.step + 1, args.steps + 1):
        loss = dmp(*batch(step, rank, args.batch_size, args.seed))
        dense_optimizer.zero_grad()
        loss.backward()  # the fused optimizer updates the embedding rows here
        dense_optimizer.step()
        loop.step = step
        ckpt.save(step)  # deltarec: a checkpoint when one is due
        if rank == 0 and step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    ckpt.close(loop.step)  # deltarec: the last step checkpointed, every write finished
    if rank == 0:
        print(f"hashed_ids: trained to step {loop.step}; {ckpt.stats.committed} checkpoints committed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    # deltarec: an exit that gloo's threads, alive past the process group, cannot abort
    # (docs/design/environment.md, "A rank's exit")
    run_main(main)
