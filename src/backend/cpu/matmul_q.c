/*
 * backend/cpu/matmul_q.c — y = x · Wᵀ (+ bias) for quantized weights at fast precision: integer
 * dot products on the blocks as they lie in the file, the activations quantized per block.
 *
 * The activations: each row of x in blocks of 32 values (for the 32-value weight types) or 256
 * (the K types), d = max|x| / 127 and q = round(x · 127 / max|x|) to nearest even, q in
 * [−127, 127] (so |x − q·d| ≤ d/2 = max|x|/254 per block); the K types also keep the sums of
 * q over each 16 values. A row's quantization depends on that row alone.
 *
 * The products, per type, with every integer sum exact (no saturation: the bounds are below):
 *   Q8_0, Q4_0,  per block b: p = Σ w·q over its 32 values (Q4_0's w = nibble − 8, Q5_0's
 *   Q5_0         the 5-bit value − 16);
 *                set_{b mod 4} ← fma((float)p, dw_b · dx_b, set_{b mod 4}) in block order;
 *                s = (set0 + set1) + (set2 + set3).
 *   Q4_1, Q5_1   the same with w the unsigned 4/5-bit value, and after each block's p its
 *                offset: set_{b mod 4} ← fma((float)Σq, mw_b · dx_b, set_{b mod 4}).
 *   Q4_K, Q5_K   per super-block: S1 = Σ_j sc_j · Σ w·q over sub-block j (w the 4/5-bit value),
 *                S2 = Σ_j m_j · (sum of q over sub-block j); s ← fma(d·dx, (float)S1, s), then
 *                s ← fma(−(dmin·dx), (float)S2, s), super-blocks in order.
 *   Q6_K         per super-block: S = Σ_j sc_j · (Σ w·q − 32 · sum of q) over the 16-value
 *                sub-blocks (w the 6-bit value 0…63); s ← fma(d·dx, (float)S, s).
 * then y = s + bias. The portable C, AVX2 (vpmaddubsw), AVX-512BW (the K types, 64 values an
 * instruction) and AVX-512 VNNI (vpdpbusd, the 32-value types) kernels compute these very
 * operations, so
 * they give the same bits, and a row of x gives the same bits alone or in any batch, on any thread
 * count (the decode and prefill loops call the same kernels).
 *
 * Loops: the rows of x are quantized in chunks that fit the backend's packed-x scratch (all
 * threads, a row each); the W rows are split into contiguous ranges, one task each. A task takes
 * 16 W rows at a time and multiplies them with the chunk: with 16 rows of x or more (AVX-512
 * VNNI), as a panel (the 16 rows unpacked and interleaved in the thread's scratch, then 16 rows at
 * once by vpdpbusd, see below); else for every 4 rows of x by the dot kernels, which take the 16
 * W rows in one call, unpack each W block once for the 4 rows of x, and so stream W once in
 * decode (n = 1).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "backend/cpu/cpu_int.h"
#include "core/log.h"
#include "llmem/pool.h"
#include "llmem/sys.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QX86 1
#include <immintrin.h>
#else
#define QX86 0
#endif

#define ALWAYS_INLINE inline __attribute__((always_inline))

#define Q_NX          4  /* rows of x per kernel call */
#define Q_MR          16 /* W rows a task takes at a time (and a panel holds) */
#define Q_PANEL_MIN_N 16 /* rows of x from which the panels pay */
#define Q_PF_BYTES    2048 /* the AVX2 K kernels read W this far ahead (rows of a few KiB) */

/* The quantized rows of x of a chunk. */
struct q_x {
    const int8_t *q;  /* (nt, cols) */
    const float *d;   /* (nt, cols / blk) */
    const int16_t *s; /* (nt, cols / 16): sums of q over 16 values (K types) */
    int64_t cols, blk;
};

/* nr rows of W, row_bytes apart, times nx rows of x: out[r * Q_NX + j] (one call for many rows,
 * so that its setup is paid once). */
typedef void (*q_dot_fn)(const uint8_t *w, int64_t row_bytes, int nr, int64_t nb,
                         const struct q_x *x, int64_t t, int nx, float *out);

/* The entry points: the body for nx = 1…4 (a constant there), and for the dot kernels once for
 * each of the nr rows (w, out the row's). */
#define DISPATCH_NX(CALL)                                                                          \
    switch (nx) {                                                                                  \
    case 1: CALL(1); break;                                                                        \
    case 2: CALL(2); break;                                                                        \
    case 3: CALL(3); break;                                                                        \
    default: CALL(4);                                                                              \
    }
#define ROWS(STMT)                                                                                 \
    for (int r_ = 0; r_ < nr; r_++) {                                                              \
        const uint8_t *w = w0 + (size_t)r_ * (size_t)row_bytes;                                    \
        float *out = out0 + r_ * Q_NX;                                                             \
        STMT;                                                                                      \
    }
#define DISPATCH_ROWS_NX(CALL)                                                                     \
    switch (nx) {                                                                                  \
    case 1: ROWS(CALL(1)); break;                                                                  \
    case 2: ROWS(CALL(2)); break;                                                                  \
    case 3: ROWS(CALL(3)); break;                                                                  \
    default: ROWS(CALL(4));                                                                        \
    }
#define DOT_ARGS                                                                                   \
    const uint8_t *w0, int64_t row_bytes, int nr, int64_t nb, const struct q_x *x, int64_t t,      \
        int nx, float *out0
/* The entry point NAME of a 32-value kind: KERNEL(…, KIND, nx) for each of the nr rows. */
#define DOT32_ENTRY(TARGET, NAME, KERNEL, KIND)                                                    \
    TARGET static void NAME(DOT_ARGS) {                                                            \
        switch (nx) {                                                                              \
        case 1: ROWS(KERNEL(w, nb, x, t, out, KIND, 1)); break;                                    \
        case 2: ROWS(KERNEL(w, nb, x, t, out, KIND, 2)); break;                                    \
        case 3: ROWS(KERNEL(w, nb, x, t, out, KIND, 3)); break;                                    \
        default: ROWS(KERNEL(w, nb, x, t, out, KIND, 4));                                          \
        }                                                                                          \
    }

/* ---- helpers ----------------------------------------------------------------------------------
 */

static ALWAYS_INLINE float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return llmem_cpu_f16_to_f32(h);
}

static ALWAYS_INLINE void scale_min_k4(int j, const uint8_t *q, int *d, int *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* All eight scales and mins of a Q4_K/Q5_K block at once, as scale_min_k4 gives them: byte j of
 * *sc and *m (kept in registers: no store and reload). */
static ALWAYS_INLINE void scales_k4(const uint8_t *q, uint64_t *sc, uint64_t *m) {
    uint32_t a, b, c;
    memcpy(&a, q, 4);
    memcpy(&b, q + 4, 4);
    memcpy(&c, q + 8, 4);
    const uint32_t s0 = a & 0x3f3f3f3fu, m0 = b & 0x3f3f3f3fu;
    const uint32_t s1 = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
    const uint32_t m1 = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
    *sc = (uint64_t)s0 | (uint64_t)s1 << 32;
    *m = (uint64_t)m0 | (uint64_t)m1 << 32;
}

/* Block bytes and values, by type. */
static int64_t q_block_bytes(int type) {
    switch (type) {
    case LLMEM_QTYPE_Q8_0: return 34;
    case LLMEM_QTYPE_Q4_0: return 18;
    case LLMEM_QTYPE_Q5_0: return 22;
    case LLMEM_QTYPE_Q4_1: return 20;
    case LLMEM_QTYPE_Q5_1: return 24;
    case LLMEM_QTYPE_Q4_K: return 144;
    case LLMEM_QTYPE_Q5_K: return 176;
    case LLMEM_QTYPE_Q6_K: return 210;
    default: return 0;
    }
}

static int64_t q_block_elems(int type) {
    return type == LLMEM_QTYPE_Q8_0 || type == LLMEM_QTYPE_Q4_0 || type == LLMEM_QTYPE_Q5_0 ||
                   type == LLMEM_QTYPE_Q4_1 || type == LLMEM_QTYPE_Q5_1
               ? 32
               : LLMEM_QK_K;
}

/* The 32-value types' kernels take their type as `kind`: Q32_8 (Q8_0: d, 32 signed bytes),
 * Q32_4 (Q4_0: d, 16 bytes of nibbles, value − 8), Q32_5 (Q5_0: d, the 32 fifth bits, 16 bytes
 * of nibbles, value − 16), Q32_4M and Q32_5M (Q4_1, Q5_1: d, m, then as Q4_0 and Q5_0 with the
 * values unsigned, d · value + m); a block's bytes. */
enum { Q32_8, Q32_4, Q32_5, Q32_4M, Q32_5M };
static ALWAYS_INLINE int64_t q32_bytes(const int kind) {
    return kind == Q32_8 ? 34 : kind == Q32_4 ? 18 : kind == Q32_5 ? 22 : kind == Q32_4M ? 20 : 24;
}
/* Whether a kind's blocks have an offset m (after d), fifth bits (after d and m), and the bias its
 * codes take off. */
static ALWAYS_INLINE int q32_min(const int kind) {
    return kind == Q32_4M || kind == Q32_5M;
}
static ALWAYS_INLINE int q32_five(const int kind) {
    return kind == Q32_5 || kind == Q32_5M;
}
static ALWAYS_INLINE int q32_bias(const int kind) {
    return kind == Q32_4 ? 8 : kind == Q32_5 ? 16 : 0;
}

/* ---- quantizing x -----------------------------------------------------------------------------
 */

static void quantize_x_scalar(const float *x, int64_t cols, int64_t blk, int8_t *q, float *d,
                              int16_t *s) {
    for (int64_t b = 0; b < cols / blk; b++) {
        const float *xb = x + b * blk;
        float amax = 0.0f;
        for (int64_t i = 0; i < blk; i++) {
            float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        for (int64_t i = 0; i < blk; i++) {
            float v = nearbyintf(xb[i] * id);
            q[b * blk + i] = (int8_t)(v >= -127.0f && v <= 127.0f ? (int)v : 0);
        }
    }
    if (s != NULL)
        for (int64_t j = 0; j < cols / 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++)
                sum += q[j * 16 + i];
            s[j] = (int16_t)sum;
        }
}

#if QX86
#define TARGET_AVX2 __attribute__((target("avx,avx2,fma,f16c")))
#define TARGET_VNNI                                                                                \
    __attribute__((target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

/* As quantize_x_scalar: max|x| is exact in any order, 127/max and x · id are single roundings,
 * and vcvtps2dq rounds to nearest even as nearbyintf does (the default rounding mode). */
TARGET_AVX2 static void quantize_x_avx2(const float *x, int64_t cols, int64_t blk, int8_t *q,
                                        float *d, int16_t *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < cols / blk; b++) {
        const float *xb = x + b * blk;
        __m256 m = _mm256_setzero_ps();
        for (int64_t i = 0; i < blk; i += 8)
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        const __m256 idv = _mm256_set1_ps(id);
        for (int64_t i = 0; i < blk; i += 32) {
            __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), idv));
            __m256i bq = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), idv));
            __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 16), idv));
            __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 24), idv));
            __m256i ab = _mm256_packs_epi32(a, bq), ce = _mm256_packs_epi32(c, e);
            __m256i all = _mm256_packs_epi16(ab, ce);
            /* the packs interleave 128-bit lanes: dwords 0 4 1 5 2 6 3 7 back in order */
            all = _mm256_permutevar8x32_epi32(all, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(q + b * blk + i), all);
        }
    }
    if (s != NULL) {
        const __m256i ones = _mm256_set1_epi16(1);
        for (int64_t j = 0; j < cols / 16; j++) {
            __m256i v = _mm256_madd_epi16(
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + j * 16))), ones);
            __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
            s[j] = (int16_t)_mm_cvtsi128_si32(h);
        }
    }
}

/* f16 → f32 by F16C: exact, as llmem_cpu_f16_to_f32 (NaNs aside). */
TARGET_AVX2 static ALWAYS_INLINE float f16_at_c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

TARGET_AVX2 static ALWAYS_INLINE int hsum_i32_sse(__m128i h) {
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    return _mm_cvtsi128_si32(h);
}

TARGET_AVX2 static ALWAYS_INLINE int hsum_i32_avx2(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    return _mm_cvtsi128_si32(h);
}

#endif

/* ---- portable kernels -------------------------------------------------------------------------
 */

/* The 32 values of a block of `kind` into v. */
static ALWAYS_INLINE void unpack32(const uint8_t *blk, const int kind, int v[32]) {
    if (kind == Q32_8) {
        for (int i = 0; i < 32; i++)
            v[i] = (int8_t)blk[2 + i];
        return;
    }
    const uint8_t *h = blk + (q32_min(kind) ? 4 : 2), *qs = h + (q32_five(kind) ? 4 : 0);
    const uint32_t qh = q32_five(kind) ? (uint32_t)h[0] | (uint32_t)h[1] << 8 |
                                             (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24
                                       : 0;
    for (int i = 0; i < 16; i++) {
        v[i] = (qs[i] & 0xf) | (int)((qh >> i) & 1) << 4;
        v[i + 16] = (qs[i] >> 4) | (int)((qh >> (i + 16)) & 1) << 4;
    }
    for (int i = 0; i < 32; i++)
        v[i] -= q32_bias(kind);
}

static ALWAYS_INLINE void dot32_scalar_row(const uint8_t *w, int64_t nb, const struct q_x *x,
                                           int64_t t, int nx, float *out, const int kind) {
    const int64_t bb = q32_bytes(kind);
    for (int j = 0; j < nx; j++) {
        const int8_t *xq = x->q + (t + j) * x->cols;
        const float *xd = x->d + (t + j) * (x->cols / 32);
        float set[4] = {0, 0, 0, 0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * bb;
            int v[32], p = 0, sq = 0;
            unpack32(blk, kind, v);
            for (int i = 0; i < 32; i++)
                p += v[i] * xq[b * 32 + i], sq += xq[b * 32 + i];
            set[b % 4] = fmaf((float)p, f16_at(blk) * xd[b], set[b % 4]);
            if (q32_min(kind))
                set[b % 4] = fmaf((float)sq, f16_at(blk + 2) * xd[b], set[b % 4]);
        }
        out[j] = (set[0] + set[1]) + (set[2] + set[3]);
    }
}

/* Q4_K (hbits NULL) and Q5_K: the values of super-block `blk` as 0…31. */
static void unpack_k45(const uint8_t *qs, const uint8_t *qh, uint8_t *v) {
    for (int i = 0; i < 4; i++)
        for (int l = 0; l < 32; l++) {
            v[64 * i + l] = (uint8_t)(qs[32 * i + l] & 0xf);
            v[64 * i + 32 + l] = (uint8_t)(qs[32 * i + l] >> 4);
            if (qh != NULL) {
                v[64 * i + l] = (uint8_t)(v[64 * i + l] | (((qh[l] >> (2 * i)) & 1) << 4));
                v[64 * i + 32 + l] =
                    (uint8_t)(v[64 * i + 32 + l] | (((qh[l] >> (2 * i + 1)) & 1) << 4));
            }
        }
}

static ALWAYS_INLINE void dot_k45_scalar(const uint8_t *w, int64_t nb, const struct q_x *x,
                                         int64_t t, int nx, float *out, const int five) {
    const int64_t bb = five ? 176 : 144;
    for (int j = 0; j < nx; j++) {
        const int8_t *xq = x->q + (t + j) * x->cols;
        const float *xd = x->d + (t + j) * (x->cols / LLMEM_QK_K);
        const int16_t *xs = x->s + (t + j) * (x->cols / 16);
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * bb;
            const int8_t *xb = xq + b * LLMEM_QK_K;
            const int16_t *bs = xs + b * 16;
            uint8_t v[LLMEM_QK_K];
            unpack_k45(blk + (five ? 48 : 16), five ? blk + 16 : NULL, v);
            int s1 = 0, s2 = 0;
            for (int sb = 0; sb < 8; sb++) {
                int sc, m, p = 0;
                scale_min_k4(sb, blk + 4, &sc, &m);
                for (int i = 32 * sb; i < 32 * sb + 32; i++)
                    p += v[i] * xb[i];
                s1 += sc * p;
                s2 += m * (bs[2 * sb] + bs[2 * sb + 1]);
            }
            acc = fmaf((float)s1, f16_at(blk) * xd[b], acc);
            acc = fmaf((float)s2, -(f16_at(blk + 2) * xd[b]), acc);
        }
        out[j] = acc;
    }
}

static void dot_q4_k_scalar_row(const uint8_t *w, int64_t nb, const struct q_x *x, int64_t t,
                                int nx, float *out) {
    dot_k45_scalar(w, nb, x, t, nx, out, 0);
}

static void dot_q5_k_scalar_row(const uint8_t *w, int64_t nb, const struct q_x *x, int64_t t,
                                int nx, float *out) {
    dot_k45_scalar(w, nb, x, t, nx, out, 1);
}

static void dot_q6_k_scalar_row(const uint8_t *w, int64_t nb, const struct q_x *x, int64_t t,
                                int nx, float *out) {
    for (int j = 0; j < nx; j++) {
        const int8_t *xq = x->q + (t + j) * x->cols;
        const float *xd = x->d + (t + j) * (x->cols / LLMEM_QK_K);
        const int16_t *xs = x->s + (t + j) * (x->cols / 16);
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * 210;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const int8_t *xb = xq + b * LLMEM_QK_K;
            uint8_t v[LLMEM_QK_K];
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
                for (int l = 0; l < 32; l++) {
                    v[128 * h + l] = (uint8_t)((ql[l] & 0xf) | ((qh[l] & 3) << 4));
                    v[128 * h + 32 + l] = (uint8_t)((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4));
                    v[128 * h + 64 + l] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    v[128 * h + 96 + l] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            }
            int s = 0;
            for (int sb = 0; sb < 16; sb++) {
                int p = 0;
                for (int i = 16 * sb; i < 16 * sb + 16; i++)
                    p += v[i] * xb[i];
                s += sc[sb] * (p - 32 * xs[b * 16 + sb]);
            }
            acc = fmaf((float)s, f16_at(blk + 208) * xd[b], acc);
        }
        out[j] = acc;
    }
}

static void dot_q8_0_scalar(DOT_ARGS) {
    ROWS(dot32_scalar_row(w, nb, x, t, nx, out, Q32_8));
}

static void dot_q4_0_scalar(DOT_ARGS) {
    ROWS(dot32_scalar_row(w, nb, x, t, nx, out, Q32_4));
}

static void dot_q5_0_scalar(DOT_ARGS) {
    ROWS(dot32_scalar_row(w, nb, x, t, nx, out, Q32_5));
}

static void dot_q4_1_scalar(DOT_ARGS) {
    ROWS(dot32_scalar_row(w, nb, x, t, nx, out, Q32_4M));
}

static void dot_q5_1_scalar(DOT_ARGS) {
    ROWS(dot32_scalar_row(w, nb, x, t, nx, out, Q32_5M));
}

static void dot_q4_k_scalar(DOT_ARGS) {
    ROWS(dot_q4_k_scalar_row(w, nb, x, t, nx, out));
}

static void dot_q5_k_scalar(DOT_ARGS) {
    ROWS(dot_q5_k_scalar_row(w, nb, x, t, nx, out));
}

static void dot_q6_k_scalar(DOT_ARGS) {
    ROWS(dot_q6_k_scalar_row(w, nb, x, t, nx, out));
}

/* ---- AVX2 and AVX-512 VNNI kernels ------------------------------------------------------------
 *
 * NX rows of x per call, each W block unpacked once. The 32-value types take the sign trick
 * (|w| unsigned times x with w's sign) for vpmaddubsw / vpdpbusd; the K types' values are
 * unsigned already. */

#if QX86
/* Lane l of the result: Σ of u·s over bytes 4l … 4l+3 (u unsigned, s signed, |u·s| ≤ 127·127
 * per byte pair, so vpmaddubsw does not saturate). */
TARGET_AVX2 static ALWAYS_INLINE __m256i dot4_avx2(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* The 32 values of a block of `kind` as signed bytes. */
TARGET_AVX2 static ALWAYS_INLINE __m256i w32(const uint8_t *blk, const int kind) {
    if (kind == Q32_8)
        return _mm256_loadu_si256((const __m256i *)(blk + 2));
    const int q5 = q32_five(kind);
    const uint8_t *h = blk + (q32_min(kind) ? 4 : 2);
    __m128i qs = _mm_loadu_si128((const __m128i *)(h + (q5 ? 4 : 0)));
    __m128i lo = _mm_and_si128(qs, _mm_set1_epi8(0xf));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), _mm_set1_epi8(0xf));
    __m256i v = _mm256_set_m128i(hi, lo);
    if (q5) { /* byte i takes bit i of qh as 16: qh's byte i / 8 to byte i, tested by bit i % 8 */
        uint32_t qh;
        memcpy(&qh, h, 4);
        const __m256i spread =
            _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2,
                                                 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        v = _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    return _mm256_sub_epi8(v, _mm256_set1_epi8((char)q32_bias(kind)));
}

/* The d of four blocks from b0, bb bytes apart, as f32. */
TARGET_AVX2 static ALWAYS_INLINE __m128 d4(const uint8_t *b0, int64_t bb) {
    uint16_t h[4];
    for (int k = 0; k < 4; k++)
        memcpy(&h[k], b0 + k * bb, 2);
    return _mm_cvtph_ps(
        _mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], 0, 0, 0, 0));
}

/* The sums of the lanes of a, b, c and d: [Σa, Σb, Σc, Σd]. */
TARGET_AVX2 static ALWAYS_INLINE __m128i sums4_avx2(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* The end of a 32-value type's row of x: the four sets (lanes of acc) after the blocks from b on,
 * one at a time, then (set0 + set1) + (set2 + set3). */
TARGET_AVX2 static ALWAYS_INLINE float dot32_finish(const uint8_t *w, int64_t bb, int64_t b,
                                                    int64_t nb, const int kind, const int8_t *xq,
                                                    const float *xd, __m128 acc) {
    float set[4];
    _mm_storeu_ps(set, acc);
    for (; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        const __m256i wv = w32(blk, kind);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
        const int p = hsum_i32_avx2(dot4_avx2(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)));
        set[b & 3] = fmaf((float)p, f16_at_c(blk) * xd[b], set[b & 3]);
        if (q32_min(kind)) {
            const int sq = hsum_i32_avx2(dot4_avx2(_mm256_set1_epi8(1), xv));
            set[b & 3] = fmaf((float)sq, f16_at_c(blk + 2) * xd[b], set[b & 3]);
        }
    }
    return (set[0] + set[1]) + (set[2] + set[3]);
}

/* The 32-value types (kind): blocks 4k … 4k+3 at once, their sums in the lanes of one register
 * (lane i: set i); the blocks after the last four one by one. */
TARGET_AVX2 static ALWAYS_INLINE void dot32_avx2_nx(const uint8_t *w, int64_t nb,
                                                    const struct q_x *x, int64_t t, float *out,
                                                    const int kind, const int NX) {
    const int64_t bb = q32_bytes(kind);
    const int8_t *xq[Q_NX];
    const float *xd[Q_NX];
    __m128 acc[Q_NX];
    for (int j = 0; j < NX; j++) {
        xq[j] = x->q + (t + j) * x->cols;
        xd[j] = x->d + (t + j) * (x->cols / 32);
        acc[j] = _mm_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        for (int64_t p = 0; p < 4 * bb; p += 64) /* (as the K kernels) */
            _mm_prefetch((const char *)w + b * bb + Q_PF_BYTES + p, _MM_HINT_T0);
        __m256i wv[4], aw[4];
        for (int k = 0; k < 4; k++) {
            wv[k] = w32(w + (b + k) * bb, kind);
            aw[k] = _mm256_sign_epi8(wv[k], wv[k]);
        }
        const __m128 dw = d4(w + b * bb, bb);
        const __m128 mw = q32_min(kind) ? d4(w + b * bb + 2, bb) : _mm_setzero_ps();
        for (int j = 0; j < NX; j++) {
            __m256i p[4], sq[4];
            for (int k = 0; k < 4; k++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq[j] + (b + k) * 32));
                p[k] = dot4_avx2(aw[k], _mm256_sign_epi8(xv, wv[k]));
                if (q32_min(kind))
                    sq[k] = dot4_avx2(_mm256_set1_epi8(1), xv);
            }
            const __m128 dx = _mm_loadu_ps(xd[j] + b);
            acc[j] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums4_avx2(p[0], p[1], p[2], p[3])),
                                  _mm_mul_ps(dw, dx), acc[j]);
            if (q32_min(kind))
                acc[j] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums4_avx2(sq[0], sq[1], sq[2], sq[3])),
                                      _mm_mul_ps(mw, dx), acc[j]);
        }
    }
    for (int j = 0; j < NX; j++) {
        out[j] = dot32_finish(w, bb, b, nb, kind, xq[j], xd[j], acc[j]);
    }
}

DOT32_ENTRY(TARGET_AVX2, dot32_avx2_q8_0, dot32_avx2_nx, Q32_8)
DOT32_ENTRY(TARGET_AVX2, dot32_avx2_q4_0, dot32_avx2_nx, Q32_4)
DOT32_ENTRY(TARGET_AVX2, dot32_avx2_q5_0, dot32_avx2_nx, Q32_5)
/* (Q4_1 and Q5_1 take these on AVX-512 too: rare types, Q5_1 only where llama-quantize falls back
 * from Q5_K, the decode is the memory's; their prefill takes the panels.) */
DOT32_ENTRY(TARGET_AVX2, dot32_avx2_q4_1, dot32_avx2_nx, Q32_4M)
DOT32_ENTRY(TARGET_AVX2, dot32_avx2_q5_1, dot32_avx2_nx, Q32_5M)

/* Values 64i … 64i+63 of a Q4_K/Q5_K super-block as bytes 0…31: lo (sub-block 2i, the low nibbles
 * of qs[32i…]) and hi (2i+1, the high ones); for Q5_K the fifth bits from qh, which moves on by
 * two bits for the next i. */
TARGET_AVX2 static ALWAYS_INLINE void k45_pair_avx2(const uint8_t *qs, int i, const int five,
                                                    __m256i *qh, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0xf), one = _mm256_set1_epi8(1);
    const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
    *lo = _mm256_and_si256(q, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if (five) {
        *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(_mm256_and_si256(*qh, one), 4));
        *hi = _mm256_or_si256(
            *hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(*qh, 1), one), 4));
        *qh = _mm256_srli_epi16(*qh, 2);
    }
}

/* Values 128h … 128h+127 of a Q6_K super-block as bytes 0…63, in four runs of 32. */
TARGET_AVX2 static ALWAYS_INLINE void q6_groups_avx2(const uint8_t *blk, int h, __m256i g[4]) {
    const __m256i m4 = _mm256_set1_epi8(0xf), m3 = _mm256_set1_epi8(3);
    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
    const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    g[0] =
        _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
    g[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
    g[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
    g[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
}

/* Q4_K and Q5_K: per pair of sub-blocks, 32 bytes of nibbles (low: sub-block 2i, high: 2i+1)
 * and, for Q5_K, bits 2i and 2i+1 of qh as the fifth bits; the integer sums of a super-block
 * gather in lo (sub-blocks 2i) and hi (2i+1), added exactly at its end. */
/* The sums of the lanes of a, b, c and d: [Σa, Σb, Σc, Σd] (integers: exact in any order). */
TARGET_AVX2 static ALWAYS_INLINE __m128i hsum4_i32(__m128i a, __m128i b, __m128i c, __m128i d) {
    return _mm_hadd_epi32(_mm_hadd_epi32(a, b), _mm_hadd_epi32(c, d));
}

/* The shuffle that puts byte k of each qword (the eight scales, repeated in every qword) in the
 * low byte of every 16-bit lane, its high byte 0: scale k in every lane. */
TARGET_AVX2 static ALWAYS_INLINE __m256i k4_scale_pick(int k) {
    return _mm256_set1_epi16((short)(0x8000 | k));
}

TARGET_AVX2 static ALWAYS_INLINE void dot_k45_avx2_nx(const uint8_t *w, int64_t nb,
                                                      const struct q_x *x, int64_t t, float *out,
                                                      const int five, const int NX) {
    const int64_t bb = five ? 176 : 144;
    const int8_t *xq[Q_NX];
    const float *xd[Q_NX];
    const int16_t *xs[Q_NX];
    for (int j = 0; j < NX; j++) {
        xq[j] = x->q + (t + j) * x->cols;
        xd[j] = x->d + (t + j) * (x->cols / LLMEM_QK_K);
        xs[j] = x->s + (t + j) * (x->cols / 16);
    }
    /* the rows of x in the lanes of one vector: a super-block's S1 and S2 of each row summed
     * together (hsum4_i32), and the rows' fma chains side by side (lane j: row j's, the
     * operations of the scalar kernel in its order) */
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        const uint8_t *qs = blk + (five ? 48 : 16);
        for (int64_t p = 0; p < bb; p += 64) /* (the rows that follow too: a task's are one run) */
            _mm_prefetch((const char *)blk + Q_PF_BYTES + p, _MM_HINT_T0);
        uint64_t sc64, m64;
        scales_k4(blk + 4, &sc64, &m64);
        const __m128i mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m64));
        const __m256i scv = _mm256_set1_epi64x((long long)sc64);
        __m256i sl[Q_NX];
        for (int j = 0; j < NX; j++)
            sl[j] = _mm256_setzero_si256();
        __m256i qhv =
            five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            __m256i wl, wh;
            k45_pair_avx2(qs, i, five, &qhv, &wl, &wh);
            const __m256i scl = _mm256_shuffle_epi8(scv, k4_scale_pick(2 * i));
            const __m256i sch = _mm256_shuffle_epi8(scv, k4_scale_pick(2 * i + 1));
            for (int j = 0; j < NX; j++) {
                const int8_t *xb = xq[j] + b * LLMEM_QK_K + 64 * i;
                __m256i x0 = _mm256_loadu_si256((const __m256i *)xb);
                __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb + 32));
                sl[j] = _mm256_add_epi32(
                    sl[j], _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(wl, x0), scl),
                                            _mm256_madd_epi16(_mm256_maddubs_epi16(wh, x1), sch)));
            }
        }
        __m128i s1[Q_NX], s2[Q_NX];
        float xdb[Q_NX];
        for (int j = 0; j < Q_NX; j++) {
            if (j < NX) {
                const __m128i *bs = (const __m128i *)(xs[j] + b * 16);
                s1[j] = _mm_add_epi32(_mm256_castsi256_si128(sl[j]),
                                      _mm256_extracti128_si256(sl[j], 1));
                s2[j] = _mm_madd_epi16(
                    mins, _mm_hadd_epi16(_mm_loadu_si128(bs), _mm_loadu_si128(bs + 1)));
                xdb[j] = xd[j][b];
            } else {
                s1[j] = s2[j] = _mm_setzero_si128();
                xdb[j] = 0.0f;
            }
        }
        const __m128 dx = _mm_loadu_ps(xdb);
        const __m128 d = _mm_set1_ps(f16_at_c(blk)), dmin = _mm_set1_ps(f16_at_c(blk + 2));
        const __m128 p1 = _mm_cvtepi32_ps(hsum4_i32(s1[0], s1[1], s1[2], s1[3]));
        const __m128 p2 = _mm_cvtepi32_ps(hsum4_i32(s2[0], s2[1], s2[2], s2[3]));
        acc = _mm_fmadd_ps(_mm_mul_ps(d, dx), p1, acc);
        acc = _mm_fmadd_ps(_mm_xor_ps(_mm_mul_ps(dmin, dx), _mm_set1_ps(-0.0f)), p2, acc);
    }
    float a[4];
    _mm_storeu_ps(a, acc);
    for (int j = 0; j < NX; j++)
        out[j] = a[j];
}

/* Q6_K: the integer sums of a super-block in lo (groups 0 and 2 of each 128 values) and hi
 * (groups 1 and 3), added exactly at its end. */
TARGET_AVX2 static ALWAYS_INLINE void dot_q6_k_avx2_nx(const uint8_t *w, int64_t nb,
                                                       const struct q_x *x, int64_t t, float *out,
                                                       const int NX) {
    const int8_t *xq[Q_NX];
    const float *xd[Q_NX];
    const int16_t *xs[Q_NX];
    for (int j = 0; j < NX; j++) {
        xq[j] = x->q + (t + j) * x->cols;
        xd[j] = x->d + (t + j) * (x->cols / LLMEM_QK_K);
        xs[j] = x->s + (t + j) * (x->cols / 16);
    }
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * 210;
        for (int64_t p = 0; p < 210; p += 64)
            _mm_prefetch((const char *)blk + Q_PF_BYTES + p, _MM_HINT_T0);
        const int8_t *sc = (const int8_t *)(blk + 192);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        __m256i sl[Q_NX], sh[Q_NX];
        for (int j = 0; j < NX; j++)
            sl[j] = sh[j] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i g[4];
            q6_groups_avx2(blk, h, g);
            for (int gi = 0; gi < 4; gi++) {
                const int k = 8 * h + 2 * gi;
                const __m256i sv =
                    _mm256_set_m128i(_mm_set1_epi16(sc[k + 1]), _mm_set1_epi16(sc[k]));
                for (int j = 0; j < NX; j++) {
                    __m256i xv = _mm256_loadu_si256(
                        (const __m256i *)(xq[j] + b * LLMEM_QK_K + 128 * h + 32 * gi));
                    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(g[gi], xv), sv);
                    if (gi & 1)
                        sh[j] = _mm256_add_epi32(sh[j], p);
                    else
                        sl[j] = _mm256_add_epi32(sl[j], p);
                }
            }
        }
        /* (the rows' sums together, as dot_k45_avx2_nx's) */
        __m128i s1[Q_NX], s2[Q_NX];
        float xdb[Q_NX];
        for (int j = 0; j < Q_NX; j++) {
            if (j < NX) {
                const __m256i c =
                    _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(xs[j] + b * 16)));
                const __m256i v = _mm256_add_epi32(sl[j], sh[j]);
                s1[j] = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
                s2[j] = _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
                xdb[j] = xd[j][b];
            } else {
                s1[j] = s2[j] = _mm_setzero_si128();
                xdb[j] = 0.0f;
            }
        }
        const __m128i sum = _mm_sub_epi32(hsum4_i32(s1[0], s1[1], s1[2], s1[3]),
                                          _mm_slli_epi32(hsum4_i32(s2[0], s2[1], s2[2], s2[3]), 5));
        acc = _mm_fmadd_ps(_mm_mul_ps(_mm_set1_ps(f16_at_c(blk + 208)), _mm_loadu_ps(xdb)),
                           _mm_cvtepi32_ps(sum), acc);
    }
    float a[4];
    _mm_storeu_ps(a, acc);
    for (int j = 0; j < NX; j++)
        out[j] = a[j];
}

/* The four-row decode kernels' (dot_k45_*_r4) start of super-block b of rows w + r · row_bytes,
 * r < 4: the blocks, their next four rows prefetched, the eight scales of each (bytes of sc[r])
 * and the mins' integer sums with x's sub-block sums (xsum; four lanes to add, mk[r]). */
TARGET_AVX2 static ALWAYS_INLINE void k45_r4_begin(const uint8_t *w, int64_t row_bytes, int64_t b,
                                                   int64_t bb, __m128i xsum, const uint8_t *blk[4],
                                                   uint64_t sc[4], __m128i mk[4]) {
    for (int r = 0; r < 4; r++) {
        blk[r] = w + r * row_bytes + b * bb;
        for (int64_t p = 0; p < bb; p += 64)
            _mm_prefetch((const char *)blk[r] + 4 * row_bytes + p, _MM_HINT_T0);
        uint64_t m64;
        scales_k4(blk[r] + 4, &sc[r], &m64);
        mk[r] = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m64)), xsum);
    }
}

/* Their float steps for super-block b, row r in lane r: acc + S · (d · xd) − M · (dmin · xd), as
 * two fused multiply-adds (the single-row kernels' order), S the rows' scaled sums and M their
 * mins' sums. */
TARGET_AVX2 static ALWAYS_INLINE __m128 k45_r4_finish(const uint8_t *const blk[4], __m128i S,
                                                      const __m128i mk[4], float xd, __m128 acc) {
    const __m128i m = _mm_hadd_epi32(_mm_hadd_epi32(mk[0], mk[1]), _mm_hadd_epi32(mk[2], mk[3]));
    const __m128 x = _mm_set1_ps(xd);
    const __m128 d =
        _mm_setr_ps(f16_at_c(blk[0]), f16_at_c(blk[1]), f16_at_c(blk[2]), f16_at_c(blk[3]));
    const __m128 dmin = _mm_setr_ps(f16_at_c(blk[0] + 2), f16_at_c(blk[1] + 2),
                                    f16_at_c(blk[2] + 2), f16_at_c(blk[3] + 2));
    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(S), _mm_mul_ps(d, x), acc);
    return _mm_fmadd_ps(_mm_cvtepi32_ps(m), _mm_xor_ps(_mm_mul_ps(dmin, x), _mm_set1_ps(-0.0f)),
                        acc);
}

/* Decode (one row of x) by four rows of W at once, out[r · Q_NX] for row r: the lanes that hold
 * the rows of x in dot_k45_avx2_nx hold four rows of W, each with its own scales (the same
 * integers and float steps: the same bits); x's values loaded once for the four. The next four
 * rows are prefetched as these are read. */
TARGET_AVX2 static ALWAYS_INLINE void dot_k45_avx2_r4(const uint8_t *w, int64_t row_bytes,
                                                      int64_t nb, const struct q_x *x, int64_t t,
                                                      float *out, const int five) {
    const int64_t bb = five ? 176 : 144;
    const int8_t *xq = x->q + t * x->cols;
    const float *xd = x->d + t * (x->cols / LLMEM_QK_K);
    const int16_t *xs = x->s + t * (x->cols / 16);
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m128i *bs = (const __m128i *)(xs + b * 16);
        const uint8_t *blk[4];
        uint64_t sc[4];
        __m128i mk[4];
        k45_r4_begin(w, row_bytes, b, bb,
                     _mm_hadd_epi16(_mm_loadu_si128(bs), _mm_loadu_si128(bs + 1)), blk, sc, mk);
        __m256i scv[4], qhv[4], sl[4];
        for (int r = 0; r < 4; r++) {
            scv[r] = _mm256_set1_epi64x((long long)sc[r]);
            qhv[r] =
                five ? _mm256_loadu_si256((const __m256i *)(blk[r] + 16)) : _mm256_setzero_si256();
            sl[r] = _mm256_setzero_si256();
        }
        for (int i = 0; i < 4; i++) {
            const int8_t *xb = xq + b * LLMEM_QK_K + 64 * i;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)xb);
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb + 32));
            for (int r = 0; r < 4; r++) {
                __m256i wl, wh;
                k45_pair_avx2(blk[r] + (five ? 48 : 16), i, five, &qhv[r], &wl, &wh);
                const __m256i scl = _mm256_shuffle_epi8(scv[r], k4_scale_pick(2 * i));
                const __m256i sch = _mm256_shuffle_epi8(scv[r], k4_scale_pick(2 * i + 1));
                sl[r] = _mm256_add_epi32(
                    sl[r], _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(wl, x0), scl),
                                            _mm256_madd_epi16(_mm256_maddubs_epi16(wh, x1), sch)));
            }
        }
        __m128i s1[4];
        for (int r = 0; r < 4; r++)
            s1[r] =
                _mm_add_epi32(_mm256_castsi256_si128(sl[r]), _mm256_extracti128_si256(sl[r], 1));
        acc = k45_r4_finish(blk, hsum4_i32(s1[0], s1[1], s1[2], s1[3]), mk, xd[b], acc);
    }
    float a[4];
    _mm_storeu_ps(a, acc);
    for (int r = 0; r < 4; r++)
        out[r * Q_NX] = a[r];
}

/* Decode (one row of x) by four rows of W (R4, the dot_*_r4 kernels), the rest row by row
 * (CALL_NX). */
#define DISPATCH_R4(R4, CALL_NX)                                                                   \
    int r = 0;                                                                                     \
    for (; nx == 1 && r + 4 <= nr; r += 4)                                                         \
        R4(w0 + (size_t)r * (size_t)row_bytes, out0 + r * Q_NX);                                   \
    w0 += (size_t)r * (size_t)row_bytes, out0 += r * Q_NX, nr -= r;                                \
    DISPATCH_ROWS_NX(CALL_NX)

#define K_ENTRY(NAME, TARGET, R4, CALL_NX)                                                         \
    TARGET static void NAME(DOT_ARGS) {                                                            \
        DISPATCH_R4(R4, CALL_NX)                                                                   \
    }
#define K45_AVX2(FIVE, N)         dot_k45_avx2_nx(w, nb, x, t, out, FIVE, N)
#define K45_AVX2_R4(FIVE, W, OUT) dot_k45_avx2_r4(W, row_bytes, nb, x, t, OUT, FIVE)
#define Q4K_AVX2(N)               K45_AVX2(0, N)
#define Q5K_AVX2(N)               K45_AVX2(1, N)
#define Q4K_AVX2_R4(W, OUT)       K45_AVX2_R4(0, W, OUT)
#define Q5K_AVX2_R4(W, OUT)       K45_AVX2_R4(1, W, OUT)
K_ENTRY(dot_q4_k_avx2, TARGET_AVX2, Q4K_AVX2_R4, Q4K_AVX2)
K_ENTRY(dot_q5_k_avx2, TARGET_AVX2, Q5K_AVX2_R4, Q5K_AVX2)

/* (Q6_K by four rows at once gains nothing with AVX2: row by row) */
TARGET_AVX2 static void dot_q6_k_avx2(DOT_ARGS){
#define CALL(N) dot_q6_k_avx2_nx(w, nb, x, t, out, N)
    DISPATCH_ROWS_NX(CALL)
#undef CALL
}

/* AVX-512BW for the K types: a 64-value run of x per instruction. Q4_K/Q5_K: the 32 nibble
 * bytes of a pair of sub-blocks in both halves of a register, shifted by 0 (low half: sub-block
 * 2i) and 4 (high half: 2i+1). Q6_K: 64 bytes of ql hold values 0…63 (low nibbles) and 64…127
 * (high nibbles) of a half, qh in both halves shifted per half. */
#define TARGET_512 __attribute__((target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl")))

TARGET_512 static ALWAYS_INLINE __m512i halves_epi16(short lo, short hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(lo)), _mm256_set1_epi16(hi),
                              1);
}

/* acc + the pairwise products of a and b: vpdpwssd where the CPU has VNNI (written as assembly,
 * so that one kernel body serves both tables), else vpmaddwd and vpaddd: the same exact integers.
 */
TARGET_512 static ALWAYS_INLINE __m512i dot2(__m512i acc, __m512i a, __m512i b, const int vnni) {
    if (vnni) {
        __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
        return acc;
    }
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
}

/* [scale 2i ×16 | scale 2i + 1 ×16] as 16-bit, for i < 4, from the eight scale bytes repeated in
 * every qword of sc: one shuffle. */
TARGET_512 static ALWAYS_INLINE __m512i k4_scales_pick(int i) {
    uint8_t c[64];
    for (int k = 0; k < 64; k++)
        c[k] = (k & 1) ? 0x80 : (uint8_t)(2 * i + (k >= 32));
    return _mm512_loadu_si512(c);
}

/* The 32-value types with AVX-512 VNNI: two blocks a register. Blocks 4k and 4k+1 go to the halves
 * of one accumulator (sets 0 and 1 of the canonical order), 4k+2 and 4k+3 to another (sets 2, 3);
 * the last nb mod 4 blocks to the sets as 8-lane halves. */

/* The sums of the 8-lane halves of a and b: [a low, a high, b low, b high]. */
TARGET_512 static ALWAYS_INLINE __m128i sums4_512(__m512i a, __m512i b) {
    /* 4 lanes a half: lanes 0–3 and 8–11 of each plus lanes 4–7 and 12–15 */
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i hi =
        _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    __m512i c =
        _mm512_add_epi32(_mm512_permutex2var_epi32(a, lo, b), _mm512_permutex2var_epi32(a, hi, b));
    c = _mm512_add_epi32(c, _mm512_shuffle_epi32(c, _MM_PERM_BADC));
    c = _mm512_add_epi32(c, _mm512_shuffle_epi32(c, _MM_PERM_CDAB));
    return _mm512_castsi512_si128(_mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), c));
}

/* Blocks 4k … 4k+3 at once: their sums in the lanes of one register, lane i set i. */
TARGET_VNNI static ALWAYS_INLINE void dot32_vnni512_nx(const uint8_t *w, int64_t nb,
                                                       const struct q_x *x, int64_t t, float *out,
                                                       const int kind, const int NX) {
    const int64_t bb = q32_bytes(kind);
    const int8_t *xq[Q_NX];
    const float *xd[Q_NX];
    __m128 acc[Q_NX];
    for (int j = 0; j < NX; j++) {
        xq[j] = x->q + (t + j) * x->cols;
        xd[j] = x->d + (t + j) * (x->cols / 32);
        acc[j] = _mm_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        const uint8_t *b0 = w + b * bb;
        for (int64_t p = 0; p < 4 * bb; p += 64) /* (as the K kernels) */
            _mm_prefetch((const char *)b0 + Q_PF_BYTES + p, _MM_HINT_T0);
        __m512i aw[2];
        __mmask64 neg[2];
        for (int h = 0; h < 2; h++) {
            const __m512i wv =
                _mm512_inserti64x4(_mm512_castsi256_si512(w32(b0 + 2 * h * bb, kind)),
                                   w32(b0 + (2 * h + 1) * bb, kind), 1);
            aw[h] = _mm512_abs_epi8(wv);
            neg[h] = _mm512_movepi8_mask(wv);
        }
        const __m128 dw = d4(b0, bb);
        for (int j = 0; j < NX; j++) {
            __m512i p[2];
            for (int h = 0; h < 2; h++) {
                __m512i xv = _mm512_loadu_si512(xq[j] + (b + 2 * h) * 32);
                xv = _mm512_mask_sub_epi8(xv, neg[h], _mm512_setzero_si512(), xv);
                p[h] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw[h], xv);
            }
            acc[j] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums4_512(p[0], p[1])),
                                  _mm_mul_ps(dw, _mm_loadu_ps(xd[j] + b)), acc[j]);
        }
    }
    for (int j = 0; j < NX; j++) {
        out[j] = dot32_finish(w, bb, b, nb, kind, xq[j], xd[j], acc[j]);
    }
}

DOT32_ENTRY(TARGET_VNNI, dot_q8_0_vnni512, dot32_vnni512_nx, Q32_8)
DOT32_ENTRY(TARGET_VNNI, dot_q4_0_vnni512, dot32_vnni512_nx, Q32_4)
DOT32_ENTRY(TARGET_VNNI, dot_q5_0_vnni512, dot32_vnni512_nx, Q32_5)

TARGET_512 static ALWAYS_INLINE
    void dot_k45_512_nx(const uint8_t *w, int64_t nb, const struct q_x *x, int64_t t, float *out,
                        const int five, const int vnni, const int NX) {
    const int64_t bb = five ? 176 : 144;
    const int8_t *xq[Q_NX];
    const float *xd[Q_NX];
    const int16_t *xs[Q_NX];
    float acc[Q_NX];
    for (int j = 0; j < NX; j++) {
        xq[j] = x->q + (t + j) * x->cols;
        xd[j] = x->d + (t + j) * (x->cols / LLMEM_QK_K);
        xs[j] = x->s + (t + j) * (x->cols / 16);
        acc[j] = 0.0f;
    }
    const __m512i m4 = _mm512_set1_epi8(0xf), one = _mm512_set1_epi8(1);
    const __m512i sh = halves_epi16(0, 4);
    const __m512i pick[4] = {k4_scales_pick(0), k4_scales_pick(1), k4_scales_pick(2),
                             k4_scales_pick(3)};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        const uint8_t *qs = blk + (five ? 48 : 16);
        for (int64_t p = 0; p < bb; p += 64) /* (the rows that follow too: a task's are one run) */
            _mm_prefetch((const char *)blk + Q_PF_BYTES + p, _MM_HINT_T0);
        uint64_t sc64, m64;
        scales_k4(blk + 4, &sc64, &m64);
        const __m512i scb = _mm512_set1_epi64((long long)sc64);
        const __m128i mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m64));
        __m512i qh = five ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)))
                          : _mm512_setzero_si512();
        __m512i s32[Q_NX];
        for (int j = 0; j < NX; j++)
            s32[j] = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) {
            __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * i)));
            __m512i wv = _mm512_and_si512(_mm512_srlv_epi16(q, sh), m4);
            if (five) {
                const __m512i shq = halves_epi16((short)(2 * i), (short)(2 * i + 1));
                wv = _mm512_or_si512(
                    wv, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shq), one), 4));
            }
            const __m512i sv = _mm512_shuffle_epi8(scb, pick[i]);
            for (int j = 0; j < NX; j++) {
                __m512i xv = _mm512_loadu_si512(xq[j] + b * LLMEM_QK_K + 64 * i);
                s32[j] = dot2(s32[j], _mm512_maddubs_epi16(wv, xv), sv, vnni);
            }
        }
        const float d = f16_at_c(blk), dmin = f16_at_c(blk + 2);
        for (int j = 0; j < NX; j++) {
            const __m128i *bs = (const __m128i *)(xs[j] + b * 16);
            const __m128i mk =
                _mm_madd_epi16(mins, _mm_hadd_epi16(_mm_loadu_si128(bs), _mm_loadu_si128(bs + 1)));
            acc[j] = fmaf((float)_mm512_reduce_add_epi32(s32[j]), d * xd[j][b], acc[j]);
            acc[j] = fmaf((float)hsum_i32_sse(mk), -(dmin * xd[j][b]), acc[j]);
        }
    }
    for (int j = 0; j < NX; j++)
        out[j] = acc[j];
}

/* The sums of the 16 lanes of each of s[0] … s[3], in lanes 0 … 3. */
TARGET_512 static ALWAYS_INLINE __m128i sums_of4_512(const __m512i s[4]) {
    const __m512i t0 = _mm512_add_epi32(_mm512_shuffle_i32x4(s[0], s[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                        _mm512_shuffle_i32x4(s[0], s[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512i t1 = _mm512_add_epi32(_mm512_shuffle_i32x4(s[2], s[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                        _mm512_shuffle_i32x4(s[2], s[3], _MM_SHUFFLE(3, 2, 3, 2)));
    /* 128-bit lane k: four partial sums of s[k] */
    __m512i u = _mm512_add_epi32(_mm512_shuffle_i32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_i32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)));
    u = _mm512_add_epi32(u, _mm512_shuffle_epi32(u, _MM_PERM_BADC));
    u = _mm512_add_epi32(u, _mm512_shuffle_epi32(u, _MM_PERM_CDAB));
    return _mm512_castsi512_si128(_mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), u));
}

/* Decode (one row of x) by four rows of W at once, out[h · Q_NX] for row h: each row's integers
 * and float steps are dot_k45_512_nx's (the same bits, the float steps in the lanes of one
 * register). x's values and sub-block sums are loaded once for the four rows, and the four rows'
 * sums reduced by shared shuffles. The next four rows are prefetched as these are read. */
TARGET_512 static ALWAYS_INLINE void dot_k45_512_r4(const uint8_t *w, int64_t row_bytes, int64_t nb,
                                                    const struct q_x *x, int64_t t, float *out,
                                                    const int five, const int vnni) {
    const int64_t bb = five ? 176 : 144;
    const int8_t *xq = x->q + t * x->cols;
    const float *xd = x->d + t * (x->cols / LLMEM_QK_K);
    const int16_t *xs = x->s + t * (x->cols / 16);
    const __m512i m4 = _mm512_set1_epi8(0xf), one = _mm512_set1_epi8(1);
    const __m512i sh = halves_epi16(0, 4);
    const __m512i pick[4] = {k4_scales_pick(0), k4_scales_pick(1), k4_scales_pick(2),
                             k4_scales_pick(3)};
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m128i *bs = (const __m128i *)(xs + b * 16);
        const uint8_t *blk[4];
        uint64_t sc[4];
        __m128i mk[4];
        k45_r4_begin(w, row_bytes, b, bb,
                     _mm_hadd_epi16(_mm_loadu_si128(bs), _mm_loadu_si128(bs + 1)), blk, sc, mk);
        __m512i scb[4], qh[4], s32[4];
        for (int r = 0; r < 4; r++) {
            scb[r] = _mm512_set1_epi64((long long)sc[r]);
            qh[r] = five
                        ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk[r] + 16)))
                        : _mm512_setzero_si512();
            s32[r] = _mm512_setzero_si512();
        }
        for (int i = 0; i < 4; i++) {
            const __m512i xv = _mm512_loadu_si512(xq + b * LLMEM_QK_K + 64 * i);
            for (int r = 0; r < 4; r++) {
                const uint8_t *qs = blk[r] + (five ? 48 : 16);
                __m512i q =
                    _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * i)));
                __m512i wv = _mm512_and_si512(_mm512_srlv_epi16(q, sh), m4);
                if (five) {
                    const __m512i shq = halves_epi16((short)(2 * i), (short)(2 * i + 1));
                    wv = _mm512_or_si512(
                        wv,
                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh[r], shq), one), 4));
                }
                const __m512i sv = _mm512_shuffle_epi8(scb[r], pick[i]);
                s32[r] = dot2(s32[r], _mm512_maddubs_epi16(wv, xv), sv, vnni);
            }
        }
        acc = k45_r4_finish(blk, sums_of4_512(s32), mk, xd[b], acc);
    }
    _Alignas(16) float a[4];
    _mm_store_ps(a, acc);
    for (int r = 0; r < 4; r++)
        out[r * Q_NX] = a[r];
}

TARGET_512 static ALWAYS_INLINE void dot_q6_k_512_nx(const uint8_t *w, int64_t nb,
                                                     const struct q_x *x, int64_t t, float *out,
                                                     const int vnni, const int NX) {
    const int8_t *xq[Q_NX];
    const float *xd[Q_NX];
    const int16_t *xs[Q_NX];
    float acc[Q_NX];
    for (int j = 0; j < NX; j++) {
        xq[j] = x->q + (t + j) * x->cols;
        xd[j] = x->d + (t + j) * (x->cols / LLMEM_QK_K);
        xs[j] = x->s + (t + j) * (x->cols / 16);
        acc[j] = 0.0f;
    }
    const __m512i m4 = _mm512_set1_epi8(0xf), m3 = _mm512_set1_epi8(3);
    const __m512i sh01 = halves_epi16(0, 2), sh23 = halves_epi16(4, 6);
    /* 128-bit lane k of the scales of values 0…63 of half h: sub-block 8h + k; of 64…127: +4 */
    __m512i idx[2][2];
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 2; g++) {
            short v[32];
            for (int k = 0; k < 32; k++)
                v[k] = (short)(8 * h + 4 * g + k / 8);
            idx[h][g] = _mm512_loadu_si512(v);
        }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * 210;
        for (int64_t p = 0; p < 210; p += 64)
            _mm_prefetch((const char *)blk + Q_PF_BYTES + p, _MM_HINT_T0);
        const int8_t *sc = (const int8_t *)(blk + 192);
        const __m256i sc16y = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        const __m512i sc16 = _mm512_castsi256_si512(sc16y);
        __m512i s32[Q_NX];
        for (int j = 0; j < NX; j++)
            s32[j] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
            const __m512i qh =
                _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
            const __m512i g01 = _mm512_or_si512(
                _mm512_and_si512(ql, m4),
                _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, sh01), m3), 4));
            const __m512i g23 = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, sh23), m3), 4));
            const __m512i sv01 = _mm512_permutexvar_epi16(idx[h][0], sc16);
            const __m512i sv23 = _mm512_permutexvar_epi16(idx[h][1], sc16);
            for (int j = 0; j < NX; j++) {
                const int8_t *xb = xq[j] + b * LLMEM_QK_K + 128 * h;
                s32[j] =
                    dot2(s32[j], _mm512_maddubs_epi16(g01, _mm512_loadu_si512(xb)), sv01, vnni);
                s32[j] = dot2(s32[j], _mm512_maddubs_epi16(g23, _mm512_loadu_si512(xb + 64)), sv23,
                              vnni);
            }
        }
        const float d = f16_at_c(blk + 208);
        for (int j = 0; j < NX; j++) {
            const __m256i c =
                _mm256_madd_epi16(sc16y, _mm256_loadu_si256((const __m256i *)(xs[j] + b * 16)));
            const int sum = _mm512_reduce_add_epi32(s32[j]) - 32 * hsum_i32_avx2(c);
            acc[j] = fmaf((float)sum, d * xd[j][b], acc[j]);
        }
    }
    for (int j = 0; j < NX; j++)
        out[j] = acc[j];
}

/* Decode by four rows of W, as dot_k45_512_r4 (the same bits as dot_q6_k_512_nx). */
TARGET_512 static ALWAYS_INLINE void dot_q6_k_512_r4(const uint8_t *w, int64_t row_bytes,
                                                     int64_t nb, const struct q_x *x, int64_t t,
                                                     float *out, const int vnni) {
    const int8_t *xq = x->q + t * x->cols;
    const float *xd = x->d + t * (x->cols / LLMEM_QK_K);
    const int16_t *xs = x->s + t * (x->cols / 16);
    const __m512i m4 = _mm512_set1_epi8(0xf), m3 = _mm512_set1_epi8(3);
    const __m512i sh01 = halves_epi16(0, 2), sh23 = halves_epi16(4, 6);
    __m512i idx[2][2];
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 2; g++) {
            short v[32];
            for (int k = 0; k < 32; k++)
                v[k] = (short)(8 * h + 4 * g + k / 8);
            idx[h][g] = _mm512_loadu_si512(v);
        }
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i xsv = _mm256_loadu_si256((const __m256i *)(xs + b * 16));
        const uint8_t *blk[4];
        __m512i sc16[4], s32[4];
        __m256i c[4];
        for (int r = 0; r < 4; r++) {
            blk[r] = w + r * row_bytes + b * 210;
            for (int64_t p = 0; p < 210; p += 64)
                _mm_prefetch((const char *)blk[r] + 4 * row_bytes + p, _MM_HINT_T0);
            const __m256i sc16y =
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk[r] + 192)));
            sc16[r] = _mm512_castsi256_si512(sc16y);
            c[r] = _mm256_madd_epi16(sc16y, xsv);
            s32[r] = _mm512_setzero_si512();
        }
        for (int h = 0; h < 2; h++) {
            const int8_t *xb = xq + b * LLMEM_QK_K + 128 * h;
            const __m512i x01 = _mm512_loadu_si512(xb), x23 = _mm512_loadu_si512(xb + 64);
            for (int r = 0; r < 4; r++) {
                const __m512i ql = _mm512_loadu_si512(blk[r] + 64 * h);
                const __m512i qh = _mm512_broadcast_i64x4(
                    _mm256_loadu_si256((const __m256i *)(blk[r] + 128 + 32 * h)));
                const __m512i g01 = _mm512_or_si512(
                    _mm512_and_si512(ql, m4),
                    _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, sh01), m3), 4));
                const __m512i g23 = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                    _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, sh23), m3), 4));
                s32[r] = dot2(s32[r], _mm512_maddubs_epi16(g01, x01),
                              _mm512_permutexvar_epi16(idx[h][0], sc16[r]), vnni);
                s32[r] = dot2(s32[r], _mm512_maddubs_epi16(g23, x23),
                              _mm512_permutexvar_epi16(idx[h][1], sc16[r]), vnni);
            }
        }
        const __m128i m = sums4_512(_mm512_inserti64x4(_mm512_castsi256_si512(c[0]), c[1], 1),
                                    _mm512_inserti64x4(_mm512_castsi256_si512(c[2]), c[3], 1));
        const __m128i sum = _mm_sub_epi32(sums_of4_512(s32), _mm_slli_epi32(m, 5));
        const __m128 d = _mm_setr_ps(f16_at_c(blk[0] + 208), f16_at_c(blk[1] + 208),
                                     f16_at_c(blk[2] + 208), f16_at_c(blk[3] + 208));
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(sum), _mm_mul_ps(d, _mm_set1_ps(xd[b])), acc);
    }
    _Alignas(16) float a[4];
    _mm_store_ps(a, acc);
    for (int r = 0; r < 4; r++)
        out[r * Q_NX] = a[r];
}

/* The entry points, with VNNI and without. */
#define D45(FIVE, VNNI, N)      dot_k45_512_nx(w, nb, x, t, out, FIVE, VNNI, N)
#define D6(VNNI, N)             dot_q6_k_512_nx(w, nb, x, t, out, VNNI, N)
#define R45(FIVE, VNNI, W, OUT) dot_k45_512_r4(W, row_bytes, nb, x, t, OUT, FIVE, VNNI)
#define R6(VNNI, W, OUT)        dot_q6_k_512_r4(W, row_bytes, nb, x, t, OUT, VNNI)
#define Q4K_512(N)              D45(0, 0, N)
#define Q5K_512(N)              D45(1, 0, N)
#define Q6K_512(N)              D6(0, N)
#define Q4K_VNNI(N)             D45(0, 1, N)
#define Q5K_VNNI(N)             D45(1, 1, N)
#define Q6K_VNNI(N)             D6(1, N)
#define Q4K_512_R4(W, OUT)      R45(0, 0, W, OUT)
#define Q5K_512_R4(W, OUT)      R45(1, 0, W, OUT)
#define Q6K_512_R4(W, OUT)      R6(0, W, OUT)
#define Q4K_VNNI_R4(W, OUT)     R45(0, 1, W, OUT)
#define Q5K_VNNI_R4(W, OUT)     R45(1, 1, W, OUT)
#define Q6K_VNNI_R4(W, OUT)     R6(1, W, OUT)
K_ENTRY(dot_q4_k_512, TARGET_512, Q4K_512_R4, Q4K_512)
K_ENTRY(dot_q5_k_512, TARGET_512, Q5K_512_R4, Q5K_512)
K_ENTRY(dot_q6_k_512, TARGET_512, Q6K_512_R4, Q6K_512)
K_ENTRY(dot_q4_k_vnni, TARGET_512, Q4K_VNNI_R4, Q4K_VNNI)
K_ENTRY(dot_q5_k_vnni, TARGET_512, Q5K_VNNI_R4, Q5K_VNNI)
K_ENTRY(dot_q6_k_vnni, TARGET_512, Q6K_VNNI_R4, Q6K_VNNI)

#endif

#if QX86
/* ---- panels for prefill (AVX-512 VNNI) ---------------------------------------------------------
 *
 * Q_MR rows of W unpacked into the thread's scratch, rows interleaved: per block or super-block,
 * the values (one byte each) as groups of 64 bytes, group g holding values 4g … 4g+3 of each of
 * the 16 rows (row r at bytes 4r … 4r+3); then the scales, one 32-bit lane a row. vpdpbusd with 4
 * values of x broadcast then multiplies 16 rows at once, every lane of an accumulator one row: a
 * block's or sub-block's integer sum needs no reduction (the K types' scale: one vpmulld). The
 * integers are those of the dot kernels, the float steps the same: the same bits. Packing costs
 * about one pass over the 16 rows, paid back over the rows of x of the chunk. */
#define PANEL_VALS 4096 /* bytes of a super-block's values */
/* Q4_K/Q5_K: values, 8 scales, 4 pairs of mins (16-bit each), d, −dmin */
#define PANEL_K45_BYTES (PANEL_VALS + 8 * 64 + 4 * 64 + 2 * 64)
/* Q6_K: values, 16 scales, 8 pairs of scales (16-bit each), d */
#define PANEL_K6_BYTES (PANEL_VALS + 16 * 64 + 8 * 64 + 64)
_Static_assert((size_t)(CPU_GEMM_K_MAX / LLMEM_QK_K) * PANEL_K6_BYTES <=
                   CPU_GEMM_THREAD_FLOATS * sizeof(float),
               "a panel of the longest row fits the thread's scratch");

/* The 16 rows' values of super-block b (rows row_bytes apart, v: 16 × 256 bytes in order) into
 * the interleaved groups: dword g of every row. */
TARGET_VNNI static ALWAYS_INLINE void panel_interleave(const uint8_t *v, uint8_t *dst) {
    const __m512i rows =
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32(LLMEM_QK_K / 4));
    for (int g = 0; g < LLMEM_QK_K / 4; g++)
        _mm512_storeu_si512(dst + 64 * g,
                            _mm512_i32gather_epi32(_mm512_add_epi32(rows, _mm512_set1_epi32(g)),
                                                   (const void *)v, 4));
}

TARGET_VNNI static void panel_pack_k45(const uint8_t *w, int64_t row_bytes, int64_t nb,
                                       const int five, uint8_t *pk) {
    const int64_t bb = five ? 176 : 144;
    uint8_t v[Q_MR * LLMEM_QK_K];
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *dst = pk + b * PANEL_K45_BYTES;
        int32_t *sc = (int32_t *)(dst + PANEL_VALS);
        int32_t *mn = sc + 8 * 16;
        float *dv = (float *)(mn + 4 * 16), *dm = dv + 16;
        for (int r = 0; r < Q_MR; r++) {
            const uint8_t *blk = w + r * row_bytes + b * bb;
            const uint8_t *qs = blk + (five ? 48 : 16);
            __m256i qh =
                five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                __m256i lo, hi;
                k45_pair_avx2(qs, i, five, &qh, &lo, &hi);
                _mm256_storeu_si256((__m256i *)(v + r * LLMEM_QK_K + 64 * i), lo);
                _mm256_storeu_si256((__m256i *)(v + r * LLMEM_QK_K + 64 * i + 32), hi);
            }
            int s[8], m[8];
            for (int j = 0; j < 8; j++) {
                scale_min_k4(j, blk + 4, &s[j], &m[j]);
                sc[j * 16 + r] = s[j];
            }
            for (int k = 0; k < 4; k++)
                mn[k * 16 + r] = (int32_t)((uint32_t)m[2 * k] | (uint32_t)m[2 * k + 1] << 16);
            dv[r] = f16_at_c(blk);
            dm[r] = -f16_at_c(blk + 2);
        }
        panel_interleave(v, dst);
    }
}

TARGET_VNNI static void panel_pack_k6(const uint8_t *w, int64_t row_bytes, int64_t nb,
                                      uint8_t *pk) {
    uint8_t v[Q_MR * LLMEM_QK_K];
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *dst = pk + b * PANEL_K6_BYTES;
        int32_t *sc = (int32_t *)(dst + PANEL_VALS);
        int32_t *sp = sc + 16 * 16;
        float *dv = (float *)(sp + 8 * 16);
        for (int r = 0; r < Q_MR; r++) {
            const uint8_t *blk = w + r * row_bytes + b * 210;
            for (int h = 0; h < 2; h++) {
                __m256i g[4];
                q6_groups_avx2(blk, h, g);
                for (int k = 0; k < 4; k++)
                    _mm256_storeu_si256((__m256i *)(v + r * LLMEM_QK_K + 128 * h + 32 * k), g[k]);
            }
            const int8_t *s = (const int8_t *)(blk + 192);
            for (int j = 0; j < 16; j++)
                sc[j * 16 + r] = s[j];
            for (int k = 0; k < 8; k++)
                sp[k * 16 + r] = (int32_t)((uint32_t)(uint16_t)s[2 * k] |
                                           (uint32_t)(uint16_t)s[2 * k + 1] << 16);
            dv[r] = f16_at_c(blk + 208);
        }
        panel_interleave(v, dst);
    }
}

static ALWAYS_INLINE int32_t x4_at(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The 16 rows of a panel times NX rows of x from t: out[j * Q_MR + r]. k6: Q6_K (16-value
 * sub-blocks, S = S1 − 32 · S2), else Q4_K/Q5_K (32-value sub-blocks and the mins). */
TARGET_VNNI static ALWAYS_INLINE void panel_mul_nx(const uint8_t *pk, int64_t nb,
                                                   const struct q_x *x, int64_t t, float *out,
                                                   const int k6, const int NX) {
    const int64_t pb = k6 ? PANEL_K6_BYTES : PANEL_K45_BYTES;
    const int sbv = k6 ? 16 : 32; /* values a sub-block */
    const int8_t *xq[Q_NX];
    const float *xd[Q_NX];
    const int16_t *xs[Q_NX];
    __m512 acc[Q_NX];
    for (int j = 0; j < NX; j++) {
        xq[j] = x->q + (t + j) * x->cols;
        xd[j] = x->d + (t + j) * (x->cols / LLMEM_QK_K);
        xs[j] = x->s + (t + j) * (x->cols / 16);
        acc[j] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = pk + b * pb;
        const __m512i *sc = (const __m512i *)(blk + PANEL_VALS);
        __m512i s1[Q_NX], s2[Q_NX];
        for (int j = 0; j < NX; j++)
            s1[j] = s2[j] = _mm512_setzero_si512();
        for (int sb = 0; sb < LLMEM_QK_K / sbv; sb++) {
            __m512i p[2][Q_NX];
            for (int j = 0; j < NX; j++)
                p[0][j] = p[1][j] = _mm512_setzero_si512();
            for (int g = 0; g < sbv / 4; g++) {
                const int v0 = sb * sbv + 4 * g;
                const __m512i wv = _mm512_loadu_si512(blk + 16 * v0);
                for (int j = 0; j < NX; j++)
                    p[g & 1][j] = _mm512_dpbusd_epi32(
                        p[g & 1][j], wv, _mm512_set1_epi32(x4_at(xq[j] + b * LLMEM_QK_K + v0)));
            }
            const __m512i sv = _mm512_loadu_si512(sc + sb);
            for (int j = 0; j < NX; j++)
                s1[j] = _mm512_add_epi32(
                    s1[j], _mm512_mullo_epi32(_mm512_add_epi32(p[0][j], p[1][j]), sv));
        }
        const __m512i *pairs = sc + LLMEM_QK_K / sbv;
        if (k6) {
            /* Σ scale · (sum of 16 values of x), sub-blocks in pairs */
            for (int k = 0; k < 8; k++) {
                const __m512i pv = _mm512_loadu_si512(pairs + k);
                for (int j = 0; j < NX; j++) {
                    int32_t xp;
                    memcpy(&xp, xs[j] + b * 16 + 2 * k, 4);
                    s2[j] = _mm512_dpwssd_epi32(s2[j], pv, _mm512_set1_epi32(xp));
                }
            }
            const __m512 dv = _mm512_loadu_ps((const float *)(pairs + 8));
            for (int j = 0; j < NX; j++) {
                const __m512i s = _mm512_sub_epi32(s1[j], _mm512_slli_epi32(s2[j], 5));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                         _mm512_mul_ps(dv, _mm512_set1_ps(xd[j][b])), acc[j]);
            }
        } else {
            /* Σ min · (sum of 32 values of x), sub-blocks in pairs */
            for (int k = 0; k < 4; k++) {
                const __m512i mv = _mm512_loadu_si512(pairs + k);
                for (int j = 0; j < NX; j++) {
                    const int16_t *bs = xs[j] + b * 16 + 4 * k;
                    const uint32_t xp = (uint32_t)(uint16_t)(bs[0] + bs[1]) |
                                        (uint32_t)(uint16_t)(bs[2] + bs[3]) << 16;
                    s2[j] = _mm512_dpwssd_epi32(s2[j], mv, _mm512_set1_epi32((int)xp));
                }
            }
            const __m512 dv = _mm512_loadu_ps((const float *)(pairs + 4));
            const __m512 dm = _mm512_loadu_ps((const float *)(pairs + 5));
            for (int j = 0; j < NX; j++) {
                const __m512 dx = _mm512_set1_ps(xd[j][b]);
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[j]), _mm512_mul_ps(dv, dx), acc[j]);
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2[j]), _mm512_mul_ps(dm, dx), acc[j]);
            }
        }
    }
    for (int j = 0; j < NX; j++)
        _mm512_storeu_ps(out + j * Q_MR, acc[j]);
}

/* The 32-value types' panels: per block, the 32 values (signed) as 8 groups of 64 bytes, then
 * −128 · Σw of each row, d, and (Q4_1, Q5_1) m. x is made unsigned (x + 128, an xor with 0x80) so
 * that vpdpbusd takes W signed as it lies; the accumulator starts at −128 · Σw, which leaves Σ w·x
 * exactly. */
static ALWAYS_INLINE int64_t panel32_bytes(const int kind) {
    return 8 * 64 + 64 + 64 + (q32_min(kind) ? 64 : 0);
}
_Static_assert((size_t)(CPU_GEMM_K_MAX / 32) * (8 * 64 + 3 * 64) <=
                   CPU_GEMM_THREAD_FLOATS * sizeof(float),
               "a panel of the longest row fits the thread's scratch");

TARGET_VNNI static void panel_pack_32(const uint8_t *w, int64_t row_bytes, int64_t nb,
                                      const int kind, uint8_t *pk) {
    const int64_t bb = q32_bytes(kind);
    const __m512i rows =
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32(8));
    uint8_t v[Q_MR * 32];
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *dst = pk + b * panel32_bytes(kind);
        int32_t *corr = (int32_t *)(dst + 8 * 64);
        float *dv = (float *)(corr + 16), *mv = dv + 16;
        for (int r = 0; r < Q_MR; r++) {
            const uint8_t *blk = w + r * row_bytes + b * bb;
            const __m256i wv = w32(blk, kind);
            _mm256_storeu_si256((__m256i *)(v + 32 * r), wv);
            corr[r] = -128 * hsum_i32_avx2(_mm256_dpbusd_epi32(_mm256_setzero_si256(),
                                                               _mm256_set1_epi8(1), wv));
            dv[r] = f16_at_c(blk);
            if (q32_min(kind))
                mv[r] = f16_at_c(blk + 2);
        }
        for (int g = 0; g < 8; g++)
            _mm512_storeu_si512(dst + 64 * g,
                                _mm512_i32gather_epi32(_mm512_add_epi32(rows, _mm512_set1_epi32(g)),
                                                       (const void *)v, 4));
    }
}

TARGET_VNNI static ALWAYS_INLINE void panel32_mul_nx(const uint8_t *pk, int64_t nb,
                                                     const struct q_x *x, int64_t t, float *out,
                                                     const int kind, const int NX) {
    const int8_t *xq[Q_NX];
    const float *xd[Q_NX];
    __m512 set[4][Q_NX];
    for (int j = 0; j < NX; j++) {
        xq[j] = x->q + (t + j) * x->cols;
        xd[j] = x->d + (t + j) * (x->cols / 32);
        set[0][j] = set[1][j] = set[2][j] = set[3][j] = _mm512_setzero_ps();
    }
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t b0 = 0; b0 < nb; b0 += 4)
        for (int k = 0; k < 4 && b0 + k < nb; k++) { /* block b into set k = b mod 4 */
            const int64_t b = b0 + k;
            const uint8_t *blk = pk + b * panel32_bytes(kind);
            __m512i p[2][Q_NX];
            for (int j = 0; j < NX; j++) {
                p[0][j] = _mm512_loadu_si512(blk + 8 * 64);
                p[1][j] = _mm512_setzero_si512();
            }
            for (int g = 0; g < 8; g++) {
                const __m512i wv = _mm512_loadu_si512(blk + 64 * g);
                for (int j = 0; j < NX; j++) {
                    const __m512i xu =
                        _mm512_xor_si512(_mm512_set1_epi32(x4_at(xq[j] + b * 32 + 4 * g)), flip);
                    p[g & 1][j] = _mm512_dpbusd_epi32(p[g & 1][j], xu, wv);
                }
            }
            const __m512 dv = _mm512_loadu_ps((const float *)(blk + 8 * 64 + 64));
            for (int j = 0; j < NX; j++)
                set[k][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(p[0][j], p[1][j])),
                                            _mm512_mul_ps(dv, _mm512_set1_ps(xd[j][b])), set[k][j]);
            if (q32_min(kind)) {
                const __m512 mv = _mm512_loadu_ps((const float *)(blk + 8 * 64 + 128));
                for (int j = 0; j < NX; j++) {
                    const int sq = hsum_i32_avx2(
                        dot4_avx2(_mm256_set1_epi8(1),
                                  _mm256_loadu_si256((const __m256i *)(xq[j] + b * 32))));
                    set[k][j] =
                        _mm512_fmadd_ps(_mm512_set1_ps((float)sq),
                                        _mm512_mul_ps(mv, _mm512_set1_ps(xd[j][b])), set[k][j]);
                }
            }
        }
    for (int j = 0; j < NX; j++)
        _mm512_storeu_ps(out + j * Q_MR, _mm512_add_ps(_mm512_add_ps(set[0][j], set[1][j]),
                                                       _mm512_add_ps(set[2][j], set[3][j])));
}

TARGET_VNNI static void panel_mul_32(const uint8_t *pk, int64_t nb, const struct q_x *x, int64_t t,
                                     int nx, float *out){
#define CALL(N) panel32_mul_nx(pk, nb, x, t, out, Q32_8, N)
    DISPATCH_NX(CALL)
#undef CALL
}

/* (Q4_1's and Q5_1's panels: the same layout, m after d) */
TARGET_VNNI static void panel_mul_32m(const uint8_t *pk, int64_t nb, const struct q_x *x, int64_t t,
                                      int nx, float *out){
#define CALL(N) panel32_mul_nx(pk, nb, x, t, out, Q32_4M, N)
    DISPATCH_NX(CALL)
#undef CALL
}

TARGET_VNNI static void panel_mul_k45(const uint8_t *pk, int64_t nb, const struct q_x *x, int64_t t,
                                      int nx, float *out){
#define CALL(N) panel_mul_nx(pk, nb, x, t, out, 0, N)
    DISPATCH_NX(CALL)
#undef CALL
}

TARGET_VNNI static void panel_mul_k6(const uint8_t *pk, int64_t nb, const struct q_x *x, int64_t t,
                                     int nx, float *out) {
#define CALL(N) panel_mul_nx(pk, nb, x, t, out, 1, N)
    DISPATCH_NX(CALL)
#undef CALL
}
#endif

/* ---- the kernel tables ------------------------------------------------------------------------
 */

struct q_kernels {
    void (*quantize)(const float *x, int64_t cols, int64_t blk, int8_t *q, float *d, int16_t *s);
    q_dot_fn q8_0, q4_0, q5_0, q4_1, q5_1, q4_k, q5_k, q6_k;
    const char *name;
    int panels; /* the K types' prefill by panels (AVX-512 VNNI) */
};

/* Designated: the fields a table does not name are zero. */
static const struct q_kernels q_scalar = {.quantize = quantize_x_scalar,
                                          .q8_0 = dot_q8_0_scalar,
                                          .q4_0 = dot_q4_0_scalar,
                                          .q5_0 = dot_q5_0_scalar,
                                          .q4_1 = dot_q4_1_scalar,
                                          .q5_1 = dot_q5_1_scalar,
                                          .q4_k = dot_q4_k_scalar,
                                          .q5_k = dot_q5_k_scalar,
                                          .q6_k = dot_q6_k_scalar,
                                          .name = "scalar"};
#if QX86
static const struct q_kernels q_avx2 = {.quantize = quantize_x_avx2,
                                        .q8_0 = dot32_avx2_q8_0,
                                        .q4_0 = dot32_avx2_q4_0,
                                        .q5_0 = dot32_avx2_q5_0,
                                        .q4_1 = dot32_avx2_q4_1,
                                        .q5_1 = dot32_avx2_q5_1,
                                        .q4_k = dot_q4_k_avx2,
                                        .q5_k = dot_q5_k_avx2,
                                        .q6_k = dot_q6_k_avx2,
                                        .name = "avx2"};
static const struct q_kernels q_512 = {.quantize = quantize_x_avx2,
                                       .q8_0 = dot32_avx2_q8_0,
                                       .q4_0 = dot32_avx2_q4_0,
                                       .q5_0 = dot32_avx2_q5_0,
                                       .q4_1 = dot32_avx2_q4_1,
                                       .q5_1 = dot32_avx2_q5_1,
                                       .q4_k = dot_q4_k_512,
                                       .q5_k = dot_q5_k_512,
                                       .q6_k = dot_q6_k_512,
                                       .name = "avx512"};
static const struct q_kernels q_vnni = {.quantize = quantize_x_avx2,
                                        .q8_0 = dot_q8_0_vnni512,
                                        .q4_0 = dot_q4_0_vnni512,
                                        .q5_0 = dot_q5_0_vnni512,
                                        .q4_1 = dot32_avx2_q4_1,
                                        .q5_1 = dot32_avx2_q5_1,
                                        .q4_k = dot_q4_k_vnni,
                                        .q5_k = dot_q5_k_vnni,
                                        .q6_k = dot_q6_k_vnni,
                                        .name = "avx512_vnni",
                                        .panels = 1};
#endif

static const struct q_kernels *q_kernels_for(enum cpu_isa isa, int no_vnni) {
#if QX86
    if (isa == CPU_ISA_AVX512)
        return !no_vnni && (llmem_sys_isa_features() & LLMEM_ISA_AVX512_VNNI) ? &q_vnni : &q_512;
    if (isa >= CPU_ISA_AVX2)
        return &q_avx2;
#endif
    (void)isa, (void)no_vnni;
    return &q_scalar;
}

const char *llmem_cpu_q_kernels_name(enum cpu_isa isa) {
    return q_kernels_for(isa, 0)->name;
}

static q_dot_fn q_dot_for(const struct q_kernels *k, int type) {
    switch (type) {
    case LLMEM_QTYPE_Q8_0: return k->q8_0;
    case LLMEM_QTYPE_Q4_0: return k->q4_0;
    case LLMEM_QTYPE_Q5_0: return k->q5_0;
    case LLMEM_QTYPE_Q4_1: return k->q4_1;
    case LLMEM_QTYPE_Q5_1: return k->q5_1;
    case LLMEM_QTYPE_Q4_K: return k->q4_k;
    case LLMEM_QTYPE_Q5_K: return k->q5_k;
    case LLMEM_QTYPE_Q6_K: return k->q6_k;
    default: return NULL;
    }
}

int llmem_cpu_matmul_q_supported(int type, int64_t cols) {
    return q_block_bytes(type) > 0 && cols > 0 && cols % q_block_elems(type) == 0 &&
           cols <= CPU_GEMM_K_MAX;
}

/* ---- the matmul -------------------------------------------------------------------------------
 */

struct q_job {
    const struct q_kernels *k;
    q_dot_fn dot;
    int panel;      /* Q_MR-row groups of a K type by panels, in the thread's scratch */
    float *scratch; /* the backend's per-thread scratch */
    const struct llmem_weight *w;
    const float *x, *bias;
    float *y;
    int8_t *xq;
    float *xd;
    int16_t *xs;
    int64_t t0, nt;        /* the chunk of rows of x */
    int64_t rows_per_task; /* W rows */
    int64_t blk, nb, row_bytes;
};

static void q_quantize_task(void *arg, int task, int thread) {
    (void)thread;
    const struct q_job *j = arg;
    const int64_t cols = j->w->cols;
    j->k->quantize(j->x + (j->t0 + task) * cols, cols, j->blk, j->xq + task * cols,
                   j->xd + task * (cols / j->blk),
                   j->xs != NULL ? j->xs + task * (cols / 16) : NULL);
}

#if QX86
/* Rows r0 … r0 + Q_MR − 1 of W times the chunk of x by a panel. */
static void q_panel_rows(const struct q_job *j, const struct q_x *xv, int64_t r0, int thread) {
    const int64_t rows = j->w->rows;
    uint8_t *pk = (uint8_t *)(j->scratch + (size_t)thread * CPU_GEMM_THREAD_FLOATS);
    const uint8_t *wr = (const uint8_t *)j->w->data + (size_t)r0 * (size_t)j->row_bytes;
    const int type = j->w->quant;
    if (type == LLMEM_QTYPE_Q6_K)
        panel_pack_k6(wr, j->row_bytes, j->nb, pk);
    else if (type == LLMEM_QTYPE_Q4_K || type == LLMEM_QTYPE_Q5_K)
        panel_pack_k45(wr, j->row_bytes, j->nb, type == LLMEM_QTYPE_Q5_K, pk);
    else
        panel_pack_32(wr, j->row_bytes, j->nb,
                      type == LLMEM_QTYPE_Q4_0   ? Q32_4
                      : type == LLMEM_QTYPE_Q5_0 ? Q32_5
                      : type == LLMEM_QTYPE_Q4_1 ? Q32_4M
                      : type == LLMEM_QTYPE_Q5_1 ? Q32_5M
                                                 : Q32_8,
                      pk);
    void (*mul)(const uint8_t *, int64_t, const struct q_x *, int64_t, int, float *) =
        type == LLMEM_QTYPE_Q6_K                               ? panel_mul_k6
        : type == LLMEM_QTYPE_Q4_K || type == LLMEM_QTYPE_Q5_K ? panel_mul_k45
        : type == LLMEM_QTYPE_Q4_1 || type == LLMEM_QTYPE_Q5_1 ? panel_mul_32m
                                                               : panel_mul_32;
    float out[Q_NX * Q_MR];
    for (int64_t t = 0; t < j->nt; t += Q_NX) {
        const int nx = j->nt - t < Q_NX ? (int)(j->nt - t) : Q_NX;
        mul(pk, j->nb, xv, t, nx, out);
        for (int i = 0; i < nx; i++) {
            float *yr = j->y + (j->t0 + t + i) * rows + r0;
            for (int r = 0; r < Q_MR; r++)
                yr[r] = j->bias != NULL ? out[i * Q_MR + r] + j->bias[r0 + r] : out[i * Q_MR + r];
        }
    }
}
#endif

/* W rows r_begin … r_end − 1 times the chunk of x. */
static void q_matmul_rows(const struct q_job *j, int64_t r_begin, int64_t r_end, int thread) {
    const int64_t rows = j->w->rows, cols = j->w->cols;
    const struct q_x xv = {j->xq, j->xd, j->xs, cols, j->blk};
    const uint8_t *wd = j->w->data;
    float out[Q_MR * Q_NX];
    for (int64_t r0 = r_begin; r0 < r_end; r0 += Q_MR) {
        int64_t r1 = r0 + Q_MR < r_end ? r0 + Q_MR : r_end;
#if QX86
        if (j->panel && r1 - r0 == Q_MR) {
            q_panel_rows(j, &xv, r0, thread);
            continue;
        }
#endif
        (void)thread;
        for (int64_t t = 0; t < j->nt; t += Q_NX) {
            const int nx = j->nt - t < Q_NX ? (int)(j->nt - t) : Q_NX;
            j->dot(wd + (size_t)r0 * (size_t)j->row_bytes, j->row_bytes, (int)(r1 - r0), j->nb, &xv,
                   t, nx, out);
            for (int64_t r = r0; r < r1; r++)
                for (int i = 0; i < nx; i++) {
                    const float v = out[(r - r0) * Q_NX + i];
                    j->y[(j->t0 + t + i) * rows + r] = j->bias != NULL ? v + j->bias[r] : v;
                }
        }
    }
}

static void q_matmul_task(void *arg, int task, int thread) {
    const struct q_job *j = arg;
    int64_t r_begin = (int64_t)task * j->rows_per_task;
    int64_t r_end =
        r_begin + j->rows_per_task < j->w->rows ? r_begin + j->rows_per_task : j->w->rows;
    q_matmul_rows(j, r_begin, r_end, thread);
}

/* Bytes of the quantized form of n rows of cols values in blocks of blk (q, d and, for the K
 * types, s; each part 64-byte aligned). */
static size_t q_x_bytes(int64_t n, int64_t cols, int64_t blk) {
    const size_t q = ((size_t)(n * cols) + 63) & ~(size_t)63;
    const size_t d = (((size_t)(n * (cols / blk)) * sizeof(float)) + 63) & ~(size_t)63;
    const size_t s =
        blk == LLMEM_QK_K ? (((size_t)(n * (cols / 16)) * sizeof(int16_t)) + 63) & ~(size_t)63 : 0;
    return q + d + s;
}

/* llmem_cpu_matmul_many's quantized matrices: each distinct input quantized once into the
 * packed-x scratch (one task a row), then the row ranges of every matrix in one dispatch. */
struct q_many_job {
    struct q_job jobs[CPU_MATMUL_MANY_MAX];
    struct {
        int job;
        int64_t r0, r1;
    } t[4 * CPU_MATMUL_MANY_MAX];
    struct {
        int job;
        int64_t row;
    } quantize[4 * CPU_MATMUL_MANY_MAX];
};

static void q_many_quantize_task(void *arg, int task, int thread) {
    const struct q_many_job *m = arg;
    q_quantize_task((void *)&m->jobs[m->quantize[task].job], (int)m->quantize[task].row, thread);
}

static void q_many_task(void *arg, int task, int thread) {
    const struct q_many_job *m = arg;
    q_matmul_rows(&m->jobs[m->t[task].job], m->t[task].r0, m->t[task].r1, thread);
}

int llmem_cpu_matmul_q_many(struct cpu_ctx *c, int count, const struct llmem_weight *const *w,
                            const float *const *x, const int64_t *n, float *const *y) {
    LLMEM_ASSERT(count >= 1 && count <= CPU_MATMUL_MANY_MAX);
    struct q_many_job *m = malloc(sizeof(*m));
    if (m == NULL)
        return LLMEM_ENOMEM;
    const struct q_kernels *k = q_kernels_for(c->isa, c->no_vnni);
    size_t used = 0;
    int n_quantize = 0, n_tasks = 0;
    int64_t rows_all = 0;
    for (int i = 0; i < count; i++)
        rows_all += w[i]->rows;
    /* a few ranges a thread over all the matrices, each range within one matrix */
    const int64_t per_all = rows_all / (c->n_threads * 4) + 1;
    for (int i = 0; i < count; i++) {
        struct q_job *j = &m->jobs[i];
        memset(j, 0, sizeof(*j));
        j->k = k;
        j->dot = q_dot_for(k, w[i]->quant);
        j->w = w[i], j->x = x[i], j->y = y[i];
        j->blk = q_block_elems(w[i]->quant);
        j->nb = w[i]->cols / j->blk, j->row_bytes = llmem_weight_row_bytes(w[i]);
        j->panel = k->panels && n[i] >= Q_PANEL_MIN_N;
        j->scratch = c->wpanel;
        j->t0 = 0, j->nt = n[i];
        /* an input already quantized with this block size: shared */
        int same = -1;
        for (int p = 0; p < i && same < 0; p++)
            if (x[p] == x[i] && n[p] == n[i] && m->jobs[p].blk == j->blk &&
                w[p]->cols == w[i]->cols)
                same = p;
        if (same >= 0) {
            j->xq = m->jobs[same].xq, j->xd = m->jobs[same].xd, j->xs = m->jobs[same].xs;
        } else {
            const size_t bytes = q_x_bytes(n[i], w[i]->cols, j->blk);
            if (used + bytes > CPU_GEMM_XT_BYTES || n_quantize + n[i] > 4 * CPU_MATMUL_MANY_MAX) {
                free(m);
                return LLMEM_ENOMEM;
            }
            uint8_t *base = (uint8_t *)c->xt + used;
            const int64_t cols = w[i]->cols;
            j->xq = (int8_t *)base;
            j->xd = (float *)(base + (((size_t)(n[i] * cols) + 63) & ~(size_t)63));
            j->xs = j->blk == LLMEM_QK_K
                        ? (int16_t *)((uint8_t *)j->xd +
                                      ((((size_t)(n[i] * (cols / j->blk)) * sizeof(float)) + 63) &
                                       ~(size_t)63))
                        : NULL;
            used += bytes;
            for (int64_t r = 0; r < n[i]; r++) {
                m->quantize[n_quantize].job = i;
                m->quantize[n_quantize++].row = r;
            }
        }
        int64_t per = per_all < w[i]->rows ? per_all : w[i]->rows;
        per = j->panel ? (per + Q_MR - 1) / Q_MR * Q_MR : (per + 3) & ~(int64_t)3;
        for (int64_t r0 = 0; r0 < w[i]->rows; r0 += per) {
            if (n_tasks == 4 * CPU_MATMUL_MANY_MAX) {
                free(m);
                return LLMEM_ENOMEM;
            }
            m->t[n_tasks].job = i;
            m->t[n_tasks].r0 = r0;
            m->t[n_tasks++].r1 = r0 + per < w[i]->rows ? r0 + per : w[i]->rows;
        }
    }
    if (n_quantize == 1 || c->n_threads == 1)
        for (int t = 0; t < n_quantize; t++)
            q_many_quantize_task(m, t, 0);
    else
        llmem_pool_run(c->pool, n_quantize, q_many_quantize_task, m);
    llmem_pool_run(c->pool, n_tasks, q_many_task, m);
    free(m);
    return LLMEM_OK;
}

void llmem_cpu_matmul_q(struct cpu_ctx *c, const struct llmem_weight *w, const float *x, int64_t n,
                        float *y, const float *bias) {
    const int64_t rows = w->rows, cols = w->cols;
    const int64_t blk = q_block_elems(w->quant);
    const int ksum = blk == LLMEM_QK_K;
    struct q_job job = {0};
    job.k = q_kernels_for(c->isa, c->no_vnni);
    job.dot = q_dot_for(job.k, w->quant);
    job.w = w, job.x = x, job.bias = bias, job.y = y;
    job.blk = blk, job.nb = cols / blk, job.row_bytes = llmem_weight_row_bytes(w);
    /* panels pay for their packing over several rows of x */
    job.panel = job.k->panels && n >= Q_PANEL_MIN_N;
    job.scratch = c->wpanel;
    /* the chunk: rows of x whose quantized form fits the packed-x scratch */
    const size_t q_bytes = ((size_t)cols + 63) & ~(size_t)63;
    const size_t d_bytes = (((size_t)(cols / blk) * sizeof(float)) + 63) & ~(size_t)63;
    const size_t s_bytes = ksum ? (((size_t)(cols / 16) * sizeof(int16_t)) + 63) & ~(size_t)63 : 0;
    int64_t chunk = (int64_t)(CPU_GEMM_XT_BYTES / (q_bytes + d_bytes + s_bytes));
    LLMEM_ASSERT(chunk >= Q_NX);
    chunk = chunk / Q_NX * Q_NX;
    if (chunk > n)
        chunk = n;
    /* the quantized rows side by side: q at cols apart, d and s likewise */
    uint8_t *base = (uint8_t *)c->xt;
    job.xq = (int8_t *)base;
    job.xd = (float *)(base + (((size_t)chunk * (size_t)cols + 63) & ~(size_t)63));
    job.xs = ksum ? (int16_t *)((uint8_t *)job.xd +
                                ((((size_t)chunk * (size_t)(cols / blk) * sizeof(float)) + 63) &
                                 ~(size_t)63))
                  : NULL;
    /* tasks: below ~64 K multiply-adds one; else a few contiguous W ranges per thread */
    int tasks = rows * cols * n < (int64_t)1 << 16 ? 1 : c->n_threads * 4;
    int64_t per = (rows + tasks - 1) / tasks;
    per = job.panel ? (per + Q_MR - 1) / Q_MR * Q_MR : (per + 3) & ~(int64_t)3;
    job.rows_per_task = per;
    const int n_tasks = (int)((rows + per - 1) / per);
    for (int64_t t0 = 0; t0 < n; t0 += chunk) {
        job.t0 = t0;
        job.nt = n - t0 < chunk ? n - t0 : chunk;
        if (job.nt == 1 || c->n_threads == 1)
            for (int64_t t = 0; t < job.nt; t++)
                q_quantize_task(&job, (int)t, 0);
        else
            llmem_pool_run(c->pool, (int)job.nt, q_quantize_task, &job);
        llmem_pool_run(c->pool, n_tasks, q_matmul_task, &job);
    }
}
