/*
 * backend/cuda/attention.cu — paged decode attention (split-K, GQA-aware, q8 decoded in-kernel on
 * tensor cores; q4 and tq on CUDA cores, see rows_kernel).
 *
 * Work: one warp per (sequence, KV head, split of the context); for the queries of a prefill chunk
 * (one table), one warp per (pack of up to 8 / group queries, KV head, split), its rows the pack's
 * (query, head) slots, so that a block's K and V are read once for the pack. The warp streams its
 * split's blocks, 16 tokens at a time, into a ring of shared-memory stages with 16-byte cp.async,
 * STAGES − 1 blocks ahead of the one it computes, and keeps an online softmax (m, l, acc) for the
 * query heads of its GQA group. Every KV row is read from memory once for all of them. 16-bit rows
 * are copied by their warp into its own ring, around L1. q8 rows (34 bytes a group) are not
 * 16-byte aligned: when the KV heads come in fours, a CTA's four warps take four consecutive heads
 * of the same tokens and copy their rows of each token as one aligned span into a ring they share
 * (a barrier a block); otherwise each warp copies its rows from the 16-byte boundary below them,
 * through L1, which serves the edges its neighbour's rows share (see Geo).
 *
 * The arithmetic is on tensor cores (mma.m16n8k16, f32 accumulate), with the query heads as the
 * 16 rows: row h holds query head h (h < group ≤ 8) rounded to 16 bits, row 8 + h the rounding's
 * remainder, so scores carry ~16 significant bits of the f32 query, and in the value product the
 * same split of the probabilities. Scores S = Q·Kᵀ per 8 tokens (K as the B operand: the k index
 * is permuted so that each thread reads 8 consecutive elements of one key row, and the query is
 * laid out the same way); then Oᵀ += Vᵀ·Pᵀ, dims as the rows (V as the A operand: ldmatrix.trans
 * for 16-bit formats, q8 interleaves two tokens' codes per register) and the probabilities, taken
 * straight from the score fragments, as the B operand (with ≤ 4 heads their remainders ride in
 * columns 4..7 of the same product).
 * q8 keys are used as stored, on int8 tensor cores (mma.m16n8k32, one k-step a group) against
 * the query in int8 steps (row h) and 254ths of a step (row 8 + h), each group's int32 sums times
 * its scale; q8 value codes become f16 exactly (magic-number conversion), times the group's f16
 * scale rounded to f16 (relative 2⁻¹²); bf16 keys and values are used as stored.
 * 16-bit rows are stored in shared memory with their 16-byte chunks swizzled by the token (chunk ^
 * f(token)), so that the key reads (8 tokens × 4 chunks) and the transposed value reads (8 tokens ×
 * 1 chunk) both hit 32 distinct banks.
 *
 * Splits: when there is more than one, each warp writes its unnormalized (acc, m, l), acc in the
 * order of its m-tiles (whole sectors a store), and the splits of a sequence are merged
 * (out = Σ e^(m_s − M)·acc_s / Σ e^(m_s − M)·l_s, q8's dims put back in order): by the warp
 * that finishes the last of them when it has few rows to read (merge_if_last, given
 * counters, see fused()), otherwise by a second kernel.
 * The split length is chosen so that the warps fill the GPU in whole waves.
 * A warp asks for the query and the first blocks' table entries before its first copies, so
 * that their loads do not queue behind those copies, and reads each table entry a block ahead.
 */
#include <mutex>
#include "backend/cuda/attention.h"
#include "backend/cuda/kv.h"
#include "backend/cuda/launch.h"
#include "backend/cuda/tc.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/log.h"
#include "core/options.h"

namespace {

constexpr int BLOCK = 16; /* tokens per KV block */
constexpr int WARPS = 4;  /* warps per CTA, each with its own work item and stages */
constexpr int MAX_GROUP = 8;
constexpr float LOG2E = 1.4426950408889634f;

enum Fmt { FMT_F16 = 0, FMT_BF16 = 1, FMT_Q8 = 2, FMT_Q4 = 3, FMT_TQ = 4 };

/* Bytes of one head's row, the 16-byte chunks copied a token and the token stride in shared
 * memory, per stage and per ring (of STAGES stages). A warp that copies its own rows (COOP false)
 * takes each row alone: a q8 row (34 bytes a group) starts on 4, 8 or 16 bytes, so its copy starts
 * at the 16-byte boundary below it and in shared memory the row begins `shift` bytes into its slot
 * (the bytes around it belong to the neighbouring heads' rows). The CTA's warps copying together
 * (COOP: consecutive KV heads of the same tokens) take their WARPS rows of a token as one
 * contiguous span, 16-byte aligned: whole cache lines, none read twice. */
template <int FMT, int D, bool COOP = false> struct Geo {
    static constexpr int ROW = FMT == FMT_Q8 ? 34 * D / 32 : 2 * D;
    static constexpr int ALIGN = ROW % 16 == 0 ? 16 : ROW % 8 == 0 ? 8 : 4;
    static constexpr int NCH = COOP            ? WARPS * ROW / 16
                               : FMT == FMT_Q8 ? (ROW + 16 - ALIGN + 15) / 16
                                               : ROW / 16;
    static constexpr int SROW = 16 * NCH;
    static constexpr int STAGE = 2 * BLOCK * SROW;         /* K rows, then V rows */
    static constexpr int THREADS = COOP ? WARPS * 32 : 32; /* that copy a stage */
    static constexpr int CTA_BYTES_PER_STAGE = COOP ? STAGE : WARPS * STAGE;
    static_assert(!COOP || (WARPS * ROW) % 16 == 0, "a span of whole 16-byte chunks");
    /* 16-bit rows are whole lines already: sharing their stages measured 1–2 % slower */
    static_assert(!COOP || FMT == FMT_Q8, "shared stages for q8 alone");
};

struct Params {
    const void *q;
    int q_bf16;
    const uint8_t *k_pool, *v_pool;
    long long block_stride;
    const int32_t *tables;
    const int32_t *table_ids;
    int table_stride;
    int table_len; /* entries of a table row that may be read: table_stride, or max_len's blocks */
    const int32_t *lengths;
    int fresh; /* llmem_cuda_attn's */
    float *out;
    float *part_acc; /* [batch, n_heads, n_splits, D], each D in m-tile order (merge_dim) */
    float2 *part_ml; /* [batch, n_heads, n_splits] */
    int n_heads, n_kv, group;
    int split_len, n_splits;
    long long n_items;
    int n_queries;            /* the batch */
    int pack;                 /* queries a warp takes (≥ 1) */
    const int32_t *packs;     /* the first query of each warp's pack (NULL: multiples of pack) */
    float qscale;             /* scale · log2(e): scores in base 2 */
    long long v_block_stride; /* rows_kernel: the value pool's block_stride */
    unsigned *counts;         /* per unit (merge_if_last); NULL: merge_kernel merges the splits */
    struct llmem_backend_kv_rotation rot; /* rows_kernel: queries rotated, outputs turned back */
};

/* ---- small device helpers ------------------------------------------------------------------ */

__device__ __forceinline__ uint32_t lds32(const uint8_t *p) {
    return *reinterpret_cast<const uint32_t *>(p);
}

/* The swizzled position of 16-byte chunk `ch` of a 16-bit row of token t (a bijection of the low
 * three bits that differs in bit 2 between consecutive tokens). */
__device__ __forceinline__ int swz(int ch, int t) {
    return ch ^ (((t & 1) << 2) | ((t >> 1) & 3));
}

/* D = A·B on int8 tensor cores (m16n8k32, s32 accumulated from zero). */
__device__ __forceinline__ void imma(int d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

/* Two floats rounded to the 16-bit type (hi) and their remainders rounded again (lo). */
template <bool BF>
__device__ __forceinline__ void split2(float x, float y, uint32_t &hi, uint32_t &lo) {
    if constexpr (BF) {
        __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
        float2 hf = __bfloat1622float2(h);
        __nv_bfloat162 l = __floats2bfloat162_rn(x - hf.x, y - hf.y);
        hi = *reinterpret_cast<uint32_t *>(&h);
        lo = *reinterpret_cast<uint32_t *>(&l);
    } else {
        __half2 h = __floats2half2_rn(x, y);
        float2 hf = __half22float2(h);
        __half2 l = __floats2half2_rn(x - hf.x, y - hf.y);
        hi = *reinterpret_cast<uint32_t *>(&h);
        lo = *reinterpret_cast<uint32_t *>(&l);
    }
}

/* Two int8 codes (bytes `sel` picks of x, already xor 0x80) as f16, times the f16 scales s2. */
__device__ __forceinline__ uint32_t dequant2(uint32_t x, uint32_t sel, __half2 s2) {
    uint32_t h = __byte_perm(x, 0x64646464u, sel); /* 1024 + code + 128, exact */
    __half2 v = __hsub2(*reinterpret_cast<__half2 *>(&h), __float2half2_rn(1152.0f));
    v = __hmul2(v, s2);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* ---- the decode kernel --------------------------------------------------------------------- */

/* A thread's share of copying a block's rows into a stage, the same for every block (the pools
 * and block_stride are 16-byte aligned): for each of its 16-byte chunks the source offset from the
 * first copied row of the block, and (token << 16) | destination offset in the stage. */
template <int FMT, int D, bool COOP> struct CopyPlan {
    using G = Geo<FMT, D, COOP>;
    static constexpr int TOTAL = BLOCK * G::NCH;
    static constexpr int N = (TOTAL + G::THREADS - 1) / G::THREADS;
    int32_t src[N]; /* q8 alone: the first chunk of token 0 may start before it */
    uint32_t dst[N];

    __device__ __forceinline__ CopyPlan(int tok_stride, size_t head_off, int tid) {
#pragma unroll
        for (int k = 0; k < N; k++) {
            const int i = G::THREADS * k + tid;
            const int t = i / G::NCH, ch = i % G::NCH;
            int32_t off = t * tok_stride;
            if (FMT == FMT_Q8 && !COOP) /* from the 16-byte boundary below the row */
                off -= (int32_t)((head_off + (size_t)off) & 15);
            src[k] = off + ch * 16;
            const int at = (FMT == FMT_Q8 ? ch : swz(ch, t)) * 16;
            dst[k] = ((uint32_t)t << 16) | (uint32_t)(t * G::SROW + at);
        }
    }

    /* Copies the block's K and V rows into the stage at `stage`; tokens ≥ n_valid are zeroed. */
    __device__ __forceinline__ void load(uint32_t stage, const uint8_t *kblk, long long v_minus_k,
                                         int n_valid, int tid) const {
        const uint32_t lim = (uint32_t)min(n_valid, BLOCK) << 16;
#pragma unroll
        for (int k = 0; k < N; k++) {
            if (TOTAL % G::THREADS == 0 || k < N - 1 || tid < TOTAL - G::THREADS * (N - 1)) {
                const int n = dst[k] < lim ? 16 : 0;
                const uint32_t d = stage + (dst[k] & 0xffffu);
                const uint8_t *src_k = kblk + src[k];
                /* a q8 row alone shares its edge sectors with the next warp's: through L1 */
                constexpr bool L1 = FMT == FMT_Q8 && !COOP;
                cp_async16<L1>(d, src_k, n);
                cp_async16<L1>(d + BLOCK * G::SROW, src_k + v_minus_k, n);
            }
        }
    }
};

/* The B operand of two k-steps of S = Q·Kᵀ (16-bit formats): 8 consecutive elements [32p + 8c,
 * +8) of the key row of token t, as four registers of two 16-bit values. */
__device__ __forceinline__ void load_k(const uint8_t *row, int t, int p, int c, uint32_t kb[4]) {
    uint4 v = *reinterpret_cast<const uint4 *>(row + swz(4 * p + c, t) * 16);
    kb[0] = v.x;
    kb[1] = v.y;
    kb[2] = v.z;
    kb[3] = v.w;
}

/* The B operand of S = Q·Kᵀ for q8 (one int8 k-step: group p): the codes [32p + 8c, +8) of a key
 * row, as stored, in two words. A group is 34 bytes (32 codes, then its f16 scale), so odd groups
 * start 2 bytes past a word. */
__device__ __forceinline__ void load_k_codes(const uint8_t *row, int p, int c, uint32_t &w0,
                                             uint32_t &w1) {
    const int o = 34 * p + 8 * c;
    if ((p & 1) == 0) {
        w0 = lds32(row + o);
        w1 = lds32(row + o + 4);
    } else {
        uint32_t a = lds32(row + o - 2), b = lds32(row + o + 2), d = lds32(row + o + 6);
        w0 = __byte_perm(a, b, 0x5432);
        w1 = __byte_perm(b, d, 0x5432);
    }
}

/* E = D/8 bytes of a q8 value row as E/4 words, from `base` (4-byte aligned) on, each word taken
 * `sel` bytes in (0x3210: none, 0x5432: two). */
template <int E>
__device__ __forceinline__ void load_q8_run(const uint8_t *base, uint32_t sel, uint32_t w[E / 4]) {
    uint32_t prev = lds32(base);
#pragma unroll
    for (int i = 0; i < E / 4; i++) {
        uint32_t next = lds32(base + 4 * (i + 1));
        w[i] = __byte_perm(prev, next, sel);
        prev = next;
    }
}

/* A warp's work item: KV heads vary fastest (neighbouring warps read neighbouring rows of the
 * same tokens), then the splits of the context, then the packs of queries; q0 is the pack's first
 * query and tab0 its table. */
struct WorkItem {
    int kvh, split, q0, tab0;
    int unit; /* the pack and KV head: the warps of its splits merge through counts[unit] */
};

__device__ __forceinline__ WorkItem work_item(const Params &p, long long item) {
    WorkItem w;
    w.kvh = (int)(item % p.n_kv);
    const long long rest = item / p.n_kv;
    w.split = (int)(rest % p.n_splits);
    const int pk = (int)(rest / p.n_splits);
    w.unit = pk * p.n_kv + w.kvh;
    w.q0 = p.packs != nullptr ? p.packs[pk] : pk * p.pack;
    w.tab0 = p.table_ids != nullptr ? p.table_ids[w.q0] : w.q0;
    return w;
}

/* The query of a pack's slot s (its head s mod group of query q0 + s / group): −1 past the pack
 * or the batch, or for a query of another table. */
__device__ __forceinline__ int pack_query(const Params &p, const WorkItem &w, int s) {
    const int q = w.q0 + s / p.group;
    if (s >= p.pack * p.group || q >= p.n_queries)
        return -1;
    const bool same =
        p.table_ids != nullptr ? p.table_ids[q] == w.tab0 : p.table_stride == 0 || q == w.q0;
    return same ? q : -1;
}

/* The dim of position x of a partial (16·mt + 8·row8 + r: the decode kernel's m-tile order): x
 * itself for 16-bit formats; for q8, whose thread r holds dims [E·r, E·r + E) (E = D/8), dim
 * E·r + (D/16)·row8 + mt. */
__device__ __forceinline__ int merge_dim(int x, int D, bool q8) {
    return q8 ? (D / 8) * (x & 7) + (D / 16) * ((x >> 3) & 1) + (x >> 4) : x;
}

/* The merge of a unit's splits inside the kernel, when counts is set (fused()): each
 * warp, once its lanes' partials are stored, counts itself in counts[w.unit] (last_of_unit), and
 * the warp that counts last merges the unit's slots as merge_kernel does (merge_unit), reading the
 * partials from L2 (other SMs wrote them), and sets the count back to 0 for the next call. */
__device__ __forceinline__ bool last_of_unit(const Params &p, const WorkItem &w, int lane) {
    /* the lanes' partials before lane 0's count: the barrier orders them before the atomic's
     * release, whose acquire in the last warp orders them before its reads */
    __syncwarp();
    unsigned before = 0;
    if (lane == 0)
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                     : "=r"(before)
                     : "l"(p.counts + w.unit)
                     : "memory");
    before = __shfl_sync(0xffffffffu, before, 0);
    if (before != (unsigned)p.n_splits - 1)
        return false;
    if (lane == 0)
        p.counts[w.unit] = 0;
    __syncwarp(); /* the other lanes' reads after lane 0's acquire */
    return true;
}

/* SL: slots the warp takes at most (the loads in flight are shared among them); Q8: partials in
 * the tensor-core kernel's m-tile order, q8's dims put back (merge_dim). */
template <int D, int SL, bool Q8>
__device__ __forceinline__ void merge_unit(const Params &p, const WorkItem &w, int lane) {
    /* a row of D floats is Q float4s; a warp load takes R rows, QL float4s of a row a lane */
    constexpr int Q = D / 4, R = Q >= 32 ? 1 : 32 / Q, QL = Q >= 32 ? Q / 32 : 1;
    constexpr int U = 8 / (SL * QL) > 0 ? 8 / (SL * QL) : 1; /* loads in flight: U·SL·QL */
    const int ro = Q >= 32 ? 0 : lane / Q, quad = Q >= 32 ? lane : lane % Q;
    const int S = p.pack * p.group;
    /* Each load below is asked for before any is used, so each round costs one trip to L2. Past
     * a slot's splits (or for a slot without a query) a lane reads a row of the workspace that
     * exists and drops what it read. */
    size_t bh[SL];
    int ns[SL], most = 0;
    float2 ml[SL];
#pragma unroll
    for (int s = 0; s < SL; s++) {
        const int q = s < S ? pack_query(p, w, s) : -1;
        const int len = q >= 0 ? p.lengths[q] : 0;
        ns[s] = q >= 0 ? min(p.n_splits, (len + p.split_len - 1) / p.split_len) : -1;
        bh[s] = q >= 0 ? (size_t)q * p.n_heads + w.kvh * p.group + s % p.group : 0;
        most = max(most, ns[s]);
        ml[s] = __ldcg(p.part_ml + bh[s] * p.n_splits + min(lane, p.n_splits - 1));
    }
    /* lane j's split: its weight e^(m_j − M); the sum of weights times l */
    float wt[SL], inv[SL];
#pragma unroll
    for (int s = 0; s < SL; s++) {
        const float2 e = lane < ns[s] ? ml[s] : make_float2(-INFINITY, 0.0f);
        float mx = e.x;
#pragma unroll
        for (int o = 16; o > 0; o /= 2)
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        wt[s] = lane < ns[s] && mx > -INFINITY ? exp2f(e.x - mx) : 0.0f;
        float sum = wt[s] * e.y;
#pragma unroll
        for (int o = 16; o > 0; o /= 2)
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
        inv[s] = sum > 0.0f ? 1.0f / sum : 0.0f;
    }
    float4 acc[SL][QL];
#pragma unroll
    for (int s = 0; s < SL; s++)
#pragma unroll
        for (int k = 0; k < QL; k++)
            acc[s][k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int j0 = 0; j0 < most; j0 += R * U) {
        float4 a[U][SL][QL];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int s = 0; s < SL; s++)
#pragma unroll
                for (int k = 0; k < QL; k++)
                    a[u][s][k] = __ldcg(reinterpret_cast<const float4 *>(
                        p.part_acc +
                        (bh[s] * p.n_splits + min(j0 + R * u + ro, p.n_splits - 1)) * D +
                        4 * (quad + 32 * k)));
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int j = j0 + R * u + ro;
#pragma unroll
            for (int s = 0; s < SL; s++) {
                const float x = __shfl_sync(0xffffffffu, wt[s], j & 31);
#pragma unroll
                for (int k = 0; k < QL; k++) {
                    const float4 v = j < ns[s] ? a[u][s][k] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    acc[s][k].x += x * v.x, acc[s][k].y += x * v.y;
                    acc[s][k].z += x * v.z, acc[s][k].w += x * v.w;
                }
            }
        }
    }
#pragma unroll
    for (int s = 0; s < SL; s++) {
#pragma unroll
        for (int k = 0; k < QL; k++)
#pragma unroll
            for (int o = Q; o < 32; o *= 2) { /* the rows a warp load took together */
                acc[s][k].x += __shfl_xor_sync(0xffffffffu, acc[s][k].x, o);
                acc[s][k].y += __shfl_xor_sync(0xffffffffu, acc[s][k].y, o);
                acc[s][k].z += __shfl_xor_sync(0xffffffffu, acc[s][k].z, o);
                acc[s][k].w += __shfl_xor_sync(0xffffffffu, acc[s][k].w, o);
            }
        if (ns[s] < 0 || ro != 0)
            continue;
#pragma unroll
        for (int k = 0; k < QL; k++) {
            const int x = 4 * (quad + 32 * k);
            const float4 a = acc[s][k];
            float *ob = p.out + bh[s] * D;
            if (Q8) {
                ob[merge_dim(x, D, true)] = a.x * inv[s];
                ob[merge_dim(x + 1, D, true)] = a.y * inv[s];
                ob[merge_dim(x + 2, D, true)] = a.z * inv[s];
                ob[merge_dim(x + 3, D, true)] = a.w * inv[s];
            } else {
                *reinterpret_cast<float4 *>(ob + x) =
                    make_float4(a.x * inv[s], a.y * inv[s], a.z * inv[s], a.w * inv[s]);
            }
        }
    }
}

/* x, computed once: the compiler may not recompute it in a loop (offsets kept in registers rather
 * than rebuilt from the lane index every block). */
__device__ __forceinline__ int opaque(int x) {
    asm volatile("" : "+r"(x));
    return x;
}

/* The tensor-core kernel's merge (counts set): 4 slots (a decode step's group of 4), or 8. */
template <int FMT, int D>
__device__ __forceinline__ void merge_if_last(const Params &p, const WorkItem &w, int lane) {
    if (p.counts == nullptr || !last_of_unit(p, w, lane))
        return;
    if (p.pack * p.group <= 4)
        merge_unit<D, 4, FMT == FMT_Q8>(p, w, lane);
    else
        merge_unit<D, MAX_GROUP, FMT == FMT_Q8>(p, w, lane);
}

/* MINB: CTAs per SM the registers must allow. COOP: the CTA's warps take consecutive KV heads of
 * the same tokens (n_kv a multiple of WARPS) and share their stages (see Geo). */
template <int FMT, int D, int STAGES, int MINB, bool COOP>
__global__ void __launch_bounds__(WARPS * 32, MINB) decode_kernel(const Params p) {
    using G = Geo<FMT, D, COOP>;
    constexpr bool BF = FMT == FMT_BF16;
    extern __shared__ __align__(16) uint8_t smem[];

    /* Launched as a programmatic dependent (launch.h): the kernels before it may still be
     * running. Until the wait below, the warp reads only what no kernel of this pass writes (the
     * tables and lengths, uploaded before the pass, and the blocks wholly before each sequence's
     * p.fresh newest tokens, written by earlier passes), so that their copies are under way while
     * the KV write before it ends. */
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); /* as pdl_begin does */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long item = (long long)blockIdx.x * WARPS + warp;
    if (item >= p.n_items)
        return;
    const WorkItem w = work_item(p, item);
    const int kvh = w.kvh, split = w.split, tab0 = w.tab0;
    const int r = lane >> 2, c = lane & 3;
    /* Rows (and columns of Oᵀ) are slots (pack_query). One query a warp: slot s is head s. */
    auto slot_query = [&](int s) { return pack_query(p, w, s); };
    const int b = slot_query(r);                /* this thread's query (rows r and 8 + r) */
    const int hq = kvh * p.group + r % p.group; /* and its head */
    const bool head = b >= 0;
    const int t0 = split * p.split_len;
    /* the first blocks' table entries, asked for together with the length rather than after it
     * (entries past the sequence's blocks are read and dropped); in the loop, the entry of the
     * block issued next is read a block ahead (its latency, an L1 hit at best, is not waited for
     * before the copies) */
    const int32_t *table = p.tables + (size_t)tab0 * p.table_stride + t0 / BLOCK;
    const int readable = p.table_len - t0 / BLOCK;
    int32_t first_blk[STAGES - 1];
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++)
        first_blk[s] = s < readable ? table[s] : 0;
    const int len_r = head ? p.lengths[b] : 0;
    int len = len_r; /* the pack's longest */
    for (int o = 4; o < 32; o *= 2)
        len = max(len, __shfl_xor_sync(0xffffffffu, len, o));

    if (t0 >= len) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        if (p.n_splits == 1 && head)
            for (int j = c; j < D; j += 4)
                p.out[((size_t)b * p.n_heads + hq) * D + j] = 0.0f;
        merge_if_last<FMT, D>(p, w, lane);
        return;
    }
    const int t1 = min(t0 + p.split_len, len);
    const int t1_r = min(t0 + p.split_len, len_r); /* this row's end */
    const int nblk = (t1 - t0 + BLOCK - 1) / BLOCK;

    uint8_t *ring = COOP ? smem : smem + (size_t)warp * STAGES * G::STAGE;
    const uint32_t ring_s = smem_addr(ring);
    const int tok_stride = p.n_kv * G::ROW;
    const size_t head_off = (size_t)kvh * G::ROW;

    /* where this warp's row of token t starts in a stage (q8 alone: past its shift) */
    auto row_off = [&](int t) {
        if constexpr (COOP)
            return t * G::SROW + warp * G::ROW;
        else if constexpr (FMT == FMT_Q8)
            return t * G::SROW + (int)(((size_t)t * tok_stride + head_off) & 15);
        else
            return t * G::SROW;
    };
    const int tid = COOP ? (int)threadIdx.x : lane;
    const CopyPlan<FMT, D, COOP> plan(tok_stride, head_off, tid);
    const uint8_t *k_first = p.k_pool + (COOP ? head_off - (size_t)warp * G::ROW : head_off);
    const long long v_minus_k = p.v_pool - p.k_pool;
    auto issue_at = [&](int i, int stage, int32_t blk) {
        plan.load(ring_s + (uint32_t)(stage * G::STAGE), k_first + blk * p.block_stride, v_minus_k,
                  t1 - t0 - i * BLOCK, tid);
    };
    /* the first blocks that end at or before every row's length − fresh: issued before the wait */
    int settled = p.fresh > 0 && head ? len_r - p.fresh : INT_MAX;
    for (int o = 4; o < 32; o *= 2)
        settled = min(settled, __shfl_xor_sync(0xffffffffu, settled, o));
    const int early = p.fresh > 0 ? min(max((settled - t0) / BLOCK, 0), STAGES - 1) : 0;
    int32_t next_blk = STAGES - 1 < nblk ? table[STAGES - 1] : 0;
    /* the first STAGES − 1 blocks, those before `early` or the rest (unrolled: first_blk stays in
     * registers) */
    auto issue_first = [&](bool before_early) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; s++)
            if ((s < early) == before_early) {
                if (s < nblk)
                    issue_at(s, s, first_blk[s]);
                cp_commit();
            }
    };
    issue_first(true);
    asm volatile("griddepcontrol.wait;" ::: "memory");

    /* The query, asked for before the rest of the first blocks (behind their copies its loads
     * would wait the longest), then as A fragments: rows r (rounded) and 8 + r (remainder), k
     * permuted like load_k. */
    uint4 qraw[D / 32][2];
#pragma unroll
    for (int k = 0; k < D / 32; k++) {
        const size_t at = ((size_t)b * p.n_heads + hq) * D + 32 * k + 8 * c;
        qraw[k][0] = qraw[k][1] = make_uint4(0, 0, 0, 0);
        if (head && p.q_bf16)
            qraw[k][0] = *reinterpret_cast<const uint4 *>((const __nv_bfloat16 *)p.q + at);
        else if (head) {
            qraw[k][0] = *reinterpret_cast<const uint4 *>((const float *)p.q + at);
            qraw[k][1] = *reinterpret_cast<const uint4 *>((const float *)p.q + at + 4);
        }
    }
    issue_first(false);
    float xq[D / 32][8]; /* this thread's query elements [32k + 8c, +8), scaled */
#pragma unroll
    for (int k = 0; k < D / 32; k++) {
        if (p.q_bf16) {
            const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&qraw[k][0]);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float2 f = __bfloat1622float2(h[i]);
                xq[k][2 * i] = f.x * p.qscale;
                xq[k][2 * i + 1] = f.y * p.qscale;
            }
        } else {
            const uint32_t w[8] = {qraw[k][0].x, qraw[k][0].y, qraw[k][0].z, qraw[k][0].w,
                                   qraw[k][1].x, qraw[k][1].y, qraw[k][1].z, qraw[k][1].w};
#pragma unroll
            for (int i = 0; i < 8; i++)
                xq[k][i] = __uint_as_float(w[i]) * p.qscale;
        }
    }
    /* 16-bit formats: qf[k] the A fragments of the two k-steps of group k, rounded (row r) and
     * remainder (row 8 + r). q8: qf[k][0..3] one int8 k-step, the query row in steps of
     * q_step = max |q| / 127 (row r) and the remainder in 254ths of a step (row 8 + r), about 15
     * bits of the query; the keys' codes are used as stored and their groups' scales applied to
     * the int32 sums (fewer instructions a block than turning every code into f16, and under the
     * GPU's power cap fewer instructions are a higher clock). */
    uint32_t qf[D / 32][FMT == FMT_Q8 ? 4 : 8];
    float q_step = 0.0f;
    if constexpr (FMT == FMT_Q8) {
        float amax = 0.0f;
#pragma unroll
        for (int k = 0; k < D / 32; k++)
#pragma unroll
            for (int i = 0; i < 8; i++)
                amax = fmaxf(amax, fabsf(xq[k][i]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        q_step = amax / 127.0f;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        /* y + 1.5·2²³ rounds y to the integer whose two's complement the float's low byte then
         * holds; the remainder in 254ths stays within ±127 */
        const float M = 12582912.0f;
#pragma unroll
        for (int k = 0; k < D / 32; k++) {
            uint32_t hb[8], lb[8];
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const float y = xq[k][i] * inv, t = __fadd_rn(y, M);
                hb[i] = __float_as_uint(t);
                lb[i] = __float_as_uint(__fmaf_rn(__fsub_rn(y, __fsub_rn(t, M)), 254.0f, M));
            }
            auto pack = [](const uint32_t *x) {
                return __byte_perm(__byte_perm(x[0], x[1], 0x0040), __byte_perm(x[2], x[3], 0x0040),
                                   0x5410);
            };
            qf[k][0] = pack(hb);
            qf[k][1] = pack(lb);
            qf[k][2] = pack(hb + 4);
            qf[k][3] = pack(lb + 4);
        }
    } else {
#pragma unroll
        for (int k = 0; k < D / 32; k++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                split2<BF>(xq[k][2 * i], xq[k][2 * i + 1], qf[k][2 * i], qf[k][2 * i + 1]);
    }

    /* O accumulates transposed, Oᵀ += Vᵀ·Pᵀ: rows are dims (two per m-tile and thread), columns
     * are head slots. With a group of ≤ 4, slot n < 4 carries head n's rounded probabilities and
     * slot n + 4 their remainders (one product); with 5..8 heads, slot n is head n and the
     * remainders take a second product into the same accumulators. */
    constexpr int MT = D / 16; /* m-tiles of dims */
    const bool packed = p.group <= 4 && p.pack == 1;
    const int h0 = packed ? (2 * c) & 3 : 2 * c; /* heads of this thread's columns */
    float acc[MT][4];
#pragma unroll
    for (int j = 0; j < MT; j++)
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    float m = -INFINITY, l = 0.0f;

    /* the rows this thread reads in a stage: keys 8j + r, values 2c, 2c + 1, 8 + 2c, 9 + 2c */
    const int k_at[2] = {opaque(row_off(r)), opaque(row_off(8 + r))};
    const int v_at[4] = {row_off(2 * c), row_off(2 * c + 1), row_off(8 + 2 * c),
                         row_off(9 + 2 * c)};
    /* q8: this thread's E = D/8 value codes of a row start at byte o (even) of it, and their
     * group's scale at scale_at; the runs as 4-byte aligned loads from v_run, `sel` bytes in */
    constexpr int E = D / 8;
    const int o = 34 * (E * r / 32) + (E * r) % 32;
    const int scale_at = 34 * (E * r / 32) + 32;
    int v_run[4] = {0, 0, 0, 0}, v_scale[4] = {0, 0, 0, 0};
    uint32_t v_sel = 0;
    if constexpr (FMT == FMT_Q8) {
#pragma unroll
        for (int x = 0; x < 4; x++) {
            v_run[x] = opaque(v_at[x] + (o & ~3));
            v_scale[x] = opaque(v_at[x] + scale_at);
        }
        v_sel = (uint32_t)opaque((o & 2) ? 0x5432 : 0x3210);
    }

    /* scores of tokens 8j + 2c + {0, 1} of the block in stage `ks` for query head r (two chains of
     * products each); −∞ past this row's `valid` tokens of the block */
    auto scores = [&](const uint8_t *ks, int valid, float s[2][2]) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            float sum[2];
            if constexpr (FMT == FMT_Q8) {
                /* per group: the int32 sums of the query's steps (row r) and 254ths (row 8 + r),
                 * times the scale of the group of each of tokens 2c, 2c + 1 (v_at: where those
                 * tokens' rows start, the same for keys as for values) */
                sum[0] = sum[1] = 0.0f;
#pragma unroll
                for (int k = 0; k < D / 32; k++) {
                    uint32_t w0, w1;
                    load_k_codes(ks + k_at[j], k, c, w0, w1);
                    int d[4];
                    imma(d, qf[k], w0, w1);
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const float sk = __half2float(
                            *reinterpret_cast<const __half *>(ks + v_at[2 * j + e] + 34 * k + 32));
                        sum[e] += sk * ((float)d[e] + (float)d[2 + e] * (1.0f / 254.0f));
                    }
                }
                sum[0] *= q_step;
                sum[1] *= q_step;
            } else {
                float ce[4] = {0.0f, 0.0f, 0.0f, 0.0f}, co[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int k = 0; k < D / 32; k++) {
                    uint32_t kb[4];
                    load_k(ks + k_at[j], 8 * j + r, k, c, kb);
                    mma<BF>(ce, &qf[k][0], kb[0], kb[1]);
                    mma<BF>(co, &qf[k][4], kb[2], kb[3]);
                }
#pragma unroll
                for (int e = 0; e < 2; e++)
                    sum[e] = (ce[e] + ce[2 + e]) + (co[e] + co[2 + e]);
            }
#pragma unroll
            for (int e = 0; e < 2; e++)
                s[j][e] = 8 * j + 2 * c + e < valid ? sum[e] : -INFINITY;
        }
    };
    for (int i = 0, cur = 0; i < nblk; i++, cur = cur == STAGES - 1 ? 0 : cur + 1) {
        /* block i has landed (and its copiers' writes are visible); every reader is done with
         * block i − 1, whose stage the next copy takes */
        cp_wait<STAGES - 2>();
        if constexpr (COOP)
            __syncthreads();
        else
            __syncwarp();
        if (i + STAGES - 1 < nblk) {
            issue_at(i + STAGES - 1, cur == 0 ? STAGES - 1 : cur - 1, next_blk);
            if (i + STAGES < nblk)
                next_blk = table[i + STAGES];
        }
        cp_commit();

        const uint8_t *ks = ring + cur * G::STAGE;
        const uint8_t *vs = ks + BLOCK * G::SROW;
        float s[2][2];
        scores(ks, t1_r - t0 - i * BLOCK, s);

        /* online softmax (base 2) */
        float mx = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m, mx);
        /* a row of a pack with no token yet (a shorter query's split): nothing, not NaN */
        const bool none = mn == -INFINITY;
        const float alpha = none ? 1.0f : ex2(m - mn);
        m = mn;
        float pr[2][2];
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 2; e++)
                pr[j][e] = none ? 0.0f : ex2(s[j][e] - mn);
        l = l * alpha + (pr[0][0] + pr[0][1]) + (pr[1][0] + pr[1][1]);
        /* rescale only when some head's maximum moved (rare once a few blocks are in) */
        if (__any_sync(0xffffffffu, alpha != 1.0f)) {
            const float a0 = __shfl_sync(0xffffffffu, alpha, 4 * h0);
            const float a1 = __shfl_sync(0xffffffffu, alpha, 4 * h0 + 4);
#pragma unroll
            for (int j = 0; j < MT; j++) {
                acc[j][0] *= a0, acc[j][2] *= a0;
                acc[j][1] *= a1, acc[j][3] *= a1;
            }
        }

        /* Pᵀ as the B operand: column r of tokens 2c, 2c+1 (b0) and 8+2c, 9+2c (b1) */
        uint32_t bh[2], bl[2];
        if (packed) {
            float x[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float own = pr[e >> 1][e & 1];
                float other = __shfl_xor_sync(0xffffffffu, own, 16); /* head r − 4 */
                x[e] = r < 4 ? own : other;
            }
            uint32_t h[2], lo[2];
            split2<BF>(x[0], x[1], h[0], lo[0]);
            split2<BF>(x[2], x[3], h[1], lo[1]);
            bh[0] = r < 4 ? h[0] : lo[0];
            bh[1] = r < 4 ? h[1] : lo[1];
        } else {
            split2<BF>(pr[0][0], pr[0][1], bh[0], bl[0]);
            split2<BF>(pr[1][0], pr[1][1], bh[1], bl[1]);
        }

        /* Oᵀ += Vᵀ·Pᵀ */
        if constexpr (FMT == FMT_Q8) {
            /* this thread's dims: [E·r, E·r + E); rows r and r + 8 of m-tile mt are dims
             * E·r + mt and E·r + E/2 + mt */
            /* this thread's E = D/8 code bytes of tokens 2c, 2c+1, 8+2c, 9+2c, and their scales */
            uint32_t wa[E / 4], wb[E / 4], wc[E / 4], wd[E / 4];
            load_q8_run<E>(vs + v_run[0], v_sel, wa);
            load_q8_run<E>(vs + v_run[1], v_sel, wb);
            load_q8_run<E>(vs + v_run[2], v_sel, wc);
            load_q8_run<E>(vs + v_run[3], v_sel, wd);
            auto scale = [&](int x) {
                return *reinterpret_cast<const uint16_t *>(vs + v_scale[x]);
            };
            uint32_t sab = __byte_perm(scale(0), scale(1), 0x5410);
            uint32_t scd = __byte_perm(scale(2), scale(3), 0x5410);
            const __half2 s_ab = *reinterpret_cast<__half2 *>(&sab);
            const __half2 s_cd = *reinterpret_cast<__half2 *>(&scd);
#pragma unroll
            for (int w = 0; w < E / 8; w++) {
                /* bytes (a_k, b_k) interleaved, xor 0x80: words w (rows r) and w + E/8 (r + 8) */
                uint32_t ab[2][2], cd[2][2];
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    const int x = w + half * (E / 8);
                    ab[half][0] = __byte_perm(wa[x], wb[x], 0x5140) ^ 0x80808080u;
                    ab[half][1] = __byte_perm(wa[x], wb[x], 0x7362) ^ 0x80808080u;
                    cd[half][0] = __byte_perm(wc[x], wd[x], 0x5140) ^ 0x80808080u;
                    cd[half][1] = __byte_perm(wc[x], wd[x], 0x7362) ^ 0x80808080u;
                }
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const uint32_t sel = q & 1 ? 0x4342 : 0x4140;
                    uint32_t a[4] = {
                        dequant2(ab[0][q >> 1], sel, s_ab), dequant2(ab[1][q >> 1], sel, s_ab),
                        dequant2(cd[0][q >> 1], sel, s_cd), dequant2(cd[1][q >> 1], sel, s_cd)};
                    mma<false>(acc[4 * w + q], a, bh[0], bh[1]);
                    if (!packed)
                        mma<false>(acc[4 * w + q], a, bl[0], bl[1]);
                }
            }
        } else {
            /* rows r and r + 8 of m-tile mt are dims 16·mt + r and 16·mt + 8 + r */
            const int mat = lane >> 3, t = (mat >> 1) * 8 + (lane & 7);
            const uint32_t vrow = smem_addr(vs + t * G::SROW);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                uint32_t addr = vrow + (uint32_t)(swz(2 * mt + (mat & 1), t) * 16);
                uint32_t a[4];
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                             : "r"(addr));
                mma<BF>(acc[mt], a, bh[0], bh[1]);
                if (!packed)
                    mma<BF>(acc[mt], a, bl[0], bl[1]);
            }
        }
    }
    cp_wait<0>();

    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    /* packed: add the remainder columns (c + 2) to the rounded ones (c) */
    if (packed) {
#pragma unroll
        for (int j = 0; j < MT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                acc[j][e] += __shfl_xor_sync(0xffffffffu, acc[j][e], 2);
    }
    /* this thread's columns: heads h0 and h0 + 1, with their m and l from the rows' threads */
    const float l0 = __shfl_sync(0xffffffffu, l, 4 * h0),
                l1 = __shfl_sync(0xffffffffu, l, 4 * h0 + 4);
    if (p.n_splits > 1 && c == 0 && head)
        p.part_ml[((size_t)b * p.n_heads + hq) * p.n_splits + split] = make_float2(m, l);
    /* this thread's columns: slots h0 and h0 + 1 */
    const int qa = slot_query(h0), qb = slot_query(h0 + 1);
    /* the output (one split), or the split's partial */
    auto store_out = [&]() {
        const bool two = qb >= 0;
        /* 16-bit formats: rows r and r + 8 of m-tile mt are dims 16·mt + r and 16·mt + 8 + r */
        auto dim = [&](int mt, int row8) { return 16 * mt + 8 * row8 + r; };
        const size_t bh0 = (size_t)qa * p.n_heads + kvh * p.group + h0 % p.group;
        const size_t bh1 = two ? (size_t)qb * p.n_heads + kvh * p.group + (h0 + 1) % p.group : bh0;
        if (p.n_splits == 1 && FMT == FMT_Q8) {
            /* thread r's dims are [E·r, E·r + E): acc[j][0] dim E·r + j, acc[j][2] dim E·r + MT +
             * j, stored as whole float4s */
            const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
            float *o0 = p.out + bh0 * D + E * r, *o1 = p.out + bh1 * D + E * r;
#pragma unroll
            for (int j = 0; j < MT; j += 4)
#pragma unroll
                for (int row8 = 0; row8 < 2; row8++) {
                    const int e = 2 * row8, at = row8 * MT + j;
                    *reinterpret_cast<float4 *>(o0 + at) = make_float4(
                        acc[j][e] * i0, acc[j + 1][e] * i0, acc[j + 2][e] * i0, acc[j + 3][e] * i0);
                    if (two)
                        *reinterpret_cast<float4 *>(o1 + at) =
                            make_float4(acc[j][e + 1] * i1, acc[j + 1][e + 1] * i1,
                                        acc[j + 2][e + 1] * i1, acc[j + 3][e + 1] * i1);
                }
        } else if (p.n_splits == 1) {
            const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
            float *o0 = p.out + bh0 * D, *o1 = p.out + bh1 * D;
#pragma unroll
            for (int j = 0; j < MT; j++) {
                o0[dim(j, 0)] = acc[j][0] * i0;
                o0[dim(j, 1)] = acc[j][2] * i0;
                if (two) {
                    o1[dim(j, 0)] = acc[j][1] * i1;
                    o1[dim(j, 1)] = acc[j][3] * i1;
                }
            }
        } else {
            /* a partial in m-tile order (position 16·mt + 8·row8 + r, which is dim() for 16-bit
             * formats): a store of the eight row threads fills one 32-byte sector (q8's dims, E
             * apart, would take eight); the merge writes q8's back in dim order (merge_dim) */
            const size_t slot0 = bh0 * p.n_splits + split, slot1 = bh1 * p.n_splits + split;
            float *o0 = p.part_acc + slot0 * D + r, *o1 = p.part_acc + slot1 * D + r;
#pragma unroll
            for (int j = 0; j < MT; j++) {
                o0[16 * j] = acc[j][0];
                o0[16 * j + 8] = acc[j][2];
                if (two) {
                    o1[16 * j] = acc[j][1];
                    o1[16 * j + 8] = acc[j][3];
                }
            }
        }
    };
    if (!((packed && c >= 2) || qa < 0))
        store_out();
    merge_if_last<FMT, D>(p, w, lane);
}

/* ---- q4 and tq, on CUDA cores ------------------------------------------------------------
 * Their codes do not become tensor-core operands as cheaply as q8's (q4's nibbles with a min,
 * tq's keys with a zero, tq's 3-bit values on a codebook), so they take a kernel of their own on
 * the same work items, splits and merge. A warp takes its split 32 tokens at a time: each lane a
 * token, whose key row it decodes against the slots' queries (held in shared memory, read as
 * broadcasts), so a score needs no reduction; the chunk's softmax by warp reductions; then the
 * value rows one token after another, each lane on dims lane + 32j. A rotated format gets its
 * queries rotated once, and each output or split's partial turned back (the merge is linear). */
template <int FMT> struct RowsGeo {
    static constexpr int KG = FMT == FMT_Q4 ? 20 : 36; /* bytes of a key group */
    static constexpr int VG = FMT == FMT_Q4 ? 20 : 14; /* of a value group */
};

/* The float of a small unsigned integer c (< 2²³), exactly, without a conversion instruction. */
__device__ __forceinline__ float small_float(uint32_t c) {
    return __uint_as_float(0x4B000000u | c) - 8388608.0f;
}

/* The two halves of a word (low, high) as floats. */
__device__ __forceinline__ float2 half_pair(uint32_t w) {
    return make_float2(__half2float(__ushort_as_half((unsigned short)(w & 0xffffu))),
                       __half2float(__ushort_as_half((unsigned short)(w >> 16))));
}

template <int FMT, int D, int SL>
__global__ void __launch_bounds__(WARPS * 32) rows_kernel(const Params p) {
    constexpr int NG = D / 32; /* groups of a row, and dims of a lane */
    constexpr int KG = RowsGeo<FMT>::KG, VG = RowsGeo<FMT>::VG;
    __shared__ __align__(16) float sq[WARPS][SL][D]; /* the slots' queries, scaled */
    __shared__ float sqsum[WARPS][SL][NG];           /* and each group's sum */
    __shared__ float book[8];
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); /* as pdl_begin does */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (FMT == FMT_TQ && threadIdx.x < 8)
        book[threadIdx.x] = tq_level(threadIdx.x);
    __syncthreads();
    const long long item = (long long)blockIdx.x * WARPS + warp;
    if (item >= p.n_items)
        return;
    const WorkItem w = work_item(p, item);
    const int kvh = w.kvh, split = w.split, tab0 = w.tab0;
    const int S = p.pack * p.group; /* slots (pack_query) */
    int qs[SL], len_s[SL], len = 0;
#pragma unroll
    for (int s = 0; s < SL; s++) {
        qs[s] = pack_query(p, w, s);
        len_s[s] = qs[s] >= 0 ? p.lengths[qs[s]] : 0;
        len = max(len, len_s[s]);
    }
    auto at = [&](int s) { return (size_t)qs[s] * p.n_heads + kvh * p.group + s % p.group; };
    const int t0 = split * p.split_len;
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (t0 >= len) {
        if (p.n_splits == 1)
#pragma unroll
            for (int s = 0; s < SL; s++)
                for (int d = lane; d < D && qs[s] >= 0; d += 32)
                    p.out[at(s) * D + d] = 0.0f;
        if (p.counts != nullptr && last_of_unit(p, w, lane))
            merge_unit<D, SL, false>(p, w, lane);
        return;
    }
    const int t1 = min(t0 + p.split_len, len);

    /* the queries: rotated, times scale · log2(e), and each group's sum (the min's weight) */
#pragma unroll
    for (int s = 0; s < SL; s++) {
        if (s >= S)
            break;
        float x[NG];
#pragma unroll
        for (int j = 0; j < NG; j++) {
            const size_t i = qs[s] >= 0 ? at(s) * D + lane + 32 * j : 0;
            x[j] = qs[s] < 0  ? 0.0f
                   : p.q_bf16 ? __bfloat162float(((const __nv_bfloat16 *)p.q)[i])
                              : ((const float *)p.q)[i];
        }
        if (p.rot.keys)
            kv_rotate(p.rot, x, NG, lane);
#pragma unroll
        for (int j = 0; j < NG; j++) {
            float v = x[j] * p.qscale;
            sq[warp][s][lane + 32 * j] = v;
#pragma unroll
            for (int o = 16; o > 0; o /= 2)
                v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0)
                sqsum[warp][s][j] = v;
        }
    }
    __syncwarp();

    const int32_t *table = p.tables + (size_t)tab0 * p.table_stride;
    const size_t k_tok = (size_t)p.n_kv * KG * NG, v_tok = (size_t)p.n_kv * VG * NG;
    const uint8_t *k_base = p.k_pool + (size_t)kvh * KG * NG;
    const uint8_t *v_base = p.v_pool + (size_t)kvh * VG * NG;
    /* values: TP tokens at a time, each on 32 / TP lanes; a lane's elements of each group are
     * hl + (32 / TP)·k (k < TP): for q4 the two nibbles of byte hl when TP = 2 */
    constexpr int TP = D <= 128 ? 2 : 1, LT = 32 / TP;
    const int hl = lane % LT, tp = lane / LT;
    float m[SL], l[SL], acc[SL][NG * TP];
#pragma unroll
    for (int s = 0; s < SL; s++) {
        m[s] = -INFINITY, l[s] = 0.0f;
#pragma unroll
        for (int j = 0; j < NG * TP; j++)
            acc[s][j] = 0.0f;
    }
    for (int c0 = t0; c0 < t1; c0 += 32) {
        const int t = c0 + lane;
        const int32_t blk = t < t1 ? table[t / BLOCK] : 0;
        /* scores: this lane's token against every slot */
        float sc[SL];
#pragma unroll
        for (int s = 0; s < SL; s++)
            sc[s] = 0.0f;
        if (t < t1) {
            const uint8_t *row = k_base + blk * p.block_stride + (size_t)(t % BLOCK) * k_tok;
#pragma unroll
            for (int g = 0; g < NG; g++) {
                constexpr int WORDS = FMT == FMT_Q4 ? 5 : 9; /* codes, then scale and min */
                uint32_t w[WORDS];
#pragma unroll
                for (int b = 0; b < WORDS; b++)
                    w[b] = reinterpret_cast<const uint32_t *>(row + g * KG)[b];
                float dot[SL];
#pragma unroll
                for (int s = 0; s < SL; s++)
                    dot[s] = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) { /* elements 4i .. 4i + 3 */
                    float e[4];
#pragma unroll
                    for (int k = 0; k < 4; k++) /* q4: byte j holds element j (low), j + 16 */
                        e[k] = FMT == FMT_Q4 ? small_float((w[i & 3] >> (8 * k + (i & 4))) & 15u)
                                             : small_float((w[i] >> (8 * k)) & 255u);
#pragma unroll
                    for (int s = 0; s < SL; s++) {
                        if (s >= S)
                            break;
                        const float4 a = reinterpret_cast<const float4 *>(&sq[warp][s][32 * g])[i];
                        dot[s] += a.x * e[0] + a.y * e[1] + a.z * e[2] + a.w * e[3];
                    }
                }
                const float2 f = half_pair(w[WORDS - 1]);
#pragma unroll
                for (int s = 0; s < SL; s++)
                    if (s < S)
                        sc[s] += f.x * dot[s] + f.y * sqsum[warp][s][g];
            }
        }
        /* the chunk's softmax, slot by slot (a slot sees its own length) */
        float pr[SL];
#pragma unroll
        for (int s = 0; s < SL; s++) {
            pr[s] = 0.0f;
            if (s >= S)
                continue;
            const float x = t < min(t1, len_s[s]) ? sc[s] : -INFINITY;
            float mx = x;
#pragma unroll
            for (int o = 16; o > 0; o /= 2)
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float top = fmaxf(m[s], mx);
            if (top == -INFINITY)
                continue;
            const float corr = exp2f(m[s] - top);
            pr[s] = exp2f(x - top);
            float sum = pr[s];
#pragma unroll
            for (int o = 16; o > 0; o /= 2)
                sum += __shfl_xor_sync(0xffffffffu, sum, o);
            l[s] = l[s] * corr + sum;
            m[s] = top;
#pragma unroll
            for (int j = 0; j < NG * TP; j++)
                acc[s][j] *= corr;
        }
        /* values: token u + tp's row, this lane's elements of each group */
        const int n = min(32, t1 - c0);
#pragma unroll 2
        for (int u = 0; u < n; u += TP) {
            const bool in = u + tp < n;
            const int32_t bu = __shfl_sync(0xffffffffu, blk, (u + tp) & 31);
            const uint8_t *row =
                v_base + bu * p.v_block_stride + (size_t)((c0 + u + tp) % BLOCK) * v_tok;
            float v[NG * TP];
#pragma unroll
            for (int g = 0; g < NG; g++) {
                const uint8_t *gr = row + g * VG;
#pragma unroll
                for (int k = 0; k < TP; k++) {
                    const int e = hl + LT * k; /* the element of the group */
                    float x;
                    if constexpr (FMT == FMT_Q4) {
                        const uint32_t byte = gr[e & 15];
                        const float2 f = half_pair(*reinterpret_cast<const uint32_t *>(gr + 16));
                        x = f.y + small_float(e < 16 ? byte & 15u : byte >> 4) * f.x;
                    } else {
                        const int bit = 3 * e; /* of the 12 bytes of codes (byte 12: the scale) */
                        const uint32_t w = gr[bit / 8] | (uint32_t)gr[bit / 8 + 1] << 8;
                        x = book[(w >> (bit % 8)) & 7u] *
                            __half2float(*reinterpret_cast<const __half *>(gr + 12));
                    }
                    v[TP * g + k] = in ? x : 0.0f; /* past the chunk: any block's bytes */
                }
            }
#pragma unroll
            for (int s = 0; s < SL; s++) {
                if (s >= S)
                    break;
                const float pu = __shfl_sync(0xffffffffu, pr[s], (u + tp) & 31);
#pragma unroll
                for (int j = 0; j < NG * TP; j++)
                    acc[s][j] += pu * v[j];
            }
        }
    }
    /* each slot with tokens in this split: the output, or the split's partial (dims in order) */
#pragma unroll
    for (int s = 0; s < SL; s++) {
        if (s >= S || qs[s] < 0 || t0 >= len_s[s])
            continue;
        /* the token lanes' sums, then dims lane + 32j */
        float o[NG];
#pragma unroll
        for (int g = 0; g < NG; g++) {
            float x[TP];
#pragma unroll
            for (int k = 0; k < TP; k++) {
                x[k] = acc[s][TP * g + k];
#pragma unroll
                for (int w = LT; w < 32; w *= 2)
                    x[k] += __shfl_xor_sync(0xffffffffu, x[k], w);
            }
            o[g] = TP == 1 || lane < LT ? x[0] : x[TP - 1]; /* element lane = hl + LT·tp */
        }
        if (p.rot.values)
            kv_rotate_inverse(p.rot, o, NG, lane);
        if (p.n_splits == 1) {
            const float inv = l[s] > 0.0f ? 1.0f / l[s] : 0.0f;
#pragma unroll
            for (int j = 0; j < NG; j++)
                p.out[at(s) * D + lane + 32 * j] = o[j] * inv;
        } else {
            const size_t slot = at(s) * p.n_splits + split;
#pragma unroll
            for (int j = 0; j < NG; j++)
                p.part_acc[slot * D + lane + 32 * j] = o[j];
            if (lane == 0)
                p.part_ml[slot] = make_float2(m[s], l[s]);
        }
    }
    if (p.counts != nullptr && last_of_unit(p, w, lane))
        merge_unit<D, SL, false>(p, w, lane);
}

/* ---- the merge of splits ------------------------------------------------------------------- */

/* One CTA per (sequence, head, MERGE_DIMS dims): every thread helps weigh the splits, then
 * 128 / (MERGE_DIMS / 4) groups of MERGE_DIMS / 4 threads (a float4 each) sum a strided share of
 * the splits, folded through shared memory. */
constexpr int MERGE_THREADS = 128;

__device__ float block_reduce(float v, bool is_max, float *red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < MERGE_THREADS / 32; w++)
        v = is_max ? fmaxf(v, red[w]) : v + red[w];
    return v;
}

template <int MERGE_DIMS>
__global__ void __launch_bounds__(MERGE_THREADS)
    merge_kernel(const float *part_acc, const float2 *part_ml, const int32_t *lengths, int n_heads,
                 int n_splits, int split_len, int D, bool q8, float *out) {
    extern __shared__ float weight[]; /* [n_splits] */
    __shared__ float red[MERGE_THREADS / 32];
    __shared__ float4 fold[MERGE_THREADS];
    const size_t bh = blockIdx.x;
    const int b = (int)(bh / n_heads);
    /* the length before the wait: uploaded before the pass, no kernel writes it (launch.h) */
    const int len = lengths[b];
    const int ns = min(n_splits, (len + split_len - 1) / split_len);
    const float2 *ml = part_ml + bh * n_splits;
    const int quad = threadIdx.x % (MERGE_DIMS / 4), sub = threadIdx.x / (MERGE_DIMS / 4);
    constexpr int SUBS = MERGE_THREADS / (MERGE_DIMS / 4), HELD = 4;
    const int d0 = blockIdx.y * MERGE_DIMS + 4 * quad;
    const float *acc = part_acc + bh * n_splits * D + d0;
    /* the decode kernel's partials are complete and visible after this; then every first load of
     * them is asked for before any is used (a thread's first split's m and l, its first HELD
     * splits' accumulators): one memory round trip, not one a loop */
    pdl_begin();
    const float2 ml0 = threadIdx.x < ns ? ml[threadIdx.x] : make_float2(-INFINITY, 0.0f);
    float4 held[HELD];
#pragma unroll
    for (int k = 0; k < HELD; k++) {
        const int s = sub + k * SUBS;
        held[k] = s < ns ? *reinterpret_cast<const float4 *>(acc + (size_t)s * D)
                         : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }

    float mx = ml0.x;
    for (int s = threadIdx.x + MERGE_THREADS; s < ns; s += MERGE_THREADS)
        mx = fmaxf(mx, ml[s].x);
    mx = block_reduce(mx, true, red);
    float sum = 0.0f;
    for (int s = threadIdx.x; s < ns; s += MERGE_THREADS) {
        const float2 e = s == threadIdx.x ? ml0 : ml[s];
        float w = exp2f(e.x - mx);
        weight[s] = w;
        sum += w * e.y;
    }
    sum = block_reduce(sum, false, red); /* its barriers also publish weight[] */
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;

    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int k = 0; k < HELD; k++) {
        const int s = sub + k * SUBS;
        if (s >= ns)
            break;
        const float w = weight[s];
        o.x += w * held[k].x, o.y += w * held[k].y, o.z += w * held[k].z, o.w += w * held[k].w;
    }
#pragma unroll 4
    for (int s = sub + HELD * SUBS; s < ns; s += SUBS) {
        float4 a = *reinterpret_cast<const float4 *>(acc + (size_t)s * D);
        float w = weight[s];
        o.x += w * a.x, o.y += w * a.y, o.z += w * a.z, o.w += w * a.w;
    }
    fold[threadIdx.x] = o;
    __syncthreads();
    if (sub == 0) {
        for (int k = 1; k < SUBS; k++) {
            float4 a = fold[threadIdx.x + k * (MERGE_DIMS / 4)];
            o.x += a.x, o.y += a.y, o.z += a.z, o.w += a.w;
        }
        if (q8) {
            float *ob = out + bh * D;
            ob[merge_dim(d0, D, true)] = o.x * inv;
            ob[merge_dim(d0 + 1, D, true)] = o.y * inv;
            ob[merge_dim(d0 + 2, D, true)] = o.z * inv;
            ob[merge_dim(d0 + 3, D, true)] = o.w * inv;
        } else {
            *reinterpret_cast<float4 *>(out + bh * D + d0) =
                make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
        }
    }
}

/* ---- host side ----------------------------------------------------------------------------- */

/* Stages per ring (a warp's, or the CTA's when its warps share their stages) and the most CTAs
 * per SM, for head_dim ≤ 128 (measured on an H200: docs/BENCHMARKS.md). LLMEM_CUDA_ATTN_STAGES
 * (2, 3, 4, 6, 8) and LLMEM_CUDA_ATTN_CTAS (1..4), or LLMEM_CUDA_ATTN_<FORMAT>_STAGES / _CTAS
 * (format BF16, F16, Q8) for one format, override them; q8's CTAs set to other than 2 also turn
 * off its taking three when the split fills one wave. */
const enum llmem_option attn_options[] = {
    LLMEM_OPT_CUDA_ATTN_STAGES,     LLMEM_OPT_CUDA_ATTN_BF16_STAGES, LLMEM_OPT_CUDA_ATTN_F16_STAGES,
    LLMEM_OPT_CUDA_ATTN_Q8_STAGES,  LLMEM_OPT_CUDA_ATTN_CTAS,        LLMEM_OPT_CUDA_ATTN_BF16_CTAS,
    LLMEM_OPT_CUDA_ATTN_F16_CTAS,   LLMEM_OPT_CUDA_ATTN_Q8_CTAS,     LLMEM_OPT_CUDA_ATTN_FUSE,
    LLMEM_OPT_CUDA_ATTN_MERGE_DIMS, LLMEM_OPT_CUDA_ATTN_SERIAL_FROM};

/* LLMEM_OK when every option above is unset or well formed, else LLMEM_EINVAL (logged): check()
 * asks first, so that option() below, read where a call cannot fail, never meets a bad one. */
int check_options() {
    for (enum llmem_option id : attn_options)
        if (llmem_option_check(id) != LLMEM_OK)
            return LLMEM_EINVAL;
    return LLMEM_OK;
}

/* The option's value; `fallback` when it is unset and has no default. */
int option(enum llmem_option id, int fallback) {
    int64_t v = fallback;
    (void)llmem_option_int(id, &v);
    return (int)v;
}

/* The format's own option where set, else the one for every format, else `fallback`. */
int format_option(enum llmem_option every, enum llmem_option own, int fallback) {
    return option(own, option(every, fallback));
}

typedef void (*kernel_fn)(const Params);

/* A kernel and what its launches need; shared by every device and the threads that drive them
 * (a split model's ranks): made once, prepared on each device under prepare_lock. */
struct KernelInfo {
    kernel_fn fn;
    int smem;         /* the stages' bytes */
    int smem_alloc;   /* what a CTA asks for: at least smem, more to cap the CTAs per SM */
    int max_ctas;     /* 0: as many as fit */
    int warps_per_sm; /* resident warps per multiprocessor, 0 until asked */
    KernelInfo *wide; /* the same kernel at more CTAs per SM, taken when its split fills one wave */
    KernelInfo *(*at_cap)(int max_ctas); /* the same kernel under another cap */
    uint64_t devices; /* bit d: prepared on device d (its shared-memory limit raised there) */
};

static KernelInfo kernel_row(kernel_fn fn, int smem, int max_ctas,
                             KernelInfo *(*at_cap)(int max_ctas)) {
    return KernelInfo{fn, smem, 0, max_ctas, 0, nullptr, at_cap, 0};
}

template <int FMT, int D, int STAGES, int MINB, bool COOP> KernelInfo *kernel_info(int max_ctas) {
    constexpr int S = STAGES * Geo<FMT, D, COOP>::CTA_BYTES_PER_STAGE;
    static KernelInfo info[5] = { /* by max_ctas */
        kernel_row(decode_kernel<FMT, D, STAGES, MINB, COOP>, S, 0,
                   kernel_info<FMT, D, STAGES, MINB, COOP>),
        kernel_row(decode_kernel<FMT, D, STAGES, MINB, COOP>, S, 1,
                   kernel_info<FMT, D, STAGES, MINB, COOP>),
        kernel_row(decode_kernel<FMT, D, STAGES, MINB, COOP>, S, 2,
                   kernel_info<FMT, D, STAGES, MINB, COOP>),
        kernel_row(decode_kernel<FMT, D, STAGES, MINB, COOP>, S, 3,
                   kernel_info<FMT, D, STAGES, MINB, COOP>),
        kernel_row(decode_kernel<FMT, D, STAGES, MINB, COOP>, S, 4,
                   kernel_info<FMT, D, STAGES, MINB, COOP>)};
    return &info[max_ctas];
}

constexpr int SMEM_CTA_MAX = 220 * 1024;

template <int FMT, int D, int MINB, bool COOP> KernelInfo *pick_stages(int stages, int max_ctas) {
    constexpr int ST = Geo<FMT, D, COOP>::CTA_BYTES_PER_STAGE;
    if (stages >= 8 && 8 * ST <= SMEM_CTA_MAX)
        return kernel_info<FMT, D, 8, MINB, COOP>(max_ctas);
    if (stages >= 6 && 6 * ST <= SMEM_CTA_MAX)
        return kernel_info<FMT, D, 6, MINB, COOP>(max_ctas);
    if (stages >= 4 && 4 * ST <= SMEM_CTA_MAX)
        return kernel_info<FMT, D, 4, MINB, COOP>(max_ctas);
    if (stages >= 3 && 3 * ST <= SMEM_CTA_MAX)
        return kernel_info<FMT, D, 3, MINB, COOP>(max_ctas);
    return kernel_info<FMT, D, 2, MINB, COOP>(max_ctas);
}

template <int FMT, bool COOP> KernelInfo *pick_dim(int head_dim) {
    constexpr bool q8 = FMT == FMT_Q8, bf16 = FMT == FMT_BF16;
    /* 16-bit: 3 stages, one CTA (4 warps) per SM; q8: 3 stages, two CTAs per SM, or three when
     * the warps share their stages and the split fills one wave of them */
    static const int stages = format_option(LLMEM_OPT_CUDA_ATTN_STAGES,
                                            q8     ? LLMEM_OPT_CUDA_ATTN_Q8_STAGES
                                            : bf16 ? LLMEM_OPT_CUDA_ATTN_BF16_STAGES
                                                   : LLMEM_OPT_CUDA_ATTN_F16_STAGES,
                                            3);
    static const int ctas = format_option(LLMEM_OPT_CUDA_ATTN_CTAS,
                                          q8     ? LLMEM_OPT_CUDA_ATTN_Q8_CTAS
                                          : bf16 ? LLMEM_OPT_CUDA_ATTN_BF16_CTAS
                                                 : LLMEM_OPT_CUDA_ATTN_F16_CTAS,
                                          q8 ? 2 : 1);
    static const bool wide = FMT == FMT_Q8 && COOP && ctas == 2;
    KernelInfo *k = NULL;
    switch (head_dim) {
    case 64: k = pick_stages<FMT, 64, 2, COOP>(stages, ctas); break;
    case 128: k = pick_stages<FMT, 128, 2, COOP>(stages, ctas); break;
    case 256: k = pick_stages<FMT, 256, 1, COOP>(stages, ctas); break;
    default: return NULL;
    }
    if (wide && head_dim <= 128 && __atomic_load_n(&k->wide, __ATOMIC_ACQUIRE) == nullptr)
        __atomic_store_n(&k->wide, k->at_cap(3), __ATOMIC_RELEASE);
    return k;
}

template <int FMT, int D, int SL> KernelInfo *rows_info(int max_ctas) {
    static KernelInfo info[5] = { /* by max_ctas */
        kernel_row(rows_kernel<FMT, D, SL>, 0, 0, rows_info<FMT, D, SL>),
        kernel_row(rows_kernel<FMT, D, SL>, 0, 1, rows_info<FMT, D, SL>),
        kernel_row(rows_kernel<FMT, D, SL>, 0, 2, rows_info<FMT, D, SL>),
        kernel_row(rows_kernel<FMT, D, SL>, 0, 3, rows_info<FMT, D, SL>),
        kernel_row(rows_kernel<FMT, D, SL>, 0, 4, rows_info<FMT, D, SL>)};
    return &info[max_ctas];
}

/* slots: a warp's (query, head) rows, pack × group (fewer registers for 4) */
template <int FMT, int SL> KernelInfo *pick_rows_dim(int head_dim) {
    switch (head_dim) {
    case 64: return rows_info<FMT, 64, SL>(0);
    case 128: return rows_info<FMT, 128, SL>(0);
    case 256: return rows_info<FMT, 256, SL>(0);
    default: return NULL;
    }
}

template <int FMT> KernelInfo *pick_rows(int head_dim, int slots) {
    return slots <= 4 ? pick_rows_dim<FMT, 4>(head_dim) : pick_rows_dim<FMT, MAX_GROUP>(head_dim);
}

KernelInfo *pick_kernel(const struct llmem_cuda_attn *a) {
    const int slots = (a->pack > 1 ? a->pack : 1) * (a->n_heads / a->n_kv_heads);
    switch (a->format) {
    case LLMEM_KV_FORMAT_Q4: return pick_rows<FMT_Q4>(a->head_dim, slots);
    case LLMEM_KV_FORMAT_TQ: return pick_rows<FMT_TQ>(a->head_dim, slots);
    case LLMEM_KV_FORMAT_F16: return pick_dim<FMT_F16, false>(a->head_dim);
    case LLMEM_KV_FORMAT_BF16: return pick_dim<FMT_BF16, false>(a->head_dim);
    case LLMEM_KV_FORMAT_Q8: /* a CTA's warps share whole spans when they are one token's heads */
        return a->n_kv_heads % WARPS == 0 ? pick_dim<FMT_Q8, true>(a->head_dim)
                                          : pick_dim<FMT_Q8, false>(a->head_dim);
    default: return NULL;
    }
}

static std::mutex prepare_lock;

/* Raises the kernel's shared-memory limit on the calling thread's device, once a device, and
 * reads its occupancy on the first (the devices of a split are alike): its fields are written
 * once, before any thread reads them. */
int prepare(KernelInfo *k) {
    int dev = 0, per_sm = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess && (dev < 0 || dev >= 64))
        err = cudaErrorInvalidDevice;
    if (err == cudaSuccess && (__atomic_load_n(&k->devices, __ATOMIC_ACQUIRE) >> dev & 1))
        return LLMEM_OK;
    std::lock_guard<std::mutex> hold(prepare_lock);
    if (err == cudaSuccess && (k->devices >> dev & 1))
        return LLMEM_OK;
    const bool first = k->devices == 0;
    if (first && err == cudaSuccess) {
        err = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
        k->smem_alloc = k->smem;
        if (err == cudaSuccess && k->max_ctas > 0) {
            /* more than per_sm / (max_ctas + 1) a CTA (1 KB of it reserved) leaves room for
             * fewer */
            int floor_bytes = per_sm / (k->max_ctas + 1) - 1024 + 256;
            k->smem_alloc = floor_bytes > k->smem ? floor_bytes : k->smem;
        }
    }
    /* the kernel's limit covers every cap it is launched under (a KernelInfo per cap) */
    cudaFuncAttributes attr;
    if (err == cudaSuccess)
        err = cudaFuncGetAttributes(&attr, k->fn);
    if (err == cudaSuccess && attr.maxDynamicSharedSizeBytes < k->smem_alloc)
        err =
            cudaFuncSetAttribute(k->fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k->smem_alloc);
    int blocks = first ? 0 : k->warps_per_sm / WARPS;
    if (first && err == cudaSuccess)
        err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k->fn, WARPS * 32,
                                                            k->smem_alloc);
    if (err != cudaSuccess || blocks == 0) {
        LLMEM_ERROR_AS("llmem_cuda_attn_decode", "kernel set-up: %s (%d blocks per SM)",
                       cudaGetErrorString(err), blocks);
        return LLMEM_EIO;
    }
    if (first)
        k->warps_per_sm = blocks * WARPS;
    __atomic_store_n(&k->devices, k->devices | (uint64_t)1 << dev, __ATOMIC_RELEASE);
    return LLMEM_OK;
}

int check(const struct llmem_cuda_attn *a, KernelInfo **kernel) {
    const char *why = NULL;
    const bool rows = a->format == LLMEM_KV_FORMAT_Q4 || a->format == LLMEM_KV_FORMAT_TQ;
    if (a->format != LLMEM_KV_FORMAT_F16 && a->format != LLMEM_KV_FORMAT_BF16 &&
        a->format != LLMEM_KV_FORMAT_Q8 && !rows)
        why = "format (f16, bf16, q8, q4 or tq)";
    else if (a->rotation != NULL && (a->rotation->keys || a->rotation->values) && !rows)
        why = "rotation (q4 and tq)";
    else if (a->head_dim != 64 && a->head_dim != 128 && a->head_dim != 256)
        why = "head_dim (64, 128 or 256)";
    else if (a->block_size != BLOCK)
        why = "block_size (16)";
    else if (a->n_kv_heads <= 0 || a->n_heads % a->n_kv_heads != 0 ||
             a->n_heads / a->n_kv_heads > MAX_GROUP)
        why = "n_heads (n_kv_heads × 1..8)";
    else if (a->batch < 0 || a->max_len < 0 || a->table_stride < 0 ||
             (a->table_stride > 0 && a->table_stride * a->block_size < a->max_len))
        why = "batch, max_len or table_stride";
    else if (a->pack > 1 &&
             (a->pack * (a->n_heads / a->n_kv_heads) > 8 || (a->packs != NULL && a->n_packs <= 0) ||
              (a->table_stride > 0 && a->table_ids == NULL)))
        why = "pack (8 / group queries at most, of one table each)";
    else if (a->split_len < 0 || a->split_len % BLOCK != 0)
        why = "split_len (a multiple of 16)";
    else if (((uintptr_t)a->k_pool | (uintptr_t)a->v_pool | (uintptr_t)a->q) % 16 != 0 ||
             ((uintptr_t)a->out | (uintptr_t)a->workspace) % 16 != 0 || a->block_stride % 16 != 0 ||
             a->v_block_stride % 16 != 0)
        why = "alignment (pools, block_stride, q, out and workspace on 16 bytes)";
    if (why) {
        LLMEM_ERROR_AS("llmem_cuda_attn_decode", "unsupported %s", why);
        return LLMEM_EINVAL;
    }
    if (check_options() != LLMEM_OK)
        return LLMEM_EINVAL;
    *kernel = pick_kernel(a);
    return prepare(*kernel);
}

/* The queries' warps a split takes: one per pack. */
long long warp_queries(const struct llmem_cuda_attn *a) {
    if (a->pack <= 1)
        return a->batch;
    return a->packs != NULL ? a->n_packs : (a->batch + a->pack - 1) / a->pack;
}

/* Splits per sequence and their length, for `slots` resident warps. */
void choose_split(const struct llmem_cuda_attn *a, long long slots, int *split_len, int *n_splits) {
    const int blocks = (a->max_len + BLOCK - 1) / BLOCK;
    const long long units = (long long)warp_queries(a) * a->n_kv_heads;
    if (blocks <= 1 || units == 0) {
        *split_len = blocks * BLOCK > 0 ? blocks * BLOCK : BLOCK;
        *n_splits = 1;
        return;
    }
    if (a->split_len > 0) {
        *split_len = a->split_len;
        *n_splits = (a->max_len + a->split_len - 1) / a->split_len;
        return;
    }
    /* cost in 64ths of a block's time: waves × (blocks per split + a fixed cost of 2), and with
     * more than one split the merge: 1, plus per split 1/64 (16-bit) or 1/16 (q8, whose blocks
     * take about half the time) — fitted to the split sweeps in docs/BENCHMARKS.md */
    const long long per_split = a->format == LLMEM_KV_FORMAT_Q8 ? 4 : 1;
    long long best = -1;
    int best_len = blocks;
    /* n splits of per blocks, n the fewest for its per: after n, the next such count is the
     * fewest whose per is smaller (O(√blocks) counts, host time a call) */
    for (int n = 1; n <= blocks && n <= 4096;) {
        const int per = (blocks + n - 1) / n;
        long long waves = (units * n + slots - 1) / slots;
        long long cost = 64 * waves * (per + 2) + (n > 1 ? 64 + per_split * n : 0);
        if (best < 0 || cost < best) {
            best = cost;
            best_len = per;
        }
        if (per == 1)
            break;
        n = (blocks + per - 2) / (per - 1);
    }
    *split_len = best_len * BLOCK;
    *n_splits = (blocks + best_len - 1) / best_len;
}

constexpr int MAX_SPLITS = 4096; /* the merge keeps a weight per split in shared memory */

int plan(const struct llmem_cuda_attn *a, KernelInfo **kernel, int *split_len, int *n_splits) {
    int rc = check(a, kernel);
    if (rc != LLMEM_OK)
        return rc;
    long long slots = (long long)sm_count() * (*kernel)->warps_per_sm;
    choose_split(a, slots > 0 ? slots : 1024, split_len, n_splits);
    /* more CTAs per SM pay when their split still runs in one wave (more warps to hide each
     * other's latency); a second wave costs more than they give (docs/BENCHMARKS.md) */
    KernelInfo *wide = __atomic_load_n(&(*kernel)->wide, __ATOMIC_ACQUIRE);
    if (wide != NULL && a->split_len == 0 && prepare(wide) == LLMEM_OK) {
        const long long wide_slots = (long long)sm_count() * wide->warps_per_sm;
        int len, n;
        choose_split(a, wide_slots, &len, &n);
        if (wide_slots > slots && warp_queries(a) * a->n_kv_heads * n <= wide_slots) {
            *kernel = wide;
            *split_len = len;
            *n_splits = n;
        }
    }
    /* A grid that needs fewer CTAs an SM than the kernel allows is capped at that many. Its CTAs
     * are placed while the kernels around it may still hold some SMs' slots (programmatic
     * launches); uncapped, the first SMs with room would take two or three of them and others
     * none, and the doubled-up CTAs would set the time (1 split × 8192 tokens, q8, 64 sequences:
     * 550 µs a call in a graph against 426 alone). */
    const int sms = sm_count();
    if (sms > 0) {
        const long long ctas = (warp_queries(a) * a->n_kv_heads * *n_splits + WARPS - 1) / WARPS;
        const long long need = (ctas + sms - 1) / sms;
        if (need >= 1 && need * WARPS < (*kernel)->warps_per_sm && need < 5) {
            KernelInfo *capped = (*kernel)->at_cap((int)need);
            if (prepare(capped) == LLMEM_OK && capped->warps_per_sm >= need * WARPS)
                *kernel = capped;
        }
    }
    if (*n_splits > MAX_SPLITS) {
        LLMEM_ERROR_AS("llmem_cuda_attn_decode", "split_len %d gives %d splits (at most %d)",
                       *split_len, *n_splits, MAX_SPLITS);
        return LLMEM_EINVAL;
    }
    return LLMEM_OK;
}

/* Units of a call (a pack of queries and a KV head: the warps of its splits). */
long long units(const struct llmem_cuda_attn *a) {
    return warp_queries(a) * a->n_kv_heads;
}

/* Whether the splits are merged inside the attention kernel (merge_if_last): given counters for
 * every unit, when the merging warp reads at most LLMEM_CUDA_ATTN_FUSE rows of 128 floats (its
 * slots × splits; 0..256, default 16). It waits for each round of its loads (8 such rows, about
 * 0.6 µs on an H200), and two rounds cost about what the second kernel does: 16 × 2048, 4 splits
 * of 4 slots, 39.1 → 37.7 µs; 1 × 256 in 8 splits, 32 rows, 8.1 µs against 4.2 with the merge
 * kernel over 16 splits (docs/BENCHMARKS.md). */
bool fused(const struct llmem_cuda_attn *a, int n_splits) {
    static const int most = option(LLMEM_OPT_CUDA_ATTN_FUSE, 16);
    const long long rows = (long long)(a->pack > 1 ? a->pack : 1) * (a->n_heads / a->n_kv_heads) *
                           n_splits * (a->head_dim > 128 ? 2 : 1);
    return n_splits > 1 && n_splits <= 32 && rows <= most && a->counters != NULL &&
           a->n_counters >= (size_t)units(a);
}

/* The dims a merge CTA takes (32, 64 or 128, at most head_dim): the fewest for which the merge
 * of `rows` (sequence, head) rows needs at most four CTAs an SM, else the most. Smaller CTAs spread
 * a few rows' splits over more SMs; past that their number costs more than it spreads (an H200,
 * graph µs: bf16 1 × 4096, 32 rows, 8.0 at 32 dims against 9.1 at 128; q8 16 × 2048, 512 rows,
 * 28.1 against 24.9; docs/BENCHMARKS.md). LLMEM_CUDA_ATTN_MERGE_DIMS (32, 64, 128) overrides it. */
int merge_dims(long long rows, int head_dim) {
    static const int forced = option(LLMEM_OPT_CUDA_ATTN_MERGE_DIMS, 0);
    const long long most = 4LL * (sm_count() > 0 ? sm_count() : 132);
    int md = 32;
    if (forced == 32 || forced == 64 || forced == 128)
        md = forced;
    else
        while (md < 128 && md < head_dim && rows * (head_dim / md) > most)
            md *= 2;
    return md < head_dim ? md : head_dim;
}

/* Whether the decode kernel is launched as a programmatic dependent (launch.h). It pays where a
 * call is short: its launch and first copies run under the kernel before it (bf16 4 × 16384,
 * splits of 1024: 64.8 against 67.6 µs in stream order; 1 × 4096: 8.0 against 10.1). With splits
 * of LLMEM_CUDA_ATTN_SERIAL_FROM tokens or more (default 4096; 0: never) the kernel goes in stream
 * order, which measured faster for a grid of long CTAs in one wave (bf16 64 × 8192, one split:
 * 479.7 against 483.8 µs; docs/BENCHMARKS.md). */
bool programmatic(int split_len) {
    static const int from = option(LLMEM_OPT_CUDA_ATTN_SERIAL_FROM, 4096);
    return from == 0 || split_len < from;
}

} // namespace

extern "C" size_t llmem_cuda_attn_counters(const struct llmem_cuda_attn *a) {
    return (size_t)units(a);
}

extern "C" int llmem_cuda_attn_split(const struct llmem_cuda_attn *a, int *split_len,
                                     int *n_splits) {
    KernelInfo *k;
    return plan(a, &k, split_len, n_splits);
}

extern "C" size_t llmem_cuda_attn_workspace_bytes(const struct llmem_cuda_attn *a) {
    KernelInfo *k;
    int len, n;
    if (plan(a, &k, &len, &n) != LLMEM_OK || n <= 1)
        return 0;
    size_t slots = (size_t)a->batch * a->n_heads * n;
    return slots * a->head_dim * sizeof(float) + slots * sizeof(float2);
}

extern "C" int llmem_cuda_attn_decode(const struct llmem_cuda_attn *a) {
    KernelInfo *k;
    int split_len, n_splits;
    int rc = plan(a, &k, &split_len, &n_splits);
    if (rc != LLMEM_OK)
        return rc;
    if (a->batch == 0)
        return LLMEM_OK;
    size_t slots = (size_t)a->batch * a->n_heads * n_splits;
    size_t need = n_splits > 1 ? slots * a->head_dim * sizeof(float) + slots * sizeof(float2) : 0;
    if (need > a->workspace_bytes || (need > 0 && a->workspace == NULL)) {
        LLMEM_ERROR("workspace of %zu bytes, %zu needed", a->workspace_bytes, need);
        return LLMEM_EINVAL;
    }

    Params p;
    p.q = a->q;
    p.q_bf16 = a->q_bf16;
    p.k_pool = (const uint8_t *)a->k_pool;
    p.v_pool = (const uint8_t *)a->v_pool;
    p.block_stride = a->block_stride;
    p.tables = a->block_tables;
    p.table_ids = a->table_ids;
    p.table_stride = a->table_stride;
    p.table_len = a->table_stride > 0 ? a->table_stride : (a->max_len + BLOCK - 1) / BLOCK;
    p.lengths = a->lengths;
    p.fresh = a->fresh;
    p.out = a->out;
    p.part_acc = (float *)a->workspace;
    p.part_ml = n_splits > 1 ? (float2 *)((float *)a->workspace + slots * a->head_dim) : NULL;
    p.n_heads = a->n_heads;
    p.n_kv = a->n_kv_heads;
    p.group = a->n_heads / a->n_kv_heads;
    p.split_len = split_len;
    p.n_splits = n_splits;
    p.n_items = warp_queries(a) * a->n_kv_heads * n_splits;
    p.n_queries = a->batch;
    p.pack = a->pack > 1 ? a->pack : 1;
    p.packs = a->pack > 1 ? a->packs : NULL;
    float scale = a->scale != 0.0f ? a->scale : 1.0f / sqrtf((float)a->head_dim);
    p.qscale = scale * LOG2E;
    p.v_block_stride = a->v_block_stride > 0 ? a->v_block_stride : a->block_stride;
    p.rot = a->rotation != NULL ? *a->rotation : llmem_backend_kv_rotation{};
    const bool fuse = fused(a, n_splits);
    p.counts = fuse ? a->counters : NULL;

    cudaStream_t stream = (cudaStream_t)a->stream;
    unsigned grid = (unsigned)((p.n_items + WARPS - 1) / WARPS);
    cudaError_t err;
    if (programmatic(split_len)) {
        err = pdl_launch(stream, k->fn, dim3(grid), dim3(WARPS * 32), k->smem_alloc, p);
    } else { /* in stream order: its griddepcontrol instructions have no grid to wait for */
        profile_begin(stream);
        k->fn<<<grid, WARPS * 32, k->smem_alloc, stream>>>(p);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess && n_splits > 1 && !fuse) {
        /* launched as a programmatic dependent: its launch overlaps the decode kernel's tail */
        const int md = merge_dims((long long)a->batch * a->n_heads, a->head_dim);
        auto fn = md == 128 ? merge_kernel<128> : md == 64 ? merge_kernel<64> : merge_kernel<32>;
        err = pdl_launch(
            stream, fn,
            dim3((unsigned)((size_t)a->batch * a->n_heads), (unsigned)(a->head_dim / md)),
            dim3(MERGE_THREADS), n_splits * sizeof(float), (const float *)p.part_acc,
            (const float2 *)p.part_ml, a->lengths, a->n_heads, n_splits, split_len, a->head_dim,
            a->format == LLMEM_KV_FORMAT_Q8, a->out);
    }
    if (err == cudaSuccess)
        err = cudaGetLastError();
    if (err != cudaSuccess) {
        LLMEM_ERROR("launch: %s", cudaGetErrorString(err));
        return LLMEM_EIO;
    }
    return LLMEM_OK;
}
