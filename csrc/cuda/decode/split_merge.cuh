/*
 * The last step of the split-KV decodes (decode.cu, sdpa_decode.cu): each query row of a tile of
 * `rows` merges its splits' partial results by their row maxima and writes O / l and the lse.
 * Both kernels lay their partials out alike: o_part [tiles][splits][rows][DP] (unnormalised O),
 * ml_part [tiles][splits][rows][2] (row max in log2 units, row sum), qshift [tiles][rows] (the
 * lse's constant term); tile = (b x Hkv + hk) x mtiles + mt, tile row R = query head hk G + R /
 * len_q at position R % len_q.
 */
#ifndef FP4ATTN_CUDA_DECODE_SPLIT_MERGE_CUH
#define FP4ATTN_CUDA_DECODE_SPLIT_MERGE_CUH

#include "../common/device.cuh"

namespace fp4attn_cuda {

struct SplitMerge {
  const float *o_part, *ml_part, *qshift;
  int64_t splits, mtiles, rows; /* rows: query rows per tile */
  int64_t heads_q, heads_kv, len_q, head_dim;
  void *out;
  int64_t out_stride[3];
  fp4attn_dtype dtype;
  float *lse; /* [batch][heads_q][len_q], or null */
};

/* Row blockIdx.y of tile blockIdx.x, a column per thread (launch_split_merge). The splits' loads
 * are independent, so a few tiles with many splits (small batches on long caches) still spread
 * over the SMs instead of serialising on a block per tile. */
template <int DP>
__global__ void __launch_bounds__(DP) split_merge_kernel(const SplitMerge m) {
  const int64_t tile = blockIdx.x, S = m.splits, G = m.heads_q / m.heads_kv, nq = m.len_q;
  const int r = blockIdx.y, d = threadIdx.x;
  const int64_t R = m.rows, bhk = tile / m.mtiles, row = (tile % m.mtiles) * R + r;
  if (row >= G * nq) return;
  const int64_t b = bhk / m.heads_kv, hk = bhk % m.heads_kv;
  const float *ml = m.ml_part + (tile * S * R + r) * 2;
  const float *o = m.o_part + (tile * S * R + r) * DP + d;
  float mx = -INFINITY;
#pragma unroll 4
  for (int64_t s = 0; s < S; ++s) mx = fmaxf(mx, ml[s * R * 2]);
  float acc = 0.0f, ls = 0.0f;
#pragma unroll 4
  for (int64_t s = 0; s < S; ++s) {
    const float ms = ml[s * R * 2];
    const float f = ms == -INFINITY ? 0.0f : exp2f(ms - mx);
    acc = fmaf(f, o[s * R * DP], acc);
    ls = fmaf(f, ml[s * R * 2 + 1], ls);
  }
  const int64_t h = hk * G + row / nq, t = row % nq;
  if (d < m.head_dim)
    store_from_float(m.out, m.dtype,
                     b * m.out_stride[0] + h * m.out_stride[1] + t * m.out_stride[2] + d,
                     ls > 0.0f ? acc / ls : 0.0f);
  if (d == 0 && m.lse)
    m.lse[(b * m.heads_q + h) * nq + t] =
        ls > 0.0f ? mx * kLn2 + logf(ls) + m.qshift[tile * R + r] : -INFINITY;
}

/* The merge of `tiles` tiles on stream s: a block of DP threads per row. */
template <int DP>
void launch_split_merge(const SplitMerge &m, int64_t tiles, cudaStream_t s) {
  split_merge_kernel<DP><<<dim3((unsigned)tiles, (unsigned)m.rows), DP, 0, s>>>(m);
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_DECODE_SPLIT_MERGE_CUH */
