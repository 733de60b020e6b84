/*
 * tests/test-mem.c — the caching allocator: reuse, the cache and memory limits, clear_cache and
 * RSS, peaks, per-tag accounting, the waste bound, threads, wiring, tracked memory, fault
 * injection at every step, and a seeded stress test that checks every invariant after every
 * operation. `test-mem [seed] [ops]` scales the stress test.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "core/json.h"
#include "llmem/mem.h"
#include "llmem/sys.h"
#include "testutil.h"

#define MiB ((size_t)1 << 20)

static uint64_t stress_seed = 0x5eed;
static int stress_ops = 20000;

static struct llmem_mem *new_mem(int64_t memory_limit, int64_t cache_limit) {
    struct llmem_mem_config cfg = {.memory_limit_bytes = memory_limit,
                                   .cache_limit_bytes = cache_limit};
    struct llmem_mem *m = NULL;
    assert_int_equal(llmem_mem_create(&cfg, &m), LLMEM_OK);
    return m;
}

static struct llmem_mem_stats stats_of(struct llmem_mem *m) {
    struct llmem_mem_stats st;
    llmem_mem_stats(m, &st);
    return st;
}

static int64_t rss_bytes(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    long size = 0, resident = 0;
    assert_non_null(f);
    assert_int_equal(fscanf(f, "%ld %ld", &size, &resident), 2);
    fclose(f);
    return (int64_t)resident * sysconf(_SC_PAGESIZE);
}

static uint64_t next_rand(uint64_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

static void test_cache_hit_reuse(void **state) {
    (void)state;
    struct llmem_mem *m = new_mem(0, 64 * MiB);
    void *p = llmem_mem_alloc(m, MiB, LLMEM_TAG_SCRATCH);
    assert_non_null(p);
    memset(p, 1, MiB);
    llmem_mem_free(m, p);
    assert_int_equal(llmem_mem_cache_size(m), MiB);
    /* The same class (a slightly smaller request) is served from the cache. */
    void *q = llmem_mem_alloc(m, MiB - 1000, LLMEM_TAG_KV);
    assert_ptr_equal(q, p);
    struct llmem_mem_stats st = stats_of(m);
    assert_int_equal(st.cache_hits, 1);
    assert_int_equal(st.cache_misses, 1);
    assert_int_equal(st.os_allocs, 1);
    assert_int_equal(st.cache_bytes, 0);
    assert_int_equal(st.tags[LLMEM_TAG_KV].active_bytes, MiB);
    assert_int_equal(st.requested_bytes, MiB - 1000);
    /* Small buffers are reused too, and are 64-byte aligned. */
    void *s = llmem_mem_alloc(m, 100, LLMEM_TAG_OTHER);
    assert_int_equal((uintptr_t)s % 64, 0);
    llmem_mem_free(m, s);
    assert_ptr_equal(llmem_mem_alloc(m, 97, LLMEM_TAG_OTHER), s);
    /* Large buffers are page-aligned. */
    assert_int_equal((uintptr_t)q % (uintptr_t)sysconf(_SC_PAGESIZE), 0);
    llmem_mem_free(m, s);
    llmem_mem_free(m, q);
    assert_int_equal(llmem_mem_check(m), LLMEM_OK);
    llmem_mem_destroy(m);
}

static void test_cache_limit_zero_disables(void **state) {
    (void)state;
    struct llmem_mem *m = new_mem(0, 64 * MiB);
    assert_int_equal(llmem_mem_set_cache_limit(m, 0), 64 * MiB);
    for (int i = 0; i < 3; i++) {
        void *p = llmem_mem_alloc(m, MiB, LLMEM_TAG_SCRATCH);
        assert_non_null(p);
        llmem_mem_free(m, p);
        assert_int_equal(llmem_mem_cache_size(m), 0);
    }
    struct llmem_mem_stats st = stats_of(m);
    assert_int_equal(st.cache_hits, 0);
    assert_int_equal(st.os_allocs, 3);
    assert_int_equal(st.os_frees, 3);
    assert_int_equal(llmem_mem_set_cache_limit(m, 5), 0);
    llmem_mem_destroy(m);
}

static void test_lowering_cache_limit_releases_on_next_alloc(void **state) {
    (void)state;
    struct llmem_mem *m = new_mem(0, 64 * MiB);
    void *p[4];
    for (int i = 0; i < 4; i++)
        p[i] = llmem_mem_alloc(m, MiB, LLMEM_TAG_SCRATCH);
    for (int i = 0; i < 4; i++)
        llmem_mem_free(m, p[i]); /* p[0] is the least recently freed */
    assert_int_equal(llmem_mem_cache_size(m), 4 * MiB);
    llmem_mem_set_cache_limit(m, MiB);
    assert_int_equal(llmem_mem_cache_size(m), 4 * MiB); /* not yet */
    void *small = llmem_mem_alloc(m, 64, LLMEM_TAG_OTHER);
    assert_int_equal(llmem_mem_cache_size(m), MiB);
    assert_int_equal(stats_of(m).evictions, 3);
    /* The survivor is the most recently freed. */
    assert_ptr_equal(llmem_mem_alloc(m, MiB, LLMEM_TAG_SCRATCH), p[3]);
    llmem_mem_free(m, p[3]);
    llmem_mem_free(m, small);
    assert_int_equal(llmem_mem_check(m), LLMEM_OK);
    llmem_mem_destroy(m);
}

static void test_clear_cache_returns_memory(void **state) {
    (void)state;
    struct llmem_mem *m = new_mem(0, 1024 * MiB);
    const size_t big = 64 * MiB;
    void *keep = llmem_mem_alloc(m, MiB, LLMEM_TAG_WEIGHTS);
    void *p[4];
    for (int i = 0; i < 4; i++) {
        p[i] = llmem_mem_alloc(m, big, LLMEM_TAG_SCRATCH);
        assert_non_null(p[i]);
        memset(p[i], 7, big); /* resident */
    }
    for (int i = 0; i < 4; i++)
        llmem_mem_free(m, p[i]);
    int64_t active = llmem_mem_active(m);
    int64_t rss_before = rss_bytes();
    assert_int_equal(llmem_mem_cache_size(m), 4 * big);
    llmem_mem_clear_cache(m);
    int64_t rss_after = rss_bytes();
    assert_int_equal(llmem_mem_cache_size(m), 0);
    assert_int_equal(llmem_mem_active(m), active);
    /* The cached buffers' pages went back to the system. */
    assert_true(rss_before - rss_after >= (int64_t)(3 * big));
    llmem_mem_free(m, keep);
    llmem_mem_destroy(m);
}

static void test_memory_limit_refusal_and_recovery(void **state) {
    (void)state;
    struct llmem_mem *m = new_mem(10 * (int64_t)MiB, 64 * MiB);
    void *a = llmem_mem_alloc(m, 4 * MiB, LLMEM_TAG_KV);
    void *b = llmem_mem_alloc(m, 4 * MiB, LLMEM_TAG_KV);
    assert_non_null(a);
    assert_non_null(b);
    assert_null(llmem_mem_alloc(m, 4 * MiB, LLMEM_TAG_KV));
    assert_non_null(strstr(llmem_last_error(), "4.0M for kv would pass the memory limit 10.0M"));
    assert_non_null(strstr(llmem_last_error(), "active 8.0M"));
    assert_int_equal(stats_of(m).limit_refusals, 1);
    assert_int_equal(llmem_mem_check(m), LLMEM_OK);
    /* Recovery: a free makes room (through the cache). */
    llmem_mem_free(m, a);
    void *c = llmem_mem_alloc(m, 4 * MiB, LLMEM_TAG_KV);
    assert_ptr_equal(c, a);
    /* The cache is released before a refusal: 8M cached + 2M active, then 6M is asked for. */
    llmem_mem_free(m, b);
    llmem_mem_free(m, c);
    void *d = llmem_mem_alloc(m, 2 * MiB, LLMEM_TAG_SCRATCH); /* class miss: 2M fresh */
    assert_non_null(d);
    assert_int_equal(llmem_mem_cache_size(m), 8 * MiB);
    void *e = llmem_mem_alloc(m, 6 * MiB, LLMEM_TAG_SCRATCH);
    assert_non_null(e);
    assert_int_equal(llmem_mem_cache_size(m), 0);
    assert_int_equal(stats_of(m).evictions, 2);
    assert_true(llmem_mem_active(m) + llmem_mem_cache_size(m) <= 10 * (int64_t)MiB);
    /* Raising the limit lifts the refusal; lowering it releases the cache now. */
    assert_null(llmem_mem_alloc(m, 4 * MiB, LLMEM_TAG_KV));
    assert_int_equal(llmem_mem_set_memory_limit(m, LLMEM_MEM_UNLIMITED), 10 * (int64_t)MiB);
    void *f = llmem_mem_alloc(m, 4 * MiB, LLMEM_TAG_KV);
    assert_non_null(f);
    llmem_mem_free(m, f);
    assert_int_equal(llmem_mem_cache_size(m), 4 * MiB);
    llmem_mem_set_memory_limit(m, 8 * (int64_t)MiB);
    assert_int_equal(llmem_mem_cache_size(m), 0);
    /* A request above the limit by itself. */
    assert_null(llmem_mem_alloc(m, 100 * MiB, LLMEM_TAG_WEIGHTS));
    llmem_mem_free(m, d);
    llmem_mem_free(m, e);
    assert_int_equal(llmem_mem_check(m), LLMEM_OK);
    llmem_mem_destroy(m);
}

static void test_peak_and_reset(void **state) {
    (void)state;
    struct llmem_mem *m = new_mem(0, 0);
    void *a = llmem_mem_alloc(m, MiB, LLMEM_TAG_WEIGHTS);
    void *b = llmem_mem_alloc(m, 2 * MiB, LLMEM_TAG_SCRATCH);
    assert_int_equal(llmem_mem_peak(m), 3 * MiB);
    llmem_mem_free(m, b);
    assert_int_equal(llmem_mem_peak(m), 3 * MiB);
    assert_int_equal(llmem_mem_active(m), MiB);
    struct llmem_mem_stats st = stats_of(m);
    assert_int_equal(st.tags[LLMEM_TAG_SCRATCH].peak_bytes, 2 * MiB);
    assert_int_equal(st.tags[LLMEM_TAG_SCRATCH].active_bytes, 0);
    llmem_mem_reset_peak(m);
    assert_int_equal(llmem_mem_peak(m), MiB);
    st = stats_of(m);
    assert_int_equal(st.tags[LLMEM_TAG_SCRATCH].peak_bytes, 0);
    assert_int_equal(st.tags[LLMEM_TAG_WEIGHTS].peak_bytes, MiB);
    llmem_mem_free(m, a);
    assert_int_equal(llmem_mem_peak(m), MiB);
    llmem_mem_destroy(m);
}

static void test_per_tag_sums(void **state) {
    (void)state;
    struct llmem_mem *m = new_mem(0, 64 * MiB);
    void *p[50];
    uint64_t x = 42;
    for (int i = 0; i < 50; i++)
        p[i] = llmem_mem_alloc(m, 1 + next_rand(&x) % (3 * MiB),
                               (enum llmem_mem_tag)(next_rand(&x) % LLMEM_TAG_COUNT));
    struct llmem_mem_stats st = stats_of(m);
    int64_t sum = 0, n = 0;
    for (int t = 0; t < LLMEM_TAG_COUNT; t++) {
        sum += st.tags[t].active_bytes;
        n += st.tags[t].n_active;
    }
    assert_int_equal(sum, st.active_bytes);
    assert_int_equal(n, 50);
    assert_int_equal(llmem_mem_check(m), LLMEM_OK);
    char *json = llmem_mem_stats_json(m);
    cJSON *o = NULL;
    assert_int_equal(llmem_json_parse(json, strlen(json), "stats", &o), LLMEM_OK);
    int64_t v = 0;
    assert_int_equal(llmem_json_get_int(o, "active_bytes", &v), LLMEM_OK);
    assert_int_equal(v, st.active_bytes);
    cJSON *kv = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(o, "tags"), "kv");
    assert_int_equal(llmem_json_get_int(kv, "active_bytes", &v), LLMEM_OK);
    assert_int_equal(v, st.tags[LLMEM_TAG_KV].active_bytes);
    cJSON_Delete(o);
    free(json);
    for (int i = 0; i < 50; i++)
        llmem_mem_free(m, p[i]);
    assert_int_equal(llmem_mem_active(m), 0);
    llmem_mem_destroy(m);
}

static void test_waste_bound(void **state) {
    (void)state;
    struct llmem_mem *m = new_mem(0, 0);
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uint64_t x = 7;
    for (int i = 0; i < 200000; i++) {
        size_t n = i < 70000 ? (size_t)i + 1 : (size_t)(next_rand(&x) >> (next_rand(&x) % 60));
        if (n == 0)
            continue;
        size_t c = llmem_mem_size_class(m, n);
        assert_true(c >= n);
        if (n <= 128)
            assert_true(c - n < 16);
        else
            assert_true((c - n) * 8 < n); /* strictly below 12.5 % */
        assert_int_equal(llmem_mem_size_class(m, c), c);
        if (c >= 32768)
            assert_int_equal(c % page, 0);
        if (n >= (size_t)1 << 30)
            assert_true(c - n < 2 * MiB); /* big buffers waste under 2 MiB */
        /* a large buffer of weights or KV: whole pages, never more than its class */
        const size_t kv = llmem_mem_alloc_size(m, n, LLMEM_TAG_KV);
        assert_int_equal(llmem_mem_alloc_size(m, n, LLMEM_TAG_SCRATCH), c);
        assert_true(kv >= n && kv <= c);
        if (n >= 32768)
            assert_true(kv % page == 0 && kv - n < page);
    }
    /* one layer's KV of 4.25 MiB is held in 4.25 MiB, not its class's 4.5 */
    void *layer = llmem_mem_alloc(m, 4 * MiB + MiB / 4, LLMEM_TAG_KV);
    assert_non_null(layer);
    assert_int_equal(llmem_mem_active(m), 4 * MiB + MiB / 4);
    llmem_mem_free(m, layer);
    /* Measured on real allocations: requested vs held. */
    void *p[64];
    for (int i = 0; i < 64; i++)
        p[i] = llmem_mem_alloc(m, 1000 + (size_t)i * 77777, LLMEM_TAG_SCRATCH);
    struct llmem_mem_stats st = stats_of(m);
    assert_true((st.active_bytes - st.requested_bytes) * 8 < st.requested_bytes);
    for (int i = 0; i < 64; i++)
        llmem_mem_free(m, p[i]);
    llmem_mem_destroy(m);
}

struct thread_arg {
    struct llmem_mem *m;
    uint64_t seed;
};

static void *thread_body(void *p) {
    struct thread_arg *a = p;
    void *live[32] = {0};
    for (int i = 0; i < 20000; i++) {
        int k = (int)(next_rand(&a->seed) % 32);
        if (live[k] != NULL) {
            llmem_mem_free(a->m, live[k]);
            live[k] = NULL;
        } else {
            size_t n = 16 + next_rand(&a->seed) % (256 << 10);
            live[k] = llmem_mem_alloc(a->m, n, (enum llmem_mem_tag)(k % LLMEM_TAG_COUNT));
            if (live[k] != NULL)
                ((char *)live[k])[n - 1] = 1;
        }
        if (i % 5000 == 0)
            (void)llmem_mem_active(a->m);
    }
    for (int k = 0; k < 32; k++)
        llmem_mem_free(a->m, live[k]);
    return NULL;
}

static void test_threads(void **state) {
    (void)state;
    struct llmem_mem *m = new_mem(0, 32 * MiB);
    pthread_t t[4];
    struct thread_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (struct thread_arg){m, 1000 + (uint64_t)i};
        assert_int_equal(pthread_create(&t[i], NULL, thread_body, &args[i]), 0);
    }
    for (int i = 0; i < 4; i++)
        pthread_join(t[i], NULL);
    assert_int_equal(llmem_mem_active(m), 0);
    assert_int_equal(llmem_mem_check(m), LLMEM_OK);
    struct llmem_mem_stats st = stats_of(m);
    assert_int_equal(st.n_allocs, st.n_frees);
    assert_true(st.cache_hits > 0);
    llmem_mem_destroy(m);
}

static void test_wired_limit(void **state) {
    (void)state;
    struct llmem_mem *m = new_mem(0, 0);
    /* an unlimited RLIMIT_MEMLOCK (as root may have) is lowered for the test, so that a limit
     * above it is refused on every machine */
    struct rlimit saved;
    assert_int_equal(getrlimit(RLIMIT_MEMLOCK, &saved), 0);
    if (saved.rlim_cur == RLIM_INFINITY) {
        struct rlimit lower = {8 * MiB, saved.rlim_max};
        assert_int_equal(setrlimit(RLIMIT_MEMLOCK, &lower), 0);
    }
    int64_t rlimit = llmem_sys_memlock_limit();
    int64_t prev = -1;
    assert_true(rlimit >= 0);
    assert_int_equal(llmem_mem_set_wired_limit(m, rlimit + 4096, &prev), LLMEM_EINVAL);
    assert_non_null(strstr(llmem_last_error(), "above RLIMIT_MEMLOCK"));
    assert_non_null(strstr(llmem_last_error(), "ulimit -l"));
    assert_int_equal(llmem_mem_set_wired_limit(m, -1, NULL), LLMEM_EINVAL);
    int64_t limit = rlimit < 4 * (int64_t)MiB ? rlimit : 4 * (int64_t)MiB;
    assert_int_equal(llmem_mem_set_wired_limit(m, limit, &prev), LLMEM_OK);
    assert_int_equal(prev, 0);
    void *w = llmem_mem_alloc(m, (size_t)limit / 2, LLMEM_TAG_WEIGHTS);
    void *s = llmem_mem_alloc(m, (size_t)limit / 2, LLMEM_TAG_SCRATCH);
    struct llmem_mem_stats st = stats_of(m);
    /* Weights are wired (unless mlock itself failed, which is counted); scratch never is. */
    assert_int_equal(st.wired_bytes + (st.wire_failures > 0 ? (int64_t)limit / 2 : 0),
                     (int64_t)limit / 2);
    assert_true(st.wired_bytes <= limit);
    /* Past the limit nothing more is wired. */
    void *k = llmem_mem_alloc(m, (size_t)limit, LLMEM_TAG_KV);
    assert_true(stats_of(m).wired_bytes <= limit);
    /* Lowering the limit unwires. */
    assert_int_equal(llmem_mem_set_wired_limit(m, 0, &prev), LLMEM_OK);
    assert_int_equal(prev, limit);
    assert_int_equal(stats_of(m).wired_bytes, 0);
    assert_int_equal(llmem_mem_check(m), LLMEM_OK);
    llmem_mem_free(m, w);
    llmem_mem_free(m, s);
    llmem_mem_free(m, k);
    llmem_mem_destroy(m);
    assert_int_equal(setrlimit(RLIMIT_MEMLOCK, &saved), 0);
}

static void test_tracked_memory(void **state) {
    (void)state;
    struct llmem_mem *m = new_mem(64 * (int64_t)MiB, 0);
    size_t len = 40 * MiB;
    void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(map != MAP_FAILED);
    assert_int_equal(llmem_mem_track(m, map, len, LLMEM_TAG_WEIGHTS), LLMEM_OK);
    struct llmem_mem_stats st = stats_of(m);
    assert_int_equal(st.tags[LLMEM_TAG_WEIGHTS].active_bytes, (int64_t)len);
    assert_int_equal(st.active_bytes, (int64_t)len);
    /* The limit sees it. */
    assert_null(llmem_mem_alloc(m, 30 * MiB, LLMEM_TAG_KV));
    void *other = (char *)map + MiB; /* a distinct address, not mapped by us: only accounted */
    assert_int_equal(llmem_mem_track(m, other, 30 * MiB, LLMEM_TAG_WEIGHTS), LLMEM_ENOMEM);
    assert_int_equal(llmem_mem_check(m), LLMEM_OK);
    llmem_mem_untrack(m, map);
    assert_int_equal(llmem_mem_active(m), 0);
    assert_int_equal(llmem_mem_peak(m), (int64_t)len);
    munmap(map, len);
    llmem_mem_destroy(m);
}

static void test_default_cache_limit(void **state) {
    (void)state;
    assert_int_equal(llmem_mem_default_cache_limit(0), 256 * (int64_t)MiB);
    assert_int_equal(llmem_mem_default_cache_limit(1024 * (int64_t)MiB), 256 * (int64_t)MiB);
    assert_int_equal(llmem_mem_default_cache_limit(36LL << 30), (36LL << 30) / 8);
    assert_int_equal(llmem_mem_default_cache_limit(192LL << 30), 8LL << 30);
    /* the default never exceeds the allocator's memory limit; a given one stays as given */
    struct llmem_mem_config c = {.memory_limit_bytes = 32 * (int64_t)MiB,
                                 .cache_limit_bytes = -1,
                                 .usable_bytes = 32 * (int64_t)MiB};
    struct llmem_mem *small = NULL;
    assert_int_equal(llmem_mem_create(&c, &small), LLMEM_OK);
    assert_int_equal(stats_of(small).cache_limit_bytes, 32 * (int64_t)MiB);
    llmem_mem_destroy(small);
    c.cache_limit_bytes = 64 * (int64_t)MiB;
    assert_int_equal(llmem_mem_create(&c, &small), LLMEM_OK);
    assert_int_equal(stats_of(small).cache_limit_bytes, 64 * (int64_t)MiB);
    llmem_mem_destroy(small);
    struct llmem_mem_config cfg = {.cache_limit_bytes = -1, .usable_bytes = 36LL << 30};
    struct llmem_mem *m = NULL;
    assert_int_equal(llmem_mem_create(&cfg, &m), LLMEM_OK);
    assert_int_equal(stats_of(m).cache_limit_bytes, (36LL << 30) / 8);
    assert_int_equal(stats_of(m).memory_limit_bytes, LLMEM_MEM_UNLIMITED);
    llmem_mem_destroy(m);
}

/* One fixed sequence of operations, each allowed to fail; returns with everything freed. */
static void fault_sequence(void) {
    struct llmem_mem_config cfg = {.memory_limit_bytes = 64 * (int64_t)MiB,
                                   .cache_limit_bytes = 16 * (int64_t)MiB};
    struct llmem_mem *m = NULL;
    if (llmem_mem_create(&cfg, &m) != LLMEM_OK)
        return;
    void *live[300] = {0};
    static char region[4096];
    int tracked = 0;
    uint64_t x = 99;
    for (int i = 0; i < 600; i++) {
        int k = (int)(next_rand(&x) % 300);
        if (live[k] != NULL) {
            llmem_mem_free(m, live[k]);
            live[k] = NULL;
        } else {
            size_t n = 1 + (size_t)(next_rand(&x) % (2 * MiB));
            live[k] = llmem_mem_alloc(m, n, (enum llmem_mem_tag)(k % LLMEM_TAG_COUNT));
        }
        if (i == 100)
            tracked = llmem_mem_track(m, region, sizeof(region), LLMEM_TAG_WEIGHTS) == LLMEM_OK;
        if (i == 300)
            llmem_mem_set_cache_limit(m, 2 * MiB);
        if (i == 400)
            llmem_mem_clear_cache(m);
        assert_int_equal(llmem_mem_check(m), LLMEM_OK);
    }
    if (tracked)
        llmem_mem_untrack(m, region);
    for (int k = 0; k < 300; k++)
        llmem_mem_free(m, live[k]);
    assert_int_equal(llmem_mem_active(m), 0);
    assert_int_equal(llmem_mem_check(m), LLMEM_OK);
    llmem_mem_destroy(m);
}

static void test_fault_injection_every_n(void **state) {
    (void)state;
    int n = 1;
    for (;; n++) {
        llmem_mem_fault_inject(n);
        fault_sequence();
        if (llmem_mem_fault_pending())
            break; /* the sequence finished before the n-th attempt: every step was covered */
    }
    llmem_mem_fault_inject(0);
    assert_true(n > 10);
    /* Leaks would show in the sanitizer build (LeakSanitizer) and as active bytes above. */
}

static void test_fault_fails_cleanly(void **state) {
    (void)state;
    struct llmem_mem *m = new_mem(0, 0);
    llmem_mem_fault_inject(1); /* the bookkeeping's first growth */
    assert_null(llmem_mem_alloc(m, 100, LLMEM_TAG_OTHER));
    assert_false(llmem_mem_fault_pending());
    assert_int_equal(llmem_mem_active(m), 0);
    void *p = llmem_mem_alloc(m, 100, LLMEM_TAG_OTHER);
    assert_non_null(p);
    /* A refused raw allocation: retried once after releasing the cache. */
    llmem_mem_fault_inject(1);
    void *q = llmem_mem_alloc(m, 5 * MiB, LLMEM_TAG_KV);
    assert_non_null(q); /* the retry succeeded */
    assert_int_equal(stats_of(m).os_failures, 1);
    llmem_mem_free(m, q);
    llmem_mem_fault_inject(1);
    assert_int_equal(llmem_mem_create(&(struct llmem_mem_config){0}, &(struct llmem_mem *){0}),
                     LLMEM_ENOMEM);
    llmem_mem_free(m, p);
    assert_int_equal(llmem_mem_check(m), LLMEM_OK);
    llmem_mem_destroy(m);
}

/* A run of refusals that the allocator's retry cannot absorb: two in a row refuse the attempt and
 * its retry; the persistent mode refuses every attempt until disarmed. Each is a clean NULL. */
static void test_fault_runs(void **state) {
    (void)state;
    struct llmem_mem *m = new_mem(0, 0);
    void *p = llmem_mem_alloc(m, 100, LLMEM_TAG_OTHER); /* the bookkeeping grows here */
    assert_non_null(p);
    llmem_mem_fault_inject_count(1, 2);
    assert_null(llmem_mem_alloc(m, 5 * MiB, LLMEM_TAG_KV));
    assert_int_equal(stats_of(m).os_failures, 1);
    assert_false(llmem_mem_fault_pending());
    void *q = llmem_mem_alloc(m, 5 * MiB, LLMEM_TAG_KV); /* the run is over */
    assert_non_null(q);
    llmem_mem_free(m, q);

    llmem_mem_fault_inject_count(2, LLMEM_MEM_FAULT_PERSIST);
    assert_true(llmem_mem_fault_pending());
    void *a = llmem_mem_alloc(m, 64, LLMEM_TAG_OTHER); /* the first attempt passes */
    assert_non_null(a);
    assert_true(llmem_mem_fault_pending());
    for (int i = 1; i <= 20; i++)
        assert_null(llmem_mem_alloc(m, (size_t)i * 3 * MiB, LLMEM_TAG_SCRATCH));
    assert_false(llmem_mem_fault_pending());
    assert_int_equal(llmem_mem_create(&(struct llmem_mem_config){0}, &(struct llmem_mem *){0}),
                     LLMEM_ENOMEM);
    llmem_mem_fault_inject(0);
    void *b = llmem_mem_alloc(m, 3 * MiB, LLMEM_TAG_SCRATCH);
    assert_non_null(b);
    /* count 0 arms nothing */
    llmem_mem_fault_inject_count(1, 0);
    assert_false(llmem_mem_fault_pending());
    llmem_mem_free(m, b);
    llmem_mem_free(m, a);
    llmem_mem_free(m, p);
    assert_int_equal(llmem_mem_active(m), 0);
    assert_int_equal(llmem_mem_check(m), LLMEM_OK);
    llmem_mem_destroy(m);
}

static void test_stress(void **state) {
    (void)state;
    struct llmem_mem *m = new_mem(256 * (int64_t)MiB, 32 * (int64_t)MiB);
    enum { SLOTS = 512 };
    void *live[SLOTS] = {0};
    size_t held[SLOTS] = {0};
    uint64_t x = stress_seed;
    int64_t limit = 256 * (int64_t)MiB;
    int trimmed = 1; /* no cache-limit change since the last allocation or clear */
    for (int i = 0; i < stress_ops; i++) {
        uint64_t r = next_rand(&x);
        int k = (int)(r % SLOTS);
        switch ((r >> 16) % 64) {
        case 0:
            llmem_mem_set_cache_limit(m, (int64_t)((r >> 24) % (64 * MiB)));
            trimmed = 0; /* a lowered limit applies at the next allocation */
            break;
        case 1:
            limit = 64 * (int64_t)MiB + (int64_t)((r >> 24) % (512 * MiB));
            llmem_mem_set_memory_limit(m, limit);
            break;
        case 2:
            llmem_mem_clear_cache(m);
            trimmed = 1;
            break;
        case 3: llmem_mem_reset_peak(m); break;
        default:
            if (live[k] != NULL) {
                llmem_mem_free(m, live[k]);
                live[k] = NULL;
                held[k] = 0;
            } else {
                /* log-uniform sizes from 1 byte to 16 MiB */
                size_t n = 1 + (size_t)((r >> 24) % ((size_t)1 << ((r >> 56) % 25)));
                trimmed = 1;
                const enum llmem_mem_tag tag = (enum llmem_mem_tag)((r >> 8) % LLMEM_TAG_COUNT);
                live[k] = llmem_mem_alloc(m, n, tag);
                if (live[k] != NULL) {
                    held[k] = llmem_mem_alloc_size(m, n, tag);
                    ((char *)live[k])[0] = 1;
                    ((char *)live[k])[n - 1] = 1;
                }
            }
        }
        /* The allocator's invariants, and the model: active = Σ held classes. */
        assert_int_equal(llmem_mem_check(m), LLMEM_OK);
        int64_t expect = 0;
        for (int s = 0; s < SLOTS; s++)
            expect += (int64_t)held[s];
        struct llmem_mem_stats st = stats_of(m);
        assert_int_equal(st.active_bytes, expect);
        assert_true(!trimmed || st.cache_bytes <= st.cache_limit_bytes);
        assert_true(st.active_bytes + st.cache_bytes <= limit || st.cache_bytes == 0);
    }
    for (int s = 0; s < SLOTS; s++)
        llmem_mem_free(m, live[s]);
    assert_int_equal(llmem_mem_active(m), 0);
    llmem_mem_destroy(m);
}

/* Every test starts with fault injection disarmed, whatever the one before did. */
static int disarm(void **state) {
    (void)state;
    llmem_mem_fault_inject(0);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1)
        stress_seed = strtoull(argv[1], NULL, 0);
    if (argc > 2)
        stress_ops = atoi(argv[2]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_cache_hit_reuse, disarm),
        cmocka_unit_test_setup(test_cache_limit_zero_disables, disarm),
        cmocka_unit_test_setup(test_lowering_cache_limit_releases_on_next_alloc, disarm),
        cmocka_unit_test_setup(test_clear_cache_returns_memory, disarm),
        cmocka_unit_test_setup(test_memory_limit_refusal_and_recovery, disarm),
        cmocka_unit_test_setup(test_peak_and_reset, disarm),
        cmocka_unit_test_setup(test_per_tag_sums, disarm),
        cmocka_unit_test_setup(test_waste_bound, disarm),
        cmocka_unit_test_setup(test_threads, disarm),
        cmocka_unit_test_setup(test_wired_limit, disarm),
        cmocka_unit_test_setup(test_tracked_memory, disarm),
        cmocka_unit_test_setup(test_default_cache_limit, disarm),
        cmocka_unit_test_setup(test_fault_injection_every_n, disarm),
        cmocka_unit_test_setup(test_fault_fails_cleanly, disarm),
        cmocka_unit_test_setup(test_fault_runs, disarm),
        cmocka_unit_test_setup(test_stress, disarm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
