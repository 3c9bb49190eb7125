/* Few-row linear layer for CPU: y[M, N] = x[M, K] . W[N, K]^T (+ b), fp32 or bf16, W packed.
 *
 * Invariant: every output is one fp32 sum of x[m, k] * W[n, k] over k (then + b, then rounded
 * once to bf16 for bf16 outputs), so it equals F.linear to fp32 rounding; only the summation
 * order differs. Decode multiplies a few rows (at most 128) by every weight matrix of the model,
 * each matrix read from DRAM once per step, so this is a register-blocked GEMM whose loads of W
 * overlap its arithmetic:
 * - W is packed once (skinny_linear.py) into panels of NC = 2 vectors of output columns, each
 *   panel contiguous: fp32 P[panel][k][NC]; bf16 P[panel][k/2][NC][2] (pairs along k, the
 *   operand layout of AVX512-BF16's dot product). One panel is one sequential stream.
 * - A tile keeps MR rows x NC columns of accumulators in registers; each k loads two vectors of
 *   W and broadcasts one x per row (fp32: 2 MR FMAs per 2 + MR loads).
 * - Threads take contiguous runs of panels (OpenMP static). While a thread multiplies a panel
 *   (from L2 after its first row tile), it prefetches its next panel, so DRAM streams under
 *   the arithmetic. oneDNN's packed GEMM, the previous choice, left that latency exposed: 32
 *   rows x SmolLM2's 150 products per step took 11.3 ms in bf16 with weights from DRAM (Zen 5,
 *   2 threads) against 8.0 here; fp32 21.1 against 16.5.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
#define MR 12 /* 24 accumulators of 32 zmm */
#elif defined(__AVX__)
#define VL 8
#define MR 6 /* 12 accumulators of 16 ymm */
#else
#define VL 4 /* SSE2 / NEON */
#define MR 6
#endif
#define NC (2 * VL) /* output columns per panel */

typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

static inline vf load_vf(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vu load_vu(const void *p) { vu v; memcpy(&v, p, sizeof v); return v; }
static inline vf as_vf(vu v) { vf f; memcpy(&f, &v, sizeof f); return f; }

int kvmemo_skinny_panel_cols(void) { return NC; }

/* Prefetch `lines` cache lines of the next panel from *cursor on, not past `end`. */
static inline void prefetch_lines(const char **cursor, const char *end, int lines) {
    for (int i = 0; i < lines && *cursor < end; i++, *cursor += 64) __builtin_prefetch(*cursor, 0, 2);
}

/* Writes a tile's accumulators (+ bias) to y: fp32, or rounded to bf16. Tail columns (a panel
 * past N) are dropped. */
static inline void store_tile(vf acc[MR][2], int rows, int cols, const float *bias, void *y,
                              int64_t ldy, int bf16) {
    float tmp[NC];
    for (int m = 0; m < rows; m++) {
        memcpy(tmp, &acc[m][0], sizeof(vf));
        memcpy(tmp + VL, &acc[m][1], sizeof(vf));
        if (bias)
            for (int j = 0; j < cols; j++) tmp[j] += bias[j];
        if (bf16) {
            uint16_t *out = (uint16_t *)y + m * ldy;
            for (int j = 0; j < cols; j++) out[j] = to_bf16(tmp[j]);
        } else {
            memcpy((float *)y + m * ldy, tmp, (size_t)cols * 4);
        }
    }
}

/* One MR x NC tile over all of K (fp32). `rows` is a compile-time constant in each caller of
 * the switch below, so the row loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_f32(
    const float *x, int64_t ldx, const float *panel, int64_t K, int rows, vf acc[MR][2],
    const char **pf, const char *pf_end, int pf_per_k) {
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        const vf w0 = load_vf(panel + k * NC), w1 = load_vf(panel + k * NC + VL);
        prefetch_lines(pf, pf_end, pf_per_k);
        for (int m = 0; m < rows; m++) {
            const vf b = (vf){0} + x[m * ldx + k];
            acc[m][0] += b * w0;
            acc[m][1] += b * w1;
        }
    }
}

/* One k pair of a bf16 tile: xp[m] holds x[m, 2k] (low half) and x[m, 2k + 1]. */
static inline __attribute__((always_inline)) void pair_bf16(const uint16_t *w, const uint32_t *xp,
                                                            int rows, vf acc[MR][2]) {
#if defined(__AVX512BF16__)
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + NC);
    for (int m = 0; m < rows; m++) {
        const __m512bh b = (__m512bh)_mm512_set1_epi32((int)xp[m]);
        acc[m][0] = (vf)_mm512_dpbf16_ps((__m512)acc[m][0], b, w0);
        acc[m][1] = (vf)_mm512_dpbf16_ps((__m512)acc[m][1], b, w1);
    }
#else
    const vu u0 = load_vu(w), u1 = load_vu(w + NC);
    const vf w0lo = as_vf(u0 << 16), w0hi = as_vf(u0 & 0xffff0000u);
    const vf w1lo = as_vf(u1 << 16), w1hi = as_vf(u1 & 0xffff0000u);
    for (int m = 0; m < rows; m++) {
        const vf lo = (vf){0} + from_bf16((uint16_t)xp[m]);
        const vf hi = (vf){0} + from_bf16((uint16_t)(xp[m] >> 16));
        acc[m][0] += lo * w0lo + hi * w0hi;
        acc[m][1] += lo * w1lo + hi * w1hi;
    }
#endif
}

/* One MR x NC tile over all of K (bf16 pairs; a zero pads an odd K in the panel, and x's last
 * pair then holds x[K - 1] and 0, never a read past the row). */
static inline __attribute__((always_inline)) void tile_bf16(
    const uint16_t *x, int64_t ldx, const uint16_t *panel, int64_t K, int rows, vf acc[MR][2],
    const char **pf, const char *pf_end, int pf_per_k) {
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = (vf){0};
    uint32_t xp[MR];
    int64_t k2 = 0;
    for (; 2 * k2 + 1 < K; k2++) {
        prefetch_lines(pf, pf_end, pf_per_k);
        for (int m = 0; m < rows; m++) memcpy(&xp[m], x + m * ldx + 2 * k2, 4);
        pair_bf16(panel + k2 * 2 * NC, xp, rows, acc);
    }
    if (K & 1) {
        for (int m = 0; m < rows; m++) xp[m] = x[m * ldx + K - 1];
        pair_bf16(panel + k2 * 2 * NC, xp, rows, acc);
    }
}

#define TILE_CASE(n, fn, ...) \
    case n: fn(__VA_ARGS__, n, acc, &pf, pf_end, pf_per_k); break;
#if MR == 12
#define TILE_SWITCH(fn, ...) switch (rows) { \
    TILE_CASE(1, fn, __VA_ARGS__) TILE_CASE(2, fn, __VA_ARGS__) TILE_CASE(3, fn, __VA_ARGS__) \
    TILE_CASE(4, fn, __VA_ARGS__) TILE_CASE(5, fn, __VA_ARGS__) TILE_CASE(6, fn, __VA_ARGS__) \
    TILE_CASE(7, fn, __VA_ARGS__) TILE_CASE(8, fn, __VA_ARGS__) TILE_CASE(9, fn, __VA_ARGS__) \
    TILE_CASE(10, fn, __VA_ARGS__) TILE_CASE(11, fn, __VA_ARGS__) default: \
    TILE_CASE(12, fn, __VA_ARGS__) }
#else
#define TILE_SWITCH(fn, ...) switch (rows) { \
    TILE_CASE(1, fn, __VA_ARGS__) TILE_CASE(2, fn, __VA_ARGS__) TILE_CASE(3, fn, __VA_ARGS__) \
    TILE_CASE(4, fn, __VA_ARGS__) TILE_CASE(5, fn, __VA_ARGS__) default: \
    TILE_CASE(6, fn, __VA_ARGS__) }
#endif

/* y[M, N] (ldy elements apart) = x[M, K] (ldx apart) . W^T + bias (fp32 [N] or NULL); W as
 * packed by skinny_linear.pack. dtype 0: fp32 x/W/y; 1: bf16 x/W/y (fp32 accumulation); 2: bf16
 * x/W, fp32 y (the sums never rounded to bf16). */
void kvmemo_skinny_linear(const void *x, int64_t ldx, const void *packed, const float *bias,
                          void *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int dtype) {
    const int bf16 = dtype == 1 || dtype == 2;
    const int out_f32 = dtype != 1;
    const int64_t panels = (N + NC - 1) / NC;
    const int64_t steps = bf16 ? (K + 1) / 2 : K;           /* k iterations per tile */
    const int64_t panel_elems = steps * NC * (bf16 ? 2 : 1);  /* per panel, in x's element */
    const int64_t panel_bytes = panel_elems * (bf16 ? 2 : 4);
    const int64_t tiles = (M + MR - 1) / MR;
    /* The next panel's lines, spread over this panel's tiles and k iterations. */
    const int64_t lines_per_tile = (panel_bytes / 64 + tiles) / tiles;
    const int pf_per_k = (int)((lines_per_tile + steps - 1) / steps);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int cols = N - p * NC < NC ? (int)(N - p * NC) : NC;
        const char *next = (const char *)packed + (p + 1) * panel_bytes;
        const char *next_end = p + 1 < panels ? next + panel_bytes : next;
        vf acc[MR][2];
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int rows = M - m0 < MR ? (int)(M - m0) : MR;
            const char *pf = next + (m0 / MR) * lines_per_tile * 64;
            const char *pf_end = pf + lines_per_tile * 64 < next_end ? pf + lines_per_tile * 64 : next_end;
            if (bf16) {
                const uint16_t *xs = (const uint16_t *)x + m0 * ldx;
                const uint16_t *panel = (const uint16_t *)packed + p * panel_elems;
                TILE_SWITCH(tile_bf16, xs, ldx, panel, K)
                if (out_f32)
                    store_tile(acc, rows, cols, bias ? bias + p * NC : 0, (float *)y + m0 * ldy + p * NC, ldy, 0);
                else
                    store_tile(acc, rows, cols, bias ? bias + p * NC : 0, (uint16_t *)y + m0 * ldy + p * NC, ldy, 1);
            } else {
                const float *xs = (const float *)x + m0 * ldx;
                const float *panel = (const float *)packed + p * panel_elems;
                TILE_SWITCH(tile_f32, xs, ldx, panel, K)
                store_tile(acc, rows, cols, bias ? bias + p * NC : 0, (float *)y + m0 * ldy + p * NC, ldy, 0);
            }
        }
    }
}
