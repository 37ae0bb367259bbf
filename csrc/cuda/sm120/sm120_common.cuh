/*
 * Shared pieces of the sm_120a FP4 attention: the workspace layout written by the operand writer
 * (operand_writer.cu) and read by the attention kernel (attention_sm120_kernel.cuh), the K token
 * permutation, and small load helpers.
 *
 * Quantized operands live in kernel-private layouts (SPEC 2 allows them), chosen so that one key
 * tile of 128 tokens is one contiguous block that cp.async copies verbatim into shared memory
 * and every lane then reads its MMA fragment with a single conflict-free 8/16-byte load:
 *
 *   Q codes   [B*Hq][nq_pad][Dp/2]            linear, rows = query tokens
 *   Q scales  [B*Hq][nq_pad][Dp/16]           linear E4M3 bytes
 *   K codes   [B*Hkv][nkt][16 ntile][32 lane][2*NKS words]   fragment order; within each
 *             32-token group the row at position c holds token perm(c) (see below)
 *   K scales  [B*Hkv][nkt][128 pos][Dp/16]    linear over permuted positions
 *   V codes   [B*Hkv][nkt][Dp/8 ntile][32 lane][4 words]     V^T (quantized along tokens),
 *             natural token order, fragment order
 *   V scales  [B*Hkv][nkt][Dp][8]             the 8 token-block scales of each channel
 *
 * with Dp the head dim padded to 64, 128 or 256 (zeros), NKS = Dp/64, nq_pad/nk_pad the lengths
 * rounded up to 128 and nkt = nk_pad/128 key tiles. Padding is zero codes with zero scales.
 */
#ifndef FP4ATTN_SM120_COMMON_CUH
#define FP4ATTN_SM120_COMMON_CUH

#include "../tile/workspace.cuh"

namespace fp4attn_sm120 {

constexpr int kBlockQ = 128;  /* query rows per CTA = SPEC query smoothing block */
constexpr int kBlockKV = 128; /* keys per tile = SPEC key tile (per-tile row max) */
constexpr int kWarps = 8;     /* 16 query rows per warp */
constexpr int kThreads = kWarps * 32;

/* K token permutation inside each 32-token group (an involution). Stored position c holds
 * token perm(c); the QK^T accumulator column c of thread t (c = 8j + 2t + e within the group)
 * is then token 8t + 2j + e: each thread owns 8 consecutive keys, exactly the keys it must
 * supply as the A operand (P) of the PV MMA. Every key index computed from an accumulator
 * position goes through this map. */
__host__ __device__ __forceinline__ int key_perm(int c) {
  return (c & ~31) | (c & 1) | ((c & 24) >> 2) | ((c & 6) << 2);
}

using fp4attn_cuda::load_as_float;
using fp4attn_cuda::padded_head_dim;

/* The sm120 kernel's own workspace sections (byte offsets from their base, which follows the
 * shared sections of tile/workspace.cuh; the means and global scales live there). */
struct Layout {
  int64_t B, Hq, Hkv, G, Nq, Nk, D, Dp;
  int64_t nqb, nq_pad, nkt, nk_pad;
  int64_t qc, qs, lse_shift, kc, ks, vc, vs, dec, total;
};

inline int64_t align256(int64_t x) {
  return (x + 255) / 256 * 256;
}

inline Layout make_layout(const fp4attn_attention_params &p) {
  Layout L;
  L.B = p.batch;
  L.Hq = p.heads_q;
  L.Hkv = p.heads_kv;
  L.G = p.heads_q / p.heads_kv;
  L.Nq = p.len_q;
  L.Nk = p.len_k;
  L.D = p.head_dim;
  L.Dp = padded_head_dim(p.head_dim);
  L.nqb = (L.Nq + kBlockQ - 1) / kBlockQ;
  L.nq_pad = L.nqb * kBlockQ;
  L.nkt = (L.Nk + kBlockKV - 1) / kBlockKV;
  L.nk_pad = L.nkt * kBlockKV;
  const int64_t bq = L.B * L.Hq, bkv = L.B * L.Hkv;
  int64_t o = 0;
  L.qc = o;
  o += align256(bq * L.nq_pad * (L.Dp / 2));
  L.qs = o;
  o += align256(bq * L.nq_pad * (L.Dp / 16));
  L.lse_shift = o;
  o += align256(bq * L.Nq * 4);
  L.kc = o;
  o += align256(bkv * L.nk_pad * (L.Dp / 2));
  L.ks = o;
  o += align256(bkv * L.nk_pad * (L.Dp / 16));
  L.vc = o;
  o += align256(bkv * L.nk_pad * (L.Dp / 2));
  L.vs = o;
  o += align256(bkv * L.nk_pad * (L.Dp / 16));
  L.dec = o;
  o += align256((bq + 2 * bkv) * 4); /* dec of Q heads, then K heads, then V heads */
  L.total = o;
  return L;
}

/* Everything the attention kernel reads; plain values, passed by value: the caller's parameters
 * (the public C API's struct) and this kernel's sections of the workspace. */
struct KernelParams {
  fp4attn_attention_params attn;
  const uint8_t *qc, *qs;
  const float *qbar, *lse_shift, *dec_q, *dec_k, *dec_v;
  const float *vbar; /* [B*Hkv][Dp] V smoothing means (SPEC 4.3), zero beyond D */
  const uint8_t *kc, *ks, *vc, *vs;
  int k_vec; /* K rows and both channel halves are 16-byte aligned: vector loads for qbar . K */
  int64_t G, nqb, nq_pad, nkt;
  int64_t num_items; /* B * Hq * nqb work items, heaviest (last query block) first */
};

/* What the operand writer reads: the caller's tensors and the shared pre-pass's statistics. */
struct WriterInputs {
  const void *q, *k, *v;
  int64_t q_stride[3], k_stride[3], v_stride[3];
  int dtype;
  const float *qbar;    /* [B*Hq][nqb][Dp] */
  const float *kbar;    /* [B*Hkv][Dp] */
  const float *vbar;    /* [B*Hkv][Dp]: V's smoothing mean, subtracted before quantizing */
  const float *qscale;  /* [B*Hq][2]: enc, dec */
  const float *kvscale; /* [B*Hkv][4]: enc, dec of K; enc, dec of V */
};

/* Host side: Q^, K^ and V^ in the layouts above from the shared statistics (SPEC 4.2-4.3), the
 * per-row LSE shift, and the dequantization scales the kernel reads. */
cudaError_t write_operands_sm120(const WriterInputs &in, const Layout &L, uint8_t *ws,
                                 cudaStream_t stream);

/* Host side: launch of the attention kernel for one padded head dim. */
template <int DP>
cudaError_t launch_attention_sm120(const KernelParams &kp, int num_sms, cudaStream_t stream);

}  // namespace fp4attn_sm120

#endif /* FP4ATTN_SM120_COMMON_CUH */
