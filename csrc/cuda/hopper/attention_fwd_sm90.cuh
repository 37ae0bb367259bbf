/*
 * FP4 attention forward for Hopper (sm_90a), head dims padded to 64 and 128: the numerics of
 * attention_fwd.cuh (FP4 operands held as exact FP16 values, SPEC 4.4-4.6), with the matrix work
 * on wgmma and the loads on a producer warpgroup.
 *
 * Block: 128 query rows of one (batch, query head), 3 warpgroups.
 *   warpgroup 0, producer (setmaxnreg down to Config::kProducerRegs): per 128-key tile, cp.async of the
 *     K^ and V^ tiles (exact FP16 values written by the pre-pass) into 128-byte-swizzled shared
 *     memory, the q-mean correction bias[key] = scale log2e qbar . K[key] from K in input
 *     precision (on mma.sync, BiasMma), then signals "full". A ring of kStages buffers; it
 *     refills one when both consumers signal "empty".
 *   warpgroups 1 and 2, consumers (setmaxnreg up): 64 rows each. S = Q^ K^T by wgmma
 *     m64n128k16 with Q^ and K^ in shared memory; the score epilogue, online softmax and P
 *     quantization in registers (attention_tile.cuh, shared with the mma.sync kernel: the wgmma
 *     accumulator layout of each warp is the m16n8k16 layout of its 16 rows); O_acc += P^q V^ by
 *     wgmma m64n{DP}k16 with P^q from registers, the first-level scales applied to O_acc in FP32
 *     between tiles (softmax_tile_stats).
 * The two consumer warpgroups take turns at issuing their wgmma (see consumer()).
 * Q: all 384 threads quantize the block's rows in the prologue (Q - qbar, global scale, phi).
 */
#ifndef FP4ATTN_CUDA_HOPPER_ATTENTION_FWD_SM90_CUH
#define FP4ATTN_CUDA_HOPPER_ATTENTION_FWD_SM90_CUH

#include "../attention_tile.cuh"
#include "wgmma.cuh"

namespace fp4attn_cuda {
namespace sm90 {

constexpr int kThreads = 384;      /* producer + 2 consumer warpgroups */
constexpr int kRows = 128;         /* query rows per block (SPEC 4 Bq) */
/* K^/V^/bias ring: a consumer holds two stages (S_j and the deferred P^q_{j-1} V^_{j-1}) while
 * the producer fills the third */
constexpr int kStages = 3;
/* Named barriers (0 is __syncthreads). "full" is per stage and consumer warpgroup, so the two
 * consumers never wait for each other there; "empty" collects both consumers' arrivals. */
constexpr int kBarFull = 1;                /* + 2 stage + consumer: K^/V^/bias of the tile are in */
constexpr int kBarEmpty = 1 + 2 * kStages; /* + stage: both consumers are done with it */
constexpr int kBarTurn = kBarEmpty + kStages; /* + consumer: its turn to issue wgmma */
constexpr int kFullCount = 256;            /* producer arrives, one consumer warpgroup syncs */
constexpr int kTurnCount = 256;            /* one consumer arrives, the other syncs */

template <int DP>
struct Config {
  /* setmaxnreg split of the launch allocation, 168 x 384 = P x 128 + C x 256: at DP = 128 the
   * producer's bias MMA holds 64 registers of K and 32 of A fragments, and at 104 it spilled
   * inside its loop with the loads in flight (ncu: consumers waited 14 % of their time for
   * "full"); 120 / 192 measured +3-7 %. At DP = 64 104 / 200 stays (no producer spills; 120 / 192
   * measured -1.5-3 %). */
  static constexpr int kProducerRegs = DP > 64 ? 120 : 104;
  static constexpr int kConsumerRegs = DP > 64 ? 192 : 200;
  static_assert(kProducerRegs + 2 * kConsumerRegs == 3 * 168, "setmaxnreg split of 168 x 384");
  static constexpr int kQBytes = kRows * DP * 2;
  static constexpr int kKBytes = kTile * DP * 2;
  static constexpr int kVBytes = DP * kTile * 2;
  /* shared memory map. Small arrays from the (16-byte aligned) base: */
  static constexpr int kOffBias = 0;
  static constexpr int kOffQbar = kOffBias + kStages * kTile * 4;
  static constexpr int kSmall = kOffQbar + DP * 4;
  /* operand tiles from the first 1024-byte boundary after them (offsets from that boundary): */
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKBytes;
  static constexpr int kTiles = kOffV + kStages * kVBytes;
  static constexpr int kSmem = kSmall + 1023 + kTiles; /* 232447 bytes for DP = 128 (H100/H200: 232448) */
};

template <int DP>
struct Kernel {
  using C = Config<DP>;

  struct Block : QueryBlock {
    const AttnArgs *a;
    char *small, *tiles; /* see Config */
    __device__ __half *tile(int off) const { return reinterpret_cast<__half *>(tiles + off); }
    __device__ float *bias(int stage) const { return reinterpret_cast<float *>(small + C::kOffBias) + stage * kTile; }
    __device__ float *qbar() const { return reinterpret_cast<float *>(small + C::kOffQbar); }
  };

#if defined(FP4ATTN_SM90_WGMMA)
  /* ---------------------------------------------------------------- producer warpgroup */
  /* How the producer computes the q-mean bias: on mma.sync (BiasMma, 16-bit K with 16-byte rows)
   * or with FP32 FMAs (compute_bias: FP32 K, unaligned rows). One producer loop per way, so the
   * loop carries no dtype tests. */
  enum class BiasPath { kMmaF16, kMmaBf16, kFma };

  static __device__ void producer(const Block &k) {
    const AttnArgs &a = *k.a;
    if (a.vec_k && a.p.dtype == FP4ATTN_BFLOAT16)
      producer_loop<BiasPath::kMmaBf16>(k);
    else if (a.vec_k && a.p.dtype == FP4ATTN_FLOAT16)
      producer_loop<BiasPath::kMmaF16>(k);
    else
      producer_loop<BiasPath::kFma>(k);
  }

  template <BiasPath kBias>
  static __device__ void producer_loop(const Block &k) {
    const AttnArgs &a = *k.a;
    const AttnWorkspace &w = a.ws;
    const int tid = threadIdx.x, warp = tid >> 5; /* 0..127, 0..3 */
    /* 16-byte chunk u of this thread is chunk tid + 128 u of the tile in memory order; in the
     * swizzled tile it lands at a fixed offset plus u whole 8-row groups (the swizzle depends on
     * row % 8 only), so every address below is a base plus a constant. */
    constexpr int KCH = DP / 8, VCH = kTile / 8; /* 16-byte chunks per row of K^ and of V^T */
    constexpr int KN = kTile * KCH / 128, VN = DP * VCH / 128; /* chunks per thread */
    const uint32_t koff = 2 * sw128_offset(kTile, tid / KCH, (tid % KCH) * 8);
    const uint32_t voff = 2 * sw128_offset(DP, tid / VCH, (tid % VCH) * 8);
    BiasMma<DP, kBias == BiasPath::kMmaBf16> bias_mma;
    if (kBias != BiasPath::kFma) bias_mma.init(a, k.b, k.hk, warp * 32, k.qbar());
    for (int j = 0, buf = 0; j < k.ntiles; ++j, buf = buf + 1 == kStages ? 0 : buf + 1) {
      if (j >= kStages) named_sync(kBarEmpty + buf, kThreads);
      const __half *kg = w.kdq + (k.bhk * w.nkp + (int64_t)j * kTile) * DP + tid * 8; /* [128][DP] */
      const __half *vg = w.vdq + (k.bhk * w.nkt + j) * (int64_t)DP * kTile + tid * 8;  /* [DP][128] */
      const uint32_t ks = smem_u32(k.tiles + C::kOffK + buf * C::kKBytes) + koff;
      const uint32_t vs = smem_u32(k.tiles + C::kOffV + buf * C::kVBytes) + voff;
#pragma unroll
      for (int u = 0; u < KN; ++u) cp_async_16_u32(ks + u * (128 / KCH) * 128, kg + u * 1024);
#pragma unroll
      for (int u = 0; u < VN; ++u) cp_async_16_u32(vs + u * (128 / VCH) * 128, vg + u * 1024);
      cp_async_commit();
      if (kBias != BiasPath::kFma)
        bias_mma.compute(a, j, k.bias(buf) + warp * 32);
      else
        compute_bias<DP, 1>(a, k.b, k.hk, (int64_t)j * kTile + tid, 0, k.qbar(), k.bias(buf) + tid);
      cp_async_wait_all();
      fence_proxy_async(); /* the tiles are read by wgmma (async proxy) */
      named_arrive(kBarFull + 2 * buf + 0, kFullCount);
      named_arrive(kBarFull + 2 * buf + 1, kFullCount);
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
    const AttnArgs &a = *k.a;
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
      named_sync(kBarFull + cwg, kFullCount);
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
        named_sync(kBarFull + 2 * buf + cwg, kFullCount);
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
    store_rows<DP>(a, rows, k.bh, o, omul, st, k.qbar(), w.kbar + k.bhk * DP);
  }

  static __device__ void run(const AttnArgs &a, char *smem) {
    /* the operand tiles need 1024-byte alignment (the swizzle works on address bits) */
    const uint32_t tiles_at = (smem_u32(smem) + C::kSmall + 1023u) & ~1023u;
    const fp4attn_attention_params &p = a.p;
    const AttnWorkspace &w = a.ws;
    Block k;
    k.a = &a;
    k.small = smem;
    k.tiles = smem + (tiles_at - smem_u32(smem));
    static_cast<QueryBlock &>(k) = query_block(p, w, kRows);

    /* prologue, all threads: qbar, Q^ (exact FP16 values, swizzled for wgmma) */
    for (int i = threadIdx.x; i < DP; i += kThreads) k.qbar()[i] = w.qbar[(k.bh * w.nqb + k.q0 / kTile) * DP + i];
    __syncthreads();
    __half *qs = k.tile(C::kOffQ);
    quantize_q_rows<DP>(a, k.b, k.h, k.bh, k.q0, kRows, k.qbar(), threadIdx.x, kThreads,
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
__global__ void __launch_bounds__(kThreads, 1) attention_fwd_sm90_kernel(const __grid_constant__ AttnArgs a) {
#if defined(FP4ATTN_SM90_WGMMA)
  extern __shared__ __align__(16) char smem[];
  Kernel<DP>::run(a, smem);
#else
  __trap(); /* never launched: the host launches this kernel only for sm_90a builds on CC 9.0 */
#endif
}

template <int DP>
fp4attn_status launch(const AttnArgs &a, cudaStream_t s) {
  static bool configured[64] = {false};
  return launch_forward(attention_fwd_sm90_kernel<DP>, a, kRows, kThreads, Config<DP>::kSmem, configured,
                        "attention (sm90 kernel)", s);
}

}  // namespace sm90
}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_HOPPER_ATTENTION_FWD_SM90_CUH */
