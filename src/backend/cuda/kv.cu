/*
 * backend/cuda/kv.cu — the paged KV cache on the GPU: rows encoded into the stored formats (all
 * six, with q4's and tq's rotations: the bytes of kv/codec.h, so that blocks move between the GPU,
 * the host and the spill store unchanged) and attention over a sequence's blocks where the
 * split-K kernels of attention.cu do not take it (f32 caches, sliding windows).
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

#define GROUP      32 /* elements per group of every format */
#define Q8_BYTES   34 /* 32 codes and an f16 scale */
#define Q4_BYTES   20 /* 16 bytes of nibbles, f16 scale, f16 min */
#define TQK_BYTES  36 /* 32 codes, f16 scale, f16 zero */
#define TQV_BYTES  14 /* 12 bytes of 3-bit codes, f16 scale */
#define WARPS      4
#define MAX_LANE_D 8 /* head_dim ≤ 256 */
#define ROWS_FROM  8 /* queries from which a call takes attend_rows_kernel */
#define FULL       0xffffffffu

/* A pool's rows: the format, its rotation (keys and values 0: none) and the bytes of one head's
 * key and value rows (a token's heads back to back). Passed by value to the kernels. */
struct kv_rows {
    enum llmem_kv_format format;
    struct llmem_backend_kv_rotation rot;
    size_t key_bytes, value_bytes;
};

/* q4 or tq: the encode kernels that hold their code (encode_group) */
static bool quantized(enum llmem_kv_format format) {
    return format == LLMEM_KV_FORMAT_Q4 || format == LLMEM_KV_FORMAT_TQ;
}

static kv_rows make_rows(enum llmem_kv_format format, const struct llmem_backend_kv_rotation *rot,
                         size_t key_bytes, size_t value_bytes) {
    kv_rows r = {};
    r.format = format;
    if (rot != NULL)
        r.rot = *rot;
    r.key_bytes = key_bytes, r.value_bytes = value_bytes;
    return r;
}

/* ---- encode ----------------------------------------------------------------------------------
 * A group of 32 elements is one register of the warp's 32 lanes. Ranges, scales and sums are
 * taken one element after another, as kv/codec.c takes them, so the codes are the host's. */

__device__ __forceinline__ __half f16_scale(float s) { /* kv/codec.c's f16_scale */
    return s > 0.0f ? __float2half_rn(s < 65504.0f ? s : 65504.0f) : __float2half_rn(0.0f);
}

__device__ __forceinline__ int quantize(float v, float lo, float hi) {
    v = v == v ? v : 0.0f;
    v = v > lo ? v : lo;
    v = v < hi ? v : hi;
    return __float2int_rn(v);
}

/* The group's stored min m and scale for codes 0..levels (affine_params); returns the code of
 * this lane's element, and the stored halves through hm, hs. */
__device__ __forceinline__ int affine_code(float val, float levels, __half *hm, __half *hs) {
    float mn = INFINITY, mx = -INFINITY;
    for (int i = 0; i < GROUP; i++) { /* NaN is skipped */
        const float x = __shfl_sync(FULL, val, i);
        mn = x < mn ? x : mn;
        mx = x > mx ? x : mx;
    }
    if (mn > mx) /* every element NaN */
        mn = mx = 0.0f;
    mn = mn > -65504.0f ? mn : -65504.0f;
    *hm = __float2half_rn(mn < 65504.0f ? mn : 65504.0f);
    const float m = __half2float(*hm);
    *hs = f16_scale(__fdiv_rn(__fsub_rn(mx, m), levels));
    const float sc = __half2float(*hs), inv = sc > 0.0f ? __fdiv_rn(1.0f, sc) : 0.0f;
    return quantize(__fmul_rn(__fsub_rn(val, m), inv), 0.0f, levels);
}

/* Σ over the group's lanes of v, in lane order. */
__device__ __forceinline__ float ordered_sum(float v) {
    float s = 0.0f;
    for (int i = 0; i < GROUP; i++)
        s = __fadd_rn(s, __shfl_sync(FULL, v, i));
    return s;
}

/* tq_assign: this lane's nearest centroid for scale sc; the group's squared error through err. */
__device__ __forceinline__ int tq_assign(float val, float sc, float *err) {
    const float v = __fmul_rn(val, sc > 0.0f ? __fdiv_rn(1.0f, sc) : 0.0f);
    constexpr float bounds[7] = LLMEM_KV_TQ_BOUNDS; /* between the levels */
    int k = 0;
#pragma unroll
    for (int b = 0; b < 7; b++)
        k += v > bounds[b];
    const float d = __fsub_rn(val, __fmul_rn(tq_level(k), sc));
    *err = ordered_sum(__fmul_rn(d, d));
    return k;
}

/* tqv_encode: the RMS scale, then rounds of least-squares refinement (kv/codec.c). */
__device__ __forceinline__ int tq_value_code(float val, __half *hs) {
    __half best_h = f16_scale(__fsqrt_rn(__fdiv_rn(ordered_sum(__fmul_rn(val, val)), 32.0f)));
    float best_err;
    int best = tq_assign(val, __half2float(best_h), &best_err), c = best;
    for (int round = 0; round < 4; round++) {
        const float C = tq_level(c);
        const float num = ordered_sum(__fmul_rn(val, C)), den = ordered_sum(__fmul_rn(C, C));
        const __half h = f16_scale(__fdiv_rn(num, den));
        if (__half_as_ushort(h) == __half_as_ushort(best_h))
            break;
        float err;
        c = tq_assign(val, __half2float(h), &err);
        if (!(err < best_err))
            break;
        best_err = err, best_h = h, best = c;
    }
    *hs = best_h;
    return best;
}

/* This lane's element of a group of `format` (keys or values) at g. QT: the format may be q4 or
 * tq (their code kept out of the kernels of the other formats, whose KV write is on every
 * decode step's path). */
template <bool QT>
__device__ __forceinline__ void encode_group(enum llmem_kv_format format, bool value, uint8_t *g,
                                             float val, int lane) {
    switch (format) {
    case LLMEM_KV_FORMAT_F32: ((float *)g)[lane] = val; return;
    case LLMEM_KV_FORMAT_F16: ((__half *)g)[lane] = __float2half_rn(val); return;
    case LLMEM_KV_FORMAT_BF16: ((__nv_bfloat16 *)g)[lane] = __float2bfloat16_rn(val); return;
    case LLMEM_KV_FORMAT_Q8: {
        float a = fabsf(val);
        a = a == a ? a : 0.0f; /* NaN is skipped */
        for (int s = 16; s > 0; s /= 2)
            a = fmaxf(a, __shfl_xor_sync(FULL, a, s));
        const __half hs = f16_scale(__fdiv_rn(a, 127.0f));
        const float sc = __half2float(hs), inv = sc > 0.0f ? __fdiv_rn(1.0f, sc) : 0.0f;
        g[lane] = (uint8_t)(int8_t)quantize(__fmul_rn(val, inv), -127.0f, 127.0f);
        if (lane == 0)
            *(__half *)(g + GROUP) = hs; /* 34-byte groups: 2-byte aligned */
        return;
    }
    case LLMEM_KV_FORMAT_Q4: {
        if constexpr (!QT)
            return;
        __half hm, hs;
        const int c = affine_code(val, 15.0f, &hm, &hs);
        const int hi = __shfl_down_sync(FULL, c, 16); /* byte j: element j low, j + 16 high */
        if (lane < 16)
            g[lane] = (uint8_t)(c | hi << 4);
        if (lane == 0)
            *(__half *)(g + 16) = hs, *(__half *)(g + 18) = hm;
        return;
    }
    default: { /* tq */
        if constexpr (!QT)
            return;
        __half hs, hm;
        if (!value) {
            g[lane] = (uint8_t)affine_code(val, 255.0f, &hm, &hs);
            if (lane == 0)
                *(__half *)(g + GROUP) = hs, *(__half *)(g + GROUP + 2) = hm;
            return;
        }
        /* code i at bits 3i..3i+2: eight lanes' codes make 3 bytes */
        uint32_t w = (uint32_t)tq_value_code(val, &hs) << (3 * (lane & 7));
        for (int s = 1; s < 8; s *= 2)
            w |= __shfl_xor_sync(FULL, w, s);
        if ((lane & 7) == 0) {
            uint8_t *o = g + 3 * (lane / 8);
            o[0] = (uint8_t)w, o[1] = (uint8_t)(w >> 8), o[2] = (uint8_t)(w >> 16);
        }
        if (lane == 0)
            *(__half *)(g + 12) = hs;
    }
    }
}

__host__ __device__ __forceinline__ int group_bytes(enum llmem_kv_format format, bool value) {
    switch (format) {
    case LLMEM_KV_FORMAT_F32: return 4 * GROUP;
    case LLMEM_KV_FORMAT_F16:
    case LLMEM_KV_FORMAT_BF16: return 2 * GROUP;
    case LLMEM_KV_FORMAT_Q8: return Q8_BYTES;
    case LLMEM_KV_FORMAT_Q4: return Q4_BYTES;
    default: return value ? TQV_BYTES : TQK_BYTES;
    }
}

/* A head's row, x[j] = element lane + 32j of the warp (per ≤ MAX_LANE_D, x not kept), into o. */
template <bool QT>
__device__ __forceinline__ void encode_row(const kv_rows &r, bool value, float *x, int per,
                                           int lane, uint8_t *o) {
    if (QT && (value ? r.rot.values : r.rot.keys))
        kv_rotate(r.rot, x, per, lane);
    const int gb = group_bytes(r.format, value);
#pragma unroll
    for (int j = 0; j < MAX_LANE_D; j++)
        if (j < per)
            encode_group<QT>(r.format, value, o + j * gb, x[j], lane);
}

/* grid (token, head, keys or values), one warp: lane i takes elements i, i + 32, … of the
 * head's row (MAX_LANE_D groups at a time); the token goes to its pool slot. */
template <bool QT>
static __global__ void encode_kernel(kv_rows r, const float *k, const float *v, int heads, int head_dim,
                              const int64_t *slots, uint8_t *k_pool, uint8_t *v_pool) {
    pdl_begin();
    const int64_t t = blockIdx.x;
    const int h = blockIdx.y, lane = threadIdx.x;
    const bool value = blockIdx.z != 0;
    const float *x = (value ? v : k) + (t * heads + h) * (int64_t)head_dim;
    const size_t row = value ? r.value_bytes : r.key_bytes;
    uint8_t *o = (value ? v_pool : k_pool) + ((size_t)slots[t] * heads + h) * row;
    const int groups = head_dim / GROUP, gb = group_bytes(r.format, value);
    for (int j0 = 0; j0 < groups; j0 += MAX_LANE_D) { /* rotated rows: one pass (≤ 256) */
        const int per = groups - j0 < MAX_LANE_D ? groups - j0 : MAX_LANE_D;
        float e[MAX_LANE_D];
#pragma unroll
        for (int j = 0; j < MAX_LANE_D; j++)
            if (j < per)
                e[j] = x[lane + GROUP * (j0 + j)];
        encode_row<QT>(r, value, e, per, lane, o + (size_t)j0 * gb);
    }
}

extern "C" void llmem_cuda_kv_encode(cudaStream_t stream, enum llmem_kv_format format,
                                     const struct llmem_backend_kv_rotation *rotation,
                                     const float *k, const float *v, int64_t n, int heads,
                                     int head_dim, const int64_t *slots, uint8_t *k_pool,
                                     uint8_t *v_pool, size_t key_bytes, size_t value_bytes) {
    const kv_rows r = make_rows(format, rotation, key_bytes, value_bytes);
    for (int64_t t = 0; t < n; t += 65535) {
        dim3 grid((unsigned)(n - t < 65535 ? n - t : 65535), (unsigned)heads, 2);
        const int64_t off = t * heads * (int64_t)head_dim;
        pdl_launch(stream, quantized(format) ? encode_kernel<true> : encode_kernel<false>,
                   dim3(grid), dim3(32), 0, r, k + off, v + off, heads, head_dim, slots + t, k_pool,
                   v_pool);
    }
}

/* grid (token, group of ROPE_WARPS rows), one warp a row of the token: rows [0, heads) are its K
 * heads (turned, written back, encoded), [heads, 2·heads) its V heads (encoded), then its Q heads
 * (turned in place). The token's angles once a block, in shared memory. Lane i holds elements
 * i + 32j; with head_dim a multiple of 64 a pair (d, d + head_dim / 2) is one lane's. */
#define ROPE_WARPS 8
template <bool QT>
static __global__ void __launch_bounds__(ROPE_WARPS * 32)
    rope_encode_kernel(kv_rows rw, float *q, int n_heads, float *k, const float *v, int heads,
                       int head_dim, const int64_t *pos, const float *inv_freq,
                       const int64_t *slots, uint8_t *k_pool, uint8_t *v_pool) {
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
        encode_row<QT>(rw, true, r, per, lane,
                       v_pool + ((size_t)slot * heads + (size_t)(row - heads)) * rw.value_bytes);
        return;
    }
    for (int j = 0; j < half; j++)
        rope_turn(&r[j], &r[j + half], cs[lane + 32 * j], sn[lane + 32 * j]);
    for (int j = 0; j < per; j++)
        x[lane + 32 * j] = r[j];
    if (row < heads)
        encode_row<QT>(rw, false, r, per, lane,
                       k_pool + ((size_t)slot * heads + (size_t)row) * rw.key_bytes);
}

extern "C" int llmem_cuda_kv_encode_rope_fits(int64_t n, int head_dim) {
    return n >= 1 && n <= 65535 && head_dim % 64 == 0 && head_dim <= 32 * MAX_LANE_D;
}

extern "C" void llmem_cuda_kv_encode_rope(cudaStream_t stream, enum llmem_kv_format format,
                                          const struct llmem_backend_kv_rotation *rotation,
                                          float *q, int n_heads, float *k, const float *v,
                                          int64_t n, int heads, int head_dim, const int64_t *pos,
                                          const float *inv_freq, const int64_t *slots,
                                          uint8_t *k_pool, uint8_t *v_pool, size_t key_bytes,
                                          size_t value_bytes) {
    dim3 grid((unsigned)n, (unsigned)((2 * heads + n_heads + ROPE_WARPS - 1) / ROPE_WARPS));
    pdl_launch(stream, quantized(format) ? rope_encode_kernel<true> : rope_encode_kernel<false>,
               grid, dim3(ROPE_WARPS * 32), 0, make_rows(format, rotation, key_bytes, value_bytes),
               q, n_heads, k, v, heads, head_dim, pos, inv_freq, slots, k_pool, v_pool);
}

/* ---- attention -------------------------------------------------------------------------------
 */

/* Element d of a head's stored row (the rotated domain where the format rotates). */
__device__ __forceinline__ float element(enum llmem_kv_format format, bool value,
                                         const uint8_t *row, int d) {
    const int i = d % GROUP;
    const uint8_t *g = row + (size_t)(d / GROUP) * group_bytes(format, value);
    switch (format) {
    case LLMEM_KV_FORMAT_F32: return ((const float *)row)[d];
    case LLMEM_KV_FORMAT_F16: return __half2float(((const __half *)row)[d]);
    case LLMEM_KV_FORMAT_BF16: return __bfloat162float(((const __nv_bfloat16 *)row)[d]);
    case LLMEM_KV_FORMAT_Q8:
        return __fmul_rn((float)(int8_t)g[i], __half2float(*(const __half *)(g + GROUP)));
    case LLMEM_KV_FORMAT_Q4: {
        const int c = i < 16 ? g[i] & 15 : g[i - 16] >> 4;
        return __half2float(*(const __half *)(g + 18)) +
               (float)c * __half2float(*(const __half *)(g + 16));
    }
    default:
        if (!value)
            return __half2float(*(const __half *)(g + GROUP + 2)) +
                   (float)g[i] * __half2float(*(const __half *)(g + GROUP));
        const int bit = 3 * i; /* within the 12 bytes of codes (byte 12 starts the scale) */
        const int c = ((g[bit / 8] | g[bit / 8 + 1] << 8) >> (bit % 8)) & 7;
        return tq_level(c) * __half2float(*(const __half *)(g + 12));
    }
}

struct attn_args {
    enum llmem_kv_format format;
    struct llmem_backend_kv_rotation rot; /* keys: queries rotated; values: outputs turned back */
    int n_heads, group, head_dim, block_size;
    const uint8_t *k_pool, *v_pool;
    size_t k_tok, v_tok, key_bytes, value_bytes;
    const int32_t *blocks;
    int64_t q_pos, window;
    float scale;
    const float *q;
    float *out;
};

static __global__ void __launch_bounds__(WARPS * 32) attend_kernel(struct attn_args a) {
    pdl_begin();
    const int64_t i = blockIdx.x; /* query */
    const int h = blockIdx.y, kvh = h / a.group;
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int per = a.head_dim / 32; /* elements per lane */
    const int64_t hi = a.q_pos + i;
    const int64_t lo = a.window > 0 && hi - a.window + 1 > 0 ? hi - a.window + 1 : 0;
    const float *q = a.q + (i * a.n_heads + h) * (int64_t)a.head_dim;
    float qv[MAX_LANE_D], acc[MAX_LANE_D];
#pragma unroll
    for (int j = 0; j < MAX_LANE_D; j++) {
        qv[j] = j < per ? q[lane + 32 * j] : 0.0f;
        acc[j] = 0;
    }
    if (a.rot.keys)
        kv_rotate(a.rot, qv, per, lane);
    float m = -INFINITY, l = 0;
    for (int64_t t = lo + warp; t <= hi; t += WARPS) {
        const size_t slot =
            (size_t)a.blocks[t / a.block_size] * (size_t)a.block_size + (size_t)(t % a.block_size);
        const uint8_t *k = a.k_pool + slot * a.k_tok + (size_t)kvh * a.key_bytes;
        const uint8_t *v = a.v_pool + slot * a.v_tok + (size_t)kvh * a.value_bytes;
        float s = 0;
        for (int j = 0; j < per; j++)
            s += qv[j] * element(a.format, false, k, lane + 32 * j);
        for (int o = 16; o > 0; o /= 2)
            s += __shfl_xor_sync(0xffffffffu, s, o);
        s *= a.scale;
        const float top = fmaxf(m, s), corr = expf(m - top), p = expf(s - top);
        l = l * corr + p;
        for (int j = 0; j < per; j++)
            acc[j] = acc[j] * corr + p * element(a.format, true, v, lane + 32 * j);
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
    if (warp != 0)
        return;
    float o[MAX_LANE_D];
#pragma unroll
    for (int j = 0; j < MAX_LANE_D; j++) {
        float s = 0;
        for (int w = 0; j < per && w < WARPS; w++)
            s += sacc[w][lane + 32 * j] * f[w];
        o[j] = total > 0 ? s / total : 0;
    }
    if (a.rot.values)
        kv_rotate_inverse(a.rot, o, per, lane);
    float *out = a.out + (i * a.n_heads + h) * (int64_t)a.head_dim;
    for (int j = 0; j < per; j++)
        out[lane + 32 * j] = o[j];
}

/* Prefill chunks: one warp per (query, head), its lanes on 32 keys at a time (each lane a whole
 * key row against the query held in shared memory), the chunk's softmax by warp reductions, then
 * the 32 value rows accumulated with each lane on head_dim / 32 elements. */
static __global__ void __launch_bounds__(WARPS * 32) attend_rows_kernel(struct attn_args a, int64_t n_q) {
    pdl_begin();
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int64_t i = blockIdx.x * (int64_t)WARPS + warp; /* query */
    const int h = blockIdx.y, kvh = h / a.group;
    const int per = a.head_dim / 32;
    __shared__ float sq[WARPS][32 * MAX_LANE_D];
    if (i >= n_q)
        return;
    const float *q = a.q + (i * a.n_heads + h) * (int64_t)a.head_dim;
    {
        float qv[MAX_LANE_D];
#pragma unroll
        for (int j = 0; j < MAX_LANE_D; j++)
            qv[j] = j < per ? q[lane + 32 * j] : 0.0f;
        if (a.rot.keys)
            kv_rotate(a.rot, qv, per, lane);
        for (int j = 0; j < per; j++)
            sq[warp][lane + 32 * j] = qv[j];
    }
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
                dot += sq[warp][d] * element(a.format, false, k, d);
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
                acc[j] += pu * element(a.format, true, v, lane + 32 * j);
        }
        m = top;
    }
#pragma unroll
    for (int j = 0; j < MAX_LANE_D; j++)
        acc[j] = j < per && l > 0 ? acc[j] / l : 0;
    if (a.rot.values)
        kv_rotate_inverse(a.rot, acc, per, lane);
    float *out = a.out + (i * a.n_heads + h) * (int64_t)a.head_dim;
    for (int j = 0; j < per; j++)
        out[lane + 32 * j] = acc[j];
}

extern "C" int llmem_cuda_kv_attend(cudaStream_t stream, const struct llmem_backend_paged_attn *p,
                                    const int32_t *blocks) {
    if (p->head_dim % 32 != 0 || p->head_dim > 32 * MAX_LANE_D || p->n_heads % p->n_kv_heads)
        return LLMEM_EINVAL;
    struct attn_args a = {p->format,    {},
                          p->n_heads,   p->n_heads / p->n_kv_heads,
                          p->head_dim,  p->block_size,
                          p->k_pool,    p->v_pool,
                          p->k_tok,     p->v_tok,
                          p->key_bytes, p->value_bytes,
                          blocks,       p->q_pos,
                          p->window,    p->scale,
                          p->q,         p->out};
    if (p->rotation != NULL)
        a.rot = *p->rotation;
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
