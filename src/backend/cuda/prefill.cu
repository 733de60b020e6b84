/*
 * backend/cuda/prefill.cu — causal attention of prefill chunks on tensor cores (prefill.h),
 * FlashAttention-2's scheme over the paged cache.
 *
 * A CTA takes a tile of a sequence's queries and one KV head; its 4 warps take 16 or 32 (query,
 * head) rows each (MB m-blocks of 16; row r: query r / group, head r mod group of the KV head's
 * group), so every K and V row the CTA reads serves the whole group, and every fragment a warp
 * reads from shared memory serves its MB m-blocks. The queries, scaled by scale · log2 e and
 * rounded to the cache's 16-bit type, wait in shared memory; the tile's keys and values stream
 * through it 64 tokens at a time, the next tile's copies (16-byte cp.async from the pool's blocks,
 * through the block table) in flight while the current one is computed. Per tile: S = Q·Kᵀ on
 * mma.m16n8k16 (f32 accumulate), the causal mask where a row's position falls inside the tile,
 * the online softmax in base 2 (each row's maximum and sum kept in registers, the output rescaled
 * when the maximum grows), then O += P·V with the probabilities taken straight from the score
 * fragments as the A operand. Queries and keys are read by ldmatrix, values by ldmatrix.trans; in
 * shared memory each 16-byte chunk of a row sits at chunk ^ (row mod 8), so the eight rows of any
 * such read hit distinct banks. A warp skips the tiles wholly after its rows' positions, and masks
 * only the tiles that straddle them; the tiles come heaviest first (the host orders them), so that
 * the longest CTAs start first.
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
#include "backend/cuda/tc.h"

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

/* Four 8×8 matrices of 16-bit values from shared memory (lanes 8i … 8i + 7 give matrix i's rows),
 * as stored or transposed (ldsm4_t). */
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

/* Eight q8 codes (two words, as stored: two's complement) times their f16 scale, as four f16
 * pairs: each code becomes 1024 + (code + 128) in f16 exactly, less 1152, times the scale. */
__device__ __forceinline__ uint4 dequant8(uint32_t w0, uint32_t w1, __half2 s2) {
    const __half2 off = __float2half2_rn(1152.0f);
    uint32_t r[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const uint32_t x = (k < 2 ? w0 : w1) ^ 0x80808080u;
        uint32_t h = __byte_perm(x, 0x64646464u, (k & 1) ? 0x4342 : 0x4140);
        __half2 v = __hmul2(__hsub2(*reinterpret_cast<__half2 *>(&h), off), s2);
        r[k] = *reinterpret_cast<uint32_t *>(&v);
    }
    return make_uint4(r[0], r[1], r[2], r[3]);
}

/* W warps of MB m-blocks (16 rows) each: a CTA holds 16·MB·W (query, head) rows. FMT: the cache's
 * rows, 16-bit (BF: bf16, else f16) or q8 (Q8: 34 bytes a group of 32, codes then the f16 scale;
 * decoded to f16 as the tile is loaded, so that the products run on f16). */
template <int D, int W, int MB, bool BF, bool Q8>
__global__ void __launch_bounds__(W * 32, W * MB <= 4 ? 2 : 1) prefill_kernel(const Params p) {
    constexpr int NCH = D / 8;          /* 16-byte chunks of a row */
    constexpr int ROWB = 2 * D;         /* bytes of a row */
    constexpr int TILE = BN * ROWB;     /* of a tile's keys (or values) */
    constexpr int BM = 16 * MB * W;     /* rows of the CTA */
    constexpr int NT = BN / 8;          /* n-tiles of the scores */
    constexpr int KS = D / 16;          /* k-steps of the scores, n-tile pairs of the output */
    extern __shared__ __align__(128) uint8_t smem[]; /* the queries, then 2 stages of [K | V] */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = lane % 4;

    pdl_begin();
    const llmem_cuda_prefill_tile tile = p.tiles[blockIdx.y];
    const int kvh = blockIdx.x;
    const int32_t *table = p.tables + (size_t)tile.table * p.table_stride;
    const int end = tile.pos + tile.n_q; /* tokens the tile's last query sees */
    const int n_kt = (end + BN - 1) / BN;
    const uint32_t qbase = smem_addr(smem), sbase = qbase + BM * ROWB;

    /* q8: the tile's rows read word by word, decoded and stored at once (a thread a group of
     * 32 of a token's key or value row); a group starts 2 bytes past a word when it is odd */
    auto load_q8 = [&](int kt) {
        constexpr int G = D / 32, RB = 34 * G;
        const int t0 = kt * BN;
        uint8_t *stage = smem + BM * ROWB + (kt & 1) * 2 * TILE;
        for (int u = threadIdx.x; u < 2 * BN * G; u += W * 32) {
            const int v = u / (BN * G), tt = (u / G) % BN, grp = u % G, t = t0 + tt;
            uint4 out[4] = {};
            if (t < end) {
                const long long blk = table[t / BLOCK];
                const uint8_t *row = (v ? p.v_pool + blk * p.v_bstride
                                        : p.k_pool + blk * p.k_bstride) +
                                     (size_t)(t % BLOCK) * p.tok_bytes + (size_t)kvh * RB +
                                     34 * grp;
                const uint32_t *w = reinterpret_cast<const uint32_t *>((uintptr_t)row & ~3ull);
                const bool odd = ((uintptr_t)row & 3) != 0;
                uint32_t x[9];
#pragma unroll
                for (int i = 0; i < 9; i++)
                    x[i] = w[i]; /* (the cache: as gemv_step reads x) */
                uint32_t codes[8];
#pragma unroll
                for (int i = 0; i < 8; i++)
                    codes[i] = odd ? __funnelshift_r(x[i], x[i + 1], 16) : x[i];
                const uint16_t sbits = (uint16_t)(odd ? x[8] >> 16 : x[8] & 0xffffu);
                const __half2 s2 = __half2half2(__ushort_as_half(sbits));
#pragma unroll
                for (int k = 0; k < 4; k++)
                    out[k] = dequant8(codes[2 * k], codes[2 * k + 1], s2);
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int ch = 4 * grp + k;
                *reinterpret_cast<uint4 *>(stage + v * TILE + tt * ROWB +
                                           ((ch ^ (tt & 7)) * 16)) = out[k];
            }
        }
    };
    auto load = [&](int kt) {
        if constexpr (Q8) {
            load_q8(kt);
        } else {
            const int t0 = kt * BN;
            const uint32_t kdst = sbase + (kt & 1) * 2 * TILE, vdst = kdst + TILE;
            for (int i = threadIdx.x; i < BN * NCH; i += W * 32) {
                const int tt = i / NCH, ch = i % NCH, t = t0 + tt;
                const bool in = t < end;
                const long long blk = in ? table[t / BLOCK] : 0;
                const size_t off =
                    (size_t)(t % BLOCK) * p.tok_bytes + (size_t)kvh * ROWB + ch * 16;
                const uint32_t d = tt * ROWB + ((ch ^ (tt & 7)) * 16);
                cp_async16<false>(kdst + d, p.k_pool + blk * p.k_bstride + off, in ? 16 : 0);
                cp_async16<false>(vdst + d, p.v_pool + blk * p.v_bstride + off, in ? 16 : 0);
            }
            cp_commit();
        }
    };
    load(0);

    /* the queries, scaled by scale · log2 e and rounded, into shared memory (row r: query
     * r / group, head r mod group; chunks swizzled by the row); rows past the tile zero */
    for (int i = threadIdx.x; i < BM * NCH; i += W * 32) {
        const int r = i / NCH, ch = i % NCH, qi = r / p.group;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (qi < tile.n_q) {
            const float *src = p.q + ((size_t)(tile.q0 + qi) * p.n_heads +
                                      (size_t)kvh * p.group + r % p.group) * D + 8 * ch;
            const float4 a = *reinterpret_cast<const float4 *>(src);
            const float4 b = *reinterpret_cast<const float4 *>(src + 4);
            v = make_uint4(pack2<BF>(a.x * p.qscale, a.y * p.qscale),
                           pack2<BF>(a.z * p.qscale, a.w * p.qscale),
                           pack2<BF>(b.x * p.qscale, b.y * p.qscale),
                           pack2<BF>(b.z * p.qscale, b.w * p.qscale));
        }
        *reinterpret_cast<uint4 *>(smem + r * ROWB + ((ch ^ (r & 7)) * 16)) = v;
    }

    /* this thread's rows g and g + 8 of each of the warp's m-blocks: position (−1: none); the
     * warp's lowest and highest position */
    int pos[MB][2];
    int lo = INT_MAX, hi = -1;
#pragma unroll
    for (int mb = 0; mb < MB; mb++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int qi = (16 * (MB * warp + mb) + g + 8 * i) / p.group;
            pos[mb][i] = qi < tile.n_q ? tile.pos + qi : -1;
            if (pos[mb][i] >= 0)
                lo = min(lo, pos[mb][i]), hi = max(hi, pos[mb][i]);
        }
#pragma unroll
    for (int o = 4; o < 32; o *= 2) {
        lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }

    float o[MB][2 * KS][4];
#pragma unroll
    for (int mb = 0; mb < MB; mb++)
#pragma unroll
        for (int n = 0; n < 2 * KS; n++)
            o[mb][n][0] = o[mb][n][1] = o[mb][n][2] = o[mb][n][3] = 0.0f;
    float m[MB][2], l[MB][2];
#pragma unroll
    for (int mb = 0; mb < MB; mb++)
        m[mb][0] = m[mb][1] = -INFINITY, l[mb][0] = l[mb][1] = 0.0f;

    for (int kt = 0; kt < n_kt; kt++) {
        if (!Q8 && kt + 1 < n_kt) { /* 16-bit: the next tile's copies in flight meanwhile */
            load(kt + 1);
            cp_wait<1>();
        } else if (!Q8) {
            cp_wait<0>();
        }
        __syncthreads(); /* the tile's copies (and, the first time, the queries) for every warp */
        const int t0 = kt * BN;
        if (hi >= t0) { /* some row of the warp sees a token of the tile */
            const uint32_t kbase = sbase + (kt & 1) * 2 * TILE, vbase = kbase + TILE;
            float s[MB][NT][4];
#pragma unroll
            for (int mb = 0; mb < MB; mb++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    s[mb][nt][0] = s[mb][nt][1] = s[mb][nt][2] = s[mb][nt][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                /* the A fragments of k-step ks: rows lane mod 16 of the m-block, chunk
                 * 2ks + lane / 16 */
                uint32_t qa[MB][4];
#pragma unroll
                for (int mb = 0; mb < MB; mb++) {
                    const int r = 16 * (MB * warp + mb) + (lane & 15), ch = 2 * ks + (lane >> 4);
                    ldsm4(qbase + r * ROWB + ((ch ^ (r & 7)) * 16), qa[mb]);
                }
                /* the B fragments of n-tiles 2np and 2np + 1: tokens 8(2np + lane / 16) +
                 * lane mod 8, chunk 2ks + (lane / 8 mod 2) */
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    const int tt = 8 * (2 * np + (lane >> 4)) + (lane & 7);
                    const int ch = 2 * ks + ((lane >> 3) & 1);
                    uint32_t b[4];
                    ldsm4(kbase + tt * ROWB + ((ch ^ (tt & 7)) * 16), b);
#pragma unroll
                    for (int mb = 0; mb < MB; mb++) {
                        mma<BF>(s[mb][2 * np], qa[mb], b[0], b[1]);
                        mma<BF>(s[mb][2 * np + 1], qa[mb], b[2], b[3]);
                    }
                }
            }
            if (lo < t0 + BN - 1) /* some row's position inside the tile: mask what follows it */
#pragma unroll
                for (int mb = 0; mb < MB; mb++)
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            if (t0 + 8 * nt + 2 * c + (e & 1) > pos[mb][e >> 1])
                                s[mb][nt][e] = -INFINITY;
#pragma unroll
            for (int mb = 0; mb < MB; mb++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
                        mx = fmaxf(mx, fmaxf(s[mb][nt][2 * i], s[mb][nt][2 * i + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float mn = fmaxf(m[mb][i], mx), base = mn == -INFINITY ? 0.0f : mn;
                    const float corr = ex2(m[mb][i] - base);
                    m[mb][i] = mn;
                    float sum = 0.0f;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        s[mb][nt][2 * i] = ex2(s[mb][nt][2 * i] - base);
                        s[mb][nt][2 * i + 1] = ex2(s[mb][nt][2 * i + 1] - base);
                        sum += s[mb][nt][2 * i] + s[mb][nt][2 * i + 1];
                    }
                    l[mb][i] = l[mb][i] * corr + sum;
#pragma unroll
                    for (int n = 0; n < 2 * KS; n++)
                        o[mb][n][2 * i] *= corr, o[mb][n][2 * i + 1] *= corr;
                }
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                /* the probabilities of tokens 16kk .. 16kk + 15 as A fragments */
                uint32_t pa[MB][4];
#pragma unroll
                for (int mb = 0; mb < MB; mb++) {
                    pa[mb][0] = pack2<BF>(s[mb][2 * kk][0], s[mb][2 * kk][1]);
                    pa[mb][1] = pack2<BF>(s[mb][2 * kk][2], s[mb][2 * kk][3]);
                    pa[mb][2] = pack2<BF>(s[mb][2 * kk + 1][0], s[mb][2 * kk + 1][1]);
                    pa[mb][3] = pack2<BF>(s[mb][2 * kk + 1][2], s[mb][2 * kk + 1][3]);
                }
                /* tokens 16kk + (lane mod 8) + 8·(lane / 8 mod 2), chunk 2nd + lane / 16: the
                 * B fragments of output n-tiles 2nd and 2nd + 1 */
                const int tt = 16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
                for (int nd = 0; nd < KS; nd++) {
                    const int ch = 2 * nd + (lane >> 4);
                    uint32_t b[4];
                    ldsm4_t(vbase + tt * ROWB + ((ch ^ (tt & 7)) * 16), b);
#pragma unroll
                    for (int mb = 0; mb < MB; mb++) {
                        mma<BF>(o[mb][2 * nd], pa[mb], b[0], b[1]);
                        mma<BF>(o[mb][2 * nd + 1], pa[mb], b[2], b[3]);
                    }
                }
            }
        }
        if (Q8 && kt + 1 < n_kt) /* q8: the next tile decoded into the other stage (the other
                                  * CTAs of the SM compute meanwhile) */
            load(kt + 1);
        else if (!Q8)
            __syncthreads(); /* every warp done with the stage the next copies overwrite */
    }

#pragma unroll
    for (int mb = 0; mb < MB; mb++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float sum = l[mb][i];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            if (pos[mb][i] < 0)
                continue;
            const int r = 16 * (MB * warp + mb) + g + 8 * i;
            float *out = p.out + ((size_t)(tile.q0 + r / p.group) * p.n_heads +
                                  (size_t)kvh * p.group + r % p.group) * D;
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
            for (int n = 0; n < 2 * KS; n++)
                *reinterpret_cast<float2 *>(out + 8 * n + 2 * c) =
                    make_float2(o[mb][n][2 * i] * inv, o[mb][n][2 * i + 1] * inv);
        }
}

constexpr int WARPS = 4; /* a CTA's */

typedef void (*kernel_fn)(const Params);

template <int D, int MB> kernel_fn pick_format(enum llmem_kv_format f) {
    return f == LLMEM_KV_FORMAT_BF16  ? prefill_kernel<D, WARPS, MB, true, false>
           : f == LLMEM_KV_FORMAT_Q8 ? prefill_kernel<D, WARPS, MB, false, true>
                                     : prefill_kernel<D, WARPS, MB, false, false>;
}

template <int MB> kernel_fn pick(int head_dim, enum llmem_kv_format f) {
    return head_dim == 64 ? pick_format<64, MB>(f) : pick_format<128, MB>(f);
}

} // namespace

extern "C" int llmem_cuda_prefill_fits(enum llmem_kv_format format, int n_heads, int n_kv_heads,
                                       int head_dim, int block_size) {
    return (format == LLMEM_KV_FORMAT_F16 || format == LLMEM_KV_FORMAT_BF16 ||
            format == LLMEM_KV_FORMAT_Q8) &&
           (head_dim == 64 || head_dim == 128) && block_size == BLOCK && n_kv_heads > 0 &&
           n_heads % n_kv_heads == 0 && n_heads / n_kv_heads <= 64;
}

extern "C" int llmem_cuda_prefill_mblocks(int group, int n_kv_heads, int64_t queries) {
    /* read once (by the first of the threads): a malformed value is logged once, then chosen per
     * call */
    static const int forced = [] {
        int64_t v = 0;
        return llmem_option_int(LLMEM_OPT_CUDA_PREFILL_MBLOCKS, &v) == LLMEM_OK ? (int)v : 0;
    }();
    if (forced > 0)
        return forced;
    const int tq = llmem_cuda_prefill_tile_queries(group, 2);
    const int64_t ctas = tq > 0 ? (queries + tq - 1) / tq * n_kv_heads : 0;
    return ctas >= 4 * (int64_t)sm_count() ? 2 : 1;
}

extern "C" int llmem_cuda_prefill_tile_queries(int group, int mblocks) {
    return group > 0 ? 16 * WARPS * mblocks / group : 0;
}

extern "C" int llmem_cuda_prefill(const struct llmem_cuda_prefill *a) {
    const char *why = NULL;
    if (!llmem_cuda_prefill_fits(a->format, a->n_heads, a->n_kv_heads, a->head_dim, a->block_size))
        why = "shape (f16, bf16 or q8, head_dim 64 or 128, block_size 16, groups up to 64)";
    else if (a->n_tiles < 0 || a->n_tiles > 65535 || a->table_stride < 0)
        why = "n_tiles (at most 65535) or table_stride";
    else if (((uintptr_t)a->k_pool | (uintptr_t)a->v_pool) % 16 != 0 ||
             a->k_block_stride % 16 != 0 || a->v_block_stride % 16 != 0 ||
             (uintptr_t)a->q % 16 != 0 || (uintptr_t)a->out % 8 != 0)
        why = "alignment (pools, block strides and q on 16 bytes, out on 8)";
    else if (a->mblocks != 1 && a->mblocks != 2)
        why = "mblocks (1 or 2)";
    if (why != NULL) {
        LLMEM_ERROR_AS("llmem_cuda_prefill", "unsupported %s", why);
        return LLMEM_EINVAL;
    }
    if (a->n_tiles == 0)
        return LLMEM_OK;
    kernel_fn fn =
        a->mblocks == 2 ? pick<2>(a->head_dim, a->format) : pick<1>(a->head_dim, a->format);
    /* the queries' rows, then two stages of a tile's keys and values */
    const int smem = (16 * WARPS * a->mblocks + 2 * 2 * BN) * 2 * a->head_dim;
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    Params p;
    p.q = a->q;
    p.out = a->out;
    p.k_pool = (const uint8_t *)a->k_pool;
    p.v_pool = (const uint8_t *)a->v_pool;
    p.k_bstride = a->k_block_stride;
    p.v_bstride = a->v_block_stride;
    /* a head's row: 16-bit values, or q8's groups of 34 bytes */
    p.tok_bytes = a->n_kv_heads * (a->format == LLMEM_KV_FORMAT_Q8 ? 34 * a->head_dim / 32
                                                                   : 2 * a->head_dim);
    p.tables = a->block_tables;
    p.table_stride = a->table_stride;
    p.tiles = a->tiles;
    p.n_heads = a->n_heads;
    p.group = a->n_heads / a->n_kv_heads;
    const float scale = a->scale != 0.0f ? a->scale : 1.0f / sqrtf((float)a->head_dim);
    p.qscale = scale * LOG2E;
    if (err == cudaSuccess)
        err = pdl_launch((cudaStream_t)a->stream, fn, dim3((unsigned)a->n_kv_heads, a->n_tiles),
                         dim3(WARPS * 32), smem, p);
    if (err != cudaSuccess) {
        LLMEM_ERROR_AS("llmem_cuda_prefill", "launch: %s", cudaGetErrorString(err));
        return LLMEM_EIO;
    }
    return LLMEM_OK;
}
