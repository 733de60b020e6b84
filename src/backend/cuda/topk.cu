/*
 * backend/cuda/topk.cu — the top k of logits rows on the device (sampling): for k = 1 the largest
 * entry of each row (whose ids are also left on the device for the next pass's embedding_top),
 * else the k largest by radix selection; the kernels write the results to mapped pinned memory,
 * and sync or top_k_wait hands them over.
 */
#include "backend/cuda/ops_int.h"

namespace llmem_cuda {

/* ---- the top k of rows (sampling on the device) --------------------------------------------- */

enum { TOP_THREADS = 1024, TOP_TIES = 1024 };

/* A float as an unsigned key in the same order (−0 as +0, which compare equal). */
__device__ __forceinline__ uint32_t order_key(float x) {
    uint32_t u = x == 0.0f ? 0u : __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

/* The largest entry of each row and its column (the lowest of equal ones): a block per row. */
static __global__ void __launch_bounds__(TOP_THREADS)
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
static __global__ void __launch_bounds__(TOP_THREADS)
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

/* Hands the oldest outstanding top_k's results over (its kernel done). */
void top_deliver(struct cuda_ctx *c) {
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

int cuda_top_k_wait(void *ctx) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    if (c->top_n == 0 || c->failed)
        return c->failed;
    if (check(c, cudaEventSynchronize(c->top_done[c->top_out[0].slot]), "synchronize") == LLMEM_OK)
        top_deliver(c);
    return c->failed;
}

int cuda_top_k(void *ctx, const float *x, int64_t n, int64_t cols, int k, int32_t *ids,
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

} // namespace llmem_cuda
