"""The server's start-up freeze (trainer/serve/server.py `freeze_startup_objects`): the objects
alive once it has started leave the collector's walks, and garbage made later is still
collected."""

from __future__ import annotations

import gc

from trainer.serve.server import freeze_startup_objects


def test_objects_alive_at_start_are_frozen_and_later_garbage_is_still_collected() -> None:
    try:
        frozen = freeze_startup_objects()
        assert frozen == gc.get_freeze_count() > 10_000  # torch's and torchrec's imports at least
        cycle: list = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # made after the freeze: collected as before
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
