"""How checkpointing's cost grows with the model: suite `scale`.

    python -m bench.run --suite scale [--sizes quick,mid,full,kaggle,full4] [--out F] [--plots docs/img] [--keep DIR]
                                      [--set KEY=VALUE ...]

The same job at each size, smallest first: 2 gloo ranks of the quickstart's DLRM, then
Criteo Kaggle's 26 categorical tables (`bench.peers.CRITEO_KAGGLE`) capped at a size's row
count, table-wise, batch 2048 per rank, a checkpoint every 170 steps at every Criteo size
(so each interval changes about as many rows whatever the table: the per-row costs compare).
At each size, in this order, each deltarec job on its own fresh embedded broker:

1. the job without checkpoints (`bench.peers.baseline_job`): throughput and every rank's
   resident memory (`bench.ckpt_rank.RankMemory`), the baseline the others' are measured from;
2. deltarec `full` at 4 bits (`bench.peers.deltarec_job`): a whole snapshot per checkpoint:
   its stall, and the host memory one full checkpoint holds (the snapshot's rows are fp32 on
   the host whatever the encoding; 4 bits keeps the memory-only broker's share small);
3. deltarec `incremental` at 4 bits with `deltarec-follow` in its own process
   (`bench.peers.follower_job`, `bench.follower_proc`): the recommended setup, one full
   checkpoint then deltas, the follower compacting; stall, bytes per interval, time to
   COMMIT, the steady state's memory per rank (the second half of the run, after the first
   full checkpoint), the follower's memory against its documented store bytes
   (`follow_store_bytes`), its compaction times;
4. `deltarec-ckpt export` of that job's newest checkpoint (torch.save + DCP), timed, its
   memory sampled: what publishing a serving snapshot costs at that size;
5. the tracker suite's measurement (`bench.tracker_overhead`, a short rotation): the hook's
   time per step and the bitmap scan that lists a checkpoint's rows;
6. `bench.peers_rank` with `dcp.save` and `dcp.async_save` (cloning stager), then restores:
   `dcp.load` and deltarec's restore of jobs 2 and 3, each with its memory sampled.

Size `full4` (`--sizes full,full4`, not in the default list) is `full`'s model on 4 ranks,
oversubscribed on a 2-core machine: the same jobs on 4 ranks, then (7.) deltarec's restore
of its follower job's checkpoint into 2 ranks (`bench.peers_rank --restore-only`). It is no
point of the trend against model size; its per-rank figures are set beside `full`'s, each
with the ratio (`RankComparison`).

Then per size the figures per GB of model and per changed row, their trend from the smallest
size to the largest as the slope of log(cost) against log(model bytes) (0: flat; 1: grows
with the table; a per-row cost that grows with the table has a positive slope), the goals
(docs/scale.md), and with `--plots` a log-log figure of each. A benchmark, not a test: it asserts
nothing about a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

from bench.common import Measurement, config_path, document_head, loadavg, log, machine_info, median_of, unit_of
from bench.memory import RssSampler
from bench.peers import (
    FOLLOWER,
    baseline_job,
    build_records,
    deltarec_job,
    follower_job,
    full_config,
    peers_job,
)
from common.process import run_main
from launch.broker import EmbeddedBroker

ENCODING = "adaptive4"
SCALE_PEERS = ("dcp.save", "dcp.async_save")
UNCAPPED = 10**12
RSS = "rss_peak_bytes"

# name -> the job: the quickstart's config, or Criteo Kaggle's tables capped at `cap` rows at `dim`
SIZES: dict[str, dict[str, Any]] = {
    "quick": {"config": "configs/quickstart.yaml", "steps": 48, "interval": 12, "follower_intervals": 12, "overrides": []},
    "mid": {"cap": 100_000, "dim": 64},  # 0.84M rows, 0.22 GB of fp32 weights
    "full": {"cap": 1_000_000, "dim": 64},  # 5.57M rows, 1.43 GB: suite `full`'s model
    # Criteo Kaggle's own cardinalities: 33.8M rows, 4.32 GB; a rank's full snapshot (~2.2 GB) is
    # over the default ckpt.write.max_pending_bytes (1 GiB), which must hold one (the checkpointer refuses less)
    "kaggle": {"cap": UNCAPPED, "dim": 32, "overrides": ["data.batch_size=2048", "ckpt.write.max_pending_bytes=4294967296"]},
    # size `full` on 4 ranks (oversubscribed on a 2-core machine), compared with `full`, and its
    # checkpoints restored into 2 ranks as well: not a point of the trend against model size
    "full4": {"cap": 1_000_000, "dim": 64, "ranks": 4, "compare": "full"},
}
BASE_RANKS = 2  # the trend's sizes run on 2 ranks
CRITEO_JOB = {
    "config": None,
    "steps": 340,
    "interval": 170,
    "follower_intervals": 8,
    "overrides": ["data.batch_size=2048"],
    "ranks": BASE_RANKS,
}


def size_job(name: str, work: Path, given: dict[str, int]) -> dict[str, Any]:
    """The suite's settings for size `name` with the options `given` (steps, interval,
    follower_intervals), its config written into `work` when generated."""
    s = {"repeats": 2, "ranks": BASE_RANKS, **CRITEO_JOB, **SIZES[name], **given}
    if s["config"] is None:
        s["config"] = str(full_config(work / f"{name}.yaml", s["cap"], s["dim"]))
    else:
        s["config"] = config_path(s["config"])
    return s


# -- one size's jobs -------------------------------------------------------------------------------
def read_memories(side: Path, ranks: int) -> list[dict[str, Any]]:
    """Every rank's `RankMemory` of a job, as dicts, in rank order."""
    from bench.ckpt_rank import read_memory

    return [asdict(read_memory(side / f"mem_rank{r}.json")) for r in range(ranks)]


def export_job(s: dict[str, Any], run: dict[str, Any], work: Path, timeout_s: float) -> dict[str, Any]:
    """`deltarec-ckpt export` of `run`'s newest checkpoint to a file and a DCP directory: its
    wall time and peak resident memory."""
    out = work / "export"
    out.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "trainer.ckpt_cli", "--config", s["config"], *run["overrides"], f"run.dir={run['run_dir']}"]
    argv += ["export", "--out", str(out / "model.pt"), "--dcp", str(out / "model.dcp")]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rss = RssSampler(proc.pid).start()
    try:
        text, _ = proc.communicate(timeout=timeout_s)
    finally:
        peak = rss.stop()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        log(f"export failed ({proc.returncode}): {text[-600:]}")
        return {"error": text[-600:]}
    nbytes = (out / "model.pt").stat().st_size
    return {"export_s": wall, "rss_peak_bytes": peak, "file_bytes": nbytes}


def tracker_job(s: dict[str, Any], timeout_s: float, block: int = 10) -> dict[str, Any]:
    """The tracker suite's short rotation on this size's job: its summary. `block`: steps per
    block of the rotation and of the warm-up; twice that between its snapshots."""
    from bench import tracker_overhead

    argv = ["--config", s["config"], "--rounds", "3", "--block", str(block), "--warmup", str(block), "--interval", str(2 * block)]
    argv += ["--ranks", str(s["ranks"]), "--repeats", "3", "--timeout-s", str(timeout_s), *s["overrides"]]
    with contextlib.redirect_stdout(io.StringIO()):  # its whole document: kept in ours instead
        result = tracker_overhead.run(argv)
    return dict(result["summary"])


@dataclass
class SizeFigures:
    """One size's figures (every rank's; memory: the largest rank's), as measured."""

    size: str
    ranks: int
    model_rows: int
    model_bytes: int  # every rank's shards: fp32 weights and sparse optimizer state
    rank_model_bytes: int  # the larger rank's
    rows_per_interval: float | None  # rows a delta checkpoint wrote (median)
    stall_ms: float | None  # a delta's stall (median)
    take_ms: float | None  # ... its copy of the rows, the slowest rank's (median)
    agree_ms: float | None  # ... the ranks agreeing to take it, the slowest rank's (median): waits for every rank
    stall_full_ms: float | None  # deltarec `full`, 4-bit
    dcp_save_stall_ms: float | None
    dcp_async_stall_ms: float | None
    bytes_per_interval: float | None  # a delta's bytes written, 4-bit
    dcp_bytes_per_interval: float | None
    capacity_bytes: float | None  # newest restorable chain with the follower
    time_to_commit_s: float | None  # a delta's checkpoint step to its COMMIT (median)
    restore_s: float | None  # deltarec's restore of the follower job's newest chain
    restore_full_s: float | None  # of the `full` job's newest
    # the follower job's restore again with `ckpt.restore.read_ahead=false`: every frame fetched inside `restore()`
    restore_cold_s: float | None
    build_s: float | None  # the job's model build (by default, the restores start that long after opening their backend)
    dcp_load_s: float | None
    samples_per_s_none: float | None
    samples_per_s_incremental: float | None
    tracker_hook_ms_per_step: float | None
    tracker_scan_ms: float | None  # the bitmap scan listing an interval's rows (the tracker suite's)
    find_rows_ms: float | None  # the same scan inside the job's own delta checkpoints (median)
    rss_none_bytes: int | None  # peak, no checkpoints
    rss_incremental_late_bytes: int | None  # peak over the second half, incremental + follower
    rss_incremental_bytes: int | None  # peak over the whole run (its first, full checkpoint included)
    rss_full_bytes: int | None  # peak, deltarec `full`
    anon_extra_end_bytes: int | None  # private memory at the end, incremental + follower less no checkpoints (largest rank)
    file_extra_end_bytes: int | None  # mapped files' resident pages at the end, the same difference
    rss_dcp_save_bytes: int | None  # a peer phase's peak, to compare with the first phase without checkpoints...
    rss_dcp_async_bytes: int | None  # (after dcp.save's: what that phase left resident counts here too)
    rss_phase_none_bytes: int | None  # ... of the same process
    pool_keep_bytes: int | None  # `ckpt.write.max_pending_bytes`
    pool_peak_incremental_bytes: int | None
    pool_peak_full_bytes: int | None
    restore_rss_bytes: int | None  # deltarec's restore of the follower chain: the rank's peak during it
    dcp_load_rss_bytes: int | None
    follower_store_bytes: int | None  # `follow_store_bytes` at the end: the documented bytes per row x rows
    follower_rss_grown_bytes: int | None  # peak less the resident set once ready, before any row
    follower_anon_grown_bytes: int | None  # its private memory when stopped less once ready...
    follower_file_grown_bytes: int | None  # ... and its mapped files' (libraries loaded on first use)
    compact_s: float | None  # median
    compactions: int
    export_s: float | None
    export_rss_bytes: int | None
    export_file_bytes: int | None
    follower_error: str | None
    restore_other_ranks: int | None = None  # a world size the follower job's checkpoints were also restored into...
    restore_other_s: float | None = None  # ... and how long that took (median over repeats)


def _status_grown(memory: dict[str, Any], key: str) -> int | None:
    """How much `key` of a follower's `proc_status` grew from ready to stopped."""
    ready, end = (memory.get(k) or {} for k in ("status_ready", "status_end"))
    return _extra(end.get(key), ready.get(key))


def _max(xs: list[Any]) -> Any:
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def gather(
    name: str, jobs: dict, peers: list[dict], base: dict, summary: dict, extra: dict, other: list[dict] | None = None
) -> SizeFigures:
    """One size's `SizeFigures` from its jobs' outputs and `build_records`' summary; `other`:
    every rank's output of the restores into another world size, if there were any."""
    inc = summary["deltarec"].get(f"{FOLLOWER}/{ENCODING}", {})
    full = summary["deltarec"].get(f"full/{ENCODING}", {})
    dcp, dasync = summary["peers"].get("dcp.save", {}), summary["peers"].get("dcp.async_save", {})
    run = jobs[(FOLLOWER, ENCODING)]
    deltas = [c for c in run["checkpoints"] if c["committed"] and c["kind"] == "delta"]
    mem_none, mem_inc, mem_full = extra["memory"]["none"], extra["memory"]["incremental"], extra["memory"]["full"]
    # each rank's phases by peer; of the two without checkpoints, the first (the one before the peers':
    # the allocator keeps what a phase freed, ckpt.keep_freed_memory, so later phases start higher)
    phases = {r: {ph["peer"]: ph for ph in reversed(p["phases"])} for r, p in enumerate(peers)}
    restores = [p["restore"] for p in peers]
    fol = run["follower"]
    fm = fol.get("memory") or {}
    applied = fol["applied"]
    exp = extra["export"]
    other_s = other[0]["restore"].get(f"deltarec:{FOLLOWER}-{ENCODING}", {}).get("restore_s", []) if other else []
    return SizeFigures(
        size=name,
        ranks=len(peers),
        model_rows=run["model_rows"],
        model_bytes=sum(m["model_bytes"] for m in mem_none),
        rank_model_bytes=max(m["model_bytes"] for m in mem_none),
        rows_per_interval=median_of([c["rows"] for c in deltas]),
        stall_ms=median_of([c["stall_ms"] for c in deltas]),
        take_ms=median_of([c["take_ms"] for c in deltas if c.get("take_ms") is not None]),
        agree_ms=median_of([c["agree_ms"] for c in deltas if c.get("agree_ms") is not None]),
        stall_full_ms=full.get("stall_ms"),
        dcp_save_stall_ms=dcp.get("stall_ms"),
        dcp_async_stall_ms=dasync.get("stall_ms"),
        bytes_per_interval=inc.get("bytes_written_delta"),
        dcp_bytes_per_interval=dcp.get("bytes_written"),
        capacity_bytes=inc.get("capacity_bytes_final"),
        time_to_commit_s=median_of([c["durable_s"] for c in deltas if c.get("durable_s") is not None]),
        restore_s=inc.get("restore_s"),
        restore_full_s=full.get("restore_s"),
        restore_cold_s=median_of(peers[0]["restore"].get(f"deltarec:{FOLLOWER}-{ENCODING}-cold", {}).get("restore_s", [])),
        build_s=peers[0].get("build_s"),
        dcp_load_s=median_of(peers[0]["restore"].get("dcp.load", {}).get("restore_s", [])),
        samples_per_s_none=base.get("samples_per_s"),
        samples_per_s_incremental=inc.get("samples_per_s"),
        tracker_hook_ms_per_step=extra["tracker"].get("hook_ms_per_step"),
        tracker_scan_ms=extra["tracker"].get("deltarec_listing_ms"),
        find_rows_ms=median_of([c.get("find_rows_ms") for c in deltas if c.get("find_rows_ms") is not None]),
        rss_none_bytes=_max([m["rss_peak_bytes"] for m in mem_none]),
        rss_incremental_late_bytes=_max([m["rss_peak_late_bytes"] for m in mem_inc]),
        rss_incremental_bytes=_max([m["rss_peak_bytes"] for m in mem_inc]),
        rss_full_bytes=_max([m["rss_peak_bytes"] for m in mem_full]),
        anon_extra_end_bytes=_max([_extra(i["rss_anon_end_bytes"], n["rss_anon_end_bytes"]) for i, n in zip(mem_inc, mem_none)]),
        file_extra_end_bytes=_max([_extra(i["rss_file_end_bytes"], n["rss_file_end_bytes"]) for i, n in zip(mem_inc, mem_none)]),
        rss_dcp_save_bytes=_max([ph.get("dcp.save", {}).get("rss_peak_bytes") for ph in phases.values()]),
        rss_dcp_async_bytes=_max([ph.get("dcp.async_save", {}).get("rss_peak_bytes") for ph in phases.values()]),
        rss_phase_none_bytes=_max([ph.get("none", {}).get("rss_peak_bytes") for ph in phases.values()]),
        pool_keep_bytes=_max([m["pool_keep_bytes"] for m in mem_inc]),
        pool_peak_incremental_bytes=_max([m["pool_peak_bytes"] for m in mem_inc]),
        pool_peak_full_bytes=_max([m["pool_peak_bytes"] for m in mem_full]),
        restore_rss_bytes=_max([x for r in restores for x in r.get(f"deltarec:{FOLLOWER}-{ENCODING}", {}).get(RSS, [])]),
        dcp_load_rss_bytes=_max([x for r in restores for x in r.get("dcp.load", {}).get(RSS, [])]),
        follower_store_bytes=applied[-1]["follow_store_bytes"] if applied else None,
        follower_rss_grown_bytes=_extra(fm.get(RSS), fm.get("rss_ready_bytes")),
        follower_anon_grown_bytes=_status_grown(fm, "RssAnon"),
        follower_file_grown_bytes=_status_grown(fm, "RssFile"),
        compact_s=median_of([c["compact_s"] for c in fol["compactions"]]),
        compactions=len(fol["compactions"]),
        export_s=exp.get("export_s"),
        export_rss_bytes=exp.get("rss_peak_bytes"),
        export_file_bytes=exp.get("file_bytes"),
        follower_error=fol.get("error") or exp.get("error"),
        restore_other_ranks=len(other) if other else None,
        restore_other_s=median_of(other_s),
    )


def measure_size(name: str, args: argparse.Namespace, work: Path, prefix: str) -> tuple[SizeFigures, list[Measurement], dict]:
    """Every job of size `name` (module docstring, steps 1-6), each deltarec job on a fresh broker."""
    work.mkdir(parents=True, exist_ok=True)
    given = (
        ("steps", args.steps),
        ("interval", args.interval),
        ("follower_intervals", args.follower_intervals),
        ("repeats", args.repeats),
    )
    s = size_job(name, work, {k: v for k, v in given if v})
    s["overrides"] = [*s["overrides"], *args.set]  # every job's, checkpointed or not
    log(f"size {name}: {s['config']}, checkpoint every {s['interval']} steps")
    with contextlib.ExitStack() as brokers:

        def broker() -> EmbeddedBroker:
            return brokers.enter_context(EmbeddedBroker())

        base = baseline_job(s, work, args.timeout_s)
        jobs: dict[tuple[str, str], dict] = {}
        jobs[("full", ENCODING)] = deltarec_job("full", ENCODING, s, work, broker(), f"{prefix}-{name}", args.timeout_s)
        jobs[(FOLLOWER, ENCODING)] = follower_job(
            ENCODING, s, work, broker(), f"{prefix}-{name}", args.timeout_s, s["follower_intervals"], args.follower_grace_s,
            process=True,
        )  # fmt: skip
        export = export_job(s, jobs[(FOLLOWER, ENCODING)], work, args.timeout_s)
        log(f"size {name}: the tracker's hook and scan")
        tracker = tracker_job(s, args.timeout_s, args.tracker_block)
        build_s = args.restore_build_s  # None: the job's own
        peers = peers_job(s, work, jobs, args.timeout_s, SCALE_PEERS, build_s=build_s)
        # restore into another world size: the 2-rank trend's sizes into 4 would oversubscribe
        # the small ones for nothing; a size of more ranks is restored into the trend's 2
        other: list[dict] | None = None
        if s["ranks"] != BASE_RANKS:
            other = peers_job(s, work, jobs, args.timeout_s, world_size=BASE_RANKS, build_s=build_s)
    ranks = s["ranks"]
    memory = {
        "none": read_memories(work / "no-ckpt" / "side", ranks),
        "full": read_memories(work / f"full-{ENCODING}" / "side", ranks),
        "incremental": read_memories(work / f"incremental-follower-{ENCODING}" / "side", ranks),
    }
    records, summary = build_records(s, jobs, peers, base, common={"size": name})
    extra = {"memory": memory, "export": export, "tracker": tracker}
    fig = gather(name, jobs, peers, base, summary, extra, other)
    phases = [{k: v for k, v in ph.items() if k != "checkpoints"} for p in peers for ph in p["phases"]]
    raw = {"settings": {k: v for k, v in s.items() if k != "repeats"}, "summary": summary, "peer_phases": phases, **extra}
    if other:
        raw["restore_other"] = [p["restore"] for p in other]
    raw["follower_job_checkpoints"] = jobs[(FOLLOWER, ENCODING)]["checkpoints"]  # each with every rank's stall parts
    return fig, list(records.items), raw


# -- per GB, per row, trends -----------------------------------------------------------------------
class Derived(NamedTuple):
    """A figure normalized: `value(f)` of one size, its unit, and what it is divided by."""

    name: str
    unit: str
    value: Callable[[SizeFigures], float | None]
    per: str


def _div(a: Any, b: Any, scale: float = 1.0) -> float | None:
    return a * scale / b if a is not None and b else None


def _extra(a: Any, b: Any) -> int | None:
    return a - b if a is not None and b is not None else None


GB = 1e9
DERIVED = (
    Derived("stall_us_per_row", "us/row", lambda f: _div(f.stall_ms, f.rows_per_interval, 1e3), "changed row"),
    Derived("bytes_per_row", "B/row", lambda f: _div(f.bytes_per_interval, f.rows_per_interval), "changed row"),
    Derived("commit_us_per_row", "us/row", lambda f: _div(f.time_to_commit_s, f.rows_per_interval, 1e6), "changed row"),
    Derived("tracker_hook_ms_per_step", "ms/step", lambda f: f.tracker_hook_ms_per_step, "step (same batch)"),
    Derived("scan_ms_per_m_table_rows", "ms/M rows", lambda f: _div(f.find_rows_ms, f.model_rows, 1e6), "table row"),
    Derived("full_stall_ms_per_gb", "ms/GB", lambda f: _div(f.stall_full_ms, f.model_bytes, GB), "GB"),
    Derived("dcp_save_stall_ms_per_gb", "ms/GB", lambda f: _div(f.dcp_save_stall_ms, f.model_bytes, GB), "GB"),
    Derived("restore_s_per_gb", "s/GB", lambda f: _div(f.restore_s, f.model_bytes, GB), "GB"),
    Derived("dcp_load_s_per_gb", "s/GB", lambda f: _div(f.dcp_load_s, f.model_bytes, GB), "GB"),
    Derived("restore_over_dcp_load", "ratio", lambda f: _div(f.restore_s, f.dcp_load_s), "-"),
    Derived("restore_cold_over_dcp_load", "ratio", lambda f: _div(f.restore_cold_s, f.dcp_load_s), "-"),
    Derived("capacity_per_gb", "B/GB", lambda f: _div(f.capacity_bytes, f.model_bytes, GB), "GB"),
    Derived("compact_s_per_gb", "s/GB", lambda f: _div(f.compact_s, f.model_bytes, GB), "GB"),
    Derived("export_s_per_gb", "s/GB", lambda f: _div(f.export_s, f.model_bytes, GB), "GB"),
    Derived(
        "steady_extra_over_rank_model",
        "fraction",
        lambda f: _div(_extra(f.rss_incremental_late_bytes, f.rss_none_bytes), f.rank_model_bytes),
        "rank's model bytes",
    ),
    Derived(
        "full_extra_over_rank_model",
        "fraction",
        lambda f: _div(_extra(f.rss_full_bytes, f.rss_none_bytes), f.rank_model_bytes),
        "rank's model bytes",
    ),
    Derived(
        "dcp_async_extra_over_rank_model",
        "fraction",
        lambda f: _div(_extra(f.rss_dcp_async_bytes, f.rss_phase_none_bytes), f.rank_model_bytes),
        "rank's model bytes",
    ),
    Derived(
        "follower_rss_over_store",
        "ratio",
        lambda f: _div(f.follower_rss_grown_bytes, f.follower_store_bytes),
        "its documented store bytes",
    ),
    # what the follower holds beside its store: bounded by its buffers (docs/design/follower.md), not the model
    Derived("follower_beyond_store", "B", lambda f: _extra(f.follower_rss_grown_bytes, f.follower_store_bytes), "-"),
)


# per rank: the same model on 2 and on 4 ranks (`full`, `full4`), each figure per row or GB a rank holds
def _rank(total: Any, f: SizeFigures) -> float | None:
    """A rank's share of `total` (rows, bytes) of size `f`."""
    return _div(total, f.ranks)


_SAME_PER_RANK = {"bytes_per_row", "tracker_hook_ms_per_step", "restore_over_dcp_load", "follower_rss_over_store"}
RANK_DERIVED = (
    Derived("stall_us_per_rank_row", "us/row", lambda f: _div(f.stall_ms, _rank(f.rows_per_interval, f), 1e3), "rank's row"),
    Derived("take_us_per_rank_row", "us/row", lambda f: _div(f.take_ms, _rank(f.rows_per_interval, f), 1e3), "rank's row"),
    Derived("agree_ms", "ms", lambda f: f.agree_ms, "-"),
    Derived("commit_us_per_rank_row", "us/row", lambda f: _div(f.time_to_commit_s, _rank(f.rows_per_interval, f), 1e6), "row"),
    Derived("scan_ms_per_m_rank_rows", "ms/M rows", lambda f: _div(f.find_rows_ms, _rank(f.model_rows, f), 1e6), "table row"),
    Derived("full_stall_ms_per_rank_gb", "ms/GB", lambda f: _div(f.stall_full_ms, _rank(f.model_bytes, f), GB), "rank's GB"),
    Derived("restore_s_per_rank_gb", "s/GB", lambda f: _div(f.restore_s, _rank(f.model_bytes, f), GB), "rank's GB"),
    Derived("dcp_load_s_per_rank_gb", "s/GB", lambda f: _div(f.dcp_load_s, _rank(f.model_bytes, f), GB), "rank's GB"),
    Derived("restore_other_ranks_over_own", "ratio", lambda f: _div(f.restore_other_s, f.restore_s), "own world's restore"),
    Derived("samples_per_s_per_rank", "samples/s", lambda f: _div(f.samples_per_s_none, f.ranks), "rank"),
    # already per rank, or the same on any number of ranks: the trend's own
    *(d for d in DERIVED if d.name.endswith("_over_rank_model") or d.name in _SAME_PER_RANK),
)


@dataclass
class RankComparison:
    """One model on the trend's 2 ranks and on more: each per-rank figure on both, and their ratio."""

    model: str  # the 2-rank size
    size: str  # the same model on `ranks` ranks
    ranks: int
    figures: dict[str, tuple[float | None, float | None, float | None]]  # name -> (2 ranks, more, ratio)
    oversubscription: float  # how many times fewer cores per rank than at 2 ranks (a wall time's expected ratio)


def rank_comparisons(figs: list[SizeFigures], cores: int) -> list[RankComparison]:
    """Every size of more ranks than the trend's beside its 2-rank model, when both ran, on a
    machine of `cores` cores."""
    by_name = {f.size: f for f in figs}
    out = []
    for f in figs:
        base = by_name.get(SIZES[f.size].get("compare", ""))
        if f.ranks == BASE_RANKS or base is None:
            continue
        pairs = {d.name: (d.value(base), d.value(f)) for d in RANK_DERIVED}
        share = max(1.0, f.ranks / cores) / max(1.0, base.ranks / cores)
        out.append(RankComparison(base.size, f.size, f.ranks, {k: (a, b, _div(b, a)) for k, (a, b) in pairs.items()}, share))
    return out


def linear_fit(xs: list[float | None], ys: list[float | None]) -> tuple[float, float] | None:
    """Least-squares (slope, intercept) of y against x over the points that have both."""
    pts = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    if not den:
        return None
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / den
    return b, my - b * mx


def slope(xs: list[float], ys: list[float | None]) -> float | None:
    """Least-squares slope of log(y) against log(x) over the sizes that have a positive y."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if y is not None and y > 0 and x > 0]
    fit = linear_fit([p[0] for p in pts], [p[1] for p in pts])
    return fit[0] if fit else None


def trend_sizes(figs: list[SizeFigures]) -> list[int]:
    """Indexes of the sizes on the trend's 2 ranks (a 4-rank size is set beside them, not on it)."""
    return [i for i, f in enumerate(figs) if f.ranks == BASE_RANKS]


def follower_fit(figs: list[SizeFigures]) -> tuple[float, float] | None:
    """The follower's growth against its documented store bytes across the trend's sizes:
    (bytes per store byte, fixed bytes). The first is what the documented bytes per row must
    predict; the second does not grow with the model (libraries, buffers of a fixed size)."""
    sizes = [figs[i] for i in trend_sizes(figs)]
    return linear_fit([f.follower_store_bytes for f in sizes], [f.follower_rss_grown_bytes for f in sizes])


def derived_table(figs: list[SizeFigures]) -> dict[str, list[float | None]]:
    return {d.name: [d.value(f) for f in figs] for d in DERIVED}


@dataclass
class Goal:
    """One of the scale goals over every size measured."""

    goal: str
    value: float | None
    op: str  # "<=", or "~" (within 10% of the target)
    target: float

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return abs(self.value - self.target) <= 0.1 * self.target if self.op == "~" else self.value <= self.target


FLAT = ("stall_us_per_row", "bytes_per_row", "commit_us_per_row", "restore_s_per_gb", "compact_s_per_gb", "export_s_per_gb")
FLAT_SLOPE = 0.1  # a log-log slope at most this: flat within what noise explains (1.0: grows with the table)


def trend(figs: list[SizeFigures], table: dict[str, list[float | None]]) -> tuple[list[float], dict[str, list[float | None]]]:
    """The trend against model size: the model bytes of the sizes on the trend's 2 ranks, and
    each derived figure at those sizes."""
    keep = trend_sizes(figs)
    return [float(figs[i].model_bytes) for i in keep], {k: [v[i] for i in keep] for k, v in table.items()}


def goals(figs: list[SizeFigures], table: dict[str, list[float | None]]) -> list[Goal]:
    """The scale goals: flat or falling per-row and per-GB costs from the smallest to the
    largest model (the 2-rank sizes), restore <= 0.5x dcp.load at each size, the steady
    state's extra memory <= 25% of a rank's model, a full checkpoint's <= one copy of its rows,
    the follower within 10% of its documented bytes (these at every size and rank count)."""
    xs, along = trend(figs, table)
    out = [Goal(f"{name}: flat or falling (log-log slope)", slope(xs, along[name]), "<=", FLAT_SLOPE) for name in FLAT]
    out += [
        Goal("restore / dcp.load, worst size", _max(table["restore_over_dcp_load"]), "<=", 0.5),
        Goal("steady extra host memory / rank's model, worst size", _max(table["steady_extra_over_rank_model"]), "<=", 0.25),
        Goal("full checkpoint's extra host memory / rank's rows, worst", _max(table["full_extra_over_rank_model"]), "<=", 1.0),
    ]
    ratios = [r for r in table["follower_rss_over_store"] if r is not None]
    worst = max(ratios, key=lambda r: abs(r - 1)) if ratios else None
    out.append(Goal("follower memory / documented store bytes, worst size", worst, "~", 1.0))
    fit = follower_fit(figs)
    out.append(Goal("follower memory per documented store byte, beyond a fixed part (fit over sizes)", fit and fit[0], "~", 1.0))
    return out


# -- output ----------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def print_tables(
    figs: list[SizeFigures], table: dict[str, list[float | None]], tg: list[Goal], ranks: list[RankComparison]
) -> None:
    head = "| figure | " + " | ".join(f.size for f in figs) + " | slope (2-rank sizes) |"
    print(head)
    print("|" + " --- |" * (len(figs) + 2))
    for fld in fields(SizeFigures)[1:]:
        print(f"| {fld.name} | " + " | ".join(_fmt(getattr(f, fld.name)) for f in figs) + " | |")
    xs, along = trend(figs, table)
    for d in DERIVED:
        print(f"| {d.name} ({d.unit}) | " + " | ".join(_fmt(v) for v in table[d.name]) + f" | {_fmt(slope(xs, along[d.name]))} |")
    for c in ranks:
        print(f"\n{c.size}: {c.ranks} ranks have {c.oversubscription:g}x fewer cores each than {c.model}'s 2 (wall times)")
        print(f"| per rank | {c.model} (2 ranks) | {c.size} ({c.ranks} ranks) | ratio |\n| --- | --- | --- | --- |")
        for name, (a, b, r) in c.figures.items():
            print(f"| {name} | {_fmt(a)} | {_fmt(b)} | {_fmt(r)} |")
    for g in tg:
        state = "met" if g.met else "NOT met" if g.met is not None else "not measured"
        print(f"target: {g.goal} {g.op} {g.target}: {_fmt(g.value)} ({state})")


def plot(figs: list[SizeFigures], table: dict[str, list[float | None]], img: Path) -> list[str]:
    """docs/img/scale_costs.png: each derived figure against model size, log-log (the sizes
    on the trend's 2 ranks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    model_bytes, table = trend(figs, table)
    xs = [x / GB for x in model_bytes]
    names = [d for d in DERIVED if any(v is not None and v > 0 for v in table[d.name])]
    cols = 4
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, d in zip(axes.flat, names):
        pts = [(x, v) for x, v in zip(xs, table[d.name]) if v is not None and v > 0]
        ax.loglog([p[0] for p in pts], [p[1] for p in pts], "o-")
        ax.set_title(d.name, fontsize=9)
        ax.set_xlabel("model GB (fp32 rows + optimizer)", fontsize=8)
        ax.set_ylabel(d.unit, fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.tight_layout()
    path = img / "scale_costs.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [str(path)]


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="quick,mid,full,kaggle", help=f"comma-separated, smallest first (of {', '.join(SIZES)})")
    p.add_argument("--out", type=Path, help="write the JSON document here")
    p.add_argument("--plots", type=Path, help="write scale_costs.png into this directory")
    p.add_argument("--keep", type=Path, help="keep run directories here (default: a temporary directory, removed per size)")
    p.add_argument("--steps", type=int, help="override every size's steps (peer phases, the full job)")
    p.add_argument("--interval", type=int, help="override every size's checkpoint interval (steps)")
    p.add_argument("--follower-intervals", type=int, help="override every size's checkpoints of the follower job")
    p.add_argument("--follower-grace-s", type=float, default=300, help="how long the follower may take to catch up")
    p.add_argument("--repeats", type=int, help="override every size's rounds of restores (default 2; the median is reported)")
    p.add_argument(
        "--tracker-block",
        type=int,
        default=10,
        help="the tracker's measurement: steps per block of its rotation and of its warm-up (twice that between its snapshots)",
    )
    p.add_argument(
        "--restore-build-s",
        type=float,
        help="seconds each deltarec restore keeps the rank busy, standing in for a restarted job's model build, "
        "before it restores (default: the job's own build, measured; 0: no wait)",
    )
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a config override for every job of every size (e.g. ckpt.capture.copy_on_write=true); repeatable",
    )  # fmt: skip
    return p


def run(argv: list[str], prog: str = "python -m bench.run --suite scale") -> dict[str, Any]:
    """Measure every size, print the tables and goals, (`--out`) write the document; return it."""
    args = parser(prog).parse_args(argv)
    names = [n.strip() for n in args.sizes.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        raise SystemExit(f"{prog}: unknown size {unknown[0]!r} (sizes: {', '.join(SIZES)})")
    started = time.perf_counter()
    machine = machine_info()
    prefix = f"bench-scale-{uuid.uuid4().hex[:8]}"
    figs: list[SizeFigures] = []
    records: list[Measurement] = []
    raw: dict[str, Any] = {}
    for n in names:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"bench-scale-{n}-") as tmp:  # removed per size: the disk holds one
            work = (args.keep / prefix / n) if args.keep else Path(tmp)
            fig, recs, raw[n] = measure_size(n, args, work, prefix)
        raw[n]["wall_s"] = time.perf_counter() - t0
        if args.out:  # each size as it ends: a later size's failure loses none of it
            part = args.out.with_suffix(f".{n}.json")
            part.write_text(json.dumps({"size": asdict(fig), "raw": raw[n]}, indent=1, default=str) + "\n")
        figs.append(fig)
        records += recs
        log(f"size {n}: {fig.model_rows:,} rows, {fig.model_bytes / GB:.2f} GB, {raw[n]['wall_s']:.0f} s")
    machine["loadavg_end"] = loadavg()
    table = derived_table(figs)
    tg = goals(figs, table)
    ranks = rank_comparisons(figs, os.cpu_count() or 1)
    fit = follower_fit(figs)
    if fit:
        records.append(Measurement("follower_grown_per_store_byte", fit[0], "ratio"))
        records.append(Measurement("follower_fixed_bytes", fit[1], "B"))
    xs, along = trend(figs, table)
    for f in figs:
        for fld in fields(SizeFigures)[1:]:
            v = getattr(f, fld.name)
            if isinstance(v, int | float) and not isinstance(v, bool):
                records.append(Measurement(fld.name, v, unit_of(fld.name), labels={"size": f.size}))
    for d in DERIVED:
        for f, v in zip(figs, table[d.name]):
            records.append(Measurement(d.name, v, d.unit, labels={"size": f.size}))
        records.append(Measurement(f"{d.name}_slope", slope(xs, along[d.name]), "log-log slope"))
    for c in ranks:
        for name, (_, _, r) in c.figures.items():
            records.append(Measurement(f"{name}_ranks_ratio", r, "ratio", labels={"size": c.size, "over": c.model}))
    result: dict[str, Any] = {
        **document_head("scale", prog, argv, machine),
        "sizes": [asdict(f) for f in figs],
        "derived": table,
        "slopes": {d.name: slope(xs, along[d.name]) for d in DERIVED},
        "ranks": [asdict(c) for c in ranks],
        "targets": [{**asdict(g), "met": g.met} for g in tg],
        "follower_fit": dict(zip(("per_store_byte", "fixed_bytes"), fit)) if fit else None,
        "raw": raw,
        "records": records,
    }
    if args.plots:
        result["plots"] = plot(figs, table, args.plots)
    result["wall_s"] = time.perf_counter() - started
    print_tables(figs, table, tg, ranks)
    if fit:
        print(f"follower: {fit[0]:.3g} bytes per documented store byte + {fit[1] / 1e6:.0f} MB fixed (fit over the sizes)")
    print(f"wall {result['wall_s']:.0f} s")
    if args.out:
        args.out.write_text(json.dumps({**result, "records": [m.flat() for m in records]}, indent=1, default=str) + "\n")
    return result


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """Every figure: each job's records (labelled by size), each size's figures and derived
    figures, each trend's slope."""
    return list(result["records"])


def main(argv: list[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv, "python -m bench.scale")
    return 0


if __name__ == "__main__":
    run_main(main)
