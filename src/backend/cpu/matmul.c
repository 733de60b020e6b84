/*
 * backend/cpu/matmul.c — y[n, rows] = x[n, cols] · Wᵀ (+ bias) for bf16, f16 and f32 weights,
 * f32 activations, f32 accumulation; portable C, AVX2+FMA+F16C and AVX-512, chosen at run time.
 *
 * Every path computes each output in one canonical order (see "the canonical order" below), so a
 * row of x gives the same bits alone or in any batch, on any path, thread count or ISA.
 *
 * Decode (n small): memory-bound. Each task owns a contiguous range of W rows and streams them
 * once, converting weights to f32 in registers (bf16 by zero-extension and a 16-bit shift, f16 by
 * VCVTPH2PS), one 16-lane accumulator per (row, token). For one row of x, four rows are read at a
 * time from four quarters of the range (four long sequential streams, prefetched 8 KiB ahead);
 * for more, four W rows at a time are multiplied with two rows of x at a time.
 *
 * GEMM (n large): each task owns a range of W rows; a token block of x is packed once per block,
 * by all threads, as [k/16][6 tokens][16]; each panel of 4 W rows is converted to f32 as
 * [k/16][4][16] and multiplied with every packed strip: 4 × 6 tiles, 10 vector loads and 24 FMAs
 * per 16 columns, one accumulator per output, reduced by the canonical tree. Rows longer than
 * CPU_GEMM_K_MAX take the decode kernels.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include <cblas.h>

#include "backend/cpu/cpu_int.h"
#include "core/log.h"
#include "core/pool.h"
#include "llmem/sys.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CPU_X86 1
#include <immintrin.h>
#else
#define CPU_X86 0
#endif

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* ---- the ISA ----------------------------------------------------------------------------------
 */

enum cpu_isa cpu_isa_best(void) {
#if CPU_X86
    uint32_t f = llmem_sys_isa_features();
    uint32_t avx512 = LLMEM_ISA_AVX512F | LLMEM_ISA_AVX512BW | LLMEM_ISA_AVX512VL | LLMEM_ISA_AVX2 |
                      LLMEM_ISA_FMA | LLMEM_ISA_F16C;
    uint32_t avx2 = LLMEM_ISA_AVX | LLMEM_ISA_AVX2 | LLMEM_ISA_FMA | LLMEM_ISA_F16C;
    if ((f & avx512) == avx512)
        return CPU_ISA_AVX512;
    if ((f & avx2) == avx2)
        return CPU_ISA_AVX2;
#endif
    return CPU_ISA_SCALAR;
}

const char *cpu_isa_name(enum cpu_isa isa) {
    switch (isa) {
    case CPU_ISA_AVX512: return "avx512";
    case CPU_ISA_AVX2: return "avx2";
    default: return "scalar";
    }
}

/* ---- the canonical order ----------------------------------------------------------------------
 *
 * Every path, every ISA, computes y[t, r] as: 16 f32 lanes, zero at first; for k0 = 0, 16, … below
 * cols rounded up to 16, lane l ← fma(w[k0 + l], x[k0 + l], lane l), both zero where k0 + l ≥ cols;
 * then the tree h8[i] = l[i] + l[i+8], h4[i] = h8[i] + h8[i+4], h2[i] = h4[i] + h4[i+2],
 * s = h2[0] + h2[1]; then y = s + bias[r] (y = s without bias). Weights convert to f32 exactly, so
 * y depends on x[t, :], W[r, :] and bias[r] alone: not on n, the path, the threads or the ISA. */

static ALWAYS_INLINE float weight_at(const void *row, enum llmem_dtype dt, int64_t k) {
    switch (dt) {
    case LLMEM_DTYPE_BF16: return cpu_bf16_to_f32(((const uint16_t *)row)[k]);
    case LLMEM_DTYPE_F16: return cpu_f16_to_f32(((const uint16_t *)row)[k]);
    default: return ((const float *)row)[k];
    }
}

static ALWAYS_INLINE const void *row_at(const void *w, enum llmem_dtype dt, int64_t ld, int64_t i) {
    return (const uint8_t *)w + (size_t)i * (size_t)ld * (dt == LLMEM_DTYPE_F32 ? 4u : 2u);
}

static ALWAYS_INLINE float finish(float s, const float *bias, int64_t i) {
    return bias != NULL ? s + bias[i] : s;
}

/* ---- portable kernels -------------------------------------------------------------------------
 */

static float reduce16_scalar(const float *l) {
    float h8[8], h4[4], h2[2];
    for (int i = 0; i < 8; i++)
        h8[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++)
        h4[i] = h8[i] + h8[i + 4];
    for (int i = 0; i < 2; i++)
        h2[i] = h4[i] + h4[i + 2];
    return h2[0] + h2[1];
}

/* Converts `count` weights of a row to f32. */
static void convert_scalar(const void *row, enum llmem_dtype dt, int64_t count, float *dst) {
    if (dt == LLMEM_DTYPE_F32) {
        memcpy(dst, row, (size_t)count * sizeof(float));
        return;
    }
    for (int64_t k = 0; k < count; k++)
        dst[k] = weight_at(row, dt, k);
}

/* The matmul contract on a range of weight rows: w is its first row (rows ld elements apart),
 * y[t·ldy + i] for t < n, i < nrows; bias is the range's first entry (or NULL). */
static void gemv_scalar(const void *w, enum llmem_dtype dt, int64_t ld, int64_t nrows,
                        const float *x, int64_t cols, int64_t n, float *y, int64_t ldy,
                        const float *bias) {
    for (int64_t i = 0; i < nrows; i++) {
        const void *wr = row_at(w, dt, ld, i);
        for (int64_t t = 0; t < n; t++) {
            const float *xr = x + t * cols;
            float acc[16] = {0};
            for (int64_t k0 = 0; k0 < cols; k0 += 16)
                for (int l = 0; l < 16; l++) {
                    int64_t k = k0 + l;
                    float wv = k < cols ? weight_at(wr, dt, k) : 0.0f;
                    float xv = k < cols ? xr[k] : 0.0f;
                    acc[l] = fmaf(wv, xv, acc[l]);
                }
            y[t * ldy + i] = finish(reduce16_scalar(acc), bias, i);
        }
    }
}

/* ---- AVX2 + FMA + F16C: the 16 lanes as two 8-lane halves --------------------------------------
 */

#if CPU_X86
#define TARGET_AVX2 __attribute__((target("avx,avx2,fma,f16c")))

TARGET_AVX2 static ALWAYS_INLINE __m256 load8_avx2(const void *row, enum llmem_dtype dt,
                                                   int64_t k) {
    if (dt == LLMEM_DTYPE_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dt == LLMEM_DTYPE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k)));
    return _mm256_loadu_ps((const float *)row + k);
}

/* The canonical tree over lanes 0–7 (lo) and 8–15 (hi). */
TARGET_AVX2 static ALWAYS_INLINE float reduce16_avx2(__m256 lo, __m256 hi) {
    __m256 h8 = _mm256_add_ps(lo, hi);
    __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

/* R weight rows × NX rows of x (R · NX ≤ 6: 12 accumulators of 16 registers). */
TARGET_AVX2 static ALWAYS_INLINE void
gemv_tile_avx2(const void *w, enum llmem_dtype dt, int64_t ld, int64_t i0, const float *x,
               int64_t cols, int64_t t0, float *y, int64_t ldy, const float *bias, const int R,
               const int NX) {
    const void *wr[3];
    for (int i = 0; i < R; i++)
        wr[i] = row_at(w, dt, ld, i0 + i);
    const float *xr[3];
    for (int j = 0; j < NX; j++)
        xr[j] = x + (t0 + j) * cols;
    __m256 lo[3][3], hi[3][3];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NX; j++)
            lo[i][j] = hi[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= cols; k += 16) {
        for (int i = 0; i < R; i++) {
            __m256 w0 = load8_avx2(wr[i], dt, k), w1 = load8_avx2(wr[i], dt, k + 8);
            for (int j = 0; j < NX; j++) {
                lo[i][j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr[j] + k), lo[i][j]);
                hi[i][j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr[j] + k + 8), hi[i][j]);
            }
        }
    }
    if (k < cols) { /* the tail, zero-padded to 16 */
        float wt[3][16] = {{0}}, xt[3][16] = {{0}};
        for (int i = 0; i < R; i++)
            for (int64_t kk = k; kk < cols; kk++)
                wt[i][kk - k] = weight_at(wr[i], dt, kk);
        for (int j = 0; j < NX; j++)
            memcpy(xt[j], xr[j] + k, (size_t)(cols - k) * sizeof(float));
        for (int i = 0; i < R; i++)
            for (int j = 0; j < NX; j++) {
                lo[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(wt[i]), _mm256_loadu_ps(xt[j]), lo[i][j]);
                hi[i][j] =
                    _mm256_fmadd_ps(_mm256_loadu_ps(wt[i] + 8), _mm256_loadu_ps(xt[j] + 8), hi[i][j]);
            }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NX; j++)
            y[(t0 + j) * ldy + i0 + i] = finish(reduce16_avx2(lo[i][j], hi[i][j]), bias, i0 + i);
}

TARGET_AVX2 static ALWAYS_INLINE void gemv_avx2_dt(const void *w, enum llmem_dtype dt, int64_t ld,
                                                   int64_t nrows, const float *x, int64_t cols,
                                                   int64_t n, float *y, int64_t ldy,
                                                   const float *bias) {
    int64_t i = 0;
    for (; i + 2 <= nrows; i += 2)
        for (int64_t t = 0; t < n; t += 3) {
            switch (n - t < 3 ? n - t : 3) {
            case 1: gemv_tile_avx2(w, dt, ld, i, x, cols, t, y, ldy, bias, 2, 1); break;
            case 2: gemv_tile_avx2(w, dt, ld, i, x, cols, t, y, ldy, bias, 2, 2); break;
            default: gemv_tile_avx2(w, dt, ld, i, x, cols, t, y, ldy, bias, 2, 3);
            }
        }
    for (; i < nrows; i++)
        for (int64_t t = 0; t < n; t += 3) {
            switch (n - t < 3 ? n - t : 3) {
            case 1: gemv_tile_avx2(w, dt, ld, i, x, cols, t, y, ldy, bias, 1, 1); break;
            case 2: gemv_tile_avx2(w, dt, ld, i, x, cols, t, y, ldy, bias, 1, 2); break;
            default: gemv_tile_avx2(w, dt, ld, i, x, cols, t, y, ldy, bias, 1, 3);
            }
        }
}

TARGET_AVX2 static void gemv_avx2(const void *w, enum llmem_dtype dt, int64_t ld, int64_t nrows,
                                  const float *x, int64_t cols, int64_t n, float *y, int64_t ldy,
                                  const float *bias) {
    switch (dt) {
    case LLMEM_DTYPE_BF16: gemv_avx2_dt(w, LLMEM_DTYPE_BF16, ld, nrows, x, cols, n, y, ldy, bias); break;
    case LLMEM_DTYPE_F16: gemv_avx2_dt(w, LLMEM_DTYPE_F16, ld, nrows, x, cols, n, y, ldy, bias); break;
    default: gemv_avx2_dt(w, LLMEM_DTYPE_F32, ld, nrows, x, cols, n, y, ldy, bias);
    }
}

TARGET_AVX2 static void convert_avx2(const void *row, enum llmem_dtype dt, int64_t count,
                                     float *dst) {
    int64_t k = 0;
    if (dt == LLMEM_DTYPE_BF16)
        for (; k + 8 <= count; k += 8)
            _mm256_storeu_ps(dst + k, load8_avx2(row, LLMEM_DTYPE_BF16, k));
    else if (dt == LLMEM_DTYPE_F16)
        for (; k + 8 <= count; k += 8)
            _mm256_storeu_ps(dst + k, load8_avx2(row, LLMEM_DTYPE_F16, k));
    else
        for (; k + 8 <= count; k += 8)
            _mm256_storeu_ps(dst + k, load8_avx2(row, LLMEM_DTYPE_F32, k));
    for (; k < count; k++)
        dst[k] = weight_at(row, dt, k);
}

/* ---- AVX-512 ----------------------------------------------------------------------------------
 */

#define TARGET_AVX512 __attribute__((target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl")))

/* 16 weights from k as f32; lanes outside the mask read as zero. */
TARGET_AVX512 static ALWAYS_INLINE __m512 load16_avx512(const void *row, enum llmem_dtype dt,
                                                        int64_t k, __mmask16 m) {
    if (dt == LLMEM_DTYPE_BF16) {
        __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)row + k);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dt == LLMEM_DTYPE_F16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)row + k));
    return _mm512_maskz_loadu_ps(m, (const float *)row + k);
}

/* The canonical tree (not _mm512_reduce_add_ps, whose order is the compiler's). */
TARGET_AVX512 static ALWAYS_INLINE float reduce16_avx512(__m512 v) {
    __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

/* R weight rows × NX rows of x, one accumulator each; PF: prefetch the weights PF bytes ahead
 * of every row (0: none). */
TARGET_AVX512 static ALWAYS_INLINE void
gemv_tile_avx512_s(const void *w, enum llmem_dtype dt, int64_t ld, int64_t i0, int64_t step,
                   const float *x, int64_t cols, int64_t t0, float *y, int64_t ldy,
                   const float *bias, const int R, const int NX, const size_t PF) {
    const size_t esize = dt == LLMEM_DTYPE_F32 ? 4 : 2;
    const void *wr[8];
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)
        wr[i] = row_at(w, dt, ld, i0 + i * step);
    const float *xr[8];
    _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++)
        xr[j] = x + (t0 + j) * cols;
    __m512 acc[8][8];
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++)
            acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= cols; k += 16) {
        __m512 xv[8];
        _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++)
            xv[j] = _mm512_loadu_ps(xr[j] + k);
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
            if (PF != 0 && ((k * esize) & 63) == 0)
                _mm_prefetch((const char *)wr[i] + (size_t)k * esize + PF, _MM_HINT_T0);
            __m512 wv = load16_avx512(wr[i], dt, k, 0xffff);
            _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++)
                acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    if (k < cols) {
        __mmask16 m = (__mmask16)((1u << (cols - k)) - 1);
        __m512 xv[8];
        _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++)
            xv[j] = _mm512_maskz_loadu_ps(m, xr[j] + k);
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
            __m512 wv = load16_avx512(wr[i], dt, k, m);
            _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++)
                acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++)
            y[(t0 + j) * ldy + i0 + i * step] =
                finish(reduce16_avx512(acc[i][j]), bias, i0 + i * step);
}

/* R consecutive weight rows × NX rows of x. */
#define gemv_tile_avx512(w, dt, ld, i0, x, cols, t0, y, ldy, bias, R, NX, PF)                       \
    gemv_tile_avx512_s(w, dt, ld, i0, 1, x, cols, t0, y, ldy, bias, R, NX, PF)

/* Single-sequence decode streams the task's rows DECODE_PF_BYTES ahead of the reads: rows of a
 * few KiB are too short for the hardware prefetchers, which stop at page boundaries. */
#define DECODE_PF_BYTES 8192
#define DECODE_R1       4 /* weight rows at a time for one row of x: independent FMA chains */

TARGET_AVX512 static ALWAYS_INLINE void gemv_avx512_dt(const void *w, enum llmem_dtype dt,
                                                       int64_t ld, int64_t nrows, const float *x,
                                                       int64_t cols, int64_t n, float *y,
                                                       int64_t ldy, const float *bias) {
    int64_t i = 0;
    if (n == 1) {
        /* DECODE_R1 long sequential streams: the range in DECODE_R1 parts, one row of each at a
         * time (consecutive rows, read together, would be DECODE_R1 short streams). */
        int64_t part = nrows / DECODE_R1;
        for (; i < part; i++)
            gemv_tile_avx512_s(w, dt, ld, i, part, x, cols, 0, y, ldy, bias, DECODE_R1, 1,
                               DECODE_PF_BYTES);
        for (i = part * DECODE_R1; i < nrows; i++)
            gemv_tile_avx512(w, dt, ld, i, x, cols, 0, y, ldy, bias, 1, 1, DECODE_PF_BYTES);
        return;
    }
    /* Two rows of x at a time: with four (16 accumulators) GCC keeps the accumulator array in
     * memory. */
    for (; i + 4 <= nrows; i += 4)
        for (int64_t t = 0; t < n; t += 2) {
            if (n - t == 1)
                gemv_tile_avx512(w, dt, ld, i, x, cols, t, y, ldy, bias, 4, 1, 0);
            else
                gemv_tile_avx512(w, dt, ld, i, x, cols, t, y, ldy, bias, 4, 2, 0);
        }
    for (; i < nrows; i++)
        for (int64_t t = 0; t < n; t += 4) {
            switch (n - t < 4 ? n - t : 4) {
            case 1: gemv_tile_avx512(w, dt, ld, i, x, cols, t, y, ldy, bias, 1, 1, 0); break;
            case 2: gemv_tile_avx512(w, dt, ld, i, x, cols, t, y, ldy, bias, 1, 2, 0); break;
            case 3: gemv_tile_avx512(w, dt, ld, i, x, cols, t, y, ldy, bias, 1, 3, 0); break;
            default: gemv_tile_avx512(w, dt, ld, i, x, cols, t, y, ldy, bias, 1, 4, 0);
            }
        }
}

TARGET_AVX512 static void gemv_avx512(const void *w, enum llmem_dtype dt, int64_t ld,
                                      int64_t nrows, const float *x, int64_t cols, int64_t n,
                                      float *y, int64_t ldy, const float *bias) {
    switch (dt) {
    case LLMEM_DTYPE_BF16:
        gemv_avx512_dt(w, LLMEM_DTYPE_BF16, ld, nrows, x, cols, n, y, ldy, bias);
        break;
    case LLMEM_DTYPE_F16:
        gemv_avx512_dt(w, LLMEM_DTYPE_F16, ld, nrows, x, cols, n, y, ldy, bias);
        break;
    default: gemv_avx512_dt(w, LLMEM_DTYPE_F32, ld, nrows, x, cols, n, y, ldy, bias);
    }
}

TARGET_AVX512 static void convert_avx512(const void *row, enum llmem_dtype dt, int64_t count,
                                         float *dst) {
    int64_t k = 0;
    if (dt == LLMEM_DTYPE_BF16)
        for (; k + 16 <= count; k += 16)
            _mm512_storeu_ps(dst + k, load16_avx512(row, LLMEM_DTYPE_BF16, k, 0xffff));
    else if (dt == LLMEM_DTYPE_F16)
        for (; k + 16 <= count; k += 16)
            _mm512_storeu_ps(dst + k, load16_avx512(row, LLMEM_DTYPE_F16, k, 0xffff));
    else
        for (; k + 16 <= count; k += 16)
            _mm512_storeu_ps(dst + k, load16_avx512(row, LLMEM_DTYPE_F32, k, 0xffff));
    for (; k < count; k++)
        dst[k] = weight_at(row, dt, k);
}

/* The GEMM's tiles: CPU_GEMM_MR converted rows (f32, ld apart) × CPU_GEMM_NR rows of x. */
TARGET_AVX512 static void panel_avx512(const float *a, int64_t ld, int64_t mr, const float *x,
                                       int64_t cols, int64_t n, float *y, int64_t ldy,
                                       const float *bias) {
    int64_t t = 0;
    if (mr == CPU_GEMM_MR) {
        for (; t + CPU_GEMM_NR <= n; t += CPU_GEMM_NR)
            gemv_tile_avx512(a, LLMEM_DTYPE_F32, ld, 0, x, cols, t, y, ldy, bias, CPU_GEMM_MR,
                             CPU_GEMM_NR, 0);
        switch (n - t) {
        case 0: break;
        case 1: gemv_tile_avx512(a, LLMEM_DTYPE_F32, ld, 0, x, cols, t, y, ldy, bias, CPU_GEMM_MR, 1, 0); break;
        case 2: gemv_tile_avx512(a, LLMEM_DTYPE_F32, ld, 0, x, cols, t, y, ldy, bias, CPU_GEMM_MR, 2, 0); break;
        case 3: gemv_tile_avx512(a, LLMEM_DTYPE_F32, ld, 0, x, cols, t, y, ldy, bias, CPU_GEMM_MR, 3, 0); break;
        case 4: gemv_tile_avx512(a, LLMEM_DTYPE_F32, ld, 0, x, cols, t, y, ldy, bias, CPU_GEMM_MR, 4, 0); break;
        default:
            gemv_avx512_dt(a, LLMEM_DTYPE_F32, ld, mr, x + t * cols, cols, n - t, y + t * ldy, ldy,
                           bias);
        }
        return;
    }
    gemv_avx512_dt(a, LLMEM_DTYPE_F32, ld, mr, x, cols, n, y, ldy, bias);
}

/* Packed operands of the AVX-512 GEMM: a = CPU_GEMM_MR weight rows as [k/16][MR][16], b =
 * CPU_GEMM_NR rows of x as [k/16][NR][16], both zero-padded, nk = k blocks of 16. One sequential
 * stream each; the canonical sums of the mr × nt valid outputs go to y. */
TARGET_AVX512 static void micro_avx512(const float *a, const float *b, int64_t nk, int mr, int nt,
                                       float *y, int64_t ldy, const float *bias) {
    __m512 acc[CPU_GEMM_MR][CPU_GEMM_NR];
    _Pragma("GCC unroll 8") for (int i = 0; i < CPU_GEMM_MR; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < CPU_GEMM_NR; j++)
            acc[i][j] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nk; s++) {
        const float *as = a + s * (CPU_GEMM_MR * 16), *bs = b + s * (CPU_GEMM_NR * 16);
        __m512 xv[CPU_GEMM_NR];
        _Pragma("GCC unroll 8") for (int j = 0; j < CPU_GEMM_NR; j++)
            xv[j] = _mm512_load_ps(bs + j * 16);
        _Pragma("GCC unroll 8") for (int i = 0; i < CPU_GEMM_MR; i++) {
            __m512 wv = _mm512_load_ps(as + i * 16);
            _Pragma("GCC unroll 8") for (int j = 0; j < CPU_GEMM_NR; j++)
                acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < CPU_GEMM_MR; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < CPU_GEMM_NR; j++)
            if (i < mr && j < nt)
                y[j * ldy + i] = finish(reduce16_avx512(acc[i][j]), bias, i);
}

/* Converts mr ≤ CPU_GEMM_MR weight rows into the packed [k/16][MR][16] layout. */
TARGET_AVX512 static void pack_w_avx512(const void *w, enum llmem_dtype dt, int64_t ld, int mr,
                                        int64_t cols, float *a) {
    const int64_t nk = (cols + 15) / 16;
    const size_t esize = dt == LLMEM_DTYPE_F32 ? 4 : 2;
    for (int i = 0; i < CPU_GEMM_MR; i++) {
        const void *wr = row_at(w, dt, ld, i);
        /* the same row of the next panel, read after this panel's tiles: into L2 meanwhile */
        const char *next = (const char *)row_at(w, dt, ld, i + CPU_GEMM_MR);
        for (int64_t s = 0; s < nk; s++) {
            if (((s * 16 * esize) & 63) == 0)
                _mm_prefetch(next + s * 16 * esize, _MM_HINT_T1);
            __m512 v = _mm512_setzero_ps();
            if (i < mr) {
                int64_t left = cols - s * 16;
                __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
                v = dt == LLMEM_DTYPE_BF16  ? load16_avx512(wr, LLMEM_DTYPE_BF16, s * 16, m)
                    : dt == LLMEM_DTYPE_F16 ? load16_avx512(wr, LLMEM_DTYPE_F16, s * 16, m)
                                            : load16_avx512(wr, LLMEM_DTYPE_F32, s * 16, m);
            }
            _mm512_store_ps(a + (s * CPU_GEMM_MR + i) * 16, v);
        }
    }
}
#endif /* CPU_X86 */

static void panel_generic_scalar(const float *a, int64_t ld, int64_t mr, const float *x,
                                 int64_t cols, int64_t n, float *y, int64_t ldy,
                                 const float *bias) {
    gemv_scalar(a, LLMEM_DTYPE_F32, ld, mr, x, cols, n, y, ldy, bias);
}

#if CPU_X86
TARGET_AVX2 static void panel_avx2(const float *a, int64_t ld, int64_t mr, const float *x,
                                   int64_t cols, int64_t n, float *y, int64_t ldy,
                                   const float *bias) {
    gemv_avx2_dt(a, LLMEM_DTYPE_F32, ld, mr, x, cols, n, y, ldy, bias);
}
#endif

/* ---- the kernel tables ------------------------------------------------------------------------
 */

struct matmul_kernels {
    void (*gemv)(const void *w, enum llmem_dtype dt, int64_t ld, int64_t nrows, const float *x,
                 int64_t cols, int64_t n, float *y, int64_t ldy, const float *bias);
    void (*convert)(const void *row, enum llmem_dtype dt, int64_t count, float *dst);
    void (*panel)(const float *a, int64_t ld, int64_t mr, const float *x, int64_t cols, int64_t n,
                  float *y, int64_t ldy, const float *bias);
};

static const struct matmul_kernels kernels[3] = {
    [CPU_ISA_SCALAR] = {gemv_scalar, convert_scalar, panel_generic_scalar},
#if CPU_X86
    [CPU_ISA_AVX2] = {gemv_avx2, convert_avx2, panel_avx2},
    [CPU_ISA_AVX512] = {gemv_avx512, convert_avx512, panel_avx512},
#else
    [CPU_ISA_AVX2] = {gemv_scalar, convert_scalar, panel_generic_scalar},
    [CPU_ISA_AVX512] = {gemv_scalar, convert_scalar, panel_generic_scalar},
#endif
};

static const void *row_ptr(const struct llmem_weight *w, int64_t r) {
    return (const uint8_t *)w->data +
           (size_t)r * (size_t)w->cols * (size_t)llmem_dtype_size(w->dtype);
}

/* ---- decode -----------------------------------------------------------------------------------
 */

struct gemv_job {
    const struct matmul_kernels *k;
    const struct llmem_weight *w;
    const float *x, *bias;
    float *y;
    int64_t n, rows_per_task; /* a multiple of 4 */
};

static void gemv_task(void *arg, int task, int thread) {
    (void)thread;
    const struct gemv_job *j = arg;
    int64_t r0 = (int64_t)task * j->rows_per_task;
    int64_t r1 = r0 + j->rows_per_task < j->w->rows ? r0 + j->rows_per_task : j->w->rows;
    if (r0 < r1)
        j->k->gemv(row_ptr(j->w, r0), j->w->dtype, j->w->cols, r1 - r0, j->x, j->w->cols, j->n,
                   j->y + r0, j->w->rows, j->bias != NULL ? j->bias + r0 : NULL);
}

static void matmul_decode(struct cpu_ctx *c, const struct matmul_kernels *k,
                          const struct llmem_weight *w, const float *x, int64_t n, float *y,
                          const float *bias) {
    /* Below ~64 K multiply-adds a dispatch costs more than it saves. */
    int tasks = w->rows * w->cols * n < (int64_t)1 << 16 ? 1 : c->n_threads;
    /* Several tasks per thread balance a machine shared with other work, but each task's first
     * rows come without prefetch: tasks of at least 1 MiB, up to 16 per thread, contiguous. */
    if (tasks > 1) {
        int64_t by_size = w->rows * w->cols * llmem_dtype_size(w->dtype) >> 20;
        int64_t most = (int64_t)tasks * 16;
        tasks = (int)(by_size < tasks ? tasks : by_size > most ? most : by_size);
    }

    int64_t per = (w->rows + tasks - 1) / tasks;
    per = (per + 3) & ~(int64_t)3;
    tasks = (int)((w->rows + per - 1) / per);
    struct gemv_job job = {k, w, x, bias, y, n, per};
    llmem_pool_run(c->pool, tasks, gemv_task, &job);
}

/* ---- GEMM -------------------------------------------------------------------------------------
 *
 * Tiles of CPU_GEMM_MR weight rows × CPU_GEMM_NR rows of x in the canonical dot-product form
 * (vectorized over k, one 16-lane accumulator per output): each task owns a range of W rows and
 * converts CPU_GEMM_MR of them at a time, the whole row, to f32 in per-thread scratch; the
 * converted rows are reused by every tile of a token block, whose rows of x stay in L2. */

struct gemm_job {
    struct cpu_ctx *c;
    const struct matmul_kernels *k;
    const struct llmem_weight *w;
    const float *x, *bias;
    float *y;
    int64_t n, nb;         /* tokens, and tokens per block */
    int64_t t0, nt;        /* the packed block (AVX-512): its first token and its tokens */
    int64_t rows_per_task; /* a multiple of CPU_GEMM_MR */
};

static void gemm_task(void *arg, int task, int thread) {
    const struct gemm_job *j = arg;
    const struct llmem_weight *w = j->w;
    const int64_t rows = w->rows, cols = w->cols;
    const int64_t ld = (cols + 15) & ~(int64_t)15;
    float *a = j->c->wpanel + (size_t)thread * CPU_GEMM_MR * CPU_GEMM_K_MAX;
    int64_t r_begin = (int64_t)task * j->rows_per_task;
    int64_t r_end = r_begin + j->rows_per_task < rows ? r_begin + j->rows_per_task : rows;
    for (int64_t t0 = 0; t0 < j->n; t0 += j->nb) {
        int64_t nt = j->n - t0 < j->nb ? j->n - t0 : j->nb;
        for (int64_t r0 = r_begin; r0 < r_end; r0 += CPU_GEMM_MR) {
            int64_t mr = r_end - r0 < CPU_GEMM_MR ? r_end - r0 : CPU_GEMM_MR;
            for (int64_t i = 0; i < mr; i++)
                j->k->convert(row_ptr(w, r0 + i), w->dtype, cols, a + i * ld);
            j->k->panel(a, ld, mr, j->x + t0 * cols, cols, nt, j->y + t0 * rows + r0, rows,
                        j->bias != NULL ? j->bias + r0 : NULL);
        }
    }
}

#if CPU_X86
/* Packs strip `task` of the block: CPU_GEMM_NR rows of x as [k/16][NR][16], zero-padded. */
static void pack_x_task(void *arg, int task, int thread) {
    (void)thread;
    const struct gemm_job *j = arg;
    const int64_t cols = j->w->cols, nk = (cols + 15) / 16;
    float *dst = j->c->xt + (size_t)task * (size_t)nk * CPU_GEMM_NR * 16;
    for (int jj = 0; jj < CPU_GEMM_NR; jj++) {
        int64_t t = (int64_t)task * CPU_GEMM_NR + jj;
        const float *src = j->x + (j->t0 + t) * cols;
        for (int64_t s = 0; s < nk; s++) {
            float *d = dst + (s * CPU_GEMM_NR + jj) * 16;
            int64_t left = t < j->nt ? cols - s * 16 : 0;
            if (left >= 16)
                memcpy(d, src + s * 16, 16 * sizeof(float));
            else {
                memset(d, 0, 16 * sizeof(float));
                if (left > 0)
                    memcpy(d, src + s * 16, (size_t)left * sizeof(float));
            }
        }
    }
}

static void gemm_packed_task(void *arg, int task, int thread) {
    const struct gemm_job *j = arg;
    const struct llmem_weight *w = j->w;
    const int64_t rows = w->rows, cols = w->cols, nk = (cols + 15) / 16;
    float *a = j->c->wpanel + (size_t)thread * CPU_GEMM_MR * CPU_GEMM_K_MAX;
    int64_t r_begin = (int64_t)task * j->rows_per_task;
    int64_t r_end = r_begin + j->rows_per_task < rows ? r_begin + j->rows_per_task : rows;
    for (int64_t r0 = r_begin; r0 < r_end; r0 += CPU_GEMM_MR) {
        int mr = r_end - r0 < CPU_GEMM_MR ? (int)(r_end - r0) : CPU_GEMM_MR;
        pack_w_avx512(row_ptr(w, r0), w->dtype, cols, mr, cols, a);
        for (int64_t t = 0; t < j->nt; t += CPU_GEMM_NR) {
            int nt = j->nt - t < CPU_GEMM_NR ? (int)(j->nt - t) : CPU_GEMM_NR;
            micro_avx512(a, j->c->xt + (size_t)(t / CPU_GEMM_NR) * (size_t)nk * CPU_GEMM_NR * 16,
                         nk, mr, nt, j->y + (j->t0 + t) * rows + r0, rows,
                         j->bias != NULL ? j->bias + r0 : NULL);
        }
    }
}
#endif

static void matmul_gemm(struct cpu_ctx *c, const struct matmul_kernels *k,
                        const struct llmem_weight *w, const float *x, int64_t n, float *y,
                        const float *bias) {
    const int64_t cols = w->cols, rows = w->rows;
    if (cols > CPU_GEMM_K_MAX) { /* rows longer than the scratch: the decode kernels, same sums */
        matmul_decode(c, k, w, x, n, y, bias);
        return;
    }
    /* Tasks: a few contiguous ranges of W rows per thread, each a multiple of the tile height. */
    int tasks = c->n_threads * 4;
    int64_t per = (rows + tasks - 1) / tasks;
    per = (per + CPU_GEMM_MR - 1) / CPU_GEMM_MR * CPU_GEMM_MR;
    int n_tasks = (int)((rows + per - 1) / per);
    const int64_t k16 = (cols + 15) & ~(int64_t)15;
    /* Token blocks whose packed rows of x fit in the shared buffer (about half the L2 cache). */
    int64_t nb = (int64_t)(CPU_GEMM_XBLOCK_BYTES / sizeof(float)) / k16;
    nb = nb / CPU_GEMM_NR * CPU_GEMM_NR;
    if (nb < CPU_GEMM_NR)
        nb = CPU_GEMM_NR;
    struct gemm_job job = {c, k, w, x, bias, y, n, nb, 0, 0, per};
#if CPU_X86
    if (c->isa == CPU_ISA_AVX512 && nb * k16 * (int64_t)sizeof(float) <= (int64_t)CPU_GEMM_XT_BYTES) {
        for (int64_t t0 = 0; t0 < n; t0 += nb) {
            job.t0 = t0;
            job.nt = n - t0 < nb ? n - t0 : nb;
            llmem_pool_run(c->pool, (int)((job.nt + CPU_GEMM_NR - 1) / CPU_GEMM_NR), pack_x_task,
                           &job);
            llmem_pool_run(c->pool, n_tasks, gemm_packed_task, &job);
        }
        return;
    }
#endif
    llmem_pool_run(c->pool, n_tasks, gemm_task, &job);
}

/* OpenBLAS for f32 weights: one sgemm, then the bias. OpenBLAS runs on its own threads, as many
 * as the backend has (set at create); the pool's workers sleep meanwhile or spin briefly. */
static void matmul_blas(const struct llmem_weight *w, const float *x, int64_t n, float *y,
                        const float *bias) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)n, (blasint)w->rows,
                (blasint)w->cols, 1.0f, x, (blasint)w->cols, (const float *)w->data,
                (blasint)w->cols, 0.0f, y, (blasint)w->rows);
    if (bias != NULL)
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = 0; r < w->rows; r++)
                y[t * w->rows + r] += bias[r];
}

void cpu_matmul(void *ctx, const struct llmem_weight *w, const float *x, int64_t n, float *y,
                const float *bias) {
    struct cpu_ctx *c = ctx;
    LLMEM_ASSERT(w != NULL && x != NULL && y != NULL && n >= 0);
    LLMEM_ASSERT(w->dtype == LLMEM_DTYPE_F32 || w->dtype == LLMEM_DTYPE_F16 ||
                 w->dtype == LLMEM_DTYPE_BF16);
    if (n == 0 || w->rows == 0)
        return;
    if (w->cols == 0) {
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = 0; r < w->rows; r++)
                y[t * w->rows + r] = bias != NULL ? bias[r] : 0.0f;
        return;
    }
    const struct matmul_kernels *k = &kernels[c->isa];
    enum cpu_matmul_path path = c->path;
    if (path == CPU_MATMUL_AUTO) {
        path = n >= c->gemm_min_n ? CPU_MATMUL_GEMM : CPU_MATMUL_DECODE;
        if (path == CPU_MATMUL_GEMM && c->blas_f32 && w->dtype == LLMEM_DTYPE_F32)
            path = CPU_MATMUL_BLAS;
    }
    if (path == CPU_MATMUL_BLAS && w->dtype != LLMEM_DTYPE_F32)
        path = CPU_MATMUL_GEMM;
    switch (path) {
    case CPU_MATMUL_DECODE: matmul_decode(c, k, w, x, n, y, bias); break;
    case CPU_MATMUL_BLAS: matmul_blas(w, x, n, y, bias); break;
    default: matmul_gemm(c, k, w, x, n, y, bias);
    }
}
