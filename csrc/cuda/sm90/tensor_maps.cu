/*
 * The TMA tensor maps of the Hopper kernels, encoded on the host for each call: K^ and V^ in the
 * workspace and Q in the caller's strides (attention_sm90.cuh), the 8-bit codes
 * (int8/forward_sm90.cu).
 */
#include "tensor_maps.h"

namespace fp4attn_cuda {

namespace sm90 {

/* cuTensorMapEncodeTiled through the runtime's driver entry point (the extension does not link
 * libcuda); looked up once. */
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void *f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

/* One tiled map of rank R through `encode` (tensor_map_encoder()): dims innermost first, the byte
 * strides of the outer R - 1 dims, box in elements; no interleave, 256-byte L2 promotion, zero
 * fill out of bounds. */
template <int R>
static CUresult encode_tiled(PFN_cuTensorMapEncodeTiled_v12000 encode, CUtensorMap &map,
                             CUtensorMapDataType type, const void *base,
                             const cuuint64_t (&dims)[R], const cuuint64_t (&strides)[R - 1],
                             const cuuint32_t (&box)[R], CUtensorMapSwizzle swizzle) {
  cuuint32_t elem_strides[R];
  for (int i = 0; i < R; ++i) elem_strides[i] = 1;
  return encode(&map, type, R, const_cast<void *>(base), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

/* encode_tiled with the encoder looked up and failures as errors naming the call (`op`, e.g.
 * "int8 attention") and the map (`what`). */
template <int R>
static fp4attn_status encode_checked(CUtensorMap &map, CUtensorMapDataType type, const void *base,
                                     const cuuint64_t (&dims)[R],
                                     const cuuint64_t (&strides)[R - 1], const cuuint32_t (&box)[R],
                                     CUtensorMapSwizzle swizzle, const char *op, const char *what) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr)
    return fp4attn_error(FP4ATTN_ERR_CUDA,
                         "%s (sm90 kernel): the driver has no cuTensorMapEncodeTiled", op);
  const CUresult r = encode_tiled<R>(encode, map, type, base, dims, strides, box, swizzle);
  if (r != CUDA_SUCCESS)
    return fp4attn_error(FP4ATTN_ERR_CUDA,
                         "%s (sm90 kernel): cuTensorMapEncodeTiled failed for %s (%d)", op, what,
                         (int)r);
  return fp4attn_ok();
}

/* One 3-D map of the workspace's FP16 K^ or V^: boxes of 64 x rows x 1 elements with the 128-byte
 * swizzle. */
static fp4attn_status encode_map(CUtensorMap &map, void *base, const cuuint64_t (&dims)[3],
                                 const cuuint64_t (&strides)[2], cuuint32_t rows,
                                 const char *what) {
  const cuuint32_t box[3] = {64, rows, 1};
  return encode_checked<3>(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, base, dims, strides, box,
                           CU_TENSOR_MAP_SWIZZLE_128B, "attention", what);
}

fp4attn_status encode_tensor_maps(const AttnArgs &a, int64_t dp, CUtensorMap &kmap,
                                  CUtensorMap &vmap) {
  const AttnWorkspace &w = a.ws;
  const cuuint64_t bhk = (cuuint64_t)(a.p.batch * a.p.heads_kv);
  /* K^ [BHk][nkp][dp] */
  const cuuint64_t kdims[3] = {(cuuint64_t)dp, (cuuint64_t)w.nkp, bhk};
  const cuuint64_t kstrides[2] = {(cuuint64_t)dp * 2, (cuuint64_t)(w.nkp * dp * 2)};
  fp4attn_status st = encode_map(kmap, w.kdq, kdims, kstrides, kTile, "K^");
  if (st.code != FP4ATTN_OK) return st;
  /* V^ [BHk][nkt][dp][128]: rows (tile, d) */
  const cuuint64_t vdims[3] = {(cuuint64_t)kTile, (cuuint64_t)(w.nkt * dp), bhk};
  const cuuint64_t vstrides[2] = {(cuuint64_t)kTile * 2, (cuuint64_t)(w.nkt * dp * kTile * 2)};
  return encode_map(vmap, w.vdq, vdims, vstrides, (cuuint32_t)dp, "V^");
}

fp4attn_status encode_byte_map(CUtensorMap &map, const void *base, const cuuint64_t (&dims)[3],
                               const cuuint64_t (&strides)[2], cuuint32_t inner, cuuint32_t rows,
                               const char *what) {
  const cuuint32_t box[3] = {inner, rows, 1};
  return encode_checked<3>(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, base, dims, strides, box,
                           inner == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                           "int8 attention", what);
}

fp4attn_status encode_f32_map(CUtensorMap &map, const void *base, const cuuint64_t (&dims)[3],
                              const cuuint64_t (&strides)[2], cuuint32_t rows, const char *what) {
  const cuuint32_t box[3] = {32, rows, 1};
  return encode_checked<3>(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, base, dims, strides, box,
                           CU_TENSOR_MAP_SWIZZLE_128B, "int8 attention", what);
}

fp4attn_status encode_rows16_map(CUtensorMap &map, const void *base, const uint64_t (&dims)[4],
                                 const uint64_t (&strides)[3], cuuint32_t rows, const char *what) {
  const cuuint64_t d[4] = {dims[0], dims[1], dims[2], dims[3]};
  const cuuint64_t st[3] = {strides[0], strides[1], strides[2]};
  const cuuint32_t box[4] = {64, rows, 1, 1};
  return encode_checked<4>(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, base, d, st, box,
                           CU_TENSOR_MAP_SWIZZLE_128B, "int8 attention", what);
}

bool encode_q_map(const AttnArgs &a, int64_t dp, CUtensorMap &qmap) {
  const fp4attn_attention_params &p = a.p;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (p.dtype == FP4ATTN_FLOAT32 || !a.vec_q || encode == nullptr) return false;
  /* Q {head_dim, Nq, Hq, B} in the caller's strides; boxes of dp x 128 rows land as [128][dp]
   * halves (no swizzle), zero-filled past head_dim and Nq. 16-bit words: FP16 and BF16 alike. */
  const cuuint64_t dims[4] = {(cuuint64_t)p.head_dim, (cuuint64_t)p.len_q, (cuuint64_t)p.heads_q,
                              (cuuint64_t)p.batch};
  const cuuint64_t strides[3] = {(cuuint64_t)p.q_stride[2] * 2, (cuuint64_t)p.q_stride[1] * 2,
                                 (cuuint64_t)p.q_stride[0] * 2};
  const cuuint32_t box[4] = {(cuuint32_t)dp, (cuuint32_t)kTile, 1, 1};
  return encode_tiled<4>(encode, qmap, CU_TENSOR_MAP_DATA_TYPE_UINT16, p.q, dims, strides, box,
                         CU_TENSOR_MAP_SWIZZLE_NONE) == CUDA_SUCCESS;
}

}  // namespace sm90

}  // namespace fp4attn_cuda
