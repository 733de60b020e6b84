/*
 * plan/geometry.c — numbers derived from a model's geometry: KV bytes per token, parameter
 * count and the engine's computed workspace. Pure arithmetic; saturates instead of overflowing
 * for absurd geometries (a hostile config can never make the planner wrap).
 */
#include <stdio.h>

#include "llmem/plan.h"
#include "plan/moe_work.h"

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

/* The parameters of one layer's MLP: dense (gate, up, down), or with experts the router and
 * `experts` of the layer's experts. */
static int64_t mlp_params(const struct llmem_model_geometry *g, int moe, int64_t experts) {
    int64_t h = g->hidden_size;
    if (!moe)
        return sat_mul(3 * h, g->intermediate_size);
    return sat_add(sat_mul(g->n_experts, h), /* the router */
                   sat_mul(experts, sat_mul(3 * h, g->expert_intermediate)));
}

/* Every parameter, with `experts` of each MoE layer's experts. */
static int64_t params(const struct llmem_model_geometry *g, int64_t experts) {
    int64_t h = g->hidden_size;
    int64_t q_dim = sat_mul(g->n_heads, g->head_dim);
    int64_t kv_dim = sat_mul(g->n_kv_heads, g->head_dim);
    int64_t layer = sat_mul(h, q_dim);              /* q_proj */
    layer = sat_add(layer, sat_mul(2 * h, kv_dim)); /* k_proj, v_proj */
    layer = sat_add(layer, sat_mul(q_dim, h));      /* o_proj */
    layer = sat_add(layer, 2 * h);                  /* two RMSNorms */
    if (g->attention_bias)
        layer = sat_add(layer, sat_add(q_dim, 2 * kv_dim));
    if (g->qk_norm)
        layer = sat_add(layer, 2 * g->head_dim);
    const int64_t moe_layers = g->n_experts > 0 ? g->n_moe_layers : 0;
    int64_t embed = sat_mul(g->vocab_size, h);
    int64_t total = sat_add(embed, sat_mul(g->n_layers, layer));
    total = sat_add(total, sat_mul(g->n_layers - moe_layers, mlp_params(g, 0, 0)));
    total = sat_add(total, sat_mul(moe_layers, mlp_params(g, 1, experts)));
    total = sat_add(total, h); /* final norm */
    if (!g->tied_embeddings)
        total = sat_add(total, embed); /* lm_head */
    return total;
}

int64_t llmem_geometry_param_count(const struct llmem_model_geometry *g) {
    return params(g, g->n_experts);
}

int64_t llmem_geometry_active_param_count(const struct llmem_model_geometry *g) {
    return params(g, g->n_experts > 0 ? g->n_experts_used : 0);
}

int64_t llmem_geometry_expert_bytes(const struct llmem_model_geometry *g) {
    if (g->n_experts <= 0 || g->n_moe_layers <= 0)
        return 0;
    if (g->expert_bytes > 0)
        return g->expert_bytes;
    /* the experts' share of the bytes, by parameters */
    int64_t all = llmem_geometry_param_count(g);
    int64_t expert_params = sat_mul(
        g->n_moe_layers, sat_mul(g->n_experts, sat_mul(3 * g->hidden_size, g->expert_intermediate)));
    return all > 0 ? (int64_t)((__int128)g->weights_bytes * expert_params / all) : 0;
}

int64_t llmem_geometry_active_bytes(const struct llmem_model_geometry *g) {
    const int64_t experts = llmem_geometry_expert_bytes(g);
    if (experts <= 0)
        return g->weights_bytes;
    int64_t unused = (int64_t)((__int128)experts * (g->n_experts - g->n_experts_used) /
                               g->n_experts);
    return g->weights_bytes - unused;
}

int64_t llmem_geometry_workspace_bytes(const struct llmem_model_geometry *g,
                                       int64_t max_batch_tokens, int64_t max_sequences) {
    if (max_batch_tokens <= 0)
        max_batch_tokens = 512;
    if (max_sequences <= 0)
        max_sequences = 1;
    const int moe = g->n_experts > 0 && g->n_moe_layers > 0;
    /* the dense MLP's gate and up, where some layer has one */
    const int64_t dense = moe && g->n_moe_layers >= g->n_layers ? 0 : g->intermediate_size;
    int64_t q_dim = sat_mul(g->n_heads, g->head_dim);
    int64_t kv_dim = sat_mul(g->n_kv_heads, g->head_dim);
    int64_t per_token = sat_mul(2, g->hidden_size);
    per_token = sat_add(per_token, sat_mul(3, q_dim));
    per_token = sat_add(per_token, sat_mul(2, kv_dim));
    per_token = sat_add(per_token, sat_mul(2, dense));
    per_token = sat_add(per_token, 2); /* the position, an int64 */
    int64_t floats = sat_mul(max_batch_tokens, per_token);
    floats = sat_add(floats, sat_mul(LLMEM_ATTN_PARTITION_ROWS, sat_mul(g->n_heads,
                                                                        g->head_dim + 2)));
    floats = sat_add(floats, sat_mul(max_sequences, g->vocab_size));
    int64_t bytes = sat_mul(floats, (int64_t)sizeof(float));
    if (moe) { /* the router's logits and the experts' workspace (plan/moe_work.h) */
        if (max_batch_tokens > ((int64_t)1 << 31) || g->n_experts > ((int64_t)1 << 20) ||
            g->n_experts_used > g->n_experts)
            return INT64_MAX;
        bytes = sat_add(bytes, sat_mul(sat_mul(max_batch_tokens, g->n_experts), 4));
        bytes = sat_add(bytes, llmem_moe_work_layout(max_batch_tokens, g->hidden_size,
                                                     g->expert_intermediate, g->n_experts,
                                                     g->n_experts_used, NULL, NULL));
    }
    return bytes;
}

/* Scales bytes by the rank's share of the parameters. */
static int64_t share(int64_t bytes, int64_t part, int64_t all) {
    return all > 0 ? (int64_t)((__int128)bytes * part / all) : 0;
}

int llmem_geometry_tensor_rank(const struct llmem_model_geometry *g, int n,
                               struct llmem_model_geometry *rank, char *why, size_t why_size) {
    *rank = *g;
    why[0] = '\0';
    if (n != 1 && n != 2 && n != 4 && n != 8) {
        snprintf(why, why_size, "a degree of %d; llmem splits a model over 1, 2, 4 or 8 devices",
                 n);
        return LLMEM_EINVAL;
    }
    const struct {
        const char *what;
        int64_t v;
    } split[] = {{"query heads", g->n_heads},
                 {"MLP columns (intermediate_size)", g->intermediate_size},
                 {"experts' columns (moe_intermediate_size)", g->expert_intermediate}};
    for (size_t i = 0; i < sizeof(split) / sizeof(split[0]); i++)
        if (split[i].v % n != 0) {
            snprintf(why, why_size, "its %lld %s do not split over %d devices",
                     (long long)split[i].v, split[i].what, n);
            return LLMEM_EINVAL;
        }
    if (g->n_kv_heads % n != 0 && (g->n_kv_heads <= 0 || n % g->n_kv_heads != 0)) {
        snprintf(why, why_size, "its %lld KV heads neither split over %d devices nor divide them",
                 (long long)g->n_kv_heads, n);
        return LLMEM_EINVAL;
    }
    rank->n_heads = g->n_heads / n;
    /* more devices than KV heads: each device holds one, n / n_kv_heads devices the same one */
    rank->n_kv_heads = g->n_kv_heads >= n ? g->n_kv_heads / n : 1;
    rank->intermediate_size = g->intermediate_size / n;
    rank->expert_intermediate = g->expert_intermediate / n;
    rank->vocab_size = (g->vocab_size + n - 1) / n; /* embeddings and LM head by vocabulary */
    const int64_t all = llmem_geometry_param_count(g);
    rank->n_params = llmem_geometry_param_count(rank);
    rank->weights_bytes = share(g->weights_bytes, rank->n_params, all);
    if (g->expert_bytes > 0) { /* the experts split like the rest */
        const int64_t experts = llmem_geometry_expert_bytes(g);
        rank->expert_bytes = experts / n;
    }
    return LLMEM_OK;
}
