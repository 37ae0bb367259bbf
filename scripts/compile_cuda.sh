#!/usr/bin/env bash
# Compiles every .cu under csrc/ on its own (no torch headers) for every target architecture of
# the build, like setup.py does: FP4ATTN_CUDA_ARCHS (default 80;90a;120a). Fails on any error, and
# when ptxas reports that it serialized wgmma instructions (C7510 across a function call, C7512
# for lack of registers, C7513 for the code between issue and wait: the sm90 kernel's overlap of
# softmax and tensor-core work would be lost without any other sign).
set -euo pipefail
cd "$(dirname "$0")/.."
archs="${FP4ATTN_CUDA_ARCHS:-80;90a;120a}"
gencode=()
for a in ${archs//[;,]/ }; do gencode+=(-gencode "arch=compute_${a},code=sm_${a}"); done
# what torch.utils.cpp_extension adds to every nvcc call of the extension build
torch_defs=(-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
            -D__CUDA_NO_HALF2_OPERATORS__)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mapfile -t sources < <(find csrc -name '*.cu' | sort)
echo "nvcc $(nvcc --version | tail -1): ${#sources[@]} sources x archs ${archs}"
jobs=${MAX_JOBS:-$(nproc)}
printf '%s\n' "${sources[@]}" | xargs -P "$jobs" -I{} sh -c \
  'log="'"$out"'/$(echo {} | tr / _).log"
   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I csrc/include -Xptxas -v '"${torch_defs[*]}"' '"${gencode[*]}"' -c "{}" \
     -o "'"$out"'/$(echo {} | tr / _).o" > "$log" 2>&1 || { cat "$log"; exit 255; }
   if grep -q "wgmma.mma_async instructions are serialized" "$log"; then
     grep "wgmma.mma_async instructions are serialized" "$log"; echo "FAIL {}: ptxas serialized wgmma"; exit 255
   fi
   echo "  ok {}"'
# The pre-pass harness (it includes csrc/cuda/prepass/prepass.cu and is built by
# tools/perf/bench_prepass.sh on a GPU machine) and the timeline harnesses
# (tools/perf/trace_sm90.cu, trace_decode.cu), so that they keep compiling (sm_90a, no link).
if [[ ";${archs};" == *";90a;"* ]]; then
  nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I csrc/include -gencode arch=compute_90a,code=sm_90a \
    -c tests/cuda_harness/check_prepass.cu -o "$out/check_prepass.o"
  echo "  ok tests/cuda_harness/check_prepass.cu"
  nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I csrc/include -DFP4ATTN_SM90_TRACE \
    -gencode arch=compute_90a,code=sm_90a -c tools/perf/trace_sm90.cu -o "$out/trace_sm90.o"
  echo "  ok tools/perf/trace_sm90.cu"
  nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I csrc/include -DFP4ATTN_DECODE_TRACE \
    -gencode arch=compute_90a,code=sm_90a -c tools/perf/trace_decode.cu -o "$out/trace_decode.o"
  echo "  ok tools/perf/trace_decode.cu"
fi
