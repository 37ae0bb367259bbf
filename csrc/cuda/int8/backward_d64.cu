#include "backward.cuh"

namespace fp4attn_cuda {
template fp4attn_status launch_int8_backward<64>(const Int8Args &, cudaStream_t);
}
