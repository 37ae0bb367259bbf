/*
 * Instantiation of the FP4 attention forward kernel (attention_fwd.cuh) for head dims padded to
 * 64: 128 query rows per block (8 warps), double-buffered FP16 K/V tiles.
 */
#include "attention_fwd.cuh"

namespace fp4attn_cuda {

fp4attn_status launch_attention_fwd_d64(const AttnArgs &a, cudaStream_t s) {
  return launch_attention_fwd<64, 8, 2>(a, s);
}

}  // namespace fp4attn_cuda
