"""Managed-collision tables checkpointed continuously through the public API: a loop of two
managed-collision tables (a pooled and a sequence one over 2^40 raw ids, DistanceLFU eviction
every 2 steps, fused SGD; tests/conformance/worker.py `mc_loop`) on 2 gloo ranks, checkpointed
every 3 steps, SIGKILLed from outside at a random point (its seed printed), resumed by the same
command, and compared bit for bit with the same loop run without deltarec: every table's rows
and fused optimizer state, torchrec's mapping buffers (raw ids, slots, counts, last access,
iteration), the loop state and the RNG. On both sinks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conformance.test_user_loops import assert_same_ranks, kill_at_random, load, module_seed, start, unsharded

pytestmark = pytest.mark.multirank

STEPS = 30


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The loop without deltarec: each rank's final dump."""
    tmp = tmp_path_factory.mktemp("mc_plain")
    start("mc", tmp, 2, STEPS, "--plain", "--dump-final", str(tmp / "final")).wait()
    return load(tmp / "final", 2)


@pytest.mark.parametrize("sink", ["filesystem", "kafka"])
def test_a_managed_collision_loop_killed_and_resumed_is_bit_identical(
    request: pytest.FixtureRequest, tmp_path: Path, plain: list[dict], sink: str
) -> None:
    seed = module_seed(request)
    job = [f"ckpt.sink.kind={sink}"]
    if sink == "kafka":
        broker = request.getfixturevalue("broker")
        job.append(f"ckpt.sink.bootstrap_servers={broker.bootstrap}")
        job.append(f"ckpt.run_id=mc-{tmp_path.name}")
    command = ("--run-dir", str(tmp_path / "run"), "--step-sleep", "0.05", "--dump-final", str(tmp_path / "final"), *job)
    kill_at_random(start("mc", tmp_path, 2, STEPS, *command), tmp_path / "run", seed, 5, 0.3)
    start("mc", tmp_path, 2, STEPS, *command).wait()
    got = load(tmp_path / "final", 2)
    assert [d["loop"]["step"] for d in got] == [STEPS] * 2
    mapping = [k for k in got[0]["model"] if "_mch_sorted_raw_ids" in k]
    assert mapping, "the dumps hold torchrec's mapping buffers"
    assert_same_ranks(got, plain, f"managed-collision loop on {sink}, resumed ({seed})")


# --- onto another world size ---------------------------------------------------------------------

RESHARD_AT = 12  # the 2-rank run's last step (a checkpoint: every 3 steps, and the final one)
HASH = 2**40  # tests/multirank/mc_worker.py's input hash size
FREE = 2**63 - 1  # torchrec's raw id of a free slot


def _local(value: dict | torch.Tensor) -> torch.Tensor:
    """One rank's part of a buffer its dump holds (a sharded one: its local shards, in order)."""
    return torch.cat([t for _, t in value["shards"]]) if isinstance(value, dict) else value


def _held(dump: dict) -> dict[str, dict[int, int]]:
    """Per managed-collision table (by its module's path): the raw ids one rank's dump holds, each
    with its global slot."""
    out: dict[str, dict[int, int]] = {}
    for key, raw in dump["model"].items():
        if not key.endswith("._mch_sorted_raw_ids"):
            continue
        module = key[: -len("._mch_sorted_raw_ids")]
        slots = _local(dump["model"][module + "._mch_remapped_ids_mapping"])
        out[module] = {int(r): int(s) for r, s in zip(_local(raw).tolist(), slots.tolist()) if r != FREE}
    return out


def _rows_by_id(dumps: list[dict]) -> dict[str, dict[int, torch.Tensor]]:
    """Per table (by its MC module's path): each held raw id's row, read from the whole table the
    dumps' shards make up."""
    whole = unsharded(dumps, "model")
    out: dict[str, dict[int, torch.Tensor]] = {}
    for d in dumps:
        for module, held in _held(d).items():
            parent, table = module.split("._managed_collision_collection._managed_collision_modules.")
            weight = next(
                v
                for k, v in whole.items()
                if k.startswith(f"model/{parent}._embedding_module.") and k.endswith(f".{table}.weight")
            )
            out.setdefault(module, {}).update({raw: weight[slot] for raw, slot in held.items()})
    return out


def _route(raw: int, world: int) -> int:
    block = -(-HASH // world)
    return raw // block if raw // block < world else raw % world


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The managed-collision loop with deltarec on 2 ranks to step RESHARD_AT (not killed): its run
    directory and its final dump (the rows and mappings its last checkpoint holds)."""
    tmp = tmp_path_factory.mktemp("mc_two")
    start("mc", tmp, 2, RESHARD_AT, "--run-dir", str(tmp / "run"), "--dump-final", str(tmp / "final")).wait()
    return tmp


@pytest.mark.parametrize("world", [1, 3])
def test_a_managed_collision_chain_of_2_ranks_resumes_on_another_world_size(tmp_path: Path, two_ranks: Path, world: int) -> None:
    before = load(two_ranks / "final", 2)
    assert [d["loop"]["step"] for d in before] == [RESHARD_AT] * 2
    shutil.copytree(two_ranks / "run", tmp_path / "run")  # each world size resumes its own copy
    steps = RESHARD_AT + 6
    group = start(
        "mc", tmp_path, world, steps, "--run-dir", str(tmp_path / "run"),
        "--dump-restored", str(tmp_path / "restored"), "--dump-final", str(tmp_path / "final"),
    )  # fmt: skip
    logs = "".join(r.stderr for r in group.wait())
    restored, final = load(tmp_path / "restored", world), load(tmp_path / "final", world)
    assert [d["restored"][1] for d in restored] == [RESHARD_AT] * world
    assert [d["loop"]["step"] for d in final] == [steps] * world
    old_rows, new_rows = _rows_by_id(before), _rows_by_id(restored)
    assert set(old_rows) == set(new_rows) and len(old_rows) == 2, "both tables"
    for module, rows in old_rows.items():
        held_now = [_held(d)[module] for d in restored]
        for rank, held in enumerate(held_now):
            assert all(_route(raw, world) == rank for raw in held), f"{module} rank {rank}: an id routed elsewhere"
        capacity = [int(_local(d["model"][module + "._mch_sorted_raw_ids"]).numel()) - 1 for d in restored]  # the miss slot aside
        for rank in range(world):
            routed = [raw for raw in rows if _route(raw, world) == rank]
            kept = [raw for raw in routed if raw in held_now[rank]]
            assert set(held_now[rank]) <= set(routed), f"{module} rank {rank}: holds an id the 2 ranks did not"
            assert len(kept) == min(len(routed), capacity[rank]), (
                f"{module} rank {rank}: kept {len(kept)} of {len(routed)} ids with room for {capacity[rank]}"
            )
            if len(kept) < len(routed):
                assert f"{len(routed) - len(kept)} of the ids" in logs, f"{module} rank {rank}: the drop is not logged"
            for raw in kept:
                assert torch.equal(new_rows[module][raw], rows[raw]), f"{module} rank {rank}: id {raw} reads another row"
        # training went on with evictions: the mappings changed after the restore
        after = [_held(d)[module] for d in final]
        assert any(a != b for a, b in zip(after, held_now)), f"{module}: no eviction or admission after the restore"
    # the chain goes on in the new layout (its next checkpoint full): resumed again on this world
    # size, it restores exactly what the resharded run ended with
    again = start(
        "mc", tmp_path, world, steps + 3, "--run-dir", str(tmp_path / "run"),
        "--dump-restored", str(tmp_path / "again"), "--dump-final", str(tmp_path / "final2"),
    )  # fmt: skip
    again.wait()
    back = load(tmp_path / "again", world)
    assert [d["restored"][1] for d in back] == [steps] * world
    for got, want in zip(back, final):
        assert _held(got) == _held(want)
        assert_same_ranks([{"model": got["model"]}], [{"model": want["model"]}], f"{world} ranks, resumed again")
