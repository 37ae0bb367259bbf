/*
 * 8-bit attention backward (docs/SPEC_INT8.md 3) for Hopper (sm_90a) on wgmma: the numbers of the
 * mma.sync kernel (backward.cuh), with the matrix work on warpgroup MMA and the loads on TMA.
 *
 * One block = one 128-key block j of one (batch, KV head), 3 warpgroups:
 *   warpgroup 0, producer (setmaxnreg down): one thread has the TMA load the key block's K^, V and
 *     Ks16^T (16 bits) once, then per 64-row query block i of the KV head's query heads (causal:
 *     those that see key block j) Q^, Q16, dO (16 bits), lse2 and Drow into a ring of kStages
 *     stages ("full" / "empty" mbarriers); warps 1 and 2 add consumer 0's and 1's dQ tiles into
 *     the workspace (dq_writer).
 *   warpgroups 1 and 2, consumers (setmaxnreg up): 64 keys each (wgmma's M), per query block:
 *     S^T  = K^ Q^T            wgmma m64n64k32 s8 (shared x shared), exact int32
 *     dP^T = V dO^T            wgmma m64n64k16 f16 / bf16, FP32
 *     P^T  = exp2(S^T f - lse2), dS^T = P^T (dP^T - Drow) in registers (accumulator layout)
 *     dV  += P16^T dO16        wgmma m64n{DP}k16, P16 from registers, dO as the MN-major B
 *     dK  += dS16^T Q16        the same with dS16 and Q16
 *     dQ_i += dS16 Ks16        wgmma m64n{DP/2}k16: this consumer's DP/2 columns over the block's
 *       128 keys, dS16^T of both consumers through shared memory (the MN-major A), Ks16^T the
 *       K-major B; handed to its writer warp as a shared FP32 tile, which that warp adds into
 *       the workspace by TMA reductions (finish_dq applies the softmax scale)
 *   The consumers share the stage ring and the dS16^T tile, double-buffered by step parity: each
 *   consumer issues step i's dQ product after step i + 1's dK, once the other has marked its half
 *   written (mbarriers ds_ready, per consumer and buffer), and marks the buffer read (ds_read),
 *   which the other waits for before writing it again; no barrier holds the two in step.
 *   Splitting dQ by columns rather than keys halves its reduction traffic, which with the stage
 *   loads bounds the step (docs/performance.md).
 * dK and dV stay in FP32 wgmma accumulators for the whole walk and are stored once, in the input
 * dtype (dK times the scale).
 * dQ's key blocks add in any order by default. `deterministic` fixes it (BwdWalk::rank): before
 * its reductions for query block i a writer waits until the key blocks before its own in that
 * order have counted themselves in dq_sem, and counts itself once its reductions are complete.
 * Every wait is on a block of the same head launched earlier (blocks start in index order, as
 * serial split-K reductions assume), so the waits cannot deadlock.
 * Operand layouts (wgmma.cuh): 8-bit tiles K-major, swizzled over their row width (Q^, K^: DP
 * bytes); 16-bit V, Ks16^T, Q16 and dO as column blocks of 128-byte rows with the 128-byte swizzle
 * (dO read K-major by dP's product, MN-major by dV's; Ks16^T [2][DP channels][64 keys]), the
 * dS16^T tile [128 keys][64 rows].
 */
#include "../sm90/tensor_maps.h"
#include "../sm90/wgmma.cuh"
#include "attention_int8.h"
#include "int8_tiles.cuh"

namespace fp4attn_cuda {
namespace {

using namespace sm90;

constexpr int kThreads = 384;         /* producer + 2 consumer warpgroups */
constexpr int kConsumerThreads = 256; /* the empty barriers' count */
constexpr int kWgKeys = kBK8 / 2;     /* keys per consumer warpgroup */

template <int DP>
struct BwdSm90Config {
  static constexpr int kStages = 2;
  /* the key block's tiles, loaded once */
  static constexpr int kKBytes = kBK8 * DP;           /* K^ [128][DP] */
  static constexpr int kVBytes = kBK8 * DP * 2;       /* V [DP/64][128][64] 16-bit */
  static constexpr int kKsBytes = kVBytes;            /* Ks16^T [2][DP][64 keys] 16-bit */
  static constexpr int kDsBytes = kWgKeys * kBQ8 * 2; /* dS16^T [64 keys][64 rows] per consumer */
  static constexpr int kDqCols = DP / 2;              /* dQ columns per consumer */
  static constexpr int kDqBytes = kBQ8 * kDqCols * 4; /* its FP32 dQ tile [DP/64][64 rows][32] */
  /* one query block's tiles (a stage) */
  static constexpr int kQBytes = kBQ8 * DP;       /* Q^ [64][DP] */
  static constexpr int kQ16Bytes = kBQ8 * DP * 2; /* Q16 [DP/64][64][64] 16-bit */
  static constexpr int kDoBytes = kBQ8 * DP * 2;  /* dO [DP/64][64][64] 16-bit */
  static constexpr int kTileBytes = kQBytes + kQ16Bytes + kDoBytes;
  static constexpr int kVecBytes = 2 * kBQ8 * 4; /* lse2 [64], Drow [64] */
  /* shared memory from a 1024-byte boundary (every tile a multiple of 1024 bytes) */
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKBytes;
  static constexpr int kOffKs = kOffV + kVBytes;
  static constexpr int kOffDs = kOffKs + kKsBytes;
  static constexpr int kOffDq = kOffDs + 2 * 2 * kDsBytes; /* two buffers of both consumers' */
  static constexpr int kOffStage = kOffDq + 2 * kDqBytes;
  static constexpr int sQ = 0, sQ16 = sQ + kQBytes, sDo = sQ16 + kQ16Bytes;
  static constexpr int kOffVec = kOffStage + kStages * kTileBytes;
  static constexpr int vLse = 0, vDrow = kBQ8 * 4;
  /* mbarriers: full[S], empty[S], kfull, then the consumers' dS16^T hand-offs ready[2][2] and
   * read[2][2] ([consumer][buffer]) */
  static constexpr int kOffBar = kOffVec + kStages * kVecBytes;
  static constexpr int kBytes = kOffBar + (2 * kStages + 1 + 8) * 8;
  static constexpr int kSmem = kBytes + 1023;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(kProducerRegs + 2 * kConsumerRegs == 3 * 168, "setmaxnreg split of 168 x 384");
  static_assert(kTileBytes % 1024 == 0, "stage tiles stay 1024-byte aligned");
  static_assert(kSmem <= 227 * 1024, "227 KB of shared memory per block");
};

/* Kernel parameters: the 8-bit arguments and this call's TMA maps (bytes, innermost first) of
 * K^ {DP, nkp, BHk}, V (int8_v16_rows), Ks16^T {256, nkb DP, BHk}, Q^ {DP, nqp, BHq}, Q16 and dO
 * {2 DP, nqp, BHq}. */
struct Int8BwdSm90Params {
  Int8Args a;
  CUtensorMap kmap, vmap, ksmap, qmap, q16map, domap, dqmap;
  bool longest_first; /* the block order (BwdWalk) */
  bool deterministic; /* dQ's key blocks added in BwdWalk::rank's order */
};

#if defined(FP4ATTN_SM90_WGMMA)

/* named barriers (the consumers' dS16^T hand-offs are mbarriers, BwdBars) */
constexpr int kBarDqFull = 2;  /* 2, 3: consumer 0's, 1's dQ tile written (consumer -> writer) */
constexpr int kBarDqEmpty = 4; /* 4, 5: ... and read by its reductions (writer -> consumer) */
constexpr int kDqBarThreads = 128 + 32; /* a consumer warpgroup and its writer warp */

template <int kStages>
struct BwdBars {
  uint32_t base;
  __device__ uint32_t full(int s) const { return base + 8 * s; }
  __device__ uint32_t empty(int s) const { return base + 8 * (kStages + s); }
  __device__ uint32_t kfull() const { return base + 16 * kStages; }
  /* consumer c's half of dS16^T buffer b is written / both halves of it have been read by c */
  __device__ uint32_t ds_ready(int c, int b) const {
    return base + 16 * kStages + 8 * (1 + 2 * c + b);
  }
  __device__ uint32_t ds_read(int c, int b) const {
    return base + 16 * kStages + 8 * (5 + 2 * c + b);
  }
};

/* The walk of one key block: its (batch, KV head), the first query block that sees it, and the
 * query blocks per query head of the group (the producer, the consumers and the writers agree on
 * it). */
struct BwdWalk {
  /* 32 bits: the launcher bounds the block counts (and the producer's registers are few) */
  int b, hk, bhk, j, i_start, per_head, G, nkb, iters;
  int rot; /* the first query block's offset from i_start */
  bool causal;
  /* Block order: a head's key blocks side by side, so that they share its Q^, dO and dQ in L2;
   * or, longest_first (causal grids of a few waves, launch_int8_backward_sm90), key block 0 of
   * every head, then 1, ...: the longest walks first, short ones in the last wave. `ordered`
   * (deterministic dQ): head-major, each head's key blocks in rank's order. */
  __device__ BwdWalk(const fp4attn_attention_params &p, const Int8Workspace &w, bool longest_first,
                     bool ordered)
      : nkb((int)w.nkb), causal(p.causal) {
    const int heads = (int)(p.batch * p.heads_kv), nqb = (int)w.nqb;
    j = longest_first ? (int)blockIdx.x / heads : (int)blockIdx.x % nkb;
    if (ordered) j = (int)dq_key_block(p.causal, nkb, j);
    bhk = longest_first ? (int)blockIdx.x % heads : (int)blockIdx.x / nkb;
    b = bhk / (int)p.heads_kv;
    hk = bhk % (int)p.heads_kv;
    G = (int)(p.heads_q / p.heads_kv);
    i_start = p.causal ? min(nqb, j * (kBK8 / kBQ8)) : 0;
    per_head = nqb - i_start;
    iters = G * per_head;
    /* key blocks start apart, so that their dQ reductions go to different rows, unless ordered */
    rot = ordered || per_head == 0 ? 0 : j % per_head;
  }
  __device__ void block(const fp4attn_attention_params &p, int it, int64_t &bh, int64_t &i) const {
    bh = (int64_t)b * p.heads_q + hk * G + it / per_head;
    const int k = it % per_head + rot;
    i = i_start + (k < per_head ? k : k - per_head);
  }
  /* This key block's place in dQ's deterministic order for query block i */
  __device__ unsigned rank(int64_t i) const { return dq_rank(causal, nkb, i, j); }
};

template <int DP, bool kBf16>
struct Int8BwdSm90 {
  using C = BwdSm90Config<DP>;
  static constexpr int kQkRow = DP; /* bytes per Q^ / K^ row: their swizzle width */

  static __device__ void producer(const Int8BwdSm90Params &prm, char *sm) {
    const Int8Args &a = prm.a;
    const fp4attn_attention_params &p = a.p;
    const Int8Workspace &w = a.ws;
    const BwdWalk walk(p, w, prm.longest_first, prm.deterministic);
    const BwdBars<C::kStages> bar{smem_u32(sm + C::kOffBar)};
    const int jr = walk.j * kBK8, bhk = walk.bhk;

    mbar_expect_tx(bar.kfull(), C::kKBytes + C::kVBytes + C::kKsBytes);
    tma_load_3d(smem_u32(sm + C::kOffK), &prm.kmap, 0, jr, bhk, bar.kfull());
#pragma unroll
    for (int cb = 0; cb < DP / 64; ++cb)
      tma_load_4d(smem_u32(sm + C::kOffV + cb * kBK8 * 128), &prm.vmap, cb * 64, jr, walk.hk,
                  walk.b, bar.kfull());
#pragma unroll
    for (int kb = 0; kb < 2; ++kb) /* Ks16^T: keys 64 kb .. of all DP channels */
      tma_load_3d(smem_u32(sm + C::kOffKs + kb * DP * 128), &prm.ksmap, kb * 128, walk.j * DP, bhk,
                  bar.kfull());
    mbar_arrive(bar.kfull());

#pragma unroll 1 /* unrolled copies spill from the producer warpgroup's 24 registers */
    for (int it = 0; it < walk.iters; ++it) {
      const int s = it % C::kStages;
      if (it >= C::kStages) mbar_wait(bar.empty(s), ((it / C::kStages) - 1) & 1);
      int64_t bh, i;
      walk.block(p, it, bh, i);
      char *st = sm + C::kOffStage + s * C::kTileBytes;
      char *vec = sm + C::kOffVec + s * C::kVecBytes;
      const int ir = (int)(i * kBQ8), bhq = (int)bh;
      const int64_t r0 = bh * w.nqp + i * kBQ8;
      mbar_expect_tx(bar.full(s), C::kTileBytes + C::kVecBytes);
      tma_load_3d(smem_u32(st + C::sQ), &prm.qmap, 0, ir, bhq, bar.full(s));
#pragma unroll
      for (int cb = 0; cb < DP / 64; ++cb) {
        tma_load_3d(smem_u32(st + C::sQ16 + cb * kBQ8 * 128), &prm.q16map, cb * 128, ir, bhq,
                    bar.full(s));
        tma_load_3d(smem_u32(st + C::sDo + cb * kBQ8 * 128), &prm.domap, cb * 128, ir, bhq,
                    bar.full(s));
      }
      bulk_load(smem_u32(vec + C::vLse), w.lse2 + r0, kBQ8 * 4, bar.full(s));
      bulk_load(smem_u32(vec + C::vDrow), w.drow + r0, kBQ8 * 4, bar.full(s));
      mbar_arrive(bar.full(s));
    }
  }

  /* Warp 1 + c of the producer warpgroup: consumer c's dQ tile of every step into the FP32
   * workspace, one TMA reduction per 32-column box (rows past len_q skipped by the map); the tile
   * comes by kBarDqFull + c and goes back by kBarDqEmpty + c once the reductions have read it.
   * Deterministic: the reductions wait for dq_sem to count this key block's rank, and count it
   * once they are complete. */
  static __device__ void dq_writer(const Int8BwdSm90Params &prm, char *sm, int c) {
    const fp4attn_attention_params &p = prm.a.p;
    const Int8Workspace &w = prm.a.ws;
    const BwdWalk walk(p, w, prm.longest_first, prm.deterministic);
    const bool leader = (threadIdx.x & 31) == 0;
    const uint32_t tile = smem_u32(sm + C::kOffDq + c * C::kDqBytes);
    for (int it = 0; it < walk.iters; ++it) {
      int64_t bh, i;
      walk.block(p, it, bh, i);
      unsigned *sem = prm.deterministic ? w.dq_sem + (bh * w.nqb + i) * 2 + c : nullptr;
      named_sync(kBarDqFull + c, kDqBarThreads);
      if (leader) {
        if (sem) {
          const unsigned rank = walk.rank(i);
          while (ld_acquire_gpu(sem) != rank) {
          }
          fence_proxy_async_global(); /* the reductions after the earlier blocks' */
        }
#pragma unroll
        for (int b = 0; b < C::kDqCols / 32; ++b)
          tma_reduce_add_3d(&prm.dqmap, tile + b * kBQ8 * 128, C::kDqCols * c + 32 * b,
                            (int)(i * kBQ8), (int)bh);
        bulk_commit();
        bulk_wait_read<0>();
      }
      __syncwarp();
      if (it + 1 < walk.iters) named_arrive(kBarDqEmpty + c, kDqBarThreads);
      if (leader && sem) {
        bulk_wait<0>(); /* the sums are in the workspace */
        fence_proxy_async_global();
        red_release_gpu_add(sem, 1u);
      }
      __syncwarp(); /* the warp's next bar.sync, converged */
    }
    if (leader) bulk_wait<0>(); /* the tile is not freed before the last reduction has read it */
  }

  static __device__ void consumer(const Int8BwdSm90Params &prm, char *sm) {
    const Int8Args &a = prm.a;
    const fp4attn_attention_params &p = a.p;
    const Int8Workspace &w = a.ws;
    const BwdWalk walk(p, w, prm.longest_first, prm.deterministic);
    const BwdBars<C::kStages> bar{smem_u32(sm + C::kOffBar)};
    const int ctid = threadIdx.x - 128, cwg = ctid >> 7, wtid = ctid & 127, wwarp = wtid >> 5;
    const int lane = ctid & 31, g = lane >> 2, t = lane & 3;
    const int krow0 = cwg * kWgKeys + wwarp * 16; /* this warp's 16 keys in the block */
    const int64_t j0 = (int64_t)walk.j * kBK8;

    /* descriptors of the resident tiles: this consumer's 64 keys of K^ and V; dQ's Ks16^T, its
     * DP/2 channels (rows) of each 64-key block */
    const uint64_t k_desc = kmajor_desc<kQkRow>(smem_u32(sm + C::kOffK) + cwg * kWgKeys * DP);
    const uint32_t v_lo = sw128_desc_lo(smem_u32(sm + C::kOffV) + cwg * kWgKeys * 128);
    const uint32_t ks_lo = sw128_desc_lo(smem_u32(sm + C::kOffKs) + cwg * C::kDqCols * 128);
    char *dq_tile = sm + C::kOffDq + cwg * C::kDqBytes;
    /* this thread's words of the dS16^T tile [128 keys][64 rows] (consumer c's keys 64c ..):
     * (key krow0 + g + 8r, rows n*8 + 2t, +1) at byte key*128 + 16 (n ^ g) + 4t (128-byte
     * swizzle: key % 8 = g) */
    const int ds_own = (krow0 + g) * 128 + 4 * t;

    float dv[DP / 8][4], dk[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dv[n][e] = dk[n][e] = 0.0f;

    const float sk = w.sk[(int64_t)walk.bhk * w.nkb + walk.j];
    const int other = 1 - cwg;
    /* dQ_i += dS16 Ks16 of step tq, one step late (issued after step tq + 1's dK, so that neither
     * consumer waits for the other's dS16^T of the same step): this consumer's DP/2 columns over
     * the block's 128 keys (k16 step kk: keys 16 kk .., +2048 bytes in the dS16^T tile; key block
     * kk / 4 of Ks16^T, +32 bytes per step inside it), once both halves of the buffer are written;
     * waits for every wgmma of this consumer, marks the buffer read, releases `stage` (>= 0: the
     * last reads of its step were dV's and dK's), then hands the product to the writer: into
     * this consumer's tile once the writer's reductions have read the last one, 32-column boxes
     * of [64 rows][128 bytes], 16-byte chunk c of row r at c ^ (r % 8) (the TMA's 128-byte
     * swizzle; row % 8 = g) */
    auto dq_step = [&](int tq, int stage) {
      const int b = tq & 1;
      const uint32_t parity = (uint32_t)(tq >> 1) & 1u;
      mbar_wait(bar.ds_ready(cwg, b), parity);
      mbar_wait(bar.ds_ready(other, b), parity);
      const uint64_t ds_mn =
          mnmajor_sw128_desc(smem_u32(sm + C::kOffDs + b * 2 * C::kDsBytes), kWgKeys * 128);
      float acc[C::kDqCols / 8][4];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK8 / 16; ++kk)
        wgmma_ss_k16<C::kDqCols, kBf16, true, false>(
            acc, ds_mn + kk * (2048 >> 4),
            sw128_desc(ks_lo + (kk >> 2) * (DP * 128 >> 4) + 2 * (kk & 3)), kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(acc);
      mbar_arrive(bar.ds_read(cwg, b));
      if (stage >= 0) mbar_arrive(bar.empty(stage));
      if (tq > 0) named_sync(kBarDqEmpty + cwg, kDqBarThreads);
#pragma unroll
      for (int n = 0; n < C::kDqCols / 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = wwarp * 16 + g + 8 * r, chunk = (2 * (n & 3) + (t >> 1)) ^ g;
          *reinterpret_cast<float2 *>(dq_tile + (n >> 2) * (kBQ8 * 128) + row * 128 + chunk * 16 +
                                      8 * (t & 1)) = make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
        }
      fence_proxy_async(); /* the tile, for the TMA */
      named_arrive(kBarDqFull + cwg, kDqBarThreads);
    };

    mbar_wait(bar.kfull(), 0);
    for (int it = 0; it < walk.iters; ++it) {
      const int s = it % C::kStages;
      int64_t bh, i;
      walk.block(p, it, bh, i);
      const int64_t h = bh % p.heads_q, i0 = i * kBQ8;
      const char *st = sm + C::kOffStage + s * C::kTileBytes;
      const char *vec = sm + C::kOffVec + s * C::kVecBytes;
      const float *lse2 = reinterpret_cast<const float *>(vec + C::vLse);
      const float *drow = reinterpret_cast<const float *>(vec + C::vDrow);
      const uint64_t q_desc = kmajor_desc<kQkRow>(smem_u32(st + C::sQ));
      const uint32_t do_lo = sw128_desc_lo(smem_u32(st + C::sDo));
      /* dO and Q16 as dV's and dK's MN-major B: query rows 16 kk .. at + 16 x 128 bytes, channel
       * slabs 64 x 128 bytes apart */
      const uint64_t do_mn = mnmajor_sw128_desc(smem_u32(st + C::sDo), kBQ8 * 128);
      const uint64_t q16_mn = mnmajor_sw128_desc(smem_u32(st + C::sQ16), kBQ8 * 128);
      const float sq = w.sq[bh * w.nqb + i];
      mbar_wait(bar.full(s), (it / C::kStages) & 1);

      /* S^T = K^ Q^T and dP^T = V dO^T (this consumer's 64 keys x the block's 64 rows) */
      int sacc[8][4];
      float dp[8][4];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DP / 32; ++kk)
        wgmma_ss_m64n64k32_s8(sacc, k_desc + 2 * kk, q_desc + 2 * kk, kk > 0);
#pragma unroll
      for (int kk = 0; kk < DP / 16; ++kk) {
        /* k16 step kk: column block kk / 4 (R rows x 128 bytes), +32 bytes per step inside it */
        const uint32_t voff = (kk >> 2) * (kBK8 * 128 >> 4) + 2 * (kk & 3);
        const uint32_t dooff = (kk >> 2) * (kBQ8 * 128 >> 4) + 2 * (kk & 3);
        wgmma_ss_m64n64k16<kBf16>(dp, sw128_desc(v_lo + voff), sw128_desc(do_lo + dooff), kk > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(sacc);
      fence_regs(dp);

      /* P^T = exp2(S^T f - lse2) with the masks; accumulator rows are keys, columns query rows */
      const float f = ((sq * sk) * p.scale) * kLog2e;
      const bool masked = p.mask_kind != FP4ATTN_MASK_NONE || j0 + kBK8 > p.len_k ||
                          i0 + kBQ8 > p.len_q || (p.causal && j0 + kBK8 - 1 > i0);
      /* two whole loops, not a select per score: per-score branches around the mask code cost
       * the unmasked steps an instruction-fetch stall per score (ncu: 20-25 % of all samples) */
      float pm[8][4];
      if (!masked) {
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            pm[n][e] = fast_exp2((float)sacc[n][e] * f - lse2[n * 8 + 2 * t + (e & 1)]);
      } else {
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n * 8 + 2 * t + (e & 1);
            const int64_t key = j0 + krow0 + g + 8 * (e >> 1), row = i0 + col;
            pm[n][e] =
                fast_exp2(masked_score(p, walk.b, h, row, key, (float)sacc[n][e] * f) - lse2[col]);
          }
      }

      /* dV += P16^T dO16 (k16 step kk: query rows 16 kk ..), accumulated by the wgmma itself */
      {
        uint32_t pa[4][4];
        acc_to_a16<kBf16, 4>(pm, pa);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_rs_acc_k16<DP, kBf16, true>(dv, pa[kk], do_mn + kk * (16 * 128 >> 4));
        wgmma_commit();
      }

      /* dS16^T = P^T (dP^T - Drow) in 16 bits; dK += dS16^T Q16 like dV */
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          dp[n][e] = pm[n][e] * (dp[n][e] - drow[n * 8 + 2 * t + (e & 1)]);
      uint32_t da[4][4];
      acc_to_a16<kBf16, 4>(dp, da);
      /* dS16^T into this consumer's half of buffer it & 1 (read before the wgmma takes da), once
       * the other consumer's dQ product of step it - 2 has read it (this one's has) */
      if (it >= 2) mbar_wait(bar.ds_read(other, it & 1), (uint32_t)((it - 2) >> 1) & 1u);
      char *ds_tile = sm + C::kOffDs + (it & 1) * 2 * C::kDsBytes;
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          *reinterpret_cast<uint32_t *>(ds_tile + ds_own + r * 8 * 128 + ((n ^ g) << 4)) =
              da[n >> 1][2 * (n & 1) + r];
      fence_proxy_async(); /* the dS16 words, for the dQ wgmma */
      mbar_arrive(bar.ds_ready(cwg, it & 1));
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_rs_acc_k16<DP, kBf16, true>(dk, da[kk], q16_mn + kk * (16 * 128 >> 4));
      wgmma_commit();
      if (it > 0) {
        dq_step(it - 1, s);
      } else {
        wgmma_wait<0>();
        mbar_arrive(bar.empty(s)); /* the stage's last reads (dV's and dK's) are done */
      }
    }
    if (walk.iters > 0) dq_step(walk.iters - 1, -1);

    /* dK and dV of this warp's 16 keys, in the input dtype (their last wgmma were waited for with
     * the last dQ product) */
    fence_regs(dv);
    fence_regs(dk);
    store_dk_dv_rows(a, walk.bhk, j0 + krow0, 0, dk, dv);
  }

  static __device__ void run(const Int8BwdSm90Params &prm, char *smem) {
    char *sm = smem + ((1024u - (smem_u32(smem) & 1023u)) & 1023u);
    if (threadIdx.x == 0) {
      const BwdBars<C::kStages> bar{smem_u32(sm + C::kOffBar)};
      for (int s = 0; s < C::kStages; ++s) {
        mbar_init(bar.full(s), 1);
        mbar_init(bar.empty(s), kConsumerThreads);
      }
      mbar_init(bar.kfull(), 1);
      for (int c = 0; c < 2; ++c)
        for (int b = 0; b < 2; ++b) {
          mbar_init(bar.ds_ready(c, b), 128);
          mbar_init(bar.ds_read(c, b), 128);
        }
      mbar_init_fence();
    }
    __syncthreads();
    grid_dependency_wait(); /* the preparation's operands */
    if (threadIdx.x < 128) {
      regs_dealloc<C::kProducerRegs>();
      if (threadIdx.x == 0)
        producer(prm, sm);
      else if (threadIdx.x >= 32 && threadIdx.x < 96)
        dq_writer(prm, sm, (threadIdx.x >> 5) - 1);
    } else {
      regs_alloc<C::kConsumerRegs>();
      consumer(prm, sm);
    }
  }
};

#endif /* FP4ATTN_SM90_WGMMA */

template <int DP, bool kBf16>
__global__ void __launch_bounds__(kThreads, 1)
    int8_backward_sm90_kernel(const __grid_constant__ Int8BwdSm90Params prm) {
#if defined(FP4ATTN_SM90_WGMMA)
  extern __shared__ __align__(16) char smem[];
  Int8BwdSm90<DP, kBf16>::run(prm, smem);
#else
  __trap(); /* never launched: the dispatch picks this kernel only for sm_90a builds on CC 9.0 */
#endif
}

}  // namespace

template <int DP>
fp4attn_status launch_int8_backward_sm90(const Int8Args &a, cudaStream_t s) {
  static_assert(DP == 64 || DP == 128, "the sm90 INT8 backward serves padded head dims 64 and 128");
  using C = BwdSm90Config<DP>;
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  if (w.nkb * DP > 0x7FFFFFFFLL || w.nqb * DP > 0x7FFFFFFFLL || w.nqp > 0x7FFFFFFFLL ||
      w.nkp > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "int8 attention backward (sm90 kernel): sequences too long for TMA "
                         "coordinates");
  Int8BwdSm90Params prm;
  prm.a = a;
  /* the causal walks longest first where the grid is a few waves, so that its last one holds
   * short walks; with many waves the tail is short and head-major order keeps a head's tiles in
   * L2. Measured (fwd + bwd, causal, longest first vs head-major): 2.9 waves (B 8, 6 heads, 1K,
   * head dim 64) -6.4 %, 5.8 waves (2K) -7.7 %, 15.5 waves (B 16, 16 heads, 1K, head dim 128)
   * +4.9 %, (B 4, 16 heads, 4K) -1.7 %, 62 waves +0.3 %. */
  const int64_t blocks = p.batch * p.heads_kv * w.nkb;
  prm.deterministic = w.dq_sem != nullptr;
  prm.longest_first = p.causal && blocks <= 8 * (int64_t)sm_count() && !prm.deterministic;
  const cuuint64_t bhq = (cuuint64_t)(p.batch * p.heads_q),
                   bhk = (cuuint64_t)(p.batch * p.heads_kv), dp = (cuuint64_t)DP;
  struct Map {
    CUtensorMap &map;
    const void *base;
    cuuint64_t dims[3], strides[2];
    cuuint32_t inner, rows;
    const char *what;
  };
  /* a [bhq][nqp][dp] 16-bit workspace section (Q16, dO) in 64-column boxes of 64 rows */
  const auto q_rows16 = [&](CUtensorMap &map, const void *base, const char *what) -> Map {
    return {map, base, {2 * dp, (cuuint64_t)w.nqp, bhq}, {2 * dp, w.nqp * 2 * dp}, 128, kBQ8, what};
  };
  Map maps[] = {
      {prm.kmap, w.kc, {dp, (cuuint64_t)w.nkp, bhk}, {dp, w.nkp * dp}, DP, kBK8, "K^"},
      {prm.ksmap,
       w.ks16,
       {2 * kBK8, w.nkb * dp, bhk},
       {2 * kBK8, w.nkb * dp * 2 * kBK8},
       128,
       DP,
       "Ks16^T"},
      {prm.qmap, w.qc, {dp, (cuuint64_t)w.nqp, bhq}, {dp, w.nqp * dp}, DP, kBQ8, "Q^"},
      q_rows16(prm.q16map, w.q16, "Q16"),
      q_rows16(prm.domap, w.do16, "dO"),
  };
  for (Map &m : maps) {
    const fp4attn_status st =
        encode_byte_map(m.map, m.base, m.dims, m.strides, m.inner, m.rows, m.what);
    if (st.code != FP4ATTN_OK) return st;
  }
  const Int8Rows16 v = int8_v16_rows(a);
  fp4attn_status st = encode_rows16_map(prm.vmap, v.base, v.dims, v.strides, kBK8, "V16");
  if (st.code != FP4ATTN_OK) return st;
  /* dQ's FP32 accumulator [bhq][len_q][DP], the target of the consumers' TMA reductions */
  const cuuint64_t dq_dims[3] = {dp, (cuuint64_t)p.len_q, bhq};
  const cuuint64_t dq_strides[2] = {4 * dp, (cuuint64_t)p.len_q * 4 * dp};
  st = encode_f32_map(prm.dqmap, w.dq_acc, dq_dims, dq_strides, kBQ8, "dQ accumulator");
  if (st.code != FP4ATTN_OK) return st;

  auto kernel =
      a.bf16_ops ? int8_backward_sm90_kernel<DP, true> : int8_backward_sm90_kernel<DP, false>;
  static int configured[64] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  const int bit = a.bf16_ops ? 2 : 1;
  if (dev < 0 || dev >= 64 || !(configured[dev] & bit)) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem) !=
        cudaSuccess)
      return launch_status("int8 attention backward (sm90 kernel)");
    if (dev >= 0 && dev < 64) configured[dev] |= bit;
  }
  if (blocks > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "int8 attention backward: too many key blocks");
  launch_dependent(kernel, dim3((unsigned)blocks), dim3(kThreads), C::kSmem, s, prm);
  return launch_status("int8 attention backward (sm90 kernel)");
}

template fp4attn_status launch_int8_backward_sm90<64>(const Int8Args &, cudaStream_t);
template fp4attn_status launch_int8_backward_sm90<128>(const Int8Args &, cudaStream_t);

}  // namespace fp4attn_cuda
