#!/usr/bin/env bash
# The static checks, first in .ci/run: lint and format (ruff), types (mypy on the product's
# packages), the layers of docs/design/layers.md (import-linter), and the docs' budgets
# (launch/doc_budgets.py: page lengths; no issue numbers, sessions or run letters). Settings: pyproject.toml.
# Sets up what is missing first (launch/setup.sh). Exit status: the first check that failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup.sh || exit 1
BIN=.venv/bin
status=0
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
check() {  # name, command...: one line for it; the tool's own output only when it failed
  local name="$1"
  shift
  if "$@" >"$out" 2>&1; then
    echo "launch/check.sh: $name ok" >&2
  else
    cat "$out" >&2
    echo "launch/check.sh: $name FAILED" >&2
    status=1
  fi
}
check "ruff lint" "$BIN/ruff" check --quiet .
check "ruff format" "$BIN/ruff" format --check --quiet .
check "mypy" "$BIN/mypy" --no-error-summary
check "layers" "$BIN/lint-imports" --no-cache
check "docs budgets" "$BIN/python" launch/doc_budgets.py
exit $status
