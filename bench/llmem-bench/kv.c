/*
 * bench/llmem-bench/kv.c — `llmem-bench kv`: decode attention over the KV caches (SPEC §4) against
 * the machine's memory bandwidth, the accuracy of each storage format, and the cost of appending.
 *
 * Shapes are those of a Llama-3-8B-like layer: 32 query heads, 8 KV heads (GQA 4:1; --heads sets
 * others), head_dim 128, one layer per cache (attention reads one layer per call, so every figure
 * is per layer).
 *
 *   bandwidth   read: every thread sums its share of a buffer far larger than the last-level cache
 *               (512 MiB, from an llmem_mem allocator, written once first); copy: memcpy of one
 *               half onto the other, counting bytes read + bytes written (SPEC §8). Measured with
 *               the attention's thread count, before and after the attention runs; the figure is
 *               the median of all passes.
 *   compute     the sustained rate of f32 multiply-adds: every thread runs 12 independent chains of
 *               vector FMAs (512-bit where the CPU has AVX-512F, else 256-bit), measured with the
 *               attention's thread count before and after the attention runs (median of all
 *               passes). Decode attention with a GQA group of G query heads per KV head does G
 *               multiply-adds per stored K element (scores) and G per V element (values), so a
 *               format of b bytes per element cannot run faster than rate / G × b bytes per
 *               second: the compute bound, printed next to the bandwidth bound.
 *   attention   one query per sequence at its last position (decode), over B sequences of ctx
 *               tokens, for every layout × format; the time is that of attending all B sequences
 *               (B calls), and the KV bytes read are B × ctx × n_kv_heads × (K + V row bytes),
 *               i.e. llmem_kv_token_bytes with one layer. The caches of one (format, ctx) are held
 *               together where they fit in 2 GiB, and their repetitions are interleaved, so that
 *               paged and contiguous are compared side by side (paging overhead: f16, longest
 *               context, largest batch measured there).
 *   accuracy    relative RMS error of the attention output of each format against f32 storage,
 *               on the same Gaussian keys, values and queries (ctx 4096, 8 queries).
 *   append      4096 tokens appended to one sequence in f16, one at a time (decode), in
 *               512-token chunks, and one at a time into room reserved up front (no growth: the
 *               cost of encoding and writing alone), per layout, with the growth events each
 *               layout went through (the paged pool starts at 16 blocks, 256 tokens, as the
 *               contiguous step, so that it grows too). Each run is timed twice: cold (the
 *               allocator's cache emptied first, so new memory comes from the OS and faults on
 *               first touch) and warm (right after, the cache holding the buffers of that run).
 * --quick keeps paged and contiguous × f16 and q8 at ctx 4K (batch 1, 4) and 32K (batch 1), and
 * every other format once (paged, ctx 4K, batch 1).
 * Keys and values are Gaussian (unit variance), cycled from 4096 generated tokens; queries are
 * Gaussian too, so with the default scale the scores are ≈ N(0, 1): flat attention, the case
 * where every stored byte matters.
 */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "bench.h"
#include "cli/bandwidth.h"
#include "core/clock.h"
#include "core/rng.h"
#include "cli/common.h"
#include "core/json.h"
#include "llmem/pool.h"
#include "kv/codec_internal.h"
#include "llmem/kv.h"
#include "llmem/mem.h"
#include "llmem/sys.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define BENCH_X86 1
#include <immintrin.h>
#else
#define BENCH_X86 0
#endif

/* ---- shapes, grid and helpers ---------------------------------------------------------------- */

/* Query and KV heads (--heads; default those of a Llama-3-8B layer). */
static int n_heads = 32, n_kv_heads = 8;
#define KV_FLOATS ((size_t)n_kv_heads * HEAD_DIM) /* one token's K (or V) row, all KV heads */
#define Q_FLOATS  ((size_t)n_heads * HEAD_DIM)    /* one query, all heads */

enum {
    HEAD_DIM = 128,
    DATA_TOKENS = 4096, /* generated tokens, cycled */
    WRITE_RUN = 512,    /* tokens per write when filling */
    ACC_QUERIES = 8,
    APPEND_CHUNK = 512,
    MAX_BATCH = 64,
};

#define GRID_MAX_TOKENS     ((int64_t)128 * 1024) /* ctx × batch of a default point */
#define GROUP_BUDGET        ((int64_t)2 << 30)    /* KV bytes held at once */
#define EXPLICIT_MAX_TOKENS ((int64_t)256 * 1024)

static const int64_t full_ctxs[] = {1024, 4096, 16384, 32768};
static const int64_t quick_ctxs[] = {4096, 32768};
static const int64_t full_batches[] = {1, 4, 16};
static const int64_t quick_batches[] = {1, 4};
#define QUICK_MAX_TOKENS ((int64_t)32 * 1024) /* --quick: ctx × batch */
#define COUNT(a)         ((int)(sizeof(a) / sizeof((a)[0])))

static void fill_gaussian(float *x, size_t n, uint64_t seed) {
    uint64_t s = seed;
    for (size_t i = 0; i < n; i += 2) {
        double u1 = ((double)(llmem_splitmix64_next(&s) >> 11) + 1.0) * 0x1p-53; /* (0, 1] */
        double u2 = (double)(llmem_splitmix64_next(&s) >> 11) * 0x1p-53;
        double r = sqrt(-2.0 * log(u1)), a = 2.0 * M_PI * u2;
        x[i] = (float)(r * cos(a));
        if (i + 1 < n)
            x[i + 1] = (float)(r * sin(a));
    }
}

/* The run: what to measure, and the shared state. */
struct bench {
    struct llmem_mem *mem;
    int n_threads; /* as asked (≤ 0: online CPUs) */
    int threads;   /* as run */
    int64_t reps;
    enum llmem_kv_route route;    /* attention's route (AUTO: the library chooses) */
    const float *k_data, *v_data; /* [DATA_TOKENS, KV_FLOATS] */
    int64_t progress_done, progress_total;
};

static void progress(struct bench *b) {
    cli_progress("bench kv", ++b->progress_done, b->progress_total);
}

static void bench_tick(void *arg) {
    progress(arg);
}

/* ---- caches ---------------------------------------------------------------------------------- */

/* The benchmark's shape: one layer of n_kv_heads × HEAD_DIM, n_seqs sequences. */
static void bench_config(const struct bench *b, enum llmem_kv_layout layout,
                         enum llmem_kv_format format, int n_seqs, struct llmem_kv_config *cfg) {
    llmem_kv_config_default(cfg);
    cfg->layout = layout;
    cfg->format = format;
    cfg->n_layers = 1;
    cfg->n_kv_heads = n_kv_heads;
    cfg->head_dim = HEAD_DIM;
    cfg->max_sequences = n_seqs;
    cfg->n_threads = b->n_threads;
}

/* A cache of n_seqs sequences of ctx tokens each, one layer, Gaussian data. */
static int build_cache(struct bench *b, enum llmem_kv_layout layout, enum llmem_kv_format format,
                       int64_t ctx, int n_seqs, struct llmem_kv **out) {
    struct llmem_kv_config cfg;
    bench_config(b, layout, format, n_seqs, &cfg);
    cfg.num_blocks = (ctx + 15) / 16 * n_seqs; /* paged: exactly what the batch needs */
    struct llmem_kv *kv = NULL;
    if (llmem_kv_create(&cfg, b->mem, &kv) != LLMEM_OK)
        return CLI_FAIL;
    for (int s = 0; s < n_seqs; s++) {
        int seq = -1;
        if (llmem_kv_seq_new(kv, &seq) != LLMEM_OK || llmem_kv_reserve(kv, seq, ctx) != LLMEM_OK)
            goto out_destroy;
        /* Each sequence starts at its own place in the data so that they differ. */
        int64_t start = ((int64_t)s * 977) % DATA_TOKENS;
        for (int64_t pos = 0; pos < ctx;) {
            int64_t at = (start + pos) % DATA_TOKENS, n = ctx - pos;
            if (n > DATA_TOKENS - at)
                n = DATA_TOKENS - at;
            if (n > WRITE_RUN)
                n = WRITE_RUN;
            if (llmem_kv_write(kv, seq, 0, pos, n, b->k_data + (size_t)at * KV_FLOATS,
                               b->v_data + (size_t)at * KV_FLOATS) != LLMEM_OK)
                goto out_destroy;
            pos += n;
            llmem_kv_set_length(kv, seq, pos); /* a write starts at most at the length */
        }
        progress(b);
    }
    *out = kv;
    return CLI_OK;
out_destroy:
    llmem_kv_destroy(kv);
    return CLI_FAIL;
}

/* ---- compute ceiling ------------------------------------------------------------------------- */

enum { FMA_CHAINS = 12, FMA_ITERS = 1 << 23 }; /* about 50 ms a pass: a sustained rate */

struct fma_job {
    int lanes; /* f32 lanes per FMA: 16, 8, or 1 (portable) */
    volatile float sink;
};

#if BENCH_X86
__attribute__((target("avx512f"))) static float fma_chains512(void) {
    __m512 a[FMA_CHAINS];
    const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
    for (int c = 0; c < FMA_CHAINS; c++)
        a[c] = _mm512_set1_ps((float)c);
    for (int i = 0; i < FMA_ITERS; i++)
        for (int c = 0; c < FMA_CHAINS; c++)
            a[c] = _mm512_fmadd_ps(a[c], x, y);
    for (int c = 1; c < FMA_CHAINS; c++)
        a[0] = _mm512_add_ps(a[0], a[c]);
    return _mm512_reduce_add_ps(a[0]);
}

__attribute__((target("avx,fma"))) static float fma_chains256(void) {
    __m256 a[FMA_CHAINS];
    const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
    for (int c = 0; c < FMA_CHAINS; c++)
        a[c] = _mm256_set1_ps((float)c);
    for (int i = 0; i < FMA_ITERS; i++)
        for (int c = 0; c < FMA_CHAINS; c++)
            a[c] = _mm256_fmadd_ps(a[c], x, y);
    for (int c = 1; c < FMA_CHAINS; c++)
        a[0] = _mm256_add_ps(a[0], a[c]);
    float v[8];
    _mm256_storeu_ps(v, a[0]);
    return v[0] + v[7];
}
#endif

static float fma_chains1(void) {
    float a[FMA_CHAINS];
    for (int c = 0; c < FMA_CHAINS; c++)
        a[c] = (float)c;
    for (int i = 0; i < FMA_ITERS; i++)
        for (int c = 0; c < FMA_CHAINS; c++)
            a[c] = fmaf(a[c], 0.999999f, 1e-7f);
    return a[0] + a[FMA_CHAINS - 1];
}

static void fma_task(void *arg, int task, int thread) {
    (void)task, (void)thread;
    struct fma_job *j = arg;
#if BENCH_X86
    if (j->lanes == 16) {
        j->sink = fma_chains512();
        return;
    }
    if (j->lanes == 8) {
        j->sink = fma_chains256();
        return;
    }
#endif
    j->sink = fma_chains1();
}

/* f32 multiply-adds per second of all threads together, one value per pass, with the vectors
 * of the attention kernels' instruction set; returns their lanes. */
static int fma_rate(struct llmem_pool *pool, int passes, double *rate) {
    struct fma_job j = {.lanes = 1};
#if BENCH_X86
    enum llmem_kv_isa isa = llmem_kv_kernels()->isa;
    j.lanes = isa == LLMEM_KV_ISA_AVX512 ? 16 : isa == LLMEM_KV_ISA_AVX2 ? 8 : 1;
#endif
    int threads = llmem_pool_threads(pool);
    for (int p = 0; p < passes; p++) {
        double t0 = llmem_clock_s();
        llmem_pool_run(pool, threads, fma_task, &j);
        double t = llmem_clock_s() - t0;
        rate[p] = (double)threads * FMA_ITERS * FMA_CHAINS * j.lanes / t;
    }
    return j.lanes;
}

/* The compute bound of decode attention in GB/s of K + V: G multiply-adds per stored element. */
static double compute_bound_gbps(double fma_per_s, enum llmem_kv_format format) {
    struct llmem_kv_config cfg = {
        .format = format, .n_layers = 1, .n_kv_heads = n_kv_heads, .head_dim = HEAD_DIM};
    double bytes_per_elem = (double)llmem_kv_token_bytes(&cfg) / (2.0 * KV_FLOATS);
    return fma_per_s / (n_heads / n_kv_heads) * bytes_per_elem * 1e-9;
}

/* ---- attention ------------------------------------------------------------------------------- */

struct point {
    enum llmem_kv_layout layout;
    enum llmem_kv_format format;
    int64_t ctx, batch;
    double seconds; /* median over the repetitions */
    int64_t kv_bytes;
    const char *route;
};

static int64_t kv_read_bytes(enum llmem_kv_format format, int64_t ctx, int64_t batch) {
    struct llmem_kv_config cfg = {
        .format = format, .n_layers = 1, .n_kv_heads = n_kv_heads, .head_dim = HEAD_DIM};
    return batch * ctx * llmem_kv_token_bytes(&cfg);
}

static const char *route_taken(const struct llmem_kv_stats *before,
                               const struct llmem_kv_stats *after) {
    if (after->route_fallback > before->route_fallback)
        return "fallback";
    if (after->route_partitioned > before->route_partitioned)
        return after->route_direct > before->route_direct ? "mixed" : "partitioned";
    return "direct";
}

/* Attends the first `batch` sequences of kv once each (decode: one query at the last position);
 * returns seconds, or a negative value on failure. */
static double attend_batch(struct llmem_kv *kv, enum llmem_kv_route route, int64_t ctx,
                           int64_t batch, const float *q, float *out) {
    const struct llmem_kv_attn attn = {.n_heads = n_heads, .route = route};
    double t0 = llmem_clock_s();
    for (int s = 0; s < batch; s++)
        if (llmem_kv_attend(kv, s, 0, ctx - 1, 1, q + (size_t)s * Q_FLOATS,
                            out + (size_t)s * Q_FLOATS, &attn) != LLMEM_OK)
            return -1;
    return llmem_clock_s() - t0;
}

/* Measures points[first, last) — all of one format and context — holding the caches of as many
 * layouts at once as GROUP_BUDGET allows, with the repetitions interleaved across them. */
static int run_points(struct bench *b, struct point *points, int first, int last, const float *q,
                      float *out) {
    int rc = CLI_OK;
    double *times = calloc((size_t)(last - first) * (size_t)b->reps, sizeof(*times));
    if (times == NULL)
        return CLI_FAIL;
    int i = first;
    while (i < last && rc == CLI_OK) {
        /* A set of layouts that fits: each layout's cache holds its largest batch. */
        struct llmem_kv *caches[LLMEM_KV_LAYOUT_COUNT] = {NULL};
        int64_t held = 0;
        int end = i;
        while (end < last) {
            enum llmem_kv_layout layout = points[end].layout;
            int64_t max_batch = 0;
            int k = end;
            for (; k < last && points[k].layout == layout; k++)
                max_batch = points[k].batch > max_batch ? points[k].batch : max_batch;
            int64_t bytes = kv_read_bytes(points[end].format, points[end].ctx, max_batch);
            if (end > i && held + bytes > GROUP_BUDGET)
                break;
            held += bytes;
            if (build_cache(b, layout, points[end].format, points[end].ctx, (int)max_batch,
                            &caches[layout]) != CLI_OK) {
                fprintf(stderr,
                        "llmem-bench kv: cannot build a %s %s cache of %lld x %lld"
                        " tokens\n",
                        llmem_kv_layout_name(layout), llmem_kv_format_name(points[end].format),
                        (long long)max_batch, (long long)points[end].ctx);
                rc = CLI_FAIL;
                break;
            }
            end = k;
        }
        /* One untimed pass (it also records the route), then the repetitions interleaved. */
        for (int64_t r = -1; rc == CLI_OK && r < b->reps; r++) {
            for (int p = i; p < end && rc == CLI_OK; p++) {
                struct llmem_kv *kv = caches[points[p].layout];
                struct llmem_kv_stats before, after;
                llmem_kv_stats(kv, &before);
                double t = attend_batch(kv, b->route, points[p].ctx, points[p].batch, q, out);
                if (t < 0) {
                    fprintf(stderr, "llmem-bench kv: attention failed\n");
                    rc = CLI_FAIL;
                    break;
                }
                if (r < 0) {
                    llmem_kv_stats(kv, &after);
                    points[p].route = route_taken(&before, &after);
                } else {
                    times[(size_t)(p - first) * (size_t)b->reps + (size_t)r] = t;
                }
                progress(b);
            }
        }
        for (int p = i; p < end && rc == CLI_OK; p++) {
            points[p].seconds =
                bench_median(times + (size_t)(p - first) * (size_t)b->reps, (int)b->reps);
            points[p].kv_bytes = kv_read_bytes(points[p].format, points[p].ctx, points[p].batch);
        }
        for (int l = 0; l < LLMEM_KV_LAYOUT_COUNT; l++)
            llmem_kv_destroy(caches[l]);
        llmem_mem_clear_cache(b->mem); /* the KV memory goes back to the OS */
        i = end;
    }
    free(times);
    return rc;
}

/* ---- accuracy -------------------------------------------------------------------------------- */

struct accuracy {
    enum llmem_kv_format format;
    double rel_error;
};

/* The outputs of ACC_QUERIES decode queries over one sequence of ctx tokens in `format`. */
static int attend_format(struct bench *b, enum llmem_kv_format format, int64_t ctx, const float *q,
                         float *out) {
    struct llmem_kv *kv = NULL;
    if (build_cache(b, LLMEM_KV_LAYOUT_PAGED, format, ctx, 1, &kv) != CLI_OK)
        return CLI_FAIL;
    const struct llmem_kv_attn attn = {.n_heads = n_heads};
    int rc = CLI_OK;
    for (int i = 0; i < ACC_QUERIES && rc == CLI_OK; i++)
        if (llmem_kv_attend(kv, 0, 0, ctx - 1, 1, q + (size_t)i * Q_FLOATS,
                            out + (size_t)i * Q_FLOATS, &attn) != LLMEM_OK)
            rc = CLI_FAIL;
    llmem_kv_destroy(kv);
    return rc;
}

static int run_accuracy(struct bench *b, const enum llmem_kv_format *formats, int n_formats,
                        int64_t ctx, struct accuracy *acc) {
    const size_t n = (size_t)ACC_QUERIES * Q_FLOATS;
    float *q = malloc(n * sizeof(float)), *ref = malloc(n * sizeof(float)),
          *out = malloc(n * sizeof(float));
    int rc = q != NULL && ref != NULL && out != NULL ? CLI_OK : CLI_FAIL;
    if (rc == CLI_OK) {
        fill_gaussian(q, n, 0xacc);
        rc = attend_format(b, LLMEM_KV_FORMAT_F32, ctx, q, ref);
    }
    for (int f = 0; f < n_formats && rc == CLI_OK; f++) {
        rc = attend_format(b, formats[f], ctx, q, out);
        double err = 0, norm = 0;
        for (size_t i = 0; i < n && rc == CLI_OK; i++) {
            double d = (double)out[i] - (double)ref[i];
            err += d * d;
            norm += (double)ref[i] * (double)ref[i];
        }
        acc[f] = (struct accuracy){formats[f], norm > 0 ? sqrt(err / norm) : 0};
    }
    free(q), free(ref), free(out);
    return rc;
}

/* ---- append and grow ------------------------------------------------------------------------- */

struct append_result {
    enum llmem_kv_layout layout;
    const char *mode; /* "token", "chunk" or "reserved" */
    int64_t tokens, chunk;
    double ns_per_token;      /* warm: the allocator's cache holds this run's buffers */
    double ns_per_token_cold; /* cold: the cache was emptied, fresh pages fault on first touch */
    int64_t grow_events;
};

enum { N_APPEND_MODES = 3 };
static const char *const append_modes[N_APPEND_MODES] = {"token", "chunk", "reserved"};

/* Appends `tokens` tokens in pieces of `chunk` to a fresh f16 cache (with all the room reserved
 * first, untimed, when `reserved`); returns seconds (< 0: failed). */
static double append_once(struct bench *b, enum llmem_kv_layout layout, int64_t tokens,
                          int64_t chunk, int reserved, int64_t *grow_events) {
    struct llmem_kv_config cfg;
    bench_config(b, layout, LLMEM_KV_FORMAT_F16, 1, &cfg);
    cfg.num_blocks = 16; /* 256 tokens, like the contiguous step: the pool grows too */
    struct llmem_kv *kv = NULL;
    int seq = -1;
    if (llmem_kv_create(&cfg, b->mem, &kv) != LLMEM_OK)
        return -1;
    double t = -1;
    if (llmem_kv_seq_new(kv, &seq) == LLMEM_OK &&
        (!reserved || llmem_kv_reserve(kv, seq, tokens) == LLMEM_OK)) {
        struct llmem_kv_stats st0, st;
        llmem_kv_stats(kv, &st0);
        double t0 = llmem_clock_s();
        int64_t pos = 0;
        while (pos < tokens) {
            int64_t at = pos % DATA_TOKENS, n = tokens - pos;
            n = n > chunk ? chunk : n;
            n = n > DATA_TOKENS - at ? DATA_TOKENS - at : n;
            if (llmem_kv_append(kv, seq, n, b->k_data + (size_t)at * KV_FLOATS,
                                b->v_data + (size_t)at * KV_FLOATS) != LLMEM_OK)
                break;
            pos += n;
        }
        if (pos == tokens)
            t = llmem_clock_s() - t0;
        llmem_kv_stats(kv, &st);
        *grow_events = st.grow_events - st0.grow_events;
    }
    llmem_kv_destroy(kv);
    return t;
}

/* Per repetition and per (layout, mode): one cold run, then one warm run. */
static int run_append(struct bench *b, const enum llmem_kv_layout *layouts, int n_layouts,
                      int64_t tokens, struct append_result *res) {
    const int64_t chunks[N_APPEND_MODES] = {1, tokens < APPEND_CHUNK ? tokens : APPEND_CHUNK, 1};
    int n = N_APPEND_MODES * n_layouts, rc = CLI_OK;
    double *times = calloc(2 * (size_t)n * (size_t)b->reps, sizeof(*times));
    if (times == NULL)
        return CLI_FAIL;
    for (int i = 0; i < n; i++)
        res[i] = (struct append_result){.layout = layouts[i / N_APPEND_MODES],
                                        .mode = append_modes[i % N_APPEND_MODES],
                                        .tokens = tokens,
                                        .chunk = chunks[i % N_APPEND_MODES]};
    for (int64_t r = 0; r < b->reps && rc == CLI_OK; r++) {
        for (int i = 0; i < n && rc == CLI_OK; i++) {
            for (int warm = 0; warm < 2 && rc == CLI_OK; warm++) {
                if (!warm)
                    llmem_mem_clear_cache(b->mem);
                double t = append_once(b, res[i].layout, tokens, res[i].chunk,
                                       i % N_APPEND_MODES == 2, &res[i].grow_events);
                if (t < 0) {
                    fprintf(stderr, "llmem-bench kv: appending to a %s cache failed\n",
                            llmem_kv_layout_name(res[i].layout));
                    rc = CLI_FAIL;
                }
                times[((size_t)(2 * i + warm)) * (size_t)b->reps + (size_t)r] = t;
                progress(b);
            }
        }
    }
    for (int i = 0; i < n && rc == CLI_OK; i++) {
        double per = 1e9 / (double)tokens;
        res[i].ns_per_token_cold =
            bench_median(times + (size_t)(2 * i) * (size_t)b->reps, (int)b->reps);
        res[i].ns_per_token =
            bench_median(times + (size_t)(2 * i + 1) * (size_t)b->reps, (int)b->reps);
        res[i].ns_per_token_cold *= per;
        res[i].ns_per_token *= per;
    }
    free(times);
    return rc;
}

/* ---- output ---------------------------------------------------------------------------------- */

struct results {
    struct llmem_device_info host;
    int64_t bw_bytes;
    double read_gbps, copy_gbps;
    double fma_per_s; /* f32 multiply-adds per second, all threads */
    int fma_lanes;
    struct point *points;
    int n_points;
    struct accuracy acc[LLMEM_KV_FORMAT_COUNT];
    int n_acc;
    int64_t acc_ctx;
    struct append_result app[N_APPEND_MODES * LLMEM_KV_LAYOUT_COUNT];
    int n_app;
    int paging; /* whether paged and contiguous f16 were both measured */
    int64_t paging_ctx, paging_batch;
    double paging_paged_s, paging_contiguous_s;
    int64_t peak_bytes; /* the allocator's active peak */
    int64_t rss_peak_bytes;
};

/* Paged against contiguous for f16 at the longest context both ran, the largest batch there. */
static void find_paging(struct results *res) {
    res->paging = 0;
    for (int i = 0; i < res->n_points; i++) {
        const struct point *p = &res->points[i];
        if (p->format != LLMEM_KV_FORMAT_F16 || p->layout != LLMEM_KV_LAYOUT_PAGED)
            continue;
        for (int k = 0; k < res->n_points; k++) {
            const struct point *c = &res->points[k];
            if (c->format != LLMEM_KV_FORMAT_F16 || c->layout != LLMEM_KV_LAYOUT_CONTIGUOUS ||
                c->ctx != p->ctx || c->batch != p->batch)
                continue;
            if (!res->paging || p->ctx > res->paging_ctx ||
                (p->ctx == res->paging_ctx && p->batch > res->paging_batch)) {
                res->paging = 1;
                res->paging_ctx = p->ctx;
                res->paging_batch = p->batch;
                res->paging_paged_s = p->seconds;
                res->paging_contiguous_s = c->seconds;
            }
        }
    }
}

static int print_json(const struct results *res, const struct bench *b, int quick) {
    cJSON *root = cJSON_CreateObject();
    int st = root == NULL;
    cJSON *machine = st ? NULL : cJSON_AddObjectToObject(root, "machine");
    st |= machine == NULL || llmem_json_add_string(machine, "cpu", res->host.name) ||
          llmem_json_add_int(machine, "n_cpus", res->host.n_cpus) ||
          llmem_json_add_int(root, "threads", b->threads) ||
          llmem_json_add_int(root, "reps", b->reps) || llmem_json_add_bool(root, "quick", quick) ||
          llmem_json_add_string(root, "kernels", llmem_kv_kernels_name());
    cJSON *shape = st ? NULL : cJSON_AddObjectToObject(root, "shape");
    st |= shape == NULL || llmem_json_add_int(shape, "n_heads", n_heads) ||
          llmem_json_add_int(shape, "n_kv_heads", n_kv_heads) ||
          llmem_json_add_int(shape, "head_dim", HEAD_DIM) ||
          llmem_json_add_int(shape, "n_layers", 1);
    st |= st || llmem_json_add_int(root, "bandwidth_bytes", res->bw_bytes) ||
          llmem_json_add_double(root, "bandwidth_read_gbps", res->read_gbps) ||
          llmem_json_add_double(root, "bandwidth_copy_gbps", res->copy_gbps) ||
          llmem_json_add_double(root, "fma_per_s", res->fma_per_s) ||
          llmem_json_add_int(root, "fma_lanes", res->fma_lanes);
    cJSON *list = st ? NULL : cJSON_AddArrayToObject(root, "attention");
    st |= list == NULL;
    for (int i = 0; i < res->n_points && !st; i++) {
        const struct point *p = &res->points[i];
        double gbps = (double)p->kv_bytes / p->seconds * 1e-9;
        double bound = compute_bound_gbps(res->fma_per_s, p->format);
        cJSON *o = cJSON_CreateObject();
        st |= o == NULL || !cJSON_AddItemToArray(list, o);
        st |= st || llmem_json_add_string(o, "layout", llmem_kv_layout_name(p->layout)) ||
              llmem_json_add_string(o, "format", llmem_kv_format_name(p->format)) ||
              llmem_json_add_int(o, "ctx", p->ctx) || llmem_json_add_int(o, "batch", p->batch) ||
              llmem_json_add_double(o, "seconds", p->seconds) ||
              llmem_json_add_int(o, "kv_bytes", p->kv_bytes) ||
              llmem_json_add_double(o, "gbps", gbps) ||
              llmem_json_add_double(o, "fraction_of_bandwidth", gbps / res->read_gbps) ||
              llmem_json_add_double(o, "compute_bound_gbps", bound) ||
              llmem_json_add_double(o, "fraction_of_compute_bound", gbps / bound) ||
              llmem_json_add_string(o, "route", p->route);
    }
    list = st ? NULL : cJSON_AddArrayToObject(root, "accuracy");
    st |= list == NULL;
    for (int i = 0; i < res->n_acc && !st; i++) {
        cJSON *o = cJSON_CreateObject();
        st |= o == NULL || !cJSON_AddItemToArray(list, o);
        st |= st || llmem_json_add_string(o, "format", llmem_kv_format_name(res->acc[i].format)) ||
              llmem_json_add_int(o, "ctx", res->acc_ctx) ||
              llmem_json_add_double(o, "rel_error", res->acc[i].rel_error);
    }
    list = st ? NULL : cJSON_AddArrayToObject(root, "append");
    st |= list == NULL;
    for (int i = 0; i < res->n_app && !st; i++) {
        const struct append_result *a = &res->app[i];
        cJSON *o = cJSON_CreateObject();
        st |= o == NULL || !cJSON_AddItemToArray(list, o);
        st |= st || llmem_json_add_string(o, "layout", llmem_kv_layout_name(a->layout)) ||
              llmem_json_add_string(o, "mode", a->mode) ||
              llmem_json_add_int(o, "tokens", a->tokens) ||
              llmem_json_add_int(o, "chunk", a->chunk) ||
              llmem_json_add_double(o, "ns_per_token", a->ns_per_token) ||
              llmem_json_add_double(o, "ns_per_token_cold", a->ns_per_token_cold) ||
              llmem_json_add_int(o, "grow_events", a->grow_events);
    }
    if (!st && res->paging) {
        cJSON *o = cJSON_AddObjectToObject(root, "paging");
        st |= o == NULL || llmem_json_add_int(o, "ctx", res->paging_ctx) ||
              llmem_json_add_int(o, "batch", res->paging_batch) ||
              llmem_json_add_double(o, "paged_seconds", res->paging_paged_s) ||
              llmem_json_add_double(o, "contiguous_seconds", res->paging_contiguous_s);
        st |= st || llmem_json_add_double(root, "paging_overhead",
                                          res->paging_paged_s / res->paging_contiguous_s - 1);
    } else {
        st |= st || llmem_json_add_null(root, "paging_overhead");
    }
    st |= st || llmem_json_add_int(root, "memory_peak_bytes", res->peak_bytes) ||
          llmem_json_add_int(root, "rss_peak_bytes", res->rss_peak_bytes);
    if (st) {
        cJSON_Delete(root);
        fprintf(stderr, "llmem-bench kv: out of memory building the JSON output\n");
        return CLI_FAIL;
    }
    return cli_print_json(root);
}

static void print_table(const struct results *res, const struct bench *b) {
    printf("llmem-bench kv: %s, %d CPUs, %d thread%s, %s kernels; %d query heads, %d KV heads,"
           " head_dim %d, one layer; median of %lld runs\n",
           res->host.name, res->host.n_cpus, b->threads, b->threads == 1 ? "" : "s",
           llmem_kv_kernels_name(), n_heads, n_kv_heads, HEAD_DIM, (long long)b->reps);
    printf("memory bandwidth (%lld MiB buffer, %d thread%s): read %.1f GB/s, copy %.1f GB/s"
           " (bytes read + written)\n",
           (long long)(res->bw_bytes >> 20), b->threads, b->threads == 1 ? "" : "s", res->read_gbps,
           res->copy_gbps);
    printf("compute (%d thread%s, %d-lane FMA): %.1f G f32 multiply-adds/s; decode attention does"
           " %d (the GQA group)\nper stored K or V element, so it cannot beat rate / %d x bytes"
           " per element: f16 and bf16 %.1f GB/s,\nf32 %.1f, q8 %.1f (\"of FMA\": the share of"
           " that bound)\n\n",
           b->threads, b->threads == 1 ? "" : "s", res->fma_lanes, res->fma_per_s * 1e-9,
           n_heads / n_kv_heads, n_heads / n_kv_heads,
           compute_bound_gbps(res->fma_per_s, LLMEM_KV_FORMAT_F16),
           compute_bound_gbps(res->fma_per_s, LLMEM_KV_FORMAT_F32),
           compute_bound_gbps(res->fma_per_s, LLMEM_KV_FORMAT_Q8));

    printf("decode attention: one query per sequence at its last position, all sequences of the"
           " batch\n");
    printf("%-10s %-6s %6s %5s %10s %9s %8s %8s %7s  %s\n", "layout", "format", "ctx", "batch",
           "time ms", "KV MiB", "GB/s", "of read", "of FMA", "route");
    for (int i = 0; i < res->n_points; i++) {
        const struct point *p = &res->points[i];
        double gbps = (double)p->kv_bytes / p->seconds * 1e-9;
        printf("%-10s %-6s %6lld %5lld %10.3f %9.1f %8.2f %7.1f%% %6.1f%%  %s\n",
               llmem_kv_layout_name(p->layout), llmem_kv_format_name(p->format), (long long)p->ctx,
               (long long)p->batch, p->seconds * 1e3, (double)p->kv_bytes / (1 << 20), gbps,
               100 * gbps / res->read_gbps,
               100 * gbps / compute_bound_gbps(res->fma_per_s, p->format), p->route);
    }
    if (res->paging)
        printf("\npaging overhead (f16, ctx %lld, batch %lld): paged %.3f ms, contiguous %.3f ms:"
               " %+.1f%% (goal <= 5%%)\n",
               (long long)res->paging_ctx, (long long)res->paging_batch, res->paging_paged_s * 1e3,
               res->paging_contiguous_s * 1e3,
               100 * (res->paging_paged_s / res->paging_contiguous_s - 1));

    printf("\naccuracy at ctx %lld: relative RMS error of the output against f32 storage"
           " (Gaussian data, %d queries)\n",
           (long long)res->acc_ctx, ACC_QUERIES);
    printf("%-6s %12s\n", "format", "rel error");
    for (int i = 0; i < res->n_acc; i++)
        printf("%-6s %12.3e\n", llmem_kv_format_name(res->acc[i].format), res->acc[i].rel_error);

    if (res->n_app > 0)
        printf("\nappend %lld tokens to one sequence (f16, one layer): ns per token, with the"
               " allocator's cache\nholding the run's buffers (warm) or emptied first (cold: fresh"
               " pages); reserved: the room\nreserved up front (no growth)\n",
               (long long)res->app[0].tokens);
    printf("%-10s %-9s %6s %12s %12s %12s\n", "layout", "mode", "chunk", "warm ns", "cold ns",
           "grow events");
    for (int i = 0; i < res->n_app; i++) {
        const struct append_result *a = &res->app[i];
        printf("%-10s %-9s %6lld %12.0f %12.0f %12lld\n", llmem_kv_layout_name(a->layout), a->mode,
               (long long)a->chunk, a->ns_per_token, a->ns_per_token_cold,
               (long long)a->grow_events);
    }
    printf("\nmemory peak: %.0f MiB in llmem buffers, %.0f MiB resident\n",
           (double)res->peak_bytes / (1 << 20), (double)res->rss_peak_bytes / (1 << 20));
}

/* ---- the command ----------------------------------------------------------------------------- */

static const char bench_kv_usage[] =
    "usage: llmem-bench kv [--quick] [--reps N] [--threads N] [--json]\n"
    "                      [--ctx N] [--batch N] [--kv-layout L,..] [--kv-format F,..]\n"
    "                      [--bw-size SIZE] [--route R] [--heads Q/KV] [--isa I]\n"
    "\n"
    "Decode attention over the KV caches (32 query heads, 8 KV heads unless --heads; head_dim\n"
    "128, one layer) for every layout (paged, contiguous, blocks, ragged) and format (f16, bf16,\n"
    "f32, q8, q4, tq), at contexts 1K-32K and batches 1/4/16 (ctx x batch <= 128K tokens):\n"
    "time, KV bytes read per second, and the fraction of the memory read bandwidth measured in\n"
    "the same run; and the fraction of the compute bound (the f32 FMA rate measured in the same\n"
    "run, G multiply-adds per stored element for a GQA group of G, 4 by default);\n"
    "the paged/contiguous ratio (f16, longest context); each format's error against f32 at\n"
    "ctx 4096; and the time per token of appending 4096 tokens (f16) one at a time, in chunks\n"
    "of 512, and one at a time into reserved room, warm (allocator cache) and cold.\n"
    "\n"
    "  --quick        paged and contiguous x f16 and q8 at ctx 4K (batch 1, 4) and 32K (batch\n"
    "                 1), every other format at ctx 4K: under 20 s on 2 cores\n"
    "  --reps N       repetitions, medians reported (default 5, quick 3)\n"
    "  --threads N    attention and bandwidth threads (default: the online CPUs)\n"
    "  --json         one JSON object: machine, threads, bandwidth_read_gbps,\n"
    "                 bandwidth_copy_gbps, fma_per_s, fma_lanes, attention[] {layout, format,\n"
    "                 ctx, batch, seconds, kv_bytes, gbps, fraction_of_bandwidth,\n"
    "                 compute_bound_gbps, fraction_of_compute_bound, route}, accuracy[]\n"
    "                 {format, ctx, rel_error}, append[] {layout, mode, tokens, chunk, "
    "ns_per_token,\n"
    "                 ns_per_token_cold, grow_events}, paging {ctx, batch, paged_seconds,\n"
    "                 contiguous_seconds}, paging_overhead (null without paged and contiguous\n"
    "                 f16), memory_peak_bytes, rss_peak_bytes\n"
    "  --ctx N        one context instead of the grid; accuracy and append then use\n"
    "                 min(N, 4096) tokens (a small N makes the smallest run)\n"
    "  --batch N      one batch size instead of 1/4/16 (ctx x batch <= 256K tokens)\n"
    "  --kv-layout L,..  (or --layouts) only these layouts; append follows\n"
    "  --kv-format F,..  (or --formats) only these formats; accuracy follows\n"
    "  --bw-size SIZE the bandwidth buffer (default 512M, quick 256M)\n"
    "  --route R      attention route: auto (default: the library's choice), direct,\n"
    "                 partitioned or fallback\n"
    "  --heads Q/KV   query and KV heads (default 32/8; Q a multiple of KV, at most 256)\n"
    "  --isa I        the attention kernels' instruction set: best (default), avx512, avx2 or\n"
    "                 scalar (portable C); the compute probe uses its vectors\n";

static int parse_layout(const char *name, int *out) {
    enum llmem_kv_layout l;
    int st = llmem_kv_layout_parse(name, &l);
    *out = (int)l;
    return st;
}

/* The attention points, ordered by format, then context, then layout, then batch. */
static int make_points(struct point *points, const int *layouts, int n_layouts, const int *formats,
                       int n_formats, const int64_t *ctxs, int n_ctxs, const int64_t *batches,
                       int n_batches, int64_t max_tokens, int quick_extra) {
    int n = 0;
    for (int f = 0; f < LLMEM_KV_FORMAT_COUNT; f++) {
        int in_grid = 0;
        for (int i = 0; i < n_formats; i++)
            in_grid |= formats[i] == f;
        for (int c = 0; c < n_ctxs; c++) {
            for (int l = 0; l < LLMEM_KV_LAYOUT_COUNT; l++) {
                int in_layouts = 0;
                for (int i = 0; i < n_layouts; i++)
                    in_layouts |= layouts[i] == l;
                for (int bi = 0; bi < n_batches; bi++) {
                    int take = in_grid && in_layouts && ctxs[c] * batches[bi] <= max_tokens;
                    /* --quick: every other format once, paged, first context, batch 1 */
                    if (!in_grid && quick_extra)
                        take = l == LLMEM_KV_LAYOUT_PAGED && c == 0 && bi == 0;
                    if (take && points != NULL)
                        points[n] = (struct point){(enum llmem_kv_layout)l,
                                                   (enum llmem_kv_format)f,
                                                   ctxs[c],
                                                   batches[bi],
                                                   0,
                                                   0,
                                                   "direct"};
                    n += take;
                }
            }
        }
    }
    return n;
}

/* The index of value among names, or -1 after a usage error naming the choices. */
static int pick(const char *flag, const char *value, const char *const *names, int n) {
    for (int i = 0; i < n; i++)
        if (strcmp(value, names[i]) == 0)
            return i;
    char list[128] = "";
    for (int i = 0; i < n; i++)
        snprintf(list + strlen(list), sizeof(list) - strlen(list), "%s%s", i ? ", " : "", names[i]);
    cli_usage_error("kv", "%s: '%s' is not one of %s", flag, value, list);
    return -1;
}

int bench_kv(int argc, char **argv) {
    static const struct option options[] = {
        {"quick", no_argument, NULL, 'q'},
        {"reps", required_argument, NULL, 'r'},
        {"threads", required_argument, NULL, 't'},
        {"json", no_argument, NULL, 'j'},
        {"ctx", required_argument, NULL, 'c'},
        {"batch", required_argument, NULL, 'b'},
        {"kv-layout", required_argument, NULL, 'L'},
        {"kv-format", required_argument, NULL, 'F'},
        {"layouts", required_argument, NULL, 'L'},
        {"formats", required_argument, NULL, 'F'},
        {"bw-size", required_argument, NULL, 'w'},
        {"route", required_argument, NULL, 'R'},
        {"isa", required_argument, NULL, 'I'},
        {"heads", required_argument, NULL, 'H'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int quick = 0, json = 0, c;
    int64_t reps = 0, threads = 0, ctx = 0, batch = 0, bw_bytes = 0;
    int layouts[LLMEM_KV_LAYOUT_COUNT], formats[LLMEM_KV_FORMAT_COUNT];
    int n_layouts = 0, n_formats = 0;
    enum llmem_kv_route route = LLMEM_KV_ROUTE_AUTO;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", options, NULL)) != -1) {
        switch (c) {
        case 'q': quick = 1; break;
        case 'j': json = 1; break;
        case 'r':
            if (cli_parse_int("--reps", optarg, 1, 1000, &reps) != CLI_OK)
                return CLI_USAGE;
            break;
        case 't':
            if (cli_parse_int("--threads", optarg, 1, 1024, &threads) != CLI_OK)
                return CLI_USAGE;
            break;
        case 'c':
            if (cli_parse_int("--ctx", optarg, 1, EXPLICIT_MAX_TOKENS, &ctx) != CLI_OK)
                return CLI_USAGE;
            break;
        case 'b':
            if (cli_parse_int("--batch", optarg, 1, MAX_BATCH, &batch) != CLI_OK)
                return CLI_USAGE;
            break;
        case 'L':
            if ((n_layouts = cli_parse_names("kv", "--kv-layout", optarg, LLMEM_KV_LAYOUT_COUNT,
                                             layouts, parse_layout)) < 0)
                return CLI_USAGE;
            break;
        case 'F':
            if ((n_formats = cli_parse_names("kv", "--kv-format", optarg, LLMEM_KV_FORMAT_COUNT,
                                             formats, cli_kv_format_name_parse)) < 0)
                return CLI_USAGE;
            break;
        case 'w':
            if (cli_parse_size("--bw-size", optarg, &bw_bytes) != CLI_OK)
                return CLI_USAGE;
            if (bw_bytes < 4096 || bw_bytes > ((int64_t)16 << 30))
                return cli_usage_error("kv", "--bw-size: must lie in [4K, 16G]");
            break;
        case 'R': {
            static const char *const routes[] = {"auto", "direct", "partitioned", "fallback"};
            int r = pick("--route", optarg, routes, 4);
            if (r < 0)
                return CLI_USAGE;
            route = (enum llmem_kv_route)r;
            break;
        }
        case 'I': {
            static const char *const isas[] = {"scalar", "avx2", "avx512", "best"};
            int i = pick("--isa", optarg, isas, 4);
            if (i < 0)
                return CLI_USAGE;
            enum llmem_kv_isa want = i == 3 ? llmem_kv_isa_best() : (enum llmem_kv_isa)i;
            if (llmem_kv_codec_set_isa(want) != want)
                return cli_usage_error("kv", "--isa: this CPU has no %s kernels (best: %s)", optarg,
                                       isas[llmem_kv_isa_best()]);
            break;
        }
        case 'H': {
            int q = 0, kv = 0, used = 0;
            if (sscanf(optarg, "%d/%d%n", &q, &kv, &used) != 2 || optarg[used] != '\0' || kv < 1 ||
                q < kv || q > 256 || q % kv != 0)
                return cli_usage_error("kv",
                                       "--heads: '%s' is not Q/KV with Q a multiple of KV, at most"
                                       " 256",
                                       optarg);
            n_heads = q, n_kv_heads = kv;
            break;
        }
        case 'h': fputs(bench_kv_usage, stdout); return CLI_OK;
        case ':': return cli_usage_error("kv", "%s needs a value", argv[optind - 1]);
        default: return cli_usage_error("kv", "unknown option '%s' (see --help)", argv[optind - 1]);
        }
    }
    if (optind < argc)
        return cli_usage_error("kv", "unexpected argument '%s'", argv[optind]);
    if (ctx > 0 && batch > 0 && ctx * batch > EXPLICIT_MAX_TOKENS)
        return cli_usage_error("kv", "--ctx x --batch: %lld tokens is over %lld",
                               (long long)(ctx * batch), (long long)EXPLICIT_MAX_TOKENS);
    if (reps == 0)
        reps = quick ? 3 : 5;
    if (bw_bytes == 0)
        bw_bytes = (int64_t)(quick ? 256 : 512) << 20;

    /* The grid. */
    int quick_extra = quick && n_formats == 0;
    if (n_layouts == 0) {
        n_layouts = quick ? 2 : LLMEM_KV_LAYOUT_COUNT;
        for (int i = 0; i < n_layouts; i++)
            layouts[i] = i; /* paged, contiguous first */
    }
    if (n_formats == 0) {
        static const int quick_formats[] = {LLMEM_KV_FORMAT_F16, LLMEM_KV_FORMAT_Q8};
        n_formats = quick ? 2 : LLMEM_KV_FORMAT_COUNT;
        for (int i = 0; i < n_formats; i++)
            formats[i] = quick ? quick_formats[i] : i;
    }
    const int64_t *ctxs = quick ? quick_ctxs : full_ctxs;
    int n_ctxs = quick ? COUNT(quick_ctxs) : COUNT(full_ctxs);
    const int64_t *batches = quick ? quick_batches : full_batches;
    int n_batches = quick ? COUNT(quick_batches) : COUNT(full_batches);
    int64_t max_tokens = quick ? QUICK_MAX_TOKENS : GRID_MAX_TOKENS;
    if (ctx > 0) {
        ctxs = &ctx;
        n_ctxs = 1;
    }
    if (batch > 0) {
        batches = &batch;
        n_batches = 1;
    }
    if (ctx > 0 || batch > 0)
        max_tokens = EXPLICIT_MAX_TOKENS;

    struct results res;
    memset(&res, 0, sizeof(res));
    res.n_points = make_points(NULL, layouts, n_layouts, formats, n_formats, ctxs, n_ctxs, batches,
                               n_batches, max_tokens, quick_extra);
    if (res.n_points == 0)
        return cli_usage_error("kv", "no attention point fits (ctx x batch <= %lld)",
                               (long long)max_tokens);
    res.points = calloc((size_t)res.n_points, sizeof(*res.points));
    int64_t max_batch = 1;
    for (int i = 0; i < n_batches; i++)
        max_batch = batches[i] > max_batch ? batches[i] : max_batch;
    float *k_data = malloc((size_t)DATA_TOKENS * KV_FLOATS * sizeof(float));
    float *v_data = malloc((size_t)DATA_TOKENS * KV_FLOATS * sizeof(float));
    float *q = malloc((size_t)max_batch * Q_FLOATS * sizeof(float));
    float *out = malloc((size_t)max_batch * Q_FLOATS * sizeof(float));
    struct llmem_mem *mem = NULL;
    struct llmem_pool *pool = NULL;
    double *read_gbps = NULL, *copy_gbps = NULL, *fma_rates = NULL;
    int rc = CLI_FAIL;
    if (res.points == NULL || k_data == NULL || v_data == NULL || q == NULL || out == NULL) {
        fprintf(stderr, "llmem-bench kv: out of memory\n");
        goto out;
    }
    make_points(res.points, layouts, n_layouts, formats, n_formats, ctxs, n_ctxs, batches,
                n_batches, max_tokens, quick_extra);
    fill_gaussian(k_data, (size_t)DATA_TOKENS * KV_FLOATS, 0x6b);
    fill_gaussian(v_data, (size_t)DATA_TOKENS * KV_FLOATS, 0x76);
    fill_gaussian(q, (size_t)max_batch * Q_FLOATS, 0x71);

    /* A cache large enough for every buffer of one append run (a warm run reuses them all);
     * attention caches are released to the OS when they are destroyed. */
    struct llmem_mem_config mcfg = {.cache_limit_bytes = (int64_t)256 << 20};
    if (llmem_mem_create(&mcfg, &mem) != LLMEM_OK ||
        llmem_pool_create((int)threads, &pool) != LLMEM_OK)
        goto out;
    struct bench b = {.mem = mem,
                      .n_threads = (int)threads,
                      .threads = llmem_pool_threads(pool),
                      .reps = reps,
                      .route = route,
                      .k_data = k_data,
                      .v_data = v_data};

    /* Progress units: bandwidth passes, filled sequences, timed attention runs, the accuracy
     * caches and the append runs. */
    int bw_passes = reps < 3 ? 3 : (int)reps;
    b.progress_total = 2 * (int64_t)(bw_passes + 1);
    for (int i = 0; i < res.n_points; i++) {
        const struct point *p = &res.points[i];
        b.progress_total += reps + 1;
        /* the sequences filled: the largest batch of each (format, ctx, layout) */
        if (i + 1 == res.n_points || res.points[i + 1].layout != p->layout ||
            res.points[i + 1].ctx != p->ctx || res.points[i + 1].format != p->format)
            b.progress_total += p->batch;
    }
    res.acc_ctx = ctx > 0 && ctx < DATA_TOKENS ? ctx : DATA_TOKENS;
    res.n_acc = n_formats + (quick_extra ? LLMEM_KV_FORMAT_COUNT - n_formats : 0);
    b.progress_total += res.n_acc + 1 + 2 * N_APPEND_MODES * n_layouts * reps;

    read_gbps = calloc(2 * (size_t)bw_passes, sizeof(double));
    copy_gbps = calloc(2 * (size_t)bw_passes, sizeof(double));
    fma_rates = calloc(2 * (size_t)bw_passes, sizeof(double));
    if (read_gbps == NULL || copy_gbps == NULL || fma_rates == NULL)
        goto out;
    res.fma_lanes = fma_rate(pool, bw_passes, fma_rates);
    res.bw_bytes = bw_bytes;
    if (cli_bandwidth(b.mem, pool, bw_bytes, bw_passes, read_gbps, copy_gbps, bench_tick, &b) !=
        CLI_OK)
        goto out;
    llmem_mem_clear_cache(b.mem); /* every group of caches starts from fresh memory */

    /* Attention: one (format, ctx) at a time. */
    for (int i = 0; i < res.n_points;) {
        int end = i;
        while (end < res.n_points && res.points[end].format == res.points[i].format &&
               res.points[end].ctx == res.points[i].ctx)
            end++;
        if (run_points(&b, res.points, i, end, q, out) != CLI_OK)
            goto out;
        i = end;
    }
    find_paging(&res);

    /* Accuracy: the grid's formats (every format with --quick). */
    enum llmem_kv_format acc_formats[LLMEM_KV_FORMAT_COUNT];
    int n_acc = 0;
    for (int f = 0; f < LLMEM_KV_FORMAT_COUNT; f++) {
        int in = quick_extra;
        for (int i = 0; i < n_formats; i++)
            in |= formats[i] == f;
        if (in)
            acc_formats[n_acc++] = (enum llmem_kv_format)f;
    }
    res.n_acc = n_acc;
    if (run_accuracy(&b, acc_formats, n_acc, res.acc_ctx, res.acc) != CLI_OK)
        goto out;

    /* Append and grow: the grid's layouts, in f16. */
    enum llmem_kv_layout app_layouts[LLMEM_KV_LAYOUT_COUNT];
    for (int i = 0; i < n_layouts; i++)
        app_layouts[i] = (enum llmem_kv_layout)layouts[i];
    res.n_app = N_APPEND_MODES * n_layouts;
    if (run_append(&b, app_layouts, n_layouts, res.acc_ctx, res.app) != CLI_OK)
        goto out;

    /* Bandwidth again, after everything, so that drift over the run shows in the median. */
    if (cli_bandwidth(b.mem, pool, bw_bytes, bw_passes, read_gbps + bw_passes,
                      copy_gbps + bw_passes, bench_tick, &b) != CLI_OK)
        goto out;
    fma_rate(pool, bw_passes, fma_rates + bw_passes);
    res.fma_per_s = bench_median(fma_rates, 2 * bw_passes);
    res.read_gbps = bench_median(read_gbps, 2 * bw_passes);
    res.copy_gbps = bench_median(copy_gbps, 2 * bw_passes);
    res.peak_bytes = llmem_mem_peak(mem);
    struct rusage ru;
    res.rss_peak_bytes = getrusage(RUSAGE_SELF, &ru) == 0 ? (int64_t)ru.ru_maxrss * 1024 : 0;
    cli_progress_done();

    llmem_sys_probe_host(&res.host);
    if (json) {
        rc = print_json(&res, &b, quick);
    } else {
        print_table(&res, &b);
        rc = CLI_OK;
    }
out:
    cli_progress_done();
    free(read_gbps), free(copy_gbps), free(fma_rates);
    llmem_pool_destroy(pool);
    llmem_mem_destroy(mem);
    free(res.points), free(k_data), free(v_data), free(q), free(out);
    return rc;
}
