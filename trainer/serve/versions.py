"""The served model, two copies of it, and the swap that keeps every response on one checkpoint.

The model is a `Servable` (trainer/serve/servable.py): deltarec-train's DLRM (`dlrm_servable`)
or a user's own; its tables are the parameters of its embedding collections, its dense state
every other parameter and the buffers its state_dict holds.

The follower (ckpt/follow/follower.py) applies each COMMIT to a `ServedModel` as it would to
its row store: `begin`, the frames of the checkpoint's link (or of its whole chain, on a
rebuild), `finish`. Everything is written into the *standby* copy, which no request reads;
`finish` loads the checkpoint's dense state into it and swaps it in under a lock. A request
takes the live copy and holds it (a reader count) until it has its scores, so a copy is never
written while a request reads it: `begin` waits for the standby's last reader to leave.

The standby is one checkpoint behind when the next one begins: it gets the rows the previous
checkpoint changed (kept, decoded, from its apply), then the new checkpoint's. After a rebuild
(the first checkpoint, a restore of an older one, a failed apply) the other copy is behind by
everything and copies every table from the live one once. Rows go in decoded, as
`deltarec-ckpt export` writes them (ckpt/restore/replay.py `decode_rows`), so a response on
checkpoint k equals that export's model bit for bit on fp32 rows.

After a rewind (the trainer resumed from an older checkpoint, so the one served is on an
abandoned branch: ckpt/log/catalog.py, "Branches") the follower calls `withdraw`: the live copy
is taken out of service at once, requests get 503 not-ready (`NotReady`, saying why) while the
follower rebuilds the newest checkpoint of the live branch, and the next `finish` serves again.
Versions swapped in from then until the new branch's first checkpoint carry the rewind
(`Version.rewind`), for the server's measures of how long it lasted.

A managed-collision (hashed-id) table is answered by raw id: each copy has its own mapping
(`SlotMaps`, trainer/serve/hashed.py), the shards' mapping records folded over the chain as
export folds them (ckpt/restore/export.py `MappingFold`) and joined when the checkpoint is
swapped in, with the copy. A delta goes on from the fold the live checkpoint left (a copy of
it: a checkpoint that fails part way leaves it as it was); a rebuild, after a rewind too,
folds its chain from nothing.

Memory per row of the embedding tables (docs/design/serving.md): two fp32 copies (2 x 4 x dim
bytes), plus the decoded rows of one checkpoint's delta, plus during a rebuild one byte per
row and column shard (the check that the base covers every row).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torchrec import KeyedJaggedTensor
from torchrec.models.dlrm import DLRM

from ckpt.dense.store import DenseRef, DenseStore
from ckpt.follow.follower import Rewind
from ckpt.log.markers import Marker
from ckpt.restore.export import SERVING_ROOT, MappingFold, build_export, replicated_tables, table_fqn
from ckpt.restore.replay import decode_rows, row_init_of
from ckpt.stream.frames import Frame
from ckpt.types import RestoreError
from common.errors import DeltarecError
from sharding.managed_collision import ManagedCollisionError, McGlobal, to_global
from sharding.row_init import fill_rows
from trainer.config import ModelConfig
from trainer.model import build_model, feature_names
from trainer.serve.hashed import SlotMaps, install, mapping_buffers
from trainer.serve.servable import Servable, materialise

logger = logging.getLogger(__name__)

#: Every FQN a checkpoint of deltarec-train records is relative to DLRMTrain, whose only child is the DLRM.
_ROOT_CHILD = "model."


class NotReady(DeltarecError):
    """No checkpoint is served: none applied yet, or the one served was abandoned by a rewind."""


@dataclass
class RewindServed:
    """One rewind as this server lived it: when its follower withdrew the abandoned checkpoint,
    and the first responses after it (set once, by the request that gave them)."""

    rewind: Rewind
    withdrawn_unix: float  # when the live copy stopped answering
    first_answer_unix: float = 0.0  # the first response after it (a checkpoint of the live branch)
    new_branch_unix: float = 0.0  # the first response from a checkpoint the resuming attempt wrote

    def since_record(self, when_unix: float) -> float:
        """Seconds from the rewind's ATTEMPT record (from when it was read, if its time is unknown) to `when_unix`."""
        return when_unix - (self.rewind.announced_unix or self.rewind.seen_unix)

    def resumed(self, checkpoint_id: int) -> bool:
        """Whether `checkpoint_id` is from before the rewind (the one resumed from, or older):
        its age is the rewind's, not the stream's lag, so it is not counted as freshness."""
        return checkpoint_id <= self.rewind.newest


@dataclass(frozen=True)
class Rows:
    """Decoded rows of one column shard of one table: what the other copy still lacks."""

    table: str
    ids: torch.Tensor  # int64 [n]
    col_offset: int
    values: torch.Tensor  # fp32 [n, dim]


@dataclass
class Version:
    """One copy of the model and the checkpoint it holds."""

    module: nn.Module
    weights: dict[str, torch.Tensor]  # table key (marker.tables) -> its weight in `module`
    checkpoint_id: int = -1  # -1: holds no checkpoint
    step: int = -1
    step_unix: float = 0.0  # when rank 0 snapshot that step (the COMMIT's time for older logs)
    live_unix: float = 0.0  # when it was swapped in
    first_served_unix: float = 0.0  # its first response; 0.0: none yet
    at_start: bool = False  # the checkpoint the server started from: its age is not the stream's lag
    rewind: RewindServed | None = None  # swapped in after a rewind, up to the new branch's first checkpoint
    ids: SlotMaps = field(default_factory=SlotMaps)  # its managed-collision tables' mapping (trainer/serve/hashed.py)
    readers: int = 0  # requests computing on it now
    behind: list[Rows] | None = field(default_factory=list)  # rows it lacks against the live copy; None: all

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights.values()) + self.ids.nbytes


def serving_module(cfg: ModelConfig) -> DLRM:
    """The inner DLRM of `build_model` on the CPU, its tables materialised (uninitialised: a
    checkpoint fills them; a managed-collision table's own mapping too, which a served copy
    never reads), in eval mode."""
    dlrm = build_model(cfg, torch.device("cpu")).model
    return materialise(dlrm, unread=mapping_buffers(dlrm))


def dlrm_score(module: DLRM, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
    """Click probabilities: the sigmoid of the DLRM's logits, as the trainer evaluates them."""
    return torch.sigmoid(module(dense, sparse))


def dlrm_servable(cfg: ModelConfig) -> Servable:
    """deltarec-train's model as a `Servable`: the inner DLRM (a checkpoint's FQNs are
    DLRMTrain's, one ``model.`` longer), its request in the job's feature order."""
    return Servable(
        serving_module(cfg),
        dlrm_score,
        dense_in_features=cfg.dense_in_features,
        features=feature_names(cfg),
        fqn_prefix=_ROOT_CHILD,
        root=SERVING_ROOT,
    )


class ServedModel:
    """The follower's apply target for a server: two copies, one live (see the module doc).
    `on_live(version, marker, apply_s)` is called after each swap, off the lock."""

    def __init__(
        self,
        model: Servable | ModelConfig,
        dense: DenseStore,
        on_live: Callable[[Version, Marker, float], None] = lambda *_: None,
    ) -> None:
        self.servable = dlrm_servable(model) if isinstance(model, ModelConfig) else model
        self.dense = dense
        self.on_live = on_live
        self._hashed = {t.key: t for t in self.servable.hashed}  # managed-collision tables, by key
        self.live: Version | None = None
        self.standby = self._copy()
        self._spare: Version | None = self._copy()  # the second copy, until the first swap
        self._cond = threading.Condition()
        self.first_lock = threading.Lock()  # who records a version's first response
        self._marker: Marker | None = None
        self._dense_state: dict[str, Any] = {}
        self._streamed: set[str] = set()  # tables with rows in the stream (not data-parallel)
        self._rebuild = False
        self._t0 = 0.0
        self._delta: list[Rows] = []  # this checkpoint's rows, for the other copy
        self._covered: dict[tuple[str, int, int], torch.Tensor] = {}  # a rebuild's base, per column shard
        self.not_ready = "no checkpoint applied yet"  # what a request hears while none is live
        self._fold = MappingFold()  # their mapping records, folded up to the live checkpoint
        self._folding: MappingFold | None = None  # ... and on to the checkpoint being applied
        self.rewinds: list[RewindServed] = []  # every rewind that withdrew a live checkpoint
        self._rewind: RewindServed | None = None  # the last one, until the new branch's first checkpoint is live

    def _copy(self) -> Version:
        module = self.servable.fresh_module()
        version = Version(module, self.servable.table_weights(module), behind=None)
        install(module, list(self._hashed.values()), version.ids)
        return version

    @property
    def nbytes(self) -> int:
        """Bytes of both copies' tables and of the rows kept for the copy behind."""
        copies = [v for v in (self.live, self.standby, self._spare) if v is not None]
        kept = sum(r.values.numel() * 4 + r.ids.numel() * 8 for v in copies for r in v.behind or [])
        return sum(v.nbytes for v in copies) + kept

    # -- requests -----------------------------------------------------------------------
    @contextmanager
    def acquire(self) -> Iterator[Version]:
        """The live copy, held (never written) until the block ends; `NotReady` before the first."""
        with self._cond:
            version = self.live
            if version is None:
                raise NotReady(self.not_ready)
            version.readers += 1
        try:
            yield version
        finally:
            with self._cond:
                version.readers -= 1
                if not version.readers:
                    self._cond.notify_all()

    # -- the follower's hooks (ckpt/follow/follower.py `ApplyTarget`) ---------------------
    def begin(self, marker: Marker, rebuild: bool) -> None:
        """Make the standby copy writable and, for a delta, as new as the live one."""
        self._t0 = time.perf_counter()
        with self._cond:
            while self.standby.readers:  # requests that took it before the last swap
                self._cond.wait()
        self._marker, self._rebuild, self._delta, self._covered = marker, rebuild, [], {}
        self._dense_state = self.dense.read(DenseRef.from_json(marker.dense))  # a bad file fails here, early
        self._streamed = set(marker.tables) - replicated_tables(marker, self._dense_state)
        standby = self.standby
        self._folding = MappingFold() if rebuild else self._fold.copy()
        if rebuild:
            standby.behind = None  # the chain writes every row
            return
        if self.live is None:
            raise RestoreError(f"checkpoint {marker.checkpoint_id}: a delta with no model to apply it to")
        if standby.behind is None:
            for key, weight in standby.weights.items():
                weight.copy_(self.live.weights[key])
        else:
            for rows in standby.behind:
                self._write(standby, rows)
        standby.behind = []

    def reset(self) -> None:
        """A full link starts: every row at its initial value (a chain with a row
        initialisation stores only trained rows) or zero."""
        assert self._marker is not None, "begin() comes first"
        init = row_init_of(self._marker)
        for key, weight in self._standby_weights().items():
            if init is None:
                weight.zero_()
            else:
                fill_rows(init, key, weight.shape[0], weight.shape[1], weight, 0, 0)
        self._covered = {}

    def apply(self, frame: Frame, partition: int, table_rows: int) -> None:
        """Decode one frame's weights into the standby copy (optimizer state is not served), or
        fold a mapping frame (a managed-collision table's raw id -> slot record) into the
        standby's mapping."""
        if frame.is_mapping:
            self._fold_mapping(frame)
            return
        weight = self._standby_weights().get(frame.table)
        if weight is None:
            raise RestoreError(f"frame of checkpoint {frame.checkpoint_id} names table {frame.table!r}, which the model lacks")
        ids = frame.row_ids
        c0, c1 = frame.col_offset, frame.col_offset + frame.dim
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]) or c1 > weight.shape[1]:
            raise RestoreError(
                f"table {frame.table}: frame of checkpoint {frame.checkpoint_id} has rows outside "
                f"0..{weight.shape[0] - 1} or columns outside 0..{weight.shape[1] - 1}"
            )
        values, _ = decode_rows(replace(frame, optim=()))
        rows = Rows(frame.table, ids, c0, values)
        self._write(self.standby, rows)
        if self._rebuild:
            key = (frame.table, c0, frame.dim)
            self._covered.setdefault(key, torch.zeros(weight.shape[0], dtype=torch.bool))[ids] = True
        else:
            self._delta.append(rows)

    def check_complete(self, checkpoint_id: int, untrained_ok: bool = False) -> None:
        """The chain's base wrote every row and column of every table (unless its rows were
        initialised, when untrained rows are absent)."""
        covered, self._covered = self._covered, {}
        if untrained_ok:
            return
        for key, weight in self._standby_weights().items():
            shards = {k: mask for k, mask in covered.items() if k[0] == key}
            cols = sum(dim for _, _, dim in shards)
            if cols != weight.shape[1] or not all(bool(mask.all()) for mask in shards.values()):
                raise RestoreError(f"checkpoint {checkpoint_id}: table {key} is not fully covered by its base checkpoint")

    def finish(self, marker: Marker) -> None:
        """Load the checkpoint's dense state into the standby copy and swap it in."""
        standby = self.standby
        self._load_dense(standby, marker, self._dense_state)
        standby.ids.tables = self._joined_mapping(marker.checkpoint_id)
        standby.checkpoint_id, standby.step = marker.checkpoint_id, marker.step
        standby.step_unix = marker.step_unix or marker.created_unix
        rewind = self._rewind
        standby.first_served_unix, standby.at_start, standby.rewind = 0.0, self.live is None and rewind is None, rewind
        if rewind is not None and not rewind.resumed(marker.checkpoint_id):
            self._rewind = None  # the new branch is served: later checkpoints are ordinary ones
        with self._cond:
            previous = self.live if self.live is not None else self._spare
            assert previous is not None
            self.live, self._spare = standby, None
            standby.live_unix = time.time()
            previous.behind = None if self._rebuild else self._delta
            self.standby = previous
        self._delta, self._marker, self._dense_state = [], None, {}
        self._fold, self._folding = self._folding or self._fold, None
        self.on_live(standby, marker, time.perf_counter() - self._t0)

    def abandon(self) -> None:
        """The checkpoint failed part way: the standby copy holds nothing usable."""
        self.standby.behind = None
        self._delta, self._covered, self._marker, self._dense_state = [], {}, None, {}
        self._folding = None

    def withdraw(self, rewind: Rewind) -> None:
        """The follower's `on_rewind`: the live checkpoint was abandoned. No request is answered
        from it from now on (those computing on it finish); until the next `finish`, requests get
        `NotReady` saying why. The withdrawn copy is the other one for the rebuild that follows."""
        served = RewindServed(rewind, time.time())
        with self._cond:
            live, self.live = self.live, None
            if live is not None:
                live.behind = None  # the rebuild writes every row of the other copy; this one copies them all after
                self._spare = live  # `finish`'s previous copy
            waiting = "rebuilding after a rewind" if rewind.resumed_from else "waiting for the new run's first checkpoint"
            self.not_ready = f"{waiting}: {rewind.describe()}"
            self._rewind = served
            self.rewinds.append(served)

    # -- helpers --------------------------------------------------------------------------
    def _fold_mapping(self, frame: Frame) -> None:
        """Fold one mapping frame into the mapping of the checkpoint being applied."""
        if frame.table not in self._hashed:
            raise RestoreError(
                f"checkpoint {frame.checkpoint_id} has an id mapping for table {frame.table!r}, "
                f"which is no managed-collision table of the served {self.servable.name}"
            )
        assert self._folding is not None, "begin() comes first"
        self._folding.add(frame)

    def _joined_mapping(self, checkpoint_id: int) -> dict[str, McGlobal]:
        """Every managed-collision table's mapping at `checkpoint_id`, its shards joined. Refuses
        a table without one, or one of another row count than the served table."""
        if not self._hashed:
            return {}
        assert self._folding is not None, "begin() comes first"
        states = self._folding.states(checkpoint_id)
        out: dict[str, McGlobal] = {}
        for key in self._hashed:
            if key not in states:
                raise RestoreError(f"checkpoint {checkpoint_id} holds no id mapping for managed-collision table {key}")
            try:
                joined = to_global(states[key])
            except ManagedCollisionError as exc:
                raise RestoreError(f"checkpoint {checkpoint_id}: the id mapping of table {key} is not whole: {exc}") from None
            rows = self.standby.weights[key].shape[0]
            if joined.num_embeddings != rows:
                raise RestoreError(
                    f"checkpoint {checkpoint_id}: the id mapping of table {key} is of {joined.num_embeddings} slots, "
                    f"the served table has {rows} rows"
                )
            out[key] = joined
        return out

    def _standby_weights(self) -> dict[str, torch.Tensor]:
        """Tables the stream carries rows of (data-parallel ones come with the dense state)."""
        return {k: w for k, w in self.standby.weights.items() if k in self._streamed}

    @staticmethod
    def _write(version: Version, rows: Rows) -> None:
        weight = version.weights[rows.table]
        weight[rows.ids, rows.col_offset : rows.col_offset + rows.values.shape[1]] = rows.values

    def _load_dense(self, version: Version, marker: Marker, state: dict[str, Any]) -> None:
        """The dense parameters (and data-parallel tables, and the buffers the module's
        state_dict holds) of `marker`, from its dense file, as export maps them."""
        exported = build_export(marker, {}, state).for_serving()
        served = self.servable
        cid = marker.checkpoint_id
        if served.root is not None and exported.fqn_root != served.root:
            raise RestoreError(
                f"checkpoint {cid} is of a {exported.fqn_root} model; this server serves deltarec-train's "
                f"{served.root} (a model of your own loop: --model)"
            )
        if served.root is None and exported.fqn_root == SERVING_ROOT:
            raise RestoreError(f"checkpoint {cid} is of deltarec-train's {SERVING_ROOT}: serve its job without --model")
        params = dict(version.module.named_parameters())
        saved = version.module.state_dict()
        unread = mapping_buffers(version.module)  # the mapping comes from the stream's records
        buffers = {k: b for k, b in version.module.named_buffers() if k in saved and k not in unread}
        streamed = {table_fqn(k).removeprefix(served.fqn_prefix) for k in marker.tables} - set(exported.model)
        missing = sorted(set(params) - set(exported.model) - streamed) + sorted(set(buffers) - set(exported.buffers))
        unknown = sorted(set(exported.model) - set(params))
        if missing or unknown:
            raise RestoreError(
                f"checkpoint {cid} (a {exported.fqn_root} model) does not fit the served {served.name}: "
                f"missing {missing[:3]}, unknown {unknown[:3]} (was the model changed?)"
            )
        with torch.no_grad():
            for fqn, value in exported.model.items():
                params[fqn].copy_(value)
            for fqn, buffer in buffers.items():
                buffer.copy_(exported.buffers[fqn])
