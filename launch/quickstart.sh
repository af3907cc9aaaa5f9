#!/usr/bin/env bash
# Sets up whatever is missing, then trains the quickstart job on 2 CPU ranks under torchrun with
# continuous checkpoints to the embedded broker; the trainer's fault injection kills a rank
# mid-run and torchrun resumes the job automatically. Arguments go to launch/quickstart.py:
# `--verbose` shows every library line, `key=value` overrides the job (e.g. train.steps=1200).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup.sh
exec .venv/bin/python -m launch.quickstart "$@"
