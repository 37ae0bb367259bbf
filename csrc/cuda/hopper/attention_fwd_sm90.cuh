/*
 * FP4 attention forward for Hopper (sm_90a), head dims padded to 64 and 128: the numerics of
 * attention_fwd.cuh (FP4 operands held as exact FP16 values, SPEC 4.4-4.6), with the matrix work
 * on wgmma and the loads on a producer warpgroup.
 *
 * Block: 128 query rows of one (batch, query head), 3 warpgroups.
 *   warpgroup 0, producer (setmaxnreg down to Config::kProducerRegs): per 128-key tile, one thread
 *     has the TMA load the K^ and V^ tiles (exact FP16 values written by the pre-pass; the
 *     tensor maps apply the 128-byte swizzle wgmma reads) onto the stage's "full" mbarrier, and
 *     all 128 threads compute the q-mean correction bias[key] = scale log2e qbar . K[key] from K
 *     in input precision (on mma.sync, BiasMma) and arrive on it. A ring of kStages buffers; it
 *     refills one when both consumers signal "empty".
 *   warpgroups 1 and 2, consumers (setmaxnreg up): 64 rows each. S = Q^ K^T by wgmma
 *     m64n128k16 with Q^ and K^ in shared memory; the score epilogue, online softmax and P
 *     quantization in registers (attention_tile.cuh, shared with the mma.sync kernel: the wgmma
 *     accumulator layout of each warp is the m16n8k16 layout of its 16 rows); O_acc += P^q V^ by
 *     wgmma m64n{DP}k16 with P^q from registers, the first-level scales applied to O_acc in FP32
 *     between tiles (softmax_tile_stats).
 * The two consumer warpgroups take turns at issuing their wgmma (see consumer()).
 * Q: all 384 threads quantize the block's rows in the prologue (Q - qbar, global scale, phi).
 * The TMA replaced per-thread cp.async (32 per producer thread and tile at DP = 128, with their
 * addressing): the producer issued a quarter of all instructions and the consumers waited for it.
 */
#ifndef FP4ATTN_CUDA_HOPPER_ATTENTION_FWD_SM90_CUH
#define FP4ATTN_CUDA_HOPPER_ATTENTION_FWD_SM90_CUH

#include <cuda.h> /* CUtensorMap (the driver entry point is looked up at run time: no -lcuda) */
#include <cudaTypedefs.h>

#include "../attention_tile.cuh"
#include "wgmma.cuh"

namespace fp4attn_cuda {
namespace sm90 {

constexpr int kThreads = 384;      /* producer + 2 consumer warpgroups */
constexpr int kRows = 128;         /* query rows per block (SPEC 4 Bq) */
/* K^/V^/bias ring: a consumer holds two stages (S_j and the deferred P^q_{j-1} V^_{j-1}) while
 * the producer fills the third */
constexpr int kStages = 3;
/* Named barriers (0 is __syncthreads). "Full" is an mbarrier per stage (Config::kOffFull): the
 * 128 producer threads arrive after writing the bias, and the TMA completes the tile bytes. */
constexpr int kBarEmpty = 1;                  /* + stage: both consumers are done with it */
constexpr int kBarTurn = kBarEmpty + kStages; /* + consumer: its turn to issue wgmma */
constexpr int kTurnCount = 256;               /* one consumer arrives, the other syncs */

/* Kernel parameters: the attention arguments and this call's TMA maps of K^ and V^ (3-D,
 * innermost first: K^ {DP, nkp, BHk}, the V^T tiles {128, nkt x DP, BHk}; boxes of 64 columns
 * (128 bytes) with the 128-byte swizzle, so a box lands as one column block of the wgmma layout). */
struct Params {
  AttnArgs a;
  CUtensorMap kmap, vmap;
};

template <int DP>
struct Config {
  /* setmaxnreg split of the launch allocation, 168 x 384 = P x 128 + C x 256. With the TMA the
   * producer waits for "empty" a third of its time, so its bias MMA may spill a little (at
   * DP = 128 it holds 64 registers of K and 32 of A fragments); the consumers must not: 120 / 192
   * at DP = 128 reloaded consumer state from local memory every tile and measured 5 % slower. */
  static constexpr int kProducerRegs = 104;
  static constexpr int kConsumerRegs = 200;
  static_assert(kProducerRegs + 2 * kConsumerRegs == 3 * 168, "setmaxnreg split of 168 x 384");
  static constexpr int kQBytes = kRows * DP * 2;
  static constexpr int kKBytes = kTile * DP * 2;
  static constexpr int kVBytes = DP * kTile * 2;
  /* shared memory map. Small arrays from the (16-byte aligned) base: */
  static constexpr int kOffBias = 0;
  static constexpr int kOffFull = kOffBias + kStages * kTile * 4; /* mbarriers, 8 bytes each */
  static constexpr int kSmall = kOffFull + kStages * 8;
  /* operand tiles from the first 1024-byte boundary after them (offsets from that boundary): */
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKBytes;
  static constexpr int kTiles = kOffV + kStages * kVBytes;
  static constexpr int kSmem = kSmall + 1023 + kTiles; /* 231959 bytes for DP = 128 (H100/H200: 232448) */
};

template <int DP>
struct Kernel {
  using C = Config<DP>;

  struct Block : QueryBlock {
    const Params *prm;
    const float *qbar; /* this block's query mean (global, DP floats) */
    char *small, *tiles; /* see Config */
    __device__ const AttnArgs &args() const { return prm->a; }
    __device__ __half *tile(int off) const { return reinterpret_cast<__half *>(tiles + off); }
    __device__ float *bias(int stage) const { return reinterpret_cast<float *>(small + C::kOffBias) + stage * kTile; }
    __device__ uint32_t full(int stage) const { return smem_u32(small + C::kOffFull) + stage * 8; }
  };

#if defined(FP4ATTN_SM90_WGMMA)
  /* ---------------------------------------------------------------- producer warpgroup */
  /* How the producer computes the q-mean bias: on mma.sync (BiasMma, 16-bit K with 16-byte rows)
   * or with FP32 FMAs (compute_bias: FP32 K, unaligned rows). One producer loop per way, so the
   * loop carries no dtype tests. */
  enum class BiasPath { kMmaF16, kMmaBf16, kFma };

  static __device__ void producer(const Block &k) {
    const AttnArgs &a = k.args();
    if (a.vec_k && a.p.dtype == FP4ATTN_BFLOAT16)
      producer_loop<BiasPath::kMmaBf16>(k);
    else if (a.vec_k && a.p.dtype == FP4ATTN_FLOAT16)
      producer_loop<BiasPath::kMmaF16>(k);
    else
      producer_loop<BiasPath::kFma>(k);
  }

  template <BiasPath kBias>
  static __device__ void producer_loop(const Block &k) {
    const AttnArgs &a = k.args();
    const int tid = threadIdx.x, warp = tid >> 5; /* 0..127, 0..3 */
    BiasMma<DP, kBias == BiasPath::kMmaBf16> bias_mma;
    if (kBias != BiasPath::kFma) bias_mma.init(a, k.b, k.hk, warp * 32, k.qbar);
    for (int j = 0, buf = 0; j < k.ntiles; ++j, buf = buf + 1 == kStages ? 0 : buf + 1) {
      if (j >= kStages) named_sync(kBarEmpty + buf, kThreads);
      if (tid == 0) {
        const uint32_t full = k.full(buf);
        const uint32_t ks = smem_u32(k.tiles + C::kOffK + buf * C::kKBytes);
        const uint32_t vs = smem_u32(k.tiles + C::kOffV + buf * C::kVBytes);
        mbar_expect_tx(full, C::kKBytes + C::kVBytes);
#pragma unroll
        for (int cb = 0; cb < DP / 64; ++cb) /* K^ rows j*128.., columns cb*64..: [128][64] */
          tma_load_3d(ks + cb * kTile * 128, &k.prm->kmap, cb * 64, j * kTile, (int)k.bhk, full);
#pragma unroll
        for (int cb = 0; cb < 2; ++cb) /* V^T of tile j, keys cb*64..: [DP][64] */
          tma_load_3d(vs + cb * DP * 128, &k.prm->vmap, cb * 64, j * DP, (int)k.bhk, full);
      }
      if (kBias != BiasPath::kFma)
        bias_mma.compute(a, j, k.bias(buf) + warp * 32);
      else
        compute_bias<DP, 1>(a, k.b, k.hk, (int64_t)j * kTile + tid, 0, k.qbar, k.bias(buf) + tid);
      mbar_arrive(k.full(buf));
    }
  }

  /* ---------------------------------------------------------------- consumer warpgroups */
  /* S = Q^ K^T for this warpgroup's 64 rows x 128 keys, reduction over DP in k16 steps (async).
   * q_lo, k_lo: descriptor low words of the operands (sw128_desc_lo); a k16 step inside a
   * 64-column block is +32 bytes, the next block +rows x 128 bytes (in 16-byte units below). */
  static __device__ __forceinline__ void issue_scores(float (&s)[16][4], uint32_t q_lo, uint32_t k_lo) {
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      const uint32_t step = (kk & 3) * 2;
      Wgmma<128>::ss(s, sw128_desc(q_lo + (kk >> 2) * (kRows * 8) + step),
                     sw128_desc(k_lo + (kk >> 2) * (kTile * 8) + step), kk > 0);
    }
  }

  /* O_acc += P^q V^: 64 rows x DP columns, reduction over the 128 keys in k16 steps (async). */
  static __device__ __forceinline__ void issue_pv(float (&o)[DP / 8][4], const uint32_t (&pa)[8][4], uint32_t v_lo) {
#pragma unroll
    for (int kb = 0; kb < 8; ++kb)
      Wgmma<DP>::rs(o, pa[kb], sw128_desc(v_lo + (kb >> 2) * (DP * 8) + (kb & 3) * 2), 1);
  }

  /* Per tile j the warpgroup issues S_j and the deferred P^q_{j-1} V^_{j-1} (two commit groups),
   * waits for S_j only and runs the first softmax phase (scores, maxima, statistics:
   * softmax_tile_stats) while P^q_{j-1} V^_{j-1} is still on the tensor cores; then waits for it,
   * frees the stage, writes P^q_j (softmax_tile_finish) and rescales O_acc by tile j's factor,
   * ready for P^q_j V^_j. O is accumulated in place by the wgmma. The two consumer warpgroups take
   * turns at issuing (kBarTurn, FA3's ping-pong: measured 1-3 % faster than free-running), so one's
   * wgmma run while the other does its softmax.
   * With an attn_mask, both groups are waited for first: ptxas serializes every wgmma of the
   * kernel (warning C7513) when the general mask code (data-dependent branches and loads) runs
   * while a group is in flight, and likewise when P^q_j is built while P^q_{j-1} is in flight
   * (more live registers than a consumer has). The causal and key-padding masks are branch-free
   * (mask_causal_tail) and take the overlapped path. */
  static __device__ void consumer(const Block &k) {
    const AttnArgs &a = k.args();
    const AttnWorkspace &w = a.ws;
    const int ctid = threadIdx.x - 128;                 /* 0..255 */
    const int cwg = ctid >> 7, wwarp = (ctid >> 5) & 3; /* consumer warpgroup, warp in it */
    const WarpRows rows = {k.b, k.h, k.q0 + cwg * 64 + wwarp * 16};
    const float decq = w.qscale[k.bh * 2 + 1];
    const float deck = w.kvscale[k.bhk * 4 + 1], decv = w.kvscale[k.bhk * 4 + 3];
    const float cqk = a.scale_log2 * (decq * deck);
    /* this warpgroup's 64 rows of Q^: 64 x 128 bytes into each column block */
    const uint32_t q_lo = sw128_desc_lo(smem_u32(k.tiles + C::kOffQ) + cwg * 64 * 128);
    const uint32_t k_lo = sw128_desc_lo(smem_u32(k.tiles + C::kOffK)), v_lo = sw128_desc_lo(smem_u32(k.tiles + C::kOffV));
    const auto k_desc = [&](int buf) { return k_lo + buf * (C::kKBytes / 16); };
    const auto v_desc = [&](int buf) { return v_lo + buf * (C::kVBytes / 16); };
    /* turns: consumer 0 starts; consumer 1 skips its last hand-over so no arrival is left over */
    const auto turn_begin = [&]() { named_sync(kBarTurn + cwg, kTurnCount); };
    const auto turn_end = [&](bool last) {
      if (!(last && cwg == 1)) named_arrive(kBarTurn + (cwg ^ 1), kTurnCount);
    };

    InPlaceSoftmaxState st;
    st.m[0] = st.m[1] = st.ref[0] = st.ref[1] = -INFINITY;
    st.l[0] = st.l[1] = 0.0f;
    float o[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

    if (k.ntiles > 0) {
      if (cwg == 1) named_arrive(kBarTurn + 0, kTurnCount);
      float s[16][4];
      uint32_t pa[8][4];
      /* tile 0: S only (O_acc is zero, its factor does not matter) */
      uint32_t phase = 0; /* parity of the stages' next "full" phase (flips after the last stage) */
      mbar_wait(k.full(0), phase);
      turn_begin();
      wgmma_fence();
      issue_scores(s, q_lo, k_desc(0));
      wgmma_commit();
      turn_end(false);
      wgmma_wait<0>();
      fence_regs(s);
      TileStats ts;
      softmax_tile_stats<MaskPath::kAll>(a.p, rows, 0, cqk, k.bias(0), s, st, ts);
      softmax_tile_finish(s, ts, st, pa);

      for (int j = 1, buf = 1, prev = 0; j < k.ntiles; ++j) {
        mbar_wait(k.full(buf), phase);
        phase ^= buf == kStages - 1;
        turn_begin();
        wgmma_fence();
        issue_scores(s, q_lo, k_desc(buf));
        wgmma_commit();
        issue_pv(o, pa, v_desc(prev));
        wgmma_commit();
        turn_end(false);
        if (a.p.mask_kind == FP4ATTN_MASK_NONE) {
          wgmma_wait<1>(); /* S_j; phase 1 overlaps P^q_{j-1} V^_{j-1} */
          fence_regs(s);
          softmax_tile_stats<MaskPath::kCausalTail>(a.p, rows, (int64_t)j * kTile, cqk, k.bias(buf), s, st, ts);
          wgmma_wait<0>();
        } else {
          wgmma_wait<0>();
          fence_regs(s);
          softmax_tile_stats<MaskPath::kAll>(a.p, rows, (int64_t)j * kTile, cqk, k.bias(buf), s, st, ts);
        }
        fence_regs(o);
        if (j - 1 + kStages < k.ntiles) named_arrive(kBarEmpty + prev, kThreads); /* stage prev is free */
        softmax_tile_finish(s, ts, st, pa);
        rescale_rows(o, ts.ofac);
        prev = buf;
        buf = buf + 1 == kStages ? 0 : buf + 1;
      }
      /* the last tile's P^q V^ (its stage is never refilled) */
      turn_begin();
      wgmma_fence();
      issue_pv(o, pa, v_desc((k.ntiles - 1) % kStages));
      wgmma_commit();
      turn_end(true);
      wgmma_wait<0>();
      fence_regs(o);
    }
    float omul[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
      omul[r] = st.ref[r] == -INFINITY ? 0.0f : fast_exp2(st.ref[r] - st.m[r]) * (decv / FP4ATTN_NVFP4_RANGE);
    store_rows<DP>(a, rows, k.bh, o, omul, st, k.qbar, w.kbar + k.bhk * DP);
  }

  static __device__ void run(const Params &prm, char *smem) {
    const AttnArgs &a = prm.a;
    /* the operand tiles need 1024-byte alignment (the swizzle works on address bits) */
    const uint32_t tiles_at = (smem_u32(smem) + C::kSmall + 1023u) & ~1023u;
    const fp4attn_attention_params &p = a.p;
    const AttnWorkspace &w = a.ws;
    Block k;
    k.prm = &prm;
    k.small = smem;
    k.tiles = smem + (tiles_at - smem_u32(smem));
    static_cast<QueryBlock &>(k) = query_block(p, w, kRows);

    k.qbar = w.qbar + (k.bh * w.nqb + k.q0 / kTile) * DP;
    /* prologue, all threads: the "full" mbarriers, Q^ (exact FP16 values, swizzled for wgmma) */
    if (threadIdx.x == 0) {
      for (int st = 0; st < kStages; ++st) mbar_init(k.full(st), 128);
      mbar_init_fence();
    }
    __half *qs = k.tile(C::kOffQ);
    quantize_q_rows<DP>(a, k.b, k.h, k.bh, k.q0, kRows, k.qbar, threadIdx.x, kThreads,
                        [&](int r, int col, const uint32_t (&v)[8]) {
                          *reinterpret_cast<uint4 *>(qs + sw128_offset(kRows, r, col)) = make_uint4(v[0], v[1], v[2], v[3]);
                          *reinterpret_cast<uint4 *>(qs + sw128_offset(kRows, r, col + 8)) = make_uint4(v[4], v[5], v[6], v[7]);
                        });
    fence_proxy_async();
    __syncthreads();

    if (threadIdx.x < 128) {
      regs_dealloc<C::kProducerRegs>();
      producer(k);
    } else {
      regs_alloc<C::kConsumerRegs>();
      consumer(k);
    }
  }
#endif /* FP4ATTN_SM90_WGMMA */
};

template <int DP>
__global__ void __launch_bounds__(kThreads, 1) attention_fwd_sm90_kernel(const __grid_constant__ Params prm) {
#if defined(FP4ATTN_SM90_WGMMA)
  extern __shared__ __align__(16) char smem[];
  Kernel<DP>::run(prm, smem);
#else
  __trap(); /* never launched: the host launches this kernel only for sm_90a builds on CC 9.0 */
#endif
}

/* The TMA maps of K^ and V^ for this call (see Params); host only, no stream work (fine under
 * CUDA-graph capture). */
fp4attn_status encode_tensor_maps(const AttnArgs &a, int64_t dp, CUtensorMap &kmap, CUtensorMap &vmap);

template <int DP>
fp4attn_status launch(const AttnArgs &a, cudaStream_t s) {
  static bool configured[64] = {false};
  Params prm;
  prm.a = a;
  fp4attn_status st = encode_tensor_maps(a, DP, prm.kmap, prm.vmap);
  if (st.code != FP4ATTN_OK) return st;
  return launch_forward(attention_fwd_sm90_kernel<DP>, prm, a.p, kRows, kThreads, Config<DP>::kSmem, configured,
                        "attention (sm90 kernel)", s);
}

}  // namespace sm90
}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_HOPPER_ATTENTION_FWD_SM90_CUH */
