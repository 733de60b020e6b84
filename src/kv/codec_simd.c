/*
 * kv/codec_simd.c — the row kernels of attention (dot with a key, accumulate a value) for every
 * KV layout, in portable C (here) and for x86-64 AVX2 (codec_avx2.c) and AVX-512
 * (codec_avx512.c), chosen at run time (here), and the tile kernels of decode attention (attn_tile
 * in kv/codec_internal.h) for AVX2 and AVX-512.
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
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kv/codec_internal.h"
#include "kv/codec_x86.h"
#include "llmem/kv.h"
#include "llmem/sys.h"

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
        return &llmem_kv_kernels_avx512;
    if (isa == LLMEM_KV_ISA_AVX2)
        return &llmem_kv_kernels_avx2;
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
