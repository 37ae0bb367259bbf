/*
 * The per-warp part of the FP4 attention forward that both FP16-operand kernels share: the
 * mma.sync kernel (attention_fwd.cuh, sm_80/86/89/90) and the Hopper wgmma kernel
 * (hopper/attention_fwd_sm90.cuh). Both hold one warp's 16 query rows x 128 keys of S in the
 * m16n8k16 accumulator layout (wgmma m64nNk16 gives each warp of the warpgroup exactly that
 * layout for its 16 rows), so the score epilogue, the online softmax with two-level P
 * quantization (SPEC 4.5) and the output epilogue (SPEC 4.6) are written once, here.
 *
 * Accumulator layout of one warp: s[n][e] is row g + 8*(e >> 1), key 8n + 2t + (e & 1), with
 * g = lane / 4 and t = lane % 4. The A-operand fragment of P for 16-key block kb is
 * {s[2kb][0..1], s[2kb][2..3], s[2kb+1][0..1], s[2kb+1][2..3]} packed to half2: no shuffles.
 */
#ifndef FP4ATTN_CUDA_ATTENTION_TILE_CUH
#define FP4ATTN_CUDA_ATTENTION_TILE_CUH

#include "attention.cuh"
#include "quantize_fast.cuh"

namespace fp4attn_cuda {

constexpr float kLog2_2688 = 11.392317422778760f; /* log2(2688) */
constexpr float kLog2_6 = 2.5849625007211562f;     /* log2(6) */
constexpr float kLn2 = 0.69314718055994531f;

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/* E4M3 block scales of two P blocks (rows g and g+8) from their maxima over 6, u = max Pq / 6:
 * s = rne_e4m3_sat(u) as floats (sv) and as the FP16 pair (s_g, s_g+8) (hw). u comes from one
 * exp2 with log2(6) folded into its offset, within a few units in the last place of max Pq / 6, so
 * the E4M3 rounding can differ from SPEC 2 only next to an exact tie. */
__device__ __forceinline__ void block_scales(float u0, float u1, float (&sv)[2], uint32_t &hw) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __nv_fp8x2_storage_t b2 = __nv_cvt_float2_to_fp8x2(make_float2(u0, u1), __NV_SATFINITE, __NV_E4M3);
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
  const __half2 r2 = __hmul2(*reinterpret_cast<const __half2 *>(&code2), r == 0 ? __low2half2(h) : __high2half2(h));
  return *reinterpret_cast<const uint32_t *>(&r2);
}

/* The query rows of work item `item` (a CUDA block, or one item of a persistent block):
 * (batch, query head) bh = (b, h), its KV head hk (bhk), the first row q0 of its `rows`-row block,
 * and how many 128-key tiles it visits. Items run over B x Hq x ceil(Nq / rows) in groups of
 * `group_heads` consecutive (batch, query head)s, so that blocks running at the same time share
 * their K/V in L2; within a group the query block is the slow index and the head the fast one.
 * Query blocks in reverse when causal: the longest items first, the shortest fill the tail.
 * group_heads = 1 is the head-major order (the kernels that pass a literal 1 compile to it);
 * w.item_heads (causal_item_heads) spreads the longest items over the heads of a group. */
struct QueryBlock {
  int64_t bh, b, h, hk, bhk, q0;
  int ntiles;
};

/* Index is the type of the decode's arithmetic. 32-bit is exact (fewer than 2^31 items:
 * launch_forward, so the item, the (batch, query head) index and every factor below fit) and
 * faster: in the one-item-per-block sm90 kernel all threads wait for thread 0's decode, which took
 * 0.6 us per item with 64-bit divisions and 0.4 us with 32-bit ones (trace_sm90.cu, v23). The
 * persistent D=64 kernel keeps 64-bit: its consumer loop's schedule moves with this code (the
 * 32-bit decode there measured -2..-12 % at N >= 4K, docs/results/h200_s23/). */
template <typename Index = uint32_t>
__device__ __forceinline__ QueryBlock query_block(const fp4attn_attention_params &p,
                                                  const AttnWorkspace &w, int rows, int64_t item,
                                                  int64_t group_heads) {
  QueryBlock k;
  const Index nqt = (Index)query_blocks_per_head(p, rows), it = (Index)item;
  Index bh, qt;
  if (group_heads == 1) {
    bh = it / nqt;
    qt = it % nqt;
  } else { /* 32-bit either way */
    const uint32_t G = (uint32_t)group_heads, per_group = G * (uint32_t)nqt;
    const uint32_t group = (uint32_t)it / per_group, r = (uint32_t)it - group * per_group;
    const uint32_t q = r / G;
    bh = (Index)group * G + (r - q * G);
    qt = q;
  }
  if (p.causal) qt = nqt - 1 - qt;
  const Index hq = (Index)p.heads_q, b = bh / hq, h = bh % hq;
  const Index hk = h / (hq / (Index)p.heads_kv);
  k.bh = bh;
  k.b = b;
  k.h = h;
  k.hk = hk;
  k.bhk = (int64_t)b * p.heads_kv + hk;
  k.q0 = (int64_t)qt * rows;
  int64_t ntiles = w.nkt;
  if (p.causal) ntiles = min(ntiles, (min(k.q0 + rows, p.len_q) - 1) / kTile + 1);
  k.ntiles = (int)ntiles;
  return k;
}

/* Where one warp's 16 rows sit: (batch, query head) and the query row of accumulator row 0. */
struct WarpRows {
  int64_t b, h, row0;
};

/* Online-softmax state of a warp's rows g and g+8 (this lane's partial sums of l). */
struct SoftmaxState {
  float m[2], l[2];
};

/* Whether the 128-key tile at j0 needs a mask (key padding, causal, attn_mask) for any query row
 * from row0 on. */
__device__ __forceinline__ bool tile_has_masks(const fp4attn_attention_params &p, int64_t j0, int64_t row0) {
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
__device__ __forceinline__ void mask_causal_tail(const fp4attn_attention_params &p, const WarpRows &w,
                                                 int64_t j0, float (&s)[16][4]) {
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
          add = load_as_float(p.mask, p.mask_dtype, off) * 1.4426950408889634f;
      }
      s[n][e] = ok ? s[n][e] + add : -INFINITY;
    }
}

/* Scores of one 128-key tile (starting at key j0) in log2 units, in place:
 *   s = scale*log2e*(dQ dK acc + qbar.K) (+ mask), with bias[key] = scale*log2e*(qbar . K[key])
 *   and cqk = scale*log2e*dQ*dK. Masks: causal (top-left), bool/additive attn_mask, key padding. */
template <MaskPath kMasks = MaskPath::kAll>
__device__ __forceinline__ void tile_scores_log2(const fp4attn_attention_params &p, const WarpRows &w,
                                                 int64_t j0, float cqk, const float *bias,
                                                 float (&s)[16][4]) {
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
 * exp2 is monotonic, so exp2(bm - off) is the block maximum of Pq without a pass over Pq. */
__device__ __forceinline__ void block_maxima(const float (&s)[16][4], float (&bm)[8][2]) {
#pragma unroll
  for (int kb = 0; kb < 8; ++kb)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      bm[kb][r] = fmaxf(fmaxf(s[2 * kb][2 * r], s[2 * kb][2 * r + 1]),
                        fmaxf(s[2 * kb + 1][2 * r], s[2 * kb + 1][2 * r + 1]));
#pragma unroll
  for (int kb = 0; kb < 8; ++kb)
#pragma unroll
    for (int r = 0; r < 2; ++r) bm[kb][r] = fmaxf(bm[kb][r], __shfl_xor_sync(0xffffffffu, bm[kb][r], 1));
#pragma unroll
  for (int kb = 0; kb < 8; ++kb)
#pragma unroll
    for (int r = 0; r < 2; ++r) bm[kb][r] = fmaxf(bm[kb][r], __shfl_xor_sync(0xffffffffu, bm[kb][r], 2));
}

__device__ __forceinline__ float tile_row_max(const float (&bm)[8][2], int r) {
  float tmax = bm[0][r];
#pragma unroll
  for (int kb = 1; kb < 8; ++kb) tmax = fmaxf(tmax, bm[kb][r]);
  return tmax;
}

/* phi_local of Pq = exp2(s - toff) per 16-key block, fused into the exponential: with the block
 * scale s = rne_e4m3_sat(max Pq / 6), Pq / s = exp2(x - (toff + log2 s)), so one exp2 per score
 * gives the value to round onto the E2M1 grid (toff = +inf: everything is 0). Returns this
 * lane's part of the row sums of Pq (unquantized, SPEC 4.5) as s * sum(Pq / s); P^q = code * s is
 * exact in FP16. The approximate exp2/log2 move Pq / s by a few units in the last place, which
 * changes its E2M1 code only when it sits on a rounding tie: the same kind of difference the
 * approximate exp always made, within SPEC 4's rel_l1 < 2e-3 against the reference. */
__device__ __forceinline__ void quantize_p_blocks(const float (&s)[16][4], const float (&bm)[8][2],
                                                  const float (&toff)[2], uint32_t (&pa)[8][4],
                                                  float (&rsum)[2]) {
  rsum[0] = rsum[1] = 0.0f;
  const float toff6[2] = {toff[0] + kLog2_6, toff[1] + kLog2_6}; /* exp2(x - toff6) = Pq / 6 */
#pragma unroll
  for (int kb = 0; kb < 8; ++kb) {
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

/* Scores of one 128-key tile (raw FP16-MMA accumulators Q^ K^T, see tile_scores_log2) -> P^q
 * fragments, updating m and l, for a caller that accumulates P^q V^ of the tile separately:
 *   out: pa = P^q as exact FP16 A fragments, 16-key block kb in pa[kb];
 *        alpha = exp(m_old - m_new) and gsc = exp(t - m_new) / 2688 per row (r = 0: g, 1: g+8),
 *        so that O = alpha O + gsc dV (P^q V^).
 * SPEC 4.4-4.5 in log2 units. */
__device__ __forceinline__ void softmax_quantize_p(const fp4attn_attention_params &p,
                                                   const WarpRows &w, int64_t j0, float cqk,
                                                   const float *bias,
                                                   float (&s)[16][4], SoftmaxState &st,
                                                   float (&alpha)[2], float (&gsc)[2],
                                                   uint32_t (&pa)[8][4]) {
  tile_scores_log2(p, w, j0, cqk, bias, s);
  float bm[8][2];
  block_maxima(s, bm);
  float toff[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float tmax = tile_row_max(bm, r);
    const float mnew = fmaxf(st.m[r], tmax);
    const bool empty = tmax == -INFINITY;
    alpha[r] = st.m[r] == -INFINITY ? 0.0f : fast_exp2(st.m[r] - mnew);
    const float beta = empty ? 0.0f : fast_exp2(tmax - mnew);
    gsc[r] = beta * (1.0f / FP4ATTN_NVFP4_RANGE);
    toff[r] = (empty ? 0.0f : tmax) - kLog2_2688; /* Pq = 2688 exp2(x - t) = exp2(x - toff) */
    st.m[r] = mnew;
  }
  float rsum[2];
  quantize_p_blocks(s, bm, toff, pa, rsum);
#pragma unroll
  for (int r = 0; r < 2; ++r) st.l[r] = fmaf(alpha[r], st.l[r], gsc[r] * rsum[r]);
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
  float bm[8][2];                        /* block maxima of the log2 scores */
  float toff[2], alpha[2], lsc[2], ofac[2]; /* per row g, g + 8 */
};

/* Phase 1: scores in log2 units (tile_scores_log2), block maxima, m, ref and the factors. */
template <MaskPath kMasks>
__device__ __forceinline__ void softmax_tile_stats(const fp4attn_attention_params &p, const WarpRows &w,
                                                   int64_t j0, float cqk, const float *bias,
                                                   float (&s)[16][4], InPlaceSoftmaxState &st,
                                                   TileStats &ts) {
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
__device__ __forceinline__ void rescale_accumulate(float (&o)[NO][4], int n0, const float (&acc)[NB][4],
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

/* SPEC 4.6, the factor of each of a warp's rows g, g+8 (r = 0, 1): O / l with O = omul * o, 0 for
 * rows without visible keys. Sums l over the quad first (st.l is then the row's l). */
__device__ __forceinline__ void row_factors(SoftmaxState &st, const float (&omul)[2], float (&inv)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 1);
    st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 2);
    inv[r] = st.l[r] > 0.0f ? omul[r] * (1.0f / st.l[r]) : 0.0f;
  }
}

/* The LSE of a warp's rows, m ln2 + log l + scale (q - qbar).kbar, when requested (after
 * row_factors). qbar: this block's query mean (any memory), kbar: the key mean of the KV head. */
__device__ __forceinline__ void store_lse(const AttnArgs &a, const WarpRows &w, int64_t bh, const SoftmaxState &st,
                                          const float *qbar, const float *kbar) {
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
      const float lse = st.l[r] > 0.0f ? st.m[r] * kLn2 + logf(st.l[r]) + p.scale * sh : -INFINITY;
      p.lse[bh * p.len_q + qi] = lse;
    }
  }
}

/* SPEC 4.6 for one warp's rows: O / l with O = omul * o per row (rows without visible keys -> 0)
 * cast to the output dtype, and the LSE (store_lse). Any output layout and dtype: stores straight
 * from the accumulator layout (4 or 8 bytes per store, 8 rows per warp instruction). */
template <int DP>
__device__ __forceinline__ void store_rows(const AttnArgs &a, const WarpRows &w, int64_t bh,
                                           const float (&o)[DP / 8][4], const float (&omul)[2],
                                           SoftmaxState &st, const float *qbar, const float *kbar) {
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
#pragma unroll
      for (int n = 0; n < DP / 8; ++n) {
        const int d = n * 8 + 2 * t;
        const float v0 = o[n][2 * r] * inv[r], v1 = o[n][2 * r + 1] * inv[r];
        if (d + 1 < D)
          store2_from_float(p.out, p.dtype, ob + d, v0, v1, a.out_pair);
        else if (d < D)
          store_from_float(p.out, p.dtype, ob + d, v0);
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
                                                  const float (&o)[DP / 8][4], const float (&omul)[2],
                                                  SoftmaxState &st, const float *qbar, const float *kbar,
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
#pragma unroll
    for (int n = 0; n < kChunks; ++n) {
      const float v0 = o[n][2 * r] * inv[r], v1 = o[n][2 * r + 1] * inv[r];
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
      const uint4 v = *reinterpret_cast<const uint4 *>(stage + row * (DP / 2) + ((chunk ^ (row & 7)) * 4));
      const int64_t off = w.b * p.out_stride[0] + w.h * p.out_stride[1] + qi * p.out_stride[2] + chunk * 8;
      *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(p.out) + off) = v;
    }
  }
  store_lse(a, w, bh, st, qbar, kbar);
}

/* bias[key] = scale * log2(e) * (qbar . K[tok0 + key]) for one key per thread group of TPK
 * threads (PER = DP / TPK columns each), K in input precision, FP32 FMAs (SPEC 4.4). All of a
 * thread's loads are issued before the first FMA (one L2 round trip per tile, not eight).
 * `key`/`part` select this thread's work; the TPK partial sums are combined by shuffles, so the
 * TPK threads of a key must be adjacent lanes. */
template <int DP, int TPK>
__device__ __forceinline__ void compute_bias(const AttnArgs &a, int64_t b, int64_t hk, int64_t tok,
                                             int part, const float *qbar, float *bias_out) {
  const fp4attn_attention_params &p = a.p;
  constexpr int PER = DP / TPK; /* columns per thread (zeros past D) */
  const int D = (int)p.head_dim;
  const int c0 = part * PER;
  float acc = 0.0f;
  if (tok < p.len_k) {
    const int64_t base = b * p.k_stride[0] + hk * p.k_stride[1] + tok * p.k_stride[2];
    if (a.vec_k && p.dtype != FP4ATTN_FLOAT32) {
      constexpr int G = PER / 8 < 8 ? PER / 8 : 8; /* 16-byte loads in flight per batch */
      const uint16_t *kp = static_cast<const uint16_t *>(p.k) + base;
      const bool bf = p.dtype == FP4ATTN_BFLOAT16;
#pragma unroll
      for (int g0 = 0; g0 < PER / 8; g0 += G) {
        uint4 raw[G];
#pragma unroll
        for (int i = 0; i < G; ++i) {
          const int d = c0 + 8 * (g0 + i);
          raw[i] = d < D ? __ldg(reinterpret_cast<const uint4 *>(kp + d)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < G; ++i) {
          const int d = c0 + 8 * (g0 + i);
          const uint32_t wv[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float2 f;
            if (bf) {
              f.x = __uint_as_float(wv[e] << 16);
              f.y = __uint_as_float(wv[e] & 0xFFFF0000u);
            } else {
              f = __half22float2(*reinterpret_cast<const __half2 *>(&wv[e]));
            }
            acc = fmaf(qbar[d + 2 * e], f.x, acc);
            acc = fmaf(qbar[d + 2 * e + 1], f.y, acc);
          }
        }
      }
    } else {
      for (int d = c0; d < min(D, c0 + PER); d += 8) {
        float v[8];
        load8_padded(p.k, p.dtype, base, d, D, a.vec_k, v);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(qbar[d + e], v[e], acc);
      }
    }
  }
#pragma unroll
  for (int o = 1; o < TPK; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (part == 0) *bias_out = acc * a.scale_log2;
}

/* The q-mean correction on the tensor cores, for one warp and 32 keys (SPEC 4.4: qbar . K with K in
 * input precision, FP32 accumulation). qbar (FP32) is split into parts exactly representable in
 * K's 16-bit type (FP16: 2 parts of 11 bits, qbar = p0 + p1 to 2^-22 relative, or 2^-25 absolute
 * below FP16's normal range; BF16: 3 parts of 8 bits, all 24 bits of qbar), each part in its own
 * row of the A operand of mma.m16n8k16; every product part x K is exact in FP32, the MMA sums them
 * in FP32, and the rows are added in FP32. This replaces 2 x DP FP32
 * instructions per key (convert + FMA) by DP/16 MMAs per 8 keys. Needs 16-byte loads (vec_k) and a
 * 16-bit dtype; compute_bias covers the rest.
 *
 * Fragment mapping (g = lane / 4, t = lane % 4): lane t loads 8-column chunks c = 4i + t of key
 * g's row; k16 step m uses chunk 4 (m / 2) + t, half m % 2, so the step's reduction index k = 2t + e
 * (b0) is column 8c + 4 (m % 2) + e and k = 2t + 8 + e (b1) is column 8c + 4 (m % 2) + 2 + e. */
template <int DP, bool kBf16>
struct BiasMma {
  static constexpr int kSteps = DP / 16;
  static constexpr int kChunks = DP / 32; /* 16-byte chunks per lane and key */
  uint32_t afrag[kSteps][2];              /* A fragment words a0, a2 of every k16 step (a1 = a3 = 0) */
  const char *kchunk;                     /* chunk 0 (columns 8t..) of K row key0 + g of tile 0, (b, hk) */
  int64_t row_bytes;                      /* from one key's row to the next */
  int64_t rows_left;                      /* len_k - (key0 + g): keys from that row on that exist */
  uint32_t chunk_ok;                      /* bit i: this lane's chunk i lies inside the head dim */

  /* The A fragments from qbar (DP floats, zero past D) and this lane's K addressing for the warp's
   * 32 keys key0 .. key0 + 31 of every tile. */
  __device__ void init(const AttnArgs &a, int64_t b, int64_t hk, int key0, const float *qbar) {
    const fp4attn_attention_params &p = a.p;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nparts = kBf16 ? 3 : 2;
#pragma unroll
    for (int m = 0; m < kSteps; ++m)
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        const int col = 8 * (4 * (m >> 1) + t) + 4 * (m & 1) + 2 * w;
        uint32_t word = 0;
        if (g < nparts) word = part_bits(qbar[col], g) | (part_bits(qbar[col + 1], g) << 16);
        afrag[m][w] = word;
      }
    row_bytes = 2 * p.k_stride[2];
    kchunk = static_cast<const char *>(p.k) + 2 * (b * p.k_stride[0] + hk * p.k_stride[1]) + (key0 + g) * row_bytes + 16 * t;
    rows_left = p.len_k - (key0 + g);
    chunk_ok = 0;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) chunk_ok |= (8 * (4 * i + t) < (int)p.head_dim ? 1u : 0u) << i;
  }

  /* Part `idx` of x: x = p0 + p1 (+ p2) with each part the rounding of what the earlier ones left. */
  __device__ static uint32_t part_bits(float x, int idx) {
    uint32_t bits = 0;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      float part;
      if (kBf16) {
        const __nv_bfloat16 h = __float2bfloat16_rn(x);
        part = __bfloat162float(h);
        if (i == idx) bits = __bfloat16_as_ushort(h);
      } else {
        const __half h = __float2half_rn(x);
        part = __half2float(h);
        if (i == idx) bits = __half_as_ushort(h);
      }
      x = x - part; /* exact: part is x rounded to fewer bits (|x| <= 65504 for FP16 inputs) */
    }
    return bits;
  }

  /* bias[8n + j] = scale log2e (qbar . K[key]) for key = tile * 128 + key0 + 8n + j, n < 4, j < 8
   * (keys past len_k: 0), in two steps: load() issues all 4 x kChunks loads of this lane's K
   * chunks, so that the caller can wait for something else while they are on their way; finish()
   * runs the MMAs (the four 8-key accumulators are independent chains, interleaved step by step)
   * and stores the bias. */
  struct Keys {
    uint4 kv[4][kChunks];
  };

  __device__ void load(int tile, Keys &keys) const {
    const int64_t left = rows_left - (int64_t)tile * kTile; /* keys of this lane's rows that exist */
    const char *kp = kchunk + (int64_t)tile * kTile * row_bytes;
    const int64_t step = 8 * row_bytes; /* rows g, g + 8, g + 16, g + 24 */
    uint4(&kv)[4][kChunks] = keys.kv;
    if (left >= 32 && chunk_ok == (1u << kChunks) - 1) { /* every tile but a key-padded last one */
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int i = 0; i < kChunks; ++i) kv[n][i] = __ldg(reinterpret_cast<const uint4 *>(kp + n * step + 64 * i));
    } else {
      const int nleft = left < 0 ? 0 : (int)min(left, (int64_t)32);
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int i = 0; i < kChunks; ++i)
          kv[n][i] = 8 * n < nleft && (chunk_ok >> i & 1u) ? __ldg(reinterpret_cast<const uint4 *>(kp + n * step + 64 * i))
                                                           : make_uint4(0, 0, 0, 0);
    }
  }

  __device__ void finish(const AttnArgs &a, const Keys &keys, float *bias) const {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const uint4(&kv)[4][kChunks] = keys.kv;
    float c[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
#pragma unroll
    for (int m = 0; m < kSteps; ++m) {
      const uint32_t af[4] = {afrag[m][0], 0u, afrag[m][1], 0u};
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const uint4 &q = kv[n][m >> 1];
        mma_16816<kBf16>(c[n], af, (m & 1) ? q.z : q.x, (m & 1) ? q.w : q.y);
      }
    }
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      /* row r of C (part r) for keys 8n + 2t, 8n + 2t + 1 sits in lane 4r + t: c[0], c[1] */
      float v0 = c[n][0] + __shfl_down_sync(0xffffffffu, c[n][0], 4);
      float v1 = c[n][1] + __shfl_down_sync(0xffffffffu, c[n][1], 4);
      if (kBf16) {
        v0 += __shfl_down_sync(0xffffffffu, c[n][0], 8);
        v1 += __shfl_down_sync(0xffffffffu, c[n][1], 8);
      }
      if (g == 0) *reinterpret_cast<float2 *>(bias + 8 * n + 2 * t) = make_float2(v0 * a.scale_log2, v1 * a.scale_log2);
    }
  }
};

/* Quantize query rows [q0, q0 + rows) of (b, h) (SPEC 4.2-4.3: Q - qbar, global scale, phi
 * along D) and store the exact FP16 values through store16(row, col, 8 words). Thread `tid` of
 * `nthreads` takes the 16-column blocks tid, tid + nthreads, ...; kBatch of them load before
 * any is quantized, so that a thread with many blocks waits for memory once per batch. */
template <int DP, int kBatch = 1, typename Store16>
__device__ __forceinline__ void quantize_q_rows(const AttnArgs &a, int64_t b, int64_t h, int64_t bh,
                                                int64_t q0, int rows, const float *qbar, int tid,
                                                int nthreads, Store16 store16) {
  const fp4attn_attention_params &p = a.p;
  const float encq = a.ws.qscale[bh * 2 + 0];
  const int D = (int)p.head_dim;
  constexpr int KB = DP / 16;
  for (int job0 = tid; job0 < rows * KB; job0 += nthreads * kBatch) {
    float xs[kBatch][16];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int job = job0 + i * nthreads, r = job / KB, kb = job % KB;
      const int64_t row = q0 + r;
      if (job < rows * KB && row < p.len_q && kb * 16 < D) {
        const int64_t base = b * p.q_stride[0] + h * p.q_stride[1] + row * p.q_stride[2];
        smoothed_block16(p.q, p.dtype, base, kb, D, a.vec_q, qbar + kb * 16, encq, xs[i]);
      } else {
#pragma unroll
        for (int e = 0; e < 16; ++e) xs[i][e] = 0.0f;
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int job = job0 + i * nthreads;
      if (job < rows * KB) {
        uint32_t o[8];
        quantize_block16(xs[i], o);
        store16(job / KB, job % KB * 16, o);
      }
    }
  }
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_ATTENTION_TILE_CUH */
