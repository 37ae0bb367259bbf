// The only file that sees torch: op schemas, argument checks, output allocation, and the calls
// into the torch-free C API (fp4attn.h). Nothing here computes; kernels never see torch.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <string>

#ifdef FP4ATTN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include "fp4attn/fp4attn.h"
#ifdef FP4ATTN_WITH_CUDA
#include "testing/testing.h"
#endif

namespace {

// setup.py passes the architecture list as a bare token (80_90a_120a): quotes and semicolons
// would not survive the build's shell.
#define FP4ATTN_STRINGIFY_(x) #x
#define FP4ATTN_STRINGIFY(x) FP4ATTN_STRINGIFY_(x)
#ifdef FP4ATTN_CUDA_ARCHS
#define FP4ATTN_CUDA_ARCHS_STR FP4ATTN_STRINGIFY(FP4ATTN_CUDA_ARCHS)
#else
#define FP4ATTN_CUDA_ARCHS_STR ""
#endif

// Error messages are formatted with snprintf and handed to TORCH_CHECK as one C string, which
// c10 passes through without an ostringstream. Why: on a machine whose g++ is newer than the
// libstdc++ loaded at run time (seen on the H200 image: /opt/gcc g++ 13), number formatting
// through std::ostream compiled into this library calls into an incompatible locale facet and
// crashes (SIGSEGV) instead of raising.
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
[[noreturn]] void fail(bool not_implemented, const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  const char *msg = buf;
  TORCH_CHECK_NOT_IMPLEMENTED(!not_implemented, msg);
  TORCH_CHECK(false, msg);
  std::abort();  // unreachable: both checks above throw
}

#define CHECK_ARG(cond, ...)               \
  do {                                     \
    if (!(cond)) fail(false, __VA_ARGS__); \
  } while (0)

// "[2, 3, 4]" for messages.
std::string shape_str(at::IntArrayRef sizes) {
  std::string out = "[";
  char buf[32];
  for (size_t i = 0; i < sizes.size(); ++i) {
    snprintf(buf, sizeof buf, i ? ", %lld" : "%lld", static_cast<long long>(sizes[i]));
    out += buf;
  }
  return out + "]";
}

const char *dtype_str(at::ScalarType t) {
  return c10::toString(t);
}

void check_status(const fp4attn_status &s) {
  if (s.code == FP4ATTN_ERR_UNSUPPORTED) fail(true, "fp4attn: %s", s.message);
  if (s.code != FP4ATTN_OK) fail(false, "fp4attn: %s", s.message);
}

// The kernel request by its C API name (fp4attn_kernel_name), which Python passes through.
fp4attn_kernel kernel_from_name(c10::string_view name) {
  std::string choices;
  for (int k = 0; k < FP4ATTN_KERNEL_COUNT; ++k) {
    const char *n = fp4attn_kernel_name(static_cast<fp4attn_kernel>(k));
    if (name == n) return static_cast<fp4attn_kernel>(k);
    choices += choices.empty() ? n : std::string(", ") + n;
  }
  fail(false, "cuda_kernel must be one of %s, got '%s'", choices.c_str(),
       std::string(name).c_str());
}

fp4attn_dtype to_c_dtype(at::ScalarType t, const char *arg) {
  switch (t) {
    case at::kFloat:
      return FP4ATTN_FLOAT32;
    case at::kHalf:
      return FP4ATTN_FLOAT16;
    case at::kBFloat16:
      return FP4ATTN_BFLOAT16;
    default:
      fail(false, "%s must be float16, bfloat16 or float32, got %s", arg, dtype_str(t));
  }
  return FP4ATTN_FLOAT32;
}

[[maybe_unused]] bool on_cuda(const at::Tensor &t) {
  return t.device().is_cuda();
}

// ---------------------------------------------------------------- quantize / dequantize

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor &x) {
  CHECK_ARG(x.dim() >= 2, "x must have at least 2 dims [..., rows, cols], got shape %s",
            shape_str(x.sizes()).c_str());
  const fp4attn_dtype dtype = to_c_dtype(x.scalar_type(), "x");
  const int64_t rows = x.size(-2), cols = x.size(-1);
  CHECK_ARG(cols >= 1, "x must have at least one column, got shape %s",
            shape_str(x.sizes()).c_str());
  // A view with unit last-dim stride when possible; reshape copies only if it must. (The matrix
  // count spelled out: -1 is ambiguous for matrices of zero rows.)
  int64_t matrices = 1;
  for (int64_t i = 0; i + 2 < x.dim(); ++i) matrices *= x.size(i);
  at::Tensor x3 = x.reshape({matrices, rows, cols});
  if (x3.stride(2) != 1) x3 = x3.contiguous();
  auto lead = x.sizes().slice(0, x.dim() - 2).vec();
  auto code_shape = lead, scale_shape = lead;
  code_shape.insert(code_shape.end(), {rows, fp4attn_code_bytes(cols)});
  scale_shape.insert(scale_shape.end(), {rows, fp4attn_scale_count(cols)});
  auto u8 = x.options().dtype(at::kByte);
  at::Tensor codes = at::empty(code_shape, u8), scales = at::empty(scale_shape, u8);
  at::Tensor dec = at::empty(lead, x.options().dtype(at::kFloat));
  if (x3.numel() == 0) { /* no values: as an all-zero matrix, dec = 1 (SPEC 2) */
    dec.fill_(1.0f);
    return {codes, scales, dec};
  }
  fp4attn_quantize_params p{};
  p.x = x3.data_ptr();
  p.dtype = dtype;
  p.batch = x3.size(0);
  p.rows = rows;
  p.cols = cols;
  p.x_batch_stride = x3.stride(0);
  p.x_row_stride = x3.stride(1);
  p.codes = codes.data_ptr<uint8_t>();
  p.scales = scales.data_ptr<uint8_t>();
  p.dec = dec.data_ptr<float>();
#ifdef FP4ATTN_WITH_CUDA
  if (on_cuda(x)) {
    c10::cuda::CUDAGuard guard(x.device());
    check_status(fp4attn_cuda_quantize(&p, at::cuda::getCurrentCUDAStream().stream()));
    return {codes, scales, dec};
  }
#endif
  CHECK_ARG(x.device().is_cpu(), "x must be a CPU or CUDA tensor, got %s",
            x.device().str().c_str());
  check_status(fp4attn_cpu_quantize(&p));
  return {codes, scales, dec};
}

void check_quantized(const at::Tensor &codes, const at::Tensor &scales, const at::Tensor &dec,
                     int64_t cols, const char *name) {
  CHECK_ARG(codes.scalar_type() == at::kByte, "%scodes must be uint8, got %s", name,
            dtype_str(codes.scalar_type()));
  CHECK_ARG(scales.scalar_type() == at::kByte || scales.scalar_type() == at::kFloat8_e4m3fn,
            "%sscales must be uint8 or float8_e4m3fn, got %s", name,
            dtype_str(scales.scalar_type()));
  CHECK_ARG(dec.scalar_type() == at::kFloat, "%sdec must be float32, got %s", name,
            dtype_str(dec.scalar_type()));
  CHECK_ARG(cols >= 1, "cols must be >= 1, got %lld", static_cast<long long>(cols));
  CHECK_ARG(codes.dim() >= 2 && codes.size(-1) == fp4attn_code_bytes(cols),
            "%scodes must be [..., rows, %lld] for %lld columns, got %s", name,
            static_cast<long long>(fp4attn_code_bytes(cols)), static_cast<long long>(cols),
            shape_str(codes.sizes()).c_str());
  CHECK_ARG(scales.dim() == codes.dim() &&
                scales.sizes()
                    .slice(0, codes.dim() - 1)
                    .equals(codes.sizes().slice(0, codes.dim() - 1)) &&
                scales.size(-1) == fp4attn_scale_count(cols),
            "%sscales must be [..., rows, %lld] with codes' leading dims %s, got %s", name,
            static_cast<long long>(fp4attn_scale_count(cols)), shape_str(codes.sizes()).c_str(),
            shape_str(scales.sizes()).c_str());
  CHECK_ARG(dec.numel() * codes.size(-2) * codes.size(-1) == codes.numel(),
            "%sdec must hold one scale per matrix, got %s for codes %s", name,
            shape_str(dec.sizes()).c_str(), shape_str(codes.sizes()).c_str());
  CHECK_ARG(codes.device() == scales.device() && codes.device() == dec.device(),
            "%scodes, scales and dec must be on one device", name);
}

at::Tensor dequantize(const at::Tensor &codes, const at::Tensor &scales, const at::Tensor &dec,
                      int64_t cols) {
  check_quantized(codes, scales, dec, cols, "");
  const int64_t rows = codes.size(-2);
  at::Tensor c = codes.contiguous(), s = scales.contiguous().view(at::kByte), d = dec.contiguous();
  auto shape = codes.sizes().vec();
  shape.back() = cols;
  at::Tensor out = at::empty(shape, codes.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  fp4attn_dequantize_params p{};
  p.codes = c.data_ptr<uint8_t>();
  p.scales = s.data_ptr<uint8_t>();
  p.dec = d.data_ptr<float>();
  p.batch = d.numel();
  p.rows = rows;
  p.cols = cols;
  p.out = out.data_ptr<float>();
#ifdef FP4ATTN_WITH_CUDA
  if (on_cuda(codes)) {
    c10::cuda::CUDAGuard guard(codes.device());
    check_status(fp4attn_cuda_dequantize(&p, at::cuda::getCurrentCUDAStream().stream()));
    return out;
  }
#endif
  check_status(fp4attn_cpu_dequantize(&p));
  return out;
}

// ---------------------------------------------------------------- fp4mm

at::Tensor fp4mm(const at::Tensor &a_codes, const at::Tensor &a_scales, const at::Tensor &a_dec,
                 const at::Tensor &b_codes, const at::Tensor &b_scales, const at::Tensor &b_dec,
                 int64_t k, at::ScalarType out_dtype) {
  check_quantized(a_codes, a_scales, a_dec, k, "a_");
  check_quantized(b_codes, b_scales, b_dec, k, "b_");
  CHECK_ARG(a_codes.device() == b_codes.device(),
            "a and b must be on the same device, got %s and %s", a_codes.device().str().c_str(),
            b_codes.device().str().c_str());
  const fp4attn_dtype odt = to_c_dtype(out_dtype, "out_dtype");
  const int64_t m = a_codes.size(-2), n = b_codes.size(-2);
  const int64_t ba = a_dec.numel(), bb = b_dec.numel();
  CHECK_ARG(ba == bb || ba == 1 || bb == 1,
            "a and b must have the same number of matrices (or one of them 1), got %lld and %lld",
            static_cast<long long>(ba), static_cast<long long>(bb));
  auto lead = (ba == bb || bb == 1 ? a_codes : b_codes).sizes().vec(); /* the wider side's */
  lead.resize(lead.size() - 2);
  auto shape = lead;
  shape.insert(shape.end(), {m, n});
  at::Tensor out = at::empty(shape, a_codes.options().dtype(out_dtype));
  if (out.numel() == 0) return out;
  at::Tensor ac = a_codes.contiguous(), as = a_scales.contiguous().view(at::kByte),
             ad = a_dec.contiguous();
  at::Tensor bc = b_codes.contiguous(), bs = b_scales.contiguous().view(at::kByte),
             bd = b_dec.contiguous();
  fp4attn_fp4mm_params p{};
  p.a_codes = ac.data_ptr<uint8_t>();
  p.a_scales = as.data_ptr<uint8_t>();
  p.a_dec = ad.data_ptr<float>();
  p.b_codes = bc.data_ptr<uint8_t>();
  p.b_scales = bs.data_ptr<uint8_t>();
  p.b_dec = bd.data_ptr<float>();
  p.batch = std::max(ba, bb);
  p.m = m;
  p.n = n;
  p.k = k;
  p.a_batch_stride = ba == 1 ? 0 : 1;
  p.b_batch_stride = bb == 1 ? 0 : 1;
  p.out = out.data_ptr();
  p.out_dtype = odt;
#ifdef FP4ATTN_WITH_CUDA
  if (on_cuda(a_codes)) {
    c10::cuda::CUDAGuard guard(a_codes.device());
    check_status(fp4attn_cuda_fp4mm(&p, at::cuda::getCurrentCUDAStream().stream()));
    return out;
  }
#endif
  check_status(fp4attn_cpu_fp4mm(&p));
  return out;
}

// ---------------------------------------------------------------- attention

void fill_strides3(const at::Tensor &t, int64_t *s) {
  s[0] = t.stride(0);
  s[1] = t.stride(1);
  s[2] = t.stride(2);
}

// The tensor-property checks every attention op shares, and the params they fill: q, k, v with
// unit stride along head_dim (a copy otherwise), the mask as a broadcast view. out / lse are the
// caller's to set.
struct AttentionCall {
  at::Tensor q, k, v, mask;
  fp4attn_attention_params p{};
};

AttentionCall prepare_attention(const at::Tensor &q_in, const at::Tensor &k_in,
                                const at::Tensor &v_in, const c10::optional<at::Tensor> &attn_mask,
                                bool is_causal, double scale) {
  CHECK_ARG(q_in.dim() == 4, "query must be 4-D [batch, heads, len_q, head_dim], got shape %s",
            shape_str(q_in.sizes()).c_str());
  CHECK_ARG(k_in.dim() == 4, "key must be 4-D [batch, heads_kv, len_k, head_dim], got shape %s",
            shape_str(k_in.sizes()).c_str());
  CHECK_ARG(v_in.dim() == 4, "value must be 4-D [batch, heads_kv, len_k, head_dim], got shape %s",
            shape_str(v_in.sizes()).c_str());
  const fp4attn_dtype dtype = to_c_dtype(q_in.scalar_type(), "query");
  CHECK_ARG(k_in.scalar_type() == q_in.scalar_type() && v_in.scalar_type() == q_in.scalar_type(),
            "query, key and value must have one dtype, got %s, %s, %s",
            dtype_str(q_in.scalar_type()), dtype_str(k_in.scalar_type()),
            dtype_str(v_in.scalar_type()));
  CHECK_ARG(k_in.device() == q_in.device() && v_in.device() == q_in.device(),
            "query, key and value must be on one device, got %s, %s, %s",
            q_in.device().str().c_str(), k_in.device().str().c_str(), v_in.device().str().c_str());
  const int64_t B = q_in.size(0), Hq = q_in.size(1), Nq = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_in.size(1), Nk = k_in.size(2);
  CHECK_ARG(k_in.size(0) == B && v_in.size(0) == B,
            "key and value batch must equal query batch %lld, got %lld and %lld",
            static_cast<long long>(B), static_cast<long long>(k_in.size(0)),
            static_cast<long long>(v_in.size(0)));
  CHECK_ARG(k_in.size(3) == D, "key head_dim must equal query head_dim %lld, got %lld",
            static_cast<long long>(D), static_cast<long long>(k_in.size(3)));
  CHECK_ARG(v_in.size(3) == D,
            "value head_dim must equal query head_dim %lld (different value head dims are not "
            "supported), got %lld",
            static_cast<long long>(D), static_cast<long long>(v_in.size(3)));
  CHECK_ARG(v_in.size(1) == Hkv && v_in.size(2) == Nk,
            "value must have the shape of key %s, got %s", shape_str(k_in.sizes()).c_str(),
            shape_str(v_in.sizes()).c_str());
  /* checked here, not only by the backends, so that calls with nothing to compute (no keys, no
   * rows) refuse the same shapes */
  CHECK_ARG(Hq == 0 || (Hkv >= 1 && Hq % Hkv == 0),
            "query heads (%lld) must be a multiple of key/value heads (%lld)",
            static_cast<long long>(Hq), static_cast<long long>(Hkv));
  /* head dim 0 only without query rows (an lse would be log(len_k), which no backend writes) */
  CHECK_ARG(D <= FP4ATTN_MAX_HEAD_DIM && (D >= 1 || B * Hq * Nq == 0),
            "head_dim must be in [1, %d], got %lld", FP4ATTN_MAX_HEAD_DIM,
            static_cast<long long>(D));
  AttentionCall c;
  c.q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  c.k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  c.v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  fp4attn_attention_params &p = c.p;
  p.q = c.q.data_ptr();
  p.k = c.k.data_ptr();
  p.v = c.v.data_ptr();
  p.dtype = dtype;
  p.batch = B;
  p.heads_q = Hq;
  p.heads_kv = Hkv;
  p.len_q = Nq;
  p.len_k = Nk;
  p.head_dim = D;
  fill_strides3(c.q, p.q_stride);
  fill_strides3(c.k, p.k_stride);
  fill_strides3(c.v, p.v_stride);
  p.scale = static_cast<float>(scale);
  p.causal = is_causal ? 1 : 0;
  if (attn_mask.has_value() && attn_mask->defined()) {
    const at::Tensor &m = *attn_mask;
    CHECK_ARG(m.device() == c.q.device(), "attn_mask must be on the device of query (%s), got %s",
              c.q.device().str().c_str(), m.device().str().c_str());
    CHECK_ARG(m.dim() <= 4, "attn_mask must have at most 4 dims, got %lld",
              static_cast<long long>(m.dim()));
    if (m.scalar_type() == at::kBool) {
      p.mask_kind = FP4ATTN_MASK_BOOL;
    } else {
      p.mask_kind = FP4ATTN_MASK_ADDITIVE;
      p.mask_dtype = to_c_dtype(m.scalar_type(), "attn_mask");
    }
    const std::vector<int64_t> target{B, Hq, Nq, Nk};
    CHECK_ARG(at::is_expandable_to(m.sizes(), target),
              "attn_mask of shape %s must be broadcastable to [batch, heads, len_q, len_k] = %s",
              shape_str(m.sizes()).c_str(), shape_str(target).c_str());
    c.mask = m.expand(target);  // a view: broadcast dims get stride 0
    p.mask = c.mask.data_ptr();
    for (int i = 0; i < 4; ++i) p.mask_stride[i] = c.mask.size(i) == 1 ? 0 : c.mask.stride(i);
  }
  return c;
}

#ifdef FP4ATTN_WITH_CUDA
// The workspace of a CUDA call, as the C API sizes it (256-byte aligned by the allocator), on
// like's device. Allocated below at::empty, which under torch's deterministic mode fills new
// tensors (to expose reads of uninitialized memory): the kernels write every part of the
// workspace they read, so that fill would only cost a pass over its bytes.
at::Tensor cuda_workspace(int64_t bytes, const at::Tensor &like) {
  CHECK_ARG(bytes >= 0, "fp4attn: could not size the attention workspace");
  return at::Tensor(
      at::detail::empty_cuda({std::max<int64_t>(bytes, 1)}, like.options().dtype(at::kByte)));
}
#endif

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor &q_in, const at::Tensor &k_in,
                                             const at::Tensor &v_in,
                                             const c10::optional<at::Tensor> &attn_mask,
                                             bool is_causal, double scale, bool return_lse,
                                             c10::string_view cuda_kernel) {
  AttentionCall c = prepare_attention(q_in, k_in, v_in, attn_mask, is_causal, scale);
  fp4attn_attention_params &p = c.p;
  const at::Tensor &q = c.q;
  p.kernel = kernel_from_name(cuda_kernel);
  at::Tensor out = at::empty({p.batch, p.heads_q, p.len_q, p.head_dim}, q.options());
  at::Tensor lse = return_lse
                       ? at::empty({p.batch, p.heads_q, p.len_q}, q.options().dtype(at::kFloat))
                       : at::empty({0}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};
  CHECK_ARG(p.len_k >= 1, "key must have at least one token");
  p.out = out.data_ptr();
  p.lse = return_lse ? lse.data_ptr<float>() : nullptr;
  fill_strides3(out, p.out_stride);
#ifdef FP4ATTN_WITH_CUDA
  if (on_cuda(q)) {
    c10::cuda::CUDAGuard guard(q.device());
    at::Tensor workspace = cuda_workspace(fp4attn_cuda_attention_workspace_bytes(&p), q);
    check_status(fp4attn_cuda_attention(&p, workspace.data_ptr(),
                                        at::cuda::getCurrentCUDAStream().stream()));
    return {out, lse};
  }
#endif
  CHECK_ARG(q.device().is_cpu(), "query must be a CPU or CUDA tensor, got %s",
            q.device().str().c_str());
  CHECK_ARG(p.kernel == FP4ATTN_KERNEL_AUTO, "cuda_kernel '%s' needs CUDA tensors",
            fp4attn_kernel_name(p.kernel));
  check_status(fp4attn_cpu_attention(&p));
  return {out, lse};
}

// ---------------------------------------------------------------- 8-bit attention

std::tuple<at::Tensor, at::Tensor> int8_attention(const at::Tensor &q_in, const at::Tensor &k_in,
                                                  const at::Tensor &v_in,
                                                  const c10::optional<at::Tensor> &attn_mask,
                                                  bool is_causal, double scale,
                                                  c10::string_view cuda_kernel) {
  AttentionCall c = prepare_attention(q_in, k_in, v_in, attn_mask, is_causal, scale);
  fp4attn_attention_params &p = c.p;
  p.kernel = kernel_from_name(cuda_kernel);
  // the backends write every element of out and lse; no keys: zeros and -inf
  const bool empty = p.len_k == 0;
  at::Tensor out = empty ? at::zeros({p.batch, p.heads_q, p.len_q, p.head_dim}, c.q.options())
                         : at::empty({p.batch, p.heads_q, p.len_q, p.head_dim}, c.q.options());
  at::Tensor lse =
      empty ? at::full({p.batch, p.heads_q, p.len_q}, -INFINITY, c.q.options().dtype(at::kFloat))
            : at::empty({p.batch, p.heads_q, p.len_q}, c.q.options().dtype(at::kFloat));
  if (out.numel() == 0 || empty) return {out, lse};
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  fill_strides3(out, p.out_stride);
#ifdef FP4ATTN_WITH_CUDA
  if (on_cuda(c.q)) {
    c10::cuda::CUDAGuard guard(c.q.device());
    at::Tensor ws = cuda_workspace(fp4attn_cuda_int8_attention_workspace_bytes(&p), c.q);
    check_status(
        fp4attn_cuda_int8_attention(&p, ws.data_ptr(), at::cuda::getCurrentCUDAStream().stream()));
    return {out, lse};
  }
#endif
  CHECK_ARG(c.q.device().is_cpu(), "query must be a CPU or CUDA tensor, got %s",
            c.q.device().str().c_str());
  CHECK_ARG(p.kernel == FP4ATTN_KERNEL_AUTO, "cuda_kernel '%s' needs CUDA tensors",
            fp4attn_kernel_name(p.kernel));
  check_status(fp4attn_cpu_int8_attention(&p));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_attention_backward(
    const at::Tensor &grad_out_in, const c10::optional<at::Tensor> &grad_lse_in,
    const at::Tensor &q_in, const at::Tensor &k_in, const at::Tensor &v_in,
    const at::Tensor &out_in, const at::Tensor &lse_in, const c10::optional<at::Tensor> &attn_mask,
    bool is_causal, double scale, c10::string_view cuda_kernel) {
  AttentionCall c = prepare_attention(q_in, k_in, v_in, attn_mask, is_causal, scale);
  fp4attn_int8_backward_params bp{};
  bp.fwd = c.p;
  fp4attn_attention_params &p = bp.fwd;
  p.kernel = kernel_from_name(cuda_kernel);
  const std::vector<int64_t> qshape{p.batch, p.heads_q, p.len_q, p.head_dim};
  CHECK_ARG(out_in.sizes() == qshape && out_in.scalar_type() == c.q.scalar_type(),
            "out must be the forward's output %s, got %s", shape_str(qshape).c_str(),
            shape_str(out_in.sizes()).c_str());
  CHECK_ARG(grad_out_in.sizes() == qshape && grad_out_in.scalar_type() == c.q.scalar_type(),
            "grad_out must have the shape and dtype of out %s, got %s", shape_str(qshape).c_str(),
            shape_str(grad_out_in.sizes()).c_str());
  const std::vector<int64_t> lshape{p.batch, p.heads_q, p.len_q};
  CHECK_ARG(lse_in.sizes() == lshape && lse_in.scalar_type() == at::kFloat,
            "lse must be float32 %s, got %s %s", shape_str(lshape).c_str(),
            dtype_str(lse_in.scalar_type()), shape_str(lse_in.sizes()).c_str());
  for (const at::Tensor *t : {&out_in, &grad_out_in, &lse_in})
    CHECK_ARG(t->device() == c.q.device(), "out, grad_out and lse must be on the device of query");
  at::Tensor out = out_in.stride(3) == 1 ? out_in : out_in.contiguous();
  at::Tensor grad_out = grad_out_in.stride(3) == 1 ? grad_out_in : grad_out_in.contiguous();
  at::Tensor lse = lse_in.contiguous(), grad_lse;
  /* the CUDA kernels write every element of the three gradients (dK and dV per key block, zeros
   * where no query sees a key; dQ by finish_dq); the C backend accumulates into zeros */
  const bool written = on_cuda(c.q) && c.q.numel() != 0 && p.len_k != 0;
  const auto alloc = [&](const at::Tensor &like) {
    return written ? at::empty(like.sizes(), like.options())
                   : at::zeros(like.sizes(), like.options());
  };
  at::Tensor dq = alloc(c.q), dk = alloc(c.k), dv = alloc(c.v);
  if (dq.numel() == 0 || p.len_k == 0) return {dq, dk, dv};
  if (grad_lse_in.has_value() && grad_lse_in->defined()) {
    CHECK_ARG(grad_lse_in->sizes() == lshape, "grad_lse must have the shape of lse %s, got %s",
              shape_str(lshape).c_str(), shape_str(grad_lse_in->sizes()).c_str());
    CHECK_ARG(grad_lse_in->device() == c.q.device(), "grad_lse must be on the device of query");
    grad_lse = grad_lse_in->to(at::kFloat).contiguous();
    bp.grad_lse = grad_lse.data_ptr<float>();
  }
  p.out = out.data_ptr();
  fill_strides3(out, p.out_stride);
  p.lse = lse.data_ptr<float>();
  bp.grad_out = grad_out.data_ptr();
  fill_strides3(grad_out, bp.grad_out_stride);
  bp.dq = dq.data_ptr();
  bp.dk = dk.data_ptr();
  bp.dv = dv.data_ptr();
#ifdef FP4ATTN_WITH_CUDA
  if (on_cuda(c.q)) {
    c10::cuda::CUDAGuard guard(c.q.device());
    // torch's deterministic mode: dQ's key blocks added in a fixed order (else in any order)
    bp.deterministic = at::globalContext().deterministicAlgorithms() ? 1 : 0;
    at::Tensor ws = cuda_workspace(fp4attn_cuda_int8_attention_backward_workspace_bytes(&bp), c.q);
    check_status(fp4attn_cuda_int8_attention_backward(&bp, ws.data_ptr(),
                                                      at::cuda::getCurrentCUDAStream().stream()));
    return {dq, dk, dv};
  }
#endif
  CHECK_ARG(c.q.device().is_cpu(), "query must be a CPU or CUDA tensor, got %s",
            c.q.device().str().c_str());
  CHECK_ARG(p.kernel == FP4ATTN_KERNEL_AUTO, "cuda_kernel '%s' needs CUDA tensors",
            fp4attn_kernel_name(p.kernel));
  check_status(fp4attn_cpu_int8_attention_backward(&bp));
  return {dq, dk, dv};
}

// The forward op dispatched below the autograd key (to the device's kernel or the reference).
std::tuple<at::Tensor, at::Tensor> int8_attention_below_autograd(
    const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
    const c10::optional<at::Tensor> &attn_mask, bool is_causal, double scale,
    c10::string_view cuda_kernel) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fp4attn::int8_attention", "")
                             .typed<decltype(int8_attention)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(q, k, v, attn_mask, is_causal, scale, cuda_kernel);
}

// Autograd of the 8-bit attention: saves q, k, v, out, lse and the mask; the backward op
// recomputes the quantized operands (SPEC_INT8 section 3). Both ops go through the dispatcher, so
// other devices reach fp4attn.int8's reference kernels and tracing sees the ops, not this code.
class Int8AttentionFunction : public torch::autograd::Function<Int8AttentionFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx,
                                                const at::Tensor &q, const at::Tensor &k,
                                                const at::Tensor &v,
                                                const c10::optional<at::Tensor> &attn_mask,
                                                bool is_causal, double scale,
                                                const std::string &cuda_kernel) {
    at::Tensor out, lse;
    std::tie(out, lse) =
        int8_attention_below_autograd(q, k, v, attn_mask, is_causal, scale, cuda_kernel);
    ctx->save_for_backward({q, k, v, out, lse, attn_mask.value_or(at::Tensor())});
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["cuda_kernel"] = cuda_kernel;
    return {out, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("fp4attn::int8_attention_backward", "")
                               .typed<decltype(int8_attention_backward)>();
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &out = saved[3];
    const at::Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const c10::optional<at::Tensor> grad_lse =
        grads[1].defined() ? c10::optional<at::Tensor>(grads[1]) : c10::nullopt;
    const c10::optional<at::Tensor> mask =
        saved[5].defined() ? c10::optional<at::Tensor>(saved[5]) : c10::nullopt;
    const std::string cuda_kernel = ctx->saved_data["cuda_kernel"].toStringRef();
    auto [dq, dk, dv] = op.call(grad_out, grad_lse, saved[0], saved[1], saved[2], out, saved[4],
                                mask, ctx->saved_data["is_causal"].toBool(),
                                ctx->saved_data["scale"].toDouble(), cuda_kernel);
    // one entry per forward argument: q, k, v get gradients; mask and the flags none
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> int8_attention_autograd(
    const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
    const c10::optional<at::Tensor> &attn_mask, bool is_causal, double scale,
    c10::string_view cuda_kernel) {
  CHECK_ARG(!(attn_mask.has_value() && attn_mask->defined() && attn_mask->requires_grad()),
            "attn_mask must not require grad with the 8-bit attention: it gets no gradient "
            "(SPEC_INT8 3)");
  if (!at::GradMode::is_enabled() ||
      !(q.requires_grad() || k.requires_grad() || v.requires_grad())) {
    // no graph to record: the kernel below autograd, without the Function's node and saved state
    return int8_attention_below_autograd(q, k, v, attn_mask, is_causal, scale, cuda_kernel);
  }
  torch::autograd::variable_list res =
      Int8AttentionFunction::apply(q, k, v, attn_mask, is_causal, scale, std::string(cuda_kernel));
  return {res[0], res[1]};
}

// ---------------------------------------------------------------- FP4 KV cache (SPEC 6)

// An optional per-sequence int32 [batch] tensor on `device` (mean_from, key_start), or null.
const int32_t *per_sequence_int32(const c10::optional<at::Tensor> &t, int64_t batch,
                                  const at::Device &device, const char *name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  CHECK_ARG(t->dim() == 1 && t->size(0) == batch && t->scalar_type() == at::kInt &&
                t->is_contiguous() && t->device() == device,
            "%s must be a contiguous int32 [batch=%lld] tensor on %s, got %s %s on %s", name,
            static_cast<long long>(batch), device.str().c_str(), dtype_str(t->scalar_type()),
            shape_str(t->sizes()).c_str(), t->device().str().c_str());
  return t->data_ptr<int32_t>();
}

// The cache's storage tensors checked against each other and described for the C API.
fp4attn_kv_cache kv_cache_view(const at::Tensor &k_codes, const at::Tensor &k_scales,
                               const at::Tensor &k_exp, const at::Tensor &v_codes,
                               const at::Tensor &v_scales, const at::Tensor &v_dec,
                               const at::Tensor &kmean, const at::Tensor &kscale,
                               const at::Tensor &block_table) {
  CHECK_ARG(kmean.dim() == 3 && kmean.scalar_type() == at::kFloat && kmean.is_contiguous(),
            "kmean must be a contiguous float32 [batch, heads_kv, head_dim] tensor, got %s %s",
            dtype_str(kmean.scalar_type()), shape_str(kmean.sizes()).c_str());
  const int64_t B = kmean.size(0), H = kmean.size(1), D = kmean.size(2);
  CHECK_ARG(B >= 1 && H >= 1, "kmean must be [batch >= 1, heads_kv >= 1, head_dim], got %s",
            shape_str(kmean.sizes()).c_str());
  CHECK_ARG(kscale.sizes() == kmean.sizes() && kscale.scalar_type() == at::kFloat &&
                kscale.is_contiguous(),
            "kscale must be a contiguous float32 tensor of kmean's shape %s, got %s %s",
            shape_str(kmean.sizes()).c_str(), dtype_str(kscale.scalar_type()),
            shape_str(kscale.sizes()).c_str());
  CHECK_ARG(D >= 1 && D <= FP4ATTN_MAX_HEAD_DIM, "head_dim must be in [1, %d], got %lld",
            FP4ATTN_MAX_HEAD_DIM, static_cast<long long>(D));
  CHECK_ARG(k_codes.dim() == 4 && k_codes.size(1) == H,
            "k_codes must be uint8 [pages, heads_kv=%lld, page_size, %lld], got %s",
            static_cast<long long>(H), static_cast<long long>(fp4attn_k5_code_bytes(D)),
            shape_str(k_codes.sizes()).c_str());
  const int64_t P = k_codes.size(0), page = k_codes.size(2);
  CHECK_ARG(P >= 1 && page >= 1, "k_codes must have pages >= 1 and page_size >= 1, got %s",
            shape_str(k_codes.sizes()).c_str());
  const std::vector<int64_t> dshape{P, H, page};
  const struct {
    const at::Tensor *t;
    const char *name;
    std::vector<int64_t> shape;
    at::ScalarType type;
  } arrays[] = {{&k_codes, "k_codes", {P, H, page, fp4attn_k5_code_bytes(D)}, at::kByte},
                {&k_scales, "k_scales", {P, H, page, fp4attn_k5_scale_count(D)}, at::kByte},
                {&k_exp, "k_exp", dshape, at::kByte},
                {&v_codes, "v_codes", {P, H, page, fp4attn_code_bytes(D)}, at::kByte},
                {&v_scales, "v_scales", {P, H, page, fp4attn_scale_count(D)}, at::kByte},
                {&v_dec, "v_dec", dshape, at::kFloat}};
  for (const auto &a : arrays)
    CHECK_ARG(a.t->sizes() == a.shape && a.t->scalar_type() == a.type && a.t->is_contiguous(),
              "%s must be contiguous %s %s, got %s %s", a.name, dtype_str(a.type),
              shape_str(a.shape).c_str(), dtype_str(a.t->scalar_type()),
              shape_str(a.t->sizes()).c_str());
  CHECK_ARG(block_table.dim() == 2 && block_table.size(0) == B &&
                block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
            "block_table must be a contiguous int32 [batch=%lld, max_pages] tensor, got %s %s",
            static_cast<long long>(B), dtype_str(block_table.scalar_type()),
            shape_str(block_table.sizes()).c_str());
  CHECK_ARG(block_table.size(1) >= 1, "block_table must have max_pages >= 1 columns, got %s",
            shape_str(block_table.sizes()).c_str());
  for (const at::Tensor *t :
       {&k_scales, &k_exp, &v_codes, &v_scales, &v_dec, &kmean, &kscale, &block_table})
    CHECK_ARG(t->device() == k_codes.device(), "the cache's tensors must be on one device");
  if (on_cuda(k_codes)) /* the CUDA kernels load and store the page arrays in 4- to 16-byte words */
    for (const auto &a : arrays)
      CHECK_ARG(reinterpret_cast<uintptr_t>(a.t->data_ptr()) % 16 == 0,
                "%s must start at a 16-byte aligned address on CUDA (a view into a larger tensor "
                "may not)",
                a.name);
  fp4attn_kv_cache c{};
  c.k_codes = k_codes.data_ptr<uint8_t>();
  c.k_scales = k_scales.data_ptr<uint8_t>();
  c.k_exp = k_exp.data_ptr<uint8_t>();
  c.v_codes = v_codes.data_ptr<uint8_t>();
  c.v_scales = v_scales.data_ptr<uint8_t>();
  c.v_dec = v_dec.data_ptr<float>();
  c.kmean = kmean.data_ptr<float>();
  c.kscale = kscale.data_ptr<float>();
  c.block_table = block_table.data_ptr<int32_t>();
  c.batch = B;
  c.heads_kv = H;
  c.head_dim = D;
  c.page_size = page;
  c.max_pages = block_table.size(1);
  c.num_pages = P;
  return c;
}

void kv_append(const at::Tensor &k_in, const at::Tensor &v_in, const at::Tensor &k_codes,
               const at::Tensor &k_scales, const at::Tensor &k_exp, const at::Tensor &v_codes,
               const at::Tensor &v_scales, const at::Tensor &v_dec, const at::Tensor &kmean,
               const at::Tensor &kscale, const at::Tensor &block_table, int64_t start,
               bool set_mean, const std::optional<at::Tensor> &mean_from, int64_t mean_rows) {
  fp4attn_kv_append_params p{};
  p.cache =
      kv_cache_view(k_codes, k_scales, k_exp, v_codes, v_scales, v_dec, kmean, kscale, block_table);
  CHECK_ARG(k_in.dim() == 4 && k_in.size(0) == p.cache.batch && k_in.size(1) == p.cache.heads_kv &&
                k_in.size(3) == p.cache.head_dim,
            "k must be [batch, heads_kv, n, head_dim] = [%lld, %lld, n, %lld], got %s",
            static_cast<long long>(p.cache.batch), static_cast<long long>(p.cache.heads_kv),
            static_cast<long long>(p.cache.head_dim), shape_str(k_in.sizes()).c_str());
  CHECK_ARG(v_in.sizes() == k_in.sizes() && v_in.scalar_type() == k_in.scalar_type(),
            "v must have the shape and dtype of k %s, got %s", shape_str(k_in.sizes()).c_str(),
            shape_str(v_in.sizes()).c_str());
  CHECK_ARG(k_in.device() == k_codes.device() && v_in.device() == k_codes.device(),
            "k and v must be on the cache's device %s", k_codes.device().str().c_str());
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.dtype = to_c_dtype(k.scalar_type(), "k");
  p.len = k.size(2);
  p.start = start;
  fill_strides3(k, p.k_stride);
  fill_strides3(v, p.v_stride);
  p.set_mean = set_mean ? 1 : 0;
  p.mean_from = per_sequence_int32(mean_from, p.cache.batch, k.device(), "mean_from");
  CHECK_ARG(mean_rows >= 0, "mean_rows must be >= 0, got %lld", static_cast<long long>(mean_rows));
  p.mean_rows = mean_rows;
  if (p.len == 0) { /* nothing to store, but the same range check as a store */
    const int64_t cap = p.cache.max_pages * p.cache.page_size;
    CHECK_ARG(start >= 0 && start <= cap,
              "start must be in [0, %lld] (the block table's tokens), got %lld",
              static_cast<long long>(cap), static_cast<long long>(start));
    return;
  }
#ifdef FP4ATTN_WITH_CUDA
  if (on_cuda(k)) {
    c10::cuda::CUDAGuard guard(k.device());
    check_status(fp4attn_cuda_kv_append(&p, at::cuda::getCurrentCUDAStream().stream()));
    return;
  }
#endif
  CHECK_ARG(k.device().is_cpu(), "k must be a CPU or CUDA tensor, got %s",
            k.device().str().c_str());
  check_status(fp4attn_cpu_kv_append(&p));
}

std::tuple<at::Tensor, at::Tensor> decode(
    const at::Tensor &q_in, const at::Tensor &k_codes, const at::Tensor &k_scales,
    const at::Tensor &k_exp, const at::Tensor &v_codes, const at::Tensor &v_scales,
    const at::Tensor &v_dec, const at::Tensor &kmean, const at::Tensor &kscale,
    const at::Tensor &block_table, const at::Tensor &seq_lens, double scale, int64_t window,
    const c10::optional<at::Tensor> &res_k, const c10::optional<at::Tensor> &res_v,
    int64_t residual_len, const c10::optional<at::Tensor> &key_start) {
  fp4attn_decode_params p{};
  CHECK_ARG(window >= 0, "window must be >= 0 (0: no sliding window), got %lld",
            static_cast<long long>(window));
  CHECK_ARG(residual_len >= 0, "residual_len must be >= 0, got %lld",
            static_cast<long long>(residual_len));
  p.cache =
      kv_cache_view(k_codes, k_scales, k_exp, v_codes, v_scales, v_dec, kmean, kscale, block_table);
  CHECK_ARG(q_in.dim() == 4 && q_in.size(0) == p.cache.batch && q_in.size(3) == p.cache.head_dim &&
                q_in.size(1) % p.cache.heads_kv == 0,
            "q must be [batch=%lld, heads_q (a multiple of %lld), len_q, head_dim=%lld], got %s",
            static_cast<long long>(p.cache.batch), static_cast<long long>(p.cache.heads_kv),
            static_cast<long long>(p.cache.head_dim), shape_str(q_in.sizes()).c_str());
  CHECK_ARG(seq_lens.dim() == 1 && seq_lens.size(0) == p.cache.batch &&
                seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
            "seq_lens must be a contiguous int32 [batch=%lld] tensor, got %s %s",
            static_cast<long long>(p.cache.batch), dtype_str(seq_lens.scalar_type()),
            shape_str(seq_lens.sizes()).c_str());
  CHECK_ARG(q_in.device() == k_codes.device() && seq_lens.device() == k_codes.device(),
            "q and seq_lens must be on the cache's device %s", k_codes.device().str().c_str());
  CHECK_ARG(res_k.has_value() == res_v.has_value() && res_k.has_value() == (residual_len > 0),
            "res_k and res_v are given together, exactly when residual_len > 0 (got residual_len "
            "%lld, res_k %s, res_v %s)",
            static_cast<long long>(residual_len), res_k.has_value() ? "given" : "None",
            res_v.has_value() ? "given" : "None");
  if (residual_len > 0) {
    const int64_t slots = res_k->dim() == 4 ? res_k->size(2) : -1;
    for (const at::Tensor *t : {&*res_k, &*res_v})
      CHECK_ARG(t->dim() == 4 && t->size(0) == p.cache.batch && t->size(1) == p.cache.heads_kv &&
                    t->size(2) == slots && slots >= residual_len &&
                    t->size(3) == p.cache.head_dim && t->scalar_type() == q_in.scalar_type() &&
                    t->is_contiguous() && t->device() == k_codes.device(),
                "res_k and res_v must be contiguous %s [batch=%lld, heads_kv=%lld, slots >= "
                "residual_len=%lld, head_dim=%lld] tensors on %s (q's dtype), got %s %s on %s",
                dtype_str(q_in.scalar_type()), static_cast<long long>(p.cache.batch),
                static_cast<long long>(p.cache.heads_kv), static_cast<long long>(residual_len),
                static_cast<long long>(p.cache.head_dim), k_codes.device().str().c_str(),
                dtype_str(t->scalar_type()), shape_str(t->sizes()).c_str(),
                t->device().str().c_str());
    p.res_k = res_k->data_ptr();
    p.res_v = res_v->data_ptr();
    p.residual_len = residual_len;
    p.residual_slots = slots;
  }
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  /* both backends write every element of out and lse (no fill kernels on the decode's path) */
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, lse};
  p.q = q.data_ptr();
  p.dtype = to_c_dtype(q.scalar_type(), "q");
  p.heads_q = q.size(1);
  p.len_q = q.size(2);
  fill_strides3(q, p.q_stride);
  p.out = out.data_ptr();
  fill_strides3(out, p.out_stride);
  p.lse = lse.data_ptr<float>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.scale = static_cast<float>(scale);
  p.window = window;
  p.key_start = per_sequence_int32(key_start, p.cache.batch, q.device(), "key_start");
#ifdef FP4ATTN_WITH_CUDA
  if (on_cuda(q)) {
    c10::cuda::CUDAGuard guard(q.device());
    at::Tensor ws = cuda_workspace(fp4attn_cuda_decode_workspace_bytes(&p), q);
    check_status(fp4attn_cuda_decode(&p, ws.data_ptr(), at::cuda::getCurrentCUDAStream().stream()));
    return {out, lse};
  }
#endif
  CHECK_ARG(q.device().is_cpu(), "q must be a CPU or CUDA tensor, got %s",
            q.device().str().c_str());
  check_status(fp4attn_cpu_decode(&p));
  return {out, lse};
}

#ifdef FP4ATTN_WITH_CUDA
at::Tensor test_mma_fp4(const at::Tensor &a, const at::Tensor &b, const at::Tensor &c,
                        const at::Tensor &sfa, const at::Tensor &sfb, int64_t tid_a,
                        int64_t tid_b) {
  auto check = [](const at::Tensor &t, const char *name, at::ScalarType dt, at::IntArrayRef shape) {
    CHECK_ARG(t.is_cuda() && t.scalar_type() == dt && t.sizes() == shape && t.is_contiguous(),
              "%s must be a contiguous CUDA %s tensor of shape %s, got %s %s on %s", name,
              dtype_str(dt), shape_str(shape).c_str(), dtype_str(t.scalar_type()),
              shape_str(t.sizes()).c_str(), t.device().str().c_str());
  };
  check(a, "a", at::kInt, {32, 4});
  check(b, "b", at::kInt, {32, 2});
  check(c, "c", at::kFloat, {32, 4});
  check(sfa, "sfa", at::kInt, {32});
  check(sfb, "sfb", at::kInt, {32});
  CHECK_ARG(tid_a >= 0 && tid_a <= 1, "tid_a must be 0 or 1, got %lld",
            static_cast<long long>(tid_a));
  CHECK_ARG(tid_b >= 0 && tid_b <= 3, "tid_b must be in [0, 3], got %lld",
            static_cast<long long>(tid_b));
  c10::cuda::CUDAGuard guard(a.device());
  at::Tensor d = at::empty_like(c);
  check_status(fp4attn_testing_mma_fp4(
      reinterpret_cast<const uint32_t *>(a.data_ptr<int32_t>()),
      reinterpret_cast<const uint32_t *>(b.data_ptr<int32_t>()), c.data_ptr<float>(),
      reinterpret_cast<const uint32_t *>(sfa.data_ptr<int32_t>()),
      reinterpret_cast<const uint32_t *>(sfb.data_ptr<int32_t>()), static_cast<int>(tid_a),
      static_cast<int>(tid_b), d.data_ptr<float>(), at::cuda::getCurrentCUDAStream().stream()));
  return d;
}
#endif

}  // namespace

TORCH_LIBRARY(fp4attn, m) {
  m.def("quantize(Tensor x) -> (Tensor codes, Tensor scales, Tensor dec)");
  m.def("dequantize(Tensor codes, Tensor scales, Tensor dec, int cols) -> Tensor");
  m.def(
      "fp4mm(Tensor a_codes, Tensor a_scales, Tensor a_dec, Tensor b_codes, Tensor b_scales, "
      "Tensor b_dec, int k, ScalarType out_dtype) -> Tensor");
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, bool is_causal, float scale, "
      "bool return_lse, str cuda_kernel=\"auto\") -> (Tensor out, Tensor lse)");
  m.def(
      "kv_append(Tensor k, Tensor v, Tensor(a!) k_codes, Tensor(b!) k_scales, Tensor(c!) k_exp, "
      "Tensor(d!) v_codes, Tensor(e!) v_scales, Tensor(f!) v_dec, Tensor(g!) kmean, "
      "Tensor(h!) kscale, Tensor block_table, SymInt start, bool set_mean, Tensor? mean_from=None, "
      "SymInt mean_rows=0) -> ()");
  m.def(
      "decode(Tensor q, Tensor k_codes, Tensor k_scales, Tensor k_exp, Tensor v_codes, "
      "Tensor v_scales, Tensor v_dec, Tensor kmean, Tensor kscale, Tensor block_table, "
      "Tensor seq_lens, float scale, int window=0, Tensor? res_k=None, Tensor? res_v=None, "
      "int residual_len=0, Tensor? key_start=None) -> (Tensor out, Tensor lse)");
  m.def(
      "int8_attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, bool is_causal, "
      "float scale, str cuda_kernel=\"auto\") -> (Tensor out, Tensor lse)");
  m.def(
      "int8_attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, "
      "Tensor out, Tensor lse, Tensor? attn_mask, bool is_causal, float scale, "
      "str cuda_kernel=\"auto\") -> (Tensor dq, Tensor dk, Tensor dv)");
}

// Private test hooks (csrc/testing/testing.h), undocumented; not part of the product's ops.
TORCH_LIBRARY(fp4attn_testing, m) {
  m.def(
      "mma_fp4(Tensor a, Tensor b, Tensor c, Tensor sfa, Tensor sfb, int tid_a, int tid_b) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(fp4attn, CPU, m) {
  m.impl("quantize", &quantize);
  m.impl("dequantize", &dequantize);
  m.impl("fp4mm", &fp4mm);
  m.impl("attention", &attention);
  m.impl("kv_append", &kv_append);
  m.impl("decode", &decode);
  m.impl("int8_attention", &int8_attention);
  m.impl("int8_attention_backward", &int8_attention_backward);
}

// The 8-bit attention's autograd. Every other op has no derivative: a backward through one
// (the 8-bit backward itself: double backward) raises instead of leaving its inputs without a
// gradient. kv_append writes the cache in place and takes no gradient-carrying input.
TORCH_LIBRARY_IMPL(fp4attn, Autograd, m) {
  m.impl("int8_attention", &int8_attention_autograd);
  for (const char *op :
       {"int8_attention_backward", "attention", "quantize", "dequantize", "fp4mm", "decode"})
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
}

// kv_append's writes bump the version counters of the cache tensors it overwrites (the schema's
// mutable arguments), so that autograd refuses a backward through values saved before them, as
// for any in-place op.
static void bump_written_versions(const c10::OperatorHandle &op, c10::DispatchKeySet keys,
                                  torch::jit::Stack *stack) {
  const auto &args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i].alias_info() != nullptr && args[i].alias_info()->isWrite())
      written.push_back((*stack)[first + i].toTensor());
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor &t : written) torch::autograd::impl::bump_version(t);
}

TORCH_LIBRARY_IMPL(fp4attn, ADInplaceOrView, m) {
  m.impl("kv_append", torch::CppFunction::makeFromBoxedFunction<&bump_written_versions>());
}

#ifdef FP4ATTN_WITH_CUDA
TORCH_LIBRARY_IMPL(fp4attn, CUDA, m) {
  m.impl("quantize", &quantize);
  m.impl("dequantize", &dequantize);
  m.impl("fp4mm", &fp4mm);
  m.impl("attention", &attention);
  m.impl("kv_append", &kv_append);
  m.impl("decode", &decode);
  m.impl("int8_attention", &int8_attention);
  m.impl("int8_attention_backward", &int8_attention_backward);
}

TORCH_LIBRARY_IMPL(fp4attn_testing, CUDA, m) {
  m.impl("mma_fp4", &test_mma_fp4);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fp4attn compiled backends (ops are registered under torch.ops.fp4attn)";
  m.def("build_info", []() {
    pybind11::dict info;
#ifdef FP4ATTN_WITH_CUDA
    info["cuda"] = true;
#else
    info["cuda"] = false;
#endif
    info["cuda_archs"] = std::string(FP4ATTN_CUDA_ARCHS_STR);
    info["openmp"] = fp4attn_cpu_has_openmp() != 0;
    return info;
  });
  m.def(
      "attention_kernel",
      [](int64_t device, int64_t head_dim, bool int8) -> std::string {
#ifdef FP4ATTN_WITH_CUDA
        // The dispatch's choice for a call of this head dim on `device` (python -m fp4attn info).
        // Planning reads sizes only; the pointers just have to be non-null.
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
        char placeholder = 0;
        float lse_placeholder = 0.0f;
        fp4attn_attention_params p{};
        p.q = p.k = p.v = p.out = &placeholder;
        p.lse = &lse_placeholder;
        p.dtype = FP4ATTN_FLOAT16;
        p.batch = p.heads_q = p.heads_kv = 1;
        p.len_q = p.len_k = 1024; /* a prefill (decode shapes choose the decode kernel) */
        p.head_dim = head_dim;
        const fp4attn_kernel k =
            int8 ? fp4attn_cuda_int8_attention_kernel(&p) : fp4attn_cuda_attention_kernel(&p);
        return k == FP4ATTN_KERNEL_AUTO ? "none" : fp4attn_kernel_name(k);
#else
        (void)device;
        (void)head_dim;
        (void)int8;
        return "none";
#endif
      },
      "The CUDA attention kernel the dispatch chooses for `head_dim` on `device`, FP4 or (int8) "
      "the 8-bit attention's forward (none: no choice)");
}
