/*
 * backend/cpu/x86_int.h — what the x86-64 kernels of matmul.c and matmul_amx.c share: the target
 * attributes of their instruction sets, the 16 × 16 transpose and the rounding of activations to
 * bf16 pairs.
 */
#ifndef LLMEM_BACKEND_CPU_X86_INT_H
#define LLMEM_BACKEND_CPU_X86_INT_H

#include <stdint.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CPU_X86 1
#include <immintrin.h>
#else
#define CPU_X86 0
#endif

#define ALWAYS_INLINE inline __attribute__((always_inline))

#if CPU_X86
#define TARGET_AVX512 __attribute__((target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl")))
#define TARGET_BF16                                                                                \
    __attribute__((target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")))
#define TARGET_AMX                                                                                 \
    __attribute__((                                                                                \
        target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

/* 16 × 16 transpose: out[c][r] = in[r][c]. */
TARGET_AVX512 static ALWAYS_INLINE void transpose16_avx512(__m512 r[16]) {
    __m512 a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        b[4 * i + 0] = _mm512_shuffle_ps(a[4 * i], a[4 * i + 2], 0x44);
        b[4 * i + 1] = _mm512_shuffle_ps(a[4 * i], a[4 * i + 2], 0xEE);
        b[4 * i + 2] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0x44);
        b[4 * i + 3] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0xEE);
    }
    /* b[4i + c], 128-bit lane q: rows 4i … 4i+3 of column 4q + c */
    for (int c = 0; c < 4; c++) {
        __m512 e0 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0x88);
        __m512 e1 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0xDD);
        __m512 e2 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0x88);
        __m512 e3 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0xDD);
        r[c] = _mm512_shuffle_f32x4(e0, e2, 0x88);
        r[8 + c] = _mm512_shuffle_f32x4(e0, e2, 0xDD);
        r[4 + c] = _mm512_shuffle_f32x4(e1, e3, 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(e1, e3, 0xDD);
    }
}

/* 32 activations from k, the first 16 in lo; lanes at or past `left` read as zero. */
TARGET_AVX512 static ALWAYS_INLINE void x32_load(const float *x, int64_t left, __m512 *lo,
                                                 __m512 *hi) {
    if (left >= 32) {
        *lo = _mm512_loadu_ps(x);
        *hi = _mm512_loadu_ps(x + 16);
    } else {
        __mmask16 m0 = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        __mmask16 m1 = left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : (__mmask16)0;
        *lo = _mm512_maskz_loadu_ps(m0, x);
        *hi = _mm512_maskz_loadu_ps(m1, x + 16);
    }
}

/* 32 activations from k as bf16 pairs; lanes at or past `left` read as zero. */
TARGET_BF16 static ALWAYS_INLINE __m512bh x32_bf16(const float *x, int64_t left) {
    __m512 lo, hi;
    x32_load(x, left, &lo, &hi);
    return _mm512_cvtne2ps_pbh(hi, lo);
}
#endif /* CPU_X86 */

#endif
