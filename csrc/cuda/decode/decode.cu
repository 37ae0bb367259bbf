/*
 * Decode attention on the FP4 KV cache (docs/SPEC.md section 6): split-KV (flash-decoding) on
 * mma.sync m16n8k16 with FP16/BF16 operands, then a merge of the splits by their lse.
 *
 * A block (4 warps) owns one tile of 16 query rows, the G query heads x len_q positions of one
 * (batch, KV head) (GQA on the tensor cores: the heads share every key the block reads), and one
 * key range of a split. Each warp takes 32-key chunks of the range in turn and never touches
 * shared memory in its loop: every lane loads the code words that its own MMA fragments need and
 * decodes them in registers (e2m1_pairs.cuh, then one packed multiply by the E4M3 scale per pair;
 * the FP32 row `dec` stays outside: per key on the scores for K, folded into P for V).
 *
 * Fragment layouts (g = lane / 4, t4 = lane % 4, chunk keys 0..31, n-tile j = keys 8j..8j+7):
 *  - S = Q K^T: lane (g, t4) decodes key 8j + g, bytes [t4 DP/8, (t4 + 1) DP/8) of its row, i.e.
 *    d = t4 DP/4 + 8i + n for word i, nibble n. Word i feeds k-steps 2i and 2i + 1; the MMA slot
 *    order this implies is applied to Q once, when the block stages it (q_dim). A dot product does
 *    not care in which order it sums d.
 *  - O += P V: the S accumulator is P's A operand (keys 8j + 2 t4 + b), so lane (g, t4) decodes
 *    the V rows of exactly those 8 keys, bytes [g DP/16, (g + 1) DP/16): d = g DP/8 + 8w + n.
 *    Half words of two keys are joined so that one decoded pair holds (key, key + 1) at one d:
 *    n-tile nt of O is d = (DP/8) n + nt for its column n (o_dim), undone when O is stored.
 * FP32 inputs split Q into BF16 hi + lo parts (two MMAs) so that S keeps 16 bits. The warps'
 * partial results merge in shared memory, the splits' in the merge kernel. No host
 * synchronisation: the grid follows the cache's capacity, each block reads its sequence's length
 * on the device.
 */
#include <map>
#include <mutex>

#include "../common/smem_tiles.cuh"
#include "decode.h"
#include "e2m1_pairs.cuh"
#include "split_merge.cuh"

namespace fp4attn_cuda {

namespace {

constexpr int kWarps = 4, kThreads = 32 * kWarps;
constexpr int kRows = 16;  /* query rows per tile */
constexpr int kChunk = 32; /* keys per warp step */
constexpr float kLog2eD = 1.4426950408889634f;

struct DecodeArgs {
  fp4attn_decode_params p;
  float *o_part;  /* [tiles][splits][16][dp]: unnormalised O of a split */
  float *ml_part; /* [tiles][splits][16][2]: its row max (log2 units) and row sum */
  float *qshift;  /* [tiles][16]: scale * (q . kmean) */
  int64_t mtiles, splits;
};

/* Shared memory: the Q tile (and its FP32 low part) in MMA slot order; later the warps' merge. */
template <int DP>
struct DecodeSmem {
  static constexpr int kW = 2 * DP; /* bytes per 16-bit row */
  static constexpr int kQ = 0, kQlo = kRows * kW;
  static constexpr int kMerge = kWarps * kRows * (DP + 2) * 4;
  static constexpr int kBytes = 2 * kRows * kW > kMerge ? 2 * kRows * kW : kMerge;
};

/* Storage d of Q slot column c (k-step c / 16, slot c % 16) in the K fragment layout above:
 * slot 2 t4 + e (+ 8 for hi) of k-step 2i + h is nibble 2h + hi + 4e of the lane's word i. */
template <int DP>
__device__ __forceinline__ int q_dim(int c) {
  const int ks = c >> 4, slot = c & 15;
  return ((slot & 7) >> 1) * (DP / 4) + 8 * (ks >> 1) + 2 * (ks & 1) + (slot >> 3) + 4 * (slot & 1);
}
/* Storage d of O column n of n-tile nt (the V fragment layout above). */
template <int DP>
__device__ __forceinline__ int o_dim(int nt, int n) {
  return (DP / 8) * n + nt;
}

template <bool kBf16>
__device__ __forceinline__ uint16_t to_bits(float x) {
  return kBf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x))
               : __half_as_ushort(__float2half_rn(x));
}
template <bool kBf16>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  return (uint32_t)to_bits<kBf16>(a) | ((uint32_t)to_bits<kBf16>(b) << 16);
}

/* A 16-bit pair (x, y) times the 16-bit pair s2: exact for E2M1 x E4M3 values. */
template <bool kBf16>
__device__ __forceinline__ uint32_t mul2(uint32_t xy, uint32_t s2) {
  uint32_t r;
  if (kBf16) /* fma with -0 (sm_80 has no bf16x2 mul); the product is exact anyway */
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(xy), "r"(s2), "r"(0x80008000u));
  else
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(xy), "r"(s2));
  return r;
}

/* An E4M3 scale byte as a 16-bit value (exact in FP16 and BF16). */
template <bool kBf16>
__device__ __forceinline__ uint32_t scale1(uint32_t e4m3) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(e4m3 & 0xFFu), __NV_E4M3);
  return kBf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(__half2float(__half(h)))) : h.x;
}

/* N consecutive 32-bit words at byte `off` of a row of `len` bytes (zeros past its end): one
 * vector load where kVec (then off and the row are 4N-byte aligned and the row is whole). */
template <int N, bool kVec>
__device__ __forceinline__ void load_words(uint32_t (&w)[N], const uint8_t *row, int off, int len) {
  if (kVec) {
    if constexpr (N == 1) {
      w[0] = *reinterpret_cast<const uint32_t *>(row + off);
    } else if constexpr (N == 2) {
      const uint2 x = *reinterpret_cast<const uint2 *>(row + off);
      w[0] = x.x, w[1] = x.y;
    } else {
#pragma unroll
      for (int i = 0; i < N; i += 4) {
        const uint4 x = *reinterpret_cast<const uint4 *>(row + off + 4 * i);
        w[i] = x.x, w[i + 1] = x.y, w[i + 2] = x.z, w[i + 3] = x.w;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i)
      w[i] = off + 4 * i + 4 <= len ? *reinterpret_cast<const uint32_t *>(row + off + 4 * i) : 0u;
  }
}
/* N consecutive scale bytes from block `blk` of a row of `len` blocks (0 past its end), packed. */
template <int N>
__device__ __forceinline__ uint32_t load_scales(const uint8_t *row, int blk, int len) {
  uint32_t r = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) r |= blk + i < len ? (uint32_t)row[blk + i] << (8 * i) : 0u;
  return r;
}

template <int DP>
struct Frag {
  static constexpr int kKWords = DP / 32; /* K words per key and lane */
  static constexpr int kKBlocks = DP / 64 > 0 ? DP / 64 : 1;
  static constexpr int kVWords = DP / 64 > 0 ? DP / 64 : 1; /* V words per key and lane */
  static constexpr int kVBlocks = DP / 128 > 0 ? DP / 128 : 1;
};

/* One chunk's raw loads of a lane: K rows of keys 8j + g, V rows and decs of keys 8j + 2 t4 + b. */
template <int DP>
struct Raw {
  using F = Frag<DP>;
  uint32_t k[4][F::kKWords], ks[4];
  uint32_t v[4][2][F::kVWords], vs[4][2];
  float kd[4][2], vd[4][2];
};

/* kFast: pages hold whole chunks (page_size % 32 == 0), D == DP and 16-byte aligned code arrays:
 * one page lookup per chunk, compile-time row strides and vector loads. Otherwise a lookup per
 * key and bounded loads. */
template <int DP, bool kFast>
__device__ __forceinline__ void load_chunk(Raw<DP> &raw, const fp4attn_kv_cache &c, int64_t b,
                                           int64_t hk, int key0, int len, int lane) {
  using F = Frag<DP>;
  const int g = lane >> 2, t4 = lane & 3;
  const int cb = kFast ? DP / 2 : (int)fp4_code_bytes(c.head_dim);
  const int sc = kFast ? DP / 16 : (int)fp4_scale_count(c.head_dim);
  const int ps = (int)c.page_size;
  int64_t base = 0;
  if (kFast) {
    const int64_t page = c.block_table[b * c.max_pages + key0 / ps];
    base = (page * c.heads_kv + hk) * ps + key0 % ps;
  }
  /* The row of chunk key `key`: base + key where pages hold whole chunks, else looked up (a key
   * past the sequence's end reads its last key). Such keys' scores are masked, their V zeroed. */
  auto row_of = [&](int key) -> int64_t {
    if (kFast) return key;
    const int pos = min(key0 + key, len - 1);
    const int64_t page = c.block_table[b * c.max_pages + pos / ps];
    return (page * c.heads_kv + hk) * ps + pos % ps;
  };
  const uint8_t *kc = c.k_codes + base * cb, *ks = c.k_scales + base * sc;
  const uint8_t *vc = c.v_codes + base * cb, *vs = c.v_scales + base * sc;
  const float *kd = c.k_dec + base, *vd = c.v_dec + base;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t r = row_of(8 * j + g);
    load_words<F::kKWords, kFast>(raw.k[j], kc + r * cb, t4 * (DP / 8), cb);
    raw.ks[j] = load_scales<F::kKBlocks>(ks + r * sc, t4 * (DP / 64), sc);
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int key = 8 * j + 2 * t4 + x;
      const bool valid = key0 + key < len;
      const int64_t rv = row_of(key);
      load_words<F::kVWords, kFast>(raw.v[j][x], vc + rv * cb, g * (DP / 16), cb);
      raw.vs[j][x] = valid ? load_scales<F::kVBlocks>(vs + rv * sc, g * DP / 128, sc) : 0u;
      raw.kd[j][x] = kd[rv];
      raw.vd[j][x] = valid ? vd[rv] : 0.0f; /* zero V past the end: no NaN from free slots */
    }
  }
}

template <int DP, bool kBf16, bool kSplitQ, bool kFast>
__global__ void __launch_bounds__(kThreads, DP == 64 ? 4 : (DP == 128 ? 3 : 1))
    decode_kernel(const DecodeArgs a) {
  using L = DecodeSmem<DP>;
  using F = Frag<DP>;
  extern __shared__ __align__(128) char smem[];
  const fp4attn_decode_params &p = a.p;
  const fp4attn_kv_cache &c = p.cache;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t tile = blockIdx.x, split = blockIdx.y;
  const int64_t H = c.heads_kv, G = p.heads_q / H, nq = p.len_q, M = G * nq;
  const int64_t b = tile / (H * a.mtiles), hk = (tile / a.mtiles) % H, mt = tile % a.mtiles;
  const int D = (int)c.head_dim;
  const int Lb = p.seq_lens[b];
  auto q_index = [&](int64_t row, int d) {
    return b * p.q_stride[0] + (hk * G + row / nq) * p.q_stride[1] + (row % nq) * p.q_stride[2] + d;
  };

  /* Q rows of the tile as 16-bit operands in MMA slot order; their smoothing shift */
  for (int i = tid; i < kRows * DP; i += kThreads) {
    const int r = i / DP, col = i % DP, d = q_dim<DP>(col);
    const int64_t row = mt * kRows + r;
    const float v = row < M && d < D ? load_as_float(p.q, p.dtype, q_index(row, d)) : 0.0f;
    const uint16_t hi = to_bits<kBf16>(v);
    *reinterpret_cast<uint16_t *>(smem + L::kQ + swz_byte<L::kW>(r, 2 * col)) = hi;
    if (kSplitQ) { /* FP32 Q as hi + lo BF16 parts: 16 significant bits in S */
      const float lo = v - __bfloat162float(__ushort_as_bfloat16(hi));
      *reinterpret_cast<uint16_t *>(smem + L::kQlo + swz_byte<L::kW>(r, 2 * col)) =
          to_bits<kBf16>(lo);
    }
  }
  if (split == 0)
    for (int r = warp; r < kRows; r += kWarps) {
      const int64_t row = mt * kRows + r;
      float acc = 0.0f;
      if (row < M)
        for (int d = lane; d < D; d += 32)
          acc += load_as_float(p.q, p.dtype, q_index(row, d)) * c.kmean[(b * H + hk) * D + d];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) a.qshift[tile * kRows + r] = p.scale * acc;
    }
  __syncthreads();

  /* this split's chunks; each thread's two rows see keys [begin[r], end[r]) */
  int end[2], begin[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    end[r] = min((int64_t)Lb, Lb - nq + (mt * kRows + g + 8 * r) % nq + 1);
    begin[r] = p.window > 0 ? max(0, end[r] - (int)p.window) : 0;
  }
  const int first = p.window > 0 ? max(0, Lb - (int)nq + 1 - (int)p.window) / kChunk : 0;
  const int nch = (Lb + kChunk - 1) / kChunk - first;
  const int per = (nch + (int)a.splits - 1) / (int)a.splits;
  const int c0 = first + (int)split * per, c1 = min(c0 + per, first + nch);
  const float scale_log2 = p.scale * kLog2eD;

  float o[DP / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  for (int ch = c0 + warp; ch < c1; ch += kWarps) {
    const int j0 = ch * kChunk;
    Raw<DP> cur; /* no register prefetch: 3 blocks per SM hide the loads instead (measured alike) */
    load_chunk<DP, kFast>(cur, c, b, hk, j0, Lb, lane);

    /* S = Q K^T: word i of key 8j + g feeds k-steps 2i, 2i + 1 of n-tile j */
    float s[4][4] = {};
#pragma unroll
    for (int i = 0; i < F::kKWords; ++i) {
      uint32_t qa[2][4], qlo[2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        ldsm_a<L::kW>(qa[h], smem + L::kQ, 0, (2 * i + h) * 32);
        if (kSplitQ) ldsm_a<L::kW>(qlo[h], smem + L::kQlo, 0, (2 * i + h) * 32);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t pr[4];
        e2m1_pairs<kBf16>(cur.k[j][i], pr);
        const uint32_t s1 = scale1<kBf16>(cur.ks[j] >> (8 * (i / 2))), s2 = s1 * 0x10001u;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t b0 = mul2<kBf16>(pr[2 * h], s2), b1 = mul2<kBf16>(pr[2 * h + 1], s2);
          mma_16816<kBf16>(s[j], qa[h], b0, b1);
          if (kSplitQ) mma_16816<kBf16>(s[j], qlo[h], b0, b1);
        }
      }
    }

    /* online softmax over the chunk; V's dec goes into P, normalised by the chunk's largest */
    float vmax = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) vmax = fmaxf(vmax, fmaxf(fabsf(cur.vd[j][0]), fabsf(cur.vd[j][1])));
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 1));
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 2));
    float alpha[2], mref[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float x = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = j0 + 8 * j + 2 * t4 + e;
          float &v = s[j][2 * r + e];
          v = key < end[r] && key >= begin[r] ? v * (cur.kd[j][e] * scale_log2) : -INFINITY;
          x = fmaxf(x, v);
        }
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
      const float m_new = fmaxf(m[r], x);
      alpha[r] = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - m_new);
      mref[r] = m_new == -INFINITY ? 0.0f : m_new;
      m[r] = m_new;
    }
    const float vinv = vmax > 0.0f ? 1.0f / vmax : 0.0f;
    float rowsum[2] = {0.0f, 0.0f}, pv[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = exp2f(s[j][e] - mref[e >> 1]);
        rowsum[e >> 1] += pe;
        pv[j][e] = pe * (cur.vd[j][e & 1] * vinv); /* in [0, 1] */
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = alpha[r] * l[r] + rowsum[r];
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f))
#pragma unroll
      for (int nt = 0; nt < DP / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[nt][e] *= alpha[e >> 1];

    /* O += P V: k-step kk holds keys 16kk + 2t4 + x (n-tile 2kk) and + 8 (n-tile 2kk + 1) */
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      uint32_t pa[4];
      pa[0] = pack2<kBf16>(pv[2 * kk][0], pv[2 * kk][1]);
      pa[1] = pack2<kBf16>(pv[2 * kk][2], pv[2 * kk][3]);
      pa[2] = pack2<kBf16>(pv[2 * kk + 1][0], pv[2 * kk + 1][1]);
      pa[3] = pack2<kBf16>(pv[2 * kk + 1][2], pv[2 * kk + 1][3]);
#pragma unroll
      for (int w = 0; w < F::kVWords; ++w) {
        uint32_t pair[2][2][4]; /* [k-slot half][d nibbles 0-3 / 4-7][pair] */
        uint32_t sc2[2];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const uint32_t x0 = cur.v[2 * kk + hf][0][w], x1 = cur.v[2 * kk + hf][1][w];
          /* key 0's 4 nibbles below key 1's: pair j = (key 0, key 1) at nibble j */
          e2m1_pairs<kBf16>(prmt_b32(x0, x1, 0x5410u), pair[hf][0]);
          e2m1_pairs<kBf16>(prmt_b32(x0, x1, 0x7632u), pair[hf][1]);
          const int sh = 8 * (w / 2);
          sc2[hf] = scale1<kBf16>(cur.vs[2 * kk + hf][0] >> sh) |
                    (scale1<kBf16>(cur.vs[2 * kk + hf][1] >> sh) << 16);
        }
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int n = 0; n < 4; ++n) {
            const int nt = 8 * w + 4 * half + n;
            float acc[4] = {};
            mma_16816<kBf16>(acc, pa, mul2<kBf16>(pair[0][half][n], sc2[0]),
                             mul2<kBf16>(pair[1][half][n], sc2[1]));
#pragma unroll
            for (int e = 0; e < 4; ++e) o[nt][e] = fmaf(vmax, acc[e], o[nt][e]);
          }
      }
    }
  }

  /* merge the warps in shared memory (the Q tiles are free now) */
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
    for (int nt = 0; nt < DP / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        wo[(warp * kRows + row) * DP + o_dim<DP>(nt, 2 * t4 + e)] = o[nt][2 * r + e];
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

/* Whether the cache allows the fast loads (load_chunk's kFast) for this head dim. */
bool fast_layout(const fp4attn_kv_cache &c, int64_t dp) {
  auto aligned = [](const void *x) { return reinterpret_cast<uintptr_t>(x) % 16 == 0; };
  return c.page_size % kChunk == 0 && c.head_dim == dp && aligned(c.k_codes) && aligned(c.v_codes);
}

using DecodeKernel = void (*)(DecodeArgs);

template <int DP, bool kFast>
DecodeKernel kernel_for_dtype(fp4attn_dtype dt) {
  switch (dt) {
    case FP4ATTN_FLOAT16:
      return decode_kernel<DP, false, false, kFast>;
    case FP4ATTN_BFLOAT16:
      return decode_kernel<DP, true, false, kFast>;
    default:
      return decode_kernel<DP, true, true, kFast>;
  }
}

/* The kernel variant of a call and its dynamic shared memory. */
DecodeKernel kernel_for(const fp4attn_decode_params &p, int64_t dp, int *smem) {
  const bool fast = fast_layout(p.cache, dp);
  switch (dp) {
    case 64:
      *smem = DecodeSmem<64>::kBytes;
      return fast ? kernel_for_dtype<64, true>(p.dtype) : kernel_for_dtype<64, false>(p.dtype);
    case 128:
      *smem = DecodeSmem<128>::kBytes;
      return fast ? kernel_for_dtype<128, true>(p.dtype) : kernel_for_dtype<128, false>(p.dtype);
    default:
      *smem = DecodeSmem<256>::kBytes;
      return fast ? kernel_for_dtype<256, true>(p.dtype) : kernel_for_dtype<256, false>(p.dtype);
  }
}

/* Blocks of `kernel` resident per SM on the current device (1 where the query fails), asked once
 * per kernel and device; the dynamic shared memory limit is raised first (only the head dim 256
 * variants need more than the default 48 KB). */
int blocks_per_sm(DecodeKernel kernel, int smem) {
  static std::mutex mu;
  static std::map<std::pair<DecodeKernel, int>, int> known;
  int dev = 0;
  cudaGetDevice(&dev);
  std::lock_guard<std::mutex> lock(mu);
  const auto it = known.find({kernel, dev});
  if (it != known.end()) return it->second;
  int n = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem) != cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  return known[{kernel, dev}] = n > 0 ? n : 1;
}

template <int DP>
fp4attn_status launch_dp(const DecodeArgs &a, const DecodePlan &plan, cudaStream_t s) {
  int smem = 0;
  const DecodeKernel kernel = kernel_for(a.p, DP, &smem);
  blocks_per_sm(kernel, smem); /* raises the kernel's shared memory limit once */
  kernel<<<dim3((unsigned)plan.tiles, (unsigned)plan.splits), kThreads, smem, s>>>(a);
  const fp4attn_decode_params &p = a.p;
  SplitMerge m{a.o_part,
               a.ml_part,
               a.qshift,
               a.splits,
               a.mtiles,
               p.heads_q,
               p.cache.heads_kv,
               p.len_q,
               p.cache.head_dim,
               p.out,
               {p.out_stride[0], p.out_stride[1], p.out_stride[2]},
               p.dtype,
               p.lse};
  split_merge_kernel<DP><<<(unsigned)plan.tiles, 256, 0, s>>>(m);
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
  /* Splits fill whole waves: as many blocks as are resident at once (a second, partial wave
   * would leave most SMs idle at its end), each with at least two chunks per warp over the keys
   * a full cache (or the window) lets a tile read. */
  int64_t keys = p.cache.max_pages * p.cache.page_size;
  if (p.window > 0) keys = std::min(keys, p.window + p.len_q + kChunk);
  const int64_t chunks = ceil_div(keys, kChunk);
  int smem = 0;
  const DecodeKernel kernel = kernel_for(p, d.dp, &smem);
  const int64_t wave = (int64_t)blocks_per_sm(kernel, smem) * sm_count();
  d.splits = std::max<int64_t>(1, std::min<int64_t>(wave / d.tiles, chunks / (2 * kWarps)));
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
