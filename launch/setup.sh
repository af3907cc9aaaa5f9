#!/usr/bin/env bash
# Creates .venv with everything deltarec needs, or does nothing if it is already there.
#
# What goes in is launch/versions.py's plan, made with the machine's python ($PYTHON, python3 by
# default) before anything is installed:
#   - that python has a CUDA torch: the venv is built on it (--system-site-packages), torch is
#     kept, and fbgemm-gpu (CUDA) and torchrec come from the table in versions.py, keyed by torch's
#     minor and CUDA major version; a torch with no row is refused in one line;
#   - otherwise the venv gets torch 2.13.0 with fbgemm-gpu-cpu 1.8.0 (CI), or with the CUDA
#     fbgemm-gpu 1.8.0 where nvidia-smi sees a GPU (that pair has not run on a GPU).
# torchrec goes in with --no-deps because its metadata asks for the CUDA fbgemm by name.
#
# DELTAREC_WHEELHOUSE=DIR   install from DIR only (pip --no-index --find-links DIR; several
#                           directories: DIR1:DIR2), for machines without network;
#                           `python -m launch.wheelhouse` makes one.
# DELTAREC_VENV=DIR         the venv to make (default: .venv in the repository).
# DELTAREC_SETUP_DRY_RUN=1  print the plan and the commands it would run; run none of them.
#
# Then the CPU kernels are compiled ahead of time (launch/kernels.py: numba's source into extension
# modules beside it, so that ranks load neither numba nor LLVM: docs/scale.md, "Host memory"); a build
# that fails says so in one line and the kernels are jitted instead.
#
# Idempotent: a stamp file records the hash of this script, versions.py, setup.cfg and the plan
# (the chosen versions, the python, the wheelhouse's listing), and each built kernel has its own
# stamp (its source's digest); when they match, the script returns in well under a second.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DELTAREC_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
case "${DELTAREC_SETUP_DRY_RUN:-0}" in 0 | "") DRY_RUN="" ;; *) DRY_RUN=1 ;; esac

# versions.py prints the refusal itself (one line); stop before anything is installed.
PLAN="$(cd "$ROOT" && "$PY" -m launch.versions plan)" || exit
RECIPE="" PY_VERSION="" SYSTEM_SITE="" REQS="" NO_DEPS="" CUDA_CHECK="" WHEELHOUSE="" SUMMARY=""
while IFS= read -r line; do
  value="${line#*=}"
  case "${line%%=*}" in
    recipe) RECIPE="$value" ;;
    python_version) PY_VERSION="$value" ;;
    system_site) SYSTEM_SITE="$value" ;;
    requirements) REQS="$value" ;;
    no_deps) NO_DEPS="$value" ;;
    cuda_check) CUDA_CHECK="$value" ;;
    wheelhouse) WHEELHOUSE="$value" ;;
    summary) SUMMARY="$value" ;;
  esac
done <<< "$PLAN"
read -r -a REQS <<< "$REQS"
read -r -a NO_DEPS <<< "$NO_DEPS"

stamp_value() {
  { cat "$ROOT/launch/setup.sh" "$ROOT/launch/versions.py" "$ROOT/setup.cfg"; printf '%s\n' "$PLAN"; } |
    sha256sum | cut -d' ' -f1
}

# The venv was made by this python, with the site-packages setting the plan wants.
venv_matches() {
  local want=false
  [[ "$SYSTEM_SITE" == 1 ]] && want=true
  [[ -x "$VENV/bin/python" && -f "$VENV/pyvenv.cfg" ]] &&
    grep -qx "include-system-site-packages = $want" "$VENV/pyvenv.cfg" &&
    grep -qx "version = $PY_VERSION" "$VENV/pyvenv.cfg"
}

# Runs a command, or in a dry run prints it (one line, shell-quoted, after "+ ").
run() {
  if [[ -n "$DRY_RUN" ]]; then
    printf '+'
    printf ' %q' "$@"
    printf '\n'
  else
    "$@"
  fi
}

# The kernels compiled ahead of time, rebuilt when their source changed (launch/kernels.py says
# why in one line when it cannot build them; the jitted kernels then run, so setup goes on).
build_kernels() {
  (cd "$ROOT" && run "$VENV/bin/python" -m launch.kernels) || true
}

STAMP="$VENV/.deltarec-setup"
if [[ -n "$DRY_RUN" ]]; then
  printf '%s\nstamp=%s\n' "$PLAN" "$(stamp_value)"
fi
if venv_matches && [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_value)" ]]; then
  [[ -n "$DRY_RUN" ]] && echo "deltarec setup: $VENV is up to date"
  build_kernels
  exit 0
fi

echo "deltarec setup: making $VENV ($RECIPE: $SUMMARY)" >&2
VENV_ARGS=()
[[ "$SYSTEM_SITE" == 1 ]] && VENV_ARGS+=(--system-site-packages)
if [[ -e "$VENV/pyvenv.cfg" ]] && ! venv_matches; then
  echo "deltarec setup: $VENV was made by another python or site-packages setting; remaking it" >&2
  VENV_ARGS+=(--clear)
fi
if ! venv_matches; then
  if ! run "$PY" -m venv ${VENV_ARGS[@]+"${VENV_ARGS[@]}"} "$VENV"; then
    # A python without ensurepip (Debian's, say) can still lend the venv its own pip.
    [[ "$SYSTEM_SITE" == 1 ]] || exit 1
    echo "deltarec setup: venv could not bootstrap pip; using $PY's pip through the system site" >&2
    run "$PY" -m venv --without-pip --clear ${VENV_ARGS[@]+"${VENV_ARGS[@]}"} "$VENV"
  fi
fi

# -qq: pip says only errors (its warnings about index locations of a particular machine are noise here)
PIP=("$VENV/bin/python" -m pip install -qq --disable-pip-version-check)
if [[ -n "$WHEELHOUSE" ]]; then
  PIP+=(--no-index)
  IFS=: read -r -a DIRS <<< "$WHEELHOUSE"
  for dir in "${DIRS[@]}"; do PIP+=(--find-links "$dir"); done
fi
run "${PIP[@]}" "${REQS[@]}"
run "${PIP[@]}" --no-deps "${NO_DEPS[@]}"
run "${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"

# Fail here, not in the first training step, if the stack does not load together (one line).
CHECK=("$VENV/bin/python" -m launch.versions check)
[[ "$CUDA_CHECK" == 1 ]] && CHECK+=(--cuda)
(cd "$ROOT" && run "${CHECK[@]}")
if [[ -n "$DRY_RUN" ]]; then
  echo "deltarec setup: dry run, nothing done" >&2
  exit 0
fi
stamp_value > "$STAMP"
build_kernels
echo "deltarec setup: done" >&2
