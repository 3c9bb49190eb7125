/* Paged decode attention for CPU: one query token per sequence, K/V read in place from pages.
 *
 * Invariant: equals softmax(scale * q . K^T) V over keys kv_starts[b] (0 without kv_starts: a
 * sliding window's first visible key) to kv_lens[b] - 1 of sequence b, the keys being block_tables[row_b][first_block + t / bs] slot t % bs of the head-major pages
 * [Hkv, num_blocks, bs, D]. No gather: each (sequence, kv head) walks its own pages and keeps an
 * online softmax, so K and V cross memory once (a gather reads them, writes a copy, then SDPA
 * reads the copy again). The vector path's per-row arithmetic is row_chunks.h's (chunks of 64
 * keys); bf16 queries on bf16 pages and builds without vectors take the per-tile loop below. The G = Hq / Hkv
 * query heads sharing a kv head share each loaded key tile (grouped-query attention without
 * repeats). Vectors are as wide as the build target's registers (VL: 16 lanes with AVX-512, else 8).
 * Parallel over (sequence, kv head) with the OpenMP runtime torch already loaded; a sequence
 * decoding alone has its keys split over the threads too (parts_per_item; in the batch-invariant
 * mode, spans of SPAN keys that every row folds alike).
 * kvmemo_paged_decode_write may start each softmax from attention over earlier keys (o_prefix,
 * lse_prefix: a cascade's shared prefix), so its output covers both sets of keys.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "../../model/kernels/bf16.h"

/* No reassociation in this file (the build's flags allow it elsewhere): a query's chains of
 * adds (row_chunks.h) must stay the chains written in every specialisation of the blocked loops,
 * or a row's bits would depend on its place in a block (gcc once merged two chains). Set for the
 * whole file so its small helpers still inline into the kernels. */
#pragma GCC optimize("no-associative-math")

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_FP8_E4M3 = 3 };
enum { TILE = 16, MAX_D = 256, MAX_GROUP = 32 };
/* Rows of a prefill chunk attending together over each key chunk (attend_rows): at most
 * ROW_GROUP, and as many as keep their states (R x G x D floats) within ROW_STATE_FLOATS (32
 * KiB). Per-tile loop, 430 rows over 7,000 keys (SmolLM2, fp32, 2 threads, Xeon SPR): one row at
 * a time 6.0 s, groups of 4 3.7 s, 8 2.8-3.1 s, 16 2.4-2.5 s, 32 2.7 s (noisy VM); the chunked
 * path (Zen 4, one layer): groups of 16 46-61 ms, 32 46-50 ms. */
enum { ROW_GROUP = 32, ROW_STATE_FLOATS = 8192 };
/* Software prefetch of the pages PREFETCH_TILES tiles ahead, into L2 (locality 1: prefetcht2).
 * Measured at 32 x 1,024 fp32, one thread (ms). AVX-512 EPYC: none 7.6; 2 ahead into L1 7.2; 3-6
 * ahead into L2 4.9-5.1; dense SDPA 5.8 (L1 has too few miss buffers for a page's worth of lines).
 * AVX2 EPYC (Zen 3): none 6.9, 4 ahead into L2 6.9, into L1 7.5; dense SDPA 7.4. */
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 1
#endif
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 4
#endif

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

/* n values of a page row range -> fp32. fp32 pages are read directly (no copy). */
static inline const float *to_f32(const void *src, int64_t offset, int64_t n, int dtype, float *buf) {
    if (dtype == KV_F32) return (const float *)src + offset;
    if (dtype == KV_BF16) {
        const uint16_t *s = (const uint16_t *)src + offset;
        uint32_t *d = (uint32_t *)buf;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = (uint32_t)s[i] << 16;
    } else if (dtype == KV_F16) {
        const _Float16 *s = (const _Float16 *)src + offset;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) buf[i] = (float)s[i];
    } else {
        /* e4m3fn (bias 7) -> fp32: the 7 magnitude bits shifted into fp32's exponent and mantissa
         * fields, times 2^(127 - 7), is exact for normals and subnormals alike (a subnormal e4m3
         * lands on an fp32 denormal, which the multiply scales back up), so the loop vectorises
         * with no select. 0x7f/0xff (NaN) are never stored. */
        const uint8_t *s = (const uint8_t *)src + offset;
        uint32_t *d = (uint32_t *)buf;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            uint32_t x = s[i], magnitude_bits = (x & 0x7fu) << 20, bits;
            float magnitude;
            memcpy(&magnitude, &magnitude_bits, 4);
            magnitude *= 0x1p120f;
            memcpy(&bits, &magnitude, 4);
            d[i] = bits | (x & 0x80u) << 24;
        }
    }
    return buf;
}


/* 2^f for |f| <= 1/2: the degree-7 Taylor series of e^(f ln 2), coefficients (ln 2)^k / k!, in
 * Horner form; a macro so the scalar and the 16-lane exp2 share it (relative error < 3e-9). */
#define TWO_POW_FRACTION(f)                                                                       \
    ((((((((f) * 1.5252733804e-05f + 1.5403530393e-04f) * (f) + 1.3333558147e-03f) * (f) +       \
         9.6181291076e-03f) * (f) + 5.5504108665e-02f) * (f) + 2.4022650696e-01f) * (f) +        \
      6.9314718056e-01f) * (f) + 1.0f)

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define HAVE_VEC 1
#endif
#endif

#ifdef HAVE_VEC
/* VL fp32 lanes: one register of the widest vector unit the build targets. A wider type than the
 * machine has is split by the compiler into several registers, and its cross-lane shuffles are
 * emulated: on AVX2 a 16-lane kernel ran at 2.2x dense SDPA, spilling 96 half-registers. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8 /* AVX2, or two NEON registers */
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
enum { MAX_CHUNKS = 16 }; /* accumulator registers per head: D / VL */
#if defined(__AVX512F__)
#define VEC_REGISTERS 32
#else
#define VEC_REGISTERS 16
#endif
#define HEADS_PER_PASS 4 /* vec_accumulate_group's most heads at once */
#define VEC_CHUNKS(D) ((D) % VL == 0 && (D) / VL <= MAX_CHUNKS && ((D) == 64 || (D) == 128 || (D) == 256))
/* The per-row chunked path (row_chunks.h) keeps no head's whole accumulator in registers (its
 * values go PV_VECS vectors at a time), so it takes D = 256 on AVX2 too (32 vectors a head), where
 * the tile path's accumulators would spill: Gemma 3's rows there took the scalar loops. */
enum { MAX_ROW_CHUNKS = 32 };
#define ROW_CHUNKS(D) ((D) % VL == 0 && (D) / VL <= MAX_ROW_CHUNKS && ((D) == 64 || (D) == 128 || (D) == 256))

static inline vf loadv(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* x[0..VL) -> r with r[i] = sum of x[i]'s lanes: a transpose-and-add tree (VL - 1 adds) instead
 * of VL separate horizontal sums (each a chain of dependent shuffles and adds). */
static inline vf sum_lanes(vf *x) {
#if VL == 16
    vf y[8], z[4], w[2];
    for (int i = 0; i < 8; i++)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(y[2 * i], y[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        w[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(z[2 * i], z[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    vf y[4], z[2];
    for (int i = 0; i < 4; i++)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
             + __builtin_shufflevector(y[2 * i], y[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14)
         + __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

#if defined(__AVX512BF16__) && VL == 16 /* TILE (16) keys per tile: one register of scores */
#include <immintrin.h>
#define HAVE_BF16_DOT 1
/* s[g * TILE + t] = c * (q_g . K_t) for t < n <= TILE, from bf16 q rows and bf16 page rows by
 * the CPU's bf16 dot product (AVX512_BF16 vdpbf16ps: each bf16 x bf16 product is exact in fp32
 * and summed in fp32), so K is read as stored, with no conversion pass over the tile: the same
 * products as converting both to fp32, summed in another order. D a multiple of 32. */
static inline __attribute__((always_inline)) void bf16_scores(
    const uint16_t *restrict q, const uint16_t *restrict K, int64_t n, int G, const int64_t D,
    float c, float *restrict s) {
    _Static_assert(TILE == VL, "one tile's scores of one head are one register");
    const int W = (int)(D / 32); /* registers per row */
    for (int g = 0; g < G; g++) {
        __m512bh qv[MAX_D / 32];
        for (int w = 0; w < W; w++) qv[w] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * w);
        vf partial[VL];
        if (n == VL) {
#pragma GCC unroll 16
            for (int i = 0; i < VL; i++) {
                __m512 a = _mm512_setzero_ps();
                for (int w = 0; w < W; w++)
                    a = _mm512_dpbf16_ps(a, qv[w], (__m512bh)_mm512_loadu_si512(K + i * D + 32 * w));
                partial[i] = (vf)a;
            }
        } else {
            for (int i = 0; i < VL; i++) {
                __m512 a = _mm512_setzero_ps();
                if (i < n) /* never read past the tile: its page may end there */
                    for (int w = 0; w < W; w++)
                        a = _mm512_dpbf16_ps(a, qv[w], (__m512bh)_mm512_loadu_si512(K + i * D + 32 * w));
                partial[i] = (vf)a;
            }
        }
        storev(s + g * TILE, sum_lanes(partial) * c);
    }
}
#else
#define HAVE_BF16_DOT 0
#endif

/* The upper 8 lanes' indices of a within-8-lanes shuffle, present only in 16-lane builds. */
#if VL == 16
#define HALF_TAIL(...) , __VA_ARGS__
#else
#define HALF_TAIL(...)
#endif

static inline vf selectv(vi mask, vf yes, vf no) { return (vf)((mask & (vi)yes) | (~mask & (vi)no)); }

/* The max and the sum of x's lanes, by halving (log2 VL shuffles): the scalar loops they
 * replace extracted every lane of every tile's scores. */
static inline float max_lanes(vf x) {
    vf y;
#if VL == 16
    y = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x = selectv(y > x, y, x);
#endif
    y = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3 HALF_TAIL(12, 13, 14, 15, 8, 9, 10, 11));
    x = selectv(y > x, y, x);
    y = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5 HALF_TAIL(10, 11, 8, 9, 14, 15, 12, 13));
    x = selectv(y > x, y, x);
    y = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6 HALF_TAIL(9, 8, 11, 10, 13, 12, 15, 14));
    x = selectv(y > x, y, x);
    return x[0];
}

static inline float add_lanes(vf x) {
#if VL == 16
    x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
#endif
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3 HALF_TAIL(12, 13, 14, 15, 8, 9, 10, 11));
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5 HALF_TAIL(10, 11, 8, 9, 14, 15, 12, 13));
    x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6 HALF_TAIL(9, 8, 11, 10, 13, 12, 15, 14));
    return x[0];
}

/* exp2_nonpositive on VL lanes (written with vector types: gcc kept the scalar loop scalar). */
static inline vf exp2_vec(vf x) {
    x = selectv(x < -125.0f, (vf){0} - 125.0f, x);
    vi i = __builtin_convertvector(x - 0.5f, vi);
    vf f = x - __builtin_convertvector(i, vf);
    return TWO_POW_FRACTION(f) * (vf)((i + 127) << 23);
}

/* One tile's online-softmax step for one head: s[0..n) (log2 units) -> probabilities in place.
 * Updates the running max *m and sum *l; returns alpha, the factor the accumulator must take. */
static inline float vec_softmax_tile(float *s, int64_t n, float *m, float *l) {
    vi lane;
    for (int i = 0; i < VL; i++) lane[i] = i;
    vf x[TILE / VL], maxes = (vf){0} + *m;
    for (int j = 0; j < TILE / VL; j++) {
        x[j] = selectv(lane + j * VL < (int32_t)n, loadv(s + j * VL), (vf){0} - INFINITY);
        maxes = selectv(x[j] > maxes, x[j], maxes);
    }
    const float tile_max = max_lanes(maxes);
    vf sums = (vf){0};
    for (int j = 0; j < TILE / VL; j++) {
        vf p = (vf)((vi)exp2_vec(x[j] - tile_max) & (lane + j * VL < (int32_t)n));
        sums += p;
        storev(s + j * VL, p);
    }
    const float sum = add_lanes(sums);
    float alpha = exp2f(*m - tile_max); /* *m = -inf on the first tile: alpha = 0 */
    *l = *l * alpha + sum;
    *m = tile_max;
    return alpha;
}

/* acc[0..VL*C) = acc * alpha + sum_t p[t] * V_t, the accumulator held in registers across keys. */
static inline __attribute__((always_inline)) void vec_accumulate(
    float *restrict acc, float alpha, const float *restrict p, const float *restrict V, int64_t n, const int C) {
    vf a[MAX_CHUNKS];
    for (int c = 0; c < C; c++) a[c] = loadv(acc + c * VL) * alpha;
    for (int64_t t = 0; t < n; t++) {
        vf pt = (vf){0} + p[t];
        for (int c = 0; c < C; c++) a[c] += pt * loadv(V + t * C * VL + c * VL);
    }
    for (int c = 0; c < C; c++) storev(acc + c * VL, a[c]);
}

/* vec_accumulate for H heads of a group at once (H a constant, H * C accumulators in registers):
 * each value row V_t is loaded once for the H heads, not once per head. */
static inline __attribute__((always_inline)) void vec_accumulate_heads(
    float *restrict acc, const float *restrict alpha, const float *restrict p, const float *restrict V,
    int64_t n, const int H, const int C) {
    vf a[HEADS_PER_PASS][MAX_CHUNKS];
    for (int h = 0; h < H; h++)
        for (int c = 0; c < C; c++) a[h][c] = loadv(acc + (h * C + c) * VL) * alpha[h];
    for (int64_t t = 0; t < n; t++) {
        vf v[MAX_CHUNKS];
        for (int c = 0; c < C; c++) v[c] = loadv(V + t * C * VL + c * VL);
        for (int h = 0; h < H; h++) {
            const vf pt = (vf){0} + p[h * TILE + t];
            for (int c = 0; c < C; c++) a[h][c] += pt * v[c];
        }
    }
    for (int h = 0; h < H; h++)
        for (int c = 0; c < C; c++) storev(acc + (h * C + c) * VL, a[h][c]);
}

/* Every head of the group: alpha[g] and probabilities p[g * TILE + t] -> acc [G][C * VL]. Heads
 * go HEADS_PER_PASS at a time while their accumulators and one value row fit the registers. */
static inline __attribute__((always_inline)) void vec_accumulate_group(
    float *restrict acc, const float *restrict alpha, const float *restrict p, const float *restrict V,
    int64_t n, int G, const int C) {
    const int per_pass = C * (HEADS_PER_PASS + 1) <= VEC_REGISTERS - 2 ? HEADS_PER_PASS
                       : C * 3 <= VEC_REGISTERS - 2 ? 2 : 1;
    for (int g = 0; g < G;) {
        const int left = G - g, h = left < per_pass ? left : per_pass;
        float *ag = acc + g * C * VL;
        const float *pg = p + g * TILE;
        if (h == 4) vec_accumulate_heads(ag, alpha + g, pg, V, n, 4, C);
        else if (h == 3) vec_accumulate_heads(ag, alpha + g, pg, V, n, 3, C);
        else if (h == 2) vec_accumulate_heads(ag, alpha + g, pg, V, n, 2, C);
        else vec_accumulate(ag, alpha[g], pg, V, n, C);
        g += h;
    }
}
#else
#define VL 1 /* no vector path: the scalar loops below run */
#define VEC_CHUNKS(D) 0
#define ROW_CHUNKS(D) 0
static inline float vec_softmax_tile(float *s, int64_t n, float *m, float *l) { return 0.0f; }
static inline void vec_accumulate(float *acc, float alpha, const float *p, const float *V, int64_t n, int C) {}
static inline void vec_accumulate_group(float *acc, const float *alpha, const float *p, const float *V, int64_t n, int G, int C) {}
#endif

#ifndef HAVE_BF16_DOT
#define HAVE_BF16_DOT 0
#endif

/* 2^x for x <= 0 without a libm call, so the loop over a tile's scores vectorises (a scalar
 * exp2f call per score was half the kernel's time). x = i + f, i = round(x), |f| <= 1/2;
 * 2^f by TWO_POW_FRACTION, 2^i built in the exponent bits. */
static inline float exp2_nonpositive(float x) {
    x = x < -125.0f ? -125.0f : x;
    int32_t i = (int32_t)(x - 0.5f); /* truncation toward zero rounds a non-positive x */
    float f = x - (float)i, p = TWO_POW_FRACTION(f);
    uint32_t bits = (uint32_t)(i + 127) << 23;
    float two_i;
    memcpy(&two_i, &bits, sizeof two_i);
    return p * two_i;
}

static const int64_t DTYPE_BYTES[4] = {4, 2, 2, 1};

/* Pages of one sequence lie anywhere in the pool, so the hardware prefetcher cannot follow them
 * across a page boundary: ask for a tile's K and V lines several tiles before it is needed. */
static inline void prefetch_tile(const void *k_pages, const void *v_pages, int dtype,
                                 const int64_t *table, int64_t start, int64_t kv_len,
                                 int64_t head_offset, int64_t bs, int64_t D) {
    int64_t in_block = start % bs, n = kv_len - start;
    if (n > TILE) n = TILE;
    if (n > bs - in_block) n = bs - in_block;
    int64_t elt = DTYPE_BYTES[dtype];
    int64_t offset = (head_offset + table[start / bs] * bs + in_block) * D * elt;
    for (int64_t byte = 0; byte < n * D * elt; byte += 64) {
        __builtin_prefetch((const char *)k_pages + offset + byte, 0, PREFETCH_LOCALITY);
        __builtin_prefetch((const char *)v_pages + offset + byte, 0, PREFETCH_LOCALITY);
    }
}

#ifdef HAVE_VEC
#include "row_chunks.h"
#define CH_OR_0 CH
#else
#define CH_OR_0 0
#endif
/* Keys packed for a step's long prefills (pack_chunk) at most: 64 MiB, else each group packs. */
#define PACK_CAP_FLOATS ((int64_t)16 << 20)

/* One tile of n keys for one row's G heads: scores, online softmax, accumulate (the per-tile
 * step of attend_rows; one row's whole arithmetic is its calls to this, tile after tile). */
static inline __attribute__((always_inline)) void attend_tile(
    const float *qs, const uint16_t *q16, float qscale, const uint16_t *k16, const float *K,
    const float *V, int64_t n, int G, const int64_t D, float *s, float *acc, float *m, float *l) {
    float *scores = s;
#if HAVE_BF16_DOT
    if (q16) {
        bf16_scores(q16, k16, n, G, D, qscale, s);
    } else
#endif
    {
        for (int64_t t = 0; t < n; t++) {
            for (int g = 0; g < G; g++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qs[g * D + d] * K[t * D + d];
                s[g * TILE + t] = dot;
            }
        }
    }
    (void)k16;
    (void)qscale;
    if (VEC_CHUNKS(D)) {
        float alpha[MAX_GROUP];
        for (int g = 0; g < G; g++) alpha[g] = vec_softmax_tile(scores + g * TILE, n, &m[g], &l[g]);
        vec_accumulate_group(acc, alpha, scores, V, n, G, D / VL);
        return;
    }
    for (int g = 0; g < G; g++) {
        float *sg = scores + g * TILE;
        float tile_max = m[g];
        for (int64_t t = 0; t < n; t++) tile_max = sg[t] > tile_max ? sg[t] : tile_max;
        float alpha = exp2f(m[g] - tile_max), sum = 0.0f; /* m = -inf first: alpha = 0 */
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; t++) { sg[t] = exp2_nonpositive(sg[t] - tile_max); sum += sg[t]; }
        l[g] = l[g] * alpha + sum;
        m[g] = tile_max;
        float *ag = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) ag[d] *= alpha;
        for (int64_t t = 0; t < n; t++) {
            float p = sg[t];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) ag[d] += p * V[t * D + d];
        }
    }
}

/* R query rows of one (sequence, kv head), each with G query heads [R][G][D] (already scaled by
 * scale * log2 e), row r over keys kv_start .. kv_lens[r] - 1 -> out (row r at r * out_stride,
 * heads D apart), lse (row r at r * lse_stride, heads 1 apart). q16 (or NULL): the same rows in
 * bf16, unscaled, row r at r * q16_stride, for bf16 pages' scores by bf16 dot products
 * (bf16_scores), times qscale = scale * log2 e.
 * The rows share each loaded key tile (a prefill chunk's queries read the keys once per group,
 * not once per row), and each row's arithmetic is the loop a row alone runs: the same tiles
 * (kv_start, then page boundaries, its last one cut at its own kv_len), the same per-tile code
 * on its own scores, softmax state and accumulator, in the same order. So a query's output does
 * not depend on the rows beside it (batch-invariant), and R = 1 is plain decode. o_init and
 * lse_init (a cascade's shared prefix: the online softmax's starting state) only with R = 1. */
static inline __attribute__((always_inline)) void attend_rows(
    const float *qs, const uint16_t *q16, int64_t q16_stride, float qscale, const void *k_pages,
    const void *v_pages, int dtype, const int64_t *table, int64_t kv_start,
    const int64_t *row_starts, const int64_t *kv_lens, int R, int64_t head_offset, int64_t bs,
    int G, const int64_t D, float *out,
    int64_t out_stride, float *lse, int64_t lse_stride, const float *o_init,
    const float *lse_init, const float *kT_all) {
#ifdef HAVE_VEC
    if (!q16 && ROW_CHUNKS(D)) {
        attend_rows_chunked(qs, k_pages, v_pages, dtype, table, kv_start, row_starts, kv_lens, R, head_offset,
                            bs, G, D, out, out_stride, lse, lse_stride, o_init, lse_init, kT_all);
        return;
    }
#endif
    (void)kT_all, (void)row_starts; /* the tile loop's rows all start at kv_start (grouped so) */
    float kbuf[TILE * MAX_D], vbuf[TILE * MAX_D], s[MAX_GROUP * TILE];
    float acc[R * G * D], m[R * G], l[R * G];
    int64_t kv_max = 0;
    for (int r = 0; r < R; r++) kv_max = kv_lens[r] > kv_max ? kv_lens[r] : kv_max;
    for (int g = 0; g < R * G; g++) { m[g] = -INFINITY; l[g] = 0.0f; }
    const int64_t step = bs < TILE ? bs : TILE;
    for (int64_t first = kv_start; first < kv_max && first < kv_start + PREFETCH_TILES * step;
         first += step)
        prefetch_tile(k_pages, v_pages, dtype, table, first, kv_max, head_offset, bs, D);
    memset(acc, 0, sizeof(float) * R * G * D);
    /* Attention over earlier keys (o_init, lse_init: a cascade's shared prefix) is the online
     * softmax's starting state: running max lse (in log2 units), sum 1, accumulator o. */
    for (int g = 0; o_init && g < G; g++) {
        if (lse_init[g] == -INFINITY) continue; /* no earlier keys */
        m[g] = lse_init[g] * LOG2E;
        l[g] = 1.0f;
        memcpy(acc + g * D, o_init + g * D, sizeof(float) * (size_t)D);
    }
    /* Tiles start at kv_start, then at page boundaries: fixed by the query's own position. */
    for (int64_t start = kv_start, n = 0; start < kv_max; start += n) {
        int64_t block = start / bs, in_block = start % bs;
        n = kv_max - start;
        if (n > TILE) n = TILE;
        if (n > bs - in_block) n = bs - in_block; /* a tile never crosses a page */
        int64_t offset = (head_offset + table[block] * bs + in_block) * D;
        /* Several tiles ahead: one tile of compute is much shorter than a DRAM round trip. */
        int64_t ahead = start + PREFETCH_TILES * step;
        if (ahead < kv_max) prefetch_tile(k_pages, v_pages, dtype, table, ahead, kv_max, head_offset, bs, D);
        const float *V = to_f32(v_pages, offset, n * D, dtype, vbuf);
        const float *K = q16 ? NULL : to_f32(k_pages, offset, n * D, dtype, kbuf);
        for (int r = 0; r < R; r++) {
            /* row r's tile: the same as alone (its keys end at its own kv_len) */
            const int64_t nr = kv_lens[r] - start < n ? kv_lens[r] - start : n;
            if (nr <= 0) continue;
            attend_tile(qs + r * G * D, q16 ? q16 + r * q16_stride : NULL, qscale,
                        (const uint16_t *)k_pages + offset, K, V, nr, G, D, s, acc + r * G * D,
                        m + r * G, l + r * G);
        }
    }
    for (int r = 0; r < R; r++) {
        for (int g = 0; g < G; g++) {
            const float lr = l[r * G + g], mr = m[r * G + g];
            float inv = lr > 0.0f ? 1.0f / lr : 0.0f;
            for (int64_t d = 0; d < D; d++) out[r * out_stride + g * D + d] = acc[(r * G + g) * D + d] * inv;
            if (lse) lse[r * lse_stride + g] = lr > 0.0f ? (mr + log2f(lr)) * LN2 : -INFINITY;
        }
    }
}

/* attend_rows for one head size: a constant D lets the compiler unroll the dot products and V
 * updates fully. Each is its own function, not inlined into the parallel loop: one function
 * holding all four took gcc 30 s to compile (its passes grow faster than the code). */
typedef void (*attend_rows_fn)(const float *, const uint16_t *, int64_t, float, const void *,
                               const void *, int, const int64_t *, int64_t, const int64_t *,
                               const int64_t *, int,
                               int64_t, int64_t, int, int64_t, float *, int64_t, float *, int64_t,
                               const float *, const float *, const float *);
#define ATTEND_ROWS_FOR(NAME, DIM, ...) \
    static __attribute__((noinline __VA_ARGS__)) void NAME( \
        const float *qs, const uint16_t *q16, int64_t q16_stride, float qscale, \
        const void *k_pages, const void *v_pages, int dtype, const int64_t *table, \
        int64_t kv_start, const int64_t *row_starts, const int64_t *kv_lens, int R, \
        int64_t head_offset, int64_t bs, int G, \
        int64_t D, float *out, int64_t out_stride, float *lse, int64_t lse_stride, \
        const float *o_init, const float *lse_init, const float *kT_all) { \
        (void)D; \
        attend_rows(qs, q16, q16_stride, qscale, k_pages, v_pages, dtype, table, kv_start, \
                    row_starts, kv_lens, \
                    R, head_offset, bs, G, DIM, out, out_stride, lse, lse_stride, o_init, \
                    lse_init, kT_all); \
    }
ATTEND_ROWS_FOR(attend_rows_64, 64)
ATTEND_ROWS_FOR(attend_rows_128, 128)
ATTEND_ROWS_FOR(attend_rows_256, 256)
/* Other head sizes (no bundled model has one): loops, not unrolled code (a third of the build
 * time: 14.9 s -> 9.9 s). */
ATTEND_ROWS_FOR(attend_rows_any, D, , optimize("O2", "no-associative-math"))
#undef ATTEND_ROWS_FOR

static inline void write_slot(const void *k_new, const void *v_new, int64_t at, int io,
                              void *k_pages, void *v_pages, int dtype, int64_t offset, int64_t D) {
    float kbuf[MAX_D], vbuf[MAX_D];
    const float *k = to_f32(k_new, at, D, io, kbuf), *v = to_f32(v_new, at, D, io, vbuf);
    if (dtype == KV_F32) {
        memcpy((float *)k_pages + offset, k, sizeof(float) * (size_t)D);
        memcpy((float *)v_pages + offset, v, sizeof(float) * (size_t)D);
        return;
    }
    uint16_t *kd = (uint16_t *)k_pages + offset, *vd = (uint16_t *)v_pages + offset;
    for (int64_t d = 0; d < D; d++) {
        kd[d] = to_bf16(k[d]);
        vd[d] = to_bf16(v[d]);
    }
}

static inline void store_io(const float *src, int io, int64_t n, void *dst) {
    if (io == 0) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) d[i] = to_bf16(src[i]);
}

/* Split-K: with fewer (sequence, kv head) items than twice the threads (one long conversation
 * decoding alone: 3 items on 2 threads, one thread idle for a third of every layer), each item's
 * keys are cut into parts of whole pages, at least MIN_PART_KEYS each, attended in parallel and
 * merged by their log-sum-exps (flash-decoding). */
enum { MIN_PART_KEYS = 128 };

static int64_t parts_per_item(int64_t items, const int64_t *kv_lens, int64_t B, int64_t bs,
                              int split) {
    if (!split) return 1; /* batch-invariant: a query's keys in one pass, whatever the batch */
#ifdef _OPENMP
    const int64_t threads = omp_get_max_threads();
#else
    const int64_t threads = 1;
#endif
    if (items <= 0 || threads < 2 || items >= 2 * threads) return 1; /* items 0: an empty batch */
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) longest = kv_lens[b] > longest ? kv_lens[b] : longest;
    int64_t parts = (2 * threads + items - 1) / items;
    const int64_t by_length = longest / (MIN_PART_KEYS > bs ? MIN_PART_KEYS : bs);
    return parts < by_length ? parts : (by_length > 1 ? by_length : 1);
}

/* Spans: in the batch-invariant mode a query's keys kv_start .. kv_len - 1 are attended in spans
 * of SPAN keys from kv_start, each span on its own (its softmax state from empty), and the spans'
 * results folded left to right (fold_span). A query with at most SPAN keys is one span: plain
 * attention, as before spans. The spans are fixed by the query's own keys, so a decode step can
 * give each span to a thread (one sequence over 1,024 keys: four units per kv head, where the
 * threads otherwise split its query heads and each read every key) while a prefill chunk's rows
 * fold the same spans in turn, and both give the same bits. A multiple of the chunked path's CH. */
enum { SPAN = 256 };

static inline int64_t span_count(int64_t kv_start, int64_t kv_len) {
    return kv_len - kv_start > SPAN ? (kv_len - kv_start + SPAN - 1) / SPAN : 1;
}

/* Where row b's chunks and spans start: its first key (a window's start; 0 without one), on the
 * chunked path rounded down to its page (align = bs; row_chunks.h says why), elsewhere itself
 * (align = 1: the tile loop's tiles start at the row's first key). */
static inline int64_t origin_of(const int64_t *kv_starts, int64_t b, int64_t align) {
    const int64_t start = kv_starts ? kv_starts[b] : 0;
    return start - start % align;
}

/* (o, *lse) <- attention over both its keys and a span's (os, ls), each normalised with its
 * natural-log log-sum-exp; -inf: no keys. One compiled body (noinline) for the decode step's
 * merge and the prefill rows' fold, so that both round alike. */
static __attribute__((noinline)) void fold_span(float *o, float *lse, const float *os, float ls,
                                                int64_t D) {
    if (ls == -INFINITY) return;
    if (*lse == -INFINITY) {
        memcpy(o, os, sizeof(float) * (size_t)D);
        *lse = ls;
        return;
    }
    const float top = *lse > ls ? *lse : ls;
    const float a = expf(*lse - top), b = expf(ls - top), total = a + b, inv = 1.0f / total;
    for (int64_t d = 0; d < D; d++) {
        const float x = a * o[d], y = b * os[d];
        o[d] = (x + y) * inv;
    }
    *lse = top + logf(total);
}

/* Query-head subgroups per item: where a step has fewer (sequence, kv head) items than threads
 * and long keys (Gemma 3 decoding one sequence: one kv head, four query heads), each thread
 * takes some of an item's query heads, reading the same keys. A head's arithmetic is the same
 * in any subgroup (its own scores, softmax and accumulator, in the same order), so unlike
 * parts (keys split by the thread count) this keeps a query's output independent of the batch. Short contexts keep
 * one unit: waking a thread costs more than their keys. Even subgroups only. */
enum { MIN_SPLIT_KEYS = 256 };

static int head_split(int64_t items, int64_t parts, int G, const int64_t *kv_lens,
                      const int64_t *kv_starts, int64_t B) {
#ifdef _OPENMP
    const int64_t threads = omp_get_max_threads();
#else
    const int64_t threads = 1;
#endif
    if (parts > 1 || items < 1 || items >= threads) return 1;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t keys = kv_lens[b] - (kv_starts ? kv_starts[b] : 0);
        longest = keys > longest ? keys : longest;
    }
    if (longest < MIN_SPLIT_KEYS) return 1;
    int split = 1;
    while (items * split < threads && G % (2 * split) == 0) split *= 2;
    return split;
}

/* The whole decode attention of one layer. q/k_new/v_new/out are fp32 or bf16 (io, one dtype
 * for all four); o_init/lse_init (fp32, optional) are attention over keys before first_block. */
static int paged_decode(const void *q, int64_t q_stride, const void *k_new, const void *v_new,
                        int64_t kv_stride, int io, const int64_t *slots, const void *k_pages,
                        const void *v_pages, int dtype, const int64_t *block_tables,
                        int64_t table_stride, const int64_t *table_rows, int64_t first_block,
                        const int64_t *kv_lens, const int64_t *kv_starts, int64_t B, int64_t Hq,
                        int64_t Hkv, int64_t D, int64_t bs, int64_t num_blocks, float scale,
                        void *out, float *lse, const float *o_init, const float *lse_init,
                        int split) {
    int G = (int)(Hq / Hkv);
    if (D > MAX_D || G > MAX_GROUP || Hq % Hkv) return 1;
    const int64_t io_bytes = io ? 2 : 4;
#ifdef HAVE_VEC
    const int q16_path = HAVE_BF16_DOT && io == 1 && dtype == KV_BF16 && (D == 64 || D == 128);
    const int64_t align = !q16_path && ROW_CHUNKS(D) ? bs : 1; /* the chunked path's origins */
#else
    const int64_t align = 1;
#endif
    /* A window's start is a key, not a page: its keys are never split into parts. */
    const int64_t items = B * Hkv,
                  parts = parts_per_item(items, kv_lens, B, bs, split && !kv_starts);
    /* Parts: each item's o [parts][G][D] and lse [parts][G] (fp32), merged after the loop. */
    float *part_o = NULL, *part_lse = NULL;
    if (parts > 1) {
        part_o = malloc(sizeof(float) * (size_t)(items * parts * G * D));
        part_lse = malloc(sizeof(float) * (size_t)(items * parts * G));
        if (!part_o || !part_lse) { free(part_o); free(part_lse); return 3; }
    }
    /* Row groups: up to ROW_GROUP consecutive rows of one sequence with the same origin (a
     * prefill chunk's queries; windowed rows whose first keys share a page) attend together,
     * sharing each key tile (attend_rows); group j is rows firsts[j] .. firsts[j + 1] - 1. A
     * decode step's rows are each their own group. */
    int64_t *firsts = NULL, groups = B;
    if (table_rows && parts == 1 && B > 1) {
        const int64_t by_state = ROW_STATE_FLOATS / (G * D), most = by_state < ROW_GROUP
            ? (by_state > 1 ? by_state : 1) : ROW_GROUP;
        firsts = malloc(sizeof(int64_t) * (size_t)(B + 1));
        if (!firsts) return 3;
        groups = 0;
        for (int64_t b = 0; b < B; b++) {
            if (b == 0 || table_rows[b] != table_rows[b - 1] || b - firsts[groups - 1] >= most
                || origin_of(kv_starts, b, align) != origin_of(kv_starts, firsts[groups - 1], align))
                firsts[groups++] = b;
        }
        firsts[groups] = B;
    }
    /* Sequences with several row groups (a long prefill chunk) have their keys transposed once
     * for all their groups (pack_chunk): packed + pack_off[group] + h * pack_chunks[group] * D * CH. */
    float *packed = NULL;
    int64_t *pack_off = NULL, *pack_chunks = NULL, *pack_units = NULL, *pack_keys = NULL, runs = 0;
#ifdef HAVE_VEC
    if (firsts && groups < B && !slots && !kv_starts && !q16_path && ROW_CHUNKS(D)
        && D <= LANES_MAX_D) {
        pack_off = malloc(sizeof(int64_t) * (size_t)(4 * groups + 1));
        if (!pack_off) { free(firsts); return 3; }
        pack_chunks = pack_off + groups;
        pack_units = pack_chunks + groups; /* per run: its first group (run r at slot r) */
        pack_keys = pack_units + groups + 1; /* per run: its sequence's keys */
        int64_t total = 0;
        for (int64_t g = 0, end; g < groups; g = end) {
            const int64_t seq = table_rows[firsts[g]];
            int64_t keys = 0;
            for (end = g; end < groups && table_rows[firsts[end]] == seq; end++)
                for (int64_t b = firsts[end]; b < firsts[end + 1]; b++)
                    keys = kv_lens[b] > keys ? kv_lens[b] : keys;
            const int64_t chunks = end - g > 1 ? (keys + CH - 1) / CH : 0;
            for (int64_t i = g; i < end; i++) {
                pack_off[i] = chunks ? total : -1;
                pack_chunks[i] = chunks;
            }
            pack_keys[runs] = keys;
            pack_units[runs++] = g;
            total += Hkv * chunks * D * CH;
        }
        pack_units[runs] = groups;
        if (total > 0 && total <= PACK_CAP_FLOATS) packed = malloc(sizeof(float) * (size_t)total);
        if (!packed) { free(pack_off); pack_off = NULL; }
    }
#endif
    const int64_t row_items = groups * Hkv;
    /* Spans (batch-invariant mode, no cascade start): a decode row's spans are units of their
     * own, folded after the loop from span_o / span_l ([item][span][G][D] / [G]); a prefill
     * group folds its rows' spans in turn within its unit. */
    const int spanned = !split && !o_init;
    int64_t spans = 1;
    for (int64_t b = 0; spanned && !firsts && b < B; b++) {
        const int64_t n = span_count(origin_of(kv_starts, b, align), kv_lens[b]);
        spans = n > spans ? n : spans;
    }
    /* Sized by the batch's most spans (B x Hq x D floats a span: 8 MiB for 64 Gemma 3 rows
     * at 8,192 keys); a shorter row's extra units return at once. */
    float *span_o = NULL, *span_l = NULL;
    if (spans > 1) {
        span_o = malloc(sizeof(float) * (size_t)(row_items * spans * G * D));
        span_l = malloc(sizeof(float) * (size_t)(row_items * spans * G));
        if (!span_o || !span_l) {
            free(span_o); free(span_l); free(firsts); free(pack_off); free(packed); free(part_o); free(part_lse);
            return 3;
        }
    }
    /* A part's keys: whole pages, the item's pages dealt out evenly (the last part the rest). */
    const int subgroups = head_split(row_items * spans, parts, G, kv_lens, kv_starts, B), Gs = G / subgroups;
    const int64_t units = row_items * parts * spans * subgroups;
    /* One unit (a single sequence's single KV head, unsplit: Gemma 3's decode) runs here: a
     * parallel region would only wake a thread to wait for it. */
#pragma omp parallel if (units > 1)
    {
        if (slots && parts * spans * subgroups > 1) { /* every unit must see the new key: write first */
#pragma omp for schedule(static)
            for (int64_t item = 0; item < items; item++) {
                int64_t b = item / Hkv, h = item % Hkv;
                write_slot(k_new, v_new, b * kv_stride + h * D, io, (void *)k_pages,
                           (void *)v_pages, dtype, (h * num_blocks * bs + slots[b]) * D, D);
            }
        }
#ifdef HAVE_VEC
        /* The packed sequences' chunks, every (run, kv head, chunk) one unit of work. */
        for (int64_t r = 0; packed && r < runs; r++) {
            const int64_t g = pack_units[r], chunks = pack_chunks[g];
            if (!chunks) continue;
            const int64_t *table = block_tables + table_rows[firsts[g]] * table_stride + first_block;
#pragma omp for schedule(static)
            for (int64_t u = 0; u < Hkv * chunks; u++)
                pack_chunk(k_pages, dtype, table, u / chunks * num_blocks * bs, bs, D, pack_keys[r],
                           u % chunks, packed + pack_off[g] + u / chunks * chunks * D * CH);
        }
#endif
#pragma omp for schedule(dynamic)
        for (int64_t unit = 0; unit < units; unit++) {
            int64_t item = unit / (parts * spans * subgroups), part = unit / (spans * subgroups) % parts,
                    span = unit / subgroups % spans;
            int64_t group = item / Hkv, h = item % Hkv;
            const int64_t b = firsts ? firsts[group] : group;
            const int R = firsts ? (int)(firsts[group + 1] - b) : 1;
            int64_t head_offset = h * num_blocks * bs;
            if (slots && parts * spans * subgroups == 1) /* this (sequence, head) alone reads the slot */
                write_slot(k_new, v_new, b * kv_stride + h * D, io, (void *)k_pages,
                           (void *)v_pages, dtype, (head_offset + slots[b]) * D, D);
            /* The unit's query heads: Gs of the group from hq0 (all G where not split). */
            const int64_t hq0 = h * G + unit % subgroups * Gs;
            /* io's codes are KV_F32 / KV_BF16, so to_f32 reads q too */
            float qs[R * Gs * D], o32[R * Gs * D];
            for (int r = 0; r < R; r++) {
                float *qr = qs + r * Gs * D;
                const float *qb = to_f32(q, (b + r) * q_stride + hq0 * D, Gs * D, io, qr);
                for (int64_t i = 0; i < Gs * D; i++) qr[i] = qb[i] * (scale * LOG2E);
            }
            const int64_t *table = block_tables + (table_rows ? table_rows[b] : b) * table_stride + first_block;
            int64_t kv_len = kv_lens[b], kv_start = origin_of(kv_starts, b, align),
                    row_start = kv_starts ? kv_starts[b] : 0; /* >= kv_start */
            const int64_t *row_lens = R > 1 ? kv_lens + b : &kv_len;
            int64_t out_stride = io ? Gs * D : Hq * D;
            float *ob, *lb;
            const float *oi = 0, *li = 0;
            int to_span = 0; /* this unit writes one span of a decode row, folded after the loop */
            if (parts > 1) {
                const int64_t pages = (kv_len + bs - 1) / bs, per_part = (pages + parts - 1) / parts;
                const int64_t first = part * per_part * bs;
                kv_len = kv_len - first < per_part * bs ? kv_len - first : per_part * bs;
                table += part * per_part;
                ob = part_o + unit * G * D;
                lb = part_lse + unit * G;
                if (kv_len <= 0) { /* fewer pages than parts: an empty part */
                    for (int g = 0; g < G; g++) lb[g] = -INFINITY;
                    memset(ob, 0, sizeof(float) * (size_t)(G * D));
                    continue;
                }
                out_stride = G * D;
            } else if (spanned && !firsts && span_count(kv_start, kv_len) > 1) { /* a decode row's span */
                to_span = 1;
                if (span >= span_count(kv_start, kv_len)) continue;
                kv_start += span * SPAN;
                kv_len = kv_len < kv_start + SPAN ? kv_len : kv_start + SPAN;
                row_start = row_start > kv_start ? row_start : kv_start;
                ob = span_o + ((item * spans + span) * G + (hq0 - h * G)) * D;
                lb = span_l + (item * spans + span) * G + (hq0 - h * G);
                out_stride = G * D;
            } else {
                if (span > 0) continue; /* one span: the unit of span 0 takes it all */
                ob = io ? o32 : (float *)out + (b * Hq + hq0) * D;
                lb = lse ? lse + b * Hq + hq0 : 0;
                oi = o_init ? o_init + (b * Hq + hq0) * D : 0;
                li = o_init ? lse_init + b * Hq + hq0 : 0;
            }
            /* bf16 queries on bf16 pages: scores by bf16 dot products (D 64 or 128). */
            const uint16_t *q16 = HAVE_BF16_DOT && io == 1 && dtype == KV_BF16 && (D == 64 || D == 128)
                ? (const uint16_t *)q + b * q_stride + hq0 * D : NULL;
            const float qscale = scale * LOG2E;
            const float *kT_all = packed && pack_off[group] >= 0
                ? packed + pack_off[group] + h * pack_chunks[group] * D * CH_OR_0 : NULL;
            const attend_rows_fn attend = D == 64 ? attend_rows_64 : D == 128 ? attend_rows_128
                : D == 256 ? attend_rows_256 : attend_rows_any;
            int64_t group_max = 0; /* the group's last key + 1 */
            for (int r = 0; r < R; r++) group_max = row_lens[r] > group_max ? row_lens[r] : group_max;
            if (spanned && firsts && span_count(kv_start, group_max) > 1) {
                /* A prefill group's rows over several spans: each span for all rows, then each
                 * row's fold (rows without keys in a span get lse -inf: folded as nothing). */
                float run_o[R * Gs * D], run_l[R * Gs], span_rows_o[R * Gs * D], span_rows_l[R * Gs];
                int64_t lens_s[R], starts_s[R];
                for (int i = 0; i < R * Gs; i++) run_l[i] = -INFINITY;
                for (int64_t s0 = kv_start; s0 < group_max; s0 += SPAN) {
                    for (int r = 0; r < R; r++) {
                        const int64_t start = kv_starts ? kv_starts[b + r] : 0;
                        lens_s[r] = row_lens[r] < s0 + SPAN ? row_lens[r] : s0 + SPAN;
                        starts_s[r] = start > s0 ? start : s0;
                    }
                    attend(qs, q16, q_stride, qscale, k_pages, v_pages, dtype, table, s0, starts_s, lens_s, R,
                           head_offset, bs, Gs, D, span_rows_o, Gs * D, span_rows_l, Gs, NULL, NULL,
                           kT_all);
                    for (int i = 0; i < R * Gs; i++)
                        fold_span(run_o + i * D, run_l + i, span_rows_o + i * D, span_rows_l[i], D);
                }
                for (int r = 0; r < R; r++) {
                    for (int g = 0; g < Gs; g++) {
                        const int i = r * Gs + g;
                        if (run_l[i] == -INFINITY) memset(run_o + i * D, 0, sizeof(float) * (size_t)D);
                        memcpy(ob + r * out_stride + g * D, run_o + i * D, sizeof(float) * (size_t)D);
                        if (lb) lb[r * Hq + g] = run_l[i];
                    }
                }
            } else {
                const int64_t *starts = R > 1 ? (kv_starts ? kv_starts + b : NULL) : &row_start;
                attend(qs, q16, q_stride, qscale, k_pages, v_pages, dtype, table, kv_start, starts,
                       row_lens, R, head_offset, bs, Gs, D, ob, out_stride, lb, Hq, oi, li, kT_all);
            }
            for (int r = 0; io && parts == 1 && !to_span && r < R; r++)
                store_io(o32 + r * Gs * D, io, Gs * D, (char *)out + ((b + r) * Hq + hq0) * D * io_bytes);
        }
        if (spans > 1) {
            /* Fold each spanned decode row's spans, left to right (fold_span). */
#pragma omp for schedule(static)
            for (int64_t row = 0; row < B * Hq; row++) {
                const int64_t b = row / Hq, hq = row % Hq, item = b * Hkv + hq / G, g = hq % G;
                const int64_t n = span_count(origin_of(kv_starts, b, align), kv_lens[b]);
                if (n < 2) continue; /* written by its unit */
                float o[MAX_D], l = -INFINITY;
                memset(o, 0, sizeof(float) * (size_t)D);
                for (int64_t sp = 0; sp < n; sp++)
                    fold_span(o, &l, span_o + ((item * spans + sp) * G + g) * D,
                              span_l[(item * spans + sp) * G + g], D);
                if (lse) lse[row] = l;
                store_io(o, io, D, (char *)out + row * D * io_bytes);
            }
        }
        if (parts > 1) {
            /* Merge each head's parts (and the starting state) by their log-sum-exps. */
#pragma omp for schedule(static)
            for (int64_t row = 0; row < B * Hq; row++) {
                const int64_t b = row / Hq, hq = row % Hq, item = b * Hkv + hq / G, g = hq % G;
                float top = o_init ? lse_init[row] : -INFINITY;
                for (int64_t p = 0; p < parts; p++) {
                    const float l = part_lse[(item * parts + p) * G + g];
                    top = l > top ? l : top;
                }
                float acc[MAX_D], total = 0.0f;
                memset(acc, 0, sizeof(float) * (size_t)D);
                if (o_init && lse_init[row] != -INFINITY) {
                    const float w = expf(lse_init[row] - top);
                    total += w;
                    for (int64_t d = 0; d < D; d++) acc[d] += w * o_init[row * D + d];
                }
                for (int64_t p = 0; p < parts; p++) {
                    const float l = part_lse[(item * parts + p) * G + g];
                    if (l == -INFINITY) continue;
                    const float w = expf(l - top), *o = part_o + ((item * parts + p) * G + g) * D;
                    total += w;
                    for (int64_t d = 0; d < D; d++) acc[d] += w * o[d];
                }
                const float inv = total > 0.0f ? 1.0f / total : 0.0f;
                for (int64_t d = 0; d < D; d++) acc[d] *= inv;
                if (lse) lse[row] = total > 0.0f ? top + logf(total) : -INFINITY;
                store_io(acc, io, D, (char *)out + row * D * io_bytes);
            }
        }
    }
    free(part_o);
    free(part_lse);
    free(span_o);
    free(span_l);
    free(firsts);
    free(pack_off);
    free(packed);
    return 0;
}

/* Returns 0, 1 when D or the group exceeds the fixed tile buffers (the caller falls back), or
 * 3 when the split's scratch could not be allocated. split = 0: never split a query's keys over
 * threads (flash-decoding's merge is other arithmetic than one pass), so each query's output
 * is a function of its own keys alone: batch-invariant. kv_starts (or NULL): each query's first
 * key (a sliding window's), counted as kv_lens are; with it keys are never split. */
int kvmemo_paged_decode(const float *q, const void *k_pages, const void *v_pages, int dtype,
                        const int64_t *block_tables, int64_t table_stride, const int64_t *table_rows,
                        int64_t first_block, const int64_t *kv_lens, const int64_t *kv_starts,
                        int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                        int64_t num_blocks, float scale, float *out, float *lse, int split) {
    return paged_decode(q, Hq * D, NULL, NULL, 0, 0, NULL, k_pages, v_pages, dtype, block_tables,
                        table_stride, table_rows, first_block, kv_lens, kv_starts, B, Hq, Hkv, D,
                        bs, num_blocks, scale, out, lse, NULL, NULL, split);
}

/* A decode step's attention for one layer with its KV write folded in: sequence b's new key and
 * value (rows of k_new / v_new, kv_stride apart, heads D apart) go to slot slots[b] of its pages
 * first, then it attends over the kv_lens[b] keys from table entry first_block on. q rows are
 * q_stride apart; q, k_new, v_new and out ([B, Hq, D] contiguous) are fp32 (io = 0) or bf16
 * (io = 1); fp32 or bf16 pages. With o_prefix [B, Hq, D] and lse_prefix [B, Hq] (fp32: a
 * cascade's attention over the shared keys before first_block), those are the online softmax's
 * starting state, so out is attention over prefix and suffix together, merged in place. split as
 * kvmemo_paged_decode's. */
int kvmemo_paged_decode_write(const void *q, int64_t q_stride, const void *k_new,
                              const void *v_new, int64_t kv_stride, int io, const int64_t *slots,
                              void *k_pages, void *v_pages, int dtype, const int64_t *block_tables,
                              int64_t table_stride, const int64_t *table_rows, int64_t first_block,
                              const int64_t *kv_lens, const int64_t *kv_starts, int64_t B,
                              int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t num_blocks,
                              float scale, const float *o_prefix, const float *lse_prefix,
                              void *out, int split) {
    if ((dtype != KV_F32 && dtype != KV_BF16) || (io != 0 && io != 1)) return 2;
    if ((o_prefix == NULL) != (lse_prefix == NULL)) return 2; /* a starting state needs both */
    return paged_decode(q, q_stride, k_new, v_new, kv_stride, io, slots, k_pages, v_pages, dtype,
                        block_tables, table_stride, table_rows, first_block, kv_lens, kv_starts, B,
                        Hq, Hkv, D, bs, num_blocks, scale, out, NULL, o_prefix, lse_prefix, split);
}
