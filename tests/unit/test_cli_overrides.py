"""`key=value` overrides stand anywhere on a command line: before, between or after the options
(and, for `deltarec-ckpt`, before or after the subcommand), as README's commands write them.

argparse gives a `nargs="*"` positional one run of arguments only, so `--config C a=1
--export-every 10 b=2` used to stop with "unrecognized arguments: b=2". Each command is
checked through its own entry point: the follower's with its real config loading (a fake
`Follower` records what it was given), the server's parser, and `deltarec-ckpt`'s parser fed
what its entry point hands it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ckpt import cli as ckpt_commands
from ckpt.follow import cli as follow_commands
from trainer import ckpt_cli, follow_cli, serve_cli
from trainer.ckpt_cli import overrides_before_command, split_overrides

if TYPE_CHECKING:
    from tests.conftest import DebugConfig


@pytest.mark.parametrize(
    ("argv", "rest", "overrides"),
    [
        (
            ["--config", "c.yaml", "a=1", "--export-every", "10", "b.c=2"],
            ["--config", "c.yaml", "--export-every", "10"],
            ["a=1", "b.c=2"],
        ),
        (["a=1", "--config", "c.yaml"], ["--config", "c.yaml"], ["a=1"]),
        # an option's value stays its value, even one that looks like an override
        (
            ["--config", "c.yaml", "export", "--out", "model=1.pt", "a=1"],
            ["--config", "c.yaml", "export", "--out", "model=1.pt"],
            ["a=1"],
        ),
        (["--export-every", "-1", "a=1"], ["--export-every", "-1"], ["a=1"]),
        (["--config=c.yaml", "a=1"], ["--config=c.yaml"], ["a=1"]),
        # help takes no value: what follows it is an override
        (["--help", "a=1", "--config", "c.yaml"], ["--help", "--config", "c.yaml"], ["a=1"]),
        # after `--` nothing moves
        (["--config", "c.yaml", "--", "a=1"], ["--config", "c.yaml", "--", "a=1"], []),
        # list values and indices, as the README writes them
        (
            ["--config", "c.yaml", "data.criteo.train_paths=[/d/t.tsv]", "list", "model.tables.0.sharding=row_wise"],
            ["--config", "c.yaml", "list"],
            ["data.criteo.train_paths=[/d/t.tsv]", "model.tables.0.sharding=row_wise"],
        ),
    ],
)
def test_split_overrides(argv: list[str], rest: list[str], overrides: list[str]) -> None:
    assert split_overrides(argv) == (rest, overrides)


# --- deltarec-follow ----------------------------------------------------------------------------


class _FakeFollower:
    seen: list[dict[str, Any]] = []

    def __init__(
        self, run_id: str, sink: Any, follow: Any, metrics: Any, export_every: int | None, export_every_s: float | None
    ) -> None:
        self.seen.append({"run_id": run_id, "sink": sink, "export_every": export_every, "export_every_s": export_every_s})

    def run(self) -> None:
        pass


@pytest.mark.parametrize(
    "order",
    [
        ["JOB", "--export-every", "10"],  # overrides first
        ["--export-every", "10", "JOB"],  # after the option (README's form)
        ["run.dir=RUN", "--export-every", "10", "JOB"],  # on both sides of it
        ["--verbose", "JOB", "--export-every", "10", "--export-every-s", "5"],
    ],
)
def test_follow_takes_overrides_before_or_after_options(
    order: list[str], tmp_path: Path, debug_config: DebugConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follow_commands, "Follower", _FakeFollower)
    monkeypatch.setattr(follow_cli.console, "setup_rank", lambda *a, **k: None)  # the test process's logging stays
    _FakeFollower.seen.clear()
    job = ["ckpt.enabled=true", "ckpt.sink.kind=filesystem", "ckpt.run_id=cli_overrides", f"run.dir={tmp_path / 'run'}"]
    argv = ["--config", str(debug_config.path)]
    for a in order:
        argv += job if a == "JOB" else [a.replace("RUN", str(tmp_path / "elsewhere"))]
    assert follow_cli.main(argv) == 0
    (seen,) = _FakeFollower.seen
    sink = seen["sink"]
    assert seen["export_every"] == 10 and seen["export_every_s"] == (5.0 if "--export-every-s" in order else None)
    assert sink.kind == "filesystem" and seen["run_id"] == "cli_overrides"
    assert sink.fs_root == str(tmp_path / "run" / "stream")  # the later run.dir wins, as in the order given


# --- deltarec-serve -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "c.yaml", "a=1", "b=2", "--address-file", "f.json"],
        ["--config", "c.yaml", "--address-file", "f.json", "a=1", "b=2"],
        ["--config", "c.yaml", "a=1", "--address-file", "f.json", "b=2"],
        ["a=1", "--config", "c.yaml", "b=2", "--verbose"],
    ],
)
def test_serve_takes_overrides_before_or_after_options(argv: list[str]) -> None:
    args = serve_cli.parse_args(argv)
    assert args.config == "c.yaml" and args.overrides == ["a=1", "b=2"]


# --- deltarec-ckpt ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["--config", "c.yaml", "a=1", "b=2", "list"], "list"),
        (["--config", "c.yaml", "list", "a=1", "b=2"], "list"),  # argparse took `a=1` for the subcommand
        (["--config", "c.yaml", "a=1", "list", "b=2"], "list"),
        (["--config", "c.yaml", "a=1", "verify", "--checkpoint", "3", "b=2"], "verify"),
        (["--config", "c.yaml", "export", "a=1", "--out", "m.pt", "b=2"], "export"),
        (["--config", "c.yaml", "a=1", "gc", "b=2", "--keep", "2"], "gc"),
    ],
)
def test_ckpt_takes_overrides_before_or_after_the_command(argv: list[str], command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    handed: list[list[str]] = []

    def commands(argv: list[str], load: object) -> int:  # ckpt/cli.py's main: what the entry point hands it
        handed.append(list(argv))
        return 0

    monkeypatch.setattr(ckpt_cli.ckpt_cli, "main", commands)
    assert ckpt_cli.main(argv) == 0
    args = ckpt_commands.parse_args(handed[0])
    assert args.command == command and args.config == "c.yaml" and args.overrides == ["a=1", "b=2"]
    assert overrides_before_command(argv) == handed[0]
    if command == "verify":
        assert args.checkpoint == 3
    if command == "export":
        assert args.out == Path("m.pt")
    if command == "gc":
        assert args.keep == 2


# --- deltarec-train -----------------------------------------------------------------------------


def test_train_takes_overrides_before_between_or_after_options() -> None:
    from trainer.main import parse_args

    args = parse_args(["--config", "c.yaml", "a=1", "--dry-run", "b=2", "--world-size", "8", "c=3"])
    assert (args.config, args.dry_run, args.world_size, args.overrides) == ("c.yaml", True, 8, ["a=1", "b=2", "c=3"])
