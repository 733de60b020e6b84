/*
 * backend/cuda/quant.cu — quantized weights on the device: GGUF's block types (Q4_0, Q4_1, Q5_0,
 * Q5_1, Q8_0, Q2_K … Q6_K) and MLX's affine groups, read from the bytes as the file holds them.
 *
 * Every type is read 8 values at a time (a group: an eighth of a 32-value block, 8 values of a K
 * super-block's 16- or 32-value sub-block, of an MLX group) in the form value = sc · (q − B) − off
 * (q the unsigned code, B the type's bias, sc and off the group's scale and offset), which
 * dequantizes exactly as quant/dequant.c does on the host (the same roundings, no fused
 * multiply-adds). Consecutive threads take consecutive groups, so that a warp reads x and writes
 * its output in whole lines. Four kernels:
 *   - qgemv: a few rows of x (decode): a warp per weight row, sc · Σ q·x − (off + sc·B) · Σ x per
 *     group in f32 (the weights stream once; the products differ from the CPU's exact ones by the
 *     order of the sums); at fast precision, for the types whose CPU fast path multiplies
 *     integers (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K), integer products with x quantized to 8 bits
 *     instead, a lane a 32-value unit (Q4_K: a pair of them), up to three matrices of one x (of
 *     any of those types) in one launch, gate and up with swiglu (below: "fast precision");
 *   - qmma: a batch's rows of x (9 to 64) at fast precision, for the same integer types: x
 *     quantized to 8 bits, the codes multiplied on the tensor cores (below: "more rows of x";
 *     Q4_K's and Q6_K's operands read straight from memory: "Q4_K and Q6_K on the tensor
 *     cores");
 *   - qdequant: a slice of rows into f16 (fast precision: gemm.cu multiplies the slice on the
 *     tensor cores) or f32 (f32 precision: a plain f32 GEMM), exactly;
 *   - qembedding: a table's rows for the token ids, exactly.
 */
#include "backend/cuda/ops_int.h"
#include "backend/cuda/tc.h"

#include "quant/quant.h"

namespace llmem_cuda {

/* The MLX types, as one template instance (their bits, group and scale dtype at run time). */
#define QT_MLX LLMEM_QTYPE_MLX_FIRST
/* Any of the integer types, chosen at run time (qgemv_set_kernel). */
#define QT_ANY (-1)

/* A quantized matrix as the kernels read it. */
struct qmat {
    const uint8_t *codes;
    const uint8_t *scales, *biases; /* MLX: [rows, cols / group] of the scale dtype */
    int64_t rows, cols, row_bytes;
    int bits, group, st; /* MLX */
};

static struct qmat qmat_of(const struct llmem_weight *w) {
    struct qmat m = {};
    m.codes = (const uint8_t *)w->data;
    m.scales = (const uint8_t *)w->scales, m.biases = (const uint8_t *)w->biases;
    m.rows = w->rows, m.cols = w->cols;
    m.row_bytes = llmem_weight_row_bytes(w);
    llmem_qtype_mlx_params(w->quant, &m.bits, &m.group, &m.st);
    return m;
}

/* ---- reading a group -------------------------------------------------------------------------
 */

/* *p: through the read-only cache (global memory), or plainly (SH: a copy in shared memory). */
template <bool SH, class T> __device__ __forceinline__ T ld(const T *p) {
    if constexpr (SH)
        return *p;
    else
        return __ldg(p);
}

template <bool SH = false> __device__ __forceinline__ float f16_at(const uint8_t *p) {
    return __half2float(__ushort_as_half(ld<SH>((const unsigned short *)p)));
}

template <bool SH = false> __device__ __forceinline__ uint32_t byte_at(const uint8_t *p) {
    return ld<SH>(p);
}

/* 8 bytes from p as two little-endian words, p aligned to A bytes (8, 4 or 2; 0: at least 2,
 * the same for the whole warp: blocks of 110 and 210 bytes leave every other block 2 bytes off a
 * word). Reads [p, p + 8) only. */
template <int A, bool SH = false>
__device__ __forceinline__ void bytes8(const uint8_t *p, uint32_t *w) {
    if (A == 8 || (A == 0 && ((uintptr_t)p & 7) == 0)) {
        const uint2 v = ld<SH>((const uint2 *)p);
        w[0] = v.x, w[1] = v.y;
    } else if (A == 4 || (A == 0 && ((uintptr_t)p & 3) == 0)) {
        w[0] = ld<SH>((const uint32_t *)p), w[1] = ld<SH>((const uint32_t *)p + 1);
    } else {
        const unsigned short *h = (const unsigned short *)p;
        w[0] = (uint32_t)ld<SH>(h) | (uint32_t)ld<SH>(h + 1) << 16;
        w[1] = (uint32_t)ld<SH>(h + 2) | (uint32_t)ld<SH>(h + 3) << 16;
    }
}

/* The f16 in the low (f16_lo) or high (f16_hi) half of w, as f32. */
__device__ __forceinline__ float f16_lo(uint32_t w) {
    return __half2float(__ushort_as_half((unsigned short)(w & 0xffff)));
}
__device__ __forceinline__ float f16_hi(uint32_t w) {
    return __half2float(__ushort_as_half((unsigned short)(w >> 16)));
}

/* A small integer (0 ≤ v < 2^23) as f32, exactly: its bits under 2^23's exponent, less 2^23 (a
 * logic operation and an add: the conversion instruction runs at an eighth of their rate). */
__device__ __forceinline__ float small_f(uint32_t v) {
    return __fsub_rn(__int_as_float(0x4B000000u | v), 8388608.0f);
}

/* The eight bytes of w[0], w[1] as f32 (exact). */
__device__ __forceinline__ void bytes_f(const uint32_t *w, float *f) {
#pragma unroll
    for (int b = 0; b < 8; b++)
        f[b] = __fsub_rn(__int_as_float(__byte_perm(w[b / 4], 0x4B000000u, 0x7540 + b % 4)),
                         8388608.0f);
}

/* Bits 0–3 of b spread to bit 0 of bytes 0–3 (Q5's fifth bits, four values at a time). */
__device__ __forceinline__ uint32_t spread4(uint32_t b) {
    return ((b & 0xfu) * 0x00204081u) & 0x01010101u;
}

/* d · scale and dmin · min of sub-block k of the Q4_K/Q5_K block at b: its 6-bit scale and min
 * as quant/dequant.c scale_min_k4 reads them, without a branch (the lanes of a warp take all eight
 * k): k < 4 in the low 6 bits of bytes k and k + 4 of the 12 after d and dmin; k ≥ 4 in the
 * nibbles of byte k + 4 with the top two bits of bytes k − 4 and k. */
template <bool SH = false>
__device__ __forceinline__ void k4_scale_min(const uint8_t *b, int k, float *sc, float *off) {
    const uint8_t *s = b + 4;
    const bool lo = k < 4;
    const uint32_t c0 = byte_at<SH>(s + (lo ? k : k + 4)),
                   c1 = byte_at<SH>(s + (lo ? k + 4 : k - 4));
    const uint32_t c2 = byte_at<SH>(s + k);
    const uint32_t scale = lo ? c0 & 63 : (c0 & 0xf) | (c1 >> 6) << 4;
    const uint32_t min = lo ? c1 & 63 : (c0 >> 4) | (c2 >> 6) << 4;
    const uint32_t dd = ld<SH>((const uint32_t *)b); /* d, dmin */
    *sc = __fmul_rn(f16_lo(dd), small_f(scale));
    *off = __fmul_rn(f16_hi(dd), small_f(min));
}

/* x rounded to the MLX scale dtype st, to nearest even (f32: x). */
__device__ __forceinline__ float round_to(float x, int st) {
    if (st == LLMEM_QTYPE_BF16)
        return __bfloat162float(__float2bfloat16_rn(x));
    if (st == LLMEM_QTYPE_F16)
        return __half2float(__float2half_rn(x));
    return x;
}

__device__ __forceinline__ float scale_at(const uint8_t *p, int st, int64_t i) {
    if (st == LLMEM_QTYPE_BF16)
        return bf16_to_f32(__ldg((const unsigned short *)p + i));
    if (st == LLMEM_QTYPE_F16)
        return __half2float(__ushort_as_half(__ldg((const unsigned short *)p + i)));
    return __ldg((const float *)p + i);
}

/* What a type's blocks hold: values (BE) and bytes (BB) a block (the MLX types: a group of 8
 * values, their bits in BB = 0: m.bits bytes), the bias of its codes (B), and whether its values
 * have an offset (OFF). */
template <int QT> struct qt {
    static constexpr int BE = QT == LLMEM_QTYPE_Q4_0 || QT == LLMEM_QTYPE_Q4_1 ||
                                      QT == LLMEM_QTYPE_Q5_0 || QT == LLMEM_QTYPE_Q5_1 ||
                                      QT == LLMEM_QTYPE_Q8_0
                                  ? 32
                              : QT == QT_MLX ? 8
                                             : 256;
    static constexpr int BB = QT == LLMEM_QTYPE_Q4_0   ? 18
                              : QT == LLMEM_QTYPE_Q4_1 ? 20
                              : QT == LLMEM_QTYPE_Q5_0 ? 22
                              : QT == LLMEM_QTYPE_Q5_1 ? 24
                              : QT == LLMEM_QTYPE_Q8_0 ? 34
                              : QT == LLMEM_QTYPE_Q2_K ? 84
                              : QT == LLMEM_QTYPE_Q3_K ? 110
                              : QT == LLMEM_QTYPE_Q4_K ? 144
                              : QT == LLMEM_QTYPE_Q5_K ? 176
                              : QT == LLMEM_QTYPE_Q6_K ? 210
                                                       : 0;
    static constexpr int G = BE / 8; /* groups a block */
    static constexpr float B = QT == LLMEM_QTYPE_Q4_0   ? 8.0f
                               : QT == LLMEM_QTYPE_Q5_0 ? 16.0f
                               : QT == LLMEM_QTYPE_Q8_0 ? 128.0f
                               : QT == LLMEM_QTYPE_Q3_K ? 4.0f
                               : QT == LLMEM_QTYPE_Q6_K ? 32.0f
                                                        : 0.0f;
    static constexpr bool OFF = QT == LLMEM_QTYPE_Q4_1 || QT == LLMEM_QTYPE_Q5_1 ||
                                QT == LLMEM_QTYPE_Q2_K || QT == LLMEM_QTYPE_Q4_K ||
                                QT == LLMEM_QTYPE_Q5_K;
};

/* Group e (values 8e … 8e + 7) of block b of row r: q[0…7] its codes as f32 (unsigned: the type's
 * value is q − qt<QT>::B), *sc and *off its scale and offset (0 without one). The MLX types: b is
 * the group's index in the row, their values q · sc + bias (off = −bias), rounded as MLX does by
 * deq8, not by this form. */
template <int QT>
__device__ __forceinline__ void qgroup(const struct qmat &m, int64_t r, const uint8_t *b,
                                       int64_t bi, int e, float *q, float *sc, float *off) {
    uint32_t w[2];
    *off = 0.0f;
    if constexpr (QT == LLMEM_QTYPE_Q4_0 || QT == LLMEM_QTYPE_Q4_1 || QT == LLMEM_QTYPE_Q5_0 ||
                  QT == LLMEM_QTYPE_Q5_1) {
        /* d (, m) (f16), (the fifth bits, u32,) 16 bytes of nibbles: value j the low nibble of
         * byte j, value j + 16 its high nibble; group e: bytes 8 (e % 2) …, nibble e / 2 */
        constexpr int head = QT == LLMEM_QTYPE_Q4_0 || QT == LLMEM_QTYPE_Q5_0 ? 2 : 4;
        constexpr int five = QT == LLMEM_QTYPE_Q5_0 || QT == LLMEM_QTYPE_Q5_1;
        *sc = f16_at(b);
        if constexpr (head == 4)
            *off = -f16_at(b + 2);
        bytes8<head == 2 ? 2 : five ? 8 : 4>(b + head + 4 * five + 8 * (e & 1), w);
        const int shift = 4 * (e >> 1);
        w[0] = (w[0] >> shift) & 0x0f0f0f0fu, w[1] = (w[1] >> shift) & 0x0f0f0f0fu;
        if constexpr (five) { /* bit v of the u32 is value v's fifth: byte e for the group */
            const uint32_t bits = byte_at(b + head + e);
            w[0] |= spread4(bits) << 4, w[1] |= spread4(bits >> 4) << 4;
        }
    } else if constexpr (QT == LLMEM_QTYPE_Q8_0) {
        *sc = f16_at(b);
        bytes8<2>(b + 2 + 8 * e, w);
        w[0] ^= 0x80808080u, w[1] ^= 0x80808080u;
    } else if constexpr (QT == LLMEM_QTYPE_Q2_K || QT == LLMEM_QTYPE_Q3_K ||
                         QT == LLMEM_QTYPE_Q6_K) {
        /* 128-value halves h; in each, four 32-value parts j (the 2-bit codes shifted by 2j, Q6_K's
         * by its nibble and top bits); each part two 16-value sub-blocks with a scale each */
        const int h = e / 16, j = (e % 16) / 4, l = 8 * (e % 4), s = 8 * h + 2 * j + l / 16;
        if constexpr (QT == LLMEM_QTYPE_Q2_K) { /* scales[16], qs[64], d, dmin */
            const uint32_t sb = byte_at(b + s);
            *sc = __fmul_rn(f16_at(b + 80), small_f(sb & 0xf));
            *off = __fmul_rn(f16_at(b + 82), small_f(sb >> 4));
            bytes8<4>(b + 16 + 32 * h + l, w);
            w[0] = (w[0] >> (2 * j)) & 0x03030303u, w[1] = (w[1] >> (2 * j)) & 0x03030303u;
        } else if constexpr (QT == LLMEM_QTYPE_Q3_K) { /* hmask[32], qs[64], scales[12], d */
            const uint32_t lo = s < 8 ? byte_at(b + 96 + s) & 0xf : byte_at(b + 96 + s - 8) >> 4;
            const uint32_t hi = (byte_at(b + 104 + s % 4) >> (2 * (s / 4))) & 3;
            *sc = __fmul_rn(f16_at(b + 108), __fsub_rn(small_f(lo | hi << 4), 32.0f));
            uint32_t hm[2];
            bytes8<0>(b + l, hm);
            bytes8<0>(b + 32 + 32 * h + l, w);
#pragma unroll
            for (int i = 0; i < 2; i++)
                w[i] = ((w[i] >> (2 * j)) & 0x03030303u) |
                       (((hm[i] >> (4 * h + j)) & 0x01010101u) << 2);
        } else { /* Q6_K: ql[128], qh[64], scales[16] (int8), d */
            *sc = __fmul_rn(f16_at(b + 208),
                            __fsub_rn(small_f(byte_at(b + 192 + s) ^ 0x80u), 128.0f));
            uint32_t hq[2];
            bytes8<0>(b + 64 * h + 32 * (j & 1) + l, w);
            bytes8<0>(b + 128 + 32 * h + l, hq);
#pragma unroll
            for (int i = 0; i < 2; i++)
                w[i] = ((w[i] >> (4 * (j >> 1))) & 0x0f0f0f0fu) |
                       (((hq[i] >> (2 * j)) & 0x03030303u) << 4);
        }
    } else if constexpr (QT == LLMEM_QTYPE_Q4_K || QT == LLMEM_QTYPE_Q5_K) {
        /* d, dmin (f16), scales[12] (eight 6-bit scales and mins), (qh[32],) qs[128]: sub-block
         * k the low (k even) or high nibbles of the 32 bytes k / 2 */
        constexpr int five = QT == LLMEM_QTYPE_Q5_K;
        const int k = e / 4, l = 8 * (e % 4);
        k4_scale_min(b, k, sc, off);
        bytes8<8>(b + (five ? 48 : 16) + 32 * (k / 2) + l, w);
        const int shift = 4 * (k & 1);
        w[0] = (w[0] >> shift) & 0x0f0f0f0fu, w[1] = (w[1] >> shift) & 0x0f0f0f0fu;
        if constexpr (five) {
            uint32_t qh[2];
            bytes8<8>(b + 16 + l, qh);
            w[0] |= ((qh[0] >> k) & 0x01010101u) << 4, w[1] |= ((qh[1] >> k) & 0x01010101u) << 4;
        }
    } else { /* QT_MLX: the group's codes, m.bits bytes at b */
        const int64_t g = 8 * bi / m.group, at = r * (m.cols / m.group) + g;
        *sc = scale_at(m.scales, m.st, at);
        *off = -scale_at(m.biases, m.st, at);
        if (m.bits == 8) {
            bytes8<8>(b, w);
        } else { /* eight nibbles, value k in bits 4k */
            const uint32_t c = __ldg((const uint32_t *)b);
            w[0] = c & 0x0f0f0f0fu, w[1] = (c >> 4) & 0x0f0f0f0fu;
            /* bytes of w[0]: values 0, 2, 4, 6; of w[1]: 1, 3, 5, 7 → in order */
            const uint32_t a = __byte_perm(w[0], w[1], 0x5140), d = __byte_perm(w[0], w[1], 0x7362);
            w[0] = a, w[1] = d;
        }
    }
    bytes_f(w, q);
}

/* v[0…7] = values 8e … 8e + 7 of block b (index bi) of row r, exactly as quant/dequant.c computes
 * them: the same products and differences, rounded once each. */
template <int QT>
__device__ __forceinline__ void deq8(const struct qmat &m, int64_t r, const uint8_t *b, int64_t bi,
                                     int e, float *v) {
    float sc, off;
    qgroup<QT>(m, r, b, bi, e, v, &sc, &off);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        if constexpr (QT == QT_MLX)
            v[i] = round_to(__fadd_rn(round_to(__fmul_rn(v[i], sc), m.st), -off), m.st);
        else if constexpr (qt<QT>::OFF)
            v[i] = __fsub_rn(__fmul_rn(sc, v[i]), off);
        else
            v[i] = __fmul_rn(sc, __fsub_rn(v[i], qt<QT>::B));
    }
}

/* Group e of block bi (at b) of row r for qgemv: as qgroup, the MLX types as their exact values
 * (sc 1, no offset: MLX rounds each value twice, which the products keep). */
template <int QT>
__device__ __forceinline__ void qload(const struct qmat &m, int64_t r, const uint8_t *b, int64_t bi,
                                      int e, float *q, float *sc, float *off) {
    if constexpr (QT == QT_MLX) {
        deq8<QT>(m, r, b, bi, e, q);
        *sc = 1.0f, *off = 0.0f;
    } else {
        qgroup<QT>(m, r, b, bi, e, q, sc, off);
    }
}

/* Bytes of block bi of a row (the MLX types: of group bi). */
template <int QT> __device__ __forceinline__ int64_t block_at(const struct qmat &m, int64_t bi) {
    return QT == QT_MLX ? bi * m.bits : bi * qt<QT>::BB;
}

/* CALL(QT) for the type of a weight */
#define QT_DISPATCH(type, CALL)                                                                    \
    switch (type) {                                                                                \
    case LLMEM_QTYPE_Q4_0: CALL(LLMEM_QTYPE_Q4_0); break;                                          \
    case LLMEM_QTYPE_Q4_1: CALL(LLMEM_QTYPE_Q4_1); break;                                          \
    case LLMEM_QTYPE_Q5_0: CALL(LLMEM_QTYPE_Q5_0); break;                                          \
    case LLMEM_QTYPE_Q5_1: CALL(LLMEM_QTYPE_Q5_1); break;                                          \
    case LLMEM_QTYPE_Q8_0: CALL(LLMEM_QTYPE_Q8_0); break;                                          \
    case LLMEM_QTYPE_Q2_K: CALL(LLMEM_QTYPE_Q2_K); break;                                          \
    case LLMEM_QTYPE_Q3_K: CALL(LLMEM_QTYPE_Q3_K); break;                                          \
    case LLMEM_QTYPE_Q4_K: CALL(LLMEM_QTYPE_Q4_K); break;                                          \
    case LLMEM_QTYPE_Q5_K: CALL(LLMEM_QTYPE_Q5_K); break;                                          \
    case LLMEM_QTYPE_Q6_K: CALL(LLMEM_QTYPE_Q6_K); break;                                          \
    default: CALL(QT_MLX);                                                                         \
    }

/* CALL(QT) for the type of a weight that qgemv_int takes */
#define QT_INT_DISPATCH(type, CALL)                                                                \
    switch (type) {                                                                                \
    case LLMEM_QTYPE_Q8_0: CALL(LLMEM_QTYPE_Q8_0); break;                                          \
    case LLMEM_QTYPE_Q4_0: CALL(LLMEM_QTYPE_Q4_0); break;                                          \
    case LLMEM_QTYPE_Q4_K: CALL(LLMEM_QTYPE_Q4_K); break;                                          \
    case LLMEM_QTYPE_Q5_K: CALL(LLMEM_QTYPE_Q5_K); break;                                          \
    default: CALL(LLMEM_QTYPE_Q6_K);                                                               \
    }

/* ---- kernels ---------------------------------------------------------------------------------
 */

/* A mixture's experts for the matrix-vector kernels (ids NULL: one matrix, as given): block
 * (x, y, z) takes the rows of block x of expert ids[order[y]] (order NULL: ids[y]) of stack z (0:
 * the kernel's m and y; 1: codes1, scales1, biases1 and y1), for the row order[y] / k of x (k 0:
 * row y), into row y of the output. The stacks hold their experts `stride` bytes apart (an MLX
 * type's scales and biases `side` bytes apart). */
struct qexperts {
    const int32_t *ids, *order;
    int k;
    int64_t stride, side;
    const uint8_t *codes1, *scales1, *biases1;
    float *y1;
};

/* The block's matrix, row of x (rows `row` elements apart) and row of output, from qexperts:
 * read after the wait (the ids are the kernel before's). */
template <typename X>
__device__ __forceinline__ void expert_of(const struct qexperts &ex, struct qmat *m, const X **x,
                                          int64_t row, float **y) {
    pdl_begin();
    const int64_t pr = blockIdx.y, p = ex.order != NULL ? ex.order[pr] : pr, e = ex.ids[p];
    if (blockIdx.z == 1)
        m->codes = ex.codes1, m->scales = ex.scales1, m->biases = ex.biases1, *y = ex.y1;
    m->codes += e * ex.stride;
    if (m->scales != NULL)
        m->scales += e * ex.side, m->biases += e * ex.side;
    *x += (ex.k > 0 ? p / ex.k : pr) * row;
    *y += pr * m->rows;
}

/* acc[j] summed over the warp, in every lane, for j < NX. */
template <int NX> __device__ __forceinline__ void warp_sum(float *acc) {
#pragma unroll
    for (int j = 0; j < NX; j++)
        for (int o = 16; o > 0; o /= 2)
            acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
}

/* y[j, r] = the warp's sum of acc[j] (+ bias[r]), for j < NX. */
template <int NX>
__device__ __forceinline__ void warp_store(float *acc, int lane, float *y, int64_t rows, int64_t r,
                                           const float *bias) {
    warp_sum<NX>(acc);
#pragma unroll
    for (int j = 0; j < NX; j++)
        if (lane == 0)
            y[j * rows + r] = bias != NULL ? acc[j] + bias[r] : acc[j];
}

/* y[t, r] = Σ_k x[t, k] · w[r, k] (+ bias[r]) for the NX rows of x at x: a warp per weight row,
 * eight rows a block; lane l takes group l % G of the blocks l / G, l / G + 32 / G, … (its place
 * in a block fixed, the warp's 32 groups 256 consecutive values). Per group
 * sc · Σ q·x − (off + sc·B) · Σ x. The first group is read before the wait (weights: launch.h). */
template <int QT, int NX>
static __global__ void __launch_bounds__(256)
    qgemv_kernel(struct qmat m, const float *x, float *y, const float *bias,
                 struct qexperts ex) {
    constexpr int G = qt<QT>::G;
    if (ex.ids != NULL)
        expert_of<float>(ex, &m, &x, m.cols, &y);
    const int lane = threadIdx.x & 31, e = lane % G;
    const int64_t r = blockIdx.x * 8 + threadIdx.x / 32, nb = m.cols / qt<QT>::BE;
    if (r >= m.rows) {
        pdl_begin();
        return;
    }
    float q[8], sc, off, acc[NX];
    int64_t bi = lane / G;
    const uint8_t *b = m.codes + r * m.row_bytes + block_at<QT>(m, bi);
    const float *xb = x + bi * qt<QT>::BE + 8 * e;
    const int64_t b_step = block_at<QT>(m, 32 / G), x_step = 32 / G * qt<QT>::BE;
    if (bi < nb)
        qload<QT>(m, r, b, bi, e, q, &sc, &off);
    pdl_begin();
#pragma unroll
    for (int j = 0; j < NX; j++)
        acc[j] = 0;
    for (bool first = true; bi < nb; bi += 32 / G, b += b_step, xb += x_step, first = false) {
        if (!first)
            qload<QT>(m, r, b, bi, e, q, &sc, &off);
        const float o = qt<QT>::B != 0.0f ? fmaf(sc, qt<QT>::B, off) : off;
#pragma unroll
        for (int j = 0; j < NX; j++) {
            const float4 *xr = reinterpret_cast<const float4 *>(xb + j * m.cols);
            const float4 a = xr[0], c = xr[1]; /* (x: as gemv_step reads it) */
            float s = q[0] * a.x;
            s = fmaf(q[1], a.y, s), s = fmaf(q[2], a.z, s), s = fmaf(q[3], a.w, s);
            s = fmaf(q[4], c.x, s), s = fmaf(q[5], c.y, s), s = fmaf(q[6], c.z, s);
            s = fmaf(q[7], c.w, s);
            acc[j] = fmaf(sc, s, acc[j]);
            if (qt<QT>::OFF || qt<QT>::B != 0.0f)
                acc[j] =
                    fmaf(-o, ((a.x + a.y) + (a.z + a.w)) + ((c.x + c.y) + (c.z + c.w)), acc[j]);
        }
    }
    warp_store<NX>(acc, lane, y, m.rows, r, bias);
}

/* Rows r0 … r0 + n of m into out [n, cols], f16 (rounded to nearest even) or f32: a thread a
 * group. */
template <int QT, typename OUT>
static __global__ void qdequant_kernel(struct qmat m, int64_t r0, int64_t n, OUT *out) {
    pdl_begin();
    constexpr int G = qt<QT>::G;
    const int64_t per_row = m.cols / 8;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n * per_row;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = r0 + i / per_row, g = i % per_row, bi = g / G;
        float v[8];
        deq8<QT>(m, r, m.codes + r * m.row_bytes + block_at<QT>(m, bi), bi, (int)(g % G), v);
        if constexpr (sizeof(OUT) == 2) {
            __half2 h[4];
#pragma unroll
            for (int k = 0; k < 4; k++)
                h[k] = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
            reinterpret_cast<uint4 *>(out)[i] = *reinterpret_cast<const uint4 *>(h);
        } else {
            reinterpret_cast<float4 *>(out)[2 * i] = make_float4(v[0], v[1], v[2], v[3]);
            reinterpret_cast<float4 *>(out)[2 * i + 1] = make_float4(v[4], v[5], v[6], v[7]);
        }
    }
}

/* out[t] = row ids[t] of m: a block a token, a thread a group. FED: the ids are top_k's feed,
 * written by the kernel before (read after the wait); else uploaded before the pass. */
template <int QT, bool FED>
static __global__ void qembedding_kernel(struct qmat m, const int32_t *ids, float *out) {
    constexpr int G = qt<QT>::G;
    const int64_t t = blockIdx.x;
    if constexpr (FED)
        pdl_begin();
    const int64_t r = ids[t];
    if constexpr (!FED)
        pdl_begin();
    if (r < 0) { /* another rank's token: a row of zeros */
        for (int64_t i = threadIdx.x; i < m.cols; i += blockDim.x)
            out[t * m.cols + i] = 0.0f;
        return;
    }
    for (int64_t g = threadIdx.x; g < m.cols / 8; g += blockDim.x) {
        const int64_t bi = g / G;
        float v[8];
        deq8<QT>(m, r, m.codes + r * m.row_bytes + block_at<QT>(m, bi), bi, (int)(g % G), v);
        float4 *o = reinterpret_cast<float4 *>(out + t * m.cols) + 2 * g;
        o[0] = make_float4(v[0], v[1], v[2], v[3]);
        o[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

/* ---- fast precision: integer products ------------------------------------------------------
 *
 * For the types whose CPU fast path multiplies integers (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K), a decode's
 * rows of x are quantized first, 32 values at a time (d = max|x| / 127, q = round(x / d), q in
 * [−127, 127]), with the f32 sums of every 16 values; a lane then takes a 32-value unit of the
 * weights (a 32-value block, a K sub-block) as 32 unsigned codes and sums code · q with dp4a:
 * value·x summed over a half h ≈ sc_h · d · Σ code·q − (off_h + sc_h·B) · Σ x.
 */

/* A warp per 32 values of a row of x (blockIdx.y): quantize_x_unit's rows (ops_int.h). */
static __global__ void quantize_x_kernel(const float *x, const float *up, int64_t cols,
                                         uint8_t *out) {
    pdl_begin();
    const int64_t u = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    if (u < cols / 32)
        quantize_x_unit(x, up, cols, blockIdx.y, u, threadIdx.x & 31, out);
}

/* d = Σ_k a_k · b_k + c over the four bytes, a unsigned, b signed. */
__device__ __forceinline__ int dp4a_us(uint32_t a, uint32_t b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

/* The 4·W bytes at p (2-byte aligned; W 4 or 8) as W little-endian words: 8-byte loads from p
 * rounded down to 8 bytes (W / 2, one more when p is not 8-byte aligned) and funnel shifts (a
 * 2-byte load for every two bytes asked the cache for a line of each lane's block every time:
 * Q6_K's 210-byte blocks leave every other block 2 bytes off a word, Q8_0's 34 and Q4_0's 18 every
 * other unit). Each load begins inside [p − 6, p + 4·W), and an aligned load that holds a byte of
 * an allocation lies inside its pages: the up to 6 bytes before p and 6 after those asked for
 * (the blocks beside it, or past a matrix's last block) are read, not used. */
template <int W, bool SH = false>
__device__ __forceinline__ void bytes_a2(const uint8_t *p, uint32_t *w) {
    const uint32_t o = (uint32_t)((uintptr_t)p & 7);
    const uint2 *a = (const uint2 *)(p - o);
    uint32_t t[W + 2];
    t[W] = t[W + 1] = 0;
#pragma unroll
    for (int i = 0; i < W / 2 + 1; i++)
        if (i < W / 2 || o != 0) {
            const uint2 v = ld<SH>(a + i);
            t[2 * i] = v.x, t[2 * i + 1] = v.y;
        }
    const bool hi = (o & 4) != 0;
    const uint32_t sh = (o & 2) * 8;
#pragma unroll
    for (int i = 0; i < W; i++)
        w[i] = __funnelshift_r(hi ? t[i + 1] : t[i], hi ? t[i + 2] : t[i + 1], sh);
}

/* Unit u (values 32u … 32u + 31) of row r: its 32 unsigned codes, byte i of w[i / 4] value i
 * (the type's value is code − qt<QT>::B), and each half's scale and offset; from global memory, or
 * (SH) from a copy of the row's blocks in shared memory at the same offset from 16 bytes. */
template <int QT, bool SH = false>
__device__ __forceinline__ void qunit_codes(const uint8_t *row, int64_t u, uint32_t *w, float *sc,
                                            float *off) {
    off[0] = off[1] = 0.0f;
    if constexpr (QT == LLMEM_QTYPE_Q4_0 || QT == LLMEM_QTYPE_Q8_0) {
        const uint8_t *b = row + u * qt<QT>::BB;
        sc[0] = sc[1] = f16_at<SH>(b);
        if constexpr (QT == LLMEM_QTYPE_Q8_0) {
            if constexpr (SH) {
#pragma unroll
                for (int i = 0; i < 4; i++)
                    bytes8<2, SH>(b + 2 + 8 * i, w + 2 * i);
            } else {
                bytes_a2<8>(b + 2, w);
            }
#pragma unroll
            for (int i = 0; i < 8; i++)
                w[i] ^= 0x80808080u;
        } else {
            uint32_t q[4];
            if constexpr (SH)
                bytes8<2, SH>(b + 2, q), bytes8<2, SH>(b + 10, q + 2);
            else
                bytes_a2<4>(b + 2, q);
#pragma unroll
            for (int i = 0; i < 4; i++)
                w[i] = q[i] & 0x0f0f0f0fu, w[4 + i] = (q[i] >> 4) & 0x0f0f0f0fu;
        }
    } else if constexpr (QT == LLMEM_QTYPE_Q4_K || QT == LLMEM_QTYPE_Q5_K) {
        constexpr int five = QT == LLMEM_QTYPE_Q5_K;
        const uint8_t *b = row + (u / 8) * qt<QT>::BB;
        const int k = (int)(u % 8);
        k4_scale_min<SH>(b, k, sc, off);
        sc[1] = sc[0], off[1] = off[0];
        const uint4 *qs = (const uint4 *)(b + (five ? 48 : 16) + 32 * (k / 2));
        const uint4 q0 = ld<SH>(qs), q1 = ld<SH>(qs + 1);
        const uint32_t q[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
        const int shift = 4 * (k & 1);
#pragma unroll
        for (int i = 0; i < 8; i++)
            w[i] = (q[i] >> shift) & 0x0f0f0f0fu;
        if constexpr (five) {
            const uint4 h0 = ld<SH>((const uint4 *)(b + 16)),
                        h1 = ld<SH>((const uint4 *)(b + 16) + 1);
            const uint32_t h[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
            for (int i = 0; i < 8; i++)
                w[i] |= ((h[i] >> k) & 0x01010101u) << 4;
        }
    } else { /* Q6_K */
        const uint8_t *b = row + (u / 8) * qt<QT>::BB;
        const int k = (int)(u % 8), h = k / 4, j = k % 4;
        const float d = f16_at<SH>(b + 208);
        const unsigned short s2 = ld<SH>((const unsigned short *)(b + 192 + 8 * h + 2 * j));
        sc[0] = __fmul_rn(d, __fsub_rn(small_f((s2 & 0xffu) ^ 0x80u), 128.0f));
        sc[1] = __fmul_rn(d, __fsub_rn(small_f((uint32_t)(s2 >> 8) ^ 0x80u), 128.0f));
        uint32_t ql[8], qh[8];
        bytes_a2<8, SH>(b + 64 * h + 32 * (j & 1), ql);
        bytes_a2<8, SH>(b + 128 + 32 * h, qh);
#pragma unroll
        for (int i = 0; i < 8; i++)
            w[i] = ((ql[i] >> (4 * (j >> 1))) & 0x0f0f0f0fu) |
                   (((qh[i] >> (2 * j)) & 0x03030303u) << 4);
    }
}

/* acc[j] += unit u of a row (w, sc, off: qunit_codes's) · unit u of row j of the quantized x,
 * for j < NX. */
template <int QT, int NX>
__device__ __forceinline__ void qunit_dot(const uint32_t *w, const float *sc, const float *off,
                                          const uint8_t *xq, int64_t cols, int64_t u, float *acc) {
    const int64_t xrow = xq_row_bytes(cols);
#pragma unroll
    for (int j = 0; j < NX; j++) {
        const uint8_t *xr = xq + j * xrow;
        /* (x quantized by the kernel before: plain loads, as gemv_step reads x) */
        const uint4 a = ((const uint4 *)(xr + 32 * u))[0], c = ((const uint4 *)(xr + 32 * u))[1];
        const float dx = ((const float *)(xr + cols))[u];
        const float *sx = (const float *)(xr + cols + cols / 32 * 4) + 2 * u;
        const float sx0 = sx[0], sx1 = sx[1];
        const int s0 =
            dp4a_us(w[3], a.w, dp4a_us(w[2], a.z, dp4a_us(w[1], a.y, dp4a_us(w[0], a.x, 0))));
        const int s1 =
            dp4a_us(w[7], c.w, dp4a_us(w[6], c.z, dp4a_us(w[5], c.y, dp4a_us(w[4], c.x, 0))));
        acc[j] = fmaf(sc[0] * dx, (float)s0, acc[j]);
        acc[j] = fmaf(sc[1] * dx, (float)s1, acc[j]);
        if (qt<QT>::OFF || qt<QT>::B != 0.0f) {
            acc[j] = fmaf(-fmaf(sc[0], qt<QT>::B, off[0]), sx0, acc[j]);
            acc[j] = fmaf(-fmaf(sc[1], qt<QT>::B, off[1]), sx1, acc[j]);
        }
    }
}

/* The eight 6-bit scales (s[0]: sub-blocks 0–3, s[1]: 4–7, a byte each) and mins (m) of a Q4_K
 * head (d, dmin, scales[12]), or one half of them (q4k_half: hi for 4–7), as quant/dequant.c's
 * scale_min_k4 reads them, four at a time:
 * sub-block k < 4 from bytes k and k + 4 of scales, k ≥ 4 from the nibbles of byte k + 4 and the
 * top bits of bytes k − 4 and k. */
__device__ __forceinline__ void q4k_half(uint4 hd, bool hi, uint32_t *s, uint32_t *m) {
    *s = hi ? (hd.w & 0x0f0f0f0fu) | ((hd.y >> 2) & 0x30303030u) : hd.y & 0x3f3f3f3fu;
    *m = hi ? ((hd.w >> 4) & 0x0f0f0f0fu) | ((hd.z >> 2) & 0x30303030u) : hd.z & 0x3f3f3f3fu;
}
__device__ __forceinline__ void q4k_scales(uint4 hd, uint32_t *s, uint32_t *m) {
    q4k_half(hd, false, &s[0], &m[0]), q4k_half(hd, true, &s[1], &m[1]);
}

/* Q4_K a lane a pair of sub-blocks: 2c and 2c + 1 of a super-block are the low and high nibbles
 * of the same 32 bytes (c < 4), so that a lane reads them once (a lane a sub-block read every byte
 * twice, and held 8 words of codes for 16 bytes). */
struct q4k_pair {
    uint4 hd, q0, q1; /* the super-block's head; the pair's 32 bytes of codes */
};

__device__ __forceinline__ void q4k_pair_load(const uint8_t *row, int64_t p, struct q4k_pair *v) {
    const uint8_t *b = row + (p / 4) * qt<LLMEM_QTYPE_Q4_K>::BB;
    const uint4 *qs = (const uint4 *)(b + 16 + 32 * (p % 4));
    v->hd = __ldg((const uint4 *)b), v->q0 = __ldg(qs), v->q1 = __ldg(qs + 1);
}

/* acc[k][j] += pair p of weight row k (v[k]) · values 64p … 64p + 63 of row j of the quantized x,
 * for k < R, j < NX: per sub-block sc·dx·Σ code·q − off·Σ x, as qunit_dot. */
template <int NX, int R>
__device__ __forceinline__ void q4k_pair_dot(const struct q4k_pair *v, int64_t p,
                                             const uint8_t *xq, int64_t cols, float (*acc)[NX]) {
    const int c = (int)(p % 4), sh = 16 * (c & 1);
    float sc[R][2], off[R][2];
#pragma unroll
    for (int k = 0; k < R; k++) {
        const uint4 hd = v[k].hd;
        uint32_t s, mn;
        q4k_half(hd, c >= 2, &s, &mn);
        const float d = f16_lo(hd.x), dm = f16_hi(hd.x);
        sc[k][0] = __fmul_rn(d, small_f((s >> sh) & 0xff));
        sc[k][1] = __fmul_rn(d, small_f((s >> (sh + 8)) & 0xff));
        off[k][0] = __fmul_rn(dm, small_f((mn >> sh) & 0xff));
        off[k][1] = __fmul_rn(dm, small_f((mn >> (sh + 8)) & 0xff));
    }
    const int64_t xrow = xq_row_bytes(cols);
#pragma unroll
    for (int j = 0; j < NX; j++) {
        const uint8_t *xr = xq + j * xrow;
        /* (x quantized by the kernel before: plain loads, as gemv_step reads x) */
        const uint4 *xc = (const uint4 *)(xr + 64 * p);
        const uint4 a0 = xc[0], a1 = xc[1], b0 = xc[2], b1 = xc[3];
        const float2 dx = ((const float2 *)(xr + cols))[p];
        const float4 sx = ((const float4 *)(xr + cols + cols / 32 * 4))[p];
        const uint32_t xa[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
        const uint32_t xb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
        for (int k = 0; k < R; k++) {
            const uint32_t q[8] = {v[k].q0.x, v[k].q0.y, v[k].q0.z, v[k].q0.w,
                                   v[k].q1.x, v[k].q1.y, v[k].q1.z, v[k].q1.w};
            int lo = 0, hi = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                lo = dp4a_us(q[i] & 0x0f0f0f0fu, xa[i], lo);
                hi = dp4a_us((q[i] >> 4) & 0x0f0f0f0fu, xb[i], hi);
            }
            float a = acc[k][j];
            a = fmaf(sc[k][0] * dx.x, (float)lo, a);
            a = fmaf(sc[k][1] * dx.y, (float)hi, a);
            a = fmaf(-off[k][0], sx.x + sx.y, a);
            acc[k][j] = fmaf(-off[k][1], sx.z + sx.w, a);
        }
    }
}

/* acc[k] = this lane's part of rows r + k of m (k < R; rows past the matrix read its last row)
 * · the NX rows of the quantized x, for Q4_K: QGEMV_PAIRS pairs of each row in flight before any
 * is used. */
#define QGEMV_PAIRS 2
template <int NX, int R>
__device__ __forceinline__ void qrow_q4k(const struct qmat &m, int64_t r, const uint8_t *xq,
                                         int lane, float (*acc)[NX]) {
    constexpr int U = QGEMV_PAIRS;
    const uint8_t *row[R];
#pragma unroll
    for (int k = 0; k < R; k++)
        row[k] = m.codes + (r + k < m.rows ? r + k : m.rows - 1) * m.row_bytes;
    const int64_t pairs = m.cols / 64;
    struct q4k_pair v[U][R];
    int64_t p = lane;
#pragma unroll
    for (int k = 0; k < R; k++)
#pragma unroll
        for (int j = 0; j < NX; j++)
            acc[k][j] = 0;
    bool waited = false;
    for (; p + 32 * (U - 1) < pairs; p += 32 * U) {
#pragma unroll
        for (int i = 0; i < U; i++)
#pragma unroll
            for (int k = 0; k < R; k++)
                q4k_pair_load(row[k], p + 32 * i, &v[i][k]);
        if (!waited)
            pdl_begin(), waited = true;
#pragma unroll
        for (int i = 0; i < U; i++)
            q4k_pair_dot<NX, R>(v[i], p + 32 * i, xq, m.cols, acc);
    }
    if (!waited)
        pdl_begin();
    for (; p < pairs; p += 32) {
#pragma unroll
        for (int k = 0; k < R; k++)
            q4k_pair_load(row[k], p, &v[0][k]);
        q4k_pair_dot<NX, R>(v[0], p, xq, m.cols, acc);
    }
}

/* Units of each lane in flight before any is used: one warp a row is too few to cover the
 * memory's latency a unit at a time. */
#define QGEMV_UNROLL 4

/* acc[j] = this lane's part of row r of m · row j of the quantized x (xq), for j < NX: a lane a
 * unit at a time, QGEMV_UNROLL units (the lane's, 32 apart) read before any is multiplied. The
 * kernel's pdl_begin comes in here, after the first units were asked for (the weights do not
 * wait for the kernel before; x does: launch.h); the first batch outside the loop, as
 * gemv_row's. */
template <int QT, int NX>
__device__ __forceinline__ void qrow_int(const struct qmat &m, int64_t r, const uint8_t *xq,
                                         int lane, float *acc) {
    if constexpr (QT == LLMEM_QTYPE_Q4_K) {
        qrow_q4k<NX, 1>(m, r, xq, lane, (float(*)[NX])acc);
        return;
    }
    constexpr int U = QGEMV_UNROLL;
    const uint8_t *row = m.codes + r * m.row_bytes;
    const int64_t units = m.cols / 32;
    uint32_t w[U][8];
    float sc[U][2], off[U][2];
    int64_t u = lane;
#pragma unroll
    for (int j = 0; j < NX; j++)
        acc[j] = 0;
    bool waited = false;
    if (u + 32 * (U - 1) < units) {
#pragma unroll
        for (int i = 0; i < U; i++)
            qunit_codes<QT>(row, u + 32 * i, w[i], sc[i], off[i]);
        pdl_begin(), waited = true;
#pragma unroll
        for (int i = 0; i < U; i++)
            qunit_dot<QT, NX>(w[i], sc[i], off[i], xq, m.cols, u + 32 * i, acc);
        u += 32 * U;
    }
    if (!waited)
        pdl_begin();
    for (; u + 32 * (U - 1) < units; u += 32 * U) {
#pragma unroll
        for (int i = 0; i < U; i++)
            qunit_codes<QT>(row, u + 32 * i, w[i], sc[i], off[i]);
#pragma unroll
        for (int i = 0; i < U; i++)
            qunit_dot<QT, NX>(w[i], sc[i], off[i], xq, m.cols, u + 32 * i, acc);
    }
    for (; u < units; u += 32) {
        qunit_codes<QT>(row, u, w[0], sc[0], off[0]);
        qunit_dot<QT, NX>(w[0], sc[0], off[0], xq, m.cols, u, acc);
    }
}

/* qrow_int for a type known at run time (the same for the whole block). */
template <int NX>
__device__ __forceinline__ void qrow_int_any(int type, const struct qmat &m, int64_t r,
                                             const uint8_t *xq, int lane, float *acc) {
#define QROW(QT) qrow_int<QT, NX>(m, r, xq, lane, acc)
    QT_INT_DISPATCH(type, QROW)
#undef QROW
}

/* qgemv_kernel with x quantized (xq: quantize_x_kernel's rows), for a mixture's experts: a warp
 * per weight row. */
template <int QT, int NX>
static __global__ void __launch_bounds__(256)
    qgemv_int_kernel(struct qmat m, const uint8_t *xq, float *y, const float *bias,
                     struct qexperts ex) {
    if (ex.ids != NULL)
        expert_of<uint8_t>(ex, &m, &xq, xq_row_bytes(m.cols), &y);
    const int lane = threadIdx.x & 31;
    const int64_t r = blockIdx.x * 8 + threadIdx.x / 32;
    if (r >= m.rows) {
        pdl_begin();
        return;
    }
    float acc[NX];
    qrow_int<QT, NX>(m, r, xq, lane, acc);
    warp_store<NX>(acc, lane, y, m.rows, r, bias);
}

/* Up to three matrices of one x in one launch (q, k and v; gate and up): matrix i, of type
 * type[i], takes the blocks [first[i], first[i + 1]), eight rows a block; or, with swiglu, gate
 * (m[0]) and up (m[1]) of one shape, a block four rows of each, into y[0] = silu(gate) · up. */
struct qset {
    struct qmat m[3];
    int type[3];
    float *y[3];
    const float *bias[3];
    unsigned first[4];
};

/* Rows a warp of qgemv_set_kernel<NX, QT> takes: Q4_K one row of x, two (whose loads it issues
 * together, and whose x it reads once). */
template <int NX, int QT> struct qgemv_rows {
    static constexpr int R = QT == LLMEM_QTYPE_Q4_K && NX == 1 ? 2 : 1;
};

/* (Q4_K at one row of x: 80 registers, three blocks an SM; measured on the H200 against two
 * blocks at 123: 12.1 against 13.7 µs for 14336 × 4096, 13.8 against 11.7 for 4096 × 14336) */
#define QGEMV_BLOCKS(NX, QT) ((QT) != LLMEM_QTYPE_Q4_K ? 0 : (NX) == 1 ? 3 : (NX) == 2 ? 2 : 0)

template <int NX, int QT>
static __global__ void __launch_bounds__(256, QGEMV_BLOCKS(NX, QT))
    qgemv_set_kernel(struct qset s, const uint8_t *xq, int swiglu) {
    static_assert(QT == QT_ANY || QT == LLMEM_QTYPE_Q4_K, "qgemv_set_kernel's instances");
    constexpr int R = qgemv_rows<NX, QT>::R;
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    int i = 0;
    int64_t r;
    if (swiglu) {
        i = warp / 4, r = (blockIdx.x * 4 + warp % 4) * R;
    } else {
        while (i < 2 && blockIdx.x >= s.first[i + 1])
            i++;
        r = ((blockIdx.x - s.first[i]) * 8 + warp) * R;
    }
    const int64_t rows = s.m[i].rows;
    float acc[R][NX];
    if (r < rows) {
        if constexpr (QT == QT_ANY)
            qrow_int_any<NX>(s.type[i], s.m[i], r, xq, lane, acc[0]);
        else
            qrow_q4k<NX, R>(s.m[i], r, xq, lane, acc);
#pragma unroll
        for (int k = 0; k < R; k++)
            warp_sum<NX>(acc[k]);
    } else {
#pragma unroll
        for (int k = 0; k < R; k++)
#pragma unroll
            for (int j = 0; j < NX; j++)
                acc[k][j] = 0;
        pdl_begin();
    }
    if (!swiglu) {
        if (lane == 0)
#pragma unroll
            for (int k = 0; k < R; k++)
                if (r + k < rows)
#pragma unroll
                    for (int j = 0; j < NX; j++)
                        s.y[i][j * rows + r + k] =
                            s.bias[i] != NULL ? acc[k][j] + s.bias[i][r + k] : acc[k][j];
        return;
    }
    __shared__ float part[8][R][NX];
    if (lane == 0)
#pragma unroll
        for (int k = 0; k < R; k++)
#pragma unroll
            for (int j = 0; j < NX; j++)
                part[warp][k][j] = acc[k][j];
    __syncthreads();
    if (warp < 4 && lane == 0)
#pragma unroll
        for (int k = 0; k < R; k++)
            if (r + k < rows)
#pragma unroll
                for (int j = 0; j < NX; j++)
                    s.y[0][j * rows + r + k] = silu_mul(part[warp][k][j], part[warp + 4][k][j]);
}

/* Q4_K at one row of x, streamed: a grid of two blocks an SM, whose warps take the set's items in
 * turn (item i: rows 2i and 2i + 1 of a matrix, the matrices' items one after another from first[];
 * with swiglu row i of gate and row i of up), a batch of a pair a lane at a time, QSTREAM_STAGES
 * batches of each warp in flight: the weights of the next batches, of this item or the next, are
 * asked for before the current batch is multiplied, so that a warp never waits on the memory with
 * nothing else asked for, and no wave of short-lived blocks ends with the device half idle. */
#define QSTREAM_STAGES 3
struct qstream {
    unsigned first[4]; /* matrix i's items [first[i], first[i + 1]) */
};

static __global__ void __launch_bounds__(256, 2)
    qgemv_q4k_stream_kernel(struct qset s, struct qstream q, const uint8_t *xq, int swiglu) {
    constexpr int S = QSTREAM_STAGES;
    const int lane = threadIdx.x & 31;
    const unsigned gw = blockIdx.x * 8 + threadIdx.x / 32, tw = gridDim.x * 8;
    const int64_t cols = s.m[0].cols, rb = s.m[0].row_bytes;
    const int pairs = (int)(cols / 64), kb = (pairs + 31) / 32; /* a lane's batches an item */
    const unsigned items = q.first[3];
    const int total = gw < items ? (int)((items - gw + tw - 1) / tw) * kb : 0;

    /* item `it`'s matrix and first row */
    const auto item_at = [&](unsigned it, int *i, int64_t *r) {
        if (swiglu) {
            *i = 0, *r = it;
            return;
        }
        int m = 0;
        while (m < 2 && it >= q.first[m + 1])
            m++;
        *i = m, *r = 2 * (int64_t)(it - q.first[m]);
    };
    /* the loads of batch f (item f / kb of the warp's, pair lane + 32 (f mod kb)) into b */
    int li = 0, lk = 0; /* the next batch to ask for: the warp's item li, its batch lk */
    const auto issue = [&](struct q4k_pair *b) {
        if (li * kb + lk >= total)
            return;
        const int p = lane + 32 * lk;
        if (p < pairs) {
            int i;
            int64_t r;
            item_at(gw + (unsigned)li * tw, &i, &r);
            const uint8_t *r0, *r1;
            if (swiglu) {
                r0 = s.m[0].codes + r * rb, r1 = s.m[1].codes + r * rb;
            } else {
                const int64_t rows = s.m[i].rows;
                r0 = s.m[i].codes + r * s.m[i].row_bytes;
                r1 = s.m[i].codes + (r + 1 < rows ? r + 1 : r) * s.m[i].row_bytes;
            }
            q4k_pair_load(r0, p, &b[0]);
            q4k_pair_load(r1, p, &b[1]);
        }
        if (++lk == kb)
            lk = 0, li++;
    };

    struct q4k_pair v[S][2];
#pragma unroll
    for (int st = 0; st < S - 1; st++)
        issue(v[st]);
    pdl_begin(); /* (the weights before: launch.h) */
    float acc[2][1] = {{0.0f}, {0.0f}};
    int ci = 0, ck = 0; /* the batch to multiply */
    for (int f0 = 0; f0 < total; f0 += S) {
#pragma unroll
        for (int st = 0; st < S; st++) {
            if (f0 + st >= total)
                break;
            issue(v[(st + S - 1) % S]);
            const int p = lane + 32 * ck;
            if (p < pairs)
                q4k_pair_dot<1, 2>(v[st], p, xq, cols, acc);
            if (++ck < kb)
                continue;
            warp_sum<1>(acc[0]), warp_sum<1>(acc[1]);
            int i;
            int64_t r;
            item_at(gw + (unsigned)ci * tw, &i, &r);
            if (lane == 0) {
                if (swiglu) {
                    s.y[0][r] = silu_mul(acc[0][0], acc[1][0]);
                } else {
                    const float *bias = s.bias[i];
                    s.y[i][r] = bias != NULL ? acc[0][0] + bias[r] : acc[0][0];
                    if (r + 1 < s.m[i].rows)
                        s.y[i][r + 1] = bias != NULL ? acc[1][0] + bias[r + 1] : acc[1][0];
                }
            }
            acc[0][0] = acc[1][0] = 0.0f;
            ck = 0, ci++;
        }
    }
}

/* ---- fast precision, more rows of x: integer products on the tensor cores ---------------------
 *
 * From QGEMV_MAX_ROWS + 1 to QMMA_MAX_ROWS rows of x (a batch's decode), the same types multiply
 * their codes by x quantized to 8 bits on the tensor cores: an m16n8k32 product of a unit's
 * unsigned codes (16 weight rows) by its signed x (8 rows of x) into s32 sums. Q8_0 and Q4_0
 * scale each unit's sums into f32 as qunit_dot scales dp4a's; Q5_K sums them in integers over a
 * super-block (qmma_int). A block takes
 * QMMA_ROWS weight rows and up to 8·NT rows of x, over a slice of the units, QMMA_STEP units a
 * step. Each step's blocks of the 64 rows and its x are copied into shared memory (cp.async, the
 * next step's while this one is multiplied); the block's threads then decode the step's (row,
 * unit) pairs there (qunit_codes) into tiles of codes and scales, and each warp multiplies 16 rows
 * by one tile of x. (Q4_K and Q6_K take a kernel of their own, below.) x is quantized for this kernel in
 * the operands' own order (struct xfrag), so that its copy is contiguous and a lane reads its
 * operand in one load. The slices (split-K, so that a matrix of few rows still fills the device)
 * are added in order by the last block of a row group to finish (k_out); their count depends on
 * the matrix's shape alone, so that a row of x's products do not depend on the rows beside it.
 */
#define QMMA_ROWS 64
#define QMMA_STEP 8

/* A unit of 8 rows of x (j, the rows 8j … 8j + 7), as the m16n8k32 product's B operand: q[l] the
 * two words of lane l (row l / 4, values 4·(l % 4) … + 3 and 16 + 4·(l % 4) … + 3), d the rows'
 * scales, s[k] the sums of the halves of rows 2k and 2k + 1: of x (f32), or for the K types (x in
 * blocks of 256) of the codes (s32). Stored [j][unit]. */
struct xfrag {
    uint2 q[32];
    float d[8];
    float4 s[4];
};

/* v summed over each 16 lanes (lanes 0–15, 16–31), in every lane. */
template <class T> __device__ __forceinline__ T half_warp_sum(T v) {
    for (int o = 8; o > 0; o /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* A warp per block of BU units (32·BU values, one scale) of a row of x (blockIdx.y, up to a whole
 * tile of 8: the rows from n on are zeros), into xfrag, with the sums of x (BU = 1: the 32-value
 * types) or of the codes (BU = QMMA_STEP: the K types, as the CPU's fast path quantizes x for
 * them). */
template <int BU>
static __global__ void quantize_x_frag_kernel(const float *x, int64_t cols, int64_t n,
                                              struct xfrag *out) {
    pdl_begin();
    const int lane = threadIdx.x & 31;
    const int64_t b = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32, t = blockIdx.y;
    const int64_t units = cols / 32;
    if (b >= units / BU)
        return;
    float v[BU], amax = 0.0f;
#pragma unroll
    for (int u = 0; u < BU; u++) {
        v[u] = t < n ? x[t * cols + 32 * (BU * b + u) + lane] : 0.0f;
        amax = fmaxf(amax, fabsf(v[u]));
    }
    for (int o = 16; o > 0; o /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    const int r = (int)(t % 8);
#pragma unroll
    for (int u = 0; u < BU; u++) {
        struct xfrag *f = out + (t / 8) * units + BU * b + u;
        const int q = __float2int_rn(v[u] * id);
        ((uint8_t *)&f->q[4 * r + (lane % 16) / 4])[4 * (lane / 16) + lane % 4] = (uint8_t)q;
        if (lane == 0)
            f->d[r] = d;
        const int at = 2 * (r % 2) + lane / 16; /* (a half's sum, of rows 2k and 2k + 1) */
        if constexpr (BU == 1) {
            const float sum = half_warp_sum(v[u]);
            if (lane % 16 == 0)
                ((float *)&f->s[r / 2])[at] = sum;
        } else {
            const int sum = half_warp_sum(q);
            if (lane % 16 == 0)
                ((int *)&f->s[r / 2])[at] = sum;
        }
    }
}

/* Whether qmma_kernel sums the K types' products in integers per super-block, as the CPU's fast
 * path does (backend/cpu/matmul_q.c): Σ_j sc_j · Σ code·q (sc_j the sub-block's integer scale)
 * and Σ_j m_j · Σ q, scaled once per super-block by d·dx and dmin·dx, x in blocks of 256. */
template <int QT> struct qmma_int {
    static constexpr bool K = QT == LLMEM_QTYPE_Q5_K; /* (Q4_K and Q6_K: qmma_k_kernel) */
};

/* The integer scales of sub-block k of the K-type super-block at b (in shared memory): its two
 * halves' scales and its min. */
template <int QT> __device__ __forceinline__ int4 qunit_iscales(const uint8_t *b, int k) {
    const uint8_t *s = b + 4;
    const bool lo = k < 4;
    const int c0 = s[lo ? k : k + 4], c1 = s[lo ? k + 4 : k - 4], c2 = s[k];
    const int scale = lo ? c0 & 63 : (c0 & 0xf) | (c1 >> 6) << 4;
    const int min = lo ? c1 & 63 : (c0 >> 4) | (c2 >> 6) << 4;
    return make_int4(scale, scale, min, 0);
}

/* Bytes of a row's blocks of a step, and of their copy in shared memory (from the 16 bytes they
 * start in, whole 16 bytes). */
template <int QT> struct qmma_bytes {
    static constexpr int STEP = qt<QT>::BB * (32 * QMMA_STEP / qt<QT>::BE);
    static constexpr int COPY = (STEP + 15 + 15) / 16 * 16;
};

/* Word i of row r of a unit's codes in the warp's tile: halves swapped in rows 4–7 and 12–15, so
 * that the eight rows a fragment's load reads fall in distinct banks. */
__device__ __forceinline__ int qmma_word(int r, int i) {
    return i ^ (r & 4);
}

/* The dynamic shared memory of qmma_kernel<QT, NT>: per warp its decoded codes [unit][row][8] and
 * scales (sc and sc·B + off of a unit's two halves, or qunit_iscales's), the K types' d and dmin
 * per row; then two stages of the rows' blocks and of x
 * (after 16 bytes that Q6_K's reads may reach before the first row). */
template <int QT, int NT> struct qmma_smem {
    static constexpr int CODES = QMMA_ROWS / 16 * QMMA_STEP * 16 * 32;
    static constexpr int SCALES = QMMA_ROWS / 16 * QMMA_STEP * 16 * 16;
    static constexpr int DD = QMMA_ROWS * 8; /* the K types: d and dmin of a row's super-block */
    static constexpr int W = QMMA_ROWS * qmma_bytes<QT>::COPY;
    static constexpr int X = NT * QMMA_STEP * (int)sizeof(struct xfrag);
    static constexpr int BYTES = CODES + SCALES + DD + 16 + 2 * (W + X);
};

/* The copies of step s into stage b: the rows' blocks (from the 16 bytes they start in; those
 * past the last row not at all) and x's units of the step, 16 bytes a thread at a time. */
template <int QT, int NT>
__device__ __forceinline__ void qmma_copy(const struct qmat &m, int64_t r0, int64_t s,
                                          int64_t units, const struct xfrag *xf, int nt,
                                          uint8_t *w, uint8_t *xs, bool weights, bool x) {
    constexpr int CH = qmma_bytes<QT>::COPY / 16;
    const int64_t step_units =
        units - s * QMMA_STEP < QMMA_STEP ? units - s * QMMA_STEP : QMMA_STEP;
    if (weights) {
        const int64_t bytes = step_units * 32 / qt<QT>::BE * qt<QT>::BB;
        for (int k = threadIdx.x; k < QMMA_ROWS * CH; k += blockDim.x) {
            const int r = k / CH, c = k % CH;
            if (r0 + r >= m.rows)
                break;
            const uint8_t *start = m.codes + (r0 + r) * m.row_bytes + s * qmma_bytes<QT>::STEP;
            const uint8_t *from = (const uint8_t *)((uintptr_t)start & ~(uintptr_t)15) + 16 * c;
            const int64_t left = start + bytes - from;
            if (left > 0)
                cp_async16<false>(smem_addr(w + r * qmma_bytes<QT>::COPY + 16 * c), from,
                                  left < 16 ? (int)left : 16);
        }
    }
    if (x) {
        constexpr int XC = (int)sizeof(struct xfrag) / 16;
        const int pieces = (int)step_units * XC;
        for (int k = threadIdx.x; k < ((nt + 7) / 8) * pieces; k += blockDim.x) {
            const int j = k / pieces, p = k % pieces;
            cp_async16<true>(smem_addr(xs + (j * QMMA_STEP * XC + p) * 16),
                             (const uint8_t *)(xf + j * units + s * QMMA_STEP) + 16 * p, 16);
        }
    }
}

/* Where a batch kernel's block puts its sums y[c][r] (c < n, r < rows): into y (+ bias) when
 * it is the only slice of K (gridDim.y = 1); otherwise into its slice of slices ([gridDim.y][n]
 * [rows]), and the last of blockIdx.x's blocks to finish (last_slice, by its counter, zero
 * before and after) adds the slices in order into y (merge), with bias: the same sums whichever
 * block is last. */
struct k_out {
    int64_t rows;
    int n;
    float *slices, *y;
    const float *bias;

    __device__ __forceinline__ void put(int64_t r, int c, float v) const {
        if (r >= rows || c >= n)
            return;
        if (gridDim.y > 1)
            slices[((int64_t)blockIdx.y * n + c) * rows + r] = v;
        else
            y[c * rows + r] = bias != NULL ? v + bias[r] : v;
    }

    /* Called by every thread of the block after its puts. */
    __device__ __forceinline__ bool last_slice(unsigned *counts) const {
        __shared__ unsigned before;
        if (gridDim.y == 1)
            return false;
        __syncthreads(); /* the block's sums before thread 0's release */
        if (threadIdx.x == 0) {
            unsigned b;
            asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                         : "=r"(b)
                         : "l"(counts + blockIdx.x)
                         : "memory");
            if (b == gridDim.y - 1)
                counts[blockIdx.x] = 0;
            before = b;
        }
        __syncthreads(); /* the others' reads after thread 0's acquire */
        return before == gridDim.y - 1;
    }

    __device__ __forceinline__ void merge(int64_t r, int c) const {
        if (r >= rows || c >= n)
            return;
        const int64_t i = c * rows + r, count = n * rows;
        float v = __ldcg(slices + i);
        for (unsigned s = 1; s < gridDim.y; s++)
            v += __ldcg(slices + s * count + i);
        y[i] = bias != NULL ? v + bias[r] : v;
    }
};

/* y = n ≤ 8·NT rows of x (xf: quantize_x_frag_kernel's) · rows [64·blockIdx.x, +64) of m over
 * the units of steps [per·blockIdx.y, per·(blockIdx.y + 1)) (+ bias), the slices of K as
 * k_out puts them. 4·NT warps: warp w multiplies
 * the 16 rows 16·(w % 4) … by the tile of x w / 4; the whole block decodes a step's (row, unit)
 * pairs first. (Four warps, each over every tile, left too few warps an SM to cover the
 * latencies of a step's chain of decode, loads and products.) */
template <int QT, int NT>
static __global__ void __launch_bounds__(128 * NT)
    qmma_kernel(struct qmat m, const struct xfrag *xf, int n, int per, float *slices,
                unsigned *counts, float *y, const float *bias) {
    extern __shared__ __align__(16) uint8_t qmma_shared[];
    using S = qmma_smem<QT, NT>;
    uint32_t(*codes)[QMMA_STEP][16][8] = (uint32_t(*)[QMMA_STEP][16][8])qmma_shared;
    float4(*scales)[QMMA_STEP][16] = (float4(*)[QMMA_STEP][16])(qmma_shared + S::CODES);
    float2(*dd)[16] = (float2(*)[16])(qmma_shared + S::CODES + S::SCALES);
    uint8_t *stage = qmma_shared + S::CODES + S::SCALES + S::DD + 16;
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int wg = warp % 4, j = warp / 4; /* this warp's 16 rows and tile of x */
    const bool has_tile = 8 * j < n;
    const int64_t r0 = blockIdx.x * (int64_t)QMMA_ROWS;
    const int64_t units = m.cols / 32, steps = (units + QMMA_STEP - 1) / QMMA_STEP;
    const int64_t s0 = (int64_t)blockIdx.y * per, s1 = s0 + per < steps ? s0 + per : steps;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (s0 < s1) /* the weights before the wait (launch.h), x after */
        qmma_copy<QT, NT>(m, r0, s0, units, xf, n, stage, stage + S::W, true, false);
    pdl_begin();
    if (s0 < s1)
        qmma_copy<QT, NT>(m, r0, s0, units, xf, n, stage, stage + S::W, false, true);
    cp_commit();
    for (int64_t s = s0; s < s1; s++) {
        uint8_t *w = stage + (s - s0) % 2 * (S::W + S::X), *xs = w + S::W;
        if (s + 1 < s1) {
            uint8_t *w1 = stage + (s + 1 - s0) % 2 * (S::W + S::X);
            qmma_copy<QT, NT>(m, r0, s + 1, units, xf, n, w1, w1 + S::W, true, true);
        }
        cp_commit();
        cp_wait<1>();
        __syncthreads(); /* step s's copies are in */
        /* pair p: row p % 64 (of warp group dr / 16), unit p / 64 of the step */
        for (int p = threadIdx.x; p < QMMA_ROWS * QMMA_STEP; p += 128 * NT) {
            const int rr = p % QMMA_ROWS, u = p / QMMA_ROWS, pg = rr / 16, dr = rr % 16;
            const uint8_t *start = m.codes + (r0 + rr) * m.row_bytes + s * qmma_bytes<QT>::STEP;
            const uint8_t *row = w + rr * qmma_bytes<QT>::COPY + ((uintptr_t)start & 15);
            uint32_t c[8];
            float sc[2], off[2];
            if (r0 + rr < m.rows && s * QMMA_STEP + u < units) {
                qunit_codes<QT, true>(row, u, c, sc, off);
                if constexpr (qmma_int<QT>::K) {
                    const int4 is = qunit_iscales<QT>(row, u);
                    sc[0] = __int_as_float(is.x), sc[1] = __int_as_float(is.y);
                    off[0] = __int_as_float(is.z);
                    if (u == 0)
                        dd[pg][dr] = make_float2(f16_at<true>(row), f16_at<true>(row + 2));
                }
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++)
                    c[k] = 0;
                sc[0] = sc[1] = off[0] = off[1] = 0.0f;
                if (qmma_int<QT>::K && u == 0)
                    dd[pg][dr] = make_float2(0.0f, 0.0f);
            }
            uint4 *a = (uint4 *)codes[pg][u][dr];
            a[qmma_word(dr, 0) / 4] = make_uint4(c[0], c[1], c[2], c[3]);
            a[qmma_word(dr, 4) / 4] = make_uint4(c[4], c[5], c[6], c[7]);
            scales[pg][u][dr] = qmma_int<QT>::K
                                    ? make_float4(sc[0], sc[1], off[0], 0.0f) /* (integers) */
                                    : make_float4(sc[0], sc[1], fmaf(sc[0], qt<QT>::B, off[0]),
                                                  fmaf(sc[1], qt<QT>::B, off[1]));
        }
        __syncthreads(); /* the step's codes are decoded */
        const struct xfrag *xt = (const struct xfrag *)xs + j * QMMA_STEP;
        int s1i[4] = {0, 0, 0, 0}, s2i[4] = {0, 0, 0, 0}; /* the K types' integer sums */
#pragma unroll
        for (int u = 0; u < QMMA_STEP; u++) {
            if (!has_tile || s * QMMA_STEP + u >= units)
                break;
            const uint32_t(*a)[8] = codes[wg][u];
            const uint32_t af[4] = {a[g][qmma_word(g, q)], a[g + 8][qmma_word(g, q)],
                                    a[g][qmma_word(g, 4 + q)], a[g + 8][qmma_word(g, 4 + q)]};
            const float4 sa = scales[wg][u][g], sb = scales[wg][u][g + 8];
            const struct xfrag *f = xt + u;
            const uint2 b = f->q[lane];
            const float2 dx = *(const float2 *)&f->d[2 * q];
            const float4 x4 = f->s[q];
            int lo[4] = {0, 0, 0, 0};
            if constexpr (qmma_int<QT>::K) {
                const int4 ia = *(const int4 *)&sa, ib = *(const int4 *)&sb;
                const int4 qs = *(const int4 *)&x4;
                mma_u8s8(lo, af, b.x, b.y);
                const int q0 = qs.x + qs.y, q1 = qs.z + qs.w;
                s1i[0] += ia.x * lo[0], s1i[1] += ia.x * lo[1];
                s1i[2] += ib.x * lo[2], s1i[3] += ib.x * lo[3];
                s2i[0] += ia.z * q0, s2i[1] += ia.z * q1;
                s2i[2] += ib.z * q0, s2i[3] += ib.z * q1;
            } else {
                mma_u8s8(lo, af, b.x, b.y);
                acc[0] += sa.x * dx.x * (float)lo[0] - sa.z * (x4.x + x4.y);
                acc[1] += sa.x * dx.y * (float)lo[1] - sa.z * (x4.z + x4.w);
                acc[2] += sb.x * dx.x * (float)lo[2] - sb.z * (x4.x + x4.y);
                acc[3] += sb.x * dx.y * (float)lo[3] - sb.z * (x4.z + x4.w);
            }
        }
        if (qmma_int<QT>::K && has_tile) { /* the step's super-block: d·dx·S1 − dmin·dx·S2 */
            const float2 da = dd[wg][g], db = dd[wg][g + 8];
            const float2 dx = *(const float2 *)&xt[0].d[2 * q];
            acc[0] = fmaf(da.x * dx.x, (float)s1i[0], acc[0]);
            acc[1] = fmaf(da.x * dx.y, (float)s1i[1], acc[1]);
            acc[2] = fmaf(db.x * dx.x, (float)s1i[2], acc[2]);
            acc[3] = fmaf(db.x * dx.y, (float)s1i[3], acc[3]);
            acc[0] = fmaf(-(da.y * dx.x), (float)s2i[0], acc[0]);
            acc[1] = fmaf(-(da.y * dx.y), (float)s2i[1], acc[1]);
            acc[2] = fmaf(-(db.y * dx.x), (float)s2i[2], acc[2]);
            acc[3] = fmaf(-(db.y * dx.y), (float)s2i[3], acc[3]);
        }
        __syncthreads(); /* the stage and the codes are free for the next step */
    }
    const struct k_out o = {m.rows, n, slices, y, bias};
    if (has_tile)
#pragma unroll
        for (int e = 0; e < 4; e++)
            o.put(r0 + wg * 16 + g + 8 * (e / 2), 8 * j + 2 * q + e % 2, acc[e]);
    if (!o.last_slice(counts) || !has_tile)
        return;
#pragma unroll
    for (int e = 0; e < 4; e++)
        o.merge(r0 + wg * 16 + g + 8 * (e / 2), 8 * j + 2 * q + e % 2);
}

/* ---- Q4_K and Q6_K on the tensor cores, the weights straight from memory -----------------------
 *
 * Q4_K and Q6_K take a kernel of their own (qmma_k_kernel): a lane reads its operands' bytes of
 * the weights from memory (no copy through shared memory, no decode into a tile), as the m16n8k32
 * product's A operand takes them: a K-slot order in which lane (g, q) holds values 8q … 8q + 7 of
 * a unit (in place of 4q … 4q + 3 and 16 + 4q … 16 + 4q + 3: the products sum over k in any
 * order, and x is laid out in the same order, struct xk4), so that a lane's operand words of a
 * row are 8 consecutive bytes of the codes (struct kq says how each type's are). Per super-block
 * the sums of integers as qmma_kernel's, scaled once by d·dx (and dmin·dx). A block is 8 warps:
 * two groups of 16 rows by four parts of the super-blocks (every fourth), the parts added in order
 * at the end; split-K slices as qmma_kernel's.
 */

/* Eight rows of x (a tile), one super-block of 256 values, for qmma_k_kernel: q[u][l] the 8
 * codes lane l takes for unit u (row l / 4 of the tile, values 32u + 8·(l % 4) …), d the rows'
 * scales, sum[r][u] the sums of row r's codes over unit u. Stored [tile][super-block]. */
struct xk4 {
    uint2 q[8][32];
    float d[8];
    short sum[8][8];
};

/* A warp per super-block (blockIdx.x · 8 + warp) of a row of x (blockIdx.y; from n on zeros):
 * quantized as quantize_x_frag_kernel<QMMA_STEP> quantizes it (d = max|x| / 127 over the 256),
 * lane l taking values 8l … 8l + 7. */
static __global__ void quantize_x_k4_kernel(const float *x, int64_t cols, int64_t n,
                                            struct xk4 *out) {
    pdl_begin();
    const int lane = threadIdx.x & 31;
    const int64_t b = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32, t = blockIdx.y;
    const int64_t blocks = cols / 256;
    if (b >= blocks)
        return;
    float v[8], amax = 0.0f;
    if (t < n) {
        const float4 *p = (const float4 *)(x + t * cols + 256 * b + 8 * lane);
        const float4 a = p[0], c = p[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = c.x, v[5] = c.y, v[6] = c.z,
        v[7] = c.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            v[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 8; i++)
        amax = fmaxf(amax, fabsf(v[i]));
    for (int o = 16; o > 0; o /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    uint32_t w[2] = {0, 0};
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int q = __float2int_rn(v[i] * id);
        w[i / 4] |= (uint32_t)(q & 0xff) << (8 * (i % 4));
        sum += q;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1); /* the unit's four lanes */
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int r = (int)(t % 8), u = lane / 4;
    struct xk4 *f = out + (t / 8) * blocks + b;
    f->q[u][4 * r + lane % 4] = make_uint2(w[0], w[1]);
    if (lane == 0)
        f->d[r] = d;
    if (lane % 4 == 0)
        f->sum[r][u] = (short)sum;
}

/* d = c + a.h0·b.b0 + a.h1·b.b1 (LO) or · b.b2, b.b3: a two signed 16-bit, b unsigned bytes. */
template <bool LO> __device__ __forceinline__ int dp2a_su(uint32_t a, uint32_t b, int c) {
    int d;
    if constexpr (LO)
        asm("dp2a.lo.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    else
        asm("dp2a.hi.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

/* One row's super-block for a lane of qmma_k_kernel<Q4_K>: its head (d, dmin, scales) and the
 * lane's 8 bytes of each of the four 32-byte code chunks. */
struct q4k_lane {
    uint4 hd;
    uint2 c[4];
};

__device__ __forceinline__ void q4k_lane_load(const uint8_t *b, int q, struct q4k_lane *v) {
    v->hd = __ldg((const uint4 *)b);
#pragma unroll
    for (int c = 0; c < 4; c++)
        v->c[c] = __ldg((const uint2 *)(b + 16 + 32 * c + 8 * q));
}

/* The 8 bytes at p, p 2-byte aligned (Q6_K's 210-byte blocks): the aligned words around them
 * and funnel shifts. Reads [p & ~7, (p & ~7) + 16) when p is not 8-byte aligned. */
__device__ __forceinline__ uint2 ld8_a2(const uint8_t *p) {
    const uint32_t o = (uint32_t)((uintptr_t)p & 7);
    const uint2 *a = (const uint2 *)(p - o);
    const uint2 w0 = __ldg(a), w1 = o != 0 ? __ldg(a + 1) : make_uint2(0, 0);
    const bool hi = (o & 4) != 0;
    const uint32_t sh = (o & 2) * 8;
    const uint32_t t0 = hi ? w0.y : w0.x, t1 = hi ? w1.x : w0.y, t2 = hi ? w1.y : w1.x;
    return make_uint2(__funnelshift_r(t0, t1, sh), __funnelshift_r(t1, t2, sh));
}

/* The 2-byte-aligned 16-bit word at p. */
__device__ __forceinline__ uint32_t ld2(const uint8_t *p) {
    return __ldg((const unsigned short *)p);
}

/* A lane's share of one super-block of its warp's rows g (a) and g + 8 (b) for qmma_k_kernel
 * (load), and its products with a stage's tiles of x into acc (dot, tile j's super-block at
 * xs[4j]: per super-block the sums of integers as qmma_kernel's, scaled once by d·dx). */
template <int QT> struct kq;

/* Q4_K: the 32 values of sub-block 2c and 2c + 1 are the low and high nibbles of the same 32
 * bytes, so that the lane's 8 of them are both units' operand words; Σ_u sc_u · Σ code·q and
 * Σ_u m_u · Σ q (the latter by dp2a over x's 16-bit unit sums). */
template <> struct kq<LLMEM_QTYPE_Q4_K> {
    struct q4k_lane a, b;

    __device__ __forceinline__ void load(const uint8_t *ra, const uint8_t *rb, int q) {
        q4k_lane_load(ra, q, &a), q4k_lane_load(rb, q, &b);
    }

    template <int NT>
    __device__ __forceinline__ void dot(const struct xk4 *xs, int tiles, int lane,
                                        float (*acc)[4]) const {
        const int q = lane & 3;
        uint32_t sa[2], ma[2], sbs[2], mb[2];
        q4k_scales(a.hd, sa, ma), q4k_scales(b.hd, sbs, mb);
        int s1i[NT][4];
#pragma unroll
        for (int j = 0; j < NT; j++)
            s1i[j][0] = s1i[j][1] = s1i[j][2] = s1i[j][3] = 0;
#pragma unroll
        for (int c = 0; c < 4; c++) {
#pragma unroll
            for (int h = 0; h < 2; h++) { /* unit 2c + h: the low or high nibbles */
                const int u = 2 * c + h, sh = 4 * h;
                const uint32_t af[4] = {(a.c[c].x >> sh) & 0x0f0f0f0fu,
                                        (b.c[c].x >> sh) & 0x0f0f0f0fu,
                                        (a.c[c].y >> sh) & 0x0f0f0f0fu,
                                        (b.c[c].y >> sh) & 0x0f0f0f0fu};
                const int sca = (int)((sa[u / 4] >> (8 * (u % 4))) & 0xff),
                          scb = (int)((sbs[u / 4] >> (8 * (u % 4))) & 0xff);
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    if (j >= tiles)
                        break;
                    const uint2 x = xs[4 * j].q[u][lane];
                    int lo[4] = {0, 0, 0, 0};
                    mma_u8s8(lo, af, x.x, x.y);
                    s1i[j][0] += sca * lo[0], s1i[j][1] += sca * lo[1];
                    s1i[j][2] += scb * lo[2], s1i[j][3] += scb * lo[3];
                }
            }
        }
        const float da = f16_lo(a.hd.x);
        const float dma = f16_hi(a.hd.x);
        const float db = f16_lo(b.hd.x);
        const float dmb = f16_hi(b.hd.x);
#pragma unroll
        for (int j = 0; j < NT; j++) {
            if (j >= tiles)
                break;
            const struct xk4 *f = xs + 4 * j;
            const float2 dx = *(const float2 *)&f->d[2 * q];
            const uint4 x0 = *(const uint4 *)f->sum[2 * q], x1 = *(const uint4 *)f->sum[2 * q + 1];
            /* Σ_u m_u · Σ q over the units, rows a and b by x's rows 2q and 2q + 1 */
            int s2[4];
            s2[0] = dp2a_su<false>(x0.w, ma[1], dp2a_su<true>(x0.z, ma[1],
                    dp2a_su<false>(x0.y, ma[0], dp2a_su<true>(x0.x, ma[0], 0))));
            s2[1] = dp2a_su<false>(x1.w, ma[1], dp2a_su<true>(x1.z, ma[1],
                    dp2a_su<false>(x1.y, ma[0], dp2a_su<true>(x1.x, ma[0], 0))));
            s2[2] = dp2a_su<false>(x0.w, mb[1], dp2a_su<true>(x0.z, mb[1],
                    dp2a_su<false>(x0.y, mb[0], dp2a_su<true>(x0.x, mb[0], 0))));
            s2[3] = dp2a_su<false>(x1.w, mb[1], dp2a_su<true>(x1.z, mb[1],
                    dp2a_su<false>(x1.y, mb[0], dp2a_su<true>(x1.x, mb[0], 0))));
            acc[j][0] = fmaf(da * dx.x, (float)s1i[j][0], acc[j][0]);
            acc[j][1] = fmaf(da * dx.y, (float)s1i[j][1], acc[j][1]);
            acc[j][2] = fmaf(db * dx.x, (float)s1i[j][2], acc[j][2]);
            acc[j][3] = fmaf(db * dx.y, (float)s1i[j][3], acc[j][3]);
            acc[j][0] = fmaf(-(dma * dx.x), (float)s2[0], acc[j][0]);
            acc[j][1] = fmaf(-(dma * dx.y), (float)s2[1], acc[j][1]);
            acc[j][2] = fmaf(-(dmb * dx.x), (float)s2[2], acc[j][2]);
            acc[j][3] = fmaf(-(dmb * dx.y), (float)s2[3], acc[j][3]);
        }
    }
};

/* Q6_K: unit u = (half h = u / 4, part j = u % 4); the lane's 8 values of it are 8 bytes of ql
 * (64h + 32·(j & 1) + 8q, nibble j / 2: one load for parts j and j + 2) and of qh (128 + 32h +
 * 8q, bits 2j: one load for the half), taken less 32 as signed bytes; its two 16-value
 * sub-blocks (lanes q < 2 and q ≥ 2) have their own scales, so a unit is two products, each with
 * the other half's lanes zero: Σ_t sc_t · Σ (code − 32)·q. */
template <> struct kq<LLMEM_QTYPE_Q6_K> {
    uint2 ql[2][2][2], qh[2][2]; /* [row][h][j & 1], [row][h] */
    uint32_t sc[2][4];           /* the 16 signed 8-bit scales of each row */
    uint32_t d;                  /* the rows' d (f16), a in the low half */

    __device__ __forceinline__ void load(const uint8_t *ra, const uint8_t *rb, int q) {
        const uint8_t *r[2] = {ra, rb};
#pragma unroll
        for (int k = 0; k < 2; k++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                ql[k][h][0] = ld8_a2(r[k] + 64 * h + 8 * q);
                ql[k][h][1] = ld8_a2(r[k] + 64 * h + 32 + 8 * q);
                qh[k][h] = ld8_a2(r[k] + 128 + 32 * h + 8 * q);
            }
            const uint2 s = ld8_a2(r[k] + 192); /* (its words end before the block does) */
            sc[k][0] = s.x, sc[k][1] = s.y;
            sc[k][2] = ld2(r[k] + 200) | ld2(r[k] + 202) << 16;
            sc[k][3] = ld2(r[k] + 204) | ld2(r[k] + 206) << 16;
        }
        d = ld2(ra + 208) | ld2(rb + 208) << 16;
    }

    /* The signed codes (code − 32) of part j from a row's ql and qh words. */
    static __device__ __forceinline__ uint32_t codes(uint32_t l, uint32_t h, int j) {
        const uint32_t c =
            ((l >> (4 * (j >> 1))) & 0x0f0f0f0fu) | (((h >> (2 * j)) & 0x03030303u) << 4);
        const uint32_t r = c ^ 0x20202020u, m = r & 0x20202020u; /* c − 32, sign-extended */
        return r | m << 1 | m << 2;
    }

    /* Signed scale t of row k. */
    __device__ __forceinline__ int scale(int k, int t) const {
        return (int)(int8_t)((sc[k][t / 4] >> (8 * (t % 4))) & 0xff);
    }

    template <int NT>
    __device__ __forceinline__ void dot(const struct xk4 *xs, int tiles, int lane,
                                        float (*acc)[4]) const {
        const int q = lane & 3;
        const bool first = q < 2; /* the lane's values in the unit's first 16 */
        int s1i[NT][4];
#pragma unroll
        for (int j = 0; j < NT; j++)
            s1i[j][0] = s1i[j][1] = s1i[j][2] = s1i[j][3] = 0;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int h = u / 4, pj = u % 4;
            const uint32_t ax = codes(ql[0][h][pj & 1].x, qh[0][h].x, pj),
                           ay = codes(ql[0][h][pj & 1].y, qh[0][h].y, pj),
                           bx = codes(ql[1][h][pj & 1].x, qh[1][h].x, pj),
                           by = codes(ql[1][h][pj & 1].y, qh[1][h].y, pj);
            const uint32_t f0[4] = {first ? ax : 0, first ? bx : 0, first ? ay : 0, first ? by : 0};
            const uint32_t f1[4] = {first ? 0 : ax, first ? 0 : bx, first ? 0 : ay, first ? 0 : by};
            const int t = 2 * u; /* = 8h + 2·pj: the first sub-block's scale */
            const int sa0 = scale(0, t), sa1 = scale(0, t + 1), sb0 = scale(1, t),
                      sb1 = scale(1, t + 1);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                if (j >= tiles)
                    break;
                const uint2 x = xs[4 * j].q[u][lane];
                int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
                mma_s8s8(lo, f0, x.x, x.y);
                mma_s8s8(hi, f1, x.x, x.y);
                s1i[j][0] += sa0 * lo[0] + sa1 * hi[0], s1i[j][1] += sa0 * lo[1] + sa1 * hi[1];
                s1i[j][2] += sb0 * lo[2] + sb1 * hi[2], s1i[j][3] += sb0 * lo[3] + sb1 * hi[3];
            }
        }
        const float da = f16_lo(d);
        const float db = f16_hi(d);
#pragma unroll
        for (int j = 0; j < NT; j++) {
            if (j >= tiles)
                break;
            const float2 dx = *(const float2 *)&xs[4 * j].d[2 * q];
            acc[j][0] = fmaf(da * dx.x, (float)s1i[j][0], acc[j][0]);
            acc[j][1] = fmaf(da * dx.y, (float)s1i[j][1], acc[j][1]);
            acc[j][2] = fmaf(db * dx.x, (float)s1i[j][2], acc[j][2]);
            acc[j][3] = fmaf(db * dx.y, (float)s1i[j][3], acc[j][3]);
        }
    }
};

/* Shared memory of qmma_k_kernel<QT, NT>: two stages of x, each the four super-blocks of an
 * iteration (one a part) by NT tiles, [tile][part]. */
template <int NT> struct k_smem {
    static constexpr int STAGE = 4 * NT * (int)sizeof(struct xk4);
    static constexpr int BYTES = 2 * STAGE;
};

/* The copy of x's super-blocks s … s + 3 (those below s1), tiles below `tiles`, into a stage:
 * a tile's four are consecutive in xk and in the stage. */
template <int NT>
__device__ __forceinline__ void k_copy_x(const struct xk4 *xk, int64_t blocks, int64_t s,
                                         int64_t s1, int tiles, uint8_t *stage) {
    const int chunks = (int)((s1 - s < 4 ? s1 - s : 4) * (int64_t)sizeof(struct xk4) / 16);
#pragma unroll
    for (int j = 0; j < NT; j++) {
        if (j >= tiles)
            break;
        const uint8_t *from = (const uint8_t *)(xk + j * blocks + s);
        uint8_t *to = stage + j * 4 * (int)sizeof(struct xk4);
        for (int k = threadIdx.x; k < chunks; k += 256)
            cp_async16<true>(smem_addr(to + 16 * k), from + 16 * k, 16);
    }
}

/* y = n ≤ 8·NT rows of x (xk: quantize_x_k4_kernel's) · rows [32·blockIdx.x, +32) of the
 * matrix m of type QT (Q4_K, Q6_K) over the super-blocks [per·blockIdx.y, +per) (+ bias), the
 * slices of K as k_out puts them. Iteration i takes super-blocks
 * s0 + 4i + part; its x is copied into shared memory (cp.async) during iteration i − 1, its
 * weights asked for then too. */
template <int QT, int NT>
static __global__ void __launch_bounds__(256, NT <= 4 ? 2 : 1)
    qmma_k_kernel(struct qmat m, const struct xk4 *xk, int n, int per, float *slices,
                  unsigned *counts, float *y, const float *bias) {
    extern __shared__ __align__(16) uint8_t k_shared[];
    constexpr int64_t BB = qt<QT>::BB;
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int rg = warp & 1, kp = warp >> 1; /* 16 rows, a fourth of the super-blocks */
    const int64_t blocks = m.cols / 256;
    const int64_t s0 = (int64_t)blockIdx.y * per, s1 = s0 + per < blocks ? s0 + per : blocks;
    const int64_t ra = blockIdx.x * 32 + 16 * rg + g, rb = ra + 8;
    /* (rows past the matrix read its last row, and are not stored) */
    const uint8_t *wa = m.codes + (ra < m.rows ? ra : m.rows - 1) * m.row_bytes;
    const uint8_t *wb = m.codes + (rb < m.rows ? rb : m.rows - 1) * m.row_bytes;
    const int tiles = (n + 7) / 8;
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    /* the first weights before the wait (launch.h), x after */
    struct kq<QT> v, nv;
    if (s0 + kp < s1)
        nv.load(wa + (s0 + kp) * BB, wb + (s0 + kp) * BB, q);
    pdl_begin();
    k_copy_x<NT>(xk, blocks, s0, s1, tiles, k_shared);
    cp_commit();
    for (int64_t s = s0, i = 0; s < s1; s += 4, i++) {
        const int64_t sb = s + kp;
        v = nv;
        if (sb + 4 < s1)
            nv.load(wa + (sb + 4) * BB, wb + (sb + 4) * BB, q);
        if (s + 4 < s1)
            k_copy_x<NT>(xk, blocks, s + 4, s1, tiles, k_shared + (i + 1) % 2 * k_smem<NT>::STAGE);
        cp_commit();
        cp_wait<1>();
        __syncthreads(); /* iteration i's x is in */
        if (sb < s1)
            v.template dot<NT>((const struct xk4 *)(k_shared + i % 2 * k_smem<NT>::STAGE) + kp,
                               tiles, lane, acc);
        __syncthreads(); /* the stage is free for iteration i + 2 */
    }
    /* the four parts added in order by part 0's warps (in the stages' memory, free now) */
    float(*part)[2][NT][4][32] = (float(*)[2][NT][4][32])k_shared;
    if (kp > 0)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                part[kp - 1][rg][j][e][lane] = acc[j][e];
    __syncthreads();
    const struct k_out o = {m.rows, n, slices, y, bias};
    if (kp == 0)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                o.put(e < 2 ? ra : rb, 8 * j + 2 * q + e % 2,
                      ((acc[j][e] + part[0][rg][j][e][lane]) + part[1][rg][j][e][lane]) +
                          part[2][rg][j][e][lane]);
    if (!o.last_slice(counts))
        return;
    if (kp == 0)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                o.merge(e < 2 ? ra : rb, 8 * j + 2 * q + e % 2);
}

/* ---- what gemm.cu and elementwise.cu call ---------------------------------------------------- */

int qgemv_int(const struct cuda_ctx *c, const struct llmem_weight *w) {
    return c->precision == LLMEM_PRECISION_FAST &&
           (w->quant == LLMEM_QTYPE_Q8_0 || w->quant == LLMEM_QTYPE_Q4_0 ||
            w->quant == LLMEM_QTYPE_Q4_K || w->quant == LLMEM_QTYPE_Q5_K ||
            w->quant == LLMEM_QTYPE_Q6_K);
}

/* qgemv_set_kernel<NX, QT> over the count matrices of s (blocks of 8·R rows, or with swiglu
 * 4·R rows of gate and of up). */
template <int NX, int QT>
static void qgemv_set_go(struct cuda_ctx *c, int count, struct qset s, const uint8_t *xq,
                         int swiglu) {
    constexpr int R = qgemv_rows<NX, QT>::R;
    s.first[0] = 0;
    for (int i = 0; i < 3; i++)
        s.first[i + 1] =
            s.first[i] + (i < count ? (unsigned)((s.m[i].rows + 8 * R - 1) / (8 * R)) : 0);
    const dim3 grid(swiglu ? (unsigned)((s.m[0].rows + 4 * R - 1) / (4 * R)) : s.first[3]);
    pdl_launch(c->stream, qgemv_set_kernel<NX, QT>, grid, dim3(256), 0, s, xq, swiglu);
}

/* Whether Q4_K at one row of x takes qgemv_q4k_stream_kernel: rows shorter than 4,096 values, of
 * fewer than two pairs a lane, which qgemv_set_kernel's warps read a pair at a time (no batch of
 * loads in flight). Longer rows it reads two pairs a lane at once, three blocks an SM, and there
 * the stream was slower (H100: the 8B shape at Q4_K_M 414.0 tokens/s with qgemv_set_kernel, 406.5
 * with the stream everywhere; the 1B shape, rows of 2,048 but the down projection's, 1,629 ->
 * 1,682-1,686 with the stream everywhere, 1,602 with it for the down projection alone). */
static bool q4k_streams(const struct qset &s) {
    return s.m[0].cols < 4096;
}

/* qgemv_q4k_stream_kernel over the count matrices of s. */
static void qgemv_q4k_stream_go(struct cuda_ctx *c, int count, const struct qset &s,
                                const uint8_t *xq, int swiglu) {
    struct qstream q = {};
    for (int i = 0; i < 3; i++)
        q.first[i + 1] =
            q.first[i] +
            (unsigned)(swiglu ? (i == 0 ? s.m[0].rows : 0)
                              : (i < count ? (s.m[i].rows + 1) / 2 : 0));
    /* as many items each warp (no warp's last item the device's tail alone), in up to
     * two blocks an SM */
    const unsigned items = q.first[3] > 0 ? q.first[3] : 1;
    const unsigned most = 16u * (unsigned)(sm_count() > 0 ? sm_count() : 132);
    const unsigned each = (items + most - 1) / most, warps = (items + each - 1) / each;
    pdl_launch(c->stream, qgemv_q4k_stream_kernel, dim3((warps + 7) / 8), dim3(256), 0, s, q,
               xq, swiglu);
}

/* qgemv_set_go for nx rows of x, of one type QT or any (QT_ANY); Q4_K's short rows at one row of
 * x streamed. */
template <int QT>
static void qgemv_set_launch(struct cuda_ctx *c, int count, int nx, const struct qset &s,
                             const uint8_t *xq, int swiglu) {
    switch (nx) {
    case 1:
        if (QT == LLMEM_QTYPE_Q4_K && q4k_streams(s))
            qgemv_q4k_stream_go(c, count, s, xq, swiglu);
        else
            qgemv_set_go<1, QT>(c, count, s, xq, swiglu);
        break;
    case 2: qgemv_set_go<2, QT>(c, count, s, xq, swiglu); break;
    case 3: qgemv_set_go<3, QT>(c, count, s, xq, swiglu); break;
    default: qgemv_set_go<4, QT>(c, count, s, xq, swiglu);
    }
}

void qgemv_set(struct cuda_ctx *c, int count, const struct llmem_weight *const *w, const float *x,
               int64_t n, float *const *y, const float *const *bias, int swiglu) {
    LLMEM_ASSERT(count >= 1 && count <= 3 && (!swiglu || count == 2));
    const int64_t cols = w[0]->cols, xrow = xq_row_bytes(cols);
    uint8_t *xq = (uint8_t *)wslice(c, (size_t)(n * xrow));
    if (xq == NULL)
        return;
    pdl_launch(c->stream, quantize_x_kernel, dim3((unsigned)((cols / 32 + 7) / 8), (unsigned)n),
               dim3(256), 0, x, (const float *)NULL, cols, xq);
    struct qset s = {};
    for (int i = 0; i < count; i++) {
        LLMEM_ASSERT(qgemv_int(c, w[i]) && w[i]->cols == cols);
        s.m[i] = qmat_of(w[i]), s.type[i] = w[i]->quant;
    }
    int same = w[0]->quant; /* the matrices' one type, or QT_ANY */
    for (int i = 1; i < count; i++)
        same = w[i]->quant == same ? same : QT_ANY;
    for (int64_t t = 0; t < n;) { /* up to 4 rows of x a launch */
        const int nx = n - t >= 4 ? 4 : (int)(n - t);
        for (int i = 0; i < (swiglu ? 1 : count); i++) /* (swiglu: one output) */
            s.y[i] = y[i] + t * w[i]->rows, s.bias[i] = bias != NULL ? bias[i] : NULL;
        const uint8_t *xt = xq + t * xrow;
        if (same == LLMEM_QTYPE_Q4_K)
            qgemv_set_launch<LLMEM_QTYPE_Q4_K>(c, count, nx, s, xt, swiglu);
        else
            qgemv_set_launch<QT_ANY>(c, count, nx, s, xt, swiglu);
        t += nx;
    }
    launched(c, swiglu ? "qgemv swiglu" : "qgemv");
}

/* kernel<<<grid, block, bytes>>>(args...) with `bytes` of dynamic shared memory, which the kernel
 * is allowed once per device (allowed: that kernel's own flags). */
template <typename... Params, typename... Args>
static void smem_launch(struct cuda_ctx *c, bool (&allowed)[64], void (*kernel)(Params...),
                        dim3 grid, dim3 block, int bytes, Args &&...args) {
    int dev = 0;
    if (check(c, cudaGetDevice(&dev), "device") != LLMEM_OK || dev < 0 || dev >= 64)
        return;
    /* (the threads of a split's ranks may ask at once: each sets the same limit) */
    if (!__atomic_load_n(&allowed[dev], __ATOMIC_ACQUIRE) &&
        check(c, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
              "qmma shared memory") == LLMEM_OK)
        __atomic_store_n(&allowed[dev], true, __ATOMIC_RELEASE);
    if (__atomic_load_n(&allowed[dev], __ATOMIC_ACQUIRE))
        pdl_launch(c->stream, kernel, grid, block, (size_t)bytes, std::forward<Args>(args)...);
}

template <int QT, int NT>
static void qmma_launch(struct cuda_ctx *c, dim3 grid, const struct qmat &m,
                        const struct xfrag *xf, int n, int per, float *part, float *y,
                        const float *bias) {
    static bool allowed[64];
    smem_launch(c, allowed, qmma_kernel<QT, NT>, grid, dim3(128 * NT), qmma_smem<QT, NT>::BYTES, m,
                xf, n, per, part, split_counters(c), y, bias);
}

template <int QT, int NT>
static void qmma_k_launch(struct cuda_ctx *c, dim3 grid, const struct qmat &m,
                          const struct xk4 *xk, int n, int per, float *part, float *y,
                          const float *bias) {
    static bool allowed[64];
    smem_launch(c, allowed, qmma_k_kernel<QT, NT>, grid, dim3(256), k_smem<NT>::BYTES, m, xk, n,
                per, part, split_counters(c), y, bias);
}

/* The split over K of a matrix of `groups` blocks of rows and `steps` steps: about two blocks of
 * threads a multiprocessor, at most `most` slices, each `per` whole steps. The count depends on
 * the matrix's shape alone, so that a row of x's products do not depend on the rows beside it.
 * A split matrix has fewer blocks of rows than the device has multiprocessors: a counter each
 * (k_out). */
struct split_k {
    int64_t slices, per;
};

static struct split_k split_k_of(int64_t groups, int64_t steps, int64_t most) {
    const int sms = sm_count() > 0 ? sm_count() : 132;
    int64_t slices = 2 * sms / groups;
    slices = slices < 1 ? 1 : slices > most ? most : slices;
    const int64_t per = (steps + slices - 1) / slices;
    LLMEM_ASSERT(slices == 1 || groups <= SPLIT_COUNTERS);
    return {(steps + per - 1) / per, per};
}

/* x as a matrix of type qt takes it on the tensor cores: Q4_K and Q6_K (qmma_k_kernel) the
 * super-blocks of struct xk4, the others (qmma_kernel) the units of struct xfrag with a scale
 * a unit (the 32-value types) or a super-block (Q5_K). */
enum { X_K4, X_FRAG1, X_FRAG8, X_LAYOUTS };
static constexpr int x_layout(int qt) {
    return qt == LLMEM_QTYPE_Q4_K || qt == LLMEM_QTYPE_Q6_K                       ? X_K4
           : qt == LLMEM_QTYPE_Q8_0 || qt == LLMEM_QTYPE_Q4_0 ? X_FRAG1
                                                                                   : X_FRAG8;
}
static constexpr bool takes_xk4(int qt) {
    return x_layout(qt) == X_K4;
}

/* The split over K of matrix m's kernel. */
static struct split_k qmma_split(const struct qmat &m, int qt) {
    if (takes_xk4(qt)) { /* (each slice at least a super-block for each of a block's four parts) */
        const int64_t blocks = m.cols / 256;
        return split_k_of((m.rows + 31) / 32, blocks, (blocks + 3) / 4);
    }
    const int64_t steps = (m.cols / 32 + QMMA_STEP - 1) / QMMA_STEP;
    return split_k_of((m.rows + QMMA_ROWS - 1) / QMMA_ROWS, steps, steps);
}

/* The kernel for matrix m of type QT on x (xk or xf as the type takes it), over the tiles of
 * its n rows. */
template <int QT>
static void qmma_go(struct cuda_ctx *c, const struct qmat &m, const struct xk4 *xk,
                    const struct xfrag *xf, int n, const struct split_k &k, float *part, float *y,
                    const float *bias) {
    const int tiles = (n + 7) / 8, per = (int)k.per;
    if constexpr (takes_xk4(QT)) {
        const dim3 grid((unsigned)((m.rows + 31) / 32), (unsigned)k.slices);
        if (tiles <= 2)
            qmma_k_launch<QT, 2>(c, grid, m, xk, n, per, part, y, bias);
        else if (tiles <= 4)
            qmma_k_launch<QT, 4>(c, grid, m, xk, n, per, part, y, bias);
        else
            qmma_k_launch<QT, 8>(c, grid, m, xk, n, per, part, y, bias);
    } else {
        const dim3 grid((unsigned)((m.rows + QMMA_ROWS - 1) / QMMA_ROWS), (unsigned)k.slices);
        if (tiles <= 2)
            qmma_launch<QT, 2>(c, grid, m, xf, n, per, part, y, bias);
        else if (tiles <= 4)
            qmma_launch<QT, 4>(c, grid, m, xf, n, per, part, y, bias);
        else
            qmma_launch<QT, 8>(c, grid, m, xf, n, per, part, y, bias);
    }
}

void qmma_set(struct cuda_ctx *c, int count, const struct llmem_weight *const *w, const float *x,
              int64_t n, float *const *y, const float *const *bias) {
    static_assert(QMMA_MAX_ROWS <= 64, "the batch kernels take up to 8 tiles of 8 rows of x");
    LLMEM_ASSERT(count >= 1 && count <= 4 && n > 0 && n <= QMMA_MAX_ROWS);
    const int64_t cols = w[0]->cols, units = cols / 32, tiles = (n + 7) / 8;
    struct qmat m[4];
    struct split_k k[4];
    int64_t xbytes[X_LAYOUTS] = {0, 0, 0}, at[X_LAYOUTS + 1] = {0};
    int64_t part_bytes = 0; /* (the kernels run one after another: one place for their slices) */
    for (int i = 0; i < count; i++) {
        LLMEM_ASSERT(qgemv_int(c, w[i]) && w[i]->cols == cols);
        m[i] = qmat_of(w[i]), k[i] = qmma_split(m[i], w[i]->quant);
        const int l = x_layout(w[i]->quant);
        xbytes[l] = tiles * (l == X_K4 ? (cols / 256) * (int64_t)sizeof(struct xk4)
                                       : units * (int64_t)sizeof(struct xfrag));
        if (k[i].slices > 1 && k[i].slices * n * m[i].rows * 4 > part_bytes)
            part_bytes = k[i].slices * n * m[i].rows * 4;
    }
    for (int l = 0; l < X_LAYOUTS; l++)
        at[l + 1] = at[l] + xbytes[l];
    uint8_t *ws = (uint8_t *)wslice(c, (size_t)(at[X_LAYOUTS] + part_bytes));
    if (ws == NULL)
        return;
    struct xk4 *xk = (struct xk4 *)(ws + at[X_K4]);
    float *part = (float *)(ws + at[X_LAYOUTS]);
    /* x quantized once for each layout the matrices take */
    const dim3 fgrid((unsigned)((units + 7) / 8), (unsigned)(tiles * 8));
    if (xbytes[X_K4] > 0)
        pdl_launch(c->stream, quantize_x_k4_kernel,
                   dim3((unsigned)((cols / 256 + 7) / 8), (unsigned)(tiles * 8)), dim3(256), 0, x,
                   cols, n, xk);
    if (xbytes[X_FRAG1] > 0)
        pdl_launch(c->stream, quantize_x_frag_kernel<1>, fgrid, dim3(256), 0, x, cols, n,
                   (struct xfrag *)(ws + at[X_FRAG1]));
    if (xbytes[X_FRAG8] > 0) /* (whole super-blocks: a warp a block, 8 a block of threads) */
        pdl_launch(c->stream, quantize_x_frag_kernel<QMMA_STEP>,
                   dim3((fgrid.x + QMMA_STEP - 1) / QMMA_STEP, fgrid.y), dim3(256), 0, x, cols, n,
                   (struct xfrag *)(ws + at[X_FRAG8]));
    for (int i = 0; i < count; i++) {
        const struct xfrag *xf = (const struct xfrag *)(ws + at[x_layout(w[i]->quant)]);
        const float *b = bias != NULL ? bias[i] : NULL;
#define QMMA_GO(QT) qmma_go<QT>(c, m[i], xk, xf, (int)n, k[i], part, y[i], b)
        switch (w[i]->quant) {
        case LLMEM_QTYPE_Q8_0: QMMA_GO(LLMEM_QTYPE_Q8_0); break;
        case LLMEM_QTYPE_Q4_0: QMMA_GO(LLMEM_QTYPE_Q4_0); break;
        case LLMEM_QTYPE_Q5_K: QMMA_GO(LLMEM_QTYPE_Q5_K); break;
        case LLMEM_QTYPE_Q4_K: QMMA_GO(LLMEM_QTYPE_Q4_K); break;
        default: QMMA_GO(LLMEM_QTYPE_Q6_K);
        }
#undef QMMA_GO
    }
    launched(c, "qmma");
}

void qgemv(struct cuda_ctx *c, const struct llmem_weight *w, const float *x, int64_t n, float *y,
           const float *bias) {
    if (qgemv_int(c, w)) {
        qgemv_set(c, 1, &w, x, n, &y, &bias, 0);
        return;
    }
    const struct qmat m = qmat_of(w);
    const dim3 grid((unsigned)((m.rows + 7) / 8));
    const struct qexperts none = {};
    for (int64_t t = 0; t < n;) {
        const int nx = n - t >= 4 ? 4 : (int)(n - t);
        const float *xt = x + t * m.cols;
        float *yt = y + t * m.rows;
#define QGEMV(QT)                                                                                  \
    switch (nx) {                                                                                  \
    case 1:                                                                                        \
        pdl_launch(c->stream, qgemv_kernel<QT, 1>, grid, dim3(256), 0, m, xt, yt, bias, none);     \
        break;                                                                                     \
    case 2:                                                                                        \
        pdl_launch(c->stream, qgemv_kernel<QT, 2>, grid, dim3(256), 0, m, xt, yt, bias, none);     \
        break;                                                                                     \
    case 3:                                                                                        \
        pdl_launch(c->stream, qgemv_kernel<QT, 3>, grid, dim3(256), 0, m, xt, yt, bias, none);     \
        break;                                                                                     \
    default:                                                                                       \
        pdl_launch(c->stream, qgemv_kernel<QT, 4>, grid, dim3(256), 0, m, xt, yt, bias, none);     \
    }
        QT_DISPATCH(w->quant, QGEMV)
#undef QGEMV
        t += nx;
    }
    launched(c, "qgemv");
}

void qgemv_experts(struct cuda_ctx *c, const struct llmem_weight *w, const struct llmem_weight *w1,
                   const int32_t *ids, const int32_t *order, int k, const float *x,
                   const float *up, const uint8_t *xq, int64_t x_rows, int64_t pairs, float *y,
                   float *y1) {
    const struct qmat m = qmat_of(w);
    struct qexperts ex = {ids, order, k, m.rows * m.row_bytes, 0, NULL, NULL, NULL, y1};
    if (m.scales != NULL)
        ex.side = m.rows * (m.cols / m.group) * (m.st == LLMEM_QTYPE_F32 ? 4 : 2);
    if (w1 != NULL)
        ex.codes1 = (const uint8_t *)w1->data, ex.scales1 = (const uint8_t *)w1->scales,
        ex.biases1 = (const uint8_t *)w1->biases;
    const dim3 grid((unsigned)((m.rows + 7) / 8), (unsigned)pairs, w1 != NULL ? 2 : 1);
    if (qgemv_int(c, w)) {
        if (xq == NULL) {
            uint8_t *xw = (uint8_t *)wslice(c, (size_t)(x_rows * xq_row_bytes(m.cols)));
            if (xw == NULL)
                return;
            pdl_launch(c->stream, quantize_x_kernel,
                       dim3((unsigned)((m.cols / 32 + 7) / 8), (unsigned)x_rows), dim3(256), 0, x,
                       up, m.cols, xw);
            xq = xw;
        }
#define QGEMV_INT(QT)                                                                              \
    pdl_launch(c->stream, qgemv_int_kernel<QT, 1>, grid, dim3(256), 0, m, xq, y,                   \
               (const float *)NULL, ex)
        QT_INT_DISPATCH(w->quant, QGEMV_INT)
#undef QGEMV_INT
    } else {
        if (up != NULL)
            swiglu_launch(c, x, up, x_rows * m.cols, (float *)x);
#define QGEMV(QT)                                                                                  \
    pdl_launch(c->stream, qgemv_kernel<QT, 1>, grid, dim3(256), 0, m, x, y, (const float *)NULL, ex)
        QT_DISPATCH(w->quant, QGEMV)
#undef QGEMV
    }
    launched(c, "qgemv experts");
}

void qdequant(struct cuda_ctx *c, const struct llmem_weight *w, int64_t r0, int64_t n,
              enum llmem_dtype dt, void *out) {
    const struct qmat m = qmat_of(w);
    const dim3 grid(grid_for(n * (m.cols / 8), 256));
#define QDEQUANT(QT)                                                                               \
    if (dt == LLMEM_DTYPE_F16)                                                                     \
        pdl_launch(c->stream, qdequant_kernel<QT, __half>, grid, dim3(256), 0, m, r0, n,           \
                   (__half *)out);                                                                 \
    else                                                                                           \
        pdl_launch(c->stream, qdequant_kernel<QT, float>, grid, dim3(256), 0, m, r0, n,            \
                   (float *)out);
    QT_DISPATCH(w->quant, QDEQUANT)
#undef QDEQUANT
    launched(c, "dequant");
}

void qembedding(struct cuda_ctx *c, const struct llmem_weight *table, const int32_t *ids, int fed,
                int64_t n, float *out) {
    const struct qmat m = qmat_of(table);
    const int64_t groups = m.cols / 8;
    const dim3 block((unsigned)(groups < 256 ? (groups + 31) / 32 * 32 : 256));
#define QEMBED(QT)                                                                                 \
    if (fed)                                                                                       \
        pdl_launch(c->stream, qembedding_kernel<QT, true>, dim3((unsigned)n), block, 0, m, ids,    \
                   out);                                                                           \
    else                                                                                           \
        pdl_launch(c->stream, qembedding_kernel<QT, false>, dim3((unsigned)n), block, 0, m, ids,   \
                   out);
    QT_DISPATCH(table->quant, QEMBED)
#undef QEMBED
    launched(c, "embedding");
}

} // namespace llmem_cuda
