/* The Hopper wgmma attention kernel for head dims padded to 64 and 128 (one translation unit: the
 * development timeline of trace_events.h is one buffer). */
#include "attention_sm90.cuh"

namespace fp4attn_cuda {
template fp4attn_status launch_attention_sm90<64>(const AttnArgs &a, cudaStream_t s);
template fp4attn_status launch_attention_sm90<128>(const AttnArgs &a, cudaStream_t s);
}  // namespace fp4attn_cuda
