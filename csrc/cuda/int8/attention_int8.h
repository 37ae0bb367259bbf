/*
 * Host interface of the 8-bit attention kernels (docs/SPEC_INT8.md: mma.sync m16n8k32 s8, sm_80
 * and newer; the Hopper forward and backward on wgmma). A call runs prepare (psi of Q, smoothed K
 * and V, plus dO and the row terms in the backward) into the workspace of int8_tiles.cuh, then the
 * forward or backward kernel; the backward ends with finish_dq. dispatch.cu is the only caller.
 */
#ifndef FP4ATTN_CUDA_INT8_ATTENTION_INT8_H
#define FP4ATTN_CUDA_INT8_ATTENTION_INT8_H

#include <cuda_runtime.h>

#include "fp4attn/fp4attn.h"

namespace fp4attn_cuda {

struct Int8Args;

fp4attn_status launch_int8_prepare(const Int8Args &a, bool backward, cudaStream_t s);
template <int DP>
fp4attn_status launch_int8_forward(const Int8Args &a, cudaStream_t s);
/* The Hopper forward on wgmma (forward_sm90.cu): DP 64, 128 or 256, sm_90a builds on CC 9.0. */
template <int DP>
fp4attn_status launch_int8_forward_sm90(const Int8Args &a, cudaStream_t s);
template <int DP>
fp4attn_status launch_int8_backward(const Int8Args &a, cudaStream_t s);
/* The Hopper backward on wgmma (backward_sm90.cu): DP 64 or 128, sm_90a builds on CC 9.0. */
template <int DP>
fp4attn_status launch_int8_backward_sm90(const Int8Args &a, cudaStream_t s);
fp4attn_status launch_int8_finish_dq(const Int8Args &a, cudaStream_t s);

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_INT8_ATTENTION_INT8_H */
