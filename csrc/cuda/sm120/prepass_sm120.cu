/*
 * Quantization pre-pass of the sm_120a FP4 attention (SPEC 4.1-4.3), writing the kernel-private
 * layouts described in sm120_common.cuh.
 *
 *   1. kmean_partial   partial K sums over 256-token chunks (fixed order: deterministic), and
 *                      amax |V| per (batch, KV head)
 *   2. kmean_final     kbar = sum of partials / Nk
 *   3. qmean           qbar per 128-row query block
 *   4. amax_qk         amax |Q - qbar| per (batch, q head) and |K - kbar| per (batch, KV head)
 *   5. quant_q         Q^ = phi(Q - qbar) (+ the per-row LSE shift (q - qbar) . kbar)
 *   6. quant_k         K^ = phi(K - kbar), token-permuted, fragment order
 *   7. quant_v         V^ = phi(V^T) along tokens, fragment order
 *
 * Maxima are taken over the float bits of |x| (monotone for non-negative floats, NaN above Inf),
 * so atomics make them order-independent and NaN-propagating like fp4attn_nanmax. Block
 * quantization is numerics.h's fp4attn_quantize_block: bit-exact with every other backend given
 * the same FP32 inputs (the means are FP32 sums in an order of our own).
 */
#include "sm120_common.cuh"

namespace fp4attn_sm120 {
namespace {

__device__ __forceinline__ uint32_t abs_bits(float x) {
  return fp4attn_float_bits(x) & 0x7FFFFFFFu;
}

__device__ __forceinline__ uint32_t block_umax(uint32_t v, uint32_t *red /* [32] */) {
  v = __reduce_max_sync(0xffffffffu, v);
  const int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if ((threadIdx.x & 31) == 0) red[w] = v;
  __syncthreads();
  uint32_t m = 0;
  for (int i = 0; i < nw; ++i) m = red[i] > m ? red[i] : m;
  __syncthreads();
  return m;
}

struct PrepassArgs {
  const void *q, *k, *v;
  int64_t q_stride[3], k_stride[3], v_stride[3];
  int64_t B, Hq, Hkv, G, Nq, Nk, D, Dp, nqb, nq_pad, nkt, nk_pad, nchunks;
  uint8_t *qc, *qs, *kc, *ks, *vc, *vs;
  float *qbar, *lse_shift, *kbar, *kpart, *dec_q, *dec_k, *dec_v;
  uint32_t *amax_q, *amax_k, *amax_v;
};

/* 1. grid (nchunks, B*Hkv), 256 threads: Dp channels x (256/Dp) token lanes */
template <int DT>
__global__ void __launch_bounds__(256) kmean_partial(PrepassArgs a) {
  __shared__ float red[256];
  __shared__ uint32_t ured[32];
  const int64_t bh = blockIdx.y, b = bh / a.Hkv, h = bh % a.Hkv;
  const int Dp = (int)a.Dp, lanes = 256 / Dp;
  const int c = threadIdx.x % Dp, r = threadIdx.x / Dp;
  const int64_t t0 = (int64_t)blockIdx.x * kMeanChunk;
  const int64_t t1 = t0 + kMeanChunk < a.Nk ? t0 + kMeanChunk : a.Nk;
  const int64_t kb = b * a.k_stride[0] + h * a.k_stride[1];
  const int64_t vb = b * a.v_stride[0] + h * a.v_stride[1];
  float sum = 0.0f;
  uint32_t vmax = 0;
  if (c < a.D) {
    for (int64_t t = t0 + r; t < t1; t += lanes) {
      sum += load_f32<DT>(a.k, kb + t * a.k_stride[2] + c);
      uint32_t u = abs_bits(load_f32<DT>(a.v, vb + t * a.v_stride[2] + c));
      vmax = u > vmax ? u : vmax;
    }
  }
  red[threadIdx.x] = sum;
  vmax = block_umax(vmax, ured); /* contains __syncthreads */
  if (r == 0) {
    float s = 0.0f;
    for (int i = 0; i < lanes; ++i) s += red[i * Dp + c];
    a.kpart[(bh * a.nchunks + blockIdx.x) * Dp + c] = s;
  }
  if (threadIdx.x == 0) atomicMax(a.amax_v + bh, vmax);
}

/* 2. grid B*Hkv, Dp threads */
__global__ void kmean_final(PrepassArgs a) {
  const int64_t bh = blockIdx.x;
  const int c = threadIdx.x;
  float s = 0.0f;
  for (int64_t i = 0; i < a.nchunks; ++i) s += a.kpart[(bh * a.nchunks + i) * a.Dp + c];
  a.kbar[bh * a.Dp + c] = c < a.D ? s / (float)a.Nk : 0.0f;
}

/* 3. grid (nqb, B*Hq), 256 threads */
template <int DT>
__global__ void __launch_bounds__(256) qmean(PrepassArgs a) {
  __shared__ float red[256];
  const int64_t bh = blockIdx.y, b = bh / a.Hq, h = bh % a.Hq, qb = blockIdx.x;
  const int Dp = (int)a.Dp, lanes = 256 / Dp;
  const int c = threadIdx.x % Dp, r = threadIdx.x / Dp;
  const int64_t t0 = qb * kBlockQ;
  const int64_t t1 = t0 + kBlockQ < a.Nq ? t0 + kBlockQ : a.Nq;
  const int64_t qbase = b * a.q_stride[0] + h * a.q_stride[1];
  float sum = 0.0f;
  if (c < a.D)
    for (int64_t t = t0 + r; t < t1; t += lanes)
      sum += load_f32<DT>(a.q, qbase + t * a.q_stride[2] + c);
  red[threadIdx.x] = sum;
  __syncthreads();
  if (r == 0) {
    float s = 0.0f;
    for (int i = 0; i < lanes; ++i) s += red[i * Dp + c];
    a.qbar[(bh * a.nqb + qb) * Dp + c] = c < a.D ? s / (float)(t1 - t0) : 0.0f;
  }
}

/* 4. grid (row chunks of 64, B*Hq + B*Hkv), 256 threads */
template <int DT>
__global__ void __launch_bounds__(256) amax_qk(PrepassArgs a) {
  __shared__ uint32_t ured[32];
  const int64_t y = blockIdx.y;
  const bool is_q = y < a.B * a.Hq;
  const int64_t bh = is_q ? y : y - a.B * a.Hq;
  const int64_t H = is_q ? a.Hq : a.Hkv, N = is_q ? a.Nq : a.Nk;
  const int64_t b = bh / H, h = bh % H;
  const int64_t *st = is_q ? a.q_stride : a.k_stride;
  const void *x = is_q ? a.q : a.k;
  const int64_t r0 = (int64_t)blockIdx.x * 64;
  if (r0 >= N) return; /* uniform per block */
  const int64_t nr = N - r0 < 64 ? N - r0 : 64;
  const int64_t base = b * st[0] + h * st[1];
  uint32_t m = 0;
  for (int64_t i = threadIdx.x; i < nr * a.D; i += 256) {
    const int64_t r = r0 + i / a.D, c = i % a.D;
    const float mean = is_q ? a.qbar[(bh * a.nqb + r / kBlockQ) * a.Dp + c] : a.kbar[bh * a.Dp + c];
    const uint32_t u = abs_bits(load_f32<DT>(x, base + r * st[2] + c) - mean);
    m = u > m ? u : m;
  }
  m = block_umax(m, ured);
  if (threadIdx.x == 0) atomicMax((is_q ? a.amax_q : a.amax_k) + bh, m);
}

/* Pack 8 unpacked codes (codes[0] in the low nibble) into a word. */
__device__ __forceinline__ uint32_t pack8(const uint8_t *codes) {
  uint32_t w = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) w |= (uint32_t)codes[i] << (4 * i);
  return w;
}

/* 5. grid (nq_pad * nb / 256, B*Hq), thread = (row, 16-channel block) */
template <int DT>
__global__ void __launch_bounds__(256) quant_q(PrepassArgs a) {
  const int nb = (int)(a.Dp / 16);
  const int64_t bh = blockIdx.y, b = bh / a.Hq, h = bh % a.Hq, bkv = b * a.Hkv + h / a.G;
  const int64_t row = (int64_t)blockIdx.x * (256 / nb) + threadIdx.x / nb;
  const int blk = threadIdx.x % nb;
  float enc, dec;
  fp4attn_global_scales(fp4attn_bits_float(a.amax_q[bh]), &enc, &dec);
  if (blockIdx.x == 0 && threadIdx.x == 0) a.dec_q[bh] = dec;
  float xs[16];
  float shift = 0.0f;
  const int64_t qbase = b * a.q_stride[0] + h * a.q_stride[1] + row * a.q_stride[2];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int c = blk * 16 + i;
    xs[i] = 0.0f;
    if (row < a.Nq && c < a.D) {
      const float qsv =
          load_f32<DT>(a.q, qbase + c) - a.qbar[(bh * a.nqb + row / kBlockQ) * a.Dp + c];
      xs[i] = qsv * enc;
      shift = __fadd_rn(shift, __fmul_rn(qsv, a.kbar[bkv * a.Dp + c]));
    }
  }
  for (int o = 1; o < nb; o <<= 1) shift += __shfl_xor_sync(0xffffffffu, shift, o);
  uint8_t codes[16];
  const uint8_t s = fp4attn_quantize_block(xs, 16, codes);
  uint32_t *dst = reinterpret_cast<uint32_t *>(a.qc + (bh * a.nq_pad + row) * (a.Dp / 2) + 8 * blk);
  dst[0] = pack8(codes);
  dst[1] = pack8(codes + 8);
  a.qs[(bh * a.nq_pad + row) * nb + blk] = s;
  if (blk == 0 && row < a.Nq) a.lse_shift[bh * a.Nq + row] = shift;
}

/* 6. grid (nk_pad * nb / 256, B*Hkv), thread = (token, 16-channel block) */
template <int DT>
__global__ void __launch_bounds__(256) quant_k(PrepassArgs a) {
  const int nb = (int)(a.Dp / 16), nks = (int)(a.Dp / 64);
  const int64_t bh = blockIdx.y, b = bh / a.Hkv, h = bh % a.Hkv;
  const int64_t tok = (int64_t)blockIdx.x * (256 / nb) + threadIdx.x / nb;
  const int blk = threadIdx.x % nb;
  float enc, dec;
  fp4attn_global_scales(fp4attn_bits_float(a.amax_k[bh]), &enc, &dec);
  if (blockIdx.x == 0 && threadIdx.x == 0) a.dec_k[bh] = dec;
  float xs[16];
  const int64_t kbase = b * a.k_stride[0] + h * a.k_stride[1] + tok * a.k_stride[2];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int c = blk * 16 + i;
    xs[i] = (tok < a.Nk && c < a.D) ? (load_f32<DT>(a.k, kbase + c) - a.kbar[bh * a.Dp + c]) * enc
                                    : 0.0f;
  }
  uint8_t codes[16];
  const uint8_t s = fp4attn_quantize_block(xs, 16, codes);
  const int64_t tile = tok / kBlockKV;
  const int pos = key_perm((int)(tok % kBlockKV)); /* token l sits at position perm(l) */
  const int nt = pos >> 3, g = pos & 7;
  uint32_t *frag =
      reinterpret_cast<uint32_t *>(a.kc) + ((bh * a.nkt + tile) * 16 + nt) * 32 * (2 * nks);
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const int wr = 2 * blk + w; /* word of the row: bytes [4wr, 4wr+4) */
    const int ks = wr >> 3, half = (wr >> 2) & 1, t = wr & 3;
    frag[(g * 4 + t) * (2 * nks) + ks * 2 + half] = pack8(codes + 8 * w);
  }
  a.ks[((bh * a.nkt + tile) * kBlockKV + pos) * nb + blk] = s;
}

/* 7. grid (ceil(nk_pad/16 / (256/Dp)), B*Hkv), thread = (channel, 16-token block) */
template <int DT>
__global__ void __launch_bounds__(256) quant_v(PrepassArgs a) {
  const int Dp = (int)a.Dp;
  const int64_t bh = blockIdx.y, b = bh / a.Hkv, h = bh % a.Hkv;
  const int ch = threadIdx.x % Dp;
  const int64_t tb = (int64_t)blockIdx.x * (256 / Dp) + threadIdx.x / Dp;
  if (tb >= a.nk_pad / 16) return;
  float enc, dec;
  fp4attn_global_scales(fp4attn_bits_float(a.amax_v[bh]), &enc, &dec);
  if (blockIdx.x == 0 && threadIdx.x == 0) a.dec_v[bh] = dec;
  float xs[16];
  const int64_t vbase = b * a.v_stride[0] + h * a.v_stride[1] + ch;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int64_t tok = tb * 16 + i;
    xs[i] = (tok < a.Nk && ch < a.D) ? load_f32<DT>(a.v, vbase + tok * a.v_stride[2]) * enc : 0.0f;
  }
  uint8_t codes[16];
  const uint8_t s = fp4attn_quantize_block(xs, 16, codes);
  const int64_t tile = tb / 8;
  const int lb = (int)(tb % 8);
  const int ntv = ch >> 3, g = ch & 7;
  uint32_t *frag =
      reinterpret_cast<uint32_t *>(a.vc) + ((bh * a.nkt + tile) * (Dp / 8) + ntv) * 32 * 4;
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const int wr = 2 * lb + w;
    const int ks = wr >> 3, half = (wr >> 2) & 1, t = wr & 3;
    frag[(g * 4 + t) * 4 + ks * 2 + half] = pack8(codes + 8 * w);
  }
  a.vs[((bh * a.nkt + tile) * Dp + ch) * 8 + lb] = s;
}

template <int DT>
cudaError_t run_prepass_typed(const PrepassArgs &a, cudaStream_t st) {
  const int64_t bq = a.B * a.Hq, bkv = a.B * a.Hkv;
  const int nb = (int)(a.Dp / 16);
  kmean_partial<DT><<<dim3((unsigned)a.nchunks, (unsigned)bkv), 256, 0, st>>>(a);
  kmean_final<<<(unsigned)bkv, (unsigned)a.Dp, 0, st>>>(a);
  qmean<DT><<<dim3((unsigned)a.nqb, (unsigned)bq), 256, 0, st>>>(a);
  const int64_t nmax = a.Nq > a.Nk ? a.Nq : a.Nk;
  amax_qk<DT><<<dim3((unsigned)((nmax + 63) / 64), (unsigned)(bq + bkv)), 256, 0, st>>>(a);
  quant_q<DT><<<dim3((unsigned)(a.nq_pad * nb / 256), (unsigned)bq), 256, 0, st>>>(a);
  quant_k<DT><<<dim3((unsigned)(a.nk_pad * nb / 256), (unsigned)bkv), 256, 0, st>>>(a);
  const int64_t tbs = a.nk_pad / 16, per = 256 / a.Dp;
  quant_v<DT><<<dim3((unsigned)((tbs + per - 1) / per), (unsigned)bkv), 256, 0, st>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t run_prepass_sm120(const fp4attn_attention_params *p, const Layout &L, uint8_t *ws,
                              cudaStream_t stream) {
  PrepassArgs a;
  a.q = p->q;
  a.k = p->k;
  a.v = p->v;
  for (int i = 0; i < 3; ++i) {
    a.q_stride[i] = p->q_stride[i];
    a.k_stride[i] = p->k_stride[i];
    a.v_stride[i] = p->v_stride[i];
  }
  a.B = L.B;
  a.Hq = L.Hq;
  a.Hkv = L.Hkv;
  a.G = L.G;
  a.Nq = L.Nq;
  a.Nk = L.Nk;
  a.D = L.D;
  a.Dp = L.Dp;
  a.nqb = L.nqb;
  a.nq_pad = L.nq_pad;
  a.nkt = L.nkt;
  a.nk_pad = L.nk_pad;
  a.nchunks = L.nchunks;
  a.qc = ws + L.qc;
  a.qs = ws + L.qs;
  a.kc = ws + L.kc;
  a.ks = ws + L.ks;
  a.vc = ws + L.vc;
  a.vs = ws + L.vs;
  a.qbar = reinterpret_cast<float *>(ws + L.qbar);
  a.lse_shift = reinterpret_cast<float *>(ws + L.lse_shift);
  a.kbar = reinterpret_cast<float *>(ws + L.kbar);
  a.kpart = reinterpret_cast<float *>(ws + L.kpart);
  const int64_t bq = L.B * L.Hq, bkv = L.B * L.Hkv;
  a.amax_q = reinterpret_cast<uint32_t *>(ws + L.amax);
  a.amax_k = a.amax_q + bq;
  a.amax_v = a.amax_k + bkv;
  a.dec_q = reinterpret_cast<float *>(ws + L.dec);
  a.dec_k = a.dec_q + bq;
  a.dec_v = a.dec_k + bkv;
  cudaError_t e = cudaMemsetAsync(a.amax_q, 0, (size_t)(bq + 2 * bkv) * 4, stream);
  if (e != cudaSuccess) return e;
  switch (p->dtype) {
    case FP4ATTN_FLOAT16:
      return run_prepass_typed<FP4ATTN_FLOAT16>(a, stream);
    case FP4ATTN_BFLOAT16:
      return run_prepass_typed<FP4ATTN_BFLOAT16>(a, stream);
    default:
      return run_prepass_typed<FP4ATTN_FLOAT32>(a, stream);
  }
}

}  // namespace fp4attn_sm120
