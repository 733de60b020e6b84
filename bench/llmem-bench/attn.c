/*
 * bench/llmem-bench/attn.c — `llmem-bench attn --backend cuda`: decode attention over the paged KV
 * cache on a GPU, through the cache and backend the engine uses (llmem_kv_attend_last), against the
 * device's copy bandwidth measured in the same run.
 *
 * Shapes: 32 query heads, 8 KV heads, head_dim 128, blocks of 16 tokens (Llama-3-8B's attention);
 * BATCHxCONTEXT sequences, each filled to the full context. One call attends the last position of
 * every sequence, as a decode step does. It runs the way a decode step does too: recorded as a
 * CUDA graph, then replayed; the time per call is the device's, from CUDA events around each
 * replay (llmem_backend_counters), median over --reps calls in groups. Bandwidth = the K + V
 * bytes the call reads / its time, against the device-to-device copy (bytes read + written).
 * The CPU's caches are measured by `llmem-bench kv`.
 */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "backend/ops.h"
#include "bench.h"
#include "cli/common.h"
#include "core/json.h"
#include "llmem/kv.h"
#include "llmem/mem.h"

#define N_HEADS    32
#define N_KV_HEADS 8
#define HEAD_DIM   128
#define MAX_SHAPES 8
#define MAX_FMTS   4
#define CHUNK      512 /* tokens written at a time while filling */
#define GROUPS     5   /* the reps are timed in this many groups; the median group is reported */

struct attn_point {
    enum llmem_kv_format format;
    int64_t batch, context;
    double ms, gbps, fraction;
};

static const char attn_help[] =
    "usage: llmem-bench attn --backend cuda [options]\n"
    "Paged decode attention on a GPU (32 query heads, 8 KV heads, head_dim 128, blocks of 16),\n"
    "through the engine's cache and backend, against the device's copy bandwidth.\n"
    "  --backend B      cuda (the CPU's caches: llmem-bench kv)\n"
    "  --device N       the CUDA device (default 0)\n"
    "  --shapes LIST    BATCHxCONTEXT, e.g. 64x8192,1x4096 (default 64x8192,1x4096,16x2048)\n"
    "  --formats LIST   f16, bf16, q8, f32, q4, tq (default bf16,q8)\n"
    "  --reps N         calls timed per shape (default 50)\n"
    "  --copy-size SIZE the copy bandwidth probe's buffer (default 1G)\n"
    "  --json           one JSON object: device copy bandwidth, points[] {format, batch, context,\n"
    "                   ms_per_call, kv_gbps, fraction_of_copy_bandwidth}\n";

static int parse_shapes(const char *list, int64_t shapes[][2], int *n) {
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", list);
    *n = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t != NULL;
         t = strtok_r(NULL, ",", &save)) {
        char *end, *end2 = NULL;
        long long b = strtoll(t, &end, 10), c = *end == 'x' ? strtoll(end + 1, &end2, 10) : 0;
        if (*n == MAX_SHAPES || b < 1 || b > 4096 || *end != 'x' || end2 == end + 1 ||
            *end2 != '\0' || c < 1 || c > (1 << 20))
            return cli_usage_error(
                "attn", "--shapes: '%s' is not BATCHxCONTEXT (at most %d of them)", t, MAX_SHAPES);
        shapes[*n][0] = b, shapes[*n][1] = c;
        (*n)++;
    }
    return *n > 0 ? CLI_OK : cli_usage_error("attn", "--shapes: empty list");
}

/* Fills a random float buffer of n values in (-1, 1) on the host. */
static float *random_host(int64_t n, uint64_t seed) {
    float *p = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; p != NULL && i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (float)((double)(seed >> 40) / 8388608.0 - 1.0);
    }
    return p;
}

/* One shape and format: fill a device cache, then time the attention. */
static int measure(const struct llmem_backend *be, struct llmem_mem *mem,
                   enum llmem_kv_format format, int64_t batch, int64_t context, int64_t reps,
                   double *ms) {
    struct llmem_kv_config kc;
    llmem_kv_config_default(&kc);
    kc.format = format;
    kc.n_layers = 1;
    kc.n_kv_heads = N_KV_HEADS;
    kc.head_dim = HEAD_DIM;
    kc.max_sequences = (int)batch;
    kc.block_size = 16;
    kc.num_blocks = batch * ((context + 15) / 16);
    kc.dynamic = 0;
    kc.device = be;
    const int64_t row = N_KV_HEADS * HEAD_DIM, q_row = N_HEADS * HEAD_DIM;
    struct llmem_kv *kv = NULL;
    int *seqs = calloc((size_t)batch, sizeof(int));
    float *hk = random_host(CHUNK * row, 1), *hq = random_host(batch * q_row, 2);
    float *dk = llmem_mem_alloc(mem, (size_t)(CHUNK * row) * sizeof(float), LLMEM_TAG_SCRATCH);
    float *dq = llmem_mem_alloc(mem, (size_t)(batch * q_row) * sizeof(float), LLMEM_TAG_SCRATCH);
    float *dout = llmem_mem_alloc(mem, (size_t)(batch * q_row) * sizeof(float), LLMEM_TAG_SCRATCH);
    int rc = CLI_FAIL;
    if (seqs == NULL || hk == NULL || hq == NULL || dk == NULL || dq == NULL || dout == NULL ||
        llmem_kv_create(&kc, mem, &kv) != LLMEM_OK ||
        be->ops->copy(be->ctx, dk, hk, (size_t)(CHUNK * row) * sizeof(float)) != LLMEM_OK ||
        be->ops->copy(be->ctx, dq, hq, (size_t)(batch * q_row) * sizeof(float)) != LLMEM_OK)
        goto out;
    for (int64_t s = 0; s < batch; s++) { /* the same chunk of keys (and values) again and again */
        if (llmem_kv_seq_new(kv, &seqs[s]) != LLMEM_OK)
            goto out;
        for (int64_t pos = 0; pos < context; pos += CHUNK) {
            int64_t n = context - pos < CHUNK ? context - pos : CHUNK;
            if (llmem_kv_append(kv, seqs[s], n, dk, dk) != LLMEM_OK)
                goto out;
        }
    }
    const struct llmem_kv_attn attn = {.n_heads = N_HEADS};
    if (llmem_kv_step(kv, (int)batch, seqs, NULL) != LLMEM_OK)
        goto out;
    struct llmem_backend_counters c0, c1;
    double times[GROUPS];
    const int64_t per_group = reps / GROUPS > 0 ? reps / GROUPS : 1;
    for (int64_t i = -2; i < GROUPS * per_group; i++) { /* two calls: run once, then recorded */
        if (i >= 0 && i % per_group == 0)
            be->ops->counters(be->ctx, &c0);
        if (be->ops->graph_begin(be->ctx, (uint64_t)batch, LLMEM_GRAPH_REPLAY) != LLMEM_OK)
            goto out;
        int status = llmem_kv_attend_last(kv, (int)batch, seqs, NULL, 0, dq, dout, &attn);
        int ended = be->ops->graph_end(be->ctx);
        if (ended == LLMEM_OK)
            ended = be->ops->graph_launch(be->ctx, status == LLMEM_OK);
        if (ended == LLMEM_EBUSY) /* not replayed (nothing ran): not a call of the group */
            continue;
        if (status != LLMEM_OK || ended != LLMEM_OK || be->ops->sync(be->ctx) != LLMEM_OK)
            goto out;
        if (i >= 0 && (i + 1) % per_group == 0) {
            be->ops->counters(be->ctx, &c1);
            int64_t replays = c1.graphs_replayed - c0.graphs_replayed;
            if (replays <= 0) {
                fprintf(stderr, "llmem-bench attn: the calls were not replayed as a graph\n");
                goto out;
            }
            times[i / per_group] = (c1.graphs_device_s - c0.graphs_device_s) / replays * 1e3;
        }
    }
    *ms = bench_median(times, GROUPS);
    rc = CLI_OK;
out:
    if (rc != CLI_OK)
        fprintf(stderr, "llmem-bench attn: %s %" PRId64 "x%" PRId64 " failed (%s)\n",
                llmem_kv_format_name(format), batch, context, llmem_last_error());
    llmem_kv_destroy(kv);
    llmem_mem_free(mem, dk), llmem_mem_free(mem, dq), llmem_mem_free(mem, dout);
    free(seqs), free(hk), free(hq);
    return rc;
}

int bench_attn(int argc, char **argv) {
    enum { OPT_BACKEND = 256, OPT_DEVICE, OPT_SHAPES, OPT_FORMATS, OPT_REPS, OPT_COPY, OPT_JSON };
    static const struct option opts[] = {{"backend", required_argument, NULL, OPT_BACKEND},
                                         {"device", required_argument, NULL, OPT_DEVICE},
                                         {"shapes", required_argument, NULL, OPT_SHAPES},
                                         {"formats", required_argument, NULL, OPT_FORMATS},
                                         {"reps", required_argument, NULL, OPT_REPS},
                                         {"copy-size", required_argument, NULL, OPT_COPY},
                                         {"json", no_argument, NULL, OPT_JSON},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    int64_t shapes[MAX_SHAPES][2] = {{64, 8192}, {1, 4096}, {16, 2048}}, device = 0, reps = 50,
            copy_bytes = (int64_t)1 << 30;
    int n_shapes = 3, n_fmts = 2, json = 0, rc = CLI_OK;
    int fmts[MAX_FMTS] = {LLMEM_KV_FORMAT_BF16, LLMEM_KV_FORMAT_Q8};
    enum llmem_backend_kind backend = LLMEM_BACKEND_CPU;
    optind = 1;
    for (int o; rc == CLI_OK && (o = getopt_long(argc, argv, "h", opts, NULL)) != -1;) {
        switch (o) {
        case OPT_BACKEND:
            if (llmem_backend_kind_parse(optarg, &backend) != LLMEM_OK)
                rc = cli_usage_error("attn", "--backend: '%s' (cpu or cuda)", optarg);
            break;
        case OPT_DEVICE: rc = cli_parse_int("--device", optarg, 0, 1024, &device); break;
        case OPT_SHAPES: rc = parse_shapes(optarg, shapes, &n_shapes); break;
        case OPT_FORMATS:
            n_fmts = cli_parse_names("attn", "--formats", optarg, MAX_FMTS, fmts,
                                     cli_kv_format_name_parse);
            rc = n_fmts < 0 ? CLI_USAGE : CLI_OK;
            break;
        case OPT_REPS: rc = cli_parse_int("--reps", optarg, GROUPS, 100000, &reps); break;
        case OPT_COPY: rc = cli_parse_size("--copy-size", optarg, &copy_bytes); break;
        case OPT_JSON: json = 1; break;
        case 'h': fputs(attn_help, stdout); return CLI_OK;
        default: return cli_usage_error("attn", "see llmem-bench attn --help");
        }
    }
    if (rc != CLI_OK)
        return rc;
    if (backend != LLMEM_BACKEND_CUDA)
        return cli_usage_error("attn", "--backend cuda is required (the CPU's caches: "
                                       "llmem-bench kv)");
    struct llmem_mem_config mc = {.ops = llmem_backend_cuda_memory((int)device)};
    struct llmem_mem *mem = NULL;
    struct llmem_backend *be = NULL;
    struct attn_point points[MAX_SHAPES * MAX_FMTS];
    int n_points = 0;
    double copy_gbps = 0;
    rc = CLI_FAIL;
    if (mc.ops == NULL || llmem_mem_create(&mc, &mem) != LLMEM_OK ||
        llmem_backend_cuda_create((int)device, LLMEM_PRECISION_FAST, mem, &be) != LLMEM_OK) {
        fprintf(stderr, "llmem-bench attn: no CUDA device %" PRId64 " (%s)\n", device,
                mc.ops == NULL ? "none in this build or on this machine" : llmem_last_error());
        goto out;
    }
    if (bench_device_copy_bandwidth((int)device, copy_bytes, &copy_gbps) != CLI_OK)
        goto out;
    for (int f = 0; f < n_fmts; f++)
        for (int s = 0; s < n_shapes; s++) {
            struct attn_point *p = &points[n_points];
            *p = (struct attn_point){
                .format = fmts[f], .batch = shapes[s][0], .context = shapes[s][1]};
            if (measure(be, mem, p->format, p->batch, p->context, reps, &p->ms) != CLI_OK)
                goto out;
            const struct llmem_kv_config one = {
                .format = p->format, .n_layers = 1, .n_kv_heads = N_KV_HEADS, .head_dim = HEAD_DIM};
            const double bytes = (double)(p->batch * p->context * llmem_kv_token_bytes(&one));
            p->gbps = bytes / (p->ms * 1e-3) * 1e-9;
            p->fraction = p->gbps / copy_gbps;
            n_points++;
            cli_progress("bench attn", n_points, (int64_t)n_fmts * n_shapes);
        }
    cli_progress_done();
    if (json) {
        cJSON *root = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(root, "points");
        int bad = root == NULL || arr == NULL ||
                  llmem_json_add_double(root, "copy_bandwidth_gbps", copy_gbps);
        for (int i = 0; !bad && i < n_points; i++) {
            cJSON *o = cJSON_CreateObject();
            bad = o == NULL || !cJSON_AddItemToArray(arr, o) ||
                  llmem_json_add_string(o, "format", llmem_kv_format_name(points[i].format)) ||
                  llmem_json_add_int(o, "batch", points[i].batch) ||
                  llmem_json_add_int(o, "context", points[i].context) ||
                  llmem_json_add_double(o, "ms_per_call", points[i].ms) ||
                  llmem_json_add_double(o, "kv_gbps", points[i].gbps) ||
                  llmem_json_add_double(o, "fraction_of_copy_bandwidth", points[i].fraction);
        }
        if (bad) {
            cJSON_Delete(root);
            goto out;
        }
        rc = cli_print_json(root);
    } else {
        printf("llmem-bench attn: device %" PRId64 ", %d query heads, %d KV heads, head_dim %d, "
               "blocks of 16; copy bandwidth %.0f GB/s (read + written)\n",
               device, N_HEADS, N_KV_HEADS, HEAD_DIM, copy_gbps);
        printf("format  batch  context   ms/call   KV GB/s  of copy bw\n");
        for (int i = 0; i < n_points; i++)
            printf("%-6s %6" PRId64 " %8" PRId64 "  %8.4f  %8.0f  %9.0f%%\n",
                   llmem_kv_format_name(points[i].format), points[i].batch, points[i].context,
                   points[i].ms, points[i].gbps, 100 * points[i].fraction);
        rc = CLI_OK;
    }
out:
    cli_progress_done();
    llmem_backend_destroy(be);
    llmem_mem_destroy(mem);
    return rc;
}
