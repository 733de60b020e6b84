/*
 * backend/cuda/ops.cu — the CUDA backend's table (backend/ops.h): every operation of a forward
 * pass on one GPU, queued in order on the backend's own stream. Here: the table, the context's
 * creation and destruction, failures, the profile, scratch, copies and synchronization. The
 * operations live in files by family: elementwise.cu (norms, RoPE, SwiGLU, embedding, add),
 * gemm.cu (matmul: the decode GEMV and the GEMMs), attend.cu (the KV write and paged attention),
 * topk.cu (the top k of logits rows), graph.cu (the upload ring of per-call data, and decode steps
 * recorded and replayed as CUDA graphs); ops_int.h is what they share.
 *
 * LLMEM_CUDA_PROFILE=1 times every operation's kernels on the device (events around them, the
 * host waiting after each: no graphs, no overlap between kernels) and logs the totals per
 * operation (INFO) when the backend is destroyed: where a pass's device time goes.
 */
#include "backend/cuda/ops_int.h"

cudaEvent_t llmem_cuda_profile_start = nullptr;
int llmem_cuda_profile_pending = 0;

namespace llmem_cuda {

void launched(struct cuda_ctx *c, const char *what) {
    check(c, cudaGetLastError(), what);
    if (!c->profiling || !llmem_cuda_profile_pending)
        return;
    /* the kernels since the start event: waited for, timed, added to the operation's total */
    float ms = 0;
    llmem_cuda_profile_pending = 0;
    if (cudaEventRecord(c->profile_end, c->stream) != cudaSuccess ||
        cudaEventSynchronize(c->profile_end) != cudaSuccess ||
        cudaEventElapsedTime(&ms, llmem_cuda_profile_start, c->profile_end) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    int i = 0;
    while (i < c->profile_n && strcmp(c->profile[i].what, what) != 0)
        i++;
    if (i == PROFILE_OPS)
        return;
    if (i == c->profile_n)
        c->profile[c->profile_n++] = (struct profile_op){what, 0, 0};
    c->profile[i].ms += ms;
    c->profile[i].calls++;
}

/* The profile's totals, largest first, logged (INFO). */
static void profile_log(struct cuda_ctx *c) {
    double total = 0;
    for (int i = 0; i < c->profile_n; i++)
        total += c->profile[i].ms;
    qsort(c->profile, (size_t)c->profile_n, sizeof(c->profile[0]),
          [](const void *a, const void *b) {
              double x = ((const struct profile_op *)a)->ms, y = ((const struct profile_op *)b)->ms;
              return (x < y) - (x > y);
          });
    LLMEM_INFO("cuda profile, device %d: %.3f ms of kernels", c->device, total);
    for (int i = 0; i < c->profile_n; i++) {
        const struct profile_op *o = &c->profile[i];
        LLMEM_INFO("cuda profile: %-12s %10.3f ms %5.1f %% %9lld calls %9.2f us each", o->what,
                   o->ms, total > 0 ? 100 * o->ms / total : 0, (long long)o->calls,
                   1000 * o->ms / (double)o->calls);
    }
}

void *dev_alloc(struct cuda_ctx *c, size_t bytes) {
    if (c->mem != NULL)
        return llmem_mem_alloc(c->mem, bytes, LLMEM_TAG_SCRATCH);
    void *p = NULL;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        LLMEM_ERROR("cuda backend: cannot allocate %zu bytes of scratch on device %d", bytes,
                    c->device);
        return NULL;
    }
    return p;
}

void dev_free(struct cuda_ctx *c, void *p) {
    if (p == NULL)
        return;
    if (c->mem != NULL)
        llmem_mem_free(c->mem, p);
    else
        cudaFree(p);
}

/* *buf (of *have bytes) grown to at least `bytes`, after the stream drains; NULL (the backend
 * failed) when the memory is refused, or while a pass is recorded (it then runs without a
 * graph). */
static void *grown(struct cuda_ctx *c, void **buf, size_t *have, size_t bytes, const char *what) {
    if (bytes <= *have)
        return *buf;
    if (c->mode != PASS_NOW) {
        c->pass_bad = 1;
        return NULL;
    }
    cudaStreamSynchronize(c->stream);
    dev_free(c, *buf);
    *buf = dev_alloc(c, bytes);
    *have = *buf != NULL ? bytes : 0;
    if (*buf == NULL)
        fail(c, LLMEM_ENOMEM, what, NULL); /* logged by the allocator */
    return *buf;
}

/* Scratch of at least `bytes`. */
void *scratch(struct cuda_ctx *c, size_t bytes) {
    return grown(c, &c->scratch, &c->scratch_bytes, bytes, "scratch");
}

/* The buffer of dequantized weight slices, at least `bytes`. */
void *wslice(struct cuda_ctx *c, size_t bytes) {
    return grown(c, &c->wslice, &c->wslice_bytes, bytes, "weight slice");
}

static int cuda_threads(void *ctx) {
    (void)ctx;
    return 1;
}

static const struct llmem_mem_raw_ops *cuda_memory(void *ctx) {
    return llmem_cuda_mem_ops(((struct cuda_ctx *)ctx)->device);
}

int cuda_sync(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    rope_flush(c);
    if (c->mode == PASS_NOW) {
        c->idle = check(c, cudaStreamSynchronize(c->stream), "synchronize") == LLMEM_OK;
        c->ring_live = c->arena_queued = 0;
        while (c->top_n > 0) /* the results of the top_k calls outstanding */
            top_deliver(c);
    }
    return c->failed;
}

static int cuda_busy(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    return c->mode == PASS_NOW && cudaStreamQuery(c->stream) == cudaErrorNotReady;
}

/* Inside a pass being recorded or staged: a copy between device buffers (a shared KV block made
 * the sequence's own) is queued now, ahead of the graph, and is no part of the recording: while
 * recording, it makes the graph one to run once. */
static int cuda_copy(void *ctx, void *dst, const void *src, size_t bytes) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    rope_flush(c);
    c->idle = 0;
    c->shadow_x = NULL;
    if (bytes > 0 && c->mode != PASS_NOW) {
        if (cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream) != cudaSuccess) {
            (void)cudaGetLastError();
            c->pass_bad = 1;
        }
        c->pass_once |= c->mode == PASS_CAPTURE;
        return c->failed;
    }
    if (bytes > 0)
        check(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream), "copy");
    return cuda_sync(ctx);
}

static void cuda_copy_out(void *ctx, void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                          size_t bytes, size_t rows) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (c->pass != NULL) { /* inside a pass: queued as its operations */
        for (size_t r = 0; r < rows; r++)
            cuda_copy(ctx, (char *)dst + r * dst_pitch, (const char *)src + r * src_pitch, bytes);
        return;
    }
    rope_flush(c);
    if (bytes == 0 || rows == 0 || c->failed)
        return;
    if (check(c, cudaEventRecord(c->copy_after, c->stream), "copy out") != LLMEM_OK ||
        check(c, cudaStreamWaitEvent(c->copy_stream, c->copy_after, 0), "copy out") != LLMEM_OK)
        return;
    c->copy_pending = 1;
    check(c,
          cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, bytes, rows, cudaMemcpyDeviceToHost,
                            c->copy_stream),
          "copy out");
}

/* Any thread: c->copy_stream is fixed, and nothing of c is written here. */
static int cuda_copy_out_wait(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    cudaError_t err = cudaStreamSynchronize(c->copy_stream);
    if (err != cudaSuccess) {
        LLMEM_ERROR("cuda backend: copies to the host: %s", cudaGetErrorString(err));
        return LLMEM_EIO;
    }
    return LLMEM_OK;
}

static void cuda_copy_out_fence(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (!c->copy_pending || c->failed)
        return;
    c->copy_pending = 0;
    rope_flush(c);
    if (c->pass != NULL) { /* a capture cannot wait on another stream's event: the host waits */
        check(c, cudaStreamSynchronize(c->copy_stream), "copy out");
        return;
    }
    if (check(c, cudaEventRecord(c->copy_done, c->copy_stream), "copy out") == LLMEM_OK)
        check(c, cudaStreamWaitEvent(c->stream, c->copy_done, 0), "copy out");
    c->idle = 0;
}

static void cuda_destroy(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (c == NULL)
        return;
    if (c->stream != NULL)
        cudaStreamSynchronize(c->stream);
    if (c->copy_stream != NULL) {
        cudaStreamSynchronize(c->copy_stream);
        cudaStreamDestroy(c->copy_stream);
    }
    if (c->copy_after != NULL)
        cudaEventDestroy(c->copy_after);
    if (c->copy_done != NULL)
        cudaEventDestroy(c->copy_done);
    if (c->profiling) {
        profile_log(c);
        cudaEventDestroy(llmem_cuda_profile_start);
        llmem_cuda_profile_start = nullptr, llmem_cuda_profile_pending = 0;
    }
    if (c->profile_end != NULL)
        cudaEventDestroy(c->profile_end);
    for (int i = 0; i < GRAPHS; i++)
        graph_drop(&c->graphs[i]);
    for (int i = 0; i < 2 * REPLAY_TIMES; i++)
        if (c->replay[i] != NULL)
            cudaEventDestroy(c->replay[i]);
    dev_free(c, c->scratch);
    dev_free(c, c->wslice);
    if (c->top_host != NULL)
        cudaFreeHost(c->top_host);
    for (int i = 0; i < SMALL_SLOTS; i++)
        if (c->small_done[i] != NULL)
            cudaEventDestroy(c->small_done[i]);
    for (int i = 0; i < 2; i++)
        if (c->top_done[i] != NULL)
            cudaEventDestroy(c->top_done[i]);
    if (c->arena_done != NULL)
        cudaEventDestroy(c->arena_done);
    if (c->small != NULL)
        cudaFree(c->small);
    if (c->small_host != NULL)
        cudaFreeHost(c->small_host);
    free(c->staging);
    if (c->blas != NULL)
        llmem_cuda_blas.destroy(c->blas);
    for (int i = 0; c->lt_plans != NULL && i < LT_PLANS; i++)
        lt_plan_free(&c->lt_plans[i]);
    free(c->lt_plans);
    if (c->lt != NULL)
        llmem_cuda_blas.lt_destroy(c->lt);
    dev_free(c, c->lt_ws);
    if (c->stream != NULL)
        cudaStreamDestroy(c->stream);
    (void)cudaGetLastError();
    free(c);
}

static void cuda_counters(void *ctx, struct llmem_backend_counters *out) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    replay_time(c, REPLAY_TIMES);
    *out = c->counters;
}

static void cuda_bind(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    check(c, cudaSetDevice(c->device), "cudaSetDevice");
}

static struct llmem_backend_ops make_ops(void) {
    struct llmem_backend_ops o = {};
    o.name = "cuda";
    o.destroy = cuda_destroy;
    o.threads = cuda_threads;
    o.matmul = cuda_matmul;
    o.matmul_multi = cuda_matmul_multi;
    o.rmsnorm = cuda_rmsnorm;
    o.add_rmsnorm = cuda_add_rmsnorm;
    o.rope = cuda_rope;
    o.rope_qk = cuda_rope_qk;
    o.swiglu = cuda_swiglu;
    o.matmul_swiglu = cuda_matmul_swiglu;
    o.embedding = cuda_embedding;
    o.add = cuda_add;
    o.moe = cuda_moe;
    o.kv_encode = cuda_kv_encode;
    o.kv_attend = cuda_kv_attend;
    o.kv_attend_last = cuda_kv_attend_last;
    o.memory = cuda_memory;
    o.copy = cuda_copy;
    o.copy_out = cuda_copy_out;
    o.copy_out_wait = cuda_copy_out_wait;
    o.copy_out_fence = cuda_copy_out_fence;
    o.top_k = cuda_top_k;
    o.top_k_wait = cuda_top_k_wait;
    o.embedding_top = cuda_embedding_top;
    o.sync = cuda_sync;
    o.busy = cuda_busy;
    o.graph_begin = cuda_graph_begin;
    o.graph_end = cuda_graph_end;
    o.graph_launch = cuda_graph_launch;
    o.graph_want = cuda_graph_want;
    o.counters = cuda_counters;
    o.bind = cuda_bind;
    return o;
}

static const struct llmem_backend_ops cuda_ops = make_ops();

extern "C" int llmem_cuda_backend_create(int device, enum llmem_backend_precision precision,
                                         struct llmem_mem *mem, struct llmem_backend **out) {
    *out = NULL;
    if (llmem_cuda_blas_load() != LLMEM_OK)
        return LLMEM_EIO;
    struct cuda_ctx *c = (struct cuda_ctx *)calloc(1, sizeof(*c));
    struct llmem_backend *b = (struct llmem_backend *)calloc(1, sizeof(*b));
    if (c == NULL || b == NULL) {
        free(c);
        free(b);
        LLMEM_ERROR("llmem_backend_cuda_create: out of memory");
        return LLMEM_ENOMEM;
    }
    c->device = device;
    c->precision = precision;
    c->mem = mem;
    c->small_bytes = SMALL_MAX;
    int profile = 0;
    if (llmem_option_bool(LLMEM_OPT_CUDA_GRAPHS, &c->graphs_on) != LLMEM_OK ||
        llmem_option_bool(LLMEM_OPT_CUDA_PROFILE, &profile) != LLMEM_OK) {
        free(c);
        free(b);
        return LLMEM_EINVAL;
    }
    c->staging = (int32_t *)malloc(SMALL_MAX);
    if (c->staging == NULL) {
        free(c);
        free(b);
        LLMEM_ERROR("llmem_backend_cuda_create: out of memory");
        return LLMEM_ENOMEM;
    }
    int status = LLMEM_OK;
    if (check(c, cudaSetDevice(device), "cudaSetDevice") != LLMEM_OK ||
        check(c, cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), "stream") !=
            LLMEM_OK ||
        check(c, cudaStreamCreateWithFlags(&c->copy_stream, cudaStreamNonBlocking), "stream") !=
            LLMEM_OK ||
        check(c, cudaEventCreateWithFlags(&c->copy_after, cudaEventDisableTiming), "event") !=
            LLMEM_OK ||
        check(c, cudaEventCreateWithFlags(&c->copy_done, cudaEventDisableTiming), "event") !=
            LLMEM_OK ||
        check(c,
              cudaMalloc(&c->small, c->small_bytes * SMALL_SLOTS +
                                        SPLIT_COUNTERS * sizeof(unsigned) +
                                        FEED_ROWS * sizeof(int32_t)),
              "cudaMalloc") != LLMEM_OK ||
        check(
            c,
            cudaMemset(split_counters(c), 0, SPLIT_COUNTERS * sizeof(unsigned)),
            "cudaMemset") != LLMEM_OK ||
        check(c, cudaHostAlloc(&c->small_host, c->small_bytes * SMALL_SLOTS, cudaHostAllocDefault),
              "cudaHostAlloc") != LLMEM_OK ||
        check_blas(c, llmem_cuda_blas.create(&c->blas), "cublasCreate") != LLMEM_OK ||
        check_blas(c, llmem_cuda_blas.lt_create(&c->lt), "cublasLtCreate") != LLMEM_OK ||
        check_blas(c, llmem_cuda_blas.set_stream(c->blas, c->stream), "cublasSetStream") != LLMEM_OK)
        status = LLMEM_EIO;
    if (status == LLMEM_OK &&
        (c->lt_plans = (struct lt_plan *)calloc(LT_PLANS, sizeof(struct lt_plan))) == NULL) {
        LLMEM_ERROR("llmem_backend_cuda_create: out of memory");
        status = LLMEM_ENOMEM;
    }
    for (int i = 0; status == LLMEM_OK && i < 2 * REPLAY_TIMES; i++)
        if (check(c, cudaEventCreate(&c->replay[i]), "event") != LLMEM_OK)
            status = LLMEM_EIO;
    for (int i = 0; status == LLMEM_OK && i < SMALL_SLOTS; i++)
        if (check(c, cudaEventCreateWithFlags(&c->small_done[i], cudaEventDisableTiming),
                  "event") != LLMEM_OK)
            status = LLMEM_EIO;
    for (int i = 0; status == LLMEM_OK && i < 2; i++)
        if (check(c, cudaEventCreateWithFlags(&c->top_done[i], cudaEventDisableTiming), "event") !=
            LLMEM_OK)
            status = LLMEM_EIO;
    if (status == LLMEM_OK &&
        check(c, cudaEventCreateWithFlags(&c->arena_done, cudaEventDisableTiming), "event") !=
            LLMEM_OK)
        status = LLMEM_EIO;
    if (status == LLMEM_OK)
        c->feed = (int32_t *)(split_counters(c) + SPLIT_COUNTERS);
    if (status == LLMEM_OK && profile && llmem_cuda_profile_start == nullptr) {
        if (check(c, cudaEventCreate(&c->profile_end), "event") != LLMEM_OK ||
            check(c, cudaEventCreate(&llmem_cuda_profile_start), "event") != LLMEM_OK) {
            status = LLMEM_EIO;
        } else {
            c->profiling = 1;
            c->graphs_on = 0; /* every operation timed on its own */
        }
    }
    if (status != LLMEM_OK) {
        cuda_destroy(c);
        free(b);
        return status;
    }
    b->ops = &cuda_ops;
    b->ctx = c;
    *out = b;
    return LLMEM_OK;
}

} // namespace llmem_cuda
