"""Smoke checks of the benchmark entry point `python -m bench.run --suite NAME`: the quick suites
run end to end in a tiny form and write what their docs promise (a record for every peer and
every deltarec policy x encoding, the common JSON-lines records with machine and commit).
Behaviour only: no figure is judged. The one-process peers suite (`gpu-peers`) runs its tiny
size on the CPU here and, under the `gpu` marker, on CUDA."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from bench.common import read_records
from bench.peers import DEFAULT_POLICY, FOLLOWER, PEERS
from bench.peers_gpu import ENCODINGS as GPU_ENCODINGS
from bench.peers_gpu import PEERS as GPU_PEERS
from bench.peers_gpu import POLICIES as GPU_POLICIES
from bench.run import SUITES
from bench.scale import DERIVED, SizeFigures
from tests.devices import DEVICES

if TYPE_CHECKING:
    from tests.conftest import CliRunner, DebugConfig

pytestmark = [pytest.mark.integration, pytest.mark.multirank]

FIELDS = {"peer", "policy", "encoding", "metric", "value", "unit", "interval", "ckpt"}
SMOKE_ENCODING = "adaptive4"  # the default policy's: the suite's targets are about it
RECORD_FIELDS = {"suite", "metric", "value", "unit", "labels", "command", "commit", "dirty", "unix", "machine"}


def test_the_entry_point_lists_every_suite(run_cli: CliRunner) -> None:
    listed = run_cli("bench.run", "--list").stdout
    assert all(f"  {s.name} " in listed for s in SUITES)
    assert "--size" in run_cli("bench.run", "--suite", "quick", "--help").stdout  # the suite's own options


def test_quick_suite_writes_every_peer_and_policy(tmp_path: Path, run_cli: CliRunner) -> None:
    out, img, records = tmp_path / "results.json", tmp_path / "img", tmp_path / "records.jsonl"
    # shortened (2 checkpoints per job, a short follower job, one encoding and the default policy
    # beside the follower's incremental one: the other jobs differ only in `ckpt.encoding.weights` and
    # `ckpt.schedule.policy`, each policy's checkpoints are tested in tests/integration/test_resume.py;
    # one round of restores, none of them waiting out a stand-in for a restarted job's model
    # build): what is checked is that every record is there
    run_cli(
        "bench.run", "--suite", "quick", "--records", records, "--out", out, "--plots", img,
        "--steps", "12", "--interval", "6", "--follower-intervals", "3", "--repeats", "1", "--restore-build-s", "0",
        "--encodings", SMOKE_ENCODING, "--policies", DEFAULT_POLICY,
        timeout_s=900,
    )  # fmt: skip
    result = json.loads(out.read_text())
    flat = result["records"]
    assert flat and all(FIELDS <= set(r) for r in flat)

    # every peer, with the figures the goals ask for
    asked = {"stall_ms", "bytes_written", "capacity_bytes", "samples_per_s", "restore_s", "steps_lost_mean"}
    for peer in PEERS:
        assert asked <= {r["metric"] for r in flat if r["peer"] == peer}, peer
    assert {"none", "none_inproc"} <= {r["peer"] for r in flat if r["metric"] == "samples_per_s"}
    assert all(r["value"] for r in flat if r["metric"] == "restore_same_state")

    # the deltarec policy x encoding asked for, per checkpoint and aggregated
    assert result["settings"]["encodings"] == [SMOKE_ENCODING]
    assert result["settings"]["policies"] == [DEFAULT_POLICY]
    assert {r["encoding"] for r in flat if r["peer"] == "deltarec"} == {SMOKE_ENCODING}
    assert {r["policy"] for r in flat if r["peer"] == "deltarec"} == {DEFAULT_POLICY, FOLLOWER}  # only what was asked
    for policy in [DEFAULT_POLICY]:
        for enc in [SMOKE_ENCODING]:
            mine = [r for r in flat if r["peer"] == "deltarec" and r["policy"] == policy and r["encoding"] == enc]
            metrics = {r["metric"] for r in mine}
            assert {
                "stall_ms",
                "bytes_written",
                "capacity_bytes",
                "samples_per_s",
                "restore_s",
                "steps_lost_mean",
                "throughput_overhead",
            } <= metrics, (policy, enc, metrics)
            assert any(r["ckpt"] is not None and r["metric"] == "bytes_written" for r in mine), (policy, enc)
            assert any(r["metric"] == "durable_at_step" for r in mine), (policy, enc)  # committed_at_step
            assert any(
                r["metric"] == "stall_ms"
                for r in flat
                if r["peer"] == "bare_copy" and r["policy"] == policy and r["encoding"] == enc
            )
            cpu = {r["metric"]: r["value"] for r in mine if r["metric"].startswith("cpu_")}
            assert {f"cpu_{k}_s_per_ckpt" for k in ("train", "stall", "writer", "kafka", "other", "trainer", "broker")} <= set(
                cpu
            ), (policy, cpu)
            # its own fresh broker served it, and the writer encoded on its own thread
            assert cpu["cpu_broker_s_per_ckpt"] > 0 and cpu["cpu_writer_s_per_ckpt"] > 0, (policy, cpu)

    assert {t["target"] for t in result["targets"]}  # reported, not judged
    assert sorted(p.name for p in img.glob("*.png")) == [
        "peers_quick_fig15_bytes_written.png",
        "peers_quick_fig16_capacity_bytes.png",
    ]

    # the common records: the same figures, one JSON line each, with machine and commit
    lines = read_records(records)
    assert len(lines) == len(flat)
    assert all(RECORD_FIELDS <= set(r) and r["suite"] == "quick" for r in lines)
    assert all(r["machine"]["cores"] and r["machine"]["loadavg_end"] for r in lines)
    assert {r["commit"] for r in lines} != {None}  # run from the git checkout
    assert {r["labels"]["peer"] for r in lines} >= {"deltarec", "bare_copy", *PEERS}


def test_quant_accuracy_restores_are_exact_in_fp32_and_quantized_ones_are_not(tmp_path: Path, run_cli: CliRunner) -> None:
    """A tiny Fig. 14 grid on 2 real ranks: every segment is a new process restoring from the
    filesystem sink. fp32 restores must reproduce the uninterrupted run exactly (final eval and
    lifetime log loss); a 2-bit restore must move both (or the grid measures nothing)."""
    out, records = tmp_path / "acc.json", tmp_path / "records.jsonl"
    run_cli("bench.run", "--suite", "accuracy", "--records", records, "--out", out, "--steps", "60",
            "--interval", "20", "--eval-every", "30", "--eval-batches", "4", "--settings", "default",
            "--restores", "1", "--controls", "fp32@1", "--skip", "--work-dir", tmp_path / "runs",
            "--set", "optimizer.sparse.lr=0.2", "ckpt.encoding.restore_bit_widths=check_n_run",  # 2-bit at L = 1
            "--timeout", "300", timeout_s=900)  # fmt: skip
    cells = {(c["setting"], c["restores"]): c for c in json.loads(out.read_text())["cells"]}
    fp32, default = cells[("fp32", 1)], cells[("default", 1)]
    assert fp32["restore_steps"] == default["restore_steps"] == [30]
    assert fp32["logloss_rel_pct"] == 0.0 and fp32["lifetime_logloss_rel_pct"] == 0.0
    assert default["codecs"] == ["adaptive2"]
    assert default["logloss_rel_pct"] != 0.0 and default["lifetime_logloss_rel_pct"] != 0.0
    by_cell = {(r["labels"]["setting"], r["metric"]): r for r in read_records(records)}
    assert by_cell[("default", "lifetime_logloss_rel_pct")]["unit"] == "%"
    assert by_cell[("fp32", "logloss_rel_pct")]["value"] == 0.0


def test_cost_suite_measures_kafka_and_the_tmpfs_reference_against_no_checkpoints(tmp_path: Path, run_cli: CliRunner) -> None:
    """A tiny `cost` run (quick model, a checkpoint every 0.2 s): every sink's throughput,
    checkpoints and CPU per checkpoint by thread class; the broker's CPU only where there is
    a broker; the baseline run before and after."""
    out, records = tmp_path / "cost.json", tmp_path / "records.jsonl"
    run_cli(
        "bench.run", "--suite", "cost", "--size", "quick", "--steps", "30", "--log-every", "10", "--interval-s", "0.2",
        "--records", records, "--out", out, "--keep", tmp_path / "runs",
        timeout_s=900,
    )  # fmt: skip
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["none"]["jobs"] == 2 and summary["none"]["samples_per_s"] > 0
    for sink in ("kafka", "tmpfs"):
        a = summary[sink]
        assert a["committed"] >= 1 and a["committed"] == a["checkpoints"], (sink, a)
        assert a["cpu_writer_s_per_ckpt"] > 0 and a["cpu_stall_s_per_ckpt"] > 0, (sink, a)
        # the direct figure is a sum of these and librdkafka's (0 on tmpfs), added in another order
        assert a["cpu_direct_s_per_ckpt"] >= a["cpu_writer_s_per_ckpt"] + a["cpu_stall_s_per_ckpt"] - 1e-9, (sink, a)
        assert a["throughput_overhead"] is not None and a["cpu_trainer_overhead"] is not None
        assert a["throughput_overhead_within"] == pytest.approx(a["pace_excess"] - summary["none"]["pace_excess"])
    assert summary["kafka"]["cpu_broker_s_per_ckpt"] > 0 and summary["kafka"]["cpu_kafka_s_per_ckpt"] > 0
    assert summary["tmpfs"]["cpu_broker_s_per_ckpt"] is None  # no broker
    assert summary["tmpfs"]["cpu_kafka_s_per_ckpt"] == pytest.approx(0, abs=0.05)  # no librdkafka threads
    assert [j["sink"] for j in result["jobs"]] == ["none", "kafka", "tmpfs", "none"]
    assert all(j["vmstat"]["pgfault"] > 0 for j in result["jobs"]), [j["vmstat"] for j in result["jobs"]]
    # 30 steps logged every 10: the windows ending at 20 and 30 (the first is warm-up)
    assert all(len(j["window_rates"]) == 2 and j["pace_excess"] >= 0 for j in result["jobs"]), result["jobs"]
    sinks = {r["labels"]["sink"] for r in read_records(records)}
    assert sinks == {"none", "kafka", "tmpfs"}


def test_checkpoint_suite_runs_its_probes_to_the_end(tmp_path: Path, run_cli: CliRunner) -> None:
    """A tiny `checkpoint` run: the writer's frames against a raw producer of the same bytes,
    the stall against a bare copy, restore against `dcp.load`, each with its figure."""
    records = tmp_path / "records.jsonl"
    run_cli(
        "bench.run",
        "--suite",
        "checkpoint",
        "--steps",
        "20",
        "--interval",
        "10",
        "--repeats",
        "1",
        "--records",
        records,
        timeout_s=600,
    )
    got = {r["metric"]: r["value"] for r in read_records(records)}
    wanted = {"writer_over_raw_full_fp32", "writer_over_raw_full_adaptive4", "stall_over_bare", "restore_over_dcp_load"}
    assert wanted <= set(got), sorted(got)
    assert all(got[m] > 0 for m in wanted), {m: got[m] for m in wanted}


def test_tracker_suite_sets_torchrecs_tracker_beside_ours_and_both_list_the_same_rows(tmp_path: Path, run_cli: CliRunner) -> None:
    """A tiny `tracker` run over a row-wise, a column-wise and a table-wise table: every hook mode
    is timed (TorchRec's `ModelDeltaTrackerTrec` included), and after the same steps its
    deduplicated ids name exactly the rows deltarec's bitmaps hold, table by table, on each rank."""
    out = tmp_path / "tracker.json"
    run_cli(
        "bench.run",
        "--suite",
        "tracker",
        "--config",
        "configs/debug_cpu.yaml",
        *("--rounds", "4", "--block", "3", "--warmup", "2", "--interval", "5", "--repeats", "1", "--out", out),
        "model.tables.0.sharding=row_wise",
        "model.tables.1.sharding=column_wise",
        timeout_s=300,
    )
    doc = json.loads(out.read_text())
    for r in doc["ranks"]:
        assert r["listing"]["rows"] > 0 and r["listing"]["tables_differing"] == [], r["listing"]
    summary = doc["summary"]
    assert summary["trackers_name_the_same_rows"] is True
    timed = ("torchrec_tracker_step_time_ratio_over_without", "torchrec_tracker_hook_ms_per_step", "deltarec_listing_ms")
    assert all(summary[k] > 0 for k in timed), {k: summary[k] for k in timed}


def test_markers_suite_reads_a_long_log_from_its_newest_catalog_record(tmp_path: Path, run_cli: CliRunner) -> None:
    out, records = tmp_path / "results.json", tmp_path / "records.jsonl"
    run_cli(
        "bench.run",
        "--suite",
        "markers",
        "--records",
        records,
        "--out",
        out,
        "--commits",
        "20,120",
        "--repeats",
        "1",
        "--catalog-every",
        "8",
        timeout_s=300,
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["sink"], r["commits"]) for r in rows] == [("fs", 20), ("fs", 120), ("kafka", 20), ("kafka", 120)]
    for r in rows:
        assert r["same_checkpoint"], r
        # after the newest catalog record: at most 8 commits and their link records, and the record
        assert r["whole_records_read"] == r["records"] and r["recent_records_read"] <= 17, r
    assert {"whole_s", "recent_s", "speedup"} <= {rec["metric"] for rec in read_records(records)}


def test_marker_scale_suite_commits_every_shape_under_the_limit(tmp_path: Path, run_cli: CliRunner) -> None:
    """`marker-scale` at small sizes: every COMMIT and link record is under Kafka's limit, the COMMIT
    does not grow with the chain, the fold joins every link back and both folds give the whole chain."""
    out = tmp_path / "results.json"
    run_cli("bench.run", "--suite", "marker-scale", "--out", out, "--shapes", "2x8,64x26", "--chains", "10,200", timeout_s=300)
    doc = json.loads(out.read_text())
    assert [(r["ranks"], r["tables"]) for r in doc["shapes"]] == [(2, 8), (64, 26)]
    assert all(
        r["under_kafka_limit"] and r["joined_exactly"] and r["commit_bytes"] < r["inline_commit_bytes"] for r in doc["shapes"]
    )
    short, long = doc["chains"]
    assert (short["links"], long["links"]) == (10, 200) and short["chains_whole"] and long["chains_whole"]
    assert long["commit_bytes"] - short["commit_bytes"] <= 8 < long["inline_commit_bytes"] // short["inline_commit_bytes"]


@pytest.mark.parametrize("device", DEVICES)
def test_gpu_peers_suite_runs_every_job_in_one_process(tmp_path: Path, run_cli: CliRunner, device: str) -> None:
    """`gpu-peers` at its tiny size, world size 1: the progress file has a line per phase as it
    finished, and every figure of the comparison is a well-formed record, labelled with its
    size; timings, bytes and rates are positive; every load checked gave back the state saved."""
    out, records = tmp_path / "progress.jsonl", tmp_path / "records.jsonl"
    run_cli(
        "bench.run",
        "--suite",
        "gpu-peers",
        "--device",
        device,
        "--sizes",
        "tiny",
        "--interval",
        "3",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--records",
        records,
        "--out",
        out,
        timeout_s=600,
    )
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    events = [e["event"] for e in lines]
    assert events[0] == "start" and events[-2:] == ["size_done", "end"], events
    assert "error" not in events, [e["msg"] for e in lines if e["event"] == "error"]
    jobs = [f"{p}-{e}" for p in GPU_POLICIES for e in GPU_ENCODINGS]
    assert [e["phase"] for e in lines if e["event"] == "phase"] == ["none", *jobs, *GPU_PEERS]
    assert all(isinstance(e["unix"], float) and e["size"] == "tiny" for e in lines[1:-2])
    done = lines[-2]
    assert done["device"] == device and done["error"] is None and done["errors"] == {}

    flat = done["records"]
    assert flat and all(FIELDS <= set(r) and r["size"] == "tiny" for r in flat)
    agg = {(r["peer"], r["policy"], r["encoding"], r["metric"]): r["value"] for r in flat if r["ckpt"] is None}
    for peer in GPU_PEERS:
        for metric in ("stall_ms", "durable_s", "bytes_written", "capacity_bytes", "samples_per_s"):
            assert agg[(peer, "full", "fp32", metric)] > 0, (peer, metric)
        per_ckpt = [r for r in flat if r["peer"] == peer and r["metric"] == "durable_s" and r["ckpt"] is not None]
        assert [r["ckpt"] for r in per_ckpt] == [1, 2, 3], peer
    assert agg[("dcp.save", "full", "fp32", "restore_s")] > 0  # dcp.load's
    assert agg[("dcp.async_save", "full", "fp32", "stall_blocking_ms")] > 0  # its stall less the wait for the last
    for policy in GPU_POLICIES:
        for enc in GPU_ENCODINGS:
            for metric in (
                "stall_ms",
                "durable_s",
                "bytes_written",
                "capacity_bytes",
                "samples_per_s",
                "restore_s",
                "restore_over_dcp_load",
                "bytes_written_vs_dcp",
                "capacity_vs_dcp",
            ):
                assert agg[("deltarec", policy, enc, metric)] > 0, (policy, enc, metric)
            assert agg[("deltarec", policy, enc, "committed")] == 3, (policy, enc)
            assert ("deltarec", policy, enc, "throughput_overhead") in agg
    # the loads that can be exact were checked: dcp.load, and each fp32 deltarec job's restore
    same = {(r["peer"], r["policy"], r["encoding"]): r["value"] for r in flat if r["metric"] == "restore_same_state"}
    assert same == {("dcp.load", "full", "fp32"): True, **{("deltarec", p, "fp32"): True for p in GPU_POLICIES}}
    assert {g["job"] for g in done["goals"]} == {f"{p}/{e}" for p in GPU_POLICIES for e in GPU_ENCODINGS}

    common = read_records(records)
    assert len(common) == len(flat)
    assert all(RECORD_FIELDS <= set(r) and r["suite"] == "gpu-peers" and r["labels"]["size"] == "tiny" for r in common)


def test_throughput_suite_compares_with_torchrec_and_profiles_the_step(
    tmp_path: Path, run_cli: CliRunner, debug_config: DebugConfig
) -> None:
    """A tiny `throughput` run on the debug model: every job's samples/s (TorchRec's pipelined
    loop, deltarec plain, pipelined, with checkpoints), the profile of both loops with the
    tracker inside the forward and the checkpoint as a stage, both readers' rates, the records."""
    out, records = tmp_path / "results.json", tmp_path / "records.jsonl"
    run_cli(
        "bench.run", "--suite", "throughput", "--records", records, "--out", out,
        "--config", debug_config.path, "--steps", "20", "--log-every", "5", "--interval-s", "0.2", "--warmup", "2",
        "--profile-steps", "4", "--profile-interval", "2", "--reader-lines", "1000", "--reader-batch", "256",
        timeout_s=600,
    )  # fmt: skip
    doc = json.loads(out.read_text())
    assert set(doc["samples_per_s"]) == {"torchrec", "deltarec_plain", "deltarec", "deltarec_ckpt"}
    assert all(rate > 0 for rate in doc["samples_per_s"].values())
    assert doc["vs_torchrec"]["torchrec"] == 1.0
    assert [p["pipeline"] for p in doc["profiles"]] == ["sparse_dist", "plain"]
    for p in doc["profiles"]:
        assert {"forward", "backward", "optimizer", "deltarec checkpoint"} <= set(p["stage_ms"]), p["stage_ms"]
        assert "deltarec tracker" in p["inside_ms"] and "deltarec tracker" not in p["stage_ms"]
    assert "start_sparse_data_dist" in doc["profiles"][0]["stage_ms"]  # the pipeline's input dist, outside the forward
    assert doc["readers"]["criteo_tsv_samples_per_s"] > 0 and doc["readers"]["criteo_npy_samples_per_s"] > 0
    metrics = {r["metric"] for r in read_records(records)}
    assert {"samples_per_s", "vs_torchrec", "stage_ms", "criteo_npy_samples_per_s", "pipeline_speedup"} <= metrics


def test_serve_suite_times_freshness_latency_and_memory(tmp_path: Path, run_cli: CliRunner, debug_config: DebugConfig) -> None:
    """A tiny `serve` run on the debug model (a checkpoint every second, a light load): the
    newest checkpoint served and the freshness timed, both request classes answered, memory per
    row, the records; 20 uploads stalled mid-body for 2 s, more than the server's places
    (serve.max_concurrency + serve.max_queue = 8), leave requests answered meanwhile."""
    out, records = tmp_path / "serve.json", tmp_path / "records.jsonl"
    run_cli(
        "bench.run", "--suite", "serve", "--records", records, "--out", out, "--config", debug_config.path,
        "--steps", "300", "--interval-s", "1", "--rate", "10", "--big", "32", "--big-rate", "2",
        "--stalled", "20", "--stall-after-s", "1", "--stall-s", "2", "--set", "serve.max_queue=4",
        timeout_s=300,
    )  # fmt: skip
    s = json.loads(out.read_text())["summary"]
    # every checkpoint the load saw was committed and the newest answered; under a loaded machine
    # (requests refused busy, two checkpoints applied in one poll) an intermediate one may
    # never meet a request, so not every checkpoint need be answered
    assert s["checkpoints"] >= 2 and 2 <= s["served_checkpoints"] <= s["checkpoints"] and s["newest_served"], s
    assert s["freshness_server_p99_s"] > 0 and s["time_to_commit_p99_s"] > 0, s
    assert s["latency_1_p99_ms"] > 0 and s["latency_32_p99_ms"] > 0 and s["requests_ok"] > 0, s
    assert s["memory_stated_per_row_bytes"] == 2 * 4 * 16 and s["rows"] == 2000 + 1000 + 64, s
    # the server holds both copies, and at least their bytes are reported held
    assert s["memory_held_per_row_bytes"] >= s["memory_stated_per_row_bytes"], s
    # a stalled upload takes no place: requests sent meanwhile are answered (before, all were 503)
    assert s["stalled_uploads"] == 20 and s["stalled_requests"] > 0, s
    assert s["stalled_requests_refused"] < s["stalled_requests"] and s["stalled_ready_fraction"] == 1.0, s
    assert {"freshness_server_p99_s", "latency_1_p99_ms", "memory_per_row_bytes"} <= {r["metric"] for r in read_records(records)}


def test_scale_suite_measures_memory_the_follower_and_the_peers_at_a_size(tmp_path: Path, run_cli: CliRunner) -> None:
    out, records = tmp_path / "scale.json", tmp_path / "records.jsonl"
    # one size, shortened (one round of restores, none waiting out a stand-in for a restarted job's
    # model build; a short rotation of the tracker): what is checked is that every figure is measured, not its value
    run_cli("bench.run", "--suite", "scale", "--records", records, "--out", out, "--sizes", "quick",
            "--steps", "12", "--interval", "6", "--follower-intervals", "4", "--repeats", "1", "--restore-build-s", "0",
            "--tracker-block", "2", timeout_s=900)  # fmt: skip
    result = json.loads(out.read_text())
    (size,) = result["sizes"]
    assert size["size"] == "quick" and size["follower_error"] is None, size
    # 4 intervals may end before the follower compacts; the restore into another world size is a 4-rank size's
    optional = {"compact_s", "follower_error", "restore_other_ranks", "restore_other_s"}
    missing = [f.name for f in fields(SizeFigures) if size[f.name] is None and f.name not in optional]
    assert not missing, missing
    # the checkpointing job holds more than the job without checkpoints; the follower's rows are resident
    assert size["rss_incremental_bytes"] > 0 and size["rss_none_bytes"] > 0
    assert size["follower_rss_grown_bytes"] > 0 and size["follower_store_bytes"] > 0
    assert size["pool_keep_bytes"] == 1 << 30 and 0 < size["pool_peak_full_bytes"] <= size["pool_keep_bytes"]
    assert size["export_file_bytes"] > size["model_bytes"] // 2  # weights of every table, fp32
    assert set(result["derived"]) == {d.name for d in DERIVED}
    assert {t["goal"] for t in result["targets"]} and (tmp_path / "scale.quick.json").is_file()
    lines = read_records(records)
    assert {r["suite"] for r in lines} == {"scale"}
    assert {r["labels"].get("size") for r in lines if r["metric"] == "stall_us_per_row"} == {"quick"}


def test_every_step_suite_measures_a_checkpoint_every_step_and_a_kill(tmp_path: Path, run_cli: CliRunner) -> None:
    """`every-step` on the debug model: both jobs of the pair trained, every figure is there, the
    checkpointed job committed checkpoints (coalescing the rest), its CPU and the broker's were
    read over the logged window, the calibration ran its three jobs, and the killed job resumed."""
    out = tmp_path / "results.json"
    steps = 120  # the logged window (steps 20-120) gives the broker more CPU than one clock tick (10 ms) counts
    run_cli("bench.run", "--suite", "every-step", "--config", "configs/debug_cpu.yaml", "--steps", str(steps), "--log-every",
            "20", "--pairs", "1", "--kill-at", "30", "--calibrate", "--out", out, timeout_s=500)  # fmt: skip
    doc = json.loads(out.read_text())
    (pair,) = doc["pairs"]
    assert pair["baseline_samples_per_s"] > 0 and pair["samples_per_s"] > 0, pair
    assert pair["committed"] + pair["coalesced"] >= steps and pair["committed"] > 1, pair
    assert 0 < pair["durable_s_p50"] <= pair["durable_s_p99"], pair
    # a crash after a step loses at least that step (its own COMMIT comes later), never the whole run
    assert 1 <= pair["at_risk_mean"] <= pair["at_risk_max"] < steps, pair
    # every committed checkpoint left its dense file (the debug model's: tens of kB each)
    assert pair["committed"] * 10_000 / steps < pair["dense_mb_per_step"] * 1e6, pair
    # the ranks train in both jobs; only the checkpointed one gives the broker work
    assert pair["cpu_ms_per_step_baseline"] > 0 and pair["cpu_ms_per_step"] > 0, pair
    assert pair["broker_cpu_ms_per_step"] > 0 and 0 < pair["broker_cores"] < 2, pair
    # the ranks' resident sets were read at both ends of the window (growth may be negative: freed)
    assert all(abs(pair[k]) < 10_000 for k in ("rss_kb_per_step_baseline", "rss_kb_per_step")), pair
    calibrated = doc["calibrated"]
    assert calibrated["burn_cores"] == pair["extra_cores"] and calibrated["broker_burn_cores"] == pair["broker_cores"]
    assert calibrated["baseline_samples_per_s"] > 0 and calibrated["burn_slowdown"] < 1, calibrated
    killed = doc["killed"]
    assert killed["resumed_step"] is not None and 0 <= killed["steps_lost"] < 30, killed


def test_serve_suite_sweeps_the_offered_load(tmp_path: Path, run_cli: CliRunner, debug_config: DebugConfig) -> None:
    """`--sweep-only`, tiny, on the debug model while it trains: one point per (rate, size) at
    doubling rates, each with its figures and the server's account of it; the highest rate meeting
    each goal agrees with the points; a saturation breakdown per size; a record per figure."""
    out, records = tmp_path / "serve.json", tmp_path / "records.jsonl"
    run_cli(
        "bench.run", "--suite", "serve", "--records", records, "--out", out, "--config", debug_config.path,
        "--interval-s", "1", "--sweep-only", "--sweep-sizes", "1,32", "--sweep-start-rps", "10", "--sweep-max-rps", "40",
        "--sweep-point-s", "1", "--sweep-goal", "1=20", "--sweep-goal", "32=50", timeout_s=300,
    )  # fmt: skip
    sweep = json.loads(out.read_text())["sweep"]
    points = sweep["points"]
    pairs = [(p["samples"], p["offered_rps"]) for p in points]
    assert len(pairs) == len(set(pairs)) and {(1, 10), (32, 10)} <= set(pairs), pairs
    for p in points:
        assert p["ok"] + p["errors"] == p["sent"] == round(p["offered_rps"]), p
        if p["ok"]:
            assert 0 < p["p50_ms"] <= p["p99_ms"], p
        server = p["server"]
        if p["errors"] == 0:  # the server answered exactly these, each within the client's time
            assert server["requests"] == p["ok"] and p["mean_ms"] >= server["request_ms"], p
        if server is not None:  # the stages add up to the server's time
            assert sum(server["stages_ms"].values()) == pytest.approx(server["request_ms"], rel=1e-2, abs=1e-3), server
    for goal in sweep["goals"]:
        mine = [p for p in points if p["samples"] == goal["samples"]]
        meets = [p["offered_rps"] for p in mine if p["errors"] == 0 and p["ok"] and p["p99_ms"] <= goal["p99_ms"]]
        assert goal["highest_rps"] == (max(meets) if meets else None), (goal, mine)
    assert [(s["samples"], s["offered_rps"]) for s in sweep["saturation"]] == [
        (n, max(r for m, r in pairs if m == n)) for n in (1, 32)
    ]
    assert sweep["trained_throughout"], sweep
    lines = read_records(records)
    answered = {(p["samples"], p["offered_rps"]) for p in points if p["p99_ms"] is not None}
    assert {(r["labels"]["samples"], r["labels"]["offered_rps"]) for r in lines if r["metric"] == "load_p99_ms"} == answered
