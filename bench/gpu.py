"""What deltarec's CUDA paths cost on a GPU: the snapshot stall against a bare device-to-host
copy of the same rows, every codec's encode and decode on CUDA tensors, and a restore's
decode and apply into shards on the GPU against the same restore into CPU shards, and a
one-GPU job's throughput with checkpoints every `--interval-s` against the job without.

    python -m bench.run --suite gpu [--parts stall,codecs,restore,overhead] [--rows 10000,...]
                                    [--dims 32,128,256] [--codec-rows 1048576] [--restore-rows 1000000]
                                    [--config configs/quickstart.yaml] [--overhead-s 180] [--interval-s 60]
                                    [--out F]

Stall: a shard of 2n rows (weights and a row-wise optimizer state, fp32) with n of them marked
in a device bitmap, as the row tracker leaves it; `SnapshotTaker.take` copies them. The stall
is what the training loop waits for: `take` returning plus the default stream's wait for the
gather it queued (the copy to pinned host memory goes on, on the taker's side stream, until
`Snapshot.wait`: reported as host-copy seconds). The baseline is the bare copy: the same rows
gathered on the device into a reused temporary and copied into reused pinned host buffers,
synchronised. Medians of `--repeats` after one warm-up each.

Codecs: random rows (a quarter of them heavy-tailed) of `--codec-rows` x d on the GPU;
GB/s of fp32 input per second of encode, of fp32 output per second of decode.

Restore: one shard's base checkpoint (adaptive 4-bit weights, fp32 row-wise state, frames of
the writer's size) replayed by `restore_rows` from memory into the shard on the CPU and on
the GPU; both must end with the same bits (weights and state).

Overhead: a short probe sizes the steps; then the `--config` job as one process on this GPU
without checkpoints and with them (the config's checkpoint settings, the embedded broker),
each about `--overhead-s`: samples/s over every logged window but the first, stalls included.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import torch

from bench.common import REPO, Measurement, config_path, document_head, log, machine_info, scalars
from ckpt.capture.host_buffers import HostBufferPool
from ckpt.capture.snapshot import SnapshotTaker
from ckpt.log.markers import ChainLink, IndexEntry, Marker, OffsetRange
from ckpt.quant import codec_names, get_codec
from ckpt.stream.frames import OptimState, chunk_rows, decode_frame
from ckpt.stream.sink import RangeRead, read_one_by_one

# The stall and codec parts import nothing of torchrec or fbgemm (the restore part's shard
# views do): on a GPU machine they run before fbgemm-gpu is installed.

RUN = "gpu-bench"


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="10000,100000,1000000,10000000", help="rows per snapshot, comma-separated")
    p.add_argument("--dims", default="32,128,256", help="row widths, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--codec-rows", type=int, default=1 << 20)
    p.add_argument("--codec-dims", default="32,64,128,256", help="widths for adaptive4; the other codecs at 128")
    p.add_argument("--restore-rows", type=int, default=1_000_000)
    p.add_argument("--parts", default="stall,codecs,restore,overhead", help="which parts to run")
    p.add_argument("--config", default="configs/quickstart.yaml", help="the overhead part's job (one process)")
    p.add_argument("--overhead-s", type=float, default=180, help="seconds of each overhead job")
    p.add_argument("--interval-s", type=float, default=60, help="the overhead job's checkpoint interval")
    p.add_argument("--out", type=Path)
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _sync_time(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


# -- the stall ---------------------------------------------------------------------------------


class _MarkedRows:
    """The row tracker's side of a take: a device bitmap of the rows a checkpoint copies."""

    def __init__(self, marked: torch.Tensor) -> None:
        self.marked = marked

    def counts(self, since_base: bool, trained: bool = False) -> list[int]:
        return [int(self.marked.sum())]

    def touched_rows(self, i: int, since_base: bool, count: int | None = None) -> torch.Tensor:
        """As `RowTracker.touched_rows` on a GPU (ckpt/capture/tracker.py `rows_of`)."""
        return self.marked.nonzero().view(-1) if count is None else torch.nonzero_static(self.marked, size=count).view(-1)


@dataclass
class _Shard:
    """The fields of a `sharding.shard_views.ShardView` that the taker reads."""

    table: str
    row_offset: int
    col_offset: int
    weight: torch.Tensor
    optimizer_states: dict[str, torch.Tensor]

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    @property
    def num_cols(self) -> int:
        return self.weight.shape[1]


@dataclass
class _Shards:
    shards: list[_Shard]


def _timed_takes(taker: SnapshotTaker, repeats: int, weight_codec: str | None) -> tuple[list[float], list[float]]:
    """(stall, host copy) seconds of `repeats` takes after one warm-up; each snapshot released
    once complete, as the writer releases it, so its pinned slab serves the next take."""
    stalls, host = [], []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        snap = taker.take(i, i, full=False, since_base=False, weight_codec=weight_codec)
        torch.cuda.current_stream().synchronize()  # the next step's kernels wait for the gather
        t1 = time.perf_counter()
        snap.wait()
        t2 = time.perf_counter()
        if i:
            stalls.append(t1 - t0)
            host.append(t2 - t0)
        snap.release()
    return stalls, host


def stall_case(n: int, dim: int, repeats: int) -> dict[str, Any]:
    """One row count and width: the taker's stall and host-copy time against the bare copy,
    with fp32 rows and with adaptive4 rows encoded on the device before their copy."""
    dev = torch.device("cuda")
    weight = torch.randn(2 * n, dim, device=dev)
    state = torch.rand(2 * n, device=dev)
    marked = torch.zeros(2 * n, dtype=torch.bool, device=dev)
    marked[torch.randperm(2 * n, device=dev)[:n]] = True
    pool = HostBufferPool(2 * n * (dim * 4 + 12) + (64 << 20), pin_for=dev)  # as the checkpointer's, pinned
    taker = SnapshotTaker(
        _Shards([_Shard("t", 0, 0, weight, {"momentum1": state})]),  # type: ignore[arg-type]
        _MarkedRows(marked),
        dev,
        pool=pool,
    )
    stalls, host = _timed_takes(taker, repeats, None)
    enc_stalls, enc_host = _timed_takes(taker, repeats, "adaptive4")

    idx = marked.nonzero().view(-1)
    tmp_w, tmp_s = torch.empty(n, dim, device=dev), torch.empty(n, device=dev)
    out_w = torch.empty(n, dim, pin_memory=True)
    out_s = torch.empty(n, pin_memory=True)
    out_i = torch.empty(n, dtype=torch.int64, pin_memory=True)

    def bare() -> None:
        torch.index_select(weight, 0, idx, out=tmp_w)
        torch.index_select(state, 0, idx, out=tmp_s)
        out_i.copy_(idx, non_blocking=True)
        out_w.copy_(tmp_w, non_blocking=True)
        out_s.copy_(tmp_s, non_blocking=True)

    bares = [_sync_time(bare) for _ in range(repeats + 1)][1:]
    nbytes = n * (dim * 4 + 4 + 8)
    s, h, b = median(stalls), median(host), median(bares)
    es, eh = median(enc_stalls), median(enc_host)
    return {
        "rows": n,
        "dim": dim,
        "bytes": nbytes,
        "stall_s": s,
        "host_copy_s": h,
        "bare_s": b,
        "stall_over_bare": s / b,
        "host_copy_over_bare": h / b,
        "bare_GBps": nbytes / b / 1e9,
        "encoded_stall_s": es,
        "encoded_host_copy_s": eh,
        "encoded_stall_over_bare": es / b,
        "encoded_host_copy_over_bare": eh / b,
        "encoded_on_device": taker.device_encoder("adaptive4") is not None,
    }


# -- codecs ------------------------------------------------------------------------------------


def _rows(n: int, dim: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, dim, device=device, generator=g)
    x[: n // 4] = x[: n // 4] ** 3
    return x


def codec_case(name: str, n: int, dim: int, repeats: int) -> dict[str, Any]:
    codec = get_codec(name)
    x = _rows(n, dim, torch.device("cuda"))
    enc = codec.encode(x)  # warm-up (kernels, allocator)
    codec.decode(enc, dim)
    e = median(_sync_time(lambda: codec.encode(x)) for _ in range(repeats))
    d = median(_sync_time(lambda: codec.decode(enc, dim)) for _ in range(repeats))
    nbytes = x.numel() * 4
    return {
        "codec": name,
        "rows": n,
        "dim": dim,
        "encode_s": e,
        "decode_s": d,
        "encode_GBps": nbytes / e / 1e9,
        "decode_GBps": nbytes / d / 1e9,
    }


# -- restore -----------------------------------------------------------------------------------


class _MemorySource:
    """Frames held in memory, one partition; a FrameSource for `restore_rows`."""

    reads_ahead_used = 0

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames

    def read_range(self, generation: int, partition: int, first: int, last: int) -> Iterator[tuple[int, Any]]:
        for pos in range(first, last + 1):
            yield pos, decode_frame(self.frames[pos])

    def read_ranges(self, reads: Sequence[RangeRead]) -> Iterator[tuple[int, int, Any]]:
        return read_one_by_one(self, reads)

    def prepare(self) -> None:
        pass

    def read_ahead(self, reads: Sequence[RangeRead]) -> None:
        pass

    def close(self) -> None:
        pass


def restore_case(n: int, dim: int, repeats: int) -> dict[str, Any]:
    from ckpt.restore.replay import restore_rows  # noqa: PLC0415 - shard views import torchrec (see the imports)
    from sharding.shard_views import ShardMap, ShardView  # noqa: PLC0415

    g = torch.Generator().manual_seed(1)
    weights, state = torch.randn(n, dim, generator=g), torch.rand(n, generator=g)
    ids = torch.arange(n)
    codec = get_codec("adaptive4")
    frames = [
        f.data
        for f in chunk_rows(
            run_id=RUN,
            checkpoint_id=1,
            rank=0,
            table="t",
            col_offset=0,
            dim=dim,
            encoding=codec.code,
            row_ids=ids,
            payload=codec.encode(weights),
            optim=[OptimState("momentum1", get_codec("fp32").code, state.unsqueeze(1))],
        )
    ]
    link = ChainLink(
        checkpoint_id=1,
        full=True,
        generation=1,
        ranges={0: [OffsetRange(0, len(frames) - 1)]},
        rows=n,
        bytes=sum(map(len, frames)),
        index=[IndexEntry(0, 0, len(frames) - 1, "t", 0, 0, n - 1, dim)],
    )
    marker = Marker(kind="commit", run_id=RUN, checkpoint_id=1, step=1, world_size=1, chain=[link])
    out: dict[str, Any] = {"rows": n, "dim": dim, "frames": len(frames), "bytes": link.bytes}
    result: dict[str, list[torch.Tensor]] = {}
    for device in ("cpu", "cuda"):
        times = []
        for _ in range(repeats + 1):
            view = ShardView("t", 0, 0, torch.zeros(n, dim, device=device), {"momentum1": torch.zeros(n, device=device)})
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = restore_rows(marker, _MemorySource(frames), ShardMap([view], []), RUN, lambda g, p, o: f"{p}@{o}")
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        result[device] = [view.weight.cpu(), view.optimizer_states["momentum1"].cpu()]
        s = median(times[1:])
        out.update(
            {
                f"{device}_s": s,
                f"{device}_MBps": link.bytes / s / 1e6,
                f"{device}_decode_s": got.decode_s,
                f"{device}_apply_s": got.apply_s,
                f"{device}_fetch_s": got.fetch_s,
            }
        )  # parts: the last repeat
    out["cuda_over_cpu"] = out["cuda_s"] / out["cpu_s"]
    out["same_bits"] = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(result["cpu"], result["cuda"]))
    return out


# -- throughput overhead of checkpoints at an interval of seconds ---------------------------------


def _train(config: str, overrides: list[str], run_dir: Path, timeout_s: float) -> list[dict[str, Any]]:
    """One single-process trainer job on this GPU; its metrics records."""
    from launch.ranks import read_metrics

    cmd = [
        sys.executable,
        "-m",
        "trainer.main",
        "--config",
        config,
        f"run.dir={run_dir}",
        "train.progress=log",
        "train.eval_every=0",
        "train.eval_batches=0",
        "sharding.default=table_wise",
        *overrides,
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"job failed ({done.returncode}): {done.stderr[-3000:]}")
    return read_metrics(run_dir)


def _rate(records: list[dict[str, Any]], batch: int, log_every: int) -> tuple[float, float]:
    """Samples/s over every logged window but the first (start-up): all of them together
    (stalls included), and the median window."""
    rates = [r["samples_per_s"] for r in records if "samples_per_s" in r][1:]
    seconds = sum(batch * log_every / r for r in rates)
    return batch * log_every * len(rates) / seconds, median(rates)


def overhead_case(config: str, seconds: float, interval_s: float, workdir: Path) -> dict[str, Any]:
    """The job without checkpoints against the same job checkpointing every `interval_s` to
    the embedded broker (the config's checkpoint settings), each about `seconds` long; a short
    probe first sizes the step count."""
    from launch.broker import EmbeddedBroker
    from trainer.config import load_config

    batch, log_every = load_config(config, [], check_data=False).data.batch_size, 100
    probe = _train(config, ["train.steps=1500", f"train.log_every={log_every}", "ckpt.enabled=false"], workdir / "probe", 600)
    steps_per_s = _rate(probe, batch, log_every)[0] / batch
    steps = int(steps_per_s * seconds) // log_every * log_every
    log(f"overhead: {steps_per_s:.0f} steps/s without checkpoints; jobs of {steps:,} steps")
    common = [f"train.steps={steps}", f"train.log_every={log_every}"]
    none = _train(config, [*common, "ckpt.enabled=false"], workdir / "none", seconds * 4)
    with EmbeddedBroker() as broker:
        ckpt = _train(
            config,
            [
                *common,
                "ckpt.enabled=true",
                "ckpt.sink.kind=kafka",
                f"ckpt.sink.bootstrap_servers={broker.bootstrap}",
                "ckpt.run_id=gpu-overhead",
                "ckpt.schedule.interval_steps=0",
                f"ckpt.schedule.interval_s={interval_s}",
            ],
            workdir / "kafka",
            seconds * 4,
        )
    (r0, m0), (r1, m1) = _rate(none, batch, log_every), _rate(ckpt, batch, log_every)
    ckpts = [r for r in ckpt if "ckpt_id" in r]
    return {
        "steps": steps,
        "interval_s": interval_s,
        "samples_per_s_none": r0,
        "samples_per_s_ckpt": r1,
        "median_window_none": m0,
        "median_window_ckpt": m1,
        "overhead": 1 - r1 / r0,
        "checkpoints": len(ckpts),
        "committed": sum(bool(r.get("ckpt_committed")) for r in ckpts),
        "stall_ms_max": max((r["ckpt_stall_ms"] for r in ckpts), default=None),
        "durable_s_max": max((r["ckpt_durable_s"] or 0 for r in ckpts), default=None),
    }


# -- the suite ---------------------------------------------------------------------------------


def run(argv: list[str], prog: str = "python -m bench.run --suite gpu") -> dict[str, Any]:
    args = parser(prog).parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(f"{prog}: needs CUDA, and torch sees no GPU")
    machine = machine_info()
    parts = set(args.parts.split(","))
    result: dict[str, Any] = {
        **document_head("gpu", prog, argv, machine),
        "device": torch.cuda.get_device_name(0),
        "stall": [],
        "codecs": [],
        "restore": [],
        "overhead": [],
    }
    if "stall" in parts:
        for dim in _ints(args.dims):
            for n in _ints(args.rows):
                case = stall_case(n, dim, args.repeats)
                torch.cuda.empty_cache()  # the case's tables and buffers are gone: give their memory back
                torch._C._host_emptyCache()  # and the pinned host blocks the caching host allocator kept
                log(
                    f"stall n={n:,} d={dim}: {case['stall_s'] * 1e3:.3f} ms (host copy {case['host_copy_s'] * 1e3:.2f}) "
                    f"vs bare {case['bare_s'] * 1e3:.3f} ms: {case['stall_over_bare']:.2f}x; bare {case['bare_GBps']:.1f} GB/s; "
                    f"adaptive4 on the device: stall {case['encoded_stall_s'] * 1e3:.3f} ms, host copy "
                    f"{case['encoded_host_copy_s'] * 1e3:.2f} ms ({case['encoded_host_copy_over_bare']:.2f}x bare)"
                )
                result["stall"].append(case)
    if "codecs" in parts:
        cases = [("adaptive4", d) for d in _ints(args.codec_dims)]
        cases += [(name, 128) for name in codec_names() if name != "adaptive4"]
        for name, dim in cases:
            rows = args.codec_rows if not name.startswith("kmeans") else args.codec_rows // 8
            case = codec_case(name, rows, dim, args.repeats)
            log(f"{name} d={dim}: encode {case['encode_GBps']:.2f} GB/s, decode {case['decode_GBps']:.2f} GB/s")
            result["codecs"].append(case)
    if "restore" in parts:
        for dim in (32, 128):
            case = restore_case(args.restore_rows, dim, args.repeats)
            log(
                f"restore n={case['rows']:,} d={dim}: cpu {case['cpu_s']:.3f} s, cuda {case['cuda_s']:.3f} s "
                f"({case['cuda_MBps']:.0f} MB/s; decode {case['cuda_decode_s']:.3f}, apply {case['cuda_apply_s']:.3f}); "
                f"same bits {case['same_bits']}"
            )
            result["restore"].append(case)
    if "overhead" in parts:
        with tempfile.TemporaryDirectory(prefix="deltarec-gpu-") as tmp:
            case = overhead_case(config_path(args.config), args.overhead_s, args.interval_s, Path(tmp))
        log(
            f"overhead at {args.interval_s:.0f} s: {case['samples_per_s_none']:,.0f} -> {case['samples_per_s_ckpt']:,.0f} "
            f"samples/s ({case['overhead']:.2%}); {case['committed']}/{case['checkpoints']} checkpoints committed, "
            f"stall max {case['stall_ms_max']} ms"
        )
        result["overhead"].append(case)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


def measurements(result: dict[str, Any]) -> list[Measurement]:
    out: list[Measurement] = []
    for case in result["stall"]:
        out += scalars(case, {"part": "stall", "rows": case["rows"], "dim": case["dim"]})
    for case in result["codecs"]:
        out += scalars(case, {"part": "codec", "codec": case["codec"], "dim": case["dim"]})
    for case in result["restore"]:
        out += scalars(case, {"part": "restore", "rows": case["rows"], "dim": case["dim"]})
    for case in result["overhead"]:
        out += scalars(case, {"part": "overhead", "interval_s": case["interval_s"]}, {"overhead": "ratio"})
    return out


if __name__ == "__main__":
    print(json.dumps(run(__import__("sys").argv[1:]), indent=1, default=str))
