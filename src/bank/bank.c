/*
 * bank/bank.c — the session bank's RAM tier (see llmem/bank.h): banked blocks keyed by their chain
 * hash in a chained hash table, kept in one LRU list.
 *
 * Guarantees: every banked block is held (llmem_kv_block_hold) exactly once by the bank; a lookup
 * returns only blocks whose whole chain, from the root, matched the prompt's tokens (SHA-256, so a
 * match is the same tokens under the same identity); eviction takes the least recently used block,
 * and chains are touched last block first, so an evicted block never strands a banked descendant
 * that was used with it.
 */
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "llmem/bank.h"

struct entry {
    uint8_t hash[32];
    int64_t block;
    int32_t chain;      /* next entry in the same hash bucket, −1 */
    int32_t prev, next; /* LRU neighbours (prev is more recent), −1 */
};

struct llmem_bank {
    struct llmem_kv *kv;
    uint8_t root[32];
    int bs;
    int64_t block_bytes;
    struct entry *e;
    int32_t n_entries, cap_entries, free_head; /* free entries chained through `chain` */
    int32_t *buckets;                          /* (n_buckets) heads, −1 */
    int32_t n_buckets;
    int32_t lru_head, lru_tail; /* most and least recently used */
    struct llmem_bank_stats st;
};

static uint32_t bucket_of(const struct llmem_bank *b, const uint8_t h[32]) {
    uint32_t x;
    memcpy(&x, h, sizeof(x)); /* SHA-256 bytes are already uniform */
    return x % (uint32_t)b->n_buckets;
}

int llmem_bank_create(struct llmem_kv *kv, const uint8_t root[32], struct llmem_bank **out) {
    struct llmem_bank *b = calloc(1, sizeof(*b));
    if (b != NULL) {
        b->n_buckets = 4096;
        b->buckets = malloc((size_t)b->n_buckets * sizeof(*b->buckets));
    }
    if (b == NULL || b->buckets == NULL) {
        free(b);
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    for (int32_t i = 0; i < b->n_buckets; i++)
        b->buckets[i] = -1;
    b->kv = kv;
    memcpy(b->root, root, 32);
    b->bs = llmem_kv_block_size(kv);
    b->block_bytes = llmem_kv_block_bytes(kv);
    b->free_head = b->lru_head = b->lru_tail = -1;
    *out = b;
    return LLMEM_OK;
}

/* ---- the LRU list and the table ----------------------------------------------------------------
 */

static void lru_unlink(struct llmem_bank *b, int32_t i) {
    struct entry *x = &b->e[i];
    if (x->prev >= 0)
        b->e[x->prev].next = x->next;
    else
        b->lru_head = x->next;
    if (x->next >= 0)
        b->e[x->next].prev = x->prev;
    else
        b->lru_tail = x->prev;
    x->prev = x->next = -1;
}

static void lru_push_front(struct llmem_bank *b, int32_t i) {
    struct entry *x = &b->e[i];
    x->prev = -1;
    x->next = b->lru_head;
    if (b->lru_head >= 0)
        b->e[b->lru_head].prev = i;
    b->lru_head = i;
    if (b->lru_tail < 0)
        b->lru_tail = i;
}

static void touch(struct llmem_bank *b, int32_t i) {
    if (b->lru_head != i) {
        lru_unlink(b, i);
        lru_push_front(b, i);
    }
}

static int32_t find(const struct llmem_bank *b, const uint8_t h[32]) {
    for (int32_t i = b->buckets[bucket_of(b, h)]; i >= 0; i = b->e[i].chain)
        if (memcmp(b->e[i].hash, h, 32) == 0)
            return i;
    return -1;
}

static int32_t add(struct llmem_bank *b, const uint8_t h[32], int64_t block) {
    int32_t i = b->free_head;
    if (i >= 0) {
        b->free_head = b->e[i].chain;
    } else {
        if (b->n_entries == b->cap_entries) {
            int32_t cap = b->cap_entries ? b->cap_entries * 2 : 256;
            struct entry *e = realloc(b->e, (size_t)cap * sizeof(*e));
            if (e == NULL)
                return -1;
            b->e = e;
            b->cap_entries = cap;
        }
        i = b->n_entries++;
    }
    struct entry *x = &b->e[i];
    memcpy(x->hash, h, 32);
    x->block = block;
    uint32_t k = bucket_of(b, h);
    x->chain = b->buckets[k];
    b->buckets[k] = i;
    lru_push_front(b, i);
    llmem_kv_block_hold(b->kv, block);
    b->st.blocks++;
    b->st.bytes += b->block_bytes;
    return i;
}

static void evict(struct llmem_bank *b, int32_t i) {
    struct entry *x = &b->e[i];
    int32_t *p = &b->buckets[bucket_of(b, x->hash)];
    while (*p != i)
        p = &b->e[*p].chain;
    *p = x->chain;
    lru_unlink(b, i);
    llmem_kv_block_release(b->kv, x->block);
    x->chain = b->free_head;
    b->free_head = i;
    b->st.blocks--;
    b->st.bytes -= b->block_bytes;
    b->st.evicted_blocks++;
}

/* ---- the interface ----------------------------------------------------------------------------
 */

void llmem_bank_destroy(struct llmem_bank *b) {
    if (b == NULL)
        return;
    while (b->lru_tail >= 0)
        evict(b, b->lru_tail);
    free(b->e);
    free(b->buckets);
    free(b);
}

/* Walks the chain of tokens' full blocks from the root while the bank has them (at most
 * max_blocks), recording entry indices into idx; returns how many matched. The final hash is left
 * in h. */
static int64_t walk(struct llmem_bank *b, const int32_t *tokens, int64_t n_tokens,
                    int64_t max_blocks, int32_t *idx, uint8_t h[32]) {
    memcpy(h, b->root, 32);
    int64_t n = 0;
    while (n < max_blocks && (n + 1) * b->bs <= n_tokens) {
        uint8_t next[32];
        llmem_bank_block_hash(h, tokens + n * b->bs, b->bs, next);
        int32_t i = find(b, next);
        if (i < 0)
            break;
        memcpy(h, next, 32);
        idx[n++] = i;
    }
    return n;
}

/* Touches a chain from its last block back to its first: the first ends up most recent. */
static void touch_chain(struct llmem_bank *b, const int32_t *idx, int64_t n) {
    for (int64_t k = n - 1; k >= 0; k--)
        touch(b, idx[k]);
}

int64_t llmem_bank_lookup(struct llmem_bank *b, const int32_t *tokens, int64_t n_tokens,
                          int64_t max_blocks, int64_t *ids) {
    b->st.lookups++;
    int64_t cap = n_tokens / b->bs < max_blocks ? n_tokens / b->bs : max_blocks;
    int32_t *idx = cap > 0 ? malloc((size_t)cap * sizeof(*idx)) : NULL;
    uint8_t h[32];
    int64_t n = idx != NULL ? walk(b, tokens, n_tokens, cap, idx, h) : 0;
    for (int64_t k = 0; k < n; k++)
        ids[k] = b->e[idx[k]].block;
    touch_chain(b, idx, n);
    free(idx);
    if (n == 0)
        b->st.miss_lookups++;
    b->st.hit_blocks += n;
    return n;
}

int llmem_bank_insert(struct llmem_bank *b, int seq, const int32_t *tokens, int64_t n_tokens) {
    const int64_t *blocks = NULL;
    llmem_kv_seq_blocks(b->kv, seq, &blocks);
    int64_t full = llmem_kv_seq_length(b->kv, seq) / b->bs;
    if (full > n_tokens / b->bs)
        full = n_tokens / b->bs;
    if (full == 0)
        return LLMEM_OK;
    int32_t *idx = malloc((size_t)full * sizeof(*idx));
    if (idx == NULL) {
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    uint8_t h[32];
    int64_t n = walk(b, tokens, n_tokens, full, idx, h); /* the part already banked */
    int status = LLMEM_OK;
    for (; n < full; n++) {
        llmem_bank_block_hash(h, tokens + n * b->bs, b->bs, h);
        int32_t i = add(b, h, blocks[n]);
        if (i < 0) {
            LLMEM_ERROR("out of memory for bank entries");
            status = LLMEM_ENOMEM;
            break;
        }
        idx[n] = i;
        b->st.inserted_blocks++;
    }
    touch_chain(b, idx, n);
    free(idx);
    return status;
}

int64_t llmem_bank_trim(struct llmem_bank *b, int64_t max_bytes) {
    int64_t released = 0;
    while (b->st.bytes > max_bytes && b->lru_tail >= 0) {
        evict(b, b->lru_tail);
        released += b->block_bytes;
    }
    return released;
}

void llmem_bank_stats(const struct llmem_bank *b, struct llmem_bank_stats *stats) {
    *stats = b->st;
}
