/*
 * The 8-bit trainable attention on the CPU (docs/SPEC_INT8.md): forward and backward.
 *
 * Operands are quantized once per call (psi: Q' = Q s per 64 rows, Ks' = (K - kbar) / s per 128
 * keys, s the channel migration of SPEC_INT8 2.1b; V is not quantized: V16, FP16 and BF16 inputs
 * as given, FP32 rounded to BF16, no scale, SPEC_INT8 2.2), then every (batch, head) runs the
 * blocked algorithm of the spec: scores from int32 dot products of the INT8 codes and FP32 scales,
 * P.V in 16 bits (P16 = 448 exp(S - m) against the running max rounded to nearest even to V16's
 * type, SPEC_INT8 2.4) with the exact products summed in double, rounded once to float. The
 * backward's other products are 16-bit too (SPEC_INT8 3): dP = dO16 V16^T, dV = P16^T dO16,
 * dQ = dS16 Ks16 and dK = dS16^T Q16, exact products summed in float.
 * OpenMP over query heads in the forward and over KV heads in the backward (a KV head's dK and dV
 * sum over its query heads without atomics). setup.py compiles with -ffp-contract=off: a * b + c
 * is two roundings, as the spec writes it, never an FMA.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "fp4attn/int8_migration.h"

#define BQ 64  /* query rows per INT8 block */
#define BK 128 /* keys per INT8 block and online-softmax step */

/* rne_int (ties to even, the default rounding mode) clamped to [-127, 127]; NaN -> 0 (the group's
 * scale is NaN then, so the dequantized values still are). */
static inline int8_t code8(float y) {
  if (!(y == y)) return 0;
  const float r = nearbyintf(y);
  return (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
}

/* x rounded to nearest even to the type of SPEC_INT8's 16-bit operands (V16, P16, and dP's and
 * Drow's dO, V, O): FP16 for FP16 inputs, else BF16. FP16 and BF16 inputs are their own values. */
static inline float round16(float x, fp4attn_dtype dt) {
  return dt == FP4ATTN_FLOAT16 ? fp4attn_f16_to_f32(fp4attn_f32_to_f16(x))
                               : fp4attn_bf16_to_f32(fp4attn_f32_to_bf16(x));
}

static inline float absmax_nan(float m, float x) {
  return fp4attn_nanmax(m, fabsf(x));
}

/* psi of one group: the rows x cols values x[r * pitch + c] (a block, or a column with cols = 1)
 * into codes at the same offsets; returns the group's scale. */
static float psi_group(const float *x, int64_t rows, int64_t cols, int64_t pitch, int8_t *codes) {
  float amax = 0.0f;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; ++c) amax = absmax_nan(amax, x[i * pitch + c]);
  /* SPEC_INT8 1: r = 127 / amax; a group it does not invert (amax 0 or tiny) is all zeros */
  float r = 127.0f / amax, s = amax / 127.0f;
  if (r == INFINITY) r = s = 0.0f;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; ++c) codes[i * pitch + c] = code8(x[i * pitch + c] * r);
  return s;
}

static float load_row(const void *base, fp4attn_dtype dt, const int64_t *st, int64_t b, int64_t h,
                      int64_t n, int64_t d) {
  return fp4attn_load(base, dt, b * st[0] + h * st[1] + n * st[2] + d);
}

/* Visibility and additive mask of (row i, key j) of (b, h): -inf when hidden. */
static float mask_term(const fp4attn_attention_params *p, int64_t b, int64_t h, int64_t i,
                       int64_t j) {
  if (p->causal && j > i) return -INFINITY;
  if (p->mask_kind == FP4ATTN_MASK_NONE) return 0.0f;
  const int64_t off =
      b * p->mask_stride[0] + h * p->mask_stride[1] + i * p->mask_stride[2] + j * p->mask_stride[3];
  if (p->mask_kind == FP4ATTN_MASK_BOOL) return ((const uint8_t *)p->mask)[off] ? 0.0f : -INFINITY;
  return fp4attn_load(p->mask, p->mask_dtype, off);
}

/* The quantized K and V of one (batch, KV head), and Q of one (batch, query head). */
typedef struct {
  float *kbar; /* [D] */
  float *mig;  /* [D]: the channel migration factors s (powers of two) */
  int8_t *kc;  /* [Nk][D], (K - kbar) / s */
  float *sk;   /* [nkb] */
  float *v16;  /* [Nk][D]: V16 (SPEC_INT8 2.2) */
} kv_codes;

typedef struct {
  int8_t *qc; /* [Nq][D] */
  float *sq;  /* [nqb] */
} q_codes;

static int quantize_kv(const fp4attn_attention_params *p, int64_t b, int64_t h, kv_codes *o) {
  const int64_t D = p->head_dim, Nk = p->len_k, nkb = (Nk + BK - 1) / BK;
  const int64_t Nq = p->len_q, G = p->heads_q / p->heads_kv;
  o->kbar = (float *)malloc(sizeof(float) * (size_t)D);
  o->mig = (float *)malloc(sizeof(float) * (size_t)D);
  o->kc = (int8_t *)malloc((size_t)(Nk * D));
  o->sk = (float *)malloc(sizeof(float) * (size_t)nkb);
  o->v16 = (float *)malloc(sizeof(float) * (size_t)(Nk * D));
  float *x = (float *)malloc(sizeof(float) * (size_t)(BK * D)); /* one block of K - kbar */
  if (!o->kbar || !o->mig || !o->kc || !o->sk || !o->v16 || !x) {
    free(x);
    return 0;
  }
  for (int64_t d = 0; d < D; ++d) {
    float s = 0.0f, kmax = -INFINITY, kmin = INFINITY;
    for (int64_t n = 0; n < Nk; ++n) {
      const float k = load_row(p->k, p->dtype, p->k_stride, b, h, n, d);
      s += k;
      kmax = k > kmax ? k : kmax; /* a NaN makes kbar, and so ka, NaN */
      kmin = k < kmin ? k : kmin;
    }
    o->kbar[d] = s / (float)Nk;
    /* SPEC_INT8 2.1b: qa over every row of the KV head's query heads */
    float qa = 0.0f;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t n = 0; n < Nq; ++n)
        qa = absmax_nan(qa, load_row(p->q, p->dtype, p->q_stride, b, h * G + g, n, d));
    o->mig[d] =
        fp4attn_int8_migration_factor(qa, fp4attn_int8_migration_ka(kmax, kmin, o->kbar[d]));
  }
  for (int64_t j = 0; j < nkb; ++j) {
    const int64_t n0 = j * BK, rows = Nk - n0 < BK ? Nk - n0 : BK;
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t d = 0; d < D; ++d)
        x[n * D + d] =
            (load_row(p->k, p->dtype, p->k_stride, b, h, n0 + n, d) - o->kbar[d]) / o->mig[d];
    o->sk[j] = psi_group(x, rows, D, D, o->kc + n0 * D);
  }
  for (int64_t n = 0; n < Nk; ++n)
    for (int64_t d = 0; d < D; ++d)
      o->v16[n * D + d] = round16(load_row(p->v, p->dtype, p->v_stride, b, h, n, d), p->dtype);
  free(x);
  return 1;
}

/* Q' = Q s of one (batch, query head), s its KV head's migration factors, quantized. */
static int quantize_q(const fp4attn_attention_params *p, const kv_codes *kv, int64_t b, int64_t h,
                      q_codes *o) {
  const int64_t D = p->head_dim, Nq = p->len_q, nqb = (Nq + BQ - 1) / BQ;
  o->qc = (int8_t *)malloc((size_t)(Nq * D));
  o->sq = (float *)malloc(sizeof(float) * (size_t)nqb);
  float *x = (float *)malloc(sizeof(float) * (size_t)(BQ * D));
  const int ok = o->qc && o->sq && x;
  for (int64_t i = 0; ok && i < nqb; ++i) {
    const int64_t n0 = i * BQ, rows = Nq - n0 < BQ ? Nq - n0 : BQ;
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t d = 0; d < D; ++d)
        x[n * D + d] = load_row(p->q, p->dtype, p->q_stride, b, h, n0 + n, d) * kv->mig[d];
    o->sq[i] = psi_group(x, rows, D, D, o->qc + n0 * D);
  }
  free(x);
  return ok;
}

static void free_kv(kv_codes *c) {
  free(c->kbar);
  free(c->mig);
  free(c->kc);
  free(c->sk);
  free(c->v16);
}

static inline int32_t dot8(const int8_t *a, const int8_t *b, int64_t n) {
  int32_t s = 0;
  for (int64_t i = 0; i < n; ++i) s += (int32_t)a[i] * (int32_t)b[i];
  return s;
}

/* S of query row i (in its 64-row block) against key block j, masked (SPEC_INT8 2.3). */
static void score_row(const fp4attn_attention_params *p, const q_codes *q, const kv_codes *kv,
                      int64_t b, int64_t h, int64_t i, int64_t j, float *s) {
  const int64_t D = p->head_dim, n0 = j * BK, n1 = n0 + BK < p->len_k ? n0 + BK : p->len_k;
  const float f = (q->sq[i / BQ] * kv->sk[j]) * p->scale;
  for (int64_t n = n0; n < n1; ++n) {
    const float m = mask_term(p, b, h, i, n);
    s[n - n0] = m == -INFINITY ? -INFINITY : (float)dot8(q->qc + i * D, kv->kc + n * D, D) * f + m;
  }
}

/* q . kbar * scale: what K smoothing removed from every score of the row (Q unmigrated). */
static float lse_shift(const fp4attn_attention_params *p, const kv_codes *kv, int64_t b, int64_t h,
                       int64_t i) {
  float s = 0.0f;
  for (int64_t d = 0; d < p->head_dim; ++d)
    s += load_row(p->q, p->dtype, p->q_stride, b, h, i, d) * kv->kbar[d];
  return p->scale * s;
}

/* SPEC_INT8 2 for one (batch, query head). */
static int forward_head(const fp4attn_attention_params *p, const kv_codes *kv, int64_t b,
                        int64_t h) {
  const int64_t D = p->head_dim, Nq = p->len_q, Nk = p->len_k, nkb = (Nk + BK - 1) / BK;
  q_codes q = {0, 0};
  float *s = (float *)malloc(sizeof(float) * BK), *o = (float *)malloc(sizeof(float) * (size_t)D);
  float *pt = (float *)malloc(sizeof(float) * BK); /* P16 of the step */
  int ok = s && o && pt && quantize_q(p, kv, b, h, &q);
  for (int64_t i = 0; ok && i < Nq; ++i) {
    float m = -INFINITY, l = 0.0f;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    /* causal: the key blocks past row i are fully masked and would change nothing */
    const int64_t jend = p->causal && i / BK + 1 < nkb ? i / BK + 1 : nkb;
    for (int64_t j = 0; j < jend; ++j) {
      const int64_t n0 = j * BK, w = Nk - n0 < BK ? Nk - n0 : BK;
      score_row(p, &q, kv, b, h, i, j, s);
      float t = -INFINITY; /* NaN-propagating: a NaN score makes the row NaN, not 0 */
      for (int64_t n = 0; n < w; ++n) t = fp4attn_nanmax(t, s[n]);
      const float m_new = m > t ? m : t;
      const float alpha = m == -INFINITY ? 0.0f : expf(m - m_new);
      /* SPEC_INT8 2.4: W = 448 exp(S - m_new) in [0, 448] (float expf, then one multiplication),
       * P16 = W in 16 bits against the running max, l sums W */
      float rowsum = 0.0f;
      for (int64_t n = 0; n < w; ++n) {
        const float wn =
            m_new == -INFINITY || s[n] == -INFINITY ? 0.0f : 448.0f * expf(s[n] - m_new);
        rowsum += wn;
        pt[n] = round16(wn, p->dtype);
      }
      l = alpha * l + rowsum;
      /* P16 V16: every product exact in double (two 16-bit significands), summed in double,
       * rounded once to float. Keys with P16 = 0 are summed too: V16 carries no scale, so a NaN
       * or Inf in V reaches O through 0 * V16 as in the reference (and a tensor core) */
      double acc[FP4ATTN_MAX_HEAD_DIM] = {0};
      for (int64_t n = 0; n < w; ++n) {
        const double pn = pt[n];
        const float *vn = kv->v16 + (n0 + n) * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += pn * vn[d];
      }
      /* alpha O + float(acc): two roundings (no FMA, -ffp-contract=off) */
      for (int64_t d = 0; d < D; ++d) o[d] = alpha * o[d] + (float)acc[d];
      m = m_new;
    }
    const int64_t orow = b * p->out_stride[0] + h * p->out_stride[1] + i * p->out_stride[2];
    /* SPEC_INT8 2.5: O / l (the 448 of W cancels); lse = m + log(l) - log(448) + scale Q.kbar */
    for (int64_t d = 0; d < D; ++d)
      fp4attn_store(p->out, p->dtype, orow + d, l != 0.0f ? o[d] / l : 0.0f);
    p->lse[(b * p->heads_q + h) * Nq + i] =
        l != 0.0f ? m + logf(l) - logf(448.0f) + lse_shift(p, kv, b, h, i) : -INFINITY;
  }
  free(q.qc);
  free(q.sq);
  free(s);
  free(o);
  free(pt);
  return ok;
}

fp4attn_status fp4attn_cpu_int8_attention(const fp4attn_attention_params *p) {
  fp4attn_status st = fp4attn_check_attention_params(p);
  if (st.code != FP4ATTN_OK) return st;
  if (!p->lse)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "int8 attention: lse must not be null");
  const int64_t nkv = p->batch * p->heads_kv, G = p->heads_q / p->heads_kv;
  kv_codes *kv = (kv_codes *)calloc((size_t)nkv, sizeof(kv_codes));
  if (!kv) return fp4attn_error(FP4ATTN_ERR_OUT_OF_MEMORY, "int8 attention: out of memory");
  int failed = 0;
#pragma omp parallel num_threads(p->num_threads > 0 ? p->num_threads : omp_get_max_threads()) \
    reduction(|| : failed)
  {
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < nkv; ++i)
      if (!quantize_kv(p, i / p->heads_kv, i % p->heads_kv, &kv[i])) failed = 1;
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < p->batch * p->heads_q; ++i) {
      const int64_t b = i / p->heads_q, h = i % p->heads_q;
      if (!failed && !forward_head(p, &kv[b * p->heads_kv + h / G], b, h)) failed = 1;
    }
  }
  for (int64_t i = 0; i < nkv; ++i) free_kv(&kv[i]);
  free(kv);
  if (failed) return fp4attn_error(FP4ATTN_ERR_OUT_OF_MEMORY, "int8 attention: out of memory");
  return fp4attn_ok();
}

/* SPEC_INT8 3 for one (batch, KV head) and its query heads: dK and dV summed over them. */
static int backward_kv_head(const fp4attn_int8_backward_params *bp, const kv_codes *kv, int64_t b,
                            int64_t hk) {
  const fp4attn_attention_params *p = &bp->fwd;
  const int64_t D = p->head_dim, Nq = p->len_q, Nk = p->len_k, G = p->heads_q / p->heads_kv;
  const int64_t nqb = (Nq + BQ - 1) / BQ, nkb = (Nk + BK - 1) / BK;
  float *P = (float *)malloc(sizeof(float) * BQ * BK),
        *dS = (float *)malloc(sizeof(float) * BQ * BK);
  float *dkacc = (float *)calloc((size_t)(Nk * D), sizeof(float));
  float *dvacc = (float *)calloc((size_t)(Nk * D), sizeof(float));
  float *dqacc = (float *)malloc(sizeof(float) * (size_t)(Nq * D));
  float *dor16 = (float *)malloc(sizeof(float) * (size_t)(BQ * D)); /* dO16 of the block */
  float *q16 = (float *)malloc(sizeof(float) * (size_t)(Nq * D));   /* Q16 of the query head */
  float *ks16 = (float *)malloc(sizeof(float) * (size_t)(Nk * D));  /* Ks16 = K - kbar */
  float *drow = (float *)malloc(sizeof(float) * BQ), *lses = (float *)malloc(sizeof(float) * BQ);
  q_codes q = {0, 0};
  int ok = P && dS && dkacc && dvacc && dqacc && dor16 && q16 && ks16 && drow && lses;
  for (int64_t n = 0; ok && n < Nk; ++n) /* dQ's operand: K - kbar (FP32), unmigrated, in 16 bits */
    for (int64_t d = 0; d < D; ++d)
      ks16[n * D + d] =
          round16(load_row(p->k, p->dtype, p->k_stride, b, hk, n, d) - kv->kbar[d], p->dtype);
  for (int64_t g = 0; ok && g < G; ++g) {
    const int64_t h = hk * G + g;
    free(q.qc);
    free(q.sq);
    q.qc = NULL;
    q.sq = NULL;
    if (!quantize_q(p, kv, b, h, &q)) {
      ok = 0;
      break;
    }
    for (int64_t n = 0; n < Nq; ++n) /* dK's operand: Q in 16 bits */
      for (int64_t d = 0; d < D; ++d) {
        q16[n * D + d] = round16(load_row(p->q, p->dtype, p->q_stride, b, h, n, d), p->dtype);
        dqacc[n * D + d] = 0.0f;
      }
    for (int64_t ib = 0; ib < nqb; ++ib) {
      const int64_t r0 = ib * BQ, rows = Nq - r0 < BQ ? Nq - r0 : BQ;
      /* dO16 of the block (dP's and dV's operand), Drow and the smoothed lse */
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = r0 + r;
        float dsum = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          dor16[r * D + d] =
              round16(load_row(bp->grad_out, p->dtype, bp->grad_out_stride, b, h, i, d), p->dtype);
          dsum += dor16[r * D + d] *
                  round16(load_row(p->out, p->dtype, p->out_stride, b, h, i, d), p->dtype);
        }
        const int64_t li = (b * p->heads_q + h) * Nq + i;
        drow[r] = bp->grad_lse ? dsum - bp->grad_lse[li] : dsum;
        const float lse = p->lse[li];
        lses[r] = lse == -INFINITY ? INFINITY : lse - lse_shift(p, kv, b, h, i);
      }
      /* causal: the key blocks past the block's last row have P = 0 and add nothing */
      const int64_t last = r0 + rows - 1,
                    jend = p->causal && last / BK + 1 < nkb ? last / BK + 1 : nkb;
      for (int64_t j = 0; j < jend; ++j) {
        const int64_t n0 = j * BK, w = Nk - n0 < BK ? Nk - n0 : BK;
        const float *vrow = kv->v16 + n0 * D; /* dP's V: V16, as the forward's */
        for (int64_t r = 0; r < rows; ++r) {
          score_row(p, &q, kv, b, h, r0 + r, j, P + r * BK);
          for (int64_t n = 0; n < w; ++n) P[r * BK + n] = expf(P[r * BK + n] - lses[r]);
        }
        /* dV_j += P16^T dO16: the products of two 16-bit values are exact in FP32 */
        for (int64_t n = 0; n < w; ++n)
          for (int64_t rr = 0; rr < rows; ++rr) {
            const float p16 = round16(P[rr * BK + n], p->dtype);
            for (int64_t d = 0; d < D; ++d) dvacc[(n0 + n) * D + d] += p16 * dor16[rr * D + d];
          }
        /* dS16 = P (dP - Drow) in 16 bits, dP = dO V^T on 16-bit operands, FP32 accumulation */
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t n = 0; n < w; ++n) {
            float dp = 0.0f;
            for (int64_t d = 0; d < D; ++d) dp += dor16[r * D + d] * vrow[n * D + d];
            dS[r * BK + n] = round16(P[r * BK + n] * (dp - drow[r]), p->dtype);
          }
        /* dQ_i += dS16 Ks16_j and dK_j += dS16^T Q16_i: exact products, FP32 sums */
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t n = 0; n < w; ++n) {
            const float ds = dS[r * BK + n];
            if (ds == 0.0f) continue;
            float *dq = dqacc + (r0 + r) * D, *dk = dkacc + (n0 + n) * D;
            const float *ks = ks16 + (n0 + n) * D, *qr = q16 + (r0 + r) * D;
            for (int64_t d = 0; d < D; ++d) dq[d] += ds * ks[d];
            for (int64_t d = 0; d < D; ++d) dk[d] += ds * qr[d];
          }
      }
    }
    /* dQ = scale dQ plus the smoothing correction scale * dlse kbar (d lse / d Q along kbar; none
     * without grad_lse or where the row sees no key), out in the input dtype (contiguous
     * [B, Hq, Nq, D]) */
    const int64_t row0 = (b * p->heads_q + h) * Nq;
    for (int64_t i = 0; i < Nq; ++i)
      for (int64_t d = 0; d < D; ++d) {
        float v = p->scale * dqacc[i * D + d];
        if (bp->grad_lse && p->lse[row0 + i] != -INFINITY)
          v += (p->scale * bp->grad_lse[row0 + i]) * kv->kbar[d];
        fp4attn_store(bp->dq, p->dtype, ((b * p->heads_q + h) * Nq + i) * D + d, v);
      }
  }
  for (int64_t n = 0; ok && n < Nk * D; ++n) { /* dK = scale (the group's sum) */
    const int64_t at = (b * p->heads_kv + hk) * Nk * D + n;
    fp4attn_store(bp->dk, p->dtype, at, p->scale * dkacc[n]);
    fp4attn_store(bp->dv, p->dtype, at, dvacc[n]);
  }
  free(q.qc);
  free(q.sq);
  free(P);
  free(dS);
  free(dkacc);
  free(dvacc);
  free(dqacc);
  free(dor16);
  free(q16);
  free(ks16);
  free(drow);
  free(lses);
  return ok;
}

fp4attn_status fp4attn_cpu_int8_attention_backward(const fp4attn_int8_backward_params *bp) {
  if (!bp) return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "int8 backward: null params");
  const fp4attn_attention_params *p = &bp->fwd;
  fp4attn_status st = fp4attn_check_attention_params(p);
  if (st.code != FP4ATTN_OK) return st;
  if (!p->lse || !bp->grad_out || !bp->dq || !bp->dk || !bp->dv)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT,
                         "int8 backward: lse, grad_out, dq, dk and dv must not be null");
  const int64_t nkv = p->batch * p->heads_kv;
  int failed = 0;
#pragma omp parallel for schedule(dynamic)                                   \
    num_threads(p->num_threads > 0 ? p->num_threads : omp_get_max_threads()) \
    reduction(|| : failed)
  for (int64_t i = 0; i < nkv; ++i) {
    kv_codes kv;
    memset(&kv, 0, sizeof kv);
    const int64_t b = i / p->heads_kv, hk = i % p->heads_kv;
    if (!quantize_kv(p, b, hk, &kv) || !backward_kv_head(bp, &kv, b, hk)) failed = 1;
    free_kv(&kv);
  }
  if (failed) return fp4attn_error(FP4ATTN_ERR_OUT_OF_MEMORY, "int8 backward: out of memory");
  return fp4attn_ok();
}
