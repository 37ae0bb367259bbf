/*
 * Host interface of the FP4 KV-cache kernels (docs/SPEC.md section 6): the fused append and the
 * split-KV decode with its merge. dispatch.cu is the only caller; heuristics.h plans the decode
 * (plan_kv_decode) from the occupancy this file reports.
 */
#ifndef FP4ATTN_CUDA_KV_CACHE_KV_CACHE_H
#define FP4ATTN_CUDA_KV_CACHE_KV_CACHE_H

#include <cuda_runtime.h>

#include "../tile/workspace.cuh"
#include "fp4attn/fp4attn.h"

namespace fp4attn_cuda {

constexpr int kKvDecodeWarps = 4;  /* warps per block of the decode kernel */
constexpr int kKvDecodeChunk = 32; /* keys per warp step */

/* Blocks of the decode kernel variant for p (padded head dim dp, tiles of `rows` query rows)
 * resident per SM on the current device (1 where the query fails), asked once per variant. */
int kv_decode_blocks_per_sm(const fp4attn_decode_params &p, int64_t dp, int64_t rows);

fp4attn_status launch_kv_append(const fp4attn_kv_append_params &p, cudaStream_t s);
fp4attn_status launch_kv_decode(const fp4attn_decode_params &p, const KvDecodePlan &plan,
                                void *workspace, cudaStream_t s);

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_KV_CACHE_KV_CACHE_H */
