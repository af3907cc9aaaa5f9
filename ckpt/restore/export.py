"""Export a checkpoint as the full, unsharded model, keyed by the model's own state_dict FQNs.

The chain of a COMMIT marker is replayed into one full tensor per table, and the dense file
supplies the MLPs (and data-parallel tables). Both go out under the FQNs of the *unsharded*
`DLRMTrain` that `trainer.model.build_model` returns, so every key starts with ``model.``
(e.g. ``model.sparse_arch.embedding_bag_collection.embedding_bags.t_user.weight``,
``model.dense_arch.model._mlp.0._linear.weight``). That root is the module deltarec trains
and shards; a consumer holding the inner `DLRM` adds the ``model.`` prefix itself. A user's
own model (checkpointed through `ckpt.Checkpointer`) goes out under its own FQNs, with
``fqn_root`` its class name (the dense file records it), and is served as it is. Names
the dense file recorded through the DMP/DDP wrappers lose their wrapper prefixes
(``_dmp_wrapped_module.``, ``module.``) on the way out.

Two outputs with the same content:

- a `torch.save` file: ``{"fqn_root": "DLRMTrain", "checkpoint_id", "step",
  "model": {fqn: tensor}, "optim": {param fqn: {state: value}}, "buffers": {fqn: tensor},
  "tables": {table name: fqn of its weight in "model"}}``;
- optionally a `torch.distributed.checkpoint` directory holding the same tensors under flat
  keys: ``<fqn>`` for the model, ``optim.<param fqn>.<state>`` and ``buffers.<fqn>``.

``"model"`` is exactly ``DLRMTrain.state_dict()``: `model.load_state_dict(f["model"])` and
`dcp.load(model.state_dict(), checkpoint_id=DIR)` both work with no renaming. DCP's default
load planner reads only the keys it is asked for, so the extra ``optim.`` and ``buffers.``
keys do not get in the way; they load as a nested dict too (``{"optim": {fqn: {"sum": t}}}``
flattens to the same keys). Build the model with `build_model(cfg.model, cpu)` and
materialise only its embedding collection (`model.get_submodule(EBC_PATH).to_empty(device=
"cpu")`): `to_empty` on the whole model would also wipe DLRM's ``triu_indices`` buffer,
which is not in the state_dict and so is not loaded back.

Optimizer state is not part of a module's state_dict, so it sits beside it, keyed by the
FQN of the parameter it belongs to: the fused sparse optimizer's per-table state from the
rows (row-wise state ``[rows]``, element-wise state ``[rows, dim]``; row-wise state written
by column-wise shards is one tensor per column shard, named ``<state>@c<first column>``)
and the dense optimizer's per-parameter state (``step``, ``sum``, ...). Hyperparameters
are not exported: they are in the job's config. ``"buffers"`` holds the buffers the dense
file captured (including sharded modules' own, such as a data-parallel collection's
``_features_order_tensor``); DLRM and DLRM_DCN register only non-persistent buffers
(derived from the config), which `state_dict()` leaves out, hence their own group.

Data-parallel tables have no rows in the stream: their weights (and dense-optimizer
state) come from the dense file, under the same table FQNs as the row-sharded ones.

A chain whose marker names a row initialisation stores only trained rows; the others come
out at their initial values, regenerated (sharding/row_init.py).

Rows come out as the checkpoint stored them: bit-exact for fp32 encodings, dequantized
otherwise. The design is described in docs/design/restore.md.

Managed-collision tables (docs/design/managed-collision.md) are stored by slot, and a slot
means nothing without the raw id -> slot mapping records beside the rows in the stream. Their
weight in ``"model"`` stays by slot (what the module's own table holds); the export also folds
each shard's records over the chain (`MappingFold`: a full record is the state, a delta
applies to the state the link before it left), joins the shards (`to_global`) and gives, per
such table key, an `McTable` keyed by raw id: ``raw_ids`` (int64 ``[k]``, ascending, the ids
held), ``rows`` (``[k, dim]``, each id's row), ``slots`` (int64 ``[k]``, its global row),
``counts`` and ``last_access`` (``[k]``, when the eviction policy keeps them), ``miss_slots``
and ``miss_rows`` (``[W]`` and ``[W, dim]``: each shard's miss slot and row, which every id
routed to that shard and not held reads), ``miss_counts`` and ``miss_last_access`` (0-d, when
kept), ``current_iter``, ``last_eviction_iter``, ``input_hash_size`` (0-d) and ``segments``
(int64 ``[W + 1]``, the shards' first slots, then the table's rows); `McTable.lookup` reads
ids' rows. A free slot's row belongs to no id (an eviction left it, an admission draws it
again) and is not among them. The file holds them under ``"mc"``: ``{table: {field: tensor}}``
(the key is absent when there are no such tables, so other exports are unchanged), the DCP
directory under ``mc.<table>.<field>``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from ckpt.dense.store import DenseRef, DenseStore
from ckpt.faults import maybe_die
from ckpt.log.markers import Marker
from ckpt.restore.replay import decode_rows, iter_chain_frames, row_init_of
from ckpt.stream.frames import Frame
from ckpt.stream.mapping import MappingError, join_mapping
from ckpt.stream.sink import FrameSource
from ckpt.types import RestoreError
from common.errors import DeltarecError
from common.files import fsync_dir
from sharding.managed_collision import ManagedCollisionError, McState, route, to_global
from sharding.row_init import fill_rows

#: The module every exported FQN is relative to (what `trainer.model.build_model` returns).
FQN_ROOT = "DLRMTrain"
#: The root of serving snapshots (ckpt/follow/serving.py): the inner DLRM, without the loss.
SERVING_ROOT = "DLRM"
#: DCP key prefixes of the groups that are not part of the model's state_dict.
OPTIM_PREFIX = "optim."
BUFFERS_PREFIX = "buffers."
MC_PREFIX = "mc."
#: Prefixes the DMP and DDP wrappers can put in front of a DLRMTrain FQN.
_WRAPPER_PREFIXES = ("_dmp_wrapped_module.", "module.")
#: DLRMTrain's only child: every FQN relative to DLRMTrain starts with it.
_ROOT_CHILD = "model."


class ExportError(DeltarecError, ValueError):
    """The checkpoint's contents cannot be mapped onto the unsharded model's names."""


def table_fqn(table: str) -> str:
    """FQN of the weight of the table keyed `table` in the unsharded model's state_dict (a
    table's key is that FQN without ``.weight``: sharding/shard_views.py)."""
    return f"{table}.weight"


def unsharded_fqn(name: str | int, positions: Sequence[str] = ()) -> str:
    """The unsharded model's FQN of a parameter or buffer name recorded through the DMP/DDP
    wrappers (DMP already strips them from `named_parameters`; a name captured from a wrapper
    directly still carries them). An int is a plain optimizer's position: `positions` names it."""
    if isinstance(name, int):
        if not 0 <= name < len(positions):
            raise ExportError(f"dense optimizer state of parameter #{name}, which the dense file does not name")
        name = positions[name]
    fqn = name
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if fqn.startswith(prefix):
                fqn, stripped = fqn[len(prefix) :], True
    return fqn


#: `McTable`'s tensor fields, then its integers (0-d tensors in a file), in the order a file lists them
_MC_ARRAYS = ("raw_ids", "slots", "rows", "counts", "last_access", "miss_slots", "miss_rows", "segments")
_MC_SCALARS = ("miss_counts", "miss_last_access", "current_iter", "last_eviction_iter", "input_hash_size")
#: the fields every table has (the counters depend on the eviction policy)
_MC_REQUIRED = (
    "raw_ids",
    "slots",
    "rows",
    "miss_slots",
    "miss_rows",
    "segments",
    "current_iter",
    "last_eviction_iter",
    "input_hash_size",
)


@dataclass(frozen=True, eq=False)
class McTable:
    """A managed-collision table keyed by raw id: the ids its shards hold, each with its row and
    slot, and what an id no shard holds reads (its shard's miss row). Built from the folded
    mapping and the assembled rows (`mc_tables`); the export file's ``"mc"`` entry holds one
    per table key (`as_dict`, read back by `from_dict`). A free slot has no entry."""

    raw_ids: torch.Tensor  # int64 [k], ascending, unique
    slots: torch.Tensor  # int64 [k]: each id's global row
    rows: torch.Tensor  # [k, dim]: each id's row
    counts: torch.Tensor | None  # int64 [k]; None: the eviction policy keeps none
    last_access: torch.Tensor | None  # int64 [k]: the iteration of its last access; None: not kept
    miss_slots: torch.Tensor  # int64 [W]: shard r's miss slot (its last row)
    miss_rows: torch.Tensor  # [W, dim]: shard r's miss row
    segments: torch.Tensor  # int64 [W + 1]: the shards' first slots, then the table's rows
    miss_counts: int | None  # the miss slots' count (every shard's is the same); None: not kept
    miss_last_access: int | None
    current_iter: int
    last_eviction_iter: int
    input_hash_size: int

    @property
    def world_size(self) -> int:
        """Shards of the layout the mapping was written under (ids are routed over them)."""
        return int(self.segments.shape[0]) - 1

    def lookup(self, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """The rows raw ids `ids` read: a held id its own row, any other its shard's miss row
        (the shard torchrec routes it to over `world_size` ranks: `route`)."""
        want = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        out = self.miss_rows[torch.from_numpy(route(want.numpy(), self.input_hash_size, self.world_size))]
        if self.raw_ids.numel():
            at = torch.searchsorted(self.raw_ids, want).clamp(max=self.raw_ids.numel() - 1)
            held = self.raw_ids[at] == want
            out[held] = self.rows[at[held]]
        return out

    def as_dict(self) -> dict[str, torch.Tensor]:
        """Every field as a tensor (0-d for the scalars), absent counters left out."""
        out: dict[str, torch.Tensor] = {}
        for name in _MC_ARRAYS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        for name in _MC_SCALARS:
            value = getattr(self, name)
            if value is not None:
                out[name] = torch.tensor(value, dtype=torch.int64)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> McTable:
        """The table `as_dict` wrote (an export file's ``f["mc"][table]``)."""
        missing = [name for name in _MC_REQUIRED if d.get(name) is None]
        if missing:
            raise ExportError(f"not a managed-collision table of an export: no {', '.join(missing)}")
        try:
            arrays = {name: d.get(name) for name in _MC_ARRAYS}
            scalars = {name: None if d.get(name) is None else int(d[name]) for name in _MC_SCALARS}
            return cls(**arrays, **scalars)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise ExportError(f"not a managed-collision table of an export: {exc}") from None


class MappingFold:
    """The mapping records of a chain's managed-collision shards, folded as their frames arrive
    in chain order: a record's frames (chunks 0..count-1 of one partition) are joined once the
    last came; a full record is the shard's state, a delta applies to the state the shard's
    previous record left, which must be of the checkpoint it follows."""

    def __init__(self) -> None:
        self._pieces: dict[tuple[str, int], list[Frame]] = {}  # (table, partition) -> chunks of a record not yet whole
        self._shards: dict[tuple[str, int], tuple[McState, int]] = {}  # (table, first slot) -> (state, its checkpoint)

    def copy(self) -> MappingFold:
        """A fold that goes on from this one's records and leaves this one as it is (the records
        fold into new states; a state is never changed in place)."""
        out = MappingFold()
        out._pieces = {key: list(pieces) for key, pieces in self._pieces.items()}
        out._shards = dict(self._shards)
        return out

    def add(self, frame: Frame) -> None:
        """Take one mapping frame; fold its record in once whole. Refuses, in one line, a record
        that cannot be read or does not follow the state held."""
        key = (frame.table, frame.rank)
        pieces = self._pieces.setdefault(key, [])
        pieces.append(frame)
        if frame.chunk_index + 1 < frame.chunk_count:
            return
        del self._pieces[key]
        try:
            record = join_mapping(pieces)
            shard = (record.table, record.slot_offset)
            held = self._shards.get(shard)
            state = record.resolve(None, 0) if held is None else record.resolve(*held)
        except MappingError as exc:
            raise RestoreError(f"checkpoint {frame.checkpoint_id}: rank {frame.rank}: {exc}") from None
        self._shards[shard] = (state, frame.checkpoint_id)

    def states(self, checkpoint_id: int) -> dict[str, list[McState]]:
        """Each table's shard states after the chain of checkpoint `checkpoint_id`, by first
        slot. Refuses a record left part way."""
        for (table, partition), pieces in self._pieces.items():
            raise RestoreError(
                f"checkpoint {checkpoint_id}: table {table} rank {partition}: the mapping record of checkpoint "
                f"{pieces[0].checkpoint_id} has {len(pieces)} of its {pieces[0].chunk_count} frames"
            )
        out: dict[str, list[McState]] = {}
        for (table, _), (state, _) in sorted(self._shards.items()):
            out.setdefault(table, []).append(state)
        return out


def _int64(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np.int64))  # a copy: the states' arrays are read-only


def mc_tables(
    checkpoint_id: int, tables: Mapping[str, Mapping[str, torch.Tensor]], mapping: Mapping[str, Sequence[McState]]
) -> dict[str, McTable]:
    """Each managed-collision table of `mapping` (table key -> every shard's state) keyed by raw
    id, its rows taken by slot from the assembled `tables`. Refuses, in one line, a mapping of a
    table without rows, of another row count, or whose shards do not make up one whole table."""
    out: dict[str, McTable] = {}
    for table, states in sorted(mapping.items()):
        if table not in tables:
            raise ExportError(f"checkpoint {checkpoint_id}: table {table} has an id mapping but no rows in the stream")
        weight = tables[table]["weight"]
        try:
            glob = to_global(states)
        except ManagedCollisionError as exc:
            raise ExportError(f"checkpoint {checkpoint_id}: the id mapping of table {table} is not whole: {exc}") from None
        if glob.num_embeddings != weight.shape[0]:
            raise ExportError(
                f"checkpoint {checkpoint_id}: the id mapping of table {table} is of {glob.num_embeddings} slots, "
                f"the table has {weight.shape[0]} rows"
            )
        slots = _int64(glob.slots)
        miss = torch.tensor([s.miss_slot for s in sorted(states, key=lambda s: s.slot_offset)], dtype=torch.int64)
        out[table] = McTable(
            raw_ids=_int64(glob.raw_ids),
            slots=slots,
            rows=weight[slots],
            counts=None if glob.counts is None else _int64(glob.counts),
            last_access=None if glob.last_access is None else _int64(glob.last_access),
            miss_slots=miss,
            miss_rows=weight[miss],
            segments=torch.tensor(glob.segments, dtype=torch.int64),
            miss_counts=None if glob.counts is None else glob.miss_counts,
            miss_last_access=None if glob.last_access is None else glob.miss_last_access,
            current_iter=glob.current_iter,
            last_eviction_iter=glob.last_eviction_iter,
            input_hash_size=glob.input_hash_size,
        )
    return out


@dataclass(frozen=True)
class ExportedModel:
    """One checkpoint as the unsharded model, keyed by FQNs relative to `fqn_root`."""

    checkpoint_id: int
    step: int
    model: dict[str, torch.Tensor]  # exactly the keys of DLRMTrain.state_dict()
    optim: dict[str, dict[str, Any]]  # parameter FQN -> optimizer state name -> value
    buffers: dict[str, torch.Tensor]  # captured buffers (DLRM's are non-persistent)
    tables: dict[str, str]  # table name -> FQN of its weight in `model`
    fqn_root: str = FQN_ROOT
    mc: dict[str, McTable] = field(default_factory=dict)  # managed-collision table key -> the table by raw id

    def for_serving(self) -> ExportedModel:
        """The same model keyed relative to the inner `DLRM` (``model.`` stripped), the module
        a server runs: `DLRM.load_state_dict(f["model"])` on a freshly built one. Another model
        (a user's own, through `ckpt.Checkpointer`) is served as it is."""
        if self.fqn_root != FQN_ROOT:
            return self

        def strip(d: dict[str, Any]) -> dict[str, Any]:
            assert all(k.startswith(_ROOT_CHILD) for k in d), "every DLRMTrain FQN starts with model."
            return {k[len(_ROOT_CHILD) :]: v for k, v in d.items()}

        return ExportedModel(
            self.checkpoint_id,
            self.step,
            strip(self.model),
            strip(self.optim),
            strip(self.buffers),
            {t: fqn[len(_ROOT_CHILD) :] for t, fqn in self.tables.items()},
            SERVING_ROOT,
            self.mc,
        )

    def to_file(self) -> dict[str, Any]:
        """The `torch.save` payload (documented in this module's docstring); ``"mc"`` only when
        the model has managed-collision tables."""
        payload: dict[str, Any] = {
            "fqn_root": self.fqn_root,
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "model": self.model,
            "optim": self.optim,
            "buffers": self.buffers,
            "tables": self.tables,
        }
        if self.mc:
            payload["mc"] = {table: t.as_dict() for table, t in self.mc.items()}
        return payload

    def to_dcp(self) -> dict[str, Any]:
        """Flat DCP keys: model FQNs as they are, the other groups under their prefixes."""
        flat: dict[str, Any] = dict(self.model)
        for fqn, states in self.optim.items():
            flat.update({f"{OPTIM_PREFIX}{fqn}.{name}": value for name, value in states.items()})
        flat.update({f"{BUFFERS_PREFIX}{fqn}": b for fqn, b in self.buffers.items()})
        for table, t in self.mc.items():
            for name, value in t.as_dict().items():
                key = f"{MC_PREFIX}{table}.{name}"
                if key in flat:
                    raise ExportError(f"DCP key {key!r} names both a model entry and a field of managed-collision table {table}")
                flat[key] = value
        return flat


def assemble(
    marker: Marker,
    frames: Iterable[tuple[bool, Frame]],
    replicated: Collection[str] = (),
    mapping: MappingFold | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Write `frames` (each with whether it belongs to the chain's base), base first, into
    full tables: {table: {"weight": ..., "<state>": ...}}. The base must cover every table.

    Tables in `replicated` (data-parallel: trained by the dense optimizer, they travel with
    the dense state and have no rows in the stream) are left out. Mapping frames (the raw id
    -> slot records of managed-collision tables) hold no rows: a table's rows come out by
    slot, and the records are folded into `mapping` when one is given (`mc_tables` then keys
    the table by raw id)."""
    if not marker.tables:
        raise RestoreError(f"checkpoint {marker.checkpoint_id}: its marker has no table shapes (written by an older deltarec)")
    shapes = {name: shape for name, shape in marker.tables.items() if name not in replicated}
    init = row_init_of(marker)
    tables: dict[str, dict[str, torch.Tensor]] = {}
    for name, (rows, dim) in shapes.items():
        weight = torch.zeros(rows, dim) if init is None else torch.empty(rows, dim)
        if init is not None:  # the chain holds only trained rows: the others are at their initial values
            fill_rows(init, name, rows, dim, weight, 0, 0)
        tables[name] = {"weight": weight}
    # which cells the chain's base wrote: a table it leaves uncovered has no value there
    covered = {name: torch.zeros(rows, dim, dtype=torch.bool) for name, (rows, dim) in shapes.items()}
    for full, frame in frames:
        if frame.table in replicated:
            raise RestoreError(
                f"checkpoint {marker.checkpoint_id}: table {frame.table} has rows in the stream "
                "and a replicated copy in the dense state"
            )
        if frame.is_mapping:  # a managed-collision table's raw id -> slot record: no rows
            if frame.table not in marker.tables:
                raise RestoreError(f"mapping frame of unknown table {frame.table!r} in checkpoint {marker.checkpoint_id}")
            if mapping is not None:
                mapping.add(frame)
            continue
        if frame.table not in tables:
            raise RestoreError(f"frame of unknown table {frame.table!r} in checkpoint {marker.checkpoint_id}")
        weights, optim = decode_rows(frame)
        t = tables[frame.table]
        ids, c0, c1 = frame.row_ids, frame.col_offset, frame.col_offset + frame.dim
        t["weight"][ids, c0:c1] = weights
        if full:
            covered[frame.table][ids, c0:c1] = True
        rows = t["weight"].shape[0]
        for name, values in optim.items():
            if values.shape[1] == 1:
                key = name if frame.dim == t["weight"].shape[1] else f"{name}@c{c0}"
                t.setdefault(key, torch.zeros(rows))[ids] = values[:, 0]
            else:
                t.setdefault(name, torch.zeros(rows, t["weight"].shape[1]))[ids, c0:c1] = values
    for name, mask in covered.items():
        if init is None and not bool(mask.all()):
            raise RestoreError(f"checkpoint {marker.checkpoint_id}: table {name} is not fully covered by its base checkpoint")
    return tables


def _add_unique(group: dict[str, Any], fqn: str, value: Any, what: str) -> None:
    """Add one entry; two sources of the same FQN mean the checkpoint is inconsistent."""
    if fqn in group:
        raise ExportError(f"{what} {fqn!r} appears twice in the checkpoint (as rows and in the dense state?)")
    group[fqn] = value


def build_export(
    marker: Marker,
    tables: dict[str, dict[str, torch.Tensor]],
    dense_state: dict[str, Any],
    mapping: Mapping[str, Sequence[McState]] | None = None,
) -> ExportedModel:
    """Rename assembled tables and a captured dense state to unsharded DLRMTrain FQNs; with
    `mapping` (managed-collision table key -> every shard's state), key those tables by raw
    id too (`mc_tables`)."""
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {}
    for table, tensors in tables.items():
        fqn = table_fqn(table)
        _add_unique(model, fqn, tensors["weight"], "parameter")
        names[table] = fqn
        states = {k: v for k, v in tensors.items() if k != "weight"}
        if states:
            optim[fqn] = states
    for name, value in dense_state["params"].items():
        fqn = unsharded_fqn(name)
        _add_unique(model, fqn, value, "parameter")
        if fqn.removesuffix(".weight") in marker.tables:  # a data-parallel table
            names[fqn.removesuffix(".weight")] = fqn
    positions = dense_state.get("optimizer_param_names", [])
    for name, states in dense_state["optimizer"].get("state", {}).items():
        _add_unique(optim, unsharded_fqn(name, positions), dict(states), "optimizer state of")
    buffers: dict[str, torch.Tensor] = {}
    for name, value in dense_state["buffers"].items():
        _add_unique(buffers, unsharded_fqn(name), value, "buffer")
    root = str(dense_state.get("root", FQN_ROOT))
    mc = mc_tables(marker.checkpoint_id, tables, mapping) if mapping else {}
    return ExportedModel(marker.checkpoint_id, marker.step, model, optim, buffers, names, root, mc)


def replicated_tables(marker: Marker, dense_state: dict[str, Any]) -> set[str]:
    """Tables whose weights are dense parameters (data-parallel): they have no rows in the stream."""
    dense_fqns = {unsharded_fqn(name) for name in dense_state["params"]}
    return {t for t in marker.tables if table_fqn(t) in dense_fqns}


def write_export(exported: ExportedModel, out: Path, dcp_dir: Path | None = None) -> dict[str, Any]:
    """Write `exported` as a `torch.save` file (and a DCP directory), each atomically: both are
    written under temporary names first, then renamed into place, so `out` and `dcp_dir` are
    always a whole export, never half of one.

    A process killed on the way leaves at most its temporary names beside them (see
    `_temporary`); the next export to the same path removes them, and puts back a previous DCP
    directory that was moved aside when the kill came just before the new one was renamed in.
    Between the two renames `out` may be the new export and `dcp_dir` still the old one."""
    payload = exported.to_file()
    out.parent.mkdir(parents=True, exist_ok=True)
    _clear_leftovers(out)
    tmp, tmp_dir = _temporary(out, "tmp"), None
    try:
        torch.save(payload, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        maybe_die("export", 1, 0)
        if dcp_dir is not None:
            dcp_dir.parent.mkdir(parents=True, exist_ok=True)
            _clear_leftovers(dcp_dir)
            tmp_dir = _temporary(dcp_dir, "tmp")
            # one process writes the whole model, even inside a job's process group
            dcp.save(exported.to_dcp(), checkpoint_id=str(tmp_dir), no_dist=True)
            maybe_die("export", 2, 0)
        os.replace(tmp, out)
        fsync_dir(out.parent)
        if tmp_dir is not None and dcp_dir is not None:
            _swap_in(tmp_dir, dcp_dir)
    finally:
        tmp.unlink(missing_ok=True)
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return payload


_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<host>[^/]+)-(?P<pid>\d+)")


def _temporary(path: Path, kind: str) -> Path:
    """`.<name>.<kind>-<host>-<pid>` beside `path`: `tmp` while it is written, `old` for the
    previous DCP directory while the new one is renamed in. Host and pid tell a leftover of a
    dead process from the work of a live one (on a filesystem several hosts share, too)."""
    return path.with_name(f".{path.name}.{kind}-{socket.gethostname()}-{os.getpid()}")


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove(path: Path) -> None:
    """Remove a leftover file or directory (a symlink itself, not what it points to)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _clear_leftovers(path: Path) -> None:
    """Remove what an export to `path` killed on this host left (its temporary names); put
    back the previous DCP directory if it was killed after moving it aside and before renaming
    the new one in."""
    if not path.parent.is_dir():
        return
    host = socket.gethostname()
    for p in sorted(path.parent.iterdir(), key=lambda q: q.name):
        m = _LEFTOVER.fullmatch(p.name)
        if m is None or m["name"] != path.name or m["host"] != host or _pid_alive(int(m["pid"])):
            continue
        if m["kind"] == "old" and not path.exists():
            os.replace(p, path)
        else:
            _remove(p)


def _swap_in(new: Path, final: Path) -> None:
    """Rename directory `new` to `final`, replacing what is there: the old one is renamed
    aside first (a non-empty directory cannot be replaced by a rename) and removed last."""
    old = _temporary(final, "old") if final.exists() else None
    if old is not None:
        os.replace(final, old)
    maybe_die("export", 3, 0)
    os.replace(new, final)
    fsync_dir(final.parent)
    if old is not None:
        _remove(old)


def export(
    marker: Marker,
    source: FrameSource,
    dense: DenseStore,
    run_id: str,
    locate: Callable[[int, int, int], str],
    out: Path,
    dcp_dir: Path | None = None,
) -> dict[str, Any]:
    """Write the unsharded model of `marker` to `out` (and `dcp_dir`); returns the
    `torch.save` payload, whose ``"tables"`` maps each table to its weight's FQN (and whose
    ``"mc"``, when there are managed-collision tables, holds each keyed by raw id)."""
    dense_state = dense.read(DenseRef.from_json(marker.dense))
    frames = ((link.full, frame) for link, frame in iter_chain_frames(marker, source, run_id, locate))
    mapping = MappingFold()
    tables = assemble(marker, frames, replicated_tables(marker, dense_state), mapping)
    exported = build_export(marker, tables, dense_state, mapping.states(marker.checkpoint_id))
    return write_export(exported, out, dcp_dir)
