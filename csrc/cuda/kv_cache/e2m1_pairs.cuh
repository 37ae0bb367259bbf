/*
 * E2M1 codes to exact 16-bit pairs in registers, for the FP4 KV-cache decode (decode.cu): a code
 * word w holds 8 codes, nibble n at bits 4n..4n+3 (sign in the top bit); pair j (j = 0..3) holds
 * nibble j in its low half and nibble j + 4 in its high half, as the FP16 bits of the code's
 * value times 2^-14. E2M1 is a small float of FP16's form (bias 1 against 15): its magnitude bits
 * e1 e0 m placed as FP16 bits 11..9 are exactly value x 2^-14, the subnormal 0.5 included
 * (2^-15, FP16's subnormal), and its sign goes to bit 15. Nibbles j and j + 4 are 16 bits apart,
 * so one shift places both. With the even and the odd nibbles apart (one LOP3 each per word), a
 * code owns its byte: the shift that places its magnitude (bits 9..11) and the one that places
 * its sign (bit 15) leave every other bit of the byte, and of the pair's other byte, outside a
 * pair's 8 bits (kPair), so one LOP3 ORs the two and masks: 6 LOP3 and 7 shifts (multiplies, off
 * the ALU pipe) per word. A multiply by a scale times 2^14 (kE2m1Unit) gives the exact product.
 * Host emulation of prmt included; tests/cuda_harness/check_e2m1_pairs.cu checks every case.
 */
#ifndef FP4ATTN_CUDA_KV_CACHE_E2M1_PAIRS_CUH
#define FP4ATTN_CUDA_KV_CACHE_E2M1_PAIRS_CUH

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

/* w & M, opaque to the compiler on the device: it would otherwise fold e2m1_pairs' nibble split
 * into its masks and go back to two LOP3 per pair. */
template <uint32_t M>
__host__ __device__ __forceinline__ uint32_t and_opaque(uint32_t w) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("and.b32 %0, %1, %2;" : "=r"(r) : "r"(w), "n"(M));
  return r;
#else
  return w & M;
#endif
}

/* The FP16 pair (2^14, 2^14): a scale pair times it makes e2m1_pairs' values whole. */
constexpr uint32_t kE2m1Unit = 0x74007400u;

/* w >> 3 as a multiply-high on the device (the FMA pipe; the ALU pipe is the decode's busiest). */
__host__ __device__ __forceinline__ uint32_t shr3(uint32_t w) {
#ifdef __CUDA_ARCH__
  return __umulhi(w, 1u << 29);
#else
  return w >> 3;
#endif
}

__host__ __device__ __forceinline__ void e2m1_pairs(uint32_t w, uint32_t (&pair)[4]) {
  constexpr uint32_t kPair = 0x8E008E00u; /* magnitude bits 9..11 and sign bit 15, both halves */
  const uint32_t e = and_opaque<0x0F0F0F0Fu>(w); /* nibbles 0, 2, 4, 6: byte k's low half */
  const uint32_t o = w - e; /* nibbles 1, 3, 5, 7, byte k's high half (a subtraction: FMA pipe) */
  pair[0] = ((e << 9) | (e << 12)) & kPair;
  pair[1] = ((o << 5) | (o << 8)) & kPair;
  pair[2] = ((e << 1) | (e << 4)) & kPair;
  pair[3] = (shr3(o) | o) & kPair;
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_KV_CACHE_E2M1_PAIRS_CUH */
