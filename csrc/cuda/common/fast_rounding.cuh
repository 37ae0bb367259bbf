/*
 * Fast bit-exact NVFP4 block quantization (SPEC 2) for the CUDA kernels: the same bytes as
 * numerics.h's fp4attn_quantize_block + block_f16_words (exact FP16 values code * scale), with
 * the E4M3 scale from an FMA-corrected m / 6 and the hardware conversion, and the E2M1 rounding
 * by one add and one subtract. Each helper is checked against numerics.h by
 * tests/cuda_harness/check_prepass.cu (exhaustively where a single float is the input).
 * Used by the pre-pass (K^, V^: two lanes per block, quantize_half_block in prepass/prepass.cu) and
 * by the attention kernels' Q quantization (quantize_block16: one thread per block). The split-KV
 * decode's K^ and V^ from mma fragments take a branch-free variant for bounded blocks
 * (decode/sdpa_decode.cu, quantize_quad_bounded).
 */
#ifndef FP4ATTN_CUDA_COMMON_FAST_ROUNDING_CUH
#define FP4ATTN_CUDA_COMMON_FAST_ROUNDING_CUH

#include "device.cuh"

namespace fp4attn_cuda {

/* The exact FP16 values code * scale of one quantized 16-value block (codes q, E4M3 scale s) as
 * 8 half2 words: the form the workspace and the kernels' shared memory hold. */
__device__ __forceinline__ void block_f16_words(const uint8_t *q, uint8_t s, uint32_t (&o)[8]) {
  const float sv = fp4attn_e4m3_decode(s);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    o[i] = pack_half2(fp4attn_e2m1_decode(q[2 * i]) * sv, fp4attn_e2m1_decode(q[2 * i + 1]) * sv);
}

/* max that returns NaN when either operand is NaN (max.NaN, sm_80+). */
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

/* bmax / 6 for the E4M3 block scale: one FMA-corrected step instead of the IEEE division. The
 * quotient may differ from the correctly rounded one in the last bit, its E4M3 rounding never
 * does (checked exhaustively over [0, 2^96] by tests/cuda_harness/check_prepass.cu; above 2688
 * both saturate to 448). */
__device__ __forceinline__ float div6_e4m3(float a) {
  const float y = 0.16666667163372040f; /* fl(1/6) */
  const float q0 = __fmul_rn(a, y);
  const float r = __fmaf_rn(-q0, 6.0f, a);
  return __fmaf_rn(r, y, q0);
}

/* value(rne_e2m1(y)) (SPEC 1) with y's sign, before saturation, for |y| < 8: adding
 * C = 1.5 * 2^(max(e, 0) + 22), e the binary exponent of |y|, leaves a float32 in C's binade
 * whose last place is the E2M1 spacing of |y|'s binade (0.5 below 2, 1 in [2, 4), 2 in [4, 8)),
 * so round-to-nearest-even puts y on the E2M1 grid with the ties of SPEC 1 (C's last mantissa
 * bit is 0, so "even" is the even grid point), symmetrically in sign; subtracting C is exact and
 * gives +0 for a zero result (the code 0 of fp4attn_e2m1_encode is +0 too). Results of 8 (|y| in
 * [7, 8)) need the saturation to 6: callers clamp y to [-6, 6] first when that can happen.
 * Checked bit for bit against fp4attn_e2m1_decode(fp4attn_e2m1_encode(y)) on every float with
 * |y| < 7, and after the clamp on every float below 2^100, by tests/cuda_harness/check_prepass.cu.
 */
__device__ __forceinline__ float e2m1_round_signed(float y) {
  uint32_t e = __float_as_uint(y) & 0x7F800000u;
  e = (e > 0x3F800000u ? e : 0x3F800000u) + 0x0B400000u;
  const float c = __uint_as_float(e);
  return __fsub_rn(__fadd_rn(y, c), c);
}

__device__ __forceinline__ float clamp6(float y) {
  return fminf(fmaxf(y, -6.0f), 6.0f);
}

/* The rare blocks with NaN, Inf or magnitudes above 2^96: numerics.h itself, out of line. */
static __device__ __noinline__ uint4 quantize_half_block_slow(float4 lo, float4 hi, float m) {
  const float xs[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const uint8_t s = fp4attn_e4m3_encode_sat(m / 6.0f);
  const float sv = fp4attn_e4m3_decode(s);
  const float r = 1.0f / sv;
  uint32_t o[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float v[2];
#pragma unroll
    for (int e = 0; e < 2; ++e)
      v[e] = sv == 0.0f ? 0.0f : fp4attn_e2m1_decode(fp4attn_e2m1_encode(xs[2 * k + e] * r)) * sv;
    o[k] = pack_half2(v[0], v[1]);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

/* What quantizing with E4M3 scale byte s needs (the sign bit is dropped): 1/s correctly rounded
 * (__frcp_rn; 0 for the zero scale, so a zero block quantizes to zeros without a branch) and s as
 * an FP16 pair (exact). */
struct ScaleEntry {
  float r;
  uint32_t s2;
};
__device__ __forceinline__ ScaleEntry e4m3_scale_entry(uint32_t s) {
  const __half_raw hs = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(s & 0x7F), __NV_E4M3);
  return ScaleEntry{(s & 0x7F) == 0 ? 0.0f : __frcp_rn(__half2float(__half(hs))),
                    (uint32_t)hs.x | ((uint32_t)hs.x << 16)};
}

/* One 16-value block (global scale already applied) quantized by one thread: its 16 exact FP16
 * values code * scale as 8 half2 words, byte-identical to fp4attn_quantize_block +
 * block_f16_words (check_prepass.cu; NaN anywhere makes the block max NaN). Finite blocks below
 * 2^96: hardware E4M3 of m / 6, e4m3_scale_entry, E2M1 by e2m1_round_signed (clamped first when
 * some |y| can reach 7), code * s as one FP16 multiply per pair; other blocks: numerics.h
 * (quantize_half_block_slow). */
__device__ __forceinline__ void quantize_block16(const float (&xs)[16], uint32_t (&o)[8]) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = max_nan(m, fabsf(xs[i]));
  if (!(m <= 7.9228163e28f)) { /* 2^96; NaN fails the test too */
    const uint4 lo = quantize_half_block_slow(make_float4(xs[0], xs[1], xs[2], xs[3]),
                                              make_float4(xs[4], xs[5], xs[6], xs[7]), m);
    const uint4 hi = quantize_half_block_slow(make_float4(xs[8], xs[9], xs[10], xs[11]),
                                              make_float4(xs[12], xs[13], xs[14], xs[15]), m);
    o[0] = lo.x, o[1] = lo.y, o[2] = lo.z, o[3] = lo.w, o[4] = hi.x, o[5] = hi.y, o[6] = hi.z,
    o[7] = hi.w;
    return;
  }
  const ScaleEntry e = e4m3_scale_entry(e4m3_encode_fast(div6_e4m3(m)));
  const bool clamp = __fmul_rn(m, e.r) >= 7.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    float y0 = __fmul_rn(xs[2 * k], e.r), y1 = __fmul_rn(xs[2 * k + 1], e.r);
    if (clamp) y0 = clamp6(y0), y1 = clamp6(y1);
    o[k] = h2_mul(pack_half2(e2m1_round_signed(y0), e2m1_round_signed(y1)), e.s2);
  }
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_COMMON_FAST_ROUNDING_CUH */
