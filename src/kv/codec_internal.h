/*
 * kv/codec_internal.h — the inner loops behind kv/codec.h and their run-time selection.
 *
 * Every layout has row kernels (a dot with a key, an accumulation of a value) for three
 * instruction sets: portable C (every target; f32, f16 and bf16 only, the quantized layouts are
 * decoded to f32 first), AVX2 + FMA + F16C and AVX-512 (F, BW, VL) on x86-64. The best set this
 * CPU and OS support (llmem_sys_isa_features) is picked once, on first use. Tests and benchmarks
 * may pin a lower set to compare the paths with each other.
 */
#ifndef LLMEM_KV_CODEC_INTERNAL_H
#define LLMEM_KV_CODEC_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "llmem/plan.h"

#define LLMEM_KV_MAX_HEAD_DIM 1024
#define LLMEM_KV_TILE         16 /* tokens of an attention tile */

/* Bytes of one group of 32 elements per layout (the layouts are described at the top of
 * kv/codec.c; every scale, min and zero is a little-endian f16 after the codes). */
#define LLMEM_KV_F32_GROUP_BYTES  128 /* 32 × f32 */
#define LLMEM_KV_HALF_GROUP_BYTES 64  /* 32 × f16 or bf16 */
#define LLMEM_KV_Q8_GROUP_BYTES   34  /* 32 int8 codes, scale at 32 */
#define LLMEM_KV_Q4_GROUP_BYTES   20  /* 16 bytes of nibbles, scale at 16, min at 18 */
#define LLMEM_KV_TQK_GROUP_BYTES  36  /* 32 uint8 codes, scale at 32, zero at 34 */
#define LLMEM_KV_TQV_GROUP_BYTES  14  /* 12 bytes of 3-bit codes, scale at 12 */

enum llmem_kv_isa {
    LLMEM_KV_ISA_SCALAR = 0, /* portable C */
    LLMEM_KV_ISA_AVX2,       /* AVX2 + FMA + F16C */
    LLMEM_KV_ISA_AVX512      /* AVX-512 F + BW + VL (with the AVX2 set) */
};

/* Row kernels, indexed by format; n is a positive multiple of 32 and rows are read at any byte
 * address. dot[f] reads a row in f's key layout, axpy[f] a row in f's value layout (they differ
 * for tq only). (optional) entries are NULL: the caller decodes the row to f32 and uses the f32
 * kernel; f32, f16 and bf16 are always present. */
/* The bytes a tile kernel prefetches while it computes: its share of the next tile's K or V, the
 * same slice [off, off + len) of each LLMEM_KV_PF_PAGE bytes of the `bytes` at `at` (nothing when
 * len is 0). Spread over the kernel's loops, a few lines per step, the prefetches keep memory busy
 * under the arithmetic; issued all at once before the tile, they queue behind each other and stall
 * the tile's own loads. A slice of every page rather than whole pages one after another: each call
 * then starts the hardware stream prefetchers on all the tile's pages, which fetch the rest of
 * them side by side through the core's many L2 miss slots (a software prefetch holds one of the
 * few L1 ones for the whole trip). */
#define LLMEM_KV_PF_PAGE 4096
struct llmem_kv_prefetch {
    const uint8_t *at;
    size_t bytes, off, len;
};

/* One tile of decode attention (n = head_dim): the T ≤ LLMEM_KV_TILE tokens of one KV head for
 * G query heads q[g·n + i] (scaled, in the key's domain) whose online-softmax states lie at
 * st + g·hs (acc[0, n), then m at n and l at n + 1), in two calls:
 * - scores: the keys (key_stride bytes apart) against the queries, the new maximum m' and sum l'
 *   of each head written to its state, and sc (LLMEM_KV_TILE_SC floats, 64-byte aligned)
 *   filled with the rescale factors e^(m − m') (sc[g]) and the weights e^(s − m')
 *   (sc[4 + G·t + g]);
 * - values: each head's acc rescaled by sc[g] and the values (value_stride bytes apart)
 *   accumulated with the weights of sc.
 * scores touches only m and l, values only acc: the scores of the next tiles may run before the
 * values of this one (each with its own sc), which hides the softmax's latency behind the values'
 * arithmetic. pf: bytes to prefetch meanwhile, spread over the call's loops. */
#define LLMEM_KV_TILE_SC 80
struct llmem_kv_attn_tile {
    void (*scores)(const uint8_t *keys, size_t key_stride, int T, const float *q, int n, float *st,
                   size_t hs, float *sc, struct llmem_kv_prefetch pf);
    void (*values)(const uint8_t *values, size_t value_stride, int T, const float *sc, int n,
                   float *st, size_t hs, struct llmem_kv_prefetch pf);
};

struct llmem_kv_kernels {
    enum llmem_kv_isa isa;
    const char *name; /* "scalar", "avx2", "avx512" */
    /* Σ q[i]·row[i] */
    float (*dot[LLMEM_KV_FORMAT_COUNT])(const uint8_t *row, const float *q, int n);
    /* acc[i] += w · row[i] */
    void (*axpy[LLMEM_KV_FORMAT_COUNT])(const uint8_t *row, float w, float *acc, int n);
    /* (optional) defaults to G calls of dot: s[g] = Σ q[g·n + i]·row[i], the row read once */
    void (*dot_group[LLMEM_KV_FORMAT_COUNT])(const uint8_t *row, const float *q, int G, int n,
                                             float *s);
    /* (optional) defaults to G calls of axpy: acc[g·stride + i] += w[g]·row[i] */
    void (*axpy_group[LLMEM_KV_FORMAT_COUNT])(const uint8_t *row, const float *w, int G, float *acc,
                                              size_t stride, int n);
    /* (optional) defaults to axpy per row and head: for T rows at row_stride bytes apart,
     * acc[g·stride + i] += Σ_t w[g·T + t]·row_t[i], the accumulators held across the rows */
    void (*axpy_tile[LLMEM_KV_FORMAT_COUNT])(const uint8_t *rows, size_t row_stride, int T,
                                             const float *w, int G, float *acc, size_t stride,
                                             int n);
    /* (optional) a tile of decode attention for four query heads (struct llmem_kv_attn_tile);
     * NULL functions: attention scores with dot_group and accumulates with axpy_tile */
    struct llmem_kv_attn_tile attn_tile[LLMEM_KV_FORMAT_COUNT];
    /* (optional) the same for two query heads (GQA groups of 2, 6, 10, …) and for one (odd
     * groups: MHA, 3, 5, 7, …) */
    struct llmem_kv_attn_tile attn_tile2[LLMEM_KV_FORMAT_COUNT];
    struct llmem_kv_attn_tile attn_tile1[LLMEM_KV_FORMAT_COUNT];
};

/* The Lloyd–Max codebook of tq values (ascending), shared by every kernel (codebook.c). */
extern const float llmem_kv_tq_centroids[8];

/* IEEE half → f32, exact (subnormals, infinities; a NaN stays NaN with its payload). Branch-free
 * so that loops over it vectorize; llmem_f16_to_f32 is this function. Normal halves and inf/NaN:
 * the exponent and mantissa bits moved into place, rebiased by multiplying with 2^-112 (exact);
 * subnormals: the mantissa m put under the exponent of 0.5, giving 0.5 + m·2^-24, minus 0.5. */
static inline float llmem_kv_half_to_float(uint16_t h) {
    uint32_t two_w = (uint32_t)h << 17; /* sign shifted out */
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t nb = (two_w >> 4) + (0xe0u << 23), db = (two_w >> 17) | (126u << 23);
    float normal, sub;
    memcpy(&normal, &nb, sizeof(normal));
    memcpy(&sub, &db, sizeof(sub));
    normal *= 0x1p-112f;
    sub -= 0.5f;
    uint32_t rn, rs;
    memcpy(&rn, &normal, sizeof(rn));
    memcpy(&rs, &sub, sizeof(rs));
    uint32_t is_sub = 0u - (uint32_t)(two_w < (1u << 27)); /* all ones for zero/subnormal */
    uint32_t bits = sign | (rs & is_sub) | (rn & ~is_sub);
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

/* bfloat16 → f32: the upper half of the f32 bits. */
static inline float llmem_kv_bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

/* The kernels in use (resolved on the first call). */
const struct llmem_kv_kernels *llmem_kv_kernels(void);
/* The best instruction set this CPU supports for the kernels. */
enum llmem_kv_isa llmem_kv_isa_best(void);
/* Test and benchmark hooks, not for use while other threads run codecs: use `isa`, capped to
 * the best supported, from now on; returns the set in effect. */
enum llmem_kv_isa llmem_kv_codec_set_isa(enum llmem_kv_isa isa);
/* on ≠ 0: the portable kernels; 0: back to the best set. */
void llmem_kv_codec_force_scalar(int on);

#endif
