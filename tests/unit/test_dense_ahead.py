"""The dense file loaded while a restarted job builds its model (ckpt/dense/ahead.py): taken once
by a restore of the same file, and otherwise left to the restore's own read."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt.dense.ahead import DenseAhead
from ckpt.dense.store import DenseRef, DenseStore, DenseStoreError


def _state(step: int) -> dict[str, object]:
    return {"params": {"w": torch.arange(12, dtype=torch.float32) * step}, "step": step, "trainers": [{"step": step}]}


@pytest.fixture
def store(tmp_path: Path) -> DenseStore:
    return DenseStore(tmp_path / "dense")


def test_the_file_loaded_ahead_is_taken_once_by_a_restore_of_that_file(store: DenseStore) -> None:
    ref = store.write(3, _state(3))
    ahead = DenseAhead(store)
    ahead.start(ref)
    got = ahead.take(ref)
    assert got is not None and got["step"] == 3
    assert torch.equal(got["params"]["w"], store.read(ref)["params"]["w"])  # what the restore's own read gives
    assert ahead.take(ref) is None  # handed over once: a fallback reads its own
    ahead.start(ref)  # too late: the restore took its turn
    assert ahead.take(ref) is None


def test_another_checkpoint_chosen_or_none_started_leaves_the_read_to_the_restore(store: DenseStore) -> None:
    old, new = store.write(3, _state(3)), store.write(4, _state(4))
    assert DenseAhead(store).take(new) is None  # nothing was started (the log read ahead failed)
    ahead = DenseAhead(store)
    ahead.start(old)  # guessed before checkpoint 4 committed
    assert ahead.take(new) is None
    assert ahead.take(old) is None
    same_path_other_digest = replace(old, sha256="0" * 64)
    ahead = DenseAhead(store)
    ahead.start(old)
    assert ahead.take(same_path_other_digest) is None  # the same file name is not enough


def test_a_load_ahead_that_failed_leaves_the_restore_to_meet_the_damage_itself(store: DenseStore) -> None:
    ref = store.write(5, _state(5))
    path = Path(ref.path)
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))
    ahead = DenseAhead(store)
    ahead.start(ref)
    assert ahead.take(ref) is None
    with pytest.raises(DenseStoreError, match=rf"dense file {path}: sha256 .* does not match its marker"):
        store.read(ref)
    missing = DenseRef(str(path.with_name("dense-00000009.pt")), ref.sha256, ref.bytes)
    ahead = DenseAhead(store)
    ahead.start(missing)
    assert ahead.take(missing) is None


def test_a_restore_that_asks_while_the_load_is_still_running_waits_for_it(tmp_path: Path) -> None:
    """A model built faster than its dense file loads: `take` waits for that load, bounded."""
    release = threading.Event()

    class SlowStore(DenseStore):
        def read(self, ref: DenseRef) -> dict[str, Any]:
            release.wait(10)
            return super().read(ref)

    store = SlowStore(tmp_path / "dense")
    ref = store.write(6, _state(6))
    ahead = DenseAhead(store)
    ahead.start(ref)
    threading.Timer(0.2, release.set).start()
    taken: list[dict[str, Any] | None] = []
    asker = threading.Thread(target=lambda: taken.append(ahead.take(ref)))
    asker.start()
    asker.join(5)
    assert not asker.is_alive(), "take() never returned: the load's result went elsewhere"
    assert taken[0] is not None and taken[0]["step"] == 6
