#!/usr/bin/env bash
# Sets up whatever is missing, then runs the whole test suite. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup.sh || exit 1
# -rs: every skip says why (root, apt); --durations: where CI time goes
.venv/bin/python -m pytest -q -rs --durations=15 -p no:cacheprovider "$@" tests
rc=$?
if [[ $rc -eq 5 ]]; then
  echo "launch/test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit $rc
