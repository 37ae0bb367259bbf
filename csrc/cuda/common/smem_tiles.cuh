/*
 * Byte-addressed shared-memory tiles for mma.sync kernels: an XOR swizzle of 16-byte chunks,
 * their cp.async fill, and the ldmatrix A and B fragments read from them. Offsets are in bytes,
 * so one set serves INT8 (32 values per 32-byte k step) and 16-bit operands (16 values).
 */
#ifndef FP4ATTN_CUDA_COMMON_SMEM_TILES_CUH
#define FP4ATTN_CUDA_COMMON_SMEM_TILES_CUH

#include "device.cuh"

namespace fp4attn_cuda {

/* Byte offset of (row, byte) in a [rows][W]-byte shared tile whose 16-byte chunks are XOR-swizzled
 * by row, so that ldmatrix's 8 rows of one chunk column fall in 8 different bank groups
 * (W = 64, or a multiple of 128). */
template <int W>
__device__ __forceinline__ int swz_byte(int row, int byte) {
  static_assert(W == 64 || W % 128 == 0, "swizzled tiles are 64 or k * 128 bytes wide");
  const int x = W >= 128 ? (row & 7) : ((row >> 1) & 3);
  return row * W + ((((byte >> 4) ^ x)) << 4) + (byte & 15);
}

/* cp.async of a dense [rows][W]-byte global tile (rows `pitch` bytes apart) into a swizzled one. */
template <int W>
__device__ __forceinline__ void load_tile(char *smem, const void *gmem, int rows, int64_t pitch,
                                          int tid, int nthreads) {
  const char *g = static_cast<const char *>(gmem);
  for (int i = tid; i < rows * (W / 16); i += nthreads) {
    const int r = i / (W / 16), c = i % (W / 16);
    cp_async_16(smem + swz_byte<W>(r, c * 16), g + r * pitch + c * 16);
  }
}
/* cp.async of `bytes` (a multiple of 16) contiguous bytes. */
__device__ __forceinline__ void load_bytes(char *smem, const void *gmem, int bytes, int tid,
                                           int nthreads) {
  for (int i = tid; i < bytes / 16; i += nthreads)
    cp_async_16(smem + 16 * i, static_cast<const char *>(gmem) + 16 * i);
}

/* A fragment (16 rows from r0, 32 k-bytes from k0: 32 int8 or 16 16-bit values) of a swizzled
 * row-major tile. */
template <int W>
__device__ __forceinline__ void ldsm_a(uint32_t (&a)[4], const char *tile, int r0, int k0) {
  const int lane = threadIdx.x & 31, mi = lane >> 3;
  const int row = r0 + (mi & 1) * 8 + (lane & 7), byte = k0 + (mi >> 1) * 16;
  ldmatrix_x4(a[0], a[1], a[2], a[3], smem_u32(tile + swz_byte<W>(row, byte)));
}
/* B fragments of two 8-column tiles (16-bit operands, k = 16 rows from k0 of a [k][n] tile, columns
 * n0..n0+15; ldmatrix .trans): b[x] is the (b0, b1) pair of columns n0 + 8x .. n0 + 8x + 7. For a
 * B operand stored k-major, e.g. V [keys][d] in P V. */
template <int W>
__device__ __forceinline__ void ldsm_b_trans(uint32_t (&b)[2][2], const char *tile, int k0,
                                             int n0) {
  const int lane = threadIdx.x & 31, mi = lane >> 3;
  const int row = k0 + (mi & 1) * 8 + (lane & 7), byte = 2 * (n0 + (mi >> 1) * 8);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b[0][0]), "=r"(b[0][1]), "=r"(b[1][0]), "=r"(b[1][1])
               : "r"(smem_u32(tile + swz_byte<W>(row, byte))));
}

/* B fragments of two 8-column tiles (columns = tile rows n0..n0+15, 32 k-bytes from k0) of a
 * swizzled [n][k] tile: b[x] is the (b0, b1) pair of columns n0 + 8x .. n0 + 8x + 7. */
template <int W>
__device__ __forceinline__ void ldsm_b(uint32_t (&b)[2][2], const char *tile, int n0, int k0) {
  const int lane = threadIdx.x & 31, mi = lane >> 3;
  const int row = n0 + (mi >> 1) * 8 + (lane & 7), byte = k0 + (mi & 1) * 16;
  ldmatrix_x4(b[0][0], b[0][1], b[1][0], b[1][1], smem_u32(tile + swz_byte<W>(row, byte)));
}

/* B fragments of one 8-column tile (columns = tile rows n0..n0+7) for two k steps (64 k-bytes
 * from k0, 16-bit operands) of a swizzled [n][k] tile: b[h] is the (b0, b1) pair of k step h. */
template <int W>
__device__ __forceinline__ void ldsm_b_x2k(uint32_t (&b)[2][2], const char *tile, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  const int row = n0 + (lane & 7), byte = k0 + (lane >> 3) * 16;
  ldmatrix_x4(b[0][0], b[0][1], b[1][0], b[1][1], smem_u32(tile + swz_byte<W>(row, byte)));
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_COMMON_SMEM_TILES_CUH */
