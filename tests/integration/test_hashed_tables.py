"""deltarec-train with a hashed table (`managed_collision`): the debug job with t_item hashed
(raw ids over 2**40, fewer rows than the ids its feature draws, evictions every 3 steps) on 2
ranks, SIGKILLed and resumed from its newest checkpoint on the filesystem sink, ends
bit-identical (fp32 rows, optimizer state, dense state) to the same job never interrupted.

A resume between two evictions needs the managed-collision state (slots, counters, eviction
phase, history) and the loop's torch RNG state (evicted rows are drawn again from it): the
checkpointer (ckpt.Checkpointer) carries both."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import yaml

from launch.ranks import spawn_ranks

if TYPE_CHECKING:
    from tests.conftest import DebugConfig

STEPS = 40
EVICTION_INTERVAL = 3  # checkpoints every 10 steps: resumes land between two evictions
pytestmark = pytest.mark.integration


def hashed_config(debug_config: DebugConfig, where: Path, sparse: str = "adagrad") -> Path:
    """The debug job with t_item hashed (row-wise, 200 rows) and a sparse optimizer that
    evicts on CPU (plain Adagrad by default: row-wise Adagrad's momentum reset is CUDA-only)."""
    data = debug_config.raw()
    (item,) = [t for t in data["model"]["tables"] if t["name"] == "t_item"]
    item.update(
        num_embeddings=200,
        sharding="row_wise",
        managed_collision={
            "input_hash_size": 2**40,
            "eviction_interval": EVICTION_INTERVAL,
            "eviction_policy": "distance_lfu",
        },
    )
    data["optimizer"]["sparse"] = {"name": sparse, "lr": 0.05}
    path = where / "hashed.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _dumps(run_dir: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(run_dir / "params" / f"rank{r}.pt") for r in range(2)]


def _common() -> list[str]:
    return [f"train.steps={STEPS}", "train.save_params=true", "train.eval_batches=1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, debug_config: DebugConfig) -> list[dict[str, torch.Tensor]]:
    """The hashed job never interrupted, without checkpoints."""
    tmp = tmp_path_factory.mktemp("hashed_reference")
    spawn_ranks(hashed_config(debug_config, tmp), _common(), tmp)
    return _dumps(tmp / "run")


# killed while rank 1 writes checkpoint 3's rows (checkpoint 2 is committed: step 20, between two
# evictions), and after step 35 on rank 0 (checkpoint 1, 2 or 3 is, as far as the writer got)
@pytest.mark.parametrize(
    "kill_at,resumed", [("rows:3@1", ("2 at step 20",)), ("step:35@0", ("1 at step 10", "2 at step 20", "3 at step 30"))]
)
def test_hashed_table_resumes_bit_exact(
    tmp_path, unique_name, reference, debug_config: DebugConfig, kill_at: str, resumed: tuple[str, ...]
):
    config = hashed_config(debug_config, tmp_path)
    job = [
        *_common(),
        "ckpt.enabled=true",
        "ckpt.sink.kind=filesystem",
        f"ckpt.run_id={unique_name('hashed')}",
        "ckpt.schedule.policy=incremental",
        "ckpt.schedule.interval_steps=10",
    ]
    rank = int(kill_at.rsplit("@", 1)[1])
    crashed = spawn_ranks(config, job, tmp_path, expect_ok=False, env_extra={"DELTAREC_KILL_AT": kill_at})
    assert crashed[rank].returncode == -9, f"rank {rank} did not die by SIGKILL ({crashed[rank].returncode})"
    rank0 = spawn_ranks(config, [*job, "ckpt.restore.resume=latest"], tmp_path)[0]
    assert any(f"deltarec: resumed from checkpoint {r} " in rank0.stdout for r in resumed), rank0.stdout[-2000:]
    got = _dumps(tmp_path / "run")
    for r, (g, w) in enumerate(zip(got, reference)):
        assert g.keys() == w.keys()
        assert any("t_item" in k for k in w), "the hashed table's rows are in the dump"
        for key in w:
            assert torch.equal(g[key], w[key]), f"{kill_at}: rank {r} {key} differs from the uninterrupted run"


def test_hashed_feature_evicts(debug_config: DebugConfig, tmp_path):
    """The synthetic stream gives the hashed feature raw ids over the hash range, more distinct
    ids than the table's rows within the run (so ids are evicted), and the ordinary features
    the ids they get without a hashed table."""
    from sharding.process_group import DistEnv  # noqa: PLC0415
    from trainer.config import load_config  # noqa: PLC0415
    from trainer.data.factory import make_reader  # noqa: PLC0415

    hashed = load_config(hashed_config(debug_config, tmp_path))
    plain = debug_config.load()
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, launcher="single")
    a, b = make_reader(hashed, env, "train"), make_reader(plain, env, "train")
    assert a is not None and b is not None
    seen: set[int] = set()
    for _ in range(STEPS):
        ka, kb = a.next_batch().sparse_features.to_dict(), b.next_batch().sparse_features.to_dict()
        assert torch.equal(ka["f_user"].values(), kb["f_user"].values())
        assert torch.equal(ka["f_ctx"].values(), kb["f_ctx"].values())
        seen.update(ka["f_item"].values().tolist())
    assert len(seen) > 2 * 200, "fewer distinct raw ids than twice the rows: nothing to evict"
    assert max(seen) >= 2**39, "raw ids are not spread over the hash range"
