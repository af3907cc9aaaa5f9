"""Continuous checkpointing on the quickstart model, per checkpoint, against plain baselines.

    python -m bench.run --suite checkpoint [--out results.json] [--steps 400] [--interval 50] [--repeats 5]
                        [--quant adaptive4 | --expected-restores N] [key=value ...]

Everything runs in one invocation against one embedded broker (Tansu, `launch.broker`),
so ratios compare figures taken on the same machine minutes apart:

1. Three training runs of `--config` (quickstart: 2 CPU gloo ranks, spawned like the tests
   do, `launch.ranks.spawn_ranks`): one without checkpoints (training throughput baseline),
   two with checkpoints every `--interval` steps to the broker,
   policy `--policy`: one with fp32 rows, one quantized (`--quant`, or Check-N-Run's bit
   width for `--expected-restores`). Per checkpoint, from `<run_dir>/metrics.jsonl`: rows,
   fraction of the model's rows (rows of every shard, a column-wise table counted once per
   column shard, as the tracker does), bytes, stall, write time, encoding, durable time.
   Each rank runs through `bench.ckpt_rank`, which adds per rank, from the checkpoint
   checkpointer's public stats: the stall's parts (agreement, `SnapshotTaker.take`, the rest)
   and the step at which the outcome was known, and a bare `index_select` / `clone` of
   exactly the same rows (timed after the checkpoint, so it adds nothing to the stall).
2. `bench.ckpt_probe` (2 ranks again, the same job built in-process): restore of the
   newest checkpoint against `dcp.save`/`dcp.load` of the same sharded model; take vs bare
   copy repeated; deltarec's writer path against a raw confluent-kafka producer sending the
   same frames to the same broker.

Prints a JSON summary (`summary`: the headline figures and ratios, medians) and writes it
with `--out`. A benchmark, not a test: nothing is asserted about the figures. About 3
minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from statistics import median
from typing import Any

from bench.common import Measurement, config_path, document_head, loadavg, log, machine_info, median_of, ratio, rounded, scalars
from common.process import run_main


# -- 1. training runs ----------------------------------------------------------------------
def train_run(label: str, extra: list[str], args: argparse.Namespace, work: Path, bootstrap: str, prefix: str) -> dict[str, Any]:
    """One checkpointing training run (every rank through `bench.ckpt_rank`): its checkpoints
    from rank 0's metrics.jsonl joined with what every rank measured of each."""
    from bench.ckpt_rank import checkpoint_rows, read_sides
    from launch.ranks import read_metrics, spawn_ranks

    tmp = work / label
    tmp.mkdir(parents=True, exist_ok=True)  # a follower process beside the job may have made its run dir
    run_id = f"{prefix}-{label}"
    overrides = [
        "ckpt.enabled=true",
        f"ckpt.sink.bootstrap_servers={bootstrap}",
        f"ckpt.run_id={run_id}",
        f"ckpt.schedule.policy={args.policy}",
        f"ckpt.schedule.interval_steps={args.interval}",
        f"train.steps={args.steps}",
        "train.eval_every=0",
        "train.eval_batches=0",
        f"train.log_every={args.interval}",
        *extra,
        *args.overrides,
    ]
    every = f"every {args.interval} steps" if args.interval else "by time (ckpt.schedule.interval_s)"
    log(f"training run {label}: {args.steps} steps, checkpoints {every}, {' '.join(extra) or 'fp32'}")
    t = time.perf_counter()
    spawn_ranks(
        args.config,
        overrides,
        tmp,
        world_size=args.ranks,
        timeout_s=args.timeout_s,
        module="bench.ckpt_rank",
        extra_args=["--side", str(tmp / "side")],
    )
    wall = time.perf_counter() - t
    metrics = read_metrics(tmp / "run")
    side = read_sides(tmp / "side", args.ranks)
    total_rows = sum({r: p.rank_total_rows for per in side.values() for r, p in per.items()}.values())
    rows = checkpoint_rows(metrics, side)
    rates = [m["samples_per_s"] for m in metrics if "samples_per_s" in m]
    return {
        "run_id": run_id,
        "overrides": overrides,
        "wall_s": wall,
        "model_rows": total_rows,
        "samples_per_s_median": median_of(rates[1:] or rates),
        "checkpoints": rows,
        "cpu": read_cpus(tmp / "side", args.ranks),
    }


def read_cpus(side: Path, ranks: int) -> list[dict[str, Any]]:
    """Every rank's `bench.ckpt_rank.RankCpu`, as dicts, in rank order."""
    from bench.ckpt_rank import read_cpu

    return [asdict(read_cpu(side / f"cpu_rank{r}.json")) for r in range(ranks)]


def baseline_run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The same job without checkpointing: training throughput to compare the runs with."""
    from launch.ranks import read_metrics, spawn_ranks

    tmp = work / "no-ckpt"
    tmp.mkdir(parents=True)
    log(f"training run without checkpoints: {args.steps} steps")
    overrides = [
        f"train.steps={args.steps}",
        "train.eval_every=0",
        "train.eval_batches=0",
        f"train.log_every={args.interval}",
        *args.overrides,
    ]
    t = time.perf_counter()
    spawn_ranks(
        args.config,
        ["ckpt.enabled=false", *overrides],
        tmp,
        world_size=args.ranks,
        timeout_s=args.timeout_s,
        module="bench.ckpt_rank",
        extra_args=["--side", str(tmp / "side")],
    )
    wall = time.perf_counter() - t
    rates = [m["samples_per_s"] for m in read_metrics(tmp / "run") if "samples_per_s" in m]
    return {"wall_s": wall, "samples_per_s_median": median_of(rates[1:] or rates), "cpu": read_cpus(tmp / "side", args.ranks)}


# per-checkpoint fields summarized as `<field>_median` for full and delta checkpoints
MEDIAN_FIELDS = (
    "fraction_of_rows",
    "bytes",
    "bytes_per_row",
    "stall_ms",
    "take_ms",
    "agree_ms",
    "dense_ms",
    "other_ms",
    "bare_copy_ms",
    "stall_over_bare",
    "take_over_bare",
    "write_s",
    "write_MBps",
)


def summarize_run(run: dict[str, Any]) -> dict[str, Any]:
    ck = [c for c in run["checkpoints"] if c["committed"]]
    out: dict[str, Any] = {"checkpoints": len(run["checkpoints"]), "committed": len(ck)}
    for kind in ("full", "delta"):
        cs = [c for c in ck if c["kind"] == kind]
        if not cs:
            continue
        out[kind] = {
            "count": len(cs),
            "fraction_of_rows_range": [min(c["fraction_of_rows"] for c in cs), max(c["fraction_of_rows"] for c in cs)],
            **{f"{key}_median": median_of([c[key] for c in cs]) for key in MEDIAN_FIELDS},
        }
    out["fraction_changed_per_interval_median"] = median_of(
        [c["fraction_changed_since_last"] for c in ck if c["kind"] == "delta"]
    )
    out["bytes_total"] = sum(c["bytes"] for c in ck)
    return out


# -- 2. probe ---------------------------------------------------------------------------------
def probe(args: argparse.Namespace, work: Path, bootstrap: str, fp32: dict, quant: dict, quant_extra: list[str]) -> list[dict]:
    from launch.ranks import spawn_ranks

    tmp = work / "probe"
    tmp.mkdir(parents=True)
    extra = [
        "--fp32-run",
        fp32["run_id"],
        "--quant-run",
        quant["run_id"],
        "--out-dir",
        str(tmp),
        "--dcp-dir",
        str(tmp / "dcp"),
        "--repeats",
        str(args.repeats),
        "--interval",
        str(args.interval),
    ]
    for ov in quant_extra:
        extra += ["--quant-override", ov]
    log("probe: restore vs dcp.load, take vs bare copy, writer vs raw producer")
    spawn_ranks(
        args.config,
        [f"ckpt.sink.bootstrap_servers={bootstrap}", *args.overrides],
        tmp,
        world_size=args.ranks,
        timeout_s=args.timeout_s,
        module="bench.ckpt_probe",
        extra_args=extra,
    )
    return [json.loads((tmp / f"probe_rank{r}.json").read_text()) for r in range(args.ranks)]


def summarize_probe(ranks: list[dict]) -> dict[str, Any]:
    r0 = ranks[0]["restore"]  # timed between barriers: the same on every rank
    restore = {
        "checkpoint": {k: r0["latest"][k] for k in ("checkpoint_id", "step", "chain", "rows", "bytes")},
        "deltarec_restore_s_median": median_of(r0["restore_s"]),
        "deltarec_first_restore_s": r0["first_restore_s"],
        "deltarec_rows_part_s_median": median_of(r0["rows_s"]),
        "deltarec_kafka_poll_s_median": max(median_of(r["restore"]["kafka_poll_s"]) for r in ranks),
        "dcp_load_s_median": median_of(r0["dcp_load_s"]),
        "restore_over_dcp_load": ratio(median_of(r0["restore_s"]), median_of(r0["dcp_load_s"])),
        "raw_kafka_read_s_median": median_of(r0["raw_kafka_read_s"]),
        "raw_kafka_read_bytes": sum(r["restore"]["raw_kafka_bytes"] for r in ranks),
        "restore_over_raw_kafka_read": ratio(median_of(r0["restore_s"]), median_of(r0["raw_kafka_read_s"])),
        "dcp_save_s_median": median_of(r0["dcp_save_s"]),
        "dcp_bytes_on_disk": r0["dcp_bytes_on_disk"],
        "restore_s_all": r0["restore_s"],
        "dcp_load_s_all": r0["dcp_load_s"],
        "raw_kafka_read_s_all": r0["raw_kafka_read_s"],
        "same_state_after_each_load": all(r["restore"]["same_state_after_each"] for r in ranks),
    }
    if "other_chain" in r0:
        d = r0["other_chain"]
        restore["other_chain"] = {
            "checkpoint_id": d["checkpoint_id"],
            "chain": d["chain"],
            "rows": d["rows"],
            "bytes": d["bytes"],
            "restore_s_median": median_of(d["restore_s"]),
            "rows_part_s_median": median_of(d["rows_s"]),
            "over_dcp_load": ratio(median_of(d["restore_s"]), median_of(r0["dcp_load_s"])),
        }
    q = r0["quant"]
    restore["quantized"] = {
        "checkpoint_id": q["checkpoint_id"],
        "chain": q["chain"],
        "bytes": q["bytes"],
        "restore_s_median": median_of(q["restore_s"]),
        "rows_part_s_median": median_of(q["rows_s"]),
        "over_dcp_load": ratio(median_of(q["restore_s"]), median_of(r0["dcp_load_s"])),
    }
    if all("weights_rel_l2_error_sq_parts" in r["restore"]["quant"] for r in ranks):
        num = sum(r["restore"]["quant"]["weights_rel_l2_error_sq_parts"][0] for r in ranks)
        den = sum(r["restore"]["quant"]["weights_rel_l2_error_sq_parts"][1] for r in ranks)
        restore["quantized"]["weights_rel_l2_error_vs_fp32"] = (num / den) ** 0.5 if den else None

    tb: dict[str, Any] = {}
    for kind in ("delta", "full"):
        takes = [r["take_vs_bare"][f"take_{kind}_ms"] for r in ranks]
        bares = [r["take_vs_bare"][f"bare_{kind}_ms"] for r in ranks]
        paired = [median(t / b for t, b in zip(ts, bs)) for ts, bs in zip(takes, bares)]  # per rank, per round
        tb[kind] = {
            "rows": sum(r["take_vs_bare"][f"{kind}_rows"] for r in ranks),
            "bytes": sum(r["take_vs_bare"][f"{kind}_bytes"] for r in ranks),
            "take_ms_median": max(median(t) for t in takes),
            "bare_copy_ms_median": max(median(b) for b in bares),
            "take_over_bare_per_rank": paired,
            "take_over_bare": max(paired),
            "find_rows_ms_median": max(median(r["take_vs_bare"]["find_delta_ms"]) for r in ranks) if kind == "delta" else 0.0,
            "take_ms_per_rank": takes,
            "bare_ms_per_rank": bares,
        }

    writer = []
    for i, case in enumerate(ranks[0]["writer"]):
        per = [r["writer"][i] for r in ranks]
        nbytes = sum(p["bytes"] for p in per)
        rounds = len(case["writer_s"])
        w = [max(p["writer_s"][k] for p in per) for k in range(rounds)]  # both ranks wrote at once
        raw = [max(p["raw_s"][k] for p in per) for k in range(rounds)]
        enc = [max(p["writer_s"][k] - p["sink_s"][k] for p in per) for k in range(rounds)]
        in_sink = [max(p["sink_s"][k] for p in per) for k in range(rounds)]
        snap_bytes = sum(p["snapshot_bytes"] for p in per)
        writer.append(
            {
                "snapshot": case["snapshot"],
                "codec": case["codec"],
                "rows": sum(p["rows"] for p in per),
                "bytes": nbytes,
                "snapshot_bytes": snap_bytes,
                "frames": sum(p["frames"] for p in per),
                "writer_MBps_median": nbytes / median(w) / 1e6,
                "raw_producer_MBps_median": nbytes / median(raw) / 1e6,
                "writer_over_raw_throughput": median_of([b / a for a, b in zip(w, raw)]),
                "writer_snapshot_MBps_median": snap_bytes / median(w) / 1e6,
                "writer_s_median": median(w),
                "raw_s_median": median(raw),
                "encode_frame_s_median": median(enc),
                # what the writer spends besides encoding, against the raw producer (per rank, then the slower)
                "sink_s_median": median(in_sink),
                "sink_part_over_raw": median_of([a / b for a, b in zip(in_sink, raw)]),
                "writer_s_all": w,
                "raw_s_all": raw,
            }
        )
    return {"restore": restore, "take_vs_bare": tb, "writer_vs_raw": writer}


# -- main -----------------------------------------------------------------------------------------
def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--steps", type=int, default=400, help="training steps per run")
    p.add_argument("--interval", type=int, default=50, help="ckpt.schedule.interval_steps")
    p.add_argument("--policy", default="intermittent_diff")
    p.add_argument("--quant", default="adaptive4", help="ckpt.encoding.weights of the quantized run")
    p.add_argument(
        "--expected-restores",
        type=int,
        default=0,
        help="> 0: the quantized run uses ckpt.encoding.expected_restores=N instead of --quant",
    )
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="timed rounds of each probe comparison")
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--out", type=Path)
    p.add_argument("--keep", type=Path, help="keep run directories here (default: a temporary directory)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every job")
    return p


def run(argv: list[str], prog: str = "python -m bench.run --suite checkpoint") -> dict[str, Any]:
    """Measure, print and (`--out`) write the result document; return it."""
    args = parser(prog).parse_args(argv)
    args.config = config_path(args.config)
    from launch.broker import EmbeddedBroker

    started = time.perf_counter()
    machine = machine_info()
    if args.expected_restores > 0:
        quant_extra, qlabel = [f"ckpt.encoding.expected_restores={args.expected_restores}"], f"restores{args.expected_restores}"
    else:
        quant_extra, qlabel = [f"ckpt.encoding.weights={args.quant}"], args.quant
    prefix = f"ckptbench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmpdir, EmbeddedBroker() as broker:
        work = args.keep / prefix if args.keep else Path(tmpdir)
        work.mkdir(parents=True, exist_ok=True)
        log(f"broker {broker.bootstrap}, work dir {work}")
        base = baseline_run(args, work)
        fp32 = train_run("fp32", [], args, work, broker.bootstrap, prefix)
        quant = train_run(qlabel, quant_extra, args, work, broker.bootstrap, prefix)
        probe_ranks = probe(args, work, broker.bootstrap, fp32, quant, quant_extra)
    machine["loadavg_end"] = loadavg()
    pr = summarize_probe(probe_ranks)
    s32, sq = summarize_run(fp32), summarize_run(quant)
    d32, f32 = s32.get("delta", {}), s32.get("full", {})
    rs = pr["restore"]
    links = lambda chain: f"{len(chain)}link"  # noqa: E731
    from trainer.config import load_config

    cfg = load_config(args.config, args.overrides, check_data=False)
    summary = {
        "model_rows": fp32["model_rows"],  # rows of every model-parallel shard (what the tracker counts)
        "table_rows": sum(t.num_embeddings for t in cfg.model.tables if cfg.sharding.type_of(t) != "data_parallel"),
        # 1. rows and bytes (fp32 run; the quantized run has the same rows)
        "fraction_of_rows_per_delta_median": d32.get("fraction_of_rows_median"),
        "fraction_changed_per_interval_median": s32["fraction_changed_per_interval_median"],
        "bytes_full_fp32": f32.get("bytes_median"),
        "bytes_delta_fp32_median": d32.get("bytes_median"),
        f"bytes_full_{qlabel}": sq.get("full", {}).get("bytes_median"),
        f"bytes_delta_{qlabel}_median": sq.get("delta", {}).get("bytes_median"),
        f"bytes_per_row_{qlabel}_over_fp32": ratio(
            sq.get("full", {}).get("bytes_per_row_median"), f32.get("bytes_per_row_median")
        ),
        # 2. stall (training thread) against a bare copy of the same rows
        "stall_ms_delta_median": d32.get("stall_ms_median"),
        "stall_ms_full_median": f32.get("stall_ms_median"),
        "take_ms_delta_median": d32.get("take_ms_median"),
        "bare_copy_ms_delta_median": d32.get("bare_copy_ms_median"),
        "bare_copy_ms_full_median": f32.get("bare_copy_ms_median"),
        "stall_over_bare_delta_median": d32.get("stall_over_bare_median"),
        "stall_over_bare_full_median": f32.get("stall_over_bare_median"),
        "take_over_bare_delta_median": d32.get("take_over_bare_median"),
        "take_over_bare_full_median": f32.get("take_over_bare_median"),
        "take_over_bare_delta_controlled": pr["take_vs_bare"]["delta"]["take_over_bare"],
        "find_rows_ms_delta_controlled": pr["take_vs_bare"]["delta"]["find_rows_ms_median"],
        "take_over_bare_full_controlled": pr["take_vs_bare"]["full"]["take_over_bare"],
        # 3. writer against a raw producer of the same bytes
        **{f"writer_over_raw_{w['snapshot']}_{w['codec']}": w["writer_over_raw_throughput"] for w in pr["writer_vs_raw"]},
        **{f"writer_MBps_{w['snapshot']}_{w['codec']}": w["writer_MBps_median"] for w in pr["writer_vs_raw"]},
        **{f"raw_producer_MBps_{w['snapshot']}_{w['codec']}": w["raw_producer_MBps_median"] for w in pr["writer_vs_raw"]},
        "writer_MBps_in_training_fp32_median": median_of([c["write_MBps"] for c in fp32["checkpoints"] if c["committed"]]),
        f"writer_MBps_in_training_{qlabel}_median": median_of([c["write_MBps"] for c in quant["checkpoints"] if c["committed"]]),
        # 4. restore against dcp.load of the same sharded state
        "restore_chain": rs["checkpoint"]["chain"],
        "restore_s_median": rs["deltarec_restore_s_median"],
        "dcp_load_s_median": rs["dcp_load_s_median"],
        "restore_over_dcp_load": rs["restore_over_dcp_load"],
        "restore_over_raw_kafka_read": rs["restore_over_raw_kafka_read"],
        f"restore_{qlabel}_over_dcp_load": rs["quantized"]["over_dcp_load"],
        "dcp_save_s_median": rs["dcp_save_s_median"],
        # training throughput (samples/s, median of the windows after the first)
        "train_samples_per_s_no_ckpt": base["samples_per_s_median"],
        "train_samples_per_s_fp32": fp32["samples_per_s_median"],
        f"train_samples_per_s_{qlabel}": quant["samples_per_s_median"],
    }
    if "other_chain" in rs:
        summary[f"restore_{links(rs['other_chain']['chain'])}_chain_over_dcp_load"] = rs["other_chain"]["over_dcp_load"]
    result = {
        **document_head("checkpoint", prog, argv, machine),
        "config": args.config,
        "settings": {
            "ranks": args.ranks,
            "steps": args.steps,
            "interval_steps": args.interval,
            "policy": args.policy,
            "quantized": quant_extra[0],
            "quant_label": qlabel,
            "repeats": args.repeats,
            "overrides": args.overrides,
        },
        "wall_s": time.perf_counter() - started,
        "summary": summary,
        "runs": {"no_ckpt": base, "fp32": {**fp32, "summary": s32}, qlabel: {**quant, "summary": sq}},
        "probe": pr,
    }
    result = rounded(result)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return result


# per-checkpoint fields written as records (labels: run, checkpoint, step, kind)
RECORD_FIELDS = (
    "rows",
    "fraction_of_rows",
    "bytes",
    "stall_ms",
    "agree_ms",
    "take_ms",
    "dense_ms",
    "other_ms",
    "find_rows_ms",
    "bare_copy_ms",
    "stall_over_bare",
    "take_over_bare",
    "write_s",
    "write_MBps",
    "durable_s",
    "committed",
    "committed_at_step",
    "durable_at_step",
)


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """The headline summary, then every checkpoint of both checkpointing runs."""
    settings = result["settings"]
    out = scalars(result["summary"], {"policy": settings["policy"], "quantized": settings["quantized"]})
    for label in ("fp32", settings["quant_label"]):
        for c in result["runs"][label]["checkpoints"]:
            labels = {
                "run": label,
                "policy": settings["policy"],
                "ckpt": c["ckpt_id"],
                "step": c["step"],
                "kind": c["kind"],
                "codec": c["codec"],
            }
            out += scalars({k: c[k] for k in RECORD_FIELDS}, labels, {"committed_at_step": "step", "durable_at_step": "step"})
    return out


def main(argv: list[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv, "python -m bench.ckpt_bench")
    return 0


if __name__ == "__main__":
    run_main(main)
