#!/usr/bin/env bash
# Builds and runs tests/cuda_harness/check_e2m1_pairs.cu: the exhaustive check of the KV-cache
# decode's E2M1 decoder (csrc/cuda/decode/e2m1_pairs.cuh), FP16 and BF16. The host emulation always
# runs (seconds); the device code too where a GPU is present. --device: the device only. Used by
# .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
nvcc -std=c++17 -O2 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=[sm_90,compute_90] \
  -I csrc/include tests/cuda_harness/check_e2m1_pairs.cu -o "$out/check_e2m1_pairs"
"$out/check_e2m1_pairs" "$@"
