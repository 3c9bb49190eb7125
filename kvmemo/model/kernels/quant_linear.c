/* GGUF-quantized linear layers for CPU: y[M, N] = x[M, K] . dequant(W)[N, K]^T, W's rows in
 * their GGUF bytes (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), read in place.
 *
 * Invariant: kvmemo_quant_rows gives exactly the values gguf-py's dequantize gives (the same
 * products of fp16 scales and integer codes, in fp32); kvmemo_quant_linear uses the same values
 * (the compiler may fuse a block's scale and offset into one multiply-add) and sums in another
 * order, so y equals F.linear(x, dequantize(W)) to fp32 rounding.
 * Why: a decode step multiplies a few rows of x by every weight, bound by reading the weights;
 * a Q4 row is ~1/7 of its fp32 bytes. Each thread takes its own share of W's rows; a row's
 * 32-value blocks (Q4_0, Q4_1, Q5_0, Q5_1) are dequantized in vector registers, other types a
 * row at a time into an L1-resident buffer, and each is reused for every row of x (up to MAX_M
 * rows at a time).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_types.h"

typedef float v16f __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int32_t v16i32 __attribute__((vector_size(64)));
static inline v16f loadf(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline float hsum(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

static inline float bf16(const uint8_t *p) {
    uint32_t bits = (uint32_t)(p[0] | (p[1] << 8)) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block s (0..7) from the packed 12 bytes. */
static inline void scale_min_k4(int s, const uint8_t *q, int *sc, int *m) {
    if (s < 4) {
        *sc = q[s] & 63;
        *m = q[s + 4] & 63;
    } else {
        *sc = (q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4);
        *m = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
    }
}

/* Block sizes in values and bytes, per type; 0 for an unknown type. */
static int block_shape(int type, int *values, int *bytes) {
    switch (type) {
    case T_F16: *values = 1; *bytes = 2; return 1;
    case T_BF16: *values = 1; *bytes = 2; return 1;
    case T_Q4_0: *values = 32; *bytes = 18; return 1;
    case T_Q4_1: *values = 32; *bytes = 20; return 1;
    case T_Q5_0: *values = 32; *bytes = 22; return 1;
    case T_Q5_1: *values = 32; *bytes = 24; return 1;
    case T_Q8_0: *values = 32; *bytes = 34; return 1;
    case T_Q4_K: *values = 256; *bytes = 144; return 1;
    case T_Q5_K: *values = 256; *bytes = 176; return 1;
    case T_Q6_K: *values = 256; *bytes = 210; return 1;
    default: return 0;
    }
}

/* One block of `type` at b -> out (its block's values). Products are written as gguf-py forms
 * them: (d * scale) * q - (dmin * min) for K-quants, d * q (+ m) for the others. */
static inline void dequant_block(int type, const uint8_t *b, float *out) {
    switch (type) {
    case T_F16: out[0] = f16(b); break;
    case T_BF16: out[0] = bf16(b); break;
    case T_Q4_0: {
        const float d = f16(b);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((b[2 + j] & 0xF) - 8);
            out[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
        }
        break;
    }
    case T_Q4_1: {
        const float d = f16(b), m = f16(b + 2);
        for (int j = 0; j < 16; j++) {
            float lo = d * (float)(b[4 + j] & 0xF), hi = d * (float)(b[4 + j] >> 4);
            out[j] = lo + m;
            out[j + 16] = hi + m;
        }
        break;
    }
    case T_Q5_0:
    case T_Q5_1: {
        const int has_min = type == T_Q5_1;
        const float d = f16(b), m = has_min ? f16(b + 2) : 0.0f;
        const uint8_t *qhp = b + (has_min ? 4 : 2), *qs = qhp + 4;
        const uint32_t qh = (uint32_t)qhp[0] | ((uint32_t)qhp[1] << 8) | ((uint32_t)qhp[2] << 16) |
                            ((uint32_t)qhp[3] << 24);
        const int offset = has_min ? 0 : 16;
        for (int j = 0; j < 16; j++) {
            int lo = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
            int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            float a = d * (float)(lo - offset), c = d * (float)(hi - offset);
            out[j] = has_min ? a + m : a;
            out[j + 16] = has_min ? c + m : c;
        }
        break;
    }
    case T_Q8_0: {
        const float d = f16(b);
        for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)b[2 + j] * d;
        break;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const float d = f16(b), dmin = f16(b + 2);
        const uint8_t *scales = b + 4;
        const uint8_t *qh = type == T_Q5_K ? b + 16 : NULL;
        const uint8_t *qs = b + (type == T_Q5_K ? 48 : 16);
        for (int s = 0; s < 8; s++) {
            int sc, mn;
            scale_min_k4(s, scales, &sc, &mn);
            const float ds = d * (float)sc, dm = dmin * (float)mn;
            const uint8_t *q = qs + 32 * (s / 2);
            const int shift = (s & 1) * 4;
            for (int j = 0; j < 32; j++) {
                int v = (q[j] >> shift) & 0xF;
                if (qh) v |= ((qh[j] >> s) & 1) << 4;
                float p = ds * (float)v;
                out[32 * s + j] = p - dm;
            }
        }
        break;
    }
    case T_Q6_K: { /* two halves of 128 values: four runs of 32 from 64 ql and 32 qh bytes */
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = f16(b + 208);
        for (int c = 0; c < 2; c++) {
            const uint8_t *ql = b + 64 * c, *qh = b + 128 + 32 * c;
            float *o = out + 128 * c;
            const int8_t *sc = scales + 8 * c;
            for (int is = 0; is < 2; is++) { /* 16 values per scale: constant inside */
                const float s1 = d * (float)sc[is], s2 = d * (float)sc[is + 2];
                const float s3 = d * (float)sc[is + 4], s4 = d * (float)sc[is + 6];
                for (int l = 16 * is; l < 16 * is + 16; l++) {
                    const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    o[l] = s1 * (float)q1;
                    o[l + 32] = s2 * (float)q2;
                    o[l + 64] = s3 * (float)q3;
                    o[l + 96] = s4 * (float)q4;
                }
            }
        }
        break;
    }
    }
}

static void dequant_row(int type, const uint8_t *row, float *out, int64_t K, int values, int bytes) {
    for (int64_t k = 0; k < K; k += values, row += bytes) dequant_block(type, row, out + k);
}

/* One 32-value block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) as two vectors of its fp32 values. */
static inline void block32(int type, const uint8_t *b, v16f *w0, v16f *w1) {
    const float d = f16(b);
    if (type == T_Q8_0) {
        v16u8 q0, q1; /* zero-extended, then the sign restored: (u ^ 128) - 128 */
        memcpy(&q0, b + 2, 16);
        memcpy(&q1, b + 18, 16);
        v16i32 a0 = (__builtin_convertvector(q0, v16i32) ^ 128) - 128;
        v16i32 a1 = (__builtin_convertvector(q1, v16i32) ^ 128) - 128;
        *w0 = __builtin_convertvector(a0, v16f) * d;
        *w1 = __builtin_convertvector(a1, v16f) * d;
        return;
    }
    const int has_min = type == T_Q4_1 || type == T_Q5_1;
    const float m = has_min ? f16(b + 2) : 0.0f;
    const int is5 = type == T_Q5_0 || type == T_Q5_1;
    const uint8_t *qs = b + 2 + 2 * has_min + 4 * is5;
    v16u8 q;
    memcpy(&q, qs, 16);
    v16i32 lo = __builtin_convertvector(q & 0xF, v16i32), hi = __builtin_convertvector(q >> 4, v16i32);
    if (is5) {
        const uint8_t *p = b + 2 + 2 * has_min;
        const uint32_t qh = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
                            ((uint32_t)p[3] << 24);
        const v16i32 bit = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        lo |= (((v16i32){0} + (int32_t)qh) >> bit & 1) << 4;
        hi |= (((v16i32){0} + (int32_t)(qh >> 16)) >> bit & 1) << 4;
    }
    const int offset = has_min ? 0 : (is5 ? 16 : 8);
    *w0 = __builtin_convertvector(lo - offset, v16f) * d + m;
    *w1 = __builtin_convertvector(hi - offset, v16f) * d + m;
}

enum { MAX_M = 32 };

/* Status 0 on success, 1 for a type it does not know, 2 for K not a multiple of the block. */
static void quant_linear_rows(const float *x, const uint8_t *W, int type, float *y, int64_t M,
                              int64_t N, int64_t K, int64_t ldy, int values, int bytes);

int kvmemo_quant_linear(const float *x, const uint8_t *W, int type, float *y, int64_t M, int64_t N,
                        int64_t K, int64_t ldy) {
    int values, bytes;
    if (!block_shape(type, &values, &bytes)) return 1;
    if (K % values) return 2;
    for (int64_t m0 = 0; m0 < M; m0 += MAX_M) { /* MAX_M accumulators at a time */
        const int64_t rows = M - m0 < MAX_M ? M - m0 : MAX_M;
        quant_linear_rows(x + m0 * K, W, type, y + m0 * ldy, rows, N, K, ldy, values, bytes);
    }
    return 0;
}

static void quant_linear_rows(const float *x, const uint8_t *W, int type, float *y, int64_t M,
                              int64_t N, int64_t K, int64_t ldy, int values, int bytes) {
    const int64_t row_bytes = K / values * bytes;
    /* Q8_0 dequantizes faster as a plain loop into the buffer (vectorized there) than lane by
     * lane in registers (measured 2x) */
    const int fast32 = values == 32 && type != T_Q8_0;
    const int vec = K % 16 == 0;
#pragma omp parallel
    {
        float *buf = fast32 ? NULL : malloc(sizeof(float) * (size_t)K);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *row = W + n * row_bytes;
            v16f acc[MAX_M];
            for (int64_t m = 0; m < M; m++) acc[m] = (v16f){0};
            if (fast32) { /* dequantize each block in registers, reuse it for every row of x */
                for (int64_t k = 0; k < K; k += 32, row += bytes) {
                    v16f w0, w1;
                    block32(type, row, &w0, &w1);
                    for (int64_t m = 0; m < M; m++) {
                        const float *xm = x + m * K + k;
                        acc[m] += loadf(xm) * w0 + loadf(xm + 16) * w1;
                    }
                }
                for (int64_t m = 0; m < M; m++) y[m * ldy + n] = hsum(acc[m]);
                continue;
            }
            dequant_row(type, row, buf, K, values, bytes);
            for (int64_t m = 0; m < M; m++) {
                const float *xm = x + m * K;
                if (vec) {
                    for (int64_t k = 0; k < K; k += 16) acc[m] += loadf(xm + k) * loadf(buf + k);
                    y[m * ldy + n] = hsum(acc[m]);
                } else {
                    float sum = 0.0f;
                    for (int64_t k = 0; k < K; k++) sum += xm[k] * buf[k];
                    y[m * ldy + n] = sum;
                }
            }
        }
        free(buf);
    }
}

/* Rows ids[0..R) of W, dequantized into out[R, K] (embedding lookups; whole-weight copies). */
int kvmemo_quant_rows(const uint8_t *W, int type, const int64_t *ids, int64_t R, int64_t K,
                      float *out) {
    int values, bytes;
    if (!block_shape(type, &values, &bytes)) return 1;
    if (K % values) return 2;
    const int64_t row_bytes = K / values * bytes;
    /* A decode step's few rows here: waking a thread costs more than they do */
#pragma omp parallel for schedule(static) if (R * K >= 65536)
    for (int64_t r = 0; r < R; r++) {
        const int64_t row = ids ? ids[r] : r;
        dequant_row(type, W + row * row_bytes, out + r * K, K, values, bytes);
    }
    return 0;
}
