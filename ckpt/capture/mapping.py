"""The managed-collision mapping of a checkpoint step: every MC shard's raw-id -> slot state,
copied to host memory in the stall (docs/design/managed-collision.md).

The next training forward of a managed-collision module changes its state (the iteration and
history at every step, the slots at an eviction), so the checkpointer captures it on the
training thread before the next step may run, beside the rows' snapshot; the writer thread
turns the states into mapping records (ckpt/write/writer.py, `MappingDiffer`).

Each capture is taken like the previous one (`sharding.managed_collision.capture`'s `like`):
between evictions the slot arrays are shared with it and only the scalars and the history are
copied from the device, so a checkpoint that falls between evictions costs a few small copies.
"""

from __future__ import annotations

from collections.abc import Sequence

from sharding.managed_collision import ManagedCollisionError, McShard, McState, capture

_ARRAYS = ("raw_ids", "counts", "last_access", "history_ids", "history_last_access")


def states_nbytes(states: Sequence[McState]) -> int:
    """Host bytes the states' arrays hold, each array counted whole even where consecutive
    captures share one (an upper bound on what keeping them costs)."""
    return sum(getattr(s, name).nbytes for s in states for name in _ARRAYS if getattr(s, name) is not None)


class MappingCapture:
    """Captures this rank's managed-collision shards (`mc_shards(model)`, in that order), each
    like its previous capture or the state a restore loaded into it (`adopt`). Used on the
    training thread only."""

    def __init__(self, shards: Sequence[McShard]) -> None:
        self.shards: tuple[McShard, ...] = tuple(shards)
        self._last: tuple[McState, ...] = ()  # the last capture (or adopted states), one per shard

    def __len__(self) -> int:
        return len(self.shards)

    @property
    def empty(self) -> bool:
        """No managed-collision table on this rank: `capture` returns ``()``."""
        return not self.shards

    def capture(self) -> tuple[McState, ...]:
        """One state per shard, in shard order, as of now (between training steps)."""
        last = self._last or (None,) * len(self.shards)
        states = tuple(capture(shard, like=prev) for shard, prev in zip(self.shards, last, strict=True))
        self._last = states
        return states

    def adopt(self, states: Sequence[McState]) -> None:
        """A restore loaded `states` into the shards (one per shard, in shard order): the next
        capture starts from them."""
        got = [(s.table, s.slot_offset) for s in states]
        want = [(sh.key, sh.rows.row_offset) for sh in self.shards]
        if got != want:
            raise ManagedCollisionError(f"restored mapping states {got} are not this rank's managed-collision shards {want}")
        self._last = tuple(states)
