"""The `every-step` suite's follower figures (bench/every_step.py): its log file is the
follower process's alone, and the chain a restore reads is what the markers log says right
after each COMMIT."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

import bench.every_step as every_step
from tests.unit.test_follow_passes import MemoryStream, Trainer, follower


def test_the_follower_process_gets_its_log_file_and_the_suite_keeps_no_handle(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    given: dict[str, Any] = {}

    class Started:
        def __init__(self, argv: list[str], **kw: Any) -> None:
            given.update(kw, argv=argv)

    monkeypatch.setattr(every_step.subprocess, "Popen", Started)
    run_dir = tmp_path / "every0" / "run"
    run_dir.mkdir(parents=True)
    every_step._follower("configs/quickstart.yaml", run_dir, ["ckpt.enabled=true"])
    out = given["stdout"]
    assert Path(out.name) == tmp_path / "every0" / "follower.log" and "trainer.follow_cli" in given["argv"]
    assert out.closed, "the suite left the follower's log file open"


def test_follower_figures_come_from_its_stopped_line_and_its_records(tmp_path: Path) -> None:
    log = tmp_path / "follower.log"
    log.write_text(
        "00:00:01 checkpoint 5 (step 5) applied (rebuilt from 1+2+3+4+5): 1.00 MB in 0.10 s; "
        "2 behind the newest COMMIT, 1.0 s after its COMMIT\n"
        "00:00:09 stopped: 12 checkpoints applied in 3 passes (1 rebuilds), 1 compacted, 0 serving snapshots\n"
    )
    metrics = tmp_path / "follower.jsonl"
    records = [
        {"event": "follow_applied", "follow_ckpt": 5, "follow_lag_ckpts": 2, "follow_lag_s": 1.0},
        {"event": "follow_applied", "follow_ckpt": 10, "follow_lag_ckpts": 4, "follow_lag_s": 0.5},
        {"event": "follow_compacted", "compacted_ckpt": 10, "compact_s": 0.25},
        {"event": "follow_applied", "follow_ckpt": 16, "follow_lag_ckpts": 0, "follow_lag_s": 0.25},
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    got = every_step._follower_figures(log, metrics)
    assert got["follower_applied"] == 12 and got["follower_passes"] == 3 and got["follower_compacted"] == 1
    assert (got["follower_behind_at_end"], got["follower_lag_s_at_end"]) == (0, 0.25)
    assert (got["follower_lag_ckpts_p50"], got["follower_lag_ckpts_max"], got["follower_lag_s_max"]) == (2, 4, 1.0)
    assert got["follower_compact_s_p50"] == 0.25


def test_the_chain_a_restore_reads_is_folded_as_of_each_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(11)
    stream = MemoryStream(rng)
    trainer = Trainer(stream, rng, tables={"t": (1024, 2, "rows")}, max_changed=2, rewinds=False)
    f, _ = follower(stream, tmp_path, monkeypatch, store=True, compact_links=4)
    seen = []
    for n in range(40):
        cid = trainer.commit()
        best = trainer.catalog.cheapest(trainer.catalog.commits[cid])
        assert best is not None
        seen.append(len(best.chain))
        if n % 3 == 0:
            f.poll()
    got = every_step.restore_chains(stream.records, "passes")
    assert got["restore_chain_links_max"] == max(seen) and got["restore_chain_links_at_end"] == seen[-1], (got, seen)
    assert max(seen) <= 4 + 3 and got["compactions_accepted"] == f.stats.compacted > 0, (got, seen)
    assert got["compactions_per_min"] == f.stats.compacted / (39 / 60)  # one commit a second (the trainer's clock)
    # a pass that applied checkpoint 5 ended 2.5 s after its COMMIT: 6 and 7 were committed by then
    passes = [{"follow_ckpt": 5, "follow_lag_s": 2.5}, {"follow_ckpt": 40, "follow_lag_s": 0.1}]
    behind = every_step.behind_at_passes(stream.records, "passes", passes)
    assert (behind["follower_behind_ckpts_p50"], behind["follower_behind_ckpts_max"]) == (1.0, 2), behind
