/*
 * The rules that choose how an attention call runs on CUDA (an AttnPlan, tile/workspace.cuh):
 * which kernel family (from the request, the device, the build's architectures and the head dim)
 * and the scheduling knobs that size the workspace. dispatch.cu is their only caller; nothing
 * else decides.
 */
#ifndef FP4ATTN_CUDA_HEURISTICS_H
#define FP4ATTN_CUDA_HEURISTICS_H

#include <string.h>

#include "tile/workspace.cuh"

#define FP4ATTN_STR2(x) #x
#define FP4ATTN_STR(x) FP4ATTN_STR2(x)

namespace fp4attn_cuda {

/* Whether the build holds sm_90a code (setup.py lists its architectures in FP4ATTN_CUDA_ARCHS):
 * the wgmma kernel has a body only in that pass. */
static inline bool built_for_sm90a() {
#if defined(FP4ATTN_CUDA_ARCHS)
  return strstr(FP4ATTN_STR(FP4ATTN_CUDA_ARCHS), "90a") != nullptr;
#else
  return false;
#endif
}

/* Heads per group of the causal work order (tile/scheduler.cuh, query_block): a group's items go
 * longest first across its heads, so the grid ends on the shortest items. The smallest divisor of
 * B x Hq whose group holds a wave of items (SM count / nqb heads or more), so that small groups
 * keep their K^/V^ in L2; 1 (head-major order) where no divisor lies near. */
static inline int64_t causal_item_heads(const fp4attn_attention_params *p, int64_t nqb) {
  const int64_t bhq = p->batch * p->heads_q;
  if (!p->causal || bhq <= 1 || nqb < 1) return 1;
  const int64_t want = ceil_div(sm_count(), nqb);
  if (want >= bhq) return bhq;
  for (int64_t g = want; g <= 2 * want && g <= bhq; ++g)
    if (bhq % g == 0) return g;
  return 1;
}

/* The plan for p (already validated) on the current device, or an FP4ATTN_ERR_UNSUPPORTED status
 * where the requested kernel cannot run. AUTO: sm120 on compute capability 12.x, sm90 on 9.0 with
 * an sm_90a build and head dim <= 128, sm80 otherwise. */
static inline fp4attn_status plan_attention(const fp4attn_attention_params *p, AttnPlan *plan) {
  const int cc = device_capability();
  const int64_t dp = padded_head_dim(p->head_dim);
  const bool sm90_ok = built_for_sm90a() && cc == 90 && dp <= 128;
  fp4attn_kernel k = p->kernel;
  if (k == FP4ATTN_KERNEL_AUTO)
    k = cc / 10 == 12 ? FP4ATTN_KERNEL_SM120
                      : (sm90_ok ? FP4ATTN_KERNEL_SM90 : FP4ATTN_KERNEL_SM80);
  if (k == FP4ATTN_KERNEL_SM90 && !sm90_ok)
    return fp4attn_error(
        FP4ATTN_ERR_UNSUPPORTED,
        "attention: kernel sm90 needs a GPU of compute capability 9.0, a build with "
        "sm_90a in FP4ATTN_CUDA_ARCHS and head dim <= 128 (got %lld)",
        (long long)p->head_dim);
  /* the sm120 operand writer's grids have B x Hq or B x Hkv blocks in y (at most 65535) */
  if (k == FP4ATTN_KERNEL_SM120 && p->batch * p->heads_q > 65535)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "batch * heads_q must be at most 65535 for the sm120 kernel");
  plan->kernel = k;
  plan->dp = dp;
  plan->fp16_operands = k != FP4ATTN_KERNEL_SM120;
  plan->qstage_blocks = k == FP4ATTN_KERNEL_SM90 && dp == 64 ? sm_count() : 0;
  plan->item_heads = causal_item_heads(p, ceil_div(p->len_q, 128));
  return fp4attn_ok();
}

/* The kernel of an 8-bit call (SPEC_INT8): the mma.sync INT8 kernels (int8/, sm_80 and newer),
 * requested as AUTO or SM80; Hopper- and Blackwell-specific INT8 kernels would be chosen here. */
static inline fp4attn_status plan_int8_attention(const fp4attn_attention_params *p,
                                                 fp4attn_kernel *kernel) {
  if (p->kernel != FP4ATTN_KERNEL_AUTO && p->kernel != FP4ATTN_KERNEL_SM80)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "int8 attention: no '%s' kernel; the 8-bit kernels are 'sm80' (mma.sync, "
                         "any GPU of compute capability 8.0 or newer)",
                         fp4attn_kernel_name(p->kernel));
  if (device_capability() < 80)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "int8 attention needs a GPU of compute capability 8.0 or newer");
  *kernel = FP4ATTN_KERNEL_SM80;
  return fp4attn_ok();
}

}  // namespace fp4attn_cuda

#endif /* FP4ATTN_CUDA_HEURISTICS_H */
