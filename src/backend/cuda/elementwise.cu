/*
 * backend/cuda/elementwise.cu — the CUDA backend's rmsnorm (with the residual add before it),
 * RoPE (of q and k in one launch, or queued for the KV write after it), SwiGLU, add and the
 * embedding (of uploaded ids, or of the ids the last greedy top k left on the device).
 *
 * Elementwise operations follow the CPU backend's arithmetic, operation for operation (no fused
 * multiply-adds where the CPU rounds twice; sums of squares in double; cos and sin of the f32
 * angle in double), so they agree with it to the last bit or two.
 */
#include "backend/cuda/ops_int.h"

namespace llmem_cuda {

/* ---- elementwise kernels ---------------------------------------------------------------------
 */

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
static __global__ void rmsnorm_kernel(float *x, const float *res, const float *weight, int64_t dim,
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
static __global__ void rope_kernel(float *x, int n_heads, float *x2, int n_heads2, int head_dim,
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

/* With out16, out's 16-bit copy too. */
static __global__ void swiglu_kernel(const float *gate, const float *up, int64_t n, float *out,
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

static __global__ void add_kernel(float *y, const float *x, int64_t n) {
    pdl_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], x[i]);
}

/* A block per token. The ids (uploaded before the pass) and a thread's first EMBED_HELD elements
 * of the row (weights) are read before the wait: no kernel writes them (launch.h). */
#define EMBED_HELD 8
/* FED: the ids were written by the kernel before (top_k's feed), read after the wait for it. */
template <bool FED>
static __global__ void embedding_kernel(const void *table, enum llmem_dtype dt, int64_t dim,
                                        const int32_t *ids, float *out) {
    const int64_t t = blockIdx.x;
    if constexpr (FED)
        pdl_begin();
    const int32_t id = ids[t]; /* negative: another rank's token, a row of zeros */
    const int64_t base = (int64_t)id * dim;
    float v[EMBED_HELD];
#pragma unroll
    for (int k = 0; k < EMBED_HELD; k++) {
        const int64_t i = threadIdx.x + (int64_t)k * blockDim.x;
        v[k] = i < dim && id >= 0 ? weight_at(table, dt, base + i) : 0.0f;
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
        out[t * dim + i] = id >= 0 ? weight_at(table, dt, base + i) : 0.0f;
}

/* ---- the operations -------------------------------------------------------------------------- */

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

void cuda_rmsnorm(void *ctx, const float *x, const float *weight, int64_t n, int64_t dim, float eps,
                  float *y) {
    rmsnorm((struct cuda_ctx *)ctx, (float *)x, NULL, weight, n, dim, eps, y); /* x unwritten */
}

void cuda_add_rmsnorm(void *ctx, float *x, const float *res, const float *weight, int64_t n,
                      int64_t dim, float eps, float *y) {
    LLMEM_ASSERT(res != NULL);
    rmsnorm((struct cuda_ctx *)ctx, x, res, weight, n, dim, eps, y);
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
void rope_launch(struct cuda_ctx *c, float *x, int n_heads, float *x2, int n_heads2, int64_t n,
                 int head_dim, const uint8_t *d) {
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

void cuda_rope(void *ctx, float *x, int64_t n, int n_heads, int head_dim, const int64_t *pos,
               const float *inv_freq) {
    rope((struct cuda_ctx *)ctx, x, n_heads, NULL, 0, n, head_dim, pos, inv_freq);
}

void cuda_rope_qk(void *ctx, float *q, float *k, int64_t n, int n_heads, int n_kv_heads,
                  int head_dim, const int64_t *pos, const float *inv_freq) {
    rope((struct cuda_ctx *)ctx, q, n_heads, k, n_kv_heads, n, head_dim, pos, inv_freq);
}

/* swiglu, and for rows of `cols` (0: unknown) its 16-bit copy for the GEMM after it. */
void swiglu(struct cuda_ctx *c, const float *gate, const float *up, int64_t n, int64_t cols,
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

void swiglu_launch(struct cuda_ctx *c, const float *gate, const float *up, int64_t n, float *out) {
    pdl_launch(c->stream, swiglu_kernel, dim3(grid_for(n, 256)), dim3(256), 0, gate, up, n, out,
               (void *)NULL, LLMEM_DTYPE_F32);
    launched(c, "swiglu");
}

void cuda_swiglu(void *ctx, const float *gate, const float *up, int64_t n, float *out) {
    swiglu((struct cuda_ctx *)ctx, gate, up, n, 0, out);
}

void cuda_add(void *ctx, float *y, const float *x, int64_t n) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    LLMEM_ASSERT(y != NULL && x != NULL && n >= 0);
    if (n == 0 || c->failed || staged(c, OP_ADD, {arg(y), arg(x), arg(n)}))
        return;
    pdl_launch(c->stream, add_kernel, dim3(grid_for(n, 256)), dim3(256), 0, y, x, n);
    launched(c, "add");
}

void cuda_embedding(void *ctx, const struct llmem_weight *table, const int32_t *ids, int64_t n,
                    float *out) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    LLMEM_ASSERT(table != NULL && ids != NULL && out != NULL && n >= 0);
    if (n == 0 || c->failed)
        return;
    const int64_t per = (int64_t)(c->small_bytes / sizeof(int32_t));
    for (int64_t t = 0; t < n; t += per) {
        int64_t m = n - t < per ? n - t : per;
        for (int64_t i = 0; i < m; i++)
            LLMEM_ASSERT(ids[t + i] < table->rows);
        const int32_t *d = (const int32_t *)small_upload(c, ids + t, (size_t)m * sizeof(int32_t));
        if (d == NULL)
            return;
        if (staged(c, OP_EMBEDDING, {arg(table->data), arg(table->cols), arg(d), arg(m), arg(out)}))
            continue;
        if (table->quant != 0) {
            qembedding(c, table, d, 0, m, out + t * table->cols);
            continue;
        }
        pdl_launch(c->stream, embedding_kernel<false>, dim3((unsigned)m), dim3(256), 0, table->data,
                   table->dtype, table->cols, d, out + t * table->cols);
    }
    launched(c, "embedding");
}

void cuda_embedding_top(void *ctx, const struct llmem_weight *table, int64_t n, float *out) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    LLMEM_ASSERT(table != NULL && out != NULL && n >= 0 && n <= c->feed_rows);
    if (n == 0 || c->failed)
        return;
    if (staged(c, OP_EMBEDDING_TOP, {arg(table->data), arg(table->cols), arg(n), arg(out)}))
        return;
    if (table->quant != 0) {
        qembedding(c, table, (const int32_t *)c->feed, 1, n, out);
        return;
    }
    pdl_launch(c->stream, embedding_kernel<true>, dim3((unsigned)n), dim3(256), 0, table->data,
               table->dtype, table->cols, (const int32_t *)c->feed, out);
    launched(c, "embedding");
}

} // namespace llmem_cuda
