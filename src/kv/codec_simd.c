/*
 * kv/codec_simd.c — the row kernels of attention (dot with a key, accumulate a value) for every
 * KV layout, in portable C and for x86-64 AVX2 and AVX-512, chosen at run time, and the tile
 * kernels of decode attention (attn_tile in kv/codec_internal.h) for AVX2 and AVX-512.
 *
 * Attention over a long context reads every stored key and value once per query: these loops are
 * memory-bound, so the vector kernels convert each group to f32 in registers and never write the
 * converted row anywhere: f16 with F16C (VCVTPH2PS), bf16 by zero-extending and shifting left by
 * 16 (exact), q8/tq-key codes by sign/zero extension and one multiply (add) with the group's
 * scale (and min), q4 nibbles by masking and shifting, tq's 3-bit codes by variable shifts and a
 * lookup of the 8 centroids with a lane permute (VPERMPS). Products are accumulated in f32 with
 * FMA in 2–4 independent accumulators, reduced at the end. bf16 deliberately does not use
 * AVX512_BF16's VDPBF16PS: it would round the f32 query to bf16, and the contract is Σ q·key
 * within f32 rounding. The portable kernels cover f32, f16 and bf16 (eight partial sums, which
 * compilers vectorize); for the quantized layouts codec.c decodes the row and uses them.
 *
 * Every kernel computes the same mathematical sum; results differ between kernels only by the
 * order of the f32 additions and by FMA's single rounding (|Δ| ≤ n·2^-24 Σ|q·k| for a dot,
 * ≤ 2^-23 (|acc| + |w·v|) per element for an accumulation).
 *
 * Selection: llmem_sys_isa_features() once, on first use; the chosen table is published with an
 * atomic pointer (threads racing on the first call store the same table). The x86 kernels are
 * compiled with GCC/Clang target attributes, so the library itself needs no -m flags and runs on
 * any x86-64; other targets get the portable kernels only.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kv/codec_internal.h"
#include "llmem/kv.h"
#include "llmem/sys.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KV_X86 1
#include <immintrin.h>
#else
#define KV_X86 0
#endif

/* ---- portable kernels ------------------------------------------------------------------------ */

/* Eight partial sums (element i into sum i mod 8) keep the additions independent, so the loop is
 * not one long chain of dependent f32 adds, and a compiler may turn it into vector code. */
#define DOT_SCALAR(name, ELEM)                                                                     \
    static float name(const uint8_t *row, const float *q, int n) {                                 \
        float s[8] = {0};                                                                          \
        for (int i = 0; i < n; i += 8)                                                             \
            for (int j = 0; j < 8; j++)                                                            \
                s[j] += q[i + j] * ELEM(row, i + j);                                               \
        return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));                  \
    }

static inline float elem_f32(const uint8_t *row, int i) {
    float k;
    memcpy(&k, row + 4 * (size_t)i, sizeof(k));
    return k;
}

static inline float elem_f16(const uint8_t *row, int i) {
    uint16_t h;
    memcpy(&h, row + 2 * (size_t)i, sizeof(h));
    return llmem_kv_half_to_float(h);
}

static inline float elem_bf16(const uint8_t *row, int i) {
    uint16_t b;
    memcpy(&b, row + 2 * (size_t)i, sizeof(b));
    return llmem_kv_bf16_to_float(b);
}

DOT_SCALAR(dot_f32_scalar, elem_f32)
DOT_SCALAR(dot_f16_scalar, elem_f16)
DOT_SCALAR(dot_bf16_scalar, elem_bf16)

#define AXPY_SCALAR(name, ELEM)                                                                    \
    static void name(const uint8_t *row, float w, float *acc, int n) {                             \
        for (int i = 0; i < n; i++)                                                                \
            acc[i] += w * ELEM(row, i);                                                            \
    }

AXPY_SCALAR(axpy_f32_scalar, elem_f32)
AXPY_SCALAR(axpy_f16_scalar, elem_f16)
AXPY_SCALAR(axpy_bf16_scalar, elem_bf16)

/* GQA groups: each 8 elements of a row converted once for up to four heads, with the arithmetic
 * of the per-head kernels above (the same partial sums in the same order, so the same results). */
#define DOTG_SCALAR(name, ELEM)                                                                    \
    static void name(const uint8_t *row, const float *q, int G, int n, float *s) {                 \
        for (int g0 = 0; g0 < G; g0 += 4) {                                                        \
            const int gn = G - g0 < 4 ? G - g0 : 4;                                                \
            float a[4][8] = {{0}};                                                                 \
            for (int i = 0; i < n; i += 8) {                                                       \
                float x[8];                                                                        \
                for (int j = 0; j < 8; j++)                                                        \
                    x[j] = ELEM(row, i + j);                                                       \
                for (int g = 0; g < gn; g++)                                                       \
                    for (int j = 0; j < 8; j++)                                                    \
                        a[g][j] += q[(size_t)(g0 + g) * (size_t)n + i + j] * x[j];                 \
            }                                                                                      \
            for (int g = 0; g < gn; g++)                                                           \
                s[g0 + g] = ((a[g][0] + a[g][1]) + (a[g][2] + a[g][3])) +                          \
                            ((a[g][4] + a[g][5]) + (a[g][6] + a[g][7]));                           \
        }                                                                                          \
    }

/* T rows accumulated for G heads, 8 elements of the output at a time for up to four heads. */
#define AXPYT_SCALAR(name, ELEM)                                                                   \
    static void name(const uint8_t *rows, size_t row_stride, int T, const float *w, int G,         \
                     float *acc, size_t stride, int n) {                                           \
        for (int g0 = 0; g0 < G; g0 += 4) {                                                        \
            const int gn = G - g0 < 4 ? G - g0 : 4;                                                \
            for (int i = 0; i < n; i += 8) {                                                       \
                float a[4][8];                                                                     \
                for (int g = 0; g < gn; g++)                                                       \
                    memcpy(a[g], acc + (size_t)(g0 + g) * stride + i, sizeof(a[g]));               \
                for (int t = 0; t < T; t++) {                                                      \
                    const uint8_t *row = rows + (size_t)t * row_stride;                            \
                    float x[8];                                                                    \
                    for (int j = 0; j < 8; j++)                                                    \
                        x[j] = ELEM(row, i + j);                                                   \
                    for (int g = 0; g < gn; g++)                                                   \
                        for (int j = 0; j < 8; j++)                                                \
                            a[g][j] += w[(size_t)(g0 + g) * (size_t)T + (size_t)t] * x[j];         \
                }                                                                                  \
                for (int g = 0; g < gn; g++)                                                       \
                    memcpy(acc + (size_t)(g0 + g) * stride + i, a[g], sizeof(a[g]));               \
            }                                                                                      \
        }                                                                                          \
    }

DOTG_SCALAR(dotg_f32_scalar, elem_f32)
DOTG_SCALAR(dotg_f16_scalar, elem_f16)
DOTG_SCALAR(dotg_bf16_scalar, elem_bf16)
AXPYT_SCALAR(axpyt_f32_scalar, elem_f32)
AXPYT_SCALAR(axpyt_f16_scalar, elem_f16)
AXPYT_SCALAR(axpyt_bf16_scalar, elem_bf16)

static const struct llmem_kv_kernels kernels_scalar = {
    .isa = LLMEM_KV_ISA_SCALAR,
    .name = "scalar",
    .dot = {[LLMEM_KV_FORMAT_F32] = dot_f32_scalar,
            [LLMEM_KV_FORMAT_F16] = dot_f16_scalar,
            [LLMEM_KV_FORMAT_BF16] = dot_bf16_scalar},
    .axpy = {[LLMEM_KV_FORMAT_F32] = axpy_f32_scalar,
             [LLMEM_KV_FORMAT_F16] = axpy_f16_scalar,
             [LLMEM_KV_FORMAT_BF16] = axpy_bf16_scalar},
    .dot_group = {[LLMEM_KV_FORMAT_F32] = dotg_f32_scalar,
                  [LLMEM_KV_FORMAT_F16] = dotg_f16_scalar,
                  [LLMEM_KV_FORMAT_BF16] = dotg_bf16_scalar},
    .axpy_tile = {[LLMEM_KV_FORMAT_F32] = axpyt_f32_scalar,
                  [LLMEM_KV_FORMAT_F16] = axpyt_f16_scalar,
                  [LLMEM_KV_FORMAT_BF16] = axpyt_bf16_scalar},
};

#if KV_X86
/* ---- the prefetches of the tile kernels (both instruction sets) ------------------------------ */

/* The prefetches of a tile kernel (struct llmem_kv_prefetch): `quota` lines a step of its loops,
 * enough for all of them in `steps` steps (unless there are fewer steps than pages) and a divisor
 * of a slice's lines, so that a step's lines lie in one slice. The kernels' loops are short of
 * registers and of branch slots, so the walk is kept to two tests a step (in cache it costs a
 * tile about 6 %; a test a line, twice that): p is the next line, stop the end of its slice,
 * skip the gap to the next page's slice (addresses as integers: the walk steps past the end of
 * the bytes before it stops). */
struct pf_spread {
    uintptr_t p, stop, end, skip;
    int quota;
};

static inline struct pf_spread pf_spread_init(struct llmem_kv_prefetch pf, int steps) {
    struct pf_spread s = {0, UINTPTR_MAX, 0, 0, 0}; /* nothing: p never reaches stop or end */
    if (pf.len > 0 && pf.off < pf.bytes && steps > 0) {
        const size_t slice = (pf.len + 63) / 64; /* lines */
        const size_t pages = (pf.bytes - pf.off + LLMEM_KV_PF_PAGE - 1) / LLMEM_KV_PF_PAGE;
        size_t quota = (pages * slice + (size_t)steps - 1) / (size_t)steps;
        if (quota > slice) /* fewer steps than pages (a short tile): some pages are left out */
            quota = slice;
        while (slice % quota != 0)
            quota++;
        const uintptr_t at = (uintptr_t)pf.at;
        s = (struct pf_spread){at + pf.off, at + pf.off + 64 * slice, at + pf.bytes,
                               LLMEM_KV_PF_PAGE - 64 * slice, (int)quota};
    }
    return s;
}

static inline void pf_step(struct pf_spread *s) {
    if (s->p == s->stop) { /* the next page's slice */
        s->p += s->skip;
        s->stop += LLMEM_KV_PF_PAGE;
    }
    if (s->p < s->end) { /* two lines unconditionally (one more than a quota of 1 asks) */
        __builtin_prefetch((const void *)s->p, 0, 3);
        __builtin_prefetch((const void *)(s->p + 64), 0, 3);
        for (int r = 2; r < s->quota; r++)
            __builtin_prefetch((const void *)(s->p + 64 * (uintptr_t)r), 0, 3);
        s->p += 64 * (uintptr_t)s->quota;
    }
}

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

static inline uint16_t get_u16(const uint8_t *p) {
    return (uint16_t)(p[0] | (p[1] << 8));
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

/* The tile kernels of both instruction sets are named attn_scores<P>_<format>_<isa> and
 * attn_values<P>_<format>_<isa>, P empty for four query heads, 2 for two and 1 for one; TILE_TABLE
 * lists one instruction set's kernels for one of those group sizes (struct llmem_kv_kernels). */
#define TILE_ENTRY(P, fmt, FMT, isa)                                                               \
    [LLMEM_KV_FORMAT_##FMT] = {attn_scores##P##_##fmt##_##isa, attn_values##P##_##fmt##_##isa}
#define TILE_TABLE(P, isa)                                                                         \
    {                                                                                              \
        TILE_ENTRY(P, f32, F32, isa), TILE_ENTRY(P, f16, F16, isa),                                \
            TILE_ENTRY(P, bf16, BF16, isa), TILE_ENTRY(P, q8, Q8, isa),                            \
            TILE_ENTRY(P, q4, Q4, isa), TILE_ENTRY(P, tq, TQ, isa)                                 \
    }

/* ---- AVX2: one tile of decode attention for a group of four, two or one query heads ---------- */

/* The AVX-512 tile kernels' arithmetic (see there) on 8 lanes. */

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

static const struct llmem_kv_kernels kernels_avx2 = {
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

static const struct llmem_kv_kernels kernels_avx512 = {
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

/* ---- selection ------------------------------------------------------------------------------- */

#define ISA_AVX2_SET   (LLMEM_ISA_AVX | LLMEM_ISA_AVX2 | LLMEM_ISA_FMA | LLMEM_ISA_F16C)
#define ISA_AVX512_SET (ISA_AVX2_SET | LLMEM_ISA_AVX512F | LLMEM_ISA_AVX512BW | LLMEM_ISA_AVX512VL)

enum llmem_kv_isa llmem_kv_isa_best(void) {
#if KV_X86
    uint32_t f = llmem_sys_isa_features();
    if ((f & ISA_AVX512_SET) == ISA_AVX512_SET)
        return LLMEM_KV_ISA_AVX512;
    if ((f & ISA_AVX2_SET) == ISA_AVX2_SET)
        return LLMEM_KV_ISA_AVX2;
#endif
    return LLMEM_KV_ISA_SCALAR;
}

static const struct llmem_kv_kernels *table_for(enum llmem_kv_isa isa) {
#if KV_X86
    if (isa == LLMEM_KV_ISA_AVX512)
        return &kernels_avx512;
    if (isa == LLMEM_KV_ISA_AVX2)
        return &kernels_avx2;
#endif
    (void)isa;
    return &kernels_scalar;
}

static _Atomic(const struct llmem_kv_kernels *) active;

const struct llmem_kv_kernels *llmem_kv_kernels(void) {
    const struct llmem_kv_kernels *k = atomic_load_explicit(&active, memory_order_acquire);
    if (k != NULL)
        return k;
    const struct llmem_kv_kernels *best = table_for(llmem_kv_isa_best());
    const struct llmem_kv_kernels *expected = NULL;
    /* a table pinned in between (llmem_kv_codec_set_isa) wins */
    if (!atomic_compare_exchange_strong_explicit(&active, &expected, best, memory_order_acq_rel,
                                                 memory_order_acquire))
        return expected;
    return best;
}

enum llmem_kv_isa llmem_kv_codec_set_isa(enum llmem_kv_isa isa) {
    enum llmem_kv_isa best = llmem_kv_isa_best();
    if ((int)isa > (int)best)
        isa = best;
    if ((int)isa < (int)LLMEM_KV_ISA_SCALAR)
        isa = LLMEM_KV_ISA_SCALAR;
    const struct llmem_kv_kernels *k = table_for(isa);
    atomic_store_explicit(&active, k, memory_order_release);
    return k->isa;
}

const char *llmem_kv_kernels_name(void) {
    return llmem_kv_kernels()->name;
}

void llmem_kv_codec_force_scalar(int on) {
    llmem_kv_codec_set_isa(on ? LLMEM_KV_ISA_SCALAR : llmem_kv_isa_best());
}
