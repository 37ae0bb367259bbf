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
#ifndef FP4ATTN_CUDA_ATTENTION_FWD_CUH
#define FP4ATTN_CUDA_ATTENTION_FWD_CUH

#include "attention.cuh"

namespace fp4attn_cuda {

constexpr float kLog2_2688 = 11.392317422778760f; /* log2(2688) */
constexpr float kLn2 = 0.69314718055994531f;

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/* bmax / 6 for the E4M3 block scale of P: one FMA-corrected step instead of the IEEE division
 * (whose slow-path branch splits the block pipeline). The quotient can differ from the correctly
 * rounded one in the last bit for some inputs, but its E4M3 rounding never does: checked
 * exhaustively for every float in [0, 4096] (P blocks are at most 2688 * (1 + 2^-22)). */
__device__ __forceinline__ float div6_for_e4m3(float a) {
  const float y = 0.16666667163372040f; /* fl(1/6) */
  const float q0 = __fmul_rn(a, y);
  const float r = __fmaf_rn(-q0, 6.0f, a);
  return __fmaf_rn(r, y, q0);
}

/* E4M3 byte -> half2 (s, s); exact. */
__device__ __forceinline__ uint32_t e4m3_half2(uint8_t s) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  __half_raw hr = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)s, __NV_E4M3);
  return (uint32_t)hr.x | ((uint32_t)hr.x << 16);
#else
  const float f = fp4attn_e4m3_decode(s);
  return pack_half2(f, f);
#endif
}

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
  static constexpr int kOffRcp = kOffQbar + DP * 4;  /* 1/s per E4M3 byte (0 for s = 0) */
  static constexpr int kOffS2 = kOffRcp + 128 * 4;   /* (s, s) as half2 per E4M3 byte */
  static constexpr int kSmem = kOffS2 + 128 * 4;
};

template <int DP, int NWARPS, int NBUF>
struct FwdKernel {
  using C = FwdConfig<DP, NWARPS, NBUF>;

  struct Ctx {
    const AttnArgs *a;
    int64_t b, h, bh, bhk, hk, q0;
    int ntiles;
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

  /* bias[key] = scale * log2(e) * (qbar_i . K_j[key]) with K in input precision, FP32. All of a
   * thread's loads are issued before the first FMA (one L2 round trip per tile, not eight). */
  static __device__ void compute_bias(const Ctx &c, int j, int buf) {
    const fp4attn_attention_params &p = c.a->p;
    const float *qbar = reinterpret_cast<const float *>(c.smem + C::kOffQbar);
    constexpr int TPK = C::kThreads / kTile; /* threads per key: 2 or 1 */
    constexpr int PER = DP / TPK;            /* columns per thread (zeros past D) */
    const int key = threadIdx.x / TPK, part = threadIdx.x % TPK;
    const int64_t tok = (int64_t)j * kTile + key;
    const int D = (int)p.head_dim;
    const int c0 = part * PER;
    float acc = 0.0f;
    if (tok < p.len_k) {
      const int64_t base = c.b * p.k_stride[0] + c.hk * p.k_stride[1] + tok * p.k_stride[2];
      if (c.a->vec_k && p.dtype != FP4ATTN_FLOAT32) {
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
            const uint32_t w[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float2 f;
              if (bf) {
                f.x = __uint_as_float(w[e] << 16);
                f.y = __uint_as_float(w[e] & 0xFFFF0000u);
              } else {
                f = __half22float2(*reinterpret_cast<const __half2 *>(&w[e]));
              }
              acc = fmaf(qbar[d + 2 * e], f.x, acc);
              acc = fmaf(qbar[d + 2 * e + 1], f.y, acc);
            }
          }
        }
      } else {
        for (int d = c0; d < min(D, c0 + PER); d += 8) {
          float v[8];
          if (c.a->vec_k && d + 8 <= D) {
            load8_as_float(p.k, p.dtype, base + d, true, v);
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = d + e < D ? load_as_float(p.k, p.dtype, base + d + e) : 0.0f;
          }
#pragma unroll
          for (int e = 0; e < 8; ++e) acc = fmaf(qbar[d + e], v[e], acc);
        }
      }
    }
    if (TPK == 2) acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if (part == 0) bias(c, buf)[key] = acc * c.a->scale_log2;
  }

  /* Q prologue: quantize this block's rows (SPEC 4.2-4.3) into FP16 smem. */
  static __device__ void quantize_q(const Ctx &c) {
    const fp4attn_attention_params &p = c.a->p;
    const float *qbar = reinterpret_cast<const float *>(c.smem + C::kOffQbar);
    const float encq = c.a->ws.qscale[c.bh * 2 + 0];
    const int D = (int)p.head_dim;
    constexpr int KB = DP / 16;
    __half *qt = q_tile(c);
    for (int job = threadIdx.x; job < C::kRows * KB; job += C::kThreads) {
      const int r = job / KB, kb = job % KB;
      const int64_t row = c.q0 + r;
      uint32_t o[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (row < p.len_q && kb * 16 < D) {
        const int64_t base = c.b * p.q_stride[0] + c.h * p.q_stride[1] + row * p.q_stride[2];
        float xs[16];
        uint8_t q[16];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int c0 = kb * 16 + half * 8;
          float v[8];
          if (c.a->vec_q && c0 + 8 <= D) {
            load8_as_float(p.q, p.dtype, base + c0, true, v);
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = c0 + e < D ? load_as_float(p.q, p.dtype, base + c0 + e) : 0.0f;
          }
#pragma unroll
          for (int e = 0; e < 8; ++e)
            xs[half * 8 + e] = c0 + e < D ? __fmul_rn(__fsub_rn(v[e], qbar[c0 + e]), encq) : 0.0f;
        }
        const uint8_t s = fp4attn_quantize_block(xs, 16, q);
        const float sv = fp4attn_e4m3_decode(s);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          o[i] = pack_half2(fp4attn_e2m1_decode(q[2 * i]) * sv, fp4attn_e2m1_decode(q[2 * i + 1]) * sv);
      }
      *reinterpret_cast<uint4 *>(qt + swz<DP>(r, kb * 16)) = make_uint4(o[0], o[1], o[2], o[3]);
      *reinterpret_cast<uint4 *>(qt + swz<DP>(r, kb * 16 + 8)) = make_uint4(o[4], o[5], o[6], o[7]);
    }
  }

  struct RowState {
    float m[2], l[2];
    float o[DP / 8][4];
  };

  /* Scores, softmax with two-level P quantization, and PV for key tile j (one warp, 16 rows). */
  static __device__ __forceinline__ void compute_tile(const Ctx &c, int j, int buf, RowState &rs,
                                                      float cqk, float decv) {
    const fp4attn_attention_params &p = c.a->p;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
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
        mma_f16_16816(s[2 * np], a, b0, b1);
        mma_f16_16816(s[2 * np + 1], a, b2, b3);
      }
    }

    /* ---- scores in log2 units: x = scale*log2e*(dQ dK acc + qbar.K) (+ mask) */
    const int64_t j0 = (int64_t)j * kTile;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      const float2 bb = *reinterpret_cast<const float2 *>(bs + n * 8 + 2 * t);
      s[n][0] = fmaf(s[n][0], cqk, bb.x);
      s[n][1] = fmaf(s[n][1], cqk, bb.y);
      s[n][2] = fmaf(s[n][2], cqk, bb.x);
      s[n][3] = fmaf(s[n][3], cqk, bb.y);
    }
    const bool tail = j0 + kTile > p.len_k;
    const bool diag = p.causal && j0 + kTile - 1 > c.q0 + wr;
    if (tail || diag || p.mask_kind != FP4ATTN_MASK_NONE) {
#pragma unroll
      for (int n = 0; n < 16; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t tok = j0 + n * 8 + 2 * t + (e & 1);
          const int64_t qi = c.q0 + wr + g + (e >> 1) * 8;
          bool ok = tok < p.len_k && (!p.causal || tok <= qi);
          float add = 0.0f;
          if (ok && p.mask_kind != FP4ATTN_MASK_NONE && qi < p.len_q) {
            const int64_t off = c.b * p.mask_stride[0] + c.h * p.mask_stride[1] +
                                qi * p.mask_stride[2] + tok * p.mask_stride[3];
            if (p.mask_kind == FP4ATTN_MASK_BOOL)
              ok = static_cast<const uint8_t *>(p.mask)[off] != 0;
            else
              add = load_as_float(p.mask, p.mask_dtype, off) * 1.4426950408889634f;
          }
          s[n][e] = ok ? s[n][e] + add : -INFINITY;
        }
    }

    /* ---- online softmax statistics (SPEC 4.5), rows g and g+8 */
    float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      tmax[0] = fmaxf(tmax[0], fmaxf(s[n][0], s[n][1]));
      tmax[1] = fmaxf(tmax[1], fmaxf(s[n][2], s[n][3]));
    }
    float alpha[2], gsc[2], toff[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
      const float mnew = fmaxf(rs.m[r], tmax[r]);
      const bool empty = tmax[r] == -INFINITY;
      alpha[r] = rs.m[r] == -INFINITY ? 0.0f : fast_exp2(rs.m[r] - mnew);
      const float beta = empty ? 0.0f : fast_exp2(tmax[r] - mnew);
      gsc[r] = beta * (1.0f / FP4ATTN_NVFP4_RANGE);
      toff[r] = (empty ? 0.0f : tmax[r]) - kLog2_2688;
      rs.m[r] = mnew;
    }

    /* ---- Pq = 2688 * exp(S - t); its row sums feed l (unquantized, SPEC 4.5) */
    float rsum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < 16; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = fast_exp2(s[n][e] - toff[e >> 1]);
      rsum[0] += s[n][0] + s[n][1];
      rsum[1] += s[n][2] + s[n][3];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) rs.l[r] = fmaf(alpha[r], rs.l[r], gsc[r] * rsum[r]);

    /* ---- phi_local of Pq in 16-key blocks -> P^q as exact FP16 A fragments. Block kb of row
     * g (r = 0) or g+8 (r = 1) is s[2kb][2r..2r+1] and s[2kb+1][2r..2r+1] of the 4 quad lanes.
     * Stages are written across all 16 blocks so the scheduler can interleave them. */
    const float *rcp_tab = reinterpret_cast<const float *>(c.smem + C::kOffRcp);
    const uint32_t *s2_tab = reinterpret_cast<const uint32_t *>(c.smem + C::kOffS2);
    float bm[8][2];
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
    uint32_t pa[8][4];
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint8_t sb = e4m3_encode_fast(div6_for_e4m3(bm[kb][r]));
        const float rcp = rcp_tab[sb];
        const uint32_t s2 = s2_tab[sb];
        const float y0 = e2m1_round_nonneg(__fmul_rn(s[2 * kb][2 * r], rcp));
        const float y1 = e2m1_round_nonneg(__fmul_rn(s[2 * kb][2 * r + 1], rcp));
        const float y2 = e2m1_round_nonneg(__fmul_rn(s[2 * kb + 1][2 * r], rcp));
        const float y3 = e2m1_round_nonneg(__fmul_rn(s[2 * kb + 1][2 * r + 1], rcp));
        pa[kb][r] = hmul2_bits(pack_half2(y0, y1), s2);
        pa[kb][2 + r] = hmul2_bits(pack_half2(y2, y3), s2);
      }
    }

    /* ---- O = alpha O + (beta/2688) dV (P^q V^), GW output columns at a time */
    constexpr int GW = DP == 256 ? 32 : 64; /* fewer live accumulators where O is largest */
    const float gv0 = gsc[0] * decv, gv1 = gsc[1] * decv;
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
          mma_f16_16816(acc[2 * np], pa[kb], b0, b1);
          mma_f16_16816(acc[2 * np + 1], pa[kb], b2, b3);
        }
      }
#pragma unroll
      for (int n = 0; n < GW / 8; ++n) {
        float *o = rs.o[grp * (GW / 8) + n];
        o[0] = fmaf(alpha[0], o[0], gv0 * acc[n][0]);
        o[1] = fmaf(alpha[0], o[1], gv0 * acc[n][1]);
        o[2] = fmaf(alpha[1], o[2], gv1 * acc[n][2]);
        o[3] = fmaf(alpha[1], o[3], gv1 * acc[n][3]);
      }
    }
  }

  static __device__ void run(const AttnArgs &a, char *smem) {
    const fp4attn_attention_params &p = a.p;
    const AttnWorkspace &w = a.ws;
    Ctx c;
    c.a = &a;
    c.smem = smem;
    const int64_t nqt = ceil_div_dev(p.len_q, C::kRows);
    const int64_t bh = blockIdx.x / nqt;
    int64_t qt = blockIdx.x % nqt;
    if (p.causal) qt = nqt - 1 - qt; /* longest rows first */
    c.bh = bh;
    c.b = bh / p.heads_q;
    c.h = bh % p.heads_q;
    c.hk = c.h / (p.heads_q / p.heads_kv);
    c.bhk = c.b * p.heads_kv + c.hk;
    c.q0 = qt * C::kRows;
    int64_t ntiles = w.nkt;
    if (p.causal) {
      const int64_t last = min(c.q0 + C::kRows, p.len_q) - 1;
      ntiles = min(ntiles, last / kTile + 1);
    }
    c.ntiles = (int)ntiles;

    /* constants in shared memory */
    {
      float *rcp = reinterpret_cast<float *>(smem + C::kOffRcp);
      uint32_t *s2 = reinterpret_cast<uint32_t *>(smem + C::kOffS2);
      for (int i = threadIdx.x; i < 128; i += C::kThreads) {
        const float sv = fp4attn_e4m3_decode((uint8_t)i);
        rcp[i] = (i == 0 || i == 0x7F) ? 0.0f : 1.0f / sv; /* correctly rounded (SPEC 2) */
        s2[i] = i == 0x7F ? 0u : e4m3_half2((uint8_t)i);
      }
      float *qbar = reinterpret_cast<float *>(smem + C::kOffQbar);
      const int64_t qblk = c.q0 / kTile;
      for (int i = threadIdx.x; i < DP; i += C::kThreads) qbar[i] = w.qbar[(bh * w.nqb + qblk) * DP + i];
    }
    issue_tile(c, 0, 0);
    cp_async_commit();
    __syncthreads();
    quantize_q(c);
    compute_bias(c, 0, 0);

    const float decq = w.qscale[bh * 2 + 1];
    const float deck = w.kvscale[c.bhk * 4 + 1], decv = w.kvscale[c.bhk * 4 + 3];
    const float cqk = a.scale_log2 * (decq * deck);

    RowState rs;
    rs.m[0] = rs.m[1] = -INFINITY;
    rs.l[0] = rs.l[1] = 0.0f;
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) rs.o[n][0] = rs.o[n][1] = rs.o[n][2] = rs.o[n][3] = 0.0f;

    for (int j = 0; j < c.ntiles; ++j) {
      cp_async_wait_all();
      __syncthreads(); /* tile j and bias j visible; every warp is done with tile j-1 */
      if (NBUF == 2) {
        if (j + 1 < c.ntiles) {
          issue_tile(c, j + 1, (j + 1) & 1); /* overlaps the compute of tile j */
          cp_async_commit();
          compute_bias(c, j + 1, (j + 1) & 1);
        }
        compute_tile(c, j, j & 1, rs, cqk, decv);
      } else {
        compute_tile(c, j, 0, rs, cqk, decv);
        if (j + 1 < c.ntiles) {
          __syncthreads();
          issue_tile(c, j + 1, 0);
          cp_async_commit();
          compute_bias(c, j + 1, 0);
        }
      }
    }

    /* ---- epilogue (SPEC 4.6): O / l, rows without visible keys -> 0, LSE */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int D = (int)p.head_dim;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      rs.l[r] += __shfl_xor_sync(0xffffffffu, rs.l[r], 1);
      rs.l[r] += __shfl_xor_sync(0xffffffffu, rs.l[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t qi = c.q0 + warp * 16 + g + r * 8;
      const float inv = rs.l[r] > 0.0f ? 1.0f / rs.l[r] : 0.0f;
      if (qi < p.len_q) {
        const int64_t ob = c.b * p.out_stride[0] + c.h * p.out_stride[1] + qi * p.out_stride[2];
#pragma unroll
        for (int n = 0; n < DP / 8; ++n) {
          const int d = n * 8 + 2 * t;
          const float v0 = rs.o[n][2 * r] * inv, v1 = rs.o[n][2 * r + 1] * inv;
          if (d + 1 < D)
            store2_from_float(p.out, p.dtype, ob + d, v0, v1, a.out_pair);
          else if (d < D)
            store_from_float(p.out, p.dtype, ob + d, v0);
        }
      }
    }
    if (p.lse) {
      /* the smoothed scores omit (q_r - qbar_i) . kbar per row; add it back (reference) */
      const float *qbar = reinterpret_cast<const float *>(smem + C::kOffQbar);
      const float *kbar = w.kbar + c.bhk * DP; /* global: keeps smem within sm_80's 163 KB */
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t qi = c.q0 + warp * 16 + g + r * 8;
        float sh = 0.0f;
        if (qi < p.len_q) {
          const int64_t base = c.b * p.q_stride[0] + c.h * p.q_stride[1] + qi * p.q_stride[2];
          for (int d = t; d < D; d += 4)
            sh = fmaf(__fsub_rn(load_as_float(p.q, p.dtype, base + d), qbar[d]), kbar[d], sh);
        }
        sh += __shfl_xor_sync(0xffffffffu, sh, 1);
        sh += __shfl_xor_sync(0xffffffffu, sh, 2);
        if (qi < p.len_q && t == 0) {
          const float lse = rs.l[r] > 0.0f ? rs.m[r] * kLn2 + logf(rs.l[r]) + p.scale * sh : -INFINITY;
          p.lse[c.bh * p.len_q + qi] = lse;
        }
      }
    }
  }

  static __device__ __forceinline__ int64_t ceil_div_dev(int64_t a, int64_t b) {
    return (a + b - 1) / b;
  }
};

template <int DP, int NWARPS, int NBUF>
__global__ void __launch_bounds__(NWARPS * 32, 1) attention_fwd_kernel(const __grid_constant__ AttnArgs a) {
  extern __shared__ __align__(16) char smem[];
  FwdKernel<DP, NWARPS, NBUF>::run(a, smem);
}

template <int DP, int NWARPS, int NBUF>
fp4attn_status launch_attention_fwd(const AttnArgs &a, cudaStream_t s) {
  using C = FwdConfig<DP, NWARPS, NBUF>;
  auto kernel = attention_fwd_kernel<DP, NWARPS, NBUF>;
  static bool configured[64] = {false};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64 || !configured[dev]) {
    int optin = 0;
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (optin < C::kSmem)
      return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                          "attention: head dim %d needs %d bytes of shared memory per block, the "
                          "device allows %d",
                          DP, C::kSmem, optin);
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem) !=
        cudaSuccess)
      return launch_status("attention: cudaFuncSetAttribute");
    if (dev >= 0 && dev < 64) configured[dev] = true;
  }
  const int64_t blocks = a.p.batch * a.p.heads_q * ceil_div(a.p.len_q, C::kRows);
  if (blocks > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "attention: too many query blocks");
  kernel<<<(unsigned)blocks, C::kThreads, C::kSmem, s>>>(a);
  return launch_status("attention: forward kernel");
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_ATTENTION_FWD_CUH */
