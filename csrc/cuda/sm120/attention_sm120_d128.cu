/* Instantiation of the sm_120a FP4 attention kernel for head dims padded to 128. */
#include "attention_sm120_kernel.cuh"

namespace fp4attn_sm120 {
template cudaError_t launch_attention_sm120<128>(const KernelParams &, int, cudaStream_t);
}  // namespace fp4attn_sm120
