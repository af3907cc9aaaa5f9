"""Hashed tables (`managed_collision`) in the job config: a valid one loads and builds a model
with its own managed-collision module and a row-wise plan for it; each impossible one is
refused with one line naming the table and what to change."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import yaml

from common.errors import DeltarecError
from sharding.config import ManagedCollisionConfig
from sharding.plan import EBC_PATH, MC_PATH, PlanError, validate_sharding
from sharding.process_group import DistEnv
from trainer.config import ConfigError, load_config

if TYPE_CHECKING:
    from tests.conftest import DebugConfig

ENV = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, launcher="single")
HASHED: dict[str, Any] = {"input_hash_size": 2**40, "eviction_interval": 100, "eviction_policy": "distance_lfu"}


def _write(tmp_path: Path, debug_config: DebugConfig, table: dict[str, Any], sparse: str = "adagrad") -> Path:
    """The debug job with t_item changed by `table`, and `sparse` as the fused optimizer."""
    data = debug_config.raw()
    (item,) = [t for t in data["model"]["tables"] if t["name"] == "t_item"]
    item.update(table)
    data["optimizer"]["sparse"]["name"] = sparse
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_hashed_table_loads(tmp_path: Path, debug_config: DebugConfig) -> None:
    cfg = load_config(_write(tmp_path, debug_config, {"sharding": "row_wise", "managed_collision": HASHED}))
    (item,) = [t for t in cfg.model.tables if t.name == "t_item"]
    assert item.managed_collision == ManagedCollisionConfig(2**40, 100, "distance_lfu")
    assert all(t.managed_collision is None for t in cfg.model.tables if t.name != "t_item")


@pytest.mark.parametrize(
    "table,words",
    [
        ({"managed_collision": HASHED}, "is sharded row_wise only, not table_wise; set its sharding: row_wise"),
        ({"sharding": "column_wise", "managed_collision": HASHED}, "row_wise only, not column_wise"),
        ({"sharding": "row_wise", "managed_collision": {**HASHED, "eviction_policy": "fifo"}}, "'fifo' is unknown"),
        ({"sharding": "row_wise", "managed_collision": {**HASHED, "input_hash_size": 999}}, "input_hash_size 999 is below"),
        (
            {"sharding": "row_wise", "managed_collision": {**HASHED, "eviction_interval": 0}},
            "eviction_interval must be at least 1",
        ),
    ],
)
def test_impossible_hashed_tables_are_refused(tmp_path: Path, debug_config: DebugConfig, table: dict, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, debug_config, table))
    msg = str(err.value)
    assert isinstance(err.value, DeltarecError)
    assert words in msg and "model.tables.1 (t_item)" in msg and "\n" not in msg, msg


def test_row_wise_adagrad_with_a_hashed_table_is_refused_on_cpu_only(tmp_path: Path, debug_config: DebugConfig) -> None:
    """fbgemm resets an evicted row's momentum with a CUDA-only kernel: the plan refuses the
    combination on CPU and lets it through on GPU."""
    cfg = load_config(
        _write(tmp_path, debug_config, {"sharding": "row_wise", "managed_collision": HASHED}, sparse="row_wise_adagrad")
    )
    with pytest.raises(PlanError) as err:
        validate_sharding(cfg.model.tables, cfg.sharding, cfg.optimizer, ENV, "cpu")
    msg = str(err.value)
    assert msg.startswith("table t_item:") and "use sgd or adagrad, or a GPU" in msg and "\n" not in msg
    validate_sharding(cfg.model.tables, cfg.sharding, cfg.optimizer, ENV, "cuda")


def test_the_model_and_plan_of_a_hashed_table(tmp_path: Path, debug_config: DebugConfig) -> None:
    """The hashed table sits in its own managed-collision module, planned row_wise over both
    ranks; the ordinary tables keep their module, names and plan."""
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection  # noqa: PLC0415

    from sharding.dmp import plan_model  # noqa: PLC0415
    from trainer.model import build_model  # noqa: PLC0415

    cfg = load_config(_write(tmp_path, debug_config, {"sharding": "row_wise", "managed_collision": HASHED}))
    plain = debug_config.load()
    model = build_model(cfg.model, torch.device("meta"))
    assert isinstance(model.get_submodule(MC_PATH), ManagedCollisionEmbeddingBagCollection)
    assert sorted(model.get_submodule(EBC_PATH).embedding_bags) == ["t_ctx", "t_user"]  # type: ignore[arg-type]
    plan, sharders = plan_model(model, cfg.model.tables, cfg.sharding, cfg.optimizer, ENV, "cpu", collective=False)
    assert len(sharders) == 2
    assert sorted(plan.plan[MC_PATH]) == ["t_item"]  # type: ignore[call-overload]
    assert plan.plan[MC_PATH]["t_item"].sharding_type == "row_wise"  # type: ignore[index]
    plain_plan, plain_sharders = plan_model(
        build_model(plain.model, torch.device("meta")),
        plain.model.tables,
        plain.sharding,
        plain.optimizer,
        ENV,
        "cpu",
        collective=False,
    )
    assert list(plain_plan.plan) == [EBC_PATH] and len(plain_sharders) == 1
    for name in ("t_user", "t_ctx"):
        assert plan.plan[EBC_PATH][name].ranks == plain_plan.plan[EBC_PATH][name].ranks  # type: ignore[index]


def test_an_ordinary_model_is_unchanged(tmp_path: Path, debug_config: DebugConfig) -> None:
    """Without hashed tables the model is torchrec's DLRM as before; with one, its MLPs start
    from the same weights for the same seed (the hashed sparse arch draws nothing)."""
    from torchrec.models.dlrm import SparseArch  # noqa: PLC0415

    from trainer.model import HashedSparseArch, build_model  # noqa: PLC0415

    plain = debug_config.load()
    hashed = load_config(_write(tmp_path, debug_config, {"sharding": "row_wise", "managed_collision": HASHED}))
    torch.manual_seed(0)
    a = build_model(plain.model, torch.device("cpu"))
    torch.manual_seed(0)
    b = build_model(hashed.model, torch.device("cpu"))
    assert type(a.get_submodule("model.sparse_arch")) is SparseArch
    assert type(b.get_submodule("model.sparse_arch")) is HashedSparseArch
    dense_a = {n: p for n, p in a.named_parameters() if "sparse_arch" not in n}
    dense_b = {n: p for n, p in b.named_parameters() if "sparse_arch" not in n}
    assert list(dense_a) == list(dense_b) and dense_a
    assert all(torch.equal(dense_a[n], dense_b[n]) for n in dense_a)
