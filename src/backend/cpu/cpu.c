/*
 * backend/cpu/cpu.c — the CPU backend (SPEC §8): its table, its context (the thread pool and the
 * GEMM scratch, allocated once at create), and the element-wise operations.
 *
 * The element-wise operations (rmsnorm, rope, swiglu, embedding, add) are written as plain loops
 * over f32 that compilers vectorize; they are memory- or libm-bound, and each runs on the calling
 * thread alone unless it is large enough (CPU_PAR_MIN elements) for a pool dispatch (~1 µs) to
 * pay off, in which case the rows or the elements are split into contiguous ranges.
 *
 * Numerics follow the Hugging Face Llama modules in f32: rmsnorm sums the squares (in double, so
 * the sum is exact to f32 rounding for any dim), then x · (1/sqrt(mean + eps)) · weight in f32;
 * rope takes angle = (float)pos · inv_freq in f32 and the f32 roundings of cos and sin of that
 * angle computed in double (as PyTorch's correctly rounded results do); silu is x / (1 + e^−x).
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_int.h"
#include "core/log.h"
#include "llmem/pool.h"
#include "llmem/mem.h"
#include "llmem/dtype.h"

/* Elements below which an element-wise operation runs on the calling thread alone. */
#define CPU_PAR_MIN ((int64_t)1 << 15)

float llmem_cpu_f16_to_f32(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t exp = ((uint32_t)h >> 10) & 0x1f, mant = (uint32_t)h & 0x3ff;
    union {
        uint32_t u;
        float f;
    } v;
    if (exp == 0x1f) {
        v.u = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        v.f = (float)mant * 0x1p-24f; /* zero or subnormal: exact */
        v.u |= sign;
    } else {
        v.u = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    return v.f;
}

/* ---- parallel ranges --------------------------------------------------------------------------
 */

struct range_job {
    void (*fn)(void *arg, int64_t begin, int64_t end);
    void *arg;
    int64_t count, per_task;
};

static void range_task(void *arg, int task, int thread) {
    (void)thread;
    const struct range_job *j = arg;
    int64_t b = (int64_t)task * j->per_task;
    int64_t e = b + j->per_task < j->count ? b + j->per_task : j->count;
    if (b < e)
        j->fn(j->arg, b, e);
}

/* fn over [0, count) in contiguous ranges; `work` is the total element count (for the decision
 * to go parallel at all). */
static void parallel_range(struct cpu_ctx *c, int64_t count, int64_t work,
                           void (*fn)(void *arg, int64_t begin, int64_t end), void *arg) {
    if (count <= 0)
        return;
    if (c->n_threads == 1 || work < CPU_PAR_MIN || count == 1) {
        fn(arg, 0, count);
        return;
    }
    int64_t tasks = count < c->n_threads ? count : c->n_threads;
    struct range_job j = {fn, arg, count, (count + tasks - 1) / tasks};
    llmem_pool_run(c->pool, (int)((count + j.per_task - 1) / j.per_task), range_task, &j);
}

/* ---- rmsnorm ----------------------------------------------------------------------------------
 */

struct rmsnorm_args {
    const float *x, *weight;
    float *y;
    int64_t dim;
    float eps;
};

static void rmsnorm_rows(void *arg, int64_t begin, int64_t end) {
    const struct rmsnorm_args *a = arg;
    const int64_t dim = a->dim;
    for (int64_t t = begin; t < end; t++) {
        const float *x = a->x + t * dim;
        float *y = a->y + t * dim;
        double s[4] = {0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 4 <= dim; i += 4)
            for (int k = 0; k < 4; k++)
                s[k] += (double)x[i + k] * (double)x[i + k];
        for (; i < dim; i++)
            s[0] += (double)x[i] * (double)x[i];
        float mean = (float)(((s[0] + s[1]) + (s[2] + s[3])) / (double)dim);
        float inv = 1.0f / sqrtf(mean + a->eps);
        for (i = 0; i < dim; i++)
            y[i] = (x[i] * inv) * a->weight[i];
    }
}

static void cpu_rmsnorm(void *ctx, const float *x, const float *weight, int64_t n, int64_t dim,
                        float eps, float *y) {
    LLMEM_ASSERT(x != NULL && weight != NULL && y != NULL && dim > 0 && n >= 0);
    struct rmsnorm_args a = {x, weight, y, dim, eps};
    parallel_range(ctx, n, n * dim, rmsnorm_rows, &a);
}

/* ---- rope -------------------------------------------------------------------------------------
 */

#define ROPE_HALF_MAX 1024

struct rope_args {
    float *x;
    int n_heads, head_dim;
    const int64_t *pos;
    const float *inv_freq;
    int pairs; /* pair i read from (2i, 2i + 1) (rope_pairs), else from (i, i + head_dim/2) */
};

static void rope_rows(void *arg, int64_t begin, int64_t end) {
    const struct rope_args *a = arg;
    const int half = a->head_dim / 2;
    float cs[ROPE_HALF_MAX], sn[ROPE_HALF_MAX];
    for (int64_t t = begin; t < end; t++) {
        float p = (float)a->pos[t];
        for (int i = 0; i < half; i++) {
            float angle = p * a->inv_freq[i];
            cs[i] = (float)cos((double)angle);
            sn[i] = (float)sin((double)angle);
        }
        for (int h = 0; h < a->n_heads; h++) {
            float *v = a->x + (t * a->n_heads + h) * (int64_t)a->head_dim;
            float in[2 * ROPE_HALF_MAX];
            if (a->pairs) /* back to halves first: the same operands, the same bits */
                for (int i = 0; i < half; i++)
                    in[i] = v[2 * i], in[i + half] = v[2 * i + 1];
            else
                memcpy(in, v, (size_t)a->head_dim * sizeof(float));
            for (int i = 0; i < half; i++) {
                float x0 = in[i], x1 = in[i + half];
                float r0 = x0 * cs[i], r1 = -x1 * sn[i];
                float r2 = x1 * cs[i], r3 = x0 * sn[i];
                v[i] = r0 + r1;
                v[i + half] = r2 + r3;
            }
        }
    }
}

static void rope_run(void *ctx, float *x, int64_t n, int n_heads, int head_dim, const int64_t *pos,
                     const float *inv_freq, int pairs) {
    LLMEM_ASSERT(x != NULL && pos != NULL && inv_freq != NULL && n >= 0 && n_heads > 0);
    LLMEM_ASSERT(head_dim > 0 && head_dim % 2 == 0 && head_dim / 2 <= ROPE_HALF_MAX);
    struct rope_args a = {x, n_heads, head_dim, pos, inv_freq, pairs};
    /* cos and sin cost ~40 ns a pair: count them as work too. */
    parallel_range(ctx, n, n * ((int64_t)n_heads * head_dim + 20 * head_dim), rope_rows, &a);
}

static void cpu_rope(void *ctx, float *x, int64_t n, int n_heads, int head_dim, const int64_t *pos,
                     const float *inv_freq) {
    rope_run(ctx, x, n, n_heads, head_dim, pos, inv_freq, 0);
}

static void cpu_rope_pairs(void *ctx, float *x, int64_t n, int n_heads, int head_dim,
                           const int64_t *pos, const float *inv_freq) {
    rope_run(ctx, x, n, n_heads, head_dim, pos, inv_freq, 1);
}

/* ---- swiglu, add ------------------------------------------------------------------------------
 */

struct swiglu_args {
    const float *gate, *up;
    float *out;
};

static void swiglu_range(void *arg, int64_t begin, int64_t end) {
    const struct swiglu_args *a = arg;
    for (int64_t i = begin; i < end; i++) {
        float g = a->gate[i];
        a->out[i] = g / (1.0f + expf(-g)) * a->up[i];
    }
}

void llmem_cpu_swiglu(void *ctx, const float *gate, const float *up, int64_t n, float *out) {
    LLMEM_ASSERT(gate != NULL && up != NULL && out != NULL && n >= 0);
    struct swiglu_args a = {gate, up, out};
    /* expf costs several ns: worth threads at an eighth of the usual size. */
    parallel_range(ctx, n, n * 8, swiglu_range, &a);
}

struct add_args {
    float *y;
    const float *x;
};

static void add_range(void *arg, int64_t begin, int64_t end) {
    const struct add_args *a = arg;
    float *restrict y = a->y;
    const float *restrict x = a->x;
    for (int64_t i = begin; i < end; i++)
        y[i] += x[i];
}

static void cpu_add(void *ctx, float *y, const float *x, int64_t n) {
    LLMEM_ASSERT(y != NULL && x != NULL && n >= 0);
    struct add_args a = {y, x};
    /* Bandwidth-bound: threads pay off only for large vectors. */
    parallel_range(ctx, n, n / 4, add_range, &a);
}

/* ---- embedding --------------------------------------------------------------------------------
 */

struct embedding_args {
    const struct llmem_weight *table;
    const int32_t *ids;
    float *out;
};

static void embedding_rows(void *arg, int64_t begin, int64_t end) {
    const struct embedding_args *a = arg;
    const int64_t dim = a->table->cols;
    for (int64_t t = begin; t < end; t++) {
        LLMEM_ASSERT(a->ids[t] < a->table->rows);
        float *o = a->out + t * dim;
        if (a->ids[t] < 0) { /* another rank's token */
            memset(o, 0, (size_t)dim * sizeof(float));
            continue;
        }
        const uint8_t *row = (const uint8_t *)a->table->data +
                             (size_t)a->ids[t] * (size_t)llmem_weight_row_bytes(a->table);
        if (a->table->quant != 0) {
            llmem_weight_dequantize_row(a->table, a->ids[t], o);
            continue;
        }
        switch (a->table->dtype) {
        case LLMEM_DTYPE_BF16:
            for (int64_t i = 0; i < dim; i++)
                o[i] = cpu_bf16_to_f32(cpu_u16_at(row, i));
            break;
        case LLMEM_DTYPE_F16:
            for (int64_t i = 0; i < dim; i++)
                o[i] = llmem_cpu_f16_to_f32(cpu_u16_at(row, i));
            break;
        default: memcpy(o, row, (size_t)dim * sizeof(float));
        }
    }
}

static void cpu_embedding(void *ctx, const struct llmem_weight *table, const int32_t *ids,
                          int64_t n, float *out) {
    LLMEM_ASSERT(table != NULL && ids != NULL && out != NULL && n >= 0);
    LLMEM_ASSERT(table->quant != 0 || table->dtype == LLMEM_DTYPE_F32 ||
                 table->dtype == LLMEM_DTYPE_F16 || table->dtype == LLMEM_DTYPE_BF16);
    struct embedding_args a = {table, ids, out};
    parallel_range(ctx, n, n * table->cols, embedding_rows, &a);
}

/* ---- the sum of a split's ranks in host memory -------------------------------------------- */

/* The ranks' threads of a host group meet at a barrier before and after each sum. */
struct host_group {
    struct llmem_backend_group group;
    pthread_barrier_t met;
    float *buf[LLMEM_SPLIT_MAX];
};

static int host_allreduce_rank(void *ctx, int rank, float *buf, int64_t count) {
    struct host_group *h = ctx;
    const int n = h->group.n;
    h->buf[rank] = buf;
    pthread_barrier_wait(&h->met); /* every rank's part written */
    const int64_t lo = count * rank / n, hi = count * (rank + 1) / n;
    for (int64_t i = lo; i < hi; i++) {
        float sum = h->buf[0][i];
        for (int r = 1; r < n; r++)
            sum += h->buf[r][i];
        for (int r = 0; r < n; r++)
            h->buf[r][i] = sum;
    }
    pthread_barrier_wait(&h->met); /* every slice summed */
    return LLMEM_OK;
}

int llmem_backend_host_group_create(int n, const struct llmem_backend *const *ranks,
                                    struct llmem_backend_group *group) {
    LLMEM_ASSERT(n >= 1 && n <= LLMEM_SPLIT_MAX && ranks != NULL && group != NULL);
    struct host_group *h = calloc(1, sizeof(*h));
    if (h == NULL || pthread_barrier_init(&h->met, NULL, (unsigned)n) != 0) {
        free(h);
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    h->group = (struct llmem_backend_group){
        .n = n, .ranks = ranks, .allreduce_rank = host_allreduce_rank, .ctx = h};
    *group = h->group;
    return LLMEM_OK;
}

void llmem_backend_host_group_free(struct llmem_backend_group *group) {
    struct host_group *h = group != NULL ? group->ctx : NULL;
    if (h == NULL)
        return;
    pthread_barrier_destroy(&h->met);
    free(h);
    group->ctx = NULL;
}

/* ---- the table --------------------------------------------------------------------------------
 */

static void cpu_destroy(void *ctx) {
    struct cpu_ctx *c = ctx;
    if (c == NULL)
        return;
    if (c->own_pool)
        llmem_pool_destroy(c->pool);
    if (c->mem != NULL) {
        llmem_mem_free(c->mem, c->xt);
        llmem_mem_free(c->mem, c->wpanel);
    } else {
        free(c->xt);
        free(c->wpanel);
    }
    free(c);
}

static int cpu_threads(void *ctx) {
    return ((struct cpu_ctx *)ctx)->n_threads;
}

static const struct llmem_mem_raw_ops *cpu_memory(void *ctx) {
    (void)ctx;
    return llmem_mem_host_ops();
}

static int cpu_copy(void *ctx, void *dst, const void *src, size_t bytes) {
    (void)ctx;
    memmove(dst, src, bytes);
    return LLMEM_OK;
}

static int cpu_sync(void *ctx) {
    (void)ctx;
    return LLMEM_OK;
}

static void cpu_counters(void *ctx, struct llmem_backend_counters *out) {
    const struct cpu_ctx *c = ctx;
    *out = (struct llmem_backend_counters){.weight_bytes = c->weight_bytes};
}

static const struct llmem_backend_ops cpu_ops = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .threads = cpu_threads,
    .matmul = llmem_cpu_matmul,
    .matmul_multi = llmem_cpu_matmul_multi,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .rope_pairs = cpu_rope_pairs,
    .swiglu = llmem_cpu_swiglu,
    .embedding = cpu_embedding,
    .add = cpu_add,
    .moe = llmem_cpu_moe,
    .memory = cpu_memory,
    .copy = cpu_copy,
    .sync = cpu_sync,
    .counters = cpu_counters,
};

int64_t llmem_backend_cpu_scratch_bytes(int n_threads) {
    return (int64_t)CPU_GEMM_XT_BYTES +
           (int64_t)n_threads * (int64_t)CPU_GEMM_THREAD_FLOATS * (int64_t)sizeof(float);
}

static int cpu_create(int n_threads, struct llmem_pool *pool, struct llmem_mem *mem,
                      struct llmem_backend **out) {
    LLMEM_ASSERT(out != NULL);
    *out = NULL;
    struct llmem_backend *b = calloc(1, sizeof(*b));
    struct cpu_ctx *c = calloc(1, sizeof(*c));
    if (b == NULL || c == NULL) {
        free(b);
        free(c);
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    c->pool = pool;
    if (pool == NULL) {
        int rc = llmem_pool_create(n_threads, &c->pool);
        if (rc != LLMEM_OK) {
            free(b);
            free(c);
            return rc;
        }
        c->own_pool = 1;
    }
    c->mem = mem;
    c->n_threads = llmem_pool_threads(c->pool);
    c->isa = llmem_cpu_isa_best();
    c->path = CPU_MATMUL_AUTO;
    c->precision = LLMEM_PRECISION_FAST;
    c->gemm_min_n = 24; /* measured crossover: below, converting W costs more than it saves */
    size_t panel = (size_t)llmem_backend_cpu_scratch_bytes(c->n_threads) - CPU_GEMM_XT_BYTES;
    int ok;
    if (mem != NULL) {
        c->xt = llmem_mem_alloc(mem, CPU_GEMM_XT_BYTES, LLMEM_TAG_SCRATCH);
        c->wpanel = llmem_mem_alloc(mem, panel, LLMEM_TAG_SCRATCH);
        ok = c->xt != NULL && c->wpanel != NULL; /* large buffers are page-aligned */
    } else {
        ok = posix_memalign((void **)&c->xt, 64, CPU_GEMM_XT_BYTES) == 0 &&
             posix_memalign((void **)&c->wpanel, 64, panel) == 0;
        if (!ok)
            LLMEM_ERROR("out of memory for %zu bytes of GEMM scratch", CPU_GEMM_XT_BYTES + panel);
    }
    if (!ok) {
        cpu_destroy(c);
        free(b);
        return LLMEM_ENOMEM;
    }
    b->ops = &cpu_ops;
    b->ctx = c;
    *out = b;
    return LLMEM_OK;
}

int llmem_backend_cpu_create(int n_threads, struct llmem_backend **out) {
    return cpu_create(n_threads, NULL, NULL, out);
}

int llmem_backend_cpu_create_shared(struct llmem_pool *pool, struct llmem_mem *mem,
                                    struct llmem_backend **out) {
    LLMEM_ASSERT(pool != NULL && mem != NULL);
    return cpu_create(0, pool, mem, out);
}

void llmem_backend_destroy(struct llmem_backend *backend) {
    if (backend == NULL)
        return;
    backend->ops->destroy(backend->ctx);
    free(backend);
}

enum cpu_isa llmem_backend_cpu_set_isa(struct llmem_backend *backend, enum cpu_isa isa) {
    struct cpu_ctx *c = backend->ctx;
    enum cpu_isa best = llmem_cpu_isa_best();
    c->isa = isa > best ? best : isa;
    return c->isa;
}

void llmem_backend_cpu_set_precision(struct llmem_backend *backend,
                                     enum llmem_backend_precision precision) {
    LLMEM_ASSERT(backend != NULL && strcmp(backend->ops->name, "cpu") == 0);
    ((struct cpu_ctx *)backend->ctx)->precision = precision;
}

void llmem_backend_cpu_set_vnni(struct llmem_backend *backend, int on) {
    ((struct cpu_ctx *)backend->ctx)->no_vnni = !on;
}

void llmem_backend_cpu_set_amx(struct llmem_backend *backend, int on) {
    ((struct cpu_ctx *)backend->ctx)->no_amx = !on;
}

const char *llmem_backend_cpu_matmul_kernels(void) {
    return llmem_cpu_q_kernels_name(llmem_cpu_isa_best());
}

const char *llmem_backend_cpu_bf16_kernels(void) {
    const enum cpu_isa isa = llmem_cpu_isa_best();
    if (!llmem_cpu_bf16_isa(isa))
        return llmem_cpu_isa_name(isa);
    return llmem_sys_isa_features() & LLMEM_ISA_AMX_BF16 ? "amx_bf16" : "avx512_bf16";
}

void llmem_backend_cpu_set_matmul_path(struct llmem_backend *backend, enum cpu_matmul_path path) {
    ((struct cpu_ctx *)backend->ctx)->path = path;
}
