"""The typed records of ckpt/events.py: each kind writes exactly the metrics.jsonl keys it wrote
as a dict (plus `"event"`), reads back equal, and a record of a file written before `"event"`
reads as the same event by the old key rules."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ckpt.events import (
    EVENTS,
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointSkipped,
    Evaluation,
    Event,
    EventError,
    FollowApplied,
    FollowCompacted,
    FollowExported,
    PartialRestore,
    Restored,
    TrainWindow,
    UnknownEvent,
    read_event,
)
from common.errors import DeltarecError

CKPT_KEYS = {
    "step",
    "ckpt_id",
    "ckpt_committed",
    "ckpt_full",
    "ckpt_rows",
    "ckpt_bytes",
    "ckpt_stall_ms",
    "ckpt_stall_new_bytes",
    "ckpt_write_s",
    "ckpt_error",
    "ckpt_encoding",
    "ckpt_durable_s",
    "ckpt_aside_bytes",
}
CKPT = dict(
    step=20,
    ckpt_id=2,
    ckpt_full=False,
    ckpt_rows=30,
    ckpt_bytes=300,
    ckpt_stall_ms=1.5,
    ckpt_write_s=0.01,
    ckpt_stall_new_bytes=4096,
    ckpt_encoding="adaptive4",
)

# One event of each kind, and the keys its record had when the code wrote it as a dict literal
# (ckpt/checkpointer.py, trainer/trainer.py, ckpt/follow/follower.py).
SAMPLES: list[tuple[Event, set[str]]] = [
    (
        TrainWindow(step=10, loss=0.69, samples_per_s=1000.0, steps_at_risk_mean=1.5, steps_at_risk_max=3),
        {"step", "loss", "samples_per_s", "steps_at_risk_mean", "steps_at_risk_max"},
    ),
    (
        Evaluation(step=20, eval_auc=0.7, eval_logloss=0.6, eval_samples=1024),
        {"step", "eval_auc", "eval_logloss", "eval_samples"},
    ),
    (CheckpointCommitted(**CKPT, ckpt_error="", ckpt_durable_s=0.2), CKPT_KEYS),
    (CheckpointFailed(**CKPT, ckpt_error="broker unreachable"), CKPT_KEYS),
    (CheckpointSkipped(step=30), {"step", "ckpt_skipped", "ckpt_coalesced"}),
    (
        Restored(
            step=50,
            restored_ckpt=4,
            restore_s=0.25,
            restore_bytes=1200,
            restore_chain=(1, 4),
            restore_rows_written=120,
            restore_markers_s=0.01,
            restore_markers_records=7,
            restore_markers_ahead_s=0.0,
            restore_read_ahead_ranks=2,
            restore_dense_ahead_ranks=2,
            restore_fetch_s=0.05,
            restore_decode_s=0.02,
            restore_apply_s=0.03,
            restore_dense_s=0.04,
            restore_regenerated_rows=0,
            restore_regenerate_s=0.0,
            run_pls=0.0,
        ),
        {
            "step",
            "restored_ckpt",
            "restore_s",
            "restore_bytes",
            "restore_chain",
            "restore_rows_written",
            "restore_markers_s",
            "restore_markers_records",
            "restore_markers_ahead_s",
            "restore_read_ahead_ranks",
            "restore_dense_ahead_ranks",
            "restore_fetch_s",
            "restore_decode_s",
            "restore_apply_s",
            "restore_dense_s",
            "restore_regenerated_rows",
            "restore_regenerate_s",
            "run_pls",
        },
    ),
    (
        PartialRestore(
            step=55,
            partial_kept_ranks=(0,),
            partial_rolled_back_ranks=(1,),
            partial_rolled_back_fraction=0.5,
            partial_rolled_back_tables={"t0": 0.5},
            partial_samples_since_ckpt=640,
            partial_lost_samples=320.0,
            partial_waiting_lost=0.0,
            run_pls=0.01,
        ),
        {
            "step",
            "partial_restore",
            "partial_kept_ranks",
            "partial_rolled_back_ranks",
            "partial_rolled_back_fraction",
            "partial_rolled_back_tables",
            "partial_samples_since_ckpt",
            "partial_lost_samples",
            "partial_waiting_lost",
            "run_pls",
        },
    ),
    (
        FollowApplied(
            step=20,
            follow_ckpt=2,
            follow_read_bytes=300,
            follow_apply_s=0.1,
            follow_lag_ckpts=0,
            follow_lag_s=0.5,
            follow_chain=(1, 2),
            follow_store_bytes=4000,
            follow_rebuilt=False,
        ),
        {
            "step",
            "follow_ckpt",
            "follow_read_bytes",
            "follow_apply_s",
            "follow_lag_ckpts",
            "follow_lag_s",
            "follow_chain",
            "follow_store_bytes",
            "follow_rebuilt",
        },
    ),
    (
        FollowCompacted(
            step=20,
            compacted_ckpt=2,
            compact_bytes=1000,
            compact_replaced_bytes=1300,
            compact_replaced_links=2,
            compact_s=0.3,
            compact_generation="g-c1-2",
        ),
        {
            "step",
            "compacted_ckpt",
            "compact_bytes",
            "compact_replaced_bytes",
            "compact_replaced_links",
            "compact_s",
            "compact_generation",
        },
    ),
    (
        FollowExported(step=20, export_ckpt=2, export_path="/serve/model-00000002-step-20.pt", export_s=0.2),
        {"step", "export_ckpt", "export_path", "export_s"},
    ),
]
IDS = [type(e).__name__ for e, _ in SAMPLES]


def through_json(record: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(record, sort_keys=True))


def test_every_kind_has_a_sample_and_a_name_of_its_own() -> None:
    assert sorted(type(e).__name__ for e, _ in SAMPLES) == sorted(cls.__name__ for cls in EVENTS.values())
    assert all(name == cls.kind for name, cls in EVENTS.items())


@pytest.mark.parametrize(("event", "keys"), SAMPLES, ids=IDS)
def test_a_record_keeps_the_old_keys_and_reads_back_equal(event: Event, keys: set[str]) -> None:
    record = through_json(event.to_record())
    assert set(record) == keys | {"event"} and record["event"] == event.kind
    assert read_event(record) == event


@pytest.mark.parametrize(("event", "keys"), SAMPLES, ids=IDS)
def test_an_old_record_without_event_reads_as_the_same_event(event: Event, keys: set[str]) -> None:
    old = {k: v for k, v in through_json(event.to_record()).items() if k != "event"}
    assert read_event(old) == event


def test_fields_an_old_file_lacks_read_as_none_and_other_keys_are_ignored() -> None:
    old = {"step": 50, "restored_ckpt": 4, "restore_s": 0.25, "restore_bytes": 1200, "restore_chain": [4], "later_key": 1}
    assert read_event(old) == Restored(step=50, restored_ckpt=4, restore_s=0.25, restore_bytes=1200, restore_chain=(4,))
    committed = {k: v for k, v in SAMPLES[2][0].to_record().items() if k not in ("ckpt_encoding", "ckpt_durable_s", "event")}
    e = read_event(committed)
    assert isinstance(e, CheckpointCommitted) and (e.ckpt_encoding, e.ckpt_durable_s) == (None, None)


def test_the_outcome_flag_picks_committed_or_failed() -> None:
    record = through_json(SAMPLES[2][0].to_record())
    del record["event"]
    assert type(read_event({**record, "ckpt_committed": False})) is CheckpointFailed
    assert CheckpointCommitted.ckpt_committed and not CheckpointFailed.ckpt_committed


def test_a_kind_not_known_here_is_kept_whole() -> None:
    for record in ({"step": 5, "a_future_kind": 1}, {"event": "a_future_kind", "step": 5}):
        e = read_event(record)
        assert isinstance(e, UnknownEvent) and e.step == 5 and e.to_record() == record


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"loss": 0.5, "samples_per_s": 1.0}, "metrics record has no 'step' field"),
        ({"step": 1.5, "loss": 0.5, "samples_per_s": 1.0}, "'step' must be an integer, got 1.5"),
        ({"step": 1, "loss": True, "samples_per_s": 1.0}, "'loss' must be a number, got True"),
        ({"event": "train", "step": 1, "loss": 0.5}, "metrics record has no 'samples_per_s' field"),
        ({"event": ["train"], "step": 1}, "'event' must be a string, got ['train']"),
        (
            {"step": 1, "restored_ckpt": 1, "restore_s": 1, "restore_bytes": 1, "restore_chain": [1, "a"]},
            "'restore_chain' must be",
        ),
        ({"step": 1, "ckpt_id": 1}, "metrics record has no 'ckpt_committed' field"),
        ({"step": 1, "a_future_kind": 1, "event": "x", "x": 1} | {"step": None}, "'step' must be an integer, got None"),
    ],
)
def test_a_record_that_is_not_an_event_is_one_line(record: dict[str, Any], message: str) -> None:
    with pytest.raises(EventError) as info:
        read_event(record)
    assert isinstance(info.value, DeltarecError)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_scalars_are_the_numeric_fields_by_record_key() -> None:
    failed = SAMPLES[3][0]
    assert failed.scalars() == {
        "ckpt_id": 2.0,
        "ckpt_committed": 0.0,
        "ckpt_full": 0.0,
        "ckpt_rows": 30.0,
        "ckpt_bytes": 300.0,
        "ckpt_stall_ms": 1.5,
        "ckpt_stall_new_bytes": 4096.0,
        "ckpt_write_s": 0.01,
    }
    assert CheckpointSkipped(step=3).scalars() == {"ckpt_skipped": 1.0, "ckpt_coalesced": 0.0}
