#!/usr/bin/env bash
# Profiling helper for a GPU machine (after the build): ncu stall reasons of the attention
# kernel and a SASS instruction histogram. Output into $1 (or $OUT).
set -uo pipefail
LOG="${1:-${OUT:-prof_out}}"; mkdir -p "$LOG"
cd "$(dirname "$0")/../.."
ncu --clock-control none -k regex:attention_fwd_kernel -c 1 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section ComputeWorkloadAnalysis --section InstructionStats \
  python3 tools/perf/profile_attention.py ${PROFILE_ARGS:-128 8192 2 16 0} > "$LOG/ncu.txt" 2>&1
grep -E "Stall|Warp Cycles|Issued|Eligible|Active Warps|Duration|Throughput|Registers|Pipe|Achieved|Theoretical" "$LOG/ncu.txt" | head -60
nvcc -std=c++17 -O3 -I csrc/include -gencode arch=compute_90a,code=sm_90a -cubin \
  -o "$LOG/d128.cubin" csrc/cuda/sm80/attention_sm80_d128.cu && cuobjdump -sass "$LOG/d128.cubin" > "$LOG/d128.sass"
grep -oE "^\s+/\*[0-9a-f]{4,5}\*/\s+[A-Z0-9_]+" "$LOG/d128.sass" | awk '{print $2}' | sort | uniq -c | sort -rn | head -30
