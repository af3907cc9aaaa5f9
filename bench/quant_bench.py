"""Benchmark of the per-row quantization codecs (ckpt/quant): speed and accuracy.

    python -m bench.run --suite codecs --out results.json --plot-dir docs/img [--rows trained_rows.pt]

* Throughput: MB/s of fp32 input (n x dim x 4 bytes) for encode and decode of every codec,
  single thread (``torch.set_num_threads(1)``) and the default thread count: the median of
  per-call times (and the best), plus, for one thread, the thread's CPU time (on a shared, loaded
  machine it is the steadier number). Baselines: torch's
  ``embedding_bag_4bit_prepack(optimized_qparams=True)`` (fbgemm's greedy search, per row in C++),
  adaptive4 with that greedy search (``search="greedy"``, the default before the fast search),
  the fast search's torch reference (``impl="torch"``), and the greedy search as a per-row Python
  loop.
* Accuracy: mean per-row L2 error ``||x - decode(encode(x))||_2`` against bit width for each
  method (sym, asym, adaptive, adaptive with the greedy search, k-means; Check-N-Run Fig. 9), on
  Gaussian and Student-t(3) rows and, with
  ``--rows PATH`` (a ``torch.save``'d float32 [n, d] tensor), on rows of a trained model. Written
  to the JSON and as one PNG per row set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

from bench.common import Measurement, document_head, figure, loadavg, machine_info, scalars
from ckpt.quant import codec_names, get_codec
from ckpt.quant.adaptive import AdaptiveCodec, greedy_range_search
from ckpt.quant.uniform import fbgemm_available
from common.process import run_main

METHODS = {  # method -> bit widths it has
    "sym": (2, 3, 4, 8),
    "asym": (2, 3, 4, 8),
    "adaptive": (2, 3, 4),
    "kmeans": (2, 3, 4),
}
SLOW = ("adaptive", "kmeans")


def _time(fn, nbytes: int, repeats: int, min_time: float) -> tuple[float, float, float]:
    """(median MB/s by wall clock, best MB/s by wall clock, median MB/s by this thread's CPU time).

    Calls are timed one by one for at least ``repeats * min_time`` seconds (and 5 calls); the
    median is robust to the stalls a shared VM throws in (OpenMP barriers waiting on a descheduled
    vCPU can make single multi-threaded calls many times slower: docs/quant.md).
    """
    fn()  # warm-up: allocator, lazy init
    walls, cpus = [], []
    t_end = time.perf_counter() + repeats * min_time
    while len(walls) < 5 or time.perf_counter() < t_end:
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.thread_time() - c0)
    med, best, med_cpu = median(walls), min(walls), median(cpus)
    return nbytes / med / 1e6, nbytes / best / 1e6, nbytes / max(med_cpu, 1e-9) / 1e6


def throughput(args, threads: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for name in args.codecs:
        c = get_codec(name)
        slow = name.startswith(SLOW)
        n = args.n_slow if slow else args.n_fast
        x = torch.randn(n, args.dim, generator=g)
        nbytes = x.numel() * 4
        enc = c.encode(x)
        for th in threads:
            torch.set_num_threads(th)
            e_wall, e_best, e_cpu = _time(lambda: c.encode(x), nbytes, args.repeats, args.min_time)
            d_wall, d_best, d_cpu = _time(lambda: c.decode(enc, args.dim), nbytes, args.repeats, args.min_time)
            r = {
                "codec": name, "code": c.code, "threads": th, "dim": args.dim, "rows": n,
                "row_bytes": c.row_bytes(args.dim),
                "encode_MBps": round(e_wall, 1), "decode_MBps": round(d_wall, 1),
                "encode_MBps_best": round(e_best, 1), "decode_MBps_best": round(d_best, 1),
            }  # fmt: skip
            if th == 1:
                r["encode_MBps_cpu"] = round(e_cpu, 1)
                r["decode_MBps_cpu"] = round(d_cpu, 1)
            rows.append(r)
            print(f"  {name:10s} threads={th} enc {e_wall:9.1f} MB/s  dec {d_wall:9.1f} MB/s", flush=True)
    return rows


def baselines(args, threads: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    x = torch.randn(args.n_slow, args.dim, generator=g)
    nbytes = x.numel() * 4
    for th in threads:
        torch.set_num_threads(th)
        w, _, cpu = _time(lambda: torch.ops.quantized.embedding_bag_4bit_prepack(x, True), nbytes, args.repeats, args.min_time)
        out.append({"baseline": "torch embedding_bag_4bit_prepack(optimized_qparams=True)", "threads": th,
                    "encode_MBps": round(w, 1), **({"encode_MBps_cpu": round(cpu, 1)} if th == 1 else {})})  # fmt: skip
        for label, codec in (
            ("adaptive4, greedy search (nbins 200)", AdaptiveCodec(4, search="greedy")),
            ("adaptive4, fast search, torch reference", AdaptiveCodec(4, impl="torch")),
        ):
            w, _, cpu = _time(lambda: codec.encode(x), nbytes, args.repeats, args.min_time)
            out.append({"baseline": label, "threads": th, "encode_MBps": round(w, 1),
                        **({"encode_MBps_cpu": round(cpu, 1)} if th == 1 else {})})  # fmt: skip
    # the same greedy search, one row at a time from Python (what a straightforward port does)
    torch.set_num_threads(1)
    xs = x[:64]

    def per_row():
        for i in range(xs.shape[0]):
            greedy_range_search(xs[i : i + 1], 4)

    w, _, cpu = _time(per_row, xs.numel() * 4, 1, args.min_time)
    out.append({"baseline": "adaptive4 search, per-row Python loop", "threads": 1,
                "encode_MBps": round(w, 2), "encode_MBps_cpu": round(cpu, 2)})  # fmt: skip
    for r in out:
        print(f"  {r['baseline']:58s} threads={r['threads']} {r['encode_MBps']:8.2f} MB/s", flush=True)
    return out


def dim_sweep(args) -> list[dict]:
    """asym4 / adaptive4 (fast search) / adaptive4 (greedy search) encode at other row widths
    (single thread)."""
    torch.set_num_threads(1)
    out = []
    g = torch.Generator().manual_seed(2)
    for dim in (16, 32, 64, 128, 256):
        for name in ("asym4", "adaptive4", "adaptive4-greedy"):
            n = (args.n_fast if name == "asym4" else args.n_slow) * 64 // dim
            x = torch.randn(n, dim, generator=g)
            c = AdaptiveCodec(4, search="greedy") if name == "adaptive4-greedy" else get_codec(name)
            w, _, cpu = _time(lambda: c.encode(x), x.numel() * 4, args.repeats, args.min_time)
            out.append({"codec": name, "dim": dim, "threads": 1, "encode_MBps": round(w, 1), "encode_MBps_cpu": round(cpu, 1)})
            print(f"  {name:10s} dim={dim:4d} enc {w:9.1f} MB/s (cpu-time {cpu:.1f})", flush=True)
    return out


def accuracy(rowsets: dict[str, torch.Tensor]) -> list[dict]:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    out = []
    for set_name, x in rowsets.items():
        dim = x.shape[1]
        norm = x.norm(dim=1).mean().item()
        ref = [("fp32", 32), ("bf16", 16), ("fp16", 16)]
        items = [(m, b) for m, bits in METHODS.items() for b in bits]
        greedy = [("adaptive-greedy", b) for b in METHODS["adaptive"]]
        for method, bits in items + greedy + [(n, b) for n, b in ref]:
            name = method if method in ("fp32", "bf16", "fp16") else f"{method}{bits}"
            c = AdaptiveCodec(bits, search="greedy") if method == "adaptive-greedy" else get_codec(name)
            t0 = time.perf_counter()
            enc = c.encode(x)
            secs = time.perf_counter() - t0
            err = (c.decode(enc, dim) - x).norm(dim=1)
            r = {
                "rows": set_name, "n": x.shape[0], "dim": dim, "method": method, "bits": bits, "codec": name,
                "row_bytes": c.row_bytes(dim), "bits_per_elem": round(8 * c.row_bytes(dim) / dim, 3),
                "mean_l2": err.mean().item(), "rel_l2": err.mean().item() / norm, "max_l2": err.max().item(),
                "encode_s": round(secs, 3),
            }  # fmt: skip
            out.append(r)
            print(f"  {set_name:10s} {name:10s} mean L2 {r['mean_l2']:.5g}  rel {r['rel_l2']:.4f}", flush=True)
    return out


def plot(acc: list[dict], plot_dir: Path) -> list[str]:
    """Check-N-Run's Fig. 9 in shape, one PNG per row set: mean L2 error per row against bits."""
    files = []
    for set_name in dict.fromkeys(r["rows"] for r in acc):
        rs = [r for r in acc if r["rows"] == set_name]
        f = plot_dir / f"quant_l2_{set_name}.png"
        with figure(f, figsize=(5.5, 4)) as (fig, ax):
            for method, marker in (("sym", "s"), ("asym", "o"), ("adaptive", "^"), ("adaptive-greedy", "v"), ("kmeans", "D")):
                pts = sorted((r["bits"], r["mean_l2"]) for r in rs if r["method"] == method)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=method)
            ax.set_xticks([2, 3, 4, 8])
            ax.set_yscale("log")
            ax.set_xlabel("bits per element (codes only)")
            ax.set_ylabel("mean L2 error per row")
            r0 = rs[0]
            ax.set_title(f"{set_name} rows ({r0['n']} x {r0['dim']})")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        files.append(str(f))
    return files


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/quant.json")
    p.add_argument("--plot-dir", default=None, help="write quant_l2_<rows>.png here")
    p.add_argument("--rows", default=None, help="torch.save'd float32 [n, d] tensor of trained embedding rows")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--n-fast", type=int, default=1 << 16, help="rows for the fast codecs' timing")
    p.add_argument("--n-slow", type=int, default=1 << 14, help="rows for adaptive/kmeans timing")
    p.add_argument("--n-acc", type=int, default=1 << 14, help="Gaussian rows for the accuracy table")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per timed run")
    p.add_argument("--codecs", nargs="*", default=None)
    p.add_argument("--threads", type=int, nargs="*", default=None, help="thread counts to time (default: 1 and torch's default)")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-accuracy", action="store_true")
    return p


def run(argv: list[str], prog: str = "python -m bench.run --suite codecs") -> dict[str, Any]:
    """Time and score the codecs, print, write `--out` (and plots); return the result document."""
    args = parser(prog).parse_args(argv)
    args.codecs = args.codecs or codec_names()

    default_threads = torch.get_num_threads()
    threads = sorted(set(args.threads)) if args.threads else sorted({1, default_threads})
    machine = {**machine_info(), "fbgemm": fbgemm_available()}
    print(f"# {machine['cpu']}, {machine['cores']} CPUs, torch {torch.__version__}, fbgemm={machine['fbgemm']}")
    res: dict = {**document_head("codecs", prog, argv, machine), "dim": args.dim}
    if not args.skip_speed:
        print("## throughput")
        res["throughput"] = throughput(args, threads)
        print("## baselines")
        res["baselines"] = baselines(args, threads)
        print("## dim sweep")
        res["dim_sweep"] = dim_sweep(args)
    student_t = torch.distributions.StudentT(3.0).sample  # heavy tails: what range clipping is for
    torch.manual_seed(4)
    rowsets = {
        "gaussian": torch.randn(args.n_acc, args.dim, generator=torch.Generator().manual_seed(3)),
        "student_t3": student_t((args.n_acc, args.dim)).to(torch.float32),
    }
    if args.skip_accuracy:
        rowsets = {}
    if args.rows:
        t = torch.load(args.rows, map_location="cpu")
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise SystemExit(f"--rows must hold a 2-D tensor, got {type(t).__name__}")
        rowsets[Path(args.rows).stem] = t.to(torch.float32).contiguous()
    print("## accuracy")
    res["accuracy"] = accuracy(rowsets)
    if args.plot_dir and res["accuracy"]:
        res["plots"] = plot(res["accuracy"], Path(args.plot_dir))
    torch.set_num_threads(default_threads)
    machine["loadavg_end"] = loadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")
    return res


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """Speed per codec and thread count, the baselines, the width sweep, and the L2 error per
    codec and row set."""
    speed = ("encode_MBps", "decode_MBps", "encode_MBps_best", "decode_MBps_best", "encode_MBps_cpu", "decode_MBps_cpu")
    out = []
    for r in result.get("throughput", []):
        out += scalars({k: r.get(k) for k in speed}, {"codec": r["codec"], "threads": r["threads"], "dim": r["dim"]})
    for r in result.get("baselines", []):
        out += scalars(
            {k: r.get(k) for k in ("encode_MBps", "encode_MBps_cpu")},
            {"baseline": r["baseline"], "threads": r["threads"], "dim": result["dim"]},
        )
    for r in result.get("dim_sweep", []):
        out += scalars(
            {k: r.get(k) for k in ("encode_MBps", "encode_MBps_cpu")},
            {"codec": r["codec"], "threads": r["threads"], "dim": r["dim"]},
        )
    for r in result.get("accuracy", []):
        out += scalars(
            {k: r[k] for k in ("mean_l2", "rel_l2", "max_l2", "row_bytes", "encode_s")},
            {"rows": r["rows"], "codec": r["codec"], "bits": r["bits"], "dim": r["dim"]},
            {"row_bytes": "B/row", "rel_l2": "ratio"},
        )
    return out


def main(argv: list[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv, "python -m bench.quant_bench")
    return 0


if __name__ == "__main__":
    run_main(main)
