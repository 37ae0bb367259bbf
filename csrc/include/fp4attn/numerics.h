/*
 * E2M1 / E4M3 encode and decode shared by the CPU and CUDA backends (SPEC.md sections 1-2).
 *
 * Everything here is exact IEEE binary32 arithmetic written so that the host compiler and nvcc
 * produce identical bytes: no fused multiply-add (no expression here multiplies and then adds),
 * no reliance on the current rounding mode except round-to-nearest-even, which both use.
 */
#ifndef FP4ATTN_NUMERICS_H
#define FP4ATTN_NUMERICS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define FP4ATTN_HD __host__ __device__ __forceinline__
#else
#define FP4ATTN_HD static inline
#endif

/* 2688 = 448 * 6: the largest value a (E4M3 scale) x (E2M1 code) product can take. */
#define FP4ATTN_NVFP4_RANGE 2688.0f

FP4ATTN_HD uint32_t fp4attn_float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  return u;
#endif
}

FP4ATTN_HD float fp4attn_bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float v;
  memcpy(&v, &u, sizeof v);
  return v;
#endif
}

FP4ATTN_HD int fp4attn_isnan(float v) {
  return v != v;
}
FP4ATTN_HD int fp4attn_isfinite(float v) {
  return (fp4attn_float_bits(v) & 0x7F800000u) != 0x7F800000u;
}

/* Maximum that propagates NaN (like torch.amax): once NaN, stays NaN. */
FP4ATTN_HD float fp4attn_nanmax(float m, float a) {
  return (a > m || a != a) ? a : m;
}

/* rne_e4m3_sat (SPEC 1) for v >= 0 or NaN: round to the nearest E4M3 value, ties to even,
 * subnormals kept, values above 448 (and +Inf) saturate to 448, NaN -> 0x7F. */
FP4ATTN_HD uint8_t fp4attn_e4m3_encode_sat(float v) {
  if (v != v) return 0x7F;
  if (v >= 448.0f) return 0x7E;
  uint32_t bits = fp4attn_float_bits(v);
  uint32_t exp = (bits >> 23) & 0xFFu;
  if (exp < 121u) {
    /* below 2^-6: E4M3 subnormal m * 2^-9; v * 512 is exact, round its integer part to even */
    uint32_t q_bits = fp4attn_float_bits(v * 512.0f);
    uint32_t q_exp = (q_bits >> 23) & 0xFFu;
    if (q_exp < 126u) return 0; /* q < 0.5 */
    /* q in [0.5, 8): integer part and remainder from the float's bits */
    uint32_t mant = (q_bits & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 150u - q_exp; /* value = mant * 2^(q_exp-150) */
    uint32_t m = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (m & 1u))) m++;
    return (uint8_t)m; /* m == 8 is the smallest normal 2^-6 (code 0x08) */
  }
  uint32_t mant = bits & 0x7FFFFFu;
  uint32_t code = ((exp - 120u) << 3) | (mant >> 20); /* exp-127+7 */
  uint32_t rem = mant & 0xFFFFFu;
  if (rem > 0x80000u || (rem == 0x80000u && (code & 1u))) code++;
  return (uint8_t)(code > 0x7Eu ? 0x7Eu : code);
}

/* Value of an E4M3 byte (sign bit honoured; 0x7F/0xFF are NaN). */
FP4ATTN_HD float fp4attn_e4m3_decode(uint8_t c) {
  uint32_t e = (c >> 3) & 0xFu, m = c & 7u;
  float mag;
  if ((c & 0x7Fu) == 0x7Fu) {
    mag = fp4attn_bits_float(0x7FC00000u);
  } else if (e == 0u) {
    mag = (float)m * 0.001953125f; /* 2^-9 */
  } else {
    mag = fp4attn_bits_float(((e + 120u) << 23) | (m << 20));
  }
  return (c & 0x80u) ? -mag : mag;
}

/* rne_e2m1 (SPEC 1): the 4-bit code (sign in bit 3; zero is always code 0). The code magnitude
 * counts the thresholds passed (> where ties go down to the even code, >= where they go up),
 * which is branch-free and vectorises. NaN maps to the largest magnitude, 6 (the slice it comes
 * from dequantizes to NaN through its global scale), without a sign: NaN sign bits differ
 * between CPUs and GPUs. */
FP4ATTN_HD uint8_t fp4attn_e2m1_encode(float y) {
  float a = y < 0.0f ? -y : y;
  uint8_t c = (uint8_t)((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                        (a >= 3.5f) + (a > 5.0f));
  if (a != a) c = 7;
  if (y < 0.0f && c != 0) c |= 8;
  return c;
}

/* value(rne_e2m1(a)) for a >= 0 (not NaN) without going through the code: the same thresholds,
 * each adding the step to the next representable magnitude (0.5 up to 2, then 1, 1, 2). */
FP4ATTN_HD float fp4attn_e2m1_round_nonneg(float a) {
  return 0.5f * (float)((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f)) +
         (float)((a > 2.5f) + (a >= 3.5f)) + 2.0f * (float)(a > 5.0f);
}

/* Value of an E2M1 code: magnitudes 0, 0.5, 1, 1.5 (codes 0-3) and 2, 3, 4, 6 (codes 4-7). */
FP4ATTN_HD float fp4attn_e2m1_decode(uint8_t c) {
  uint32_t mag = c & 7u;
  float v = mag < 4u ? 0.5f * (float)mag : (float)((1u << ((mag - 4u) >> 1)) * (2u + (mag & 1u)));
  return (c & 8u) ? -v : v;
}

/* Per-slice global scales (SPEC 2): enc multiplies x before block quantization, dec undoes it. */
FP4ATTN_HD void fp4attn_global_scales(float amax, float *enc, float *dec) {
  float e = FP4ATTN_NVFP4_RANGE / amax;
  float d = amax / FP4ATTN_NVFP4_RANGE;
  if (amax == 0.0f || !fp4attn_isfinite(e)) {
    e = 1.0f;
    d = 1.0f;
  }
  if (!fp4attn_isfinite(amax)) d = fp4attn_bits_float(0x7FC00000u);
  *enc = e;
  *dec = d;
}

/* Quantize one block of n <= 16 values already multiplied by enc (xs); missing values of a
 * short block are zeros. Writes n codes (one per byte, unpacked) and returns the E4M3 scale. */
FP4ATTN_HD uint8_t fp4attn_quantize_block(const float *xs, int n, uint8_t *codes) {
  float bmax = 0.0f;
  for (int i = 0; i < n; ++i) bmax = fp4attn_nanmax(bmax, xs[i] < 0.0f ? -xs[i] : xs[i]);
  uint8_t s = fp4attn_e4m3_encode_sat(bmax / 6.0f);
  float sv = fp4attn_e4m3_decode(s);
  if (sv == 0.0f) {
    for (int i = 0; i < n; ++i) codes[i] = 0;
  } else {
    float r = 1.0f / sv;
    for (int i = 0; i < n; ++i) codes[i] = fp4attn_e2m1_encode(xs[i] * r);
  }
  return s;
}

/* ---- The KV cache's key rows (SPEC 6, K5): rotated 5-bit integers, an E4M3 scale per 64
 * values, a power-of-two row scale. The rotation's butterfly, the scale search's error sums and
 * the packing are structural and written out by each backend in SPEC 6's order. */

/* 6720 = 15 * 448: the largest |code x scale|. */
#define FP4ATTN_K5_RANGE 6720.0f

/* The row scale's exponent: the smallest e >= -126 with 2^e >= amax / 6720 (correctly rounded
 * division), for a finite amax >= 0. */
FP4ATTN_HD int fp4attn_k5_exponent(float amax) {
  const uint32_t t = fp4attn_float_bits(amax / FP4ATTN_K5_RANGE);
  const int ef = (int)(t >> 23);
  if (ef == 0) return -126; /* zero or subnormal */
  const int e = ef - 127 + ((t & 0x7FFFFFu) != 0u);
  return e < -126 ? -126 : e;
}

/* 2^-e for e in [-126, 127]: exact. */
FP4ATTN_HD float fp4attn_k5_inverse_scale(int e) {
  return fp4attn_bits_float((uint32_t)(127 - e) << 23);
}

/* The code q = clamp(rne(y / s), -15, 15) of y under scale s > 0, as u = q + 15 in 0..30. */
FP4ATTN_HD uint32_t fp4attn_k5_code(float y, float s) {
  float q = rintf(y / s);
  q = q > 15.0f ? 15.0f : (q < -15.0f ? -15.0f : q);
  return (uint32_t)(int)q + 15u;
}

#endif /* FP4ATTN_NUMERICS_H */
