"""Managed-collision ("hashed", ZCH) tables on an eviction-heavy stream: what each checkpoint
writes and costs against `torch.distributed.checkpoint.save`: `python -m bench.run --suite hashed`.

    python -m bench.run --suite hashed [--quick] [--slots N] [--intervals K] [--steps-per-interval S]
        [--eviction-every E] [--interval-ids M] [--new-share F] [--encoding CODEC] [--policy P] [--out results.json]

One job of 2 gloo ranks (`bench.hashed_rank`): a managed-collision table of `--slots` slots
(DistanceLFU eviction every `--eviction-every` steps, 2^40 raw ids) beside an ordinary table,
fused SGD, checkpointed every `--steps-per-interval` steps by a `ckpt.Checkpointer` to the
filesystem sink in a temporary directory (policy incremental, fp32 rows unless overridden), with
`dcp.save` of the same model's state dict at every checkpoint step. Interval 0 fills the table;
in every later interval a share `--new-share` of the distinct raw ids drawn are new, so each
eviction admits new ids and evicts cold ones. With the eviction interval twice the checkpoint
interval, every other checkpoint has an eviction since the one before.

Figures per checkpoint (interval) and in total:

- bytes written: the rows' frames and the mapping's frames (`Frame.is_mapping`), read back from
  the segment files, plus rank 0's dense file; against the bytes on disk of `dcp.save` at the same
  step (`over_dcp`), and how many such intervals fit in one `dcp.save`'s bytes (`capacity`,
  delta checkpoints only);
- the stall (`Checkpointer.stats.stalls`, the slowest rank) and the time `MappingCapture.capture`
  took inside it (the slowest rank), with and without an eviction since the previous checkpoint;
- per admitted or evicted id: the mapping frames' bytes over admissions + evictions (both ranks),
  and the capture's time per changed slot (admitted + evicted).

Totals are over the steady state: the delta checkpoints after the one whose eviction filled the
empty table (the first eviction only fills free slots; every later one admits ids by evicting
others). The full checkpoint and the fill are reported apart.

A benchmark, not a test: it asserts nothing about the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any

from bench.common import Measurement, document_head, loadavg, log, machine_info, ratio, rounded, scalars
from ckpt.stream.filesystem import scan_records
from ckpt.stream.frames import decode_frame, file_where

# flags of the rank worker each size sets; the rest keep bench.hashed_rank's defaults
SIZES: dict[str, dict[str, Any]] = {
    "default": {
        "slots": 200_000,
        "plain_rows": 50_000,
        "dim": 64,
        "intervals": 40,
        "steps_per_interval": 4,
        "eviction_every": 8,
        "interval_ids": 50_000,
        "hot": 1024,
    },
    "quick": {
        "slots": 8_000,
        "plain_rows": 2_000,
        "dim": 16,
        "intervals": 6,
        "steps_per_interval": 2,
        "eviction_every": 4,
        "interval_ids": 2_000,
        "hot": 64,
    },
}


@dataclass(frozen=True)
class IntervalFigures:
    """One checkpoint of the job (both ranks together unless said)."""

    checkpoint_id: int
    step: int
    full: bool
    eviction: bool  # an eviction ran since the previous checkpoint (on any rank)
    rows_bytes: int
    mapping_bytes: int
    dense_bytes: int
    bytes: int  # rows + mapping + dense
    dcp_bytes: int | None  # dcp.save of the state dict at the same step, on disk
    over_dcp: float | None
    stall_ms: float  # the slowest rank's
    capture_ms: float  # MappingCapture.capture inside the stall, the slowest rank's
    admitted: int
    evicted: int
    counter_slots: int
    history: int  # raw ids received since the last eviction, at the checkpoint
    mapping_bytes_per_changed_id: float | None  # mapping bytes over admitted + evicted
    capture_us_per_changed_slot: float | None  # capture time (slowest rank) over admitted + evicted
    stream_ids: int  # distinct raw ids the interval drew
    stream_new: int  # of them, never seen before


def frame_bytes(fs_root: Path) -> dict[int, dict[str, int]]:
    """checkpoint id -> bytes of its row frames (`rows`) and mapping frames (`mapping`) on disk,
    records' headers included, over every segment file under `fs_root`."""
    out: dict[int, dict[str, int]] = defaultdict(lambda: {"rows": 0, "mapping": 0})
    for seg in sorted(fs_root.rglob("*.seg")):
        with seg.open("rb") as f:
            for pos, end, payload in scan_records(f, seg):
                frame = decode_frame(payload, where=file_where(seg, pos))
                out[frame.checkpoint_id]["mapping" if frame.is_mapping else "rows"] += end - pos
    return dict(out)


def dense_bytes(dense_dir: Path) -> dict[int, int]:
    """checkpoint id -> bytes of rank 0's dense file (`dense-<id>.pt`) still on disk."""
    return {int(p.stem.split("-")[1]): p.stat().st_size for p in dense_dir.glob("dense-*.pt")}


def intervals(ranks: list[dict[str, Any]], frames: dict[int, dict[str, int]], dense: dict[int, int]) -> list[IntervalFigures]:
    """The per-checkpoint figures of both ranks' reports and the bytes on disk."""
    zero = ranks[0]
    stream = zero["stream"]
    out = []
    for stall in zero["stalls"]:
        cid, step = stall["checkpoint_id"], stall["step"]
        stalls = [next(s for s in r["stalls"] if s["checkpoint_id"] == cid) for r in ranks]
        caps = [next(c for c in r["captures"] if c["step"] == step) for r in ranks]
        fb = frames.get(cid, {"rows": 0, "mapping": 0})
        d = dense.get(cid, 0)
        total = fb["rows"] + fb["mapping"] + d
        dcp = zero["dcp_bytes"].get(str(step))
        admitted, evicted = sum(c["admitted"] for c in caps), sum(c["evicted"] for c in caps)
        capture_ms = max(c["capture_ms"] for c in caps)
        changed = admitted + evicted
        interval = (step - 1) // max(1, ranks[0]["steps_per_interval"])
        s = stream[interval] if interval < len(stream) else {"ids": 0, "new": 0}
        out.append(
            IntervalFigures(
                checkpoint_id=cid,
                step=step,
                full=bool(stall["full"]),
                eviction=any(c["eviction"] for c in caps),
                rows_bytes=fb["rows"],
                mapping_bytes=fb["mapping"],
                dense_bytes=d,
                bytes=total,
                dcp_bytes=dcp,
                over_dcp=ratio(total, dcp),
                stall_ms=max(s["stall_ms"] for s in stalls),
                capture_ms=capture_ms,
                admitted=admitted,
                evicted=evicted,
                counter_slots=sum(c["counter_slots"] for c in caps),
                history=sum(c["history"] for c in caps),
                mapping_bytes_per_changed_id=ratio(fb["mapping"], changed),
                capture_us_per_changed_slot=ratio(capture_ms * 1e3, changed),
                stream_ids=s["ids"],
                stream_new=s["new"],
            )
        )
    return out


def _med(xs: list[float]) -> float | None:
    return median(xs) if xs else None


def summarize(rows: list[IntervalFigures]) -> dict[str, Any]:
    """Totals over the job in its steady state: the delta checkpoints after the one whose
    eviction filled the empty table (there every later eviction admits ids only by evicting
    others): their bytes against dcp.save, the capacity, stalls and capture times with and
    without an eviction, per-id costs. The full checkpoint and the fill are reported apart."""
    dcps = [r.dcp_bytes for r in rows if r.dcp_bytes]
    dcp_bytes = median(dcps) if dcps else None
    fill = next((r for r in rows if r.eviction), None)
    steady = [r for r in rows if not r.full and fill is not None and r.step > fill.step]
    evicting = [r for r in steady if r.eviction]
    quiet = [r for r in steady if not r.eviction]
    delta_bytes = [r.bytes for r in steady]
    changed = sum(r.admitted + r.evicted for r in evicting)
    mean_delta = _mean(delta_bytes)
    capture_evicting, stall_evicting = _med([r.capture_ms for r in evicting]), _med([r.stall_ms for r in evicting])
    return {
        "checkpoints": len(rows),
        "steady_checkpoints": len(steady),
        "with_eviction": len(evicting),
        "without_eviction": len(quiet),
        "dcp_bytes": dcp_bytes,
        "full_bytes": _mean([r.bytes for r in rows if r.full]),
        "full_mapping_bytes": _mean([r.mapping_bytes for r in rows if r.full]),
        "fill_bytes": fill.bytes if fill is not None else None,
        "fill_mapping_bytes": fill.mapping_bytes if fill is not None else None,
        "delta_bytes_total": sum(delta_bytes),
        "delta_bytes_mean": mean_delta,
        "delta_rows_bytes_mean": _mean([r.rows_bytes for r in steady]),
        "delta_mapping_bytes_mean": _mean([r.mapping_bytes for r in steady]),
        "mapping_bytes_mean_with_eviction": _mean([r.mapping_bytes for r in evicting]),
        "mapping_bytes_mean_without_eviction": _mean([r.mapping_bytes for r in quiet]),
        "mapping_share_of_delta_bytes": ratio(sum(r.mapping_bytes for r in steady), sum(delta_bytes)),
        "delta_over_dcp": ratio(mean_delta, dcp_bytes),
        "delta_over_dcp_with_eviction": ratio(_mean([r.bytes for r in evicting]), dcp_bytes),
        "delta_over_dcp_without_eviction": ratio(_mean([r.bytes for r in quiet]), dcp_bytes),
        "capacity_intervals_per_dcp": ratio(dcp_bytes, mean_delta),
        "stall_ms_median_with_eviction": stall_evicting,
        "stall_ms_median_without_eviction": _med([r.stall_ms for r in quiet]),
        "capture_ms_median_with_eviction": capture_evicting,
        "capture_ms_median_without_eviction": _med([r.capture_ms for r in quiet]),
        "capture_over_stall_with_eviction": ratio(capture_evicting, stall_evicting),
        "admitted_total": sum(r.admitted for r in evicting),
        "evicted_total": sum(r.evicted for r in evicting),
        "counter_slots_total": sum(r.counter_slots for r in evicting),
        "mapping_bytes_per_changed_id": ratio(sum(r.mapping_bytes for r in evicting), changed),
        "capture_us_per_changed_slot": ratio(sum(r.capture_ms for r in evicting) * 1e3, changed),
        "stall_ms_full": _med([r.stall_ms for r in rows if r.full]),
        "stream_new_share": ratio(sum(r.stream_new for r in rows[1:]), sum(r.stream_ids for r in rows[1:])),
    }


def _mean(xs: list[int] | list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def table(rows: list[IntervalFigures], summary: dict[str, Any]) -> str:
    """The per-checkpoint figures and the totals, as Markdown."""

    def mb(x: float | None) -> str:
        return "-" if x is None else f"{x / 1e6:.2f}"

    def f(x: float | None, nd: int = 2) -> str:
        return "-" if x is None else f"{x:.{nd}f}"

    lines = [
        "| ckpt | step | kind | eviction | rows MB | mapping MB | dense MB | dcp.save MB | over dcp | stall ms | "
        "capture ms | admitted / evicted | mapping B per id | capture us per slot |",
        "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.checkpoint_id} | {r.step} | {'full' if r.full else 'delta'} | {'yes' if r.eviction else 'no'} | "
            f"{mb(r.rows_bytes)} | {mb(r.mapping_bytes)} | {mb(r.dense_bytes)} | {mb(r.dcp_bytes)} | {f(r.over_dcp, 3)} | "
            f"{f(r.stall_ms, 1)} | {f(r.capture_ms)} | {r.admitted} / {r.evicted} | "
            f"{f(r.mapping_bytes_per_changed_id, 1)} | {f(r.capture_us_per_changed_slot, 3)} |"
        )
    s = summary
    lines += [
        "",
        f"steady deltas ({s['steady_checkpoints']}, after the fill): {mb(s['delta_bytes_mean'])} MB a checkpoint "
        f"(rows {mb(s['delta_rows_bytes_mean'])}, mapping "
        f"{mb(s['delta_mapping_bytes_mean'])}: {f(s['mapping_share_of_delta_bytes'], 3)} of it) against dcp.save "
        f"{mb(s['dcp_bytes'])} MB: {f(s['delta_over_dcp'], 3)}, {f(s['capacity_intervals_per_dcp'], 1)} intervals "
        "in one dcp.save",
        f"stall median with / without an eviction: {f(s['stall_ms_median_with_eviction'], 1)} / "
        f"{f(s['stall_ms_median_without_eviction'], 1)} ms; mapping capture in it "
        f"{f(s['capture_ms_median_with_eviction'])} / {f(s['capture_ms_median_without_eviction'])} ms",
        f"per admitted or evicted id ({s['with_eviction']} checkpoints, {s['admitted_total']} admitted, "
        f"{s['evicted_total']} evicted): "
        f"{f(s['mapping_bytes_per_changed_id'], 1)} mapping bytes, {f(s['capture_us_per_changed_slot'], 3)} us of capture",
    ]
    return "\n".join(lines)


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny job (seconds): the smoke test's size")
    for name, value in SIZES["default"].items():
        p.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {value} (quick: {SIZES['quick'][name]})"
        )
    p.add_argument("--new-share", type=float, default=0.2, help="share of each interval's distinct raw ids never seen before")
    p.add_argument("--encoding", default="fp32", help="ckpt.encoding.weights")
    p.add_argument("--policy", default="incremental", help="ckpt.schedule.policy")
    p.add_argument("--no-dcp", action="store_true", help="skip dcp.save (no ratio)")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--out", type=Path)
    return p


def run_job(settings: dict[str, Any], args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """The 2-rank job; each rank's report, rank 0 first."""
    from launch.ranks import start_command

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    flags += [f"--new-share={args.new_share}", f"--encoding={args.encoding}", f"--policy={args.policy}"]
    if args.no_dcp:
        flags.append("--no-dcp")
    rdzv = work / "rdzv"
    argv = [sys.executable, "-m", "bench.hashed_rank", f"--init-method=file://{rdzv}", f"--work={work}", *flags]
    start_command(argv, work, world_size=2, timeout_s=args.timeout_s).wait()
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        r["steps_per_interval"] = settings["steps_per_interval"]
    return ranks


def run(argv: list[str], prog: str = "python -m bench.run --suite hashed") -> dict[str, Any]:
    args = parser(prog).parse_args(argv)
    settings = dict(SIZES["quick" if args.quick else "default"])
    for name in settings:
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    machine = machine_info()
    log(f"hashed: {settings['intervals']} intervals of {settings['steps_per_interval']} steps, {settings['slots']} slots")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hashed-") as tmp:
        work = Path(tmp)
        ranks = run_job(settings, args, work)
        frames = frame_bytes(Path(ranks[0]["fs_root"]))
        dense = dense_bytes(Path(ranks[0]["dense_dir"]))
    rows = intervals(ranks, frames, dense)
    summary = summarize(rows)
    machine["loadavg_end"] = loadavg()
    result = {
        **document_head("hashed", prog, argv, machine),
        "settings": {**settings, "new_share": args.new_share, "encoding": args.encoding, "policy": args.policy},
        "wall_s": time.perf_counter() - t0,
        "train_s": max(r["train_s"] for r in ranks),
        # dcp.save's own time at the checkpoint steps (rank 0's, barrier included): context, not compared
        "dcp_save_s_median": _med(list(ranks[0]["dcp_s"].values())),
        "committed": ranks[0]["committed"],
        "failed": ranks[0]["failed"],
        "intervals": [asdict(r) for r in rows],
        "summary": summary,
    }
    result = rounded(result)
    print(table(rows, summary))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """The summary's figures, then each checkpoint's bytes, ratio, stall and capture."""
    out = scalars({"dcp_save_s_median": result["dcp_save_s_median"]})
    out += scalars(result["summary"], units={"capacity_intervals_per_dcp": "intervals", "capture_us_per_changed_slot": "us"})
    for r in result["intervals"]:
        labels = {"ckpt": r["checkpoint_id"], "kind": "full" if r["full"] else "delta", "eviction": r["eviction"]}
        fields = ("rows_bytes", "mapping_bytes", "dense_bytes", "bytes", "dcp_bytes", "over_dcp", "stall_ms", "capture_ms")
        out += scalars({k: r[k] for k in fields}, labels)
    return out
