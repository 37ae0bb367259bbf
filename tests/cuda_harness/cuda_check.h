/*
 * CK(call) for the GPU harnesses in this folder: on a failed CUDA runtime call, print the file,
 * line, call and error, and exit with status 2 (a harness's own mismatches exit with 1); and
 * count_on_device, their device part.
 */
#ifndef FP4ATTN_TESTS_CUDA_CHECK_H
#define FP4ATTN_TESTS_CUDA_CHECK_H

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(2);                                                                           \
    }                                                                                    \
  } while (0)

/* Runs kernel<<<blocks, threads>>>(counter), counter zeroed first, on the current GPU and stores
 * the mismatches it counted in *bad. Returns false, running nothing, where no GPU is present. */
template <typename Kernel>
inline bool count_on_device(Kernel kernel, unsigned blocks, unsigned threads,
                            unsigned long long *bad) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return false;
  unsigned long long *d = nullptr;
  CK(cudaMalloc(&d, sizeof(*d)));
  CK(cudaMemset(d, 0, sizeof(*d)));
  kernel<<<blocks, threads>>>(d);
  CK(cudaGetLastError());
  CK(cudaMemcpy(bad, d, sizeof(*bad), cudaMemcpyDeviceToHost));
  CK(cudaFree(d));
  return true;
}

#endif /* FP4ATTN_TESTS_CUDA_CHECK_H */
