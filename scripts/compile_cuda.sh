#!/usr/bin/env bash
# Compiles every .cu under csrc/ on its own (no torch headers) for every target architecture of
# the build, like setup.py does: FP4ATTN_CUDA_ARCHS (default 80;90a;120a). Fails on any error.
set -euo pipefail
cd "$(dirname "$0")/.."
archs="${FP4ATTN_CUDA_ARCHS:-80;90a;120a}"
gencode=()
for a in ${archs//[;,]/ }; do gencode+=(-gencode "arch=compute_${a},code=sm_${a}"); done
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mapfile -t sources < <(find csrc -name '*.cu' | sort)
echo "nvcc $(nvcc --version | tail -1): ${#sources[@]} sources x archs ${archs}"
jobs=${MAX_JOBS:-$(nproc)}
printf '%s\n' "${sources[@]}" | xargs -P "$jobs" -I{} sh -c \
  'nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I csrc/include '"${gencode[*]}"' -c "{}" -o "'"$out"'/$(echo {} | tr / _).o" && echo "  ok {}"'
