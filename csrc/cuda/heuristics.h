/*
 * The rules that choose how an attention call runs on CUDA (an AttnPlan, tile/workspace.cuh):
 * which kernel family (from the request, the device, the build's architectures and the head dim)
 * and the scheduling knobs that size the workspace. dispatch.cu is their only caller; nothing
 * else decides.
 */
#ifndef FP4ATTN_CUDA_HEURISTICS_H
#define FP4ATTN_CUDA_HEURISTICS_H

#include <string.h>

#include <algorithm>

#include "decode/sdpa_decode.h"
#include "int8/int8_tiles.cuh"
#include "kv_cache/kv_cache.h"
#include "tile/workspace.cuh"

#define FP4ATTN_STR2(x) #x
#define FP4ATTN_STR(x) FP4ATTN_STR2(x)

namespace fp4attn_cuda {

/* Whether the build holds sm_90a code (setup.py lists its architectures in FP4ATTN_CUDA_ARCHS):
 * the wgmma kernel has a body only in that pass. */
static inline bool built_for_sm90a() {
#if defined(FP4ATTN_CUDA_ARCHS)
  return strstr(FP4ATTN_STR(FP4ATTN_CUDA_ARCHS), "90a") != nullptr;
#else
  return false;
#endif
}

/* Heads per group of the causal work order (tile/scheduler.cuh, query_block): a group's items go
 * longest first across its heads, so the grid ends on the shortest items. The smallest divisor of
 * B x Hq whose group holds a wave of items (SM count / nqb heads or more), so that small groups
 * keep their K^/V^ in L2; 1 (head-major order) where no divisor lies near. */
static inline int64_t causal_item_heads(const fp4attn_attention_params *p, int64_t nqb) {
  const int64_t bhq = p->batch * p->heads_q;
  if (!p->causal || bhq <= 1 || nqb < 1) return 1;
  const int64_t want = ceil_div(sm_count(), nqb);
  if (want >= bhq) return bhq;
  for (int64_t g = want; g <= 2 * want && g <= bhq; ++g)
    if (bhq % g == 0) return g;
  return 1;
}

/* The opt-in shared memory per block of the current device, cached per device. */
static inline int smem_optin() {
  static int cache[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  if (cache[dev] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    cache[dev] = n > 0 ? n : -1;
  }
  return cache[dev];
}

/* Why the fused split-KV decode (decode/sdpa_decode.cu) cannot run p on this device, or null. */
static inline const char *sdpa_decode_refusal(const fp4attn_attention_params *p, int cc) {
  if (cc < 80) return "a GPU of compute capability 8.0 or newer";
  if (p->dtype == FP4ATTN_FLOAT32) return "float16 or bfloat16 inputs";
  if (p->mask_kind != FP4ATTN_MASK_NONE) return "no attn_mask";
  if (p->len_q > kDecodeMaxLenQ) return "len_q <= 128 (one query-smoothing block)";
  if (!vector_rows(p->k, p->k_stride, p->head_dim) || !vector_rows(p->v, p->v_stride, p->head_dim))
    return "K and V rows 16-byte aligned, with head_dim and strides multiples of 8";
  if (smem_optin() < sdpa_decode_smem_bytes(padded_head_dim(p->head_dim)))
    return "more shared memory per block than this device has at this head dim";
  return nullptr;
}

/* The fused decode's schedule: m-tiles of 16 rows; splits of the key tiles that minimise the
 * attention grid's makespan, waves x (tiles per split + the block's prologue, which finishes the
 * statistics and quantizes Q: about 1.6 tiles' time at head dim 128 on the H200, counted as 2),
 * where a partial last wave costs a whole one, the fewest splits among equals (each adds merge
 * work); the statistics kernel's token chunks (multiples of 64 tokens) so that its grid holds about
 * 2 blocks per SM, at most 32 per head (the attention prologue reduces a head's chunk partials).
 * Causal: the top-left causal mask leaves the first key tile only (len_q <= 128), one split. */
static inline DecodeSchedule sdpa_decode_schedule(const fp4attn_attention_params *p, int64_t dp) {
  constexpr int64_t kPrologueTiles = 2;
  DecodeSchedule d;
  const int64_t bhk = p->batch * p->heads_kv, group = p->heads_q / p->heads_kv;
  d.mtiles = ceil_div(group * p->len_q, kDecodeRows);
  const int64_t ntiles = p->causal ? 1 : ceil_div(p->len_k, kTile);
  const int64_t slots = (int64_t)sm_count() * (dp <= 64 ? 2 : 1), blocks = bhk * d.mtiles;
  int64_t best = INT64_MAX;
  for (int64_t s = 1; s <= std::min(ntiles, 4 * slots); ++s) { /* past 4 waves: overhead only */
    const int64_t per = ceil_div(ntiles, s);
    const int64_t makespan = ceil_div(blocks * s, slots) * (per + kPrologueTiles);
    if (makespan < best && ceil_div(ntiles, per) == s) best = makespan, d.tiles_per_split = per;
  }
  d.splits = ceil_div(ntiles, d.tiles_per_split);
  const int64_t chunks = std::min<int64_t>(32, ceil_div(2 * (int64_t)sm_count(), bhk));
  d.chunk_len = round_up(ceil_div(p->len_k, chunks), 64);
  d.chunks = ceil_div(p->len_k, d.chunk_len);
  return d;
}

/* The plan for p (already validated) on the current device, or an FP4ATTN_ERR_UNSUPPORTED status
 * where the requested kernel cannot run. AUTO: the fused decode for decode shapes (below), else
 * sm120 on compute capability 12.x, sm90 on 9.0 with an sm_90a build and head dim <= 128, sm80
 * otherwise.
 *
 * Decode shapes: len_q <= 16, len_k >= 256, and batch x heads_kv <= 32 or GQA groups of at least
 * 4 query heads, where sdpa_decode_refusal finds nothing. The fused decode quantizes K and V in
 * registers once per m-tile, which the heads of a group share: measured on the H200 (D = 64 and
 * 128, 8K-128K keys) it beats sm90 up to 32 (batch, KV head) pairs (1.4-7x) and with groups of 4
 * at up to 512 pairs (1.2-1.25x; equal at 4 query tokens), and mostly loses without GQA from 256
 * pairs (6.6 against 5.2 ms at one query token, 0.75-1.8x sm90's time at four). With at most 16
 * query rows per head the 128-row query tiles of the other kernels are nearly empty, and their
 * pre-pass writes and re-reads FP16 copies of all of K and V; the fused decode reads K and V twice
 * in their input dtype (statistics, then attention) and spreads the keys over the SMs. Below two
 * key tiles (256 keys) there is nothing to split and either path is bound by launch latency, so
 * the general kernels keep those calls. */
static inline fp4attn_status plan_attention(const fp4attn_attention_params *p, AttnPlan *plan) {
  const int cc = device_capability();
  const int64_t dp = padded_head_dim(p->head_dim);
  const bool sm90_ok = built_for_sm90a() && cc == 90 && dp <= 128;
  fp4attn_kernel k = p->kernel;
  if (k == FP4ATTN_KERNEL_AUTO) {
    if (p->len_q <= 16 && p->len_k >= 2 * kTile &&
        (p->batch * p->heads_kv <= 32 || p->heads_q / p->heads_kv >= 4) &&
        !sdpa_decode_refusal(p, cc))
      k = FP4ATTN_KERNEL_DECODE;
    else
      k = cc / 10 == 12 ? FP4ATTN_KERNEL_SM120
                        : (sm90_ok ? FP4ATTN_KERNEL_SM90 : FP4ATTN_KERNEL_SM80);
  } else if (k == FP4ATTN_KERNEL_DECODE) { /* AUTO asked sdpa_decode_refusal already */
    const char *why = sdpa_decode_refusal(p, cc);
    if (why)
      return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "attention: kernel decode needs %s", why);
  }
  if (k == FP4ATTN_KERNEL_SM90 && !sm90_ok)
    return fp4attn_error(
        FP4ATTN_ERR_UNSUPPORTED,
        "attention: kernel sm90 needs a GPU of compute capability 9.0, a build with "
        "sm_90a in FP4ATTN_CUDA_ARCHS and head dim <= 128 (got %lld)",
        (long long)p->head_dim);
  /* the sm120 operand writer's grids have B x Hq or B x Hkv blocks in y (at most 65535) */
  if (k == FP4ATTN_KERNEL_SM120 && p->batch * p->heads_q > 65535)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "batch * heads_q must be at most 65535 for the sm120 kernel");
  plan->kernel = k;
  plan->dp = dp;
  plan->fp16_operands = k != FP4ATTN_KERNEL_SM120 && k != FP4ATTN_KERNEL_DECODE;
  plan->qstage_blocks = k == FP4ATTN_KERNEL_SM90 && dp == 64 ? sm_count() : 0;
  plan->item_heads = causal_item_heads(p, ceil_div(p->len_q, 128));
  plan->decode = k == FP4ATTN_KERNEL_DECODE ? sdpa_decode_schedule(p, dp) : DecodeSchedule{};
  if (k == FP4ATTN_KERNEL_DECODE && p->batch * p->heads_kv * plan->decode.mtiles > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "attention: kernel decode: too many heads");
  return fp4attn_ok();
}

/* The plan of a decode on the FP4 KV cache (kv_cache/decode.cu). Splits of the stored rows fill
 * whole waves: as many blocks as are resident at once (a second, partial wave would leave most SMs
 * idle at its end), each with at least two chunks per warp over the keys a full cache (or the
 * window) lets a tile read. A residual adds one short split per tile (split 0, dispatched first).
 */
static inline KvDecodePlan plan_kv_decode(const fp4attn_decode_params *p) {
  KvDecodePlan d;
  d.dp = padded_head_dim(p->cache.head_dim);
  const int64_t G = p->heads_q / p->cache.heads_kv;
  d.rows = G * p->len_q <= 8 ? 8 : 16; /* N of the transposed products: 1 or 2 n-tiles */
  d.mtiles = ceil_div(G * p->len_q, d.rows);
  d.tiles = p->cache.batch * p->cache.heads_kv * d.mtiles;
  int64_t keys = p->cache.max_pages * p->cache.page_size;
  if (p->window > 0 && p->window < keys) /* (a larger window is none: no overflow) */
    keys = std::min(keys, p->window + p->len_q + kKvDecodeChunk);
  const int64_t chunks = ceil_div(keys, kKvDecodeChunk);
  const int64_t wave = (int64_t)kv_decode_blocks_per_sm(*p, d.dp, d.rows) * sm_count();
  d.kv_splits =
      std::max<int64_t>(1, std::min<int64_t>(wave / d.tiles, chunks / (2 * kKvDecodeWarps)));
  d.splits = d.kv_splits + (p->residual_len > 0 ? 1 : 0);
  d.o_part_bytes = round_up(4 * d.tiles * d.splits * d.rows * d.dp, 256);
  d.ml_part_bytes = round_up(4 * d.tiles * d.splits * d.rows * 2, 256);
  d.qshift_bytes = round_up(4 * d.tiles * d.rows, 256);
  d.bytes = d.o_part_bytes + d.ml_part_bytes + d.qshift_bytes;
  return d;
}

/* The kernel of an 8-bit call, forward or backward, and its V16 operand (Int8Plan). AUTO: the
 * wgmma kernels (int8/forward_sm90.cu: head dims <= 256, int8/backward_sm90.cu: <= 128) on
 * compute capability 9.0 with an sm_90a build, else the mma.sync kernels (int8/, sm_80 and newer).
 * The sm90 forward reads V16 by rows (MN-major B of its P.V wgmma) rather than as the
 * preparation's transposed tiles (K-major) where that saves the preparation's V pass (the caller's
 * V is V16 already: int8_v_caller) and the call is short, or at head dim 256: the transposed B
 * makes the kernel slower by 7 % at head dim 128, 5 % at 64 and under 1 % at 256 (H200,
 * docs/performance.md), the V pass costs 0.05-0.15 ms per 16K tokens x 2048 channels. Short: up
 * to 4,096 keys (2,048 at head dim 64), twice that with a causal mask. */
static inline fp4attn_status plan_int8_attention(const fp4attn_attention_params *p, bool backward,
                                                 Int8Plan *plan) {
  if (p->kernel != FP4ATTN_KERNEL_AUTO && p->kernel != FP4ATTN_KERNEL_SM80 &&
      p->kernel != FP4ATTN_KERNEL_SM90)
    return fp4attn_error(
        FP4ATTN_ERR_UNSUPPORTED,
        "int8 attention: no '%s' kernel; the 8-bit kernels are 'sm80' (mma.sync, "
        "any GPU of compute capability 8.0 or newer) and 'sm90' (wgmma forward and "
        "backward, compute capability 9.0)",
        fp4attn_kernel_name(p->kernel));
  const int cc = device_capability();
  if (cc < 80)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "int8 attention needs a GPU of compute capability 8.0 or newer");
  const int64_t sm90_max_dim = backward ? 128 : 256;
  const bool sm90_ok = built_for_sm90a() && cc == 90 && p->head_dim <= sm90_max_dim;
  if (p->kernel == FP4ATTN_KERNEL_SM90 && !sm90_ok)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "int8 attention: kernel sm90 needs a GPU of compute capability 9.0, a "
                         "build with sm_90a in FP4ATTN_CUDA_ARCHS and head dim <= %lld for the %s "
                         "(got %lld)",
                         (long long)sm90_max_dim, backward ? "backward" : "forward",
                         (long long)p->head_dim);
  const bool sm90 =
      p->kernel == FP4ATTN_KERNEL_SM90 || (p->kernel == FP4ATTN_KERNEL_AUTO && sm90_ok);
  plan->kernel = sm90 ? FP4ATTN_KERNEL_SM90 : FP4ATTN_KERNEL_SM80;
  const int64_t dp = padded_head_dim(p->head_dim);
  const int64_t short_keys = (dp == 64 ? 2048 : 4096) * (p->causal ? 2 : 1);
  const bool in_place = sm90 && int8_v_caller(p);
  plan->v_rows = sm90 && !backward && (dp == 256 || (in_place && p->len_k <= short_keys));
  plan->v_caller = in_place && (backward || plan->v_rows);
  plan->deterministic = false; /* the backward's request, set by its caller */
  return fp4attn_ok();
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_HEURISTICS_H */
