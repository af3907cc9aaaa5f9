"""The managed-collision (ZCH) state of sharding/managed_collision.py on the real modules, on
spawned gloo ranks (tests/multirank/mc_worker.py): a sharded ManagedCollisionEmbeddingBagCollection
and ManagedCollisionEmbeddingCollection trained with fused SGD or Adagrad and evictions, captured
every step, resumed bit-identically from a captured step, and resharded 2 -> 1 and 2 -> 3 ranks
with their rows. The pure functions: tests/unit/test_managed_collision.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from launch.ranks import start_command

# --- the real modules, on spawned gloo ranks -----------------------------------------------------


def _spawn(tmp: Path, world: int, *args: str, timeout_s: float = 150) -> list[dict]:
    argv = [sys.executable, "-m", "tests.multirank.mc_worker", "--init-method", f"file://{tmp}/rdzv-{time.monotonic_ns()}", *args]
    results = start_command(argv, tmp, world_size=world, timeout_s=timeout_s).wait()
    out = []
    for r in results:
        (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        out.append(json.loads(line[len("RESULT ") :]))
    return out


@pytest.fixture(scope="module", params=["sgd", "adagrad"])
def resumed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """2 ranks: 9 steps captured every step, then resumed from step 5 (and the two controls)."""
    return _spawn(tmp_path_factory.mktemp("mc-resume"), 2, "--mode", "resume", "--optimizer", request.param)


@pytest.mark.multirank
def test_each_rank_holds_the_ids_routed_to_it_in_its_row_range(resumed: list[dict]) -> None:
    for rep in resumed:
        for key, t in rep["tables"].items():
            where = f"rank {rep['rank']} {key}"
            assert t["slots"] == t["segments"][rep["rank"] : rep["rank"] + 2], where
            assert t["routed_here"] and t["held"] > 0, where


@pytest.mark.multirank
def test_every_step_diff_applies_and_training_evicted_ids(resumed: list[dict]) -> None:
    for rep in resumed:
        for key, t in rep["tables"].items():
            where = f"rank {rep['rank']} {key}"
            assert t["chain_ok"] and t["jump_ok"], where
            assert t["evictions"] > 0 and t["admissions"] > t["evictions"], f"{where}: no held id was evicted (proves nothing)"


@pytest.mark.multirank
def test_resume_from_a_captured_step_is_bit_identical(resumed: list[dict]) -> None:
    for rep in resumed:
        for key, t in rep["tables"].items():
            where = f"rank {rep['rank']} {key}"
            assert t["iters"] == [5, 4, 9] and t["history_at_k"] > 0, f"{where}: the capture must fall between evictions"
            assert t["resume_state"] and t["resume_rows"], where


@pytest.mark.multirank
def test_the_resume_needs_the_phase_the_history_and_the_rng_state(resumed: list[dict]) -> None:
    for rep in resumed:
        for key, t in rep["tables"].items():
            where = f"rank {rep['rank']} {key}"
            assert not t["stripped_same"], f"{where}: torchrec's state dict alone resumed exactly (the check proves nothing)"
            assert t["no_rng_state"] and not t["no_rng_rows"], f"{where}: the mapping is RNG-free, the drawn rows are not"


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict]]:
    """2 ranks train and save; then 1 rank and 3 ranks each load it and train on."""
    tmp = tmp_path_factory.mktemp("mc-reshard")
    saved = tmp / "saved"
    saved.mkdir()
    _spawn(tmp, 2, "--mode", "save", "--dir", str(saved), "--optimizer", "adagrad")
    return {w: _spawn(tmp, w, "--mode", "reshard", "--dir", str(saved), "--optimizer", "adagrad") for w in (1, 3)}


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 3])
def test_a_resharded_table_reads_each_held_ids_own_row_and_trains_on(resharded: dict[int, list[dict]], world: int) -> None:
    reports = resharded[world]
    for key in reports[0]["tables"]:
        kept = sum(rep["tables"][key]["kept"] for rep in reports)
        dropped = sum(rep["tables"][key]["dropped"] for rep in reports)
        assert kept + dropped == reports[0]["tables"][key]["old_held"], key
        if world == 1:
            assert dropped == 0, f"{key}: one shard has room for both old shards' ids"
        for rep in reports:
            t = rep["tables"][key]
            where = f"{world} ranks, rank {rep['rank']} {key}"
            assert t["probe_held"] == kept, where
            assert t["held_rows_same"] and t["misses_read_miss_row"], where
            assert t["trained_on"] and t["apply_ok"] and t["iters"] == [9, 13], where
    if world == 3:
        assert any(t["moved"] for rep in reports for t in rep["tables"].values()), "no row moved (proves nothing)"
        assert any(t["admissions_after"] for rep in reports for t in rep["tables"].values()), "no eviction after the reshard"
