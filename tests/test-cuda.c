/*
 * tests/test-cuda.c — the CUDA backend against the CPU backend, the reference: device memory
 * through the caching allocator, and every operation of the backend table on the same random
 * inputs, compared within the bounds below. The build checks run everywhere; the rest needs a
 * CUDA build and a GPU, and the suite exits 77 (skipped) without them.
 *
 * Bounds: the elementwise operations follow the CPU's arithmetic and agree to a few units in the
 * last place (1e-6 relative); matmul at f32 precision differs only by the order of the sums
 * (1e-5 of the largest output); at fast precision the activations are rounded to bf16 or f16 for
 * the tensor cores, which costs up to 1e-2 of the largest output (measured values are printed).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#include "backend/ops.h"
#include "llmem/backend.h"
#include "llmem/mem.h"
#include "llmem/status.h"

static struct llmem_backend *cpu, *gpu, *gpu_f32;
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
static double rel_diff(const float *a, const float *b, int64_t n) {
    double d = 0, m = 1e-30;
    for (int64_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - (double)b[i]));
        m = fmax(m, fabs((double)a[i]));
    }
    return d / m;
}

/* ---- builds without CUDA ---------------------------------------------------------------------
 */

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
        struct llmem_weight wh = {table, dts[k], vocab, dim}, wd = {dt, dts[k], vocab, dim};
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

/* matmul for every weight dtype, decode and GEMM row counts, aligned and odd shapes, with and
 * without bias, at both precisions. */
static void test_matmul(void **state) {
    (void)state;
    const enum llmem_dtype dts[] = {LLMEM_DTYPE_BF16, LLMEM_DTYPE_F16, LLMEM_DTYPE_F32};
    const int64_t ns[] = {1, 3, 8, 9, 64};
    const int64_t shapes[][2] = {{300, 512}, {77, 100}, {1024, 2048}};
    double worst_f32 = 0, worst_fast = 0;
    for (int k = 0; k < 3; k++)
        for (int s = 0; s < 3; s++) {
            const int64_t rows = shapes[s][0], cols = shapes[s][1];
            size_t bytes;
            void *w = random_weight(dts[k], rows, cols, &bytes);
            void *dw = to_device(w, bytes);
            float *bias = random_floats(rows, 1.0f);
            float *dbias = to_device(bias, (size_t)rows * 4);
            struct llmem_weight wh = {w, dts[k], rows, cols}, wd = {dw, dts[k], rows, cols};
            for (int t = 0; t < 5; t++) {
                const int64_t n = ns[t];
                const int with_bias = (t + s) % 2;
                float *x = random_floats(n * cols, 1.0f), *y = malloc((size_t)(n * rows) * 4);
                float *dx = to_device(x, (size_t)(n * cols) * 4);
                float *dy = llmem_mem_alloc(dmem, (size_t)(n * rows) * 4, LLMEM_TAG_SCRATCH);
                cpu->ops->matmul(cpu->ctx, &wh, x, n, y, with_bias ? bias : NULL);
                for (int p = 0; p < 2; p++) {
                    struct llmem_backend *b = p == 0 ? gpu_f32 : gpu;
                    b->ops->matmul(b->ctx, &wd, dx, n, dy, with_bias ? dbias : NULL);
                    assert_int_equal(b->ops->sync(b->ctx), LLMEM_OK);
                    float *g = to_host(dy, n * rows);
                    double e = rel_diff(y, g, n * rows);
                    if (p == 0 || n <= 8 || dts[k] == LLMEM_DTYPE_F32) {
                        worst_f32 = fmax(worst_f32, e);
                        if (e > 1e-5)
                            fail_msg("f32 matmul %s %lldx%lld n %lld: %.3e",
                                     llmem_dtype_name(dts[k]), (long long)rows, (long long)cols,
                                     (long long)n, e);
                    } else {
                        worst_fast = fmax(worst_fast, e);
                        assert_true(e <= 1e-2);
                    }
                    free(g);
                }
                llmem_mem_free(dmem, dx), llmem_mem_free(dmem, dy);
                free(x), free(y);
            }
            llmem_mem_free(dmem, dw), llmem_mem_free(dmem, dbias);
            free(w), free(bias);
        }
    printf("  matmul: f32 paths %.2e, fast GEMMs %.2e of the largest output\n", worst_f32,
           worst_fast);
    assert_true(worst_fast > 0); /* the fast GEMMs did round (the test would see a no-op) */
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
    struct llmem_weight wd = {dw, LLMEM_DTYPE_BF16, rows, cols};
    b->ops->matmul(b->ctx, &wd, dx, n, dy, NULL);
    assert_int_equal(b->ops->sync(b->ctx), LLMEM_ENOMEM);
    assert_int_equal(b->ops->sync(b->ctx), LLMEM_ENOMEM);
    llmem_backend_destroy(b);
    llmem_mem_destroy(m);
    llmem_mem_free(dmem, dw), llmem_mem_free(dmem, dx), llmem_mem_free(dmem, dy);
    free(w);
}

static int setup(void **state) {
    (void)state;
    struct llmem_mem_config cfg = {.ops = llmem_backend_cuda_memory(0)};
    if (llmem_mem_create(&cfg, &dmem) != LLMEM_OK ||
        llmem_backend_cpu_create(2, &cpu) != LLMEM_OK ||
        llmem_backend_cuda_create(0, LLMEM_PRECISION_FAST, dmem, &gpu) != LLMEM_OK ||
        llmem_backend_cuda_create(0, LLMEM_PRECISION_F32, dmem, &gpu_f32) != LLMEM_OK)
        return -1;
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

int main(void) {
    const struct CMUnitTest build[] = {cmocka_unit_test(test_build)};
    int failed = cmocka_run_group_tests_name("build", build, NULL, NULL);
    if (failed)
        return failed;
    int n = 0;
    llmem_backend_device_count(&n);
    if (!llmem_backend_cuda_available() || n == 0) {
        printf("skipped: %s\n",
               llmem_backend_cuda_available() ? "no CUDA device" : "built without CUDA");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_device_memory), cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rope),          cmocka_unit_test(test_swiglu_add),
        cmocka_unit_test(test_embedding),     cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_out_of_memory),
    };
    return cmocka_run_group_tests_name("cuda", tests, setup, teardown);
}
