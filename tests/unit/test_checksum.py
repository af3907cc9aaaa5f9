"""common.checksum.crc32 gives zlib's CRC-32 values, so every frame, record and marker written
with the stdlib's stays readable."""

from __future__ import annotations

import random
import zlib
from typing import TYPE_CHECKING

import numpy as np

from common.checksum import crc32

if TYPE_CHECKING:
    from tests.conftest import ReplaySeed


def test_crc32_equals_zlibs_for_any_bytes_and_any_running_value(replay_seed: ReplaySeed) -> None:
    rng = random.Random(replay_seed.value)
    for _ in range(200):
        n = rng.choice([0, 1, 7, 64, 4095, 65537, rng.randrange(1 << 20)])
        data = rng.randbytes(n)
        start = rng.randrange(1 << 32)
        assert crc32(data) == zlib.crc32(data), replay_seed
        assert crc32(data, start) == zlib.crc32(data, start), replay_seed


def test_crc32_reads_numpy_memory_in_place_and_chains_like_zlib() -> None:
    rows = np.arange(4096, dtype=np.float32).reshape(64, 64)
    parts = [b"head", rows.reshape(-1).view(np.uint8).data, memoryview(b"tail")[1:]]
    ours = theirs = 0
    for p in parts:
        ours, theirs = crc32(p, ours), zlib.crc32(p, theirs)
    assert ours == theirs == zlib.crc32(b"head" + rows.tobytes() + b"ail")
