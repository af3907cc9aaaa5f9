"""deltarec-serve's raw-id side of managed-collision tables (trainer/serve/hashed.py): the slot
a raw id reads (`McGlobal.slots_of`) is the one the export's `McTable.lookup` reads, on random
states of 1-3 shards; the served model finds its hashed tables and takes raw ids below their
hash size in a request; a mapping fold copied for the next checkpoint leaves the live one as
it was."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
import yaml

from ckpt.restore.export import MappingFold, mc_tables
from sharding.managed_collision import route, to_global
from tests.unit.test_managed_collision import H, _states
from trainer.config import load_config
from trainer.serve.hashed import ANY_ID, SlotMaps
from trainer.serve.requests import RequestError, parse_request
from trainer.serve.versions import dlrm_servable

if TYPE_CHECKING:
    from tests.conftest import DebugConfig, ReplaySeed

KEY = "mc._embedding_module.embedding_bags.t"  # the table `_states` makes


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_raw_id_reads_the_slot_the_export_reads(replay_seed: ReplaySeed, world: int) -> None:
    rng = np.random.default_rng(replay_seed.value)
    states = _states(rng, 97, world, "distance_lfu")
    glob = to_global(states)
    weight = torch.arange(97, dtype=torch.float32).unsqueeze(1)  # row i holds i: a row read names its slot
    (table,) = mc_tables(1, {KEY: {"weight": weight}}, {KEY: states}).values()
    held = glob.raw_ids[rng.integers(0, glob.raw_ids.size, size=50)]
    misses = np.setdiff1d(rng.integers(0, H, size=200), glob.raw_ids)
    ids = rng.permutation(np.concatenate([held, misses, [0, H - 1]]))
    slots = glob.slots_of(ids)
    assert np.array_equal(slots, table.lookup(torch.from_numpy(ids))[:, 0].long().numpy()), replay_seed
    at = np.searchsorted(glob.raw_ids, held)
    assert np.array_equal(glob.slots_of(held), glob.slots[at]), "a held id reads its own slot"
    ends = np.asarray(glob.segments[1:])
    assert np.array_equal(glob.slots_of(misses), ends[route(misses, H, world)] - 1), "a miss reads its shard's miss slot"
    served = SlotMaps({KEY: glob}).slots(KEY, torch.from_numpy(ids))
    assert served.dtype == torch.int64 and np.array_equal(served.numpy(), slots)


def test_a_copied_fold_goes_on_without_changing_the_live_one(replay_seed: ReplaySeed) -> None:
    fold = MappingFold()
    fold._shards[(KEY, 0)] = (_states(np.random.default_rng(replay_seed.value), 50, 1, "lfu")[0], 3)
    later = fold.copy()
    later._shards[(KEY, 0)] = (later._shards[(KEY, 0)][0], 4)
    later._pieces[(KEY, 0)] = []
    assert fold._shards[(KEY, 0)][1] == 3 and not fold._pieces


def _hashed_job(tmp_path: Path, debug_config: DebugConfig) -> Path:
    data = debug_config.raw()
    (item,) = [t for t in data["model"]["tables"] if t["name"] == "t_item"]
    item.update(sharding="row_wise", managed_collision={"input_hash_size": 2**40, "eviction_interval": 4})
    data["optimizer"]["sparse"]["name"] = "adagrad"
    path = tmp_path / "hashed.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_served_job_takes_raw_ids_of_its_hashed_table(tmp_path: Path, debug_config: DebugConfig) -> None:
    served = dlrm_servable(load_config(_hashed_job(tmp_path, debug_config)).model)
    (table,) = served.hashed
    assert table.key == "model.sparse_arch.managed_collision._embedding_module.embedding_bags.t_item"
    assert table.path == "sparse_arch.managed_collision._managed_collision_collection._managed_collision_modules.t_item"
    assert table.features == ("f_item",) and table.ids_below == 2**40
    assert table.key in served.table_weights(served.fresh_module())
    layout = served.layout()
    sample: dict[str, Any] = {"dense": [0.0] * layout.dense_in_features, "sparse": {"f_item": [2**40 - 1, 0]}}
    batch = parse_request(json.dumps({"samples": [sample]}).encode(), layout, 8)
    assert batch.sparse["f_item"].values().tolist() == [2**40 - 1, 0]
    sample["sparse"]["f_item"] = [2**40]
    body = json.dumps({"samples": [sample]}).encode()
    with pytest.raises(RequestError, match=r"samples\[0\]\.sparse\.f_item: id 1099511627776 out of range 0\.\.1099511627775"):
        parse_request(body, layout, 8)
    # an ordinary model keeps its bounds
    plain = dlrm_servable(load_config(debug_config.path).model)
    assert not plain.hashed and "f_item" in plain.layout().features


def test_a_module_that_hashes_its_input_takes_any_id(tmp_path: Path, debug_config: DebugConfig) -> None:
    served = dlrm_servable(load_config(_hashed_job(tmp_path, debug_config)).model)
    mch = served.module.get_submodule(served.hashed[0].path)
    mch._input_hash_func = lambda values, size: values % size  # type: ignore[assignment]
    assert served.hashed[0].ids_below == ANY_ID
