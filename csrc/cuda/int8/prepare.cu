/*
 * The preparation kernels of the 8-bit attention (docs/SPEC_INT8.md 2.1-2.2, 3): one pass over the
 * inputs that leaves every operand of the attention kernels in the workspace (int8_tiles.cuh).
 * The statistics kernels reduce columns; each quantizing block holds one 128-row tile of one
 * operand in registers (128 keys, or two 64-row Q^ blocks; dO: 64 rows) (RegTile: all its loads in
 * flight at once, 16-byte where the rows allow) and writes its outputs straight from them (by
 * rows, or transposed per block for some 16-bit tiles). K, V and Q share one launch.
 *
 * - kbar: per 128-key block column sums of K, then their ordered sum / Nk (deterministic, so that
 *   the backward recomputes the forward's K^ bit for bit), with the column max and min of K.
 * - the channel migration (SPEC_INT8 2.1b): the column amax of |Q| per kQaRows rows, then per
 *   (batch, KV head) and channel qa (over the group's query heads), ka from K's max, min and kbar,
 *   and s = fp4attn_int8_migration_factor(qa, ka) with 1 / s (max and min are exact in any order).
 * - K, V: K^ = psi((K - kbar) / s) per 128 keys (row-major; and Ks16 = K - kbar in 16 bits,
 *   unmigrated, for the backward's dQ);
 *   V16 (SPEC_INT8 2.2: V in the 16-bit operand type) unless the sm90 kernels read the caller's
 *   V (Int8Workspace::v_caller): transposed per 128 keys in natural key order, stored from
 *   registers (the forward's tiles), else row-major.
 * - Q: Q^ = psi(Q s) per 64 rows (row-major; and Q16, Q in 16 bits, for the backward's dK), and
 *   the lse's smoothing term scale * (q . kbar) per row, of the unmigrated q.
 * - dO (backward): Drow = rowsum(dO * O) - dlse (16-bit operands, like dP), the smoothed lse in
 *   log2 units, dO in 16 bits (dO16, the operand of dP and dV).
 * - finish_dq (backward): dQ = scale * the kernel's FP32 sum + scale * dlse kbar, in the input
 *   dtype (the kernels' dK epilogue multiplies by the scale).
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

__device__ __forceinline__ uint16_t to16(float x, bool bf16) {
  return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}

/* A value as dP and Drow see it (SPEC_INT8 3): FP32 inputs rounded to BF16. */
__device__ __forceinline__ float as16(float x, fp4attn_dtype dt) {
  return dt == FP4ATTN_FLOAT32 ? __bfloat162float(__float2bfloat16_rn(x)) : x;
}

/* 8 consecutive elements of a row as loaded: FP32 as floats, FP16 / BF16 as their bits (half the
 * registers; converted where used). Columns from D on are 0; 16-byte loads where `vec` (the row's
 * alignment) and all 8 are inside the row. */
template <fp4attn_dtype kDt>
struct Vals8 {
  static constexpr bool k16 = kDt != FP4ATTN_FLOAT32;
  static constexpr int kWords = k16 ? 4 : 8;
  uint32_t w[kWords];

  __device__ void zero() {
#pragma unroll
    for (int q = 0; q < kWords; ++q) w[q] = 0u;
  }
  __device__ void load(const void *base, int64_t row, int col, int D, bool vec) {
    if (vec && col + 8 <= D) {
      const uint4 *src = reinterpret_cast<const uint4 *>(static_cast<const uint32_t *>(base) +
                                                         (row + col) * kWords / 8);
#pragma unroll
      for (int q = 0; q < kWords / 4; ++q) {
        const uint4 x = src[q];
        w[4 * q] = x.x, w[4 * q + 1] = x.y, w[4 * q + 2] = x.z, w[4 * q + 3] = x.w;
      }
      return;
    }
    zero();
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if (col + e >= D) continue;
      if constexpr (k16)
        w[e / 2] |= (uint32_t)static_cast<const uint16_t *>(base)[row + col + e] << (16 * (e & 1));
      else
        w[e] = static_cast<const uint32_t *>(base)[row + col + e];
    }
  }
  __device__ float operator[](int e) const {
    if constexpr (!k16)
      return __uint_as_float(w[e]);
    else
      return bits16_as_float(e & 1 ? w[e / 2] >> 16 : w[e / 2], kDt == FP4ATTN_BFLOAT16);
  }
};

/* A block's threads over a row-major [rows][dp] input: thread t reads columns c .. c + 7 of rows
 * lane, lane + lanes, ... (8-column groups across the threads, row lanes per group). */
struct ColumnLanes {
  int lanes, c, lane;
  __device__ explicit ColumnLanes(int dp)
      : lanes(kThreads / (dp / 8)), c((threadIdx.x % (dp / 8)) * 8), lane(threadIdx.x / (dp / 8)) {}
};

/* Rows of a statistics block a thread has loaded before it reduces any: their loads are in flight
 * together (one at a time, a block's few hundred threads wait a DRAM latency per row). */
constexpr int kRowsInFlight = 4;

/* Column sums, maxima and minima of 128 keys of one (batch, KV head): block `blk` of them. */
template <fp4attn_dtype kDt>
__device__ void kbar_partial(const Int8Args &a, int64_t blk, float *part, float *pmax,
                             float *pmin) {
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int64_t bhk = blk / w.nkb, j = blk % w.nkb;
  const int64_t b = bhk / p.heads_kv, hk = bhk % p.heads_kv, n0 = j * kBK8;
  const int rows = (int)min((int64_t)kBK8, p.len_k - n0), dp = (int)w.dp;
  const int64_t base = b * p.k_stride[0] + hk * p.k_stride[1] + n0 * p.k_stride[2];
  const ColumnLanes cl(dp);
  const int lanes = cl.lanes, c = cl.c, lane = cl.lane;
  float s[8], mx[8], mn[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) s[e] = 0.0f, mx[e] = -INFINITY, mn[e] = INFINITY;
  for (int r0 = lane; r0 < rows; r0 += kRowsInFlight * lanes) {
    Vals8<kDt> v[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const int r = r0 + u * lanes;
      if (r < rows) v[u].load(p.k, base + r * p.k_stride[2], c, (int)p.head_dim, a.vec_k);
    }
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      if (r0 + u * lanes >= rows) break; /* the rows in order: kbar's sum is reproducible */
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float x = v[u][e];
        s[e] += x;
        mx[e] = fmaxf(mx[e], x); /* a NaN makes kbar, and so ka, NaN */
        mn[e] = fminf(mn[e], x);
      }
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

/* The column amax of |Q| over kQaRows rows of one (batch, query head), block `blk` of them (NaN
 * propagates). */
template <fp4attn_dtype kDt>
__device__ void q_amax_partial(const Int8Args &a, int64_t blk, float *part) {
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int64_t bh = blk / w.nqa, i = blk % w.nqa;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q, r0 = i * kQaRows;
  const int rows = (int)min((int64_t)kQaRows, p.len_q - r0), dp = (int)w.dp;
  const int64_t base = b * p.q_stride[0] + h * p.q_stride[1] + r0 * p.q_stride[2];
  const ColumnLanes cl(dp);
  const int lanes = cl.lanes, c = cl.c, lane = cl.lane;
  float m[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int rr = lane; rr < rows; rr += kRowsInFlight * lanes) {
    Vals8<kDt> v[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const int r = rr + u * lanes;
      if (r < rows)
        v[u].load(p.q, base + r * p.q_stride[2], c, (int)p.head_dim, a.vec_q);
      else
        v[u].zero(); /* |0| changes no amax */
    }
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u)
#pragma unroll
      for (int e = 0; e < 8; ++e) m[e] = amax_u(m[e], fabsf(v[u][e]));
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

/* Both partial statistics in one grid: K's 128-key blocks first, then Q's kQaRows-row blocks. */
template <fp4attn_dtype kDt>
__global__ void __launch_bounds__(kThreads) stats_partial_kernel(const Int8Args a) {
  __shared__ float part[kThreads * 8], pmax[kThreads * 8], pmin[kThreads * 8];
  grid_dependents_launch(); /* kbar_final may start; it waits for this grid to finish */
  if (blockIdx.x == 0 && threadIdx.x == 0 && a.ws.next_item) *a.ws.next_item = 0u;
  const int64_t k_blocks = a.p.batch * a.p.heads_kv * a.ws.nkb;
  if ((int64_t)blockIdx.x < k_blocks)
    kbar_partial<kDt>(a, blockIdx.x, part, pmax, pmin);
  else
    q_amax_partial<kDt>(a, blockIdx.x - k_blocks, part);
}

/* kbar_final's blocks: kFinChannels channels x kFinLanes lanes of one (batch, KV head). The
 * order-free reductions (K's column max and min, Q's amax) are spread over the lanes; kbar's sum
 * stays in key-block order in one thread per channel, from chunks of partials the lanes stage in
 * shared memory (a thread walking them alone waits a memory latency per few partials). */
constexpr int kFinChannels = 16, kFinLanes = kThreads / kFinChannels, kFinChunk = 64;

/* kbar, and SPEC_INT8 2.1b's s and 1 / s, of kFinChannels channels of one (batch, KV head). */
__global__ void __launch_bounds__(kThreads) kbar_final_kernel(const Int8Args a) {
  __shared__ float sums[kFinChunk][kFinChannels];
  __shared__ float red[3][kFinLanes][kFinChannels];
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int64_t groups = w.dp / kFinChannels, bhk = blockIdx.x / groups;
  const int ch = threadIdx.x % kFinChannels, lane = threadIdx.x / kFinChannels;
  const int64_t d = (blockIdx.x % groups) * kFinChannels + ch, G = p.heads_q / p.heads_kv;
  const int64_t bh0 = (bhk / p.heads_kv) * p.heads_q + (bhk % p.heads_kv) * G; /* 1st query head */
  float s = 0.0f, hi = -INFINITY, lo = INFINITY, qa = 0.0f;
  grid_dependency_handoff(); /* the partials */
  for (int64_t j0 = 0; j0 < w.nkb; j0 += kFinChunk) {
    const int n = (int)min((int64_t)kFinChunk, w.nkb - j0);
#pragma unroll
    for (int u = 0; u < kFinChunk / kFinLanes; ++u) {
      const int jj = lane + u * kFinLanes;
      if (jj >= n) break;
      const int64_t at = (bhk * w.nkb + j0 + jj) * w.dp + d;
      sums[jj][ch] = w.kbar_part[at];
      hi = fmaxf(hi, w.kmax_part[at]); /* a NaN makes kbar, and so ka, NaN */
      lo = fminf(lo, w.kmin_part[at]);
    }
    __syncthreads();
    if (lane == 0)
      for (int jj = 0; jj < n; ++jj) s += sums[jj][ch];
    __syncthreads();
  }
#pragma unroll 8 /* loads in flight together */
  for (int64_t e = lane; e < G * w.nqa; e += kFinLanes)
    qa = amax_u(qa, w.qa_part[(bh0 * w.nqa + e) * w.dp + d]);
  red[0][lane][ch] = hi;
  red[1][lane][ch] = lo;
  red[2][lane][ch] = qa;
  __syncthreads();
  if (lane != 0) return;
  for (int l = 1; l < kFinLanes; ++l) {
    hi = fmaxf(hi, red[0][l][ch]);
    lo = fminf(lo, red[1][l][ch]);
    qa = amax_u(qa, red[2][l][ch]);
  }
  const float kbar = d < p.head_dim ? s / (float)p.len_k : 0.0f;
  const float mig = d < p.head_dim
                        ? fp4attn_int8_migration_factor(qa, fp4attn_int8_migration_ka(hi, lo, kbar))
                        : 1.0f;
  w.kbar[bhk * w.dp + d] = kbar;
  w.mig[bhk * w.dp + d] = mig;
  w.mig_inv[bhk * w.dp + d] = __frcp_rn(mig); /* exact: a power of two in [2^-63, 2^64] */
}

/* A tile of kRows rows of one (batch, head) matrix held in registers, 32 values per thread:
 * thread t holds columns c .. c + 7 of the four adjacent rows row0 .. row0 + 3 (c = (t % G) * 8,
 * G = DP / 8 threads per row), so that every load instruction of a warp reads whole sectors, a
 * row's G threads are neighbouring lanes.
 * Rows from `rows` on (padding) and columns from D on are 0. */
template <int DP, int kRows, fp4attn_dtype kDt>
struct RegTile {
  static constexpr int kGroups = DP / 8, kPer = 4;
  static constexpr int kThreads = kRows / kPer * kGroups;
  Vals8<kDt> v[kPer];
  int c, row0;

  __device__ RegTile() : c((threadIdx.x % kGroups) * 8), row0((threadIdx.x / kGroups) * kPer) {}

  /* every load issued before any value is used (no store in between) */
  __device__ void load(const void *x, int64_t base, int64_t row_stride, int rows, int D, bool vec) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (row0 + i < rows)
        v[i].load(x, base + (row0 + i) * row_stride, c, D, vec);
      else
        v[i].zero();
    }
  }

  /* a row's sum of f(e) over its G threads' 8 columns each, valid in its first thread (c == 0) */
  template <typename F>
  __device__ float row_sum(F f) const {
    float acc = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += f(e);
#pragma unroll
    for (int o = 1; o < kGroups && o < 32; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
  }

  /* max |f(i, e)| over the thread's values */
  template <typename F>
  __device__ float amax(F f) const {
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i)
#pragma unroll
      for (int e = 0; e < 8; ++e) m = amax_u(m, fabsf(f(i, e)));
    return m;
  }

  /* row-major codes psi(f(i, e), r) of all kRows rows into out [kRows][DP], 8 bytes per row and
   * thread */
  template <typename F>
  __device__ void store_rows(int8_t *out, float r, F f) const {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      int q[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) q[e] = code_s8(f(i, e), r);
      *reinterpret_cast<uint2 *>(out + (row0 + i) * DP + c) =
          make_uint2(pack_s8x4(q[0], q[1], q[2], q[3]), pack_s8x4(q[4], q[5], q[6], q[7]));
    }
  }

  /* f(i, e) of all kRows rows in 16 bits (BF16 if bf16, else FP16) into out [kRows][DP] */
  template <typename F>
  __device__ void store_rows16(uint16_t *out, bool bf16, F f) const {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      uint32_t w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q)
        w[q] = (uint32_t)to16(f(i, 2 * q), bf16) | ((uint32_t)to16(f(i, 2 * q + 1), bf16) << 16);
      *reinterpret_cast<uint4 *>(out + (row0 + i) * DP + c) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }

  /* f(i, e) of all kRows rows in 16 bits transposed into out [DP][kRows]: the thread's 4 rows of
   * each of its 8 columns, 8 bytes */
  template <typename F>
  __device__ void store_transposed16(uint16_t *out, bool bf16, F f) const {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      uint16_t y[kPer];
#pragma unroll
      for (int i = 0; i < kPer; ++i) y[i] = to16(f(i, e), bf16);
      *reinterpret_cast<uint2 *>(out + (c + e) * kRows + row0) =
          make_uint2(y[0] | ((uint32_t)y[1] << 16), y[2] | ((uint32_t)y[3] << 16));
    }
  }

  /* all kRows rows in 16 bits (BF16 if bf16, else FP16) into out [kRows][DP] */
  __device__ void store_rows16(uint16_t *out, bool bf16) const {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      uint32_t w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q)
        w[q] =
            (kDt == FP4ATTN_BFLOAT16 && bf16) || (kDt == FP4ATTN_FLOAT16 && !bf16)
                ? v[i].w[q] /* the input's own bits */
                : (uint32_t)to16(v[i][2 * q], bf16) | ((uint32_t)to16(v[i][2 * q + 1], bf16) << 16);
      *reinterpret_cast<uint4 *>(out + (row0 + i) * DP + c) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
};

/* The amax of one value per thread over the thread's group of kGroupWarps consecutive warps (the
 * whole block by default); red: kWarps floats. */
template <int kWarps, int kGroupWarps = kWarps>
__device__ float block_amax(float v, float *red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = amax_u(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  const int w0 = (int)(threadIdx.x >> 5) / kGroupWarps * kGroupWarps;
  v = 0.0f;
#pragma unroll
  for (int w = 0; w < kGroupWarps; ++w) v = amax_u(v, red[w0 + w]);
  __syncthreads();
  return v;
}

template <int DP, fp4attn_dtype kDt>
using KvTile = RegTile<DP, kBK8, kDt>;
template <int DP, fp4attn_dtype kDt>
using QTile = RegTile<DP, kBQ8, kDt>;
/* 16-bit inputs: 64 registers, half the SM's threads (the tiles' loads in flight are what keep
 * DRAM busy); FP32 tiles need more */
template <int DP, fp4attn_dtype kDt>
constexpr int kTileBlocksPerSm = kDt == FP4ATTN_FLOAT32 ? 1 : 1024 / KvTile<DP, kDt>::kThreads;
static_assert(kBK8 == 2 * kBQ8, "a quantizing block holds 128 keys or two 64-row Q^ blocks");

/* One pair of 64-row blocks of one (batch, query head), `blk` of them, in a 128-row tile (the
 * K tile's shape, so that K, V and Q share one launch): the lse's shift of the unmigrated q, Q^
 * with a scale per 64-row half (and Q16, dK's operand, backward). The pair's second block may be
 * past the last one (odd nqb): its threads take part in the reductions and store nothing. */
template <int DP, fp4attn_dtype kDt>
__device__ void quantize_q_pair(const Int8Args &a, int64_t blk, bool backward, float *red) {
  using T = KvTile<DP, kDt>;
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int64_t pairs = (w.nqb + 1) / 2, bh = blk / pairs, r0 = blk % pairs * 2 * kBQ8;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / (p.heads_q / p.heads_kv);
  const int rows = (int)min((int64_t)(2 * kBQ8), p.len_q - r0), D = (int)p.head_dim;
  T t;
  t.load(p.q, b * p.q_stride[0] + h * p.q_stride[1] + r0 * p.q_stride[2], p.q_stride[2], rows, D,
         a.vec_q);
  grid_dependency_handoff();                      /* kbar and s */
  const int64_t i = r0 / kBQ8 + (t.row0 >= kBQ8); /* this thread's Q^ block */
  const bool live = i < w.nqb;
  {
    const float *kbar = w.kbar + (b * p.heads_kv + hk) * DP;
    float kb[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) kb[e] = kbar[t.c + e];
#pragma unroll
    for (int r = 0; r < T::kPer; ++r) {
      const float acc = t.row_sum([&](int e) { return t.v[r][e] * kb[e]; });
      if (t.c == 0 && live)
        w.qshift[bh * w.nqp + r0 + t.row0 + r] = t.row0 + r < rows ? p.scale * acc : 0.0f;
    }
  }
  const float *mig = w.mig + (b * p.heads_kv + hk) * DP;
  float mg[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) mg[e] = mig[t.c + e];
  /* Q' = Q s (exact: s is a power of two) */
  const auto qs = [&](int r, int e) { return __fmul_rn(t.v[r][e], mg[e]); };
  float rq, sq;
  psi_factors(block_amax<T::kThreads / 32, T::kThreads / 64>(t.amax(qs), red), rq, sq);
  if (!live) return;
  if (threadIdx.x % (T::kThreads / 2) == 0) w.sq[bh * w.nqb + i] = sq;
  t.store_rows(w.qc + (bh * w.nqp + r0) * DP, rq, qs);
  if (backward) t.store_rows16(w.q16 + (bh * w.nqp + r0) * DP, a.bf16_ops);
}

/* Blocks [0, n): K^ of one 128-key block of one (batch, KV head) (and Ks16, backward); blocks
 * [n, 2n), unless the kernels read the caller's V: V16 of the same block (vt16 or v16); then the
 * pairs of Q^ blocks (quantize_q_pair). K^'s amax comes from the block's column max and min
 * (kbar_partial): rounding is monotonic, so max |fl(fl(K - kbar) / s)| over a column is that of
 * its max or its min. */
template <int DP, fp4attn_dtype kDt>
__global__ void __launch_bounds__(KvTile<DP, kDt>::kThreads, kTileBlocksPerSm<DP, kDt>)
    quantize_kernel(const Int8Args a, bool backward) {
  using T = KvTile<DP, kDt>;
  __shared__ float red[T::kThreads / 32];
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int64_t n = p.batch * p.heads_kv * w.nkb, kv_blocks = (w.v_caller ? 1 : 2) * n;
  if ((int64_t)blockIdx.x >= kv_blocks) {
    quantize_q_pair<DP, kDt>(a, blockIdx.x - kv_blocks, backward, red);
    return;
  }
  const bool is_v = blockIdx.x >= n;
  const int64_t blk = is_v ? blockIdx.x - n : blockIdx.x;
  const int64_t bhk = blk / w.nkb, j = blk % w.nkb;
  const int64_t b = bhk / p.heads_kv, hk = bhk % p.heads_kv, n0 = j * kBK8;
  const int rows = (int)min((int64_t)kBK8, p.len_k - n0), D = (int)p.head_dim;
  T t;
  if (!is_v) {
    t.load(p.k, b * p.k_stride[0] + hk * p.k_stride[1] + n0 * p.k_stride[2], p.k_stride[2], rows, D,
           a.vec_k);
    grid_dependency_handoff(); /* kbar, s and the block's column max and min */
    const float *kbar = w.kbar + bhk * DP, *inv = w.mig_inv + bhk * DP;
    float m = 0.0f;
    for (int d = threadIdx.x; d < DP; d += T::kThreads) {
      const int64_t at = (bhk * w.nkb + j) * DP + d;
      m = amax_u(m, amax_u(fabsf(__fmul_rn(w.kmax_part[at] - kbar[d], inv[d])),
                           fabsf(__fmul_rn(w.kmin_part[at] - kbar[d], inv[d]))));
    }
    float r, s;
    psi_factors(block_amax<T::kThreads / 32>(m, red), r, s);
    if (threadIdx.x == 0) w.sk[bhk * w.nkb + j] = s;
    float kb[8], iv[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) kb[e] = kbar[t.c + e], iv[e] = inv[t.c + e];
    /* (K - kbar) / s on real rows, 0 on padding (1 / s is exact) */
    const auto ks = [&](int i, int e) {
      return t.row0 + i < rows ? __fmul_rn(t.v[i][e] - kb[e], iv[e]) : 0.0f;
    };
    t.store_rows(w.kc + (bhk * w.nkp + n0) * DP, r, ks);
    if (!backward) return;
    /* dQ's operand Ks16: K - kbar unmigrated, 0 on padding; by rows, or transposed per block */
    const auto ks16 = [&](int i, int e) { return t.row0 + i < rows ? t.v[i][e] - kb[e] : 0.0f; };
    if (w.ks16_t)
      t.store_transposed16(w.ks16 + (bhk * w.nkb + j) * DP * kBK8, a.bf16_ops, ks16);
    else
      t.store_rows16(w.ks16 + (bhk * w.nkp + n0) * DP, a.bf16_ops, ks16);
    return;
  }
  t.load(p.v, b * p.v_stride[0] + hk * p.v_stride[1] + n0 * p.v_stride[2], p.v_stride[2], rows, D,
         a.vec_v);
  grid_dependency_handoff(); /* V16 needs nothing of kbar_final's; every block links the chain */
  if (!w.v_tiles) {
    t.store_rows16(w.v16 + (bhk * w.nkp + n0) * DP, a.bf16_ops);
    return;
  }
  /* V16 [DP][128] in natural key order */
  t.store_transposed16(w.vt16 + (bhk * w.nkb + j) * DP * kBK8, a.bf16_ops,
                       [&](int i, int e) { return t.v[i][e]; });
}

/* One 64-row block of one (batch, query head) of dO: Drow and the smoothed lse per row, dO in 16
 * bits. */
template <int DP, fp4attn_dtype kDt>
__global__ void __launch_bounds__(QTile<DP, kDt>::kThreads) prepare_do_kernel(const Int8Args a) {
  using T = QTile<DP, kDt>;
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int64_t bh = blockIdx.x / w.nqb, i = blockIdx.x % w.nqb;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q, r0 = i * kBQ8;
  const int rows = (int)min((int64_t)kBQ8, p.len_q - r0), D = (int)p.head_dim;
  T t;
  t.load(a.grad_out,
         b * a.grad_out_stride[0] + h * a.grad_out_stride[1] + r0 * a.grad_out_stride[2],
         a.grad_out_stride[2], rows, D, a.vec_do);
  {
    T o;
    o.load(p.out, b * p.out_stride[0] + h * p.out_stride[1] + r0 * p.out_stride[2], p.out_stride[2],
           rows, D, a.vec_out);
    grid_dependency_handoff(); /* qshift */
#pragma unroll
    for (int r = 0; r < T::kPer; ++r) {
      const float acc =
          t.row_sum([&](int e) { return as16(t.v[r][e], kDt) * as16(o.v[r][e], kDt); });
      const int n = t.row0 + r;
      if (t.c != 0) continue;
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
  }
  t.store_rows16(w.do16 + (bh * w.nqp + r0) * DP, a.bf16_ops);
}

/* dQ = scale dQ + scale * dlse kbar (SPEC_INT8 3; no correction without dlse or where the row sees
 * no key), each operation rounded, in the input dtype: a thread per 4 columns of a row (the row and
 * head from one division per thread: per-element 64-bit divisions made this kernel issue-bound). */
template <int DP>
__global__ void __launch_bounds__(kThreads) finish_dq_kernel(const Int8Args a) {
  constexpr int kTpr = DP / 4, kRowsPerBlock = kThreads / kTpr;
  const fp4attn_attention_params &p = a.p;
  const Int8Workspace &w = a.ws;
  const int64_t row = blockIdx.x * (int64_t)kRowsPerBlock + threadIdx.x / kTpr;
  const int d0 = (threadIdx.x % kTpr) * 4, D = (int)p.head_dim;
  grid_dependency_wait(); /* the backward kernel's sums */
  if (row >= p.batch * p.heads_q * p.len_q || d0 >= D) return;
  const int64_t bh = row / p.len_q, G = p.heads_q / p.heads_kv;
  const int64_t bhk = (bh / p.heads_q) * p.heads_kv + (bh % p.heads_q) / G;
  const float4 acc = *reinterpret_cast<const float4 *>(w.dq_acc + row * DP + d0);
  float v[4] = {__fmul_rn(p.scale, acc.x), __fmul_rn(p.scale, acc.y), __fmul_rn(p.scale, acc.z),
                __fmul_rn(p.scale, acc.w)};
  if (a.grad_lse && p.lse[row] != -INFINITY) {
    const float g = __fmul_rn(p.scale, a.grad_lse[row]);
    const float4 kb = *reinterpret_cast<const float4 *>(w.kbar + bhk * DP + d0);
    v[0] = __fadd_rn(v[0], __fmul_rn(g, kb.x));
    v[1] = __fadd_rn(v[1], __fmul_rn(g, kb.y));
    v[2] = __fadd_rn(v[2], __fmul_rn(g, kb.z));
    v[3] = __fadd_rn(v[3], __fmul_rn(g, kb.w));
  }
  const int64_t e = row * D + d0;
  const bool pairs = D % 2 == 0; /* 4-byte (16-bit) / 8-byte (fp32) aligned pairs */
  const int n = min(4, D - d0);
  for (int k = 0; k < n; k += 2) {
    if (k + 1 < n)
      store2_from_float(a.dq, p.dtype, e + k, v[k], v[k + 1], pairs);
    else
      store_from_float(a.dq, p.dtype, e + k, v[k]);
  }
}

}  // namespace

namespace {

/* quantize_kernel's grid: K's 128-key blocks, V's unless read in place, the pairs of Q^ blocks */
int64_t quantize_blocks(const Int8Args &a) {
  const int64_t bhk = a.p.batch * a.p.heads_kv, bhq = a.p.batch * a.p.heads_q;
  return (a.ws.v_caller ? 1 : 2) * bhk * a.ws.nkb + bhq * ((a.ws.nqb + 1) / 2);
}

/* The statistics (kbar, s), then the quantized operands. The first kernel is an ordinary launch
 * (it reads the caller's tensors; the workspace's previous readers have ended); the others are
 * programmatic dependents of the one before, which load their input tiles while it finishes. */
template <int DP, fp4attn_dtype kDt>
void launch_kernels(const Int8Args &a, bool backward, cudaStream_t s) {
  const Int8Workspace &w = a.ws;
  const int64_t bhk = a.p.batch * a.p.heads_kv, bhq = a.p.batch * a.p.heads_q;
  stats_partial_kernel<kDt><<<(unsigned)(bhk * w.nkb + bhq * w.nqa), kThreads, 0, s>>>(a);
  launch_dependent(kbar_final_kernel, dim3((unsigned)(bhk * (w.dp / kFinChannels))), dim3(kThreads),
                   0, s, a);
  launch_dependent(quantize_kernel<DP, kDt>, dim3((unsigned)quantize_blocks(a)),
                   dim3(KvTile<DP, kDt>::kThreads), 0, s, a, backward);
  if (backward)
    launch_dependent(prepare_do_kernel<DP, kDt>, dim3((unsigned)(bhq * w.nqb)),
                     dim3(QTile<DP, kDt>::kThreads), 0, s, a);
}

template <int DP>
fp4attn_status launch_prepare(const Int8Args &a, bool backward, cudaStream_t s) {
  const Int8Workspace &w = a.ws;
  const int64_t bhk = a.p.batch * a.p.heads_kv, bhq = a.p.batch * a.p.heads_q;
  if (quantize_blocks(a) > 0x7FFFFFFFLL || bhq * w.nqb > 0x7FFFFFFFLL ||
      bhk * w.nkb + bhq * w.nqa > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "int8 attention: too many blocks");
  /* dQ's sums (and their order counters) start at 0: cleared before the first kernel, outside
   * the dependent chain */
  if (backward) cudaMemsetAsync(w.dq_acc, 0, sizeof(float) * bhq * a.p.len_q * w.dp, s);
  if (w.dq_sem) cudaMemsetAsync(w.dq_sem, 0, sizeof(unsigned) * bhq * w.nqb * 2, s);
  switch (a.p.dtype) { /* the element type fixes the tiles' registers and conversions */
    case FP4ATTN_FLOAT16:
      launch_kernels<DP, FP4ATTN_FLOAT16>(a, backward, s);
      break;
    case FP4ATTN_BFLOAT16:
      launch_kernels<DP, FP4ATTN_BFLOAT16>(a, backward, s);
      break;
    default:
      launch_kernels<DP, FP4ATTN_FLOAT32>(a, backward, s);
  }
  return launch_status("int8 attention: prepare");
}

}  // namespace

/* The padded head dim is a template parameter of the quantizing kernels: it fixes their tile shape
 * and thread count, and keeps their index arithmetic shifts and masks. */
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
  const int64_t rows = a.p.batch * a.p.heads_q * a.p.len_q;
  const int rows_per_block = kThreads / ((int)a.ws.dp / 4);
  const int64_t blocks = ceil_div(rows, (int64_t)rows_per_block);
  if (blocks > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "int8 attention backward: too many rows");
  switch (a.ws.dp) {
    case 64:
      launch_dependent(finish_dq_kernel<64>, dim3((unsigned)blocks), dim3(kThreads), 0, s, a);
      break;
    case 128:
      launch_dependent(finish_dq_kernel<128>, dim3((unsigned)blocks), dim3(kThreads), 0, s, a);
      break;
    default:
      launch_dependent(finish_dq_kernel<256>, dim3((unsigned)blocks), dim3(kThreads), 0, s, a);
  }
  return launch_status("int8 attention: finish dq");
}

}  // namespace fp4attn_cuda
