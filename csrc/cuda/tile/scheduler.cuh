/*
 * Work order of the attention kernels: which query block of which (batch, query head) a CUDA
 * block or a persistent block's work item computes (query_block), and the launch of a forward
 * kernel over those items (launch_forward: one block per item, or persistent blocks).
 */
#ifndef FP4ATTN_CUDA_TILE_SCHEDULER_CUH
#define FP4ATTN_CUDA_TILE_SCHEDULER_CUH

#include "workspace.cuh"

namespace fp4attn_cuda {

/* Query blocks of `rows` rows of one (batch, query head), and of all of them: the forward
 * kernels' blocks or work items (query_block). */
__host__ __device__ inline int64_t query_blocks_per_head(const fp4attn_attention_params &p,
                                                         int rows) {
  return (p.len_q + rows - 1) / rows;
}
__host__ __device__ inline int64_t query_block_count(const fp4attn_attention_params &p, int rows) {
  return p.batch * p.heads_q * query_blocks_per_head(p, rows);
}

/* The query rows of work item `item` (a CUDA block, or one item of a persistent block):
 * (batch, query head) bh = (b, h), its KV head hk (bhk), the first row q0 of its `rows`-row block,
 * and how many 128-key tiles it visits. Items run over B x Hq x ceil(Nq / rows) in groups of
 * `group_heads` consecutive (batch, query head)s, so that blocks running at the same time share
 * their K/V in L2; within a group the query block is the slow index and the head the fast one.
 * Query blocks in reverse when causal: the longest items first, the shortest fill the tail.
 * group_heads = 1 is the head-major order (the kernels that pass a literal 1 compile to it);
 * w.item_heads (causal_item_heads) spreads the longest items over the heads of a group. */
struct QueryBlock {
  int64_t bh, b, h, hk, bhk, q0;
  int ntiles;
};

/* Index is the type of the decode's arithmetic. 32-bit is exact (fewer than 2^31 items:
 * launch_forward, so the item, the (batch, query head) index and every factor below fit) and
 * cheaper; the persistent D=64 sm90 kernel keeps 64-bit because its consumer loop's schedule
 * moves with this code (sass_loop_stats.py --compare). */
template <typename Index = uint32_t>
__device__ __forceinline__ QueryBlock query_block(const fp4attn_attention_params &p,
                                                  const AttnWorkspace &w, int rows, int64_t item,
                                                  int64_t group_heads) {
  QueryBlock k;
  const Index nqt = (Index)query_blocks_per_head(p, rows), it = (Index)item;
  Index bh, qt;
  if (group_heads == 1) {
    bh = it / nqt;
    qt = it % nqt;
  } else { /* 32-bit either way */
    const uint32_t G = (uint32_t)group_heads, per_group = G * (uint32_t)nqt;
    const uint32_t group = (uint32_t)it / per_group, r = (uint32_t)it - group * per_group;
    const uint32_t q = r / G;
    bh = (Index)group * G + (r - q * G);
    qt = q;
  }
  if (p.causal) qt = nqt - 1 - qt;
  const Index hq = (Index)p.heads_q, b = bh / hq, h = bh % hq;
  const Index hk = h / (hq / (Index)p.heads_kv);
  k.bh = bh;
  k.b = b;
  k.h = h;
  k.hk = hk;
  k.bhk = (int64_t)b * p.heads_kv + hk;
  k.q0 = (int64_t)qt * rows;
  int64_t ntiles = w.nkt;
  if (p.causal) ntiles = min(ntiles, (min(k.q0 + rows, p.len_q) - 1) / kTile + 1);
  k.ntiles = (int)ntiles;
  return k;
}

/* Launches forward kernel `kernel` with parameter `args` and `smem` bytes of dynamic shared
 * memory on stream s: one block of `threads` per `rows` query rows of every (batch, query head)
 * of p, or, when `persistent` > 0, at most that many and no more than fit on the device at once
 * (the kernel loops over the query blocks). The first launch on a device raises the kernel's
 * shared-memory limit and records how many blocks are resident at once (`resident`: the kernel's
 * per-device record, 0 until then), or returns FP4ATTN_ERR_UNSUPPORTED where the device has too
 * little memory. */
template <typename Kernel, typename Args>
fp4attn_status launch_forward(Kernel kernel, const Args &args, const fp4attn_attention_params &p,
                              int rows, int threads, int smem, int (&resident)[64],
                              int64_t persistent, const char *name, cudaStream_t s) {
  int dev = 0;
  cudaGetDevice(&dev);
  int at_once = dev >= 0 && dev < 64 ? resident[dev] : 0;
  if (at_once == 0) {
    int optin = 0, per_sm = 0;
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (optin < smem)
      return fp4attn_error(
          FP4ATTN_ERR_UNSUPPORTED,
          "%s: head dim %lld needs %d bytes of shared memory per block, the device "
          "allows %d",
          name, (long long)padded_head_dim(p.head_dim), smem, optin);
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
            cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) !=
            cudaSuccess)
      return launch_status(name);
    at_once = sm_count() * (per_sm > 0 ? per_sm : 1);
    if (dev >= 0 && dev < 64) resident[dev] = at_once;
  }
  int64_t blocks = query_block_count(p, rows);
  if (blocks > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "%s: too many query blocks", name);
  if (persistent > 0) blocks = min(blocks, min((int64_t)at_once, persistent));
  kernel<<<(unsigned)blocks, threads, smem, s>>>(args);
  return launch_status(name);
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_TILE_SCHEDULER_CUH */
