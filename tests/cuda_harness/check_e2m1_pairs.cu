/*
 * Exhaustive check of the KV-cache decode's E2M1 decoder (e2m1_pairs, csrc/cuda/kv_cache/
 * e2m1_pairs.cuh): for every 32-bit word of 8 codes and every pair position j, pair j must be
 * the exact FP16 values of codes j and j + 4 times 2^-14, with no bit of the other six codes.
 * The host emulation always runs (seconds); the device code too where a GPU is present. Build
 * and run: scripts/check_e2m1_pairs.sh.
 */
#include <cstdio>
#include <cstring>

#include "../../csrc/cuda/kv_cache/e2m1_pairs.cuh"
#include "../../csrc/include/fp4attn/numerics.h"
#include "cuda_check.h"

/* The FP16 bits of E2M1 code c times 2^-14 (a zero magnitude keeps its sign): normal from
 * 2^-14 up, else subnormal (a multiple of 2^-24). */
__host__ __device__ static uint32_t want_bits(uint32_t c) {
  const float v = fp4attn_e2m1_decode((uint8_t)(c & 7u)) * 0x1p-14f;
  const uint32_t f = fp4attn_float_bits(v);
  uint32_t mag = 0;
  if (v >= 0x1p-14f)
    mag = ((((f >> 23) & 0xFFu) - 127u + 15u) << 10) | ((f >> 13) & 0x3FFu);
  else if (v > 0.0f)
    mag = (uint32_t)(v * 0x1p24f);
  return mag | ((c & 8u) ? 0x8000u : 0u);
}

/* Mismatches of the words [first, first + count) (pair j must be the wanted bits of nibbles j and
 * j + 4, nothing else); `want` is want_bits of the 16 codes. */
__host__ __device__ static unsigned long long check_words(uint64_t first, uint64_t count,
                                                          const uint32_t *want) {
  unsigned long long bad = 0;
  for (uint64_t x = first; x < first + count; ++x) {
    const uint32_t w = (uint32_t)x;
    uint32_t pair[4];
    fp4attn_cuda::e2m1_pairs(w, pair);
    for (int j = 0; j < 4; ++j)
      bad += pair[j] != (want[(w >> (4 * j)) & 15u] | want[(w >> (4 * j + 16)) & 15u] << 16);
  }
  return bad;
}

/* Every 32-bit word: a thread per 2^16 consecutive words. */
__global__ void check_kernel(unsigned long long *bad) {
  __shared__ uint32_t want[16];
  if (threadIdx.x < 16) want[threadIdx.x] = want_bits(threadIdx.x);
  __syncthreads();
  const uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned long long b = check_words(t << 16, 1ull << 16, want);
  if (b) atomicAdd(bad, b);
}

int main(int argc, char **argv) {
  const bool device_only = argc > 1 && strcmp(argv[1], "--device") == 0;
  unsigned long long host_bad = 0;
  if (!device_only) {
    uint32_t want[16];
    for (uint32_t c = 0; c < 16; ++c) want[c] = want_bits(c);
    host_bad = check_words(0, 1ull << 32, want);
    printf("e2m1_pairs (host): all 2^32 code words x 4 pairs, %llu mismatches\n", host_bad);
  }
  unsigned long long dev_bad = 0;
  if (count_on_device(check_kernel, (1u << 16) / 256, 256, &dev_bad)) {
    printf("e2m1_pairs (device): all 2^32 code words x 4 pairs, %llu mismatches\n", dev_bad);
  } else if (device_only) {
    printf("e2m1_pairs: --device needs a GPU\n");
    return 1;
  }
  return host_bad || dev_bad ? 1 : 0;
}
