/*
 * backend/cuda/ops.cu — the CUDA backend's table (backend/ops.h): every operation of a forward
 * pass on one GPU, queued in order on the backend's own stream.
 *
 * Elementwise operations follow the CPU backend's arithmetic, operation for operation (no fused
 * multiply-adds where the CPU rounds twice; sums of squares in double; cos and sin of the f32
 * angle in double), so they agree with it to the last bit or two.
 *
 * matmul: a few rows of x (decode) go through our own memory-bound kernel in f32 (each warp owns
 * a weight row and streams it once with 16-byte loads for all the rows of x); more rows go to
 * cuBLAS: at fast precision the activations are rounded to the weights' 16-bit type and the
 * product runs on the tensor cores with f32 accumulation; at f32 precision the weights are widened
 * to f32 in slices of rows and multiplied in plain f32 (no TF32).
 *
 * Graphs (graph_begin / graph_end): a pass the caller repeats with the same shapes (a decode step)
 * is run once as usual, recorded into a CUDA graph the second time, and from then on replayed
 * with one launch: its operations then only stage their small per-call arrays (at the offsets the
 * recording used) and extend a hash of every operation and argument, and the graph is launched
 * when that hash equals the recording's; else nothing has run, and the caller runs the pass again
 * (as usual, which also sizes any scratch the new shapes need; the next such pass is recorded
 * afresh). LLMEM_CUDA_GRAPHS=0 turns them off.
 *
 * LLMEM_CUDA_PROFILE=1 times every operation's kernels on the device (events around them, the
 * host waiting after each: no graphs, no overlap between kernels) and logs the totals per
 * operation (INFO) when the backend is destroyed: where a pass's device time goes.
 */
#include "backend/cuda/backend.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/kv.h"
#include "backend/cuda/launch.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <initializer_list>
#include <stdlib.h>
#include <string.h>

#include "core/hash.h"
#include "core/log.h"
#include "core/options.h"
#include "llmem/dtype.h"
#include "llmem/forward.h"

/* x rows up to which matmul takes the memory-bound kernel (gemv_rows): at f32 precision, where a
 * GEMM first widens the weights, up to GEMV_MAX_ROWS; at fast precision up to GEMV_FAST_ROWS, the
 * tensor cores being faster from 3 rows (on the H200 a decode step of 8 sequences took 3.06 ms on
 * the device through the GEMV, one of 32 sequences 1.25 ms through the GEMMs) */
#define GEMV_MAX_ROWS  8
#define GEMV_FAST_ROWS 2
/* 16-byte weight loads each lane has in flight in the matrix-vector kernel */
#define GEMV_UNROLL 8
/* weight bytes widened to f32 at a time at f32 precision */
#define WIDEN_SLICE_BYTES ((size_t)64 << 20)
/* The fast GEMMs' plans (cublasLt: the algorithm its heuristic ranks first for a shape, given up
 * to LT_WORKSPACE_MAX of workspace), kept in a table of LT_PLANS by shape. */
#define LT_PLANS         1024
#define LT_WORKSPACE_MAX ((size_t)32 << 20)
/* RoPE's cosines and sines are computed once per token and block up to this head_dim / 2, in
 * blocks of one token and a group of heads, about this many blocks (more for long batches) */
#define ROPE_MAX_HALF 256
#define ROPE_BLOCKS   264
/* the small per-call host arrays (positions, ids, frequencies, block tables) are staged up to
 * this many bytes a call, in a ring of slots so that no upload waits for the GPU */
#define SMALL_MAX    (256 << 10)
#define SMALL_SLOTS  32
#define SMALL_REUSE  4  /* the last uploads compared with a new one */
#define GRAPHS       32 /* recorded passes kept, the least recently used replaced */
#define REPLAY_TIMES 64 /* replays timed by event pairs, read when counters are asked for */
#define GRAPH_MISSES 4  /* passes of a key that did not match its graph before it is given up */

/* after the small slots: the attention's counters (llmem_cuda_attn.counters; the stream's calls
 * run one after another), for 4,096 sequences × KV heads; then the ids a greedy top_k leaves for
 * the next pass's embedding_top, for up to FEED_ROWS rows */
#define ATTN_COUNTERS_BYTES (4096 * sizeof(unsigned))
#define FEED_ROWS           4096

enum pass_mode { PASS_NOW, PASS_CAPTURE, PASS_STAGE };

/* C[rows, n] = Aᵀ·B, column-major, A = W [cols, rows] and B = x [cols, n] in one 16-bit type, C
 * f32: how cublasLt computes it; `batch` of them (1 or 2), the matrices one after the other, the
 * outputs stride_c floats apart, one B. */
struct lt_plan {
    int64_t rows, n, cols, batch, stride_c;
    cudaDataType_t type;
    int ready; /* 0: a free slot */
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
    size_t workspace;
};
enum graph_state { GRAPH_SEEN, GRAPH_READY, GRAPH_OFF };

struct graph {
    uint64_t key;
    uint64_t sig;         /* the hash of the recorded pass's operations and arguments */
    cudaGraphExec_t exec; /* GRAPH_READY */
    enum graph_state state;
    int misses;
    uint64_t used; /* the pass count at its last use */
};

cudaEvent_t cuda_profile_start = nullptr;
int cuda_profile_pending = 0;

#define PROFILE_OPS 32
struct profile_op {
    const char *what;
    double ms;
    int64_t calls;
};

/* rope_qk of q and k, queued for the KV write after it (one launch for the two,
 * llmem_cuda_kv_encode_rope), or launched alone by the next other operation (rope_flush). */
struct rope_later {
    float *q, *k;
    int n_heads, n_kv_heads, head_dim;
    int64_t n;
    const uint8_t *d; /* the positions, then inv_freq, on the device */
};

/* An outstanding top_k's results: where they go, and their slot of top_host. */
struct top_out {
    int32_t *ids;
    float *vals;
    size_t count; /* n·k */
    int slot;
};

struct cuda_ctx {
    int device;
    enum llmem_backend_precision precision;
    cudaStream_t stream;
    cublasHandle_t blas;
    struct llmem_mem *mem; /* scratch; NULL: cudaMalloc */
    void *scratch;         /* activations rounded to 16 bits, or a slice of widened weights */
    size_t scratch_bytes;
    void *small; /* device copies of the small host arrays: SMALL_SLOTS slots, then the counters
                  * and the feed */
    void *small_host; /* their pinned staging, slot for slot */
    size_t small_bytes;
    cudaEvent_t small_done[SMALL_SLOTS]; /* recorded after the copy out of a slot was queued */
    size_t small_size[SMALL_SLOTS];      /* bytes each slot holds */
    int small_next;                      /* the slot the next upload takes */
    int32_t *staging; /* SMALL_MAX bytes where an upload is assembled (block tables, positions) */
    int failed;       /* the first failure's status (LLMEM_EIO, LLMEM_ENOMEM), reported by
                       * copy and sync ever after: later operations are skipped */
    /* graphs */
    int graphs_on;
    struct graph graphs[GRAPHS];
    struct graph *pass; /* between graph_begin and graph_end */
    enum pass_mode mode;
    uint64_t sig;      /* of the pass's operations so far */
    size_t arena_used; /* per-call data the pass staged, from the start of the ring's memory */
    size_t arena_off[SMALL_REUSE], arena_size[SMALL_REUSE];
    int arena_n;
    int pass_bad;   /* the pass cannot be recorded (per-call data or scratch would not fit) */
    int pass_once;  /* the recording copied memory: it runs once, it is not kept */
    int ring_stale; /* a pass staged in the ring's memory: wait before the ring's next use */
    int ring_live;  /* uploads through the ring queued since the stream last synchronized */
    cudaEvent_t arena_done; /* recorded after the last pass's per-call data was copied */
    int arena_queued;       /* … and since the stream last synchronized */
    uint64_t passes;
    struct llmem_backend_counters counters;
    struct rope_later rope_later; /* with rope_pending */
    int rope_pending;
    int profiling; /* LLMEM_CUDA_PROFILE: this context owns cuda_profile_start */
    cudaEvent_t profile_end;
    struct profile_op profile[PROFILE_OPS];
    int profile_n;
    /* around the replays not yet added to the counters: pairs replay_first … + replay_pending
     * (mod REPLAY_TIMES), read when the counters are asked for or a pair is needed again (a
     * step's host time does not wait for them) */
    cudaEvent_t replay[2 * REPLAY_TIMES];
    int replay_first, replay_pending;
    int idle; /* the stream synchronized since anything was queued on it */
    /* copy_out: copies to the host on a stream of their own, each after the work queued on
     * `stream` before it (the event copy_after); copy_done, recorded by copy_out_fence, for
     * `stream` to wait on */
    cudaStream_t copy_stream;
    cudaEvent_t copy_after, copy_done;
    int copy_pending;
    /* top_k's results: two slots of top_bytes (ids, then values), pinned and mapped, until sync
     * or top_k_wait hands them over; the slots of the calls outstanding, oldest first */
    void *top_host;
    void *top; /* the device's address of top_host */
    size_t top_bytes;
    struct top_out top_out[2];
    int top_n, top_next;
    cudaEvent_t top_done[2];
    int32_t *feed;     /* (in small) the last greedy top_k's ids, FEED_ROWS at most */
    int64_t feed_rows; /* the rows it left there (0: the last top_k left none) */
    cublasLtHandle_t lt;
    struct lt_plan *lt_plans; /* (LT_PLANS) */
    void *lt_ws;              /* the workspace of the plans that want one */
    size_t lt_ws_bytes;
    /* The 16-bit copy of an f32 activation written to scratch, beside it, by the operation that
     * produced it (rmsnorm, swiglu), for the fast GEMMs that read it next: the copy of shadow_x
     * (shadow_n floats, NULL: none) as shadow_dt, at shadow_at. Any other operation drops it. */
    const float *shadow_x;
    int64_t shadow_n;
    enum llmem_dtype shadow_dt;
    const void *shadow_at;
    struct {
        enum llmem_dtype dt;
        int64_t cols;
    } rounds[8];  /* the types and widths the fast GEMMs rounded x to last (the producers' cue) */
    int n_rounds; /* widths recorded so far; the slot of the next is n_rounds mod 8 */
};

static int64_t gemv_rows(const struct cuda_ctx *c) {
    return c->precision == LLMEM_PRECISION_FAST ? GEMV_FAST_ROWS : GEMV_MAX_ROWS;
}

/* The backend's first failure: logged once, kept as the status of every later copy and sync. */
static void fail(struct cuda_ctx *c, int status, const char *what, const char *why) {
    if (c->failed)
        return;
    if (why != NULL)
        LLMEM_ERROR("cuda backend: %s: %s", what, why);
    c->failed = status;
}

static int check(struct cuda_ctx *c, cudaError_t err, const char *what) {
    if (err == cudaSuccess)
        return LLMEM_OK;
    fail(c, LLMEM_EIO, what, cudaGetErrorString(err));
    return LLMEM_EIO;
}

static int check_blas(struct cuda_ctx *c, cublasStatus_t st, const char *what) {
    if (st == CUBLAS_STATUS_SUCCESS)
        return LLMEM_OK;
    fail(c, LLMEM_EIO, what, cublasGetStatusString(st));
    return LLMEM_EIO;
}

static void rope_flush(struct cuda_ctx *c);

static void launched(struct cuda_ctx *c, const char *what) {
    check(c, cudaGetLastError(), what);
    if (!c->profiling || !cuda_profile_pending)
        return;
    /* the kernels since the start event: waited for, timed, added to the operation's total */
    float ms = 0;
    cuda_profile_pending = 0;
    if (cudaEventRecord(c->profile_end, c->stream) != cudaSuccess ||
        cudaEventSynchronize(c->profile_end) != cudaSuccess ||
        cudaEventElapsedTime(&ms, cuda_profile_start, c->profile_end) != cudaSuccess) {
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

static void *dev_alloc(struct cuda_ctx *c, size_t bytes) {
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

static void dev_free(struct cuda_ctx *c, void *p) {
    if (p == NULL)
        return;
    if (c->mem != NULL)
        llmem_mem_free(c->mem, p);
    else
        cudaFree(p);
}

/* Scratch of at least `bytes`, grown (after the stream drains) when short. */
static void *scratch(struct cuda_ctx *c, size_t bytes) {
    if (bytes <= c->scratch_bytes)
        return c->scratch;
    if (c->mode != PASS_NOW) { /* no waiting while recording: the pass runs without a graph */
        c->pass_bad = 1;
        return NULL;
    }
    cudaStreamSynchronize(c->stream);
    dev_free(c, c->scratch);
    c->scratch = dev_alloc(c, bytes);
    c->scratch_bytes = c->scratch != NULL ? bytes : 0;
    if (c->scratch == NULL)
        fail(c, LLMEM_ENOMEM, "scratch", NULL); /* logged by the allocator */
    return c->scratch;
}

/* Copies a small host array to the device for the next kernel, queued on the stream: through the
 * next pinned slot of the ring, which is free once the work queued after its last upload is done
 * (an event recorded at the following upload; the ring is long enough that this rarely waits). */
static const void *arena_upload(struct cuda_ctx *c, const void *host, size_t bytes);

static const void *small_upload(struct cuda_ctx *c, const void *host, size_t bytes) {
    if (c->mode != PASS_NOW)
        return arena_upload(c, host, bytes);
    if (c->ring_stale) { /* a graph's data lay in the ring's memory: wait for it */
        if (check(c, cudaStreamSynchronize(c->stream), "synchronize") != LLMEM_OK)
            return NULL;
        c->arena_queued = 0;
        memset(c->small_size, 0, sizeof(c->small_size));
        c->ring_stale = 0;
    }
    if (bytes > c->small_bytes) {
        LLMEM_ERROR("cuda backend: %zu bytes of per-call data (at most %zu)", bytes,
                    c->small_bytes);
        fail(c, LLMEM_EINVAL, "per-call data", NULL);
        return NULL;
    }
    /* The same bytes as one of the last few uploads (every layer's positions and block table):
     * its device copy again. A device slot is only rewritten by a copy queued after every kernel
     * already queued, so a kernel queued now still reads these bytes. */
    for (int i = 1; i <= SMALL_REUSE; i++) {
        const int slot = (c->small_next + SMALL_SLOTS - i) % SMALL_SLOTS;
        if (c->small_size[slot] == bytes &&
            memcmp((uint8_t *)c->small_host + (size_t)slot * c->small_bytes, host, bytes) == 0)
            return (uint8_t *)c->small + (size_t)slot * c->small_bytes;
    }
    const int prev = (c->small_next + SMALL_SLOTS - 1) % SMALL_SLOTS, slot = c->small_next;
    c->small_next = (slot + 1) % SMALL_SLOTS;
    if (check(c, cudaEventRecord(c->small_done[prev], c->stream), "event") != LLMEM_OK ||
        check(c, cudaEventSynchronize(c->small_done[slot]), "event") != LLMEM_OK)
        return NULL;
    uint8_t *h = (uint8_t *)c->small_host + (size_t)slot * c->small_bytes;
    uint8_t *d = (uint8_t *)c->small + (size_t)slot * c->small_bytes;
    memcpy(h, host, bytes);
    c->small_size[slot] = bytes;
    c->idle = 0;
    c->ring_live = 1;
    if (check(c, cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, c->stream), "upload") !=
        LLMEM_OK)
        return NULL;
    return d;
}

/* ---- graphs ----------------------------------------------------------------------------------
 */

/* A pass's per-call data, staged from the start of the ring's memory (free then: graph_begin
 * waited for the stream), at offsets that depend only on the sizes and order of the uploads and on
 * which of them repeat one of the last few; graph_end copies it to the device in one piece. */
static const void *arena_upload(struct cuda_ctx *c, const void *host, size_t bytes) {
    uint8_t *h = (uint8_t *)c->small_host, *d = (uint8_t *)c->small;
    for (int i = 0; i < c->arena_n && i < SMALL_REUSE; i++)
        if (c->arena_size[i] == bytes && memcmp(h + c->arena_off[i], host, bytes) == 0)
            return d + c->arena_off[i];
    const size_t off = (c->arena_used + 15) & ~(size_t)15;
    if (off + bytes > c->small_bytes * SMALL_SLOTS) {
        c->pass_bad = 1;
        return NULL;
    }
    memcpy(h + off, host, bytes);
    c->arena_off[c->arena_n % SMALL_REUSE] = off;
    c->arena_size[c->arena_n % SMALL_REUSE] = bytes;
    c->arena_n++;
    c->arena_used = off + bytes;
    return d + off;
}

static uint64_t arg(const void *p) {
    return (uint64_t)(uintptr_t)p;
}
static uint64_t arg(int64_t v) {
    return (uint64_t)v;
}
static uint64_t arg(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

/* The operations, as they extend a pass's hash (staged). */
enum {
    OP_MATMUL = 1,
    OP_GEMV_SET,
    OP_MATMUL_W, /* one weight of a matmul_multi */
    OP_RMSNORM,
    OP_ROPE,
    OP_SWIGLU,
    OP_ADD,
    OP_EMBEDDING,
    OP_KV_ENCODE,
    OP_ATTN_DECODE,
    OP_KV_ATTEND,
    OP_MATMUL_MULTI,
    OP_GEMV_SWIGLU,
    OP_EMBEDDING_TOP,
};

/* Called by every operation before it launches anything: its arguments extend the pass's hash.
 * 1: do not launch (the pass is staged for a recorded graph). */
static int staged(struct cuda_ctx *c, int op, std::initializer_list<uint64_t> args) {
    c->idle = 0;            /* (every operation stages before it queues anything) */
    if (op != OP_KV_ENCODE) /* which may take it */
        rope_flush(c);
    if (op != OP_MATMUL && op != OP_GEMV_SET && op != OP_MATMUL_W && op != OP_MATMUL_MULTI &&
        op != OP_GEMV_SWIGLU)
        c->shadow_x = NULL; /* only the GEMMs read a shadow; any other operation may write */
    if (c->pass == NULL)
        return 0;
    uint64_t v[24];
    size_t n = 0;
    LLMEM_ASSERT(args.size() < sizeof(v) / sizeof(v[0]));
    v[n++] = (uint64_t)op;
    for (uint64_t a : args)
        v[n++] = a;
    c->sig = llmem_hash64(v, n * sizeof(uint64_t), c->sig);
    return c->mode == PASS_STAGE;
}

static void graph_drop(struct graph *g) {
    if (g->exec != NULL)
        cudaGraphExecDestroy(g->exec);
    g->exec = NULL;
}

/* Adds the oldest `n` timed replays' device time to the counters (waiting for them). */
static void replay_time(struct cuda_ctx *c, int n) {
    for (; n > 0 && c->replay_pending > 0; n--) {
        cudaEvent_t *e = &c->replay[2 * c->replay_first];
        float ms = 0;
        if (cudaEventSynchronize(e[1]) == cudaSuccess &&
            cudaEventElapsedTime(&ms, e[0], e[1]) == cudaSuccess)
            c->counters.graphs_device_s += ms * 1e-3;
        (void)cudaGetLastError();
        c->replay_first = (c->replay_first + 1) % REPLAY_TIMES;
        c->replay_pending--;
    }
}

static int cuda_graph_ready(void *ctx, uint64_t key) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    for (int i = 0; c->graphs_on && !c->failed && i < GRAPHS; i++)
        if (c->graphs[i].used != 0 && c->graphs[i].key == key)
            return c->graphs[i].state == GRAPH_READY;
    return 0;
}

static int cuda_graph_begin(void *ctx, uint64_t key) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    rope_flush(c);
    LLMEM_ASSERT(c->pass == NULL);
    c->shadow_x = NULL;
    if (!c->graphs_on || c->failed)
        return c->failed;
    struct graph *g = NULL, *lru = &c->graphs[0];
    for (int i = 0; i < GRAPHS && g == NULL; i++) {
        if (c->graphs[i].used != 0 && c->graphs[i].key == key)
            g = &c->graphs[i];
        else if (c->graphs[i].used < lru->used)
            lru = &c->graphs[i];
    }
    if (g == NULL) { /* a new pass: run as usual this time */
        graph_drop(lru);
        memset(lru, 0, sizeof(*lru));
        lru->key = key;
        lru->state = GRAPH_SEEN;
        g = lru;
    }
    g->used = ++c->passes;
    if (g->state == GRAPH_OFF)
        return LLMEM_OK;
    c->pass = g;
    c->sig = key;
    c->pass_bad = c->pass_once = 0;
    c->arena_used = 0;
    c->arena_n = 0;
    c->mode = PASS_NOW;
    if (g->state == GRAPH_READY || (g->exec == NULL && g->sig != 0)) {
        /* the ring's pinned memory takes this pass's data: no copy queued may still read it.
         * When only a pass's data was copied from it since the stream last synchronized, that
         * copy is waited for, not the pass (its copy for this pass is queued after the pass). */
        if (!c->idle && c->arena_queued && !c->ring_live) {
            if (check(c, cudaEventSynchronize(c->arena_done), "synchronize") != LLMEM_OK)
                return c->failed;
        } else if (!c->idle) {
            if (check(c, cudaStreamSynchronize(c->stream), "synchronize") != LLMEM_OK)
                return c->failed;
            c->ring_live = c->arena_queued = 0;
        }
        c->ring_stale = 1;
        c->mode = g->state == GRAPH_READY ? PASS_STAGE : PASS_CAPTURE;
    }
    if (c->mode == PASS_CAPTURE &&
        cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeRelaxed) != cudaSuccess) {
        (void)cudaGetLastError();
        g->state = GRAPH_OFF;
        c->mode = PASS_NOW;
    }
    return LLMEM_OK;
}

static int cuda_graph_end(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    rope_flush(c);
    c->shadow_x = NULL;
    struct graph *g = c->pass;
    if (g == NULL)
        return c->failed;
    const enum pass_mode mode = c->mode;
    c->pass = NULL;
    c->mode = PASS_NOW;
    /* what the kernels were given as scratch */
    const uint64_t v[3] = {c->sig, arg(c->scratch), arg(c->lt_ws)};
    const uint64_t sig = llmem_hash64(v, sizeof(v), 0) | 1;
    if (mode == PASS_NOW) { /* ran as usual: the next pass of this key is recorded */
        g->sig = sig;
        return c->failed;
    }
    if (mode == PASS_CAPTURE) {
        cudaGraph_t graph = NULL;
        cudaError_t err = cudaStreamEndCapture(c->stream, &graph);
        if (err == cudaSuccess && !c->pass_bad)
            err = cudaGraphInstantiate(&g->exec, graph, 0);
        if (graph != NULL)
            cudaGraphDestroy(graph);
        if (err != cudaSuccess || c->pass_bad || c->failed) { /* nothing ran: again, */
            (void)cudaGetLastError();
            g->exec = NULL;
            g->sig = 0; /* as usual (which sizes the scratch it lacked), then recorded */
            g->state = err != cudaSuccess || ++g->misses >= GRAPH_MISSES ? GRAPH_OFF : GRAPH_SEEN;
            return c->failed ? c->failed : LLMEM_EBUSY;
        }
        g->sig = sig;
        g->state = GRAPH_READY;
        c->counters.graphs_recorded++;
    } else if (c->pass_bad || sig != g->sig) { /* nothing ran: again, as usual, then recorded */
        c->counters.graphs_missed++;
        graph_drop(g);
        g->sig = 0;
        g->state = ++g->misses >= GRAPH_MISSES ? GRAPH_OFF : GRAPH_SEEN;
        return LLMEM_EBUSY;
    }
    c->idle = 0;
    if (c->arena_used > 0 &&
        check(c,
              cudaMemcpyAsync(c->small, c->small_host, c->arena_used, cudaMemcpyHostToDevice,
                              c->stream),
              "upload") == LLMEM_OK &&
        check(c, cudaEventRecord(c->arena_done, c->stream), "event") == LLMEM_OK)
        c->arena_queued = 1;
    if (mode == PASS_STAGE && c->replay_pending == REPLAY_TIMES)
        replay_time(c, 1); /* its pair is needed again */
    cudaEvent_t *e = &c->replay[2 * ((c->replay_first + c->replay_pending) % REPLAY_TIMES)];
    const int timed = mode == PASS_STAGE && cudaEventRecord(e[0], c->stream) == cudaSuccess;
    check(c, cudaGraphLaunch(g->exec, c->stream), "cudaGraphLaunch");
    if (timed && cudaEventRecord(e[1], c->stream) == cudaSuccess)
        c->replay_pending++;
    if (mode == PASS_STAGE) {
        c->counters.graphs_replayed++;
        g->misses = 0; /* only misses in a row give a key up */
    }
    if (c->pass_once) { /* it held a copy of this pass's own */
        graph_drop(g);
        g->state = GRAPH_SEEN;
    }
    return c->failed;
}

/* ---- elementwise kernels ---------------------------------------------------------------------
 */

__device__ __forceinline__ float bf16_to_f32(uint16_t v) {
    return __uint_as_float((uint32_t)v << 16);
}

__device__ __forceinline__ float weight_at(const void *w, enum llmem_dtype dt, int64_t i) {
    switch (dt) {
    case LLMEM_DTYPE_BF16: return bf16_to_f32(((const uint16_t *)w)[i]);
    case LLMEM_DTYPE_F16: return __half2float(((const __half *)w)[i]);
    default: return ((const float *)w)[i];
    }
}

/* y's 16-bit copy (y16 not NULL): round to nearest even, as round_kernel. */
__device__ __forceinline__ void store16(void *y16, enum llmem_dtype dt, int64_t i, float v) {
    if (dt == LLMEM_DTYPE_BF16)
        ((__nv_bfloat16 *)y16)[i] = __float2bfloat16_rn(v);
    else
        ((__half *)y16)[i] = __float2half_rn(v);
}

/* One block per row: the sum of squares in double, as the CPU does. With res, first x += res
 * (the residual add before the norm: exactly add_kernel's). With y16, y's 16-bit copy too.
 * PER > 0: a thread's PER elements (i, i + blockDim, …; dim ≤ PER · blockDim) held in registers,
 * every load of a pass asked for before any is used, the weights before the wait: a decode's norm
 * is a chain of memory round trips, and a loop that stores x before it loads the next element
 * makes one round trip per element. PER 0: any dim, element by element. */
template <int PER>
__global__ void rmsnorm_kernel(float *x, const float *res, const float *weight, int64_t dim,
                               float eps, float *y, void *y16, enum llmem_dtype dt) {
    float *xr = x + blockIdx.x * dim;
    float *yr = y + blockIdx.x * dim;
    double s = 0;
    float v[PER > 0 ? PER : 1], w[PER > 0 ? PER : 1];
    if constexpr (PER > 0) {
#pragma unroll
        for (int k = 0; k < PER; k++) { /* the weights: no kernel writes them */
            const int64_t i = threadIdx.x + (int64_t)k * blockDim.x;
            w[k] = i < dim ? weight[i] : 0.0f;
        }
        pdl_begin();
        float r[PER > 0 ? PER : 1];
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int64_t i = threadIdx.x + (int64_t)k * blockDim.x;
            v[k] = i < dim ? xr[i] : 0.0f;
            r[k] = i < dim && res != NULL ? res[blockIdx.x * dim + i] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int64_t i = threadIdx.x + (int64_t)k * blockDim.x;
            if (i >= dim)
                continue;
            if (res != NULL) {
                v[k] = __fadd_rn(v[k], r[k]);
                xr[i] = v[k];
            }
            s += (double)v[k] * (double)v[k];
        }
    } else {
        pdl_begin();
        for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
            float e = xr[i];
            if (res != NULL) {
                e = __fadd_rn(e, res[blockIdx.x * dim + i]);
                xr[i] = e;
            }
            s += (double)e * (double)e;
        }
    }
    __shared__ double part[32];
    for (int o = 16; o > 0; o /= 2)
        s += __shfl_down_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        s = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : 0;
        for (int o = 16; o > 0; o /= 2)
            s += __shfl_down_sync(0xffffffffu, s, o);
        if (threadIdx.x == 0)
            part[0] = s;
    }
    __syncthreads();
    float mean = (float)(part[0] / (double)dim);
    float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    if constexpr (PER > 0) {
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int64_t i = threadIdx.x + (int64_t)k * blockDim.x;
            if (i >= dim)
                continue;
            const float e = __fmul_rn(__fmul_rn(v[k], inv), w[k]);
            yr[i] = e;
            if (y16 != NULL)
                store16(y16, dt, blockIdx.x * dim + i, e);
        }
    } else {
        for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
            const float e = __fmul_rn(__fmul_rn(xr[i], inv), weight[i]);
            yr[i] = e;
            if (y16 != NULL)
                store16(y16, dt, blockIdx.x * dim + i, e);
        }
    }
}

/* grid (token, head), one thread per pair (i, i + half). */
/* A block per token and group of `per` heads (of x's heads, then x2's): the token's angles'
 * cosines and sines once (in double, as the CPU backend computes them; per pair where
 * head_dim / 2 > ROPE_MAX_HALF), then the group's pairs. */
__global__ void rope_kernel(float *x, int n_heads, float *x2, int n_heads2, int head_dim,
                            const int64_t *pos, const float *inv_freq, int per) {
    pdl_begin();
    __shared__ float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
    const int half = head_dim / 2, shared = half <= ROPE_MAX_HALF;
    const int64_t t = blockIdx.x;
    const int h0 = (int)blockIdx.y * per, h1 = min(h0 + per, n_heads + n_heads2);
    for (int i = threadIdx.x; shared && i < half; i += blockDim.x)
        rope_angle(pos, inv_freq, t, i, &cs[i], &sn[i]);
    __syncthreads();
    for (int j = h0 * half + (int)threadIdx.x; j < h1 * half; j += blockDim.x) {
        const int h = j / half, i = j % half;
        float *v = h < n_heads ? x + (t * n_heads + h) * (int64_t)head_dim
                               : x2 + (t * n_heads2 + h - n_heads) * (int64_t)head_dim;
        float c_, s_;
        if (shared)
            c_ = cs[i], s_ = sn[i];
        else
            rope_angle(pos, inv_freq, t, i, &c_, &s_);
        rope_turn(&v[i], &v[i + half], c_, s_);
    }
}

/* silu(g) · u = g / (1 + e^−g) · u */
__device__ __forceinline__ float silu_mul(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

/* With out16, out's 16-bit copy too. */
__global__ void swiglu_kernel(const float *gate, const float *up, int64_t n, float *out,
                              void *out16, enum llmem_dtype dt) {
    pdl_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const float v = silu_mul(gate[i], up[i]);
        out[i] = v;
        if (out16 != NULL)
            store16(out16, dt, i, v);
    }
}

__global__ void add_kernel(float *y, const float *x, int64_t n) {
    pdl_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], x[i]);
}

/* y[t, r] += bias[r] */
__global__ void bias_kernel(float *y, const float *bias, int64_t rows, int64_t n) {
    pdl_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n * rows;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], bias[i % rows]);
}

/* A block per token. The ids (uploaded before the pass) and a thread's first EMBED_HELD elements
 * of the row (weights) are read before the wait: no kernel writes them (launch.h). */
#define EMBED_HELD 8
/* FED: the ids were written by the kernel before (top_k's feed), read after the wait for it. */
template <bool FED>
__global__ void embedding_kernel(const void *table, enum llmem_dtype dt, int64_t dim,
                                 const int32_t *ids, float *out) {
    const int64_t t = blockIdx.x;
    if constexpr (FED)
        pdl_begin();
    const int64_t base = (int64_t)ids[t] * dim;
    float v[EMBED_HELD];
#pragma unroll
    for (int k = 0; k < EMBED_HELD; k++) {
        const int64_t i = threadIdx.x + (int64_t)k * blockDim.x;
        v[k] = i < dim ? weight_at(table, dt, base + i) : 0.0f;
    }
    if constexpr (!FED)
        pdl_begin();
#pragma unroll
    for (int k = 0; k < EMBED_HELD; k++) {
        const int64_t i = threadIdx.x + (int64_t)k * blockDim.x;
        if (i < dim)
            out[t * dim + i] = v[k];
    }
    for (int64_t i = threadIdx.x + (int64_t)EMBED_HELD * blockDim.x; i < dim; i += blockDim.x)
        out[t * dim + i] = weight_at(table, dt, base + i);
}

/* f32 → the weights' 16-bit type, round to nearest even */
__global__ void round_kernel(const float *x, int64_t n, enum llmem_dtype dt, void *out) {
    pdl_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        if (dt == LLMEM_DTYPE_BF16)
            ((__nv_bfloat16 *)out)[i] = __float2bfloat16_rn(x[i]);
        else
            ((__half *)out)[i] = __float2half_rn(x[i]);
    }
}

/* 16-bit weights → f32 */
__global__ void widen_kernel(const void *w, enum llmem_dtype dt, int64_t n, float *out) {
    pdl_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = weight_at(w, dt, i);
}

/* ---- the top k of rows (sampling on the device) --------------------------------------------- */

enum { TOP_THREADS = 1024, TOP_TIES = 1024 };

/* A float as an unsigned key in the same order (−0 as +0, which compare equal). */
__device__ __forceinline__ uint32_t order_key(float x) {
    uint32_t u = x == 0.0f ? 0u : __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

/* The largest entry of each row and its column (the lowest of equal ones): a block per row. */
__global__ void __launch_bounds__(TOP_THREADS)
    argmax_kernel(const float *x, int64_t cols, int32_t *ids, float *vals, int32_t *feed) {
    pdl_begin();
    const float *row = x + (size_t)blockIdx.x * (size_t)cols;
    uint32_t best = 0;
    int64_t at = INT64_MAX;
    /* a thread's first ARGMAX_HELD entries asked for together, then the rest */
    constexpr int ARGMAX_HELD = 4;
    float e[ARGMAX_HELD];
#pragma unroll
    for (int j = 0; j < ARGMAX_HELD; j++) {
        const int64_t i = threadIdx.x + (int64_t)j * blockDim.x;
        e[j] = i < cols ? row[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < ARGMAX_HELD; j++) {
        const int64_t i = threadIdx.x + (int64_t)j * blockDim.x;
        const uint32_t k = order_key(e[j]);
        if (i < cols && (k > best || at == INT64_MAX))
            best = k, at = i;
    }
    for (int64_t i = threadIdx.x + (int64_t)ARGMAX_HELD * blockDim.x; i < cols; i += blockDim.x) {
        uint32_t k = order_key(row[i]);
        if (k > best || at == INT64_MAX)
            best = k, at = i;
    }
    /* (key, column) ordered by key, then by the lower column */
    for (int o = 16; o > 0; o >>= 1) {
        uint32_t k2 = __shfl_down_sync(0xffffffffu, best, o);
        int64_t a2 = __shfl_down_sync(0xffffffffu, at, o);
        if (k2 > best || (k2 == best && a2 < at))
            best = k2, at = a2;
    }
    __shared__ uint32_t wk[TOP_THREADS / 32];
    __shared__ int64_t wa[TOP_THREADS / 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    if (lane == 0)
        wk[warp] = best, wa[warp] = at;
    __syncthreads();
    if (warp == 0) {
        best = lane < warps ? wk[lane] : 0;
        at = lane < warps ? wa[lane] : INT64_MAX;
        for (int o = 16; o > 0; o >>= 1) {
            uint32_t k2 = __shfl_down_sync(0xffffffffu, best, o);
            int64_t a2 = __shfl_down_sync(0xffffffffu, at, o);
            if (k2 > best || (k2 == best && a2 < at))
                best = k2, at = a2;
        }
        if (lane == 0) {
            ids[blockIdx.x] = (int32_t)at;
            vals[blockIdx.x] = row[at];
            if (feed != NULL)
                feed[blockIdx.x] = (int32_t)at;
        }
    }
}

/* The k largest entries of each row, a block per row, by radix selection on the keys: three
 * passes of a histogram over the next 11, 11 and 10 bits of the keys that share the bits chosen
 * so far find the k-th largest key τ; then every entry above τ, and the lowest columns of those
 * equal to τ as many as still needed, each written at its rank (key descending, column
 * ascending). */
__global__ void __launch_bounds__(TOP_THREADS)
    top_k_kernel(const float *x, int64_t cols, int k, int32_t *ids, float *vals) {
    pdl_begin();
    __shared__ uint32_t hist[2048];
    __shared__ uint32_t s_prefix, s_mask;
    __shared__ int s_need, s_above, s_ties;
    __shared__ uint32_t sel_key[LLMEM_TOP_K_MAX];
    __shared__ int64_t sel_at[LLMEM_TOP_K_MAX];
    __shared__ int64_t ties[TOP_TIES];
    const float *row = x + (size_t)blockIdx.x * (size_t)cols;
    uint32_t prefix = 0, mask = 0;
    int need = k; /* the rank of τ among the keys that match prefix under mask */
    const int shift[3] = {21, 10, 0}, width[3] = {11, 11, 10};
    for (int p = 0; p < 3; p++) {
        const uint32_t digits = (1u << width[p]) - 1;
        for (int b = threadIdx.x; b < 2048; b += blockDim.x)
            hist[b] = 0;
        __syncthreads();
        for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
            uint32_t key = order_key(row[i]);
            bool in = (key & mask) == prefix;
            uint32_t d = in ? (key >> shift[p]) & digits : 0xffffffffu;
            /* the lanes with the same digit add once (logits crowd into few bins) */
            uint32_t same = __match_any_sync(__activemask(), d);
            if (in && (threadIdx.x % 32) == (unsigned)(__ffs(same) - 1))
                atomicAdd(&hist[d], (uint32_t)__popc(same));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int acc = 0, b = (int)digits;
            for (; b > 0 && acc + (int)hist[b] < need; b--)
                acc += (int)hist[b];
            s_need = need - acc;
            s_prefix = prefix | ((uint32_t)b << shift[p]);
            s_mask = mask | (digits << shift[p]);
            s_above = 0, s_ties = 0;
        }
        __syncthreads();
        prefix = s_prefix, mask = s_mask, need = s_need;
    }
    /* τ = prefix; k − need keys lie above it */
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
        uint32_t key = order_key(row[i]);
        if (key > prefix) {
            int at = atomicAdd(&s_above, 1);
            sel_key[at] = key, sel_at[at] = i;
        } else if (key == prefix) {
            int at = atomicAdd(&s_ties, 1);
            if (at < TOP_TIES)
                ties[at] = i;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int n = s_above, nt = s_ties;
        if (nt <= TOP_TIES) { /* the `need` lowest columns, by selection */
            for (int j = 0; j < need; j++) {
                int m = j;
                for (int t = j + 1; t < nt; t++)
                    m = ties[t] < ties[m] ? t : m;
                int64_t lo = ties[m];
                ties[m] = ties[j], ties[j] = lo;
                sel_key[n] = prefix, sel_at[n++] = lo;
            }
        } else { /* more equal keys than the buffer holds: the row in order */
            for (int64_t i = 0; i < cols && n < k; i++)
                if (order_key(row[i]) == prefix)
                    sel_key[n] = prefix, sel_at[n++] = i;
        }
    }
    __syncthreads();
    if (threadIdx.x < (unsigned)k) { /* each entry to its rank: key descending, column ascending */
        const uint32_t key = sel_key[threadIdx.x];
        const int64_t at = sel_at[threadIdx.x];
        int r = 0;
        for (int t = 0; t < k; t++)
            r += sel_key[t] > key || (sel_key[t] == key && sel_at[t] < at);
        ids[(size_t)blockIdx.x * (size_t)k + (size_t)r] = (int32_t)at;
        vals[(size_t)blockIdx.x * (size_t)k + (size_t)r] = row[at];
    }
}

static unsigned grid_for(int64_t n, int threads) {
    int64_t g = (n + threads - 1) / threads;
    return (unsigned)(g < 1 ? 1 : g > 65535 * 8 ? 65535 * 8 : g);
}

/* ---- matmul ----------------------------------------------------------------------------------
 */

/* Eight weights from a 16-byte load, as f32. */
template <enum llmem_dtype DT> __device__ __forceinline__ void unpack8(uint4 v, float *w) {
    const uint32_t p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        if (DT == LLMEM_DTYPE_BF16) {
            w[2 * j] = __uint_as_float(p[j] << 16);
            w[2 * j + 1] = __uint_as_float(p[j] & 0xffff0000u);
        } else {
            __half2 h = *reinterpret_cast<const __half2 *>(&p[j]);
            float2 f = __half22float2(h);
            w[2 * j] = f.x;
            w[2 * j + 1] = f.y;
        }
    }
}

/* Up to four matrices of one dtype and column count multiplied with the same rows of x in one
 * launch (q, k and v; gate and up): matrix m takes blocks [first[m], first[m + 1]) (gemv16 sets
 * first; one grid of only the blocks with rows, so that q, k and v fit in one wave). */
struct gemv_set {
    const void *w[4];
    float *y[4];
    const float *bias[4];
    int64_t rows[4];
    unsigned first[5];
};

/* acc[j] += the 8 weights of chunk k (raw) · x[x_row0 + j, 8k … 8k + 7], for j < NX. */
template <enum llmem_dtype DT, int NX>
__device__ __forceinline__ void gemv_step(uint4 raw, const float *x, int64_t x_row0, int64_t cols,
                                          int64_t k, float *acc) {
    float wv[8];
    unpack8<DT>(raw, wv);
#pragma unroll
    for (int j = 0; j < NX; j++) {
        const float4 *xr = reinterpret_cast<const float4 *>(x + (x_row0 + j) * cols + k * 8);
        float4 a = __ldg(xr), b = __ldg(xr + 1);
        acc[j] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * b.x +
                  wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
    }
}

/* y[t, r] = Σ_k x[t, k] · w[r, k] for NX rows of x: W warps per weight row (each over 1/W of the
 * columns: long rows need more warps in flight than rows), 16-byte loads of 8 weights, each lane's
 * partial sums reduced by shuffles, then the W warps' in shared memory. 16-bit weights, cols a
 * multiple of 8·W and 16-byte aligned rows (checked by the caller). */
/* acc[j] = row wr (NULL: none, 0) · x[x_row0 + j] for j < NX, summed over the whole warp: its
 * share `part` of W (W warps a row). The kernel's pdl_begin comes in here, after the first weights
 * were asked for: the weights, written before any pass, do not wait for the kernels before this
 * one (the next GEMV's weights stream in while they finish); x and everything else do. */
template <enum llmem_dtype DT, int NX, int W>
__device__ __forceinline__ void gemv_row(const uint16_t *w_row, int64_t cols, const float *x,
                                         int64_t x_row0, int part, int lane, float *acc) {
#pragma unroll
    for (int j = 0; j < NX; j++)
        acc[j] = 0;
    bool waited = false;
    if (w_row != NULL) {
        const uint4 *wr = reinterpret_cast<const uint4 *>(w_row);
        const int64_t per = cols / 8 / W, end = (part + 1) * per;
        int64_t k = part * per + lane;
        /* GEMV_UNROLL loads of each lane in flight before any is used: a warp per row is too
         * few to cover the memory's latency one load at a time */
        for (; k + 32 * (GEMV_UNROLL - 1) < end; k += 32 * GEMV_UNROLL) {
            uint4 raw[GEMV_UNROLL];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++)
                raw[u] = __ldcs(wr + k + 32 * u); /* streamed once: do not keep it in L2 */
            if (!waited)
                pdl_begin(), waited = true;
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++)
                gemv_step<DT, NX>(raw[u], x, x_row0, cols, k + 32 * u, acc);
        }
        if (!waited)
            pdl_begin(), waited = true;
        for (; k < end; k += 32)
            gemv_step<DT, NX>(__ldcs(wr + k), x, x_row0, cols, k, acc);
    }
    if (!waited)
        pdl_begin();
#pragma unroll
    for (int j = 0; j < NX; j++)
        for (int o = 16; o > 0; o /= 2)
            acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
}

/* A block's 4 / W rows r of gate (warps 0–3) and of up (warps 4–7), W warps a row, and
 * out[x_row0 + j, r] = silu(gate) · up: the pair's GEMVs (as gemv16_kernel sums them) and swiglu in
 * one launch, with the bits of the three. */
template <enum llmem_dtype DT, int NX, int W>
__global__ void __launch_bounds__(256)
    gemv16_swiglu_kernel(const uint16_t *gate, const uint16_t *up, int64_t rows, int64_t cols,
                         const float *x, int64_t x_row0, float *out) {
    /* (pdl_begin in gemv_row) */
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, slot = warp % 4;
    const int64_t r = blockIdx.x * (int64_t)(4 / W) + slot / W;
    float acc[NX];
    gemv_row<DT, NX, W>(r < rows ? (warp < 4 ? gate : up) + r * cols : NULL, cols, x, x_row0,
                        slot % W, lane, acc);
    __shared__ float part[8][NX];
    if (lane == 0)
#pragma unroll
        for (int j = 0; j < NX; j++)
            part[warp][j] = acc[j];
    __syncthreads();
    if (warp >= 4 || slot % W != 0 || lane != 0 || r >= rows)
        return;
#pragma unroll
    for (int j = 0; j < NX; j++) {
        float g = part[warp][j], u = part[warp + 4][j];
        for (int i = 1; i < W; i++)
            g += part[warp + i][j], u += part[warp + 4 + i][j];
        out[(x_row0 + j) * rows + r] = silu_mul(g, u);
    }
}

/* One row of x: at most 64 registers a thread, four blocks an SM, so that the down projection's
 * 512 blocks (2,048 rows, two warps a row) run in one wave (at 70 registers, three: 1.3 waves).
 * More rows of x: at most 128 (uncapped, nvcc takes 218–255; at 64 they spill). */
template <enum llmem_dtype DT, int NX, int W>
__global__ void __launch_bounds__(256, NX == 1 ? 4 : 2)
    gemv16_kernel(struct gemv_set set, int64_t cols, const float *x, int64_t x_row0) {
    /* (pdl_begin in gemv_row: a warp without a row returns before touching memory) */
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    int m = 0;
    while (m < 3 && blockIdx.x >= set.first[m + 1])
        m++;
    const int64_t rows = set.rows[m];
    const int64_t r = (blockIdx.x - set.first[m]) * (int64_t)(blockDim.x / 32 / W) + warp / W;
    if (W == 1 && r >= rows)
        return;
    float acc[NX];
    gemv_row<DT, NX, W>(r < rows ? (const uint16_t *)set.w[m] + r * cols : NULL, cols, x, x_row0,
                        warp % W, lane, acc);
    __shared__ float part[W > 1 ? 8 : 1][NX];
#pragma unroll
    for (int j = 0; j < NX; j++)
        if (W > 1 && lane == 0)
            part[warp][j] = acc[j];
    if (W > 1) {
        __syncthreads();
        if (warp % W != 0 || r >= rows)
            return;
#pragma unroll
        for (int j = 0; j < NX; j++)
            for (int i = 1; i < W; i++)
                acc[j] += part[warp + i][j];
    }
    const float *bias = set.bias[m];
    float *y = set.y[m];
#pragma unroll
    for (int j = 0; j < NX; j++)
        if (lane == 0)
            y[(x_row0 + j) * rows + r] = bias != NULL ? acc[j] + bias[r] : acc[j];
}

/* The general case (f32 weights, odd shapes): one warp per (row of x, weight row). */
__global__ void gemv_any_kernel(const void *w, enum llmem_dtype dt, int64_t rows, int64_t cols,
                                const float *x, int64_t n, float *y, const float *bias) {
    pdl_begin();
    const int64_t warp = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (warp >= rows * n)
        return;
    const int64_t r = warp % rows, t = warp / rows;
    float s = 0;
    for (int64_t k = lane; k < cols; k += 32)
        s += weight_at(w, dt, r * cols + k) * x[t * cols + k];
    for (int o = 16; o > 0; o /= 2)
        s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0)
        y[t * rows + r] = bias != NULL ? s + bias[r] : s;
}

template <enum llmem_dtype DT>
static void gemv16(struct cuda_ctx *c, const struct gemv_set *set, int count, int64_t cols,
                   const float *x, int64_t n) {
    const int warps = 8;
    /* rows of 4096 columns and more: two warps a row (measured on the H200: down, 2048 × 8192,
     * 2.3 → 2.75 TB/s; gate+up, 2 × 8192 × 2048, is better at one) */
    const int split = cols >= 4096 && cols % 16 == 0 ? 2 : 1;
    const int per_block = warps / split;
    struct gemv_set s = *set;
    s.first[0] = 0;
    for (int i = 0; i < 4; i++)
        s.first[i + 1] =
            s.first[i] + (i < count ? (unsigned)((s.rows[i] + per_block - 1) / per_block) : 0);
    set = &s;
    dim3 grid(s.first[4]);
    for (int64_t t = 0; t < n;) {
#define GEMV_CASE(NX)                                                                              \
    case NX:                                                                                       \
        if (split == 2)                                                                            \
            pdl_launch(c->stream, gemv16_kernel<DT, NX, 2>, dim3(grid), dim3(warps * 32), 0, *set, \
                       cols, x, t);                                                                \
        else                                                                                       \
            pdl_launch(c->stream, gemv16_kernel<DT, NX, 1>, dim3(grid), dim3(warps * 32), 0, *set, \
                       cols, x, t);                                                                \
        t += NX;                                                                                   \
        break;
        switch (n - t >= 4 ? 4 : (int)(n - t)) {
            GEMV_CASE(1)
            GEMV_CASE(2)
            GEMV_CASE(3)
            GEMV_CASE(4)
        }
#undef GEMV_CASE
    }
    launched(c, "gemv");
}

/* The memory-bound kernel applies: a decode's few rows, 16-bit weights in aligned rows. */
static int gemv16_fits(const struct cuda_ctx *c, const struct llmem_weight *w, const float *x,
                       int64_t n) {
    return n <= gemv_rows(c) && (w->dtype == LLMEM_DTYPE_BF16 || w->dtype == LLMEM_DTYPE_F16) &&
           w->cols % 8 == 0 && ((uintptr_t)w->data & 15) == 0 && ((uintptr_t)x & 15) == 0;
}

static void gemv16_set(struct cuda_ctx *c, const struct gemv_set *set, int count,
                       enum llmem_dtype dt, int64_t cols, const float *x, int64_t n) {
    if (dt == LLMEM_DTYPE_BF16)
        gemv16<LLMEM_DTYPE_BF16>(c, set, count, cols, x, n);
    else
        gemv16<LLMEM_DTYPE_F16>(c, set, count, cols, x, n);
}

/* Column-major C[m, n] (ldc) = Aᵀ · B, A [k, m] and B [k, n] packed, in plain f32: the pedantic
 * compute type keeps TF32 out even when the environment asks for it. */
static void sgemm(struct cuda_ctx *c, int64_t m, int64_t n, int64_t k, const float *a,
                  const float *b, float *y, int64_t ldc) {
    const float one = 1.0f, zero = 0.0f;
    check_blas(c,
               cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)m, (int)n, (int)k, &one, a,
                            CUDA_R_32F, (int)k, b, CUDA_R_32F, (int)k, &zero, y, CUDA_R_32F,
                            (int)ldc, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx (f32)");
}

/* The 16-bit copy of x (n rows of cols) for weights of type dt, if the operation before wrote it.
 */
static const void *shadow_of(struct cuda_ctx *c, const float *x, int64_t n, int64_t cols,
                             enum llmem_dtype dt) {
    return c->shadow_x == x && c->shadow_n == n * cols && c->shadow_dt == dt &&
                   c->shadow_at == c->scratch
               ? c->shadow_at
               : NULL;
}

/* Where an operation producing n rows of cols floats writes their 16-bit copy as well (*dt its
 * type), or NULL: at fast precision, for a GEMM's rows (more than gemv_rows), when the fast
 * GEMMs rounded rows of this width before, into scratch that holds them already while a pass is
 * recorded or staged. */
static void *shadow_begin(struct cuda_ctx *c, int64_t n, int64_t cols, enum llmem_dtype *dt) {
    c->shadow_x = NULL;
    if (c->precision != LLMEM_PRECISION_FAST || n <= gemv_rows(c))
        return NULL;
    for (int i = 0; i < c->n_rounds && i < (int)(sizeof(c->rounds) / sizeof(c->rounds[0])); i++) {
        if (c->rounds[i].cols != cols)
            continue;
        const size_t bytes = (size_t)(n * cols) * 2;
        if (bytes > c->scratch_bytes && c->mode != PASS_NOW)
            return NULL;
        *dt = c->rounds[i].dt;
        return scratch(c, bytes);
    }
    return NULL;
}

static void shadow_set(struct cuda_ctx *c, const float *x, int64_t elems, enum llmem_dtype dt,
                       const void *at) {
    c->shadow_x = at != NULL ? x : NULL;
    c->shadow_n = elems, c->shadow_dt = dt, c->shadow_at = at;
}

/* Drops the shadow when [y, y + n) overlaps its f32 original (a GEMM's output). */
static void shadow_written(struct cuda_ctx *c, const float *y, int64_t n) {
    if (c->shadow_x != NULL && y < c->shadow_x + c->shadow_n && c->shadow_x < y + n)
        c->shadow_x = NULL;
}

/* x rounded to the weights' 16-bit type in scratch, for the tensor cores (fast precision). */
static const void *rounded(struct cuda_ctx *c, const float *x, int64_t n, int64_t cols,
                           enum llmem_dtype dt) {
    const int slots = (int)(sizeof(c->rounds) / sizeof(c->rounds[0]));
    int known = 0;
    for (int i = 0; i < c->n_rounds && i < slots; i++)
        known |= c->rounds[i].cols == cols && c->rounds[i].dt == dt;
    if (!known) { /* the oldest width makes room */
        c->rounds[c->n_rounds % slots].dt = dt, c->rounds[c->n_rounds % slots].cols = cols;
        c->n_rounds++;
    }
    void *xr = scratch(c, (size_t)(n * cols) * 2);
    if (xr == NULL)
        return NULL;
    pdl_launch(c->stream, round_kernel, dim3(grid_for(n * cols, 256)), dim3(256), 0, x, n * cols,
               dt, xr);
    launched(c, "round");
    c->counters.rounds++;
    return xr;
}

static void lt_plan_free(struct lt_plan *p) {
    if (!p->ready)
        return;
    cublasLtMatrixLayoutDestroy(p->a);
    cublasLtMatrixLayoutDestroy(p->b);
    cublasLtMatrixLayoutDestroy(p->c);
    cublasLtMatmulDescDestroy(p->op);
    p->ready = 0;
}

/* The best algorithm cublasLt's heuristic knows for the shape with at most `workspace` bytes of
 * workspace; LLMEM_OK, or the status of a failure (logged). */
static int lt_plan_make(struct cuda_ctx *c, struct lt_plan *p, size_t workspace) {
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res = {};
    int found = 0;
    p->op = NULL, p->a = p->b = p->c = NULL, p->ready = 1;
    cublasStatus_t st = cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatrixLayoutCreate(&p->a, p->type, (uint64_t)p->cols, (uint64_t)p->rows,
                                        p->cols);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatrixLayoutCreate(&p->b, p->type, (uint64_t)p->cols, (uint64_t)p->n, p->cols);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatrixLayoutCreate(&p->c, CUDA_R_32F, (uint64_t)p->rows, (uint64_t)p->n,
                                        p->rows);
    /* a batch: the matrices one after the other, one x (stride 0), the outputs stride_c apart */
    const int32_t batch = (int32_t)p->batch;
    cublasLtMatrixLayout_t layouts[3] = {p->a, p->b, p->c};
    const int64_t strides[3] = {p->rows * p->cols, 0, p->stride_c};
    for (int i = 0; batch > 1 && i < 3; i++) {
        if (st == CUBLAS_STATUS_SUCCESS)
            st = cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                  &batch, sizeof(batch));
        if (st == CUBLAS_STATUS_SUCCESS)
            st = cublasLtMatrixLayoutSetAttribute(layouts[i],
                                                  CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                  &strides[i], sizeof(strides[i]));
    }
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceCreate(&pref);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &workspace, sizeof(workspace));
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &res,
                                            &found);
    if (st == CUBLAS_STATUS_SUCCESS && found == 0)
        st = CUBLAS_STATUS_NOT_SUPPORTED;
    if (pref != NULL)
        cublasLtMatmulPreferenceDestroy(pref);
    p->algo = res.algo;
    p->workspace = res.workspaceSize;
    return check_blas(c, st, "cublasLt plan");
}

/* The plan of a shape, made at its first use (and its workspace provided), or NULL: then the pass
 * is failed, or is being recorded and runs again as usual (c->pass_bad). */
static const struct lt_plan *lt_plan_for(struct cuda_ctx *c, int64_t rows, int64_t n, int64_t cols,
                                         cudaDataType_t type, int64_t batch, int64_t stride_c) {
    const int64_t key[6] = {rows, n, cols, (int64_t)type, batch, stride_c};
    uint64_t h = llmem_hash64(key, sizeof(key), 0);
    struct lt_plan *p = NULL;
    for (int probe = 0; probe < 8; probe++) {
        struct lt_plan *q = &c->lt_plans[(h + (uint64_t)probe) % LT_PLANS];
        if (q->ready && q->rows == rows && q->n == n && q->cols == cols && q->type == type &&
            q->batch == batch && q->stride_c == stride_c)
            return q;
        if (p == NULL && !q->ready)
            p = q;
    }
    if (c->mode != PASS_NOW) { /* planning waits for the stream: not while recording */
        c->pass_bad = 1;
        return NULL;
    }
    if (p == NULL) /* a full neighbourhood: its first slot makes room */
        lt_plan_free(p = &c->lt_plans[h % LT_PLANS]);
    p->rows = rows, p->n = n, p->cols = cols, p->type = type, p->batch = batch;
    p->stride_c = stride_c;
    if (lt_plan_make(c, p, LT_WORKSPACE_MAX) != LLMEM_OK) {
        lt_plan_free(p);
        return NULL;
    }
    if (p->workspace > c->lt_ws_bytes) {
        check(c, cudaStreamSynchronize(c->stream), "synchronize");
        dev_free(c, c->lt_ws);
        c->lt_ws_bytes = 0;
        if ((c->lt_ws = dev_alloc(c, p->workspace)) != NULL) {
            c->lt_ws_bytes = p->workspace;
        } else { /* refused by the memory limit: an algorithm without workspace */
            (void)cudaGetLastError();
            lt_plan_free(p); /* (keeps the shape) */
            if (lt_plan_make(c, p, 0) != LLMEM_OK) {
                lt_plan_free(p);
                return NULL;
            }
        }
    }
    return p;
}

/* cuda_matmul, where xr (if not NULL) is x already rounded for the fast GEMM. */
static void matmul(struct cuda_ctx *c, const struct llmem_weight *w, const float *x, const void *xr,
                   int64_t n, float *y, const float *bias) {
    const int is16 = w->dtype == LLMEM_DTYPE_BF16 || w->dtype == LLMEM_DTYPE_F16;
    if (n <= gemv_rows(c)) {
        if (gemv16_fits(c, w, x, n)) {
            const struct gemv_set set = {
                {w->data}, {y}, {bias}, {w->rows}, {0}}; /* first: gemv16 */
            gemv16_set(c, &set, 1, w->dtype, w->cols, x, n);
        } else {
            int64_t warps = w->rows * n;
            pdl_launch(c->stream, gemv_any_kernel, dim3((unsigned)((warps + 7) / 8)), dim3(256), 0,
                       w->data, w->dtype, w->rows, w->cols, x, n, y, bias);
            launched(c, "gemv");
        }
        return;
    }
    /* Row-major y[n, rows] = x[n, cols] · Wᵀ is, column-major, C[rows, n] = Aᵀ · B with A = W
     * ([cols, rows], lda = cols) and B = x ([cols, n], ldb = cols). */
    if (!is16) {
        sgemm(c, w->rows, n, w->cols, (const float *)w->data, x, y, w->rows);
    } else if (c->precision == LLMEM_PRECISION_FAST) {
        const float one = 1.0f, zero = 0.0f;
        const cudaDataType_t t = w->dtype == LLMEM_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
        const struct lt_plan *p = lt_plan_for(c, w->rows, n, w->cols, t, 1, 0);
        if (xr == NULL)
            xr = shadow_of(c, x, n, w->cols, w->dtype);
        if (p == NULL || (xr == NULL && (xr = rounded(c, x, n, w->cols, w->dtype)) == NULL))
            return;
        profile_begin(c->stream);
        check_blas(c,
                   cublasLtMatmul(c->lt, p->op, &one, w->data, p->a, xr, p->b, &zero, y, p->c, y,
                                  p->c, &p->algo, p->workspace > 0 ? c->lt_ws : NULL, p->workspace,
                                  c->stream),
                   "cublasLtMatmul");
        launched(c, "gemm");
    } else {
        /* f32: slices of weight rows widened to f32, each a plain f32 GEMM into its columns of
         * C (rows r0 … r0 + m of y's rows, ldc = rows). */
        int64_t slice = (int64_t)(WIDEN_SLICE_BYTES / ((size_t)w->cols * 4));
        slice = slice < 1 ? 1 : slice > w->rows ? w->rows : slice;
        float *wf = (float *)scratch(c, (size_t)(slice * w->cols) * 4);
        if (wf == NULL)
            return;
        for (int64_t r0 = 0; r0 < w->rows && !c->failed; r0 += slice) {
            int64_t m = w->rows - r0 < slice ? w->rows - r0 : slice;
            pdl_launch(c->stream, widen_kernel, dim3(grid_for(m * w->cols, 256)), dim3(256), 0,
                       (const uint16_t *)w->data + r0 * w->cols, w->dtype, m * w->cols, wf);
            launched(c, "widen");
            sgemm(c, m, n, w->cols, wf, x, y + r0, w->rows);
        }
    }
    if (bias != NULL) {
        pdl_launch(c->stream, bias_kernel, dim3(grid_for(n * w->rows, 256)), dim3(256), 0, y, bias,
                   w->rows, n);
        launched(c, "bias");
    }
}

static void cuda_matmul(void *ctx, const struct llmem_weight *w, const float *x, int64_t n,
                        float *y, const float *bias) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    LLMEM_ASSERT(w != NULL && x != NULL && y != NULL && n >= 0);
    if (n == 0 || c->failed ||
        staged(c, OP_MATMUL,
               {arg(w->data), arg((int64_t)w->dtype), arg(w->rows), arg(w->cols), arg(x), arg(n),
                arg(y), arg(bias), arg(shadow_of(c, x, n, w->cols, w->dtype))}))
        return;
    matmul(c, w, x, NULL, n, y, bias);
    shadow_written(c, y, n * w->rows);
}

/* Several matrices of the same x: one launch when all take the memory-bound kernel together. */
static void cuda_matmul_multi(void *ctx, int count, const struct llmem_weight *const *w,
                              const float *x, int64_t n, float *const *y,
                              const float *const *bias) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    LLMEM_ASSERT(count >= 1 && count <= 4);
    int together = 1;
    for (int i = 0; i < count; i++)
        together = together && gemv16_fits(c, w[i], x, n) && w[i]->dtype == w[0]->dtype &&
                   w[i]->cols == w[0]->cols;
    if (!together || n == 0 || c->failed) {
        /* the fast GEMMs of one x: rounded once for all */
        int shared = n > gemv_rows(c) && c->precision == LLMEM_PRECISION_FAST && !c->failed;
        for (int i = 0; i < count; i++)
            shared = shared && w[i]->dtype == w[0]->dtype && w[i]->cols == w[0]->cols &&
                     (w[i]->dtype == LLMEM_DTYPE_BF16 || w[i]->dtype == LLMEM_DTYPE_F16);
        if (!shared) {
            for (int i = 0; i < count; i++)
                cuda_matmul(ctx, w[i], x, n, y[i], bias != NULL ? bias[i] : NULL);
            return;
        }
        for (int i = 0; i < count; i++)
            staged(c, OP_MATMUL_W,
                   {arg(w[i]->data), arg(w[i]->rows), arg(y[i]), arg(bias ? bias[i] : NULL)});
        const void *xr = shadow_of(c, x, n, w[0]->cols, w[0]->dtype);
        if (staged(c, OP_MATMUL_MULTI,
                   {arg((int64_t)count), arg(x), arg(n), arg(w[0]->cols), arg(xr)}))
            return;
        if (xr == NULL)
            xr = rounded(c, x, n, w[0]->cols, w[0]->dtype);
        for (int i = 0; xr != NULL && i < count; i++) {
            /* a pair in one buffer, without biases, into outputs a fixed stride apart: one
             * batched GEMM */
            if (i + 1 < count && llmem_weight_follows(w[i], w[i + 1]) &&
                (bias == NULL || (bias[i] == NULL && bias[i + 1] == NULL)) &&
                y[i + 1] - y[i] >= n * w[i]->rows) {
                const cudaDataType_t t = w[i]->dtype == LLMEM_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
                const float one = 1.0f, zero = 0.0f;
                const struct lt_plan *p =
                    lt_plan_for(c, w[i]->rows, n, w[i]->cols, t, 2, (int64_t)(y[i + 1] - y[i]));
                if (p == NULL)
                    return;
                profile_begin(c->stream);
                check_blas(c,
                           cublasLtMatmul(c->lt, p->op, &one, w[i]->data, p->a, xr, p->b, &zero,
                                          y[i], p->c, y[i], p->c, &p->algo,
                                          p->workspace > 0 ? c->lt_ws : NULL, p->workspace,
                                          c->stream),
                           "cublasLtMatmul");
                launched(c, "gemm pair");
                i++;
                continue;
            }
            matmul(c, w[i], x, xr, n, y[i], bias != NULL ? bias[i] : NULL);
        }
        for (int i = 0; i < count; i++)
            shadow_written(c, y[i], n * w[i]->rows);
        return;
    }
    for (int i = 0; i < count; i++)
        staged(c, OP_MATMUL_W,
               {arg(w[i]->data), arg(w[i]->rows), arg(y[i]), arg(bias ? bias[i] : NULL)});
    if (staged(c, OP_GEMV_SET, {arg((int64_t)count), arg(x), arg(n)}))
        return;
    struct gemv_set set = {};
    for (int i = 0; i < count; i++) {
        set.w[i] = w[i]->data;
        set.y[i] = y[i];
        set.bias[i] = bias != NULL ? bias[i] : NULL;
        set.rows[i] = w[i]->rows;
    }
    gemv16_set(c, &set, count, w[0]->dtype, w[0]->cols, x, n);
}

/* ---- the other operations --------------------------------------------------------------------
 */

static void rmsnorm(struct cuda_ctx *c, float *x, const float *res, const float *weight, int64_t n,
                    int64_t dim, float eps, float *y) {
    LLMEM_ASSERT(x != NULL && weight != NULL && y != NULL && dim > 0 && n >= 0);
    if (n == 0 || c->failed)
        return;
    enum llmem_dtype dt = LLMEM_DTYPE_F32;
    uint8_t *y16 = (uint8_t *)shadow_begin(c, n, dim, &dt);
    if (staged(c, OP_RMSNORM,
               {arg(x), arg(res), arg(weight), arg(n), arg(dim), arg(eps), arg(y), arg(y16),
                arg((int64_t)dt)})) {
        shadow_set(c, y, n * dim, dt, y16);
        return;
    }
    for (int64_t t = 0; t < n; t += 65535) {
        unsigned rows = (unsigned)(n - t < 65535 ? n - t : 65535);
        const unsigned threads = dim >= 1024 ? 1024 : 256;
        const int64_t per = (dim + threads - 1) / threads;
        auto kernel = per <= 1   ? rmsnorm_kernel<1>
                      : per <= 2 ? rmsnorm_kernel<2>
                      : per <= 4 ? rmsnorm_kernel<4>
                      : per <= 8 ? rmsnorm_kernel<8>
                                 : rmsnorm_kernel<0>;
        pdl_launch(c->stream, kernel, dim3(rows), dim3(threads), 0, x + t * dim,
                   res != NULL ? res + t * dim : NULL, weight, dim, eps, y + t * dim,
                   y16 != NULL ? y16 + t * dim * 2 : NULL, dt);
    }
    launched(c, "rmsnorm");
    shadow_set(c, y, n * dim, dt, y16);
}

static void cuda_rmsnorm(void *ctx, const float *x, const float *weight, int64_t n, int64_t dim,
                         float eps, float *y) {
    rmsnorm((struct cuda_ctx *)ctx, (float *)x, NULL, weight, n, dim, eps, y); /* x unwritten */
}

static void cuda_add_rmsnorm(void *ctx, float *x, const float *res, const float *weight, int64_t n,
                             int64_t dim, float eps, float *y) {
    LLMEM_ASSERT(res != NULL);
    rmsnorm((struct cuda_ctx *)ctx, x, res, weight, n, dim, eps, y);
}

static void rope_launch(struct cuda_ctx *c, float *x, int n_heads, float *x2, int n_heads2,
                        int64_t n, int head_dim, const uint8_t *d);

/* Launches a queued rope_qk on its own, so that nothing reads q or k before they are turned: from
 * staged, which every operation calls before it launches (all but the KV write that can take
 * it), and first in those that stage nothing (copy, sync, top_k, graph_begin, graph_end). */
static void rope_flush(struct cuda_ctx *c) {
    if (!c->rope_pending)
        return;
    c->rope_pending = 0;
    if (!c->failed)
        rope_launch(c, c->rope_later.q, c->rope_later.n_heads, c->rope_later.k,
                    c->rope_later.n_kv_heads, c->rope_later.n, c->rope_later.head_dim,
                    c->rope_later.d);
}

/* Rotary embedding of x [n, n_heads, head_dim] and x2 [n, n_heads2, head_dim] in one launch; with
 * x2 (q and k) queued for the KV write after it where it can take it (rope_later). */
static void rope(struct cuda_ctx *c, float *x, int n_heads, float *x2, int n_heads2, int64_t n,
                 int head_dim, const int64_t *pos, const float *inv_freq) {
    LLMEM_ASSERT(x != NULL && pos != NULL && inv_freq != NULL && n >= 0 && n_heads > 0);
    LLMEM_ASSERT(head_dim > 0 && head_dim % 2 == 0 && (x2 != NULL || n_heads2 == 0));
    if (n == 0 || c->failed)
        return;
    const size_t pos_bytes = (size_t)n * sizeof(int64_t), freq_bytes = (size_t)head_dim / 2 * 4;
    if (pos_bytes + freq_bytes > c->small_bytes) { /* a long prompt: in pieces */
        int64_t per = (int64_t)((c->small_bytes - freq_bytes) / sizeof(int64_t));
        for (int64_t t = 0; t < n; t += per)
            rope(c, x + t * n_heads * (int64_t)head_dim, n_heads,
                 x2 != NULL ? x2 + t * n_heads2 * (int64_t)head_dim : NULL, n_heads2,
                 n - t < per ? n - t : per, head_dim, pos + t, inv_freq);
        return;
    }
    uint8_t *packed = (uint8_t *)c->staging;
    memcpy(packed, pos, pos_bytes);
    memcpy(packed + pos_bytes, inv_freq, freq_bytes);
    const uint8_t *d = (const uint8_t *)small_upload(c, packed, pos_bytes + freq_bytes);
    if (d == NULL || staged(c, OP_ROPE,
                            {arg(x), arg((int64_t)n_heads), arg(x2), arg((int64_t)n_heads2), arg(n),
                             arg((int64_t)head_dim), arg(d)}))
        return;
    if (x2 != NULL && llmem_cuda_kv_encode_rope_fits(n, head_dim)) {
        c->rope_later.q = x, c->rope_later.k = x2, c->rope_later.n = n, c->rope_later.d = d;
        c->rope_later.n_heads = n_heads, c->rope_later.n_kv_heads = n_heads2;
        c->rope_later.head_dim = head_dim;
        c->rope_pending = 1;
        return;
    }
    rope_launch(c, x, n_heads, x2, n_heads2, n, head_dim, d);
}

/* rope_kernel over x and x2, pos and inv_freq at d (n positions, then head_dim / 2 floats). */
static void rope_launch(struct cuda_ctx *c, float *x, int n_heads, float *x2, int n_heads2,
                        int64_t n, int head_dim, const uint8_t *d) {
    const size_t pos_bytes = (size_t)n * sizeof(int64_t);
    /* the heads of a token in groups, enough blocks for the device (the angles once a block) */
    const int heads = n_heads + n_heads2;
    const int64_t want = (ROPE_BLOCKS + n - 1) / n;
    const int groups = want < heads ? (int)want : heads, per = (heads + groups - 1) / groups;
    for (int64_t t = 0; t < n; t += 65535)
        pdl_launch(c->stream, rope_kernel,
                   dim3((unsigned)(n - t < 65535 ? n - t : 65535), (unsigned)groups), dim3(256), 0,
                   x + t * n_heads * (int64_t)head_dim, n_heads,
                   x2 != NULL ? x2 + t * n_heads2 * (int64_t)head_dim : NULL, n_heads2, head_dim,
                   (const int64_t *)d + t, (const float *)(d + pos_bytes), per);
    launched(c, "rope");
}

static void cuda_rope(void *ctx, float *x, int64_t n, int n_heads, int head_dim, const int64_t *pos,
                      const float *inv_freq) {
    rope((struct cuda_ctx *)ctx, x, n_heads, NULL, 0, n, head_dim, pos, inv_freq);
}

static void cuda_rope_qk(void *ctx, float *q, float *k, int64_t n, int n_heads, int n_kv_heads,
                         int head_dim, const int64_t *pos, const float *inv_freq) {
    rope((struct cuda_ctx *)ctx, q, n_heads, k, n_kv_heads, n, head_dim, pos, inv_freq);
}

/* swiglu, and for rows of `cols` (0: unknown) its 16-bit copy for the GEMM after it. */
static void swiglu(struct cuda_ctx *c, const float *gate, const float *up, int64_t n, int64_t cols,
                   float *out) {
    LLMEM_ASSERT(gate != NULL && up != NULL && out != NULL && n >= 0);
    if (n == 0 || c->failed)
        return;
    enum llmem_dtype dt = LLMEM_DTYPE_F32;
    void *o16 = cols > 0 && n % cols == 0 ? shadow_begin(c, n / cols, cols, &dt) : NULL;
    if (staged(c, OP_SWIGLU, {arg(gate), arg(up), arg(n), arg(out), arg(o16), arg((int64_t)dt)})) {
        shadow_set(c, out, n, dt, o16);
        return;
    }
    pdl_launch(c->stream, swiglu_kernel, dim3(grid_for(n, 256)), dim3(256), 0, gate, up, n, out,
               o16, dt);
    launched(c, "swiglu");
    shadow_set(c, out, n, dt, o16);
}

static void cuda_swiglu(void *ctx, const float *gate, const float *up, int64_t n, float *out) {
    swiglu((struct cuda_ctx *)ctx, gate, up, n, 0, out);
}

/* A decode's few rows of x: a launch for up to 4 of them computes both GEMVs and swiglu
 * (gemv16_swiglu_kernel); more rows take the GEMMs and swiglu. */
static void cuda_matmul_swiglu(void *ctx, const struct llmem_weight *gate,
                               const struct llmem_weight *up, const float *x, int64_t n, float *g,
                               float *u, float *out) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    LLMEM_ASSERT(gate != NULL && up != NULL && x != NULL && out != NULL && n >= 0);
    if (!gemv16_fits(c, gate, x, n) || !gemv16_fits(c, up, x, n) || gate->dtype != up->dtype ||
        gate->rows != up->rows || gate->cols != up->cols) {
        const struct llmem_weight *w[2] = {gate, up};
        float *y[2] = {g, u};
        cuda_matmul_multi(ctx, 2, w, x, n, y, NULL);
        swiglu(c, g, u, n * gate->rows, gate->rows, out);
        return;
    }
    if (n == 0 || c->failed ||
        staged(c, OP_GEMV_SWIGLU,
               {arg(gate->data), arg(up->data), arg((int64_t)gate->dtype), arg(gate->rows),
                arg(gate->cols), arg(x), arg(n), arg(out)}))
        return;
    const int64_t rows = gate->rows, cols = gate->cols;
    const int split = cols >= 4096 && cols % 16 == 0 ? 2 : 1; /* as gemv16 */
    const dim3 grid((unsigned)((rows + 4 / split - 1) / (4 / split)));
    const uint16_t *wg = (const uint16_t *)gate->data, *wu = (const uint16_t *)up->data;
    for (int64_t t = 0; t < n;) {
        const int nx = n - t >= 4 ? 4 : (int)(n - t);
#define SWIGLU_CASE(DT, NX)                                                                        \
    if (gate->dtype == DT && nx == NX) {                                                           \
        if (split == 2)                                                                            \
            pdl_launch(c->stream, gemv16_swiglu_kernel<DT, NX, 2>, grid, dim3(256), 0, wg, wu,     \
                       rows, cols, x, t, out);                                                     \
        else                                                                                       \
            pdl_launch(c->stream, gemv16_swiglu_kernel<DT, NX, 1>, grid, dim3(256), 0, wg, wu,     \
                       rows, cols, x, t, out);                                                     \
    }
        SWIGLU_CASE(LLMEM_DTYPE_BF16, 1)
        SWIGLU_CASE(LLMEM_DTYPE_BF16, 2)
        SWIGLU_CASE(LLMEM_DTYPE_BF16, 3)
        SWIGLU_CASE(LLMEM_DTYPE_BF16, 4)
        SWIGLU_CASE(LLMEM_DTYPE_F16, 1)
        SWIGLU_CASE(LLMEM_DTYPE_F16, 2)
        SWIGLU_CASE(LLMEM_DTYPE_F16, 3)
        SWIGLU_CASE(LLMEM_DTYPE_F16, 4)
#undef SWIGLU_CASE
        t += nx;
    }
    launched(c, "gemv swiglu");
}

static void cuda_add(void *ctx, float *y, const float *x, int64_t n) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    LLMEM_ASSERT(y != NULL && x != NULL && n >= 0);
    if (n == 0 || c->failed || staged(c, OP_ADD, {arg(y), arg(x), arg(n)}))
        return;
    pdl_launch(c->stream, add_kernel, dim3(grid_for(n, 256)), dim3(256), 0, y, x, n);
    launched(c, "add");
}

static void cuda_embedding(void *ctx, const struct llmem_weight *table, const int32_t *ids,
                           int64_t n, float *out) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    LLMEM_ASSERT(table != NULL && ids != NULL && out != NULL && n >= 0);
    if (n == 0 || c->failed)
        return;
    const int64_t per = (int64_t)(c->small_bytes / sizeof(int32_t));
    for (int64_t t = 0; t < n; t += per) {
        int64_t m = n - t < per ? n - t : per;
        for (int64_t i = 0; i < m; i++)
            LLMEM_ASSERT(ids[t + i] >= 0 && ids[t + i] < table->rows);
        const int32_t *d = (const int32_t *)small_upload(c, ids + t, (size_t)m * sizeof(int32_t));
        if (d == NULL)
            return;
        if (staged(c, OP_EMBEDDING, {arg(table->data), arg(table->cols), arg(d), arg(m), arg(out)}))
            continue;
        pdl_launch(c->stream, embedding_kernel<false>, dim3((unsigned)m), dim3(256), 0, table->data,
                   table->dtype, table->cols, d, out + t * table->cols);
    }
    launched(c, "embedding");
}

static void cuda_embedding_top(void *ctx, const struct llmem_weight *table, int64_t n, float *out) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    LLMEM_ASSERT(table != NULL && out != NULL && n >= 0 && n <= c->feed_rows);
    if (n == 0 || c->failed)
        return;
    if (staged(c, OP_EMBEDDING_TOP, {arg(table->data), arg(table->cols), arg(n), arg(out)}))
        return;
    pdl_launch(c->stream, embedding_kernel<true>, dim3((unsigned)n), dim3(256), 0, table->data,
               table->dtype, table->cols, (const int32_t *)c->feed, out);
    launched(c, "embedding");
}

/* What a launch depends on of a rotation (0: none). */
static uint64_t rotation_sig(const struct llmem_backend_kv_rotation *r) {
    return r != NULL ? llmem_hash64(r, sizeof(*r), 1) : 0;
}

static void cuda_kv_encode(void *ctx, enum llmem_kv_format format,
                           const struct llmem_backend_kv_rotation *rotation, const float *k,
                           const float *v, int64_t n, int heads, int head_dim, const int64_t *slots,
                           uint8_t *k_pool, uint8_t *v_pool, size_t key_bytes, size_t value_bytes) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    const int64_t per = (int64_t)(SMALL_MAX / sizeof(int64_t));
    for (int64_t t = 0; t < n && !c->failed; t += per) {
        const int64_t m = n - t < per ? n - t : per;
        const int64_t *d = (const int64_t *)small_upload(c, slots + t, (size_t)m * sizeof(int64_t));
        if (d == NULL)
            return;
        if (staged(c, OP_KV_ENCODE,
                   {arg((int64_t)format), rotation_sig(rotation), arg(k), arg(v), arg(m),
                    arg((int64_t)heads), arg((int64_t)head_dim), arg(d), arg(k_pool), arg(v_pool),
                    arg((int64_t)key_bytes), arg((int64_t)value_bytes)}))
            continue;
        const struct rope_later *r = &c->rope_later;
        if (c->rope_pending && r->k == k && r->n == n && m == n && r->n_kv_heads == heads &&
            r->head_dim == head_dim) { /* the rope_qk just before: one launch for both */
            c->rope_pending = 0;
            llmem_cuda_kv_encode_rope(c->stream, format, rotation, r->q, r->n_heads, r->k, v, n,
                                      heads, head_dim, (const int64_t *)r->d,
                                      (const float *)(r->d + (size_t)n * sizeof(int64_t)), d,
                                      k_pool, v_pool, key_bytes, value_bytes);
            launched(c, "rope + kv encode");
            continue;
        }
        rope_flush(c);
        const int64_t off = t * heads * (int64_t)head_dim;
        llmem_cuda_kv_encode(c->stream, format, rotation, k + off, v + off, m, heads, head_dim, d,
                             k_pool, v_pool, key_bytes, value_bytes);
        launched(c, "kv encode");
    }
}

/* The split-K decode kernel of attention.cu takes these queries (a sequence's last position, or a
 * chunk's queries as sequences of their own lengths): no window, f16, bf16, q8 (on tensor cores),
 * q4 or tq blocks of 16 tokens. */
static int decode_kernel_fits(const struct llmem_backend_paged_attn *a) {
    const int group = a->n_heads / a->n_kv_heads;
    return a->window == 0 && a->format != LLMEM_KV_FORMAT_F32 && a->block_size == 16 &&
           group <= 8 && (a->head_dim == 64 || a->head_dim == 128 || a->head_dim == 256);
}

/* What a launch of the decode kernel reads from c->staging (n_ints int32 in all): the block
 * tables (table_stride apart; 0: one table for all) from index 0, the queries' lengths from
 * lengths_at, the table of each query from ids_at and the first query of each pack from packs_at
 * (NO_IDS: none); queries a warp takes together: pack. */
#define NO_IDS ((size_t)-1)
struct attn_call {
    int n_queries, table_stride, max_len, pack, n_packs;
    int fresh; /* the newest tokens of a sequence, just written by the KV write before */
    size_t lengths_at, ids_at, packs_at, n_ints;
};
static_assert(sizeof(struct attn_call) == 6 * sizeof(int) + 4 * sizeof(size_t),
              "attn_call is hashed as bytes: no padding");

/* Queries of a prefill chunk a warp takes together: as many as fill the kernel's 8 rows. */
static int attn_pack(const struct llmem_backend_paged_attn *a) {
    const int group = a->n_heads / a->n_kv_heads;
    return group <= 4 ? 8 / group : 1;
}

/* Runs the decode kernel over the queries of `call`; q and out [n_queries, n_heads, head_dim]. */
static void decode_kernel(struct cuda_ctx *c, const struct llmem_backend_paged_attn *a,
                          const struct attn_call *call) {
    const int32_t *d = (const int32_t *)small_upload(c, c->staging, call->n_ints * sizeof(int32_t));
    if (d == NULL ||
        staged(c, OP_ATTN_DECODE,
               {arg((int64_t)a->format), arg((int64_t)a->n_heads), arg((int64_t)a->n_kv_heads),
                arg((int64_t)a->head_dim), arg(a->q), arg(a->k_pool), arg(a->v_pool), arg(a->out),
                arg(d), arg(a->scale), arg((int64_t)a->k_tok), arg((int64_t)a->v_tok),
                rotation_sig(a->rotation), arg((int64_t)llmem_hash64(call, sizeof(*call), 0))}))
        return;
    struct llmem_cuda_attn ca = {};
    ca.format = a->format;
    ca.n_heads = a->n_heads;
    ca.n_kv_heads = a->n_kv_heads;
    ca.head_dim = a->head_dim;
    ca.block_size = a->block_size;
    ca.batch = call->n_queries;
    ca.max_len = call->max_len;
    ca.scale = a->scale;
    ca.q = a->q;
    ca.k_pool = a->k_pool;
    ca.v_pool = a->v_pool;
    ca.block_stride = (int64_t)a->block_size * (int64_t)a->k_tok;
    ca.v_block_stride = (int64_t)a->block_size * (int64_t)a->v_tok;
    ca.rotation = a->rotation;
    ca.block_tables = d;
    ca.table_stride = call->table_stride;
    ca.lengths = d + call->lengths_at;
    ca.fresh = call->fresh;
    ca.table_ids = call->ids_at != NO_IDS ? d + call->ids_at : NULL;
    ca.pack = call->pack;
    ca.packs = call->packs_at != NO_IDS ? d + call->packs_at : NULL;
    ca.n_packs = call->n_packs;
    ca.out = a->out;
    ca.stream = c->stream;
    ca.workspace_bytes = llmem_cuda_attn_workspace_bytes(&ca);
    /* a prefill chunk's splits merged inside the kernel when they are few; a decode step's by the
     * second kernel, which measured faster inside the pass (docs/BENCHMARKS.md) */
    if (call->pack > 1) {
        ca.counters = (unsigned *)((uint8_t *)c->small + c->small_bytes * SMALL_SLOTS);
        ca.n_counters = ATTN_COUNTERS_BYTES / sizeof(unsigned);
    }
    if (ca.workspace_bytes > 0 && (ca.workspace = scratch(c, ca.workspace_bytes)) == NULL)
        return;
    if (llmem_cuda_attn_decode(&ca) != LLMEM_OK)
        fail(c, LLMEM_EIO, "attention", NULL); /* logged by attention.cu */
    else
        launched(c, "attention");
}

static void cuda_kv_attend(void *ctx, const struct llmem_backend_paged_attn *a) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (a->n_q == 0 || c->failed)
        return;
    const size_t max_ints = SMALL_MAX / sizeof(int32_t);
    if ((size_t)a->n_blocks + 1 > max_ints) {
        LLMEM_ERROR("cuda backend: a sequence of %lld blocks (at most %zu)", (long long)a->n_blocks,
                    max_ints - 1);
        fail(c, LLMEM_EINVAL, "per-call data", NULL);
        return;
    }
    for (int64_t b = 0; b < a->n_blocks; b++)
        c->staging[b] = (int32_t)a->blocks[b];
    if (decode_kernel_fits(a) && (size_t)(a->n_blocks + a->n_q) <= max_ints) {
        /* each query a "sequence" of its own length over the one table (on tensor cores) */
        for (int64_t i = 0; i < a->n_q; i++)
            c->staging[a->n_blocks + i] = (int32_t)(a->q_pos + i + 1);
        const struct attn_call call = {.n_queries = (int)a->n_q,
                                       .table_stride = 0,
                                       .max_len = (int)(a->q_pos + a->n_q),
                                       .pack = a->n_q > 1 ? attn_pack(a) : 1,
                                       .n_packs = 0,
                                       .fresh = (int)a->n_q,
                                       .lengths_at = (size_t)a->n_blocks,
                                       .ids_at = NO_IDS,
                                       .packs_at = NO_IDS,
                                       .n_ints = (size_t)(a->n_blocks + a->n_q)};
        decode_kernel(c, a, &call);
        return;
    }
    const int32_t *d =
        (const int32_t *)small_upload(c, c->staging, (size_t)a->n_blocks * sizeof(int32_t));
    if (d == NULL ||
        staged(c, OP_KV_ATTEND,
               {arg((int64_t)a->format), arg((int64_t)a->n_heads), arg((int64_t)a->n_kv_heads),
                arg((int64_t)a->head_dim), arg(a->k_pool), arg(a->v_pool), arg(a->q), arg(a->out),
                arg(a->q_pos), arg(a->n_q), arg(a->window), arg(a->scale), arg(d),
                arg((int64_t)a->k_tok), arg((int64_t)a->v_tok), arg((int64_t)a->key_bytes),
                arg((int64_t)a->value_bytes), rotation_sig(a->rotation)}))
        return;
    if (llmem_cuda_kv_attend(c->stream, a, d) != LLMEM_OK) {
        LLMEM_ERROR("cuda backend: attention over head_dim %d (a multiple of 32 up to 256)",
                    a->head_dim);
        fail(c, LLMEM_EINVAL, "attention", NULL);
        return;
    }
    launched(c, "kv attend");
}

/* The last n_q[s] positions (n_q NULL: the last one) of each of n_seqs sequences: one launch of the
 * decode kernel for all their queries where it applies and the tables fit one upload (each query
 * a "sequence" of its own length over its sequence's table), else sequence by sequence. */
static void cuda_kv_attend_last(void *ctx, const struct llmem_backend_paged_attn *a, int n_seqs,
                                const int64_t *const *blocks, const int64_t *lengths,
                                const int64_t *n_q) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (n_seqs == 0 || c->failed)
        return;
    int64_t most = 0, queries = 0, fresh = 1;
    for (int s = 0; s < n_seqs; s++) {
        most = lengths[s] > most ? lengths[s] : most;
        queries += n_q != NULL ? n_q[s] : 1;
        fresh = n_q != NULL && n_q[s] > fresh ? n_q[s] : fresh;
    }
    /* tables padded to a power of two of blocks: the same launch (and graph) for many steps */
    int64_t stride = 8;
    while (stride * a->block_size < most)
        stride *= 2;
    most = stride * a->block_size;
    /* the tables, the queries' lengths, and with n_q the table of each query and the packs of
     * a sequence's queries that a warp takes together (a decode's one query its own) */
    const int pack = n_q != NULL ? attn_pack(a) : 1;
    int64_t packs = 0;
    for (int s = 0; n_q != NULL && s < n_seqs; s++)
        packs += (n_q[s] + pack - 1) / pack;
    struct attn_call call = {.n_queries = (int)queries,
                             .table_stride = (int)stride,
                             .max_len = (int)most,
                             .pack = packs < queries ? pack : 1,
                             .n_packs = packs < queries ? (int)packs : 0,
                             .fresh = (int)fresh,
                             .lengths_at = (size_t)n_seqs * (size_t)stride,
                             .ids_at = NO_IDS,
                             .packs_at = NO_IDS,
                             .n_ints = 0};
    call.n_ints = call.lengths_at + (size_t)queries;
    if (n_q != NULL)
        call.ids_at = call.n_ints, call.n_ints += (size_t)queries;
    if (call.pack > 1)
        call.packs_at = call.n_ints, call.n_ints += (size_t)packs;
    if (decode_kernel_fits(a) && call.n_ints <= SMALL_MAX / sizeof(int32_t)) {
        size_t at = 0, pk = 0;
        for (int s = 0; s < n_seqs; s++) {
            const int64_t nb = (lengths[s] + a->block_size - 1) / a->block_size;
            int32_t *row = c->staging + (size_t)s * (size_t)stride;
            for (int64_t b = 0; b < stride; b++)
                row[b] = b < nb ? (int32_t)blocks[s][b] : 0;
            const int64_t m = n_q != NULL ? n_q[s] : 1;
            for (int64_t i = 0; i < m; i++, at++) {
                c->staging[call.lengths_at + at] = (int32_t)(lengths[s] - m + i + 1);
                if (call.ids_at != NO_IDS)
                    c->staging[call.ids_at + at] = s;
                if (call.packs_at != NO_IDS && i % call.pack == 0)
                    c->staging[call.packs_at + pk++] = (int32_t)at;
            }
        }
        decode_kernel(c, a, &call);
        return;
    }
    const size_t row = (size_t)a->n_heads * (size_t)a->head_dim;
    size_t at = 0;
    for (int s = 0; s < n_seqs; s++) {
        struct llmem_backend_paged_attn one = *a;
        one.blocks = blocks[s];
        one.n_blocks = (lengths[s] + a->block_size - 1) / a->block_size;
        one.n_q = n_q != NULL ? n_q[s] : 1;
        one.q_pos = lengths[s] - one.n_q;
        one.q = a->q + at * row;
        one.out = a->out + at * row;
        cuda_kv_attend(ctx, &one);
        at += (size_t)one.n_q;
    }
}

static int cuda_threads(void *ctx) {
    (void)ctx;
    return 1;
}

static const struct llmem_mem_raw_ops *cuda_memory(void *ctx) {
    return llmem_cuda_mem_ops(((struct cuda_ctx *)ctx)->device);
}

/* Hands the oldest outstanding top_k's results over (its kernel done). */
static void top_deliver(struct cuda_ctx *c) {
    const struct top_out o = c->top_out[0];
    if (!c->failed) {
        const int32_t *h =
            (const int32_t *)((uint8_t *)c->top_host + (size_t)o.slot * c->top_bytes);
        memcpy(o.ids, h, o.count * sizeof(int32_t));
        memcpy(o.vals, h + o.count, o.count * sizeof(float));
    }
    c->top_out[0] = c->top_out[1];
    c->top_n--;
}

static int cuda_sync(void *ctx) {
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

static int cuda_top_k_wait(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (c->top_n == 0 || c->failed)
        return c->failed;
    if (check(c, cudaEventSynchronize(c->top_done[c->top_out[0].slot]), "synchronize") == LLMEM_OK)
        top_deliver(c);
    return c->failed;
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

static int cuda_top_k(void *ctx, const float *x, int64_t n, int64_t cols, int k, int32_t *ids,
                      float *vals) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    rope_flush(c);
    LLMEM_ASSERT(x != NULL && ids != NULL && vals != NULL && n >= 0 && k >= 1 &&
                 k <= LLMEM_TOP_K_MAX && k <= cols && c->mode == PASS_NOW);
    if (n == 0 || c->failed)
        return c->failed;
    LLMEM_ASSERT(c->top_n < 2); /* two outstanding at most */
    const size_t count = (size_t)n * (size_t)k;
    if (count * (sizeof(int32_t) + sizeof(float)) > c->top_bytes) {
        /* doubled at least (freeing pinned memory waits for the device: not at every step of a
         * growing batch) */
        size_t bytes = c->top_bytes * 2 > 65536 ? c->top_bytes * 2 : 65536;
        while (bytes < count * (sizeof(int32_t) + sizeof(float)))
            bytes *= 2;
        cuda_sync(ctx); /* pending results are handed over before their buffers go */
        if (c->top_host != NULL)
            cudaFreeHost(c->top_host);
        c->top_host = NULL, c->top = NULL, c->top_bytes = 0;
        if (check(c, cudaHostAlloc(&c->top_host, 2 * bytes, cudaHostAllocMapped),
                  "cudaHostAlloc") != LLMEM_OK ||
            check(c, cudaHostGetDevicePointer(&c->top, c->top_host, 0),
                  "cudaHostGetDevicePointer") != LLMEM_OK) {
            if (c->top_host != NULL)
                cudaFreeHost(c->top_host);
            c->top_host = NULL, c->top = NULL;
            return c->failed;
        }
        c->top_bytes = bytes;
    }
    /* the kernels write the results to pinned host memory (mapped): sync or top_k_wait hands
     * them over without a copy queued after them */
    const int slot = c->top_next;
    c->top_next ^= 1;
    int32_t *d_ids = (int32_t *)((uint8_t *)c->top + (size_t)slot * c->top_bytes);
    float *d_vals = (float *)(d_ids + count);
    c->idle = 0;
    c->feed_rows = k == 1 && n <= FEED_ROWS ? n : 0;
    if (k == 1)
        pdl_launch(c->stream, argmax_kernel, dim3((unsigned)n), dim3(TOP_THREADS), 0, x, cols,
                   d_ids, d_vals, c->feed_rows > 0 ? c->feed : (int32_t *)NULL);
    else
        pdl_launch(c->stream, top_k_kernel, dim3((unsigned)n), dim3(TOP_THREADS), 0, x, cols, k,
                   d_ids, d_vals);
    launched(c, "top_k");
    c->counters.top_k_rows += n;
    c->top_out[c->top_n++] = top_out{ids, vals, count, slot};
    check(c, cudaEventRecord(c->top_done[slot], c->stream), "event");
    return c->failed;
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
        cudaEventDestroy(cuda_profile_start);
        cuda_profile_start = nullptr, cuda_profile_pending = 0;
    }
    if (c->profile_end != NULL)
        cudaEventDestroy(c->profile_end);
    for (int i = 0; i < GRAPHS; i++)
        graph_drop(&c->graphs[i]);
    for (int i = 0; i < 2 * REPLAY_TIMES; i++)
        if (c->replay[i] != NULL)
            cudaEventDestroy(c->replay[i]);
    dev_free(c, c->scratch);
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
        cublasDestroy(c->blas);
    for (int i = 0; c->lt_plans != NULL && i < LT_PLANS; i++)
        lt_plan_free(&c->lt_plans[i]);
    free(c->lt_plans);
    if (c->lt != NULL)
        cublasLtDestroy(c->lt);
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
    o.graph_begin = cuda_graph_begin;
    o.graph_end = cuda_graph_end;
    o.graph_ready = cuda_graph_ready;
    o.counters = cuda_counters;
    return o;
}

static const struct llmem_backend_ops cuda_ops = make_ops();

extern "C" int llmem_cuda_backend_create(int device, enum llmem_backend_precision precision,
                                         struct llmem_mem *mem, struct llmem_backend **out) {
    *out = NULL;
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
              cudaMalloc(&c->small, c->small_bytes * SMALL_SLOTS + ATTN_COUNTERS_BYTES +
                                        FEED_ROWS * sizeof(int32_t)),
              "cudaMalloc") != LLMEM_OK ||
        check(
            c,
            cudaMemset((uint8_t *)c->small + c->small_bytes * SMALL_SLOTS, 0, ATTN_COUNTERS_BYTES),
            "cudaMemset") != LLMEM_OK ||
        check(c, cudaHostAlloc(&c->small_host, c->small_bytes * SMALL_SLOTS, cudaHostAllocDefault),
              "cudaHostAlloc") != LLMEM_OK ||
        check_blas(c, cublasCreate(&c->blas), "cublasCreate") != LLMEM_OK ||
        check_blas(c, cublasLtCreate(&c->lt), "cublasLtCreate") != LLMEM_OK ||
        check_blas(c, cublasSetStream(c->blas, c->stream), "cublasSetStream") != LLMEM_OK)
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
        c->feed =
            (int32_t *)((uint8_t *)c->small + c->small_bytes * SMALL_SLOTS + ATTN_COUNTERS_BYTES);
    if (status == LLMEM_OK && profile && cuda_profile_start == nullptr) {
        if (check(c, cudaEventCreate(&c->profile_end), "event") != LLMEM_OK ||
            check(c, cudaEventCreate(&cuda_profile_start), "event") != LLMEM_OK) {
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
