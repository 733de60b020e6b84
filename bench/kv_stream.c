/*
 * bench/kv_stream.c — what one core can stream through the fused decode-attention kernel
 * (llmem_kv_kernels()->attn_tile, f16, 4 query heads per KV head, head_dim 128), against plain
 * reads of the same bytes in the same order: a paged cache's 16-token blocks of 8 KV heads
 * (rows of 2 KiB, K then V), 512 MiB, one thread (or -t N threads on disjoint halves).
 *
 *   llmem-bench-kv-stream [-t THREADS]
 *
 * Rows (GB/s of K + V bytes, the slowest thread's time):
 * - sum, sequential: every 64-byte line in address order (the hardware prefetchers' case);
 * - sum, per head: the kernel's order, a head's 256 bytes of each of the 16 rows, head by head;
 * - kernel: the kernel in that order, no prefetch;
 * - kernel + prefetch: the next block prefetched an eighth per head, spread over the kernel's
 *   loops, as kv/attention.c does: an eighth of each 4 KiB page of its K and of its V;
 * - kernel + prefetch, runs: the same amount, but each head's eighth of the block in one run
 *   (K's half with the scores, V's with the values: a page or two at a time);
 * - kernel + touch: the block read through once in address order first, then the kernel;
 * - kernel, in cache: the kernel over 4 blocks again and again (its compute rate).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/clock.h"
#include "kv/codec_internal.h"

#define HD     128
#define NKV    8
#define TOK    16
#define ROW    (NKV * HD * 2)          /* bytes of one token's K (or V), all heads */
#define BLOCK  ((size_t)TOK * ROW * 2) /* K and V of one block */
#define BYTES  ((size_t)512 << 20)
#define NMODES 7

static const char *const names[NMODES] = {
    "sum, sequential",  "sum, per head",          "kernel", "kernel + prefetch", "kernel + touch",
    "kernel, in cache", "kernel + prefetch, runs"};
static uint8_t *buf;
static int n_threads = 1, mode;
static double secs[64];
static const struct llmem_kv_attn_tile *tile;

/* Sums one 8-byte word of every 64-byte line of [p, p + n): every line is fetched. */
static uint64_t sum_lines(const uint8_t *p, size_t n) {
    uint64_t s = 0;
    for (size_t x = 0; x < n; x += 64)
        s += *(const uint64_t *)(p + x);
    return s;
}

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    const size_t blocks = BYTES / BLOCK / (size_t)n_threads;
    uint8_t *base = buf + (size_t)id * blocks * BLOCK;
    static __thread float q[NKV * 4 * HD], st[NKV * 4 * (HD + 2)];
    for (int i = 0; i < NKV * 4 * HD; i++)
        q[i] = 0.01f * (float)(i % 7);
    for (int h = 0; h < NKV * 4; h++) {
        memset(st + h * (HD + 2), 0, HD * sizeof(float));
        st[h * (HD + 2) + HD] = -1e30f;
        st[h * (HD + 2) + HD + 1] = 0;
    }
    uint64_t sink = 0;
    float sc[2][LLMEM_KV_TILE_SC] __attribute__((aligned(64)));
    int cur = 0;
    const uint8_t *held_v = NULL;
    float *held_st = NULL;
    struct llmem_kv_prefetch held_pf = {NULL, 0, 0, 0};
    const int reps = mode == 5 ? 256 : 1;
    const size_t n = mode == 5 ? 4 : blocks;
    double t = llmem_clock_s();
    for (int r = 0; r < reps; r++)
        for (size_t b = 0; b < n; b++) {
            const uint8_t *k = base + b * BLOCK, *v = k + BLOCK / 2;
            if (mode == 0) {
                sink += sum_lines(k, BLOCK);
                continue;
            }
            if (mode == 4)
                sink += sum_lines(k, BLOCK);
            const uint8_t *next = b + 1 < n ? k + BLOCK : NULL;
            for (int h = 0; h < NKV; h++) {
                if (mode == 1) {
                    for (int row = 0; row < TOK; row++)
                        sink += sum_lines(k + row * ROW + h * HD * 2, HD * 2) +
                                sum_lines(v + row * ROW + h * HD * 2, HD * 2);
                    continue;
                }
                /* as kv/attention.c: half the prefetch with the scores, half with the values,
                 * and the values of each call after the scores of the next */
                struct llmem_kv_prefetch pfk = {NULL, 0, 0, 0}, pfv = {NULL, 0, 0, 0};
                if (mode == 3 && next != NULL) {
                    const size_t slice = LLMEM_KV_PF_PAGE / NKV;
                    pfk = (struct llmem_kv_prefetch){next, BLOCK / 2, (size_t)h * slice, slice};
                    pfv = pfk;
                    pfv.at += BLOCK / 2;
                }
                if (mode == 6 && next != NULL) {
                    pfk = (struct llmem_kv_prefetch){next + (size_t)h * (BLOCK / NKV),
                                                     BLOCK / NKV / 2, 0, BLOCK / NKV / 2};
                    pfv = pfk;
                    pfv.at += pfk.bytes;
                }
                float *sh = st + h * 4 * (HD + 2);
                tile->scores(k + h * HD * 2, ROW, TOK, q + h * 4 * HD, HD, sh, HD + 2, sc[cur],
                             pfk);
                if (held_v != NULL)
                    tile->values(held_v, ROW, TOK, sc[cur ^ 1], HD, held_st, HD + 2, held_pf);
                held_v = v + h * HD * 2, held_st = sh, held_pf = pfv, cur ^= 1;
            }
        }
    if (held_v != NULL)
        tile->values(held_v, ROW, TOK, sc[cur ^ 1], HD, held_st, HD + 2, held_pf);
    secs[id] = llmem_clock_s() - t;
    __asm__ volatile("" ::"r"(sink));
    return NULL;
}

int main(int argc, char **argv) {
    int opt;
    while ((opt = getopt(argc, argv, "t:")) != -1)
        if (opt == 't')
            n_threads = atoi(optarg);
    if (n_threads < 1 || n_threads > 64) {
        fprintf(stderr, "usage: llmem-bench-kv-stream [-t THREADS]\n");
        return 2;
    }
    tile = &llmem_kv_kernels()->attn_tile[LLMEM_KV_FORMAT_F16];
    if (tile->scores == NULL) {
        fprintf(stderr, "llmem-bench-kv-stream: no fused f16 tile kernel on this CPU (AVX-512)\n");
        return 1;
    }
    buf = aligned_alloc((size_t)2 << 20, BYTES);
    if (buf == NULL)
        return 1;
    madvise(buf, BYTES, MADV_HUGEPAGE);
    for (size_t i = 0; i < BYTES / 2; i++) /* f16 values in [1, 2) */
        ((uint16_t *)buf)[i] = (uint16_t)(0x3c00 | (i & 0x3ff));
    printf("%d thread(s), 512 MiB of f16 K + V, blocks of 16 tokens x 8 KV heads x 128; GB/s:\n",
           n_threads);
    for (int rep = 0; rep < 3; rep++) {
        for (mode = 0; mode < NMODES; mode++) {
            pthread_t th[64];
            for (int i = 0; i < n_threads; i++)
                pthread_create(&th[i], NULL, worker, (void *)(intptr_t)i);
            double slowest = 0;
            for (int i = 0; i < n_threads; i++) {
                pthread_join(th[i], NULL);
                slowest = secs[i] > slowest ? secs[i] : slowest;
            }
            double bytes = mode == 5 ? 256.0 * 4 * BLOCK * n_threads
                                     : (double)(BYTES / BLOCK / n_threads * BLOCK * n_threads);
            printf("  %-23s %6.1f%s", names[mode], bytes / slowest * 1e-9,
                   mode % 3 == 2 || mode == NMODES - 1 ? "\n" : "");
        }
        printf("\n");
    }
    free(buf);
    return 0;
}
