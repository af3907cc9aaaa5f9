"""The examples a user copies (examples/: two_tower over two EmbeddingBagCollections,
sequence_ranking over an EmbeddingCollection and an EmbeddingBagCollection), run as they are on 2 gloo ranks through the public
`ckpt.Checkpointer`: killed from outside with SIGKILL at a random point and resumed, their
final model (exported by FQN with `deltarec-ckpt export`) is bit-identical to an uninterrupted
run's; a checkpoint restores into 1 rank and another plan with every row, optimizer state and
dense parameter as the checkpoint holds them.

The kill point is random: its seed is printed (`DELTAREC_TEST_SEED` replays it).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from launch.ranks import RankGroup, start_command

STEPS = 60
#: each example's plan on 2 ranks, and the other plan its checkpoint is restored into on 1 rank
PLANS = {"two_tower": ("table_wise", "row_wise"), "sequence_ranking": ("row_wise", "table_wise")}
JOB = ["ckpt.sink=filesystem", "ckpt.interval_steps=10", "ckpt.encoding=fp32", "ckpt.optimizer_encoding=fp32"]


def _start(example: str, run_dir: Path, tmp: Path, world: int = 2) -> RankGroup:
    rdzv = tmp / f"rdzv-{time.monotonic_ns()}"
    argv = [sys.executable, f"examples/{example}.py", "--run-dir", str(run_dir), "--steps", str(STEPS)]
    argv += ["--init-method", f"file://{rdzv}", "--plan", PLANS[example][0], *JOB]
    return start_command(argv, tmp, world_size=world, timeout_s=300)


def _export(run_dir: Path, out: Path, checkpoint: int | None = None) -> dict:
    """`deltarec-ckpt --config <run_dir>/ckpt.yaml export`, as a user runs it; the loaded file."""
    argv = [sys.executable, "-m", "trainer.ckpt_cli", "--config", str(run_dir / "ckpt.yaml"), "export", "--out", str(out)]
    if checkpoint is not None:
        argv += ["--checkpoint", str(checkpoint)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=False)


def _committed(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return metrics.read_text().count('"event": "checkpoint_committed"') if metrics.exists() else 0


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a["step"] == b["step"], (a["step"], b["step"])
    assert sorted(a["model"]) == sorted(b["model"]), f"{what}: other keys"
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"{what}: {k} differs"
    assert sorted(a["optim"]) == sorted(b["optim"]), f"{what}: other optimizer keys"
    for k, states in a["optim"].items():
        for name, value in states.items():
            other = b["optim"][k][name]
            same = torch.equal(value, other) if torch.is_tensor(value) else value == other
            assert same, f"{what}: optimizer state {k}/{name} differs"


@pytest.fixture(scope="module", params=sorted(PLANS))
def uninterrupted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, dict]:
    """(example, its run directory, the export of its last checkpoint) of a run nobody killed."""
    example = request.param
    tmp = tmp_path_factory.mktemp(f"{example}_ref")
    run_dir = tmp / "run"
    _start(example, run_dir, tmp).wait()
    return example, run_dir, _export(run_dir, tmp / "final.pt")


def test_example_killed_from_outside_resumes_bit_identical(tmp_path: Path, uninterrupted: tuple[str, Path, dict]) -> None:
    example, _, reference = uninterrupted
    seed = int(os.environ.get("DELTAREC_TEST_SEED", time.time_ns() % 100_000))
    print(f"kill point seed {seed} (DELTAREC_TEST_SEED={seed} replays it)")
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    group = _start(example, run_dir, tmp_path)
    need = rng.randint(1, 3)  # committed checkpoints to wait for, then a random moment
    deadline = time.monotonic() + 240
    while _committed(run_dir) < need and group.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 0.5))
    if not group.running():
        pytest.fail(f"the job ended before it could be killed (seed {seed}): make it longer")
    for p in group.procs:
        p.send_signal(signal.SIGKILL)
    results = group.wait(expect_ok=False)
    assert all(r.returncode == -signal.SIGKILL for r in results), [r.returncode for r in results]
    _start(example, run_dir, tmp_path).wait()
    resumed = _export(run_dir, tmp_path / "final.pt")
    assert resumed["step"] == STEPS
    _assert_same(reference, resumed, f"{example}, seed {seed}")
    assert (run_dir / "metrics.jsonl").read_text().count('"event": "restore"') == 1


def test_example_restores_into_one_rank_and_another_plan(tmp_path: Path, uninterrupted: tuple[str, Path, dict]) -> None:
    example, ref_dir, _ = uninterrupted
    checkpoint = 3  # a delta of the chain (every 10 steps: step 30)
    want = _export(ref_dir, tmp_path / "k.pt", checkpoint)
    out = tmp_path / "restored.pt"
    argv = [
        sys.executable, "-m", "tests.multirank.example_restore_worker", "--example", example,
        "--ckpt-config", str(ref_dir / "ckpt.yaml"), "--checkpoint", str(checkpoint), "--plan", PLANS[example][1],
        "--run-dir", str(tmp_path / "one_rank"), "--init-method", f"file://{tmp_path}/rdzv", "--out", str(out),
    ]  # fmt: skip
    start_command(argv, tmp_path, world_size=1, timeout_s=240).wait()
    got = torch.load(out, weights_only=False)
    assert got["step"] == want["step"] == 30
    for key, value in got["tables"].items():
        fqn, _, state = key.partition("/")
        expected = want["model"][fqn] if not state else want["optim"][fqn][state]
        assert torch.equal(value, expected), f"{example} {key}: restored on 1 rank ({PLANS[example][1]}) != the export"
    for name, value in got["dense"].items():
        assert torch.equal(value, want["model"][name]), f"dense {name} differs"
    same_name = {  # two modules, one table name: two tables
        "two_tower": {"user_tower.embedding_bags.id.weight", "item_tower.embedding_bags.id.weight"},
        "sequence_ranking": {"history.embeddings.item.weight", "context.embedding_bags.item.weight"},
    }
    assert {k.partition("/")[0] for k in got["tables"]} >= same_name[example]


def test_a_checkpoint_of_another_model_is_refused_naming_a_table(tmp_path: Path, uninterrupted: tuple[str, Path, dict]) -> None:
    """The other example's model restoring this one's checkpoint: one line naming a table, before any row is written."""
    example, ref_dir, _ = uninterrupted
    other = next(e for e in PLANS if e != example)
    argv = [
        sys.executable, "-m", "tests.multirank.example_restore_worker", "--example", other,
        "--ckpt-config", str(ref_dir / "ckpt.yaml"), "--checkpoint", "3", "--plan", PLANS[other][1],
        "--run-dir", str(tmp_path / "other"), "--init-method", f"file://{tmp_path}/rdzv", "--out", str(tmp_path / "x.pt"),
    ]  # fmt: skip
    (result,) = start_command(argv, tmp_path, world_size=1, timeout_s=240).wait(expect_ok=False)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    refusal = r"(\[rank0\]: )?ckpt\.errors\.RestoreError: checkpoint 3 of run run (has no|holds) table \S+, which the model.*"
    assert re.fullmatch(refusal, last), last
    assert not (tmp_path / "x.pt").exists()
