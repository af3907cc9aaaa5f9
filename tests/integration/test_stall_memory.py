"""The stall copies into host memory that is already there: half an interval before each
snapshot (a job's first included) the checkpointer reserves the snapshot's slab ahead
(ckpt/capture/host_buffers.py), so no stall allocates and faults in memory, even
as `one_shot_diff`'s deltas grow past every slab the pool keeps (without the reservations the
first checkpoint makes a slab of 8 MiB inside its stall, the third and fourth of 6-8 MiB)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from launch.ranks import REPO, spawn_ranks

if TYPE_CHECKING:
    from tests.conftest import MetricsReader

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_no_snapshot_of_a_job_allocates_host_memory_inside_its_stall(tmp_path, metrics: MetricsReader):
    # the quickstart model: its snapshots span several 2 MiB pages, so a growing delta
    # outgrows the slab of the one before (the debug model fits one page whatever it trains)
    job = [
        "ckpt.enabled=true",
        "ckpt.sink.kind=filesystem",
        "ckpt.run_id=stall-memory",
        "ckpt.schedule.policy=one_shot_diff",
        "ckpt.schedule.interval_steps=12",
        "train.steps=60",
        "train.eval_batches=0",
    ]
    spawn_ranks(REPO / "configs" / "quickstart.yaml", job, tmp_path, timeout_s=240)
    fresh = metrics.values(tmp_path / "run", "ckpt_stall_new_bytes", ckpt_committed=True)
    assert fresh == [0, 0, 0, 0, 0], f"host bytes allocated inside each stall: {fresh}"
