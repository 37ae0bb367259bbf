/*
 * Development timelines of kernels' work items (tools/perf/trace_sm90.cu, trace_decode.cu): a
 * kernel built with its trace flag stamps, per work item, 64-bit values into a __device__ buffer of
 * its translation unit; the harness copies the buffer out after each call (trace_take). Builds
 * without a trace flag include these helpers but call none of them.
 */
#ifndef FP4ATTN_CUDA_COMMON_TRACE_CUH
#define FP4ATTN_CUDA_COMMON_TRACE_CUH

#include <cuda_runtime.h>
#include <stdint.h>

namespace fp4attn_cuda {

#if defined(__CUDACC__)
/* The SM's cycle counter (per SM: differences within one SM only), the global timer (ns, all
 * SMs: the clock rate and cross-SM order) and the SM's index. */
__device__ __forceinline__ unsigned long long trace_cycles() {
  return clock64();
}
__device__ __forceinline__ unsigned long long trace_ns() {
  unsigned long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}
__device__ __forceinline__ unsigned long long trace_sm() {
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return sm;
}
#endif

/* Host: copies the first `rows` rows of the timeline `buf` (a __device__ array of rows, of the
 * caller's translation unit) to `host`, then clears it for the next call. Returns 0 on success. */
template <class Row, int kRows>
int trace_take(Row (&buf)[kRows], unsigned long long *host, int rows) {
  if (rows > kRows) rows = kRows;
  if (cudaMemcpyFromSymbol(host, buf, sizeof(Row) * rows) != cudaSuccess) return 1;
  void *dev = nullptr;
  if (cudaGetSymbolAddress(&dev, buf) != cudaSuccess) return 1;
  return cudaMemset(dev, 0, sizeof(buf)) == cudaSuccess ? 0 : 1;
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_COMMON_TRACE_CUH */
