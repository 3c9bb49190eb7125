/* Flash attention for CPU prefill: queries against contiguous keys, each row seeing keys
 * [0, limit[row]], with the fp32 log-sum-exp that cascade attention merges by.
 *
 * Why not torch's _scaled_dot_product_flash_attention_for_cpu: it runs at ~125-200 GFLOP/s here
 * in fp32 and bf16 alike (AMD Zen 5, 2 cores), and attention was half of W1's time. This kernel
 * keeps the score tile and the output rows in registers (6 query rows x 64 keys), folds scores
 * into the online softmax 512 keys at a time (one row max and rescale per chunk: per 64-key
 * tile these serial steps cost as much as the products; 603 -> 727 GFLOP/s in bf16 at 3,738
 * rows x 1,024 keys), and in bf16 it multiplies with the CPU's bf16 dot products (AVX512_BF16
 * vdpbf16ps: pairs of bf16, fp32 accumulation), as oneDNN's bf16 GEMMs do.
 *
 * Layout: problem (b, h) has rows q[b, h, 0:M, 0:D] and keys/values [b, h, 0:L, 0:D], each row's
 * D values contiguous (strides in elements). Row r of batch b sees keys j <= limits[b * lim_sb +
 * r] (all L keys when limits is NULL; a limit below 0 counts as 0, above L - 1 as L - 1). Outputs: out[b, h, r,
 * :] fp32 (softmax(q k^T * scale) v) and lse[b, h, r] = log sum_j exp(q.k_j * scale), both
 * contiguous.
 *
 * Numerics: scores, the running max and sum, and the output accumulate in fp32. In bf16 the
 * probabilities are rounded to bf16 before the PV product (as torch's bf16 flash kernel does).
 * exp is Cephes' single-precision polynomial (about 1 ulp).
 *
 * Returns 0, or 1 when this build cannot run the call (no AVX-512, bf16 without AVX512_BF16,
 * D not a multiple of 64, an unknown dtype): the caller then uses torch's kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#define NB 64 /* keys per tile */
#define CT 8  /* tiles per softmax chunk: one row max, rescale and exp pass per CT * NB keys */
#define CW (CT * NB)
#define RB 6  /* query rows per block: 6 x 4 accumulators + 4 loads + 1 broadcast <= 32 zmm */
#define SCRATCH_CAP ((size_t)64 << 20) /* packed K/V kept per thread between calls, at most */

static inline __m512 exp512(__m512 x) {
    /* Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial, times 2^n. */
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 live = _mm512_cmp_ps_mask(x, lo, _CMP_GT_OQ); /* -inf (masked) and underflow: 0 */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 r2 = _mm512_mul_ps(r, r);
    p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

/* ---- packing: one (b, h) problem's keys into tiles the micro-kernels stream ---------------- */

/* Both pack keys j0 <= j < j1 (j0 a multiple of NB) of one problem, so threads can share one
 * problem's tiles; the range holding the last tile also zeroes its padding keys. */

/* fp32: K tile t as [D][NB] (keys contiguous per dimension); V as [Lpad][D]. Zero padded. */
static void pack_f32(const float *k, const float *v, int64_t L, int64_t D, int64_t k_sr,
                     int64_t v_sr, int64_t tiles, float *kp, float *vp, int64_t j0, int64_t j1) {
    if (j1 >= L && L % NB) { /* the last tile's padding keys: zero scores' inputs and values */
        memset(kp + (tiles - 1) * NB * D, 0, sizeof(float) * NB * D);
        memset(vp + L * D, 0, sizeof(float) * (tiles * NB - L) * D);
    }
    j1 = j1 < L ? j1 : L;
    for (int64_t j = j0; j < j1; j++) {
        const float *kr = k + j * k_sr;
        float *dst = kp + (j / NB) * NB * D + (j % NB);
        for (int64_t d = 0; d < D; d++) dst[d * NB] = kr[d];
        memcpy(vp + j * D, v + j * v_sr, sizeof(float) * D);
    }
}

/* bf16: K tile t as [D/2][NB][2] (a key's dimension pair per 32-bit lane); V tile as
 * [NB/2][D][2] (two consecutive keys' values of one dimension per 32-bit lane). */
static void pack_bf16(const uint16_t *k, const uint16_t *v, int64_t L, int64_t D, int64_t k_sr,
                      int64_t v_sr, int64_t tiles, uint32_t *kp, uint16_t *vp, int64_t j0,
                      int64_t j1) {
    if (j1 >= L && L % NB) {
        memset(kp + (tiles - 1) * NB * (D / 2), 0, sizeof(uint32_t) * NB * (D / 2));
        memset(vp + (tiles - 1) * NB * D, 0, sizeof(uint16_t) * NB * D);
    }
    j1 = j1 < L ? j1 : L;
    for (int64_t j = j0; j < j1; j++) {
        const uint32_t *kr = (const uint32_t *)(k + j * k_sr);
        uint32_t *dst = kp + (j / NB) * NB * (D / 2) + (j % NB);
        for (int64_t dp = 0; dp < D / 2; dp++) dst[dp * NB] = kr[dp];
    }
#if defined(__AVX512BW__)
    /* V: two consecutive keys' rows interleaved, 32 dimensions at a time. */
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                            40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33,
                                            1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int64_t j = j0; j < j1; j += 2) {
        const uint16_t *r0 = v + j * v_sr;
        const uint16_t *r1 = j + 1 < L ? v + (j + 1) * v_sr : NULL;
        uint16_t *vdst = vp + (j / NB) * NB * D + ((j % NB) / 2) * D * 2;
        for (int64_t d = 0; d < D; d += 32) {
            __m512i a = _mm512_loadu_si512(r0 + d);
            __m512i b = r1 ? _mm512_loadu_si512(r1 + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(vdst + 2 * d, _mm512_permutex2var_epi16(a, lo_idx, b));
            _mm512_storeu_si512(vdst + 2 * d + 32, _mm512_permutex2var_epi16(a, hi_idx, b));
        }
    }
#else
    for (int64_t j = j0; j < j1; j++) {
        const uint16_t *vr = v + j * v_sr;
        uint16_t *vdst = vp + (j / NB) * NB * D + ((j % NB) / 2) * D * 2 + (j % 2);
        for (int64_t d = 0; d < D; d++) vdst[d * 2] = vr[d];
    }
#endif
}

/* ---- micro-kernels: S[RB][NB] = Q[RB] . K_tile^T;  O[RB][D] += P[RB][NB] . V_tile ----------- */

static inline void qk_f32(const float *const *qr, const float *kt, int64_t D, float *s,
                          int64_t ld) {
    __m512 acc[RB][4];
    for (int r = 0; r < RB; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const float *kd = kt + d * NB;
        __m512 k0 = _mm512_loadu_ps(kd), k1 = _mm512_loadu_ps(kd + 16);
        __m512 k2 = _mm512_loadu_ps(kd + 32), k3 = _mm512_loadu_ps(kd + 48);
#pragma GCC unroll 6
        for (int r = 0; r < RB; r++) {
            __m512 q = _mm512_set1_ps(qr[r][d]);
            acc[r][0] = _mm512_fmadd_ps(q, k0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(q, k1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(q, k2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(q, k3, acc[r][3]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(s + r * ld + 16 * i, acc[r][i]);
}

static inline void pv_f32(const float *p, int64_t ld, int64_t width, const float *vt, int64_t D,
                          float *o) {
    for (int64_t dc = 0; dc < D; dc += 64) {
        __m512 acc[RB][4];
        for (int r = 0; r < RB; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = _mm512_loadu_ps(o + r * D + dc + 16 * i);
        for (int64_t j = 0; j < width; j++) {
            const float *vj = vt + j * D + dc;
            __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
            __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
#pragma GCC unroll 6
            for (int r = 0; r < RB; r++) {
                __m512 pr = _mm512_set1_ps(p[r * ld + j]);
                acc[r][0] = _mm512_fmadd_ps(pr, v0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(pr, v1, acc[r][1]);
                acc[r][2] = _mm512_fmadd_ps(pr, v2, acc[r][2]);
                acc[r][3] = _mm512_fmadd_ps(pr, v3, acc[r][3]);
            }
        }
        for (int r = 0; r < RB; r++)
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(o + r * D + dc + 16 * i, acc[r][i]);
    }
}

#if defined(__AVX512BF16__)
static inline void qk_bf16(const uint16_t *const *qr, const uint32_t *kt, int64_t D, float *s,
                           int64_t ld) {
    __m512 acc[RB][4];
    for (int r = 0; r < RB; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < D / 2; dp++) {
        const uint32_t *kd = kt + dp * NB;
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(kd), k1 = (__m512bh)_mm512_loadu_si512(kd + 16);
        __m512bh k2 = (__m512bh)_mm512_loadu_si512(kd + 32);
        __m512bh k3 = (__m512bh)_mm512_loadu_si512(kd + 48);
#pragma GCC unroll 6
        for (int r = 0; r < RB; r++) {
            uint32_t pair;
            memcpy(&pair, qr[r] + 2 * dp, 4);
            __m512bh q = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], q, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], q, k1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], q, k2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], q, k3);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(s + r * ld + 16 * i, acc[r][i]);
}

static inline void pv_bf16(const uint32_t *p, int64_t ld, int64_t width, const uint16_t *vt,
                           int64_t D, float *o) {
    /* p: [RB][ld] pairs of bf16 probabilities, width / 2 used; vt: [width/2][D][2]. */
    for (int64_t dc = 0; dc < D; dc += 64) {
        __m512 acc[RB][4];
        for (int r = 0; r < RB; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = _mm512_loadu_ps(o + r * D + dc + 16 * i);
        for (int64_t jp = 0; jp < width / 2; jp++) {
            const uint16_t *vj = vt + (jp * D + dc) * 2;
            __m512bh v0 = (__m512bh)_mm512_loadu_si512(vj);
            __m512bh v1 = (__m512bh)_mm512_loadu_si512(vj + 32);
            __m512bh v2 = (__m512bh)_mm512_loadu_si512(vj + 64);
            __m512bh v3 = (__m512bh)_mm512_loadu_si512(vj + 96);
#pragma GCC unroll 6
            for (int r = 0; r < RB; r++) {
                __m512bh pr = (__m512bh)_mm512_set1_epi32((int)p[r * ld + jp]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pr, v0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pr, v1);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], pr, v2);
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], pr, v3);
            }
        }
        for (int r = 0; r < RB; r++)
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(o + r * D + dc + 16 * i, acc[r][i]);
    }
}
#endif

/* ---- softmax step: scale and mask a chunk of scores, fold it into each row's running max/sum -- */

/* s: [RB][CW] raw scores of a chunk of `width` keys (a multiple of NB); visible[r]: keys of the
 * chunk row r sees (<= 0: none). Leaves the probabilities in s (0 where masked), rescales o's
 * rows, updates m and l. Why chunks of CT tiles, not one: the row max, the scalar rescale and
 * the reductions are serial latency per row; over 64 keys they cost as much as the products. */
static inline void online_softmax(float *s, int64_t width, const int64_t *visible, float scale,
                                  float *m, float *l, float *o, int64_t D) {
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < RB; r++) {
        float *sr = s + r * CW;
        int64_t n = visible[r] < width ? visible[r] : width;
        if (n <= 0) {
            memset(sr, 0, sizeof(float) * width);
            continue;
        }
        const int64_t live_vecs = (n + 15) / 16; /* vectors holding a visible key */
        __m512 mx = ninf;
        for (int64_t i = 0; i < live_vecs; i++) {
            int64_t left = n - 16 * i;
            __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
            __m512 x = _mm512_mask_mul_ps(ninf, keep, _mm512_loadu_ps(sr + 16 * i), vscale);
            _mm512_storeu_ps(sr + 16 * i, x);
            mx = _mm512_max_ps(mx, x);
        }
        float chunk_max = _mm512_reduce_max_ps(mx);
        float m_new = chunk_max > m[r] ? chunk_max : m[r];
        float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - m_new);
        __m512 vm = _mm512_set1_ps(m_new), sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < live_vecs; i++) {
            __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * i), vm));
            sum = _mm512_add_ps(sum, p);
            _mm512_storeu_ps(sr + 16 * i, p);
        }
        if (16 * live_vecs < width) memset(sr + 16 * live_vecs, 0, sizeof(float) * (width - 16 * live_vecs));
        l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
        if (alpha != 1.0f) {
            float *orow = o + r * D;
            __m512 va = _mm512_set1_ps(alpha);
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), va));
        }
        m[r] = m_new;
    }
}

#define PACK_CHUNK 4 /* tiles per packing task: a problem's tiles spread over the threads */

/* Every problem's keys and values into kbuf / vbuf (per_problem elements each per problem). */
static void pack_all(const void *k, const void *v, int dtype, int64_t B, int64_t H, int64_t L,
                     int64_t D, int64_t k_sb, int64_t k_sh, int64_t k_sr, int64_t v_sb,
                     int64_t v_sh, int64_t v_sr, char *kbuf, char *vbuf) {
    const int64_t tiles = (L + NB - 1) / NB, per_problem = tiles * NB * D;
    const int64_t chunks = (tiles + PACK_CHUNK - 1) / PACK_CHUNK;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t b = bh / H, h = bh % H;
            const int64_t j0 = c * PACK_CHUNK * NB, j1 = j0 + PACK_CHUNK * NB;
            if (dtype == 0)
                pack_f32((const float *)k + b * k_sb + h * k_sh,
                         (const float *)v + b * v_sb + h * v_sh, L, D, k_sr, v_sr, tiles,
                         (float *)kbuf + bh * per_problem, (float *)vbuf + bh * per_problem,
                         j0, j1);
            else
                pack_bf16((const uint16_t *)k + b * k_sb + h * k_sh,
                          (const uint16_t *)v + b * v_sb + h * v_sh, L, D, k_sr, v_sr, tiles,
                          (uint32_t *)kbuf + bh * per_problem / 2,
                          (uint16_t *)vbuf + bh * per_problem, j0, j1);
        }
}

/* Queries against packed keys and values (pack_all's layout); out and lse as documented above. */
static void attend(const void *q, const char *kbuf, const char *vbuf, int dtype, int64_t B,
                   int64_t H, int64_t M, int64_t L, int64_t D, int64_t q_sb, int64_t q_sh,
                   int64_t q_sr, const int64_t *limits, int64_t lim_sb, float scale, float *out,
                   float *lse) {
    const int64_t tiles = (L + NB - 1) / NB, per_problem = tiles * NB * D;
    const int64_t esize = dtype == 0 ? 4 : 2;
    const int64_t row_blocks = (M + RB - 1) / RB;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t bh = 0; bh < B * H; bh++)
        for (int64_t rb = 0; rb < row_blocks; rb++) {
            const int64_t b = bh / H, h = bh % H, r0 = rb * RB;
            float o[RB * 512], s[RB * CW], m[RB], l[RB];
            int64_t limit[RB];
            const void *rows[RB];
            int64_t max_limit = 0;
            for (int r = 0; r < RB; r++) {
                int64_t row = r0 + r < M ? r0 + r : M - 1; /* padding rows repeat the last */
                int64_t lim = limits ? limits[b * lim_sb + row] : L - 1;
                lim = lim < L - 1 ? lim : L - 1;
                lim = lim > 0 ? lim : 0; /* every row sees key 0 at least (never a 0/0 row) */
                limit[r] = r0 + r < M ? lim : -1;
                if (limit[r] > max_limit) max_limit = limit[r];
                rows[r] = (const char *)q + (b * q_sb + h * q_sh + row * q_sr) * esize;
                m[r] = -INFINITY;
                l[r] = 0.0f;
            }
            memset(o, 0, sizeof(float) * RB * D);
            const int64_t used_tiles = max_limit / NB + 1; /* tiles holding a visible key */
            for (int64_t t0 = 0; t0 < used_tiles; t0 += CT) {
                const int64_t nt = used_tiles - t0 < CT ? used_tiles - t0 : CT;
                const int64_t width = nt * NB;
                int64_t visible[RB];
                for (int r = 0; r < RB; r++) visible[r] = limit[r] - t0 * NB + 1;
                if (dtype == 0) {
                    const float *kp = (const float *)kbuf + bh * per_problem;
                    for (int64_t t = 0; t < nt; t++)
                        qk_f32((const float *const *)rows, kp + (t0 + t) * NB * D, D, s + t * NB,
                               CW);
                    online_softmax(s, width, visible, scale, m, l, o, D);
                    pv_f32(s, CW, width, (const float *)vbuf + bh * per_problem + t0 * NB * D, D,
                           o);
                }
#if defined(__AVX512BF16__)
                else {
                    const uint32_t *kp = (const uint32_t *)kbuf + bh * per_problem / 2;
                    for (int64_t t = 0; t < nt; t++)
                        qk_bf16((const uint16_t *const *)rows, kp + (t0 + t) * NB * D / 2, D,
                                s + t * NB, CW);
                    online_softmax(s, width, visible, scale, m, l, o, D);
                    uint32_t pairs[RB * CW / 2];
                    for (int r = 0; r < RB; r++)
                        for (int64_t i = 0; i < width; i += 32) {
                            __m512bh pb = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + r * CW + i + 16),
                                                              _mm512_loadu_ps(s + r * CW + i));
                            _mm512_storeu_si512(pairs + r * (CW / 2) + i / 2, (__m512i)pb);
                        }
                    pv_bf16(pairs, CW / 2, width,
                            (const uint16_t *)vbuf + bh * per_problem + t0 * NB * D, D, o);
                }
#endif
            }
            for (int r = 0; r < RB && r0 + r < M; r++) {
                float inv = 1.0f / l[r];
                float *dst = out + (bh * M + r0 + r) * D;
                for (int64_t d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
                lse[bh * M + r0 + r] = m[r] + logf(l[r]);
            }
        }
}

static int unsupported(int dtype, int64_t M, int64_t L, int64_t D) {
#if !defined(__AVX512BF16__)
    if (dtype == 1) return 1;
#endif
    return (dtype != 0 && dtype != 1) || D % 64 != 0 || D > 512 || M < 1 || L < 1;
}

/* Bytes of one packed K (and of one packed V) of B x H problems of L keys. */
int64_t kvmemo_flash_packed_bytes(int dtype, int64_t B, int64_t H, int64_t L, int64_t D) {
    return B * H * ((L + NB - 1) / NB) * NB * D * (dtype == 0 ? 4 : 2);
}

/* Packs keys and values once for kvmemo_flash_attention_packed: a decode step's shared prefix,
 * which every layer call of step after step reads unchanged. Returns 0, or 1 (unsupported). */
int kvmemo_flash_pack(const void *k, const void *v, int dtype, int64_t B, int64_t H, int64_t L,
                      int64_t D, int64_t k_sb, int64_t k_sh, int64_t k_sr, int64_t v_sb,
                      int64_t v_sh, int64_t v_sr, void *kbuf, void *vbuf) {
    if (unsupported(dtype, 1, L, D)) return 1;
    pack_all(k, v, dtype, B, H, L, D, k_sb, k_sh, k_sr, v_sb, v_sh, v_sr, kbuf, vbuf);
    return 0;
}

/* kvmemo_flash_attention over keys and values kvmemo_flash_pack packed (no limits: every row
 * sees every key). */
int kvmemo_flash_attention_packed(const void *q, const void *kbuf, const void *vbuf, int dtype,
                                  int64_t B, int64_t H, int64_t M, int64_t L, int64_t D,
                                  int64_t q_sb, int64_t q_sh, int64_t q_sr, float scale,
                                  float *out, float *lse) {
    if (unsupported(dtype, M, L, D)) return 1;
    attend(q, kbuf, vbuf, dtype, B, H, M, L, D, q_sb, q_sh, q_sr, NULL, 0, scale, out, lse);
    return 0;
}

int kvmemo_flash_attention(const void *q, const void *k, const void *v, int dtype, int64_t B,
                           int64_t H, int64_t M, int64_t L, int64_t D, int64_t q_sb,
                           int64_t q_sh, int64_t q_sr, int64_t k_sb, int64_t k_sh, int64_t k_sr,
                           int64_t v_sb, int64_t v_sh, int64_t v_sr, const int64_t *limits,
                           int64_t lim_sb, float scale, float *out, float *lse) {
    if (unsupported(dtype, M, L, D)) return 1;
    /* The packed keys and values live in a buffer the calling thread keeps between calls: a
     * fresh allocation this size is a new mapping whose page faults cost as much as a decode
     * step's prefix attention. */
    static __thread char *scratch = NULL;
    static __thread size_t scratch_bytes = 0;
    size_t half = (size_t)kvmemo_flash_packed_bytes(dtype, B, H, L, D);
    char *own = NULL; /* a call above the kept size's cap allocates for itself */
    if (2 * half > SCRATCH_CAP) {
        own = malloc(2 * half);
        if (own == NULL) return 1;
    } else if (scratch_bytes < 2 * half) {
        free(scratch);
        scratch = malloc(2 * half);
        scratch_bytes = scratch == NULL ? 0 : 2 * half;
        if (scratch == NULL) return 1;
    }
    char *kbuf = own ? own : scratch, *vbuf = kbuf + half;
    pack_all(k, v, dtype, B, H, L, D, k_sb, k_sh, k_sr, v_sb, v_sh, v_sr, kbuf, vbuf);
    attend(q, kbuf, vbuf, dtype, B, H, M, L, D, q_sb, q_sh, q_sr, limits, lim_sb, scale, out, lse);
    free(own);
    return 0;
}

#else /* no AVX-512: the caller uses torch's kernel */
int kvmemo_flash_attention(const void *q, const void *k, const void *v, int dtype, int64_t B,
                           int64_t H, int64_t M, int64_t L, int64_t D, int64_t q_sb,
                           int64_t q_sh, int64_t q_sr, int64_t k_sb, int64_t k_sh, int64_t k_sr,
                           int64_t v_sb, int64_t v_sh, int64_t v_sr, const int64_t *limits,
                           int64_t lim_sb, float scale, float *out, float *lse) {
    (void)q; (void)k; (void)v; (void)dtype; (void)B; (void)H; (void)M; (void)L; (void)D;
    (void)q_sb; (void)q_sh; (void)q_sr; (void)k_sb; (void)k_sh; (void)k_sr; (void)v_sb;
    (void)v_sh; (void)v_sr; (void)limits; (void)lim_sb; (void)scale; (void)out; (void)lse;
    return 1;
}
int64_t kvmemo_flash_packed_bytes(int dtype, int64_t B, int64_t H, int64_t L, int64_t D) {
    (void)dtype; (void)B; (void)H; (void)L; (void)D;
    return 0;
}
int kvmemo_flash_pack(const void *k, const void *v, int dtype, int64_t B, int64_t H, int64_t L,
                      int64_t D, int64_t k_sb, int64_t k_sh, int64_t k_sr, int64_t v_sb,
                      int64_t v_sh, int64_t v_sr, void *kbuf, void *vbuf) {
    (void)k; (void)v; (void)dtype; (void)B; (void)H; (void)L; (void)D; (void)k_sb; (void)k_sh;
    (void)k_sr; (void)v_sb; (void)v_sh; (void)v_sr; (void)kbuf; (void)vbuf;
    return 1;
}
int kvmemo_flash_attention_packed(const void *q, const void *kbuf, const void *vbuf, int dtype,
                                  int64_t B, int64_t H, int64_t M, int64_t L, int64_t D,
                                  int64_t q_sb, int64_t q_sh, int64_t q_sr, float scale,
                                  float *out, float *lse) {
    (void)q; (void)kbuf; (void)vbuf; (void)dtype; (void)B; (void)H; (void)M; (void)L; (void)D;
    (void)q_sb; (void)q_sh; (void)q_sr; (void)scale; (void)out; (void)lse;
    return 1;
}
#endif
