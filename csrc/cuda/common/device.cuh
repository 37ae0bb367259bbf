/*
 * Shared device helpers of the CUDA backend (sm_80 and newer): status construction, dtype
 * conversion, tensor-core fragments (ldmatrix, mma.sync m16n8k16), cp.async, the fast
 * non-negative E2M1 rounding used for P (e2m1_pair_sat6), and the cached SM count.
 *
 * Every rounding that must be bit-exact with the CPU backend goes through numerics.h or through
 * a helper proven equal to it (fast_rounding.cuh). P's rounding (SPEC 4 asks rel_l1, not bits) may
 * differ at exact ties: e2m1_pair_sat6.
 */
#ifndef FP4ATTN_CUDA_COMMON_DEVICE_CUH
#define FP4ATTN_CUDA_COMMON_DEVICE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include <map>
#include <mutex>
#include <utility>

#include "fp4attn/checks.h"
#include "fp4attn/fp4attn.h"
#include "fp4attn/numerics.h"

namespace fp4attn_cuda {

constexpr float kLog2e = 1.4426950408889634f; /* log2(e) */
constexpr float kLn2 = 0.69314718055994531f;  /* ln(2) */

/* An additive attn_mask value in the kernels' log2 units: m log2(e), with a finite m kept finite.
 * m below -FLT_MAX / log2(e) (torch.finfo(float32 or bfloat16).min, transformers' "hidden") would
 * overflow to -inf and hide a key the specs count as seen: a row with only such keys averages V
 * in torch and the C backend, and would give 0 here. */
__device__ __forceinline__ float mask_log2(float m) {
  const float r = m * kLog2e;
  return isinf(r) && !isinf(m) ? copysignf(3.402823466e+38f, r) : r;
}

/* ---------------------------------------------------------------------------------- status */

/* Status of the last launch (cudaGetLastError also clears a sticky launch error). */
static inline fp4attn_status launch_status(const char *what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return fp4attn_error(FP4ATTN_ERR_CUDA, "%s: CUDA error %s (%s)", what, cudaGetErrorName(e),
                         cudaGetErrorString(e));
  return fp4attn_ok();
}

/* Multiprocessor count of the current device, cached per device (read once, never assumed). */
static inline int sm_count() {
  static int cache[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  if (dev < 0 || dev >= 64) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 1;
  }
  if (cache[dev] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    cache[dev] = n > 0 ? n : 1;
  }
  return cache[dev];
}

/* Compute capability of the current device as 10 * major + minor (90 for H100/H200), cached per
 * device; 0 if it cannot be read. */
static inline int device_capability() {
  static int cache[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev < 0 || dev >= 64) return 0;
  if (cache[dev] == 0) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    cache[dev] = 10 * major + minor;
  }
  return cache[dev];
}

/* Division of 32-bit unsigned integers by a divisor fixed on the host (Granlund-Montgomery): a
 * multiply-high, two adds and two shifts instead of a division's ~25 instructions. */
struct DivU32 {
  uint32_t m = 1; /* the multiplier; the default divides by 1 */
  int s1 = 0, s2 = 0;
  DivU32() = default;
  explicit DivU32(uint32_t divisor) {
    int l = 0;
    while (l < 32 && (1ull << l) < divisor) ++l; /* ceil(log2 d) */
    m = (uint32_t)(((1ull << 32) * ((1ull << l) - divisor)) / divisor + 1);
    s1 = l < 1 ? l : 1, s2 = l > 1 ? l - 1 : 0;
  }
#ifdef __CUDACC__
  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    const uint32_t t = __umulhi(m, n);
    return (t + ((n - t) >> s1)) >> s2;
  }
#endif
};

static inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}
static inline int64_t round_up(int64_t a, int64_t b) {
  return ceil_div(a, b) * b;
}

/* Rows of d elements at ptr with these (batch, head, token) strides allow 16-byte vector access
 * in groups of 8 elements (any dtype: 8 x 2 bytes, or two 16-byte halves of 8 floats). */
static inline bool vector_rows(const void *ptr, const int64_t *stride, int64_t d) {
  return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0 && d % 8 == 0 && stride[0] % 8 == 0 &&
         stride[1] % 8 == 0 && stride[2] % 8 == 0;
}

__host__ __device__ inline int64_t dtype_size(fp4attn_dtype d) {
  return d == FP4ATTN_FLOAT32 ? 4 : 2;
}
/* fp4attn_code_bytes / fp4attn_scale_count of fp4attn.h, callable on the device too */
__host__ __device__ inline int64_t fp4_code_bytes(int64_t cols) {
  return (cols + 15) / 16 * 8;
}
__host__ __device__ inline int64_t fp4_scale_count(int64_t cols) {
  return (cols + 15) / 16;
}

/* ---------------------------------------------------------------------- dtype conversions */

/* An FP16 or BF16 value given as its 16 bits (in the low half of `bits`), as float. */
__device__ __forceinline__ float bits16_as_float(uint32_t bits, bool bf16) {
  return bf16 ? __uint_as_float(bits << 16) : __half2float(__ushort_as_half((uint16_t)bits));
}

__device__ __forceinline__ float load_as_float(const void *base, fp4attn_dtype dt, int64_t i) {
  if (dt == FP4ATTN_FLOAT16) return __half2float(static_cast<const __half *>(base)[i]);
  if (dt == FP4ATTN_BFLOAT16) return __bfloat162float(static_cast<const __nv_bfloat16 *>(base)[i]);
  return static_cast<const float *>(base)[i];
}

__device__ __forceinline__ void store_from_float(void *base, fp4attn_dtype dt, int64_t i, float v) {
  if (dt == FP4ATTN_FLOAT16)
    static_cast<__half *>(base)[i] = __float2half_rn(v);
  else if (dt == FP4ATTN_BFLOAT16)
    static_cast<__nv_bfloat16 *>(base)[i] = __float2bfloat16_rn(v);
  else
    static_cast<float *>(base)[i] = v;
}

/* Two adjacent elements (i, i+1); `aligned` says the pair may be written as one word. */
__device__ __forceinline__ void store2_from_float(void *base, fp4attn_dtype dt, int64_t i, float a,
                                                  float b, bool aligned) {
  if (aligned) {
    if (dt == FP4ATTN_FLOAT16) {
      *reinterpret_cast<__half2 *>(static_cast<__half *>(base) + i) = __floats2half2_rn(a, b);
      return;
    }
    if (dt == FP4ATTN_BFLOAT16) {
      *reinterpret_cast<__nv_bfloat162 *>(static_cast<__nv_bfloat16 *>(base) + i) =
          __floats2bfloat162_rn(a, b);
      return;
    }
    *reinterpret_cast<float2 *>(static_cast<float *>(base) + i) = make_float2(a, b);
    return;
  }
  store_from_float(base, dt, i, a);
  store_from_float(base, dt, i + 1, b);
}

/* 8 consecutive elements as float. `vec` requires 16-byte alignment of element i (fp16/bf16)
 * or of elements i and i+4 (fp32). */
__device__ __forceinline__ void load8_as_float(const void *base, fp4attn_dtype dt, int64_t i,
                                               bool vec, float *out) {
  if (vec) {
    if (dt == FP4ATTN_FLOAT32) {
      const float4 a = *reinterpret_cast<const float4 *>(static_cast<const float *>(base) + i);
      const float4 b = *reinterpret_cast<const float4 *>(static_cast<const float *>(base) + i + 4);
      out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
      out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
      return;
    }
    const uint4 u = *reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(base) + i);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (dt == FP4ATTN_FLOAT16) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&w[k]));
        out[2 * k] = f.x, out[2 * k + 1] = f.y;
      } else {
        out[2 * k] = __uint_as_float(w[k] << 16);
        out[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
      }
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) out[k] = load_as_float(base, dt, i + k);
}

/* Elements col .. col+7 of a row starting at element `row` as float, zeros from column D on;
 * 16-byte loads when `vec` (load8_as_float's alignment) and all 8 are inside the row. */
__device__ __forceinline__ void load8_padded(const void *base, fp4attn_dtype dt, int64_t row,
                                             int col, int D, bool vec, float *out) {
  if (vec && col + 8 <= D) {
    load8_as_float(base, dt, row + col, true, out);
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = col + e < D ? load_as_float(base, dt, row + col + e) : 0.0f;
}

/* Columns kb*16 .. kb*16+15 of the row at element `row` of x, smoothed and scaled for phi
 * (SPEC 4.1-4.3: (x - mean) * enc, two roundings), zeros from column D on. mean: the 16 means of
 * these columns (any memory; registers when the caller holds them). */
__device__ __forceinline__ void smoothed_block16(const void *x, fp4attn_dtype dt, int64_t row,
                                                 int kb, int D, bool vec, const float *mean,
                                                 float enc, float (&xs)[16]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int c0 = kb * 16 + half * 8;
    float v[8];
    load8_padded(x, dt, row, c0, D, vec, v);
#pragma unroll
    for (int e = 0; e < 8; ++e)
      xs[half * 8 + e] = c0 + e < D ? __fmul_rn(__fsub_rn(v[e], mean[half * 8 + e]), enc) : 0.0f;
  }
}

/* ------------------------------------------------------------------------ FP4 helpers */

/* rne_e2m1 (SPEC 1) of two floats y0, y1 >= 0, saturated at 6, as the FP16 pair of the
 * rounded values (y0 in the low half), in packed FP16 arithmetic (2 values per instruction):
 *  1. h = y rounded toward zero to FP16 (above 65504: 65504), then min(h, 6), then h's last bit
 * set. Every E2M1 rounding tie (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) is an FP16 value whose last
 * bit is 0, so h lies on the same side of every tie as y, or just above a tie that y is exactly.
 *     (Rounding to nearest FP16 instead would move the values within half an FP16 unit of a tie
 *     onto it.)
 *  2. With 2^e the power of two at or below max(h, 1), h + 2^(e+9) is an FP16 value whose unit in
 *     the last place is the E2M1 spacing of h's binade (0.5 below 2, 1 in [2, 4), 2 in [4, 8)); its
 *     rounding to nearest even (an FMA) puts h on the grid, and subtracting 2^(e+9) is exact.
 * The result is value(fp4attn_e2m1_encode(y)) for every float y >= 0 except the 7 ties themselves,
 * which round up instead of to even (NaN gives 6): a Pq/s exactly on a tie needs exp2 to land on
 * one of 7 values, and the approximate exp2 already moves Pq/s by a few units in the last place.
 * tests/cuda_harness/check_fast_rounding.cu checks every float, on the host (CI) and the GPU.
 * The min and max run as 16-bit integer operations on sm_90 (non-negative FP16 values order like
 * their bits): VIMNMX.U16x2, which issues faster than the FP16 HMNMX2. */
__host__ __device__ __forceinline__ uint32_t e2m1_pair_sat6(float y0, float y1) {
#if defined(__CUDA_ARCH__)
  uint32_t h, m, p2, t, r;
  asm("cvt.rz.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(y1), "f"(y0)); /* first operand: high half */
#if __CUDA_ARCH__ >= \
    900 /* non-negative FP16 values (NaN above +inf) order like unsigned integers */
#define FP4ATTN_MINMAX_TYPE "u16x2"
#else
#define FP4ATTN_MINMAX_TYPE "f16x2"
#endif
  asm("min." FP4ATTN_MINMAX_TYPE " %0, %1, %2;" : "=r"(m) : "r"(h), "r"(0x46004600u)); /* 6 */
  m |= 0x00010001u;
  asm("max." FP4ATTN_MINMAX_TYPE " %0, %1, %2;" : "=r"(p2) : "r"(m), "r"(0x3C003C00u)); /* 1 */
#undef FP4ATTN_MINMAX_TYPE
  p2 &= 0x7C007C00u;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(t) : "r"(p2), "r"(0x60006000u), "r"(m)); /* 512 */
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(p2), "r"(0xE000E000u), "r"(t)); /* -512 */
  return r;
#else
  /* the same steps on the host, one value at a time, in exact double arithmetic */
  const auto one = [](float y) -> uint32_t {
    double h; /* step 1: toward zero onto the FP16 grid (spacing 2^-24 below 2^-14), at most 6 (NaN:
                 6, as the device's min) */
    if (!(y < 6.0f)) {
      h = 6.0;
    } else {
      const int e = y < 0x1p-14f ? -14 : (int)((fp4attn_float_bits(y) >> 23) & 0xFF) - 127;
      const double ulp = ldexp(1.0, e - 10);
      h = floor((double)y / ulp) * ulp;
      if (fmod(h / ulp, 2.0) == 0.0) h += ulp; /* the last bit set */
    }
    const double p2 = h < 1.0 ? 1.0 : ldexp(1.0, ilogb(h));
    const double spacing = p2 / 2; /* of FP16 at 512 p2, and of E2M1 in h's binade */
    const double r =
        nearbyint(h / spacing) * spacing; /* (512 p2 + h) to nearest even, minus 512 p2 */
    return __half_as_ushort(__double2half(r));
  };
  return one(y0) | (one(y1) << 16);
#endif
}

/* rne_e4m3_sat (SPEC 1) of a finite v >= 0 as the E4M3 byte: the hardware conversion on sm_89+
 * (cvt.rn.satfinite.e4m3x2.f32, which SPEC 1 names as the definition; checked against
 * fp4attn_e4m3_encode_sat for every float by tests/cuda_harness/check_prepass.cu), numerics.h
 * before. */
__device__ __forceinline__ uint8_t e4m3_encode_fast(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
#else
  return fp4attn_e4m3_encode_sat(v);
#endif
}

/* -------------------------------------------------------------- tensor-core primitives */

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                            uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

/* A hint to bring the 128-byte line holding global address `gmem` into L2 (no register waits). */
__device__ __forceinline__ void prefetch_l2(const void *gmem) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(gmem));
}
/* A counter in global memory that other blocks update: read with acquire, add with release (GPU
 * scope). */
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned *at) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(at) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_gpu_add(unsigned *at, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(at), "r"(v) : "memory");
}

/* D = A(16x16, row) * B(16x8, col) + D, FP16 (or, kBf16, BF16) operands, FP32 accumulation. */
#define FP4ATTN_MMA_16816(T)                                    \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." T "." T \
               ".f32 {%0,%1,%2,%3}, "                           \
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"       \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <bool kBf16 = false>
__device__ __forceinline__ void mma_16816(float *d, const uint32_t *a, uint32_t b0, uint32_t b1) {
  if (kBf16)
    FP4ATTN_MMA_16816("bf16");
  else
    FP4ATTN_MMA_16816("f16");
}
#undef FP4ATTN_MMA_16816

__device__ __forceinline__ void cp_async_16(void *smem, const void *gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
/* cp_async_16 that copies `src_bytes` (0 or 16) bytes and zero-fills the rest of the 16: a zero
 * chunk for padding without a branch around the copy (gmem must be a valid address either way). */
__device__ __forceinline__ void cp_async_16_zfill(void *smem, const void *gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::);
}
/* Waits until at most N of this thread's cp.async groups are in flight. */
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* The transpose of an 8x8 16-bit matrix held as an m16n8k16 accumulator half (lane (g, t4): row
 * g, columns 2 t4 and 2 t4 + 1 packed) in the same layout: row g of the result is column g. */
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}
__device__ __forceinline__ uint32_t pack_half2(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t *>(&h);
}

/* exp2 and log2 by the SFU (ex2/lg2.approx: a few units in the last place; subnormals flushed). */
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/* The maximum of x over a block of W warps, for every thread (fmaxf: NaN operands are dropped);
 * scratch: W floats of shared memory. Every thread of the block must call it (one barrier). */
template <int W>
__device__ __forceinline__ float block_max(float x, float *scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < W; ++w) x = fmaxf(x, scratch[w]);
  return x;
}

/* a * b, min, max on two FP16 lanes (round to nearest; subnormals kept). */
__device__ __forceinline__ uint32_t h2_mul(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
/* ------------------------------------------------------- programmatic dependent launch */

/* A kernel launched by launch_dependent may start before the stream's previous kernel ends, so it
 * calls grid_dependency_wait() before it reads anything that kernel writes (the wait returns once
 * that kernel has completed and its writes are visible). The previous kernel lets it launch once
 * all its blocks have called grid_dependents_launch() (or exited). Both are no-ops below sm_90. */
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
/* A chain's middle link (a dependent that has dependents): wait for the kernel before, then let
 * the next one launch. Called by every block, so the chain's last kernel ends after all links. */
__device__ __forceinline__ void grid_dependency_handoff() {
  grid_dependency_wait();
  grid_dependents_launch();
}
/* Whether `kernel` may launch as a programmatic dependent on the current device: a GPU of compute
 * capability 9.0 or newer running code built from PTX for sm_90 or newer (the compute_80 PTX that
 * a newer GPU may JIT-compile has no grid_dependency_wait()), with a runtime whose graph capture
 * keeps programmatic edges (12.3). Asked once per kernel and device; never when an earlier error
 * is pending, and a failed query leaves no error behind. */
static inline bool dependent_launch_ok(const void *kernel) {
#if CUDART_VERSION >= 12030
  static std::mutex mu;
  static std::map<std::pair<const void *, int>, bool> known;
  int dev = 0;
  if (cudaPeekAtLastError() != cudaSuccess || cudaGetDevice(&dev) != cudaSuccess) return false;
  std::lock_guard<std::mutex> lock(mu);
  const auto it = known.find({kernel, dev});
  if (it != known.end()) return it->second;
  cudaFuncAttributes fa;
  const bool sm90_code = cudaFuncGetAttributes(&fa, kernel) == cudaSuccess && fa.ptxVersion >= 90;
  const bool ok = sm90_code && device_capability() >= 90;
  if (cudaPeekAtLastError() != cudaSuccess) cudaGetLastError(); /* the query's own error */
  known[{kernel, dev}] = ok;
  return ok;
#else
  (void)kernel;
  return false;
#endif
}
/* kernel<<<grid, block, smem, s>>>(args...), as a programmatic dependent of the stream's previous
 * kernel where dependent_launch_ok (else, or if the runtime refuses the attribute, plainly). */
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t s, Args &&...args) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = s;
  cfg.attrs = &attr;
  cfg.numAttrs = dependent_launch_ok(reinterpret_cast<const void *>(kernel)) ? 1 : 0;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (e != cudaSuccess && cfg.numAttrs == 1) { /* nothing was pending (dependent_launch_ok) */
    cudaGetLastError();
    cfg.numAttrs = 0;
    e = cudaLaunchKernelEx(&cfg, kernel, args...);
  }
  return e;
}

__device__ __forceinline__ uint32_t h2_min(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("min.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t h2_max(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

/* Unsigned-bits maximum of non-negative floats; NaN (0x7FC00000 after clearing the sign) is
 * larger than +Inf, so a NaN anywhere wins, like fp4attn_nanmax. */
__device__ __forceinline__ void atomic_amax(float *addr, float v) {
  atomicMax(reinterpret_cast<unsigned int *>(addr), fp4attn_float_bits(v) & 0x7FFFFFFFu);
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_COMMON_DEVICE_CUH */
