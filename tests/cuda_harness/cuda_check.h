/*
 * CK(call) for the GPU harnesses in this folder: on a failed CUDA runtime call, print the file,
 * line, call and error, and exit with status 2 (a harness's own mismatches exit with 1).
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

#endif /* FP4ATTN_TESTS_CUDA_CHECK_H */
