/*
 * kv/codec.h — KV storage formats (SPEC §4.4): encoding one head's row of head_dim floats into
 * its stored bytes and reading it back, with the fused operations attention needs.
 *
 * Layout per 32 elements, exactly the byte counts of plan/kv_format.c
 * (llmem_kv_format_info: key_group_bytes / value_group_bytes):
 *   f32   32 × f32                                              128 B
 *   f16   32 × IEEE half                                         64 B
 *   bf16  32 × bfloat16                                          64 B
 *   q8    32 × int8 (symmetric), f16 scale                       34 B
 *   q4    16 B of 4-bit codes (two per byte), f16 scale, f16 min 20 B   (keys and values)
 *   tq    keys: 32 × uint8 (asymmetric), f16 scale, f16 zero     36 B
 *         values: 12 B of 3-bit Lloyd–Max codes, f16 scale       14 B
 * Rotation: q4 (when enabled, the default) rotates keys and values, tq rotates values, by
 * R = H·D / sqrt(head_dim): D a fixed random ±1 diagonal (from the seed), H the Walsh–Hadamard
 * matrix (head_dim a power of two). R is orthogonal, so q·k = (Rq)·(Rk): attention rotates the
 * query once, and accumulates values in the rotated domain, applying Rᵀ once at the end.
 * Decoding returns the rotated-domain row; nothing here rotates back implicitly.
 */
#ifndef LLMEM_KV_CODEC_H
#define LLMEM_KV_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "llmem/plan.h"

#define LLMEM_KV_GROUP 32

struct llmem_kv_codec {
    enum llmem_kv_format format;
    int head_dim;       /* a multiple of 32 (and a power of two when rotating) */
    int rotate_keys;    /* keys are stored rotated (q4 with rotation) */
    int rotate_values;  /* values are stored rotated (q4 with rotation, tq) */
    size_t key_bytes;   /* stored bytes of one head's key row */
    size_t value_bytes; /* stored bytes of one head's value row */
    float signs[1024];  /* D of the rotation, ±1; head_dim ≤ 1024 */
};

/* LLMEM_EINVAL (logged) for a head_dim that is not a positive multiple of 32 (≤ 1024), or not a
 * power of two when this format rotates. `rotate` applies to q4 (tq always rotates values). */
int llmem_kv_codec_init(struct llmem_kv_codec *c, enum llmem_kv_format format, int head_dim,
                        int rotate, uint64_t seed);

/* 1/√head_dim, the norm of R, in f32. */
float llmem_kv_rotation_norm(int head_dim);
/* x ← R x and x ← Rᵀ x (in place, head_dim floats). */
void llmem_kv_rotate(const struct llmem_kv_codec *c, float *x);
void llmem_kv_rotate_inverse(const struct llmem_kv_codec *c, float *x);

/* Encodes one head's row (rotating first when the format says so; x is not modified). */
void llmem_kv_encode_key(const struct llmem_kv_codec *c, const float *x, uint8_t *out);
void llmem_kv_encode_value(const struct llmem_kv_codec *c, const float *x, uint8_t *out);
/* Decodes one head's row, in the stored (possibly rotated) domain. */
void llmem_kv_decode_key(const struct llmem_kv_codec *c, const uint8_t *in, float *x);
void llmem_kv_decode_value(const struct llmem_kv_codec *c, const uint8_t *in, float *x);

/* Σ q[i]·key[i] over the head (q given in the key's domain: rotated when rotate_keys). */
float llmem_kv_dot_key(const struct llmem_kv_codec *c, const uint8_t *key, const float *q);
/* acc[i] += w · value[i] (acc in the value's domain). */
void llmem_kv_axpy_value(const struct llmem_kv_codec *c, const uint8_t *value, float w, float *acc);

/* The same for the `heads` query heads of a GQA group, reading the stored row once:
 * s[g] = Σ q[g·head_dim + i]·key[i], and acc[g·stride + i] += w[g]·value[i]. */
void llmem_kv_dot_key_group(const struct llmem_kv_codec *c, const uint8_t *key, const float *q,
                            int heads, float *s);
void llmem_kv_axpy_value_group(const struct llmem_kv_codec *c, const uint8_t *value, const float *w,
                               int heads, float *acc, size_t stride);

/* Values of T consecutive tokens (rows row_stride bytes apart) for a group of heads, weights
 * w[g·T + t]: acc[g·stride + i] += Σ_t w[g·T + t]·value_t[i]. */
void llmem_kv_axpy_value_tile(const struct llmem_kv_codec *c, const uint8_t *values,
                              size_t row_stride, int T, const float *w, int heads, float *acc,
                              size_t stride);

/* IEEE half and bfloat16 conversions (round to nearest even), scalar and exact. */
uint16_t llmem_f32_to_f16(float x);
float llmem_f16_to_f32(uint16_t h);
uint16_t llmem_f32_to_bf16(float x);
float llmem_bf16_to_f32(uint16_t b);

#endif
