/*
 * Host interface of the fused split-KV decode of plain attention calls (sdpa_decode.cu): few query
 * rows against long keys, K and V read in their input dtype and quantized in registers (SPEC 4),
 * no pre-pass. heuristics.h decides when it runs (FP4ATTN_KERNEL_DECODE) and plans its
 * DecodeSchedule; dispatch.cu sizes the workspace and launches it.
 *
 * Workspace (every section 256-byte aligned; BHk = batch * heads_kv, C = schedule.chunks,
 * T = BHk * mtiles m-tiles, S = splits, Dp = padded head dim):
 *   ksum, kmin, kmax f32 [BHk][C][Dp]  per-chunk column sums / minima / maxima of K
 *   vmax             f32 [BHk][C]      per-chunk max |V|
 *   o_part           f32 [T][S][16][Dp] unnormalised O of each split (scaled like m)
 *   ml_part          f32 [T][S][16][2]  the split's row max m (log2 units) and row sum l
 *   qshift           f32 [T][16]        scale * (Q_r - qbar) . kbar of each row (SPEC 4.6)
 */
#ifndef FP4ATTN_CUDA_DECODE_SDPA_DECODE_H
#define FP4ATTN_CUDA_DECODE_SDPA_DECODE_H

#include "../tile/workspace.cuh"

namespace fp4attn_cuda {

constexpr int kDecodeRows = 16;     /* query rows per m-tile: G query heads x len_q positions */
constexpr int kDecodeMaxLenQ = 128; /* one query-smoothing block (SPEC 4.2) per head */

struct SdpaDecodeWorkspace {
  float *ksum, *kmin, *kmax, *vmax, *o_part, *ml_part, *qshift;
  int64_t bytes;
};

static inline SdpaDecodeWorkspace sdpa_decode_layout(const fp4attn_attention_params &p,
                                                     const AttnPlan &plan, void *base) {
  const DecodeSchedule &d = plan.decode;
  const int64_t bhk = p.batch * p.heads_kv, tiles = bhk * d.mtiles;
  SdpaDecodeWorkspace w;
  int64_t off = 0;
  char *b = static_cast<char *>(base);
  auto take = [&](int64_t bytes) -> float * {
    float *r = b ? reinterpret_cast<float *>(b + off) : nullptr;
    off += round_up(bytes, 256);
    return r;
  };
  w.ksum = take(4 * bhk * d.chunks * plan.dp);
  w.kmin = take(4 * bhk * d.chunks * plan.dp);
  w.kmax = take(4 * bhk * d.chunks * plan.dp);
  w.vmax = take(4 * bhk * d.chunks);
  w.o_part = take(4 * tiles * d.splits * kDecodeRows * plan.dp);
  w.ml_part = take(4 * tiles * d.splits * kDecodeRows * 2);
  w.qshift = take(4 * tiles * kDecodeRows);
  w.bytes = off;
  return w;
}

/* Dynamic shared memory of the attention kernel at padded head dim dp (the plan checks it against
 * the device's limit). */
int64_t sdpa_decode_smem_bytes(int64_t dp);

/* The statistics, split-KV attention and merge kernels on stream s (p validated and planned). */
fp4attn_status launch_sdpa_decode(const fp4attn_attention_params &p, const AttnPlan &plan,
                                  void *workspace, cudaStream_t s);

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_DECODE_SDPA_DECODE_H */
