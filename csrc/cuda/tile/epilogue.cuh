/*
 * Output epilogue of one warp's rows (SPEC 4.6): O / l + vbar (V smoothing, SPEC 4.3; rows without
 * visible keys stay 0) cast to the output dtype, and the LSE with the key-smoothing shift added
 * back.
 */
#ifndef FP4ATTN_CUDA_TILE_EPILOGUE_CUH
#define FP4ATTN_CUDA_TILE_EPILOGUE_CUH

#include "softmax.cuh"

namespace fp4attn_cuda {

/* SPEC 4.6, the factor of each of a warp's rows g, g+8 (r = 0, 1): O / l with O = omul * o, 0 for
 * rows without visible keys. Sums l over the quad first (st.l is then the row's l). */
__device__ __forceinline__ void row_factors(SoftmaxState &st, const float (&omul)[2],
                                            float (&inv)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 1);
    st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 2);
    inv[r] = st.l[r] != 0.0f ? omul[r] * (1.0f / st.l[r]) : 0.0f;
  }
}

/* The LSE of a warp's rows, m ln2 + log l + scale (q - qbar).kbar, when requested (after
 * row_factors). qbar: this block's query mean (any memory), kbar: the key mean of the KV head. */
__device__ __forceinline__ void store_lse(const AttnArgs &a, const WarpRows &w, int64_t bh,
                                          const SoftmaxState &st, const float *qbar,
                                          const float *kbar) {
  const fp4attn_attention_params &p = a.p;
  if (!p.lse) return;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int D = (int)p.head_dim;
  /* the smoothed scores omit (q_r - qbar_i) . kbar per row; add it back (reference) */
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t qi = w.row0 + g + r * 8;
    float sh = 0.0f;
    if (qi < p.len_q) {
      const int64_t base = w.b * p.q_stride[0] + w.h * p.q_stride[1] + qi * p.q_stride[2];
      for (int d = t; d < D; d += 4)
        sh = fmaf(__fsub_rn(load_as_float(p.q, p.dtype, base + d), qbar[d]), kbar[d], sh);
    }
    sh += __shfl_xor_sync(0xffffffffu, sh, 1);
    sh += __shfl_xor_sync(0xffffffffu, sh, 2);
    if (qi < p.len_q && t == 0) {
      const float lse = st.l[r] != 0.0f ? st.m[r] * kLn2 + logf(st.l[r]) + p.scale * sh : -INFINITY;
      p.lse[bh * p.len_q + qi] = lse;
    }
  }
}

/* Output element pair (d, d + 1) of row r: fl(fl(fl(o x inv) x dv) + vbar) for rows with visible
 * keys, 0 for the others (also where dv is NaN: V holds a NaN that those rows do not see). vbar:
 * the KV head's V smoothing mean, zero beyond D (d even). dv (V's dec, or 1 where o carries it)
 * last: for a small max |V| (~1e-34) a row factor that included it would be subnormal and lose
 * its precision. */
__device__ __forceinline__ float2 out_pair(float o0, float o1, float inv, float dv, bool visible,
                                           const float *vbar, int d) {
  if (!visible) return make_float2(0.0f, 0.0f);
  const float2 vb = *reinterpret_cast<const float2 *>(vbar + d);
  return make_float2(__fadd_rn(__fmul_rn(__fmul_rn(o0, inv), dv), vb.x),
                     __fadd_rn(__fmul_rn(__fmul_rn(o1, inv), dv), vb.y));
}

/* SPEC 4.6 for one warp's rows: O / l + vbar with O = omul * o * dv per row (rows without visible
 * keys -> 0) cast to the output dtype, and the LSE (store_lse). Any output layout and dtype:
 * stores straight from the accumulator layout (4 or 8 bytes per store, 8 rows per warp
 * instruction). */
template <int DP>
__device__ __forceinline__ void store_rows(const AttnArgs &a, const WarpRows &w, int64_t bh,
                                           const float (&o)[DP / 8][4], const float (&omul)[2],
                                           float dv, SoftmaxState &st, const float *qbar,
                                           const float *kbar, const float *vbar) {
  const fp4attn_attention_params &p = a.p;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int D = (int)p.head_dim;
  float inv[2];
  row_factors(st, omul, inv);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t qi = w.row0 + g + r * 8;
    if (qi < p.len_q) {
      const int64_t ob = w.b * p.out_stride[0] + w.h * p.out_stride[1] + qi * p.out_stride[2];
      const bool visible = st.l[r] != 0.0f;
#pragma unroll
      for (int n = 0; n < DP / 8; ++n) {
        const int d = n * 8 + 2 * t;
        const float2 v = out_pair(o[n][2 * r], o[n][2 * r + 1], inv[r], dv, visible, vbar, d);
        if (d + 1 < D)
          store2_from_float(p.out, p.dtype, ob + d, v.x, v.y, a.out_pair);
        else if (d < D)
          store_from_float(p.out, p.dtype, ob + d, v.x);
      }
    }
  }
  store_lse(a, w, bh, st, qbar, kbar);
}

/* store_rows for 16-bit outputs whose 8-element groups are 16-byte aligned (a.vec_out): the warp
 * writes its 16 rows into shared memory first, then stores whole rows with 16-byte stores (two
 * rows of 128 columns, or four of 64, per warp instruction, instead of 8-row scatters of 4 bytes).
 * stage: this warp's 16 x DP halves, with 16-byte chunk c of row r at chunk c ^ (r % 8) of the
 * row (conflict-free both ways), used by this warp alone. */
template <int DP>
__device__ __forceinline__ void store_rows_staged(const AttnArgs &a, const WarpRows &w, int64_t bh,
                                                  const float (&o)[DP / 8][4],
                                                  const float (&omul)[2], float dv,
                                                  SoftmaxState &st, const float *qbar,
                                                  const float *kbar, const float *vbar,
                                                  uint32_t *stage) {
  const fp4attn_attention_params &p = a.p;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  constexpr int kChunks = DP / 8; /* 16-byte chunks per row */
  float inv[2];
  row_factors(st, omul, inv);
  __syncwarp(); /* the warp's reads of its last use of stage are done */
  const bool bf = p.dtype == FP4ATTN_BFLOAT16;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    const bool visible = st.l[r] != 0.0f;
#pragma unroll
    for (int n = 0; n < kChunks; ++n) {
      const float2 v =
          out_pair(o[n][2 * r], o[n][2 * r + 1], inv[r], dv, visible, vbar, n * 8 + 2 * t);
      const float v0 = v.x, v1 = v.y;
      uint32_t word;
      if (bf) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(v0, v1);
        word = *reinterpret_cast<const uint32_t *>(&h);
      } else {
        const __half2 h = __floats2half2_rn(v0, v1);
        word = *reinterpret_cast<const uint32_t *>(&h);
      }
      stage[row * (DP / 2) + ((n ^ (row & 7)) * 4) + t] = word;
    }
  }
  __syncwarp();
  constexpr int kRowsPerStep = 32 / kChunks; /* rows one warp instruction covers */
  const int chunk = lane % kChunks, D = (int)p.head_dim;
#pragma unroll
  for (int r0 = 0; r0 < 16; r0 += kRowsPerStep) {
    const int row = r0 + lane / kChunks;
    const int64_t qi = w.row0 + row;
    if (qi < p.len_q && chunk * 8 < D) {
      const uint4 v =
          *reinterpret_cast<const uint4 *>(stage + row * (DP / 2) + ((chunk ^ (row & 7)) * 4));
      const int64_t off =
          w.b * p.out_stride[0] + w.h * p.out_stride[1] + qi * p.out_stride[2] + chunk * 8;
      *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(p.out) + off) = v;
    }
  }
  store_lse(a, w, bh, st, qbar, kbar);
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_TILE_EPILOGUE_CUH */
