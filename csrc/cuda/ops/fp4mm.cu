/*
 * FP4MM (SPEC 3) on FP16 tensor cores: C[b] = (dA * dB) * A'[b] (M x K) times B'[b]^T (N x K).
 *
 * Tile 64 x 64 per block of 4 warps (2 x 2, each warp 32 x 32 = 2 x 4 mma.m16n8k16), K in steps
 * of 64 (four NVFP4 blocks). Each step dequantizes the A and B tiles exactly into FP16 shared
 * memory (value(code) * E4M3 scale has at most 6 significant bits, so FP16 holds it exactly),
 * then ldmatrix + mma.sync with FP32 accumulation. The FP32 global scales are applied only in
 * the epilogue. Operands use the public linear layout; padding rows/blocks read as zero.
 * Not a performance path (the attention kernel has its own pipeline); it is exact and simple.
 */
#include "../common/device.cuh"

using namespace fp4attn_cuda;

namespace {

constexpr int TM = 64, TN = 64, TK = 64, LDS = TK + 8; /* +8 halves: conflict-free ldmatrix */

__device__ void dequant_tile(__half *dst, const uint8_t *codes, const uint8_t *scales, int64_t rows,
                             int64_t r0, int64_t k0, int64_t code_bytes, int64_t nblk) {
  /* 64 rows x 4 blocks of 16 = 256 block jobs, 2 per thread */
  for (int job = threadIdx.x; job < TM * 4; job += blockDim.x) {
    const int r = job >> 2, kb = job & 3;
    const int64_t gr = r0 + r, gb = k0 / 16 + kb;
    __half *out = dst + r * LDS + kb * 16;
    if (gr < rows && gb < nblk) {
      const uint8_t *c = codes + gr * code_bytes + gb * 8;
      const float s = fp4attn_e4m3_decode(scales[gr * nblk + gb]);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint8_t byte = c[i];
        out[2 * i] = __float2half_rn(fp4attn_e2m1_decode(byte & 0xF) * s);
        out[2 * i + 1] = __float2half_rn(fp4attn_e2m1_decode(byte >> 4) * s);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) out[i] = __float2half_rn(0.0f);
    }
  }
}

__global__ void __launch_bounds__(128) fp4mm_kernel(fp4attn_fp4mm_params p) {
  __shared__ __align__(16) __half sa[TM * LDS];
  __shared__ __align__(16) __half sb[TN * LDS];
  const int64_t b = blockIdx.z;
  const int64_t m0 = (int64_t)blockIdx.y * TM, n0 = (int64_t)blockIdx.x * TN;
  const int64_t code_bytes = fp4_code_bytes(p.k), nblk = fp4_scale_count(p.k);
  const int64_t ia = b * p.a_batch_stride, ib = b * p.b_batch_stride;
  const uint8_t *ac = p.a_codes + ia * p.m * code_bytes, *as = p.a_scales + ia * p.m * nblk;
  const uint8_t *bc = p.b_codes + ib * p.n * code_bytes, *bs = p.b_scales + ib * p.n * nblk;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  float acc[2][4][4] = {};
  for (int64_t k0 = 0; k0 < nblk * 16; k0 += TK) {
    __syncthreads();
    dequant_tile(sa, ac, as, p.m, m0, k0, code_bytes, nblk);
    dequant_tile(sb, bc, bs, p.n, n0, k0, code_bytes, nblk);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < TK / 16; ++kk) {
      uint32_t a[2][4], bf[4][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int row = wm + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int col = kk * 16 + (lane >> 4) * 8;
        ldmatrix_x4(a[mi][0], a[mi][1], a[mi][2], a[mi][3], smem_u32(sa + row * LDS + col));
      }
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const int row = wn + np * 16 + (lane & 7) + (lane >> 4) * 8;
        const int col = kk * 16 + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(bf[2 * np][0], bf[2 * np][1], bf[2 * np + 1][0], bf[2 * np + 1][1],
                    smem_u32(sb + row * LDS + col));
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_16816(acc[mi][ni], a[mi], bf[ni][0], bf[ni][1]);
    }
  }
  const float dd = __fmul_rn(p.a_dec[ia], p.b_dec[ib]);
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t r = m0 + wm + mi * 16 + g + h * 8;
        const int64_t c = n0 + wn + ni * 8 + 2 * t;
        if (r >= p.m) continue;
        const int64_t o = (b * p.m + r) * p.n + c;
        const float v0 = __fmul_rn(dd, acc[mi][ni][2 * h]);
        const float v1 = __fmul_rn(dd, acc[mi][ni][2 * h + 1]);
        if (c < p.n) store_from_float(p.out, p.out_dtype, o, v0);
        if (c + 1 < p.n) store_from_float(p.out, p.out_dtype, o + 1, v1);
      }
}

}  // namespace

extern "C" fp4attn_status fp4attn_cuda_fp4mm(const fp4attn_fp4mm_params *p, void *stream) {
  if (!p || !p->a_codes || !p->a_scales || !p->a_dec || !p->b_codes || !p->b_scales || !p->b_dec ||
      !p->out)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "fp4mm: null pointer argument");
  if (p->out_dtype != FP4ATTN_FLOAT32 && p->out_dtype != FP4ATTN_FLOAT16 &&
      p->out_dtype != FP4ATTN_BFLOAT16)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "fp4mm: unsupported out_dtype");
  if (p->batch < 0 || p->m < 0 || p->n < 0 || p->k < 0)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "fp4mm: negative size");
  if (p->a_batch_stride < 0 || p->a_batch_stride > 1 || p->b_batch_stride < 0 ||
      p->b_batch_stride > 1)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "fp4mm: batch strides must be 0 or 1");
  if (p->batch == 0 || p->m == 0 || p->n == 0) return fp4attn_ok();
  if (p->batch > 65535 || ceil_div(p->m, TM) > 65535)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "fp4mm: batch (%lld) or m (%lld) too large",
                         (long long)p->batch, (long long)p->m);
  dim3 grid((unsigned)ceil_div(p->n, TN), (unsigned)ceil_div(p->m, TM), (unsigned)p->batch);
  fp4mm_kernel<<<grid, 128, 0, static_cast<cudaStream_t>(stream)>>>(*p);
  return launch_status("fp4mm kernel");
}
