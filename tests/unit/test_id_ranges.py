"""Checkpoint ids as ranges in one-line messages (common/id_ranges.py)."""

from __future__ import annotations

from common.id_ranges import id_ranges


def test_ids_become_sorted_ranges_and_a_thousand_stay_short() -> None:
    assert id_ranges([]) == ""
    assert id_ranges([7]) == "7"
    assert id_ranges([9, 1, 2, 3, 7, 10, 3]) == "1-3, 7, 9-10"
    assert id_ranges(range(834, 1200)) == "834-1199"
    assert len(id_ranges([*range(1, 1000), 1500])) < 20
