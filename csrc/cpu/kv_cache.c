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

/* Row r dequantized (SPEC 2: (value * s) * dec), D values. */
static void dequantize_row(const uint8_t *codes, const uint8_t *scales, float dec, int64_t D,
                           float *out) {
  for (int64_t d = 0; d < D; ++d) {
    const uint8_t code = (d & 1) ? (uint8_t)(codes[d / 2] >> 4) : (uint8_t)(codes[d / 2] & 0xF);
    out[d] = (fp4attn_e2m1_decode(code) * fp4attn_e4m3_decode(scales[d / 16])) * dec;
  }
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

fp4attn_status fp4attn_cpu_decode(const fp4attn_decode_params *p) {
  fp4attn_status st = fp4attn_check_decode_params(p);
  if (st.code != FP4ATTN_OK) return st;
  const fp4attn_kv_cache *c = &p->cache;
  const int64_t D = c->head_dim, H = c->heads_kv, G = p->heads_q / H, nq = p->len_q;
  const int64_t cb = fp4attn_code_bytes(D), sc = fp4attn_scale_count(D);
  const int nt = p->num_threads > 0 ? p->num_threads : omp_get_max_threads();
  int bad = 0;
  /* one (batch, KV head, query position) at a time: each key row dequantized once for its G heads
   */
#pragma omp parallel num_threads(nt) reduction(|| : bad)
  {
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * D + G * (2 * D + 3)));
    float *kr = buf, *vr = buf + D, *q = buf + 2 * D, *o = q + G * D, *m = o + G * D;
    float *l = m + G, *shift = l + G;
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < c->batch * H * nq; ++i) {
      if (!buf) {
        bad = 1;
        continue;
      }
      const int64_t b = i / (H * nq), hk = (i / nq) % H, t = i % nq;
      int64_t L = p->seq_lens[b], end = L - nq + t + 1; /* keys begin .. end - 1 are visible */
      if (end > L) end = L;
      const int64_t begin = p->window > 0 && end > p->window ? end - p->window : 0;
      const float *kmean = c->kmean + (b * H + hk) * D;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g,
                      qb = b * p->q_stride[0] + h * p->q_stride[1] + t * p->q_stride[2];
        float s = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          q[g * D + d] = fp4attn_load(p->q, p->dtype, qb + d);
          s += q[g * D + d] * kmean[d];
          o[g * D + d] = 0.0f;
        }
        shift[g] = p->scale * s;
        m[g] = -INFINITY;
        l[g] = 0.0f;
      }
      for (int64_t j = begin; j < end; ++j) {
        const int64_t r = row_index(c, b, hk, j);
        if (r < 0) {
          bad = 1;
          break;
        }
        dequantize_row(c->k_codes + r * cb, c->k_scales + r * sc, c->k_dec[r], D, kr);
        dequantize_row(c->v_codes + r * cb, c->v_scales + r * sc, c->v_dec[r], D, vr);
        for (int64_t g = 0; g < G; ++g) {
          float s = 0.0f;
          for (int64_t d = 0; d < D; ++d) s += q[g * D + d] * kr[d];
          s *= p->scale;
          const float m_new = s > m[g] ? s : m[g];
          const float alpha = expf(m[g] - m_new), w = expf(s - m_new);
          l[g] = alpha * l[g] + w;
          for (int64_t d = 0; d < D; ++d) o[g * D + d] = alpha * o[g * D + d] + w * vr[d];
          m[g] = m_new;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g;
        const int64_t ob = b * p->out_stride[0] + h * p->out_stride[1] + t * p->out_stride[2];
        for (int64_t d = 0; d < D; ++d)
          fp4attn_store(p->out, p->dtype, ob + d, l[g] > 0.0f ? o[g * D + d] / l[g] : 0.0f);
        if (p->lse)
          p->lse[(b * p->heads_q + h) * nq + t] =
              l[g] > 0.0f ? m[g] + logf(l[g]) + shift[g] : -INFINITY;
      }
    }
    free(buf);
  }
  if (bad)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT,
                         "decode: a block-table entry is outside the page pool (or out of memory)");
  return fp4attn_ok();
}
