"""The writers' exchange (ckpt/write/exchange.py) on three real gloo ranks: reports reach rank 0
in rank order and its decision reaches every rank, in one gather and one broadcast while they
fit the capacity; a report or a decision that does not fit still arrives whole, the capacity
grows for the next exchanges, and rank 0 decides once per exchange."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.multirank.exchange_worker import BIG_DECISION, BIG_REPORT

pytestmark = pytest.mark.multirank
WORLD = 3


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    rdzv = tmp_path_factory.mktemp("exchange") / "rdzv"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.multirank.exchange_worker", str(r), str(WORLD), str(rdzv)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(WORLD)
    ]  # fmt: skip
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)  # a hang on any rank fails here
            assert p.returncode == 0, stderr
            (line,) = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            out.append(json.loads(line[len("RESULT ") :]))
    finally:
        for p in procs:
            p.kill()
    return out


def test_every_rank_gets_the_decision_of_every_rank_report_in_rank_order(results: list[dict]) -> None:
    assert [r["rank"] for r in results] == list(range(WORLD))
    for r in results:
        assert [x["round"] for x in r["rounds"]] == [0, 1, 2, 3]
        assert all(x["ranks"] == [0, 1, 2] for x in r["rounds"])
        assert [x["sizes"] for x in r["rounds"]] == [[10, 10, 10], [10, BIG_REPORT, 10], [10, 10, 10], [10, 10, 10]]
        assert [x["pad"] for x in r["rounds"]] == [0, 0, BIG_DECISION, 0]
    assert results[0]["decided"] == 4  # once per exchange, a report too large included


def test_one_gather_and_one_broadcast_while_they_fit(results: list[dict]) -> None:
    for r in results:
        calls = [x["calls"] for x in r["rounds"]]
        assert calls[0] == calls[3] == {"gather": 1, "broadcast": 1}
        assert calls[1] == {"gather": 2, "broadcast": 2}  # the large report: a larger capacity, all send again
        assert calls[2] == {"gather": 1, "broadcast": 2}  # the large decision follows its length


def test_the_capacity_grows_to_a_power_of_two_and_stays(results: list[dict]) -> None:
    for r in results:
        caps = [x["capacity"] for x in r["rounds"]]
        assert caps[0] == 256
        assert caps[1] == caps[2] == caps[3] == 8192  # BIG_REPORT's pickle and its length fit 8 KiB, not 4
