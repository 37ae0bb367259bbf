/*
 * The quantization pre-pass of the CUDA attention (SPEC 4.1-4.3): qbar and max |Q - qbar| per
 * 128-row query block, kbar, vbar (V smoothing), the global scales of Qs, Ks and V - vbar, and, for
 * the kernels with FP16 operands, Ks^ quantized along D into kdq and (V - vbar)^ along tokens into
 * the tile-major vdq (layouts in tile/workspace.cuh). Five kernels (six with an attn_mask), none
 * of which waits for another block:
 *   1. stream_stats_kernel, one short block per 128-row block of Q, K or V (1,024 threads per SM
 *      for 16-bit inputs, 8 rows of 16-byte loads per thread), all of a thread's loads in flight
 *      before the first use: a query block stores qbar and max |Q - qbar| (by monotonicity of
 *      rounding, max_j |fl(x_j - c)| = max(|fl(max x - c)|, |fl(c - min x)|), so Q is read once,
 *      evict-first); a K chunk stores its column sums and folds its column minima and maxima into
 *      per-head atomicMax keys (float_key: a min or max is exact in any order); a V chunk does the
 *      same with its column minima and maxima and flags a NaN (a NaN column sum) in a per-head key.
 *      K and V stay in L2 where they fit.
 *   1b. with an attn_mask only, vbar_mask_kernel, one block per query block: the masks of vbar
 *      (SPEC 4.3): each key's bias (the largest mask value of the entries that see it) folded into
 *      the KV head's atomicMax keys, the block's rows that see some key, counted, and their mean
 *      where some rows see none.
 *   2. stream_finalize_kernel, one block per K/V head (reduce_head: the chunk sums added in chunk
 *      order with batched loads, kbar, the global scales of Ks; qm, the mean query of the head's
 *      query blocks, with a mask over the rows that see some key) and per query head (the Q
 *      scales).
 *   3. vbar_chunk_kernel, one block per 128-key chunk (SPEC 4.3): the scores scale * qm . K_j (DP/8
 *      lanes per key, 8 columns each, then a butterfly over those lanes), their chunk maximum M_c,
 *      l_c = sum exp(s_j - M_c) and per column sum exp(s_j - M_c) V_j (keys ascending), K and V
 *      read again from L2 where the statistics kernel left them.
 *   4. vbar_finalize_kernel, one block per K/V head: the chunks merged in chunk order into vbar,
 *      the amax of V - vbar from the column minima and maxima, the global scales of V - vbar.
 *   5. stream_quantize_kernel, persistent blocks over items of item_rows tokens (one or two
 *      128-token chunks, half a chunk for fp32 at head dim 256), last item first, so that the
 *      chunks the statistics kernel read last are re-read from L2: K and V copied into shared
 *      memory (cp.async, 16 bytes per copy), the next item's K (V) copied while this item's V (K)
 *      is quantized. Ks^ along D and (V - vbar)^ along tokens (quantize_half_block: two lanes per
 * 16-value block, hardware E4M3 of bmax/6 (FMA-corrected quotient), a 1/s table, the signed
 *      add/subtract E2M1 rounding, one FP16 multiply per pair; NaN/Inf blocks through numerics.h).
 * The kernels read 16-byte vectors of 8 elements: inputs without them (unaligned rows, head dims
 * that are no multiple of 8) are first copied into the workspace's staging area with the head dim
 * zero-padded to a multiple of 8 (stage_rows_kernel), which leaves every result unchanged.
 * The keys are zeroed by the cudaMemsetAsync of the sync section on the same stream; nothing else
 * is shared between blocks, so the pre-pass runs inside CUDA graphs and for any sequence length.
 *
 * Summation order (it defines the bits of qbar and kbar): a 128-row block of D columns is read as
 * CG = D/8 groups of 8 columns x RG = min(16, 256/CG) row groups (stat_row_groups). Row group g
 * sums rows g, g+RG, ... in order from 0; the block sum adds the RG group sums in order from 0;
 * kbar adds the chunk sums in chunk order from 0 and divides by Nk. qm adds n_i x qbar_i over the
 * KV head's query heads, then their blocks, in order, and divides by G x Nq (with an attn_mask:
 * n'_i x qbar'_i over the blocks with n'_i rows that see a key, divided by the sum of n'_i).
 */
#include <mutex>

#include "../common/fast_rounding.cuh"
#include "../tile/scheduler.cuh"
#include "prepass.h"

using namespace fp4attn_cuda;

namespace {

constexpr int kThreads = 256;

/* Row groups of the 8-wide column statistics of a 128-row block with CG 8-column groups: 16, so
 * that a thread sums 8 rows, up to head dim 128; above it 256 / CG, since 16 x CG threads would
 * exceed a 256-thread block. The streaming statistics kernel's blocks are sized by it. */
__host__ __device__ constexpr int stat_row_groups(int CG) {
  return CG <= kThreads / 16 ? 16 : kThreads / CG;
}

/* ============================================================ shared block helpers */

/* NaN-propagating max over the block of one value per thread; result valid in every thread. */
__device__ float block_nanmax(float v, float *sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fp4attn_nanmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = 0.0f;
  for (int i = 0; i < (int)(blockDim.x >> 5); ++i) r = fp4attn_nanmax(r, sh[i]);
  return r;
}

/* The global scales of Qs of head bh from its query blocks' max |Q - qbar| (a max, so any order);
 * sh_red: 32 floats of shared memory. */
__device__ void q_head_scales(const AttnWorkspace &w, int64_t bh, float *sh_red) {
  float qm = 0.0f;
  for (int64_t t = threadIdx.x; t < w.nqb; t += blockDim.x)
    qm = fp4attn_nanmax(qm, w.qamax[bh * w.nqb + t]);
  qm = block_nanmax(qm, sh_red);
  if (threadIdx.x == 0) fp4attn_global_scales(qm, &q_scales(w, bh)[kQEnc], &q_scales(w, bh)[kQDec]);
}

/* ========================================================================= kernels */

/* Eight consecutive input elements as raw bits: one 16-byte word (fp16, bf16) or two (fp32). */
template <typename T>
struct Raw8 {
  uint4 w[sizeof(T) / 2];
};

__device__ __forceinline__ uint32_t word_of(const uint4 &u, int k) {
  return k == 0 ? u.x : (k == 1 ? u.y : (k == 2 ? u.z : u.w)); /* k is a constant after unrolling */
}

/* Element j (0..7, a constant after unrolling) of a Raw8 as float (exact). */
template <typename T>
__device__ __forceinline__ float raw8_elem(const Raw8<T> &r, int j);
template <>
__device__ __forceinline__ float raw8_elem<__half>(const Raw8<__half> &r, int j) {
  const uint32_t u = word_of(r.w[0], j >> 1);
  return __half2float(__ushort_as_half((unsigned short)((j & 1) ? (u >> 16) : (u & 0xFFFFu))));
}
template <>
__device__ __forceinline__ float raw8_elem<__nv_bfloat16>(const Raw8<__nv_bfloat16> &r, int j) {
  const uint32_t u = word_of(r.w[0], j >> 1);
  return __uint_as_float((j & 1) ? (u & 0xFFFF0000u) : (u << 16));
}
template <>
__device__ __forceinline__ float raw8_elem<float>(const Raw8<float> &r, int j) {
  return __uint_as_float(word_of(r.w[j >> 2], j & 3));
}

template <typename T>
__device__ __forceinline__ void raw8_to_float(const Raw8<T> &r, float *v) {
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = raw8_elem<T>(r, j);
}

template <typename T>
__device__ __forceinline__ Raw8<T> raw8_zero() {
  Raw8<T> r;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(T) / 2); ++i) r.w[i] = make_uint4(0u, 0u, 0u, 0u);
  return r;
}

/* Loads of 8 elements from shared memory ... */
template <typename T>
__device__ __forceinline__ Raw8<T> raw8_shared(const T *p) {
  Raw8<T> r;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(T) / 2); ++i) r.w[i] = reinterpret_cast<const uint4 *>(p)[i];
  return r;
}
/* ... from global memory: read once (evict-first), or, kReadAgain, through L2 only with normal
 * eviction (K and V, re-read by the quantize kernel) */
template <typename T, bool kReadAgain>
__device__ __forceinline__ Raw8<T> raw8_global(const T *p) {
  Raw8<T> r;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(T) / 2); ++i) {
    const uint4 *q = reinterpret_cast<const uint4 *>(p) + i;
    r.w[i] = kReadAgain ? __ldcg(q) : __ldcs(q);
  }
  return r;
}

/* Per-E4M3-byte tables in shared memory: 1/scale correctly rounded (SPEC 2; 0 for the zero
 * scale, so that a zero block quantizes to zeros without a branch) and (scale, scale) as half2
 * (exact: E4M3 values are FP16 normals). */
struct ScaleTables {
  float rcp[128];
  uint32_t sv2[128];
};

__device__ void fill_scale_tables(ScaleTables *t) {
  for (int i = threadIdx.x; i < 128; i += blockDim.x) {
    const float sv = fp4attn_e4m3_decode((uint8_t)i);
    t->rcp[i] = (i == 0 || i == 0x7F) ? 0.0f : 1.0f / sv;
    t->sv2[i] = i == 0x7F ? 0u : pack_half2(sv, sv);
  }
}

/* Quantizes 8 of the 16 values of one block (SPEC 2 with the global scale already applied:
 * xs = x * enc); the other 8 are held by lane (lane ^ partner), and all 32 lanes of the warp call
 * this together. Returns the 8 FP16 values code * scale as one 16-byte word, byte-identical to
 * fp4attn_quantize_block + block_f16_words (the block max m is the same whatever the order; a
 * NaN anywhere makes it NaN):
 *   finite blocks: hardware E4M3 of m/6, table 1/s, E2M1 rounding by e2m1_round_signed
 *   (clamped first only in warps where some |y| can reach 7), code * s as one FP16 multiply;
 *   other blocks: quantize_half_block_slow. */
__device__ __forceinline__ uint4 quantize_half_block(const float *xs, int partner,
                                                     const ScaleTables *tab) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = max_nan(m, fabsf(xs[i]));
  m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, partner));
  const bool fast = m <= 7.9228163e28f; /* 2^96; false for NaN */
  const uint8_t s = e4m3_encode_fast(div6_e4m3(m)) & 0x7F;
  const float r = tab->rcp[s];
  const uint32_t sv2 = tab->sv2[s];
  const bool clamp = __any_sync(0xffffffffu, fast && __fmul_rn(m, r) >= 7.0f);
  if (!fast)
    return quantize_half_block_slow(make_float4(xs[0], xs[1], xs[2], xs[3]),
                                    make_float4(xs[4], xs[5], xs[6], xs[7]), m);
  uint32_t o[4];
  if (clamp) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float q0 = e2m1_round_signed(clamp6(__fmul_rn(xs[2 * k], r)));
      const float q1 = e2m1_round_signed(clamp6(__fmul_rn(xs[2 * k + 1], r)));
      o[k] = h2_mul(pack_half2(q0, q1), sv2);
    }
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float q0 = e2m1_round_signed(__fmul_rn(xs[2 * k], r));
      const float q1 = e2m1_round_signed(__fmul_rn(xs[2 * k + 1], r));
      o[k] = h2_mul(pack_half2(q0, q1), sv2);
    }
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

/* Everything a pre-pass block keeps in static shared memory (about 10 KB, beside the quantize
 * kernel's item buffers: quantize_min_blocks). */
struct __align__(16) PrepassShared {
  float
      red[kThreads * 8]; /* [RG][D] partials of the column statistics; reduce_head's running sums */
  float kbar[256];
  float vbar[256];
  float small[32];
  ScaleTables tab;
  float enck, encv;
};

/* What the five kernels share: work counts and the sync section of the workspace
 * (tile/workspace.cuh, zeroed before every pre-pass). */
struct StreamParams {
  unsigned int *vnan;        /* [BHk]: nonzero where V holds a NaN, atomicMax */
  unsigned int *kmin, *kmax; /* [BHk][Dp]: order keys of the column minima (inverted) / maxima */
  unsigned int *vmin, *vmax; /* [BHk][Dp]: the same for V */
  int64_t n_q;               /* query blocks */
  int64_t n_kv;              /* quantize items (items_per_head per head) */
  int64_t items_per_head;    /* ceil(nkt / chunks_per_item) */
};

/* Order-preserving map of a float (not NaN) to a nonzero unsigned key: the column minima and
 * maxima of a head are exact whatever the order, so the chunks combine them with atomicMax on
 * these keys (zeroed memory is below every key) instead of storing per-chunk partials. */
__device__ __forceinline__ unsigned int float_key(float x) {
  const unsigned int b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_float(unsigned int k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

/* Threads of a streaming statistics block: the RG x CG row and column groups of head dim DP (at
 * smaller head dims of the same DP some stay idle): 128 at DP = 64, else 256. */
template <int DP>
__host__ __device__ constexpr int stats_threads() {
  return stat_row_groups(DP / 8) * (DP / 8);
}

template <typename T, int DP>
struct BlockRows {
  static constexpr int kFewestGroups = stat_row_groups(DP / 8);                /* D = DP */
  static constexpr int kMaxRows = (kTile + kFewestGroups - 1) / kFewestGroups; /* any D <= DP */
  Raw8<T> raw[kMaxRows];
};

/* A thread's part of a 128-row block for column_stats_of: 8 columns (group
 * cg) of rows rg, rg + RG, ... (zeros past `rows`), read once (evict-first) or, kReadAgain, kept
 * in L2 for a later kernel. */
template <typename T, int DP, bool kReadAgain>
__device__ __forceinline__ void load_block_rows(const T *base, int64_t row_stride, int rows, int D,
                                                BlockRows<T, DP> &b) {
  const int CG = D / 8, RG = stat_row_groups(CG);
  const int rg = threadIdx.x / CG, cg = threadIdx.x % CG;
#pragma unroll
  for (int i = 0; i < BlockRows<T, DP>::kMaxRows; ++i) {
    const int r = rg + i * RG;
    const T *src = base + (int64_t)r * row_stride + cg * 8;
    b.raw[i] = (rg < RG && r < rows) ? raw8_global<T, kReadAgain>(src) : raw8_zero<T>();
  }
}

/* Column statistics of a 128-row block of D columns (D % 8 == 0), loaded by load_block_rows, in
 * the summation order of the header: thread (rg, cg) sums rows rg, rg + RG, ... of its 8 columns,
 * then the RG partials are added in rg order (through sh.red: a round for the sums, one or two for
 * the minima and maxima). Thread c < D returns column c. */
template <typename T, int DP>
__device__ void column_stats_of(const BlockRows<T, DP> &b, int rows, int D, PrepassShared &sh,
                                float &sum_c, float &min_c, float &max_c) {
  constexpr int kMaxRows = BlockRows<T, DP>::kMaxRows;
  const int CG = D / 8, RG = stat_row_groups(CG);
  const int tid = threadIdx.x, rg = tid / CG, cg = tid % CG;
  const Raw8<T> *raw = b.raw;
  float sum[8], mn[8], mx[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) sum[e] = 0.0f, mn[e] = INFINITY, mx[e] = -INFINITY;
#pragma unroll
  for (int i = 0; i < kMaxRows; ++i) {
    if (rg < RG && rg + i * RG < rows) {
      float v[8];
      raw8_to_float<T>(raw[i], v);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        sum[e] = __fadd_rn(sum[e], v[e]);
        mn[e] = fminf(mn[e], v[e]);
        mx[e] = fmaxf(mx[e], v[e]);
      }
    }
  }
  float *red = sh.red;
  /* the sums: the RG partials added in rg order by thread c < D */
  __syncthreads(); /* red is free */
  if (rg < RG) {
#pragma unroll
    for (int e = 0; e < 8; ++e) red[rg * D + cg * 8 + e] = sum[e];
  }
  __syncthreads();
  if (tid < D) {
    float s = 0.0f;
    for (int i = 0; i < RG; ++i) s = __fadd_rn(s, red[i * D + tid]);
    sum_c = s;
  }
  /* the minima and maxima, exact in any order: where row groups rg and rg + 1 are lanes CG apart
   * in one warp (CG a power of two up to 16: head dims 8 ... 128), a shuffle halves the partials
   * and both fit in red at once, so one round does both; else a round each */
  if (CG <= 16 && (CG & (CG - 1)) == 0) {
    const int half = RG / 2;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      mn[e] = fminf(mn[e], __shfl_xor_sync(0xffffffffu, mn[e], CG));
      mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], CG));
    }
    __syncthreads(); /* the sums are read */
    if (rg < RG && (rg & 1) == 0) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        red[(rg / 2) * D + cg * 8 + e] = mn[e];
        red[(half + rg / 2) * D + cg * 8 + e] = mx[e];
      }
    }
    __syncthreads();
    if (tid < D) {
      float a = INFINITY, b = -INFINITY;
      for (int i = 0; i < half; ++i) {
        a = fminf(a, red[i * D + tid]);
        b = fmaxf(b, red[(half + i) * D + tid]);
      }
      min_c = a;
      max_c = b;
    }
    return;
  }
#pragma unroll
  for (int round = 1; round < 3; ++round) {
    __syncthreads(); /* red is free */
    if (rg < RG) {
#pragma unroll
      for (int e = 0; e < 8; ++e) red[rg * D + cg * 8 + e] = round == 1 ? mn[e] : mx[e];
    }
    __syncthreads();
    if (tid < D) {
      float s = round == 1 ? INFINITY : -INFINITY;
      for (int i = 0; i < RG; ++i)
        s = round == 1 ? fminf(s, red[i * D + tid]) : fmaxf(s, red[i * D + tid]);
      if (round == 1)
        min_c = s;
      else
        max_c = s;
    }
  }
}

/* Query block `item`'s rows: the first, and how many. */
template <typename T>
__device__ __forceinline__ const T *q_block_rows(const AttnArgs &a, int64_t item, int &rows) {
  const fp4attn_attention_params &p = a.p;
  const int64_t bh = item / a.ws.nqb, qb = item % a.ws.nqb;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  rows = (int)min((int64_t)kTile, p.len_q - qb * kTile);
  return static_cast<const T *>(p.q) + b * p.q_stride[0] + h * p.q_stride[1] +
         qb * kTile * p.q_stride[2];
}

/* One query block, its rows loaded: qbar and max |Q - qbar|, stored. */
template <typename T, int DP>
__device__ void q_block_stats_of(const AttnArgs &a, int64_t item, const BlockRows<T, DP> &rb,
                                 int rows, PrepassShared &sh) {
  const AttnWorkspace &w = a.ws;
  const int D = (int)a.p.head_dim, tid = threadIdx.x;
  float s = 0.0f, mn = 0.0f, mx = 0.0f;
  column_stats_of<T, DP>(rb, rows, D, sh, s, mn, mx);
  float am = 0.0f;
  if (tid < DP) {
    float mean = 0.0f;
    if (tid < D) {
      mean = __fdiv_rn(s, (float)rows);
      am = fp4attn_nanmax(fabsf(__fsub_rn(mx, mean)), fabsf(__fsub_rn(mean, mn)));
      am = fp4attn_nanmax(am, fabsf(mean - mean)); /* NaN mean (NaN/Inf input) -> NaN */
    }
    w.qbar[item * DP + tid] = mean; /* item = bh * nqb + qb */
  }
  am = block_nanmax(am, sh.small);
  if (tid == 0) w.qamax[item] = am;
}

/* One K/V head: kbar = (sum of the chunk sums in chunk order) / Nk, the amax of Ks from the column
 * minima and maxima and its global scales, and qm, into the workspace.
 * The chunk sums of 4 columns are float4 loads; P threads per 4 columns each load a run of 8
 * chunks at once, then add them in turn, passing the running sums on through shared memory, so
 * that the serial chain waits for one round of loads instead of one per chunk. */
template <int DP>
__device__ void reduce_head(const AttnArgs &a, const StreamParams &f, int64_t bh,
                            PrepassShared &sh) {
  const fp4attn_attention_params &p = a.p;
  const AttnWorkspace &w = a.ws;
  const int D = (int)p.head_dim, tid = threadIdx.x;
  const int64_t nkt = w.nkt;
  /* order-free parts first, so that their loads overlap the chain's */
  float mn = 0.0f, mx = 0.0f;
  if (tid < D) {
    mn = key_float(~__ldcg(&f.kmin[bh * DP + tid]));
    mx = key_float(__ldcg(&f.kmax[bh * DP + tid]));
  }
  constexpr int kRun = 8;
  const int QC = D / 4;                         /* column quads */
  const int64_t runs = (nkt + kRun - 1) / kRun; /* runs of 8 chunks */
  const int P = (int)min((int64_t)(kThreads / QC), runs);
  const int q = tid % QC, part = tid / QC;
  float4 *carry = reinterpret_cast<float4 *>(sh.red); /* [QC] running sums */
  const float *ksum = w.ksum + bh * nkt * DP + 4 * q;
  for (int64_t t0 = 0; t0 < nkt; t0 += (int64_t)kRun * P) {
    const int64_t mine = t0 + (int64_t)part * kRun;
    float4 v[kRun];
#pragma unroll
    for (int i = 0; i < kRun; ++i)
      v[i] = (part < P && mine + i < nkt)
                 ? __ldcg(reinterpret_cast<const float4 *>(ksum + (mine + i) * DP))
                 : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int step = 0; step < P; ++step) {
      __syncthreads(); /* the previous step's running sums are visible */
      if (part == step) {
        float4 c = (t0 == 0 && step == 0) ? make_float4(0.0f, 0.0f, 0.0f, 0.0f) : carry[q];
#pragma unroll
        for (int i = 0; i < kRun; ++i) {
          if (mine + i < nkt) {
            c.x = __fadd_rn(c.x, v[i].x);
            c.y = __fadd_rn(c.y, v[i].y);
            c.z = __fadd_rn(c.z, v[i].z);
            c.w = __fadd_rn(c.w, v[i].w);
          }
        }
        carry[q] = c;
      }
    }
  }
  __syncthreads();
  float am = 0.0f;
  if (tid < DP) {
    float kbar = 0.0f;
    if (tid < D) {
      const float4 c = carry[tid / 4];
      const float s = (tid & 3) == 0 ? c.x : ((tid & 3) == 1 ? c.y : ((tid & 3) == 2 ? c.z : c.w));
      kbar = __fdiv_rn(s, (float)p.len_k);
      am = fp4attn_nanmax(fabsf(__fsub_rn(mx, kbar)), fabsf(__fsub_rn(kbar, mn)));
      am = fp4attn_nanmax(am, fabsf(kbar - kbar));
    }
    w.kbar[bh * DP + tid] = kbar;
  }
  const float kam = block_nanmax(am, sh.small);
  if (tid == 0) fp4attn_global_scales(kam, &kv_scales(w, bh)[kKEnc], &kv_scales(w, bh)[kKDec]);
  /* qm (SPEC 4.3): n_i x qbar_i over the G query heads of this KV head, then their blocks (the
   * heads are consecutive, so their blocks are G x nqb consecutive rows of qbar), / (G x Nq).
   * With an attn_mask, over the rows that see some key (vbar_mask_kernel): a block counts n'_i
   * rows with their mean (qbar_i where n'_i = n_i, qmask where 0 < n'_i < n_i), / sum n'_i
   * (qm = 0 where no row sees a key). */
  if (tid < DP) {
    float qs = 0.0f;
    if (tid < D) {
      const int64_t G = p.heads_q / p.heads_kv, n = G * w.nqb;
      const int64_t q0 = (bh / p.heads_kv * p.heads_q + bh % p.heads_kv * G) * w.nqb;
      const float *qb = w.qbar + q0 * DP;
      if (p.mask_kind == FP4ATTN_MASK_NONE) {
        for (int64_t i = 0; i < n; ++i) {
          const float rows = (float)min((int64_t)kTile, p.len_q - i % w.nqb * kTile);
          qs = __fadd_rn(qs, __fmul_rn(rows, __ldcg(qb + i * DP + tid)));
        }
        qs = __fdiv_rn(qs, (float)(G * p.len_q));
      } else {
        int64_t total = 0;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t rows = min((int64_t)kTile, p.len_q - i % w.nqb * kTile);
          const int64_t cnt = (int64_t)__ldcg(w.qcount + q0 + i);
          if (cnt == 0) continue;
          const float *mean = cnt < rows ? w.qmask + (q0 + i) * DP : qb + i * DP;
          qs = __fadd_rn(qs, __fmul_rn((float)cnt, __ldcg(mean + tid)));
          total += cnt;
        }
        qs = total > 0 ? __fdiv_rn(qs, (float)total) : 0.0f;
      }
    }
    w.qmean[bh * DP + tid] = qs;
  }
}

/* The statistics of one 128-row block (its loads all issued before its first
 * use), read from global memory: block j < n_q is query block j (qbar, max |Q - qbar|; Q read for
 * the last time); then a chunk of K (the column sums stored, the column minima / maxima folded
 * into the head's atomicMax keys) and of V (max |V| into the head's key), in turn, left in L2 for
 * the quantize kernel. No block waits or counts: stream_finalize_kernel runs after it. */
template <typename T, int DP>
__device__ void stream_stats_block(const AttnArgs &a, const StreamParams &f, int64_t j,
                                   PrepassShared &sh) {
  const fp4attn_attention_params &p = a.p;
  const AttnWorkspace &w = a.ws;
  const int D = (int)p.head_dim, tid = threadIdx.x;
  BlockRows<T, DP> rb;
  int rows;
  if (j < f.n_q) {
    const T *q = q_block_rows<T>(a, j, rows);
    load_block_rows<T, DP, false>(q, p.q_stride[2], rows, D, rb);
    q_block_stats_of<T, DP>(a, j, rb, rows, sh);
    return;
  }
  const bool is_v = ((j - f.n_q) & 1) != 0;
  const int64_t c = (j - f.n_q) / 2, bh = c / w.nkt, kt = c % w.nkt; /* c = bh * nkt + kt */
  const int64_t *st = is_v ? p.v_stride : p.k_stride;
  const T *src = static_cast<const T *>(is_v ? p.v : p.k) + bh / p.heads_kv * st[0] +
                 bh % p.heads_kv * st[1] + kt * kTile * st[2];
  rows = (int)min((int64_t)kTile, p.len_k - kt * kTile);
  load_block_rows<T, DP, true>(src, st[2], rows, D, rb);
  /* one column_stats_of call for K and V chunks alike: a third inlined copy spilled on sm_90a */
  float s = 0.0f, mn = 0.0f, mx = 0.0f;
  column_stats_of<T, DP>(rb, rows, D, sh, s, mn, mx);
  if (tid < D) {
    unsigned int *kmin = is_v ? f.vmin : f.kmin, *kmax = is_v ? f.vmax : f.kmax;
    atomicMax(&kmin[bh * DP + tid], ~float_key(mn));
    atomicMax(&kmax[bh * DP + tid], float_key(mx));
    if (!is_v)
      w.ksum[c * DP + tid] = s;
    else if (s != s && fmaxf(fabsf(mn), fabsf(mx)) <= 3.4028235e38f / kTile)
      /* the minima and maxima skip NaNs; the sum keeps them. A column with |v| above
       * FLT_MAX / 128 may sum +inf and -inf partials to NaN without a NaN: not flagged (a NaN
       * beside such values then goes unseen; SPEC 4.3) */
      atomicMax(&f.vnan[bh], 1u);
  }
}

/* Kernel 1 of 5: the statistics, one block of stats_threads<DP>() per 128-row block
 * (stream_stats_block): n_q query blocks, then 2 x B x Hkv x nkt K and V chunks. Many short
 * blocks, 1,024 threads per SM for 16-bit inputs at head dims 64 and 128 (registers capped at 64),
 * each with 8 rows of 16-byte loads in flight. */
template <typename T, int DP>
constexpr int stats_min_blocks() {
  return sizeof(T) == 2 && DP <= 128 ? 1024 / stats_threads<DP>() : 1;
}
template <typename T, int DP>
__global__ void __launch_bounds__(stats_threads<DP>(), stats_min_blocks<T, DP>())
    stream_stats_kernel(AttnArgs a, StreamParams f) {
  __shared__ PrepassShared sh;
  stream_stats_block<T, DP>(a, f, blockIdx.x, sh);
}

/* Kernel 2 of 5: one block per K/V head (kbar, the K scales and qm: reduce_head)
 * and per query head (the Q scales). */
template <int DP>
__global__ void __launch_bounds__(kThreads) stream_finalize_kernel(AttnArgs a, StreamParams f) {
  __shared__ PrepassShared sh;
  const int64_t bhk = a.p.batch * a.p.heads_kv;
  if ((int64_t)blockIdx.x < bhk)
    reduce_head<DP>(a, f, blockIdx.x, sh);
  else
    q_head_scales(a.ws, (int64_t)blockIdx.x - bhk, sh.small);
}

__device__ __forceinline__ float elem_float(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float elem_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float elem_float(float x) {
  return x;
}

/* Kernel 1b, attn_mask only (SPEC 4.3, the masks of vbar): one block per 128-row query block
 * item = bhq x nqb + qb, launched between kernels 1 and 2. Entry (i, j) is seen when causal allows
 * it (j <= i) and the mask value is above -inf (bool: True, value 0). Thread j % 256 takes key j
 * over the block's rows and folds the largest value that sees it into the KV head's order key
 * kbias[j] (atomicMax; the zeroed 0 = seen by no row); the rows that see some key are flagged in
 * shared memory; qcount = their number, and where some but not all rows see a key, qmask = the
 * mean of those rows (rows ascending, one rounding per sum). A mask broadcast over rows (stride 0,
 * no causal) is read for the first row only. */
template <typename T, int DP>
__global__ void __launch_bounds__(kThreads) vbar_mask_kernel(AttnArgs a, StreamParams f) {
  __shared__ int seen[kTile];
  __shared__ int count;
  const fp4attn_attention_params &p = a.p;
  const AttnWorkspace &w = a.ws;
  const int64_t item = blockIdx.x, bhq = item / w.nqb, i0 = item % w.nqb * kTile;
  const int64_t b = bhq / p.heads_q, h = bhq % p.heads_q;
  const int64_t bhk = b * p.heads_kv + h / (p.heads_q / p.heads_kv);
  const int rows = (int)min((int64_t)kTile, p.len_q - i0);
  const int D = (int)p.head_dim, tid = threadIdx.x;
  const int eval_rows = p.mask_stride[2] == 0 && !p.causal ? 1 : rows;
  for (int r = tid; r < kTile; r += kThreads) seen[r] = 0;
  __syncthreads();
  const int64_t jend = p.causal ? min(p.len_k, i0 + rows) : p.len_k;
  const int64_t base = b * p.mask_stride[0] + h * p.mask_stride[1];
  for (int64_t j = tid; j < jend; j += kThreads) {
    float best = -INFINITY;
    for (int r = 0; r < eval_rows; ++r) {
      const int64_t i = i0 + r;
      if (p.causal && j > i) continue;
      const int64_t off = base + i * p.mask_stride[2] + j * p.mask_stride[3];
      const float x = p.mask_kind == FP4ATTN_MASK_BOOL
                          ? (static_cast<const uint8_t *>(p.mask)[off] ? 0.0f : -INFINITY)
                          : load_as_float(p.mask, p.mask_dtype, off);
      if (x > -INFINITY) { /* false for NaN: a NaN entry sees nothing */
        seen[r] = 1;
        best = fmaxf(best, x);
      }
    }
    if (best > -INFINITY) atomicMax(&w.kbias[bhk * w.nkp + j], float_key(best));
  }
  __syncthreads();
  if (tid < 32) {
    int c = 0;
    for (int r = tid; r < rows; r += 32) c += seen[eval_rows == 1 ? 0 : r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    if (tid == 0) {
      count = c;
      w.qcount[item] = (float)c;
    }
  }
  __syncthreads();
  const int cnt = count;
  if (cnt == 0 || cnt == rows || tid >= DP) return;
  float mean = 0.0f;
  if (tid < D) {
    const T *q = static_cast<const T *>(p.q) + b * p.q_stride[0] + h * p.q_stride[1] +
                 i0 * p.q_stride[2] + tid;
    for (int r = 0; r < rows; ++r)
      if (seen[r]) mean = __fadd_rn(mean, elem_float(q[(int64_t)r * p.q_stride[2]]));
    mean = __fdiv_rn(mean, (float)cnt);
  }
  w.qmask[item * DP + tid] = mean;
}

/* Kernel 3 of 5 (SPEC 4.3, V smoothing): one block per 128-key chunk c = bh x nkt + kt. The scores
 * s_j = scale * (qm . K_j): DP/8 lanes per key, 8 columns each (FMA), summed by a butterfly over
 * those lanes; M_c = max s_j (NaN-propagating), e_j = exp(s_j - M_c), and thread d < D sums
 * e_j x V_j[d] over the keys in increasing order (thread 0 also l_c = sum e_j), one rounding per
 * product and per sum. K and V are read again through L2, like the quantize kernel. */
template <typename T, int DP>
__global__ void __launch_bounds__(kThreads) vbar_chunk_kernel(AttnArgs a, StreamParams f) {
  __shared__ float qm[DP];
  __shared__ float e[kTile];
  __shared__ float red[kThreads / 32];
  const fp4attn_attention_params &p = a.p;
  const AttnWorkspace &w = a.ws;
  const int64_t c = blockIdx.x, bh = c / w.nkt, kt = c % w.nkt;
  const int64_t b = bh / p.heads_kv, h = bh % p.heads_kv;
  const int D = (int)p.head_dim, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rows = (int)min((int64_t)kTile, p.len_k - kt * kTile);
  for (int i = tid; i < DP; i += kThreads) qm[i] = __ldcg(&w.qmean[bh * DP + i]);
  __syncthreads();
  constexpr int LK = DP / 8, KPW = 32 / LK; /* lanes per key, keys per warp and step */
  const int cg = lane % LK;
  const T *k = static_cast<const T *>(p.k) + b * p.k_stride[0] + h * p.k_stride[1] +
               kt * kTile * p.k_stride[2];
#pragma unroll 4
  for (int j0 = warp * KPW; j0 < kTile; j0 += kThreads / 32 * KPW) {
    const int j = j0 + lane / LK;
    float dot = 0.0f;
    if (j < rows && cg * 8 < D) {
      float v[8];
      raw8_to_float<T>(raw8_global<T, true>(k + (int64_t)j * p.k_stride[2] + cg * 8), v);
#pragma unroll
      for (int i = 0; i < 8; ++i) dot = fmaf(qm[cg * 8 + i], v[i], dot);
    }
#pragma unroll
    for (int o = LK / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (cg == 0) {
      float sj = -INFINITY;
      if (j < rows) {
        sj = __fmul_rn(p.scale, dot);
        const int64_t jk = kt * kTile + j;
        if (p.mask_kind != FP4ATTN_MASK_NONE) { /* the key's bias (vbar_mask_kernel) */
          const unsigned int kb = __ldcg(&w.kbias[bh * w.nkp + jk]);
          sj = __fadd_rn(sj, kb == 0u ? -INFINITY : key_float(kb));
        } else if (p.causal) { /* causal only: keys j < Nq are seen (by row j), the rest not */
          sj = __fadd_rn(sj, jk < p.len_q ? 0.0f : -INFINITY);
        }
      }
      e[j] = sj;
    }
  }
  __syncthreads();
  float m = tid < kTile ? e[tid] : -INFINITY;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fp4attn_nanmax(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
  for (int i = 1; i < kThreads / 32; ++i) m = fp4attn_nanmax(m, red[i]);
  /* masks: a chunk of keys no row sees (M_c = -inf) gets exp(-inf - 0) = 0, not NaN */
  const bool masked = p.mask_kind != FP4ATTN_MASK_NONE || p.causal;
  const float ref = masked && m == -INFINITY ? 0.0f : m;
  if (tid < rows) e[tid] = expf(e[tid] - ref);
  __syncthreads();
  if (tid < DP) {
    float acc = 0.0f, l = 0.0f;
    if (tid < D) {
      const T *v = static_cast<const T *>(p.v) + b * p.v_stride[0] + h * p.v_stride[1] +
                   kt * kTile * p.v_stride[2] + tid;
#pragma unroll 8
      for (int j = 0; j < rows; ++j) {
        acc = __fadd_rn(acc, __fmul_rn(e[j], elem_float(__ldcg(v + (int64_t)j * p.v_stride[2]))));
        l = __fadd_rn(l, e[j]);
      }
    }
    w.vpart[c * DP + tid] = acc;
    if (tid == 0) {
      w.vml[2 * c] = m;
      w.vml[2 * c + 1] = l;
    }
  }
}

/* Kernel 4 of 5 (SPEC 4.3): one block per K/V head. M = max_c M_c, then in chunk order
 * L = sum exp(M_c - M) l_c and A = sum exp(M_c - M) a_c (every thread the same L), vbar = A / L,
 * 0 where M or vbar is not finite; the amax of V - vbar from the column minima and maxima
 * (monotone rounding: max |fl(x - c)| = max(|fl(max x - c)|, |fl(c - min x)|)), NaN where V holds
 * a NaN, and the global scales of V - vbar. */
template <int DP>
__global__ void __launch_bounds__(kThreads) vbar_finalize_kernel(AttnArgs a, StreamParams f) {
  __shared__ float small[32];
  const AttnWorkspace &w = a.ws;
  const int64_t bh = blockIdx.x, nkt = w.nkt;
  const int D = (int)a.p.head_dim, tid = threadIdx.x;
  const float *ml = w.vml + bh * nkt * 2, *part = w.vpart + bh * nkt * DP + tid;
  float m = -INFINITY;
  for (int64_t c = 0; c < nkt; ++c) m = fp4attn_nanmax(m, __ldcg(&ml[2 * c]));
  float l = 0.0f, acc = 0.0f;
  const bool masked = a.p.mask_kind != FP4ATTN_MASK_NONE || a.p.causal;
  for (int64_t c = 0; c < nkt; ++c) {
    /* masks: no visible key at all (M_c = M = -inf) weighs 0, not NaN */
    const float mc = __ldcg(&ml[2 * c]);
    const float wc = masked && mc == -INFINITY ? 0.0f : expf(mc - m);
    l = __fadd_rn(l, __fmul_rn(wc, __ldcg(&ml[2 * c + 1])));
    if (tid < D) acc = __fadd_rn(acc, __fmul_rn(wc, __ldcg(&part[c * DP])));
  }
  float am = 0.0f;
  if (tid < DP) {
    float vb = 0.0f;
    if (tid < D) {
      vb = __fdiv_rn(acc, l);
      if (!(isfinite(m) && isfinite(vb))) vb = 0.0f;
      const float mn = key_float(~__ldcg(&f.vmin[bh * DP + tid]));
      const float mx = key_float(__ldcg(&f.vmax[bh * DP + tid]));
      am = fp4attn_nanmax(fabsf(__fsub_rn(mx, vb)), fabsf(__fsub_rn(vb, mn)));
    }
    w.vbar[bh * DP + tid] = vb;
  }
  am = block_nanmax(am, small);
  if (tid == 0) {
    if (__ldcg(&f.vnan[bh])) am = NAN;
    fp4attn_global_scales(am, &kv_scales(w, bh)[kVEnc], &kv_scales(w, bh)[kVDec]);
  }
}

/* Copies rows [0, rows) of a chunk (row stride `stride` elements in global memory, D elements
 * per row, 16-byte aligned) into shared memory with row stride D, 16 bytes per cp.async. */
template <typename T>
__device__ __forceinline__ void copy_chunk_async(T *dst, const T *src, int64_t stride, int rows,
                                                 int D) {
  const int upr = D * (int)sizeof(T) / 16; /* 16-byte units per row, <= 64 */
  const int rpi = kThreads / upr;          /* rows per pass */
  const int tid = threadIdx.x;
  if (tid >= rpi * upr) return;
  const int u = tid % upr;
  for (int r = tid / upr; r < rows; r += rpi)
    cp_async_16(reinterpret_cast<char *>(dst + (int64_t)r * D) + 16 * u,
                reinterpret_cast<const char *>(src + (int64_t)r * stride) + 16 * u);
}

/* Ks^ of one piece of kRows tokens (a 128-token chunk, or half of one) in shared memory (row
 * stride D): job (row r, 8-column group g), lanes 2i and 2i+1 hold the two halves of one
 * 16-column block. Rows past `rows` and columns past D are zeros. */
template <typename T, int DP, int kRows>
__device__ void quantize_k_chunk(const T *kbuf, int rows, int D, const PrepassShared &sh,
                                 __half *dst) {
  constexpr int G = DP / 8;
  const int g = threadIdx.x % G; /* the same group in every job of this thread */
  const bool live_g = g * 8 < D;
  float kb[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) kb[e] = live_g ? sh.kbar[g * 8 + e] : 0.0f;
  const float enck = sh.enck;
#pragma unroll 2
  for (int r = threadIdx.x / G; r < kRows; r += kThreads / G) {
    float xs[8];
    if (live_g && r < rows) {
      float v[8];
      raw8_to_float<T>(raw8_shared<T>(kbuf + r * D + g * 8), v);
#pragma unroll
      for (int e = 0; e < 8; ++e) xs[e] = __fmul_rn(__fsub_rn(v[e], kb[e]), enck);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) xs[e] = 0.0f;
    }
    const uint4 o = quantize_half_block(xs, 1, &sh.tab);
    __stcs(reinterpret_cast<uint4 *>(dst + (int64_t)r * DP + g * 8), o);
  }
}

/* Jobs of quantize_v_chunk per piece of kRows tokens: 8-channel groups x 8-token half blocks
 * (whole warps). */
template <int DP, int kRows>
constexpr int v_jobs_per_chunk() {
  return DP / 8 * (kRows / 8);
}

/* V^ of one piece of kRows tokens in shared memory (row stride D) into the tile-major V^T
 * [Dp][128] (dst: the piece's first token column): job (8-channel group g,
 * 8-token half block hh), this thread's jobs first_job, first_job + 256, ... < NJ (its thread
 * index, or where two chunks share the block, its index within its half); the two halves of a
 * 16-token block sit GW lanes apart in one warp, and GW consecutive lanes read GW consecutive
 * 16-byte pieces of one token row. */
template <typename T, int DP, int kRows>
__device__ void quantize_v_chunk(const T *vbuf, int rows, int D, const PrepassShared &sh,
                                 __half *dst, int first_job) {
  constexpr int G = DP / 8, GW = G < 16 ? G : 16, NJ = v_jobs_per_chunk<DP, kRows>();
  const float encv = sh.encv;
  for (int j = first_job; j < NJ; j += kThreads) {
    const int gl = j % GW, hb = (j / GW) & 1, rest = j / (2 * GW);
    const int g = (rest % (G / GW)) * GW + gl, hh = (rest / (G / GW)) * 2 + hb;
    const bool live_g = g * 8 < D;
    Raw8<T> raw[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int t = hh * 8 + i;
      raw[i] = (live_g && t < rows) ? raw8_shared<T>(vbuf + t * D + g * 8) : raw8_zero<T>();
    }
#pragma unroll
    for (int ch = 0; ch < 8; ++ch) {
      const float vb = live_g ? sh.vbar[g * 8 + ch] : 0.0f;
      float xs[8];
#pragma unroll
      for (int i = 0; i < 8; ++i)
        xs[i] = hh * 8 + i < rows ? __fmul_rn(__fsub_rn(raw8_elem<T>(raw[i], ch), vb), encv) : 0.0f;
      const uint4 o = quantize_half_block(xs, GW, &sh.tab);
      __stcs(reinterpret_cast<uint4 *>(dst + (int64_t)(g * 8 + ch) * kTile + hh * 8), o);
    }
  }
}

/* 128-token K/V chunks per quantize item: as many as fill 64 KB of shared memory with K and V (2 at
 * head dim 64 in 16-bit types, else 1), so that small head dims move as many bytes per item, and
 * pay the item's fixed costs (barriers, kbar) as rarely, as head dim 128. */
template <typename T, int DP>
constexpr int chunks_per_item() {
  return 2 * kTile * DP * (int)sizeof(T) <= 32768 ? 2 : 1;
}

/* Token rows per quantize item: its chunks, or half a chunk where one chunk of K and V would not
 * fit in shared memory (fp32 at head dim 256: 2 x 64 x 256 x 4 = 128 KB). */
template <typename T, int DP>
constexpr int item_rows() {
  return 2 * kTile * DP * (int)sizeof(T) > 131072 ? kTile / 2 : chunks_per_item<T, DP>() * kTile;
}

/* Ks^ and V^ of `chunks` consecutive 128-token chunks (or of one half chunk) in shared memory
 * (`rows` token rows of stride D; kdst / vdst: the item's place in kdq / vdq). Two chunks' V at
 * head dim 64 are quantized side by side, each on its half of the block (one chunk has only 128
 * jobs there). */
template <typename T, int DP>
__device__ __forceinline__ void quantize_item_k(const T *k, int chunks, int rows, int D,
                                                const PrepassShared &sh, __half *kdst) {
  constexpr int P = item_rows<T, DP>() < kTile ? item_rows<T, DP>() : kTile; /* rows per piece */
  for (int c = 0; c < chunks; ++c)
    quantize_k_chunk<T, DP, P>(k + c * kTile * D, min(P, rows - c * kTile), D, sh,
                               kdst + (int64_t)c * kTile * DP);
}
template <typename T, int DP>
__device__ __forceinline__ void quantize_item_v(const T *v, int chunks, int rows, int D,
                                                const PrepassShared &sh, __half *vdst) {
  constexpr int C = chunks_per_item<T, DP>();
  constexpr int P = item_rows<T, DP>() < kTile ? item_rows<T, DP>() : kTile; /* rows per piece */
  constexpr int kVJobs = v_jobs_per_chunk<DP, P>();
  const int tid = threadIdx.x;
  if (C > 1 && C * kVJobs <= kThreads) {
    const int c = tid / kVJobs;
    if (c < chunks)
      quantize_v_chunk<T, DP, P>(v + c * kTile * D, min(P, rows - c * kTile), D, sh,
                                 vdst + (int64_t)c * DP * kTile, tid % kVJobs);
  } else {
    for (int c = 0; c < chunks; ++c)
      quantize_v_chunk<T, DP, P>(v + c * kTile * D, min(P, rows - c * kTile), D, sh,
                                 vdst + (int64_t)c * DP * kTile, tid);
  }
}

/* Starts the copy of K or V of quantize item `item` (item_rows rows of one head) into `buf` (one
 * cp.async group). */
template <typename T, int DP>
__device__ __forceinline__ void load_item(const AttnArgs &a, const StreamParams &f, int64_t item,
                                          bool is_v, T *buf) {
  const fp4attn_attention_params &p = a.p;
  const int64_t bh = item / f.items_per_head, r0 = item % f.items_per_head * item_rows<T, DP>();
  const int64_t b = bh / p.heads_kv, h = bh % p.heads_kv;
  const int rows = (int)min((int64_t)item_rows<T, DP>(), p.len_k - r0);
  const int64_t *st = is_v ? p.v_stride : p.k_stride;
  const T *src = static_cast<const T *>(is_v ? p.v : p.k) + b * st[0] + h * st[1] + r0 * st[2];
  copy_chunk_async<T>(buf, src, st[2], rows, (int)p.head_dim);
  cp_async_commit();
}

/* Quantize blocks per SM: as many as the item buffers (K and V) allow. */
template <typename T, int DP>
constexpr int quantize_min_blocks() {
  constexpr int kItemBytes = 2 * item_rows<T, DP>() * DP * (int)sizeof(T);
  return kItemBytes <= 32768 ? 4 : (kItemBytes <= 65536 ? 3 : 1);
}

/* Kernel 5 of 5: Ks^ and (V - vbar)^ of every quantize item (item_rows rows), K and V read again
 * (from L2 where the statistics kernel left them). Persistent blocks take items n_kv - 1 -
 * blockIdx.x, n_kv - 1 - blockIdx.x - grid, ...: the last chunks that the statistics kernel read
 * come first, while they are still in L2. K and V go through shared memory by cp.async; the next
 * item's K (V) is copied while this item's V (K) is quantized. */
template <typename T, int DP>
__global__ void __launch_bounds__(kThreads, quantize_min_blocks<T, DP>())
    stream_quantize_kernel(AttnArgs a, StreamParams f) {
  constexpr int C = chunks_per_item<T, DP>(), R = item_rows<T, DP>();
  extern __shared__ uint4 item_buffers[];
  __shared__ PrepassShared sh;
  const fp4attn_attention_params &p = a.p;
  const AttnWorkspace &w = a.ws;
  const int D = (int)p.head_dim;
  T *kbuf = reinterpret_cast<T *>(item_buffers);
  T *vbuf = kbuf + R * D;
  fill_scale_tables(&sh.tab);
  int64_t i = blockIdx.x;
  if (i < f.n_kv) {
    load_item<T, DP>(a, f, f.n_kv - 1 - i, false, kbuf);
    load_item<T, DP>(a, f, f.n_kv - 1 - i, true, vbuf);
  }
  for (; i < f.n_kv; i += gridDim.x) {
    const int64_t item = f.n_kv - 1 - i, next = item - gridDim.x;
    const bool more = next >= 0;
    const int64_t bh = item / f.items_per_head, r0 = item % f.items_per_head * R;
    const int chunks = (int)min((int64_t)C, w.nkt - r0 / kTile);
    /* <= 0 for a half-chunk item wholly past len_k: it writes its padding rows as zeros */
    const int rows = (int)min((int64_t)R, p.len_k - r0);
    __syncthreads(); /* the previous item is done with sh.kbar and sh.vbar */
    for (int c = threadIdx.x; c < DP; c += kThreads) {
      sh.kbar[c] = w.kbar[bh * DP + c];
      sh.vbar[c] = w.vbar[bh * DP + c];
    }
    if (threadIdx.x == 0) sh.enck = kv_scales(w, bh)[kKEnc], sh.encv = kv_scales(w, bh)[kVEnc];
    cp_async_wait_group<1>(); /* K has landed; V may still be in flight */
    __syncthreads();
    quantize_item_k<T, DP>(kbuf, chunks, rows, D, sh, w.kdq + (bh * w.nkp + r0) * DP);
    __syncthreads(); /* kbuf free */
    if (more) {
      load_item<T, DP>(a, f, next, false, kbuf);
      cp_async_wait_group<1>(); /* V has landed; the next K may be in flight */
    } else {
      cp_async_wait_all();
    }
    __syncthreads();
    quantize_item_v<T, DP>(vbuf, chunks, rows, D, sh,
                           w.vdq + (bh * w.nkt + r0 / kTile) * DP * kTile + r0 % kTile);
    __syncthreads(); /* vbuf free */
    if (more) load_item<T, DP>(a, f, next, true, vbuf);
  }
}

typedef void (*PrepassKernel)(AttnArgs, StreamParams);

struct StreamKernels {
  PrepassKernel stats, vbar_mask, finalize, vbar_chunk, vbar_finalize, quantize;
  int stats_threads; /* block size of `stats` */
  int item_rows;     /* token rows per quantize item */
};

template <typename T, int DP>
StreamKernels stream_kernels() {
  return {stream_stats_kernel<T, DP>, vbar_mask_kernel<T, DP>,  stream_finalize_kernel<DP>,
          vbar_chunk_kernel<T, DP>,   vbar_finalize_kernel<DP>, stream_quantize_kernel<T, DP>,
          stats_threads<DP>(),        item_rows<T, DP>()};
}

template <typename T>
StreamKernels stream_kernels_for_dp(int64_t dp) {
  if (dp == 64) return stream_kernels<T, 64>();
  if (dp == 128) return stream_kernels<T, 128>();
  return stream_kernels<T, 256>();
}

/* The kernels for a's dtype and padded head dim; a's inputs have vector rows (staged where the
 * caller's do not). */
StreamKernels stream_kernels_for(const AttnArgs &a) {
  return a.p.dtype == FP4ATTN_FLOAT16    ? stream_kernels_for_dp<__half>(a.ws.dp)
         : a.p.dtype == FP4ATTN_BFLOAT16 ? stream_kernels_for_dp<__nv_bfloat16>(a.ws.dp)
                                         : stream_kernels_for_dp<float>(a.ws.dp);
}

/* Blocks of `kernel` with `smem` bytes of dynamic shared memory that fit on one SM of the current
 * device, 0 where it cannot run there. Sets the kernel's shared-memory attributes once and caches
 * the answer, so that a call costs no driver round trips. The attribute is the kernel's maximum:
 * call it with one `smem` per kernel (launches may use less). */
int resident_blocks_per_sm(PrepassKernel kernel, size_t smem) {
  struct Entry {
    int dev;
    PrepassKernel kernel;
    size_t smem;
    int blocks;
  };
  static Entry cache[32];
  static int used = 0;
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  for (int i = 0; i < used; ++i)
    if (cache[i].dev == dev && cache[i].kernel == kernel && cache[i].smem == smem)
      return cache[i].blocks;
  int optin = 0, blocks = 0;
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (!(smem + sizeof(PrepassShared) <= (size_t)optin &&
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) ==
            cudaSuccess &&
        cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100) ==
            cudaSuccess &&
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, smem) ==
            cudaSuccess))
    blocks = 0;
  cudaGetLastError(); /* no sticky error from a refused attribute */
  if (used < 32) cache[used++] = {dev, kernel, smem, blocks};
  return blocks;
}

/* Copies n rows (b, h, t) of d elements of x (any strides and alignment) into contiguous rows of
 * d8 = round_up(d, 8) elements at dst, zeros from column d on: one thread per 8-element group.
 * Bits: the element's storage type (a bit copy is exact). */
template <typename Bits>
__global__ void __launch_bounds__(kThreads)
    stage_rows_kernel(const Bits *x, int64_t s0, int64_t s1, int64_t s2, int64_t heads, int64_t len,
                      int d, int d8, int64_t n, Bits *dst) {
  const int groups = d8 / 8;
  for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < n * groups;
       i += (int64_t)gridDim.x * kThreads) {
    const int64_t row = i / groups, t = row % len, bh = row / len;
    const int c0 = (int)(i % groups) * 8;
    const Bits *src = x + bh / heads * s0 + bh % heads * s1 + t * s2;
    alignas(16) Bits v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = c0 + e < d ? src[c0 + e] : (Bits)0;
    uint4 *out = reinterpret_cast<uint4 *>(dst + row * d8 + c0);
#pragma unroll
    for (int k = 0; k < (int)sizeof(v) / 16; ++k) out[k] = reinterpret_cast<const uint4 *>(v)[k];
  }
}

int64_t staged_head_dim(const fp4attn_attention_params &p) {
  return round_up(p.head_dim, 8);
}

int64_t staged_bytes(const fp4attn_attention_params &p, int64_t heads, int64_t len) {
  return round_up(p.batch * heads * len * staged_head_dim(p) * dtype_size(p.dtype), 256);
}

bool needs_staging(const fp4attn_attention_params &p) {
  return !(vector_rows(p.q, p.q_stride, p.head_dim) && vector_rows(p.k, p.k_stride, p.head_dim) &&
           vector_rows(p.v, p.v_stride, p.head_dim));
}

/* Enqueues the staging copy of one operand and points `x`/`stride` at it. */
fp4attn_status stage_operand(const fp4attn_attention_params &p, int64_t heads, int64_t len,
                             const void *&x, int64_t (&stride)[3], char *dst, cudaStream_t s) {
  const int d8 = (int)staged_head_dim(p);
  const int64_t n = p.batch * heads * len, jobs = n * (d8 / 8);
  const unsigned grid = (unsigned)min(ceil_div(jobs, kThreads), (int64_t)sm_count() * 8);
  const int d = (int)p.head_dim;
  if (p.dtype == FP4ATTN_FLOAT32)
    stage_rows_kernel<uint32_t><<<grid, kThreads, 0, s>>>(
        static_cast<const uint32_t *>(x), stride[0], stride[1], stride[2], heads, len, d, d8, n,
        reinterpret_cast<uint32_t *>(dst));
  else
    stage_rows_kernel<uint16_t><<<grid, kThreads, 0, s>>>(
        static_cast<const uint16_t *>(x), stride[0], stride[1], stride[2], heads, len, d, d8, n,
        reinterpret_cast<uint16_t *>(dst));
  x = dst;
  stride[0] = heads * len * d8;
  stride[1] = len * d8;
  stride[2] = d8;
  return launch_status("attention: pre-pass staging kernel");
}

/* The five kernels on a's inputs, which have vector rows. */
fp4attn_status launch_kernels(const AttnArgs &a, bool fp16_operands, cudaStream_t s) {
  const fp4attn_attention_params &p = a.p;
  const AttnWorkspace &w = a.ws;
  const StreamKernels k = stream_kernels_for(a);
  const int64_t bhk = p.batch * p.heads_kv, bhq = p.batch * p.heads_q;
  StreamParams f;
  f.vnan =
      reinterpret_cast<unsigned int *>(static_cast<unsigned long long *>(w.sync) + kSyncTickets);
  f.kmin = f.vnan + bhk;
  f.kmax = f.kmin + bhk * w.dp;
  f.vmin = f.kmax + bhk * w.dp;
  f.vmax = f.vmin + bhk * w.dp;
  f.n_q = query_block_count(p, kTile);
  f.items_per_head = ceil_div(w.nkp, (int64_t)k.item_rows);
  f.n_kv = bhk * f.items_per_head;
  const int64_t stats_blocks = f.n_q + 2 * bhk * w.nkt;
  if (stats_blocks > 0x7FFFFFFFLL || bhk + bhq > 0x7FFFFFFFLL || bhk * w.nkt > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "attention: problem too large for one grid");
  k.stats<<<(unsigned)stats_blocks, (unsigned)k.stats_threads, 0, s>>>(a, f);
  fp4attn_status st = launch_status("attention: pre-pass statistics kernel");
  if (st.code != FP4ATTN_OK) return st;
  if (p.mask_kind != FP4ATTN_MASK_NONE) { /* the masks of vbar, before qm (finalize) */
    if (cudaMemsetAsync(w.kbias, 0, sizeof(unsigned int) * (size_t)(bhk * w.nkp), s) != cudaSuccess)
      return launch_status("attention: vbar key bias reset");
    k.vbar_mask<<<(unsigned)f.n_q, kThreads, 0, s>>>(a, f);
    st = launch_status("attention: pre-pass vbar mask kernel");
    if (st.code != FP4ATTN_OK) return st;
  }
  k.finalize<<<(unsigned)(bhk + bhq), kThreads, 0, s>>>(a, f);
  st = launch_status("attention: pre-pass finalize kernel");
  if (st.code != FP4ATTN_OK) return st;
  k.vbar_chunk<<<(unsigned)(bhk * w.nkt), kThreads, 0, s>>>(a, f);
  st = launch_status("attention: pre-pass V smoothing kernel");
  if (st.code != FP4ATTN_OK) return st;
  k.vbar_finalize<<<(unsigned)bhk, kThreads, 0, s>>>(a, f);
  st = launch_status("attention: pre-pass V smoothing finalize kernel");
  if (st.code != FP4ATTN_OK || !fp16_operands) return st;
  /* the item buffers hold rows of head_dim elements; the attribute and the occupancy are those of
   * the padded head dim, the kernel's largest */
  const size_t es = (size_t)dtype_size(p.dtype);
  const size_t smem = 2 * (size_t)k.item_rows * (size_t)p.head_dim * es;
  const size_t smem_max = 2 * (size_t)k.item_rows * (size_t)w.dp * es;
  const int per_sm = resident_blocks_per_sm(k.quantize, smem_max);
  if (per_sm < 1)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "attention: the pre-pass needs %zu bytes of shared memory per block",
                         smem_max + sizeof(PrepassShared));
  const int64_t grid = min((int64_t)per_sm * sm_count(), f.n_kv);
  k.quantize<<<(unsigned)grid, kThreads, smem, s>>>(a, f);
  return launch_status("attention: pre-pass quantize kernel");
}

}  // namespace

int64_t fp4attn_cuda::prepass_staging_bytes(const fp4attn_attention_params &p) {
  if (!needs_staging(p)) return 0;
  return staged_bytes(p, p.heads_q, p.len_q) + 2 * staged_bytes(p, p.heads_kv, p.len_k);
}

fp4attn_status fp4attn_cuda::launch_prepass(const AttnArgs &a, bool fp16_operands, void *staging,
                                            cudaStream_t s) {
  /* the statistics kernel's atomicMax keys and the sm90 kernel's work ticket */
  const size_t sync_bytes = attn_sync_bytes(a.p.batch * a.p.heads_kv, a.ws.dp);
  if (cudaMemsetAsync(a.ws.sync, 0, sync_bytes, s) != cudaSuccess)
    return launch_status("attention: counter reset");
  if (!needs_staging(a.p)) return launch_kernels(a, fp16_operands, s);
  /* Unaligned rows or a head dim that is no multiple of 8: the kernels read a contiguous copy with
   * the head dim zero-padded to a multiple of 8 (the padding columns get mean 0 and quantize to 0,
   * as beyond head_dim anyway). */
  AttnArgs staged = a;
  fp4attn_attention_params &p = staged.p;
  char *dst = static_cast<char *>(staging);
  fp4attn_status st = stage_operand(a.p, p.heads_q, p.len_q, p.q, p.q_stride, dst, s);
  if (st.code != FP4ATTN_OK) return st;
  dst += staged_bytes(a.p, p.heads_q, p.len_q);
  st = stage_operand(a.p, p.heads_kv, p.len_k, p.k, p.k_stride, dst, s);
  if (st.code != FP4ATTN_OK) return st;
  dst += staged_bytes(a.p, p.heads_kv, p.len_k);
  st = stage_operand(a.p, p.heads_kv, p.len_k, p.v, p.v_stride, dst, s);
  if (st.code != FP4ATTN_OK) return st;
  p.head_dim = staged_head_dim(a.p);
  staged.vec_q = staged.vec_k = staged.vec_v = true;
  return launch_kernels(staged, fp16_operands, s);
}
