/*
 * backend/cpu/matmul.c — y[n, rows] = x[n, cols] · Wᵀ (+ bias) for bf16, f16 and f32 weights,
 * f32 activations, f32 accumulation; portable C, AVX2+FMA+F16C and AVX-512, chosen at run time.
 *
 * Two algorithms, by the number n of activation rows:
 *
 * Decode (n small): memory-bound. Each task owns a contiguous range of W rows and streams them
 * once, converting weights to f32 in registers (bf16 by zero-extension and a 16-bit shift, f16 by
 * VCVTPH2PS). For one row of x the rows are read as one sequential stream with a software
 * prefetch 8 KiB ahead; for more, four W rows at a time (two with AVX2) are multiplied with two
 * (four) rows of x at a time, and further rows of x re-read those W rows from L1, not memory.
 *
 * GEMM (n large): compute-bound. The problem is computed transposed, yᵀ = W · xᵀ, so that W never
 * needs a transposed packing: a block of tokens of x is packed once per call and block, by all
 * threads together, as xᵀ strips [k][32 tokens] (zero-padded); then each task owns a range of W
 * rows, converts 12 of them at a time to f32 (one K block, ≤ 4096 columns, into per-thread
 * scratch) and runs the 12 × 32 micro-kernel over every strip: per k, two vector loads of the
 * strip and twelve broadcasts of W, 24 FMAs into 24 accumulators (AVX-512; AVX2 runs it as four
 * 6 × 16 tiles). The conversion of W is amortized over all tokens of a block, the packing of x over
 * all rows of W. The tile is written to y once per K block (transposed, through a small buffer).
 * Columns beyond 4096 are split into equal K blocks, accumulated into y.
 *
 * Numerics: every path computes Σ_k x·w in f32 with FMA from the exact f32 value of each weight
 * (no activation is rounded to bf16), so the paths differ only by the order of the additions:
 * |y − y_exact| ≤ ~cols · 2^-24 · Σ|x·w| in the worst case, far less in practice.
 */
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

/* ---- portable kernels -------------------------------------------------------------------------
 */

static ALWAYS_INLINE float weight_at(const void *row, enum llmem_dtype dt, int64_t k) {
    switch (dt) {
    case LLMEM_DTYPE_BF16: return cpu_bf16_to_f32(((const uint16_t *)row)[k]);
    case LLMEM_DTYPE_F16: return cpu_f16_to_f32(((const uint16_t *)row)[k]);
    default: return ((const float *)row)[k];
    }
}

static const void *row_ptr(const struct llmem_weight *w, int64_t r) {
    return (const uint8_t *)w->data +
           (size_t)r * (size_t)w->cols * (size_t)llmem_dtype_size(w->dtype);
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

/* One W row against up to 8 rows of x: 8 partial sums per x row keep the adds independent. */
static void gemv_scalar(const struct llmem_weight *w, const float *x, int64_t n, float *y,
                        const float *bias, int64_t r0, int64_t r1) {
    const int64_t cols = w->cols, rows = w->rows;
    for (int64_t r = r0; r < r1; r++) {
        const void *wr = row_ptr(w, r);
        for (int64_t j0 = 0; j0 < n; j0 += 4) {
            int nx = n - j0 < 4 ? (int)(n - j0) : 4;
            float s[4][8] = {{0}};
            int64_t k = 0;
            for (; k + 8 <= cols; k += 8)
                for (int i = 0; i < 8; i++) {
                    float wv = weight_at(wr, w->dtype, k + i);
                    for (int j = 0; j < nx; j++)
                        s[j][i] += wv * x[(j0 + j) * cols + k + i];
                }
            for (; k < cols; k++) {
                float wv = weight_at(wr, w->dtype, k);
                for (int j = 0; j < nx; j++)
                    s[j][k & 7] += wv * x[(j0 + j) * cols + k];
            }
            for (int j = 0; j < nx; j++) {
                float t = ((s[j][0] + s[j][1]) + (s[j][2] + s[j][3])) +
                          ((s[j][4] + s[j][5]) + (s[j][6] + s[j][7]));
                y[(j0 + j) * rows + r] = t + (bias != NULL ? bias[r] : 0.0f);
            }
        }
    }
}

/* The micro-kernel's contract (every ISA): acc[i][t] = Σ_k a[k·12 + i] · b[k·32 + t] for
 * i < 12, t < 32, written to tile[i·32 + t]. */
static void micro_scalar(const float *a, const float *b, int64_t kc, float *tile) {
    for (int i = 0; i < CPU_GEMM_MR; i++) {
        float acc[CPU_GEMM_NR] = {0};
        for (int64_t k = 0; k < kc; k++) {
            float av = a[k * CPU_GEMM_MR + i];
            for (int t = 0; t < CPU_GEMM_NR; t++)
                acc[t] += av * b[k * CPU_GEMM_NR + t];
        }
        memcpy(tile + i * CPU_GEMM_NR, acc, sizeof(acc));
    }
}

/* ---- AVX2 + FMA + F16C ------------------------------------------------------------------------
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

TARGET_AVX2 static ALWAYS_INLINE float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* R W rows (R ≤ 2) × NX x rows (NX ≤ 4): 8 accumulators at most, with 16 registers. */
TARGET_AVX2 static ALWAYS_INLINE void gemv_tile_avx2(const struct llmem_weight *w,
                                                     enum llmem_dtype dt, const float *x, int64_t r,
                                                     int64_t j0, float *y, const float *bias,
                                                     const int R, const int NX) {
    const int64_t cols = w->cols, rows = w->rows;
    const void *wr[2] = {row_ptr(w, r), R > 1 ? row_ptr(w, r + 1) : NULL};
    const char *pf[2]; /* the rows after these (see gemv_tile_avx512) */
    const size_t esize = dt == LLMEM_DTYPE_F32 ? 4 : 2;
    for (int i = 0; i < R; i++)
        pf[i] = r + R + i < rows ? (const char *)row_ptr(w, r + R + i) : (const char *)wr[i];
    __m256 acc[2][4];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NX; j++)
            acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= cols; k += 8) {
        __m256 xv[4];
        for (int j = 0; j < NX; j++)
            xv[j] = _mm256_loadu_ps(x + (j0 + j) * cols + k);
        for (int i = 0; i < R; i++) {
            if ((k & 15) == 0)
                _mm_prefetch(pf[i] + (size_t)k * esize, _MM_HINT_T0);
            __m256 wv = load8_avx2(wr[i], dt, k);
            for (int j = 0; j < NX; j++)
                acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NX; j++) {
            float s = hsum_avx2(acc[i][j]);
            for (int64_t kk = k; kk < cols; kk++)
                s += weight_at(wr[i], dt, kk) * x[(j0 + j) * cols + kk];
            y[(j0 + j) * rows + r + i] = s + (bias != NULL ? bias[r + i] : 0.0f);
        }
}

TARGET_AVX2 static void gemv_avx2_dt(const struct llmem_weight *w, enum llmem_dtype dt,
                                     const float *x, int64_t n, float *y, const float *bias,
                                     int64_t r0, int64_t r1) {
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2)
        for (int64_t j0 = 0; j0 < n; j0 += 4) {
            switch (n - j0 < 4 ? n - j0 : 4) {
            case 1: gemv_tile_avx2(w, dt, x, r, j0, y, bias, 2, 1); break;
            case 2: gemv_tile_avx2(w, dt, x, r, j0, y, bias, 2, 2); break;
            case 3: gemv_tile_avx2(w, dt, x, r, j0, y, bias, 2, 3); break;
            default: gemv_tile_avx2(w, dt, x, r, j0, y, bias, 2, 4);
            }
        }
    for (; r < r1; r++)
        for (int64_t j0 = 0; j0 < n; j0 += 4) {
            switch (n - j0 < 4 ? n - j0 : 4) {
            case 1: gemv_tile_avx2(w, dt, x, r, j0, y, bias, 1, 1); break;
            case 2: gemv_tile_avx2(w, dt, x, r, j0, y, bias, 1, 2); break;
            case 3: gemv_tile_avx2(w, dt, x, r, j0, y, bias, 1, 3); break;
            default: gemv_tile_avx2(w, dt, x, r, j0, y, bias, 1, 4);
            }
        }
}

TARGET_AVX2 static void gemv_avx2(const struct llmem_weight *w, const float *x, int64_t n, float *y,
                                  const float *bias, int64_t r0, int64_t r1) {
    switch (w->dtype) {
    case LLMEM_DTYPE_BF16: gemv_avx2_dt(w, LLMEM_DTYPE_BF16, x, n, y, bias, r0, r1); break;
    case LLMEM_DTYPE_F16: gemv_avx2_dt(w, LLMEM_DTYPE_F16, x, n, y, bias, r0, r1); break;
    default: gemv_avx2_dt(w, LLMEM_DTYPE_F32, x, n, y, bias, r0, r1);
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

/* 6 W rows × 16 tokens: 12 accumulators; the 12 × 32 tile is four of these. */
TARGET_AVX2 static ALWAYS_INLINE void micro6x16_avx2(const float *a, const float *b, int64_t kc,
                                                     float *tile) {
    __m256 acc[6][2];
    for (int i = 0; i < 6; i++)
        acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        __m256 b0 = _mm256_loadu_ps(b + k * CPU_GEMM_NR),
               b1 = _mm256_loadu_ps(b + k * CPU_GEMM_NR + 8);
        for (int i = 0; i < 6; i++) {
            __m256 av = _mm256_broadcast_ss(a + k * CPU_GEMM_MR + i);
            acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < 6; i++) {
        _mm256_storeu_ps(tile + i * CPU_GEMM_NR, acc[i][0]);
        _mm256_storeu_ps(tile + i * CPU_GEMM_NR + 8, acc[i][1]);
    }
}

TARGET_AVX2 static void micro_avx2(const float *a, const float *b, int64_t kc, float *tile) {
    micro6x16_avx2(a, b, kc, tile);
    micro6x16_avx2(a, b + 16, kc, tile + 16);
    micro6x16_avx2(a + 6, b, kc, tile + 6 * CPU_GEMM_NR);
    micro6x16_avx2(a + 6, b + 16, kc, tile + 6 * CPU_GEMM_NR + 16);
}

/* ---- AVX-512 ----------------------------------------------------------------------------------
 */

#define TARGET_AVX512 __attribute__((target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl")))

/* 16 weights from k as f32; lanes at or beyond `left` (when < 16) read as zero. */
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

/* R W rows × NX x rows (R, NX ≤ 4; called with R · NX ≤ 8). */
TARGET_AVX512 static ALWAYS_INLINE void
gemv_tile_avx512(const struct llmem_weight *w, enum llmem_dtype dt, const float *x, int64_t r,
                 int64_t j0, float *y, const float *bias, const int R, const int NX) {
    const int64_t cols = w->cols, rows = w->rows;
    const void *wr[4];
    const char *pf[4]; /* the rows after these: prefetched, since rows of a few KiB are too
                          short for the hardware prefetchers, which stop at page boundaries */
    const size_t esize = dt == LLMEM_DTYPE_F32 ? 4 : 2;
    for (int i = 0; i < R; i++) {
        wr[i] = row_ptr(w, r + i);
        pf[i] = r + R + i < rows ? (const char *)row_ptr(w, r + R + i) : (const char *)wr[i];
    }
    __m512 acc[4][4];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NX; j++)
            acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= cols; k += 16) {
        __m512 xv[4];
        for (int j = 0; j < NX; j++)
            xv[j] = _mm512_loadu_ps(x + (j0 + j) * cols + k);
        for (int i = 0; i < R; i++) {
            _mm_prefetch(pf[i] + (size_t)k * esize, _MM_HINT_T0);
            __m512 wv = load16_avx512(wr[i], dt, k, 0xffff);
            for (int j = 0; j < NX; j++)
                acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    if (k < cols) {
        __mmask16 m = (__mmask16)((1u << (cols - k)) - 1);
        __m512 xv[4];
        for (int j = 0; j < NX; j++)
            xv[j] = _mm512_maskz_loadu_ps(m, x + (j0 + j) * cols + k);
        for (int i = 0; i < R; i++) {
            __m512 wv = load16_avx512(wr[i], dt, k, m);
            for (int j = 0; j < NX; j++)
                acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NX; j++)
            y[(j0 + j) * rows + r + i] =
                _mm512_reduce_add_ps(acc[i][j]) + (bias != NULL ? bias[r + i] : 0.0f);
}

/* One row of x (single-sequence decode): the task's rows read as one sequential stream, as the
 * bandwidth probe reads, four accumulators along k, and a software prefetch DECODE_PF_BYTES
 * ahead that crosses page and row boundaries (where the hardware prefetchers stop). Measured on
 * the development machine: 0.90–0.92 of the probed read bandwidth against 0.80–0.83 for the
 * four-row tiles, which read four interleaved streams. */
#define DECODE_PF_BYTES 8192

TARGET_AVX512 static ALWAYS_INLINE void gemv1_avx512(const struct llmem_weight *w,
                                                     enum llmem_dtype dt, const float *x, float *y,
                                                     const float *bias, int64_t r0, int64_t r1) {
    const int64_t cols = w->cols;
    const size_t esize = dt == LLMEM_DTYPE_F32 ? 4 : 2;
    for (int64_t r = r0; r < r1; r++) {
        const char *wr = row_ptr(w, r);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t k = 0;
        for (; k + 64 <= cols; k += 64) {
            const char *pf = wr + (size_t)k * esize + DECODE_PF_BYTES;
            _mm_prefetch(pf, _MM_HINT_T0);
            _mm_prefetch(pf + 64, _MM_HINT_T0);
            if (esize == 4) {
                _mm_prefetch(pf + 128, _MM_HINT_T0);
                _mm_prefetch(pf + 192, _MM_HINT_T0);
            }
            a0 = _mm512_fmadd_ps(load16_avx512(wr, dt, k, 0xffff), _mm512_loadu_ps(x + k), a0);
            a1 = _mm512_fmadd_ps(load16_avx512(wr, dt, k + 16, 0xffff), _mm512_loadu_ps(x + k + 16),
                                 a1);
            a2 = _mm512_fmadd_ps(load16_avx512(wr, dt, k + 32, 0xffff), _mm512_loadu_ps(x + k + 32),
                                 a2);
            a3 = _mm512_fmadd_ps(load16_avx512(wr, dt, k + 48, 0xffff), _mm512_loadu_ps(x + k + 48),
                                 a3);
        }
        for (; k < cols; k += 16) {
            __mmask16 m = cols - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (cols - k)) - 1);
            a0 = _mm512_fmadd_ps(load16_avx512(wr, dt, k, m), _mm512_maskz_loadu_ps(m, x + k), a0);
        }
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) +
               (bias != NULL ? bias[r] : 0.0f);
    }
}

TARGET_AVX512 static void gemv_avx512_dt(const struct llmem_weight *w, enum llmem_dtype dt,
                                         const float *x, int64_t n, float *y, const float *bias,
                                         int64_t r0, int64_t r1) {
    if (n == 1) {
        gemv1_avx512(w, dt, x, y, bias, r0, r1);
        return;
    }
    int64_t r = r0;
    /* Two rows of x at a time: with four (16 accumulators) GCC keeps the accumulator array in
     * memory, which made n = 4 a third slower than two passes of two. */
    for (; r + 4 <= r1; r += 4)
        for (int64_t j0 = 0; j0 < n; j0 += 2) {
            if (n - j0 == 1)
                gemv_tile_avx512(w, dt, x, r, j0, y, bias, 4, 1);
            else
                gemv_tile_avx512(w, dt, x, r, j0, y, bias, 4, 2);
        }
    for (; r < r1; r++)
        for (int64_t j0 = 0; j0 < n; j0 += 4) {
            switch (n - j0 < 4 ? n - j0 : 4) {
            case 1: gemv_tile_avx512(w, dt, x, r, j0, y, bias, 1, 1); break;
            case 2: gemv_tile_avx512(w, dt, x, r, j0, y, bias, 1, 2); break;
            case 3: gemv_tile_avx512(w, dt, x, r, j0, y, bias, 1, 3); break;
            default: gemv_tile_avx512(w, dt, x, r, j0, y, bias, 1, 4);
            }
        }
}

TARGET_AVX512 static void gemv_avx512(const struct llmem_weight *w, const float *x, int64_t n,
                                      float *y, const float *bias, int64_t r0, int64_t r1) {
    switch (w->dtype) {
    case LLMEM_DTYPE_BF16: gemv_avx512_dt(w, LLMEM_DTYPE_BF16, x, n, y, bias, r0, r1); break;
    case LLMEM_DTYPE_F16: gemv_avx512_dt(w, LLMEM_DTYPE_F16, x, n, y, bias, r0, r1); break;
    default: gemv_avx512_dt(w, LLMEM_DTYPE_F32, x, n, y, bias, r0, r1);
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

TARGET_AVX512 static void micro_avx512(const float *a, const float *b, int64_t kc, float *tile) {
    __m512 acc[CPU_GEMM_MR][2];
    for (int i = 0; i < CPU_GEMM_MR; i++)
        acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        __m512 b0 = _mm512_loadu_ps(b + k * CPU_GEMM_NR);
        __m512 b1 = _mm512_loadu_ps(b + k * CPU_GEMM_NR + 16);
        for (int i = 0; i < CPU_GEMM_MR; i++) {
            __m512 av = _mm512_set1_ps(a[k * CPU_GEMM_MR + i]);
            acc[i][0] = _mm512_fmadd_ps(av, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(av, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < CPU_GEMM_MR; i++) {
        _mm512_storeu_ps(tile + i * CPU_GEMM_NR, acc[i][0]);
        _mm512_storeu_ps(tile + i * CPU_GEMM_NR + 16, acc[i][1]);
    }
}
#endif /* CPU_X86 */

/* ---- the kernel tables ------------------------------------------------------------------------
 */

struct matmul_kernels {
    void (*gemv)(const struct llmem_weight *w, const float *x, int64_t n, float *y,
                 const float *bias, int64_t r0, int64_t r1);
    void (*convert)(const void *row, enum llmem_dtype dt, int64_t count, float *dst);
    void (*micro)(const float *a, const float *b, int64_t kc, float *tile);
};

static const struct matmul_kernels kernels[3] = {
    [CPU_ISA_SCALAR] = {gemv_scalar, convert_scalar, micro_scalar},
#if CPU_X86
    [CPU_ISA_AVX2] = {gemv_avx2, convert_avx2, micro_avx2},
    [CPU_ISA_AVX512] = {gemv_avx512, convert_avx512, micro_avx512},
#else
    [CPU_ISA_AVX2] = {gemv_scalar, convert_scalar, micro_scalar},
    [CPU_ISA_AVX512] = {gemv_scalar, convert_scalar, micro_scalar},
#endif
};

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
        j->k->gemv(j->w, j->x, j->n, j->y, j->bias, r0, r1);
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
 */

struct gemm_job {
    struct cpu_ctx *c;
    const struct matmul_kernels *k;
    const struct llmem_weight *w;
    const float *x, *bias;
    float *y;
    int64_t p0, kc;        /* this K block: columns [p0, p0 + kc) */
    int64_t j0, nb;        /* this token block: rows [j0, j0 + nb) of x and y */
    int64_t n_strips;      /* ceil(nb / 32) */
    int64_t rows_per_task; /* a multiple of CPU_GEMM_MR */
};

/* Packs strip `task` of the token block as xt[s][k][32] (tokens past the block are zero). */
static void pack_task(void *arg, int task, int thread) {
    (void)thread;
    const struct gemm_job *j = arg;
    const int64_t cols = j->w->cols, kc = j->kc;
    float *dst = j->c->xt + (size_t)task * (size_t)kc * CPU_GEMM_NR;
    int64_t t0 = j->j0 + (int64_t)task * CPU_GEMM_NR;
    int64_t nt = j->j0 + j->nb - t0 < CPU_GEMM_NR ? j->j0 + j->nb - t0 : CPU_GEMM_NR;
    if (nt < CPU_GEMM_NR)
        memset(dst, 0, (size_t)kc * CPU_GEMM_NR * sizeof(float));
    /* 8 tokens × 8 columns at a time: reads and writes stay within a few cache lines. */
    for (int64_t k0 = 0; k0 < kc; k0 += 8) {
        int64_t k1 = k0 + 8 < kc ? k0 + 8 : kc;
        for (int64_t t = 0; t < nt; t++) {
            const float *src = j->x + (t0 + t) * cols + j->p0;
            for (int64_t k = k0; k < k1; k++)
                dst[k * CPU_GEMM_NR + t] = src[k];
        }
    }
}

static void gemm_task(void *arg, int task, int thread) {
    const struct gemm_job *j = arg;
    const struct llmem_weight *w = j->w;
    const int64_t rows = w->rows, kc = j->kc;
    /* Per thread: 12 converted rows, kc + 16 floats apart (at a multiple of 4 KiB all 12 would
     * share one set of the L1 cache), then the same interleaved as [k][12] for the kernel. */
    float *rowbuf =
        j->c->wpanel + (size_t)thread * CPU_GEMM_MR * (CPU_GEMM_LDA_MAX + CPU_GEMM_KC_MAX);
    float *a = rowbuf + (size_t)CPU_GEMM_MR * CPU_GEMM_LDA_MAX;
    const int64_t lda = kc + 16;
    float tile[CPU_GEMM_MR * CPU_GEMM_NR] __attribute__((aligned(64)));
    int64_t r_begin = (int64_t)task * j->rows_per_task;
    int64_t r_end = r_begin + j->rows_per_task < rows ? r_begin + j->rows_per_task : rows;
    size_t esize = (size_t)llmem_dtype_size(w->dtype);
    for (int64_t r0 = r_begin; r0 < r_end; r0 += CPU_GEMM_MR) {
        int mr = r_end - r0 < CPU_GEMM_MR ? (int)(r_end - r0) : CPU_GEMM_MR;
        for (int i = 0; i < mr; i++)
            j->k->convert((const uint8_t *)row_ptr(w, r0 + i) + (size_t)j->p0 * esize, w->dtype, kc,
                          rowbuf + (size_t)i * (size_t)lda);
        for (int i = mr; i < CPU_GEMM_MR; i++)
            memset(rowbuf + (size_t)i * (size_t)lda, 0, (size_t)kc * sizeof(float));
        for (int64_t k = 0; k < kc; k++)
            for (int i = 0; i < CPU_GEMM_MR; i++)
                a[k * CPU_GEMM_MR + i] = rowbuf[i * lda + k];
        for (int64_t s = 0; s < j->n_strips; s++) {
            j->k->micro(a, j->c->xt + (size_t)s * (size_t)kc * CPU_GEMM_NR, kc, tile);
            int64_t t0 = j->j0 + s * CPU_GEMM_NR;
            int nt = j->j0 + j->nb - t0 < CPU_GEMM_NR ? (int)(j->j0 + j->nb - t0) : CPU_GEMM_NR;
            for (int t = 0; t < nt; t++) {
                float *yr = j->y + (t0 + t) * rows + r0;
                if (j->p0 > 0)
                    for (int i = 0; i < mr; i++)
                        yr[i] += tile[i * CPU_GEMM_NR + t];
                else if (j->bias != NULL)
                    for (int i = 0; i < mr; i++)
                        yr[i] = tile[i * CPU_GEMM_NR + t] + j->bias[r0 + i];
                else
                    for (int i = 0; i < mr; i++)
                        yr[i] = tile[i * CPU_GEMM_NR + t];
            }
        }
    }
}

static void matmul_gemm(struct cpu_ctx *c, const struct matmul_kernels *k,
                        const struct llmem_weight *w, const float *x, int64_t n, float *y,
                        const float *bias) {
    const int64_t cols = w->cols, rows = w->rows;
    int64_t n_kblocks = (cols + CPU_GEMM_KC_MAX - 1) / CPU_GEMM_KC_MAX;
    int64_t kc_step = (cols + n_kblocks - 1) / n_kblocks;
    kc_step = (kc_step + 15) & ~(int64_t)15;
    /* Tasks: a few contiguous ranges of W rows per thread, each a multiple of the tile height. */
    int tasks = c->n_threads * 4;
    int64_t per = (rows + tasks - 1) / tasks;
    per = (per + CPU_GEMM_MR - 1) / CPU_GEMM_MR * CPU_GEMM_MR;
    int n_tasks = (int)((rows + per - 1) / per);
    for (int64_t p0 = 0; p0 < cols; p0 += kc_step) {
        int64_t kc = cols - p0 < kc_step ? cols - p0 : kc_step;
        int64_t max_strips = (int64_t)(CPU_GEMM_XT_BYTES / sizeof(float)) / (kc * CPU_GEMM_NR);
        int64_t nb_max = max_strips * CPU_GEMM_NR;
        for (int64_t j0 = 0; j0 < n; j0 += nb_max) {
            struct gemm_job job = {c, k, w, x, bias, y, p0, kc, j0, 0, 0, per};
            job.nb = n - j0 < nb_max ? n - j0 : nb_max;
            job.n_strips = (job.nb + CPU_GEMM_NR - 1) / CPU_GEMM_NR;
            llmem_pool_run(c->pool, (int)job.n_strips, pack_task, &job);
            llmem_pool_run(c->pool, n_tasks, gemm_task, &job);
        }
    }
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
