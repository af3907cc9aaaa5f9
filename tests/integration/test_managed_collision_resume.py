"""Managed-collision tables checkpointed continuously through the public API: a loop of two
managed-collision tables (a pooled and a sequence one over 2^40 raw ids, DistanceLFU eviction
every 2 steps, fused SGD; tests/conformance/worker.py `mc_loop`) on 2 gloo ranks, checkpointed
every 3 steps, SIGKILLed from outside at a random point (its seed printed), resumed by the same
command, and compared bit for bit with the same loop run without deltarec: every table's rows
and fused optimizer state, torchrec's mapping buffers (raw ids, slots, counts, last access,
iteration), the loop state and the RNG. On both sinks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conformance.test_user_loops import assert_same_ranks, kill_at_random, load, module_seed, start

pytestmark = pytest.mark.multirank

STEPS = 30


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The loop without deltarec: each rank's final dump."""
    tmp = tmp_path_factory.mktemp("mc_plain")
    start("mc", tmp, 2, STEPS, "--plain", "--dump-final", str(tmp / "final")).wait()
    return load(tmp / "final", 2)


@pytest.mark.parametrize("sink", ["filesystem", "kafka"])
def test_a_managed_collision_loop_killed_and_resumed_is_bit_identical(
    request: pytest.FixtureRequest, tmp_path: Path, plain: list[dict], sink: str
) -> None:
    seed = module_seed(request)
    job = [f"ckpt.sink.kind={sink}"]
    if sink == "kafka":
        broker = request.getfixturevalue("broker")
        job.append(f"ckpt.sink.bootstrap_servers={broker.bootstrap}")
        job.append(f"ckpt.run_id=mc-{tmp_path.name}")
    command = ("--run-dir", str(tmp_path / "run"), "--step-sleep", "0.05", "--dump-final", str(tmp_path / "final"), *job)
    kill_at_random(start("mc", tmp_path, 2, STEPS, *command), tmp_path / "run", seed, 5, 0.3)
    start("mc", tmp_path, 2, STEPS, *command).wait()
    got = load(tmp_path / "final", 2)
    assert [d["loop"]["step"] for d in got] == [STEPS] * 2
    mapping = [k for k in got[0]["model"] if "_mch_sorted_raw_ids" in k]
    assert mapping, "the dumps hold torchrec's mapping buffers"
    assert_same_ranks(got, plain, f"managed-collision loop on {sink}, resumed ({seed})")
