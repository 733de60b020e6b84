/*
 * model/forward.c — the forward pass of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over
 * the KV caches, through the backend table. One call runs a batch: several sequences, each a run
 * of consecutive tokens starting at a position (a prefill chunk, or one decode token), with the
 * logits of each sequence's last token, or of all its tokens.
 *
 * Per layer, for all T tokens of the batch at once:
 *   xn = rmsnorm(x); q, k, v = xn·Wqᵀ (+b), xn·Wkᵀ (+b), xn·Wvᵀ (+b); q/k per-head rmsnorm (Qwen3);
 *   rope(q, k); write k, v into the cache, attend (GQA, causal, sliding window);
 *   x += att·Woᵀ;  xn = rmsnorm(x);  x += (silu(xn·Wgᵀ) ⊙ xn·Wuᵀ)·Wdᵀ
 * or, in a mixture-of-experts layer, x += the same over the experts its router picks for each
 * token, weighted by their probabilities (the backend's moe)
 * then the rows that want logits: rmsnorm, ·lm_headᵀ. A step's sequences (decode tokens and
 * prefill chunks alike, each its sequence's last tokens) are written and attended with one cache
 * call each (llmem_kv_write_last, llmem_kv_attend_last): one launch each on a device.
 *
 * Any backend: the activations live in the model's allocator (host memory, or a device's for a
 * model copied there by llmem_model_to_device); the logits come back to the caller's host memory,
 * or on a device only each row's largest few (llmem_forward_run_top: the backend's top_k).
 *
 * Memory: the activations are sized once, at create, for max_batch_tokens tokens (tag scratch);
 * attention allocates its own workspace per call (also tag scratch), bounded by handing it the
 * queries of a long prefill chunk in groups so that queries × 512-token partitions stays within
 * LLMEM_ATTN_PARTITION_ROWS. Together with the caller's logits rows this is exactly the planner's
 * computed workspace (llmem_geometry_workspace_bytes). On a device the logits rows are computed
 * there first, into a buffer kept from pass to pass (a replayed decode step writes where its
 * recording did).
 *
 * A pure decode step on a backend with graphs (ops.h graph_begin) runs between graph_begin and
 * graph_end, and again when the backend says its recording did not match. With only the top few
 * of each row asked for, the pass can be started (llmem_forward_start_top: queued up to the
 * backend's top_k) and waited for later (llmem_forward_wait: the backend's sync delivers them).
 * A greedy decode step can be queued behind such a pass before its tokens reach the host
 * (llmem_forward_start_next: its embedding reads them on the device); each wait is then for the
 * older pass (the backend's top_k_wait).
 *
 * A model split over several backends (forward_split.h: tensor parallelism) runs the same code
 * for each rank (struct rank: each its share, backend and activations), a pass cut into segments
 * (the embeddings, each attention and MLP block, the logits) whose partial outputs — of o, down,
 * the experts, the embeddings — the group sums between them: on devices each rank's thread runs
 * its segments and its part of each sum (struct crew), and records its decode steps as graphs
 * when every rank agrees (rank_graphed); on the host alike (the CPU backends taking turns on a
 * pool they share).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "llmem/kv.h"
#include "llmem/status.h"
#include "llmem/config.h"
#include "llmem/forward.h"
#include "model/forward_split.h"
#include "model/model_int.h"
#include "plan/moe_work.h"

/* What one rank of a split model (the whole model in a group of one) holds for a pass: its share
 * of the weights, its backend and its activations. */
struct rank {
    struct llmem_model *model;
    const struct llmem_backend *be;
    struct llmem_mem *mem;
    float *x;         /* (T, hidden) the residual stream, the same on every rank */
    float *xn;        /* (T, hidden) normed input of a block; its output before the residual add
                       * (the rank's part of it, until the ranks' parts are summed) */
    float *q;         /* (T, n_heads·hd) */
    float *att;       /* (T, n_heads·hd) attention output */
    float *k, *v;     /* (T, n_kv·hd) */
    float *gate, *up; /* (T, inter) of a dense MLP */
    float *router;    /* (T, n_experts) a MoE layer's router logits, or NULL */
    void *moe_work;   /* a MoE layer's workspace (plan/moe_work.h), or NULL */
    float *dev_logits; /* on a device, or of a split: its logits rows there, kept for the next pass
                        * (graphs) */
    int64_t dev_logits_rows;
    int32_t *ids; /* (T, host) of a split: the tokens' rows of its share of the vocabulary, −1 for
                   * the others' */
    int32_t *top_ids; /* (T, LLMEM_TOP_K_MAX, host) of a split on devices: its share's top k of */
    float *top_vals;  /* each row, merged into the pass's by llmem_forward_wait */
};

/* The batch of the pass being run, as its ranks read it. */
struct pass {
    const int32_t *tokens; /* NULL: read on the device (llmem_forward_start_next) */
    const struct llmem_batch_seq *seqs;
    int n_seqs;
    int64_t T, n_logits;
    int decode;    /* every sequence has one token */
    float *logits; /* a group of one's logits rows (the backend's memory) */
    int graph;     /* recorded and replayed (graph_begin), with this key */
    uint64_t key;
};

struct llmem_forward {
    struct llmem_model *model;      /* rank 0's (its configuration: the vocabulary, the layers) */
    const struct llmem_backend *be; /* rank 0's */
    struct llmem_kv *kv;
    int64_t max_tokens;
    struct llmem_backend_group group;
    const struct llmem_backend *one; /* a group of one: its backend */
    struct rank *ranks;              /* (group.n) */
    struct crew *crew;               /* a split: the threads of ranks 1 … n − 1 */
    struct pass pass;
    int64_t *pos;     /* (T) position of each token */
    int *seq_ids;     /* (T) the sequences of a step */
    int64_t *n_q;     /* (T) and their tokens */
    int64_t *lengths; /* (T) their lengths before the pass, restored if it fails */
    /* the passes started and not yet waited for, oldest first: their sequences and lengths
     * before them (the arrays, T each, swap with seq_ids and lengths as passes start) */
    struct started {
        int n_seqs, k;
        int *seq_ids;
        int64_t *lengths;
        float *logits; /* k = 0: where wait copies the rows (the ranks' dev_logits) */
        int64_t logit_rows;
        int32_t *ids; /* k > 0 in a split: where wait merges the ranks' top k */
        float *vals;
    } started[2];
    int n_started;
    /* the MoE layers whose experts are on the host (model_layer experts_on_host): the backend
     * that runs them, the router logits and the block's input and output there, its workspace */
    const struct llmem_backend *host;
    float *host_logits, *host_x;
    void *host_work;
};

struct crew;
static int crew_create(struct llmem_forward *f, struct crew **out);
static void crew_free(struct crew *c);

/* A rank's activations for batches of T tokens (tag scratch). */
static int rank_alloc(struct rank *R, int64_t max_tokens, int split) {
    const struct llmem_model_geometry *g = &R->model->cfg.geom;
    const int moe = g->n_experts > 0 && g->n_moe_layers > 0;
    const size_t T = (size_t)max_tokens;
    /* the dense MLP's width, where some layer has one (llmem_geometry_workspace_bytes) */
    const size_t inter = moe && g->n_moe_layers >= g->n_layers ? 0 : (size_t)g->intermediate_size;
    const size_t q_dim = (size_t)(g->n_heads * g->head_dim);
    const size_t kv_dim = (size_t)(g->n_kv_heads * g->head_dim);
    struct {
        float **p;
        size_t floats;
    } bufs[] = {
        {&R->x, T * (size_t)g->hidden_size},
        {&R->xn, T * (size_t)g->hidden_size},
        {&R->q, T * q_dim},
        {&R->att, T * q_dim},
        {&R->k, 2 * T * kv_dim},   /* and v */
        {&R->gate, 2 * T * inter}, /* and up */
        {&R->router, moe ? T * (size_t)g->n_experts : 0},
        {(float **)&R->moe_work,
         moe ? (size_t)llmem_moe_work_layout((int64_t)T, g->hidden_size, g->expert_intermediate,
                                             g->n_experts, g->n_experts_used, NULL, NULL) /
                   sizeof(float)
             : 0},
    };
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) {
        if (bufs[i].floats == 0)
            continue;
        *bufs[i].p = llmem_mem_alloc(R->mem, bufs[i].floats * sizeof(float), LLMEM_TAG_SCRATCH);
        if (*bufs[i].p == NULL)
            return LLMEM_ENOMEM;
    }
    /* the outputs of a pair of matrices a fixed distance apart, as the pair may be multiplied */
    R->v = R->k + T * kv_dim;
    R->up = R->gate != NULL ? R->gate + T * inter : NULL;
    const int top = split && R->model->on_device && R->be->ops->top_k != NULL;
    if (split && ((R->ids = malloc(T * sizeof(int32_t))) == NULL ||
                  (top && ((R->top_ids = malloc(T * LLMEM_TOP_K_MAX * sizeof(int32_t))) == NULL ||
                           (R->top_vals = malloc(T * LLMEM_TOP_K_MAX * sizeof(float))) == NULL)))) {
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    return LLMEM_OK;
}

static void rank_free(struct rank *R) {
    /* (v and up within k and gate) */
    float *bufs[] = {
        R->x, R->xn, R->q, R->att, R->k, R->gate, R->router, (float *)R->moe_work, R->dev_logits};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        llmem_mem_free(R->mem, bufs[i]);
    free(R->ids), free(R->top_ids), free(R->top_vals);
}

int llmem_forward_create_split(struct llmem_model *const *models,
                               const struct llmem_backend_group *group, struct llmem_kv *kv,
                               int64_t max_batch_tokens, struct llmem_forward **out) {
    LLMEM_ASSERT(models != NULL && group != NULL && group->n >= 1 && kv != NULL &&
                 max_batch_tokens > 0 && group->n <= LLMEM_SPLIT_MAX &&
                 (group->n == 1 || group->allreduce_rank != NULL));
    const int n = group->n;
    for (int r = 0; r < n; r++) {
        const struct llmem_model *m = models[r];
        const struct llmem_backend_ops *ops = group->ranks[r]->ops;
        LLMEM_ASSERT(n == 1 || (m->ranks == n && m->rank == r));
        if (m->dummy_deferred) {
            LLMEM_ERROR("%s: a model loaded with its values deferred runs only as a device's "
                        "copy (llmem_model_to_device)",
                        m->cfg.geom.source);
            return LLMEM_EINVAL;
        }
        if (m->cfg.rope_interleaved && ops->rope_pairs == NULL) {
            LLMEM_ERROR("%s: the %s backend does not run RoPE on interleaved pairs (GGUF llama "
                        "files)",
                        m->cfg.geom.source, ops->name);
            return LLMEM_EUNSUPPORTED;
        }
        const struct llmem_model_geometry *g = &m->cfg.geom;
        const int moe = g->n_experts > 0 && g->n_moe_layers > 0;
        if (moe && ops->moe == NULL) {
            LLMEM_ERROR("%s: the %s backend does not run mixture-of-experts layers", g->source,
                        ops->name);
            return LLMEM_EUNSUPPORTED;
        }
        if (moe && max_batch_tokens * g->n_experts_used > INT32_MAX) {
            LLMEM_ERROR("a batch of %" PRId64 " tokens: more than a mixture of experts indexes",
                        max_batch_tokens);
            return LLMEM_EINVAL;
        }
    }
    struct llmem_forward *f = calloc(1, sizeof(*f));
    struct rank *ranks = calloc((size_t)n, sizeof(*ranks));
    if (f == NULL || ranks == NULL) {
        free(f), free(ranks);
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    *f = (struct llmem_forward){.model = models[0],
                                .be = group->ranks[0],
                                .kv = kv,
                                .max_tokens = max_batch_tokens,
                                .group = *group,
                                .ranks = ranks};
    int status = LLMEM_OK;
    for (int r = 0; r < n && status == LLMEM_OK; r++) {
        ranks[r] = (struct rank){.model = models[r], .be = group->ranks[r], .mem = models[r]->mem};
        status = rank_alloc(&ranks[r], max_batch_tokens, n > 1);
    }
    if (status != LLMEM_OK)
        goto fail;
    const size_t T = (size_t)max_batch_tokens;
    f->pos = malloc(T * sizeof(int64_t)); /* host memory, as the rope operation takes it */
    f->seq_ids = malloc(T * sizeof(int));
    f->n_q = malloc(T * sizeof(int64_t));
    f->lengths = malloc(T * sizeof(int64_t));
    int ok = f->pos != NULL && f->seq_ids != NULL && f->n_q != NULL && f->lengths != NULL;
    for (int i = 0; i < 2; i++) {
        f->started[i].seq_ids = malloc(T * sizeof(int));
        f->started[i].lengths = malloc(T * sizeof(int64_t));
        ok &= f->started[i].seq_ids != NULL && f->started[i].lengths != NULL;
    }
    if (!ok) {
        LLMEM_ERROR("out of memory");
        status = LLMEM_ENOMEM;
        goto fail;
    }
    if (n > 1 && (status = crew_create(f, &f->crew)) != LLMEM_OK)
        goto fail;
    *out = f;
    return LLMEM_OK;
fail:
    llmem_forward_free(f);
    return status;
}

int llmem_forward_create(struct llmem_model *model, const struct llmem_backend *backend,
                         struct llmem_kv *kv, int64_t max_batch_tokens,
                         struct llmem_forward **out) {
    LLMEM_ASSERT(model != NULL && backend != NULL);
    const struct llmem_backend *const one[1] = {backend};
    const struct llmem_backend_group group = {.n = 1, .ranks = one};
    int status = llmem_forward_create_split(&model, &group, kv, max_batch_tokens, out);
    if (status == LLMEM_OK) { /* the group's table of one, kept with the pass */
        (*out)->one = backend;
        (*out)->group.ranks = &(*out)->one;
    }
    return status;
}

void llmem_forward_free(struct llmem_forward *f) {
    if (f == NULL)
        return;
    crew_free(f->crew);
    for (int r = 0; f->ranks != NULL && r < f->group.n; r++)
        rank_free(&f->ranks[r]);
    free(f->ranks);
    free(f->host_logits), free(f->host_x), free(f->host_work);
    free(f->pos);
    free(f->seq_ids);
    free(f->n_q);
    free(f->lengths);
    for (int i = 0; i < 2; i++) {
        free(f->started[i].seq_ids);
        free(f->started[i].lengths);
    }
    free(f);
}

int llmem_forward_set_host(struct llmem_forward *f, const struct llmem_backend *host) {
    LLMEM_ASSERT(f != NULL && host != NULL && host->ops->moe != NULL && f->host == NULL &&
                 f->group.n == 1);
    const struct llmem_model_geometry *g = &f->model->cfg.geom;
    const int64_t T = f->max_tokens;
    const size_t work = (size_t)llmem_moe_work_layout(T, g->hidden_size, g->expert_intermediate,
                                                      g->n_experts, g->n_experts_used, NULL, NULL);
    f->host_logits = malloc((size_t)(T * g->n_experts) * sizeof(float));
    f->host_x = malloc((size_t)(T * g->hidden_size) * sizeof(float));
    if (posix_memalign(&f->host_work, 64, work) != 0)
        f->host_work = NULL;
    if (f->host_logits == NULL || f->host_x == NULL || f->host_work == NULL) {
        free(f->host_logits), free(f->host_x), free(f->host_work);
        f->host_logits = f->host_x = NULL, f->host_work = NULL;
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    f->host = host;
    return LLMEM_OK;
}

int64_t llmem_forward_max_tokens(const struct llmem_forward *f) {
    return f->max_tokens;
}

/* ---- one layer ------------------------------------------------------------------------------ */

/* xn = rmsnorm(x) with the norm weights w, after x += xn (the block before's output, when
 * `residual`): one operation where the backend fuses the two. */
static void residual_norm(struct rank *R, const float *w, int64_t T, int residual) {
    const struct llmem_backend_ops *ops = R->be->ops;
    const int64_t dim = R->model->cfg.geom.hidden_size;
    const float eps = (float)R->model->cfg.rms_norm_eps;
    if (residual && ops->add_rmsnorm != NULL) {
        ops->add_rmsnorm(R->be->ctx, R->x, R->xn, w, T, dim, eps, R->xn);
        return;
    }
    if (residual)
        ops->add(R->be->ctx, R->x, R->xn, T * dim);
    ops->rmsnorm(R->be->ctx, R->x, w, T, dim, eps, R->xn);
}

/* Several matmuls of one input: one dispatch where the backend offers it. */
static void matmul_multi(struct rank *R, int count, const struct llmem_weight *const *w,
                         const float *x, int64_t n, float *const *y, const float *const *bias) {
    const struct llmem_backend_ops *ops = R->be->ops;
    if (ops->matmul_multi != NULL) {
        ops->matmul_multi(R->be->ctx, count, w, x, n, y, bias);
        return;
    }
    for (int i = 0; i < count; i++)
        ops->matmul(R->be->ctx, w[i], x, n, y[i], bias != NULL ? bias[i] : NULL);
}

/* Rank r, its device made the calling thread's current one where it drives several. */
static struct rank *enter(struct llmem_forward *f, int r) {
    struct rank *R = &f->ranks[r];
    if (f->group.n > 1 && R->be->ops->bind != NULL)
        R->be->ops->bind(R->be->ctx);
    return R;
}

/* A rank's attention block for layer `layer` (its KV heads at the cache's layer
 * rank · n_layers + layer), its part of the output projection into xn. */
static int attention_block(struct llmem_forward *f, struct rank *R, int rank, int layer, int n_seqs,
                           int64_t T, int decode) {
    const struct llmem_backend_ops *ops = R->be->ops;
    void *ctx = R->be->ctx;
    const struct llmem_model_config *c = &R->model->cfg;
    const struct llmem_model_geometry *g = &c->geom;
    const struct model_layer *L = &R->model->layers[layer];
    const int hd = (int)g->head_dim, nh = (int)g->n_heads, nkv = (int)g->n_kv_heads;
    const float eps = (float)c->rms_norm_eps;

    residual_norm(R, L->attn_norm, T, layer > 0); /* the layer before's MLP output added first */
    {
        const struct llmem_weight *w[3] = {&L->wq, &L->wk, &L->wv};
        float *y[3] = {R->q, R->k, R->v};
        const float *b[3] = {L->bq, L->bk, L->bv};
        matmul_multi(R, 3, w, R->xn, T, y, b);
    }
    if (L->q_norm != NULL) {
        ops->rmsnorm(ctx, R->q, L->q_norm, T * nh, hd, eps, R->q);
        ops->rmsnorm(ctx, R->k, L->k_norm, T * nkv, hd, eps, R->k);
    }
    if (c->rope_interleaved) { /* a GGUF llama file's permuted q and k rows */
        ops->rope_pairs(ctx, R->q, T, nh, hd, f->pos, R->model->inv_freq);
        ops->rope_pairs(ctx, R->k, T, nkv, hd, f->pos, R->model->inv_freq);
    } else if (ops->rope_qk != NULL) {
        ops->rope_qk(ctx, R->q, R->k, T, nh, nkv, hd, f->pos, R->model->inv_freq);
    } else {
        ops->rope(ctx, R->q, T, nh, hd, f->pos, R->model->inv_freq);
        ops->rope(ctx, R->k, T, nkv, hd, f->pos, R->model->inv_freq);
    }

    /* every sequence's tokens are the last of it (the lengths cover them): each cache call once
     * for the whole step (n_q NULL for a pure decode step, as its recording has it) */
    const struct llmem_kv_attn attn = {.n_heads = nh, .window = L->window};
    const int64_t *n_q = decode ? NULL : f->n_q;
    const int kv_layer = rank * (int)g->n_layers + layer;
    int status = llmem_kv_write_last(f->kv, n_seqs, f->seq_ids, n_q, kv_layer, R->k, R->v);
    if (status == LLMEM_OK)
        status =
            llmem_kv_attend_last(f->kv, n_seqs, f->seq_ids, n_q, kv_layer, R->q, R->att, &attn);
    if (status != LLMEM_OK)
        return status;
    ops->matmul(ctx, &L->wo, R->att, T, R->xn, NULL); /* added to x by the next norm */
    return LLMEM_OK;
}

static int mlp_block(struct llmem_forward *f, struct rank *R, int layer, int64_t T) {
    const struct llmem_backend_ops *ops = R->be->ops;
    void *ctx = R->be->ctx;
    const struct llmem_model_geometry *g = &R->model->cfg.geom;
    const struct model_layer *L = &R->model->layers[layer];
    residual_norm(R, L->mlp_norm, T, 1);
    if (L->experts != NULL) { /* added to x by the next norm */
        ops->matmul(ctx, &L->router, R->xn, T, R->router, NULL);
        if (!L->experts_on_host) {
            ops->moe(ctx, &L->moe, R->router, R->xn, T, R->xn, R->moe_work);
            return LLMEM_OK;
        }
        /* the experts in host memory: the logits and the input there and the output back */
        const size_t x_bytes = (size_t)(T * g->hidden_size) * sizeof(float);
        int status =
            ops->copy(ctx, f->host_logits, R->router, (size_t)(T * g->n_experts) * sizeof(float));
        if (status == LLMEM_OK && (status = ops->copy(ctx, f->host_x, R->xn, x_bytes)) == LLMEM_OK)
            f->host->ops->moe(f->host->ctx, &L->moe, f->host_logits, f->host_x, T, f->host_x,
                              f->host_work);
        return status == LLMEM_OK ? ops->copy(ctx, R->xn, f->host_x, x_bytes) : status;
    }
    if (ops->matmul_swiglu != NULL) {
        ops->matmul_swiglu(ctx, &L->w_gate, &L->w_up, R->xn, T, R->gate, R->up, R->gate);
    } else {
        const struct llmem_weight *w[2] = {&L->w_gate, &L->w_up};
        float *y[2] = {R->gate, R->up};
        matmul_multi(R, 2, w, R->xn, T, y, NULL);
        ops->swiglu(ctx, R->gate, R->up, T * g->intermediate_size, R->gate);
    }
    ops->matmul(ctx, &L->w_down, R->gate, T, R->xn, NULL); /* added to x by the next norm */
    return LLMEM_OK;
}

/* ---- the batch ------------------------------------------------------------------------------ */

/* A rank's embeddings of the batch's tokens into x: of a split, its share's rows and zeros for
 * the rest (the ranks' parts then summed). */
static void embed(struct llmem_forward *f, struct rank *R, const int32_t *tokens, int64_t T) {
    const struct llmem_backend_ops *ops = R->be->ops;
    if (tokens == NULL) { /* a greedy step's tokens, from the pass before it on the device */
        ops->embedding_top(R->be->ctx, &R->model->embed, T, R->x);
        return;
    }
    if (f->group.n == 1) {
        ops->embedding(R->be->ctx, &R->model->embed, tokens, T, R->x);
        return;
    }
    const int64_t first = R->model->vocab_first, rows = R->model->embed.rows;
    for (int64_t t = 0; t < T; t++)
        R->ids[t] =
            tokens[t] >= first && tokens[t] < first + rows ? (int32_t)(tokens[t] - first) : -1;
    ops->embedding(R->be->ctx, &R->model->embed, R->ids, T, R->x);
}

/* A rank's logits rows of the pass (after its last MLP): into `logits` (the backend's memory) in a
 * group of one, else its share of the vocabulary into its dev_logits. */
static void logits_rows(struct llmem_forward *f, struct rank *R, const struct pass *p) {
    const struct llmem_backend_ops *ops = R->be->ops;
    void *ctx = R->be->ctx;
    const int64_t hidden = R->model->cfg.geom.hidden_size, T = p->T;
    if (p->n_logits == T) { /* every row wants its logits (a decode step): in place */
        residual_norm(R, R->model->final_norm, T, 1); /* the last MLP's output added first */
    } else {
        ops->add(ctx, R->x, R->xn, T * hidden); /* the last MLP's output */
        /* The rows that want logits, gathered in order (row r moves to index i ≤ r). */
        int64_t i = 0, row = 0;
        for (int s = 0; s < p->n_seqs; s++) {
            const struct llmem_batch_seq *b = &p->seqs[s];
            int64_t first = b->all_logits ? row : row + b->n_tokens - 1;
            for (int64_t t = first; t < row + b->n_tokens; t++, i++)
                if (i != t)
                    ops->copy(ctx, R->x + i * hidden, R->x + t * hidden,
                              (size_t)hidden * sizeof(float));
            row += b->n_tokens;
        }
        ops->rmsnorm(ctx, R->x, R->model->final_norm, p->n_logits, hidden,
                     (float)R->model->cfg.rms_norm_eps, R->xn);
    }
    ops->matmul(ctx, &R->model->lm_head, R->xn, p->n_logits,
                f->group.n == 1 ? p->logits : R->dev_logits, NULL);
}

/* A pass is a sequence of segments, each rank's part of one joined by the group's sum: 0 the
 * embeddings, 2l + 1 layer l's attention, 2l + 2 its MLP, and the last (2 · n_layers + 1) the
 * logits rows, after which nothing is summed. */
static int segments(const struct llmem_forward *f) {
    return 2 * (int)f->model->cfg.geom.n_layers + 2;
}

static int segment(struct llmem_forward *f, int r, int seg) {
    const struct pass *p = &f->pass;
    struct rank *R = enter(f, r);
    if (seg == 0) {
        embed(f, R, p->tokens, p->T);
        return LLMEM_OK;
    }
    if (seg == segments(f) - 1) {
        logits_rows(f, R, p);
        return LLMEM_OK;
    }
    const int layer = (seg - 1) / 2;
    return seg % 2 == 1 ? attention_block(f, R, r, layer, p->n_seqs, p->T, p->decode)
                        : mlp_block(f, R, layer, p->T);
}

/* The buffer of a rank that the group sums after segment seg: the embeddings' x, else a block's
 * output xn. */
static float *joined(struct rank *R, int seg) {
    return seg == 0 ? R->x : R->xn;
}

/* Rank r's whole pass, on its own thread: each of its segments, the group's sum after each. A
 * failed rank goes on to make every sum, so that the others finish. */
static int rank_pass(struct llmem_forward *f, int r) {
    const int64_t count = f->pass.T * f->model->cfg.geom.hidden_size;
    int status = LLMEM_OK;
    for (int seg = 0; seg < segments(f); seg++) {
        if (status == LLMEM_OK)
            status = segment(f, r, seg);
        if (seg < segments(f) - 1 && f->group.n > 1) {
            const int st =
                f->group.allreduce_rank(f->group.ctx, r, joined(&f->ranks[r], seg), count);
            status = status != LLMEM_OK ? status : st;
        }
    }
    return status;
}

/* The threads of ranks 1 … n − 1 of a split (rank 0's pass runs on the caller's), waiting for a
 * pass between passes. */
struct crew {
    struct llmem_forward *f;
    int n; /* threads started */
    pthread_t threads[LLMEM_SPLIT_MAX];
    pthread_mutex_t lock;
    pthread_cond_t go, done;
    uint64_t passes; /* passes handed out; the threads run each once */
    int running;     /* threads still running the current pass */
    int stop;
    int status[LLMEM_SPLIT_MAX];
    char error[LLMEM_SPLIT_MAX][256]; /* a failed rank's last error (its thread's own) */
    pthread_barrier_t met; /* the ranks' threads (the caller's as rank 0's) meet to agree */
    int votes[LLMEM_SPLIT_MAX];
};

struct crew_arg {
    struct crew *crew;
    int rank;
};

/* The largest of the ranks' values v (each rank's thread gives its own): what they agree on, with
 * a group of one's its own. */
static int agree(struct llmem_forward *f, int r, int v) {
    struct crew *c = f->crew;
    if (c == NULL)
        return v;
    c->votes[r] = v;
    pthread_barrier_wait(&c->met); /* every vote in */
    int most = v;
    for (int q = 0; q < f->group.n; q++)
        most = c->votes[q] > most ? c->votes[q] : most;
    pthread_barrier_wait(&c->met); /* every vote read before the next */
    return most;
}

/* Rank r's pass (a group of one's whole pass), or, where the pass is a graph's (pass.graph),
 * recorded and replayed: every rank of a split run the same way (the least any wants), the ranks'
 * recordings launched together or not at all, and the pass run again as usual when one did not
 * match its recording or could not be recorded. */
static int rank_graphed(struct llmem_forward *f, int r) {
    if (!f->pass.graph)
        return rank_pass(f, r);
    const struct llmem_backend *be = f->ranks[r].be;
    int most = LLMEM_GRAPH_REPLAY;
    for (;;) {
        (void)enter(f, r);
        const int want = be->ops->graph_want(be->ctx, f->pass.key);
        const int way = -agree(f, r, -(want < most ? want : most));
        int status = be->ops->graph_begin(be->ctx, f->pass.key, way);
        const int ran = rank_pass(f, r); /* (every rank makes every sum) */
        const int ended = be->ops->graph_end(be->ctx);
        status = status != LLMEM_OK ? status : ran != LLMEM_OK ? ran : ended;
        /* 0: every rank's pass ran or is held; 1: one did not match; 2: one failed */
        const int worst = agree(f, r, status == LLMEM_OK ? 0 : status == LLMEM_EBUSY ? 1 : 2);
        const int launched = be->ops->graph_launch(be->ctx, worst == 0);
        if (worst == 0)
            return launched;
        if (worst == 2 || way == LLMEM_GRAPH_RUN) /* (the failed rank's status is the pass's) */
            return status == LLMEM_EBUSY ? LLMEM_OK : status;
        most = LLMEM_GRAPH_RUN; /* again, as usual */
    }
}

static void *crew_thread(void *arg) {
    struct crew_arg a = *(struct crew_arg *)arg;
    struct crew *c = a.crew;
    free(arg);
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&c->lock);
        while (!c->stop && c->passes == seen)
            pthread_cond_wait(&c->go, &c->lock);
        const int stop = c->stop;
        seen = c->passes;
        pthread_mutex_unlock(&c->lock);
        if (stop)
            return NULL;
        const int status = rank_graphed(c->f, a.rank);
        pthread_mutex_lock(&c->lock);
        c->status[a.rank] = status;
        if (status != LLMEM_OK)
            snprintf(c->error[a.rank], sizeof(c->error[a.rank]), "%s", llmem_last_error());
        if (--c->running == 0)
            pthread_cond_signal(&c->done);
        pthread_mutex_unlock(&c->lock);
    }
}

static void crew_free(struct crew *c) {
    if (c == NULL)
        return;
    pthread_mutex_lock(&c->lock);
    c->stop = 1;
    pthread_cond_broadcast(&c->go);
    pthread_mutex_unlock(&c->lock);
    for (int i = 0; i < c->n; i++)
        pthread_join(c->threads[i], NULL);
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->go);
    pthread_cond_destroy(&c->done);
    pthread_barrier_destroy(&c->met);
    free(c);
}

static int crew_create(struct llmem_forward *f, struct crew **out) {
    struct crew *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    c->f = f;
    if (pthread_barrier_init(&c->met, NULL, (unsigned)f->group.n) != 0) {
        free(c);
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->go, NULL);
    pthread_cond_init(&c->done, NULL);
    for (int r = 1; r < f->group.n; r++) {
        struct crew_arg *a = malloc(sizeof(*a));
        if (a != NULL)
            *a = (struct crew_arg){c, r};
        if (a == NULL || pthread_create(&c->threads[c->n], NULL, crew_thread, a) != 0) {
            free(a);
            crew_free(c);
            LLMEM_ERROR("cannot start the thread of rank %d", r);
            return LLMEM_EIO;
        }
        c->n++;
    }
    *out = c;
    return LLMEM_OK;
}

/* The layers and the logits rows of the pass (f->pass) whose cache lengths already cover it: a
 * group of one's on the caller's thread, a split's ranks each on its own (rank 0's the caller's).
 */
static int run_pass(struct llmem_forward *f) {
    if (f->group.n == 1)
        return rank_graphed(f, 0);
    struct crew *c = f->crew;
    pthread_mutex_lock(&c->lock);
    c->passes++;
    c->running = c->n;
    pthread_cond_broadcast(&c->go);
    pthread_mutex_unlock(&c->lock);
    int status = rank_graphed(f, 0);
    pthread_mutex_lock(&c->lock);
    while (c->running > 0)
        pthread_cond_wait(&c->done, &c->lock);
    for (int r = 1; r < f->group.n && status == LLMEM_OK; r++)
        if ((status = c->status[r]) != LLMEM_OK) /* its message, the caller's to report */
            llmem_log_set_last_error(c->error[r]);
    pthread_mutex_unlock(&c->lock);
    return status;
}

/* The logits rows of the last pass (rows of them) into the caller's host memory: from the
 * device, or from each rank its share's columns. */
static int fetch_logits(struct llmem_forward *f, float *logits, int64_t rows) {
    const int64_t vocab = f->model->cfg.geom.vocab_size;
    if (f->group.n == 1) {
        const struct rank *R = &f->ranks[0];
        return R->be->ops->copy(R->be->ctx, logits, R->dev_logits,
                                (size_t)(rows * vocab) * sizeof(float));
    }
    int status = LLMEM_OK;
    for (int r = 0; r < f->group.n; r++) {
        const struct rank *R = enter(f, r);
        const struct llmem_backend_ops *ops = R->be->ops;
        const int64_t width = R->model->lm_head.rows;
        float *dst = logits + R->model->vocab_first;
        if (ops->copy_out != NULL) { /* one pitched copy, waited for below */
            ops->copy_out(R->be->ctx, dst, (size_t)vocab * sizeof(float), R->dev_logits,
                          (size_t)width * sizeof(float), (size_t)width * sizeof(float),
                          (size_t)rows);
            continue;
        }
        for (int64_t i = 0; status == LLMEM_OK && i < rows; i++)
            status = ops->copy(R->be->ctx, dst + i * vocab, R->dev_logits + i * width,
                               (size_t)width * sizeof(float));
    }
    for (int r = 0; r < f->group.n; r++) {
        const struct rank *R = enter(f, r);
        int st = R->be->ops->copy_out != NULL ? R->be->ops->copy_out_wait(R->be->ctx) : LLMEM_OK;
        status = status != LLMEM_OK ? status : st;
    }
    return status;
}

/* Whether the pass's decode steps may be graphs: on a device, a group of one or a split whose
 * ranks' threads record their sums too. */
static int graphs(const struct llmem_forward *f) {
    return f->model->on_device && f->be->ops->graph_begin != NULL &&
           (f->group.n == 1 || f->group.graphs);
}

int llmem_forward_replays(const struct llmem_forward *f, int n_seqs) {
    int ready = graphs(f) && llmem_kv_blocks_free(f->kv) >= n_seqs;
    for (int r = 0; ready && r < f->group.n; r++) {
        const struct llmem_backend *be = f->ranks[r].be;
        ready = be->ops->graph_want(be->ctx, (uint64_t)n_seqs) == LLMEM_GRAPH_REPLAY;
    }
    return ready;
}

int llmem_forward_has_top(const struct llmem_forward *f) {
    int top = f->model->on_device;
    for (int r = 0; r < f->group.n; r++) /* (of a split: every rank its share's) */
        top &= f->ranks[r].be->ops->top_k != NULL &&
               (f->group.n == 1 || f->ranks[r].model->lm_head.rows >= LLMEM_TOP_K_MAX);
    return top;
}

int llmem_forward_has_next(const struct llmem_forward *f) {
    return f->group.n == 1 && llmem_forward_has_top(f) && f->be->ops->top_k_wait != NULL &&
           f->be->ops->embedding_top != NULL;
}

/* The top k of each of `rows` rows from the ranks' top k of their shares (each by value
 * descending, equal values by the lower id): the same order over the whole vocabulary, where a
 * lower rank's ids are the lower. */
static void merge_top(const struct llmem_forward *f, int64_t rows, int k, int32_t *ids,
                      float *vals) {
    const int n = f->group.n;
    for (int64_t i = 0; i < rows; i++) {
        int at[n];
        memset(at, 0, sizeof(at));
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int r = 0; r < n; r++)
                if (at[r] < k && (best < 0 || f->ranks[r].top_vals[i * k + at[r]] >
                                                  f->ranks[best].top_vals[i * k + at[best]]))
                    best = r;
            const struct rank *R = &f->ranks[best];
            ids[i * k + j] = (int32_t)(R->top_ids[i * k + at[best]] + R->model->vocab_first);
            vals[i * k + j] = R->top_vals[i * k + at[best]];
            at[best]++;
        }
    }
}

/* Sequences back at the lengths they had before a pass. */
static void restore_lengths(struct llmem_forward *f, int n_seqs, const int *seq_ids,
                            const int64_t *lengths) {
    for (int s = 0; s < n_seqs; s++)
        llmem_kv_set_length(f->kv, seq_ids[s], lengths[s]);
}

/* llmem_forward_run (start 0) and llmem_forward_start (1), or llmem_forward_start_top with
 * k > 0; a pass started on a device returns once it is queued, llmem_forward_wait then waiting
 * for it; tokens NULL: llmem_forward_start_next's. */
static int forward(struct llmem_forward *f, const int32_t *tokens,
                   const struct llmem_batch_seq *seqs, int n_seqs, float *logits, int start, int k,
                   int32_t *ids, float *vals) {
    const struct llmem_model_geometry *g = &f->model->cfg.geom;
    LLMEM_ASSERT(f->n_started == 0 || tokens == NULL); /* llmem_forward_wait first */
    int64_t T = 0, n_logits = 0;
    for (int s = 0; s < n_seqs; s++) {
        const struct llmem_batch_seq *b = &seqs[s];
        if (b->n_tokens <= 0 || b->pos < 0 || b->pos > llmem_kv_seq_length(f->kv, b->seq)) {
            LLMEM_ERROR("sequence %d: %" PRId64 " tokens at position %" PRId64
                        " (the sequence holds %" PRId64 ")",
                        b->seq, b->n_tokens, b->pos, llmem_kv_seq_length(f->kv, b->seq));
            return LLMEM_EINVAL;
        }
        T += b->n_tokens;
        n_logits += b->all_logits ? b->n_tokens : 1;
    }
    if (T == 0 || T > f->max_tokens) {
        LLMEM_ERROR("a batch of %" PRId64 " tokens; this pass takes 1 to %" PRId64, T,
                    f->max_tokens);
        return LLMEM_EINVAL;
    }
    for (int64_t t = 0; tokens != NULL && t < T; t++) {
        if (tokens[t] < 0 || tokens[t] >= g->vocab_size) {
            LLMEM_ERROR("token id %d is outside the vocabulary (0 to %" PRId64 ")", tokens[t],
                        g->vocab_size - 1);
            return LLMEM_EINVAL;
        }
    }

    /* Room in the cache first: the only step that can run out of memory before any state
     * changes. Then the lengths cover the new tokens, so that each layer attends over them. */
    for (int s = 0; s < n_seqs; s++) {
        const struct llmem_batch_seq *b = &seqs[s];
        int64_t len = llmem_kv_seq_length(f->kv, b->seq);
        int64_t need = b->pos + b->n_tokens - len;
        if (need > 0) {
            int status = llmem_kv_reserve(f->kv, b->seq, need);
            if (status != LLMEM_OK)
                return status;
        }
    }
    for (int s = 0; s < n_seqs; s++) { /* (n_seqs ≤ T ≤ max_tokens: the arrays have room) */
        f->seq_ids[s] = seqs[s].seq;
        f->lengths[s] = llmem_kv_seq_length(f->kv, seqs[s].seq);
    }
    int64_t row = 0;
    for (int s = 0; s < n_seqs; s++) {
        for (int64_t i = 0; i < seqs[s].n_tokens; i++)
            f->pos[row + i] = seqs[s].pos + i;
        row += seqs[s].n_tokens;
        llmem_kv_set_length(f->kv, seqs[s].seq, seqs[s].pos + seqs[s].n_tokens);
    }

    /* The leading sequences of one token each (a step's decodes, each token at its sequence's end:
     * the lengths were just set to cover it) go to the cache together. */
    int decode = 1;
    for (int s = 0; s < n_seqs; s++) {
        f->n_q[s] = seqs[s].n_tokens;
        decode &= seqs[s].n_tokens == 1;
    }
    const struct llmem_backend_ops *ops = f->be->ops;
    void *ctx = f->be->ctx;
    /* the blocks the step writes made its sequences' own: the layers' cache calls then only read
     * (a split's ranks make them from their threads) */
    int status = llmem_kv_step(f->kv, n_seqs, f->seq_ids, decode ? NULL : f->n_q);
    if (status != LLMEM_OK)
        goto failed;
    /* On a device, a pure decode step may be recorded and replayed as one launch (graph_begin):
     * when every sequence could take a fresh block without the pool growing mid-pass. */
    const int graph = graphs(f) && decode && n_logits == n_seqs &&
                      llmem_kv_blocks_free(f->kv) >= n_seqs &&
                      f->host == NULL; /* a pass with host work is not one launch */
    float *dl = NULL;
    /* on a device, or from the ranks of a split: the logits there, then to the caller's host
     * memory */
    for (int r = 0; r < f->group.n && (f->model->on_device || f->group.n > 1); r++) {
        struct rank *R = &f->ranks[r];
        if (n_logits > R->dev_logits_rows) {
            llmem_mem_free(R->mem, R->dev_logits);
            R->dev_logits_rows = 0;
            R->dev_logits =
                llmem_mem_alloc(R->mem, (size_t)(n_logits * R->model->lm_head.rows) * sizeof(float),
                                LLMEM_TAG_SCRATCH);
            if (R->dev_logits == NULL) {
                status = LLMEM_ENOMEM;
                goto failed;
            }
            R->dev_logits_rows = n_logits;
        }
        dl = f->ranks[0].dev_logits;
    }
    /* a step fed from the device is recorded apart from one whose tokens come from the host */
    f->pass = (struct pass){.tokens = tokens,
                            .seqs = seqs,
                            .n_seqs = n_seqs,
                            .T = T,
                            .n_logits = n_logits,
                            .decode = decode,
                            .logits = dl != NULL ? dl : logits,
                            .graph = graph,
                            .key = (uint64_t)n_seqs | (tokens == NULL ? (uint64_t)1 << 32 : 0)};
    status = run_pass(f);
    if (status == LLMEM_OK && (k > 0 || (start && dl != NULL))) { /* llmem_forward_wait waits */
        if (k > 0 && f->group.n == 1)
            status = ops->top_k(ctx, dl, n_logits, g->vocab_size, k, ids, vals);
        for (int r = 0; k > 0 && f->group.n > 1 && status == LLMEM_OK && r < f->group.n; r++) {
            struct rank *R = enter(f, r); /* its share's top k, merged by llmem_forward_wait */
            status = R->be->ops->top_k(R->be->ctx, R->dev_logits, n_logits, R->model->lm_head.rows,
                                       k, R->top_ids, R->top_vals);
        }
        if (status == LLMEM_OK) { /* its arrays become the pass's record */
            struct started *p = &f->started[f->n_started++];
            int *si = p->seq_ids;
            int64_t *len = p->lengths;
            p->seq_ids = f->seq_ids, p->lengths = f->lengths, p->n_seqs = n_seqs, p->k = k;
            p->logits = logits, p->logit_rows = n_logits, p->ids = ids, p->vals = vals;
            f->seq_ids = si, f->lengths = len;
            return LLMEM_OK;
        }
    } else if (status == LLMEM_OK && dl != NULL) { /* and every failure of the pass */
        status = fetch_logits(f, logits, n_logits);
    }
failed:
    if (status != LLMEM_OK)
        restore_lengths(f, n_seqs, f->seq_ids, f->lengths);
    return status;
}

int llmem_forward_wait(struct llmem_forward *f) {
    if (f->n_started == 0)
        return LLMEM_OK;
    const struct llmem_backend_ops *ops = f->be->ops;
    const struct started *p = &f->started[0];
    (void)enter(f, 0);
    int status = p->k == 0          ? fetch_logits(f, p->logits, p->logit_rows)
                 : f->n_started > 1 ? ops->top_k_wait(f->be->ctx)
                                    : ops->sync(f->be->ctx);
    for (int r = 1; p->k > 0 && r < f->group.n; r++) { /* a split's other ranks, then the merge */
        const struct rank *R = enter(f, r);
        const int st = R->be->ops->sync(R->be->ctx);
        status = status != LLMEM_OK ? status : st;
    }
    if (status == LLMEM_OK && p->k > 0 && f->group.n > 1)
        merge_top(f, p->logit_rows, p->k, p->ids, p->vals);
    if (status != LLMEM_OK) { /* every pass started fails with it: the newest restored first */
        for (int i = f->n_started - 1; i >= 0; i--)
            restore_lengths(f, f->started[i].n_seqs, f->started[i].seq_ids, f->started[i].lengths);
        f->n_started = 0;
        return status;
    }
    struct started done = f->started[0];
    f->started[0] = f->started[1];
    f->started[1] = done;
    f->n_started--;
    return LLMEM_OK;
}

int llmem_forward_run(struct llmem_forward *f, const int32_t *tokens,
                      const struct llmem_batch_seq *seqs, int n_seqs, float *logits) {
    return forward(f, tokens, seqs, n_seqs, logits, 0, 0, NULL, NULL);
}

int llmem_forward_start(struct llmem_forward *f, const int32_t *tokens,
                        const struct llmem_batch_seq *seqs, int n_seqs, float *logits) {
    return forward(f, tokens, seqs, n_seqs, logits, 1, 0, NULL, NULL);
}

int llmem_forward_busy(const struct llmem_forward *f) {
    int busy = 0;
    for (int r = 0; f->n_started > 0 && r < f->group.n; r++) {
        const struct llmem_backend *be = f->ranks[r].be;
        busy |= be->ops->busy != NULL && be->ops->busy(be->ctx);
    }
    return busy;
}

int llmem_forward_start_top(struct llmem_forward *f, const int32_t *tokens,
                            const struct llmem_batch_seq *seqs, int n_seqs, int k, int32_t *ids,
                            float *vals) {
    if (!llmem_forward_has_top(f) || k < 1 || k > LLMEM_TOP_K_MAX ||
        k > f->model->cfg.geom.vocab_size) {
        LLMEM_ERROR("the top %d logits of a row: this pass selects 1 to %d on a device only", k,
                    LLMEM_TOP_K_MAX);
        return LLMEM_EINVAL;
    }
    return forward(f, tokens, seqs, n_seqs, NULL, 1, k, ids, vals);
}

int llmem_forward_start_next(struct llmem_forward *f, int32_t *ids, float *vals) {
    const struct started *p = &f->started[f->n_started > 0 ? f->n_started - 1 : 0];
    if (!llmem_forward_has_next(f) || f->n_started != 1 || p->k != 1) {
        LLMEM_ERROR("a decode step fed from the device follows one greedy pass in flight (%d "
                    "started)",
                    f->n_started);
        return LLMEM_EINVAL;
    }
    struct llmem_batch_seq seqs[p->n_seqs];
    for (int s = 0; s < p->n_seqs; s++) {
        const int seq = p->seq_ids[s];
        if (llmem_kv_seq_length(f->kv, seq) != p->lengths[s] + 1) {
            LLMEM_ERROR("sequence %d: a step fed from the device follows a pass of one token", seq);
            return LLMEM_EINVAL;
        }
        seqs[s] = (struct llmem_batch_seq){
            .seq = seq, .pos = p->lengths[s] + 1, .n_tokens = 1, .all_logits = 0};
    }
    return forward(f, NULL, seqs, p->n_seqs, NULL, 1, 1, ids, vals);
}

int llmem_forward_run_top(struct llmem_forward *f, const int32_t *tokens,
                          const struct llmem_batch_seq *seqs, int n_seqs, int k, int32_t *ids,
                          float *vals) {
    int status = llmem_forward_start_top(f, tokens, seqs, n_seqs, k, ids, vals);
    return status == LLMEM_OK ? llmem_forward_wait(f) : status;
}
