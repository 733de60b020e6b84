/*
 * quant/dequant.c — rows of every type llmem reads to f32 (quant/quant.h), the scalar reference
 * the f32 path of the forward pass and the tests stand on.
 *
 * Each block decodes as ggml's dequantize_row_* decodes it (ggml/src/ggml-quants.c), with the
 * same float operations in the same order: a value is (its scale × its quant) − its min, the
 * scale of a sub-block first made as ggml makes it (d × 6-bit scale, then × quant), so the
 * result is bit-exact, not merely close. The f16 decode is ggml_compute_fp16_to_fp32 (exact for
 * every finite value; a NaN comes back quiet). Blocks are read as bytes, little-endian, at any
 * alignment (a GGUF tensor's offset is only 32-byte aligned, its rows not at all). No division.
 *
 * This file is compiled with -ffp-contract=off (CMakeLists.txt): a fused multiply-add would round
 * once where ggml rounds twice.
 */
#include <stdint.h>
#include <string.h>

#include "llmem/status.h"
#include "quant/quant.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "GGUF blocks are little-endian; big-endian hosts are not supported"
#endif

#define QK LLMEM_QK_K

/* ---- f16 and bf16 ------------------------------------------------------------------------- */

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

/* A normal or infinite/NaN half: its bits shifted into an f32 with the exponent rebiased by 2^112
 * (the multiply quiets a NaN, as ggml's does); a subnormal half: 0.5 + m × 2^-24 built in the
 * mantissa of 0.5, minus 0.5. */
float llmem_quant_f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = f32_from_bits((two_w >> 4) + (0xe0u << 23)) * 0x1.0p-112f;
    const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    return f32_from_bits(sign |
                         (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized)));
}

float llmem_quant_bf16_to_f32(uint16_t b) {
    return f32_from_bits((uint32_t)b << 16);
}

/* ---- reading blocks ----------------------------------------------------------------------- */

static inline uint16_t u16_at(const uint8_t *p) {
    return (uint16_t)(p[0] | (p[1] << 8));
}

static inline uint32_t u32_at(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline float f16_at(const uint8_t *p) {
    return llmem_quant_f16_to_f32(u16_at(p));
}

/* The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block's 12 scale bytes (ggml's
 * get_scale_min_k4): j < 4 in the low 6 bits of bytes j and j + 4; j ≥ 4 in the nibbles of byte
 * j + 4 with the top two bits of bytes j − 4 and j. */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* ---- 32-value blocks ---------------------------------------------------------------------- */

/* Q4_0: d (f16), 16 bytes of nibbles; value j = (nibble − 8) × d, low nibbles first. */
static void block_q4_0(const uint8_t *b, float *y) {
    const float d = f16_at(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 0x0f) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

/* Q4_1: d, m (f16), nibbles; value = nibble × d + m. */
static void block_q4_1(const uint8_t *b, float *y) {
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 0x0f) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

/* Q5_0: d, the fifth bits (u32, bit j for value j), nibbles; value = (5-bit q − 16) × d. */
static void block_q5_0(const uint8_t *b, float *y) {
    const float d = f16_at(b);
    const uint32_t qh = u32_at(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        const int h0 = (int)(((qh >> j) << 4) & 0x10), h1 = (int)((qh >> (j + 12)) & 0x10);
        y[j] = (float)(((qs[j] & 0x0f) | h0) - 16) * d;
        y[j + 16] = (float)(((qs[j] >> 4) | h1) - 16) * d;
    }
}

/* Q5_1: d, m, the fifth bits, nibbles; value = 5-bit q × d + m. */
static void block_q5_1(const uint8_t *b, float *y) {
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint32_t qh = u32_at(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        const int h0 = (int)(((qh >> j) << 4) & 0x10), h1 = (int)((qh >> (j + 12)) & 0x10);
        y[j] = (float)((qs[j] & 0x0f) | h0) * d + m;
        y[j + 16] = (float)((qs[j] >> 4) | h1) * d + m;
    }
}

/* Q8_0: d, 32 signed bytes; value = q × d. */
static void block_q8_0(const uint8_t *b, float *y) {
    const float d = f16_at(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++)
        y[j] = (float)qs[j] * d;
}

/* ---- 256-value super-blocks --------------------------------------------------------------- */

/* Q2_K: scales[16] (low nibble scale, high nibble min of each 16 values), qs[64] (2-bit quants,
 * four 32-value groups a 32-byte run, shifted by 0/2/4/6), d, dmin (f16);
 * value = d × scale × q − dmin × min. */
static void block_q2_k(const uint8_t *b, float *y) {
    const uint8_t *scales = b, *q = b + 16;
    const float d = f16_at(b + 80), min = f16_at(b + 82);
    int is = 0;
    for (int n = 0; n < QK; n += 128) {
        for (int shift = 0; shift < 8; shift += 2) {
            for (int half = 0; half < 2; half++) {
                const uint8_t sc = scales[is++];
                const float dl = d * (float)(sc & 0xf), ml = min * (float)(sc >> 4);
                const uint8_t *qq = q + 16 * half;
                for (int l = 0; l < 16; l++)
                    *y++ = dl * (float)((qq[l] >> shift) & 3) - ml;
            }
        }
        q += 32;
    }
}

/* Q3_K: hmask[32] (the third bit, clear meaning −4), qs[64] (2-bit, as Q2_K), scales[12] (sixteen
 * 6-bit scales biased by 32: low nibbles in bytes 0..7, top bits in 8..11), d (f16);
 * value = d × (scale − 32) × (q − 4·!hbit). */
static void block_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *q = b + 32, *sb = b + 96;
    const float d_all = f16_at(b + 108);
    int8_t scales[16];
    for (int j = 0; j < 16; j++) {
        const int lo = j < 8 ? sb[j] & 0xf : sb[j - 8] >> 4;
        const int hi = (sb[8 + j % 4] >> (2 * (j / 4))) & 3;
        scales[j] = (int8_t)((lo | (hi << 4)) - 32);
    }
    int is = 0;
    uint8_t m = 1;
    for (int n = 0; n < QK; n += 128) {
        for (int shift = 0; shift < 8; shift += 2) {
            for (int half = 0; half < 2; half++) {
                const float dl = d_all * (float)scales[is++];
                const uint8_t *qq = q + 16 * half, *hh = hm + 16 * half;
                for (int l = 0; l < 16; l++)
                    *y++ = dl * (float)(((qq[l] >> shift) & 3) - ((hh[l] & m) ? 0 : 4));
            }
            m = (uint8_t)(m << 1);
        }
        q += 32;
    }
}

/* Q4_K: d, dmin (f16), scales[12] (eight 6-bit scales and mins), qs[128] (nibbles: each 32-byte
 * run holds two 32-value sub-blocks, low then high); value = d × scale × q − dmin × min. */
static void block_q4_k(const uint8_t *b, float *y) {
    const float d = f16_at(b), min = f16_at(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int is = 0; is < 8; is += 2) {
        uint8_t sc, m;
        scale_min_k4(is, scales, &sc, &m);
        const float d1 = d * (float)sc, m1 = min * (float)m;
        scale_min_k4(is + 1, scales, &sc, &m);
        const float d2 = d * (float)sc, m2 = min * (float)m;
        for (int l = 0; l < 32; l++)
            *y++ = d1 * (float)(q[l] & 0xf) - m1;
        for (int l = 0; l < 32; l++)
            *y++ = d2 * (float)(q[l] >> 4) - m2;
        q += 32;
    }
}

/* Q5_K: as Q4_K with qh[32] before the nibbles: the fifth bit of value l of sub-block s is bit s
 * of qh[l]. */
static void block_q5_k(const uint8_t *b, float *y) {
    const float d = f16_at(b), min = f16_at(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    uint8_t u1 = 1, u2 = 2;
    for (int is = 0; is < 8; is += 2) {
        uint8_t sc, m;
        scale_min_k4(is, scales, &sc, &m);
        const float d1 = d * (float)sc, m1 = min * (float)m;
        scale_min_k4(is + 1, scales, &sc, &m);
        const float d2 = d * (float)sc, m2 = min * (float)m;
        for (int l = 0; l < 32; l++)
            *y++ = d1 * (float)((ql[l] & 0xf) + (qh[l] & u1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++)
            *y++ = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
        ql += 32;
        u1 = (uint8_t)(u1 << 2);
        u2 = (uint8_t)(u2 << 2);
    }
}

/* Q6_K: ql[128] (low nibbles), qh[64] (top two bits), scales[16] (int8, one a 16 values), d (f16);
 * value = d × scale × (q − 32), each 128 values from 64 ql bytes and 32 qh bytes. */
static void block_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16_at(b + 208);
    for (int n = 0; n < QK; n += 128) {
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

/* ---- rows --------------------------------------------------------------------------------- */

typedef void (*block_fn)(const uint8_t *block, float *dst);

static block_fn block_decoder(int type) {
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
    default: return NULL;
    }
}

int llmem_quant_dequantize_row(int type, const void *src, float *dst, int64_t n) {
    const struct llmem_qtype_info *t = llmem_qtype_info(type);
    if (t == NULL || n < 0 || n % t->block_elems != 0)
        return LLMEM_EINVAL;
    if (!t->readable)
        return LLMEM_EUNSUPPORTED;
    const uint8_t *s = src;
    switch (type) {
    case LLMEM_QTYPE_F32:
        if (n > 0)
            memcpy(dst, s, (size_t)n * sizeof(float));
        return LLMEM_OK;
    case LLMEM_QTYPE_F16:
        for (int64_t i = 0; i < n; i++)
            dst[i] = llmem_quant_f16_to_f32(u16_at(s + 2 * i));
        return LLMEM_OK;
    case LLMEM_QTYPE_BF16:
        for (int64_t i = 0; i < n; i++)
            dst[i] = llmem_quant_bf16_to_f32(u16_at(s + 2 * i));
        return LLMEM_OK;
    default: break;
    }
    block_fn decode = block_decoder(type);
    if (decode == NULL) /* also the MLX types: their scales are not in the row */
        return llmem_qtype_mlx_params(type, NULL, NULL, NULL) ? LLMEM_EINVAL : LLMEM_EUNSUPPORTED;
    const int64_t nb = n / t->block_elems;
    for (int64_t i = 0; i < nb; i++)
        decode(s + i * t->block_bytes, dst + i * t->block_elems);
    return LLMEM_OK;
}

/* ---- MLX's affine formats ------------------------------------------------------------------- */

/* x rounded to the scale dtype st, to nearest even (f32: x). */
static inline float round_to(float x, int st) {
    switch (st) {
    case LLMEM_QTYPE_BF16: return llmem_quant_bf16_to_f32(llmem_quant_f32_to_bf16(x));
    case LLMEM_QTYPE_F16: return llmem_quant_f16_to_f32(llmem_quant_f32_to_f16(x));
    default: return x;
    }
}

static inline float scale_at(const uint8_t *p, int st, int64_t i) {
    switch (st) {
    case LLMEM_QTYPE_BF16: return llmem_quant_bf16_to_f32(u16_at(p + 2 * i));
    case LLMEM_QTYPE_F16: return llmem_quant_f16_to_f32(u16_at(p + 2 * i));
    default: {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    }
}

int llmem_quant_dequantize_mlx_row(int type, const void *codes, const void *scales,
                                   const void *biases, float *dst, int64_t n) {
    int bits, group, st;
    if (!llmem_qtype_mlx_params(type, &bits, &group, &st) || n < 0 || n % group != 0)
        return LLMEM_EINVAL;
    const uint8_t *c = codes;
    const uint32_t mask = (1u << bits) - 1;
    const int per_word = 32 / bits;
    for (int64_t g = 0; g < n / group; g++) {
        const float s = scale_at(scales, st, g), b = scale_at(biases, st, g);
        for (int64_t i = g * group; i < (g + 1) * group; i += per_word) {
            uint32_t w;
            memcpy(&w, c + (i / per_word) * 4, 4); /* little-endian, as the files are */
            for (int k = 0; k < per_word; k++, w >>= bits) {
                float q = (float)(w & mask);
                dst[i + k] = round_to(round_to(q * s, st) + b, st);
            }
        }
    }
    return LLMEM_OK;
}
