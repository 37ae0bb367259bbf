/*
 * Exhaustive check of the KV-cache decode's K5 decoder (csrc/cuda/kv_cache/k5_pairs.cuh):
 *  1. k5_nibble_pairs, every 32-bit word: pair j is exactly 0x6400 | nibble j (low half) and
 *     0x6400 | nibble j + 4 (high half), no bit of the other six nibbles;
 *  2. k5_high_pair<j>, every plane byte: exactly bit j at bit 4 and bit j + 4 at bit 20 (so the
 *     OR of 1 and 2 is 0x6400 | u in each half, u = nibble | high bit << 4);
 *  3. every u in 0..30 and E4M3 scale byte 0..126: h2_sub(0x6400 | u, kK5Offset) is the FP16 of
 *     q = u - 15, and q times k5_scale_pair(byte) is exactly q x s x 2^-8 (device: the decode's
 *     own instructions; host: that the FP16 bits are those values and the product is a FP16
 *     value, so a correctly rounded multiply returns it).
 * The host part always runs (seconds); the device code too where a GPU is present. Build and run:
 * scripts/check_k5_pairs.sh.
 */
#include <cmath>
#include <cstdio>
#include <cstring>

#include "../../csrc/cuda/kv_cache/k5_pairs.cuh"
#include "../../csrc/include/fp4attn/numerics.h"
#include "cuda_check.h"

using fp4attn_cuda::k5_high_pair;
using fp4attn_cuda::k5_nibble_pairs;
using fp4attn_cuda::k5_scale_pair;
using fp4attn_cuda::kK5Offset;

__host__ __device__ static unsigned long long check_words(uint64_t first, uint64_t count) {
  unsigned long long bad = 0;
  for (uint64_t x = first; x < first + count; ++x) {
    const uint32_t w = (uint32_t)x;
    uint32_t pair[4];
    k5_nibble_pairs(w, pair);
    for (int j = 0; j < 4; ++j)
      bad += pair[j] !=
             ((0x6400u | ((w >> (4 * j)) & 15u)) | (0x6400u | ((w >> (4 * j + 16)) & 15u)) << 16);
  }
  return bad;
}

template <int J>
__host__ __device__ static unsigned long long check_high_j() {
  unsigned long long bad = 0;
  for (uint32_t hb = 0; hb < 256; ++hb)
    bad += k5_high_pair<J>(hb) != (((hb >> J) & 1u) << 4 | ((hb >> (J + 4)) & 1u) << 20);
  return bad;
}
__host__ __device__ static unsigned long long check_high() {
  return check_high_j<0>() + check_high_j<1>() + check_high_j<2>() + check_high_j<3>();
}

/* The value of FP16 bits h (finite), exactly. */
__host__ __device__ static double half_value(uint32_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const double v = e ? ldexp(1024.0 + m, e - 25) : ldexp((double)m, -24);
  return (h & 0x8000u) ? -v : v;
}
/* Whether v is exactly an FP16 value (finite, |v| <= 65504). */
__host__ __device__ static bool is_half(double v) {
  const double a = fabs(v);
  if (a > 65504.0) return false;
  if (a < ldexp(1.0, -14)) return ldexp(a, 24) == floor(ldexp(a, 24));
  int e;
  frexp(a, &e); /* a = f 2^e, f in [0.5, 1): 11 significant bits */
  return ldexp(a, 11 - e) == floor(ldexp(a, 11 - e));
}

/* Mismatches of item 3 for u, scale byte c: `q_bits` and `prod_bits` are what the decode's
 * instructions give (device), or 0xFFFFFFFF to check representability only (host). */
__host__ __device__ static unsigned long long check_value(uint32_t u, uint32_t c, uint32_t q_bits,
                                                          uint32_t prod_bits) {
  const double q = (double)u - 15.0;
  const double s = (double)fp4attn_e4m3_decode((uint8_t)c);
  const double want = q * s / 256.0;
  unsigned long long bad = 0;
  bad += half_value(0x6400u | u) != 1024.0 + u;     /* the pair's bits */
  bad += half_value(kK5Offset & 0xFFFFu) != 1039.0; /* the offset */
  bad += half_value(k5_scale_pair(c) & 0xFFFFu) != s / 256.0;
  bad += (k5_scale_pair(c) >> 16) != (k5_scale_pair(c) & 0xFFFFu);
  bad += !is_half(q) || !is_half(want); /* so correctly rounded ops are exact */
  if (q_bits != 0xFFFFFFFFu) {
    bad += half_value(q_bits & 0xFFFFu) != q || half_value(q_bits >> 16) != q;
    bad += half_value(prod_bits & 0xFFFFu) != want || half_value(prod_bits >> 16) != want;
  }
  return bad;
}

#ifdef __CUDACC__
__device__ static uint32_t h2_mul_dev(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
#endif

__global__ void check_kernel(unsigned long long *bad) {
  const uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned long long b = check_words(t << 16, 1ull << 16);
  if (t == 0) b += check_high();
  if (t < 31 * 127) {
    const uint32_t u = (uint32_t)t % 31, c = (uint32_t)t / 31;
    const uint32_t q = fp4attn_cuda::h2_sub((0x6400u | u) * 0x10001u, kK5Offset);
    b += check_value(u, c, q, h2_mul_dev(q, k5_scale_pair(c)));
  }
  if (b) atomicAdd(bad, b);
}

int main(int argc, char **argv) {
  const bool device_only = argc > 1 && strcmp(argv[1], "--device") == 0;
  unsigned long long host_bad = 0;
  if (!device_only) {
    host_bad = check_words(0, 1ull << 32) + check_high();
    for (uint32_t u = 0; u < 31; ++u)
      for (uint32_t c = 0; c < 127; ++c) host_bad += check_value(u, c, 0xFFFFFFFFu, 0);
    printf(
        "k5_pairs (host): all 2^32 code words x 4 pairs, 256 plane bytes x 4, 31 codes x 127 "
        "scales: %llu mismatches\n",
        host_bad);
  }
  unsigned long long dev_bad = 0;
  if (count_on_device(check_kernel, (1u << 16) / 256, 256, &dev_bad)) {
    printf("k5_pairs (device): the same on the GPU's instructions, %llu mismatches\n", dev_bad);
  } else if (device_only) {
    printf("k5_pairs: --device needs a GPU\n");
    return 1;
  }
  return host_bad || dev_bad ? 1 : 0;
}
