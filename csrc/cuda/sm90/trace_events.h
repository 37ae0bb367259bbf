/*
 * Development timeline of the sm90 kernels' work items (the FP4 attention, attention_sm90.cuh, and
 * the 8-bit forward, int8/forward_sm90.cu, built with -DFP4ATTN_SM90_TRACE; read by
 * tools/perf/trace_sm90.cu): per item, one 64-bit stamp of the SM's cycle counter (clock64) per
 * event below, from one thread of the role that reaches it (common/trace.cuh); the harness reads
 * the buffer with these indices. The 8-bit forward's events are its consumer 0's unless
 * said otherwise; its kTrFull0 is that consumer's wait for the first tile's stage.
 */
#ifndef FP4ATTN_CUDA_SM90_TRACE_EVENTS_H
#define FP4ATTN_CUDA_SM90_TRACE_EVENTS_H

#include <cstdint>

#include "../common/trace.cuh"

namespace fp4attn_cuda {
namespace sm90 {

enum TraceEvent {
  kTrStart,   /* the block starts (its first item) */
  kTrQReady,  /* Q^ of the item is in shared memory (after the prologue / the hand-over) */
  kTrFull0,   /* the producer has arrived on "full" of the item's first tile (bias written) */
  kTrS0,      /* consumer 0 has S of the first tile */
  kTrTile0,   /* consumer 0 has P^q of the first tile */
  kTrLastPv,  /* consumer 0 has the last P^q V^ */
  kTrEnd,     /* consumer 0 has stored O */
  kTrSm,      /* the SM's index (not a time) */
  kTrStartNs, /* kTrStart and kTrEnd on the global timer (ns): the clock rate */
  kTrEndNs,
  kTrQCopied,    /* one item per block: consumer 0 sees the item's Q rows in shared memory */
  kTrQQuantized, /* one item per block: consumer 0 has quantized its Q^ blocks (before the barrier)
                  */
  kTrS0Issue,    /* consumer 0 has its turn for the first S, and the stage is full */
  kTrDecoded, /* one item per block: thread 0 has initialised the barriers and decoded the item */
  kTrDepWait, /* 8-bit forward: the block has passed its wait for the preparation kernels */
  kTrEndLast, /* 8-bit forward: the item's last consumer has stored its O */
  kTrEvents
};
constexpr int kTraceItems = 16384; /* items with a row in the buffer (the first ones) */
using TraceRow = unsigned long long[kTrEvents];

#if defined(FP4ATTN_SM90_TRACE) && defined(__CUDACC__)
/* Stamps event ev of row `item` of a kernel's timeline buffer (rows past kTraceItems are not
 * kept): the SM's index, the global timer (ns) for the *Ns events, else the SM's cycles. */
__device__ __forceinline__ void trace_stamp(TraceRow *buf, long long item, TraceEvent ev) {
  if (item < 0 || item >= kTraceItems) return;
  buf[item][ev] = ev == kTrSm                          ? trace_sm()
                  : ev == kTrStartNs || ev == kTrEndNs ? trace_ns()
                                                       : trace_cycles();
}
#endif

/* A kernel's stamp where `cond` holds, into its translation unit's buffer `buf` (a TraceRow
 * array defined under FP4ATTN_SM90_TRACE); nothing, and `buf` unused, otherwise. */
#if defined(FP4ATTN_SM90_TRACE)
#define FP4ATTN_SM90_TRACE_INTO(buf, cond, item, ev) \
  do {                                               \
    if (cond) trace_stamp((buf), (item), (ev));      \
  } while (0)
#else
#define FP4ATTN_SM90_TRACE_INTO(buf, cond, item, ev) ((void)0)
#endif

}  // namespace sm90
}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_SM90_TRACE_EVENTS_H */
