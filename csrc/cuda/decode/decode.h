/*
 * Host interface of the FP4 KV-cache kernels (docs/SPEC.md section 6): the fused append and the
 * split-KV decode with its merge. dispatch.cu is the only caller.
 */
#ifndef FP4ATTN_CUDA_DECODE_DECODE_H
#define FP4ATTN_CUDA_DECODE_DECODE_H

#include <cuda_runtime.h>

#include "fp4attn/fp4attn.h"

namespace fp4attn_cuda {

/* How a decode call is split: tiles of `rows` (8 or 16) query rows (G query heads x len_q
 * positions of one (batch, KV head), in m-tiles) times `splits` key ranges; its workspace
 * layout. */
struct DecodePlan {
  int64_t dp, rows, mtiles, tiles, splits;
  int64_t o_part_bytes, ml_part_bytes, qshift_bytes, bytes;
};
DecodePlan plan_decode(const fp4attn_decode_params &p);

fp4attn_status launch_kv_append(const fp4attn_kv_append_params &p, cudaStream_t s);
fp4attn_status launch_decode(const fp4attn_decode_params &p, const DecodePlan &plan,
                             void *workspace, cudaStream_t s);

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_DECODE_DECODE_H */
