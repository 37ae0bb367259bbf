/* Test hook of the block-scaled FP4 MMA primitive (native on sm_120a, emulated elsewhere). */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdio.h>

#include "../cuda/sm120/mma_fp4.cuh"
#include "fp4attn/checks.h"
#include "testing.h"

namespace {

/* mma_fp4_m16n8k64 with the selectors (tid_a, tid_b) = (K / 4, K % 4) of sel = K: they are
 * immediates in the kernels, so each pair gets its own call site with constants. */
template <int K>
__device__ void mma_selected(int sel, float (&rd)[4], const uint32_t (&ra)[4],
                             const uint32_t (&rb)[2], const float (&rc)[4], uint32_t fa,
                             uint32_t fb) {
  if (sel == K)
    fp4attn_sm120::mma_fp4_m16n8k64(rd, ra, rb, rc, fa, fb, K / 4, K % 4);
  else if constexpr (K < 7)
    mma_selected<K + 1>(sel, rd, ra, rb, rc, fa, fb);
}

__global__ void test_mma_fp4_kernel(const uint32_t *a, const uint32_t *b, const float *c,
                                    const uint32_t *sfa, const uint32_t *sfb, int tid_a, int tid_b,
                                    float *d) {
  const int lane = threadIdx.x & 31;
  uint32_t ra[4], rb[2];
  float rc[4], rd[4];
  for (int i = 0; i < 4; ++i) ra[i] = a[lane * 4 + i];
  for (int i = 0; i < 2; ++i) rb[i] = b[lane * 2 + i];
  for (int i = 0; i < 4; ++i) rc[i] = c[lane * 4 + i];
  mma_selected<0>(tid_a * 4 + tid_b, rd, ra, rb, rc, sfa[lane], sfb[lane]);
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
