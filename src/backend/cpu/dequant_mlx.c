/*
 * backend/cpu/dequant_mlx.c — rows of MLX's affine groups dequantized with AVX-512 or AVX2, to
 * the bits of the reference (quant/dequant.c's llmem_quant_dequantize_mlx_row, as mx.dequantize):
 * a value is R(R(q · scale) + bias), each step rounded to the scales' type. The 4-bit codes take
 * 16 values a group, so a group's values are computed once, as a table of 16 floats, and each
 * code looks its value up (one permute for 16 or 8 codes); the 8-bit codes are computed lane by
 * lane. Rounding to bf16 is the reference's integer step; to f16 the conversion instructions
 * (round to nearest even, as the reference); a row with a NaN among its values is the reference's.
 * Built without contraction: the product and the sum round separately.
 */
#include <string.h>

#include "backend/cpu/cpu_int.h"
#include "backend/cpu/x86_int.h"
#include "llmem/status.h"
#include "quant/quant.h"

/* Scale or bias i of a row's, as the reference reads it (bf16 and f32 inline). */
static ALWAYS_INLINE float scale_at(const uint8_t *p, int st, int64_t i) {
    uint32_t u;
    if (st == LLMEM_QTYPE_F16) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        return llmem_quant_f16_to_f32(h);
    }
    if (st == LLMEM_QTYPE_BF16) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        u = (uint32_t)h << 16;
    } else {
        memcpy(&u, p + 4 * i, 4);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* How far ahead the codes are asked for: the rows of a task follow each other. */
#define MLX_PF_BYTES 2048

/* A row of `groups` groups into dst, each by GROUP (group_512 or group_256), the lanes that held a
 * NaN marked in nan: 0 when there is one, for the reference to compute the row. */
#define DEQUANT_ROW(GROUP)                                                                         \
    for (int64_t g = 0; g < groups; g++) {                                                         \
        _mm_prefetch((const char *)codes + g * group * bits / 8 + MLX_PF_BYTES, _MM_HINT_T0);      \
        GROUP(codes + g * group * bits / 8, bits, group, st, scale_at(scales, st, g),              \
              scale_at(biases, st, g), dst + g * group, &nan);                                     \
    }                                                                                              \
    return nan == 0

#if CPU_X86
#define TARGET_AVX2_F16C __attribute__((target("avx,avx2,fma,f16c")))

/* ---- AVX-512: 16 lanes ---------------------------------------------------------------------- */

/* v rounded to the scales' type st, as the reference rounds any value but a NaN: *nan marks the
 * lanes holding one, left to the reference (which NaN of two an operation returns is the
 * compiler's choice of operand order there). */
TARGET_AVX512 static ALWAYS_INLINE __m512 round_to_512(__m512 v, int st, __mmask16 *nan) {
    *nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (st == LLMEM_QTYPE_BF16) { /* to nearest even on the low 16 bits */
        const __m512i u = _mm512_castps_si512(v);
        const __m512i r = _mm512_add_epi32(
            u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
        return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
    }
    if (st == LLMEM_QTYPE_F16)
        return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return v;
}

/* A group's values into dst[0, group), the lanes that held a NaN marked in *nan. */
TARGET_AVX512 static ALWAYS_INLINE void group_512(const uint8_t *codes, int bits, int group, int st,
                                                  float s, float b, float *dst, __mmask16 *nan) {
    const __m512 sv = _mm512_set1_ps(s), bv = _mm512_set1_ps(b);
    if (bits == 4) {
        const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 lut =
            round_to_512(_mm512_add_ps(round_to_512(_mm512_mul_ps(q, sv), st, nan), bv), st, nan);
        const __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        for (int i = 0; i < group; i += 16) {
            const __m128i c = _mm_loadl_epi64((const __m128i *)(codes + i / 2));
            const __m512i k = _mm512_and_si512(
                _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(c, c)), shift),
                _mm512_set1_epi32(15));
            _mm512_storeu_ps(dst + i, _mm512_permutexvar_ps(k, lut));
        }
    } else {
        for (int i = 0; i < group; i += 16) {
            const __m512 q = _mm512_cvtepi32_ps(
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i))));
            _mm512_storeu_ps(
                dst + i,
                round_to_512(_mm512_add_ps(round_to_512(_mm512_mul_ps(q, sv), st, nan), bv), st,
                             nan));
        }
    }
}

TARGET_AVX512 static int row_512(const uint8_t *codes, const uint8_t *scales, const uint8_t *biases,
                                 int64_t groups, int bits, int group, int st, float *dst) {
    __mmask16 nan = 0;
    DEQUANT_ROW(group_512);
}

/* ---- AVX2: 8 lanes -------------------------------------------------------------------------- */

TARGET_AVX2_F16C static ALWAYS_INLINE __m256 round_to_256(__m256 v, int st, int *nan) {
    *nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    if (st == LLMEM_QTYPE_BF16) {
        const __m256i u = _mm256_castps_si256(v);
        const __m256i r = _mm256_add_epi32(
            u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
        return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
    }
    if (st == LLMEM_QTYPE_F16)
        return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return v;
}

TARGET_AVX2_F16C static ALWAYS_INLINE void group_256(const uint8_t *codes, int bits, int group,
                                                     int st, float s, float b, float *dst,
                                                     int *nan) {
    const __m256 sv = _mm256_set1_ps(s), bv = _mm256_set1_ps(b);
    if (bits == 4) { /* the table in two halves, a code's bit 3 choosing between them */
        const __m256 q = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 lo =
            round_to_256(_mm256_add_ps(round_to_256(_mm256_mul_ps(q, sv), st, nan), bv), st, nan);
        const __m256 hi = round_to_256(
            _mm256_add_ps(
                round_to_256(_mm256_mul_ps(_mm256_add_ps(q, _mm256_set1_ps(8)), sv), st, nan), bv),
            st, nan);
        const __m256i shift = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
        for (int i = 0; i < group; i += 8) {
            uint32_t w;
            memcpy(&w, codes + i / 2, 4);
            const __m128i c = _mm_cvtsi32_si128((int)w);
            const __m256i k = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(c, c)), shift),
                _mm256_set1_epi32(15));
            const __m256 high = _mm256_castsi256_ps(_mm256_slli_epi32(k, 28)); /* bit 3 → sign */
            _mm256_storeu_ps(dst + i, _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, k),
                                                       _mm256_permutevar8x32_ps(hi, k), high));
        }
    } else {
        for (int i = 0; i < group; i += 8) {
            const __m256 q = _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i))));
            _mm256_storeu_ps(
                dst + i,
                round_to_256(_mm256_add_ps(round_to_256(_mm256_mul_ps(q, sv), st, nan), bv), st,
                             nan));
        }
    }
}

TARGET_AVX2_F16C static int row_256(const uint8_t *codes, const uint8_t *scales,
                                    const uint8_t *biases, int64_t groups, int bits, int group,
                                    int st, float *dst) {
    int nan = 0;
    DEQUANT_ROW(group_256);
}
#endif

int llmem_cpu_dequantize_row(enum cpu_isa isa, const struct llmem_weight *w, int64_t r,
                             float *dst) {
    int bits, group, st;
#if CPU_X86
    if (isa >= CPU_ISA_AVX2 && llmem_qtype_mlx_params(w->quant, &bits, &group, &st)) {
        const int64_t groups = w->cols / group, ssize = st == LLMEM_QTYPE_F32 ? 4 : 2;
        const uint8_t *codes = (const uint8_t *)w->data + r * llmem_weight_row_bytes(w);
        const uint8_t *scales = (const uint8_t *)w->scales + r * groups * ssize;
        const uint8_t *biases = (const uint8_t *)w->biases + r * groups * ssize;
        if (isa == CPU_ISA_AVX512 ? row_512(codes, scales, biases, groups, bits, group, st, dst)
                                  : row_256(codes, scales, biases, groups, bits, group, st, dst))
            return LLMEM_OK;
        return llmem_weight_dequantize_row(w, r, dst); /* a NaN: the reference's */
    }
#endif
    (void)isa, (void)bits, (void)group, (void)st, (void)scale_at;
    return llmem_weight_dequantize_row(w, r, dst);
}
