/*
 * model/device.c — a loaded model copied into a device backend's memory: every matrix and small
 * vector allocated from the device's allocator (tag weights) and moved through the backend (k and
 * v, gate and up in one buffer a pair, so that a backend can multiply them as one batch; a
 * mixture's experts in three stacks a layer, upload_experts), the configuration copied, the rotary frequencies kept on the host (the backend takes them per call).
 * The copy owns its memory and shares nothing with the host model, which can be freed.
 */
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "model/model_int.h"
#include "llmem/dtype.h"

/* host bytes → a new buffer of the device; NULL on failure (logged by the allocator or here) */
static void *upload(struct llmem_mem *mem, const struct llmem_backend *be, const void *host,
                    size_t bytes) {
    void *d = llmem_mem_alloc(mem, bytes, LLMEM_TAG_WEIGHTS);
    if (d != NULL && be->ops->copy(be->ctx, d, host, bytes) != LLMEM_OK) {
        llmem_mem_free(mem, d);
        d = NULL;
    }
    return d;
}

/* A matrix's bytes as stored: its rows (of values or blocks; an MLX type's codes), and an MLX
 * type's scales and biases (*side bytes each, else 0). */
static size_t weight_bytes(const struct llmem_weight *w, size_t *side) {
    int group, st;
    *side = 0;
    if (llmem_qtype_mlx_params(w->quant, NULL, &group, &st))
        *side = (size_t)(w->rows * (w->cols / group)) * (st == LLMEM_QTYPE_F32 ? 4 : 2);
    return (size_t)(w->rows * llmem_weight_row_bytes(w));
}

static int upload_weight(struct llmem_model *m, const struct llmem_backend *be,
                         struct llmem_weight *w) {
    size_t side;
    const size_t bytes = weight_bytes(w, &side);
    const void *scales = w->scales, *biases = w->biases;
    w->scales = w->biases = NULL;
    w->data = upload(m->mem, be, w->data, bytes);
    if (w->data != NULL && side > 0 &&
        ((w->scales = upload(m->mem, be, scales, side)) == NULL ||
         (w->biases = upload(m->mem, be, biases, side)) == NULL)) {
        llmem_mem_free(m->mem, (void *)w->data), llmem_mem_free(m->mem, (void *)w->scales);
        w->data = w->scales = NULL;
    }
    return w->data != NULL ? LLMEM_OK : LLMEM_ENOMEM;
}

/* a and b into one buffer, b right after a (llmem_weight_follows), where they have one shape
 * and type (not an MLX one: its scales travel apart); else each into its own */
static int upload_pair(struct llmem_model *m, const struct llmem_backend *be,
                       struct llmem_weight *a, struct llmem_weight *b) {
    if (a->dtype != b->dtype || a->quant != b->quant || a->rows != b->rows || a->cols != b->cols ||
        a->scales != NULL) {
        int status = upload_weight(m, be, a);
        return status == LLMEM_OK ? upload_weight(m, be, b) : status;
    }
    size_t side; /* 0: not an MLX type */
    const size_t bytes = weight_bytes(a, &side);
    uint8_t *d = llmem_mem_alloc(m->mem, 2 * bytes, LLMEM_TAG_WEIGHTS);
    if (d == NULL)
        return LLMEM_ENOMEM;
    if (be->ops->copy(be->ctx, d, a->data, bytes) != LLMEM_OK ||
        be->ops->copy(be->ctx, d + bytes, b->data, bytes) != LLMEM_OK) {
        llmem_mem_free(m->mem, d);
        return LLMEM_ENOMEM;
    }
    a->data = d, b->data = d + bytes;
    return LLMEM_OK;
}

/* The rows of a GGUF llama file's q or k matrix (or of their biases and norms, a value a row) in
 * the model's order again: within each head's hd rows, row s·hd/2 + j from the file's row 2j + s
 * (the converter's permutation for RoPE on interleaved pairs, undone so that the device runs its
 * RoPE on rotate-half rows and the KV cache is the unpermuted model's, as on the host). A new host
 * buffer; NULL for none, or out of memory (*failed set). */
static void *unpermuted(const void *src, int64_t rows, size_t row_bytes, int64_t hd, int *failed) {
    if (src == NULL)
        return NULL;
    uint8_t *d = malloc((size_t)rows * row_bytes);
    if (d == NULL) {
        *failed = 1;
        return NULL;
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = r % hd, s = i / (hd / 2), j = i % (hd / 2);
        memcpy(d + r * row_bytes, (const uint8_t *)src + (r - i + 2 * j + s) * row_bytes,
               row_bytes);
    }
    return d;
}

static int upload_vector(struct llmem_model *m, const struct llmem_backend *be, float **v,
                         int64_t n) {
    if (*v == NULL)
        return LLMEM_OK;
    *v = upload(m->mem, be, *v, (size_t)n * sizeof(float));
    return *v != NULL ? LLMEM_OK : LLMEM_ENOMEM;
}

/* One of a MoE layer's three stacks (its experts' gates, ups or downs: one shape and type) into a
 * buffer of its own, the experts' rows one after the other (an MLX type's scales and biases
 * likewise), so that a backend finds expert e at a fixed stride from expert 0. */
static int upload_experts(struct llmem_model *m, const struct llmem_backend *be,
                          const struct llmem_weight *src, int64_t E, struct llmem_weight *dst) {
    size_t side;
    const size_t bytes = weight_bytes(&src[0], &side);
    for (int64_t e = 1; e < E; e++)
        if (src[e].dtype != src[0].dtype || src[e].quant != src[0].quant ||
            src[e].rows != src[0].rows || src[e].cols != src[0].cols) {
            LLMEM_ERROR("the experts of a layer differ in shape or type");
            return LLMEM_EUNSUPPORTED;
        }
    uint8_t *d[3] = {llmem_mem_alloc(m->mem, (size_t)E * bytes, LLMEM_TAG_WEIGHTS), NULL, NULL};
    if (d[0] != NULL && side > 0) {
        d[1] = llmem_mem_alloc(m->mem, (size_t)E * side, LLMEM_TAG_WEIGHTS);
        d[2] = d[1] != NULL ? llmem_mem_alloc(m->mem, (size_t)E * side, LLMEM_TAG_WEIGHTS) : NULL;
    }
    int status = d[0] != NULL && (side == 0 || d[2] != NULL) ? LLMEM_OK : LLMEM_ENOMEM;
    for (int64_t e = 0; status == LLMEM_OK && e < E; e++) {
        if (be->ops->copy(be->ctx, d[0] + e * bytes, src[e].data, bytes) != LLMEM_OK ||
            (side > 0 &&
             (be->ops->copy(be->ctx, d[1] + e * side, src[e].scales, side) != LLMEM_OK ||
              be->ops->copy(be->ctx, d[2] + e * side, src[e].biases, side) != LLMEM_OK)))
            status = LLMEM_EIO;
        dst[e] = src[e];
        dst[e].data = d[0] + e * bytes;
        dst[e].scales = side > 0 ? d[1] + e * side : NULL;
        dst[e].biases = side > 0 ? d[2] + e * side : NULL;
    }
    if (status != LLMEM_OK) {
        for (int i = 0; i < 3; i++)
            llmem_mem_free(m->mem, d[i]);
        for (int64_t e = 0; e < E; e++)
            dst[e].data = dst[e].scales = dst[e].biases = NULL;
    }
    return status;
}

/* A MoE layer's router and its experts' three stacks, into L (whose table is made here); or, on
 * the host, the router alone, the table pointing at S's experts. */
static int upload_moe(struct llmem_model *m, const struct llmem_backend *be,
                      const struct model_layer *S, struct model_layer *L, int on_host) {
    const int64_t E = S->moe.n_experts;
    int status = llmem_model_layer_experts(m, L);
    if (status != LLMEM_OK)
        return status;
    L->router = S->router;
    if ((status = upload_weight(m, be, &L->router)) != LLMEM_OK)
        return status;
    if (on_host) {
        memcpy(L->experts, S->moe.gate, (size_t)E * sizeof(*L->experts));
        memcpy(L->experts + E, S->moe.up, (size_t)E * sizeof(*L->experts));
        memcpy(L->experts + 2 * E, S->moe.down, (size_t)E * sizeof(*L->experts));
        L->experts_on_host = 1;
        return LLMEM_OK;
    }
    if ((status = upload_experts(m, be, S->moe.gate, E, L->experts)) == LLMEM_OK &&
        (status = upload_experts(m, be, S->moe.up, E, L->experts + E)) == LLMEM_OK)
        status = upload_experts(m, be, S->moe.down, E, L->experts + 2 * E);
    return status;
}

int llmem_model_to_device(const struct llmem_model *src, const struct llmem_backend *be,
                          struct llmem_mem *mem, int64_t experts_on_host, llmem_progress_fn progress, void *progress_arg,
                          struct llmem_model **out) {
    LLMEM_ASSERT(src != NULL && be != NULL && mem != NULL && out != NULL);
    *out = NULL;
    const struct llmem_model_geometry *g = &src->cfg.geom;
    int status = LLMEM_OK;
    struct llmem_model *m = calloc(1, sizeof(*m));
    struct model_layer *layers = calloc((size_t)g->n_layers, sizeof(*layers));
    uint8_t *sliding = src->cfg.layer_sliding != NULL ? malloc((size_t)g->n_layers) : NULL;
    uint8_t *moe = src->cfg.layer_moe != NULL ? malloc((size_t)g->n_layers) : NULL;
    float *inv_freq = malloc((size_t)g->head_dim / 2 * sizeof(float));
    const size_t overrides_bytes =
        (size_t)src->cfg.n_quant_overrides * sizeof(*src->cfg.quant_overrides);
    struct llmem_model_quant_override *overrides =
        overrides_bytes > 0 ? malloc(overrides_bytes) : NULL;
    if (m == NULL || layers == NULL || inv_freq == NULL ||
        (src->cfg.layer_sliding != NULL && sliding == NULL) ||
        (src->cfg.layer_moe != NULL && moe == NULL) ||
        (overrides_bytes > 0 && overrides == NULL)) {
        free(m), free(layers), free(sliding), free(moe), free(inv_freq), free(overrides);
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    m->cfg = src->cfg;
    m->cfg.rope_interleaved = 0;    /* q and k unpermuted on the way (unpermuted) */
    m->cfg.layer_sliding = sliding; /* the configuration's arrays: copies of its own */
    if (sliding != NULL)
        memcpy(sliding, src->cfg.layer_sliding, (size_t)g->n_layers);
    m->cfg.layer_moe = moe;
    if (moe != NULL)
        memcpy(moe, src->cfg.layer_moe, (size_t)g->n_layers);
    m->cfg.quant_overrides = overrides;
    if (overrides != NULL)
        memcpy(overrides, src->cfg.quant_overrides, overrides_bytes);
    memcpy(inv_freq, src->inv_freq, (size_t)g->head_dim / 2 * sizeof(float));
    m->inv_freq = inv_freq;
    m->mem = mem;
    m->on_device = 1;
    m->vector_bytes = src->vector_bytes;
    m->embed = src->embed;
    m->lm_head = src->lm_head;
    memcpy(layers, src->layers, (size_t)g->n_layers * sizeof(*layers));
    m->layers = layers;
    /* NULL every device pointer first, so that a failure half-way frees only what was made */
    m->final_norm = NULL;
    for (int64_t l = 0; l < g->n_layers; l++) {
        struct model_layer *L = &layers[l];
        struct llmem_weight *w[7] = {&L->wq,     &L->wk,   &L->wv,    &L->wo,
                                     &L->w_gate, &L->w_up, &L->w_down};
        for (int i = 0; i < 7; i++)
            w[i]->data = w[i]->scales = w[i]->biases = NULL;
        L->router.data = L->router.scales = L->router.biases = NULL;
        L->experts = NULL; /* the host model's: this copy makes its own (upload_moe) */
        L->experts_on_host = 0;
        L->attn_norm = L->mlp_norm = L->bq = L->bk = L->bv = L->q_norm = L->k_norm = NULL;
    }
    m->embed.data = m->lm_head.data = NULL;
    m->embed.scales = m->embed.biases = m->lm_head.scales = m->lm_head.biases = NULL;

    const int64_t hidden = g->hidden_size, hd = g->head_dim;
    const int64_t q_dim = g->n_heads * hd, kv_dim = g->n_kv_heads * hd;
    struct llmem_weight e = src->embed;
    status = upload_weight(m, be, &e);
    m->embed = e;
    if (status == LLMEM_OK) {
        if (src->lm_head.data == src->embed.data) {
            m->lm_head = m->embed; /* tied */
        } else {
            struct llmem_weight h = src->lm_head;
            status = upload_weight(m, be, &h);
            m->lm_head = h;
        }
    }
    float *final_norm = src->final_norm;
    if (status == LLMEM_OK && (status = upload_vector(m, be, &final_norm, hidden)) == LLMEM_OK)
        m->final_norm = final_norm;
    int64_t moe_seen = 0; /* MoE layers so far */
    for (int64_t l = 0; status == LLMEM_OK && l < g->n_layers; l++) {
        const struct model_layer *S = &src->layers[l];
        struct model_layer *L = &layers[l];
        struct llmem_weight w[7] = {S->wq, S->wk, S->wv, S->wo, S->w_gate, S->w_up, S->w_down};
        struct llmem_weight *dst[7] = {&L->wq,     &L->wk,   &L->wv,    &L->wo,
                                       &L->w_gate, &L->w_up, &L->w_down};
        float *v[7] = {S->attn_norm, S->mlp_norm, S->bq, S->bk, S->bv, S->q_norm, S->k_norm};
        void *perm[6] = {NULL}; /* q, k, their biases and norms, unpermuted */
        if (src->cfg.rope_interleaved) {
            int failed = 0;
            perm[0] = unpermuted(S->wq.data, S->wq.rows, (size_t)llmem_weight_row_bytes(&S->wq), hd,
                                 &failed);
            perm[1] = unpermuted(S->wk.data, S->wk.rows, (size_t)llmem_weight_row_bytes(&S->wk), hd,
                                 &failed);
            perm[2] = unpermuted(S->bq, q_dim, sizeof(float), hd, &failed);
            perm[3] = unpermuted(S->bk, kv_dim, sizeof(float), hd, &failed);
            perm[4] = unpermuted(S->q_norm, hd, sizeof(float), hd, &failed);
            perm[5] = unpermuted(S->k_norm, hd, sizeof(float), hd, &failed);
            w[0].data = perm[0], w[1].data = perm[1];
            v[2] = perm[2], v[3] = perm[3], v[5] = perm[4], v[6] = perm[5];
            status = failed ? LLMEM_ENOMEM : LLMEM_OK;
        }
        for (int i = 0; status == LLMEM_OK && i < 7; i++) {
            if (S->experts != NULL && i >= 4) { /* a MoE layer: no dense MLP */
                status = upload_moe(m, be, S, L, moe_seen++ < experts_on_host);
                break;
            }
            const int pair = i == 1 || i == 4; /* k and v, gate and up */
            status = pair ? upload_pair(m, be, &w[i], &w[i + 1]) : upload_weight(m, be, &w[i]);
            if (status == LLMEM_OK)
                *dst[i] = w[i];
            if (status == LLMEM_OK && pair)
                *dst[i + 1] = w[i + 1], i++;
        }
        float **vd[7] = {&L->attn_norm, &L->mlp_norm, &L->bq,    &L->bk,
                         &L->bv,        &L->q_norm,   &L->k_norm};
        const int64_t n[7] = {hidden, hidden, q_dim, kv_dim, kv_dim, hd, hd};
        for (int i = 0; status == LLMEM_OK && i < 7; i++) {
            status = upload_vector(m, be, &v[i], n[i]);
            if (status == LLMEM_OK)
                *vd[i] = v[i];
        }
        for (int i = 0; i < 6; i++)
            free(perm[i]);
        if (progress != NULL)
            progress(progress_arg, l + 1, g->n_layers);
    }
    if (status != LLMEM_OK) {
        LLMEM_ERROR("cannot copy the model to the %s backend's memory", be->ops->name);
        llmem_model_free(m);
        return status;
    }
    *out = m;
    return LLMEM_OK;
}
