/*
 * Host interface of the Hopper wgmma attention kernel (sm_90a, head dims padded to 64 and 128;
 * attention_sm90.cuh), instantiated in attention_sm90.cu.
 */
#ifndef FP4ATTN_CUDA_SM90_ATTENTION_SM90_H
#define FP4ATTN_CUDA_SM90_ATTENTION_SM90_H

#include <cuda_runtime.h>

#include "fp4attn/fp4attn.h"

namespace fp4attn_cuda {

struct AttnArgs;

/* Enqueues the kernel for head dims padded to DP (64 or 128) on s; the pre-pass has filled a.ws.
 * Only for sm_90a builds on compute capability 9.0 (heuristics.h). */
template <int DP>
fp4attn_status launch_attention_sm90(const AttnArgs &a, cudaStream_t s);

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_SM90_ATTENTION_SM90_H */
