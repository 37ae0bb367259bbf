/*
 * Exhaustive check of the 8-bit attention's FP8 E4M3 helpers (csrc/cuda/common/e4m3.cuh) against
 * numerics.h (fp4attn_e4m3_encode_sat / fp4attn_e4m3_decode, the sign applied):
 *  1. e4m3_round(y) is the value of y's E4M3 byte, for every float y (both signs, +-inf, NaN);
 *  2. e4m3x2(y, y') gives the bytes of both (device: cvt.rn.satfinite.e4m3x2.f32 on sm_89+, the
 *     encoder on sm_80), compared as values (a zero's sign and a NaN's payload may differ);
 *  3. e4m3_terms_sum(y), every float |y| <= 448 (1 + 2^-23) (V's scaled values): the exact sum of
 *     e4m3_round(y) and e4m3_round(y - e4m3_round(y)) (both terms and the sum taken in double).
 * The host part always runs (~1 minute); the device code too where a GPU is present. Build and
 * run: scripts/check_e4m3.sh [--device].
 */
#include <cstdio>
#include <cstring>

#include "../../csrc/cuda/common/e4m3.cuh"
#include "cuda_check.h"

using fp4attn_cuda::e4m3_byte;
using fp4attn_cuda::e4m3_round;

__host__ __device__ static float byte_value(uint32_t c) {
  return fp4attn_e4m3_decode((uint8_t)c);
}
/* Equal values, a NaN equal to a NaN. */
__host__ __device__ static bool same(float a, float b) {
  return a == b || (a != a && b != b);
}

/* Item 3 for y: 0 if it holds or y is outside its range. */
__host__ __device__ static unsigned long long check_terms(float y) {
  if (!(fabsf(y) <= 448.0f * (1.0f + 0x1p-23f))) return 0;
  const double hi = byte_value(e4m3_byte(y));
  const double lo = byte_value(e4m3_byte((float)((double)y - hi)));
  return (double)fp4attn_cuda::e4m3_terms_sum(y) != hi + lo;
}

/* Items 1 to 3 for the floats with bits [first, first + count) (count even). */
__host__ __device__ static unsigned long long check_floats(uint64_t first, uint64_t count) {
  unsigned long long bad = 0;
  for (uint64_t u = first; u < first + count; u += 2) {
    const float y0 = fp4attn_bits_float((uint32_t)u), y1 = fp4attn_bits_float((uint32_t)u + 1);
    const float w0 = byte_value(e4m3_byte(y0)), w1 = byte_value(e4m3_byte(y1));
    bad += !same(e4m3_round(y0), w0) + !same(e4m3_round(y1), w1);
    bad += check_terms(y0) + check_terms(y1);
#ifdef __CUDA_ARCH__
    const uint32_t b = fp4attn_cuda::e4m3x2(y0, y1);
    bad += !same(byte_value(b & 0xFFu), w0) + !same(byte_value(b >> 8), w1) + (b >> 16 != 0);
#endif
  }
  return bad;
}

__global__ void check_kernel(unsigned long long *bad) {
  const uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned long long b = check_floats(t << 16, 1ull << 16);
  if (b) atomicAdd(bad, b);
}

int main(int argc, char **argv) {
  const bool device_only = argc > 1 && strcmp(argv[1], "--device") == 0;
  unsigned long long host_bad = 0;
  if (!device_only) {
    host_bad = check_floats(0, 1ull << 32);
    printf("e4m3 (host): e4m3_round and e4m3_terms_sum on all 2^32 floats: %llu mismatches\n",
           host_bad);
  }
  unsigned long long dev_bad = 0;
  if (count_on_device(check_kernel, (1u << 16) / 256, 256, &dev_bad)) {
    printf(
        "e4m3 (device): the same and e4m3x2's bytes on the GPU's instructions, %llu "
        "mismatches\n",
        dev_bad);
  } else if (device_only) {
    printf("e4m3: --device needs a GPU\n");
    return 1;
  }
  return host_bad || dev_bad ? 1 : 0;
}
