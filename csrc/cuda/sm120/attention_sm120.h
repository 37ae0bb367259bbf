/*
 * Native Blackwell (sm_120a: RTX 50xx, RTX PRO Blackwell) FP4 attention and its test hooks.
 *
 * fp4attn_cuda_attention_sm120 computes SPEC.md section 4 with both matmuls on the block-scaled
 * FP4 MMA (mma_fp4.cuh). Built for any other architecture (sm_80, sm_90a) the same kernel source
 * runs with an exact software emulation of that MMA, which is how it is tested without Blackwell
 * hardware. The generic CUDA backend dispatches here for FP4ATTN_KERNEL_SM120, or for
 * FP4ATTN_KERNEL_AUTO on compute capability 12.x. See docs/blackwell.md.
 */
#ifndef FP4ATTN_CUDA_SM120_ATTENTION_SM120_H
#define FP4ATTN_CUDA_SM120_ATTENTION_SM120_H

#include <stdint.h>

#include "fp4attn/fp4attn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Device workspace (bytes, a multiple of 256) that fp4attn_cuda_attention_sm120 needs. */
int64_t fp4attn_cuda_attention_sm120_workspace_bytes(const fp4attn_attention_params *p);

/* Enqueue the attention on `stream` (cudaStream_t as void*); `workspace` is device memory of at
 * least fp4attn_cuda_attention_sm120_workspace_bytes(p) bytes, 256-byte aligned. */
fp4attn_status fp4attn_cuda_attention_sm120(const fp4attn_attention_params *p, void *workspace,
                                            void *stream);

/* fp4attn_cuda_test_mma_fp4, the test hook of mma_fp4_m16n8k64, is declared in fp4attn.h. */

/* 1 when this build holds native sm_120a/sm_121a code for the device it runs on. */
int fp4attn_cuda_sm120_native(void);

#ifdef __cplusplus
}
#endif
#endif /* FP4ATTN_CUDA_SM120_ATTENTION_SM120_H */
