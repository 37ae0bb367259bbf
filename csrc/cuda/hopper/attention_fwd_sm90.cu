/*
 * Hopper wgmma attention kernel (attention_fwd_sm90.cuh): instantiations for head dims padded to
 * 64 and 128, and the rule that picks it.
 */
#include "attention_fwd_sm90.cuh"

#include <string.h>

#define FP4ATTN_STR2(x) #x
#define FP4ATTN_STR(x) FP4ATTN_STR2(x)

namespace fp4attn_cuda {

namespace {

/* The extension build lists its device architectures in FP4ATTN_CUDA_ARCHS (setup.py); the
 * kernel has a body only in the sm_90a pass. */
bool built_for_sm90a() {
#if defined(FP4ATTN_CUDA_ARCHS)
  return strstr(FP4ATTN_STR(FP4ATTN_CUDA_ARCHS), "90a") != nullptr;
#else
  return false;
#endif
}

}  // namespace

Sm90Choice choose_sm90(const fp4attn_attention_params &p, int64_t dp) {
  if (p.kernel != FP4ATTN_KERNEL_AUTO && p.kernel != FP4ATTN_KERNEL_SM90) return SM90_NO;
  const bool available = built_for_sm90a() && device_capability() == 90 && dp <= 128;
  if (available) return SM90_YES;
  return p.kernel == FP4ATTN_KERNEL_SM90 ? SM90_UNAVAILABLE : SM90_NO;
}

fp4attn_status sm90_unavailable(int64_t head_dim) {
  return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                      "attention: kernel sm90 needs a GPU of compute capability 9.0, a build with "
                      "sm_90a in FP4ATTN_CUDA_ARCHS and head dim <= 128 (got %lld)",
                      (long long)head_dim);
}

fp4attn_status launch_attention_fwd_sm90_d64(const AttnArgs &a, cudaStream_t s) { return sm90::launch<64>(a, s); }
fp4attn_status launch_attention_fwd_sm90_d128(const AttnArgs &a, cudaStream_t s) { return sm90::launch<128>(a, s); }

}  // namespace fp4attn_cuda
