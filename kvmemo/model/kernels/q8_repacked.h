/* The int8 product over weights repacked for it: 16 output rows per vector, so that a lane is an
 * output and a VNNI dot product needs no horizontal sum. Included by quant_int8.c (it uses that
 * file's unpack(), run_t and the activations' layout).
 *
 * Layout, per group of 16 weight rows (the last padded with zero rows), per 32-value run j:
 *     codes  the unsigned code of row r, value 4g + i of the run, at index [g][r][i] (512):
 *            Q8_0 as bytes; the others as nibbles, quads 2h and 2h + 1 the low and high halves
 *            of bytes [h][r][i] (256 bytes), then one plane of bit 4 (Q5_*) or two of bits 4
 *            and 5 (Q6_K), 512 bits each (64 bytes; plane_bit says where each sits)
 *     s[16], c[16]     the run's scale and offset per row (value = s * code + c): fp16 for the
 *            types whose scales are fp16 in the file (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: exact;
 *            Q8_0 stores no c: it is -128 s, or 0 where the codes stay signed), fp32 for the K-quants (a 6-bit scale times
 *            an fp16); Q6_K, whose scale changes every 16 values, has the second half's s and
 *            c after them
 * So a Q4_1 weight takes 20 bytes per 32 values, as in the file; Q5_0 24 (22), Q6_K 40 (26.25).
 * A quad g of codes times a row's four int8 activations of that quad is one vpdpbusd against
 * the broadcast quad, for 16 outputs at once; the dots of an activation group's quads (GROUP
 * values, 16: half a run) add in int32, the group's scale multiplies their sum once, the run's s
 * and c close the run.
 *
 * Why: the row-by-row kernel (row_tile) spends 5-6 vector instructions per 64 multiply-adds
 * of one row and unpacks every run again for each tile of 4 rows; here a run is unpacked once,
 * at load, and a row pays a dot per 64 (16 outputs x 4 values) and a conversion and an FMA per
 * activation group.
 *
 * Invariant: an output is its own row's sum, run by run in order, groups in order within a run,
 * whatever the row count, the row's place in a tile or the thread that computes it, so a row's
 * result does not depend on the rows beside it (batch invariance). */
#ifndef KVMEMO_Q8_REPACKED_H
#define KVMEMO_Q8_REPACKED_H

enum { PACK_ROWS = 16, PACK_TILE = 4 };
/* A group never straddles Q6_K's halves (16 values a scale): its dots take one weight scale. */
_Static_assert(GROUP == 4 || GROUP == 16, "activation groups of 4 or 16 values");

/* Codes are nibbles plus this many planes of their higher bits (Q8_0: whole bytes, -1). */
static inline int bit_planes(int type) {
    switch (type) {
    case T_Q8_0: return -1;
    case T_Q5_0: case T_Q5_1: case T_Q5_K: return 1;
    case T_Q6_K: return 2;
    default: return 0;
    }
}
static inline int half_scales(int type) { return type != T_Q4_K && type != T_Q5_K && type != T_Q6_K; }
static inline int split_scales(int type) { return type == T_Q6_K; }
static inline int64_t codes_bytes(int type) {
    return bit_planes(type) < 0 ? 512 : 256 + 64 * bit_planes(type);
}

static inline int64_t packed_run_bytes(int type) {
    const int64_t scales = half_scales(type) ? (type == T_Q8_0 ? 32 : 64)
                                             : (split_scales(type) ? 256 : 128);
    return codes_bytes(type) + scales;
}

/* Q8_0's codes are repacked as w + 128 (up to 255, c = -128 s) for a VNNI dot. Without one
 * (AVX2's vpmaddubsw), pairs of such products overflow int16 (2 * 255 * 127), so there the codes
 * stay signed (c = 0) and each quad's product is |w| against x carrying w's sign, whose pairs
 * stay within it (2 * 128 * 127), as llama.cpp's AVX2 Q8_0 dot does. */
#if Q8_REPACKED == 256 && !defined(__AVXVNNI__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define Q8_SIGNED_CODES 1
#else
#define Q8_SIGNED_CODES 0
#endif

/* Where a code's higher bit sits in its plane (512 bits: 16 rows x 32 values of a run). The
 * 512-bit kernel reads quad g's 64 bits as one mask: bit [g][r][i]. The 256-bit kernel reads
 * each half's 32 bytes at once, a byte per (row, value) of a quad and bit g for quad g: two
 * shifts and a mask put quad g's bits in place, where a mask per quad took five instructions to
 * spread into bytes (Q5_0 is most of Gemma 3's layers). */
static inline int64_t plane_bit(int g, int64_t r, int i) {
#if Q8_REPACKED == 256
    return (r * 4 + i) * 8 + g; /* byte 32 h + 4 (r - 8 h) + i for row r of half h */
#else
    return (g * PACK_ROWS + r) * 4 + i;
#endif
}

/* Whether this build's kernel takes `type` repacked: every type it reads. */
static inline int repacks(int type) {
    (void)type;
    return 1;
}

/* Bytes of a repacked [N, K] weight, 0 when this build has no repacked kernel for it. */
int64_t kvmemo_q8_repacked_bytes(int type, int64_t N, int64_t K) {
#if defined(Q8_REPACKED)
    if (K % 32 || N < 1 || !repacks(type)) return 0;
    return (N + PACK_ROWS - 1) / PACK_ROWS * (K / 32) * packed_run_bytes(type);
#else
    (void)type, (void)N, (void)K;
    return 0;
#endif
}

#if defined(Q8_REPACKED)
/* v as fp16 at p; 0 when the half does not hold v exactly (the repack then fails). */
static inline int store_half(float v, uint8_t *p) {
    const uint16_t h = (uint16_t)_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    memcpy(p, &h, 2);
    return _cvtsh_ss(h) == v;
}
#endif

/* W [N, K] in its GGUF bytes (row_bytes per row) -> out (kvmemo_q8_repacked_bytes of room).
 * Status 0; 1 when this build has no repacked kernel; 2 when a scale does not fit the layout's
 * fp16 (a Q4_0 scale beyond 8,188: -8 d overflows), so the weight is read as it is. */
int kvmemo_q8_repack(int type, const uint8_t *W, int64_t row_bytes, int64_t N, int64_t K,
                     uint8_t *out) {
#if defined(Q8_REPACKED)
    if (!repacks(type)) return 1;
    const int64_t nb = K / 32, groups = (N + PACK_ROWS - 1) / PACK_ROWS;
    const int64_t run_bytes = packed_run_bytes(type), cb = codes_bytes(type);
    const int planes = bit_planes(type), half = half_scales(type), split = split_scales(type);
    int inexact = 0;
#pragma omp parallel for schedule(static) reduction(| : inexact)
    for (int64_t gi = 0; gi < groups; gi++) {
        /* cleared here, not before the loop: the threads share the first touch of the output's
         * pages (2 MiB ones, huge_pages.py, cost a VM's host the most) */
        memset(out + gi * nb * run_bytes, 0, (size_t)(nb * run_bytes));
        for (int64_t r = 0; r < PACK_ROWS && gi * PACK_ROWS + r < N; r++) {
            const uint8_t *row = W + (gi * PACK_ROWS + r) * row_bytes;
            for (int64_t j = 0; j < nb; j++) {
                uint8_t *run = out + (gi * nb + j) * run_bytes, *scales = run + cb;
                run_t u = unpack(type, row, j);
                if (type == T_Q8_0 && !Q8_SIGNED_CODES) u.u ^= 0x80; /* w -> w + 128, c = -128 s */
                for (int g = 0; g < 8; g++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t code = u.u[4 * g + i];
                        const int64_t at = (g * PACK_ROWS + r) * 4 + i; /* the code's index */
                        if (planes < 0) {
                            run[at] = code;
                            continue;
                        }
                        run[((g / 2) * PACK_ROWS + r) * 4 + i] |= (uint8_t)((code & 15) << (4 * (g & 1)));
                        for (int p = 0; p < planes; p++) /* bit 4 + p of the code */
                            run[256 + 64 * p + plane_bit(g, r, i) / 8] |=
                                (uint8_t)(((code >> (4 + p)) & 1) << (plane_bit(g, r, i) % 8));
                    }
                if (half) {
                    inexact |= !store_half(u.sa, scales + 2 * r);
                    if (type != T_Q8_0) inexact |= !store_half(u.ca, scales + 32 + 2 * r);
                } else {
                    float *s = (float *)scales;
                    s[r] = u.sa;
                    s[PACK_ROWS + r] = u.ca;
                    if (split) {
                        s[2 * PACK_ROWS + r] = u.sb;
                        s[3 * PACK_ROWS + r] = u.cb;
                    }
                }
            }
        }
    }
    return inexact ? 2 : 0;
#else
    (void)type, (void)W, (void)row_bytes, (void)N, (void)K, (void)out;
    return 1;
#endif
}

#if Q8_REPACKED == 512
/* Rows [0, R) of x (codes q, scales e as kvmemo_quantize_q8 lays them out, half-run offset sums
 * hs: [m][j][2]) against one group of 16 weight rows -> y[m * ldy + 0..valid). */
static inline __attribute__((always_inline)) void packed_tile(
    int type, int R, const uint8_t *group, int64_t nb, const int8_t *q, const float *e,
    const float *hs, int64_t K, float *y, int64_t ldy, __mmask16 valid) {
    const int64_t run_bytes = packed_run_bytes(type), cb = codes_bytes(type);
    const int split = split_scales(type);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[PACK_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *run = group + j * run_bytes;
        __m512i w[8];
        if (bit_planes(type) >= 0) {
            for (int h = 0; h < 4; h++) {
                const __m512i b = _mm512_loadu_si512((const void *)(run + 64 * h));
                w[2 * h] = _mm512_and_si512(b, low);
                w[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
            }
            for (int p = 0; p < bit_planes(type); p++) /* + 16 << p where the plane's bit is set */
                for (int g = 0; g < 8; g++) {
                    uint64_t bits;
                    memcpy(&bits, run + 256 + 64 * p + 8 * g, 8);
                    w[g] = _mm512_mask_add_epi8(w[g], _cvtu64_mask64(bits), w[g],
                                                _mm512_set1_epi8((char)(16 << p)));
                }
        } else {
            for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512((const void *)(run + 64 * g));
        }
        __m512 sa, ca, sb = _mm512_setzero_ps(), cbv = _mm512_setzero_ps();
        if (half_scales(type)) {
            sa = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(run + cb)));
            ca = type == T_Q8_0 ? _mm512_mul_ps(sa, _mm512_set1_ps(-128.0f))
                                : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(run + cb + 32)));
        } else {
            const float *sc = (const float *)(run + cb);
            sa = _mm512_loadu_ps(sc);
            ca = _mm512_loadu_ps(sc + PACK_ROWS);
            if (split) {
                sb = _mm512_loadu_ps(sc + 2 * PACK_ROWS);
                cbv = _mm512_loadu_ps(sc + 3 * PACK_ROWS);
            }
        }
        for (int r = 0; r < R; r++) {
            const int8_t *quad = q + r * K + 32 * j;
            const float *d = e + r * 16 * nb + 8 * j, *h = hs + (r * nb + j) * 2;
            __m512 fa = _mm512_setzero_ps(), fb = _mm512_setzero_ps();
            for (int g0 = 0; g0 < 8; g0 += GROUP / 4) {
                /* the quads of one activation group share its scale: their dots add in int32 */
                __m512i dot = _mm512_setzero_si512();
                for (int g = g0; g < g0 + GROUP / 4; g++) {
                    int32_t codes; /* the row's 4 codes of quad g, broadcast to every lane */
                    memcpy(&codes, quad + 4 * g, 4);
                    dot = _mm512_dpbusd_epi32(dot, w[g], _mm512_set1_epi32(codes));
                }
                if (g0 < 4 || !split)
                    fa = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(d[g0]), fa);
                else
                    fb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(d[g0]), fb);
            }
            if (split) {
                acc[r] = _mm512_fmadd_ps(fa, sa, acc[r]);
                acc[r] = _mm512_fmadd_ps(fb, sb, acc[r]);
                acc[r] = _mm512_fmadd_ps(ca, _mm512_set1_ps(h[0]), acc[r]);
                acc[r] = _mm512_fmadd_ps(cbv, _mm512_set1_ps(h[1]), acc[r]);
            } else {
                acc[r] = _mm512_fmadd_ps(fa, sa, acc[r]);
                acc[r] = _mm512_fmadd_ps(ca, _mm512_set1_ps(h[0] + h[1]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy, valid, acc[r]);
}
#elif Q8_REPACKED == 256
/* The 256-bit kernel: the same sums in the same order, on the group's two halves of 8 rows in
 * turn (sixteen ymm registers hold one half's accumulators, not both). */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define HAVE_DOT_VNNI 1
#endif

#if defined(HAVE_DOT_VNNI)
/* sum + each lane's dot of its 4 codes with x's 4 int8 values (exact in int32). */
static inline __m256i dot_quad(__m256i sum, __m256i codes, int32_t x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(sum, codes, _mm256_set1_epi32(x));
#else
    return _mm256_dpbusd_avx_epi32(sum, codes, _mm256_set1_epi32(x));
#endif
}
#endif

#if !defined(HAVE_DOT_VNNI)
/* Without a VNNI dot, quads whose vpmaddubsw pair sums add in int16 before one vpmaddwd: codes
 * up to 31 give pairs up to 2 * 31 * 127, four of which fit int16; Q6_K's up to 63, two. */
static inline int int16_quads(int type) {
    /* Q8_0's signed pairs (up to 2 * 128 * 127) take int16 one quad at a time */
    const int quads = bit_planes(type) < 0 ? 1 : bit_planes(type) >= 2 ? 2 : 4;
    return quads < GROUP / 4 ? quads : GROUP / 4; /* and never past the activation group */
}
#endif

/* Quad g of a run's codes for one half (8 weight rows) of a group, as bytes; planes[p] is that
 * half's plane p (bit g of a byte is quad g's). */
static inline __attribute__((always_inline)) __m256i packed_codes(int type, const uint8_t *run, int half,
                                                                  int g, const __m256i *planes) {
    if (bit_planes(type) < 0) return _mm256_loadu_si256((const __m256i *)(run + 64 * g + 32 * half));
    const __m256i b = _mm256_loadu_si256((const __m256i *)(run + 64 * (g / 2) + 32 * half));
    __m256i w = _mm256_and_si256(g & 1 ? _mm256_srli_epi16(b, 4) : b, _mm256_set1_epi8(0x0F));
    for (int p = 0; p < bit_planes(type); p++) {
        /* bit g of each byte to bit 4 + p, within the byte (plane_bit) */
        const int shift = 4 + p - g;
        const __m256i moved = shift >= 0 ? _mm256_slli_epi16(planes[p], shift)
                                         : _mm256_srli_epi16(planes[p], -shift);
        w = _mm256_or_si256(w, _mm256_and_si256(moved, _mm256_set1_epi8((char)(16 << p))));
    }
    return w;
}

/* A group's codes as bytes, [run][quad][half][32] (Q8_0's layout), into out (nb * 512 bytes). */
static void unpack_group(int type, const uint8_t *group, int64_t nb, uint8_t *out) {
    const int64_t run_bytes = packed_run_bytes(type);
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *run = group + j * run_bytes;
        for (int half = 0; half < 2; half++) {
            __m256i planes[2];
            for (int p = 0; p < bit_planes(type); p++)
                planes[p] = _mm256_loadu_si256((const __m256i *)(run + 256 + 64 * p + 32 * half));
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++)
                _mm256_storeu_si256((__m256i *)(out + j * 512 + 64 * g + 32 * half),
                                    packed_codes(type, run, half, g, planes));
        }
    }
}

enum { UNPACK_ROWS = 8, UNPACK_NIBBLE_ROWS = 16, BYTES_TILE = 4 };

/* A decode step reads each weight once, straight from memory (Gemma 3's head alone is 178 MB):
 * plain loads leave those lines in every cache level, evicting what the rest of the step reuses
 * (the KV pages, the activations, the interpreter's own working set). Runs this many bytes
 * ahead are prefetched non-temporally instead (a weight's groups follow one another in memory,
 * so past a group's end lie the next group's runs). Decode on Zen 3 (AVX2), prefetch on and off
 * alternating in one process, both models at 18 and 1,024 tokens of context, two sittings at
 * 1,024 and two at 2,048 bytes ahead: 1.00-1.15x, 1.07x on average at 2,048 (1.06x at 1,024).
 * The 512-bit kernel is left as it was until an AVX-512 machine measures it. */
enum { STREAM_AHEAD = 2048 };

/* This thread's buffer for one group's codes as bytes (nb runs of 512), grown as needed and
 * kept for the thread's life: 16 bytes per input column. NULL without memory (the caller
 * then unpacks as it goes). */
static uint8_t *group_bytes(int64_t nb) {
    static __thread uint8_t *buffer;
    static __thread int64_t runs;
    if (runs < nb) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)nb * 512);
        runs = buffer ? nb : 0;
    }
    return buffer;
}

/* Rows [0, R) of x against one group of 16 weight rows -> y[m * ldy + 0..live), the group's two
 * halves of 8 rows in H passes: one row of Q8_0 takes both halves in one pass (each code line
 * read once, each quad of x broadcast once: its in-cache products 5-15% faster on Zen 3); more
 * rows, or codes with bit planes, one half at a time (their accumulators and planes fill the
 * sixteen ymm registers: Q5_0 both at once was 1.6x slower). A lane's sums are the same
 * either way. from_bytes: the codes are read from `bytes` (unpack_group's layout) instead of
 * unpacked here; a constant at each call, so each variant compiles without the other's code.
 * stream: this tile is the group's only one (decode), so the weights pass once: see
 * STREAM_AHEAD. */
static inline __attribute__((always_inline)) void packed_tile(
    int type, int R, const uint8_t *group, int64_t nb, const int8_t *q, const float *e,
    const float *hs, int64_t K, float *y, int64_t ldy, int64_t live, int from_bytes,
    const uint8_t *bytes, int stream) {
    enum { MAX_H = 2 };
    const int H = R == 1 && bit_planes(type) < 0 ? 2 : 1;
    const int64_t run_bytes = packed_run_bytes(type), cb = codes_bytes(type);
    const int split = split_scales(type);
    for (int half0 = 0; half0 < 2 && 8 * half0 < live; half0 += H) {
        __m256 acc[MAX_H][PACK_TILE];
        for (int h = 0; h < H; h++)
            for (int r = 0; r < R; r++) acc[h][r] = _mm256_setzero_ps();
        for (int64_t j = 0; j < nb; j++) {
            const uint8_t *run = group + j * run_bytes;
            for (int64_t line = 0; stream && half0 == 0 && line < run_bytes; line += 64)
                _mm_prefetch((const char *)run + STREAM_AHEAD + line, _MM_HINT_NTA);
            __m256 fa[MAX_H][PACK_TILE], fb[MAX_H][PACK_TILE];
            __m256i dot[MAX_H][PACK_TILE]; /* a row's dots of the activation group so far */
#if !defined(HAVE_DOT_VNNI)
            __m256i pairs[MAX_H][PACK_TILE]; /* int16 pair sums of the quads since the last vpmaddwd */
            const int span = int16_quads(type);
#endif
            __m256i planes[MAX_H][2]; /* each half's bit planes: bit g of a byte is quad g's */
            for (int h = 0; h < H; h++) {
                for (int r = 0; r < R; r++) fa[h][r] = fb[h][r] = _mm256_setzero_ps();
                for (int p = 0; !from_bytes && p < bit_planes(type); p++)
                    planes[h][p] = _mm256_loadu_si256(
                        (const __m256i *)(run + 256 + 64 * p + 32 * (half0 + h)));
            }
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                const int last = g % (GROUP / 4) == GROUP / 4 - 1;
                int32_t codes[PACK_TILE]; /* each row's 4 codes of quad g */
                for (int r = 0; r < R; r++) memcpy(&codes[r], q + r * K + 32 * j + 4 * g, 4);
                for (int h = 0; h < H; h++) {
                    const int half = half0 + h;
                    const __m256i w = from_bytes ? _mm256_loadu_si256((const __m256i *)(bytes + j * 512 + 64 * g + 32 * half))
                                            : packed_codes(type, run, half, g, planes[h]);
#if !defined(HAVE_DOT_VNNI)
                    /* signed Q8_0 codes (Q8_SIGNED_CODES): |w| here, w's sign on each row's x */
                    const __m256i magnitude = type == T_Q8_0 ? _mm256_abs_epi8(w) : w;
#endif
                    for (int r = 0; r < R; r++) {
#if defined(HAVE_DOT_VNNI)
                        dot[h][r] = dot_quad(g % (GROUP / 4) ? dot[h][r] : _mm256_setzero_si256(), w,
                                             codes[r]);
#else
                        const __m256i x = _mm256_set1_epi32(codes[r]);
                        const __m256i p16 = _mm256_maddubs_epi16(
                            magnitude, type == T_Q8_0 ? _mm256_sign_epi8(x, w) : x);
                        pairs[h][r] = g % span == 0 ? p16 : _mm256_add_epi16(pairs[h][r], p16);
                        if (g % span != span - 1) continue;
                        const __m256i p32 = _mm256_madd_epi16(pairs[h][r], _mm256_set1_epi16(1));
                        dot[h][r] = g % (GROUP / 4) < span ? p32 : _mm256_add_epi32(dot[h][r], p32);
#endif
                        if (!last) continue;
                        /* the group's dots, summed, take its scale: as the 512-bit kernel does */
                        const __m256 pf = _mm256_cvtepi32_ps(dot[h][r]);
                        const __m256 d = _mm256_set1_ps(e[r * 16 * nb + 8 * j + g]);
                        if (g < 4 || !split) fa[h][r] = _mm256_fmadd_ps(pf, d, fa[h][r]);
                        else fb[h][r] = _mm256_fmadd_ps(pf, d, fb[h][r]);
                    }
                }
            }
            for (int h = 0; h < H; h++) {
                const int half = half0 + h;
                __m256 sa, ca, sb = _mm256_setzero_ps(), cbv = _mm256_setzero_ps();
                if (half_scales(type)) {
                    sa = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(run + cb + 16 * half)));
                    ca = type == T_Q8_0
                             ? _mm256_mul_ps(sa, _mm256_set1_ps(Q8_SIGNED_CODES ? 0.0f : -128.0f))
                             : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(run + cb + 32 + 16 * half)));
                } else {
                    const float *sc = (const float *)(run + cb) + 8 * half;
                    sa = _mm256_loadu_ps(sc);
                    ca = _mm256_loadu_ps(sc + PACK_ROWS);
                    if (split) {
                        sb = _mm256_loadu_ps(sc + 2 * PACK_ROWS);
                        cbv = _mm256_loadu_ps(sc + 3 * PACK_ROWS);
                    }
                }
                for (int r = 0; r < R; r++) {
                    const float *hr = hs + (r * nb + j) * 2;
                    if (split) {
                        acc[h][r] = _mm256_fmadd_ps(fa[h][r], sa, acc[h][r]);
                        acc[h][r] = _mm256_fmadd_ps(fb[h][r], sb, acc[h][r]);
                        acc[h][r] = _mm256_fmadd_ps(ca, _mm256_set1_ps(hr[0]), acc[h][r]);
                        acc[h][r] = _mm256_fmadd_ps(cbv, _mm256_set1_ps(hr[1]), acc[h][r]);
                    } else {
                        acc[h][r] = _mm256_fmadd_ps(fa[h][r], sa, acc[h][r]);
                        if (type != T_Q8_0 || !Q8_SIGNED_CODES) /* signed codes: no offset */
                            acc[h][r] = _mm256_fmadd_ps(ca, _mm256_set1_ps(hr[0] + hr[1]), acc[h][r]);
                    }
                }
            }
        }
        for (int h = 0; h < H; h++) {
            const int half = half0 + h;
            const int64_t n = live - 8 * half < 8 ? live - 8 * half : 8;
            for (int r = 0; r < R && n > 0; r++) {
                if (n == 8) {
                    _mm256_storeu_ps(y + r * ldy + 8 * half, acc[h][r]);
                } else {
                    float lanes[8];
                    _mm256_storeu_ps(lanes, acc[h][r]);
                    memcpy(y + r * ldy + 8 * half, lanes, sizeof(float) * (size_t)n);
                }
            }
        }
    }
}
#endif

#if defined(Q8_REPACKED)

/* y[m, n] for M rows against the repacked rows [n0, n1) (n0 a multiple of 16). */
static inline __attribute__((always_inline)) void packed_rows(
    int type, const uint8_t *P, const int8_t *xq, const float *xd, const float *hs, float *y,
    int64_t M, int64_t n0, int64_t n1, int64_t K, int64_t ldy) {
    const int64_t nb = K / 32, run_bytes = packed_run_bytes(type);
#if Q8_REPACKED == 512
    const int tile = PACK_TILE;
#else
    /* From 8 rows (16 for plain nibbles), a group's codes are unpacked to bytes once, into this
     * thread's buffer (L1), and every tile of 4 rows reads them: unpacking nibbles and bit planes
     * had cost a tile more than its products (512-row products, Zen 3, 2 threads: Q5_0 98-106
     * -> 115-127 GMAC/s, Q6_K 80 -> 94-100). Fewer rows unpack as they go: codes without planes
     * two rows a tile (four spilled AVX2's 16 registers: 256-row products 28-35 -> 42-52 GMAC/s
     * on one Zen 3 thread), with planes four (their unpacking shared: Q5_0 20 -> 25). */
    const int64_t unpack_rows = bit_planes(type) > 0 ? UNPACK_ROWS : UNPACK_NIBBLE_ROWS;
    uint8_t *bytes = bit_planes(type) >= 0 && M >= unpack_rows ? group_bytes(nb) : NULL;
    const int tile = bytes ? BYTES_TILE : bit_planes(type) > 0 ? PACK_TILE : 2;
    const int stream = M <= tile; /* one tile per group: its weights pass once */
#endif
    for (int64_t n = n0; n < n1; n += PACK_ROWS) {
        const uint8_t *group = P + (n / PACK_ROWS) * nb * run_bytes;
        const int64_t live = n1 - n < PACK_ROWS ? n1 - n : PACK_ROWS;
#if Q8_REPACKED == 512
        const __mmask16 valid = (__mmask16)((1u << live) - 1);
#define TILE(R) packed_tile(type, R, group, nb, q, e, h, K, out, ldy, valid)
#else
        const int64_t valid = live;
        if (bytes) unpack_group(type, group, nb, bytes);
#define TILE(R) (bytes ? packed_tile(type, R, group, nb, q, e, h, K, out, ldy, valid, 1, bytes, 0) \
                       : packed_tile(type, R, group, nb, q, e, h, K, out, ldy, valid, 0, NULL, stream))
#endif
        for (int64_t m = 0; m < M; m += tile) {
            const int8_t *q = xq + m * K;
            const float *e = xd + m * 16 * nb, *h = hs + m * nb * 2;
            float *out = y + m * ldy + n;
            switch (M - m < tile ? M - m : tile) {
            case 1: TILE(1); break;
            case 2: TILE(2); break;
            case 3: TILE(3); break;
            default: TILE(4); break;
            }
        }
#undef TILE
    }
}

typedef void (*packed_fn)(const uint8_t *, const int8_t *, const float *, const float *, float *,
                          int64_t, int64_t, int64_t, int64_t, int64_t);
#define PACKED_KERNEL(T)                                                                       \
    static void packed_##T(const uint8_t *P, const int8_t *xq, const float *xd, const float *hs, \
                           float *y, int64_t M, int64_t n0, int64_t n1, int64_t K, int64_t ldy) { \
        packed_rows(T, P, xq, xd, hs, y, M, n0, n1, K, ldy);                                   \
    }
PACKED_KERNEL(T_Q4_0)
PACKED_KERNEL(T_Q4_1)
PACKED_KERNEL(T_Q5_0)
PACKED_KERNEL(T_Q5_1)
PACKED_KERNEL(T_Q8_0)
PACKED_KERNEL(T_Q4_K)
PACKED_KERNEL(T_Q5_K)
PACKED_KERNEL(T_Q6_K)

static packed_fn packed_kernel(int type) {
    switch (type) {
    case T_Q4_0: return packed_T_Q4_0;
    case T_Q4_1: return packed_T_Q4_1;
    case T_Q5_0: return packed_T_Q5_0;
    case T_Q5_1: return packed_T_Q5_1;
    case T_Q8_0: return packed_T_Q8_0;
    case T_Q4_K: return packed_T_Q4_K;
    case T_Q5_K: return packed_T_Q5_K;
    default: return packed_T_Q6_K;
    }
}
#endif
#endif
