/*
 * Masks of one warp's 16 query rows x 128 keys of S (causal top-left, bool/additive attn_mask with
 * broadcast strides, key padding), in the m16n8k16 accumulator layout shared by the mma.sync and
 * wgmma kernels: s[n][e] is row g + 8*(e >> 1), key 8n + 2t + (e & 1), g = lane / 4, t = lane % 4.
 */
#ifndef FP4ATTN_CUDA_TILE_MASK_CUH
#define FP4ATTN_CUDA_TILE_MASK_CUH

#include "workspace.cuh"

namespace fp4attn_cuda {

/* Where one warp's 16 rows sit: (batch, query head) and the query row of accumulator row 0. */
struct WarpRows {
  int64_t b, h, row0;
};

/* Whether the 128-key tile at j0 needs a mask (key padding, causal, attn_mask) for any query row
 * from row0 on. */
__device__ __forceinline__ bool tile_has_masks(const fp4attn_attention_params &p, int64_t j0,
                                               int64_t row0) {
  const bool tail = j0 + kTile > p.len_k;
  const bool diag = p.causal && j0 + kTile - 1 > row0;
  return tail || diag || p.mask_kind != FP4ATTN_MASK_NONE;
}

/* Which masks tile_scores_log2 may have to apply (the caller knows more than the tile). */
enum class MaskPath {
  kCausalTail, /* no attn_mask: causal and key padding only (branch-free, cheap) */
  kAll,        /* anything, attn_mask included */
};

/* Causal and key-padding mask of one tile, no attn_mask: each row sees the columns up to its
 * last visible key, so one bound per row and one compare per score. */
__device__ __forceinline__ void mask_causal_tail(const fp4attn_attention_params &p,
                                                 const WarpRows &w, int64_t j0, float (&s)[16][4]) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  int last[2]; /* last visible column of rows g, g + 8 (from j0, clamped to [-1, 127]) minus 2t */
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int64_t l = p.len_k - 1 - j0;
    if (p.causal) l = min(l, w.row0 + g + 8 * r - j0);
    last[r] = (int)max((int64_t)-1, min(l, (int64_t)kTile - 1)) - 2 * t;
  }
#pragma unroll
  for (int n = 0; n < 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (n * 8 + (e & 1) > last[e >> 1]) s[n][e] = -INFINITY;
}

/* Any mask: causal (top-left), bool/additive attn_mask (broadcast strides), key padding. */
__device__ __forceinline__ void mask_general(const fp4attn_attention_params &p, const WarpRows &w,
                                             int64_t j0, float (&s)[16][4]) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t tok = j0 + n * 8 + 2 * t + (e & 1);
      const int64_t qi = w.row0 + g + (e >> 1) * 8;
      bool ok = tok < p.len_k && (!p.causal || tok <= qi);
      float add = 0.0f;
      if (ok && qi < p.len_q) {
        const int64_t off = w.b * p.mask_stride[0] + w.h * p.mask_stride[1] +
                            qi * p.mask_stride[2] + tok * p.mask_stride[3];
        if (p.mask_kind == FP4ATTN_MASK_BOOL)
          ok = static_cast<const uint8_t *>(p.mask)[off] != 0;
        else
          add = mask_log2(load_as_float(p.mask, p.mask_dtype, off));
      }
      s[n][e] = ok ? s[n][e] + add : -INFINITY;
    }
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_TILE_MASK_CUH */
