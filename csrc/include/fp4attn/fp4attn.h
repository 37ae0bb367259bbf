/*
 * fp4attn public C API (torch-free).
 *
 * One parameter struct per op. Every entry point returns an fp4attn_status: code 0 means
 * success, otherwise `message` says what was wrong. Nothing here exits, prints or allocates
 * user-visible memory; outputs are written to caller-provided buffers. The CPU entry points
 * (fp4attn_cpu_*) ignore `stream`; the CUDA entry points (fp4attn_cuda_*) enqueue on it
 * (a cudaStream_t passed as void*) and never synchronise the host.
 *
 * Numerics: docs/SPEC.md.
 * All strides and sizes are int64 element counts; the innermost dimension is contiguous. The CUDA
 * entry points assume every buffer's base address is 16-byte aligned (as cudaMalloc and torch's
 * allocator give it); inputs with other strides or offsets are read in place only where the
 * params make that checkable (e.g. attention's strides), outputs and caches are written in
 * vector words.
 */
#ifndef FP4ATTN_FP4ATTN_H
#define FP4ATTN_FP4ATTN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FP4ATTN_BLOCK 16     /* NVFP4 block: 16 values share one E4M3 scale */
#define FP4ATTN_BLOCK_Q 128  /* query smoothing block (SPEC 4.2) */
#define FP4ATTN_BLOCK_KV 128 /* key tile of the online softmax (SPEC 4.5) */
#define FP4ATTN_MAX_HEAD_DIM 256

typedef enum {
  FP4ATTN_OK = 0,
  FP4ATTN_ERR_INVALID_ARGUMENT = 1,
  FP4ATTN_ERR_UNSUPPORTED = 2,
  FP4ATTN_ERR_OUT_OF_MEMORY = 3,
  FP4ATTN_ERR_CUDA = 4,
} fp4attn_code;

typedef struct {
  fp4attn_code code;
  char message[256];
} fp4attn_status;

typedef enum {
  FP4ATTN_FLOAT32 = 0,
  FP4ATTN_FLOAT16 = 1,
  FP4ATTN_BFLOAT16 = 2,
} fp4attn_dtype;

/* Which attention kernel to run (CUDA); the CPU backend has one. AUTO lets the dispatch choose
 * for the device, head dim and build; an explicit request that cannot run is an
 * FP4ATTN_ERR_UNSUPPORTED error, never a silent substitute. Names: fp4attn_kernel_name. */
typedef enum {
  FP4ATTN_KERNEL_AUTO = 0,
  FP4ATTN_KERNEL_SM80 = 1, /* "sm80": mma.sync on exact FP16/BF16 dequantization, sm_80 and newer */
  FP4ATTN_KERNEL_SM120 = 2, /* "sm120": block-scaled FP4 MMA; emulated exactly off Blackwell */
  FP4ATTN_KERNEL_SM90 = 3, /* "sm90": Hopper wgmma + TMA (sm_90a build, capability 9.0, D <= 128) */
  /* "decode": fused split-KV decode for few query rows (len_q <= 128, no attn_mask, fp16/bf16,
   * 16-byte aligned K/V rows with head_dim % 8 == 0), mma.sync, sm_80 and newer: K and V read in
   * their input dtype and quantized in registers, no pre-pass */
  FP4ATTN_KERNEL_DECODE = 4,
} fp4attn_kernel;

#define FP4ATTN_KERNEL_COUNT 5

/* The name of a kernel request ("auto", "sm80", "sm120", "sm90", "decode"); NULL for an invalid
 * value. */
static inline const char *fp4attn_kernel_name(fp4attn_kernel k) {
  switch (k) {
    case FP4ATTN_KERNEL_AUTO:
      return "auto";
    case FP4ATTN_KERNEL_SM80:
      return "sm80";
    case FP4ATTN_KERNEL_SM120:
      return "sm120";
    case FP4ATTN_KERNEL_SM90:
      return "sm90";
    case FP4ATTN_KERNEL_DECODE:
      return "decode";
  }
  return 0;
}

typedef enum {
  FP4ATTN_MASK_NONE = 0,
  FP4ATTN_MASK_BOOL = 1,     /* uint8/bool, nonzero = attend */
  FP4ATTN_MASK_ADDITIVE = 2, /* float added to the scaled scores; dtype in mask_dtype */
} fp4attn_mask_kind;

/* Packed codes per row for `cols` values: ceil(cols/16)*8 bytes; scales per row: ceil(cols/16). */
static inline int64_t fp4attn_code_bytes(int64_t cols) {
  return (cols + 15) / 16 * 8;
}
static inline int64_t fp4attn_scale_count(int64_t cols) {
  return (cols + 15) / 16;
}

/* ---- NVFP4 quantization phi (SPEC 2): `batch` independent slices of rows x cols, each with
 * its own FP32 global scale, quantized along cols. Outputs are contiguous (linear layout). */
typedef struct {
  const void *x;
  fp4attn_dtype dtype;
  int64_t batch, rows, cols;
  int64_t x_batch_stride, x_row_stride; /* elements */
  uint8_t *codes;                       /* [batch, rows, code_bytes(cols)] */
  uint8_t *scales;                      /* [batch, rows, scale_count(cols)] E4M3 bytes */
  float *dec;                           /* [batch] global dequantization scale */
} fp4attn_quantize_params;

/* ---- Dequantization: x' = (value(code) * scale) * dec, float32 [batch, rows, cols]. */
typedef struct {
  const uint8_t *codes;
  const uint8_t *scales;
  const float *dec;
  int64_t batch, rows, cols;
  float *out;
} fp4attn_dequantize_params;

/* ---- FP4MM (SPEC 3): C[b] = A[b] (M x K) times B[b]^T (N x K), both quantized along K.
 * Operands in the linear layout of fp4attn_quantize_params; A/B batch strides may be 0
 * (broadcast). Output [batch, M, N] contiguous in out_dtype. */
typedef struct {
  const uint8_t *a_codes, *a_scales;
  const float *a_dec;
  const uint8_t *b_codes, *b_scales;
  const float *b_dec;
  int64_t batch, m, n, k;
  int64_t a_batch_stride, b_batch_stride; /* in matrices: 0 (broadcast) or 1 */
  void *out;
  fp4attn_dtype out_dtype;
} fp4attn_fp4mm_params;

/* ---- FP4 attention forward (SPEC 4).
 * q [batch, heads_q, len_q, head_dim], k/v [batch, heads_kv, len_k, head_dim], out like q.
 * Strides are (batch, head, token); the head_dim stride is 1. heads_q % heads_kv == 0.
 * The mask is read as mask[b*s0 + h*s1 + i*s2 + j*s3] (stride 0 = broadcast). */
typedef struct {
  const void *q, *k, *v;
  void *out;
  float *lse; /* optional [batch, heads_q, len_q] float32, contiguous; NULL to skip */
  fp4attn_dtype dtype;
  int64_t batch, heads_q, heads_kv, len_q, len_k, head_dim;
  int64_t q_stride[3], k_stride[3], v_stride[3], out_stride[3];
  float scale;
  int causal; /* top-left aligned: query i sees keys j <= i */
  fp4attn_mask_kind mask_kind;
  fp4attn_dtype mask_dtype; /* for FP4ATTN_MASK_ADDITIVE */
  const void *mask;
  int64_t mask_stride[4];
  int num_threads;       /* CPU only: 0 = OpenMP default */
  fp4attn_kernel kernel; /* CUDA only */
} fp4attn_attention_params;

/* ---- 8-bit attention (SPEC_INT8). Forward: fp4attn_attention_params with lse required (always
 * produced); on CUDA `kernel` is AUTO, SM80 (the mma.sync INT8 kernels) or SM90 (wgmma, sm_90a;
 * the backward's at head dim <= 128). Backward: the forward's
 * params with `out` and `lse` as the forward returned them; grad_out like out (its own strides),
 * grad_lse optional (NULL or [batch, heads_q, len_q] float32 contiguous); dq, dk, dv contiguous
 * like q, k, v in dtype. `deterministic` (CUDA): dQ's key blocks are added in one fixed order, so
 * that every call gives the same bits; otherwise in any order (faster). The CPU backend is always
 * deterministic. */
typedef struct {
  fp4attn_attention_params fwd;
  const void *grad_out;
  int64_t grad_out_stride[3];
  const float *grad_lse;
  void *dq, *dk, *dv;
  int deterministic;
} fp4attn_int8_backward_params;

/* The KV cache's key rows (SPEC 6, K5): Dp = head_dim rounded up to 16; 5 Dp/8 code bytes (Dp/2
 * of low nibbles, then Dp/8 of high bits) and ceil(Dp/64) E4M3 scales per row. */
static inline int64_t fp4attn_k5_code_bytes(int64_t head_dim) {
  return (head_dim + 15) / 16 * 10;
}
static inline int64_t fp4attn_k5_scale_count(int64_t head_dim) {
  return ((head_dim + 15) / 16 * 16 + 63) / 64;
}

/* ---- FP4 KV cache (SPEC 6). Paged storage: token t of sequence b is slot t % page_size of page
 * block_table[b * max_pages + t / page_size]; a page holds [heads_kv][page_size] rows: for K,
 * k5_code_bytes(head_dim) codes, k5_scale_count(head_dim) E4M3 scales and one row-scale byte
 * (E8M0); for V, code_bytes(head_dim) codes, scale_count(head_dim) E4M3 scales and one FP32 dec. */
typedef struct {
  uint8_t *k_codes, *k_scales, *k_exp, *v_codes, *v_scales;
  float *v_dec;
  float *kmean;               /* [batch][heads_kv][head_dim] */
  float *kscale;              /* [batch][heads_kv][head_dim]: channel scales */
  const int32_t *block_table; /* [batch][max_pages] */
  int64_t batch, heads_kv, head_dim, page_size, max_pages, num_pages;
} fp4attn_kv_cache;

/* Append `len` tokens to every sequence at positions start .. start + len - 1 (the pages must be
 * in the block table). k, v [batch, heads_kv, len, head_dim] with (batch, head, token) strides.
 * set_mean: kmean and kscale from these tokens' K rows first (the first tokens, SPEC 6): of
 * sequence b the rows mean_from[b] .. min(len, mean_from[b] + mean_rows) - 1 (mean_from NULL: from
 * 0; mean_rows 0: to len), which skips a sequence's left padding; no row: kmean 0, kscale 1. */
typedef struct {
  fp4attn_kv_cache cache;
  const void *k, *v;
  fp4attn_dtype dtype;
  int64_t len, start;
  int64_t k_stride[3], v_stride[3];
  int set_mean;
  const int32_t *mean_from; /* [batch], >= 0, on the tensors' device; or NULL */
  int64_t mean_rows;
  int num_threads; /* CPU only: 0 = OpenMP default */
} fp4attn_kv_append_params;

/* Decode attention on the cache (SPEC 6): q [batch, heads_q, len_q, head_dim] are the last len_q
 * positions of each sequence (seq_lens[b] tokens, a device array on CUDA); out like q; lse
 * optional [batch, heads_q, len_q] float32 contiguous. window > 0: sliding-window attention, each
 * query sees only its last `window` keys (itself included); 0: all keys up to its position.
 * residual_len R > 0: each query reads its newest R keys that are still in the ring of
 * residual_slots S >= R exact rows (res_k, res_v [batch][heads_kv][S][head_dim], contiguous, in
 * `dtype`; token t in slot t % S) instead of their quantized rows; 0: no ring. key_start
 * (int32 [batch] on the tensors' device, or NULL): sequence b's queries see no key before
 * key_start[b] (its left padding; values below 0 act as 0, a row left without keys gives 0 and
 * lse -inf). */
typedef struct {
  fp4attn_kv_cache cache;
  const int32_t *seq_lens;
  const void *q;
  void *out;
  float *lse;
  fp4attn_dtype dtype;
  int64_t heads_q, len_q;
  int64_t q_stride[3], out_stride[3];
  float scale;
  int64_t window;
  const void *res_k, *res_v;
  int64_t residual_len, residual_slots;
  const int32_t *key_start;
  int num_threads; /* CPU only */
} fp4attn_decode_params;

/* CPU backend (csrc/cpu) */
fp4attn_status fp4attn_cpu_quantize(const fp4attn_quantize_params *p);
fp4attn_status fp4attn_cpu_dequantize(const fp4attn_dequantize_params *p);
fp4attn_status fp4attn_cpu_fp4mm(const fp4attn_fp4mm_params *p);
fp4attn_status fp4attn_cpu_attention(const fp4attn_attention_params *p);
fp4attn_status fp4attn_cpu_int8_attention(const fp4attn_attention_params *p);
fp4attn_status fp4attn_cpu_int8_attention_backward(const fp4attn_int8_backward_params *p);
fp4attn_status fp4attn_cpu_kv_append(const fp4attn_kv_append_params *p);
fp4attn_status fp4attn_cpu_decode(const fp4attn_decode_params *p);
/* Non-zero when the CPU backend was compiled with OpenMP. */
int fp4attn_cpu_has_openmp(void);

/* CUDA backend (csrc/cuda). `stream` is a cudaStream_t; work is enqueued on it on the current
 * device, without host synchronisation (safe under CUDA-graph capture). The attention needs a
 * device workspace of fp4attn_cuda_attention_workspace_bytes(p) bytes (256-byte aligned), sized
 * for the current device and for p itself (it depends on the SM count, the kernel chosen, and on
 * whether q, k and v allow 16-byte vector loads: otherwise it holds a staged copy of them): query
 * the size with the params of the call and launch with the same device current. */
fp4attn_status fp4attn_cuda_quantize(const fp4attn_quantize_params *p, void *stream);
fp4attn_status fp4attn_cuda_dequantize(const fp4attn_dequantize_params *p, void *stream);
fp4attn_status fp4attn_cuda_fp4mm(const fp4attn_fp4mm_params *p, void *stream);
int64_t fp4attn_cuda_attention_workspace_bytes(const fp4attn_attention_params *p);
fp4attn_status fp4attn_cuda_attention(const fp4attn_attention_params *p, void *workspace,
                                      void *stream);
/* The kernel fp4attn_cuda_attention would choose for `p` on the current device (AUTO resolved),
 * or FP4ATTN_KERNEL_AUTO where the arguments or the request rule every kernel out. A chosen kernel
 * may still refuse at launch (e.g. too little shared memory for the head dim). */
fp4attn_kernel fp4attn_cuda_attention_kernel(const fp4attn_attention_params *p);
/* The same for fp4attn_cuda_int8_attention (p->lse must be set). */
fp4attn_kernel fp4attn_cuda_int8_attention_kernel(const fp4attn_attention_params *p);
/* 8-bit attention on CUDA (SPEC_INT8), same conventions: a workspace of the size the matching
 * *_workspace_bytes returns for the same params and device (pointers and strides included: the
 * Hopper kernels read a suitably aligned 16-bit V in place, otherwise the workspace holds a copy),
 * nothing synchronised. The backward writes dq, dk, dv (contiguous) from the forward's out and
 * lse. */
int64_t fp4attn_cuda_int8_attention_workspace_bytes(const fp4attn_attention_params *p);
fp4attn_status fp4attn_cuda_int8_attention(const fp4attn_attention_params *p, void *workspace,
                                           void *stream);
int64_t fp4attn_cuda_int8_attention_backward_workspace_bytes(const fp4attn_int8_backward_params *p);
fp4attn_status fp4attn_cuda_int8_attention_backward(const fp4attn_int8_backward_params *p,
                                                    void *workspace, void *stream);
/* The FP4 KV cache on CUDA (SPEC 6): one fused append kernel (plus the mean on a first append);
 * the decode is split-KV with a workspace of fp4attn_cuda_decode_workspace_bytes(p) bytes, its
 * grid fixed by the cache's capacity (max_pages) so that lengths may change between graph
 * replays. */
fp4attn_status fp4attn_cuda_kv_append(const fp4attn_kv_append_params *p, void *stream);
int64_t fp4attn_cuda_decode_workspace_bytes(const fp4attn_decode_params *p);
fp4attn_status fp4attn_cuda_decode(const fp4attn_decode_params *p, void *workspace, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* FP4ATTN_FP4ATTN_H */
