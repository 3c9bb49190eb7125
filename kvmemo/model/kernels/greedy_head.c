/* The exact argmax of x . W^T from a coarse (bf16) product, for greedy decoding.
 *
 * Invariant: out[r] is the smallest index j maximising dot(x[r], W[j]) computed in fp32, given
 * |coarse[r, j] - dot(x[r], W[j])| <= radius[r] * norms[j] for every j (the caller's error
 * bound). Why it is exact: the best token's fp32 logit is at least L = max_k (coarse_k -
 * radius * norm_k), so only tokens with coarse_j + radius * norm_j >= L can reach it; those
 * are recomputed in fp32 and the best taken. A row reads its coarse logits twice and a few
 * dozen fp32 weight rows (7 on average for SmolLM2 in W1, at most ~70), not all 49,152.
 * A row whose bound L is not finite gets -1: the caller computes it in full.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

static float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i]; /* vectorised (-fassociative-math) */
    return acc;
}

#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 bf16x16(const uint16_t *p) {
    __m256i bits = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

/* L = max_j (coarse_j - radius * norms_j): a lower bound of the best fp32 logit. */
static float lower_bound(const uint16_t *c, const float *norms, float radius, int64_t vocab) {
    float low = -INFINITY;
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 neg_radius = _mm512_set1_ps(-radius);
    __m512 acc = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= vocab; j += 16)
        acc = _mm512_max_ps(acc, _mm512_fmadd_ps(neg_radius, _mm512_loadu_ps(norms + j),
                                                 bf16x16(c + j)));
    low = _mm512_reduce_max_ps(acc);
#endif
    for (; j < vocab; j++) {
        float value = from_bf16(c[j]) - radius * norms[j];
        low = value > low ? value : low;
    }
    return low;
}

/* Folds candidate token j into (best, best_j) by its fp32 logit. */
static inline void consider(int64_t j, const float *x, const float *weight, int64_t dim,
                            float *best, int64_t *best_j) {
    float exact = dot(x, weight + j * dim, dim);
    if (exact > *best) { /* ascending j: a tie keeps the smaller index, as argmax does */
        *best = exact;
        *best_j = j;
    }
}

/* coarse: [rows, vocab] bf16 (the bf16 head's product), row stride coarse_ld;
 * norms: [vocab] |W[j]|; radii: [rows], the bound's factor for each row. */
void kvmemo_refine_argmax(const uint16_t *coarse, int64_t rows, int64_t vocab, int64_t coarse_ld,
                          const float *x, int64_t dim, const float *weight, const float *norms,
                          const float *radii, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = coarse + r * coarse_ld;
        const float *xr = x + r * dim;
        const float radius = radii[r];
        const float low = lower_bound(c, norms, radius, vocab);
        if (!isfinite(low) || !isfinite(radius)) {
            out[r] = -1;
            continue;
        }
        float best = -INFINITY;
        int64_t best_j = 0, j = 0;
#if defined(__AVX512F__)
        const __m512 low_v = _mm512_set1_ps(low), radius_v = _mm512_set1_ps(radius);
        for (; j + 16 <= vocab; j += 16) {
            __m512 upper = _mm512_fmadd_ps(radius_v, _mm512_loadu_ps(norms + j), bf16x16(c + j));
            __mmask16 hit = _mm512_cmp_ps_mask(upper, low_v, _CMP_GE_OQ);
            while (hit) {
                int lane = __builtin_ctz(hit);
                hit &= hit - 1;
                consider(j + lane, xr, weight, dim, &best, &best_j);
            }
        }
#endif
        for (; j < vocab; j++)
            if (from_bf16(c[j]) + radius * norms[j] >= low)
                consider(j, xr, weight, dim, &best, &best_j);
        out[r] = best_j;
    }
}
