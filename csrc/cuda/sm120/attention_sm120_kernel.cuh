/*
 * FP4 attention forward for sm_120a (SPEC 4.4-4.6), both matmuls on the block-scaled FP4 MMA.
 *
 * Work: one CTA of 8 warps takes one (batch, q head, 128-row query block) at a time, from a
 * persistent grid sized from the SM count (heaviest causal blocks first); warp w owns rows
 * 16w..16w+15. The 128-row CTA block is the SPEC query-smoothing block, so qbar is one vector.
 *
 * Per 128-key tile j (double-buffered cp.async of the pre-quantized K/V tile into shared memory,
 * the copy of tile j+1 in flight while tile j computes):
 *   - qbar . K_j (SPEC 4.4 correction) by FP32 FMAs from the caller's K, into shared memory
 *   - S = Q^ K^T: 16 n-tiles x Dp/64 MMAs per warp; Q's fragments and scale words stay in
 *     registers for the whole block; every lane reads its K fragment with one 8/16-byte load
 *   - epilogue in registers: S = scale * (dQ dK acc + qbar.K), masks (causal, padding,
 *     attn_mask), per-tile row max t, online-softmax statistics (SPEC 4.5)
 *   - P quantization in registers: thanks to the K token permutation a thread's 8 score columns
 *     of a 32-key group are 8 consecutive tokens, i.e. one A-operand register of the PV MMA;
 *     blocks of 16 keys are the two threads t = 2m, 2m+1 (one shuffle for the block max) and the
 *     A scale words are assembled with one more shuffle (thread-id-a selects the k-step)
 *   - O = alpha O + (exp(t - m_new) / 2688) (P^ V^_j dV): 2 MMAs per 8 output channels into a
 *     fresh accumulator, then one FMA pair per element
 * Finally O / l + vbar (V smoothing, SPEC 4.3; 0 for rows that see no key),
 * LSE = m + log l + scale (q - qbar) . kbar.
 */
#ifndef FP4ATTN_SM120_ATTENTION_KERNEL_CUH
#define FP4ATTN_SM120_ATTENTION_KERNEL_CUH

#include <math.h>

#include "mma_fp4.cuh"
#include "sm120_common.cuh"

namespace fp4attn_sm120 {

using fp4attn_cuda::cp_async_16;
using fp4attn_cuda::cp_async_commit;
using fp4attn_cuda::cp_async_wait_group;
using fp4attn_cuda::load_as_float;

__device__ __forceinline__ float fast_exp(float x) {
  /* e^x as 2^(x log2 e); ex2.approx: about 2 ulp. exp(-inf) = 0. */
  return exp2f(x * 1.4426950408889634f);
}

template <int DP>
struct Smem {
  static constexpr int KC = 64 * DP; /* K codes of one tile: 128 keys x DP/2 bytes */
  static constexpr int KS = 8 * DP;  /* K scales: 128 x DP/16 */
  static constexpr int VC = 64 * DP; /* V^T codes: DP channels x 64 bytes */
  static constexpr int VS = 8 * DP;  /* V scales: DP x 8 */
  static constexpr int STAGE = KC + KS + VC + VS;
  static constexpr int QBAR = 2 * STAGE;     /* float[DP] */
  static constexpr int BIAS = QBAR + 4 * DP; /* float[128] */
  static constexpr int TOTAL = BIAS + 4 * kBlockKV;
};

template <int DP>
__device__ __forceinline__ void load_tile_async(uint8_t *stage, const KernelParams &p, int64_t bkv,
                                                int64_t j) {
  using S = Smem<DP>;
  const int64_t tile = bkv * p.nkt + j;
  const uint8_t *src[4] = {p.kc + tile * S::KC, p.ks + tile * S::KS, p.vc + tile * S::VC,
                           p.vs + tile * S::VS};
  const int off[4] = {0, S::KC, S::KC + S::KS, S::KC + S::KS + S::VC};
  const int len[4] = {S::KC, S::KS, S::VC, S::VS};
#pragma unroll
  for (int s = 0; s < 4; ++s)
    for (int i = threadIdx.x * 16; i < len[s]; i += kThreads * 16)
      cp_async_16(stage + off[s] + i, src[s] + i);
}

/* Mask value to add to one score, or -inf if the key is not visible. */
__device__ __forceinline__ float mask_term(const KernelParams &p, int64_t mbase, int64_t row,
                                           int64_t key) {
  if (p.attn.causal && key > row) return -INFINITY;
  if (p.attn.mask_kind == FP4ATTN_MASK_BOOL) {
    const uint8_t m = static_cast<const uint8_t *>(
        p.attn.mask)[mbase + row * p.attn.mask_stride[2] + key * p.attn.mask_stride[3]];
    return m ? 0.0f : -INFINITY;
  }
  if (p.attn.mask_kind == FP4ATTN_MASK_ADDITIVE)
    return load_as_float(p.attn.mask, p.attn.mask_dtype,
                         mbase + row * p.attn.mask_stride[2] + key * p.attn.mask_stride[3]);
  return 0.0f;
}

/* phi_local of 8 values of one row (this thread's half of a 16-key block; the partner is lane^1):
 * returns the 8 packed codes and the block's E4M3 scale byte. */
__device__ __forceinline__ uint32_t quantize_p8(const float v[8], uint32_t *scale_byte) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = fp4attn_nanmax(m, v[i]); /* v >= 0 */
  m = fp4attn_nanmax(m, __shfl_xor_sync(0xffffffffu, m, 1));
  const uint8_t s = fp4attn_e4m3_encode_sat(__fdiv_rn(m, 6.0f));
  const float sv = fp4attn_e4m3_decode(s);
  uint32_t w = 0;
  if (sv != 0.0f) {
    const float r = __fdiv_rn(1.0f, sv);
#pragma unroll
    for (int i = 0; i < 8; ++i) w |= (uint32_t)fp4attn_e2m1_encode(__fmul_rn(v[i], r)) << (4 * i);
  }
  *scale_byte = s;
  return w;
}

template <int DP>
__global__ void __launch_bounds__(kThreads, 1) attention_sm120_kernel(const KernelParams p) {
  constexpr int NKS = DP / 64; /* k-steps of QK^T */
  constexpr int NB = DP / 16;  /* Q/K scale bytes per row */
  constexpr int NVT = DP / 8;  /* output channel tiles */
  constexpr int NQS = (NKS + 1) / 2;
  using S = Smem<DP>;
  extern __shared__ __align__(16) uint8_t smem[];
  float *qbar_s = reinterpret_cast<float *>(smem + S::QBAR);
  float *bias_s = reinterpret_cast<float *>(smem + S::BIAS);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t bhq = p.attn.batch * p.attn.heads_q;

  for (int64_t item = blockIdx.x; item < p.num_items; item += gridDim.x) {
    const int64_t qb = p.nqb - 1 - item / bhq; /* heaviest (causal) blocks first */
    const int64_t bh = item % bhq, b = bh / p.attn.heads_q, h = bh % p.attn.heads_q;
    const int64_t bkv = b * p.attn.heads_kv + h / p.G;
    const int64_t row0 = qb * kBlockQ + warp * 16; /* first row of this warp */
    const int64_t rg = row0 + g, rg8 = rg + 8;     /* this thread's two rows */
    const bool warp_rows = row0 < p.attn.len_q;
    int64_t ntiles = p.nkt;
    if (p.attn.causal) {
      const int64_t last_row = (qb * kBlockQ + kBlockQ - 1) < (p.attn.len_q - 1)
                                   ? (qb * kBlockQ + kBlockQ - 1)
                                   : (p.attn.len_q - 1);
      const int64_t lim = last_row / kBlockKV + 1;
      ntiles = lim < ntiles ? lim : ntiles;
    }

    __syncthreads(); /* the previous item is done with shared memory */
    if (tid < DP) qbar_s[tid] = p.qbar[(bh * p.nqb + qb) * DP + tid];
    if (ntiles > 0) load_tile_async<DP>(smem, p, bkv, 0);
    cp_async_commit();

    /* Q^ fragments and scale words (registers for the whole block) */
    uint32_t qa[NKS][4];
    uint32_t qsc[NQS];
    {
      const uint8_t *q0 = p.qc + (bh * p.nq_pad + rg) * (DP / 2);
      const uint8_t *q8 = q0 + 8 * (DP / 2);
#pragma unroll
      for (int ks = 0; ks < NKS; ++ks) {
        qa[ks][0] = *reinterpret_cast<const uint32_t *>(q0 + 32 * ks + 4 * t);
        qa[ks][1] = *reinterpret_cast<const uint32_t *>(q8 + 32 * ks + 4 * t);
        qa[ks][2] = *reinterpret_cast<const uint32_t *>(q0 + 32 * ks + 16 + 4 * t);
        qa[ks][3] = *reinterpret_cast<const uint32_t *>(q8 + 32 * ks + 16 + 4 * t);
      }
      /* lane (g, t) supplies row g + 8 (t & 1) for k-step 2r + (t >> 1) (thread-id-a = ks & 1) */
      const int64_t srow = bh * p.nq_pad + row0 + g + 8 * (t & 1);
#pragma unroll
      for (int r = 0; r < NQS; ++r) {
        const int ks = 2 * r + (t >> 1);
        qsc[r] = ks < NKS ? *reinterpret_cast<const uint32_t *>(p.qs + srow * NB + 4 * ks) : 0u;
      }
    }
    const float dqk = p.dec_q[bh] * p.dec_k[bkv];
    const float dv = p.dec_v[bkv];
    const int64_t mbase = b * p.attn.mask_stride[0] + h * p.attn.mask_stride[1];
    const int64_t kbase = b * p.attn.k_stride[0] + (h / p.G) * p.attn.k_stride[1];

    float o[NVT][4];
#pragma unroll
    for (int n = 0; n < NVT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f}; /* l: this thread's part */
    __syncthreads();                                              /* qbar_s visible */

    for (int64_t j = 0; j < ntiles; ++j) {
      uint8_t *stage = smem + (j & 1) * S::STAGE;
      if (j + 1 < ntiles) load_tile_async<DP>(smem + ((j + 1) & 1) * S::STAGE, p, bkv, j + 1);
      cp_async_commit();

      /* qbar . K_j in FP32 from the keys in input precision: 2 threads per key */
      {
        const int key = tid >> 1, half = tid & 1;
        const int64_t tok = j * kBlockKV + key;
        const int hd = (int)((p.attn.head_dim + 1) / 2);
        const int c0 = half * hd,
                  c1 = (half + 1) * hd < p.attn.head_dim ? (half + 1) * hd : (int)p.attn.head_dim;
        float acc = 0.0f;
        if (tok < p.attn.len_k) {
          const int64_t base = kbase + tok * p.attn.k_stride[2];
          /* same channel order in both paths: identical sums */
          if (p.k_vec) {
            const int per = p.attn.dtype == FP4ATTN_FLOAT32 ? 4 : 8; /* elements per 16 bytes */
            const uint4 *src = reinterpret_cast<const uint4 *>(
                static_cast<const uint8_t *>(p.attn.k) +
                (base + c0) * (p.attn.dtype == FP4ATTN_FLOAT32 ? 4 : 2));
            for (int c = c0, i = 0; c < c1; c += per, ++i) {
              const uint4 raw = __ldg(src + i);
              const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
              if (p.attn.dtype == FP4ATTN_FLOAT32) {
#pragma unroll
                for (int e = 0; e < 4; ++e) acc = fmaf(qbar_s[c + e], __uint_as_float(w[e]), acc);
              } else if (p.attn.dtype == FP4ATTN_FLOAT16) {
#pragma unroll
                for (int e = 0; e < 8; ++e)
                  acc = fmaf(
                      qbar_s[c + e],
                      __half2float(__ushort_as_half((unsigned short)(w[e >> 1] >> (16 * (e & 1))))),
                      acc);
              } else {
#pragma unroll
                for (int e = 0; e < 8; ++e)
                  acc = fmaf(qbar_s[c + e], __uint_as_float((w[e >> 1] >> (16 * (e & 1))) << 16),
                             acc);
              }
            }
          } else if (p.attn.dtype == FP4ATTN_FLOAT16) {
            for (int c = c0; c < c1; ++c)
              acc = fmaf(qbar_s[c], load_as_float(p.attn.k, FP4ATTN_FLOAT16, base + c), acc);
          } else if (p.attn.dtype == FP4ATTN_BFLOAT16) {
            for (int c = c0; c < c1; ++c)
              acc = fmaf(qbar_s[c], load_as_float(p.attn.k, FP4ATTN_BFLOAT16, base + c), acc);
          } else {
            for (int c = c0; c < c1; ++c)
              acc = fmaf(qbar_s[c], load_as_float(p.attn.k, FP4ATTN_FLOAT32, base + c), acc);
          }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        if (half == 0) bias_s[key] = acc;
      }
      cp_async_wait_group<1>();
      __syncthreads();

      const int64_t key0 = j * kBlockKV;
      const bool active = warp_rows && (!p.attn.causal || key0 <= row0 + 15);
      if (active) {
        const uint8_t *kc_s = stage;
        const uint8_t *ks_s = stage + S::KC;
        const uint8_t *vc_s = stage + S::KC + S::KS;
        const uint8_t *vs_s = stage + S::KC + S::KS + S::VC;

        /* ---- S = Q^ K^T (FP32 accumulators; column c of n-tile nt = key position 8nt + c) */
        float s[16][4];
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
          s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
          uint32_t kb[2 * NKS];
          const uint8_t *kf = kc_s + (nt * 32 + lane) * (8 * NKS);
          if constexpr (NKS == 1) {
            const uint2 v = *reinterpret_cast<const uint2 *>(kf);
            kb[0] = v.x;
            kb[1] = v.y;
          } else {
#pragma unroll
            for (int i = 0; i < NKS / 2; ++i) {
              const uint4 v = *reinterpret_cast<const uint4 *>(kf + 16 * i);
              kb[4 * i] = v.x;
              kb[4 * i + 1] = v.y;
              kb[4 * i + 2] = v.z;
              kb[4 * i + 3] = v.w;
            }
          }
          /* lane (g, t) supplies key position 8nt + g's scale word for k-step t */
          const uint32_t ksc =
              t < NKS ? *reinterpret_cast<const uint32_t *>(ks_s + (nt * 8 + g) * NB + 4 * t) : 0u;
#pragma unroll
          for (int ks = 0; ks < NKS; ++ks)
            mma_fp4_m16n8k64(s[nt], qa[ks], &kb[2 * ks], s[nt], qsc[ks >> 1], ksc, ks & 1, ks);
        }

        /* ---- scores, masks, per-tile row max. Accumulator (nt, e) of thread t is token
         * key0 + 32 (nt >> 2) + 8t + 2 (nt & 3) + (e & 1): the K permutation, inverted. */
        const bool need_mask = p.attn.causal || p.attn.mask_kind != FP4ATTN_MASK_NONE ||
                               key0 + kBlockKV > p.attn.len_k;
        float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int kl = 32 * (nt >> 2) + 8 * t + 2 * (nt & 3) + (e & 1);
            float v = __fmul_rn(p.attn.scale, __fadd_rn(__fmul_rn(dqk, s[nt][e]),
                                                        bias_s[kl])); /* no FMA: as SPEC */
            if (need_mask) {
              const int64_t key = key0 + kl;
              const int64_t row = (e < 2) ? rg : rg8;
              if (key >= p.attn.len_k || row >= p.attn.len_q)
                v = -INFINITY;
              else
                v += mask_term(p, mbase, row, key);
            }
            s[nt][e] = v;
            tmax[e >> 1] = fmaxf(tmax[e >> 1], v);
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
          tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
        }
        /* ---- online softmax statistics (SPEC 4.5); a row empty in this tile adds nothing */
        float alpha[2], beta[2], pvf[2], tsafe[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float m_new = fmaxf(m_r[r], tmax[r]);
          const bool empty = tmax[r] == -INFINITY;
          alpha[r] = m_r[r] == -INFINITY ? 0.0f : expf(m_r[r] - m_new);
          beta[r] = empty ? 0.0f : expf(tmax[r] - m_new);
          pvf[r] = beta[r] / FP4ATTN_NVFP4_RANGE;
          tsafe[r] = empty ? 0.0f : tmax[r];
          m_r[r] = m_new;
        }
        /* ---- P~ = exp(S - t), l, and P^ = phi_local(2688 P~) straight into A fragments:
         * pa[ks][0..3] = {row g keys 64ks+8t.., row g+8 same, row g keys 64ks+32+8t.., row g+8} */
        uint32_t pa[2][4];
        uint32_t sbyte[4]
                      [2]; /* [32-key group][row half] E4M3 scale of this thread's 16-key block */
        float rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float v[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              const float e = fast_exp(s[4 * q + (i >> 1)][2 * r + (i & 1)] - tsafe[r]);
              rs[r] += e;
              v[i] = FP4ATTN_NVFP4_RANGE * e;
            }
            pa[q >> 1][2 * (q & 1) + r] = quantize_p8(v, &sbyte[q][r]);
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) l_r[r] = alpha[r] * l_r[r] + beta[r] * rs[r];
        /* A scale words: byte jb of (ks, row half r) is block jb = 2 (q & 1) + (t >> 1) of
         * q = 2ks + (q & 1). Lane t must hold (ks = t >> 1, r = t & 1); it owns bytes t >> 1 and
         * 2 + (t >> 1) of every word, its partner t ^ 2 the others: one shuffle completes it. */
        uint32_t sfa;
        {
          const int sh = 8 * (t >> 1);
          const bool odd = (t & 1) != 0,
                     upper = (t >> 1) != 0; /* selects, not indexing: no local memory */
          const uint32_t w0 = odd ? (sbyte[0][1] << sh) | (sbyte[1][1] << (16 + sh))
                                  : (sbyte[0][0] << sh) | (sbyte[1][0] << (16 + sh));
          const uint32_t w1 = odd ? (sbyte[2][1] << sh) | (sbyte[3][1] << (16 + sh))
                                  : (sbyte[2][0] << sh) | (sbyte[3][0] << (16 + sh));
          const uint32_t mine = upper ? w1 : w0;   /* (ks = t >> 1, row half t & 1) */
          const uint32_t theirs = upper ? w0 : w1; /* what lane t ^ 2 needs from us */
          sfa = mine | __shfl_xor_sync(0xffffffffu, theirs, 2);
        }
        /* ---- O = alpha O + (beta / 2688) (P^ V^ dV) */
#pragma unroll
        for (int n = 0; n < NVT; ++n) {
          const uint4 vv = *reinterpret_cast<const uint4 *>(vc_s + (n * 32 + lane) * 16);
          const uint32_t vb0[2] = {vv.x, vv.y}, vb1[2] = {vv.z, vv.w};
          const uint32_t vsc =
              t < 2 ? *reinterpret_cast<const uint32_t *>(vs_s + (n * 8 + g) * 8 + 4 * t) : 0u;
          float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          mma_fp4_m16n8k64(acc, pa[0], vb0, acc, sfa, vsc, 0, 0);
          mma_fp4_m16n8k64(acc, pa[1], vb1, acc, sfa, vsc, 1, 1);
#pragma unroll
          for (int e = 0; e < 4; ++e)
            o[n][e] = alpha[e >> 1] * o[n][e] + (pvf[e >> 1] * acc[e]) * dv; /* as SPEC 4.5 */
        }
      }
      __syncthreads(); /* stage (j & 1) and bias_s are free again */
    }
    cp_async_wait_group<0>();

    /* ---- O / l, LSE (SPEC 4.6) */
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 1);
      l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = r ? rg8 : rg;
      if (row >= p.attn.len_q) continue;
      const float l = l_r[r];
      const float inv = l != 0.0f ? 1.0f / l : 0.0f;
      const int64_t obase =
          b * p.attn.out_stride[0] + h * p.attn.out_stride[1] + row * p.attn.out_stride[2];
#pragma unroll
      for (int n = 0; n < NVT; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = 8 * n + 2 * t + e;
          if (c >= p.attn.head_dim) continue;
          const float val =
              l != 0.0f ? __fadd_rn(__fmul_rn(o[n][2 * r + e], inv), p.vbar[bkv * DP + c]) : 0.0f;
          if (p.attn.dtype == FP4ATTN_FLOAT16)
            static_cast<__half *>(p.attn.out)[obase + c] = __float2half_rn(val);
          else if (p.attn.dtype == FP4ATTN_BFLOAT16)
            static_cast<__nv_bfloat16 *>(p.attn.out)[obase + c] = __float2bfloat16_rn(val);
          else
            static_cast<float *>(p.attn.out)[obase + c] = val;
        }
      }
      if (p.attn.lse && t == 0)
        p.attn.lse[bh * p.attn.len_q + row] =
            l != 0.0f ? m_r[r] + logf(l) + p.attn.scale * p.lse_shift[bh * p.attn.len_q + row]
                      : -INFINITY;
    }
  }
}

template <int DP>
cudaError_t launch_attention_sm120(const KernelParams &kp, int num_sms, cudaStream_t stream) {
  const int smem = Smem<DP>::TOTAL;
  cudaError_t e = cudaFuncSetAttribute(attention_sm120_kernel<DP>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  int per_sm = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, attention_sm120_kernel<DP>, kThreads,
                                                    smem);
  if (e != cudaSuccess) return e;
  if (per_sm < 1) per_sm = 1;
  int64_t grid = (int64_t)num_sms * per_sm;
  if (grid > kp.num_items) grid = kp.num_items;
  if (grid < 1) return cudaSuccess;
  attention_sm120_kernel<DP><<<(unsigned)grid, kThreads, smem, stream>>>(kp);
  return cudaGetLastError();
}

}  // namespace fp4attn_sm120

#endif /* FP4ATTN_SM120_ATTENTION_KERNEL_CUH */
