/*
 * The channel migration of the 8-bit attention (docs/SPEC_INT8.md 2.1b), shared by the CPU and
 * CUDA backends so that both compute the same factor s_c from the same channel statistics.
 *
 * Exact IEEE binary32 arithmetic: one correctly rounded division, then exponent bits; nothing
 * here depends on contraction or on the rounding mode (beyond round-to-nearest-even).
 */
#ifndef FP4ATTN_INT8_MIGRATION_H
#define FP4ATTN_INT8_MIGRATION_H

#include "numerics.h"

/* ka_c = max(fl(kmax_c - kbar_c), fl(kbar_c - kmin_c)), NaN propagating: the same number as
 * max_j |fl(K_jc - kbar_c)|, since rounding is monotonic. */
FP4ATTN_HD float fp4attn_int8_migration_ka(float kmax, float kmin, float kbar) {
  const float hi = kmax - kbar, lo = kbar - kmin;
  return (lo > hi || lo != lo) ? lo : hi;
}

/* Whether v is a normal finite FP32 number (NaN, zero, subnormals and infinities are not). */
FP4ATTN_HD int fp4attn_int8_migration_normal(float v) {
  const uint32_t e = (fp4attn_float_bits(v) >> 23) & 0xFFu;
  return e != 0u && e != 0xFFu;
}

/* s_c = 2^ceil(E / 2), E the exponent of r = fl(ka / qa) = m 2^E (1 <= m < 2), where qa, ka and
 * r are all positive normal finite numbers; 2^-63 where ka = 0 and qa is normal finite (the
 * channel's smoothed keys are all 0: it adds nothing to a score, and its query channel must not
 * set its rows' scale); 1 otherwise. qa, ka >= 0 or NaN. s_c and 1 / s_c are powers of two in
 * [2^-63, 2^64]. */
FP4ATTN_HD float fp4attn_int8_migration_factor(float qa, float ka) {
  if (ka == 0.0f && fp4attn_int8_migration_normal(qa))
    return fp4attn_bits_float(64u << 23); /* 2^-63 */
  if (!(qa > 0.0f && ka > 0.0f) || !fp4attn_int8_migration_normal(qa) ||
      !fp4attn_int8_migration_normal(ka))
    return 1.0f;
#if defined(__CUDA_ARCH__)
  const float r = __fdiv_rn(ka, qa);
#else
  const float r = ka / qa;
#endif
  if (!fp4attn_int8_migration_normal(r)) return 1.0f;
  const int e = (int)((fp4attn_float_bits(r) >> 23) & 0xFFu) - 127; /* -126 .. 127 */
  const int h = (e + 1 + 256) / 2 - 128;                            /* ceil(e / 2), -63 .. 64 */
  return fp4attn_bits_float((uint32_t)(h + 127) << 23);
}

#endif /* FP4ATTN_INT8_MIGRATION_H */
