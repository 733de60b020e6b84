/*
 * quant/quantize.c — f32 rows into the blocks of ggml's types (quant/quant.h): the reference
 * quantizers `llmem quantize` writes with and the tests' source of blocks.
 *
 * Each block is what ggml's quantize_row_*_ref (ggml/src/ggml-quants.c) writes, byte for byte:
 * the same search for scales (make_qx_quants, make_q3_quants, make_qkx2_quants below, without an
 * importance matrix), the same float operations in the same order, the same rounding
 * (nearest_int's magic-number trick, roundf, truncation after adding 0.5), the scales rounded to
 * f16 by ggml's GGML_FP32_TO_FP16 and read back before the final quants are chosen. This file is
 * compiled with -ffp-contract=off (CMakeLists.txt): a fused multiply-add would round once where
 * ggml rounds twice.
 *
 * Where ggml converts a float to an integer type that C leaves undefined — an infinite or NaN
 * quotient, as in a block of f32 denormals whose 1/d overflows — x86-64 decides: cvttss2si gives
 * INT32_MIN, whose low byte is 0. f32_to_i32 spells that out, so these inputs give ggml's bytes on
 * x86-64 without undefined behaviour here (ggml on another architecture may differ on them).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "llmem/status.h"
#include "quant/quant.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "GGUF blocks are little-endian; big-endian hosts are not supported"
#endif

#define QK            LLMEM_QK_K
#define GROUP_MAX_EPS 1e-15f /* ggml's: a group below this is all zero */

static inline int imin(int a, int b) {
    return a < b ? a : b;
}

static inline int imax(int a, int b) {
    return a > b ? a : b;
}

/* ---- conversions -------------------------------------------------------------------------- */

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

/* ggml_compute_fp32_to_fp16: |x| scaled up by 2^112 and down by 2^-110 lets the FPU round the
 * mantissa (to nearest even, overflow to infinity); adding a power of two that puts the value's
 * last kept bit at the unit of the f32 (its exponent clamped to the smallest normal half's)
 * rounds away the bits a half drops. Any NaN becomes 0x7e00 with its sign. */
uint16_t llmem_quant_f32_to_f16(float x) {
    float base = (fabsf(x) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(x);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    if (bias < 0x71000000u)
        bias = 0x71000000u;
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007c00u;
    const uint32_t mantissa_bits = bits & 0x00000fffu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

/* ggml_compute_fp32_to_bf16: round the low 16 bits to even; a NaN is made quiet. */
uint16_t llmem_quant_f32_to_bf16(float x) {
    const uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 64u);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

/* ggml's nearest_int: the float added to 1.5 × 2^23 holds the rounded integer (to even) in its
 * low mantissa bits. Defined for every float; meaningful for |x| ≤ 2^22 − 1. */
static inline int nearest_int(float x) {
    const float v = x + 12582912.f;
    int32_t i;
    memcpy(&i, &v, sizeof(i));
    return (i & 0x007fffff) - 0x00400000;
}

/* A float truncated to int32 as x86-64's cvttss2si does: INT32_MIN for NaN and out of range. */
static inline int32_t f32_to_i32(float x) {
    if (x >= -2147483648.0f && x < 2147483648.0f)
        return (int32_t)x;
    return INT32_MIN;
}

/* (int8_t)x and (uint8_t)x as ggml's C compiles on x86-64: the low byte of the int32. */
static inline int8_t f32_to_i8(float x) {
    return (int8_t)(uint8_t)((uint32_t)f32_to_i32(x) & 0xffu);
}

static inline uint8_t f32_to_u8(float x) {
    return (uint8_t)((uint32_t)f32_to_i32(x) & 0xffu);
}

/* ---- writing blocks ----------------------------------------------------------------------- */

static inline void put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v & 0xffu);
    p[1] = (uint8_t)(v >> 8);
}

static inline void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline void put_f16(uint8_t *p, float x) {
    put_u16(p, llmem_quant_f32_to_f16(x));
}

static inline float f16_at(const uint8_t *p) {
    return llmem_quant_f16_to_f32((uint16_t)(p[0] | (p[1] << 8)));
}

/* ---- 32-value blocks ---------------------------------------------------------------------- */

/* The value of largest magnitude, the first of them (ggml's strict comparison). */
static float signed_absmax(const float *x, int n) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    return max;
}

static void min_max(const float *x, int n, float *min, float *max) {
    *min = FLT_MAX;
    *max = -FLT_MAX;
    for (int j = 0; j < n; j++) {
        if (x[j] < *min)
            *min = x[j];
        if (x[j] > *max)
            *max = x[j];
    }
}

/* Q4_0: d = max / −8 (max: the signed value of largest magnitude), q = trunc(x / d + 8.5) ≤ 15. */
static void block_q4_0(const float *x, uint8_t *b) {
    const float d = signed_absmax(x, 32) / -8;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(b, d);
    for (int j = 0; j < 16; j++) {
        const uint8_t q0 = (uint8_t)imin(15, f32_to_i8(x[j] * id + 8.5f));
        const uint8_t q1 = (uint8_t)imin(15, f32_to_i8(x[j + 16] * id + 8.5f));
        b[2 + j] = (uint8_t)(q0 | (q1 << 4));
    }
}

/* Q4_1: d = (max − min) / 15, m = min, q = trunc((x − min) / d + 0.5) ≤ 15. */
static void block_q4_1(const float *x, uint8_t *b) {
    float min, max;
    min_max(x, 32, &min, &max);
    const float d = (max - min) / 15;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(b, d);
    put_f16(b + 2, min);
    for (int j = 0; j < 16; j++) {
        const uint8_t q0 = (uint8_t)imin(15, f32_to_i8((x[j] - min) * id + 0.5f));
        const uint8_t q1 = (uint8_t)imin(15, f32_to_i8((x[j + 16] - min) * id + 0.5f));
        b[4 + j] = (uint8_t)(q0 | (q1 << 4));
    }
}

/* Q5_0: d = max / −16, q = trunc(x / d + 16.5) ≤ 31, the fifth bits gathered in a u32. */
static void block_q5_0(const float *x, uint8_t *b) {
    const float d = signed_absmax(x, 32) / -16;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(b, d);
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        const uint8_t q0 = (uint8_t)imin(31, f32_to_i8(x[j] * id + 16.5f));
        const uint8_t q1 = (uint8_t)imin(31, f32_to_i8(x[j + 16] * id + 16.5f));
        b[6 + j] = (uint8_t)((q0 & 0x0f) | ((q1 & 0x0f) << 4));
        qh |= ((q0 & 0x10u) >> 4) << j;
        qh |= ((q1 & 0x10u) >> 4) << (j + 16);
    }
    put_u32(b + 2, qh);
}

/* Q5_1: d = (max − min) / 31, m = min, q = trunc((x − min) / d + 0.5). */
static void block_q5_1(const float *x, uint8_t *b) {
    float min, max;
    min_max(x, 32, &min, &max);
    const float d = (max - min) / 31;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(b, d);
    put_f16(b + 2, min);
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        const uint8_t q0 = f32_to_u8((x[j] - min) * id + 0.5f);
        const uint8_t q1 = f32_to_u8((x[j + 16] - min) * id + 0.5f);
        b[8 + j] = (uint8_t)((q0 & 0x0f) | ((q1 & 0x0f) << 4));
        qh |= ((q0 & 0x10u) >> 4) << j;
        qh |= ((q1 & 0x10u) >> 4) << (j + 16);
    }
    put_u32(b + 4, qh);
}

/* Q8_0: d = amax / 127, q = roundf(x × (1/d)) with 1/d computed in float. */
static void block_q8_0(const float *x, uint8_t *b) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++)
        amax = amax > fabsf(x[j]) ? amax : fabsf(x[j]); /* ggml's MAX(amax, |x|) */
    const float d = amax / 127;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(b, d);
    for (int j = 0; j < 32; j++)
        b[2 + j] = (uint8_t)f32_to_i8(roundf(x[j] * id));
}

/* ---- the scale searches of the K types ---------------------------------------------------- */

/* make_qx_quants with rmse_type 1 and no importance (weights x²): symmetric quants in
 * [−nmax, nmax) stored +nmax in L; the scale is the weighted least-squares fit of the best of
 * 19 trial inverse scales −(nmax + 0.1 k) / max. */
static float make_qx_quants(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        const float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    if (amax < GROUP_MAX_EPS) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float iscale = (float)-nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = nearest_int(iscale * x[i]);
        l = imax(-nmax, imin(nmax - 1, l));
        L[i] = (int8_t)(l + nmax);
        const float w = x[i] * x[i];
        sumlx += w * x[i] * (float)l;
        suml2 += w * (float)l * (float)l;
    }
    float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0)
            continue;
        iscale = -((float)nmax + 0.1f * (float)is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            int l = nearest_int(iscale * x[i]);
            l = imax(-nmax, imin(nmax - 1, l));
            const float w = x[i] * x[i];
            sumlx += w * x[i] * (float)l;
            suml2 += w * (float)l * (float)l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++) {
                const int l = nearest_int(iscale * x[i]);
                L[i] = (int8_t)(nmax + imax(-nmax, imin(nmax - 1, l)));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* make_q3_quants with do_rmse: quants in [−nmax, nmax) from −nmax / max, then up to five passes
 * that move one quant at a time when that improves the x²-weighted fit; stored +nmax in L. */
static float make_q3_quants(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        const float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    if (amax < GROUP_MAX_EPS) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    const float iscale = (float)-nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = nearest_int(iscale * x[i]);
        l = imax(-nmax, imin(nmax - 1, l));
        L[i] = (int8_t)l;
        const float w = x[i] * x[i];
        sumlx += w * x[i] * (float)l;
        suml2 += w * (float)l * (float)l;
    }
    for (int itry = 0; itry < 5; itry++) {
        int n_changed = 0;
        for (int i = 0; i < n; i++) {
            const float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * (float)L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * (float)L[i] * (float)L[i];
                int new_l = nearest_int(x[i] * sl2 / slx);
                new_l = imax(-nmax, imin(nmax - 1, new_l));
                if (new_l != L[i]) {
                    slx += w * x[i] * (float)new_l;
                    sl2 += w * (float)new_l * (float)new_l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed++;
                    }
                }
            }
        }
        if (!n_changed)
            break;
    }
    for (int i = 0; i < n; i++)
        L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* make_qkx2_quants: quants in [0, nmax] of x − min (min ≤ 0), the scale and min refit by weighted
 * least squares for nstep + 1 trial inverse scales (rmin + rdelta·k + nmax) / (max − min), the one
 * of least weighted error (|·| with use_mad, else squared) kept. Returns the scale, −min in
 * *the_min. */
static float make_qkx2_quants(int n, int nmax, const float *x, const float *weights, uint8_t *L,
                              float *the_min, uint8_t *Laux, float rmin, float rdelta, int nstep,
                              int use_mad) {
    float min = x[0], max = x[0];
    float sum_w = weights[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min)
            min = x[i];
        if (x[i] > max)
            max = x[i];
        const float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0)
        min = 0;
    if (max == min) {
        memset(L, 0, (size_t)n);
        *the_min = -min;
        return 0.f;
    }
    float iscale = (float)nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; i++) {
        const int l = nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)imax(0, imin(nmax, l));
        float diff = scale * (float)L[i] + min - x[i];
        diff = use_mad ? fabsf(diff) : diff * diff;
        best_error += weights[i] * diff;
    }
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * (float)is + (float)nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = nearest_int(iscale * (x[i] - min));
            l = imax(0, imin(nmax, l));
            Laux[i] = (uint8_t)l;
            const float w = weights[i];
            sum_l += w * (float)l;
            sum_l2 += w * (float)l * (float)l;
            sum_xl += w * (float)l * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * (float)Laux[i] + this_min - x[i];
                diff = use_mad ? fabsf(diff) : diff * diff;
                cur_error += weights[i] * diff;
            }
            if (cur_error < best_error) {
                memcpy(L, Laux, (size_t)n);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

/* Four 32-value groups of 2-bit quants packed a byte each, shifted 0/2/4/6 (Q2_K, Q3_K). */
static void pack_2bit(const uint8_t *L, uint8_t *qs) {
    for (int j = 0; j < QK; j += 128)
        for (int l = 0; l < 32; l++)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) |
                                      (L[j + l + 96] << 6));
}

/* ---- 256-value super-blocks --------------------------------------------------------------- */

/* Q2_K (block: scales[16] qs[64] d dmin): each 16 values fit by make_qkx2_quants (3, weights
 * |x|, MAD); their scales and mins as 4-bit multiples of d = max scale / 15 and dmin = max min /
 * 15; the quants chosen again against the rounded scales. */
static void block_q2_k(const float *x, uint8_t *b) {
    uint8_t L[QK], Laux[16];
    float weights[16], mins[QK / 16], scales[QK / 16];
    uint8_t *sc = b, *qs = b + 16;
    const float q4scale = 15.f;
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < QK / 16; j++) {
        for (int l = 0; l < 16; l++)
            weights[l] = fabsf(x[16 * j + l]);
        scales[j] = make_qkx2_quants(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux, -0.5f,
                                     0.1f, 15, 1);
        if (scales[j] > max_scale)
            max_scale = scales[j];
        if (mins[j] > max_min)
            max_min = mins[j];
    }
    if (max_scale > 0) {
        const float iscale = q4scale / max_scale;
        for (int j = 0; j < QK / 16; j++)
            sc[j] = (uint8_t)nearest_int(iscale * scales[j]);
        put_f16(b + 80, max_scale / q4scale);
    } else {
        memset(sc, 0, QK / 16);
        put_f16(b + 80, 0.f);
    }
    if (max_min > 0) {
        const float iscale = q4scale / max_min;
        for (int j = 0; j < QK / 16; j++)
            sc[j] = (uint8_t)(sc[j] | ((unsigned)nearest_int(iscale * mins[j]) << 4));
        put_f16(b + 82, max_min / q4scale);
    } else {
        put_f16(b + 82, 0.f);
    }
    const float d_all = f16_at(b + 80), dmin_all = f16_at(b + 82);
    for (int j = 0; j < QK / 16; j++) {
        const float d = d_all * (float)(sc[j] & 0xf);
        if (d == 0.0f)
            continue;
        const float dm = dmin_all * (float)(sc[j] >> 4);
        for (int ii = 0; ii < 16; ii++) {
            const int l = nearest_int((x[16 * j + ii] + dm) / d);
            L[16 * j + ii] = (uint8_t)imax(0, imin(3, l));
        }
    }
    pack_2bit(L, qs);
}

/* Q3_K (block: hmask[32] qs[64] scales[12] d): each 16 values fit by make_q3_quants (4); their
 * scales as 6-bit signed multiples of d = max scale / −32 (the signed one of largest
 * magnitude); quants in [−4, 4) chosen again, the bit of 4 in hmask, the rest as Q2_K's. */
static void block_q3_k(const float *x, uint8_t *b) {
    int8_t L[QK];
    float scales[QK / 16];
    uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    float max_scale = 0, amax = 0;
    for (int j = 0; j < QK / 16; j++) {
        scales[j] = make_q3_quants(16, 4, x + 16 * j, L + 16 * j);
        const float scale = fabsf(scales[j]);
        if (scale > amax) {
            amax = scale;
            max_scale = scales[j];
        }
    }
    memset(sc, 0, 12);
    if (max_scale != 0.0f) {
        const float iscale = -32.f / max_scale;
        for (int j = 0; j < QK / 16; j++) {
            int8_t l = (int8_t)nearest_int(iscale * scales[j]);
            l = (int8_t)(imax(-32, imin(31, l)) + 32);
            if (j < 8)
                sc[j] = (uint8_t)(l & 0xf);
            else
                sc[j - 8] = (uint8_t)(sc[j - 8] | ((unsigned)(l & 0xf) << 4));
            l = (int8_t)(l >> 4);
            sc[j % 4 + 8] = (uint8_t)(sc[j % 4 + 8] | ((unsigned)l << (2 * (j / 4))));
        }
        put_f16(b + 108, 1 / iscale);
    } else {
        put_f16(b + 108, 0.f);
    }
    const float d_all = f16_at(b + 108);
    for (int j = 0; j < QK / 16; j++) {
        const int lo = j < 8 ? sc[j] & 0xf : sc[j - 8] >> 4;
        const int8_t s = (int8_t)((lo | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32);
        const float d = d_all * (float)s;
        if (d == 0.0f)
            continue;
        for (int ii = 0; ii < 16; ii++) {
            const int l = nearest_int(x[16 * j + ii] / d);
            L[16 * j + ii] = (int8_t)(imax(-4, imin(3, l)) + 4);
        }
    }
    memset(hmask, 0, QK / 8);
    int m = 0;
    uint8_t hm = 1;
    uint8_t L2[QK];
    for (int j = 0; j < QK; j++) {
        int l = L[j];
        if (l > 3) {
            hmask[m] |= hm;
            l -= 4;
        }
        L2[j] = (uint8_t)l;
        if (++m == QK / 8) {
            m = 0;
            hm = (uint8_t)(hm << 1);
        }
    }
    pack_2bit(L2, qs);
}

/* The eight 6-bit scales and mins of Q4_K/Q5_K into their 12 bytes (get_scale_min_k4's layout). */
static void pack_scales_k4(const float *scales, const float *mins, float max_scale, float max_min,
                           uint8_t *sc) {
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < QK / 32; j++) {
        uint8_t ls = (uint8_t)nearest_int(inv_scale * scales[j]);
        uint8_t lm = (uint8_t)nearest_int(inv_min * mins[j]);
        ls = ls < 63 ? ls : 63;
        lm = lm < 63 ? lm : 63;
        if (j < 4) {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (uint8_t)((ls & 0xf) | ((lm & 0xf) << 4));
            sc[j - 4] = (uint8_t)(sc[j - 4] | ((ls >> 4) << 6));
            sc[j] = (uint8_t)(sc[j] | ((lm >> 4) << 6));
        }
    }
}

static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Q4_K and Q5_K share all but nmax and the search's range: each 32 values fit by
 * make_qkx2_quants (weights rms + |x|), scales and mins as 6-bit multiples of max / 63, the
 * quants in [0, nmax] chosen again against the rounded ones into L. */
static void fit_k4(const float *x, uint8_t *b, int nmax, float rmin, int nstep, uint8_t *L) {
    uint8_t Laux[32];
    float weights[32], mins[QK / 32], scales[QK / 32];
    uint8_t *sc = b + 4;
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < QK / 32; j++) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++)
            sum_x2 += x[32 * j + l] * x[32 * j + l];
        const float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++)
            weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux,
                                     rmin, 0.1f, nstep, 0);
        if (scales[j] > max_scale)
            max_scale = scales[j];
        if (mins[j] > max_min)
            max_min = mins[j];
    }
    pack_scales_k4(scales, mins, max_scale, max_min, sc);
    put_f16(b, max_scale / 63.f);
    put_f16(b + 2, max_min / 63.f);
    const float d_all = f16_at(b), dmin_all = f16_at(b + 2);
    for (int j = 0; j < QK / 32; j++) {
        uint8_t s, m;
        scale_min_k4(j, sc, &s, &m);
        const float d = d_all * (float)s;
        if (d == 0.0f)
            continue;
        const float dm = dmin_all * (float)m;
        for (int ii = 0; ii < 32; ii++) {
            const int l = nearest_int((x[32 * j + ii] + dm) / d);
            L[32 * j + ii] = (uint8_t)imax(0, imin(nmax, l));
        }
    }
}

/* Q4_K (block: d dmin scales[12] qs[128]). */
static void block_q4_k(const float *x, uint8_t *b) {
    uint8_t L[QK];
    fit_k4(x, b, 15, -1.f, 20, L);
    uint8_t *q = b + 16;
    for (int j = 0; j < QK; j += 64) {
        for (int l = 0; l < 32; l++)
            q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
        q += 32;
    }
}

/* Q5_K (block: d dmin scales[12] qh[32] qs[128]): the fifth bit of sub-block s in bit s of qh. */
static void block_q5_k(const float *x, uint8_t *b) {
    uint8_t L[QK];
    fit_k4(x, b, 31, -0.5f, 15, L);
    uint8_t *qh = b + 16, *ql = b + 48;
    memset(qh, 0, QK / 8);
    uint8_t m1 = 1, m2 = 2;
    for (int n = 0; n < QK; n += 64) {
        for (int j = 0; j < 32; j++) {
            int l1 = L[n + j], l2 = L[n + j + 32];
            if (l1 > 15) {
                l1 -= 16;
                qh[j] |= m1;
            }
            if (l2 > 15) {
                l2 -= 16;
                qh[j] |= m2;
            }
            ql[j] = (uint8_t)(l1 | (l2 << 4));
        }
        m1 = (uint8_t)(m1 << 2);
        m2 = (uint8_t)(m2 << 2);
        ql += 32;
    }
}

/* Q6_K (block: ql[128] qh[64] scales[16] d): each 16 values fit by make_qx_quants (32); their
 * scales as int8 multiples of d = max scale / −128; quants in [−32, 32) chosen again. */
static void block_q6_k(const float *x, uint8_t *b) {
    int8_t L[QK];
    float scales[QK / 16];
    float max_scale = 0, max_abs_scale = 0;
    for (int ib = 0; ib < QK / 16; ib++) {
        const float scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
        scales[ib] = scale;
        if (fabsf(scale) > max_abs_scale) {
            max_abs_scale = fabsf(scale);
            max_scale = scale;
        }
    }
    if (max_abs_scale < GROUP_MAX_EPS) {
        memset(b, 0, 210);
        return;
    }
    uint8_t *ql = b, *qh = b + 128;
    int8_t *sc = (int8_t *)(b + 192);
    const float iscale = -128.f / max_scale;
    put_f16(b + 208, 1 / iscale);
    for (int ib = 0; ib < QK / 16; ib++)
        sc[ib] = (int8_t)imin(127, nearest_int(iscale * scales[ib]));
    const float d_all = f16_at(b + 208);
    for (int j = 0; j < QK / 16; j++) {
        const float d = d_all * (float)sc[j];
        if (d == 0.0f)
            continue;
        for (int ii = 0; ii < 16; ii++) {
            const int l = nearest_int(x[16 * j + ii] / d);
            L[16 * j + ii] = (int8_t)(imax(-32, imin(31, l)) + 32);
        }
    }
    for (int j = 0; j < QK; j += 128) {
        for (int l = 0; l < 32; l++) {
            const int q1 = L[j + l] & 0xf, q2 = L[j + l + 32] & 0xf;
            const int q3 = L[j + l + 64] & 0xf, q4 = L[j + l + 96] & 0xf;
            ql[l] = (uint8_t)(q1 | (q3 << 4));
            ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
            qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) |
                              ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6));
        }
        ql += 64;
        qh += 32;
    }
}

/* Q8_K (block: d (f32) qs[256] bsums[16] (int16)): q = nearest(−127 / max × x), bsums the sums
 * of each 16 quants. An all-zero block is written all zero (ggml leaves its bsums as they were). */
static void block_q8_k(const float *x, uint8_t *b) {
    float max = 0, amax = 0;
    for (int j = 0; j < QK; j++) {
        const float ax = fabsf(x[j]);
        if (ax > amax) {
            amax = ax;
            max = x[j];
        }
    }
    if (amax == 0.0f) {
        memset(b, 0, 292);
        return;
    }
    const float iscale = -127.f / max;
    int8_t *qs = (int8_t *)(b + 4);
    for (int j = 0; j < QK; j++)
        qs[j] = (int8_t)imin(127, nearest_int(iscale * x[j]));
    for (int j = 0; j < QK / 16; j++) {
        int sum = 0;
        for (int ii = 0; ii < 16; ii++)
            sum += qs[j * 16 + ii];
        put_u16(b + 260 + 2 * j, (uint16_t)(int16_t)sum);
    }
    put_u32(b, f32_bits(1 / iscale));
}

/* ---- rows --------------------------------------------------------------------------------- */

typedef void (*block_fn)(const float *src, uint8_t *block);

static block_fn block_encoder(int type) {
    switch (type) {
    case LLMEM_QTYPE_Q4_0: return block_q4_0;
    case LLMEM_QTYPE_Q4_1: return block_q4_1;
    case LLMEM_QTYPE_Q5_0: return block_q5_0;
    case LLMEM_QTYPE_Q5_1: return block_q5_1;
    case LLMEM_QTYPE_Q8_0: return block_q8_0;
    case LLMEM_QTYPE_Q2_K: return block_q2_k;
    case LLMEM_QTYPE_Q3_K: return block_q3_k;
    case LLMEM_QTYPE_Q4_K: return block_q4_k;
    case LLMEM_QTYPE_Q5_K: return block_q5_k;
    case LLMEM_QTYPE_Q6_K: return block_q6_k;
    case LLMEM_QTYPE_Q8_K: return block_q8_k;
    default: return NULL;
    }
}

int llmem_quant_quantize_row(int type, const float *src, void *dst, int64_t n) {
    const struct llmem_qtype_info *t = llmem_qtype_info(type);
    if (t == NULL || n < 0 || n % t->block_elems != 0)
        return LLMEM_EINVAL;
    uint8_t *d = dst;
    switch (type) {
    case LLMEM_QTYPE_F32:
        if (n > 0)
            memcpy(d, src, (size_t)n * sizeof(float));
        return LLMEM_OK;
    case LLMEM_QTYPE_F16:
        for (int64_t i = 0; i < n; i++)
            put_u16(d + 2 * i, llmem_quant_f32_to_f16(src[i]));
        return LLMEM_OK;
    case LLMEM_QTYPE_BF16:
        for (int64_t i = 0; i < n; i++)
            put_u16(d + 2 * i, llmem_quant_f32_to_bf16(src[i]));
        return LLMEM_OK;
    default: break;
    }
    block_fn encode = block_encoder(type);
    if (encode == NULL)
        return LLMEM_EUNSUPPORTED;
    const int64_t nb = n / t->block_elems;
    for (int64_t i = 0; i < nb; i++)
        encode(src + i * t->block_elems, d + i * t->block_bytes);
    return LLMEM_OK;
}
