/*
 * Online softmax with two-level P quantization (SPEC 4.4-4.5) of one warp's 16 query rows x 128
 * keys, shared by the FP16-operand kernels: the mma.sync kernel (sm80/) and the Hopper wgmma
 * kernel (sm90/). Both hold S in the m16n8k16 accumulator layout (wgmma m64nNk16 gives each warp
 * of the warpgroup exactly that layout for its 16 rows).
 *
 * Accumulator layout of one warp: s[n][e] is row g + 8*(e >> 1), key 8n + 2t + (e & 1), with
 * g = lane / 4 and t = lane % 4. The A-operand fragment of P for 16-key block kb is
 * {s[2kb][0..1], s[2kb][2..3], s[2kb+1][0..1], s[2kb+1][2..3]} packed to half2: no shuffles.
 */
#ifndef FP4ATTN_CUDA_TILE_SOFTMAX_CUH
#define FP4ATTN_CUDA_TILE_SOFTMAX_CUH

#include "../common/fast_rounding.cuh"
#include "mask.cuh"

namespace fp4attn_cuda {

constexpr float kLog2_2688 = 11.392317422778760f; /* log2(2688) */
constexpr float kLog2_6 = 2.5849625007211562f;    /* log2(6) */

/* E4M3 block scales of two P blocks (rows g and g+8) from their maxima over 6, u = max Pq / 6:
 * s = rne_e4m3_sat(u) as floats (sv) and as the FP16 pair (s_g, s_g+8) (hw). u comes from one
 * exp2 with log2(6) folded into its offset, within a few units in the last place of max Pq / 6, so
 * the E4M3 rounding can differ from SPEC 2 only next to an exact tie. */
__device__ __forceinline__ void block_scales(float u0, float u1, float (&sv)[2], uint32_t &hw) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __nv_fp8x2_storage_t b2 =
      __nv_cvt_float2_to_fp8x2(make_float2(u0, u1), __NV_SATFINITE, __NV_E4M3);
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(b2, __NV_E4M3); /* .x = row g, .y = row g+8 */
  hw = (uint32_t)h.x | ((uint32_t)h.y << 16);
  const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&hw));
  sv[0] = f.x, sv[1] = f.y;
#else
  sv[0] = fp4attn_e4m3_decode(fp4attn_e4m3_encode_sat(u0));
  sv[1] = fp4attn_e4m3_decode(fp4attn_e4m3_encode_sat(u1));
  hw = pack_half2(sv[0], sv[1]);
#endif
}

/* code * s for an FP16 pair of E2M1 values and the scale s of row half r of hw (exact). */
__device__ __forceinline__ uint32_t scale_pair(uint32_t code2, uint32_t hw, int r) {
  const __half2 h = *reinterpret_cast<const __half2 *>(&hw);
  const __half2 r2 = __hmul2(*reinterpret_cast<const __half2 *>(&code2),
                             r == 0 ? __low2half2(h) : __high2half2(h));
  return *reinterpret_cast<const uint32_t *>(&r2);
}

/* Online-softmax state of a warp's rows g and g+8 (this lane's partial sums of l). */
struct SoftmaxState {
  float m[2], l[2];
};

/* Scores of one 128-key tile (starting at key j0) in log2 units, in place:
 *   s = scale*log2e*(dQ dK acc + qbar.K) (+ mask), with bias[key] = scale*log2e*(qbar . K[key])
 *   and cqk = scale*log2e*dQ*dK. Masks: causal (top-left), bool/additive attn_mask, key padding. */
template <MaskPath kMasks = MaskPath::kAll>
__device__ __forceinline__ void tile_scores_log2(const fp4attn_attention_params &p,
                                                 const WarpRows &w, int64_t j0, float cqk,
                                                 const float *bias, float (&s)[16][4]) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int n = 0; n < 16; ++n) {
    const float2 bb = *reinterpret_cast<const float2 *>(bias + n * 8 + 2 * t);
    s[n][0] = fmaf(s[n][0], cqk, bb.x);
    s[n][1] = fmaf(s[n][1], cqk, bb.y);
    s[n][2] = fmaf(s[n][2], cqk, bb.x);
    s[n][3] = fmaf(s[n][3], cqk, bb.y);
  }
  if (tile_has_masks(p, j0, w.row0)) {
    if (kMasks == MaskPath::kCausalTail || p.mask_kind == FP4ATTN_MASK_NONE)
      mask_causal_tail(p, w, j0, s);
    else
      mask_general(p, w, j0, s);
  }
}

/* Block maxima of the log2 scores: bm[kb][r] is the maximum of 16-key block kb of row g + 8r
 * (s[2kb][2r..2r+1] and s[2kb+1][2r..2r+1] of the 4 quad lanes), in every lane of the quad.
 * exp2 is monotonic, so exp2(bm - off) is the block maximum of Pq without a pass over Pq.
 * NT 8-key column tiles (16 for a 128-key tile; the split-KV decode's warps hold 4). */
template <int NT>
__device__ __forceinline__ void block_maxima(const float (&s)[NT][4], float (&bm)[NT / 2][2]) {
#pragma unroll
  for (int kb = 0; kb < NT / 2; ++kb)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      bm[kb][r] = fmaxf(fmaxf(s[2 * kb][2 * r], s[2 * kb][2 * r + 1]),
                        fmaxf(s[2 * kb + 1][2 * r], s[2 * kb + 1][2 * r + 1]));
#pragma unroll
  for (int kb = 0; kb < NT / 2; ++kb)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      bm[kb][r] = fmaxf(bm[kb][r], __shfl_xor_sync(0xffffffffu, bm[kb][r], 1));
#pragma unroll
  for (int kb = 0; kb < NT / 2; ++kb)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      bm[kb][r] = fmaxf(bm[kb][r], __shfl_xor_sync(0xffffffffu, bm[kb][r], 2));
}

template <int NB>
__device__ __forceinline__ float tile_row_max(const float (&bm)[NB][2], int r) {
  float tmax = bm[0][r];
#pragma unroll
  for (int kb = 1; kb < NB; ++kb) tmax = fmaxf(tmax, bm[kb][r]);
  return tmax;
}

/* phi_local of Pq = exp2(s - toff) per 16-key block, fused into the exponential: with the block
 * scale s = rne_e4m3_sat(max Pq / 6), Pq / s = exp2(x - (toff + log2 s)), so one exp2 per score
 * gives the value to round onto the E2M1 grid (toff = +inf: everything is 0). Returns this
 * lane's part of the row sums of Pq (unquantized, SPEC 4.5) as s * sum(Pq / s); P^q = code * s is
 * exact in FP16. The approximate exp2/log2 move Pq / s by a few units in the last place, which
 * changes its E2M1 code only when it sits on a rounding tie: the same kind of difference the
 * approximate exp always made, within SPEC 4's rel_l1 < 2e-3 against the reference. */
template <int NT>
__device__ __forceinline__ void quantize_p_blocks(const float (&s)[NT][4],
                                                  const float (&bm)[NT / 2][2],
                                                  const float (&toff)[2], uint32_t (&pa)[NT / 2][4],
                                                  float (&rsum)[2]) {
  rsum[0] = rsum[1] = 0.0f;
  const float toff6[2] = {toff[0] + kLog2_6, toff[1] + kLog2_6}; /* exp2(x - toff6) = Pq / 6 */
#pragma unroll
  for (int kb = 0; kb < NT / 2; ++kb) {
    float sv[2], off[2];
    uint32_t hw;
    block_scales(fast_exp2(bm[kb][0] - toff6[0]), fast_exp2(bm[kb][1] - toff6[1]), sv, hw);
    /* A block whose scale rounds to 0 (max Pq / 6 below 2^-10) gets P^q = code * 0 = 0, but its
     * unquantized Pq still count in l (SPEC 4.5): y is taken against sc = max(s, 2^-126), so
     * y * sc = Pq for the row sum, and y stays finite (below 2^121; e2m1_pair_sat6 saturates it
     * at 6 before the multiplication by s = 0). */
    float sc[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sc[r] = fmaxf(sv[r], 1.17549435e-38f);
      off[r] = toff[r] + fast_log2(sc[r]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float y0 = fast_exp2(s[2 * kb][2 * r] - off[r]);
      const float y1 = fast_exp2(s[2 * kb][2 * r + 1] - off[r]);
      const float y2 = fast_exp2(s[2 * kb + 1][2 * r] - off[r]);
      const float y3 = fast_exp2(s[2 * kb + 1][2 * r + 1] - off[r]);
      rsum[r] = fmaf((y0 + y1) + (y2 + y3), sc[r], rsum[r]);
      pa[kb][r] = scale_pair(e2m1_pair_sat6(y0, y1), hw, r);
      pa[kb][2 + r] = scale_pair(e2m1_pair_sat6(y2, y3), hw, r);
    }
  }
}

/* The online-softmax step of SPEC 4.5 for scores already in log2 units (scaled, corrected,
 * masked) whose tile row maxima t are tmax (r = 0: row g, 1: row g + 8; the maximum over the whole
 * 128-key tile, which may be wider than the NT x 8 keys this warp holds):
 *   out: pa = P^q as exact FP16 A fragments, 16-key block kb in pa[kb];
 *        alpha = exp(m_old - m_new) and gsc = exp(t - m_new) / 2688 per row,
 *        so that O = alpha O + gsc dV (P^q V^); st.l gets this lane's part of the tile's sum. */
template <int NT>
__device__ __forceinline__ void softmax_step_p(const float (&tmax)[2], const float (&s)[NT][4],
                                               const float (&bm)[NT / 2][2], SoftmaxState &st,
                                               float (&alpha)[2], float (&gsc)[2],
                                               uint32_t (&pa)[NT / 2][4]) {
  float toff[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float mnew = fmaxf(st.m[r], tmax[r]);
    const bool empty = tmax[r] == -INFINITY;
    alpha[r] = st.m[r] == -INFINITY ? 0.0f : fast_exp2(st.m[r] - mnew);
    const float beta = empty ? 0.0f : fast_exp2(tmax[r] - mnew);
    gsc[r] = beta * (1.0f / FP4ATTN_NVFP4_RANGE);
    toff[r] = (empty ? 0.0f : tmax[r]) - kLog2_2688; /* Pq = 2688 exp2(x - t) = exp2(x - toff) */
    st.m[r] = mnew;
  }
  float rsum[2];
  quantize_p_blocks(s, bm, toff, pa, rsum);
#pragma unroll
  for (int r = 0; r < 2; ++r) st.l[r] = fmaf(alpha[r], st.l[r], gsc[r] * rsum[r]);
}

/* Scores of one 128-key tile (raw FP16-MMA accumulators Q^ K^T, see tile_scores_log2) -> P^q
 * fragments, updating m and l, for a caller that accumulates P^q V^ of the tile separately
 * (outputs as softmax_step_p). SPEC 4.4-4.5 in log2 units. */
__device__ __forceinline__ void softmax_quantize_p(const fp4attn_attention_params &p,
                                                   const WarpRows &w, int64_t j0, float cqk,
                                                   const float *bias, float (&s)[16][4],
                                                   SoftmaxState &st, float (&alpha)[2],
                                                   float (&gsc)[2], uint32_t (&pa)[8][4]) {
  tile_scores_log2(p, w, j0, cqk, bias, s);
  float bm[8][2];
  block_maxima(s, bm);
  const float tmax[2] = {tile_row_max(bm, 0), tile_row_max(bm, 1)};
  softmax_step_p(tmax, s, bm, st, alpha, gsc, pa);
}

/* A tile whose row maximum t lies this far (log2 units) below the running maximum m adds at most
 * 128 * 2^-64 to l >= 1 (the maximum's own term): nothing in FP32. Such rows are skipped by the
 * in-place accumulation, which keeps its O scale within 2^64 of exp2(m). */
constexpr float kNegligibleLog2 = 64.0f;

/* Online-softmax state of a caller that accumulates P^q V^ in place, O_acc += P^q V^ (wgmma
 * accumulators): the true O (SPEC 4.5) is O_acc * exp2(ref - m) dV / 2688, where ref is the row
 * maximum t of the last tile that contributed. */
struct InPlaceSoftmaxState : SoftmaxState {
  float ref[2];
};

/* The online-softmax step of one tile for in-place accumulation, in two phases so that the first
 * can run while the previous tile's P^q V^ is still on the tensor cores (it touches only s and
 * the statistics) and the second, which writes the P^q fragments, after it.
 *
 * Before P^q V^ of this tile is added, O_acc must be multiplied by ofac = exp2(ref - t) per row
 * (then ref = t), since
 *   O = alpha O + (beta/2688) dV P^qV^  with alpha = exp2(m_old - m_new), beta = exp2(t - m_new)
 * becomes, dividing by exp2(t - m_new) dV / 2688, O_acc = exp2(ref - t) O_acc + P^q V^. The FP4
 * operands stay exact; the first-level scale lives only in FP32 (ofac, the epilogue's factor).
 * Rows the tile does not reach (fully masked, or negligible as above) get P^q = 0 and ofac = 1. */
struct TileStats {
  float bm[8][2];                           /* block maxima of the log2 scores */
  float toff[2], alpha[2], lsc[2], ofac[2]; /* per row g, g + 8 */
};

/* Phase 1: scores in log2 units (tile_scores_log2), block maxima, m, ref and the factors. */
template <MaskPath kMasks>
__device__ __forceinline__ void softmax_tile_stats(const fp4attn_attention_params &p,
                                                   const WarpRows &w, int64_t j0, float cqk,
                                                   const float *bias, float (&s)[16][4],
                                                   InPlaceSoftmaxState &st, TileStats &ts) {
  tile_scores_log2<kMasks>(p, w, j0, cqk, bias, s);
  block_maxima(s, ts.bm);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float tmax = tile_row_max(ts.bm, r);
    const float mnew = fmaxf(st.m[r], tmax);
    const bool used = tmax != -INFINITY && tmax >= mnew - kNegligibleLog2;
    ts.alpha[r] = st.m[r] == -INFINITY ? 0.0f : fast_exp2(st.m[r] - mnew);
    ts.lsc[r] = used ? fast_exp2(tmax - mnew) * (1.0f / FP4ATTN_NVFP4_RANGE) : 0.0f;
    ts.ofac[r] = !used ? 1.0f : st.ref[r] == -INFINITY ? 0.0f : fast_exp2(st.ref[r] - tmax);
    ts.toff[r] = used ? tmax - kLog2_2688 : INFINITY; /* Pq = 2688 exp2(x - t) = exp2(x - toff) */
    if (used) st.ref[r] = tmax;
    st.m[r] = mnew;
  }
}

/* Phase 2: P^q fragments (quantize_p_blocks) and l. */
__device__ __forceinline__ void softmax_tile_finish(const float (&s)[16][4], const TileStats &ts,
                                                    InPlaceSoftmaxState &st, uint32_t (&pa)[8][4]) {
  float rsum[2];
  quantize_p_blocks(s, ts.bm, ts.toff, pa, rsum);
#pragma unroll
  for (int r = 0; r < 2; ++r) st.l[r] = fmaf(ts.alpha[r], st.l[r], ts.lsc[r] * rsum[r]);
}

/* O_acc *= ofac per row (rows g and g+8); nothing when the factor is 1 for the whole warp. */
template <int NO>
__device__ __forceinline__ void rescale_rows(float (&o)[NO][4], const float (&ofac)[2]) {
  if (__all_sync(0xffffffffu, ofac[0] == 1.0f && ofac[1] == 1.0f)) return;
#pragma unroll
  for (int n = 0; n < NO; ++n) {
    o[n][0] *= ofac[0];
    o[n][1] *= ofac[0];
    o[n][2] *= ofac[1];
    o[n][3] *= ofac[1];
  }
}

/* O[n0 + n] = alpha O[n0 + n] + (beta/2688) dV acc[n] for NB 8-column groups (acc = P^q V^ of
 * this tile, gv = beta/2688 dV per row). Once the running maxima settle, alpha is 1 for every
 * row of the warp and the update is one FMA per element (the test is warp-uniform). */
template <int NO, int NB>
__device__ __forceinline__ void rescale_accumulate(float (&o)[NO][4], int n0,
                                                   const float (&acc)[NB][4],
                                                   const float (&alpha)[2], float gv0, float gv1) {
  if (__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) {
#pragma unroll
    for (int n = 0; n < NB; ++n) {
      o[n0 + n][0] = fmaf(gv0, acc[n][0], o[n0 + n][0]);
      o[n0 + n][1] = fmaf(gv0, acc[n][1], o[n0 + n][1]);
      o[n0 + n][2] = fmaf(gv1, acc[n][2], o[n0 + n][2]);
      o[n0 + n][3] = fmaf(gv1, acc[n][3], o[n0 + n][3]);
    }
    return;
  }
#pragma unroll
  for (int n = 0; n < NB; ++n) {
    o[n0 + n][0] = fmaf(alpha[0], o[n0 + n][0], gv0 * acc[n][0]);
    o[n0 + n][1] = fmaf(alpha[0], o[n0 + n][1], gv0 * acc[n][1]);
    o[n0 + n][2] = fmaf(alpha[1], o[n0 + n][2], gv1 * acc[n][2]);
    o[n0 + n][3] = fmaf(alpha[1], o[n0 + n][3], gv1 * acc[n][3]);
  }
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_TILE_SOFTMAX_CUH */
