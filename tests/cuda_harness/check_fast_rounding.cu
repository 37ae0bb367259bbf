/*
 * Exhaustive host check of the two shortcuts the CUDA attention kernel takes in its P path
 * (csrc/cuda/common.cuh, attention_fwd.cuh), against numerics.h:
 *   e2m1_round_nonneg(y) == value(fp4attn_e2m1_encode(y)) for every float y in [0, 16];
 *   e4m3(div6_for_e4m3(a)) == e4m3(a / 6) for every float a in [0, 4096].
 * Build and run (no GPU needed, about 30 s):
 *   nvcc -std=c++17 -O2 -I csrc/include tests/cuda_harness/check_fast_rounding.cu -o /tmp/chk && /tmp/chk
 */
#include <cmath>
#include <cstdio>

#include "../../csrc/cuda/common.cuh"

static float div6_host(float a) { /* same operations as div6_for_e4m3 */
  const float y = 0.16666667163372040f;
  volatile float q0 = a * y;
  volatile float r = std::fmaf(-q0, 6.0f, a);
  return std::fmaf(r, y, q0);
}

int main() {
  long bad_round = 0, bad_div = 0;
  for (uint32_t u = 0; u <= 0x41800000u; ++u) {
    const float y = fp4attn_bits_float(u);
    if (fp4attn_cuda::e2m1_round_nonneg(y) != fp4attn_e2m1_decode(fp4attn_e2m1_encode(y))) ++bad_round;
  }
  for (uint32_t u = 0; u <= 0x45800000u; ++u) {
    const float a = fp4attn_bits_float(u);
    volatile float exact = a / 6.0f;
    if (fp4attn_e4m3_encode_sat(div6_host(a)) != fp4attn_e4m3_encode_sat(exact)) ++bad_div;
  }
  printf("e2m1 rounding mismatches: %ld, E4M3(a/6) mismatches: %ld\n", bad_round, bad_div);
  return (bad_round || bad_div) ? 1 : 0;
}
