"""Exports and serving snapshots key managed-collision tables by raw id.

Chains are written through the real frame writer to a filesystem sink as ranks write them
(tests/unit/test_mapping_follow.py's `Writer`: each rank's rows, then its shard's mapping
record, full or a delta), over random shard states (seed printed):
- `deltarec-ckpt export`'s ``"mc"`` holds, per managed-collision table, the ids the states the
  records were made from hold, ascending, each with the row the chain wrote at its slot, its
  counters, and each shard's miss row; no free slot's row is among them; `McTable.lookup`
  reads a held id's row and an unheld id's shard's miss row; the DCP directory holds the same;
- an export of a chain without mapping frames has exactly today's keys and bytes;
- the follower's serving snapshot holds the same ``"mc"`` as the export of the same chain;
- a mapping that does not fold or does not make up a whole table is refused in one line.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ckpt.dense.store import DenseStore
from ckpt.follow.serving import Publisher
from ckpt.follow.store import RowStore
from ckpt.log.markers import ChainLink, Marker
from ckpt.restore.export import (
    FQN_ROOT,
    ExportedModel,
    ExportError,
    McTable,
    assemble,
    build_export,
    export,
    mc_tables,
    write_export,
)
from ckpt.restore.replay import iter_chain_frames
from ckpt.stream.filesystem import FsSource
from ckpt.stream.mapping import MappingRecord, record_for
from ckpt.types import RestoreError
from sharding.managed_collision import FREE, McState, route
from tests.unit.test_managed_collision import _evolve, _grow, _states
from tests.unit.test_mapping_follow import MC, MC_ROWS, RUN, TABLES, WORLD, Writer, _diff_record, _feed, _locate

if TYPE_CHECKING:
    from tests.conftest import ReplaySeed

CHECKPOINTS = 5
DENSE: dict[str, Any] = {"params": {}, "optimizer": {}, "buffers": {}, "root": "Own"}  # a user's own model: no DLRM prefix


def _history(rng: np.random.Generator, checkpoints: int) -> list[list[McState]]:
    """`states[c][rank]`: each rank's shard state at checkpoints 1..`checkpoints` (index 0 unused),
    the ranks in step as torchrec keeps them (the same iteration and eviction phase)."""
    first = _states(rng, MC_ROWS, WORLD, "distance_lfu")
    states: list[list[McState]] = [first, first]
    for _ in range(checkpoints - 1):
        step = _grow if rng.random() < 0.5 else _evolve
        moved = [step(rng, s, WORLD, rank) for rank, s in enumerate(states[-1])]
        evicted = max(s.last_eviction_iter for s in moved)
        states.append([dataclasses.replace(s, last_eviction_iter=evicted) for s in moved])
    return states


def _chain(root: Path, states: list[list[McState]], mapping: bool = True) -> tuple[Marker, list[ChainLink]]:
    """Checkpoints 1..CHECKPOINTS of `states` (each rank's record full or a delta, whichever is
    smaller), committed with a dense file; the marker of the last."""
    writer = Writer(root / "chain", mapping)
    chain = []
    for cid in range(1, CHECKPOINTS + 1):
        records = {r: record_for(None if cid == 1 else states[cid - 1][r], states[cid][r], cid - 1) for r in range(WORLD)}
        chain.append(writer.link(cid, cid == 1, records))
    writer.close()
    ref = DenseStore(root / "dense").write(CHECKPOINTS, DENSE)
    marker = Marker(
        kind="commit", run_id=RUN, checkpoint_id=CHECKPOINTS, step=CHECKPOINTS, world_size=WORLD, chain=chain,
        tables=TABLES, dense=ref.as_json(),
    )  # fmt: skip
    return marker, chain


def _weights(marker: Marker, root: Path) -> torch.Tensor:
    """The MC table's weight by slot, as the chain's rows give it (mapping frames passed over)."""
    frames = ((link.full, f) for link, f in iter_chain_frames(marker, FsSource(root / "chain", RUN), RUN, _locate))
    return assemble(marker, frames)[MC]["weight"]


def _expected(states: list[McState]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Held ids ascending with their global slots and counters, read off the shard states."""
    ids, slots, counts, access = [], [], [], []
    for s in states:
        for local, raw in enumerate(s.raw_ids.tolist()):
            if raw != FREE:
                ids.append(raw)
                slots.append(s.slot_offset + local)
                counts.append(None if s.counts is None else int(s.counts[local]))
                access.append(None if s.last_access is None else int(s.last_access[local]))
    order = np.argsort(np.array(ids, dtype=np.int64))
    has_counts, has_access = states[0].counts is not None, states[0].last_access is not None
    return (
        np.array(ids, dtype=np.int64)[order],
        np.array(slots, dtype=np.int64)[order],
        np.array(counts, dtype=np.int64)[order] if has_counts else None,
        np.array(access, dtype=np.int64)[order] if has_access else None,
    )


def _export(root: Path, marker: Marker, dcp: bool = True) -> tuple[dict[str, Any], Path]:
    out, dcp_dir = root / "out" / "model.pt", root / "out" / "model.dcp"
    export(marker, FsSource(root / "chain", RUN), DenseStore(root / "dense"), RUN, _locate, out, dcp_dir if dcp else None)
    return torch.load(out, weights_only=True), dcp_dir


def test_the_export_keys_a_managed_collision_table_by_raw_id(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    states = _history(np.random.default_rng(replay_seed.value), CHECKPOINTS)
    marker, chain = _chain(tmp_path, states)
    assert any(not link.full for link in chain)
    f, dcp_dir = _export(tmp_path, marker)
    assert sorted(f["mc"]) == [MC], str(replay_seed)
    got = f["mc"][MC]
    ids, slots, counts, access = _expected(states[CHECKPOINTS])
    weight = _weights(marker, tmp_path)
    why = str(replay_seed)
    assert torch.equal(got["raw_ids"], torch.from_numpy(ids)), why
    assert torch.equal(got["slots"], torch.from_numpy(slots)), why
    assert torch.equal(got["rows"], weight[torch.from_numpy(slots)]), why
    assert torch.equal(got["rows"], f["model"][f"{MC}.weight"][got["slots"]]), why  # the same rows "model" holds by slot
    for name, want in (("counts", counts), ("last_access", access)):
        assert (name in got) == (want is not None) and (want is None or torch.equal(got[name], torch.from_numpy(want))), name
    miss = [s.miss_slot for s in states[CHECKPOINTS]]
    assert got["miss_slots"].tolist() == miss and torch.equal(got["miss_rows"], weight[miss]), why
    assert got["segments"].tolist() == list(states[CHECKPOINTS][0].segments)
    assert int(got["input_hash_size"]) == states[CHECKPOINTS][0].input_hash_size
    assert int(got["current_iter"]) == states[CHECKPOINTS][0].current_iter
    # the DCP directory holds the same, under mc.<table>.<field>
    flat_path = tmp_path / "flat.pt"
    dcp_to_torch_save(dcp_dir, flat_path)
    flat = torch.load(flat_path, weights_only=True)
    assert {k for k in flat if k.startswith(f"mc.{MC}.")} == {f"mc.{MC}.{name}" for name in got}
    assert all(torch.equal(flat[f"mc.{MC}.{name}"], value) for name, value in got.items())


def test_no_free_slot_row_is_exported_and_lookup_reads_by_raw_id(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    states = _history(np.random.default_rng(replay_seed.value), CHECKPOINTS)
    first = states[CHECKPOINTS][0]
    if not np.any(first.raw_ids[:-1] == FREE):  # a history that filled every slot of rank 0: the last checkpoint frees one
        raw = first.raw_ids.copy()
        raw[0] = FREE
        states[CHECKPOINTS][0] = dataclasses.replace(first, raw_ids=raw)
    marker, _ = _chain(tmp_path, states)
    f, _ = _export(tmp_path, marker, dcp=False)
    table = McTable.from_dict(f["mc"][MC])
    weight = _weights(marker, tmp_path)
    last = states[CHECKPOINTS]
    free = [s.slot_offset + i for s in last for i in np.flatnonzero(s.raw_ids[:-1] == FREE).tolist()]
    assert free, f"the states hold no free slot: {replay_seed}"
    exported = set(table.slots.tolist()) | set(table.miss_slots.tolist())
    assert not exported & set(free), str(replay_seed)
    assert exported == {s.slot_offset + i for s in last for i in range(s.size) if i == s.size - 1 or s.raw_ids[i] != FREE}
    assert torch.equal(table.rows, weight[table.slots]), str(replay_seed)  # each held id's own row, no free slot's
    # held ids read their rows; an id no shard holds reads the miss row of the shard it routes to
    g = torch.Generator().manual_seed(replay_seed.value)
    held = table.raw_ids[torch.randperm(table.raw_ids.numel(), generator=g)[:20]]
    assert torch.equal(table.lookup(held), weight[table.slots[torch.searchsorted(table.raw_ids, held)]])
    rng = np.random.default_rng(replay_seed.value + 1)
    unheld = np.setdiff1d(rng.integers(0, table.input_hash_size, size=50), table.raw_ids.numpy())
    ranks = route(unheld, table.input_hash_size, WORLD)
    assert torch.equal(table.lookup(torch.from_numpy(unheld)), weight[[last[r].miss_slot for r in ranks.tolist()]])


def test_an_export_without_managed_collision_tables_is_unchanged(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    states = _history(np.random.default_rng(replay_seed.value), CHECKPOINTS)
    marker, _ = _chain(tmp_path, states, mapping=False)
    f, _ = _export(tmp_path, marker)
    assert list(f) == ["fqn_root", "checkpoint_id", "step", "model", "optim", "buffers", "tables"]
    exported = build_export(marker, assemble(marker, [(True, fr) for _, fr in _frames(tmp_path, marker)]), DENSE)
    assert exported.mc == {} and exported.to_dcp().keys() == exported.model.keys() | {
        f"optim.{fqn}.{name}" for fqn, states in exported.optim.items() for name in states
    }
    before = {  # what an export held before managed-collision tables were keyed by raw id
        "fqn_root": exported.fqn_root,
        "checkpoint_id": exported.checkpoint_id,
        "step": exported.step,
        "model": exported.model,
        "optim": exported.optim,
        "buffers": exported.buffers,
        "tables": exported.tables,
    }
    assert _saved(exported.to_file()) == _saved(before)


def _frames(root: Path, marker: Marker) -> list[tuple[ChainLink, Any]]:
    return list(iter_chain_frames(marker, FsSource(root / "chain", RUN), RUN, _locate))


def _saved(payload: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


def test_the_serving_snapshot_holds_what_the_export_holds(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    states = _history(np.random.default_rng(replay_seed.value), CHECKPOINTS)
    marker, chain = _chain(tmp_path, states)
    store = RowStore()
    for link in chain:
        _feed(store, link, FsSource(tmp_path / "chain", RUN))
    store.check_complete(CHECKPOINTS)
    snap = Publisher(tmp_path / "serving", DenseStore(tmp_path / "dense"), keep=2, dcp=True).publish(store, marker, RUN)
    served = torch.load(snap.path, weights_only=True)
    f, _ = _export(tmp_path, marker, dcp=False)
    assert served["mc"].keys() == f["mc"].keys() == {MC}
    assert served["mc"][MC].keys() == f["mc"][MC].keys()
    for name, value in f["mc"][MC].items():
        assert torch.equal(served["mc"][MC][name], value), f"{name}: {replay_seed}"
    assert snap.dcp_dir is not None
    flat_path = tmp_path / "flat.pt"
    dcp_to_torch_save(snap.dcp_dir, flat_path)
    assert torch.equal(torch.load(flat_path, weights_only=True)[f"mc.{MC}.raw_ids"], f["mc"][MC]["raw_ids"])


def test_for_serving_keeps_the_tables_by_raw_id(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    states = _history(np.random.default_rng(replay_seed.value), 1)[1]
    weight = torch.randn(MC_ROWS, 4)
    mc = mc_tables(1, {MC: {"weight": weight}}, {MC: states})
    model = ExportedModel(1, 1, {f"model.{MC}.weight": weight}, {}, {}, {MC: f"model.{MC}.weight"}, FQN_ROOT, mc)
    serving = model.for_serving()
    assert serving.mc is mc and serving.tables == {MC: f"{MC}.weight"}
    payload = write_export(serving, tmp_path / "s.pt")
    assert McTable.from_dict(torch.load(tmp_path / "s.pt", weights_only=True)["mc"][MC]).raw_ids.equal(mc[MC].raw_ids)
    assert payload["mc"][MC]["rows"].equal(mc[MC].rows)
    partial = {k: v for k, v in payload["mc"][MC].items() if k not in ("rows", "segments")}
    with pytest.raises(ExportError, match="^not a managed-collision table of an export: no rows, segments$"):
        McTable.from_dict(partial)


def test_a_mapping_that_does_not_fold_or_is_not_whole_is_refused(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    states = _history(np.random.default_rng(replay_seed.value), 3)
    with pytest.raises(ExportError, match=f"checkpoint 7: the id mapping of table {MC} is not whole") as e:
        mc_tables(7, {MC: {"weight": torch.zeros(MC_ROWS, 4)}}, {MC: states[1][:1]})
    assert "\n" not in str(e.value)
    with pytest.raises(ExportError, match=f"table {MC} has an id mapping but no rows"):
        mc_tables(7, {}, {MC: states[1]})
    # a delta that follows a checkpoint the chain does not hold
    writer = Writer(tmp_path / "chain")
    chain = [
        writer.link(1, True, {r: MappingRecord.of_state(states[1][r]) for r in range(WORLD)}),
        writer.link(3, False, {r: _diff_record(states[2][r], states[3][r], 2) for r in range(WORLD)}),
    ]
    writer.close()
    ref = DenseStore(tmp_path / "dense").write(3, DENSE)
    marker = Marker(kind="commit", run_id=RUN, checkpoint_id=3, step=3, world_size=WORLD, chain=chain, tables=TABLES,
                    dense=ref.as_json())  # fmt: skip
    with pytest.raises(RestoreError, match="checkpoint 3: rank 0: mapping record of table .*: a delta from checkpoint 2, "
                                           "but the chain has the state of checkpoint 1") as e2:  # fmt: skip
        _export(tmp_path, dataclasses.replace(marker))
    assert "\n" not in str(e2.value)
