/*
 * tests/data/quant/make_reference.c — the references of test-quant, made by ggml's own C code:
 * quantize_row_*_ref, dequantize_row_* (ggml/src/ggml-quants.c) and the scalar conversions of
 * ggml-impl.h, compiled from a llama.cpp source tree. Never edited by hand; make_reference.sh
 * builds and runs this and cross-checks the results with gguf-py (the test needs neither).
 *
 * Writes into the directory given as argv[1]:
 *   input.f32           ROWS × N float32: the seeded input rows (normals at several scales,
 *                       zeros, an outlier, f32 denormals, tiny normals, rounding ties, all-positive
 *                       and constant blocks, values past f16's range, sparse rows with -0)
 *   special.f32         N float32 for the float conversions only: NaNs, infinities, ±0, f16 and
 *                       bf16 rounding ties, the edges of f16's range and subnormals
 *   <type>.q            the input rows quantized by ggml (F16/BF16: GGML_FP32_TO_FP16/BF16;
 *                       none for F32, whose blocks and values are input.f32)
 *   <type>.f32          ggml's dequantization of <type>.q
 *   <type>.rand.q       one row of random blocks (f16 scales finite; F16/BF16 all bit patterns)
 *   <type>.rand.f32     ggml's dequantization of it
 *   f16.special.q, bf16.special.q, f32 conversions of special.f32
 *   q8_K.q              the input rows as Q8_K (the activations of the K dot products)
 *   bulk.txt            for many more rows, only hashes: BULK_ROWS rows made from splitmix64 with
 *                       float arithmetic alone (bulk_row: no libm, so test-quant makes the same
 *                       rows), quantized by each type, FNV-1a 64 of each BULK_CHUNK rows' bytes;
 *                       and as many rows of random blocks, FNV-1a 64 of ggml's floats from them
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-impl.h"
#include "ggml-quants.h"

#define N    256 /* values a row */
#define ROWS 12

/* ---- what ggml-quants.c needs from the rest of ggml ---------------------------------------- */

void ggml_abort(const char *file, int line, const char *fmt, ...) {
    fprintf(stderr, "ggml_abort %s:%d %s\n", file, line, fmt);
    abort();
}
size_t ggml_row_size(enum ggml_type type, int64_t ne) {
    (void)type;
    (void)ne;
    abort();
}
const char *ggml_type_name(enum ggml_type type) {
    (void)type;
    return "?";
}
size_t ggml_type_size(enum ggml_type type) {
    (void)type;
    abort();
}

/* ---- seeded inputs -------------------------------------------------------------------------- */

static uint64_t rng_state = 0x5eed0123456789abull;
static uint64_t rng_next(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double rng_uniform(void) {
    return (double)(rng_next() >> 11) * 0x1p-53;
}
static float rng_normal(double sigma) {
    double u1 = rng_uniform(), u2 = rng_uniform();
    if (u1 < 1e-300)
        u1 = 1e-300;
    return (float)(sigma * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}
static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void make_inputs(float *x /* (ROWS, N) */) {
    for (int r = 0; r < ROWS; r++) {
        float *row = x + r * N;
        for (int i = 0; i < N; i++) {
            switch (r) {
            case 0: row[i] = rng_normal(1.0); break;
            case 1: row[i] = rng_normal(0.02); break;
            case 2: row[i] = rng_normal(300.0); break;
            case 3: row[i] = 0.0f; break;
            case 4: row[i] = i == 77 ? 40.0f : rng_normal(0.02); break;
            case 5: /* f32 denormals, some zeros */
                row[i] = i % 7 == 0 ? 0.0f : from_bits((uint32_t)(rng_next() & 0x807fffffu));
                break;
            case 6: row[i] = rng_normal(1e-6); break; /* scales below f16's normals */
            case 7: row[i] = (float)((i * 7) % 32 - 16) * 0.5f; break;          /* ties */
            case 8: row[i] = 0.5f + (float)rng_uniform(); break;                /* min > 0 */
            case 9: row[i] = i < 128 ? 0.25f : (i < 192 ? -3.0f : 1.0f); break; /* constant */
            case 10: row[i] = rng_normal(2e4); break; /* past f16's range */
            case 11: row[i] = i % 9 == 0 ? rng_normal(1.0) : (i % 2 ? -0.0f : 0.0f); break;
            }
        }
    }
}

static void make_special(float *s /* N */) {
    static const uint32_t fixed[] = {
        0x7fc00000u,
        0xffc00000u,
        0x7f800001u,
        0xff800001u,
        0x7fffffffu,
        0x7fa00000u,
        0x7f800000u,
        0xff800000u,
        0x00000000u,
        0x80000000u,
        0x7f7fffffu,
        0xff7fffffu,
        0x477fe000u /* 65504 */,
        0x477fefffu,
        0x477ff000u /* 65520: tie to inf */,
        0xc77ff000u,
        0x38800000u /* 2^-14 */,
        0x33800000u /* 2^-24 */,
        0x33000000u /* 2^-25: tie to 0 */,
        0x33000001u,
        0x33c00000u /* 1.5 × 2^-24 */,
        0x34200000u /* 2.5 × 2^-24 */,
        0x00000001u,
        0x807fffffu,
        0x3f801000u /* 1 + 2^-11 */,
        0x3f803000u,
        0x3f808000u /* bf16 tie */,
        0x3f818000u,
        0x3f7fffffu,
        0x387fc000u,
    };
    size_t nf = sizeof(fixed) / sizeof(fixed[0]);
    for (size_t i = 0; i < nf; i++)
        s[i] = from_bits(fixed[i]);
    for (int i = (int)nf; i < N; i++) {
        uint32_t h = (uint32_t)(rng_next() & 0x7bffu); /* a finite f16 below the largest */
        float a = ggml_compute_fp16_to_fp32((ggml_fp16_t)h);
        float b = ggml_compute_fp16_to_fp32((ggml_fp16_t)(h + 1));
        switch (i % 4) {
        case 0: s[i] = (float)(((double)a + (double)b) * 0.5); break; /* an f16 tie, exact */
        case 1: s[i] = -(float)(((double)a + (double)b) * 0.5); break;
        case 2: s[i] = from_bits((uint32_t)rng_next()); break; /* any bits */
        case 3: s[i] = from_bits(((uint32_t)rng_next() & 0xffff0000u) | 0x8000u); break;
        }
    }
}

/* ---- the types ------------------------------------------------------------------------------ */

typedef void (*quant_fn)(const float *x, void *y, int64_t k);
typedef void (*dequant_fn)(const void *x, float *y, int64_t k);

struct qtype {
    const char *name;
    int block_elems, block_bytes;
    quant_fn quant;
    dequant_fn dequant;
    int f16_at[2]; /* byte offsets of a block's f16 fields (-1: none) */
};

static void quant_f32(const float *x, void *y, int64_t k) {
    memcpy(y, x, (size_t)k * 4);
}
static void dequant_f32(const void *x, float *y, int64_t k) {
    memcpy(y, x, (size_t)k * 4);
}
static void quant_f16(const float *x, void *y, int64_t k) {
    for (int64_t i = 0; i < k; i++)
        ((ggml_fp16_t *)y)[i] = GGML_FP32_TO_FP16(x[i]);
}
static void dequant_f16(const void *x, float *y, int64_t k) {
    for (int64_t i = 0; i < k; i++)
        y[i] = GGML_FP16_TO_FP32(((const ggml_fp16_t *)x)[i]);
}
static void quant_bf16(const float *x, void *y, int64_t k) {
    for (int64_t i = 0; i < k; i++)
        ((ggml_bf16_t *)y)[i] = GGML_FP32_TO_BF16(x[i]);
}
static void dequant_bf16(const void *x, float *y, int64_t k) {
    for (int64_t i = 0; i < k; i++)
        y[i] = GGML_BF16_TO_FP32(((const ggml_bf16_t *)x)[i]);
}

#define Q(fn) ((quant_fn)(void (*)(void))(fn))
#define D(fn) ((dequant_fn)(void (*)(void))(fn))
#define T(name, tn, qk)                                                                            \
    {                                                                                              \
        name, qk, (int)sizeof(block_##tn), Q(quantize_row_##tn##_ref), D(dequantize_row_##tn), {   \
            (int)offsetof(block_##tn, d), -1                                                       \
        }                                                                                          \
    }
#define T2(name, tn, qk, second)                                                                   \
    {                                                                                              \
        name, qk, (int)sizeof(block_##tn), Q(quantize_row_##tn##_ref), D(dequantize_row_##tn), {   \
            (int)offsetof(block_##tn, d), (int)offsetof(block_##tn, second)                        \
        }                                                                                          \
    }

static const struct qtype types[] = {
    {"f32", 1, 4, quant_f32, dequant_f32, {-1, -1}},
    {"f16", 1, 2, quant_f16, dequant_f16, {-1, -1}},
    {"bf16", 1, 2, quant_bf16, dequant_bf16, {-1, -1}},
    T("q4_0", q4_0, 32),
    T2("q4_1", q4_1, 32, m),
    T("q5_0", q5_0, 32),
    T2("q5_1", q5_1, 32, m),
    T("q8_0", q8_0, 32),
    T2("q2_K", q2_K, 256, dmin),
    T("q3_K", q3_K, 256),
    T2("q4_K", q4_K, 256, dmin),
    T2("q5_K", q5_K, 256, dmin),
    T("q6_K", q6_K, 256),
};

/* ---- bulk rows: the same recipe as tests/test-quant.c's ------------------------------------ */

#define BULK_ROWS  4096
#define BULK_CHUNK 256

/* 24 random bits as a float in [0, 1), exact. */
static float bulk_uniform(uint64_t *st) {
    uint64_t z = (*st += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)(z >> 40) * 0x1p-24f;
}

/* Row r: a scale from 1e-3 to 30 and a shape: near-normal (four uniforms summed), uniform, with
 * an outlier 20 times the scale, on a grid of 16 multiples of the scale, or with a third of its
 * values zero. */
static void bulk_row(int r, float *x /* N */) {
    static const float scales[4] = {1e-3f, 0.02f, 1.0f, 30.0f};
    uint64_t st = 0xb01c0000u + (uint64_t)r;
    const float scale = scales[r % 4];
    const int shape = (r / 4) % 5;
    for (int i = 0; i < N; i++) {
        const float u1 = bulk_uniform(&st), u2 = bulk_uniform(&st);
        const float u3 = bulk_uniform(&st), u4 = bulk_uniform(&st);
        const float g = ((u1 + u2) + (u3 + u4)) - 2.0f;
        switch (shape) {
        case 0: x[i] = g * scale; break;
        case 1: x[i] = (u1 - 0.5f) * scale; break;
        case 2: x[i] = i == r % N ? 20.0f * scale : g * scale; break;
        case 3: x[i] = (float)((int)(u1 * 16.0f) - 8) * scale; break;
        default: x[i] = u1 < 0.33f ? 0.0f : g * scale; break;
        }
    }
}

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}
#define FNV_INIT 0xcbf29ce484222325ull

/* One row of random blocks of type ty, its f16 scales made finite; seeded by the row. */
static void random_blocks(const struct qtype *ty, int r, uint8_t *q, size_t row_bytes) {
    uint64_t st = 0x4a4d0000u + (uint64_t)r;
    for (size_t i = 0; i < row_bytes; i++)
        q[i] = (uint8_t)(bulk_uniform(&st) * 256.0f);
    for (int b = 0; b < N / ty->block_elems; b++) {
        for (int f = 0; f < 2; f++) {
            if (ty->f16_at[f] < 0)
                continue;
            uint8_t *h = q + b * ty->block_bytes + ty->f16_at[f];
            if ((h[1] & 0x7c) == 0x7c)
                h[1] ^= 0x40;
        }
    }
}

static void write_file(const char *dir, const char *name, const char *ext, const void *p,
                       size_t n) {
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s%s", dir, name, ext);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(p, 1, n, f) != n || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    static float x[ROWS * N], special[N], y[ROWS * N];
    static uint8_t q[ROWS * N * 4];
    make_inputs(x);
    make_special(special);
    write_file(dir, "input", ".f32", x, sizeof(x));
    write_file(dir, "special", ".f32", special, sizeof(special));

    for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); t++) {
        const struct qtype *ty = &types[t];
        size_t row_bytes = (size_t)(N / ty->block_elems * ty->block_bytes);
        /* the input rows, one call a row (as llama-quantize quantizes row by row) */
        memset(q, 0, sizeof(q));
        for (int r = 0; r < ROWS; r++)
            ty->quant(x + r * N, q + r * row_bytes, N);
        for (int r = 0; r < ROWS; r++)
            ty->dequant(q + r * row_bytes, y + r * N, N);
        if (strcmp(ty->name, "f32") != 0) { /* f32's would be input.f32 twice */
            write_file(dir, ty->name, ".q", q, ROWS * row_bytes);
            write_file(dir, ty->name, ".f32", y, sizeof(float) * ROWS * N);
        }

        /* one row of random blocks */
        for (size_t i = 0; i < row_bytes; i++)
            q[i] = (uint8_t)rng_next();
        for (int b = 0; b < N / ty->block_elems; b++) {
            for (int f = 0; f < 2; f++) {
                if (ty->f16_at[f] < 0)
                    continue;
                uint8_t *h = q + b * ty->block_bytes + ty->f16_at[f];
                if ((h[1] & 0x7c) == 0x7c)
                    h[1] ^= 0x40; /* no infinities or NaNs in the scales */
            }
        }
        ty->dequant(q, y, N);
        write_file(dir, ty->name, ".rand.q", q, row_bytes);
        write_file(dir, ty->name, ".rand.f32", y, sizeof(float) * N);

        if (ty->block_elems == 1 && strcmp(ty->name, "f32") != 0) {
            ty->quant(special, q, N);
            write_file(dir, ty->name, ".special.q", q, row_bytes);
        }
    }

    memset(q, 0, sizeof(q)); /* an all-zero block's bsums are left as they were */
    for (int r = 0; r < ROWS; r++)
        quantize_row_q8_K_ref(x + r * N, (block_q8_K *)q + r, N);
    write_file(dir, "q8_K", ".q", q, ROWS * sizeof(block_q8_K));

    char path[1024];
    snprintf(path, sizeof(path), "%s/bulk.txt", dir);
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        perror(path);
        return 1;
    }
    fprintf(f,
            "# make_reference.c: FNV-1a 64 of each %d rows of bulk_row (quantize) and of ggml's"
            " floats from random blocks (dequantize)\n",
            BULK_CHUNK);
    for (size_t t = 0; t < sizeof(types) / sizeof(types[0]) + 1; t++) {
        const int q8k = t == sizeof(types) / sizeof(types[0]);
        const char *name = q8k ? "q8_K" : types[t].name;
        size_t row_bytes =
            q8k ? sizeof(block_q8_K) : (size_t)(N / types[t].block_elems * types[t].block_bytes);
        for (int pass = 0; pass < (q8k ? 1 : 2); pass++) {
            fprintf(f, "%s %s", pass == 0 ? "quantize" : "dequantize", name);
            uint64_t h = FNV_INIT;
            for (int r = 0; r < BULK_ROWS; r++) {
                memset(q, 0, row_bytes);
                if (pass == 0) {
                    bulk_row(r, x);
                    if (q8k)
                        quantize_row_q8_K_ref(x, (block_q8_K *)q, N);
                    else
                        types[t].quant(x, q, N);
                    h = fnv1a(h, q, row_bytes);
                } else {
                    random_blocks(&types[t], r, q, row_bytes);
                    types[t].dequant(q, y, N);
                    h = fnv1a(h, y, sizeof(float) * N);
                }
                if ((r + 1) % BULK_CHUNK == 0) {
                    fprintf(f, " %016llx", (unsigned long long)h);
                    h = FNV_INIT;
                }
            }
            fprintf(f, "\n");
        }
    }
    if (fclose(f) != 0) {
        perror(path);
        return 1;
    }
    return 0;
}
