/*
 * Private interface between the attention pre-pass (attention.cu) and the forward kernels
 * (attention_fwd.cuh, instantiated per padded head dim in attention_fwd_d*.cu).
 *
 * Workspace layout (every section 256-byte aligned; BHq = batch*heads_q, BHk = batch*heads_kv,
 * Dp = head dim padded to 64/128/256, nqb = ceil(Nq/128), nkt = ceil(Nk/128), nkp = 128*nkt):
 *   qbar    f32 [BHq][nqb][Dp]     per-128-row query means (SPEC 4.2), zero beyond D
 *   qamax   f32 [BHq][nqb]         max |Q - qbar| of each query block
 *   ksum/kmin/kmax f32 [BHk][nkt][Dp]  per-128-token column partials of K
 *   vamax   f32 [BHk][nkt]         max |V| per 128-token chunk
 *   kbar    f32 [BHk][Dp]          key mean (SPEC 4.1)
 *   qscale  f32 [BHq][2]           enc, dec of Qs
 *   kvscale f32 [BHk][4]           enc, dec of Ks; enc, dec of V
 *   kdq     f16 [BHk][nkp][Dp]     Ks^ quantized along D (SPEC 4.3), stored as the exact FP16
 *                                  values code * E4M3 scale (no global scale; padding is 0)
 *   vdq     f16 [BHk][nkt][Dp][128] V^ quantized along tokens, the same way, tile-major V^T:
 *                                  one 128-token tile is Dp*256 contiguous bytes
 *   qstage  f16 [S][128][Dp]       Q^ of the next query block of each persistent block of the
 *                                  Hopper kernel (hopper/attention_fwd_sm90.cuh, Dp = 64), as its
 *                                  shared-memory image; S = SM count where Dp = 64, else 0
 *   sync    u64, u32 [BHk], u32 [BHk][Dp] x 2: the Hopper kernel's work ticket, then the max |V|
 *                                  and column min/max keys of the streaming pre-pass (prepass.cu),
 *                                  zeroed on the stream by every pre-pass
 * Storing the dequantized values (exact: at most 6 significant bits) rather than packed FP4 moves
 * the dequantization out of the attention kernel's inner loop, where it cost ~30% of the issued
 * instructions on Hopper; the bits are the same as dequantizing the FP4 codes in the kernel.
 * Q is not stored quantized: the forward kernel quantizes its own 128-row block from the input.
 */
#ifndef FP4ATTN_CUDA_ATTENTION_CUH
#define FP4ATTN_CUDA_ATTENTION_CUH

#include "common.cuh"

namespace fp4attn_cuda {

constexpr int kTile = 128; /* SPEC 4: Bq = Bkv = 128 */

struct AttnWorkspace {
  int64_t dp, nqb, nkt, nkp;
  float *qbar, *qamax, *ksum, *kmin, *kmax, *vamax, *kbar, *qscale, *kvscale;
  __half *kdq, *vdq, *qstage;
  int64_t qstage_blocks;
  void *sync;
  int64_t bytes;
  int64_t item_heads; /* (batch, query head)s per group of the causal work order of the Hopper
                         kernels (causal_item_heads; 1 without causal masking) */
};

/* The u64 work ticket at the start of the sync section: the Hopper kernel's (query blocks handed
 * out after the first grid-size ones). The pre-pass's u32 keys follow it. */
constexpr int kSyncTickets = 1;
__host__ __device__ inline unsigned long long *attn_item_ticket(const AttnWorkspace &w) {
  return static_cast<unsigned long long *>(w.sync);
}

struct AttnArgs {
  fp4attn_attention_params p;
  AttnWorkspace ws;
  bool vec_q, vec_k, vec_v; /* 8-element groups are 16-byte aligned: vector loads */
  bool out_pair;            /* two adjacent output elements form one aligned word */
  bool vec_out;             /* 16-bit output, 8-element groups 16-byte aligned: 16-byte stores */
  float scale_log2;         /* scale * log2(e) */
};

static inline int64_t padded_head_dim(int64_t d) { return d <= 64 ? 64 : (d <= 128 ? 128 : 256); }

/* Query blocks of `rows` rows of one (batch, query head), and of all of them: the forward
 * kernels' blocks or work items (query_block). */
__host__ __device__ inline int64_t query_blocks_per_head(const fp4attn_attention_params &p, int rows) {
  return (p.len_q + rows - 1) / rows;
}
__host__ __device__ inline int64_t query_block_count(const fp4attn_attention_params &p, int rows) {
  return p.batch * p.heads_q * query_blocks_per_head(p, rows);
}

/* Bytes of the sync section (see the layout above). */
static inline int64_t attn_sync_bytes(int64_t bhk, int64_t dp) {
  return 8 * kSyncTickets + 4 * bhk + 8 * bhk * dp;
}

/* Heads per group of the causal work order (query_block): the groups' items go longest first
 * across the group's heads, so the last items of the grid are the shortest of the last group
 * and fill the tail. (Longest first within each head leaves the last head's longest item to start
 * near the end: 3-6 % of the causal kernel's time at N = 1K-8K in a list-scheduling model.) The
 * smallest divisor of B x Hq whose group holds a wave of items (SM count / nqb heads or more):
 * small groups keep their K^/V^ in L2. 1 (the head-major order) where no divisor lies near.
 * The Hopper kernels use it (the mma.sync kernel keeps the head-major order); the head-dim-128
 * kernel decodes its item once per block into shared memory, so the decode does not reach its
 * tile loop's register allocation (docs/cuda_notes.md, v21). */
static inline int64_t causal_item_heads(const fp4attn_attention_params *p, int64_t nqb) {
  const int64_t bhq = p->batch * p->heads_q;
  if (!p->causal || bhq <= 1 || nqb < 1) return 1;
  const int64_t want = ceil_div(sm_count(), nqb);
  if (want >= bhq) return bhq;
  for (int64_t g = want; g <= 2 * want && g <= bhq; ++g)
    if (bhq % g == 0) return g;
  return 1;
}

/* Fills the section pointers for `base` (may be null to only compute the size); the current
 * device's SM count sizes qstage (the same device for both calls: the binding sizes the workspace
 * and launches on the inputs' device). */
static inline AttnWorkspace attn_workspace_layout(const fp4attn_attention_params *p, void *base) {
  AttnWorkspace w;
  w.dp = padded_head_dim(p->head_dim);
  w.qstage_blocks = w.dp == 64 ? sm_count() : 0;
  w.nqb = ceil_div(p->len_q, kTile);
  w.nkt = ceil_div(p->len_k, kTile);
  w.nkp = w.nkt * kTile;
  w.item_heads = causal_item_heads(p, w.nqb);
  const int64_t bhq = p->batch * p->heads_q, bhk = p->batch * p->heads_kv;
  int64_t off = 0;
  char *b = static_cast<char *>(base);
  auto take = [&](int64_t bytes) -> void * {
    void *r = b ? b + off : nullptr;
    off += round_up(bytes, 256);
    return r;
  };
  w.qbar = (float *)take(4 * bhq * w.nqb * w.dp);
  w.qamax = (float *)take(4 * bhq * w.nqb);
  w.ksum = (float *)take(4 * bhk * w.nkt * w.dp);
  w.kmin = (float *)take(4 * bhk * w.nkt * w.dp);
  w.kmax = (float *)take(4 * bhk * w.nkt * w.dp);
  w.vamax = (float *)take(4 * bhk * w.nkt);
  w.kbar = (float *)take(4 * bhk * w.dp);
  w.qscale = (float *)take(4 * bhq * 2);
  w.kvscale = (float *)take(4 * bhk * 4);
  w.kdq = (__half *)take(2 * bhk * w.nkp * w.dp);
  w.vdq = (__half *)take(2 * bhk * w.nkp * w.dp);
  w.qstage = (__half *)take(2 * w.qstage_blocks * kTile * w.dp);
  w.sync = take(attn_sync_bytes(bhk, w.dp));
  w.bytes = off;
  return w;
}

/* Columns kb*16 .. kb*16+15 of the row at element `row` of x, smoothed and scaled for phi
 * (SPEC 4.1-4.3: (x - mean) * enc, two roundings), zeros from column D on. mean: the 16 means of
 * these columns (any memory; registers when the caller holds them). */
__device__ __forceinline__ void smoothed_block16(const void *x, fp4attn_dtype dt, int64_t row, int kb,
                                                 int D, bool vec, const float *mean, float enc,
                                                 float (&xs)[16]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int c0 = kb * 16 + half * 8;
    float v[8];
    load8_padded(x, dt, row, c0, D, vec, v);
#pragma unroll
    for (int e = 0; e < 8; ++e)
      xs[half * 8 + e] = c0 + e < D ? __fmul_rn(__fsub_rn(v[e], mean[half * 8 + e]), enc) : 0.0f;
  }
}

/* The exact FP16 values code * scale of one quantized 16-value block (codes q, E4M3 scale s) as
 * 8 half2 words: the form the workspace and the kernels' shared memory hold. */
__device__ __forceinline__ void block_f16_words(const uint8_t *q, uint8_t s, uint32_t (&o)[8]) {
  const float sv = fp4attn_e4m3_decode(s);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    o[i] = pack_half2(fp4attn_e2m1_decode(q[2 * i]) * sv, fp4attn_e2m1_decode(q[2 * i + 1]) * sv);
}

/* Launches forward kernel `kernel` with parameter `args` and `smem` bytes of dynamic shared
 * memory on stream s: one block of `threads` per `rows` query rows of every (batch, query head)
 * of p, or, when `persistent` > 0, at most that many and no more than fit on the device at once
 * (the kernel loops over the query blocks). The first launch on a device raises the kernel's
 * shared-memory limit and records how many blocks are resident at once (`resident`: the kernel's
 * per-device record, 0 until then), or returns FP4ATTN_ERR_UNSUPPORTED where the device has too
 * little memory. */
template <typename Kernel, typename Args>
fp4attn_status launch_forward(Kernel kernel, const Args &args, const fp4attn_attention_params &p, int rows,
                              int threads, int smem, int (&resident)[64], int64_t persistent, const char *name,
                              cudaStream_t s) {
  int dev = 0;
  cudaGetDevice(&dev);
  int at_once = dev >= 0 && dev < 64 ? resident[dev] : 0;
  if (at_once == 0) {
    int optin = 0, per_sm = 0;
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (optin < smem)
      return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                          "%s: head dim %lld needs %d bytes of shared memory per block, the device "
                          "allows %d",
                          name, (long long)padded_head_dim(p.head_dim), smem, optin);
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess)
      return launch_status(name);
    at_once = sm_count() * (per_sm > 0 ? per_sm : 1);
    if (dev >= 0 && dev < 64) resident[dev] = at_once;
  }
  int64_t blocks = query_block_count(p, rows);
  if (blocks > 0x7FFFFFFFLL) return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "%s: too many query blocks", name);
  if (persistent > 0) blocks = min(blocks, min((int64_t)at_once, persistent));
  kernel<<<(unsigned)blocks, threads, smem, s>>>(args);
  return launch_status(name);
}

/* Forward kernels, one per padded head dim (attention_fwd_d*.cu). Each picks between the
 * mma.sync kernel and, on Hopper, the wgmma kernel (hopper/attention_fwd_sm90.cu). */
fp4attn_status launch_attention_fwd_d64(const AttnArgs &a, cudaStream_t s);
fp4attn_status launch_attention_fwd_d128(const AttnArgs &a, cudaStream_t s);
fp4attn_status launch_attention_fwd_d256(const AttnArgs &a, cudaStream_t s);

/* The Hopper kernel runs for kernel = SM90, or AUTO on compute capability 9.0, when the build
 * has sm_90a and the padded head dim is at most 128; SM90 requested where it cannot run is an
 * FP4ATTN_ERR_UNSUPPORTED error (sm90_unavailable). */
enum Sm90Choice { SM90_NO, SM90_YES, SM90_UNAVAILABLE };
Sm90Choice choose_sm90(const fp4attn_attention_params &p, int64_t dp);
fp4attn_status sm90_unavailable(int64_t head_dim);
fp4attn_status launch_attention_fwd_sm90_d64(const AttnArgs &a, cudaStream_t s);
fp4attn_status launch_attention_fwd_sm90_d128(const AttnArgs &a, cudaStream_t s);

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_ATTENTION_CUH */
