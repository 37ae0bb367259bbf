/*
 * Decode attention on the FP4 KV cache (docs/SPEC.md section 6): split-KV (flash-decoding) on
 * mma.sync m16n8k16 with FP16 operands whatever the input dtype, then a merge of the splits by
 * their lse.
 *
 * The products are transposed: S^T = K Q^T with 16 keys as the MMA's M and the query rows as N,
 * O^T = V^T P^T with 16 channels as M and the keys as K. A decode tile has few query rows (the G
 * query heads x len_q positions of one (batch, KV head); 4 for GQA 32/8 with one position), so
 * N = 8 (or 16, NT = 2 n-tiles) pads far less than the M = 16 of Q K^T, and O^T takes DP / 4
 * registers per lane and n-tile instead of DP / 2.
 *
 * A block (4 warps) owns one tile of 8 NT query rows (GQA on the tensor cores: the heads share
 * every key the block reads) and one key range of a split. Each warp takes 32-key chunks of the
 * range in turn; where pages hold whole chunks it copies the next chunk's rows into its second
 * shared-memory slot by cp.async while it works on the current one (stage_chunk), otherwise it
 * loads straight from global memory (load_chunk). Either way every lane takes exactly the code
 * words that its own MMA fragments need and decodes them in registers (e2m1_pairs.cuh: FP16 bits
 * placed by shifts and masks, then one packed multiply by the E4M3 scale per pair, exact in FP16;
 * the FP32 row `dec` stays outside: per key on the scores for K, folded into P for V).
 *
 * Fragment layouts (g = lane / 4, t4 = lane % 4, chunk keys 0..31, key group j = keys 8j..8j+7):
 *  - S^T: m-tile mt holds keys 16 mt + r (rows r = g: group 2 mt, r = g + 8: group 2 mt + 1).
 *    Lane (g, t4) decodes key 8j + g, bytes [t4 DP/8, (t4 + 1) DP/8) of its row, i.e.
 *    d = t4 DP/4 + 8i + n for word i, nibble n. Word i feeds k-steps 2i and 2i + 1; the MMA slot
 *    order this implies is applied to Q once, when the block stages it (q_dim). A dot product does
 *    not care in which order it sums d.
 *  - P^T: the S^T accumulator (lane: keys 8j + g, queries 2 t4 + e) transposed by movmatrix is
 *    the B operand of O^T's k-step mt (keys 16 mt + 2 t4 + e (+ 8), query g).
 *  - O^T: lane (g, t4) decodes the V rows of keys 8j + 2 t4 + b, bytes [g DP/16, (g + 1) DP/16):
 *    d = g DP/8 + 8w + n. Half words of two keys are joined so that one decoded pair holds
 *    (key, key + 1) at one d; m-tile mt's row r is d = (DP/8) (r % 8) + 2 mt + r / 8 (o_dim),
 *    undone when O is stored.
 * Q is staged as FP16 times a power of two per tile (exact for FP16 and BF16 inputs; FP32 inputs
 * as hi + lo parts, two MMAs, 22 bits), P as FP16 in [0, 1]. The warps' partial results merge in
 * shared memory, the splits' in the merge kernel (a programmatic dependent: its launch overlaps
 * this kernel). No host synchronisation: the grid follows the cache's capacity, each block reads
 * its sequence's length on the device.
 */
#include <cfloat>
#include <climits>
#include <map>
#include <mutex>
#include <type_traits>

#include "../common/smem_tiles.cuh"
#include "../common/trace.cuh"
#include "../tile/split_merge.cuh"
#include "decode_trace.h"
#include "e2m1_pairs.cuh"
#include "k5_pairs.cuh"
#include "kv_cache.h"

namespace fp4attn_cuda {

namespace {

constexpr int kWarps = kKvDecodeWarps, kThreads = 32 * kWarps;
constexpr int kChunk = kKvDecodeChunk;

/* The development timeline (decode_trace.h): stamps where FP4ATTN_DECODE_TRACE is defined, nothing
 * otherwise. */
#if defined(FP4ATTN_DECODE_TRACE)
__device__ unsigned long long g_decode_trace[kDecodeTraceBlocks][kDtEvents];
__device__ __forceinline__ void decode_trace(DecodeTraceEvent ev, unsigned long long value) {
  const long long row = (long long)blockIdx.y * gridDim.x + blockIdx.x;
  if (row < kDecodeTraceBlocks) g_decode_trace[row][ev] = value;
}
#define DECODE_TRACE_AT(cond, ev, value)   \
  do {                                     \
    if (cond) decode_trace((ev), (value)); \
  } while (0)
#else
#define DECODE_TRACE_AT(cond, ev, value) ((void)0)
#endif

/* (rows = the tile's 8 or 16 query rows) */
struct DecodeArgs {
  fp4attn_decode_params p;
  float *o_part;  /* [tiles][splits][rows][dp]: unnormalised O of a split */
  float *ml_part; /* [tiles][splits][rows][2]: its row max (log2 units) and row sum */
  float *qshift;  /* [tiles][rows]: scale * (q . kmean) */
  int64_t mtiles, splits, kv_splits; /* splits: kv_splits of stored rows (+ the residual's) */
  DivU32 page;                       /* by the cache's page size */
};

/* One staged chunk (the kFast path) in shared memory: the chunk's rows of the cache arrays, copied
 * whole (every region a multiple of 16 bytes). V's code rows are padded by 16 bytes so that the
 * lanes' reads of four even (or odd) keys at once fall into distinct banks. */
template <int DP>
struct ChunkSlot {
  static constexpr int kKRow = 5 * DP / 8;            /* K code bytes per row (K5) */
  static constexpr int kKc = 0;                       /* K codes [32][kKRow] */
  static constexpr int kVStride = DP / 2 + 16;        /* bytes per V code row */
  static constexpr int kVc = kKc + kChunk * kKRow;    /* V codes [32][kVStride] */
  static constexpr int kKs = kVc + kChunk * kVStride; /* K scales [32][DP/64] */
  static constexpr int kVs = kKs + kChunk * DP / 64;  /* V scales [32][DP/16] */
  static constexpr int kKe = kVs + kChunk * DP / 16;  /* K row-scale bytes [32] */
  static constexpr int kVd = kKe + kChunk;            /* V dec [32] */
  static constexpr int kBytes = kVd + 4 * kChunk;
};
/* A warp's slots: the chunk it works on and the kAhead next ones, in flight. (3 slots, 3 blocks
 * per SM instead of 4, measured 4-53 % slower: the decode needs the warps more than the depth.) */
constexpr int kStages = 2, kAhead = kStages - 1;

/* The residual split's shared memory (residual_split): per step of kKeys = 128 / NQ keys, K - kmean
 * and V of those keys and the tile's queries as FP32 rows (K and Q padded by a column: the score
 * threads of a warp read distinct keys' rows), and the rows' weights. */
template <int DP, int NQ>
struct ResidualSmem {
  static constexpr int kKeys = kThreads / NQ; /* a thread per (row, key) */
  static constexpr int kK = 0, kV = kK + kKeys * (DP + 1), kQ = kV + kKeys * DP;
  static constexpr int kP = kQ + NQ * (DP + 1);
  static constexpr int kBytes = 4 * (kP + NQ * kKeys);
};

/* Shared memory: the Q tile of NQ rows (and, kSplitQ, its FP32 low part) in MMA slot order, then
 * (kFast) the warps' chunk slots; after the loop, the warps' merge over all of it. */
template <int DP, int NQ, bool kSplitQ, bool kFast>
struct DecodeSmem {
  static constexpr int kW = 2 * DP; /* bytes per 16-bit row */
  static constexpr int kQ = 0, kQlo = NQ * kW, kRing = (kSplitQ ? 2 : 1) * NQ * kW;
  static constexpr int kLoop = kRing + (kFast ? kWarps * kStages * ChunkSlot<DP>::kBytes : 0);
  static constexpr int kMerge = kWarps * NQ * (DP + 2) * 4;
  static constexpr int kMax = kLoop > kMerge ? kLoop : kMerge;
  static constexpr int kRes = ResidualSmem<DP, NQ>::kBytes; /* residual_split */
  static constexpr int kBytes = kMax > kRes ? kMax : kRes;
};

/* Storage d of Q slot column c (k-step c / 16, slot c % 16) in the K fragment layout above:
 * slot 2 t4 + e (+ 8 for hi) of k-step 2i + h is nibble 2h + hi + 4e of the lane's word i. */
template <int DP>
__device__ __forceinline__ int q_dim(int c) {
  const int ks = c >> 4, slot = c & 15;
  return ((slot & 7) >> 1) * (DP / 4) + 8 * (ks >> 1) + 2 * (ks & 1) + (slot >> 3) + 4 * (slot & 1);
}
/* Storage d of row r of O^T's m-tile mt (the V fragment layout above). */
template <int DP>
__device__ __forceinline__ int o_dim(int mt, int r) {
  return (DP / 8) * (r & 7) + 2 * mt + (r >> 3);
}

/* E4M3 scale bytes as FP16 pairs times 2^6: an E4M3 byte's exponent and mantissa bits read as
 * FP16 bits 7 places up are the same value times 2^-8, exactly (subnormals included), and the
 * multiply by 2^14 (kE2m1Unit) is exact too (2^-3 <= s 2^6 <= 28672). Times an e2m1_pairs value
 * (code x 2^-14), by h2_mul, that is code x s x 2^-8, exact (a multiple of 2^-18, at most 10.5);
 * the 2^8 is restored in FP32 (kScaleUnit). */
constexpr float kScaleUnit = 256.0f;
/* K: k5_scale_pair (k5_pairs.cuh) times a code q (|q| <= 15) is q s 2^-8, exact (at most 8
 * significant bits, a multiple of 2^-17, at most 26.25). A garbage row (a free slot past the
 * sequence's end) may decode to anything, NaN included, but reaches only its own row of S^T,
 * whose scores are masked. Its row scale: 2^(e - 127) (e >= 1 as SPEC 6 stores it; 255 gives
 * +Inf, and the row's zero products make its scores NaN, as a non-finite row's must be). */
__device__ __forceinline__ float k_row_scale(uint32_t e) {
  return __uint_as_float(e << 23);
}
/* V: byte k of `lo` and of `hi` (the pair's two keys), masked after the shift (the sign bit and
 * the bytes between cleared): a garbage row stays finite, so its zero weight in P^T zeroes it. */
__device__ __forceinline__ uint32_t v_scale_pair(uint32_t lo, uint32_t hi, int k) {
  return h2_mul((prmt_b32(lo, hi, (uint32_t)k | (uint32_t)(4 + k) << 8) << 7) & 0x3F803F80u,
                kE2m1Unit);
}

/* N consecutive 32-bit words at `at` (4N-byte aligned, global or shared): vector loads. */
template <int N>
__device__ __forceinline__ void vector_words(uint32_t (&w)[N], const void *at) {
  if constexpr (N == 1) {
    w[0] = *reinterpret_cast<const uint32_t *>(at);
  } else if constexpr (N == 2) {
    const uint2 x = *reinterpret_cast<const uint2 *>(at);
    w[0] = x.x, w[1] = x.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const uint4 x = reinterpret_cast<const uint4 *>(at)[i / 4];
      w[i] = x.x, w[i + 1] = x.y, w[i + 2] = x.z, w[i + 3] = x.w;
    }
  }
}
/* N consecutive 32-bit words at byte `off` of a row of `len` bytes, zeros past its end. */
template <int N>
__device__ __forceinline__ void load_words(uint32_t (&w)[N], const uint8_t *row, int off, int len) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    w[i] = off + 4 * i + 4 <= len ? *reinterpret_cast<const uint32_t *>(row + off + 4 * i) : 0u;
}
/* N (1, 2 or 4) consecutive bytes at `at` (N-byte aligned), packed. */
template <int N>
__device__ __forceinline__ uint32_t vector_bytes(const void *at) {
  if constexpr (N == 4) return *reinterpret_cast<const uint32_t *>(at);
  if constexpr (N == 2) return *reinterpret_cast<const uint16_t *>(at);
  return *reinterpret_cast<const uint8_t *>(at);
}
/* N consecutive scale bytes from block `blk` of a row of `len` blocks (0 past its end), packed. */
template <int N>
__device__ __forceinline__ uint32_t load_scales(const uint8_t *row, int blk, int len) {
  uint32_t r = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) r |= blk + i < len ? (uint32_t)row[blk + i] << (8 * i) : 0u;
  return r;
}

template <int DP>
struct Frag {
  static constexpr int kKWords = DP / 32; /* K nibble words per key and lane */
  static constexpr int kKPlane = DP / 32; /* K high-bit bytes per key and lane (one per word) */
  static constexpr int kKPlaneWords = (kKPlane + 3) / 4;
  static constexpr int kVWords = DP / 64 > 0 ? DP / 64 : 1; /* V words per key and lane */
  static constexpr int kVBlocks = DP / 128 > 0 ? DP / 128 : 1;
};

/* One chunk's raw loads of a lane: K rows and both decs of keys 8j + g (the S^T layout), V rows
 * and scales of keys 8j + 2 t4 + b (the O^T layout). */
template <int DP>
struct Raw {
  using F = Frag<DP>;
  uint32_t k[4][F::kKWords], kh[4][F::kKPlaneWords], ks[4]; /* ks: the lane's one K scale byte */
  uint32_t v[4][2][F::kVWords], vs[4][2];
  float kd[4], vd[4]; /* kd: K's row scale 2^(e - 127) */
};

/* The cache row of key `key` of sequence b, KV head hk (a block table lookup); rows fit in 31 bits
 * (launch_decode checks). A page id outside the pool is a device-side error (the CPU backend
 * raises one), not a read of other memory. */
__device__ __forceinline__ int64_t cache_row(const fp4attn_kv_cache &c, const DivU32 &page,
                                             int64_t b, int64_t hk, int key) {
  const uint32_t ps = (uint32_t)c.page_size, pi = page.div((uint32_t)key);
  const uint32_t pg = (uint32_t)c.block_table[b * c.max_pages + pi];
  if (pg >= (uint32_t)c.num_pages) __trap();
  return (int64_t)(pg * ((uint32_t)c.heads_kv * ps) + (uint32_t)hk * ps +
                   ((uint32_t)key - pi * ps));
}

/* N words of a K5 row's bytes [off, len) from 16-bit loads (rows are 5 Dp/8 bytes: even, not
 * always a multiple of 4), zero bytes past len (len and off even). */
template <int N>
__device__ __forceinline__ void load_words16(uint32_t (&w)[N], const uint8_t *row, int off,
                                             int len) {
  const uint16_t *h = reinterpret_cast<const uint16_t *>(row + off);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const uint32_t lo = off + 4 * i + 2 <= len ? h[2 * i] : 0u;
    const uint32_t hi = off + 4 * i + 4 <= len ? h[2 * i + 1] : 0u;
    w[i] = lo | hi << 16;
  }
}

/* The general path: a page lookup per key (a key past the sequence's end reads its last key; such
 * keys' scores are masked, their V dec zeroed) and bounded loads, straight into registers. */
template <int DP>
__device__ __forceinline__ void load_chunk(Raw<DP> &raw, const fp4attn_kv_cache &c,
                                           const DivU32 &page, int64_t b, int64_t hk, int key0,
                                           int len, int lane) {
  using F = Frag<DP>;
  const int g = lane >> 2, t4 = lane & 3;
  const int cb = (int)fp4_code_bytes(c.head_dim), sc = (int)fp4_scale_count(c.head_dim);
  const int dp = 2 * cb, kcb = 5 * dp / 8, ksc = (dp + 63) / 64; /* the K5 row of Dp values */
  auto row_of = [&](int key) { return cache_row(c, page, b, hk, min(key0 + key, len - 1)); };
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t r = row_of(8 * j + g);
    const uint8_t *krow = c.k_codes + r * kcb;
    load_words16(raw.k[j], krow, t4 * (DP / 8), dp / 2);
    /* the plane bytes of the lane's d range, zeros past the row's dp / 8 */
    uint32_t plane[F::kKPlaneWords] = {};
#pragma unroll
    for (int i = 0; i < F::kKPlane; ++i) {
      const int at = t4 * F::kKPlane + i;
      plane[i / 4] |= at < dp / 8 ? (uint32_t)krow[dp / 2 + at] << (8 * (i % 4)) : 0u;
    }
#pragma unroll
    for (int i = 0; i < F::kKPlaneWords; ++i) raw.kh[j][i] = plane[i];
    const int blk = t4 * DP / 256; /* the 64-value block of the lane's d range */
    raw.ks[j] = blk < ksc ? c.k_scales[r * ksc + blk] : 0u;
    raw.kd[j] = k_row_scale(c.k_exp[r]);
    raw.vd[j] = key0 + 8 * j + g < len ? c.v_dec[r] : 0.0f; /* no NaN from free slots */
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int64_t rv = row_of(8 * j + 2 * t4 + x);
      load_words(raw.v[j][x], c.v_codes + rv * cb, g * (DP / 16), cb);
      raw.vs[j][x] = load_scales<F::kVBlocks>(c.v_scales + rv * sc, g * DP / 128, sc);
    }
  }
}

/* kFast (pages hold whole chunks, D == DP, 16-byte aligned arrays): the chunk whose first key is
 * cache row `row` is 32 consecutive rows of every cache array, copied into `slot` by the warp's
 * cp.async, 16 bytes per copy, without waiting. Each lane's copies sit at fixed offsets from its
 * first one, so the addresses are one 64-bit base per array and immediate offsets. */
template <int DP>
__device__ __forceinline__ void stage_chunk(char *slot, const fp4attn_kv_cache &c, int64_t row,
                                            int lane) {
  using S = ChunkSlot<DP>;
  constexpr int kCodeCopies = kChunk * DP / 32, kRowCopies = DP / 32; /* 16-byte copies */
  constexpr int kKCodeCopies = kChunk * S::kKRow / 16;
  constexpr int kKScaleCopies = kChunk * DP / 64 / 16, kVScaleCopies = kChunk * DP / 16 / 16;
  static_assert(kCodeCopies % 32 == 0 && 32 % kRowCopies == 0, "whole copies per lane");
  const uint8_t *vc = c.v_codes + row * (DP / 2) + 16 * lane;
  char *vd = slot + S::kVc + (lane / kRowCopies) * S::kVStride + 16 * (lane % kRowCopies);
#pragma unroll
  for (int i = 0; i < kCodeCopies / 32; ++i)
    cp_async_16(vd + (32 / kRowCopies) * S::kVStride * i, vc + 512 * i);
  const uint8_t *kc = c.k_codes + row * S::kKRow; /* 32 rows: 20 DP bytes, contiguous */
#pragma unroll
  for (int i = lane; i < kKCodeCopies; i += 32) cp_async_16(slot + S::kKc + 16 * i, kc + 16 * i);
  /* the small arrays: the K and V scales, then K's row-scale bytes and V's decs */
  const uint8_t *ks = c.k_scales + row * (DP / 64), *vs = c.v_scales + row * (DP / 16);
#pragma unroll
  for (int i = lane; i < kKScaleCopies + kVScaleCopies; i += 32) {
    const bool v = i >= kKScaleCopies;
    const int x = v ? i - kKScaleCopies : i;
    cp_async_16(slot + (v ? S::kVs : S::kKs) + 16 * x, (v ? vs : ks) + 16 * x);
  }
  if (lane < 2) /* K: 32 bytes */
    cp_async_16(slot + S::kKe + 16 * lane, c.k_exp + row + 16 * lane);
  else if (lane < 10) /* V: 128 bytes */
    cp_async_16(slot + S::kVd + 16 * (lane - 2), c.v_dec + row + 4 * (lane - 2));
}

/* A staged chunk's registers for this lane, as load_chunk gives them, in two parts: K's rows and
 * both decs first, V's rows and scales when O^T needs them (they are not live across S^T). */
template <int DP>
__device__ __forceinline__ void read_chunk_k(Raw<DP> &raw, const char *slot, int key0, int len,
                                             int lane) {
  using F = Frag<DP>;
  using S = ChunkSlot<DP>;
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int kr = 8 * j + g;
    const char *krow = slot + S::kKc + kr * S::kKRow;
    vector_words(raw.k[j], krow + t4 * (DP / 8));
    if constexpr (F::kKPlane == 2)
      raw.kh[j][0] = vector_bytes<2>(krow + DP / 2 + 2 * t4);
    else
      vector_words(raw.kh[j], krow + DP / 2 + t4 * F::kKPlane);
    raw.ks[j] = *reinterpret_cast<const uint8_t *>(slot + S::kKs + kr * (DP / 64) + t4 * DP / 256);
    raw.kd[j] = k_row_scale(*reinterpret_cast<const uint8_t *>(slot + S::kKe + kr));
    raw.vd[j] = key0 + kr < len ? *reinterpret_cast<const float *>(slot + S::kVd + 4 * kr) : 0.0f;
  }
}
template <int DP>
__device__ __forceinline__ void read_chunk_v(Raw<DP> &raw, const char *slot, int lane) {
  using F = Frag<DP>;
  using S = ChunkSlot<DP>;
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int key = 8 * j + 2 * t4 + x;
      vector_words(raw.v[j][x], slot + S::kVc + key * S::kVStride + g * (DP / 16));
      raw.vs[j][x] = vector_bytes<F::kVBlocks>(slot + S::kVs + key * (DP / 16) + g * DP / 128);
    }
}

/* Sequence b's length, or 0 where it is outside [0, the tokens its block-table row addresses]:
 * such a length would read other sequences' pages (the CPU backend refuses it; here, without a
 * host copy of seq_lens, the decode reads none of its keys and length_fits marks its rows' split
 * maxima NaN, which the merge turns into NaN rows). */
__device__ __forceinline__ bool length_fits(const fp4attn_decode_params &p, int64_t b) {
  const int64_t L = p.seq_lens[b];
  return L >= 0 && L <= p.cache.max_pages * p.cache.page_size;
}

/* Sequence b's first key any of its queries sees (key_start: its left padding), >= 0. */
__device__ __forceinline__ int first_key(const fp4attn_decode_params &p, int64_t b) {
  return p.key_start ? max(0, p.key_start[b]) : 0;
}

/* The keys [begin, end) that row `row` of a tile sees, and where its residual keys start, `exact`
 * (SPEC 6: its newest residual_len keys still in the ring; end without a residual); ks: the
 * sequence's first_key. */
struct RowKeys {
  int begin, exact, end;
};
__device__ __forceinline__ RowKeys row_keys(const fp4attn_decode_params &p, int Lb, int64_t row,
                                            int ks) {
  RowKeys k;
  k.end = (int)min((int64_t)Lb, Lb - p.len_q + row % p.len_q + 1);
  k.begin = p.window > 0 && k.end > p.window ? (int)(k.end - p.window) : 0; /* no overflow */
  k.begin = min(max(k.begin, ks), max(k.end, 0)); /* key_start past the end: no keys */
  k.exact = k.end;
  if (p.residual_len > 0) {
    const int r = (int)p.residual_len, s = (int)p.residual_slots;
    k.exact = max(k.begin, min(k.end, max(k.end - r, Lb - s)));
  }
  return k;
}

/* A raw element of a tensor of dtype `dt` (T: float for FP32, the bits of FP16 / BF16) as float. */
template <typename T>
__device__ __forceinline__ float raw_as_float(T x, fp4attn_dtype dt) {
  if constexpr (sizeof(T) == 4)
    return x;
  else
    return bits16_as_float(x, dt == FP4ATTN_BFLOAT16);
}

/* The residual split (SPEC 6): the tile's rows against their residual keys, the exact K and V rows
 * of the ring, in FP32 (scores scale (q . (K - kmean)), in log2 units like the stored rows'). Per
 * step of kKeys keys, thread (row r, key j) = (tid / kKeys, tid % kKeys) scores its pair, the kKeys
 * threads of a row (lanes of one warp) update its online softmax, then the same thread owns
 * columns j + kKeys i of the row's O. Writes the split's o_part and ml_part as the other splits do.
 * T: the element type of q and the ring, loaded raw (loads batch only if nothing converts them
 * before the last is issued). */
template <int DP, int NQ, typename T>
__device__ void residual_split(const DecodeArgs &a, int64_t tile, int64_t b, int64_t hk, int64_t mt,
                               int Lb, char *smem) {
  using S = ResidualSmem<DP, NQ>;
  constexpr int kKeys = S::kKeys, kCols = DP / kKeys;
  static_assert(kKeys * NQ == kThreads && kKeys <= 32 && DP % kKeys == 0, "the thread layout");
  const fp4attn_decode_params &p = a.p;
  const fp4attn_kv_cache &c = p.cache;
  const int tid = threadIdx.x, r = tid / kKeys, jj = tid % kKeys;
  const int64_t H = c.heads_kv;
  const int G = (int)(p.heads_q / H), nq = (int)p.len_q, M = G * nq; /* 32-bit divisions */
  const int D = (int)c.head_dim, slots = (int)p.residual_slots;
  const float *kmean = c.kmean + (b * H + hk) * D;
  const int64_t ring = (b * H + hk) * slots; /* the sequence's slot 0, in rows */
  float *ks = reinterpret_cast<float *>(smem) + S::kK,
        *vs = reinterpret_cast<float *>(smem) + S::kV;
  float *qs = reinterpret_cast<float *>(smem) + S::kQ,
        *ps = reinterpret_cast<float *>(smem) + S::kP;
  { /* the sequence's ring into L2 at once (a line per thread): the steps below then wait for
     * L2, not for memory, once each */
    const int es = p.dtype == FP4ATTN_FLOAT32 ? 4 : 2; /* bytes per element */
    const int64_t bytes = (int64_t)slots * D * es;
    const char *rk = static_cast<const char *>(p.res_k) + ring * D * es;
    const char *rv = static_cast<const char *>(p.res_v) + ring * D * es;
    for (int64_t off = 128 * (int64_t)tid; off < bytes; off += 128 * kThreads) {
      prefetch_l2(rk + off);
      prefetch_l2(rv + off);
    }
  }

  /* the staging steps issue kBatch loads per array before their stores: few memory latencies,
   * few registers (the kernel's other path sets the budget) */
  constexpr int kQPer = NQ * DP / kThreads, kKVPer = kKeys * DP / kThreads;
  constexpr int kQBatch = kQPer < 8 ? kQPer : 8, kBatch = kKVPer < 8 ? kKVPer : 8;
#pragma unroll
  for (int i0 = 0; i0 < kQPer; i0 += kQBatch) { /* the tile's queries, as given */
    T x[kQBatch];
#pragma unroll
    for (int i = 0; i < kQBatch; ++i) {
      const int e = tid + kThreads * (i0 + i), qr = (int)mt * NQ + e / DP, d = e % DP;
      const int64_t at =
          b * p.q_stride[0] + (hk * G + qr / nq) * p.q_stride[1] + (qr % nq) * p.q_stride[2] + d;
      x[i] = qr < M && d < D ? static_cast<const T *>(p.q)[at] : T(0);
    }
#pragma unroll
    for (int i = 0; i < kQBatch; ++i) {
      const int e = tid + kThreads * (i0 + i);
      qs[(e / DP) * (DP + 1) + e % DP] = raw_as_float(x[i], p.dtype);
    }
  }
  const int64_t row = mt * NQ + r;
  const int kstart = first_key(p, b); /* keys before it (padding) are not loaded: no 0 x NaN */
  const RowKeys rk = row_keys(p, Lb, row, kstart);
  const int lo = row < M ? rk.exact : 0, hi = row < M ? rk.end : 0; /* the row's residual keys */
  const float s_log2 = p.scale * kLog2e;
  float o[kCols] = {}, m = -INFINITY, l = 0.0f;
  for (int j0 = max(0, Lb - slots); j0 < Lb; j0 += kKeys) {
    __syncthreads(); /* the previous keys are read (and the queries written) */
#pragma unroll
    for (int i0 = 0; i0 < kKVPer; i0 += kBatch) {
      T kx[kBatch], vx[kBatch];
      float km[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int e = tid + kThreads * (i0 + i), j = j0 + e / DP, d = e % DP;
        const bool in = j >= kstart && j < Lb && d < D;
        const int64_t at = (ring + j % slots) * D + d;
        kx[i] = in ? static_cast<const T *>(p.res_k)[at] : T(0);
        vx[i] = in ? static_cast<const T *>(p.res_v)[at] : T(0);
        km[i] = in ? kmean[d] : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int e = tid + kThreads * (i0 + i);
        ks[(e / DP) * (DP + 1) + e % DP] = raw_as_float(kx[i], p.dtype) - km[i];
        vs[e] = raw_as_float(vx[i], p.dtype);
      }
    }
    __syncthreads();
    float dot[4] = {};
    const float *qr = qs + r * (DP + 1), *kr = ks + jj * (DP + 1);
#pragma unroll 2
    for (int d = 0; d < DP; d += 4)
#pragma unroll
      for (int x = 0; x < 4; ++x) dot[x] = fmaf(qr[d + x], kr[d + x], dot[x]);
    const int key = j0 + jj;
    const float sc =
        key >= lo && key < hi ? ((dot[0] + dot[1]) + (dot[2] + dot[3])) * s_log2 : -INFINITY;
    float mx = sc; /* the row's kKeys lanes */
#pragma unroll
    for (int w = kKeys / 2; w > 0; w >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, w));
    const float m_new = fmaxf(m, mx);
    const float alpha = m == -INFINITY ? 0.0f : exp2f(m - m_new);
    const float pw = exp2f(sc - (m_new == -INFINITY ? 0.0f : m_new));
    float sum = pw;
#pragma unroll
    for (int w = kKeys / 2; w > 0; w >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, w);
    l = fmaf(l, alpha, sum);
    m = m_new;
    ps[r * kKeys + jj] = pw;
    __syncwarp(); /* the row's weights are written (its lanes are in this warp) */
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      float acc = o[i] * alpha;
#pragma unroll 4
      for (int k = 0; k < kKeys; ++k)
        acc = fmaf(ps[r * kKeys + k], vs[k * DP + jj + kKeys * i], acc);
      o[i] = acc;
    }
  }
  const int64_t part = tile * a.splits; /* split 0 */
#pragma unroll
  for (int i = 0; i < kCols; ++i) a.o_part[(part * NQ + r) * DP + jj + kKeys * i] = o[i];
  if (jj == 0) {
    a.ml_part[(part * NQ + r) * 2] = length_fits(p, b) ? m : NAN;
    a.ml_part[(part * NQ + r) * 2 + 1] = l;
  }
}

/* Blocks per SM the register budget is set for: O^T takes DP / 4 registers per n-tile. (More warps
 * at DP x NT = 128 need 96 registers, which spill: 5 blocks measured slower, and 6 blocks of 3
 * warps put 5 warps on some sub-partitions just the same.) */
template <int DP, int NT>
constexpr int min_blocks() {
  return DP * NT <= 64 ? 5 : (DP * NT <= 128 ? 4 : (DP * NT <= 256 ? 3 : 1));
}

template <int DP, int NT, bool kSplitQ, bool kFast>
__global__ void __launch_bounds__(kThreads, (min_blocks<DP, NT>()))
    decode_kernel(const DecodeArgs a) {
  constexpr int NQ = 8 * NT; /* query rows per tile */
  using L = DecodeSmem<DP, NQ, kSplitQ, kFast>;
  using F = Frag<DP>;
  constexpr int kQPer = NQ * DP / kThreads; /* Q elements per thread */
  static_assert(NQ * DP % kThreads == 0, "whole Q elements per thread");
  extern __shared__ __align__(128) char smem[];
  __shared__ float warp_qmax[kWarps];
  __shared__ int first_seen;      /* first_key, read again in the chunk loop's masked chunks only */
  __shared__ float q_rot[NQ][DP]; /* the tile's queries rotated (SPEC 6), FP32 */
  __shared__ int64_t q_row[NQ];   /* element offset of each tile row's q, -1 past the G x nq rows */
  const fp4attn_decode_params &p = a.p;
  const fp4attn_kv_cache &c = p.cache;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t tile = blockIdx.x, split = blockIdx.y;
  const int64_t H = c.heads_kv, G = p.heads_q / H, nq = p.len_q, M = G * nq;
  const int64_t b = tile / (H * a.mtiles), hk = (tile / a.mtiles) % H, mt = tile % a.mtiles;
  const int D = (int)c.head_dim;
  const bool fits = length_fits(p, b);
  const int Lb = fits ? p.seq_lens[b] : 0;
  DECODE_TRACE_AT(tid == 0, kDtStart, trace_cycles());
  DECODE_TRACE_AT(tid == 0, kDtStartNs, trace_ns());
  DECODE_TRACE_AT(tid == 0, kDtSm, trace_sm());
  grid_dependents_launch(); /* the merge kernel may start */
  /* split 0 is the residual's, where there is one: dispatched first, it runs beside the others */
  const bool residual = a.splits > a.kv_splits;
  if (residual && split == 0) { /* the whole block */
    residual_split<DP, NQ, std::conditional_t<kSplitQ, float, uint16_t>>(a, tile, b, hk, mt, Lb,
                                                                         smem); /* FP32: kSplitQ */
    DECODE_TRACE_AT(tid == 0, kDtResidual, 1);
    DECODE_TRACE_AT(tid == 0, kDtEnd, trace_cycles());
    DECODE_TRACE_AT(tid == 0, kDtEndNs, trace_ns());
    return;
  }
  const int64_t kv_split = split - (residual ? 1 : 0); /* among the stored rows' splits */

  /* this split's chunks (stored rows below Lq: the last row's residual keys are above it); the
   * warp's first one is in flight while the block stages Q */
  const int Lq = p.residual_len > 0 ? (int)max((int64_t)0, Lb - p.residual_len) : Lb;
  const int64_t end0 = Lb - nq + 1;      /* the first row's keys end there */
  const int ks = first_key(p, b);        /* no row sees a key before it */
  if (threadIdx.x == 0) first_seen = ks; /* (the block's barriers before the loop publish it) */
  const int first =
      max(p.window > 0 && end0 > p.window ? (int)((end0 - p.window) / kChunk) : 0, ks / kChunk);
  const int nch = max(0, (Lq + kChunk - 1) / kChunk - first);
  const int per = (nch + (int)a.kv_splits - 1) / (int)a.kv_splits;
  const int c0 = first + (int)kv_split * per, c1 = min(c0 + per, first + nch);
  char *ring = smem + L::kRing + warp * kStages * ChunkSlot<DP>::kBytes;
  int64_t next_row = 0; /* kFast: the cache row of the chunk staged next, looked up early */
  if (kFast) {          /* one cp.async group per chunk, empty past the split's end */
#pragma unroll
    for (int s = 0; s < kAhead; ++s) {
      const int ch = c0 + warp + s * kWarps;
      if (ch < c1)
        stage_chunk<DP>(ring + s * ChunkSlot<DP>::kBytes, c,
                        cache_row(c, a.page, b, hk, ch * kChunk), lane);
      cp_async_commit();
    }
    if (c0 + warp + kAhead * kWarps < c1)
      next_row = cache_row(c, a.page, b, hk, (c0 + warp + kAhead * kWarps) * kChunk);
  }

  if (tid < NQ) {
    const int64_t row = mt * NQ + tid;
    q_row[tid] = row < M ? b * p.q_stride[0] + (hk * G + row / nq) * p.q_stride[1] +
                               (row % nq) * p.q_stride[2]
                         : -1;
  }
  __syncthreads();

  /* The keys are stored divided by kscale and rotated (SPEC 6): q . k = (H (q kscale)) . (H k) / n.
   * A warp per row: lane l holds d = kPer l .. kPer l + kPer - 1 (zeros past D); split 0 writes
   * the row's lse term scale (q . kmean) first, then the row times kscale is rotated by the
   * butterfly in blocks of n (pairs within a lane for h < kPer, across lanes l, l ^ (h / kPer)
   * above) into q_rot. */
  constexpr int kPer = DP / 32;
  const int dp16 = (D + 15) / 16 * 16, n_rot = dp16 & -dp16;
  for (int r = warp; r < NQ; r += kWarps) {
    const int64_t at = q_row[r];
    float x[kPer];
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int d = kPer * lane + i;
      x[i] = at < 0 || d >= D ? 0.0f : load_as_float(p.q, p.dtype, at + d);
      dot += d < D ? x[i] * c.kmean[(b * H + hk) * D + d] : 0.0f;
      x[i] *= d < D ? c.kscale[(b * H + hk) * D + d] : 0.0f;
    }
    if (kv_split == 0) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (lane == 0) a.qshift[tile * NQ + r] = p.scale * dot;
    }
#pragma unroll
    for (int h = 1; h < kPer; h <<= 1)
      if (h < n_rot)
#pragma unroll
        for (int i = 0; i < kPer; ++i)
          if (!(i & h)) {
            const float u = x[i], v = x[i + h];
            x[i] = u + v;
            x[i + h] = u - v;
          }
    for (int h = kPer; h < n_rot; h <<= 1) {
      const int m = h / kPer;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const float o = __shfl_xor_sync(0xffffffffu, x[i], m);
        x[i] = (lane & m) ? o - x[i] : x[i] + o;
      }
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) q_rot[r][kPer * lane + i] = x[i];
  }
  __syncthreads();

  /* The tile's rotated Q as FP16 times 2^-qexp, a power of two that puts its largest |q| in
   * [2^14, 2^15): one rounding to FP16 for FP16 and BF16 inputs (the rotation's sums are not
   * 16-bit values), 22 bits as hi + lo parts for FP32. Thread tid holds slot columns (tid +
   * kThreads k) % DP of row (tid + kThreads k) / DP (a warp: 32 slot columns of one row). */
  float qv[kQPer];
  float qmax = 0.0f;
#pragma unroll
  for (int k = 0; k < kQPer; ++k) {
    const int i = tid + kThreads * k, r = i / DP, d = q_dim<DP>(i % DP);
    qv[k] = q_rot[r][d];
    qmax = fmaxf(qmax, fabsf(qv[k]));
  }
  qmax = block_max<kWarps>(qmax, warp_qmax);
  const int qexp = qmax > 0.0f && qmax <= FLT_MAX ? max(-126, min(126, ilogbf(qmax) - 14)) : 0;
  const float qinv = ldexpf(1.0f, -qexp);
#pragma unroll
  for (int k = 0; k < kQPer; ++k) {
    const int i = tid + kThreads * k, r = i / DP, col = i % DP;
    const float v = qv[k] * qinv;
    const __half hi = __float2half_rn(v);
    *reinterpret_cast<__half *>(smem + L::kQ + swz_byte<L::kW>(r, 2 * col)) = hi;
    if (kSplitQ)
      *reinterpret_cast<__half *>(smem + L::kQlo + swz_byte<L::kW>(r, 2 * col)) =
          __float2half_rn(v - __half2float(hi));
  }
  __syncthreads();
  DECODE_TRACE_AT(tid == 0, kDtQReady, trace_cycles());

  /* the lane's query 8n + 2 t4 + e reads the stored rows of keys [begin, end) */
  int end[NT][2], begin[NT][2];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const RowKeys k = row_keys(p, Lb, mt * NQ + 8 * n + 2 * t4 + e, ks);
      end[n][e] = k.exact;
      begin[n][e] = k.begin;
    }
  /* keys that every row of the tile sees: the chunks inside need no mask */
  int seen_lo = 0, seen_hi = INT_MAX;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      seen_lo = max(seen_lo, begin[n][e]), seen_hi = min(seen_hi, end[n][e]);
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    seen_lo = max(seen_lo, __shfl_xor_sync(0xffffffffu, seen_lo, o));
    seen_hi = min(seen_hi, __shfl_xor_sync(0xffffffffu, seen_hi, o));
  }
  /* S in log2 units = (Q 2^-qexp . K 2^-8) x 2^(e - 127) x s_log2, the rotation's 1 / n in it */
  const float s_log2 = ldexpf(p.scale * kLog2e * kScaleUnit, qexp - (__ffs(n_rot) - 1));

  /* O = (sum P V 2^-8) x vref: the MMAs accumulate P dec / vref, vref the warp's running
   * max |dec| of V, in [0, 1] like P itself; O is rescaled when vref grows, as when m does */
  float o[DP / 16][NT][4] = {};
  float m[NT][2], l[NT][2], vref = 0.0f, vinv = 0.0f; /* vinv = 1 / vref (0 while vref is) */
#pragma unroll
  for (int n = 0; n < NT; ++n) m[n][0] = m[n][1] = -INFINITY, l[n][0] = l[n][1] = 0.0f;
  for (int ch = c0 + warp, it = 0; ch < c1; ch += kWarps, ++it) {
    const int j0 = ch * kChunk;
    Raw<DP> cur;
    const char *slot = ring + (it % kStages) * ChunkSlot<DP>::kBytes; /* kFast: this chunk's */
    if (kFast) {    /* the chunk kAhead on into the slot freed last, then this one's registers */
      __syncwarp(); /* the lanes' reads of the slot to be refilled are done */
      if (ch + kAhead * kWarps < c1) {
        stage_chunk<DP>(ring + ((it + kAhead) % kStages) * ChunkSlot<DP>::kBytes, c, next_row,
                        lane);
        if (ch + (kAhead + 1) * kWarps < c1)
          next_row = cache_row(c, a.page, b, hk, j0 + (kAhead + 1) * kWarps * kChunk);
      }
      cp_async_commit();
      cp_async_wait_group<kAhead>();
      __syncwarp();
      DECODE_TRACE_AT(tid == 0 && it == 0, kDtFirstChunk, trace_cycles());
      read_chunk_k<DP>(cur, slot, j0, Lb, lane);
    } else {
      load_chunk<DP>(cur, c, a.page, b, hk, j0, Lb, lane);
    }

    /* S^T = K Q^T: word i of key 8j + g feeds k-steps 2i, 2i + 1 of m-tile j / 2 */
    float s[2][NT][4] = {};
#pragma unroll
    for (int i = 0; i < F::kKWords; ++i) {
      uint32_t qb[NT][2][2], qlo[NT][2][2];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        ldsm_b_x2k<L::kW>(qb[n], smem + L::kQ, 8 * n, 2 * i * 32);
        if (kSplitQ) ldsm_b_x2k<L::kW>(qlo[n], smem + L::kQlo, 8 * n, 2 * i * 32);
      }
#pragma unroll
      for (int km = 0; km < 2; ++km) {
        uint32_t pr[2][4], s2[2]; /* keys 8 (2 km + x) + g */
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const uint32_t hb = (cur.kh[2 * km + x][i / 4] >> (8 * (i % 4))) & 0xFFu;
          k5_pairs(cur.k[2 * km + x][i], hb, pr[x]);
#pragma unroll
          for (int y = 0; y < 4; ++y) pr[x][y] = h2_sub(pr[x][y], kK5Offset);
          s2[x] = k5_scale_pair(cur.ks[2 * km + x]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t ka[4] = {h2_mul(pr[0][2 * h], s2[0]), h2_mul(pr[1][2 * h], s2[1]),
                                  h2_mul(pr[0][2 * h + 1], s2[0]), h2_mul(pr[1][2 * h + 1], s2[1])};
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            mma_16816(s[km][n], ka, qb[n][h][0], qb[n][h][1]);
            if (kSplitQ) mma_16816(s[km][n], ka, qlo[n][h][0], qlo[n][h][1]);
          }
        }
      }
    }

    const bool inside = j0 >= seen_lo && j0 + kChunk <= seen_hi; /* the same in every lane */
    /* keys before the sequence's first seen one (padding; only in a masked chunk): V's dec 0,
     * so that a NaN or huge dec there reaches neither vref nor, as 0 x NaN, the MMA */
    if (!inside && j0 < first_seen)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (j0 + 8 * j + g < first_seen) cur.vd[j] = 0.0f;

    /* online softmax over the chunk: a query's keys lie across the lanes of one t4 */
    float vmax =
        fmaxf(fmaxf(fabsf(cur.vd[0]), fabsf(cur.vd[1])), fmaxf(fabsf(cur.vd[2]), fabsf(cur.vd[3])));
#pragma unroll
    for (int o4 = 4; o4 < 32; o4 <<= 1) vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, o4));
    float vgrow = 1.0f; /* O's factor for a new vref */
    if (vmax > vref) {  /* the same in every lane, and rare: vref only grows */
      vinv = 1.0f / vmax;
      vgrow = vref * vinv;
      vref = vmax;
    }
    float kf[4], vf[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) kf[j] = cur.kd[j] * s_log2, vf[j] = cur.vd[j] * vinv;
    float alpha[NT][2], mref[NT][2];
    bool rescale = vgrow != 1.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) s[j >> 1][n][2 * (j & 1) + e] *= kf[j];
    if (!inside) /* (a garbage key's NaN score is dropped here) */
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = j0 + 8 * j + g;
            float &v = s[j >> 1][n][2 * (j & 1) + e];
            v = key < end[n][e] && key >= begin[n][e] ? v : -INFINITY;
          }
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; ++j) x = fmaxf(x, s[j >> 1][n][2 * (j & 1) + e]);
#pragma unroll
        for (int o4 = 4; o4 < 32; o4 <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o4));
        const float m_new = fmaxf(m[n][e], x);
        alpha[n][e] = m[n][e] == -INFINITY ? 0.0f : fast_exp2(m[n][e] - m_new);
        mref[n][e] = m_new == -INFINITY ? 0.0f : m_new;
        m[n][e] = m_new;
        l[n][e] *= alpha[n][e];
        rescale |= alpha[n][e] != 1.0f;
      }
    /* P^T fragments: pb[km][n] = (b0, b1) of O^T's k-step km */
    uint32_t pb[2][NT][2];
#pragma unroll
    for (int km = 0; km < 2; ++km)
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        float pv[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pe = fast_exp2(s[km][n][e] - mref[n][e & 1]);
          l[n][e & 1] += pe;                  /* the lane's share of the row sum */
          pv[e] = pe * vf[2 * km + (e >> 1)]; /* in [0, 1] */
        }
        pb[km][n][0] = movmatrix_trans(pack_half2(pv[0], pv[1]));
        pb[km][n][1] = movmatrix_trans(pack_half2(pv[2], pv[3]));
      }
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) alpha[n][e] *= vgrow;
#pragma unroll
      for (int r = 0; r < DP / 16; ++r)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[r][n][e] *= alpha[n][e & 1];
    }

    if (kFast) read_chunk_v<DP>(cur, slot, lane);
    if (!inside && j0 < first_seen) /* and their V scales 0 (a NaN scale: 0 x NaN) */
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int x = 0; x < 2; ++x)
          if (j0 + 8 * j + 2 * t4 + x < first_seen) cur.vs[j][x] = 0u;
    /* O^T += V^T P^T: k-step km holds keys 16 km + 2 t4 + x (group 2 km) and + 8 (2 km + 1) */
#pragma unroll
    for (int km = 0; km < 2; ++km)
#pragma unroll
      for (int w = 0; w < F::kVWords; ++w) {
        uint32_t pair[2][2][4]; /* [k-slot half][d nibbles 0-3 / 4-7][pair] */
        uint32_t sc2[2];        /* the two keys' scales (key 0 low, key 1 high) */
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const uint32_t x0 = cur.v[2 * km + hf][0][w], x1 = cur.v[2 * km + hf][1][w];
          /* key 0's 4 nibbles below key 1's: pair j = (key 0, key 1) at nibble j */
          e2m1_pairs(prmt_b32(x0, x1, 0x5410u), pair[hf][0]);
          e2m1_pairs(prmt_b32(x0, x1, 0x7632u), pair[hf][1]);
          sc2[hf] = v_scale_pair(cur.vs[2 * km + hf][0], cur.vs[2 * km + hf][1], w / 2);
        }
      /* m-tile 4w + 2 half + y: rows 0-7 nibble 2y, rows 8-15 nibble 2y + 1 */
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int y = 0; y < 2; ++y) {
            const uint32_t va[4] = {
                h2_mul(pair[0][half][2 * y], sc2[0]), h2_mul(pair[0][half][2 * y + 1], sc2[0]),
                h2_mul(pair[1][half][2 * y], sc2[1]), h2_mul(pair[1][half][2 * y + 1], sc2[1])};
#pragma unroll
            for (int n = 0; n < NT; ++n)
              mma_16816(o[4 * w + 2 * half + y][n], va, pb[km][n][0], pb[km][n][1]);
          }
      }
  }

  DECODE_TRACE_AT(tid == 0, kDtLoopEnd, trace_cycles());
  DECODE_TRACE_AT(tid == 0, kDtChunks,
                  (unsigned long long)(c1 > c0 ? (c1 - c0 - 1) / kWarps + 1 : 0));
  /* merge the warps in shared memory (the Q tiles and slots are free now) */
  if (kFast) cp_async_wait_all();
  __syncthreads();
  float *wo = reinterpret_cast<float *>(smem); /* [warps][NQ][DP] */
  float *wml = wo + kWarps * NQ * DP;          /* [warps][NQ][2] */
  const float ounit = vref * kScaleUnit;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float ls = l[n][e];
#pragma unroll
      for (int o4 = 4; o4 < 32; o4 <<= 1) ls += __shfl_xor_sync(0xffffffffu, ls, o4);
      const int row = 8 * n + 2 * t4 + e;
      if (g == 0) {
        wml[(warp * NQ + row) * 2] = m[n][e];
        wml[(warp * NQ + row) * 2 + 1] = ls;
      }
#pragma unroll
      for (int r = 0; r < DP / 16; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          wo[(warp * NQ + row) * DP + o_dim<DP>(r, g + 8 * h)] = o[r][n][2 * h + e] * ounit;
    }
  __syncthreads();
  DECODE_TRACE_AT(tid == 0, kDtMerged, trace_cycles());
  const int64_t part = tile * a.splits + split;
  for (int i = tid; i < NQ * DP; i += kThreads) {
    const int row = i / DP, d = i % DP;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, wml[(w * NQ + row) * 2]);
    float acc = 0.0f, ls = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = wml[(w * NQ + row) * 2];
      const float f = mw == -INFINITY ? 0.0f : exp2f(mw - mx);
      acc += f * wo[(w * NQ + row) * DP + d];
      ls += f * wml[(w * NQ + row) * 2 + 1];
    }
    a.o_part[(part * NQ + row) * DP + d] = acc;
    if (d == 0) {
      a.ml_part[(part * NQ + row) * 2] = fits ? mx : NAN;
      a.ml_part[(part * NQ + row) * 2 + 1] = ls;
    }
  }
  DECODE_TRACE_AT(tid == 0, kDtEnd, trace_cycles());
  DECODE_TRACE_AT(tid == 0, kDtEndNs, trace_ns());
}

/* Whether the cache allows the staged loads (stage_chunk, kFast) for this head dim. */
bool fast_layout(const fp4attn_kv_cache &c, int64_t dp) {
  auto aligned = [](const void *x) { return reinterpret_cast<uintptr_t>(x) % 16 == 0; };
  return c.page_size % kChunk == 0 && c.head_dim == dp && aligned(c.k_codes) &&
         aligned(c.v_codes) && aligned(c.k_scales) && aligned(c.v_scales) && aligned(c.k_exp) &&
         aligned(c.v_dec);
}

using DecodeKernel = void (*)(DecodeArgs);

/* A kernel variant on the current device, asked once per kernel and device: whether its static
 * shared memory plus `smem` dynamic bytes fit one block (the staged head-dim-256 variants do not
 * on GPUs of 99 KB per block: sm_86, sm_89, sm_120), and where they do, its resident blocks per SM
 * once its dynamic shared memory limit is raised (only the head dim 256 variants need more than
 * the default 48 KB) and the carveout set to shared memory (the chunk slots are the kernel's
 * cache: cp.async.cg bypasses L1). A CUDA call that fails gives 1 block and is asked again. */
struct DeviceFit {
  bool fits;
  int blocks;
};
DeviceFit device_fit(DecodeKernel kernel, int smem) {
  static std::mutex mu;
  static std::map<std::pair<DecodeKernel, int>, DeviceFit> known;
  int dev = 0;
  cudaGetDevice(&dev);
  std::lock_guard<std::mutex> lock(mu);
  const auto it = known.find({kernel, dev});
  if (it != known.end()) return it->second;
  cudaFuncAttributes attr;
  int optin = 0, n = 0;
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    cudaGetLastError();
    return {false, 1};
  }
  if ((int64_t)attr.sharedSizeBytes + smem > optin) return known[{kernel, dev}] = {false, 1};
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
          cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem) != cudaSuccess) {
    cudaGetLastError();
    return {true, 1};
  }
  return known[{kernel, dev}] = {true, n > 0 ? n : 1};
}

/* The staged variant where the cache allows it and the device holds its chunk slots, else the
 * plain one (the same numbers: both decode every row alike). */
template <int DP, int NT, bool kSplitQ>
DecodeKernel variant(bool fast, int *smem) {
  using Fast = DecodeSmem<DP, 8 * NT, kSplitQ, true>;
  using Plain = DecodeSmem<DP, 8 * NT, kSplitQ, false>;
  if (fast && device_fit(decode_kernel<DP, NT, kSplitQ, true>, Fast::kBytes).fits) {
    *smem = Fast::kBytes;
    return decode_kernel<DP, NT, kSplitQ, true>;
  }
  *smem = Plain::kBytes;
  return decode_kernel<DP, NT, kSplitQ, false>;
}
template <int DP, int NT>
DecodeKernel variant(fp4attn_dtype dt, bool fast, int *smem) {
  return dt == FP4ATTN_FLOAT32 ? variant<DP, NT, true>(fast, smem)
                               : variant<DP, NT, false>(fast, smem);
}

/* The kernel variant of a call (padded head dim, 8 or 16 query rows per tile) and its dynamic
 * shared memory. */
DecodeKernel kernel_for(const fp4attn_decode_params &p, int64_t dp, int64_t rows, int *smem) {
  const bool fast = fast_layout(p.cache, dp), one = rows == 8;
  switch (dp) {
    case 64:
      return one ? variant<64, 1>(p.dtype, fast, smem) : variant<64, 2>(p.dtype, fast, smem);
    case 128:
      return one ? variant<128, 1>(p.dtype, fast, smem) : variant<128, 2>(p.dtype, fast, smem);
    default:
      return one ? variant<256, 1>(p.dtype, fast, smem) : variant<256, 2>(p.dtype, fast, smem);
  }
}

template <int DP>
fp4attn_status launch_dp(const DecodeArgs &a, const KvDecodePlan &plan, cudaStream_t s) {
  int smem = 0;
  const DecodeKernel kernel = kernel_for(a.p, DP, plan.rows, &smem);
  device_fit(kernel, smem); /* raises the kernel's shared memory limit once */
  kernel<<<dim3((unsigned)plan.tiles, (unsigned)plan.splits), kThreads, smem, s>>>(a);
  /* no merge of partials the kernel did not write */
  const fp4attn_status st = launch_status("decode");
  if (st.code != FP4ATTN_OK) return st;
  const fp4attn_decode_params &p = a.p;
  launch_split_merge<DP>({a.o_part,
                          a.ml_part,
                          a.qshift,
                          a.splits,
                          a.mtiles,
                          plan.rows,
                          p.heads_q,
                          p.cache.heads_kv,
                          p.len_q,
                          p.cache.head_dim,
                          p.out,
                          {p.out_stride[0], p.out_stride[1], p.out_stride[2]},
                          p.dtype,
                          p.lse},
                         plan.tiles, s);
  return launch_status("decode: split merge");
}

}  // namespace

int kv_decode_blocks_per_sm(const fp4attn_decode_params &p, int64_t dp, int64_t rows) {
  int smem = 0;
  const DecodeKernel kernel = kernel_for(p, dp, rows, &smem);
  return device_fit(kernel, smem).blocks;
}

#if defined(FP4ATTN_DECODE_TRACE)
/* Development only (tools/perf/trace_decode.cu): copy out `blocks` rows of the decode kernel's
 * timeline, then clear it for the next call. Returns 0 on success. */
extern "C" int fp4attn_decode_trace_take(unsigned long long *host, int blocks) {
  return trace_take(g_decode_trace, host, blocks);
}
#endif

fp4attn_status launch_kv_decode(const fp4attn_decode_params &p, const KvDecodePlan &plan,
                                void *workspace, cudaStream_t s) {
  if (plan.tiles > 0x7FFFFFFFLL || plan.splits > 65535)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "decode: too many tiles");
  if (p.cache.num_pages * p.cache.heads_kv * p.cache.page_size > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "decode: a cache of more than 2^31 - 1 rows");
  DecodeArgs a;
  a.p = p;
  char *w = static_cast<char *>(workspace);
  a.o_part = reinterpret_cast<float *>(w);
  a.ml_part = reinterpret_cast<float *>(w + plan.o_part_bytes);
  a.qshift = reinterpret_cast<float *>(w + plan.o_part_bytes + plan.ml_part_bytes);
  a.mtiles = plan.mtiles;
  a.splits = plan.splits;
  a.kv_splits = plan.kv_splits;
  a.page = DivU32((uint32_t)p.cache.page_size);
  switch (plan.dp) {
    case 64:
      return launch_dp<64>(a, plan, s);
    case 128:
      return launch_dp<128>(a, plan, s);
    default:
      return launch_dp<256>(a, plan, s);
  }
}

}  // namespace fp4attn_cuda
