/*
 * K5 key codes (SPEC 6) to exact 16-bit pairs in registers, for the KV-cache decode (decode.cu).
 * A code word w holds the low nibbles of 8 codes u = q + 15 (nibble n at bits 4n..4n+3), a plane
 * byte hb their high bits (bit n); pair j (j = 0..3) holds code j in its low half and code j + 4
 * in its high half, as the FP16 value q.
 *
 * 0x6400 | u is the FP16 bits of 1024 + u (u < 1024: FP16's unit in the last place at 1024 is 1),
 * so a pair is built from a nibble part and a high-bit part in disjoint bits, ORed, then one
 * HSUB2 by (1039, 1039) gives u - 15 = q exactly:
 *  - k5_nibble_pairs: the even nibbles (e) and the odd ones (o) each in their own bytes, then one
 *    prmt per pair puts nibble j's byte under the byte 0x64 in the low half and nibble j + 4's in
 *    the high half (bits 0..3 and 16..19, with 0x64 in bits 8..15 and 24..31);
 *  - k5_high_pairs: one multiply moves bit j of hb to bit 4 and bit j + 4 to bit 20 (hb << (4 - j)
 *    spans bits 4 - j .. 11 - j, hb << (16 - j) bits 16 - j .. 23 - j: no carries between them),
 *    one AND keeps those two bits.
 * Each part is exhaustively checked alone (tests/cuda_harness/check_k5_pairs.cu: every word, every
 * plane byte, that each part is exactly its field, and every code x scale product); the pair is
 * their OR. A multiply by the E4M3 scale as FP16 (times 2^-8, k5_scale_pair) stays exact.
 */
#ifndef FP4ATTN_CUDA_KV_CACHE_K5_PAIRS_CUH
#define FP4ATTN_CUDA_KV_CACHE_K5_PAIRS_CUH

#include <cstdint>

#include "e2m1_pairs.cuh"

namespace fp4attn_cuda {

/* The FP16 pair (1039, 1039) = (1024 + 15) twice: subtracted, u becomes q. */
constexpr uint32_t kK5Offset = 0x640F640Fu;

/* Pair j's nibble part: (0x6400 | nibble j) low, (0x6400 | nibble j + 4) high. */
__host__ __device__ __forceinline__ void k5_nibble_pairs(uint32_t w, uint32_t (&pair)[4]) {
  const uint32_t e = w & 0x0F0F0F0Fu;        /* byte k: nibble 2k */
  const uint32_t o = (w >> 4) & 0x0F0F0F0Fu; /* byte k: nibble 2k + 1 */
  constexpr uint32_t k64 = 0x64646464u;      /* prmt's bytes 4..7 */
  pair[0] = prmt_b32(e, k64, 0x4240u);       /* nibbles 0, 4 */
  pair[1] = prmt_b32(o, k64, 0x4240u);       /* nibbles 1, 5 */
  pair[2] = prmt_b32(e, k64, 0x4341u);       /* nibbles 2, 6 */
  pair[3] = prmt_b32(o, k64, 0x4341u);       /* nibbles 3, 7 */
}

/* Pair j's high-bit part: bit j of hb (< 256) at bit 4, bit j + 4 at bit 20. */
template <int J>
__host__ __device__ __forceinline__ uint32_t k5_high_pair(uint32_t hb) {
  return (hb * ((1u << (4 - J)) | (1u << (16 - J)))) & 0x00100010u;
}

/* The four pairs of a code word and its plane byte, as FP16 bits of 1024 + u (h2_sub of
 * kK5Offset makes them q). */
__host__ __device__ __forceinline__ void k5_pairs(uint32_t w, uint32_t hb, uint32_t (&pair)[4]) {
  k5_nibble_pairs(w, pair);
  pair[0] |= k5_high_pair<0>(hb);
  pair[1] |= k5_high_pair<1>(hb);
  pair[2] |= k5_high_pair<2>(hb);
  pair[3] |= k5_high_pair<3>(hb);
}

/* A K5 scale byte (sign clear in SPEC 6) in both halves as FP16 bits: s x 2^-8 exactly (an E4M3
 * byte's exponent and mantissa bits read as FP16 bits 7 places up, subnormals included). */
__host__ __device__ __forceinline__ uint32_t k5_scale_pair(uint32_t byte) {
  return byte * 0x00800080u;
}

#ifdef __CUDACC__
/* a - b on two FP16 lanes (round to nearest; exact for 1024 + u - 1039). */
__device__ __forceinline__ uint32_t h2_sub(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
#endif

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_KV_CACHE_K5_PAIRS_CUH */
