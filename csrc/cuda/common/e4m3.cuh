/*
 * FP8 E4M3 ("fn": max 448, subnormals in steps of 2^-9) for the 8-bit attention's P.V
 * (docs/SPEC_INT8.md 2.2 and 2.4): rounding a float to an E4M3 value, the bytes of E4M3 values,
 * and, for GPUs without FP8 MMA (sm_80 / sm_86), bytes to FP16. Every helper gives the bytes or
 * values of numerics.h's fp4attn_e4m3_encode_sat / fp4attn_e4m3_decode (with the sign applied);
 * tests/cuda_harness/check_e4m3.cu checks them exhaustively (scripts/check_e4m3.sh).
 */
#ifndef FP4ATTN_CUDA_COMMON_E4M3_CUH
#define FP4ATTN_CUDA_COMMON_E4M3_CUH

#include <cuda_fp16.h>
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

/* Two E4M3 bytes (bits 0-7 and 8-15 of w) as FP16 values times 2^-8, in the halves of the result:
 * a byte's magnitude bits moved to FP16 bits 7-13 give E4M3's exponent rebiased by -8 (15 - 7)
 * and its mantissa, a subnormal E4M3 becoming a subnormal FP16 of the same scale, and its sign
 * to bit 15. Exact (the extra 2^-8 keeps 448 and the smallest code 2^-9 in FP16's range); NaN
 * codes become a finite value (the kernels never load one: V~ and R are finite where V is). */
__host__ __device__ __forceinline__ uint32_t e4m3x2_to_half2_scaled(uint32_t w) {
#if defined(__CUDA_ARCH__)
  const uint32_t x = __byte_perm(w, 0u, 0x1404); /* byte 0 -> bits 8-15, byte 1 -> bits 24-31 */
#else
  const uint32_t x = ((w & 0xFFu) << 8) | ((w & 0xFF00u) << 16);
#endif
  return ((x >> 1) & 0x3F803F80u) | (x & 0x80008000u);
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_COMMON_E4M3_CUH */
