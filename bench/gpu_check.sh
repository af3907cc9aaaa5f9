#!/usr/bin/env bash
# Every GPU check of this checkout in one run, for a machine with one CUDA GPU and its own CUDA
# torch (docs/BENCHMARKS.md "On an H100"). Each step has its own time limit and log under OUT,
# so a run cut short keeps what finished; a failed step does not stop the next.
#
#   bash bench/gpu_check.sh OUT [STEP ...]      (default: every step, in this order)
#
# Steps:
#   setup    launch/setup.sh into $DELTAREC_VENV (default /tmp/deltarec-gpu-venv) on the machine's
#            torch; DELTAREC_WHEELHOUSE=DIR[:DIR2] for a machine without network (docs/gpu.md, "On a GPU")
#   tests    pytest -m gpu: every test that needs CUDA (snapshot, codecs and the Triton kernel,
#            staged restore, a GPU job's bit-exact resume under SIGKILL)
#   peers    python -m bench.run --suite gpu-peers --sizes full,big (about 5 minutes on an H100)
#   micro    python -m bench.gpu (stall, restore) and python -m bench.gpu_encode
#   throughput  python -m bench.run --suite throughput on one GPU, once per batch
#            size per rank (THROUGHPUT_BATCHES, default "8192 65536"): TorchRec's pipelined loop,
#            deltarec plain and pipelined, and pipelined with a checkpoint every
#            THROUGHPUT_INTERVAL_S (default 20), each THROUGHPUT_STEPS steps ("BATCH:STEPS ...",
#            default "8192:1500 65536:300": about a minute a job at rates guessed from the H100 run),
#            then the profile of a step. Not in the default steps (several minutes of device time).
#            THROUGHPUT_CONFIG (default full: the full suite's model) and THROUGHPUT_RANKS (1).
# Limits in seconds: SETUP_S, TESTS_S, PEERS_S, MICRO_S, THROUGHPUT_S (each batch size).
set -uo pipefail
OUT="${1:?usage: bash bench/gpu_check.sh OUT [setup|tests|peers|micro ...]}"
shift
STEPS=("$@")
[[ ${#STEPS[@]} -gt 0 ]] || STEPS=(setup tests peers micro)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DELTAREC_VENV="${DELTAREC_VENV:-/tmp/deltarec-gpu-venv}"
PY="$DELTAREC_VENV/bin/python"

step() {  # name, limit, command...: logs to OUT/name.log, one summary line on stdout
  local name="$1" limit="$2"
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "gpu_check: $name rc=$rc in $((SECONDS - t0)) s (log: $OUT/$name.log)"
  tail -n 4 "$OUT/$name.log" | cut -c1-300
}

nvidia-smi -L || echo "gpu_check: nvidia-smi failed"
for s in "${STEPS[@]}"; do
  case "$s" in
    setup) step setup "${SETUP_S:-300}" bash launch/setup.sh ;;
    tests) step tests "${TESTS_S:-600}" "$PY" -m pytest -q -p no:cacheprovider -m gpu -n 2 tests ;;
    peers) step peers "${PEERS_S:-540}" "$PY" -m bench.run --suite gpu-peers --sizes full,big \
             --out "$OUT/gpu-peers.jsonl" --records "$OUT/gpu-peers-records.jsonl" ;;
    micro) step micro "${MICRO_S:-300}" bash -c "'$PY' -m bench.gpu --parts stall,restore --rows 10000,100000,1000000 \
             --dims 32,128,256 --repeats 20 --out '$OUT/gpu.json' && '$PY' -m bench.gpu_encode --out '$OUT/gpu_encode.json'" ;;
    throughput)
      for b in ${THROUGHPUT_BATCHES:-8192 65536}; do
        n=300
        for pair in ${THROUGHPUT_STEPS:-8192:1500 65536:300}; do [[ "${pair%%:*}" == "$b" ]] && n="${pair#*:}"; done
        step "throughput-$b" "${THROUGHPUT_S:-420}" "$PY" -m bench.run --suite throughput \
          --records "$OUT/throughput-records.jsonl" --config "${THROUGHPUT_CONFIG:-full}" \
          --ranks "${THROUGHPUT_RANKS:-1}" --steps "$n" --interval-s "${THROUGHPUT_INTERVAL_S:-20}" --rounds 1 \
          --profile-steps 20 --reader-lines 0 --out "$OUT/throughput-$b.json" "data.batch_size=$b"
      done ;;
    *) echo "gpu_check: unknown step $s (setup, tests, peers, micro, throughput)" >&2; exit 2 ;;
  esac
done
