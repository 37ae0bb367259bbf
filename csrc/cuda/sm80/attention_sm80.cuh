/*
 * FP4 attention forward for sm_80/86/89/90 (SPEC 4.4-4.6): FlashAttention-2-style mma.sync
 * m16n8k16 over FP4-quantized operands held as their exact FP16 values.
 *
 * Tile: one block = NWARPS x 16 query rows (128 for head dims 64/128, 64 for 256) of one
 * (batch, query head); each warp owns 16 rows. Keys in tiles of 128 (Bkv of SPEC 4.5: the
 * per-tile row maximum t is taken over exactly these 128 keys, as in the reference).
 *
 * Pipeline per key tile j (NBUF = 2; head dim 256 has one buffer and loads between tiles):
 *   cp.async    K^ and V^ tile j+1 (exact FP16 values code * scale written by the pre-pass,
 *               one contiguous sweep each) -> XOR-swizzled smem for conflict-free ldmatrix
 *   bias        tile j+1: the q-mean correction qbar . K_j (SPEC 4.4, keys in input precision,
 *               FP32 FMAs, all loads issued before the first FMA)
 *   compute     tile j: S = Q^ K^T (mma), S*scale*dQ*dK + correction, masks, row max t over the
 *               128 keys, Pq = 2688 * exp(S - t) kept in registers and quantized in place
 *               (phi_local, 16-key blocks = one PV k-slice: block max over the 4-thread quad,
 *               E4M3 scale, correctly rounded reciprocal, E2M1 rounding, all equal to numerics.h),
 *               P^q V^ (mma, the accumulator layout of S is the A-operand layout of P), then
 *               O = alpha O + (exp(t - m)/2688) dV (P^q V^) in FP32 per 64-column group.
 * Q: the block quantizes its own rows in the prologue (Q - qbar_i, global scale from the
 * pre-pass, fp4attn_quantize_block) into FP16 smem. Global scales touch only FP32 values.
 *
 * Swapping in the Blackwell FP4 MMA: keep the tiling, stage packed E2M1 bytes + E4M3 scales
 * instead of FP16 values (the pre-pass has them before it expands), ldmatrix the bytes into
 * mma.m16n8k64 ... kind::mxf4nvf4 fragments with the scales as 4X operands, and pack P^q to
 * E2M1 instead of FP16 (docs/reference/blackwell_fp4.md). csrc/cuda/sm120 does exactly that.
 */
#ifndef FP4ATTN_CUDA_SM80_ATTENTION_SM80_CUH
#define FP4ATTN_CUDA_SM80_ATTENTION_SM80_CUH

#include "../tile/epilogue.cuh"
#include "../tile/q_quant.cuh"
#include "../tile/qmean_bias.cuh"
#include "../tile/scheduler.cuh"
#include "../tile/softmax.cuh"
#include "attention_sm80.h"

namespace fp4attn_cuda {

/* Element offset of (row, col) in a [rows][W] FP16 tile whose 16-byte chunks are XOR-swizzled
 * by the row (W >= 64): ldmatrix rows r..r+7 of one chunk land in 8 different bank groups. */
template <int W>
__device__ __forceinline__ int swz(int row, int col) {
  return row * W + ((((col >> 3) ^ row) & 7) | ((col >> 3) & ~7)) * 8 + (col & 7);
}

template <int DP, int NWARPS, int NBUF>
struct FwdConfig {
  static constexpr int kThreads = NWARPS * 32;
  static constexpr int kRows = NWARPS * 16;
  /* shared memory map (bytes) */
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kRows * DP * 2;
  static constexpr int kOffV = kOffK + NBUF * kTile * DP * 2;
  static constexpr int kOffBias = kOffV + NBUF * DP * kTile * 2;
  static constexpr int kOffQbar = kOffBias + NBUF * kTile * 4;
  static constexpr int kSmem = kOffQbar + DP * 4;
};

template <int DP, int NWARPS, int NBUF>
struct FwdKernel {
  using C = FwdConfig<DP, NWARPS, NBUF>;

  struct Ctx : QueryBlock {
    const AttnArgs *a;
    char *smem;
  };

  static __device__ __forceinline__ __half *q_tile(const Ctx &c) {
    return reinterpret_cast<__half *>(c.smem + C::kOffQ);
  }
  static __device__ __forceinline__ __half *k_tile(const Ctx &c, int buf) {
    return reinterpret_cast<__half *>(c.smem + C::kOffK) + buf * kTile * DP;
  }
  static __device__ __forceinline__ __half *v_tile(const Ctx &c, int buf) {
    return reinterpret_cast<__half *>(c.smem + C::kOffV) + buf * DP * kTile;
  }
  static __device__ __forceinline__ float *bias(const Ctx &c, int buf) {
    return reinterpret_cast<float *>(c.smem + C::kOffBias) + buf * kTile;
  }

  /* K^ and V^ tile j (exact FP16 values from the pre-pass) -> buffer buf, cp.async 16 B per
   * request into the XOR-swizzled layout that ldmatrix reads conflict-free. */
  static __device__ void issue_tile(const Ctx &c, int j, int buf) {
    const AttnWorkspace &w = c.a->ws;
    const __half *kg = w.kdq + (c.bhk * w.nkp + (int64_t)j * kTile) * DP;
    const __half *vg = w.vdq + (c.bhk * w.nkt + j) * (int64_t)DP * kTile;
    __half *kt = k_tile(c, buf), *vt = v_tile(c, buf);
    constexpr int KCH = DP / 8, VCH = kTile / 8; /* 16-byte chunks per row */
#pragma unroll
    for (int it = 0; it < kTile * KCH / C::kThreads; ++it) {
      const int i = threadIdx.x + it * C::kThreads;
      const int r = i / KCH, ch = i % KCH;
      cp_async_16(kt + swz<DP>(r, ch * 8), kg + (int64_t)i * 8);
    }
#pragma unroll
    for (int it = 0; it < DP * VCH / C::kThreads; ++it) {
      const int i = threadIdx.x + it * C::kThreads;
      const int r = i / VCH, ch = i % VCH;
      cp_async_16(vt + swz<kTile>(r, ch * 8), vg + (int64_t)i * 8);
    }
  }

  /* bias of tile j (tile/): one or two threads per key. */
  static __device__ void compute_bias_tile(const Ctx &c, int j, int buf) {
    const float *qbar = reinterpret_cast<const float *>(c.smem + C::kOffQbar);
    constexpr int TPK = C::kThreads / kTile; /* threads per key: 2 or 1 */
    const int key = threadIdx.x / TPK;
    compute_bias<DP, TPK>(*c.a, c.b, c.hk, (int64_t)j * kTile + key, threadIdx.x % TPK, qbar,
                          bias(c, buf) + key);
  }

  /* Q prologue: quantize this block's rows (SPEC 4.2-4.3) into FP16 smem. */
  static __device__ void quantize_q(const Ctx &c) {
    const float *qbar = reinterpret_cast<const float *>(c.smem + C::kOffQbar);
    __half *qt = q_tile(c);
    quantize_q_rows<DP>(
        *c.a, c.b, c.h, c.bh, c.q0, C::kRows, qbar, threadIdx.x, C::kThreads,
        [&](int r, int col, const uint32_t (&o)[8]) {
          *reinterpret_cast<uint4 *>(qt + swz<DP>(r, col)) = make_uint4(o[0], o[1], o[2], o[3]);
          *reinterpret_cast<uint4 *>(qt + swz<DP>(r, col + 8)) = make_uint4(o[4], o[5], o[6], o[7]);
        });
  }

  struct RowState {
    SoftmaxState sm;
    float o[DP / 8][4];
  };

  /* Scores, softmax with two-level P quantization, and PV for key tile j (one warp, 16 rows). */
  static __device__ __forceinline__ void compute_tile(const Ctx &c, int j, int buf, RowState &rs,
                                                      float cqk) {
    const fp4attn_attention_params &p = c.a->p;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wr = warp * 16;
    const __half *qt = q_tile(c);
    const __half *kt = k_tile(c, buf);
    const __half *vt = v_tile(c, buf);
    const float *bs = bias(c, buf);

    /* ---- S = Q^ K^T (FP16 operands, FP32 accumulation) */
    float s[16][4];
#pragma unroll
    for (int n = 0; n < 16; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      uint32_t a[4];
      {
        const int row = wr + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int col = kk * 16 + (lane >> 4) * 8;
        ldmatrix_x4(a[0], a[1], a[2], a[3], smem_u32(qt + swz<DP>(row, col)));
      }
#pragma unroll
      for (int np = 0; np < 8; ++np) {
        uint32_t b0, b1, b2, b3;
        const int row = np * 16 + (lane & 7) + (lane >> 4) * 8;
        const int col = kk * 16 + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(b0, b1, b2, b3, smem_u32(kt + swz<DP>(row, col)));
        mma_16816(s[2 * np], a, b0, b1);
        mma_16816(s[2 * np + 1], a, b2, b3);
      }
    }

    /* ---- softmax and P quantization (tile/) */
    const WarpRows wrows = {c.b, c.h, c.q0 + wr};
    float alpha[2], gsc[2];
    uint32_t pa[8][4];
    softmax_quantize_p(p, wrows, (int64_t)j * kTile, cqk, bs, s, rs.sm, alpha, gsc, pa);

    /* ---- O = alpha O + (beta/2688) (P^q V^), GW output columns at a time; V's dV is applied
     * in the epilogue, last, as SPEC 4.5 orders it (a tiny dV times beta/2688 went subnormal) */
    constexpr int GW = DP == 256 ? 32 : 64; /* fewer live accumulators where O is largest */
    const float gv0 = gsc[0], gv1 = gsc[1];
#pragma unroll
    for (int grp = 0; grp < DP / GW; ++grp) {
      float acc[GW / 8][4];
#pragma unroll
      for (int n = 0; n < GW / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
      for (int kb = 0; kb < 8; ++kb) {
#pragma unroll
        for (int np = 0; np < GW / 16; ++np) {
          uint32_t b0, b1, b2, b3;
          const int row = grp * GW + np * 16 + (lane & 7) + (lane >> 4) * 8;
          const int col = kb * 16 + ((lane >> 3) & 1) * 8;
          ldmatrix_x4(b0, b1, b2, b3, smem_u32(vt + swz<kTile>(row, col)));
          mma_16816(acc[2 * np], pa[kb], b0, b1);
          mma_16816(acc[2 * np + 1], pa[kb], b2, b3);
        }
      }
      rescale_accumulate(rs.o, grp * (GW / 8), acc, alpha, gv0, gv1);
    }
  }

  static __device__ void run(const AttnArgs &a, char *smem) {
    const fp4attn_attention_params &p = a.p;
    const AttnWorkspace &w = a.ws;
    Ctx c;
    c.a = &a;
    c.smem = smem;
    static_cast<QueryBlock &>(c) = query_block(p, w, C::kRows, blockIdx.x, 1);

    /* constants in shared memory */
    {
      float *qbar = reinterpret_cast<float *>(smem + C::kOffQbar);
      const int64_t qblk = c.q0 / kTile;
      for (int i = threadIdx.x; i < DP; i += C::kThreads)
        qbar[i] = w.qbar[(c.bh * w.nqb + qblk) * DP + i];
    }
    issue_tile(c, 0, 0);
    cp_async_commit();
    __syncthreads();
    quantize_q(c);
    compute_bias_tile(c, 0, 0);

    const float decq = q_scales(w, c.bh)[kQDec];
    const float deck = kv_scales(w, c.bhk)[kKDec], decv = kv_scales(w, c.bhk)[kVDec];
    const float cqk = a.scale_log2 * (decq * deck);

    RowState rs;
    rs.sm.m[0] = rs.sm.m[1] = -INFINITY;
    rs.sm.l[0] = rs.sm.l[1] = 0.0f;
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) rs.o[n][0] = rs.o[n][1] = rs.o[n][2] = rs.o[n][3] = 0.0f;

    for (int j = 0; j < c.ntiles; ++j) {
      cp_async_wait_all();
      __syncthreads(); /* tile j and bias j visible; every warp is done with tile j-1 */
      if (NBUF == 2) {
        if (j + 1 < c.ntiles) {
          issue_tile(c, j + 1, (j + 1) & 1); /* overlaps the compute of tile j */
          cp_async_commit();
          compute_bias_tile(c, j + 1, (j + 1) & 1);
        }
        compute_tile(c, j, j & 1, rs, cqk);
      } else {
        compute_tile(c, j, 0, rs, cqk);
        if (j + 1 < c.ntiles) {
          __syncthreads();
          issue_tile(c, j + 1, 0);
          cp_async_commit();
          compute_bias_tile(c, j + 1, 0);
        }
      }
    }

    /* ---- epilogue (SPEC 4.6) */
    const WarpRows wrows = {c.b, c.h, c.q0 + (threadIdx.x >> 5) * 16};
    const float unit[2] = {1.0f, 1.0f}; /* o is O / dV: the P scales were applied per tile */
    store_rows<DP>(a, wrows, c.bh, rs.o, unit, decv, rs.sm,
                   reinterpret_cast<const float *>(smem + C::kOffQbar),
                   w.kbar + c.bhk * DP,  /* kbar, vbar from global: keeps smem within sm_80's */
                   w.vbar + c.bhk * DP); /* 163 KB */
  }
};

template <int DP, int NWARPS, int NBUF>
__global__ void __launch_bounds__(NWARPS * 32, 1)
    attention_fwd_kernel(const __grid_constant__ AttnArgs a) {
  extern __shared__ __align__(16) char smem[];
  FwdKernel<DP, NWARPS, NBUF>::run(a, smem);
}

template <int DP, int NWARPS, int NBUF>
fp4attn_status launch_attention_fwd(const AttnArgs &a, cudaStream_t s) {
  using C = FwdConfig<DP, NWARPS, NBUF>;
  static int resident[64] = {0};
  return launch_forward(attention_fwd_kernel<DP, NWARPS, NBUF>, a, a.p, C::kRows, C::kThreads,
                        C::kSmem, resident, 0, "attention", s);
}

/* The tile shape per padded head dim: 128 query rows (8 warps) and double-buffered K/V tiles up to
 * 128; 64 rows (4 warps) and one buffer at 256, which must fit sm_80's shared memory. */
template <int DP>
fp4attn_status launch_attention_sm80(const AttnArgs &a, cudaStream_t s) {
  if constexpr (DP == 256)
    return launch_attention_fwd<256, 4, 1>(a, s);
  else
    return launch_attention_fwd<DP, 8, 2>(a, s);
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_SM80_ATTENTION_SM80_CUH */
