/* Internal helpers of the C CPU backend: dtype conversions and the row quantizer. */
#ifndef FP4ATTN_CPU_COMMON_H
#define FP4ATTN_CPU_COMMON_H

#include "fp4attn/checks.h"
#include "fp4attn/fp4attn.h"
#include "fp4attn/numerics.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* IEEE binary16 -> binary32 (exact). */
static inline float fp4attn_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1Fu) return fp4attn_bits_float(sign | 0x7F800000u | (m << 13));
  if (e == 0u) {
    float v = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
    return sign ? -v : v;
  }
  return fp4attn_bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

/* binary32 -> binary16, round to nearest even (what a tensor .half() does). */
static inline uint16_t fp4attn_f32_to_f16(float f) {
  uint32_t x = fp4attn_float_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) return (uint16_t)(sign | (x > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (x >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520 rounds to Inf */
  if (x < 0x38800000u) {                                   /* below 2^-14: subnormal */
    if (x <= 0x33000000u) return (uint16_t)sign;           /* <= 2^-25 rounds to 0 */
    uint32_t e = x >> 23, m = (x & 0x7FFFFFu) | 0x800000u, shift = 126u - e;
    uint32_t r = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t r = (x >> 13) - (112u << 10), rem = x & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
  return (uint16_t)(sign | r);
}

static inline float fp4attn_bf16_to_f32(uint16_t b) {
  return fp4attn_bits_float((uint32_t)b << 16);
}

static inline uint16_t fp4attn_f32_to_bf16(float f) {
  uint32_t x = fp4attn_float_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u);
  return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

static inline float fp4attn_load(const void *base, fp4attn_dtype dtype, int64_t i) {
  switch (dtype) {
    case FP4ATTN_FLOAT16:
      return fp4attn_f16_to_f32(((const uint16_t *)base)[i]);
    case FP4ATTN_BFLOAT16:
      return fp4attn_bf16_to_f32(((const uint16_t *)base)[i]);
    default:
      return ((const float *)base)[i];
  }
}

static inline void fp4attn_store(void *base, fp4attn_dtype dtype, int64_t i, float v) {
  switch (dtype) {
    case FP4ATTN_FLOAT16:
      ((uint16_t *)base)[i] = fp4attn_f32_to_f16(v);
      break;
    case FP4ATTN_BFLOAT16:
      ((uint16_t *)base)[i] = fp4attn_f32_to_bf16(v);
      break;
    default:
      ((float *)base)[i] = v;
      break;
  }
}

/* Quantize one row of `cols` float values (already in FP32, not yet multiplied by enc) into
 * packed codes and block scales (SPEC 2). Shared by the quantize op and the attention pre-pass. */
static inline void fp4attn_quantize_row(const float *x, int64_t cols, float enc, uint8_t *codes,
                                        uint8_t *scales) {
  for (int64_t c0 = 0, b = 0; c0 < cols; c0 += FP4ATTN_BLOCK, ++b) {
    float xs[FP4ATTN_BLOCK];
    uint8_t q[FP4ATTN_BLOCK];
    int n = cols - c0 < FP4ATTN_BLOCK ? (int)(cols - c0) : FP4ATTN_BLOCK;
    for (int i = 0; i < FP4ATTN_BLOCK; ++i) xs[i] = i < n ? x[c0 + i] * enc : 0.0f;
    scales[b] = fp4attn_quantize_block(xs, FP4ATTN_BLOCK, q);
    for (int i = 0; i < FP4ATTN_BLOCK / 2; ++i)
      codes[b * 8 + i] = (uint8_t)(q[2 * i] | (q[2 * i + 1] << 4));
  }
}

#endif /* FP4ATTN_CPU_COMMON_H */
