"""What the public API (`ckpt.Checkpointer`) refuses before training starts, each with one
line naming the culprit: a checkpoint whose tables are not the model's, a loop whose state
has no step, a fused optimizer with state outside the rows; and the config it takes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ckpt import CkptConfig, load_ckpt_config
from ckpt.build import (
    SUPPORTED_OPTIMIZERS,
    UnsupportedOptimizerError,
    check_dense_optimizer,
    check_loop,
    check_optimizers,
    resolve,
)
from ckpt.config import ScheduleConfig, SinkConfig
from ckpt.log.markers import Marker
from ckpt.restore.restorer import check_tables
from ckpt.types import RestoreError
from common.errors import ConfigError, DeltarecError
from sharding.shard_views import ShardMap, ShardView

USER = "towers.user.embedding_bags.id"
ITEM = "towers.item.embedding_bags.id"


def _marker(tables: dict[str, list[int]]) -> Marker:
    return Marker(kind="commit", run_id="r", checkpoint_id=7, step=70, world_size=2, tables=tables)


def test_matching_tables_pass_and_old_markers_are_not_checked() -> None:
    check_tables(_marker({USER: [100, 8], ITEM: [50, 8]}), {USER: (100, 8), ITEM: (50, 8)})
    check_tables(_marker({}), {USER: (100, 8)})  # written before markers carried shapes


@pytest.mark.parametrize(
    ("saved", "model", "line"),
    [
        ({USER: [100, 8]}, {USER: (100, 8), ITEM: (50, 8)}, f"checkpoint 7 of run r has no table {ITEM}, which the model has"),
        ({USER: [100, 8], ITEM: [50, 8]}, {USER: (100, 8)}, f"holds table {ITEM}, which the model does not have"),
        (
            {USER: [100, 8]},
            {USER: (100, 16)},
            f"table {USER}: checkpoint 7 of run r has 100 rows x 8 columns, the model 100 x 16",
        ),
        ({USER: [100, 8]}, {USER: (120, 8)}, f"table {USER}: checkpoint 7 of run r has 100 rows x 8 columns, the model 120 x 8"),
    ],
)
def test_a_checkpoint_that_does_not_match_the_model_is_refused_naming_the_table(
    saved: dict[str, list[int]], model: dict[str, tuple[int, int]], line: str
) -> None:
    with pytest.raises(RestoreError, match=line) as info:
        check_tables(_marker(saved), model)
    assert isinstance(info.value, DeltarecError) and "\n" not in str(info.value)


class _Loop:
    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def test_the_loop_state_must_hold_an_int_step() -> None:
    check_loop(_Loop({"step": 0, "data": [1, 2]}), partial=False)
    for bad in ({"epoch": 3}, {"step": "3"}, {"step": True}, [("step", 3)]):
        with pytest.raises(ConfigError, match="state_dict\\(\\) must be a dict with an int 'step'"):
            check_loop(_Loop(bad), partial=False)


class _SkippingLoop(_Loop):
    def skip_batches(self, n: int) -> None:
        pass


def test_a_step_only_loop_is_enough_but_partial_recovery_needs_samples_seen_and_skip_batches() -> None:
    """Full recovery reads nothing but `step` (the README's loop); partial recovery counts lost
    samples against `samples_seen` and moves a rolled-back rank's data with `skip_batches`, so
    a loop without either is refused before training, naming what it lacks."""
    check_loop(_Loop({"step": 3}), partial=False)
    check_loop(_SkippingLoop({"step": 3, "samples_seen": 768}), partial=True)
    lacks = "loop _SkippingLoop: ckpt.recovery.mode=partial .* int 'samples_seen'.*got keys \\['step'\\]"
    with pytest.raises(ConfigError, match=lacks):
        check_loop(_SkippingLoop({"step": 3}), partial=True)
    with pytest.raises(ConfigError, match="int 'samples_seen'"):
        check_loop(_SkippingLoop({"step": 3, "samples_seen": 7.5}), partial=True)
    with pytest.raises(ConfigError, match="loop _Loop: ckpt.recovery.mode=partial needs a skip_batches\\(n\\) method"):
        check_loop(_Loop({"step": 3, "samples_seen": 768}), partial=True)


def test_a_loop_state_a_restore_could_not_load_is_refused_at_start() -> None:
    """The loop state rides in the dense file, which restores load weights-only: a numpy RNG
    state or an object of the user's would commit and then fail every restore, so it is refused
    before training, naming the loop and the culprit; tensors and plain data pass."""
    import random

    import numpy as np

    lr = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), 3)
    check_loop(_Loop({"step": 1, "rng": torch.get_rng_state(), "py": random.getstate(), "lr": lr.state_dict()}), partial=False)
    with pytest.raises(ConfigError, match="loop _Loop: its state_dict\\(\\) cannot be checkpointed: .*GLOBAL numpy"):
        check_loop(_Loop({"step": 1, "np_rng": np.random.get_state()}), partial=False)
    with pytest.raises(ConfigError, match="loop _Loop: .*torch.save cannot write it"):
        check_loop(_Loop({"step": 1, "f": lambda x: x}), partial=False)


def test_a_dense_optimizer_without_its_state_dict_is_refused() -> None:
    check_dense_optimizer(None)
    check_dense_optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    with pytest.raises(ConfigError, match="dense_optimizer SimpleNamespace has no state_dict\\(\\) or load_state_dict\\(\\)"):
        check_dense_optimizer(SimpleNamespace(step=lambda: None))


def test_the_ckpt_yaml_a_run_leaves_names_absolute_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`deltarec-ckpt --config runs/my_job/ckpt.yaml` from another directory reads the same run."""
    monkeypatch.chdir(tmp_path)
    cfg = resolve(CkptConfig(sink=SinkConfig(kind="filesystem"), schedule=ScheduleConfig(interval_steps=5)), "runs/my_job")
    for path in (cfg.sink.fs_root, cfg.sink.dense_dir, cfg.follow.export_dir, cfg.follow.metrics):
        assert Path(path).is_absolute() and Path(path).is_relative_to(tmp_path / "runs" / "my_job"), path
    assert cfg.run_id == "my_job"
    own = resolve(CkptConfig(sink=SinkConfig(kind="filesystem", fs_root="elsewhere/stream")), "runs/my_job")
    assert own.sink.fs_root == str(tmp_path / "elsewhere" / "stream")


def _shard(kind: str, counter: bool = False) -> ShardView:
    kernel = SimpleNamespace(optimizer=SimpleNamespace(value=kind), _used_rowwise_adagrad_with_counter=counter)
    return ShardView(USER, 0, 0, torch.zeros(4, 2), {}, kernel)  # type: ignore[arg-type]


def test_fused_optimizers_with_state_outside_the_rows_are_refused() -> None:
    for kind in SUPPORTED_OPTIMIZERS:
        check_optimizers(ShardMap([_shard(kind)], []))
    for kind, counter in (("adam", False), ("partial_row_wise_lamb", False), ("exact_row_wise_adagrad", True)):
        with pytest.raises(UnsupportedOptimizerError, match=f"table {USER}: its fused optimizer {kind} keeps a step counter"):
            check_optimizers(ShardMap([_shard(kind, counter)], []))


def test_ckpt_config_from_a_yaml_section_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("model: {anything: 1}\nckpt:\n  sink: {kind: filesystem}\n  schedule: {interval_steps: 25}\n")
    cfg = load_ckpt_config(path, ["encoding.weights=fp16"])
    assert (cfg.sink.kind, cfg.schedule.interval_steps, cfg.encoding.weights) == ("filesystem", 25, "fp16")
    assert cfg.override(["ckpt.schedule.interval_steps=5"]).schedule.interval_steps == 5
    with pytest.raises(ConfigError, match="unknown key 'ckpt.schedule.intervall_steps'"):
        CkptConfig().override(["schedule.intervall_steps=5"])
    with pytest.raises(ConfigError, match="ckpt.schedule.interval_steps must be int"):
        load_ckpt_config(path, ["schedule.interval_steps=often"])


def test_managed_collision_tables_refuse_copy_on_write_and_partial_recovery() -> None:
    """An eviction redraws rows in the forward pass, which copy-on-write's guards do not see, and
    a partial recovery's survivors would keep a mapping ahead of the rolled-back shards': both
    are refused at start, naming the table and the setting to change."""
    from ckpt.build import check_managed_collision
    from ckpt.config import CaptureConfig, RecoveryConfig

    mc = [SimpleNamespace(key="mc._embedding_module.embedding_bags.t")]
    check_managed_collision(CkptConfig(), mc)  # type: ignore[arg-type]
    check_managed_collision(CkptConfig(capture=CaptureConfig(copy_on_write=True)), [])
    with pytest.raises(ConfigError, match="table mc._embedding_module.embedding_bags.t .* set ckpt.capture.copy_on_write=false"):
        check_managed_collision(CkptConfig(capture=CaptureConfig(copy_on_write=True)), mc)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="managed-collision table: set ckpt.recovery.mode=full"):
        check_managed_collision(CkptConfig(recovery=RecoveryConfig(mode="partial")), mc)  # type: ignore[arg-type]
