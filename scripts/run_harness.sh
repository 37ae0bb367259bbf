#!/usr/bin/env bash
# Builds tests/cuda_harness/NAME.cu for sm_80 and sm_90 (+ compute_90 PTX for newer GPUs) and runs
# it with the remaining arguments: the exhaustive checks whose host emulation needs no GPU and
# whose device code runs where one is present. Usage: scripts/run_harness.sh NAME [--device]
set -euo pipefail
cd "$(dirname "$0")/.."
name="$1"
shift
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
nvcc -std=c++17 -O2 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=[sm_90,compute_90] \
  -I csrc/include "tests/cuda_harness/$name.cu" -o "$out/$name"
"$out/$name" "$@"
