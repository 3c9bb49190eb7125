/* The small ops of a dense decoder layer between its GEMMs, each one call over all of a step's
 * rows (decode or prefill): the residual add with the RMSNorm after it, RoPE in place,
 * SiLU(gate) * up.
 *
 * Why: a decode step of a 135M model has ~20 such ops per layer between its GEMMs; through
 * torch each costs a few microseconds of dispatch and allocation for a few hundred nanoseconds
 * of arithmetic, and they added up to a quarter of the step. A decode step's few rows run on
 * the calling thread (waking the OpenMP team would cost more than their work); from
 * PARALLEL_ROWS rows on (prefill), rows are split over the team. Arithmetic is fp32 whatever
 * the storage dtype (fp32 or bf16, code 0 or 1), with one rounding to bf16 per output value.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vec_exp.h"

enum { F32 = 0, BF16 = 1 };

static void load_row(const void *src, int32_t dtype, int64_t n, float *dst) {
    if (dtype == F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    } else {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int64_t k = 0; k < n; k++) dst[k] = from_bf16(s[k]);
    }
}

static void store_row(const float *src, int32_t dtype, int64_t n, void *dst) {
    if (dtype == F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    } else {
        uint16_t *d = (uint16_t *)dst;
#pragma omp simd
        for (int64_t k = 0; k < n; k++) d[k] = to_bf16(src[k]);
    }
}

#define MAX_COLS 16384 /* a row's fp32 scratch on the stack (64 KiB) */
#define PARALLEL_ROWS 64

/* hidden[r] += addend[r] (if addend), then out[r] = (hidden[r] / rms(hidden[r])) * weight, for
 * rows r; hidden is fp32 [rows, cols] contiguous, addend rows ld_addend apart, out contiguous.
 * Returns 0, or -1 for a dtype or width it does not take. */
int kvmemo_add_rmsnorm(float *hidden, int64_t rows, int64_t cols, const void *addend,
                       int32_t addend_dtype, int64_t ld_addend, const float *weight, float eps,
                       void *out, int32_t out_dtype) {
    if (cols > MAX_COLS || (addend && addend_dtype != F32 && addend_dtype != BF16) ||
        (out_dtype != F32 && out_dtype != BF16))
        return -1;
    const size_t out_size = out_dtype == F32 ? 4 : 2, add_size = addend_dtype == F32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float scratch[MAX_COLS];
        float *h = hidden + r * cols;
        if (addend) {
            load_row((const char *)addend + (size_t)(r * ld_addend) * add_size, addend_dtype,
                     cols, scratch);
#pragma omp simd
            for (int64_t k = 0; k < cols; k++) h[k] += scratch[k];
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t k = 0; k < cols; k++) ss += h[k] * h[k];
        const float scale = 1.0f / sqrtf(ss / (float)cols + eps);
#pragma omp simd
        for (int64_t k = 0; k < cols; k++) scratch[k] = (h[k] * scale) * weight[k];
        store_row(scratch, out_dtype, cols, (char *)out + (size_t)(r * cols) * out_size);
    }
    return 0;
}

/* Rotate-half RoPE in place on each row's first rope_cols columns (whole heads of head_dim):
 * x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin; rows ld apart; cos/sin fp32 [rows, head_dim/2]. */
int kvmemo_rope(void *x, int32_t dtype, int64_t rows, int64_t ld, int64_t rope_cols,
                int64_t head_dim, const float *cos, const float *sin) {
    if ((dtype != F32 && dtype != BF16) || rope_cols > MAX_COLS || head_dim % 2 ||
        rope_cols % head_dim)
        return -1;
    const int64_t half = head_dim / 2;
    const size_t size = dtype == F32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float row[MAX_COLS];
        void *dst = (char *)x + (size_t)(r * ld) * size;
        load_row(dst, dtype, rope_cols, row);
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < rope_cols; h += head_dim) {
            float *a = row + h, *b = a + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
        store_row(row, dtype, rope_cols, dst);
    }
    return 0;
}

/* out[r] = silu(gate[r]) * up[r], computed in fp32 and rounded once; gate and up rows ld_gate
 * and ld_up apart, out [rows, cols] contiguous, all of one dtype. */
int kvmemo_silu_mul(const void *gate, int64_t ld_gate, const void *up, int64_t ld_up,
                    int32_t dtype, int64_t rows, int64_t cols, void *out) {
    if ((dtype != F32 && dtype != BF16) || cols > MAX_COLS) return -1;
    const size_t size = dtype == F32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float g[MAX_COLS], u[MAX_COLS];
        load_row((const char *)gate + (size_t)(r * ld_gate) * size, dtype, cols, g);
        load_row((const char *)up + (size_t)(r * ld_up) * size, dtype, cols, u);
#pragma omp simd
        for (int64_t k = 0; k < cols; k++) g[k] = g[k] / (1.0f + exp_poly(-g[k])) * u[k];
        store_row(g, dtype, cols, (char *)out + (size_t)(r * cols) * size);
    }
    return 0;
}
