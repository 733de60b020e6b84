/*
 * tests/test-cpuops.c — every operation of the CPU backend against a float64 reference on seeded
 * random data: weight dtypes bf16/f16/f32, odd shapes, n = 1…300, 1–3 threads, every ISA the
 * machine has, both matmul paths (which must also agree with each other), bias on and off.
 * matmul is batch invariant: a row of x gives the same bits alone or in any batch, on any path,
 * thread count and ISA (one canonical summation order).
 *
 * Tolerances, stated against the float64 result of the same (exactly representable) inputs:
 *   matmul      |y − ref| ≤ 1e-6 · Σ_k |x_k · w_k| + 1e-6 · |bias|   (f32 accumulation)
 *   rmsnorm     |y − ref| ≤ 1e-6 · |ref| + 1e-30
 *   rope        |y − ref| ≤ 1e-6 · (|x_i| + |x_{i+h}|)   (ref: double rotation by the f32 cos/sin
 *               of the f32 angle, as the contract says)
 *   swiglu      |y − ref| ≤ 1e-6 · |ref| + 1e-30
 *   embedding, add: exact.
 *   quantized weights at fast precision (test_matmul_fast): |y − ref| within the rounding of the
 *               activations to 8 bits per block (the bound is derived there; worst seen 0.14 of
 *               it), and the same bits on every ISA, thread count and n.
 *   bf16 weights at fast precision on a CPU with AVX512-BF16: the matmul bound against the
 *               float64 product of the weights and x rounded to bf16 (to nearest even), so within
 *               2⁻⁹ · Σ|x·w| of the exact product; batch invariant within the precision.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <time.h>

#include "backend/cpu/cpu_int.h"
#include "backend/ops.h"
#include "llmem/dtype.h"
#include "llmem/sys.h"
#include "quant/quant.h"
#include "testutil.h"

/* ---- data -------------------------------------------------------------------------------------
 */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng(void) {
    uint64_t x = rng_state;
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return rng_state = x;
}

/* Uniform in [-1, 1). */
static float frand(void) {
    return (float)((double)(rng() >> 11) * 0x1p-53 * 2.0 - 1.0);
}

/* A random weight matrix in dtype, and its values as double (decoded independently). */
static void *make_weight(enum llmem_dtype dt, int64_t count, double *val) {
    void *data = malloc((size_t)(count > 0 ? count : 1) * 4);
    assert_non_null(data);
    for (int64_t i = 0; i < count; i++) {
        uint64_t r = rng();
        if (dt == LLMEM_DTYPE_F32) {
            float f = frand();
            ((float *)data)[i] = f;
            val[i] = f;
        } else if (dt == LLMEM_DTYPE_BF16) {
            float f = frand();
            uint32_t u;
            memcpy(&u, &f, 4);
            uint16_t b = (uint16_t)(u >> 16);
            ((uint16_t *)data)[i] = b;
            u = (uint32_t)b << 16;
            memcpy(&f, &u, 4);
            val[i] = f;
        } else { /* f16: sign, exponent field 1..16 (normals up to 2), random mantissa, or a
                    subnormal now and then */
            uint16_t sign = (uint16_t)(r & 1), mant = (uint16_t)((r >> 1) & 0x3ff);
            uint16_t exp = (uint16_t)((r >> 11) % 17);
            ((uint16_t *)data)[i] = (uint16_t)(sign << 15 | exp << 10 | mant);
            double m = exp == 0 ? mant / 1024.0 : 1.0 + mant / 1024.0;
            val[i] = (sign ? -1 : 1) * ldexp(m, (exp == 0 ? 1 : exp) - 15);
        }
    }
    return data;
}

static float *make_floats(int64_t count) {
    float *v = malloc((size_t)(count > 0 ? count : 1) * sizeof(float));
    assert_non_null(v);
    for (int64_t i = 0; i < count; i++)
        v[i] = frand();
    return v;
}

static struct llmem_backend *make_backend(int threads) {
    struct llmem_backend *b = NULL;
    assert_int_equal(llmem_backend_cpu_create(threads, &b), LLMEM_OK);
    assert_non_null(b);
    assert_string_equal(b->ops->name, "cpu");
    assert_int_equal(b->ops->threads(b->ctx), threads);
    return b;
}

/* ---- matmul -----------------------------------------------------------------------------------
 */

/* x rounded to bf16 to nearest even, as VCVTNE2PS2BF16 rounds it (the test data hold no NaN or
 * subnormals). */
static double bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    float r;
    memcpy(&r, &u, 4);
    return r;
}

/* Whether a matmul of w on b rounds the activations to bf16 (fast precision, AVX512-BF16). */
static int rounds_x(struct llmem_backend *b, const struct llmem_weight *w) {
    return w->quant == 0 && w->dtype == LLMEM_DTYPE_BF16 && llmem_cpu_bf16_fast(b->ctx);
}

static double worst_ratio; /* the largest |err| / bound seen, printed at the end */

/* Runs one matmul on the given path and checks it; returns y (malloc'ed). */
static float *check_matmul(struct llmem_backend *b, enum cpu_matmul_path path,
                           const struct llmem_weight *w, const double *wv, const float *x,
                           int64_t n, const float *bias) {
    const int64_t rows = w->rows, cols = w->cols;
    float *y = malloc((size_t)(n * rows > 0 ? n * rows : 1) * sizeof(float));
    assert_non_null(y);
    for (int64_t i = 0; i < n * rows; i++)
        y[i] = NAN;
    llmem_backend_cpu_set_matmul_path(b, path);
    b->ops->matmul(b->ctx, w, x, n, y, bias);
    const int round = rounds_x(b, w);
    for (int64_t t = 0; t < n; t++)
        for (int64_t r = 0; r < rows; r++) {
            double ref = bias != NULL ? bias[r] : 0.0, mag = 0.0;
            for (int64_t k = 0; k < cols; k++) {
                double xv = round ? bf16_round(x[t * cols + k]) : (double)x[t * cols + k];
                double p = xv * wv[r * cols + k];
                ref += p;
                mag += fabs(p);
            }
            double bound = 1e-6 * mag + 1e-6 * (bias != NULL ? fabs(bias[r]) : 0.0) + 1e-30;
            double err = fabs((double)y[t * rows + r] - ref);
            if (err / bound > worst_ratio)
                worst_ratio = err / bound;
            if (!(err <= bound)) {
                fprintf(stderr,
                        "matmul %s %lldx%lld n=%lld path=%d y[%lld,%lld]=%.9g ref=%.9g bound=%g\n",
                        llmem_dtype_name(w->dtype), (long long)rows, (long long)cols, (long long)n,
                        (int)path, (long long)t, (long long)r, (double)y[t * rows + r], ref, bound);
                fail();
            }
        }
    return y;
}

static void matmul_case(struct llmem_backend *b, enum llmem_dtype dt, int64_t rows, int64_t cols,
                        int64_t n, int with_bias) {
    double *wv = malloc((size_t)(rows * cols > 0 ? rows * cols : 1) * sizeof(double));
    assert_non_null(wv);
    struct llmem_weight w = {make_weight(dt, rows * cols, wv), dt, rows, cols, 0, NULL, NULL, 0};
    float *x = make_floats(n * cols);
    float *bias = with_bias ? make_floats(rows) : NULL;
    float *yd = check_matmul(b, CPU_MATMUL_DECODE, &w, wv, x, n, bias);
    float *yg = check_matmul(b, CPU_MATMUL_GEMM, &w, wv, x, n, bias);
    float *ya = check_matmul(b, CPU_MATMUL_AUTO, &w, wv, x, n, bias);
    /* The paths give the same bits (one summation order). */
    assert_memory_equal(yd, yg, (size_t)(n * rows) * sizeof(float));
    assert_memory_equal(ya, yd, (size_t)(n * rows) * sizeof(float));
    llmem_backend_cpu_set_matmul_path(b, CPU_MATMUL_AUTO);
    free(yd);
    free(yg);
    free(ya);
    free(bias);
    free(x);
    free((void *)w.data);
    free(wv);
}

static const enum llmem_dtype dtypes[3] = {LLMEM_DTYPE_BF16, LLMEM_DTYPE_F16, LLMEM_DTYPE_F32};

static void test_matmul_shapes(void **state) {
    (void)state;
    static const int64_t shapes[][2] = {{1, 1}, {3, 37}, {67, 129}, {16, 32}, {25, 64}, {13, 300}};
    static const int64_t ns[] = {1, 3, 17, 64, 100};
    for (int threads = 1; threads <= 3; threads++) {
        struct llmem_backend *b = make_backend(threads);
        for (int isa = CPU_ISA_SCALAR; isa <= (int)llmem_cpu_isa_best(); isa++) {
            assert_int_equal(llmem_backend_cpu_set_isa(b, (enum cpu_isa)isa), isa);
            for (int d = 0; d < 3; d++)
                for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
                    for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++)
                        matmul_case(b, dtypes[d], shapes[s][0], shapes[s][1], ns[i],
                                    (int)((s + i) & 1));
        }
        llmem_backend_destroy(b);
    }
    fprintf(stderr, "matmul: worst |err| / bound = %.3f\n", worst_ratio);
}

/* Enough rows for the multi-task split, more than one K block (cols > 4096) and more than one
 * token block of packed activations (n = 300 with K blocks of 4112). */
static void test_matmul_blocks(void **state) {
    (void)state;
    struct llmem_backend *b = make_backend(2);
    for (int isa = CPU_ISA_SCALAR; isa <= (int)llmem_cpu_isa_best(); isa++) {
        llmem_backend_cpu_set_isa(b, (enum cpu_isa)isa);
        matmul_case(b, LLMEM_DTYPE_BF16, 5, 8200, 300, 1);
        matmul_case(b, LLMEM_DTYPE_F16, 3, 4100, 17, 0);
        matmul_case(b, LLMEM_DTYPE_F32, 1030, 40, 5, 1);
        matmul_case(b, LLMEM_DTYPE_BF16, 2053, 64, 33, 0);
    }
    llmem_backend_destroy(b);
    fprintf(stderr, "matmul blocks: worst |err| / bound = %.3f\n", worst_ratio);
}

/* Batch invariance: every row of matmul(x[0..n)) equals matmul(x[i..i+1)) bit for bit, for
 * n = 1…100 (both paths, AUTO), 1–3 threads, both precisions, and every ISA gives the same bits
 * (fast precision's bf16 kernels their own, the same on every thread count; without them fast
 * gives f32's bits). The single rows are checked against the float64 reference. The scalar and
 * AVX2 kernels run a subset of n. */
static void test_matmul_batch_invariance(void **state) {
    (void)state;
    static const int64_t shapes[][2] = {{37, 4100}, {67, 129}, {29, 16}, {5, 8200}};
    static const int64_t few_n[] = {2, 3, 7, 23, 24, 25, 31, 100};
    const int64_t max_n = 100;
    for (int d = 0; d < 3; d++)
        for (size_t sh = 0; sh < sizeof(shapes) / sizeof(shapes[0]); sh++) {
            const int64_t rows = shapes[sh][0], cols = shapes[sh][1];
            double *wv = malloc((size_t)(rows * cols) * sizeof(double));
            assert_non_null(wv);
            struct llmem_weight w = {
                make_weight(dtypes[d], rows * cols, wv), dtypes[d], rows, cols, 0, NULL, NULL, 0};
            float *x = make_floats(max_n * cols);
            float *bias = (sh & 1) ? make_floats(rows) : NULL;
            /* the bits of single rows, exact and with x rounded to bf16 */
            float *singles[2] = {malloc((size_t)(max_n * rows) * sizeof(float)),
                                 malloc((size_t)(max_n * rows) * sizeof(float))};
            float *batch = malloc((size_t)(max_n * rows) * sizeof(float));
            assert_true(singles[0] != NULL && singles[1] != NULL && batch != NULL);
            int have[2] = {0, 0};
            for (int threads = 1; threads <= 3; threads++) {
                struct llmem_backend *b = make_backend(threads);
                for (int prec = 0; prec < 2; prec++)
                    for (int isa = CPU_ISA_SCALAR; isa <= (int)llmem_cpu_isa_best(); isa++) {
                        llmem_backend_cpu_set_precision(b, prec ? LLMEM_PRECISION_FAST
                                                                : LLMEM_PRECISION_F32);
                        llmem_backend_cpu_set_isa(b, (enum cpu_isa)isa);
                        const int kind = rounds_x(b, &w);
                        float *single = singles[kind];
                        int have_single = have[kind];
                        for (int64_t i = 0; i < max_n; i++) {
                            float *y1 =
                                check_matmul(b, CPU_MATMUL_AUTO, &w, wv + 0, x + i * cols, 1, bias);
                            if (!have_single)
                                memcpy(single + i * rows, y1, (size_t)rows * sizeof(float));
                            else /* the same bits on every ISA and thread count */
                                assert_memory_equal(single + i * rows, y1,
                                                    (size_t)rows * sizeof(float));
                            free(y1);
                        }
                        have[kind] = 1;
                        int full = isa == (int)llmem_cpu_isa_best() && (prec == 0 || kind);
                        int64_t count = full ? max_n : (int64_t)(sizeof(few_n) / sizeof(few_n[0]));
                        for (int64_t c = 0; c < count; c++) {
                            int64_t n = full ? c + 1 : few_n[c];
                            for (int p = CPU_MATMUL_AUTO; p <= CPU_MATMUL_GEMM; p++) {
                                llmem_backend_cpu_set_matmul_path(b, (enum cpu_matmul_path)p);
                                b->ops->matmul(b->ctx, &w, x, n, batch, bias);
                                if (memcmp(batch, single, (size_t)(n * rows) * sizeof(float)) !=
                                    0) {
                                    fprintf(stderr,
                                            "batch invariance: %s %lldx%lld n=%lld path=%d "
                                            "isa=%d threads=%d precision=%d\n",
                                            llmem_dtype_name(w.dtype), (long long)rows,
                                            (long long)cols, (long long)n, p, isa, threads, prec);
                                    fail();
                                }
                            }
                        }
                        llmem_backend_cpu_set_matmul_path(b, CPU_MATMUL_AUTO);
                    }
                llmem_backend_destroy(b);
            }
            free(singles[0]), free(singles[1]), free(batch), free(bias), free(x);
            free((void *)w.data), free(wv);
        }
}

/* Several matmuls of one input in one call give each matmul's own bits: q/k/v-like and
 * gate/up-like sets (mixed dtypes and shapes, with and without bias), n = 1, 4 and 40 (decode and
 * GEMM paths), 1 to 3 threads. */
static void test_matmul_multi(void **state) {
    (void)state;
    static const int64_t shapes[3][2] = {{256, 512}, {64, 512}, {1000, 512}};
    double *wv[3];
    struct llmem_weight w[3];
    for (int i = 0; i < 3; i++) {
        wv[i] = malloc((size_t)(shapes[i][0] * shapes[i][1]) * sizeof(double));
        assert_non_null(wv[i]);
        w[i] = (struct llmem_weight){make_weight(dtypes[i], shapes[i][0] * shapes[i][1], wv[i]),
                                     dtypes[i],
                                     shapes[i][0],
                                     shapes[i][1],
                                     0,
                                     NULL,
                                     NULL,
                                     0};
    }
    float *x = make_floats(40 * 512), *bias = make_floats(1000);
    for (int threads = 1; threads <= 3; threads++) {
        struct llmem_backend *b = make_backend(threads);
        for (int count = 2; count <= 3; count++) {
            for (int with_bias = 0; with_bias < 2; with_bias++) {
                static const int64_t ns[] = {1, 4, 40};
                for (size_t k = 0; k < 3; k++) {
                    int64_t n = ns[k];
                    const struct llmem_weight *wp[3] = {&w[0], &w[1], &w[2]};
                    const float *bp[3] = {bias, NULL, bias};
                    float *y[3], *want[3];
                    for (int i = 0; i < count; i++) {
                        y[i] = malloc((size_t)(n * w[i].rows) * sizeof(float));
                        want[i] = malloc((size_t)(n * w[i].rows) * sizeof(float));
                        assert_non_null(y[i]);
                        assert_non_null(want[i]);
                        b->ops->matmul(b->ctx, &w[i], x, n, want[i], with_bias ? bp[i] : NULL);
                    }
                    b->ops->matmul_multi(b->ctx, count, wp, x, n, y, with_bias ? bp : NULL);
                    for (int i = 0; i < count; i++) {
                        assert_memory_equal(y[i], want[i], (size_t)(n * w[i].rows) * sizeof(float));
                        free(y[i]), free(want[i]);
                    }
                }
            }
        }
        llmem_backend_destroy(b);
    }
    for (int i = 0; i < 3; i++)
        free((void *)w[i].data), free(wv[i]);
    free(x), free(bias);
}

/* llmem_cpu_matmul_many (a mixture's experts): matrices each of their own rows of x — float
 * dtypes and quantized types at fast precision, a few rows (one dispatch) or many (one by one),
 * two matrices sharing an input — give llmem_cpu_matmul's bits on each, at any thread count. */
static void test_matmul_many(void **state) {
    (void)state;
    enum { N = 6, COLS = 512 };
    const int64_t rows[N] = {96, 64, 100, 256, 32, 48};
    const int quant[N] = {0, 0, LLMEM_QTYPE_Q4_K, LLMEM_QTYPE_Q8_0, LLMEM_QTYPE_Q6_K, 0};
    struct llmem_weight w[N];
    double *wv[N];
    for (int i = 0; i < N; i++) {
        wv[i] = malloc((size_t)(rows[i] * COLS) * sizeof(double));
        assert_non_null(wv[i]);
        const enum llmem_dtype dt = dtypes[i % 3];
        w[i] = (struct llmem_weight){
            make_weight(dt, rows[i] * COLS, wv[i]), dt, rows[i], COLS, 0, NULL, NULL, 0};
        if (quant[i] != 0) { /* its rows as the type's blocks */
            float *f = make_floats(rows[i] * COLS);
            const int64_t rb = llmem_qtype_bytes(quant[i], COLS);
            uint8_t *q = malloc((size_t)(rows[i] * rb));
            assert_non_null(q);
            for (int64_t r = 0; r < rows[i]; r++)
                assert_int_equal(llmem_quant_quantize_row(quant[i], f + r * COLS, q + r * rb, COLS),
                                 LLMEM_OK);
            free((void *)w[i].data);
            free(f);
            w[i] =
                (struct llmem_weight){q, LLMEM_DTYPE_F32, rows[i], COLS, quant[i], NULL, NULL, 0};
        }
    }
    float *xs = make_floats(N * 40 * COLS);
    static const int64_t counts[][N] = {
        {1, 1, 1, 1, 1, 1}, {3, 1, 7, 2, 23, 5}, {40, 2, 30, 1, 1, 24}};
    for (int threads = 1; threads <= 3; threads++) {
        struct llmem_backend *b = make_backend(threads);
        for (size_t c = 0; c < sizeof(counts) / sizeof(counts[0]); c++) {
            for (int floats = 0; floats < 2; floats++) { /* the float matrices, the quantized */
                const struct llmem_weight *wp[N];
                const float *xp[N];
                int64_t np[N];
                float *y[N], *want[N];
                int m = 0;
                for (int i = 0; i < N; i++) {
                    if ((quant[i] == 0) != floats)
                        continue;
                    wp[m] = &w[i], np[m] = counts[c][i];
                    /* the second matrix of each kind shares the first's input */
                    xp[m] = xs + (m == 1 ? 0 : i) * 40 * COLS;
                    if (m == 1)
                        np[m] = np[0];
                    y[m] = malloc((size_t)(np[m] * rows[i]) * sizeof(float));
                    want[m] = malloc((size_t)(np[m] * rows[i]) * sizeof(float));
                    assert_true(y[m] != NULL && want[m] != NULL);
                    llmem_cpu_matmul(b->ctx, wp[m], xp[m], np[m], want[m], NULL);
                    m++;
                }
                llmem_cpu_matmul_many(b->ctx, m, wp, xp, np, y);
                for (int i = 0; i < m; i++) {
                    assert_memory_equal(y[i], want[i],
                                        (size_t)(np[i] * wp[i]->rows) * sizeof(float));
                    free(y[i]), free(want[i]);
                }
            }
        }
        llmem_backend_destroy(b);
    }
    for (int i = 0; i < N; i++)
        free((void *)w[i].data), free(wv[i]);
    free(xs);
}

static void test_matmul_empty(void **state) {
    (void)state;
    struct llmem_backend *b = make_backend(2);
    float bias[3] = {1, 2, 3}, y[6] = {0}, x[1] = {0};
    uint16_t data[1] = {0};
    struct llmem_weight w = {data, LLMEM_DTYPE_BF16, 3, 0, 0, NULL, NULL, 0};
    b->ops->matmul(b->ctx, &w, x, 2, y, bias);
    for (int i = 0; i < 6; i++)
        assert_true(y[i] == bias[i % 3]);
    b->ops->matmul(b->ctx, &w, x, 0, y, NULL); /* n = 0: nothing */
    llmem_backend_destroy(b);
}

/* ---- element-wise operations ------------------------------------------------------------------
 */

static void test_rmsnorm(void **state) {
    (void)state;
    static const int64_t cases[][2] = {{1, 1}, {3, 37}, {5, 2048}, {64, 1024}, {100, 129}};
    for (int threads = 1; threads <= 3; threads++) {
        struct llmem_backend *b = make_backend(threads);
        for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
            int64_t n = cases[c][0], dim = cases[c][1];
            float *x = make_floats(n * dim), *wt = make_floats(dim);
            float *y = malloc((size_t)(n * dim) * sizeof(float));
            float *inplace = malloc((size_t)(n * dim) * sizeof(float));
            assert_non_null(y);
            assert_non_null(inplace);
            memcpy(inplace, x, (size_t)(n * dim) * sizeof(float));
            const float eps = 1e-5f;
            b->ops->rmsnorm(b->ctx, x, wt, n, dim, eps, y);
            b->ops->rmsnorm(b->ctx, inplace, wt, n, dim, eps, inplace);
            for (int64_t t = 0; t < n; t++) {
                double s = 0;
                for (int64_t i = 0; i < dim; i++)
                    s += (double)x[t * dim + i] * x[t * dim + i];
                double inv = 1.0 / sqrt(s / (double)dim + (double)eps);
                for (int64_t i = 0; i < dim; i++) {
                    double ref = x[t * dim + i] * inv * wt[i];
                    assert_true(fabs(y[t * dim + i] - ref) <= 1e-6 * fabs(ref) + 1e-30);
                    assert_true(inplace[t * dim + i] == y[t * dim + i]);
                }
            }
            free(x);
            free(wt);
            free(y);
            free(inplace);
        }
        llmem_backend_destroy(b);
    }
}

static void test_rope(void **state) {
    (void)state;
    static const int head_dims[] = {32, 64, 128};
    for (int threads = 1; threads <= 3; threads++) {
        struct llmem_backend *b = make_backend(threads);
        for (size_t hd = 0; hd < 3; hd++) {
            const int head_dim = head_dims[hd], half = head_dim / 2, n_heads = 3;
            const int64_t n = threads == 2 ? 130 : 7;
            float inv_freq[64];
            for (int i = 0; i < half; i++)
                inv_freq[i] = (float)(1.0 / pow(500000.0, 2.0 * i / head_dim));
            int64_t pos[130];
            for (int64_t t = 0; t < n; t++)
                pos[t] = t == 0 ? 0 : t == 1 ? 100000 : t == 2 ? 131071 : (int64_t)(rng() % 200000);
            float *x = make_floats(n * n_heads * head_dim);
            float *y = malloc((size_t)(n * n_heads * head_dim) * sizeof(float));
            assert_non_null(y);
            memcpy(y, x, (size_t)(n * n_heads * head_dim) * sizeof(float));
            b->ops->rope(b->ctx, y, n, n_heads, head_dim, pos, inv_freq);
            for (int64_t t = 0; t < n; t++)
                for (int h = 0; h < n_heads; h++)
                    for (int i = 0; i < half; i++) {
                        int64_t base = (t * n_heads + h) * head_dim;
                        float angle = (float)pos[t] * inv_freq[i];
                        double c = (float)cos((double)angle), s = (float)sin((double)angle);
                        double x0 = x[base + i], x1 = x[base + i + half];
                        double r0 = x0 * c - x1 * s, r1 = x1 * c + x0 * s;
                        double tol = 1e-6 * (fabs(x0) + fabs(x1));
                        assert_true(fabs(y[base + i] - r0) <= tol);
                        assert_true(fabs(y[base + i + half] - r1) <= tol);
                    }
            free(x);
            free(y);
        }
        llmem_backend_destroy(b);
    }
}

static void test_swiglu_add(void **state) {
    (void)state;
    static const int64_t sizes[] = {1, 37, 8192, 300000};
    for (int threads = 1; threads <= 3; threads++) {
        struct llmem_backend *b = make_backend(threads);
        for (size_t c = 0; c < 4; c++) {
            int64_t n = sizes[c];
            float *g = make_floats(n), *u = make_floats(n), *out = malloc((size_t)n * 4);
            float *g2 = malloc((size_t)n * 4);
            assert_non_null(out);
            assert_non_null(g2);
            for (int64_t i = 0; i < n; i++)
                g[i] *= 20.0f; /* both tails of the sigmoid */
            memcpy(g2, g, (size_t)n * 4);
            b->ops->swiglu(b->ctx, g, u, n, out);
            b->ops->swiglu(b->ctx, g2, u, n, g2); /* out == gate */
            for (int64_t i = 0; i < n; i++) {
                double ref = (double)g[i] / (1.0 + exp(-(double)g[i])) * u[i];
                assert_true(fabs(out[i] - ref) <= 1e-6 * fabs(ref) + 1e-30);
                assert_true(g2[i] == out[i]);
            }
            float *y = make_floats(n), *y0 = malloc((size_t)n * 4);
            assert_non_null(y0);
            memcpy(y0, y, (size_t)n * 4);
            b->ops->add(b->ctx, y, u, n);
            for (int64_t i = 0; i < n; i++)
                assert_true(y[i] == y0[i] + u[i]);
            free(g), free(u), free(out), free(g2), free(y), free(y0);
        }
        llmem_backend_destroy(b);
    }
}

static void test_embedding(void **state) {
    (void)state;
    for (int threads = 1; threads <= 3; threads += 2) {
        struct llmem_backend *b = make_backend(threads);
        for (int d = 0; d < 3; d++) {
            const int64_t vocab = 50, dim = threads == 1 ? 37 : 4096, n = 20;
            double *val = malloc((size_t)(vocab * dim) * sizeof(double));
            assert_non_null(val);
            struct llmem_weight table = {
                make_weight(dtypes[d], vocab * dim, val), dtypes[d], vocab, dim, 0, NULL, NULL, 0};
            int32_t ids[20];
            for (int t = 0; t < n; t++)
                ids[t] = t == 0 ? 0 : t == 1 ? (int32_t)vocab - 1 : (int32_t)(rng() % vocab);
            float *out = malloc((size_t)(n * dim) * sizeof(float));
            assert_non_null(out);
            b->ops->embedding(b->ctx, &table, ids, n, out);
            for (int64_t t = 0; t < n; t++)
                for (int64_t i = 0; i < dim; i++)
                    assert_true((double)out[t * dim + i] == val[ids[t] * dim + i]);
            free(out);
            free((void *)table.data);
            free(val);
        }
        llmem_backend_destroy(b);
    }
}

/* Quantized weights (GGUF's blocks) multiply as f32 weights holding their exactly dequantized
 * values do, bit for bit, at every n and thread count, with and without a bias; the embedding
 * of a quantized table is the dequantized row. */
static void test_matmul_quantized(void **state) {
    (void)state;
    const int types[] = {LLMEM_QTYPE_Q8_0, LLMEM_QTYPE_Q4_0, LLMEM_QTYPE_Q5_1,
                         LLMEM_QTYPE_Q4_K, LLMEM_QTYPE_Q6_K, LLMEM_QTYPE_Q2_K};
    const int64_t rows = 37, cols = 512;
    float *wf = make_floats(rows * cols);
    float *deq = malloc((size_t)(rows * cols) * sizeof(float));
    assert_non_null(deq);
    for (int threads = 1; threads <= 2; threads++) {
        struct llmem_backend *b = make_backend(threads);
        llmem_backend_cpu_set_precision(b, LLMEM_PRECISION_F32);
        for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
            const int64_t row_bytes = llmem_qtype_bytes(types[ti], cols);
            uint8_t *q = malloc((size_t)(rows * row_bytes));
            assert_non_null(q);
            for (int64_t r = 0; r < rows; r++) {
                assert_int_equal(
                    llmem_quant_quantize_row(types[ti], wf + r * cols, q + r * row_bytes, cols),
                    LLMEM_OK);
                assert_int_equal(
                    llmem_quant_dequantize_row(types[ti], q + r * row_bytes, deq + r * cols, cols),
                    LLMEM_OK);
            }
            struct llmem_weight wq = {q, LLMEM_DTYPE_F32, rows, cols, types[ti], NULL, NULL, 0};
            struct llmem_weight w32 = {deq, LLMEM_DTYPE_F32, rows, cols, 0, NULL, NULL, 0};
            assert_int_equal(llmem_weight_row_bytes(&wq), row_bytes);
            for (int64_t n = 1; n <= 40; n += 13) {
                float *x = make_floats(n * cols), *bias = make_floats(rows);
                float *yq = malloc((size_t)(n * rows) * sizeof(float));
                float *yf = malloc((size_t)(n * rows) * sizeof(float));
                assert_true(yq != NULL && yf != NULL);
                for (int with_bias = 0; with_bias < 2; with_bias++) {
                    /* the f32 reference through the same panel: the portable GEMM path */
                    llmem_backend_cpu_set_matmul_path(b, CPU_MATMUL_GEMM);
                    b->ops->matmul(b->ctx, &w32, x, n, yf, with_bias ? bias : NULL);
                    llmem_backend_cpu_set_matmul_path(b, CPU_MATMUL_AUTO);
                    b->ops->matmul(b->ctx, &wq, x, n, yq, with_bias ? bias : NULL);
                    for (int64_t i = 0; i < n * rows; i++)
                        assert_float_equal(yq[i], yf[i], 1e-4f * (1.0f + fabsf(yf[i])));
                }
                free(x), free(bias), free(yq), free(yf);
            }
            int32_t ids[3] = {0, 36, 5};
            float *e = malloc((size_t)(3 * cols) * sizeof(float));
            assert_non_null(e);
            b->ops->embedding(b->ctx, &wq, ids, 3, e);
            for (int t = 0; t < 3; t++)
                assert_memory_equal(e + t * cols, deq + ids[t] * cols,
                                    (size_t)cols * sizeof(float));
            free(e);
            free(q);
        }
        llmem_backend_destroy(b);
    }
    free(wf);
    free(deq);
}

/* ---- quantized weights at fast precision ------------------------------------------------------
 *
 * The integer kernels (matmul_q.c) against the exact product of the dequantized weights with x,
 * in double. The activations are quantized per block of B values (32 for the 32-value types,
 * 256 for the K types) with d = max|x| / 127, so each value moves by at most d/2 = max|x_b| / 254,
 * and |y − ref| ≤ Σ_b max|x_b| / 254 · Σ_{i∈b} |w_i| · (1 + 1e-5) + 1e-5 · Σ_i |w_i · x_i| + 1e-6
 * (the second term the f32 scalings and sums). Every ISA, thread count and n gives the bits of the
 * portable kernel on the row alone: integer sums are exact and the float operations are the same
 * ones in the same order. */
static double worst_fast_ratio;

static void fast_case(int type, int64_t rows, int64_t cols, const int64_t *ns, int n_ns,
                      int max_threads) {
    const int64_t blk = type == LLMEM_QTYPE_Q8_0 || type == LLMEM_QTYPE_Q4_0 ||
                                type == LLMEM_QTYPE_Q5_0 || type == LLMEM_QTYPE_Q4_1 ||
                                type == LLMEM_QTYPE_Q5_1
                            ? 32
                            : 256;
    const int64_t row_bytes = llmem_qtype_bytes(type, cols);
    int64_t n_max = 0;
    for (int i = 0; i < n_ns; i++)
        n_max = ns[i] > n_max ? ns[i] : n_max;
    float *wf = make_floats(rows * cols);
    float *deq = malloc((size_t)(rows * cols) * sizeof(float));
    uint8_t *q = malloc((size_t)(rows * row_bytes));
    assert_true(deq != NULL && q != NULL);
    for (int64_t r = 0; r < rows; r++) {
        assert_int_equal(llmem_quant_quantize_row(type, wf + r * cols, q + r * row_bytes, cols),
                         LLMEM_OK);
        assert_int_equal(llmem_quant_dequantize_row(type, q + r * row_bytes, deq + r * cols, cols),
                         LLMEM_OK);
    }
    struct llmem_weight wq = {q, LLMEM_DTYPE_F32, rows, cols, type, NULL, NULL, 0};
    float *x = make_floats(n_max * cols), *bias = make_floats(rows);
    for (int64_t i = 0; i < n_max * cols; i += 7) /* some rows' blocks with large and zero values */
        x[i] *= (i / cols) % 3 == 0 ? 16.0f : 1.0f;
    for (int64_t i = 0; i < blk && n_max > 1; i++)
        x[cols + i] = 0.0f;
    /* the portable kernel, one row of x at a time: the bits every other run must give */
    float *one = malloc((size_t)(n_max * rows) * sizeof(float));
    float *y = malloc((size_t)(n_max * rows) * sizeof(float));
    assert_true(one != NULL && y != NULL);
    struct llmem_backend *b1 = make_backend(1);
    assert_int_equal(llmem_backend_cpu_set_isa(b1, CPU_ISA_SCALAR), CPU_ISA_SCALAR);
    for (int64_t t = 0; t < n_max; t++)
        b1->ops->matmul(b1->ctx, &wq, x + t * cols, 1, one + t * rows, bias);
    llmem_backend_destroy(b1);
    for (int64_t t = 0; t < n_max; t++)
        for (int64_t r = 0; r < rows; r++) {
            double ref = bias[r], mag = 0.0, qerr = 0.0;
            for (int64_t b0 = 0; b0 < cols; b0 += blk) {
                double amax = 0.0, wsum = 0.0;
                for (int64_t k = b0; k < b0 + blk; k++) {
                    double xv = x[t * cols + k], wv = deq[r * cols + k];
                    ref += xv * wv;
                    mag += fabs(xv * wv);
                    amax = fabs(xv) > amax ? fabs(xv) : amax;
                    wsum += fabs(wv);
                }
                qerr += amax / 254.0 * wsum;
            }
            double bound = qerr * (1 + 1e-5) + 1e-5 * mag + 1e-6 * (1.0 + fabs(bias[r]));
            double err = fabs((double)one[t * rows + r] - ref);
            if (err / bound > worst_fast_ratio)
                worst_fast_ratio = err / bound;
            if (!(err <= bound)) {
                fprintf(stderr, "fast %s %lldx%lld y[%lld,%lld]=%.9g ref=%.9g bound=%g\n",
                        llmem_qtype_name(type), (long long)rows, (long long)cols, (long long)t,
                        (long long)r, (double)one[t * rows + r], ref, bound);
                fail();
            }
        }
    for (int threads = 1; threads <= max_threads; threads++) {
        struct llmem_backend *b = make_backend(threads);
        /* every ISA; AVX-512 also without VNNI */
        for (int isa = CPU_ISA_SCALAR; isa <= (int)llmem_cpu_isa_best() + 1; isa++) {
            const int no_vnni = isa > (int)llmem_cpu_isa_best();
            if (no_vnni && llmem_cpu_isa_best() != CPU_ISA_AVX512)
                break;
            llmem_backend_cpu_set_isa(b, no_vnni ? CPU_ISA_AVX512 : (enum cpu_isa)isa);
            llmem_backend_cpu_set_vnni(b, !no_vnni);
            for (int i = 0; i < n_ns; i++) {
                for (int64_t k = 0; k < ns[i] * rows; k++)
                    y[k] = NAN;
                b->ops->matmul(b->ctx, &wq, x, ns[i], y, bias);
                if (memcmp(y, one, (size_t)(ns[i] * rows) * sizeof(float)) != 0) {
                    fprintf(stderr, "fast %s %lldx%lld: isa %d, %d threads, n=%lld differs\n",
                            llmem_qtype_name(type), (long long)rows, (long long)cols, isa, threads,
                            (long long)ns[i]);
                    fail();
                }
            }
        }
        llmem_backend_destroy(b);
    }
    free(one), free(y), free(x), free(bias), free(q), free(deq), free(wf);
}

static void test_matmul_fast(void **state) {
    (void)state;
    const int types[] = {LLMEM_QTYPE_Q8_0, LLMEM_QTYPE_Q4_0, LLMEM_QTYPE_Q5_0, LLMEM_QTYPE_Q4_1,
                         LLMEM_QTYPE_Q5_1, LLMEM_QTYPE_Q4_K, LLMEM_QTYPE_Q5_K, LLMEM_QTYPE_Q6_K};
    const int64_t ns[] = {1, 2, 3, 4, 5, 7, 16, 18, 23, 24, 25, 64, 101};
    for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
        fast_case(types[ti], 37, 512, ns, (int)(sizeof(ns) / sizeof(ns[0])), 3);
        fast_case(types[ti], 5, 768, ns, 4, 2);
    }
    /* rows of x in more than one chunk of the quantized-x scratch */
    const int64_t big[] = {1, 300};
    fast_case(LLMEM_QTYPE_Q4_K, 3, 16384, big, 2, 2);
    fast_case(LLMEM_QTYPE_Q8_0, 3, 16384, big, 2, 2);
    /* blocks after the last group of four (the 32-value tiles take them one by one) */
    fast_case(LLMEM_QTYPE_Q8_0, 9, 224, ns, 6, 2);
    fast_case(LLMEM_QTYPE_Q4_0, 9, 224, ns, 6, 2);
    fast_case(LLMEM_QTYPE_Q5_0, 9, 224, ns, 6, 2);
    fast_case(LLMEM_QTYPE_Q4_1, 9, 224, ns, 6, 2);
    fast_case(LLMEM_QTYPE_Q5_1, 9, 224, ns, 6, 2);
    /* W too large to stay in the caches: decode by the dot kernels, prefill by the tiles and
     * (the K types, 16 rows of x or more) the panels */
    const int64_t two[] = {1, 5, 17};
    fast_case(LLMEM_QTYPE_Q8_0, 1040, 512, two, 3, 2);
    fast_case(LLMEM_QTYPE_Q5_0, 1040, 512, two, 3, 2);
    fast_case(LLMEM_QTYPE_Q5_1, 1040, 512, two, 3, 2);
    fast_case(LLMEM_QTYPE_Q4_K, 1040, 512, two, 3, 2);
    fast_case(LLMEM_QTYPE_Q6_K, 1040, 256, two, 3, 2);
    printf("fast matmul: worst |err| / bound = %.3f (kernels: %s)\n", worst_fast_ratio,
           llmem_backend_cpu_matmul_kernels());
    /* f32 precision keeps the exact path: checked in test_matmul_quantized */
}

/* bf16 weights at fast precision run the AVX512-BF16 kernels where the CPU has them (else the
 * test is skipped): their results differ from f32's by the rounding of x to bf16 alone (within
 * 2⁻⁹ · Σ|x·w| plus the accumulation bound), and a backend capped below AVX-512 gives f32's. */
static void test_matmul_bf16_fast(void **state) {
    (void)state;
    if (!llmem_cpu_bf16_isa(llmem_cpu_isa_best()))
        skip();
    enum { ROWS = 96, COLS = 2048, N = 40 };
    double *wv = malloc((size_t)ROWS * COLS * sizeof(double));
    assert_non_null(wv);
    struct llmem_weight w = {make_weight(LLMEM_DTYPE_BF16, ROWS * COLS, wv),
                             LLMEM_DTYPE_BF16,
                             ROWS,
                             COLS,
                             0,
                             NULL,
                             NULL,
                             0};
    float *x = make_floats(N * COLS), *yf = malloc(sizeof(float) * N * ROWS),
          *ye = malloc(sizeof(float) * N * ROWS);
    assert_true(yf != NULL && ye != NULL);
    struct llmem_backend *b = make_backend(2);
    assert_true(llmem_cpu_bf16_fast(b->ctx)); /* the default precision is fast */
    b->ops->matmul(b->ctx, &w, x, N, yf, NULL);
    llmem_backend_cpu_set_precision(b, LLMEM_PRECISION_F32);
    b->ops->matmul(b->ctx, &w, x, N, ye, NULL);
    int differ = 0;
    for (int t = 0; t < N; t++)
        for (int r = 0; r < ROWS; r++) {
            double mag = 0.0;
            for (int k = 0; k < COLS; k++)
                mag += fabs((double)x[t * COLS + k] * wv[r * COLS + k]);
            double d = fabs((double)yf[t * ROWS + r] - ye[t * ROWS + r]);
            assert_true(d <= 0x1p-9 * mag + 2e-6 * mag);
            differ |= d > 0.0;
        }
    assert_true(differ); /* x was rounded: this is not the f32 path */
    llmem_backend_cpu_set_precision(b, LLMEM_PRECISION_FAST);
    assert_int_equal(llmem_backend_cpu_set_isa(b, CPU_ISA_AVX2), CPU_ISA_AVX2);
    assert_false(llmem_cpu_bf16_fast(b->ctx));
    b->ops->matmul(b->ctx, &w, x, N, yf, NULL);
    assert_memory_equal(yf, ye, sizeof(float) * N * ROWS);
    llmem_backend_destroy(b);
    free(x), free(yf), free(ye), free((void *)w.data), free(wv);
}

/* On a CPU with AMX-BF16 (else skipped), bf16 weights at fast precision take the tiles for every
 * row count: a row of x gives the same bits alone, in any batch, beside other matrices of the same
 * x (matmul_multi) or of their own (matmul_many); the results keep the bound of x rounded to bf16,
 * as do the AVX512-BF16 kernels a backend without AMX runs. Shapes with partial tiles: 100 rows
 * (32 · 3 + 4), 2,050 columns (a chunk of 2). */
static void test_matmul_amx(void **state) {
    (void)state;
    if (!(llmem_sys_isa_features() & LLMEM_ISA_AMX_BF16))
        skip();
    enum { ROWS = 100, COLS = 2050, N = 37, ROWS2 = 33 };
    double *wv = malloc(sizeof(double) * ROWS * COLS), *wv2 = malloc(sizeof(double) * ROWS2 * COLS);
    assert_true(wv != NULL && wv2 != NULL);
    struct llmem_weight w = {make_weight(LLMEM_DTYPE_BF16, ROWS * COLS, wv),
                             LLMEM_DTYPE_BF16,
                             ROWS,
                             COLS,
                             0,
                             NULL,
                             NULL,
                             0};
    struct llmem_weight w2 = {make_weight(LLMEM_DTYPE_BF16, ROWS2 * COLS, wv2),
                              LLMEM_DTYPE_BF16,
                              ROWS2,
                              COLS,
                              0,
                              NULL,
                              NULL,
                              0};
    float *x = make_floats(N * COLS), *bias = make_floats(ROWS);
    float *yb = malloc(sizeof(float) * N * ROWS), *y1 = malloc(sizeof(float) * N * ROWS);
    float *yb2 = malloc(sizeof(float) * N * ROWS2), *y2 = malloc(sizeof(float) * N * ROWS2);
    assert_true(yb != NULL && y1 != NULL && yb2 != NULL && y2 != NULL);
    struct llmem_backend *b = make_backend(3);
    assert_true(llmem_cpu_amx_takes(b->ctx, &w));
    assert_string_equal(llmem_backend_cpu_bf16_kernels(), "amx_bf16");
    b->ops->matmul(b->ctx, &w, x, N, yb, bias);
    b->ops->matmul(b->ctx, &w2, x, N, yb2, NULL);
    for (int t = 0; t < N; t++) {
        b->ops->matmul(b->ctx, &w, x + t * COLS, 1, y1, bias);
        assert_memory_equal(y1, yb + t * ROWS, sizeof(float) * ROWS);
    }
    for (int t = 0; t + 5 <= N; t += 7) {
        b->ops->matmul(b->ctx, &w, x + t * COLS, 5, y1, bias);
        assert_memory_equal(y1, yb + t * ROWS, sizeof(float) * ROWS * 5);
    }
    const struct llmem_weight *ws[2] = {&w, &w2};
    const float *biases[2] = {bias, NULL};
    for (int64_t n = 1; n <= N; n += 18) {
        float *ys[2] = {y1, y2};
        b->ops->matmul_multi(b->ctx, 2, ws, x, n, ys, biases);
        assert_memory_equal(y1, yb, sizeof(float) * (size_t)n * ROWS);
        assert_memory_equal(y2, yb2, sizeof(float) * (size_t)n * ROWS2);
    }
    /* matmul_many: w2 on rows 3.. of x, w on rows 0..1 (no bias there) */
    const float *xs[2] = {x + 3 * COLS, x};
    const int64_t ns[2] = {4, 2};
    const struct llmem_weight *wm[2] = {&w2, &w};
    float *ym[2] = {y2, y1};
    llmem_cpu_matmul_many(b->ctx, 2, wm, xs, ns, ym);
    assert_memory_equal(y2, yb2 + 3 * ROWS2, sizeof(float) * 4 * ROWS2);
    for (int t = 0; t < 2; t++)
        for (int r = 0; r < ROWS; r++)
            assert_true(y1[t * ROWS + r] + bias[r] == yb[t * ROWS + r]);
    /* The bound of x rounded to bf16, on the tiles and on the AVX512-BF16 kernels. */
    for (int amx = 1; amx >= 0; amx--) {
        llmem_backend_cpu_set_amx(b, amx);
        assert_int_equal(llmem_cpu_amx_takes(b->ctx, &w), amx);
        b->ops->matmul(b->ctx, &w, x, N, y1, NULL);
        for (int t = 0; t < N; t++)
            for (int r = 0; r < ROWS; r++) {
                double ref = 0.0, mag = 0.0;
                for (int k = 0; k < COLS; k++) {
                    double p = bf16_round(x[t * COLS + k]) * wv[r * COLS + k];
                    ref += p;
                    mag += fabs(p);
                }
                assert_true(fabs((double)y1[t * ROWS + r] - ref) <= 1e-6 * mag + 1e-30);
            }
    }
    llmem_backend_destroy(b);
    free(x), free(bias), free(yb), free(y1), free(yb2), free(y2);
    free((void *)w.data), free((void *)w2.data), free(wv), free(wv2);
}

/* rope_pairs on rows permuted as the GGUF converter permutes q and k (pair i moved from
 * (i, i + half) to (2i, 2i + 1)) gives, bit for bit and in the same layout, what `rope` gives on
 * the rows before the permutation. */
/* MLX's groups dequantized with each ISA's vectors give the reference's bits (quant/dequant.c,
 * as mx.dequantize): every bits × group × scale type, over scales and biases that round normally,
 * overflow f16, fall to its subnormals, or are infinite or NaN, quiet or with a payload (a group
 * with a NaN rounded to f16 goes to the reference, whose NaN it returns). */
static void test_dequantize_mlx(void **state) {
    (void)state;
    const int scale_types[] = {LLMEM_QTYPE_BF16, LLMEM_QTYPE_F16, LLMEM_QTYPE_F32};
    const float specials[] = {70000.0f, 3e-7f, -1e-5f, INFINITY, NAN, 0.0f, -65504.0f};
    enum { ROWS = 3, COLS = 512 };
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    for (int bits = 4; bits <= 8; bits += 4)
        for (int gi = 0; gi < 3; gi++)
            for (int si = 0; si < 3; si++) {
                const int group = 32 << gi, st = scale_types[si];
                const int groups = COLS / group, ssize = st == LLMEM_QTYPE_F32 ? 4 : 2;
                uint8_t codes[ROWS * COLS], scales[ROWS * COLS / 32 * 4], biases[sizeof(scales)];
                for (size_t i = 0; i < sizeof(codes); i++)
                    codes[i] = (uint8_t)((seed = seed * 6364136223846793005ull + 1) >> 56);
                for (int i = 0; i < ROWS * groups; i++)
                    for (int k = 0; k < 2; k++) {
                        seed = seed * 6364136223846793005ull + 1;
                        float v = (float)((double)(seed >> 40) / (double)(1 << 24) - 0.5) * 0.1f;
                        if ((seed >> 20) % 5 == 0) /* one in five special */
                            v = specials[(seed >> 8) % (sizeof(specials) / sizeof(specials[0]))];
                        uint8_t *p = (k ? biases : scales) + (size_t)i * (size_t)ssize;
                        if (st == LLMEM_QTYPE_F32) {
                            memcpy(p, &v, 4);
                        } else {
                            uint16_t h = st == LLMEM_QTYPE_BF16 ? llmem_quant_f32_to_bf16(v)
                                                                : llmem_quant_f32_to_f16(v);
                            if ((seed >> 12) % 13 == 0) /* a NaN with a payload, as a file may */
                                h = st == LLMEM_QTYPE_BF16 ? 0xff81 : 0x7d01;
                            memcpy(p, &h, 2);
                        }
                    }
                const struct llmem_weight w = {.data = codes,
                                               .scales = scales,
                                               .biases = biases,
                                               .dtype = LLMEM_DTYPE_F32,
                                               .quant = llmem_qtype_mlx(bits, group, st),
                                               .rows = ROWS,
                                               .cols = COLS};
                assert_true(w.quant > 0);
                for (int r = 0; r < ROWS; r++) {
                    float want[COLS], got[COLS];
                    assert_int_equal(llmem_weight_dequantize_row(&w, r, want), LLMEM_OK);
                    for (int isa = CPU_ISA_SCALAR; isa <= (int)llmem_cpu_isa_best(); isa++) {
                        memset(got, 0xa5, sizeof(got));
                        assert_int_equal(llmem_cpu_dequantize_row((enum cpu_isa)isa, &w, r, got),
                                         LLMEM_OK);
                        if (memcmp(got, want, sizeof(got)) != 0)
                            fail_msg("bits %d group %d scale type %d row %d isa %d differ", bits,
                                     group, st, r, isa);
                    }
                }
            }
}

static void test_rope_pairs(void **state) {
    (void)state;
    struct llmem_backend *b = make_backend(2);
    const int head_dim = 64, half = 32, n_heads = 4;
    const int64_t n = 9;
    float inv_freq[32];
    for (int i = 0; i < half; i++)
        inv_freq[i] = (float)(1.0 / pow(10000.0, 2.0 * i / head_dim));
    int64_t pos[9];
    for (int64_t t = 0; t < n; t++)
        pos[t] = t * 977;
    float *x = make_floats(n * n_heads * head_dim);
    float *p = malloc((size_t)(n * n_heads * head_dim) * sizeof(float));
    assert_non_null(p);
    for (int64_t r = 0; r < n * n_heads; r++)
        for (int i = 0; i < half; i++) {
            p[r * head_dim + 2 * i] = x[r * head_dim + i];
            p[r * head_dim + 2 * i + 1] = x[r * head_dim + i + half];
        }
    b->ops->rope(b->ctx, x, n, n_heads, head_dim, pos, inv_freq);
    b->ops->rope_pairs(b->ctx, p, n, n_heads, head_dim, pos, inv_freq);
    assert_memory_equal(p, x, (size_t)(n * n_heads * head_dim) * sizeof(float));
    free(x);
    free(p);
    llmem_backend_destroy(b);
}

static void test_destroy_null(void **state) {
    (void)state;
    llmem_backend_destroy(NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul_shapes),
        cmocka_unit_test(test_matmul_blocks),
        cmocka_unit_test(test_matmul_batch_invariance),
        cmocka_unit_test(test_matmul_multi),
        cmocka_unit_test(test_matmul_many),
        cmocka_unit_test(test_matmul_empty),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_swiglu_add),
        cmocka_unit_test(test_embedding),
        cmocka_unit_test(test_matmul_quantized),
        cmocka_unit_test(test_matmul_fast),
        cmocka_unit_test(test_matmul_bf16_fast),
        cmocka_unit_test(test_matmul_amx),
        cmocka_unit_test(test_dequantize_mlx),
        cmocka_unit_test(test_rope_pairs),
        cmocka_unit_test(test_destroy_null),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
