"""The soak script's short version (bench/soak.py): a torchrun job SIGKILLed three times from
outside at random moments (random ranks), restarted by torchrun each time, ends bit-identical
to the same job never interrupted. The long version (20,000 steps, 20 kills, both sinks) is
run by hand; its figures are in docs/reliability.md. This one trains with a loader worker per
rank (`--set data.workers=1`), so every kill also drops the batches that worker had read ahead."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.conftest import CliRunner, ReplaySeed

pytestmark = [pytest.mark.integration, pytest.mark.multirank]


def test_three_kills_from_outside_end_bit_identical_with_a_loader_worker_reading_ahead(
    tmp_path, run_cli: CliRunner, replay_seed: ReplaySeed
) -> None:
    out = tmp_path / "soak.json"
    p = run_cli("bench.soak", "--sink", "filesystem", "--steps", "600", "--kills", "3", "--delay", "0", "1.5",
                "--seed", str(replay_seed.value), "--set", "data.workers=1", "--keep", tmp_path / "work", "--out", out,
                timeout_s=600)  # fmt: skip
    result = json.loads(out.read_text())
    assert result["overrides"] == ["data.workers=1"]
    for run in ("reference/run", "run"):  # the override reached the job and its reference alike
        assert "workers: 1" in (tmp_path / "work" / run / "config.yaml").read_text(), run
    assert result["kills"] == 3, f"{replay_seed}: {p.stderr[-3000:]}"
    assert result["identical"], f"{replay_seed}: the parameters differ from the uninterrupted run"
    assert "bit-identical to the uninterrupted run" in p.stdout
    launch_log = (tmp_path / "work" / "launch.log").read_text()
    assert launch_log.count("torchrun restarts the job") == 3, f"{replay_seed}: {launch_log[-3000:]}"
    assert result["restores"] == launch_log.count("deltarec: resumed from checkpoint"), str(replay_seed)


def test_a_checkpoint_every_step_survives_kills_from_outside_bit_identical(
    tmp_path, run_cli: CliRunner, replay_seed: ReplaySeed
) -> None:
    """`ckpt.schedule.interval_steps=1` with incremental fp32 deltas: the writers fall behind and coalesce
    due checkpoints into the next (`ckpt.write.max_pending_checkpoints`), kills land in stalls, writes
    and commits alike, and the job still ends bit-identical to the uninterrupted run."""
    out = tmp_path / "soak.json"
    p = run_cli("bench.soak", "--sink", "filesystem", "--steps", "300", "--kills", "2", "--delay", "0", "2", "--interval", "1",
                "--set", "ckpt.schedule.policy=incremental", "--seed", str(replay_seed.value), "--keep", tmp_path / "work",
                "--out", out, timeout_s=600)  # fmt: skip
    result = json.loads(out.read_text())
    assert result["kills"] == 2 and result["identical"], f"{replay_seed}: {p.stderr[-3000:]}"
    launch_log = (tmp_path / "work" / "launch.log").read_text()
    assert "coalesced into the next" in launch_log, launch_log[-3000:]
    assert launch_log.count("deltarec: resumed from checkpoint") == result["restores"] == 2, str(replay_seed)
