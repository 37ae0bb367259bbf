/*
 * Instantiation of the FP4 attention forward kernel (attention_fwd.cuh) for head dims padded to
 * 256: 64 query rows per block (4 warps), single-buffered FP16 K/V tiles.
 */
#include "attention_fwd.cuh"

namespace fp4attn_cuda {

fp4attn_status launch_attention_fwd_d256(const AttnArgs &a, cudaStream_t s) {
  if (choose_sm90(a.p, 256) == SM90_UNAVAILABLE) return sm90_unavailable(a.p.head_dim);
  return launch_attention_fwd<256, 4, 1>(a, s);
}

}  // namespace fp4attn_cuda
