/*
 * Operand writer of the sm_120a FP4 attention: Q^, K^ and V^ in the kernel's fragment layouts
 * (sm120_common.cuh) from the shared pre-pass's means and global scales (prepass/), so that kbar,
 * vbar and the scales are bit-identical to every other CUDA kernel's.
 *
 *   quant_q  Q^ = phi(Q - qbar), and the per-row LSE shift (q - qbar) . kbar
 *   quant_k  K^ = phi(K - kbar), token-permuted, fragment order
 *   quant_v  V^ = phi((V - vbar)^T) along tokens, fragment order
 *
 * Block quantization is numerics.h's fp4attn_quantize_block: bit-exact with every other backend
 * given the same FP32 inputs.
 */
#include "../tile/workspace.cuh"
#include "sm120_common.cuh"

namespace fp4attn_sm120 {
namespace {

using fp4attn_cuda::kKDec;
using fp4attn_cuda::kKEnc;
using fp4attn_cuda::kKvScales;
using fp4attn_cuda::kQDec;
using fp4attn_cuda::kQEnc;
using fp4attn_cuda::kQScales;
using fp4attn_cuda::kVDec;
using fp4attn_cuda::kVEnc;

struct WriterArgs {
  WriterInputs in;
  Layout L; /* sizes (the byte offsets are applied to the pointers below) */
  uint8_t *qc, *qs, *kc, *ks, *vc, *vs;
  float *lse_shift, *dec_q, *dec_k, *dec_v;
};

/* Pack 8 unpacked codes (codes[0] in the low nibble) into a word. */
__device__ __forceinline__ uint32_t pack8(const uint8_t *codes) {
  uint32_t w = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) w |= (uint32_t)codes[i] << (4 * i);
  return w;
}

/* grid (nq_pad * nb / 256, B*Hq), thread = (row, 16-channel block) */
template <int DT>
__global__ void __launch_bounds__(256) quant_q(WriterArgs a) {
  const int nb = (int)(a.L.Dp / 16);
  const int64_t bh = blockIdx.y, b = bh / a.L.Hq, h = bh % a.L.Hq, bkv = b * a.L.Hkv + h / a.L.G;
  const int64_t row = (int64_t)blockIdx.x * (256 / nb) + threadIdx.x / nb;
  const int blk = threadIdx.x % nb;
  const float enc = a.in.qscale[bh * kQScales + kQEnc];
  if (blockIdx.x == 0 && threadIdx.x == 0) a.dec_q[bh] = a.in.qscale[bh * kQScales + kQDec];
  float xs[16];
  float shift = 0.0f;
  const int64_t qbase = b * a.in.q_stride[0] + h * a.in.q_stride[1] + row * a.in.q_stride[2];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int c = blk * 16 + i;
    xs[i] = 0.0f;
    if (row < a.L.Nq && c < a.L.D) {
      const float qsv = load_as_float(a.in.q, (fp4attn_dtype)DT, qbase + c) -
                        a.in.qbar[(bh * a.L.nqb + row / kBlockQ) * a.L.Dp + c];
      xs[i] = qsv * enc;
      shift = __fadd_rn(shift, __fmul_rn(qsv, a.in.kbar[bkv * a.L.Dp + c]));
    }
  }
  for (int o = 1; o < nb; o <<= 1) shift += __shfl_xor_sync(0xffffffffu, shift, o);
  uint8_t codes[16];
  const uint8_t s = fp4attn_quantize_block(xs, 16, codes);
  uint32_t *dst =
      reinterpret_cast<uint32_t *>(a.qc + (bh * a.L.nq_pad + row) * (a.L.Dp / 2) + 8 * blk);
  dst[0] = pack8(codes);
  dst[1] = pack8(codes + 8);
  a.qs[(bh * a.L.nq_pad + row) * nb + blk] = s;
  if (blk == 0 && row < a.L.Nq) a.lse_shift[bh * a.L.Nq + row] = shift;
}

/* grid (nk_pad * nb / 256, B*Hkv), thread = (token, 16-channel block) */
template <int DT>
__global__ void __launch_bounds__(256) quant_k(WriterArgs a) {
  const int nb = (int)(a.L.Dp / 16), nks = (int)(a.L.Dp / 64);
  const int64_t bh = blockIdx.y, b = bh / a.L.Hkv, h = bh % a.L.Hkv;
  const int64_t tok = (int64_t)blockIdx.x * (256 / nb) + threadIdx.x / nb;
  const int blk = threadIdx.x % nb;
  const float enc = a.in.kvscale[bh * kKvScales + kKEnc];
  if (blockIdx.x == 0 && threadIdx.x == 0) a.dec_k[bh] = a.in.kvscale[bh * kKvScales + kKDec];
  float xs[16];
  const int64_t kbase = b * a.in.k_stride[0] + h * a.in.k_stride[1] + tok * a.in.k_stride[2];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int c = blk * 16 + i;
    xs[i] =
        (tok < a.L.Nk && c < a.L.D)
            ? (load_as_float(a.in.k, (fp4attn_dtype)DT, kbase + c) - a.in.kbar[bh * a.L.Dp + c]) *
                  enc
            : 0.0f;
  }
  uint8_t codes[16];
  const uint8_t s = fp4attn_quantize_block(xs, 16, codes);
  const int64_t tile = tok / kBlockKV;
  const int pos = key_perm((int)(tok % kBlockKV)); /* token l sits at position perm(l) */
  const int nt = pos >> 3, g = pos & 7;
  uint32_t *frag =
      reinterpret_cast<uint32_t *>(a.kc) + ((bh * a.L.nkt + tile) * 16 + nt) * 32 * (2 * nks);
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const int wr = 2 * blk + w; /* word of the row: bytes [4wr, 4wr+4) */
    const int ks = wr >> 3, half = (wr >> 2) & 1, t = wr & 3;
    frag[(g * 4 + t) * (2 * nks) + ks * 2 + half] = pack8(codes + 8 * w);
  }
  a.ks[((bh * a.L.nkt + tile) * kBlockKV + pos) * nb + blk] = s;
}

/* grid (ceil(nk_pad/16 / (256/Dp)), B*Hkv), thread = (channel, 16-token block) */
template <int DT>
__global__ void __launch_bounds__(256) quant_v(WriterArgs a) {
  const int Dp = (int)a.L.Dp;
  const int64_t bh = blockIdx.y, b = bh / a.L.Hkv, h = bh % a.L.Hkv;
  const int ch = threadIdx.x % Dp;
  const int64_t tb = (int64_t)blockIdx.x * (256 / Dp) + threadIdx.x / Dp;
  if (tb >= a.L.nk_pad / 16) return;
  const float enc = a.in.kvscale[bh * kKvScales + kVEnc];
  if (blockIdx.x == 0 && threadIdx.x == 0) a.dec_v[bh] = a.in.kvscale[bh * kKvScales + kVDec];
  const float vb = a.in.vbar[bh * Dp + ch];
  float xs[16];
  const int64_t vbase = b * a.in.v_stride[0] + h * a.in.v_stride[1] + ch;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int64_t tok = tb * 16 + i;
    xs[i] =
        (tok < a.L.Nk && ch < a.L.D)
            ? __fmul_rn(
                  __fsub_rn(
                      load_as_float(a.in.v, (fp4attn_dtype)DT, vbase + tok * a.in.v_stride[2]), vb),
                  enc)
            : 0.0f;
  }
  uint8_t codes[16];
  const uint8_t s = fp4attn_quantize_block(xs, 16, codes);
  const int64_t tile = tb / 8;
  const int lb = (int)(tb % 8);
  const int ntv = ch >> 3, g = ch & 7;
  uint32_t *frag =
      reinterpret_cast<uint32_t *>(a.vc) + ((bh * a.L.nkt + tile) * (Dp / 8) + ntv) * 32 * 4;
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const int wr = 2 * lb + w;
    const int ks = wr >> 3, half = (wr >> 2) & 1, t = wr & 3;
    frag[(g * 4 + t) * 4 + ks * 2 + half] = pack8(codes + 8 * w);
  }
  a.vs[((bh * a.L.nkt + tile) * Dp + ch) * 8 + lb] = s;
}

template <int DT>
cudaError_t write_typed(const WriterArgs &a, cudaStream_t st) {
  const int64_t bq = a.L.B * a.L.Hq, bkv = a.L.B * a.L.Hkv;
  const int nb = (int)(a.L.Dp / 16);
  quant_q<DT><<<dim3((unsigned)(a.L.nq_pad * nb / 256), (unsigned)bq), 256, 0, st>>>(a);
  quant_k<DT><<<dim3((unsigned)(a.L.nk_pad * nb / 256), (unsigned)bkv), 256, 0, st>>>(a);
  const int64_t tbs = a.L.nk_pad / 16, per = 256 / a.L.Dp;
  quant_v<DT><<<dim3((unsigned)((tbs + per - 1) / per), (unsigned)bkv), 256, 0, st>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t write_operands_sm120(const WriterInputs &in, const Layout &L, uint8_t *ws,
                                 cudaStream_t stream) {
  WriterArgs a;
  a.in = in;
  a.L = L;
  a.qc = ws + L.qc;
  a.qs = ws + L.qs;
  a.kc = ws + L.kc;
  a.ks = ws + L.ks;
  a.vc = ws + L.vc;
  a.vs = ws + L.vs;
  a.lse_shift = reinterpret_cast<float *>(ws + L.lse_shift);
  a.dec_q = reinterpret_cast<float *>(ws + L.dec);
  a.dec_k = a.dec_q + L.B * L.Hq;
  a.dec_v = a.dec_k + L.B * L.Hkv;
  switch (in.dtype) {
    case FP4ATTN_FLOAT16:
      return write_typed<FP4ATTN_FLOAT16>(a, stream);
    case FP4ATTN_BFLOAT16:
      return write_typed<FP4ATTN_BFLOAT16>(a, stream);
    default:
      return write_typed<FP4ATTN_FLOAT32>(a, stream);
  }
}

}  // namespace fp4attn_sm120
