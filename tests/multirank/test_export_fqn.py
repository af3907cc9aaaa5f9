"""`deltarec-ckpt export` keyed by the unsharded model's FQNs: a freshly built DLRMTrain
loads the DCP directory and the torch.save file as they are, and then holds (and predicts
with) exactly what the sharded job trained.

The job trains for real on 2 gloo ranks with one table of each kind a row stream and the
dense file can carry: row_wise (t_user), column_wise (t_item: row-wise optimizer state per
column shard) and data_parallel (t_ctx: travels with the dense state). Each rank dumps its
parameters at the end (`train.save_params`), which is the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt.restore.export import ExportError, unsharded_fqn
from launch.ranks import spawn_ranks
from sharding.plan import EBC_PATH
from sharding.process_group import DistEnv
from trainer.data.factory import make_reader
from trainer.model import build_model

if TYPE_CHECKING:
    from tests.conftest import CliRunner, DebugConfig

JOB = [
    "ckpt.enabled=true",
    "ckpt.sink.kind=filesystem",
    "ckpt.schedule.interval_steps=10",
    "ckpt.encoding.weights=fp32",
    "ckpt.encoding.optimizer=fp32",
    "model.tables.0.sharding=row_wise",
    "model.tables.1.sharding=column_wise",
    "model.tables.2.sharding=data_parallel",
]
STEPS = 30
TABLE_PREFIX = f"{EBC_PATH}.embedding_bags."


def _fresh_model(debug_config: DebugConfig, job: list[str]) -> torch.nn.Module:
    """An unsharded DLRMTrain as `build_model` returns it, with its (meta) tables given
    memory. Only the collection is materialised: `to_empty` on the whole model would also
    wipe the non-persistent `triu_indices` buffer, which no state_dict restores."""
    model = build_model(debug_config.load(job, check_data=False).model, torch.device("cpu"))
    model.get_submodule(EBC_PATH).to_empty(device="cpu")
    return model


def _trained_state(run_dir: Path, ranks: int, shapes: dict[str, tuple[int, ...]]) -> tuple[dict, dict]:
    """(model state, optimizer state) keyed by DLRMTrain FQN, built from every rank's
    parameter dump: embedding shards placed at their global rows and columns (row-wise
    state of a shard narrower than its table named `<state>@c<col>`, as export documents),
    dense parameters, data-parallel tables and the dense optimizer's state from rank 0.
    Slots no dump covers stay NaN, so they can never compare equal."""
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for r in range(ranks):
        dump = torch.load(run_dir / "params" / f"rank{r}.pt")
        for key, value in dump.items():
            parts = key.split("/")
            if parts[0] == "emb":
                table, row, col, name = parts[1], int(parts[2][1:]), int(parts[3][1:]), parts[4]
                fqn = f"{table}.weight"  # the dump names shards by table key
                rows, dim = shapes[fqn]
                if name == "weight":
                    full = model.setdefault(fqn, torch.full((rows, dim), float("nan")))
                    full[row : row + value.shape[0], col : col + value.shape[1]] = value
                elif value.dim() == 1:
                    cols = dump[f"emb/{table}/r{row}/c{col}/weight"].shape[1]
                    state = name if cols == dim else f"{name}@c{col}"
                    full = optim.setdefault(fqn, {}).setdefault(state, torch.full((rows,), float("nan")))
                    full[row : row + value.shape[0]] = value
                else:
                    full = optim.setdefault(fqn, {}).setdefault(name, torch.full((rows, dim), float("nan")))
                    full[row : row + value.shape[0], col : col + value.shape[1]] = value
            elif parts[0] == "dense" and r == 0:
                model[key[len("dense/") :]] = value
            elif parts[0] == "dense_opt" and r == 0:
                pname, state = key[len("dense_opt/") :].rsplit("/", 1)
                optim.setdefault(pname, {})[state] = value
    return model, optim


@pytest.mark.multirank
def test_export_loads_into_a_fresh_unsharded_model(tmp_path: Path, debug_config: DebugConfig, run_cli: CliRunner) -> None:
    spawn_ranks(debug_config.path, [*JOB, f"train.steps={STEPS}", "train.save_params=true", "train.eval_batches=1"], tmp_path)
    run_dir = tmp_path / "run"
    out, dcp_dir = tmp_path / "export" / "model.pt", tmp_path / "export" / "dcp"
    p = run_cli("trainer.ckpt_cli", "--config", debug_config.path, f"run.dir={run_dir}", *JOB,
                "export", "--out", out, "--dcp", dcp_dir)  # fmt: skip
    assert f"(step {STEPS}, 3 tables)" in p.stdout, p.stdout

    # DCP: the fresh model's own state_dict is the load target, no renaming.
    from_dcp = _fresh_model(debug_config, JOB)
    keys = set(from_dcp.state_dict())
    dcp.load(from_dcp.state_dict(), checkpoint_id=str(dcp_dir))
    # torch.save: the "model" part is a strict state_dict of the same model.
    exported = torch.load(out)
    assert exported["fqn_root"] == "DLRMTrain" and exported["step"] == STEPS
    assert exported["checkpoint_id"] == 3
    assert set(exported["model"]) == keys
    assert exported["tables"] == {f"{TABLE_PREFIX}{t}": f"{TABLE_PREFIX}{t}.weight" for t in ("t_user", "t_item", "t_ctx")}
    from_file = _fresh_model(debug_config, JOB)
    from_file.load_state_dict(exported["model"])

    # (a) every embedding weight and dense parameter is the trained one, bit for bit.
    shapes = {k: tuple(v.shape) for k, v in from_dcp.state_dict().items()}
    trained, trained_optim = _trained_state(run_dir, 2, shapes)
    assert set(trained) == keys, "the dumps and the unsharded model name different parameters"
    for fqn, value in trained.items():
        assert not value.isnan().any(), f"{fqn}: the dumps do not cover it"
        assert torch.equal(from_dcp.state_dict()[fqn], value), f"{fqn} differs after dcp.load"
        assert torch.equal(from_file.state_dict()[fqn], value), f"{fqn} differs after load_state_dict"

    # Optimizer state sits beside the model under "optim.<param fqn>.<state>" (nested
    # dicts flatten to those keys), and equals the trained state.
    assert set(exported["optim"]) == set(trained_optim)
    t_item = f"{TABLE_PREFIX}t_item.weight"
    assert set(exported["optim"][t_item]) == {"sum@c0", "sum@c8"}, "column-wise row-wise state is per column shard"
    target = {"optim": {fqn: {s: torch.empty_like(v) for s, v in states.items()} for fqn, states in trained_optim.items()}}
    dcp.load(target, checkpoint_id=str(dcp_dir))
    for fqn, states in trained_optim.items():
        for state, value in states.items():
            assert torch.equal(exported["optim"][fqn][state], value), f"optim {fqn} {state} (torch.save)"
            assert torch.equal(target["optim"][fqn][state], value), f"optim {fqn} {state} (DCP)"
    buffer = {"buffers": {"model.inter_arch.triu_indices": torch.zeros_like(from_dcp.model.inter_arch.triu_indices)}}
    dcp.load(buffer, checkpoint_id=str(dcp_dir))
    assert torch.equal(buffer["buffers"]["model.inter_arch.triu_indices"], from_dcp.model.inter_arch.triu_indices)

    # (b) predictions on a synthetic batch equal those of a model holding the dumped state.
    reference = _fresh_model(debug_config, JOB)
    reference.load_state_dict(trained)
    cfg = debug_config.load(JOB, check_data=False)
    batch = make_reader(cfg, DistEnv(0, 1, 0, 1, "single"), "eval").next_batch()
    logits = {}
    with torch.no_grad():
        for name, model in (("dcp", from_dcp), ("file", from_file), ("reference", reference)):
            model.eval()
            logits[name] = model.model(batch.dense_features, batch.sparse_features)
    assert logits["reference"].shape == (cfg.data.batch_size, 1)
    assert logits["reference"].std() > 0, "a constant prediction would not tell models apart"
    assert torch.equal(logits["dcp"], logits["reference"])
    assert torch.equal(logits["file"], logits["reference"])


def test_unsharded_fqn_strips_wrappers_and_names_positions() -> None:
    """Names recorded through DMP (`_dmp_wrapped_module.`) and DDP (`module.`) map to the
    unsharded model's FQN, whatever the model; a plain optimizer's position is named by the
    dense file's list, and a position it does not name is an ExportError, not a silent key."""
    fqn = "model.dense_arch.model._mlp.0._linear.weight"
    assert unsharded_fqn(fqn) == fqn
    assert unsharded_fqn(f"module.{fqn}") == fqn
    assert unsharded_fqn(f"_dmp_wrapped_module.module.{fqn}") == fqn
    assert unsharded_fqn("towers.user_mlp.weight") == "towers.user_mlp.weight"
    assert unsharded_fqn(1, ["a.weight", "module.b.bias"]) == "b.bias"
    with pytest.raises(ExportError, match="#2"):
        unsharded_fqn(2, ["a.weight", "b.bias"])
