/* Inverse-CDF sampling from softmax(logits / temperature), one row at a time, without the
 * [rows, vocab] probability and cumulative-sum tensors torch's path materialises.
 *
 * Invariant: with total = sum_j e_j, e_j = exp(x_j / t - max_j(x_j / t)) (0 where x_j = -inf),
 * out[r] is the first j whose running sum e_0 + ... + e_j exceeds uniform[r] * total (the last
 * j with e_j > 0 when rounding leaves the sum short of it): the token Sampler._inverse_cdf
 * draws from softmax + cumsum + searchsorted for the same uniform, up to fp32 rounding of the
 * sums (a zero-probability token is never drawn). A row whose maximum or total is not
 * finite, or whose total is 0, has no usable mass: out[r] is -1. Why: for 64 rows of a
 * 49,152-token vocabulary torch's path is four passes over 12.6 MB (divide, softmax, cumsum,
 * search) and two temporaries; here a row is read twice (max, then exp into a row buffer) and
 * its buffer summed once, all in L2. The sums accumulate in double: a float sum of 49,152
 * terms loses the smallest ones against the running total, and how many depends on how many
 * SIMD lanes share the sum (a plain x86-64 build drew tokens 4e-5 of the CDF away, measured),
 * so the draw would differ from CPU to CPU by more than rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "../../model/kernels/vec_exp.h"

/* Returns 0, or 1 when a row's scratch could not be allocated (the caller uses torch). */
int kvmemo_sample_rows(const float *logits, int64_t rows, int64_t vocab, int64_t ld,
                       const float *temperatures, const float *uniforms, int64_t *out) {
    int failed = 0;
#pragma omp parallel if (rows >= 8)
    {
        /* e_j of the row at hand, kept for the search: one exp per token, not two */
        float *e = malloc(sizeof(float) * (size_t)vocab);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (e == NULL) {
                failed = 1;
                continue;
            }
            const float *x = logits + r * ld;
            /* x * (1 / t), not x / t: the caller's usability check computes max(x) * (1 / t)
             * in fp32 the same way, so both see the same overflow */
            const float inv = 1.0f / temperatures[r];
            float top = -INFINITY;
            for (int64_t j = 0; j < vocab; j++) {
                float y = x[j] * inv;
                top = y > top ? y : top;
            }
            double total = 0.0;
#pragma omp simd reduction(+ : total)
            for (int64_t j = 0; j < vocab; j++) {
                float y = x[j] * inv;
                e[j] = y == -INFINITY ? 0.0f : exp_poly(y - top);
                total += (double)e[j];
            }
            if (!isfinite(top) || !isfinite(total) || !(total > 0.0)) {
                out[r] = -1;
                continue;
            }
            /* The running sum in blocks: a block's sum is vectorised, and only the block
             * holding the target is walked one token at a time. */
            const double target = (double)uniforms[r] * total;
            double running = 0.0;
            int64_t pick = -1;
            for (int64_t j0 = 0; j0 < vocab; j0 += 256) {
                const int64_t end = j0 + 256 < vocab ? j0 + 256 : vocab;
                double block = 0.0;
#pragma omp simd reduction(+ : block)
                for (int64_t j = j0; j < end; j++) block += (double)e[j];
                if (running + block <= target) {
                    running += block;
                    continue;
                }
                int64_t j = j0;
                for (; j < end; j++) {
                    running += (double)e[j];
                    if (running > target) break;
                }
                if (j < end) {
                    pick = j;
                    break;
                }
            }
            /* The running sum ended at or below the target (its rounding differs from the
             * total's): the last token with mass, never a token of zero probability. */
            for (int64_t j = vocab - 1; pick < 0 && j >= 0; j--)
                if (e[j] > 0.0f) pick = j;
            out[r] = pick;
        }
        free(e);
    }
    return failed;
}
