/*
 * The arguments every CUDA attention kernel receives (AttnArgs: the caller's parameters and the
 * workspace) and the workspace layout shared by the pre-pass (prepass/) and the kernels.
 *
 * Workspace layout (every section 256-byte aligned; BHq = batch*heads_q, BHk = batch*heads_kv,
 * Dp = head dim padded to 64/128/256, nqb = ceil(Nq/128), nkt = ceil(Nk/128), nkp = 128*nkt):
 *   qbar    f32 [BHq][nqb][Dp]     per-128-row query means (SPEC 4.2), zero beyond D
 *   qamax   f32 [BHq][nqb]         max |Q - qbar| of each query block
 *   ksum    f32 [BHk][nkt][Dp]     per-128-token column sums of K
 *   kbar    f32 [BHk][Dp]          key mean (SPEC 4.1)
 *   qmean   f32 [BHk][Dp]          mean query of the KV head's query heads (SPEC 4.3, qm)
 *   vpart   f32 [BHk][nkt][Dp]     per-128-key chunk sums exp(s_j - M_c) V_j of V smoothing
 *   vml     f32 [BHk][nkt][2]      the chunk's M_c and l_c = sum exp(s_j - M_c)
 *   vbar    f32 [BHk][Dp]          V smoothing mean (SPEC 4.3), zero beyond D
 *   qmask   f32 [BHq][nqb][Dp]     with an attn_mask only (else empty): the mean of each query
 *                                  block's rows that see some key, where some do not (SPEC 4.3)
 *   qcount  f32 [BHq][nqb]         with an attn_mask only: how many rows of the block see a key
 *   kbias   u32 [BHk][nkp]         with an attn_mask only: each key's bias in vbar's softmax as
 *                                  an order key (0: no row sees the key), zeroed by the pre-pass
 *   qscale  f32 [BHq][2]           enc, dec of Qs
 *   kvscale f32 [BHk][4]           enc, dec of Ks; enc, dec of V
 *   kdq     f16 [BHk][nkp][Dp]     Ks^ quantized along D (SPEC 4.3), stored as the exact FP16
 *                                  values code * E4M3 scale (no global scale; padding is 0)
 *   vdq     f16 [BHk][nkt][Dp][128] V^ quantized along tokens, the same way, tile-major V^T:
 *                                  one 128-token tile is Dp*256 contiguous bytes
 *                                  (kdq and vdq are empty unless AttnPlan::fp16_operands)
 *   qstage  f16 [S][128][Dp]       Q^ of the next query block of each block of the persistent
 *                                  sm90 kernel (sm90/attention_sm90.cuh, Dp = 64), as its
 *                                  shared-memory image; S = AttnPlan::qstage_blocks
 *   sync    u64, u32 [BHk], u32 [BHk][Dp] x 4: the Hopper kernel's work ticket, then the max |V|
 *                                  key and the K and V column min/max keys of the pre-pass
 *                                  (prepass/), zeroed on the stream by every pre-pass
 * Storing the dequantized values (exact: at most 6 significant bits) rather than packed FP4 moves
 * the dequantization out of the attention kernels' inner loops; the bits are the same as
 * dequantizing the FP4 codes in the kernel. Q is not stored quantized: the sm80/sm90 kernels
 * quantize their own 128-row blocks from the input. At offset `bytes` follow the pre-pass's staging
 * area (prepass/prepass.h), then the sm120 kernel's own sections (FP4 codes in its fragment
 * order, sm120/sm120_common.cuh): dispatch.cu sizes and places them.
 */
#ifndef FP4ATTN_CUDA_TILE_WORKSPACE_CUH
#define FP4ATTN_CUDA_TILE_WORKSPACE_CUH

#include "../common/device.cuh"

namespace fp4attn_cuda {

constexpr int kTile = 128; /* SPEC 4: Bq = Bkv = 128 */

static inline int64_t padded_head_dim(int64_t d) {
  return d <= 64 ? 64 : (d <= 128 ? 128 : 256);
}

/* The schedule of the fused split-KV decode (decode/sdpa_decode.cu): m-tiles of 16 query rows
 * per (batch, KV head), key-tile ranges (splits of tiles_per_split 128-key tiles), and the
 * statistics kernel's token chunks. */
struct DecodeSchedule {
  int64_t mtiles, splits, tiles_per_split, chunks, chunk_len;
};

/* How a decode call on the FP4 KV cache (kv_cache/decode.cu) is split (planned by heuristics.h,
 * plan_kv_decode): tiles of `rows` (8 or 16) query rows (G query heads x len_q positions of one
 * (batch, KV head), in m-tiles) times `splits` parts: with a residual, split 0 for the residual
 * rows, then kv_splits key ranges of the stored rows; its workspace layout. */
struct KvDecodePlan {
  int64_t dp, rows, mtiles, tiles, splits, kv_splits;
  int64_t o_part_bytes, ml_part_bytes, qshift_bytes, bytes;
};

/* How one attention call runs (planned by heuristics.h); the workspace is sized for it. */
struct AttnPlan {
  fp4attn_kernel kernel; /* never AUTO */
  int64_t dp;            /* head dim padded to the instantiated 64 / 128 / 256 */
  bool fp16_operands;    /* the pre-pass writes K^/V^ as exact FP16 values (sm80, sm90) */
  int64_t qstage_blocks; /* Q^ staging buffers of the persistent sm90 kernel (one per SM), or 0 */
  int64_t item_heads;    /* (batch, query head)s per group of the sm90 causal work order */
  DecodeSchedule decode; /* FP4ATTN_KERNEL_DECODE only */
};

struct AttnWorkspace {
  int64_t dp, nqb, nkt, nkp;
  float *qbar, *qamax, *ksum, *kbar, *qmean, *vpart, *vml, *vbar, *qscale, *kvscale;
  float *qmask, *qcount; /* masked vbar (attn_mask only) */
  unsigned int *kbias;
  __half *kdq, *vdq, *qstage;
  int64_t qstage_blocks;
  void *sync;
  int64_t bytes;
  int64_t item_heads; /* AttnPlan::item_heads */
};

/* The global scales (SPEC 2) of the pre-pass: qscale[bh][kQScales], kvscale[bhk][kKvScales]. */
enum QScale { kQEnc = 0, kQDec = 1, kQScales = 2 };
enum KvScale { kKEnc = 0, kKDec = 1, kVEnc = 2, kVDec = 3, kKvScales = 4 };
__host__ __device__ inline float *q_scales(const AttnWorkspace &w, int64_t bh) {
  return w.qscale + bh * kQScales;
}
__host__ __device__ inline float *kv_scales(const AttnWorkspace &w, int64_t bhk) {
  return w.kvscale + bhk * kKvScales;
}

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

/* Bytes of the sync section (see the layout above). */
static inline int64_t attn_sync_bytes(int64_t bhk, int64_t dp) {
  return 8 * kSyncTickets + 4 * bhk + 16 * bhk * dp;
}

/* Fills the section pointers for `base` (may be null to only compute the size). */
static inline AttnWorkspace attn_workspace_layout(const fp4attn_attention_params *p,
                                                  const AttnPlan &plan, void *base) {
  AttnWorkspace w;
  w.dp = plan.dp;
  w.qstage_blocks = plan.qstage_blocks;
  w.nqb = ceil_div(p->len_q, kTile);
  w.nkt = ceil_div(p->len_k, kTile);
  w.nkp = w.nkt * kTile;
  w.item_heads = plan.item_heads;
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
  w.kbar = (float *)take(4 * bhk * w.dp);
  w.qmean = (float *)take(4 * bhk * w.dp);
  w.vpart = (float *)take(4 * bhk * w.nkt * w.dp);
  w.vml = (float *)take(4 * bhk * w.nkt * 2);
  w.vbar = (float *)take(4 * bhk * w.dp);
  const bool masked = p->mask_kind != FP4ATTN_MASK_NONE;
  w.qmask = (float *)take(masked ? 4 * bhq * w.nqb * w.dp : 0);
  w.qcount = (float *)take(masked ? 4 * bhq * w.nqb : 0);
  w.kbias = (unsigned int *)take(masked ? 4 * bhk * w.nkp : 0);
  w.qscale = (float *)take(4 * bhq * 2);
  w.kvscale = (float *)take(4 * bhk * 4);
  const int64_t operand_bytes = plan.fp16_operands ? 2 * bhk * w.nkp * w.dp : 0;
  w.kdq = (__half *)take(operand_bytes);
  w.vdq = (__half *)take(operand_bytes);
  w.qstage = (__half *)take(2 * w.qstage_blocks * kTile * w.dp);
  w.sync = take(attn_sync_bytes(bhk, w.dp));
  w.bytes = off;
  return w;
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_TILE_WORKSPACE_CUH */
