/*
 * backend/cuda/kv.cu — the paged KV cache on the GPU: rows encoded into the stored formats (f32,
 * f16, bf16, q8; the bytes of kv/codec.h, so that blocks move between the GPU, the host and the
 * spill store unchanged) and attention over a sequence's blocks.
 *
 * Attention, a few queries: one block of four warps per (query, head). The warps take the
 * visible tokens in turn, each lane holding head_dim / 32 elements of the query and of its own
 * accumulator; a token's score is a warp reduction, and each warp keeps its own online softmax
 * (m, l, acc), merged through shared memory at the end: m = max m_w, l = Σ l_w·e^(m_w − m), and
 * the same for acc. Many queries (prefill): one warp per (query, head), see attend_rows_kernel.
 */
#include "backend/cuda/kv.h"
#include "backend/cuda/launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

#define GROUP      32 /* elements per q8 group */
#define Q8_BYTES   34 /* 32 codes and an f16 scale */
#define WARPS      4
#define MAX_LANE_D 8 /* head_dim ≤ 256 */
#define ROWS_FROM  8 /* queries from which a call takes attend_rows_kernel */

/* ---- encode ----------------------------------------------------------------------------------
 */

/* Element d (of lane d mod 32) of a row in `format` at o: for q8 the warp's 32 lanes hold the
 * group of 32 together. */
__device__ __forceinline__ void encode_element(enum llmem_kv_format format, uint8_t *o, int d,
                                               float val, int lane) {
    switch (format) {
    case LLMEM_KV_FORMAT_F32: ((float *)o)[d] = val; break;
    case LLMEM_KV_FORMAT_F16: ((__half *)o)[d] = __float2half_rn(val); break;
    case LLMEM_KV_FORMAT_BF16: ((__nv_bfloat16 *)o)[d] = __float2bfloat16_rn(val); break;
    default: { /* q8: the group of 32 is this warp's 32 lanes */
        float a = fabsf(val);
        a = a == a ? a : 0.0f; /* NaN is skipped */
        for (int s = 16; s > 0; s /= 2)
            a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, s));
        float sc = __fdiv_rn(a, 127.0f);
        __half hs = sc > 0.0f ? __float2half_rn(fminf(sc, 65504.0f)) : __float2half_rn(0.0f);
        float s = __half2float(hs), inv = s > 0.0f ? __fdiv_rn(1.0f, s) : 0.0f;
        float q = __fmul_rn(val, inv);
        q = q == q ? q : 0.0f;
        q = fminf(fmaxf(q, -127.0f), 127.0f);
        uint8_t *g = o + (size_t)(d / GROUP) * Q8_BYTES;
        g[d % GROUP] = (uint8_t)(int8_t)__float2int_rn(q);
        if (lane == 0)
            *(__half *)(g + GROUP) = hs; /* 34-byte groups: 2-byte aligned */
    }
    }
}

/* grid (token, head, keys or values), one warp: lane i takes elements i, i + 32, … of the
 * head's row; the token goes to its pool slot. */
__global__ void encode_kernel(enum llmem_kv_format format, const float *k, const float *v,
                              int heads, int head_dim, const int64_t *slots, uint8_t *k_pool,
                              uint8_t *v_pool, size_t tok_bytes, size_t row_bytes) {
    pdl_begin();
    const int64_t t = blockIdx.x;
    const int h = blockIdx.y, lane = threadIdx.x;
    const float *x = (blockIdx.z == 0 ? k : v) + (t * heads + h) * (int64_t)head_dim;
    uint8_t *o =
        (blockIdx.z == 0 ? k_pool : v_pool) + (size_t)slots[t] * tok_bytes + (size_t)h * row_bytes;
    for (int d = lane; d < head_dim; d += 32)
        encode_element(format, o, d, x[d], lane);
}

extern "C" void llmem_cuda_kv_encode(cudaStream_t stream, enum llmem_kv_format format,
                                     const float *k, const float *v, int64_t n, int heads,
                                     int head_dim, const int64_t *slots, uint8_t *k_pool,
                                     uint8_t *v_pool, size_t tok_bytes, size_t row_bytes) {
    for (int64_t t = 0; t < n; t += 65535) {
        dim3 grid((unsigned)(n - t < 65535 ? n - t : 65535), (unsigned)heads, 2);
        const int64_t off = t * heads * (int64_t)head_dim;
        pdl_launch(stream, encode_kernel, dim3(grid), dim3(32), 0, format, k + off, v + off, heads,
                   head_dim, slots + t, k_pool, v_pool, tok_bytes, row_bytes);
    }
}

/* grid (token, group of ROPE_WARPS rows), one warp a row of the token: rows [0, heads) are its K
 * heads (turned, written back, encoded), [heads, 2·heads) its V heads (encoded), then its Q heads
 * (turned in place). The token's angles once a block, in shared memory. Lane i holds elements
 * i + 32j; with head_dim a multiple of 64 a pair (d, d + head_dim / 2) is one lane's. */
#define ROPE_WARPS 8
__global__ void __launch_bounds__(ROPE_WARPS * 32)
    rope_encode_kernel(enum llmem_kv_format format, float *q, int n_heads, float *k, const float *v,
                       int heads, int head_dim, const int64_t *pos, const float *inv_freq,
                       const int64_t *slots, uint8_t *k_pool, uint8_t *v_pool, size_t tok_bytes,
                       size_t row_bytes) {
    __shared__ float cs[16 * MAX_LANE_D], sn[16 * MAX_LANE_D];
    const int64_t t = blockIdx.x;
    const int per = head_dim / 32, half = per / 2; /* elements of a lane, pairs of a lane */
    /* the angles and the slot before the wait: the positions, frequencies and slots were
     * uploaded before the pass, no kernel writes them (launch.h) */
    for (int i = threadIdx.x; i < head_dim / 2; i += blockDim.x)
        rope_angle(pos, inv_freq, t, i, &cs[i], &sn[i]);
    const int64_t slot = slots[t];
    pdl_begin();
    __syncthreads();
    const int lane = threadIdx.x & 31, row = (int)blockIdx.y * ROPE_WARPS + threadIdx.x / 32;
    if (row >= 2 * heads + n_heads)
        return;
    const bool is_v = row >= heads && row < 2 * heads;
    float *x = row < heads ? k + (t * heads + row) * (int64_t)head_dim
               : is_v      ? NULL
                           : q + (t * n_heads + row - 2 * heads) * (int64_t)head_dim;
    const float *src = is_v ? v + (t * heads + row - heads) * (int64_t)head_dim : x;
    float r[MAX_LANE_D];
    for (int j = 0; j < per; j++) /* every load before any store or encoding */
        r[j] = src[lane + 32 * j];
    if (is_v) {
        uint8_t *o = v_pool + (size_t)slot * tok_bytes + (size_t)(row - heads) * row_bytes;
        for (int j = 0; j < per; j++)
            encode_element(format, o, lane + 32 * j, r[j], lane);
        return;
    }
    for (int j = 0; j < half; j++)
        rope_turn(&r[j], &r[j + half], cs[lane + 32 * j], sn[lane + 32 * j]);
    for (int j = 0; j < per; j++)
        x[lane + 32 * j] = r[j];
    if (row < heads) {
        uint8_t *o = k_pool + (size_t)slot * tok_bytes + (size_t)row * row_bytes;
        for (int j = 0; j < per; j++)
            encode_element(format, o, lane + 32 * j, r[j], lane);
    }
}

extern "C" int llmem_cuda_kv_encode_rope_fits(int64_t n, int head_dim) {
    return n >= 1 && n <= 65535 && head_dim % 64 == 0 && head_dim <= 32 * MAX_LANE_D;
}

extern "C" void llmem_cuda_kv_encode_rope(cudaStream_t stream, enum llmem_kv_format format,
                                          float *q, int n_heads, float *k, const float *v,
                                          int64_t n, int heads, int head_dim, const int64_t *pos,
                                          const float *inv_freq, const int64_t *slots,
                                          uint8_t *k_pool, uint8_t *v_pool, size_t tok_bytes,
                                          size_t row_bytes) {
    dim3 grid((unsigned)n, (unsigned)((2 * heads + n_heads + ROPE_WARPS - 1) / ROPE_WARPS));
    pdl_launch(stream, rope_encode_kernel, grid, dim3(ROPE_WARPS * 32), 0, format, q, n_heads, k, v,
               heads, head_dim, pos, inv_freq, slots, k_pool, v_pool, tok_bytes, row_bytes);
}

/* ---- attention -------------------------------------------------------------------------------
 */

__device__ __forceinline__ float element(enum llmem_kv_format format, const uint8_t *row, int d) {
    switch (format) {
    case LLMEM_KV_FORMAT_F32: return ((const float *)row)[d];
    case LLMEM_KV_FORMAT_F16: return __half2float(((const __half *)row)[d]);
    case LLMEM_KV_FORMAT_BF16: return __bfloat162float(((const __nv_bfloat16 *)row)[d]);
    default: {
        const uint8_t *g = row + (size_t)(d / GROUP) * Q8_BYTES;
        return __fmul_rn((float)(int8_t)g[d % GROUP], __half2float(*(const __half *)(g + GROUP)));
    }
    }
}

struct attn_args {
    enum llmem_kv_format format;
    int n_heads, group, head_dim, block_size;
    const uint8_t *k_pool, *v_pool;
    size_t k_tok, v_tok, key_bytes, value_bytes;
    const int32_t *blocks;
    int64_t q_pos, window;
    float scale;
    const float *q;
    float *out;
};

__global__ void __launch_bounds__(WARPS * 32) attend_kernel(struct attn_args a) {
    pdl_begin();
    const int64_t i = blockIdx.x; /* query */
    const int h = blockIdx.y, kvh = h / a.group;
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int per = a.head_dim / 32; /* elements per lane */
    const int64_t hi = a.q_pos + i;
    const int64_t lo = a.window > 0 && hi - a.window + 1 > 0 ? hi - a.window + 1 : 0;
    const float *q = a.q + (i * a.n_heads + h) * (int64_t)a.head_dim;
    float qv[MAX_LANE_D], acc[MAX_LANE_D];
    for (int j = 0; j < per; j++) {
        qv[j] = q[lane + 32 * j];
        acc[j] = 0;
    }
    float m = -INFINITY, l = 0;
    for (int64_t t = lo + warp; t <= hi; t += WARPS) {
        const size_t slot =
            (size_t)a.blocks[t / a.block_size] * (size_t)a.block_size + (size_t)(t % a.block_size);
        const uint8_t *k = a.k_pool + slot * a.k_tok + (size_t)kvh * a.key_bytes;
        const uint8_t *v = a.v_pool + slot * a.v_tok + (size_t)kvh * a.value_bytes;
        float s = 0;
        for (int j = 0; j < per; j++)
            s += qv[j] * element(a.format, k, lane + 32 * j);
        for (int o = 16; o > 0; o /= 2)
            s += __shfl_xor_sync(0xffffffffu, s, o);
        s *= a.scale;
        const float top = fmaxf(m, s), corr = expf(m - top), p = expf(s - top);
        l = l * corr + p;
        for (int j = 0; j < per; j++)
            acc[j] = acc[j] * corr + p * element(a.format, v, lane + 32 * j);
        m = top;
    }
    __shared__ float sm[WARPS], sl[WARPS], sacc[WARPS][32 * MAX_LANE_D];
    if (lane == 0)
        sm[warp] = m, sl[warp] = l;
    for (int j = 0; j < per; j++)
        sacc[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    float top = -INFINITY;
    for (int w = 0; w < WARPS; w++)
        top = fmaxf(top, sm[w]);
    float total = 0, f[WARPS];
    for (int w = 0; w < WARPS; w++) {
        f[w] = sl[w] > 0 ? expf(sm[w] - top) : 0;
        total += sl[w] * f[w];
    }
    float *out = a.out + (i * a.n_heads + h) * (int64_t)a.head_dim;
    for (int d = threadIdx.x; d < a.head_dim; d += WARPS * 32) {
        float s = 0;
        for (int w = 0; w < WARPS; w++)
            s += sacc[w][d] * f[w];
        out[d] = total > 0 ? s / total : 0;
    }
}

/* Prefill chunks: one warp per (query, head), its lanes on 32 keys at a time (each lane a whole
 * key row against the query held in shared memory), the chunk's softmax by warp reductions, then
 * the 32 value rows accumulated with each lane on head_dim / 32 elements. */
__global__ void __launch_bounds__(WARPS * 32) attend_rows_kernel(struct attn_args a, int64_t n_q) {
    pdl_begin();
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int64_t i = blockIdx.x * (int64_t)WARPS + warp; /* query */
    const int h = blockIdx.y, kvh = h / a.group;
    const int per = a.head_dim / 32;
    __shared__ float sq[WARPS][32 * MAX_LANE_D];
    if (i >= n_q)
        return;
    const float *q = a.q + (i * a.n_heads + h) * (int64_t)a.head_dim;
    for (int d = lane; d < a.head_dim; d += 32)
        sq[warp][d] = q[d];
    __syncwarp();
    const int64_t hi = a.q_pos + i;
    const int64_t lo = a.window > 0 && hi - a.window + 1 > 0 ? hi - a.window + 1 : 0;
    float acc[MAX_LANE_D];
    for (int j = 0; j < per; j++)
        acc[j] = 0;
    float m = -INFINITY, l = 0;
    for (int64_t t0 = lo; t0 <= hi; t0 += 32) {
        const int64_t t = t0 + lane;
        float s = -INFINITY;
        if (t <= hi) {
            const size_t slot = (size_t)a.blocks[t / a.block_size] * (size_t)a.block_size +
                                (size_t)(t % a.block_size);
            const uint8_t *k = a.k_pool + slot * a.k_tok + (size_t)kvh * a.key_bytes;
            float dot = 0;
            for (int d = 0; d < a.head_dim; d++)
                dot += sq[warp][d] * element(a.format, k, d);
            s = dot * a.scale;
        }
        float top = s;
        for (int o = 16; o > 0; o /= 2)
            top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
        top = fmaxf(top, m);
        const float corr = expf(m - top), p = t <= hi ? expf(s - top) : 0;
        float sum = p;
        for (int o = 16; o > 0; o /= 2)
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
        l = l * corr + sum;
        for (int j = 0; j < per; j++)
            acc[j] *= corr;
        const int n = hi - t0 + 1 < 32 ? (int)(hi - t0 + 1) : 32;
        for (int u = 0; u < n; u++) {
            const float pu = __shfl_sync(0xffffffffu, p, u);
            const int64_t tu = t0 + u;
            const size_t slot = (size_t)a.blocks[tu / a.block_size] * (size_t)a.block_size +
                                (size_t)(tu % a.block_size);
            const uint8_t *v = a.v_pool + slot * a.v_tok + (size_t)kvh * a.value_bytes;
            for (int j = 0; j < per; j++)
                acc[j] += pu * element(a.format, v, lane + 32 * j);
        }
        m = top;
    }
    float *out = a.out + (i * a.n_heads + h) * (int64_t)a.head_dim;
    for (int j = 0; j < per; j++)
        out[lane + 32 * j] = l > 0 ? acc[j] / l : 0;
}

extern "C" int llmem_cuda_kv_attend(cudaStream_t stream, const struct llmem_backend_paged_attn *p,
                                    const int32_t *blocks) {
    if (p->head_dim % 32 != 0 || p->head_dim > 32 * MAX_LANE_D || p->n_heads % p->n_kv_heads)
        return LLMEM_EINVAL;
    struct attn_args a = {p->format,    p->n_heads,     p->n_heads / p->n_kv_heads,
                          p->head_dim,  p->block_size,  p->k_pool,
                          p->v_pool,    p->k_tok,       p->v_tok,
                          p->key_bytes, p->value_bytes, blocks,
                          p->q_pos,     p->window,      p->scale,
                          p->q,         p->out};
    if (p->n_q >= ROWS_FROM) { /* many queries: a warp each */
        dim3 grid((unsigned)((p->n_q + WARPS - 1) / WARPS), (unsigned)p->n_heads);
        pdl_launch(stream, attend_rows_kernel, dim3(grid), dim3(WARPS * 32), 0, a, p->n_q);
        return LLMEM_OK;
    }
    for (int64_t i = 0; i < p->n_q; i += 65535) {
        dim3 grid((unsigned)(p->n_q - i < 65535 ? p->n_q - i : 65535), (unsigned)p->n_heads);
        a.q = p->q + i * p->n_heads * (int64_t)p->head_dim;
        a.out = p->out + i * p->n_heads * (int64_t)p->head_dim;
        a.q_pos = p->q_pos + i;
        pdl_launch(stream, attend_kernel, dim3(grid), dim3(WARPS * 32), 0, a);
    }
    return LLMEM_OK;
}
