/*
 * plan/geometry.c — numbers derived from a model's geometry: KV bytes per token, parameter
 * count and the engine's computed workspace. Pure arithmetic; saturates instead of overflowing
 * for absurd geometries (a hostile config can never make the planner wrap).
 */
#include "llmem/plan.h"

static int64_t sat_mul(int64_t a, int64_t b) {
    __int128 r = (__int128)a * b;
    return r > INT64_MAX ? INT64_MAX : r < INT64_MIN ? INT64_MIN : (int64_t)r;
}

static int64_t sat_add(int64_t a, int64_t b) {
    __int128 r = (__int128)a + b;
    return r > INT64_MAX ? INT64_MAX : r < INT64_MIN ? INT64_MIN : (int64_t)r;
}

int64_t llmem_geometry_kv_bytes_per_token(const struct llmem_model_geometry *g) {
    /* K and V, 2 bytes per element, every layer (sliding-window layers are priced in full). */
    return sat_mul(sat_mul(g->n_layers, 2 * 2), sat_mul(g->n_kv_heads, g->head_dim));
}

int64_t llmem_geometry_param_count(const struct llmem_model_geometry *g) {
    int64_t h = g->hidden_size;
    int64_t q_dim = sat_mul(g->n_heads, g->head_dim);
    int64_t kv_dim = sat_mul(g->n_kv_heads, g->head_dim);
    int64_t layer = sat_mul(h, q_dim);                            /* q_proj */
    layer = sat_add(layer, sat_mul(2 * h, kv_dim));               /* k_proj, v_proj */
    layer = sat_add(layer, sat_mul(q_dim, h));                    /* o_proj */
    layer = sat_add(layer, sat_mul(3 * h, g->intermediate_size)); /* gate, up, down */
    layer = sat_add(layer, 2 * h);                                /* two RMSNorms */
    if (g->attention_bias)
        layer = sat_add(layer, sat_add(q_dim, 2 * kv_dim));
    if (g->qk_norm)
        layer = sat_add(layer, 2 * g->head_dim);
    int64_t embed = sat_mul(g->vocab_size, h);
    int64_t total = sat_add(embed, sat_mul(g->n_layers, layer));
    total = sat_add(total, h); /* final norm */
    if (!g->tied_embeddings)
        total = sat_add(total, embed); /* lm_head */
    return total;
}

int64_t llmem_geometry_workspace_bytes(const struct llmem_model_geometry *g,
                                       int64_t max_batch_tokens, int64_t max_sequences) {
    if (max_batch_tokens <= 0)
        max_batch_tokens = 512;
    if (max_sequences <= 0)
        max_sequences = 1;
    int64_t q_dim = sat_mul(g->n_heads, g->head_dim);
    int64_t kv_dim = sat_mul(g->n_kv_heads, g->head_dim);
    int64_t per_token = sat_mul(2, g->hidden_size);
    per_token = sat_add(per_token, sat_mul(3, q_dim));
    per_token = sat_add(per_token, sat_mul(2, kv_dim));
    per_token = sat_add(per_token, sat_mul(2, g->intermediate_size));
    per_token = sat_add(per_token, 2); /* the position, an int64 */
    int64_t floats = sat_mul(max_batch_tokens, per_token);
    floats = sat_add(floats, sat_mul(LLMEM_ATTN_PARTITION_ROWS, sat_mul(g->n_heads,
                                                                        g->head_dim + 2)));
    floats = sat_add(floats, sat_mul(max_sequences, g->vocab_size));
    return sat_mul(floats, (int64_t)sizeof(float));
}
