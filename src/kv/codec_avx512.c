/*
 * kv/codec_avx512.c — the AVX-512 (F, BW, VL) kernels (struct llmem_kv_kernels): the row kernels
 * of every KV layout, the GQA group and tile forms of f32, f16 and bf16, and the tile kernels of
 * decode attention, on 16 lanes; what they compute, and how the set is chosen at run time, is said
 * at the top of codec_simd.c.
 */
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kv/codec_internal.h"
#include "kv/codec_x86.h"

#if KV_X86

/* ---- AVX-512 F + BW + VL --------------------------------------------------------------------- */

#define TARGET_AVX512 __attribute__((target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl")))

TARGET_AVX512 static inline __m512 load16_f16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)p));
}

TARGET_AVX512 static inline __m512 load16_bf16(const uint8_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* Two vectors per group of 32, four accumulators over pairs of groups. */
#define DOT512_BODY(LOAD, STRIDE)                                                                  \
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                                     \
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();                                     \
    int i = 0;                                                                                     \
    for (; i + 64 <= n; i += 64) {                                                                 \
        const uint8_t *p = row + (STRIDE) * (size_t)i;                                             \
        a0 = _mm512_fmadd_ps(LOAD(p), _mm512_loadu_ps(q + i), a0);                                 \
        a1 = _mm512_fmadd_ps(LOAD(p + 16 * (STRIDE)), _mm512_loadu_ps(q + i + 16), a1);            \
        a2 = _mm512_fmadd_ps(LOAD(p + 32 * (STRIDE)), _mm512_loadu_ps(q + i + 32), a2);            \
        a3 = _mm512_fmadd_ps(LOAD(p + 48 * (STRIDE)), _mm512_loadu_ps(q + i + 48), a3);            \
    }                                                                                              \
    if (i < n) {                                                                                   \
        const uint8_t *p = row + (STRIDE) * (size_t)i;                                             \
        a0 = _mm512_fmadd_ps(LOAD(p), _mm512_loadu_ps(q + i), a0);                                 \
        a1 = _mm512_fmadd_ps(LOAD(p + 16 * (STRIDE)), _mm512_loadu_ps(q + i + 16), a1);            \
    }                                                                                              \
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)))

TARGET_AVX512 static inline __m512 load16_f32(const uint8_t *p) {
    return _mm512_loadu_ps((const void *)p);
}

TARGET_AVX512 static float dot_f32_avx512(const uint8_t *row, const float *q, int n) {
    DOT512_BODY(load16_f32, 4);
}

TARGET_AVX512 static float dot_f16_avx512(const uint8_t *row, const float *q, int n) {
    DOT512_BODY(load16_f16, 2);
}

TARGET_AVX512 static float dot_bf16_avx512(const uint8_t *row, const float *q, int n) {
    DOT512_BODY(load16_bf16, 2);
}

#define AXPY512_BODY(LOAD, STRIDE)                                                                 \
    do {                                                                                           \
        __m512 vw = _mm512_set1_ps(w);                                                             \
        for (int i = 0; i < n; i += 32) {                                                          \
            const uint8_t *p = row + (STRIDE) * (size_t)i;                                         \
            __m512 r0 = _mm512_fmadd_ps(LOAD(p), vw, _mm512_loadu_ps(acc + i));                    \
            __m512 r1 =                                                                            \
                _mm512_fmadd_ps(LOAD(p + 16 * (STRIDE)), vw, _mm512_loadu_ps(acc + i + 16));       \
            _mm512_storeu_ps(acc + i, r0);                                                         \
            _mm512_storeu_ps(acc + i + 16, r1);                                                    \
        }                                                                                          \
    } while (0)

TARGET_AVX512 static void axpy_f32_avx512(const uint8_t *row, float w, float *acc, int n) {
    AXPY512_BODY(load16_f32, 4);
}

TARGET_AVX512 static void axpy_f16_avx512(const uint8_t *row, float w, float *acc, int n) {
    AXPY512_BODY(load16_f16, 2);
}

TARGET_AVX512 static void axpy_bf16_avx512(const uint8_t *row, float w, float *acc, int n) {
    AXPY512_BODY(load16_bf16, 2);
}

/* A GQA group: four query heads per pass over the row, so each 16 elements are loaded and
 * converted once for four independent FMA chains. */
#define DOTG512_BODY(LOAD, STRIDE, DOT1)                                                           \
    int g = 0;                                                                                     \
    for (; g + 4 <= G; g += 4) {                                                                   \
        const float *q0 = q + (size_t)g * (size_t)n, *q1 = q0 + n, *q2 = q1 + n, *q3 = q2 + n;     \
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                                 \
        __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();                                 \
        for (int i = 0; i < n; i += 16) {                                                          \
            __m512 k = LOAD(row + (STRIDE) * (size_t)i);                                           \
            a0 = _mm512_fmadd_ps(k, _mm512_loadu_ps(q0 + i), a0);                                  \
            a1 = _mm512_fmadd_ps(k, _mm512_loadu_ps(q1 + i), a1);                                  \
            a2 = _mm512_fmadd_ps(k, _mm512_loadu_ps(q2 + i), a2);                                  \
            a3 = _mm512_fmadd_ps(k, _mm512_loadu_ps(q3 + i), a3);                                  \
        }                                                                                          \
        s[g] = _mm512_reduce_add_ps(a0);                                                           \
        s[g + 1] = _mm512_reduce_add_ps(a1);                                                       \
        s[g + 2] = _mm512_reduce_add_ps(a2);                                                       \
        s[g + 3] = _mm512_reduce_add_ps(a3);                                                       \
    }                                                                                              \
    for (; g < G; g++)                                                                             \
    s[g] = DOT1(row, q + (size_t)g * (size_t)n, n)

#define AXPYG512_BODY(LOAD, STRIDE)                                                                \
    do {                                                                                           \
        for (int i = 0; i < n; i += 16) {                                                          \
            __m512 v = LOAD(row + (STRIDE) * (size_t)i);                                           \
            for (int g = 0; g < G; g++) {                                                          \
                float *a = acc + (size_t)g * stride + i;                                           \
                _mm512_storeu_ps(a, _mm512_fmadd_ps(v, _mm512_set1_ps(w[g]), _mm512_loadu_ps(a))); \
            }                                                                                      \
        }                                                                                          \
    } while (0)

TARGET_AVX512
static void dotg_f32_avx512(const uint8_t *row, const float *q, int G, int n, float *s) {
    DOTG512_BODY(load16_f32, 4, dot_f32_avx512);
}
TARGET_AVX512 static void dotg_f16_avx512(const uint8_t *row, const float *q, int G, int n,
                                          float *s) {
    DOTG512_BODY(load16_f16, 2, dot_f16_avx512);
}
TARGET_AVX512 static void dotg_bf16_avx512(const uint8_t *row, const float *q, int G, int n,
                                           float *s) {
    DOTG512_BODY(load16_bf16, 2, dot_bf16_avx512);
}
TARGET_AVX512 static void axpyg_f32_avx512(const uint8_t *row, const float *w, int G, float *acc,
                                           size_t stride, int n) {
    AXPYG512_BODY(load16_f32, 4);
}

TARGET_AVX512
static void axpyg_f16_avx512(const uint8_t *row, const float *w, int G, float *acc, size_t stride,
                             int n) {
    AXPYG512_BODY(load16_f16, 2);
}

TARGET_AVX512
static void axpyg_bf16_avx512(const uint8_t *row, const float *w, int G, float *acc, size_t stride,
                              int n) {
    AXPYG512_BODY(load16_bf16, 2);
}

/* A tile of T rows for a group of heads: four accumulators stay in registers across the rows,
 * and each 16 elements of a row are loaded and converted once for the four heads. */
#define AXPYT512_BODY(LOAD, STRIDE)                                                                \
    do {                                                                                           \
        for (int i = 0; i < n; i += 16) {                                                          \
            int g = 0;                                                                             \
            for (; g + 4 <= G; g += 4) {                                                           \
                float *c0 = acc + (size_t)g * stride + i, *c1 = c0 + stride;                       \
                float *c2 = c1 + stride, *c3 = c2 + stride;                                        \
                const float *w0 = w + (size_t)g * (size_t)T, *w1 = w0 + T, *w2 = w1 + T;           \
                const float *w3 = w2 + T;                                                          \
                __m512 a0 = _mm512_loadu_ps(c0), a1 = _mm512_loadu_ps(c1);                         \
                __m512 a2 = _mm512_loadu_ps(c2), a3 = _mm512_loadu_ps(c3);                         \
                for (int t = 0; t < T; t++) {                                                      \
                    __m512 v = LOAD(rows + (size_t)t * row_stride + (STRIDE) * (size_t)i);         \
                    a0 = _mm512_fmadd_ps(v, _mm512_set1_ps(w0[t]), a0);                            \
                    a1 = _mm512_fmadd_ps(v, _mm512_set1_ps(w1[t]), a1);                            \
                    a2 = _mm512_fmadd_ps(v, _mm512_set1_ps(w2[t]), a2);                            \
                    a3 = _mm512_fmadd_ps(v, _mm512_set1_ps(w3[t]), a3);                            \
                }                                                                                  \
                _mm512_storeu_ps(c0, a0);                                                          \
                _mm512_storeu_ps(c1, a1);                                                          \
                _mm512_storeu_ps(c2, a2);                                                          \
                _mm512_storeu_ps(c3, a3);                                                          \
            }                                                                                      \
            for (; g < G; g++) {                                                                   \
                float *c0 = acc + (size_t)g * stride + i;                                          \
                __m512 a0 = _mm512_loadu_ps(c0);                                                   \
                for (int t = 0; t < T; t++)                                                        \
                    a0 = _mm512_fmadd_ps(                                                          \
                        LOAD(rows + (size_t)t * row_stride + (STRIDE) * (size_t)i),                \
                        _mm512_set1_ps(w[(size_t)g * (size_t)T + (size_t)t]), a0);                 \
                _mm512_storeu_ps(c0, a0);                                                          \
            }                                                                                      \
        }                                                                                          \
    } while (0)

TARGET_AVX512 static void axpyt_f32_avx512(const uint8_t *rows, size_t row_stride, int T,
                                           const float *w, int G, float *acc, size_t stride,
                                           int n) {
    AXPYT512_BODY(load16_f32, 4);
}

TARGET_AVX512 static void axpyt_f16_avx512(const uint8_t *rows, size_t row_stride, int T,
                                           const float *w, int G, float *acc, size_t stride,
                                           int n) {
    AXPYT512_BODY(load16_f16, 2);
}

TARGET_AVX512 static void axpyt_bf16_avx512(const uint8_t *rows, size_t row_stride, int T,
                                            const float *w, int G, float *acc, size_t stride,
                                            int n) {
    AXPYT512_BODY(load16_bf16, 2);
}

/* Quantized groups, decoded into two vectors of 16 (elements 0–15, 16–31). */

TARGET_AVX512 static inline __m512 bcast512_f16(const uint8_t *p) {
    return _mm512_set1_ps(_cvtsh_ss(get_u16(p)));
}

TARGET_AVX512 static inline __m512 u8x16_to_ps(__m128i b) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
}

TARGET_AVX512 static inline void q8_group_avx512(const uint8_t *p, __m512 v[2]) {
    __m512 s = bcast512_f16(p + 32);
    for (int j = 0; j < 2; j++) {
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(p + 16 * j));
        v[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), s);
    }
}

TARGET_AVX512 static inline void q4_group_avx512(const uint8_t *p, __m512 v[2]) {
    __m512 s = bcast512_f16(p + 16), m = bcast512_f16(p + 18);
    __m128i b = _mm_loadu_si128((const __m128i *)(const void *)p);
    v[0] = _mm512_fmadd_ps(u8x16_to_ps(_mm_and_si128(b, _mm_set1_epi8(0x0f))), s, m);
    v[1] = _mm512_fmadd_ps(u8x16_to_ps(_mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f))), s,
                           m);
}

TARGET_AVX512 static inline void tqk_group_avx512(const uint8_t *p, __m512 v[2]) {
    __m512 s = bcast512_f16(p + 32), m = bcast512_f16(p + 34);
    for (int j = 0; j < 2; j++)
        v[j] = _mm512_fmadd_ps(
            u8x16_to_ps(_mm_loadu_si128((const __m128i *)(const void *)(p + 16 * j))), s, m);
}

TARGET_AVX512 static inline void tqv_group_avx512(const uint8_t *p, __m512 v[2]) {
    __m512 s = bcast512_f16(p + 12);
    /* indices stay below 8: the upper half of the table is never read */
    __m512 book = _mm512_castps256_ps512(_mm256_loadu_ps(llmem_kv_tq_centroids));
    __m512i shifts = _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21);
    for (int j = 0; j < 2; j++) {
        const uint8_t *b = p + 6 * j;
        int lo = b[0] | (b[1] << 8) | (b[2] << 16), hi = b[3] | (b[4] << 8) | (b[5] << 16);
        __m512i bits = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(lo)),
                                          _mm256_set1_epi32(hi), 1);
        __m512i idx = _mm512_and_si512(_mm512_srlv_epi32(bits, shifts), _mm512_set1_epi32(7));
        v[j] = _mm512_mul_ps(_mm512_permutexvar_ps(idx, book), s);
    }
}

#define QUANT_DOT_AVX512(fmt, GROUP, BYTES)                                                        \
    TARGET_AVX512 static float dot_##fmt##_avx512(const uint8_t *row, const float *q, int n) {     \
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                                 \
        for (int i = 0; i < n; i += 32, row += (BYTES)) {                                          \
            __m512 v[2];                                                                           \
            GROUP(row, v);                                                                         \
            a0 = _mm512_fmadd_ps(v[0], _mm512_loadu_ps(q + i), a0);                                \
            a1 = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(q + i + 16), a1);                           \
        }                                                                                          \
        return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));                                        \
    }

#define QUANT_AXPY_AVX512(fmt, GROUP, BYTES)                                                       \
    TARGET_AVX512 static void axpy_##fmt##_avx512(const uint8_t *row, float w, float *acc,         \
                                                  int n) {                                         \
        __m512 vw = _mm512_set1_ps(w);                                                             \
        for (int i = 0; i < n; i += 32, row += (BYTES)) {                                          \
            __m512 v[2];                                                                           \
            GROUP(row, v);                                                                         \
            _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(v[0], vw, _mm512_loadu_ps(acc + i)));        \
            _mm512_storeu_ps(acc + i + 16,                                                         \
                             _mm512_fmadd_ps(v[1], vw, _mm512_loadu_ps(acc + i + 16)));            \
        }                                                                                          \
    }

QUANT_DOT_AVX512(q8, q8_group_avx512, LLMEM_KV_Q8_GROUP_BYTES)
QUANT_DOT_AVX512(q4, q4_group_avx512, LLMEM_KV_Q4_GROUP_BYTES)
QUANT_DOT_AVX512(tqk, tqk_group_avx512, LLMEM_KV_TQK_GROUP_BYTES)
QUANT_AXPY_AVX512(q8, q8_group_avx512, LLMEM_KV_Q8_GROUP_BYTES)
QUANT_AXPY_AVX512(q4, q4_group_avx512, LLMEM_KV_Q4_GROUP_BYTES)
QUANT_AXPY_AVX512(tqv, tqv_group_avx512, LLMEM_KV_TQV_GROUP_BYTES)

/* ---- AVX-512: one tile of decode attention for a group of four query heads ------------------ */

/* e^x in f32 for x ≤ 0 (the arguments of a softmax), within about 1 ulp for x ≥ −87: Cody–Waite
 * reduction x = n·ln 2 + r (|r| ≤ ln 2 / 2, ln 2 split in two so that n·ln2_hi is exact), the
 * degree-7 polynomial of Cephes' expf for e^r, and VSCALEFPS for 2^n, which underflows gradually
 * to 0. Below −110 the result is 0 (−∞ included), above 88.7 it saturates. */
TARGET_AVX512 static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-110.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* The elements of a stored row as f32 that a tile kernel's step takes, per format (W in
 * ATTN_SCORES512): [i, i + 16) (i a multiple of 16), or for q8 the 32 of a group (i a multiple
 * of 32), whose scale is then converted once for both halves. */
TARGET_AVX512 static inline void chunks_f32(const uint8_t *row, int i, __m512 *v) {
    v[0] = _mm512_loadu_ps((const void *)(row + 4 * (size_t)i));
}
TARGET_AVX512 static inline void chunks_f16(const uint8_t *row, int i, __m512 *v) {
    v[0] = load16_f16(row + 2 * (size_t)i);
}
TARGET_AVX512 static inline void chunks_bf16(const uint8_t *row, int i, __m512 *v) {
    v[0] = load16_bf16(row + 2 * (size_t)i);
}
TARGET_AVX512 static inline void chunks_q8(const uint8_t *row, int i, __m512 *v) {
    q8_group_avx512(row + (size_t)LLMEM_KV_Q8_GROUP_BYTES * (size_t)(i >> 5), v);
}
TARGET_AVX512 static inline void chunks_q4(const uint8_t *row, int i, __m512 *v) {
    q4_group_avx512(row + (size_t)LLMEM_KV_Q4_GROUP_BYTES * (size_t)(i >> 5), v);
}
TARGET_AVX512 static inline void chunks_tqk(const uint8_t *row, int i, __m512 *v) {
    tqk_group_avx512(row + (size_t)LLMEM_KV_TQK_GROUP_BYTES * (size_t)(i >> 5), v);
}
TARGET_AVX512 static inline void chunks_tqv(const uint8_t *row, int i, __m512 *v) {
    tqv_group_avx512(row + (size_t)LLMEM_KV_TQV_GROUP_BYTES * (size_t)(i >> 5), v);
}

/* Four vectors (heads 0–3 of one token) summed into 4 lanes: per 128-bit lane, [h0, h1, h2, h3]
 * partial sums (the four lanes still to be added). */
TARGET_AVX512 static inline __m512 sum4_lanes(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    return _mm512_add_ps(_mm512_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2)));
}

/* Four such vectors (tokens 0–3) into one: lane 4·t + g = Σ q_g·k_t. */
TARGET_AVX512 static inline __m512 sum16(__m512 u0, __m512 u1, __m512 u2, __m512 u3) {
    __m512 p01 = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 p23 = _mm512_add_ps(_mm512_shuffle_f32x4(u2, u3, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(u2, u3, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(p01, p23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(p01, p23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* A tile of T ≤ 16 tokens of one KV head for G = 4, 2 or 1 query heads, in two calls (see
 * attn_tile in kv/codec_internal.h).
 * Scores: 16/G tokens at a time against the G queries, sixteen accumulators, each key chunk
 * converted once and each query chunk loaded once per 16/G tokens, then one transposing reduction
 * into a vector of 16 scores (lane G·t + g); then the softmax step (attn_softmax512).
 * Values: 64 elements at a time for the G heads (the old state rescaled as it is loaded), each
 * value chunk converted once for the G heads.
 * CHUNKS converts W chunks of 16 elements a call (chunks_f16 and the like). */
#define ATTN_SCORES512(name, CHUNKS, W, G)                                                         \
    TARGET_AVX512 static void name(const uint8_t *keys, size_t key_stride, int T, const float *q,  \
                                   int n, float *st, size_t hs, float *sc,                         \
                                   struct llmem_kv_prefetch pf) {                                  \
        enum { TOK = 16 / (G) };                                                                   \
        struct pf_spread sp = pf_spread_init(pf, ((T + TOK - 1) / TOK) * (n / (16 * (W))));        \
        __m512 sv[4]; /* the scores, lane G·t + g of vector t / TOK */                            \
        for (int t0 = 0; t0 < T; t0 += TOK) {                                                      \
            const uint8_t *k[TOK];                                                                 \
            for (int u = 0; u < TOK; u++) /* past T: the last row again, masked below */           \
                k[u] = keys + (size_t)(t0 + u < T ? t0 + u : T - 1) * key_stride;                  \
            __m512 a[16]; /* a[u·G + g]: token u, head g */                                       \
            for (int x = 0; x < 16; x++)                                                           \
                a[x] = _mm512_setzero_ps();                                                        \
            for (int i = 0; i < n; i += 16 * (W)) {                                                \
                pf_step(&sp);                                                                      \
                __m512 x[G][W];                                                                    \
                for (int g = 0; g < (G); g++)                                                      \
                    for (int w = 0; w < (W); w++)                                                  \
                        x[g][w] = _mm512_loadu_ps(q + (size_t)g * (size_t)n + i + 16 * w);         \
                for (int u = 0; u < TOK; u++) {                                                    \
                    __m512 kc[W];                                                                  \
                    CHUNKS(k[u], i, kc);                                                           \
                    for (int w = 0; w < (W); w++)                                                  \
                        for (int g = 0; g < (G); g++)                                              \
                            a[u * (G) + g] = _mm512_fmadd_ps(kc[w], x[g][w], a[u * (G) + g]);      \
                }                                                                                  \
            }                                                                                      \
            sv[t0 / TOK] = sum16(                                                                  \
                sum4_lanes(a[0], a[1], a[2], a[3]), sum4_lanes(a[4], a[5], a[6], a[7]),            \
                sum4_lanes(a[8], a[9], a[10], a[11]), sum4_lanes(a[12], a[13], a[14], a[15]));     \
        }                                                                                          \
        attn_softmax512(sv, sc, T, st, hs, n, G);                                                  \
    }

#define ATTN_VALUES512(name, CHUNKS, W, G)                                                         \
    TARGET_AVX512 static void name(const uint8_t *values, size_t value_stride, int T,              \
                                   const float *sc, int n, float *st, size_t hs,                   \
                                   struct llmem_kv_prefetch pf) {                                  \
        struct pf_spread sp = pf_spread_init(pf, T * ((n + 63) / 64));                             \
        __m512 c[G];                                                                               \
        for (int g = 0; g < (G); g++)                                                              \
            c[g] = _mm512_set1_ps(sc[g]);                                                          \
        const float *w = sc + 4;                                                                   \
        int i = 0;                                                                                 \
        for (; i + 64 <= n; i += 64) {                                                             \
            __m512 x[G][4];                                                                        \
            for (int g = 0; g < (G); g++)                                                          \
                for (int e = 0; e < 4; e++)                                                        \
                    x[g][e] =                                                                      \
                        _mm512_mul_ps(_mm512_loadu_ps(st + (size_t)g * hs + i + 16 * e), c[g]);    \
            const uint8_t *v = values;                                                             \
            for (int t = 0; t < T; t++, v += value_stride) {                                       \
                pf_step(&sp);                                                                      \
                __m512 vc[4];                                                                      \
                for (int e = 0; e < 4; e += (W))                                                   \
                    CHUNKS(v, i + 16 * e, vc + e);                                                 \
                for (int g = 0; g < (G); g++) {                                                    \
                    __m512 wg = _mm512_set1_ps(w[(G)*t + g]);                                      \
                    for (int e = 0; e < 4; e++)                                                    \
                        x[g][e] = _mm512_fmadd_ps(vc[e], wg, x[g][e]);                             \
                }                                                                                  \
            }                                                                                      \
            for (int g = 0; g < (G); g++)                                                          \
                for (int e = 0; e < 4; e++)                                                        \
                    _mm512_storeu_ps(st + (size_t)g * hs + i + 16 * e, x[g][e]);                   \
        }                                                                                          \
        for (; i < n; i += 32) { /* head_dim ≡ 32 (mod 64) */                                    \
            __m512 x[G][2];                                                                        \
            for (int g = 0; g < (G); g++)                                                          \
                for (int e = 0; e < 2; e++)                                                        \
                    x[g][e] =                                                                      \
                        _mm512_mul_ps(_mm512_loadu_ps(st + (size_t)g * hs + i + 16 * e), c[g]);    \
            const uint8_t *v = values;                                                             \
            for (int t = 0; t < T; t++, v += value_stride) {                                       \
                pf_step(&sp);                                                                      \
                __m512 vc[2];                                                                      \
                for (int e = 0; e < 2; e += (W))                                                   \
                    CHUNKS(v, i + 16 * e, vc + e);                                                 \
                for (int g = 0; g < (G); g++) {                                                    \
                    __m512 wg = _mm512_set1_ps(w[(G)*t + g]);                                      \
                    x[g][0] = _mm512_fmadd_ps(vc[0], wg, x[g][0]);                                 \
                    x[g][1] = _mm512_fmadd_ps(vc[1], wg, x[g][1]);                                 \
                }                                                                                  \
            }                                                                                      \
            for (int g = 0; g < (G); g++)                                                          \
                for (int e = 0; e < 2; e++)                                                        \
                    _mm512_storeu_ps(st + (size_t)g * hs + i + 16 * e, x[g][e]);                   \
        }                                                                                          \
    }

/* The softmax step of a tile for G = 4, 2 or 1 heads: lane G·t + g of sv[0..4), counted across the
 * vectors, holds the score of token t (t < T) and head g (kept in registers, not stored and loaded
 * back with a mask: 2 % off a bf16 tile in cache); afterwards sc[0..G) hold the heads' rescale
 * factors e^(m − m') and sc[4 + G·t + g] the weights e^(s − m') (0 past T), and each head's m and
 * l (st + g·hs + n, + n + 1) are updated: l' = l·e^(m − m') + Σ weights. Lane l of a vector belongs
 * to head l mod G, so the reductions keep lanes of one head together: across the 128-bit quarters,
 * and for G ≤ 2 within them. */
TARGET_AVX512 static inline void attn_softmax512(const __m512 *sv, float *sc, int T, float *st,
                                                 size_t hs, int n, int G) {
    const int per = 16 / G; /* tokens per vector */
    const int vecs = (T + per - 1) / per;
    __m512 s[4];
    for (int j = 0; j < 4; j++) {
        int left = T - per * j; /* tokens of this vector */
        __mmask16 valid = (__mmask16)(left >= per ? 0xffffu
                                      : left <= 0 ? 0u
                                                  : (1u << (G * left)) - 1);
        s[j] = j < vecs ? _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, sv[j])
                        : _mm512_set1_ps(-INFINITY);
    }
    __m512 mx = _mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3]));
    /* lanes 0..3: heads 0..3, or 0, 1, 0, 1, or 0, 0, 0, 0 */
    __m128 m_old = _mm_setr_ps(st[n], st[(size_t)(1 % G) * hs + n], st[(size_t)(2 % G) * hs + n],
                               st[(size_t)(3 % G) * hs + n]);
    __m128 l_old = _mm_setr_ps(st[n + 1], st[(size_t)(1 % G) * hs + n + 1],
                               st[(size_t)(2 % G) * hs + n + 1], st[(size_t)(3 % G) * hs + n + 1]);
    __m512 top = _mm512_broadcast_f32x4(m_old);
    /* Once a few tiles are in, no head's maximum moves in most tiles: m' = m, the weights are
     * e^(s − m) and nothing is rescaled (e^0 = 1 exactly, so this is what the general path below
     * computes). Telling so lane by lane, before the maxima are reduced across lanes, lets the
     * exponentials start without waiting for that reduction (8 % of a tile's time in cache). */
    const bool stays = _mm_cmp_ps_mask(m_old, _mm_set1_ps(-INFINITY), _CMP_GT_OQ) == 0xf &&
                       _mm512_cmp_ps_mask(mx, top, _CMP_GT_OQ) == 0;
    __m128 m_new = m_old, corr = _mm_set1_ps(1.0f);
    if (!stays) {
        mx = _mm512_max_ps(mx, _mm512_shuffle_f32x4(mx, mx, _MM_SHUFFLE(1, 0, 3, 2)));
        mx = _mm512_max_ps(mx, _mm512_shuffle_f32x4(mx, mx, _MM_SHUFFLE(2, 3, 0, 1)));
        if (G <= 2)
            mx = _mm512_max_ps(mx, _mm512_shuffle_ps(mx, mx, _MM_SHUFFLE(1, 0, 3, 2)));
        if (G == 1)
            mx = _mm512_max_ps(mx, _mm512_shuffle_ps(mx, mx, _MM_SHUFFLE(2, 3, 0, 1)));
        m_new = _mm_max_ps(m_old, _mm512_castps512_ps128(mx));
        top = _mm512_broadcast_f32x4(m_new);
        /* e^(m − m'): 1 exactly where the maximum stays, 0 for the first tile (m = −∞) */
        corr = _mm512_castps512_ps128(exp512(_mm512_castps128_ps512(_mm_sub_ps(m_old, m_new))));
    }
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < vecs; j++) {
        __m512 w = exp512(_mm512_sub_ps(s[j], top)); /* −∞ past T: 0 */
        _mm512_storeu_ps(sc + 4 + 16 * j, w);
        sum = _mm512_add_ps(sum, w);
    }
    sum = _mm512_add_ps(sum, _mm512_shuffle_f32x4(sum, sum, _MM_SHUFFLE(1, 0, 3, 2)));
    sum = _mm512_add_ps(sum, _mm512_shuffle_f32x4(sum, sum, _MM_SHUFFLE(2, 3, 0, 1)));
    if (G <= 2)
        sum = _mm512_add_ps(sum, _mm512_shuffle_ps(sum, sum, _MM_SHUFFLE(1, 0, 3, 2)));
    if (G == 1)
        sum = _mm512_add_ps(sum, _mm512_shuffle_ps(sum, sum, _MM_SHUFFLE(2, 3, 0, 1)));
    __m128 l_new = _mm_add_ps(_mm_mul_ps(l_old, corr), _mm512_castps512_ps128(sum));
    float mv[4], lv[4];
    _mm_storeu_ps(mv, m_new);
    _mm_storeu_ps(lv, l_new);
    _mm_storeu_ps(sc, corr);
    for (int g = 0; g < G; g++) {
        st[(size_t)g * hs + (size_t)n] = mv[g];
        st[(size_t)g * hs + (size_t)n + 1] = lv[g];
    }
}

/* The scores the softmax takes (vectors j < ⌈T / (16 / G)⌉) were all set by the key loop, T ≥ 1;
 * gcc 12 does not see it through the prefetch steps. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
/* One format's tile kernels for four, two and one query heads (keys read with KC, values with
 * VC, W chunks a call). */
#define TILES512(fmt, KC, VC, W)                                                                   \
    ATTN_SCORES512(attn_scores_##fmt##_avx512, KC, W, 4)                                           \
    ATTN_VALUES512(attn_values_##fmt##_avx512, VC, W, 4)                                           \
    ATTN_SCORES512(attn_scores2_##fmt##_avx512, KC, W, 2)                                          \
    ATTN_VALUES512(attn_values2_##fmt##_avx512, VC, W, 2)                                          \
    ATTN_SCORES512(attn_scores1_##fmt##_avx512, KC, W, 1)                                          \
    ATTN_VALUES512(attn_values1_##fmt##_avx512, VC, W, 1)
TILES512(f32, chunks_f32, chunks_f32, 1)
TILES512(f16, chunks_f16, chunks_f16, 1)
TILES512(bf16, chunks_bf16, chunks_bf16, 1)
TILES512(q8, chunks_q8, chunks_q8, 2)
TILES512(q4, chunks_q4, chunks_q4, 2)
TILES512(tq, chunks_tqk, chunks_tqv, 2)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

const struct llmem_kv_kernels llmem_kv_kernels_avx512 = {
    .isa = LLMEM_KV_ISA_AVX512,
    .name = "avx512",
    .dot = {[LLMEM_KV_FORMAT_F32] = dot_f32_avx512,
            [LLMEM_KV_FORMAT_F16] = dot_f16_avx512,
            [LLMEM_KV_FORMAT_BF16] = dot_bf16_avx512,
            [LLMEM_KV_FORMAT_Q8] = dot_q8_avx512,
            [LLMEM_KV_FORMAT_Q4] = dot_q4_avx512,
            [LLMEM_KV_FORMAT_TQ] = dot_tqk_avx512},
    .axpy = {[LLMEM_KV_FORMAT_F32] = axpy_f32_avx512,
             [LLMEM_KV_FORMAT_F16] = axpy_f16_avx512,
             [LLMEM_KV_FORMAT_BF16] = axpy_bf16_avx512,
             [LLMEM_KV_FORMAT_Q8] = axpy_q8_avx512,
             [LLMEM_KV_FORMAT_Q4] = axpy_q4_avx512,
             [LLMEM_KV_FORMAT_TQ] = axpy_tqv_avx512},
    .dot_group = {[LLMEM_KV_FORMAT_F32] = dotg_f32_avx512,
                  [LLMEM_KV_FORMAT_F16] = dotg_f16_avx512,
                  [LLMEM_KV_FORMAT_BF16] = dotg_bf16_avx512},
    .axpy_group = {[LLMEM_KV_FORMAT_F32] = axpyg_f32_avx512,
                   [LLMEM_KV_FORMAT_F16] = axpyg_f16_avx512,
                   [LLMEM_KV_FORMAT_BF16] = axpyg_bf16_avx512},
    .axpy_tile = {[LLMEM_KV_FORMAT_F32] = axpyt_f32_avx512,
                  [LLMEM_KV_FORMAT_F16] = axpyt_f16_avx512,
                  [LLMEM_KV_FORMAT_BF16] = axpyt_bf16_avx512},
    .attn_tile = TILE_TABLE(, avx512),
    .attn_tile2 = TILE_TABLE(2, avx512),
    .attn_tile1 = TILE_TABLE(1, avx512),
};
#endif /* KV_X86 */
