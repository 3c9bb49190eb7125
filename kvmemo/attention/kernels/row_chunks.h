/* Per-row attention in chunks of CH keys: the vector path of paged_decode.c's attend_rows (fp32
 * queries, any page dtype), for every row of every step: decode, prefill, speculative drafts.
 * Included by paged_decode.c after its vector helpers (vf, loadv, storev, selectv, max_lanes,
 * add_lanes, sum_lanes, exp2_vec).
 *
 * A row's arithmetic, fixed by its own position alone (so it is batch-invariant):
 * - chunks are the keys [c, c + CH) for c = o, o + CH, ..., to the one holding its last key
 *   (kv_len - 1), o being the row's first key (0, or its sliding window's start s) rounded down
 *   to its page (s - s % bs: a table cropped by whole pages behind a window moves nothing);
 *   keys before s and from kv_len on are masked (score -inf, probability 0). The page-aligned
 *   origin lets a prefill's windowed rows, whose first keys all differ, share their chunks in
 *   groups (one group per page of first keys) where each row alone read its 512 keys again;
 * - each score q . k in one order (lane chains, then sum_lanes' tree; see below), computed with
 *   the keys in rows (a step's few rows: no transposition) or in lanes (the chunk transposed once
 *   for a group of rows, or once for every group of a long prefill: pack_chunk), same bits;
 * - the online softmax steps once per chunk: the running max m takes the chunk's max, the
 *   accumulator and the per-lane sums scale by 2^(m_old - m) (exactly 1 when m did not grow),
 *   probabilities are 2^(s - m);
 * - the accumulator adds p_j * V_j for the chunk's keys in increasing j, one FMA chain per output
 *   value (a masked key adds 0 exactly, so rows of a group whose keys end earlier are unchanged);
 * - the sum of probabilities is kept per lane across chunks and summed by add_lanes at the end.
 * Register blocking over rows and heads (QK_ROWS x QK_VECS scores, PV_ROWS x PV_VECS outputs)
 * changes which values are computed together, never a chain's order, and every FMA is written
 * out (fmav), so a row computes the same bits alone, in a prefill group or as a draft's row
 * (tests/attention/test_row_chunks.py).
 *
 * Why: the earlier per-tile loop read a tile per row (no register blocking across rows) and
 * stepped the softmax every 16 keys: at SmolLM2's head size a prefill over a long context cost
 * 1.64-1.84x the flash kernel's (docs/benchmarks.md has today's figures). */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

enum { CH = 64, CV = CH / VL }; /* keys per chunk; vectors of keys per chunk */
/* Row-heads from which a chunk's keys are transposed for scoring in lanes (below: in rows), and
 * the largest head size that does it: at 256 the transposed chunk (64 KiB) leaves L1, and rows
 * were faster (Gemma 3, 1,024 rows: 12.6-14.7 ms against 20-30). */
enum { LANES_MIN_ROWS = 8, LANES_MAX_D = 128 };
#if VL == 16
/* scores: a 2 x 2 block's tree keeps ~5 partial sums each (20) + 2 keys + 2 q; values: 16 + 4 + 1 */
enum { QK_ROWS = 2, QK_VECS = 2, PV_ROWS = 4, PV_VECS = 4 };
#else
/* scores: 8 chains + 2 keys + 1 q (each lane's chains finished before the next: qk_block);
 * values: 8 + 4 + 1 of 16 */
enum { QK_ROWS = 4, QK_VECS = 2, PV_ROWS = 2, PV_VECS = 4 };
#endif

/* a * b + c in one rounding, written out: the compiler's own contraction (-ffp-contract) may
 * fuse either product of x * y + z * w, and may choose differently in two inlined copies of the
 * same loop (bits moved when chunk_values was inlined), which would make a row's bits depend on
 * the block it ran in. Builds without FMA multiply and add (every row alike). */
static inline vf fmav(vf a, vf b, vf c) {
#if VL == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && defined(__AVX__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vf p = a * b;
    __asm__("" : "+m"(p)); /* no contraction on CPUs that have FMA outside x86 (NEON) */
    return p + c;
#endif
}

/* x[0..VL) (rows) -> its transpose, in registers: log2(VL) stages, each swapping the
 * off-diagonal blocks of every 2h x 2h block (h = VL / 2, ..., 1). */
static inline void transpose_lanes(vf *x) {
#if VL == 16
    for (int i = 0; i < 8; i++) {
        vf a = x[i], b = x[i + 8];
        x[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
        x[i + 8] = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 16; i += (i % 8 == 3) ? 5 : 1) {
        vf a = x[i], b = x[i + 4];
        x[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
        x[i + 4] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
    for (int i = 0; i < 16; i += (i % 4 == 1) ? 3 : 1) {
        vf a = x[i], b = x[i + 2];
        x[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
        x[i + 2] = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
    for (int i = 0; i < 16; i += 2) {
        vf a = x[i], b = x[i + 1];
        x[i] = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
        x[i + 1] = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
#else
    for (int i = 0; i < 4; i++) {
        vf a = x[i], b = x[i + 4];
        x[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11);
        x[i + 4] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    }
    for (int i = 0; i < 8; i += (i % 4 == 1) ? 3 : 1) {
        vf a = x[i], b = x[i + 2];
        x[i] = __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13);
        x[i + 2] = __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int i = 0; i < 8; i += 2) {
        vf a = x[i], b = x[i + 1];
        x[i] = __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14);
        x[i + 1] = __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
    }
#endif
}

/* kT[d * CH + j] = krow[j][d] for the chunk's CH keys (a NULL row: zeros), D a multiple of VL. */
static void transpose_chunk(const float *const *krow, int64_t D, float *restrict kT) {
    const vf zero = (vf){0};
    for (int blk = 0; blk < CV; blk++) {
        for (int64_t d0 = 0; d0 < D; d0 += VL) {
            vf x[VL];
            for (int i = 0; i < VL; i++) {
                const float *row = krow[blk * VL + i];
                x[i] = row ? loadv(row + d0) : zero;
            }
            transpose_lanes(x);
            for (int i = 0; i < VL; i++) storev(kT + (d0 + i) * CH + blk * VL, x[i]);
        }
    }
}

/* The score q . k of one key, in one order for both layouts, so a row's bits are the same
 * whichever computed it: lane L's chain a_L = sum over c of
 * q[c VL + L] k[c VL + L] (FMAs in increasing c, from 0), then the lanes by sum_lanes' tree:
 * pairs (L, L + VL/2), then (L, L + VL/4), ..., (0, 1). With keys in rows (decode's few rows) the
 * lanes are the head dimension and the tree is sum_lanes' shuffles; with keys in lanes (kT, a
 * chunk transposed once for many rows) each a_L is a vector of keys and the tree is plain adds,
 * which run beside the FMAs on CPUs with separate add pipes. */

/* x held in a register: gcc otherwise folds a load shared by several FMAs into each of them as
 * a memory operand (a key vector read once per row of the block: 12 loads for 8 FMAs on AVX2).
 * AVX2 builds only (a 32-byte vf is one ymm register); the AVX-512 code is left as it was. */
static inline vf in_register(vf x) {
#if defined(__AVX__) && VL == 8
    __asm__("" : "+x"(x));
#endif
    return x;
}

/* a[r][v] = lane L's chain for NR row-heads (q rows D apart) x NV vectors of keys (kT). */
static inline __attribute__((always_inline)) void lane_chain(
    const float *restrict q, const float *restrict kT, const int64_t D, const int L, const int NR,
    const int NV, vf a[QK_ROWS][QK_VECS]) {
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) a[r][v] = (vf){0};
    for (int64_t d = L; d < D; d += VL) {
        vf k[QK_VECS];
        for (int v = 0; v < NV; v++) k[v] = in_register(loadv(kT + d * CH + v * VL));
        for (int r = 0; r < NR; r++) {
            const vf qd = (vf){0} + q[r * D + d];
            for (int v = 0; v < NV; v++) a[r][v] = fmav(qd, k[v], a[r][v]);
        }
    }
}

#if VL == 16
/* sum_lanes' tree, depth first: pair(L) = a_L + a_(L + VL/2); quad(L) = pair(L) + pair(L + VL/4);
 * oct(L) = quad(L) + quad(L + 2); the score is oct(0) + oct(1). Float addition commutes
 * exactly, so only this grouping has to match. Depth first, five blocks of chains are live at
 * most (20 of AVX-512's 32 registers at 2 x 2). */
#define ADD_INTO(a, b)                                                                           \
    for (int r = 0; r < NR; r++)                                                                 \
        for (int v = 0; v < NV; v++) a[r][v] += b[r][v]
static inline __attribute__((always_inline)) void tree_pair(
    const float *restrict q, const float *restrict kT, const int64_t D, const int L, const int NR,
    const int NV, vf a[QK_ROWS][QK_VECS]) {
    vf b[QK_ROWS][QK_VECS];
    lane_chain(q, kT, D, L, NR, NV, a);
    lane_chain(q, kT, D, L + VL / 2, NR, NV, b);
    ADD_INTO(a, b);
}
static inline __attribute__((always_inline)) void tree_quad(
    const float *restrict q, const float *restrict kT, const int64_t D, const int L, const int NR,
    const int NV, vf a[QK_ROWS][QK_VECS]) {
    vf b[QK_ROWS][QK_VECS];
    tree_pair(q, kT, D, L, NR, NV, a);
    tree_pair(q, kT, D, L + VL / 4, NR, NV, b);
    ADD_INTO(a, b);
}
static inline __attribute__((always_inline)) void tree_top(
    const float *restrict q, const float *restrict kT, const int64_t D, const int L, const int NR,
    const int NV, vf a[QK_ROWS][QK_VECS]) {
    vf b[QK_ROWS][QK_VECS];
    tree_quad(q, kT, D, L, NR, NV, a);
    tree_quad(q, kT, D, L + 2, NR, NV, b);
    ADD_INTO(a, b);
}

/* s[r * CH + v * VL + lane] = q_r . k, NR row-heads x NV vectors of keys in lanes. */
static inline __attribute__((always_inline)) void qk_block(
    const float *restrict q, const float *restrict kT, const int64_t D, const int NR,
    const int NV, float *restrict s) {
    vf a[QK_ROWS][QK_VECS], b[QK_ROWS][QK_VECS];
    tree_top(q, kT, D, 0, NR, NV, a);
    tree_top(q, kT, D, 1, NR, NV, b);
    ADD_INTO(a, b);
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) storev(s + r * CH + v * VL, a[r][v]);
}
#undef ADD_INTO
#else
/* s[r * CH + v * VL + lane] = q_r . k, NR row-heads x NV vectors of keys in lanes: every lane's
 * chains (lane_chain) for the block, each finished before the next starts, then sum_lanes'
 * tree over them, level by level: pairs (L, L + VL/2), then (L, L + VL/4), ..., (0, 1). Float
 * addition commutes exactly, so only this grouping has to match (paged_decode.c is built
 * without associative math, so the compiler keeps it). Why kept, not depth first:
 * a depth-first tree holds log2(VL) + 1 blocks of chains at once, which on AVX2's 16 registers
 * allowed one row by two vectors, three loads for every two FMAs; here one block is live, four
 * rows by two vectors (six loads for eight FMAs), and the finished chains wait in L1 (Zen 3,
 * one thread, SmolLM2's shape: the whole attention about 10% faster, same bits). */
static inline __attribute__((always_inline)) void qk_block(
    const float *restrict q, const float *restrict kT, const int64_t D, const int NR,
    const int NV, float *restrict s) {
    vf chains[VL][QK_ROWS][QK_VECS];
    for (int L = 0; L < VL; L++) lane_chain(q, kT, D, L, NR, NV, chains[L]);
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) {
            vf node[VL];
            for (int L = 0; L < VL; L++) node[L] = chains[L][r][v];
            for (int width = VL / 2; width >= 1; width /= 2)
                for (int L = 0; L < width; L++) node[L] += node[L + width];
            storev(s + r * CH + v * VL, node[0]);
        }
}
#endif

/* acc rows (D apart, from the block's first value) = acc * alpha[r] + sum_j p[r * CH + j] V_j for
 * keys j0 <= j < n (vrow[j]: value row j, offset to the block's values), NR row-heads x NV
 * vectors of values. */
static inline __attribute__((always_inline)) void pv_block(
    float *restrict acc, const float *restrict alpha, const float *restrict p,
    const float *const *vrow, int64_t voff, int j0, int n, const int64_t D, const int NR,
    const int NV) {
    vf a[PV_ROWS][PV_VECS];
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) a[r][v] = loadv(acc + r * D + v * VL) * alpha[r];
    for (int j = j0; j < n; j++) {
        vf x[PV_VECS];
        for (int v = 0; v < NV; v++) x[v] = loadv(vrow[j] + voff + v * VL);
        for (int r = 0; r < NR; r++) {
            const vf pj = (vf){0} + p[r * CH + j];
            for (int v = 0; v < NV; v++) a[r][v] = fmav(pj, x[v], a[r][v]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) storev(acc + r * D + v * VL, a[r][v]);
}

/* Row pointers of the chunk's keys first <= j < last (c0 <= first): fp32 pages in place, other
 * dtypes through fp32 copies in kbuf / vbuf ([CH][D]); k_pages or v_pages NULL: not gathered. */
static void gather_chunk(const void *k_pages, const void *v_pages, int dtype,
                         const int64_t *table, int64_t head_offset, int64_t bs, int64_t D,
                         int64_t c0, int64_t first, int64_t last, float *kbuf, float *vbuf,
                         const float **krow, const float **vrow) {
    for (int64_t at = first, n = 0; at < last; at += n) {
        const int64_t in_block = at % bs;
        n = last - at < bs - in_block ? last - at : bs - in_block; /* within one page */
        const int64_t offset = (head_offset + table[at / bs] * bs + in_block) * D;
        const float *K = k_pages ? to_f32(k_pages, offset, n * D, dtype, kbuf + (at - c0) * D) : NULL;
        const float *V = v_pages ? to_f32(v_pages, offset, n * D, dtype, vbuf + (at - c0) * D) : NULL;
        for (int64_t i = 0; i < n; i++) {
            krow[at - c0 + i] = K ? K + i * D : NULL;
            vrow[at - c0 + i] = V ? V + i * D : NULL;
        }
    }
}

/* One sequence's keys 0 <= j < keys of one kv head, transposed chunk by chunk into kT_all
 * ([chunks][D][CH], zeros past the last key): the chunks every row group of a long prefill
 * would otherwise transpose again (one group of 32 rows per 7,000 keys re-read them 14 times). */
static void pack_chunk(const void *k_pages, int dtype, const int64_t *table, int64_t head_offset,
                       int64_t bs, int64_t D, int64_t keys, int64_t chunk, float *kT_all) {
    const float *krow[CH], *vrow[CH];
    float kbuf[dtype != KV_F32 ? CH * D : 1];
    const int64_t c0 = chunk * CH, last = c0 + CH < keys ? c0 + CH : keys;
    for (int j = 0; j < CH; j++) krow[j] = NULL;
    gather_chunk(k_pages, NULL, dtype, table, head_offset, bs, D, c0, c0, last, kbuf, NULL,
                 krow, vrow);
    transpose_chunk(krow, D, kT_all + chunk * D * CH);
}

/* Scores of RH row-heads (q rows D apart) over one chunk with its keys in lanes (kT). */
static inline __attribute__((always_inline)) void chunk_scores(
    const float *q, const float *kT, int RH, const int64_t D, float *s) {
    for (int v0 = 0; v0 < CV; v0 += QK_VECS) {
        int r0 = 0;
        for (; r0 + QK_ROWS <= RH; r0 += QK_ROWS)
            qk_block(q + r0 * D, kT + v0 * VL, D, QK_ROWS, QK_VECS, s + r0 * CH + v0 * VL);
        for (; r0 < RH; r0++)
            qk_block(q + r0 * D, kT + v0 * VL, D, 1, QK_VECS, s + r0 * CH + v0 * VL);
    }
}

/* The same scores with the keys in rows (krow[j], every entry set; no transposition, for a
 * step's few rows: decode), for the chunk's vectors of keys holding j0 .. n - 1: each key's lane
 * chains over the head's VL-wide pieces, then sum_lanes over VL keys at once. On AVX2 the
 * chains go ROW_HEADS heads x ROW_KEYS keys at once (each piece of a key loaded once for the
 * block's heads, each piece of a head once for its keys: a head of 256 does not fit the 16
 * registers); a chain's order is the same in any block. */
#if VL == 8 /* AVX2: 16 registers; AVX-512 keeps a head's pieces in registers (below) */
enum { ROW_HEADS = 2, ROW_KEYS = 4 };
static inline __attribute__((always_inline)) void row_block(
    const float *q, const float *const *krow, const int64_t D, const int NH, float *partial,
    int l0) {
    const int C = (int)(D / VL);
    vf a[ROW_HEADS][ROW_KEYS];
    for (int h = 0; h < NH; h++)
        for (int k = 0; k < ROW_KEYS; k++) a[h][k] = (vf){0};
    for (int c = 0; c < C; c++) {
        vf kv[ROW_KEYS];
        for (int k = 0; k < ROW_KEYS; k++) kv[k] = in_register(loadv(krow[l0 + k] + c * VL));
        for (int h = 0; h < NH; h++) {
            const vf qv = in_register(loadv(q + h * D + c * VL));
            for (int k = 0; k < ROW_KEYS; k++) a[h][k] = fmav(qv, kv[k], a[h][k]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int k = 0; k < ROW_KEYS; k++) storev(partial + (h * VL + l0 + k) * VL, a[h][k]);
}

static inline __attribute__((always_inline)) void chunk_scores_rows(
    const float *q, const float *const *krow, int RH, const int64_t D, int j0, int n, float *s) {
    for (int v = j0 / VL; v * VL < n; v++) {
        for (int i = 0; i < RH; i += ROW_HEADS) {
            const int NH = RH - i < ROW_HEADS ? RH - i : ROW_HEADS;
            float partial[ROW_HEADS * VL * VL] __attribute__((aligned(64)));
            for (int l0 = 0; l0 < VL; l0 += ROW_KEYS) {
                if (NH == ROW_HEADS) row_block(q + i * D, krow + v * VL, D, ROW_HEADS, partial, l0);
                else row_block(q + i * D, krow + v * VL, D, 1, partial, l0);
            }
            for (int h = 0; h < NH; h++) {
                vf lanes[VL];
                for (int l = 0; l < VL; l++) lanes[l] = loadv(partial + (h * VL + l) * VL);
                storev(s + (i + h) * CH + v * VL, sum_lanes(lanes));
            }
        }
    }
}
#else
static inline __attribute__((always_inline)) void chunk_scores_rows(
    const float *q, const float *const *krow, int RH, const int64_t D, int j0, int n, float *s) {
    const int C = (int)(D / VL);
    for (int v = j0 / VL; v * VL < n; v++) {
        for (int i = 0; i < RH; i++) {
            vf qv[MAX_CHUNKS], partial[VL];
            for (int c = 0; c < C; c++) qv[c] = loadv(q + i * D + c * VL);
#pragma GCC unroll 16
            for (int l = 0; l < VL; l++) {
                const float *k = krow[v * VL + l];
                vf a = (vf){0};
                for (int c = 0; c < C; c++) a = fmav(qv[c], loadv(k + c * VL), a);
                partial[l] = a;
            }
            storev(s + i * CH + v * VL, sum_lanes(partial));
        }
    }
}
#endif

/* acc += P V for RH row-heads over one chunk's keys j0 <= j < n, blocked PV_ROWS x PV_VECS. */
static inline __attribute__((always_inline)) void chunk_values(float *acc, const float *alpha, const float *p, const float *const *vrow,
                         int j0, int n, int RH, const int64_t D) {
    for (int64_t d0 = 0; d0 < D; d0 += PV_VECS * VL) {
        int r0 = 0;
        for (; r0 + PV_ROWS <= RH; r0 += PV_ROWS)
            pv_block(acc + r0 * D + d0, alpha + r0, p + r0 * CH, vrow, d0, j0, n, D, PV_ROWS, PV_VECS);
        float *ar = acc + r0 * D + d0;
        switch (RH - r0) { /* the rest as one block: each value row read once */
        case 3: pv_block(ar, alpha + r0, p + r0 * CH, vrow, d0, j0, n, D, 3 % PV_ROWS, PV_VECS); break;
        case 2: pv_block(ar, alpha + r0, p + r0 * CH, vrow, d0, j0, n, D, 2 % PV_ROWS, PV_VECS); break;
        case 1: pv_block(ar, alpha + r0, p + r0 * CH, vrow, d0, j0, n, D, 1, PV_VECS); break;
        default: break;
        }
    }
}

/* One row-head's softmax step over a chunk: its scores s[0..CH) (log2 units), visible keys
 * lo <= j < hi (hi > lo) -> probabilities in place; updates the running max *m and the per-lane
 * sums lsum; returns the factor the accumulator takes (1 exactly when the max did not grow). */
static inline float chunk_softmax(float *s, int lo, int hi, float *m, float *lsum) {
    vi lane;
    for (int i = 0; i < VL; i++) lane[i] = i;
    vf x[CV], top = (vf){0} - INFINITY;
    vi seen[CV];
    for (int v = 0; v < CV; v++) {
        const vi j = lane + v * VL;
        seen[v] = (j >= lo) & (j < hi);
        x[v] = selectv(seen[v], loadv(s + v * VL), (vf){0} - INFINITY);
        top = selectv(x[v] > top, x[v], top);
    }
    const float chunk_max = max_lanes(top);
    float alpha = 1.0f;
    if (chunk_max > *m) { /* *m = -inf before the first chunk: alpha = 0 */
        alpha = exp2f(*m - chunk_max);
        *m = chunk_max;
    }
    vf sum = (vf){0};
    for (int v = 0; v < CV; v++) {
        const vf p = (vf)((vi)exp2_vec(x[v] - *m) & seen[v]);
        sum += p;
        storev(s + v * VL, p);
    }
    storev(lsum, fmav(loadv(lsum), (vf){0} + alpha, sum));
    return alpha;
}

/* attend_rows for fp32 queries on the vector path (see the top of this file): R rows x G heads
 * of one (sequence, kv head), qs [R][G][D] scaled by scale * log2 e, row r over keys
 * row_starts[r] .. kv_lens[r] - 1 in chunks from kv_start (the origin, at most every row's
 * start; row_starts NULL: every row starts there); o_init / lse_init (R = 1 only) the starting
 * state. */
static inline __attribute__((always_inline)) void attend_rows_chunked(
    const float *qs, const void *k_pages, const void *v_pages, int dtype, const int64_t *table,
    int64_t kv_start, const int64_t *row_starts, const int64_t *kv_lens, int R,
    int64_t head_offset, int64_t bs, int G, const int64_t D, float *out, int64_t out_stride,
    float *lse, int64_t lse_stride, const float *o_init, const float *lse_init,
    const float *kT_all) {
    const int RH = R * G;
    const int converts = dtype != KV_F32; /* other pages go through fp32 copies of the chunk */
    float kT[D * CH] __attribute__((aligned(64)));
    float kbuf[converts ? CH * D : 1], vbuf[converts ? CH * D : 1];
    float s[RH * CH], acc[RH * D], m[RH], lsum[RH * VL], alpha[RH];
    static const float zeros[MAX_D];
    const float *krow[CH], *vrow[CH];
    int64_t kv_max = 0;
    for (int r = 0; r < R; r++) kv_max = kv_lens[r] > kv_max ? kv_lens[r] : kv_max;
    memset(acc, 0, sizeof(float) * (size_t)(RH * D));
    memset(lsum, 0, sizeof(float) * (size_t)(RH * VL));
    for (int i = 0; i < RH; i++) m[i] = -INFINITY;
    /* Attention over earlier keys (a cascade's shared prefix) is the starting state: running
     * max lse (log2 units), sum 1 (lane 0), accumulator o. */
    for (int g = 0; o_init && g < G; g++) {
        if (lse_init[g] == -INFINITY) continue; /* no earlier keys */
        m[g] = lse_init[g] * LOG2E;
        lsum[g * VL] = 1.0f;
        memcpy(acc + g * D, o_init + g * D, sizeof(float) * (size_t)D);
    }
    const int64_t step = bs < TILE ? bs : TILE;
    for (int64_t at = kv_start; at < kv_max && at < kv_start + PREFETCH_TILES * step; at += step)
        prefetch_tile(k_pages, v_pages, dtype, table, at, kv_max, head_offset, bs, D);
    for (int64_t c0 = kv_start; c0 < kv_max; c0 += CH) {
        /* The chunk's rows: keys in [kv_start, kv_max) from their pages, others zero. */
        const int64_t first = c0 > kv_start ? c0 : kv_start,
                      last = c0 + CH < kv_max ? c0 + CH : kv_max;
        for (int j = 0; j < CH; j++) krow[j] = vrow[j] = NULL;
        gather_chunk(kT_all ? NULL : k_pages, v_pages, dtype, table, head_offset, bs, D, c0,
                     first, last, kbuf, vbuf, krow, vrow);
        for (int64_t at = c0 + CH; at < kv_max && at < c0 + 2 * CH; at += step)
            prefetch_tile(k_pages, v_pages, dtype, table, at, kv_max, head_offset, bs, D);
        const int lo = (int)(first - c0);
        if (D <= LANES_MAX_D && kT_all) { /* this sequence's keys, packed once for its groups
                                            * (never past LANES_MAX_D: no code for it there) */
            chunk_scores(qs, kT_all + c0 / CH * D * CH, RH, D, s);
        } else if (RH >= LANES_MIN_ROWS && D <= LANES_MAX_D) {
            transpose_chunk(krow, D, kT);
            chunk_scores(qs, kT, RH, D, s);
        } else {
            for (int j = 0; j < CH; j++) krow[j] = krow[j] ? krow[j] : zeros;
            chunk_scores_rows(qs, krow, RH, D, lo, (int)(last - c0), s);
        }
        for (int j = 0; j < CH; j++) vrow[j] = vrow[j] ? vrow[j] : zeros;
        int hi_all = lo;
        for (int r = 0; r < R; r++) {
            const int64_t end = kv_lens[r] - c0, start = row_starts ? row_starts[r] - c0 : lo;
            const int hi = end < CH ? (int)end : CH;
            /* the row's own first key in this chunk (keys before it masked: a windowed row) */
            const int lo_r = start > lo ? (start < CH ? (int)start : CH) : lo;
            hi_all = hi > hi_all ? hi : hi_all;
            for (int g = 0; g < G; g++) {
                const int i = r * G + g;
                if (hi <= lo_r) { /* none of this chunk's keys: as if the row skipped it */
                    alpha[i] = 1.0f;
                    memset(s + i * CH, 0, sizeof(float) * CH);
                } else {
                    alpha[i] = chunk_softmax(s + i * CH, lo_r, hi, m + i, lsum + i * VL);
                }
            }
        }
        chunk_values(acc, alpha, s, vrow, lo, hi_all, RH, D);
    }
    for (int r = 0; r < R; r++) {
        for (int g = 0; g < G; g++) {
            const int i = r * G + g;
            const float l = add_lanes(loadv(lsum + i * VL)), inv = l > 0.0f ? 1.0f / l : 0.0f;
            for (int64_t d = 0; d < D; d++) out[r * out_stride + g * D + d] = acc[i * D + d] * inv;
            if (lse) lse[r * lse_stride + g] = l > 0.0f ? (m[i] + log2f(l)) * LN2 : -INFINITY;
        }
    }
}

