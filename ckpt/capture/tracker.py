"""Which embedding rows changed since the last checkpoint: one bitmap per local shard.

Where the ids come from
-----------------------
A rank's own batch names only part of the rows its shards update:
the rest arrive from other ranks in the input all-to-all. So the tracker listens *after*
input distribution, on ``ShardedEmbeddingBagCollection.register_post_lookup_tracker_fn``.
``compute_and_output_dist`` calls it once per lookup group (one group per sharding
type) as ``fn(features, embs, sebc, None)``, where ``features`` is the KeyedJaggedTensor
that group's lookup has just consumed.
``ShardedEmbeddingCollection`` (unpooled, sequence features) calls the same hook the same
way, and so do both in any number of modules: the tracker registers on every sharded
embedding module of the model (``sharding.shard_views.embedding_modules``) and keeps each
module's lookup groups apart (by the module the hook names), since two modules may take
features of the same name.

How that KJT maps to this rank's shards
---------------------------------------
The lookup splits ``features`` *by position* into one slice per fused kernel
(``GroupedPooledEmbeddingsLookup._feature_splits``), and each kernel maps its keys to
its tables by position (``feature_table_map``): the keys are the concatenation, over the
lookup's kernels in order, of ``table.feature_names`` for each local table. So key
position ``k`` names exactly one local shard (a column-wise table with two column shards
on one rank shows up as the same feature name twice, at two positions). The tracker
precomputes that position -> shard map per lookup and recognises a lookup by its tuple
of keys (a feature belongs to one table, a table to one sharding type, so key tuples of
different lookups never collide).

The ids are the very indices the fused kernel uses into its *local* weight tensor, so
they are always shard-local rows, ``0 <= id < shard.num_rows``; the global row is
``shard.row_offset + id``. Per sharding type (checked on 2 gloo ranks, torchrec 1.8):

- ``table_wise``: only the rank holding the table receives its feature, with the ids of
  every rank's batch (stride = batch * world). ``row_offset == 0``: local == global.
- ``row_wise``: ids are bucketized by row block before the all-to-all
  (``block_bucketize_sparse_features``) and arrive *already shifted* into the block:
  ``local = global - row_offset``. Each rank receives only the ids of its block, from
  every rank's batch.
- ``table_row_wise``: the same as row_wise within the host the table is placed on
  (ids shard-local to the block, from every rank's batch).
- ``column_wise`` / ``table_column_wise``: every column shard receives all ids of the
  table's global batch, unshifted (``row_offset == 0``); each column shard of a row
  gets its own bit, and they agree (each shard's row-wise Adagrad momentum is separate).
- ``data_parallel``: the replicated lookup's KJT (this rank's own ids, global) also
  reaches the hook; it is ignored: those tables are trained by the dense optimizer and
  travel with the dense state (``ShardMap.replicated_tables``).

Managed-collision tables
------------------------
A sharded managed-collision module (``ShardMap.from_model(model, managed_collision=True)``;
docs/design/managed-collision.md) owns an inner sharded EBC/EC whose shards are tracked like any
other, but torchrec never calls that collection's post-lookup hook: the module's ``compute``
(``BaseShardedManagedCollisionEmbeddingCollection.compute``) remaps the raw ids to slots, takes
the slots an eviction freed or filled (``evict()``), redraws their rows (``_evict``: the
table's ``init_fn`` from the global RNG, and row-wise Adagrad's momentum zeroed on CUDA), and
only then calls the inner collection's ``compute`` on the remapped KJTList. So the tracker
wraps two methods on the module instance (restored by `detach`, wrapped again by `attach`,
each wrapper calling whatever the attribute was before, so wrappers chain):

- ``_evict(evictions_per_table)``: called in every forward with the per-table local slots
  about to be redrawn (None where the table evicted nothing), *before* the writes. The
  wrapper marks them, and first lets whoever must see the rows unchanged do so: the pending
  hold, the pending ``before_update`` wait (an eviction changes rows in the forward pass,
  ahead of the backward pass the gradient hook waits in) and the guards. Redrawn rows are
  marked in any forward that evicts, also in a training-mode forward under ``no_grad``
  (torchrec's MCH module profiles, and so evicts, whenever the module is in training mode):
  those rows did change. An eval forward never evicts.
- ``compute(ctx, dist_input)``: after it returns, ``ctx.remapped_kjt`` is the KJTList the
  inner collection's ``compute`` received, one KJT per lookup (its ids already made
  shard-local by the managed-collision collection, ``global_to_local_index``), and the
  return value its lookups' outputs; each pair goes through the same marking as a
  post-lookup hook call (lookup groups of the inner collection, training forwards only).
  The remapped KJT is built in that compute, so the split by ``length_per_key()`` computes
  its lengths per key there (on a GPU a host sync, which the all-to-all's KJTs do not cost).

Wrapping ``compute`` rather than the inner collection's ``compute`` keeps both hooks on the one
module the `ShardMap` records; wrapping ``_evict`` rather than reading
``ctx.evictions_per_table`` after ``compute`` is what puts the marks and waits before the
redraw. The marks are exact: a step changes an MC table's rows only by that redraw and by the
fused optimizer's update of the rows the step looked up.

Recording happens only when the ShardedEBC is in training mode *and* autograd is on
(an eval forward or a ``no_grad`` forward never reaches the fused optimizer, so it
changes no row). A training forward whose backward never runs over-marks, which is safe:
a checkpoint may carry an unchanged row, never miss a changed one.

Cost: one flat ``torch.bool`` buffer holds every shard's bitmap back to back; each key
position of a lookup holds a view of its shard's slice. Per lookup the hook splits the
values by ``length_per_key()`` (a list the input all-to-all has already computed, so no
host sync) and runs one ``index_fill_`` per key position into that view: the ids need no
offset because they are shard-local, and an id outside its shard raises (``index_fill_``
is bounds-checked) instead of marking a neighbour shard's row. No Python loop over ids;
the loop over keys is two ops per key. Its cost per step: `python -m bench.run --suite tracker`
(docs/BENCHMARKS.md, "Checkpoint and tracker").

``since_last`` is filled by the hook; ``since_base`` is kept as the rows folded in at
earlier ``mark_checkpoint`` calls, and reported OR-ed with ``since_last``; ``trained``
keeps the rows folded in at earlier ``mark_base`` calls (or that a restore found in the
stream), so OR-ed with ``since_base`` it is every row touched since the model was
initialised: what a full checkpoint stores when untouched rows can be regenerated
(sharding/row_init.py). Under partial recovery the tracker also keeps, per checkpoint
taken but not yet known committed, the rows it captured since the one before
(`keep_uncommitted`, `remember`, `committed`), so a surviving rank can save exactly the rows
changed since the newest committed checkpoint (`since_committed_rows`). Besides the
per-shard masks, `touched_rows(i, since_base)` (sorted local indices) and
`counts(since_base)` (rows per shard) serve `ckpt.capture.snapshot.SnapshotTaker` without copying
bitmaps. On CUDA the hook ran in tests/integration/test_gpu_resume.py on an H100; nothing in
the hook syncs the host.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.profiler import record_function
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sharding.shard_views import EmbeddingModule, ManagedCollision, ShardMap

logger = logging.getLogger(__name__)


def rows_of(mask: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """Sorted int64 indices of the set bits of a 1-D bool bitmap. On CPU numpy's `flatnonzero`,
    faster than torch's `nonzero` on one thread, and it is part of the checkpoint stall
    (docs/history/BENCHMARKS-2026-11.md, "The stall against a copy into reused memory"). On a GPU, `count` (the
    set bits, known from `RowTracker.counts`) lets `nonzero_static` size its output without
    waiting for the device, as `nonzero` must."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    if count is not None:
        return torch.nonzero_static(mask, size=count).view(-1)
    return mask.nonzero().view(-1)


def _count(mask: torch.Tensor) -> int:
    """Set bits of a bitmap (on CPU numpy's count_nonzero, faster than torch's sum of a bool tensor)."""
    return int(np.count_nonzero(mask.numpy())) if mask.device.type == "cpu" else int(mask.sum())


@dataclass
class LookupGroup:
    """Key position -> the shard it looks up, and a view of that shard's since_last bitmap."""

    keys: tuple[str, ...]
    shards: list[int | None]  # shard index per key position (None: not tracked)
    bitmaps: list[torch.Tensor | None]  # per key position: a view of that shard's since_last bits
    any_tracked: bool


_MC_METHODS = ("compute", "_evict")  # what the tracker wraps on a sharded managed-collision module's instance
_UNSET = object()  # a method the instance did not override (its class's is used)


@dataclass
class _McHook:
    """One sharded managed-collision module the tracker wraps: its inner collection, a one-key
    group per table for the slots an eviction redraws, and the instance attributes the
    wrappers replaced (`_UNSET` where the class's method was used)."""

    inner: EmbeddingModule
    module: ManagedCollision
    evictions: dict[str, LookupGroup]  # table name in the module -> its local shard's group
    replaced: dict[str, Any]


class RowTracker:
    """Per-shard bitmaps of the rows touched by training since the last checkpoint/base."""

    def __init__(self, shard_map: ShardMap) -> None:
        self.shard_map = shard_map
        shards = shard_map.shards
        self._starts: list[int] = []
        total = 0
        for s in shards:
            self._starts.append(total)
            total += s.num_rows
        device = shards[0].weight.device if shards else torch.device("cpu")
        self.device = device
        self._last = torch.zeros(total, dtype=torch.bool, device=device)
        self._base = torch.zeros(total, dtype=torch.bool, device=device)  # folded at mark_checkpoint
        self._trained = torch.zeros(total, dtype=torch.bool, device=device)  # folded at mark_base
        self._scratch: np.ndarray | None = None  # `all_counts`' OR of the bitmaps (CPU)
        # (checkpoint id, rows changed since the checkpoint before it) of checkpoints not yet
        # known committed; None: not kept (only partial recovery needs it)
        self._uncommitted: list[tuple[int, torch.Tensor]] | None = None
        # also told every lookup's ids (the group and its shard-local ids per key position), and
        # the slots a managed-collision eviction redraws: prioritized checkpoints count updates
        # there (ckpt/recovery/priority.py)
        self.listener: Callable[[LookupGroup, list[torch.Tensor]], None] | None = None
        # called the same way before the marks, while registered (`guard`): pending copy-on-write
        # snapshots save the looked-up rows aside there (ckpt/capture/copy_on_write.py)
        self._guards: tuple[Callable[[LookupGroup, list[torch.Tensor]], None], ...] = ()
        self._guards_lock = threading.Lock()
        # every sharded embedding collection, the inner ones of managed-collision modules included
        self.modules = shard_map.modules
        # those whose post-lookup hooks these are (torchrec never calls an inner one's)
        self._hooked = [em for em in self.modules if em.managed_collision is None]
        # per module (by id): feature keys of each lookup group -> where its ids go (benchmarks
        # time one group's hook)
        self._groups = {id(em.sharded): self._build_lookup_maps(em) for em in self.modules}
        self._check_every_shard_tracked()
        self._mc = [self._build_mc_hook(em) for em in self.modules if em.managed_collision is not None]
        self._previous = self._hooks_now()  # per module (by id): the hook it had before this tracker's
        self._attached = True
        self._hold: Callable[[], None] | None = None  # called once, first thing, by the next lookup
        self._before_update: Callable[[], None] | None = None  # called once, before the next row update
        for em in self._hooked:
            em.sharded.register_post_lookup_tracker_fn(self.record_lookup)
        for hook in self._mc:
            self._wrap_mc(hook)

    @property
    def sharded_ebc(self) -> Any:
        """The first sharded embedding module (what a benchmark of one module's hook drives)."""
        return self.modules[0].sharded

    @property
    def lookup_groups(self) -> dict[tuple[str, ...], LookupGroup]:
        """The lookup groups of the first module, by feature keys."""
        return self._groups[id(self.modules[0].sharded)]

    # -- mapping ------------------------------------------------------------------------
    def _build_lookup_maps(self, em: EmbeddingModule) -> dict[tuple[str, ...], LookupGroup]:
        index = {(id(s.kernel), s.table, s.row_offset, s.col_offset): i for i, s in enumerate(self.shard_map.shards)}
        maps: dict[tuple[str, ...], LookupGroup] = {}
        for lookup in em.sharded._lookups:
            inner = getattr(lookup, "module", lookup)  # data_parallel lookups are DDP-wrapped
            keys: list[str] = []
            owners: list[int | None] = []
            for emb in getattr(inner, "_emb_modules", []):
                kernel = emb.emb_module
                for t in emb.config.embedding_tables:
                    i = None
                    if t.local_metadata is not None:
                        row_off, col_off = t.local_metadata.shard_offsets
                        i = index.get((id(kernel), em.key(t.name), int(row_off), int(col_off)))
                    for f in t.feature_names:
                        keys.append(f)
                        owners.append(i)
            key = tuple(keys)
            bitmaps = [None if i is None else self._slice(self._last, i) for i in owners]
            m = LookupGroup(key, owners, bitmaps, any(i is not None for i in owners))
            if key in maps and (maps[key].any_tracked or m.any_tracked):
                raise RuntimeError(f"two lookup groups of {em.fqn} receive the same features {key}: cannot tell them apart")
            if key not in maps or m.any_tracked:
                maps[key] = m
        return maps

    def _build_mc_hook(self, em: EmbeddingModule) -> _McHook:
        """Where the slots each table of a managed-collision module evicts go: its one local
        shard (row-wise only, so one per rank)."""
        assert em.managed_collision is not None
        index = {id(s): i for i, s in enumerate(self.shard_map.shards)}
        evictions: dict[str, LookupGroup] = {}
        for c in em.configs():
            shards = [index[id(s)] for s in self.shard_map.of_table(em.key(c.name))]
            if len(shards) > 1:
                raise RuntimeError(f"managed-collision table {em.key(c.name)} has {len(shards)} shards on this rank, not one")
            if shards:
                (i,) = shards
                evictions[c.name] = LookupGroup((em.key(c.name),), [i], [self._slice(self._last, i)], True)
        return _McHook(em, em.managed_collision, evictions, {})

    def _check_every_shard_tracked(self) -> None:
        """Every local shard is looked up by some lookup group (else its rows would go unsaved)."""
        used = {i for groups in self._groups.values() for m in groups.values() for i in m.shards if i is not None}
        missing = [s.table for i, s in enumerate(self.shard_map.shards) if i not in used]
        if missing:
            raise RuntimeError(f"shards of {missing} belong to no lookup group of a sharded module: cannot track them")

    # -- the hook -----------------------------------------------------------------------
    def record_lookup(
        self, features: KeyedJaggedTensor, embs: torch.Tensor, module: nn.Module | None, raw_ids: torch.Tensor | None
    ) -> None:
        """The post-lookup hook: mark the shard-local ids of one lookup group's input as touched.
        torchrec calls it after the input all-to-all; public so a benchmark can time it. A
        profile shows it as `## deltarec tracker ##`, inside TorchRec's `## forward ##`."""
        with record_function("## deltarec tracker ##"):
            self._record_lookup(features, embs, module, raw_ids)

    def _record_lookup(
        self, features: KeyedJaggedTensor, embs: torch.Tensor, module: nn.Module | None, raw_ids: torch.Tensor | None
    ) -> None:
        self._run_hold()
        owner = module if module is not None else self.sharded_ebc
        previous = self._previous.get(id(owner))  # called first, so hooks chain
        if previous is not None:
            previous(features, embs, module, raw_ids)
        self._mark_lookup(owner, features, embs)

    def _run_hold(self) -> None:
        """The pending `hold_next_lookup` call: before any mark, in every forward (eval too)."""
        if self._hold is not None:
            hold, self._hold = self._hold, None
            hold()

    def _mark_lookup(self, owner: Any, features: KeyedJaggedTensor, embs: torch.Tensor) -> None:
        """Mark one lookup group's shard-local ids (a training forward only), after the guards
        and before the listener; place the pending `before_update` on its output's gradient."""
        training = owner.training and torch.is_grad_enabled()
        groups = self._groups.get(id(owner))
        # every group's output: each has its own kernels. A forward without backward (eval,
        # no_grad) changes no row: the wait stays pending for the next one that has one.
        if self._before_update is not None and training and isinstance(embs, torch.Tensor) and embs.requires_grad:
            embs.register_hook(self._run_before_update)
        if not training:
            return
        keys = tuple(features.keys())
        m = groups.get(keys) if groups is not None else None
        if m is None:
            raise RuntimeError(
                f"RowTracker: a lookup of {type(owner).__name__} received features {keys}, which match no "
                f"lookup group {list(groups or {})}; rows would go untracked"
            )
        if not m.any_tracked:
            return
        # One narrow view per key, one index_fill_ per key into the bitmap of that key's shard.
        # length_per_key() is a list the input all-to-all has already filled in (no sync; a
        # managed-collision lookup's is computed here: module docstring).
        parts = features.values().split(features.length_per_key())
        for guard in self._guards:  # a tuple replaced whole by `guard`: safe to iterate as it changes
            guard(m, list(parts))
        for bits, ids in zip(m.bitmaps, parts):
            if bits is not None:
                bits.index_fill_(0, ids, True)
        if self.listener is not None:
            self.listener(m, list(parts))

    def _hooks_now(self) -> dict[int, Callable[..., None] | None]:
        """Each hooked module's registered post-lookup hook, by module id."""
        return {id(em.sharded): em.sharded.post_lookup_tracker_fn for em in self._hooked}

    # -- managed-collision modules (module docstring, "Managed-collision tables") ---------
    def _wrap_mc(self, hook: _McHook) -> None:
        """Replace the module instance's `compute` and `_evict` with wrappers that mark, each
        calling what the attribute was before (so an earlier wrapper still runs)."""
        module = hook.module.sharded
        hook.replaced = {name: module.__dict__.get(name, _UNSET) for name in _MC_METHODS}
        compute, evict = module.compute, module._evict

        def tracked_compute(ctx: Any, dist_input: Any) -> list[torch.Tensor]:
            out = compute(ctx, dist_input)
            self._record_mc_lookups(hook, ctx, out)
            return out

        def tracked_evict(evictions_per_table: dict[str, torch.Tensor | None]) -> None:
            self._record_mc_evictions(hook, evictions_per_table)
            evict(evictions_per_table)

        module.compute = tracked_compute
        module._evict = tracked_evict

    def _unwrap_mc(self, hook: _McHook) -> None:
        """Put back the instance attributes `_wrap_mc` replaced."""
        module = hook.module.sharded
        for name, value in hook.replaced.items():
            if value is _UNSET:
                delattr(module, name)
            else:
                setattr(module, name, value)

    def _record_mc_evictions(self, hook: _McHook, evictions_per_table: dict[str, torch.Tensor | None]) -> None:
        """Mark the local slots about to be redrawn, after letting the pending hold, the
        pending `before_update` wait and the guards see the rows as they are."""
        evicted = [(t, ids) for t, ids in evictions_per_table.items() if ids is not None]
        if not evicted:
            return
        with record_function("## deltarec tracker ##"):
            self._run_hold()
            fn, self._before_update = self._before_update, None  # the rows change now, not in backward
            if fn is not None:
                fn()
            for table, ids in evicted:
                m = hook.evictions.get(table)
                if m is None:
                    raise RuntimeError(
                        f"RowTracker: {hook.module.fqn or '<root>'} evicted slots of table {table}, which has no "
                        "shard on this rank; rows would go untracked"
                    )
                parts = [ids.to(torch.int64)]
                for guard in self._guards:
                    guard(m, list(parts))
                bits = m.bitmaps[0]
                assert bits is not None
                bits.index_fill_(0, parts[0], True)
                if self.listener is not None:
                    self.listener(m, list(parts))

    def _record_mc_lookups(self, hook: _McHook, ctx: Any, out: list[torch.Tensor]) -> None:
        """Mark the slots the inner collection's `compute` looked up: `ctx.remapped_kjt`, one
        KJT per lookup, beside its output."""
        with record_function("## deltarec tracker ##"):
            self._run_hold()
            remapped = getattr(ctx, "remapped_kjt", None)
            if remapped is None or len(remapped) != len(out):
                raise RuntimeError(
                    f"RowTracker: {hook.module.fqn or '<root>'}'s compute left no remapped ids for its "
                    f"{len(out)} lookups in its context; rows would go untracked"
                )
            for features, embs in zip(remapped, out):
                self._mark_lookup(hook.inner.sharded, features, embs)

    def hold_next_lookup(self, fn: Callable[[], None], before_update: Callable[[], None]) -> None:
        """Have the next lookup call `fn()` before it marks anything, and the next backward
        pass call `before_update()` before the embedding kernels may update a row: a gradient
        hook on each lookup group's output, which runs before the fused optimizer's backward,
        placed by the next training forward (a forward without backward leaves it pending).
        A managed-collision eviction changes rows in the forward pass: both calls then run
        there, before the redraw, whatever the forward (module docstring, "Managed-collision
        tables"). The lookup hook runs in the forward pass, after the lookup read its rows
        (ckpt/capture/overlapped_copy.py waits at both points for a checkpoint's copy; the checkpoint
        checkpointer's own calls wait for all of it)."""
        assert self._attached, "a detached tracker's hook never runs: nothing would wait"
        self._hold = fn
        self._before_update = before_update

    def guard(self, fn: Callable[[LookupGroup, list[torch.Tensor]], None]) -> Callable[[], None]:
        """Call `fn(group, ids)` in every training lookup, with its shard-local ids per key
        position, before the backward pass may update those rows, and with the slots a
        managed-collision eviction is about to redraw (a one-key group of the table's shard),
        until the returned function is called (from any thread). A copy-on-write snapshot saves rows aside there
        (ckpt/capture/copy_on_write.py); it registers before the next step's first lookup may
        go on (`hold_next_lookup`)."""
        assert self._attached, "a detached tracker's hook never runs: nothing would be saved aside"
        with self._guards_lock:
            self._guards = (*self._guards, fn)

        def remove() -> None:
            with self._guards_lock:
                self._guards = tuple(g for g in self._guards if g is not fn)

        return remove

    def _run_before_update(self, grad: torch.Tensor | None) -> None:
        """The gradient hook `hold_next_lookup` places: the first call runs `before_update`."""
        fn, self._before_update = self._before_update, None
        if fn is not None:
            fn()

    @property
    def attached(self) -> bool:
        """Whether the hook is registered (`detach` / `attach`)."""
        return self._attached

    def detach(self) -> None:
        """Stop recording (restores whatever hook was registered before this tracker, and the
        managed-collision modules' methods)."""
        if self._attached:
            for em in self._hooked:
                em.sharded.post_lookup_tracker_fn = self._previous[id(em.sharded)]
            for hook in self._mc:
                self._unwrap_mc(hook)
            self._attached = False

    def attach(self) -> None:
        """Record again after `detach()`."""
        if not self._attached:
            self._previous = self._hooks_now()
            for em in self._hooked:
                em.sharded.post_lookup_tracker_fn = self.record_lookup
            for hook in self._mc:
                self._wrap_mc(hook)
            self._attached = True

    # -- queries ------------------------------------------------------------------------
    def _slice(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        start = self._starts[i]
        return flat[start : start + self.shard_map.shards[i].num_rows]

    def since_last(self, i: int) -> torch.Tensor:
        """bool [num_rows] of shard `i`: rows touched since the last mark_checkpoint()/mark_base() (a copy)."""
        return self._slice(self._last, i).clone()

    def since_base(self, i: int) -> torch.Tensor:
        """bool [num_rows] of shard `i`: rows touched since the last mark_base() (includes since_last)."""
        return self._slice(self._base, i) | self._slice(self._last, i)

    def touched_rows(self, i: int, since_base: bool, count: int | None = None) -> torch.Tensor:
        """Sorted int64 local row indices of shard `i` that `since_base(i)` / `since_last(i)` mark
        (`count`: how many, from `counts`, which spares a GPU's `nonzero` its wait)."""
        mask = self.since_base(i) if since_base else self._slice(self._last, i)
        return rows_of(mask, count)

    def trained(self, i: int) -> torch.Tensor:
        """bool [num_rows] of shard `i`: rows touched since the model was initialised."""
        return self._slice(self._trained, i) | self.since_base(i)

    def trained_rows(self, i: int, count: int | None = None) -> torch.Tensor:
        """Sorted int64 local row indices of shard `i` that `trained(i)` marks (`count` as in `touched_rows`)."""
        return rows_of(self.trained(i), count)

    def counts(self, since_base: bool, trained: bool = False) -> list[int]:
        """Rows marked per shard (one host sync for all shards): since the last checkpoint,
        since the base, or (`trained`) since the model was initialised."""
        if not self._starts:
            return []
        masks = []
        for i in range(len(self._starts)):
            mask = self._slice(self._last, i)
            if since_base or trained:
                mask = mask | self._slice(self._base, i)
            if trained:
                mask = mask | self._slice(self._trained, i)
            masks.append(mask)
        if self._last.device.type == "cpu":
            return [_count(m) for m in masks]
        return [int(c) for c in torch.stack([m.sum() for m in masks]).tolist()]

    def all_counts(self, trained: bool) -> tuple[list[int], list[int], list[int] | None]:
        """Rows marked per shard since the base, since the last checkpoint and (`trained`) since
        the model was initialised: what `counts` gives for each, on CPU from one OR of the flat
        bitmaps into a scratch buffer instead of a new mask per shard and kind."""
        if self._last.device.type != "cpu" or not self._starts:
            full = self.counts(since_base=True, trained=True) if trained else None
            return self.counts(since_base=True), self.counts(since_base=False), full
        if self._scratch is None:
            self._scratch = np.empty(self._last.numel(), dtype=np.bool_)
        last, scratch = self._last.numpy(), self._scratch
        spans = [(start, start + s.num_rows) for start, s in zip(self._starts, self.shard_map.shards)]
        since_last = [int(np.count_nonzero(last[a:b])) for a, b in spans]
        np.logical_or(self._base.numpy(), last, out=scratch)
        since_base = [int(np.count_nonzero(scratch[a:b])) for a, b in spans]
        if not trained:
            return since_base, since_last, None
        np.logical_or(self._trained.numpy(), scratch, out=scratch)
        return since_base, since_last, [int(np.count_nonzero(scratch[a:b])) for a, b in spans]

    def count_since_last(self) -> int:
        """Rows touched since the last checkpoint, summed over shards (a row of two column shards counts twice)."""
        return _count(self._last)

    def count_since_base(self) -> int:
        """Rows touched since the last base, summed over shards."""
        return _count(self._base | self._last)

    @property
    def starts(self) -> list[int]:
        """Where each shard's rows start in the flat bitmaps (shard order)."""
        return list(self._starts)

    def changed_since_last(self) -> torch.Tensor:
        """The flat bool bitmap (every shard back to back) of rows touched since the last checkpoint (a copy)."""
        return self._last.clone()

    def since_committed_rows(self, i: int) -> torch.Tensor:
        """Sorted int64 local rows of shard `i` changed since the newest checkpoint `committed`
        was told of (needs `keep_uncommitted`)."""
        assert self._uncommitted is not None, "keep_uncommitted() was not called"
        mask = self._slice(self._last, i).clone()
        for _, rows in self._uncommitted:
            mask |= self._slice(rows, i)
        return rows_of(mask)

    # -- since the newest committed checkpoint ----------------------------------------------
    _MAX_UNCOMMITTED = 4  # entries kept apart; older ones are OR-ed together (a superset)

    def keep_uncommitted(self) -> None:
        """From now on keep what `since_committed_rows` needs (one bitmap per checkpoint in flight)."""
        if self._uncommitted is None:
            self._uncommitted = []

    def remember(self, checkpoint_id: int) -> None:
        """Right before checkpoint `checkpoint_id` marks the bitmaps: keep the rows it captured
        since the checkpoint before it until it is known committed."""
        if self._uncommitted is None:
            return
        self._uncommitted.append((checkpoint_id, self._last.clone()))
        if len(self._uncommitted) > self._MAX_UNCOMMITTED:  # a long outage: merge the oldest two
            (_, older), (cid, newer) = self._uncommitted[:2]
            self._uncommitted[:2] = [(cid, older | newer)]

    def committed(self, checkpoint_id: int) -> None:
        """Checkpoint `checkpoint_id` committed: the rows it (and every one before it) holds
        are no longer changes since the newest committed checkpoint."""
        if self._uncommitted is not None:
            self._uncommitted = [(cid, rows) for cid, rows in self._uncommitted if cid > checkpoint_id]

    def touch(self, masks: list[torch.Tensor]) -> None:
        """Mark rows as changed since the last checkpoint (one bool mask per shard, in shard
        order): rows a restore set to something no committed checkpoint holds."""
        assert len(masks) == len(self._starts), (len(masks), len(self._starts))
        for i, mask in enumerate(masks):
            self._slice(self._last, i).logical_or_(mask.to(self.device))

    # -- marks --------------------------------------------------------------------------
    def mark_checkpoint(self) -> None:
        """Fold since_last into since_base and clear since_last (right after a delta snapshot)."""
        torch.logical_or(self._base, self._last, out=self._base)
        self._last.zero_()

    def mark_saved(self, local_rows: list[torch.Tensor]) -> None:
        """After a checkpoint that saved only these rows of what changed (sorted local indices
        per shard, a prioritized checkpoint): they fold into since_base, the others stay
        changed since the last checkpoint, for a later one to save."""
        assert len(local_rows) == len(self._starts), (len(local_rows), len(self._starts))
        for i, rows in enumerate(local_rows):
            self._slice(self._base, i).index_fill_(0, rows.to(self.device), True)
            self._slice(self._last, i).index_fill_(0, rows.to(self.device), False)

    def mark_base(self) -> None:
        """Clear both bitmaps, folding them into `trained` (right after a full snapshot)."""
        torch.logical_or(self._trained, self._base, out=self._trained)
        torch.logical_or(self._trained, self._last, out=self._trained)
        self._base.zero_()
        self._last.zero_()

    def load_trained(self, masks: list[torch.Tensor]) -> None:
        """After a restore: the rows the stream held, one bool mask per shard (in shard
        order), are the rows trained so far; the other bitmaps start empty."""
        assert len(masks) == len(self._starts), (len(masks), len(self._starts))
        for i, mask in enumerate(masks):
            self._slice(self._trained, i).copy_(mask)
        self._base.zero_()
        self._last.zero_()

    # -- state --------------------------------------------------------------------------
    def _names(self) -> list[str]:
        return [f"{s.table}.r{s.row_offset}.c{s.col_offset}" for s in self.shard_map.shards]

    _KINDS = ("since_last", "folded_base", "trained")

    def _flat(self, kind: str) -> torch.Tensor:
        return {"since_last": self._last, "folded_base": self._base, "trained": self._trained}[kind]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Per shard `<table>.r<row_offset>.c<col_offset>.{since_last,folded_base,trained}`: bool CPU tensors."""
        out: dict[str, torch.Tensor] = {}
        for i, name in enumerate(self._names()):
            for kind in self._KINDS:
                out[f"{name}.{kind}"] = self._slice(self._flat(kind), i).cpu().clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load bitmaps saved by `state_dict()` of a tracker over the same shards (same plan)."""
        expected = {f"{n}.{kind}" for n in self._names() for kind in self._KINDS}
        if set(state) != expected:
            raise ValueError(
                f"RowTracker state does not match this rank's shards: missing {sorted(expected - set(state))}, "
                f"unexpected {sorted(set(state) - expected)}"
            )
        for i, name in enumerate(self._names()):
            for kind in self._KINDS:
                t = state[f"{name}.{kind}"]
                dst = self._slice(self._flat(kind), i)
                if t.dtype != torch.bool or t.shape != dst.shape:
                    raise ValueError(f"RowTracker state {name}.{kind}: {t.dtype} {tuple(t.shape)}, want bool {tuple(dst.shape)}")
        for i, name in enumerate(self._names()):
            for kind in self._KINDS:
                self._slice(self._flat(kind), i).copy_(state[f"{name}.{kind}"])
