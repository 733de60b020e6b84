/*
 * tests/test-quant.c — the block formats of quantized weights: the table of ggml's types against
 * the sizes gguf-py's GGML_QUANT_SIZES gives, the byte arithmetic of rows, and the scalar
 * reference against ggml's own output (tests/data/quant, made by make_reference.sh from
 * ggml-quants.c): every readable type's dequantization of ggml's blocks equal to ggml's floats
 * bit for bit, and our quantization of the same inputs equal to ggml's bytes. MLX's affine
 * formats (not ggml's): their ids, and groups worked out by hand — codes, scales, biases and
 * the values mx.dequantize gives — at 4 and 8 bits with f32, f16 and bf16 scales.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "llmem/status.h"
#include "quant/quant.h"
#include "testutil.h"

#define N    256 /* values a reference row */
#define ROWS 12  /* rows of input.f32 */

static void test_table(void **state) {
    (void)state;
    /* (type, values a block, bytes a block) as gguf-py's constants.py lists them */
    const int64_t want[][3] = {
        {LLMEM_QTYPE_F32, 1, 4},      {LLMEM_QTYPE_F16, 1, 2},        {LLMEM_QTYPE_BF16, 1, 2},
        {LLMEM_QTYPE_Q4_0, 32, 18},   {LLMEM_QTYPE_Q4_1, 32, 20},     {LLMEM_QTYPE_Q5_0, 32, 22},
        {LLMEM_QTYPE_Q5_1, 32, 24},   {LLMEM_QTYPE_Q8_0, 32, 34},     {LLMEM_QTYPE_Q8_1, 32, 40},
        {LLMEM_QTYPE_Q2_K, 256, 84},  {LLMEM_QTYPE_Q3_K, 256, 110},   {LLMEM_QTYPE_Q4_K, 256, 144},
        {LLMEM_QTYPE_Q5_K, 256, 176}, {LLMEM_QTYPE_Q6_K, 256, 210},   {LLMEM_QTYPE_Q8_K, 256, 292},
        {LLMEM_QTYPE_IQ4_NL, 32, 18}, {LLMEM_QTYPE_IQ4_XS, 256, 136}, {LLMEM_QTYPE_MXFP4, 32, 17},
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        const struct llmem_qtype_info *t = llmem_qtype_info((int)want[i][0]);
        assert_non_null(t);
        assert_int_equal(t->block_elems, want[i][1]);
        assert_int_equal(t->block_bytes, want[i][2]);
    }
    /* what llmem reads: the float types, the legacy ones and the K types */
    const int readable[] = {LLMEM_QTYPE_F32,  LLMEM_QTYPE_F16,  LLMEM_QTYPE_BF16, LLMEM_QTYPE_Q8_0,
                            LLMEM_QTYPE_Q4_0, LLMEM_QTYPE_Q4_1, LLMEM_QTYPE_Q5_0, LLMEM_QTYPE_Q5_1,
                            LLMEM_QTYPE_Q2_K, LLMEM_QTYPE_Q3_K, LLMEM_QTYPE_Q4_K, LLMEM_QTYPE_Q5_K,
                            LLMEM_QTYPE_Q6_K};
    int n = 0;
    for (int t = 0; t < LLMEM_QTYPE_COUNT; t++)
        n += llmem_qtype_info(t) != NULL && llmem_qtype_info(t)->readable;
    assert_int_equal(n, (int)(sizeof(readable) / sizeof(readable[0])));
    for (size_t i = 0; i < sizeof(readable) / sizeof(readable[0]); i++)
        assert_true(llmem_qtype_info(readable[i])->readable);
    /* retired and unknown ids */
    assert_null(llmem_qtype_info(4));
    assert_null(llmem_qtype_info(31));
    assert_null(llmem_qtype_info(-1));
    assert_null(llmem_qtype_info(LLMEM_QTYPE_COUNT));
    assert_string_equal(llmem_qtype_name(5), "unknown");
    assert_string_equal(llmem_qtype_name(LLMEM_QTYPE_Q4_K), "q4_K");
}

static void test_bytes(void **state) {
    (void)state;
    assert_int_equal(llmem_qtype_bytes(LLMEM_QTYPE_Q4_K, 4096), 16 * 144);
    assert_int_equal(llmem_qtype_bytes(LLMEM_QTYPE_Q8_0, 64), 68);
    assert_int_equal(llmem_qtype_bytes(LLMEM_QTYPE_F16, 3), 6);
    assert_int_equal(llmem_qtype_bytes(LLMEM_QTYPE_Q8_0, 0), 0);
    assert_int_equal(llmem_qtype_bytes(LLMEM_QTYPE_Q4_K, 100), -1); /* not whole blocks */
    assert_int_equal(llmem_qtype_bytes(LLMEM_QTYPE_Q8_0, -32), -1);
    assert_int_equal(llmem_qtype_bytes(4, 32), -1);
    assert_int_equal(llmem_qtype_bytes(LLMEM_QTYPE_F32, INT64_MAX / 2), -1); /* overflows */
}

/* ---- the references ----------------------------------------------------------------------- */

/* tests/data/quant/<name>, which must be `len` bytes long. */
static void *load(const char *name, size_t len) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/quant/%s", LLMEM_TEST_DATA, name);
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        fail_msg("cannot open %s", path);
    void *p = malloc(len + 1);
    assert_non_null(p);
    size_t got = fread(p, 1, len + 1, f);
    fclose(f);
    if (got != len)
        fail_msg("%s: %zu bytes, want %zu", path, got, len);
    return p;
}

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

/* The first value where two float arrays differ as bits, or −1. */
static int64_t first_float_diff(const float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (bits(a[i]) != bits(b[i]))
            return i;
    return -1;
}

static int64_t first_byte_diff(const uint8_t *a, const uint8_t *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (a[i] != b[i])
            return i;
    return -1;
}

static const int readable_types[] = {
    LLMEM_QTYPE_F32,  LLMEM_QTYPE_F16,  LLMEM_QTYPE_BF16, LLMEM_QTYPE_Q4_0, LLMEM_QTYPE_Q4_1,
    LLMEM_QTYPE_Q5_0, LLMEM_QTYPE_Q5_1, LLMEM_QTYPE_Q8_0, LLMEM_QTYPE_Q2_K, LLMEM_QTYPE_Q3_K,
    LLMEM_QTYPE_Q4_K, LLMEM_QTYPE_Q5_K, LLMEM_QTYPE_Q6_K,
};
#define N_READABLE ((int)(sizeof(readable_types) / sizeof(readable_types[0])))

/* ggml's blocks of the input rows (F32: the rows themselves) and ggml's floats from them. */
static void load_type(int type, uint8_t **q, float **deq) {
    const int64_t row_bytes = llmem_qtype_bytes(type, N);
    char name[64];
    if (type == LLMEM_QTYPE_F32) {
        *q = load("input.f32", (size_t)(ROWS * row_bytes));
        *deq = load("input.f32", sizeof(float) * ROWS * N);
        return;
    }
    snprintf(name, sizeof(name), "%s.q", llmem_qtype_name(type));
    *q = load(name, (size_t)(ROWS * row_bytes));
    snprintf(name, sizeof(name), "%s.f32", llmem_qtype_name(type));
    *deq = load(name, sizeof(float) * ROWS * N);
}

/* Our dequantization of ggml's blocks, row by row and in one call, equals ggml's floats bit for
 * bit: the input rows' blocks and a row of random blocks (scales of every finite f16, quants of
 * every bit pattern). */
static void test_dequantize_reference(void **state) {
    (void)state;
    float *y = malloc(sizeof(float) * ROWS * N);
    assert_non_null(y);
    for (int k = 0; k < N_READABLE; k++) {
        const int type = readable_types[k];
        const char *name = llmem_qtype_name(type);
        const int64_t row_bytes = llmem_qtype_bytes(type, N);
        uint8_t *q;
        float *want;
        load_type(type, &q, &want);
        for (int r = 0; r < ROWS; r++) {
            memset(y + r * N, 0xa5, sizeof(float) * N);
            assert_int_equal(llmem_quant_dequantize_row(type, q + r * row_bytes, y + r * N, N),
                             LLMEM_OK);
            int64_t i = first_float_diff(y + r * N, want + r * N, N);
            if (i >= 0)
                fail_msg("%s row %d value %lld: %08x, ggml %08x", name, r, (long long)i,
                         bits(y[r * N + i]), bits(want[r * N + i]));
        }
        memset(y, 0, sizeof(float) * ROWS * N);
        assert_int_equal(llmem_quant_dequantize_row(type, q, y, ROWS * N), LLMEM_OK);
        assert_int_equal(first_float_diff(y, want, ROWS * N), -1);
        free(q);
        free(want);

        char file[64];
        snprintf(file, sizeof(file), "%s.rand.q", name);
        q = load(file, (size_t)row_bytes);
        snprintf(file, sizeof(file), "%s.rand.f32", name);
        want = load(file, sizeof(float) * N);
        assert_int_equal(llmem_quant_dequantize_row(type, q, y, N), LLMEM_OK);
        int64_t i = first_float_diff(y, want, N);
        if (i >= 0)
            fail_msg("%s random blocks, value %lld: %08x, ggml %08x", name, (long long)i,
                     bits(y[i]), bits(want[i]));
        free(q);
        free(want);
    }
    free(y);
}

/* Blocks at an odd address (a GGUF row starts anywhere) decode to the same floats. */
static void test_dequantize_unaligned(void **state) {
    (void)state;
    float *y = malloc(sizeof(float) * N);
    uint8_t *buf = malloc((size_t)llmem_qtype_bytes(LLMEM_QTYPE_F32, N) + 1);
    assert_true(y != NULL && buf != NULL);
    for (int k = 0; k < N_READABLE; k++) {
        const int type = readable_types[k];
        const int64_t row_bytes = llmem_qtype_bytes(type, N);
        uint8_t *q;
        float *want;
        load_type(type, &q, &want);
        memcpy(buf + 1, q + 2 * row_bytes, (size_t)row_bytes); /* row 2 */
        assert_int_equal(llmem_quant_dequantize_row(type, buf + 1, y, N), LLMEM_OK);
        assert_int_equal(first_float_diff(y, want + 2 * N, N), -1);
        free(q);
        free(want);
    }
    free(buf);
    free(y);
}

/* Our quantization of the input rows equals ggml's bytes: quantize_row_*_ref for the block types,
 * GGML_FP32_TO_FP16/BF16 for the half types; also a row quantized in two calls of whole blocks. */
static void test_quantize_reference(void **state) {
    (void)state;
    float *x = load("input.f32", sizeof(float) * ROWS * N);
    uint8_t *out = malloc(sizeof(float) * ROWS * N);
    assert_non_null(out);
    for (int k = 0; k < N_READABLE; k++) {
        const int type = readable_types[k];
        const char *name = llmem_qtype_name(type);
        const int64_t row_bytes = llmem_qtype_bytes(type, N);
        uint8_t *want;
        float *deq;
        load_type(type, &want, &deq);
        for (int r = 0; r < ROWS; r++) {
            memset(out, 0x5a, (size_t)row_bytes);
            assert_int_equal(llmem_quant_quantize_row(type, x + r * N, out, N), LLMEM_OK);
            int64_t i = first_byte_diff(out, want + r * row_bytes, row_bytes);
            if (i >= 0)
                fail_msg("%s row %d byte %lld: %02x, ggml %02x", name, r, (long long)i, out[i],
                         want[r * row_bytes + i]);
        }
        /* the first half and the second, for types with more than one block a row */
        const int64_t be = llmem_qtype_info(type)->block_elems;
        if (be < N) {
            const int64_t half = N / 2 / be * be;
            const int64_t half_bytes = llmem_qtype_bytes(type, half);
            assert_int_equal(llmem_quant_quantize_row(type, x, out, half), LLMEM_OK);
            assert_int_equal(llmem_quant_quantize_row(type, x + half, out + half_bytes, N - half),
                             LLMEM_OK);
            assert_int_equal(first_byte_diff(out, want, row_bytes), -1);
        }
        free(want);
        free(deq);
    }
    /* Q8_K, the activations of the K types' dot products (not a weight type llmem reads) */
    const int64_t q8k = llmem_qtype_bytes(LLMEM_QTYPE_Q8_K, N);
    uint8_t *want = load("q8_K.q", (size_t)(ROWS * q8k));
    assert_int_equal(llmem_quant_quantize_row(LLMEM_QTYPE_Q8_K, x, out, ROWS * N), LLMEM_OK);
    int64_t i = first_byte_diff(out, want, ROWS * q8k);
    if (i >= 0)
        fail_msg("q8_K byte %lld: %02x, ggml %02x", (long long)i, out[i], want[i]);
    free(want);
    free(out);
    free(x);
}

/* ---- bulk: many more rows, checked by hash ----------------------------------------------- */

#define BULK_ROWS  4096
#define BULK_CHUNK 256

/* make_reference.c's bulk_uniform and bulk_row, the same float operations: 24 random bits as a
 * float in [0, 1), and rows of five shapes at four scales. */
static float bulk_uniform(uint64_t *st) {
    return (float)(llmem_splitmix64_next(st) >> 40) * 0x1p-24f;
}

static void bulk_row(int r, float *x) {
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

/* make_reference.c's random_blocks: random bytes, the f16 scales at these offsets made finite. */
static void random_blocks(int type, int r, uint8_t *q, int64_t row_bytes) {
    int at[2] = {-1, -1};
    switch (type) {
    case LLMEM_QTYPE_Q4_0:
    case LLMEM_QTYPE_Q5_0:
    case LLMEM_QTYPE_Q8_0: at[0] = 0; break;
    case LLMEM_QTYPE_Q4_1:
    case LLMEM_QTYPE_Q5_1:
    case LLMEM_QTYPE_Q4_K:
    case LLMEM_QTYPE_Q5_K: at[0] = 0, at[1] = 2; break;
    case LLMEM_QTYPE_Q2_K: at[0] = 80, at[1] = 82; break;
    case LLMEM_QTYPE_Q3_K: at[0] = 108; break;
    case LLMEM_QTYPE_Q6_K: at[0] = 208; break;
    default: break;
    }
    uint64_t st = 0x4a4d0000u + (uint64_t)r;
    for (int64_t i = 0; i < row_bytes; i++)
        q[i] = (uint8_t)(bulk_uniform(&st) * 256.0f);
    const struct llmem_qtype_info *t = llmem_qtype_info(type);
    for (int64_t b = 0; b < N / t->block_elems; b++) {
        for (int f = 0; f < 2; f++) {
            if (at[f] < 0)
                continue;
            uint8_t *h = q + b * t->block_bytes + at[f];
            if ((h[1] & 0x7c) == 0x7c)
                h[1] ^= 0x40;
        }
    }
}

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static int type_by_name(const char *name) {
    for (int t = 0; t < LLMEM_QTYPE_COUNT; t++)
        if (llmem_qtype_info(t) != NULL && strcmp(llmem_qtype_name(t), name) == 0)
            return t;
    fail_msg("bulk.txt: unknown type %s", name);
    return -1;
}

/* bulk.txt: for 4096 more rows per type, the hashes of ggml's bytes (quantize) and of ggml's
 * floats from random blocks (dequantize), a hash every 256 rows; ours must give the same. */
static void test_bulk_reference(void **state) {
    (void)state;
    char path[4096];
    snprintf(path, sizeof(path), "%s/quant/bulk.txt", LLMEM_TEST_DATA);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    float x[N], y[N];
    uint8_t q[4 * N];
    char line[4096];
    int n_lines = 0;
    while (fgets(line, sizeof(line), f) != NULL) {
        if (line[0] == '#')
            continue;
        char op[16], name[16];
        int at = 0;
        assert_int_equal(sscanf(line, "%15s %15s%n", op, name, &at), 2);
        const int type = type_by_name(name);
        const int dequant = strcmp(op, "dequantize") == 0;
        assert_true(dequant || strcmp(op, "quantize") == 0);
        const int64_t row_bytes = llmem_qtype_bytes(type, N);
        const char *p = line + at;
        uint64_t h = 0xcbf29ce484222325ull;
        for (int r = 0; r < BULK_ROWS; r++) {
            memset(q, 0, (size_t)row_bytes);
            if (dequant) {
                random_blocks(type, r, q, row_bytes);
                assert_int_equal(llmem_quant_dequantize_row(type, q, y, N), LLMEM_OK);
                h = fnv1a(h, y, sizeof(y));
            } else {
                bulk_row(r, x);
                assert_int_equal(llmem_quant_quantize_row(type, x, q, N), LLMEM_OK);
                h = fnv1a(h, q, (size_t)row_bytes);
            }
            if ((r + 1) % BULK_CHUNK == 0) {
                unsigned long long want;
                int used = 0;
                assert_int_equal(sscanf(p, " %llx%n", &want, &used), 1);
                p += used;
                if (h != (uint64_t)want)
                    fail_msg("%s %s: rows %d..%d differ from ggml's", op, name, r + 1 - BULK_CHUNK,
                             r);
                h = 0xcbf29ce484222325ull;
            }
        }
        n_lines++;
    }
    fclose(f);
    assert_int_equal(n_lines, 2 * N_READABLE + 1); /* + quantize q8_K */
}

/* The half conversions of values the quantized types never see: NaNs, infinities, ±0, the ties
 * of f16 and bf16 rounding, the edges of f16's range and its subnormals. */
static void test_convert_special(void **state) {
    (void)state;
    float *s = load("special.f32", sizeof(float) * N);
    uint8_t out[2 * N];
    const int types[] = {LLMEM_QTYPE_F16, LLMEM_QTYPE_BF16};
    for (int k = 0; k < 2; k++) {
        char name[64];
        snprintf(name, sizeof(name), "%s.special.q", llmem_qtype_name(types[k]));
        uint8_t *want = load(name, 2 * N);
        assert_int_equal(llmem_quant_quantize_row(types[k], s, out, N), LLMEM_OK);
        int64_t i = first_byte_diff(out, want, 2 * N);
        if (i >= 0)
            fail_msg("%s value %lld (%08x): byte %02x, ggml %02x", name, (long long)(i / 2),
                     bits(s[i / 2]), out[i], want[i]);
        free(want);
    }
    free(s);
}

/* Every f16: its f32 is its exact value (a NaN stays a NaN of its sign, made quiet), and back to
 * f16 it is itself (a NaN: 0x7e00 with its sign). Every bf16 likewise. */
static void test_convert_exhaustive(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        const float f = llmem_quant_f16_to_f32((uint16_t)h);
        const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
        const int neg = (h & 0x8000u) != 0;
        if (e == 0x1f && m != 0) {
            assert_true(isnan(f));
            assert_int_equal(bits(f), (neg ? 0x80000000u : 0) | 0x7fc00000u | (m << 13));
            assert_int_equal(llmem_quant_f32_to_f16(f), (neg ? 0x8000u : 0) | 0x7e00u);
            continue;
        }
        const double mag = e == 0x1f ? INFINITY
                           : e == 0  ? ldexp((double)m, -24)
                                     : ldexp((double)(m | 0x400u), (int)e - 25);
        assert_true((double)f == (neg ? -mag : mag));
        assert_int_equal(signbit(f) != 0, neg);
        assert_int_equal(llmem_quant_f32_to_f16(f), h);

        const float b = llmem_quant_bf16_to_f32((uint16_t)h);
        assert_int_equal(bits(b), h << 16);
        if (!isnan(b))
            assert_int_equal(llmem_quant_f32_to_bf16(b), h);
        else
            assert_int_equal(llmem_quant_f32_to_bf16(b), h | 0x40u);
    }
}

/* Refusals: an unknown or retired id and a length that is not whole blocks are EINVAL, a type
 * llmem does not read (or cannot write) EUNSUPPORTED; none of them logs (the caller names the
 * tensor), and none touches dst. */
static void test_errors(void **state) {
    (void)state;
    uint8_t src[512] = {0};
    float dst[512];
    uint8_t qdst[512];
    memset(dst, 0x11, sizeof(dst));
    memset(qdst, 0x22, sizeof(qdst));
    tu_count_errors(LLMEM_LOG_DEBUG);
    const int bad_ids[] = {-1, 4, 5, 31, LLMEM_QTYPE_COUNT, 1000};
    for (size_t i = 0; i < sizeof(bad_ids) / sizeof(bad_ids[0]); i++) {
        assert_int_equal(llmem_quant_dequantize_row(bad_ids[i], src, dst, 32), LLMEM_EINVAL);
        assert_int_equal(llmem_quant_quantize_row(bad_ids[i], dst, qdst, 32), LLMEM_EINVAL);
    }
    assert_int_equal(llmem_quant_dequantize_row(LLMEM_QTYPE_Q4_K, src, dst, 100), LLMEM_EINVAL);
    assert_int_equal(llmem_quant_dequantize_row(LLMEM_QTYPE_Q8_0, src, dst, 33), LLMEM_EINVAL);
    assert_int_equal(llmem_quant_dequantize_row(LLMEM_QTYPE_Q8_0, src, dst, -32), LLMEM_EINVAL);
    assert_int_equal(llmem_quant_dequantize_row(LLMEM_QTYPE_F16, src, dst, -1), LLMEM_EINVAL);
    assert_int_equal(llmem_quant_quantize_row(LLMEM_QTYPE_Q6_K, dst, qdst, 128), LLMEM_EINVAL);
    assert_int_equal(llmem_quant_quantize_row(LLMEM_QTYPE_Q4_0, dst, qdst, -32), LLMEM_EINVAL);
    const int unread[] = {LLMEM_QTYPE_Q8_1,   LLMEM_QTYPE_Q8_K, LLMEM_QTYPE_IQ2_XXS,
                          LLMEM_QTYPE_IQ4_NL, LLMEM_QTYPE_I8,   LLMEM_QTYPE_F64,
                          LLMEM_QTYPE_TQ1_0,  LLMEM_QTYPE_MXFP4};
    for (size_t i = 0; i < sizeof(unread) / sizeof(unread[0]); i++) {
        const int64_t n = llmem_qtype_info(unread[i])->block_elems;
        assert_int_equal(llmem_quant_dequantize_row(unread[i], src, dst, n), LLMEM_EUNSUPPORTED);
        if (unread[i] != LLMEM_QTYPE_Q8_K)
            assert_int_equal(llmem_quant_quantize_row(unread[i], dst, qdst, n), LLMEM_EUNSUPPORTED);
    }
    for (size_t i = 0; i < sizeof(dst); i++)
        assert_int_equal(((uint8_t *)dst)[i], 0x11);
    for (size_t i = 0; i < sizeof(qdst); i++)
        assert_int_equal(qdst[i], 0x22);
    /* no values: nothing to do, and fine */
    assert_int_equal(llmem_quant_dequantize_row(LLMEM_QTYPE_Q4_K, NULL, NULL, 0), LLMEM_OK);
    assert_int_equal(llmem_quant_quantize_row(LLMEM_QTYPE_F32, NULL, NULL, 0), LLMEM_OK);
    assert_int_equal(tu_error_lines, 0);
    tu_count_errors_stop();
}

/* ---- MLX's affine formats ------------------------------------------------------------------ */

static void test_mlx_table(void **state) {
    (void)state;
    const int scale_types[] = {LLMEM_QTYPE_F32, LLMEM_QTYPE_F16, LLMEM_QTYPE_BF16};
    int seen[LLMEM_QTYPE_MLX_COUNT] = {0};
    for (int bits = 4; bits <= 8; bits += 4)
        for (int group = 32; group <= 128; group *= 2)
            for (int s = 0; s < 3; s++) {
                int t = llmem_qtype_mlx(bits, group, scale_types[s]);
                assert_true(t >= LLMEM_QTYPE_MLX_FIRST &&
                            t < LLMEM_QTYPE_MLX_FIRST + LLMEM_QTYPE_MLX_COUNT);
                seen[t - LLMEM_QTYPE_MLX_FIRST]++;
                int b, g, st;
                assert_int_equal(llmem_qtype_mlx_params(t, &b, &g, &st), 1);
                assert_int_equal(b, bits);
                assert_int_equal(g, group);
                assert_int_equal(st, scale_types[s]);
                const struct llmem_qtype_info *info = llmem_qtype_info(t);
                assert_non_null(info);
                assert_true(info->readable);
                assert_int_equal(info->block_elems, group);
                assert_int_equal(info->block_bytes, group * bits / 8);
                /* a row's codes: cols · bits / 32 words */
                assert_int_equal(llmem_qtype_bytes(t, 384), 384 * bits / 8);
                assert_int_equal(llmem_qtype_bytes(t, group + 16), -1);
            }
    for (int i = 0; i < LLMEM_QTYPE_MLX_COUNT; i++)
        assert_int_equal(seen[i], 1);
    assert_string_equal(llmem_qtype_name(llmem_qtype_mlx(4, 64, LLMEM_QTYPE_BF16)),
                        "mlx_q4_g64_bf16");
    assert_string_equal(llmem_qtype_name(llmem_qtype_mlx(8, 128, LLMEM_QTYPE_F32)),
                        "mlx_q8_g128_f32");
    /* what MLX has and llmem does not read, and what MLX does not have */
    assert_int_equal(llmem_qtype_mlx(3, 64, LLMEM_QTYPE_BF16), -1);
    assert_int_equal(llmem_qtype_mlx(2, 64, LLMEM_QTYPE_BF16), -1);
    assert_int_equal(llmem_qtype_mlx(4, 48, LLMEM_QTYPE_BF16), -1);
    assert_int_equal(llmem_qtype_mlx(4, 64, LLMEM_QTYPE_Q8_0), -1);
    assert_int_equal(llmem_qtype_mlx_params(LLMEM_QTYPE_Q4_K, NULL, NULL, NULL), 0);
    assert_int_equal(
        llmem_qtype_mlx_params(LLMEM_QTYPE_MLX_FIRST + LLMEM_QTYPE_MLX_COUNT, NULL, NULL, NULL), 0);
    assert_null(llmem_qtype_info(LLMEM_QTYPE_MLX_FIRST - 1));
    assert_null(llmem_qtype_info(LLMEM_QTYPE_MLX_FIRST + LLMEM_QTYPE_MLX_COUNT));
}

/* Groups worked out by hand. A word holds 32 / bits codes, code k in bits [k·bits, (k+1)·bits);
 * value = R(R(q · scale) + bias), R rounding to the scales' dtype (to nearest, ties to even). */
static void test_mlx_known_answers(void **state) {
    (void)state;
    float out[32];

    /* 4 bits, f32 scale 0.5 and bias −3: words 0x76543210 and 0xFEDCBA98 are the codes 0 … 15
     * (−3, −2.5, …, 4.5); 0x0F0F0F0F is 15, 0, 15, 0, …; 0x00000001 is 1 then seven 0s. */
    {
        const uint32_t codes[4] = {0x76543210u, 0xFEDCBA98u, 0x0F0F0F0Fu, 0x00000001u};
        const float scale = 0.5f, bias = -3.0f;
        const float want[32] = {-3.0f, -2.5f, -2.0f, -1.5f, -1.0f, -0.5f, 0.0f,  0.5f,
                                1.0f,  1.5f,  2.0f,  2.5f,  3.0f,  3.5f,  4.0f,  4.5f,
                                4.5f,  -3.0f, 4.5f,  -3.0f, 4.5f,  -3.0f, 4.5f,  -3.0f,
                                -2.5f, -3.0f, -3.0f, -3.0f, -3.0f, -3.0f, -3.0f, -3.0f};
        assert_int_equal(llmem_quant_dequantize_mlx_row(llmem_qtype_mlx(4, 32, LLMEM_QTYPE_F32),
                                                        codes, &scale, &bias, out, 32),
                         LLMEM_OK);
        assert_memory_equal(out, want, sizeof(want));
    }
    /* 4 bits, f32 scale 0.1f, bias −0.3f: code 3 is fl(3 · 0.1f) = 0.3f (0x3e99999a), plus −0.3f:
     * exactly 0 — a fused multiply-add would give −2^−27; code 7: fl(0.7f) − 0.3f =
     * 0x1.999998p−2 (fused: 0x1.99999ap−2); code 0: −0.3f; code 15: 0x1.333334p+0. */
    {
        const uint32_t codes[4] = {0x00000F73u, 0, 0, 0}; /* 3, 7, 15, then 0s */
        const float scale = 0.1f, bias = -0.3f;
        assert_int_equal(llmem_quant_dequantize_mlx_row(llmem_qtype_mlx(4, 32, LLMEM_QTYPE_F32),
                                                        codes, &scale, &bias, out, 32),
                         LLMEM_OK);
        assert_true(out[0] == 0.0f && !signbit(out[0]));
        assert_true(out[1] == 0x1.999998p-2f);
        assert_true(out[2] == 0x1.333334p+0f);
        for (int i = 3; i < 32; i++)
            assert_true(out[i] == -0.3f);
    }
    /* 8 bits, bf16 scale 0x3F81 (1.0078125) and bias 0x3F80 (1.0). Word 0x80030100 holds the
     * codes 0, 1, 3, 128; 0x000000FF holds 255, 0, 0, 0.
     *   q 0:   0 → 0 + 1 = 1
     *   q 1:   1.0078125 (a bf16) → + 1 = 2.0078125, halfway between the bf16s 2 and 2.015625:
     *          the even one, 2
     *   q 3:   3.0234375, halfway between 3.015625 and 3.03125 → 3.03125; + 1 = 4.03125 (a bf16)
     *   q 128: 129 → 130
     *   q 255: 256.9921875 → 256 (bf16s are 2 apart there); + 1 = 257, halfway → the even, 256
     *          (f32 arithmetic would give 257.9921875) */
    {
        const uint32_t codes[8] = {0x80030100u, 0x000000FFu, 0, 0, 0, 0, 0, 0};
        const uint16_t scale = 0x3F81, bias = 0x3F80;
        float want[32];
        for (int i = 0; i < 32; i++)
            want[i] = 1.0f;
        want[1] = 2.0f;
        want[2] = 4.03125f;
        want[3] = 130.0f;
        want[4] = 256.0f;
        assert_int_equal(llmem_quant_dequantize_mlx_row(llmem_qtype_mlx(8, 32, LLMEM_QTYPE_BF16),
                                                        codes, &scale, &bias, out, 32),
                         LLMEM_OK);
        assert_memory_equal(out, want, sizeof(want));
    }
    /* 4 bits, f16 scale 0x3C01 (1 + 2^−10) and bias 0xC000 (−2), group 64 (the second group's
     * scale 0x4000 = 2, bias 0x3800 = 0.5):
     *   q 15: 15.0146484375 → the f16 15.015625 (f16s are 2^−7 apart there); − 2 = 13.015625
     *         (f32 arithmetic: 13.0146484375)
     *   q 1:  1.0009765625 (an f16) − 2 = −0.9990234375 (an f16)
     *   q 0:  −2; second group: q 9 → 18.5, q 0 → 0.5 */
    {
        uint32_t codes[16] = {0x000001F0u};
        codes[8] = 0x00000009u;
        const uint16_t scales[2] = {0x3C01, 0x4000}, biases[2] = {0xC000, 0x3800};
        float got[128], want[128];
        for (int i = 0; i < 64; i++)
            want[i] = -2.0f;
        for (int i = 64; i < 128; i++)
            want[i] = 0.5f;
        want[1] = 13.015625f;
        want[2] = -0.9990234375f;
        want[64] = 18.5f;
        assert_int_equal(llmem_quant_dequantize_mlx_row(llmem_qtype_mlx(4, 64, LLMEM_QTYPE_F16),
                                                        codes, scales, biases, got, 128),
                         LLMEM_OK);
        assert_memory_equal(got, want, sizeof(want));
    }
    /* 8 bits, f32, group 128: codes i (0 … 127) in order, scale −0.25, bias 10 → 10 − i/4; the
     * codes read at any alignment */
    {
        uint8_t buf[4 * 32 + 1];
        for (int i = 0; i < 128; i++)
            buf[1 + i] = (uint8_t)i; /* little-endian words: code k of word j is byte 4j + k */
        const float scale = -0.25f, bias = 10.0f;
        float got[128];
        assert_int_equal(llmem_quant_dequantize_mlx_row(llmem_qtype_mlx(8, 128, LLMEM_QTYPE_F32),
                                                        buf + 1, &scale, &bias, got, 128),
                         LLMEM_OK);
        for (int i = 0; i < 128; i++)
            assert_true(got[i] == 10.0f - (float)i / 4.0f);
    }
    /* errors: not an MLX type, a length that is not whole groups; the row form refuses MLX's */
    const uint32_t codes[8] = {0};
    const float one = 1.0f;
    assert_int_equal(llmem_quant_dequantize_mlx_row(LLMEM_QTYPE_Q4_0, codes, &one, &one, out, 32),
                     LLMEM_EINVAL);
    assert_int_equal(llmem_quant_dequantize_mlx_row(llmem_qtype_mlx(4, 32, LLMEM_QTYPE_F32), codes,
                                                    &one, &one, out, 16),
                     LLMEM_EINVAL);
    assert_int_equal(
        llmem_quant_dequantize_row(llmem_qtype_mlx(4, 32, LLMEM_QTYPE_F32), codes, out, 32),
        LLMEM_EINVAL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mlx_table),
        cmocka_unit_test(test_mlx_known_answers),
        cmocka_unit_test(test_table),
        cmocka_unit_test(test_bytes),
        cmocka_unit_test(test_dequantize_reference),
        cmocka_unit_test(test_dequantize_unaligned),
        cmocka_unit_test(test_quantize_reference),
        cmocka_unit_test(test_bulk_reference),
        cmocka_unit_test(test_convert_special),
        cmocka_unit_test(test_convert_exhaustive),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
