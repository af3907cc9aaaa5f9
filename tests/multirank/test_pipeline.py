"""Under TorchRec's pipeline the tracker attributes rows to the step that trained them, and
the loop saves the position of the last trained batch (docs/design/invariants.md, invariant
6). tests/multirank/pipeline_worker.py does the work on 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launch.ranks import spawn_ranks
from tests.conftest import DebugConfig

pytestmark = pytest.mark.multirank

PLANS = {
    "table_wise": ["sharding.default=table_wise", "data.workers=1"],
    "row_wise": ["sharding.default=row_wise", "data.workers=0"],
    "two_workers": ["sharding.default=column_wise", "data.workers=2"],
}
STEPS = 3


@pytest.fixture(scope="module", params=list(PLANS))
def report(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, debug_config: DebugConfig
) -> tuple[str, list[dict]]:
    plan = request.param
    tmp = tmp_path_factory.mktemp(f"pipeline-{plan}")
    results = spawn_ranks(
        debug_config.path,
        PLANS[plan],
        tmp,
        module="tests.multirank.pipeline_worker",
        extra_args=["--steps", str(STEPS)],
        timeout_s=180,
    )
    reports = []
    for r in results:
        (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        reports.append(json.loads(line[len("RESULT ") :]))
    return plan, reports


def test_rows_of_batches_in_flight_are_not_in_the_step_before(report: tuple[str, list[dict]]) -> None:
    """After step 3 the pipeline holds batches 4 and 5 (their input all-to-all done or under
    way): the tracker lists exactly the rows batches 1-3 looked up, no row only 4 or 5 name,
    and those rows have not changed."""
    plan, reports = report
    only_in_flight = 0
    for rep in reports:
        first = rep["after"][0]
        assert first["step"] == STEPS and first["in_flight"] == 2, f"{plan}: {first['in_flight']} batches in flight"
        for s in first["shards"]:
            where = f"{plan} rank {rep['rank']} {s['table']}"
            assert s["trained"] > 0, f"{where}: no trained row on this shard, the check proves nothing"
            assert s["trained_not_tracked"] == 0, f"{where}: rows of trained batches not tracked"
            assert s["tracked_not_trained"] == 0, f"{where}: tracked rows no trained batch looked up"
            assert s["tracked"] == s["changed"], f"{where}: tracked {s['tracked']} rows, {s['changed']} changed"
            assert s["only_in_flight_tracked"] == 0, f"{where}: rows of batches in flight were tracked"
            assert s["only_in_flight_changed"] == 0, f"{where}: rows of batches in flight changed"
            only_in_flight += s["only_in_flight"]
    assert only_in_flight > 0, f"{plan}: the batches in flight name no new row, the check proves nothing"


def test_rows_of_the_next_batch_are_tracked_after_its_step(report: tuple[str, list[dict]]) -> None:
    """One step more: the rows of batch 4 are tracked and changed, exactly."""
    plan, reports = report
    grew = 0
    for rep in reports:
        first, second = rep["after"]
        assert second["step"] == STEPS + 1
        for a, b in zip(first["shards"], second["shards"]):
            assert b["trained_not_tracked"] == 0 and b["tracked_not_trained"] == 0, f"{plan} {b['table']}"
            assert b["tracked"] == b["changed"]
            grew += b["tracked"] - a["tracked"]
    assert grew > 0, f"{plan}: step {STEPS + 1} tracked no new row"


def test_the_saved_position_counts_trained_batches_only(report: tuple[str, list[dict]]) -> None:
    """The loop's reader state after step k names global batch k * world as the next, though
    the reader has produced two steps more."""
    plan, reports = report
    for rep in reports:
        for after in rep["after"]:
            assert after["reader"] == {"next_global_batch": after["step"] * 2}, f"{plan}: {after['reader']}"


def test_the_pipelined_and_plain_loops_train_bit_identical_models(tmp_path: Path, debug_config: DebugConfig) -> None:
    """The same job through TorchRec's pipeline (two loader workers, an evaluation every 20 steps
    that hands the model back and takes it again) and one batch at a time ends with every
    parameter and optimizer state equal, bit for bit."""
    dumps = {}
    for loop, workers in (("sparse_dist", 2), ("plain", 0)):
        tmp = tmp_path / loop
        tmp.mkdir()
        spawn_ranks(
            debug_config.path,
            [f"train.pipeline={loop}", f"data.workers={workers}", "train.eval_every=20", "train.save_params=true"],
            tmp,
        )
        dumps[loop] = [torch.load(tmp / "run" / "params" / f"rank{r}.pt") for r in range(2)]
    for rank, (piped, plain) in enumerate(zip(dumps["sparse_dist"], dumps["plain"])):
        assert piped.keys() == plain.keys()
        for key in plain:
            assert torch.equal(piped[key], plain[key]), f"rank {rank} {key}: the loops disagree"
