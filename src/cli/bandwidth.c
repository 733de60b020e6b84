/*
 * cli/bandwidth.c — the host's memory bandwidth, measured (cli/bandwidth.h):
 *   read   every task sums its share of a buffer far larger than the last-level cache, read as
 *          READ_STREAMS streams side by side;
 *   copy   memcpy of the first half onto the second, counted as bytes read + bytes written.
 * The buffer is touched first (page faults are not bandwidth) and the first pass is a warm-up.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/bandwidth.h"

#include "cli/common.h"
#include "core/clock.h"
#include "llmem/mem.h"
#include "llmem/pool.h"

typedef uint64_t u64x2 __attribute__((vector_size(16)));

#define READ_STREAMS 8

struct bw_job {
    uint8_t *buf;
    size_t bytes, chunk; /* the whole buffer; one task's share (a multiple of 64) */
    int copy;            /* 0: read (sum); 1: copy the first half onto the second */
    uint64_t sink[256];  /* per task, so that the sums are not optimized away */
};

static void bw_task(void *arg, int task, int thread) {
    (void)thread;
    struct bw_job *j = arg;
    size_t lo = (size_t)task * j->chunk;
    if (j->copy) {
        size_t half = j->bytes / 2;
        if (lo >= half)
            return;
        size_t n = lo + j->chunk <= half ? j->chunk : half - lo;
        memcpy(j->buf + half + lo, j->buf + lo, n);
        return;
    }
    if (lo >= j->bytes)
        return;
    size_t n = lo + j->chunk <= j->bytes ? j->chunk : j->bytes - lo;
    /* READ_STREAMS runs of the share read side by side, a line of each in turn: with one
     * stream, a core's reads in flight are bounded by how far its prefetcher runs ahead on that
     * stream, and the probe measured that bound rather than the memory (Intel Xeon, two threads:
     * one stream 17 GB/s, eight 28–31) */
    const size_t run = n / READ_STREAMS & ~(size_t)63;
    const uint8_t *p = j->buf + lo;
    u64x2 a = {0, 0}, b = {0, 0}, c = {0, 0}, d = {0, 0};
    for (size_t o = 0; o < run; o += 64)
        for (int k = 0; k < READ_STREAMS; k++) {
            const u64x2 *l = (const u64x2 *)(const void *)(p + (size_t)k * run + o);
            a += l[0];
            b += l[1];
            c += l[2];
            d += l[3];
        }
    const u64x2 *rest = (const u64x2 *)(const void *)p; /* past the runs: fewer than 8 lines */
    for (size_t i = READ_STREAMS * run / 16; i < n / 16; i++)
        a += rest[i];
    u64x2 s = a + b + c + d;
    j->sink[task % 256] += s[0] + s[1];
}

static void touch_task(void *arg, int task, int thread) {
    (void)thread;
    struct bw_job *j = arg;
    size_t lo = (size_t)task * j->chunk;
    if (lo >= j->bytes)
        return;
    size_t n = lo + j->chunk <= j->bytes ? j->chunk : j->bytes - lo;
    memset(j->buf + lo, (int)(task & 0x7f) + 1, n);
}

int cli_bandwidth(struct llmem_mem *mem, struct llmem_pool *pool, int64_t bytes, int passes,
                  double *read_gbps, double *copy_gbps, void (*tick)(void *), void *tick_arg) {
    struct bw_job *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return CLI_FAIL;
    j->bytes = (size_t)bytes & ~(size_t)127;
    j->buf = mem != NULL ? llmem_mem_alloc(mem, j->bytes, LLMEM_TAG_SCRATCH)
                         : aligned_alloc(64, j->bytes);
    if (j->buf == NULL) {
        free(j);
        return CLI_FAIL;
    }
    const int tasks = 64;
    j->chunk = ((j->bytes + (size_t)tasks - 1) / (size_t)tasks + 63) & ~(size_t)63;
    llmem_pool_run(pool, tasks, touch_task, j);
    for (int p = -1; p < passes; p++) {
        /* read: all of it */
        j->copy = 0;
        j->chunk = ((j->bytes + (size_t)tasks - 1) / (size_t)tasks + 63) & ~(size_t)63;
        double t0 = llmem_clock_s();
        llmem_pool_run(pool, tasks, bw_task, j);
        if (p >= 0) /* the first pass warms up */
            read_gbps[p] = (double)j->bytes / (llmem_clock_s() - t0) * 1e-9;
        if (copy_gbps != NULL) { /* copy: half onto half, bytes read + bytes written */
            j->copy = 1;
            j->chunk = ((j->bytes / 2 + (size_t)tasks - 1) / (size_t)tasks + 63) & ~(size_t)63;
            t0 = llmem_clock_s();
            llmem_pool_run(pool, tasks, bw_task, j);
            if (p >= 0)
                copy_gbps[p] = (double)j->bytes / (llmem_clock_s() - t0) * 1e-9;
        }
        if (tick != NULL)
            tick(tick_arg);
    }
    uint64_t sum = 0;
    for (int i = 0; i < 256; i++)
        sum += j->sink[i];
    volatile uint64_t keep = sum;
    (void)keep;
    if (mem != NULL)
        llmem_mem_free(mem, j->buf);
    else
        free(j->buf);
    free(j);
    return CLI_OK;
}

int cli_read_bandwidth(int threads, int64_t bytes, double *read_gbps) {
    struct llmem_pool *pool = NULL;
    if (llmem_pool_create(threads, &pool) != LLMEM_OK)
        return CLI_FAIL;
    double read[2];
    const int rc = cli_bandwidth(NULL, pool, bytes, 2, read, NULL, NULL, NULL);
    llmem_pool_destroy(pool);
    if (rc == CLI_OK)
        *read_gbps = read[0] > read[1] ? read[0] : read[1];
    return rc;
}
