"""Partial recovery (CPR): which survivor snapshots a restore uses, and what the failure cost.

With `ckpt.recovery.mode: partial` a restore of checkpoint k adds, after k's chain, the survivor
snapshots (ckpt/recovery/survivor.py) that the previous trainer attempt's ranks left, when they fit:

- only records of the attempt just before this one (an older attempt's were superseded by
  what that attempt did next; another run's never reach this run's log fold);
- only records whose rows are a delta of k: written on top of k itself, or on top of an
  older checkpoint of the attempt that also wrote k (rows changed since an older one include
  every row changed since k, and the rest equal k's);
- never one through a generation `deltarec-ckpt gc` dropped.

The survivors' shards then hold their rows as they were at the failure, the dead ranks'
shards k's; dense state, step and the survivors' loop state come from the survivor that got
furthest; a rank whose snapshot is missing continues its reader from k's position, skipping
the batches it would have trained (its samples are not trained again: CPR's lost samples).
With no usable record the restore is exactly a full recovery (docs/design/partial-recovery.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from ckpt.log.catalog import Catalog
from ckpt.log.markers import Marker, SurvivorRecord
from ckpt.recovery.lost_samples import lost_samples
from ckpt.types import RestoreError

logger = logging.getLogger(__name__)


@runtime_checkable
class SkipsBatches(Protocol):
    """A loop whose reader can move forward without training (the trainer's)."""

    def skip_batches(self, n: int) -> None: ...


def usable_survivors(catalog: Catalog, marker: Marker) -> list[SurvivorRecord]:
    """The survivor snapshots a restore of `marker` may add, by rank (see the module
    docstring). `catalog` is the log as read before this attempt announced itself, so its
    newest trainer attempt is the one that just ended."""
    if not catalog.trainer_attempts:
        return []
    previous = catalog.trainer_attempts[-1].attempt
    out = []
    for _, r in sorted(catalog.survivors.get(previous, {}).items()):
        delta_of_marker = r.base == marker.checkpoint_id or (r.base < marker.checkpoint_id and r.attempt == marker.attempt)
        if delta_of_marker and r.link.generation not in catalog.dropped:
            out.append(r)
    return out


def with_survivors(marker: Marker, survivors: list[SurvivorRecord]) -> Marker:
    """`marker` whose chain ends with the survivors' links: replayed after it, they win."""
    return replace(marker, chain=[*marker.chain, *(r.link for r in survivors)])


@dataclass
class PartialOutcome:
    """What one partial recovery kept, rolled back and lost."""

    checkpoint_id: int
    checkpoint_step: int
    step: int  # the furthest survivor's last step: training goes on from here
    world_size: int  # of the attempt that failed
    kept: list[int]  # its ranks whose shards keep their state
    rolled_back: list[int]  # its ranks whose shards roll back to the checkpoint
    rolled_back_fraction: float  # of the model-parallel embedding parameters
    rolled_back_tables: dict[str, float] = field(default_factory=dict)  # table -> fraction of it
    samples_since: int = 0  # samples trained between the checkpoint and `step`
    lost_samples: float = 0.0  # their updates to the rolled-back shards, lost (ckpt/recovery/lost_samples.py) ...
    waiting_lost: float = 0.0  # ... and, of those, the samples' worth of updates prioritized
    # checkpoints had left waiting on the rolled-back ranks (ckpt/recovery/priority.py)

    def describe(self) -> str:
        """Which shards rolled back, for the resume line."""
        tables = ", ".join(f"{t} {f:.0%}" for t, f in sorted(self.rolled_back_tables.items()) if f > 0)
        return (
            f"ranks {self.kept} of {self.world_size} kept step {self.step}, rank(s) {self.rolled_back} rolled back "
            f"to step {self.checkpoint_step} ({self.rolled_back_fraction:.1%} of the embedding parameters"
            + (f": {tables}" if tables else "")
            + ")"
        )


def rolled_back_tables(marker: Marker, survivors: list[SurvivorRecord]) -> dict[str, float]:
    """Per model-parallel table of the checkpoint, the fraction of its parameters no
    survivor holds (table -> fraction)."""
    kept: dict[str, int] = {}
    for r in survivors:
        for table, _row0, rows, _col0, cols in r.shards:
            kept[table] = kept.get(table, 0) + int(rows) * int(cols)
    out = {}
    for table, (rows, dim) in marker.tables.items():
        if marker.plan.get(table) != "data_parallel":
            out[table] = max(0.0, 1.0 - kept.get(table, 0) / max(rows * dim, 1))
    return out


def compose(
    marker: Marker,
    survivors: list[SurvivorRecord],
    checkpoint_state: dict[str, Any],
    survivor_states: dict[int, dict[str, Any]],
    *,
    world_now: int,
) -> tuple[dict[str, Any], list[int], PartialOutcome]:
    """The dense state a partial restore loads (the furthest survivor's, with every rank's
    loop state under "trainers"), the batches each rank's reader must skip, and the outcome.
    `survivor_states`: rank -> the dense file of that rank's record; `world_now`: ranks of the
    restoring job. Into another world size only readers with one global position carry over
    (as for any restore): every rank then continues from the furthest survivor's."""
    assert survivors and set(survivor_states) == {r.rank for r in survivors}
    world = survivors[0].world_size
    if any(r.world_size != world for r in survivors):
        raise RestoreError(f"survivor snapshots of one attempt name world sizes {sorted({r.world_size for r in survivors})}")
    lead = max(survivors, key=lambda r: (r.step, -r.rank))
    lead_state = survivor_states[lead.rank]
    lead_loop = lead_state["trainer"]
    trainers = checkpoint_state["trainers"]
    states, skips = [], []
    for rank in range(world):
        if rank in survivor_states:
            base = survivor_states[rank]["trainer"]
        else:  # this rank died: its reader continues from the checkpoint's position
            base = trainers[rank] if len(trainers) == world else shared_reader(trainers, marker, _OTHER_WORLD)
        states.append({**base, "step": lead_loop["step"], "samples_seen": lead_loop["samples_seen"]})
        skips.append(int(lead_loop["step"]) - int(base["step"]))
    if world_now != world:
        shared_reader([survivor_states[r.rank]["trainer"] for r in survivors] + list(trainers), marker, _OTHER_WORLD)
        states, skips = [lead_loop], [0]
    tables = rolled_back_tables(marker, survivors)
    sizes = {t: rows * dim for t, (rows, dim) in marker.tables.items() if t in tables}
    fraction = sum(tables[t] * sizes[t] for t in tables) / max(sum(sizes.values()), 1)
    since = int(lead_loop["samples_seen"]) - int(trainers[0]["samples_seen"])
    rolled_back = sorted(set(range(world)) - set(survivor_states))
    waiting = _waiting_lost(trainers, rolled_back, world, fraction)
    outcome = PartialOutcome(
        checkpoint_id=marker.checkpoint_id,
        checkpoint_step=marker.step,
        step=int(lead_loop["step"]),
        world_size=world,
        kept=sorted(survivor_states),
        rolled_back=rolled_back,
        rolled_back_fraction=fraction,
        rolled_back_tables=tables,
        samples_since=since,
        lost_samples=lost_samples(max(since, 0), fraction) + waiting,
        waiting_lost=waiting,
    )
    state = {k: v for k, v in lead_state.items() if k != "trainer"}
    state["trainers"] = states
    state["lost_samples"] = float(lead_state.get("lost_samples", 0.0)) + outcome.lost_samples
    return state, skips, outcome


def _waiting_lost(trainers: list[dict[str, Any]], rolled_back: list[int], world: int, fraction: float) -> float:
    """Samples' worth of updates the checkpoint's prioritized chain left out on the rolled-back
    ranks: per rank, the samples since its last full checkpoint times the share of their
    updates that went to rows still waiting, times the rank's share of the parameters (the
    rolled-back fraction split evenly). 0 without prioritized checkpoints."""
    if len(trainers) != world or not rolled_back:
        return 0.0
    lost = 0.0
    for rank in rolled_back:
        p = trainers[rank].get("priority")
        if p and p["updates_since_full"]:
            samples = int(trainers[rank]["samples_seen"]) - int(p["full_samples_seen"])
            lost += lost_samples(max(samples, 0), fraction / len(rolled_back)) * p["unsaved_updates"] / p["updates_since_full"]
    return lost


_OTHER_WORLD = ", and its survivors by another number of ranks"


def shared_reader(trainers: list[dict[str, Any]], marker: Marker, why: str) -> dict[str, Any]:
    """The loop state every rank of another world size resumes from: only when the ranks that
    wrote `trainers` held one reader position (the synthetic stream's global position);
    else a `RestoreError` ending in `why`. A loop state without a `reader` (a user's loop,
    ckpt/checkpointer.py) resumes every rank from rank 0's: its data position is the loop's to derive."""
    if not any("reader" in t for t in trainers):
        return trainers[0]
    readers = [t.get("reader") for t in trainers]
    if any(r != readers[0] for r in readers):
        raise RestoreError(
            f"checkpoint {marker.checkpoint_id} was written by {len(trainers)} ranks whose readers hold different positions{why}"
        )
    return trainers[0]
