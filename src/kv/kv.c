/*
 * kv/kv.c — KV cache layouts: sequences, storage, growth, sharing, trimming (see llmem/kv.h).
 *
 * Every layout answers one question for attention and writes: where do the bytes of token `pos`
 * of layer `layer` live, and how many tokens follow contiguously (llmem_kv_span).
 *   paged       k_pool[layer] + (table[pos / bs] · bs + pos % bs) · k_tok
 *   contiguous  k_buf[layer] + pos · k_tok
 *   blocks      block[pos / bs]: [K: n_layers × bs × k_tok][V: n_layers × bs × v_tok]
 *   ragged      r_k[layer] + (seq · capacity + pos) · k_tok
 * Guarantees: every allocation happens in reserve (or in the copy-on-write of a shared block),
 * and a failed one leaves every sequence exactly as it was; a paged block's reference count is
 * the number of block tables that hold it (llmem_kv_check verifies it).
 */
#include "kv/kv_int.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend/ops.h"
#include "core/log.h"
#include "core/options.h"

static const char *const layout_names[LLMEM_KV_LAYOUT_COUNT] = {"paged", "contiguous", "blocks",
                                                                "ragged"};

const char *llmem_kv_layout_name(enum llmem_kv_layout layout) {
    return (unsigned)layout < LLMEM_KV_LAYOUT_COUNT ? layout_names[layout] : "unknown";
}

int llmem_kv_layout_parse(const char *name, enum llmem_kv_layout *layout) {
    for (int i = 0; i < LLMEM_KV_LAYOUT_COUNT; i++) {
        if (name != NULL && strcasecmp(name, layout_names[i]) == 0) {
            *layout = (enum llmem_kv_layout)i;
            return LLMEM_OK;
        }
    }
    LLMEM_ERROR("unknown KV layout '%s' (layouts: paged, contiguous, blocks, ragged)",
                name != NULL ? name : "");
    return LLMEM_EINVAL;
}

void llmem_kv_config_default(struct llmem_kv_config *c) {
    memset(c, 0, sizeof(*c));
    c->layout = LLMEM_KV_LAYOUT_PAGED;
    c->format = LLMEM_KV_FORMAT_F16;
    c->max_sequences = 64;
    c->num_blocks = 1024;
    c->dynamic = 1;
    c->step = 256;
    c->rotate = 1;
    c->seed = 0x6c6c6d656d6b76ULL;
}

int llmem_kv_config_from_env(struct llmem_kv_config *c) {
    /* Each option has no default of its own: unset, the config's value stands. The names the
     * options accept are the layouts' and formats' own, so their parsers cannot fail here. */
    const char *layout = NULL, *format = NULL;
    int64_t block_size = c->block_size;
    if (llmem_option_enum(LLMEM_OPT_KV_LAYOUT, &layout) != LLMEM_OK ||
        llmem_option_enum(LLMEM_OPT_KV_FORMAT, &format) != LLMEM_OK ||
        llmem_option_int(LLMEM_OPT_KV_BLOCK_SIZE, &block_size) != LLMEM_OK ||
        llmem_option_int(LLMEM_OPT_KV_NUM_BLOCKS, &c->num_blocks) != LLMEM_OK ||
        llmem_option_bool(LLMEM_OPT_KV_DYNAMIC, &c->dynamic) != LLMEM_OK)
        return LLMEM_EINVAL;
    if ((layout != NULL && llmem_kv_layout_parse(layout, &c->layout) != LLMEM_OK) ||
        (format != NULL && llmem_kv_format_parse(format, &c->format) != LLMEM_OK))
        return LLMEM_EINVAL;
    c->block_size = (int)block_size;
    return LLMEM_OK;
}

int64_t llmem_kv_token_bytes(const struct llmem_kv_config *c) {
    const struct llmem_kv_format_info *f = llmem_kv_format_info(c->format);
    if (f == NULL || c->head_dim % LLMEM_KV_GROUP != 0)
        return 0;
    int64_t groups = c->head_dim / LLMEM_KV_GROUP;
    return (int64_t)c->n_layers * c->n_kv_heads * groups *
           (f->key_group_bytes + f->value_group_bytes);
}

/* ---- storage helpers ----------------------------------------------------------------------------
 */

/* What llmem_kv_step prepared is gone: a call that changes a sequence or a block's sharing. */
static void step_forget(struct llmem_kv *kv) {
    kv->step_n = 0;
}

static int block_size(const struct llmem_kv *kv) {
    return kv->cfg.block_size;
}

/* The ranks a cache is split over (1: not split), and rank r's device (its first layer's). */
static int ranks_of(const struct llmem_kv *kv) {
    return kv->cfg.n_ranks > 1 ? kv->cfg.n_ranks : 1;
}

static const struct llmem_backend *rank_device(const struct llmem_kv *kv, int r) {
    return llmem_kv_layer_device(kv, r * (kv->cfg.n_layers / ranks_of(kv)));
}

/* Storage of layer l (the blocks layout's blocks, all layers: l 0). */
static uint8_t *kv_alloc(struct llmem_kv *kv, int l, size_t bytes) {
    struct llmem_mem *mem = llmem_kv_layer_mem(kv, l);
    uint8_t *p = llmem_mem_alloc(mem, bytes, LLMEM_TAG_KV);
    if (p != NULL)
        kv->st.bytes += (int64_t)llmem_mem_alloc_size(mem, bytes, LLMEM_TAG_KV);
    return p;
}

static void kv_release(struct llmem_kv *kv, int l, void *p, size_t bytes) {
    if (p == NULL)
        return;
    struct llmem_mem *mem = llmem_kv_layer_mem(kv, l);
    llmem_mem_free(mem, p);
    kv->st.bytes -= (int64_t)llmem_mem_alloc_size(mem, bytes, LLMEM_TAG_KV);
}

/* memcpy for layer l's memory: host or, with a device backend, through it. */
static void kv_copy(const struct llmem_kv *kv, int l, void *dst, const void *src, size_t bytes) {
    const struct llmem_backend *d = llmem_kv_layer_device(kv, l);
    if (d != NULL)
        d->ops->copy(d->ctx, dst, src, bytes); /* a failure is the backend's, reported at sync */
    else
        memcpy(dst, src, bytes);
}

/* The bytes of one block in the blocks layout (all layers, K then V). */
static size_t blocks_block_bytes(const struct llmem_kv *kv) {
    return (size_t)kv->cfg.n_layers * (size_t)block_size(kv) * (kv->k_tok + kv->v_tok);
}

int64_t llmem_kv_span(const struct llmem_kv *kv, int seq, int layer, int64_t pos, uint8_t **k,
                      uint8_t **v) {
    const struct kv_seq *s = &kv->seqs[seq];
    int64_t bs = block_size(kv), off = pos % bs;
    switch (kv->cfg.layout) {
    case LLMEM_KV_LAYOUT_PAGED: {
        int64_t slot = s->table[pos / bs] * bs + off;
        *k = kv->k_pool[layer] + (size_t)slot * kv->k_tok;
        *v = kv->v_pool[layer] + (size_t)slot * kv->v_tok;
        return bs - off;
    }
    case LLMEM_KV_LAYOUT_BLOCKS: {
        uint8_t *b = (uint8_t *)(uintptr_t)s->table[pos / bs];
        size_t k_part = (size_t)kv->cfg.n_layers * (size_t)bs * kv->k_tok;
        *k = b + ((size_t)layer * (size_t)bs + (size_t)off) * kv->k_tok;
        *v = b + k_part + ((size_t)layer * (size_t)bs + (size_t)off) * kv->v_tok;
        return bs - off;
    }
    case LLMEM_KV_LAYOUT_CONTIGUOUS:
        *k = s->k_buf[layer] + (size_t)pos * kv->k_tok;
        *v = s->v_buf[layer] + (size_t)pos * kv->v_tok;
        return s->capacity - pos;
    default: {
        size_t row = (size_t)seq * (size_t)kv->ragged_cap + (size_t)pos;
        *k = kv->r_k[layer] + row * kv->k_tok;
        *v = kv->r_v[layer] + row * kv->v_tok;
        return kv->ragged_cap - pos;
    }
    }
}

/* ---- paged pool
 * ----------------------------------------------------------------------------------- */

/* Device pools: the work queued after this waits for the copies of
 * llmem_kv_blocks_copy_out_async queued before it (before a block they read is written again, or
 * a pool they read is let go). The blocks they read are held until they are queued; one freed
 * since (refcount 0) may be given out again, so the next pool_take fences (take_fence). */
static void copies_fence(struct llmem_kv *kv) {
    if (kv->copies_pending) {
        for (int r = 0; r < ranks_of(kv); r++) {
            const struct llmem_backend *d = rank_device(kv, r);
            d->ops->copy_out_fence(d->ctx);
        }
        kv->copies_pending = 0;
    }
    kv->take_fence = 0;
}

/* Grows the pool to at least `required` blocks (×1.5 steps, clamped to max_blocks). */
static int pool_grow(struct llmem_kv *kv, int64_t required) {
    int64_t cur = kv->n_blocks, max = kv->cfg.max_blocks > 0 ? kv->cfg.max_blocks : INT32_MAX;
    int64_t next = cur + (cur + 1) / 2;
    if (next < required)
        next = required;
    if (next > max)
        next = max;
    if (!kv->cfg.dynamic || next < required) {
        LLMEM_ERROR_AS("llmem_kv_reserve", "the paged pool needs %lld blocks but holds %lld%s",
                       (long long)required, (long long)cur,
                       kv->cfg.dynamic ? " and max_blocks stops it there" : " and growth is off");
        return LLMEM_ERANGE;
    }
    int n_layers = kv->cfg.n_layers, bs = block_size(kv);
    uint8_t **nk = calloc((size_t)n_layers, sizeof(*nk)),
            **nv = calloc((size_t)n_layers, sizeof(*nv));
    int32_t *rc = realloc(NULL, (size_t)next * sizeof(*rc));
    int32_t *hd = calloc((size_t)next, sizeof(*hd));
    int64_t *fr = realloc(NULL, (size_t)next * sizeof(*fr));
    int status = (nk && nv && rc && hd && fr) ? LLMEM_OK : LLMEM_ENOMEM;
    for (int l = 0; status == LLMEM_OK && l < n_layers; l++) {
        nk[l] = kv_alloc(kv, l, (size_t)next * (size_t)bs * kv->k_tok);
        nv[l] = kv_alloc(kv, l, (size_t)next * (size_t)bs * kv->v_tok);
        if (nk[l] == NULL || nv[l] == NULL)
            status = LLMEM_ENOMEM;
    }
    if (status != LLMEM_OK) {
        for (int l = 0; nk && nv && l < n_layers; l++) {
            kv_release(kv, l, nk[l], (size_t)next * (size_t)bs * kv->k_tok);
            kv_release(kv, l, nv[l], (size_t)next * (size_t)bs * kv->v_tok);
        }
        free(nk), free(nv), free(rc), free(hd), free(fr);
        LLMEM_ERROR_AS("llmem_kv_reserve", "cannot grow the paged pool from %lld to %lld blocks",
                       (long long)cur, (long long)next);
        return LLMEM_ENOMEM;
    }
    copies_fence(kv);
    for (int l = 0; l < n_layers; l++) {
        if (cur > 0) {
            kv_copy(kv, l, nk[l], kv->k_pool[l], (size_t)cur * (size_t)bs * kv->k_tok);
            kv_copy(kv, l, nv[l], kv->v_pool[l], (size_t)cur * (size_t)bs * kv->v_tok);
        }
        if (kv->k_pool != NULL) {
            kv_release(kv, l, kv->k_pool[l], (size_t)cur * (size_t)bs * kv->k_tok);
            kv_release(kv, l, kv->v_pool[l], (size_t)cur * (size_t)bs * kv->v_tok);
        }
    }
    if (cur > 0) {
        memcpy(rc, kv->refcount, (size_t)cur * sizeof(*rc));
        memcpy(hd, kv->held, (size_t)cur * sizeof(*hd));
    }
    if (kv->n_free > 0)
        memcpy(fr, kv->free_ids, (size_t)kv->n_free * sizeof(*fr));
    /* New ids go on the stack so that the lowest is handed out first. */
    for (int64_t id = next - 1; id >= cur; id--) {
        rc[id] = 0;
        fr[kv->n_free++] = id;
    }
    free(kv->k_pool), free(kv->v_pool), free(kv->refcount), free(kv->held), free(kv->free_ids);
    kv->k_pool = nk, kv->v_pool = nv, kv->refcount = rc, kv->held = hd, kv->free_ids = fr;
    if (cur > 0)
        kv->st.grow_events++;
    kv->n_blocks = next;
    return LLMEM_OK;
}

static int64_t pool_take(struct llmem_kv *kv) {
    if (kv->take_fence)
        copies_fence(kv);
    int64_t id = kv->free_ids[--kv->n_free];
    kv->refcount[id] = 1;
    return id;
}

static void pool_unref(struct llmem_kv *kv, int64_t id) {
    LLMEM_ASSERT(kv->refcount[id] > 0);
    if (--kv->refcount[id] == 0) {
        kv->free_ids[kv->n_free++] = id;
        kv->take_fence |= kv->copies_pending;
    }
}

static int table_reserve(struct kv_seq *s, int64_t n) {
    if (n <= s->cap_table)
        return LLMEM_OK;
    int64_t cap = s->cap_table ? s->cap_table : 16;
    while (cap < n)
        cap *= 2;
    int64_t *t = realloc(s->table, (size_t)cap * sizeof(*t));
    if (t == NULL)
        return LLMEM_ENOMEM;
    s->table = t;
    s->cap_table = cap;
    return LLMEM_OK;
}

/* ---- per-layout growth
 * ------------------------------------------------------------------------------ */

static int64_t round_up(int64_t n, int64_t step) {
    return (n + step - 1) / step;
}

static int reserve_paged(struct llmem_kv *kv, struct kv_seq *s, int64_t need) {
    int64_t bs = block_size(kv), want = round_up(need, bs);
    int64_t more = want - s->n_table;
    if (more <= 0)
        return LLMEM_OK;
    if (table_reserve(s, want) != LLMEM_OK) {
        LLMEM_ERROR_AS("llmem_kv_reserve", "out of memory for a block table of %lld",
                       (long long)want);
        return LLMEM_ENOMEM;
    }
    if (kv->n_free < more) {
        int status = pool_grow(kv, kv->n_blocks - kv->n_free + more);
        if (status != LLMEM_OK)
            return status;
    }
    while (s->n_table < want)
        s->table[s->n_table++] = pool_take(kv);
    s->capacity = s->n_table * bs;
    return LLMEM_OK;
}

static int reserve_blocks(struct llmem_kv *kv, struct kv_seq *s, int64_t need) {
    int64_t bs = block_size(kv), want = round_up(need, bs);
    if (want <= s->n_table)
        return LLMEM_OK;
    if (table_reserve(s, want) != LLMEM_OK) {
        LLMEM_ERROR_AS("llmem_kv_reserve", "out of memory for a block list of %lld",
                       (long long)want);
        return LLMEM_ENOMEM;
    }
    int64_t first = s->n_table;
    while (s->n_table < want) {
        uint8_t *b = kv_alloc(kv, 0, blocks_block_bytes(kv));
        if (b == NULL) {
            while (s->n_table > first)
                kv_release(kv, 0, (void *)(uintptr_t)s->table[--s->n_table],
                           blocks_block_bytes(kv));
            LLMEM_ERROR_AS("llmem_kv_reserve", "cannot allocate a block of %zu bytes",
                           blocks_block_bytes(kv));
            return LLMEM_ENOMEM;
        }
        s->table[s->n_table++] = (int64_t)(uintptr_t)b;
    }
    s->capacity = s->n_table * bs;
    return LLMEM_OK;
}

static int reserve_contiguous(struct llmem_kv *kv, struct kv_seq *s, int64_t need) {
    if (need <= s->capacity)
        return LLMEM_OK;
    int n_layers = kv->cfg.n_layers;
    int64_t cap = (int64_t)round_up(need, kv->cfg.step) * kv->cfg.step;
    uint8_t **nk = calloc((size_t)n_layers, sizeof(*nk)),
            **nv = calloc((size_t)n_layers, sizeof(*nv));
    int ok = nk != NULL && nv != NULL;
    for (int l = 0; ok && l < n_layers; l++) {
        nk[l] = kv_alloc(kv, l, (size_t)cap * kv->k_tok);
        nv[l] = kv_alloc(kv, l, (size_t)cap * kv->v_tok);
        ok = nk[l] != NULL && nv[l] != NULL;
    }
    if (!ok) {
        for (int l = 0; nk && nv && l < n_layers; l++) {
            kv_release(kv, l, nk[l], (size_t)cap * kv->k_tok);
            kv_release(kv, l, nv[l], (size_t)cap * kv->v_tok);
        }
        free(nk), free(nv);
        LLMEM_ERROR_AS("llmem_kv_reserve", "cannot grow a sequence to %lld tokens", (long long)cap);
        return LLMEM_ENOMEM;
    }
    for (int l = 0; l < n_layers; l++) {
        if (s->k_buf != NULL) {
            memcpy(nk[l], s->k_buf[l], (size_t)s->length * kv->k_tok);
            memcpy(nv[l], s->v_buf[l], (size_t)s->length * kv->v_tok);
            kv_release(kv, l, s->k_buf[l], (size_t)s->capacity * kv->k_tok);
            kv_release(kv, l, s->v_buf[l], (size_t)s->capacity * kv->v_tok);
        }
    }
    if (s->k_buf != NULL)
        kv->st.grow_events++;
    free(s->k_buf), free(s->v_buf);
    s->k_buf = nk, s->v_buf = nv;
    s->capacity = cap;
    return LLMEM_OK;
}

/* Ragged: every row shares one capacity; growing moves every row. */
static int ragged_resize(struct llmem_kv *kv, int64_t cap) {
    int n_layers = kv->cfg.n_layers, rows = kv->cfg.max_sequences;
    uint8_t **nk = calloc((size_t)n_layers, sizeof(*nk)),
            **nv = calloc((size_t)n_layers, sizeof(*nv));
    int ok = nk != NULL && nv != NULL;
    for (int l = 0; ok && l < n_layers; l++) {
        nk[l] = kv_alloc(kv, l, (size_t)rows * (size_t)cap * kv->k_tok);
        nv[l] = kv_alloc(kv, l, (size_t)rows * (size_t)cap * kv->v_tok);
        ok = nk[l] != NULL && nv[l] != NULL;
    }
    int64_t old = kv->ragged_cap;
    if (!ok) {
        for (int l = 0; nk && nv && l < n_layers; l++) {
            kv_release(kv, l, nk[l], (size_t)rows * (size_t)cap * kv->k_tok);
            kv_release(kv, l, nv[l], (size_t)rows * (size_t)cap * kv->v_tok);
        }
        free(nk), free(nv);
        LLMEM_ERROR_AS("llmem_kv_reserve", "cannot grow the ragged batch to %d × %lld tokens", rows,
                       (long long)cap);
        return LLMEM_ENOMEM;
    }
    for (int l = 0; l < n_layers && kv->r_k != NULL; l++) {
        for (int r = 0; r < rows; r++) {
            int64_t len = kv->seqs[r].length;
            memcpy(nk[l] + (size_t)r * (size_t)cap * kv->k_tok,
                   kv->r_k[l] + (size_t)r * (size_t)old * kv->k_tok, (size_t)len * kv->k_tok);
            memcpy(nv[l] + (size_t)r * (size_t)cap * kv->v_tok,
                   kv->r_v[l] + (size_t)r * (size_t)old * kv->v_tok, (size_t)len * kv->v_tok);
        }
        kv_release(kv, l, kv->r_k[l], (size_t)rows * (size_t)old * kv->k_tok);
        kv_release(kv, l, kv->r_v[l], (size_t)rows * (size_t)old * kv->v_tok);
    }
    if (kv->r_k != NULL)
        kv->st.grow_events++;
    free(kv->r_k), free(kv->r_v);
    kv->r_k = nk, kv->r_v = nv;
    kv->ragged_cap = cap;
    for (int r = 0; r < rows; r++)
        kv->seqs[r].capacity = cap;
    return LLMEM_OK;
}

static int reserve_ragged(struct llmem_kv *kv, int64_t need) {
    if (need <= kv->ragged_cap)
        return LLMEM_OK;
    if (kv->frozen) {
        LLMEM_ERROR_AS("llmem_kv_reserve",
                       "%lld tokens do not fit the frozen ragged capacity of %lld", (long long)need,
                       (long long)kv->ragged_cap);
        return LLMEM_ERANGE;
    }
    return ragged_resize(kv, (int64_t)round_up(need, kv->cfg.step) * kv->cfg.step);
}

/* ---- the public functions
 * --------------------------------------------------------------------------- */

int llmem_kv_create(const struct llmem_kv_config *config, struct llmem_mem *mem,
                    struct llmem_kv **out) {
    struct llmem_kv_config c = *config;
    if (c.block_size <= 0)
        c.block_size = c.layout == LLMEM_KV_LAYOUT_BLOCKS ? 1024 : 16;
    if (c.step <= 0)
        c.step = 256;
    if (c.num_blocks <= 0)
        c.num_blocks = 1024;
    if (c.max_sequences <= 0)
        c.max_sequences = 64;
    if (c.n_layers <= 0 || c.n_kv_heads <= 0 || c.head_dim <= 0 ||
        (unsigned)c.layout >= LLMEM_KV_LAYOUT_COUNT) {
        LLMEM_ERROR("invalid KV geometry: %d layers, %d KV heads, head_dim %d", c.n_layers,
                    c.n_kv_heads, c.head_dim);
        return LLMEM_EINVAL;
    }
    if (c.device != NULL &&
        (c.layout != LLMEM_KV_LAYOUT_PAGED || mem == NULL || c.device->ops->kv_encode == NULL ||
         c.device->ops->kv_attend == NULL || c.device->ops->kv_attend_last == NULL)) {
        LLMEM_ERROR("a KV cache on the %s backend is paged, over the backend's memory (asked: %s)",
                    c.device->ops->name, llmem_kv_layout_name(c.layout));
        return LLMEM_EUNSUPPORTED;
    }
    if (c.n_ranks > 1 &&
        (mem == NULL || c.rank_mems == NULL || c.rank_mems[0] != mem ||
         c.n_layers % c.n_ranks != 0 || (c.device != NULL) != (c.rank_devices != NULL) ||
         (c.device != NULL && c.rank_devices[0] != c.device))) {
        LLMEM_ERROR("a KV cache split over %d ranks: their memories (and devices, on devices), "
                    "rank 0's the cache's, and a multiple of them of layers (%d)",
                    c.n_ranks, c.n_layers);
        return LLMEM_EINVAL;
    }
    if (c.max_blocks > 0 && c.num_blocks > c.max_blocks)
        c.num_blocks = c.max_blocks;
    struct llmem_kv *kv = calloc(1, sizeof(*kv));
    if (kv == NULL) {
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    kv->cfg = c;
    int status = llmem_kv_codec_init(&kv->codec, c.format, c.head_dim, c.rotate, c.seed);
    if (status != LLMEM_OK)
        goto out_free;
    kv->k_tok = (size_t)c.n_kv_heads * kv->codec.key_bytes;
    kv->v_tok = (size_t)c.n_kv_heads * kv->codec.value_bytes;
    if (c.device != NULL && (kv->codec.rotate_keys || kv->codec.rotate_values)) {
        if (c.head_dim > LLMEM_BACKEND_ROTATION_DIMS) {
            LLMEM_ERROR("a KV cache on the %s backend rotates rows of head_dim %d at most (KV "
                        "format %s, head_dim %d)",
                        c.device->ops->name, LLMEM_BACKEND_ROTATION_DIMS,
                        llmem_kv_format_name(c.format), c.head_dim);
            status = LLMEM_EUNSUPPORTED;
            goto out_free;
        }
        kv->rotation.keys = kv->codec.rotate_keys;
        kv->rotation.values = kv->codec.rotate_values;
        kv->rotation.norm = llmem_kv_rotation_norm(c.head_dim);
        for (int i = 0; i < c.head_dim; i++)
            if (kv->codec.signs[i] < 0)
                kv->rotation.neg[i / 32] |= 1u << (i % 32);
    }
    kv->mem = mem;
    if (mem == NULL) {
        /* A cache of 16 MiB keeps attention's per-call workspace (about 1 MiB at 32K tokens)
         * from going back to the OS, and being faulted in again, on every call. */
        struct llmem_mem_config mc = {.cache_limit_bytes = (int64_t)16 << 20};
        if ((status = llmem_mem_create(&mc, &kv->mem)) != LLMEM_OK)
            goto out_free;
        kv->own_mem = 1;
    }
    const size_t seqs = (size_t)c.max_sequences;
    kv->seqs = calloc(seqs, sizeof(*kv->seqs));
    kv->step_seqs = malloc(seqs * sizeof(*kv->step_seqs));
    kv->step_lengths = malloc(seqs * sizeof(*kv->step_lengths));
    kv->step_n_q = malloc(seqs * sizeof(*kv->step_n_q));
    if (c.device != NULL)
        kv->step_blocks = malloc(seqs * sizeof(*kv->step_blocks));
    if (kv->seqs == NULL || kv->step_seqs == NULL || kv->step_lengths == NULL ||
        kv->step_n_q == NULL || (c.device != NULL && kv->step_blocks == NULL)) {
        LLMEM_ERROR("out of memory");
        status = LLMEM_ENOMEM;
        goto out_free;
    }
    if (c.pool != NULL)
        kv->pool = c.pool;
    else if ((status = llmem_pool_create(c.n_threads, &kv->pool)) != LLMEM_OK)
        goto out_free;
    if (c.layout == LLMEM_KV_LAYOUT_PAGED) {
        int saved = kv->cfg.dynamic;
        kv->cfg.dynamic = 1; /* the initial pool is not growth */
        status = pool_grow(kv, c.num_blocks);
        kv->cfg.dynamic = saved;
        if (status != LLMEM_OK)
            goto out_free;
    }
    kv->st.n_blocks = kv->n_blocks;
    *out = kv;
    return LLMEM_OK;
out_free:
    llmem_kv_destroy(kv);
    return status;
}

void llmem_kv_destroy(struct llmem_kv *kv) {
    if (kv == NULL)
        return;
    for (int i = 0; kv->seqs != NULL && i < kv->cfg.max_sequences; i++)
        if (kv->seqs[i].used)
            llmem_kv_seq_free(kv, i);
    if (kv->copies_pending) /* the pools stay until the copies that read them are done */
        (void)llmem_kv_copies_wait(kv);
    for (int l = 0; l < kv->cfg.n_layers; l++) {
        size_t bs = (size_t)block_size(kv), n = (size_t)kv->n_blocks;
        if (kv->k_pool != NULL) {
            kv_release(kv, l, kv->k_pool[l], n * bs * kv->k_tok);
            kv_release(kv, l, kv->v_pool[l], n * bs * kv->v_tok);
        }
        size_t rows = (size_t)kv->cfg.max_sequences, cap = (size_t)kv->ragged_cap;
        if (kv->r_k != NULL) {
            kv_release(kv, l, kv->r_k[l], rows * cap * kv->k_tok);
            kv_release(kv, l, kv->r_v[l], rows * cap * kv->v_tok);
        }
    }
    free(kv->k_pool), free(kv->v_pool), free(kv->refcount), free(kv->held), free(kv->free_ids);
    free(kv->r_k), free(kv->r_v);
    free(kv->seqs);
    free(kv->step_seqs), free(kv->step_lengths), free(kv->step_n_q), free(kv->step_blocks);
    free(kv->step_slots), free(kv->slots);
    if (kv->pool != kv->cfg.pool)
        llmem_pool_destroy(kv->pool);
    if (kv->own_mem)
        llmem_mem_destroy(kv->mem);
    free(kv);
}

int llmem_kv_seq_new(struct llmem_kv *kv, int *seq) {
    for (int i = 0; i < kv->cfg.max_sequences; i++) {
        struct kv_seq *s = &kv->seqs[i];
        if (!s->used) {
            memset(s, 0, sizeof(*s));
            s->used = 1;
            s->capacity = kv->cfg.layout == LLMEM_KV_LAYOUT_RAGGED ? kv->ragged_cap : 0;
            kv->st.n_sequences++;
            *seq = i;
            return LLMEM_OK;
        }
    }
    LLMEM_ERROR("all %d sequences are in use", kv->cfg.max_sequences);
    return LLMEM_ERANGE;
}

static struct kv_seq *get_seq(struct llmem_kv *kv, int seq) {
    LLMEM_ASSERT(seq >= 0 && seq < kv->cfg.max_sequences && kv->seqs[seq].used);
    return &kv->seqs[seq];
}

int64_t llmem_kv_seq_length(const struct llmem_kv *kv, int seq) {
    return get_seq((struct llmem_kv *)kv, seq)->length;
}

/* Releases storage past `keep` tokens (whole blocks only). */
static void release_tail(struct llmem_kv *kv, struct kv_seq *s, int64_t keep) {
    int64_t bs = block_size(kv), blocks = round_up(keep, bs);
    if (kv->cfg.layout == LLMEM_KV_LAYOUT_PAGED) {
        while (s->n_table > blocks)
            pool_unref(kv, s->table[--s->n_table]);
        s->capacity = s->n_table * bs;
    } else if (kv->cfg.layout == LLMEM_KV_LAYOUT_BLOCKS) {
        while (s->n_table > blocks)
            kv_release(kv, 0, (void *)(uintptr_t)s->table[--s->n_table], blocks_block_bytes(kv));
        s->capacity = s->n_table * bs;
    }
}

void llmem_kv_seq_free(struct llmem_kv *kv, int seq) {
    step_forget(kv);
    struct kv_seq *s = get_seq(kv, seq);
    release_tail(kv, s, 0);
    if (kv->cfg.layout == LLMEM_KV_LAYOUT_CONTIGUOUS && s->k_buf != NULL) {
        for (int l = 0; l < kv->cfg.n_layers; l++) {
            kv_release(kv, l, s->k_buf[l], (size_t)s->capacity * kv->k_tok);
            kv_release(kv, l, s->v_buf[l], (size_t)s->capacity * kv->v_tok);
        }
    }
    free(s->k_buf), free(s->v_buf), free(s->table);
    memset(s, 0, sizeof(*s));
    kv->st.n_sequences--;
}

int llmem_kv_reserve(struct llmem_kv *kv, int seq, int64_t n) {
    step_forget(kv);
    struct kv_seq *s = get_seq(kv, seq);
    LLMEM_ASSERT(n >= 0);
    int64_t need = s->length + n;
    switch (kv->cfg.layout) {
    case LLMEM_KV_LAYOUT_PAGED: return reserve_paged(kv, s, need);
    case LLMEM_KV_LAYOUT_BLOCKS: return reserve_blocks(kv, s, need);
    case LLMEM_KV_LAYOUT_CONTIGUOUS: return reserve_contiguous(kv, s, need);
    default: return reserve_ragged(kv, need);
    }
}

/* Paged: gives the sequence its own copy of every shared block in [first, last]. */
static int unshare_blocks(struct llmem_kv *kv, struct kv_seq *s, int64_t first, int64_t last) {
    int64_t shared = 0;
    for (int64_t b = first; b <= last; b++)
        shared += kv->refcount[s->table[b]] > 1;
    if (shared == 0)
        return LLMEM_OK;
    if (kv->n_free < shared) {
        int status = pool_grow(kv, kv->n_blocks - kv->n_free + shared);
        if (status != LLMEM_OK)
            return status;
    }
    size_t bs = (size_t)block_size(kv);
    for (int64_t b = first; b <= last; b++) {
        int64_t old = s->table[b];
        if (kv->refcount[old] <= 1)
            continue;
        int64_t id = pool_take(kv);
        for (int l = 0; l < kv->cfg.n_layers; l++) {
            kv_copy(kv, l, kv->k_pool[l] + (size_t)id * bs * kv->k_tok,
                    kv->k_pool[l] + (size_t)old * bs * kv->k_tok, bs * kv->k_tok);
            kv_copy(kv, l, kv->v_pool[l] + (size_t)id * bs * kv->v_tok,
                    kv->v_pool[l] + (size_t)old * bs * kv->v_tok, bs * kv->v_tok);
        }
        pool_unref(kv, old);
        s->table[b] = id;
        kv->st.cow_copies++;
    }
    return LLMEM_OK;
}

/* Host memory for n slot numbers in *slots (LLMEM_ENOMEM logged when it cannot grow). */
static int64_t *slots_room(int64_t **slots, int64_t *cap, int64_t n) {
    if (n > *cap) {
        int64_t *p = realloc(*slots, (size_t)n * sizeof(int64_t));
        if (p == NULL) {
            LLMEM_ERROR("out of memory");
            return NULL;
        }
        *slots = p, *cap = n;
    }
    return *slots;
}

/* Paged: the pool slot (block · block_size + offset) of a sequence's position. */
static int64_t slot_of(const struct llmem_kv *kv, const struct kv_seq *s, int64_t pos) {
    const int64_t bs = block_size(kv);
    return s->table[pos / bs] * bs + pos % bs;
}

/* n tokens of one layer (k, v [n, n_kv_heads, head_dim], device memory) into their pool slots,
 * on the device; counted as one write. */
static void encode_slots(struct llmem_kv *kv, int layer, const float *k, const float *v, int64_t n,
                         const int64_t *slots) {
    const struct llmem_backend *d = llmem_kv_layer_device(kv, layer);
    d->ops->kv_encode(d->ctx, kv->cfg.format, llmem_kv_device_rotation(kv), k, v, n,
                      kv->cfg.n_kv_heads, kv->cfg.head_dim, slots, kv->k_pool[layer],
                      kv->v_pool[layer], kv->codec.key_bytes, kv->codec.value_bytes);
    KV_COUNT(kv, updates, 1);
    KV_COUNT(kv, bytes_written, n * (int64_t)(kv->k_tok + kv->v_tok));
}

int llmem_kv_step(struct llmem_kv *kv, int n, const int *seqs, const int64_t *n_q) {
    LLMEM_ASSERT(n >= 0 && n <= kv->cfg.max_sequences);
    step_forget(kv);
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        struct kv_seq *s = get_seq(kv, seqs[i]);
        const int64_t m = n_q != NULL ? n_q[i] : 1, pos = s->length - m;
        LLMEM_ASSERT(m >= 1 && pos >= 0);
        if (kv->cfg.layout == LLMEM_KV_LAYOUT_PAGED) {
            const int64_t bs = block_size(kv);
            int status = unshare_blocks(kv, s, pos / bs, (pos + m - 1) / bs);
            if (status != LLMEM_OK)
                return status;
        }
        total += m;
    }
    int64_t *slots =
        kv->cfg.device != NULL ? slots_room(&kv->step_slots, &kv->step_slots_cap, total) : NULL;
    if (kv->cfg.device != NULL && slots == NULL)
        return LLMEM_ENOMEM;
    for (int i = 0, at = 0; i < n; i++) {
        const struct kv_seq *s = get_seq(kv, seqs[i]);
        kv->step_seqs[i] = seqs[i];
        kv->step_lengths[i] = s->length;
        kv->step_n_q[i] = n_q != NULL ? n_q[i] : 1;
        if (slots == NULL)
            continue;
        kv->step_blocks[i] = s->table;
        for (int64_t pos = s->length - (n_q != NULL ? n_q[i] : 1); pos < s->length; pos++)
            slots[at++] = slot_of(kv, s, pos);
    }
    kv->step_n = n;
    kv->step_tokens = total;
    return LLMEM_OK;
}

int llmem_kv_step_is(const struct llmem_kv *kv, int n, const int *seqs, const int64_t *n_q) {
    int same = n == kv->step_n;
    for (int i = 0; same && i < n; i++)
        same = seqs[i] == kv->step_seqs[i] &&
               kv->step_lengths[i] == llmem_kv_seq_length(kv, seqs[i]) &&
               kv->step_n_q[i] == (n_q != NULL ? n_q[i] : 1);
    return same;
}

int llmem_kv_write_last(struct llmem_kv *kv, int n, const int *seqs, const int64_t *n_q, int layer,
                        const float *k, const float *v) {
    LLMEM_ASSERT(layer >= 0 && layer < kv->cfg.n_layers && llmem_kv_step_is(kv, n, seqs, n_q));
    if (kv->cfg.device != NULL) {
        encode_slots(kv, layer, k, v, kv->step_tokens, kv->step_slots);
        return LLMEM_OK;
    }
    const size_t row = (size_t)kv->cfg.n_kv_heads * (size_t)kv->cfg.head_dim;
    size_t at = 0;
    for (int i = 0; i < n; i++) { /* (the blocks written are the sequence's own since the step) */
        const int64_t m = n_q != NULL ? n_q[i] : 1;
        int status = llmem_kv_write(kv, seqs[i], layer, kv->step_lengths[i] - m, m, k + at * row,
                                    v + at * row);
        if (status != LLMEM_OK)
            return status;
        at += (size_t)m;
    }
    return LLMEM_OK;
}

int llmem_kv_write(struct llmem_kv *kv, int seq, int layer, int64_t pos, int64_t n, const float *k,
                   const float *v) {
    struct kv_seq *s = get_seq(kv, seq);
    LLMEM_ASSERT(layer >= 0 && layer < kv->cfg.n_layers && pos >= 0 && n >= 0);
    LLMEM_ASSERT(pos + n <= s->capacity && pos <= s->length);
    if (n == 0)
        return LLMEM_OK;
    if (kv->cfg.layout == LLMEM_KV_LAYOUT_PAGED) {
        int64_t bs = block_size(kv);
        int status = unshare_blocks(kv, s, pos / bs, (pos + n - 1) / bs);
        if (status != LLMEM_OK)
            return status;
    }
    const int heads = kv->cfg.n_kv_heads, hd = kv->cfg.head_dim;
    if (kv->cfg.device != NULL) { /* every token to its pool slot, encoded on the device */
        int64_t *slots = slots_room(&kv->slots, &kv->slots_cap, n);
        if (slots == NULL)
            return LLMEM_ENOMEM;
        for (int64_t t = 0; t < n; t++)
            slots[t] = slot_of(kv, s, pos + t);
        encode_slots(kv, layer, k, v, n, slots);
        return LLMEM_OK;
    }
    for (int64_t t = 0; t < n;) {
        uint8_t *kp, *vp;
        int64_t run = llmem_kv_span(kv, seq, layer, pos + t, &kp, &vp);
        if (run > n - t)
            run = n - t;
        for (int64_t i = 0; i < run; i++, t++) {
            for (int h = 0; h < heads; h++) {
                size_t row = ((size_t)t * (size_t)heads + (size_t)h) * (size_t)hd;
                llmem_kv_encode_key(&kv->codec, k + row,
                                    kp + (size_t)i * kv->k_tok + (size_t)h * kv->codec.key_bytes);
                llmem_kv_encode_value(&kv->codec, v + row,
                                      vp + (size_t)i * kv->v_tok +
                                          (size_t)h * kv->codec.value_bytes);
            }
        }
    }
    KV_COUNT(kv, updates, 1);
    KV_COUNT(kv, bytes_written, n * (int64_t)(kv->k_tok + kv->v_tok));
    return LLMEM_OK;
}

void llmem_kv_set_length(struct llmem_kv *kv, int seq, int64_t length) {
    struct kv_seq *s = get_seq(kv, seq);
    LLMEM_ASSERT(length >= 0 && length <= s->capacity);
    s->length = length;
}

int llmem_kv_append(struct llmem_kv *kv, int seq, int64_t n, const float *k, const float *v) {
    int status = llmem_kv_reserve(kv, seq, n);
    if (status != LLMEM_OK)
        return status;
    int64_t pos = get_seq(kv, seq)->length;
    size_t layer_floats = (size_t)n * (size_t)kv->cfg.n_kv_heads * (size_t)kv->cfg.head_dim;
    for (int l = 0; l < kv->cfg.n_layers; l++) {
        status = llmem_kv_write(kv, seq, l, pos, n, k + (size_t)l * layer_floats,
                                v + (size_t)l * layer_floats);
        if (status != LLMEM_OK)
            return status; /* only the first layer can fail (copy on write), before any write */
    }
    llmem_kv_set_length(kv, seq, pos + n);
    return LLMEM_OK;
}

void llmem_kv_trim(struct llmem_kv *kv, int seq, int64_t n) {
    step_forget(kv);
    struct kv_seq *s = get_seq(kv, seq);
    s->length = n >= s->length ? 0 : s->length - n;
    release_tail(kv, s, s->length);
}

int llmem_kv_seq_fork(struct llmem_kv *kv, int src, int *dst) {
    step_forget(kv);
    struct kv_seq *from = get_seq(kv, src);
    int status = llmem_kv_seq_new(kv, dst);
    if (status != LLMEM_OK)
        return status;
    from = &kv->seqs[src];
    struct kv_seq *to = &kv->seqs[*dst];
    if (kv->cfg.layout == LLMEM_KV_LAYOUT_PAGED) {
        int64_t blocks = round_up(from->length, block_size(kv));
        if (table_reserve(to, blocks) != LLMEM_OK) {
            llmem_kv_seq_free(kv, *dst);
            LLMEM_ERROR("out of memory for a block table");
            return LLMEM_ENOMEM;
        }
        for (int64_t b = 0; b < blocks; b++) {
            to->table[b] = from->table[b];
            kv->refcount[from->table[b]]++;
        }
        to->n_table = blocks;
        to->capacity = blocks * block_size(kv);
        to->length = from->length;
        return LLMEM_OK;
    }
    if ((status = llmem_kv_reserve(kv, *dst, from->length)) != LLMEM_OK) {
        llmem_kv_seq_free(kv, *dst);
        return status;
    }
    for (int l = 0; l < kv->cfg.n_layers; l++) {
        for (int64_t pos = 0; pos < from->length;) {
            uint8_t *sk, *sv, *dk, *dv;
            int64_t a = llmem_kv_span(kv, src, l, pos, &sk, &sv);
            int64_t b = llmem_kv_span(kv, *dst, l, pos, &dk, &dv);
            int64_t run = a < b ? a : b;
            if (run > from->length - pos)
                run = from->length - pos;
            memcpy(dk, sk, (size_t)run * kv->k_tok);
            memcpy(dv, sv, (size_t)run * kv->v_tok);
            pos += run;
        }
    }
    to->length = from->length;
    return LLMEM_OK;
}

int llmem_kv_freeze_capacity(struct llmem_kv *kv, int64_t capacity) {
    step_forget(kv);
    if (kv->cfg.layout != LLMEM_KV_LAYOUT_RAGGED) {
        LLMEM_ERROR("freeze_capacity applies to the ragged layout, not %s",
                    llmem_kv_layout_name(kv->cfg.layout));
        return LLMEM_EUNSUPPORTED;
    }
    for (int r = 0; r < kv->cfg.max_sequences; r++) {
        if (kv->seqs[r].used && kv->seqs[r].length > capacity) {
            LLMEM_ERROR("row %d holds %lld tokens, more than the capacity %lld", r,
                        (long long)kv->seqs[r].length, (long long)capacity);
            return LLMEM_ERANGE;
        }
    }
    if (capacity != kv->ragged_cap) {
        int status = ragged_resize(kv, capacity);
        if (status != LLMEM_OK)
            return status;
    }
    kv->frozen = 1;
    return LLMEM_OK;
}

void llmem_kv_stats(struct llmem_kv *kv, struct llmem_kv_stats *st) {
    *st = kv->st;
    st->tokens = 0;
    st->capacity_tokens = 0;
    for (int i = 0; i < kv->cfg.max_sequences; i++) {
        if (kv->seqs[i].used) {
            st->tokens += kv->seqs[i].length;
            st->capacity_tokens += kv->seqs[i].capacity;
        }
    }
    st->n_blocks = kv->n_blocks;
    st->n_blocks_free = kv->n_free;
    st->n_blocks_used = kv->n_blocks - kv->n_free;
    st->n_blocks_shared = 0;
    for (int64_t b = 0; b < kv->n_blocks; b++)
        st->n_blocks_shared += kv->refcount[b] > 1;
}

int llmem_kv_check(struct llmem_kv *kv) {
    int status = LLMEM_OK;
    int32_t *refs = NULL;
    int64_t bs = block_size(kv), n_used = 0;
    if (kv->cfg.layout == LLMEM_KV_LAYOUT_PAGED) {
        refs = calloc((size_t)kv->n_blocks, sizeof(*refs));
        LLMEM_INVARIANT(refs != NULL, "out of memory checking");
    }
    for (int i = 0; i < kv->cfg.max_sequences; i++) {
        const struct kv_seq *s = &kv->seqs[i];
        if (!s->used)
            continue;
        n_used++;
        LLMEM_INVARIANT(s->length >= 0 && s->length <= s->capacity,
                        "sequence %d: length %lld, capacity %lld", i, (long long)s->length,
                        (long long)s->capacity);
        if (kv->cfg.layout == LLMEM_KV_LAYOUT_PAGED || kv->cfg.layout == LLMEM_KV_LAYOUT_BLOCKS)
            LLMEM_INVARIANT(s->capacity == s->n_table * bs,
                            "sequence %d: capacity is not its blocks", i);
        if (kv->cfg.layout == LLMEM_KV_LAYOUT_RAGGED)
            LLMEM_INVARIANT(s->capacity == kv->ragged_cap, "row %d: capacity is not the batch's",
                            i);
        for (int64_t b = 0; refs != NULL && b < s->n_table; b++) {
            LLMEM_INVARIANT(s->table[b] >= 0 && s->table[b] < kv->n_blocks,
                            "sequence %d: bad block id", i);
            refs[s->table[b]]++;
        }
    }
    LLMEM_INVARIANT(n_used == kv->st.n_sequences, "%lld sequences in use, %lld counted",
                    (long long)n_used, (long long)kv->st.n_sequences);
    if (refs != NULL) {
        int64_t zero = 0;
        for (int64_t b = 0; b < kv->n_blocks; b++) {
            LLMEM_INVARIANT(refs[b] + kv->held[b] == kv->refcount[b],
                            "block %lld: %d references and %d holds, count %d", (long long)b,
                            refs[b], kv->held[b], kv->refcount[b]);
            zero += kv->refcount[b] == 0;
        }
        LLMEM_INVARIANT(zero == kv->n_free, "%lld unreferenced blocks but %lld free",
                        (long long)zero, (long long)kv->n_free);
        for (int64_t f = 0; f < kv->n_free; f++)
            LLMEM_INVARIANT(kv->refcount[kv->free_ids[f]] == 0, "a free block is referenced");
    }
out:
    free(refs);
    return status;
}

/* ---- blocks held outside sequences (paged) ----------------------------------------------------
 */

int llmem_kv_block_size(const struct llmem_kv *kv) {
    return block_size(kv);
}

int64_t llmem_kv_block_bytes(const struct llmem_kv *kv) {
    return (int64_t)block_size(kv) * kv->cfg.n_layers * (int64_t)(kv->k_tok + kv->v_tok);
}

int64_t llmem_kv_blocks_free(const struct llmem_kv *kv) {
    return kv->cfg.layout == LLMEM_KV_LAYOUT_PAGED ? kv->n_free : 0;
}

static int cmp_id(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Gives the pages of [p, p + n) that lie wholly inside it back to the kernel; the bytes given. */
static int64_t release_span(uint8_t *p, size_t n) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = ((uintptr_t)p + page - 1) & ~(page - 1), hi = ((uintptr_t)p + n) & ~(page - 1);
    if (hi <= lo || madvise((void *)lo, hi - lo, MADV_DONTNEED) != 0)
        return 0;
    return (int64_t)(hi - lo);
}

int64_t llmem_kv_release_free(struct llmem_kv *kv) {
    if (kv->cfg.layout != LLMEM_KV_LAYOUT_PAGED || kv->n_free == 0 || kv->cfg.device != NULL)
        return 0; /* device memory is not paged by the kernel */
    int64_t *ids = malloc((size_t)kv->n_free * sizeof(int64_t));
    if (ids == NULL)
        return 0; /* nothing released: the pages stay, which is only a missed saving */
    memcpy(ids, kv->free_ids, (size_t)kv->n_free * sizeof(int64_t));
    qsort(ids, (size_t)kv->n_free, sizeof(int64_t), cmp_id);
    const size_t kb = (size_t)block_size(kv) * kv->k_tok, vb = (size_t)block_size(kv) * kv->v_tok;
    int64_t released = 0;
    for (int64_t i = 0; i < kv->n_free;) {
        int64_t j = i + 1; /* a run of consecutive free blocks [ids[i], ids[j − 1]] */
        while (j < kv->n_free && ids[j] == ids[j - 1] + 1)
            j++;
        for (int l = 0; l < kv->cfg.n_layers; l++) {
            released += release_span(kv->k_pool[l] + (size_t)ids[i] * kb, (size_t)(j - i) * kb);
            released += release_span(kv->v_pool[l] + (size_t)ids[i] * vb, (size_t)(j - i) * vb);
        }
        i = j;
    }
    free(ids);
    return released;
}

int64_t llmem_kv_seq_blocks(struct llmem_kv *kv, int seq, const int64_t **ids) {
    struct kv_seq *s = get_seq(kv, seq);
    LLMEM_ASSERT(kv->cfg.layout == LLMEM_KV_LAYOUT_PAGED);
    *ids = s->table;
    return round_up(s->length, block_size(kv));
}

void llmem_kv_block_hold(struct llmem_kv *kv, int64_t id) {
    step_forget(kv);
    LLMEM_ASSERT(kv->cfg.layout == LLMEM_KV_LAYOUT_PAGED && id >= 0 && id < kv->n_blocks &&
                 kv->refcount[id] > 0);
    kv->refcount[id]++;
    kv->held[id]++;
}

void llmem_kv_block_release(struct llmem_kv *kv, int64_t id) {
    step_forget(kv);
    LLMEM_ASSERT(kv->cfg.layout == LLMEM_KV_LAYOUT_PAGED && id >= 0 && id < kv->n_blocks &&
                 kv->held[id] > 0);
    kv->held[id]--;
    pool_unref(kv, id);
}

int llmem_kv_seq_new_from_blocks(struct llmem_kv *kv, const int64_t *ids, int64_t n_blocks,
                                 int *seq) {
    step_forget(kv);
    LLMEM_ASSERT(kv->cfg.layout == LLMEM_KV_LAYOUT_PAGED && n_blocks >= 0);
    for (int64_t b = 0; b < n_blocks; b++)
        LLMEM_ASSERT(ids[b] >= 0 && ids[b] < kv->n_blocks && kv->refcount[ids[b]] > 0);
    int status = llmem_kv_seq_new(kv, seq);
    if (status != LLMEM_OK)
        return status;
    struct kv_seq *s = &kv->seqs[*seq];
    if (table_reserve(s, n_blocks) != LLMEM_OK) {
        llmem_kv_seq_free(kv, *seq);
        LLMEM_ERROR("out of memory for a block table");
        return LLMEM_ENOMEM;
    }
    for (int64_t b = 0; b < n_blocks; b++) {
        s->table[b] = ids[b];
        kv->refcount[ids[b]]++;
    }
    s->n_table = n_blocks;
    s->capacity = s->length = n_blocks * block_size(kv);
    return LLMEM_OK;
}

void llmem_kv_block_copy_out(const struct llmem_kv *kv, int64_t id, void *dst) {
    LLMEM_ASSERT(kv->cfg.layout == LLMEM_KV_LAYOUT_PAGED && id >= 0 && id < kv->n_blocks &&
                 kv->refcount[id] > 0);
    size_t bs = (size_t)block_size(kv), k = bs * kv->k_tok, v = bs * kv->v_tok;
    uint8_t *out = dst;
    for (int l = 0; l < kv->cfg.n_layers; l++) {
        kv_copy(kv, l, out, kv->k_pool[l] + (size_t)id * k, k);
        kv_copy(kv, l, out + k, kv->v_pool[l] + (size_t)id * v, v);
        out += k + v;
    }
}

void llmem_kv_blocks_copy_out_async(struct llmem_kv *kv, const int64_t *ids, int64_t n, void *dst) {
    const struct llmem_backend *d = kv->cfg.device;
    uint8_t *out = dst;
    const size_t block = blocks_block_bytes(kv);
    if (d == NULL || d->ops->copy_out == NULL || d->ops->copy_out_wait == NULL ||
        d->ops->copy_out_fence == NULL) {
        for (int64_t i = 0; i < n; i++)
            llmem_kv_block_copy_out(kv, ids[i], out + (size_t)i * block);
        return;
    }
    /* a run of consecutive ids: one strided copy a layer for its K and one for its V */
    const size_t bs = (size_t)block_size(kv), k = bs * kv->k_tok, v = bs * kv->v_tok;
    for (int64_t i = 0, j; i < n; i = j) {
        LLMEM_ASSERT(ids[i] >= 0 && ids[i] < kv->n_blocks && kv->refcount[ids[i]] > 0);
        for (j = i + 1; j < n && ids[j] == ids[j - 1] + 1; j++)
            LLMEM_ASSERT(kv->refcount[ids[j]] > 0);
        uint8_t *o = out + (size_t)i * block;
        for (int l = 0; l < kv->cfg.n_layers; l++, o += k + v) {
            d = llmem_kv_layer_device(kv, l);
            d->ops->copy_out(d->ctx, o, block, kv->k_pool[l] + (size_t)ids[i] * k, k, k,
                             (size_t)(j - i));
            d->ops->copy_out(d->ctx, o + k, block, kv->v_pool[l] + (size_t)ids[i] * v, v, v,
                             (size_t)(j - i));
        }
    }
    kv->copies_pending = 1;
}

int llmem_kv_copies_wait(const struct llmem_kv *kv) {
    int status = LLMEM_OK;
    for (int r = 0; r < ranks_of(kv); r++) {
        const struct llmem_backend *d = rank_device(kv, r);
        const int st =
            d != NULL && d->ops->copy_out_wait != NULL ? d->ops->copy_out_wait(d->ctx) : LLMEM_OK;
        status = status != LLMEM_OK ? status : st;
    }
    return status;
}

int llmem_kv_block_new_from(struct llmem_kv *kv, const void *src, int64_t *id) {
    LLMEM_ASSERT(kv->cfg.layout == LLMEM_KV_LAYOUT_PAGED);
    if (kv->n_free == 0)
        return LLMEM_ERANGE;
    int64_t b = pool_take(kv);
    kv->held[b]++;
    size_t bs = (size_t)block_size(kv), k = bs * kv->k_tok, v = bs * kv->v_tok;
    const uint8_t *in = src;
    for (int l = 0; l < kv->cfg.n_layers; l++) {
        kv_copy(kv, l, kv->k_pool[l] + (size_t)b * k, in, k);
        kv_copy(kv, l, kv->v_pool[l] + (size_t)b * v, in + k, v);
        in += k + v;
    }
    *id = b;
    return LLMEM_OK;
}

const struct llmem_kv_config *llmem_kv_get_config(const struct llmem_kv *kv) {
    return &kv->cfg;
}
