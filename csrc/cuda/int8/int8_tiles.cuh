/*
 * Shared pieces of the 8-bit attention kernels (docs/SPEC_INT8.md): block sizes, the workspace
 * the preparation kernels fill and the attention kernels read, the INT8 psi code, the s8 MMA,
 * 16-bit A fragments from accumulators (P16, dS16), the mma.sync forward's P16 V16 product
 * (FP16 or BF16 MMA, SPEC_INT8 2.4) and the epilogues.
 *
 * Fragment conventions (g = lane / 4, t = lane % 4): the m16n8 accumulator holds rows g, g + 8
 * and columns 2t, 2t + 1 of each 8-column tile; the A operand of m16n8k32 holds row g / g + 8 and
 * k = 4t..4t+3 (+16); B holds k = 4t..4t+3 (+16) of column g; the A operand of m16n8k16 holds
 * k = 2t, 2t + 1 (+8), so an accumulator in 16 bits is an A operand as it stands (acc_to_a16).
 */
#ifndef FP4ATTN_CUDA_INT8_INT8_TILES_CUH
#define FP4ATTN_CUDA_INT8_INT8_TILES_CUH

#include "../common/smem_tiles.cuh"
#include "../tile/mask.cuh"

namespace fp4attn_cuda {

constexpr int kBQ8 = 64; /* SPEC_INT8 BQ: query rows per block (one Q^ scale, backward row block) */
constexpr int kBK8 = 128;    /* SPEC_INT8 BK: keys per block and per online-softmax step */
constexpr int kQaRows = 128; /* query rows per partial column amax of Q (the migration's qa) */

/* Head dims the INT8 kernels are instantiated for (inputs are zero-padded up to them). */
static inline int64_t int8_padded_head_dim(int64_t d) {
  return d <= 64 ? 64 : (d <= 128 ? 128 : 256);
}

/* The workspace of one call; every operand tile is zero-padded to whole blocks and to dp. */
struct Int8Workspace {
  int64_t dp, nqb, nkb, nqp, nkp; /* padded head dim, block counts, padded lengths */
  int64_t nqa;                    /* partial amaxes of Q per query head: ceil(len_q / kQaRows) */
  float *kbar_part;               /* [bhk][nkb][dp]: per-block column sums of K */
  float *kmax_part, *kmin_part;   /* [bhk][nkb][dp]: per-block column max / min of K */
  float *qa_part;                 /* [bhq][nqa][dp]: column amax of |Q| per kQaRows rows */
  float *kbar;                    /* [bhk][dp] */
  float *mig, *mig_inv;           /* [bhk][dp]: SPEC_INT8 2.1b's s (1 past D), 1 / s */
  int8_t *kc;                     /* [bhk][nkp][dp]: K^ = psi((K - kbar) / s) per 128 keys */
  float *sk;                      /* [bhk][nkb] */
  /* V16 (SPEC_INT8 2.2: V in the 16-bit operand type), the forward's P.V and the backward's dP
   * operand. The forward reads it transposed per block (v_tiles: the mma.sync forward, and the
   * sm90 one unless Int8Plan::v_rows), the rest by rows: the sm90 kernels TMA-load the caller's
   * V where it is V16 already (v_caller, see int8_v_caller); otherwise the preparation writes
   * it, to vt16 or v16. */
  bool v_tiles, v_caller;
  uint16_t *vt16; /* [bhk][nkb][dp][128] */
  uint16_t *v16;  /* [bhk][nkp][dp] */
  int8_t *qc;     /* [bhq][nqp][dp]: Q^ = psi(Q s) per 64 rows */
  float *sq;      /* [bhq][nqb] */
  float *qshift;  /* [bhq][nqp]: scale * (q . kbar), the lse's smoothing term */
  /* the sm90 forward's next item past its first wave (zeroed by the statistics kernel) */
  unsigned *next_item;
  /* backward only */
  /* K - kbar in 16 bits (dQ's operand): [bhk][nkp][dp] for the mma.sync backward; ks16_t (the
   * sm90 backward, whose dQ reads it as a K-major B) [bhk][nkb][dp][128], transposed per block */
  bool ks16_t;
  uint16_t *ks16;
  uint16_t *q16;  /* [bhq][nqp][dp]: Q in 16 bits (dK's operand) */
  uint16_t *do16; /* [bhq][nqp][dp]: dO in 16 bits (dP's and dV's operand) */
  float *drow;    /* [bhq][nqp]: rowsum(dO * O) - dlse (0 on padding rows) */
  float *lse2;    /* [bhq][nqp]: (lse - qshift) * log2(e), +inf where no key is visible */
  float *dq_acc;  /* [bhq][len_q][dp]: FP32 dQ accumulated by the key blocks */
  /* Int8Plan::deterministic: [bhq][nqb][2], per query block and half of dQ's columns the key
   * blocks that have added theirs (zeroed with dq_acc) */
  unsigned *dq_sem;
  int64_t bytes;
};

/* Everything an INT8 kernel reads: the forward's params (out/lse as the forward returned them
 * in the backward), the workspace, and the backward's extra tensors. */
struct Int8Args {
  fp4attn_attention_params p;
  Int8Workspace ws;
  const void *grad_out;
  int64_t grad_out_stride[3];
  const float *grad_lse;
  void *dq, *dk, *dv; /* contiguous like q, k, v */
  bool bf16_ops; /* the 16-bit operands (V16, P16, dP's) are BF16 (input bf16 or fp32), else FP16 */
  bool vec_q, vec_k, vec_v, vec_out, vec_do; /* rows allow 16-byte loads (vector_rows) */
};

/* The caller's V is V16 as it stands and a TMA source of the sm90 kernels (their 4-D map of
 * int8_v16_rows): 16-bit, a 16-byte aligned base, and strides that are positive multiples of 8
 * elements wherever the dimension has more than one index (a broadcast head has stride 0). */
static inline bool int8_v_caller(const fp4attn_attention_params *p) {
  if (p->dtype == FP4ATTN_FLOAT32 || (reinterpret_cast<uintptr_t>(p->v) & 15u) != 0) return false;
  const int64_t sizes[3] = {p->batch, p->heads_kv, p->len_k};
  for (int i = 0; i < 3; ++i)
    if (sizes[i] > 1 &&
        (p->v_stride[i] <= 0 || p->v_stride[i] % 8 != 0 || p->v_stride[i] >= (int64_t)1 << 38))
      return false;
  return true;
}

/* How an 8-bit call runs (planned by heuristics.h, plan_int8_attention); the workspace is sized
 * for it. */
struct Int8Plan {
  fp4attn_kernel kernel; /* SM80 or SM90 */
  bool v_rows;           /* the sm90 forward reads V16 by rows, not as transposed tiles */
  bool v_caller;         /* the sm90 kernels read the caller's V as V16 (int8_v_caller) */
  bool deterministic;    /* backward: dQ's key blocks added in a fixed order */
};

/* Fills the section pointers for `base` (null: sizes only) of a call run as `plan`; backward adds
 * its sections. */
static inline Int8Workspace int8_workspace_layout(const fp4attn_attention_params *p, bool backward,
                                                  const Int8Plan &plan, void *base) {
  Int8Workspace w;
  w.dp = int8_padded_head_dim(p->head_dim);
  w.nqb = ceil_div(p->len_q, kBQ8);
  w.nkb = ceil_div(p->len_k, kBK8);
  w.nqp = w.nqb * kBQ8;
  w.nkp = w.nkb * kBK8;
  w.nqa = ceil_div(p->len_q, kQaRows);
  const int64_t bhq = p->batch * p->heads_q, bhk = p->batch * p->heads_kv, dp = w.dp;
  int64_t off = 0;
  char *b = static_cast<char *>(base);
  auto take = [&](int64_t bytes) -> void * {
    void *r = b && bytes ? b + off : nullptr;
    off += round_up(bytes, 256);
    return r;
  };
  w.kbar_part = (float *)take(4 * bhk * w.nkb * dp);
  w.kmax_part = (float *)take(4 * bhk * w.nkb * dp);
  w.kmin_part = (float *)take(4 * bhk * w.nkb * dp);
  w.qa_part = (float *)take(4 * bhq * w.nqa * dp);
  w.kbar = (float *)take(4 * bhk * dp);
  w.mig = (float *)take(4 * bhk * dp);
  w.mig_inv = (float *)take(4 * bhk * dp);
  w.kc = (int8_t *)take(bhk * w.nkp * dp);
  w.sk = (float *)take(4 * bhk * w.nkb);
  w.v_tiles = !backward && !(plan.kernel == FP4ATTN_KERNEL_SM90 && plan.v_rows);
  w.v_caller = plan.v_caller;
  w.vt16 = (uint16_t *)take(w.v_tiles ? 2 * bhk * w.nkp * dp : 0);
  w.v16 = (uint16_t *)take(w.v_tiles || w.v_caller ? 0 : 2 * bhk * w.nkp * dp);
  w.qc = (int8_t *)take(bhq * w.nqp * dp);
  w.sq = (float *)take(4 * bhq * w.nqb);
  w.qshift = (float *)take(4 * bhq * w.nqp);
  w.next_item = (unsigned *)take(!backward && plan.kernel == FP4ATTN_KERNEL_SM90 ? 4 : 0);
  const int64_t bw = backward ? 1 : 0;
  w.ks16_t = backward && plan.kernel == FP4ATTN_KERNEL_SM90;
  w.ks16 = (uint16_t *)take(bw * 2 * bhk * w.nkp * dp);
  w.q16 = (uint16_t *)take(bw * 2 * bhq * w.nqp * dp);
  w.do16 = (uint16_t *)take(bw * 2 * bhq * w.nqp * dp);
  w.drow = (float *)take(bw * 4 * bhq * w.nqp);
  w.lse2 = (float *)take(bw * 4 * bhq * w.nqp);
  w.dq_acc = (float *)take(bw * 4 * bhq * p->len_q * dp);
  w.dq_sem = (unsigned *)take(backward && plan.deterministic ? 4 * bhq * w.nqb * 2 : 0);
  w.bytes = off;
  return w;
}

/* V16 as the sm90 kernels' TMA sees it: 16-bit words {width, keys, KV heads, batch} with the byte
 * strides of the outer three; the caller's V (v_caller: width head_dim, the TMA zero-fills up to
 * dp and past len_k) or the workspace's v16. A dimension of one index gets the stride a packed
 * tensor would have, which the driver accepts whatever the caller's was. */
struct Int8Rows16 {
  const void *base;
  uint64_t dims[4], strides[3];
};
static inline Int8Rows16 int8_v16_rows(const Int8Args &a) {
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  if (!w.v_caller) { /* the workspace's v16: [bhk][nkp][dp] */
    const uint64_t row = 2 * (uint64_t)w.dp, head = row * (uint64_t)w.nkp;
    return {w.v16,
            {(uint64_t)w.dp, (uint64_t)w.nkp, (uint64_t)p.heads_kv, (uint64_t)p.batch},
            {row, head, head * (uint64_t)p.heads_kv}};
  }
  const uint64_t row =
      p.len_k > 1 ? 2 * (uint64_t)p.v_stride[2] : (uint64_t)round_up(2 * p.head_dim, 16);
  const uint64_t head = p.heads_kv > 1 ? 2 * (uint64_t)p.v_stride[1] : row * (uint64_t)p.len_k;
  const uint64_t batch = p.batch > 1 ? 2 * (uint64_t)p.v_stride[0] : head * (uint64_t)p.heads_kv;
  return {p.v,
          {(uint64_t)p.head_dim, (uint64_t)p.len_k, (uint64_t)p.heads_kv, (uint64_t)p.batch},
          {row, head, batch}};
}

/* ------------------------------------------------------------------------ device helpers */

/* The backward's deterministic dQ order (Int8Workspace::dq_sem): the key blocks that see query
 * block i (j' with i_start(j') = j' kBK8 / kBQ8 <= i under causality) add to its dQ in ascending
 * order, or descending under causality, where a key block's first query block then waits for
 * none. The grids launch a head's key blocks in that order (block x of the head is key block
 * dq_key_block(x)), so that every wait is on a block launched earlier. */
__device__ __forceinline__ int64_t dq_key_block(bool causal, int64_t nkb, int64_t x) {
  return causal ? nkb - 1 - x : x;
}
/* Key block j's place in that order for query block i. */
__device__ __forceinline__ unsigned dq_rank(bool causal, int64_t nkb, int64_t i, int64_t j) {
  return (unsigned)(causal ? min(nkb - 1, i * kBQ8 / kBK8) - j : j);
}

/* SPEC_INT8 1 for one value: clamp(rne_int(x * r), -127, 127), r = 127 / amax or 0 for a
 * flushed group (a NaN product converts to 0; its scale is NaN then). */
__device__ __forceinline__ int code_s8(float x, float r) {
  return max(-127, min(127, __float2int_rn(x * r)));
}
/* The group's (r, scale) from its amax; r = 0 where 127 / amax overflows (SPEC_INT8 1). */
__device__ __forceinline__ void psi_factors(float amax, float &r, float &scale) {
  r = 127.0f / amax;
  scale = amax / 127.0f;
  if (r == INFINITY) r = scale = 0.0f;
}

__device__ __forceinline__ uint32_t pack_s8x4(int a, int b, int c, int d) {
  return (uint32_t)(a & 0xFF) | ((uint32_t)(b & 0xFF) << 8) | ((uint32_t)(c & 0xFF) << 16) |
         ((uint32_t)d << 24);
}

/* D += A (16x32, row) * B (32x8, col), signed bytes, exact int32 accumulation. */
__device__ __forceinline__ void mma_s8(int (&d)[4], const uint32_t (&a)[4],
                                       const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* ln(448), log2(448): the forward's W = 448 exp(S - m) (SPEC_INT8 2.4), whose row sums l are. */
constexpr float kLn448 = 6.1047932324149849f;
constexpr float kLog2_448 = 8.8073549220576041f;

/* ---- The forward's P16 V16 on mma.sync (SPEC_INT8 2.4): FP16 or (kBf16) BF16 MMA of P16 and the
 * preparation's V16 tiles, accumulated into O. */

/* P16 of one 128-key step as the A fragments of its eight k16 steps (k16 step s = accumulator
 * tiles 2s, 2s + 1: natural key order, m16n8k16's A layout). */
struct P16 {
  uint32_t a[8][4];
};

/* Two values rounded to nearest even to FP16 or (kBf16) BF16, packed (a low). */
template <bool kBf16>
__device__ __forceinline__ uint32_t pack16x2(float a, float b) {
  if constexpr (kBf16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t *>(&h);
  } else {
    return pack_half2(a, b);
  }
}

/* The A fragments of kSteps k16 steps from FP32 values in accumulator layout (2 kSteps tiles of 8
 * columns, step k = tiles 2k, 2k + 1), rounded to nearest even to the 16-bit type: an m16n8k16 /
 * wgmma accumulator becomes the A operand of the next product in registers. */
template <bool kBf16, int kSteps>
__device__ __forceinline__ void acc_to_a16(const float (&w)[2 * kSteps][4],
                                           uint32_t (&a)[kSteps][4]) {
#pragma unroll
  for (int k = 0; k < kSteps; ++k)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int n = 2 * k + (q >> 1), e = 2 * (q & 1);
      a[k][q] = pack16x2<kBf16>(w[n][e], w[n][e + 1]);
    }
}

/* P16 = W rounded to the 16-bit type, from W in accumulator layout (16 tiles of 8 keys). */
template <bool kBf16>
__device__ __forceinline__ void make_p16(const float (&w)[16][4], P16 &p) {
  acc_to_a16<kBf16, 8>(w, p.a);
}

/* O += P16 V16 over output tiles 2np, 2np + 1 (columns 16np .. 16np + 15): vt the step's swizzled
 * [DP][128] tile of V16 (keys in natural order). */
template <bool kBf16, int NB>
__device__ __forceinline__ void mma_p16_v(float (&o)[NB][4], const P16 &p, const char *vt, int np) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    uint32_t vb[2][2];
    ldsm_b<2 * kBK8>(vb, vt, 16 * np, 32 * k);
    mma_16816<kBf16>(o[2 * np], p.a[k], vb[0][0], vb[0][1]);
    mma_16816<kBf16>(o[2 * np + 1], p.a[k], vb[1][0], vb[1][1]);
  }
}

/* dst[0..1] += (x, y) atomically (8-byte aligned): one vector atomic on sm_90 and newer. */
__device__ __forceinline__ void add_pair(float *dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2 *>(dst), make_float2(x, y));
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

/* The backward's score s (log2 units) of (row, key) of head (b, h) with the masks applied: plus
 * the additive mask, or -inf where the key is hidden (past len_k or len_q, causal, a false boolean
 * mask), so that exp2(score - lse2) is P, 0 where hidden (SPEC_INT8 3). */
__device__ __forceinline__ float masked_score(const fp4attn_attention_params &p, int64_t b,
                                              int64_t h, int64_t row, int64_t key, float s) {
  if (key >= p.len_k || row >= p.len_q || (p.causal && key > row)) return -INFINITY;
  if (p.mask_kind == FP4ATTN_MASK_NONE) return s;
  const int64_t off =
      b * p.mask_stride[0] + h * p.mask_stride[1] + row * p.mask_stride[2] + key * p.mask_stride[3];
  if (p.mask_kind == FP4ATTN_MASK_BOOL)
    return static_cast<const uint8_t *>(p.mask)[off] != 0 ? s : -INFINITY;
  return s + mask_log2(load_as_float(p.mask, p.mask_dtype, off));
}

/* The backward's epilogue: dK and dV of one warp's 16 keys from key0 (accumulator layout, columns
 * d0 + 8n + 2t) into the contiguous [B, Hkv, Nk, D] gradients of KV head bhk, in the input dtype;
 * keys past len_k and columns past head_dim are not stored. dk holds dS16^T Q16 summed over the
 * KV head's query heads; dK = scale times that (SPEC_INT8 3). */
template <int N>
__device__ __forceinline__ void store_dk_dv_rows(const Int8Args &a, int64_t bhk, int64_t key0,
                                                 int d0, const float (&dk)[N][4],
                                                 const float (&dv)[N][4]) {
  const fp4attn_attention_params &p = a.p;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const bool pair_ok = p.head_dim % 2 == 0;
#pragma unroll
  for (int n = 0; n < N; ++n) {
    const int col = d0 + n * 8 + 2 * t;
    if (col >= p.head_dim) continue;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t key = key0 + g + 8 * r;
      if (key >= p.len_k) continue;
      const int64_t at = (bhk * p.len_k + key) * p.head_dim + col;
      const float dk0 = __fmul_rn(p.scale, dk[n][2 * r]);
      if (col + 1 < p.head_dim) {
        store2_from_float(a.dk, p.dtype, at, dk0, __fmul_rn(p.scale, dk[n][2 * r + 1]), pair_ok);
        store2_from_float(a.dv, p.dtype, at, dv[n][2 * r], dv[n][2 * r + 1], pair_ok);
      } else {
        store_from_float(a.dk, p.dtype, at, dk0);
        store_from_float(a.dv, p.dtype, at, dv[n][2 * r]);
      }
    }
  }
}

/* The forward's epilogue for one warp's 16 query rows from rows.row0 (accumulator layout, see the
 * file comment): O / l in the input dtype and lse = m ln2 + log(l) - ln(448) + scale (q . kbar)
 * (SPEC_INT8 2.5); m in log2 units, l this thread's partial row sums of W (quad-reduced here).
 * Rows past len_q are not stored. */
template <int DP>
__device__ __forceinline__ void store_forward_rows(const fp4attn_attention_params &p,
                                                   const Int8Workspace &w, const WarpRows &rows,
                                                   int64_t bh, const float (&o)[DP / 8][4],
                                                   const float (&m)[2], const float (&l)[2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const bool pair_ok = p.head_dim % 2 == 0 && p.out_stride[0] % 2 == 0 &&
                       p.out_stride[1] % 2 == 0 && p.out_stride[2] % 2 == 0 &&
                       (reinterpret_cast<uintptr_t>(p.out) % (2 * dtype_size(p.dtype))) == 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lsum = quad_sum(l[r]);
    const int64_t row = rows.row0 + g + 8 * r;
    if (row >= p.len_q) continue;
    const int64_t base =
        rows.b * p.out_stride[0] + rows.h * p.out_stride[1] + row * p.out_stride[2];
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) {
      const int col = n * 8 + 2 * t;
      if (col >= p.head_dim) continue;
      const float v0 = lsum != 0.0f ? o[n][2 * r] / lsum : 0.0f;
      const float v1 = lsum != 0.0f ? o[n][2 * r + 1] / lsum : 0.0f;
      if (col + 1 < p.head_dim)
        store2_from_float(p.out, p.dtype, base + col, v0, v1, pair_ok);
      else
        store_from_float(p.out, p.dtype, base + col, v0);
    }
    if (t == 0)
      p.lse[bh * p.len_q + row] =
          lsum != 0.0f ? (m[r] * kLn2 + (logf(lsum) - kLn448)) + w.qshift[bh * w.nqp + row]
                       : -INFINITY;
  }
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_INT8_INT8_TILES_CUH */
