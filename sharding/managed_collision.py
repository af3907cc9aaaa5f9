"""The raw-id -> slot state of TorchRec's managed-collision (ZCH) tables, per shard: find it,
copy it to host memory, diff it, write it back, and move it to another world size.

What it covers: every sharded `ManagedCollisionEmbeddingBagCollection` and
`ManagedCollisionEmbeddingCollection` of a DMP-wrapped model (torchrec's
`BaseShardedManagedCollisionEmbeddingCollection`) whose tables use `MCHManagedCollisionModule`
with the LFU, LRU or DistanceLFU eviction policy. Other managed-collision modules (the hash
ZCH of `HashZchManagedCollisionModule`, a policy keeping other metadata) are refused with one
line, since their state would go unsaved.

How torchrec 1.8 splits the two spaces across the W ranks of a table
---------------------------------------------------------------------
*Raw ids* are the feature values after the module's ``input_hash_func`` (none by default: the
values themselves), in ``[0, input_hash_size)``. The sharded module routes them before the
input all-to-all with ``block_bucketize_sparse_features``: block size
``ceil(input_hash_size / W)``, ``total_num_blocks = W`` (the MCH module's ``buckets()``, which
sharding rebuilds to the number of row-wise shards) and ``keep_orig_idx`` (the value that
arrives is the raw id itself, not its offset in the block). An id goes to rank
``id // block`` when that is below W, else to ``id % W`` (ids past the hash size). So rank r
owns the raw ids ``[r * block, (r + 1) * block)``: with ``input_hash_size = 2**40`` and small
ids, every id lands on rank 0. `route` computes this.

*Slots* are the global rows of the table. The table is sharded row-wise only (the MC sharder
asserts it), with torchrec's rule: ``ceil(N / W)`` rows per shard, the last shard the rest
(`row_wise_segments`). Rank r's MCH module is rebuilt with ``zch_size`` = its shard's rows and
``output_global_offset`` = its first row, so its mapping holds global slots
``[offset, offset + zch_size)``; the lookup subtracts the offset to index the local shard. The
last slot of each shard, ``offset + zch_size - 1``, is that shard's *miss slot*: every id routed
to the rank and not in its map reads (and trains) that row. It is never given to an id: it
sits last in the sorted buffer with the free-slot sentinel raw id (int64 max), and each
eviction pins its count to int64 max and its last access to the current iteration.

The per-shard state (one MCH module per table per rank)
-------------------------------------------------------
Buffers: ``_mch_sorted_raw_ids`` [zch] (raw ids ascending; free slots hold int64 max),
``_mch_remapped_ids_mapping`` [zch] (the global slot of each sorted entry), one ``_mch_<name>``
[zch] per metadata the policy keeps (``counts`` for LFU, ``last_access_iter`` for LRU, both
for DistanceLFU), ``_current_iter_tensor`` [1] (training forwards so far; every rank profiles
every step, so it is the same on all ranks) and ``_output_segments_tensor`` [1025] (the
table's row-wise shard starts then N, padded with -1: the same on every rank, never changed by
training; torchrec's load checks the shard's slot range against it).
Python attributes the buffers do not hold, which a bit-exact resume needs: ``_current_iter``
(-1 until the first training forward, then mirrors the tensor), ``_last_eviction_iter`` (the
eviction phase: torchrec's own state-dict load leaves it at -1, and the first forward after it
sets it to the loaded iteration, which shifts every later eviction), the history of raw ids
received since the last eviction (``_history_accumulator[:_current_history_buffer_offset]``,
with ``_history_last_access_iter`` for policies with last access; the buffer's capacity,
``_input_history_buffer_size``, is set from the first batch times interval times 1.25, and ids
past it are dropped, so it is state too) and ``_evicted``/``_evicted_emb_indices`` (slots
evicted but not yet reset, consumed in the same forward).

What an eviction touches: every ``eviction_interval`` training forwards the module coalesces
its history (unique ids, counts, last access), adds to the counters of ids it holds, scores
held and new ids with the policy and keeps the best ``zch_size``; new ids take the positions
of the evicted ones (free slots first: their score is 0), counters included, and the buffers
are re-sorted. Right after, in the same forward, the sharded module resets the rows of those
slots (free slots being filled included) in the local shard: ``reset_embedding_weight_momentum``
zeroes row-wise Adagrad's momentum (an fbgemm kernel that exists for CUDA only) and does nothing
for SGD or plain Adagrad (whose momentum of an evicted row stays), then each row is drawn
again with the table config's ``init_fn`` (by default uniform in +-sqrt(1/N)), which consumes the
global torch generator of the rows' device: the loop's RNG state is part of an exact resume.
Those row writes happen outside backward, so a tracker that marks trained rows does not see
them; `McDelta.admitted_slots` names them.

Forms of the state here: `McState` is one shard's copy indexed by local slot (raw id, counters
per slot, plus the scalars and history above); the sorted buffer order is a function of it
(raw id ascending, free slots by slot ascending: stable sorts keep the initial order of free
slots and a slot never becomes free again), which `capture` checks and `load` relies on.
`McGlobal` is a table's state over all ranks keyed by raw id, independent of the world size;
`rebucket` places it on a new world size and says which rows move where (`SlotMoves`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from common.errors import DeltarecError
from sharding.shard_views import EmbeddingModule, ShardView, _add_shards, unwrapped

FREE = int(np.iinfo(np.int64).max)  # the raw id torchrec keeps in a free slot (and in the miss slot)
PINNED_COUNT = FREE  # the count each eviction pins on the miss slot
_METADATA = {"counts": "counts", "last_access_iter": "last_access"}  # torchrec's metadata name -> McState field


class ManagedCollisionError(DeltarecError, ValueError):
    """A managed-collision state that cannot be captured, applied, loaded or moved as asked."""


# --- routing and layout --------------------------------------------------------------------------


def route(raw_ids: np.ndarray, input_hash_size: int, world_size: int) -> np.ndarray:
    """The rank each raw id is sent to (`block_bucketize_sparse_features` with ``W`` blocks of
    ``ceil(input_hash_size / W)`` ids; an id past the blocks goes to ``id % W``)."""
    ids = np.asarray(raw_ids, dtype=np.int64)
    if world_size < 1 or input_hash_size < 1:
        raise ManagedCollisionError(f"cannot route ids over {world_size} ranks and a hash size of {input_hash_size}")
    block = -(-int(input_hash_size) // world_size)
    blocks = ids // block
    return np.where(blocks < world_size, blocks, ids % world_size).astype(np.int64)


def row_wise_segments(num_embeddings: int, world_size: int) -> tuple[int, ...]:
    """The first row of each of the W row-wise shards of a table, then ``num_embeddings``:
    torchrec's rule (``ceil(N / W)`` rows each, the last shard the rest, shards past it empty)."""
    if world_size < 1 or num_embeddings < 1:
        raise ManagedCollisionError(f"cannot shard {num_embeddings} rows over {world_size} ranks")
    block = -(-num_embeddings // world_size)
    return tuple(min(r * block, num_embeddings) for r in range(world_size)) + (num_embeddings,)


# --- the per-shard state -------------------------------------------------------------------------


def _int64(a: Any) -> np.ndarray:
    out = np.ascontiguousarray(a, dtype=np.int64)
    out.flags.writeable = False
    return out


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and np.array_equal(a, b)


@dataclass(frozen=True)
class _Source:
    """Where a state came from: the live MCH module (weakly) and its mapping buffers' version."""

    module: weakref.ref[Any]
    version: tuple[tuple[int, int], ...]


@dataclass(frozen=True, eq=False)
class McState:
    """One shard's raw-id -> slot state in host memory, indexed by local slot ``s`` (global slot
    ``slot_offset + s``). Arrays are int64 and read-only (the state owns the arrays it is given);
    `counts` and `last_access` are None when the eviction policy keeps no such metadata.
    `==` compares every field exactly."""

    table: str  # the table's key (`ShardView.table`)
    slot_offset: int  # global slot of local slot 0 (the shard's first row)
    raw_ids: np.ndarray  # [size]: the raw id held at each slot, FREE where none (and at the miss slot)
    counts: np.ndarray | None  # [size]
    last_access: np.ndarray | None  # [size]: the iteration of the last access
    current_iter: int  # training forwards so far (`_current_iter_tensor`)
    last_eviction_iter: int  # the iteration of the last eviction; -1: no training forward since built
    history_ids: np.ndarray  # [n]: raw ids received since the last eviction, in arrival order
    history_last_access: np.ndarray | None  # [n]: their iteration (None exactly when `last_access` is)
    history_capacity: int  # the history buffer's length; -1: not allocated yet
    segments: tuple[int, ...]  # the table's row-wise shard starts, then its row count
    input_hash_size: int
    # the live module it was read from or loaded into, and its buffers' version then (`capture`'s
    # `like`); not part of the state: never compared, never copied by `dataclasses.replace`
    source: _Source | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("raw_ids", "counts", "last_access", "history_ids", "history_last_access"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _int64(value))
        n, h = self.raw_ids.shape[0], self.history_ids.shape[0]
        bad = [f for f in ("counts", "last_access") if getattr(self, f) is not None and getattr(self, f).shape != (n,)]
        if self.history_last_access is not None and self.history_last_access.shape != (h,):
            bad.append("history_last_access")
        if self.raw_ids.ndim != 1 or n < 1 or self.history_ids.ndim != 1 or bad:
            raise ManagedCollisionError(
                f"state of table {self.table}: arrays of mismatched shapes ({', '.join(bad) or 'raw_ids'})"
            )
        if (self.history_last_access is None) != (self.last_access is None):
            raise ManagedCollisionError(
                f"state of table {self.table}: the history's last access must come with the slots' last access"
            )
        if self.history_capacity >= 0 and h > self.history_capacity:
            raise ManagedCollisionError(
                f"state of table {self.table}: {h} history ids exceed the capacity {self.history_capacity}"
            )

    @property
    def size(self) -> int:
        """Slots in the shard (its rows), the miss slot included."""
        return int(self.raw_ids.shape[0])

    @property
    def miss_slot(self) -> int:
        """The global slot every id routed here and not held reads."""
        return self.slot_offset + self.size - 1

    @property
    def held(self) -> np.ndarray:
        """Local slots holding an id."""
        return np.flatnonzero(self.raw_ids != FREE)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, McState):
            return NotImplemented
        scalars = (
            "table",
            "slot_offset",
            "current_iter",
            "last_eviction_iter",
            "history_capacity",
            "segments",
            "input_hash_size",
        )
        arrays = ("raw_ids", "counts", "last_access", "history_ids", "history_last_access")
        return all(getattr(self, f) == getattr(other, f) for f in scalars) and all(
            _same(getattr(self, f), getattr(other, f)) for f in arrays
        )

    __hash__ = None  # type: ignore[assignment]  # equal by value, mutable-free but array-holding

    def as_arrays(self) -> dict[str, np.ndarray]:
        """Every field as a named array (absent metadata left out): what a file or a record holds."""
        out = {
            "slot_offset": np.array(self.slot_offset),
            "raw_ids": self.raw_ids,
            "current_iter": np.array(self.current_iter),
            "last_eviction_iter": np.array(self.last_eviction_iter),
            "history_ids": self.history_ids,
            "history_capacity": np.array(self.history_capacity),
            "segments": np.array(self.segments, dtype=np.int64),
            "input_hash_size": np.array(self.input_hash_size),
        }
        for name in ("counts", "last_access", "history_last_access"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_arrays(cls, table: str, arrays: dict[str, np.ndarray]) -> McState:
        """The state `as_arrays` wrote."""
        return cls(
            table=table,
            slot_offset=int(arrays["slot_offset"]),
            raw_ids=arrays["raw_ids"],
            counts=arrays.get("counts"),
            last_access=arrays.get("last_access"),
            current_iter=int(arrays["current_iter"]),
            last_eviction_iter=int(arrays["last_eviction_iter"]),
            history_ids=arrays["history_ids"],
            history_last_access=arrays.get("history_last_access"),
            history_capacity=int(arrays["history_capacity"]),
            segments=tuple(int(x) for x in arrays["segments"]),
            input_hash_size=int(arrays["input_hash_size"]),
        )


# --- diff and apply ------------------------------------------------------------------------------


# McDelta's arrays, in field order
_DELTA_ARRAYS = (
    "evicted_slots",
    "evicted_raw_ids",
    "admitted_slots",
    "admitted_raw_ids",
    "counter_slots",
    "counts",
    "last_access",
    "history_ids",
    "history_last_access",
)


@dataclass(frozen=True, eq=False)
class McDelta:
    """What changed in one shard's state between two captures; slots are *global* (table rows).

    A slot whose id changed carries a tombstone (`evicted_slots`, with the id that left) and,
    unless it became free, an admission (`admitted_slots`, the id that came): a reader keyed by
    raw id drops the first and adds the second. Training never frees a slot (an evicted slot is
    always refilled); only a load or a rebucket does. `counter_slots` lists every slot whose
    counters differ, admissions included, with the new values.

    The history: between evictions it only grows (ids are appended as they arrive), so when the
    old history is a prefix of the new one the delta keeps the old one's first `history_keep`
    ids (and their last access) and carries only the ids after them; an eviction empties it,
    and the delta then carries it whole (`history_keep` 0)."""

    table: str
    slot_offset: int
    size: int
    evicted_slots: np.ndarray
    evicted_raw_ids: np.ndarray
    admitted_slots: np.ndarray
    admitted_raw_ids: np.ndarray
    counter_slots: np.ndarray
    counts: np.ndarray | None  # [len(counter_slots)]: new values
    last_access: np.ndarray | None
    current_iter: int
    last_eviction_iter: int
    history_ids: np.ndarray  # the ids after the first `history_keep` of the old history
    history_last_access: np.ndarray | None
    history_capacity: int
    history_keep: int = 0  # how many of the old history's first ids the new history starts with

    def __post_init__(self) -> None:
        if self.history_keep < 0:
            raise ManagedCollisionError(f"delta of table {self.table}: history_keep {self.history_keep} is negative")
        for name in _DELTA_ARRAYS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _int64(value))

    @property
    def empty(self) -> bool:
        """No id and no counter changed (the scalars and the history may have)."""
        return not (self.evicted_slots.size or self.admitted_slots.size or self.counter_slots.size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, McDelta):
            return NotImplemented
        scalars = ("table", "slot_offset", "size", "current_iter", "last_eviction_iter", "history_capacity", "history_keep")
        return all(getattr(self, f) == getattr(other, f) for f in scalars) and all(
            _same(getattr(self, f), getattr(other, f)) for f in _DELTA_ARRAYS
        )

    __hash__ = None  # type: ignore[assignment]  # equal by value, like `McState`


def _check_same_shard(old: McState, new: McState) -> None:
    same = (old.table, old.slot_offset, old.size, old.segments, old.input_hash_size) == (
        new.table,
        new.slot_offset,
        new.size,
        new.segments,
        new.input_hash_size,
    )
    kinds = (old.counts is None, old.last_access is None) == (new.counts is None, new.last_access is None)
    if not (same and kinds):
        raise ManagedCollisionError(
            f"states of table {old.table} (slots from {old.slot_offset}) and {new.table} (from {new.slot_offset}) "
            "are not of the same shard and policy"
        )


def diff(old: McState, new: McState) -> McDelta:
    """The change from `old` to `new` (two captures of one shard); `apply(old, diff(old, new)) == new`."""
    _check_same_shard(old, new)
    moved = old.raw_ids != new.raw_ids
    evicted = np.flatnonzero(moved & (old.raw_ids != FREE))
    admitted = np.flatnonzero(moved & (new.raw_ids != FREE))
    changed = np.zeros(old.size, dtype=bool)
    for a, b in ((old.counts, new.counts), (old.last_access, new.last_access)):
        if a is not None and b is not None:
            changed |= a != b
    changed[admitted] = True
    counter = np.flatnonzero(changed)
    keep = _history_kept(old, new)
    return McDelta(
        table=new.table,
        slot_offset=new.slot_offset,
        size=new.size,
        evicted_slots=evicted + new.slot_offset,
        evicted_raw_ids=old.raw_ids[evicted],
        admitted_slots=admitted + new.slot_offset,
        admitted_raw_ids=new.raw_ids[admitted],
        counter_slots=counter + new.slot_offset,
        counts=None if new.counts is None else new.counts[counter],
        last_access=None if new.last_access is None else new.last_access[counter],
        current_iter=new.current_iter,
        last_eviction_iter=new.last_eviction_iter,
        history_ids=new.history_ids[keep:],
        history_last_access=None if new.history_last_access is None else new.history_last_access[keep:],
        history_capacity=new.history_capacity,
        history_keep=keep,
    )


def _history_kept(old: McState, new: McState) -> int:
    """How many of `old`'s history entries `new`'s starts with: all of them when no eviction
    came in between (the history only grew) and the old entries are exactly the new ones'
    first; else 0."""
    n = old.history_ids.shape[0]
    if n == 0 or old.last_eviction_iter != new.last_eviction_iter or new.history_ids.shape[0] < n:
        return 0
    if not np.array_equal(old.history_ids, new.history_ids[:n]):
        return 0
    if old.history_last_access is not None and new.history_last_access is not None:
        if not np.array_equal(old.history_last_access, new.history_last_access[:n]):
            return 0
    return n


def _local(slots: np.ndarray, delta: McDelta) -> np.ndarray:
    local = slots - delta.slot_offset
    if local.size and (local.min() < 0 or local.max() >= delta.size):
        raise ManagedCollisionError(f"delta of table {delta.table} names slots outside its shard")
    return local


def apply(state: McState, delta: McDelta) -> McState:
    """`state` with `delta` applied. Refuses a delta of another shard or policy, and one whose
    tombstones name ids `state` does not hold at those slots or that keeps more history than
    `state` has (a delta that does not follow it)."""
    if (state.table, state.slot_offset, state.size) != (delta.table, delta.slot_offset, delta.size) or (
        state.counts is None,
        state.last_access is None,
    ) != (delta.counts is None, delta.last_access is None):
        raise ManagedCollisionError(f"delta of table {delta.table} (slots from {delta.slot_offset}) is not of this shard")
    evicted, admitted, counter = (
        _local(delta.evicted_slots, delta),
        _local(delta.admitted_slots, delta),
        _local(delta.counter_slots, delta),
    )
    if not np.array_equal(state.raw_ids[evicted], delta.evicted_raw_ids):
        raise ManagedCollisionError(
            f"delta of table {delta.table} evicts ids this state does not hold: it follows another checkpoint"
        )
    raw = state.raw_ids.copy()
    raw[evicted] = FREE
    if np.any(raw[admitted] != FREE):
        raise ManagedCollisionError(f"delta of table {delta.table} admits ids into held slots without evicting them")
    raw[admitted] = delta.admitted_raw_ids
    keep = delta.history_keep
    if keep > state.history_ids.shape[0]:
        raise ManagedCollisionError(
            f"delta of table {delta.table} keeps {keep} history ids of a state holding "
            f"{state.history_ids.shape[0]}: it follows another checkpoint"
        )
    history = np.concatenate([state.history_ids[:keep], delta.history_ids]) if keep else delta.history_ids
    history_access = delta.history_last_access
    if keep and state.history_last_access is not None and delta.history_last_access is not None:
        history_access = np.concatenate([state.history_last_access[:keep], delta.history_last_access])

    def counters(current: np.ndarray | None, values: np.ndarray | None) -> np.ndarray | None:
        if current is None or values is None:
            return None
        out = current.copy()
        out[counter] = values
        return out

    return McState(
        table=state.table,
        slot_offset=state.slot_offset,
        raw_ids=raw,
        counts=counters(state.counts, delta.counts),
        last_access=counters(state.last_access, delta.last_access),
        current_iter=delta.current_iter,
        last_eviction_iter=delta.last_eviction_iter,
        history_ids=history,
        history_last_access=history_access,
        history_capacity=delta.history_capacity,
        segments=state.segments,
        input_hash_size=state.input_hash_size,
    )


# --- the live modules ----------------------------------------------------------------------------


@dataclass(frozen=True)
class McShard:
    """This rank's part of one managed-collision table: its MCH module and its rows."""

    key: str  # the table's key (`ShardView.table`): FQN of its weight in the unsharded model, without ".weight"
    module: str  # FQN of the sharded managed-collision module
    name: str  # the table's name in it
    mch: Any = field(compare=False, repr=False)  # the live MCHManagedCollisionModule (torchrec leaves it untyped)
    rows: ShardView = field(compare=False, repr=False)  # the local shard: rows [slot_offset, slot_offset + size), optimizer state


def mc_shards(model: nn.Module) -> list[McShard]:
    """Every managed-collision table of a DMP-wrapped model, with this rank's MCH module and
    shard rows, in module order. Refuses (one line naming it) a table whose state these
    functions cannot hold."""
    from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection  # noqa: PLC0415
    from torchrec.modules.mc_modules import MCHManagedCollisionModule  # noqa: PLC0415

    found: list[McShard] = []
    for fqn, m in unwrapped(model).named_modules():
        if not isinstance(m, BaseShardedManagedCollisionEmbeddingCollection):
            continue
        inner = f"{fqn}._embedding_module" if fqn else "_embedding_module"
        views: list[ShardView] = []
        _add_shards(EmbeddingModule(inner, m._embedding_module, bool(m.bagged)), views, [])
        by_key = {v.table: v for v in views}
        attr = "embedding_bags" if m.bagged else "embeddings"
        for name, mch in m._managed_collision_collection._managed_collision_modules.items():
            key = f"{inner}.{attr}.{name}"
            if not isinstance(mch, MCHManagedCollisionModule):
                raise ManagedCollisionError(
                    f"table {key} uses a {type(mch).__name__}: deltarec captures MCHManagedCollisionModule's state only"
                )
            names = [i.metadata_name for i in mch._eviction_policy.metadata_info]
            if any(n not in _METADATA for n in names):
                raise ManagedCollisionError(
                    f"table {key}: eviction policy {type(mch._eviction_policy).__name__} keeps {names}; "
                    "deltarec captures counts and last_access_iter only"
                )
            if key not in by_key:
                raise ManagedCollisionError(f"table {key}: no fused shard of its rows on this rank")
            view = by_key[key]
            if (view.row_offset, view.num_rows) != (mch._output_global_offset, mch._zch_size):
                raise ManagedCollisionError(f"table {key}: its slot range and its row shard disagree")
            found.append(McShard(key, fqn, name, mch, view))
    return found


def _segments(mch: Any) -> tuple[int, ...]:
    seg = mch._output_segments_tensor.detach().cpu().tolist()
    return tuple(int(x) for x in seg if x >= 0)


def _buffers_version(mch: Any) -> tuple[tuple[int, int], ...] | None:
    """The mapping buffers' (storage address, version counter); None when a buffer has no
    version counter (an inference tensor): nothing is reused then. Every in-place write bumps a
    tensor's version: an eviction's, a re-sort's, a state-dict load's, `load`'s."""
    buffers = [mch._mch_sorted_raw_ids, mch._mch_remapped_ids_mapping, *mch._mch_metadata.values()]
    try:
        return tuple((t.data_ptr(), int(t._version)) for t in buffers)
    except RuntimeError:
        return None


def _remember(mch: Any, state: McState) -> None:
    """`state` holds what the module's mapping buffers hold now: it carries the module (weakly)
    and the buffers' version, so that `capture(shard, like=state)` can tell they are unchanged."""
    version = _buffers_version(mch)
    object.__setattr__(state, "source", None if version is None else _Source(weakref.ref(mch), version))


def _unchanged_since(mch: Any, like: McState) -> bool:
    """Whether `like` was read from (or loaded into) the module and its mapping buffers have
    not been written since."""
    src = like.source
    return src is not None and src.module() is mch and src.version == _buffers_version(mch)


def capture(shard: McShard, like: McState | None = None) -> McState:
    """A host copy of the shard's state, taken between training steps. Refuses evictions not yet
    applied to the rows, and buffers out of the order `load` writes (the order `McState` implies).

    `like`: an earlier state captured from this shard (or loaded into it), typically the
    previous checkpoint's. The mapping buffers change only at evictions (and loads), so when
    they have not been written since `like` was read (their storage and version counters say
    so) the new state shares `like`'s read-only slot arrays and segments, and only the
    iteration, the eviction phase and the history are copied from the device. Any other `like`
    (of another module, read before an eviction, or made by `dataclasses.replace`) is ignored:
    the state is then copied whole."""
    mch = shard.mch
    if mch._evicted:
        raise ManagedCollisionError(f"table {shard.key}: evicted slots not reset yet; capture between training steps")
    if like is not None and like.table == shard.key and _unchanged_since(mch, like):
        raw_ids, counts, last_access, segments = like.raw_ids, like.counts, like.last_access, like.segments
    else:
        raw_ids, counts, last_access = _slots(shard)
        segments = _segments(mch)
    n = int(mch._current_history_buffer_offset)
    capacity = int(mch._input_history_buffer_size)
    history = np.zeros(0, dtype=np.int64)
    history_access = None if last_access is None else np.zeros(0, dtype=np.int64)
    if capacity >= 0:
        history = mch._history_accumulator[:n].detach().cpu().numpy().copy()
        if history_access is not None:
            history_access = mch._history_metadata["last_access_iter"][:n].detach().cpu().numpy().copy()
    state = McState(
        table=shard.key,
        slot_offset=int(mch._output_global_offset),
        raw_ids=raw_ids,
        counts=counts,
        last_access=last_access,
        current_iter=int(mch._current_iter_tensor.item()),
        last_eviction_iter=int(mch._last_eviction_iter),
        history_ids=history,
        history_last_access=history_access,
        history_capacity=capacity,
        segments=segments,
        input_hash_size=int(mch._input_hash_size),
    )
    _remember(mch, state)
    return state


def _slots(shard: McShard) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The raw id, count and last access of each local slot, from the sorted buffers, which
    must be in the order `load` writes."""
    mch = shard.mch
    sorted_raw = mch._mch_sorted_raw_ids.detach().cpu().numpy()
    local = mch._mch_remapped_ids_mapping.detach().cpu().numpy() - mch._output_global_offset
    size = int(mch._zch_size)
    if not np.array_equal(np.sort(local), np.arange(size)):
        raise ManagedCollisionError(f"table {shard.key}: the mapping is not a permutation of the shard's slots")
    up = sorted_raw[1:] > sorted_raw[:-1]
    tie = (sorted_raw[1:] == sorted_raw[:-1]) & (sorted_raw[1:] == FREE) & (local[1:] > local[:-1])
    if not np.all(up | tie) or sorted_raw[-1] != FREE or local[-1] != size - 1:
        raise ManagedCollisionError(f"table {shard.key}: the sorted buffers are not in the order deltarec restores")

    def by_slot(sorted_values: torch.Tensor) -> np.ndarray:
        out = np.empty(size, dtype=np.int64)
        out[local] = sorted_values.detach().cpu().numpy()
        return out

    meta = {_METADATA[n]: by_slot(t) for n, t in mch._mch_metadata.items()}
    return by_slot(mch._mch_sorted_raw_ids), meta.get("counts"), meta.get("last_access")


def load(shard: McShard, state: McState) -> None:
    """Write `state` into the live module: every buffer, the iteration and eviction phase, and the
    history, so that training goes on exactly as from the captured step (given the same rows,
    optimizer state and RNG state). The rows are the caller's (`McShard.rows`). Refuses a state
    of another shard layout or policy, and checks the write by capturing it back."""
    mch = shard.mch
    names = set(mch._mch_metadata)
    kinds = {"counts" if state.counts is not None else "", "last_access_iter" if state.last_access is not None else ""} - {""}
    if (
        state.table != shard.key
        or state.slot_offset != mch._output_global_offset
        or state.size != mch._zch_size
        or state.segments != _segments(mch)
        or state.input_hash_size != mch._input_hash_size
        or kinds != names
    ):
        raise ManagedCollisionError(
            f"state of table {state.table} (slots {state.slot_offset}+{state.size}, {sorted(kinds)}) does not fit "
            f"{shard.key} here (slots {mch._output_global_offset}+{mch._zch_size}, {sorted(names)})"
        )
    if state.raw_ids[-1] != FREE:
        raise ManagedCollisionError(f"state of table {state.table} holds an id in the miss slot")
    held = state.raw_ids[state.raw_ids != FREE]
    if np.unique(held).size != held.size:
        raise ManagedCollisionError(f"state of table {state.table} holds an id in two slots")
    order = np.lexsort((np.arange(state.size), state.raw_ids))  # raw id, then slot: torchrec's stable order
    device = mch._mch_sorted_raw_ids.device

    def put(buffer: torch.Tensor, values: np.ndarray) -> None:
        buffer.copy_(torch.from_numpy(np.ascontiguousarray(values)).to(device))

    with torch.no_grad():
        put(mch._mch_sorted_raw_ids, state.raw_ids[order])
        put(mch._mch_remapped_ids_mapping, order + state.slot_offset)
        if state.counts is not None:
            put(mch._mch_metadata["counts"], state.counts[order])
        if state.last_access is not None:
            put(mch._mch_metadata["last_access_iter"], state.last_access[order])
        mch._current_iter_tensor.fill_(state.current_iter)
        fresh = state.last_eviction_iter < 0
        mch._current_iter = -1 if fresh else state.current_iter
        mch._last_eviction_iter = -1 if fresh else state.last_eviction_iter
        mch._evicted = False
        _load_history(mch, state, device)
    back = capture(shard)
    assert back == state, f"table {shard.key}: the loaded state does not read back as written"
    _remember(mch, state)  # the next capture may take `state` as `like`


def _load_history(mch: Any, state: McState, device: torch.device) -> None:
    """The history buffers at the state's capacity, holding its ids (torchrec allocates them on
    the first training forward from that batch's size; a state sets them itself)."""
    n = state.history_ids.shape[0]
    if state.history_capacity < 0:
        if n:
            raise ManagedCollisionError(f"state of table {state.table} has history ids but no history buffer")
        mch._input_history_buffer_size = -1
        mch._current_history_buffer_offset = 0
        return
    cap = state.history_capacity
    mch._input_history_buffer_size = cap
    mch._history_accumulator = torch.zeros(cap, dtype=torch.int64, device=device)
    mch._history_accumulator[:n] = torch.from_numpy(state.history_ids.copy()).to(device)
    for info in mch._eviction_policy.metadata_info:
        if not info.is_history_metadata:
            continue
        buf = torch.zeros(cap, dtype=torch.int64, device=device)
        if info.metadata_name == "last_access_iter":
            if state.history_last_access is None:
                raise ManagedCollisionError(f"state of table {state.table} lacks the last access of its history")
            buf[:n] = torch.from_numpy(state.history_last_access.copy()).to(device)
        mch.register_buffer(f"_history_{info.metadata_name}", buf, persistent=False)
        mch._history_metadata[info.metadata_name] = buf
    mch._current_history_buffer_offset = n


# --- world-size independent form -----------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class McGlobal:
    """A table's state over all its shards, one entry per held raw id (ascending): its global slot
    in the layout `segments` describes and its counters. The miss slots' counters and the history
    travel beside, since they belong to no id."""

    table: str
    raw_ids: np.ndarray  # [k] ascending, unique
    slots: np.ndarray  # [k] global slots (rows) in `segments`' layout
    counts: np.ndarray | None  # [k]
    last_access: np.ndarray | None  # [k]
    current_iter: int
    last_eviction_iter: int
    history_ids: np.ndarray  # every shard's pending history, concatenated in rank order
    history_last_access: np.ndarray | None
    history_capacity: int  # the shards' capacities summed; -1 when none was allocated
    miss_counts: int  # the miss slots' counters (every shard's are the same: evictions run in step)
    miss_last_access: int
    segments: tuple[int, ...]
    input_hash_size: int

    def __post_init__(self) -> None:
        for name in ("raw_ids", "slots", "counts", "last_access", "history_ids", "history_last_access"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _int64(value))

    @property
    def num_embeddings(self) -> int:
        return self.segments[-1]

    def slots_of(self, raw_ids: np.ndarray) -> np.ndarray:
        """The global slot each of `raw_ids` reads, as the sharded module would: its own when it
        is held, else the miss slot (last row) of the shard `route` sends it to."""
        ids = np.asarray(raw_ids, dtype=np.int64)
        ends = np.asarray(self.segments[1:], dtype=np.int64)
        out = ends[route(ids, self.input_hash_size, len(ends))] - 1
        if self.raw_ids.size:
            at = np.searchsorted(self.raw_ids, ids).clip(max=self.raw_ids.size - 1)
            held = self.raw_ids[at] == ids
            out[held] = self.slots[at[held]]
        return out


def to_global(states: Sequence[McState]) -> McGlobal:
    """One table's shard states (every rank's, any order) as one world-size independent state.
    Refuses states of several tables, shards missing or doubled, ranks out of step, and an id
    held by a shard it is not routed to."""
    if not states:
        raise ManagedCollisionError("no shard states to join")
    first = states[0]
    ordered = sorted(states, key=lambda s: s.slot_offset)
    world = len(first.segments) - 1
    starts = [s.slot_offset for s in ordered]
    if any(
        (s.table, s.segments, s.input_hash_size) != (first.table, first.segments, first.input_hash_size) for s in states
    ) or starts != list(first.segments[:-1]):
        raise ManagedCollisionError(f"table {first.table}: the shard states given do not make up its {world} shards once each")
    if any(s.size != b - a for s, a, b in zip(ordered, first.segments[:-1], first.segments[1:])):
        raise ManagedCollisionError(f"table {first.table}: a shard state's size disagrees with the table's segments")
    if len({(s.current_iter, s.last_eviction_iter) for s in states}) != 1:
        raise ManagedCollisionError(f"table {first.table}: the shards are at different iterations")
    raws, slots, counts, access = [], [], [], []
    for rank, s in enumerate(ordered):
        held = s.held
        ids = s.raw_ids[held]
        if np.any(route(ids, s.input_hash_size, world) != rank):
            raise ManagedCollisionError(f"table {first.table}: shard {rank} holds ids routed to another rank")
        raws.append(ids)
        slots.append(held + s.slot_offset)
        if s.counts is not None:
            counts.append(s.counts[held])
        if s.last_access is not None:
            access.append(s.last_access[held])
    raw = np.concatenate(raws)
    order = np.argsort(raw, kind="stable")
    if raw.size and np.any(raw[order][1:] == raw[order][:-1]):
        raise ManagedCollisionError(f"table {first.table}: an id is held by two shards")

    def cat(parts: list[np.ndarray], present: bool) -> np.ndarray | None:
        return np.concatenate(parts)[order] if present else None

    hist_access = [s.history_last_access for s in ordered]
    capacities = [s.history_capacity for s in ordered if s.history_capacity >= 0]
    return McGlobal(
        table=first.table,
        raw_ids=raw[order],
        slots=np.concatenate(slots)[order],
        counts=cat(counts, first.counts is not None),
        last_access=cat(access, first.last_access is not None),
        current_iter=first.current_iter,
        last_eviction_iter=first.last_eviction_iter,
        history_ids=np.concatenate([s.history_ids for s in ordered]),
        history_last_access=None
        if any(a is None for a in hist_access)
        else np.concatenate([a for a in hist_access if a is not None]),
        history_capacity=sum(capacities) if capacities else -1,
        miss_counts=0 if ordered[0].counts is None else int(ordered[0].counts[-1]),
        miss_last_access=0 if ordered[0].last_access is None else int(ordered[0].last_access[-1]),
        segments=first.segments,
        input_hash_size=first.input_hash_size,
    )


@dataclass(frozen=True, eq=False)
class SlotMoves:
    """Where the rows (and their optimizer state) of one new shard come from: the row of each kept
    id moves from `old_slots[i]` (the old layout's global row) to `new_slots[i]` (the new layout's),
    and the new miss slot takes the row of old miss slot `miss_old_slot`. Ids routed to the shard
    that did not fit are `dropped_raw_ids` (their rows `dropped_slots` are not moved: the ids
    start over as misses). Any other row of the shard is a free slot: its content is never read
    before an admission draws it again."""

    raw_ids: np.ndarray
    old_slots: np.ndarray
    new_slots: np.ndarray
    miss_old_slot: int
    miss_new_slot: int
    dropped_raw_ids: np.ndarray
    dropped_slots: np.ndarray

    def __post_init__(self) -> None:
        for name in ("raw_ids", "old_slots", "new_slots", "dropped_raw_ids", "dropped_slots"):
            object.__setattr__(self, name, _int64(getattr(self, name)))


def rebucket(
    glob: McGlobal, new_world_size: int, rank: int, segments: tuple[int, ...] | None = None
) -> tuple[McState, SlotMoves]:
    """Shard `rank`'s state when the table is sharded over `new_world_size` ranks (in `segments`,
    default torchrec's row-wise rule), and the row moves that go with it.

    Each id routed to `rank` by the new world size keeps its global slot when that slot is a
    regular slot of the new shard, else takes the lowest free one. When more ids are routed to the
    shard than it has regular slots, it keeps the most counted, then the most recently accessed,
    then the lowest ids (the policy's own score needs its decay exponent, which is configuration,
    not state), and reports the others as dropped. History ids are re-routed the same way."""
    segs = row_wise_segments(glob.num_embeddings, new_world_size) if segments is None else tuple(segments)
    if len(segs) != new_world_size + 1 or segs[-1] != glob.num_embeddings or not 0 <= rank < new_world_size:
        raise ManagedCollisionError(
            f"table {glob.table}: segments {segs} do not split {glob.num_embeddings} rows over {new_world_size} ranks"
        )
    start, end = segs[rank], segs[rank + 1]
    size = end - start
    if size < 1:
        raise ManagedCollisionError(
            f"table {glob.table}: rank {rank} of {new_world_size} gets no rows (torchrec cannot build it)"
        )
    mine = np.flatnonzero(route(glob.raw_ids, glob.input_hash_size, new_world_size) == rank)
    capacity = size - 1
    if mine.size > capacity:
        counts = np.zeros(glob.raw_ids.size, np.int64) if glob.counts is None else glob.counts
        access = np.zeros(glob.raw_ids.size, np.int64) if glob.last_access is None else glob.last_access
        best = np.lexsort((glob.raw_ids[mine], -access[mine], -counts[mine]))
        kept, dropped = np.sort(mine[best[:capacity]]), np.sort(mine[best[capacity:]])
    else:
        kept, dropped = mine, mine[:0]
    old = glob.slots[kept]
    new = np.full(kept.size, -1, dtype=np.int64)
    stays = (old >= start) & (old < end - 1)
    new[stays] = old[stays]
    taken = np.zeros(size, dtype=bool)
    taken[old[stays] - start] = True
    taken[-1] = True  # the miss slot
    new[~stays] = np.flatnonzero(~taken)[: int((~stays).sum())] + start
    raw_ids = np.full(size, FREE, dtype=np.int64)
    raw_ids[new - start] = glob.raw_ids[kept]

    def counters(values: np.ndarray | None, miss: int) -> np.ndarray | None:
        if values is None:
            return None
        out = np.zeros(size, dtype=np.int64)
        out[new - start] = values[kept]
        out[-1] = miss
        return out

    hist = route(glob.history_ids, glob.input_hash_size, new_world_size) == rank
    hist_ids = glob.history_ids[hist]
    capacity_h = glob.history_capacity if glob.history_capacity < 0 else max(glob.history_capacity, int(hist_ids.size))
    state = McState(
        table=glob.table,
        slot_offset=start,
        raw_ids=raw_ids,
        counts=counters(glob.counts, glob.miss_counts),
        last_access=counters(glob.last_access, glob.miss_last_access),
        current_iter=glob.current_iter,
        last_eviction_iter=glob.last_eviction_iter,
        history_ids=hist_ids,
        history_last_access=None if glob.history_last_access is None else glob.history_last_access[hist],
        history_capacity=capacity_h,
        segments=segs,
        input_hash_size=glob.input_hash_size,
    )
    # the new miss row: the old miss row of the shard that received the first ids of this shard's block
    first_id = np.array([rank * -(-glob.input_hash_size // new_world_size)], dtype=np.int64)
    old_rank = int(route(first_id, glob.input_hash_size, len(glob.segments) - 1)[0])
    moves = SlotMoves(
        raw_ids=glob.raw_ids[kept],
        old_slots=old,
        new_slots=new,
        miss_old_slot=glob.segments[old_rank + 1] - 1,
        miss_new_slot=end - 1,
        dropped_raw_ids=glob.raw_ids[dropped],
        dropped_slots=glob.slots[dropped],
    )
    return state, moves
