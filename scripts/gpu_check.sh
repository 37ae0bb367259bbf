#!/usr/bin/env bash
# One command on a GPU machine: build fp4attn with its CUDA backend, run every GPU-marked test
# under tests/, run the quick benchmarks (FP4 and 8-bit forward). Logs go to the folder given as
# $1, else $OUT, else ./gpu_logs.
#   scripts/gpu_check.sh logs/            (FP4ATTN_CUDA_ARCHS=90a to build only for Hopper)
#   SKIP_SLOW=1 scripts/gpu_check.sh logs/   (skip the slow tests: 16K, > 2^31 elements)
set -uo pipefail
LOG="${1:-${OUT:-gpu_logs}}"
mkdir -p "$LOG"
LOG="$(cd "$LOG" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
status=0
export PYTHONUNBUFFERED=1

{ nvidia-smi; nvcc --version; "$PY" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'; } \
  > "$LOG/env.txt" 2>&1
echo "== build (FP4ATTN_CUDA_ARCHS=${FP4ATTN_CUDA_ARCHS:-default})"
t0=$(date +%s)
if ! MAX_JOBS="${MAX_JOBS:-16}" "$PY" -m pip install --no-build-isolation --no-deps -v -e . \
    > "$LOG/build.log" 2>&1; then
  echo "BUILD FAILED (tail of $LOG/build.log):"
  grep -E "error|Error" "$LOG/build.log" | head -40
  tail -30 "$LOG/build.log"
  exit 1
fi
echo "build took $(( $(date +%s) - t0 )) s"
grep -E "spill stores [1-9]" "$LOG/build.log" | sort | uniq -c | head -20

echo "== E2M1 rounding of P on the device (every float)"
bash scripts/check_fast_rounding.sh --device || status=1
echo "== the KV-cache decode's E2M1 decoder on the device"
bash scripts/check_e2m1_pairs.sh --device || status=1
echo "== the KV-cache decode's K5 key decoder on the device"
bash scripts/check_k5_pairs.sh --device || status=1
run_tests() {  # $1: marker expression, $2: log name
  local t0=$(date +%s)
  "$PY" -m pytest tests/ -m "$1" -q -rfE -p no:cacheprovider > "$LOG/$2" 2>&1 || status=1
  tail -15 "$LOG/$2"
  echo "($2: $(( $(date +%s) - t0 )) s)"
}
echo "== GPU tests"
run_tests "gpu and not slow" tests.log
echo "== quick benchmarks"
"$PY" benchmarks/bench_attention.py --quick --out "$LOG" > "$LOG/bench.log" 2>&1 || status=1
tail -32 "$LOG/bench.log"
"$PY" benchmarks/bench_attention.py --quick --precision int8 --out "$LOG" > "$LOG/bench_int8.log" 2>&1 ||
  status=1
tail -16 "$LOG/bench_int8.log"
if [ "${SKIP_SLOW:-0}" != "1" ]; then
  echo "== slow GPU tests"
  run_tests "gpu and slow" tests_slow.log
fi
exit $status
