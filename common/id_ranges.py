"""Checkpoint ids in a message as ranges (`834-1199, 1201`), so a line stays short however many
ids it names: a chain of a thousand links, a thousand checkpoints dropped."""

from __future__ import annotations

from collections.abc import Iterable


def id_ranges(ids: Iterable[int]) -> str:
    """`[1, 2, 3, 7, 9, 10]` -> `"1-3, 7, 9-10"` (sorted, duplicates dropped)."""
    runs: list[list[int]] = []
    for i in sorted(set(ids)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
