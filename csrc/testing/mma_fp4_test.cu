/* Test hook of the block-scaled FP4 MMA primitive (native on sm_120a, emulated elsewhere). */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdio.h>

#include "../cuda/sm120/mma_fp4.cuh"
#include "fp4attn/checks.h"
#include "testing.h"

namespace {

__global__ void test_mma_fp4_kernel(const uint32_t *a, const uint32_t *b, const float *c,
                                    const uint32_t *sfa, const uint32_t *sfb, int tid_a, int tid_b,
                                    float *d) {
  const int lane = threadIdx.x & 31;
  uint32_t ra[4], rb[2];
  float rc[4], rd[4];
  for (int i = 0; i < 4; ++i) ra[i] = a[lane * 4 + i];
  for (int i = 0; i < 2; ++i) rb[i] = b[lane * 2 + i];
  for (int i = 0; i < 4; ++i) rc[i] = c[lane * 4 + i];
  /* the selectors are immediates in the kernels: one call site per pair, with constants */
  const uint32_t fa = sfa[lane], fb = sfb[lane];
  switch (tid_a * 4 + tid_b) {
    case 0:
      fp4attn_sm120::mma_fp4_m16n8k64(rd, ra, rb, rc, fa, fb, 0, 0);
      break;
    case 1:
      fp4attn_sm120::mma_fp4_m16n8k64(rd, ra, rb, rc, fa, fb, 0, 1);
      break;
    case 2:
      fp4attn_sm120::mma_fp4_m16n8k64(rd, ra, rb, rc, fa, fb, 0, 2);
      break;
    case 3:
      fp4attn_sm120::mma_fp4_m16n8k64(rd, ra, rb, rc, fa, fb, 0, 3);
      break;
    case 4:
      fp4attn_sm120::mma_fp4_m16n8k64(rd, ra, rb, rc, fa, fb, 1, 0);
      break;
    case 5:
      fp4attn_sm120::mma_fp4_m16n8k64(rd, ra, rb, rc, fa, fb, 1, 1);
      break;
    case 6:
      fp4attn_sm120::mma_fp4_m16n8k64(rd, ra, rb, rc, fa, fb, 1, 2);
      break;
    default:
      fp4attn_sm120::mma_fp4_m16n8k64(rd, ra, rb, rc, fa, fb, 1, 3);
      break;
  }
  for (int i = 0; i < 4; ++i) d[lane * 4 + i] = rd[i];
}

}  // namespace

extern "C" fp4attn_status fp4attn_testing_mma_fp4(const uint32_t *a, const uint32_t *b,
                                                  const float *c, const uint32_t *sfa,
                                                  const uint32_t *sfb, int tid_a, int tid_b,
                                                  float *d, void *stream) {
  if (!a || !b || !c || !sfa || !sfb || !d)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "mma_fp4 test: null pointer");
  if (tid_a < 0 || tid_a > 1)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "mma_fp4 test: tid_a must be 0 or 1");
  if (tid_b < 0 || tid_b > 3)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "mma_fp4 test: tid_b must be in 0..3");
  test_mma_fp4_kernel<<<1, 32, 0, (cudaStream_t)stream>>>(a, b, c, sfa, sfb, tid_a, tid_b, d);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return fp4attn_error(FP4ATTN_ERR_CUDA, "mma_fp4 test: launch failed: %s",
                         cudaGetErrorString(err));
  }
  return fp4attn_ok();
}
