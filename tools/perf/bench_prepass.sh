#!/usr/bin/env bash
# The attention pre-pass (csrc/cuda/prepass/prepass.cu) on a GPU machine, logs under $1 (or $OUT):
#   1. tests/cuda_harness/check_prepass.cu: the pre-pass byte-identical to its host reference,
#      exhaustive checks of the fast rounding helpers, graph capture, and pre-pass timing at the benchmark
#      shapes (uses a prebuilt .prepass_bin/check_prepass when it runs there, else builds it);
#   2. the extension build (FP4ATTN_CUDA_ARCHS=90a), the CUDA quantize/attention tests;
#   3. benchmarks/bench_attention.py --quick (BASELINES=1 to include the torch SDPA backends).
set -uo pipefail
LOG="${1:-${OUT:-prepass_logs}}"
mkdir -p "$LOG"
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
status=0
nvidia-smi -L
echo "== pre-pass harness"
BIN=.prepass_bin/check_prepass
if ! { [ -x "$BIN" ] && "$BIN" --probe >/dev/null 2>&1; }; then
  mkdir -p /tmp/pp && BIN=/tmp/pp/check_prepass
  nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I csrc/include -gencode arch=compute_90a,code=sm_90a \
    tests/cuda_harness/check_prepass.cu -o "$BIN" > "$LOG/harness_build.log" 2>&1 ||
    { echo "harness build failed"; tail "$LOG/harness_build.log"; }
fi
timeout 150 "$BIN" ${HARNESS_ARGS:-} > "$LOG/harness.log" 2>&1 || status=1
grep -E "FAIL|exhaustive|block quantizer|graph|checks" "$LOG/harness.log" | head -30
sed -n '/copy bandwidth/,$p' "$LOG/harness.log"
echo "== build"
t0=$(date +%s)
FP4ATTN_CUDA_ARCHS=90a MAX_JOBS=16 timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . \
  > "$LOG/build.log" 2>&1 || { echo "BUILD FAILED"; grep -E "error" "$LOG/build.log" | head -20; exit 1; }
echo "build took $(( $(date +%s) - t0 )) s"
echo "== tests"
t0=$(date +%s)
timeout 300 python3 -m pytest tests/test_cuda.py -q -x -k "quantize or attention" -p no:cacheprovider -rfE \
  > "$LOG/tests.log" 2>&1 || status=1
tail -6 "$LOG/tests.log"
echo "(tests: $(( $(date +%s) - t0 )) s)"
echo "== bench"
nb=--no-baselines
[ "${BASELINES:-0}" = "1" ] && nb=
timeout 240 python3 benchmarks/bench_attention.py --quick $nb --out "$LOG/bench" > "$LOG/bench.log" 2>&1 || status=1
grep -E "device|prepass" "$LOG/bench.log" | head -20
exit $status
