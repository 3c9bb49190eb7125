/* A decode step's decoder layers in one call: per layer, the q/k/v product (input norm, per-head
 * norms and RoPE folded in), the KV write with each row's attention, and the block after
 * attention (o_proj, residual adds, norms, the MLP), through the same kernel entry points that
 * llama_fast.FusedLayerStep and the batch-invariant attention call one by one from Python.
 *
 * Invariant: the hidden states out equal, bit for bit, what the per-layer Python path computes:
 * the same functions with the same arguments in the same order (only the calls between them
 * move from Python to this loop). The kernels are reached through function pointers taken from
 * their own libraries (quant_int8.c, attention/kernels/paged_decode.c), so each stays one build.
 * Why: on a 2-core AVX2 machine, a SmolLM2 decode step spent a third of its time in Python
 * between its ~120 kernel calls (argument checks, ctypes structs, the attention wrapper). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "q8_api.h"

typedef int (*linear_fn)(const float *x, int64_t M, int64_t ldx, const q8_weights *w, float *y,
                         int64_t ldy, const q8_options *opts);
typedef int (*mlp_block_fn)(const float *attn, int64_t lda, const float *hidden, int64_t ldh,
                            int64_t M, const q8_weights *o_proj, const float *norm, float eps,
                            const q8_weights *gate_up, const q8_weights *down, float *out,
                            int64_t ldo, const float *post_o_norm, const float *post_mlp_norm,
                            int32_t gelu);
/* kvmemo_paged_decode_write */
typedef int (*attend_fn)(const void *q, int64_t q_stride, const void *k_new, const void *v_new,
                         int64_t kv_stride, int io, const int64_t *slots, void *k_pages,
                         void *v_pages, int dtype, const int64_t *block_tables,
                         int64_t table_stride, const int64_t *table_rows, int64_t first_block,
                         const int64_t *kv_lens, const int64_t *kv_starts, int64_t B, int64_t Hq,
                         int64_t Hkv, int64_t D, int64_t bs, int64_t num_blocks, float scale,
                         const float *o_prefix, const float *lse_prefix, void *out, int split);

/* One layer, fixed at load (the pages' addresses included: the KV cache is allocated once). */
typedef struct {
    const q8_weights *qkv, *o_proj, *gate_up, *down;
    q8_options qkv_options; /* its cos and sin are the step's (rope table `rope`) */
    const float *mlp_norm, *post_o_norm, *post_mlp_norm; /* post norms NULL in a Llama */
    float eps;
    int32_t gelu;
    int32_t rope;  /* which of the step's RoPE tables */
    int32_t group; /* which of the step's attention groups (a hybrid model's layer groups) */
    void *k_pages, *v_pages;
} chain_layer;

/* The model's shapes and the kernels, fixed at load. */
typedef struct {
    linear_fn linear;
    mlp_block_fn mlp_block;
    attend_fn attend;
    int64_t num_layers, hidden, q_size, kv_size, num_heads, num_kv_heads, head_dim;
    int64_t block_size, num_blocks;
    int32_t kv_dtype; /* paged_decode.c's code for the pages' dtype */
    float scale;
    const chain_layer *layers;
} chain_model;

/* A layer group's attention arguments for this step (attention/invariant.py's RowPlan). */
typedef struct {
    const int64_t *slots, *block_tables, *kv_lens, *kv_starts; /* kv_starts NULL: no window */
    int64_t table_stride;
} chain_group;

/* Runs the layers over B decode rows: hidden [B, H] fp32 in (not written), out [B, H] the last
 * layer's output (before the final norm). cos/sin: the step's RoPE tables, [B, D/2] fp32 each.
 * Returns 0, or the failing kernel's status with the layer in *failed_layer (3: no memory). */
int kvmemo_layer_chain(const chain_model *m, int64_t B, const float *hidden, float *out,
                       const float *const *cos, const float *const *sin,
                       const chain_group *groups, int64_t *failed_layer) {
    const int64_t H = m->hidden, width = m->q_size + 2 * m->kv_size;
    float *qkv = malloc(sizeof(float) * (size_t)(B * width));
    float *attn = malloc(sizeof(float) * (size_t)(B * m->q_size));
    float *other = malloc(sizeof(float) * (size_t)(B * H));
    if (!qkv || !attn || !other) {
        free(qkv);
        free(attn);
        free(other);
        *failed_layer = 0;
        return 3;
    }
    /* Ping-pong: layer l reads `from` and writes `to`, so that the last writes out. */
    float *buffers[2] = {out, other};
    const float *from = hidden;
    int status = 0;
    for (int64_t l = 0; l < m->num_layers && !status; l++) {
        const chain_layer *layer = &m->layers[l];
        const chain_group *group = &groups[layer->group];
        float *to = buffers[(m->num_layers - 1 - l) % 2];
        q8_options options = layer->qkv_options;
        options.cos = cos[layer->rope];
        options.sin = sin[layer->rope];
        status = m->linear(from, B, H, layer->qkv, qkv, width, &options);
        if (!status)
            status = m->attend(qkv, width, qkv + m->q_size, qkv + m->q_size + m->kv_size, width,
                               0, group->slots, layer->k_pages, layer->v_pages, m->kv_dtype,
                               group->block_tables, group->table_stride, NULL, 0,
                               group->kv_lens, group->kv_starts, B, m->num_heads,
                               m->num_kv_heads, m->head_dim, m->block_size, m->num_blocks,
                               m->scale, NULL, NULL, attn, 0);
        if (!status)
            status = m->mlp_block(attn, m->q_size, from, H, B, layer->o_proj, layer->mlp_norm,
                                  layer->eps, layer->gate_up, layer->down, to, H,
                                  layer->post_o_norm, layer->post_mlp_norm, layer->gelu);
        if (status) *failed_layer = l;
        from = to;
    }
    free(qkv);
    free(attn);
    free(other);
    return status;
}
