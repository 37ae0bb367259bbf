#!/usr/bin/env bash
# Compile the sm_120a FP4 attention sources (no GPU, no torch needed) and fail unless the PTX
# holds the block-scaled FP4 MMA:
#   mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X
# PTX of every kernel file for sm_120a (and sm_121a when this nvcc knows it); SASS of every
# source of csrc/cuda/sm120 for sm_120a, so that ptxas validates the instruction; with cuobjdump
# present, the SASS is checked for OMMA too. Usage: scripts/check_sm120_ptx.sh [nvcc]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NVCC="${1:-${NVCC:-nvcc}}"
SRC="$ROOT/csrc/cuda/sm120"
WANT='mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X'
EMUL='mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32'
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
command -v "$NVCC" >/dev/null || { echo "check_sm120_ptx: nvcc not found ($NVCC)" >&2; exit 2; }
"$NVCC" --version | tail -n 1

archs=(120a)
if "$NVCC" --list-gpu-arch 2>/dev/null | grep -q 'compute_121'; then archs+=(121a); fi
# the kernel sources: the attention per padded head dim, and the private MMA test hook
kernels=("$SRC/attention_sm120_d64.cu" "$SRC/attention_sm120_d128.cu" "$SRC/attention_sm120_d256.cu"
         "$ROOT/csrc/testing/mma_fp4_test.cu")
FLAGS=(-std=c++17 -O3 -I "$ROOT/csrc/include")

# job list: "ptx <arch> <file>" and "sass 120a <file>"
{
  for arch in "${archs[@]}"; do for k in "${kernels[@]}"; do echo "ptx $arch $k"; done; done
  for f in "$SRC"/*.cu; do echo "sass 120a $f"; done
} > "$TMP/jobs"
export NVCC TMP
export FLAGS_STR="${FLAGS[*]}"
xargs -P "$JOBS" -L 1 bash -c '
  kind=$0 arch=$1 f=$2 base=$(basename "$f" .cu)
  if [ "$kind" = ptx ]; then
    $NVCC $FLAGS_STR -gencode "arch=compute_${arch},code=compute_${arch}" -ptx "$f" -o "$TMP/${base}_${arch}.ptx"
  else
    $NVCC $FLAGS_STR -gencode "arch=compute_${arch},code=sm_${arch}" -c "$f" -o "$TMP/${base}_${arch}.o"
  fi' < "$TMP/jobs"

fail=0
for arch in "${archs[@]}"; do
  for src in "${kernels[@]}"; do
    k=$(basename "$src" .cu)
    ptx="$TMP/${k}_${arch}.ptx"
    n=$(grep -cF "$WANT" "$ptx" || true)
    if [ "$n" -eq 0 ]; then
      echo "FAIL: $k (sm_${arch}) PTX has no '$WANT'" >&2
      fail=1
    else
      echo "ok:   $k (sm_${arch}) PTX has $n block-scaled FP4 MMA(s)"
    fi
    if grep -qF "$EMUL" "$ptx"; then  # the emulation must not leak into the native build
      echo "FAIL: $k (sm_${arch}) PTX still uses the FP16 emulation" >&2
      fail=1
    fi
  done
done
echo "ok:   every csrc/cuda/sm120/*.cu assembled to sm_120a SASS by ptxas"
if command -v cuobjdump >/dev/null; then
  if cuobjdump -sass "$TMP/attention_sm120_d128_120a.o" | grep -q 'OMMA'; then
    echo "ok:   sm_120a SASS has OMMA"
  else
    echo "FAIL: sm_120a SASS has no OMMA" >&2
    fail=1
  fi
fi
[ "$fail" -eq 0 ] && echo "check_sm120_ptx: PASS (${archs[*]})"
exit "$fail"
