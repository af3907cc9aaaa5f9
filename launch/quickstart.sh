#!/usr/bin/env bash
# Sets up whatever is missing, then trains the quickstart job on 2 CPU ranks under torchrun.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup.sh
exec .venv/bin/deltarec-launch --nproc-per-node 2 --config configs/quickstart.yaml "$@"
