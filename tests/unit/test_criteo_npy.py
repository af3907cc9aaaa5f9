"""trainer/data/criteo_npy.py on day files made by TorchRec's own conversion utility
(`BinaryCriteoUtils.tsv_to_npys`): the order of samples across days and epochs, exact
positions in any world size, several loader workers, and `file:row` errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import BinaryCriteoUtils

from tests.unit.test_criteo_reader import MARKER_TABLE, NAMES, SIZES, assert_batches_equal, marked, markers, write
from trainer.data.criteo_npy import CriteoNpyReader
from trainer.data.loader import positioned_batches
from trainer.data.reader import DataError

DAY_ROWS = (10, 7)


def make_day(tmp: Path, name: str, first_marker: int, rows: int) -> str:
    """A day of `rows` Criteo lines (C1 = marker), converted by TorchRec; its prefix."""
    tsv = write(tmp / f"{name}.tsv", [marked(first_marker + i, label=i % 2) for i in range(rows)])
    prefix = str(tmp / name)
    BinaryCriteoUtils.tsv_to_npys(tsv, f"{prefix}_dense.npy", f"{prefix}_sparse.npy", f"{prefix}_labels.npy")
    return prefix


@pytest.fixture
def days(tmp_path: Path) -> list[str]:
    return [make_day(tmp_path, "day_0", 0, DAY_ROWS[0]), make_day(tmp_path, "day_1", 100, DAY_ROWS[1])]


def npy_reader(days: list[str], rank: int = 0, world_size: int = 1, batch_size: int = 4) -> CriteoNpyReader:
    return CriteoNpyReader(
        paths=days, feature_names=NAMES, num_embeddings=SIZES, batch_size=batch_size, rank=rank, world_size=world_size
    )


def sample_markers() -> list[int]:
    """The markers of the days' samples in order: 0..9 then 100..106."""
    return list(range(DAY_ROWS[0])) + [100 + i for i in range(DAY_ROWS[1])]


def test_ranks_read_global_batches_across_days_and_epochs(days: list[str]) -> None:
    """Global batch g is samples 4g..4g+3 of the 17, wrapping into the next epoch; rank r of 2
    reads batches r, r+2, ..."""
    seq = sample_markers() * 3
    for rank in (0, 1):
        r = npy_reader(days, rank, 2)
        for k in range(6):
            g = 2 * k + rank
            assert markers(r.next_batch()) == seq[4 * g : 4 * g + 4], f"rank {rank} batch {k}"


def test_values_are_torchrecs_arrays(days: list[str]) -> None:
    """Dense features and labels as TorchRec wrote them; ids modulo the table size."""
    b = npy_reader(days, batch_size=12).next_batch()  # 10 rows of day 0, 2 of day 1
    dense = np.concatenate([np.load(f"{days[0]}_dense.npy"), np.load(f"{days[1]}_dense.npy")[:2]])
    labels = np.concatenate([np.load(f"{days[0]}_labels.npy"), np.load(f"{days[1]}_labels.npy")[:2]])[:, 0]
    assert torch.equal(b.dense_features, torch.from_numpy(dense))
    assert b.labels.tolist() == labels.astype(np.float32).tolist()
    c26 = b.sparse_features["C26"].values()
    assert c26.tolist() == [int("f", 16) % SIZES[25]] * 12
    assert MARKER_TABLE == SIZES[0]


def test_a_position_restores_into_another_world_size(days: list[str]) -> None:
    """The state after 3 steps of 2 ranks, loaded into 1 rank, yields global batch 6 next."""
    r0 = npy_reader(days, 0, 2)
    for _ in range(3):
        r0.next_batch()
    one = npy_reader(days, 0, 1)
    one.load_state_dict(r0.state_dict())
    assert_batches_equal(one.next_batch(), npy_reader(days).batch_at(6))
    with pytest.raises(DataError, match="next_global_batch"):
        one.load_state_dict({"next_global_batch": -1})


def test_several_workers_read_it_in_order(days: list[str]) -> None:
    r = npy_reader(days, 1, 2)
    batches = positioned_batches(r, 2, prefetch=2, device=torch.device("cpu"))
    try:
        got = [next(batches) for _ in range(5)]
    finally:
        batches.close()
    for k, b in enumerate(got):
        assert_batches_equal(b, r.batch_at(2 * k + 1))


def test_a_label_out_of_range_names_file_and_row(days: list[str]) -> None:
    labels = np.load(f"{days[1]}_labels.npy")
    labels[3, 0] = -1  # the Kaggle test set's filler
    np.save(f"{days[1]}_labels.npy", labels)
    r = npy_reader(days, batch_size=4)
    r.next_batch()
    r.next_batch()  # samples 0-7 of day 0
    r.next_batch()  # day 0 rows 8-9, day 1 rows 0-1
    with pytest.raises(DataError) as caught:
        r.next_batch()  # day 1 rows 2-5
    assert str(caught.value).startswith(f"{days[1]}_labels.npy:3: a label must be 0 or 1")


def test_a_non_finite_dense_value_names_file_and_row(days: list[str]) -> None:
    dense = np.load(f"{days[0]}_dense.npy")
    dense[5, 2] = np.nan
    np.save(f"{days[0]}_dense.npy", dense)
    with pytest.raises(DataError, match=rf"{days[0]}_dense.npy:5: dense features must be finite"):
        npy_reader(days, batch_size=8).next_batch()


@pytest.mark.parametrize(
    "damage, fragment",
    [
        (lambda p: Path(f"{p}_sparse.npy").unlink(), "_sparse.npy not found"),
        (lambda p: np.save(f"{p}_sparse.npy", np.zeros((10, 25), dtype=np.int64)), "has shape (10, 25), expected [rows, 26]"),
        (lambda p: np.save(f"{p}_labels.npy", np.zeros((9, 1), dtype=np.int32)), "has 9 rows"),
        (lambda p: Path(f"{p}_dense.npy").write_bytes(b"not numpy"), "is not a readable .npy file"),
    ],
)
def test_damaged_days_are_refused_naming_the_file(days: list[str], damage, fragment: str) -> None:
    damage(days[0])
    with pytest.raises(DataError) as caught:
        npy_reader(days)
    assert fragment in str(caught.value) and "day_0" in str(caught.value)
