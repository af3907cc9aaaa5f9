"""launch/doc_budgets.py, the docs' budgets launch/check.sh keeps: a tree that breaks each rule is
named line by line, the history folder and code outside docstrings and comments are left alone,
and this checkout passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from launch import doc_budgets

ROOT = Path(__file__).resolve().parents[2]

# The wordings the check refuses, built here so that this file's own prose holds none of them.
ISSUE = "issue " + "12"
HASH = "#" + "13"
ORDINAL = "twenty-" + "eighth session"
SESSION_NUMBER = "session " + "7"
RUN = "run " + "K"
RUNS = "runs " + "A-H"


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _lines(n: int) -> str:
    return "".join(f"line {i}\n" for i in range(n))


def test_a_tree_within_its_budgets_passes(tmp_path: Path) -> None:
    _write(tmp_path, "README.md", _lines(doc_budgets.README_MAX_LINES))
    _write(tmp_path, "docs/BENCHMARKS.md", _lines(doc_budgets.BENCHMARKS_MAX_LINES))
    _write(tmp_path, "docs/design/restore.md", _lines(doc_budgets.PAGE_MAX_LINES))
    _write(tmp_path, "ckpt/a.py", '"""A module."""\n\nX = 1  # a comment\n')
    assert doc_budgets.violations(tmp_path) == []


def test_every_budget_and_wording_broken_is_named_once_per_line(tmp_path: Path) -> None:
    _write(tmp_path, "README.md", _lines(doc_budgets.README_MAX_LINES + 1))
    _write(tmp_path, "docs/BENCHMARKS.md", _lines(doc_budgets.BENCHMARKS_MAX_LINES + 1))
    _write(tmp_path, "docs/design/kafka.md", _lines(doc_budgets.PAGE_MAX_LINES + 1))
    _write(tmp_path, "docs/scale.md", f"# Scale\n\nMeasured in {RUN} ({ISSUE}).\nThe {ORDINAL} of it.\n")
    _write(tmp_path, "docs/history/BENCHMARKS-2026-11.md", _lines(2000) + f"{ISSUE}, {ORDINAL}, {RUNS}\n")
    _write(
        tmp_path,
        "bench/suite.py",
        f'"""A suite ({HASH} item 4)."""\n\n\ndef f() -> str:\n    """Its {SESSION_NUMBER} figure."""\n'
        f'    return "{ISSUE} in a string is output, not prose"  # {RUNS} again\n',
    )
    _write(tmp_path, "launch/run.sh", f'#!/usr/bin/env bash\n# see {ISSUE}\necho "{RUN}"\n')
    _write(tmp_path, "configs/job.yaml", f"run:\n  seed: 1  # {ORDINAL}\n")
    _write(tmp_path, "docs/img/notes.txt", f"{ISSUE}\n")
    found = doc_budgets.violations(tmp_path)
    expected = [
        f"docs/BENCHMARKS.md: {doc_budgets.BENCHMARKS_MAX_LINES + 1} lines, over its budget of "
        f"{doc_budgets.BENCHMARKS_MAX_LINES}",
        f"README.md: {doc_budgets.README_MAX_LINES + 1} lines, over its budget of {doc_budgets.README_MAX_LINES}",
        f"docs/design/kafka.md: {doc_budgets.PAGE_MAX_LINES + 1} lines, over a page's budget of {doc_budgets.PAGE_MAX_LINES}",
        f"docs/scale.md:3: an issue number: {ISSUE!r}",
        f"docs/scale.md:3: a run letter: {RUN!r}",
        f"docs/scale.md:4: a session ordinal: {ORDINAL!r}",
        f"bench/suite.py:6: a run letter: {RUNS!r}",
        f"bench/suite.py:1: an issue number: {HASH!r}",
        f"bench/suite.py:5: a session ordinal: {SESSION_NUMBER!r}",
        f"configs/job.yaml:2: a session ordinal: {ORDINAL!r}",
        f"launch/run.sh:2: an issue number: {ISSUE!r}",
    ]
    assert sorted(found) == sorted(expected)


def test_the_command_prints_one_line_per_violation_and_fails(tmp_path: Path) -> None:
    _write(tmp_path, "docs/BENCHMARKS.md", f"{ISSUE}\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "doc_budgets.py"), str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 1
    assert proc.stdout == f"doc budgets: docs/BENCHMARKS.md:1: an issue number: {ISSUE!r}\n"


def test_this_checkout_keeps_its_budgets() -> None:
    assert doc_budgets.violations(ROOT) == []
