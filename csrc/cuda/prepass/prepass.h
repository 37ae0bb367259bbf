/*
 * The quantization pre-pass of the CUDA attention (SPEC 4.1-4.3), shared by every kernel: the
 * query/key means and global scales into the workspace (tile/workspace.cuh), so that they are
 * bit-identical whichever kernel runs, and, for the kernels that take FP16 operands, K^ and V^.
 */
#ifndef FP4ATTN_CUDA_PREPASS_PREPASS_H
#define FP4ATTN_CUDA_PREPASS_PREPASS_H

#include "../tile/workspace.cuh"

namespace fp4attn_cuda {

/* kAuto takes the streaming kernels where they apply (16-byte rows, head dim a multiple of 8, not
 * fp32 above head dim 128) and the two-read kernels otherwise; the others force one (kStreaming
 * is FP4ATTN_ERR_UNSUPPORTED where it does not apply). Both write the same bytes
 * (tests/cuda_harness/check_prepass.cu). */
enum class PrepassPath { kAuto, kTwoRead, kStreaming };

/* Enqueues the pre-pass on s: statistics (qbar, qamax, kbar, the global scales), then, where
 * fp16_operands, K^ and V^ as exact FP16 values (kdq, vdq). Zeroes the sync section first. */
fp4attn_status launch_prepass(const AttnArgs &a, bool fp16_operands, cudaStream_t s,
                              PrepassPath path = PrepassPath::kAuto);

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_PREPASS_PREPASS_H */
