/*
 * CPU NVFP4 quantization, dequantization and FP4MM (SPEC.md sections 2 and 3).
 *
 * quantize: per slice, one pass for the global amax, then one pass that converts each row to
 * FP32, multiplies by enc and quantizes 16-value blocks (fp4attn_quantize_row). Bit-exact with
 * the reference and the CUDA backend because every rounding goes through numerics.h.
 * fp4mm: operands dequantized exactly (value * scale has at most 6 significant bits) into FP32
 * rows, multiplied with FP32 accumulation; the two global scales are applied in the epilogue.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

int fp4attn_cpu_has_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

fp4attn_status fp4attn_cpu_quantize(const fp4attn_quantize_params *p) {
  if (!p || !p->x || !p->codes || !p->scales || !p->dec)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "quantize: null pointer argument");
  if (!fp4attn_valid_dtype(p->dtype))
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "quantize: unsupported dtype %d", (int)p->dtype);
  if (p->batch < 0 || p->rows < 0 || p->cols < 0)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "quantize: negative size");
  const int64_t code_bytes = fp4attn_code_bytes(p->cols), nscales = fp4attn_scale_count(p->cols);
  int failed = 0;

#pragma omp parallel for schedule(dynamic)
  for (int64_t b = 0; b < p->batch; ++b) {
    float *row = (float *)malloc(sizeof(float) * (size_t)(p->cols > 0 ? p->cols : 1));
    if (!row) {
      failed = 1;
      continue;
    }
    float amax = 0.0f;
    for (int64_t r = 0; r < p->rows; ++r) {
      const int64_t base = b * p->x_batch_stride + r * p->x_row_stride;
      for (int64_t c = 0; c < p->cols; ++c) {
        float v = fp4attn_load(p->x, p->dtype, base + c);
        amax = fp4attn_nanmax(amax, v < 0.0f ? -v : v);
      }
    }
    float enc, dec;
    fp4attn_global_scales(amax, &enc, &dec);
    p->dec[b] = dec;
    for (int64_t r = 0; r < p->rows; ++r) {
      const int64_t base = b * p->x_batch_stride + r * p->x_row_stride;
      for (int64_t c = 0; c < p->cols; ++c) row[c] = fp4attn_load(p->x, p->dtype, base + c);
      const int64_t out_row = b * p->rows + r;
      fp4attn_quantize_row(row, p->cols, enc, p->codes + out_row * code_bytes,
                           p->scales + out_row * nscales);
    }
    free(row);
  }
  if (failed) return fp4attn_error(FP4ATTN_ERR_OUT_OF_MEMORY, "quantize: out of memory");
  return fp4attn_ok();
}

/* Exact FP32 value of element c of a quantized row, without the global scale. */
static inline float block_value(const uint8_t *codes, const uint8_t *scales, int64_t c) {
  uint8_t byte = codes[c >> 1];
  uint8_t code = (c & 1) ? (uint8_t)(byte >> 4) : (uint8_t)(byte & 0xF);
  return fp4attn_e2m1_decode(code) * fp4attn_e4m3_decode(scales[c / FP4ATTN_BLOCK]);
}

fp4attn_status fp4attn_cpu_dequantize(const fp4attn_dequantize_params *p) {
  if (!p || !p->codes || !p->scales || !p->dec || !p->out)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "dequantize: null pointer argument");
  const int64_t code_bytes = fp4attn_code_bytes(p->cols), nscales = fp4attn_scale_count(p->cols);
#pragma omp parallel for schedule(static)
  for (int64_t br = 0; br < p->batch * p->rows; ++br) {
    const float dec = p->dec[br / (p->rows > 0 ? p->rows : 1)];
    const uint8_t *codes = p->codes + br * code_bytes, *scales = p->scales + br * nscales;
    float *out = p->out + br * p->cols;
    for (int64_t c = 0; c < p->cols; ++c) out[c] = block_value(codes, scales, c) * dec;
  }
  return fp4attn_ok();
}

fp4attn_status fp4attn_cpu_fp4mm(const fp4attn_fp4mm_params *p) {
  if (!p || !p->a_codes || !p->a_scales || !p->a_dec || !p->b_codes || !p->b_scales || !p->b_dec ||
      !p->out)
    return fp4attn_error(FP4ATTN_ERR_INVALID_ARGUMENT, "fp4mm: null pointer argument");
  if (!fp4attn_valid_dtype(p->out_dtype))
    return fp4attn_error(FP4ATTN_ERR_UNSUPPORTED, "fp4mm: unsupported out_dtype");
  const int64_t m = p->m, n = p->n, k = p->k;
  const int64_t code_bytes = fp4attn_code_bytes(k), nscales = fp4attn_scale_count(k);
  /* B^T dequantized once per batch entry: [k][n], so the inner loop runs along n. */
  float *bt = (float *)malloc(sizeof(float) * (size_t)(k * n > 0 ? k * n : 1));
  if (!bt) return fp4attn_error(FP4ATTN_ERR_OUT_OF_MEMORY, "fp4mm: out of memory");
  for (int64_t b = 0; b < p->batch; ++b) {
    const int64_t ia = b * p->a_batch_stride, ib = b * p->b_batch_stride;
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t *codes = p->b_codes + (ib * n + j) * code_bytes;
      const uint8_t *scales = p->b_scales + (ib * n + j) * nscales;
      for (int64_t c = 0; c < k; ++c) bt[c * n + j] = block_value(codes, scales, c);
    }
    const float dd = p->a_dec[ia] * p->b_dec[ib];
    int failed = 0;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; ++i) {
      float *acc = (float *)calloc((size_t)(n > 0 ? n : 1), sizeof(float));
      if (!acc) {
        failed = 1;
        continue;
      }
      const uint8_t *codes = p->a_codes + (ia * m + i) * code_bytes;
      const uint8_t *scales = p->a_scales + (ia * m + i) * nscales;
      for (int64_t c = 0; c < k; ++c) {
        const float a = block_value(codes, scales, c);
        const float *brow = bt + c * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) acc[j] += a * brow[j];
      }
      for (int64_t j = 0; j < n; ++j)
        fp4attn_store(p->out, p->out_dtype, (b * m + i) * n + j, dd * acc[j]);
      free(acc);
    }
    if (failed) {
      free(bt);
      return fp4attn_error(FP4ATTN_ERR_OUT_OF_MEMORY, "fp4mm: out of memory");
    }
  }
  free(bt);
  return fp4attn_ok();
}
