"""What a user sees: deltarec's lines only, the libraries' known noise back with --verbose, and a
killed rank as one line instead of a traceback. Real ranks, real torchrun, a real SIGKILL."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from launch.ranks import spawn_ranks
from trainer.console import TRAINER_NOISE, LogNoise, WarningNoise

if TYPE_CHECKING:
    from tests.conftest import CliRunner, DebugConfig

pytestmark = pytest.mark.multirank


def _shows(entry: WarningNoise | LogNoise, err: str) -> bool:
    """Whether `err` has the library line `entry` names (for a logger silenced below a level:
    any record of that logger, which names it)."""
    if isinstance(entry, LogNoise) and entry.level:
        return f" {entry.logger}" in err
    return re.search(entry.message, err) is not None


# Lines of deltarec's own on rank 0's stderr: its time-stamped progress (no logger name,
# no level), the plan table, its one-line errors.
OWN_LINE = re.compile(
    r"^(\d\d:\d\d:\d\d (?!\[rank)|sharding plan for |table +sharding +ranks$|t_\w+ +\w+ +[\d,]+$"
    r"|bytes per rank |  rank \d+: |deltarec(-train|-launch)?: )"
)


@pytest.fixture(scope="module")
def noisy_job(tmp_path_factory: pytest.TempPathFactory, debug_config: DebugConfig) -> Path:
    """The debug job with one table of each sharding that makes torchrec or fbgemm speak:
    row_wise, table_row_wise, data_parallel, and one the planner places (auto)."""
    cfg = debug_config.raw()
    shardings = ["row_wise", "table_row_wise", "data_parallel"]
    for table, sharding in zip(cfg["model"]["tables"], shardings):
        table["sharding"] = sharding
    cfg["model"]["tables"].append(
        {"name": "t_ad", "num_embeddings": 500, "embedding_dim": 16, "features": ["f_ad"], "sharding": "auto"}
    )
    cfg["train"].update(steps=4, eval_batches=1)
    path = tmp_path_factory.mktemp("noisy") / "noisy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _stderr(config: Path, tmp_path: Path, *extra_args: str) -> list[str]:
    """Every rank's stderr from a run of `config` in `tmp_path` (made here)."""
    tmp_path.mkdir()
    results = spawn_ranks(config, [], tmp_path, extra_args=extra_args)
    return [r.stderr for r in results]


def test_verbose_shows_every_known_noise_the_default_hides(noisy_job: Path, tmp_path: Path) -> None:
    verbose = _stderr(noisy_job, tmp_path / "verbose", "--verbose")
    for entry in TRAINER_NOISE:  # this job makes every listed library line appear
        assert any(_shows(entry, err) for err in verbose), f"--verbose lacks {entry}:\n{verbose[0][-3000:]}"

    quiet = _stderr(noisy_job, tmp_path / "quiet")
    for rank, err in enumerate(quiet):
        for entry in TRAINER_NOISE:
            assert not _shows(entry, err), f"rank {rank} shows {entry}:\n{err}"
        assert "Warning" not in err and "[rank" not in err, err
    others = [line for line in quiet[0].splitlines() if line.strip() and not OWN_LINE.match(line)]
    assert not others, f"rank 0 printed lines that are not deltarec's: {others}"
    assert any(" step 4/4: loss " in line for line in quiet[0].splitlines()), quiet[0]
    assert quiet[1] == "", f"rank 1 has no warning to print, yet printed:\n{quiet[1]}"


def test_a_killed_rank_is_one_line_and_torchrun_resumes_the_job(
    tmp_path: Path, run_cli: CliRunner, debug_config: DebugConfig
) -> None:
    """Rank 1 dies (SIGKILL) once it learns checkpoint 2 committed: rank 0's gloo error is one
    line, the agent's report is deltarec's line, no traceback; the second attempt resumes."""
    p = run_cli(
        "launch.torchrun", "--nproc-per-node", "2", "--max-restarts", "1", "--config", debug_config.path,
        f"run.dir={tmp_path / 'run'}", "ckpt.enabled=true", "ckpt.sink.kind=filesystem", "ckpt.schedule.interval_steps=10",
        "ckpt.restore.resume=latest", "train.steps=40",
        env={"DELTAREC_KILL_AT": "committed:2@1"}, timeout_s=300,
    )  # fmt: skip
    launcher = [line for line in p.stderr.splitlines() if line.startswith("deltarec-launch:")]
    assert launcher == ["deltarec-launch: rank 1 exited (SIGKILL); torchrun restarts the job, attempt 2/2"], p.stderr
    assert "Traceback" not in p.stderr and "exitcode" not in p.stderr, p.stderr
    # rank 0 says it lost its peer, unless the agent stopped it before its next collective
    lost = [line for line in p.stderr.splitlines() if line.startswith("deltarec-train:")]
    assert all(re.fullmatch(r"deltarec-train: rank 0 stopped: another rank of the job is gone \(.+\)", x) for x in lost)
    assert len(lost) <= 1, p.stderr
    others = [line for line in p.stderr.splitlines() if line.strip() and not OWN_LINE.match(line)]
    assert not others, f"lines that are not deltarec's: {others}"
    assert p.stderr.count("sharding plan for 2 rank(s)") == 1, "a restarted job has the same plan: shown once"
    resumed = [line for line in p.stdout.splitlines() if line.startswith("deltarec: resumed from checkpoint")]
    assert len(resumed) == 1 and resumed[0].startswith("deltarec: resumed from checkpoint 2 at step 20"), p.stdout
    assert "deltarec: trained 40 steps" in p.stdout
