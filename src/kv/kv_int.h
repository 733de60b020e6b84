/*
 * kv/kv_int.h — the inside of a KV cache, shared by kv.c (layouts, sequences, growth) and
 * attention.c (the routes). A cache is driven by one thread at a time, except a step's writes and
 * attention after llmem_kv_step (a split model's ranks, each from its thread): those only read
 * the bookkeeping and add to the counters atomically (KV_COUNT). Attention parallelizes
 * internally over its own pool.
 */
#ifndef LLMEM_KV_INT_H
#define LLMEM_KV_INT_H

#include "backend/ops.h"
#include "llmem/pool.h"
#include "kv/codec.h"
#include "llmem/kv.h"

struct kv_seq {
    int used;
    int64_t length;   /* tokens written and committed */
    int64_t capacity; /* tokens its storage holds */
    /* paged: block ids; blocks layout: block buffers (as uintptr_t) */
    int64_t *table; /* (n_table) */
    int64_t n_table, cap_table;
    /* contiguous: one K and one V buffer per layer, (capacity, k_tok) / (capacity, v_tok) */
    uint8_t **k_buf, **v_buf; /* (n_layers) */
};

struct llmem_kv {
    struct llmem_kv_config cfg;
    struct llmem_kv_codec codec;
    struct llmem_mem *mem;
    int own_mem;
    struct llmem_pool *pool;
    size_t k_tok, v_tok; /* bytes of one token of one layer, all KV heads */
    struct kv_seq *seqs; /* (max_sequences) */

    /* paged */
    uint8_t **k_pool, **v_pool; /* (n_layers) of (n_blocks, block_size, k_tok / v_tok) */
    int64_t n_blocks;
    int32_t *refcount; /* (n_blocks) */
    int32_t *held;     /* (n_blocks) of those references, the ones held outside any sequence */
    int64_t *free_ids; /* a stack of free block ids */
    int64_t n_free;

    /* ragged */
    uint8_t **r_k, **r_v; /* (n_layers) of (max_sequences, ragged_cap, k_tok / v_tok) */
    int64_t ragged_cap;
    int frozen;

    struct llmem_backend_kv_rotation
        rotation;       /* device pools: the codec's, as a backend takes it */
    int copies_pending; /* device pools: block copies to the host not yet fenced (copies_fence) */
    int take_fence;     /* and a block freed since: the next pool_take fences them */
    /* the step prepared by llmem_kv_step, which its _last calls only read (step_n 0 once a call
     * changes what it prepared): its sequences, their lengths and tokens, (max_sequences) each,
     * and its tokens in all; on a device the pool slots they take (step_slots_cap) and the block
     * tables attention reads (max_sequences) */
    int step_n;
    int *step_seqs;
    int64_t *step_lengths, *step_n_q;
    int64_t step_tokens;
    int64_t *step_slots;
    int64_t step_slots_cap;
    const int64_t **step_blocks;
    int64_t *slots; /* device pools: the slot numbers of a write (slots_cap) */
    int64_t slots_cap;

    struct llmem_kv_stats st;
};

/* Adds v to one of the cache's counters: a step's calls may come from several threads. */
#define KV_COUNT(kv, field, v) ((void)__atomic_fetch_add(&(kv)->st.field, (v), __ATOMIC_RELAXED))

/* Whether the step llmem_kv_step prepared last is that of these sequences, at their lengths and
 * with these tokens, and nothing changed it since. */
int llmem_kv_step_is(const struct llmem_kv *kv, int n, const int *seqs, const int64_t *n_q);

/* The storage of token `pos` of a sequence's layer: K and V bytes of all heads, and how many
 * tokens follow contiguously from there (to the end of its block or buffer). pos < capacity. */
int64_t llmem_kv_span(const struct llmem_kv *kv, int seq, int layer, int64_t pos, uint8_t **k,
                      uint8_t **v);

/* The rank of layer l of a split cache (n_ranks > 1), and its device (the rank's, made the
 * calling thread's current one; else the cache's device, or NULL for host memory). */
static inline int llmem_kv_layer_rank(const struct llmem_kv *kv, int l) {
    return l / (kv->cfg.n_layers / kv->cfg.n_ranks); /* (a split cache's: n_ranks > 1) */
}
static inline const struct llmem_backend *llmem_kv_layer_device(const struct llmem_kv *kv, int l) {
    if (kv->cfg.n_ranks <= 1 || kv->cfg.device == NULL)
        return kv->cfg.device;
    const struct llmem_backend *d = kv->cfg.rank_devices[llmem_kv_layer_rank(kv, l)];
    if (d->ops->bind != NULL)
        d->ops->bind(d->ctx);
    return d;
}

/* The memory of layer l's storage and of its attention's workspace: a split cache's rank's, else
 * the cache's. */
static inline struct llmem_mem *llmem_kv_layer_mem(const struct llmem_kv *kv, int l) {
    return kv->cfg.n_ranks > 1 ? kv->cfg.rank_mems[llmem_kv_layer_rank(kv, l)] : kv->mem;
}

/* The rotation a device takes with this cache's rows: NULL when nothing is rotated. */
static inline const struct llmem_backend_kv_rotation *
llmem_kv_device_rotation(const struct llmem_kv *kv) {
    return kv->rotation.keys || kv->rotation.values ? &kv->rotation : NULL;
}

#endif
