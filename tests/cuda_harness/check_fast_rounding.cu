/*
 * Exhaustive host check of the E2M1 rounding shortcut of the CUDA attention kernels' P path
 * (e2m1_grid_nonneg, csrc/cuda/common.cuh) against numerics.h: for every float y in [0, 16],
 * min(e2m1_grid_nonneg(y), 6) == value(fp4attn_e2m1_encode(y)).
 * Run by .ci/run; by hand (no GPU needed, a few seconds):
 *   nvcc -std=c++17 -O2 -I csrc/include tests/cuda_harness/check_fast_rounding.cu -o /tmp/chk && /tmp/chk
 */
#include <cstdio>

#include "../../csrc/cuda/common.cuh"

int main() {
  long bad = 0;
  for (uint32_t u = 0; u <= 0x41800000u; ++u) { /* +0 .. 16 */
    const float y = fp4attn_bits_float(u);
    const float r = fp4attn_cuda::e2m1_grid_nonneg(y);
    if ((r < 6.0f ? r : 6.0f) != fp4attn_e2m1_decode(fp4attn_e2m1_encode(y))) ++bad;
  }
  printf("e2m1_grid_nonneg: every float in [0, 16] checked, %ld mismatches\n", bad);
  return bad ? 1 : 0;
}
