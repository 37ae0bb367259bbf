/*
 * Appending to the FP4 KV cache (docs/SPEC.md section 6): one warp per token row quantizes its K
 * row (minus kmean) and its V row with the row as its own NVFP4 slice, lane i owning the 16-value
 * block i, and writes them into the row's page slot. On a first append a small kernel fixes kmean
 * first (sums in token order: bit-exact with the CPU backend).
 */
#include "../common/device.cuh"
#include "kv_cache.h"

namespace fp4attn_cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) kv_mean_kernel(const fp4attn_kv_append_params p) {
  const fp4attn_kv_cache &c = p.cache;
  const int64_t bh = blockIdx.x, b = bh / c.heads_kv, h = bh % c.heads_kv;
  for (int d = threadIdx.x; d < c.head_dim; d += kThreads) {
    float s = 0.0f;
    const int64_t base = b * p.k_stride[0] + h * p.k_stride[1] + d;
    for (int64_t n = 0; n < p.len; ++n) s += load_as_float(p.k, p.dtype, base + n * p.k_stride[2]);
    c.kmean[bh * c.head_dim + d] = s / (float)p.len;
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

__global__ void __launch_bounds__(kThreads) kv_append_kernel(const fp4attn_kv_append_params p) {
  const fp4attn_kv_cache &c = p.cache;
  const int lane = threadIdx.x & 31;
  const int64_t row = (int64_t)blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
  if (row >= c.batch * c.heads_kv * p.len) return;
  const int64_t b = row / (c.heads_kv * p.len), h = (row / p.len) % c.heads_kv, n = row % p.len;
  const int64_t pos = p.start + n;
  const int64_t page = c.block_table[b * c.max_pages + pos / c.page_size];
  if (page < 0 || page >= c.num_pages) return; /* the host checked the table it built */
  const int64_t r = (page * c.heads_kv + h) * c.page_size + pos % c.page_size;
  const int D = (int)c.head_dim, nb = (D + 15) / 16;
  const int64_t cb = fp4_code_bytes(D), sc = fp4_scale_count(D);
  const float *kmean = c.kmean + (b * c.heads_kv + h) * D;
  float x[16];
  const int64_t kb = b * p.k_stride[0] + h * p.k_stride[1] + n * p.k_stride[2];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int d = 16 * lane + i;
    x[i] = lane < nb && d < D ? load_as_float(p.k, p.dtype, kb + d) - kmean[d] : 0.0f;
  }
  quantize_row_warp(x, lane, nb, c.k_codes + r * cb, c.k_scales + r * sc, c.k_dec + r);
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
