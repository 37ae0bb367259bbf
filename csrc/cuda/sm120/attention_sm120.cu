/*
 * Host entry points of the sm_120a FP4 attention: argument checks, workspace layout, the
 * quantization pre-pass (prepass_sm120.cu) and the attention kernel for the padded head dim
 * (attention_sm120_d{64,128,256}.cu). Never synchronises the host; safe under graph capture.
 */
#include <stdarg.h>
#include <stdio.h>

#include "attention_sm120.h"
#include "fp4attn/checks.h"
#include "mma_fp4.cuh"
#include "sm120_common.cuh"

namespace {

fp4attn_status check(const fp4attn_attention_params *p) {
  const fp4attn_status st = fp4attn_check_attention_params(p);
  if (st.code != FP4ATTN_OK) return st;
  /* grid dimensions of the pre-pass are 32-bit (y: up to 65535) */
  if (p->batch * (p->heads_q + p->heads_kv) > 65535)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                         "batch * (heads_q + heads_kv) must be at most 65535 for the sm120 kernel");
  return fp4attn_ok();
}

__global__ void native_probe_kernel(int *out) {
  *out = FP4ATTN_SM120_NATIVE_MMA;
}

}  // namespace

extern "C" int64_t fp4attn_cuda_attention_sm120_workspace_bytes(const fp4attn_attention_params *p) {
  if (check(p).code != FP4ATTN_OK) return 0;
  return fp4attn_sm120::make_layout(p).total;
}

extern "C" fp4attn_status fp4attn_cuda_attention_sm120(const fp4attn_attention_params *p,
                                                       void *workspace, void *stream) {
  using namespace fp4attn_sm120;
  fp4attn_status st = check(p);
  if (st.code != FP4ATTN_OK) return st;
  const Layout L = make_layout(p);
  const int64_t items = L.B * L.Hq * L.nqb;
  if (items == 0) return st; /* nothing to write */
  if (!workspace && L.total > 0)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "workspace must not be NULL");
  if (((uintptr_t)workspace & 255u) != 0)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "workspace must be 256-byte aligned");
  cudaStream_t s = (cudaStream_t)stream;
  uint8_t *ws = static_cast<uint8_t *>(workspace);
  cudaError_t e = cudaSuccess;
  if (L.Nk > 0) {
    e = run_prepass_sm120(p, L, ws, s);
    if (e != cudaSuccess)
      return fp4attn_error(FP4ATTN_ERR_CUDA, "sm120 attention pre-pass: %s", cudaGetErrorString(e));
  }
  KernelParams kp;
  kp.qc = ws + L.qc;
  kp.qs = ws + L.qs;
  kp.qbar = reinterpret_cast<const float *>(ws + L.qbar);
  kp.lse_shift = reinterpret_cast<const float *>(ws + L.lse_shift);
  const int64_t bq = L.B * L.Hq, bkv = L.B * L.Hkv;
  kp.dec_q = reinterpret_cast<const float *>(ws + L.dec);
  kp.dec_k = kp.dec_q + bq;
  kp.dec_v = kp.dec_k + bkv;
  kp.kc = ws + L.kc;
  kp.ks = ws + L.ks;
  kp.vc = ws + L.vc;
  kp.vs = ws + L.vs;
  kp.k = p->k;
  for (int i = 0; i < 3; ++i) {
    kp.k_stride[i] = p->k_stride[i];
    kp.out_stride[i] = p->out_stride[i];
  }
  {
    const int64_t es = p->dtype == FP4ATTN_FLOAT32 ? 4 : 2, hd = (L.D + 1) / 2;
    kp.k_vec = ((uintptr_t)p->k % 16 == 0) && (p->k_stride[0] * es) % 16 == 0 &&
               (p->k_stride[1] * es) % 16 == 0 && (p->k_stride[2] * es) % 16 == 0 &&
               (hd * es) % 16 == 0 && (L.D % 2 == 0);
  }
  kp.out = p->out;
  kp.lse = p->lse;
  kp.mask = p->mask;
  for (int i = 0; i < 4; ++i) kp.mask_stride[i] = p->mask_stride[i];
  kp.mask_kind = (int)p->mask_kind;
  kp.mask_dtype = (int)p->mask_dtype;
  kp.dtype = (int)p->dtype;
  kp.causal = p->causal ? 1 : 0;
  kp.scale = p->scale;
  kp.B = L.B;
  kp.Hq = L.Hq;
  kp.Hkv = L.Hkv;
  kp.G = L.G;
  kp.Nq = L.Nq;
  kp.Nk = L.Nk;
  kp.D = L.D;
  kp.nqb = L.nqb;
  kp.nq_pad = L.nq_pad;
  kp.nkt = L.nkt;
  kp.num_items = items;

  int dev = 0, sms = 0;
  e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess)
    return fp4attn_error(FP4ATTN_ERR_CUDA, "sm120 attention: %s", cudaGetErrorString(e));
  switch (L.Dp) {
    case 64:
      e = launch_attention_sm120<64>(kp, sms, s);
      break;
    case 128:
      e = launch_attention_sm120<128>(kp, sms, s);
      break;
    default:
      e = launch_attention_sm120<256>(kp, sms, s);
      break;
  }
  if (e != cudaSuccess)
    return fp4attn_error(FP4ATTN_ERR_CUDA, "sm120 attention kernel: %s", cudaGetErrorString(e));
  return st;
}

extern "C" int fp4attn_cuda_sm120_native(void) {
  /* which image the runtime picked for this device: native MMA only in sm_120a/121a code */
  int *d = nullptr, h = 0;
  if (cudaMalloc(&d, sizeof(int)) != cudaSuccess) return 0;
  native_probe_kernel<<<1, 1>>>(d);
  if (cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) h = 0;
  cudaFree(d);
  return h;
}
