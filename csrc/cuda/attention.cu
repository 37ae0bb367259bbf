/*
 * FP4 attention on CUDA: argument checks and kernel selection. The quantization pre-pass
 * (SPEC 4.1-4.3: qbar, kbar, global scales, K^ and V^ into the workspace of attention.cuh) is
 * in prepass.cu; the forward kernels (attention_fwd*.cu, hopper/) then quantize each query
 * block themselves.
 */
#include "attention.cuh"

#if defined(__has_include)
#if __has_include("sm120/attention_sm120.h")
#include "sm120/attention_sm120.h"
#define FP4ATTN_HAVE_SM120 1
#endif
#endif

namespace fp4attn_cuda {
/* prepass.cu; path 0 picks the streaming pre-pass where it applies */
fp4attn_status launch_attention_prepass(const AttnArgs &a, cudaStream_t s, int path);
}  // namespace fp4attn_cuda

using namespace fp4attn_cuda;

namespace {

bool aligned16(const void *ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

bool vec_ok(const void *ptr, const int64_t *stride, int64_t d) {
  return aligned16(ptr) && d % 8 == 0 && stride[0] % 8 == 0 && stride[1] % 8 == 0 &&
         stride[2] % 8 == 0;
}

bool use_sm120(const fp4attn_attention_params *p) {
#if defined(FP4ATTN_HAVE_SM120)
  if (p->kernel == FP4ATTN_KERNEL_SM120) return true;
  if (p->kernel == FP4ATTN_KERNEL_AUTO && device_capability() / 10 == 12) return true;
#else
  (void)p;
#endif
  return false;
}

}  // namespace

extern "C" int64_t fp4attn_cuda_attention_workspace_bytes(const fp4attn_attention_params *p) {
  if (!p || fp4attn_check_attention_params(p).code != FP4ATTN_OK) return 0;
  int64_t bytes = attn_workspace_layout(p, nullptr).bytes;
#if defined(FP4ATTN_HAVE_SM120)
  if (p->kernel == FP4ATTN_KERNEL_SM120 || p->kernel == FP4ATTN_KERNEL_AUTO) {
    const int64_t other = fp4attn_cuda_attention_sm120_workspace_bytes(p);
    if (other > bytes) bytes = other;
  }
#endif
  return bytes;
}

extern "C" fp4attn_status fp4attn_cuda_attention(const fp4attn_attention_params *p,
                                                 void *workspace, void *stream) {
  fp4attn_status st = fp4attn_check_attention_params(p);
  if (st.code != FP4ATTN_OK) return st;
  if (p->kernel != FP4ATTN_KERNEL_AUTO && p->kernel != FP4ATTN_KERNEL_FP16_MMA &&
      p->kernel != FP4ATTN_KERNEL_SM120 && p->kernel != FP4ATTN_KERNEL_SM90)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "attention: unknown kernel %d",
                        (int)p->kernel);
  if (use_sm120(p)) {
#if defined(FP4ATTN_HAVE_SM120)
    return fp4attn_cuda_attention_sm120(p, workspace, stream);
#endif
  }
#if !defined(FP4ATTN_HAVE_SM120)
  if (p->kernel == FP4ATTN_KERNEL_SM120)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                        "attention: this build has no sm120 kernel (csrc/cuda/sm120 missing)");
#endif
  if (!workspace)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "attention: workspace is null");
  if (reinterpret_cast<uintptr_t>(workspace) & 255u)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "attention: workspace must be 256-byte aligned");
  if (p->q_stride[0] < 0 || p->q_stride[1] < 0 || p->q_stride[2] < 0 || p->k_stride[2] < 0 ||
      p->v_stride[2] < 0 || p->out_stride[2] < 0)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "attention: negative strides");

  AttnArgs a;
  a.p = *p;
  a.ws = attn_workspace_layout(p, workspace);
  a.vec_q = vec_ok(p->q, p->q_stride, p->head_dim);
  a.vec_k = vec_ok(p->k, p->k_stride, p->head_dim);
  a.vec_v = vec_ok(p->v, p->v_stride, p->head_dim);
  const size_t es = dtype_size(p->dtype);
  a.out_pair = (reinterpret_cast<uintptr_t>(p->out) % (2 * es)) == 0 && p->out_stride[0] % 2 == 0 &&
               p->out_stride[1] % 2 == 0 && p->out_stride[2] % 2 == 0;
  a.vec_out = p->dtype != FP4ATTN_FLOAT32 && vec_ok(p->out, p->out_stride, p->head_dim);
  a.scale_log2 = p->scale * 1.4426950408889634f;

  cudaStream_t s = static_cast<cudaStream_t>(stream);
  st = launch_attention_prepass(a, s, 0);
  if (st.code != FP4ATTN_OK) return st;
  switch (a.ws.dp) {
    case 64: return launch_attention_fwd_d64(a, s);
    case 128: return launch_attention_fwd_d128(a, s);
    default: return launch_attention_fwd_d256(a, s);
  }
}
