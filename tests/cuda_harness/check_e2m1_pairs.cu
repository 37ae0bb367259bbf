/*
 * Exhaustive check of the KV-cache decode's E2M1 decoder (e2m1_pairs, csrc/cuda/decode/
 * e2m1_pairs.cuh): for every pair position j and every 8-bit (nibble j,
 * nibble j + 4) combination, over many backgrounds of the other six nibbles, pair j must be the
 * exact FP16 values of both codes times 2^-14 and no other nibble may leak in. The host emulation
 * always runs; the device code too where a GPU is present. Build and run:
 * scripts/check_e2m1_pairs.sh.
 */
#include <cstdio>
#include <cstring>

#include "../../csrc/cuda/decode/e2m1_pairs.cuh"
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

__host__ __device__ static unsigned long long check_background(uint32_t bg) {
  unsigned long long bad = 0;
  for (int j = 0; j < 4; ++j)
    for (uint32_t c = 0; c < 256; ++c) {
      const uint32_t lo = c & 15u, hi = c >> 4;
      uint32_t w = bg & ~((0xFu << (4 * j)) | (0xFu << (4 * j + 16)));
      w |= lo << (4 * j) | hi << (4 * j + 16);
      uint32_t pair[4];
      fp4attn_cuda::e2m1_pairs(w, pair);
      bad += pair[j] != (want_bits(lo) | want_bits(hi) << 16);
    }
  return bad;
}

/* Backgrounds: a simple generator over 2^16 words per thread index. */
__host__ __device__ static uint32_t background(uint32_t i) {
  uint32_t x = i * 0x9E3779B9u + 0x7F4A7C15u;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  return x ^ (x >> 12);
}

__global__ void check_kernel(unsigned long long *bad, uint32_t n) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const unsigned long long b = check_background(background(i));
  if (b) atomicAdd(bad, b);
}

int main(int argc, char **argv) {
  const bool device_only = argc > 1 && strcmp(argv[1], "--device") == 0;
  const uint32_t backgrounds = 1u << 12;
  unsigned long long host_bad = 0;
  if (!device_only) {
    for (uint32_t i = 0; i < backgrounds; ++i) host_bad += check_background(background(i));
    host_bad += check_background(0) + check_background(0xFFFFFFFFu);
    printf(
        "e2m1_pairs (host): 4 positions x 256 codes x %u backgrounds, %llu "
        "mismatches\n",
        backgrounds + 2, host_bad);
  }
  int devices = 0;
  unsigned long long dev_bad = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    unsigned long long *d = nullptr;
    CK(cudaMalloc(&d, sizeof(*d)));
    CK(cudaMemset(d, 0, sizeof(*d)));
    const uint32_t n = 1u << 16;
    check_kernel<<<n / 256, 256>>>(d, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(&dev_bad, d, sizeof(dev_bad), cudaMemcpyDeviceToHost));
    printf("e2m1_pairs (device): %u backgrounds, %llu mismatches\n", n, dev_bad);
  } else if (device_only) {
    printf("e2m1_pairs: --device needs a GPU\n");
    return 1;
  }
  return host_bad || dev_bad ? 1 : 0;
}
