/*
 * The CUDA attention entry points of the C API, and the one place that decides how a call runs:
 * the arguments are validated once (checks.h, then this backend's limits), heuristics.h plans
 * the kernel, the pre-pass (prepass/) fills the workspace, and the planned kernel family
 * (sm80/, sm90/, sm120/) computes the output; decode shapes run the fused split-KV decode
 * (decode/sdpa_decode.cu) instead, without the pre-pass. The 8-bit attention (SPEC_INT8) enters
 * here too: its preparation kernels, then the int8/ forward or backward; and the FP4 KV cache (SPEC
 * 6): kv_cache/'s append and split-KV decode.
 */
#include <type_traits>

#include "decode/sdpa_decode.h"
#include "heuristics.h"
#include "int8/attention_int8.h"
#include "int8/int8_tiles.cuh"
#include "prepass/prepass.h"
#include "sm120/attention_sm120.h"
#include "sm80/attention_sm80.h"
#include "sm90/attention_sm90.h"

using namespace fp4attn_cuda;

namespace {

/* The C API contract plus what every CUDA attention kernel needs: non-negative strides. */
fp4attn_status check_cuda_attention(const fp4attn_attention_params *p, const char *what) {
  const fp4attn_status st = fp4attn_check_attention_params(p);
  if (st.code != FP4ATTN_OK) return st;
  if (p->q_stride[0] < 0 || p->q_stride[1] < 0 || p->q_stride[2] < 0 || p->k_stride[2] < 0 ||
      p->v_stride[2] < 0 || p->out_stride[2] < 0)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "%s: negative strides", what);
  return fp4attn_ok();
}

/* The checks, then the plan. */
fp4attn_status check_and_plan(const fp4attn_attention_params *p, AttnPlan *plan) {
  const fp4attn_status st = check_cuda_attention(p, "attention");
  if (st.code != FP4ATTN_OK) return st;
  return plan_attention(p, plan);
}

/* The workspace: the shared sections (tile/workspace.cuh), the pre-pass's staging, then the
 * sm120 kernel's own sections; each part a multiple of 256 bytes. The fused decode has its own
 * (decode/sdpa_decode.h) and no pre-pass. */
int64_t workspace_bytes(const fp4attn_attention_params *p, const AttnPlan &plan) {
  if (plan.kernel == FP4ATTN_KERNEL_DECODE) return sdpa_decode_layout(*p, plan, nullptr).bytes;
  const int64_t shared = attn_workspace_layout(p, plan, nullptr).bytes + prepass_staging_bytes(*p);
  return plan.kernel == FP4ATTN_KERNEL_SM120 ? shared + sm120_workspace_bytes(*p) : shared;
}

AttnArgs make_args(const fp4attn_attention_params *p, const AttnPlan &plan, void *workspace) {
  AttnArgs a;
  a.p = *p;
  a.ws = attn_workspace_layout(p, plan, workspace);
  a.vec_q = vector_rows(p->q, p->q_stride, p->head_dim);
  a.vec_k = vector_rows(p->k, p->k_stride, p->head_dim);
  a.vec_v = vector_rows(p->v, p->v_stride, p->head_dim);
  const size_t es = dtype_size(p->dtype);
  a.out_pair = (reinterpret_cast<uintptr_t>(p->out) % (2 * es)) == 0 && p->out_stride[0] % 2 == 0 &&
               p->out_stride[1] % 2 == 0 && p->out_stride[2] % 2 == 0;
  a.vec_out = p->dtype != FP4ATTN_FLOAT32 && vector_rows(p->out, p->out_stride, p->head_dim);
  a.scale_log2 = p->scale * 1.4426950408889634f;
  return a;
}

/* launch(dp) for an instantiated padded head dim (64, 128 or 256), dp a compile-time constant. */
template <typename Launch>
fp4attn_status for_head_dim(int64_t dp, Launch launch) {
  switch (dp) {
    case 64:
      return launch(std::integral_constant<int, 64>{});
    case 128:
      return launch(std::integral_constant<int, 128>{});
    default:
      return launch(std::integral_constant<int, 256>{});
  }
}

/* The INT8 kernels' checks beyond the C API contract, and their kernel (forward or backward). */
fp4attn_status check_int8(const fp4attn_attention_params *p, bool backward, Int8Plan *plan) {
  const fp4attn_status st = check_cuda_attention(p, "int8 attention");
  if (st.code != FP4ATTN_OK) return st;
  if (!p->lse)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "int8 attention: lse must not be null");
  return plan_int8_attention(p, backward, plan);
}

fp4attn_status check_workspace(const void *workspace, const char *what) {
  if (!workspace) return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "%s: workspace is null", what);
  if (reinterpret_cast<uintptr_t>(workspace) & 255u)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "%s: workspace must be 256-byte aligned",
                         what);
  return fp4attn_ok();
}

Int8Args make_int8_args(const fp4attn_attention_params *p, bool backward, const Int8Plan &plan,
                        void *workspace) {
  Int8Args a{};
  a.p = *p;
  a.ws = int8_workspace_layout(p, backward, plan, workspace);
  a.bf16_ops = p->dtype != FP4ATTN_FLOAT16;
  a.vec_q = vector_rows(p->q, p->q_stride, p->head_dim);
  a.vec_k = vector_rows(p->k, p->k_stride, p->head_dim);
  a.vec_v = vector_rows(p->v, p->v_stride, p->head_dim);
  a.vec_out = vector_rows(p->out, p->out_stride, p->head_dim);
  return a;
}

fp4attn_status launch_kernel(const AttnArgs &a, const AttnPlan &plan, void *workspace,
                             cudaStream_t s) {
  switch (plan.kernel) {
    case FP4ATTN_KERNEL_SM90:
      return plan.dp == 64 ? launch_attention_sm90<64>(a, s) : launch_attention_sm90<128>(a, s);
    case FP4ATTN_KERNEL_SM120:
      return launch_attention_sm120(
          a, static_cast<char *>(workspace) + a.ws.bytes + prepass_staging_bytes(a.p), s);
    case FP4ATTN_KERNEL_SM80:
      switch (plan.dp) {
        case 64:
          return launch_attention_sm80<64>(a, s);
        case 128:
          return launch_attention_sm80<128>(a, s);
        default:
          return launch_attention_sm80<256>(a, s);
      }
    default:
      return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "attention: no launcher for kernel %d",
                           (int)plan.kernel);
  }
}

}  // namespace

extern "C" int64_t fp4attn_cuda_attention_workspace_bytes(const fp4attn_attention_params *p) {
  AttnPlan plan;
  if (check_and_plan(p, &plan).code != FP4ATTN_OK) return 0;
  return workspace_bytes(p, plan);
}

extern "C" fp4attn_kernel fp4attn_cuda_attention_kernel(const fp4attn_attention_params *p) {
  AttnPlan plan;
  return check_and_plan(p, &plan).code == FP4ATTN_OK ? plan.kernel : FP4ATTN_KERNEL_AUTO;
}

extern "C" fp4attn_status fp4attn_cuda_attention(const fp4attn_attention_params *p, void *workspace,
                                                 void *stream) {
  AttnPlan plan;
  fp4attn_status st = check_and_plan(p, &plan);
  if (st.code != FP4ATTN_OK) return st;
  st = check_workspace(workspace, "attention");
  if (st.code != FP4ATTN_OK) return st;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (plan.kernel == FP4ATTN_KERNEL_DECODE) return launch_sdpa_decode(*p, plan, workspace, s);
  const AttnArgs a = make_args(p, plan, workspace);
  st = launch_prepass(a, plan.fp16_operands, static_cast<char *>(workspace) + a.ws.bytes, s);
  if (st.code != FP4ATTN_OK) return st;
  return launch_kernel(a, plan, workspace, s);
}

extern "C" int64_t fp4attn_cuda_int8_attention_workspace_bytes(const fp4attn_attention_params *p) {
  Int8Plan plan;
  if (check_int8(p, false, &plan).code != FP4ATTN_OK) return 0;
  return int8_workspace_layout(p, false, plan, nullptr).bytes;
}

extern "C" fp4attn_kernel fp4attn_cuda_int8_attention_kernel(const fp4attn_attention_params *p) {
  Int8Plan plan;
  return check_int8(p, false, &plan).code == FP4ATTN_OK ? plan.kernel : FP4ATTN_KERNEL_AUTO;
}

extern "C" fp4attn_status fp4attn_cuda_int8_attention(const fp4attn_attention_params *p,
                                                      void *workspace, void *stream) {
  Int8Plan plan;
  fp4attn_status st = check_int8(p, false, &plan);
  if (st.code != FP4ATTN_OK) return st;
  st = check_workspace(workspace, "int8 attention");
  if (st.code != FP4ATTN_OK) return st;
  Int8Args a = make_int8_args(p, false, plan, workspace);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  st = launch_int8_prepare(a, false, s);
  if (st.code != FP4ATTN_OK) return st;
  if (plan.kernel == FP4ATTN_KERNEL_SM90)
    return for_head_dim(a.ws.dp, [&](auto dp) { return launch_int8_forward_sm90<dp()>(a, s); });
  return for_head_dim(a.ws.dp, [&](auto dp) { return launch_int8_forward<dp()>(a, s); });
}

namespace {

fp4attn_status check_int8_backward(const fp4attn_int8_backward_params *bp, Int8Plan *plan) {
  if (!bp) return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "int8 backward: null params");
  const fp4attn_status st = check_int8(&bp->fwd, true, plan);
  if (st.code != FP4ATTN_OK) return st;
  if (!bp->grad_out || !bp->dq || !bp->dk || !bp->dv)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT,
                         "int8 backward: grad_out, dq, dk and dv must not be null");
  if (bp->grad_out_stride[0] < 0 || bp->grad_out_stride[1] < 0 || bp->grad_out_stride[2] < 0)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "int8 backward: negative strides");
  plan->deterministic = bp->deterministic != 0;
  return fp4attn_ok();
}

}  // namespace

extern "C" int64_t fp4attn_cuda_int8_attention_backward_workspace_bytes(
    const fp4attn_int8_backward_params *bp) {
  Int8Plan plan;
  if (check_int8_backward(bp, &plan).code != FP4ATTN_OK) return 0;
  return int8_workspace_layout(&bp->fwd, true, plan, nullptr).bytes;
}

extern "C" fp4attn_status fp4attn_cuda_int8_attention_backward(
    const fp4attn_int8_backward_params *bp, void *workspace, void *stream) {
  Int8Plan plan;
  fp4attn_status st = check_int8_backward(bp, &plan);
  if (st.code != FP4ATTN_OK) return st;
  st = check_workspace(workspace, "int8 backward");
  if (st.code != FP4ATTN_OK) return st;
  Int8Args a = make_int8_args(&bp->fwd, true, plan, workspace);
  a.grad_out = bp->grad_out;
  for (int i = 0; i < 3; ++i) a.grad_out_stride[i] = bp->grad_out_stride[i];
  a.vec_do = vector_rows(bp->grad_out, bp->grad_out_stride, bp->fwd.head_dim);
  a.grad_lse = bp->grad_lse;
  a.dq = bp->dq;
  a.dk = bp->dk;
  a.dv = bp->dv;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  st = launch_int8_prepare(a, true, s);
  if (st.code != FP4ATTN_OK) return st;
  if (plan.kernel == FP4ATTN_KERNEL_SM90)
    st = a.ws.dp == 64 ? launch_int8_backward_sm90<64>(a, s) : launch_int8_backward_sm90<128>(a, s);
  else
    st = for_head_dim(a.ws.dp, [&](auto dp) { return launch_int8_backward<dp()>(a, s); });
  if (st.code != FP4ATTN_OK) return st;
  return launch_int8_finish_dq(a, s);
}

extern "C" fp4attn_status fp4attn_cuda_kv_append(const fp4attn_kv_append_params *p, void *stream) {
  const fp4attn_status st = fp4attn_check_kv_append_params(p);
  if (st.code != FP4ATTN_OK) return st;
  return launch_kv_append(*p, static_cast<cudaStream_t>(stream));
}

extern "C" int64_t fp4attn_cuda_decode_workspace_bytes(const fp4attn_decode_params *p) {
  if (fp4attn_check_decode_params(p).code != FP4ATTN_OK) return 0;
  return plan_kv_decode(p).bytes;
}

extern "C" fp4attn_status fp4attn_cuda_decode(const fp4attn_decode_params *p, void *workspace,
                                              void *stream) {
  fp4attn_status st = fp4attn_check_decode_params(p);
  if (st.code != FP4ATTN_OK) return st;
  st = check_workspace(workspace, "decode");
  if (st.code != FP4ATTN_OK) return st;
  return launch_kv_decode(*p, plan_kv_decode(p), workspace, static_cast<cudaStream_t>(stream));
}
