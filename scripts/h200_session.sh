#!/usr/bin/env bash
# One device call on the lent H200: everything that needs the GPU, logs under $OUT (or $1).
#   build (sm_90a only, to save time) + CUDA tests + quick benchmark + slow tests (gpu_check.sh),
#   sm120 emulation tests, the CPU suite under the device's torch, info + demo on the GPU,
#   the real-model cross-check and the accuracy report on captured activations (.captured/,
#   see crosscheck_captured.py),
#   and a native backtrace of the error-path crash seen on this machine.
set -uo pipefail
LOG="${1:-${OUT:-gpu_logs}}"
mkdir -p "$LOG"
cd "$(dirname "$0")/.."
export FP4ATTN_CUDA_ARCHS="${FP4ATTN_CUDA_ARCHS:-90a}" MAX_JOBS="${MAX_JOBS:-16}" PYTHONUNBUFFERED=1
status=0
if [ "${SKIP_GPU_CHECK:-0}" != "1" ]; then  # 1: reuse the build of a previous call (warm machine)
  bash scripts/gpu_check.sh "$LOG" || status=1
fi
echo "== sm120 emulation tests"
python3 -m pytest tests/test_sm120.py -q -rfE -p no:cacheprovider > "$LOG/sm120.log" 2>&1 || status=1
tail -5 "$LOG/sm120.log"
echo "== CPU suite under the device's torch"
python3 -m pytest tests/test_api.py tests/test_quantize.py tests/test_attention_cpu.py \
  tests/test_transformers.py tests/test_reference.py -q -rfE -p no:cacheprovider \
  > "$LOG/cpu_suite.log" 2>&1 || status=1
tail -5 "$LOG/cpu_suite.log"
echo "== info + demo"
python3 -m fp4attn info
python3 -m fp4attn demo --seq 4096 2>&1 | tee "$LOG/demo.log" | tail -9
if [ -f .captured/smollm2.pt ]; then
  echo "== real-model cross-check (captured SmolLM2 activations)"
  python3 scripts/crosscheck_captured.py check .captured/smollm2.pt 2>&1 | tee "$LOG/crosscheck.log" | tail -14 || status=1
  echo "== accuracy report on the GPU (captured activations; the weights do not travel)"
  python3 -m fp4attn report --captured .captured/smollm2.pt --device cuda --ablation-tokens 256 \
    --out "$LOG/report_cuda" > "$LOG/report_cuda.log" 2>&1 || status=1
  grep -E "Per-layer cosine|done in" "$LOG/report_cuda.log"
fi
echo "== error-path backtrace"
cat > /tmp/err.py <<'PY'
import torch, fp4attn
q = torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.float16)
k = torch.randn(1, 3, 16, 64, device="cuda", dtype=torch.float16)
try:
    torch.ops.fp4attn.attention(q, k, k, None, False, 0.125, False, 1)
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0])
PY
python3 /tmp/err.py; echo "exit code $?"
timeout 90 cuda-gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 /tmp/err.py \
  > "$LOG/err_bt.log" 2>&1
grep -E "^#|SIGSEGV|raised|gomp" "$LOG/err_bt.log" | head -40
exit $status
