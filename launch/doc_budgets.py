"""The docs' budgets, kept by CI (launch/check.sh): the pages state today's facts, not a lab notebook.

Prints one line per violation and exits 1 if there is any:
- docs/BENCHMARKS.md over `BENCHMARKS_MAX_LINES` lines, README.md over `README_MAX_LINES`, any
  other page under docs/ over `PAGE_MAX_LINES` (docs/history/ holds the superseded runs,
  verbatim, and has no budget);
- issue numbers (the word issue, or a hash, before a number), session ordinals (an ordinal or a
  number beside the word session) and run letters (the word run before a capital letter) in
  docs/ (not docs/history/), in README.md, and in the docstrings and comments of the .py, .sh
  and YAML files under `CODE_DIRS`. Say the fact instead: the commit, the date, the figure, the
  page that holds the measurement.

Standalone on purpose (the standard library only): `launch` imports nothing of the product here.
`python launch/doc_budgets.py [ROOT]` checks ROOT (default: the checkout this file is in).
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

BENCHMARKS_MAX_LINES = 300
# The README's budget: a short pitch, the quick start, the library API within its first ~100
# lines and a tour of the CLI, each step linking to the page under docs/ that holds the details.
# Never raise it: move a detail to its page instead.
README_MAX_LINES = 300
PAGE_MAX_LINES = 450
CODE_DIRS = ("ckpt", "trainer", "sharding", "common", "launch", "bench", "examples", "tests", "configs")

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|thirtieth|fortieth|fiftieth"
)
_TENS = "twenty|thirty|forty|fifty"
_UNITS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth"
PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("an issue number", re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)),
    ("an issue number", re.compile(r"(?<![\w&#/])#\d{1,4}\b")),
    (
        "a session ordinal",
        re.compile(rf"\b(?:(?:{_TENS})-(?:{_UNITS})|{_ORDINALS}|\d+(?:st|nd|rd|th))\s+sessions?\b", re.IGNORECASE),
    ),
    ("a session ordinal", re.compile(r"\bsessions?\s+#?\d+", re.IGNORECASE)),
    ("a run letter", re.compile(r"\b[Rr]uns?\s+[A-Z](?:\s*[-–]\s*[A-Z])?(?![\w'’])")),
    ("a design section number (cite the page under docs/design/)", re.compile(r"design\.md\s*§")),
)


def wording(text: str) -> Iterator[tuple[int, str, str]]:
    """(line number, what, the words) of every issue number, session ordinal or run letter in `text`."""
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in PATTERNS:
            for match in pattern.finditer(line):
                yield number, what, match.group(0)


def python_prose(source: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of every comment and docstring of a Python source."""
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                yield token.start[0], token.string
    except (tokenize.TokenError, SyntaxError):
        pass
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    yield body[0].lineno, body[0].value.value


_HASH_COMMENT = re.compile(r"(?:^|\s)(#.*)$")


def hash_comments(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every `#` comment of a shell or YAML file (a `#` at a line's start or after a blank)."""
    for number, line in enumerate(source.splitlines(), 1):
        match = _HASH_COMMENT.search(line)
        if match:
            yield number, match.group(1)


def _line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def violations(root: Path) -> list[str]:
    """Every violation under `root`, one line each, as `path[:line]: what`."""
    found: list[str] = []
    docs = root / "docs"
    benchmarks = docs / "BENCHMARKS.md"
    readme = root / "README.md"
    if benchmarks.is_file() and (n := _line_count(benchmarks)) > BENCHMARKS_MAX_LINES:
        found.append(f"docs/BENCHMARKS.md: {n} lines, over its budget of {BENCHMARKS_MAX_LINES}")
    if readme.is_file() and (n := _line_count(readme)) > README_MAX_LINES:
        found.append(f"README.md: {n} lines, over its budget of {README_MAX_LINES}")
    pages = sorted(p for p in docs.rglob("*.md") if "history" not in p.relative_to(docs).parts) if docs.is_dir() else []
    for page in pages:
        if page != benchmarks and (n := _line_count(page)) > PAGE_MAX_LINES:
            found.append(f"{page.relative_to(root)}: {n} lines, over a page's budget of {PAGE_MAX_LINES}")
    for page in [*pages, readme] if readme.is_file() else pages:
        for number, what, words in wording(page.read_text(encoding="utf-8")):
            found.append(f"{page.relative_to(root)}:{number}: {what}: {words!r}")
    for name in CODE_DIRS:
        top = root / name
        if not top.is_dir():
            continue
        for path in sorted(top.rglob("*")):
            if not path.is_file() or any(part.startswith(".") for part in path.relative_to(root).parts):
                continue
            if path.suffix == ".py":
                prose = python_prose(path.read_text(encoding="utf-8"))
            elif path.suffix in (".sh", ".yaml", ".yml"):
                prose = hash_comments(path.read_text(encoding="utf-8"))
            else:
                continue
            for first, text in prose:
                for offset, what, words in wording(text):
                    found.append(f"{path.relative_to(root)}:{first + offset - 1}: {what}: {words!r}")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    found = violations(root)
    for line in found:
        print(f"doc budgets: {line}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
