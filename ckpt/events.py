"""What a run reports as it goes: one frozen dataclass per kind of record that metrics.jsonl
(and the follower's metrics file), the console, TensorBoard and `deltarec-report` share, and
where they go: `MetricsSink`, and `MetricsLog`, the sink that writes them to metrics.jsonl.

Every reader reads these by name: a record is turned into its event once (`read_event`),
and from there on code uses attributes, never "which keys does this dict hold". The field
names are the metrics.jsonl keys, so files stay readable by anything that reads them as JSON
(benchmarks, notebooks). A record written now also carries `"event": <kind>`; files written
before it are told apart by the key rules in `_kind_of_old_record`, kept in that one place.

The trainer's own records (training windows, evaluations) and the follower's live here too,
so that one module names every record kind that any reader tells apart.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeAlias, Union, cast

from common.errors import ConfigError, DeltarecError
from common.typed import TypeMismatch, convert, fields_of

EVENT_KEY = "event"
"""The key that names a record's kind in files written since records became typed events."""


class EventError(DeltarecError):
    """A metrics record that is not an event of its kind: a field missing or of the wrong type.
    The message is one line without the file and line; the reader that knows them adds them."""


@dataclass(frozen=True)
class Event:
    """One record: `step` is the training step it belongs to (TensorBoard's x axis).

    `kind` names the record kind (its `"event"` value); `flags` are class-level keys that
    today's files carry for every record of the kind (e.g. `ckpt_skipped: true`), written
    so that readers of the old key rules still recognise new files."""

    kind: ClassVar[str] = ""
    flags: ClassVar[dict[str, Any]] = {}

    step: int

    def to_record(self) -> dict[str, Any]:
        """The JSON object metrics.jsonl gets: every field under its own name (tuples as lists),
        the class-level flags, and the kind under `"event"`."""
        record: dict[str, Any] = {EVENT_KEY: self.kind, **self.flags}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            record[f.name] = list(value) if isinstance(value, tuple) else value
        return record

    def scalars(self) -> dict[str, float]:
        """The numeric fields (bools as 0/1, flags included), by record key, without `step`:
        what TensorBoard plots. Strings, lists, objects and nulls stay in the JSON file."""
        return {
            name: float(value)
            for name, value in self.to_record().items()
            if name != "step" and isinstance(value, (bool, int, float))
        }


# --- the trainer ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainWindow(Event):
    """Mean training loss (over every rank) of the `train.log_every` steps ending at `step`, and
    the samples per second of that window. With checkpoints, the steps a crash right after each
    step of the window would have lost, mean and most (rank 0's view, an upper bound:
    `ckpt.save.outcomes.AtRisk`); None without checkpoints and in runs written before."""

    kind: ClassVar[str] = "train"

    loss: float
    samples_per_s: float
    steps_at_risk_mean: float | None = None
    steps_at_risk_max: int | None = None


@dataclass(frozen=True)
class Evaluation(Event):
    """Held-out AUC and log loss at `step`, over `eval_samples` samples of every rank."""

    kind: ClassVar[str] = "eval"

    eval_auc: float
    eval_logloss: float
    eval_samples: int


# --- checkpoints (the checkpointer: ckpt/save/outcomes.py) -------------------------------------------------


@dataclass(frozen=True)
class CheckpointOutcome(Event):
    """What became of the checkpoint `ckpt_id` taken at `step`: `CheckpointCommitted` or
    `CheckpointFailed` (`ckpt_committed` says which, as the record's key does).

    `ckpt_stall_ms` is the worst rank's stall; `ckpt_stall_new_bytes` the host memory the stall
    allocated fresh, summed over ranks; `ckpt_error` is empty for a committed one. Runs written
    before they were recorded lack `ckpt_stall_new_bytes`, `ckpt_encoding` (the weight
    encoding) and `ckpt_durable_s` (the checkpoint's stall start to its COMMIT marker; null for
    a failed one): those read as None. Under copy-on-write (`ckpt.capture.copy_on_write`) the stall
    includes the rows the steps after it saved aside, and `ckpt_aside_bytes` is the most any rank
    held aside at once (0 otherwise)."""

    ckpt_committed: ClassVar[bool]

    ckpt_id: int
    ckpt_full: bool
    ckpt_rows: int
    ckpt_bytes: int
    ckpt_stall_ms: float
    ckpt_write_s: float
    ckpt_error: str
    ckpt_stall_new_bytes: int | None = None
    ckpt_encoding: str | None = None
    ckpt_durable_s: float | None = None
    ckpt_aside_bytes: int | None = None

    def to_record(self) -> dict[str, Any]:
        return {**super().to_record(), "ckpt_committed": self.ckpt_committed}


@dataclass(frozen=True)
class CheckpointCommitted(CheckpointOutcome):
    """A checkpoint whose COMMIT marker is written: restorable from now on."""

    kind: ClassVar[str] = "checkpoint_committed"
    ckpt_committed: ClassVar[bool] = True


@dataclass(frozen=True)
class CheckpointFailed(CheckpointOutcome):
    """A checkpoint that never committed; `ckpt_error` says why, and the next one is full."""

    kind: ClassVar[str] = "checkpoint_failed"
    ckpt_committed: ClassVar[bool] = False


@dataclass(frozen=True)
class CheckpointSkipped(Event):
    """The checkpoint due at `step`, dropped because the writers were behind
    (`ckpt.write.on_backpressure=skip`, `ckpt.write.max_pending_bytes`), or, `coalesced`, left to the next
    checkpoint, which writes its rows (`ckpt.write.max_pending_checkpoints`)."""

    kind: ClassVar[str] = "checkpoint_skipped"
    flags: ClassVar[dict[str, Any]] = {"ckpt_skipped": True}

    ckpt_coalesced: bool = False


CheckpointEvent: TypeAlias = CheckpointCommitted | CheckpointFailed | CheckpointSkipped
"""What the checkpointer tells the console about one checkpoint (`extra={"ckpt": event}`)."""


# --- restores (the checkpointer: ckpt/restore/restorer.py) --------------------------------------------


@dataclass(frozen=True)
class Restored(Event):
    """A job that started from checkpoint `restored_ckpt` (at `step`), read through
    `restore_chain`, in `restore_s` (slowest rank) and `restore_bytes`; then where the time went.
    `run_pls` is the run's portion of lost samples so far. Runs written before the parts were
    recorded have only the first five: the rest read as None."""

    kind: ClassVar[str] = "restore"

    restored_ckpt: int
    restore_s: float
    restore_bytes: int
    restore_chain: tuple[int, ...]
    restore_rows_written: int | None = None
    restore_markers_s: float | None = None
    restore_markers_records: int | None = None
    restore_markers_ahead_s: float | None = None
    restore_read_ahead_ranks: int | None = None  # ranks whose frames were fetched while the model was built
    restore_dense_ahead_ranks: int | None = None  # ranks that took the dense state loaded while the model was built
    restore_fetch_s: float | None = None
    restore_decode_s: float | None = None
    restore_apply_s: float | None = None
    restore_dense_s: float | None = None
    restore_regenerated_rows: int | None = None
    restore_regenerate_s: float | None = None
    run_pls: float | None = None


@dataclass(frozen=True)
class PartialRestore(Event):
    """A partial recovery (`ckpt.recovery.mode=partial`), written after its `Restored`: which ranks of
    the failed attempt kept their state and which rolled back, what share of the embedding
    parameters (per table) rolled back, and the samples' worth of updates lost."""

    kind: ClassVar[str] = "partial_restore"
    flags: ClassVar[dict[str, Any]] = {"partial_restore": True}

    partial_kept_ranks: tuple[int, ...]
    partial_rolled_back_ranks: tuple[int, ...]
    partial_rolled_back_fraction: float
    partial_rolled_back_tables: dict[str, float]
    partial_samples_since_ckpt: int
    partial_lost_samples: float
    partial_waiting_lost: float
    run_pls: float


# --- the follower (ckpt/follow/follower.py; its own file, ckpt.follow.metrics) -------------------


@dataclass(frozen=True)
class FollowApplied(Event):
    """The follower applied checkpoint `follow_ckpt` to its store: by a delta, or rebuilt from
    its chain (`follow_rebuilt`); how far behind the newest COMMIT it is, in checkpoints and in
    seconds after that checkpoint's COMMIT."""

    kind: ClassVar[str] = "follow_applied"

    follow_ckpt: int
    follow_read_bytes: int
    follow_apply_s: float
    follow_lag_ckpts: int
    follow_lag_s: float
    follow_chain: tuple[int, ...]
    follow_store_bytes: int
    follow_rebuilt: bool


@dataclass(frozen=True)
class FollowCompacted(Event):
    """The follower compacted checkpoint `compacted_ckpt`'s chain of `compact_replaced_links`
    links into one baseline of `compact_bytes`, written to `compact_generation`."""

    kind: ClassVar[str] = "follow_compacted"

    compacted_ckpt: int
    compact_bytes: int
    compact_replaced_bytes: int
    compact_replaced_links: int
    compact_s: float
    compact_generation: str


@dataclass(frozen=True)
class FollowExported(Event):
    """The follower published a serving snapshot of checkpoint `export_ckpt` at `export_path`."""

    kind: ClassVar[str] = "follow_exported"

    export_ckpt: int
    export_path: str
    export_s: float


@dataclass(frozen=True)
class UnknownEvent(Event):
    """A record of a kind this deltarec does not know (a newer one wrote it): kept whole in
    `record` so that readers can pass over it; it still has an integer `step`."""

    kind: ClassVar[str] = "unknown"

    record: dict[str, Any]

    def to_record(self) -> dict[str, Any]:
        return dict(self.record)


EVENTS: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        TrainWindow,
        Evaluation,
        CheckpointCommitted,
        CheckpointFailed,
        CheckpointSkipped,
        Restored,
        PartialRestore,
        FollowApplied,
        FollowCompacted,
        FollowExported,
    )
}
"""Every record kind by its `"event"` name."""


# --- reading -------------------------------------------------------------------------------------


def read_event(record: dict[str, Any]) -> Event:
    """The event a metrics record holds: by its `"event"` name, or in a file written before
    records carried one, by the old key rules (`_kind_of_old_record`). Keys the event does not
    have are ignored; a record of a kind this deltarec does not know is an `UnknownEvent`.
    Raises `EventError` (one line, without the file and line) for a record that is not an
    event: no integer `step`, a field missing or of the wrong type, a kind it does not know.

    The fields are checked by common/typed.py's `convert`, the converter configs go through
    too, strict here: a number is no string, a bool no number (ints pass as floats, lists as
    tuples)."""
    if EVENT_KEY in record:
        name = record[EVENT_KEY]
        if not isinstance(name, str):
            raise EventError(f"{EVENT_KEY!r} must be a string, got {name!r}")
        cls = EVENTS.get(name)
    else:
        cls = _kind_of_old_record(record)
    if cls is None:
        step = _field(record, "step", int)  # an unknown kind must still be a metrics record
        return UnknownEvent(step=step, record=dict(record))
    fields = fields_of(cls)
    try:  # in the fields' order, so the first field amiss is named; an absent optional one takes its default
        return cast(Event, convert(cls, {k: record[k] for k in fields if k in record}, path=""))
    except TypeMismatch as exc:
        field = exc.path.split(".")[0]  # a list item or an object's value: name the whole field
        raise _error(exc, record, field, fields[field].type) from None


def _field(record: dict[str, Any], name: str, hint: Any) -> Any:
    """`record[name]`, which every record of the kind must hold, as field type `hint`."""
    try:
        if name not in record:  # worded by `_error`, as an event's missing field is
            raise TypeMismatch(name, "missing_key", f"missing required key {name!r}")
        return convert(hint, record[name], path=name)
    except TypeMismatch as exc:
        raise _error(exc, record, name, hint) from None


def _error(exc: TypeMismatch, record: dict[str, Any], name: str, hint: Any) -> EventError:
    """The converter's refusal of field `name` (of type `hint`) in the words of a metrics reader."""
    if exc.problem == "missing_key":
        return EventError(f"metrics record has no {name!r} field")
    allowed = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    return EventError(f"{name!r} must be {_WHAT.get(hint, _WHAT.get(allowed[0], str(hint)))}, got {record[name]!r}")


def _kind_of_old_record(record: dict[str, Any]) -> type[Event] | None:
    """For old files only (written before records carried `"event"`): the kind of a record by
    the keys it holds, as `deltarec-report` told them apart then. None: a kind not known here."""
    if "restored_ckpt" in record:
        return Restored
    if record.get("partial_restore") is True:
        return PartialRestore
    if record.get("ckpt_skipped") is True:
        return CheckpointSkipped
    if "ckpt_id" in record:
        committed = _field(record, "ckpt_committed", bool)
        return CheckpointCommitted if committed else CheckpointFailed
    if "eval_auc" in record:
        return Evaluation
    if "loss" in record:
        return TrainWindow
    if "follow_ckpt" in record:
        return FollowApplied
    if "compacted_ckpt" in record:
        return FollowCompacted
    if "export_ckpt" in record:
        return FollowExported
    return None


_WHAT: dict[Any, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    tuple[int, ...]: "a list of integers",
    dict[str, float]: "an object of numbers",
}
"""How a metrics reader names each field type a record holds (an optional one by its type)."""


# --- writing -------------------------------------------------------------------------------------


class MetricsSink(Protocol):
    """Where ckpt/ reports events: checkpoint outcomes, skips and restores (the checkpointer), the
    follower's progress; `MetricsLog` is one."""

    def write(self, event: Event) -> None: ...


class MetricsLog:
    """Where events go: one JSON record per line in `<run_dir>/metrics.jsonl`, appended by one
    rank (only the writing rank opens the file). The trainer's metrics and a `ckpt.Checkpointer`
    of a user's own loop both write through it.

    Each record is an event, written as `event.to_record()`. With
    `tensorboard_dir` (`train.tensorboard`), the writing rank also logs every numeric field of
    every event as a TensorBoard scalar of the same name at the event's `step`
    (`Event.scalars`: bools as 0/1; strings, lists and nulls are left to the JSON file). Every rank checks
    that tensorboard is importable, so a missing package stops all ranks with the same
    error instead of leaving the others waiting in a collective."""

    def __init__(self, path: Path, enabled: bool, tensorboard_dir: Path | None = None) -> None:
        self.path = path
        self._file = None
        self._tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ConfigError(
                    "train.tensorboard is true but the tensorboard package is not installed: "
                    "pip install 'deltarec[report]' (or set train.tensorboard=false)"
                ) from exc
            if enabled:
                self._tb = SummaryWriter(log_dir=str(tensorboard_dir))
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)

    def write(self, event: Event) -> None:
        if self._file is not None:
            self._file.write(json.dumps(event.to_record(), sort_keys=True) + "\n")
        if self._tb is not None:
            for name, value in event.scalars().items():
                self._tb.add_scalar(name, value, global_step=event.step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()  # flushes the event file
            self._tb = None
