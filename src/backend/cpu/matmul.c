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
 * time from four quarters of the range (four long sequential streams, prefetched 2 KiB ahead);
 * for more, four W rows at a time are multiplied with two rows of x at a time (prefetched as they
 * are first read).
 *
 * GEMM (n large), AVX-512: lane by lane (the 16 lanes of the canonical sums are independent
 * chains), a tile of 32 W rows × 12 rows of x is an outer-product GEMM vectorized over W rows:
 * 24 accumulators, 2 vector loads and 12 broadcasts per 24 FMAs. Each task owns a range of W
 * rows; a block of x (up to 4.5 MiB) is packed once per block, by all threads, per lane as
 * [l][k/16][12]; W is converted in chunks of 2048 columns, transposed per lane ([l][k/16][32]),
 * and multiplied with every strip of the block; the 16 lane sums of a tile are added by the
 * canonical tree at the end, 16 outputs per vector. Portable and AVX2: 4 converted W rows ×
 * rows of x, one accumulator per output. Rows longer than CPU_GEMM_K_MAX take the decode kernels.
 *
 * At fast precision on a CPU with AVX512-BF16, bf16 weights (but those marked f32_x) multiply the
 * activations rounded to bf16 with VDPBF16PS, in a canonical order of their own (see "AVX512-BF16"
 * below), through the same loops.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "backend/cpu/cpu_int.h"
#include "backend/cpu/x86_int.h"
#include "core/log.h"
#include "llmem/pool.h"
#include "llmem/sys.h"
#include "llmem/dtype.h"

/* ---- the ISA ----------------------------------------------------------------------------------
 */

enum cpu_isa llmem_cpu_isa_best(void) {
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

const char *llmem_cpu_isa_name(enum cpu_isa isa) {
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
    case LLMEM_DTYPE_BF16: return cpu_bf16_to_f32(cpu_u16_at(row, k));
    case LLMEM_DTYPE_F16: return llmem_cpu_f16_to_f32(cpu_u16_at(row, k));
    default: {
        float v;
        memcpy(&v, (const uint8_t *)row + 4 * k, sizeof(v));
        return v;
    }
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

/* Decode prefetches the task's rows DECODE_PF_BYTES ahead of the reads: rows of a few KiB are too
 * short for the hardware prefetchers, which stop at page boundaries. Four streams 2 KiB ahead
 * keep 128 lines in flight a core; 8 KiB ahead (512 lines, most of L1) streamed 15 % slower on
 * the Zen 5 machines of docs/BENCHMARKS.md, and no prefetch 10 %. */
#define DECODE_PF_BYTES 2048

/* R weight rows × NX rows of x (R · NX ≤ 6: 12 accumulators of 16 registers). A decode's one
 * row of x takes six weight rows at a time: six streams in flight instead of two (bf16, 2
 * threads on a Zen 3: 10.5 → 12.4 tokens/s on the 1B shape); each row's sums keep their order. */
TARGET_AVX2 static ALWAYS_INLINE void gemv_tile_avx2_s(const void *w, enum llmem_dtype dt,
                                                       int64_t ld, int64_t i0, int64_t step,
                                                       const float *x, int64_t cols, int64_t t0,
                                                       float *y, int64_t ldy, const float *bias,
                                                       const int R, const int NX, const size_t PF) {
    const size_t esize = dt == LLMEM_DTYPE_F32 ? 4 : 2;
    const void *wr[6];
    for (int i = 0; i < R; i++)
        wr[i] = row_at(w, dt, ld, i0 + i * step);
    const float *xr[3];
    for (int j = 0; j < NX; j++)
        xr[j] = x + (t0 + j) * cols;
    __m256 lo[6][3], hi[6][3];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NX; j++)
            lo[i][j] = hi[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= cols; k += 16) {
        for (int i = 0; i < R; i++) {
            if (PF != 0 && ((k * esize) & 63) == 0)
                _mm_prefetch((const char *)wr[i] + (size_t)k * esize + PF, _MM_HINT_T0);
            __m256 w0 = load8_avx2(wr[i], dt, k), w1 = load8_avx2(wr[i], dt, k + 8);
            for (int j = 0; j < NX; j++) {
                lo[i][j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr[j] + k), lo[i][j]);
                hi[i][j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr[j] + k + 8), hi[i][j]);
            }
        }
    }
    if (k < cols) { /* the tail, zero-padded to 16 */
        float wt[6][16] = {{0}}, xt[3][16] = {{0}};
        for (int i = 0; i < R; i++)
            for (int64_t kk = k; kk < cols; kk++)
                wt[i][kk - k] = weight_at(wr[i], dt, kk);
        for (int j = 0; j < NX; j++)
            memcpy(xt[j], xr[j] + k, (size_t)(cols - k) * sizeof(float));
        for (int i = 0; i < R; i++)
            for (int j = 0; j < NX; j++) {
                lo[i][j] =
                    _mm256_fmadd_ps(_mm256_loadu_ps(wt[i]), _mm256_loadu_ps(xt[j]), lo[i][j]);
                hi[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(wt[i] + 8), _mm256_loadu_ps(xt[j] + 8),
                                           hi[i][j]);
            }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NX; j++)
            y[(t0 + j) * ldy + i0 + i * step] =
                finish(reduce16_avx2(lo[i][j], hi[i][j]), bias, i0 + i * step);
}

/* R consecutive weight rows × NX rows of x. */
#define gemv_tile_avx2(w, dt, ld, i0, x, cols, t0, y, ldy, bias, R, NX)                            \
    gemv_tile_avx2_s(w, dt, ld, i0, 1, x, cols, t0, y, ldy, bias, R, NX, 0)

TARGET_AVX2 static ALWAYS_INLINE void gemv_avx2_dt(const void *w, enum llmem_dtype dt, int64_t ld,
                                                   int64_t nrows, const float *x, int64_t cols,
                                                   int64_t n, float *y, int64_t ldy,
                                                   const float *bias) {
    int64_t i = 0;
    if (n == 1) { /* six long streams: the range in six parts, a row of each at a time */
        const int64_t part = nrows / 6;
        for (; i < part; i++)
            gemv_tile_avx2_s(w, dt, ld, i, part, x, cols, 0, y, ldy, bias, 6, 1, DECODE_PF_BYTES);
        i = part * 6;
    }
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
    case LLMEM_DTYPE_BF16:
        gemv_avx2_dt(w, LLMEM_DTYPE_BF16, ld, nrows, x, cols, n, y, ldy, bias);
        break;
    case LLMEM_DTYPE_F16:
        gemv_avx2_dt(w, LLMEM_DTYPE_F16, ld, nrows, x, cols, n, y, ldy, bias);
        break;
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
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) wr[i] = row_at(w, dt, ld, i0 + i * step);
    const float *xr[8];
    _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++) xr[j] = x + (t0 + j) * cols;
    __m512 acc[8][8];
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= cols; k += 16) {
        __m512 xv[8];
        _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++) xv[j] = _mm512_loadu_ps(xr[j] + k);
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
            if (PF != 0 && ((k * esize) & 63) == 0)
                _mm_prefetch((const char *)wr[i] + (size_t)k * esize + PF, _MM_HINT_T0);
            __m512 wv = load16_avx512(wr[i], dt, k, 0xffff);
            _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++) acc[i][j] =
                _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    if (k < cols) {
        __mmask16 m = (__mmask16)((1u << (cols - k)) - 1);
        __m512 xv[8];
        _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++) xv[j] =
            _mm512_maskz_loadu_ps(m, xr[j] + k);
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
            __m512 wv = load16_avx512(wr[i], dt, k, m);
            _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++) acc[i][j] =
                _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++) y[(t0 + j) * ldy + i0 + i * step] =
            finish(reduce16_avx512(acc[i][j]), bias, i0 + i * step);
}

/* R consecutive weight rows × NX rows of x. */
#define gemv_tile_avx512(w, dt, ld, i0, x, cols, t0, y, ldy, bias, R, NX, PF)                      \
    gemv_tile_avx512_s(w, dt, ld, i0, 1, x, cols, t0, y, ldy, bias, R, NX, PF)

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
                gemv_tile_avx512(w, dt, ld, i, x, cols, t, y, ldy, bias, 4, 1,
                                 t == 0 ? DECODE_PF_BYTES : 0);
            else
                gemv_tile_avx512(w, dt, ld, i, x, cols, t, y, ldy, bias, 4, 2,
                                 t == 0 ? DECODE_PF_BYTES : 0);
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

TARGET_AVX512 static void gemv_avx512(const void *w, enum llmem_dtype dt, int64_t ld, int64_t nrows,
                                      const float *x, int64_t cols, int64_t n, float *y,
                                      int64_t ldy, const float *bias) {
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

/* The AVX-512 GEMM works lane by lane: the canonical sums are 16 independent chains per output
 * (lane l takes the columns k ≡ l mod 16 in increasing order), so for one lane at a time a tile is
 * an ordinary outer-product GEMM, vectorized over 16 W rows with one element of x broadcast:
 * 32 rows × 12 rows of x, 24 accumulators, 2 vector loads and 12 broadcasts per 24 FMAs. W is
 * packed per lane ([l][k/16][32], a 16 × 16 transpose per block) and x too ([l][k/16][12]); the
 * 16 lanes' partial sums of a tile are kept in scratch and added by the canonical tree at the end,
 * 16 outputs per vector. */

/* One lane of a tile: ns steps of wp ([step][32]) and xp ([step][12]); the 24 accumulators start
 * from st (or zero) and go back to st ([24][16]: row group g, row of x j at g · 12 + j). */
TARGET_AVX512 static void lane_avx512(const float *wp, const float *xp, int64_t ns, float *st,
                                      int init) {
    __m512 acc0[CPU_GEMM512_NR], acc1[CPU_GEMM512_NR];
    _Pragma("GCC unroll 12") for (int j = 0; j < CPU_GEMM512_NR; j++) {
        acc0[j] = init ? _mm512_load_ps(st + j * 16) : _mm512_setzero_ps();
        acc1[j] = init ? _mm512_load_ps(st + (CPU_GEMM512_NR + j) * 16) : _mm512_setzero_ps();
    }
    for (int64_t s = 0; s < ns; s++) {
        __m512 w0 = _mm512_load_ps(wp + s * 32), w1 = _mm512_load_ps(wp + s * 32 + 16);
        const float *xs = xp + s * CPU_GEMM512_NR;
        _Pragma("GCC unroll 12") for (int j = 0; j < CPU_GEMM512_NR; j++) {
            __m512 xb = _mm512_set1_ps(xs[j]);
            acc0[j] = _mm512_fmadd_ps(w0, xb, acc0[j]);
            acc1[j] = _mm512_fmadd_ps(w1, xb, acc1[j]);
        }
    }
    _Pragma("GCC unroll 12") for (int j = 0; j < CPU_GEMM512_NR; j++) {
        _mm512_store_ps(st + j * 16, acc0[j]);
        _mm512_store_ps(st + (CPU_GEMM512_NR + j) * 16, acc1[j]);
    }
}

/* The canonical tree over the 16 lanes of a tile's sums (st: [16][24][16]), plus the bias, into
 * y: mr ≤ 32 valid W rows, nt ≤ 12 valid rows of x. */
TARGET_AVX512 static void finish_tile_avx512(const float *st, int mr, int nt, float *y, int64_t ldy,
                                             const float *bias) {
    const int per = 2 * CPU_GEMM512_NR * 16;
    for (int g = 0; g < 2; g++) {
        int rows = mr - g * 16;
        if (rows <= 0)
            break;
        __mmask16 m = rows >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << rows) - 1);
        __m512 b = bias != NULL ? _mm512_maskz_loadu_ps(m, bias + g * 16) : _mm512_setzero_ps();
        for (int j = 0; j < nt; j++) {
            const float *p = st + (g * CPU_GEMM512_NR + j) * 16;
            __m512 h8[8], h4[4], h2[2];
            for (int i = 0; i < 8; i++)
                h8[i] =
                    _mm512_add_ps(_mm512_load_ps(p + i * per), _mm512_load_ps(p + (i + 8) * per));
            for (int i = 0; i < 4; i++)
                h4[i] = _mm512_add_ps(h8[i], h8[i + 4]);
            for (int i = 0; i < 2; i++)
                h2[i] = _mm512_add_ps(h4[i], h4[i + 2]);
            __m512 v = _mm512_add_ps(h2[0], h2[1]);
            if (bias != NULL)
                v = _mm512_add_ps(v, b);
            _mm512_mask_storeu_ps(y + j * ldy + g * 16, m, v);
        }
    }
}

/* Converts columns [16 · s0, 16 · (s0 + ns)) of mr ≤ 32 weight rows (ld apart) into wp as
 * [l][ns][32]: zero past cols and past mr. */
TARGET_AVX512 static ALWAYS_INLINE void pack_w_avx512_dt(const void *w, enum llmem_dtype dt,
                                                         int64_t ld, int mr, int64_t cols,
                                                         int64_t s0, int64_t ns, float *wp) {
    for (int g = 0; g < 2; g++) {
        const void *wr[16];
        for (int i = 0; i < 16; i++)
            wr[i] = row_at(w, dt, ld, g * 16 + i < mr ? g * 16 + i : 0);
        for (int64_t s = 0; s < ns; s++) {
            int64_t k = (s0 + s) * 16, left = cols - k;
            __mmask16 m = left >= 16 ? (__mmask16)0xffff
                          : left > 0 ? (__mmask16)((1u << left) - 1)
                                     : (__mmask16)0;
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = g * 16 + i < mr ? load16_avx512(wr[i], dt, k, m) : _mm512_setzero_ps();
            transpose16_avx512(r);
            for (int l = 0; l < 16; l++)
                _mm512_store_ps(wp + ((size_t)l * (size_t)ns + (size_t)s) * 32 + g * 16, r[l]);
        }
    }
}

TARGET_AVX512 static void pack_w_avx512(const void *w, enum llmem_dtype dt, int64_t ld, int mr,
                                        int64_t cols, int64_t s0, int64_t ns, float *wp) {
    switch (dt) {
    case LLMEM_DTYPE_BF16: pack_w_avx512_dt(w, LLMEM_DTYPE_BF16, ld, mr, cols, s0, ns, wp); break;
    case LLMEM_DTYPE_F16: pack_w_avx512_dt(w, LLMEM_DTYPE_F16, ld, mr, cols, s0, ns, wp); break;
    default: pack_w_avx512_dt(w, LLMEM_DTYPE_F32, ld, mr, cols, s0, ns, wp);
    }
}

/* ---- AVX512-BF16: bf16 weights at fast precision ----------------------------------------------
 *
 * The activations are rounded to bf16 (VCVTNE2PS2BF16: to nearest even, denormals as zero) and
 * multiplied by the weights as they lie in the file with VDPBF16PS, which adds to each f32 lane
 * the two products of a pair of bf16 values: twice the FMA rate, no conversion of W.
 *
 * The fast canonical order: 16 f32 lanes, zero at first; for k0 = 0, 32, … below cols rounded up
 * to 32, lane l ← VDPBF16PS(lane l, (w[k0 + 2l], w[k0 + 2l + 1]), (x[k0 + 2l], x[k0 + 2l + 1]))
 * with both zero where the index is ≥ cols; then the canonical tree over the lanes and the bias.
 * The decode kernels (a row of 32 weights a vector) and the GEMM (lane by lane, as the f32 GEMM,
 * pairs in place of single values) both compute exactly this, so a row of x gives the same bits
 * alone or in any batch at this precision. */

/* 32 bf16 weights from k (as 16 pairs); past `left` zero. */
TARGET_BF16 static ALWAYS_INLINE __m512i w32_bf16(const void *row, int64_t k, int64_t left) {
    const uint16_t *p = (const uint16_t *)row + k;
    if (left >= 32)
        return _mm512_loadu_si512(p);
    return _mm512_maskz_loadu_epi16((__mmask32)((1u << left) - 1), p);
}

TARGET_BF16 static ALWAYS_INLINE __m512 dp_bf16(__m512 acc, __m512i w, __m512bh x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, x);
}

/* R weight rows (step apart from i0) × NX rows of x, as gemv_tile_avx512_s. */
TARGET_BF16 static ALWAYS_INLINE void gemv_tile_bf16_s(const void *w, int64_t ld, int64_t i0,
                                                       int64_t step, const float *x, int64_t cols,
                                                       int64_t t0, float *y, int64_t ldy,
                                                       const float *bias, const int R, const int NX,
                                                       const size_t PF) {
    const void *wr[8];
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) wr[i] =
        row_at(w, LLMEM_DTYPE_BF16, ld, i0 + i * step);
    const float *xr[8];
    _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++) xr[j] = x + (t0 + j) * cols;
    __m512 acc[8][8];
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < cols; k += 32) {
        const int64_t left = cols - k;
        __m512bh xv[8];
        _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++) xv[j] = x32_bf16(xr[j] + k, left);
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
            if (PF != 0)
                _mm_prefetch((const char *)wr[i] + (size_t)k * 2 + PF, _MM_HINT_T0);
            __m512i wv = w32_bf16(wr[i], k, left);
            _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++) acc[i][j] =
                dp_bf16(acc[i][j], wv, xv[j]);
        }
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < NX; j++) y[(t0 + j) * ldy + i0 + i * step] =
            finish(reduce16_avx512(acc[i][j]), bias, i0 + i * step);
}

#define gemv_tile_bf16(w, ld, i0, x, cols, t0, y, ldy, bias, R, NX, PF)                            \
    gemv_tile_bf16_s(w, ld, i0, 1, x, cols, t0, y, ldy, bias, R, NX, PF)

/* The decode kernel of bf16 weights at fast precision (dt is bf16): the loops of gemv_avx512. */
TARGET_BF16 static void gemv_bf16(const void *w, enum llmem_dtype dt, int64_t ld, int64_t nrows,
                                  const float *x, int64_t cols, int64_t n, float *y, int64_t ldy,
                                  const float *bias) {
    LLMEM_ASSERT(dt == LLMEM_DTYPE_BF16);
    int64_t i = 0;
    if (n == 1) {
        int64_t part = nrows / DECODE_R1;
        for (; i < part; i++)
            gemv_tile_bf16_s(w, ld, i, part, x, cols, 0, y, ldy, bias, DECODE_R1, 1,
                             DECODE_PF_BYTES);
        for (i = part * DECODE_R1; i < nrows; i++)
            gemv_tile_bf16(w, ld, i, x, cols, 0, y, ldy, bias, 1, 1, DECODE_PF_BYTES);
        return;
    }
    for (; i + 4 <= nrows; i += 4)
        for (int64_t t = 0; t < n; t += 2) {
            if (n - t == 1)
                gemv_tile_bf16(w, ld, i, x, cols, t, y, ldy, bias, 4, 1,
                               t == 0 ? DECODE_PF_BYTES : 0);
            else
                gemv_tile_bf16(w, ld, i, x, cols, t, y, ldy, bias, 4, 2,
                               t == 0 ? DECODE_PF_BYTES : 0);
        }
    for (; i < nrows; i++)
        for (int64_t t = 0; t < n; t += 2) {
            if (n - t == 1)
                gemv_tile_bf16(w, ld, i, x, cols, t, y, ldy, bias, 1, 1, 0);
            else
                gemv_tile_bf16(w, ld, i, x, cols, t, y, ldy, bias, 1, 2, 0);
        }
}

/* One lane of a tile, as lane_avx512: wp [step][32] pairs, xp [step][12] pairs. */
TARGET_BF16 static void lane_bf16(const uint32_t *wp, const uint32_t *xp, int64_t ns, float *st,
                                  int init) {
    __m512 acc0[CPU_GEMM512_NR], acc1[CPU_GEMM512_NR];
    _Pragma("GCC unroll 12") for (int j = 0; j < CPU_GEMM512_NR; j++) {
        acc0[j] = init ? _mm512_load_ps(st + j * 16) : _mm512_setzero_ps();
        acc1[j] = init ? _mm512_load_ps(st + (CPU_GEMM512_NR + j) * 16) : _mm512_setzero_ps();
    }
    for (int64_t s = 0; s < ns; s++) {
        __m512i w0 = _mm512_load_si512(wp + s * 32), w1 = _mm512_load_si512(wp + s * 32 + 16);
        const uint32_t *xs = xp + s * CPU_GEMM512_NR;
        _Pragma("GCC unroll 12") for (int j = 0; j < CPU_GEMM512_NR; j++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xs[j]);
            acc0[j] = dp_bf16(acc0[j], w0, xb);
            acc1[j] = dp_bf16(acc1[j], w1, xb);
        }
    }
    _Pragma("GCC unroll 12") for (int j = 0; j < CPU_GEMM512_NR; j++) {
        _mm512_store_ps(st + j * 16, acc0[j]);
        _mm512_store_ps(st + (CPU_GEMM512_NR + j) * 16, acc1[j]);
    }
}

/* Pairs [32 · s0, 32 · (s0 + ns)) of mr ≤ 32 bf16 weight rows (ld apart) into wp as
 * [l][ns][32] pairs: zero past cols and past mr. */
TARGET_BF16 static void pack_w_bf16(const void *w, int64_t ld, int mr, int64_t cols, int64_t s0,
                                    int64_t ns, uint32_t *wp) {
    for (int g = 0; g < 2; g++) {
        const void *wr[16];
        for (int i = 0; i < 16; i++)
            wr[i] = row_at(w, LLMEM_DTYPE_BF16, ld, g * 16 + i < mr ? g * 16 + i : 0);
        for (int64_t s = 0; s < ns; s++) {
            int64_t k = (s0 + s) * 32;
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = g * 16 + i < mr ? _mm512_castsi512_ps(w32_bf16(wr[i], k, cols - k))
                                       : _mm512_setzero_ps();
            transpose16_avx512(r);
            for (int l = 0; l < 16; l++)
                _mm512_store_ps((float *)wp + ((size_t)l * (size_t)ns + (size_t)s) * 32 + g * 16,
                                r[l]);
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
    [CPU_ISA_AVX512] = {gemv_avx512, convert_avx512, panel_avx2},
#else
    [CPU_ISA_AVX2] = {gemv_scalar, convert_scalar, panel_generic_scalar},
    [CPU_ISA_AVX512] = {gemv_scalar, convert_scalar, panel_generic_scalar},
#endif
};

/* bf16 weights at fast precision on a CPU with AVX512-BF16: the decode kernel here, the GEMM
 * packed in pairs (matmul_gemm); no panel path. */
#if CPU_X86
static const struct matmul_kernels kernels_bf16 = {gemv_bf16, NULL, NULL};
#else
static const struct matmul_kernels kernels_bf16 = {gemv_scalar, NULL, NULL}; /* (never chosen) */
#endif

int llmem_cpu_bf16_isa(enum cpu_isa isa) {
    return isa == CPU_ISA_AVX512 && (llmem_sys_isa_features() & LLMEM_ISA_AVX512_BF16) != 0;
}

int llmem_cpu_bf16_fast(const struct cpu_ctx *c) {
    return c->precision == LLMEM_PRECISION_FAST && llmem_cpu_bf16_isa(c->isa);
}

/* The kernels of a matrix of floats (not quantized). */
static const struct matmul_kernels *kernels_of(const struct cpu_ctx *c,
                                               const struct llmem_weight *w) {
    return w->dtype == LLMEM_DTYPE_BF16 && !w->f32_x && llmem_cpu_bf16_fast(c) ? &kernels_bf16
                                                                               : &kernels[c->isa];
}

static const void *row_ptr(const struct llmem_weight *w, int64_t r) {
    return (const uint8_t *)w->data + (size_t)r * (size_t)llmem_weight_row_bytes(w);
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

/* Several matrices in one dispatch, each of its own input of n[i] rows: each split as
 * matmul_decode would split it alone, the tasks of all of them run together. */
#define MULTI_TASKS 256
struct gemv_multi_job {
    const struct matmul_kernels *k;
    struct {
        const struct llmem_weight *w;
        const float *x;
        int64_t n;
        float *y;
        const float *bias;
        int64_t r0, r1;
    } t[MULTI_TASKS];
};

static void gemv_multi_task(void *arg, int task, int thread) {
    (void)thread;
    const struct gemv_multi_job *j = arg;
    const struct llmem_weight *w = j->t[task].w;
    int64_t r0 = j->t[task].r0, r1 = j->t[task].r1;
    j->k->gemv(row_ptr(w, r0), w->dtype, w->cols, r1 - r0, j->t[task].x, w->cols, j->t[task].n,
               j->t[task].y + r0, w->rows, j->t[task].bias != NULL ? j->t[task].bias + r0 : NULL);
}

static void matmul_decode_multi(struct cpu_ctx *c, const struct matmul_kernels *k, int count,
                                const struct llmem_weight *const *w, const float *const *x,
                                const int64_t *n, float *const *y, const float *const *bias) {
    int64_t work = 0;
    for (int i = 0; i < count; i++)
        work += w[i]->rows * w[i]->cols * n[i];
    struct gemv_multi_job *job = malloc(sizeof(*job));
    if (job == NULL) { /* one dispatch each, then */
        for (int i = 0; i < count; i++)
            matmul_decode(c, k, w[i], x[i], n[i], y[i], bias != NULL ? bias[i] : NULL);
        return;
    }
    job->k = k;
    int tasks = 0;
    for (int i = 0; i < count; i++) {
        /* Below ~64 K multiply-adds in all, one task; else as matmul_decode splits one matrix */
        int per_w = work < (int64_t)1 << 16 ? 1 : c->n_threads;
        if (per_w > 1) {
            int64_t by_size = w[i]->rows * w[i]->cols * llmem_dtype_size(w[i]->dtype) >> 20;
            int64_t most = (int64_t)per_w * 16;
            per_w = (int)(by_size < per_w ? per_w : by_size > most ? most : by_size);
        }
        if (per_w > MULTI_TASKS / count)
            per_w = MULTI_TASKS / count;
        int64_t per = (w[i]->rows + per_w - 1) / per_w;
        per = (per + 3) & ~(int64_t)3;
        for (int64_t r0 = 0; r0 < w[i]->rows; r0 += per) {
            job->t[tasks].w = w[i], job->t[tasks].y = y[i];
            job->t[tasks].x = x[i], job->t[tasks].n = n[i];
            job->t[tasks].bias = bias != NULL ? bias[i] : NULL;
            job->t[tasks].r0 = r0;
            job->t[tasks].r1 = r0 + per < w[i]->rows ? r0 + per : w[i]->rows;
            tasks++;
        }
    }
    llmem_pool_run(c->pool, tasks, gemv_multi_task, job);
    free(job);
}

/* ---- GEMM -------------------------------------------------------------------------------------
 *
 * Portable and AVX2: tiles of CPU_GEMM_MR weight rows × a few rows of x in the canonical
 * dot-product form (vectorized over k, one 16-lane accumulator per output): each task owns a range
 * of W rows and converts CPU_GEMM_MR of them at a time, the whole row, to f32 in per-thread
 * scratch, reused by every tile of a token block. AVX-512: lane by lane (see lane_avx512). */

struct gemm_job {
    struct cpu_ctx *c;
    const struct matmul_kernels *k;
    const struct llmem_weight *w;
    const float *x, *bias;
    float *y;
    int64_t n, nb;         /* tokens, and tokens per block */
    int64_t t0, nt;        /* the packed block (AVX-512): its first token and its tokens */
    int64_t rows_per_task; /* a multiple of CPU_GEMM_MR */
    int bf16;              /* bf16 weights at fast precision: pairs of 32 columns a step */
};

static void gemm_task(void *arg, int task, int thread) {
    const struct gemm_job *j = arg;
    const struct llmem_weight *w = j->w;
    const int64_t rows = w->rows, cols = w->cols;
    const int64_t ld = (cols + 15) & ~(int64_t)15;
    float *a = j->c->wpanel + (size_t)thread * CPU_GEMM_THREAD_FLOATS;
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
/* Packs strip `task` of the block: CPU_GEMM512_NR rows of x as [l][k/16][NR] (column 16 s + l of
 * row j at (l · nk + s) · NR + j), zero past cols and past the block. */
TARGET_AVX512 static void pack_x_task(void *arg, int task, int thread) {
    (void)thread;
    const struct gemm_job *j = arg;
    const int64_t cols = j->w->cols, nk = (cols + 15) / 16;
    float *dst = j->c->xt + (size_t)task * (size_t)nk * 16 * CPU_GEMM512_NR;
    const float *src[CPU_GEMM512_NR];
    for (int jj = 0; jj < CPU_GEMM512_NR; jj++) {
        int64_t t = (int64_t)task * CPU_GEMM512_NR + jj;
        src[jj] = t < j->nt ? j->x + (j->t0 + t) * cols : NULL;
    }
    const __mmask16 m12 = (__mmask16)((1u << CPU_GEMM512_NR) - 1);
    for (int64_t s = 0; s < nk; s++) {
        int64_t left = cols - s * 16;
        __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        __m512 r[16];
        for (int jj = 0; jj < 16; jj++)
            r[jj] = jj < CPU_GEMM512_NR && src[jj] != NULL
                        ? _mm512_maskz_loadu_ps(m, src[jj] + s * 16)
                        : _mm512_setzero_ps();
        transpose16_avx512(r);
        for (int l = 0; l < 16; l++)
            _mm512_mask_storeu_ps(dst + ((size_t)l * (size_t)nk + (size_t)s) * CPU_GEMM512_NR, m12,
                                  r[l]);
    }
}

/* The same for bf16 weights at fast precision: pairs of x rounded to bf16, [l][k/32][NR]. */
TARGET_BF16 static void pack_x_bf16_task(void *arg, int task, int thread) {
    (void)thread;
    const struct gemm_job *j = arg;
    const int64_t cols = j->w->cols, nk = (cols + 31) / 32;
    uint32_t *dst = (uint32_t *)j->c->xt + (size_t)task * (size_t)nk * 16 * CPU_GEMM512_NR;
    const float *src[CPU_GEMM512_NR];
    for (int jj = 0; jj < CPU_GEMM512_NR; jj++) {
        int64_t t = (int64_t)task * CPU_GEMM512_NR + jj;
        src[jj] = t < j->nt ? j->x + (j->t0 + t) * cols : NULL;
    }
    const __mmask16 m12 = (__mmask16)((1u << CPU_GEMM512_NR) - 1);
    for (int64_t s = 0; s < nk; s++) {
        __m512 r[16];
        for (int jj = 0; jj < 16; jj++)
            r[jj] = jj < CPU_GEMM512_NR && src[jj] != NULL
                        ? _mm512_castsi512_ps((__m512i)x32_bf16(src[jj] + s * 32, cols - s * 32))
                        : _mm512_setzero_ps();
        transpose16_avx512(r);
        for (int l = 0; l < 16; l++)
            _mm512_mask_storeu_ps(
                (float *)dst + ((size_t)l * (size_t)nk + (size_t)s) * CPU_GEMM512_NR, m12, r[l]);
    }
}

/* A task: its range of W rows, 32 at a time; per chunk of columns, the chunk of the panel is
 * converted (bf16 at fast precision: transposed in pairs) once and multiplied with every strip of
 * the block, lane by lane. */
static void gemm_packed_task(void *arg, int task, int thread) {
    const struct gemm_job *j = arg;
    const struct llmem_weight *w = j->w;
    const int64_t rows = w->rows, cols = w->cols;
    const int64_t nk = j->bf16 ? (cols + 31) / 32 : (cols + 15) / 16; /* steps of a row */
    const int64_t kc = CPU_GEMM512_KC / 16; /* steps per chunk (the same bytes of W either way) */
    float *wp = j->c->wpanel + (size_t)thread * CPU_GEMM_THREAD_FLOATS;
    float *sums = wp + (size_t)CPU_GEMM512_MR * CPU_GEMM512_KC;
    const size_t tile = (size_t)16 * CPU_GEMM512_MR * CPU_GEMM512_NR; /* floats of a tile's sums */
    const size_t strip = (size_t)nk * 16 * CPU_GEMM512_NR;            /* floats of a packed strip */
    const int64_t strips = (j->nt + CPU_GEMM512_NR - 1) / CPU_GEMM512_NR;
    const int multi = nk > kc; /* then strips ≤ CPU_GEMM512_STRIPS */
    int64_t r_begin = (int64_t)task * j->rows_per_task;
    int64_t r_end = r_begin + j->rows_per_task < rows ? r_begin + j->rows_per_task : rows;
    for (int64_t r0 = r_begin; r0 < r_end; r0 += CPU_GEMM512_MR) {
        int mr = r_end - r0 < CPU_GEMM512_MR ? (int)(r_end - r0) : CPU_GEMM512_MR;
        for (int64_t s0 = 0; s0 < nk; s0 += kc) {
            int64_t ns = nk - s0 < kc ? nk - s0 : kc;
            if (j->bf16)
                pack_w_bf16(row_ptr(w, r0), cols, mr, cols, s0, ns, (uint32_t *)wp);
            else
                pack_w_avx512(row_ptr(w, r0), w->dtype, cols, mr, cols, s0, ns, wp);
            for (int64_t q = 0; q < strips; q++) {
                float *st = sums + (multi ? (size_t)q * tile : 0);
                const float *xs = j->c->xt + (size_t)q * strip;
                for (int l = 0; l < 16; l++) {
                    size_t wo = (size_t)l * (size_t)ns * 32;
                    size_t xo = ((size_t)l * (size_t)nk + (size_t)s0) * CPU_GEMM512_NR;
                    float *sl = st + (size_t)l * 2 * CPU_GEMM512_NR * 16;
                    if (j->bf16)
                        lane_bf16((const uint32_t *)wp + wo, (const uint32_t *)xs + xo, ns, sl,
                                  s0 > 0);
                    else
                        lane_avx512(wp + wo, xs + xo, ns, sl, s0 > 0);
                }
                if (!multi || s0 + ns == nk) {
                    int64_t t = q * CPU_GEMM512_NR;
                    int nt = j->nt - t < CPU_GEMM512_NR ? (int)(j->nt - t) : CPU_GEMM512_NR;
                    finish_tile_avx512(st, mr, nt, j->y + (j->t0 + t) * rows + r0, rows,
                                       j->bias != NULL ? j->bias + r0 : NULL);
                }
            }
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
    const int bf16 = k == &kernels_bf16;
    const int64_t mr = c->isa == CPU_ISA_AVX512 ? CPU_GEMM512_MR : CPU_GEMM_MR;
    int tasks = c->n_threads * 4;
    int64_t per = (rows + tasks - 1) / tasks;
    per = (per + mr - 1) / mr * mr;
    int n_tasks = (int)((rows + per - 1) / per);
    /* Token blocks whose rows of x fit in the shared buffer, whole strips (4 bytes a column, 2 as
     * bf16 pairs); KC columns of a chunk (twice as many pairs). */
    const int64_t k16 = bf16 ? (cols + 31) / 32 * 16 : (cols + 15) & ~(int64_t)15;
    int64_t nb = (int64_t)(CPU_GEMM_XBLOCK_BYTES / sizeof(float)) / k16;
    nb = nb / CPU_GEMM512_NR * CPU_GEMM512_NR;
    if (nb < CPU_GEMM512_NR)
        nb = CPU_GEMM512_NR;
    struct gemm_job job = {c, k, w, x, bias, y, n, nb, 0, 0, per, bf16};
#if CPU_X86
    if (c->isa == CPU_ISA_AVX512) {
        /* Partial sums wait between column chunks for at most CPU_GEMM512_STRIPS strips. */
        if (k16 > CPU_GEMM512_KC && nb > (int64_t)CPU_GEMM512_STRIPS * CPU_GEMM512_NR)
            nb = (int64_t)CPU_GEMM512_STRIPS * CPU_GEMM512_NR;
        job.nb = nb;
        for (int64_t t0 = 0; t0 < n; t0 += nb) {
            job.t0 = t0;
            job.nt = n - t0 < nb ? n - t0 : nb;
            llmem_pool_run(c->pool, (int)((job.nt + CPU_GEMM512_NR - 1) / CPU_GEMM512_NR),
                           bf16 ? pack_x_bf16_task : pack_x_task, &job);
            llmem_pool_run(c->pool, n_tasks, gemm_packed_task, &job);
        }
        return;
    }
#endif
    LLMEM_ASSERT(!bf16);
    llmem_pool_run(c->pool, n_tasks, gemm_task, &job);
}

void llmem_cpu_matmul_multi(void *ctx, int count, const struct llmem_weight *const *w,
                            const float *x, int64_t n, float *const *y, const float *const *bias) {
    struct cpu_ctx *c = ctx;
    LLMEM_ASSERT(count >= 1 && count <= 4);
    int amx = n > 0;
    for (int i = 0; i < count && amx; i++)
        amx = w[i]->rows > 0 && llmem_cpu_amx_takes(c, w[i]);
    const float *xs[4] = {x, x, x, x};
    const int64_t ns[4] = {n, n, n, n};
    if (amx && count > 1 && llmem_cpu_matmul_amx(c, count, w, xs, ns, y, bias) == LLMEM_OK) {
        for (int i = 0; i < count; i++)
            c->weight_bytes += w[i]->rows * llmem_weight_row_bytes(w[i]);
        return;
    }
    int decode = c->path == CPU_MATMUL_DECODE || (c->path == CPU_MATMUL_AUTO && n < c->gemm_min_n);
    for (int i = 0; i < count && decode; i++)
        decode = w[i]->rows > 0 && w[i]->cols > 0 && n > 0 && w[i]->quant == 0 &&
                 !llmem_cpu_amx_takes(c, w[i]) && kernels_of(c, w[i]) == kernels_of(c, w[0]);
    if (!decode || count == 1) {
        for (int i = 0; i < count; i++)
            llmem_cpu_matmul(ctx, w[i], x, n, y[i], bias != NULL ? bias[i] : NULL);
        return;
    }
    for (int i = 0; i < count; i++)
        c->weight_bytes += w[i]->rows * llmem_weight_row_bytes(w[i]);
    matmul_decode_multi(c, kernels_of(c, w[0]), count, w, xs, ns, y, bias);
}

/* ---- quantized weights (the exact path) -------------------------------------------------------
 *
 * Rows of ggml blocks or MLX groups dequantized exactly to f32, CPU_GEMM_MR at a time into the
 * thread's panel, then the decode kernel over every row of x: the bits f32 weights holding the
 * dequantized values give on any path (the decode and GEMM paths agree bit for bit). */

struct quant_job {
    struct cpu_ctx *c;
    const struct matmul_kernels *k;
    const struct llmem_weight *w;
    const float *x, *bias;
    float *y;
    int64_t n, rows_per_task; /* a multiple of CPU_GEMM_MR */
};

static void quant_task(void *arg, int task, int thread) {
    const struct quant_job *j = arg;
    const struct llmem_weight *w = j->w;
    const int64_t rows = w->rows, cols = w->cols;
    const int64_t ld = (cols + 15) & ~(int64_t)15;
    float *a = j->c->wpanel + (size_t)thread * CPU_GEMM_THREAD_FLOATS;
    int64_t r_begin = (int64_t)task * j->rows_per_task;
    int64_t r_end = r_begin + j->rows_per_task < rows ? r_begin + j->rows_per_task : rows;
    for (int64_t r0 = r_begin; r0 < r_end; r0 += CPU_GEMM_MR) {
        int64_t mr = r_end - r0 < CPU_GEMM_MR ? r_end - r0 : CPU_GEMM_MR;
        for (int64_t i = 0; i < mr; i++) {
            llmem_cpu_dequantize_row(j->c->isa, w, r0 + i, a + i * ld);
            memset(a + i * ld + cols, 0, (size_t)(ld - cols) * sizeof(float));
        }
        j->k->gemv(a, LLMEM_DTYPE_F32, ld, mr, j->x, cols, j->n, j->y + r0, rows,
                   j->bias != NULL ? j->bias + r0 : NULL);
    }
}

static void matmul_quant(struct cpu_ctx *c, const struct matmul_kernels *k,
                         const struct llmem_weight *w, const float *x, int64_t n, float *y,
                         const float *bias) {
    LLMEM_ASSERT(w->cols <= CPU_GEMM_K_MAX);
    int tasks = w->rows * w->cols * n < (int64_t)1 << 16 ? 1 : c->n_threads * 4;
    int64_t per = (w->rows + tasks - 1) / tasks;
    per = (per + CPU_GEMM_MR - 1) / CPU_GEMM_MR * CPU_GEMM_MR;
    struct quant_job job = {c, k, w, x, bias, y, n, per};
    llmem_pool_run(c->pool, (int)((w->rows + per - 1) / per), quant_task, &job);
}

void llmem_cpu_matmul_many(void *ctx, int count, const struct llmem_weight *const *w,
                           const float *const *x, const int64_t *n, float *const *y) {
    struct cpu_ctx *c = ctx;
    LLMEM_ASSERT(count >= 1 && count <= CPU_MATMUL_MANY_MAX);
    int floats = 1, quant = c->precision == LLMEM_PRECISION_FAST, amx = 1;
    for (int i = 0; i < count; i++) {
        amx &= n[i] > 0 && w[i]->rows > 0 && llmem_cpu_amx_takes(c, w[i]);
        floats &= w[i]->quant == 0 && n[i] > 0 && n[i] < c->gemm_min_n && w[i]->rows > 0 &&
                  w[i]->cols > 0 && !llmem_cpu_amx_takes(c, w[i]) &&
                  kernels_of(c, w[i]) == kernels_of(c, w[0]);
        quant &= w[i]->quant != 0 && llmem_cpu_matmul_q_supported(w[i]->quant, w[i]->cols) &&
                 n[i] > 0 && n[i] < c->gemm_min_n;
    }
    if (amx && llmem_cpu_matmul_amx(c, count, w, x, n, y, NULL) == LLMEM_OK) {
        for (int i = 0; i < count; i++)
            c->weight_bytes += w[i]->rows * llmem_weight_row_bytes(w[i]);
        return;
    }
    if (floats && c->path != CPU_MATMUL_GEMM) {
        for (int i = 0; i < count; i++)
            c->weight_bytes += w[i]->rows * llmem_weight_row_bytes(w[i]);
        matmul_decode_multi(c, kernels_of(c, w[0]), count, w, x, n, y, NULL);
        return;
    }
    if (quant && llmem_cpu_matmul_q_many(c, count, w, x, n, y) == LLMEM_OK) {
        for (int i = 0; i < count; i++)
            c->weight_bytes += w[i]->rows * llmem_weight_row_bytes(w[i]);
        return;
    }
    for (int i = 0; i < count; i++) /* (counted there) */
        llmem_cpu_matmul(ctx, w[i], x[i], n[i], y[i], NULL);
}

void llmem_cpu_matmul(void *ctx, const struct llmem_weight *w, const float *x, int64_t n, float *y,
                      const float *bias) {
    struct cpu_ctx *c = ctx;
    LLMEM_ASSERT(w != NULL && x != NULL && y != NULL && n >= 0);
    LLMEM_ASSERT(w->quant != 0 || w->dtype == LLMEM_DTYPE_F32 || w->dtype == LLMEM_DTYPE_F16 ||
                 w->dtype == LLMEM_DTYPE_BF16);
    if (n == 0 || w->rows == 0)
        return;
    c->weight_bytes += w->rows * llmem_weight_row_bytes(w);
    if (w->cols == 0) {
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = 0; r < w->rows; r++)
                y[t * w->rows + r] = bias != NULL ? bias[r] : 0.0f;
        return;
    }
    const struct matmul_kernels *k = &kernels[c->isa];
    if (w->quant != 0) {
        if (c->precision == LLMEM_PRECISION_FAST && llmem_cpu_matmul_q_supported(w->quant, w->cols))
            llmem_cpu_matmul_q(c, w, x, n, y, bias);
        else
            matmul_quant(c, k, w, x, n, y, bias);
        return;
    }
    if (llmem_cpu_amx_takes(c, w)) { /* every row count, the same arithmetic */
        llmem_cpu_matmul_amx(c, 1, &w, &x, &n, &y, &bias);
        return;
    }
    k = kernels_of(c, w);
    enum cpu_matmul_path path = c->path;
    if (path == CPU_MATMUL_AUTO)
        path = n >= c->gemm_min_n ? CPU_MATMUL_GEMM : CPU_MATMUL_DECODE;
    switch (path) {
    case CPU_MATMUL_DECODE: matmul_decode(c, k, w, x, n, y, bias); break;
    default: matmul_gemm(c, k, w, x, n, y, bias);
    }
}
