/*
 * The rows of a KV-cache append that set a sequence's K statistics (SPEC 6), shared by the CPU and
 * CUDA backends so that both sum exactly the same rows.
 */
#ifndef FP4ATTN_KV_ROWS_H
#define FP4ATTN_KV_ROWS_H

#include <stdint.h>

#include "numerics.h" /* FP4ATTN_HD */

/* Rows [*lo, *hi) of an append of `len` rows: from `from` (the sequence's padding among them,
 * clamped to [0, len]), at most `mean_rows` of them (0: to len). */
FP4ATTN_HD void fp4attn_kv_mean_rows(int64_t from, int64_t len, int64_t mean_rows, int64_t *lo,
                                     int64_t *hi) {
  *lo = from < 0 ? 0 : (from > len ? len : from);
  *hi = mean_rows > 0 && mean_rows < len - *lo ? *lo + mean_rows : len;
}

#endif /* FP4ATTN_KV_ROWS_H */
