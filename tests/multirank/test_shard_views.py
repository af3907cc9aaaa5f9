"""The shard views of weights and optimizer state alias the live sharded model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from launch.ranks import spawn_ranks

if TYPE_CHECKING:
    from tests.conftest import DebugConfig

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise", "table_row_wise"])
def test_views_tile_tables_and_alias_the_model(tmp_path: Path, sharding: str, debug_config: DebugConfig) -> None:
    results = spawn_ranks(
        debug_config.path,
        [f"sharding.default={sharding}", "model.tables.2.sharding=data_parallel"],
        tmp_path,
        module="tests.multirank.alias_worker",
    )
    counts = [int(r.stdout.split(":")[1].split()[0]) for r in results]
    assert sum(counts) >= 2, counts  # every model-parallel table has at least one shard somewhere
