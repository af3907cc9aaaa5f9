"""Config loading: every shipped config loads; unknown keys, wrong types and broken
cross-field rules are rejected with one line naming the key and the file."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from common.config_loader import build
from trainer.config import ConfigError, JobConfig, load_config

if TYPE_CHECKING:
    from tests.conftest import DebugConfig


@pytest.mark.parametrize("name", ["debug_cpu", "quickstart", "criteo_kaggle_8gpu", "slurm_criteo"])
def test_shipped_configs_load(name: str, debug_config: DebugConfig) -> None:
    cfg = load_config(debug_config.path.with_name(f"{name}.yaml"), check_data=False)  # configs/<name>.yaml
    assert cfg.model.tables and cfg.train.steps > 0


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_misspelled_key_in_file_is_named_with_the_file(tmp_path: Path, debug_config: DebugConfig) -> None:
    data = debug_config.raw()
    data["train"]["stpes"] = 10
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "'train.stpes'" in msg and str(path) in msg and "\n" not in msg


def test_misspelled_key_inside_a_table_is_named(tmp_path: Path, debug_config: DebugConfig) -> None:
    data = debug_config.raw()
    data["model"]["tables"][1]["num_embedings"] = 5
    with pytest.raises(ConfigError, match=r"'model\.tables\.1\.num_embedings'"):
        load_config(_write(tmp_path, data))


def test_unknown_top_level_section(tmp_path: Path, debug_config: DebugConfig) -> None:
    data = debug_config.raw()
    data["trainer"] = {"steps": 1}
    with pytest.raises(ConfigError, match="unknown key 'trainer'"):
        load_config(_write(tmp_path, data))


def test_overrides_are_applied_and_type_checked(debug_config: DebugConfig) -> None:
    cfg = load_config(debug_config.path, ["train.steps=7", "optimizer.sparse.lr=1", "model.tables.1.sharding=row_wise"])
    assert cfg.train.steps == 7
    assert cfg.optimizer.sparse.lr == 1.0 and isinstance(cfg.optimizer.sparse.lr, float)
    assert cfg.sharding.type_of(cfg.model.tables[1]) == "row_wise"
    assert cfg.sharding.type_of(cfg.model.tables[0]) == "table_wise"  # the file's default
    with pytest.raises(ConfigError, match="train.steps must be int, got str 'many'"):
        load_config(debug_config.path, ["train.steps=many"])
    with pytest.raises(ConfigError, match="train.save_params must be bool"):
        load_config(debug_config.path, ["train.save_params=3"])
    with pytest.raises(ConfigError, match="unknown key 'train.stepz'"):
        load_config(debug_config.path, ["train.stepz=3"])
    with pytest.raises(ConfigError, match="sharding.default must be one of"):
        load_config(debug_config.path, ["sharding.default=diagonal"])
    with pytest.raises(ConfigError, match="not an index"):
        load_config(debug_config.path, ["model.tables.9.sharding=row_wise"])
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(debug_config.path, ["train.steps"])


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.tables.0.embedding_dim=32", "must equal the last of model.dense_arch_layer_sizes"),
        ("model.tables.1.features=[f_user]", "feature 'f_user' is already looked up by table 't_user'"),
        ("model.over_arch_layer_sizes=[8, 2]", "must end with 1"),
        ("data.batch_size=0", "data.batch_size must be positive"),
        ("data.kind=criteo", "needs 26 categorical features"),
        ("data.synthetic.zipf_exponent=0", "zipf_exponent must be > 0"),
        ("model.tables=[]", "model.tables is empty"),
        # values the YAML types accept but torch refuses with a traceback when the job starts
        ("model.over_arch_layer_sizes=[-5, 1]", "model.over_arch_layer_sizes must be at least 1, got [-5, 1]"),
        ("model.dense_arch_layer_sizes=[]", "model.dense_arch_layer_sizes must not be empty"),
        ("model.dense_in_features=0", "model.dense_in_features must be at least 1"),
        ("train.threads_per_rank=-2", "train.threads_per_rank must be at least 0"),
        ("sharding.timeout_s=0", "sharding.timeout_s must be at least 1"),
        ("optimizer.dense.lr=-0.1", "optimizer.dense.lr must be at least 0"),
        ("data.workers=-1", "data.workers must be at least 0"),
        ("data.prefetch_batches=0", "data.prefetch_batches must be at least 1"),
        ("train.pipeline=fused", "train.pipeline must be one of"),
    ],
)
def test_cross_field_rules_say_what_to_change(override: str, fragment: str, debug_config: DebugConfig) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(debug_config.path, [override])
    assert fragment in str(err.value)


def test_criteo_reads_ahead_with_one_worker_at_most(tmp_path: Path, debug_config: DebugConfig) -> None:
    """The Criteo reader cannot skip lines without parsing them: several workers are refused."""
    kaggle = debug_config.path.with_name("criteo_kaggle_8gpu.yaml")
    with pytest.raises(ConfigError, match="data.workers=2: the criteo reader reads its lines in order"):
        load_config(kaggle, ["data.workers=2"], check_data=False)
    assert load_config(kaggle, ["data.workers=1"], check_data=False).data.workers == 1


def test_criteo_paths_must_exist(tmp_path: Path, debug_config: DebugConfig) -> None:
    kaggle = debug_config.path.with_name("criteo_kaggle_8gpu.yaml")
    with pytest.raises(ConfigError, match="needs data.criteo.train_paths"):
        load_config(kaggle)
    with pytest.raises(ConfigError, match="data file not found: .*nope.tsv"):
        load_config(kaggle, [f"data.criteo.train_paths=[{tmp_path / 'nope.tsv'}]"])


def test_resolved_config_round_trips(debug_config: DebugConfig) -> None:
    cfg = load_config(debug_config.path, ["train.steps=11", "model.tables.2.sharding=column_wise"])
    again = build(JobConfig, yaml.safe_load(cfg.to_yaml()), source="resolved")
    assert again == cfg
    assert again.digest() == cfg.digest()
    assert load_config(debug_config.path).digest() != cfg.digest()


@pytest.mark.parametrize("value", ["-1", "20"])
def test_writer_nice_out_of_range_is_rejected(value: str, debug_config: DebugConfig) -> None:
    with pytest.raises(ConfigError, match=rf"ckpt.write.writer_nice must be in 0..19 .*got {value}"):
        load_config(debug_config.path, ["ckpt.enabled=true", "ckpt.sink.kind=filesystem", f"ckpt.write.writer_nice={value}"])


def test_restore_bit_widths_reach_the_checkpointer_and_bad_tables_are_refused(debug_config: DebugConfig) -> None:
    from ckpt.checkpointer import codecs_for

    base = ["ckpt.enabled=true", "ckpt.sink.kind=filesystem", "ckpt.encoding.expected_restores=3"]
    default = load_config(debug_config.path, base)
    assert default.ckpt.encoding.restore_bit_widths == "deltarec" and default.ckpt.encoding.bit_widths() == ((1, 4),)
    assert codecs_for(default.ckpt.encoding, 0) == ("asym8", "asym8")  # 3 > 1
    once = load_config(debug_config.path, [*base, "ckpt.encoding.expected_restores=1"])
    assert codecs_for(once.ckpt.encoding, 0) == ("adaptive4", "asym8")
    assert codecs_for(once.ckpt.encoding, 2) == ("asym8", "asym8")
    cnr = load_config(debug_config.path, [*base, "ckpt.encoding.restore_bit_widths=check_n_run"])
    assert codecs_for(cnr.ckpt.encoding, 0) == ("adaptive3", "asym8")
    table = load_config(debug_config.path, [*base, "ckpt.encoding.restore_bit_widths=[[1,2],[10,3]]"])
    assert codecs_for(table.ckpt.encoding, 0) == ("adaptive3", "asym8")
    with pytest.raises(
        ConfigError,
        match=r"ckpt.encoding.restore_bit_widths cnr: 'cnr' is not a preset; choose one of "
        r"deltarec, check_n_run or give a table",
    ):
        load_config(debug_config.path, [*base, "ckpt.encoding.restore_bit_widths=cnr"])
    with pytest.raises(
        ConfigError, match=r"ckpt.encoding.restore_bit_widths \[\[20, 4\], \[3, 3\]\]: entry 1 .* restores must increase"
    ):
        load_config(debug_config.path, [*base, "ckpt.encoding.restore_bit_widths=[[20,4],[3,3]]"])


def test_the_config_a_run_keeps_names_absolute_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, debug_config) -> None:
    """`<run_dir>/config.yaml` is read by deltarec-ckpt, -follow and -serve from any directory:
    every path in it absolute, as the job resolved it; the rest as `to_yaml` says it."""
    monkeypatch.chdir(tmp_path)
    cfg = debug_config.load(["run.dir=runs/job", "ckpt.enabled=true", "ckpt.sink.kind=filesystem"])
    kept = yaml.safe_load(cfg.run_file_yaml())
    assert kept["run"]["dir"] == str(tmp_path / "runs" / "job")
    for key in ("fs_root", "dense_dir"):
        path = Path(kept["ckpt"]["sink"][key])
        assert path.is_absolute() and path.is_relative_to(tmp_path / "runs" / "job")
    assert Path(kept["ckpt"]["follow"]["export_dir"]).is_absolute()
    plain = yaml.safe_load(cfg.to_yaml())
    assert {k: v for k, v in kept.items() if k not in ("run", "ckpt", "serve", "data")} == {
        k: v for k, v in plain.items() if k not in ("run", "ckpt", "serve", "data")
    }
