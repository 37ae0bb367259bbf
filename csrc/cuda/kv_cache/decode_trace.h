/*
 * Development timeline of the KV-cache decode kernel's blocks (decode.cu built with
 * -DFP4ATTN_DECODE_TRACE; read by tools/perf/trace_decode.cu): per block, row split x tiles +
 * tile, one 64-bit value per event below (common/trace.cuh), from thread 0 unless said otherwise.
 */
#ifndef FP4ATTN_CUDA_KV_CACHE_DECODE_TRACE_H
#define FP4ATTN_CUDA_KV_CACHE_DECODE_TRACE_H

namespace fp4attn_cuda {

enum DecodeTraceEvent {
  kDtStart,      /* the block starts */
  kDtQReady,     /* the tile's rotated queries are staged (the prologue's last barrier) */
  kDtFirstChunk, /* warp 0's first chunk has landed in its slot (staged blocks only) */
  kDtLoopEnd,    /* warp 0 has finished its chunks */
  kDtMerged,     /* the warps' partial results are in shared memory (after the barrier) */
  kDtEnd,        /* thread 0 has written its share of the split's partial result */
  kDtChunks,     /* warp 0's chunk count (not a time) */
  kDtResidual,   /* 1 where the block is the residual ring's split (not a time) */
  kDtSm,         /* the SM's index (not a time) */
  kDtStartNs,    /* kDtStart and kDtEnd on the global timer (ns) */
  kDtEndNs,
  kDtEvents
};
constexpr int kDecodeTraceBlocks = 65536; /* blocks with a row (the first ones) */

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_KV_CACHE_DECODE_TRACE_H */
