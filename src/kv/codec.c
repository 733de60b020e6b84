/*
 * kv/codec.c — the KV storage formats (see kv/codec.h for the contract): half and bfloat16
 * conversions, the randomized Hadamard rotation, and the per-group codes of q8, q4 and tq.
 *
 * Group layouts (32 elements; every multi-byte field little-endian, the host's order):
 *   f32 / f16 / bf16   the 32 elements in order
 *   q8      [0,32) int8 codes c, [32,34) f16 scale s              x = c·s, s = max|x| / 127
 *   q4      [0,16) nibbles: byte j holds element j (low) and j+16 (high); [16,18) f16 scale s,
 *           [18,20) f16 min m                                     x = m + c·s, s = (max − m) / 15
 *   tq key  [0,32) uint8 codes, [32,34) f16 scale s, [34,36) f16 zero m
 *                                                                 x = m + c·s, s = (max − m) / 255
 *   tq val  [0,12) 3-bit codes, code i at bits 3i..3i+2 of the 96-bit little-endian string,
 *           [12,14) f16 scale s                                   x = s·C[c]
 * with C the Lloyd–Max codebook of a unit normal, ascending: ∓2.15195 ∓1.34391 ∓0.75601 ∓0.24509,
 * codes chosen by the midpoints between centroids (nearest centroid).
 *
 * Codes round to nearest (ties to even), from the *stored* (f16-rounded) scale and min, so what
 * is decoded is what the code was chosen against. A scale that overflows f16 is clamped to 65504
 * (as is a min outside ±65504); a zero scale stores code 0 and decodes to exactly m (q4, tq keys)
 * or 0 (q8, tq values) with no division. NaN elements are skipped when looking for the range
 * and store code 0 (their group's other elements keep their codes); ±inf saturate. Nothing here
 * traps, whatever the input.
 *
 * tq value scale: the group's RMS is the scale for which x/s matches the unit normal the
 * codebook was built for; from there, up to four rounds of alternating optimization
 * (nearest-centroid codes for the scale, then the least-squares scale Σx·C[c] / ΣC[c]² for those
 * codes) lower the group's squared error, stopping when a round does not improve it, and the best
 * stored (f16) scale is kept. This is Lloyd's algorithm on a codebook with one free parameter; it
 * costs a few passes over 32 floats at encode time and nothing at decode time.
 *
 * Rotation: R = H·D/√d, D = diag(±1) from xorshift64 seeded through splitmix64 (1024 signs,
 * so the first d do not depend on d), H the Sylvester Walsh–Hadamard matrix applied by the
 * in-place fast transform (d log d additions). Rᵀ = D·H/√d. Encoding rotates a copy of the row.
 *
 * Measured round-trip error: relative RMS ‖x − x̂‖/‖x‖ over 256 rows of N(0, 1) ("gauss") or of
 * N(0, 1) with 4 fixed channels × 20 ("outlier"), x̂ = Rᵀ decode(encode(x)); tests/test-kvcodec.c
 * prints this table and asserts the last column. Keys and values share one code except in tq.
 *
 *   format         gauss d=64   d=128    d=256  outlier d=64   d=128    d=256  asserted ≤ g / o
 *   f32                 0        0        0            0        0        0      0 (bit-exact)
 *   f16             2.08e-4  2.06e-4  2.09e-4     2.08e-4  2.15e-4  2.04e-4     2.5e-4 †
 *   bf16            1.65e-3  1.67e-3  1.66e-3     1.63e-3  1.68e-3  1.66e-3     2.0e-3 †
 *   q8              5.31e-3  5.40e-3  5.34e-3     1.13e-2  1.17e-2  1.14e-2     6.5e-3 / 1.4e-2
 *   q4 rotated      7.87e-2  7.77e-2  7.84e-2     6.24e-2  6.46e-2  6.76e-2     9.0e-2 / 8.0e-2
 *   q4 plain        7.81e-2  7.87e-2  7.79e-2     1.17e-1  1.14e-1  1.14e-1     9.0e-2 / 1.35e-1
 *   tq keys         4.61e-3  4.63e-3  4.60e-3     6.97e-3  6.62e-3  6.61e-3     5.5e-3 / 8.5e-3
 *   tq values       1.65e-1  1.67e-1  1.67e-1     1.58e-1  1.59e-1  1.59e-1     1.9e-1 / 1.85e-1
 *   † and every element within 2^-11 (f16) / 2^-8 (bf16) of |x|: round to nearest even.
 * Rotation lowers q4's error on the outlier rows 1.7–1.9× (asserted > 1.5×). tq values: the RMS
 * scale alone gives 0.180 (d = 128); the refinement brings it to 0.167, below the asymptotic
 * √0.03455 = 0.186 of the Lloyd–Max quantizer because each group's scale is fitted to the group.
 *
 * Inner loops (codec_simd.c): dot_key and axpy_value run the vector kernel of the row's layout,
 * which for q8, q4 and tq decodes each group in registers with the arithmetic of the decoders
 * below (FMA may fuse m + c·s). The portable path decodes the row with the functions below into
 * floats (loops the compiler vectorizes) and uses the f32 kernel. Either way the result equals the
 * decoded row's dot or axpy up to f32 rounding.
 */
#include "kv/codec.h"

#include <math.h>
#include <string.h>

#include "core/log.h"
#include "core/rng.h"
#include "kv/codec_internal.h"
#include "plan/kv_codebook.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the KV formats are stored little-endian; big-endian hosts are not supported"
#endif

#define G LLMEM_KV_GROUP

_Static_assert(LLMEM_KV_MAX_HEAD_DIM == sizeof(((struct llmem_kv_codec *)0)->signs) / sizeof(float),
               "signs[] holds one sign per element of the largest head");

/* ---- half and bfloat16 ----------------------------------------------------------------------- */

uint16_t llmem_f32_to_f16(float x) {
    uint32_t w;
    memcpy(&w, &x, sizeof(w));
    uint16_t sign = (uint16_t)((w >> 16) & 0x8000u);
    uint32_t a = w & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN: quiet, keeping the top payload bits */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* ≥ 65520 (the tie above 65504 goes to even: infinity), or inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) { /* ≥ 2^-14: a normal half; rebias 127 → 15, round 13 bits to even */
        uint32_t r = a - 0x38000000u;
        r += 0x0fffu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    if (a < 0x33000000u) /* < 2^-25 (and f32 subnormals): rounds to zero */
        return sign;
    /* a subnormal half: round(|x| × 2^24) = round(m × 2^(e − 126)), to even */
    uint32_t e = a >> 23; /* 102 ..= 112 */
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14 ..= 24 */
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u)))
        r++; /* may carry into the smallest normal, 0x0400, which is right */
    return (uint16_t)(sign | r);
}

float llmem_f16_to_f32(uint16_t h) {
    return llmem_kv_half_to_float(h);
}

uint16_t llmem_f32_to_bf16(float x) {
    uint32_t w;
    memcpy(&w, &x, sizeof(w));
    if ((w & 0x7fffffffu) > 0x7f800000u) /* NaN: quiet */
        return (uint16_t)((w >> 16) | 0x0040u);
    w += 0x7fffu + ((w >> 16) & 1u); /* round 16 bits to even; overflow reaches infinity */
    return (uint16_t)(w >> 16);
}

float llmem_bf16_to_f32(uint16_t b) {
    return llmem_kv_bf16_to_float(b);
}

/* ---- helpers --------------------------------------------------------------------------------- */

static inline void put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v & 0xffu);
    p[1] = (uint8_t)(v >> 8);
}

static inline uint16_t get_u16(const uint8_t *p) {
    return (uint16_t)(p[0] | (p[1] << 8));
}

static inline float get_f16(const uint8_t *p) {
    return llmem_kv_half_to_float(get_u16(p));
}

/* A scale as f16: NaN and values ≤ 0 give 0, values above the f16 range clamp to 65504. */
static uint16_t f16_scale(float s) {
    if (!(s > 0.0f))
        return 0;
    return llmem_f32_to_f16(s < 65504.0f ? s : 65504.0f);
}

/* An offset as f16, clamped to ±65504; NaN gives 0. */
static uint16_t f16_offset(float m) {
    if (m != m)
        return 0;
    m = m > -65504.0f ? m : -65504.0f;
    m = m < 65504.0f ? m : 65504.0f;
    return llmem_f32_to_f16(m);
}

/* round(v) clamped to [lo, hi], NaN → 0 (lo ≤ 0 ≤ hi); no conversion of a non-finite value. */
static inline int quantize(float v, float lo, float hi) {
    v = v == v ? v : 0.0f;
    v = v > lo ? v : lo;
    v = v < hi ? v : hi;
    return (int)rintf(v);
}

/* ---- the codec and the rotation -------------------------------------------------------------- */

static const struct {
    int key_group_bytes, value_group_bytes;
} layouts[LLMEM_KV_FORMAT_COUNT] = {
    [LLMEM_KV_FORMAT_F16] = {LLMEM_KV_HALF_GROUP_BYTES, LLMEM_KV_HALF_GROUP_BYTES},
    [LLMEM_KV_FORMAT_BF16] = {LLMEM_KV_HALF_GROUP_BYTES, LLMEM_KV_HALF_GROUP_BYTES},
    [LLMEM_KV_FORMAT_F32] = {LLMEM_KV_F32_GROUP_BYTES, LLMEM_KV_F32_GROUP_BYTES},
    [LLMEM_KV_FORMAT_Q8] = {LLMEM_KV_Q8_GROUP_BYTES, LLMEM_KV_Q8_GROUP_BYTES},
    [LLMEM_KV_FORMAT_Q4] = {LLMEM_KV_Q4_GROUP_BYTES, LLMEM_KV_Q4_GROUP_BYTES},
    [LLMEM_KV_FORMAT_TQ] = {LLMEM_KV_TQK_GROUP_BYTES, LLMEM_KV_TQV_GROUP_BYTES},
};

int llmem_kv_codec_init(struct llmem_kv_codec *c, enum llmem_kv_format format, int head_dim,
                        int rotate, uint64_t seed) {
    LLMEM_ASSERT(c != NULL);
    const struct llmem_kv_format_info *info = llmem_kv_format_info(format);
    if (info == NULL) {
        LLMEM_ERROR("unknown KV format %d", (int)format);
        return LLMEM_EINVAL;
    }
    if (head_dim <= 0 || head_dim % G != 0 || head_dim > LLMEM_KV_MAX_HEAD_DIM) {
        LLMEM_ERROR("head_dim %d is not a positive multiple of %d up to %d (KV format %s)",
                    head_dim, G, LLMEM_KV_MAX_HEAD_DIM, info->name);
        return LLMEM_EINVAL;
    }
    int rotate_keys = format == LLMEM_KV_FORMAT_Q4 && rotate;
    int rotate_values = rotate_keys || format == LLMEM_KV_FORMAT_TQ;
    if ((rotate_keys || rotate_values) && (head_dim & (head_dim - 1)) != 0) {
        LLMEM_ERROR("head_dim %d is not a power of two, which the Hadamard rotation of KV format "
                    "%s needs%s",
                    head_dim, info->name,
                    format == LLMEM_KV_FORMAT_Q4 ? " (q4 can run without rotation)" : "");
        return LLMEM_EINVAL;
    }
    /* the layouts here and the planner's table are one truth */
    LLMEM_ASSERT(layouts[format].key_group_bytes == info->key_group_bytes &&
                 layouts[format].value_group_bytes == info->value_group_bytes);

    memset(c, 0, sizeof(*c));
    c->format = format;
    c->head_dim = head_dim;
    c->rotate_keys = rotate_keys;
    c->rotate_values = rotate_values;
    c->key_bytes = (size_t)(head_dim / G) * (size_t)layouts[format].key_group_bytes;
    c->value_bytes = (size_t)(head_dim / G) * (size_t)layouts[format].value_group_bytes;
    uint64_t s = llmem_splitmix64(seed);
    if (s == 0) /* the one fixed point of xorshift */
        s = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < LLMEM_KV_MAX_HEAD_DIM; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        c->signs[i] = (s >> 63) ? -1.0f : 1.0f;
    }
    return LLMEM_OK;
}

/* x ← H x, H the unnormalized Sylvester Walsh–Hadamard matrix, n a power of two. */
static void fwht(float *x, int n) {
    for (int h = 1; h < n; h <<= 1) {
        for (int i = 0; i < n; i += 2 * h) {
            for (int j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
    }
}

float llmem_kv_rotation_norm(int head_dim) {
    return (float)(1.0 / sqrt((double)head_dim));
}

void llmem_kv_rotate(const struct llmem_kv_codec *c, float *x) {
    int n = c->head_dim;
    LLMEM_ASSERT(n > 0 && n <= LLMEM_KV_MAX_HEAD_DIM && (n & (n - 1)) == 0);
    float r = llmem_kv_rotation_norm(n);
    for (int i = 0; i < n; i++)
        x[i] *= c->signs[i] * r;
    fwht(x, n);
}

void llmem_kv_rotate_inverse(const struct llmem_kv_codec *c, float *x) {
    int n = c->head_dim;
    LLMEM_ASSERT(n > 0 && n <= LLMEM_KV_MAX_HEAD_DIM && (n & (n - 1)) == 0);
    float r = llmem_kv_rotation_norm(n);
    fwht(x, n);
    for (int i = 0; i < n; i++)
        x[i] *= c->signs[i] * r;
}

/* ---- groups of 32 ---------------------------------------------------------------------------- */

static void f16_encode(const float *x, uint8_t *out) {
    for (int i = 0; i < G; i++) {
        uint16_t h = llmem_f32_to_f16(x[i]);
        memcpy(out + 2 * i, &h, sizeof(h));
    }
}

static void f16_decode(const uint8_t *in, float *x) {
    for (int i = 0; i < G; i++) {
        uint16_t h;
        memcpy(&h, in + 2 * i, sizeof(h));
        x[i] = llmem_kv_half_to_float(h);
    }
}

static void bf16_encode(const float *x, uint8_t *out) {
    for (int i = 0; i < G; i++) {
        uint16_t b = llmem_f32_to_bf16(x[i]);
        memcpy(out + 2 * i, &b, sizeof(b));
    }
}

static void bf16_decode(const uint8_t *in, float *x) {
    for (int i = 0; i < G; i++) {
        uint16_t b;
        memcpy(&b, in + 2 * i, sizeof(b));
        x[i] = llmem_kv_bf16_to_float(b);
    }
}

static void q8_encode(const float *x, uint8_t *out) {
    float amax = 0.0f;
    for (int i = 0; i < G; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax; /* NaN is skipped */
    }
    uint16_t hs = f16_scale(amax / 127.0f);
    float s = llmem_kv_half_to_float(hs);
    float inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (int i = 0; i < G; i++)
        out[i] = (uint8_t)(int8_t)quantize(x[i] * inv, -127.0f, 127.0f);
    put_u16(out + G, hs);
}

static void q8_decode(const uint8_t *in, float *x) {
    float s = get_f16(in + G);
    for (int i = 0; i < G; i++)
        x[i] = (float)(int8_t)in[i] * s;
}

/* Asymmetric codes 0..levels: the stored min m and scale s = (max − m) / levels. */
static void affine_params(const float *x, float levels, uint16_t *hs, uint16_t *hm, float *m,
                          float *inv) {
    float mn = INFINITY, mx = -INFINITY;
    for (int i = 0; i < G; i++) { /* NaN is skipped */
        mn = x[i] < mn ? x[i] : mn;
        mx = x[i] > mx ? x[i] : mx;
    }
    if (mn > mx) /* every element NaN */
        mn = mx = 0.0f;
    *hm = f16_offset(mn);
    *m = llmem_kv_half_to_float(*hm);
    *hs = f16_scale((mx - *m) / levels);
    float s = llmem_kv_half_to_float(*hs);
    *inv = s > 0.0f ? 1.0f / s : 0.0f;
}

static void q4_encode(const float *x, uint8_t *out) {
    uint16_t hs, hm;
    float m, inv;
    affine_params(x, 15.0f, &hs, &hm, &m, &inv);
    uint8_t c[G];
    for (int i = 0; i < G; i++)
        c[i] = (uint8_t)quantize((x[i] - m) * inv, 0.0f, 15.0f);
    for (int j = 0; j < G / 2; j++)
        out[j] = (uint8_t)(c[j] | (c[j + G / 2] << 4));
    put_u16(out + 16, hs);
    put_u16(out + 18, hm);
}

static void q4_decode(const uint8_t *in, float *x) {
    float s = get_f16(in + 16), m = get_f16(in + 18);
    for (int j = 0; j < G / 2; j++) {
        x[j] = m + (float)(in[j] & 0x0f) * s;
        x[j + G / 2] = m + (float)(in[j] >> 4) * s;
    }
}

static void tqk_encode(const float *x, uint8_t *out) {
    uint16_t hs, hm;
    float m, inv;
    affine_params(x, 255.0f, &hs, &hm, &m, &inv);
    for (int i = 0; i < G; i++)
        out[i] = (uint8_t)quantize((x[i] - m) * inv, 0.0f, 255.0f);
    put_u16(out + G, hs);
    put_u16(out + G + 2, hm);
}

static void tqk_decode(const uint8_t *in, float *x) {
    float s = get_f16(in + G), m = get_f16(in + G + 2);
    for (int i = 0; i < G; i++)
        x[i] = m + (float)in[i] * s;
}

/* Rounds of scale refinement for tq values (see the top of the file). */
#define TQ_SCALE_ROUNDS 4

/* The decision thresholds between the levels of the Lloyd–Max quantizer of N(0, 1) (the levels
 * themselves: llmem_kv_tq_centroids, codebook.c). */
static const float tq_bounds[7] = LLMEM_KV_TQ_BOUNDS;

/* Nearest centroid of every x/s; returns the squared error of the decoded group. */
static float tq_assign(const float *x, float s, uint8_t *c) {
    float inv = s > 0.0f ? 1.0f / s : 0.0f;
    float err = 0.0f;
    for (int i = 0; i < G; i++) {
        float v = x[i] * inv;
        int k = 0;
        for (int b = 0; b < 7; b++)
            k += v > tq_bounds[b];
        c[i] = (uint8_t)k;
        float d = x[i] - llmem_kv_tq_centroids[k] * s;
        err += d * d;
    }
    return err;
}

static void tqv_encode(const float *x, uint8_t *out) {
    float ss = 0.0f;
    for (int i = 0; i < G; i++)
        ss += x[i] * x[i];
    uint16_t best_h = f16_scale(sqrtf(ss / (float)G));
    uint8_t best_c[G], c[G];
    float best_err = tq_assign(x, llmem_kv_half_to_float(best_h), best_c);
    memcpy(c, best_c, sizeof(c));
    for (int round = 0; round < TQ_SCALE_ROUNDS; round++) {
        float num = 0.0f, den = 0.0f; /* least-squares scale for the codes c */
        for (int i = 0; i < G; i++) {
            num += x[i] * llmem_kv_tq_centroids[c[i]];
            den += llmem_kv_tq_centroids[c[i]] * llmem_kv_tq_centroids[c[i]];
        }
        uint16_t h = f16_scale(num / den); /* den ≥ 32 × 0.24509² */
        if (h == best_h)
            break;
        float err = tq_assign(x, llmem_kv_half_to_float(h), c);
        if (!(err < best_err))
            break;
        best_err = err;
        best_h = h;
        memcpy(best_c, c, sizeof(c));
    }
    for (int k = 0; k < 4; k++) { /* 8 codes → 24 bits → 3 bytes */
        uint32_t v = 0;
        for (int j = 0; j < 8; j++)
            v |= (uint32_t)best_c[8 * k + j] << (3 * j);
        out[3 * k] = (uint8_t)(v & 0xffu);
        out[3 * k + 1] = (uint8_t)((v >> 8) & 0xffu);
        out[3 * k + 2] = (uint8_t)(v >> 16);
    }
    put_u16(out + 12, best_h);
}

static void tqv_decode(const uint8_t *in, float *x) {
    float s = get_f16(in + 12);
    for (int k = 0; k < 4; k++) {
        uint32_t v =
            (uint32_t)in[3 * k] | ((uint32_t)in[3 * k + 1] << 8) | ((uint32_t)in[3 * k + 2] << 16);
        for (int j = 0; j < 8; j++)
            x[8 * k + j] = llmem_kv_tq_centroids[(v >> (3 * j)) & 7u] * s;
    }
}

/* ---- rows ------------------------------------------------------------------------------------ */

static void f32_encode(const float *x, uint8_t *out) {
    memcpy(out, x, G * sizeof(float));
}

static void f32_decode(const uint8_t *in, float *x) {
    memcpy(x, in, G * sizeof(float));
}

static size_t group_bytes(const struct llmem_kv_codec *c, int value) {
    return (size_t)(value ? layouts[c->format].value_group_bytes
                          : layouts[c->format].key_group_bytes);
}

static void encode_row(const struct llmem_kv_codec *c, int value, const float *x, uint8_t *out) {
    LLMEM_ASSERT((unsigned)c->format < LLMEM_KV_FORMAT_COUNT);
    int n_groups = c->head_dim / G;
    float rotated[LLMEM_KV_MAX_HEAD_DIM];
    if (value ? c->rotate_values : c->rotate_keys) {
        memcpy(rotated, x, (size_t)c->head_dim * sizeof(float));
        llmem_kv_rotate(c, rotated);
        x = rotated;
    }
    size_t stride = group_bytes(c, value);
    for (int g = 0; g < n_groups; g++) {
        const float *xg = x + g * G;
        uint8_t *og = out + (size_t)g * stride;
        switch (c->format) {
        case LLMEM_KV_FORMAT_F32: f32_encode(xg, og); break;
        case LLMEM_KV_FORMAT_F16: f16_encode(xg, og); break;
        case LLMEM_KV_FORMAT_BF16: bf16_encode(xg, og); break;
        case LLMEM_KV_FORMAT_Q8: q8_encode(xg, og); break;
        case LLMEM_KV_FORMAT_Q4: q4_encode(xg, og); break;
        default: value ? tqv_encode(xg, og) : tqk_encode(xg, og); break;
        }
    }
}

/* One loop per layout, so that the group decoder is inlined and vectorized. */
#define DECODE_GROUPS(fn, stride)                                                                  \
    for (int g = 0; g < n_groups; g++)                                                             \
        fn(in + (size_t)g * (stride), x + g * G);                                                  \
    break

static void decode_row(const struct llmem_kv_codec *c, int value, const uint8_t *in, float *x) {
    LLMEM_ASSERT((unsigned)c->format < LLMEM_KV_FORMAT_COUNT);
    int n_groups = c->head_dim / G;
    switch (c->format) {
    case LLMEM_KV_FORMAT_F32: DECODE_GROUPS(f32_decode, LLMEM_KV_F32_GROUP_BYTES);
    case LLMEM_KV_FORMAT_F16: DECODE_GROUPS(f16_decode, LLMEM_KV_HALF_GROUP_BYTES);
    case LLMEM_KV_FORMAT_BF16: DECODE_GROUPS(bf16_decode, LLMEM_KV_HALF_GROUP_BYTES);
    case LLMEM_KV_FORMAT_Q8: DECODE_GROUPS(q8_decode, LLMEM_KV_Q8_GROUP_BYTES);
    case LLMEM_KV_FORMAT_Q4: DECODE_GROUPS(q4_decode, LLMEM_KV_Q4_GROUP_BYTES);
    default:
        if (value) {
            DECODE_GROUPS(tqv_decode, LLMEM_KV_TQV_GROUP_BYTES);
        } else {
            DECODE_GROUPS(tqk_decode, LLMEM_KV_TQK_GROUP_BYTES);
        }
    }
}

void llmem_kv_encode_key(const struct llmem_kv_codec *c, const float *x, uint8_t *out) {
    encode_row(c, 0, x, out);
}

void llmem_kv_encode_value(const struct llmem_kv_codec *c, const float *x, uint8_t *out) {
    encode_row(c, 1, x, out);
}

void llmem_kv_decode_key(const struct llmem_kv_codec *c, const uint8_t *in, float *x) {
    decode_row(c, 0, in, x);
}

void llmem_kv_decode_value(const struct llmem_kv_codec *c, const uint8_t *in, float *x) {
    decode_row(c, 1, in, x);
}

/* ---- the fused operations of attention ------------------------------------------------------- */

float llmem_kv_dot_key(const struct llmem_kv_codec *c, const uint8_t *key, const float *q) {
    LLMEM_ASSERT((unsigned)c->format < LLMEM_KV_FORMAT_COUNT);
    const struct llmem_kv_kernels *k = llmem_kv_kernels();
    if (k->dot[c->format] != NULL)
        return k->dot[c->format](key, q, c->head_dim);
    float x[LLMEM_KV_MAX_HEAD_DIM];
    decode_row(c, 0, key, x);
    return k->dot[LLMEM_KV_FORMAT_F32]((const uint8_t *)x, q, c->head_dim);
}

/* A format without a kernel of its own (the portable set's quantized formats) is decoded to f32
 * first: once per row for all the heads it serves, then read by f32's kernels. */
void llmem_kv_dot_key_group(const struct llmem_kv_codec *c, const uint8_t *key, const float *q,
                            int heads, float *s) {
    const struct llmem_kv_kernels *k = llmem_kv_kernels();
    const int n = c->head_dim;
    if (k->dot_group[c->format] != NULL) {
        k->dot_group[c->format](key, q, heads, n, s);
        return;
    }
    if (k->dot[c->format] != NULL || heads == 1) {
        for (int g = 0; g < heads; g++)
            s[g] = llmem_kv_dot_key(c, key, q + (size_t)g * (size_t)n);
        return;
    }
    float x[LLMEM_KV_MAX_HEAD_DIM];
    decode_row(c, 0, key, x);
    if (k->dot_group[LLMEM_KV_FORMAT_F32] != NULL) {
        k->dot_group[LLMEM_KV_FORMAT_F32]((const uint8_t *)x, q, heads, n, s);
        return;
    }
    for (int g = 0; g < heads; g++)
        s[g] = k->dot[LLMEM_KV_FORMAT_F32]((const uint8_t *)x, q + (size_t)g * (size_t)n, n);
}

void llmem_kv_axpy_value_group(const struct llmem_kv_codec *c, const uint8_t *value, const float *w,
                               int heads, float *acc, size_t stride) {
    const struct llmem_kv_kernels *k = llmem_kv_kernels();
    if (k->axpy_group[c->format] != NULL) {
        k->axpy_group[c->format](value, w, heads, acc, stride, c->head_dim);
        return;
    }
    for (int g = 0; g < heads; g++)
        llmem_kv_axpy_value(c, value, w[g], acc + (size_t)g * stride);
}

void llmem_kv_axpy_value_tile(const struct llmem_kv_codec *c, const uint8_t *values,
                              size_t row_stride, int T, const float *w, int heads, float *acc,
                              size_t stride) {
    const struct llmem_kv_kernels *k = llmem_kv_kernels();
    if (k->axpy_tile[c->format] != NULL) {
        k->axpy_tile[c->format](values, row_stride, T, w, heads, acc, stride, c->head_dim);
        return;
    }
    if (k->axpy[c->format] != NULL || heads == 1) {
        for (int t = 0; t < T; t++)
            for (int g = 0; g < heads; g++)
                llmem_kv_axpy_value(c, values + (size_t)t * row_stride, w[g * T + t],
                                    acc + (size_t)g * stride);
        return;
    }
    float x[LLMEM_KV_MAX_HEAD_DIM];
    for (int t = 0; t < T; t++) { /* each row decoded once for every head */
        decode_row(c, 1, values + (size_t)t * row_stride, x);
        for (int g = 0; g < heads; g++)
            k->axpy[LLMEM_KV_FORMAT_F32]((const uint8_t *)x, w[g * T + t], acc + (size_t)g * stride,
                                         c->head_dim);
    }
}

void llmem_kv_axpy_value(const struct llmem_kv_codec *c, const uint8_t *value, float w,
                         float *acc) {
    LLMEM_ASSERT((unsigned)c->format < LLMEM_KV_FORMAT_COUNT);
    const struct llmem_kv_kernels *k = llmem_kv_kernels();
    if (k->axpy[c->format] != NULL) {
        k->axpy[c->format](value, w, acc, c->head_dim);
        return;
    }
    float x[LLMEM_KV_MAX_HEAD_DIM];
    decode_row(c, 1, value, x);
    k->axpy[LLMEM_KV_FORMAT_F32]((const uint8_t *)x, w, acc, c->head_dim);
}
