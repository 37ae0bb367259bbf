/*
 * Decode attention on the FP4 KV cache (docs/SPEC.md section 6): split-KV (flash-decoding) on
 * mma.sync m16n8k16 with FP16/BF16 operands, then a merge of the splits by their lse.
 *
 * A block (4 warps) owns one tile of 16 query rows, the G query heads x len_q positions of one
 * (batch, KV head) (GQA on the tensor cores: the heads share every key the block reads), and one
 * key range of a split. Each warp takes 32-key chunks of the range in turn: it loads the chunk's
 * K and V code runs (16 bytes per lane; the next chunk's loads are issued before this one is used)
 * and dequantizes them into its own shared tiles as the exact 16-bit values value(code) x scale,
 * decoded in registers by byte permutes and one packed multiply per pair (the FP32 row `dec` stays
 * outside: per key on the scores for K, folded into P for V); then S = Q K^T, the online softmax in
 * FP32 and O += P V. FP32 inputs split Q into BF16 hi + lo parts (two MMAs) so that S keeps 16
 * bits. The warps' partial results merge in shared memory, the splits' in the merge kernel. No host
 * synchronisation: the grid follows the cache's capacity, each block reads its sequence's length on
 * the device.
 */
#include "../common/smem_tiles.cuh"
#include "decode.h"

namespace fp4attn_cuda {

namespace {

constexpr int kWarps = 4, kThreads = 32 * kWarps;
constexpr int kRows = 16;  /* query rows per tile */
constexpr int kChunk = 32; /* keys per warp step */
constexpr float kLog2eD = 1.4426950408889634f;
constexpr float kLn2D = 0.69314718055994531f;

struct DecodeArgs {
  fp4attn_decode_params p;
  float *o_part;  /* [tiles][splits][16][dp]: unnormalised O of a split */
  float *ml_part; /* [tiles][splits][16][2]: its row max (log2 units) and row sum */
  float *qshift;  /* [tiles][16]: scale * (q . kmean) */
  int64_t mtiles, splits;
};

template <int DP>
struct DecodeSmem {
  static constexpr int kW = 2 * DP;                /* bytes per 16-bit row */
  static constexpr int kQ = 0;                     /* Q [16][DP] */
  static constexpr int kQlo = kQ + kRows * kW;     /* FP32 inputs: Q - Q_hi [16][DP] */
  static constexpr int kWarp0 = kQlo + kRows * kW; /* per warp: K, V [32][DP], dec [2][32] */
  static constexpr int kWarpBytes = 2 * kChunk * kW + 2 * kChunk * 4;
  static constexpr int kBytes = kWarp0 + kWarps * kWarpBytes;
};

template <bool kBf16>
__device__ __forceinline__ uint16_t to_bits(float x) {
  return kBf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x))
               : __half_as_ushort(__float2half_rn(x));
}
template <bool kBf16>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  return (uint32_t)to_bits<kBf16>(a) | ((uint32_t)to_bits<kBf16>(b) << 16);
}

/* Row index of token `pos` of (b, h) in the page arrays. */
__device__ __forceinline__ int64_t cache_row(const fp4attn_kv_cache &c, int64_t b, int64_t h,
                                             int64_t pos) {
  const int64_t page = c.block_table[b * c.max_pages + pos / c.page_size];
  return (page * c.heads_kv + h) * c.page_size + pos % c.page_size;
}

/* A 16-bit pair (x, y) times the 16-bit scale s in both halves: exact for E2M1 x E4M3 values. */
template <bool kBf16>
__device__ __forceinline__ uint32_t mul2(uint32_t xy, uint32_t s2) {
  uint32_t r;
  if (kBf16) /* fma with -0 (sm_80 has no bf16x2 mul); the product is exact anyway */
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(xy), "r"(s2), "r"(0x80008000u));
  else
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(xy), "r"(s2));
  return r;
}

/* The 16 code bytes of a run at p (32 values), `left` >= 8 bytes of the row from p on (a multiple
 * of 8: rows end on whole 16-value blocks); missing bytes are zero codes. */
__device__ __forceinline__ uint4 load_run(const uint8_t *p, int64_t left, bool vec16) {
  if (vec16) return *reinterpret_cast<const uint4 *>(p);
  const uint2 a = *reinterpret_cast<const uint2 *>(p);
  const uint2 b = left >= 16 ? *reinterpret_cast<const uint2 *>(p + 8) : make_uint2(0, 0);
  return make_uint4(a.x, a.y, b.x, b.y);
}

/* An E4M3 scale byte as a 16-bit value in both halves (exact in FP16 and BF16). */
template <bool kBf16>
__device__ __forceinline__ uint32_t scale2(uint8_t e4m3) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)e4m3, __NV_E4M3);
  uint16_t bits = h.x;
  if (kBf16) bits = __bfloat16_as_ushort(__float2bfloat16_rn(__half2float(__half(h))));
  return (uint32_t)bits * 0x10001u;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

/* The 8 E2M1 codes of w (element 2i in nibble 2i... low nibble first) as four 16-bit pairs, all
 * in registers: a byte permute looks the magnitudes up (an E2M1 magnitude in FP16 is one high
 * byte: 00 38 3C 3E 40 42 44 46; in BF16 two bytes), another interleaves them into pairs, and the
 * sign bits are replicated into place by a permute in sign mode. Exact. */
template <bool kBf16>
__device__ __forceinline__ void e2m1x8(uint32_t w, uint32_t (&pair)[4]) {
  const uint32_t idx = w & 0x77777777u;
  const uint32_t sgn_lo = w << 4; /* byte k's msb: the sign of nibble 2k (w's: of nibble 2k + 1) */
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t sel = (idx >> (16 * h)) & 0xFFFFu; /* nibbles 4h .. 4h + 3 */
    uint32_t m[2];
    if (kBf16) {
      const uint32_t hi = prmt(0x3F3F3F00u, 0x40404040u, sel),
                     lo = prmt(0xC0800000u, 0xC0804000u, sel);
      m[0] = prmt(lo, hi, 0x5140u);
      m[1] = prmt(lo, hi, 0x7362u);
    } else {
      const uint32_t hi = prmt(0x3E3C3800u, 0x46444240u, sel);
      m[0] = prmt(hi, 0u, 0x1404u);
      m[1] = prmt(hi, 0u, 0x3424u);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) { /* pair 2h + k: nibbles 4h + 2k, 4h + 2k + 1 = byte 2h + k */
      const uint32_t byte = 2 * h + k;
      const uint32_t sign = prmt(sgn_lo, w, ((8u | (4u + byte)) << 12) | ((8u | byte) << 4));
      pair[2 * h + k] = m[k] | (sign & 0x80008000u);
    }
  }
}

/* 32 values (16 code bytes, two 16-value blocks with scales s0, s1) dequantized as value x scale
 * into a 64-byte run of a swizzled 16-bit row: register-only decoding and one packed multiply per
 * pair. */
template <int W, bool kBf16>
__device__ __forceinline__ void dequant32(char *tile, int key, int d0, uint4 codes, uint32_t s0,
                                          uint32_t s1) {
  const uint32_t w[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) { /* 8 values: one code word -> 4 pairs -> one 16-byte store */
    const uint32_t s2 = q < 2 ? s0 : s1;
    uint32_t pr[4];
    e2m1x8<kBf16>(w[q], pr);
    const uint4 out = make_uint4(mul2<kBf16>(pr[0], s2), mul2<kBf16>(pr[1], s2),
                                 mul2<kBf16>(pr[2], s2), mul2<kBf16>(pr[3], s2));
    *reinterpret_cast<uint4 *>(tile + swz_byte<W>(key, 2 * (d0 + 8 * q))) = out;
  }
}

template <int DP, bool kBf16, bool kSplitQ>
__global__ void __launch_bounds__(kThreads) decode_kernel(const DecodeArgs a) {
  using L = DecodeSmem<DP>;
  extern __shared__ __align__(128) char smem[];
  const fp4attn_decode_params &p = a.p;
  const fp4attn_kv_cache &c = p.cache;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t tile = blockIdx.x, split = blockIdx.y;
  const int64_t H = c.heads_kv, G = p.heads_q / H, nq = p.len_q, M = G * nq;
  const int64_t b = tile / (H * a.mtiles), hk = (tile / a.mtiles) % H, mt = tile % a.mtiles;
  const int D = (int)c.head_dim;
  const int64_t Lb = p.seq_lens[b];

  /* Q rows of the tile as 16-bit operands; their smoothing shift (one split writes it) */
  for (int i = tid; i < kRows * DP; i += kThreads) {
    const int r = i / DP, d = i % DP;
    const int64_t row = mt * kRows + r;
    float v = 0.0f;
    if (row < M && d < D)
      v = load_as_float(
          p.q, p.dtype,
          b * p.q_stride[0] + (hk * G + row / nq) * p.q_stride[1] + (row % nq) * p.q_stride[2] + d);
    const uint16_t hi = to_bits<kBf16>(v);
    *reinterpret_cast<uint16_t *>(smem + L::kQ + swz_byte<L::kW>(r, 2 * d)) = hi;
    if (kSplitQ) { /* FP32 Q as hi + lo BF16 parts: 16 significant bits in S */
      const float lo = v - __bfloat162float(__ushort_as_bfloat16(hi));
      *reinterpret_cast<uint16_t *>(smem + L::kQlo + swz_byte<L::kW>(r, 2 * d)) =
          to_bits<kBf16>(lo);
    }
  }

  if (split == 0)
    for (int r = warp; r < kRows; r += kWarps) {
      const int64_t row = mt * kRows + r;
      float acc = 0.0f;
      if (row < M)
        for (int d = lane; d < D; d += 32)
          acc += load_as_float(p.q, p.dtype,
                               b * p.q_stride[0] + (hk * G + row / nq) * p.q_stride[1] +
                                   (row % nq) * p.q_stride[2] + d) *
                 c.kmean[(b * H + hk) * D + d];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) a.qshift[tile * kRows + r] = p.scale * acc;
    }
  __syncthreads();

  /* this split's chunks; each thread's two rows see keys below end[r] */
  const int64_t nch = (Lb + kChunk - 1) / kChunk, per = (nch + a.splits - 1) / a.splits;
  const int64_t c0 = split * per, c1 = min(c0 + per, nch);
  int64_t end[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) end[r] = min(Lb, Lb - nq + (mt * kRows + g + 8 * r) % nq + 1);
  char *ks = smem + L::kWarp0 + warp * L::kWarpBytes, *vs = ks + kChunk * L::kW;
  float *kdec = reinterpret_cast<float *>(vs + kChunk * L::kW), *vdec = kdec + kChunk;
  const int64_t cb = fp4_code_bytes(D), sc = fp4_scale_count(D);
  const float scale_log2 = p.scale * kLog2eD;

  float o[DP / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  /* the chunk's raw rows: lane l looks up key l's page; each lane loads 16-byte code runs (32
   * values) of K and V for its (key, run) pairs. The next chunk's loads are issued before the
   * current chunk is dequantized, so a warp always has one chunk in flight. */
  constexpr int kRuns = DP / 32, kIters = kChunk * kRuns / 32;
  const bool vec16 = cb % 16 == 0; /* rows of whole 16-byte runs, 16-byte aligned */
  struct Raw {
    uint4 k[kIters], v[kIters];
    uint16_t ks[kIters], vs[kIters];
    float kd, vd;
  };
  auto issue = [&](int64_t ch, Raw &raw) {
    const int64_t j0 = ch * kChunk;
    const bool valid = j0 + lane < Lb;
    const int64_t rl = valid ? cache_row(c, b, hk, j0 + lane) : 0;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int i = lane + 32 * it, key = i / kRuns, d0 = (i % kRuns) * 32;
      const int64_t r = __shfl_sync(0xffffffffu, rl, key);
      raw.k[it] = raw.v[it] = make_uint4(0, 0, 0, 0);
      raw.ks[it] = raw.vs[it] = 0;
      if (j0 + key < Lb && d0 < D) {
        raw.k[it] = load_run(c.k_codes + r * cb + d0 / 2, cb - d0 / 2, vec16);
        raw.v[it] = load_run(c.v_codes + r * cb + d0 / 2, cb - d0 / 2, vec16);
        raw.ks[it] = c.k_scales[r * sc + d0 / 16] |
                     (d0 + 16 < D ? c.k_scales[r * sc + d0 / 16 + 1] << 8 : 0);
        raw.vs[it] = c.v_scales[r * sc + d0 / 16] |
                     (d0 + 16 < D ? c.v_scales[r * sc + d0 / 16 + 1] << 8 : 0);
      }
    }
    raw.kd = valid ? c.k_dec[rl] : 0.0f;
    raw.vd = valid ? c.v_dec[rl] : 0.0f;
  };
  Raw cur, nxt;
  if (c0 + warp < c1) issue(c0 + warp, cur);
  for (int64_t ch = c0 + warp; ch < c1; ch += kWarps) {
    const int64_t j0 = ch * kChunk;
    if (ch + kWarps < c1) issue(ch + kWarps, nxt);
    kdec[lane] = cur.kd;
    vdec[lane] = cur.vd;
    const float vd = cur.vd;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int i = lane + 32 * it, key = i / kRuns, d0 = (i % kRuns) * 32;
      dequant32<L::kW, kBf16>(ks, key, d0, cur.k[it], scale2<kBf16>(cur.ks[it] & 0xFF),
                              scale2<kBf16>(cur.ks[it] >> 8));
      dequant32<L::kW, kBf16>(vs, key, d0, cur.v[it], scale2<kBf16>(cur.vs[it] & 0xFF),
                              scale2<kBf16>(cur.vs[it] >> 8));
    }
    float vmax = fabsf(vd);
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, x));
    __syncwarp();

    float s[kChunk / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      uint32_t qa[4];
      ldsm_a<L::kW>(qa, smem + L::kQ, 0, kk * 32);
#pragma unroll
      for (int np = 0; np < kChunk / 16; ++np) {
        uint32_t kb[2][2];
        ldsm_b<L::kW>(kb, ks, np * 16, kk * 32);
        mma_16816<kBf16>(s[2 * np], qa, kb[0][0], kb[0][1]);
        mma_16816<kBf16>(s[2 * np + 1], qa, kb[1][0], kb[1][1]);
        if (kSplitQ) {
          uint32_t qlo[4];
          ldsm_a<L::kW>(qlo, smem + L::kQlo, 0, kk * 32);
          mma_16816<kBf16>(s[2 * np], qlo, kb[0][0], kb[0][1]);
          mma_16816<kBf16>(s[2 * np + 1], qlo, kb[1][0], kb[1][1]);
        }
      }
    }
    float alpha[2], mref[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float x = -INFINITY;
#pragma unroll
      for (int n = 0; n < kChunk / 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = n * 8 + 2 * t4 + e;
          float &v = s[n][2 * r + e];
          v = j0 + key < end[r] ? v * (kdec[key] * scale_log2) : -INFINITY;
          x = fmaxf(x, v);
        }
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
      const float m_new = fmaxf(m[r], x);
      alpha[r] = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - m_new);
      mref[r] = m_new == -INFINITY ? 0.0f : m_new;
      m[r] = m_new;
    }
    uint32_t pa[kChunk / 16][4];
    const float vinv = vmax > 0.0f ? 1.0f / vmax : 0.0f;
    float rowsum[2] = {0.0f, 0.0f}, pv[kChunk / 8][4];
#pragma unroll
    for (int n = 0; n < kChunk / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = exp2f(s[n][e] - mref[e >> 1]);
        rowsum[e >> 1] += pe;
        pv[n][e] = pe * (vdec[n * 8 + 2 * t4 + (e & 1)] * vinv); /* in [0, 1] */
      }
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      pa[kk][0] = pack2<kBf16>(pv[2 * kk][0], pv[2 * kk][1]);
      pa[kk][1] = pack2<kBf16>(pv[2 * kk][2], pv[2 * kk][3]);
      pa[kk][2] = pack2<kBf16>(pv[2 * kk + 1][0], pv[2 * kk + 1][1]);
      pa[kk][3] = pack2<kBf16>(pv[2 * kk + 1][2], pv[2 * kk + 1][3]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = alpha[r] * l[r] + rowsum[r];
#pragma unroll
    for (int np = 0; np < DP / 16; ++np) {
      float acc[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < kChunk / 16; ++kk) {
        uint32_t vb[2][2];
        ldsm_b_trans<L::kW>(vb, vs, kk * 16, np * 16);
        mma_16816<kBf16>(acc[0], pa[kk], vb[0][0], vb[0][1]);
        mma_16816<kBf16>(acc[1], pa[kk], vb[1][0], vb[1][1]);
      }
#pragma unroll
      for (int x = 0; x < 2; ++x)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          o[2 * np + x][e] = alpha[e >> 1] * o[2 * np + x][e] + vmax * acc[x][e];
    }
    cur = nxt;
    __syncwarp();
  }

  /* merge the warps in shared memory (the Q and chunk tiles are free now) */
  __syncthreads();
  float *wo = reinterpret_cast<float *>(smem); /* [warps][16][DP] */
  float *wml = wo + kWarps * kRows * DP;       /* [warps][16][2] */
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lsum = l[r] + __shfl_xor_sync(0xffffffffu, l[r], 1);
    const float ls = lsum + __shfl_xor_sync(0xffffffffu, lsum, 2);
    const int row = g + 8 * r;
    if (t4 == 0) {
      wml[(warp * kRows + row) * 2] = m[r];
      wml[(warp * kRows + row) * 2 + 1] = ls;
    }
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) {
      wo[(warp * kRows + row) * DP + n * 8 + 2 * t4] = o[n][2 * r];
      wo[(warp * kRows + row) * DP + n * 8 + 2 * t4 + 1] = o[n][2 * r + 1];
    }
  }
  __syncthreads();
  const int64_t part = tile * a.splits + split;
  for (int i = tid; i < kRows * DP; i += kThreads) {
    const int row = i / DP, d = i % DP;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, wml[(w * kRows + row) * 2]);
    float acc = 0.0f, ls = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = wml[(w * kRows + row) * 2];
      const float f = mw == -INFINITY ? 0.0f : exp2f(mw - mx);
      acc += f * wo[(w * kRows + row) * DP + d];
      ls += f * wml[(w * kRows + row) * 2 + 1];
    }
    a.o_part[(part * kRows + row) * DP + d] = acc;
    if (d == 0) {
      a.ml_part[(part * kRows + row) * 2] = mx;
      a.ml_part[(part * kRows + row) * 2 + 1] = ls;
    }
  }
}

/* One block per tile: the splits merged by their row maxima, O / l and the lse. */
template <int DP>
__global__ void __launch_bounds__(256) decode_merge_kernel(const DecodeArgs a) {
  const fp4attn_decode_params &p = a.p;
  const int64_t tile = blockIdx.x, H = p.cache.heads_kv, G = p.heads_q / H, nq = p.len_q;
  const int64_t b = tile / (H * a.mtiles), hk = (tile / a.mtiles) % H, mt = tile % a.mtiles;
  const int D = (int)p.cache.head_dim;
  for (int i = threadIdx.x; i < kRows * DP; i += 256) {
    const int r = i / DP, d = i % DP;
    const int64_t row = mt * kRows + r;
    if (row >= G * nq || d >= D) continue;
    float mx = -INFINITY;
    for (int64_t s = 0; s < a.splits; ++s)
      mx = fmaxf(mx, a.ml_part[((tile * a.splits + s) * kRows + r) * 2]);
    float acc = 0.0f, ls = 0.0f;
    for (int64_t s = 0; s < a.splits; ++s) {
      const int64_t part = tile * a.splits + s;
      const float ms = a.ml_part[(part * kRows + r) * 2];
      const float f = ms == -INFINITY ? 0.0f : exp2f(ms - mx);
      acc += f * a.o_part[(part * kRows + r) * DP + d];
      ls += f * a.ml_part[(part * kRows + r) * 2 + 1];
    }
    const int64_t h = hk * G + row / nq, t = row % nq;
    store_from_float(p.out, p.dtype,
                     b * p.out_stride[0] + h * p.out_stride[1] + t * p.out_stride[2] + d,
                     ls > 0.0f ? acc / ls : 0.0f);
    if (d == 0 && p.lse)
      p.lse[(b * p.heads_q + h) * nq + t] =
          ls > 0.0f ? (mx * kLn2D + logf(ls)) + a.qshift[tile * kRows + r] : -INFINITY;
  }
}

template <int DP>
fp4attn_status launch_dp(const DecodeArgs &a, const DecodePlan &plan, cudaStream_t s) {
  static int configured[64][3];
  const int variant = a.p.dtype == FP4ATTN_FLOAT16 ? 0 : (a.p.dtype == FP4ATTN_BFLOAT16 ? 1 : 2);
  auto kernel =
      variant == 0
          ? decode_kernel<DP, false, false>
          : (variant == 1 ? decode_kernel<DP, true, false> : decode_kernel<DP, true, true>);
  const int smem = DecodeSmem<DP>::kBytes > kWarps * kRows * (DP + 2) * 4
                       ? DecodeSmem<DP>::kBytes
                       : kWarps * kRows * (DP + 2) * 4;
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64 || !configured[dev][variant]) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
        cudaSuccess)
      return launch_status("decode");
    if (dev >= 0 && dev < 64) configured[dev][variant] = 1;
  }
  kernel<<<dim3((unsigned)plan.tiles, (unsigned)plan.splits), kThreads, smem, s>>>(a);
  decode_merge_kernel<DP><<<(unsigned)plan.tiles, 256, 0, s>>>(a);
  return launch_status("decode");
}

}  // namespace

DecodePlan plan_decode(const fp4attn_decode_params &p) {
  DecodePlan d;
  const int64_t hd = p.cache.head_dim;
  d.dp = hd <= 64 ? 64 : (hd <= 128 ? 128 : 256);
  const int64_t G = p.heads_q / p.cache.heads_kv;
  d.mtiles = ceil_div(G * p.len_q, kRows);
  d.tiles = p.cache.batch * p.cache.heads_kv * d.mtiles;
  /* enough blocks for ~4 per SM, each with at least two chunks per warp at full capacity */
  const int64_t chunks = ceil_div(p.cache.max_pages * p.cache.page_size, kChunk);
  const int64_t want = ceil_div(4 * (int64_t)sm_count(), d.tiles);
  d.splits = std::max<int64_t>(1, std::min<int64_t>(want, chunks / (2 * kWarps)));
  d.o_part_bytes = round_up(4 * d.tiles * d.splits * kRows * d.dp, 256);
  d.ml_part_bytes = round_up(4 * d.tiles * d.splits * kRows * 2, 256);
  d.qshift_bytes = round_up(4 * d.tiles * kRows, 256);
  d.bytes = d.o_part_bytes + d.ml_part_bytes + d.qshift_bytes;
  return d;
}

fp4attn_status launch_decode(const fp4attn_decode_params &p, const DecodePlan &plan,
                             void *workspace, cudaStream_t s) {
  if (plan.tiles > 0x7FFFFFFFLL || plan.splits > 65535)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "decode: too many tiles");
  DecodeArgs a;
  a.p = p;
  char *w = static_cast<char *>(workspace);
  a.o_part = reinterpret_cast<float *>(w);
  a.ml_part = reinterpret_cast<float *>(w + plan.o_part_bytes);
  a.qshift = reinterpret_cast<float *>(w + plan.o_part_bytes + plan.ml_part_bytes);
  a.mtiles = plan.mtiles;
  a.splits = plan.splits;
  switch (plan.dp) {
    case 64:
      return launch_dp<64>(a, plan, s);
    case 128:
      return launch_dp<128>(a, plan, s);
    default:
      return launch_dp<256>(a, plan, s);
  }
}

}  // namespace fp4attn_cuda
