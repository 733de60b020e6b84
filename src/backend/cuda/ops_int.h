/*
 * backend/cuda/ops_int.h — what the files of the CUDA backend's table share (ops.cu: the table
 * and the context; graph.cu, elementwise.cu, gemm.cu, topk.cu, attend.cu: the operations by
 * family): the sizes they are built with, the context, what each file offers the others, and the
 * small helpers of every file (inline, as the compiler inlined them when the table was one file).
 * Everything is in namespace llmem_cuda; only llmem_cuda_backend_create (backend.h) is for C.
 */
#ifndef LLMEM_BACKEND_CUDA_OPS_INT_H
#define LLMEM_BACKEND_CUDA_OPS_INT_H

#include "backend/cuda/backend.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/blas.h"
#include "backend/cuda/kv.h"
#include "backend/cuda/launch.h"
#include "backend/cuda/prefill.h"

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

namespace llmem_cuda {

/* x rows up to which matmul takes the memory-bound kernel (gemv_rows): at f32 precision, where a
 * GEMM first widens the weights, up to GEMV_MAX_ROWS; at fast precision up to GEMV_FAST_ROWS, the
 * tensor cores being faster from 3 rows (on the H200 a decode step of 8 sequences took 3.06 ms on
 * the device through the GEMV, one of 32 sequences 1.25 ms through the GEMMs) */
#define GEMV_MAX_ROWS  8
#define GEMV_FAST_ROWS 2
/* 16-byte weight loads each lane has in flight in the matrix-vector kernel */
#define GEMV_UNROLL 8
/* weight bytes widened to f32 at a time at f32 precision; quantized weights dequantized to f16
 * (fast precision, into their own buffer: x rounded is in scratch) or f32 at a time */
#define WIDEN_SLICE_BYTES ((size_t)64 << 20)
/* x rows up to which quantized weights take the matrix-vector kernels (quant.cu qgemv) at either
 * precision: they read the blocks once, where a GEMM first writes and reads them dequantized */
#define QGEMV_MAX_ROWS 8
/* x rows up to which, at fast precision, the integer types (qgemv_int) take the tensor cores'
 * integer products (quant.cu qmma) instead of the dequantized weights' GEMMs */
#define QMMA_MAX_ROWS 64
/* The fast GEMMs' plans (cublasLt: an algorithm of those its heuristic ranks first for a shape,
 * given up to LT_WORKSPACE_MAX of workspace: gemm.cu lt_pick), kept in a table of LT_PLANS by
 * shape. */
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

/* after the small slots: the counters of the kernels whose splits the last block to finish
 * merges (the attention's llmem_cuda_attn.counters, for 4,096 sequences × KV heads; qmma's, a
 * block of rows each), zero between calls (the stream's calls run one after another; each sets
 * back what it counted); then the ids a greedy top_k leaves for the next pass's embedding_top,
 * for up to FEED_ROWS rows */
#define SPLIT_COUNTERS      4096
#define FEED_ROWS           4096
/* the most experts a mixture's layer may have on this backend (moe.cu: a lane's 32 in routing) */
#define LLMEM_CUDA_MOE_MAX_EXPERTS 1024

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
    void *wslice; /* at fast precision, a slice of quantized weights dequantized to f16 */
    size_t wslice_bytes;
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
    struct graph *held; /* between graph_end and graph_launch: recorded or staged, to launch */
    enum pass_mode held_mode;
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
    int profiling; /* LLMEM_CUDA_PROFILE: this context owns llmem_cuda_profile_start */
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

/* ---- what each file offers the others -------------------------------------------------------- */

/* ops.cu */
void launched(struct cuda_ctx *c, const char *what);
void *dev_alloc(struct cuda_ctx *c, size_t bytes);
void dev_free(struct cuda_ctx *c, void *p);
void *scratch(struct cuda_ctx *c, size_t bytes);
void *wslice(struct cuda_ctx *c, size_t bytes);
int cuda_sync(void *ctx);

/* The SPLIT_COUNTERS counters (in small, after the slots). */
static inline unsigned *split_counters(const struct cuda_ctx *c) {
    return (unsigned *)((uint8_t *)c->small + c->small_bytes * SMALL_SLOTS);
}

/* graph.cu */
int staged(struct cuda_ctx *c, int op, std::initializer_list<uint64_t> args);
const void *small_upload(struct cuda_ctx *c, const void *host, size_t bytes);
void graph_drop(struct graph *g);
/* Every recording of c destroyed (before the communicator whose calls they hold). */
void graph_drop_all(struct cuda_ctx *c);
void replay_time(struct cuda_ctx *c, int n);
int cuda_graph_want(void *ctx, uint64_t key);
int cuda_graph_begin(void *ctx, uint64_t key, int most);
int cuda_graph_end(void *ctx);
int cuda_graph_launch(void *ctx, int go);

/* elementwise.cu */
void rope_launch(struct cuda_ctx *c, float *x, int n_heads, float *x2, int n_heads2, int64_t n,
                 int head_dim, const uint8_t *d);
void swiglu(struct cuda_ctx *c, const float *gate, const float *up, int64_t n, int64_t cols,
            float *out);
/* swiglu's kernel alone: no shadow, nothing staged (for an operation that staged itself) */
void swiglu_launch(struct cuda_ctx *c, const float *gate, const float *up, int64_t n, float *out);
void cuda_rmsnorm(void *ctx, const float *x, const float *weight, int64_t n, int64_t dim, float eps,
                  float *y);
void cuda_add_rmsnorm(void *ctx, float *x, const float *res, const float *weight, int64_t n,
                      int64_t dim, float eps, float *y);
void cuda_rope(void *ctx, float *x, int64_t n, int n_heads, int head_dim, const int64_t *pos,
               const float *inv_freq);
void cuda_rope_qk(void *ctx, float *q, float *k, int64_t n, int n_heads, int n_kv_heads,
                  int head_dim, const int64_t *pos, const float *inv_freq);
void cuda_swiglu(void *ctx, const float *gate, const float *up, int64_t n, float *out);
void cuda_add(void *ctx, float *y, const float *x, int64_t n);
void cuda_embedding(void *ctx, const struct llmem_weight *table, const int32_t *ids, int64_t n,
                    float *out);
void cuda_embedding_top(void *ctx, const struct llmem_weight *table, int64_t n, float *out);

/* gemm.cu */
void lt_plan_free(struct lt_plan *p);
void cuda_matmul(void *ctx, const struct llmem_weight *w, const float *x, int64_t n, float *y,
                 const float *bias);
void cuda_matmul_multi(void *ctx, int count, const struct llmem_weight *const *w, const float *x,
                       int64_t n, float *const *y, const float *const *bias);
void cuda_matmul_swiglu(void *ctx, const struct llmem_weight *gate, const struct llmem_weight *up,
                        const float *x, int64_t n, float *g, float *u, float *out);

/* A mixture's experts for a few rows (moe.cu): y[r] = x[order[r] / k] · Wᵀ (k 0: x[r]) with W
 * expert ids[order[r]] of the stack whose expert 0 is w (the experts one after the other, as
 * model/device.c uploads them; an MLX type's scales and biases too), for r < pairs, and the same
 * of w1 into y1 in the same launch when w1 is not NULL (gate and up); x has x_rows rows; order
 * NULL: the pairs as routed (order[r] = r, one load fewer before a block's weights); with up
 * not NULL, x is silu(x) · up (a mixture's down projection after its gate and up: x written over
 * with it, or at fast precision rounded to 8 bits straight from the two); xq not NULL: x already
 * rounded to 8 bits where qgemv_int(c, w) (quantize_x_unit's rows; moe.cu's routing launch), NULL
 * otherwise. The matrix-vector kernels' products (gemm.cu for float weights, quant.cu's for
 * quantized ones). */
void gemv_experts(struct cuda_ctx *c, const struct llmem_weight *w, const struct llmem_weight *w1,
                  const int32_t *ids, const int32_t *order, int k, const float *x, const float *up,
                  const uint8_t *xq, int64_t x_rows, int64_t pairs, float *y, float *y1);
void qgemv_experts(struct cuda_ctx *c, const struct llmem_weight *w, const struct llmem_weight *w1,
                   const int32_t *ids, const int32_t *order, int k, const float *x, const float *up,
                   const uint8_t *xq, int64_t x_rows, int64_t pairs, float *y, float *y1);

/* quant.cu: quantized weights (w->quant != 0): y = x · Wᵀ (+ bias) for n rows of x by the
 * matrix-vector kernel; rows r0 … r0 + n of w dequantized into out (dt: F16 or F32); the rows of a
 * table for ids (fed: top_k's feed on the device) */
void qgemv(struct cuda_ctx *c, const struct llmem_weight *w, const float *x, int64_t n, float *y,
           const float *bias);
/* Whether qgemv multiplies integers for w at c's precision (x quantized to 8 bits); such weights
 * of one x and column count (count ≤ 3) take one launch: y[i] = x · w[i]ᵀ (+ bias[i]), or with
 * swiglu (count 2: gate and up of one shape) y[0] = silu(x · gateᵀ) · (x · upᵀ). */
int qgemv_int(const struct cuda_ctx *c, const struct llmem_weight *w);
void qgemv_set(struct cuda_ctx *c, int count, const struct llmem_weight *const *w, const float *x,
               int64_t n, float *const *y, const float *const *bias, int swiglu);
/* y[i] = x · w[i]ᵀ (+ bias[i]) for count ≤ 4 matrices of the weights qgemv_int takes, of one
 * width, and n ≤ QMMA_MAX_ROWS rows of x, on the tensor cores (x quantized to 8 bits as qgemv's,
 * once for all) */
void qmma_set(struct cuda_ctx *c, int count, const struct llmem_weight *const *w, const float *x,
              int64_t n, float *const *y, const float *const *bias);
void qdequant(struct cuda_ctx *c, const struct llmem_weight *w, int64_t r0, int64_t n,
              enum llmem_dtype dt, void *out);
void qembedding(struct cuda_ctx *c, const struct llmem_weight *table, const int32_t *ids, int fed,
                int64_t n, float *out);

/* moe.cu */
void cuda_moe(void *ctx, const struct llmem_backend_moe *m, const float *logits, const float *x,
              int64_t T, float *y, void *work);

/* topk.cu */
void top_deliver(struct cuda_ctx *c);
int cuda_top_k(void *ctx, const float *x, int64_t n, int64_t cols, int k, int32_t *ids,
               float *vals);
int cuda_top_k_wait(void *ctx);

/* attend.cu */
void cuda_kv_encode(void *ctx, enum llmem_kv_format format,
                    const struct llmem_backend_kv_rotation *rotation, const float *k,
                    const float *v, int64_t n, int heads, int head_dim, const int64_t *slots,
                    uint8_t *k_pool, uint8_t *v_pool, size_t key_bytes, size_t value_bytes);
void cuda_kv_attend(void *ctx, const struct llmem_backend_paged_attn *a);
void cuda_kv_attend_last(void *ctx, const struct llmem_backend_paged_attn *a, int n_seqs,
                         const int64_t *const *blocks, const int64_t *lengths, const int64_t *n_q);

/* ---- helpers every file inlines -------------------------------------------------------------- */

static inline int64_t gemv_rows(const struct cuda_ctx *c) {
    return c->precision == LLMEM_PRECISION_FAST ? GEMV_FAST_ROWS : GEMV_MAX_ROWS;
}

/* The backend's first failure: logged once, kept as the status of every later copy and sync. */
static inline void fail(struct cuda_ctx *c, int status, const char *what, const char *why) {
    if (c->failed)
        return;
    if (why != NULL)
        LLMEM_ERROR("cuda backend: %s: %s", what, why);
    c->failed = status;
}

static inline int check(struct cuda_ctx *c, cudaError_t err, const char *what) {
    if (err == cudaSuccess)
        return LLMEM_OK;
    fail(c, LLMEM_EIO, what, cudaGetErrorString(err));
    return LLMEM_EIO;
}

static inline int check_blas(struct cuda_ctx *c, cublasStatus_t st, const char *what) {
    if (st == CUBLAS_STATUS_SUCCESS)
        return LLMEM_OK;
    fail(c, LLMEM_EIO, what, llmem_cuda_blas.status_string(st));
    return LLMEM_EIO;
}

/* Launches a queued rope_qk on its own, so that nothing reads q or k before they are turned: from
 * staged, which every operation calls before it launches (all but the KV write that can take
 * it), and first in those that stage nothing (copy, sync, top_k, graph_begin, graph_end). */
static inline void rope_flush(struct cuda_ctx *c) {
    if (!c->rope_pending)
        return;
    c->rope_pending = 0;
    if (!c->failed)
        rope_launch(c, c->rope_later.q, c->rope_later.n_heads, c->rope_later.k,
                    c->rope_later.n_kv_heads, c->rope_later.n, c->rope_later.head_dim,
                    c->rope_later.d);
}

static inline uint64_t arg(const void *p) {
    return (uint64_t)(uintptr_t)p;
}
static inline uint64_t arg(int64_t v) {
    return (uint64_t)v;
}
static inline uint64_t arg(float v) {
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
    OP_PREFILL,
    OP_MATMUL_MULTI,
    OP_GEMV_SWIGLU,
    OP_EMBEDDING_TOP,
    OP_MOE,
    OP_ALLREDUCE,
};

/* Where an operation producing n rows of cols floats writes their 16-bit copy as well (*dt its
 * type), or NULL: at fast precision, for a GEMM's rows (more than gemv_rows), when the fast
 * GEMMs rounded rows of this width before, into scratch that holds them already while a pass is
 * recorded or staged. */
static inline void *shadow_begin(struct cuda_ctx *c, int64_t n, int64_t cols,
                                 enum llmem_dtype *dt) {
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

static inline void shadow_set(struct cuda_ctx *c, const float *x, int64_t elems,
                              enum llmem_dtype dt, const void *at) {
    c->shadow_x = at != NULL ? x : NULL;
    c->shadow_n = elems, c->shadow_dt = dt, c->shadow_at = at;
}

static inline unsigned grid_for(int64_t n, int threads) {
    int64_t g = (n + threads - 1) / threads;
    return (unsigned)(g < 1 ? 1 : g > 65535 * 8 ? 65535 * 8 : g);
}

/* ---- device helpers of more than one file ---------------------------------------------------- */

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

/* silu(g) · u = g / (1 + e^−g) · u */
__device__ __forceinline__ float silu_mul(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

/* Rows of x rounded to 8 bits for quant.cu's integer matrix-vector kernels: per row, cols int8
 * codes, then cols / 32 scales and cols / 16 sums (floats), rows 16-byte aligned. */
__host__ __device__ constexpr int64_t xq_row_bytes(int64_t cols) {
    return (cols + cols / 32 * 4 + cols / 16 * 4 + 15) / 16 * 16;
}

/* Values 32u … 32u + 31 of row t of x rounded to 8 bits into row t of out (xq_row_bytes) by a
 * warp, lane l value 32u + l (d = max|v| / 127, q = round(v / d), the f32 sums of each 16), v = x,
 * or silu(x) · up where up is not NULL (a mixture's gate and up products, into its down
 * projection's x). */
__device__ __forceinline__ void quantize_x_unit(const float *x, const float *up, int64_t cols,
                                                int64_t t, int64_t u, int lane, uint8_t *out) {
    const int64_t i = t * cols + 32 * u + lane;
    const float v = up != NULL ? silu_mul(x[i], up[i]) : x[i];
    float amax = fabsf(v), sum = v;
    for (int o = 16; o > 0; o /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    for (int o = 8; o > 0; o /= 2) /* sums of each 16 lanes */
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    uint8_t *row = out + t * xq_row_bytes(cols);
    row[32 * u + lane] = (uint8_t)(int8_t)__float2int_rn(v * id);
    if (lane == 0)
        reinterpret_cast<float *>(row + cols)[u] = d;
    if (lane % 16 == 0)
        reinterpret_cast<float *>(row + cols + cols / 32 * 4)[2 * u + lane / 16] = sum;
}

} // namespace llmem_cuda

#endif
