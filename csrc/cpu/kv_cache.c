/*
 * The FP4 KV cache on the CPU (docs/SPEC.md section 6): appending tokens (per-row NVFP4 with the
 * K mean of the first append removed) and decode attention on the stored rows in FP32.
 * Bit-exact with the CUDA append: the same numerics.h rounding, sums in token order.
 */
#include <math.h>
#include <stdlib.h>

#include "common.h"

/* phi of one row as its own slice (SPEC 2 and 6): x[0..D) -> packed codes, E4M3 scales; the dec. */
static float quantize_row(const float *x, int64_t D, uint8_t *codes, uint8_t *scales) {
  float amax = 0.0f;
  for (int64_t i = 0; i < D; ++i) amax = fp4attn_nanmax(amax, fabsf(x[i]));
  float enc, dec;
  fp4attn_global_scales(amax, &enc, &dec);
  for (int64_t b = 0; b < (D + 15) / 16; ++b) {
    float xs[16];
    uint8_t c[16];
    for (int i = 0; i < 16; ++i) xs[i] = 16 * b + i < D ? x[16 * b + i] * enc : 0.0f;
    scales[b] = fp4attn_quantize_block(xs, 16, c);
    for (int i = 0; i < 8; ++i) codes[8 * b + i] = (uint8_t)(c[2 * i] | (c[2 * i + 1] << 4));
  }
  return dec;
}

/* The stored row of token `pos` of (b, h): its index in the page arrays, or -1 outside the table.
 */
static int64_t row_index(const fp4attn_kv_cache *c, int64_t b, int64_t h, int64_t pos) {
  const int64_t page = c->block_table[b * c->max_pages + pos / c->page_size];
  if (page < 0 || page >= c->num_pages) return -1;
  return (page * c->heads_kv + h) * c->page_size + pos % c->page_size;
}

fp4attn_status fp4attn_cpu_kv_append(const fp4attn_kv_append_params *p) {
  fp4attn_status st = fp4attn_check_kv_append_params(p);
  if (st.code != FP4ATTN_OK) return st;
  const fp4attn_kv_cache *c = &p->cache;
  const int64_t D = c->head_dim, H = c->heads_kv, cb = fp4attn_code_bytes(D);
  const int64_t sc = fp4attn_scale_count(D), rows = c->batch * H * p->len;
  const int nt = p->num_threads > 0 ? p->num_threads : omp_get_max_threads();
  if (p->set_mean) {
#pragma omp parallel for num_threads(nt)
    for (int64_t bh = 0; bh < c->batch * H; ++bh)
      for (int64_t d = 0; d < D; ++d) {
        float s = 0.0f;
        const int64_t base = (bh / H) * p->k_stride[0] + (bh % H) * p->k_stride[1] + d;
        for (int64_t n = 0; n < p->len; ++n)
          s += fp4attn_load(p->k, p->dtype, base + n * p->k_stride[2]);
        c->kmean[bh * D + d] = s / (float)p->len;
      }
  }
  int bad = 0;
#pragma omp parallel num_threads(nt) reduction(|| : bad)
  {
    float *x = (float *)malloc(sizeof(float) * (size_t)D);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t b = i / (H * p->len), h = (i / p->len) % H, n = i % p->len;
      const int64_t r = row_index(c, b, h, p->start + n);
      if (r < 0 || !x) {
        bad = 1;
        continue;
      }
      const float *kmean = c->kmean + (b * H + h) * D;
      const int64_t kb = b * p->k_stride[0] + h * p->k_stride[1] + n * p->k_stride[2];
      const int64_t vb = b * p->v_stride[0] + h * p->v_stride[1] + n * p->v_stride[2];
      for (int64_t d = 0; d < D; ++d) x[d] = fp4attn_load(p->k, p->dtype, kb + d) - kmean[d];
      c->k_dec[r] = quantize_row(x, D, c->k_codes + r * cb, c->k_scales + r * sc);
      for (int64_t d = 0; d < D; ++d) x[d] = fp4attn_load(p->v, p->dtype, vb + d);
      c->v_dec[r] = quantize_row(x, D, c->v_codes + r * cb, c->v_scales + r * sc);
    }
    free(x);
  }
  if (bad)
    return fp4attn_error(
        FP4ATTN_ERR_INVALID_ARGUMENT,
        "kv append: a block-table entry is outside the page pool (or out of memory)");
  return fp4attn_ok();
}

/* Decode, one task = (batch, KV head, a group of its query rows); row r of a KV head is query head
 * r / nq at position r % nq. Each key row is dequantized once per task (not once per query row),
 * by tables of the code and scale values, into a block of kKeys keys (K transposed); every query
 * row then scores the keys of the block it sees, each score a sum in d order (vectorisable across
 * the keys), and runs the online softmax over them in order, one key at a time, exactly as a
 * per-row loop would (so results do not depend on the grouping or the thread count). */
enum { kKeys = 32 };

typedef struct {
  float *q, *o, *m, *l, *shift, *kt, *vr, *sk;
  int64_t *begin, *end; /* each row's visible keys */
} DecodeScratch;

static DecodeScratch decode_scratch(int64_t rows, int64_t D) {
  DecodeScratch w;
  w.q = (float *)malloc(sizeof(float) * (size_t)(rows * (2 * D + 3) + 2 * kKeys * D + kKeys));
  w.begin = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * rows));
  if (!w.q || !w.begin) {
    free(w.q), free(w.begin);
    w.q = NULL, w.begin = NULL;
    return w;
  }
  w.o = w.q + rows * D;
  w.m = w.o + rows * D;
  w.l = w.m + rows;
  w.shift = w.l + rows;
  w.kt = w.shift + rows; /* [D][kKeys] */
  w.vr = w.kt + kKeys * D;
  w.sk = w.vr + kKeys * D;
  w.end = w.begin + rows;
  return w;
}

/* A stored row dequantized (SPEC 2: (value * s) * dec), D values `stride` floats apart, by the
 * tables of the 16 code values and the 256 scale values. */
static void dequantize_row(const uint8_t *restrict codes, const uint8_t *restrict scales, float dec,
                           int64_t D, const float *restrict code_value,
                           const float *restrict scale_value, float *restrict out, int64_t stride) {
  for (int64_t blk = 0; blk < (D + 15) / 16; ++blk) {
    const float s = scale_value[scales[blk]];
    const int64_t n = D - 16 * blk < 16 ? D - 16 * blk : 16;
    for (int64_t i = 0; i < n; i += 2) {
      const uint8_t byte = codes[8 * blk + i / 2];
      out[(16 * blk + i) * stride] = (code_value[byte & 0xF] * s) * dec;
      if (i + 1 < n) out[(16 * blk + i + 1) * stride] = (code_value[byte >> 4] * s) * dec;
    }
  }
}

/* One key's update of one row's online softmax (m, l, o) with its score s (SPEC 6 decode math). */
static inline void softmax_step(float s, const float *restrict v, int64_t D, float *m, float *l,
                                float *restrict o) {
  const float m_new = s > *m ? s : *m;
  /* exp(0) is 1 exactly: the same result without the call while the maximum stays */
  const float alpha = m_new == *m && isfinite(m_new) ? 1.0f : expf(*m - m_new);
  const float w = expf(s - m_new);
  *l = alpha * *l + w;
  for (int64_t d = 0; d < D; ++d) o[d] = alpha * o[d] + w * v[d];
  *m = m_new;
}

fp4attn_status fp4attn_cpu_decode(const fp4attn_decode_params *p) {
  fp4attn_status st = fp4attn_check_decode_params(p);
  if (st.code != FP4ATTN_OK) return st;
  const fp4attn_kv_cache *c = &p->cache;
  const int64_t D = c->head_dim, H = c->heads_kv, G = p->heads_q / H, nq = p->len_q, R = G * nq;
  const int64_t cb = fp4attn_code_bytes(D), sc = fp4attn_scale_count(D);
  const int nt = p->num_threads > 0 ? p->num_threads : omp_get_max_threads();
  float code_value[16], scale_value[256];
  for (int i = 0; i < 16; ++i) code_value[i] = fp4attn_e2m1_decode((uint8_t)i);
  for (int i = 0; i < 256; ++i) scale_value[i] = fp4attn_e4m3_decode((uint8_t)i);
  /* enough tasks for the threads, but every group dequantizes the keys again: at least 16 rows
   * each (a key row's dequantization costs about what 16 rows' scores and updates of it cost) */
  int64_t groups = (4 * (int64_t)nt + c->batch * H - 1) / (c->batch * H);
  groups = groups > (R + 15) / 16 ? (R + 15) / 16 : groups;
  groups = groups < 1 ? 1 : groups;
  const int64_t per = (R + groups - 1) / groups;
  int bad = 0;
#pragma omp parallel num_threads(nt) reduction(|| : bad)
  {
    DecodeScratch w = decode_scratch(per, D);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < c->batch * H * groups; ++task) {
      if (!w.q) {
        bad = 1;
        continue;
      }
      const int64_t b = task / (H * groups), hk = (task / groups) % H;
      const int64_t r0 = (task % groups) * per, r1 = r0 + per < R ? r0 + per : R, n = r1 - r0;
      if (n <= 0) continue;
      const int64_t L = p->seq_lens[b];
      const float *kmean = c->kmean + (b * H + hk) * D;
      /* the rows' queries, constant lse terms and visible keys; the keys any row sees, [lo, hi) */
      int64_t lo = L, hi = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = r0 + i, h = hk * G + r / nq, t = r % nq;
        const int64_t qb = b * p->q_stride[0] + h * p->q_stride[1] + t * p->q_stride[2];
        float s = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          w.q[i * D + d] = fp4attn_load(p->q, p->dtype, qb + d);
          s += w.q[i * D + d] * kmean[d];
          w.o[i * D + d] = 0.0f;
        }
        w.shift[i] = p->scale * s;
        w.m[i] = -INFINITY;
        w.l[i] = 0.0f;
        const int64_t end = L - nq + t + 1 < L ? L - nq + t + 1 : L;
        w.end[i] = end;
        w.begin[i] = p->window > 0 && end > p->window ? end - p->window : 0;
        lo = w.begin[i] < lo ? w.begin[i] : lo, hi = end > hi ? end : hi;
      }
      for (int64_t j0 = lo; j0 < hi && !bad; j0 += kKeys) {
        const int64_t nk = hi - j0 < kKeys ? hi - j0 : kKeys;
        for (int64_t j = 0; j < nk; ++j) { /* the block's key and value rows, dequantized */
          const int64_t r = row_index(c, b, hk, j0 + j);
          if (r < 0) {
            bad = 1;
            break;
          }
          const uint8_t *kc = c->k_codes + r * cb, *vc = c->v_codes + r * cb;
          const uint8_t *ks = c->k_scales + r * sc, *vs = c->v_scales + r * sc;
          dequantize_row(kc, ks, c->k_dec[r], D, code_value, scale_value, w.kt + j, kKeys);
          dequantize_row(vc, vs, c->v_dec[r], D, code_value, scale_value, w.vr + j * D, 1);
        }
        if (bad) break;
        float *restrict sk = w.sk;
        for (int64_t i = 0; i < n; ++i) { /* the block's keys [ja, jb) that row i sees */
          const int64_t ja = w.begin[i] > j0 ? w.begin[i] - j0 : 0;
          const int64_t jb = w.end[i] < j0 + nk ? w.end[i] - j0 : nk;
          if (ja >= jb) continue;
          for (int64_t j = ja; j < jb; ++j) sk[j] = 0.0f;
          for (int64_t d = 0; d < D; ++d) {
            const float qd = w.q[i * D + d];
            const float *restrict kt = w.kt + d * kKeys;
            for (int64_t j = ja; j < jb; ++j) sk[j] += qd * kt[j];
          }
          for (int64_t j = ja; j < jb; ++j)
            softmax_step(sk[j] * p->scale, w.vr + j * D, D, &w.m[i], &w.l[i], w.o + i * D);
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = r0 + i, h = hk * G + r / nq, t = r % nq;
        const int64_t ob = b * p->out_stride[0] + h * p->out_stride[1] + t * p->out_stride[2];
        for (int64_t d = 0; d < D; ++d)
          fp4attn_store(p->out, p->dtype, ob + d, w.l[i] > 0.0f ? w.o[i * D + d] / w.l[i] : 0.0f);
        if (p->lse)
          p->lse[(b * p->heads_q + h) * nq + t] =
              w.l[i] > 0.0f ? w.m[i] + logf(w.l[i]) + w.shift[i] : -INFINITY;
      }
    }
    free(w.q);
    free(w.begin);
  }
  if (bad)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT,
                         "decode: a block-table entry is outside the page pool (or out of memory)");
  return fp4attn_ok();
}
