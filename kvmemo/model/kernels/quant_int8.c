/* GGUF-quantized linear layers with int8 activations: y[M, N] = q8(x)[M, K] . dequant(W)[N, K]^T.
 *
 * How: each row of x is quantized per GROUP (16) values to int8 codes with one fp32 scale
 * (d = amax * (1/127), code = round(x / d)). Why 16: the repacked kernel sums a group's four
 * vpdpbusd in int32 before one conversion and one FMA, where a scale per 4 values (lane) needs
 * both for every dot: 1.4x the products' rate at 9 to 512 rows (docs/benchmarks.md). llama.cpp's
 * Q8 activations take one scale per 32 (no faster here, and less exact). A weight's 32-value
 * run is a vector of unsigned codes u with per-16 scales sa/sb and offsets ca/cb (value = s * u
 * + c), so a lane's product (4 codes) is
 *     d_lane * s * <u, q>[lane] + c * d_lane * sum(q[lane])
 * and <u, q> is an integer dot product: vpdpbusd with AVX512-VNNI or AVX-VNNI, vpmaddubsw +
 * vpmaddwd on AVX2, a plain loop elsewhere. Where the build has vectors (AVX2 and up), weights
 * are repacked once at load so that a vector's lanes are 16 output rows (q8_repacked.h): that
 * kernel serves every row count. The row-by-row kernel below reads the GGUF bytes as they are:
 * for plain x86-64 and a weight whose scales the repacked layout cannot hold (kvmemo_q8_repack's
 * status 2). Q8_0's signed codes go as |w| . sign(q, w) on AVX2 without VNNI, in both.
 *
 * Invariant: y equals F.linear(x', dequantize(W)) to fp32 rounding, where x' = d * code is x
 * after that quantization (so |y - F.linear(x, W)| <= sum_k |W[n, k]| * d(k) / 2, plus
 * rounding). Why: a decode step is bound by reading the weights, and an integer dot product of
 * 32 codes takes one instruction where dequantizing them to fp32 takes a dozen; the
 * fp32-activation kernel in quant_linear.c stays for F16/BF16 weights.
 * Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32-value blocks), Q4_K, Q5_K, Q6_K (256-value blocks,
 * read as eight 32-value runs).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "gguf_types.h"
#include "q8_api.h"
#include "vec_exp.h"

enum { MAX_M = 32 };
enum { GROUP = 16 }; /* activation values per int8 scale: 4 or 16 (lanes of 4 codes) */

/* GROUP for Python (quant_int8.py reads it here: stated once). */
int kvmemo_q8_group(void) { return GROUP; }

typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef uint8_t v32u8 __attribute__((vector_size(32)));

/* Row m of x -> codes xq[m, K] and 16 * K/32 floats of scales at xd + m * 16 * (K/32): first,
 * per 32-code block b, the scale d of each of its 8 lanes (4 codes; a GROUP shares one d) at 8b;
 * then, per lane, d * sum(its group's codes) * 4 / GROUP (at 8 * (K/32) + 8b). Why that layout:
 * the product kernel multiplies eight int32 lanes of partial dot products by their d and adds
 * offset * (d * sum) spread over a group's lanes, with two vector FMAs and no scalar work (the
 * spreading factor is a power of two, exact); consecutive blocks' entries are adjacent, so a
 * 512-bit load takes two blocks. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
/* Sixteen values (four groups of GROUP == 4, or one of 16) as the scalar loop below quantizes
 * them, bit for bit: NaN counts as 0 in the group's amax (as fmaxf skips it) and codes as 0; the
 * group max and sum reduce within each 128-bit lane, then across lanes for a group of 16.
 * Returns d and d * sum * 4 / GROUP, replicated over each group. */
static inline void quantize16(const float *x, int8_t *q, __m512 *d_out, __m512 *c_out) {
    const __m512 v = _mm512_loadu_ps(x);
    const __mmask16 ordered = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
    __m512 a = _mm512_maskz_mov_ps(ordered, _mm512_abs_ps(v));
    a = _mm512_max_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));
    a = _mm512_max_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));
    if (GROUP == 16) {
        a = _mm512_max_ps(a, _mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(2, 3, 0, 1)));
        a = _mm512_max_ps(a, _mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(1, 0, 3, 2)));
    }
    const __m512 d = _mm512_mul_ps(a, _mm512_set1_ps(1.0f / 127.0f));
    const __mmask16 normal = _mm512_cmp_ps_mask(d, _mm512_set1_ps(0x1p-126f), _CMP_GE_OQ);
    const __m512 id = _mm512_maskz_div_ps(normal, _mm512_set1_ps(1.0f), d);
    const __m512 scaled = _mm512_mul_ps(v, id);
    const __mmask16 numbers = _mm512_cmp_ps_mask(scaled, scaled, _CMP_ORD_Q);
    const __m512 r = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i codes = _mm512_maskz_cvtps_epi32(numbers, r);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(codes));
    codes = _mm512_add_epi32(codes, _mm512_shuffle_epi32(codes, _MM_PERM_CDAB));
    codes = _mm512_add_epi32(codes, _mm512_shuffle_epi32(codes, _MM_PERM_BADC));
    if (GROUP == 16) {
        codes = _mm512_add_epi32(codes, _mm512_shuffle_i32x4(codes, codes, _MM_SHUFFLE(2, 3, 0, 1)));
        codes = _mm512_add_epi32(codes, _mm512_shuffle_i32x4(codes, codes, _MM_SHUFFLE(1, 0, 3, 2)));
    }
    *d_out = d;
    *c_out = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(codes)),
                           _mm512_set1_ps(4.0f / GROUP));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) \
    && !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__))
/* The largest of a vector's 8 lanes, in every lane (max is exact: the order does not matter). */
static inline __m256 lanes_max(__m256 a) {
    a = _mm256_max_ps(a, _mm256_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));
    a = _mm256_max_ps(a, _mm256_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_max_ps(a, _mm256_permute2f128_ps(a, a, 1));
}

/* One group of 16 values (GROUP == 16) as the scalar loop below quantizes them, bit for bit:
 * NaN counts as 0 in the amax (as fmaxf skips it) and codes as 0. Writes the 16 codes to q, d
 * to *d_out and d * sum * 4 / GROUP to *c_out. (The scalar loop called libm's fmaxf per value:
 * 8% of Gemma 3's prefill on Zen 3.) */
static inline void quantize16_avx2(const float *x, int8_t *q, float *d_out, float *c_out) {
    const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 a0 = _mm256_and_ps(_mm256_andnot_ps(sign, v0), _mm256_cmp_ps(v0, v0, _CMP_ORD_Q));
    const __m256 a1 = _mm256_and_ps(_mm256_andnot_ps(sign, v1), _mm256_cmp_ps(v1, v1, _CMP_ORD_Q));
    const __m256 d = _mm256_mul_ps(lanes_max(_mm256_max_ps(a0, a1)), _mm256_set1_ps(1.0f / 127.0f));
    const __m256 normal = _mm256_cmp_ps(d, _mm256_set1_ps(0x1p-126f), _CMP_GE_OQ);
    const __m256 id = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), d), normal);
    __m256i codes[2];
    const __m256 v[2] = {v0, v1};
    for (int i = 0; i < 2; i++) {
        const __m256 scaled = _mm256_mul_ps(v[i], id);
        const __m256 r = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        /* NaN (from x NaN, or inf * 0) codes as 0 */
        codes[i] = _mm256_and_si256(_mm256_cvtps_epi32(r),
                                    _mm256_castps_si256(_mm256_cmp_ps(scaled, scaled, _CMP_ORD_Q)));
    }
    /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back */
    const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(codes[0], codes[1]), _MM_SHUFFLE(3, 1, 2, 0));
    const __m128i w8 = _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
    _mm_storeu_si128((__m128i *)q, w8);
    __m256i sum = _mm256_add_epi32(codes[0], codes[1]);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    const float dd = _mm256_cvtss_f32(d);
    *d_out = dd;
    *c_out = dd * (float)_mm_cvtsi128_si32(s4) * (4.0f / GROUP);
}
#endif

int kvmemo_quantize_q8(const float *x, int64_t M, int64_t K, int64_t ldx, int8_t *xq, float *xd) {
    if (K % 32) return 2;
    const int64_t nb = K / 32;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
    if (GROUP == 4 || GROUP == 16) {
        /* lanes 0, 4, 8, 12 of the first vector, then of the second: one per lane of 4 codes */
        const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
        for (int64_t m = 0; m < M; m++) {
            for (int64_t b = 0; b < nb; b++) {
                const float *xb = x + m * ldx + 32 * b;
                int8_t *q = xq + m * K + 32 * b;
                float *e = xd + m * 16 * nb + 8 * b, *c = e + 8 * nb;
                __m512 d0, c0, d1, c1;
                quantize16(xb, q, &d0, &c0);
                quantize16(xb + 16, q + 16, &d1, &c1);
                _mm256_storeu_ps(e, _mm512_castps512_ps256(_mm512_permutex2var_ps(d0, firsts, d1)));
                _mm256_storeu_ps(c, _mm512_castps512_ps256(_mm512_permutex2var_ps(c0, firsts, c1)));
            }
        }
        return 0;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (GROUP == 16) {
        for (int64_t m = 0; m < M; m++)
            for (int64_t b = 0; b < nb; b++) {
                float *e = xd + m * 16 * nb + 8 * b, *c = e + 8 * nb;
                for (int g = 0; g < 2; g++) {
                    float d, dc;
                    quantize16_avx2(x + m * ldx + 32 * b + 16 * g, xq + m * K + 32 * b + 16 * g, &d, &dc);
                    for (int i = 0; i < 4; i++) e[4 * g + i] = d, c[4 * g + i] = dc;
                }
            }
        return 0;
    }
#endif
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            float *e = xd + m * 16 * nb + 8 * b, *c = e + 8 * nb;
            for (int g = 0; g < 32 / GROUP; g++) { /* a scale per GROUP values */
                const float *xg = x + m * ldx + 32 * b + GROUP * g;
                float amax = 0.0f;
                for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(xg[i]));
                /* a subnormal d would make 1/d infinite: such a group is zeros */
                const float d = amax * (1.0f / 127.0f), id = d >= 0x1p-126f ? 1.0f / d : 0.0f;
                int8_t *q = xq + m * K + 32 * b + GROUP * g;
                int32_t sum = 0; /* |sum| <= 16 * 127: exact in fp32 */
                for (int i = 0; i < GROUP; i++) {
                    const float v = xg[i] * id;
                    q[i] = (int8_t)(v == v ? nearbyintf(v) : 0.0f); /* NaN: 0, not UB */
                    sum += q[i];
                }
                for (int i = 0; i < GROUP / 4; i++) { /* its lanes: 4 codes each */
                    e[GROUP / 4 * g + i] = d;
                    c[GROUP / 4 * g + i] = d * (float)sum * (4.0f / GROUP);
                }
            }
        }
    }
    return 0;
}

/* One weight run of 32 values: unsigned codes, per-16 scales and offsets (see the header). */
typedef struct {
    v32u8 u;
    float sa, sb, ca, cb;
} run_t;

static inline v32u8 join(v16u8 lo, v16u8 hi) {
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                   17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}

/* Bit i of the 32-bit little-endian word at p, as 0x10 in byte i (Q5 high bits). */
static inline v32u8 high_bits(const uint8_t *p) {
    v32u8 w = {p[0], p[1], p[2], p[3]};
    v32u8 bytes = __builtin_shufflevector(w, w, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2,
                                          2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const v32u8 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                       1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    return (v32u8)((bytes & bit) != 0) & 0x10;
}

static inline v32u8 load32(const uint8_t *p) { v32u8 v; memcpy(&v, p, 32); return v; }
static inline v16u8 load16(const uint8_t *p) { v16u8 v; memcpy(&v, p, 16); return v; }

/* Run j (0-based, 32 values each) of a weight row of `type`. Offsets and scales are formed as
 * gguf-py's dequantize forms the values (d * code + m, d * sc * code - dmin * mn, ...). */
static inline __attribute__((always_inline)) run_t unpack(int type, const uint8_t *row, int64_t j) {
    run_t r;
    switch (type) {
    case T_Q4_0: case T_Q4_1: {
        const int has_min = type == T_Q4_1;
        const uint8_t *b = row + j * (has_min ? 20 : 18);
        const float d = f16(b);
        const v16u8 q = load16(b + 2 + 2 * has_min);
        r.u = join(q & 0xF, q >> 4);
        r.sa = r.sb = d;
        r.ca = r.cb = has_min ? f16(b + 2) : -8.0f * d;
        break;
    }
    case T_Q5_0: case T_Q5_1: {
        const int has_min = type == T_Q5_1;
        const uint8_t *b = row + j * (has_min ? 24 : 22);
        const float d = f16(b);
        const uint8_t *qh = b + 2 + 2 * has_min;
        const v16u8 q = load16(qh + 4);
        r.u = join(q & 0xF, q >> 4) | high_bits(qh);
        r.sa = r.sb = d;
        r.ca = r.cb = has_min ? f16(b + 2) : -16.0f * d;
        break;
    }
    case T_Q8_0: { /* signed codes: the caller takes |w| and moves the sign onto x */
        const uint8_t *b = row + j * 34;
        r.u = load32(b + 2);
        r.sa = r.sb = f16(b);
        r.ca = r.cb = 0.0f;
        break;
    }
    case T_Q4_K: case T_Q5_K: {
        const int is5 = type == T_Q5_K;
        const uint8_t *b = row + (j / 8) * (is5 ? 176 : 144);
        const int s = (int)(j % 8);
        const uint8_t *sc = b + 4;
        int scale, mn;
        if (s < 4) {
            scale = sc[s] & 63;
            mn = sc[s + 4] & 63;
        } else {
            scale = (sc[s + 4] & 0xF) | ((sc[s - 4] >> 6) << 4);
            mn = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
        }
        const v32u8 q = load32(b + (is5 ? 48 : 16) + 32 * (s / 2));
        r.u = (s & 1) ? q >> 4 : q & 0xF;
        if (is5) r.u |= ((load32(b + 16) >> s) & 1) << 4;
        r.sa = r.sb = f16(b) * (float)scale;
        r.ca = r.cb = -(f16(b + 2) * (float)mn);
        break;
    }
    case T_Q6_K: { /* half c of the block, run k of its four: low 4 bits from ql, 2 from qh */
        const uint8_t *b = row + (j / 8) * 210;
        const int c = (int)(j % 8) / 4, k = (int)(j % 4);
        const v32u8 ql = load32(b + 64 * c + 32 * (k & 1)), qh = load32(b + 128 + 32 * c);
        r.u = ((ql >> (4 * (k >> 1))) & 0xF) | (((qh >> (2 * k)) & 3) << 4);
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * c + 2 * k;
        const float d = f16(b + 208);
        r.sa = d * (float)sc[0];
        r.sb = d * (float)sc[1];
        r.ca = -32.0f * r.sa;
        r.cb = -32.0f * r.sb;
        break;
    }
    default: __builtin_unreachable();
    }
    return r;
}

#if defined(__AVX2__)
/* Eight int32 lanes, lane i = sum of u[4i..4i+3] * s[4i..4i+3] (u unsigned, s signed). */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else /* |u| <= 255, |s| <= 127 except Q8_0 (|u| <= 128): pairs stay within int16 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

enum { TILE = 4 }; /* rows of x per pass over a weight row: their accumulators stay in registers */

/* A weight run's scales and offsets as eight lanes (four per half). */
#if defined(__AVX2__)
static inline __m256 half_lanes(float a, float b) { return _mm256_setr_ps(a, a, a, a, b, b, b, b); }
#endif

/* Int8Weights repacks every weight for q8_repacked.h's kernel: 512-bit with VNNI, else 256-bit
 * (AVX2, F16C; Q8_0's codes signed without a VNNI dot, see Q8_SIGNED_CODES). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)
#define Q8_REPACKED 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q8_REPACKED 256
#endif

#if defined(__AVX2__)
/* Weight run j as unsigned codes, the mask source for Q8_0's signs, its scales and offsets. */
typedef struct {
    __m256i u, w;
    __m256 s, c;
} unpacked_t;

static inline __attribute__((always_inline)) unpacked_t unpack_run(int type, const uint8_t *row,
                                                                   int64_t j) {
    const run_t r = unpack(type, row, j);
    unpacked_t p;
    p.w = (__m256i)r.u;
    p.u = type == T_Q8_0 ? _mm256_abs_epi8(p.w) : p.w;
    p.s = half_lanes(r.sa, r.sb);
    p.c = half_lanes(r.ca, r.cb);
    return p;
}

/* Weight run j against x rows [0, R): acc_p[r] += (lanes of <u, q>) * s * d, acc_c[r] +=
 * c * (d * sums / 4). Inlined with R constant, so the accumulators are registers. */
static inline __attribute__((always_inline)) void run_products(
    int type, int R, unpacked_t r, int64_t j, const int8_t *xq, const float *xd, int64_t K,
    int64_t nb, __m256 *acc_p, __m256 *acc_c) {
    for (int m = 0; m < R; m++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(xq + m * K + 32 * j));
        if (type == T_Q8_0) q = _mm256_sign_epi8(q, r.w);
        const float *e = xd + m * 16 * nb + 8 * j;
        const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(dot_u8s8(r.u, q)), r.s);
        acc_p[m] = _mm256_fmadd_ps(p, _mm256_loadu_ps(e), acc_p[m]);
        if (type != T_Q8_0) acc_c[m] = _mm256_fmadd_ps(r.c, _mm256_loadu_ps(e + 8 * nb), acc_c[m]);
    }
}

/* y[m * ldy] for x rows [0, R) against one weight row, from its bytes or its runs unpacked
 * before (`runs`, see pack_row). Two sets of accumulators take even and odd runs, so
 * consecutive FMAs into one register do not wait on each other (latency 4). */
static inline __attribute__((always_inline)) void row_tile(int type, int R, const uint8_t *row,
                                                           const unpacked_t *runs,
                                                           const int8_t *xq, const float *xd,
                                                           int64_t K, float *y, int64_t ldy) {
    const int64_t nb = K / 32;
    __m256 p0[TILE], p1[TILE], c0[TILE], c1[TILE];
    for (int m = 0; m < R; m++) p0[m] = p1[m] = c0[m] = c1[m] = _mm256_setzero_ps();
#define RUN(j) (runs ? runs[j] : unpack_run(type, row, j))
    int64_t j = 0;
    for (; j + 1 < nb; j += 2) {
        run_products(type, R, RUN(j), j, xq, xd, K, nb, p0, c0);
        run_products(type, R, RUN(j + 1), j + 1, xq, xd, K, nb, p1, c1);
    }
    if (j < nb) run_products(type, R, RUN(j), j, xq, xd, K, nb, p0, c0);
#undef RUN
    for (int m = 0; m < R; m++)
        y[m * ldy] = hsum8(_mm256_add_ps(_mm256_add_ps(p0[m], p1[m]), _mm256_add_ps(c0[m], c1[m])));
}

static inline void pack_row(int type, const uint8_t *row, int64_t nb, unpacked_t *out) {
    for (int64_t j = 0; j < nb; j++) out[j] = unpack_run(type, row, j);
}
#endif

/* y[m, n] for M rows of x against weight rows [n0, n1) of one type. `scratch` (NULL, or room
 * for the rows' unpacked runs: unpacked_bytes) lets more than one tile of x rows share one
 * unpacking of each weight run, where each tile would otherwise unpack it again. Either way a
 * product's arithmetic is the same (the same vectors, summed in the same order): a row's
 * output does not depend on which rows share the call. */
static inline __attribute__((always_inline)) void rows_of_type(
    int type, const int8_t *xq, const float *xd, const uint8_t *W, int64_t row_bytes, float *y,
    int64_t M, int64_t n0, int64_t n1, int64_t K, int64_t ldy, void *scratch) {
    const int64_t nb = K / 32;
#if defined(__AVX2__)
    unpacked_t *runs = M > TILE ? (unpacked_t *)scratch : NULL;
    if (runs)
        for (int64_t n = n0; n < n1; n++) pack_row(type, W + n * row_bytes, nb, runs + (n - n0) * nb);
    /* x tile outside, weight rows inside: a tile's codes (TILE rows) stay in L1 while the
     * task's few weight rows stream past them. */
    for (int64_t m = 0; m < M; m += TILE) {
        const int8_t *q = xq + m * K;
        const float *e = xd + m * 16 * nb;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *row = W + n * row_bytes;
            const unpacked_t *r = runs ? runs + (n - n0) * nb : NULL;
            float *out = y + m * ldy + n;
            switch (M - m < TILE ? M - m : TILE) {
            case 1: row_tile(type, 1, row, r, q, e, K, out, ldy); break;
            case 2: row_tile(type, 2, row, r, q, e, K, out, ldy); break;
            case 3: row_tile(type, 3, row, r, q, e, K, out, ldy); break;
            default: row_tile(type, 4, row, r, q, e, K, out, ldy); break;
            }
        }
    }
#else
    (void)scratch;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = W + n * row_bytes;
        float acc[MAX_M] = {0};
        for (int64_t j = 0; j < nb; j++) {
            const run_t r = unpack(type, row, j);
            for (int64_t m = 0; m < M; m++) {
                const int8_t *q = xq + m * K + 32 * j;
                const float *e = xd + m * 16 * nb + 8 * j, *c = e + 8 * nb;
                for (int lane = 0; lane < 8; lane++) { /* as the vector lanes: 4 codes each */
                    int32_t dot = 0;
                    for (int i = 4 * lane; i < 4 * lane + 4; i++)
                        dot += (type == T_Q8_0 ? (int8_t)r.u[i] : r.u[i]) * q[i];
                    acc[m] += e[lane] * (lane < 4 ? r.sa : r.sb) * (float)dot +
                              (lane < 4 ? r.ca : r.cb) * c[lane];
                }
            }
        }
        for (int64_t m = 0; m < M; m++) y[m * ldy + n] = acc[m];
    }
#endif
}

#define TYPE_KERNEL(T)                                                                         \
    static void rows_##T(const int8_t *xq, const float *xd, const uint8_t *W, int64_t rb,      \
                         float *y, int64_t M, int64_t n0, int64_t n1, int64_t K, int64_t ldy,   \
                         void *scratch) {                                                       \
        rows_of_type(T, xq, xd, W, rb, y, M, n0, n1, K, ldy, scratch);                          \
    }
TYPE_KERNEL(T_Q4_0)
TYPE_KERNEL(T_Q4_1)
TYPE_KERNEL(T_Q5_0)
TYPE_KERNEL(T_Q5_1)
TYPE_KERNEL(T_Q8_0)
TYPE_KERNEL(T_Q4_K)
TYPE_KERNEL(T_Q5_K)
TYPE_KERNEL(T_Q6_K)

typedef void (*rows_fn)(const int8_t *, const float *, const uint8_t *, int64_t,
                        float *, int64_t, int64_t, int64_t, int64_t, int64_t, void *);

enum { CHUNK = 16 }; /* weight rows per task (a repacked group): a thread's rows stay contiguous */

/* Rows of x per pass over the weights: with vector kernels as many as keep their codes and
 * scales (3 bytes per value) within about 384 KiB of L2, so that each weight chunk is unpacked
 * once per pass and the x rows it meets come from cache; the plain-C loop keeps MAX_M sums. */
static int64_t rows_per_pass(int64_t K) {
#if defined(__AVX2__)
    int64_t rows = (int64_t)(384 << 10) / (3 * K);
    rows = rows < 16 ? 16 : rows > 256 ? 256 : rows;
    return rows - rows % TILE;
#else
    (void)K;
    return MAX_M;
#endif
}

/* Bytes of a task's unpacked weight runs (CHUNK rows), 0 where nothing is unpacked ahead. */
static size_t unpacked_bytes(int64_t K) {
#if defined(__AVX2__)
    return sizeof(unpacked_t) * (size_t)(CHUNK * (K / 32));
#else
    (void)K;
    return 0;
#endif
}

static int kernel_for(int type, rows_fn *fn, int64_t *values, int64_t *bytes) {
    switch (type) {
    case T_Q4_0: *fn = rows_T_Q4_0; *values = 32; *bytes = 18; return 1;
    case T_Q4_1: *fn = rows_T_Q4_1; *values = 32; *bytes = 20; return 1;
    case T_Q5_0: *fn = rows_T_Q5_0; *values = 32; *bytes = 22; return 1;
    case T_Q5_1: *fn = rows_T_Q5_1; *values = 32; *bytes = 24; return 1;
    case T_Q8_0: *fn = rows_T_Q8_0; *values = 32; *bytes = 34; return 1;
    case T_Q4_K: *fn = rows_T_Q4_K; *values = 256; *bytes = 144; return 1;
    case T_Q5_K: *fn = rows_T_Q5_K; *values = 256; *bytes = 176; return 1;
    case T_Q6_K: *fn = rows_T_Q6_K; *values = 256; *bytes = 210; return 1;
    default: return 0;
    }
}

/* out = x * rsqrt(mean(x^2) + eps) * w over n values (out may be x). */
static inline void rmsnorm_row(const float *x, int64_t n, const float *w, float eps, float *out) {
    float ss = 0.0f;
    for (int64_t k = 0; k < n; k++) ss += x[k] * x[k];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t k = 0; k < n; k++) out[k] = x[k] * r * w[k];
}

/* tanh-approximated GELU (torch's approximate="tanh", Gemma's gelu_pytorch_tanh), with tanh u
 * as 1 - 2 / (e^2u + 1) so that the loop vectorizes (exp_poly saturates: tanh stays in [-1, 1]) */
#pragma omp declare simd
static inline float gelu_tanh(float x) {
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + (1.0f - 2.0f / (exp_poly(2.0f * u) + 1.0f)));
}

/* Row m of the product's input, after the options' norm or gating, into out[K]. */
static void prepare_row(const float *x, int64_t K, const q8_options *o, float *out) {
    if (o && o->gated && o->gelu) {
#pragma omp simd
        for (int64_t k = 0; k < K; k++) out[k] = gelu_tanh(x[k]) * x[K + k];
    } else if (o && o->gated) {
#pragma omp simd
        for (int64_t k = 0; k < K; k++) {
            const float g = x[k];
            out[k] = g / (1.0f + exp_poly(-g)) * x[K + k];
        }
    } else if (o && o->norm) {
        rmsnorm_row(x, K, o->norm, o->eps, out);
    } else {
        memcpy(out, x, sizeof(float) * (size_t)K);
    }
}

/* Per-head norms, RoPE on y's first rope_cols columns (whole heads), the row's norm, then the
 * residual add: row by row, in parallel from PARALLEL_ROWS rows (a row's steps and their order are
 * the same on any thread, so its bits are too). */
enum { PARALLEL_ROWS = 4 };
static void finish_rows(float *y, int64_t M, int64_t N, int64_t ldy, const q8_options *o) {
    if (!o) return;
#pragma omp parallel for schedule(static) if (M >= PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++) {
        float *ym = y + m * ldy;
        if (o->q_norm) {
            for (int64_t h = 0; h < o->q_cols; h += o->head_dim)
                rmsnorm_row(ym + h, o->head_dim, o->q_norm, o->eps, ym + h);
            for (int64_t h = o->q_cols; h < o->q_cols + o->k_cols; h += o->head_dim)
                rmsnorm_row(ym + h, o->head_dim, o->k_norm, o->eps, ym + h);
        }
        if (o->cos) {
            const int64_t half = o->head_dim / 2;
            const float *c = o->cos + m * half, *sn = o->sin + m * half;
            for (int64_t h = 0; h < o->rope_cols; h += o->head_dim) {
                float *a = ym + h, *b = a + half;
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = a[i], x2 = b[i];
                    a[i] = x1 * c[i] - x2 * sn[i];
                    b[i] = x2 * c[i] + x1 * sn[i];
                }
            }
        }
        if (o->post_norm) rmsnorm_row(ym, N, o->post_norm, o->eps, ym);
        if (o->residual)
            for (int64_t n = 0; n < N; n++) ym[n] += o->residual[m * o->ldr + n];
    }
}

#include "q8_repacked.h"

/* y[M, sum N_p] = q8(x')[M, K] . [W_0; W_1; ...]^T, x' = x after the options' norm or gating.
 * x' is quantized here (kvmemo_quantize_q8), and one parallel loop covers every part, so a small
 * part (k, v) does not run on its own. opts may be NULL. Status 0 on success, 1 for a type this
 * kernel does not read (or a bad part count), 2 for K not a whole number of a part's blocks, 3
 * when out of memory. */
int kvmemo_quant_linear_q8(const float *x, int64_t M, int64_t ldx, const q8_weights *w, float *y,
                           int64_t ldy, const q8_options *opts) {
    rows_fn fn[MAX_PARTS];
    int64_t row_bytes[MAX_PARTS], first_chunk[MAX_PARTS + 1], column[MAX_PARTS];
    int is_packed[MAX_PARTS], any_packed = 0, any_unpacked = 0;
    const int64_t K = w->K, num_parts = w->num_parts;
    if (num_parts < 1 || num_parts > MAX_PARTS) return 1;
    first_chunk[0] = 0;
    for (int64_t p = 0; p < num_parts; p++) {
        int64_t values, bytes;
        if (!kernel_for(w->types[p], &fn[p], &values, &bytes)) return 1;
        if (K % values) return 2;
#if defined(Q8_REPACKED)
        is_packed[p] = w->packed[p] && repacks(w->types[p]);
#else
        is_packed[p] = 0;
#endif
        any_packed |= is_packed[p];
        any_unpacked |= !is_packed[p];
        row_bytes[p] = K / values * bytes;
        column[p] = p ? column[p - 1] + w->N[p - 1] : 0;
        first_chunk[p + 1] = first_chunk[p] + (w->N[p] + CHUNK - 1) / CHUNK;
    }
    const int64_t nb = K / 32, chunks = first_chunk[num_parts];
    int8_t *xq = malloc((size_t)(M * K));
    float *xd = malloc(sizeof(float) * (size_t)(M * 16 * nb));
    /* per run of each row: its two halves' d * sum (the repacked kernel's offset terms) */
    float *hs = any_packed ? malloc(sizeof(float) * (size_t)(M * nb * 2)) : NULL;
    int no_row = 0;
    if (!xq || !xd || (any_packed && !hs)) {
        free(xq);
        free(xd);
        free(hs);
        return 3;
    }
    /* Rows are prepared and quantized each on its own (in parallel from PARALLEL_ROWS rows: a
     * prefill's GELU gating and quantization were a serial tenth of its products' time). */
#pragma omp parallel if (M >= PARALLEL_ROWS)
    {
        float *row = malloc(sizeof(float) * (size_t)K);
        if (!row) {
#pragma omp atomic write
            no_row = 1;
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            if (!row) continue;
            prepare_row(x + m * ldx, K, opts, row);
            kvmemo_quantize_q8(row, 1, K, K, xq + m * K, xd + m * 16 * nb);
            const float *c = xd + m * 16 * nb + 8 * nb;
            for (int64_t j = 0; hs && j < nb; j++) {
                hs[(m * nb + j) * 2] = (c[8 * j] + c[8 * j + 1]) + (c[8 * j + 2] + c[8 * j + 3]);
                hs[(m * nb + j) * 2 + 1] = (c[8 * j + 4] + c[8 * j + 5]) + (c[8 * j + 6] + c[8 * j + 7]);
            }
        }
        free(row);
    }
    if (no_row) {
        free(xq);
        free(xd);
        free(hs);
        return 3;
    }
    const int64_t pass = rows_per_pass(K);
    const size_t scratch_bytes = M > TILE && any_unpacked ? unpacked_bytes(K) : 0;
    int failed = 0;
    for (int64_t m0 = 0; m0 < M; m0 += pass) {
        const int64_t rows = M - m0 < pass ? M - m0 : pass;
        const int8_t *q = xq + m0 * K;
        const float *e = xd + m0 * 16 * nb;
#pragma omp parallel
        {
            /* 64-byte aligned: the unpacked runs are vector registers' images */
            void *scratch = scratch_bytes ? aligned_alloc(64, (scratch_bytes + 63) & ~(size_t)63) : NULL;
            if (scratch_bytes && !scratch) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t c = 0; c < chunks; c++) {
                if (scratch_bytes && !scratch) continue;
                int64_t p = 0;
                while (c >= first_chunk[p + 1]) p++;
                const int64_t n0 = (c - first_chunk[p]) * CHUNK;
                const int64_t n1 = n0 + CHUNK < w->N[p] ? n0 + CHUNK : w->N[p];
#if defined(Q8_REPACKED)
                if (is_packed[p]) {
                    packed_kernel(w->types[p])(w->packed[p], q, e, hs + m0 * nb * 2,
                                               y + m0 * ldy + column[p], rows, n0, n1, K, ldy);
                    continue;
                }
#endif
                fn[p](q, e, w->W[p], row_bytes[p], y + m0 * ldy + column[p], rows, n0, n1, K, ldy,
                      scratch);
            }
            free(scratch);
        }
        if (failed) break;
    }
    free(hs);
    if (failed) {
        free(xq);
        free(xd);
        return 3;
    }
    free(xq);
    free(xd);
    finish_rows(y, M, column[num_parts - 1] + w->N[num_parts - 1], ldy, opts);
    return 0;
}

/* A decoder layer after attention, for M tokens: h = hidden + post_o(o_proj(attn)); out = h +
 * post_mlp(down(act(gate) * up)) with [gate | up] = gate_up(rmsnorm(h) * norm). A Llama layer
 * has no post norms (NULL) and SiLU (gelu 0); a Gemma layer has both norms and tanh-GELU. out
 * [M, H] may be hidden. Why one call: three products and the small ops between them, with no
 * return to Python. */
int kvmemo_q8_mlp_block(const float *attn, int64_t lda, const float *hidden, int64_t ldh,
                        int64_t M, const q8_weights *o_proj, const float *norm, float eps,
                        const q8_weights *gate_up, const q8_weights *down, float *out,
                        int64_t ldo, const float *post_o_norm, const float *post_mlp_norm,
                        int32_t gelu) {
    const int64_t H = o_proj->N[0], I2 = gate_up->N[0] + gate_up->N[1];
    if (o_proj->num_parts != 1 || gate_up->num_parts != 2 || down->num_parts != 1) return 1;
    float *h = malloc(sizeof(float) * (size_t)(M * H)), *gu = malloc(sizeof(float) * (size_t)(M * I2));
    if (!h || !gu) {
        free(h);
        free(gu);
        return 3;
    }
    q8_options o = {0};
    o.residual = hidden;
    o.ldr = ldh;
    o.post_norm = post_o_norm;
    o.eps = eps;
    int status = kvmemo_quant_linear_q8(attn, M, lda, o_proj, h, H, &o);
    if (!status) {
        q8_options n = {0};
        n.norm = norm;
        n.eps = eps;
        status = kvmemo_quant_linear_q8(h, M, H, gate_up, gu, I2, &n);
    }
    if (!status) {
        q8_options g = {0};
        g.gated = 1;
        g.gelu = gelu;
        g.residual = h;
        g.ldr = H;
        g.post_norm = post_mlp_norm;
        g.eps = eps;
        status = kvmemo_quant_linear_q8(gu, M, I2, down, out, ldo, &g);
    }
    free(h);
    free(gu);
    return status;
}
