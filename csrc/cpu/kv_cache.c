/*
 * The KV cache on the CPU (docs/SPEC.md section 6): appending tokens (K minus the mean of the first
 * tokens, divided by the channel scales, as rotated 5-bit rows, V as NVFP4 rows) and decode
 * attention on the stored rows in FP32 (queries scaled and rotated once). Bit-exact with the CUDA
 * append: the same numerics.h rounding, sums in SPEC 6's order.
 */
#include <math.h>
#include <stdlib.h>

#include "common.h"
#include "fp4attn/kv_rows.h"

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

/* The K5 key row of SPEC 6 from x[0..D): w holds ceil(Dp/64)*64 floats of scratch. Writes
 * 5 Dp/8 code bytes and ceil(Dp/64) E4M3 scales; returns the row scale's byte. */
static uint8_t quantize_key_row(const float *x, int64_t D, float *w, uint8_t *codes,
                                uint8_t *scales) {
  const int64_t dp = (D + 15) / 16 * 16, n = dp & -dp, nb = (dp + 63) / 64;
  for (int64_t i = 0; i < nb * 64; ++i) w[i] = i < D ? x[i] : 0.0f;
  for (int64_t h = 1; h < n; h <<= 1) /* the butterfly, stage h: pairs (i, i + h), bit h clear */
    for (int64_t blk = 0; blk < dp; blk += 2 * h)
      for (int64_t i = blk; i < blk + h; ++i) {
        const float a = w[i], b = w[i + h];
        w[i] = a + b;
        w[i + h] = a - b;
      }
  float amax = 0.0f;
  for (int64_t i = 0; i < dp; ++i) amax = fp4attn_nanmax(amax, fabsf(w[i]));
  const int finite = fp4attn_isfinite(amax);
  const int e = finite ? fp4attn_k5_exponent(amax) : 0;
  const float rinv = fp4attn_k5_inverse_scale(e);
  for (int64_t i = 0; i < dp; ++i) w[i] = finite ? w[i] * rinv : 0.0f;
  uint8_t u[256];
  for (int64_t blk = 0; blk < nb; ++blk) {
    const float *y = w + 64 * blk;
    float bmax = 0.0f;
    for (int i = 0; i < 64; ++i) bmax = fp4attn_nanmax(bmax, fabsf(y[i]));
    uint8_t best = 0;
    if (bmax > 0.0f) { /* the scale search: the first code of the smallest squared error */
      const int c0 = fp4attn_e4m3_encode_sat(bmax / 15.0f);
      const int lo = c0 - 3 < 1 ? 1 : c0 - 3, hi = c0 + 3 > 0x7E ? 0x7E : c0 + 3;
      float best_err = INFINITY;
      for (int c = lo; c <= hi; ++c) {
        const float sv = fp4attn_e4m3_decode((uint8_t)c);
        float p[8];
        for (int k = 0; k < 8; ++k) {
          p[k] = 0.0f;
          for (int i = 8 * k; i < 8 * k + 8; ++i) {
            const float d = y[i] - (float)((int)fp4attn_k5_code(y[i], sv) - 15) * sv;
            const float d2 = d * d;
            p[k] = i == 8 * k ? d2 : p[k] + d2;
          }
        }
        const float err = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
        if (err < best_err) best_err = err, best = (uint8_t)c;
      }
    }
    scales[blk] = best;
    const float sv = fp4attn_e4m3_decode(best);
    for (int i = 0; i < 64 && 64 * blk + i < dp; ++i)
      u[64 * blk + i] = best ? (uint8_t)fp4attn_k5_code(y[i], sv) : 15;
  }
  for (int64_t i = 0; i < dp / 2; ++i)
    codes[i] = (uint8_t)((u[2 * i] & 15) | (u[2 * i + 1] & 15) << 4);
  for (int64_t j = 0; j < dp / 8; ++j) {
    uint8_t plane = 0;
    for (int b = 0; b < 8; ++b) plane |= (uint8_t)((u[8 * j + b] >> 4) << b);
    codes[dp / 2 + j] = plane;
  }
  return finite ? (uint8_t)(e + 127) : 255;
}

/* The stored row of token `pos` of (b, h): its index in the page arrays, or -1 outside the table.
 */
static int64_t row_index(const fp4attn_kv_cache *c, int64_t b, int64_t h, int64_t pos) {
  if (pos < 0 || pos / c->page_size >= c->max_pages) return -1;
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
  const int64_t kcb = fp4attn_k5_code_bytes(D), ksc = fp4attn_k5_scale_count(D);
  const int nt = p->num_threads > 0 ? p->num_threads : omp_get_max_threads();
  /* every page the append writes must be in the pool before anything is written: a failed append
   * leaves the cache as it was */
  for (int64_t b = 0; b < c->batch; ++b)
    for (int64_t pg = p->start / c->page_size; pg <= (p->start + p->len - 1) / c->page_size; ++pg)
      if (row_index(c, b, 0, pg * c->page_size) < 0)
        return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT,
                             "kv append: block_table[%lld, %lld] = %d is outside the page pool "
                             "[0, %lld)",
                             (long long)b, (long long)pg,
                             (int)c->block_table[b * c->max_pages + pg], (long long)c->num_pages);
  if (p->set_mean) {
#pragma omp parallel for num_threads(nt)
    for (int64_t bh = 0; bh < c->batch * H; ++bh) {
      float *kmean = c->kmean + bh * D, *kscale = c->kscale + bh * D, g = 0.0f;
      int64_t lo, hi; /* the rows of this sequence's statistics */
      fp4attn_kv_mean_rows(p->mean_from ? p->mean_from[bh / H] : 0, p->len, p->mean_rows, &lo, &hi);
      for (int64_t d = 0; d < D; ++d) {
        float s = 0.0f, a = 0.0f;
        const int64_t base = (bh / H) * p->k_stride[0] + (bh % H) * p->k_stride[1] + d;
        for (int64_t n = lo; n < hi; ++n)
          s += fp4attn_load(p->k, p->dtype, base + n * p->k_stride[2]);
        kmean[d] = hi > lo ? s / (float)(hi - lo) : 0.0f;
        for (int64_t n = lo; n < hi; ++n)
          a = fp4attn_nanmax(
              a, fabsf(fp4attn_load(p->k, p->dtype, base + n * p->k_stride[2]) - kmean[d]));
        kscale[d] = sqrtf(a);
        g = fp4attn_nanmax(g, kscale[d]);
      }
      /* SPEC 6's channel scales: max(r_c, g 2^-6), or 1 everywhere unless g is finite and > 0 */
      const int ok = fp4attn_isfinite(g) && g > 0.0f;
      for (int64_t d = 0; d < D; ++d)
        kscale[d] = !ok ? 1.0f : (kscale[d] > g * 0x1p-6f ? kscale[d] : g * 0x1p-6f);
    }
  }
  int bad = 0;
#pragma omp parallel num_threads(nt) reduction(|| : bad)
  {
    float *x = (float *)malloc(sizeof(float) * (size_t)(D + 256)), *w = x ? x + D : NULL;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t b = i / (H * p->len), h = (i / p->len) % H, n = i % p->len;
      const int64_t r = row_index(c, b, h, p->start + n);
      if (r < 0 || !x) {
        bad = 1;
        continue;
      }
      const float *kmean = c->kmean + (b * H + h) * D, *kscale = c->kscale + (b * H + h) * D;
      const int64_t kb = b * p->k_stride[0] + h * p->k_stride[1] + n * p->k_stride[2];
      const int64_t vb = b * p->v_stride[0] + h * p->v_stride[1] + n * p->v_stride[2];
      for (int64_t d = 0; d < D; ++d)
        x[d] = (fp4attn_load(p->k, p->dtype, kb + d) - kmean[d]) / kscale[d];
      c->k_exp[r] = quantize_key_row(x, D, w, c->k_codes + r * kcb, c->k_scales + r * ksc);
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
  float *q, *qx, *o, *m, *l, *shift, *kt, *vr, *sk;
  /* each row's visible keys [begin, end): stored rows before `exact`, residual rows from it */
  int64_t *begin, *exact, *end;
} DecodeScratch;

/* q: the rows' rotated queries [rows][Dp], qx: as given [rows][D]; kt: the block's rotated keys
 * transposed [Dp][kKeys] */
static DecodeScratch decode_scratch(int64_t rows, int64_t D, int64_t dp) {
  DecodeScratch w;
  w.q = (float *)malloc(sizeof(float) *
                        (size_t)(rows * (dp + 2 * D + 3) + kKeys * dp + kKeys * D + kKeys));
  w.begin = (int64_t *)malloc(sizeof(int64_t) * (size_t)(3 * rows));
  if (!w.q || !w.begin) {
    free(w.q), free(w.begin);
    w.q = NULL, w.begin = NULL;
    return w;
  }
  w.qx = w.q + rows * dp;
  w.o = w.qx + rows * D;
  w.m = w.o + rows * D;
  w.l = w.m + rows;
  w.shift = w.l + rows;
  w.kt = w.shift + rows;
  w.vr = w.kt + kKeys * dp;
  w.sk = w.vr + kKeys * D;
  w.exact = w.begin + rows;
  w.end = w.exact + rows;
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

/* A stored K5 key row's rotated values (SPEC 6: (q * s) * 2^e), Dp values `stride` floats
 * apart, by the tables of the 31 code values and the 256 scale values. */
static void dequantize_key_row(const uint8_t *restrict codes, const uint8_t *restrict scales,
                               uint8_t exp, int64_t dp, const float *restrict scale_value,
                               float *restrict out, int64_t stride) {
  /* 2^(exp - 127); the byte 255 (a non-finite row) gives NaN */
  const float r =
      exp == 255 ? NAN : (exp == 0 ? 0x1p-127f : fp4attn_bits_float((uint32_t)exp << 23));
  for (int64_t i = 0; i < dp; ++i) {
    const int u = ((codes[i / 2] >> (4 * (i & 1))) & 15) | ((codes[dp / 2 + i / 8] >> (i & 7)) & 1)
                                                               << 4;
    out[i * stride] = ((float)(u - 15) * scale_value[scales[i / 64]]) * r;
  }
}

/* x[0..dp) times the rotation (SPEC 6's butterfly in blocks of dp & -dp). */
static void rotate(float *x, int64_t dp) {
  const int64_t n = dp & -dp;
  for (int64_t h = 1; h < n; h <<= 1)
    for (int64_t blk = 0; blk < dp; blk += 2 * h)
      for (int64_t i = blk; i < blk + h; ++i) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
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
  for (int64_t b = 0; b < c->batch; ++b) /* the CUDA decode gives such a sequence NaN rows */
    if (p->seq_lens[b] < 0 || p->seq_lens[b] > c->max_pages * c->page_size)
      return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT,
                           "decode: seq_lens[%lld] = %lld is outside [0, %lld], the tokens its "
                           "block-table row of %lld pages of %lld addresses",
                           (long long)b, (long long)p->seq_lens[b],
                           (long long)(c->max_pages * c->page_size), (long long)c->max_pages,
                           (long long)c->page_size);
  const int64_t D = c->head_dim, H = c->heads_kv, G = p->heads_q / H, nq = p->len_q, R = G * nq;
  const int64_t cb = fp4attn_code_bytes(D), sc = fp4attn_scale_count(D);
  const int64_t dp = (D + 15) / 16 * 16, kcb = fp4attn_k5_code_bytes(D);
  const int64_t nres = p->residual_len, slots = p->residual_slots;
  const int64_t ksc = fp4attn_k5_scale_count(D);
  /* scores of rotated rows: q . k = (H q) . (H k) / n, the 1/n with the scale (a power of two) */
  const float kscale = p->scale / (float)(dp & -dp);
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
    DecodeScratch w = decode_scratch(per, D, dp);
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
      const int64_t ks = p->key_start && p->key_start[b] > 0 ? p->key_start[b] : 0;
      const float *kmean = c->kmean + (b * H + hk) * D, *chs = c->kscale + (b * H + hk) * D;
      /* the rows' queries (times the channel scales, then rotated), constant lse terms and
       * visible keys; the keys any row sees, [lo, hi), stored rows below hq, residual rows
       * from xlo */
      int64_t lo = L, hi = 0, hq = 0, xlo = L;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = r0 + i, h = hk * G + r / nq, t = r % nq;
        const int64_t qb = b * p->q_stride[0] + h * p->q_stride[1] + t * p->q_stride[2];
        float s = 0.0f, *q = w.q + i * dp;
        for (int64_t d = 0; d < dp; ++d) q[d] = d < D ? fp4attn_load(p->q, p->dtype, qb + d) : 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          s += q[d] * kmean[d];
          w.qx[i * D + d] = q[d];
          q[d] *= chs[d];
          w.o[i * D + d] = 0.0f;
        }
        rotate(q, dp);
        w.shift[i] = p->scale * s;
        w.m[i] = -INFINITY;
        w.l[i] = 0.0f;
        const int64_t end = L - nq + t + 1 < L ? L - nq + t + 1 : L;
        w.end[i] = end;
        w.begin[i] = p->window > 0 && end > p->window ? end - p->window : 0;
        w.begin[i] = w.begin[i] > ks ? w.begin[i] : ks; /* the sequence's padding */
        /* key_start past the end: no keys (end < 0: more query positions than keys) */
        w.begin[i] = w.begin[i] < end ? w.begin[i] : (end > 0 ? end : 0);
        /* the row's newest nres keys still in the ring: [exact, end) */
        int64_t ex = end;
        if (nres > 0) {
          ex = end - nres > L - slots ? end - nres : L - slots;
          ex = ex < w.begin[i] ? w.begin[i] : (ex > end ? end : ex);
        }
        w.exact[i] = ex;
        lo = w.begin[i] < lo ? w.begin[i] : lo, hi = end > hi ? end : hi;
        hq = ex > hq ? ex : hq, xlo = ex < xlo ? ex : xlo;
      }
      for (int64_t j0 = lo; j0 < hq && !bad; j0 += kKeys) {
        const int64_t nk = hq - j0 < kKeys ? hq - j0 : kKeys;
        for (int64_t j = 0; j < nk; ++j) { /* the block's key and value rows, dequantized */
          const int64_t r = row_index(c, b, hk, j0 + j);
          if (r < 0) {
            bad = 1;
            break;
          }
          const uint8_t *kc = c->k_codes + r * kcb, *vc = c->v_codes + r * cb;
          const uint8_t *ks = c->k_scales + r * ksc, *vs = c->v_scales + r * sc;
          dequantize_key_row(kc, ks, c->k_exp[r], dp, scale_value, w.kt + j, kKeys);
          dequantize_row(vc, vs, c->v_dec[r], D, code_value, scale_value, w.vr + j * D, 1);
        }
        if (bad) break;
        float *restrict sk = w.sk;
        for (int64_t i = 0; i < n; ++i) { /* the block's keys [ja, jb) that row i sees */
          const int64_t ja = w.begin[i] > j0 ? w.begin[i] - j0 : 0;
          const int64_t jb = w.exact[i] < j0 + nk ? w.exact[i] - j0 : nk;
          if (ja >= jb) continue;
          for (int64_t j = ja; j < jb; ++j) sk[j] = 0.0f;
          for (int64_t d = 0; d < dp; ++d) {
            const float qd = w.q[i * dp + d];
            const float *restrict kt = w.kt + d * kKeys;
            for (int64_t j = ja; j < jb; ++j) sk[j] += qd * kt[j];
          }
          for (int64_t j = ja; j < jb; ++j)
            softmax_step(sk[j] * kscale, w.vr + j * D, D, &w.m[i], &w.l[i], w.o + i * D);
        }
      }
      for (int64_t j = xlo; nres > 0 && j < hi; ++j) { /* the residual keys */
        const int64_t at = ((b * H + hk) * slots + j % slots) * D;
        float *restrict kr = w.kt, *restrict vr = w.vr;
        for (int64_t d = 0; d < D; ++d) {
          kr[d] = fp4attn_load(p->res_k, p->dtype, at + d) - kmean[d];
          vr[d] = fp4attn_load(p->res_v, p->dtype, at + d);
        }
        for (int64_t i = 0; i < n; ++i) {
          if (j < w.exact[i] || j >= w.end[i]) continue;
          float s = 0.0f;
          for (int64_t d = 0; d < D; ++d) s += w.qx[i * D + d] * kr[d];
          softmax_step(s * p->scale, vr, D, &w.m[i], &w.l[i], w.o + i * D);
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = r0 + i, h = hk * G + r / nq, t = r % nq;
        const int64_t ob = b * p->out_stride[0] + h * p->out_stride[1] + t * p->out_stride[2];
        for (int64_t d = 0; d < D; ++d)
          fp4attn_store(p->out, p->dtype, ob + d, w.l[i] != 0.0f ? w.o[i * D + d] / w.l[i] : 0.0f);
        if (p->lse)
          p->lse[(b * p->heads_q + h) * nq + t] =
              w.l[i] != 0.0f ? w.m[i] + logf(w.l[i]) + w.shift[i] : -INFINITY;
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
