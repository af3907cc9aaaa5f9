"""The trainer's command line: dry run, one-line errors, torchrun, and Criteo TSV end to end."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from launch.ranks import spawn_ranks

if TYPE_CHECKING:
    from tests.conftest import CliResult, CliRunner, DebugConfig, MetricsReader

pytestmark = pytest.mark.multirank


def test_dry_run_prints_plan_and_bytes_per_rank(run_cli: CliRunner, debug_config: DebugConfig) -> None:
    p = run_cli(
        "trainer.main", "--config", debug_config.path, "--dry-run", "--world-size", "2", "model.tables.0.sharding=row_wise"
    )
    lines = p.stdout.splitlines()
    assert "sharding plan for 2 rank(s) on cpu:" in lines[0]
    assert any(line.split()[:3] == ["t_user", "row_wise", "0,1"] for line in lines)
    assert any(line.split()[:2] == ["t_item", "table_wise"] for line in lines)
    # t_user: 2000 rows x 16 dims, row-wise Adagrad: 1000 * (16 + 1) * 4 bytes per rank from it.
    rank_lines = [line for line in lines if line.strip().startswith("rank ")]
    assert len(rank_lines) == 2
    total = sum(int(line.split(":")[1].split()[0].replace(",", "")) for line in rank_lines)
    assert total == 4 * (2000 * 17 + 1000 * 17 + 64 * 17)


def _error_line(run_cli: CliRunner, *args: str | Path) -> str:
    """The one error line `deltarec-train` prints when it refuses a job (exit status 2)."""
    p: CliResult = run_cli("trainer.main", *args, expect_rc=2)
    errors = p.lines("deltarec-train: error:")
    assert len(errors) == 1, p.stderr
    return errors[0]


def test_misspelled_key_is_one_line_naming_it(run_cli: CliRunner, debug_config: DebugConfig) -> None:
    line = _error_line(run_cli, "--config", debug_config.path, "--dry-run", "train.stepz=5")
    assert "unknown key 'train.stepz'" in line and "debug_cpu.yaml" in line


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("optimizer.sparse.name=adam", "fused CPU embedding kernel supports only"),
        ("model.tables.2.num_embeddings=1", "row_wise needs at least one row per rank"),
    ],
)
def test_impossible_combinations_fail_at_start(
    override: str, fragment: str, run_cli: CliRunner, debug_config: DebugConfig
) -> None:
    args = ["--config", str(debug_config.path), "--dry-run", "--world-size", "2", override]
    if "num_embeddings" in override:
        args.append("model.tables.2.sharding=row_wise")
    assert fragment in _error_line(run_cli, *args)


def test_torchrun_wrapper_trains_every_sharding_type(
    tmp_path: Path, run_cli: CliRunner, debug_config: DebugConfig, metrics: MetricsReader
) -> None:
    """Two torchrun jobs cover the five sharding types (one table each in the first)."""
    jobs = [
        ["model.tables.0.sharding=row_wise", "model.tables.1.sharding=column_wise", "model.tables.2.sharding=table_row_wise"],
        ["model.tables.0.sharding=table_wise", "model.tables.1.sharding=data_parallel", "model.tables.2.sharding=auto"],
    ]
    for i, overrides in enumerate(jobs):
        run_dir = tmp_path / f"job{i}"
        p = run_cli(
            "launch.torchrun",
            "--nproc-per-node",
            "2",
            "--config",
            debug_config.path,
            f"run.dir={run_dir}",
            "train.steps=40",
            *overrides,
            timeout_s=180,
        )
        assert "deltarec: trained 40 steps" in p.stdout
        assert metrics.values(run_dir, "step", "loss") == [20, 40]
        assert (run_dir / "config.yaml").is_file()


N_CAT = 26


def _criteo_line(rng: random.Random, empty_rate: float = 0.2) -> str:
    label = str(rng.randint(0, 1))
    dense = ["" if rng.random() < empty_rate else str(rng.randint(-2, 5000)) for _ in range(13)]
    cats = ["" if rng.random() < empty_rate else f"{rng.getrandbits(32):08x}" for _ in range(N_CAT)]
    return "\t".join([label, *dense, *cats])


def _criteo_job(tmp_path: Path, lines: list[str], on_malformed: str, debug_config: DebugConfig) -> Path:
    """The debug job's model over 26 categorical tables, trained on `lines` as a Criteo TSV."""
    train = tmp_path / "train.tsv"
    train.write_text("\n".join(lines) + "\n")
    evalf = tmp_path / "eval.tsv"
    rng = random.Random(7)
    evalf.write_text("\n".join(_criteo_line(rng) for _ in range(300)) + "\n")
    cfg = debug_config.raw()
    cfg["model"]["tables"] = [
        {"name": f"t_cat_{i}", "num_embeddings": 97, "embedding_dim": 16, "features": [f"cat_{i}"]} for i in range(N_CAT)
    ]
    cfg["data"] = {
        "kind": "criteo",
        "batch_size": 64,
        "criteo": {"train_paths": [str(train)], "eval_paths": [str(evalf)], "on_malformed": on_malformed},
    }
    cfg["train"].update(steps=20, log_every=10, eval_batches=2)
    path = tmp_path / "criteo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_criteo_tsv_with_empty_fields_trains_end_to_end(
    tmp_path: Path, debug_config: DebugConfig, metrics: MetricsReader
) -> None:
    rng = random.Random(1)
    lines = [_criteo_line(rng) for _ in range(1000)]
    assert any("\t\t" in line for line in lines)
    spawn_ranks(_criteo_job(tmp_path, lines, "stop", debug_config), [], tmp_path)
    assert metrics.values(tmp_path / "run", "step", "loss") == [10, 20]
    assert metrics(tmp_path / "run", "eval_auc")


def test_malformed_criteo_line_names_file_and_line(tmp_path: Path, debug_config: DebugConfig) -> None:
    rng = random.Random(2)
    lines = [_criteo_line(rng) for _ in range(1000)]
    lines[9] = "1\tnot-a-number" + "\t" * 38  # line 10 of the file, read by rank 0
    job = _criteo_job(tmp_path, lines, "stop", debug_config)
    results = spawn_ranks(job, [], tmp_path, expect_ok=False, timeout_s=120)
    rank0 = results[0]
    assert rank0.returncode == 2
    errors = [line for line in rank0.stderr.splitlines() if line.startswith("deltarec-train: error:")]
    assert len(errors) == 1 and f"{tmp_path / 'train.tsv'}:10:" in errors[0], rank0.stderr[-2000:]


def test_malformed_criteo_line_can_be_skipped(tmp_path: Path, debug_config: DebugConfig) -> None:
    rng = random.Random(3)
    lines = [_criteo_line(rng) for _ in range(1000)]
    lines[9] = "1\tnot-a-number" + "\t" * 38
    results = spawn_ranks(_criteo_job(tmp_path, lines, "skip", debug_config), [], tmp_path)
    assert "train.tsv:10" in results[0].stderr


def _npy_job(tmp_path: Path, debug_config: DebugConfig) -> Path:
    """The debug job's model over 26 tables, trained on two days converted by TorchRec's own
    `BinaryCriteoUtils.tsv_to_npys` (the Criteo 1TB reference's format), 2 loader workers."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    rng = random.Random(4)
    days = []
    for d, rows in enumerate((700, 500)):
        tsv = tmp_path / f"day_{d}.tsv"
        tsv.write_text("\n".join(_criteo_line(rng) for _ in range(rows)) + "\n")
        prefix = str(tmp_path / f"day_{d}")
        BinaryCriteoUtils.tsv_to_npys(str(tsv), f"{prefix}_dense.npy", f"{prefix}_sparse.npy", f"{prefix}_labels.npy")
        days.append(prefix)
    cfg = debug_config.raw()
    cfg["model"]["tables"] = [
        {"name": f"t_cat_{i}", "num_embeddings": 97, "embedding_dim": 16, "features": [f"cat_{i}"]} for i in range(N_CAT)
    ]
    cfg["data"] = {
        "kind": "criteo_npy",
        "batch_size": 64,
        "workers": 2,
        "criteo_npy": {"train_days": days, "eval_days": days[1:]},
    }
    cfg["train"].update(steps=16, log_every=8, eval_batches=2, save_params=True)
    path = tmp_path / "criteo_npy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_criteo_npy_days_train_and_resume_bit_exact(tmp_path: Path, debug_config: DebugConfig, metrics: MetricsReader) -> None:
    """TorchRec-format days, read by 2 workers per rank through the pipeline: a job stopped at
    step 8 (its final checkpoint) and resumed to 16 ends bit-identical to one never stopped."""
    import torch

    job = _npy_job(tmp_path, debug_config)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    whole.mkdir()
    parts.mkdir()
    spawn_ranks(job, ["ckpt.enabled=false"], whole)
    assert metrics.values(whole / "run", "step", "loss") == [8, 16]
    assert metrics(whole / "run", "eval_auc")
    ckpt = ["ckpt.enabled=true", "ckpt.sink.kind=filesystem", "ckpt.schedule.interval_steps=5", "ckpt.run_id=npy"]
    spawn_ranks(job, [*ckpt, "train.steps=8"], parts)
    results = spawn_ranks(job, [*ckpt, "ckpt.restore.resume=latest"], parts)
    assert "resumed from checkpoint" in results[0].stdout + results[0].stderr
    for rank in range(2):
        want = torch.load(whole / "run" / "params" / f"rank{rank}.pt")
        got = torch.load(parts / "run" / "params" / f"rank{rank}.pt")
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), f"rank {rank} {key} differs from the run never stopped"
