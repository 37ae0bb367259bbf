/*
 * The quantization pre-pass of the CUDA attention (SPEC 4.1-4.3), shared by every kernel: the
 * query/key means, V's smoothing mean and the global scales into the workspace
 * (tile/workspace.cuh), so that they are bit-identical whichever kernel runs, and, for the kernels
 * that take FP16 operands, K^ and V^. One implementation for every input (prepass.cu).
 */
#ifndef FP4ATTN_CUDA_PREPASS_PREPASS_H
#define FP4ATTN_CUDA_PREPASS_PREPASS_H

#include "../tile/workspace.cuh"

namespace fp4attn_cuda {

/* Bytes of staging the pre-pass needs for p's inputs: a copy of Q, K and V where their rows do
 * not allow 16-byte vector loads, else 0. A multiple of 256. */
int64_t prepass_staging_bytes(const fp4attn_attention_params &p);

/* Enqueues the pre-pass on s: statistics (qbar, qamax, kbar, qmean, vbar, the global scales),
 * then, where fp16_operands, K^ and (V - vbar)^ as exact FP16 values (kdq, vdq). Zeroes the sync
 * section first. staging: prepass_staging_bytes(a.p) bytes of device memory, 256-byte aligned. */
fp4attn_status launch_prepass(const AttnArgs &a, bool fp16_operands, void *staging, cudaStream_t s);

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_PREPASS_PREPASS_H */
