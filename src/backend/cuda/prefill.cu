/*
 * backend/cuda/prefill.cu — causal attention of prefill chunks on tensor cores (prefill.h),
 * FlashAttention-2's scheme over the paged cache.
 *
 * A CTA takes a tile of a sequence's queries and one KV head; its W warps take 16 (query, head)
 * rows each (row r: query r / group, head r mod group of the KV head's group), so every K and V
 * row the CTA reads serves the whole group. The queries' fragments stay in registers (scaled by
 * scale · log2 e and rounded to the cache's 16-bit type); the tile's keys and values stream
 * through shared memory 64 tokens at a time, the next tile's copies (16-byte cp.async from the
 * pool's blocks, through the block table) in flight while the current one is computed. Per tile:
 * S = Q·Kᵀ on mma.m16n8k16 (f32 accumulate), the causal mask where a row's position falls inside
 * the tile, the online softmax in base 2 (each row's maximum and sum kept in registers, the
 * output rescaled when the maximum grows), then O += P·V with the probabilities taken straight
 * from the score fragments as the A operand. Keys are read by ldmatrix, values by ldmatrix.trans;
 * in shared memory each 16-byte chunk of a row sits at chunk ^ (token mod 8), so the eight rows of
 * either read hit distinct banks. A warp skips the tiles wholly after its rows' positions, and
 * masks only the tiles that straddle them; the tiles come heaviest first (the host orders them),
 * so that the longest CTAs start first.
 */
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wshadow" /* plan.h's llmem_kv_format_info(), in C++ */
#endif
#include "backend/cuda/prefill.h"
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#include "backend/cuda/launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>

#include "core/log.h"
#include "core/options.h"

namespace {

constexpr int BN = 64;    /* tokens of a KV tile */
constexpr int BLOCK = 16; /* tokens of a cache block */
constexpr float LOG2E = 1.4426950408889634f;

struct Params {
    const float *q;
    float *out;
    const uint8_t *k_pool, *v_pool;
    long long k_bstride, v_bstride;
    int tok_bytes; /* a token's rows, every KV head */
    const int32_t *tables;
    int table_stride;
    const llmem_cuda_prefill_tile *tiles;
    int n_heads, group;
    float qscale;
};

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes (n = 16; n = 0 zero-fills) to shared memory, around L1. */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N> __device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm4(uint32_t addr, uint32_t r[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm4_t(uint32_t addr, uint32_t r[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

template <bool BF>
__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    if constexpr (BF)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* 2^x, subnormal results flushed to 0; 2^−∞ = 0. */
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* Two floats rounded to the 16-bit type, x in the low half. */
template <bool BF> __device__ __forceinline__ uint32_t pack2(float x, float y) {
    if constexpr (BF) {
        __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
        return *reinterpret_cast<uint32_t *>(&h);
    } else {
        __half2 h = __floats2half2_rn(x, y);
        return *reinterpret_cast<uint32_t *>(&h);
    }
}

template <int D, int W, bool BF>
__global__ void __launch_bounds__(W * 32, W == 4 ? 2 : 1) prefill_kernel(const Params p) {
    constexpr int NCH = D / 8;       /* 16-byte chunks of a row */
    constexpr int ROWB = 2 * D;      /* bytes of a row */
    constexpr int TILE = BN * ROWB;  /* of a tile's keys (or values) */
    constexpr int NT = BN / 8;       /* n-tiles of the scores */
    constexpr int KS = D / 16;       /* k-steps of the scores, n-tiles of the output */
    extern __shared__ __align__(128) uint8_t smem[]; /* 2 stages of [keys | values] */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = lane % 4;

    pdl_begin();
    const llmem_cuda_prefill_tile tile = p.tiles[blockIdx.y];
    const int kvh = blockIdx.x;
    const int32_t *table = p.tables + (size_t)tile.table * p.table_stride;
    const int end = tile.pos + tile.n_q; /* tokens the tile's last query sees */
    const int n_kt = (end + BN - 1) / BN;

    /* this thread's rows g and g + 8 of the warp's 16: position (−1: none) and where q and out
     * hold them; the warp's lowest and highest position */
    int pos[2];
    size_t at[2];
    int lo = INT_MAX, hi = -1;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r = 16 * warp + g + 8 * i, qi = r / p.group, h = r % p.group;
        const bool valid = qi < tile.n_q;
        pos[i] = valid ? tile.pos + qi : -1;
        at[i] = valid ? ((size_t)(tile.q0 + qi) * p.n_heads + (size_t)kvh * p.group + h) * D : 0;
        if (valid)
            lo = min(lo, pos[i]), hi = max(hi, pos[i]);
    }
#pragma unroll
    for (int o = 4; o < 32; o *= 2) {
        lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }

    const uint32_t sbase = smem_addr(smem);
    auto load = [&](int kt) {
        const int t0 = kt * BN;
        const uint32_t kdst = sbase + (kt & 1) * 2 * TILE, vdst = kdst + TILE;
        for (int i = threadIdx.x; i < BN * NCH; i += W * 32) {
            const int tt = i / NCH, ch = i % NCH, t = t0 + tt;
            const bool in = t < end;
            const long long blk = in ? table[t / BLOCK] : 0;
            const size_t off = (size_t)(t % BLOCK) * p.tok_bytes + (size_t)kvh * ROWB + ch * 16;
            const uint32_t d = tt * ROWB + ((ch ^ (tt & 7)) * 16);
            cp_async16(kdst + d, p.k_pool + blk * p.k_bstride + off, in ? 16 : 0);
            cp_async16(vdst + d, p.v_pool + blk * p.v_bstride + off, in ? 16 : 0);
        }
        cp_commit();
    };
    load(0);

    /* the queries' A fragments: k-step ks holds (row g, dims 16ks + 2c, +1), (row g + 8, the
     * same), (row g, dims 16ks + 8 + 2c, +1), (row g + 8, the same) */
    uint32_t qa[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = j & 1, d = 16 * ks + 8 * (j >> 1) + 2 * c;
            const float2 v = pos[i] >= 0 ? *reinterpret_cast<const float2 *>(p.q + at[i] + d)
                                         : make_float2(0.0f, 0.0f);
            qa[ks][j] = pack2<BF>(v.x * p.qscale, v.y * p.qscale);
        }

    float o[KS * 2][4];
#pragma unroll
    for (int n = 0; n < 2 * KS; n++)
        o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    for (int kt = 0; kt < n_kt; kt++) {
        if (kt + 1 < n_kt) {
            load(kt + 1);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const int t0 = kt * BN;
        if (hi >= t0) { /* some row of the warp sees a token of the tile */
            const uint32_t kbase = sbase + (kt & 1) * 2 * TILE, vbase = kbase + TILE;
            float s[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
                /* tokens 8nt + (lane mod 8); chunks 4kp .. 4kp + 3 by lane / 8: the B fragments
                 * of k-steps 2kp and 2kp + 1 */
                const int tt = 8 * nt + (lane & 7);
#pragma unroll
                for (int kp = 0; kp < KS / 2; kp++) {
                    const int ch = 4 * kp + (lane >> 3);
                    uint32_t r[4];
                    ldsm4(kbase + tt * ROWB + ((ch ^ (tt & 7)) * 16), r);
                    mma<BF>(s[nt], qa[2 * kp], r[0], r[1]);
                    mma<BF>(s[nt], qa[2 * kp + 1], r[2], r[3]);
                }
            }
            if (lo < t0 + BN - 1) /* some row's position inside the tile: mask what follows it */
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        if (t0 + 8 * nt + 2 * c + (e & 1) > pos[e >> 1])
                            s[nt][e] = -INFINITY;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                float mx = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    mx = fmaxf(mx, fmaxf(s[nt][2 * i], s[nt][2 * i + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float mn = fmaxf(m[i], mx), base = mn == -INFINITY ? 0.0f : mn;
                const float corr = ex2(m[i] - base);
                m[i] = mn;
                float sum = 0.0f;
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    s[nt][2 * i] = ex2(s[nt][2 * i] - base);
                    s[nt][2 * i + 1] = ex2(s[nt][2 * i + 1] - base);
                    sum += s[nt][2 * i] + s[nt][2 * i + 1];
                }
                l[i] = l[i] * corr + sum;
#pragma unroll
                for (int n = 0; n < 2 * KS; n++)
                    o[n][2 * i] *= corr, o[n][2 * i + 1] *= corr;
            }
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                const uint32_t pa[4] = {pack2<BF>(s[2 * kk][0], s[2 * kk][1]),
                                        pack2<BF>(s[2 * kk][2], s[2 * kk][3]),
                                        pack2<BF>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                        pack2<BF>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                /* tokens 16kk + (lane mod 8) + 8·(lane / 8 mod 2), chunk 2nd + lane / 16: the
                 * B fragments of output n-tiles 2nd and 2nd + 1 */
                const int tt = 16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
                for (int nd = 0; nd < KS; nd++) {
                    const int ch = 2 * nd + (lane >> 4);
                    uint32_t r[4];
                    ldsm4_t(vbase + tt * ROWB + ((ch ^ (tt & 7)) * 16), r);
                    mma<BF>(o[2 * nd], pa, r[0], r[1]);
                    mma<BF>(o[2 * nd + 1], pa, r[2], r[3]);
                }
            }
        }
        __syncthreads(); /* every warp done with the stage the next copies overwrite */
    }

#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        if (pos[i] < 0)
            continue;
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
#pragma unroll
        for (int n = 0; n < 2 * KS; n++)
            *reinterpret_cast<float2 *>(p.out + at[i] + 8 * n + 2 * c) =
                make_float2(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
    }
}

int option(enum llmem_option id, int fallback) {
    int64_t v = fallback;
    (void)llmem_option_int(id, &v);
    return (int)v;
}

/* Warps a CTA: LLMEM_CUDA_PREFILL_WARPS (4 or 8; checked by every launch). */
int warps() {
    return option(LLMEM_OPT_CUDA_PREFILL_WARPS, 4) >= 8 ? 8 : 4;
}

typedef void (*kernel_fn)(const Params);

template <int W> kernel_fn pick_warps(int head_dim, bool bf) {
    if (head_dim == 64)
        return bf ? prefill_kernel<64, W, true> : prefill_kernel<64, W, false>;
    return bf ? prefill_kernel<128, W, true> : prefill_kernel<128, W, false>;
}

} // namespace

extern "C" int llmem_cuda_prefill_fits(enum llmem_kv_format format, int n_heads, int n_kv_heads,
                                       int head_dim, int block_size) {
    return (format == LLMEM_KV_FORMAT_F16 || format == LLMEM_KV_FORMAT_BF16) &&
           (head_dim == 64 || head_dim == 128) && block_size == BLOCK && n_kv_heads > 0 &&
           n_heads % n_kv_heads == 0 && n_heads / n_kv_heads <= 64;
}

extern "C" int llmem_cuda_prefill_tile_queries(int group) {
    return group > 0 ? 16 * warps() / group : 0;
}

extern "C" int llmem_cuda_prefill(const struct llmem_cuda_prefill *a) {
    const char *why = NULL;
    if (!llmem_cuda_prefill_fits(a->format, a->n_heads, a->n_kv_heads, a->head_dim, a->block_size))
        why = "shape (f16 or bf16, head_dim 64 or 128, block_size 16, groups up to 64)";
    else if (a->n_tiles < 0 || a->n_tiles > 65535 || a->table_stride < 0)
        why = "n_tiles (at most 65535) or table_stride";
    else if (((uintptr_t)a->k_pool | (uintptr_t)a->v_pool) % 16 != 0 ||
             a->k_block_stride % 16 != 0 || a->v_block_stride % 16 != 0 ||
             ((uintptr_t)a->q | (uintptr_t)a->out) % 8 != 0)
        why = "alignment (pools and block strides on 16 bytes, q and out on 8)";
    else if (llmem_option_check(LLMEM_OPT_CUDA_PREFILL_WARPS) != LLMEM_OK)
        why = "LLMEM_CUDA_PREFILL_WARPS";
    if (why != NULL) {
        LLMEM_ERROR_AS("llmem_cuda_prefill", "unsupported %s", why);
        return LLMEM_EINVAL;
    }
    if (a->n_tiles == 0)
        return LLMEM_OK;
    const int w = warps();
    const bool bf = a->format == LLMEM_KV_FORMAT_BF16;
    kernel_fn fn = w == 8 ? pick_warps<8>(a->head_dim, bf) : pick_warps<4>(a->head_dim, bf);
    const int smem = 2 * 2 * BN * 2 * a->head_dim;
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    Params p;
    p.q = a->q;
    p.out = a->out;
    p.k_pool = (const uint8_t *)a->k_pool;
    p.v_pool = (const uint8_t *)a->v_pool;
    p.k_bstride = a->k_block_stride;
    p.v_bstride = a->v_block_stride;
    p.tok_bytes = a->n_kv_heads * 2 * a->head_dim;
    p.tables = a->block_tables;
    p.table_stride = a->table_stride;
    p.tiles = a->tiles;
    p.n_heads = a->n_heads;
    p.group = a->n_heads / a->n_kv_heads;
    const float scale = a->scale != 0.0f ? a->scale : 1.0f / sqrtf((float)a->head_dim);
    p.qscale = scale * LOG2E;
    if (err == cudaSuccess)
        err = pdl_launch((cudaStream_t)a->stream, fn, dim3((unsigned)a->n_kv_heads, a->n_tiles),
                         dim3(w * 32), smem, p);
    if (err != cudaSuccess) {
        LLMEM_ERROR_AS("llmem_cuda_prefill", "launch: %s", cudaGetErrorString(err));
        return LLMEM_EIO;
    }
    return LLMEM_OK;
}
