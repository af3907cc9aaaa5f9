"""Partial recovery's pieces without ranks: PLS and interval formulas with worked numbers,
SURVIVOR records in the log fold, which survivor snapshots a restore may use, the state it
composes, and the tracker's rows changed since the newest committed checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ckpt.capture.tracker import RowTracker
from ckpt.log.catalog import Catalog
from ckpt.log.markers import (
    AttemptRecord,
    ChainLink,
    DroppedRecord,
    Marker,
    OffsetRange,
    SurvivorRecord,
    decode_record,
    encode_marker,
)
from ckpt.recovery.lost_samples import estimate_mtbf, expected_pls, interval_for_pls, lost_samples, run_pls
from ckpt.recovery.partial import compose, usable_survivors, with_survivors
from ckpt.types import RestoreError
from trainer.config import ConfigError, load_config

RUN = "unit-run"


# -- formulas -------------------------------------------------------------------------------
def test_pls_and_interval_formulas_with_worked_numbers() -> None:
    # two equal ranks (f = 1/2), a failure every hour, at most 1% of samples lost:
    # T = 2 * 0.01 * 3600 / 0.5 = 144 s, and checkpoints every 144 s expect exactly that PLS
    assert interval_for_pls(0.01, 3600, 0.5) == pytest.approx(144.0)
    assert expected_pls(144.0, 3600, 0.5) == pytest.approx(0.01)
    # CPR's form, N equal ranks: T = 2 * PLS * N * MTBF = 2 * 0.02 * 8 * 7200 = 2304 s
    assert interval_for_pls(0.02, 7200, 1 / 8) == pytest.approx(2304.0)
    # halving the interval halves the expected loss
    assert expected_pls(72.0, 3600, 0.5) == pytest.approx(0.005)
    # a failure 5 steps of 512 samples after the checkpoint, half the parameters rolled back
    assert lost_samples(5 * 512, 0.5) == 1280
    assert run_pls(1280, 25 * 512) == pytest.approx(0.1)
    assert run_pls(0, 0) == 0.0
    # two earlier attempts, the first started 1,200 s ago: a failure every 600 s
    assert estimate_mtbf([1000.0, 1700.0], 2200.0) == pytest.approx(600.0)
    assert estimate_mtbf([], 2200.0) is None


# -- records and which ones a restore uses --------------------------------------------------
def _link(cid: int, generation: int | None = None, full: bool = False) -> ChainLink:
    return ChainLink(
        checkpoint_id=cid,
        full=full,
        generation=cid if generation is None else generation,
        ranges={0: [OffsetRange(0, 3)]},
        rows=4,
        bytes=400,
        epoch=7,
    )


def _survivor(attempt: str, rank: int, base: int, sid: int, step: int = 25) -> SurvivorRecord:
    return SurvivorRecord(
        kind="survivor",
        run_id=RUN,
        attempt=attempt,
        rank=rank,
        world_size=2,
        base=base,
        step=step,
        link=_link(sid),
        dense={"path": f"/d/survivor-{sid}-r{rank}.pt", "sha256": "0" * 64, "bytes": 1},
        shards=[["t", 0, 100, 0, 8]],
        created_unix=1.0,
    )


def _commit(cid: int, attempt: str, step: int) -> Marker:
    return Marker(
        kind="commit",
        run_id=RUN,
        checkpoint_id=cid,
        step=step,
        world_size=2,
        chain=[_link(1, full=True)],
        attempt=attempt,
        tables={"t": [200, 8], "d": [10, 8]},
        plan={"t": "row_wise", "d": "data_parallel"},
    )


def _attempt(name: str) -> AttemptRecord:
    return AttemptRecord(kind="attempt", run_id=RUN, role="trainer", attempt=name, world_size=2, created_unix=1.0)


def _fold(*records) -> Catalog:
    return Catalog(RUN).feed((pos, encode_marker(r)) for pos, r in enumerate(records))


def test_a_survivor_record_round_trips_and_its_id_is_never_reused() -> None:
    record = _survivor("a1", 0, base=2, sid=3)
    assert decode_record(encode_marker(record)) == record
    catalog = _fold(_attempt("a1"), _commit(2, "a1", 20), record)
    assert catalog.survivors == {"a1": {0: record}}
    assert catalog.newest_id == 3  # the survivor's generation and dense file are S = 3


def test_only_the_previous_attempts_survivors_of_the_restored_checkpoint_are_used() -> None:
    k = _commit(2, "a1", 20)
    on_k = _survivor("a1", 0, base=2, sid=3)
    catalog = _fold(_attempt("a1"), _commit(1, "a1", 10), k, on_k)
    assert usable_survivors(catalog, k) == [on_k]
    # on an older checkpoint of the same attempt: rows changed since 1 include those since 2
    older_base = _survivor("a1", 0, base=1, sid=3)
    assert usable_survivors(_fold(_attempt("a1"), k, older_base), k) == [older_base]
    # a base the restore does not reach (a newer checkpoint), or a gc-dropped generation: not used
    assert usable_survivors(_fold(_attempt("a1"), k, _survivor("a1", 0, base=3, sid=4)), k) == []
    dropped = DroppedRecord(kind="dropped", run_id=RUN, generations=[3], created_unix=1.0)
    assert usable_survivors(_fold(_attempt("a1"), k, on_k, dropped), k) == []
    # a later attempt started (and left none): the older attempt's are superseded
    assert usable_survivors(_fold(_attempt("a1"), k, on_k, _attempt("a2")), k) == []
    # the previous attempt restored k from an earlier attempt: its survivors on k still count,
    # but not on an older checkpoint of that earlier attempt
    b_on_k = _survivor("a2", 1, base=2, sid=5)
    assert usable_survivors(_fold(_attempt("a1"), k, _attempt("a2"), b_on_k), k) == [b_on_k]
    assert usable_survivors(_fold(_attempt("a1"), k, _attempt("a2"), _survivor("a2", 1, base=1, sid=5)), k) == []
    # another run's records never reach this run's fold
    assert not _fold(_attempt("a1"), k, SurvivorRecord(**{**vars(on_k), "run_id": "other"})).survivors
    assert [link.checkpoint_id for link in with_survivors(k, [on_k]).chain] == [1, 3]


def _loop(step: int, reader: int) -> dict:
    return {"step": step, "samples_seen": step * 512, "reader": {"position": reader}, "rng_torch": torch.zeros(1)}


def test_compose_keeps_the_survivors_state_and_moves_the_dead_ranks_reader_on() -> None:
    k = _commit(2, "a1", 20)
    survivor = _survivor("a1", 0, base=2, sid=3, step=25)
    survivor.shards = [["t", 0, 100, 0, 8]]  # half of table t; d is data-parallel (dense state)
    at_k = {"trainers": [_loop(20, 20), _loop(20, 120)], "params": {"w": torch.zeros(1)}}
    theirs = {0: {"trainer": _loop(25, 25), "params": {"w": torch.ones(1)}, "lost_samples": 100.0, "restores": 1}}
    state, skips, outcome = compose(k, [survivor], at_k, theirs, world_now=2)
    assert torch.equal(state["params"]["w"], torch.ones(1))  # dense state: the survivor's
    assert [t["reader"] for t in state["trainers"]] == [{"position": 25}, {"position": 120}]
    assert skips == [0, 5]  # rank 1 moves past the 5 batches it would have trained
    assert {t["step"] for t in state["trainers"]} == {25}
    assert outcome.kept == [0] and outcome.rolled_back == [1] and outcome.rolled_back_tables == {"t": 0.5}
    assert outcome.rolled_back_fraction == 0.5 and outcome.samples_since == 5 * 512
    assert outcome.lost_samples == 1280 and state["lost_samples"] == 100.0 + 1280
    # into another world size only one global reader position carries over
    with pytest.raises(RestoreError, match="different positions"):
        compose(k, [survivor], at_k, theirs, world_now=3)
    same = {"trainers": [_loop(20, 20), _loop(20, 20)]}
    state, skips, _ = compose(k, [survivor], same, {0: {**theirs[0], "trainer": _loop(25, 20)}}, world_now=3)
    assert len(state["trainers"]) == 1 and skips == [0]


# -- the tracker's rows since the newest committed checkpoint ---------------------------------
def _tracker(rows: int) -> RowTracker:
    """A tracker's bitmaps without a model (the bookkeeping under test needs none)."""
    t = RowTracker.__new__(RowTracker)
    t.shard_map = SimpleNamespace(shards=[SimpleNamespace(num_rows=rows)])
    t._starts, t.device = [0], torch.device("cpu")
    t._last, t._base, t._trained = (torch.zeros(rows, dtype=torch.bool) for _ in range(3))
    t._uncommitted = None
    return t


def test_rows_changed_since_the_newest_committed_checkpoint() -> None:
    t = _tracker(10)
    t.keep_uncommitted()
    t._last[[1, 2]] = True
    t.remember(1)
    t.mark_checkpoint()  # checkpoint 1 holds rows 1, 2; not yet known committed
    t._last[[3]] = True
    t.remember(2)
    t.mark_checkpoint()
    t._last[[4]] = True
    assert t.since_committed_rows(0).tolist() == [1, 2, 3, 4]
    t.committed(1)
    assert t.since_committed_rows(0).tolist() == [3, 4]
    t.committed(2)
    assert t.since_committed_rows(0).tolist() == [4]
    for cid in range(3, 10):  # a long outage: nothing commits, entries merge, nothing is lost
        t._last[cid] = True
        t.remember(cid)
        t.mark_checkpoint()
    assert len(t._uncommitted) <= RowTracker._MAX_UNCOMMITTED
    assert t.since_committed_rows(0).tolist() == [3, 4, 5, 6, 7, 8, 9]
    t.touch([torch.tensor([True] + [False] * 9)])  # rows a partial restore set
    assert t.since_committed_rows(0).tolist()[0] == 0


# -- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ckpt.recovery.target_pls=0.01"], "needs ckpt.recovery.mode=partial"),
        (["ckpt.recovery.mode=partial", "ckpt.recovery.target_pls=0.01", "ckpt.schedule.interval_s=5"], "not both"),
        (["ckpt.recovery.mode=partial", "ckpt.recovery.survivor_timeout_s=0"], "survivor_timeout_s must be positive"),
        (["ckpt.recovery.mode=partial", "ckpt.recovery.target_pls=1.5"], r"target_pls must be in \[0, 1\)"),
        (["ckpt.recovery.mode=sometimes"], "ckpt.recovery.mode"),
    ],
)
def test_recovery_options_are_checked(debug_config, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(debug_config.path, ["ckpt.enabled=true", "ckpt.sink.kind=filesystem", *overrides], check_data=False)


def test_a_pls_target_alone_sets_the_interval(debug_config) -> None:
    job = ["ckpt.enabled=true", "ckpt.sink.kind=filesystem", "ckpt.recovery.mode=partial", "ckpt.recovery.target_pls=0.01"]
    cfg = load_config(debug_config.path, [*job, "ckpt.recovery.mtbf_s=600", "ckpt.schedule.interval_steps=0"], check_data=False)
    assert cfg.ckpt.recovery.target_pls == 0.01 and cfg.ckpt.schedule.interval_steps == 0


# -- prioritized checkpoints (MFU, SSU) ---------------------------------------------------------
def _priority(mode: str, sizes: tuple[int, ...] = (6, 4), row_bytes: tuple[int, ...] = (10, 20)):
    from ckpt.capture.tracker import LookupGroup
    from ckpt.recovery.priority import RowPriority

    t = _tracker(sum(sizes))
    t.shard_map = SimpleNamespace(shards=[SimpleNamespace(num_rows=n) for n in sizes])
    t._starts = [0, sizes[0]]
    p = RowPriority(t, list(row_bytes), mode, sample=1.0, seed=3)
    group = LookupGroup(("a", "b"), [0, 1], [None, None], True)
    return t, p, group


def test_mfu_saves_the_most_updated_changed_rows_within_the_budget() -> None:
    t, p, group = _priority("mfu")
    # shard 0 row 2 updated 5 times, row 4 twice, row 0 once; shard 1 row 1 three times
    p.record(group, [torch.tensor([2, 2, 2, 2, 2, 4, 4, 0]), torch.tensor([1, 1, 1])])
    assert t.listener == p.record and p.updates_since_full == 11
    changed = torch.zeros(10, dtype=torch.bool)
    changed[[0, 2, 4, 6 + 1]] = True
    # 35 bytes: row 2 (10 B) then shard 1 row 1 (20 B) fit; row 4 (10 B) would make 40
    chosen = p.select(changed, budget_bytes=35)
    assert [c.tolist() for c in chosen] == [[2], [1]]
    p.saved(chosen)
    assert p.counts.tolist() == [1, 0, 0, 0, 2, 0, 0, 0, 0, 0]
    t._last.copy_(changed)
    t.mark_saved(chosen)
    waiting = t.changed_since_last()
    assert waiting.nonzero().view(-1).tolist() == [0, 4]  # left for a later checkpoint
    assert p.accounting(waiting) == {"unsaved_updates": 3, "updates_since_full": 11}
    p.full()
    assert p.accounting(waiting) == {"unsaved_updates": 0, "updates_since_full": 0}


def test_ssu_saves_only_rows_its_sub_sample_touched() -> None:
    t, p, group = _priority("ssu")
    p.sample = 0.0
    p.record(group, [torch.tensor([0, 1]), torch.tensor([0])])  # counted, never sampled
    p.sample = 1.0
    p.record(group, [torch.tensor([3]), torch.tensor([2])])
    changed = torch.ones(10, dtype=torch.bool)
    assert [c.tolist() for c in p.select(changed, budget_bytes=1000)] == [[3], [2]]
    assert sum(c.numel() for c in p.select(changed, budget_bytes=25)) == 1  # over the budget: a random part
    assert p.counts.tolist() == [1, 1, 0, 1, 0, 0, 1, 0, 1, 0]


@pytest.mark.parametrize(
    "overrides",
    [
        ["ckpt.recovery.priority=mfu"],
        ["ckpt.recovery.priority=ssu", "ckpt.recovery.mode=partial"],
        [
            "ckpt.recovery.priority=mfu",
            "ckpt.recovery.mode=partial",
            "ckpt.schedule.policy=incremental",
            "ckpt.recovery.priority_budget=0",
        ],
        [
            "ckpt.recovery.priority=mfu",
            "ckpt.recovery.mode=partial",
            "ckpt.schedule.policy=incremental",
            "ckpt.recovery.priority_full_every=1",
        ],
    ],
)
def test_prioritized_checkpoints_need_partial_recovery_and_sane_budgets(debug_config, overrides: list[str]) -> None:
    with pytest.raises(ConfigError, match="ckpt.recovery.priority"):
        load_config(debug_config.path, ["ckpt.enabled=true", "ckpt.sink.kind=filesystem", *overrides], check_data=False)


# -- a survivor's save: all of it in time, or no record ---------------------------------------
def _survivor_job(tmp_path):
    from ckpt.capture.snapshot import ShardRows, Snapshot
    from ckpt.config import SinkConfig
    from ckpt.write.writer import WriteJob

    g = torch.Generator().manual_seed(5)
    rows = ShardRows(
        "t", 100, 0, torch.tensor([100, 103, 150]), torch.randn(3, 8, generator=g), {"momentum1": torch.rand(3, generator=g)}
    )
    job = WriteJob(
        checkpoint_id=9,
        step=55,
        generation=9,
        chain=[],
        snapshot=Snapshot(9, 55, False, [rows], 0.0),
        trainer_state={"step": 55, "samples_seen": 99},
        epoch=4,
    )
    sink = SinkConfig(kind="filesystem", fs_root=str(tmp_path / "stream"), dense_dir=str(tmp_path / "dense"))
    return sink, job


def test_a_survivor_saves_frames_and_dense_file_before_its_record(tmp_path) -> None:
    import time

    from ckpt.dense.store import DenseRef, DenseStore
    from ckpt.recovery.survivor import SurvivorError, save_survivor
    from ckpt.restore.replay import decode_rows, iter_link_frames
    from ckpt.stream.filesystem import FsMarkers, FsSource

    sink, job = _survivor_job(tmp_path)
    kwargs = dict(
        rank=1,
        job=job,
        attempt="a1",
        world_size=2,
        base=7,
        dense_state={"trainer": job.trainer_state},
        shards=[["t", 100, 100, 0, 8]],
    )
    with pytest.raises(SurvivorError, match="out of time"):
        save_survivor(sink, run_id=RUN, deadline=time.monotonic() - 1, **kwargs)
    markers = FsMarkers(tmp_path / "stream", RUN)
    assert markers.read_markers() == []  # out of time: nothing a restore would use
    record = save_survivor(sink, run_id=RUN, deadline=time.monotonic() + 30, **kwargs)
    [(_, data)] = markers.read_markers()
    assert decode_record(data) == record and record.base == 7 and record.step == 55 and record.link.epoch == 4
    [frame] = list(iter_link_frames(record.link, FsSource(tmp_path / "stream", RUN), RUN, lambda *a: str(a)))
    weights, optim = decode_rows(frame)
    assert torch.equal(weights, job.snapshot.shards[0].weights) and frame.row_ids.tolist() == [100, 103, 150]
    dense = DenseStore(tmp_path / "dense").read(DenseRef.from_json(record.dense))
    assert dense["trainer"] == job.trainer_state
