/*
 * Host side of the sm_120a FP4 attention: the operand writer (operand_writer.cu) from the shared
 * pre-pass's statistics, then the kernel for the padded head dim
 * (attention_sm120_d{64,128,256}.cu). Never synchronises the host; safe under graph capture.
 */
#include "../tile/workspace.cuh"
#include "attention_sm120.h"
#include "sm120_common.cuh"

namespace fp4attn_cuda {

int64_t sm120_workspace_bytes(const fp4attn_attention_params &p) {
  return fp4attn_sm120::make_layout(p).total;
}

fp4attn_status launch_attention_sm120(const AttnArgs &a, void *own, cudaStream_t s) {
  using namespace fp4attn_sm120;
  const fp4attn_attention_params *p = &a.p;
  const Layout L = make_layout(*p);
  uint8_t *ws = static_cast<uint8_t *>(own);
  WriterInputs in;
  in.q = p->q;
  in.k = p->k;
  in.v = p->v;
  for (int i = 0; i < 3; ++i) {
    in.q_stride[i] = p->q_stride[i];
    in.k_stride[i] = p->k_stride[i];
    in.v_stride[i] = p->v_stride[i];
  }
  in.dtype = (int)p->dtype;
  in.qbar = a.ws.qbar;
  in.kbar = a.ws.kbar;
  in.vbar = a.ws.vbar;
  in.qscale = a.ws.qscale;
  in.kvscale = a.ws.kvscale;
  cudaError_t e = write_operands_sm120(in, L, ws, s);
  if (e != cudaSuccess)
    return fp4attn_error(FP4ATTN_ERR_CUDA, "sm120 attention operand writer: %s",
                         cudaGetErrorString(e));

  KernelParams kp;
  kp.qc = ws + L.qc;
  kp.qs = ws + L.qs;
  kp.qbar = a.ws.qbar;
  kp.vbar = a.ws.vbar;
  kp.lse_shift = reinterpret_cast<const float *>(ws + L.lse_shift);
  const int64_t bq = L.B * L.Hq, bkv = L.B * L.Hkv;
  kp.dec_q = reinterpret_cast<const float *>(ws + L.dec);
  kp.dec_k = kp.dec_q + bq;
  kp.dec_v = kp.dec_k + bkv;
  kp.kc = ws + L.kc;
  kp.ks = ws + L.ks;
  kp.vc = ws + L.vc;
  kp.vs = ws + L.vs;
  kp.attn = *p;
  {
    const int64_t es = p->dtype == FP4ATTN_FLOAT32 ? 4 : 2, hd = (L.D + 1) / 2;
    kp.k_vec = ((uintptr_t)p->k % 16 == 0) && (p->k_stride[0] * es) % 16 == 0 &&
               (p->k_stride[1] * es) % 16 == 0 && (p->k_stride[2] * es) % 16 == 0 &&
               (hd * es) % 16 == 0 && (L.D % 2 == 0);
  }
  kp.G = L.G;
  kp.nqb = L.nqb;
  kp.nq_pad = L.nq_pad;
  kp.nkt = L.nkt;
  kp.num_items = bq * L.nqb;

  const int sms = sm_count();
  switch (L.Dp) {
    case 64:
      e = fp4attn_sm120::launch_attention_sm120<64>(kp, sms, s);
      break;
    case 128:
      e = fp4attn_sm120::launch_attention_sm120<128>(kp, sms, s);
      break;
    default:
      e = fp4attn_sm120::launch_attention_sm120<256>(kp, sms, s);
      break;
  }
  if (e != cudaSuccess)
    return fp4attn_error(FP4ATTN_ERR_CUDA, "sm120 attention kernel: %s", cudaGetErrorString(e));
  return fp4attn_ok();
}

}  // namespace fp4attn_cuda
