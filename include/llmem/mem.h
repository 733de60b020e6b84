/*
 * llmem/mem.h — the caching allocator (SPEC §3.2: the MLX allocator's semantics, on Linux).
 *
 * Every model-sized byte llmem uses comes from an allocator object, one per memory kind (host
 * memory now; CUDA device memory and pinned host memory plug in through a small table of raw
 * alloc/free functions). Freed buffers go to a buffer cache keyed by size class and are reused;
 * the operating system (or driver) is called only on a miss.
 *
 * Size classes: a request of n bytes is served from a buffer of class(n) bytes:
 *   n ≤ 128                 rounded up to 16 bytes
 *   128 < n                 rounded up to a step of 2^⌊log2 n⌋ / 8 (at least 16 bytes), so the
 *                           waste class(n) − n is below n / 8: at most 12.5 %
 *   n ≥ large_min (32 KiB)  the step is also at least one page (the buffer is page-aligned, from
 *                           mmap) and at most 2 MiB, so a 10 GiB buffer wastes under 2 MiB
 * but a large buffer of weights or KV is whole pages where that is less than its class
 * (llmem_mem_alloc_size): made once for a model's life, it never needs a class's reuse.
 * Small buffers are 64-byte aligned (posix_memalign); large ones are page-aligned (mmap).
 *
 * Limits: the memory limit bounds active + cached bytes. An allocation that would pass it first
 * releases cached buffers (least recently freed first), then fails with LLMEM_ENOMEM and a message
 * with the numbers; so does one the OS refuses even after the cache is released. Nothing crashes
 * and nothing is left to the OOM killer. The cache limit bounds the cache: a free that would pass
 * it releases the buffer instead of caching it (limit 0: no caching), and an allocation first
 * trims a cache above its limit (after the limit was lowered). A free never caches past the
 * memory limit either, so active + cache ≤ memory limit holds whenever the cache is not empty.
 *
 * Every function is thread-safe (one mutex per allocator; the hot path is a few hash lookups).
 */
#ifndef LLMEM_MEM_H
#define LLMEM_MEM_H

#include "llmem/api.h"

#include <stddef.h>
#include <stdint.h>

#include "llmem/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a buffer is for: accounting per tag attributes a peak to weights, KV, bank or scratch. */
enum llmem_mem_tag {
    LLMEM_TAG_WEIGHTS = 0,
    LLMEM_TAG_KV,
    LLMEM_TAG_BANK,
    LLMEM_TAG_SCRATCH,
    LLMEM_TAG_OTHER,
    LLMEM_TAG_COUNT
};
LLMEM_API const char *llmem_mem_tag_name(enum llmem_mem_tag tag); /* "weights", "kv", ... */

/* The raw memory of one kind. alloc returns NULL on failure; lock/unlock are optional (NULL:
 * the kind cannot be wired). `large_min` is where page-aligned classes begin (0: 32 KiB). */
struct llmem_mem_raw_ops {
    const char *name; /* "host", "cuda", "pinned" */
    void *(*alloc)(void *ctx, size_t bytes, int large);
    void (*free)(void *ctx, void *ptr, size_t bytes, int large);
    int (*lock)(void *ctx, void *ptr, size_t bytes);    /* (optional) 0 on success */
    void (*unlock)(void *ctx, void *ptr, size_t bytes); /* (optional) */
    void *ctx;
    size_t large_min;
};

/* The host kind: posix_memalign below large_min, mmap/munmap above, mlock/munlock for wiring. */
LLMEM_API const struct llmem_mem_raw_ops *llmem_mem_host_ops(void);

#define LLMEM_MEM_UNLIMITED INT64_MAX

struct llmem_mem_config {
    const struct llmem_mem_raw_ops *ops; /* NULL: the host kind */
    int64_t memory_limit_bytes;          /* 0: LLMEM_MEM_UNLIMITED */
    int64_t cache_limit_bytes;           /* < 0: llmem_mem_default_cache_limit(usable_bytes), at
                                          * most memory_limit_bytes */
    int64_t usable_bytes;                /* the plan's engine budget, for the default cache limit */
};

/* clamp(usable / 8, 256 MiB, 8 GiB); 256 MiB when usable ≤ 0 (unknown). */
LLMEM_API int64_t llmem_mem_default_cache_limit(int64_t usable_bytes);

struct llmem_mem; /* an allocator */

/* Creates an allocator (the destructor is llmem_mem_destroy, because llmem_mem_free returns a
 * buffer). LLMEM_ENOMEM or LLMEM_EINVAL (logged). */
LLMEM_API int llmem_mem_create(const struct llmem_mem_config *config, struct llmem_mem **out);
/* Releases every cached buffer and the allocator. Buffers still active are released too, with
 * one WARN line saying how many (a leak in the caller). NULL is a no-op. */
LLMEM_API void llmem_mem_destroy(struct llmem_mem *mem);

/* A buffer of at least `bytes` (> 0), or NULL with LLMEM_ENOMEM logged (the limit and the numbers,
 * or the OS refusal). */
LLMEM_API void *llmem_mem_alloc(struct llmem_mem *mem, size_t bytes, enum llmem_mem_tag tag);
/* Returns a buffer to the cache (or to the OS when the cache is full). NULL is a no-op; a pointer
 * this allocator did not hand out is API misuse (LLMEM_ASSERT). */
LLMEM_API void llmem_mem_free(struct llmem_mem *mem, void *ptr);

/* Records memory the allocator did not allocate (memory-mapped weights, used in place) under a
 * tag, so that active bytes, peaks and the memory limit see it; LLMEM_ENOMEM (logged) when it
 * would pass the memory limit. Untrack forgets it (the caller unmaps). */
LLMEM_API int llmem_mem_track(struct llmem_mem *mem, void *ptr, size_t bytes,
                              enum llmem_mem_tag tag);
LLMEM_API void llmem_mem_untrack(struct llmem_mem *mem, void *ptr);

/* The class size a request of `bytes` is served from (see the top of this file). */
LLMEM_API size_t llmem_mem_size_class(const struct llmem_mem *mem, size_t bytes);
/* The bytes a request of `bytes` under `tag` takes: its class size, but for a large buffer of
 * weights or KV (made once for a model's life, never reused at another size) whole pages, where
 * that is less: the plan's weights and KV are what they hold, not up to 12.5 % more. */
LLMEM_API size_t llmem_mem_alloc_size(const struct llmem_mem *mem, size_t bytes,
                                      enum llmem_mem_tag tag);

/* Limits. Each setter returns the previous value. */
LLMEM_API int64_t llmem_mem_set_cache_limit(struct llmem_mem *mem,
                                            int64_t bytes); /* 0 disables it */
LLMEM_API int64_t llmem_mem_set_memory_limit(struct llmem_mem *mem,
                                             int64_t bytes); /* or UNLIMITED */
/* Releases every cached buffer now; active buffers are untouched. */
LLMEM_API void llmem_mem_clear_cache(struct llmem_mem *mem);
/* Wires (mlock) up to `bytes` of weights and KV buffers, tracked ones included, and unwires past
 * a lowered limit. LLMEM_EINVAL (logged, with the command that raises it) above RLIMIT_MEMLOCK,
 * LLMEM_EUNSUPPORTED for a kind that cannot be wired. *previous gets the old limit (may be NULL).
 */
LLMEM_API int llmem_mem_set_wired_limit(struct llmem_mem *mem, int64_t bytes, int64_t *previous);

LLMEM_API int64_t
llmem_mem_active(struct llmem_mem *mem);                 /* bytes in buffers handed out + tracked */
LLMEM_API int64_t llmem_mem_peak(struct llmem_mem *mem); /* the high-water mark of active */
LLMEM_API void llmem_mem_reset_peak(struct llmem_mem *mem);    /* peak := active (also per tag) */
LLMEM_API int64_t llmem_mem_cache_size(struct llmem_mem *mem); /* bytes in cached buffers */

/* Statistics: one list, exported as a struct and as JSON. */
#define LLMEM_MEM_STATS_FIELDS(X)                                                                  \
    X(active_bytes)    /* buffers handed out + tracked memory */                                   \
    X(peak_bytes)      /* high-water mark of active_bytes since the last reset */                  \
    X(requested_bytes) /* what the active buffers were asked for (waste = active − this) */      \
    X(cache_bytes)     /* buffers in the cache */                                                  \
    X(n_cached)        /* how many */                                                              \
    X(cache_limit_bytes)                                                                           \
    X(memory_limit_bytes) /* LLMEM_MEM_UNLIMITED when none */                                      \
    X(wired_bytes)                                                                                 \
    X(wired_limit_bytes)                                                                           \
    X(n_allocs)                                                                                    \
    X(n_frees)                                                                                     \
    X(cache_hits)                                                                                  \
    X(cache_misses)                                                                                \
    X(os_allocs)      /* raw allocations (the OS or driver was called) */                          \
    X(os_frees)       /* raw releases */                                                           \
    X(evictions)      /* cached buffers released: cache limit, memory limit, clear, pressure */    \
    X(limit_refusals) /* allocations refused by the memory limit */                                \
    X(os_failures)    /* raw allocations the OS refused */                                         \
    X(wire_failures)  /* mlock calls that failed (the buffer stays unwired) */

#define LLMEM_MEM_STATS_FIELD_(name) int64_t name;
struct llmem_mem_tag_stats {
    int64_t active_bytes;
    int64_t peak_bytes;
    int64_t n_active;
};
struct llmem_mem_stats {
    LLMEM_MEM_STATS_FIELDS(LLMEM_MEM_STATS_FIELD_)
    struct llmem_mem_tag_stats tags[LLMEM_TAG_COUNT];
};
#undef LLMEM_MEM_STATS_FIELD_

LLMEM_API void llmem_mem_stats(struct llmem_mem *mem, struct llmem_mem_stats *stats);
/* The stats as one JSON object (malloc'ed; free with free()); NULL on out of memory (logged). */
LLMEM_API char *llmem_mem_stats_json(struct llmem_mem *mem);

/* Checks every invariant (per-tag sums equal the totals, the cache lists and byte counts agree,
 * limits hold where they must); LLMEM_OK or LLMEM_EFORMAT with the broken invariant logged.
 * O(number of buffers): for tests and debug builds. */
LLMEM_API int llmem_mem_check(struct llmem_mem *mem);

/* ---------------------------------------------------------------------------------------------
 * Fault injection, for every test in the project: the n-th allocation attempt from now (counting
 * raw allocations and the allocator's own bookkeeping, in every allocator) fails as if the OS had
 * refused it. n ≤ 0 disarms. llmem_mem_fault_pending() says whether the armed fault has not
 * fired yet (so a test can tell that its whole sequence ran past it).
 *
 * A single refusal is usually absorbed (the allocator releases its cache and retries), so
 * llmem_mem_fault_inject_count() arms a run of them: the n-th attempt and the count − 1 after it
 * fail; count < 0 (LLMEM_MEM_FAULT_PERSIST): every attempt from the n-th on fails, until
 * disarmed with n ≤ 0 (or count 0). llmem_mem_fault_inject(n) is the count 1.
 * ------------------------------------------------------------------------------------------- */
#define LLMEM_MEM_FAULT_PERSIST (-1)
LLMEM_API void llmem_mem_fault_inject(int64_t n);
LLMEM_API void llmem_mem_fault_inject_count(int64_t n, int64_t count);
LLMEM_API int llmem_mem_fault_pending(void);

#ifdef __cplusplus
}
#endif

#endif
