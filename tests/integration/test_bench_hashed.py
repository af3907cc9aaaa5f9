"""Smoke check of the hashed-table suite (`python -m bench.run --suite hashed --quick`): the job
of a managed-collision table on an eviction-heavy stream runs end to end on 2 gloo ranks, every
checkpoint commits, and the result document and the records hold every figure the suite
promises, with values that can be figures at all (bytes written, mapping bytes after
evictions, the ratio against dcp.save, stalls, per-id costs). Behaviour only: no figure is
judged against a target."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from bench.common import read_records
from bench.hashed import IntervalFigures

if TYPE_CHECKING:
    from tests.conftest import CliRunner

pytestmark = [pytest.mark.integration, pytest.mark.multirank]

SUMMARY = (
    "dcp_bytes",
    "full_bytes",
    "fill_bytes",
    "delta_bytes_mean",
    "delta_rows_bytes_mean",
    "delta_mapping_bytes_mean",
    "mapping_bytes_mean_with_eviction",
    "mapping_bytes_mean_without_eviction",
    "delta_over_dcp",
    "capacity_intervals_per_dcp",
    "stall_ms_median_with_eviction",
    "stall_ms_median_without_eviction",
    "capture_ms_median_with_eviction",
    "capture_ms_median_without_eviction",
    "mapping_bytes_per_changed_id",
    "capture_us_per_changed_slot",
)


def test_hashed_suite_reports_every_figure(tmp_path: Path, run_cli: CliRunner) -> None:
    out, records = tmp_path / "hashed.json", tmp_path / "records.jsonl"
    printed = run_cli("bench.run", "--suite", "hashed", "--quick", "--out", out, "--records", records, timeout_s=120).stdout
    result = json.loads(out.read_text())
    assert result["benchmark"] == "hashed" and result["machine"]["cores"]
    assert result["failed"] == 0 and result["committed"] == len(result["intervals"]) == result["settings"]["intervals"]

    rows = result["intervals"]
    assert all({f.name for f in fields(IntervalFigures)} <= set(r) for r in rows)
    assert rows[0]["full"] and not any(r["full"] for r in rows[1:])  # incremental: one full, then deltas
    assert all(r["bytes"] == r["rows_bytes"] + r["mapping_bytes"] + r["dense_bytes"] for r in rows)
    assert all(r["rows_bytes"] > 0 and r["mapping_bytes"] > 0 and r["dcp_bytes"] > 0 for r in rows)
    assert all(r["over_dcp"] == pytest.approx(r["bytes"] / r["dcp_bytes"], rel=1e-3) for r in rows)
    assert all(r["stall_ms"] > 0 and r["capture_ms"] > 0 for r in rows)
    # the eviction interval is twice the checkpoint interval: every other checkpoint follows one
    assert [r["eviction"] for r in rows] == [i % 2 == 1 for i in range(len(rows))]
    fill, *after = [r for r in rows if r["eviction"]]
    assert fill["admitted"] > 0 and fill["evicted"] == 0  # the first eviction fills the empty table
    for r in after:  # then each eviction admits new ids by evicting others, and the mapping says so
        assert r["admitted"] > 0 and r["evicted"] > 0
        assert r["mapping_bytes_per_changed_id"] > 0 and r["capture_us_per_changed_slot"] > 0
    quiet = [r for r in rows[1:] if not r["eviction"]]
    assert all(r["admitted"] == r["evicted"] == 0 for r in quiet)
    # an eviction's mapping record carries its admissions and tombstones: more than the history alone
    assert min(r["mapping_bytes"] for r in after) > max(r["mapping_bytes"] for r in quiet)

    s = result["summary"]
    assert all(isinstance(s[k], (int, float)) and s[k] > 0 for k in SUMMARY), {k: s.get(k) for k in SUMMARY}
    assert s["with_eviction"] >= 1 and s["without_eviction"] >= 1
    assert s["delta_over_dcp"] == pytest.approx(s["delta_bytes_mean"] / s["dcp_bytes"], rel=1e-3)
    assert s["capacity_intervals_per_dcp"] == pytest.approx(1 / s["delta_over_dcp"], rel=1e-3)
    assert 0 < s["mapping_share_of_delta_bytes"] < 1
    assert "over dcp" in printed and "intervals in one dcp.save" in printed

    written = read_records(records)
    assert {r["suite"] for r in written} == {"hashed"}
    metrics = {r["metric"] for r in written}
    assert set(SUMMARY) <= metrics and {"rows_bytes", "mapping_bytes", "over_dcp", "stall_ms", "capture_ms"} <= metrics
