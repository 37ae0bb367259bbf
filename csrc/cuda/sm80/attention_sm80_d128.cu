/* The mma.sync attention kernel for head dims padded to 128. */
#include "attention_sm80.cuh"

namespace fp4attn_cuda {
template fp4attn_status launch_attention_sm80<128>(const AttnArgs &a, cudaStream_t s);
}  // namespace fp4attn_cuda
