/*
 * NVFP4 quantization phi (SPEC 2) and its inverse for the public API, linear layout.
 *
 * quantize, three launches on the caller's stream:
 *   1. amax per slice: a grid-stride pass, one warp per row, |x| maxima combined with an
 *      unsigned atomicMax on the float bits (NaN wins, like fp4attn_nanmax) into dec[b], which
 *      serves as scratch (zeroed with cudaMemsetAsync first);
 *   2. one thread per 16-value block: enc from the slice amax (fp4attn_global_scales), codes and
 *      the E4M3 scale through fp4attn_quantize_block, so the bytes equal the CPU backend's;
 *   3. dec[b] = the slice's dequantization scale (overwrites the scratch amax).
 * dequantize: one thread per packed byte (two values). No host synchronisation anywhere.
 */
#include "../common/device.cuh"

using namespace fp4attn_cuda;

namespace {

__global__ void quantize_amax_kernel(fp4attn_quantize_params p) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  const int64_t total_rows = p.batch * p.rows;
  for (int64_t br = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; br < total_rows;
       br += warps) {
    const int64_t b = br / p.rows, r = br % p.rows;
    const int64_t base = b * p.x_batch_stride + r * p.x_row_stride;
    float m = 0.0f;
    for (int64_t c = lane; c < p.cols; c += 32) {
      const float v = load_as_float(p.x, p.dtype, base + c);
      m = fp4attn_nanmax(m, fabsf(v));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fp4attn_nanmax(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) atomic_amax(p.dec + b, m);
  }
}

__global__ void quantize_blocks_kernel(fp4attn_quantize_params p) {
  const int64_t nblk = fp4_scale_count(p.cols);
  const int64_t code_bytes = fp4_code_bytes(p.cols);
  const int64_t total = p.batch * p.rows * nblk;
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t kb = idx % nblk, br = idx / nblk;
    const int64_t b = br / p.rows, r = br % p.rows;
    float enc, dec;
    fp4attn_global_scales(p.dec[b], &enc, &dec);
    const int64_t base = b * p.x_batch_stride + r * p.x_row_stride;
    float xs[16];
    uint8_t q[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int64_t c = kb * 16 + i;
      xs[i] = c < p.cols ? __fmul_rn(load_as_float(p.x, p.dtype, base + c), enc) : 0.0f;
    }
    const uint8_t s = fp4attn_quantize_block(xs, 16, q);
    uint32_t w0 = 0, w1 = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w0 |= (uint32_t)(q[2 * i] | (q[2 * i + 1] << 4)) << (8 * i);
      w1 |= (uint32_t)(q[8 + 2 * i] | (q[8 + 2 * i + 1] << 4)) << (8 * i);
    }
    uint8_t *dst = p.codes + br * code_bytes + kb * 8;
    /* code rows are multiples of 8 bytes and the buffer comes from an allocator: 8-aligned */
    *reinterpret_cast<uint2 *>(dst) = make_uint2(w0, w1);
    p.scales[br * nblk + kb] = s;
  }
}

__global__ void quantize_finish_kernel(fp4attn_quantize_params p) {
  const int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (b < p.batch) {
    float enc, dec;
    fp4attn_global_scales(p.dec[b], &enc, &dec);
    p.dec[b] = dec;
  }
}

__global__ void dequantize_kernel(fp4attn_dequantize_params p) {
  const int64_t pairs_per_row = (p.cols + 1) / 2;
  const int64_t code_bytes = fp4_code_bytes(p.cols), nblk = fp4_scale_count(p.cols);
  const int64_t total = p.batch * p.rows * pairs_per_row;
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t pc = idx % pairs_per_row, br = idx / pairs_per_row;
    const float dec = p.dec[br / p.rows];
    const uint8_t byte = p.codes[br * code_bytes + pc];
    const float s = fp4attn_e4m3_decode(p.scales[br * nblk + (2 * pc) / 16]);
    const int64_t c = 2 * pc;
    float *out = p.out + br * p.cols;
    out[c] = __fmul_rn(__fmul_rn(fp4attn_e2m1_decode(byte & 0xF), s), dec);
    if (c + 1 < p.cols) out[c + 1] = __fmul_rn(__fmul_rn(fp4attn_e2m1_decode(byte >> 4), s), dec);
  }
}

int grid_for(int64_t work, int threads) {
  const int64_t blocks = ceil_div(work, threads);
  const int64_t cap = (int64_t)sm_count() * 16;
  return (int)(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

}  // namespace

extern "C" fp4attn_status fp4attn_cuda_quantize(const fp4attn_quantize_params *p, void *stream) {
  if (!p || !p->x || !p->codes || !p->scales || !p->dec)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "quantize: null pointer argument");
  if (p->dtype != FP4ATTN_FLOAT32 && p->dtype != FP4ATTN_FLOAT16 && p->dtype != FP4ATTN_BFLOAT16)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "quantize: unsupported dtype %d", (int)p->dtype);
  if (p->batch < 0 || p->rows < 0 || p->cols < 0)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "quantize: negative size");
  if (p->batch == 0) return fp4attn_ok();
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (cudaMemsetAsync(p->dec, 0, sizeof(float) * (size_t)p->batch, s) != cudaSuccess)
    return launch_status("quantize: memset");
  if (p->rows > 0 && p->cols > 0) {
    quantize_amax_kernel<<<grid_for(p->batch * p->rows * 32, 256), 256, 0, s>>>(*p);
    fp4attn_status st = launch_status("quantize: amax kernel");
    if (st.code != FP4ATTN_OK) return st;
    const int64_t blocks = p->batch * p->rows * fp4attn_scale_count(p->cols);
    quantize_blocks_kernel<<<grid_for(blocks, 256), 256, 0, s>>>(*p);
    st = launch_status("quantize: block kernel");
    if (st.code != FP4ATTN_OK) return st;
  }
  quantize_finish_kernel<<<(unsigned)ceil_div(p->batch, 256), 256, 0, s>>>(*p);
  return launch_status("quantize: finish kernel");
}

extern "C" fp4attn_status fp4attn_cuda_dequantize(const fp4attn_dequantize_params *p,
                                                  void *stream) {
  if (!p || !p->codes || !p->scales || !p->dec || !p->out)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "dequantize: null pointer argument");
  if (p->batch < 0 || p->rows < 0 || p->cols < 0)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "dequantize: negative size");
  const int64_t total = p->batch * p->rows * ((p->cols + 1) / 2);
  if (total == 0) return fp4attn_ok();
  dequantize_kernel<<<grid_for(total, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(*p);
  return launch_status("dequantize kernel");
}
