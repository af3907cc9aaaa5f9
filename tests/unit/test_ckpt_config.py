"""The `ckpt` section in stage sections: the flat layout used before still loads (files,
overrides, the job config) through its one table of keys, every old key to its new place; a key
given both ways is refused with one line; each stage's rules name the sectioned key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ckpt.config import FLAT_KEYS, CkptConfig, load_ckpt_config
from common.errors import ConfigError
from trainer.config import load_config

#: A value other than the default for every key of the flat layout (a key added to FLAT_KEYS
#: without one here fails `test_every_flat_key_is_tested`).
OLD_VALUES: dict[str, Any] = {
    "sink": "filesystem",
    "bootstrap_servers": "broker:9092",
    "kafka": {"acks": "all"},
    "fs_root": "/s",
    "dense_dir": "/d",
    "max_frame_bytes": 20000,
    "flush_timeout_s": 5.0,
    "connect_timeout_s": 3.0,
    "catalog_every": 4,
    "policy": "incremental",
    "interval_steps": 7,
    "interval_s": 2.0,
    "final": False,
    "max_pending_bytes": 1000,
    "on_backpressure": "wait",
    "max_pending_checkpoints": 2,
    "writer_nice": 3,
    "encoding": "asym8",
    "optimizer_encoding": "fp16",
    "expected_restores": 2,
    "restore_bit_widths": "check_n_run",
    "untrained_rows": "store",
    "overlap_copy": False,
    "copy_on_write": True,
    "encode_on": "host",
    "resume": "latest",
    "on_corrupt": "previous",
    "read_ahead": False,
    "recovery": "partial",
    "survivor_timeout_s": 9.0,
    "target_pls": 0.01,
    "mtbf_s": 60.0,
    "priority": "mfu",
    "priority_budget": 0.2,
    "priority_full_every": 4,
    "ssu_sample": 0.3,
}


def _at(cfg: CkptConfig, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


def test_every_flat_key_is_tested() -> None:
    assert set(OLD_VALUES) == set(FLAT_KEYS)
    defaults = CkptConfig()
    assert all(_at(defaults, FLAT_KEYS[k]) != v for k, v in OLD_VALUES.items())  # each value moves something


def test_a_flat_file_loads_every_key_into_its_section(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"ckpt": {"enabled": True, "run_id": "old", **OLD_VALUES}}))
    cfg = load_ckpt_config(path)
    for old, new in FLAT_KEYS.items():
        assert _at(cfg, new) == OLD_VALUES[old], (old, new)
    assert cfg.enabled and cfg.run_id == "old"
    again = CkptConfig.from_dict(yaml.safe_load(cfg.to_yaml())["ckpt"])  # written sectioned, read back the same
    assert again == cfg


def test_flat_overrides_land_in_their_sections_and_leave_the_rest_of_a_section() -> None:
    base = CkptConfig.from_dict(
        {"encoding": {"weights": "fp16", "optimizer": "bf16"}, "sink": {"kind": "kafka", "fs_root": "/x"}}
    )
    for old, value in OLD_VALUES.items():
        raw = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
        cfg = base.override([f"ckpt.{old}={raw}"])
        assert _at(cfg, FLAT_KEYS[old]) == value, old
    # a scalar for a key that is now also a section replaces one field, not the section
    cfg = base.override(["encoding=asym8", "sink=filesystem", "kafka.security.protocol=SSL"])
    assert (cfg.encoding.weights, cfg.encoding.optimizer) == ("asym8", "bf16")
    assert (cfg.sink.kind, cfg.sink.fs_root, cfg.sink.kafka) == ("filesystem", "/x", {"security": {"protocol": "SSL"}})
    assert base.override(["sink={kind: filesystem}"]).sink.fs_root == ""  # a mapping is the whole section


def test_a_key_given_both_ways_is_refused_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text("ckpt:\n  interval_steps: 5\n  schedule: {interval_steps: 6}\n")
    with pytest.raises(ConfigError, match=r"ckpt.interval_steps is the old name of ckpt.schedule.interval_steps, which is also"):
        load_ckpt_config(path)
    path.write_text("ckpt:\n  interval_steps: 5\n  schedule: often\n")
    with pytest.raises(ConfigError, match="ckpt.schedule must be a mapping"):
        load_ckpt_config(path)


def test_a_job_config_in_the_flat_layout_loads_with_flat_overrides(tmp_path: Path, debug_config) -> None:
    data = yaml.safe_load(Path(debug_config.path).read_text())
    data["ckpt"] = {**data.get("ckpt", {}), "sink": "filesystem", "interval_steps": 5, "encoding": "asym8"}
    path = tmp_path / "old_job.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path, ["ckpt.enabled=true", "ckpt.interval_steps=9", "ckpt.optimizer_encoding=fp16"], check_data=False)
    c = cfg.ckpt
    assert (c.sink.kind, c.schedule.interval_steps, c.encoding.weights, c.encoding.optimizer) == (
        "filesystem",
        9,
        "asym8",
        "fp16",
    )
    written = yaml.safe_load(cfg.to_yaml())["ckpt"]  # the run directory's config.yaml: sectioned
    assert written["schedule"]["interval_steps"] == 9 and "interval_steps" not in written


def test_rules_spanning_sections_name_the_sectioned_keys() -> None:
    ok = {"enabled": True, "run_id": "r", "sink": {"kind": "filesystem"}}
    CkptConfig.from_dict(ok).validate("job.yaml")
    bad = [
        ({"schedule": {"interval_steps": 0}}, "ckpt.schedule.interval_steps and/or ckpt.schedule.interval_s"),
        ({"recovery": {"priority": "mfu", "mode": "partial"}}, "needs ckpt.recovery.mode=partial and ckpt.schedule.policy"),
        ({"recovery": {"mode": "partial", "target_pls": 0.1}, "schedule": {"interval_s": 5.0}}, "not both"),
        ({"sink": {"kind": "kafka"}}, "ckpt.sink.kind=kafka needs ckpt.sink.bootstrap_servers"),
        ({"encoding": {"optimizer": "adaptive4"}}, "never stored below 8 bits"),
        ({"write": {"writer_nice": 40}}, "ckpt.write.writer_nice must be in 0..19"),
        ({"write": {"max_coalesced": -1}}, r"ckpt.write.max_coalesced must be >= 0 \(0: no bound\), got -1"),
        ({"write": {"keep_dense": -2}}, r"ckpt.write.keep_dense must be >= 0 \(0: keep every dense file\), got -2"),
    ]
    for extra, message in bad:
        with pytest.raises(ConfigError, match=message):
            CkptConfig.from_dict({**ok, **extra}).validate("job.yaml")
