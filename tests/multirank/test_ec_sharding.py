"""EmbeddingCollection (sequence features, unpooled) on every model-parallel sharding type
torchrec offers it (table_wise, row_wise, column_wise; the worker says why not the other two),
beside a weighted EmbeddingBagCollection, on 2 gloo ranks (tests/multirank/ec_tracker_worker.py):
the tracker marks exactly the rows training changed, shard by shard (ids arrive after the
input all-to-all, bucketized for row-wise types), and a snapshot holds exactly the live values
of the marked rows."""

from __future__ import annotations

import json
import sys
import time

import pytest

from launch.ranks import start_command


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("ec")
    argv = [
        sys.executable,
        "-m",
        "tests.multirank.ec_tracker_worker",
        "--init-method",
        f"file://{tmp}/rdzv-{time.monotonic_ns()}",
    ]
    results = start_command(argv, tmp, world_size=2, timeout_s=180).wait()
    out = []
    for r in results:
        (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        out.append(json.loads(line[len("RESULT ") :]))
    return out


def test_every_sharding_type_is_placed_as_asked(reports: list[dict]) -> None:
    types = reports[0]["types"]
    assert types == {
        "seq.tw.embeddings.t": "table_wise",
        "seq.rw.embeddings.t": "row_wise",
        "seq.cw.embeddings.t": "column_wise",
        "pooled.embedding_bags.t": "row_wise",
    }
    for rep in reports:
        assert rep["replicated"] == [], "every table here is model-parallel: its rows are tracked"


def test_tracked_rows_are_exactly_the_changed_rows_on_every_type(reports: list[dict]) -> None:
    seen = set()
    for rep in reports:
        for s in rep["shards"]:
            where = f"rank {rep['rank']} {s['table']}"
            assert s["changed"] > 0, f"{where}: training changed no row (the check would prove nothing)"
            assert s["changed_not_tracked"] == 0, f"{where}: {s['changed_not_tracked']} changed rows untracked"
            assert s["tracked_not_changed"] == 0, f"{where}: {s['tracked_not_changed']} tracked rows unchanged"
            seen.add(s["table"])
    assert seen == {k for k, v in reports[0]["types"].items() if v != "data_parallel"}


def test_a_snapshot_holds_the_live_values_of_the_marked_rows(reports: list[dict]) -> None:
    assert all(rep["snapshot_exact"] for rep in reports)
