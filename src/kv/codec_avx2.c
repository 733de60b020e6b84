/*
 * kv/codec_avx2.c — the AVX2 + FMA + F16C kernels (struct llmem_kv_kernels): the row kernels of
 * every KV layout and the tile kernels of decode attention, on 8 lanes and sixteen registers; what
 * they compute, and how the set is chosen at run time, is said at the top of codec_simd.c.
 */
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kv/codec_internal.h"
#include "kv/codec_x86.h"

#if KV_X86

/* ---- AVX2 + FMA + F16C ----------------------------------------------------------------------- */

#define TARGET_AVX2 __attribute__((target("avx,avx2,fma,f16c")))

TARGET_AVX2 static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

TARGET_AVX2 static inline __m256 load8_f16(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p));
}

TARGET_AVX2 static inline __m256 load8_bf16(const uint8_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

TARGET_AVX2 static float dot_f32_avx2(const uint8_t *row, const float *q, int n) {
    const float *k = (const float *)(const void *)row;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(k + i), _mm256_loadu_ps(q + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(k + i + 8), _mm256_loadu_ps(q + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(k + i + 16), _mm256_loadu_ps(q + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(k + i + 24), _mm256_loadu_ps(q + i + 24), a3);
    }
    return hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

TARGET_AVX2 static float dot_f16_avx2(const uint8_t *row, const float *q, int n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 32) {
        const uint8_t *p = row + 2 * (size_t)i;
        a0 = _mm256_fmadd_ps(load8_f16(p), _mm256_loadu_ps(q + i), a0);
        a1 = _mm256_fmadd_ps(load8_f16(p + 16), _mm256_loadu_ps(q + i + 8), a1);
        a2 = _mm256_fmadd_ps(load8_f16(p + 32), _mm256_loadu_ps(q + i + 16), a2);
        a3 = _mm256_fmadd_ps(load8_f16(p + 48), _mm256_loadu_ps(q + i + 24), a3);
    }
    return hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

TARGET_AVX2 static float dot_bf16_avx2(const uint8_t *row, const float *q, int n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 32) {
        const uint8_t *p = row + 2 * (size_t)i;
        a0 = _mm256_fmadd_ps(load8_bf16(p), _mm256_loadu_ps(q + i), a0);
        a1 = _mm256_fmadd_ps(load8_bf16(p + 16), _mm256_loadu_ps(q + i + 8), a1);
        a2 = _mm256_fmadd_ps(load8_bf16(p + 32), _mm256_loadu_ps(q + i + 16), a2);
        a3 = _mm256_fmadd_ps(load8_bf16(p + 48), _mm256_loadu_ps(q + i + 24), a3);
    }
    return hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

TARGET_AVX2 static void axpy_f32_avx2(const uint8_t *row, float w, float *acc, int n) {
    const float *v = (const float *)(const void *)row;
    __m256 vw = _mm256_set1_ps(w);
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(acc + i,
                         _mm256_fmadd_ps(_mm256_loadu_ps(v + i), vw, _mm256_loadu_ps(acc + i)));
}

TARGET_AVX2 static void axpy_f16_avx2(const uint8_t *row, float w, float *acc, int n) {
    __m256 vw = _mm256_set1_ps(w);
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(
            acc + i, _mm256_fmadd_ps(load8_f16(row + 2 * (size_t)i), vw, _mm256_loadu_ps(acc + i)));
}

TARGET_AVX2 static void axpy_bf16_avx2(const uint8_t *row, float w, float *acc, int n) {
    __m256 vw = _mm256_set1_ps(w);
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(load8_bf16(row + 2 * (size_t)i), vw,
                                                  _mm256_loadu_ps(acc + i)));
}

TARGET_AVX2 static inline __m256 bcast_f16(const uint8_t *p) {
    return _mm256_set1_ps(_cvtsh_ss(get_u16(p)));
}

TARGET_AVX2 static inline __m256 u8x8_to_ps(__m128i b) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}

/* The elements [i, i + 8·W) of a stored row as f32 (W in ATTN_SCORES256): one vector of 8 for
 * f32, f16 and bf16; half a group of 32 (i a multiple of 16) for the quantized layouts, their
 * arithmetic that of the group decoders above. */
TARGET_AVX2 static inline void chunks8_f32(const uint8_t *row, int i, __m256 *v) {
    v[0] = _mm256_loadu_ps((const void *)(row + 4 * (size_t)i));
}
TARGET_AVX2 static inline void chunks8_f16(const uint8_t *row, int i, __m256 *v) {
    v[0] = load8_f16(row + 2 * (size_t)i);
}
TARGET_AVX2 static inline void chunks8_bf16(const uint8_t *row, int i, __m256 *v) {
    v[0] = load8_bf16(row + 2 * (size_t)i);
}
TARGET_AVX2 static inline void chunks8_q8(const uint8_t *row, int i, __m256 *v) {
    const uint8_t *p = row + (size_t)LLMEM_KV_Q8_GROUP_BYTES * (size_t)(i >> 5);
    __m256 s = bcast_f16(p + 32);
    for (int j = 0; j < 2; j++) {
        __m128i c = _mm_loadl_epi64((const __m128i *)(const void *)(p + (i & 16) + 8 * j));
        v[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), s);
    }
}
TARGET_AVX2 static inline void chunks8_q4(const uint8_t *row, int i, __m256 *v) {
    const uint8_t *p = row + (size_t)LLMEM_KV_Q4_GROUP_BYTES * (size_t)(i >> 5);
    __m256 s = bcast_f16(p + 16), m = bcast_f16(p + 18);
    __m128i b = _mm_loadu_si128((const __m128i *)(const void *)p);
    if (i & 16) /* elements 16–31: the high nibbles */
        b = _mm_srli_epi16(b, 4);
    b = _mm_and_si128(b, _mm_set1_epi8(0x0f));
    v[0] = _mm256_fmadd_ps(u8x8_to_ps(b), s, m);
    v[1] = _mm256_fmadd_ps(u8x8_to_ps(_mm_srli_si128(b, 8)), s, m);
}
TARGET_AVX2 static inline void chunks8_tqk(const uint8_t *row, int i, __m256 *v) {
    const uint8_t *p = row + (size_t)LLMEM_KV_TQK_GROUP_BYTES * (size_t)(i >> 5);
    __m256 s = bcast_f16(p + 32), m = bcast_f16(p + 34);
    for (int j = 0; j < 2; j++) {
        __m128i c = _mm_loadl_epi64((const __m128i *)(const void *)(p + (i & 16) + 8 * j));
        v[j] = _mm256_fmadd_ps(u8x8_to_ps(c), s, m);
    }
}
TARGET_AVX2 static inline void chunks8_tqv(const uint8_t *row, int i, __m256 *v) {
    const uint8_t *p = row + (size_t)LLMEM_KV_TQV_GROUP_BYTES * (size_t)(i >> 5);
    __m256 s = bcast_f16(p + 12);
    __m256 book = _mm256_loadu_ps(llmem_kv_tq_centroids);
    __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
    for (int j = 0; j < 2; j++) {
        const uint8_t *b = p + 3 * (((i & 16) >> 3) + j);
        int bits = b[0] | (b[1] << 8) | (b[2] << 16);
        __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(bits), shifts),
                                       _mm256_set1_epi32(7));
        v[j] = _mm256_mul_ps(_mm256_permutevar8x32_ps(book, idx), s);
    }
}

/* Quantized groups, decoded into four vectors of 8 (elements 0–7, 8–15, 16–23, 24–31): the two
 * halves above, with the arithmetic of the portable decoders in codec.c (FMA may fuse m + c·s). */
#define GROUP_AVX2(fmt)                                                                            \
    TARGET_AVX2 static inline void fmt##_group_avx2(const uint8_t *p, __m256 v[4]) {               \
        chunks8_##fmt(p, 0, v);                                                                    \
        chunks8_##fmt(p, 16, v + 2);                                                               \
    }
GROUP_AVX2(q8)
GROUP_AVX2(q4)
GROUP_AVX2(tqk)
GROUP_AVX2(tqv)

#define QUANT_DOT_AVX2(fmt, GROUP, BYTES)                                                          \
    TARGET_AVX2 static float dot_##fmt##_avx2(const uint8_t *row, const float *q, int n) {         \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                 \
        __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();                                 \
        for (int i = 0; i < n; i += 32, row += (BYTES)) {                                          \
            __m256 v[4];                                                                           \
            GROUP(row, v);                                                                         \
            a0 = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(q + i), a0);                                \
            a1 = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(q + i + 8), a1);                            \
            a2 = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(q + i + 16), a2);                           \
            a3 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(q + i + 24), a3);                           \
        }                                                                                          \
        return hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));               \
    }

#define QUANT_AXPY_AVX2(fmt, GROUP, BYTES)                                                         \
    TARGET_AVX2 static void axpy_##fmt##_avx2(const uint8_t *row, float w, float *acc, int n) {    \
        __m256 vw = _mm256_set1_ps(w);                                                             \
        for (int i = 0; i < n; i += 32, row += (BYTES)) {                                          \
            __m256 v[4];                                                                           \
            GROUP(row, v);                                                                         \
            for (int j = 0; j < 4; j++)                                                            \
                _mm256_storeu_ps(acc + i + 8 * j,                                                  \
                                 _mm256_fmadd_ps(v[j], vw, _mm256_loadu_ps(acc + i + 8 * j)));     \
        }                                                                                          \
    }

QUANT_DOT_AVX2(q8, q8_group_avx2, LLMEM_KV_Q8_GROUP_BYTES)
QUANT_DOT_AVX2(q4, q4_group_avx2, LLMEM_KV_Q4_GROUP_BYTES)
QUANT_DOT_AVX2(tqk, tqk_group_avx2, LLMEM_KV_TQK_GROUP_BYTES)
QUANT_AXPY_AVX2(q8, q8_group_avx2, LLMEM_KV_Q8_GROUP_BYTES)
QUANT_AXPY_AVX2(q4, q4_group_avx2, LLMEM_KV_Q4_GROUP_BYTES)
QUANT_AXPY_AVX2(tqv, tqv_group_avx2, LLMEM_KV_TQV_GROUP_BYTES)

/* ---- AVX2: one tile of decode attention for a group of four, two or one query heads ---------- */

/* The AVX-512 tile kernels' arithmetic (codec_avx512.c) on 8 lanes. */

/* e^x in f32 for x ≤ 0: exp512's reduction and polynomial, 2^n from its exponent bits; below
 * −87.3 (where 2^n would be subnormal) the result is 0, −∞ included. */
TARGET_AVX2 static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* Four vectors summed into 4 lanes per 128-bit half (sum4_lanes on 8 lanes), and two such
 * results into one: lane 4·u + x = Σ of a[4·u + x] (u = 0, 1). */
TARGET_AVX2 static inline __m256 sum4_lanes256(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 t01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
    __m256 t23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
    return _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2)));
}
TARGET_AVX2 static inline __m256 sum8(const __m256 *a) {
    __m256 s0 = sum4_lanes256(a[0], a[1], a[2], a[3]), s1 = sum4_lanes256(a[4], a[5], a[6], a[7]);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20),
                         _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* attn_softmax512 on 8 lanes: lane G·t + g of sv[0..8) (8 / G tokens a vector). */
TARGET_AVX2 static inline void attn_softmax256(const __m256 *sv, float *sc, int T, float *st,
                                               size_t hs, int n, int G) {
    const int per = 8 / G; /* tokens per vector */
    const int vecs = (T + per - 1) / per;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 s[8], mx = _mm256_set1_ps(-INFINITY);
    for (int j = 0; j < 8; j++) {
        int left = T - per * j; /* tokens of this vector */
        __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(G * left), lane));
        s[j] = j < vecs ? _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sv[j], valid)
                        : _mm256_set1_ps(-INFINITY);
        mx = _mm256_max_ps(mx, s[j]);
    }
    /* lanes 0..3: heads 0..3, or 0, 1, 0, 1, or 0, 0, 0, 0 */
    __m128 m_old = _mm_setr_ps(st[n], st[(size_t)(1 % G) * hs + n], st[(size_t)(2 % G) * hs + n],
                               st[(size_t)(3 % G) * hs + n]);
    __m128 l_old = _mm_setr_ps(st[n + 1], st[(size_t)(1 % G) * hs + n + 1],
                               st[(size_t)(2 % G) * hs + n + 1], st[(size_t)(3 % G) * hs + n + 1]);
    __m256 top = _mm256_set_m128(m_old, m_old);
    const bool stays =
        _mm_movemask_ps(_mm_cmp_ps(m_old, _mm_set1_ps(-INFINITY), _CMP_GT_OQ)) == 0xf &&
        _mm256_movemask_ps(_mm256_cmp_ps(mx, top, _CMP_GT_OQ)) == 0;
    __m128 m_new = m_old, corr = _mm_set1_ps(1.0f);
    if (!stays) {
        mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 0x01));
        if (G <= 2)
            mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, _MM_SHUFFLE(1, 0, 3, 2)));
        if (G == 1)
            mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, _MM_SHUFFLE(2, 3, 0, 1)));
        m_new = _mm_max_ps(m_old, _mm256_castps256_ps128(mx));
        top = _mm256_set_m128(m_new, m_new);
        corr = _mm256_castps256_ps128(
            exp256(_mm256_set_m128(_mm_setzero_ps(), _mm_sub_ps(m_old, m_new))));
    }
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < vecs; j++) {
        __m256 w = exp256(_mm256_sub_ps(s[j], top)); /* −∞ past T: 0 */
        _mm256_storeu_ps(sc + 4 + 8 * j, w);
        sum = _mm256_add_ps(sum, w);
    }
    sum = _mm256_add_ps(sum, _mm256_permute2f128_ps(sum, sum, 0x01));
    if (G <= 2)
        sum = _mm256_add_ps(sum, _mm256_shuffle_ps(sum, sum, _MM_SHUFFLE(1, 0, 3, 2)));
    if (G == 1)
        sum = _mm256_add_ps(sum, _mm256_shuffle_ps(sum, sum, _MM_SHUFFLE(2, 3, 0, 1)));
    __m128 l_new = _mm_add_ps(_mm_mul_ps(l_old, corr), _mm256_castps256_ps128(sum));
    float mv[4], lv[4];
    _mm_storeu_ps(mv, m_new);
    _mm_storeu_ps(lv, l_new);
    _mm_storeu_ps(sc, corr);
    for (int g = 0; g < G; g++) {
        st[(size_t)g * hs + (size_t)n] = mv[g];
        st[(size_t)g * hs + (size_t)n + 1] = lv[g];
    }
}

/* ATTN_SCORES512 and ATTN_VALUES512 on 8 lanes, with AVX2's sixteen registers: scores take 8 / G
 * tokens at a time (eight accumulators; the query chunks are loaded as the FMAs' operands), values
 * 16 elements at a time for the G heads. CHUNKS converts W chunks of 8 elements a call. */
#define ATTN_SCORES256(name, CHUNKS, W, G)                                                         \
    TARGET_AVX2 static void name(const uint8_t *keys, size_t key_stride, int T, const float *q,    \
                                 int n, float *st, size_t hs, float *sc,                           \
                                 struct llmem_kv_prefetch pf) {                                    \
        enum { TOK = 8 / (G) };                                                                    \
        struct pf_spread sp = pf_spread_init(pf, ((T + TOK - 1) / TOK) * (n / (8 * (W))));         \
        __m256 sv[8]; /* the scores, lane G·t + g of vector t / TOK */                            \
        for (int t0 = 0; t0 < T; t0 += TOK) {                                                      \
            const uint8_t *k[TOK];                                                                 \
            for (int u = 0; u < TOK; u++) /* past T: the last row again, masked below */           \
                k[u] = keys + (size_t)(t0 + u < T ? t0 + u : T - 1) * key_stride;                  \
            __m256 a[8]; /* a[u·G + g]: token u, head g */                                        \
            for (int x = 0; x < 8; x++)                                                            \
                a[x] = _mm256_setzero_ps();                                                        \
            for (int i = 0; i < n; i += 8 * (W)) {                                                 \
                pf_step(&sp);                                                                      \
                for (int u = 0; u < TOK; u++) {                                                    \
                    __m256 kc[W];                                                                  \
                    CHUNKS(k[u], i, kc);                                                           \
                    for (int w = 0; w < (W); w++)                                                  \
                        for (int g = 0; g < (G); g++)                                              \
                            a[u * (G) + g] = _mm256_fmadd_ps(                                      \
                                kc[w], _mm256_loadu_ps(q + (size_t)g * (size_t)n + i + 8 * w),     \
                                a[u * (G) + g]);                                                   \
                }                                                                                  \
            }                                                                                      \
            sv[t0 / TOK] = sum8(a);                                                                \
        }                                                                                          \
        attn_softmax256(sv, sc, T, st, hs, n, G);                                                  \
    }

#define ATTN_VALUES256(name, CHUNKS, W, G)                                                         \
    TARGET_AVX2 static void name(const uint8_t *values, size_t value_stride, int T,                \
                                 const float *sc, int n, float *st, size_t hs,                     \
                                 struct llmem_kv_prefetch pf) {                                    \
        struct pf_spread sp = pf_spread_init(pf, T * (n / 16));                                    \
        const float *w = sc + 4;                                                                   \
        for (int i = 0; i < n; i += 16) {                                                          \
            __m256 x[G][2];                                                                        \
            for (int g = 0; g < (G); g++)                                                          \
                for (int e = 0; e < 2; e++)                                                        \
                    x[g][e] = _mm256_mul_ps(_mm256_loadu_ps(st + (size_t)g * hs + i + 8 * e),      \
                                            _mm256_set1_ps(sc[g]));                                \
            const uint8_t *v = values;                                                             \
            for (int t = 0; t < T; t++, v += value_stride) {                                       \
                pf_step(&sp);                                                                      \
                __m256 vc[2];                                                                      \
                for (int e = 0; e < 2; e += (W))                                                   \
                    CHUNKS(v, i + 8 * e, vc + e);                                                  \
                for (int g = 0; g < (G); g++) {                                                    \
                    __m256 wg = _mm256_set1_ps(w[(G)*t + g]);                                      \
                    x[g][0] = _mm256_fmadd_ps(vc[0], wg, x[g][0]);                                 \
                    x[g][1] = _mm256_fmadd_ps(vc[1], wg, x[g][1]);                                 \
                }                                                                                  \
            }                                                                                      \
            for (int g = 0; g < (G); g++)                                                          \
                for (int e = 0; e < 2; e++)                                                        \
                    _mm256_storeu_ps(st + (size_t)g * hs + i + 8 * e, x[g][e]);                    \
        }                                                                                          \
    }

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
/* One format's tile kernels for four, two and one query heads (keys read with KC, values with
 * VC, W chunks a call). */
#define TILES256(fmt, KC, VC, W)                                                                   \
    ATTN_SCORES256(attn_scores_##fmt##_avx2, KC, W, 4)                                             \
    ATTN_VALUES256(attn_values_##fmt##_avx2, VC, W, 4)                                             \
    ATTN_SCORES256(attn_scores2_##fmt##_avx2, KC, W, 2)                                            \
    ATTN_VALUES256(attn_values2_##fmt##_avx2, VC, W, 2)                                            \
    ATTN_SCORES256(attn_scores1_##fmt##_avx2, KC, W, 1)                                            \
    ATTN_VALUES256(attn_values1_##fmt##_avx2, VC, W, 1)
TILES256(f32, chunks8_f32, chunks8_f32, 1)
TILES256(f16, chunks8_f16, chunks8_f16, 1)
TILES256(bf16, chunks8_bf16, chunks8_bf16, 1)
TILES256(q8, chunks8_q8, chunks8_q8, 2)
TILES256(q4, chunks8_q4, chunks8_q4, 2)
TILES256(tq, chunks8_tqk, chunks8_tqv, 2)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

const struct llmem_kv_kernels llmem_kv_kernels_avx2 = {
    .isa = LLMEM_KV_ISA_AVX2,
    .name = "avx2",
    .dot = {[LLMEM_KV_FORMAT_F32] = dot_f32_avx2,
            [LLMEM_KV_FORMAT_F16] = dot_f16_avx2,
            [LLMEM_KV_FORMAT_BF16] = dot_bf16_avx2,
            [LLMEM_KV_FORMAT_Q8] = dot_q8_avx2,
            [LLMEM_KV_FORMAT_Q4] = dot_q4_avx2,
            [LLMEM_KV_FORMAT_TQ] = dot_tqk_avx2},
    .axpy = {[LLMEM_KV_FORMAT_F32] = axpy_f32_avx2,
             [LLMEM_KV_FORMAT_F16] = axpy_f16_avx2,
             [LLMEM_KV_FORMAT_BF16] = axpy_bf16_avx2,
             [LLMEM_KV_FORMAT_Q8] = axpy_q8_avx2,
             [LLMEM_KV_FORMAT_Q4] = axpy_q4_avx2,
             [LLMEM_KV_FORMAT_TQ] = axpy_tqv_avx2},
    .attn_tile = TILE_TABLE(, avx2),
    .attn_tile2 = TILE_TABLE(2, avx2),
    .attn_tile1 = TILE_TABLE(1, avx2),
};
#endif /* KV_X86 */
