/*
 * FP4 attention on CUDA: argument checks, kernel selection, and the quantization pre-pass.
 *
 * Pre-pass (SPEC 4.1-4.3), three launches, inputs read twice, never written or copied:
 *   1. stats_kernel, one block of 256 threads per 128-row query block and per 128-token K/V
 *      chunk: column sums, minima and maxima (16-byte loads where aligned). A query block gets
 *      its mean qbar and max |Q - qbar| directly (by monotonicity of rounding,
 *      max_j |fl(x_j - c)| = max(|fl(max x - c)|, |fl(c - min x)|), so no second pass over Q);
 *      a K chunk stores its partials, a V chunk its max |V|. Deterministic: fixed-order sums.
 *   2. finalize_kernel, one block per (batch, head): kbar = sum / Nk, the amax of Ks from the
 *      partial min/max, and the global scales of Qs, Ks and V (fp4attn_global_scales).
 *   3. quantize_kv_kernel, one block per (kv head, 128-token tile): Ks^ along D (linear) and
 *      V^ along tokens into the tile-major V^T layout of attention.cuh, through
 *      fp4attn_quantize_block (bit-exact with the CPU backend for the same kbar), written as
 *      the exact FP16 values code * scale that the tensor cores consume.
 * The forward kernel (attention_fwd.cuh) then quantizes each query block itself.
 */
#include "attention.cuh"

#if defined(__has_include)
#if __has_include("sm120/attention_sm120.h")
#include "sm120/attention_sm120.h"
#define FP4ATTN_HAVE_SM120 1
#endif
#endif

using namespace fp4attn_cuda;

namespace {

constexpr int kThreads = 256;

/* Column statistics of `rows` rows x D columns (rows at `base + r * row_stride`), by 256
 * threads: thread (rg, cg) handles E consecutive columns of every RG-th row. Results for
 * column c < D land in red_sum/min/max[c]; |x| maximum in *red_amax when want_abs. */
template <int E>
__device__ void column_stats(const void *base, fp4attn_dtype dt, int64_t row_stride, int64_t rows,
                             int D, bool want_sum, float *sh_sum, float *sh_min, float *sh_max,
                             float *sh_abs) {
  const int CG = (D + E - 1) / E;
  const int RG = kThreads / CG;
  const int tid = threadIdx.x, rg = tid / CG, cg = tid % CG;
  float sum[E], mn[E], mx[E], am = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) sum[e] = 0.0f, mn[e] = INFINITY, mx[e] = -INFINITY;
  if (rg < RG) {
    for (int64_t r = rg; r < rows; r += RG) {
      float v[E];
      const int64_t off = r * row_stride + (int64_t)cg * E;
      if (E == 8) {
        load8_as_float(base, dt, off, true, v);
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) v[e] = load_as_float(base, dt, off + e);
      }
#pragma unroll
      for (int e = 0; e < E; ++e) {
        if (want_sum) {
          sum[e] = __fadd_rn(sum[e], v[e]);
          mn[e] = fminf(mn[e], v[e]);
          mx[e] = fmaxf(mx[e], v[e]);
        } else {
          am = fp4attn_nanmax(am, fabsf(v[e]));
        }
      }
    }
  }
  /* [RG][D] partials in shared memory, reduced in fixed rg order */
  __syncthreads();
  if (rg < RG) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int c = cg * E + e;
      if (c < D) {
        if (want_sum) {
          sh_sum[rg * D + c] = sum[e];
          sh_min[rg * D + c] = mn[e];
          sh_max[rg * D + c] = mx[e];
        } else {
          sh_abs[rg * D + c] = am;
        }
      }
    }
  }
  __syncthreads();
  if (tid < D) {
    if (want_sum) {
      float s = 0.0f, a = INFINITY, b = -INFINITY;
      for (int i = 0; i < RG; ++i) {
        s = __fadd_rn(s, sh_sum[i * D + tid]);
        a = fminf(a, sh_min[i * D + tid]);
        b = fmaxf(b, sh_max[i * D + tid]);
      }
      sh_sum[tid] = s, sh_min[tid] = a, sh_max[tid] = b;
    } else {
      float a = 0.0f;
      for (int i = 0; i < RG; ++i) a = fp4attn_nanmax(a, sh_abs[i * D + tid]);
      sh_abs[tid] = a;
    }
  }
  __syncthreads();
}

/* NaN-propagating max over the block of one value per thread; result valid in every thread. */
__device__ float block_nanmax(float v, float *sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fp4attn_nanmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = 0.0f;
  for (int i = 0; i < (int)(blockDim.x >> 5); ++i) r = fp4attn_nanmax(r, sh[i]);
  return r;
}

__global__ void __launch_bounds__(kThreads) stats_kernel(AttnArgs a) {
  const fp4attn_attention_params &p = a.p;
  const AttnWorkspace &w = a.ws;
  __shared__ float sh_sum[kThreads * 8], sh_min[kThreads * 8], sh_max[kThreads * 8];
  __shared__ float sh_red[32];
  const int D = (int)p.head_dim;
  const int64_t nq_blocks = p.batch * p.heads_q * w.nqb;
  const int64_t bid = blockIdx.x;
  if (bid < nq_blocks) {
    const int64_t bh = bid / w.nqb, qb = bid % w.nqb;
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    const int64_t r0 = qb * kTile, rows = min((int64_t)kTile, p.len_q - r0);
    const char *base = static_cast<const char *>(p.q) +
                       (b * p.q_stride[0] + h * p.q_stride[1] + r0 * p.q_stride[2]) *
                           (int64_t)dtype_size(p.dtype);
    if (a.vec_q)
      column_stats<8>(base, p.dtype, p.q_stride[2], rows, D, true, sh_sum, sh_min, sh_max, nullptr);
    else
      column_stats<1>(base, p.dtype, p.q_stride[2], rows, D, true, sh_sum, sh_min, sh_max, nullptr);
    const int c = threadIdx.x;
    float am = 0.0f;
    if (c < w.dp) {
      float mean = 0.0f;
      if (c < D) {
        mean = __fdiv_rn(sh_sum[c], (float)rows);
        am = fp4attn_nanmax(fabsf(__fsub_rn(sh_max[c], mean)), fabsf(__fsub_rn(mean, sh_min[c])));
        am = fp4attn_nanmax(am, fabsf(mean - mean)); /* NaN mean (NaN/Inf input) -> NaN */
      }
      w.qbar[(bh * w.nqb + qb) * w.dp + c] = mean;
    }
    am = block_nanmax(am, sh_red);
    if (threadIdx.x == 0) w.qamax[bh * w.nqb + qb] = am;
    return;
  }
  const int64_t kid = bid - nq_blocks;
  const int64_t bh = kid / w.nkt, kt = kid % w.nkt;
  const int64_t b = bh / p.heads_kv, h = bh % p.heads_kv;
  const int64_t r0 = kt * kTile, rows = min((int64_t)kTile, p.len_k - r0);
  const int64_t esz = (int64_t)dtype_size(p.dtype);
  const char *kb = static_cast<const char *>(p.k) +
                   (b * p.k_stride[0] + h * p.k_stride[1] + r0 * p.k_stride[2]) * esz;
  if (a.vec_k)
    column_stats<8>(kb, p.dtype, p.k_stride[2], rows, D, true, sh_sum, sh_min, sh_max, nullptr);
  else
    column_stats<1>(kb, p.dtype, p.k_stride[2], rows, D, true, sh_sum, sh_min, sh_max, nullptr);
  const int c = threadIdx.x;
  if (c < D) {
    const int64_t o = (bh * w.nkt + kt) * w.dp + c;
    w.ksum[o] = sh_sum[c];
    w.kmin[o] = sh_min[c];
    w.kmax[o] = sh_max[c];
  }
  const char *vb = static_cast<const char *>(p.v) +
                   (b * p.v_stride[0] + h * p.v_stride[1] + r0 * p.v_stride[2]) * esz;
  if (a.vec_v)
    column_stats<8>(vb, p.dtype, p.v_stride[2], rows, D, false, nullptr, nullptr, nullptr, sh_sum);
  else
    column_stats<1>(vb, p.dtype, p.v_stride[2], rows, D, false, nullptr, nullptr, nullptr, sh_sum);
  const float am = block_nanmax(c < D ? sh_sum[c] : 0.0f, sh_red);
  if (threadIdx.x == 0) w.vamax[bh * w.nkt + kt] = am;
}

__global__ void __launch_bounds__(kThreads) finalize_kernel(AttnArgs a) {
  const fp4attn_attention_params &p = a.p;
  const AttnWorkspace &w = a.ws;
  __shared__ float sh_red[32];
  const int D = (int)p.head_dim;
  const int64_t bhk = p.batch * p.heads_kv;
  const int c = threadIdx.x;
  if ((int64_t)blockIdx.x < bhk) {
    const int64_t bh = blockIdx.x;
    float am = 0.0f;
    if (c < w.dp) {
      float kbar = 0.0f;
      if (c < D) {
        float s = 0.0f, mn = INFINITY, mx = -INFINITY;
        for (int64_t t = 0; t < w.nkt; ++t) {
          const int64_t o = (bh * w.nkt + t) * w.dp + c;
          s = __fadd_rn(s, w.ksum[o]);
          mn = fminf(mn, w.kmin[o]);
          mx = fmaxf(mx, w.kmax[o]);
        }
        kbar = __fdiv_rn(s, (float)p.len_k);
        am = fp4attn_nanmax(fabsf(__fsub_rn(mx, kbar)), fabsf(__fsub_rn(kbar, mn)));
        am = fp4attn_nanmax(am, fabsf(kbar - kbar));
      }
      w.kbar[bh * w.dp + c] = kbar;
    }
    const float kam = block_nanmax(am, sh_red);
    float vam = 0.0f;
    for (int64_t t = c; t < w.nkt; t += blockDim.x) vam = fp4attn_nanmax(vam, w.vamax[bh * w.nkt + t]);
    vam = block_nanmax(vam, sh_red);
    if (c == 0) {
      float enc, dec;
      fp4attn_global_scales(kam, &enc, &dec);
      w.kvscale[bh * 4 + 0] = enc;
      w.kvscale[bh * 4 + 1] = dec;
      fp4attn_global_scales(vam, &enc, &dec);
      w.kvscale[bh * 4 + 2] = enc;
      w.kvscale[bh * 4 + 3] = dec;
    }
    return;
  }
  const int64_t bh = blockIdx.x - bhk;
  float am = 0.0f;
  for (int64_t t = c; t < w.nqb; t += blockDim.x) am = fp4attn_nanmax(am, w.qamax[bh * w.nqb + t]);
  am = block_nanmax(am, sh_red);
  if (c == 0) {
    float enc, dec;
    fp4attn_global_scales(am, &enc, &dec);
    w.qscale[bh * 2 + 0] = enc;
    w.qscale[bh * 2 + 1] = dec;
  }
}

/* 16 codes + scale -> 16 exact FP16 values code * scale, stored as two 16-byte words. */
__device__ __forceinline__ void store_block_f16(__half *dst, const uint8_t *q, uint8_t s) {
  const float sv = fp4attn_e4m3_decode(s);
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
    o[i] = pack_half2(fp4attn_e2m1_decode(q[2 * i]) * sv, fp4attn_e2m1_decode(q[2 * i + 1]) * sv);
  reinterpret_cast<uint4 *>(dst)[0] = make_uint4(o[0], o[1], o[2], o[3]);
  reinterpret_cast<uint4 *>(dst)[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

__global__ void __launch_bounds__(kThreads) quantize_kv_kernel(AttnArgs a) {
  const fp4attn_attention_params &p = a.p;
  const AttnWorkspace &w = a.ws;
  __shared__ float sh_kbar[256];
  const int D = (int)p.head_dim, DP = (int)w.dp;
  const int64_t bh = blockIdx.x / w.nkt, kt = blockIdx.x % w.nkt;
  const int64_t b = bh / p.heads_kv, h = bh % p.heads_kv;
  for (int c = threadIdx.x; c < DP; c += blockDim.x) sh_kbar[c] = w.kbar[bh * DP + c];
  __syncthreads();
  const float enck = w.kvscale[bh * 4 + 0], encv = w.kvscale[bh * 4 + 2];
  const int64_t t0 = kt * kTile;
  /* Ks^: one 16-column block of one token per job */
  const int kblocks = DP / 16;
  for (int job = threadIdx.x; job < kTile * kblocks; job += blockDim.x) {
    const int r = job / kblocks, kb = job % kblocks;
    const int64_t tok = t0 + r;
    float xs[16];
    uint8_t q[16] = {0};
    uint8_t s = 0;
    if (tok < p.len_k && kb * 16 < D) {
      const int64_t base = b * p.k_stride[0] + h * p.k_stride[1] + tok * p.k_stride[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int c0 = kb * 16 + half * 8;
        float v[8];
        if (a.vec_k && c0 + 8 <= D) {
          load8_as_float(p.k, p.dtype, base + c0, true, v);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = c0 + e < D ? load_as_float(p.k, p.dtype, base + c0 + e) : 0.0f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e)
          xs[half * 8 + e] =
              c0 + e < D ? __fmul_rn(__fsub_rn(v[e], sh_kbar[c0 + e]), enck) : 0.0f;
      }
      s = fp4attn_quantize_block(xs, 16, q);
    }
    store_block_f16(w.kdq + (bh * w.nkp + tok) * DP + kb * 16, q, s);
  }
  /* V^: one channel x 16 tokens per job (adjacent threads read adjacent channels) */
  for (int job = threadIdx.x; job < DP * 8; job += blockDim.x) {
    const int d = job % DP, blk = job / DP;
    float xs[16];
    uint8_t q[16] = {0};
    uint8_t s = 0;
    if (d < D && t0 + blk * 16 < p.len_k) {
      const int64_t base = b * p.v_stride[0] + h * p.v_stride[1] + d;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int64_t tok = t0 + blk * 16 + i;
        xs[i] = tok < p.len_k
                    ? __fmul_rn(load_as_float(p.v, p.dtype, base + tok * p.v_stride[2]), encv)
                    : 0.0f;
      }
      s = fp4attn_quantize_block(xs, 16, q);
    }
    store_block_f16(w.vdq + ((bh * w.nkt + kt) * DP + d) * kTile + blk * 16, q, s);
  }
}

bool aligned16(const void *ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

bool vec_ok(const void *ptr, const int64_t *stride, int64_t d) {
  return aligned16(ptr) && d % 8 == 0 && stride[0] % 8 == 0 && stride[1] % 8 == 0 &&
         stride[2] % 8 == 0;
}

bool use_sm120(const fp4attn_attention_params *p) {
#if defined(FP4ATTN_HAVE_SM120)
  if (p->kernel == FP4ATTN_KERNEL_SM120) return true;
  if (p->kernel == FP4ATTN_KERNEL_AUTO && device_major() == 12) return true;
#else
  (void)p;
#endif
  return false;
}

}  // namespace

extern "C" int64_t fp4attn_cuda_attention_workspace_bytes(const fp4attn_attention_params *p) {
  if (!p || fp4attn_check_attention_params(p).code != FP4ATTN_OK) return 0;
  int64_t bytes = attn_workspace_layout(p, nullptr).bytes;
#if defined(FP4ATTN_HAVE_SM120)
  if (p->kernel == FP4ATTN_KERNEL_SM120 || p->kernel == FP4ATTN_KERNEL_AUTO) {
    const int64_t other = fp4attn_cuda_attention_sm120_workspace_bytes(p);
    if (other > bytes) bytes = other;
  }
#endif
  return bytes;
}

extern "C" fp4attn_status fp4attn_cuda_attention(const fp4attn_attention_params *p,
                                                 void *workspace, void *stream) {
  fp4attn_status st = fp4attn_check_attention_params(p);
  if (st.code != FP4ATTN_OK) return st;
  if (p->kernel != FP4ATTN_KERNEL_AUTO && p->kernel != FP4ATTN_KERNEL_FP16_MMA &&
      p->kernel != FP4ATTN_KERNEL_SM120 && p->kernel != FP4ATTN_KERNEL_SM90)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "attention: unknown kernel %d",
                        (int)p->kernel);
  if (use_sm120(p)) {
#if defined(FP4ATTN_HAVE_SM120)
    return fp4attn_cuda_attention_sm120(p, workspace, stream);
#endif
  }
#if !defined(FP4ATTN_HAVE_SM120)
  if (p->kernel == FP4ATTN_KERNEL_SM120)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED,
                        "attention: this build has no sm120 kernel (csrc/cuda/sm120 missing)");
#endif
  if (!workspace)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "attention: workspace is null");
  if (reinterpret_cast<uintptr_t>(workspace) & 255u)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "attention: workspace must be 256-byte aligned");
  if (p->q_stride[0] < 0 || p->q_stride[1] < 0 || p->q_stride[2] < 0 || p->k_stride[2] < 0 ||
      p->v_stride[2] < 0 || p->out_stride[2] < 0)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "attention: negative strides");

  AttnArgs a;
  a.p = *p;
  a.ws = attn_workspace_layout(p, workspace);
  a.vec_q = vec_ok(p->q, p->q_stride, p->head_dim);
  a.vec_k = vec_ok(p->k, p->k_stride, p->head_dim);
  a.vec_v = vec_ok(p->v, p->v_stride, p->head_dim);
  const size_t es = dtype_size(p->dtype);
  a.out_pair = (reinterpret_cast<uintptr_t>(p->out) % (2 * es)) == 0 && p->out_stride[0] % 2 == 0 &&
               p->out_stride[1] % 2 == 0 && p->out_stride[2] % 2 == 0;
  a.scale_log2 = p->scale * 1.4426950408889634f;

  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t nstat = p->batch * p->heads_q * a.ws.nqb + p->batch * p->heads_kv * a.ws.nkt;
  if (nstat > 0x7FFFFFFFLL)
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "attention: problem too large for one grid");
  stats_kernel<<<(unsigned)nstat, kThreads, 0, s>>>(a);
  st = launch_status("attention: stats kernel");
  if (st.code != FP4ATTN_OK) return st;
  finalize_kernel<<<(unsigned)(p->batch * (p->heads_q + p->heads_kv)), kThreads, 0, s>>>(a);
  st = launch_status("attention: finalize kernel");
  if (st.code != FP4ATTN_OK) return st;
  quantize_kv_kernel<<<(unsigned)(p->batch * p->heads_kv * a.ws.nkt), kThreads, 0, s>>>(a);
  st = launch_status("attention: quantize kernel");
  if (st.code != FP4ATTN_OK) return st;
  switch (a.ws.dp) {
    case 64: return launch_attention_fwd_d64(a, s);
    case 128: return launch_attention_fwd_d128(a, s);
    default: return launch_attention_fwd_d256(a, s);
  }
}
