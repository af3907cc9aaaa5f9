"""RowTracker on managed-collision tables: on 2 spawned gloo ranks
(tests/multirank/mc_tracking_worker.py), a sharded ManagedCollisionEmbeddingBagCollection and
ManagedCollisionEmbeddingCollection (DistanceLFU, eviction every 2 steps) beside an ordinary
EmbeddingBagCollection, fused SGD. At every step the tracker's marks are compared with the rows
whose bytes changed (none missed) and with the rows the step looked up or an eviction redrew,
worked out apart from the tracker (nothing else marked); also for forwards that train nothing
(eval, and training mode under no_grad, whose eviction redraws rows), across detach/attach,
and for the order of `hold_next_lookup`'s calls and the guards against the rows' changes.
Without ``managed_collision`` the model is still refused in one line.

The seed of the batches: $DELTAREC_TEST_SEED when set, else a fixed one; it is printed, and
named in every assertion message.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from launch.ranks import start_command

pytestmark = pytest.mark.multirank
SEED = int(os.environ.get("DELTAREC_TEST_SEED", "7321"))
MC_KEYS = ["mc._embedding_module.embedding_bags.t", "mcseq._embedding_module.embeddings.t"]
PLAIN_KEY = "ebc.embedding_bags.u"


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("mc-tracking")
    print(f"mc tracking: seed {SEED} (replay: DELTAREC_TEST_SEED={SEED})")
    argv = [
        sys.executable,
        "-m",
        "tests.multirank.mc_tracking_worker",
        "--init-method",
        f"file://{tmp}/rdzv-{time.monotonic_ns()}",
        "--seed",
        str(SEED),
    ]
    results = start_command(argv, tmp, world_size=2, timeout_s=180).wait()
    out = []
    for r in results:
        (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        out.append(json.loads(line[len("RESULT ") :]))
    assert [rep["rank"] for rep in out] == [0, 1]
    return out


def _check(shard: dict, where: str) -> None:
    """No changed row missed; no row marked that the step neither looked up nor redrew; and
    (the worker's loss moves every looked-up row) nothing marked that did not change."""
    changed, marked = set(shard["changed"]), set(shard["marked"])
    touched = set(shard["looked_up"]) | set(shard["redrawn"])
    assert not changed - marked, f"{where}: changed rows not marked {sorted(changed - marked)} (seed {SEED})"
    assert not marked - touched, f"{where}: marked rows neither looked up nor redrawn {sorted(marked - touched)} (seed {SEED})"
    assert marked == touched, f"{where}: looked-up or redrawn rows not marked {sorted(touched - marked)} (seed {SEED})"
    assert marked == changed, f"{where}: marked rows that did not change {sorted(marked - changed)} (seed {SEED})"


def test_without_managed_collision_the_model_is_refused_in_one_line(reports: list[dict]) -> None:
    for rep in reports:
        assert rep["refused"] == (
            "module mc is a ShardedManagedCollisionEmbeddingBagCollection: deltarec checkpoints the rows of sharded "
            "EmbeddingBagCollection and EmbeddingCollection modules (and FeatureProcessedEmbeddingBagCollection's) only"
        )


def test_mc_tables_are_keyed_as_in_the_unsharded_model(reports: list[dict]) -> None:
    for rep in reports:
        assert rep["keys"]["shard_map"] == rep["keys"]["unsharded"] == sorted([*MC_KEYS, PLAIN_KEY])
        assert sorted(rep["keys"]["local"]) == sorted([*MC_KEYS, PLAIN_KEY]), "row-wise: every rank holds a shard of each"
        assert rep["mc_modules"] == ["mc", "mcseq"]
        assert set(rep["sharding"].values()) == {"row_wise"}


def test_every_step_marks_exactly_the_rows_it_looked_up_or_redrew(reports: list[dict]) -> None:
    later_evictions = 0  # after the first, which fills free slots: held ids evicted too
    for rep in reports:
        for step, shards in enumerate(rep["steps"]):
            for shard in shards:
                where = f"rank {rep['rank']} step {step} {shard['table']}"
                _check(shard, where)
                assert shard["looked_up"], f"{where}: the step looked nothing up (proves nothing)"
                if shard["table"] in MC_KEYS:
                    assert not shard["redrawn"] or step % 2 == 1, f"{where}: an eviction between evictions (seed {SEED})"
                    later_evictions += step > 1 and bool(shard["redrawn"])
                else:
                    assert not shard["redrawn"], where
    assert later_evictions > 0, f"no eviction after the first (proves little; seed {SEED})"


def test_redrawn_rows_outside_the_lookups_are_marked(reports: list[dict]) -> None:
    """An evicted slot that the step does not look up changes only by the redraw: the marks
    must come from the eviction, not from the lookups."""
    only_redrawn = 0
    for rep in reports:
        for shards in rep["steps"]:
            for shard in shards:
                rest = set(shard["redrawn"]) - set(shard["looked_up"])
                only_redrawn += len(rest)
                assert rest <= set(shard["changed"]) & set(shard["marked"]), shard["table"]
    assert only_redrawn > 0, f"every redrawn slot was looked up too (proves nothing; seed {SEED})"


def test_forwards_that_train_nothing_mark_only_what_an_eviction_redraws(reports: list[dict]) -> None:
    redrawn = 0
    for rep in reports:
        forwards = rep["forwards"]
        assert set(forwards) == {"eval", "no_grad", "no_grad_eviction"}
        for name, shards in forwards.items():
            for shard in shards:
                where = f"rank {rep['rank']} {name} {shard['table']}"
                _check(shard, where)
                if name == "no_grad_eviction" and shard["table"] in MC_KEYS:
                    assert shard["changed"] == shard["redrawn"], where
                    redrawn += len(shard["redrawn"])
                else:
                    assert not shard["marked"] and not shard["changed"], where
    assert redrawn > 0, f"the no_grad forward at an eviction step redrew nothing (proves nothing; seed {SEED})"


def test_detach_restores_the_modules_methods_and_attach_wraps_them_again(reports: list[dict]) -> None:
    for rep in reports:
        d = rep["detached"]
        assert d["own_methods"] and d["rewrapped"], rep["rank"]
        assert d["marked"] == 0, f"rank {rep['rank']}: a detached tracker marked rows"
        for shard in d["after_attach"]:
            _check(shard, f"rank {rep['rank']} after attach {shard['table']}")


@pytest.mark.parametrize("step", ["eviction", "lookups_only"])
def test_waits_and_guards_come_before_any_row_changes(reports: list[dict], step: str) -> None:
    """`hold_next_lookup`'s calls and the guards (what the overlapped copy and copy-on-write
    snapshots rely on): at an eviction step the redraw changes rows in the forward pass, so the
    wait for the copy runs there, before it, and the guards name the redrawn rows first."""
    for rep in reports:
        held = rep["held"][step]
        where = f"rank {rep['rank']} {step} step (seed {SEED})"
        kinds = [e[0] for e in held["events"]]
        assert kinds[0] == "hold" and kinds.count("hold") == 1 and kinds.count("before_update") == 1, f"{where}: {kinds}"
        assert all(changed == 0 for kind, changed in held["events"] if kind != "guard"), f"{where}: {held['events']}"
        if held["redrawn"]:
            assert kinds[1] == "before_update", f"{where}: the wait must come before the redraw: {kinds}"
        else:
            assert kinds[-1] == "before_update", f"{where}: without a redraw the wait is the backward pass's: {kinds}"
        assert held["events"][kinds.index("guard")][1] == 0, f"{where}: rows changed before the first guard call"
        assert not held["late"] and not held["unguarded"], f"{where}: late {held['late']}, unguarded {held['unguarded']}"
        assert held["changed"] > 0, where
    if step == "eviction":
        assert any(rep["held"][step]["redrawn"] for rep in reports), f"the eviction step redrew nothing (seed {SEED})"
    else:
        assert not any(rep["held"][step]["redrawn"] for rep in reports), f"a redraw between evictions (seed {SEED})"
