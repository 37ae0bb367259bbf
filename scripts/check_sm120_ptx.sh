#!/usr/bin/env bash
# Compile the sm_120a FP4 attention sources (no GPU, no torch needed) and fail unless the PTX
# holds the block-scaled FP4 MMA. Also builds SASS for sm_120a (and sm_121a when this nvcc
# accepts it) so that ptxas validates the instruction, and, when cuobjdump exists, checks the
# SASS for OMMA. Usage: scripts/check_sm120_ptx.sh [nvcc]   (env NVCC also honoured)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NVCC="${1:-${NVCC:-nvcc}}"
SRC="$ROOT/csrc/cuda/sm120"
WANT='mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X'
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
command -v "$NVCC" >/dev/null || { echo "check_sm120_ptx: nvcc not found ($NVCC)" >&2; exit 2; }
"$NVCC" --version | tail -n 1

archs=(120a)
if "$NVCC" --list-gpu-arch 2>/dev/null | grep -q 'compute_121'; then archs+=(121a); fi

fail=0
for arch in "${archs[@]}"; do
  for f in "$SRC"/attention_sm120_d64.cu "$SRC"/attention_sm120_d128.cu "$SRC"/attention_sm120_d256.cu "$SRC"/test_mma_fp4.cu; do
    base="$(basename "$f" .cu)"
    ptx="$TMP/${base}_${arch}.ptx"
    "$NVCC" -std=c++17 -O3 -I "$ROOT/csrc/include" -gencode "arch=compute_${arch},code=compute_${arch}" \
      -ptx "$f" -o "$ptx"
    n=$(grep -cF "$WANT" "$ptx" || true)
    if [ "$n" -eq 0 ]; then
      echo "FAIL: $base (sm_${arch}) PTX has no '$WANT'" >&2
      fail=1
    else
      echo "ok:   $base (sm_${arch}) PTX has $n block-scaled FP4 MMA(s)"
    fi
    # the emulation must not leak into the native build
    if grep -q 'mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32' "$ptx"; then
      echo "FAIL: $base (sm_${arch}) PTX still uses the FP16 emulation" >&2
      fail=1
    fi
  done
  # ptxas must accept it (SASS), for every source file of the directory
  for f in "$SRC"/*.cu; do
    "$NVCC" -std=c++17 -O3 -I "$ROOT/csrc/include" -gencode "arch=compute_${arch},code=sm_${arch}" \
      -c "$f" -o "$TMP/$(basename "$f" .cu)_${arch}.o"
  done
  if command -v cuobjdump >/dev/null; then
    if cuobjdump -sass "$TMP/attention_sm120_d128_${arch}.o" | grep -q 'OMMA'; then
      echo "ok:   sm_${arch} SASS has OMMA"
    else
      echo "FAIL: sm_${arch} SASS has no OMMA" >&2
      fail=1
    fi
  fi
done
[ "$fail" -eq 0 ] && echo "check_sm120_ptx: PASS (${archs[*]})"
exit "$fail"
