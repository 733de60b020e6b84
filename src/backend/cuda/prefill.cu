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
 * the longest CTAs start first. On Hopper the 16-bit caches at head_dim 128 take the same scheme
 * on warpgroup products (prefill_wg_kernel, below).
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
constexpr int WG_STAGES = 3; /* prefill_wg_kernel's tiles of keys and values in shared memory */

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

/* Row r of a tile's (query, head) rows (query r / group, head r mod group of KV head kvh):
 * where it starts in q and out. */
template <int D>
__device__ __forceinline__ size_t row_at(const Params &p, const llmem_cuda_prefill_tile &tile,
                                         int kvh, int r) {
    return ((size_t)(tile.q0 + r / p.group) * p.n_heads + (size_t)kvh * p.group + r % p.group) * D;
}

/* 16-byte chunk ch of row r's query, scaled by scale · log2 e and rounded to the 16-bit type;
 * zeros past the tile's queries. */
template <int D, bool BF>
__device__ __forceinline__ uint4 query_chunk(const Params &p, const llmem_cuda_prefill_tile &tile,
                                             int kvh, int r, int ch) {
    if (r / p.group >= tile.n_q)
        return make_uint4(0, 0, 0, 0);
    const float *src = p.q + row_at<D>(p, tile, kvh, r) + 8 * ch;
    const float4 a = *reinterpret_cast<const float4 *>(src);
    const float4 b = *reinterpret_cast<const float4 *>(src + 4);
    return make_uint4(
        pack2<BF>(a.x * p.qscale, a.y * p.qscale), pack2<BF>(a.z * p.qscale, a.w * p.qscale),
        pack2<BF>(b.x * p.qscale, b.y * p.qscale), pack2<BF>(b.z * p.qscale, b.w * p.qscale));
}

/* Chunk ch of token t of KV head kvh (cache block blk) into shared memory at kd and vd: a
 * cp.async of 16 bytes each, zeros from `end` on. */
template <int D>
__device__ __forceinline__ void copy_chunk(const Params &p, int kvh, int t, int end, int ch,
                                           long long blk, uint32_t kd, uint32_t vd) {
    const bool in = t < end;
    if (!in)
        blk = 0;
    const size_t off = (size_t)(t % BLOCK) * p.tok_bytes + (size_t)kvh * 2 * D + ch * 16;
    cp_async16<false>(kd, p.k_pool + blk * p.k_bstride + off, in ? 16 : 0);
    cp_async16<false>(vd, p.v_pool + blk * p.v_bstride + off, in ? 16 : 0);
}

/* Copies of the keys and values of tokens t0 … t0 + TOKENS − 1 of KV head kvh (16-bit rows;
 * zeros from `end` on) into shared memory at kdst and vdst, chunk ch of token tt at at(tt, ch):
 * THREADS threads a 16-byte chunk at a time, as one cp.async group. The cache blocks from the
 * block table, or (PRE) from blocks[], the tile's blocks read ahead into registers: the loop then
 * unrolled, so that the thread's j-th copy, whose tokens lie in block (j · THREADS / NCH) / BLOCK
 * of the tile (THREADS / NCH and BLOCK powers of two), reads it from a register. */
template <int D, int TOKENS, int THREADS, bool PRE, class At>
__device__ __forceinline__ void copy_tile(const Params &p, const int32_t *table,
                                          const int32_t *blocks, int kvh, int t0, int end,
                                          uint32_t kdst, uint32_t vdst, At at) {
    constexpr int NCH = D / 8;
    if constexpr (PRE) {
        static_assert(TOKENS * NCH % THREADS == 0 &&
                          ((THREADS / NCH) % BLOCK == 0 || BLOCK % (THREADS / NCH) == 0),
                      "copy_tile's rounds of copies and the cache blocks");
#pragma unroll
        for (int j = 0; j < TOKENS * NCH / THREADS; j++) {
            const int i = threadIdx.x + j * THREADS;
            copy_chunk<D>(p, kvh, t0 + i / NCH, end, i % NCH, blocks[j * (THREADS / NCH) / BLOCK],
                          kdst + at(i / NCH, i % NCH), vdst + at(i / NCH, i % NCH));
        }
    } else {
        for (int i = threadIdx.x; i < TOKENS * NCH; i += THREADS) {
            const int t = t0 + i / NCH;
            copy_chunk<D>(p, kvh, t, end, i % NCH, t < end ? table[t / BLOCK] : 0,
                          kdst + at(i / NCH, i % NCH), vdst + at(i / NCH, i % NCH));
        }
    }
    cp_commit();
}

/* Scores of a warp's 16 rows by NT n-blocks of 8 tokens in the m16n8 accumulator layout (this
 * thread: rows g and g + 8 of each n-block, tokens t0 + 8nt + 2c and + 1): −∞ after each row's
 * position pos[i] (−1: a row past the tile). */
template <int NT>
__device__ __forceinline__ void causal_mask(float (*s)[4], int t0, int c, const int pos[2]) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (t0 + 8 * nt + 2 * c + (e & 1) > pos[e >> 1])
                s[nt][e] = -INFINITY;
}

/* The online softmax of row i (0: g, 1: g + 8) over a tile's scores, in base 2: the scores
 * become probabilities against the row's new maximum, m and l (its maximum and this thread's
 * share of the sum) move on, and the factor the output's row is rescaled by is returned. */
template <int NT>
__device__ __forceinline__ float softmax_row(float (*s)[4], int i, float &m, float &l) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
        mx = fmaxf(mx, fmaxf(s[nt][2 * i], s[nt][2 * i + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m, mx), base = mn == -INFINITY ? 0.0f : mn;
    const float corr = ex2(m - base);
    m = mn;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        s[nt][2 * i] = ex2(s[nt][2 * i] - base);
        s[nt][2 * i + 1] = ex2(s[nt][2 * i + 1] - base);
        sum += s[nt][2 * i] + s[nt][2 * i + 1];
    }
    l = l * corr + sum;
    return corr;
}

/* Row i of this thread's output (o: D / 8 n-blocks in the m16n8 layout) divided by the row's sum
 * (l: the thread's share, summed over its quad here) into out; nothing for a row past the tile
 * (pos −1). */
template <int D>
__device__ __forceinline__ void store_row(const float (*o)[4], int i, float l, int pos, int c,
                                          float *out) {
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (pos < 0)
        return;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int n = 0; n < D / 8; n++)
        *reinterpret_cast<float2 *>(out + 8 * n + 2 * c) =
            make_float2(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
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
            const uint32_t kdst = sbase + (kt & 1) * 2 * TILE;
            const auto at = [](int tt, int ch) { return tt * ROWB + ((ch ^ (tt & 7)) * 16); };
            copy_tile<D, BN, W * 32, false>(p, table, NULL, kvh, kt * BN, end, kdst, kdst + TILE,
                                            at);
        }
    };
    load(0);

    /* the queries, scaled by scale · log2 e and rounded, into shared memory (row r: query
     * r / group, head r mod group; chunks swizzled by the row); rows past the tile zero */
    for (int i = threadIdx.x; i < BM * NCH; i += W * 32) {
        const int r = i / NCH, ch = i % NCH;
        *reinterpret_cast<uint4 *>(smem + r * ROWB + ((ch ^ (r & 7)) * 16)) =
            query_chunk<D, BF>(p, tile, kvh, r, ch);
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
                    causal_mask<NT>(s[mb], t0, c, pos[mb]);
#pragma unroll
            for (int mb = 0; mb < MB; mb++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    const float corr = softmax_row<NT>(s[mb], i, m[mb][i], l[mb][i]);
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
            const int r = 16 * (MB * warp + mb) + g + 8 * i;
            store_row<D>(o[mb], i, l[mb][i], pos[mb][i], c, p.out + row_at<D>(p, tile, kvh, r));
        }
}

/* ---- Hopper: the same attention on warpgroup products (wgmma) ----------------------------------
 *
 * head_dim 128 and a 16-bit cache on a device of compute capability 9.0 (the sm_90a code). A CTA
 * of WG warpgroups takes 64·WG (query, head) rows, each warpgroup 64 of them (a warp 16, as in
 * prefill_kernel), and streams the tile's keys and values through shared memory BN tokens at a
 * time with the same copies, laid out as the warpgroup products read them: each operand in slabs
 * of 64 values (128 bytes a row), the 16-byte chunks of a row at chunk ^ (row mod 8) (the
 * hardware's 128-byte swizzle, slabs on 1024-byte boundaries). S = Q·Kᵀ takes both operands from
 * shared memory (K-major), O += P·V the probabilities from the score registers (the accumulator's
 * layout is mma.sync's m16n8 one per warp, so the softmax and the packing are prefill_kernel's)
 * and V as stored (N-major, transposed by the product). The products are asynchronous, and a
 * warpgroup keeps the tensor cores busy through its softmax: each step issues the next tile's
 * scores, then this tile's P·V, waits for the scores alone and makes them probabilities while P·V
 * runs, then rescales the output. Three stages of tiles in shared memory: while step kt reads
 * tiles kt and kt + 1, tile kt + 2's copies land in the stage step kt − 1 finished with. */

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) /* (the helpers of the sm_90a image's kernels) */
/* A shared-memory operand: its start, the byte offsets between its 64-value slabs (lead, read
 * only by N-major operands) and between its groups of 8 rows (stride), 128-byte swizzle. */
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lead, uint32_t stride) {
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | (uint64_t)((lead & 0x3FFFFu) >> 4) << 16 |
           (uint64_t)((stride & 0x3FFFFu) >> 4) << 32 | 1ull << 62;
}

/* The order between the threads' register accesses and the asynchronous products, and their
 * completion. */
__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
/* (at most N of the groups committed last still pending) */
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* The threads' shared-memory writes (cp.async, stores) made visible to the products. */
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
/* Registers the compiler must treat as written here: the products' accumulators and A operands
 * are read and written asynchronously, between the issue and the wait. */
template <int N> __device__ __forceinline__ void wg_keep(float *r) {
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void wg_keep(uint32_t *r) {
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+r"(r[i])::"memory");
}

#define WG_D8(i)                                                                                   \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),    \
        "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_D32 WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24)
#define WG_D64 WG_D32, WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56)
#define WG_R32                                                                                     \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_R64                                                                                     \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "   \
    "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "   \
    "%56, %57, %58, %59, %60, %61, %62, %63}"
/* (A, B, P: the operand numbers of a, b and accumulate, after the N / 2 of d) */
#define WG_SS(N, T, R, DL, A, B, P)                                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                                  \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." T "." T " " R ", %" #A          \
                 ", %" #B ", p, 1, 1, 0, 0;\n}\n"                                                  \
                 : DL                                                                              \
                 : "l"(a), "l"(b), "r"(accumulate))

/* d (64 × N, f32) = (accumulate ? d : 0) + a·b: a (64 × 16) and b (16 × N) in shared memory,
 * K-major. */
template <int N, bool BF>
__device__ __forceinline__ void wgmma_ss(float *d, uint64_t a, uint64_t b, int accumulate) {
    static_assert(N == 64 || N == 128, "wgmma_ss's shapes");
    if constexpr (N == 64 && BF)
        WG_SS(64, "bf16", WG_R32, WG_D32, 32, 33, 34);
    else if constexpr (N == 64)
        WG_SS(64, "f16", WG_R32, WG_D32, 32, 33, 34);
    else if constexpr (BF)
        WG_SS(128, "bf16", WG_R64, WG_D64, 64, 65, 66);
    else
        WG_SS(128, "f16", WG_R64, WG_D64, 64, 65, 66);
}

/* d (64 × 128, f32) += a·b: a (64 × 16) in registers (mma.sync's A fragment per warp), b (16 ×
 * 128) in shared memory, N-major. */
template <bool BF>
__device__ __forceinline__ void wgmma_rs(float *d, const uint32_t a[4], uint64_t b) {
    if constexpr (BF)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WG_R64
                     ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                     : WG_D64
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
    else
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " WG_R64
                     ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                     : WG_D64
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
#endif

/* 1 in the image built for sm_90a (the one whose kernels below hold the products), else 0. */
__device__ int wg_built =
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    1;
#else
    0;
#endif

template <int WG, int BN, bool BF>
__global__ void __launch_bounds__(WG * 128, 1) prefill_wg_kernel(const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int D = 128, NCH = D / 8, BM = 64 * WG;
    constexpr int QSLAB = BM * 128; /* bytes of a slab of the queries */
    constexpr int SLAB = BN * 128;  /* of a slab of a tile's keys (or values) */
    constexpr int TILE = 2 * SLAB;  /* of a tile's keys (or values) */
    constexpr int NT = BN / 8;      /* n-blocks of 8 of the scores */
    extern __shared__ uint8_t smem_raw[]; /* the queries, then WG_STAGES of [K | V] */
    const uint32_t raw = smem_addr(smem_raw), qbase = (raw + 1023u) & ~1023u;
    uint8_t *const smem = smem_raw + (qbase - raw);
    const uint32_t sbase = qbase + 2 * QSLAB;
    const int wg = threadIdx.x / 128, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = lane % 4;

    pdl_begin();
    const llmem_cuda_prefill_tile tile = p.tiles[blockIdx.y];
    const int kvh = blockIdx.x;
    const int32_t *table = p.tables + (size_t)tile.table * p.table_stride;
    const int end = tile.pos + tile.n_q; /* tokens the tile's last query sees */
    const int n_kt = (end + BN - 1) / BN;

    const auto stage = [&](int kt) { return sbase + (kt % WG_STAGES) * 2 * TILE; };
    /* the cache blocks of a tile, read ahead of its copies (whose addresses would otherwise wait
     * on these loads, with the warp's softmax behind them) */
    int32_t blocks[BN / BLOCK];
    const auto fetch = [&](int kt) {
#pragma unroll
        for (int b = 0; b < BN / BLOCK; b++)
            blocks[b] = kt * BN + b * BLOCK < end ? table[kt * BN / BLOCK + b] : 0;
    };
    const auto load = [&](int kt) {
        const uint32_t kdst = stage(kt);
        const auto at = [](int tt, int ch) {
            return (ch / 8) * SLAB + tt * 128 + ((ch % 8) ^ (tt & 7)) * 16;
        };
        copy_tile<D, BN, WG * 128, true>(p, table, blocks, kvh, kt * BN, end, kdst, kdst + TILE,
                                         at);
    };
    fetch(0);
    load(0);
    if (n_kt > 1)
        fetch(1), load(1);
    else
        cp_commit(); /* (an empty group: tile 0's is then always the older of two) */

    /* the queries as prefill_kernel rounds them, in the slabs */
    for (int i = threadIdx.x; i < BM * NCH; i += WG * 128) {
        const int r = i / NCH, ch = i % NCH;
        *reinterpret_cast<uint4 *>(smem + (ch / 8) * QSLAB + r * 128 + ((ch % 8) ^ (r & 7)) * 16) =
            query_chunk<D, BF>(p, tile, kvh, r, ch);
    }

    /* this thread's rows g and g + 8 of its warp's 16: position (−1: none); the warpgroup's
     * first and last query (the same in its every thread: its products are collective) and the
     * tiles it sees a token of */
    const int row0 = 64 * wg + 16 * warp + g;
    int pos[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int qi = (row0 + 8 * i) / p.group;
        pos[i] = qi < tile.n_q ? tile.pos + qi : -1;
    }
    const int q_first = 64 * wg / p.group, q_last = min(tile.n_q - 1, (64 * wg + 63) / p.group);
    const int lo = tile.pos + q_first, hi = tile.pos + q_last;
    const int wg_kt = q_first < tile.n_q ? min(n_kt, hi / BN + 1) : 0;

    float o[D / 2]; /* n-block nd (dims 8nd …): o[4nd … 4nd + 3], as mma.sync's */
#pragma unroll
    for (int i = 0; i < D / 2; i++)
        o[i] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float s[BN / 2];
    float(*const s4)[4] = reinterpret_cast<float(*)[4]>(s);
    uint32_t pa[BN / 16][4]; /* the probabilities of tokens 16kk … 16kk + 15 as A fragments */

    /* S = Q·Kᵀ of tile kt, issued */
    const auto scores = [&](int kt) {
        const uint32_t kbase = stage(kt);
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++)
            wgmma_ss<BN, BF>(
                s, wg_desc(qbase + (ks / 4) * QSLAB + wg * 64 * 128 + (ks % 4) * 32, 16, 1024),
                wg_desc(kbase + (ks / 4) * SLAB + (ks % 4) * 32, 16, 1024), ks > 0);
        wg_commit();
    };
    /* tile kt's scores masked and made probabilities; the output's factors returned in corr */
    const auto softmax = [&](int kt, float corr[2]) {
        const int t0 = kt * BN;
        if (lo < t0 + BN - 1) /* some row's position inside the tile */
            causal_mask<NT>(s4, t0, c, pos);
#pragma unroll
        for (int i = 0; i < 2; i++)
            corr[i] = softmax_row<NT>(s4, i, m[i], l[i]);
    };
    const auto pack = [&] {
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                pa[kk][j] = pack2<BF>(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
    };

    cp_wait<1>();
    fence_proxy_async();
    __syncthreads(); /* the queries and tile 0 for every warpgroup */
    if (wg_kt > 0) {
        float corr[2];
        wg_fence();
        scores(0);
        wg_wait<0>();
        wg_keep<BN / 2>(s);
        softmax(0, corr); /* (the output is still 0) */
        pack();
    }

    /* Step kt: O += P·V of tile kt, issued behind the next tile's scores, whose softmax then
     * runs while the tensor cores work on that product. Tile kt + 2's copies go to the stage
     * step kt − 1's product read, which every warpgroup finished before this step's barrier. */
    for (int kt = 0; kt < n_kt; kt++) {
        if (kt + 2 < n_kt)
            fetch(kt + 2);
        cp_wait<0>();
        fence_proxy_async();
        __syncthreads(); /* tile kt + 1 for every warpgroup, and step kt − 1 done by each */
        const auto load_next = [&] { /* (behind the products' issue) */
            if (kt + 2 < n_kt)
                load(kt + 2);
        };
        const uint32_t vbase = stage(kt) + TILE;
        const auto values = [&] {
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++)
                wgmma_rs<BF>(o, pa[kk], wg_desc(vbase + kk * 16 * 128, SLAB, 1024));
            wg_commit();
        };
        if (kt + 1 < wg_kt) {
            wg_keep<BN / 4>(&pa[0][0]);
            wg_keep<D / 2>(o);
            wg_fence();
            scores(kt + 1);
            values();
            load_next();
            wg_wait<1>(); /* the scores (committed first) */
            wg_keep<BN / 2>(s);
            float corr[2];
            softmax(kt + 1, corr);
            wg_wait<0>();
            wg_keep<D / 2>(o);
            wg_keep<BN / 4>(&pa[0][0]);
#pragma unroll
            for (int nd = 0; nd < D / 8; nd++)
#pragma unroll
                for (int i = 0; i < 2; i++)
                    o[4 * nd + 2 * i] *= corr[i], o[4 * nd + 2 * i + 1] *= corr[i];
            pack();
        } else if (kt + 1 == wg_kt) { /* the warpgroup's last tile */
            wg_keep<BN / 4>(&pa[0][0]);
            wg_keep<D / 2>(o);
            wg_fence();
            values();
            load_next();
            wg_wait<0>();
            wg_keep<D / 2>(o);
        } else {
            load_next();
        }
    }

#pragma unroll
    for (int i = 0; i < 2; i++)
        store_row<D>(reinterpret_cast<const float(*)[4]>(o), i, l[i], pos[i], c,
                     p.out + row_at<D>(p, tile, kvh, row0 + 8 * i));
#else
    (void)p;
    __trap(); /* (never launched: wg_built is 0 in this image) */
#endif
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

/* Whether the current device runs the sm_90a image's warpgroup kernels (asked once per device, by
 * any of the threads that drive devices). */
static bool wgmma_device() {
    static int cached[64]; /* 0: not asked, 1: no, 2: yes */
    int dev = 0, v;
    if (cudaGetDevice(&dev) != cudaSuccess)
        return false;
    if (dev >= 0 && dev < 64 && (v = __atomic_load_n(&cached[dev], __ATOMIC_RELAXED)) > 0)
        return v == 2;
    int major = 0, minor = 0, built = 0;
    const bool yes = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) ==
                         cudaSuccess &&
                     cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) ==
                         cudaSuccess &&
                     major == 9 && minor == 0 &&
                     cudaMemcpyFromSymbol(&built, wg_built, sizeof(built)) == cudaSuccess &&
                     built == 1;
    if (dev >= 0 && dev < 64)
        __atomic_store_n(&cached[dev], yes ? 2 : 1, __ATOMIC_RELAXED);
    return yes;
}

extern "C" int llmem_cuda_prefill_wgmma(enum llmem_kv_format format, int head_dim) {
    static const int on = [] { /* read once, as the m-blocks */
        int v = 0;
        return llmem_option_bool(LLMEM_OPT_CUDA_PREFILL_WGMMA, &v) == LLMEM_OK ? v : 0;
    }();
    return on && head_dim == 128 &&
           (format == LLMEM_KV_FORMAT_F16 || format == LLMEM_KV_FORMAT_BF16) && wgmma_device();
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
    kernel_fn fn;
    int smem, threads = WARPS * 32;
    if (!a->warp_mma && llmem_cuda_prefill_wgmma(a->format, a->head_dim)) {
        /* a warpgroup per 64 rows: two with tiles of 128 tokens, one with tiles of 64; the
         * queries' rows, then WG_STAGES of a tile's keys and values, from 1024 bytes on */
        const bool bf = a->format == LLMEM_KV_FORMAT_BF16;
        if (a->mblocks == 2)
            fn = bf ? prefill_wg_kernel<2, 128, true> : prefill_wg_kernel<2, 128, false>;
        else
            fn = bf ? prefill_wg_kernel<1, 64, true> : prefill_wg_kernel<1, 64, false>;
        const int bn = a->mblocks == 2 ? 128 : 64;
        smem = 1024 + (64 * a->mblocks + WG_STAGES * 2 * bn) * 2 * a->head_dim;
        threads = 128 * a->mblocks;
    } else {
        fn = a->mblocks == 2 ? pick<2>(a->head_dim, a->format) : pick<1>(a->head_dim, a->format);
        /* the queries' rows, then two stages of a tile's keys and values */
        smem = (16 * WARPS * a->mblocks + 2 * 2 * BN) * 2 * a->head_dim;
    }
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
                         dim3(threads), smem, p);
    if (err != cudaSuccess) {
        LLMEM_ERROR_AS("llmem_cuda_prefill", "launch: %s", cudaGetErrorString(err));
        return LLMEM_EIO;
    }
    return LLMEM_OK;
}
