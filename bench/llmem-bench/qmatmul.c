/*
 * bench/llmem-bench/qmatmul.c — `llmem-bench qmatmul`: a backend's matmul with quantized weights
 * (and bf16 beside them) on the matrices of an 8B Llama layer (q and o 4096 × 4096, k and v
 * 1024 × 4096, gate and up 14336 × 4096, down 4096 × 14336), for decode's few rows of x and
 * prefill's many: µs a call (the median of --reps timed batches of calls), the weights' GB/s
 * (what decode is bound by) and TFLOP/s (what prefill is bound by).
 */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/ops.h"
#include "bench.h"
#include "cli/common.h"
#include "core/clock.h"
#include "llmem/backend.h"
#include "llmem/mem.h"
#include "llmem/status.h"
#include "quant/quant.h"

static const char qmatmul_usage[] =
    "usage: llmem-bench qmatmul [options]\n"
    "\n"
    "A backend's matmul with quantized weights (and bf16 beside them) on the matrices of an 8B\n"
    "Llama layer: µs a call, the weights' GB/s and TFLOP/s, medians of --reps batches of calls.\n"
    "  --backend B    cuda (default) or cpu\n"
    "  --precision P  fast (default) or f32\n"
    "  --types LIST   weight types (default q4_K,q6_K,q8_0,bf16)\n"
    "  --rows LIST    rows of x (default 1,4,32,512)\n"
    "  --reps N       timed batches of 10 calls (default 5)\n";

static const int64_t shapes[][2] = {{4096, 4096}, {1024, 4096}, {14336, 4096}, {4096, 14336}};
static const char *shape_names[] = {"q, o", "k, v", "gate, up", "down"};
#define N_SHAPES 4

static uint64_t rng = 0x2545f4914f6cdd1dull;
static float frand(void) { /* uniform in [-1, 1) */
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* Type names as llmem_qtype_name gives them ("q4_K"), or "bf16". */
static int type_of(const char *name) {
    for (int t = 0; t < LLMEM_QTYPE_COUNT; t++) {
        const struct llmem_qtype_info *i = llmem_qtype_info(t);
        if (i != NULL && i->readable && strcmp(i->name, name) == 0)
            return t;
    }
    return -1;
}

/* A host matrix of random values as type t: its bytes in *bytes; NULL when out of memory. */
static void *random_matrix(int t, int64_t rows, int64_t cols, size_t *bytes) {
    const int64_t row_bytes = llmem_qtype_bytes(t, cols);
    *bytes = (size_t)(rows * row_bytes);
    uint8_t *w = malloc(*bytes);
    float *v = malloc((size_t)cols * sizeof(float));
    if (w != NULL && v != NULL)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t i = 0; i < cols; i++)
                v[i] = frand() * 0.05f;
            if (llmem_quant_quantize_row(t, v, w + r * row_bytes, cols) != LLMEM_OK) {
                free(w);
                w = NULL;
                break;
            }
        }
    free(v);
    return w;
}

static int parse_list(const char *s, int64_t *out, int max) {
    int n = 0;
    for (const char *p = s; *p != '\0' && n < max;) {
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p || v <= 0)
            return -1;
        out[n++] = v;
        p = *end == ',' ? end + 1 : end;
    }
    return n;
}

int bench_qmatmul(int argc, char **argv) {
    static const struct option opts[] = {{"backend", required_argument, NULL, 'b'},
                                         {"precision", required_argument, NULL, 'p'},
                                         {"types", required_argument, NULL, 't'},
                                         {"rows", required_argument, NULL, 'n'},
                                         {"reps", required_argument, NULL, 'r'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    int cuda = 1, reps = 5, n_ns = 4, n_types = 0;
    enum llmem_backend_precision precision = LLMEM_PRECISION_FAST;
    int64_t ns[8] = {1, 4, 32, 512};
    int types[8];
    char type_list[128] = "q4_K,q6_K,q8_0,bf16";
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
        switch (c) {
        case 'b':
            if (strcmp(optarg, "cuda") != 0 && strcmp(optarg, "cpu") != 0)
                return cli_usage_error("qmatmul", "--backend is cuda or cpu, not '%s'", optarg);
            cuda = strcmp(optarg, "cuda") == 0;
            break;
        case 'p':
            if (strcmp(optarg, "fast") != 0 && strcmp(optarg, "f32") != 0)
                return cli_usage_error("qmatmul", "--precision is fast or f32, not '%s'", optarg);
            precision = strcmp(optarg, "f32") == 0 ? LLMEM_PRECISION_F32 : LLMEM_PRECISION_FAST;
            break;
        case 't': snprintf(type_list, sizeof(type_list), "%s", optarg); break;
        case 'n':
            if ((n_ns = parse_list(optarg, ns, 8)) <= 0)
                return cli_usage_error("qmatmul", "--rows takes counts such as 1,4,32");
            break;
        case 'r':
            if ((reps = atoi(optarg)) <= 0)
                return cli_usage_error("qmatmul", "--reps takes a positive count");
            break;
        case 'h': fputs(qmatmul_usage, stdout); return CLI_OK;
        case ':': return cli_usage_error("qmatmul", "%s needs a value", argv[optind - 1]);
        default:
            return cli_usage_error("qmatmul", "unknown option '%s' (see --help)", argv[optind - 1]);
        }
    }
    for (char *save = NULL, *tok = strtok_r(type_list, ",", &save); tok != NULL && n_types < 8;
         tok = strtok_r(NULL, ",", &save))
        if ((types[n_types++] = type_of(tok)) < 0)
            return cli_usage_error("qmatmul", "unknown weight type '%s'", tok);

    struct llmem_mem_config mc = {.ops = cuda ? llmem_backend_cuda_memory(0) : NULL,
                                  .cache_limit_bytes = -1};
    struct llmem_mem *mem = NULL;
    struct llmem_backend *be = NULL;
    int status = llmem_mem_create(&mc, &mem);
    if (status == LLMEM_OK)
        status = cuda ? llmem_backend_cuda_create(0, precision, mem, &be)
                      : llmem_backend_cpu_create(0, &be);
    if (status != LLMEM_OK) {
        fprintf(stderr, "llmem-bench qmatmul: cannot set up the %s backend (%s)\n",
                cuda ? "cuda" : "cpu", llmem_last_error());
        llmem_mem_destroy(mem);
        return CLI_FAIL;
    }
    if (!cuda)
        llmem_backend_cpu_set_precision(be, precision);
    int64_t max_n = 0;
    for (int i = 0; i < n_ns; i++)
        max_n = ns[i] > max_n ? ns[i] : max_n;
    const size_t xy_bytes = (size_t)max_n * 14336 * sizeof(float);
    float *xh = malloc(xy_bytes);
    void *x = llmem_mem_alloc(mem, xy_bytes, LLMEM_TAG_SCRATCH);
    void *y = llmem_mem_alloc(mem, xy_bytes, LLMEM_TAG_SCRATCH);
    int rc = CLI_FAIL;
    if (xh == NULL || x == NULL || y == NULL)
        goto out;
    for (size_t i = 0; i < xy_bytes / sizeof(float); i++)
        xh[i] = frand();
    if (be->ops->copy(be->ctx, x, xh, xy_bytes) != LLMEM_OK)
        goto out;
    printf("llmem-bench qmatmul: %s backend, %s precision; µs a call, GB/s of weights, TFLOP/s\n",
           cuda ? "cuda" : "cpu", llmem_backend_precision_name(precision));
    printf("%-6s %-9s %13s %10s", "type", "matrix", "rows x cols", "MB");
    for (int i = 0; i < n_ns; i++)
        printf("   n=%-4lld µs   GB/s TFLOP/s", (long long)ns[i]);
    printf("\n");
    for (int t = 0; t < n_types; t++)
        for (int s = 0; s < N_SHAPES; s++) {
            const int64_t rows = shapes[s][0], cols = shapes[s][1];
            size_t bytes;
            void *wh = random_matrix(types[t], rows, cols, &bytes);
            void *wd = wh != NULL ? llmem_mem_alloc(mem, bytes, LLMEM_TAG_SCRATCH) : NULL;
            if (wd == NULL || be->ops->copy(be->ctx, wd, wh, bytes) != LLMEM_OK) {
                fprintf(stderr, "llmem-bench qmatmul: out of memory\n");
                free(wh);
                goto out;
            }
            free(wh);
            struct llmem_weight w = {
                .data = wd, .dtype = LLMEM_DTYPE_F32, .rows = rows, .cols = cols};
            if (types[t] == LLMEM_QTYPE_BF16)
                w.dtype = LLMEM_DTYPE_BF16;
            else if (types[t] == LLMEM_QTYPE_F16)
                w.dtype = LLMEM_DTYPE_F16;
            else if (types[t] != LLMEM_QTYPE_F32)
                w.quant = types[t];
            printf("%-6s %-9s %6lld x %-5lld %10.1f", llmem_qtype_name(types[t]), shape_names[s],
                   (long long)rows, (long long)cols, (double)bytes / 1e6);
            for (int i = 0; i < n_ns; i++) {
                double v[64];
                for (int k = 0; k < 3; k++) /* warm-up: plans, scratch */
                    be->ops->matmul(be->ctx, &w, x, ns[i], y, NULL);
                be->ops->sync(be->ctx);
                for (int r = 0; r < reps && r < 64; r++) {
                    const double t0 = llmem_clock_s();
                    for (int k = 0; k < 10; k++)
                        be->ops->matmul(be->ctx, &w, x, ns[i], y, NULL);
                    be->ops->sync(be->ctx);
                    v[r] = (llmem_clock_s() - t0) / 10;
                }
                const double sec = bench_median(v, reps < 64 ? reps : 64);
                printf("   %9.1f %6.0f %7.1f", sec * 1e6, (double)bytes / sec / 1e9,
                       2.0 * (double)rows * (double)cols * (double)ns[i] / sec / 1e12);
                fflush(stdout);
            }
            printf("\n");
            llmem_mem_free(mem, wd);
        }
    rc = CLI_OK;
out:
    free(xh);
    llmem_mem_free(mem, x);
    llmem_mem_free(mem, y);
    llmem_backend_destroy(be);
    llmem_mem_destroy(mem);
    return rc;
}
