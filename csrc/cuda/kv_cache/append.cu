/*
 * Appending to the KV cache (docs/SPEC.md section 6): one warp per token row quantizes its K row
 * (minus kmean, divided by kscale) as a rotated 5-bit row (lane i owning values 8i .. 8i + 7) and
 * its V row as its own NVFP4 slice (lane i owning the 16-value block i), and writes them into the
 * row's page slot. On a first append a small kernel fixes kmean and kscale first (sums in token
 * order from each sequence's first unpadded row, correctly rounded division and square root:
 * bit-exact with the CPU backend).
 */
#include "../common/device.cuh"
#include "fp4attn/kv_rows.h"
#include "kv_cache.h"

namespace fp4attn_cuda {
namespace {

constexpr int kThreads = 256;

/* kmean and kscale of one (b, h) by one block, thread d owning channel d (head_dim <= kThreads). */
__global__ void __launch_bounds__(kThreads) kv_mean_kernel(const fp4attn_kv_append_params p) {
  static_assert(kThreads >= FP4ATTN_MAX_HEAD_DIM, "one thread per channel");
  __shared__ float warp_max[kThreads / 32];
  const fp4attn_kv_cache &c = p.cache;
  const int64_t bh = blockIdx.x, b = bh / c.heads_kv, h = bh % c.heads_kv;
  const int d = threadIdx.x;
  int64_t lo, hi; /* the rows of this sequence's statistics */
  fp4attn_kv_mean_rows(p.mean_from ? p.mean_from[b] : 0, p.len, p.mean_rows, &lo, &hi);
  float r = 0.0f; /* sqrt of the channel's largest |K - kmean| */
  if (d < c.head_dim) {
    float s = 0.0f, a = 0.0f;
    const int64_t base = b * p.k_stride[0] + h * p.k_stride[1] + d;
    for (int64_t n = lo; n < hi; ++n)
      s = __fadd_rn(s, load_as_float(p.k, p.dtype, base + n * p.k_stride[2]));
    const float m = hi > lo ? __fdiv_rn(s, (float)(hi - lo)) : 0.0f;
    c.kmean[bh * c.head_dim + d] = m;
    for (int64_t n = lo; n < hi; ++n)
      a = fp4attn_nanmax(
          a, fabsf(__fsub_rn(load_as_float(p.k, p.dtype, base + n * p.k_stride[2]), m)));
    r = __fsqrt_rn(a);
  }
  float g = r; /* the largest r, NaN-propagating */
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) g = fp4attn_nanmax(g, __shfl_xor_sync(0xffffffffu, g, o));
  if ((d & 31) == 0) warp_max[d / 32] = g;
  __syncthreads();
  g = warp_max[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) g = fp4attn_nanmax(g, warp_max[w]);
  if (d < c.head_dim) {
    const bool ok = fp4attn_isfinite(g) && g > 0.0f;
    const float lo = g * 0x1p-6f; /* exact: a power of two */
    c.kscale[bh * c.head_dim + d] = !ok ? 1.0f : (r > lo ? r : lo);
  }
}

/* phi of one row by one warp: lane i < nb holds block i's 16 values (already smoothed). */
__device__ __forceinline__ void quantize_row_warp(float (&x)[16], int lane, int nb, uint8_t *codes,
                                                  uint8_t *scales, float *dec) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fp4attn_nanmax(amax, fabsf(x[i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    amax = fp4attn_nanmax(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  float enc, d;
  fp4attn_global_scales(amax, &enc, &d);
  if (lane == 0) *dec = d;
  if (lane >= nb) return;
  float xs[16];
  uint8_t c[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) xs[i] = x[i] * enc;
  scales[lane] = fp4attn_quantize_block(xs, 16, c);
  uint2 packed;
  packed.x = c[0] | (c[1] << 4) | (c[2] << 8) | (c[3] << 12) | (c[4] << 16) | (c[5] << 20) |
             (c[6] << 24) | ((uint32_t)c[7] << 28);
  packed.y = c[8] | (c[9] << 4) | (c[10] << 8) | (c[11] << 12) | (c[12] << 16) | (c[13] << 20) |
             (c[14] << 24) | ((uint32_t)c[15] << 28);
  *reinterpret_cast<uint2 *>(codes + 8 * lane) = packed;
}

/* The K5 key row of SPEC 6 by one warp: lane l holds values 8l .. 8l + 7 of the row (zeros past
 * the head dim, and in lanes l >= Dp/8). Every step is SPEC 6's, in its order: the butterfly's
 * pairs (i, i + h) are in a lane for h < 8, across lanes l, l ^ (h/8) otherwise (the lower
 * element takes a + b, the upper a - b); a block of 64 values is 8 lanes, whose squared-error
 * partial sums (8 values each, in order) combine by xor-shuffles 1, 2, 4, which add the pairs of
 * SPEC 6's tree (each sum the same whichever lane forms it: additions commute). No FMA: products
 * and sums by __fmul_rn / __fadd_rn. */
__device__ __forceinline__ void quantize_key_row_warp(float (&x)[8], int lane, int dp,
                                                      uint8_t *codes, uint8_t *scales,
                                                      uint8_t *exp) {
  const int n = dp & -dp;
#pragma unroll
  for (int h = 1; h < 8; h <<= 1)
    if (h < n)
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (!(i & h)) {
          const float a = x[i], b = x[i + h];
          x[i] = __fadd_rn(a, b);
          x[i + h] = __fsub_rn(a, b);
        }
  for (int h = 8; h < n; h <<= 1) {
    const int m = h / 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float o = __shfl_xor_sync(0xffffffffu, x[i], m);
      x[i] = (lane & m) ? __fsub_rn(o, x[i]) : __fadd_rn(x[i], o);
    }
  }
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fp4attn_nanmax(amax, fabsf(x[i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    amax = fp4attn_nanmax(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const bool finite = fp4attn_isfinite(amax);
  const int e = finite ? fp4attn_k5_exponent(amax) : 0;
  const float rinv = fp4attn_k5_inverse_scale(e);
  float bmax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[i] = finite ? __fmul_rn(x[i], rinv) : 0.0f;
    bmax = fmaxf(bmax, fabsf(x[i]));
  }
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) bmax = fmaxf(bmax, __shfl_xor_sync(0xffffffffu, bmax, o));
  /* the scale search, 7 steps in every lane (shuffles need the whole warp): the first code of
   * the smallest error among max(c0 - 3, 1) .. min(c0 + 3, 126) */
  const int c0 = fp4attn_e4m3_encode_sat(bmax / 15.0f);
  float best_err = INFINITY;
  int best = 0;
#pragma unroll 1
  for (int off = -3; off <= 3; ++off) {
    const int c = c0 + off;
    const bool valid = c >= 1 && c <= 0x7E && bmax > 0.0f;
    const float sv = fp4attn_e4m3_decode((uint8_t)(valid ? c : 1));
    float p = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float q = (float)((int)fp4attn_k5_code(x[i], sv) - 15);
      const float d = __fsub_rn(x[i], __fmul_rn(q, sv));
      const float d2 = __fmul_rn(d, d);
      p = i == 0 ? d2 : __fadd_rn(p, d2);
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) p = __fadd_rn(p, __shfl_xor_sync(0xffffffffu, p, o));
    if (valid && p < best_err) best_err = p, best = c;
  }
  if (8 * lane >= dp) return;
  const float sv = fp4attn_e4m3_decode((uint8_t)best);
  uint32_t u[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) u[i] = best ? fp4attn_k5_code(x[i], sv) : 15u;
  /* rows are 5 Dp/8 bytes (a multiple of 2): 16-bit stores */
  uint16_t *low = reinterpret_cast<uint16_t *>(codes + 4 * lane);
  low[0] = (uint16_t)((u[0] & 15) | (u[1] & 15) << 4 | (u[2] & 15) << 8 | (u[3] & 15) << 12);
  low[1] = (uint16_t)((u[4] & 15) | (u[5] & 15) << 4 | (u[6] & 15) << 8 | (u[7] & 15) << 12);
  uint32_t plane = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) plane |= (u[i] >> 4) << i;
  codes[dp / 2 + lane] = (uint8_t)plane;
  if ((lane & 7) == 0) scales[lane / 8] = (uint8_t)best;
  if (lane == 0) *exp = finite ? (uint8_t)(e + 127) : (uint8_t)255;
}

__global__ void __launch_bounds__(kThreads) kv_append_kernel(const fp4attn_kv_append_params p) {
  const fp4attn_kv_cache &c = p.cache;
  const int lane = threadIdx.x & 31;
  const int64_t row = (int64_t)blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
  if (row >= c.batch * c.heads_kv * p.len) return;
  const int64_t b = row / (c.heads_kv * p.len), h = (row / p.len) % c.heads_kv, n = row % p.len;
  const int64_t pos = p.start + n;
  const int64_t page = c.block_table[b * c.max_pages + pos / c.page_size];
  /* a block-table entry outside the pool: a device-side error, as the CPU backend raises one
   * (FP4KVCache builds valid tables; a direct op call may not) */
  if (page < 0 || page >= c.num_pages) __trap();
  const int64_t r = (page * c.heads_kv + h) * c.page_size + pos % c.page_size;
  const int D = (int)c.head_dim, nb = (D + 15) / 16;
  const int64_t cb = fp4_code_bytes(D), sc = fp4_scale_count(D);
  const int64_t kcb = 10 * nb, ksc = (16 * nb + 63) / 64; /* fp4attn_k5_code_bytes / scale_count */
  const float *kmean = c.kmean + (b * c.heads_kv + h) * D;
  const float *kscale = c.kscale + (b * c.heads_kv + h) * D;
  const int64_t kb = b * p.k_stride[0] + h * p.k_stride[1] + n * p.k_stride[2];
  float kx[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int d = 8 * lane + i;
    kx[i] = d < D ? __fdiv_rn(__fsub_rn(load_as_float(p.k, p.dtype, kb + d), kmean[d]), kscale[d])
                  : 0.0f;
  }
  quantize_key_row_warp(kx, lane, 16 * nb, c.k_codes + r * kcb, c.k_scales + r * ksc, c.k_exp + r);
  float x[16];
  const int64_t vb = b * p.v_stride[0] + h * p.v_stride[1] + n * p.v_stride[2];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int d = 16 * lane + i;
    x[i] = lane < nb && d < D ? load_as_float(p.v, p.dtype, vb + d) : 0.0f;
  }
  quantize_row_warp(x, lane, nb, c.v_codes + r * cb, c.v_scales + r * sc, c.v_dec + r);
}

}  // namespace

fp4attn_status launch_kv_append(const fp4attn_kv_append_params &p, cudaStream_t s) {
  const int64_t rows = p.cache.batch * p.cache.heads_kv * p.len;
  const int64_t blocks = ceil_div(rows, kThreads / 32);
  if (blocks > 0x7FFFFFFFLL || p.cache.batch * p.cache.heads_kv > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "kv append: too many rows");
  if (p.set_mean)
    kv_mean_kernel<<<(unsigned)(p.cache.batch * p.cache.heads_kv), kThreads, 0, s>>>(p);
  kv_append_kernel<<<(unsigned)blocks, kThreads, 0, s>>>(p);
  return launch_status("kv append");
}

}  // namespace fp4attn_cuda
