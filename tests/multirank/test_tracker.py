"""RowTracker marks exactly the rows training changes; SnapshotTaker copies them faithfully.

Two spawned gloo ranks per sharding plan train the debug model through the real
`Trainer.train_step` (tests/multirank/tracker_worker.py does the work and reports JSON);
the assertions are here. One spawn per plan (~8 s), shared by the tests of that plan.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from launch.ranks import spawn_ranks

if TYPE_CHECKING:
    from tests.conftest import DebugConfig

pytestmark = pytest.mark.multirank
PLANS = {
    # t_ctx data_parallel in every single-type plan: its ids reach the hook too and must be ignored.
    "table_wise": ["sharding.default=table_wise", "model.tables.2.sharding=data_parallel"],
    "row_wise": ["sharding.default=row_wise", "model.tables.2.sharding=data_parallel"],
    "column_wise": ["sharding.default=column_wise", "model.tables.2.sharding=data_parallel"],
    "table_row_wise": ["sharding.default=table_row_wise", "model.tables.2.sharding=data_parallel"],
    # two column shards of each table per rank: one feature at two key positions of a lookup
    "column_wise_2_per_rank": ["sharding.default=column_wise", "model.tables.2.sharding=data_parallel"],
    # three lookup groups in one model
    "mixed": ["model.tables.0.sharding=row_wise", "model.tables.1.sharding=column_wise", "model.tables.2.sharding=table_wise"],
}


@pytest.fixture(scope="module", params=list(PLANS))
def report(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, debug_config: DebugConfig
) -> tuple[str, list[dict]]:
    plan = request.param
    tmp = tmp_path_factory.mktemp(f"tracker-{plan}")
    extra = ["--column-shards-per-rank", "2"] if plan == "column_wise_2_per_rank" else []
    results = spawn_ranks(
        debug_config.path, PLANS[plan], tmp, module="tests.multirank.tracker_worker", extra_args=extra, timeout_s=180
    )
    reports = []
    for r in results:
        (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        reports.append(json.loads(line[len("RESULT ") :]))
    assert [rep["rank"] for rep in reports] == [0, 1]
    return plan, reports


def test_tracked_rows_are_exactly_the_changed_rows(report: tuple[str, list[dict]]) -> None:
    """changed ⊆ tracked strictly; tracked ⊆ changed as well (row-wise Adagrad moves the
    momentum of every looked-up row unless its gradient is exactly 0, which DLRM never hits)."""
    plan, reports = report
    shards = [s for rep in reports for s in rep["exact"]["shards"]]
    assert shards, f"{plan}: no model-parallel shard on any rank"
    if plan == "column_wise_2_per_rank":
        assert sorted((s["table"], s["col_offset"]) for s in reports[0]["exact"]["shards"]) == [
            ("t_item", 0),
            ("t_item", 4),
            ("t_user", 0),
            ("t_user", 4),
        ]
    for s in shards:
        where = f"{plan} {s['table']} rows {s['row_offset']}+{s['rows']} cols {s['col_offset']}"
        assert s["changed"] > 0, f"{where}: training changed nothing, the comparison proves nothing"
        assert s["changed_not_tracked"] == 0, f"{where}: {s['changed_not_tracked']} changed rows were not tracked"
        assert s["tracked_not_changed"] == 0, f"{where}: {s['tracked_not_changed']} tracked rows did not change"
        assert s["tracked"] == s["changed"]
    if plan != "mixed":
        for rep in reports:  # data_parallel tables are not tracked
            assert rep["exact"]["replicated"] == ["t_ctx"]
            assert all(s["table"] != "t_ctx" for s in rep["exact"]["shards"])


def test_own_batch_ids_miss_rows_the_shard_updates(report: tuple[str, list[dict]]) -> None:
    """A rank's own batch names only part of the rows its shards update: hooking the
    reader instead of the post-all-to-all lookup would lose the rest."""
    plan, reports = report
    shards = [s for rep in reports for s in rep["exact"]["shards"]]
    for s in shards:
        assert s["own_not_changed"] == 0  # every own id of a local shard was updated...
        assert s["changed_not_own"] > 0, f"{plan} {s['table']}: own batch covered every changed row"
    coverage = sum(s["own"] for s in shards) / sum(s["changed"] for s in shards)
    if plan == "row_wise":
        assert 0.5 < coverage < 0.85, f"row_wise: own batches covered {coverage:.0%} of updated rows (expected ~70%)"


def test_eval_and_no_grad_forwards_mark_nothing(report: tuple[str, list[dict]]) -> None:
    plan, reports = report
    for rep in reports:
        e = rep["eval"]
        assert e["after_evaluate"] == 0, f"{plan}: Trainer.evaluate() marked {e['after_evaluate']} rows"
        assert e["after_eval_forward"] == 0, f"{plan}: an eval-mode forward marked rows"
        assert e["after_no_grad_forward"] == 0, f"{plan}: a no-grad forward marked rows"
        assert e["after_train_forward"] > 0, f"{plan}: a training forward marked nothing (control)"


def test_mark_checkpoint_and_mark_base(report: tuple[str, list[dict]]) -> None:
    plan, reports = report
    for rep in reports:
        m = rep["marks"]
        assert m["first"] > 0 and m["second"] > 0 and m["second_new_rows"] > 0, m
        failed = [k for k, v in m.items() if v is False]
        assert not failed, f"{plan} rank {rep['rank']}: {failed}"
        assert m["last_after_mark_checkpoint"] == 0
        assert m["last_after_mark_base"] == 0 and m["base_after_mark_base"] == 0
        assert m["trained_is_folded_base"] and m["trained_counts_ok"]


def test_snapshot_copies_the_tracked_rows(report: tuple[str, list[dict]]) -> None:
    plan, reports = report
    for rep in reports:
        s = rep["snapshot"]
        failed = [k for k, v in s.items() if v is False]
        assert not failed, f"{plan} rank {rep['rank']}: {failed}"
        assert s["delta_rows"] > 0 and s["delta_est"] == s["delta_nbytes"] > 0
        assert s["live_moved_rows"] > 0, "training after take moved no captured row: the copy check proves nothing"
        assert s["base_rows"] > s["last_rows"]  # the one-shot diff spans both windows
        assert s["empty_rows"] == s["empty_nbytes"] == s["empty_est"] == 0


def test_a_held_step_waits_at_its_first_lookup_and_again_before_any_row_changes(
    report: tuple[str, list[dict]],
) -> None:
    """What a checkpoint's copy beside the next step relies on (ckpt/capture/overlapped_copy.py): its
    bookkeeping is waited for at the first lookup, its rows before the backward pass reaches
    the fused kernels of any lookup group; a forward without backward (an eval beside the
    copy) leaves the second wait to the next training step."""
    plan, reports = report
    for rep in reports:
        h, where = rep["hold"], f"{plan} rank {rep['rank']}"
        names = [e[0] for e in h["train_step"]]
        assert names == ["lookup", "before_update", "step_done"], f"{where}: {h['train_step']}"
        changed = dict(h["train_step"])
        assert changed["lookup"] == 0 and changed["before_update"] == 0, f"{where}: rows changed before the waits"
        assert changed["step_done"] > 0, f"{where}: the step changed no row, the check proves nothing"
        after = h["no_grad_forward_then_step"]
        assert [e[0] for e in after] == ["lookup", "forward_done", "before_update", "step_done"], f"{where}: {after}"
        assert dict(after)["before_update"] == 0 < dict(after)["step_done"], f"{where}: {after}"
