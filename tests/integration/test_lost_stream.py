"""A lost stream never makes a run silently start over, and a new start never overwrites the
files of earlier checkpoints: the broker restarted empty (its storage is
memory) and a filesystem sink's root emptied, with real ranks, a real broker and real files."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from confluent_kafka.admin import AdminClient

from launch.broker import EmbeddedBroker
from launch.ranks import read_jsonl, spawn_ranks

if TYPE_CHECKING:
    from tests.conftest import DebugConfig

pytestmark = pytest.mark.integration
STEPS = 30


def _job(run_id: str, sink: str, bootstrap: str = "") -> list[str]:
    return [
        "ckpt.enabled=true",
        f"ckpt.sink.kind={sink}",
        f"ckpt.sink.bootstrap_servers={bootstrap}",
        f"ckpt.run_id={run_id}",
        "ckpt.schedule.interval_steps=10",
        "ckpt.sink.flush_timeout_s=20",
        "ckpt.schedule.final=false",
        f"train.steps={STEPS}",
        "train.eval_batches=1",
    ]


def _dense_files(run_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((run_dir / "dense").glob("dense-*.pt"))}


def _committed_ids(run_dir: Path) -> list[int]:
    return [r["ckpt_id"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("ckpt_committed")]


def _refused_then_started_over(
    debug_config: DebugConfig, job: list[str], tmp_path: Path, *losses: Callable[[], tuple[list[str], str]]
) -> None:
    """Train, then for each loss: lose the stream (the callable returns overrides, such as
    another broker's address, and the stream the job then points at) and check `resume=latest`
    is refused naming that stream; then start over."""
    run_dir = tmp_path / "run"
    spawn_ranks(debug_config.path, job, tmp_path)
    first = _committed_ids(run_dir)
    assert first == [1, 2, 3]
    before = _dense_files(run_dir)
    assert sorted(before) == [f"dense-{i:08d}.pt" for i in first]

    for lose_stream in losses:
        overrides, where = lose_stream()
        refused = spawn_ranks(debug_config.path, [*job, *overrides, "ckpt.restore.resume=latest"], tmp_path, expect_ok=False)
        assert all(r.returncode == 2 for r in refused), [r.returncode for r in refused]
        out = refused[0].stdout + refused[0].stderr
        line = next((x for x in out.splitlines() if "committed checkpoint(s)" in x), None)
        assert line is not None, out[-3000:]
        assert "records 3 committed checkpoint(s) (newest 3 at step 30" in line and "ckpt.restore.resume=none" in line, line
        assert f"but {where} has no COMMIT marker" in line, line
        assert "starting from scratch" not in out and "Traceback" not in refused[0].stderr, out[-3000:]
        assert _dense_files(run_dir) == before  # nothing written, nothing replaced
        assert _committed_ids(run_dir) == first  # no checkpoint taken by the refused attempt

    # The user chooses to start over: the old files stay, ids go on after them.
    spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=none"], tmp_path)
    assert _committed_ids(run_dir) == [1, 2, 3, 4, 5, 6]
    after = _dense_files(run_dir)
    assert {k: after[k] for k in before} == before
    assert sorted(after) == [f"dense-{i:08d}.pt" for i in range(1, 7)]

    # ... and that new start is what `resume=latest` brings back now.
    resumed = spawn_ranks(debug_config.path, [*job, "ckpt.restore.resume=latest", f"train.steps={STEPS + 10}"], tmp_path)
    assert "deltarec: resumed from checkpoint 6 at step 30" in resumed[0].stdout


def test_broker_restarted_empty_is_refused_not_started_over(tmp_path, unique_name, debug_config: DebugConfig):
    """Also the two other ways a Kafka stream goes missing, first: the job pointed at another
    live broker (where the refused start must not even create a topic), and the run's topics
    deleted."""
    run_id = unique_name("lost")
    first = EmbeddedBroker(state_dir=tmp_path / "broker1")
    first.start()
    port = first.port
    job = _job(run_id, "kafka", first.bootstrap)
    others: list[EmbeddedBroker] = []

    def another_broker() -> tuple[list[str], str]:
        b = EmbeddedBroker(state_dir=tmp_path / "other")
        b.start()
        others.append(b)
        return [f"ckpt.sink.bootstrap_servers={b.bootstrap}"], b.bootstrap

    def topics_deleted() -> tuple[list[str], str]:
        leaked = [
            t
            for t in AdminClient({"bootstrap.servers": others[0].bootstrap}).list_topics(timeout=10).topics
            if t.startswith(run_id)
        ]
        assert leaked == [], f"the refused start wrote to the broker it was wrongly pointed at: {leaked}"
        admin = AdminClient({"bootstrap.servers": first.bootstrap})
        ours = [t for t in admin.list_topics(timeout=10).topics if t.startswith(run_id)]
        assert f"{run_id}.markers" in ours and len(ours) > 1, ours
        for future in admin.delete_topics(ours, operation_timeout=30).values():
            future.result()
        return [], first.bootstrap

    def restart_empty() -> tuple[list[str], str]:
        first.stop()
        b = EmbeddedBroker(port=port, state_dir=tmp_path / "broker2")  # memory storage: nothing survives
        b.start()
        others.append(b)
        return [], first.bootstrap

    try:
        _refused_then_started_over(debug_config, job, tmp_path, another_broker, topics_deleted, restart_empty)
    finally:
        for b in [first, *others]:
            b.stop()


def test_filesystem_sink_emptied_is_refused_not_started_over(tmp_path, unique_name, debug_config: DebugConfig):
    job = _job(unique_name("lost-fs"), "filesystem")
    stream = tmp_path / "run" / "stream"
    _refused_then_started_over(debug_config, job, tmp_path, lambda: (shutil.rmtree(stream) or [], str(stream)))
