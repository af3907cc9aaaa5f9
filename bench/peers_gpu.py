"""deltarec against DCP on one GPU: suite `gpu-peers`, world size 1.

    python -m bench.run --suite gpu-peers [--sizes full,big] [--device auto|cuda|cpu]
                        [--interval-s 3 | --interval STEPS] [--checkpoints 3] [--repeats 2]
                        [--out F.jsonl] [--keep DIR] [--timeout-s S] [key=value ...]

The peers suites `quick` and `full` spawn 2 gloo ranks, and nccl refuses two ranks on one GPU.
This suite runs the comparison as one process per size (world size 1: every table sharded
table-wise onto the one device; nccl on a GPU, gloo on the CPU), which does everything on the
model it builds (`bench.peers_gpu_rank`, which says why): a probe of the step time
(the interval is `--interval-s` of steps unless `--interval` says), then, each from the model as
built and with a new training loop, through `Trainer.fit`, `--checkpoints` checkpoints each:

1. the job without checkpoints: the throughput baseline of every other phase;
2. deltarec, `intermittent_diff` (the default policy) and `incremental`, each with fp32 and
   adaptive4 rows: the trainer's checkpointer (`bench.ckpt_rank.train`), checkpointing
   to one embedded broker (Tansu, memory storage) shared by every job of the invocation;
3. `dcp.save`, and `dcp.async_save` with its state staged in pinned host memory
   (`bench.peers_rank.pinned_stager`);
4. restore to training-ready, `--repeats` rounds: `dcp.load` of the newest `dcp.save`
   checkpoint against deltarec's `Checkpointer.restore` of each job's newest checkpoint
   (into the model as built, as a restarted job restores; an fp32 job's checked to give back
   the state it ended with).

Sizes: `full` is the full suite's model (26 tables, Criteo Kaggle's cardinalities capped at
1M rows, dim 64: 5.57M rows, 1.43 GB of fp32 embeddings); `big` is Criteo Kaggle's real
cardinalities at dim 80 (33.76M rows, 10.8 GB); `tiny` (the CPU variant, and the smoke test's)
caps them at 2,000 rows at dim 16.

Metrics per size (records as `bench.peers`'s, docs/peers.md, each labelled with its `size`):
stall (deltarec: the checkpointer's; dcp.async_save: the part of the save that blocks training),
seconds from the checkpoint step to durable (deltarec: its COMMIT; dcp.save: its duration;
dcp.async_save: until its future completed), bytes per interval, capacity (bytes the newest
restorable checkpoint needs), restore time, throughput overhead against the job without
checkpoints. The goals (stall <= 0.1x dcp.async_save's blocking time, restore <= dcp.load,
stretch 0.5x, durable no later than dcp.async_save) are reported, never asserted.

`--out` is a JSON-lines file written as the run goes: a `start` line, each phase's line as it
finishes (`phase`, `error`, `restore`: written by the rank), and per size a `size_done` line
with its records, summary and goals; `end` last. A run killed at its limit keeps every line
written before. Progress lines go to stderr with the time of day.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Measurement, document_head, loadavg, log, machine_info, ratio
from bench.peers import CRITEO_KAGGLE, build_records, full_config, table
from common.process import run_main

POLICIES = ("intermittent_diff", "incremental")
ENCODINGS = ("fp32", "adaptive4")
PEERS = ("dcp.save", "dcp.async_save")

# cap: rows per table at most; batch: samples per step; bare_repeats: bare copies per checkpoint
# (none on `big`: a copy of every row of a full checkpoint would pin another ~16 GB of host memory)
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"cap": 2_000, "dim": 16, "batch": 256, "bare_repeats": 1},
    "full": {"cap": 1_000_000, "dim": 64, "batch": 2048, "bare_repeats": 1},
    "big": {"cap": None, "dim": 80, "batch": 2048, "bare_repeats": 0},
}
# a rough model of the time, for the estimate printed at the start (not a measurement)
STARTUP_S = {"cuda": 20.0, "cpu": 12.0}  # imports, the device, the process group, the sharded model
INIT_S_PER_VALUE = 12e-9  # `sharding.row_init` generates every row's values on one host core
STEP_S_GUESS = {"cuda": 0.03, "cpu": 0.02}  # only with --interval (else the interval is --interval-s)
JOB_OVERHEAD_S = 4.0  # a deltarec job's checkpointer set-up, the writer's last flush, reading back its figures
DISK_BPS, STAGE_BPS = 1.5e9, 8e9  # dcp's save and load through the page cache; staging into pinned memory


def size_rows(name: str) -> tuple[int, int]:
    """(rows, dim) of a size's model."""
    s = SIZES[name]
    return sum(n if s["cap"] is None else min(n, s["cap"]) for n in CRITEO_KAGGLE), s["dim"]


def size_config(name: str, path: Path) -> tuple[Path, list[str]]:
    """A size's job config (`bench.peers.full_config`: quickstart's job with Criteo Kaggle's 26
    tables, table-wise) and the overrides its jobs run with."""
    s = SIZES[name]
    rows, dim = size_rows(name)
    cap = s["cap"] if s["cap"] is not None else max(CRITEO_KAGGLE)
    # a full snapshot of every row must fit the checkpointer's budget for pending snapshots (weights,
    # row-wise momentum, row ids), which at world size 1 holds the whole model
    pending = int(rows * (dim * 4 + 16) * 1.25) + (1 << 28)
    return full_config(path, cap, dim), [f"data.batch_size={s['batch']}", f"ckpt.write.max_pending_bytes={pending}"]


def estimate_s(name: str, device: str, args: argparse.Namespace, interval_s: float | None = None) -> float:
    """Seconds one size should take (the printed estimate; its model is `STARTUP_S` & co);
    `interval_s`: the interval's seconds once the probe has measured them."""
    rows, dim = size_rows(name)
    phases = 1 + len(POLICIES) * len(args.encodings) + len(PEERS)
    if interval_s is None:
        interval_s = args.interval * STEP_S_GUESS[device] if args.interval else args.interval_s
    state = rows * (dim + 1) * 4
    dcp = args.checkpoints * (state / DISK_BPS + state / STAGE_BPS) + args.repeats * state / DISK_BPS
    return (
        STARTUP_S[device]
        + rows * dim * INIT_S_PER_VALUE
        + phases * args.checkpoints * interval_s
        + len(POLICIES) * len(args.encodings) * (JOB_OVERHEAD_S + args.repeats)
        + dcp
    )


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes", default=None, help="comma-separated, of " + ", ".join(SIZES) + " (default: full,big on a GPU, tiny on the CPU)"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="cpu: hide the GPUs from the rank (CUDA_VISIBLE_DEVICES=), gloo",
    )
    p.add_argument("--interval-s", type=float, default=3.0, help="the checkpoint interval's target, seconds of steps")
    p.add_argument("--interval", type=int, default=0, help="the checkpoint interval in steps (overrides --interval-s)")
    p.add_argument("--checkpoints", type=int, default=3, help="checkpoints per job")
    p.add_argument("--warmup", type=int, default=5, help="steps before the probe of the step time")
    p.add_argument("--repeats", type=int, default=2, help="rounds of restores (the median is reported)")
    p.add_argument("--encodings", nargs="+", choices=ENCODINGS, default=list(ENCODINGS))
    p.add_argument("--out", type=Path, help="JSON lines, written as the run goes")
    p.add_argument("--keep", type=Path, help="keep run directories here (default: a temporary directory)")
    p.add_argument("--dcp-dir", type=Path, help="where the peers checkpoint (default: /dev/shm where it has room)")
    p.add_argument("--timeout-s", type=float, default=0, help="per size (default: 3x its estimate + 2 minutes)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every job")
    return p


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")


def _follow(group: Any, events: Path, offset: int, on_event: Callable[[dict[str, Any]], None]) -> int:
    """Follow the rank until it ends or outlives its deadline, echoing its events' lines as they
    come (and handing each to `on_event`); the file offset read to."""
    while True:
        running = group.running()
        if events.exists():
            with events.open() as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            for line in complete.splitlines():
                rec = json.loads(line)
                if rec.get("msg"):
                    log(f"{time.strftime('%H:%M:%S')} {rec['msg']}")
                on_event(rec)
            offset += len(complete.encode())
        if not running or time.monotonic() > group.deadline:  # past it, `wait` kills the rank
            return offset
        time.sleep(1.0)  # polling the rank's progress file


def peers_dir(args: argparse.Namespace, name: str, prefix: str) -> Path | None:
    """Where the peers of size `name` checkpoint: under `--dcp-dir`; else in /dev/shm where it
    has room for four checkpoints (the newest `dcp.save` kept for `dcp.load`, the one being
    written, two of `dcp.async_save`), RAM like the broker's memory storage that deltarec's
    checkpoints go to; else None (the size's work directory)."""
    if args.dcp_dir is not None:
        return args.dcp_dir / f"{prefix}-{name}"
    rows, dim = size_rows(name)
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 4 * rows * (dim + 1) * 4 + (1 << 30):
        return shm / f"{prefix}-{name}"
    return None


def one_size(
    name: str, args: argparse.Namespace, device: str, work: Path, broker: Any, events: Path, prefix: str
) -> dict[str, Any]:
    """Run one size in its own process; its records, summary and goals (or what failed)."""
    from launch.ranks import start_ranks

    tmp = work / name
    tmp.mkdir(parents=True, exist_ok=True)
    config, overrides = size_config(name, tmp / f"{name}.yaml")
    est = estimate_s(name, device, args)
    timeout_s = args.timeout_s or 3 * est + 120
    rows, dim = size_rows(name)
    log(
        f"{time.strftime('%H:%M:%S')} size {name}: {rows:,} rows x {dim} ({rows * dim * 4 / 1e9:.2f} GB fp32) on {device}; "
        f"expected ~{est:.0f} s (timeout {timeout_s:.0f} s)"
    )
    jobs = ",".join(f"{p}/{e}" for p in POLICIES for e in args.encodings)
    extra = [
        "--out-dir",
        str(tmp / "out"),
        "--checkpoints",
        str(args.checkpoints),
        "--interval",
        str(args.interval),
        "--interval-s",
        str(args.interval_s),
        "--repeats",
        str(args.repeats),
        "--jobs",
        jobs,
        "--peers",
        ",".join(PEERS),
        "--stager",
        "pinned",
        "--bootstrap",
        broker.bootstrap,
        "--broker-pid",
        str(broker.pid),
        "--run-prefix",
        f"{prefix}-{name}",
        "--events",
        str(events),
        "--size",
        name,
        "--bare-repeats",
        str(SIZES[name]["bare_repeats"]),
        "--warmup",
        str(args.warmup),
    ]
    dcp_dir = peers_dir(args, name, prefix)
    if dcp_dir is not None:
        extra += ["--peers-dir", str(dcp_dir)]
    log(f"size {name}: the peers checkpoint to {dcp_dir or tmp / 'out'}")
    env_extra = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else None

    def on_event(rec: dict[str, Any]) -> None:
        if rec.get("event") == "probe":  # the interval is known now: the estimate again
            refined = estimate_s(name, device, args, interval_s=rec["interval"] * rec["step_s"])
            log(
                f"size {name}: expected ~{refined:.0f} s in all at this interval "
                f"(~{refined - (time.perf_counter() - t0):.0f} s more)"
            )

    t0 = time.perf_counter()
    offset = events.stat().st_size if events.exists() else 0
    group = start_ranks(
        config,
        [*overrides, *args.overrides],
        tmp,
        world_size=1,
        timeout_s=timeout_s,
        module="bench.peers_gpu_rank",
        extra_args=extra,
        env_extra=env_extra,
    )
    error = None
    try:
        _follow(group, events, offset, on_event)
        group.wait()
    except AssertionError as exc:  # the rank failed or ran out of time: what it finished is in the events
        error = str(exc)
        log(f"size {name} failed after {time.perf_counter() - t0:.0f} s:\n{error[-3000:]}")
    finally:
        if group.running():  # interrupted: leave no rank behind
            for proc in group.procs:
                proc.kill()
        if dcp_dir is not None:  # a rank killed before its own clean-up leaves the peers' checkpoints
            shutil.rmtree(dcp_dir, ignore_errors=True)
    result: dict[str, Any] = {"size": name, "wall_s": time.perf_counter() - t0, "estimate_s": est, "error": error}
    done = tmp / "out" / "one_process.json"
    if not done.exists():
        return result
    one = json.loads(done.read_text())
    result.update(records_of(name, one))
    result.update(
        {
            "device": one["device"],
            "interval": one["interval"],
            "steps": one["steps"],
            "step_s": one["step_s"],
            "model_rows": one["model_rows"],
            "errors": one["errors"],
        }
    )
    return result


def records_of(name: str, one: dict[str, Any]) -> dict[str, Any]:
    """`bench.peers.build_records` of a one-process run, and its goals."""
    jobs = {}
    for run in one["jobs"].values():
        run["capacity"] = {int(k): v for k, v in run["capacity"].items()}
        jobs[(run["policy"], run["encoding"])] = run
    base = one["none"] or {"samples_per_s": None, "cpu": []}
    rec, summary = build_records({"interval": one["interval"], "steps": one["steps"]}, jobs, [one], base, common={"size": name})
    return {"records": rec.items, "summary": summary, "goals": goals(summary)}


def goals(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPU goals for each deltarec job against the peers of its size: reported, never asserted."""
    peers = summary["peers"]
    # the part of async_save's stall that staged and planned it, not its wait for the previous save
    # (which a longer interval avoids): the smaller, the harder the goal
    a = peers.get("dcp.async_save", {})
    blocking = a.get("stall_blocking_ms") if a.get("stall_blocking_ms") is not None else a.get("stall_ms")
    load = peers.get("dcp.save", {}).get("restore_s")
    async_durable = peers.get("dcp.async_save", {}).get("durable_s")
    out = []
    for key, d in summary["deltarec"].items():
        for goal, value, op, bound in (
            ("stall / dcp.async_save's blocking time", ratio(d["stall_ms"], blocking), "<=", 0.1),
            ("restore / dcp.load", ratio(d["restore_s"], load), "<=", 1.0),
            ("restore / dcp.load (stretch)", ratio(d["restore_s"], load), "<=", 0.5),
            ("durable / dcp.async_save's durable", ratio(d["durable_s"], async_durable), "<=", 1.0),
        ):
            out.append(
                {
                    "job": key,
                    "goal": goal,
                    "value": value,
                    "op": op,
                    "bound": bound,
                    "met": None if value is None else value <= bound,
                }
            )
    return out


def goals_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| deltarec job | goal | value | bound | met |", "| --- | --- | --- | --- | --- |"]
    for g in rows:
        v = "n/a" if g["value"] is None else f"{g['value']:.3g}"
        met = "not measured" if g["met"] is None else "met" if g["met"] else "NOT met"
        lines.append(f"| {g['job'].replace('/', ' / ')} | {g['goal']} | {v} | {g['op']} {g['bound']} | {met} |")
    return "\n".join(lines)


def run(argv: list[str], prog: str = "python -m bench.peers_gpu") -> dict[str, Any]:
    """Measure every size, print its table and goals, write `--out` as it goes; return the
    result document (its `records` as `Measurement`s, `sizes`: each size's summary)."""
    import torch

    from launch.broker import EmbeddedBroker

    args = parser(prog).parse_args(argv)
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{prog}: --device cuda, and torch sees no GPU")
    sizes = (args.sizes or ("full,big" if device == "cuda" else "tiny")).split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"{prog}: unknown size(s) {unknown}; sizes are {', '.join(SIZES)}")
    started = time.perf_counter()
    machine = machine_info()
    head = document_head("peers-gpu", prog, argv, machine)
    prefix = f"bench-gpu-{uuid.uuid4().hex[:8]}"
    total = sum(estimate_s(s, device, args) for s in sizes)
    log(
        f"{time.strftime('%H:%M:%S')} suite gpu-peers on {device}: sizes {', '.join(sizes)}; "
        f"expected ~{total:.0f} s in all; one embedded broker (memory storage) holds every deltarec checkpoint"
    )
    result: dict[str, Any] = {**head, "suite": "gpu-peers", "device": device, "sizes": {}, "records": []}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-peers-") as tmpdir, EmbeddedBroker() as broker:
        work = args.keep / prefix if args.keep else Path(tmpdir)
        work.mkdir(parents=True, exist_ok=True)
        events = args.out or work / "events.jsonl"
        events.parent.mkdir(parents=True, exist_ok=True)
        _append(
            events,
            {
                "event": "start",
                **head,
                "device": device,
                "sizes": sizes,
                "estimate_s": total,
                "settings": {k: v for k, v in vars(args).items() if k not in ("out", "keep")},
            },
        )
        for name in sizes:
            r = one_size(name, args, device, work, broker, events, prefix)
            records = r.pop("records", [])
            result["records"] += records
            result["sizes"][name] = r
            _append(events, {"event": "size_done", **r, "records": [m.flat() for m in records]})
            if "summary" in r:
                print(
                    f"\n## {name} ({r['device']}, interval {r['interval']} steps, {r['step_s'] * 1e3:.1f} ms/step, "
                    f"{r['wall_s']:.0f} s, expected {r['estimate_s']:.0f} s)\n"
                )
                print(table(r["summary"]))
                print()
                print(goals_table(r["goals"]))
                for label, err in r.get("errors", {}).items():
                    print(f"failed: {label}: {err}")
            else:
                print(f"\n## {name}: no results ({r['error'][-500:] if r['error'] else 'no output'})")
        machine["loadavg_end"] = loadavg()
        result["wall_s"] = time.perf_counter() - started
        _append(events, {"event": "end", "wall_s": result["wall_s"], "loadavg_end": machine["loadavg_end"]})
    print(f"wall {result['wall_s']:.0f} s (expected {total:.0f} s)")
    return result


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """Every record of every size."""
    return list(result["records"])


def main(argv: list[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv)
    return 0


if __name__ == "__main__":
    run_main(main)
