"""One rank of `bench.ckpt_bench`'s training runs: `trainer.main`, with the stall instrumented.

    DELTAREC_BENCH_SIDE=<dir> python -m bench.ckpt_rank --config ... [key=value ...]

Runs the real trainer (same argv as `trainer.main`) and, per checkpoint, records in
``<dir>/rank<r>.jsonl`` what this rank did, without adding anything to the stall:

- ``take_ms``: `SnapshotTaker.take` alone (its own `Snapshot.stall_s`, read before the
  manager overwrites it with the whole stall);
- ``stall_ms``: the manager's whole stall on this rank (what ``ckpt_stall_ms`` reports as
  the max over ranks): agreement all-reduces, take, tracker marks, dense capture;
  ``agree_ms``: the part spent in the manager's two all-reduces (row counts, flags), which
  includes waiting for the other rank to reach the checkpoint;
- ``bare_ms``: a bare ``index_select`` (``clone`` for a full checkpoint) of exactly the rows
  that take copied, weights and every optimizer state, from the same live tensors. It runs
  *after* the checkpoint, at the first step end where this rank's writer holds nothing
  (so it neither inflates the stall nor competes with this rank's writer thread), three
  times; ``find_ms`` is the bitmap scan take does first (``touched_rows``), timed on the
  bitmaps of that later moment (its cost depends on the bitmap size, not on its content);
- ``write_s`` / ``write_bytes``: this rank's writer (encode + frame + produce + flush);
- ``since_base`` / ``since_last``: the all-reduced fractions of rows the policy saw;
- ``committed_at_step``: the training step at which this rank learned the checkpoint's
  outcome (the step end whose `save` collected it; the last step for outcomes collected
  by `finish`), i.e. from when a crash would have restored it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from statistics import median
from typing import Any, Sequence

import torch

BARE_REPEATS = 3


def bare_copy(shards: Sequence[Any], locals_: Sequence[torch.Tensor | None]) -> float:
    """Seconds to copy the given local rows (None: every row) of each shard: weights and
    every optimizer state, with plain `index_select` / `clone` into fresh tensors (the
    same copy as `bench.tracker_overhead`'s bare baseline)."""
    t = time.perf_counter()
    out = []
    for v, idx in zip(shards, locals_):
        if idx is None:
            out.append([v.weight.detach().clone(), *(s.detach().clone() for s in v.optimizer_states.values())])
        else:
            out.append([v.weight.detach().index_select(0, idx),
                        *(s.detach().index_select(0, idx) for s in v.optimizer_states.values())])
    dt = time.perf_counter() - t
    del out
    return dt


def find_rows(tracker: Any, n_shards: int, since_base: bool) -> float:
    t = time.perf_counter()
    found = [tracker.touched_rows(i, since_base) for i in range(n_shards)]
    dt = time.perf_counter() - t
    del found
    return dt


class _Recorder:
    def __init__(self, side: Path, rank: int) -> None:
        self.path = side / f"rank{rank}.jsonl"
        self.rank = rank
        self.records: dict[int, dict[str, Any]] = {}
        self.pending: list[tuple[int, Any, list[torch.Tensor | None], bool, bool]] = []  # global ids (None: all)
        self.fractions: list[tuple[float, float]] = []
        self.lock = threading.Lock()
        self.total_rows = 0
        self.agree_s = 0.0

    def rec(self, cid: int) -> dict[str, Any]:
        with self.lock:
            return self.records.setdefault(cid, {"rank": self.rank, "ckpt_id": cid})

    def measure_pending(self) -> None:
        """Bare copies of the rows of every checkpoint taken since the last call."""
        while self.pending:
            cid, taker, rows, full, since_base = self.pending.pop(0)
            shards = taker.shard_map.shards
            locals_ = [None if g is None else g - v.row_offset for g, v in zip(rows, shards)]  # untimed
            times = [bare_copy(shards, locals_) * 1e3 for _ in range(BARE_REPEATS)]
            r = self.rec(cid)
            r["bare_ms_all"] = times
            r["bare_ms"] = median(times)
            r["bare_ms_first"] = times[0]
            r["find_ms"] = 0.0 if full else find_rows(taker.tracker, len(shards), since_base) * 1e3

    def dump(self) -> None:
        with self.path.open("w") as f:
            for cid in sorted(self.records):
                f.write(json.dumps(self.records[cid], sort_keys=True) + "\n")


def install(side: Path, rank: int) -> _Recorder:
    """Wrap the checkpoint path's classes (this process only) to record what it does."""
    from ckpt import manager as manager_module
    from ckpt.manager import CheckpointManager
    from ckpt.snapshot import SnapshotTaker
    from ckpt.writer import RankWriter

    r = _Recorder(side, rank)
    real_dist = manager_module.dist

    class _TimedDist:
        """torch.distributed as the manager module sees it, with all_reduce timed."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real_dist, name)

        def all_reduce(self, *a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return real_dist.all_reduce(*a, **kw)
            finally:
                r.agree_s += time.perf_counter() - t

    manager_module.dist = _TimedDist()  # this process only
    orig_take, orig_agree = SnapshotTaker.take, CheckpointManager._agree
    orig_submit, orig_write = RankWriter.submit, RankWriter._write
    orig_save, orig_finish, orig_init = CheckpointManager.save, CheckpointManager.finish, CheckpointManager.__init__
    orig_checkpoint = CheckpointManager._checkpoint
    orig_record = CheckpointManager._record

    def init(self, *a: Any, **kw: Any) -> None:
        orig_init(self, *a, **kw)
        r.total_rows = self.total_rows

    def checkpoint(self, step: int, final: bool = False) -> None:
        r.agree_s = 0.0
        orig_checkpoint(self, step, final)

    def record(self, o: Any) -> None:
        r.rec(o.checkpoint_id).update(committed_at_step=self.trainer.step, committed=o.committed)
        orig_record(self, o)

    def agree(self):
        out = orig_agree(self)
        r.fractions.append(self.agreed_fractions)  # a list append: nothing in the stall
        return out

    def take(self, checkpoint_id: int, step: int, *, full: bool, since_base: bool):
        snap = orig_take(self, checkpoint_id, step, full=full, since_base=since_base)
        rows = [None if full else s.global_rows for s in snap.shards]  # keep the ids; locals computed later
        r.pending.append((checkpoint_id, self, rows, full, since_base))
        fb, fl = r.fractions[-1] if r.fractions else (float("nan"), float("nan"))
        rec = r.rec(checkpoint_id)
        rec.update(step=step, full=full, since_base=since_base, take_ms=snap.stall_s * 1e3, rows=snap.rows,
                   snapshot_bytes=snap.nbytes, frac_since_base=fb, frac_since_last=fl, rank_total_rows=r.total_rows,
                   agree_ms=r.agree_s * 1e3)
        return snap

    def submit(self, job: Any) -> None:
        r.rec(job.checkpoint_id)["stall_ms"] = job.snapshot.stall_s * 1e3  # the manager's whole stall
        orig_submit(self, job)

    def write(self, job: Any):
        report = orig_write(self, job)
        r.rec(job.checkpoint_id).update(write_s=report.write_s, write_bytes=report.bytes, write_ok=report.ok,
                                         weight_codec=job.weight_codec)
        return report

    def save(self, step: int) -> None:
        if r.pending and self.writer.pending_bytes == 0:
            r.measure_pending()
        orig_save(self, step)

    def finish(self, step: int) -> None:
        orig_finish(self, step)  # may take the final checkpoint; closes the writer
        r.measure_pending()
        r.dump()

    SnapshotTaker.take = take
    CheckpointManager._agree = agree
    RankWriter.submit = submit
    RankWriter._write = write
    CheckpointManager.save = save
    CheckpointManager.finish = finish
    CheckpointManager.__init__ = init
    CheckpointManager._checkpoint = checkpoint
    CheckpointManager._record = record
    return r


def main(argv: Sequence[str] | None = None) -> int:
    side = Path(os.environ["DELTAREC_BENCH_SIDE"])
    install(side, int(os.environ.get("RANK", "0")))
    from trainer.main import main as train_main

    return train_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
