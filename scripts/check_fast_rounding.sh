#!/usr/bin/env bash
# Builds and runs tests/cuda_harness/check_fast_rounding.cu: the exhaustive check of P's E2M1
# rounding (e2m1_pair_sat6). The host emulation always runs; the device code too where a GPU is
# present, for its architecture (sm_80 and sm_90+ take different min/max instructions, so both are
# built; compute_90 PTX covers newer GPUs). Arguments go to the check: --device checks the device
# code only (and fails without a GPU). Used by .ci/run and scripts/gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
nvcc -std=c++17 -O2 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=[sm_90,compute_90] \
  -I csrc/include tests/cuda_harness/check_fast_rounding.cu -o "$out/check_fast_rounding"
"$out/check_fast_rounding" "$@"
