/*
 * mem/mem.c — the caching allocator (see llmem/mem.h for the contract).
 *
 * Bookkeeping lives outside the buffers (a buffer may be device memory the host cannot touch):
 *   - `active`: an open-addressing hash map from buffer address to its block record, for every
 *     buffer handed out and every tracked region;
 *   - `classes`: a hash map from class size to the most recently freed cached block of that size;
 *     cached blocks of one class form a doubly linked list from there (reuse is LIFO: the warmest
 *     buffer first);
 *   - one LRU list of all cached blocks, most recently freed at the head: releases (cache limit,
 *     memory limit, clear_cache) take the tail, the least recently freed, first.
 * Block records come from chunks of BLOCKS_PER_CHUNK and are recycled through a free list.
 *
 * Guarantees: active + cache never grows past the memory limit through this allocator; a failed
 * allocation leaves the allocator exactly as it was before (apart from cache it released); every
 * failure of the allocator's own bookkeeping is an LLMEM_ENOMEM like any other, which the fault
 * injection hook exercises at every step.
 */
#include "llmem/mem.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/json.h"
#include "core/log.h"
#include "llmem/size.h"
#include "llmem/sys.h"

#define SMALL_ALIGN       64
#define LARGE_MIN_DEFAULT ((size_t)32 << 10)
#define LARGE_STEP_MAX    ((size_t)2 << 20)
#define BLOCKS_PER_CHUNK  256
#define MAP_MIN_CAP       64

/* ---- fault injection --------------------------------------------------------------------------
 */

/* The armed fault: `countdown` attempts until the first refused one, then `left` more refused
 * (< 0: every one until disarmed). `armed` is the lock-free fast path of fault_hit: when 0, no
 * fault is armed or firing and an allocation pays one relaxed load. */
static _Atomic int fault_armed;
static pthread_mutex_t fault_lock = PTHREAD_MUTEX_INITIALIZER;
static int64_t fault_countdown; /* 0: fired or disarmed; n: the n-th attempt from now fails */
static int64_t fault_left;      /* refusals still to come after the first; < 0: until disarmed */

void llmem_mem_fault_inject_count(int64_t n, int64_t count) {
    pthread_mutex_lock(&fault_lock);
    fault_countdown = n > 0 && count != 0 ? n : 0;
    fault_left = fault_countdown > 0 ? (count < 0 ? -1 : count - 1) : 0;
    atomic_store(&fault_armed, fault_countdown > 0);
    pthread_mutex_unlock(&fault_lock);
}

void llmem_mem_fault_inject(int64_t n) {
    llmem_mem_fault_inject_count(n, 1);
}

int llmem_mem_fault_pending(void) {
    pthread_mutex_lock(&fault_lock);
    int pending = fault_countdown > 0;
    pthread_mutex_unlock(&fault_lock);
    return pending;
}

/* Counts one allocation attempt; 1 when this one is to fail. */
static int fault_hit(void) {
    if (!atomic_load_explicit(&fault_armed, memory_order_relaxed))
        return 0;
    pthread_mutex_lock(&fault_lock);
    int hit = 0;
    if (fault_countdown > 0) {
        hit = --fault_countdown == 0;
    } else if (fault_left != 0) {
        hit = 1;
        if (fault_left > 0)
            fault_left--;
    }
    atomic_store(&fault_armed, fault_countdown > 0 || fault_left != 0);
    pthread_mutex_unlock(&fault_lock);
    return hit;
}

/* ---- the host kind ----------------------------------------------------------------------------
 */

/* Large buffers of 2 MiB or more start on a 2 MiB boundary and ask for transparent huge pages:
 * KV pools, weights read into memory and GEMM scratch are streamed, and 4 KiB pages would cost a
 * TLB walk every 4 KiB (dearer still under virtualization). The mapping is cut to exactly
 * [p, p + bytes), so host_free unmaps what it is given. */
#define HUGE_PAGE ((size_t)2 << 20)

static void *host_alloc(void *ctx, size_t bytes, int large) {
    (void)ctx;
    if (large) {
        size_t extra = bytes >= HUGE_PAGE ? HUGE_PAGE : 0;
        char *p = mmap(NULL, bytes + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                       -1, 0);
        if (p == MAP_FAILED)
            return NULL;
        if (extra > 0) {
            size_t head = (HUGE_PAGE - ((uintptr_t)p & (HUGE_PAGE - 1))) & (HUGE_PAGE - 1);
            if (head > 0)
                munmap(p, head);
            if (extra - head > 0)
                munmap(p + head + bytes, extra - head);
            p += head;
            madvise(p, bytes, MADV_HUGEPAGE); /* advice: a kernel without THP ignores it */
        }
        return p;
    }
    void *p = NULL;
    return posix_memalign(&p, SMALL_ALIGN, bytes) == 0 ? p : NULL;
}

static void host_free(void *ctx, void *ptr, size_t bytes, int large) {
    (void)ctx;
    if (large)
        munmap(ptr, bytes);
    else
        free(ptr);
}

static int host_lock(void *ctx, void *ptr, size_t bytes) {
    (void)ctx;
    return mlock(ptr, bytes);
}

static void host_unlock(void *ctx, void *ptr, size_t bytes) {
    (void)ctx;
    munlock(ptr, bytes);
}

static const struct llmem_mem_raw_ops host_ops = {
    .name = "host",
    .alloc = host_alloc,
    .free = host_free,
    .lock = host_lock,
    .unlock = host_unlock,
};

const struct llmem_mem_raw_ops *llmem_mem_host_ops(void) {
    return &host_ops;
}

const char *llmem_mem_tag_name(enum llmem_mem_tag tag) {
    static const char *const names[LLMEM_TAG_COUNT] = {"weights", "kv", "bank", "scratch", "other"};
    return (unsigned)tag < LLMEM_TAG_COUNT ? names[tag] : "unknown";
}

int64_t llmem_mem_default_cache_limit(int64_t usable_bytes) {
    const int64_t lo = (int64_t)256 << 20, hi = (int64_t)8 << 30;
    int64_t v = usable_bytes / 8;
    return v < lo ? lo : v > hi ? hi : v;
}

/* ---- block records ----------------------------------------------------------------------------
 */

enum block_state { BLOCK_ACTIVE = 1, BLOCK_CACHED, BLOCK_TRACKED };

struct block {
    uintptr_t ptr;
    size_t size;      /* class size (bytes held); tracked: the region's size */
    size_t requested; /* what the caller asked for */
    uint8_t tag, state, wired, large;
    struct block *lru_prev, *lru_next; /* cached: the LRU list */
    struct block *cls_prev, *cls_next; /* cached: its class list; spare: the free list */
};

struct chunk {
    struct chunk *next;
    struct block blocks[BLOCKS_PER_CHUNK];
};

/* ---- an open-addressing map from a nonzero 64-bit key to a block ------------------------------
 */

struct map {
    uint64_t *keys; /* 0: empty */
    struct block **vals;
    size_t cap; /* a power of two */
    size_t n;
    int shift; /* 64 − log2(cap) */
};

static size_t map_home(const struct map *m, uint64_t key) {
    return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> m->shift);
}

static long map_find(const struct map *m, uint64_t key) {
    if (m->cap == 0)
        return -1;
    for (size_t i = map_home(m, key);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == key)
            return (long)i;
        if (m->keys[i] == 0)
            return -1;
    }
}

static void map_put_unchecked(struct map *m, uint64_t key, struct block *val) {
    size_t i = map_home(m, key);
    while (m->keys[i] != 0)
        i = (i + 1) & (m->cap - 1);
    m->keys[i] = key;
    m->vals[i] = val;
    m->n++;
}

/* Makes room for one more entry (load ≤ 1/2); LLMEM_ENOMEM when the table cannot grow. */
static int map_reserve(struct map *m) {
    if ((m->n + 1) * 2 <= m->cap)
        return LLMEM_OK;
    size_t cap = m->cap ? m->cap * 2 : MAP_MIN_CAP;
    if (fault_hit())
        return LLMEM_ENOMEM;
    uint64_t *keys = calloc(cap, sizeof(*keys));
    struct block **vals = malloc(cap * sizeof(*vals));
    if (keys == NULL || vals == NULL) {
        free(keys);
        free(vals);
        return LLMEM_ENOMEM;
    }
    struct map grown = {keys, vals, cap, 0, 64 - __builtin_ctzll((unsigned long long)cap)};
    for (size_t i = 0; i < m->cap; i++)
        if (m->keys[i] != 0)
            map_put_unchecked(&grown, m->keys[i], m->vals[i]);
    free(m->keys);
    free(m->vals);
    *m = grown;
    return LLMEM_OK;
}

/* Deletes slot i, shifting later entries of the probe run back (no tombstones). */
static void map_delete(struct map *m, size_t i) {
    size_t mask = m->cap - 1;
    for (size_t j = (i + 1) & mask; m->keys[j] != 0; j = (j + 1) & mask) {
        size_t home = map_home(m, m->keys[j]);
        /* Move j into the hole at i when its home is not cyclically within (i, j]. */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            m->keys[i] = m->keys[j];
            m->vals[i] = m->vals[j];
            i = j;
        }
    }
    m->keys[i] = 0;
    m->n--;
}

static void map_free(struct map *m) {
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof(*m));
}

/* ---- the allocator ----------------------------------------------------------------------------
 */

struct llmem_mem {
    pthread_mutex_t lock;
    struct llmem_mem_raw_ops ops;
    size_t page, large_min;
    struct map active;  /* address → ACTIVE or TRACKED block */
    struct map classes; /* class size → the most recently freed CACHED block of that size */
    struct block *lru_head, *lru_tail;
    struct block *spare;
    struct chunk *chunks;
    struct llmem_mem_stats st;
};

static struct block *block_new(struct llmem_mem *m) {
    if (m->spare == NULL) {
        if (fault_hit())
            return NULL;
        struct chunk *c = calloc(1, sizeof(*c));
        if (c == NULL)
            return NULL;
        c->next = m->chunks;
        m->chunks = c;
        for (int i = 0; i < BLOCKS_PER_CHUNK; i++) {
            c->blocks[i].cls_next = m->spare;
            m->spare = &c->blocks[i];
        }
    }
    struct block *b = m->spare;
    m->spare = b->cls_next;
    memset(b, 0, sizeof(*b));
    return b;
}

static void block_put(struct llmem_mem *m, struct block *b) {
    b->state = 0;
    b->cls_next = m->spare;
    m->spare = b;
}

size_t llmem_mem_size_class(const struct llmem_mem *m, size_t n) {
    if (n <= 128)
        return n == 0 ? 16 : (n + 15) & ~(size_t)15;
    int k = 63 - __builtin_clzll((unsigned long long)n);
    size_t step = ((size_t)1 << k) >> 3;
    if (step < 16)
        step = 16;
    if (n >= m->large_min) {
        if (step < m->page)
            step = m->page;
        if (step > LARGE_STEP_MAX)
            step = LARGE_STEP_MAX;
    }
    if (n > SIZE_MAX - (step - 1))
        return 0; /* no class: the request is beyond any memory */
    return (n + step - 1) / step * step;
}

size_t llmem_mem_alloc_size(const struct llmem_mem *m, size_t n, enum llmem_mem_tag tag) {
    const size_t cls = llmem_mem_size_class(m, n);
    if ((tag != LLMEM_TAG_WEIGHTS && tag != LLMEM_TAG_KV) || n < m->large_min || cls == 0)
        return cls;
    const size_t pages = (n + m->page - 1) / m->page * m->page;
    return pages < cls ? pages : cls;
}

/* ---- accounting -------------------------------------------------------------------------------
 */

static void account_add(struct llmem_mem *m, const struct block *b) {
    struct llmem_mem_stats *st = &m->st;
    struct llmem_mem_tag_stats *t = &st->tags[b->tag];
    st->active_bytes += (int64_t)b->size;
    st->requested_bytes += (int64_t)b->requested;
    if (st->active_bytes > st->peak_bytes)
        st->peak_bytes = st->active_bytes;
    t->active_bytes += (int64_t)b->size;
    t->n_active++;
    if (t->active_bytes > t->peak_bytes)
        t->peak_bytes = t->active_bytes;
}

static void account_sub(struct llmem_mem *m, const struct block *b) {
    struct llmem_mem_tag_stats *t = &m->st.tags[b->tag];
    m->st.active_bytes -= (int64_t)b->size;
    m->st.requested_bytes -= (int64_t)b->requested;
    t->active_bytes -= (int64_t)b->size;
    t->n_active--;
}

/* ---- wiring -----------------------------------------------------------------------------------
 */

static int wire_eligible(const struct block *b) {
    return !b->wired && (b->tag == LLMEM_TAG_WEIGHTS || b->tag == LLMEM_TAG_KV);
}

static void wire(struct llmem_mem *m, struct block *b) {
    if (m->ops.lock == NULL || m->st.wired_bytes + (int64_t)b->size > m->st.wired_limit_bytes)
        return;
    if (m->ops.lock(m->ops.ctx, (void *)b->ptr, b->size) != 0) {
        m->st.wire_failures++;
        return;
    }
    b->wired = 1;
    m->st.wired_bytes += (int64_t)b->size;
}

static void unwire(struct llmem_mem *m, struct block *b) {
    if (!b->wired)
        return;
    m->ops.unlock(m->ops.ctx, (void *)b->ptr, b->size);
    b->wired = 0;
    m->st.wired_bytes -= (int64_t)b->size;
}

/* ---- the cache --------------------------------------------------------------------------------
 */

static void lru_unlink(struct llmem_mem *m, struct block *b) {
    if (b->lru_prev)
        b->lru_prev->lru_next = b->lru_next;
    else
        m->lru_head = b->lru_next;
    if (b->lru_next)
        b->lru_next->lru_prev = b->lru_prev;
    else
        m->lru_tail = b->lru_prev;
    b->lru_prev = b->lru_next = NULL;
}

/* Takes a cached block out of its class list and the LRU; it is no longer counted as cache. */
static void cache_unlink(struct llmem_mem *m, struct block *b) {
    if (b->cls_prev) {
        b->cls_prev->cls_next = b->cls_next;
    } else {
        long i = map_find(&m->classes, b->size);
        LLMEM_ASSERT(i >= 0 && m->classes.vals[i] == b);
        m->classes.vals[i] = b->cls_next;
    }
    if (b->cls_next)
        b->cls_next->cls_prev = b->cls_prev;
    b->cls_prev = b->cls_next = NULL;
    lru_unlink(m, b);
    m->st.cache_bytes -= (int64_t)b->size;
    m->st.n_cached--;
}

static void raw_release(struct llmem_mem *m, struct block *b) {
    m->ops.free(m->ops.ctx, (void *)b->ptr, b->size, b->large);
    m->st.os_frees++;
    block_put(m, b);
}

/* Releases the least recently freed cached block to the OS. */
static void evict_one(struct llmem_mem *m) {
    struct block *b = m->lru_tail;
    cache_unlink(m, b);
    m->st.evictions++;
    raw_release(m, b);
}

static void trim_cache(struct llmem_mem *m, int64_t limit) {
    while (m->st.cache_bytes > limit && m->lru_tail != NULL)
        evict_one(m);
}

/* Puts a freed block in the cache; 0 when it does not fit (the caller releases it). */
static int cache_put(struct llmem_mem *m, struct block *b) {
    int64_t size = (int64_t)b->size;
    if (m->st.cache_bytes + size > m->st.cache_limit_bytes ||
        m->st.active_bytes + m->st.cache_bytes > m->st.memory_limit_bytes - size)
        return 0; /* over the cache limit, or over a memory limit lowered below what is held */
    long i = map_find(&m->classes, b->size);
    if (i < 0) {
        if (map_reserve(&m->classes) != LLMEM_OK)
            return 0; /* no room to remember it: release it instead */
        map_put_unchecked(&m->classes, b->size, NULL);
        i = map_find(&m->classes, b->size);
    }
    b->state = BLOCK_CACHED;
    b->cls_prev = NULL;
    b->cls_next = m->classes.vals[i];
    if (b->cls_next)
        b->cls_next->cls_prev = b;
    m->classes.vals[i] = b;
    b->lru_prev = NULL;
    b->lru_next = m->lru_head;
    if (m->lru_head)
        m->lru_head->lru_prev = b;
    else
        m->lru_tail = b;
    m->lru_head = b;
    m->st.cache_bytes += (int64_t)b->size;
    m->st.n_cached++;
    return 1;
}

static struct block *cache_take(struct llmem_mem *m, size_t size) {
    long i = map_find(&m->classes, size);
    if (i < 0 || m->classes.vals[i] == NULL)
        return NULL;
    struct block *b = m->classes.vals[i];
    cache_unlink(m, b);
    return b;
}

/* Whether `bytes` more fit under the memory limit, releasing cache (LRU first) to make room. */
static int make_room(struct llmem_mem *m, int64_t bytes) {
    int64_t limit = m->st.memory_limit_bytes;
    if (bytes > limit)
        return 0;
    while (m->st.active_bytes + m->st.cache_bytes > limit - bytes && m->lru_tail != NULL)
        evict_one(m);
    return m->st.active_bytes + m->st.cache_bytes <= limit - bytes;
}

/* ---- the public functions ---------------------------------------------------------------------
 */

int llmem_mem_create(const struct llmem_mem_config *config, struct llmem_mem **out) {
    const struct llmem_mem_raw_ops *ops = config && config->ops ? config->ops : &host_ops;
    if (ops->alloc == NULL || ops->free == NULL || (ops->lock == NULL) != (ops->unlock == NULL)) {
        LLMEM_ERROR("raw ops '%s' need alloc and free, and lock and unlock together",
                    ops->name ? ops->name : "?");
        return LLMEM_EINVAL;
    }
    if (fault_hit())
        goto out_nomem;
    struct llmem_mem *m = calloc(1, sizeof(*m));
    if (m == NULL)
        goto out_nomem;
    if (pthread_mutex_init(&m->lock, NULL) != 0) {
        free(m);
        goto out_nomem;
    }
    m->ops = *ops;
    long page = sysconf(_SC_PAGESIZE);
    m->page = page > 0 ? (size_t)page : 4096;
    m->large_min = ops->large_min ? ops->large_min : LARGE_MIN_DEFAULT;
    if (m->large_min < 8 * m->page)
        m->large_min = 8 * m->page;
    int64_t limit = config ? config->memory_limit_bytes : 0;
    m->st.memory_limit_bytes = limit > 0 ? limit : LLMEM_MEM_UNLIMITED;
    int64_t cache = config ? config->cache_limit_bytes : -1;
    m->st.cache_limit_bytes =
        cache >= 0 ? cache : llmem_mem_default_cache_limit(config ? config->usable_bytes : 0);
    if (cache < 0 && limit > 0 && m->st.cache_limit_bytes > limit)
        m->st.cache_limit_bytes = limit; /* a cache larger than all it may hold means nothing */
    *out = m;
    return LLMEM_OK;
out_nomem:
    LLMEM_ERROR("out of memory creating an allocator");
    return LLMEM_ENOMEM;
}

void llmem_mem_destroy(struct llmem_mem *m) {
    if (m == NULL)
        return;
    pthread_mutex_lock(&m->lock);
    trim_cache(m, 0);
    int64_t leaked = 0, leaked_bytes = 0;
    for (size_t i = 0; i < m->active.cap; i++) {
        struct block *b = m->active.vals[i];
        if (m->active.keys[i] == 0)
            continue;
        unwire(m, b);
        if (b->state == BLOCK_ACTIVE) {
            leaked++;
            leaked_bytes += (int64_t)b->size;
            m->ops.free(m->ops.ctx, (void *)b->ptr, b->size, b->large);
        }
    }
    if (leaked > 0)
        LLMEM_WARN("%" PRId64 " buffer(s) of %" PRId64 " bytes were still in use; released", leaked,
                   leaked_bytes);
    map_free(&m->active);
    map_free(&m->classes);
    for (struct chunk *c = m->chunks, *next; c != NULL; c = next) {
        next = c->next;
        free(c);
    }
    pthread_mutex_unlock(&m->lock);
    pthread_mutex_destroy(&m->lock);
    free(m);
}

#define SZ(v)                                                                                      \
    llmem_size_format_short((int64_t)(v), (char[LLMEM_SIZE_STR_MAX]){0}, LLMEM_SIZE_STR_MAX)

void *llmem_mem_alloc(struct llmem_mem *m, size_t bytes, enum llmem_mem_tag tag) {
    LLMEM_ASSERT(m != NULL && (unsigned)tag < LLMEM_TAG_COUNT);
    size_t size = llmem_mem_alloc_size(m, bytes, tag);
    if (bytes == 0 || size == 0 || size > (size_t)INT64_MAX / 2) {
        LLMEM_ERROR("%s: cannot allocate %zu bytes for %s", m->ops.name, bytes,
                    llmem_mem_tag_name(tag));
        return NULL;
    }
    pthread_mutex_lock(&m->lock);
    trim_cache(m, m->st.cache_limit_bytes);
    struct block *b = NULL;
    if (map_reserve(&m->active) != LLMEM_OK)
        goto out_bookkeeping;
    b = cache_take(m, size);
    if (b != NULL) {
        m->st.cache_hits++;
    } else {
        m->st.cache_misses++;
        if (!make_room(m, (int64_t)size)) {
            m->st.limit_refusals++;
            int64_t active = m->st.active_bytes, limit = m->st.memory_limit_bytes;
            pthread_mutex_unlock(&m->lock);
            LLMEM_ERROR("%s: %s for %s would pass the memory limit %s (active %s, cache released)",
                        m->ops.name, SZ(size), llmem_mem_tag_name(tag), SZ(limit), SZ(active));
            return NULL;
        }
        b = block_new(m);
        if (b == NULL)
            goto out_bookkeeping;
        int large = size >= m->large_min;
        void *p = fault_hit() ? NULL : m->ops.alloc(m->ops.ctx, size, large);
        if (p == NULL) {
            /* The OS is short: give it the whole cache back and try once more. */
            m->st.os_failures++;
            trim_cache(m, 0);
            p = fault_hit() ? NULL : m->ops.alloc(m->ops.ctx, size, large);
        }
        if (p == NULL) {
            block_put(m, b);
            int64_t active = m->st.active_bytes;
            pthread_mutex_unlock(&m->lock);
            LLMEM_ERROR("%s: the system refused %s for %s (active %s, cache released)", m->ops.name,
                        SZ(size), llmem_mem_tag_name(tag), SZ(active));
            return NULL;
        }
        m->st.os_allocs++;
        b->ptr = (uintptr_t)p;
        b->size = size;
        b->large = (uint8_t)large;
    }
    b->requested = bytes;
    b->tag = (uint8_t)tag;
    b->state = BLOCK_ACTIVE;
    map_put_unchecked(&m->active, b->ptr, b);
    account_add(m, b);
    if (wire_eligible(b))
        wire(m, b);
    m->st.n_allocs++;
    pthread_mutex_unlock(&m->lock);
    return (void *)b->ptr;

out_bookkeeping:
    pthread_mutex_unlock(&m->lock);
    LLMEM_ERROR("%s: out of memory for the allocator's records (allocating %s for %s)", m->ops.name,
                SZ(size), llmem_mem_tag_name(tag));
    return NULL;
}

void llmem_mem_free(struct llmem_mem *m, void *ptr) {
    if (ptr == NULL)
        return;
    pthread_mutex_lock(&m->lock);
    long i = map_find(&m->active, (uintptr_t)ptr);
    LLMEM_ASSERT(i >= 0 && m->active.vals[i]->state == BLOCK_ACTIVE);
    struct block *b = m->active.vals[i];
    map_delete(&m->active, (size_t)i);
    account_sub(m, b);
    unwire(m, b);
    m->st.n_frees++;
    if (!cache_put(m, b))
        raw_release(m, b);
    pthread_mutex_unlock(&m->lock);
}

int llmem_mem_track(struct llmem_mem *m, void *ptr, size_t bytes, enum llmem_mem_tag tag) {
    LLMEM_ASSERT(m != NULL && ptr != NULL && (unsigned)tag < LLMEM_TAG_COUNT);
    pthread_mutex_lock(&m->lock);
    LLMEM_ASSERT(map_find(&m->active, (uintptr_t)ptr) < 0);
    struct block *b = NULL;
    if (map_reserve(&m->active) != LLMEM_OK || (b = block_new(m)) == NULL) {
        pthread_mutex_unlock(&m->lock);
        LLMEM_ERROR("%s: out of memory for the allocator's records (tracking %s of %s)",
                    m->ops.name, SZ(bytes), llmem_mem_tag_name(tag));
        return LLMEM_ENOMEM;
    }
    if (bytes > (size_t)INT64_MAX / 2 || !make_room(m, (int64_t)bytes)) {
        block_put(m, b);
        m->st.limit_refusals++;
        int64_t active = m->st.active_bytes, limit = m->st.memory_limit_bytes;
        pthread_mutex_unlock(&m->lock);
        LLMEM_ERROR("%s: %s of %s would pass the memory limit %s (active %s, cache released)",
                    m->ops.name, SZ(bytes), llmem_mem_tag_name(tag), SZ(limit), SZ(active));
        return LLMEM_ENOMEM;
    }
    b->ptr = (uintptr_t)ptr;
    b->size = b->requested = bytes;
    b->tag = (uint8_t)tag;
    b->state = BLOCK_TRACKED;
    map_put_unchecked(&m->active, b->ptr, b);
    account_add(m, b);
    if (wire_eligible(b))
        wire(m, b);
    pthread_mutex_unlock(&m->lock);
    return LLMEM_OK;
}

void llmem_mem_untrack(struct llmem_mem *m, void *ptr) {
    if (ptr == NULL)
        return;
    pthread_mutex_lock(&m->lock);
    long i = map_find(&m->active, (uintptr_t)ptr);
    LLMEM_ASSERT(i >= 0 && m->active.vals[i]->state == BLOCK_TRACKED);
    struct block *b = m->active.vals[i];
    map_delete(&m->active, (size_t)i);
    account_sub(m, b);
    unwire(m, b);
    block_put(m, b);
    pthread_mutex_unlock(&m->lock);
}

int64_t llmem_mem_set_cache_limit(struct llmem_mem *m, int64_t bytes) {
    LLMEM_ASSERT(bytes >= 0);
    pthread_mutex_lock(&m->lock);
    int64_t previous = m->st.cache_limit_bytes;
    m->st.cache_limit_bytes = bytes; /* a larger cache is trimmed at the next allocation */
    pthread_mutex_unlock(&m->lock);
    return previous;
}

int64_t llmem_mem_set_memory_limit(struct llmem_mem *m, int64_t bytes) {
    LLMEM_ASSERT(bytes >= 0);
    pthread_mutex_lock(&m->lock);
    int64_t previous = m->st.memory_limit_bytes;
    m->st.memory_limit_bytes = bytes;
    make_room(m, 0); /* the cache gives way now; active buffers stay */
    pthread_mutex_unlock(&m->lock);
    return previous;
}

void llmem_mem_clear_cache(struct llmem_mem *m) {
    pthread_mutex_lock(&m->lock);
    trim_cache(m, 0);
    pthread_mutex_unlock(&m->lock);
}

int llmem_mem_set_wired_limit(struct llmem_mem *m, int64_t bytes, int64_t *previous) {
    if (m->ops.lock == NULL) {
        LLMEM_ERROR("%s memory cannot be wired", m->ops.name);
        return LLMEM_EUNSUPPORTED;
    }
    if (bytes < 0) {
        LLMEM_ERROR("a wired limit cannot be negative (%" PRId64 ")", bytes);
        return LLMEM_EINVAL;
    }
    int64_t rlimit = llmem_sys_memlock_limit();
    if (rlimit >= 0 && bytes > rlimit) {
        LLMEM_ERROR("a wired limit of %s is above RLIMIT_MEMLOCK (%s); raise it first, e.g."
                    " `ulimit -l %" PRId64 "` (KiB) in the shell that starts llmem, `memlock` in"
                    " /etc/security/limits.conf, or LimitMEMLOCK= in a systemd unit",
                    SZ(bytes), SZ(rlimit), (bytes + 1023) / 1024);
        return LLMEM_EINVAL;
    }
    pthread_mutex_lock(&m->lock);
    if (previous != NULL)
        *previous = m->st.wired_limit_bytes;
    m->st.wired_limit_bytes = bytes;
    for (size_t i = 0; i < m->active.cap; i++) {
        if (m->active.keys[i] == 0)
            continue;
        struct block *b = m->active.vals[i];
        if (b->wired && m->st.wired_bytes > bytes)
            unwire(m, b);
        else if (wire_eligible(b))
            wire(m, b);
    }
    pthread_mutex_unlock(&m->lock);
    return LLMEM_OK;
}

int64_t llmem_mem_active(struct llmem_mem *m) {
    pthread_mutex_lock(&m->lock);
    int64_t v = m->st.active_bytes;
    pthread_mutex_unlock(&m->lock);
    return v;
}

int64_t llmem_mem_peak(struct llmem_mem *m) {
    pthread_mutex_lock(&m->lock);
    int64_t v = m->st.peak_bytes;
    pthread_mutex_unlock(&m->lock);
    return v;
}

void llmem_mem_reset_peak(struct llmem_mem *m) {
    pthread_mutex_lock(&m->lock);
    m->st.peak_bytes = m->st.active_bytes;
    for (int t = 0; t < LLMEM_TAG_COUNT; t++)
        m->st.tags[t].peak_bytes = m->st.tags[t].active_bytes;
    pthread_mutex_unlock(&m->lock);
}

int64_t llmem_mem_cache_size(struct llmem_mem *m) {
    pthread_mutex_lock(&m->lock);
    int64_t v = m->st.cache_bytes;
    pthread_mutex_unlock(&m->lock);
    return v;
}

void llmem_mem_stats(struct llmem_mem *m, struct llmem_mem_stats *stats) {
    pthread_mutex_lock(&m->lock);
    *stats = m->st;
    pthread_mutex_unlock(&m->lock);
}

char *llmem_mem_stats_json(struct llmem_mem *m) {
    struct llmem_mem_stats st;
    llmem_mem_stats(m, &st);
    cJSON *o = cJSON_CreateObject();
    int bad = o == NULL || llmem_json_add_string(o, "kind", m->ops.name) != LLMEM_OK;
#define LLMEM_MEM_STATS_JSON_(name) bad |= !bad && llmem_json_add_int(o, #name, st.name) != 0;
    LLMEM_MEM_STATS_FIELDS(LLMEM_MEM_STATS_JSON_)
#undef LLMEM_MEM_STATS_JSON_
    cJSON *tags = bad ? NULL : cJSON_AddObjectToObject(o, "tags");
    bad |= tags == NULL;
    for (int t = 0; !bad && t < LLMEM_TAG_COUNT; t++) {
        cJSON *to = cJSON_AddObjectToObject(tags, llmem_mem_tag_name((enum llmem_mem_tag)t));
        bad |= to == NULL || llmem_json_add_int(to, "active_bytes", st.tags[t].active_bytes) ||
               llmem_json_add_int(to, "peak_bytes", st.tags[t].peak_bytes) ||
               llmem_json_add_int(to, "n_active", st.tags[t].n_active);
    }
    char *text = bad ? NULL : llmem_json_print(o, 0);
    if (bad)
        LLMEM_ERROR("out of memory");
    cJSON_Delete(o);
    return text;
}

/* ---- the invariant checker --------------------------------------------------------------------
 */

int llmem_mem_check(struct llmem_mem *m) {
    int status = LLMEM_OK;
    pthread_mutex_lock(&m->lock);
    const struct llmem_mem_stats *st = &m->st;
    int64_t tag_bytes[LLMEM_TAG_COUNT] = {0}, tag_n[LLMEM_TAG_COUNT] = {0};
    int64_t active = 0, requested = 0, wired = 0, n = 0;
    for (size_t i = 0; i < m->active.cap; i++) {
        if (m->active.keys[i] == 0)
            continue;
        const struct block *b = m->active.vals[i];
        n++;
        LLMEM_INVARIANT(b->ptr == m->active.keys[i], "map key and block address differ");
        LLMEM_INVARIANT(b->state == BLOCK_ACTIVE || b->state == BLOCK_TRACKED,
                        "a mapped block is cached");
        LLMEM_INVARIANT(
            b->state == BLOCK_TRACKED ||
                b->size == llmem_mem_alloc_size(m, b->requested, (enum llmem_mem_tag)b->tag),
            "a buffer of %zu bytes is not the class of its request %zu", b->size, b->requested);
        LLMEM_INVARIANT(b->tag < LLMEM_TAG_COUNT, "bad tag %d", b->tag);
        tag_bytes[b->tag] += (int64_t)b->size;
        tag_n[b->tag]++;
        active += (int64_t)b->size;
        requested += (int64_t)b->requested;
        wired += b->wired ? (int64_t)b->size : 0;
    }
    LLMEM_INVARIANT((size_t)n == m->active.n, "the map holds %zu entries, %" PRId64 " found",
                    m->active.n, n);
    LLMEM_INVARIANT(active == st->active_bytes, "active %" PRId64 " != sum of buffers %" PRId64,
                    st->active_bytes, active);
    LLMEM_INVARIANT(requested == st->requested_bytes, "requested bytes disagree");
    LLMEM_INVARIANT(wired == st->wired_bytes && wired <= st->wired_limit_bytes,
                    "wired bytes disagree");
    int64_t tag_sum = 0;
    for (int t = 0; t < LLMEM_TAG_COUNT; t++) {
        LLMEM_INVARIANT(
            tag_bytes[t] == st->tags[t].active_bytes && tag_n[t] == st->tags[t].n_active,
            "tag %s disagrees with its buffers", llmem_mem_tag_name((enum llmem_mem_tag)t));
        LLMEM_INVARIANT(st->tags[t].peak_bytes >= st->tags[t].active_bytes,
                        "tag peak below active");
        tag_sum += st->tags[t].active_bytes;
    }
    LLMEM_INVARIANT(tag_sum == st->active_bytes, "per-tag sum %" PRId64 " != active %" PRId64,
                    tag_sum, st->active_bytes);
    LLMEM_INVARIANT(st->peak_bytes >= st->active_bytes, "peak below active");

    int64_t cached = 0, n_cached = 0;
    const struct block *prev = NULL;
    for (const struct block *b = m->lru_head; b != NULL; prev = b, b = b->lru_next) {
        LLMEM_INVARIANT(b->state == BLOCK_CACHED, "a block in the LRU is not cached");
        LLMEM_INVARIANT(b->lru_prev == prev, "LRU links are broken");
        LLMEM_INVARIANT(!b->wired, "a cached block is wired");
        LLMEM_INVARIANT(map_find(&m->active, b->ptr) < 0, "a cached buffer is also active");
        cached += (int64_t)b->size;
        n_cached++;
    }
    LLMEM_INVARIANT(prev == m->lru_tail, "the LRU tail is wrong");
    LLMEM_INVARIANT(cached == st->cache_bytes && n_cached == st->n_cached,
                    "cache %" PRId64 " bytes in %" PRId64 " buffers, counted %" PRId64
                    " in %" PRId64,
                    cached, n_cached, st->cache_bytes, st->n_cached);
    int64_t in_classes = 0;
    for (size_t i = 0; i < m->classes.cap; i++) {
        if (m->classes.keys[i] == 0)
            continue;
        const struct block *p = NULL;
        for (const struct block *b = m->classes.vals[i]; b != NULL; p = b, b = b->cls_next) {
            LLMEM_INVARIANT(b->size == m->classes.keys[i], "a block is in the wrong class list");
            LLMEM_INVARIANT(b->state == BLOCK_CACHED && b->cls_prev == p,
                            "class list links are broken");
            in_classes++;
        }
    }
    LLMEM_INVARIANT(in_classes == n_cached, "class lists hold %" PRId64 " blocks, the LRU %" PRId64,
                    in_classes, n_cached);
out:
    pthread_mutex_unlock(&m->lock);
    return status;
}
