/*
 * Quantization of a block's query rows (SPEC 4.2-4.3: Q - qbar, global scale, phi along D) into
 * the exact FP16 values the tensor cores consume.
 */
#ifndef FP4ATTN_CUDA_TILE_Q_QUANT_CUH
#define FP4ATTN_CUDA_TILE_Q_QUANT_CUH

#include "../common/fast_rounding.cuh"
#include "workspace.cuh"

namespace fp4attn_cuda {

/* Quantize query rows [q0, q0 + rows) of (b, h) (SPEC 4.2-4.3: Q - qbar, global scale, phi
 * along D) and store the exact FP16 values through store16(row, col, 8 words). Thread `tid` of
 * `nthreads` takes the 16-column blocks tid, tid + nthreads, ...; kBatch of them load before
 * any is quantized, so that a thread with many blocks waits for memory once per batch. */
template <int DP, int kBatch = 1, typename Store16>
__device__ __forceinline__ void quantize_q_rows(const AttnArgs &a, int64_t b, int64_t h, int64_t bh,
                                                int64_t q0, int rows, const float *qbar, int tid,
                                                int nthreads, Store16 store16) {
  const fp4attn_attention_params &p = a.p;
  const float encq = q_scales(a.ws, bh)[kQEnc];
  const int D = (int)p.head_dim;
  constexpr int KB = DP / 16;
  for (int job0 = tid; job0 < rows * KB; job0 += nthreads * kBatch) {
    float xs[kBatch][16];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int job = job0 + i * nthreads, r = job / KB, kb = job % KB;
      const int64_t row = q0 + r;
      if (job < rows * KB && row < p.len_q && kb * 16 < D) {
        const int64_t base = b * p.q_stride[0] + h * p.q_stride[1] + row * p.q_stride[2];
        smoothed_block16(p.q, p.dtype, base, kb, D, a.vec_q, qbar + kb * 16, encq, xs[i]);
      } else {
#pragma unroll
        for (int e = 0; e < 16; ++e) xs[i][e] = 0.0f;
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int job = job0 + i * nthreads;
      if (job < rows * KB) {
        uint32_t o[8];
        quantize_block16(xs[i], o);
        store16(job / KB, job % KB * 16, o);
      }
    }
  }
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_TILE_Q_QUANT_CUH */
