"""One rank of a conformance loop (tests/conformance/test_user_loops.py): a TorchRec training
loop written the way users write them, run with deltarec (`ckpt.Checkpointer`) or without it
(no Checkpointer constructed at all), dumping what the model, both optimizers and the loop
then hold.

    python -m tests.conformance.worker --loop readme|rich --steps N --init-method file://... \
        --workdir DIR --dump-final PREFIX [--plain] [--dump-restored PREFIX] [--step-sleep S]

Loops:

- `readme`: README.md's "Use it in your own training loop" snippet, read from README.md at
  run time and run as it is, its placeholder line `...  # your forward, ...` replaced by this
  worker's training step; the loop's state is only `step`. The snippet's `run_dir` is
  relative: the worker runs it from `--workdir`.
- `rich`: several EmbeddingBagCollections and EmbeddingCollections at several depths of the
  module tree, a weighted EBC, a feature-processed EBC (position weights), row-wise,
  table-wise, column-wise, table-row-wise and data-parallel tables of several widths, an
  fp16 table, a table read by two features; dense optimizers under torchrec's
  `CombinedOptimizer` of two `KeyedOptimizerWrapper`s (Adagrad, SGD with momentum), a
  `StepLR` schedule and a dropout whose RNG rides in the loop state (which has no `reader`).
  Its plan is a function of the world size, so the same loop runs on 1, 2 or 3 ranks.

Every rank writes `<PREFIX>_rank<r>.pt` (`dump`): its local shards of every table and fused
optimizer state (`dmp.state_dict()`, `dmp.fused_optimizer.state_dict()`: torchrec's own view,
not deltarec's), dense parameters, the dense optimizer's state and the loop's state.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.stateful import Stateful
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from common.process import run_main
from launch.ranks import REPO

META = torch.device("meta")
BATCH = 64
README = REPO / "README.md"
SNIPPET_HEADING = "## Use it in your own training loop"


# --- the README loop ------------------------------------------------------------------------------


def readme_snippet(readme: Path = README) -> str:
    """The first ```python block after the README's heading of the library section, as written."""
    text = readme.read_text()
    start = text.index(SNIPPET_HEADING)
    match = re.search(r"^```python\n(.*?)^```", text[start:], re.S | re.M)
    assert match, f"{readme}: no ```python block after {SNIPPET_HEADING!r}"
    return match.group(1)


def with_training_step(snippet: str, call: str) -> str:
    """`snippet` with its placeholder line (`    ...  # your forward, ...`) replaced by `call`,
    indented as the placeholder was; nothing else changes."""
    lines = snippet.splitlines(keepends=True)
    holders = [i for i, line in enumerate(lines) if re.fullmatch(r"\s+\.\.\.(\s+#.*)?\n?", line)]
    assert len(holders) == 1, f"README snippet: expected one `...` placeholder line, found {len(holders)}"
    (i,) = holders
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = f"{indent}{call}\n"
    return "".join(lines)


class StepOnly(Stateful):
    """The smallest loop state the README allows: the step, nothing else (the batches are a
    function of the step, so the step is the data position)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


class Small(nn.Module):
    """The README loop's model: one EBC (row-wise and table-wise tables) and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="user", num_embeddings=800, embedding_dim=8, feature_names=["user"]),
                EmbeddingBagConfig(name="item", num_embeddings=600, embedding_dim=8, feature_names=["item"]),
            ],
            device=META,
        )
        self.mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, kjt: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.mlp(self.ebc(kjt).values()).squeeze(-1)
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def small_batch(step: int, rank: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1_009 + rank)
    user = (torch.rand(BATCH, generator=g) ** 2 * 800).long()
    item = (user * 3 + torch.randint(0, 30, (BATCH,), generator=g)) % 600
    ones = torch.ones(BATCH, dtype=torch.int64)
    labels = ((item - user * 3) % 600 < 10).float()
    return KeyedJaggedTensor.from_lengths_sync(["user", "item"], torch.cat([user, item]), torch.cat([ones, ones])), labels


def build_small(world: int) -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    model = Small()
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.05})
    plan = construct_module_sharding_plan(
        model.ebc, {"user": row_wise(), "item": table_wise(rank=world - 1)}, local_size=world, world_size=world, device_type="cpu"
    )
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=ShardingPlan({"ebc": plan}), env=env)
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, torch.optim.Adagrad(dense, lr=0.05)


# --- the rich loop --------------------------------------------------------------------------------

MAX_CLICKS, MAX_SEQ = 4, 6


class UserTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(  # towers.user.ebc
            tables=[
                EmbeddingBagConfig(name="id", num_embeddings=1000, embedding_dim=16, feature_names=["user_id"]),
                EmbeddingBagConfig(name="geo", num_embeddings=64, embedding_dim=8, feature_names=["user_geo"]),
            ],
            device=META,
        )


class Sequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(  # towers.item.seq.ec: a nested EmbeddingCollection
            tables=[
                EmbeddingConfig(name="item", num_embeddings=2000, embedding_dim=16, feature_names=["item_seq"]),
                EmbeddingConfig(name="query", num_embeddings=300, embedding_dim=16, feature_names=["query"]),
            ],
            device=META,
        )


class ItemTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = Sequence()


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = UserTower()
        self.item = ItemTower()


#: the rich model's input width: user id 16 + geo 8 + item sequence 16 + query 16 + tags 8 + clicks 8
#: + ctx 4 + cat (two features) 2x8 + fp16 8
RICH_WIDTH = 16 + 8 + 16 + 16 + 8 + 8 + 4 + 16 + 8


class Rich(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.towers = Towers()
        self.tags = EmbeddingBagCollection(  # a weighted EBC
            tables=[EmbeddingBagConfig(name="tag", num_embeddings=500, embedding_dim=8, feature_names=["tags"])],
            is_weighted=True,
            device=META,
        )
        clicked = EmbeddingBagConfig(name="clicked", num_embeddings=700, embedding_dim=8, feature_names=["clicks"])
        self.clicks = FeatureProcessedEmbeddingBagCollection(  # position-weighted clicks
            EmbeddingBagCollection(tables=[clicked], is_weighted=True, device=META),
            PositionWeightedModuleCollection({"clicks": MAX_CLICKS}, device=META),
        )
        self.ctx = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="ctx", num_embeddings=50, embedding_dim=4, feature_names=["ctx"]),
                EmbeddingBagConfig(name="cat", num_embeddings=40, embedding_dim=8, feature_names=["cat_a", "cat_b"]),
                EmbeddingBagConfig(
                    name="f16", num_embeddings=200, embedding_dim=8, feature_names=["f16"], data_type=DataType.FP16
                ),
            ],
            device=META,
        )
        self.mlp = nn.Sequential(nn.Linear(RICH_WIDTH, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))

    def forward(self, sparse: KeyedJaggedTensor, weighted: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
        user = self.towers.user.ebc(sparse).to_dict()
        seq = self.towers.item.seq.ec(sparse)
        items = seq["item_seq"].to_padded_dense(desired_length=MAX_SEQ).mean(1)
        query = seq["query"].to_padded_dense(desired_length=1).squeeze(1)
        tags = self.tags(weighted).to_dict()["tags"]
        clicks = self.clicks(sparse).to_dict()["clicks"]
        ctx = self.ctx(sparse).to_dict()
        parts = [user["user_id"], user["user_geo"], items, query, tags, clicks, ctx["ctx"], ctx["cat_a"], ctx["cat_b"]]
        x = torch.cat([*parts, ctx["f16"].float()], dim=1)
        return nn.functional.binary_cross_entropy_with_logits(self.mlp(x).squeeze(-1), labels)


SPARSE = ["user_id", "user_geo", "item_seq", "query", "clicks", "ctx", "cat_a", "cat_b", "f16"]
SIZES = {
    "user_id": 1000,
    "user_geo": 64,
    "item_seq": 2000,
    "query": 300,
    "clicks": 700,
    "ctx": 50,
    "cat_a": 40,
    "cat_b": 40,
    "f16": 200,
}


def rich_batch(step: int, rank: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor, torch.Tensor]:
    """This rank's batch of `step`: a function of (step, rank) only."""
    g = torch.Generator().manual_seed(step * 7_919 + rank * 31 + 5)
    values, lengths = [], []
    user = (torch.rand(BATCH, generator=g) ** 2 * SIZES["user_id"]).long()
    for f in SPARSE:
        if f in ("item_seq", "clicks"):
            n = torch.randint(0, (MAX_SEQ if f == "item_seq" else MAX_CLICKS) + 1, (BATCH,), generator=g)
        else:
            n = torch.ones(BATCH, dtype=torch.int64)
        ids = (user.repeat_interleave(n) * 13 + torch.randint(0, 40, (int(n.sum()),), generator=g)) % SIZES[f]
        values.append(ids)
        lengths.append(n)
    sparse = KeyedJaggedTensor.from_lengths_sync(SPARSE, torch.cat(values), torch.cat(lengths))
    n = torch.randint(1, 4, (BATCH,), generator=g)
    tags = torch.randint(0, 500, (int(n.sum()),), generator=g)
    weighted = KeyedJaggedTensor.from_lengths_sync(["tags"], tags, n, weights=torch.rand(int(n.sum()), generator=g))
    labels = ((user % 7) < 2).float()
    return sparse, weighted, labels


def rich_plan(model: Rich, world: int) -> ShardingPlan:
    """Every sharding type, placed by the world size (1, 2 or 3 ranks)."""
    last = world - 1
    fp = isinstance(model.clicks, FeatureProcessedEmbeddingBagCollection)
    clicks_sharder = FeatureProcessedEmbeddingBagCollectionSharder() if fp else None

    def plan(module: nn.Module, per_table: dict, sharder: Any = None) -> Any:
        return construct_module_sharding_plan(
            module, per_table, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
        )

    return ShardingPlan(
        {
            "towers.user.ebc": plan(model.towers.user.ebc, {"id": row_wise(), "geo": table_wise(rank=last)}),
            "towers.item.seq.ec": plan(
                model.towers.item.seq.ec,
                {"item": column_wise(ranks=[0, last]), "query": table_wise(rank=0)},
                EmbeddingCollectionSharder(),
            ),
            "tags": plan(model.tags, {"tag": table_row_wise(host_index=0)}),
            "clicks": plan(model.clicks, {"clicked": row_wise()}, clicks_sharder),
            "ctx": plan(model.ctx, {"ctx": data_parallel(), "cat": table_wise(rank=0), "f16": row_wise()}),
        }
    )


def build_rich(world: int) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    model = Rich()
    clicks = model.clicks._embedding_bag_collection
    assert isinstance(clicks, nn.Module)
    fused = [*model.towers.parameters(), *model.tags.parameters(), *clicks.parameters(), *model.ctx.parameters()]
    apply_optimizer_in_backward(RowWiseAdagrad, fused, {"lr": 0.05})
    sharders = [
        EmbeddingBagCollectionSharder(),
        EmbeddingCollectionSharder(),
        FeatureProcessedEmbeddingBagCollectionSharder(),
    ]
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    dmp = DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=rich_plan(model, world),
        env=env,
        sharders=sharders,  # type: ignore[arg-type]
    )
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    # the data-parallel table (and position weights) by SGD with momentum, the MLP by Adagrad
    dp_tables = {n: p for n, p in dense.items() if n.startswith(("ctx.", "clicks."))}
    mlp = {n: p for n, p in dense.items() if n not in dp_tables}
    optimizer = CombinedOptimizer(
        [
            ("mlp", KeyedOptimizerWrapper(mlp, lambda ps: torch.optim.Adagrad(ps, lr=0.05))),
            ("tables", KeyedOptimizerWrapper(dp_tables, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))),
        ]
    )
    # nothing else: the Checkpointer keeps a KeyedOptimizer's param groups (the LR the scheduler
    # sets) and creates its lazy state before a restore loads into it (ckpt/dense/state.py)
    return dmp, optimizer


class RichLoop(Stateful):
    """Step, the LR schedule and the RNG dropout draws from; no `reader` (the batches are a
    function of step and rank). `rank` says which rank wrote a state, `restored_from` which
    rank's state this one came back from."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, rank: int) -> None:
        self.step, self.scheduler, self.rank = 0, scheduler, rank
        self.restored_from: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state(), "rank": self.rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.restored_from = state["step"], state["rank"]
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])


# --- what a rank dumps ----------------------------------------------------------------------------


def _local(value: Any) -> Any:
    """A ShardedTensor as its local shards [(offsets, size, tensor)] with its global size; else a copy."""
    if isinstance(value, ShardedTensor):
        shards = [(list(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()]
        return {"global_size": list(value.size()), "shards": shards}
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value


def dump(path: str, dmp: DistributedModelParallel, dense_opt: Any, loop: Stateful, **extra: Any) -> None:
    """This rank's view of everything training depends on, in torchrec's terms."""
    fused = dmp.fused_optimizer.state_dict()
    if hasattr(dense_opt, "save_param_groups"):  # a KeyedOptimizer: its learning rates compared too, in both runs
        dense_opt.save_param_groups(True)
    state = {
        "model": _local(dmp.state_dict()),
        "fused": _local(fused),
        "dense_opt": _local(dense_opt.state_dict()),
        "loop": _local(loop.state_dict()),
        "rng": torch.get_rng_state(),
        **extra,
    }
    torch.save(state, f"{path}_rank{dist.get_rank()}.pt")


# --- main -----------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--loop", choices=["readme", "rich", "mc"], required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--workdir", required=True, help="the README loop runs from here (its run_dir is relative)")
    p.add_argument("--run-dir", help="the rich loop's run_dir")
    p.add_argument("--plain", action="store_true", help="the same loop without deltarec: no Checkpointer at all")
    p.add_argument("--dump-final", required=True, help="prefix of the dump after the last step")
    p.add_argument("--dump-restored", help="prefix of a dump right after the restore (rich and mc loops)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step waits (a window to kill in)")
    p.add_argument("overrides", nargs="*", help="ckpt settings of the rich loop")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    t0 = time.perf_counter()
    dist.init_process_group("gloo", init_method=args.init_method, rank=rank, world_size=world)
    torch.manual_seed(0)  # the MLPs start the same on every rank; dropout draws the same masks
    os.chdir(args.workdir)
    loops = {"readme": readme_loop, "rich": rich_loop, "mc": mc_loop}
    loop = loops[args.loop](args, rank, world)
    print(f"rank {rank}: done at step {loop.step} in {time.perf_counter() - t0:.1f} s", flush=True)
    dist.destroy_process_group()
    return 0


def readme_loop(args: argparse.Namespace, rank: int, world: int) -> StepOnly:
    dmp, dense_opt = build_small(world)
    loop, steps = StepOnly(), args.steps
    dmp.train()

    def train_step(step: int) -> None:
        loss = dmp(*small_batch(step, rank))
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        time.sleep(args.step_sleep)

    if args.plain:
        for step in range(loop.step + 1, steps + 1):
            train_step(step)
            loop.step = step
    else:
        code = with_training_step(readme_snippet(), "train_step(step)")
        namespace = {"dmp": dmp, "dense_opt": dense_opt, "loop": loop, "steps": steps, "train_step": train_step}
        exec(compile(code, "README.md snippet", "exec"), namespace)  # the README's code, as a user pastes it
    dump(args.dump_final, dmp, dense_opt, loop)
    return loop


def rich_loop(args: argparse.Namespace, rank: int, world: int) -> RichLoop:
    dmp, dense_opt = build_rich(world)
    scheduler = torch.optim.lr_scheduler.StepLR(dense_opt, step_size=7, gamma=0.5)
    loop = RichLoop(scheduler, rank)
    ckpt = None
    if not args.plain:
        from ckpt import Checkpointer, CkptConfig  # a plain run never imports deltarec's engine

        cfg = CkptConfig.from_dict(
            {"sink": {"kind": "filesystem"}, "schedule": {"interval_steps": 5}, "restore": {"resume": "latest"}}
        ).override(args.overrides)
        ckpt = Checkpointer(cfg, dmp, dense_optimizer=dense_opt, loop=loop, run_dir=args.run_dir)
        report = ckpt.restore()
        if args.dump_restored:
            restored = None if report is None else (report.checkpoint_id, report.step)
            dump(args.dump_restored, dmp, dense_opt, loop, restored=restored, restored_from=loop.restored_from)
    dmp.train()
    for step in range(loop.step + 1, args.steps + 1):
        loss = dmp(*rich_batch(step, rank))
        dense_opt.zero_grad()
        loss.backward()  # the fused optimizer updates the rows here
        dense_opt.step()
        scheduler.step()
        loop.step = step
        if ckpt is not None:
            ckpt.save(step)
        time.sleep(args.step_sleep)
    if ckpt is not None:
        ckpt.close(loop.step)
    dump(args.dump_final, dmp, dense_opt, loop, restored_from=loop.restored_from)
    return loop


class McLoop(Stateful):
    """The managed-collision loop's state: the step and the RNG, which an eviction's redraw of
    rows draws from (so an exact resume needs it, as a user's loop state would hold it)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"])


class _NoDenseOptimizer:
    """The managed-collision model has no dense parameters: what `dump` reads of a dense optimizer."""

    def state_dict(self) -> dict[str, Any]:
        return {}


def mc_loop(args: argparse.Namespace, rank: int, world: int) -> McLoop:
    """A model of two managed-collision tables (tests/multirank/mc_worker.py: a pooled and a
    sequence one, 2^40 raw ids, DistanceLFU eviction every 2 steps, fused SGD), each rank
    training its own batches; checkpointed every 3 steps unless `--plain`. `--dump-restored`: a
    dump right after the restore (on another world size than the chain's too)."""
    from tests.multirank.mc_worker import batch, build  # noqa: PLC0415

    dmp, loop, ckpt = build(world, "sgd"), McLoop(), None
    if not args.plain:
        from ckpt import Checkpointer, CkptConfig  # noqa: PLC0415

        cfg = CkptConfig.from_dict(
            {"sink": {"kind": "filesystem"}, "schedule": {"interval_steps": 3}, "restore": {"resume": "latest"}}
        ).override(args.overrides)
        ckpt = Checkpointer(cfg, dmp, dense_optimizer=None, loop=loop, run_dir=args.run_dir)
        report = ckpt.restore()
        if args.dump_restored:  # the rows and mappings as restored (on any world size), before a step
            restored = None if report is None else (report.checkpoint_id, report.step)
            dump(args.dump_restored, dmp, _NoDenseOptimizer(), loop, restored=restored)
    dmp.train()
    for step in range(loop.step + 1, args.steps + 1):
        pooled, seq = dmp(*batch(step, rank))
        (pooled.pow(2).sum() + seq.pow(2).sum()).backward()  # the fused optimizer updates the rows here
        loop.step = step
        if ckpt is not None:
            ckpt.save(step)
        time.sleep(args.step_sleep)
    if ckpt is not None:
        ckpt.close(loop.step)
    dump(args.dump_final, dmp, _NoDenseOptimizer(), loop)
    return loop


if __name__ == "__main__":
    run_main(main)
