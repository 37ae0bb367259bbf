/*
 * 8-bit attention forward (docs/SPEC_INT8.md 2) for Hopper (sm_90a) on wgmma: the numbers of the
 * mma.sync kernel (forward.cu), with the matrix work on warpgroup MMA and the loads on TMA.
 *
 * An item is kConsumers SPEC_INT8 Q^ blocks of 64 query rows of one (batch, query head), one
 * consumer warpgroup per Q^ block plus the producer (kConsumers = 3 at head dims 64 and 128, so
 * each scheduler has three softmax warps to interleave; 2 at 256, whose output needs 240 registers
 * a thread). A block takes one item, or (kPersistent: head dim 128, two waves of items or more)
 * blocks, one per SM, take items in turn: the first by block index, the next from a counter that
 * the statistics kernel zeroes.
 *   warpgroup 0, producer (setmaxnreg down): one thread has the TMA load, per 128-key tile j, the
 *     K^ tile and V16_j into a ring of kStages stages ("full" mbarriers), refilling a stage once
 *     every consumer thread has released it ("empty" mbarriers), and the item's Q^ rows (once the
 *     consumers' last S has read the previous item's: "qempty"), so that the next item's first
 *     tiles and Q^ load while the consumers finish the last one and store its output. V16_j
 *     as the preparation's transposed tile, or (kVRows, heuristics.h's Int8Plan::v_rows) as its
 *     rows: the caller's V where it is V16 already, else a row-major copy (int8_v16_rows).
 *   warpgroups 1 .. kConsumers, consumers (setmaxnreg up): one Q^ block of 64 rows each
 *     (wgmma's M), per tile: S_j = Q^ K^_j^T by wgmma m64n128k32 s8.s8 (both in shared memory,
 *     exact int32), the online softmax with P16 = fl16(448 exp2(S - m)) against the running row
 *     maximum in registers (SPEC_INT8 2.4), then O = alpha O + P16_j V16_j: O rescaled in
 *     registers (not at all once the row maxima settle), then eight wgmma m64n{DP}k16 FP16 or
 *     (kBf16) BF16 accumulating into O, with P16_j from registers (the accumulator layout is the
 *     k16 A fragment's), V16_j the B operand: K-major tiles, or (kVRows) MN-major rows.
 *     The consumers take turns at issuing S (named barriers in a ring), so the others' wgmma run
 *     while one computes its softmax.
 * Operand layouts: K-major rows swizzled over their width (wgmma.cuh, kmajor_desc): Q^ and K^ rows
 * of DP bytes (64: 64-byte swizzle, 128: 128-byte swizzle, 256: two 128-byte slabs). V16: tiles
 * as two K-major slabs [DP][64 keys] (sw128_desc), or rows as per 64 of its DP columns an
 * MN-major slab [128 keys][64] (mnmajor_sw128_desc); 128-byte swizzle for both.
 */
#include "../sm90/tensor_maps.h"
#include "../sm90/trace_events.h"
#include "../sm90/wgmma.cuh"
#include "attention_int8.h"
#include "int8_tiles.cuh"

namespace fp4attn_cuda {
namespace {

using namespace sm90;

template <int DP>
struct Sm90Config {
  static constexpr int kConsumers = DP <= 128 ? 3 : 2; /* consumer warpgroups */
  static constexpr int kConsumerThreads = 128 * kConsumers;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kRows = kConsumers * kBQ8; /* query rows per block: a Q^ block each */
  /* P.V follows its own tile's softmax: 160 registers (3 consumers), or O's 128 at head dim 256,
   * leave no room for S_{j+1} beside O and P, which FA3's overlap of P_j V_j with S_{j+1} needs.
   * The consumers' turns keep the tensor cores busy instead. */
  static constexpr int kStages = DP == 256 ? 2 : 4; /* 256: 2 stages of 96 KB */
  /* Q^ and K^ rows as slabs of kSlab bytes, the swizzle's width (TMA boxes and wgmma operands
   * swizzle at most 128 bytes): [DP / kSlab][rows][kSlab] */
  static constexpr int kSlab = DP < 128 ? DP : 128;
  static constexpr int kQBytes = kRows * DP;    /* Q^ [DP / kSlab][kRows][kSlab] */
  static constexpr int kKBytes = kBK8 * DP;     /* K^ [DP / kSlab][128][kSlab] */
  static constexpr int kVBytes = 2 * DP * kBK8; /* V16 tile or rows, 16 bits */
  /* shared memory from a 1024-byte boundary (the swizzled tiles' alignment) */
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKBytes;
  static constexpr int kOffBar = kOffV + kStages * kVBytes; /* full[S], empty[S], qfull, qempty */
  static constexpr int kOffItem = kOffBar + (2 * kStages + 2) * 8; /* the item Q^ holds (int64) */
  static constexpr int kBytes = kOffItem + 8;
  /* 1023 bytes to align the dynamic shared memory where they fit in 227 KB (at every head dim
   * now: 229,432 bytes at 256); otherwise the kernel checks that the base is aligned */
  static constexpr int kMaxSmem = 227 * 1024;
  static constexpr int kAlignSlack = kBytes + 1023 <= kMaxSmem ? 1023 : 0;
  static constexpr int kSmem = kBytes + kAlignSlack;
  static_assert(kSmem <= kMaxSmem, "227 KB of shared memory per block");
};

/* Kernel parameters: the 8-bit arguments and this call's TMA maps of Q^ {DP, nqp, BHq}, K^ {DP,
 * nkp, BHk}, V16's tiles {256, nkb x DP, BHk} (bytes, innermost first) or rows (16-bit words,
 * int8_v16_rows). */
struct Int8Sm90Params {
  Int8Args a;
  CUtensorMap qmap, kmap, vmap;
};

/* The development timeline (sm90/trace_events.h, tools/perf/trace_sm90.cu --int8): stamps per
 * item where FP4ATTN_SM90_TRACE is defined, nothing otherwise. */
#if defined(FP4ATTN_SM90_TRACE)
__device__ TraceRow g_int8_trace[kTraceItems];
#endif
#define INT8_TRACE_AT(cond, item, ev) FP4ATTN_SM90_TRACE_INTO(g_int8_trace, cond, item, ev)

#if defined(FP4ATTN_SM90_WGMMA)

/* Named barriers (0 is __syncthreads): the consumers' turns at issuing wgmma, one per consumer;
 * the consumer before it in the ring arrives, it syncs (2 x 128 threads). */
constexpr int kBarTurn = 1;
constexpr int kTurnCount = 256;

/* Item x: kRows query rows (item qi of (batch, query head) bh; bhk its KV head). Causal calls
 * longest first across all heads, otherwise head-major (items taken together share K^ and V's
 * tiles in L2), as forward.cu orders its blocks. */
struct Int8Item {
  int64_t b, h, bh, bhk, qi;
};
__device__ __forceinline__ Int8Item int8_item(const fp4attn_attention_params &p, int64_t nqi,
                                              int64_t x) {
  const int64_t bhq = p.batch * p.heads_q;
  Int8Item it;
  it.bh = p.causal ? x % bhq : x / nqi;
  it.qi = p.causal ? nqi - 1 - x / bhq : x % nqi;
  it.b = it.bh / p.heads_q;
  it.h = it.bh % p.heads_q;
  it.bhk = it.b * p.heads_kv + it.h / (p.heads_q / p.heads_kv);
  return it;
}

/* The block's mbarriers (8 bytes each, from Sm90Config::kOffBar): "full" per stage (the
 * producer's arrival and the stage's bytes), "empty" per stage (every consumer thread), Q^ full
 * (the producer's arrival, the item number written, and Q^'s bytes), Q^ empty (every consumer
 * thread, once its item's last S has completed). */
template <int kStages>
struct Int8Bars {
  uint32_t base;
  __device__ uint32_t full(int s) const { return base + 8 * s; }
  __device__ uint32_t empty(int s) const { return base + 8 * (kStages + s); }
  __device__ uint32_t qfull() const { return base + 16 * kStages; }
  __device__ uint32_t qempty() const { return base + 16 * kStages + 8; }
};

/* kPersistent: one block per SM taking items in turn, else one block per item */
template <int DP, bool kBf16, bool kVRows, bool kPersistent>
struct Int8Sm90 {
  using C = Sm90Config<DP>;
  /* setmaxnreg split of the registers the launch gives the block (kThreads x kLaunchRegs), which
   * it only moves between warpgroups: the producer only issues copies (and, persistent, takes
   * items) */
  static constexpr int kLaunchRegs = 65536 / C::kThreads / 8 * 8;
  static constexpr int kProducerRegs = kPersistent ? 32 : 24;
  static constexpr int kConsumerRegs = C::kConsumers == 3 ? 160 : 240;
  static_assert(128 * (kProducerRegs + C::kConsumers * kConsumerRegs) <= C::kThreads * kLaunchRegs,
                "setmaxnreg cannot take more registers than the block was launched with");
  static constexpr int kSteps = DP / 32;           /* k32 steps of S */
  static constexpr int kSlabSteps = C::kSlab / 32; /* of them per slab */

  /* The item number in shared memory (written by the producer before its Q^ arrival), -1 once
   * there are no more. */
  static __device__ __forceinline__ volatile int64_t *item_slot(char *tiles) {
    return reinterpret_cast<volatile int64_t *>(tiles + C::kOffItem);
  }

  static __device__ void producer(const Int8Sm90Params &prm, char *tiles, int64_t nqi,
                                  int64_t items) {
    const Int8Args &a = prm.a;
    const fp4attn_attention_params &p = a.p;
    const Int8Workspace &w = a.ws;
    const Int8Bars<C::kStages> bar{smem_u32(tiles + C::kOffBar)};
    /* the item's TMA coordinates (32 bits: the launcher bounds them; the producer has few
     * registers): (batch, KV head) as one index and as two, its first row, (batch, query head) */
    int bhk, b, hk, q0, bh;
    /* the item's tile j into the ring's g-th stage use, once the tile before there is released */
    const auto load_tile = [&](int j, uint32_t g) {
      const int s = (int)(g % C::kStages);
      if (g >= (uint32_t)C::kStages) mbar_wait(bar.empty(s), ((g / C::kStages) - 1) & 1);
      mbar_expect_tx(bar.full(s), C::kKBytes + C::kVBytes);
      for (int x = 0; x < DP; x += C::kSlab)
        tma_load_3d(smem_u32(tiles + C::kOffK + s * C::kKBytes) + x * kBK8, &prm.kmap, x, j * kBK8,
                    bhk, bar.full(s));
      const uint32_t vs = smem_u32(tiles + C::kOffV + s * C::kVBytes);
      if constexpr (kVRows)
        for (int x = 0; x < DP; x += 64) /* V16's columns x ..: [128 keys][64] */
          tma_load_4d(vs + x * 2 * kBK8, &prm.vmap, x, j * kBK8, hk, b, bar.full(s));
      else
        for (int cb = 0; cb < 2; ++cb) /* keys cb * 64 ..: [DP][64] */
          tma_load_3d(vs + cb * DP * 128, &prm.vmap, cb * 128, j * DP, bhk, bar.full(s));
      mbar_arrive(bar.full(s));
    };

    /* item x's coordinates; returns its tile count */
    const auto take = [&](int64_t x) {
      const Int8Item it = int8_item(p, nqi, x);
      bhk = (int)it.bhk, b = (int)it.b, hk = (int)(it.bhk - it.b * p.heads_kv);
      q0 = (int)(it.qi * C::kRows), bh = (int)it.bh;
      return tile_count(p, w, it.qi);
    };
    const auto load_q = [&]() {
      mbar_expect_tx(bar.qfull(), C::kQBytes);
      for (int c = 0; c < DP; c += C::kSlab)
        tma_load_3d(smem_u32(tiles + C::kOffQ) + c * C::kRows, &prm.qmap, c, q0, bh, bar.qfull());
      mbar_arrive(bar.qfull());
    };

    if constexpr (!kPersistent) { /* the block's item: Q^ first, which the first S needs */
      const int ntiles = take(blockIdx.x);
      load_q();
      for (int j = 0; j < ntiles; ++j) load_tile(j, j);
      return;
    }
    uint32_t g = 0; /* tiles loaded by this block */
    int n = 0;      /* items taken by this block */
    for (int64_t x = blockIdx.x; x < items; ++n) {
      const int ntiles = take(x);
      /* the item's first tiles into stages the last item has released, then Q^ once the
       * consumers' last S has read the previous one */
      const int ahead = min(ntiles, C::kStages - 1);
      for (int j = 0; j < ahead; ++j) load_tile(j, g + j);
      if (n > 0) mbar_wait(bar.qempty(), (n - 1) & 1);
      *item_slot(tiles) = x;
      load_q();
      for (int j = ahead; j < ntiles; ++j) load_tile(j, g + j);
      g += ntiles;
      x = (int64_t)gridDim.x + atomicAdd(w.next_item, 1u);
    }
    if (n > 0) mbar_wait(bar.qempty(), (n - 1) & 1);
    *item_slot(tiles) = -1;
    mbar_arrive(bar.qfull());
  }

  /* Key tiles of item qi: all of them, or with causal masking those up to its last row's key. */
  static __device__ __forceinline__ int tile_count(const fp4attn_attention_params &p,
                                                   const Int8Workspace &w, int64_t qi) {
    int64_t n = w.nkb;
    if (p.causal) n = min(n, (min((qi + 1) * C::kRows, p.len_q) - 1) / kBK8 + 1);
    return (int)n;
  }

  /* The consumers: the block's item, or (kPersistent) items until the producer's -1. The ring of
   * turns runs on across items (every consumer issues the same S steps); consumer 0 takes the
   * last hand-over at the end. */
  static __device__ void consumer(const Int8Sm90Params &prm, char *tiles, int64_t nqi) {
    if constexpr (kPersistent) {
      const int cwg = (threadIdx.x - 128) >> 7;
      const Int8Bars<C::kStages> bar{smem_u32(tiles + C::kOffBar)};
      if (cwg == C::kConsumers - 1) named_arrive(kBarTurn, kTurnCount); /* consumer 0 first */
      uint32_t g = 0; /* tiles consumed by this block */
      for (int n = 0;; ++n) {
        mbar_wait(bar.qfull(), n & 1);
        const int64_t x = *item_slot(tiles);
        if (x < 0) break;
        g = consume_item(prm, tiles, int8_item(prm.a.p, nqi, x), x, g);
      }
      if (cwg == 0) named_sync(kBarTurn, kTurnCount);
    } else {
      consume_item(prm, tiles, int8_item(prm.a.p, nqi, blockIdx.x), blockIdx.x, 0);
    }
  }

  /* One item (number x), its tiles from the ring's g-th stage use on; returns the use after its
   * last. Persistent, its Q^ has landed and the turns run on; else the block's only item: it starts
   * the ring of turns, waits for Q^ once its state is set up, and takes the last hand-over. */
  static __device__ __forceinline__ uint32_t consume_item(const Int8Sm90Params &prm, char *tiles,
                                                          const Int8Item &it, int64_t x,
                                                          uint32_t g) {
    const Int8Args &a = prm.a;
    const fp4attn_attention_params &p = a.p;
    const Int8Workspace &w = a.ws;
    const int ctid = threadIdx.x - 128, cwg = ctid >> 7, wwarp = (ctid >> 5) & 3;
    (void)x;                                        /* the item's number: its row of the trace */
    const int64_t qb = C::kConsumers * it.qi + cwg; /* its Q^ block (past nqb: padding rows) */
    const int ntiles = tile_count(p, w, it.qi);
    const WarpRows rows{it.b, it.h, qb * kBQ8 + wwarp * 16};
    const Int8Bars<C::kStages> bar{smem_u32(tiles + C::kOffBar)};
    /* k32 step kk of this consumer's Q^ rows and of stage s's K^: slab kk / kSlabSteps */
    const auto q_desc = [&](int kk) {
      const int x = kk / kSlabSteps * C::kSlab;
      return kmajor_desc<C::kSlab>(smem_u32(tiles + C::kOffQ) + x * C::kRows +
                                   cwg * kBQ8 * C::kSlab) +
             2 * (kk % kSlabSteps);
    };
    const auto k_desc = [&](int s, int kk) {
      const int x = kk / kSlabSteps * C::kSlab;
      return kmajor_desc<C::kSlab>(smem_u32(tiles + C::kOffK + s * C::kKBytes) + x * kBK8) +
             2 * (kk % kSlabSteps);
    };
    const auto turn_begin = [&]() { named_sync(kBarTurn + cwg, kTurnCount); };
    const auto turn_end = [&]() { named_arrive(kBarTurn + (cwg + 1) % C::kConsumers, kTurnCount); };
    if constexpr (!kPersistent)
      if (cwg == C::kConsumers - 1) turn_end(); /* consumer 0 issues first */

    const float sq = qb < w.nqb ? w.sq[it.bh * w.nqb + qb] : 0.0f;
    float o[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; /* l: this thread's partial sums */
    float alpha[2] = {0.0f, 0.0f}; /* the tile's rescale of O (its P.V follows its softmax) */
    uint32_t pa[8][4];             /* P16 of the tile: A fragments of its 8 k16 steps */

    /* every consumer thread, once its reads of stage s are done (its own reads are ordered) */
    const auto release = [&](int s) { mbar_arrive(bar.empty(s)); };
    /* O = alpha O + P16 V16 of stage s: O rescaled in registers (once the row maxima settle,
     * alpha is exactly 1 in every row of the warp: skipped), then accumulated by the wgmma */
    const auto issue_pv = [&](int s) {
      if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f))
#pragma unroll
        for (int n = 0; n < DP / 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e >> 1];
      const uint32_t vs = smem_u32(tiles + C::kOffV + s * C::kVBytes);
      wgmma_fence();
      if constexpr (kVRows) {
        /* keys 16 kb ..: + 16 x 128 bytes; the next 64 columns a slab (128 x 128 bytes) on */
        const uint64_t v0 = mnmajor_sw128_desc(vs, kBK8 * 128);
#pragma unroll
        for (int kb = 0; kb < 8; ++kb)
          wgmma_rs_acc_k16<DP, kBf16, true>(o, pa[kb], v0 + kb * (16 * 128 >> 4));
      } else {
        /* keys 16 kb ..: slab kb / 4, + 32 bytes per k16 step inside it */
        const uint32_t v_lo = sw128_desc_lo(vs);
#pragma unroll
        for (int kb = 0; kb < 8; ++kb)
          wgmma_rs_acc_k16<DP, kBf16>(o, pa[kb],
                                      sw128_desc(v_lo + (kb >> 2) * (DP * 8) + (kb & 3) * 2));
      }
      wgmma_commit();
    };

    /* S of the current tile: exact int32 products, or (tile_stats on a masked tile) the bits of
     * its FP32 scores in log2 units, masked: one register array for both */
    int acc[16][4];
    bool scores_in_acc = false; /* which of the two acc holds */
    float f = 0.0f;             /* the tile's score factor sQ sK scale log2(e) */
    float shift[2];             /* m - log2(448): W = exp2(S - shift) */
    const bool general_mask = p.mask_kind != FP4ATTN_MASK_NONE;
    const auto issue_scores = [&](int s) {
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk)
        wgmma_ss_m64n128k32_s8(acc, q_desc(kk), k_desc(s, kk), kk > 0);
    };
    /* Tile j's row maxima and online-softmax factors. A tile without masks and with f >= 0 takes
     * its row maxima on the integers (f x is increasing in x, and FP32 rounding keeps that
     * order) and leaves acc as it is; a masked tile gets its scores scaled and masked in acc. */
    const auto tile_stats = [&](int j, float sk_pre) {
      const float sk = kPersistent ? sk_pre : w.sk[it.bhk * w.nkb + j];
      f = ((sq * sk) * p.scale) * kLog2e;
      const int64_t j0 = (int64_t)j * kBK8;
      scores_in_acc = tile_has_masks(p, j0, rows.row0) || !(f >= 0.0f);
      float tr2[2];
      if (scores_in_acc) {
        float sc[16][4];
#pragma unroll
        for (int n = 0; n < 16; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[n][e] = (float)acc[n][e] * f;
        if (!general_mask)
          mask_causal_tail(p, rows, j0, sc);
        else
          mask_general(p, rows, j0, sc);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float x = -INFINITY;
#pragma unroll
          for (int n = 0; n < 16; ++n) x = fmaxf(x, fmaxf(sc[n][2 * r], sc[n][2 * r + 1]));
          tr2[r] = quad_max(x);
        }
#pragma unroll
        for (int n = 0; n < 16; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[n][e] = __float_as_int(sc[n][e]);
      } else {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          int x = INT_MIN;
#pragma unroll
          for (int n = 0; n < 16; ++n) x = max(x, max(acc[n][2 * r], acc[n][2 * r + 1]));
          x = max(x, __shfl_xor_sync(0xffffffffu, x, 1));
          x = max(x, __shfl_xor_sync(0xffffffffu, x, 2));
          tr2[r] = (float)x * f;
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_new = fmaxf(m[r], tr2[r]);
        alpha[r] = m[r] == -INFINITY ? 0.0f : fast_exp2(m[r] - m_new);
        m[r] = m_new;
        /* a row with nothing visible yet has S = -inf: W = 0 */
        shift[r] = m_new == -INFINITY ? 0.0f : m_new - kLog2_448;
      }
    };
    /* P16 = fl16(W) of the tile into pa, W = exp2(S - shift) = 448 exp2(S - m), and l */
    const auto make_p = [&]() {
      float rowsum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int kb = 0; kb < 8; ++kb) {
        float wt[2][4];
#pragma unroll
        for (int q = 0; q < 2; ++q)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int a_ne = acc[2 * kb + q][e];
            const float x = scores_in_acc ? __int_as_float(a_ne) - shift[e >> 1]
                                          : fmaf((float)a_ne, f, -shift[e >> 1]);
            wt[q][e] = fast_exp2(x);
            rowsum[e >> 1] += wt[q][e];
          }
        /* the A fragment of k16 step kb: accumulator tiles 2 kb, 2 kb + 1 (m16n8k16's layout) */
#pragma unroll
        for (int q = 0; q < 4; ++q)
          pa[kb][q] = pack16x2<kBf16>(wt[q >> 1][2 * (q & 1)], wt[q >> 1][2 * (q & 1) + 1]);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) l[r] = alpha[r] * l[r] + rowsum[r];
    };

    /* S_j (issued in this consumer's turn) from stage s, its softmax and P16; (kPersistent) Q^
     * released after the item's last S, and sK_j loaded before the waits, off the chain from S
     * to its softmax (the one-item kernels read it in tile_stats: their measured schedule) */
    const auto scores_and_p = [&](int j, int s, uint32_t parity) {
      float sk = 0.0f;
      if constexpr (kPersistent) sk = w.sk[it.bhk * w.nkb + j];
      mbar_wait(bar.full(s), parity);
      INT8_TRACE_AT(ctid == 0 && j == 0, x, kTrFull0);
      turn_begin();
      INT8_TRACE_AT(ctid == 0 && j == 0, x, kTrS0Issue);
      wgmma_fence();
      issue_scores(s);
      wgmma_commit();
      turn_end();
      wgmma_wait<0>();
      fence_regs(acc);
      INT8_TRACE_AT(ctid == 0 && j == 0, x, kTrS0);
      if constexpr (kPersistent)
        if (j == ntiles - 1) mbar_arrive(bar.qempty());
      tile_stats(j, sk);
      make_p();
      INT8_TRACE_AT(ctid == 0 && j == 0, x, kTrTile0);
    };

    if constexpr (!kPersistent) mbar_wait(bar.qfull(), 0);
    INT8_TRACE_AT(ctid == 0, x, kTrQReady);
    /* per tile: S, its softmax, then P.V; the other consumers' wgmma run while this one
     * computes */
    for (int j = 0; j < ntiles; ++j) {
      const uint32_t u = g + j;
      const int s = (int)(u % C::kStages);
      scores_and_p(j, s, (u / C::kStages) & 1);
      issue_pv(s);
      wgmma_wait<0>();
      fence_regs(o);
      release(s);
      INT8_TRACE_AT(ctid == 0 && j == ntiles - 1, x, kTrLastPv);
    }
    if constexpr (!kPersistent)
      if (cwg == 0) turn_begin(); /* the last consumer's last hand-over */
    store_forward_rows<DP>(p, w, rows, it.bh, o, m, l);
    INT8_TRACE_AT(ctid == 0, x, kTrEnd);
    INT8_TRACE_AT(ctid == 0, x, kTrSm);
    INT8_TRACE_AT(ctid == 0, x, kTrEndNs);
    INT8_TRACE_AT(ctid == C::kConsumerThreads - 128, x, kTrEndLast);
    return g + ntiles;
  }

  static __device__ void run(const Int8Sm90Params &prm, char *smem) {
    const int64_t nqi = (prm.a.p.len_q + C::kRows - 1) / C::kRows;      /* items per query head */
    if (C::kAlignSlack == 0 && (smem_u32(smem) & 1023u) != 0) __trap(); /* see Sm90Config */
    char *tiles = smem + ((1024u - (smem_u32(smem) & 1023u)) & 1023u);
    INT8_TRACE_AT(threadIdx.x == 0, blockIdx.x, kTrStart);
    INT8_TRACE_AT(threadIdx.x == 0, blockIdx.x, kTrStartNs);
    if (threadIdx.x == 0) {
      const Int8Bars<C::kStages> bar{smem_u32(tiles + C::kOffBar)};
      for (int s = 0; s < C::kStages; ++s) {
        mbar_init(bar.full(s), 1);
        mbar_init(bar.empty(s), C::kConsumerThreads);
      }
      mbar_init(bar.qfull(), 1);
      if constexpr (kPersistent) mbar_init(bar.qempty(), C::kConsumerThreads);
      mbar_init_fence();
    }
    __syncthreads();
    grid_dependency_wait(); /* the preparation's operands */
    INT8_TRACE_AT(threadIdx.x == 0, blockIdx.x, kTrDepWait);
    if (threadIdx.x < 128) {
      regs_dealloc<kProducerRegs>();
      if (threadIdx.x == 0) producer(prm, tiles, nqi, prm.a.p.batch * prm.a.p.heads_q * nqi);
    } else {
      regs_alloc<kConsumerRegs>();
      consumer(prm, tiles, nqi);
    }
  }
};

#endif /* FP4ATTN_SM90_WGMMA */

template <int DP, bool kBf16, bool kVRows, bool kPersistent>
__global__ void __launch_bounds__(Sm90Config<DP>::kThreads, 1)
    int8_forward_sm90_kernel(const __grid_constant__ Int8Sm90Params prm) {
#if defined(FP4ATTN_SM90_WGMMA)
  extern __shared__ __align__(16) char smem[];
  Int8Sm90<DP, kBf16, kVRows, kPersistent>::run(prm, smem);
#else
  __trap(); /* never launched: the dispatch picks this kernel only for sm_90a builds on CC 9.0 */
#endif
}

template <int DP, bool kBf16, bool kVRows, bool kPersistent>
fp4attn_status launch_kernel(const Int8Sm90Params &prm, int64_t blocks, cudaStream_t s);

/* The kernel for the call's 16-bit type (SPEC_INT8 2.2: V16 is BF16 unless the inputs are FP16),
 * V16 layout and item count. */
template <int DP, bool kBf16, bool kVRows>
fp4attn_status launch_typed(const Int8Args &a, cudaStream_t s) {
  static_assert(DP == 64 || DP == 128 || DP == 256,
                "the sm90 8-bit forward serves padded head dims 64, 128 and 256");
  using C = Sm90Config<DP>;
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  Int8Sm90Params prm;
  prm.a = a;
  const cuuint64_t bhq = (cuuint64_t)(p.batch * p.heads_q),
                   bhk = (cuuint64_t)(p.batch * p.heads_kv);
  const cuuint64_t qdims[3] = {(cuuint64_t)DP, (cuuint64_t)w.nqp, bhq};
  const cuuint64_t qstrides[2] = {(cuuint64_t)DP, (cuuint64_t)(w.nqp * DP)};
  fp4attn_status st = encode_byte_map(prm.qmap, w.qc, qdims, qstrides, C::kSlab, C::kRows, "Q^");
  if (st.code != FP4ATTN_OK) return st;
  const cuuint64_t kdims[3] = {(cuuint64_t)DP, (cuuint64_t)w.nkp, bhk};
  const cuuint64_t kstrides[2] = {(cuuint64_t)DP, (cuuint64_t)(w.nkp * DP)};
  st = encode_byte_map(prm.kmap, w.kc, kdims, kstrides, C::kSlab, kBK8, "K^");
  if (st.code != FP4ATTN_OK) return st;
  if constexpr (kVRows) {
    const Int8Rows16 v = int8_v16_rows(a);
    st = encode_rows16_map(prm.vmap, v.base, v.dims, v.strides, kBK8, "V16");
  } else { /* rows of 128 keys as 256 bytes; boxes of 64 keys x DP rows */
    const cuuint64_t vdims[3] = {(cuuint64_t)(2 * kBK8), (cuuint64_t)(w.nkb * DP), bhk};
    const cuuint64_t vstrides[2] = {(cuuint64_t)(2 * kBK8), (cuuint64_t)(w.nkb * DP * 2 * kBK8)};
    st = encode_byte_map(prm.vmap, w.vt16, vdims, vstrides, 128, DP, "V16");
  }
  if (st.code != FP4ATTN_OK) return st;

  const int64_t items = p.batch * p.heads_q * ceil_div(p.len_q, (int64_t)C::kRows);
  if (items > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "int8 attention: too many query blocks");
  if (w.nkb * DP > 0x7FFFFFFFLL || w.nqp > 0x7FFFFFFFLL || w.nkp > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "int8 attention (sm90 kernel): sequences too long for TMA coordinates");
  /* Persistent blocks from two waves of items on, at head dim 128: measured faster there and
   * nowhere else (docs/performance.md, section 4) */
  if constexpr (DP == 128)
    if (items >= 2 * (int64_t)sm_count())
      return launch_kernel<DP, kBf16, kVRows, true>(prm, sm_count(), s);
  return launch_kernel<DP, kBf16, kVRows, false>(prm, items, s);
}

template <int DP, bool kBf16, bool kVRows, bool kPersistent>
fp4attn_status launch_kernel(const Int8Sm90Params &prm, int64_t blocks, cudaStream_t s) {
  using C = Sm90Config<DP>;
  static int configured[64] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64 || !configured[dev]) {
    if (cudaFuncSetAttribute(int8_forward_sm90_kernel<DP, kBf16, kVRows, kPersistent>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem) != cudaSuccess)
      return launch_status("int8 attention forward (sm90 kernel)");
    /* without alignment slack the tiles start at the dynamic shared memory's base, which is
     * 1024-aligned only while the kernel has no static shared memory (the kernel traps otherwise)
     */
    cudaFuncAttributes attr{};
    if (C::kAlignSlack == 0 &&
        (cudaFuncGetAttributes(&attr, int8_forward_sm90_kernel<DP, kBf16, kVRows, kPersistent>) !=
             cudaSuccess ||
         attr.sharedSizeBytes != 0))
      return fp4attn_error(
          FP4ATTN_ERR_UNSUPPORTED,
          "int8 attention (sm90 kernel, head dim %d): the kernel has static shared "
          "memory, which misaligns its tiles",
          DP);
    if (dev >= 0 && dev < 64) configured[dev] = 1;
  }
  launch_dependent(int8_forward_sm90_kernel<DP, kBf16, kVRows, kPersistent>, dim3((unsigned)blocks),
                   dim3(C::kThreads), C::kSmem, s, prm);
  return launch_status("int8 attention forward (sm90 kernel)");
}

}  // namespace

#if defined(FP4ATTN_SM90_TRACE)
/* Development only (tools/perf/trace_sm90.cu --int8): copy out `items` rows of the 8-bit
 * forward's timeline, then clear it for the next call. Returns 0 on success. */
extern "C" int fp4attn_int8_sm90_trace_take(unsigned long long *host, int items) {
  return trace_take(g_int8_trace, host, items);
}
#endif

template <int DP>
fp4attn_status launch_int8_forward_sm90(const Int8Args &a, cudaStream_t s) {
  if (a.ws.v_tiles) {
    if constexpr (DP == 256) /* the plan reads V16 by rows there (heuristics.h) */
      return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                           "int8 attention (sm90 kernel): head dim 256 reads V16 by rows");
    else
      return a.bf16_ops ? launch_typed<DP, true, false>(a, s)
                        : launch_typed<DP, false, false>(a, s);
  }
  return a.bf16_ops ? launch_typed<DP, true, true>(a, s) : launch_typed<DP, false, true>(a, s);
}

template fp4attn_status launch_int8_forward_sm90<64>(const Int8Args &, cudaStream_t);
template fp4attn_status launch_int8_forward_sm90<128>(const Int8Args &, cudaStream_t);
template fp4attn_status launch_int8_forward_sm90<256>(const Int8Args &, cudaStream_t);

}  // namespace fp4attn_cuda
