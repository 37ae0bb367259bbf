/*
 * The q-mean correction of SPEC 4.4, bias[key] = scale * log2(e) * (qbar . K[key]) with K in input
 * precision: on FP32 FMAs (compute_bias) or on the tensor cores (BiasMma).
 */
#ifndef FP4ATTN_CUDA_TILE_QMEAN_BIAS_CUH
#define FP4ATTN_CUDA_TILE_QMEAN_BIAS_CUH

#include "workspace.cuh"

namespace fp4attn_cuda {

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
 * g's row; k16 step m uses chunk 4 (m / 2) + t, half m % 2, so the step's reduction index k = 2t +
 * e (b0) is column 8c + 4 (m % 2) + e and k = 2t + 8 + e (b1) is column 8c + 4 (m % 2) + 2 + e. */
template <int DP, bool kBf16>
struct BiasMma {
  static constexpr int kSteps = DP / 16;
  static constexpr int kChunks = DP / 32; /* 16-byte chunks per lane and key */
  uint32_t afrag[kSteps][2]; /* A fragment words a0, a2 of every k16 step (a1 = a3 = 0) */
  const char *kchunk;        /* chunk 0 (columns 8t..) of K row key0 + g of tile 0, (b, hk) */
  int64_t row_bytes;         /* from one key's row to the next */
  int64_t rows_left;         /* len_k - (key0 + g): keys from that row on that exist */
  uint32_t chunk_ok;         /* bit i: this lane's chunk i lies inside the head dim */

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
    kchunk = static_cast<const char *>(p.k) + 2 * (b * p.k_stride[0] + hk * p.k_stride[1]) +
             (key0 + g) * row_bytes + 16 * t;
    rows_left = p.len_k - (key0 + g);
    chunk_ok = 0;
#pragma unroll
    for (int i = 0; i < kChunks; ++i)
      chunk_ok |= (8 * (4 * i + t) < (int)p.head_dim ? 1u : 0u) << i;
  }

  /* Part `idx` of x: x = p0 + p1 (+ p2) with each part the rounding of what the earlier ones left.
   */
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
    const int64_t left =
        rows_left - (int64_t)tile * kTile; /* keys of this lane's rows that exist */
    const char *kp = kchunk + (int64_t)tile * kTile * row_bytes;
    const int64_t step = 8 * row_bytes; /* rows g, g + 8, g + 16, g + 24 */
    uint4(&kv)[4][kChunks] = keys.kv;
    if (left >= 32 && chunk_ok == (1u << kChunks) - 1) { /* every tile but a key-padded last one */
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int i = 0; i < kChunks; ++i)
          kv[n][i] = __ldg(reinterpret_cast<const uint4 *>(kp + n * step + 64 * i));
    } else {
      const int nleft = left < 0 ? 0 : (int)min(left, (int64_t)32);
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int i = 0; i < kChunks; ++i)
          kv[n][i] = 8 * n < nleft && (chunk_ok >> i & 1u)
                         ? __ldg(reinterpret_cast<const uint4 *>(kp + n * step + 64 * i))
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
      if (g == 0)
        *reinterpret_cast<float2 *>(bias + 8 * n + 2 * t) =
            make_float2(v0 * a.scale_log2, v1 * a.scale_log2);
    }
  }
};

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_TILE_QMEAN_BIAS_CUH */
