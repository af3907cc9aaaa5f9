"""trainer/data/loader.py: batches read ahead by DataLoader workers, in the reader's order,
each with the position after it; the loop's position counts trained batches only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.test_criteo_reader import assert_batches_equal, marked, reader, write
from trainer.data.loader import positioned_batches
from trainer.data.reader import DataError
from trainer.data.synthetic import SyntheticClickStream

CPU = torch.device("cpu")


def stream(rank: int = 1, world_size: int = 2) -> SyntheticClickStream:
    return SyntheticClickStream(
        feature_names=["a", "b"], num_embeddings=[100, 50], num_dense=3, batch_size=8, rank=rank, world_size=world_size, seed=7
    )


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_batches_come_in_the_readers_order_with_the_position_after_each(workers: int) -> None:
    """Rank 1 of 2 from global batch 4: the loader yields global batches 5, 7, 9, ... whatever
    the number of workers; `trained` moves one batch per `trained_one`, not per batch read."""
    r = stream()
    r.load_state_dict({"next_global_batch": 4})
    batches = positioned_batches(r, workers, prefetch=2, device=CPU)
    try:
        got = [next(batches) for _ in range(7)]
        assert batches.in_flight == 7
        assert batches.trained == {"next_global_batch": 4}
        for k, b in enumerate(got):
            assert_batches_equal(b, r.batch_at(4 + 2 * k + 1))
        batches.trained_one()
        batches.trained_one()
        assert batches.trained == {"next_global_batch": 8}
        assert batches.in_flight == 5
    finally:
        batches.close()


def test_several_workers_need_a_reader_that_skips(tmp_path: Path) -> None:
    path = write(tmp_path / "day.tsv", [marked(i) for i in range(20)])
    batches = positioned_batches(reader([path]), 2, prefetch=2, device=CPU)
    with pytest.raises(DataError, match="cannot skip batches"):
        next(batches)
    batches.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_malformed_line_in_a_worker_is_one_line_naming_it(tmp_path: Path, workers: int) -> None:
    """The worker's error comes back as the reader's own one-line message (file:line), not the
    DataLoader's wrapped traceback; batches before it arrive first."""
    lines = [marked(i) for i in range(6)] + ["1\tnot-a-number"] + [marked(i) for i in range(6, 12)]
    path = write(tmp_path / "day.tsv", lines)
    batches = positioned_batches(reader([path]), workers, prefetch=2, device=CPU)
    try:
        next(batches)  # lines 1-4
        with pytest.raises(DataError) as caught:
            next(batches)
        message = str(caught.value)
        assert f"{path}:7" in message and "\n" not in message
    finally:
        batches.close()


def test_criteo_positions_resume_exactly(tmp_path: Path) -> None:
    """A Criteo reader behind a worker: the position after the 2nd trained batch, loaded into a
    fresh reader, yields the 3rd batch, though the worker had read further."""
    path = write(tmp_path / "day.tsv", [marked(i) for i in range(40)])
    batches = positioned_batches(reader([path]), 1, prefetch=2, device=CPU)
    try:
        got = [next(batches) for _ in range(4)]
        batches.trained_one()
        batches.trained_one()
        fresh = reader([path])
        fresh.load_state_dict(batches.trained)
        assert_batches_equal(fresh.next_batch(), got[2])
    finally:
        batches.close()
