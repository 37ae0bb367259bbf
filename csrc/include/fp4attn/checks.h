/*
 * Status construction and the argument checks every backend applies to the C API (host code
 * only; C11 and C++). Backend-specific limits (alignment, grid sizes) stay in the backend.
 */
#ifndef FP4ATTN_CHECKS_H
#define FP4ATTN_CHECKS_H

#include <stdarg.h>
#include <stdio.h>

#include "fp4attn/fp4attn.h"

static inline fp4attn_status fp4attn_ok(void) {
  fp4attn_status s;
  s.code = FP4ATTN_OK;
  s.message[0] = '\0';
  return s;
}

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static inline fp4attn_status fp4attn_error(fp4attn_code code, const char *fmt, ...) {
  fp4attn_status s;
  va_list ap;
  s.code = code;
  va_start(ap, fmt);
  vsnprintf(s.message, sizeof s.message, fmt, ap);
  va_end(ap);
  return s;
}

static inline int fp4attn_valid_dtype(fp4attn_dtype d) {
  return d == FP4ATTN_FLOAT32 || d == FP4ATTN_FLOAT16 || d == FP4ATTN_BFLOAT16;
}

/* Whether a * b * c * d (each >= 1) is at most limit, without overflowing. */
static inline int fp4attn_product_fits(int64_t a, int64_t b, int64_t c, int64_t d, int64_t limit) {
  const int64_t f[4] = {a, b, c, d};
  for (int i = 0; i < 4; ++i) {
    if (f[i] > limit) return 0;
    limit /= f[i];
  }
  return 1;
}

/* Elements of one operand, padded to whole tiles (+256) and head dims (256): a bound far past any
 * memory that keeps every backend's element and byte offsets inside int64. */
#define FP4ATTN_MAX_OPERAND_ELEMS ((int64_t)1 << 56)

/* The contract of fp4attn_attention_params (fp4attn.h): sizes >= 1 (callers return early for
 * empty outputs) and within FP4ATTN_MAX_OPERAND_ELEMS, non-null tensors, heads_q a multiple of
 * heads_kv, head_dim in [1, 256], a valid kernel request, a consistent mask description. */
static inline fp4attn_status fp4attn_check_attention_params(const fp4attn_attention_params *p) {
  if (!p) return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "attention: null params");
  if (p->batch < 1 || p->heads_q < 1 || p->heads_kv < 1 || p->len_q < 1 || p->len_k < 1)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT,
                         "attention: sizes must be >= 1, got batch=%lld heads_q=%lld "
                         "heads_kv=%lld len_q=%lld len_k=%lld",
                         (long long)p->batch, (long long)p->heads_q, (long long)p->heads_kv,
                         (long long)p->len_q, (long long)p->len_k);
  if (p->len_q > FP4ATTN_MAX_OPERAND_ELEMS || p->len_k > FP4ATTN_MAX_OPERAND_ELEMS ||
      !fp4attn_product_fits(p->batch, p->heads_q, p->len_q + 256, 256, FP4ATTN_MAX_OPERAND_ELEMS) ||
      !fp4attn_product_fits(p->batch, p->heads_kv, p->len_k + 256, 256, FP4ATTN_MAX_OPERAND_ELEMS))
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "attention: sizes too large (batch=%lld heads_q=%lld heads_kv=%lld "
                         "len_q=%lld len_k=%lld: more than 2^56 padded elements per operand)",
                         (long long)p->batch, (long long)p->heads_q, (long long)p->heads_kv,
                         (long long)p->len_q, (long long)p->len_k);
  if (!p->q || !p->k || !p->v || !p->out)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "attention: null tensor pointer");
  if (!fp4attn_valid_dtype(p->dtype))
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "attention: unsupported dtype %d", (int)p->dtype);
  if (p->heads_q % p->heads_kv != 0)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT,
                         "attention: heads_q (%lld) must be a multiple of heads_kv (%lld)",
                         (long long)p->heads_q, (long long)p->heads_kv);
  if (p->head_dim < 1 || p->head_dim > FP4ATTN_MAX_HEAD_DIM)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "attention: head_dim must be in [1, %d], got %lld", FP4ATTN_MAX_HEAD_DIM,
                         (long long)p->head_dim);
  if (!fp4attn_kernel_name(p->kernel))
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "attention: kernel %d is not valid",
                         (int)p->kernel);
  if (p->mask_kind != FP4ATTN_MASK_NONE && p->mask_kind != FP4ATTN_MASK_BOOL &&
      p->mask_kind != FP4ATTN_MASK_ADDITIVE)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "attention: mask_kind %d is not valid",
                         (int)p->mask_kind);
  if (p->mask_kind != FP4ATTN_MASK_NONE && !p->mask)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "attention: mask kind set but mask is null");
  if (p->mask_kind == FP4ATTN_MASK_ADDITIVE && !fp4attn_valid_dtype(p->mask_dtype))
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "attention: unsupported mask dtype %d",
                         (int)p->mask_dtype);
  return fp4attn_ok();
}

/* The contract of fp4attn_kv_cache: non-null storage, sizes >= 1, head_dim in [1, 256]. */
static inline fp4attn_status fp4attn_check_kv_cache(const fp4attn_kv_cache *c) {
  if (c->batch < 1 || c->heads_kv < 1 || c->page_size < 1 || c->max_pages < 1 || c->num_pages < 1)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT,
                         "kv cache: sizes must be >= 1, got batch=%lld heads_kv=%lld "
                         "page_size=%lld max_pages=%lld num_pages=%lld",
                         (long long)c->batch, (long long)c->heads_kv, (long long)c->page_size,
                         (long long)c->max_pages, (long long)c->num_pages);
  if (!c->k_codes || !c->k_scales || !c->k_exp || !c->v_codes || !c->v_scales || !c->v_dec ||
      !c->kmean || !c->kscale || !c->block_table)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "kv cache: null storage pointer");
  if (c->head_dim < 1 || c->head_dim > FP4ATTN_MAX_HEAD_DIM)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "kv cache: head_dim must be in [1, %d], got %lld",
                         FP4ATTN_MAX_HEAD_DIM, (long long)c->head_dim);
  /* token positions stay 32-bit in the kernels */
  if (c->max_pages > (((int64_t)1 << 31) - 64) / c->page_size)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "kv cache: the block table addresses max_pages x page_size = %lld x %lld "
                         "tokens per sequence, more than 2^31 - 64",
                         (long long)c->max_pages, (long long)c->page_size);
  return fp4attn_ok();
}

static inline fp4attn_status fp4attn_check_kv_append_params(const fp4attn_kv_append_params *p) {
  if (!p || !p->k || !p->v)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "kv append: null tensor pointer");
  if (!fp4attn_valid_dtype(p->dtype))
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "kv append: unsupported dtype %d", (int)p->dtype);
  const fp4attn_status st = fp4attn_check_kv_cache(&p->cache);
  if (st.code != FP4ATTN_OK) return st;
  const int64_t cap = p->cache.max_pages * p->cache.page_size;
  if (p->len < 1 || p->start < 0 || p->len > cap || p->start > cap - p->len) /* no overflow */
    return fp4attn_error(
        FP4ATTN_ERR_INVALID_ARGUMENT,
        "kv append: %lld tokens from %lld do not fit the block table (%lld tokens)",
        (long long)p->len, (long long)p->start, (long long)cap);
  if (p->mean_rows < 0)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "kv append: mean_rows (%lld) must be >= 0",
                         (long long)p->mean_rows);
  return fp4attn_ok();
}

static inline fp4attn_status fp4attn_check_decode_params(const fp4attn_decode_params *p) {
  if (!p || !p->q || !p->out || !p->seq_lens)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "decode: null tensor pointer");
  if (!fp4attn_valid_dtype(p->dtype))
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "decode: unsupported dtype %d", (int)p->dtype);
  if (p->heads_q < 1 || p->len_q < 1 || p->heads_q % p->cache.heads_kv != 0)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT,
                         "decode: heads_q (%lld) must be a positive multiple of heads_kv (%lld), "
                         "len_q (%lld) >= 1",
                         (long long)p->heads_q, (long long)p->cache.heads_kv, (long long)p->len_q);
  if (p->window < 0)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "decode: window (%lld) must be >= 0",
                         (long long)p->window);
  if (p->residual_len < 0 ||
      (p->residual_len > 0 && (p->residual_slots < p->residual_len ||
                               p->residual_slots > 0x7FFFFFFF || !p->res_k || !p->res_v)))
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT,
                         "decode: residual_len (%lld) must be >= 0, and with residual_len > 0 "
                         "res_k and res_v must be given with residual_slots (%lld) in "
                         "[residual_len, 2^31)",
                         (long long)p->residual_len, (long long)p->residual_slots);
  return fp4attn_check_kv_cache(&p->cache);
}

#endif /* FP4ATTN_CHECKS_H */
