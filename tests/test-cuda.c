/*
 * tests/test-cuda.c — the CUDA backend against the CPU backend, the reference: device memory
 * through the caching allocator, and every operation of the backend table on the same random
 * inputs, compared within the bounds below. The build checks run everywhere; the rest (the group
 * "gpu", ctest test-cuda:gpu) needs a CUDA build and a GPU, and skips without them.
 *
 * Bounds: the elementwise operations follow the CPU's arithmetic and agree to a few units in the
 * last place (1e-6 relative); matmul at f32 precision differs only by the order of the sums
 * (1e-5 of the largest output); at fast precision the activations are rounded to bf16 or f16 for
 * the tensor cores, which costs up to 1e-2 of the largest output (measured values are printed).
 * The paged KV cache on the device stores the same bytes as on the host and attends within 1e-5
 * (f32), 1e-3 (f16, bf16, q8: the CPU rounds the query differently) of the CPU; whole models at f32
 * precision give the CPU's logits within 1e-3 and its greedy tokens; at fast precision the drift is
 * printed and bounded.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"

#include "backend/ops.h"
#include "core/options.h"
#include "llmem/backend.h"
#include "llmem/engine.h"
#include "llmem/kv.h"
#include "llmem/mem.h"
#include "llmem/model.h"
#include "llmem/status.h"
#include "plan/moe_work.h"
#include "quant/quant.h"

static struct llmem_backend *cpu, *gpu, *gpu_f32;

/* Rows of x up to which the fast-precision backend multiplies in f32 (ops_int.h GEMV_FAST_ROWS);
 * more go to the tensor cores with x rounded to 16 bits. */
#define GEMV_FAST_ROWS 2
/* Rows of x up to which quantized weights take the matrix-vector kernels (ops_int.h) */
#define QGEMV_MAX_ROWS 8
#define QMMA_MAX_ROWS  64
static struct llmem_mem *dmem; /* device memory */

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void) { /* uniform in [-1, 1) */
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static float *random_floats(int64_t n, float scale) {
    float *p = malloc((size_t)n * sizeof(float));
    assert_non_null(p);
    for (int64_t i = 0; i < n; i++)
        p[i] = frand() * scale;
    return p;
}

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static uint16_t to_f16(float f) { /* normal range only, round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u, mant = u & 0x7fffffu;
    int e = (int)((u >> 23) & 0xff) - 127 + 15;
    if (e <= 0)
        return (uint16_t)sign;
    uint32_t m = mant >> 13, rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (m & 1)))
        m++;
    return (uint16_t)(sign | (((uint32_t)e << 10) + m));
}

/* A host weight [rows, cols] of dtype with random values, and its bytes. */
static void *random_weight(enum llmem_dtype dt, int64_t rows, int64_t cols, size_t *bytes) {
    *bytes = (size_t)(rows * cols) * (size_t)llmem_dtype_size(dt);
    void *w = malloc(*bytes);
    assert_non_null(w);
    for (int64_t i = 0; i < rows * cols; i++) {
        float v = frand() * 0.5f;
        if (dt == LLMEM_DTYPE_BF16)
            ((uint16_t *)w)[i] = to_bf16(v);
        else if (dt == LLMEM_DTYPE_F16)
            ((uint16_t *)w)[i] = to_f16(v);
        else
            ((float *)w)[i] = v;
    }
    return w;
}

/* host bytes → a new device buffer */
static void *to_device(const void *host, size_t bytes) {
    void *d = llmem_mem_alloc(dmem, bytes, LLMEM_TAG_SCRATCH);
    assert_non_null(d);
    assert_int_equal(gpu->ops->copy(gpu->ctx, d, host, bytes), LLMEM_OK);
    return d;
}

static float *to_host(const void *dev, int64_t n) {
    float *h = malloc((size_t)n * sizeof(float));
    assert_non_null(h);
    assert_int_equal(gpu->ops->copy(gpu->ctx, h, dev, (size_t)n * sizeof(float)), LLMEM_OK);
    return h;
}

/* max |a − b| / max(max |a|, tiny) */
/* max |a − b| / max |a|; infinite where b is not finite (fmax would pass over a NaN). */
static double rel_diff(const float *a, const float *b, int64_t n) {
    double d = 0, m = 1e-30;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(b[i]))
            return INFINITY;
        d = fmax(d, fabs((double)a[i] - (double)b[i]));
        m = fmax(m, fabs((double)a[i]));
    }
    return d / m;
}

/* ---- builds without CUDA ---------------------------------------------------------------------
 */

/* Whether a library whose file name holds `name` is mapped into this process. */
static int mapped(const char *name) {
    FILE *f = fopen("/proc/self/maps", "r");
    assert_non_null(f);
    char line[4096];
    int found = 0;
    while (!found && fgets(line, sizeof(line), f) != NULL)
        found = strstr(line, name) != NULL;
    fclose(f);
    return found;
}

/* cuBLAS is opened with the first CUDA backend, not at start: a CPU backend of a CUDA build does
 * not map it (cuBLASLt alone holds about 150 MB resident once loaded). Then the loader finds every
 * function it needs, with or without a GPU, and says the same the second time; a build without
 * CUDA has none to load. */
static void test_blas_opened_late(void **state) {
    (void)state;
    struct llmem_backend *c = NULL;
    assert_int_equal(llmem_backend_cpu_create(1, &c), LLMEM_OK);
    llmem_backend_destroy(c);
    assert_false(mapped("libcublas"));
    if (!llmem_backend_cuda_available()) {
        assert_int_equal(llmem_backend_cuda_blas_load(), LLMEM_EUNSUPPORTED);
        return;
    }
    assert_int_equal(llmem_backend_cuda_blas_load(), LLMEM_OK);
    assert_true(mapped("libcublasLt.so"));
    assert_int_equal(llmem_backend_cuda_blas_load(), LLMEM_OK);
}

static void test_build(void **state) {
    (void)state;
    struct llmem_backend *b = NULL;
    enum llmem_backend_precision p;
    assert_int_equal(llmem_backend_precision_parse("f32", &p), LLMEM_OK);
    assert_int_equal(p, LLMEM_PRECISION_F32);
    assert_int_equal(llmem_backend_precision_parse("fast", &p), LLMEM_OK);
    assert_int_equal(p, LLMEM_PRECISION_FAST);
    assert_int_equal(llmem_backend_precision_parse("fp8", &p), LLMEM_EINVAL);
    assert_string_equal(llmem_backend_precision_name(LLMEM_PRECISION_F32), "f32");
    if (!llmem_backend_cuda_available()) {
        assert_int_equal(llmem_backend_cuda_create(0, LLMEM_PRECISION_F32, NULL, &b),
                         LLMEM_EUNSUPPORTED);
        assert_null(b);
        assert_null(llmem_backend_cuda_memory(0));
        return;
    }
    int n = 0;
    llmem_backend_device_count(&n);
    assert_int_equal(llmem_backend_cuda_create(n, LLMEM_PRECISION_F32, NULL, &b), LLMEM_EINVAL);
    assert_null(b);
    assert_null(llmem_backend_cuda_memory(n));
    /* the CPU backend's memory is the host's */
    struct llmem_backend *c = NULL;
    assert_int_equal(llmem_backend_cpu_create(1, &c), LLMEM_OK);
    assert_ptr_equal(c->ops->memory(c->ctx), llmem_mem_host_ops());
    float a[3] = {1, 2, 3}, z[3] = {0};
    assert_int_equal(c->ops->copy(c->ctx, z, a, sizeof(a)), LLMEM_OK);
    assert_memory_equal(a, z, sizeof(a));
    assert_int_equal(c->ops->sync(c->ctx), LLMEM_OK);
    llmem_backend_destroy(c);
}

/* ---- device memory ---------------------------------------------------------------------------
 */

static void test_device_memory(void **state) {
    (void)state;
    struct llmem_mem_config cfg = {.ops = llmem_backend_cuda_memory(0),
                                   .memory_limit_bytes = 64 << 20,
                                   .cache_limit_bytes = 16 << 20};
    struct llmem_mem *m = NULL;
    assert_int_equal(llmem_mem_create(&cfg, &m), LLMEM_OK);
    void *a = llmem_mem_alloc(m, 40 << 20, LLMEM_TAG_KV);
    void *b = llmem_mem_alloc(m, 3 << 20, LLMEM_TAG_SCRATCH);
    assert_non_null(a);
    assert_non_null(b);
    assert_null(llmem_mem_alloc(m, 30 << 20, LLMEM_TAG_KV)); /* past the limit */
    assert_true(llmem_mem_active(m) >= (43 << 20));
    llmem_mem_free(m, b);
    assert_true(llmem_mem_cache_size(m) >= (3 << 20)); /* cached, not returned to the driver */
    void *c = llmem_mem_alloc(m, 3 << 20, LLMEM_TAG_SCRATCH);
    assert_ptr_equal(b, c); /* reused from the cache */
    assert_int_equal(llmem_mem_check(m), LLMEM_OK);
    /* the buffers are device memory: a copy through them comes back intact */
    uint8_t in[4096], out[4096];
    for (int i = 0; i < 4096; i++)
        in[i] = (uint8_t)(i * 7);
    assert_int_equal(gpu->ops->copy(gpu->ctx, c, in, sizeof(in)), LLMEM_OK);
    assert_int_equal(gpu->ops->copy(gpu->ctx, (uint8_t *)a + 12345, c, sizeof(in)), LLMEM_OK);
    assert_int_equal(gpu->ops->copy(gpu->ctx, out, (uint8_t *)a + 12345, sizeof(out)), LLMEM_OK);
    assert_memory_equal(in, out, sizeof(in));
    llmem_mem_free(m, a);
    llmem_mem_free(m, c);
    llmem_mem_clear_cache(m);
    assert_int_equal(llmem_mem_cache_size(m), 0);
    llmem_mem_destroy(m);
}

/* ---- the operations --------------------------------------------------------------------------
 */

/* rmsnorm equals the CPU's; add_rmsnorm equals add then rmsnorm, bit for bit. */
static void test_rmsnorm(void **state) {
    (void)state;
    const int64_t dims[] = {64, 2048, 5000};
    for (int d = 0; d < 3; d++) {
        const int64_t n = 7, dim = dims[d];
        float *x = random_floats(n * dim, 3.0f), *w = random_floats(dim, 1.0f);
        float *y = malloc((size_t)(n * dim) * 4);
        cpu->ops->rmsnorm(cpu->ctx, x, w, n, dim, 1e-6f, y);
        float *dx = to_device(x, (size_t)(n * dim) * 4), *dw = to_device(w, (size_t)dim * 4);
        gpu->ops->rmsnorm(gpu->ctx, dx, dw, n, dim, 1e-6f, dx); /* in place */
        float *g = to_host(dx, n * dim);
        double e = rel_diff(y, g, n * dim);
        printf("  rmsnorm dim %lld: %.2e\n", (long long)dim, e);
        assert_true(e <= 1e-6);
        /* the residual add fused in: the bits of add, then rmsnorm (res may be the output) */
        float *r = random_floats(n * dim, 2.0f);
        float *dx2 = to_device(x, (size_t)(n * dim) * 4), *dr = to_device(r, (size_t)(n * dim) * 4);
        float *dx3 = to_device(x, (size_t)(n * dim) * 4),
              *dr3 = to_device(r, (size_t)(n * dim) * 4);
        gpu->ops->add(gpu->ctx, dx2, dr, n * dim);
        gpu->ops->rmsnorm(gpu->ctx, dx2, dw, n, dim, 1e-6f, dr);
        gpu->ops->add_rmsnorm(gpu->ctx, dx3, dr3, dw, n, dim, 1e-6f, dr3);
        float *a1 = to_host(dx2, n * dim), *a2 = to_host(dx3, n * dim);
        float *b1 = to_host(dr, n * dim), *b2 = to_host(dr3, n * dim);
        assert_memory_equal(a1, a2, (size_t)(n * dim) * 4);
        assert_memory_equal(b1, b2, (size_t)(n * dim) * 4);
        llmem_mem_free(dmem, dx2), llmem_mem_free(dmem, dr), llmem_mem_free(dmem, dx3);
        llmem_mem_free(dmem, dr3);
        free(r), free(a1), free(a2), free(b1), free(b2);
        llmem_mem_free(dmem, dx), llmem_mem_free(dmem, dw);
        free(x), free(w), free(y), free(g);
    }
}

static void test_rope(void **state) {
    (void)state;
    const int hds[] = {64, 128};
    for (int k = 0; k < 2; k++) {
        const int64_t n = 9;
        const int heads = 4, hd = hds[k];
        float *x = random_floats(n * heads * hd, 2.0f), inv_freq[64];
        int64_t pos[9];
        for (int i = 0; i < hd / 2; i++)
            inv_freq[i] = (float)pow(500000.0, -2.0 * i / hd);
        for (int t = 0; t < n; t++)
            pos[t] = t * 4099 + 3; /* up to 32K: large angles */
        float *dx = to_device(x, (size_t)(n * heads * hd) * 4);
        cpu->ops->rope(cpu->ctx, x, n, heads, hd, pos, inv_freq);
        gpu->ops->rope(gpu->ctx, dx, n, heads, hd, pos, inv_freq);
        float *g = to_host(dx, n * heads * hd);
        double e = rel_diff(x, g, n * heads * hd);
        printf("  rope head_dim %d: %.2e\n", hd, e);
        assert_true(e <= 1e-6);
        /* q and k in one launch: the bits of one rope each (k with 2 heads) */
        float *k2 = random_floats(n * 2 * hd, 2.0f);
        float *dq = to_device(x, (size_t)(n * heads * hd) * 4),
              *dk = to_device(k2, (size_t)(n * 2 * hd) * 4);
        float *dq1 = to_device(x, (size_t)(n * heads * hd) * 4),
              *dk1 = to_device(k2, (size_t)(n * 2 * hd) * 4);
        gpu->ops->rope_qk(gpu->ctx, dq, dk, n, heads, 2, hd, pos, inv_freq);
        gpu->ops->rope(gpu->ctx, dq1, n, heads, hd, pos, inv_freq);
        gpu->ops->rope(gpu->ctx, dk1, n, 2, hd, pos, inv_freq);
        float *q_a = to_host(dq, n * heads * hd), *q_b = to_host(dq1, n * heads * hd);
        float *k_a = to_host(dk, n * 2 * hd), *k_b = to_host(dk1, n * 2 * hd);
        assert_memory_equal(q_a, q_b, (size_t)(n * heads * hd) * 4);
        assert_memory_equal(k_a, k_b, (size_t)(n * 2 * hd) * 4);
        llmem_mem_free(dmem, dq), llmem_mem_free(dmem, dk), llmem_mem_free(dmem, dq1);
        llmem_mem_free(dmem, dk1);
        free(k2), free(q_a), free(q_b), free(k_a), free(k_b);
        llmem_mem_free(dmem, dx);
        free(x), free(g);
    }
}

static void test_swiglu_add(void **state) {
    (void)state;
    const int64_t n = 100003;
    float *g = random_floats(n, 8.0f), *u = random_floats(n, 2.0f), *y = malloc((size_t)n * 4);
    float *dg = to_device(g, (size_t)n * 4), *du = to_device(u, (size_t)n * 4);
    cpu->ops->swiglu(cpu->ctx, g, u, n, y);
    gpu->ops->swiglu(gpu->ctx, dg, du, n, dg);
    float *r = to_host(dg, n);
    double e = rel_diff(y, r, n);
    printf("  swiglu: %.2e\n", e);
    assert_true(e <= 1e-6);
    free(r);
    /* add is exact (from the same y on both) */
    assert_int_equal(gpu->ops->copy(gpu->ctx, dg, y, (size_t)n * 4), LLMEM_OK);
    cpu->ops->add(cpu->ctx, y, u, n);
    gpu->ops->add(gpu->ctx, dg, du, n);
    r = to_host(dg, n);
    assert_memory_equal(y, r, (size_t)n * 4);
    llmem_mem_free(dmem, dg), llmem_mem_free(dmem, du);
    free(g), free(u), free(y), free(r);
}

static void test_embedding(void **state) {
    (void)state;
    const enum llmem_dtype dts[] = {LLMEM_DTYPE_BF16, LLMEM_DTYPE_F16, LLMEM_DTYPE_F32};
    for (int k = 0; k < 3; k++) {
        const int64_t vocab = 1000, dim = 96, n = 6;
        size_t bytes;
        void *table = random_weight(dts[k], vocab, dim, &bytes);
        void *dt = to_device(table, bytes);
        int32_t ids[6] = {0, 999, 17, 17, 500, 3};
        struct llmem_weight wh = {table, dts[k], vocab, dim, 0, NULL, NULL, 0},
                            wd = {dt, dts[k], vocab, dim, 0, NULL, NULL, 0};
        float *y = malloc((size_t)(n * dim) * 4);
        float *dy = llmem_mem_alloc(dmem, (size_t)(n * dim) * 4, LLMEM_TAG_SCRATCH);
        cpu->ops->embedding(cpu->ctx, &wh, ids, n, y);
        gpu->ops->embedding(gpu->ctx, &wd, ids, n, dy);
        float *g = to_host(dy, n * dim);
        assert_memory_equal(y, g, (size_t)(n * dim) * 4);
        llmem_mem_free(dmem, dt), llmem_mem_free(dmem, dy);
        free(table), free(y), free(g);
    }
}

/* x of n random rows through wh on the reference backend and wd on the GPU at f32 (err[0]) and
 * fast precision (err[1]): each output's largest difference relative to the largest output. */
static void gpu_vs_ref(struct llmem_backend *ref, const struct llmem_weight *wh,
                       const struct llmem_weight *wd, const float *bias, const float *dbias,
                       int64_t n, double err[2]) {
    const int64_t rows = wh->rows, cols = wh->cols;
    float *x = random_floats(n * cols, 1.0f), *y = malloc((size_t)(n * rows) * 4);
    float *dx = to_device(x, (size_t)(n * cols) * 4);
    float *dy = llmem_mem_alloc(dmem, (size_t)(n * rows) * 4, LLMEM_TAG_SCRATCH);
    ref->ops->matmul(ref->ctx, wh, x, n, y, bias);
    for (int p = 0; p < 2; p++) {
        struct llmem_backend *b = p == 0 ? gpu_f32 : gpu;
        b->ops->matmul(b->ctx, wd, dx, n, dy, dbias);
        assert_int_equal(b->ops->sync(b->ctx), LLMEM_OK);
        float *g = to_host(dy, n * rows);
        err[p] = rel_diff(y, g, n * rows);
        free(g);
    }
    llmem_mem_free(dmem, dx), llmem_mem_free(dmem, dy);
    free(x), free(y);
}

/* matmul for every weight dtype, decode and GEMM row counts, aligned and odd shapes, with and
 * without bias, at both precisions. */
static void test_matmul(void **state) {
    (void)state;
    const enum llmem_dtype dts[] = {LLMEM_DTYPE_BF16, LLMEM_DTYPE_F16, LLMEM_DTYPE_F32};
    const int64_t ns[] = {1, 3, 8, 9, 64};
    /* the last: rows long enough for two warps a row in the matrix-vector kernel */
    const int64_t shapes[][2] = {{300, 512}, {77, 100}, {1024, 2048}, {203, 8192}};
    double worst_f32 = 0, worst_fast = 0;
    for (int k = 0; k < 3; k++)
        for (int s = 0; s < 4; s++) {
            const int64_t rows = shapes[s][0], cols = shapes[s][1];
            size_t bytes;
            void *w = random_weight(dts[k], rows, cols, &bytes);
            void *dw = to_device(w, bytes);
            float *bias = random_floats(rows, 1.0f);
            float *dbias = to_device(bias, (size_t)rows * 4);
            struct llmem_weight wh = {w, dts[k], rows, cols, 0, NULL, NULL, 0},
                                wd = {dw, dts[k], rows, cols, 0, NULL, NULL, 0};
            for (int t = 0; t < 5; t++) {
                const int64_t n = ns[t];
                const int with_bias = (t + s) % 2;
                double err[2];
                gpu_vs_ref(cpu, &wh, &wd, with_bias ? bias : NULL, with_bias ? dbias : NULL, n,
                           err);
                for (int p = 0; p < 2; p++) {
                    const double e = err[p];
                    if (p == 0 || n <= GEMV_FAST_ROWS || dts[k] == LLMEM_DTYPE_F32) {
                        worst_f32 = fmax(worst_f32, e);
                        if (e > 1e-5)
                            fail_msg("f32 matmul %s %lldx%lld n %lld: %.3e",
                                     llmem_dtype_name(dts[k]), (long long)rows, (long long)cols,
                                     (long long)n, e);
                    } else {
                        worst_fast = fmax(worst_fast, e);
                        assert_true(e <= 1e-2);
                    }
                }
            }
            llmem_mem_free(dmem, dw), llmem_mem_free(dmem, dbias);
            free(w), free(bias);
        }
    printf("  matmul: f32 paths %.2e, fast GEMMs %.2e of the largest output\n", worst_f32,
           worst_fast);
    assert_true(worst_fast > 0); /* the fast GEMMs did round (the test would see a no-op) */
}

/* A host weight [rows, cols] of a quantized type with random values: GGUF blocks as the
 * quantizer writes them, or MLX codes with random scales and biases (*scales, *biases, *side
 * bytes each; else NULL). Returns the codes, *bytes of them. */
static void *random_quantized(int type, int64_t rows, int64_t cols, size_t *bytes, void **scales,
                              void **biases, size_t *side) {
    const int64_t row_bytes = llmem_qtype_bytes(type, cols);
    assert_true(row_bytes > 0);
    *bytes = (size_t)(rows * row_bytes);
    uint8_t *w = malloc(*bytes);
    assert_non_null(w);
    int bits, group, st;
    *scales = *biases = NULL;
    *side = 0;
    if (!llmem_qtype_mlx_params(type, &bits, &group, &st)) {
        float *v = random_floats(cols, 0.5f);
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t i = 0; i < cols; i++)
                v[i] = frand() * 0.5f;
            assert_int_equal(llmem_quant_quantize_row(type, v, w + r * row_bytes, cols), LLMEM_OK);
        }
        free(v);
        return w;
    }
    for (size_t i = 0; i < *bytes; i++)
        w[i] = (uint8_t)(frand() * 128 + 128);
    const int64_t groups = rows * (cols / group);
    const size_t size = st == LLMEM_QTYPE_F32 ? 4 : 2;
    *side = (size_t)groups * size;
    uint8_t *sb[2] = {malloc(*side), malloc(*side)};
    for (int k = 0; k < 2; k++) {
        assert_non_null(sb[k]);
        for (int64_t g = 0; g < groups; g++) {
            const float v = k == 0 ? frand() * 0.05f : frand() * 0.5f;
            const uint16_t h = st == LLMEM_QTYPE_BF16 ? to_bf16(v) : to_f16(v);
            if (st == LLMEM_QTYPE_F32)
                memcpy(sb[k] + 4 * g, &v, 4);
            else
                memcpy(sb[k] + 2 * g, &h, 2);
        }
    }
    *scales = sb[0], *biases = sb[1];
    return w;
}

/* Quantized weights, every block type llmem reads and MLX's groups: the embedding's rows are the
 * CPU's bit for bit; matmul at f32 precision (and the matrix-vector kernel of the types without
 * integer products at fast precision) give the CPU's exact f32 products within the order of the
 * sums (1e-5 of the largest output); the fast GEMMs (weights and x in f16) within 1e-2, the
 * integer products (x in 8 bits) within 2e-2. Rows of an odd count of blocks put every other row of
 * the 2-byte-aligned types off a word. */
static void test_matmul_quantized(void **state) {
    (void)state;
    const int types[] = {LLMEM_QTYPE_Q4_0,
                         LLMEM_QTYPE_Q4_1,
                         LLMEM_QTYPE_Q5_0,
                         LLMEM_QTYPE_Q5_1,
                         LLMEM_QTYPE_Q8_0,
                         LLMEM_QTYPE_Q2_K,
                         LLMEM_QTYPE_Q3_K,
                         LLMEM_QTYPE_Q4_K,
                         LLMEM_QTYPE_Q5_K,
                         LLMEM_QTYPE_Q6_K,
                         llmem_qtype_mlx(4, 64, LLMEM_QTYPE_BF16),
                         llmem_qtype_mlx(8, 32, LLMEM_QTYPE_F16),
                         llmem_qtype_mlx(4, 128, LLMEM_QTYPE_F32)};
    /* (9, 24 and 40 rows: the tensor-core kernels' instances of 2, 4 and 8 tiles of x) */
    const int64_t ns[] = {1, 3, 8, 9, 24, 40};
    /* (4,352 columns: rows long enough for the integer kernel's batches of units and a tail;
     * 1,120 columns, the 32-value types only: 35 blocks a row, so that Q8_0's and Q4_0's rows start
     * at every even offset from a 16-byte line and end in a chunk of 3 units) */
    const int64_t shapes[][2] = {{77, 768}, {300, 1280}, {160, 4352}, {45, 1120}};
    struct llmem_backend *ref = NULL; /* the CPU's exact path: blocks dequantized to f32 */
    assert_int_equal(llmem_backend_cpu_create(2, &ref), LLMEM_OK);
    llmem_backend_cpu_set_precision(ref, LLMEM_PRECISION_F32);
    double worst_f32 = 0, worst_fast = 0;
    for (size_t k = 0; k < sizeof(types) / sizeof(types[0]); k++)
        for (int s = 0; s < 4; s++) {
            const int64_t rows = shapes[s][0], cols = shapes[s][1];
            if (cols % 256 != 0 && (types[k] < LLMEM_QTYPE_Q4_0 || types[k] > LLMEM_QTYPE_Q8_0))
                continue;
            size_t bytes, side;
            void *scales, *biases;
            void *w = random_quantized(types[k], rows, cols, &bytes, &scales, &biases, &side);
            struct llmem_weight wh = {w, LLMEM_DTYPE_F32, rows, cols, types[k], scales, biases, 0};
            struct llmem_weight wd = wh;
            wd.data = to_device(w, bytes);
            if (side > 0)
                wd.scales = to_device(scales, side), wd.biases = to_device(biases, side);
            float *bias = random_floats(rows, 1.0f);
            float *dbias = to_device(bias, (size_t)rows * 4);
            /* the embedding: rows as the CPU dequantizes them */
            int32_t ids[5] = {0, (int32_t)rows - 1, 17, 17, 40};
            float *e = malloc((size_t)(5 * cols) * 4);
            float *de = llmem_mem_alloc(dmem, (size_t)(5 * cols) * 4, LLMEM_TAG_SCRATCH);
            ref->ops->embedding(ref->ctx, &wh, ids, 5, e);
            gpu->ops->embedding(gpu->ctx, &wd, ids, 5, de);
            float *ge = to_host(de, 5 * cols);
            if (memcmp(e, ge, (size_t)(5 * cols) * 4) != 0)
                fail_msg("embedding of %s differs from the CPU's", llmem_qtype_name(types[k]));
            free(e), free(ge), llmem_mem_free(dmem, de);
            for (int t = 0; t < 6; t++) {
                const int64_t n = ns[t];
                const int with_bias = (t + s) % 2;
                double e2[2];
                gpu_vs_ref(ref, &wh, &wd, with_bias ? bias : NULL, with_bias ? dbias : NULL, n, e2);
                for (int p = 0; p < 2; p++) {
                    const double err = e2[p];
                    /* at fast precision the CPU's integer types multiply integers with x
                     * quantized to 8 bits up to 64 rows (ops_int.h QGEMV_MAX_ROWS, QMMA_MAX_ROWS:
                     * the matrix-vector kernel, then the tensor cores), the others in f32 up to 8
                     * rows; more rows take the f16 GEMMs */
                    const int integer =
                        types[k] == LLMEM_QTYPE_Q8_0 || types[k] == LLMEM_QTYPE_Q4_0 ||
                        types[k] == LLMEM_QTYPE_Q4_K || types[k] == LLMEM_QTYPE_Q5_K ||
                        types[k] == LLMEM_QTYPE_Q6_K;
                    const int exact = p == 0 || (n <= 8 && !integer);
                    /* (the integer products: codes unsigned, Q6_K's up to 63, against x's
                     * rounding to 8 bits; one sample of the 77 × 768 Q6_K matrix reached 1.08e-2
                     * of its largest output) */
                    const double bound = exact                                ? 1e-5
                                         : n <= (integer ? QMMA_MAX_ROWS : 8) ? 2e-2
                                                                              : 1e-2;
                    if (exact)
                        worst_f32 = fmax(worst_f32, err);
                    else
                        worst_fast = fmax(worst_fast, err);
                    if (!(err <= bound))
                        fail_msg("%s matmul %s %lldx%lld n %lld: %.3e", p == 0 ? "f32" : "fast",
                                 llmem_qtype_name(types[k]), (long long)rows, (long long)cols,
                                 (long long)n, err);
                }
            }
            llmem_mem_free(dmem, (void *)wd.data), llmem_mem_free(dmem, dbias);
            if (side > 0)
                llmem_mem_free(dmem, (void *)wd.scales), llmem_mem_free(dmem, (void *)wd.biases);
            free(w), free(bias), free(scales), free(biases);
        }
    printf("  quantized matmul: f32 paths %.2e, fast paths %.2e of the largest output\n", worst_f32,
           worst_fast);
    assert_true(worst_fast > 0);
    llmem_backend_destroy(ref);
}

/* A stack of n matrices [rows, cols] of a type (a float dtype when type is 0), one after the
 * other in one buffer as model/device.c uploads a layer's experts: the host's and the device's
 * views of each (freed by free_stack). */
struct stack {
    struct llmem_weight *host, *dev; /* n each */
    void *h[3], *d[3];               /* codes, scales, biases */
};

static void make_stack(int type, int64_t n, int64_t rows, int64_t cols, struct stack *s) {
    size_t bytes, side = 0;
    void *scales = NULL, *biases = NULL;
    memset(s, 0, sizeof(*s));
    s->h[0] = type != 0 ? random_quantized(type, n * rows, cols, &bytes, &scales, &biases, &side)
                        : random_weight(LLMEM_DTYPE_BF16, n * rows, cols, &bytes);
    s->h[1] = scales, s->h[2] = biases;
    s->host = calloc((size_t)n, sizeof(*s->host)), s->dev = calloc((size_t)n, sizeof(*s->dev));
    assert_true(s->host != NULL && s->dev != NULL);
    s->d[0] = to_device(s->h[0], bytes);
    if (side > 0)
        s->d[1] = to_device(scales, side), s->d[2] = to_device(biases, side);
    for (int64_t e = 0; e < n; e++) {
        const struct llmem_weight w = {s->h[0], LLMEM_DTYPE_BF16, rows, cols, type, NULL, NULL, 0};
        const size_t at = (size_t)(e * rows * llmem_weight_row_bytes(&w)), sat = side / (size_t)n;
        for (int v = 0; v < 2; v++) {
            struct llmem_weight *o = v == 0 ? &s->host[e] : &s->dev[e];
            uint8_t *const *b = (uint8_t *const *)(v == 0 ? s->h : s->d);
            *o = w;
            o->data = b[0] + at;
            o->scales = side > 0 ? b[1] + e * sat : NULL;
            o->biases = side > 0 ? b[2] + e * sat : NULL;
        }
    }
}

static void free_stack(struct stack *s) {
    for (int i = 0; i < 3; i++)
        free(s->h[i]), llmem_mem_free(dmem, s->d[i]);
    free(s->host), free(s->dev);
}

/* A mixture of E experts of one weight type (bf16 when type is 0) against the CPU's at f32
 * precision, top k of E for each T of Ts, renormalized or not (norms: 1 or 2 runs), in place
 * (y = x) or not: the CPU's routing, and its outputs within bound[p] of the largest output (p 0:
 * f32 precision, 1: fast); the worst errors into worst[]. */
static void moe_case(struct llmem_backend *ref, int type, int64_t E, int64_t hidden, int64_t inter,
                     const int64_t *ks, int nk, const int64_t *Ts, int nT, const double *bound,
                     double *worst) {
    struct stack g, u, d;
    make_stack(type, E, inter, hidden, &g);
    make_stack(type, E, inter, hidden, &u);
    make_stack(type, E, hidden, inter, &d);
    for (int ki = 0; ki < nk; ki++) {
        struct llmem_backend_moe mh = {E, ks[ki], ki == 0, g.host, u.host, d.host};
        struct llmem_backend_moe md = {E, ks[ki], ki == 0, g.dev, u.dev, d.dev};
        for (int t = 0; t < nT; t++) {
            const int64_t T = Ts[t];
            const size_t wb = (size_t)llmem_moe_work_layout(T, hidden, inter, E, mh.k, NULL, NULL);
            float *logits = random_floats(T * E, 3.0f), *x = random_floats(T * hidden, 1.0f);
            float *y = malloc((size_t)(T * hidden) * 4);
            void *work = aligned_alloc(64, (wb + 63) / 64 * 64);
            assert_non_null(y), assert_non_null(work);
            ref->ops->moe(ref->ctx, &mh, logits, x, T, y, work);
            float *dl = to_device(logits, (size_t)(T * E) * 4);
            void *dw = llmem_mem_alloc(dmem, wb, LLMEM_TAG_SCRATCH);
            assert_non_null(dw);
            for (int p = 0; p < 2; p++) {
                struct llmem_backend *b = p == 0 ? gpu_f32 : gpu;
                float *dx = to_device(x, (size_t)(T * hidden) * 4);
                float *dy = (t + p) % 2 == 0 ? dx
                                             : llmem_mem_alloc(dmem, (size_t)(T * hidden) * 4,
                                                               LLMEM_TAG_SCRATCH);
                b->ops->moe(b->ctx, &md, dl, dx, T, dy, dw);
                assert_int_equal(b->ops->sync(b->ctx), LLMEM_OK);
                float *gy = to_host(dy, T * hidden);
                int32_t *ids = malloc((size_t)(T * mh.k) * 4), *href = work;
                assert_non_null(ids);
                assert_int_equal(b->ops->copy(b->ctx, ids, dw, (size_t)(T * mh.k) * 4), LLMEM_OK);
                assert_memory_equal(ids, href, (size_t)(T * mh.k) * 4);
                const double err = rel_diff(y, gy, T * hidden);
                worst[p] = fmax(worst[p], err);
                if (err > bound[p])
                    fail_msg("moe %s %s E %lld k %lld T %lld: %.3e", p == 0 ? "f32" : "fast",
                             type != 0 ? llmem_qtype_name(type) : "bf16", (long long)E,
                             (long long)mh.k, (long long)T, err);
                free(gy), free(ids);
                if (dy != dx)
                    llmem_mem_free(dmem, dy);
                llmem_mem_free(dmem, dx);
            }
            llmem_mem_free(dmem, dl), llmem_mem_free(dmem, dw);
            free(logits), free(x), free(y), free(work);
        }
    }
    free_stack(&g), free_stack(&u), free_stack(&d);
}

/* The mixture of experts: every weight type's stacks (bf16, three GGUF block types, MLX 4-bit),
 * top 3 of 8 renormalized and top 2 not, for a decode's pairs (unsorted), a batch's (sorted) and
 * a prefill's (the GEMMs), in place (y = x) or not: the CPU's routing, and its outputs within the
 * matmuls' bounds (f32 precision 1e-5 of the largest output; fast 4e-2: two products in a row, the
 * K types' x one scale a 256 values from 9 rows on, as the CPU's fast path; Q6_K reached
 * 3.09e-2). Wider experts at Q8_0 and Q6_K, a decode and a batch: rows of 2,048, 1,280 and 768
 * values, so that a lane takes two units of a row, one and a part, or one with lanes idle. Then
 * 200 and 1,000 experts, top 8 (the routing's registers: 8 and 32 logits a lane), for a decode
 * and a batch. */
static void test_moe(void **state) {
    (void)state;
    const int types[] = {0, LLMEM_QTYPE_Q8_0, LLMEM_QTYPE_Q4_K, LLMEM_QTYPE_Q6_K,
                         llmem_qtype_mlx(4, 64, LLMEM_QTYPE_BF16)};
    const int64_t Ts[] = {1, 5, 20, 150}, ks[] = {3, 2}, many_ks[] = {8}, many_Ts[] = {1, 5},
                  wide_Ts[] = {1, 20};
    const double bound[2] = {1e-5, 4e-2};
    struct llmem_backend *ref = NULL;
    assert_int_equal(llmem_backend_cpu_create(2, &ref), LLMEM_OK);
    llmem_backend_cpu_set_precision(ref, LLMEM_PRECISION_F32);
    double worst[2] = {0, 0};
    for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++)
        moe_case(ref, types[ti], 8, 512, 256, ks, 2, Ts, 4, bound, worst);
    moe_case(ref, LLMEM_QTYPE_Q8_0, 8, 2048, 768, ks, 2, wide_Ts, 2, bound, worst);
    moe_case(ref, LLMEM_QTYPE_Q6_K, 8, 1280, 768, ks, 1, wide_Ts, 2, bound, worst);
    moe_case(ref, 0, 200, 256, 64, many_ks, 1, many_Ts, 2, bound, worst);
    moe_case(ref, 0, 1000, 256, 32, many_ks, 1, many_Ts, 2, bound, worst);
    printf("  moe: f32 %.2e, fast %.2e of the largest output\n", worst[0], worst[1]);
    llmem_backend_destroy(ref);
}

/* Three matrices of one x in one launch (q, k, v with biases), and a set that cannot go together
 * (mixed dtypes) one by one: each equals the CPU's; with more rows (the GEMMs, x rounded once for
 * all three), each equals the GPU's own matmul bit for bit. */
static void test_matmul_multi(void **state) {
    (void)state;
    const int64_t cols = 512, rows[3] = {256, 64, 72};
    const enum llmem_dtype mixed[3] = {LLMEM_DTYPE_BF16, LLMEM_DTYPE_F16, LLMEM_DTYPE_F32};
    for (int mix = 0; mix < 2; mix++)
        for (int ni = 0; ni < 3; ni++) {
            const int64_t n = ni == 0 ? 1 : ni == 1 ? 5 : 33;
            void *w[3], *dw[3];
            float *b[3], *db[3], *y[3], *dy[3];
            struct llmem_weight wh[3], wd[3];
            const struct llmem_weight *ph[3], *pd[3];
            float *x = random_floats(n * cols, 1.0f), *dx = to_device(x, (size_t)(n * cols) * 4);
            for (int i = 0; i < 3; i++) {
                size_t bytes;
                enum llmem_dtype dt = mix ? mixed[i] : LLMEM_DTYPE_BF16;
                w[i] = random_weight(dt, rows[i], cols, &bytes);
                dw[i] = to_device(w[i], bytes);
                b[i] = random_floats(rows[i], 1.0f);
                db[i] = to_device(b[i], (size_t)rows[i] * 4);
                y[i] = malloc((size_t)(n * rows[i]) * 4);
                dy[i] = llmem_mem_alloc(dmem, (size_t)(n * rows[i]) * 4, LLMEM_TAG_SCRATCH);
                wh[i] = (struct llmem_weight){w[i], dt, rows[i], cols, 0, NULL, NULL, 0};
                wd[i] = (struct llmem_weight){dw[i], dt, rows[i], cols, 0, NULL, NULL, 0};
                ph[i] = &wh[i], pd[i] = &wd[i];
            }
            cpu->ops->matmul_multi(cpu->ctx, 3, ph, x, n, y, (const float *const *)b);
            gpu->ops->matmul_multi(gpu->ctx, 3, pd, dx, n, dy, (const float *const *)db);
            for (int i = 0; i < 3; i++) {
                float *g = to_host(dy[i], n * rows[i]);
                if (n <= GEMV_FAST_ROWS) {
                    assert_true(rel_diff(y[i], g, n * rows[i]) <= 1e-5);
                } else {
                    gpu->ops->matmul(gpu->ctx, pd[i], dx, n, dy[i], db[i]);
                    float *one = to_host(dy[i], n * rows[i]);
                    assert_memory_equal(one, g, (size_t)(n * rows[i]) * 4);
                    assert_true(rel_diff(y[i], g, n * rows[i]) <= 2e-2);
                    free(one);
                }
                free(g), free(w[i]), free(b[i]), free(y[i]);
                llmem_mem_free(dmem, dw[i]), llmem_mem_free(dmem, db[i]);
                llmem_mem_free(dmem, dy[i]);
            }
            llmem_mem_free(dmem, dx);
            free(x);
        }
}

/* Quantized matrices of one x at fast precision (q, k and v of mixed integer types, gate and up):
 * matmul_multi's one launch gives each matrix's own matmul bit for bit, and matmul_swiglu gives
 * matmul_multi then swiglu bit for bit, for a decode's rows of x (launches of up to 4) and a
 * batch's (the tensor cores' integer products); a row's products do not depend on the rows beside
 * it. Rows of 2,304 and 4,352 values: Q4_K at one row of x streams the short ones. */
static void test_quantized_sets(void **state) {
    (void)state;
    const int64_t rows[3] = {300, 40, 72}, ns[4] = {1, 3, 6, 45};
    for (int c = 0; c < 2; c++) {
        const int64_t cols = c == 0 ? 2304 : 4352;
        const int types[3] = {LLMEM_QTYPE_Q4_K, LLMEM_QTYPE_Q8_0, LLMEM_QTYPE_Q6_K};
        struct llmem_weight wd[3], wh[3];
        const struct llmem_weight *pd[3];
        void *w[3];
        for (int i = 0; i < 3; i++) {
            size_t bytes, side;
            void *scales, *biases;
            w[i] = random_quantized(types[i], rows[i], cols, &bytes, &scales, &biases, &side);
            wd[i] = (struct llmem_weight){
                to_device(w[i], bytes), LLMEM_DTYPE_F32, rows[i], cols, types[i], NULL, NULL, 0};
            wh[i] = wd[i], wh[i].data = w[i];
            pd[i] = &wd[i];
        }
        for (int k = 0; k < 4; k++) {
            const int64_t n = ns[k];
            float *x = random_floats(n * cols, 1.0f), *dx = to_device(x, (size_t)(n * cols) * 4);
            float *dy[3],
                *one = llmem_mem_alloc(dmem, (size_t)(n * rows[0]) * 4, LLMEM_TAG_SCRATCH);
            for (int i = 0; i < 3; i++)
                dy[i] = llmem_mem_alloc(dmem, (size_t)(n * rows[i]) * 4, LLMEM_TAG_SCRATCH);
            gpu->ops->matmul_multi(gpu->ctx, 3, pd, dx, n, dy, NULL);
            for (int i = 0; i < 3; i++) {
                gpu->ops->matmul(gpu->ctx, pd[i], dx, n, one, NULL);
                float *a = to_host(dy[i], n * rows[i]), *b = to_host(one, n * rows[i]);
                assert_memory_equal(a, b, (size_t)(n * rows[i]) * 4);
                cpu->ops->matmul(cpu->ctx, &wh[i], x, n, b, NULL); /* (x in 8 bits or f16: 1e-2) */
                assert_true(rel_diff(b, a, n * rows[i]) <= 1e-2);
                for (int64_t t = 0; n <= QGEMV_MAX_ROWS && t < n; t += 2) { /* row t alone */
                    gpu->ops->matmul(gpu->ctx, pd[i], dx + t * cols, 1, one, NULL);
                    float *alone = to_host(one, rows[i]);
                    assert_memory_equal(a + t * rows[i], alone, (size_t)rows[i] * 4);
                    free(alone);
                }
                if (n > QGEMV_MAX_ROWS) { /* the tensor cores: the last 9 rows by themselves */
                    const int64_t t = n - (QGEMV_MAX_ROWS + 1);
                    gpu->ops->matmul(gpu->ctx, pd[i], dx + t * cols, QGEMV_MAX_ROWS + 1, one, NULL);
                    float *few = to_host(one, (QGEMV_MAX_ROWS + 1) * rows[i]);
                    assert_memory_equal(a + t * rows[i], few,
                                        (size_t)((QGEMV_MAX_ROWS + 1) * rows[i]) * 4);
                    free(few);
                }
                free(a), free(b);
            }
            /* gate and up: the Q4_K matrix twice, then Q6_K's */
            for (int p = 0; p < 2; p++) {
                const struct llmem_weight *gu = p == 0 ? &wd[0] : &wd[2];
                const struct llmem_weight *pair[2] = {gu, gu};
                const int64_t r = gu->rows;
                float *y[2] = {dy[0], one};
                float *o = llmem_mem_alloc(dmem, (size_t)(n * r) * 4, LLMEM_TAG_SCRATCH);
                gpu->ops->matmul_multi(gpu->ctx, 2, pair, dx, n, y, NULL);
                gpu->ops->swiglu(gpu->ctx, y[0], y[1], n * r, y[0]);
                float *want = to_host(y[0], n * r);
                gpu->ops->matmul_swiglu(gpu->ctx, gu, gu, dx, n, y[0], y[1], o);
                float *got = to_host(o, n * r);
                assert_memory_equal(want, got, (size_t)(n * r) * 4);
                free(want), free(got), llmem_mem_free(dmem, o);
            }
            for (int i = 0; i < 3; i++)
                llmem_mem_free(dmem, dy[i]);
            llmem_mem_free(dmem, one), llmem_mem_free(dmem, dx);
            free(x);
        }
        for (int i = 0; i < 3; i++)
            llmem_mem_free(dmem, (void *)wd[i].data), free(w[i]);
    }
}

/* Two matrices in one buffer (the second right after the first, as a device model's k and v,
 * gate and up) into outputs a fixed stride apart: one batched GEMM, the results of two. */
static void test_matmul_pair(void **state) {
    (void)state;
    const int64_t rows = 96, cols = 512, ns[2] = {33, 130}, stride = 130 * 96 + 64;
    size_t bytes;
    void *w = random_weight(LLMEM_DTYPE_BF16, 2 * rows, cols, &bytes); /* both, one buffer */
    uint8_t *dw = to_device(w, bytes);
    const struct llmem_weight pair[2] = {
        {dw, LLMEM_DTYPE_BF16, rows, cols, 0, NULL, NULL, 0},
        {dw + bytes / 2, LLMEM_DTYPE_BF16, rows, cols, 0, NULL, NULL, 0}};
    const struct llmem_weight host[2] = {
        {w, LLMEM_DTYPE_BF16, rows, cols, 0, NULL, NULL, 0},
        {(uint8_t *)w + bytes / 2, LLMEM_DTYPE_BF16, rows, cols, 0, NULL, NULL, 0}};
    assert_true(llmem_weight_follows(&pair[0], &pair[1]));
    const struct llmem_weight *pp[2] = {&pair[0], &pair[1]};
    float *dy = llmem_mem_alloc(dmem, (size_t)(2 * stride) * 4, LLMEM_TAG_SCRATCH);
    float *dz = llmem_mem_alloc(dmem, (size_t)(130 * rows) * 4, LLMEM_TAG_SCRATCH);
    for (int k = 0; k < 2; k++) {
        const int64_t n = ns[k];
        float *x = random_floats(n * cols, 1.0f), *dx = to_device(x, (size_t)(n * cols) * 4);
        float *out[2] = {dy, dy + stride};
        gpu->ops->matmul_multi(gpu->ctx, 2, pp, dx, n, out, NULL);
        for (int i = 0; i < 2; i++) {
            float *g = to_host(out[i], n * rows), *ref = malloc((size_t)(n * rows) * 4);
            cpu->ops->matmul(cpu->ctx, &host[i], x, n, ref, NULL);
            gpu->ops->matmul(gpu->ctx, &pair[i], dx, n, dz, NULL);
            float *one = to_host(dz, n * rows);
            assert_true(rel_diff(one, g, n * rows) <= 1e-5); /* f32 sums in another order */
            assert_true(rel_diff(ref, g, n * rows) <= 2e-2); /* x rounded to bf16 */
            free(g), free(ref), free(one);
        }
        llmem_mem_free(dmem, dx);
        free(x);
    }
    llmem_mem_free(dmem, dy), llmem_mem_free(dmem, dz), llmem_mem_free(dmem, dw);
    free(w);
}

/* matmul_swiglu gives the bits of matmul_multi and swiglu: one and two warps a row (2,048 and
 * 4,096 columns), rows not a multiple of the block's, x rows in launches of up to 4, both 16-bit
 * types, and a batch past the GEMV (the GEMMs). */
static void test_matmul_swiglu(void **state) {
    (void)state;
    const int64_t rows = 102, colss[2] = {2048, 4096}, ns[4] = {1, 3, 5, 33};
    const enum llmem_dtype dts[2] = {LLMEM_DTYPE_BF16, LLMEM_DTYPE_F16};
    for (int ci = 0; ci < 2; ci++)
        for (int di = 0; di < 2; di++) {
            const int64_t cols = colss[ci];
            size_t bytes;
            void *w = random_weight(dts[di], 2 * rows, cols, &bytes);
            uint8_t *dw = to_device(w, bytes);
            const struct llmem_weight gate = {dw, dts[di], rows, cols, 0, NULL, NULL, 0},
                                      up = {dw + bytes / 2, dts[di], rows, cols, 0, NULL, NULL, 0};
            const struct llmem_weight *pair[2] = {&gate, &up};
            for (int k = 0; k < 4; k++) {
                const int64_t n = ns[k];
                float *x = random_floats(n * cols, 1.0f),
                      *dx = to_device(x, (size_t)(n * cols) * 4);
                float *g = llmem_mem_alloc(dmem, (size_t)(n * rows) * 4, LLMEM_TAG_SCRATCH),
                      *u = llmem_mem_alloc(dmem, (size_t)(n * rows) * 4, LLMEM_TAG_SCRATCH),
                      *o = llmem_mem_alloc(dmem, (size_t)(n * rows) * 4, LLMEM_TAG_SCRATCH);
                float *y[2] = {g, u};
                gpu->ops->matmul_multi(gpu->ctx, 2, pair, dx, n, y, NULL);
                gpu->ops->swiglu(gpu->ctx, g, u, n * rows, g);
                float *want = to_host(g, n * rows);
                gpu->ops->matmul_swiglu(gpu->ctx, &gate, &up, dx, n, g, u, o);
                float *got = to_host(o, n * rows);
                assert_memory_equal(want, got, (size_t)(n * rows) * 4);
                llmem_mem_free(dmem, dx), llmem_mem_free(dmem, g), llmem_mem_free(dmem, u);
                llmem_mem_free(dmem, o);
                free(x), free(want), free(got);
            }
            llmem_mem_free(dmem, dw);
            free(w);
        }
}

/* An rmsnorm's or a matmul_swiglu's output for a fast GEMM right after it: the operation writes
 * its 16-bit copy as it goes (no rounding kernel of its own), and the GEMM gives the bits of one
 * that rounds the same values separately. */
static void test_shadow_copies(void **state) {
    (void)state;
    const int64_t rows = 96, cols = 1024, ns[2] = {GEMV_FAST_ROWS, 40};
    size_t bytes;
    void *w = random_weight(LLMEM_DTYPE_BF16, rows, cols, &bytes);
    void *dw = to_device(w, bytes);
    const struct llmem_weight wd = {dw, LLMEM_DTYPE_BF16, rows, cols, 0, NULL, NULL, 0};
    size_t pair_bytes; /* gate and up: rows of cols, for the GEMM of cols above */
    void *wp = random_weight(LLMEM_DTYPE_BF16, 2 * cols, cols, &pair_bytes);
    uint8_t *dwp = to_device(wp, pair_bytes);
    const struct llmem_weight
        gate = {dwp, LLMEM_DTYPE_BF16, cols, cols, 0, NULL, NULL, 0},
        up = {dwp + pair_bytes / 2, LLMEM_DTYPE_BF16, cols, cols, 0, NULL, NULL, 0};
    for (int k = 0; k < 2; k++) {
        const int64_t n = ns[k];
        float *x = random_floats(n * cols, 1.0f), *r = random_floats(n * cols, 1.0f);
        float *nw = random_floats(cols, 1.0f);
        float *dx = to_device(x, (size_t)(n * cols) * 4),
              *dr = to_device(r, (size_t)(n * cols) * 4);
        float *dnw = to_device(nw, (size_t)cols * 4);
        float *dy = llmem_mem_alloc(dmem, (size_t)(n * cols) * 4, LLMEM_TAG_SCRATCH),
              *dy2 = llmem_mem_alloc(dmem, (size_t)(n * cols) * 4, LLMEM_TAG_SCRATCH),
              *out = llmem_mem_alloc(dmem, (size_t)(n * rows) * 4, LLMEM_TAG_SCRATCH),
              *g = llmem_mem_alloc(dmem, (size_t)(n * cols) * 4, LLMEM_TAG_SCRATCH),
              *u = llmem_mem_alloc(dmem, (size_t)(n * cols) * 4, LLMEM_TAG_SCRATCH);
        gpu->ops->matmul(gpu->ctx, &wd, dx, n, out, NULL); /* this width's first GEMM */
        for (int op = 0; op < 3; op++) {
            struct llmem_backend_counters c0, c1;
            gpu->ops->counters(gpu->ctx, &c0);
            if (op == 0)
                gpu->ops->rmsnorm(gpu->ctx, dx, dnw, n, cols, 1e-5f, dy);
            else if (op == 1)
                gpu->ops->add_rmsnorm(gpu->ctx, dx, dr, dnw, n, cols, 1e-5f, dy);
            else
                gpu->ops->matmul_swiglu(gpu->ctx, &gate, &up, dx, n, g, u, dy);
            gpu->ops->matmul(gpu->ctx, &wd, dy, n, out, NULL);
            gpu->ops->counters(gpu->ctx, &c1);
            float *got = to_host(out, n * rows);
            /* the same values in another buffer: rounded by a kernel of their own */
            assert_int_equal(gpu->ops->copy(gpu->ctx, dy2, dy, (size_t)(n * cols) * 4), LLMEM_OK);
            gpu->ops->matmul(gpu->ctx, &wd, dy2, n, out, NULL);
            float *want = to_host(out, n * rows);
            assert_memory_equal(want, got, (size_t)(n * rows) * 4);
            /* GEMMs round x; only matmul_swiglu's own input is rounded */
            printf("  %s, %lld rows: %lld rounding kernels\n",
                   op == 0   ? "rmsnorm"
                   : op == 1 ? "add_rmsnorm"
                             : "matmul_swiglu",
                   (long long)n, (long long)(c1.rounds - c0.rounds));
            assert_int_equal(c1.rounds - c0.rounds, n > GEMV_FAST_ROWS && op == 2 ? 1 : 0);
            free(got), free(want);
        }
        llmem_mem_free(dmem, dx), llmem_mem_free(dmem, dr), llmem_mem_free(dmem, dnw);
        llmem_mem_free(dmem, dy), llmem_mem_free(dmem, dy2), llmem_mem_free(dmem, out);
        llmem_mem_free(dmem, g), llmem_mem_free(dmem, u);
        free(x), free(r), free(nw);
    }
    llmem_mem_free(dmem, dw), llmem_mem_free(dmem, dwp);
    free(w), free(wp);
}

/* Scratch beyond the allocator's limit: the operation is skipped and every later sync says why. */
static void test_out_of_memory(void **state) {
    (void)state;
    struct llmem_mem_config cfg = {.ops = llmem_backend_cuda_memory(0),
                                   .memory_limit_bytes = 1 << 20};
    struct llmem_mem *m = NULL;
    assert_int_equal(llmem_mem_create(&cfg, &m), LLMEM_OK);
    struct llmem_backend *b = NULL;
    assert_int_equal(llmem_backend_cuda_create(0, LLMEM_PRECISION_FAST, m, &b), LLMEM_OK);
    const int64_t rows = 64, cols = 4096, n = 512; /* x rounded to bf16: 4 MiB of scratch */
    size_t bytes;
    void *w = random_weight(LLMEM_DTYPE_BF16, rows, cols, &bytes);
    void *dw = to_device(w, bytes);
    float *dx = llmem_mem_alloc(dmem, (size_t)(n * cols) * 4, LLMEM_TAG_SCRATCH);
    float *dy = llmem_mem_alloc(dmem, (size_t)(n * rows) * 4, LLMEM_TAG_SCRATCH);
    struct llmem_weight wd = {dw, LLMEM_DTYPE_BF16, rows, cols, 0, NULL, NULL, 0};
    b->ops->matmul(b->ctx, &wd, dx, n, dy, NULL);
    assert_int_equal(b->ops->sync(b->ctx), LLMEM_ENOMEM);
    assert_int_equal(b->ops->sync(b->ctx), LLMEM_ENOMEM);
    llmem_backend_destroy(b);
    llmem_mem_destroy(m);
    llmem_mem_free(dmem, dw), llmem_mem_free(dmem, dx), llmem_mem_free(dmem, dy);
    free(w);
}

/* ---- the paged KV cache on the device ---------------------------------------------------------
 */

/* The same writes into a host cache and a device cache: the stored blocks are byte-identical
 * (q4's and tq's rotations and codes included), and attention agrees, across blocks, with GQA,
 * windows and a prefill's many queries. */
static void test_kv_device(void **state) {
    (void)state;
    const struct {
        enum llmem_kv_format format;
        int rotate;
    } fmts[] = {{LLMEM_KV_FORMAT_F32, 1}, {LLMEM_KV_FORMAT_F16, 1}, {LLMEM_KV_FORMAT_BF16, 1},
                {LLMEM_KV_FORMAT_Q8, 1},  {LLMEM_KV_FORMAT_Q4, 1},  {LLMEM_KV_FORMAT_Q4, 0},
                {LLMEM_KV_FORMAT_TQ, 1}};
    const int hds[] = {64, 128};
    for (size_t fi = 0; fi < sizeof(fmts) / sizeof(fmts[0]); fi++)
        for (int hi = 0; hi < 2; hi++) {
            const int hd = hds[hi], n_kv = 2, n_heads = 8, layers = 2;
            struct llmem_kv_config kc;
            llmem_kv_config_default(&kc);
            kc.format = fmts[fi].format;
            kc.rotate = fmts[fi].rotate;
            kc.n_layers = layers;
            kc.n_kv_heads = n_kv;
            kc.head_dim = hd;
            kc.max_sequences = 4;
            kc.num_blocks = 64;
            kc.n_threads = 2;
            struct llmem_kv *host = NULL, *dev = NULL;
            assert_int_equal(llmem_kv_create(&kc, NULL, &host), LLMEM_OK);
            kc.device = gpu;
            assert_int_equal(llmem_kv_create(&kc, dmem, &dev), LLMEM_OK);
            const int64_t n = 203; /* 12 full blocks and a partial one */
            const int64_t kv_floats = n * n_kv * hd, q_floats = n * n_heads * hd;
            float *k = random_floats(kv_floats * layers, 2.0f);
            float *v = random_floats(kv_floats * layers, 1.0f);
            float *q = random_floats(q_floats, 1.0f);
            int hs = -1, ds = -1;
            assert_int_equal(llmem_kv_seq_new(host, &hs), LLMEM_OK);
            assert_int_equal(llmem_kv_seq_new(dev, &ds), LLMEM_OK);
            float *dk = to_device(k, (size_t)(kv_floats * layers) * 4);
            float *dv = to_device(v, (size_t)(kv_floats * layers) * 4);
            float *dq = to_device(q, (size_t)q_floats * 4);
            assert_int_equal(llmem_kv_append(host, hs, n, k, v), LLMEM_OK);
            assert_int_equal(llmem_kv_append(dev, ds, n, dk, dv), LLMEM_OK);
            /* the stored bytes */
            const int64_t bb = llmem_kv_block_bytes(host);
            uint8_t *a = malloc((size_t)bb), *b = malloc((size_t)bb);
            const int64_t *ih, *id;
            int64_t nb = llmem_kv_seq_blocks(host, hs, &ih);
            assert_int_equal(llmem_kv_seq_blocks(dev, ds, &id), nb);
            for (int64_t i = 0; i < nb - 1; i++) { /* full blocks: every byte written */
                llmem_kv_block_copy_out(host, ih[i], a);
                llmem_kv_block_copy_out(dev, id[i], b);
                assert_memory_equal(a, b, (size_t)bb);
            }
            /* attention: decode at the end, a prefill chunk, a window */
            struct {
                int64_t q_pos, n_q, window;
            } cases[] = {
                {n - 1, 1, 0}, {n - 40, 40, 0}, {n - 3, 3, 37}, {0, 17, 0}, {n - 20, 20, 37}};
            float *out = malloc((size_t)q_floats * 4);
            float *dout = llmem_mem_alloc(dmem, (size_t)q_floats * 4, LLMEM_TAG_SCRATCH);
            double worst = 0;
            for (int c = 0; c < 5; c++)
                for (int layer = 0; layer < layers; layer++) {
                    struct llmem_kv_attn at = {.n_heads = n_heads, .window = cases[c].window};
                    assert_int_equal(
                        llmem_kv_attend(host, hs, layer, cases[c].q_pos, cases[c].n_q, q, out, &at),
                        LLMEM_OK);
                    assert_int_equal(llmem_kv_attend(dev, ds, layer, cases[c].q_pos, cases[c].n_q,
                                                     dq, dout, &at),
                                     LLMEM_OK);
                    float *g = to_host(dout, cases[c].n_q * n_heads * hd);
                    worst = fmax(worst, rel_diff(out, g, cases[c].n_q * n_heads * hd));
                    free(g);
                }
            const char *name = llmem_kv_format_name(fmts[fi].format);
            const char *how =
                fmts[fi].format == LLMEM_KV_FORMAT_Q4 && !fmts[fi].rotate ? " (not rotated)" : "";
            printf("  kv %s%s head_dim %d: attention %.2e\n", name, how, hd, worst);
            assert_true(worst <= (fmts[fi].format == LLMEM_KV_FORMAT_F32 ? 1e-5 : 1e-3));
            /* a decode step of three sequences at once (one forked, sharing the partial block):
             * one token each written and attended, the same on both; then a mixed step: one
             * decode token, a 5-token chunk and a 20-token chunk across a block boundary */
            {
                int hseq[3] = {hs, -1, -1}, dseq[3] = {ds, -1, -1};
                assert_int_equal(llmem_kv_seq_fork(host, hs, &hseq[1]), LLMEM_OK);
                assert_int_equal(llmem_kv_seq_fork(dev, ds, &dseq[1]), LLMEM_OK);
                assert_int_equal(llmem_kv_seq_new(host, &hseq[2]), LLMEM_OK);
                assert_int_equal(llmem_kv_seq_new(dev, &dseq[2]), LLMEM_OK);
                assert_int_equal(llmem_kv_append(host, hseq[2], 37, k, v), LLMEM_OK);
                assert_int_equal(llmem_kv_append(dev, dseq[2], 37, dk, dv), LLMEM_OK);
                const int64_t kv_row = n_kv * hd, q_row = n_heads * hd;
                for (int mixed = 0; mixed < 2; mixed++) {
                    const int64_t chunks[3] = {1, 5, 20}, ones[3] = {1, 1, 1};
                    const int64_t *nq = mixed ? chunks : ones;
                    const int64_t rows = nq[0] + nq[1] + nq[2];
                    for (int i = 0; i < 3; i++) {
                        int64_t len = llmem_kv_seq_length(host, hseq[i]);
                        assert_int_equal(llmem_kv_reserve(host, hseq[i], nq[i]), LLMEM_OK);
                        assert_int_equal(llmem_kv_reserve(dev, dseq[i], nq[i]), LLMEM_OK);
                        llmem_kv_set_length(host, hseq[i], len + nq[i]);
                        llmem_kv_set_length(dev, dseq[i], len + nq[i]);
                    }
                    struct llmem_kv_attn at = {.n_heads = n_heads};
                    double w = 0;
                    assert_int_equal(llmem_kv_step(host, 3, hseq, mixed ? nq : NULL), LLMEM_OK);
                    assert_int_equal(llmem_kv_step(dev, 3, dseq, mixed ? nq : NULL), LLMEM_OK);
                    for (int layer = 0; layer < layers; layer++) {
                        /* the step's new keys: rows 100.. of the data, other rows per layer */
                        const int64_t r0 = 100 + layer * 3 + mixed * 40;
                        const float *nk = k + r0 * kv_row, *nv = v + r0 * kv_row;
                        const float *dnk = dk + r0 * kv_row, *dnv = dv + r0 * kv_row;
                        const int64_t *arg = mixed ? nq : NULL;
                        assert_int_equal(llmem_kv_write_last(host, 3, hseq, arg, layer, nk, nv),
                                         LLMEM_OK);
                        assert_int_equal(llmem_kv_write_last(dev, 3, dseq, arg, layer, dnk, dnv),
                                         LLMEM_OK);
                        assert_int_equal(
                            llmem_kv_attend_last(host, 3, hseq, arg, layer, q, out, &at), LLMEM_OK);
                        assert_int_equal(
                            llmem_kv_attend_last(dev, 3, dseq, arg, layer, dq, dout, &at),
                            LLMEM_OK);
                        float *g = to_host(dout, rows * q_row);
                        w = fmax(w, rel_diff(out, g, rows * q_row));
                        free(g);
                    }
                    printf("  kv %s%s head_dim %d: a %s step of 3 sequences %.2e\n", name, how, hd,
                           mixed ? "mixed" : "decode", w);
                    assert_true(w <= (fmts[fi].format == LLMEM_KV_FORMAT_F32 ? 1e-5 : 1e-3));
                }
                /* the stored bytes of the chunks, full blocks */
                for (int i = 0; i < 3; i++) {
                    const int64_t *bh, *bd;
                    int64_t nbh = llmem_kv_seq_blocks(host, hseq[i], &bh);
                    assert_int_equal(llmem_kv_seq_blocks(dev, dseq[i], &bd), nbh);
                    for (int64_t j = 0; j + 1 < nbh; j++) {
                        llmem_kv_block_copy_out(host, bh[j], a);
                        llmem_kv_block_copy_out(dev, bd[j], b);
                        assert_memory_equal(a, b, (size_t)bb);
                    }
                }
                for (int i = 1; i < 3; i++) {
                    llmem_kv_seq_free(host, hseq[i]);
                    llmem_kv_seq_free(dev, dseq[i]);
                }
            }
            /* a fork shares the blocks; a write into the partial block copies it on the device */
            int fs = -1;
            struct llmem_kv_stats st;
            llmem_kv_stats(dev, &st);
            const int64_t cow = st.cow_copies;
            assert_int_equal(llmem_kv_seq_fork(dev, ds, &fs), LLMEM_OK);
            assert_int_equal(llmem_kv_append(dev, fs, 1, dk, dv), LLMEM_OK);
            llmem_kv_stats(dev, &st);
            assert_int_equal(st.cow_copies, cow + 1);
            assert_true(st.route_device > 0);
            assert_int_equal(llmem_kv_check(dev), LLMEM_OK);
            assert_int_equal(gpu->ops->sync(gpu->ctx), LLMEM_OK);
            llmem_mem_free(dmem, dk), llmem_mem_free(dmem, dv), llmem_mem_free(dmem, dq);
            llmem_mem_free(dmem, dout);
            llmem_kv_destroy(host);
            llmem_kv_destroy(dev);
            free(k), free(v), free(q), free(a), free(b), free(out);
        }
    /* what the device does not hold is refused by name: rows rotated past head_dim 256, and
     * layouts other than paged */
    struct llmem_kv_config kc;
    llmem_kv_config_default(&kc);
    kc.n_layers = 1, kc.n_kv_heads = 1, kc.head_dim = 512, kc.device = gpu;
    kc.format = LLMEM_KV_FORMAT_TQ;
    struct llmem_kv *kv = NULL;
    assert_int_equal(llmem_kv_create(&kc, dmem, &kv), LLMEM_EUNSUPPORTED);
    kc.head_dim = 64;
    kc.format = LLMEM_KV_FORMAT_F16, kc.layout = LLMEM_KV_LAYOUT_CONTIGUOUS;
    assert_int_equal(llmem_kv_create(&kc, dmem, &kv), LLMEM_EUNSUPPORTED);
}

/* Blocks copied to the host without waiting (the spill store's staging, pinned or not): the
 * thread goes on, frees the sequence and writes new tokens into the same blocks, given out again;
 * after llmem_kv_copies_wait the copies hold the old bytes, those of a host cache with the same
 * writes. */
static void test_kv_copy_out_async(void **state) {
    (void)state;
    struct llmem_kv_config kc;
    llmem_kv_config_default(&kc);
    kc.format = LLMEM_KV_FORMAT_F16;
    kc.n_layers = 3, kc.n_kv_heads = 2, kc.head_dim = 64, kc.max_sequences = 2, kc.num_blocks = 8;
    struct llmem_kv *host = NULL, *dev = NULL;
    assert_int_equal(llmem_kv_create(&kc, NULL, &host), LLMEM_OK);
    kc.device = gpu;
    assert_int_equal(llmem_kv_create(&kc, dmem, &dev), LLMEM_OK);
    const int64_t n = 64, row = n * 2 * 64; /* four blocks */
    float *k = random_floats(2 * row * 3, 1.0f), *v = random_floats(2 * row * 3, 1.0f);
    float *dk = to_device(k, (size_t)(2 * row * 3) * 4),
          *dv = to_device(v, (size_t)(2 * row * 3) * 4);
    int hs = -1, ds = -1;
    assert_int_equal(llmem_kv_seq_new(host, &hs), LLMEM_OK);
    assert_int_equal(llmem_kv_seq_new(dev, &ds), LLMEM_OK);
    assert_int_equal(llmem_kv_append(host, hs, n, k, v), LLMEM_OK);
    assert_int_equal(llmem_kv_append(dev, ds, n, dk, dv), LLMEM_OK);
    const int64_t bb = llmem_kv_block_bytes(dev);
    const int64_t *ids = NULL;
    assert_int_equal(llmem_kv_seq_blocks(dev, ds, &ids), 4);
    int64_t took[4];
    memcpy(took, ids, sizeof(took));
    struct llmem_mem_config pc = {.ops = llmem_backend_cuda_pinned_memory()};
    struct llmem_mem *pmem = NULL;
    assert_non_null(pc.ops);
    assert_int_equal(llmem_mem_create(&pc, &pmem), LLMEM_OK);
    uint8_t *pinned = llmem_mem_alloc(pmem, (size_t)bb * 2, LLMEM_TAG_BANK);
    uint8_t *plain = malloc((size_t)bb * 2), *want = malloc((size_t)bb);
    assert_non_null(pinned);
    /* blocks 0 and 1 in one call (a run of ids, if they follow each other), 3 then 2 */
    llmem_kv_blocks_copy_out_async(dev, took, 2, pinned);
    llmem_kv_blocks_copy_out_async(dev, took + 3, 1, plain + bb);
    llmem_kv_blocks_copy_out_async(dev, took + 2, 1, plain);
    /* the same blocks, given out again and overwritten at once (other rows of the data) */
    llmem_kv_seq_free(dev, ds);
    assert_int_equal(llmem_kv_seq_new(dev, &ds), LLMEM_OK);
    assert_int_equal(llmem_kv_append(dev, ds, n, dk + row * 3, dv + row * 3), LLMEM_OK);
    assert_int_equal(llmem_kv_seq_blocks(dev, ds, &ids), 4);
    int reused = 0;
    for (int b = 0; b < 4; b++)
        for (int c = 0; c < 4; c++)
            reused += ids[b] == took[c];
    assert_true(reused > 0);
    assert_int_equal(llmem_kv_copies_wait(dev), LLMEM_OK);
    const int64_t *hid = NULL;
    llmem_kv_seq_blocks(host, hs, &hid);
    for (int b = 0; b < 4; b++) {
        llmem_kv_block_copy_out(host, hid[b], want);
        assert_memory_equal(b < 2 ? pinned + b * bb : plain + (b - 2) * bb, want, (size_t)bb);
    }
    assert_int_equal(llmem_kv_check(dev), LLMEM_OK);
    assert_int_equal(gpu->ops->sync(gpu->ctx), LLMEM_OK);
    llmem_mem_free(pmem, pinned);
    llmem_mem_destroy(pmem);
    free(plain), free(want), free(k), free(v);
    llmem_mem_free(dmem, dk), llmem_mem_free(dmem, dv);
    llmem_kv_destroy(host);
    llmem_kv_destroy(dev);
}

/* ---- whole models ----------------------------------------------------------------------------
 */

/* open_engine with a mixture's experts_on_host (-1: the plan's placement), split over `ranks`
 * (on this device: main sets LLMEM_SPLIT_ONE_DEVICE). */
static struct llmem_engine *open_engine_split(const char *dir, enum llmem_backend_kind backend,
                                              enum llmem_backend_precision precision,
                                              enum llmem_kv_format format, int64_t experts_on_host,
                                              int ranks) {
    struct llmem_engine_config c;
    llmem_engine_config_default(&c);
    c.max_sequences = 4;
    c.model_dir = dir;
    c.n_threads = 2;
    c.no_bank = 1;
    c.context = 512;
    c.kv_format = format;
    c.backend = backend;
    c.precision = precision;
    c.experts_on_host = experts_on_host;
    c.tensor_parallel = ranks;
    struct llmem_engine *e = NULL;
    assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_OK);
    return e;
}

/* open_engine with a mixture's experts_on_host (-1: the plan's placement). */
static struct llmem_engine *open_engine_placed(const char *dir, enum llmem_backend_kind backend,
                                               enum llmem_backend_precision precision,
                                               enum llmem_kv_format format,
                                               int64_t experts_on_host) {
    return open_engine_split(dir, backend, precision, format, experts_on_host, 1);
}

static struct llmem_engine *open_engine(const char *dir, enum llmem_backend_kind backend,
                                        enum llmem_backend_precision precision,
                                        enum llmem_kv_format format) {
    return open_engine_placed(dir, backend, precision, format, -1);
}

/* The defaults with pycoder on the device. */
static void pycoder_on_device(struct llmem_engine_config *c) {
    llmem_engine_config_default(c);
    c->model_dir = LLMEM_SOURCE_DIR "/models/pycoder";
    c->backend = LLMEM_BACKEND_CUDA;
}

/* pycoder on the device with its defaults (the bank on), 4 sequences of up to 512 tokens. */
static struct llmem_engine *open_small_pycoder(void) {
    struct llmem_engine_config c;
    pycoder_on_device(&c);
    c.max_sequences = 4;
    c.context = 512;
    struct llmem_engine *e = NULL;
    assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_OK);
    return e;
}

static float *teacher_forced(struct llmem_engine *e, const int32_t *ids, int64_t n, int64_t vocab) {
    float *logits = malloc((size_t)(n * vocab) * sizeof(float));
    assert_non_null(logits);
    int seq = -1;
    assert_int_equal(llmem_kv_seq_new(llmem_engine_kv(e), &seq), LLMEM_OK);
    /* two prefill chunks of 32 tokens (the GEMM paths), then one token at a time (decode) */
    for (int64_t pos = 0, m; pos < n; pos += m) {
        m = pos < 64 ? (n - pos < 32 ? n - pos : 32) : 1;
        struct llmem_batch_seq b = {.seq = seq, .pos = pos, .n_tokens = m, .all_logits = 1};
        assert_int_equal(
            llmem_forward_run(llmem_engine_forward(e), ids + pos, &b, 1, logits + pos * vocab),
            LLMEM_OK);
    }
    llmem_kv_seq_free(llmem_engine_kv(e), seq);
    return logits;
}

/* Every reference model: teacher-forced logits at f32 precision (f32 KV) within 1e-3 of the CPU;
 * at fast precision (f16 KV) the drift is measured: max |Δ| and how often the top token changes. */
static void test_models(void **state) {
    (void)state;
    const char *models[] = {
        LLMEM_SOURCE_DIR "/models/pycoder",
        LLMEM_TEST_DATA "/models/tiny-llama3",
        LLMEM_TEST_DATA "/models/tiny-mistral-swa",
        LLMEM_TEST_DATA "/models/tiny-qwen2",
        LLMEM_TEST_DATA "/models/tiny-qwen3",
        /* quantized: GGUF's Q4_K_M (Q4_K and Q6_K; llama's permuted q and k), MLX's groups (4
         * and 8 bits, one model mixing them; test_matmul_quantized takes every block type) */
        LLMEM_TEST_DATA "/gguf/pycoder-q4_k_m.gguf",
        LLMEM_TEST_DATA "/mlx/tiny-qwen2-4bit",
        LLMEM_TEST_DATA "/mlx/tiny-mistral-swa-mixed",
        /* mixtures of experts: safetensors and MLX 4-bit (test_moe takes the GGUF types) */
        LLMEM_TEST_DATA "/models/tiny-qwen3-moe",
        LLMEM_TEST_DATA "/models/tiny-mixtral",
        LLMEM_TEST_DATA "/mlx/tiny-qwen3-moe-4bit",
    };
    for (size_t m = 0; m < sizeof(models) / sizeof(models[0]); m++) {
        struct llmem_engine *cpu_e =
            open_engine(models[m], LLMEM_BACKEND_CPU, LLMEM_PRECISION_F32, LLMEM_KV_FORMAT_F32);
        const int64_t vocab = llmem_model_get_config(llmem_engine_model(cpu_e))->geom.vocab_size;
        const int64_t n = 100;
        int32_t ids[100];
        for (int i = 0; i < n; i++)
            ids[i] = (int32_t)((i * 7919 + 13) % (vocab < 2000 ? vocab : 2000));
        float *ref = teacher_forced(cpu_e, ids, n, vocab);
        llmem_engine_close(cpu_e);
        for (int p = 0; p < 2; p++) {
            struct llmem_engine *e = open_engine(
                models[m], LLMEM_BACKEND_CUDA, p == 0 ? LLMEM_PRECISION_F32 : LLMEM_PRECISION_FAST,
                p == 0 ? LLMEM_KV_FORMAT_F32 : LLMEM_KV_FORMAT_F16);
            float *got = teacher_forced(e, ids, n, vocab);
            double worst = 0, kl_sum = 0, kl_max = 0;
            int flips = 0;
            for (int64_t t = 0; t < n; t++) {
                const float *r = ref + t * vocab, *g = got + t * vocab;
                int64_t a = 0, b = 0;
                for (int64_t i = 0; i < vocab; i++) {
                    worst = fmax(worst, fabs((double)r[i] - (double)g[i]));
                    a = r[i] > r[a] ? i : a;
                    b = g[i] > g[b] ? i : b;
                }
                flips += a != b;
                /* KL(cpu ‖ gpu) of the next-token distributions, in nats */
                double zr = 0, zg = 0, kl = 0;
                for (int64_t i = 0; i < vocab; i++) {
                    zr += exp((double)r[i] - r[a]);
                    zg += exp((double)g[i] - g[b]);
                }
                for (int64_t i = 0; i < vocab; i++) {
                    double lr = (double)r[i] - r[a] - log(zr), lg = (double)g[i] - g[b] - log(zg);
                    kl += exp(lr) * (lr - lg);
                }
                kl_sum += kl;
                kl_max = fmax(kl_max, kl);
            }
            printf("  %s %s: max |dlogit| %.2e, top token differs at %d of %lld positions, KL mean "
                   "%.2e max %.2e nats\n",
                   strrchr(models[m], '/') + 1, p == 0 ? "f32" : "fast", worst, flips, (long long)n,
                   kl_sum / (double)n, kl_max);
            if (p == 0) {
                assert_true(worst <= 1e-3);
            } else if (strstr(models[m], ".gguf") != NULL) {
                /* a decode's K-type products take x in 8 bits, as the CPU's fast path: its drift
                 * bounds (tests/e2e/e2e-gguf.c DRIFT_*; measured 1.05 and 4.7e-3) */
                assert_true(worst <= 3.0);
                assert_true(kl_sum / (double)n <= 1.5e-2);
            } else {
                assert_true(worst <= 0.25);
                assert_true(kl_sum / (double)n <= 1e-3); /* measured ≤ 1.3e-4 */
            }
            free(got);
            llmem_engine_close(e);
        }
        free(ref);
    }
}

/* The largest |a − b| over n logits. */
static double max_abs_diff(const float *a, const float *b, int64_t n) {
    double worst = 0;
    for (int64_t i = 0; i < n; i++)
        worst = fmax(worst, fabs((double)a[i] - (double)b[i]));
    return worst;
}

/* A mixture with the experts of its first MoE layers left on the host (--experts-on-host): those
 * run on the CPU, the rest on the device; the logits at f32 precision within 1e-3 of the CPU's,
 * for 0, 2 and all 3 of tiny-qwen3-moe's MoE layers on the host. */
/* One-token decode steps of a 2,048-wide model (seeded random weights from a config.json and
 * pycoder's tokenizer): the matrix-vector kernels take every row of x from the kernel before
 * while it may still run (programmatic dependent launch); teacher-forced logits at f32
 * precision within 1e-4 of the CPU's at every position, prefill and decode. */
static void test_wide_decode(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    tu_copy_into(LLMEM_SOURCE_DIR "/models/pycoder/tokenizer.json", dir);
    tu_copy_into(LLMEM_SOURCE_DIR "/models/pycoder/tokenizer_config.json", dir);
    free(tu_write_file(dir, "config.json",
                       "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", "
                       "\"hidden_size\": 2048, \"intermediate_size\": 8192, "
                       "\"num_hidden_layers\": 1, \"num_attention_heads\": 32, "
                       "\"num_key_value_heads\": 8, \"head_dim\": 64, \"vocab_size\": 4096, "
                       "\"max_position_embeddings\": 2048, \"rms_norm_eps\": 1e-05, "
                       "\"rope_theta\": 500000.0, \"tie_word_embeddings\": true, "
                       "\"bos_token_id\": 0, \"eos_token_id\": 1, \"torch_dtype\": \"bfloat16\"}",
                       -1));
    struct llmem_engine *e[2];
    float *logits[2];
    const int64_t n = 80, vocab = 4096;
    int32_t ids[80];
    for (int i = 0; i < n; i++)
        ids[i] = (int32_t)((i * 7919 + 13) % 2000);
    for (int b = 0; b < 2; b++) {
        struct llmem_engine_config c;
        llmem_engine_config_default(&c);
        c.model_dir = dir;
        c.load_dummy = 1;
        c.n_threads = 2;
        c.context = 512;
        c.kv_format = LLMEM_KV_FORMAT_F32;
        c.backend = b == 0 ? LLMEM_BACKEND_CPU : LLMEM_BACKEND_CUDA;
        c.precision = LLMEM_PRECISION_F32;
        assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e[b]), LLMEM_OK);
        logits[b] = teacher_forced(e[b], ids, n, vocab);
        llmem_engine_close(e[b]);
    }
    double worst = 0;
    int64_t at = 0;
    for (int64_t i = 0; i < n * vocab; i++) {
        const double d = fabs((double)logits[0][i] - (double)logits[1][i]);
        if (isnan(d) || d > worst)
            worst = isnan(d) ? INFINITY : d, at = i / vocab;
    }
    printf("  2,048 wide, decode steps of one token: max |dlogit| %.2e (position %lld)\n", worst,
           (long long)at);
    assert_true(worst <= 1e-4);
    free(logits[0]), free(logits[1]);
    tu_rmtree(dir);
    free(dir);
}

static void test_experts_on_host(void **state) {
    (void)state;
    const char *dir = LLMEM_TEST_DATA "/models/tiny-qwen3-moe";
    struct llmem_engine *cpu_e =
        open_engine(dir, LLMEM_BACKEND_CPU, LLMEM_PRECISION_F32, LLMEM_KV_FORMAT_F32);
    const int64_t vocab = llmem_model_get_config(llmem_engine_model(cpu_e))->geom.vocab_size;
    int32_t ids[80];
    for (int i = 0; i < 80; i++)
        ids[i] = (int32_t)((i * 7919 + 13) % (vocab < 2000 ? vocab : 2000));
    float *ref = teacher_forced(cpu_e, ids, 80, vocab);
    llmem_engine_close(cpu_e);
    const int64_t on_host[] = {0, 2, 3};
    for (int i = 0; i < 3; i++) {
        struct llmem_engine *e = open_engine_placed(dir, LLMEM_BACKEND_CUDA, LLMEM_PRECISION_F32,
                                                    LLMEM_KV_FORMAT_F32, on_host[i]);
        const struct llmem_expert_placement *placed = llmem_engine_expert_placement(e);
        assert_int_equal(placed->moe_layers, 3);
        assert_int_equal(placed->host_layers, on_host[i]);
        float *got = teacher_forced(e, ids, 80, vocab);
        const double d = max_abs_diff(ref, got, 80 * vocab);
        printf("  experts of %lld MoE layers on the host: max |dlogit| %.2e\n",
               (long long)on_host[i], d);
        assert_true(d <= 1e-3);
        free(got);
        llmem_engine_close(e);
    }
    free(ref);
}

/* pycoder with q4 (rotated) and tq caches at f32 precision, teacher-forced over prefill chunks and
 * decode steps: the device's logits are as close to those of an f32 cache as the CPU's with the
 * same format, and agree with the CPU's top token wherever it is clear. The two code the same
 * keys and values only up to f32 rounding, which now and then moves a code by a step, or (tq's
 * values) a group's fitted scale: so they do not agree to 1e-3 as with an f32 cache (H200: q4
 * 2.0e-3, tq 0.73, against each format's own error of 3.9 and 5.2). */
static void test_quantized_caches(void **state) {
    (void)state;
    const char *dir = LLMEM_SOURCE_DIR "/models/pycoder";
    const int64_t n = 100;
    int32_t ids[100];
    for (int i = 0; i < n; i++)
        ids[i] = (int32_t)((i * 7919 + 13) % 2000);
    struct llmem_engine *e =
        open_engine(dir, LLMEM_BACKEND_CPU, LLMEM_PRECISION_F32, LLMEM_KV_FORMAT_F32);
    const int64_t vocab = llmem_model_get_config(llmem_engine_model(e))->geom.vocab_size;
    float *ref = teacher_forced(e, ids, n, vocab);
    llmem_engine_close(e);
    const enum llmem_kv_format fmts[] = {LLMEM_KV_FORMAT_Q4, LLMEM_KV_FORMAT_TQ};
    for (int f = 0; f < 2; f++) {
        float *out[2];
        for (int b = 0; b < 2; b++) {
            e = open_engine(dir, b == 0 ? LLMEM_BACKEND_CPU : LLMEM_BACKEND_CUDA,
                            LLMEM_PRECISION_F32, fmts[f]);
            out[b] = teacher_forced(e, ids, n, vocab);
            llmem_engine_close(e);
        }
        const double cpu_err = max_abs_diff(out[0], ref, n * vocab);
        const double gpu_err = max_abs_diff(out[1], ref, n * vocab);
        const double apart = max_abs_diff(out[0], out[1], n * vocab);
        int flips = 0, clear_flips = 0; /* top tokens that differ; of them, where the CPU's top
                                         * token leads by ≥ 2e-3 */
        for (int64_t t = 0; t < n; t++) {
            const float *r = out[0] + t * vocab, *g = out[1] + t * vocab;
            int64_t a = 0, c = 0;
            for (int64_t i = 0; i < vocab; i++) {
                a = r[i] > r[a] ? i : a;
                c = g[i] > g[c] ? i : c;
            }
            double second = -INFINITY;
            for (int64_t i = 0; i < vocab; i++)
                second = i != a && r[i] > second ? r[i] : second;
            flips += a != c;
            clear_flips += a != c && r[a] - second >= 2e-3;
        }
        printf("  pycoder, %s cache, f32: max |dlogit| from an f32 cache %.2e (CPU) and %.2e "
               "(device), %.2e apart; top token differs at %d of %lld positions\n",
               llmem_kv_format_name(fmts[f]), cpu_err, gpu_err, apart, flips, (long long)n);
        assert_true(gpu_err <= 1.25 * cpu_err);
        assert_int_equal(clear_flips, 0);
        free(out[0]), free(out[1]);
    }
    free(ref);
}

/* The spill store with the cache on the device: a first engine's prompt goes to disk through
 * the device's copy queue and pinned staging; a second engine on the same store (an empty RAM
 * tier) restores it into device blocks and generates the same tokens at f32 precision. */
static void test_spill_on_device(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    int32_t prompt[600];
    for (int i = 0; i < 600; i++)
        prompt[i] = 20 + (i * 37) % 3900;
    struct llmem_generate_params gp;
    llmem_generate_params_default(&gp);
    gp.max_tokens = 16;
    gp.ignore_eos = 1;
    struct llmem_generate_result r[2];
    for (int run = 0; run < 2; run++) {
        struct llmem_engine_config c;
        pycoder_on_device(&c);
        c.precision = LLMEM_PRECISION_F32;
        c.n_threads = 2;
        c.bank_dir = dir;
        struct llmem_engine *e = NULL;
        assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_OK);
        assert_int_equal(llmem_engine_generate(e, prompt, 600, &gp, NULL, NULL, &r[run]), LLMEM_OK);
        struct llmem_engine_bank_stats bs;
        llmem_engine_bank_stats(e, &bs);
        assert_true(bs.spill_on && bs.spill.owned);
        assert_int_equal(r[run].reused_disk_tokens, run == 0 ? 0 : 599 / 16 * 16);
        llmem_engine_close(e); /* flushes the writes */
    }
    printf("  600-token prompt on the device: ttft cold %.1f ms, from disk %.1f ms\n", r[0].ttft_ms,
           r[1].ttft_ms);
    assert_int_equal(r[1].n_ids, r[0].n_ids);
    assert_memory_equal(r[1].ids, r[0].ids, (size_t)r[0].n_ids * sizeof(int32_t));
    llmem_generate_result_free(&r[0]);
    llmem_generate_result_free(&r[1]);
    tu_rmtree(dir);
    free(dir);
}

/* A prompt of n ids base, base + step, …, and parameters for max_tokens tokens past any EOS. */
static void long_run(int32_t *prompt, int n, int base, int step, int64_t max_tokens,
                     struct llmem_generate_params *gp) {
    for (int i = 0; i < n; i++)
        prompt[i] = base + i * step;
    llmem_generate_params_default(gp);
    gp->max_tokens = max_tokens;
    gp->ignore_eos = 1;
}

/* pycoder's greedy continuation: the same tokens on the GPU at f32 precision; at fast precision
 * (f16 KV) the first token that differs is reported. */
static void test_greedy(void **state) {
    (void)state;
    const char *dir = LLMEM_SOURCE_DIR "/models/pycoder";
    int32_t prompt[24];
    struct llmem_generate_params gp;
    long_run(prompt, 24, 100, 31, 32, &gp);
    struct llmem_generate_result r[3];
    for (int b = 0; b < 3; b++) {
        struct llmem_engine *e = open_engine(dir, b == 0 ? LLMEM_BACKEND_CPU : LLMEM_BACKEND_CUDA,
                                             b < 2 ? LLMEM_PRECISION_F32 : LLMEM_PRECISION_FAST,
                                             b < 2 ? LLMEM_KV_FORMAT_F32 : LLMEM_KV_FORMAT_F16);
        assert_int_equal(llmem_engine_generate(e, prompt, 24, &gp, NULL, NULL, &r[b]), LLMEM_OK);
        llmem_engine_close(e);
    }
    assert_int_equal(r[0].n_ids, r[1].n_ids);
    assert_memory_equal(r[0].ids, r[1].ids, (size_t)r[0].n_ids * sizeof(int32_t));
    int64_t first = 0;
    while (first < r[0].n_ids && first < r[2].n_ids && r[0].ids[first] == r[2].ids[first])
        first++;
    if (first == r[0].n_ids)
        printf("  pycoder fast: the %lld greedy tokens all equal the CPU's\n",
               (long long)r[0].n_ids);
    else
        printf("  pycoder fast: first greedy token that differs from the CPU's: %lld of %lld\n",
               (long long)first, (long long)r[0].n_ids);
    for (int b = 0; b < 3; b++)
        llmem_generate_result_free(&r[b]);
}

/* A model split over 2 and 4 ranks on this one device (LLMEM_SPLIT_ONE_DEVICE: each rank a
 * backend and an allocator of its own, the KV pool's layers on their ranks, the sums made by rank
 * 0's stream; the path of a split over devices but NCCL, which test-cuda-comm checks): pycoder's
 * and tiny-qwen3-moe's greedy tokens at f32 (every logits row gathered from the ranks' shares of
 * the vocabulary) equal the CPU's whole model's; at fast precision the tokens that agree are
 * printed; every rank's allocator peaks within the plan's footprint. */
static void test_split_one_device(void **state) {
    (void)state;
    const char *dirs[2] = {LLMEM_SOURCE_DIR "/models/pycoder",
                           LLMEM_TEST_DATA "/models/tiny-qwen3-moe"};
    int32_t prompt[24];
    struct llmem_generate_params gp;
    long_run(prompt, 24, 100, 31, 32, &gp);
    for (int m = 0; m < 2; m++) {
        struct llmem_generate_result want, got;
        struct llmem_engine *e =
            open_engine(dirs[m], LLMEM_BACKEND_CPU, LLMEM_PRECISION_F32, LLMEM_KV_FORMAT_F32);
        assert_int_equal(llmem_engine_generate(e, prompt, 24, &gp, NULL, NULL, &want), LLMEM_OK);
        llmem_engine_close(e);
        for (int ranks = 2; ranks <= 4; ranks *= 2) {
            for (int fast = 0; fast < 2; fast++) {
                e = open_engine_split(dirs[m], LLMEM_BACKEND_CUDA,
                                      fast ? LLMEM_PRECISION_FAST : LLMEM_PRECISION_F32,
                                      fast ? LLMEM_KV_FORMAT_F16 : LLMEM_KV_FORMAT_F32, -1, ranks);
                assert_int_equal(llmem_engine_generate(e, prompt, 24, &gp, NULL, NULL, &got),
                                 LLMEM_OK);
                struct llmem_engine_metrics mm; /* each rank's allocator within its plan */
                llmem_engine_metrics(e, &mm);
                assert_int_equal(mm.n_devices, ranks);
                for (int d = 0; d < ranks; d++)
                    assert_true(mm.devices[d].peak > 0 &&
                                mm.devices[d].peak <= llmem_engine_plan(e)->footprint_bytes &&
                                mm.devices[d].peak <= mm.devices[d].limit);
                llmem_engine_close(e);
                int64_t first = 0;
                while (first < want.n_ids && first < got.n_ids && want.ids[first] == got.ids[first])
                    first++;
                printf("  %s over %d ranks on one device, %s: %lld of %lld greedy tokens as the "
                       "CPU's\n",
                       strrchr(dirs[m], '/') + 1, ranks, fast ? "fast" : "f32", (long long)first,
                       (long long)want.n_ids);
                if (!fast) {
                    assert_int_equal(got.n_ids, want.n_ids);
                    assert_int_equal(first, want.n_ids);
                }
                llmem_generate_result_free(&got);
            }
        }
        llmem_generate_result_free(&want);
    }
}

struct entry {
    float v;
    int32_t id;
};

static int by_value_desc(const void *a, const void *b) {
    const struct entry *x = a, *y = b;
    if (x->v != y->v)
        return x->v > y->v ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* The k largest of a row, by value descending and equal values by the lower column. */
static void top_ref(const float *row, int64_t cols, int k, int32_t *ids) {
    struct entry *e = malloc((size_t)cols * sizeof(*e));
    assert_non_null(e);
    for (int64_t i = 0; i < cols; i++)
        e[i] = (struct entry){row[i], (int32_t)i};
    qsort(e, (size_t)cols, sizeof(*e), by_value_desc);
    for (int j = 0; j < k; j++)
        ids[j] = e[j].id;
    free(e);
}

/* top_k against a reference: k of 1 (argmax), 2, 7 and 64; a vocabulary-sized row, short rows,
 * many rows; coarse values (ties), −0 beside +0, and rows of one value (more ties than the
 * kernel buffers). The results arrive with the sync that follows. */
static void test_top_k(void **state) {
    (void)state;
    const struct { int64_t n, cols; } shapes[] = {{3, 128256}, {130, 1000}, {5, 64}, {2, 5000}};
    const int ks[] = {1, 2, 7, 64};
    for (size_t sh = 0; sh < sizeof(shapes) / sizeof(shapes[0]); sh++) {
        const int64_t n = shapes[sh].n, cols = shapes[sh].cols;
        float *x = random_floats(n * cols, 8.0f);
        for (int64_t i = 0; i < n * cols; i++)
            x[i] = i % 3 == 0 ? roundf(x[i] * 4.0f) * 0.25f : x[i]; /* ties */
        x[0] = -0.0f, x[1] = 0.0f;
        if (sh == 3)
            for (int64_t i = 0; i < cols; i++)
                x[i] = 1.5f; /* the first row: one value */
        float *dx = to_device(x, (size_t)(n * cols) * sizeof(float));
        for (size_t kk = 0; kk < sizeof(ks) / sizeof(ks[0]); kk++) {
            const int k = ks[kk];
            if (k > cols)
                continue;
            int32_t *ids = malloc((size_t)(n * k) * sizeof(int32_t)), ref[64];
            float *vals = malloc((size_t)(n * k) * sizeof(float));
            memset(ids, 0xff, (size_t)(n * k) * sizeof(int32_t));
            assert_int_equal(gpu->ops->top_k(gpu->ctx, dx, n, cols, k, ids, vals), LLMEM_OK);
            assert_int_equal(gpu->ops->sync(gpu->ctx), LLMEM_OK); /* the results land here */
            for (int64_t r = 0; r < n; r++) {
                top_ref(x + r * cols, cols, k, ref);
                assert_memory_equal(ids + r * k, ref, (size_t)k * sizeof(int32_t));
                for (int j = 0; j < k; j++)
                    assert_true(vals[r * k + j] == x[r * cols + ref[j]]);
            }
            free(ids), free(vals);
        }
        llmem_mem_free(dmem, dx);
        free(x);
    }
}

/* Sampling from the device's top k (temperature, top_k, top_p, seed) draws the same tokens as
 * from whole rows of logits (which the engine takes when log-probabilities are asked for). */
static void test_sampling_on_device(void **state) {
    (void)state;
    const char *dir = LLMEM_SOURCE_DIR "/models/pycoder";
    int32_t prompt[16];
    struct llmem_generate_params gp;
    long_run(prompt, 16, 200, 17, 48, &gp);
    gp.sampling.temperature = 0.9, gp.sampling.top_k = 40, gp.sampling.top_p = 0.95;
    gp.sampling.seed = 5;
    struct llmem_generate_result r[2];
    int64_t top_rows[2];
    for (int b = 0; b < 2; b++) {
        struct llmem_engine *e =
            open_engine(dir, LLMEM_BACKEND_CUDA, LLMEM_PRECISION_FAST, LLMEM_KV_FORMAT_F16);
        gp.logprobs = b == 0 ? -1 : 1;
        assert_int_equal(llmem_engine_generate(e, prompt, 16, &gp, NULL, NULL, &r[b]), LLMEM_OK);
        const struct llmem_backend *be = llmem_engine_backend(e);
        struct llmem_backend_counters bc;
        be->ops->counters(be->ctx, &bc);
        top_rows[b] = bc.top_k_rows;
        llmem_engine_close(e);
    }
    assert_int_equal(top_rows[0], 48); /* every token from the device's top 40 */
    assert_int_equal(top_rows[1], 0);
    assert_int_equal(r[0].n_ids, r[1].n_ids);
    assert_memory_equal(r[0].ids, r[1].ids, (size_t)r[0].n_ids * sizeof(int32_t));
    for (int b = 0; b < 2; b++)
        llmem_generate_result_free(&r[b]);
}

/* What a streaming callback received: the ids and text, in order; it cancels after `cancel_at`
 * tokens (0: never). */
struct heard {
    int32_t ids[64];
    int n, cancel_at;
    char text[4096];
    size_t len;
};

static int hear(void *arg, int32_t id, const char *text, size_t len) {
    struct heard *h = arg;
    if (id >= 0)
        h->ids[h->n++] = id;
    assert_true(h->len + len < sizeof(h->text));
    memcpy(h->text + h->len, text, len);
    h->len += len;
    return h->cancel_at > 0 && h->n >= h->cancel_at;
}

/* Streaming from the device's top k: every token reaches the callback in order with its text,
 * the pieces add up to the result, and a cancel from the callback or a stop string ends the
 * request with exactly the tokens and text the client heard. Replayed decode steps hand a
 * token over while the next step computes, so the cancel and the stop string show while the
 * request is in the pass that follows: that pass's token is dropped and the KV left whole. */
static void test_streaming(void **state) {
    (void)state;
    const char *dir = LLMEM_SOURCE_DIR "/models/pycoder";
    int32_t prompt[16];
    struct llmem_generate_params gp;
    long_run(prompt, 16, 300, 13, 40, &gp);
    struct llmem_engine *e =
        open_engine(dir, LLMEM_BACKEND_CUDA, LLMEM_PRECISION_FAST, LLMEM_KV_FORMAT_F16);
    struct llmem_kv *kv = llmem_engine_kv(e);
    struct llmem_kv_stats ks;
    llmem_kv_stats(kv, &ks);
    const int64_t free_blocks = ks.n_blocks_free;
    struct heard full = {0};
    char stop[8] = "";
    for (int run = 0; run < 3; run++) {
        struct heard h = {.cancel_at = run == 1 ? 7 : 0};
        const char *stops[] = {stop};
        gp.stop = run == 2 ? stops : NULL;
        gp.n_stop = run == 2 ? 1 : 0;
        struct llmem_generate_result r;
        assert_int_equal(llmem_engine_generate(e, prompt, 16, &gp, hear, &h, &r), LLMEM_OK);
        assert_string_equal(r.finish_reason, run == 0 ? "length" : run == 1 ? "cancelled" : "stop");
        assert_int_equal(h.n, r.n_ids);
        assert_memory_equal(h.ids, r.ids, (size_t)r.n_ids * sizeof(int32_t));
        assert_int_equal(h.len, r.text_len);
        assert_memory_equal(h.text, r.text, r.text_len);
        if (run == 0) {
            assert_int_equal(r.n_ids, 40);
            full = h;
            /* four characters from the middle of the text: where they first appear, it stops */
            snprintf(stop, sizeof(stop), "%.4s", full.text + full.len / 2);
        } else if (run == 1) {
            assert_int_equal(r.n_ids, 7);
            assert_memory_equal(r.ids, full.ids, 7 * sizeof(int32_t));
        } else {
            const char *at = strstr(full.text, stop);
            assert_non_null(at);
            assert_int_equal(r.text_len, (size_t)(at - full.text));
            assert_memory_equal(r.text, full.text, r.text_len);
            assert_true(r.n_ids >= 2 && r.n_ids < 40);
            assert_memory_equal(r.ids, full.ids, (size_t)r.n_ids * sizeof(int32_t));
        }
        llmem_generate_result_free(&r);
        llmem_kv_stats(kv, &ks);
        assert_int_equal(ks.n_sequences, 0);
        assert_int_equal(ks.n_blocks_free, free_blocks);
        assert_int_equal(llmem_kv_check(kv), LLMEM_OK);
    }
    llmem_engine_close(e);
}

/* Greedy decode steps queued behind the step in flight, their tokens fed on the device
 * (LLMEM_DECODE_AHEAD), give the tokens of steps queued one at a time: a run to its length; one
 * that samples a stop id mid-run, so that the step queued behind that token is dropped and the
 * sequence set back; and, with the bank on, that run's prompt and tokens again, from the bank.
 * Through the forward pass: three sequences' next two tokens, the second step queued before the
 * first's results reached the host, equal two steps run one after the other. */
/* llmem_forward_start queues a pass of whole rows and llmem_forward_wait copies them: the same
 * rows as llmem_forward_run's (a prefill chunk, then decode steps replayed as a graph); start
 * returns while the device computes (a grammar's masks are made then). */
static void test_start_whole_rows(void **state) {
    (void)state;
    struct llmem_engine *e = open_small_pycoder();
    struct llmem_kv *kv = llmem_engine_kv(e);
    struct llmem_forward *f = llmem_engine_forward(e);
    const int64_t vocab = llmem_model_get_config(llmem_engine_model(e))->geom.vocab_size;
    int32_t toks[40];
    for (int i = 0; i < 40; i++)
        toks[i] = (int32_t)((i * 37 + 5) % vocab);
    float *rows[2][3];
    int busy = 0;
    for (int way = 0; way < 2; way++) {
        int seq = -1;
        assert_int_equal(llmem_kv_seq_new(kv, &seq), LLMEM_OK);
        const int64_t at[4] = {0, 32, 36, 37};
        for (int step = 0; step < 3; step++) {
            rows[way][step] = malloc((size_t)vocab * sizeof(float));
            struct llmem_batch_seq b = {
                .seq = seq, .pos = at[step], .n_tokens = at[step + 1] - at[step]};
            if (way == 0) {
                assert_int_equal(llmem_forward_run(f, toks + at[step], &b, 1, rows[0][step]),
                                 LLMEM_OK);
                continue;
            }
            assert_int_equal(llmem_forward_start(f, toks + at[step], &b, 1, rows[1][step]),
                             LLMEM_OK);
            busy += llmem_forward_busy(f);
            assert_int_equal(llmem_forward_wait(f), LLMEM_OK);
            assert_false(llmem_forward_busy(f));
        }
        llmem_kv_seq_free(kv, seq);
    }
    for (int step = 0; step < 3; step++) {
        assert_memory_equal(rows[0][step], rows[1][step], (size_t)vocab * sizeof(float));
        free(rows[0][step]), free(rows[1][step]);
    }
    printf("  of 3 passes started, %d still running when start returned\n", busy);
    llmem_engine_close(e);
}

static void test_decode_ahead(void **state) {
    (void)state;
    int32_t prompt[20];
    struct llmem_generate_params gp;
    long_run(prompt, 20, 200, 17, 48, &gp);
    struct llmem_generate_result r[2][3];
    int64_t ahead[2];
    int32_t stop = -1;
    for (int on = 0; on < 2; on++) {
        llmem_option_set(LLMEM_OPT_DECODE_AHEAD, on ? "1" : "0");
        struct llmem_engine *e = open_small_pycoder();
        struct llmem_kv *kv = llmem_engine_kv(e);
        assert_int_equal(llmem_engine_generate(e, prompt, 20, &gp, NULL, NULL, &r[on][0]),
                         LLMEM_OK);
        assert_int_equal(r[on][0].n_ids, 48);
        if (on == 0)
            stop = r[0][0].ids[30];
        struct llmem_generate_params sp = gp;
        sp.stop_ids = &stop;
        sp.n_stop_ids = 1;
        assert_int_equal(llmem_engine_generate(e, prompt, 20, &sp, NULL, NULL, &r[on][1]),
                         LLMEM_OK);
        assert_string_equal(r[on][1].finish_reason, "stop");
        int32_t again[20 + 48];
        memcpy(again, prompt, sizeof(prompt));
        memcpy(again + 20, r[on][1].ids, (size_t)r[on][1].n_ids * sizeof(int32_t));
        const int64_t n_again = 20 + r[on][1].n_ids;
        assert_int_equal(llmem_engine_generate(e, again, n_again, &gp, NULL, NULL, &r[on][2]),
                         LLMEM_OK);
        assert_true(r[on][2].reused_tokens >= 16);
        struct llmem_kv_stats ks;
        llmem_kv_stats(kv, &ks);
        assert_int_equal(ks.n_sequences, 0);
        assert_int_equal(llmem_kv_check(kv), LLMEM_OK);
        struct llmem_engine_metrics m;
        llmem_engine_metrics(e, &m);
        ahead[on] = m.ahead_steps;

        /* the forward pass: start_top, start_next, then two waits */
        struct llmem_forward *f = llmem_engine_forward(e);
        const int64_t vocab = llmem_model_get_config(llmem_engine_model(e))->geom.vocab_size;
        float *logits = malloc((size_t)(3 * vocab) * sizeof(float));
        assert_non_null(logits);
        int seq[2][3];
        int32_t next[2][2][3]; /* [one at a time, queued ahead][step][sequence] */
        for (int way = 0; way < 2; way++) {
            for (int s = 0; s < 3; s++) {
                const int64_t len = 20 + 9 * s;
                assert_int_equal(llmem_kv_seq_new(kv, &seq[way][s]), LLMEM_OK);
                struct llmem_batch_seq b = {.seq = seq[way][s], .pos = 0, .n_tokens = len};
                assert_int_equal(llmem_forward_run(f, r[0][0].ids, &b, 1, logits), LLMEM_OK);
            }
            struct llmem_batch_seq b[3];
            int32_t tok[3] = {5, 77, 1234};
            float vals[2][3];
            for (int s = 0; s < 3; s++)
                b[s] = (struct llmem_batch_seq){
                    .seq = seq[way][s], .pos = llmem_kv_seq_length(kv, seq[way][s]), .n_tokens = 1};
            if (way == 0) {
                assert_int_equal(llmem_forward_run_top(f, tok, b, 3, 1, next[0][0], vals[0]),
                                 LLMEM_OK);
                for (int s = 0; s < 3; s++)
                    b[s].pos++;
                assert_int_equal(llmem_forward_run_top(f, next[0][0], b, 3, 1, next[0][1], vals[1]),
                                 LLMEM_OK);
            } else if (on) {
                assert_int_equal(llmem_forward_start_top(f, tok, b, 3, 1, next[1][0], vals[0]),
                                 LLMEM_OK);
                assert_int_equal(llmem_forward_start_next(f, next[1][1], vals[1]), LLMEM_OK);
                assert_int_equal(llmem_forward_wait(f), LLMEM_OK);
                assert_int_equal(llmem_forward_wait(f), LLMEM_OK);
                assert_memory_equal(next[1], next[0], sizeof(next[0]));
                for (int s = 0; s < 3; s++)
                    assert_int_equal(llmem_kv_seq_length(kv, seq[1][s]), 20 + 9 * s + 2);
            } else { /* only after a greedy pass in flight */
                assert_int_equal(llmem_forward_start_next(f, next[1][1], vals[1]), LLMEM_EINVAL);
            }
            for (int s = 0; s < 3; s++)
                llmem_kv_seq_free(kv, seq[way][s]);
        }
        free(logits);
        llmem_engine_close(e);
    }
    llmem_option_set(LLMEM_OPT_DECODE_AHEAD, NULL);
    printf("  decode ahead: %lld steps queued ahead (0 without)\n", (long long)ahead[1]);
    assert_int_equal(ahead[0], 0);
    assert_true(ahead[1] >= 2 * 40);
    for (int run = 0; run < 3; run++) {
        assert_int_equal(r[0][run].n_ids, r[1][run].n_ids);
        assert_memory_equal(r[0][run].ids, r[1][run].ids,
                            (size_t)r[0][run].n_ids * sizeof(int32_t));
        assert_int_equal(r[0][run].text_len, r[1][run].text_len);
        assert_memory_equal(r[0][run].text, r[1][run].text, r[0][run].text_len);
        assert_int_equal(r[0][run].reused_tokens, r[1][run].reused_tokens);
    }
    int64_t at = 0; /* the stopped run ends before the first stop id */
    while (r[0][0].ids[at] != stop)
        at++;
    assert_int_equal(r[0][1].n_ids, at);
    for (int on = 0; on < 2; on++)
        for (int run = 0; run < 3; run++)
            llmem_generate_result_free(&r[on][run]);
}

/* A served request's progress (test_decode_ahead_serving). */
struct served {
    pthread_mutex_t *mu;
    pthread_cond_t *cv;
    int *n_done;
    int tokens, cancel_at, status;
    int64_t n_ids;
    char reason[16];
};

static int served_token(void *arg, const struct llmem_token_event *ev) {
    struct served *o = arg;
    (void)ev;
    pthread_mutex_lock(o->mu);
    int cancel = ++o->tokens == o->cancel_at;
    pthread_mutex_unlock(o->mu);
    return cancel;
}

static void served_done(void *arg, int status, const struct llmem_generate_result *r,
                        const char *message) {
    struct served *o = arg;
    (void)message;
    pthread_mutex_lock(o->mu);
    o->status = status;
    if (r != NULL) {
        snprintf(o->reason, sizeof(o->reason), "%s", r->finish_reason);
        o->n_ids = r->n_ids;
    }
    (*o->n_done)++;
    pthread_cond_broadcast(o->cv);
    pthread_mutex_unlock(o->mu);
}

/* Until request o has streamed `tokens` tokens. */
static void served_wait(struct served *o, int tokens) {
    for (;;) {
        pthread_mutex_lock(o->mu);
        int got = o->tokens;
        pthread_mutex_unlock(o->mu);
        if (got >= tokens)
            return;
        nanosleep(&(struct timespec){0, 200000}, NULL);
    }
}

/* Serving with decode steps queued ahead: requests that arrive while such steps run, one that
 * cancels itself from its token callback and one the caller cancels mid-run end as asked, each
 * with the tokens it wanted, every KV sequence freed. */
static void test_decode_ahead_serving(void **state) {
    (void)state;
    struct llmem_engine *e = open_small_pycoder();
    assert_int_equal(llmem_engine_serve_start(e, NULL), LLMEM_OK);
    enum { N = 6 };
    const int max_tokens[N] = {40, 25, 200, 33, 50, 200}; /* 2 cancels itself, 5 is cancelled */
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    int n_done = 0;
    struct served out[N];
    uint64_t ids[N];
    for (int i = 0; i < N; i++) {
        if (i == 1)
            served_wait(&out[0], 8); /* the rest arrive while it decodes */
        out[i] = (struct served){
            .mu = &mu, .cv = &cv, .n_done = &n_done, .cancel_at = i == 2 ? 10 : 0, .n_ids = -1};
        int32_t prompt[24];
        for (int k = 0; k < 24; k++)
            prompt[k] = (int32_t)(5 + (i * 131 + k * 17) % 3000);
        struct llmem_generate_params p;
        llmem_generate_params_default(&p);
        p.max_tokens = max_tokens[i];
        p.ignore_eos = 1;
        struct llmem_request_events ev = {
            .on_token = served_token, .on_done = served_done, .arg = &out[i]};
        assert_int_equal(llmem_engine_submit(e, prompt, 12 + 2 * i, &p, &ev, &ids[i]), LLMEM_OK);
    }
    served_wait(&out[5], 5);
    llmem_engine_cancel(e, ids[5]);
    pthread_mutex_lock(&mu);
    while (n_done < N)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    struct llmem_engine_metrics m;
    llmem_engine_metrics(e, &m);
    llmem_engine_serve_stop(e);
    printf("  serving: %lld of %lld steps queued ahead\n", (long long)m.ahead_steps,
           (long long)m.steps);
    for (int i = 0; i < N; i++) {
        assert_int_equal(out[i].status, LLMEM_OK);
        if (i == 2) {
            assert_string_equal(out[i].reason, "cancelled");
            assert_int_equal(out[i].n_ids, 10);
        } else if (i == 5) {
            assert_string_equal(out[i].reason, "cancelled");
            assert_true(out[i].n_ids >= 5 && out[i].n_ids < max_tokens[i]);
        } else {
            assert_string_equal(out[i].reason, "length");
            assert_int_equal(out[i].n_ids, max_tokens[i]);
        }
    }
    assert_true(m.ahead_steps > 0);
    assert_int_equal(m.running, 0);
    struct llmem_kv_stats ks;
    llmem_kv_stats(llmem_engine_kv(e), &ks);
    assert_int_equal(ks.n_sequences, 0);
    assert_int_equal(llmem_kv_check(llmem_engine_kv(e)), LLMEM_OK);
    llmem_engine_close(e);
}

/* Decode steps recorded as CUDA graphs and replayed give exactly the logits of the same steps run
 * as usual: batches of two sizes, block tables growing past their padding (128 tokens), and
 * sequences forked mid-block, so that a replayed step first copies a shared block. */
static void test_graphs(void **state) {
    (void)state;
    const char *dir = LLMEM_SOURCE_DIR "/models/pycoder";
    enum { STEPS = 48, SEQS = 4 };
    float *out[2] = {NULL, NULL};
    struct llmem_backend_counters count[2];
    int64_t vocab = 0;
    for (int run = 0; run < 2; run++) {
        llmem_option_set(LLMEM_OPT_CUDA_GRAPHS, run == 0 ? "0" : "1");
        struct llmem_engine *e =
            open_engine(dir, LLMEM_BACKEND_CUDA, LLMEM_PRECISION_FAST, LLMEM_KV_FORMAT_F16);
        struct llmem_kv *kv = llmem_engine_kv(e);
        struct llmem_forward *f = llmem_engine_forward(e);
        vocab = llmem_model_get_config(llmem_engine_model(e))->geom.vocab_size;
        float *logits = malloc((size_t)(SEQS * vocab) * sizeof(float));
        out[run] = calloc((size_t)(STEPS * SEQS * vocab), sizeof(float));
        assert_non_null(logits);
        assert_non_null(out[run]);
        int seq[SEQS];
        const int64_t lens[3] = {100, 117, 9};
        int32_t ids[128];
        for (int s = 0; s < 3; s++) {
            for (int i = 0; i < lens[s]; i++)
                ids[i] = (int32_t)((i * 31 + s * 7) % 1000);
            assert_int_equal(llmem_kv_seq_new(kv, &seq[s]), LLMEM_OK);
            struct llmem_batch_seq b = {.seq = seq[s], .pos = 0, .n_tokens = lens[s]};
            assert_int_equal(llmem_forward_run(f, ids, &b, 1, logits), LLMEM_OK);
        }
        assert_int_equal(llmem_kv_seq_fork(kv, seq[1], &seq[3]), LLMEM_OK);
        for (int step = 0; step < STEPS; step++) {
            if (step == 30) { /* a replayed step's first write copies the shared block */
                llmem_kv_seq_free(kv, seq[3]);
                assert_int_equal(llmem_kv_seq_fork(kv, seq[2], &seq[3]), LLMEM_OK);
            }
            const int n = step % 8 < 6 ? SEQS : 2;
            struct llmem_batch_seq b[SEQS];
            int32_t tok[SEQS];
            for (int s = 0; s < n; s++) {
                b[s] = (struct llmem_batch_seq){
                    .seq = seq[s], .pos = llmem_kv_seq_length(kv, seq[s]), .n_tokens = 1};
                tok[s] = (int32_t)((step * 13 + s * 101) % 1000);
            }
            assert_int_equal(llmem_forward_run(f, tok, b, n, logits), LLMEM_OK);
            memcpy(out[run] + (size_t)(step * SEQS * vocab), logits,
                   (size_t)(n * vocab) * sizeof(float));
        }
        struct llmem_backend *be = llmem_engine_backend(e);
        be->ops->counters(be->ctx, &count[run]);
        free(logits);
        llmem_engine_close(e);
    }
    llmem_option_set(LLMEM_OPT_CUDA_GRAPHS, NULL);
    printf("  graphs: %lld recorded, %lld replayed, %lld missed\n",
           (long long)count[1].graphs_recorded, (long long)count[1].graphs_replayed,
           (long long)count[1].graphs_missed);
    assert_int_equal(count[0].graphs_replayed, 0);
    assert_true(count[1].graphs_recorded >= 2); /* the two batch sizes */
    assert_true(count[1].graphs_replayed >= STEPS / 2);
    assert_memory_equal(out[0], out[1], (size_t)(STEPS * SEQS * vocab) * sizeof(float));
    free(out[0]);
    free(out[1]);
}

/* A step that mixes a decode with two prefill chunks (one write for all their tokens; at fast
 * precision the chunk of 45 takes the prefill kernel, the rest the decode kernel) gives each
 * sequence the logits of running it alone: at f32 precision within twice the f32 parity bound
 * (each run lies within 1e-3 of the CPU's; the GEMMs of 63 rows and of 1, 17 or 45 sum in other
 * orders, and an ulp of a stored f16 key is 1e-3 relative: 4e-4 to 7e-4 measured), at fast
 * precision within the fast drift's bound. */
static void test_mixed_step(void **state) {
    (void)state;
    const char *dir = LLMEM_SOURCE_DIR "/models/pycoder";
    const enum llmem_backend_precision precs[2] = {LLMEM_PRECISION_F32, LLMEM_PRECISION_FAST};
    int32_t ids[3][64];
    for (int s = 0; s < 3; s++)
        for (int i = 0; i < 64; i++)
            ids[s][i] = (int32_t)((i * 37 + s * 11 + 5) % 1000);
    for (int pi = 0; pi < 2; pi++) {
        struct llmem_engine *e =
            open_engine(dir, LLMEM_BACKEND_CUDA, precs[pi], LLMEM_KV_FORMAT_F16);
        struct llmem_kv *kv = llmem_engine_kv(e);
        struct llmem_forward *f = llmem_engine_forward(e);
        const int64_t vocab = llmem_model_get_config(llmem_engine_model(e))->geom.vocab_size;
        float *mixed = malloc((size_t)(3 * vocab) * sizeof(float));
        float *alone = malloc((size_t)(3 * vocab) * sizeof(float));
        assert_non_null(mixed);
        assert_non_null(alone);
        for (int round = 0; round < 2; round++) {
            int seq[3];
            for (int s = 0; s < 3; s++)
                assert_int_equal(llmem_kv_seq_new(kv, &seq[s]), LLMEM_OK);
            /* A: 40 tokens first, then one decode token; B and C: chunks of 45 and 17 */
            struct llmem_batch_seq a = {.seq = seq[0], .pos = 0, .n_tokens = 40};
            assert_int_equal(llmem_forward_run(f, ids[0], &a, 1, alone), LLMEM_OK);
            struct llmem_batch_seq b[3] = {{.seq = seq[0], .pos = 40, .n_tokens = 1},
                                           {.seq = seq[1], .pos = 0, .n_tokens = 45},
                                           {.seq = seq[2], .pos = 0, .n_tokens = 17}};
            if (round == 0) { /* one step: the tokens in the order of the sequences */
                int32_t tok[1 + 45 + 17];
                tok[0] = ids[0][40];
                memcpy(tok + 1, ids[1], 45 * sizeof(int32_t));
                memcpy(tok + 46, ids[2], 17 * sizeof(int32_t));
                assert_int_equal(llmem_forward_run(f, tok, b, 3, mixed), LLMEM_OK);
            } else { /* each alone */
                const int32_t *from[3] = {ids[0] + 40, ids[1], ids[2]};
                for (int s = 0; s < 3; s++)
                    assert_int_equal(llmem_forward_run(f, from[s], &b[s], 1, alone + s * vocab),
                                     LLMEM_OK);
            }
            for (int s = 0; s < 3; s++)
                llmem_kv_seq_free(kv, seq[s]);
        }
        double worst = 0;
        for (int64_t i = 0; i < 3 * vocab; i++)
            worst = fmax(worst, fabs((double)mixed[i] - (double)alone[i]));
        printf("  %s: a mixed step against each sequence alone, max |dlogit| %.2e\n",
               pi == 0 ? "f32" : "fast", worst);
        assert_true(worst <= (pi == 0 ? 2e-3 : 0.25));
        free(mixed), free(alone);
        llmem_engine_close(e);
    }
}

static char refusals[2048];
static void capture_errors(enum llmem_log_level level, const char *line, void *user) {
    (void)user;
    size_t used = strlen(refusals);
    if (level == LLMEM_LOG_ERROR)
        snprintf(refusals + used, sizeof(refusals) - used, "%s\n", line);
}

/* The device plan holds on the GPU: under a budget, a request as long as the resolved context runs
 * with the device allocator's peak within the plan's allocation limit; with most of the pool held
 * by another sequence, a request that cannot fit is refused before any KV is written. */
static void test_device_plan(void **state) {
    (void)state;
    struct llmem_engine_config c;
    pycoder_on_device(&c);
    c.kv_format = LLMEM_KV_FORMAT_F16;
    c.no_bank = 1;
    c.max_sequences = 2;
    c.budget_bytes = (int64_t)160 << 20;
    struct llmem_engine *e = NULL;
    assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_OK);
    const struct llmem_plan *plan = llmem_engine_plan(e);
    const int64_t ctx = plan->context_window_resolved;
    struct llmem_mem_stats ms;
    llmem_mem_stats(llmem_engine_mem(e), &ms);
    printf("  device plan: limit %lld, context %lld\n", (long long)plan->allocation_limit_bytes,
           (long long)ctx);
    assert_true(ms.memory_limit_bytes <= plan->allocation_limit_bytes);
    assert_true(ctx >= 64);
    const int64_t n = ctx - 8;
    int32_t *prompt = malloc((size_t)ctx * sizeof(int32_t));
    assert_non_null(prompt);
    for (int64_t i = 0; i < ctx; i++)
        prompt[i] = (int32_t)(40 + (i * 17) % 3000);
    struct llmem_generate_params p;
    llmem_generate_params_default(&p);
    p.max_tokens = 8;
    p.ignore_eos = 1;
    struct llmem_generate_result r;
    assert_int_equal(llmem_engine_generate(e, prompt, n, &p, NULL, NULL, &r), LLMEM_OK);
    assert_int_equal(r.n_ids, 8);
    llmem_generate_result_free(&r);
    llmem_mem_stats(llmem_engine_mem(e), &ms);
    printf("  device plan: peak %lld of %lld\n", (long long)ms.peak_bytes,
           (long long)ms.memory_limit_bytes);
    assert_true(ms.peak_bytes <= ms.memory_limit_bytes);
    /* most of the pool held elsewhere: refused up front, nothing written */
    struct llmem_kv *kv = llmem_engine_kv(e);
    int other;
    assert_int_equal(llmem_kv_seq_new(kv, &other), LLMEM_OK);
    assert_int_equal(llmem_kv_reserve(kv, other, (llmem_kv_blocks_free(kv) - 2) * 16), LLMEM_OK);
    struct llmem_kv_stats before, after;
    llmem_kv_stats(kv, &before);
    refusals[0] = '\0';
    llmem_log_set_callback(capture_errors, NULL, LLMEM_LOG_ERROR);
    assert_int_equal(llmem_engine_generate(e, prompt, n, &p, NULL, NULL, &r), LLMEM_ENOMEM);
    llmem_log_set_callback(NULL, NULL, LLMEM_LOG_WARN);
    assert_non_null(strstr(refusals, "refused before prefill"));
    llmem_kv_stats(kv, &after);
    assert_int_equal(after.bytes_written, before.bytes_written);
    llmem_kv_seq_free(kv, other);
    free(prompt);
    llmem_engine_close(e);
}

/* The default prefill chunk on a device: as large as the transient reserve the plan commits for
 * 512 tokens holds (8192 with the whole H200; less under a small budget), the plan's commitments
 * the same as with 512; an explicit chunk stays as given. */
static void test_default_chunk(void **state) {
    (void)state;
    const int64_t budgets[] = {0, (int64_t)160 << 20};
    for (int b = 0; b < 2; b++) {
        struct llmem_engine_config c;
        pycoder_on_device(&c);
        c.no_bank = 1;
        c.budget_bytes = budgets[b];
        struct llmem_engine *e = NULL, *e512 = NULL;
        assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e), LLMEM_OK);
        c.max_batch_tokens = 512;
        assert_int_equal(llmem_engine_open(&c, NULL, NULL, &e512), LLMEM_OK);
        const int64_t chunk = llmem_engine_get_config(e)->max_batch_tokens;
        printf("  budget %lld: prefill chunk %lld\n", (long long)budgets[b], (long long)chunk);
        assert_true(chunk >= 512 && chunk <= 8192 && (chunk & (chunk - 1)) == 0);
        if (b == 0)
            assert_int_equal(chunk, 8192);
        assert_int_equal(llmem_forward_max_tokens(llmem_engine_forward(e)), chunk);
        assert_int_equal(llmem_engine_plan(e)->runtime_transients_bytes,
                         llmem_engine_plan(e512)->runtime_transients_bytes);
        assert_int_equal(llmem_engine_get_config(e512)->max_batch_tokens, 512);
        llmem_engine_close(e512);
        llmem_engine_close(e);
    }
}

static int setup(void **state) {
    (void)state;
    struct llmem_mem_config cfg = {.ops = llmem_backend_cuda_memory(0)};
    if (llmem_mem_create(&cfg, &dmem) != LLMEM_OK ||
        llmem_backend_cpu_create(2, &cpu) != LLMEM_OK ||
        llmem_backend_cuda_create(0, LLMEM_PRECISION_FAST, dmem, &gpu) != LLMEM_OK ||
        llmem_backend_cuda_create(0, LLMEM_PRECISION_F32, dmem, &gpu_f32) != LLMEM_OK)
        return -1;
    /* the reference: f32 products (at fast precision an AVX512-BF16 CPU rounds x to bf16) */
    llmem_backend_cpu_set_precision(cpu, LLMEM_PRECISION_F32);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    llmem_backend_destroy(gpu);
    llmem_backend_destroy(gpu_f32);
    llmem_backend_destroy(cpu);
    llmem_mem_destroy(dmem);
    return 0;
}

int main(int argc, char **argv) {
    /* test_split_one_device's ranks on this device (read once, at the first option asked for) */
    setenv("LLMEM_SPLIT_ONE_DEVICE", "1", 1);
    const struct CMUnitTest build[] = {cmocka_unit_test(test_blas_opened_late),
                                       cmocka_unit_test(test_build)};
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_device_memory),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_swiglu_add),
        cmocka_unit_test(test_embedding),
        cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_matmul_quantized),
        cmocka_unit_test(test_matmul_multi),
        cmocka_unit_test(test_matmul_pair),
        cmocka_unit_test(test_matmul_swiglu),
        cmocka_unit_test(test_quantized_sets),
        cmocka_unit_test(test_moe),
        cmocka_unit_test(test_shadow_copies),
        cmocka_unit_test(test_out_of_memory),
        cmocka_unit_test(test_kv_device),
        cmocka_unit_test(test_kv_copy_out_async),
        cmocka_unit_test(test_models),
        cmocka_unit_test(test_wide_decode),
        cmocka_unit_test(test_experts_on_host),
        cmocka_unit_test(test_quantized_caches),
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_split_one_device),
        cmocka_unit_test(test_spill_on_device),
        cmocka_unit_test(test_graphs),
        cmocka_unit_test(test_mixed_step),
        cmocka_unit_test(test_top_k),
        cmocka_unit_test(test_sampling_on_device),
        cmocka_unit_test(test_streaming),
        cmocka_unit_test(test_start_whole_rows),
        cmocka_unit_test(test_decode_ahead),
        cmocka_unit_test(test_decode_ahead_serving),
        cmocka_unit_test(test_device_plan),
        cmocka_unit_test(test_default_chunk),
    };
    const struct tu_group groups[] = {
        TU_GROUP("build", build, NULL),
        TU_GROUP_FIXTURES("gpu", tests, tu_gpu_unavailable, setup, teardown),
    };
    return tu_main(argc, argv, groups, sizeof(groups) / sizeof(groups[0]));
}
