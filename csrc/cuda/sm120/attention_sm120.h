/*
 * Host interface of the Blackwell (sm_120a: RTX 50xx, RTX PRO Blackwell) FP4 attention: both
 * matmuls on the block-scaled FP4 MMA (mma_fp4.cuh). Built for any other architecture the same
 * kernel source runs with an exact software emulation of that MMA, which is how it is tested
 * without Blackwell hardware. See docs/blackwell.md.
 */
#ifndef FP4ATTN_CUDA_SM120_ATTENTION_SM120_H
#define FP4ATTN_CUDA_SM120_ATTENTION_SM120_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "fp4attn/fp4attn.h"

namespace fp4attn_cuda {

struct AttnArgs;

/* Bytes of the kernel's own workspace sections (after the shared ones), a multiple of 256. */
int64_t sm120_workspace_bytes(const fp4attn_attention_params &p);

/* Writes Q^, K^, V^ into `own` (256-byte aligned, sm120_workspace_bytes) from the shared
 * statistics in a.ws (the pre-pass has run without FP16 operands), then runs the kernel on s. */
fp4attn_status launch_attention_sm120(const AttnArgs &a, void *own, cudaStream_t s);

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_SM120_ATTENTION_SM120_H */
