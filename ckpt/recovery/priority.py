"""Prioritized checkpoints (CPR's MFU and SSU): which changed rows a checkpoint under a byte
budget saves.

Under `ckpt.recovery.priority: mfu | ssu` (with `ckpt.recovery.mode: partial`) a checkpoint that is not full
saves, of the rows changed since they were last saved, at most `ckpt.recovery.priority_budget` of the
bytes of a full snapshot of the rank; the rest stay changed and wait (a later checkpoint, at
the latest the full one every `ckpt.recovery.priority_full_every` checkpoints, saves them). Which rows:

- MFU (most frequently updated): the rows with the most updates since they were last saved,
  from one int32 counter per row (4 bytes per row of the rank's shards);
- SSU (sub-sampled updates): the rows that a uniform sub-sample of the looked-up ids
  (`ckpt.recovery.ssu_sample` of them) touched, from one more bool per row, in random order when they
  exceed the budget. CPR's proxy for MFU without ranking; the counters are kept under SSU too,
  for the accounting below.

A restore from such a chain holds, for a row left waiting, its value as last saved: the
updates since are lost for a shard that rolls back. The counters say how many: the updates
of rows left waiting over all updates since the last full checkpoint, recorded per rank with
each checkpoint's loop state (`accounting`) and counted into the portion of lost samples by a
partial restore (ckpt/recovery/partial.py, docs/design/partial-recovery.md).
"""

from __future__ import annotations

import torch

from ckpt.capture.tracker import LookupGroup, RowTracker, rows_of

MODES = ("mfu", "ssu")


class RowPriority:
    """Update counters (and the SSU sample) of one rank's shards, fed by its tracker's hook."""

    def __init__(self, tracker: RowTracker, row_bytes: list[int], mode: str, *, sample: float = 0.1, seed: int = 0) -> None:
        assert mode in MODES, mode
        self.mode = mode
        self.sample = sample
        self.starts = tracker.starts
        self.sizes = [s.num_rows for s in tracker.shard_map.shards]
        total = sum(self.sizes)
        self.counts = torch.zeros(total, dtype=torch.int32, device=tracker.device)
        self.sampled = torch.zeros(total, dtype=torch.bool, device=tracker.device) if mode == "ssu" else None
        self.row_bytes = (
            torch.cat([torch.full((n,), b, dtype=torch.int64) for n, b in zip(self.sizes, row_bytes)])
            if total
            else torch.zeros(0, dtype=torch.int64)
        )
        self.updates_since_full = 0  # ids looked up into this rank's shards since the last full checkpoint
        self._rng = torch.Generator(device="cpu").manual_seed(seed)
        tracker.listener = self.record

    def _view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        return flat[self.starts[i] : self.starts[i] + self.sizes[i]]

    def record(self, group: LookupGroup, ids_per_key: list[torch.Tensor]) -> None:
        """The tracker's listener: count one lookup's updates (and sub-sample them for SSU)."""
        for shard, ids in zip(group.shards, ids_per_key):
            if shard is None or ids.numel() == 0:
                continue
            self._view(self.counts, shard).index_add_(0, ids, torch.ones(ids.shape, dtype=torch.int32, device=ids.device))
            self.updates_since_full += ids.numel()
            if self.sampled is not None:
                keep = torch.rand(ids.shape, generator=self._rng) < self.sample
                self._view(self.sampled, shard).index_fill_(0, ids[keep.to(ids.device)], True)

    def select(self, changed: torch.Tensor, budget_bytes: int) -> list[torch.Tensor]:
        """Of the `changed` rows (flat bool bitmap), the ones to save within `budget_bytes`:
        sorted local rows per shard."""
        candidates = rows_of(changed)
        if self.sampled is not None:
            candidates = candidates[self.sampled[candidates]]
            order = torch.randperm(candidates.numel(), generator=self._rng)
        else:  # the most updated first; ties by position, so the choice repeats exactly
            order = torch.sort(self.counts[candidates].cpu(), descending=True, stable=True).indices
        ranked = candidates[order.to(candidates.device)]
        fits = torch.cumsum(self.row_bytes[ranked.cpu()], 0) <= budget_bytes
        chosen = torch.sort(ranked[fits.to(ranked.device)]).values
        return [chosen[(chosen >= a) & (chosen < a + n)] - a for a, n in zip(self.starts, self.sizes)]

    def saved(self, local_rows: list[torch.Tensor]) -> None:
        """These rows were saved: their counts (and sample marks) start again."""
        for i, rows in enumerate(local_rows):
            self._view(self.counts, i).index_fill_(0, rows, 0)
            if self.sampled is not None:
                self._view(self.sampled, i).index_fill_(0, rows, False)

    def full(self) -> None:
        """A full checkpoint saved every row."""
        self.counts.zero_()
        if self.sampled is not None:
            self.sampled.zero_()
        self.updates_since_full = 0

    def accounting(self, waiting: torch.Tensor) -> dict[str, int]:
        """What a restore of the chain so far would lose on this rank: the updates of the rows
        still `waiting` (flat bool bitmap: changed, not saved), of all updates since the full
        checkpoint."""
        return {"unsaved_updates": int(self.counts[waiting].sum()), "updates_since_full": self.updates_since_full}
