/*
 * Fused split-KV decode of plain attention calls (SPEC 4 with few query rows): no pre-pass, K and V
 * are read in their input dtype and quantized in registers. Three kernels:
 *
 * 1. sdpa_decode_stats_kernel, grid (B x Hkv, chunks): per chunk of chunk_len tokens of one
 *    (batch, KV head), the FP32 column sums, minima and maxima of K and max |V|, into the
 *    workspace (sdpa_decode.h). Thread (rg, cg) reads 16-byte groups of 8 columns of rows rg,
 *    rg + RG, ... (RG x CG = 256 threads, CG = Dp / 8) in increasing order; the RG partial sums are
 *    added in rg order. Nothing is atomic, so the results are deterministic.
 *
 * 2. sdpa_decode_attn_kernel, grid (m-tiles, splits), NW warps (8; 4 at Dp = 256). An m-tile holds
 * 16 query rows of one (batch b, KV head hk): row R = 16 mt + r is query head hk * G + R / len_q at
 * position R % len_q (G = Hq / Hkv), so all heads of a GQA group share every key the block reads.
 * The prologue finishes the statistics: kbar = (chunk sums added in chunk order) / Nk, the amax of
 *    K - kbar from the column minima and maxima (max |fl(x - c)| = max(|fl(max x - c)|,
 *    |fl(c - min x)|), rounding being monotone), max |V|, their global scales (SPEC 2); and the
 *    query side per head of the tile: qbar (its len_q rows, one query block, SPEC 4.2), the amax
 *    of Q - qbar and its scales, Q^ = phi(Q - qbar) as exact FP16 values in shared memory, and
 *    qbar split into 16-bit parts (BiasMma::part_bits) for the correction qbar . K on the tensor
 *    cores. Then the split's 128-key tiles (the Bkv of SPEC 4.5): K and V tiles [128][Dp] are
 *    copied raw (cp.async, zero-filled past Nk and past head_dim, XOR-swizzled, double-buffered up
 *    to Dp = 128). Warp w owns keys KW w .. KW w + KW - 1 of a tile (KW = 128 / NW):
 *      - raw K B-fragments by ldmatrix: lane (g, t) holds key g, columns 2t, 2t+1, 2t+8, 2t+9 of
 *        a 16-column block, so the quad holds the block (SPEC 2 along D: its max in 2 shuffles);
 *        K^ = phi((K - kbar) * encK) in registers (quantize_quad_bounded), S = Q^ K^T on
 *        mma.sync FP16, and the correction qbar . K = sum of parts x raw K, on mma.sync in K's
 *        dtype (every product exact, FP32 accumulation);
 *      - S * scale * dQ dK + scale * qbar . K in log2 units, causal (top-left: query position i
 *        sees keys j <= i) and key padding masks, 16-key block maxima; the tile's row maxima t
 *        over all 128 keys through shared memory (one barrier), then the softmax step and P
 *        quantization of SPEC 4.5 (tile/softmax.cuh, softmax_step_p);
 *      - raw V B-fragments by ldmatrix.trans: lane (g, t) holds channel g, keys 2t, 2t+1, 2t+8,
 *        2t+9 of a 16-key block, so V^ = phi(V^T * encV) along tokens quantizes per quad too;
 *        O = alpha O + (exp(t - m) / 2688) dV (P^q V^).
 *    Every warp sees the same tile maxima, so the warps' m agree and their O and l add up. The
 *    split writes its O, m (log2 units) and l per row, and split 0 the LSE term
 *    scale * (Q_r - qbar) . kbar.
 *
 * 3. split_merge_kernel (split_merge.cuh, shared with the KV-cache decode), a block per row:
 *    the splits merged by their maxima, O / l in the input dtype and
 *    lse = m ln2 + log l + scale * (Q_r - qbar) . kbar (SPEC 4.6).
 *
 * Kernels 2 and 3 are programmatic dependents of the kernel before them (launch_dependent): 2
 * starts its first tile's copy before 1 ends and waits for it before reading the statistics. Grid
 * sizes follow from the shapes (heuristics.h, sdpa_decode_schedule); nothing waits on the host.
 */
#include <type_traits>

#include "../common/fast_rounding.cuh"
#include "../common/smem_tiles.cuh"
#include "../tile/qmean_bias.cuh"
#include "../tile/softmax.cuh"
#include "../tile/split_merge.cuh"
#include "sdpa_decode.h"

namespace fp4attn_cuda {

namespace {

constexpr int kRows = kDecodeRows;
constexpr int kStatThreads = 256;

struct DecodeArgs {
  fp4attn_attention_params p;
  SdpaDecodeWorkspace w;
  DecodeSchedule d;
  int64_t group; /* G = Hq / Hkv */
  bool vec_q;
  float scale_log2;
};

/* Two 16-bit input values (one 32-bit word, element 0 in the low half) as floats (exact). */
template <bool kBf16>
__device__ __forceinline__ float2 word_to_float2(uint32_t w) {
  if (kBf16) return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  return __half22float2(*reinterpret_cast<const __half2 *>(&w));
}

/* e2m1_round_signed (fast_rounding.cuh) in four instructions instead of five: its constant
 * C = 1.5 * 2^(max(e, 0) + 22) is 1.5 * 2^22 times the power of two 2^max(e, 0) (the exponent bits
 * of max(|y|, 1): one max, one AND), so fma(+-2^max(e, 0), 1.5 * 2^22, .) adds and subtracts C with
 * the same single roundings as y + C and (y + C) - C. The same value for every finite y below
 * 2^100 in magnitude. */
__device__ __forceinline__ float e2m1_round_fma(float y) {
  const float c = __uint_as_float(__float_as_uint(fmaxf(fabsf(y), 1.0f)) & 0x7F800000u);
  return __fmaf_rn(-c, 6291456.0f, __fmaf_rn(c, 6291456.0f, y));
}

/* e4m3_encode_fast (device.cuh) as a 32-bit value: the byte, zero above (no masking needed to
 * index a table with it). */
__device__ __forceinline__ uint32_t e4m3_byte(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t r;
  asm("{.reg .b16 t;\n cvt.rn.satfinite.e4m3x2.f32 t, %2, %1;\n cvt.u32.u16 %0, t;}"
      : "=r"(r)
      : "f"(v), "f"(0.0f));
  return r;
#else
  return e4m3_encode_fast(v);
#endif
}

/* quantize_block16 (fast_rounding.cuh) of one 16-value block held by a quad (4 values per lane),
 * for blocks of real keys of a slice whose global amax is finite: then every |xs| is at most
 * 2688 (1 + 2^-22) (|x - kbar| <= amax K, |x| <= amax V, and xs = x enc with enc = 2688 / amax),
 * far inside the range (max below 2^96) where quantize_block16 takes its fast path, and the
 * bytes are the same. Branch-free, so that the compiler interleaves a tile's independent blocks:
 *  - the scale's reciprocal and FP16 form come from the table tab (e4m3_scale_entry);
 *  - y is rounded first (e2m1_round_fma) and saturated after: for |y| >= 7 the rounding gives 8
 *    or more (its grid point 2^e <= |y|), exactly representable or +-Inf in FP16, which the FP16
 *    clamp to [-6, 6] maps to +-6 like rne_e2m1 of the clamped y; below 7 the clamp changes
 *    nothing. The clamp runs on FP16 pairs (one min and one max per two values).
 * Blocks of other inputs (NaN or Inf, key padding past Nk) get codes that need not match: a
 * non-finite amax makes dK or dV NaN, and then every score of the slice or every output row is
 * NaN whatever the codes; padding keys are masked to -inf before the softmax reads them, and
 * their V rows are zeros. */
__device__ __forceinline__ void quantize_quad_bounded(const float (&xs)[4], const ScaleEntry *tab,
                                                      uint32_t (&o)[2]) {
  float m = max_nan(max_nan(fabsf(xs[0]), fabsf(xs[1])), max_nan(fabsf(xs[2]), fabsf(xs[3])));
  m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, 2));
  const ScaleEntry e = tab[e4m3_byte(div6_e4m3(m))];
  const uint32_t six = 0x46004600u, neg_six = 0xC600C600u; /* FP16 pairs (6, 6), (-6, -6) */
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t c = pack_half2(e2m1_round_fma(__fmul_rn(xs[2 * k], e.r)),
                                  e2m1_round_fma(__fmul_rn(xs[2 * k + 1], e.r)));
    o[k] = h2_mul(h2_min(h2_max(c, neg_six), six), e.s2);
  }
}

/* ============================================================ kernel 1: statistics */

template <typename T, int DP>
__global__ void __launch_bounds__(kStatThreads)
    sdpa_decode_stats_kernel(const __grid_constant__ DecodeArgs a) {
  constexpr int CG = DP / 8, RG = kStatThreads / CG, U = 4; /* U rows in flight per thread */
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  __shared__ float red[3][RG][DP];
  __shared__ float vred[kStatThreads / 32];
  const fp4attn_attention_params &p = a.p;
  const int64_t bhk = blockIdx.x, c = blockIdx.y;
  const int64_t b = bhk / p.heads_kv, hk = bhk % p.heads_kv;
  const int D = (int)p.head_dim, tid = threadIdx.x, rg = tid / CG, cg = tid % CG;
  const bool live = cg * 8 < D;
  grid_dependents_launch(); /* the attention kernel's prologue may start */
  const T *kp = static_cast<const T *>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1] + cg * 8;
  const T *vp = static_cast<const T *>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1] + cg * 8;
  const int64_t r0 = c * a.d.chunk_len, r1 = min(r0 + a.d.chunk_len, p.len_k);
  float sum[8], mn[8], mx[8], vam = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) sum[e] = 0.0f, mn[e] = INFINITY, mx[e] = -INFINITY;
  for (int64_t r = r0 + rg; r < r1; r += U * RG) {
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t row = r + u * RG;
      const bool ok = live && row < r1;
      kr[u] = ok ? __ldcg(reinterpret_cast<const uint4 *>(kp + row * p.k_stride[2]))
                 : make_uint4(0, 0, 0, 0);
      vr[u] = ok ? __ldcg(reinterpret_cast<const uint4 *>(vp + row * p.v_stride[2]))
                 : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!(live && r + u * RG < r1)) continue;
      const uint32_t kw[4] = {kr[u].x, kr[u].y, kr[u].z, kr[u].w};
      const uint32_t vw[4] = {vr[u].x, vr[u].y, vr[u].z, vr[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 kf = word_to_float2<kBf16>(kw[i]), vf = word_to_float2<kBf16>(vw[i]);
        sum[2 * i] = __fadd_rn(sum[2 * i], kf.x);
        sum[2 * i + 1] = __fadd_rn(sum[2 * i + 1], kf.y);
        mn[2 * i] = fminf(mn[2 * i], kf.x);
        mn[2 * i + 1] = fminf(mn[2 * i + 1], kf.y);
        mx[2 * i] = fmaxf(mx[2 * i], kf.x);
        mx[2 * i + 1] = fmaxf(mx[2 * i + 1], kf.y);
        vam = max_nan(vam, max_nan(fabsf(vf.x), fabsf(vf.y)));
      }
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    red[0][rg][cg * 8 + e] = sum[e];
    red[1][rg][cg * 8 + e] = mn[e];
    red[2][rg][cg * 8 + e] = mx[e];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) vam = max_nan(vam, __shfl_xor_sync(0xffffffffu, vam, o));
  if ((tid & 31) == 0) vred[tid >> 5] = vam;
  __syncthreads();
  const int64_t part = bhk * a.d.chunks + c;
  for (int d = tid; d < DP; d += kStatThreads) {
    float s = 0.0f, lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < RG; ++i) {
      s = __fadd_rn(s, red[0][i][d]);
      lo = fminf(lo, red[1][i][d]);
      hi = fmaxf(hi, red[2][i][d]);
    }
    a.w.ksum[part * DP + d] = s;
    a.w.kmin[part * DP + d] = lo;
    a.w.kmax[part * DP + d] = hi;
  }
  if (tid == 0) {
    float m = 0.0f;
    for (int i = 0; i < kStatThreads / 32; ++i) m = max_nan(m, vred[i]);
    a.w.vmax[part] = m;
  }
}

/* ============================================================ kernel 2: split-KV attention */

template <int DP, int NBUF, int NW>
struct AttnSmem {
  static constexpr int kW = 2 * DP;                        /* bytes per 16-bit row of DP values */
  static constexpr int kTileBytes = kTile * kW;            /* one raw K or V tile [128][DP] */
  static constexpr int kK = 0;                             /* NBUF x (K tile, V tile) */
  static constexpr int kQhat = kK + NBUF * 2 * kTileBytes; /* Q^ [16][DP] FP16 */
  static constexpr int kQpart = kQhat + kRows * kW;        /* qbar parts [3][16][DP] */
  static constexpr int kQbar = kQpart + 3 * kRows * kW;    /* f32 [16 heads][DP] */
  static constexpr int kKbar = kQbar + kRows * DP * 4;     /* f32 [DP] */
  static constexpr int kTmax = kKbar + DP * 4;             /* f32 [2][warps][16] */
  static constexpr int kStab = kTmax + 2 * NW * kRows * 4; /* ScaleEntry [256] */
  static constexpr int kScal = kStab + 256 * 8;            /* see Scalars */
  static constexpr int kBytes = kScal + 256;
  static_assert(NW * kRows * (DP + 2) * 4 <= NBUF * 2 * kTileBytes, "merge buffer");
};

struct Scalars {
  float enck, deck, encv, decv;
  float encq[kRows], decq[kRows];
  unsigned int qam[kRows], kam, vam; /* max bits of non-negative floats (NaN above Inf) */
};

template <typename T, int DP, int NBUF, int NW>
struct DecodeKernel {
  using L = AttnSmem<DP, NBUF, NW>;
  static constexpr int kWarps = NW, kThreads = 32 * NW;
  static constexpr int KW = kTile / NW; /* keys per warp and tile: 16 or 32 */
  static constexpr int NT = KW / 8;     /* their 8-key column tiles */
  static constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  static constexpr int kParts = kBf16 ? 3 : 2; /* 16-bit parts of qbar (BiasMma) */
  static constexpr int W = L::kW;

  /* cp.async of raw K and V tile j of (b, hk) into buffer buf, rows past Nk and columns past
   * head_dim zero-filled. Thread i copies 16-byte chunk i % CH of rows i / CH + RS u: one row
   * test and two pointer steps per chunk pair. */
  static __device__ void issue_tile(const DecodeArgs &a, const T *kg, const T *vg, int64_t j,
                                    char *smem, int buf) {
    const fp4attn_attention_params &p = a.p;
    constexpr int CH = DP / 8, RS = kThreads / CH; /* 16-byte chunks per row; rows per pass */
    static_assert(kThreads % CH == 0 && kTile % RS == 0, "whole rows per pass");
    char *kt = smem + L::kK + buf * 2 * L::kTileBytes, *vt = kt + L::kTileBytes;
    const int r0 = threadIdx.x / CH, ch = threadIdx.x % CH;
    const int64_t tok0 = j * kTile + r0;
    /* rows of this thread that exist (none past head_dim) */
    const int64_t avail = ch * 8 < (int)p.head_dim ? p.len_k - tok0 : 0;
    const int rows = (int)(avail < kTile ? avail : kTile);
    const T *kr = kg + tok0 * p.k_stride[2] + ch * 8, *vr = vg + tok0 * p.v_stride[2] + ch * 8;
    const int64_t kstep = RS * p.k_stride[2], vstep = RS * p.v_stride[2];
#pragma unroll
    for (int u = 0; u < kTile / RS; ++u) {
      const bool ok = u * RS < rows;
      const int off = swz_byte<W>(r0 + u * RS, ch * 16);
      cp_async_16_zfill(kt + off, ok ? kr : kg, ok ? 16 : 0);
      cp_async_16_zfill(vt + off, ok ? vr : vg, ok ? 16 : 0);
      kr += kstep;
      vr += vstep;
    }
  }

  /* The statistics of KV head bhk from the chunk partials, into smem (kbar, K and V scales). */
  static __device__ void finish_kv_stats(const DecodeArgs &a, int64_t bhk, char *smem) {
    const fp4attn_attention_params &p = a.p;
    const int D = (int)p.head_dim;
    float *kbar = reinterpret_cast<float *>(smem + L::kKbar);
    Scalars &sc = *reinterpret_cast<Scalars *>(smem + L::kScal);
    const int64_t C = a.d.chunks;
    for (int d = threadIdx.x; d < DP; d += kThreads) {
      float s = 0.0f, lo = INFINITY, hi = -INFINITY;
      const float *ps = a.w.ksum + bhk * C * DP + d, *pl = a.w.kmin + bhk * C * DP + d,
                  *ph = a.w.kmax + bhk * C * DP + d;
      if (d < D) {
        for (int64_t c0 = 0; c0 < C; c0 += 8) {
          float vs[8], vl[8], vh[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const bool ok = c0 + i < C;
            vs[i] = ok ? __ldcg(ps + (c0 + i) * DP) : 0.0f;
            vl[i] = ok ? __ldcg(pl + (c0 + i) * DP) : INFINITY;
            vh[i] = ok ? __ldcg(ph + (c0 + i) * DP) : -INFINITY;
          }
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            if (c0 + i < C) s = __fadd_rn(s, vs[i]);
            lo = fminf(lo, vl[i]);
            hi = fmaxf(hi, vh[i]);
          }
        }
      }
      float kb = 0.0f, am = 0.0f;
      if (d < D) {
        kb = __fdiv_rn(s, (float)p.len_k);
        am = fp4attn_nanmax(fabsf(__fsub_rn(hi, kb)), fabsf(__fsub_rn(kb, lo)));
        am = fp4attn_nanmax(am, fabsf(kb - kb)); /* NaN kbar (NaN / Inf input) -> NaN */
      }
      kbar[d] = kb;
      atomicMax(&sc.kam, __float_as_uint(am) & 0x7FFFFFFFu);
    }
    float vm = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += kThreads)
      vm = max_nan(vm, __ldcg(a.w.vmax + bhk * C + c));
    atomicMax(&sc.vam, __float_as_uint(vm) & 0x7FFFFFFFu);
  }

  /* qbar (f32, smem [local head][DP]) and the amax of Q - qbar of the heads h0 .. h0 + nh - 1. */
  static __device__ void q_head_stats(const DecodeArgs &a, int64_t b, int64_t h0, int nh,
                                      char *smem) {
    const fp4attn_attention_params &p = a.p;
    const int D = (int)p.head_dim;
    float *qbar = reinterpret_cast<float *>(smem + L::kQbar);
    Scalars &sc = *reinterpret_cast<Scalars *>(smem + L::kScal);
    for (int i = threadIdx.x; i < nh * DP; i += kThreads) {
      const int hl = i / DP, d = i % DP;
      float mean = 0.0f, am = 0.0f;
      if (d < D) {
        const int64_t base = b * p.q_stride[0] + (h0 + hl) * p.q_stride[1] + d;
        float s = 0.0f, lo = INFINITY, hi = -INFINITY;
        for (int64_t t = 0; t < p.len_q; ++t) {
          const float x = load_as_float(p.q, p.dtype, base + t * p.q_stride[2]);
          s = __fadd_rn(s, x);
          lo = fminf(lo, x);
          hi = fmaxf(hi, x);
        }
        mean = __fdiv_rn(s, (float)p.len_q);
        am = fp4attn_nanmax(fabsf(__fsub_rn(hi, mean)), fabsf(__fsub_rn(mean, lo)));
        am = fp4attn_nanmax(am, fabsf(mean - mean));
      }
      qbar[hl * DP + d] = mean;
      atomicMax(&sc.qam[hl], __float_as_uint(am) & 0x7FFFFFFFu);
    }
  }

  /* Q^ rows of the tile (exact FP16, swizzled [16][DP]), qbar parts per row ([3][16][DP] in T's
   * bits), and, for split 0, the LSE terms scale * (Q_r - qbar) . kbar. */
  static __device__ void q_operands(const DecodeArgs &a, int64_t b, int64_t hk, int64_t tile,
                                    int64_t mt, int64_t h0, bool lse_terms, char *smem) {
    const fp4attn_attention_params &p = a.p;
    const int D = (int)p.head_dim;
    const int64_t rows = a.group * p.len_q;
    const float *qbar = reinterpret_cast<const float *>(smem + L::kQbar);
    const float *kbar = reinterpret_cast<const float *>(smem + L::kKbar);
    const Scalars &sc = *reinterpret_cast<const Scalars *>(smem + L::kScal);
    char *qhat = smem + L::kQhat, *qpart = smem + L::kQpart;
    constexpr int KB = DP / 16;
    for (int job = threadIdx.x; job < kRows * KB; job += kThreads) {
      const int r = job / KB, kb = job % KB;
      const int64_t R = mt * kRows + r;
      uint32_t o[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (R < rows && kb * 16 < D) {
        const int hl = (int)(R / p.len_q - h0);
        const int64_t row = b * p.q_stride[0] + (hk * a.group + R / p.len_q) * p.q_stride[1] +
                            (R % p.len_q) * p.q_stride[2];
        float xs[16];
        smoothed_block16(p.q, p.dtype, row, kb, D, a.vec_q, qbar + hl * DP + kb * 16, sc.encq[hl],
                         xs);
        quantize_block16(xs, o);
      }
      *reinterpret_cast<uint4 *>(qhat + swz_byte<W>(r, kb * 32)) =
          make_uint4(o[0], o[1], o[2], o[3]);
      *reinterpret_cast<uint4 *>(qhat + swz_byte<W>(r, kb * 32 + 16)) =
          make_uint4(o[4], o[5], o[6], o[7]);
    }
    for (int i = threadIdx.x; i < kRows * DP / 2; i += kThreads) {
      const int r = i / (DP / 2), d = 2 * (i % (DP / 2));
      const int64_t R = mt * kRows + r;
      const float *qb = qbar + (R < rows ? (int)(R / p.len_q - h0) : 0) * DP;
      const float x0 = R < rows ? qb[d] : 0.0f, x1 = R < rows ? qb[d + 1] : 0.0f;
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
        const uint32_t w = BiasMma<DP, kBf16>::part_bits(x0, part) |
                           (BiasMma<DP, kBf16>::part_bits(x1, part) << 16);
        *reinterpret_cast<uint32_t *>(qpart + part * kRows * W + swz_byte<W>(r, 2 * d)) = w;
      }
    }
    if (!lse_terms || !p.lse) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = warp; r < kRows; r += kWarps) {
      const int64_t R = mt * kRows + r;
      float acc = 0.0f;
      if (R < rows) {
        const int hl = (int)(R / p.len_q - h0);
        const int64_t row = b * p.q_stride[0] + (hk * a.group + R / p.len_q) * p.q_stride[1] +
                            (R % p.len_q) * p.q_stride[2];
        for (int d = lane; d < D; d += 32)
          acc = fmaf(__fsub_rn(load_as_float(p.q, p.dtype, row + d), qbar[hl * DP + d]), kbar[d],
                     acc);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) a.w.qshift[tile * kRows + r] = p.scale * acc;
    }
  }

  struct State {
    SoftmaxState sm;
    float o[DP / 8][4];
  };

  /* One 128-key tile j (buffer buf): this warp's KW keys, the tile maxima exchange, P^q V^. */
  static __device__ __forceinline__ void compute_tile(const DecodeArgs &a, int64_t j, int buf,
                                                      int parity, char *smem, const float (&cqk)[2],
                                                      const int64_t (&last)[2], int64_t last_any,
                                                      State &st) {
    const fp4attn_attention_params &p = a.p;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t4 = lane & 3;
    const int D = (int)p.head_dim;
    const char *kt = smem + L::kK + buf * 2 * L::kTileBytes, *vt = kt + L::kTileBytes;
    const char *qhat = smem + L::kQhat, *qpart = smem + L::kQpart;
    const float *kbar = reinterpret_cast<const float *>(smem + L::kKbar);
    const ScaleEntry *stab = reinterpret_cast<const ScaleEntry *>(smem + L::kStab);
    const Scalars &sc = *reinterpret_cast<const Scalars *>(smem + L::kScal);
    float *tmax_s = reinterpret_cast<float *>(smem + L::kTmax) + parity * kWarps * kRows;
    const int key0 = warp * KW;
    const int64_t jk = j * kTile + key0; /* this warp's first key */
    const bool live = jk <= last_any;    /* some row sees a key of this warp's KW */

    float s[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = -INFINITY;
    float bm[NT / 2][2];
    if (live) {
      float c[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = c[n][e] = 0.0f;
      const float enck = sc.enck;
#pragma unroll
      for (int kk = 0; kk < DP / 16; ++kk) {
        /* past D, K, Q^ and the qbar parts are zeros (so is K^): a 16-column step there adds
         * zeros, and stopping only at 32-column boundaries gives the compiler 4 blocks at once */
        if (kk % 2 == 0 && kk * 16 >= D) break;
        uint32_t qa[4], qp[kParts][4];
        ldsm_a<W>(qa, qhat, 0, kk * 32);
#pragma unroll
        for (int part = 0; part < kParts; ++part)
          ldsm_a<W>(qp[part], qpart + part * kRows * W, 0, kk * 32);
        const float2 kb0 = *reinterpret_cast<const float2 *>(kbar + kk * 16 + 2 * t4);
        const float2 kb1 = *reinterpret_cast<const float2 *>(kbar + kk * 16 + 2 * t4 + 8);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t kr[2][2];
          ldsm_b<W>(kr, kt, key0 + np * 16, kk * 32);
#pragma unroll
          for (int x = 0; x < 2; ++x) {
#pragma unroll
            for (int part = 0; part < kParts; ++part)
              mma_16816<kBf16>(c[2 * np + x], qp[part], kr[x][0], kr[x][1]);
            const float2 f0 = word_to_float2<kBf16>(kr[x][0]), f1 = word_to_float2<kBf16>(kr[x][1]);
            const float xs[4] = {
                __fmul_rn(__fsub_rn(f0.x, kb0.x), enck), __fmul_rn(__fsub_rn(f0.y, kb0.y), enck),
                __fmul_rn(__fsub_rn(f1.x, kb1.x), enck), __fmul_rn(__fsub_rn(f1.y, kb1.y), enck)};
            uint32_t kq[2];
            quantize_quad_bounded(xs, stab, kq);
            mma_16816(s[2 * np + x], qa, kq[0], kq[1]);
          }
        }
      }
      /* scores in log2 units (SPEC 4.4) and the masks: key j of row r is visible iff j <= last[r]
       */
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t key = jk + n * 8 + 2 * t4 + (e & 1);
          const float x = fmaf(s[n][e], cqk[e >> 1], c[n][e] * a.scale_log2);
          s[n][e] = key <= last[e >> 1] ? x : -INFINITY;
        }
    }
    block_maxima(s, bm);
    if (t4 == 0) {
      const int g = lane >> 2;
      tmax_s[warp * kRows + g] = tile_row_max(bm, 0);
      tmax_s[warp * kRows + g + 8] = tile_row_max(bm, 1);
    }
    __syncthreads(); /* every warp's maxima of this tile */
    float tmax[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = (lane >> 2) + 8 * r;
      tmax[r] = tmax_s[row];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) tmax[r] = fmaxf(tmax[r], tmax_s[w * kRows + row]);
    }
    float alpha[2], gsc[2];
    uint32_t pa[NT / 2][4];
    softmax_step_p(tmax, s, bm, st.sm, alpha, gsc, pa);

    /* O = alpha O + (beta / 2688) dV (P^q V^), GW output columns at a time */
    constexpr int GW = DP == 256 ? 32 : 64;
    const float gv0 = gsc[0] * sc.decv, gv1 = gsc[1] * sc.decv;
    const float encv = sc.encv;
#pragma unroll
    for (int grp = 0; grp < DP / GW; ++grp) {
      float acc[GW / 8][4];
#pragma unroll
      for (int n = 0; n < GW / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
      if (live && grp * GW < D) {
#pragma unroll
        for (int kb = 0; kb < NT / 2; ++kb)
#pragma unroll
          for (int np = 0; np < GW / 16; ++np) {
            if (np % 2 == 0 && grp * GW + np * 16 >= D) break; /* zero channels, as for K */
            uint32_t vr[2][2];
            ldsm_b_trans<W>(vr, vt, key0 + kb * 16, grp * GW + np * 16);
#pragma unroll
            for (int x = 0; x < 2; ++x) {
              const float2 f0 = word_to_float2<kBf16>(vr[x][0]),
                           f1 = word_to_float2<kBf16>(vr[x][1]);
              const float xs[4] = {__fmul_rn(f0.x, encv), __fmul_rn(f0.y, encv),
                                   __fmul_rn(f1.x, encv), __fmul_rn(f1.y, encv)};
              uint32_t vq[2];
              quantize_quad_bounded(xs, stab, vq);
              mma_16816(acc[2 * np + x], pa[kb], vq[0], vq[1]);
            }
          }
      }
      rescale_accumulate(st.o, grp * (GW / 8), acc, alpha, gv0, gv1);
    }
  }

  static __device__ void run(const DecodeArgs &a, char *smem) {
    const fp4attn_attention_params &p = a.p;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int64_t tile = blockIdx.x, split = blockIdx.y;
    const int64_t bhk = tile / a.d.mtiles, mt = tile % a.d.mtiles;
    const int64_t b = bhk / p.heads_kv, hk = bhk % p.heads_kv;
    const int64_t rows = a.group * p.len_q;
    const int64_t ntiles = p.causal ? 1 : (p.len_k + kTile - 1) / kTile;
    const int64_t j0 = split * a.d.tiles_per_split, j1 = min(j0 + a.d.tiles_per_split, ntiles);
    const T *kg = static_cast<const T *>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
    const T *vg = static_cast<const T *>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];
    Scalars &sc = *reinterpret_cast<Scalars *>(smem + L::kScal);

    grid_dependents_launch(); /* the merge kernel may start */
    /* the first tile's copy overlaps the prologue (and the end of the statistics kernel) */
    if (j0 < j1) issue_tile(a, kg, vg, j0, smem, 0);
    cp_async_commit();
    if (tid < kRows) sc.qam[tid] = 0u;
    if (tid == 0) sc.kam = sc.vam = 0u;
    for (int i = tid; i < 256; i += kThreads)
      reinterpret_cast<ScaleEntry *>(smem + L::kStab)[i] = e4m3_scale_entry(i);
    __syncthreads();
    const int64_t h0 = mt * kRows / p.len_q; /* the tile's first head (within the group) */
    const int nh = (int)((min(rows, (mt + 1) * kRows) - 1) / p.len_q - h0 + 1);
    grid_dependency_wait(); /* the statistics are complete */
    finish_kv_stats(a, bhk, smem);
    q_head_stats(a, b, hk * a.group + h0, nh, smem);
    __syncthreads();
    if (tid == 0) {
      fp4attn_global_scales(__uint_as_float(sc.kam), &sc.enck, &sc.deck);
      fp4attn_global_scales(__uint_as_float(sc.vam), &sc.encv, &sc.decv);
    }
    if (tid < nh) fp4attn_global_scales(__uint_as_float(sc.qam[tid]), &sc.encq[tid], &sc.decq[tid]);
    __syncthreads();
    q_operands(a, b, hk, tile, mt, h0, split == 0, smem);
    __syncthreads();

    /* per-row constants of this lane's rows g, g + 8: scale log2e dQ dK, the last visible key */
    float cqk[2];
    int64_t last[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t R = mt * kRows + (lane >> 2) + 8 * r;
      const int hl = R < rows ? (int)(R / p.len_q - h0) : 0;
      cqk[r] = a.scale_log2 * (sc.decq[hl] * sc.deck);
      last[r] = p.len_k - 1;
      if (p.causal) last[r] = min(last[r], R % p.len_q);
      if (R >= rows) last[r] = -1; /* padding rows see nothing */
    }

    /* the last key any row of the tile sees */
    const int64_t last_any = p.causal ? min(p.len_k, p.len_q) - 1 : p.len_k - 1;

    State st;
    st.sm.m[0] = st.sm.m[1] = -INFINITY;
    st.sm.l[0] = st.sm.l[1] = 0.0f;
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) st.o[n][0] = st.o[n][1] = st.o[n][2] = st.o[n][3] = 0.0f;

    for (int64_t j = j0; j < j1; ++j) {
      const int i = (int)(j - j0);
      cp_async_wait_all();
      __syncthreads(); /* tile j visible; every warp is done with tile j - 1 */
      if (NBUF == 2 && j + 1 < j1) {
        issue_tile(a, kg, vg, j + 1, smem, (i + 1) & 1);
        cp_async_commit();
      }
      compute_tile(a, j, NBUF == 2 ? (i & 1) : 0, i & 1, smem, cqk, last, last_any, st);
      if (NBUF == 1 && j + 1 < j1) {
        __syncthreads();
        issue_tile(a, kg, vg, j + 1, smem, 0);
        cp_async_commit();
      }
    }
    cp_async_wait_all();

    /* the warps' O and l add up (their m agree); then this split's partial result */
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      st.sm.l[r] += __shfl_xor_sync(0xffffffffu, st.sm.l[r], 1);
      st.sm.l[r] += __shfl_xor_sync(0xffffffffu, st.sm.l[r], 2);
    }
    __syncthreads();                                     /* the tile buffers are free */
    float *wo = reinterpret_cast<float *>(smem + L::kK); /* [warps][16][DP] */
    float *wl = wo + kWarps * kRows * DP;                /* [warps][16][2] */
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = g + 8 * r;
#pragma unroll
      for (int n = 0; n < DP / 8; ++n)
        *reinterpret_cast<float2 *>(wo + (warp * kRows + row) * DP + n * 8 + 2 * t4) =
            make_float2(st.o[n][2 * r], st.o[n][2 * r + 1]);
      if (t4 == 0) {
        wl[(warp * kRows + row) * 2] = st.sm.m[r];
        wl[(warp * kRows + row) * 2 + 1] = st.sm.l[r];
      }
    }
    __syncthreads();
    const int64_t part = tile * a.d.splits + split;
    for (int i = tid; i < kRows * DP; i += kThreads) {
      const int row = i / DP, d = i % DP;
      float acc = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) acc += wo[(w * kRows + row) * DP + d];
      a.w.o_part[(part * kRows + row) * DP + d] = acc;
    }
    if (tid < kRows) {
      float l = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) l += wl[(w * kRows + tid) * 2 + 1];
      a.w.ml_part[(part * kRows + tid) * 2] = wl[tid * 2];
      a.w.ml_part[(part * kRows + tid) * 2 + 1] = l;
    }
  }
};

template <typename T, int DP, int NBUF, int NW>
__global__ void __launch_bounds__(NW * 32, 1)
    sdpa_decode_attn_kernel(const __grid_constant__ DecodeArgs a) {
  extern __shared__ __align__(128) char smem[];
  DecodeKernel<T, DP, NBUF, NW>::run(a, smem);
}

/* The attention kernel at padded head dim DP: its tile buffers and warps, its shared memory. */
template <int DP>
struct AttnShape {
  static constexpr int kBufs = DP <= 128 ? 2 : 1, kWarps = DP <= 128 ? 8 : 4;
  using Smem = AttnSmem<DP, kBufs, kWarps>;
};

template <typename T, int DP>
fp4attn_status launch_typed(const DecodeArgs &a, const AttnPlan &plan, cudaStream_t s) {
  constexpr int NBUF = AttnShape<DP>::kBufs, NW = AttnShape<DP>::kWarps;
  using L = typename AttnShape<DP>::Smem;
  auto kernel = sdpa_decode_attn_kernel<T, DP, NBUF, NW>;
  static int configured[64] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64 || !configured[dev]) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes) !=
        cudaSuccess)
      return launch_status("attention: decode kernel attributes");
    if (dev >= 0 && dev < 64) configured[dev] = 1;
  }
  const int64_t bhk = a.p.batch * a.p.heads_kv, tiles = bhk * plan.decode.mtiles;
  sdpa_decode_stats_kernel<T, DP>
      <<<dim3((unsigned)bhk, (unsigned)plan.decode.chunks), kStatThreads, 0, s>>>(a);
  fp4attn_status st = launch_status("attention: decode statistics kernel");
  if (st.code != FP4ATTN_OK) return st;
  launch_dependent(kernel, dim3((unsigned)tiles, (unsigned)plan.decode.splits), dim3(NW * 32),
                   L::kBytes, s, a);
  st = launch_status("attention: decode kernel");
  if (st.code != FP4ATTN_OK) return st;
  const fp4attn_attention_params &p = a.p;
  launch_split_merge<DP>({a.w.o_part,
                          a.w.ml_part,
                          a.w.qshift,
                          plan.decode.splits,
                          plan.decode.mtiles,
                          kRows,
                          p.heads_q,
                          p.heads_kv,
                          p.len_q,
                          p.head_dim,
                          p.out,
                          {p.out_stride[0], p.out_stride[1], p.out_stride[2]},
                          p.dtype,
                          p.lse},
                         tiles, s);
  return launch_status("attention: decode merge kernel");
}

template <typename T>
fp4attn_status launch_for_dp(const DecodeArgs &a, const AttnPlan &plan, cudaStream_t s) {
  switch (plan.dp) {
    case 64:
      return launch_typed<T, 64>(a, plan, s);
    case 128:
      return launch_typed<T, 128>(a, plan, s);
    default:
      return launch_typed<T, 256>(a, plan, s);
  }
}

}  // namespace

int64_t sdpa_decode_smem_bytes(int64_t dp) {
  return dp <= 64 ? AttnShape<64>::Smem::kBytes
                  : (dp <= 128 ? AttnShape<128>::Smem::kBytes : AttnShape<256>::Smem::kBytes);
}

fp4attn_status launch_sdpa_decode(const fp4attn_attention_params &p, const AttnPlan &plan,
                                  void *workspace, cudaStream_t s) {
  if (plan.decode.splits > 65535) /* chunks: at most 32 (sdpa_decode_schedule) */
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "attention: decode grid too large");
  DecodeArgs a;
  a.p = p;
  a.w = sdpa_decode_layout(p, plan, workspace);
  a.d = plan.decode;
  a.group = p.heads_q / p.heads_kv;
  a.vec_q = vector_rows(p.q, p.q_stride, p.head_dim);
  a.scale_log2 = p.scale * kLog2e;
  return p.dtype == FP4ATTN_BFLOAT16 ? launch_for_dp<__nv_bfloat16>(a, plan, s)
                                     : launch_for_dp<__half>(a, plan, s);
}

}  // namespace fp4attn_cuda
