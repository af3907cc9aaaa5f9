#!/usr/bin/env bash
# Sets up whatever is missing, then runs the whole test suite (CI's command). Extra arguments go
# to pytest.
#   bash launch/test.sh          every test: units, spawned gloo ranks, the embedded broker,
#                                Slurm, two nodes (about 12 minutes on 2 cores; 3 pytest
#                                workers take as long: the tests are CPU-bound there)
#   bash launch/test.sh --fast   tests/unit only: no spawned ranks, broker or scheduler (under
#                                2 minutes), for a contributor before a commit
# Ranks and the commands tests run are forked from a warm process (launch/warm.py).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup.sh || exit 1
WHERE=(tests)
if [[ "${1:-}" == "--fast" ]]; then
  shift
  WHERE=(tests/unit)
fi
# Two pytest workers (DELTAREC_TEST_WORKERS), each test file on one of them: many tests spend
# much of their time waiting (timeouts, a broker, Slurm's scheduler, restarts), not computing.
# -rs: every skip says why (root, apt); --durations: where CI time goes.
.venv/bin/python -m pytest -q -rs --durations=15 -p no:cacheprovider \
  -n "${DELTAREC_TEST_WORKERS:-2}" --dist loadfile "$@" "${WHERE[@]}"
rc=$?
if [[ $rc -eq 5 ]]; then
  echo "launch/test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit $rc
