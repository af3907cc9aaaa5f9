"""Cost of continuous-checkpoint bookkeeping on the training thread: the tracker hook and the snapshot stall.

    python -m bench.run --suite tracker [--config configs/quickstart.yaml] [--ranks 2] [--rounds 12] [--block 25]
                                        [--out results.json] [key=value ...]

Spawns `--ranks` gloo ranks of the real DMP model and `Trainer.train_step` (synthetic data).

1. Tracker: in the same run, blocks of steps rotate between the RowTracker hook attached,
   detached, a do-nothing hook (the A/A control: how much two identical setups differ
   on this machine) and TorchRec's own `ModelDeltaTrackerTrec` in ID_ONLY mode (the peer,
   torchrec/distributed/model_tracker: a list of each batch's ids per table, read and
   deduplicated with `get_unique_ids`, here at the end of each of its blocks); the order
   rotates every round so drift cancels. Reports median and mean step time per mode and
   their ratios, the time measured inside each hook (per step and per 64k ids, and a
   micro-benchmark of one 64k-id lookup batch), and the peer's read per block.
   Then both listen to the same `--interval` steps at once: what each lists for a
   checkpoint (deltarec's bitmap scan, the peer's `get_unique_ids`), timed, and whether
   they name the same rows of every table this rank holds.
2. Snapshot: after `--interval` steps, the stall of `SnapshotTaker.take` (incremental
   delta, and full) against a bare `index_select` / `clone` of the same rows of the same
   tensors (weights and optimizer state), medians of `--repeats`.

Prints one JSON object (per-rank numbers and the max over ranks). The hook is timed from
inside by swapping the torchrec module's `post_lookup_tracker_fn` for a timed call of the
tracker's own callback (`RowTracker.record_lookup`, the hook torchrec calls).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import fmean, median
from typing import Any

from bench.common import Measurement, config_path, document_head, loadavg, machine_info, scalars
from common.process import run_main


# -- launcher ----------------------------------------------------------------------------
def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rounds", type=int, default=12, help="rotations of on / off / no-op blocks")
    p.add_argument("--block", type=int, default=25, help="steps per block")
    p.add_argument("--interval", type=int, default=50, help="steps between the base and the delta snapshot")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--timeout-s", type=float, default=1200)
    p.add_argument("--out", type=Path)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def run(argv: list[str], prog: str = "python -m bench.run --suite tracker") -> dict[str, Any]:
    """Spawn the ranks, print and (`--out`) write the result document; return it."""
    from launch.ranks import start_ranks

    args, rest = parser(prog).parse_known_args(argv)
    config = config_path(args.config)
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="tracker-bench-") as tmp:
        worker_args = ["--worker", "--rounds", str(args.rounds), "--block", str(args.block), "--warmup", str(args.warmup),
                       "--interval", str(args.interval), "--repeats", str(args.repeats)]  # fmt: skip
        threads = str(max(1, (os.cpu_count() or 1) // args.ranks))
        group = start_ranks(
            config,
            rest,
            Path(tmp),
            args.ranks,
            args.timeout_s,
            module="bench.tracker_overhead",
            extra_args=worker_args,
            env_extra={"OMP_NUM_THREADS": threads},
        )
        results = group.wait()
    machine["loadavg_end"] = loadavg()
    ranks = [json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("{"))) for r in results]
    worst = lambda key, sub: max(r[sub][key] for r in ranks)  # noqa: E731
    result = {
        **document_head("tracker", prog, argv, machine),
        "config": config,
        "overrides": rest,
        "settings": {
            "ranks": args.ranks,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "block": args.block,
            "interval": args.interval,
            "repeats": args.repeats,
        },
        "summary": {
            "step_ms_without_tracker": worst("step_ms_off", "tracker"),
            "step_ms_with_tracker": worst("step_ms_on", "tracker"),
            "step_time_ratio_with_over_without": worst("ratio_on_over_off", "tracker"),
            "mean_step_time_ratio_with_over_without": worst("mean_ratio_on_over_off", "tracker"),
            "noise_control_noop_hook_ratio": worst("ratio_noop_over_off", "tracker"),
            "noise_control_noop_hook_mean_ratio": worst("mean_ratio_noop_over_off", "tracker"),
            "hook_ms_per_step": worst("hook_ms_per_step", "tracker"),
            "hook_fraction_of_step": worst("hook_fraction_of_step", "tracker"),
            "hook_ms_per_64k_ids": worst("hook_ms_per_64k_ids", "tracker"),
            "micro_hook_ms_64k_ids": worst("micro_hook_ms_64k_ids", "tracker"),
            "torchrec_tracker_step_time_ratio_over_without": worst("ratio_mdt_over_off", "tracker"),
            "torchrec_tracker_mean_step_time_ratio_over_without": worst("mean_ratio_mdt_over_off", "tracker"),
            "torchrec_tracker_hook_ms_per_step": worst("mdt_hook_ms_per_step", "tracker"),
            "torchrec_tracker_read_ms_per_block": worst("mdt_read_ms_per_block", "tracker"),
            "listing_interval_steps": args.interval,
            "deltarec_listing_ms": worst("deltarec_listing_ms", "listing"),
            "torchrec_tracker_listing_ms": worst("torchrec_listing_ms", "listing"),
            "trackers_name_the_same_rows": all(r["listing"]["same_rows"] for r in ranks),
            "delta_stall_ms": worst("stall_ms", "delta"),
            "delta_bare_index_select_ms": worst("bare_ms", "delta"),
            "delta_stall_over_bare": worst("ratio", "delta"),
            "delta_find_rows_ms": worst("find_rows_ms", "delta"),
            "full_stall_ms": worst("stall_ms", "full"),
            "full_bare_clone_ms": worst("bare_ms", "full"),
            "full_stall_over_bare": worst("ratio", "full"),
        },
        "ranks": ranks,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """The summary: the slower rank's figures."""
    return scalars(result["summary"], {"config": result["config"], "ranks": result["settings"]["ranks"]})


# -- one rank ----------------------------------------------------------------------------
def worker(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch
    import torch.distributed as dist
    from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec
    from torchrec.distributed.model_tracker.types import TrackingMode
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from bench.ckpt_rank import BareCopier, find_rows
    from bench.job import start_job, stop_job
    from ckpt.capture.host_buffers import HostBufferPool
    from ckpt.capture.snapshot import SnapshotTaker
    from ckpt.capture.tracker import RowTracker
    from sharding.shard_views import ShardMap
    from trainer.config import load_config

    cfg = load_config(args.config, ["train.eval_batches=0", *overrides])
    env, device, sharded, trainer, _ = start_job(cfg)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    smap = ShardMap.from_model(sharded.model)
    tracker = RowTracker(smap)

    # Time the hook from inside: wrap the registered callback.
    sebc = tracker.sharded_ebc
    hook_s = [0.0]
    hook_ids = [0]

    def timed(features, embs, module, raw):
        t = time.perf_counter()
        tracker.record_lookup(features, embs, module, raw)
        hook_s[0] += time.perf_counter() - t
        if features.keys() and tracker.lookup_groups[tuple(features.keys())].any_tracked:
            hook_ids[0] += features.values().numel()

    def noop(features, embs, module, raw):
        return None

    # TorchRec's tracker registers its hook in the same slot as RowTracker's: built here (which
    # takes the slot), its callback is kept, timed like ours, and the slot handed back by `attach`.
    mdt = ModelDeltaTrackerTrec(sharded.model, consumers=["bench"], delete_on_read=True, mode=TrackingMode.ID_ONLY)
    mdt_s = [0.0]

    def timed_mdt(features, embs, module, raw):
        t = time.perf_counter()
        mdt.record_lookup(features, embs, module, raw)
        mdt_s[0] += time.perf_counter() - t

    hooks = {"on": timed, "off": None, "noop": noop, "mdt": timed_mdt}  # noop: a hook doing nothing (the A/A control)

    def attach(mode: str) -> None:
        sebc.post_lookup_tracker_fn = hooks[mode]

    attach("on")
    for _ in range(args.warmup):
        trainer.train_step()
    times: dict[str, list[float]] = {m: [] for m in hooks}
    hook_s[0], hook_ids[0], mdt_s[0] = 0.0, 0, 0.0
    mdt_reads: list[float] = []
    modes = ("on", "off", "noop", "mdt")
    for r in range(args.rounds):
        for mode in modes[r % 4 :] + modes[: r % 4]:  # each mode in each position once per 4 rounds
            attach(mode)
            dist.barrier()
            for _ in range(args.block):
                t = time.perf_counter()
                if mode == "mdt":
                    mdt.step()  # its batch index, before the forward pass (as DistributedModelParallel.forward does)
                trainer.train_step()
                times[mode].append(time.perf_counter() - t)
            if mode == "mdt":
                t = time.perf_counter()
                mdt.get_unique_ids("bench")  # what a consumer reads (and the store then drops)
                mdt_reads.append(time.perf_counter() - t)
    attach("on")
    steps_on = len(times["on"])
    med = {m: median(v) * 1e3 for m, v in times.items()}
    mean = {m: fmean(v) * 1e3 for m, v in times.items()}
    hook_ms_per_step = hook_s[0] * 1e3 / steps_on
    tr = {
        "steps_per_mode": steps_on,
        "step_ms_on": med["on"],
        "step_ms_off": med["off"],
        "step_ms_noop": med["noop"],
        "ratio_on_over_off": med["on"] / med["off"],
        "ratio_noop_over_off": med["noop"] / med["off"],
        "mean_step_ms_on": mean["on"],
        "mean_step_ms_off": mean["off"],
        "mean_step_ms_noop": mean["noop"],
        "mean_ratio_on_over_off": mean["on"] / mean["off"],
        "mean_ratio_noop_over_off": mean["noop"] / mean["off"],
        "hook_ms_per_step": hook_ms_per_step,
        "ids_per_step": hook_ids[0] / steps_on,
        "hook_fraction_of_step": hook_ms_per_step / med["off"],
        "hook_ms_per_64k_ids": hook_s[0] * 1e3 / max(hook_ids[0], 1) * 65536,
        "step_ms_mdt": med["mdt"],
        "ratio_mdt_over_off": med["mdt"] / med["off"],
        "mean_step_ms_mdt": mean["mdt"],
        "mean_ratio_mdt_over_off": mean["mdt"] / mean["off"],
        "mdt_hook_ms_per_step": mdt_s[0] * 1e3 / len(times["mdt"]),
        "mdt_read_ms_per_block": median(mdt_reads) * 1e3,
    }
    listing = compare_listings(trainer, tracker, mdt, smap, sebc, args.interval)
    # Micro: one lookup batch of 64k ids into the largest tracked lookup group.
    m = max(tracker.lookup_groups.values(), key=lambda lm: sum(i is not None for i in lm.shards))
    rows = torch.tensor([1 if i is None else smap.shards[i].num_rows for i in m.shards])
    stride = 65536 // len(m.keys)
    values = (torch.rand(len(m.keys), stride) * rows[:, None]).long().view(-1)
    kjt = KeyedJaggedTensor(
        keys=list(m.keys), values=values, lengths=torch.ones(values.numel(), dtype=torch.int32), stride=stride
    )
    sebc.train()
    micro = []
    for _ in range(50):
        t = time.perf_counter()
        tracker.record_lookup(kjt, None, sebc, None)
        micro.append(time.perf_counter() - t)
    tr["micro_hook_ms_64k_ids"] = median(micro[5:]) * 1e3
    tr["micro_ids"] = values.numel()

    # Snapshot stall vs a bare index_select of the same rows, both into reused memory.
    taker = SnapshotTaker(smap, tracker, device, pool=HostBufferPool(cfg.ckpt.write.max_pending_bytes))
    tracker.mark_base()
    for _ in range(args.interval):
        trainer.train_step()
    locals_ = [tracker.touched_rows(i, False) for i in range(len(smap.shards))]
    sizes = {"delta": 0, "full": 0}

    def take(full: bool) -> float:
        snap = taker.take(1, trainer.step, full=full, since_base=False)
        sizes["full" if full else "delta"] = snap.nbytes
        snap.release()  # as the writer does once the rows are written
        return snap.stall_s

    copier = BareCopier()

    def bare(full: bool) -> float:
        return copier.copy(smap.shards, [None] * len(locals_) if full else locals_)

    def find() -> float:
        return find_rows(tracker, len(smap.shards), False)

    times_: dict[str, list[float]] = {"take_delta": [], "bare_delta": [], "take_full": [], "bare_full": [], "find": []}
    for r in range(args.repeats):  # alternate the order: fresh host memory costs page faults to whoever comes first
        for name in ("take", "bare") if r % 2 == 0 else ("bare", "take"):
            fn = take if name == "take" else bare
            times_[f"{name}_delta"].append(fn(False))
            times_[f"{name}_full"].append(fn(True))
        times_["find"].append(find())
    stall, bare_ms = median(times_["take_delta"]), median(times_["bare_delta"])
    fstall, fbare = median(times_["take_full"]), median(times_["bare_full"])
    nbytes, full_nbytes = sizes["delta"], sizes["full"]
    rows_delta = sum(int(i.numel()) for i in locals_)
    total_rows = sum(v.num_rows for v in smap.shards)
    delta = {
        "interval_steps": args.interval,
        "rows": rows_delta,
        "fraction_of_rows": rows_delta / max(total_rows, 1),
        "bytes": nbytes,
        "stall_ms": stall * 1e3,
        "bare_ms": bare_ms * 1e3,
        "ratio": stall / bare_ms,
        "GB_per_s": nbytes / stall / 1e9,
        "find_rows_ms": median(times_["find"]) * 1e3,  # the nonzero scans of the bitmaps, part of the stall
    }
    full = {
        "rows": total_rows,
        "bytes": full_nbytes,
        "stall_ms": fstall * 1e3,
        "bare_ms": fbare * 1e3,
        "ratio": fstall / fbare,
        "GB_per_s": full_nbytes / fstall / 1e9,
    }
    print(
        json.dumps(
            {
                "rank": env.rank,
                "threads": torch.get_num_threads(),
                "tracker": tr,
                "listing": listing,
                "delta": delta,
                "full": full,
            }
        ),
        flush=True,
    )
    trainer = tracker = taker = smap = sharded = mdt = None  # released before the process group goes
    stop_job()
    return 0


def compare_listings(trainer: Any, tracker: Any, mdt: Any, smap: Any, sebc: Any, steps: int) -> dict[str, Any]:
    """Both trackers listen to the same `steps` steps (one hook calling both); then each lists
    the rows a delta checkpoint would copy: deltarec's bitmap scan per shard, TorchRec's
    deduplicated ids per table (shard-local ids: post-lookup, after input distribution).
    Whether they agree, table by table, on the tables this rank holds shards of."""
    from bench.ckpt_rank import touched

    def both(features, embs, module, raw):
        tracker.record_lookup(features, embs, module, raw)
        mdt.record_lookup(features, embs, module, raw)

    tracker.mark_base()
    # nothing to drop from `mdt`: the rotation read it after its last block (and a read with no
    # new batch raises in torchrec 1.8: `torch.cat` of no ids)
    sebc.post_lookup_tracker_fn = both
    for _ in range(steps):
        mdt.step()
        trainer.train_step()
    sebc.post_lookup_tracker_fn = tracker.record_lookup
    rows, deltarec_s = touched(tracker, len(smap.shards), False)
    t = time.perf_counter()
    ids = mdt.get_unique_ids("bench")
    torchrec_s = time.perf_counter() - t
    theirs = {fqn.rsplit(".", 1)[-1]: set(v.tolist()) for fqn, v in ids.items()}
    ours: dict[str, set[int]] = {}
    for shard, local in zip(smap.shards, rows):
        ours.setdefault(smap.table_info[shard.table].name, set()).update(local.tolist())  # by name, as theirs
    # data-parallel tables are in no shard of ours (the dense optimizer trains them; they travel in
    # the dense file) but their lookups pass the same hook, so torchrec lists them too
    differ = sorted(t for t in ours if ours[t] != theirs.get(t, set()))
    return {
        "steps": steps,
        "deltarec_listing_ms": deltarec_s * 1e3,
        "torchrec_listing_ms": torchrec_s * 1e3,
        "rows": sum(len(v) for v in ours.values()),
        "same_rows": not differ,
        "tables_differing": differ,
        "tables_only_torchrec_lists": sorted(set(theirs) - set(ours)),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, rest = parser("python -m bench.tracker_overhead").parse_known_args(argv)
    if args.worker:  # one rank, spawned by `run`
        return worker(args, rest)
    run(argv, "python -m bench.tracker_overhead")
    return 0


if __name__ == "__main__":
    run_main(main)
