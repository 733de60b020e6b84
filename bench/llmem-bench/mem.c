/*
 * bench/llmem-bench/mem.c — `llmem-bench mem`: allocation/free throughput of the caching allocator
 * against glibc malloc/free and against raw mmap/munmap, on the same operation sequence:
 *   inference  the temporaries of a prefill step of a Llama-3.2-1B-shaped model (512 tokens):
 *              per layer q, k, v, attention output, scores, gate and up are allocated and freed,
 *              around the step's residual, norm output and logits — the same shapes thousands of
 *              times, as a generation loop does;
 *   random     a live set of 64 slots; each operation frees a slot's buffer or allocates one of a
 *              log-uniform size from 64 B to 16 MiB.
 * One operation is one allocation or one free. Buffers are not written (the allocator's own cost
 * is measured); --touch writes one byte per page of each new buffer, which adds the page faults
 * that a cache avoids (and runs a hundredth of the operations, since faults dominate).
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "core/clock.h"
#include "cli/common.h"
#include "core/json.h"
#include "llmem/mem.h"
#include "llmem/sys.h"

/* ---- the operation sequences -------------------------------------------------------------------
 */

struct op {
    int slot;     /* which live buffer */
    size_t bytes; /* > 0: allocate into slot; 0: free slot */
};

struct pattern {
    const char *name;
    struct op *ops;
    size_t n_ops;
    int n_slots;
};

static int push(struct pattern *p, size_t *cap, int slot, size_t bytes) {
    if (p->n_ops == *cap) {
        size_t next = *cap ? *cap * 2 : 1024;
        struct op *grown = realloc(p->ops, next * sizeof(*grown));
        if (grown == NULL)
            return -1;
        p->ops = grown;
        *cap = next;
    }
    p->ops[p->n_ops++] = (struct op){slot, bytes};
    if (slot + 1 > p->n_slots)
        p->n_slots = slot + 1;
    return 0;
}

static int make_inference(struct pattern *p, int steps) {
    const size_t T = 512, hidden = 2048, heads = 32, kv_dim = 512, inter = 8192, vocab = 128256;
    const size_t f = sizeof(float);
    const size_t layer_shapes[] = {
        T * hidden * f,    /* q */
        T * kv_dim * f,    /* k */
        T * kv_dim * f,    /* v */
        heads * T * T * f, /* attention scores */
        T * hidden * f,    /* attention output */
        T * inter * f,     /* gate */
        T * inter * f,     /* up */
        hidden * f,        /* a norm's row */
    };
    const int n_layer = (int)(sizeof(layer_shapes) / sizeof(layer_shapes[0]));
    size_t cap = 0;
    memset(p, 0, sizeof(*p));
    p->name = "inference";
    for (int s = 0; s < steps; s++) {
        int rc = push(p, &cap, 0, T * hidden * f) | push(p, &cap, 1, T * hidden * f);
        for (int layer = 0; layer < 16; layer++) {
            for (int i = 0; i < n_layer; i++)
                rc |= push(p, &cap, 2 + i, layer_shapes[i]);
            for (int i = n_layer - 1; i >= 0; i--)
                rc |= push(p, &cap, 2 + i, 0);
        }
        rc |= push(p, &cap, 2 + n_layer, vocab * f); /* logits of the last token */
        rc |= push(p, &cap, 2 + n_layer, 0) | push(p, &cap, 1, 0) | push(p, &cap, 0, 0);
        if (rc != 0)
            return -1;
    }
    return 0;
}

static int make_random(struct pattern *p, size_t n_ops, uint64_t seed) {
    enum { SLOTS = 64 };
    int live[SLOTS] = {0};
    size_t cap = 0;
    memset(p, 0, sizeof(*p));
    p->name = "random";
    uint64_t x = seed;
    for (size_t i = 0; i < n_ops; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        int slot = (int)(x % SLOTS);
        size_t bytes = 0;
        if (!live[slot]) {
            int bits = 6 + (int)((x >> 8) % 19); /* 64 B .. 16 MiB */
            bytes = ((size_t)1 << bits) + (size_t)((x >> 32) % ((size_t)1 << bits));
            bytes = bytes > ((size_t)16 << 20) ? (size_t)16 << 20 : bytes;
        }
        if (push(p, &cap, slot, bytes) != 0)
            return -1;
        live[slot] = bytes > 0;
    }
    for (int s = 0; s < SLOTS; s++)
        if (live[s] && push(p, &cap, s, 0) != 0)
            return -1;
    return 0;
}

/* ---- the allocators under test ----------------------------------------------------------------
 */

enum which { USE_LLMEM = 0, USE_MALLOC, USE_MMAP, N_WHICH };
static const char *const which_name[N_WHICH] = {"llmem", "malloc", "mmap"};

static void touch(void *p, size_t bytes, size_t page) {
    for (size_t off = 0; off < bytes; off += page)
        ((volatile char *)p)[off] = 1;
}

/* Runs the pattern once; returns seconds, or a negative value when an allocation failed. */
static double run_once(const struct pattern *p, enum which w, struct llmem_mem *mem, void **slots,
                       size_t *sizes, int do_touch, size_t page) {
    double t0 = llmem_clock_s();
    for (size_t i = 0; i < p->n_ops; i++) {
        const struct op *o = &p->ops[i];
        if (o->bytes > 0) {
            void *ptr = NULL;
            switch (w) {
            case USE_LLMEM: ptr = llmem_mem_alloc(mem, o->bytes, LLMEM_TAG_SCRATCH); break;
            case USE_MALLOC: ptr = malloc(o->bytes); break;
            default:
                ptr = mmap(NULL, o->bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                           0);
                if (ptr == MAP_FAILED)
                    ptr = NULL;
            }
            if (ptr == NULL)
                return -1;
            if (do_touch)
                touch(ptr, o->bytes, page);
            slots[o->slot] = ptr;
            sizes[o->slot] = o->bytes;
        } else {
            switch (w) {
            case USE_LLMEM: llmem_mem_free(mem, slots[o->slot]); break;
            case USE_MALLOC: free(slots[o->slot]); break;
            default: munmap(slots[o->slot], sizes[o->slot]);
            }
        }
    }
    return llmem_clock_s() - t0;
}

/* ---- the command ------------------------------------------------------------------------------
 */

static const char bench_usage[] =
    "usage: llmem-bench mem [--quick] [--steps N] [--reps N] [--touch] [--json]\n"
    "\n"
    "Allocation/free throughput of the caching allocator against malloc/free and mmap/munmap,\n"
    "for an inference-like pattern and a random one; medians of N runs (default 5) and ratios\n"
    "measured side by side. --quick finishes in a few seconds; --steps N sets the length (N\n"
    "inference steps, 150 N random operations; default 2000, quick 300); --touch also writes\n"
    "each new"
    " page; --json prints one object with per-pattern name, llmem_ops_per_s, malloc_ops_per_s,\n"
    "mmap_ops_per_s.\n";

int bench_mem(int argc, char **argv) {
    static const struct option options[] = {
        {"quick", no_argument, NULL, 'q'},
        {"reps", required_argument, NULL, 'r'},
        {"touch", no_argument, NULL, 't'},
        {"json", no_argument, NULL, 'j'},
        {"steps", required_argument, NULL, 's'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int quick = 0, do_touch = 0, json = 0, c;
    int64_t reps = 5, steps = 0;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", options, NULL)) != -1) {
        switch (c) {
        case 'q': quick = 1; break;
        case 't': do_touch = 1; break;
        case 'j': json = 1; break;
        case 'r':
            if (cli_parse_int("--reps", optarg, 1, 1000, &reps) != CLI_OK)
                return CLI_USAGE;
            break;
        case 's':
            if (cli_parse_int("--steps", optarg, 1, 1000000, &steps) != CLI_OK)
                return CLI_USAGE;
            break;
        case 'h': fputs(bench_usage, stdout); return CLI_OK;
        case ':': return cli_usage_error("mem", "%s needs a value", argv[optind - 1]);
        default:
            return cli_usage_error("mem", "unknown option '%s' (see --help)", argv[optind - 1]);
        }
    }
    if (quick && reps == 5)
        reps = 3;

    /* Touching pages costs far more than allocating: a hundredth of the operations then. */
    if (steps == 0)
        steps = (quick ? 300 : 2000) / (do_touch ? 100 : 1);
    struct pattern patterns[2];
    if (make_inference(&patterns[0], (int)steps) != 0 ||
        make_random(&patterns[1], 150 * (size_t)steps, 0x5eed) != 0) {
        fprintf(stderr, "llmem-bench mem: out of memory building the patterns\n");
        return CLI_FAIL;
    }
    struct llmem_mem_config cfg = {.cache_limit_bytes = (int64_t)2 << 30};
    struct llmem_mem *mem = NULL;
    if (llmem_mem_create(&cfg, &mem) != LLMEM_OK)
        return CLI_FAIL;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    double ops_per_s[2][N_WHICH];
    int rc = CLI_OK;
    int total_runs = 2 * N_WHICH * (int)(reps + 1), done = 0;

    for (int pi = 0; pi < 2 && rc == CLI_OK; pi++) {
        const struct pattern *p = &patterns[pi];
        void **slots = calloc((size_t)p->n_slots, sizeof(*slots));
        size_t *sizes = calloc((size_t)p->n_slots, sizeof(*sizes));
        double *times = calloc((size_t)(N_WHICH * reps), sizeof(*times));
        if (slots == NULL || sizes == NULL || times == NULL) {
            rc = CLI_FAIL;
        }
        /* One untimed warm-up each, then the reps interleaved so drift hits all three alike. */
        for (int64_t r = -1; rc == CLI_OK && r < reps; r++) {
            for (int w = 0; w < N_WHICH && rc == CLI_OK; w++) {
                double t = run_once(p, (enum which)w, mem, slots, sizes, do_touch, page);
                if (t < 0) {
                    fprintf(stderr, "llmem-bench mem: %s: an allocation failed\n", which_name[w]);
                    rc = CLI_FAIL;
                }
                if (r >= 0)
                    times[w * reps + r] = t;
                cli_progress("bench mem", ++done, total_runs);
            }
        }
        for (int w = 0; w < N_WHICH && rc == CLI_OK; w++) {
            ops_per_s[pi][w] = (double)p->n_ops / bench_median(times + w * reps, (int)reps);
        }
        free(slots);
        free(sizes);
        free(times);
    }
    cli_progress_done();
    llmem_mem_destroy(mem);
    if (rc != CLI_OK)
        goto out;

    struct llmem_device_info host;
    llmem_sys_probe_host(&host);
    if (json) {
        cJSON *root = cJSON_CreateObject();
        int st = root == NULL;
        cJSON *machine = st ? NULL : cJSON_AddObjectToObject(root, "machine");
        st |= machine == NULL || llmem_json_add_string(machine, "cpu", host.name) ||
              llmem_json_add_int(machine, "n_cpus", host.n_cpus) ||
              llmem_json_add_int(root, "reps", reps) ||
              llmem_json_add_bool(root, "touch", do_touch);
        cJSON *list = st ? NULL : cJSON_AddArrayToObject(root, "patterns");
        st |= list == NULL;
        for (int pi = 0; pi < 2 && !st; pi++) {
            cJSON *o = cJSON_CreateObject();
            st |= o == NULL || !cJSON_AddItemToArray(list, o);
            st |= st || llmem_json_add_string(o, "name", patterns[pi].name) ||
                  llmem_json_add_int(o, "ops", (int64_t)patterns[pi].n_ops);
            for (int w = 0; w < N_WHICH && !st; w++) {
                char key[32];
                snprintf(key, sizeof(key), "%s_ops_per_s", which_name[w]);
                st |= llmem_json_add_double(o, key, ops_per_s[pi][w]);
            }
            st |= st ||
                  llmem_json_add_double(o, "llmem_vs_malloc",
                                        ops_per_s[pi][USE_LLMEM] / ops_per_s[pi][USE_MALLOC]) ||
                  llmem_json_add_double(o, "llmem_vs_mmap",
                                        ops_per_s[pi][USE_LLMEM] / ops_per_s[pi][USE_MMAP]);
        }
        if (st) {
            cJSON_Delete(root);
            fprintf(stderr, "llmem-bench mem: out of memory building the JSON output\n");
            rc = CLI_FAIL;
        } else {
            rc = cli_print_json(root);
        }
    } else {
        printf("llmem-bench mem: %s, %d CPUs; median of %lld runs%s; ops/s (one op = one"
               " allocation or one free)\n\n",
               host.name, host.n_cpus, (long long)reps, do_touch ? ", pages touched" : "");
        printf("%-10s %10s %14s %14s %14s %13s %12s\n", "pattern", "ops", "llmem", "malloc", "mmap",
               "llmem/malloc", "llmem/mmap");
        for (int pi = 0; pi < 2; pi++) {
            const double *o = ops_per_s[pi];
            printf("%-10s %10zu %14.0f %14.0f %14.0f %12.2fx %11.1fx\n", patterns[pi].name,
                   patterns[pi].n_ops, o[USE_LLMEM], o[USE_MALLOC], o[USE_MMAP],
                   o[USE_LLMEM] / o[USE_MALLOC], o[USE_LLMEM] / o[USE_MMAP]);
        }
    }
out:
    free(patterns[0].ops);
    free(patterns[1].ops);
    return rc;
}
