"""Plan-independent row initialisation (sharding/row_init.py): the same values whichever rows,
columns or chunks a shard covers, stable across library versions, only where a mask says."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from sharding.row_init import CHUNK_ROWS, RowInit, bounds, chunk_values, fill_rows, initialise_shards
from sharding.shard_views import ShardView

INIT = RowInit(seed=42)


def test_values_are_pinned_so_a_library_upgrade_cannot_change_them() -> None:
    """Restore regenerates untrained rows from these values: they must never drift."""
    v = chunk_values(INIT, "t_user", 200_000, 8, 1)
    assert v.shape == (CHUNK_ROWS, 8) and v.dtype == torch.float32
    assert hashlib.sha256(v.numpy().tobytes()).hexdigest() == ("7cdf24c458235d98815c389a392ca332e60eff947505a710c735d780fc2370ee")
    lo, hi = bounds(200_000)
    assert hi == pytest.approx(math.sqrt(1 / 200_000)) and lo == -hi  # torchrec's default range
    assert float(v.min()) >= lo and float(v.max()) < hi
    assert abs(float(v.mean())) < 0.01 * hi


def test_seed_table_and_chunk_each_change_the_values() -> None:
    base = chunk_values(INIT, "a", 100_000, 4, 0)
    for other in (
        chunk_values(RowInit(43), "a", 100_000, 4, 0),
        chunk_values(INIT, "b", 100_000, 4, 0),
        chunk_values(INIT, "a", 100_000, 4, 1)[: base.shape[0]],
    ):
        assert not torch.equal(base, other)


@pytest.mark.parametrize("row_cuts,col_cuts", [([0, 70_000, 140_001], [0, 5]), ([0, 1, 65_536, 65_537, 140_001], [0, 2, 3, 5])])
def test_any_split_of_rows_and_columns_gives_the_values_of_the_whole_table(row_cuts: list[int], col_cuts: list[int]) -> None:
    rows, dim = 140_001, 5
    whole = torch.empty(rows, dim)
    assert fill_rows(INIT, "t", rows, dim, whole, 0, 0) == rows
    for r0, r1 in zip(row_cuts, row_cuts[1:]):
        for c0, c1 in zip(col_cuts, col_cuts[1:]):
            part = torch.empty(r1 - r0, c1 - c0)
            fill_rows(INIT, "t", rows, dim, part, r0, c0)
            assert torch.equal(part, whole[r0:r1, c0:c1]), (r0, r1, c0, c1)


def test_a_mask_limits_the_rows_written_and_the_state_zeroed() -> None:
    rows, dim = 3 * CHUNK_ROWS, 2
    whole = torch.empty(rows, dim)
    fill_rows(INIT, "t", rows, dim, whole, 0, 0)
    view = ShardView("t", CHUNK_ROWS - 2, 0, torch.full((CHUNK_ROWS, dim), 7.0), {"sum": torch.full((CHUNK_ROWS,), 3.0)})
    mask = torch.zeros(CHUNK_ROWS, dtype=torch.bool)
    mask[[0, 5]] = True  # global rows CHUNK_ROWS-2 (chunk 0) and CHUNK_ROWS+3 (chunk 1)
    assert initialise_shards(INIT, [view], {"t": (rows, dim)}, {id(view): mask}) == 2
    assert torch.equal(view.weight[mask], whole[[CHUNK_ROWS - 2, CHUNK_ROWS + 3]])
    assert bool((view.weight[~mask] == 7.0).all())
    assert view.optimizer_states["sum"][mask].tolist() == [0.0, 0.0]
    assert bool((view.optimizer_states["sum"][~mask] == 3.0).all())
    assert initialise_shards(INIT, [view], {"t": (rows, dim)}, {id(view): torch.zeros_like(mask)}) == 0


def test_the_marker_form_round_trips_and_an_unknown_scheme_is_refused() -> None:
    assert RowInit.from_json(INIT.to_json()) == INIT
    assert RowInit.from_json({}) is None
    with pytest.raises(ValueError, match="scheme 'torch-v0' is not known"):
        RowInit.from_json({"scheme": "torch-v0", "seed": 1})
