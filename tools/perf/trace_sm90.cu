/*
 * Timeline of the sm90 kernels' work items (development tool, no torch): where a work item's time
 * goes besides its steady tiles (prologue, first tile, epilogue, the gap until the next item
 * starts on the SM), for the FP4 attention or (--int8) the 8-bit forward. The kernels record
 * clock64 stamps per item when built with -DFP4ATTN_SM90_TRACE (the events:
 * csrc/cuda/sm90/trace_events.h). Build and run on an H100/H200:
 *   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I csrc/include -DFP4ATTN_SM90_TRACE \
 *     -DFP4ATTN_CUDA_ARCHS=90a -gencode arch=compute_90a,code=sm_90a \
 *     tools/perf/trace_sm90.cu $(find csrc/cuda csrc/testing -name '*.cu') -o /tmp/trace_sm90
 *   /tmp/trace_sm90 [--int8] [D N B H causal]...   (default: the bench shapes at 1K, 4K, 16K)
 * The stamps add a few instructions to the kernel: its times are close to, not equal to, the
 * benchmark's. Built without -DFP4ATTN_SM90_TRACE it only times the calls (pre-pass included,
 * L2 flushed before each, median of 20): an A/B of two builds in one session.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "../../csrc/cuda/sm90/trace_events.h"
#include "../../tests/cuda_harness/cuda_check.h"
#include "fp4attn/fp4attn.h"

#if defined(FP4ATTN_SM90_TRACE)
extern "C" int fp4attn_sm90_trace_take(unsigned long long *host, int items);
extern "C" int fp4attn_int8_sm90_trace_take(unsigned long long *host, int items);
#endif

using namespace fp4attn_cuda::sm90; /* TraceEvent */

__global__ void fill_normalish(__half *x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    uint32_t g = h * 1664525u + 1013904223u;
    /* sum of two uniforms: a cheap bell shape in [-2, 2] */
    x[i] = __float2half(((h >> 8) * (1.0f / 16777216.0f) + (g >> 8) * (1.0f / 16777216.0f) - 1.0f) *
                        2.0f);
  }
}

static double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
static double mean(const std::vector<double> &v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / v.size();
}

/* The work items of a call as the kernels number them: rows per item, the key tiles of item i,
 * whether blocks take items in turn (one block per SM). */
struct Items {
  int rows, count, nq, nk, bh, len;
  bool causal, persistent;
  int tiles(int i) const {
    /* FP4 (128 rows): item i is query tile i % nq, longest first if causal; 8-bit: head-major, or
     * causal longest first across all heads */
    const int qt =
        rows == 128 ? (causal ? nq - 1 - i % nq : i % nq) : (causal ? nq - 1 - i / bh : i % nq);
    const int last_row = std::min((qt + 1) * rows, len) - 1;
    return causal ? std::min(nk, last_row / 128 + 1) : nk;
  }
};
static Items items_of(bool int8, int D, int N, int B, int H, int causal) {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Items it;
  /* 8-bit: three 64-row Q^ blocks per item (two at 256); persistent at head dim 128 from two waves
   * of items (int8/forward_sm90.cu). FP4: 128 rows, persistent at head dims up to 64. */
  it.rows = int8 ? (D <= 128 ? 192 : 128) : 128;
  it.nq = (N + it.rows - 1) / it.rows, it.nk = (N + 127) / 128, it.bh = B * H, it.len = N;
  it.count = B * H * it.nq, it.causal = causal;
  it.persistent = int8 ? D > 64 && D <= 128 && it.count >= 2 * sms : D <= 64;
  return it;
}

static void run(bool int8, int D, int N, int B, int H, int causal) {
  const size_t n = (size_t)B * H * N * D;
  __half *q, *k, *v, *o;
  float *lse;
  CK(cudaMalloc(&q, n * 2));
  CK(cudaMalloc(&k, n * 2));
  CK(cudaMalloc(&v, n * 2));
  CK(cudaMalloc(&o, n * 2));
  CK(cudaMalloc(&lse, (size_t)B * H * N * sizeof(float)));
  fill_normalish<<<512, 256>>>(q, n, 1);
  fill_normalish<<<512, 256>>>(k, n, 2);
  fill_normalish<<<512, 256>>>(v, n, 3);
  fp4attn_attention_params p = {};
  p.q = q, p.k = k, p.v = v, p.out = o, p.lse = lse;
  p.dtype = FP4ATTN_FLOAT16;
  p.batch = B, p.heads_q = H, p.heads_kv = H, p.len_q = N, p.len_k = N, p.head_dim = D;
  const int64_t st[3] = {(int64_t)H * N * D, (int64_t)N * D, D};
  for (int i = 0; i < 3; ++i)
    p.q_stride[i] = p.k_stride[i] = p.v_stride[i] = p.out_stride[i] = st[i];
  p.scale = 1.0f / sqrtf((float)D);
  p.causal = causal;
  p.mask_kind = FP4ATTN_MASK_NONE;
  p.kernel = FP4ATTN_KERNEL_SM90;
  void *ws;
  CK(cudaMalloc(&ws, int8 ? fp4attn_cuda_int8_attention_workspace_bytes(&p)
                          : fp4attn_cuda_attention_workspace_bytes(&p)));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const Items its_of = items_of(int8, D, N, B, H, causal);
  const int items = its_of.count;
  const int traced = std::min(items, kTraceItems); /* the items with a row in the timeline */
  std::vector<unsigned long long> tr((size_t)traced * kTrEvents);
  static char *flush = nullptr; /* larger than L2 */
  const size_t flush_bytes = 256u << 20;
  if (!flush) CK(cudaMalloc(&flush, flush_bytes));
  std::vector<float> times;
  for (int rep = 0; rep < 23; ++rep) {
    fp4attn_attention_params pp = p;
    CK(cudaMemsetAsync(flush, rep, flush_bytes));
    CK(cudaEventRecord(e0));
    fp4attn_status s = int8 ? fp4attn_cuda_int8_attention(&pp, ws, nullptr)
                            : fp4attn_cuda_attention(&pp, ws, nullptr);
    CK(cudaEventRecord(e1));
    if (s.code != FP4ATTN_OK) {
      fprintf(stderr, "attention failed: %s\n", s.message);
      exit(2);
    }
    CK(cudaDeviceSynchronize());
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    if (rep >= 3) times.push_back(t);
#if defined(FP4ATTN_SM90_TRACE)
    if ((int8 ? fp4attn_int8_sm90_trace_take : fp4attn_sm90_trace_take)(tr.data(), traced)) exit(2);
#endif
  }
  std::sort(times.begin(), times.end());
  const float ms = times[times.size() / 2];
  const double flops = 4.0 * B * H * (double)N * N * D / (causal ? 2 : 1);
#if !defined(FP4ATTN_SM90_TRACE)
  printf(
      "%sD=%d N=%d B=%d H=%d causal=%d: %.4f ms (median of %zu, pre-pass included) %.1f TFLOPS\n",
      int8 ? "int8 " : "", D, N, B, H, causal, ms, times.size(), flops / ms * 1e-9);
  CK(cudaFree(q));
  CK(cudaFree(k));
  CK(cudaFree(v));
  CK(cudaFree(o));
  CK(cudaFree(lse));
  CK(cudaFree(ws));
  return;
#endif
  /* per SM: items by start, kernel span in cycles (for the clock rate) */
  std::map<int, std::vector<int>> by_sm;
  for (int i = 0; i < traced; ++i)
    if (tr[(size_t)i * kTrEvents + kTrEnd])
      by_sm[(int)tr[(size_t)i * kTrEvents + kTrSm]].push_back(i);
  const auto at = [&](int i, int e) { return (double)tr[(size_t)i * kTrEvents + e]; };
  const bool persistent = its_of.persistent;
  std::vector<double> prologue, decoded, copied, quantized, s0_issue, full0, s0, tile0, steady, epi,
      gap, total, ghz_sm, dep_wait, last_end;
  for (auto &kv : by_sm) {
    std::vector<int> &its = kv.second;
    const auto first = [&](int i) { return persistent ? at(i, kTrQReady) : at(i, kTrStart); };
    std::sort(its.begin(), its.end(), [&](int x, int y) { return first(x) < first(y); });
    /* clock rate: the first item started (kTrStart) by the block that the last item ended in */
    int first_of_block = -1;
    for (int i : its)
      if (at(i, kTrStartNs) > 0 &&
          (first_of_block < 0 || at(i, kTrStartNs) < at(first_of_block, kTrStartNs)))
        first_of_block = i;
    const int last = its.back();
    if (first_of_block >= 0 && at(last, kTrEndNs) > at(first_of_block, kTrStartNs))
      ghz_sm.push_back((at(last, kTrEnd) - at(first_of_block, kTrStart)) /
                       (at(last, kTrEndNs) - at(first_of_block, kTrStartNs)));
    for (size_t c = 0; c < its.size(); ++c) {
      const int i = its[c];
      if (!persistent) prologue.push_back(at(i, kTrQReady) - at(i, kTrStart));
      if (!persistent && at(i, kTrDecoded) > 0)
        decoded.push_back(at(i, kTrDecoded) - at(i, kTrStart));
      if (!persistent && at(i, kTrQCopied) > 0)
        copied.push_back(at(i, kTrQCopied) - at(i, kTrStart));
      if (!persistent && at(i, kTrQQuantized) > 0)
        quantized.push_back(at(i, kTrQQuantized) - at(i, kTrStart));
      if (at(i, kTrDepWait) > 0) dep_wait.push_back(at(i, kTrDepWait) - at(i, kTrStart));
      if (at(i, kTrEndLast) > 0) last_end.push_back(at(i, kTrEndLast) - at(i, kTrEnd));
      s0_issue.push_back(at(i, kTrS0Issue) - at(i, kTrQReady));
      full0.push_back(at(i, kTrFull0) - at(i, kTrQReady));
      s0.push_back(at(i, kTrS0) - at(i, kTrQReady));
      tile0.push_back(at(i, kTrTile0) - at(i, kTrS0));
      epi.push_back(at(i, kTrEnd) - at(i, kTrLastPv));
      total.push_back(at(i, kTrEnd) - first(i));
      if (c + 1 < its.size()) gap.push_back(first(its[c + 1]) - at(i, kTrEnd));
      /* steady per tile: from the first tile's P^q to the last P^q V^ over the tiles between */
      const double nt = (at(i, kTrLastPv) - at(i, kTrTile0));
      steady.push_back(nt);
    }
  }
  const double ghz = median(ghz_sm); /* cycles per ns */
  const auto us = [&](double cyc) { return cyc / ghz / 1000.0; };
  int tiles_sum = 0;
  for (int i = 0; i < items; ++i) tiles_sum += its_of.tiles(i);
  const double avg_tiles = (double)tiles_sum / items;
  printf(
      "%sD=%d N=%d B=%d H=%d causal=%d: %.3f ms, %d items%s on %zu SMs, %.2f GHz (clock64 / "
      "globaltimer), avg %.1f tiles/item\n",
      int8 ? "int8 " : "", D, N, B, H, causal, ms, items, persistent ? " (persistent)" : "",
      by_sm.size(), ghz, avg_tiles);
  printf("  per item, median / mean us: ");
  if (!persistent) printf("prologue %.2f/%.2f  ", us(median(prologue)), us(mean(prologue)));
  if (!decoded.empty())
    printf("(item decoded at %.2f/%.2f)  ", us(median(decoded)), us(mean(decoded)));
  if (!copied.empty())
    printf("(Q rows copied at %.2f/%.2f)  ", us(median(copied)), us(mean(copied)));
  if (!quantized.empty())
    printf("(Q^ quantized at %.2f/%.2f)  ", us(median(quantized)), us(mean(quantized)));
  if (!dep_wait.empty())
    printf("(preparation waited for until %.2f/%.2f)  ", us(median(dep_wait)), us(mean(dep_wait)));
  printf("Q^->S0 issue %.2f/%.2f  ", us(median(s0_issue)), us(mean(s0_issue)));
  printf(
      "Q^->full0 %.2f/%.2f  Q^->S0 %.2f/%.2f  tile0 softmax %.2f/%.2f  "
      "tile0->last PV %.2f/%.2f (%.3f per later tile)  epilogue %.2f/%.2f  gap to next %.2f/%.2f  "
      "item total %.2f/%.2f\n",
      us(median(full0)), us(mean(full0)), us(median(s0)), us(mean(s0)), us(median(tile0)),
      us(mean(tile0)), us(median(steady)), us(mean(steady)),
      us(mean(steady)) / std::max(1.0, avg_tiles - 1), us(median(epi)), us(mean(epi)),
      us(median(gap)), us(mean(gap)), us(median(total)), us(mean(total)));
  if (!last_end.empty())
    printf("  the last consumer stores its O %.2f/%.2f us after consumer 0\n", us(median(last_end)),
           us(mean(last_end)));
  CK(cudaFree(q));
  CK(cudaFree(k));
  CK(cudaFree(v));
  CK(cudaFree(o));
  CK(cudaFree(lse));
  CK(cudaFree(ws));
}

int main(int argc, char **argv) {
  const bool int8 = argc > 1 && std::string(argv[1]) == "--int8";
  const int first = int8 ? 2 : 1;
  if (argc - first >= 5) {
    for (int i = first; i + 4 < argc; i += 5)
      run(int8, atoi(argv[i]), atoi(argv[i + 1]), atoi(argv[i + 2]), atoi(argv[i + 3]),
          atoi(argv[i + 4]));
    return 0;
  }
  for (int D : {128, 64})
    for (int N : {1024, 4096, 16384})
      for (int causal : {0, 1}) run(int8, D, N, 16384 / N, 2048 / D, causal);
  return 0;
}
