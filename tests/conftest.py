"""Fixtures every test directory shares: the debug config, a command-line runner, a metrics
reader and the replayable random seed.

They replace the private copies test modules used to keep (a `_cli`/`_train` wrapper around
`subprocess.run([sys.executable, "-m", ...])` each, `REPO / "configs" / "debug_cpu.yaml"` in
every file, json-lines parsing of metrics.jsonl). Fixtures that hold no state are session-scoped
so module-scoped fixtures (one spawn shared by several tests) can use them too. The broker
fixtures stay in tests/integration/conftest.py.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from launch import warm
from launch.ranks import REPO, read_jsonl

if TYPE_CHECKING:
    import torch

    from trainer.config import JobConfig

DEBUG_CONFIG = REPO / "configs" / "debug_cpu.yaml"

# Ranks that launch/ranks.py starts are forked from a process that imported torch once (see
# launch/warm.py) instead of paying seconds of imports each; DELTAREC_WARM_RANKS=0 starts them cold.
os.environ.setdefault(warm.ENV_FLAG, "1")
SEED_ENV = "DELTAREC_TEST_SEED"

# A command run from a test is a user's command at a shell, never one rank of a job: a test run
# under torchrun or inside a slurm allocation must not leak the launcher's identity into it.
LAUNCHER_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
)  # fmt: skip


# --- the debug config ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DebugConfig:
    """configs/debug_cpu.yaml: the small CPU job (three tables, synthetic data) tests train."""

    path: Path

    def load(self, overrides: Sequence[str] = (), check_data: bool = True) -> JobConfig:
        """The validated job config with `key=value` overrides applied, as the trainer builds it."""
        from trainer.config import load_config  # lazy: collecting tests must not need the trainer

        return load_config(self.path, list(overrides), check_data=check_data)

    def raw(self) -> dict[str, Any]:
        """The YAML as a fresh dict, for a test to edit and write as a config of its own."""
        return yaml.safe_load(self.path.read_text())


@pytest.fixture(scope="session")
def debug_config() -> DebugConfig:
    """The debug config: `.path` to hand to a command, `.load(overrides)` for a JobConfig."""
    return DebugConfig(DEBUG_CONFIG)


# --- running module entry points ----------------------------------------------------------------


@dataclass(frozen=True)
class CliResult:
    """What one `python -m <module>` run returned."""

    command: str  # the command line, quoted for a shell, for messages
    rc: int
    stdout: str
    stderr: str

    def lines(self, prefix: str, stream: str = "stderr") -> list[str]:
        """The lines of `stream` ("stdout" or "stderr") that start with `prefix`."""
        text = self.stdout if stream == "stdout" else self.stderr
        return [line for line in text.splitlines() if line.startswith(prefix)]


def _tail(text: str, n: int) -> str:
    return text[-n:]


class CliRunner:
    """Runs `python -m <module> args...` from the repo root, as a user would, within a timeout
    (started warm, as the suite's ranks are: launch/warm.py).

    Generic over the module (trainer.main, launch.torchrun, launch.broker, the checkpoint CLI,
    bench.*), so an entry point moving between packages changes only the name a test passes.
    """

    def __call__(
        self,
        module: str,
        *args: str | Path,
        expect_rc: int | None = 0,
        timeout_s: float = 120,
        env: Mapping[str, str] | None = None,
    ) -> CliResult:
        """Run the module and return rc/stdout/stderr.

        `expect_rc`: the exit status the test expects; any other fails the test showing the
        command and the tail of its stderr (and stdout). None accepts any status (the test
        checks it). A run past `timeout_s` is killed and fails the test the same way. `env`
        adds to (or overrides) this process's environment, minus the launcher variables.
        """
        argv = [sys.executable, "-m", module, *map(str, args)]
        command = shlex.join(["python", "-m", module, *map(str, args)])
        full_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        full_env["PYTHONUNBUFFERED"] = "1"
        full_env.update(env or {})
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = warm.popen(argv, REPO, full_env, out, err)
            try:
                rc: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = None
            out.seek(0)
            err.seek(0)
            result = CliResult(command, -1 if rc is None else rc, out.read(), err.read())
        if rc is None:
            pytest.fail(
                f"{command}\ndid not finish within {timeout_s:.0f}s (killed)\n"
                f"--- stdout tail ---\n{_tail(result.stdout, 1500)}\n--- stderr tail ---\n{_tail(result.stderr, 3000)}",
                pytrace=False,
            )
        if expect_rc is not None and result.rc != expect_rc:
            pytest.fail(
                f"{command}\nexited {result.rc}, expected {expect_rc}\n"
                f"--- stdout tail ---\n{_tail(result.stdout, 1500)}\n--- stderr tail ---\n{_tail(result.stderr, 3000)}",
                pytrace=False,
            )
        return result


@pytest.fixture(scope="session")
def run_cli() -> CliRunner:
    """`run_cli(module, *args, expect_rc=0, timeout_s=120, env=None)` -> CliResult."""
    return CliRunner()


# --- metrics.jsonl ------------------------------------------------------------------------------


class MetricsReader:
    """Reads the records a job wrote to metrics.jsonl (one JSON object per line)."""

    def __call__(self, where: Path, *keys: str, live: bool = False, **equal: Any) -> list[dict]:
        """The records, in file order, that have every key in `keys` and `key == value` for
        every `equal` item, e.g. `metrics(run, "loss")`, `metrics(run, ckpt_committed=True)`.

        `where` is a run dir (its metrics.jsonl) or a .jsonl file. `live=True` reads a file a
        running job is still writing: no file yet is no records, a half-written last line is
        left out.
        """
        path = Path(where)
        if path.suffix != ".jsonl":
            path = path / "metrics.jsonl"
        return [
            r for r in read_jsonl(path, live=live)
            if all(k in r for k in keys) and all(k in r and r[k] == v for k, v in equal.items())
        ]  # fmt: skip

    def values(self, where: Path, key: str, *also: str, live: bool = False, **equal: Any) -> list[Any]:
        """`key`'s value in every record that has it (and the filters of `__call__`), in order:
        `metrics.values(run, "step", "loss")` is the steps at which a loss was logged."""
        return [r[key] for r in self(where, key, *also, live=live, **equal)]


@pytest.fixture(scope="session")
def metrics() -> MetricsReader:
    """`metrics(run_dir, *keys, **equal)` -> records; `metrics.values(run_dir, key, ...)`."""
    return MetricsReader()


# --- replayable randomness ----------------------------------------------------------------------


@dataclass(frozen=True)
class ReplaySeed:
    """The seed of a test's random choices, and the command that replays them.

    `str(seed)` names both; put it in every assertion message that depends on the draw.
    """

    value: int
    replay: str

    def rng(self) -> random.Random:
        """A `random.Random` seeded with this seed (each call starts the same sequence)."""
        return random.Random(self.value)

    def torch_generator(self) -> torch.Generator:
        """A CPU `torch.Generator` seeded with this seed (each call starts the same sequence)."""
        import torch

        return torch.Generator().manual_seed(self.value)

    def __str__(self) -> str:
        return f"seed {self.value} (replay: {self.replay})"


def _replay_command(config: pytest.Config, nodeid: str, value: int) -> str:
    """The shell command that reruns the test `nodeid` alone with seed `value`."""
    root = config.rootpath
    python = Path(sys.executable)
    if python.is_relative_to(root):  # the repo's .venv: keep the command short
        python = python.relative_to(root)
    return f"cd {shlex.quote(str(root))} && {SEED_ENV}={value} {python} -m pytest -q {shlex.quote(nodeid)}"


@pytest.fixture
def replay_seed(request: pytest.FixtureRequest) -> ReplaySeed:
    """A seed for the test's random choices: $DELTAREC_TEST_SEED when set, else a fresh one.

    Printed at setup (pytest shows it with any failure of the test) with the exact command
    that reruns this test with the same seed.
    """
    raw = os.environ.get(SEED_ENV, "").strip()
    if not raw:
        value = random.SystemRandom().randrange(1 << 31)  # independent of any seeding tests do
    elif re.fullmatch(r"[0-9]+", raw):
        value = int(raw)
    else:
        pytest.fail(f"{SEED_ENV}={raw!r}: not an integer seed", pytrace=False)
    seed = ReplaySeed(value, _replay_command(request.config, request.node.nodeid, value))
    print(f"random {seed}")
    return seed
