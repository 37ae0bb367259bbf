/*
 * FP8 E4M3 ("fn": max 448, subnormals in steps of 2^-9) for the 8-bit attention's P.V
 * (docs/SPEC_INT8.md 2.2 and 2.4): rounding a float to an E4M3 value, the bytes of E4M3 values,
 * and the sum of V's two E4M3 terms. Every helper gives the bytes or values of numerics.h's
 * fp4attn_e4m3_encode_sat / fp4attn_e4m3_decode (with the sign applied);
 * tests/cuda_harness/check_e4m3.cu checks them exhaustively (scripts/check_e4m3.sh).
 */
#ifndef FP4ATTN_CUDA_COMMON_E4M3_CUH
#define FP4ATTN_CUDA_COMMON_E4M3_CUH

#include <stdint.h>

#include "fp4attn/numerics.h"

namespace fp4attn_cuda {

/* 448 = the largest finite E4M3 value. */
constexpr float kE4m3Max = 448.0f;

/* The E4M3 value of y (round to nearest even, saturating at +-448, NaN stays NaN) as a float.
 * Adding C = 1.5 * 2^(max(e, -6) + 20), e the binary exponent of |y|, leaves a float in C's
 * binade whose last place is E4M3's spacing in |y|'s binade (2^(e - 3); 2^-9 below 2^-6), so the
 * addition rounds y onto the E4M3 grid, ties to even (C's last mantissa bit is 0), symmetrically
 * in sign, and subtracting C is exact. The clamp first makes 448 the largest result. */
__host__ __device__ __forceinline__ float e4m3_round(float y) {
  if (y != y) return y;
  y = fminf(fmaxf(y, -kE4m3Max), kE4m3Max);
  uint32_t e = fp4attn_float_bits(y) & 0x7F800000u;
  e = (e > 0x3C800000u ? e : 0x3C800000u) + 0x0A400000u;
  const float c = fp4attn_bits_float(e);
#if defined(__CUDA_ARCH__)
  return __fsub_rn(__fadd_rn(y, c), c);
#else
  volatile float t = y + c; /* two roundings, never contracted or reassociated */
  return t - c;
#endif
}

/* The E4M3 byte of y (sign in bit 7, RNE, saturating; NaN -> 0x7F), numerics.h's encoder. */
__host__ __device__ __forceinline__ uint32_t e4m3_byte(float y) {
  const uint32_t sign = (fp4attn_float_bits(y) >> 24) & 0x80u;
  const uint32_t mag = fp4attn_e4m3_encode_sat(y < 0.0f ? -y : y);
  return mag == 0x7Fu ? 0x7Fu : (sign | mag);
}

/* The bytes of (lo, hi) in the low 16 bits (lo in bits 0-7): one conversion instruction where
 * the GPU has it (sm_89+), numerics.h's encoder elsewhere. */
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return e4m3_byte(lo) | (e4m3_byte(hi) << 8);
#endif
}

/* The two E4M3 terms of y summed, V~ + R with V~ = e4m3_round(y), R = e4m3_round(y - V~)
 * (SPEC_INT8 2.2's V for scaled y, |y| <= 448 (1 + 2^-23)): y - V~ is exact (y's bits below V~'s
 * precision, or y - 448 >= 0 by Sterbenz), and so is the sum: both terms are multiples of 2^-9
 * below 2^9. */
__host__ __device__ __forceinline__ float e4m3_terms_sum(float y) {
  const float hi = e4m3_round(y);
  return hi + e4m3_round(y - hi);
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_COMMON_E4M3_CUH */
