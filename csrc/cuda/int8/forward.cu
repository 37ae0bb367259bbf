/*
 * 8-bit attention forward (docs/SPEC_INT8.md 2) on mma.sync, sm_80 and newer.
 *
 * One block = 4 warps = the 64 query rows of one Q^ block (one scale sQ) of one (batch, query
 * head); each warp owns 16 rows. Per 128-key step j (K^ tiles double-buffered by cp.async, the
 * step's V tile loaded while its scores and softmax run):
 *   S     = Q^ K^_j^T (m16n8k32 s8, exact int32) * (sQ sK_j scale) in log2 units, masks
 *   m_new = max(m, rowmax S); W = 448 exp2(S - m_new); P16 = W in 16 bits; l += W
 *   O     = alpha O + P16 V16_j, by FP16 or (kBf16) BF16 MMA accumulating into O, V16 as the
 *           preparation stores it transposed per block (int8_tiles.cuh)
 * P16 goes from the accumulator layout straight into A fragments. Head dims 64 / 128 / 256.
 */
#include "../tile/mask.cuh"
#include "attention_int8.h"
#include "int8_tiles.cuh"

namespace fp4attn_cuda {
namespace {

template <int DP>
struct FwdSmem {
  static constexpr int kQ = 0;                  /* Q^ [64][DP] */
  static constexpr int kK = kQ + kBQ8 * DP;     /* K^ [2][128][DP], double-buffered */
  static constexpr int kV = kK + 2 * kBK8 * DP; /* V16 [DP][128], the step's */
  static constexpr int kBytes = kV + 2 * DP * kBK8;
};

template <int DP, bool kBf16>
__global__ void __launch_bounds__(128) int8_forward_kernel(const Int8Args a) {
  using L = FwdSmem<DP>;
  extern __shared__ __align__(128) char smem[];
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t bhq = p.batch * p.heads_q;
  /* causal: query blocks longest first across all heads; otherwise head-major (K/V reuse in L2) */
  int64_t bh, qb;
  if (p.causal) {
    bh = blockIdx.x % bhq;
    qb = w.nqb - 1 - blockIdx.x / bhq;
  } else {
    bh = blockIdx.x / w.nqb;
    qb = blockIdx.x % w.nqb;
  }
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const int64_t bhk = b * p.heads_kv + h / (p.heads_q / p.heads_kv);
  const int64_t q0 = qb * kBQ8;
  int ntiles = (int)w.nkb;
  if (p.causal) ntiles = (int)min((int64_t)ntiles, (min(q0 + kBQ8, p.len_q) - 1) / kBK8 + 1);

  auto load_k = [&](int j, int buf) {
    load_tile<DP>(smem + L::kK + buf * kBK8 * DP, w.kc + (bhk * w.nkp + (int64_t)j * kBK8) * DP,
                  kBK8, DP, tid, 128);
  };
  auto load_v = [&](int j) {
    load_tile<2 * kBK8>(smem + L::kV, w.vt16 + (bhk * w.nkb + j) * DP * kBK8, DP, 2 * kBK8, tid,
                        128);
  };
  /* cp.async groups in commit order: {Q^, K^_0}, {V_0}, then per step {K^_j+1} and {V_j+1} */
  load_tile<DP>(smem + L::kQ, w.qc + (bh * w.nqp + q0) * DP, kBQ8, DP, tid, 128);
  load_k(0, 0);
  cp_async_commit();
  load_v(0);
  cp_async_commit();

  const float sq_scale = w.sq[bh * w.nqb + qb];
  const WarpRows rows{b, h, q0 + warp * 16};
  float o[DP / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; /* l: this thread's partial sums */

  for (int j = 0; j < ntiles; ++j) {
    const int buf = j & 1;
    const bool next = j + 1 < ntiles;
    if (next) {
      load_k(j + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait_group<2>(); /* K^_j; V_j and K^_j+1 may be in flight */
    } else {
      cp_async_wait_group<1>();
    }
    __syncthreads();
    const char *kt = smem + L::kK + buf * kBK8 * DP;

    int acc[16][4] = {};
#pragma unroll
    for (int kc = 0; kc < DP / 32; ++kc) {
      uint32_t qa[4];
      ldsm_a<DP>(qa, smem + L::kQ, warp * 16, kc * 32);
#pragma unroll
      for (int np = 0; np < 8; ++np) {
        uint32_t kb[2][2];
        ldsm_b<DP>(kb, kt, np * 16, kc * 32);
        mma_s8(acc[2 * np], qa, kb[0]);
        mma_s8(acc[2 * np + 1], qa, kb[1]);
      }
    }
    const float f = ((sq_scale * w.sk[bhk * w.nkb + j]) * p.scale) * kLog2e;
    float s[16][4];
#pragma unroll
    for (int n = 0; n < 16; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = (float)acc[n][e] * f;
    const int64_t j0 = (int64_t)j * kBK8;
    if (tile_has_masks(p, j0, rows.row0)) {
      if (p.mask_kind == FP4ATTN_MASK_NONE)
        mask_causal_tail(p, rows, j0, s);
      else
        mask_general(p, rows, j0, s);
    }

    /* online softmax with P16 against the running maximum (SPEC_INT8 2.4), in log2 units */
    float alpha[2], shift[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float x = -INFINITY;
#pragma unroll
      for (int n = 0; n < 16; ++n) x = fmaxf(x, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      const float m_new = fmaxf(m[r], quad_max(x));
      alpha[r] = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - m_new);
      m[r] = m_new;
      /* W = exp2(S - (m - log2 448)); a row with nothing visible yet has S = -inf: W = 0 */
      shift[r] = m_new == -INFINITY ? 0.0f : m_new - kLog2_448;
    }
    float rowsum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < 16; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - shift[e >> 1]);
        rowsum[e >> 1] += s[n][e];
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = alpha[r] * l[r] + rowsum[r];
    P16 pt;
    make_p16<kBf16>(s, pt);

    if (next)
      cp_async_wait_group<1>(); /* V_j; K^_j+1 may be in flight */
    else
      cp_async_wait_group<0>();
    __syncthreads();
#pragma unroll
    for (int n = 0; n < DP / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e >> 1];
#pragma unroll
    for (int np = 0; np < DP / 16; ++np) mma_p16_v<kBf16>(o, pt, smem + L::kV, np);
    __syncthreads(); /* every warp is done with K^_j, V_j: their buffers are refilled */
    if (next) {
      load_v(j + 1);
      cp_async_commit();
    }
  }

  store_forward_rows<DP>(p, w, rows, bh, o, m, l);
}

/* The kernel for the call's 16-bit type (SPEC_INT8 2.2: V16 is BF16 unless the inputs are FP16). */
template <int DP, bool kBf16>
fp4attn_status launch_int8_forward_typed(const Int8Args &a, cudaStream_t s) {
  static int configured[64] = {0};
  const int smem = FwdSmem<DP>::kBytes;
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64 || !configured[dev]) {
    int optin = 0;
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (optin < smem)
      return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                           "int8 attention: head dim %d needs %d bytes of shared memory, the "
                           "device allows %d",
                           DP, smem, optin);
    if (cudaFuncSetAttribute(int8_forward_kernel<DP, kBf16>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
      return launch_status("int8 attention forward");
    if (dev >= 0 && dev < 64) configured[dev] = 1;
  }
  const int64_t blocks = a.p.batch * a.p.heads_q * a.ws.nqb;
  if (blocks > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "int8 attention: too many query blocks");
  int8_forward_kernel<DP, kBf16><<<(unsigned)blocks, 128, smem, s>>>(a);
  return launch_status("int8 attention forward");
}

}  // namespace

template <int DP>
fp4attn_status launch_int8_forward(const Int8Args &a, cudaStream_t s) {
  return a.bf16_ops ? launch_int8_forward_typed<DP, true>(a, s)
                    : launch_int8_forward_typed<DP, false>(a, s);
}

template fp4attn_status launch_int8_forward<64>(const Int8Args &, cudaStream_t);
template fp4attn_status launch_int8_forward<128>(const Int8Args &, cudaStream_t);
template fp4attn_status launch_int8_forward<256>(const Int8Args &, cudaStream_t);

}  // namespace fp4attn_cuda
