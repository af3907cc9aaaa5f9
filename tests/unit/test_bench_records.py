"""The benchmark instrument's bookkeeping, without running a benchmark: the common record
schema (`bench.common`) and how `bench.ckpt_rank` turns the checkpointer's public stats
into per-checkpoint records (which rows get a bare copy, when, and at which step an outcome
was learned). No figure is timed or judged."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bench.ckpt_rank import ObservedCheckpointer, read_side
from bench.common import Measurement, Provenance, read_records, scalars, unit_of, write_records
from ckpt.save.handoff import StallTiming
from ckpt.save.outcomes import CheckpointStats
from ckpt.write.writer import Outcome


def test_metric_names_carry_their_units() -> None:
    assert unit_of("stall_ms_delta_median") == "ms"
    assert unit_of("restore_s_median") == "s"
    assert unit_of("writer_MBps_full_fp32") == "MB/s"
    assert unit_of("train_samples_per_s_fp32") == "samples/s"
    assert unit_of("bytes_full_fp32") == "B"
    assert unit_of("fraction_of_rows_per_delta_median") == "fraction"
    assert unit_of("restore_over_dcp_load") == "ratio"
    assert unit_of("lifetime_logloss_rel_pct") == "%"
    assert unit_of("eval_auc") == ""


def test_records_are_one_json_line_per_measurement_with_provenance(tmp_path: Path) -> None:
    ms = scalars({"stall_ms": 1.5, "committed": True, "skipped": None, "chain": [1, 2]}, {"run": "fp32"})
    assert [(m.metric, m.unit) for m in ms] == [("stall_ms", "ms"), ("committed", "bool")]  # None and lists left out
    prov = Provenance(
        suite="checkpoint",
        command="python -m bench.run --suite checkpoint",
        commit="abc",
        dirty=True,
        unix=1.0,
        machine={"cores": 2},
    )
    path = tmp_path / "r.jsonl"
    assert write_records(path, prov, ms) == 2
    write_records(path, prov, [Measurement("rows", 3, "rows")])  # appends
    lines = read_records(path)
    assert len(lines) == 3
    assert lines[0] == {
        "suite": "checkpoint",
        "metric": "stall_ms",
        "value": 1.5,
        "unit": "ms",
        "labels": {"run": "fp32"},
        "command": prov.command,
        "commit": "abc",
        "dirty": True,
        "unix": 1.0,
        "machine": {"cores": 2},
    }
    assert Measurement("x_ms", 2.0, "ms", {"peer": "dcp.save"}).flat() == {
        "peer": "dcp.save",
        "metric": "x_ms",
        "value": 2.0,
        "unit": "ms",
    }


# -- bench.ckpt_rank against a stand-in manager -------------------------------------------------
@dataclass
class _Shard:
    weight: torch.Tensor
    optimizer_states: dict[str, torch.Tensor]


@dataclass
class _Tracker:
    touched: list[torch.Tensor]
    since_base_asked: list[bool] = field(default_factory=list)

    def touched_rows(self, i: int, since_base: bool) -> torch.Tensor:
        self.since_base_asked.append(since_base)
        return self.touched[i]


class _Manager:
    """What `ObservedCheckpointer` reads of a `Checkpointer`: public attributes only. It
    checkpoints at every 2nd step (a full first, deltas after) and delivers each outcome at
    the step end after the next."""

    def __init__(self, overlap: bool = False) -> None:
        self.cfg = SimpleNamespace(schedule=SimpleNamespace(interval_steps=2, policy="one_shot_diff"))
        # with the copy beside the next step, a stall is recorded during that step (`lookup`)
        self.overlap = overlap
        self.copier = SimpleNamespace(busy=False)
        self.in_flight: StallTiming | None = None
        self.stats = CheckpointStats()
        self.stages = SimpleNamespace(
            shard_map=SimpleNamespace(shards=[_Shard(torch.zeros(8, 4), {"momentum": torch.zeros(8)})]),
            tracker=_Tracker([torch.tensor([1, 5])]),
            total_rows=8,
        )
        self.owed: list[tuple[int, int]] = []  # (step it is delivered at, checkpoint id)

    def save(self, step: int) -> None:
        for due, cid in [o for o in self.owed if o[0] <= step]:
            self.owed.remove((due, cid))
            self.stats.outcomes.append(Outcome(checkpoint_id=cid, step=2 * cid, committed=True))
        if step % 2 == 0:
            cid = step // 2
            full = cid == 1
            timing = StallTiming(cid, step, full, 1.0, 2.0, 0.5, 3.5, 8 if full else 2, 64, 0.25, 0.25)
            if self.overlap:
                self.in_flight, self.copier.busy = timing._replace(overlapped=True, wait_ms=1.5), True
            else:
                self.stats.stalls.append(timing)
            self.owed.append((step + 2, cid))

    def wait_for_copy(self) -> None:
        self.lookup()

    def lookup(self) -> None:
        """The next step's wait for the copy in flight (its backward pass), whose stall is then recorded."""
        if self.in_flight is not None:
            self.stats.stalls.append(self.in_flight)
            self.in_flight, self.copier.busy = None, False

    def close(self, step: int) -> None:
        self.lookup()  # the checkpointer waits for a copy in flight first
        for _, cid in self.owed:
            self.stats.outcomes.append(Outcome(checkpoint_id=cid, step=2 * cid, committed=True))
        self.owed.clear()


@pytest.mark.parametrize("overlap", [False, True], ids=["copy-in-stall", "copy-beside-next-step"])
def test_ckpt_rank_records_each_checkpoint_from_the_managers_stats(tmp_path: Path, overlap: bool) -> None:
    manager = _Manager(overlap)
    observed = ObservedCheckpointer(manager, rank=0)  # type: ignore[arg-type]
    for step in range(1, 6):
        manager.lookup()
        observed.save(step)
        if step == (5 if overlap else 4):  # checkpoint 2 (a delta, step 4) recorded; its outcome not in yet
            assert observed.records[2].bare_ms_all == [] and observed.records[2].committed is None
    observed.finish(5)
    observed.dump(tmp_path / "rank0.jsonl")
    recs = {r.checkpoint_id: r for r in read_side(tmp_path / "rank0.jsonl")}

    assert sorted(recs) == [1, 2]
    full, delta = recs[1], recs[2]
    assert full.full and not delta.full
    assert (full.committed_at_step, delta.committed_at_step) == (4, 5)  # the step end that learned each outcome
    assert full.committed and delta.committed
    assert (delta.stall_ms, delta.agree_ms, delta.take_ms, delta.dense_ms) == (3.5, 1.0, 2.0, 0.5)
    assert delta.overlapped == overlap
    assert delta.other_ms == (1.0 if overlap else 0.5)  # the stall less the agreement and the copy, or the wait
    assert len(full.bare_ms_all) == len(delta.bare_ms_all) == 3  # bare copies ran, after the checkpoints
    assert full.find_ms == 0.0 and delta.find_ms is not None
    assert set(manager.stages.tracker.since_base_asked) == {True}  # a one-shot diff copies rows changed since the base


def test_ckpt_rank_keeps_each_deltas_rows_in_a_file_until_the_bare_copies(tmp_path: Path) -> None:
    """Suite `scale` measures the rank's memory as the checkpoint's: the rows the bare copies
    need wait in files, not in the process, and the copies read exactly those rows back."""
    from bench.ckpt_rank import BareCopier

    class _Recording(BareCopier):
        def __init__(self) -> None:
            super().__init__()
            self.asked: list[list[torch.Tensor | None]] = []

        def copy(self, shards: Any, locals_: Any) -> float:
            self.asked.append(list(locals_))
            return super().copy(shards, locals_)

    manager = _Manager()
    copier, spill = _Recording(), tmp_path / "bare_rows_rank0"
    observed = ObservedCheckpointer(manager, rank=0, copier=copier, bare_repeats=1, spill_dir=spill)  # type: ignore[arg-type]
    for step in range(1, 5):
        observed.save(step)
    assert [item.rows for item in observed.to_copy] == [None, None]  # nothing held in memory
    assert sorted(p.name for p in spill.iterdir()) == ["rows_2.pt"]  # the delta's; the full copies every row
    observed.finish(4)
    full_rows, delta_rows = copier.asked
    assert full_rows == [None]
    assert [t.tolist() for t in delta_rows] == [[1, 5]]  # what the tracker listed before the delta
    assert not spill.exists()  # read back once, then removed


def test_the_bare_copy_copies_the_rows_into_buffers_it_reuses() -> None:
    from bench.ckpt_rank import BareCopier

    shards = [_Shard(torch.arange(40.0).view(10, 4), {"momentum": torch.arange(10.0)}), _Shard(torch.arange(12.0).view(6, 2), {})]
    copier = BareCopier()
    rows = [torch.tensor([7, 2, 9]), torch.tensor([0, 5])]
    copier.copy(shards, rows)
    bufs = dict(copier._bufs)
    assert torch.equal(bufs[(0, 0)][:3], shards[0].weight[[7, 2, 9]])
    assert torch.equal(bufs[(0, 1)][:3], shards[0].optimizer_states["momentum"][[7, 2, 9]])
    assert torch.equal(bufs[(1, 0)][:2], shards[1].weight[[0, 5]])
    copier.copy(shards, [torch.tensor([1]), torch.tensor([3])])  # fewer rows: the same memory
    assert all(copier._bufs[k].data_ptr() == b.data_ptr() for k, b in bufs.items())
    assert torch.equal(copier._bufs[(0, 0)][:1], shards[0].weight[[1]])
    copier.copy(shards, [None, None])  # every row: the buffers grow once
    assert torch.equal(copier._bufs[(0, 0)], shards[0].weight) and torch.equal(copier._bufs[(1, 0)], shards[1].weight)
    grown = copier._bufs[(0, 0)].data_ptr()
    copier.copy(shards, [None, None])
    assert copier._bufs[(0, 0)].data_ptr() == grown
