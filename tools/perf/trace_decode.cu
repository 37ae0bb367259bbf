/*
 * Timeline of the KV-cache decode kernel's blocks (development tool, no torch): where a decode
 * call's time goes besides its chunks (the queries' prologue, the first chunk's wait, the warps'
 * merge and the partial result's write, the residual ring's split, the merge kernel and launch),
 * for the fixed cost per call that bounds small batches. The kernel records stamps per block when
 * built with -DFP4ATTN_DECODE_TRACE (the events: csrc/cuda/kv_cache/decode_trace.h). Build and run
 * on an H100/H200:
 *   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I csrc/include -DFP4ATTN_DECODE_TRACE \
 *     -DFP4ATTN_CUDA_ARCHS=90a -gencode arch=compute_90a,code=sm_90a \
 *     tools/perf/trace_decode.cu $(find csrc/cuda csrc/testing -name '*.cu') -o /tmp/trace_decode
 *   /tmp/trace_decode [B L Hq Hkv D nq R]...   (default: B = 1 and 8 at 32K, B = 1 at 128K, with
 *                                               and without the 16-token residual ring)
 * One call per shape (FP16, page size 128, the cache filled by fp4attn_cuda_kv_append), the L2
 * flushed before each of 23 calls, the median of the last 20 timed by events; the stamps come
 * from the last call. Built without the flag it only times the calls.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../../csrc/cuda/kv_cache/decode_trace.h"
#include "../../tests/cuda_harness/cuda_check.h"
#include "fp4attn/fp4attn.h"

#if defined(FP4ATTN_DECODE_TRACE)
extern "C" int fp4attn_decode_trace_take(unsigned long long *host, int blocks);
#endif

using namespace fp4attn_cuda; /* DecodeTraceEvent */

__global__ void fill_normalish(__half *x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    const uint32_t g = h * 1664525u + 1013904223u;
    x[i] = __float2half(((h >> 8) + (g >> 8)) * (1.0f / 16777216.0f) - 1.0f);
  }
}

static double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, (size_t)(q * (v.size() - 1) + 0.5))];
}

template <class T>
static T *dev_alloc(size_t count) {
  T *p = nullptr;
  CK(cudaMalloc(&p, count * sizeof(T)));
  CK(cudaMemset(p, 0, count * sizeof(T)));
  return p;
}

static void check(fp4attn_status s, const char *what) {
  if (s.code != FP4ATTN_OK) {
    fprintf(stderr, "%s failed: %s\n", what, s.message);
    exit(2);
  }
}

static void run(int B, int L, int Hq, int Hkv, int D, int nq, int R) {
  const int page = 128, pages_per_seq = (L + page - 1) / page, pages = B * pages_per_seq;
  const size_t rows = (size_t)pages * Hkv * page;
  fp4attn_kv_cache c = {};
  c.k_codes = dev_alloc<uint8_t>(rows * fp4attn_k5_code_bytes(D));
  c.k_scales = dev_alloc<uint8_t>(rows * fp4attn_k5_scale_count(D));
  c.k_exp = dev_alloc<uint8_t>(rows);
  c.v_codes = dev_alloc<uint8_t>(rows * fp4attn_code_bytes(D));
  c.v_scales = dev_alloc<uint8_t>(rows * fp4attn_scale_count(D));
  c.v_dec = dev_alloc<float>(rows);
  c.kmean = dev_alloc<float>((size_t)B * Hkv * D);
  c.kscale = dev_alloc<float>((size_t)B * Hkv * D);
  std::vector<int32_t> table((size_t)B * pages_per_seq);
  for (size_t i = 0; i < table.size(); ++i) table[i] = (int32_t)i;
  int32_t *block_table = dev_alloc<int32_t>(table.size());
  CK(cudaMemcpy(block_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  c.block_table = block_table;
  c.batch = B, c.heads_kv = Hkv, c.head_dim = D, c.page_size = page;
  c.max_pages = pages_per_seq, c.num_pages = pages;

  /* the cache's L tokens, appended in one call (K's mean from all of them) */
  const size_t kv_n = (size_t)B * Hkv * L * D;
  __half *k = dev_alloc<__half>(kv_n), *v = dev_alloc<__half>(kv_n);
  fill_normalish<<<1024, 256>>>(k, kv_n, 1);
  fill_normalish<<<1024, 256>>>(v, kv_n, 2);
  fp4attn_kv_append_params ap = {};
  ap.cache = c, ap.k = k, ap.v = v, ap.dtype = FP4ATTN_FLOAT16, ap.len = L, ap.start = 0;
  const int64_t kst[3] = {(int64_t)Hkv * L * D, (int64_t)L * D, D};
  for (int i = 0; i < 3; ++i) ap.k_stride[i] = ap.v_stride[i] = kst[i];
  ap.set_mean = 1;
  check(fp4attn_cuda_kv_append(&ap, nullptr), "append");
  CK(cudaDeviceSynchronize());
  CK(cudaFree(k));
  CK(cudaFree(v));

  const size_t q_n = (size_t)B * Hq * nq * D;
  __half *q = dev_alloc<__half>(q_n), *o = dev_alloc<__half>(q_n);
  fill_normalish<<<64, 256>>>(q, q_n, 3);
  std::vector<int32_t> lens(B, L);
  int32_t *seq_lens = dev_alloc<int32_t>(B);
  CK(cudaMemcpy(seq_lens, lens.data(), B * 4, cudaMemcpyHostToDevice));
  const int slots = R > 0 ? 2 * R - 1 : 0; /* the ring as FP4Cache keeps it */
  __half *res_k = R > 0 ? dev_alloc<__half>((size_t)B * Hkv * slots * D) : nullptr;
  __half *res_v = R > 0 ? dev_alloc<__half>((size_t)B * Hkv * slots * D) : nullptr;
  fp4attn_decode_params p = {};
  p.cache = c, p.seq_lens = seq_lens, p.q = q, p.out = o, p.dtype = FP4ATTN_FLOAT16;
  p.heads_q = Hq, p.len_q = nq;
  const int64_t qst[3] = {(int64_t)Hq * nq * D, (int64_t)nq * D, D};
  for (int i = 0; i < 3; ++i) p.q_stride[i] = p.out_stride[i] = qst[i];
  p.scale = 1.0f / sqrtf((float)D);
  p.res_k = res_k, p.res_v = res_v, p.residual_len = R, p.residual_slots = slots;
  void *ws = dev_alloc<char>((size_t)fp4attn_cuda_decode_workspace_bytes(&p));

  static char *flush = nullptr; /* larger than L2 */
  const size_t flush_bytes = 256u << 20;
  if (!flush) CK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<double> times;
  std::vector<unsigned long long> tr((size_t)kDecodeTraceBlocks * kDtEvents);
  for (int rep = 0; rep < 23; ++rep) {
    CK(cudaMemsetAsync(flush, rep, flush_bytes));
    CK(cudaEventRecord(e0));
    check(fp4attn_cuda_decode(&p, ws, nullptr), "decode");
    CK(cudaEventRecord(e1));
    CK(cudaDeviceSynchronize());
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    if (rep >= 3) times.push_back(t * 1000.0);
#if defined(FP4ATTN_DECODE_TRACE)
    if (fp4attn_decode_trace_take(tr.data(), kDecodeTraceBlocks)) exit(2);
#endif
  }
  printf("B=%d L=%d heads=%d/%d D=%d nq=%d residual=%d: %.1f us per call (median of %zu)\n", B, L,
         Hq, Hkv, D, nq, R, quantile(times, 0.5), times.size());
#if defined(FP4ATTN_DECODE_TRACE)
  const auto at = [&](size_t row, int e) { return (double)tr[row * kDtEvents + e]; };
  std::vector<double> prologue, first, per_chunk, merge, write, total, residual, chunks;
  double t0 = 1e300, t1 = 0, last_start = 0, ghz_sum = 0;
  int blocks = 0, ghz_n = 0;
  for (size_t row = 0; row < (size_t)kDecodeTraceBlocks; ++row) {
    if (at(row, kDtEndNs) == 0) continue;
    ++blocks;
    t0 = std::min(t0, at(row, kDtStartNs)), t1 = std::max(t1, at(row, kDtEndNs));
    last_start = std::max(last_start, at(row, kDtStartNs));
    const double span_ns = at(row, kDtEndNs) - at(row, kDtStartNs);
    const double span_cyc = at(row, kDtEnd) - at(row, kDtStart);
    if (span_ns <= 0) continue; /* (a block within one tick of the global timer) */
    ghz_sum += span_cyc / span_ns, ++ghz_n;
    if (at(row, kDtResidual) != 0) {
      residual.push_back(span_ns / 1000.0);
      continue;
    }
    total.push_back(span_ns / 1000.0);
    chunks.push_back(at(row, kDtChunks));
    const double ghz = span_cyc / span_ns;
    const auto us = [&](int a, int b) { return (at(row, b) - at(row, a)) / ghz / 1000.0; };
    prologue.push_back(us(kDtStart, kDtQReady));
    if (at(row, kDtFirstChunk) != 0) {
      first.push_back(us(kDtQReady, kDtFirstChunk));
      if (at(row, kDtChunks) > 1)
        per_chunk.push_back(us(kDtFirstChunk, kDtLoopEnd) / (at(row, kDtChunks) - 1));
    }
    merge.push_back(us(kDtLoopEnd, kDtMerged));
    write.push_back(us(kDtMerged, kDtEnd));
  }
  if (blocks == 0) return;
  const double span = (t1 - t0) / 1000.0;
  printf(
      "  %d blocks, %.2f GHz; decode kernel %.1f us from the first block's start to the last "
      "block's end (blocks started over %.1f us); the rest of the call %.1f us (launch, merge "
      "kernel)\n",
      blocks, ghz_sum / ghz_n, span, (last_start - t0) / 1000.0, quantile(times, 0.5) - span);
  printf(
      "  per block, median [max] us: total %.1f [%.1f], queries' prologue %.2f [%.2f], first "
      "chunk after it %.2f [%.2f], %.2f per later chunk (warp 0: %.0f chunks), warps' merge "
      "%.2f, partial's write %.2f",
      quantile(total, 0.5), quantile(total, 1), quantile(prologue, 0.5), quantile(prologue, 1),
      quantile(first, 0.5), quantile(first, 1), quantile(per_chunk, 0.5), quantile(chunks, 0.5),
      quantile(merge, 0.5), quantile(write, 0.5));
  if (!residual.empty())
    printf("; residual split %.1f [%.1f]", quantile(residual, 0.5), quantile(residual, 1));
  printf("\n");
#endif
  for (void *x : {(void *)c.k_codes, (void *)c.k_scales, (void *)c.k_exp, (void *)c.v_codes,
                  (void *)c.v_scales, (void *)c.v_dec, (void *)c.kmean, (void *)c.kscale,
                  (void *)block_table, (void *)q, (void *)o, (void *)seq_lens, ws})
    CK(cudaFree(x));
  if (res_k) CK(cudaFree(res_k));
  if (res_v) CK(cudaFree(res_v));
}

int main(int argc, char **argv) {
  if (argc > 7) {
    for (int i = 1; i + 6 < argc; i += 7)
      run(atoi(argv[i]), atoi(argv[i + 1]), atoi(argv[i + 2]), atoi(argv[i + 3]), atoi(argv[i + 4]),
          atoi(argv[i + 5]), atoi(argv[i + 6]));
    return 0;
  }
  for (int R : {0, 16}) {
    run(1, 32768, 32, 8, 128, 1, R);
    run(8, 32768, 32, 8, 128, 1, R);
    run(1, 131072, 32, 8, 128, 1, R);
  }
  return 0;
}
