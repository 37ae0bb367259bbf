/*
 * FP4 attention forward for Hopper (sm_90a), head dims padded to 64 and 128: the numerics of
 * the sm80 kernel (FP4 operands held as exact FP16 values, SPEC 4.4-4.6), with the matrix work
 * on wgmma and the loads on a producer warpgroup.
 *
 * Work items: 128 query rows of one (batch, query head) (item_count), with 3 warpgroups per block.
 * At DP = 64 the blocks are persistent (Config::kPersistent: one per SM, items from a ticket); at
 * DP = 128 there is one block per item, which thread 0 decodes once into shared memory for all
 * roles (Shared::block_item), so the decode stays out of the consumers' register allocation.
 *   warpgroup 0, producer (setmaxnreg down to Config::kProducerRegs): per 128-key tile, one thread
 *     has the TMA load the K^ and V^ tiles (exact FP16 values written by the pre-pass; the
 *     tensor maps apply the 128-byte swizzle wgmma reads) onto the stage's "full" mbarrier, and
 *     all 128 threads compute the q-mean correction bias[key] = scale log2e qbar . K[key] from K
 *     in input precision (on mma.sync, BiasMma) and arrive on it. A ring of Config::kStages
 *     buffers; it refills one when both consumers signal "empty". Persistent blocks: between its
 * tiles the producer also quantizes the next item's Q (Q - qbar, global scale, phi) into a staging
 *     buffer in global memory, and copies it into shared memory (one bulk copy) as soon as the
 *     consumers are done with the current item's Q^ (producer_loop).
 *   warpgroups 1 and 2, consumers (setmaxnreg up): 64 rows each. S = Q^ K^T by wgmma
 *     m64n128k16 with Q^ and K^ in shared memory; the score epilogue, online softmax and P
 *     quantization in registers (tile/, shared with the mma.sync kernel: the wgmma
 *     accumulator layout of each warp is the m16n8k16 layout of its 16 rows); O_acc += P^q V^ by
 *     wgmma m64n{DP}k16 with P^q from registers, the first-level scales applied to O_acc in FP32
 *     between tiles (softmax_tile_stats).
 * The two consumer warpgroups take turns at issuing their wgmma (see consumer()).
 * Persistence hides what a block per item exposes on every item: the launch, Q's quantization
 * and the first tile. With one block per item (DP = 128) the producer bulk-copies the item's Q
 * rows into shared memory and loads the first tile while the consumers quantize Q^ from the copy.
 * The consumers' and producer's loops have a fragile register allocation: after any change here,
 * compare their SASS with tools/perf/sass_loop_stats.py --compare (docs/performance.md).
 */
#ifndef FP4ATTN_CUDA_SM90_ATTENTION_SM90_CUH
#define FP4ATTN_CUDA_SM90_ATTENTION_SM90_CUH

#include <type_traits>

#include "../tile/epilogue.cuh"
#include "../tile/q_quant.cuh"
#include "../tile/qmean_bias.cuh"
#include "../tile/scheduler.cuh"
#include "../tile/softmax.cuh"
#include "attention_sm90.h"
#include "tensor_maps.h"
#include "trace_events.h"
#include "wgmma.cuh"

namespace fp4attn_cuda {
namespace sm90 {

constexpr int kThreads = 384; /* producer + 2 consumer warpgroups */
constexpr int kRows = 128;    /* query rows per work item (SPEC 4 Bq) */
constexpr int kMaxStages = 4; /* of the K^/V^/bias ring (Config::kStages) */
/* Named barriers (0 is __syncthreads). "Full" is an mbarrier per stage (Config::kOffFull): the
 * 128 producer threads arrive after writing the bias, and the TMA completes the tile bytes. */
constexpr int kBarEmpty = 1;                     /* + stage: both consumers are done with it */
constexpr int kBarTurn = kBarEmpty + kMaxStages; /* + consumer: its turn to issue wgmma */
constexpr int kTurnCount = 256;                  /* one consumer arrives, the other syncs */
constexpr int kBarQFree =
    kBarTurn + 2; /* both consumers have read Q^ of their item for the last time */
constexpr int kBarProducer = kBarQFree + 1; /* the producer warpgroup alone */
/* one item per block: Q^ is written (all 384 threads: the producer then loads over the Q rows) */
constexpr int kBarQReady = kBarProducer + 1;

/* The development timeline (trace_events.h): stamps where FP4ATTN_SM90_TRACE is defined,
 * nothing otherwise. */
#if defined(FP4ATTN_SM90_TRACE)
__device__ TraceRow g_trace[kTraceItems];
#endif
#define FP4ATTN_SM90_TRACE_AT(cond, item, ev) FP4ATTN_SM90_TRACE_INTO(g_trace, cond, item, ev)

/* Kernel parameters: the attention arguments and this call's TMA maps of K^ and V^ (3-D,
 * innermost first: K^ {DP, nkp, BHk}, the V^T tiles {128, nkt x DP, BHk}; boxes of 64 columns
 * (128 bytes) with the 128-byte swizzle, so a box lands as one column block of the wgmma layout).
 */
struct Params {
  AttnArgs a;
  CUtensorMap kmap, vmap;
  /* One item per block, 16-bit Q: the 4-D map of Q {head_dim, Nq, Hq, B} (the caller's strides)
   * with boxes of DP x 128 x 1 x 1, so that one TMA load brings an item's rows (zeros past Nq and
   * head_dim); q_map says whether it was encoded (otherwise one bulk copy per row, copy_q_rows). */
  CUtensorMap qmap;
  bool q_map;
};

/* Work items: the query blocks of 128 rows of every (batch, query head), in query_block's order
 * (fewer than 2^31: launch_forward). Block c of a grid of G starts with item c; later items come
 * from a ticket (G + attn_item_ticket++), like the hardware hands out blocks: at any time the
 * running items are neighbours (they share K/V in L2), and with causal masking the long ones go
 * first. */
__device__ __forceinline__ int item_count(const fp4attn_attention_params &p) {
  return (int)query_block_count(p, kRows);
}

template <int DP>
struct Config {
  /* setmaxnreg split of the launch allocation, 168 x 384 = P x 128 + C x 256. The producer's bias
   * MMA may spill a little (it waits on "empty" much of its time); the consumers must not spill
   * (sass_loop_stats.py reports their local-memory traffic). */
  static constexpr int kProducerRegs = 104;
  static constexpr int kConsumerRegs = 200;
  static_assert(kProducerRegs + 2 * kConsumerRegs == 3 * 168, "setmaxnreg split of 168 x 384");
  /* Persistent blocks (item_count) where the producer has the slack to quantize the next item's
   * Q^ between its tiles: DP = 64. At DP = 128 its bias work per tile is twice as large, and one
   * block per item is faster (docs/performance.md). */
  static constexpr bool kPersistent = DP == 64;
  /* K^/V^/bias ring: a consumer holds two stages (S_j and the deferred P^q_{j-1} V^_{j-1}) while
   * the producer fills the others. DP = 64 has the shared memory for a fourth, which lets the
   * producer of a persistent block run further ahead into the next item. */
  static constexpr int kStages = DP == 64 ? 4 : 3;
  static_assert(kStages <= kMaxStages, "named barriers for the ring");
  /* 16-column blocks of Q a thread loads before quantizing them; the producer quantizes the next
   * item's Q^ in kQPieces pieces of kQBatch blocks per thread, one after each tile load */
  static constexpr int kQBatch = 2;
  static constexpr int kQPieces = kRows * (DP / 16) / (128 * kQBatch);
  static constexpr int kQBytes = kRows * DP * 2;
  static constexpr int kKBytes = kTile * DP * 2;
  static constexpr int kVBytes = DP * kTile * 2;
  /* shared memory map. Small arrays from the (16-byte aligned) base: */
  static constexpr int kOffBias = 0;
  static constexpr int kOffFull = kOffBias + kStages * kTile * 4; /* mbarriers, 8 bytes each */
  static constexpr int kOffQFull = kOffFull + kStages * 8; /* mbarrier: Q^ of the next item */
  static constexpr int kOffItem = kOffQFull + 8;           /* int [2]: the consumers' next items */
  static constexpr int kOffNext = kOffItem + 8;            /* int: the producer's next item */
  static constexpr int kOffBlockItem = kOffNext + 8; /* Item: one item per block, decoded once */
  static constexpr int kBlockItemBytes = kPersistent ? 0 : 64;
  static constexpr int kSmall = kOffBlockItem + kBlockItemBytes;
  /* operand tiles from the first 1024-byte boundary after them (offsets from that boundary): */
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKBytes;
  /* O on its way out (store_rows_staged), 16 rows x DP halves per consumer warp: persistent
   * blocks have their own (the next item's Q^ may be arriving); otherwise Q^'s space, free once
   * the item's last S is done (each warp uses 4 KB of its own warpgroup's Q^ rows) */
  static constexpr int kOutBytes = kRows * DP * 2;
  static constexpr int kOffOut = kPersistent ? kOffV + kStages * kVBytes : kOffQ;
  static constexpr int kTiles = kOffV + kStages * kVBytes + (kPersistent ? kOutBytes : 0);
  static constexpr int kSmem =
      kSmall + 1023 + kTiles; /* 231983 bytes for DP = 128 (H100/H200: 232448) */
  /* One item per block: the item's Q rows as copied (Kernel::copy_q_rows), in the K^ buffer of the
   * ring's last stage, which the producer fills only once Q^ is ready (kBarQReady) */
  static constexpr int kOffQRows = kOffK + (kStages - 1) * kKBytes;
  static_assert(kPersistent || (kStages >= 2 && kKBytes >= kRows * DP * 2),
                "Q rows fit into a later stage's K^");
  static_assert(kPersistent || kOutBytes == kQBytes, "O's staging fits into Q^");
};

template <int DP>
struct Kernel {
  using C = Config<DP>;

  /* One work item: 128 query rows and their query mean. */
  struct Item : QueryBlock {
    const float *qbar; /* DP floats (global) */
  };
  static_assert(C::kPersistent || (sizeof(Item) <= C::kBlockItemBytes && alignof(Item) <= 8),
                "Config::kBlockItemBytes");

  /* This block's shared memory (see Config). */
  struct Shared {
    char *small, *tiles;
    __device__ __half *tile(int off) const { return reinterpret_cast<__half *>(tiles + off); }
    __device__ float *bias(int stage) const {
      return reinterpret_cast<float *>(small + C::kOffBias) + stage * kTile;
    }
    __device__ uint32_t full(int stage) const { return smem_u32(small + C::kOffFull) + stage * 8; }
    __device__ uint32_t qfull() const { return smem_u32(small + C::kOffQFull); }
    /* the item of hand-over h (the block's item h + 1) is in slot h & 1: it stays there until
     * hand-over h + 2, which waits for the consumers to be done with item h + 2's Q^ */
    __device__ volatile int *item(int h) const {
      return reinterpret_cast<volatile int *>(small + C::kOffItem) + (h & 1);
    }
    __device__ volatile int *next() const {
      return reinterpret_cast<volatile int *>(small + C::kOffNext);
    }
    /* one item per block: the block's item, decoded by thread 0 before the role split (run) */
    __device__ Item *block_item() const {
      return reinterpret_cast<Item *>(small + C::kOffBlockItem);
    }
    /* the 16 x DP halves of O staging of consumer warp wwarp of warpgroup cwg (see
     * Config::kOffOut): without a space of its own, 32 of its warpgroup's Q^ rows in one 64-column
     * block */
    __device__ uint32_t *out_stage(int cwg, int wwarp) const {
      const int off = C::kPersistent
                          ? (cwg * 4 + wwarp) * 16 * DP * 2
                          : (wwarp >> 1) * kRows * 128 + (cwg * 64 + (wwarp & 1) * 32) * 128;
      return reinterpret_cast<uint32_t *>(tiles + C::kOffOut + off);
    }
  };

  static __device__ Item item_at(const AttnArgs &a, int it) {
    Item k;
    using Index =
        typename std::conditional<C::kPersistent, int64_t, uint32_t>::type; /* see query_block */
    static_cast<QueryBlock &>(k) = query_block<Index>(a.p, a.ws, kRows, it, a.ws.item_heads);
    k.qbar = a.ws.qbar + (k.bh * a.ws.nqb + k.q0 / kTile) * DP;
    return k;
  }

  /* Rows r0 .. r0 + rows - 1 of Q^ of item `it` (Q - qbar, global scale, phi: exact FP16 values
   * in the 128-byte-swizzled layout wgmma reads) through store(half offset in the tile, 16 bytes),
   * by thread tid of n. */
  template <typename Store>
  static __device__ __forceinline__ void quantize_q(const AttnArgs &a, int it, int r0, int rows,
                                                    int tid, int n, Store store) {
    const Item k = item_at(a, it);
    quantize_q_rows<DP, C::kQBatch>(
        a, k.b, k.h, k.bh, k.q0 + r0, rows, k.qbar, tid, n,
        [&](int r, int col, const uint32_t (&v)[8]) {
          store(sw128_offset(kRows, r0 + r, col), make_uint4(v[0], v[1], v[2], v[3]));
          store(sw128_offset(kRows, r0 + r, col + 8), make_uint4(v[4], v[5], v[6], v[7]));
        });
  }

  /* L2 prefetch of row `tid` of item `it`'s Q (one thread per row), ahead of quantize_q. */
  static __device__ __forceinline__ void prefetch_q_row(const AttnArgs &a, int it, int tid) {
    const fp4attn_attention_params &p = a.p;
    const Item k = item_at(a, it);
    if (k.q0 + tid >= p.len_q) return;
    const char *row = static_cast<const char *>(p.q) +
                      dtype_size(p.dtype) * (k.b * p.q_stride[0] + k.h * p.q_stride[1] +
                                             (k.q0 + tid) * p.q_stride[2]);
    for (int64_t off = 0; off < dtype_size(p.dtype) * p.head_dim; off += 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
  }

#if defined(FP4ATTN_SM90_WGMMA)
  /* One item per block with 16-bit Q in 16-byte aligned rows: warp 0 has the item's Q rows copied
   * into shared memory (copy_q_rows) and the consumers quantize them from there
   * (quantize_copied_q). Their Q^ then waits for one copy instead of two rounds of global loads. */
  static __device__ __forceinline__ bool q_by_copy(const Params &prm) {
    return !C::kPersistent && prm.a.vec_q && prm.a.p.dtype != FP4ATTN_FLOAT32;
  }

  /* Warp 0 copies item k's Q rows into Config::kOffQRows ([128][DP] halves) onto "Q^ full"
   * (which blocks with one item do not use otherwise), right after thread 0's decode: with
   * Params::qmap one TMA load by lane 0 (zeros past len_q and head_dim), else one bulk copy per
   * row (rows past len_q are not copied; the consumers treat them as zeros). The fallback loop
   * is part of the consumers' register allocation: removing it makes their loop spill
   * (sass_loop_stats.py --compare). */
  static __device__ void copy_q_rows(const Params &prm, const Item &k, const Shared &sh, int lane) {
    const fp4attn_attention_params &p = prm.a.p;
    if (prm.q_map) {
      if (lane == 0) {
        mbar_expect_tx(sh.qfull(), kRows * DP * 2); /* the whole box, zero fill included */
        tma_load_4d(smem_u32(sh.tiles + C::kOffQRows), &prm.qmap, 0, (int)k.q0, (int)k.h, (int)k.b,
                    sh.qfull());
        mbar_arrive(sh.qfull());
      }
      return;
    }
    const int rows = (int)min((int64_t)kRows, p.len_q - k.q0);
    const uint32_t row_bytes = 2 * (uint32_t)p.head_dim;
    if (lane == 0) mbar_expect_tx(sh.qfull(), (uint32_t)rows * row_bytes);
    __syncwarp(); /* the transaction count before any copy completes */
    const char *q = static_cast<const char *>(p.q) +
                    2 * (k.b * p.q_stride[0] + k.h * p.q_stride[1] + k.q0 * p.q_stride[2]);
    for (int r = lane; r < rows; r += 32)
      bulk_load(smem_u32(sh.tiles + C::kOffQRows) + r * DP * 2, q + 2 * r * p.q_stride[2],
                row_bytes, sh.qfull());
    if (lane == 0) mbar_arrive(sh.qfull());
  }

  /* Q^ of item `it` from the rows copy_q_rows copied, by consumer thread tid of 256, through
   * store(half offset in the tile, 16 bytes): quantize_q_rows's arithmetic (smoothed_block16,
   * quantize_block16). Every job of a thread is in the same 16-column block, so its 16 means are
   * loaded once, into registers, while the copy is on its way. */
  template <typename Store>
  static __device__ __forceinline__ void quantize_copied_q(const AttnArgs &a, const Item &k,
                                                           const Shared &sh, int tid, Store store) {
    constexpr int kBlocks = DP / 16, kThreadsQ = kThreads - 128;
    static_assert(kThreadsQ % kBlocks == 0, "one column block per thread");
    const fp4attn_attention_params &p = a.p;
    const int kb = tid % kBlocks, D = (int)p.head_dim;
    const float encq = q_scales(a.ws, k.bh)[kQEnc];
    float mean[16]; /* DP floats, zero past D; 16-byte aligned (the workspace's qbar rows) */
#pragma unroll
    for (int e = 0; e < 16; e += 4) {
      const float4 m4 = *reinterpret_cast<const float4 *>(k.qbar + kb * 16 + e);
      mean[e] = m4.x, mean[e + 1] = m4.y, mean[e + 2] = m4.z, mean[e + 3] = m4.w;
    }
    const int64_t rows = p.len_q - k.q0;
    mbar_wait(sh.qfull(), 0);
    FP4ATTN_SM90_TRACE_AT(tid == 0, blockIdx.x, kTrQCopied);
#pragma unroll 1
    for (int job = tid; job < kRows * kBlocks; job += kThreadsQ) {
      const int r = job / kBlocks;
      float xs[16];
      if (r < rows) {
        if (D == DP) /* no padding columns: no bound checks */
          smoothed_block16(sh.tiles + C::kOffQRows + r * DP * 2, p.dtype, 0, kb, DP, true, mean,
                           encq, xs);
        else
          smoothed_block16(sh.tiles + C::kOffQRows + r * DP * 2, p.dtype, 0, kb, D, true, mean,
                           encq, xs);
      } else {
#pragma unroll
        for (int e = 0; e < 16; ++e) xs[e] = 0.0f;
      }
      uint32_t o[8];
      quantize_block16(xs, o);
      store(sw128_offset(kRows, r, kb * 16), make_uint4(o[0], o[1], o[2], o[3]));
      store(sw128_offset(kRows, r, kb * 16 + 8), make_uint4(o[4], o[5], o[6], o[7]));
    }
  }

  /* ---------------------------------------------------------------- producer warpgroup */
  /* How the producer computes the q-mean bias: on mma.sync (BiasMma, 16-bit K with 16-byte rows)
   * or with FP32 FMAs (compute_bias: FP32 K, unaligned rows). One producer loop per way, so the
   * loop carries no dtype tests. */
  enum class BiasPath { kMmaF16, kMmaBf16, kFma };

  static __device__ void producer(const Params &prm, const Shared &sh) {
    const AttnArgs &a = prm.a;
    if (a.vec_k && a.p.dtype == FP4ATTN_BFLOAT16)
      producer_loop<BiasPath::kMmaBf16>(prm, sh);
    else if (a.vec_k && a.p.dtype == FP4ATTN_FLOAT16)
      producer_loop<BiasPath::kMmaF16>(prm, sh);
    else
      producer_loop<BiasPath::kFma>(prm, sh);
  }

  /* One item per block: the copy of its Q rows (copy_q_rows), its first tile, the wait until the
   * consumers have made Q^ of them (kBarQReady: the later tiles overwrite the copy), its other
   * tiles.
   * Persistent blocks, per item: the tiles and, between them, the next item's Q^ into this block's
   * staging buffer in global memory (ws.qstage, L2-resident); then, when the consumers are done
   * with the item's Q^ (kBarQFree), the hand-over: one bulk copy of the staged Q^ into shared
   * memory onto the "Q^ full" mbarrier, with the next item's index (or the end) in shared memory.
   * Q^ is quantized while the consumers work on the item before, and the ring runs on over the
   * items, so the next item's first loads overlap the end of this one. */
  template <BiasPath kBias>
  static __device__ void producer_loop(const Params &prm, const Shared &sh) {
    const AttnArgs &a = prm.a;
    const int tid = threadIdx.x, warp = tid >> 5; /* 0..127, 0..3 */
    constexpr bool kBiasMma = kBias != BiasPath::kFma;
    BiasMma<DP, kBias == BiasPath::kMmaBf16> bias_mma;
    int loaded = 0; /* tiles loaded, over all items */
    int stage = 0;
    const auto load_tile = [&](const Item &k, int j) {
      /* The bias's K rows come from the input K, not from the ring: at DP = 128 they are loaded
       * before the wait for the stage, so they are on their way while the producer waits. At
       * DP = 64 they are loaded after it: the other order moves the consumers' loop schedule
       * (docs/performance.md). */
      typename BiasMma<DP, kBias == BiasPath::kMmaBf16>::Keys keys;
      constexpr bool kEarlyKeys = DP == 128;
      if (kBiasMma && kEarlyKeys) bias_mma.load(j, keys);
      if (loaded >= C::kStages) named_sync(kBarEmpty + stage, kThreads);
      if (kBiasMma && !kEarlyKeys) bias_mma.load(j, keys);
      if (tid == 0) {
        const uint32_t full = sh.full(stage);
        const uint32_t ks = smem_u32(sh.tiles + C::kOffK + stage * C::kKBytes);
        const uint32_t vs = smem_u32(sh.tiles + C::kOffV + stage * C::kVBytes);
        mbar_expect_tx(full, C::kKBytes + C::kVBytes);
#pragma unroll
        for (int cb = 0; cb < DP / 64; ++cb) /* K^ rows j*128.., columns cb*64..: [128][64] */
          tma_load_3d(ks + cb * kTile * 128, &prm.kmap, cb * 64, j * kTile, (int)k.bhk, full);
#pragma unroll
        for (int cb = 0; cb < 2; ++cb) /* V^T of tile j, keys cb*64..: [DP][64] */
          tma_load_3d(vs + cb * DP * 128, &prm.vmap, cb * 64, j * DP, (int)k.bhk, full);
      }
      if (kBiasMma)
        bias_mma.finish(a, keys, sh.bias(stage) + warp * 32);
      else
        compute_bias<DP, 1>(a, k.b, k.hk, (int64_t)j * kTile + tid, 0, k.qbar,
                            sh.bias(stage) + tid);
      mbar_arrive(sh.full(stage));
      ++loaded;
      stage = stage + 1 == C::kStages ? 0 : stage + 1;
    };
    const int nitems = item_count(a.p);
    __half *staging = a.ws.qstage + (int64_t)blockIdx.x * (kRows * DP);
    if constexpr (C::kPersistent) {
      /* Q^ of the first item straight into shared memory: phase 0 of "Q^ full". (Quantizing it
       * with all 384 threads before the role split makes the consumers' tile loop spill.) */
      __half *qs = sh.tile(C::kOffQ);
      quantize_q(a, blockIdx.x, 0, kRows, tid, 128,
                 [&](int off, const uint4 &v) { *reinterpret_cast<uint4 *>(qs + off) = v; });
      fence_proxy_async();
      named_sync(kBarProducer, 128);
      if (tid == 0) mbar_arrive(sh.qfull());
    }
    if constexpr (!C::kPersistent) {   /* one item per block */
      const Item k = *sh.block_item(); /* its Q rows are on their way (run) */
      if (kBiasMma) bias_mma.init(a, k.b, k.hk, warp * 32, k.qbar);
      for (int j = 0; j < k.ntiles; ++j) {
        load_tile(k, j);
        FP4ATTN_SM90_TRACE_AT(j == 0 && tid == 0, blockIdx.x, kTrFull0);
        if (j == 0) named_sync(kBarQReady, kThreads); /* then the other tiles */
      }
      if (k.ntiles == 0) named_sync(kBarQReady, kThreads);
    }
    int handovers = 0; /* hand-over h completes phase h + 1 of "Q^ full" */
    for (int cur = C::kPersistent ? (int)blockIdx.x : nitems; cur < nitems;) {
      if (tid == 0) *sh.next() = (int)gridDim.x + (int)atomicAdd(attn_item_ticket(a.ws), 1ull);
      const Item k = item_at(a, cur);
      if (kBiasMma) bias_mma.init(a, k.b, k.hk, warp * 32, k.qbar);
      int j = 0;
      for (; j < min(2, k.ntiles); ++j) {
        load_tile(k, j);
        FP4ATTN_SM90_TRACE_AT(j == 0 && tid == 0, cur, kTrFull0);
      }
      /* the next item (taken from the ticket above), its Q rows on their way to L2, and, once the
       * last copy out of the staging buffer is done, its Q^ into it piece by piece, one piece
       * after each further tile: in the producer's slack between tiles (all at once, it made the
       * consumers wait for tiles of short items) */
      named_sync(kBarProducer, 128); /* *sh.next() is written */
      const int nxt = *sh.next();
      if (nxt < nitems) {
        prefetch_q_row(a, nxt, tid);
        if (handovers > 0) mbar_wait(sh.qfull(), handovers & 1); /* phase handovers: the copy out */
      }
      for (int piece = 0; piece < C::kQPieces; ++piece) {
        if (j < k.ntiles) load_tile(k, j++);
        if (nxt < nitems) {
          constexpr int kPieceRows = kRows / C::kQPieces;
          quantize_q(
              a, nxt, piece * kPieceRows, kPieceRows, tid, 128,
              [&](int off, const uint4 &v) { *reinterpret_cast<uint4 *>(staging + off) = v; });
          fence_proxy_async_global();
        }
      }
      for (; j < k.ntiles; ++j) load_tile(k, j);
      named_sync(kBarQFree,
                 kThreads); /* also orders every thread's staging writes before the copy */
      if (tid == 0) {
        *sh.item(handovers) = nxt;
        if (nxt < nitems) {
          mbar_expect_tx(sh.qfull(), C::kQBytes);
          bulk_load(smem_u32(sh.tile(C::kOffQ)), staging, C::kQBytes, sh.qfull());
        }
        mbar_arrive(sh.qfull());
      }
      ++handovers;
      cur = nxt;
    }
    /* match the consumers' releases of the stages of the last tiles */
    for (int t = loaded > C::kStages ? loaded - C::kStages : 0; t < loaded; ++t)
      named_sync(kBarEmpty + t % C::kStages, kThreads);
  }

  /* ---------------------------------------------------------------- consumer warpgroups */
  /* S = Q^ K^T for this warpgroup's 64 rows x 128 keys, reduction over DP in k16 steps (async).
   * q_lo, k_lo: descriptor low words of the operands (sw128_desc_lo); a k16 step inside a
   * 64-column block is +32 bytes, the next block +rows x 128 bytes (in 16-byte units below). */
  static __device__ __forceinline__ void issue_scores(float (&s)[16][4], uint32_t q_lo,
                                                      uint32_t k_lo) {
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      const uint32_t step = (kk & 3) * 2;
      wgmma_ss_m64n128k16(s, sw128_desc(q_lo + (kk >> 2) * (kRows * 8) + step),
                          sw128_desc(k_lo + (kk >> 2) * (kTile * 8) + step), kk > 0);
    }
  }

  /* O_acc += P^q V^: 64 rows x DP columns, reduction over the 128 keys in k16 steps (async). */
  static __device__ __forceinline__ void issue_pv(float (&o)[DP / 8][4], const uint32_t (&pa)[8][4],
                                                  uint32_t v_lo) {
#pragma unroll
    for (int kb = 0; kb < 8; ++kb)
      wgmma_rs_acc_k16<DP, false>(o, pa[kb],
                                  sw128_desc(v_lo + (kb >> 2) * (DP * 8) + (kb & 3) * 2));
  }

  /* Position in the K^/V^ ring: the stage of the next tile and the parity of its "full" phase
   * (the tiles of all items follow each other, as the producer loads them). */
  struct Ring {
    int stage = 0;
    uint32_t phase = 0;
    __device__ void next() {
      if (++stage == C::kStages) stage = 0, phase ^= 1u;
    }
  };

  /* Per item: run the tiles, release Q^ after the last S (kBarQFree), store O and the LSE, then
   * wait for the next item's Q^ and index ("Q^ full", see producer_loop).
   * Per tile j the warpgroup issues S_j and the deferred P^q_{j-1} V^_{j-1} (two commit groups),
   * waits for S_j only and runs the first softmax phase (scores, maxima, statistics:
   * softmax_tile_stats) while P^q_{j-1} V^_{j-1} is still on the tensor cores; then waits for it,
   * frees the stage, writes P^q_j (softmax_tile_finish) and rescales O_acc by tile j's factor,
   * ready for P^q_j V^_j. O is accumulated in place by the wgmma. The two consumer warpgroups take
   * turns at issuing (kBarTurn, as FA3's ping-pong), so one's
   * wgmma run while the other does its softmax; the turns run on over the items.
   * With an attn_mask, both groups are waited for first: ptxas serializes every wgmma of the
   * kernel (warning C7513) when the general mask code (data-dependent branches and loads) runs
   * while a group is in flight, and likewise when P^q_j is built while P^q_{j-1} is in flight
   * (more live registers than a consumer has). The causal and key-padding masks are branch-free
   * (mask_causal_tail) and take the overlapped path. */
  static __device__ void consumer(const Params &prm, const Shared &sh) {
    const AttnArgs &a = prm.a;
    const AttnWorkspace &w = a.ws;
    const int ctid = threadIdx.x - 128; /* 0..255 */
    /* consumer warpgroup and warp in it. Persistent blocks broadcast cwg from lane 0: the compiler
     * then knows it is warp-uniform and keeps the Q^ descriptors in uniform registers (they
     * spilled in the tile loop otherwise); with one item per block the plain value spills less. */
    const int cwg = C::kPersistent ? __shfl_sync(0xffffffffu, ctid >> 7, 0) : ctid >> 7,
              wwarp = (ctid >> 5) & 3;
    /* this warpgroup's 64 rows of Q^: 64 x 128 bytes into each column block */
    const uint32_t q_lo = sw128_desc_lo(smem_u32(sh.tiles + C::kOffQ) + cwg * 64 * 128);
    const uint32_t k_lo = sw128_desc_lo(smem_u32(sh.tiles + C::kOffK)),
                   v_lo = sw128_desc_lo(smem_u32(sh.tiles + C::kOffV));
    const auto k_desc = [&](int stage) { return k_lo + stage * (C::kKBytes / 16); };
    const auto v_desc = [&](int stage) { return v_lo + stage * (C::kVBytes / 16); };
    /* turns: consumer 1 hands the first to consumer 0; consumer 0 takes back the last hand-over */
    const auto turn_begin = [&]() { named_sync(kBarTurn + cwg, kTurnCount); };
    const auto turn_end = [&]() { named_arrive(kBarTurn + (cwg ^ 1), kTurnCount); };
    if (cwg == 1) named_arrive(kBarTurn + 0, kTurnCount);

    Ring ring;
    const int nitems = item_count(a.p);
    /* item n of this block: blockIdx.x, then from hand-over n - 1 (read where needed rather than
     * kept: one register less in the tile loop, which spilled otherwise) */
    const auto item_index = [&](int n) {
      return n == 0 ? (int)blockIdx.x : __shfl_sync(0xffffffffu, *sh.item(n - 1), 0);
    };
    /* releases Q^ after the item's last S (persistent blocks only: otherwise Q^ stays) */
    const auto q_free = [&]() {
      if (C::kPersistent) named_arrive(kBarQFree, kThreads);
    };
    /* item n of this block, decoded: persistent blocks decode it again where needed (keeping it
     * through the tile loop cost the consumers spills there), one item per block reads it from
     * shared memory */
    const auto item_of = [&](int n) -> Item {
      return C::kPersistent ? item_at(a, item_index(n)) : *sh.block_item();
    };
    for (int item_no = 0;; ++item_no) {
      if constexpr (C::kPersistent) {
        mbar_wait(sh.qfull(), item_no & 1); /* Q^ of the item, and its index (or the end) */
        if (item_index(item_no) >= nitems) break;
      } else if (item_no > 0) {
        break; /* one item per block, its Q^ from the prologue */
      }
#if defined(FP4ATTN_SM90_TRACE)
      const int tr_item = item_index(item_no); /* by every thread: item_index shuffles */
      FP4ATTN_SM90_TRACE_AT(C::kPersistent && ctid == 0, tr_item, kTrQReady);
#endif
      const Item k = item_of(item_no);
      const WarpRows rows = {k.b, k.h, k.q0 + cwg * 64 + wwarp * 16};
      /* the rows for a tile's masks: one item per block reads them from shared memory in every
       * tile (3 shared loads) rather than keeping 6 registers of 64-bit indices through the loop,
       * which makes that loop spill */
      const auto tile_rows = [&]() -> WarpRows {
        if constexpr (C::kPersistent) {
          return rows;
        } else {
          const volatile Item *b = sh.block_item();
          return {b->b, b->h, b->q0 + cwg * 64 + wwarp * 16};
        }
      };
      /* dQ, dK: loaded here, multiplied into cqk only once the first S is issued, so that the
       * first S does not wait for these loads; loading them in the prologue makes the tile loop
       * spill (sass_loop_stats.py --compare). */
      const float decq = q_scales(w, k.bh)[kQDec];
      const float deck = kv_scales(w, k.bhk)[kKDec];
      InPlaceSoftmaxState st;
      st.m[0] = st.m[1] = st.ref[0] = st.ref[1] = -INFINITY;
      st.l[0] = st.l[1] = 0.0f;
      float o[DP / 8][4];
#pragma unroll
      for (int n = 0; n < DP / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

      if (k.ntiles == 0) q_free();
      if (k.ntiles > 0) {
        float s[16][4];
        uint32_t pa[8][4];
        /* tile 0: S only (O_acc is zero, its factor does not matter) */
        mbar_wait(sh.full(ring.stage), ring.phase);
        turn_begin();
        FP4ATTN_SM90_TRACE_AT(ctid == 0, tr_item, kTrS0Issue);
        wgmma_fence();
        issue_scores(s, q_lo, k_desc(ring.stage));
        wgmma_commit();
        turn_end();
        wgmma_wait<0>();
        fence_regs(s);
        const float cqk = a.scale_log2 * (decq * deck);
        FP4ATTN_SM90_TRACE_AT(ctid == 0, tr_item, kTrS0);
        if (k.ntiles == 1) q_free();
        TileStats ts;
        softmax_tile_stats<MaskPath::kAll>(a.p, rows, 0, cqk, sh.bias(ring.stage), s, st, ts);
        softmax_tile_finish(s, ts, st, pa);
        FP4ATTN_SM90_TRACE_AT(ctid == 0, tr_item, kTrTile0);
        int prev = ring.stage;
        ring.next();

        for (int j = 1; j < k.ntiles; ++j) {
          mbar_wait(sh.full(ring.stage), ring.phase);
          turn_begin();
          wgmma_fence();
          issue_scores(s, q_lo, k_desc(ring.stage));
          wgmma_commit();
          issue_pv(o, pa, v_desc(prev));
          wgmma_commit();
          turn_end();
          if (a.p.mask_kind == FP4ATTN_MASK_NONE) {
            wgmma_wait<1>(); /* S_j; phase 1 overlaps P^q_{j-1} V^_{j-1} */
            fence_regs(s);
            if (j == k.ntiles - 1) q_free();
            softmax_tile_stats<MaskPath::kCausalTail>(a.p, tile_rows(), (int64_t)j * kTile, cqk,
                                                      sh.bias(ring.stage), s, st, ts);
            wgmma_wait<0>();
          } else {
            wgmma_wait<0>();
            fence_regs(s);
            if (j == k.ntiles - 1) q_free();
            softmax_tile_stats<MaskPath::kAll>(a.p, tile_rows(), (int64_t)j * kTile, cqk,
                                               sh.bias(ring.stage), s, st, ts);
          }
          fence_regs(o);
          named_arrive(kBarEmpty + prev, kThreads); /* stage prev is free */
          softmax_tile_finish(s, ts, st, pa);
          rescale_rows(o, ts.ofac);
          prev = ring.stage;
          ring.next();
        }
        /* the last tile's P^q V^ */
        turn_begin();
        wgmma_fence();
        issue_pv(o, pa, v_desc(prev));
        wgmma_commit();
        turn_end();
        wgmma_wait<0>();
        fence_regs(o);
        named_arrive(kBarEmpty + prev, kThreads);
        FP4ATTN_SM90_TRACE_AT(ctid == 0, tr_item, kTrLastPv);
      }
      const Item e = item_of(item_no); /* once more for the epilogue (see item_of) */
      const WarpRows erows = {e.b, e.h, e.q0 + cwg * 64 + wwarp * 16};
      const float decv = kv_scales(w, e.bhk)[kVDec]; /* applied last (out_pair) */
      float omul[2];
#pragma unroll
      for (int r = 0; r < 2; ++r)
        omul[r] = st.ref[r] == -INFINITY
                      ? 0.0f
                      : fast_exp2(st.ref[r] - st.m[r]) * (1.0f / FP4ATTN_NVFP4_RANGE);
      if (a.vec_out)
        store_rows_staged<DP>(a, erows, e.bh, o, omul, decv, st, e.qbar, w.kbar + e.bhk * DP,
                              w.vbar + e.bhk * DP, sh.out_stage(cwg, wwarp));
      else
        store_rows<DP>(a, erows, e.bh, o, omul, decv, st, e.qbar, w.kbar + e.bhk * DP,
                       w.vbar + e.bhk * DP);
      FP4ATTN_SM90_TRACE_AT(ctid == 0, tr_item, kTrEnd);
      FP4ATTN_SM90_TRACE_AT(ctid == 0, tr_item, kTrSm);
      FP4ATTN_SM90_TRACE_AT(ctid == 0, tr_item, kTrEndNs);
    }
    if (cwg == 0) turn_begin(); /* consumer 1's last hand-over */
  }

  static __device__ void run(const Params &prm, char *smem) {
    if (blockIdx.x >= item_count(prm.a.p)) return;
    FP4ATTN_SM90_TRACE_AT(threadIdx.x == 0, blockIdx.x, kTrStart);
    FP4ATTN_SM90_TRACE_AT(threadIdx.x == 0, blockIdx.x, kTrStartNs);
    /* the operand tiles need 1024-byte alignment (the swizzle works on address bits) */
    const uint32_t tiles_at = (smem_u32(smem) + C::kSmall + 1023u) & ~1023u;
    Shared sh;
    sh.small = smem;
    sh.tiles = smem + (tiles_at - smem_u32(smem));
    if (threadIdx.x < 32) {
      if (threadIdx.x == 0) {
        for (int st = 0; st < C::kStages; ++st) mbar_init(sh.full(st), 128);
        mbar_init(sh.qfull(), 1);
        mbar_init_fence();
        if constexpr (!C::kPersistent) {
          fence_proxy_async(); /* the initialised "Q^ full", to the copies (async proxy) */
          *sh.block_item() = item_at(prm.a, blockIdx.x);
        }
        FP4ATTN_SM90_TRACE_AT(!C::kPersistent, blockIdx.x, kTrDecoded);
      }
      if constexpr (!C::kPersistent) {
        if (q_by_copy(prm)) {
          __syncwarp(); /* the decoded item and the mbarriers, to the whole warp */
          copy_q_rows(prm, *sh.block_item(), sh, threadIdx.x);
        }
      }
    }
    __syncthreads(); /* the mbarriers are initialised, the block's item is decoded */
    if (threadIdx.x < 128) {
      regs_dealloc<C::kProducerRegs>();
      producer(prm, sh);
    } else {
      if constexpr (!C::kPersistent) {
        /* The block's one item: Q^ by the 256 consumer threads from the rows warp 0 copied
         * (quantize_copied_q), or, for FP32 and unaligned Q, from global memory in 2 batches of
         * loads, while the
         * producer loads the first tile and computes its bias. */
        __half *qs = sh.tile(C::kOffQ);
        const auto store = [&](int off, const uint4 &v) {
          *reinterpret_cast<uint4 *>(qs + off) = v;
        };
        if (q_by_copy(prm))
          quantize_copied_q(prm.a, *sh.block_item(), sh, threadIdx.x - 128, store);
        else /* decodes the item itself: quantize_q taking the decoded item reordered the D=64 tile
                loop */
          quantize_q(prm.a, blockIdx.x, 0, kRows, threadIdx.x - 128, kThreads - 128, store);
        FP4ATTN_SM90_TRACE_AT(threadIdx.x == 128, blockIdx.x, kTrQQuantized);
        fence_proxy_async();
        named_sync(kBarQReady, kThreads);
        FP4ATTN_SM90_TRACE_AT(threadIdx.x == 128, blockIdx.x, kTrQReady);
      }
      regs_alloc<C::kConsumerRegs>();
      consumer(prm, sh);
    }
  }
#endif /* FP4ATTN_SM90_WGMMA */
};

template <int DP>
__global__ void __launch_bounds__(kThreads, 1)
    attention_fwd_sm90_kernel(const __grid_constant__ Params prm) {
#if defined(FP4ATTN_SM90_WGMMA)
  extern __shared__ __align__(16) char smem[];
  Kernel<DP>::run(prm, smem);
#else
  __trap(); /* never launched: the host launches this kernel only for sm_90a builds on CC 9.0 */
#endif
}

template <int DP>
fp4attn_status launch(const AttnArgs &a, cudaStream_t s) {
  static int resident[64] = {0};
  Params prm;
  prm.a = a;
  fp4attn_status st = encode_tensor_maps(a, DP, prm.kmap, prm.vmap);
  if (st.code != FP4ATTN_OK) return st;
  prm.q_map = !Config<DP>::kPersistent && encode_q_map(a, DP, prm.qmap);
  /* persistent: at most one block per staging buffer (ws.qstage: one per SM) */
  if (Config<DP>::kPersistent && a.ws.qstage_blocks < 1)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "attention (sm90 kernel): the workspace has no Q^ staging");
  return launch_forward(attention_fwd_sm90_kernel<DP>, prm, a.p, kRows, kThreads, Config<DP>::kSmem,
                        resident, Config<DP>::kPersistent ? a.ws.qstage_blocks : 0,
                        "attention (sm90 kernel)", s);
}

}  // namespace sm90

template <int DP>
fp4attn_status launch_attention_sm90(const AttnArgs &a, cudaStream_t s) {
  return sm90::launch<DP>(a, s);
}

}  // namespace fp4attn_cuda

#if defined(FP4ATTN_SM90_TRACE)
/* Development only (tools/perf/trace_sm90.cu): copy out `items` rows of the timeline (kTrEvents
 * stamps each), then clear it for the next call. Returns 0 on success. */
extern "C" int fp4attn_sm90_trace_take(unsigned long long *host, int items) {
  return fp4attn_cuda::trace_take(fp4attn_cuda::sm90::g_trace, host, items);
}
#endif

#endif /* FP4ATTN_CUDA_SM90_ATTENTION_SM90_CUH */
