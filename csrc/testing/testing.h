/*
 * Private test hooks of the CUDA backend: not part of the public C API (fp4attn.h). The binding
 * exposes them as the undocumented torch op namespace `fp4attn_testing` for tests/test_sm120.py.
 */
#ifndef FP4ATTN_TESTING_H
#define FP4ATTN_TESTING_H

#include <stdint.h>

#include "fp4attn/fp4attn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One warp runs the sm120 kernel's mma_fp4_m16n8k64 once (native on sm_120a, emulated elsewhere).
 * a [32][4], b [32][2], c/d [32][4] are the per-lane fragment registers, sfa/sfb [32] the per-lane
 * scale words; all device pointers. Enqueued on `stream` (a cudaStream_t). */
fp4attn_status fp4attn_testing_mma_fp4(const uint32_t *a, const uint32_t *b, const float *c,
                                       const uint32_t *sfa, const uint32_t *sfb, int tid_a,
                                       int tid_b, float *d, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* FP4ATTN_TESTING_H */
