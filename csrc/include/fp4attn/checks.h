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

/* The contract of fp4attn_attention_params (fp4attn.h): non-null tensors, sizes >= 1 (callers
 * return early for empty outputs), heads_q a multiple of heads_kv, head_dim in [1, 256], a valid
 * kernel request, a consistent mask description. */
static inline fp4attn_status fp4attn_check_attention_params(const fp4attn_attention_params *p) {
  if (!p || !p->q || !p->k || !p->v || !p->out)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "attention: null tensor pointer");
  if (!fp4attn_valid_dtype(p->dtype))
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "attention: unsupported dtype %d", (int)p->dtype);
  if (p->batch < 1 || p->heads_q < 1 || p->heads_kv < 1 || p->len_q < 1 || p->len_k < 1)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT,
                         "attention: sizes must be >= 1, got batch=%lld heads_q=%lld "
                         "heads_kv=%lld len_q=%lld len_k=%lld",
                         (long long)p->batch, (long long)p->heads_q, (long long)p->heads_kv,
                         (long long)p->len_q, (long long)p->len_k);
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

#endif /* FP4ATTN_CHECKS_H */
