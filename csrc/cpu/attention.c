/*
 * CPU FP4 attention forward (SPEC.md section 4).
 *
 * Four parallel phases:
 *   1. per (batch, kv head): K smoothing (4.1) and quantization of Ks along D (4.3), kept as
 *      exactly dequantized FP32 values (code * block scale, no global scale), K transposed to
 *      [D][Nk] so the score loop runs along keys; V copied to FP32;
 *   2. per (batch, query head): per-128-row Q smoothing (4.2) and quantization of Qs;
 *   3. per (batch, kv head): V smoothing (4.3: vbar from the query means of phase 2 and the keys)
 *      and quantization of V - vbar along tokens;
 *   4. per (batch, query head, 128-row query block): 128-key tiles with the scores of 4.4
 *      (FP4 product with the global scales in FP32, plus the q-mean correction against K in input
 *      precision), masks, the online softmax with two-level P quantization of 4.5, and
 *      O / l + vbar (4.6).
 * Inner loops are axpy-shaped (no reductions) so the compiler vectorises them without
 * reassociating; target_clones adds an AVX2 version chosen at load time.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FP4ATTN_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FP4ATTN_VECTOR_CLONES
#endif

enum { BQ = FP4ATTN_BLOCK_Q, BKV = FP4ATTN_BLOCK_KV };

typedef struct {
  const fp4attn_attention_params *p;
  int64_t nk_pad;   /* len_k rounded up to BKV (a multiple of 16) */
  int64_t d_pad;    /* head_dim rounded up to 16 */
  int64_t n_qblock; /* query blocks per head */
  /* K is stored per key tile and transposed, [B*Hkv][tile][D][BKV]: the score loop runs along
   * keys, and a tile's D rows are 512 bytes apart (a stride of whole sequences would alias the
   * same L1 sets for every d). */
  float *kd_t;      /* dequantized smoothed K, without dK */
  float *kf_t;      /* K in input precision (for the q-mean correction) */
  float *vd;        /* [B*Hkv][nk_pad][d_pad] dequantized V, without dV (zero padded) */
  float *dk, *dv;   /* [B*Hkv] global scales */
  float *qd;        /* [B*Hq][n_qblock*BQ][D] dequantized smoothed Q (zero rows past Nq) */
  float *qbar;      /* [B*Hq][n_qblock][D] */
  float *dq;        /* [B*Hq] */
  float *kbar;      /* [B*Hkv][D] key means */
  float *vbar;      /* [B*Hkv][D] V smoothing means (SPEC 4.3) */
  float *lse_shift; /* [B*Hq][Nq] scale * (q_r - qbar_i) . kbar, only when the LSE is wanted */
} attention_state;

/* Offset of key j, channel d inside one head's tiled, transposed K. */
static inline int64_t kt_offset(int64_t j, int64_t d, int64_t D) {
  return (j / BKV) * D * BKV + d * BKV + j % BKV;
}

static float load_qkv(const void *base, fp4attn_dtype dt, const int64_t *stride, int64_t b,
                      int64_t h, int64_t n, int64_t d) {
  return fp4attn_load(base, dt, b * stride[0] + h * stride[1] + n * stride[2] + d);
}

/* GNU vector type: 8 floats, one AVX register (two SSE registers in the default clone). The
 * micro-kernels below are written with it because the auto-vectoriser picks the wrong loop. */
typedef float v8f __attribute__((vector_size(32), aligned(4)));

#define v8f_splat(a) ((v8f){(a), (a), (a), (a), (a), (a), (a), (a)})

typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

/* Largest of 16 values with NaN propagation (fp4attn_nanmax over a block, vectorised). */
static inline float block_nanmax16(const float *x) {
  v8f m = *(const v8f *)x;
  const v8f b = *(const v8f *)(x + 8);
  v8i take = (v8i)(b > m) | (v8i)(b != b);
  m = (v8f)(((v8i)b & take) | ((v8i)m & ~take));
  float r = 0.0f;
  for (int i = 0; i < 8; ++i) r = fp4attn_nanmax(r, m[i]);
  return r;
}

/* phi (SPEC 2) of one row straight to values: out[c * out_stride] = value(code) * block scale
 * (no global scale), for rows of `cols` values already in FP32. Same roundings as
 * fp4attn_quantize_row; a NaN input gives a NaN block scale, like the packed path. */
static void quantize_row_values(const float *x, int64_t cols, float enc, float *out,
                                int64_t out_stride) {
  for (int64_t c0 = 0; c0 < cols; c0 += FP4ATTN_BLOCK) {
    float xs[FP4ATTN_BLOCK], mag[FP4ATTN_BLOCK];
    const int n = cols - c0 < FP4ATTN_BLOCK ? (int)(cols - c0) : FP4ATTN_BLOCK;
    for (int i = 0; i < FP4ATTN_BLOCK; ++i) {
      xs[i] = i < n ? x[c0 + i] * enc : 0.0f;
      mag[i] = xs[i] < 0.0f ? -xs[i] : xs[i];
    }
    const float sc = fp4attn_e4m3_decode(fp4attn_e4m3_encode_sat(block_nanmax16(mag) / 6.0f));
    const float r = sc == 0.0f ? 0.0f : 1.0f / sc;
    for (int i = 0; i < n; ++i) {
      const float v = fp4attn_e2m1_round_nonneg(mag[i] * r) * sc;
      out[(c0 + i) * out_stride] = xs[i] < 0.0f ? -v : v;
    }
  }
}

/* exp(x) for 8 values x <= 0 (-inf gives 0, NaN stays NaN) within ~2 ulp, branch-free so the P
 * loop vectorises (SPEC 5 lets exp rounding differ between backends). exp(x) = 2^n * 2^f with
 * n = round(x*log2 e) and f in [-1/2, 1/2]; 2^f by its degree-7 Taylor polynomial. */
static inline v8f exp_nonpos8(v8f x) {
  const v8f t = x * v8f_splat(1.44269504088896341f);
  const v8f magic = v8f_splat(12582912.0f); /* 1.5 * 2^23: add and subtract to round */
  v8f n = (t + magic) - magic;
  const v8f f = t - n;
  v8f p = v8f_splat(1.525273380405984e-05f);
  p = p * f + v8f_splat(1.5403530393381606e-04f);
  p = p * f + v8f_splat(1.3333558146428443e-03f);
  p = p * f + v8f_splat(9.618129107628477e-03f);
  p = p * f + v8f_splat(5.550410866482158e-02f);
  p = p * f + v8f_splat(2.402265069591007e-01f);
  p = p * f + v8f_splat(6.931471805599453e-01f);
  p = p * f + v8f_splat(1.0f);
  /* clamp n to [-126, 0] with masks; NaN lanes get -126 (p carries the NaN) */
  const v8i keep = (v8i)(n > v8f_splat(-126.0f));
  n = (v8f)(((v8i)n & keep) | ((v8i)v8f_splat(-126.0f) & ~keep));
  const v8i two_n = (__builtin_convertvector(n, v8i) + 127) << 23;
  const v8i underflow = (v8i)(x < v8f_splat(-87.0f));
  return (v8f)((v8i)(p * (v8f)two_n) & ~underflow);
}

/* Phase 1: smooth and quantize K (along D) of one (batch, kv head); V into vd as FP32. */
static int prepare_kv(attention_state *st, int64_t b, int64_t h) {
  const fp4attn_attention_params *p = st->p;
  const int64_t nk = p->len_k, D = p->head_dim, np = st->nk_pad, bh = b * p->heads_kv + h;
  float *kd_t = st->kd_t + bh * D * np, *kf_t = st->kf_t + bh * D * np,
        *vd = st->vd + bh * np * st->d_pad;
  float *ks = (float *)calloc((size_t)(nk * st->d_pad), sizeof(float));
  float *kbar = st->kbar + bh * D;
  int ok = ks != NULL;
  if (ok) {
    /* 4.1: kbar = mean over the real tokens, in FP32 */
    for (int64_t d = 0; d < D; ++d) kbar[d] = 0.0f;
    for (int64_t j = 0; j < nk; ++j)
      for (int64_t d = 0; d < D; ++d) {
        float v = load_qkv(p->k, p->dtype, p->k_stride, b, h, j, d);
        kf_t[kt_offset(j, d, D)] = v;
        kbar[d] += v;
      }
    for (int64_t d = 0; d < D; ++d) kbar[d] /= (float)nk;
    float amax = 0.0f;
    for (int64_t j = 0; j < nk; ++j)
      for (int64_t d = 0; d < D; ++d) {
        float v = kf_t[kt_offset(j, d, D)] - kbar[d];
        ks[j * st->d_pad + d] = v;
        amax = fp4attn_nanmax(amax, fabsf(v));
      }
    float enc, dec;
    fp4attn_global_scales(amax, &enc, &dec);
    st->dk[bh] = dec;
    for (int64_t j = 0; j < nk; ++j)
      quantize_row_values(ks + j * st->d_pad, D, enc, kd_t + kt_offset(j, 0, D), BKV);
    for (int64_t j = 0; j < nk; ++j)
      for (int64_t d = 0; d < D; ++d)
        vd[j * st->d_pad + d] = load_qkv(p->v, p->dtype, p->v_stride, b, h, j, d);
  }
  free(ks);
  return ok;
}

/* Phase 2: per-128-row smoothing and quantization of Q for one (batch, query head). */
static int prepare_q(attention_state *st, int64_t b, int64_t h) {
  const fp4attn_attention_params *p = st->p;
  const int64_t nq = p->len_q, D = p->head_dim, bh = b * p->heads_q + h;
  float *qd = st->qd + bh * st->n_qblock * BQ * D, *qbar = st->qbar + bh * st->n_qblock * D;
  float *qs = (float *)calloc((size_t)(nq * st->d_pad), sizeof(float));
  int ok = qs != NULL;
  if (ok) {
    float amax = 0.0f;
    for (int64_t qb = 0; qb < st->n_qblock; ++qb) {
      const int64_t i0 = qb * BQ, i1 = i0 + BQ < nq ? i0 + BQ : nq;
      float *mean = qbar + qb * D;
      for (int64_t d = 0; d < D; ++d) mean[d] = 0.0f;
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t d = 0; d < D; ++d) {
          float v = load_qkv(p->q, p->dtype, p->q_stride, b, h, i, d);
          qs[i * st->d_pad + d] = v;
          mean[d] += v;
        }
      for (int64_t d = 0; d < D; ++d) mean[d] /= (float)(i1 - i0);
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t d = 0; d < D; ++d) {
          float v = qs[i * st->d_pad + d] - mean[d];
          qs[i * st->d_pad + d] = v;
          amax = fp4attn_nanmax(amax, fabsf(v));
        }
    }
    float enc, dec;
    fp4attn_global_scales(amax, &enc, &dec);
    st->dq[bh] = dec;
    for (int64_t i = 0; i < nq; ++i) quantize_row_values(qs + i * st->d_pad, D, enc, qd + i * D, 1);
    /* The scores of SPEC 4.4 lack the per-row constant (q_r - qbar_i) . kbar (it cancels in the
     * softmax); the LSE adds it back so LSEs of key ranges with different kbar can be merged. */
    if (st->lse_shift) {
      const float *kbar = st->kbar + (b * p->heads_kv + h / (p->heads_q / p->heads_kv)) * D;
      for (int64_t i = 0; i < nq; ++i) {
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += qs[i * st->d_pad + d] * kbar[d];
        st->lse_shift[bh * nq + i] = p->scale * dot;
      }
    }
  }
  free(qs);
  return ok;
}

static float mask_value(const fp4attn_attention_params *p, int64_t b, int64_t h, int64_t i,
                        int64_t j) {
  const int64_t off =
      b * p->mask_stride[0] + h * p->mask_stride[1] + i * p->mask_stride[2] + j * p->mask_stride[3];
  if (p->mask_kind == FP4ATTN_MASK_BOOL) return ((const uint8_t *)p->mask)[off] ? 0.0f : -INFINITY;
  return fp4attn_load(p->mask, p->mask_dtype, off);
}

/* The masks of vbar (SPEC 4.3) for one (batch, kv head): seen[g * nq + i] = 1 where row i of the
 * head's query head g sees some key, bias[j] the key's bias in vbar's softmax: -inf for a key no
 * row sees, else the largest mask value (0 for a bool mask and causal) over the entries that see
 * it. An entry (i, j) is seen when causal allows it (j <= i) and the mask value is above -inf. A
 * mask broadcast over rows (and without causal) or over heads is read once. */
static void vbar_visibility(const fp4attn_attention_params *p, int64_t b, int64_t h, uint8_t *seen,
                            float *bias) {
  const int64_t nk = p->len_k, nq = p->len_q, G = p->heads_q / p->heads_kv;
  for (int64_t j = 0; j < nk; ++j) bias[j] = -INFINITY;
  if (p->mask_kind == FP4ATTN_MASK_NONE) { /* causal only: row i sees keys 0..i */
    for (int64_t j = 0; j < nk && j < nq; ++j) bias[j] = 0.0f;
    memset(seen, 1, (size_t)(G * nq));
    return;
  }
  const int64_t gn = p->mask_stride[1] == 0 ? 1 : G;
  const int64_t in = p->mask_stride[2] == 0 && !p->causal ? 1 : nq;
  for (int64_t g = 0; g < gn; ++g)
    for (int64_t i = 0; i < in; ++i) {
      const int64_t jn = p->causal && i + 1 < nk ? i + 1 : nk;
      uint8_t any = 0;
      for (int64_t j = 0; j < jn; ++j) {
        const float x = mask_value(p, b, h * G + g, i, j);
        if (x > -INFINITY) {
          any = 1;
          bias[j] = fmaxf(bias[j], x);
        }
      }
      seen[g * nq + i] = any;
    }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < nq; ++i)
      seen[g * nq + i] = seen[(g < gn ? g : 0) * nq + (i < in ? i : 0)];
}

/* vbar of SPEC 4.3 for one (batch, kv head), in its order: qm from the query-block means of the
 * head's G query heads (h, then block, ascending), the scores scale * qm . K_j (d ascending), per
 * 128-key chunk its maximum, sum of exponentials and exponential-weighted sum of V (keys
 * ascending), the chunks merged in chunk order; 0 where it is not finite. With a mask or causal
 * (`masked`): a block's mean and count over its rows that see some key (the phase-2 mean where
 * all do; a mean of its own, rows ascending, where some do not), qm divided by the number of such
 * rows (qm = 0 if none), each score plus the key's bias of vbar_visibility, and a chunk whose
 * scores are all -inf adds nothing. */
static int v_mean(const attention_state *st, int64_t b, int64_t h, float *vbar) {
  const fp4attn_attention_params *p = st->p;
  const int64_t nk = p->len_k, nq = p->len_q, D = p->head_dim, np = st->nk_pad;
  const int64_t G = p->heads_q / p->heads_kv, bh = b * p->heads_kv + h;
  const int64_t nchunks = np / BKV;
  const int masked = p->mask_kind != FP4ATTN_MASK_NONE || p->causal;
  float *qm = (float *)calloc((size_t)D, sizeof(float));
  float *a = (float *)calloc((size_t)D, sizeof(float));
  float *ac = (float *)malloc(sizeof(float) * (size_t)(nchunks * D));
  float *mc = (float *)malloc(sizeof(float) * (size_t)nchunks);
  float *lc = (float *)malloc(sizeof(float) * (size_t)nchunks);
  uint8_t *seen = masked ? (uint8_t *)malloc((size_t)(G * nq)) : NULL;
  float *kbias = masked ? (float *)malloc(sizeof(float) * (size_t)nk) : NULL;
  float *msum = masked ? (float *)malloc(sizeof(float) * (size_t)D) : NULL;
  int ok = qm && a && ac && mc && lc && (!masked || (seen && kbias && msum));
  if (ok) {
    if (masked) vbar_visibility(p, b, h, seen, kbias);
    int64_t total = 0;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t qb = 0; qb < st->n_qblock; ++qb) {
        const int64_t i0 = qb * BQ, n = nq - i0 < BQ ? nq - i0 : BQ;
        const float *mean = st->qbar + ((b * p->heads_q + h * G + g) * st->n_qblock + qb) * D;
        int64_t cnt = n;
        if (masked) {
          cnt = 0;
          for (int64_t i = i0; i < i0 + n; ++i) cnt += seen[g * nq + i];
        }
        if (cnt == 0) continue;
        if (cnt < n) { /* the mean of the block's rows that see some key */
          for (int64_t d = 0; d < D; ++d) msum[d] = 0.0f;
          for (int64_t i = i0; i < i0 + n; ++i)
            if (seen[g * nq + i])
              for (int64_t d = 0; d < D; ++d)
                msum[d] += load_qkv(p->q, p->dtype, p->q_stride, b, h * G + g, i, d);
          for (int64_t d = 0; d < D; ++d) msum[d] /= (float)cnt;
          mean = msum;
        }
        total += cnt;
        for (int64_t d = 0; d < D; ++d) qm[d] += (float)cnt * mean[d];
      }
    for (int64_t d = 0; d < D; ++d) qm[d] = total > 0 ? qm[d] / (float)total : 0.0f;
    const float *kf_t = st->kf_t + bh * D * np, *v = st->vd + bh * np * st->d_pad;
    float m = -INFINITY;
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t j0 = c * BKV, j1 = j0 + BKV < nk ? j0 + BKV : nk;
      float s[BKV], cm = -INFINITY, l = 0.0f;
      float *acc = ac + c * D;
      for (int64_t j = j0; j < j1; ++j) {
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += qm[d] * kf_t[kt_offset(j, d, D)];
        s[j - j0] = p->scale * dot;
        if (masked) s[j - j0] += kbias[j];
        cm = fp4attn_nanmax(cm, s[j - j0]);
      }
      /* masked: a chunk of hidden keys only (cm = -inf) gets exp(-inf - 0) = 0, not NaN */
      const float ref = masked && cm == -INFINITY ? 0.0f : cm;
      for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
      for (int64_t j = j0; j < j1; ++j) {
        const float e = expf(s[j - j0] - ref);
        l += e;
        for (int64_t d = 0; d < D; ++d) acc[d] += e * v[j * st->d_pad + d];
      }
      mc[c] = cm;
      lc[c] = l;
      m = fp4attn_nanmax(m, cm);
    }
    float l = 0.0f;
    for (int64_t c = 0; c < nchunks; ++c) {
      /* masked: no visible key at all (M_c = M = -inf) weighs 0, not NaN */
      const float w = masked && mc[c] == -INFINITY ? 0.0f : expf(mc[c] - m);
      l += w * lc[c];
      for (int64_t d = 0; d < D; ++d) a[d] += w * ac[c * D + d];
    }
    for (int64_t d = 0; d < D; ++d) {
      const float r = a[d] / l;
      vbar[d] = isfinite(m) && isfinite(r) ? r : 0.0f;
    }
  }
  free(qm);
  free(a);
  free(ac);
  free(mc);
  free(lc);
  free(seen);
  free(kbias);
  free(msum);
  return ok;
}

/* Phase 3: vbar, then V - vbar quantized per channel along tokens (blocks of 16 tokens, 4.3). */
static int prepare_v(attention_state *st, int64_t b, int64_t h) {
  const fp4attn_attention_params *p = st->p;
  const int64_t nk = p->len_k, D = p->head_dim, np = st->nk_pad, bh = b * p->heads_kv + h;
  float *vd = st->vd + bh * np * st->d_pad, *vbar = st->vbar + bh * D;
  float *col = (float *)calloc((size_t)np, sizeof(float));
  int ok = col != NULL && v_mean(st, b, h, vbar);
  if (ok) {
    float amax = 0.0f;
    for (int64_t j = 0; j < nk; ++j)
      for (int64_t d = 0; d < D; ++d) {
        const float v = vd[j * st->d_pad + d] - vbar[d];
        vd[j * st->d_pad + d] = v;
        amax = fp4attn_nanmax(amax, fabsf(v));
      }
    float enc, dec;
    fp4attn_global_scales(amax, &enc, &dec);
    st->dv[bh] = dec;
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t j = 0; j < nk; ++j) col[j] = vd[j * st->d_pad + d];
      quantize_row_values(col, nk, enc, vd + d, st->d_pad);
    }
  }
  free(col);
  return ok;
}

/* s[r][c] = sum_d q[r][d] * kt[d][c] for all BQ rows of a block and one tile of BKV keys.
 * 4 rows x 16 keys of accumulators stay in registers while d runs. */
FP4ATTN_VECTOR_CLONES
static void tile_scores(const float *q, int64_t D, const float *kt, float *s) {
  for (int r0 = 0; r0 < BQ; r0 += 4)
    for (int c0 = 0; c0 < BKV; c0 += 16) {
      v8f acc[4][2];
      for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = v8f_splat(0.0f);
      for (int64_t d = 0; d < D; ++d) {
        const v8f k0 = *(const v8f *)(kt + d * BKV + c0),
                  k1 = *(const v8f *)(kt + d * BKV + c0 + 8);
        for (int i = 0; i < 4; ++i) {
          const v8f a = v8f_splat(q[(r0 + i) * D + d]);
          acc[i][0] += a * k0;
          acc[i][1] += a * k1;
        }
      }
      for (int i = 0; i < 4; ++i) {
        *(v8f *)(s + (r0 + i) * BKV + c0) = acc[i][0];
        *(v8f *)(s + (r0 + i) * BKV + c0 + 8) = acc[i][1];
      }
    }
}

/* bias[c] = sum_d qbar[d] * kt[d][c]: the q-mean correction of SPEC 4.4 for one tile. */
FP4ATTN_VECTOR_CLONES
static void tile_bias(const float *qbar, int64_t D, const float *kt, float *bias) {
  for (int c = 0; c < BKV; ++c) bias[c] = 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float a = qbar[d];
    const float *krow = kt + d * BKV;
    for (int c = 0; c < BKV; ++c) bias[c] += a * krow[c];
  }
}

/* pv[r][d] = sum_c p[r][c] * v[c][d] for all BQ rows and one tile; v rows and pv rows have
 * dp (head_dim padded to 16) floats. 4 rows x 16 channels of accumulators in registers. */
FP4ATTN_VECTOR_CLONES
static void tile_pv(const float *p, const float *v, int64_t dp, int64_t width, float *pv) {
  for (int r0 = 0; r0 < BQ; r0 += 4)
    for (int64_t d0 = 0; d0 < dp; d0 += 16) {
      v8f acc[4][2];
      for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = v8f_splat(0.0f);
      for (int64_t c = 0; c < width; ++c) {
        const v8f v0 = *(const v8f *)(v + c * dp + d0), v1 = *(const v8f *)(v + c * dp + d0 + 8);
        for (int i = 0; i < 4; ++i) {
          const v8f a = v8f_splat(p[(r0 + i) * BKV + c]);
          acc[i][0] += a * v0;
          acc[i][1] += a * v1;
        }
      }
      for (int i = 0; i < 4; ++i) {
        *(v8f *)(pv + (r0 + i) * dp + d0) = acc[i][0];
        *(v8f *)(pv + (r0 + i) * dp + d0 + 8) = acc[i][1];
      }
    }
}

/* SPEC 4.4 for one row of one tile: srow[c] = scale * (qk_dec * acc + bias[c]) for the first
 * `visible` keys and -inf for the rest (padding, causal); returns the row maximum (NaN if any). */
FP4ATTN_VECTOR_CLONES
static float finish_scores(float *srow, const float *bias, float scale, float qk_dec,
                           int64_t visible) {
  v8f m = v8f_splat(-INFINITY);
  for (int c0 = 0; c0 < BKV; c0 += 8) {
    v8f v = v8f_splat(scale) *
            (v8f_splat(qk_dec) * *(const v8f *)(srow + c0) + *(const v8f *)(bias + c0));
    for (int e = 0; e < 8; ++e)
      if (c0 + e >= visible) v[e] = -INFINITY;
    *(v8f *)(srow + c0) = v;
    const v8i take = (v8i)(v > m) | (v8i)(v != v);
    m = (v8f)(((v8i)v & take) | ((v8i)m & ~take));
  }
  float r = -INFINITY;
  for (int e = 0; e < 8; ++e) r = fp4attn_nanmax(r, m[e]);
  return r;
}

/* SPEC 4.5 for one row of one tile: exponentials relative to the tile maximum `tmax`, the sum of
 * the unquantized values (returned), and P^q dequantized exactly (value * E4M3 block scale,
 * first level puts the maximum at 2688) into srow in place. */
FP4ATTN_VECTOR_CLONES
static float quantize_p_row(float *srow, float tmax) {
  float ex[BKV];
  v8f sum = v8f_splat(0.0f);
  for (int c = 0; c < BKV; c += 8) {
    const v8f e = exp_nonpos8(*(const v8f *)(srow + c) - v8f_splat(tmax));
    *(v8f *)(ex + c) = e;
    sum += e;
  }
  for (int c0 = 0; c0 < BKV; c0 += FP4ATTN_BLOCK) {
    float *blk = srow + c0;
    for (int e = 0; e < FP4ATTN_BLOCK; ++e) blk[e] = FP4ATTN_NVFP4_RANGE * ex[c0 + e];
    const float bmax = block_nanmax16(blk);
    const float sc = fp4attn_e4m3_decode(fp4attn_e4m3_encode_sat(bmax / 6.0f));
    const float r = sc == 0.0f ? 0.0f : 1.0f / sc;
    for (int e = 0; e < FP4ATTN_BLOCK; ++e) blk[e] = fp4attn_e2m1_round_nonneg(blk[e] * r) * sc;
  }
  return ((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7]));
}

/* Phase 4: one 128-row query block of one (batch, query head). */
static int attend_block(attention_state *st, int64_t b, int64_t h, int64_t qb) {
  const fp4attn_attention_params *p = st->p;
  const int64_t nq = p->len_q, nk = p->len_k, D = p->head_dim, np = st->nk_pad;
  const int64_t hk = h / (p->heads_q / p->heads_kv), bhq = b * p->heads_q + h,
                bhk = b * p->heads_kv + hk;
  const int64_t i0 = qb * BQ, rows = (i0 + BQ < nq ? i0 + BQ : nq) - i0;
  const float *qd = st->qd + (bhq * st->n_qblock + qb) * BQ * D,
              *qbar = st->qbar + (bhq * st->n_qblock + qb) * D;
  const float *kd_t = st->kd_t + bhk * D * np, *kf_t = st->kf_t + bhk * D * np;
  const float *vd = st->vd + bhk * np * st->d_pad, *vbar = st->vbar + bhk * D;
  const float qk_dec = st->dq[bhq] * st->dk[bhk], dv = st->dv[bhk];

  float *s = (float *)malloc(sizeof(float) * BQ * BKV);
  float *bias = (float *)malloc(sizeof(float) * BKV);
  float *pv = (float *)malloc(sizeof(float) * BQ * (size_t)st->d_pad);
  float *o = (float *)calloc((size_t)(BQ * D), sizeof(float));
  float m[BQ], l[BQ], tile_max[BQ], rowsum[BQ];
  int ok = s && bias && pv && o;
  if (ok) {
    for (int64_t r = 0; r < rows; ++r) {
      m[r] = -INFINITY;
      l[r] = 0.0f;
    }
    int64_t n_tiles = (nk + BKV - 1) / BKV;
    if (p->causal) {
      int64_t last_visible = i0 + rows - 1; /* the block's last row sees keys <= its index */
      int64_t t_causal = last_visible / BKV + 1;
      if (t_causal < n_tiles) n_tiles = t_causal;
    }
    for (int64_t t = 0; t < n_tiles; ++t) {
      const int64_t j0 = t * BKV, width = nk - j0 < BKV ? nk - j0 : BKV;
      tile_scores(qd, D, kd_t + t * D * BKV, s);
      tile_bias(qbar, D, kf_t + t * D * BKV, bias);
      for (int64_t r = 0; r < BQ; ++r) {
        const int64_t i = i0 + r;
        float *srow = s + r * BKV;
        /* keys [0, visible) of this tile exist and pass the causal mask */
        int64_t visible = r < rows ? width : 0;
        if (p->causal && i - j0 + 1 < visible) visible = i - j0 + 1 > 0 ? i - j0 + 1 : 0;
        const float tmax = finish_scores(srow, bias, p->scale, qk_dec, visible);
        if (p->mask_kind != FP4ATTN_MASK_NONE && tmax != -INFINITY) {
          float masked_max = -INFINITY;
          for (int64_t c = 0; c < visible; ++c) {
            srow[c] += mask_value(p, b, h, i, j0 + c);
            masked_max = fp4attn_nanmax(masked_max, srow[c]);
          }
          tile_max[r] = masked_max;
        } else {
          tile_max[r] = tmax;
        }
        const float tmax_row = tile_max[r];
        if (tmax_row == -INFINITY) { /* row masked for the whole tile: contributes nothing */
          for (int64_t c = 0; c < BKV; ++c) srow[c] = 0.0f;
          continue;
        }
        rowsum[r] = quantize_p_row(srow, tmax_row);
      }
      tile_pv(s, vd + j0 * st->d_pad, st->d_pad, width, pv);
      for (int64_t r = 0; r < rows; ++r) {
        if (tile_max[r] == -INFINITY) continue;
        const float m_new = fmaxf(m[r], tile_max[r]);
        const float alpha = expf(m[r] - m_new), beta = expf(tile_max[r] - m_new);
        const float w = beta / FP4ATTN_NVFP4_RANGE;
        l[r] = alpha * l[r] + beta * rowsum[r];
        float *orow = o + r * D;
        const float *prow = pv + r * st->d_pad;
        /* w <= 1/2688 first (as SPEC 4.5 groups it): prow * dv alone reaches 2^19 max|V| and
         * overflowed for |V| near 2^115 */
        for (int64_t d = 0; d < D; ++d) orow[d] = alpha * orow[d] + (w * prow[d]) * dv;
        m[r] = m_new;
      }
    }
    /* 4.6: normalise and add vbar back; rows that saw no key give 0 and lse = -inf */
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      const int64_t ob = b * p->out_stride[0] + h * p->out_stride[1] + i * p->out_stride[2];
      if (l[r] != 0.0f) { /* 0: no visible key; NaN (a NaN reached the row) stays NaN */
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; ++d)
          fp4attn_store(p->out, p->dtype, ob + d, o[r * D + d] * inv + vbar[d]);
      } else {
        for (int64_t d = 0; d < D; ++d) fp4attn_store(p->out, p->dtype, ob + d, 0.0f);
      }
      if (p->lse)
        p->lse[bhq * nq + i] =
            l[r] != 0.0f ? m[r] + logf(l[r]) + st->lse_shift[bhq * nq + i] : -INFINITY;
    }
  }
  free(s);
  free(bias);
  free(pv);
  free(o);
  return ok;
}

fp4attn_status fp4attn_cpu_attention(const fp4attn_attention_params *p) {
  fp4attn_status status = fp4attn_check_attention_params(p);
  if (status.code != FP4ATTN_OK) return status;
  attention_state st;
  memset(&st, 0, sizeof st);
  st.p = p;
  st.nk_pad = (p->len_k + BKV - 1) / BKV * BKV;
  st.d_pad = (p->head_dim + FP4ATTN_BLOCK - 1) / FP4ATTN_BLOCK * FP4ATTN_BLOCK;
  st.n_qblock = (p->len_q + BQ - 1) / BQ;
  const int64_t nkv = p->batch * p->heads_kv, nqh = p->batch * p->heads_q, D = p->head_dim;
  const size_t kv_elems = (size_t)(nkv * st.d_pad * st.nk_pad);
  st.kd_t = (float *)calloc(kv_elems, sizeof(float));
  st.kf_t = (float *)calloc(kv_elems, sizeof(float));
  st.vd = (float *)calloc(kv_elems, sizeof(float));
  st.dk = (float *)malloc(sizeof(float) * (size_t)nkv);
  st.dv = (float *)malloc(sizeof(float) * (size_t)nkv);
  st.qd = (float *)calloc((size_t)(nqh * st.n_qblock * BQ * D), sizeof(float));
  st.qbar = (float *)malloc(sizeof(float) * (size_t)(nqh * st.n_qblock * D));
  st.dq = (float *)malloc(sizeof(float) * (size_t)nqh);
  st.kbar = (float *)malloc(sizeof(float) * (size_t)(nkv * D));
  st.vbar = (float *)malloc(sizeof(float) * (size_t)(nkv * D));
  st.lse_shift = p->lse ? (float *)malloc(sizeof(float) * (size_t)(nqh * p->len_q)) : NULL;
  int ok = st.kd_t && st.kf_t && st.vd && st.dk && st.dv && st.qd && st.qbar && st.dq && st.kbar &&
           st.vbar && (st.lse_shift || !p->lse);
  if (ok) {
    int failed = 0;
#pragma omp parallel num_threads(p->num_threads > 0 ? p->num_threads : omp_get_max_threads()) \
    reduction(|| : failed)
    {
#pragma omp for schedule(dynamic)
      for (int64_t i = 0; i < nkv; ++i)
        if (!prepare_kv(&st, i / p->heads_kv, i % p->heads_kv)) failed = 1;
#pragma omp for schedule(dynamic)
      for (int64_t i = 0; i < nqh; ++i)
        if (!prepare_q(&st, i / p->heads_q, i % p->heads_q)) failed = 1;
#pragma omp for schedule(dynamic)
      for (int64_t i = 0; i < nkv; ++i)
        if (!prepare_v(&st, i / p->heads_kv, i % p->heads_kv)) failed = 1;
#pragma omp for schedule(dynamic)
      for (int64_t i = 0; i < nqh * st.n_qblock; ++i) {
        const int64_t bh = i / st.n_qblock;
        if (!attend_block(&st, bh / p->heads_q, bh % p->heads_q, i % st.n_qblock)) failed = 1;
      }
    }
    ok = !failed;
  }
  free(st.kd_t);
  free(st.kf_t);
  free(st.vd);
  free(st.dk);
  free(st.dv);
  free(st.qd);
  free(st.qbar);
  free(st.dq);
  free(st.kbar);
  free(st.vbar);
  free(st.lse_shift);
  if (!ok) return fp4attn_error(FP4ATTN_ERR_OUT_OF_MEMORY, "attention: out of memory");
  return fp4attn_ok();
}
