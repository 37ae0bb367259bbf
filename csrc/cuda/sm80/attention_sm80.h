/*
 * Host interface of the mma.sync attention kernel (sm_80 and newer; attention_sm80.cuh), one
 * instantiation per padded head dim in attention_sm80_d{64,128,256}.cu.
 */
#ifndef FP4ATTN_CUDA_SM80_ATTENTION_SM80_H
#define FP4ATTN_CUDA_SM80_ATTENTION_SM80_H

#include <cuda_runtime.h>

#include "fp4attn/fp4attn.h"

namespace fp4attn_cuda {

struct AttnArgs;

/* Enqueues the kernel for head dims padded to DP on s; the pre-pass has filled a.ws. */
template <int DP>
fp4attn_status launch_attention_sm80(const AttnArgs &a, cudaStream_t s);

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_SM80_ATTENTION_SM80_H */
