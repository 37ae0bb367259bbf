/*
 * The block-scaled FP4 tensor-core MMA of sm_120a, and its exact emulation everywhere else.
 *
 *   D (16x8 f32) = (A (16x64 e2m1) * scale_A) x (B (64x8 e2m1) * scale_B) + C
 *
 * Native (sm_120a / sm_121a and the sm_120f family): one
 *   mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1.e2m1.f32.ue4m3
 * Elsewhere (sm_80, sm_90a, ... ; the "emulation build" that runs the whole Blackwell kernel on
 * Hopper): four FP16 m16n8k16 MMAs with FP32 accumulation that consume the very same registers.
 *
 * Register contract (docs/reference/blackwell_fp4.md; g = lane >> 2, t = lane & 3; nibble i of a
 * 32-bit register is element i, low nibble first):
 *   a0 = A[g][8t..8t+7]    a1 = A[g+8][8t..8t+7]   a2 = A[g][32+8t..]   a3 = A[g+8][32+8t..]
 *   b0 = B[8t..8t+7][g]    b1 = B[32+8t..32+8t+7][g]
 *   c/d: c0,c1 = row g, columns 2t, 2t+1; c2,c3 = row g+8, same columns
 *   sfa: lane 4g + 2*tid_a holds row g's word, lane 4g + 2*tid_a + 1 row g+8's (tid_a in {0,1});
 *   sfb: lane 4n + tid_b holds column n's word (tid_b in {0..3}); byte j of a word scales
 *        k in [16j, 16j+16). Other lanes' scale words are ignored.
 *
 * Why the emulation is exact up to accumulation order: the k sum may be taken in any order as
 * long as A and B use the same one. FP16 MMA j (j = 0..3) takes nibbles 2j, 2j+1 of each FP4
 * register with the same name, so thread (g, t) feeds physical k = 8t + 2j + e (a0, a1, b0) and
 * 32 + 8t + 2j + e (a2, a3, b1): A and B agree on every k and all 64 are covered once, with no
 * data shuffles. The scale block of a0/a1/b0 is t >> 1, of a2/a3/b1 it is 2 + (t >> 1); the three
 * scale words a thread needs come from other lanes by three __shfl_sync. Every product
 * e2m1 * e4m3 is exact in FP16; we carry both factors scaled by 2^-7 (so that the smallest
 * product, 2^-10, and the largest, 2688, stay exact FP16 values whose product is exact too) and
 * undo the resulting 2^-14 exactly in FP32 around the accumulation.
 *
 * E4M3 NaN scale bytes (0x7F) are not modelled as NaN by the emulation; they only arise from NaN
 * inputs, whose FP32 global scale is NaN anyway (SPEC 2).
 */
#ifndef FP4ATTN_SM120_MMA_FP4_CUH
#define FP4ATTN_SM120_MMA_FP4_CUH

#include <stdint.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && \
    (__CUDA_ARCH_FAMILY_SPECIFIC__ == 1200 || __CUDA_ARCH_FAMILY_SPECIFIC__ == 1210)
#define FP4ATTN_SM120_NATIVE_MMA 1
#else
#define FP4ATTN_SM120_NATIVE_MMA 0
#endif

namespace fp4attn_sm120 {

/* Two E2M1 codes (one byte: element 0 in the low nibble) -> FP16x2 of value * 2^-14, exact:
 * the code's 3 magnitude bits land on FP16 exponent bit 0 + mantissa bit 9, which encodes
 * 0, 0.5, 1, ..., 6 times 2^-14 (code 1 becomes the FP16 subnormal 2^-15). */
__device__ __forceinline__ uint32_t e2m1x2_to_h2_scaled(uint32_t byte_in_low_bits) {
  uint32_t y = byte_in_low_bits;
  return ((y & 0x7u) << 9) | ((y & 0x8u) << 12) | ((y & 0x70u) << 21) | ((y & 0x80u) << 24);
}

/* Exact-by-construction FP16x2 product (subnormals kept: f16 arithmetic never flushes). */
__device__ __forceinline__ uint32_t hmul2_u32(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

/* FP16 value of (E4M3 byte) * 2^7, exact (range 2^-2 .. 57344), broadcast to both halves.
 * (c & 0x7F) << 7 is the FP16 bit pattern of value * 2^-8 for every finite E4M3 byte, normal
 * or subnormal; multiplying by 2^15 is exact. */
__device__ __forceinline__ uint32_t e4m3_to_h2_x128(uint32_t c) {
  const uint32_t h = (c & 0x7Fu) << 7;
  return hmul2_u32(h | (h << 16), 0x78007800u /* 2^15, 2^15 */);
}

/* Dequantized FP16x2 (times 2^-7) of nibbles 2j, 2j+1 of an FP4 register under one scale. */
__device__ __forceinline__ uint32_t dq_pair(uint32_t reg, int j, uint32_t scale_h2_x128) {
  return hmul2_u32(e2m1x2_to_h2_scaled(reg >> (8 * j)), scale_h2_x128);
}

__device__ __forceinline__ void mma_f16_m16n8k16(float d[4], const uint32_t a[4],
                                                 const uint32_t b[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  (void)d;
  (void)a;
  (void)b;
  __trap(); /* FP4 attention kernels need sm_80 or newer */
#endif
}

/* D = A x B + C with block scales; d may alias c. tid_a in {0,1}, tid_b in {0..3} (byte-id 0).
 * Must be called by all 32 lanes of a warp with the same tid_a / tid_b. */
__device__ __forceinline__ void mma_fp4_m16n8k64(float d[4], const uint32_t a[4],
                                                 const uint32_t b[2], const float c[4],
                                                 uint32_t sfa, uint32_t sfb, int tid_a, int tid_b) {
#if FP4ATTN_SM120_NATIVE_MMA
  const uint16_t bid = 0, ta = (uint16_t)tid_a, tb = (uint16_t)tid_b;
  asm volatile(
      "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1.e2m1."
      "f32.ue4m3 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13}, %14, {%15,%16}, %17, {%18,%19};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]), "r"(sfa), "h"(bid), "h"(ta), "r"(sfb), "h"(bid), "h"(tb));
#else
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  /* the three scale words this thread's elements need (all lanes take part in every shuffle) */
  const uint32_t sa_lo = __shfl_sync(0xffffffffu, sfa, 4 * g + 2 * tid_a);     /* row g   */
  const uint32_t sa_hi = __shfl_sync(0xffffffffu, sfa, 4 * g + 2 * tid_a + 1); /* row g+8 */
  const uint32_t sb = __shfl_sync(0xffffffffu, sfb, 4 * g + tid_b);            /* column g */
  const int blk0 = t >> 1, blk1 = 2 + (t >> 1); /* scale bytes for k in [8t,..) and [32+8t,..) */
  const uint32_t sA0 = e4m3_to_h2_x128((sa_lo >> (8 * blk0)) & 0xFFu);
  const uint32_t sA1 = e4m3_to_h2_x128((sa_hi >> (8 * blk0)) & 0xFFu);
  const uint32_t sA2 = e4m3_to_h2_x128((sa_lo >> (8 * blk1)) & 0xFFu);
  const uint32_t sA3 = e4m3_to_h2_x128((sa_hi >> (8 * blk1)) & 0xFFu);
  const uint32_t sB0 = e4m3_to_h2_x128((sb >> (8 * blk0)) & 0xFFu);
  const uint32_t sB1 = e4m3_to_h2_x128((sb >> (8 * blk1)) & 0xFFu);
  /* operands carry 2^-7 each: accumulate C * 2^-14 and scale back (powers of two: exact) */
  float acc[4] = {c[0] * 0x1p-14f, c[1] * 0x1p-14f, c[2] * 0x1p-14f, c[3] * 0x1p-14f};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t ha[4], hb[2];
    ha[0] = dq_pair(a[0], j, sA0);
    ha[1] = dq_pair(a[1], j, sA1);
    ha[2] = dq_pair(a[2], j, sA2);
    ha[3] = dq_pair(a[3], j, sA3);
    hb[0] = dq_pair(b[0], j, sB0);
    hb[1] = dq_pair(b[1], j, sB1);
    mma_f16_m16n8k16(acc, ha, hb);
  }
  d[0] = acc[0] * 0x1p14f;
  d[1] = acc[1] * 0x1p14f;
  d[2] = acc[2] * 0x1p14f;
  d[3] = acc[3] * 0x1p14f;
#endif
}

}  // namespace fp4attn_sm120

#endif /* FP4ATTN_SM120_MMA_FP4_CUH */
