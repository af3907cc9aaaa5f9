#!/usr/bin/env bash
# Sets up whatever is missing, then trains the quickstart job on 2 CPU ranks under torchrun with
# continuous checkpoints to the embedded broker, kills a rank mid-run and resumes automatically.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup.sh
exec .venv/bin/python -m launch.quickstart "$@"
