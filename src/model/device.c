/*
 * model/device.c — a loaded model copied into a device backend's memory: every matrix and small
 * vector allocated from the device's allocator (tag weights) and moved through the backend (k and
 * v, gate and up in one buffer a pair, so that a backend can multiply them as one batch; a
 * mixture's experts in three stacks a layer, upload_experts), the configuration copied, the rotary frequencies kept on the host (the backend takes them per call).
 * The copy owns its memory and shares nothing with the host model, which can be freed.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "model/model_int.h"
#include "llmem/dtype.h"
#include "llmem/plan.h"

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

/* ---- a rank's share (tensor parallelism) ---------------------------------------------------- */

/* What rank r of n holds of the model: ranges of rows of each kind of matrix (a matrix split by
 * its columns takes the same range of columns). */
struct share {
    int64_t q0, q_rows;   /* its query heads' rows of wq (and bq), columns of wo */
    int64_t kv0, kv_rows; /* its KV heads' rows of wk and wv */
    int64_t i0, i_rows;   /* the dense MLP's columns: rows of gate and up, columns of down */
    int64_t e0, e_rows;   /* each expert's likewise */
    int64_t v0, v_rows;   /* the vocabulary: rows of the embeddings and the LM head */
};

static struct share share_of(const struct llmem_model_geometry *g,
                             const struct llmem_model_geometry *rg, int r, int n) {
    const int64_t hd = g->head_dim;
    /* more ranks than KV heads: n / n_kv_heads ranks hold each one (llmem_geometry_tensor_rank) */
    const int64_t kv_head = g->n_kv_heads >= n ? r * rg->n_kv_heads : r / (n / g->n_kv_heads);
    const int64_t v0 = r * rg->vocab_size;
    return (struct share){
        .q0 = r * rg->n_heads * hd,
        .q_rows = rg->n_heads * hd,
        .kv0 = kv_head * hd,
        .kv_rows = rg->n_kv_heads * hd,
        .i0 = r * rg->intermediate_size,
        .i_rows = rg->intermediate_size,
        .e0 = r * rg->expert_intermediate,
        .e_rows = rg->expert_intermediate,
        .v0 = v0,
        .v_rows = g->vocab_size - v0 < rg->vocab_size ? g->vocab_size - v0 : rg->vocab_size,
    };
}

/* Host memory for the parts a copy makes before it moves them (columns copied, deferred values
 * made): one buffer reused from matrix to matrix, so that its pages are faulted in once, grown at
 * a reset to what the parts between two resets took (blocks beyond it taken meanwhile, freed
 * then). */
struct stage {
    uint8_t *buf;
    size_t size, used, need;
    void *extra; /* the blocks beyond buf: a list, each block's first pointer the next */
};

static void *stage_take(struct stage *st, size_t bytes) {
    bytes = (bytes + 63) & ~(size_t)63;
    st->need += bytes;
    if (st->used + bytes <= st->size) {
        st->used += bytes;
        return st->buf + st->used - bytes;
    }
    void **block = malloc(bytes + 64);
    if (block == NULL)
        return NULL;
    *block = st->extra;
    st->extra = block;
    return (uint8_t *)block + 64;
}

/* Every part taken is done with: the extra blocks freed, buf grown to hold them all next time. */
static void stage_reset(struct stage *st) {
    while (st->extra != NULL) {
        void *next = *(void **)st->extra;
        free(st->extra);
        st->extra = next;
    }
    if (st->need > st->size) {
        free(st->buf);
        st->buf = malloc(st->need);
        st->size = st->buf != NULL ? st->need : 0;
    }
    st->used = st->need = 0;
}

/* Rows [first, first + count) of src's matrix w (a view of its bytes), or with `cols` its columns
 * [first, first + count) copied row by row into the stage (codes, then an MLX type's scales and
 * biases); of a deferred dummy model, the part's values made there. LLMEM_EUNSUPPORTED (logged)
 * where the columns would cut a block or group, LLMEM_ENOMEM. */
static int weight_part(const struct llmem_model *src, const struct llmem_weight *w, int cols,
                       int64_t first, int64_t count, struct stage *stage,
                       struct llmem_weight *out) {
    *out = *w;
    if (src->dummy_deferred) {
        const int64_t rows = cols ? w->rows : count, width = cols ? count : w->cols;
        uint16_t *d = stage_take(stage, (size_t)(rows * width) * sizeof(uint16_t));
        if (d == NULL) {
            LLMEM_ERROR("out of memory");
            return LLMEM_ENOMEM;
        }
        llmem_model_dummy_matrix(src, w, cols ? 0 : first, rows, cols ? first : 0, width, d);
        out->data = d, out->rows = rows, out->cols = width;
        return LLMEM_OK;
    }
    int group = 1, st = 0;
    const int mlx = llmem_qtype_mlx_params(w->quant, NULL, &group, &st);
    const int64_t sb = mlx ? (st == LLMEM_QTYPE_F32 ? 4 : 2) : 0; /* bytes of a scale */
    const int64_t row = llmem_weight_row_bytes(w), side = w->cols / group * sb;
    if (cols && first == 0 && count == w->cols) /* every column: the matrix itself */
        return LLMEM_OK;
    if (!cols) {
        out->data = (const uint8_t *)w->data + first * row;
        out->rows = count;
        if (mlx) {
            out->scales = (const uint8_t *)w->scales + first * side;
            out->biases = (const uint8_t *)w->biases + first * side;
        }
        return LLMEM_OK;
    }
    const int64_t at = w->quant != 0 ? llmem_qtype_bytes(w->quant, first)
                                     : first * (int64_t)llmem_dtype_size(w->dtype);
    out->cols = count;
    const int64_t bytes = llmem_weight_row_bytes(out);
    if (at < 0 || bytes <= 0 || first % group != 0 || count % group != 0) {
        const int64_t block = mlx ? group : llmem_qtype_info(w->quant)->block_elems;
        LLMEM_ERROR_AS("llmem_model_to_device",
                       "a %" PRId64 "x%" PRId64
                       " matrix of %s does not split into shares of %" PRId64
                       " columns: they cut its blocks of %" PRId64,
                       w->rows, w->cols, llmem_qtype_name(w->quant), count, block);
        return LLMEM_EUNSUPPORTED;
    }
    const int64_t s0 = first / group * sb, s_bytes = count / group * sb;
    uint8_t *d = stage_take(stage, (size_t)(w->rows * (bytes + 2 * s_bytes)));
    if (d == NULL) {
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    uint8_t *ds = d + w->rows * bytes, *db = ds + w->rows * s_bytes;
    for (int64_t r = 0; r < w->rows; r++) {
        memcpy(d + r * bytes, (const uint8_t *)w->data + r * row + at, (size_t)bytes);
        if (mlx) {
            memcpy(ds + r * s_bytes, (const uint8_t *)w->scales + r * side + s0, (size_t)s_bytes);
            memcpy(db + r * s_bytes, (const uint8_t *)w->biases + r * side + s0, (size_t)s_bytes);
        }
    }
    out->data = d;
    out->scales = mlx ? ds : NULL;
    out->biases = mlx ? db : NULL;
    return LLMEM_OK;
}

/* A MoE layer's router and its experts' three stacks, into L (whose table is made here), of each
 * expert the share's columns; or, on the host, the router alone, the table pointing at S's
 * experts. */
static int upload_moe(const struct llmem_model *src, struct llmem_model *m,
                      const struct llmem_backend *be, const struct model_layer *S,
                      struct model_layer *L, int on_host, const struct share *sh,
                      struct stage *stage) {
    const int64_t E = S->moe.n_experts;
    int status = llmem_model_layer_experts(m, L);
    if (status != LLMEM_OK)
        return status;
    if ((status = weight_part(src, &S->router, 0, 0, S->router.rows, stage, &L->router)) ==
        LLMEM_OK)
        status = upload_weight(m, be, &L->router);
    stage_reset(stage);
    if (status != LLMEM_OK)
        return status;
    if (on_host) {
        memcpy(L->experts, S->moe.gate, (size_t)E * sizeof(*L->experts));
        memcpy(L->experts + E, S->moe.up, (size_t)E * sizeof(*L->experts));
        memcpy(L->experts + 2 * E, S->moe.down, (size_t)E * sizeof(*L->experts));
        L->experts_on_host = 1;
        return LLMEM_OK;
    }
    const struct llmem_weight *stacks[3] = {S->moe.gate, S->moe.up, S->moe.down};
    struct llmem_weight *parts = calloc((size_t)E, sizeof(*parts));
    if (parts == NULL)
        status = LLMEM_ENOMEM;
    for (int s = 0; status == LLMEM_OK && s < 3; s++) {
        for (int64_t e = 0; status == LLMEM_OK && e < E; e++)
            status = weight_part(src, &stacks[s][e], s == 2, sh->e0, sh->e_rows, stage, &parts[e]);
        if (status == LLMEM_OK)
            status = upload_experts(m, be, parts, E, L->experts + s * E);
        stage_reset(stage);
    }
    free(parts);
    return status;
}

int llmem_model_to_device(const struct llmem_model *src, const struct llmem_backend *be,
                          struct llmem_mem *mem, int64_t experts_on_host, int rank, int ranks,
                          llmem_progress_fn progress, void *progress_arg,
                          struct llmem_model **out) {
    LLMEM_ASSERT(src != NULL && be != NULL && mem != NULL && out != NULL);
    LLMEM_ASSERT(rank >= 0 && rank < ranks && (ranks == 1 || experts_on_host == 0));
    LLMEM_ASSERT(!src->dummy_deferred || experts_on_host == 0); /* (no values on the host) */
    *out = NULL;
    const struct llmem_model_geometry *g = &src->cfg.geom;
    struct llmem_model_geometry rg;
    char why[256];
    if (llmem_geometry_tensor_rank(g, ranks, &rg, why, sizeof(why)) != LLMEM_OK) {
        LLMEM_ERROR("%s: cannot split the model over %d devices: %s", g->source, ranks, why);
        return LLMEM_EINVAL;
    }
    const struct share sh = share_of(g, &rg, rank, ranks);
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
    m->cfg.geom = rg; /* the share's heads and widths; the vocabulary stays the model's */
    m->cfg.geom.vocab_size = g->vocab_size;
    m->rank = rank, m->ranks = ranks, m->vocab_first = sh.v0;
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
    struct stage stage = {0};
    struct llmem_weight e;
    status = weight_part(src, &src->embed, 0, sh.v0, sh.v_rows, &stage, &e);
    if (status == LLMEM_OK)
        status = upload_weight(m, be, &e);
    stage_reset(&stage);
    m->embed = e;
    if (status == LLMEM_OK) {
        if (src->lm_head.data == src->embed.data) {
            m->lm_head = m->embed; /* tied */
        } else {
            struct llmem_weight h;
            status = weight_part(src, &src->lm_head, 0, sh.v0, sh.v_rows, &stage, &h);
            if (status == LLMEM_OK)
                status = upload_weight(m, be, &h);
            stage_reset(&stage);
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
        struct llmem_weight w[7];
        struct llmem_weight *dst[7] = {&L->wq,     &L->wk,   &L->wv,    &L->wo,
                                       &L->w_gate, &L->w_up, &L->w_down};
        /* the share of each matrix: rows of q, k, v, gate and up; columns of o and down */
        const struct llmem_weight *sw[7] = {&S->wq,     &S->wk,   &S->wv,    &S->wo,
                                            &S->w_gate, &S->w_up, &S->w_down};
        const int64_t first[7] = {sh.q0, sh.kv0, sh.kv0, sh.q0, sh.i0, sh.i0, sh.i0};
        const int64_t count[7] = {sh.q_rows, sh.kv_rows, sh.kv_rows, sh.q_rows,
                                  sh.i_rows, sh.i_rows,  sh.i_rows};
        const int dense = S->experts == NULL ? 7 : 4;
        for (int i = 0; status == LLMEM_OK && i < dense; i++)
            status = weight_part(src, sw[i], i == 3 || i == 6, first[i], count[i], &stage, &w[i]);
        float *v[7] = {S->attn_norm, S->mlp_norm, S->bq, S->bk, S->bv, S->q_norm, S->k_norm};
        v[2] = S->bq != NULL ? S->bq + sh.q0 : NULL;
        v[3] = S->bk != NULL ? S->bk + sh.kv0 : NULL;
        v[4] = S->bv != NULL ? S->bv + sh.kv0 : NULL;
        void *perm[6] = {NULL}; /* q, k, their biases and norms, unpermuted */
        if (status == LLMEM_OK && src->cfg.rope_interleaved) { /* whole heads: within each */
            int failed = 0;
            perm[0] = unpermuted(w[0].data, w[0].rows, (size_t)llmem_weight_row_bytes(&w[0]), hd,
                                 &failed);
            perm[1] = unpermuted(w[1].data, w[1].rows, (size_t)llmem_weight_row_bytes(&w[1]), hd,
                                 &failed);
            perm[2] = unpermuted(v[2], sh.q_rows, sizeof(float), hd, &failed);
            perm[3] = unpermuted(v[3], sh.kv_rows, sizeof(float), hd, &failed);
            perm[4] = unpermuted(S->q_norm, hd, sizeof(float), hd, &failed);
            perm[5] = unpermuted(S->k_norm, hd, sizeof(float), hd, &failed);
            w[0].data = perm[0], w[1].data = perm[1];
            v[2] = perm[2], v[3] = perm[3], v[5] = perm[4], v[6] = perm[5];
            status = failed ? LLMEM_ENOMEM : LLMEM_OK;
        }
        for (int i = 0; status == LLMEM_OK && i < 7; i++) {
            if (S->experts != NULL && i >= 4) { /* a MoE layer: no dense MLP */
                stage_reset(&stage); /* (q, k, v and o moved: the stage is the experts') */
                status = upload_moe(src, m, be, S, L, moe_seen++ < experts_on_host, &sh, &stage);
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
        const int64_t n[7] = {hidden, hidden, sh.q_rows, sh.kv_rows, sh.kv_rows, hd, hd};
        for (int i = 0; status == LLMEM_OK && i < 7; i++) {
            status = upload_vector(m, be, &v[i], n[i]);
            if (status == LLMEM_OK)
                *vd[i] = v[i];
        }
        for (int i = 0; i < 6; i++)
            free(perm[i]);
        stage_reset(&stage);
        if (progress != NULL)
            progress(progress_arg, l + 1, g->n_layers);
    }
    stage_reset(&stage);
    free(stage.buf);
    if (status != LLMEM_OK) {
        LLMEM_ERROR("cannot copy the model to the %s backend's memory", be->ops->name);
        llmem_model_free(m);
        return status;
    }
    *out = m;
    return LLMEM_OK;
}
