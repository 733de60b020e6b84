/*
 * bench/llmem-bench/matmul.c — `llmem-bench matmul`: the CPU backend's matrix products against the
 * machine's own limits, measured in the same run:
 *   bandwidth  the multithreaded streaming read (cli_bandwidth) over 512 MiB, probed right
 *              before and right after every timed decode run; each run's fraction is taken
 *              against the mean of its two probes, and the median over runs is reported;
 *   decode     y = x · Wᵀ for n = 1 (and 4) on Llama-3.2-1B shapes; each timed run cycles over
 *              enough copies of W (like the layers of a model) that the weights come from memory,
 *              not from the last-level cache; GB/s = weight bytes / time;
 *   prefill    n = 512 on the same shapes; GFLOP/s = 2 · n · rows · cols / time, for the GEMM
 *              path (at f32 precision) and, for f32 weights, OpenBLAS sgemm on the same data when
 *              llmem-bench is built with it (-DLLMEM_BENCH_OPENBLAS=ON; the library itself never
 *              uses BLAS), for bf16 weights also at fast precision (amx on AMX tiles, else
 *              dpbf16, AVX512-BF16);
 *   peak       the FMA rate of the vector unit (independent FMA chains, no memory), the bound of
 *              prefill, and the TDPBF16PS rate where bf16 weights run on AMX tiles, else the
 *              VDPBF16PS rate where the CPU has AVX512_BF16 (JSON: peak_dpbf16_gflops);
 *   dispatch   the latency of one pool run of trivial tasks (what every threaded op pays).
 * Every figure is the median of repeated runs.
 */
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef LLMEM_BENCH_OPENBLAS
#include <cblas.h>
#define BENCH_OPENBLAS 1
#else
#define BENCH_OPENBLAS 0
#endif

#include "backend/cpu/cpu_int.h"
#include "bench.h"
#include "cli/bandwidth.h"
#include "core/clock.h"
#include "cli/common.h"
#include "core/json.h"
#include "llmem/pool.h"
#include "llmem/mem.h"
#include "llmem/sys.h"
#include "llmem/dtype.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define BENCH_X86 1
#include <immintrin.h>
#else
#define BENCH_X86 0
#endif

/* ---- peak rates -------------------------------------------------------------------------------
 */

#define PEAK_ITERS 4000000

struct peak_job {
    int kind;         /* 0: f32 FMA (AVX-512 or AVX2), 1: VDPBF16PS */
    enum cpu_isa isa; /* for kind 0 */
    float sink[64];
};

#if BENCH_X86
__attribute__((target("avx512f"))) static float peak_fma512(void) {
    __m512 a[16], m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < 16; i++)
        a[i] = _mm512_set1_ps((float)i);
    for (int it = 0; it < PEAK_ITERS; it++)
        for (int i = 0; i < 16; i++)
            a[i] = _mm512_fmadd_ps(a[i], m, c);
    __m512 s = a[0];
    for (int i = 1; i < 16; i++)
        s = _mm512_add_ps(s, a[i]);
    return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) static float peak_fma256(void) {
    __m256 a[12], m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++)
        a[i] = _mm256_set1_ps((float)i);
    for (int it = 0; it < PEAK_ITERS; it++)
        for (int i = 0; i < 12; i++)
            a[i] = _mm256_fmadd_ps(a[i], m, c);
    __m256 s = a[0];
    for (int i = 1; i < 12; i++)
        s = _mm256_add_ps(s, a[i]);
    float v[8];
    _mm256_storeu_ps(v, s);
    return v[0] + v[7];
}

__attribute__((target("avx512f,avx512bf16"))) static float peak_dpbf16(void) {
    __m512 a[16];
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80),
             y = (__m512bh)_mm512_set1_epi32(0x3f003f00);
    for (int i = 0; i < 16; i++)
        a[i] = _mm512_set1_ps((float)i);
    for (int it = 0; it < PEAK_ITERS; it++)
        for (int i = 0; i < 16; i++)
            a[i] = _mm512_dpbf16_ps(a[i], x, y);
    __m512 s = a[0];
    for (int i = 1; i < 16; i++)
        s = _mm512_add_ps(s, a[i]);
    return _mm512_reduce_add_ps(s);
}

/* TDPBF16PS on four accumulator tiles from two tiles of each operand, in registers (the tile
 * configuration is the thread's; the process's permission was asked for by the ISA detection). */
__attribute__((target("amx-tile,amx-bf16"))) static float peak_amx(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _Alignas(64) static const uint16_t ones[512] = {0};
    _Alignas(64) float out[256];
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, ones, 64);
    _tile_loadd(5, ones, 64);
    _tile_loadd(6, ones, 64);
    _tile_loadd(7, ones, 64);
    for (int it = 0; it < PEAK_ITERS / 4; it++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out, 64);
    _tile_release();
    return out[0];
}
#endif

static void peak_task(void *arg, int task, int thread) {
    (void)thread;
    struct peak_job *j = arg;
#if BENCH_X86
    float r = j->kind == 2               ? peak_amx()
              : j->kind == 1             ? peak_dpbf16()
              : j->isa == CPU_ISA_AVX512 ? peak_fma512()
                                         : peak_fma256();
    j->sink[task % 64] = r;
#else
    (void)j, (void)task;
#endif
}

/* FLOP/s of `threads` threads running the loop at once (one task each). Per iteration 16 zmm
 * FMAs (32 FLOP each), 12 ymm FMAs (16 each), 16 VDPBF16PS (64 each) or, for AMX, a quarter of
 * its iterations, one TDPBF16PS (16 · 16 · 32 · 2). */
static double peak_gflops(struct llmem_pool *pool, int kind, enum cpu_isa isa) {
    struct peak_job j = {.kind = kind, .isa = isa};
    int threads = llmem_pool_threads(pool);
    double t0 = llmem_clock_s();
    llmem_pool_run(pool, threads, peak_task, &j);
    double t = llmem_clock_s() - t0;
    double per_iter = kind == 2               ? 16.0 * 16 * 32 * 2 /* a TDPBF16PS a 4th */
                      : kind == 1             ? 16.0 * 64
                      : isa == CPU_ISA_AVX512 ? 16.0 * 32
                                              : 12.0 * 16;
    return (double)PEAK_ITERS * per_iter * threads / t * 1e-9;
}

static void noop_task(void *arg, int task, int thread) {
    (void)arg, (void)task, (void)thread;
}

/* Microseconds per pool run of `threads` trivial tasks (median of 5 × 2000). */
static double dispatch_us(struct llmem_pool *pool) {
    double v[5];
    int threads = llmem_pool_threads(pool);
    for (int r = 0; r < 5; r++) {
        double t0 = llmem_clock_s();
        for (int i = 0; i < 2000; i++)
            llmem_pool_run(pool, threads, noop_task, NULL);
        v[r] = (llmem_clock_s() - t0) / 2000 * 1e6;
    }
    return bench_median(v, 5);
}

/* ---- OpenBLAS, the comparison ----------------------------------------------------------------
 */

#if BENCH_OPENBLAS
/* y[n, rows] = x[n, cols] · Wᵀ for f32 W by one sgemm, on as many OpenBLAS threads as the pool
 * has, set at the first call: an OpenBLAS sized for threads it has not run yet still has them
 * poll for work (sched_yield) beside the pool's during the decode runs on a small machine. */
static void blas_matmul(const struct llmem_weight *w, const float *x, int64_t n, float *y,
                        int n_threads) {
    static int sized;
    if (!sized) {
        openblas_set_num_threads(n_threads);
        sized = 1;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)n, (blasint)w->rows,
                (blasint)w->cols, 1.0f, x, (blasint)w->cols, (const float *)w->data,
                (blasint)w->cols, 0.0f, y, (blasint)w->rows);
}
#endif

/* ---- data -------------------------------------------------------------------------------------
 */

/* Random weights of dtype (values in [-1, 1), like a checkpoint's). */
static void fill_weights(void *data, enum llmem_dtype dt, int64_t count, uint64_t seed) {
    uint64_t s = seed | 1;
    for (int64_t i = 0; i < count; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        float f = (float)((double)(s >> 40) * 0x1p-23 - 1.0);
        uint32_t u;
        memcpy(&u, &f, 4);
        if (dt == LLMEM_DTYPE_F32)
            ((float *)data)[i] = f;
        else if (dt == LLMEM_DTYPE_BF16)
            ((uint16_t *)data)[i] = (uint16_t)(u >> 16);
        else /* f16 of |f| < 1: exponent field 14 or below, mantissa from f */
            ((uint16_t *)data)[i] = (uint16_t)((u >> 16 & 0x8000) | (uint16_t)(s >> 8 & 0x3bff));
    }
}

static void fill_floats(float *v, int64_t count) {
    uint64_t s = 0x1234567;
    for (int64_t i = 0; i < count; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        v[i] = (float)((double)(s >> 40) * 0x1p-23 - 1.0);
    }
}

/* ---- the command ------------------------------------------------------------------------------
 */

static const char matmul_usage[] =
    "usage: llmem-bench matmul [--threads N] [--quick] [--reps N] [--json]\n"
    "\n"
    "The CPU backend's matmul on Llama-3.2-1B shapes (2048x2048, 8192x2048, 2048x8192, and the\n"
    "4096x2048 head-like one for decode), bf16/f16/f32 weights: decode (n = 1, 4) in GB/s and as "
    "a\n"
    "fraction of the streaming read bandwidth probed before and after in the same run; prefill\n"
    "(n = 512) in GFLOP/s, against the measured FMA peak (f32 also through OpenBLAS when built\n"
    "with -DLLMEM_BENCH_OPENBLAS=ON; bf16 also at fast precision, path amx against the\n"
    "TDPBF16PS peak where the CPU has AMX, else dpbf16 against the VDPBF16PS peak where it\n"
    "has AVX512-BF16); the pool's dispatch latency. Medians\n"
    "of N runs (default 5, quick 3). --threads N (default: the online CPUs); --quick streams\n"
    "less memory and skips n = 4; --json prints one object.\n";

static const int64_t shapes[][2] = {{2048, 2048}, {8192, 2048}, {2048, 8192}, {4096, 2048}};
enum { N_SHAPES = 4, N_PREFILL_SHAPES = 3, PREFILL_N = 512 };
static const enum llmem_dtype bench_dtypes[3] = {LLMEM_DTYPE_BF16, LLMEM_DTYPE_F16,
                                                 LLMEM_DTYPE_F32};

struct decode_result {
    int64_t rows, cols, n;
    enum llmem_dtype dtype;
    double gbps, fraction;
};

struct prefill_result {
    int64_t rows, cols;
    enum llmem_dtype dtype;
    const char *path;
    double gflops, fraction_of_peak;
};

static int64_t progress_done, progress_total;

static void tick(void *arg) {
    (void)arg;
    cli_progress("bench matmul", ++progress_done, progress_total);
}

int bench_matmul(int argc, char **argv) {
    static const struct option options[] = {
        {"threads", required_argument, NULL, 't'}, {"quick", no_argument, NULL, 'q'},
        {"reps", required_argument, NULL, 'r'},    {"json", no_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},          {NULL, 0, NULL, 0},
    };
    int quick = 0, json = 0, c;
    int64_t threads = 0, reps = 0;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", options, NULL)) != -1) {
        switch (c) {
        case 't':
            if (cli_parse_int("--threads", optarg, 1, 1024, &threads) != CLI_OK)
                return CLI_USAGE;
            break;
        case 'q': quick = 1; break;
        case 'j': json = 1; break;
        case 'r':
            if (cli_parse_int("--reps", optarg, 1, 1000, &reps) != CLI_OK)
                return CLI_USAGE;
            break;
        case 'h': fputs(matmul_usage, stdout); return CLI_OK;
        case ':': return cli_usage_error("matmul", "%s needs a value", argv[optind - 1]);
        default:
            return cli_usage_error("matmul", "unknown option '%s' (see --help)", argv[optind - 1]);
        }
    }
    if (reps == 0)
        reps = quick ? 3 : 5;
    const int64_t stream_bytes = (quick ? (int64_t)160 : 400) << 20; /* per decode run */
    /* Far beyond any last-level cache: the probe must not read from cache. */
    const int64_t bw_bytes = (int64_t)512 << 20;
    const int n_decode_n = quick ? 1 : 2;
    const int64_t decode_ns[2] = {1, 4};

    struct llmem_backend *be = NULL;
    struct llmem_pool *pool = NULL;
    struct llmem_mem *mem = NULL;
    struct llmem_mem_config mcfg = {.cache_limit_bytes = (int64_t)1
                                                         << 30}; /* keeps the probe buffer */
    uint8_t *wbuf = NULL;
    float *x = NULL, *y = NULL, *times = NULL;
    double *tv = NULL;
    double copy_gbps[1], *probe_read = NULL, *probe_copy = NULL, *frac = NULL;
    struct decode_result dres[3 * N_SHAPES * 2];
    struct prefill_result pres[3 * N_PREFILL_SHAPES * 2];
    int n_dres = 0, n_pres = 0, rc = CLI_FAIL;
    (void)times;

    if (llmem_backend_cpu_create((int)threads, &be) != LLMEM_OK ||
        llmem_pool_create((int)threads, &pool) != LLMEM_OK ||
        llmem_mem_create(&mcfg, &mem) != LLMEM_OK) {
        fprintf(stderr, "llmem-bench matmul: cannot set up the backend (%s)\n", llmem_last_error());
        goto out;
    }
    int n_threads = be->ops->threads(be->ctx);
    enum cpu_isa isa = llmem_cpu_isa_best();
    int has_bf16 = (llmem_sys_isa_features() & LLMEM_ISA_AVX512_BF16) != 0;
    /* bf16 weights at fast precision run on the AMX tiles where the CPU has them */
    int has_amx = has_bf16 && strcmp(llmem_backend_cpu_bf16_kernels(), "amx_bf16") == 0;
    size_t wbuf_bytes = (size_t)stream_bytes + ((size_t)64 << 20);
    wbuf = malloc(wbuf_bytes);
    x = malloc((size_t)PREFILL_N * 8192 * sizeof(float));
    y = malloc((size_t)PREFILL_N * 8192 * sizeof(float));
    tv = malloc((size_t)reps * sizeof(double));
    frac = malloc((size_t)reps * sizeof(double));
    size_t max_probes = 1 + (size_t)(3 * N_SHAPES * n_decode_n) * (size_t)reps;
    probe_read = malloc(max_probes * sizeof(double));
    probe_copy = malloc(max_probes * sizeof(double));
    if (wbuf == NULL || x == NULL || y == NULL || tv == NULL || frac == NULL ||
        probe_read == NULL || probe_copy == NULL) {
        fprintf(stderr, "llmem-bench matmul: out of memory\n");
        goto out;
    }
    fill_floats(x, (int64_t)PREFILL_N * 8192);
    progress_total = 3 * N_SHAPES * n_decode_n + 3 * N_PREFILL_SHAPES + 1 +
                     (BENCH_OPENBLAS ? N_PREFILL_SHAPES : 0);

    /* Peaks and dispatch first, on a quiet pool. */
    double peak = 0, peak256 = 0, peak_dp = 0, disp = 0;
    if (isa != CPU_ISA_SCALAR) {
        for (int i = 0; i < 3; i++) { /* the best of three: the rate the core can reach */
            double p = peak_gflops(pool, 0, isa), p256 = peak_gflops(pool, 0, CPU_ISA_AVX2);
            peak = p > peak ? p : peak;
            peak256 = p256 > peak256 ? p256 : peak256;
        }
        if (has_bf16)
            peak_dp = peak_gflops(pool, has_amx ? 2 : 1, isa);
    }
    disp = dispatch_us(pool);
    tick(NULL);

    /* ---- decode, every timed run between two bandwidth probes ---- */
    /* The machine may be shared: a probe before and after each timed run, and the fraction of
     * each run against the mean of its two probes, so that load that comes and goes hits both
     * sides of the ratio alike. */
    int n_probe = 0;
    double prev_read;
    if (cli_bandwidth(mem, pool, bw_bytes, 1, &prev_read, &copy_gbps[0], NULL, NULL) != CLI_OK)
        goto out;
    probe_read[n_probe] = prev_read;
    probe_copy[n_probe++] = copy_gbps[0];
    for (int d = 0; d < 3; d++) {
        for (int s = 0; s < N_SHAPES; s++) {
            int64_t rows = shapes[s][0], cols = shapes[s][1];
            size_t wbytes = (size_t)(rows * cols * llmem_dtype_size(bench_dtypes[d]));
            int copies = (int)(((size_t)stream_bytes + wbytes - 1) / wbytes);
            if ((size_t)copies * wbytes > wbuf_bytes)
                copies = (int)(wbuf_bytes / wbytes);
            fill_weights(wbuf, bench_dtypes[d], rows * cols * copies, 0xabc + (uint64_t)s);
            for (int ni = 0; ni < n_decode_n; ni++) {
                int64_t n = decode_ns[ni];
                for (int64_t r = -1; r < reps; r++) {
                    /* An untimed pass first: the probe's copy leaves the caches full of dirty
                     * lines, whose write-back would otherwise be charged to the decode. */
                    double t0 = 0;
                    for (int pass = 0; pass < 2; pass++) {
                        t0 = llmem_clock_s();
                        for (int k = 0; k < copies; k++) {
                            struct llmem_weight w = {wbuf + (size_t)k * wbytes,
                                                     bench_dtypes[d],
                                                     rows,
                                                     cols,
                                                     0,
                                                     NULL,
                                                     NULL,
                                                     0};
                            be->ops->matmul(be->ctx, &w, x, n, y, NULL);
                        }
                    }
                    double t = llmem_clock_s() - t0, rd, cp;
                    if (cli_bandwidth(mem, pool, bw_bytes, 1, &rd, &cp, NULL, NULL) != CLI_OK)
                        goto out;
                    if (r >= 0) {
                        tv[r] = t / copies;
                        frac[r] = (double)wbytes / tv[r] * 1e-9 / (0.5 * (prev_read + rd));
                        probe_read[n_probe] = rd;
                        probe_copy[n_probe++] = cp;
                    }
                    prev_read = rd;
                }
                double t = bench_median(tv, (int)reps);
                dres[n_dres++] = (struct decode_result){rows,
                                                        cols,
                                                        n,
                                                        bench_dtypes[d],
                                                        (double)wbytes / t * 1e-9,
                                                        bench_median(frac, (int)reps)};
                tick(NULL);
            }
        }
    }
    double bw_read = bench_median(probe_read, n_probe);
    double bw_copy = bench_median(probe_copy, n_probe);

    /* ---- prefill ---- */
    for (int d = 0; d < 3; d++) {
        for (int s = 0; s < N_PREFILL_SHAPES; s++) {
            int64_t rows = shapes[s][0], cols = shapes[s][1];
            fill_weights(wbuf, bench_dtypes[d], rows * cols, 0xdef + (uint64_t)s);
            struct llmem_weight w = {wbuf, bench_dtypes[d], rows, cols, 0, NULL, NULL, 0};
            /* f32 weights also through OpenBLAS; bf16 also at fast precision (AVX512-BF16) */
            int fast = bench_dtypes[d] == LLMEM_DTYPE_BF16 && llmem_cpu_bf16_fast(be->ctx);
            int n_paths = (BENCH_OPENBLAS && bench_dtypes[d] == LLMEM_DTYPE_F32) || fast ? 2 : 1;
            llmem_backend_cpu_set_matmul_path(be, CPU_MATMUL_GEMM);
            for (int p = 0; p < n_paths; p++) {
                llmem_backend_cpu_set_precision(be, fast && p == 0 ? LLMEM_PRECISION_F32
                                                                   : LLMEM_PRECISION_FAST);
                for (int64_t r = -1; r < reps; r++) {
                    double t0 = llmem_clock_s();
#if BENCH_OPENBLAS
                    if (p == 1)
                        blas_matmul(&w, x, PREFILL_N, y, n_threads);
                    else
#endif
                        be->ops->matmul(be->ctx, &w, x, PREFILL_N, y, NULL);
                    if (r >= 0)
                        tv[r] = llmem_clock_s() - t0;
                }
                double gf = 2.0 * PREFILL_N * (double)rows * (double)cols /
                            bench_median(tv, (int)reps) * 1e-9;
                double of = fast && p == 1 ? peak_dp : peak;
                pres[n_pres++] = (struct prefill_result){rows,
                                                         cols,
                                                         bench_dtypes[d],
                                                         p == 0 ? "gemm"
                                                         : fast ? (has_amx ? "amx" : "dpbf16")
                                                                : "openblas",
                                                         gf,
                                                         of > 0 ? gf / of : 0};
                tick(NULL);
            }
        }
    }
    llmem_backend_cpu_set_matmul_path(be, CPU_MATMUL_AUTO);
    cli_progress_done();
    static const char no_blas_note[] =
        "f32 through OpenBLAS: not built (configure with -DLLMEM_BENCH_OPENBLAS=ON)";
    if (!BENCH_OPENBLAS && json)
        fprintf(stderr, "llmem-bench matmul: %s\n", no_blas_note);

    struct llmem_device_info host;
    llmem_sys_probe_host(&host);
    if (json) {
        cJSON *root = cJSON_CreateObject();
        int st = root == NULL;
        cJSON *machine = st ? NULL : cJSON_AddObjectToObject(root, "machine");
        st |= machine == NULL || llmem_json_add_string(machine, "cpu", host.name) ||
              llmem_json_add_int(machine, "n_cpus", host.n_cpus) ||
              llmem_json_add_string(machine, "isa", llmem_cpu_isa_name(isa)) ||
              llmem_json_add_int(root, "threads", n_threads) ||
              llmem_json_add_int(root, "reps", reps) ||
              llmem_json_add_double(root, "read_gbps", bw_read) ||
              llmem_json_add_double(root, "copy_gbps", bw_copy) ||
              llmem_json_add_double(root, "peak_fma_gflops", peak) ||
              llmem_json_add_double(root, "peak_fma256_gflops", peak256) ||
#if BENCH_OPENBLAS
              llmem_json_add_string(root, "openblas_core", openblas_get_corename()) ||
#else
              cJSON_AddNullToObject(root, "openblas_core") == NULL ||
#endif
              llmem_json_add_double(root, "peak_dpbf16_gflops", peak_dp) ||
              llmem_json_add_double(root, "pool_dispatch_us", disp);
        cJSON *dl = st ? NULL : cJSON_AddArrayToObject(root, "decode");
        st |= dl == NULL;
        for (int i = 0; i < n_dres && !st; i++) {
            cJSON *o = cJSON_CreateObject();
            st |= o == NULL || !cJSON_AddItemToArray(dl, o);
            st |= st || llmem_json_add_string(o, "dtype", llmem_dtype_name(dres[i].dtype)) ||
                  llmem_json_add_int(o, "rows", dres[i].rows) ||
                  llmem_json_add_int(o, "cols", dres[i].cols) ||
                  llmem_json_add_int(o, "n", dres[i].n) ||
                  llmem_json_add_double(o, "gbps", dres[i].gbps) ||
                  llmem_json_add_double(o, "fraction_of_read", dres[i].fraction);
        }
        cJSON *pl = st ? NULL : cJSON_AddArrayToObject(root, "prefill");
        st |= pl == NULL;
        for (int i = 0; i < n_pres && !st; i++) {
            cJSON *o = cJSON_CreateObject();
            st |= o == NULL || !cJSON_AddItemToArray(pl, o);
            st |= st || llmem_json_add_string(o, "dtype", llmem_dtype_name(pres[i].dtype)) ||
                  llmem_json_add_int(o, "rows", pres[i].rows) ||
                  llmem_json_add_int(o, "cols", pres[i].cols) ||
                  llmem_json_add_int(o, "n", PREFILL_N) ||
                  llmem_json_add_string(o, "path", pres[i].path) ||
                  llmem_json_add_double(o, "gflops", pres[i].gflops) ||
                  llmem_json_add_double(o, "fraction_of_peak", pres[i].fraction_of_peak);
        }
        if (st) {
            cJSON_Delete(root);
            fprintf(stderr, "llmem-bench matmul: out of memory building the JSON output\n");
            goto out;
        }
        rc = cli_print_json(root);
    } else {
        printf("llmem-bench matmul: %s, %d CPUs, %d threads, %s kernels; medians of %lld runs\n\n",
               host.name, host.n_cpus, n_threads, llmem_cpu_isa_name(isa), (long long)reps);
        printf("read bandwidth %.1f GB/s, copy %.1f GB/s (medians of the probes around every"
               " decode run)\n",
               bw_read, bw_copy);
        printf("peak f32 FMA %.1f GFLOP/s (256-bit: %.1f)", peak, peak256);
        if (has_bf16)
            printf(", %s %.1f GFLOP/s", has_amx ? "TDPBF16PS (AMX)" : "VDPBF16PS", peak_dp);
#if BENCH_OPENBLAS
        printf("; pool dispatch %.2f us; OpenBLAS core %s\n\n", disp, openblas_get_corename());
#else
        printf("; pool dispatch %.2f us\n\n", disp);
#endif
        printf("decode (GB/s of weights; median fraction of the read bandwidth probed around each "
               "run)\n");
        printf("%-6s %-11s %3s %9s %9s\n", "dtype", "shape", "n", "GB/s", "of read");
        for (int i = 0; i < n_dres; i++) {
            char shape[32];
            snprintf(shape, sizeof(shape), "%lldx%lld", (long long)dres[i].rows,
                     (long long)dres[i].cols);
            printf("%-6s %-11s %3lld %9.1f %8.0f%%\n", llmem_dtype_name(dres[i].dtype), shape,
                   (long long)dres[i].n, dres[i].gbps, 100 * dres[i].fraction);
        }
        printf("\nprefill, n = %d (GFLOP/s; fraction of the FMA peak, for bf16 weights at fast "
               "precision of %s's)\n",
               PREFILL_N, has_amx ? "TDPBF16PS" : "VDPBF16PS");
        printf("%-6s %-11s %-9s %9s %8s\n", "dtype", "shape", "path", "GFLOP/s", "of peak");
        for (int i = 0; i < n_pres; i++) {
            char shape[32];
            snprintf(shape, sizeof(shape), "%lldx%lld", (long long)pres[i].rows,
                     (long long)pres[i].cols);
            printf("%-6s %-11s %-9s %9.1f %7.0f%%\n", llmem_dtype_name(pres[i].dtype), shape,
                   pres[i].path, pres[i].gflops, 100 * pres[i].fraction_of_peak);
        }
        if (!BENCH_OPENBLAS)
            printf("\n%s\n", no_blas_note);
        rc = CLI_OK;
    }
out:
    free(tv);
    free(frac);
    free(probe_read);
    free(probe_copy);
    free(x);
    free(y);
    free(wbuf);
    llmem_mem_destroy(mem);
    llmem_pool_destroy(pool);
    llmem_backend_destroy(be);
    return rc;
}
