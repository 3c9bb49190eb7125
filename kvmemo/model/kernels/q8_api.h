/* The int8 kernels' argument structs (quant_int8.c), shared with the code that calls them from C
 * (layer_chain.c: a decode step's layers in one call). quant_int8.py mirrors both as ctypes
 * structures: keep the three in step. */
#ifndef KVMEMO_Q8_API_H
#define KVMEMO_Q8_API_H
#include <stdint.h>

enum { MAX_PARTS = 8 };

/* Weights [N_p, K] in their GGUF bytes, each of its own type, that one product multiplies: their
 * outputs are consecutive column ranges (a fused q/k/v or gate/up). */
typedef struct {
    int64_t num_parts, K;
    const uint8_t *W[MAX_PARTS];
    int32_t types[MAX_PARTS];
    int64_t N[MAX_PARTS];
    const uint8_t *packed[MAX_PARTS]; /* the part repacked (kvmemo_q8_repack), or NULL */
} q8_weights;

/* What a decoder layer does around a product, folded into the call so that a decode step pays
 * one call instead of a handful of small tensor ops (each costs more than its arithmetic). */
typedef struct {
    const float *norm; /* RMSNorm each x row first: x * rsqrt(mean(x^2) + eps) * norm[k] */
    float eps;              /* every norm's of the call */
    int32_t gated;          /* x rows are [gate | up], 2K wide: the input is act(gate) * up */
    const float *residual;  /* y = residual + product, rows ldr apart (not y: y is written first) */
    int64_t ldr;
    const float *cos, *sin; /* rotate-half RoPE over y's first rope_cols columns, [M, D/2] */
    int64_t rope_cols, head_dim;
    /* Gemma's block shape: */
    int32_t gelu;           /* act is tanh-GELU (else SiLU) */
    const float *q_norm, *k_norm; /* RMSNorm of each head_dim-wide head of y's first q_cols
                                   * columns (q_norm), then of the next k_cols (k_norm), before
                                   * RoPE */
    int64_t q_cols, k_cols;
    const float *post_norm; /* RMSNorm of each y row (the product) before the residual add */
} q8_options;

#endif
