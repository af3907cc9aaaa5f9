"""One rank of the checkpointing training runs (`bench.ckpt_bench`, `bench.peers`): the
trainer's job with checkpoints, and per checkpoint what this rank's stall was made of.

    python -m bench.ckpt_rank --config C --side DIR [key=value ...]

The job is built and trained as `trainer.main` does (`bench.job.start_job`, the checkpointer from
`trainer.main.make_checkpointer`, `restore`, `Trainer.fit`, `finish`). What it records
in ``DIR/rank<r>.jsonl`` (one `RankCheckpoint` per line) comes from the checkpointer's public
stats, read after each step end, never from inside the stall:

- from `manager.stats.stalls` (`StallTiming`): ``stall_ms`` (the whole stall on this rank,
  what ``ckpt_stall_ms`` reports as the max over ranks), ``agree_ms`` (the agreement on the
  checkpoint's kind: tracker counts and two small all-reduces, which include waiting for the
  other ranks), ``take_ms`` (`SnapshotTaker.take`), ``dense_ms`` (tracker marks, dense
  state), ``rows``, ``snapshot_bytes``, ``since_base`` / ``since_last`` (the
  all-reduced fractions of rows changed that the policy saw); with ``ckpt.capture.overlap_copy``
  (``overlapped``) the copy ran beside the next step, and the stall is the hand-off plus
  ``wait_ms``, that step waiting for the copy; its record appears during that step;
- from `manager.stats.outcomes`: ``committed`` and ``committed_at_step``, the step end at
  which this rank learned the outcome (the last step for outcomes `finish` collects), and
  ``durable_at_step``, the first step end (the wall time this rank's step called the checkpointer)
  at or after the moment its COMMIT marker was durable (`Outcome.commit_unix`): a crash after
  that step restores this checkpoint, whether or not the ranks had learned of it yet;
- a bare baseline: ``bare_ms_all``, a plain ``index_select`` (``copy_`` for a full
  checkpoint) of exactly the rows the checkpoint copied, weights and every optimizer state,
  from the same live tensors into reused buffers (`BareCopier`; from GPU shards into pinned
  host buffers, as a snapshot copies), three times (`bare_repeats`). It runs once
  training is over (`ObservedCheckpointer.finish`, after the CPU figures below are taken),
  so it inflates neither the stall nor the throughput and CPU the suites measure, and does
  not compete with the writer. (Run at step ends, a full checkpoint's three copies of every
  row, with their buffers faulted in, took seconds of the training thread on the full-size
  model, which the cost suite counted as the checkpoint's cost.) ``find_ms`` is the bitmap
  scan (`RowTracker.touched_rows`) that found those rows, the scan `take` starts with.
  Until then each delta's rows wait in a file under ``DIR/bare_rows_rank<r>/``, not in the
  rank's memory, which suite `scale` measures as the checkpoint's (writing it costs the
  checkpoint's step end a few MB into the page cache, 8 bytes per changed row).

And in ``DIR/cpu_rank<r>.json`` (`RankCpu`), the CPU seconds of this rank's threads by class
(`bench.cpu`: training thread, checkpoint threads, librdkafka's threads, the rest, and the rest
by thread name) from the first step until its writer is idle, and the training thread's share
inside the stalls. A job run with ``ckpt.enabled=false`` writes only this file and the next: the baseline
the checkpoint's cost is measured against. In ``DIR/mem_rank<r>.json`` (`RankMemory`): the
rank's resident set before the first step and its peak while training (sampled), its shards'
bytes, and the host buffers' bound and peak (suite `scale`).

Why one hook remains: the rows a delta copies are known only before its checkpoint marks the
tracker, so `ObservedCheckpointer` stands in for the checkpointer as the loop's `Checkpointer`
and scans the tracker at checkpoint steps before calling the checkpointer's public `save`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

import torch

from bench.common import ratio
from common.process import run_main

if TYPE_CHECKING:
    from bench.job import Job
    from ckpt.capture.tracker import RowTracker
    from ckpt.checkpointer import Checkpointer
    from ckpt.save.handoff import StallTiming
    from trainer.config import JobConfig

BARE_REPEATS = 3


class BareCopier:
    """The stall's baseline: a plain copy of the given local rows (None: every row) of each
    shard, weights and every optimizer state, with ``index_select(out=)`` / ``copy_`` into
    buffers this object keeps for the next copy, as `take` carves its snapshots from reused
    slabs (the stall's goal compares it with exactly this). A buffer that must grow is
    replaced by a zero-filled one before the clock starts, so no copy pays page faults.

    GPU shards: the copy a snapshot makes, to host memory. The rows are gathered on the
    device into a reused temporary and copied into reused pinned host buffers, the device
    synchronised before the clock starts and before it stops (`bench.gpu`'s bare copy)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, int], torch.Tensor] = {}
        self._tmps: dict[tuple[int, int], torch.Tensor] = {}

    @staticmethod
    def _reuse(
        bufs: dict[tuple[int, int], torch.Tensor],
        key: tuple[int, int],
        src: torch.Tensor,
        n: int,
        device: torch.device,
        pinned: bool,
    ) -> torch.Tensor:
        buf = bufs.get(key)
        if buf is None or buf.shape[0] < n or buf.shape[1:] != src.shape[1:] or buf.dtype != src.dtype:
            # zeros touch every page; pinned host memory is page-locked when allocated
            buf = torch.zeros((n, *src.shape[1:]), dtype=src.dtype, device=device, pin_memory=pinned)
            bufs[key] = buf
        return buf[:n]

    def copy(self, shards: Sequence[Any], locals_: Sequence[torch.Tensor | None]) -> float:
        """Seconds to copy those rows into this object's buffers (on the host)."""
        from bench.job import sync

        work = []
        devices = set()
        for i, (v, idx) in enumerate(zip(shards, locals_)):
            if idx is not None:
                idx = idx.to(v.weight.device)  # the tracker's rows live with its bitmaps (no-op where they are)
            for j, src in enumerate([v.weight.detach(), *(s.detach() for s in v.optimizer_states.values())]):
                n = src.shape[0] if idx is None else int(idx.numel())
                cuda = src.device.type == "cuda"
                devices.add(src.device)
                out = self._reuse(self._bufs, (i, j), src, n, torch.device("cpu"), pinned=cuda)
                tmp = self._reuse(self._tmps, (i, j), src, n, src.device, False) if cuda and idx is not None else None
                work.append((src, idx, out, tmp))
        for d in devices:
            sync(d)
        t = time.perf_counter()
        for src, idx, out, tmp in work:
            if idx is None:
                out.copy_(src, non_blocking=True)  # a device-to-host copy into pinned memory; on CPU a plain copy
            elif tmp is None:
                torch.index_select(src, 0, idx, out=out)
            else:
                torch.index_select(src, 0, idx, out=tmp)
                out.copy_(tmp, non_blocking=True)
        for d in devices:
            sync(d)
        return time.perf_counter() - t


def find_rows(tracker: RowTracker, n_shards: int, since_base: bool) -> float:
    """Seconds of the bitmap scans that list every shard's changed rows."""
    return touched(tracker, n_shards, since_base)[1]


def touched(tracker: RowTracker, n_shards: int, since_base: bool) -> tuple[list[torch.Tensor], float]:
    """(every shard's changed local rows, seconds the scans took)."""
    t = time.perf_counter()
    rows = [tracker.touched_rows(i, since_base) for i in range(n_shards)]
    return rows, time.perf_counter() - t


@dataclass
class RankCheckpoint:
    """What one rank measured of one checkpoint (milliseconds unless named otherwise)."""

    checkpoint_id: int
    step: int
    full: bool
    stall_ms: float
    agree_ms: float
    take_ms: float
    dense_ms: float
    rows: int
    snapshot_bytes: int
    since_base: float
    since_last: float
    rank: int
    rank_total_rows: int  # rows of this rank's model-parallel shards (what the tracker counts)
    committed: bool | None = None
    committed_at_step: int | None = None
    durable_at_step: int | None = None
    find_ms: float | None = None
    bare_ms_all: list[float] = field(default_factory=list)
    overlapped: bool = False  # the copy (take_ms, dense_ms) ran beside the next step, not in the stall
    wait_ms: float = 0.0  # of stall_ms: the next step waiting for that copy

    @property
    def other_ms(self) -> float:
        """The stall besides the agreement and the copy (or, the copy overlapping the next
        step, the wait for it): tracker marks, dense state, loop state, the hand-off."""
        return self.stall_ms - self.agree_ms - (self.wait_ms if self.overlapped else self.take_ms)

    @property
    def bare_ms(self) -> float | None:
        """Median of the bare copies."""
        return median(self.bare_ms_all) if self.bare_ms_all else None


@dataclass
class _ToCopy:
    """A checkpoint whose bare copy is still to run: its record and the local rows it copied
    (None: every row of every shard), held in memory or, when `spilled` names a file, in it."""

    record: RankCheckpoint
    rows: list[torch.Tensor] | None
    spilled: Path | None = None

    def local_rows(self, n_shards: int) -> list[torch.Tensor | None]:
        """Every shard's rows to copy (None: all of that shard's), read back when spilled."""
        if self.spilled is not None:
            rows: list[torch.Tensor] = torch.load(self.spilled, weights_only=True)
            self.spilled.unlink()
            return list(rows)
        return [None] * n_shards if self.rows is None else list(self.rows)


class ObservedCheckpointer:
    """The loop's `Checkpointer`: the checkpointer's `save`, plus what this rank measures around it.

    Before a step end that checkpoints (`ckpt.schedule.interval_steps`), it lists the rows the delta
    will copy (the tracker forgets them once the checkpoint marks it); after each step end it
    reads the checkpointer's new `StallTiming`s and outcomes; after training (`finish`) it times
    the bare copies."""

    def __init__(
        self,
        manager: Checkpointer,
        rank: int,
        copier: BareCopier | None = None,
        bare_repeats: int = BARE_REPEATS,
        spill_dir: Path | None = None,
    ) -> None:
        self.manager = manager
        # where each delta's rows wait for the bare copies, off this process's heap: kept in
        # memory they would count as the checkpoint's own host memory (suite `scale`)
        self.spill_dir = spill_dir
        self.rank = rank
        self.since_base = manager.cfg.schedule.policy != "incremental"  # what a delta of this policy copies
        self.records: dict[int, RankCheckpoint] = {}
        self.to_copy: list[_ToCopy] = []
        self.copier = copier or BareCopier()  # one copier for several jobs of a process keeps its buffers
        self.bare_repeats = bare_repeats  # 0: no bare copies
        self._scans: dict[int, tuple[list[torch.Tensor], float]] = {}  # step -> rows listed before its save
        self._stalls_seen = 0  # a stall is recorded once its copy is done: with `ckpt.capture.overlap_copy`
        self._outcomes_seen = 0  # during the next step, so both lists are read past what was seen
        self._step_ends: deque[tuple[int, float]] = deque()  # (step, time.time() as its step end began)

    def steps_at_risk(self) -> tuple[float, int] | None:
        return self.manager.steps_at_risk()

    def save(self, step: int) -> None:
        """The checkpointer's `save(step)`, observed."""
        interval = self.manager.cfg.schedule.interval_steps
        due = interval > 0 and step % interval == 0
        self._observe(step, lambda: self.manager.save(step), scan=due)

    def finish(self, step: int) -> None:
        """The checkpointer's `finish(step)` (which may take the final checkpoint), observed; then
        every checkpoint's bare copy, the writer idle and training over."""
        self._observe(step, lambda: self.manager.close(step), scan=True)
        self._copy_bare()

    def _observe(self, step: int, call: Callable[[], None], scan: bool) -> None:
        """Run `call` (a checkpointer method at this step end); turn what the checkpointer's stats gained
        since the last look into records. `scan`: list the changed rows first (a checkpoint may
        be taken)."""
        m, st = self.manager, self.manager.stats
        self._step_ends.append((step, time.time()))
        if scan:  # not while a copy beside training changes the bitmaps (a torn scan lists garbage)
            m.wait_for_copy()
            self._scans[step] = touched(m.stages.tracker, len(m.stages.shard_map.shards), self.since_base)
        call()
        for timing in st.stalls.since(self._stalls_seen):
            rec = self._record(timing)
            self.records[rec.checkpoint_id] = rec
            rows, find_s = self._scans.get(timing.step, (None, 0.0))
            if timing.full:
                self.to_copy.append(_ToCopy(rec, None))
            elif rows is not None:
                rec.find_ms = find_s * 1e3
                self.to_copy.append(self._held(rec, rows))
            # else a time-based checkpoint (`ckpt.schedule.interval_s`) whose rows were not listed: no bare copy
        self._stalls_seen = st.stalls.total
        self._scans = {s: v for s, v in self._scans.items() if s >= step}
        for outcome in st.outcomes.since(self._outcomes_seen):
            rec = self.records.get(outcome.checkpoint_id)
            if rec is not None:
                rec.committed, rec.committed_at_step = outcome.committed, step
                if outcome.committed:  # commits come in order: step ends before this one serve no later one
                    while self._step_ends and self._step_ends[0][1] < outcome.commit_unix:
                        self._step_ends.popleft()
                    rec.durable_at_step = self._step_ends[0][0] if self._step_ends else step + 1
        self._outcomes_seen = st.outcomes.total

    def _held(self, rec: RankCheckpoint, rows: list[torch.Tensor]) -> _ToCopy:
        if self.spill_dir is None:
            return _ToCopy(rec, rows)
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        path = self.spill_dir / f"rows_{rec.checkpoint_id}.pt"
        torch.save([r.cpu() for r in rows], path)
        return _ToCopy(rec, None, path)

    def _record(self, t: StallTiming) -> RankCheckpoint:
        return RankCheckpoint(
            checkpoint_id=t.checkpoint_id,
            step=t.step,
            full=t.full,
            stall_ms=t.stall_ms,
            agree_ms=t.agree_ms,
            take_ms=t.take_ms,
            dense_ms=t.dense_ms,
            rows=t.rows,
            snapshot_bytes=t.snapshot_bytes,
            overlapped=t.overlapped,
            wait_ms=t.wait_ms,
            since_base=t.since_base,
            since_last=t.since_last,
            rank=self.rank,
            rank_total_rows=self.manager.stages.total_rows,
            find_ms=0.0 if t.full else None,
        )

    def _copy_bare(self) -> None:
        shards = self.manager.stages.shard_map.shards
        while self.to_copy:
            item = self.to_copy.pop(0)
            rows = item.local_rows(len(shards))
            item.record.bare_ms_all = [self.copier.copy(shards, rows) * 1e3 for _ in range(self.bare_repeats)]
        if self.spill_dir is not None and self.spill_dir.is_dir() and not any(self.spill_dir.iterdir()):
            self.spill_dir.rmdir()

    def dump(self, path: Path) -> None:
        """This rank's records, one JSON line per checkpoint, in checkpoint order."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for cid in sorted(self.records):
                f.write(json.dumps(asdict(self.records[cid]), sort_keys=True) + "\n")


def read_side(path: Path) -> list[RankCheckpoint]:
    """The records `ObservedCheckpointer.dump` wrote."""
    return [RankCheckpoint(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class RankCpu:
    """CPU seconds this rank's threads spent while training (`bench.cpu` classes), from the
    first step to the moment its writer had nothing left to write."""

    rank: int
    steps: int
    checkpoints: int
    threads: dict[str, float]  # class -> CPU seconds
    stall_cpu_s: float  # the training thread's CPU inside checkpoint stalls (`StallTiming.cpu_ms`)
    wall_s: float
    other_by_name: dict[str, float] = field(default_factory=dict)  # the `other` class by thread name
    writer_by_name: dict[str, float] = field(default_factory=dict)  # the `writer` class by thread name
    faults: dict[str, int] = field(default_factory=dict)  # class -> minor page faults


@dataclass
class RankMemory:
    """This rank's resident memory while it trained (`bench.memory`), beside the bytes its
    checkpointing may hold by design: what suite `scale` compares."""

    rank: int
    model_bytes: int  # this rank's embedding shards: weights and sparse optimizer state
    rss_before_bytes: int  # built and restored, before the first step
    rss_peak_bytes: int  # the largest resident set from the first step until the writer was idle
    rss_peak_late_bytes: int  # ... over the second half of that time: the steady state after a first full checkpoint
    rss_end_bytes: int  # once the writer was idle
    hwm_bytes: int  # VmHWM at the end: the peak since the process started (construction included)
    pool_keep_bytes: int = 0  # `ckpt.write.max_pending_bytes`: the host buffers' bound (0: checkpoints off)
    pool_peak_bytes: int = 0  # the host buffers' largest capacity held at once, lent and free
    pinned: bool = False  # the host buffers are page-locked (a CUDA job)
    rss_anon_end_bytes: int = 0  # the end's resident set, its private part (RssAnon) ...
    rss_file_end_bytes: int = 0  # ... and its mapped files (RssFile: libraries' code, shared by every process mapping them)


def model_bytes(sharded: Any) -> int:
    """Bytes of this rank's embedding shards, weights and every sparse optimizer state."""
    from sharding.shard_views import ShardMap

    return sum(
        v.weight.numel() * v.weight.element_size() + sum(t.numel() * t.element_size() for t in v.optimizer_states.values())
        for v in ShardMap.from_model(sharded.model).shards
    )


def read_memory(path: Path) -> RankMemory:
    """The record `run` wrote to `side/mem_rank<r>.json`."""
    return RankMemory(**json.loads(path.read_text()))


def read_cpu(path: Path) -> RankCpu:
    """The record `run` wrote to `side/cpu_rank<r>.json`."""
    return RankCpu(**json.loads(path.read_text()))


def wait_idle(manager: Checkpointer, timeout_s: float = 600.0) -> None:
    """Wait until the writer holds no snapshot (its threads, and librdkafka's, still alive)."""
    deadline = time.monotonic() + timeout_s
    while manager.stages.writer.pending_bytes and time.monotonic() < deadline:
        time.sleep(0.01)


def run(cfg: JobConfig, side: Path) -> None:
    """Train `cfg` on this rank (as `trainer.main.run_job` does; with `ckpt.enabled` through
    the checkpointer) and write this rank's `RankCheckpoint`s to `side/rank<r>.jsonl` and
    its threads' CPU to `side/cpu_rank<r>.json`."""
    from bench.job import start_job

    train(start_job(cfg, cfg.run.run_dir / "metrics.jsonl", evaluate=True), cfg, side)


def train(job: Job, cfg: JobConfig, side: Path, copier: BareCopier | None = None, bare_repeats: int = BARE_REPEATS) -> None:
    """`run`'s training and measuring, on a job already built (`job.trainer` fresh, reporting
    to `job.metrics`): what a spawned rank does, and each job of the one-process suite
    (`bench.peers_gpu`) on a model `bench.job.Pristine` put back. The checkpointer is
    finished and its tracker detached from the model when this returns or raises, so another
    job can train the same model after it."""
    from bench.cpu import CpuLedger
    from bench.memory import RssSampler, proc_status
    from trainer.main import make_checkpointer

    manager = observed = None
    try:
        if cfg.ckpt.enabled:
            manager = make_checkpointer(cfg, job.env, job.device, job.sharded, job.trainer, job.metrics)
            spill = side / f"bare_rows_rank{job.env.rank}"
            observed = ObservedCheckpointer(manager, job.env.rank, copier, bare_repeats, spill_dir=spill)
            job.trainer.checkpointer = observed
            manager.restore()
        ledger, t0 = CpuLedger().start(), time.perf_counter()
        rss = RssSampler().start()
        job.trainer.fit()
        if manager is not None:
            wait_idle(manager)
        ledger.sample()
        pool = manager.stages.taker.pool if manager is not None else None
        status = proc_status(os.getpid())
        memory = RankMemory(
            rank=job.env.rank,
            model_bytes=model_bytes(job.sharded),
            rss_before_bytes=rss.start_bytes,
            rss_peak_bytes=rss.stop(),
            rss_peak_late_bytes=rss.peak_after(0.5),
            rss_end_bytes=rss.samples[-1][1],
            hwm_bytes=status["VmHWM"],
            rss_anon_end_bytes=status["RssAnon"],
            rss_file_end_bytes=status["RssFile"],
            pool_keep_bytes=pool.keep_bytes if pool is not None else 0,
            pool_peak_bytes=pool.held_peak if pool is not None else 0,
            pinned=bool(pool is not None and pool.pinned),
        )
        cpu = RankCpu(
            rank=job.env.rank,
            steps=job.trainer.step,
            checkpoints=manager.stats.stalls.total if manager else 0,
            threads=ledger.totals(),
            wall_s=time.perf_counter() - t0,
            other_by_name=ledger.by_name("other"),
            writer_by_name=ledger.by_name("writer"),
            faults=ledger.faults(),
            stall_cpu_s=sum(t.cpu_ms for t in manager.stats.stalls) / 1e3 if manager else 0.0,
        )
        if observed is not None:
            finished, manager = manager, None  # finished below, whatever happens next
            try:
                observed.finish(job.trainer.step)
            finally:
                finished.stages.tracker.detach()
            observed.dump(side / f"rank{job.env.rank}.jsonl")
        side.mkdir(parents=True, exist_ok=True)
        (side / f"cpu_rank{job.env.rank}.json").write_text(json.dumps(asdict(cpu), sort_keys=True) + "\n")
        (side / f"mem_rank{job.env.rank}.json").write_text(json.dumps(asdict(memory), sort_keys=True) + "\n")
    finally:
        job.metrics.close()
        job.trainer.checkpointer = None
        if manager is not None:  # training failed: stop the checkpointer's threads, leave the model untracked
            try:
                manager.close(job.trainer.step)
            finally:
                manager.stages.tracker.detach()


def read_sides(side: Path, ranks: int) -> dict[int, dict[int, RankCheckpoint]]:
    """checkpoint id -> rank -> what that rank measured of it (`ObservedCheckpointer.dump`)."""
    out: dict[int, dict[int, RankCheckpoint]] = {}
    for rank in range(ranks):
        for rec in read_side(side / f"rank{rank}.jsonl"):
            out.setdefault(rec.checkpoint_id, {})[rank] = rec
    return out


def checkpoint_rows(metrics: list[dict[str, Any]], side: dict[int, dict[int, RankCheckpoint]]) -> list[dict[str, Any]]:
    """One row per checkpoint of a run, as the suites report it: rank 0's metrics record of it
    (`ckpt_*`) joined with what every rank measured (the worst rank's figure, and each rank's)."""
    total_rows = sum({r: p.rank_total_rows for per in side.values() for r, p in per.items()}.values())
    rows = []
    for m in (m for m in metrics if "ckpt_id" in m):
        per = side.get(m["ckpt_id"], {})

        def worst(key: str) -> Any:
            return max((v for v in (getattr(p, key) for p in per.values()) if v is not None), default=None)

        bare, take = worst("bare_ms"), worst("take_ms")
        row = {
            "ckpt_id": m["ckpt_id"],
            "step": m["step"],
            "kind": "full" if m["ckpt_full"] else "delta",
            "committed": m["ckpt_committed"],
            "rows": m["ckpt_rows"],
            "fraction_of_rows": ratio(m["ckpt_rows"], total_rows),
            "fraction_changed_since_last": next((p.since_last for p in per.values()), None),
            "bytes": m["ckpt_bytes"],
            "bytes_per_row": m["ckpt_bytes"] / max(m["ckpt_rows"], 1),
            "stall_ms": m["ckpt_stall_ms"],
            "agree_ms": worst("agree_ms"),
            "take_ms": take,
            "dense_ms": worst("dense_ms"),
            "other_ms": worst("other_ms"),
            "find_rows_ms": worst("find_ms"),
            "bare_copy_ms": bare,
            "stall_over_bare": ratio(m["ckpt_stall_ms"], bare),
            "take_over_bare": ratio(take, bare),
            "write_s": m["ckpt_write_s"],
            "write_MBps": m["ckpt_bytes"] / m["ckpt_write_s"] / 1e6 if m["ckpt_write_s"] else None,
            "durable_s": m.get("ckpt_durable_s"),
            "stall_new_bytes": m.get("ckpt_stall_new_bytes"),
            "aside_bytes": m.get("ckpt_aside_bytes"),  # copy-on-write: the most a rank held aside
            "codec": m.get("ckpt_encoding"),
            "committed_at_step": worst("committed_at_step"),
            "durable_at_step": worst("durable_at_step"),
            "per_rank": {
                r: {
                    k: getattr(p, k)
                    for k in ("rows", "stall_ms", "agree_ms", "take_ms", "dense_ms", "other_ms", "bare_ms_all", "find_ms")
                }
                for r, p in sorted(per.items())
            },
        }
        if not m["ckpt_committed"]:
            row["error"] = m.get("ckpt_error")
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from bench.job import stop_job
    from sharding.process_group import detect_env
    from trainer.config import load_config
    from trainer.main import setup_logging

    p = argparse.ArgumentParser(prog="python -m bench.ckpt_rank", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--side", type=Path, required=True, help="write rank<r>.jsonl here")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging(detect_env().rank)
    run(load_config(args.config, args.overrides), args.side)
    stop_job()
    return 0


if __name__ == "__main__":
    run_main(main)
