/*
 * E2M1 codes to exact 16-bit pairs in registers, for the FP4 KV-cache decode (decode.cu): a code
 * word w holds 8 codes, nibble n at bits 4n..4n+3 (sign in the top bit); pair j (j = 0..3) holds
 * nibble j in its low half and nibble j + 4 in its high half, as FP16 bits (+-0 for the zero
 * codes). Byte permutes look the magnitudes up in 8-entry tables, place them (zero bytes from
 * the permute's sign mode on a positive byte), and one shift + one LOP3 per pair adds the signs:
 * nibbles j and j + 4 are 16 bits apart, so one shift brings both sign bits to bits 15 and 31.
 * Host emulation of prmt included, so tests/cuda_harness/check_e2m1_pairs.cu checks every case.
 */
#ifndef FP4ATTN_CUDA_DECODE_E2M1_PAIRS_CUH
#define FP4ATTN_CUDA_DECODE_E2M1_PAIRS_CUH

#include <cstdint>

namespace fp4attn_cuda {

/* PTX prmt.b32 (default mode): byte k of the result is byte sel[4k+2:4k] of {b, a} (a = bytes
 * 0-3), or that byte's msb replicated where sel bit 4k+3 is set. */
__host__ __device__ __forceinline__ uint32_t prmt_b32(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
#else
  const uint64_t src = (uint64_t)b << 32 | a;
  uint32_t r = 0;
  for (int k = 0; k < 4; ++k) {
    const uint32_t s = (sel >> (4 * k)) & 0xFu;
    uint32_t byte = (uint32_t)(src >> (8 * (s & 7u))) & 0xFFu;
    if (s & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    r |= byte << (8 * k);
  }
  return r;
#endif
}

__host__ __device__ __forceinline__ void e2m1_pairs(uint32_t w, uint32_t (&pair)[4]) {
  const uint32_t idx = w & 0x77777777u; /* magnitudes; the selectors of the table lookups */
  /* an FP16 magnitude is one high byte: 00 38 3C 3E 40 42 44 46 */
  const uint32_t lo = prmt_b32(0x3E3C3800u, 0x46444240u, idx), /* nibbles 0-3 */
      hi = prmt_b32(0x3E3C3800u, 0x46444240u, idx >> 16);      /* nibbles 4-7 */
  /* pair j = [hi_j, 0, lo_j, 0]: selector 8 (sign mode on byte 0, whose msb is clear) = 0 */
  const uint32_t mag[4] = {prmt_b32(lo, hi, 0x4808u), prmt_b32(lo, hi, 0x5818u),
                           prmt_b32(lo, hi, 0x6828u), prmt_b32(lo, hi, 0x7838u)};
#pragma unroll
  for (int j = 0; j < 4; ++j) /* sign of nibble j (bit 4j + 3) to 15, of nibble j + 4 to 31 */
    pair[j] = mag[j] | ((w << (12 - 4 * j)) & 0x80008000u);
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_DECODE_E2M1_PAIRS_CUH */
