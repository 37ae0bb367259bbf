/*
 * The preparation kernels of the 8-bit attention (docs/SPEC_INT8.md 2.1-2.2, 3): one pass over the
 * inputs that leaves every operand of the attention kernels in the workspace (int8_tiles.cuh).
 * Each block stages its rows once in shared memory as floats (coalesced 16-byte loads where the
 * rows allow) and reads them from there in every order its outputs need.
 *
 * - kbar: per 128-key block column sums of K, then their ordered sum / Nk (deterministic, so that
 *   the backward recomputes the forward's K^ bit for bit), with the column max and min of K.
 * - the channel migration (SPEC_INT8 2.1b): the column amax of |Q| per kQaRows rows, then per
 *   (batch, KV head) and channel qa (over the group's query heads), ka from K's max, min and kbar,
 *   and s = fp4attn_int8_migration_factor(qa, ka) with 1 / s (max and min are exact in any order).
 * - K, V: K^ = psi((K - kbar) / s) per 128 keys (row-major; transposed too for the backward);
 *   V^ = psi(V) per 128 keys and channel (perm tiles; forward), V in 16 bits (backward).
 * - Q: Q^ = psi(Q s) per 64 rows (row-major; perm tiles for the backward), and the lse's
 *   smoothing term scale * (q . kbar) per row, of the unmigrated q.
 * - dO (backward): Drow = rowsum(dO * O) - dlse (16-bit operands, like dP), the smoothed lse in
 *   log2 units, dO^ per channel over each 64-row block (perm tiles), dO in 16 bits.
 * - finish_dq (backward): dQ = the kernel's FP32 sum * s + scale * dlse kbar, in the input
 *   dtype (the kernels' dK epilogue divides by s).
 */
#include "attention_int8.h"
#include "fp4attn/int8_migration.h"
#include "int8_tiles.cuh"

namespace fp4attn_cuda {
namespace {

constexpr int kThreads = 256;

/* max of non-negative floats by their bits: a NaN (sign cleared) beats +inf, as SPEC_INT8 asks */
__device__ __forceinline__ float amax_u(float a, float b) {
  return __uint_as_float(max(__float_as_uint(a), __float_as_uint(b)));
}

__device__ float block_amax(float v, float *red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = amax_u(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) v = amax_u(v, red[w]);
  __syncthreads();
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ uint16_t to16(float x, bool bf16) {
  return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}

/* A value as dP and Drow see it (SPEC_INT8 3): FP32 inputs rounded to BF16. */
__device__ __forceinline__ float as16(float x, fp4attn_dtype dt) {
  return dt == FP4ATTN_FLOAT32 ? __bfloat162float(__float2bfloat16_rn(x)) : x;
}

/* 16 codes as one 16-byte store: code(e) for e = 0..15. */
template <typename F>
__device__ __forceinline__ void store16(int8_t *dst, F code) {
  uint32_t w[4];
#pragma unroll
  for (int q = 0; q < 4; ++q)
    w[q] = pack_s8x4(code(4 * q), code(4 * q + 1), code(4 * q + 2), code(4 * q + 3));
  *reinterpret_cast<uint4 *>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

/* Rows r0 .. r0 + rows - 1 of x's (b, h) matrix into a float tile [rows_max][dp + 4] in shared
 * memory, coalesced (16-byte loads where `vec`), zeros past `rows` and past D. Each thread issues
 * kBatch loads before it stores any: the compiler cannot move a global load above a store through
 * another pointer, and one load in flight per thread leaves DRAM idle. */
__device__ __forceinline__ void stage_rows(float *tile, const void *x, fp4attn_dtype dt,
                                           const int64_t *st, int64_t b, int64_t h, int64_t r0,
                                           int rows, int rows_max, int D, int dp, bool vec) {
  constexpr int kBatch = 4;
  const int groups = dp / 8, pitch = dp + 4, n = rows_max * groups;
  for (int i0 = threadIdx.x; i0 < n; i0 += kBatch * kThreads) {
    float v[kBatch][8];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = i0 + u * kThreads, r = i / groups, c = (i % groups) * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) v[u][e] = 0.0f;
      if (i < n && r < rows)
        load8_padded(x, dt, b * st[0] + h * st[1] + (r0 + r) * st[2], c, D, vec, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = i0 + u * kThreads, r = i / groups, c = (i % groups) * 8;
      if (i >= n) break;
      float4 *dst = reinterpret_cast<float4 *>(tile + r * pitch + c);
      dst[0] = make_float4(v[u][0], v[u][1], v[u][2], v[u][3]);
      dst[1] = make_float4(v[u][4], v[u][5], v[u][6], v[u][7]);
    }
  }
}

/* Row-major codes of a staged tile's kRows rows with one scale per tile (psi of its amax m, the
 * block-wide value): thread 0 writes the scale to *scale, the codes go to out [kRows][dp].
 * Returns the factor r, for further codes of the same tile. */
template <int kRows>
__device__ __forceinline__ float code_rows(const float *tile, int pitch, int dp, float m,
                                           float *scale, int8_t *out) {
  float r, s;
  psi_factors(m, r, s);
  if (threadIdx.x == 0) *scale = s;
  for (int i = threadIdx.x; i < kRows * (dp / 16); i += kThreads) {
    const int n = i / (dp / 16), d0 = (i % (dp / 16)) * 16;
    store16(out + n * dp + d0, [&](int e) { return code_s8(tile[n * pitch + d0 + e], r); });
  }
  return r;
}

/* Per-channel codes of a staged tile (the first `rows` of its kRows rows are real): channel d's
 * scale (psi of its amax over the rows) to scales[d], its kRows codes in perm16 order to
 * out + d x kRows. kThreads / dp neighbouring threads share a channel (its rows for the amax, its
 * 16-code groups for the stores), so that every thread works at dp < kThreads. */
template <int kRows>
__device__ __forceinline__ void code_channels(const float *tile, int pitch, int rows, int dp,
                                              float *scales, int8_t *out) {
  const int tpc = dp < kThreads ? kThreads / dp : 1; /* 1, 2 or 4: lanes of one warp */
  const int part = threadIdx.x % tpc;
  for (int d = threadIdx.x / tpc; d < dp; d += kThreads / tpc) {
    float m = 0.0f;
    for (int n = part; n < rows; n += tpc) m = amax_u(m, fabsf(tile[n * pitch + d]));
    for (int o = 1; o < tpc; o <<= 1) m = amax_u(m, __shfl_xor_sync(0xffffffffu, m, o));
    float r, s;
    psi_factors(m, r, s);
    if (part == 0) scales[d] = s;
    for (int c0 = 16 * part; c0 < kRows; c0 += 16 * tpc)
      store16(out + d * kRows + c0,
              [&](int e) { return code_s8(tile[(c0 + perm16(e)) * pitch + d], r); });
  }
}

/* Shared-memory bytes of a staged tile of `rows` rows. */
__host__ __device__ constexpr int tile_bytes(int rows, int dp) {
  return rows * (dp + 4) * 4;
}

/* A block's threads over a row-major [rows][dp] input: thread t reads columns c .. c + 7 of rows
 * lane, lane + lanes, ... (8-column groups across the threads, row lanes per group). */
struct ColumnLanes {
  int lanes, c, lane;
  __device__ explicit ColumnLanes(int dp)
      : lanes(kThreads / (dp / 8)), c((threadIdx.x % (dp / 8)) * 8), lane(threadIdx.x / (dp / 8)) {}
};

__global__ void __launch_bounds__(kThreads) kbar_partial_kernel(const Int8Args a) {
  __shared__ float part[kThreads * 8], pmax[kThreads * 8], pmin[kThreads * 8];
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int64_t bhk = blockIdx.x / w.nkb, j = blockIdx.x % w.nkb;
  const int64_t b = bhk / p.heads_kv, hk = bhk % p.heads_kv, n0 = j * kBK8;
  const int rows = (int)min((int64_t)kBK8, p.len_k - n0), dp = (int)w.dp;
  const ColumnLanes cl(dp);
  const int lanes = cl.lanes, c = cl.c, lane = cl.lane;
  float s[8], mx[8], mn[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) s[e] = 0.0f, mx[e] = -INFINITY, mn[e] = INFINITY;
  for (int r = lane; r < rows; r += lanes) {
    float v[8];
    load8_padded(p.k, p.dtype, b * p.k_stride[0] + hk * p.k_stride[1] + (n0 + r) * p.k_stride[2], c,
                 (int)p.head_dim, a.vec_k, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      s[e] += v[e];
      mx[e] = fmaxf(mx[e], v[e]); /* a NaN makes kbar, and so ka, NaN */
      mn[e] = fminf(mn[e], v[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    part[lane * dp + c + e] = s[e];
    pmax[lane * dp + c + e] = mx[e];
    pmin[lane * dp + c + e] = mn[e];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < dp; d += kThreads) { /* the lanes in a fixed order */
    float t = 0.0f, hi = -INFINITY, lo = INFINITY;
    for (int l = 0; l < lanes; ++l) {
      t += part[l * dp + d];
      hi = fmaxf(hi, pmax[l * dp + d]);
      lo = fminf(lo, pmin[l * dp + d]);
    }
    w.kbar_part[(bhk * w.nkb + j) * dp + d] = t;
    w.kmax_part[(bhk * w.nkb + j) * dp + d] = hi;
    w.kmin_part[(bhk * w.nkb + j) * dp + d] = lo;
  }
}

/* The column amax of |Q| over kQaRows rows of one (batch, query head) (NaN propagates). */
__global__ void __launch_bounds__(kThreads) q_amax_partial_kernel(const Int8Args a) {
  __shared__ float part[kThreads * 8];
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int64_t bh = blockIdx.x / w.nqa, i = blockIdx.x % w.nqa;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q, r0 = i * kQaRows;
  const int rows = (int)min((int64_t)kQaRows, p.len_q - r0), dp = (int)w.dp;
  const ColumnLanes cl(dp);
  const int lanes = cl.lanes, c = cl.c, lane = cl.lane;
  float m[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int r = lane; r < rows; r += lanes) {
    float v[8];
    load8_padded(p.q, p.dtype, b * p.q_stride[0] + h * p.q_stride[1] + (r0 + r) * p.q_stride[2], c,
                 (int)p.head_dim, a.vec_q, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) m[e] = amax_u(m[e], fabsf(v[e]));
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) part[lane * dp + c + e] = m[e];
  __syncthreads();
  for (int d = threadIdx.x; d < dp; d += kThreads) {
    float t = 0.0f;
    for (int l = 0; l < lanes; ++l) t = amax_u(t, part[l * dp + d]);
    w.qa_part[(bh * w.nqa + i) * dp + d] = t;
  }
}

/* kbar, and SPEC_INT8 2.1b's s and 1 / s, of one (batch, KV head). */
__global__ void __launch_bounds__(kThreads) kbar_final_kernel(const Int8Args a) {
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int64_t bhk = blockIdx.x, G = p.heads_q / p.heads_kv;
  const int64_t bh0 = (bhk / p.heads_kv) * p.heads_q + (bhk % p.heads_kv) * G; /* 1st query head */
  for (int d = threadIdx.x; d < w.dp; d += kThreads) {
    float s = 0.0f, hi = -INFINITY, lo = INFINITY;
    for (int64_t j = 0; j < w.nkb; ++j) {
      const int64_t at = (bhk * w.nkb + j) * w.dp + d;
      s += w.kbar_part[at];
      hi = fmaxf(hi, w.kmax_part[at]);
      lo = fminf(lo, w.kmin_part[at]);
    }
    float qa = 0.0f;
    for (int64_t e = 0; e < G * w.nqa; ++e)
      qa = amax_u(qa, w.qa_part[(bh0 * w.nqa + e) * w.dp + d]);
    const float kbar = d < p.head_dim ? s / (float)p.len_k : 0.0f;
    const float mig =
        d < p.head_dim ? fp4attn_int8_migration_factor(qa, fp4attn_int8_migration_ka(hi, lo, kbar))
                       : 1.0f;
    w.kbar[bhk * w.dp + d] = kbar;
    w.mig[bhk * w.dp + d] = mig;
    w.mig_inv[bhk * w.dp + d] = __frcp_rn(mig); /* exact: a power of two in [2^-63, 2^64] */
  }
}

/* One 128-key block of one (batch, KV head): K^ (and K^T), then V^ (forward) or V16 (backward),
 * each staged once in shared memory. */
template <int DP>
__global__ void __launch_bounds__(kThreads) quantize_kv_kernel(const Int8Args a, bool backward) {
  extern __shared__ __align__(16) float tile[]; /* [128][dp + 4] */
  __shared__ float red[kThreads / 32];
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int64_t bhk = blockIdx.x / w.nkb, j = blockIdx.x % w.nkb;
  const int64_t b = bhk / p.heads_kv, hk = bhk % p.heads_kv, n0 = j * kBK8;
  const int rows = (int)min((int64_t)kBK8, p.len_k - n0), D = (int)p.head_dim;
  constexpr int dp = DP; /* compile-time: the index arithmetic below is shifts and masks */
  const int pitch = dp + 4;
  const float *kbar = w.kbar + bhk * dp, *inv = w.mig_inv + bhk * dp;
  stage_rows(tile, p.k, p.dtype, p.k_stride, b, hk, n0, rows, kBK8, D, dp, a.vec_k);
  __syncthreads();
  float m = 0.0f; /* smooth and migrate in place (real rows only: padding stays 0), take the amax */
  for (int i = threadIdx.x; i < rows * dp; i += kThreads) {
    float &x = tile[(i / dp) * pitch + i % dp];
    x = __fmul_rn(x - kbar[i % dp], inv[i % dp]); /* = (K - kbar) / s: 1 / s is exact */
    m = amax_u(m, fabsf(x));
  }
  const float r = code_rows<kBK8>(tile, pitch, dp, block_amax(m, red), w.sk + bhk * w.nkb + j,
                                  w.kc + (bhk * w.nkp + n0) * dp);
  if (backward) {
    int8_t *kct = w.kct + (bhk * w.nkb + j) * dp * kBK8;
    for (int i = threadIdx.x; i < dp * (kBK8 / 16); i += kThreads) {
      const int d = i % dp, c0 = (i / dp) * 16;
      store16(kct + d * kBK8 + c0, [&](int e) { return code_s8(tile[(c0 + e) * pitch + d], r); });
    }
  }
  __syncthreads();
  stage_rows(tile, p.v, p.dtype, p.v_stride, b, hk, n0, rows, kBK8, D, dp, a.vec_v);
  __syncthreads();
  if (backward) {
    for (int i = threadIdx.x; i < kBK8 * dp; i += kThreads)
      w.v16[(bhk * w.nkp + n0) * dp + i] = to16(tile[(i / dp) * pitch + i % dp], a.bf16_ops);
    return;
  }
  code_channels<kBK8>(tile, pitch, rows, dp, w.sv + (bhk * w.nkb + j) * dp,
                      w.vct + (bhk * w.nkb + j) * dp * kBK8); /* V: one scale per channel */
}

/* One 64-row block of one (batch, query head): Q^ (and its perm tiles), the lse's shift. */
template <int DP>
__global__ void __launch_bounds__(kThreads) quantize_q_kernel(const Int8Args a, bool backward) {
  extern __shared__ __align__(16) float tile[]; /* [64][dp + 4] */
  __shared__ float red[kThreads / 32];
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int64_t bh = blockIdx.x / w.nqb, i = blockIdx.x % w.nqb;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / (p.heads_q / p.heads_kv);
  const int64_t r0 = i * kBQ8;
  const int rows = (int)min((int64_t)kBQ8, p.len_q - r0), D = (int)p.head_dim;
  constexpr int dp = DP;
  const int pitch = dp + 4;
  stage_rows(tile, p.q, p.dtype, p.q_stride, b, h, r0, rows, kBQ8, D, dp, a.vec_q);
  __syncthreads();
  const float *kbar = w.kbar + (b * p.heads_kv + hk) * dp,
              *mig = w.mig + (b * p.heads_kv + hk) * dp;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int n = warp; n < kBQ8; n += kThreads / 32) { /* the lse's shift, of the unmigrated q */
    float acc = 0.0f;
    for (int d = lane; d < dp; d += 32) acc += tile[n * pitch + d] * kbar[d];
    acc = warp_sum(acc);
    if (lane == 0) w.qshift[bh * w.nqp + r0 + n] = n < rows ? p.scale * acc : 0.0f;
  }
  __syncthreads();
  float m = 0.0f; /* Q' = Q s in place (exact: s is a power of two) and its amax */
  for (int e = threadIdx.x; e < kBQ8 * dp; e += kThreads) {
    float &x = tile[(e / dp) * pitch + e % dp];
    x = __fmul_rn(x, mig[e % dp]);
    m = amax_u(m, fabsf(x));
  }
  const float r = code_rows<kBQ8>(tile, pitch, dp, block_amax(m, red), w.sq + bh * w.nqb + i,
                                  w.qc + (bh * w.nqp + r0) * dp);
  if (backward) {
    int8_t *qct = w.qct + (bh * w.nqb + i) * dp * kBQ8;
    for (int e = threadIdx.x; e < dp * (kBQ8 / 16); e += kThreads) {
      const int d = e % dp, c0 = (e / dp) * 16;
      store16(qct + d * kBQ8 + c0,
              [&](int x) { return code_s8(tile[(c0 + perm16(x)) * pitch + d], r); });
    }
  }
}

/* One 64-row block of one (batch, query head) of dO: Drow and the smoothed lse per row, dO^ per
 * channel (perm tiles), dO in 16 bits. */
template <int DP>
__global__ void __launch_bounds__(kThreads) prepare_do_kernel(const Int8Args a) {
  extern __shared__ __align__(16) float tile[]; /* dO, then O: [2][64][dp + 4] */
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int64_t bh = blockIdx.x / w.nqb, i = blockIdx.x % w.nqb;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q, r0 = i * kBQ8;
  const int rows = (int)min((int64_t)kBQ8, p.len_q - r0), D = (int)p.head_dim;
  constexpr int dp = DP;
  const int pitch = dp + 4;
  float *otile = tile + kBQ8 * pitch;
  stage_rows(tile, a.grad_out, p.dtype, a.grad_out_stride, b, h, r0, rows, kBQ8, D, dp, a.vec_do);
  stage_rows(otile, p.out, p.dtype, p.out_stride, b, h, r0, rows, kBQ8, D, dp, a.vec_out);
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int n = warp; n < kBQ8; n += kThreads / 32) {
    float acc = 0.0f;
    for (int d = lane; d < dp; d += 32)
      acc += as16(tile[n * pitch + d], p.dtype) * as16(otile[n * pitch + d], p.dtype);
    acc = warp_sum(acc);
    if (lane != 0) continue;
    float drow = 0.0f, lse2 = INFINITY;
    if (n < rows) {
      const int64_t li = bh * p.len_q + r0 + n;
      drow = a.grad_lse ? acc - a.grad_lse[li] : acc;
      const float lse = p.lse[li];
      if (lse != -INFINITY) lse2 = (lse - w.qshift[bh * w.nqp + r0 + n]) * kLog2e;
    }
    w.drow[bh * w.nqp + r0 + n] = drow;
    w.lse2[bh * w.nqp + r0 + n] = lse2;
  }
  code_channels<kBQ8>(tile, pitch, rows, dp, w.sdo + (bh * w.nqb + i) * dp,
                      w.doct + (bh * w.nqb + i) * dp * kBQ8); /* dO^: one scale per channel */
  for (int e = threadIdx.x; e < kBQ8 * dp; e += kThreads)
    w.do16[(bh * w.nqp + r0) * dp + e] = to16(tile[(e / dp) * pitch + e % dp], a.bf16_ops);
}

__global__ void __launch_bounds__(kThreads) finish_dq_kernel(const Int8Args a) {
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int64_t D = p.head_dim, total = p.batch * p.heads_q * p.len_q * D;
  const int64_t G = p.heads_q / p.heads_kv;
  for (int64_t e = blockIdx.x * (int64_t)kThreads + threadIdx.x; e < total;
       e += (int64_t)gridDim.x * kThreads) {
    const int64_t row = e / D, d = e % D, bh = row / p.len_q;
    const int64_t bhk = (bh / p.heads_q) * p.heads_kv + (bh % p.heads_q) / G;
    /* dQ = dQ' s + scale * dlse kbar (SPEC_INT8 3; no correction without dlse or where the row
     * sees no key), each operation rounded */
    float v = __fmul_rn(w.dq_acc[row * w.dp + d], w.mig[bhk * w.dp + d]);
    if (a.grad_lse && p.lse[row] != -INFINITY)
      v = __fadd_rn(v, __fmul_rn(__fmul_rn(p.scale, a.grad_lse[row]), w.kbar[bhk * w.dp + d]));
    store_from_float(a.dq, p.dtype, e, v);
  }
}

/* Raises a kernel's dynamic shared-memory limit to `bytes`, once per device (kernels here need at
 * most 133 KB, at head dim 256). */
template <typename Kernel>
bool allow_smem(Kernel kernel, int bytes, int (&done)[64]) {
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev >= 0 && dev < 64 && done[dev] >= bytes) return true;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) !=
      cudaSuccess)
    return false;
  if (dev >= 0 && dev < 64) done[dev] = bytes;
  return true;
}

}  // namespace

namespace {

template <int DP>
fp4attn_status launch_prepare(const Int8Args &a, bool backward, cudaStream_t s) {
  static int kv_smem[64], q_smem[64], do_smem[64];
  const Int8Workspace &w = a.ws;
  constexpr int dp = DP;
  const int64_t bhk = a.p.batch * a.p.heads_kv, bhq = a.p.batch * a.p.heads_q;
  if (bhk * w.nkb > 0x7FFFFFFFLL || bhq * w.nqb > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "int8 attention: too many blocks");
  const int kv_bytes = tile_bytes(kBK8, dp), q_bytes = tile_bytes(kBQ8, dp);
  if (!allow_smem(quantize_kv_kernel<DP>, kv_bytes, kv_smem) ||
      !allow_smem(quantize_q_kernel<DP>, q_bytes, q_smem) ||
      (backward && !allow_smem(prepare_do_kernel<DP>, 2 * q_bytes, do_smem)))
    return launch_status("int8 attention: prepare (shared memory)");
  kbar_partial_kernel<<<(unsigned)(bhk * w.nkb), kThreads, 0, s>>>(a);
  q_amax_partial_kernel<<<(unsigned)(bhq * w.nqa), kThreads, 0, s>>>(a);
  kbar_final_kernel<<<(unsigned)bhk, kThreads, 0, s>>>(a);
  quantize_kv_kernel<DP><<<(unsigned)(bhk * w.nkb), kThreads, kv_bytes, s>>>(a, backward);
  quantize_q_kernel<DP><<<(unsigned)(bhq * w.nqb), kThreads, q_bytes, s>>>(a, backward);
  if (backward) {
    prepare_do_kernel<DP><<<(unsigned)(bhq * w.nqb), kThreads, 2 * q_bytes, s>>>(a);
    cudaMemsetAsync(w.dq_acc, 0, sizeof(float) * bhq * a.p.len_q * w.dp, s);
  }
  return launch_status("int8 attention: prepare");
}

}  // namespace

/* The padded head dim is a template parameter of the staged kernels: their per-element index
 * arithmetic (row = i / dp, ...) is then shifts, not divisions (which made them issue-bound). */
fp4attn_status launch_int8_prepare(const Int8Args &a, bool backward, cudaStream_t s) {
  switch (a.ws.dp) {
    case 64:
      return launch_prepare<64>(a, backward, s);
    case 128:
      return launch_prepare<128>(a, backward, s);
    default:
      return launch_prepare<256>(a, backward, s);
  }
}

fp4attn_status launch_int8_finish_dq(const Int8Args &a, cudaStream_t s) {
  const int64_t total = a.p.batch * a.p.heads_q * a.p.len_q * a.p.head_dim;
  const int64_t blocks = min(ceil_div(total, kThreads), (int64_t)sm_count() * 16);
  finish_dq_kernel<<<(unsigned)blocks, kThreads, 0, s>>>(a);
  return launch_status("int8 attention: finish dq");
}

}  // namespace fp4attn_cuda
