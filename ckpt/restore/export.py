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
otherwise. A managed-collision table comes out by slot, as its rows are stored; the raw id ->
slot mapping records beside them in the stream are not part of an export yet. The design is
described in docs/design/restore.md.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ckpt.dense.store import DenseRef, DenseStore
from ckpt.faults import maybe_die
from ckpt.log.markers import Marker
from ckpt.restore.replay import decode_rows, iter_chain_frames, row_init_of
from ckpt.stream.frames import Frame
from ckpt.stream.sink import FrameSource
from ckpt.types import RestoreError
from common.errors import DeltarecError
from common.files import fsync_dir
from sharding.row_init import fill_rows

#: The module every exported FQN is relative to (what `trainer.model.build_model` returns).
FQN_ROOT = "DLRMTrain"
#: The root of serving snapshots (ckpt/follow/serving.py): the inner DLRM, without the loss.
SERVING_ROOT = "DLRM"
#: DCP key prefixes of the groups that are not part of the model's state_dict.
OPTIM_PREFIX = "optim."
BUFFERS_PREFIX = "buffers."
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
        )

    def to_file(self) -> dict[str, Any]:
        """The `torch.save` payload (documented in this module's docstring)."""
        return {
            "fqn_root": self.fqn_root,
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "model": self.model,
            "optim": self.optim,
            "buffers": self.buffers,
            "tables": self.tables,
        }

    def to_dcp(self) -> dict[str, Any]:
        """Flat DCP keys: model FQNs as they are, the other groups under their prefixes."""
        flat: dict[str, Any] = dict(self.model)
        for fqn, states in self.optim.items():
            flat.update({f"{OPTIM_PREFIX}{fqn}.{name}": value for name, value in states.items()})
        flat.update({f"{BUFFERS_PREFIX}{fqn}": b for fqn, b in self.buffers.items()})
        return flat


def assemble(
    marker: Marker,
    frames: Iterable[tuple[bool, Frame]],
    replicated: Collection[str] = (),
) -> dict[str, dict[str, torch.Tensor]]:
    """Write `frames` (each with whether it belongs to the chain's base), base first, into
    full tables: {table: {"weight": ..., "<state>": ...}}. The base must cover every table.

    Tables in `replicated` (data-parallel: trained by the dense optimizer, they travel with
    the dense state and have no rows in the stream) are left out. Mapping frames (the raw id
    -> slot records of managed-collision tables) hold no rows and are passed over: a table's
    rows come out by slot."""
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


def build_export(marker: Marker, tables: dict[str, dict[str, torch.Tensor]], dense_state: dict[str, Any]) -> ExportedModel:
    """Rename assembled tables and a captured dense state to unsharded DLRMTrain FQNs."""
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
    return ExportedModel(marker.checkpoint_id, marker.step, model, optim, buffers, names, root)


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
    `torch.save` payload, whose ``"tables"`` maps each table to its weight's FQN."""
    dense_state = dense.read(DenseRef.from_json(marker.dense))
    frames = ((link.full, frame) for link, frame in iter_chain_frames(marker, source, run_id, locate))
    tables = assemble(marker, frames, replicated_tables(marker, dense_state))
    return write_export(build_export(marker, tables, dense_state), out, dcp_dir)
