"""The examples a user copies (examples/: two_tower over two EmbeddingBagCollections,
sequence_ranking over an EmbeddingCollection and an EmbeddingBagCollection), run as they are on 2 gloo ranks through the public
`ckpt.Checkpointer`: killed from outside with SIGKILL at a random point and resumed, their
final model (exported by FQN with `deltarec-ckpt export`) is bit-identical to an uninterrupted
run's; a checkpoint restores into 1 rank and another plan with every row, optimizer state and
dense parameter as the checkpoint holds them (with 4-bit rows: within the codec's bound); a
checkpoint of the other example's model is refused, naming a table.

The kill point is random: its seed is printed (`DELTAREC_TEST_SEED` replays it).
"""

from __future__ import annotations

import importlib
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

from ckpt.follow.serving import list_snapshots
from ckpt.quant.adaptive import DEFAULT_RATIO
from launch.ranks import RankGroup, start_command

STEPS = 60
#: each example's plan on 2 ranks, and the other plan its checkpoint is restored into on 1 rank
PLANS = {"two_tower": ("table_wise", "row_wise"), "sequence_ranking": ("row_wise", "table_wise")}
MODELS = {"two_tower": "TwoTower", "sequence_ranking": "Ranker"}  # each example's model class
JOB = [
    "ckpt.sink.kind=filesystem",
    "ckpt.schedule.interval_steps=10",
    "ckpt.encoding.weights=fp32",
    "ckpt.encoding.optimizer=fp32",
]


def _start(example: str, run_dir: Path, tmp: Path, world: int = 2, extra: tuple[str, ...] = ()) -> RankGroup:
    rdzv = tmp / f"rdzv-{time.monotonic_ns()}"
    argv = [sys.executable, f"examples/{example}.py", "--run-dir", str(run_dir), "--steps", str(STEPS)]
    argv += ["--init-method", f"file://{rdzv}", "--plan", PLANS[example][0], *JOB, *extra]
    return start_command(argv, tmp, world_size=world, timeout_s=300)


def export_run(run_dir: Path, out: Path, checkpoint: int | None = None) -> dict:
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
    return example, run_dir, export_run(run_dir, tmp / "final.pt")


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
    resumed = export_run(run_dir, tmp_path / "final.pt")
    assert resumed["step"] == STEPS
    _assert_same(reference, resumed, f"{example}, seed {seed}")
    assert (run_dir / "metrics.jsonl").read_text().count('"event": "restore"') == 1


def test_the_follower_serves_a_user_model_under_its_own_fqns(tmp_path: Path, uninterrupted: tuple[str, Path, dict]) -> None:
    """`deltarec-follow --config <run_dir>/ckpt.yaml` on a user's run: its serving snapshot of the
    newest checkpoint is the export, bit for bit, and loads (strict) into the unsharded model.
    Before the tests below that restore checkpoint 3 of the same run: each of them is an attempt
    resumed from 3, which leaves the later checkpoints on an abandoned branch no follower serves."""
    example, ref_dir, final = uninterrupted
    serving = tmp_path / "serving"
    argv = [
        sys.executable, "-m", "trainer.follow_cli", "--config", str(ref_dir / "ckpt.yaml"), "--export-every", "1",
        f"follow.export_dir={serving}", f"follow.metrics={tmp_path / 'follower.jsonl'}",
    ]  # fmt: skip
    log = tmp_path / "follower.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[2], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not any(cid == final["checkpoint_id"] for cid, _ in list_snapshots(serving)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    (path,) = [p for cid, p in list_snapshots(serving) if cid == final["checkpoint_id"]]
    snap = torch.load(path, weights_only=False)
    assert sorted(snap["model"]) == sorted(final["model"])
    for key, value in final["model"].items():
        assert torch.equal(snap["model"][key], value), f"{example}: serving {key} != the export"
    model = getattr(importlib.import_module(f"examples.{example}"), MODELS[example])().to_empty(device="cpu")
    model.load_state_dict(snap["model"], strict=True)
    state = model.state_dict()
    assert all(torch.equal(state[key], value) for key, value in snap["model"].items())
    assert snap["fqn_root"] == MODELS[example]


def _restore_on_one_rank(example: str, run_dir: Path, tmp: Path, checkpoint: int) -> dict:
    """Checkpoint `checkpoint` of `run_dir` restored on 1 rank with the example's other plan:
    what the model then holds (tests/multirank/example_restore_worker.py)."""
    out = tmp / "restored.pt"
    argv = [
        sys.executable, "-m", "tests.multirank.example_restore_worker", "--example", example,
        "--ckpt-config", str(run_dir / "ckpt.yaml"), "--checkpoint", str(checkpoint), "--plan", PLANS[example][1],
        "--run-dir", str(tmp / "one_rank"), "--init-method", f"file://{tmp}/rdzv-{time.monotonic_ns()}", "--out", str(out),
    ]  # fmt: skip
    start_command(argv, tmp, world_size=1, timeout_s=240).wait()
    return torch.load(out, weights_only=False)


def test_example_restores_into_one_rank_and_another_plan(tmp_path: Path, uninterrupted: tuple[str, Path, dict]) -> None:
    example, ref_dir, _ = uninterrupted
    checkpoint = 3  # a delta of the chain (every 10 steps: step 30)
    want = export_run(ref_dir, tmp_path / "k.pt", checkpoint)
    got = _restore_on_one_rank(example, ref_dir, tmp_path, checkpoint)
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


def test_a_4bit_run_restores_within_the_codecs_bound(tmp_path: Path, uninterrupted: tuple[str, Path, dict]) -> None:
    """The same job with adaptive 4-bit rows trains exactly as the fp32 one (checkpoints do not
    touch training), so its checkpoint 3, restored on 1 rank, is the fp32 run's within the
    codec's per-row bound (tests/unit/test_quant_codecs.py): the clipped ends, half a step,
    fp16 scale and bias; optimizer state (fp32) and dense parameters exactly."""
    example, ref_dir, _ = uninterrupted
    run_dir = tmp_path / "run4"
    _start(example, run_dir, tmp_path, extra=("ckpt.encoding.weights=adaptive4",)).wait()
    want = export_run(ref_dir, tmp_path / "k.pt", 3)
    got = _restore_on_one_rank(example, run_dir, tmp_path, 3)
    quantized = 0
    for key, value in got["tables"].items():
        fqn, _, state = key.partition("/")
        if state:
            assert torch.equal(value, want["optim"][fqn][state]), f"{example} {key}: fp32 optimizer state differs"
            continue
        exact = want["model"][fqn]
        lo, hi = exact.min(1).values, exact.max(1).values
        rng, amax = hi - lo, torch.maximum(hi.abs(), lo.abs())
        bound = (1 - DEFAULT_RATIO[4]) * rng + rng / 15 / 2 + 2**-10 * (rng + amax) + 2**-18
        err = (value - exact).abs().max(1).values
        assert bool((err <= bound).all()), f"{example} {key}: row {int((err - bound).argmax())} outside the 4-bit bound"
        quantized += int((err > 0).sum())
    assert quantized > 0, "no row differs from fp32: were the rows really stored in 4 bits?"
    for name, value in got["dense"].items():
        assert torch.equal(value, want["model"][name]), f"dense {name} differs"


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
    refusal = r"(\[rank0\]: )?ckpt\.types\.RestoreError: checkpoint 3 of run run (has no|holds) table \S+, which the model.*"
    assert re.fullmatch(refusal, last), last
    assert not (tmp_path / "x.pt").exists()
