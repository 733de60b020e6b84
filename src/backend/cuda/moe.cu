/*
 * backend/cuda/moe.cu — a mixture-of-experts MLP on the device (ops.h `moe`), with the experts of
 * each stack one after the other (model/device.c):
 *   - route: a warp per token picks its k experts from the router's logits (softmax in f32, the
 *     k largest, renormalized when asked) and their weights, on the device; in the same launch,
 *     when the experts multiply integers, x rounded to 8 bits for them;
 *   - sort: one block groups the (token, slot) pairs by expert, in token order within an expert;
 *   - a few pairs (a decode step, and every pass recorded as a graph): the matrix-vector kernels
 *     take each pair's expert from the device (gemv_experts; gate and up in one launch, silu(gate)
 *     · up formed as the down projection reads it), so that a step reads only the chosen experts'
 *     rows and never waits for the host;
 *   - many pairs (prefill): the expert offsets come to the host once a layer and each expert with
 *     rows runs as a GEMM over its gathered rows, as the dense layers do;
 *   - combine: each token's outputs weighted and summed in increasing expert order (the CPU's).
 */
#include "backend/cuda/ops_int.h"

#include "plan/moe_work.h"

namespace llmem_cuda {

/* Pairs up to which a pass outside a graph takes the matrix-vector kernels (more: the GEMMs,
 * after the offsets reach the host); pairs up to which those kernels take them unsorted. */
#define MOE_GEMV_PAIRS   256
#define MOE_UNSORTED_MAX 32

/* v's place in the order route ranks logits in, as an unsigned integer above 0: NaN as −∞ (the
 * CPU's top_k never picks a NaN over a number), −0 as +0, so that equal keys are equal values. */
__device__ __forceinline__ uint32_t order_key(float v) {
    const uint32_t b = __float_as_uint(isnan(v) ? -INFINITY : v + 0.0f);
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}

/* Rows of x the routing launch rounds to 8 bits for the experts' integer kernels after it
 * (quantize_x_unit's rows; blocks of route_kernel past the tokens'), so that x needs no launch
 * of its own between the routing and the experts. */
struct route_x {
    const float *x;
    int64_t cols;
    uint8_t *xq; /* NULL: none */
};

/* A warp per token: ids and probs of its k experts (largest logit first, the lower index first
 * among equals), p = softmax(logits)[e], renormalized over the k when norm; and identity slots
 * when `slot` is not NULL (pairs left unsorted: the kernels after take them as routed). Blocks
 * past the tokens' ((T + 7) / 8 of them) round the T rows of rx.x to 8 bits, a warp a unit. Lane l
 * holds logits l, l + 32, … (PER of them, E ≤ 32·PER) in registers: each of the k rounds is a pass
 * over them and two of the warp's integer reductions (the largest key, then the lowest expert
 * holding it), with no memory between (the logits read again and five rounds of shuffles a
 * pick took a decode's routing 9 µs on an H100, a third of its layer's matrix products). */
template <int PER>
static __global__ void route_kernel(const float *logits, int64_t T, int64_t E, int k, int norm,
                                    int32_t *ids, float *probs, int32_t *slot, struct route_x rx) {
    pdl_begin();
    const int lane = threadIdx.x & 31;
    const int64_t routing = (T + 7) / 8;
    if (blockIdx.x >= routing) { /* x's units: (cols / 32 + 7) / 8 blocks a row */
        const int64_t b = blockIdx.x - routing, per = (rx.cols / 32 + 7) / 8;
        const int64_t u = b % per * 8 + threadIdx.x / 32;
        if (u < rx.cols / 32)
            quantize_x_unit(rx.x, NULL, rx.cols, b / per, u, lane, rx.xq);
        return;
    }
    const int64_t t = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    if (t >= T)
        return;
    float l[PER];
    float mx = -INFINITY, sum = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        l[i] = lane + 32 * i < E ? logits[t * E + lane + 32 * i] : -INFINITY;
        mx = fmaxf(mx, l[i]);
    }
    for (int o = 16; o > 0; o /= 2)
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
#pragma unroll
    for (int i = 0; i < PER; i++)
        if (lane + 32 * i < E)
            sum += expf(l[i] - mx);
    for (int o = 16; o > 0; o /= 2)
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    uint32_t key[PER]; /* the logits' order as unsigned integers, 0 for none */
#pragma unroll
    for (int i = 0; i < PER; i++)
        key[i] = lane + 32 * i < E ? order_key(l[i]) : 0;
    uint32_t taken = 0; /* bit i: expert lane + 32·i */
    float total = 0.0f;
    for (int j = 0; j < k; j++) {
        uint32_t best = 0; /* the lane's largest key not taken, its first among equals */
        float raw = 0.0f;
        int bi = 0;
#pragma unroll
        for (int i = 0; i < PER; i++)
            if (!(taken >> i & 1) && key[i] > best)
                best = key[i], raw = l[i], bi = i;
        const uint32_t top = __reduce_max_sync(0xffffffffu, best);
        const int be = (int)__reduce_min_sync(
            0xffffffffu, best == top && best != 0 ? (uint32_t)(lane + 32 * bi) : 0xffffffffu);
        const float braw = __shfl_sync(0xffffffffu, raw, be % 32);
        if (be % 32 == lane)
            taken |= 1u << (be / 32);
        const float p = expf(braw - mx) / sum;
        total += p;
        if (lane == 0)
            ids[t * k + j] = be, probs[t * k + j] = p;
    }
    __syncwarp(); /* lane 0's probs, to the lanes that renormalize them */
    for (int j = lane; j < k; j += 32) {
        if (norm)
            probs[t * k + j] /= total;
        if (slot != NULL)
            slot[t * k + j] = (int32_t)(t * k + j);
    }
}

/* One block: offsets[e] where expert e's pairs start, the pairs in that order (each expert's in
 * pair order: a warp places 32 at a time, ranked among equal experts by lane) and each pair's
 * place. */
static __global__ void sort_kernel(const int32_t *ids, int64_t pairs, int64_t E, int32_t *offsets,
                                   int32_t *order, int32_t *slot) {
    pdl_begin();
    __shared__ int32_t next[LLMEM_CUDA_MOE_MAX_EXPERTS + 1];
    const int lane = threadIdx.x & 31;
    for (int64_t e = threadIdx.x; e <= E; e += blockDim.x)
        next[e] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < pairs; i += blockDim.x)
        atomicAdd(&next[ids[i] + 1], 1);
    __syncthreads();
    if (threadIdx.x < 32) { /* the counts' running sums, 32 at a time */
        int32_t carry = 0;
        for (int64_t e0 = 0; e0 <= E; e0 += 32) {
            int32_t v = e0 + lane <= E ? next[e0 + lane] : 0;
            for (int o = 1; o < 32; o *= 2) {
                const int32_t u = __shfl_up_sync(0xffffffffu, v, o);
                v += lane >= o ? u : 0;
            }
            if (e0 + lane <= E)
                next[e0 + lane] = v + carry;
            carry += __shfl_sync(0xffffffffu, v, 31);
        }
    }
    __syncthreads();
    for (int64_t e = threadIdx.x; e <= E; e += blockDim.x)
        offsets[e] = next[e];
    if (threadIdx.x >= 32)
        return;
    for (int64_t i0 = 0; i0 < pairs; i0 += 32) {
        const int64_t i = i0 + lane;
        const bool live = i < pairs;
        const int32_t e = live ? ids[i] : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        const int rank = __popc(peers & ((1u << lane) - 1));
        if (live) {
            const int32_t s = next[e] + rank;
            order[s] = (int32_t)i, slot[i] = s;
        }
        __syncwarp();
        if (live && rank == 0)
            next[e] += __popc(peers);
        __syncwarp();
    }
}

/* out[r] = x[order[r] / k], hidden floats a row */
static __global__ void gather_kernel(const float *x, const int32_t *order, int k, int64_t pairs,
                                     int64_t hidden, float *out) {
    pdl_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < pairs * hidden;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = x[(order[i / hidden] / k) * hidden + i % hidden];
}

/* y = Σ p_j · out[slot_j] over a token's k pairs in increasing expert order: block (x, y) takes
 * 256 columns of token y (a block a token kept a decode's combining on one multiprocessor). */
static __global__ void combine_kernel(const int32_t *ids, const float *probs, const int32_t *slot,
                                      const float *out, int k, int64_t hidden, float *y) {
    pdl_begin();
    __shared__ int32_t e[LLMEM_MOE_MAX_K], s[LLMEM_MOE_MAX_K];
    __shared__ float p[LLMEM_MOE_MAX_K];
    const int64_t t = blockIdx.y;
    const int j = threadIdx.x;
    if (j < k)
        e[j] = ids[t * k + j];
    __syncthreads();
    if (j < k) { /* pair j's place among the token's by expert, the earlier first among equals */
        int rank = 0;
        for (int i = 0; i < k; i++)
            rank += e[i] < e[j] || (e[i] == e[j] && i < j);
        s[rank] = slot[t * k + j], p[rank] = probs[t * k + j];
    }
    __syncthreads();
    const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (c < hidden) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++)
            acc = fmaf(p[j], out[s[j] * hidden + c], acc);
        y[t * hidden + c] = acc;
    }
}

/* Whether the n matrices of a stack lie one after the other from the first. */
static int stacked(const struct llmem_weight *w, int64_t n) {
    const int64_t bytes = w[0].rows * llmem_weight_row_bytes(&w[0]);
    for (int64_t e = 1; e < n; e++)
        if ((const uint8_t *)w[e].data != (const uint8_t *)w[0].data + e * bytes)
            return 0;
    return 1;
}

void cuda_moe(void *ctx, const struct llmem_backend_moe *m, const float *logits, const float *x,
              int64_t T, float *y, void *work) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    LLMEM_ASSERT(m != NULL && logits != NULL && x != NULL && y != NULL && work != NULL && T >= 0 &&
                 m->k >= 1 && m->k <= LLMEM_MOE_MAX_K && m->k <= m->n_experts);
    const int64_t E = m->n_experts, k = m->k, hidden = m->down[0].rows, inter = m->gate[0].rows;
    const int64_t pairs = T * k;
    if (T == 0 || c->failed)
        return;
    const int grouped = c->pass == NULL && c->mode == PASS_NOW && pairs > MOE_GEMV_PAIRS;
    if (staged(c, OP_MOE,
               {arg(m->gate[0].data), arg(m->up[0].data), arg(m->down[0].data), arg(E), arg(k),
                arg((int64_t)m->norm_topk), arg(logits), arg(x), arg(T), arg(y), arg(work)}))
        return;
    if (E > LLMEM_CUDA_MOE_MAX_EXPERTS || (!grouped && pairs > 65535)) {
        fail(c, LLMEM_EUNSUPPORTED, "moe", "more experts or pairs than the kernels take");
        return;
    }
    if (!stacked(m->gate, E) || !stacked(m->up, E) || !stacked(m->down, E)) {
        fail(c, LLMEM_EUNSUPPORTED, "moe", "a layer's experts are not one after the other");
        return;
    }
    struct llmem_moe_work w;
    llmem_moe_work_layout(T, hidden, inter, E, k, work, &w);
    const int sort = grouped || pairs > MOE_UNSORTED_MAX;
    auto *route = E <= 128   ? route_kernel<4>
                  : E <= 256 ? route_kernel<8>
                             : route_kernel<LLMEM_CUDA_MOE_MAX_EXPERTS / 32>;
    struct route_x rx = {x, hidden, NULL}; /* (x rounded here for the experts' integer kernels) */
    if (!grouped && qgemv_int(c, &m->gate[0]) &&
        (rx.xq = (uint8_t *)wslice(c, (size_t)(T * xq_row_bytes(hidden)))) == NULL)
        return;
    const int64_t x_blocks = rx.xq != NULL ? T * ((hidden / 32 + 7) / 8) : 0;
    pdl_launch(c->stream, route, dim3((unsigned)((T + 7) / 8 + x_blocks)), dim3(256), 0, logits, T,
               E, (int)k, m->norm_topk, w.ids, w.probs, sort ? NULL : w.slot, rx);
    if (sort)
        pdl_launch(c->stream, sort_kernel, dim3(1), dim3(1024), 0, (const int32_t *)w.ids, pairs, E,
                   w.offsets, w.order, w.slot);
    if (!grouped) { /* (unsorted: the pairs as routed) */
        const int32_t *order = sort ? w.order : NULL;
        gemv_experts(c, &m->gate[0], &m->up[0], w.ids, order, (int)k, x, NULL, rx.xq, T, pairs,
                     w.gate, w.up);
        gemv_experts(c, &m->down[0], NULL, w.ids, order, 0, w.gate, w.up, NULL, pairs, pairs, w.x,
                     NULL);
    } else {
        pdl_launch(c->stream, gather_kernel, dim3(grid_for(pairs * hidden, 256)), dim3(256), 0, x,
                   (const int32_t *)w.order, (int)k, pairs, hidden, w.x);
        int32_t *off = c->staging; /* (E + 1 ≤ SMALL_MAX / 4 ints) */
        if (check(c, cudaMemcpyAsync(off, w.offsets, (size_t)(E + 1) * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, c->stream),
                  "moe offsets") != LLMEM_OK ||
            check(c, cudaStreamSynchronize(c->stream), "moe offsets") != LLMEM_OK)
            return;
        for (int64_t e = 0; e < E; e++) {
            const int64_t at = off[e], n = off[e + 1] - at;
            const struct llmem_weight *gu[2] = {&m->gate[e], &m->up[e]};
            float *out[2] = {w.gate + at * inter, w.up + at * inter};
            if (n > 0)
                cuda_matmul_multi(c, 2, gu, w.x + at * hidden, n, out, NULL);
        }
        swiglu_launch(c, w.gate, w.up, pairs * inter, w.gate);
        for (int64_t e = 0; e < E; e++) {
            const int64_t at = off[e], n = off[e + 1] - at;
            if (n > 0)
                cuda_matmul(c, &m->down[e], w.gate + at * inter, n, w.x + at * hidden, NULL);
        }
    }
    pdl_launch(c->stream, combine_kernel, dim3((unsigned)((hidden + 255) / 256), (unsigned)T),
               dim3(256), 0, (const int32_t *)w.ids,
               (const float *)w.probs, (const int32_t *)w.slot, (const float *)w.x, (int)k, hidden,
               y);
    launched(c, "moe");
}

} // namespace llmem_cuda
