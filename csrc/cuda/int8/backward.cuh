/*
 * 8-bit attention backward (docs/SPEC_INT8.md 3) on mma.sync: m16n8k32 s8 for the scores,
 * m16n8k16 FP16/BF16 for dP = dO V^T, dV, dK and dQ.
 *
 * One block = 8 warps = one 128-key block j of one (batch, KV head), and DO of its head-dim
 * columns (DO = DP, or half of it at head dim 256: the grid's y splits dK, dV and dQ by columns,
 * recomputing S and dP). Each warp owns 16 keys. The block walks every 64-row query block i of the
 * KV head's query heads (causal: only blocks that see key block j), double-buffering their tiles:
 *   S^T  = K^ Q^_i^T * (sQ sK scale), masks, P^T = exp2(S^T - lse2)         (keys x 64 rows)
 *   dV  += P16^T dO16 in 16 bits                     (A from registers, dO16 by ldmatrix .trans)
 *   dP^T = V dO^T in 16 bits; dS16^T = P (dP - Drow) rounded to the 16-bit type
 *   dK  += dS16^T Q16_i                              (A from registers, Q16 by ldmatrix .trans)
 *   dQ_i += dS16 Ks16_j   (dS16 through shared memory, Ks16 by ldmatrix .trans), FP32 atomics
 *   into the workspace (finish_dq applies the softmax scale)
 * dK and dV sum over the group's query heads in registers and are stored once (dK times the
 * scale), no atomics. Deterministic (Int8Workspace::dq_sem): the key blocks of a head add to
 * each query block's dQ in dq_rank's order (int8_tiles.cuh): one thread waits until the block's
 * rank is counted, the block's atomics follow, and once they are performed (a fence per thread)
 * the count goes up by one.
 */
#ifndef FP4ATTN_CUDA_INT8_BACKWARD_CUH
#define FP4ATTN_CUDA_INT8_BACKWARD_CUH

#include "attention_int8.h"
#include "int8_tiles.cuh"

namespace fp4attn_cuda {

template <int DP, int DO, int NBUF>
struct BwdSmem {
  static constexpr int kKc = 0;                      /* K^ [128][DP] */
  static constexpr int kV16 = kKc + kBK8 * DP;       /* V [128][DP] 16-bit */
  static constexpr int kKs16 = kV16 + kBK8 * DP * 2; /* Ks16 [128][DO] 16-bit */
  static constexpr int kDs = kKs16 + kBK8 * DO * 2;  /* dS16 [64][128] 16-bit */
  static constexpr int kBuf = kDs + kBQ8 * kBK8 * 2;
  /* one buffer of a query block's tiles */
  static constexpr int bQc = 0;                    /* Q^ [64][DP] */
  static constexpr int bQ16 = bQc + kBQ8 * DP;     /* Q16 [64][DO] 16-bit */
  static constexpr int bDo = bQ16 + kBQ8 * DO * 2; /* dO [64][DP] 16-bit */
  static constexpr int bLse = bDo + kBQ8 * DP * 2; /* lse2 [64] */
  static constexpr int bDrow = bLse + kBQ8 * 4;    /* Drow [64] */
  static constexpr int kBufBytes = bDrow + kBQ8 * 4;
  static constexpr int kBytes = kBuf + NBUF * kBufBytes;
};

template <int DP, int DO, int NBUF, bool kBf16>
__global__ void __launch_bounds__(256, 1) int8_backward_kernel(const Int8Args a) {
  using L = BwdSmem<DP, DO, NBUF>;
  extern __shared__ __align__(128) char smem[];
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const bool ordered = w.dq_sem != nullptr;
  const int64_t jx = blockIdx.x % w.nkb, bhk = blockIdx.x / w.nkb;
  const int64_t j = ordered ? dq_key_block(p.causal, w.nkb, jx) : jx;
  const int64_t b = bhk / p.heads_kv, hk = bhk % p.heads_kv, G = p.heads_q / p.heads_kv;
  const int d0 = blockIdx.y * DO, krow0 = warp * 16;
  const int64_t j0 = j * kBK8;
  const int64_t i_start = p.causal ? min(w.nqb, j0 / kBQ8) : 0, per_head = w.nqb - i_start;
  const int iters = (int)(G * per_head);

  auto block_of = [&](int it, int64_t &bh, int64_t &i) {
    bh = b * p.heads_q + hk * G + it / per_head;
    i = i_start + it % per_head;
  };
  auto load_block = [&](int it, int buf) {
    int64_t bh, i;
    block_of(it, bh, i);
    char *B = smem + L::kBuf + buf * L::kBufBytes;
    const int64_t r0 = bh * w.nqp + i * kBQ8;
    load_tile<DP>(B + L::bQc, w.qc + r0 * DP, kBQ8, DP, tid, 256);
    load_tile<2 * DO>(B + L::bQ16, w.q16 + r0 * DP + d0, kBQ8, 2 * DP, tid, 256);
    load_tile<2 * DP>(B + L::bDo, w.do16 + r0 * DP, kBQ8, 2 * DP, tid, 256);
    load_bytes(B + L::bLse, w.lse2 + r0, kBQ8 * 4, tid, 256);
    load_bytes(B + L::bDrow, w.drow + r0, kBQ8 * 4, tid, 256);
  };

  if (iters > 0) { /* a key block no query sees (causal, Nk > Nq) loads nothing: zero dK, dV */
    load_tile<DP>(smem + L::kKc, w.kc + (bhk * w.nkp + j0) * DP, kBK8, DP, tid, 256);
    load_tile<2 * DP>(smem + L::kV16, w.v16 + (bhk * w.nkp + j0) * DP, kBK8, 2 * DP, tid, 256);
    load_tile<2 * DO>(smem + L::kKs16, w.ks16 + (bhk * w.nkp + j0) * DP + d0, kBK8, 2 * DP, tid,
                      256);
    load_block(0, 0);
    cp_async_commit();
  }

  const float sk = w.sk[bhk * w.nkb + j];
  float dv[DO / 8][4] = {}, dk[DO / 8][4] = {};
  for (int it = 0; it < iters; ++it) {
    const int buf = NBUF == 2 ? (it & 1) : 0;
    if (NBUF == 2 && it + 1 < iters) {
      load_block(it + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait_group<1>();
    } else {
      if (NBUF == 1 && it > 0) {
        load_block(it, 0);
        cp_async_commit();
      }
      cp_async_wait_group<0>();
    }
    __syncthreads();
    int64_t bh, i;
    block_of(it, bh, i);
    const int64_t h = bh % p.heads_q, i0 = i * kBQ8;
    const char *B = smem + L::kBuf + buf * L::kBufBytes;
    const float *lse2 = reinterpret_cast<const float *>(B + L::bLse);
    const float *drow = reinterpret_cast<const float *>(B + L::bDrow);
    const float sq = w.sq[bh * w.nqb + i];

    /* S^T = K^ Q^T (this warp's 16 keys x the block's 64 rows), then P^T */
    int acc[8][4] = {};
#pragma unroll
    for (int kc = 0; kc < DP / 32; ++kc) {
      uint32_t ka[4];
      ldsm_a<DP>(ka, smem + L::kKc, krow0, kc * 32);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t qb[2][2];
        ldsm_b<DP>(qb, B + L::bQc, np * 16, kc * 32);
        mma_s8(acc[2 * np], ka, qb[0]);
        mma_s8(acc[2 * np + 1], ka, qb[1]);
      }
    }
    const float f = ((sq * sk) * p.scale) * kLog2e;
    /* two whole loops, not the mask tests per score: their branches cost the unmasked steps an
     * instruction-fetch stall per score */
    const bool masked = p.mask_kind != FP4ATTN_MASK_NONE || j0 + kBK8 > p.len_k ||
                        i0 + kBQ8 > p.len_q || (p.causal && j0 + kBK8 - 1 > i0);
    float pm[8][4];
    if (!masked) {
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          pm[n][e] = exp2f((float)acc[n][e] * f - lse2[n * 8 + 2 * t + (e & 1)]);
    } else {
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n * 8 + 2 * t + (e & 1);
          const int64_t key = j0 + krow0 + g + 8 * (e >> 1), row = i0 + col;
          pm[n][e] = exp2f(masked_score(p, b, h, row, key, (float)acc[n][e] * f) - lse2[col]);
        }
    }

    /* dV += P16^T dO16: k16 step kk = query rows 16 kk .. 16 kk + 15 */
    {
      uint32_t pa[4][4];
      acc_to_a16<kBf16, 4>(pm, pa);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int np = 0; np < DO / 16; ++np) {
          uint32_t ob[2][2];
          ldsm_b_trans<2 * DP>(ob, B + L::bDo, 16 * kk, d0 + 16 * np);
          mma_16816<kBf16>(dv[2 * np], pa[kk], ob[0][0], ob[0][1]);
          mma_16816<kBf16>(dv[2 * np + 1], pa[kk], ob[1][0], ob[1][1]);
        }
    }

    /* dP^T = V dO^T in 16 bits, FP32 accumulation */
    float dp[8][4] = {};
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      uint32_t va[4];
      ldsm_a<2 * DP>(va, smem + L::kV16, krow0, kk * 32);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t ob[2][2];
        ldsm_b<2 * DP>(ob, B + L::bDo, np * 16, kk * 32);
        mma_16816<kBf16>(dp[2 * np], va, ob[0][0], ob[0][1]);
        mma_16816<kBf16>(dp[2 * np + 1], va, ob[1][0], ob[1][1]);
      }
    }

    /* dS16^T = P (dP - Drow) in 16 bits: dK's A fragments (k16 step kk = query rows 16 kk ..) */
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) pm[n][e] = pm[n][e] * (dp[n][e] - drow[n * 8 + 2 * t + (e & 1)]);
    uint32_t da[4][4];
    acc_to_a16<kBf16, 4>(pm, da);
    /* dS16 [64 rows][128 keys] for dQ: word da[n / 2][2 (n % 2) + r] holds rows n*8 + 2t, +1 of
     * key krow0 + g + 8r */
    char *ds_tile = smem + L::kDs;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t w2 = da[n >> 1][2 * (n & 1) + r];
        const int key = krow0 + g + 8 * r, row = n * 8 + 2 * t;
        *reinterpret_cast<uint16_t *>(ds_tile + swz_byte<2 * kBK8>(row, 2 * key)) = (uint16_t)w2;
        *reinterpret_cast<uint16_t *>(ds_tile + swz_byte<2 * kBK8>(row + 1, 2 * key)) =
            (uint16_t)(w2 >> 16);
      }

    /* dK += dS16^T Q16 */
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int np = 0; np < DO / 16; ++np) {
        uint32_t qb[2][2];
        ldsm_b_trans<2 * DO>(qb, B + L::bQ16, 16 * kk, 16 * np);
        mma_16816<kBf16>(dk[2 * np], da[kk], qb[0][0], qb[0][1]);
        mma_16816<kBf16>(dk[2 * np + 1], da[kk], qb[1][0], qb[1][1]);
      }
    __syncthreads();

    /* dQ_i += dS16 Ks16 over the block's 128 keys: warp -> 16 rows x DO/2 columns, FP32 atomics */
    {
      constexpr int NT = DO / 16;
      const int r0 = (warp & 3) * 16, c0 = (warp >> 2) * (DO / 2);
      float dq[NT][4] = {};
#pragma unroll
      for (int kk = 0; kk < kBK8 / 16; ++kk) {
        uint32_t sa[4];
        ldsm_a<2 * kBK8>(sa, ds_tile, r0, kk * 32);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t kb[2][2];
          ldsm_b_trans<2 * DO>(kb, smem + L::kKs16, 16 * kk, c0 + 16 * np);
          mma_16816<kBf16>(dq[2 * np], sa, kb[0][0], kb[0][1]);
          mma_16816<kBf16>(dq[2 * np + 1], sa, kb[1][0], kb[1][1]);
        }
      }
      unsigned *sem = ordered ? w.dq_sem + (bh * w.nqb + i) * 2 + blockIdx.y : nullptr;
      if (sem) { /* the key blocks before this one in the order have added theirs */
        const unsigned rank = dq_rank(p.causal, w.nkb, i, j);
        if (tid == 0)
          while (ld_acquire_gpu(sem) != rank) {
          }
        __syncthreads();
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t row = i0 + r0 + g + 8 * r;
        if (row >= p.len_q) continue;
        float *dst = w.dq_acc + (bh * p.len_q + row) * DP + d0 + c0 + 2 * t;
#pragma unroll
        for (int n = 0; n < NT; ++n) add_pair(dst + n * 8, dq[n][2 * r], dq[n][2 * r + 1]);
      }
      if (sem) {
        __threadfence(); /* this thread's additions are performed */
        __syncthreads();
        if (tid == 0) red_release_gpu_add(sem, 1u);
      }
    }
  }

  /* dK and dV of this warp's keys, in the input dtype */
  store_dk_dv_rows(a, bhk, j0 + krow0, d0, dk, dv);
}

/* The kernel of head dim DP, DO columns per block and NBUF query-tile buffers for the 16-bit type
 * of dP, its shared memory set once per device. */
template <int DP, int DO, int NBUF>
fp4attn_status launch_backward_kernel(const Int8Args &a, cudaStream_t s, int dev) {
  using L = BwdSmem<DP, DO, NBUF>;
  static int configured[64] = {0};
  auto kernel = a.bf16_ops ? int8_backward_kernel<DP, DO, NBUF, true>
                           : int8_backward_kernel<DP, DO, NBUF, false>;
  const int bit = a.bf16_ops ? 2 : 1;
  if (dev < 0 || dev >= 64 || !(configured[dev] & bit)) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes) !=
        cudaSuccess)
      return launch_status("int8 attention backward");
    if (dev >= 0 && dev < 64) configured[dev] |= bit;
  }
  const int64_t blocks = a.p.batch * a.p.heads_kv * a.ws.nkb;
  if (blocks > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "int8 attention backward: too many key blocks");
  kernel<<<dim3((unsigned)blocks, DP / DO), 256, L::kBytes, s>>>(a);
  return launch_status("int8 attention backward");
}

/* Head dim DP: dK/dV/dQ columns per block (DO: all of them up to 128, else half, S and dP
 * recomputed per half), and two query-tile buffers where the device's shared memory takes them
 * (head dim 128 needs 177 KB with two: one on an A100). */
template <int DP>
fp4attn_status launch_int8_backward(const Int8Args &a, cudaStream_t s) {
  constexpr int DO = DP > 128 ? 128 : DP;
  int dev = 0;
  cudaGetDevice(&dev);
  static int optin_of[64] = {0};
  int optin = dev >= 0 && dev < 64 ? optin_of[dev] : 0;
  if (optin == 0) {
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (dev >= 0 && dev < 64) optin_of[dev] = optin;
  }
  if constexpr (DP <= 128)
    if (optin >= BwdSmem<DP, DO, 2>::kBytes) return launch_backward_kernel<DP, DO, 2>(a, s, dev);
  constexpr int kBytes = BwdSmem<DP, DO, 1>::kBytes;
  if (optin < kBytes)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "int8 attention backward: head dim %d needs %d bytes of shared memory, "
                         "the device allows %d",
                         DP, kBytes, optin);
  return launch_backward_kernel<DP, DO, 1>(a, s, dev);
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_INT8_BACKWARD_CUH */
