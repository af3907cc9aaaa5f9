"""Conformance: deltarec in TorchRec loops written the way users write them
(tests/conformance/worker.py), each on gloo ranks, SIGKILLed from outside at a random point
(its seed printed; `DELTAREC_TEST_SEED=N` replays it), resumed by running the same command
again, and compared bit for bit with the same loop run without deltarec at all (no
Checkpointer constructed): checkpointing must not perturb training, and a resume must
continue it exactly. What is compared is what every rank holds at the end, in torchrec's own
terms: its local shards of every table and fused optimizer state (`dmp.state_dict()`,
`dmp.fused_optimizer.state_dict()`), dense parameters, the dense optimizer's state, the
loop's state (step, LR schedule, RNG) and the RNG itself.

- README.md's snippet ("Use it in your own training loop"), read from README.md at test time
  and run as written, with a loop whose state holds only `step`; killed, resumed, and run a
  third time once finished (a no-op that must still exit cleanly).
- A rich model: EBCs and ECs at several depths (`towers.user.ebc`, `towers.item.seq.ec`), a
  weighted EBC, a feature processor (`FeatureProcessedEmbeddingBagCollection` with a
  `PositionWeightedModuleCollection`, whose position weights the dense optimizer trains),
  row-wise, table-wise, column-wise, table-row-wise and data-parallel tables of widths 4, 8
  and 16, an fp16 table, one table read by two features, row-wise Adagrad fused
  (torchrec leaves the data-parallel table out of the fused optimizer: the dense one trains
  it); dense optimizers under torchrec's `CombinedOptimizer` of two `KeyedOptimizerWrapper`s
  (Adagrad; SGD with momentum: its state is created lazily, and its param groups must come
  back for the LR schedule), a `StepLR` schedule and dropout whose RNG rides in the loop state.
- That run's checkpoints resumed on 1 rank, then on 3: each resumes at the newest
  checkpoint's step with every table row, fused optimizer state, dense parameter and dense
  optimizer state the checkpoint holds, and, its loop state having no `reader`, every rank
  with rank 0's loop state (ckpt/recovery/partial.py `shared_reader`).

Not runnable on CPU (torchrec 1.8.0, fbgemm-gpu-cpu 1.8.0, 2 gloo ranks, row-wise Adagrad fused),
so not in the loops; everything else above runs, and fp16 tables run on every sharding type
an EBC or EC otherwise runs:

- an `EmbeddingCollection` table `data_parallel()`: sharded, then its first forward fails in
  torchrec's `construct_jagged_tensors` (the lookup pools what should stay unpooled):
  "RuntimeError: split_with_sizes expects split_sizes to sum exactly to 2 (input tensor's size
  at dimension 0), but got split_sizes=[4]" (a batch of 2 samples holding 4 ids).
- an `EmbeddingCollection` table `table_row_wise(host_index=0)`: refused by torchrec's
  sharder when DMP is built, on any device: "ValueError: Sharding not supported table_row_wise".
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from launch.ranks import RankGroup, read_jsonl, start_command
from tests.conftest import SEED_ENV, ReplaySeed

pytestmark = pytest.mark.multirank

README_STEPS = 140  # the snippet checkpoints every 50 steps: at 50, 100 and the last
RICH_STEPS = 40  # every 5 steps (ckpt.schedule.interval_steps=5)
RICH_JOB = [
    "ckpt.sink.kind=filesystem",
    "ckpt.encoding.weights=fp32",
    "ckpt.encoding.optimizer=fp32",
    "ckpt.schedule.interval_steps=5",
]
TIMEOUT_S = 180  # each group of ranks; a rank failing fails the group at once


# --- running a loop -------------------------------------------------------------------------------


def start(loop: str, tmp: Path, world: int, steps: int, *args: str) -> RankGroup:
    """`world` ranks of tests/conformance/worker.py's `loop`, with a fresh file rendezvous."""
    argv = [sys.executable, "-m", "tests.conformance.worker", "--loop", loop, "--steps", str(steps)]
    argv += ["--init-method", f"file://{tmp}/rdzv-{time.monotonic_ns()}", "--workdir", str(tmp), *args]
    return start_command(argv, tmp, world_size=world, timeout_s=TIMEOUT_S)


def committed(run_dir: Path) -> int:
    return sum(r.get("event") == "checkpoint_committed" for r in read_jsonl(run_dir / "metrics.jsonl", live=True))


def events(run_dir: Path, event: str) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("event") == event]


def kill_at_random(group: RankGroup, run_dir: Path, seed: ReplaySeed, checkpoints: int, window_s: float) -> None:
    """SIGKILL every rank of `group` from outside once 1..`checkpoints` checkpoints committed
    (drawn), `window_s` seconds later at most (drawn)."""
    rng = seed.rng()
    need, delay = rng.randint(1, checkpoints), rng.uniform(0.0, window_s)
    print(f"kill after {need} committed checkpoint(s) + {delay:.3f} s ({seed})")
    while committed(run_dir) < need and group.running() and time.monotonic() < group.deadline:
        time.sleep(0.02)
    time.sleep(delay)
    if not group.running():
        results = group.wait(expect_ok=False)
        pytest.fail(f"the job ended before it could be killed ({seed}): make it longer; rcs {[r.returncode for r in results]}")
    for p in group.procs:
        p.send_signal(signal.SIGKILL)
    results = group.wait(expect_ok=False)
    assert all(r.returncode == -signal.SIGKILL for r in results), ([r.returncode for r in results], str(seed))


# --- comparing dumps ------------------------------------------------------------------------------


def load(prefix: Path, world: int) -> list[dict]:
    return [torch.load(f"{prefix}_rank{r}.pt", weights_only=False) for r in range(world)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """A floating tensor's bit patterns (so -0.0 != 0.0, and a NaN equals the same NaN); others as they are."""
    if not t.is_floating_point():
        return t
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_equal(a: Any, b: Any, where: str) -> None:
    """Exactly equal, recursively: tensors by dtype, shape and every bit."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b), f"{where}: a tensor and a {type(b if torch.is_tensor(a) else a)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        assert torch.equal(bits(a), bits(b)), f"{where}: differs ({int((a != b).sum())} of {a.numel()} values)"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert sorted(map(str, a)) == sorted(map(str, b)), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_ranks(got: Sequence[dict], want: Sequence[dict], what: str, skip: Sequence[str] = ()) -> None:
    """Rank by rank (one world size, one plan), everything each rank dumped."""
    assert len(got) == len(want)
    for rank, (g, w) in enumerate(zip(got, want)):
        keys = sorted(set(g) | set(w) - set(skip))
        for key in keys:
            if key not in skip:
                assert_equal(g.get(key), w.get(key), f"{what}, rank {rank}: {key}")


def _is_shards(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"global_size", "shards"}


def unsharded(dumps: Sequence[dict], part: str) -> dict[str, torch.Tensor]:
    """`part` ("model" or "fused") of every rank's dump as whole tensors by path: each sharded
    tensor assembled from every rank's shards (each element from exactly one shard), each
    replicated one the same on every rank that holds it."""
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str, rank: int) -> None:
        if _is_shards(value):
            for offsets, shard in value["shards"]:
                if path not in out:
                    out[path] = torch.zeros(value["global_size"], dtype=shard.dtype)
                    covered[path] = torch.zeros(value["global_size"], dtype=torch.int32)
                where = tuple(slice(o, o + n) for o, n in zip(offsets, shard.shape))
                out[path][where] = shard
                covered[path][where] += 1
        elif torch.is_tensor(value):
            if path in out:
                assert torch.equal(out[path], value), f"{path}: a replicated tensor differs on rank {rank}"
            out[path] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}/{k}", rank)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]", rank)

    for rank, d in enumerate(dumps):
        walk(d[part], part, rank)
    for path, c in covered.items():
        assert bool((c == 1).all()), f"{path}: {int((c != 1).sum())} elements not in exactly one shard"
    return out


def assert_same_unsharded(got: Sequence[dict], want: Sequence[dict], what: str) -> None:
    """Across world sizes and plans: every table row and fused optimizer state, assembled from
    the shards; every dense parameter; the dense optimizer's state (rank 0's, every rank the same)."""
    for part in ("model", "fused"):
        g, w = unsharded(got, part), unsharded(want, part)
        if part == "fused":  # the param groups list each rank's own tables: only the state is global
            g = {k: v for k, v in g.items() if k.startswith("fused/state/")}
            w = {k: v for k, v in w.items() if k.startswith("fused/state/")}
        assert sorted(g) == sorted(w), f"{what}: {part} holds {sorted(set(g) ^ set(w))} on one side only"
        assert any(k.endswith("momentum1") for k in g) or part == "model"
        for k in g:
            assert_equal(g[k], w[k], f"{what}: {k}")
    for rank, d in enumerate(got):
        assert_equal(d["dense_opt"], want[0]["dense_opt"], f"{what}, rank {rank}: the dense optimizer's state")


# --- the README snippet ---------------------------------------------------------------------------


def test_readme_snippet_killed_resumed_and_rerun_is_bit_identical_to_no_deltarec(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    """README.md's snippet as written (a loop state of `step` only): SIGKILLed, resumed by the
    same command, and run once more after it finished; every rank ends exactly where the same
    loop without deltarec does."""
    plain_dir, job_dir = tmp_path / "plain", tmp_path / "job"
    plain_dir.mkdir()
    job_dir.mkdir()
    plain = start("readme", plain_dir, 2, README_STEPS, "--plain", "--dump-final", str(plain_dir / "final"))
    plain.wait()
    command = ("--step-sleep", "0.01", "--dump-final", str(job_dir / "final"))
    run_dir = job_dir / "runs" / "my_job"  # the snippet's run_dir, relative to where it runs
    kill_at_random(start("readme", job_dir, 2, README_STEPS, *command), run_dir, replay_seed, 2, 0.5)
    start("readme", job_dir, 2, README_STEPS, *command).wait()
    want = load(plain_dir / "final", 2)
    assert [d["loop"] for d in want] == [{"step": README_STEPS}] * 2
    assert_same_ranks(load(job_dir / "final", 2), want, f"README loop resumed ({replay_seed})")
    assert len(events(run_dir, "restore")) == 1
    start("readme", job_dir, 2, README_STEPS, *command).wait()  # the same command once more: nothing left to train
    assert_same_ranks(load(job_dir / "final", 2), want, f"README loop run again once finished ({replay_seed})")
    (*_, last) = events(run_dir, "restore")
    assert last["step"] == README_STEPS, last


# --- the rich loop, and its checkpoints on other world sizes ------------------------------------


def module_seed(request: pytest.FixtureRequest) -> ReplaySeed:
    """tests/conftest.py's `replay_seed` for a module-scoped fixture: DELTAREC_TEST_SEED or a fresh draw, printed."""
    raw = os.environ.get(SEED_ENV, "").strip()
    value = int(raw) if raw else random.SystemRandom().randrange(1 << 31)
    root, python = request.config.rootpath, Path(sys.executable)
    python = python.relative_to(root) if python.is_relative_to(root) else python
    seed = ReplaySeed(value, f"cd {root} && {SEED_ENV}={value} {python} -m pytest -q {request.node.nodeid}")
    print(f"random {seed}")
    return seed


@pytest.fixture(scope="module")
def rich_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path, ReplaySeed]:
    """The rich loop on 2 ranks without deltarec (its ranks' final dumps), and the directory of
    the same loop with deltarec, SIGKILLed at a random point and resumed by the same command
    (its dumps: `final`, and `restored` right after the restore)."""
    seed = module_seed(request)
    plain, job = tmp_path_factory.mktemp("rich_plain"), tmp_path_factory.mktemp("rich_job")
    start("rich", plain, 2, RICH_STEPS, "--plain", "--dump-final", str(plain / "final")).wait()
    command = ("--run-dir", str(job / "run"), "--step-sleep", "0.02", "--dump-final", str(job / "final"), *RICH_JOB)
    kill_at_random(start("rich", job, 2, RICH_STEPS, *command), job / "run", seed, 4, 0.25)
    start("rich", job, 2, RICH_STEPS, *command, "--dump-restored", str(job / "restored")).wait()
    return load(plain / "final", 2), job, seed


#: where each table of the rich loop lives on 2 ranks, per rank: (row, column offsets, shape) of
#: its shards, or "replicated"; what the plan asked for, as torchrec's state_dict shows it
RICH_LAYOUT_2 = {
    "towers.user.ebc.embedding_bags.id.weight": [[([0, 0], (500, 16))], [([500, 0], (500, 16))]],  # row-wise
    "towers.user.ebc.embedding_bags.geo.weight": [[], [([0, 0], (64, 8))]],  # table-wise on rank 1
    "towers.item.seq.ec.embeddings.item.weight": [[([0, 0], (2000, 8))], [([0, 8], (2000, 8))]],  # column-wise
    "towers.item.seq.ec.embeddings.query.weight": [[([0, 0], (300, 16))], []],  # table-wise on rank 0
    "tags.embedding_bags.tag.weight": [[([0, 0], (250, 8))], [([250, 0], (250, 8))]],  # table-row-wise
    "clicks._embedding_bag_collection.embedding_bags.clicked.weight": [[([0, 0], (350, 8))], [([350, 0], (350, 8))]],
    "ctx.embedding_bags.ctx.weight": ["replicated", "replicated"],  # data-parallel
    "ctx.embedding_bags.cat.weight": [[([0, 0], (40, 8))], []],  # two features, one table
    "ctx.embedding_bags.f16.weight": [[([0, 0], (100, 8))], [([100, 0], (100, 8))]],  # fp16, row-wise
}


def layout(dumps: Sequence[dict]) -> dict[str, list]:
    def of(value: Any) -> Any:
        if torch.is_tensor(value):
            return "replicated"
        return [(offsets, tuple(t.shape)) for offsets, t in value["shards"]]

    return {k: [of(d["model"][k]) for d in dumps] for k in dumps[0]["model"] if ".embedding" in k}


def test_rich_loop_killed_and_resumed_is_bit_identical_to_no_deltarec(rich_runs: tuple[list[dict], Path, ReplaySeed]) -> None:
    want, job, seed = rich_runs
    got = load(job / "final", 2)
    assert [d["loop"]["step"] for d in got] == [RICH_STEPS] * 2
    assert [d["restored_from"] for d in want] == [None, None]
    assert [d["restored_from"] for d in got] == [0, 1], "each rank resumes from its own loop state on the same world size"
    assert_same_ranks(got, want, f"rich loop resumed ({seed})", skip=["restored_from"])
    (restore,) = events(job / "run", "restore")
    restored = load(job / "restored", 2)
    assert [d["restored"] for d in restored] == [(restore["restored_ckpt"], restore["step"])] * 2
    assert [d["loop"]["step"] for d in restored] == [restore["step"]] * 2, str(seed)
    assert layout(want) == RICH_LAYOUT_2
    assert {t.dtype for d in got for _, t in d["model"]["ctx.embedding_bags.f16.weight"]["shards"]} == {torch.float16}


def test_rich_loop_resumes_on_1_then_3_ranks_with_rank_0s_loop_state(
    tmp_path: Path, rich_runs: tuple[list[dict], Path, ReplaySeed]
) -> None:
    """The rich job's run directory (its last checkpoint at step 40, written by 2 ranks) resumed
    on 1 rank up to step 50, then on 3 ranks up to step 60: each restore holds exactly what the
    previous world size ended with (the checkpoint of its last step), and every rank the loop
    state of the previous run's rank 0 (no `reader` in it: ckpt/recovery/partial.py `shared_reader`)."""
    _, job, _ = rich_runs
    shutil.copytree(job / "run", tmp_path / "run")
    before = load(job / "final", 2)
    for world, steps in ((1, RICH_STEPS + 10), (3, RICH_STEPS + 20)):
        out = tmp_path / f"world{world}"
        args = ("--run-dir", str(tmp_path / "run"), "--dump-final", f"{out}_final", "--dump-restored", f"{out}_restored")
        start("rich", tmp_path, world, steps, *args, *RICH_JOB).wait()
        restored = load(Path(f"{out}_restored"), world)
        previous_step = before[0]["loop"]["step"]
        restore = events(tmp_path / "run", "restore")[-1]
        assert restore["step"] == previous_step, (world, restore)
        assert [d["restored"] for d in restored] == [(restore["restored_ckpt"], previous_step)] * world
        assert_same_unsharded(restored, before, f"restored on {world} rank(s)")
        for rank, d in enumerate(restored):
            assert d["restored_from"] == 0, f"{world} ranks: rank {rank} resumed from rank {d['restored_from']}'s loop state"
            mine = {k: v for k, v in d["loop"].items() if k != "rank"}  # `rank` says who dumped it
            assert_equal(
                mine, {k: v for k, v in before[0]["loop"].items() if k != "rank"}, f"{world} ranks: rank {rank}'s loop state"
            )
            assert_equal(d["rng"], before[0]["rng"], f"{world} ranks: rank {rank}'s RNG")
        before = load(Path(f"{out}_final"), world)
        assert [d["loop"]["step"] for d in before] == [steps] * world
