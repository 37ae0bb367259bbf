/*
 * The last step of the split-KV decodes (kv_cache/decode.cu, decode/sdpa_decode.cu): each query row
 * of a tile of `rows` merges its splits' partial results by their row maxima and writes O / l and
 * the lse. Both kernels lay their partials out alike: o_part [tiles][splits][rows][DP]
 * (unnormalised O), ml_part [tiles][splits][rows][2] (row max in log2 units, row sum), qshift
 * [tiles][rows] (the lse's constant term); tile = (b x Hkv + hk) x mtiles + mt, tile row R = query
 * head hk G + R / len_q at position R % len_q.
 */
#ifndef FP4ATTN_CUDA_TILE_SPLIT_MERGE_CUH
#define FP4ATTN_CUDA_TILE_SPLIT_MERGE_CUH

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

constexpr int kMergeWarps = 8;

/* Row blockIdx.y of tile blockIdx.x (launch_split_merge). Warp w takes splits w, w + 8, ..., each
 * lane DP / 32 consecutive columns (vector loads): many splits of a few rows (small batches on
 * long caches) are eight independent load streams per row instead of one chain. The row's maximum
 * comes first, so every split's weight exp2(m_s - max) is computed once, the same in every warp. */
template <int DP>
__global__ void __launch_bounds__(32 * kMergeWarps) split_merge_kernel(const SplitMerge m) {
  constexpr int V = DP / 32; /* columns per lane */
  static_assert(V == 2 || V % 4 == 0, "DP: 64, 128 or 256");
  __shared__ float part[kMergeWarps][DP], part_l[kMergeWarps], warp_max[kMergeWarps];
  const int64_t tile = blockIdx.x, S = m.splits, G = m.heads_q / m.heads_kv, nq = m.len_q;
  const int r = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t R = m.rows, bhk = tile / m.mtiles, row = (tile % m.mtiles) * R + r;
  if (row >= G * nq) return; /* the whole block: no barrier is left waiting */
  grid_dependency_wait();    /* the splits' partial results are complete */
  const int64_t b = bhk / m.heads_kv, hk = bhk % m.heads_kv;
  const float *ml = m.ml_part + (tile * S * R + r) * 2;
  const float *o = m.o_part + (tile * S * R + r) * DP + V * lane;
  float mx = -INFINITY;
  for (int64_t s = threadIdx.x; s < S; s += 32 * kMergeWarps) mx = fmaxf(mx, ml[s * R * 2]);
  mx = block_max<kMergeWarps>(mx, warp_max);
  float acc[V] = {}, ls = 0.0f;
#pragma unroll 4
  for (int64_t s = warp; s < S; s += kMergeWarps) {
    const float ms = ml[s * R * 2];
    const float f = ms == -INFINITY ? 0.0f : exp2f(ms - mx);
    float x[V];
    if constexpr (V == 2) {
      const float2 t = *reinterpret_cast<const float2 *>(o + s * R * DP);
      x[0] = t.x, x[1] = t.y;
    } else {
#pragma unroll
      for (int i = 0; i < V; i += 4) {
        const float4 t = *reinterpret_cast<const float4 *>(o + s * R * DP + i);
        x[i] = t.x, x[i + 1] = t.y, x[i + 2] = t.z, x[i + 3] = t.w;
      }
    }
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = fmaf(f, x[i], acc[i]);
    ls = fmaf(f, ml[s * R * 2 + 1], ls);
  }
#pragma unroll
  for (int i = 0; i < V; ++i) part[warp][V * lane + i] = acc[i];
  if (lane == 0) part_l[warp] = ls;
  __syncthreads();
  ls = 0.0f;
#pragma unroll
  for (int w = 0; w < kMergeWarps; ++w) ls += part_l[w];
  const int64_t h = hk * G + row / nq, t = row % nq;
  for (int d = threadIdx.x; d < m.head_dim; d += 32 * kMergeWarps) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kMergeWarps; ++w) sum += part[w][d];
    store_from_float(m.out, m.dtype,
                     b * m.out_stride[0] + h * m.out_stride[1] + t * m.out_stride[2] + d,
                     ls != 0.0f ? sum / ls : 0.0f);
  }
  if (threadIdx.x == 0 && m.lse)
    m.lse[(b * m.heads_q + h) * nq + t] =
        ls != 0.0f ? mx * kLn2 + logf(ls) + m.qshift[tile * R + r] : -INFINITY;
}

/* The merge of `tiles` tiles on stream s, right after the kernel that writes the partial results
 * (a programmatic dependent of it): a block of kMergeWarps warps per row. */
template <int DP>
void launch_split_merge(const SplitMerge &m, int64_t tiles, cudaStream_t s) {
  launch_dependent(split_merge_kernel<DP>, dim3((unsigned)tiles, (unsigned)m.rows),
                   dim3(32 * kMergeWarps), 0, s, m);
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_TILE_SPLIT_MERGE_CUH */
