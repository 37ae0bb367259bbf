/*
 * The TMA tensor maps of the Hopper kernel, encoded on the host for each call (tensor_maps.cu);
 * host only, no stream work (fine under CUDA-graph capture).
 */
#ifndef FP4ATTN_CUDA_SM90_TENSOR_MAPS_H
#define FP4ATTN_CUDA_SM90_TENSOR_MAPS_H

#include <cuda.h> /* CUtensorMap (the driver entry point is looked up at run time: no -lcuda) */
#include <cudaTypedefs.h>

#include "../tile/workspace.cuh"

namespace fp4attn_cuda {
namespace sm90 {

/* The maps of K^ and V^ in the workspace: 3-D, boxes of 64 columns (128 bytes) with the 128-byte
 * swizzle, so a box lands as one column block of the wgmma layout. */
fp4attn_status encode_tensor_maps(const AttnArgs &a, int64_t dp, CUtensorMap &kmap,
                                  CUtensorMap &vmap);
/* The map of 16-bit Q with 16-byte aligned rows in the caller's strides (boxes of dp x 128 rows);
 * false where the driver does not take its strides (e.g. a broadcast head): the kernel then
 * copies Q row by row. */
bool encode_q_map(const AttnArgs &a, int64_t dp, CUtensorMap &qmap);
/* A 3-D map of bytes (the 8-bit kernels' codes in their workspace): dims innermost first, the byte
 * strides of the outer two, boxes of inner x rows x 1 swizzled over their inner width (64 or 128
 * bytes), as the 8-bit wgmma's K-major operands are laid out (wgmma.cuh, kmajor_desc). */
fp4attn_status encode_byte_map(CUtensorMap &map, const void *base, const cuuint64_t (&dims)[3],
                               const cuuint64_t (&strides)[2], cuuint32_t inner, cuuint32_t rows,
                               const char *what);

/* A 3-D map of FP32 words (the 8-bit backward's dQ accumulator, the target of TMA reductions):
 * dims innermost first, the byte strides of the outer two, boxes of 32 x rows x 1 with the 128-byte
 * swizzle; elements past the dims are neither read nor written. */
fp4attn_status encode_f32_map(CUtensorMap &map, const void *base, const cuuint64_t (&dims)[3],
                              const cuuint64_t (&strides)[2], cuuint32_t rows, const char *what);

/* A 4-D map of 16-bit words (a caller's tensor or a workspace section): dims innermost first, the
 * byte strides of the outer three, boxes of 64 x rows x 1 x 1 swizzled over their 128 bytes (the
 * rows of a 16-bit wgmma operand, K-major or, with the transpose bit, MN-major); zero-filled past
 * the dims. */
fp4attn_status encode_rows16_map(CUtensorMap &map, const void *base, const uint64_t (&dims)[4],
                                 const uint64_t (&strides)[3], cuuint32_t rows, const char *what);

}  // namespace sm90
}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_SM90_TENSOR_MAPS_H */
