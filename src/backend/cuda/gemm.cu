/*
 * backend/cuda/gemm.cu — the CUDA backend's matmul: one matrix, several of the same x (q, k and v;
 * gate and up) and gate and up with SwiGLU, for a decode's few rows and for prefill's many.
 *
 * matmul: a few rows of x (decode) go through our own memory-bound kernel in f32 (each warp owns
 * a weight row and streams it once with 16-byte loads for all the rows of x); more rows go to
 * cuBLAS: at fast precision the activations are rounded to the weights' 16-bit type and the
 * product runs on the tensor cores with f32 accumulation; at f32 precision the weights are widened
 * to f32 in slices of rows and multiplied in plain f32 (no TF32).
 *
 * Quantized weights (quant.cu) take quant.cu's matrix-vector kernel for up to QGEMV_MAX_ROWS rows
 * of x (at fast precision, q, k and v, or gate and up with swiglu, in one launch of its integer
 * kernel); at fast precision the types it multiplies in integers take its tensor-core integer
 * products (qmma_set, the matrices of one x after one quantization of it) up to QMMA_MAX_ROWS;
 * more rows dequantize slices of the weights (f16 at fast
 * precision, beside x rounded to f16; f32 at f32 precision) for the same GEMMs.
 *
 * The fast GEMMs' plans (cublasLt, per shape) and the 16-bit copy of an activation that the
 * operation before a GEMM writes (the shadow) live here too.
 */
#include "backend/cuda/ops_int.h"

namespace llmem_cuda {

/* ---- x rounded, weights widened, the bias ---------------------------------------------------- */

/* y[t, r] += bias[r] */
static __global__ void bias_kernel(float *y, const float *bias, int64_t rows, int64_t n) {
    pdl_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n * rows;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], bias[i % rows]);
}

/* f32 → the weights' 16-bit type, round to nearest even */
static __global__ void round_kernel(const float *x, int64_t n, enum llmem_dtype dt, void *out) {
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
static __global__ void widen_kernel(const void *w, enum llmem_dtype dt, int64_t n, float *out) {
    pdl_begin();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = weight_at(w, dt, i);
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
        /* x by plain loads after pdl_begin's wait, never the read-only path (__ldg):
         * ld.global.nc promises data that does not change while the kernel runs, and x is the
         * output of the kernel before, which a programmatic dependent launch lets run on while
         * this one starts (the read-only loads read stale x: one-row decode steps of a
         * 2,048-wide model went wrong) */
        const float4 *xr = reinterpret_cast<const float4 *>(x + (x_row0 + j) * cols + k * 8);
        float4 a = xr[0], b = xr[1];
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
         * few to cover the memory's latency one load at a time. The first batch before the wait,
         * outside the loop: the wait's memory barrier inside it kept the compiler from issuing
         * a batch's x loads together with its weight loads (a one-token step of the 8B shape:
         * 4.23 → 4.11 ms on the device) */
        if (k + 32 * (GEMV_UNROLL - 1) < end) {
            uint4 raw[GEMV_UNROLL];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++)
                raw[u] = __ldcs(wr + k + 32 * u); /* streamed once: do not keep it in L2 */
            pdl_begin(), waited = true;
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++)
                gemv_step<DT, NX>(raw[u], x, x_row0, cols, k + 32 * u, acc);
            k += 32 * GEMV_UNROLL;
        }
        if (!waited)
            pdl_begin(), waited = true;
        for (; k + 32 * (GEMV_UNROLL - 1) < end; k += 32 * GEMV_UNROLL) {
            uint4 raw[GEMV_UNROLL];
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++)
                raw[u] = __ldcs(wr + k + 32 * u);
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++)
                gemv_step<DT, NX>(raw[u], x, x_row0, cols, k + 32 * u, acc);
        }
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
static __global__ void __launch_bounds__(256)
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
static __global__ void __launch_bounds__(256, NX == 1 ? 4 : 2)
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

/* Columns gemv32_kernel takes: its 256 threads hold a row in registers, 8 float4s each. */
#define GEMV32_MAX_COLS (256 * 8 * 4)

/* f32 weights (a mixture's router, 128 rows of 2,048 in a Qwen3 MoE): a block a weight row, its
 * 256 threads each holding up to 8 float4s of it, read before the wait and at once (a warp a row
 * in gemv_any_kernel put 16 blocks on the device, each reading its rows a float a lane at a time:
 * 10.4 µs for the router's 1 MB), then multiplied with each of the n rows of x. cols a multiple of
 * 4 up to GEMV32_MAX_COLS, w and x 16-byte aligned (matmul checks). */
static __global__ void __launch_bounds__(256)
    gemv32_kernel(const float *w, int64_t rows, int64_t cols, const float *x, int64_t n, float *y,
                  const float *bias) {
    constexpr int C = GEMV32_MAX_COLS / 1024;
    const int64_t r = blockIdx.x, c4 = cols / 4;
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const float4 *wr = reinterpret_cast<const float4 *>(w + r * cols);
    float4 wv[C];
#pragma unroll
    for (int i = 0; i < C; i++) {
        const int64_t k = threadIdx.x + 256 * i;
        wv[i] = k < c4 ? __ldg(wr + k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    pdl_begin();
    __shared__ float part[8];
    for (int64_t t = 0; t < n; t++) {
        const float4 *xr = reinterpret_cast<const float4 *>(x + t * cols);
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < C; i++) {
            const int64_t k = threadIdx.x + 256 * i;
            if (k < c4) {
                const float4 a = xr[k];
                s += wv[i].x * a.x + wv[i].y * a.y + wv[i].z * a.z + wv[i].w * a.w;
            }
        }
        for (int o = 16; o > 0; o /= 2)
            s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0)
            part[warp] = s;
        __syncthreads();
        if (threadIdx.x == 0) {
            float v = 0.0f;
            for (int i = 0; i < 8; i++)
                v += part[i];
            y[t * rows + r] = bias != NULL ? v + bias[r] : v;
        }
        __syncthreads();
    }
}

/* The general case (odd shapes): one warp per (row of x, weight row). */
static __global__ void gemv_any_kernel(const void *w, enum llmem_dtype dt, int64_t rows,
                                       int64_t cols, const float *x, int64_t n, float *y,
                                       const float *bias) {
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

/* A mixture's experts (ops_int.h gemv_experts): block (x, y, z) takes the rows of block x of
 * expert ids[order[y]] (order NULL: ids[y]) of stack z (w0, w1: the experts rows · cols values
 * apart), for row order[y] / k of x (k 0: row y), into row y of y0 or y1. 16-bit weights in
 * aligned rows, W warps a row, as gemv16_kernel. */
template <enum llmem_dtype DT, int W>
static __global__ void __launch_bounds__(256)
    gemv16_experts_kernel(const uint16_t *w0, const uint16_t *w1, int64_t rows, int64_t cols,
                          const int32_t *ids, const int32_t *order, int k, const float *x,
                          float *y0, float *y1) {
    pdl_begin(); /* the experts are known once the routing ran */
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int64_t pr = blockIdx.y, p = order != NULL ? order[pr] : pr, e = ids[p];
    const uint16_t *w = (blockIdx.z == 1 ? w1 : w0) + e * rows * cols;
    float *y = (blockIdx.z == 1 ? y1 : y0) + pr * rows;
    const int64_t r = blockIdx.x * (int64_t)(8 / W) + warp / W;
    float acc[1];
    gemv_row<DT, 1, W>(r < rows ? w + r * cols : NULL, cols, x, k > 0 ? p / k : pr, warp % W,
                       lane, acc);
    if (W > 1) {
        __shared__ float part[8];
        if (lane == 0)
            part[warp] = acc[0];
        __syncthreads();
        if (warp % W != 0)
            return;
        for (int i = 1; i < W; i++)
            acc[0] += part[warp + i];
    }
    if (lane == 0 && r < rows)
        y[r] = acc[0];
}

/* gemv16_experts_kernel for any float weights: a warp a row. */
static __global__ void gemv_any_experts_kernel(const void *w0, const void *w1, enum llmem_dtype dt,
                                               int64_t rows, int64_t cols, const int32_t *ids,
                                               const int32_t *order, int k, const float *x,
                                               float *y0, float *y1) {
    pdl_begin();
    const int64_t r = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (r >= rows)
        return;
    const int64_t pr = blockIdx.y, p = order != NULL ? order[pr] : pr, e = ids[p];
    const float *xr = x + (k > 0 ? p / k : pr) * cols;
    const int64_t at = (e * rows + r) * cols;
    float s = 0;
    for (int64_t i = lane; i < cols; i += 32)
        s += weight_at(blockIdx.z == 1 ? w1 : w0, dt, at + i) * xr[i];
    for (int o = 16; o > 0; o /= 2)
        s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0)
        (blockIdx.z == 1 ? y1 : y0)[pr * rows + r] = s;
}

void gemv_experts(struct cuda_ctx *c, const struct llmem_weight *w, const struct llmem_weight *w1,
                  const int32_t *ids, const int32_t *order, int k, const float *x, const float *up,
                  const uint8_t *xq, int64_t x_rows, int64_t pairs, float *y, float *y1) {
    if (w->quant != 0) {
        qgemv_experts(c, w, w1, ids, order, k, x, up, xq, x_rows, pairs, y, y1);
        return;
    }
    LLMEM_ASSERT(xq == NULL);
    if (up != NULL)
        swiglu_launch(c, x, up, x_rows * w->cols, (float *)x);
    const int64_t rows = w->rows, cols = w->cols;
    const unsigned z = w1 != NULL ? 2 : 1;
    const void *d1 = w1 != NULL ? w1->data : w->data;
    const int is16 = (w->dtype == LLMEM_DTYPE_BF16 || w->dtype == LLMEM_DTYPE_F16) &&
                     cols % 8 == 0 && (((uintptr_t)w->data | (uintptr_t)d1 | (uintptr_t)x) & 15) == 0;
    if (!is16) {
        pdl_launch(c->stream, gemv_any_experts_kernel, dim3((unsigned)((rows + 7) / 8),
                   (unsigned)pairs, z), dim3(256), 0, w->data, d1, w->dtype, rows, cols, ids,
                   order, k, x, y, y1);
        launched(c, "gemv experts");
        return;
    }
    const int split = cols >= 4096 && cols % 16 == 0 ? 2 : 1; /* as gemv16 */
    const dim3 grid((unsigned)((rows + 8 / split - 1) / (8 / split)), (unsigned)pairs, z);
    const uint16_t *a = (const uint16_t *)w->data, *b = (const uint16_t *)d1;
#define EXPERTS(DT, W)                                                                             \
    pdl_launch(c->stream, gemv16_experts_kernel<DT, W>, grid, dim3(256), 0, a, b, rows, cols, ids, \
               order, k, x, y, y1)
    if (w->dtype == LLMEM_DTYPE_BF16 && split == 2)
        EXPERTS(LLMEM_DTYPE_BF16, 2);
    else if (w->dtype == LLMEM_DTYPE_BF16)
        EXPERTS(LLMEM_DTYPE_BF16, 1);
    else if (split == 2)
        EXPERTS(LLMEM_DTYPE_F16, 2);
    else
        EXPERTS(LLMEM_DTYPE_F16, 1);
#undef EXPERTS
    launched(c, "gemv experts");
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
    return n <= gemv_rows(c) && w->quant == 0 &&
           (w->dtype == LLMEM_DTYPE_BF16 || w->dtype == LLMEM_DTYPE_F16) && w->cols % 8 == 0 &&
           ((uintptr_t)w->data & 15) == 0 && ((uintptr_t)x & 15) == 0;
}

static void gemv16_set(struct cuda_ctx *c, const struct gemv_set *set, int count,
                       enum llmem_dtype dt, int64_t cols, const float *x, int64_t n) {
    if (dt == LLMEM_DTYPE_BF16)
        gemv16<LLMEM_DTYPE_BF16>(c, set, count, cols, x, n);
    else
        gemv16<LLMEM_DTYPE_F16>(c, set, count, cols, x, n);
}

/* Column-major C[m, n] (ldc) = Aᵀ · B, A [k, m] and B [k, n] packed, of type t, C f32: in plain
 * f32 (the pedantic compute type keeps TF32 out even when the environment asks for it), or with
 * 16-bit A and B on the tensor cores with f32 accumulation. */
static void gemm_ex(struct cuda_ctx *c, int64_t m, int64_t n, int64_t k, const void *a,
                    const void *b, cudaDataType_t t, float *y, int64_t ldc) {
    const float one = 1.0f, zero = 0.0f;
    check_blas(c,
               llmem_cuda_blas.gemm_ex(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)m, (int)n, (int)k, &one, a, t,
                            (int)k, b, t, (int)k, &zero, y, CUDA_R_32F, (int)ldc,
                            t == CUDA_R_32F ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT),
               t == CUDA_R_32F ? "cublasGemmEx (f32)" : "cublasGemmEx (f16)");
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

void lt_plan_free(struct lt_plan *p) {
    if (!p->ready)
        return;
    llmem_cuda_blas.lt_layout_destroy(p->a);
    llmem_cuda_blas.lt_layout_destroy(p->b);
    llmem_cuda_blas.lt_layout_destroy(p->c);
    llmem_cuda_blas.lt_desc_destroy(p->op);
    p->ready = 0;
}

/* Of the heuristic's candidates (best first), the one a plan takes: the first, unless its tiles
 * fill under half of one wave of the GPU's SMs (a skinny batch's GEMM: a few tiles each streaming
 * a long slice of the weights) and another's fill at least 90 % of one, then the one nearest a full
 * wave (the earlier on a tie). Deterministic for a device and a shape. (H100, 128 rows of x: the
 * 8B shape's down projection 51.4 µs as the first, split-K 3 in a third of a wave, against 45.1 in
 * 0.97 of one; its k and v, whose candidates all fill under half a wave, 10.5 µs as the first
 * against 11.4-15.5 for the others.) */
#define LT_CANDIDATES 8
static int lt_pick(const cublasLtMatmulHeuristicResult_t *res, int found) {
    const auto fill = [&](int i) { return res[i].wavesCount < 1.0f ? res[i].wavesCount : 1.0f; };
    int best = 0;
    for (int i = 1; i < found; i++)
        best = fill(i) > fill(best) ? i : best;
    return res[0].wavesCount < 0.5f && fill(best) >= 0.9f ? best : 0;
}

/* The algorithm for the shape, of those cublasLt's heuristic knows with at most `workspace` bytes
 * of workspace (lt_pick); LLMEM_OK, or the status of a failure (logged). */
static int lt_plan_make(struct cuda_ctx *c, struct lt_plan *p, size_t workspace) {
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res[LT_CANDIDATES] = {};
    int found = 0;
    p->op = NULL, p->a = p->b = p->c = NULL, p->ready = 1;
    cublasStatus_t st = llmem_cuda_blas.lt_desc_create(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = llmem_cuda_blas.lt_desc_set(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    if (st == CUBLAS_STATUS_SUCCESS)
        st = llmem_cuda_blas.lt_desc_set(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    if (st == CUBLAS_STATUS_SUCCESS)
        st = llmem_cuda_blas.lt_layout_create(&p->a, p->type, (uint64_t)p->cols, (uint64_t)p->rows,
                                        p->cols);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = llmem_cuda_blas.lt_layout_create(&p->b, p->type, (uint64_t)p->cols, (uint64_t)p->n, p->cols);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = llmem_cuda_blas.lt_layout_create(&p->c, CUDA_R_32F, (uint64_t)p->rows, (uint64_t)p->n,
                                        p->rows);
    /* a batch: the matrices one after the other, one x (stride 0), the outputs stride_c apart */
    const int32_t batch = (int32_t)p->batch;
    cublasLtMatrixLayout_t layouts[3] = {p->a, p->b, p->c};
    const int64_t strides[3] = {p->rows * p->cols, 0, p->stride_c};
    for (int i = 0; batch > 1 && i < 3; i++) {
        if (st == CUBLAS_STATUS_SUCCESS)
            st = llmem_cuda_blas.lt_layout_set(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                  &batch, sizeof(batch));
        if (st == CUBLAS_STATUS_SUCCESS)
            st = llmem_cuda_blas.lt_layout_set(layouts[i],
                                                  CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                  &strides[i], sizeof(strides[i]));
    }
    if (st == CUBLAS_STATUS_SUCCESS)
        st = llmem_cuda_blas.lt_pref_create(&pref);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = llmem_cuda_blas.lt_pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &workspace, sizeof(workspace));
    if (st == CUBLAS_STATUS_SUCCESS)
        st = llmem_cuda_blas.lt_algo_heuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref, LT_CANDIDATES,
                                               res, &found);
    if (st == CUBLAS_STATUS_SUCCESS && found == 0)
        st = CUBLAS_STATUS_NOT_SUPPORTED;
    if (pref != NULL)
        llmem_cuda_blas.lt_pref_destroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS)
        return check_blas(c, st, "cublasLt plan");
    const int pick = lt_pick(res, found);
    p->algo = res[pick].algo;
    p->workspace = res[pick].workspaceSize;
    LLMEM_DEBUG("cuda: GEMM %lld x %lld x %lld (batch %lld): candidate %d of %d, %.2f waves "
                "(the first %.2f), workspace %zu",
                (long long)p->rows, (long long)p->n, (long long)p->cols, (long long)p->batch, pick,
                found, (double)res[pick].wavesCount, (double)res[0].wavesCount, p->workspace);
    return LLMEM_OK;
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

/* y = b · Wᵀ with W in slices of rows made dt (F32, at f32 precision: 16-bit weights widened or
 * quantized ones dequantized, in scratch; F16, at fast precision: quantized weights dequantized,
 * in the slice buffer, b being x rounded to f16), each slice a GEMM into its columns of C (rows
 * r0 … r0 + m of y's rows, ldc = rows): in plain f32, or on the tensor cores. */
static void sliced_gemm(struct cuda_ctx *c, const struct llmem_weight *w, const void *b, int64_t n,
                        float *y, enum llmem_dtype dt) {
    const size_t size = dt == LLMEM_DTYPE_F16 ? 2 : 4;
    int64_t slice = (int64_t)(WIDEN_SLICE_BYTES / ((size_t)w->cols * size));
    slice = slice < 1 ? 1 : slice > w->rows ? w->rows : slice;
    void *ws = dt == LLMEM_DTYPE_F16 ? wslice(c, (size_t)(slice * w->cols) * size)
                                     : scratch(c, (size_t)(slice * w->cols) * size);
    if (ws == NULL)
        return;
    for (int64_t r0 = 0; r0 < w->rows && !c->failed; r0 += slice) {
        const int64_t m = w->rows - r0 < slice ? w->rows - r0 : slice;
        if (w->quant != 0) {
            qdequant(c, w, r0, m, dt, ws);
        } else {
            pdl_launch(c->stream, widen_kernel, dim3(grid_for(m * w->cols, 256)), dim3(256), 0,
                       (const uint16_t *)w->data + r0 * w->cols, w->dtype, m * w->cols,
                       (float *)ws);
            launched(c, "widen");
        }
        profile_begin(c->stream);
        gemm_ex(c, m, n, w->cols, ws, b, dt == LLMEM_DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F, y + r0,
                w->rows);
        launched(c, "gemm");
    }
}

/* cuda_matmul, where xr (if not NULL) is x already rounded for the fast GEMM. */
static void matmul(struct cuda_ctx *c, const struct llmem_weight *w, const float *x, const void *xr,
                   int64_t n, float *y, const float *bias) {
    const int is16 = w->dtype == LLMEM_DTYPE_BF16 || w->dtype == LLMEM_DTYPE_F16;
    if (w->quant != 0 && n <= QGEMV_MAX_ROWS) {
        qgemv(c, w, x, n, y, bias);
        return;
    }
    if (n <= QMMA_MAX_ROWS && qgemv_int(c, w)) {
        qmma_set(c, 1, &w, x, n, &y, &bias);
        return;
    }
    if (w->quant != 0 && c->precision == LLMEM_PRECISION_FAST) {
        /* x in f16 (the shadow, or rounded) beside the slices */
        const void *b = shadow_of(c, x, n, w->cols, LLMEM_DTYPE_F16);
        if (b == NULL && (b = rounded(c, x, n, w->cols, LLMEM_DTYPE_F16)) == NULL)
            return;
        sliced_gemm(c, w, b, n, y, LLMEM_DTYPE_F16);
    } else if (w->quant != 0) {
        sliced_gemm(c, w, x, n, y, LLMEM_DTYPE_F32);
    } else if (n <= gemv_rows(c)) {
        if (gemv16_fits(c, w, x, n)) {
            const struct gemv_set set = {
                {w->data}, {y}, {bias}, {w->rows}, {0}}; /* first: gemv16 */
            gemv16_set(c, &set, 1, w->dtype, w->cols, x, n);
        } else if (w->dtype == LLMEM_DTYPE_F32 && w->cols % 4 == 0 &&
                   w->cols <= GEMV32_MAX_COLS && (((uintptr_t)w->data | (uintptr_t)x) & 15) == 0) {
            pdl_launch(c->stream, gemv32_kernel, dim3((unsigned)w->rows), dim3(256), 0,
                       (const float *)w->data, w->rows, w->cols, x, n, y, bias);
            launched(c, "gemv");
        } else {
            int64_t warps = w->rows * n;
            pdl_launch(c->stream, gemv_any_kernel, dim3((unsigned)((warps + 7) / 8)), dim3(256), 0,
                       w->data, w->dtype, w->rows, w->cols, x, n, y, bias);
            launched(c, "gemv");
        }
        return;
    } else if (!is16) {
        /* Row-major y[n, rows] = x[n, cols] · Wᵀ is, column-major, C[rows, n] = Aᵀ · B with
         * A = W ([cols, rows], lda = cols) and B = x ([cols, n], ldb = cols). */
        gemm_ex(c, w->rows, n, w->cols, w->data, x, CUDA_R_32F, y, w->rows);
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
                   llmem_cuda_blas.lt_matmul(c->lt, p->op, &one, w->data, p->a, xr, p->b, &zero, y, p->c, y,
                                  p->c, &p->algo, p->workspace > 0 ? c->lt_ws : NULL, p->workspace,
                                  c->stream),
                   "cublasLtMatmul");
        launched(c, "gemm");
    } else {
        sliced_gemm(c, w, x, n, y, LLMEM_DTYPE_F32); /* f32 precision, 16-bit W */
    }
    if (bias != NULL) {
        pdl_launch(c->stream, bias_kernel, dim3(grid_for(n * w->rows, 256)), dim3(256), 0, y, bias,
                   w->rows, n);
        launched(c, "bias");
    }
}

void cuda_matmul(void *ctx, const struct llmem_weight *w, const float *x, int64_t n, float *y,
                 const float *bias) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    LLMEM_ASSERT(w != NULL && x != NULL && y != NULL && n >= 0);
    if (n == 0 || c->failed ||
        staged(c, OP_MATMUL,
               {arg(w->data), arg((int64_t)w->dtype), arg((int64_t)w->quant), arg(w->rows),
                arg(w->cols), arg(x), arg(n), arg(y), arg(bias),
                arg(shadow_of(c, x, n, w->cols, w->quant != 0 ? LLMEM_DTYPE_F16 : w->dtype))}))
        return;
    matmul(c, w, x, NULL, n, y, bias);
    shadow_written(c, y, n * w->rows);
}

/* Quantized matrices of one x that quant.cu's qgemv_set (n ≤ QGEMV_MAX_ROWS) or qmma_set
 * (most = QMMA_MAX_ROWS) take with x quantized once. */
static int qset_fits(const struct cuda_ctx *c, int count, const struct llmem_weight *const *w,
                     int64_t n, int64_t most) {
    int fits = count <= 3 && n > 0 && n <= most && !c->failed;
    for (int i = 0; i < count; i++)
        fits = fits && qgemv_int(c, w[i]) && w[i]->cols == w[0]->cols;
    return fits;
}

/* Several matrices of the same x: one launch when all take the memory-bound kernel together. */
void cuda_matmul_multi(void *ctx, int count, const struct llmem_weight *const *w, const float *x,
                       int64_t n, float *const *y, const float *const *bias) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    LLMEM_ASSERT(count >= 1 && count <= 4);
    if (qset_fits(c, count, w, n, QMMA_MAX_ROWS)) {
        for (int i = 0; i < count; i++)
            staged(c, OP_MATMUL_W,
                   {arg(w[i]->data), arg(w[i]->rows), arg(y[i]), arg(bias ? bias[i] : NULL)});
        if (staged(c, OP_GEMV_SET, {arg((int64_t)count), arg(x), arg(n)}))
            return;
        if (n <= QGEMV_MAX_ROWS)
            qgemv_set(c, count, w, x, n, y, bias, 0);
        else
            qmma_set(c, count, w, x, n, y, bias);
        for (int i = 0; i < count; i++)
            shadow_written(c, y[i], n * w[i]->rows);
        return;
    }
    int together = 1;
    for (int i = 0; i < count; i++)
        together = together && gemv16_fits(c, w[i], x, n) && w[i]->dtype == w[0]->dtype &&
                   w[i]->cols == w[0]->cols;
    if (!together || n == 0 || c->failed) {
        /* the fast GEMMs of one x: rounded once for all */
        int shared = n > gemv_rows(c) && c->precision == LLMEM_PRECISION_FAST && !c->failed;
        for (int i = 0; i < count; i++)
            shared = shared && w[i]->quant == 0 && w[i]->dtype == w[0]->dtype &&
                     w[i]->cols == w[0]->cols &&
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
                           llmem_cuda_blas.lt_matmul(c->lt, p->op, &one, w[i]->data, p->a, xr, p->b, &zero,
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

/* A decode's few rows of x: a launch for up to 4 of them computes both GEMVs and swiglu
 * (gemv16_swiglu_kernel); more rows take the GEMMs and swiglu. */
void cuda_matmul_swiglu(void *ctx, const struct llmem_weight *gate, const struct llmem_weight *up,
                        const float *x, int64_t n, float *g, float *u, float *out) {
    struct cuda_ctx *c = (struct cuda_ctx *)ctx;
    LLMEM_ASSERT(gate != NULL && up != NULL && x != NULL && out != NULL && n >= 0);
    const struct llmem_weight *gu[2] = {gate, up};
    if (qset_fits(c, 2, gu, n, QGEMV_MAX_ROWS) && gate->rows == up->rows) {
        if (staged(c, OP_GEMV_SWIGLU,
                   {arg(gate->data), arg(up->data), arg((int64_t)gate->quant), arg(gate->rows),
                    arg(gate->cols), arg(x), arg(n), arg(out)}))
            return;
        qgemv_set(c, 2, gu, x, n, &out, NULL, 1);
        shadow_written(c, out, n * gate->rows);
        return;
    }
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

} // namespace llmem_cuda
