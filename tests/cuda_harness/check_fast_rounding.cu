/*
 * Exhaustive check of the E2M1 rounding of the CUDA attention kernels' P path (e2m1_pair_sat6,
 * csrc/cuda/common/device.cuh) against numerics.h: for every float y >= 0 (and +inf, and NaN -> 6),
 * the result is value(fp4attn_e2m1_encode(y)) saturated at 6, except at the 7 exact ties, which
 * round up. The host emulation is checked (no GPU needed; .ci/run, ~2 minutes) and, where a GPU is
 * present, the device instruction sequence of the GPU's architecture (a second; it must be built
 * for sm_80 and sm_90, which take different min/max instructions). --device: the device only.
 * Build and run: scripts/check_fast_rounding.sh [--device] (.ci/run, scripts/gpu_check.sh).
 */
#include <cstdio>
#include <cstring>

#include "../../csrc/cuda/common/device.cuh"

/* The expected FP16 bits of the rounding of y (see the file comment). */
__host__ __device__ static uint16_t expected_bits(float y) {
  const float ties[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const float up[7] = {0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  float v = y != y ? 6.0f : fp4attn_e2m1_decode(fp4attn_e2m1_encode(y));
  for (int i = 0; i < 7; ++i)
    if (y == ties[i]) v = up[i];
  return __half_as_ushort(__float2half_rn(v));
}

/* Mismatches among the floats with bits lo .. hi (the pair (y, y') with y' the next float). */
__host__ __device__ static unsigned long long check_range(uint32_t lo, uint32_t hi) {
  unsigned long long bad = 0;
  for (uint32_t u = lo; u <= hi && u >= lo; u += 2) {
    const float y0 = fp4attn_bits_float(u), y1 = fp4attn_bits_float(u + 1 <= hi ? u + 1 : u);
    const uint32_t r = fp4attn_cuda::e2m1_pair_sat6(y0, y1);
    bad += (r & 0xFFFFu) != expected_bits(y0);
    bad += (r >> 16) != expected_bits(y1);
  }
  return bad;
}

constexpr uint32_t kLast = 0x7FC00000u; /* +0 .. +inf, and the canonical NaN */

__global__ void check_kernel(unsigned long long *bad) {
  const uint64_t per = 1u << 12; /* floats per thread (even) */
  const uint64_t lo = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) * per;
  if (lo > kLast) return;
  const uint64_t hi = lo + per - 1 < kLast ? lo + per - 1 : kLast;
  const unsigned long long n = check_range((uint32_t)lo, (uint32_t)hi);
  if (n) atomicAdd(bad, n);
}

int main(int argc, char **argv) {
  const bool device_only = argc > 1 && strcmp(argv[1], "--device") == 0;
  unsigned long long host_bad = 0;
  if (!device_only) {
    host_bad = check_range(0, kLast);
    printf("e2m1_pair_sat6 (host): every float in [+0, +inf] and NaN checked, %llu mismatches\n",
           host_bad);
  }
  int devices = 0;
  unsigned long long dev_bad = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    unsigned long long *d = nullptr;
    cudaMalloc(&d, sizeof(*d));
    cudaMemset(d, 0, sizeof(*d));
    const uint64_t threads = ((uint64_t)kLast + (1u << 12)) >> 12;
    check_kernel<<<(unsigned)((threads + 255) / 256), 256>>>(d);
    const cudaError_t err = cudaMemcpy(&dev_bad, d, sizeof(dev_bad), cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) {
      printf("device check failed: %s\n", cudaGetErrorString(err));
      return 1;
    }
    printf("e2m1_pair_sat6 (device): every float in [+0, +inf] and NaN checked, %llu mismatches\n",
           dev_bad);
  } else {
    printf("no GPU: device check skipped\n");
    if (device_only) return 1;
  }
  return host_bad || dev_bad ? 1 : 0;
}
