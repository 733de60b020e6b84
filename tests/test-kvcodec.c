/*
 * tests/test-kvcodec.c — the KV storage formats of kv/codec.h: half and bfloat16 conversions
 * (known values, ties, subnormals, inf/NaN, exhaustive round trips), the byte size of every
 * format against the planner's table, round-trip error bounds on Gaussian rows and on rows with
 * outlier channels (and that rotation helps q4 there), the rotation's orthonormality, the fused
 * dot/axpy against the decoded rows on every instruction set this CPU has, degenerate groups and
 * invalid head sizes.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#include "kv/codec.h"
#include "kv/codec_internal.h"
#include "llmem/plan.h"
#include "llmem/status.h"
#include "llmem/sys.h"

#define MAX_D  LLMEM_KV_MAX_HEAD_DIM
#define N_ROWS 256

static const int head_dims[] = {64, 128, 256};
#define N_HEAD_DIMS ((int)(sizeof(head_dims) / sizeof(head_dims[0])))

/* ---- seeded data ----------------------------------------------------------------------------- */

struct rng {
    uint64_t s;
};

static uint64_t rng_next(struct rng *r) {
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return r->s;
}

/* uniform in (0, 1) */
static double rng_uniform(struct rng *r) {
    return ((double)(rng_next(r) >> 11) + 0.5) / 9007199254740992.0;
}

/* Box–Muller */
static float rng_gauss(struct rng *r) {
    double u = rng_uniform(r), v = rng_uniform(r);
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

enum data_kind { DATA_GAUSS = 0, DATA_OUTLIER };
static const char *const data_names[] = {"gauss", "outlier"};

/* One row: N(0, 1) elements; with outliers, four fixed channels (the same in every row, as in
 * real keys) are 20 times larger. */
static void make_row(struct rng *r, enum data_kind kind, int d, float *x) {
    for (int i = 0; i < d; i++)
        x[i] = rng_gauss(r);
    if (kind == DATA_OUTLIER) {
        const int channels[4] = {1, 7, 33, d - 2};
        for (int k = 0; k < 4; k++)
            x[channels[k]] *= 20.0f;
    }
}

static struct llmem_kv_codec make_codec(enum llmem_kv_format f, int d, int rotate) {
    struct llmem_kv_codec c;
    assert_int_equal(llmem_kv_codec_init(&c, f, d, rotate, 0x5eed), LLMEM_OK);
    return c;
}

static const char *fmt_name(enum llmem_kv_format f) {
    return llmem_kv_format_name(f);
}

/* ---- f16 and bf16 ---------------------------------------------------------------------------- */

static float bits_f32(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof(f));
    return f;
}

static uint32_t f32_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof(b));
    return b;
}

static void test_f16_known_values(void **state) {
    (void)state;
    static const struct {
        float x;
        uint16_t h;
    } cases[] = {
        {0.0f, 0x0000},
        {-0.0f, 0x8000},
        {1.0f, 0x3c00},
        {-2.0f, 0xc000},
        {0.5f, 0x3800},
        {0.1f, 0x2e66},
        {1.0f / 3.0f, 0x3555},
        {65504.0f, 0x7bff},
        {65519.99f, 0x7bff},
        {65520.0f, 0x7c00}, /* the tie above the largest half goes to even: infinity */
        {-65520.0f, 0xfc00},
        {1e10f, 0x7c00},
        {INFINITY, 0x7c00},
        {-INFINITY, 0xfc00},
        {0x1p-14f, 0x0400},        /* smallest normal */
        {0x1p-24f, 0x0001},        /* smallest subnormal */
        {0x1p-25f, 0x0000},        /* tie between 0 and 2^-24: even is 0 */
        {0x1.000002p-25f, 0x0001}, /* just above the tie */
        {0x3p-25f, 0x0002},        /* tie between 1 and 2 subnormal units: even is 2 */
        {0x5p-25f, 0x0002},        /* tie between 2 and 3: even is 2 */
        {0x1.ff8p-15f, 0x03ff},    /* largest subnormal */
        {0x1.ffcp-15f, 0x0400},    /* tie: to even, out of the subnormals */
        {-0x1p-24f, 0x8001},       /* negative subnormal */
        {1.0f + 0x1p-11f, 0x3c00}, /* tie: to even (0x3c00) */
        {1.0f + 0x3p-11f, 0x3c02}, /* tie: to even (0x3c02) */
        {0x1.002002p+0f, 0x3c01},  /* above the tie */
        {0x1p-149f, 0x0000},       /* f32 subnormal */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        uint16_t h = llmem_f32_to_f16(cases[i].x);
        if (h != cases[i].h)
            fail_msg("f32_to_f16(%a) = 0x%04x, expected 0x%04x", (double)cases[i].x, h, cases[i].h);
    }
    assert_true(llmem_f16_to_f32(0x3c00) == 1.0f);
    assert_true(llmem_f16_to_f32(0x0001) == 0x1p-24f);
    assert_true(llmem_f16_to_f32(0x03ff) == 1023.0f * 0x1p-24f);
    assert_true(llmem_f16_to_f32(0x7bff) == 65504.0f);
    assert_true(llmem_f16_to_f32(0xc000) == -2.0f);
    assert_true(llmem_f16_to_f32(0x7c00) == INFINITY);
    assert_true(llmem_f16_to_f32(0xfc00) == -INFINITY);
    assert_true(f32_bits(llmem_f16_to_f32(0x8000)) == 0x80000000u);
    assert_true(isnan(llmem_f16_to_f32(0x7e00)));
    assert_true(isnan(llmem_f16_to_f32(0x7c01)));
    assert_true(isnan(llmem_f16_to_f32(0xfe00)));
    uint16_t hn = llmem_f32_to_f16(NAN);
    assert_true((hn & 0x7c00) == 0x7c00 && (hn & 0x03ff) != 0);
    assert_true(isnan(llmem_f16_to_f32(llmem_f32_to_f16(bits_f32(0x7f800001u))))); /* sNaN */
    assert_true(isnan(llmem_f16_to_f32(llmem_f32_to_f16(-NAN))));
}

/* Every half survives the trip through f32; the midpoints between neighbouring halves round to
 * even, and one f32 step off a midpoint rounds to the nearer half. */
static void test_f16_exhaustive(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        float f = llmem_f16_to_f32((uint16_t)h);
        if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0) {
            assert_true(isnan(f));
            continue;
        }
        assert_int_equal(llmem_f32_to_f16(f), h);
        uint32_t mag = h & 0x7fffu;
        if (mag >= 0x7bffu) /* the next half up is infinity (or this is infinity) */
            continue;
        /* midpoint between h and h+1 (same sign): exact in f32 */
        float next = llmem_f16_to_f32((uint16_t)(h + 1));
        float mid = (float)(((double)f + (double)next) / 2.0);
        uint16_t even = (h & 1u) ? (uint16_t)(h + 1) : (uint16_t)h;
        assert_int_equal(llmem_f32_to_f16(mid), even);
        float below = nextafterf(mid, f), above = nextafterf(mid, next);
        assert_int_equal(llmem_f32_to_f16(below), h);
        assert_int_equal(llmem_f32_to_f16(above), h + 1);
    }
    /* the tie above 65504 (f16 max) */
    assert_int_equal(llmem_f32_to_f16(nextafterf(65520.0f, 0.0f)), 0x7bff);
    assert_int_equal(llmem_f32_to_f16(65520.0f), 0x7c00);
}

/* f32 → f16 against the compiler's own conversion over random f32 bit patterns (a compiler with
 * _Float16: the group "float16"). */
static void test_f16_matches_compiler(void **state) {
    (void)state;
#if defined(__FLT16_MAX__)
    struct rng r = {0x1234567};
    for (int i = 0; i < 1000000; i++) {
        float x = bits_f32((uint32_t)rng_next(&r));
        if (isnan(x))
            continue;
        _Float16 ref = (_Float16)x;
        uint16_t rb;
        memcpy(&rb, &ref, sizeof(rb));
        if (llmem_f32_to_f16(x) != rb)
            fail_msg("f32_to_f16(%a) = 0x%04x, the compiler says 0x%04x", (double)x,
                     llmem_f32_to_f16(x), rb);
    }
#else
    tu_skip("the compiler has no _Float16");
#endif
}

static void test_bf16(void **state) {
    (void)state;
    assert_int_equal(llmem_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(llmem_f32_to_bf16(-2.0f), 0xc000);
    assert_int_equal(llmem_f32_to_bf16(0.0f), 0x0000);
    assert_int_equal(llmem_f32_to_bf16(-0.0f), 0x8000);
    assert_int_equal(llmem_f32_to_bf16(bits_f32(0x3f808000u)), 0x3f80); /* tie → even */
    assert_int_equal(llmem_f32_to_bf16(bits_f32(0x3f818000u)), 0x3f82); /* tie → even */
    assert_int_equal(llmem_f32_to_bf16(bits_f32(0x3f808001u)), 0x3f81); /* above the tie */
    assert_int_equal(llmem_f32_to_bf16(bits_f32(0x3f807fffu)), 0x3f80); /* below the tie */
    assert_int_equal(llmem_f32_to_bf16(3.14159265f), 0x4049);
    assert_int_equal(llmem_f32_to_bf16(INFINITY), 0x7f80);
    assert_int_equal(llmem_f32_to_bf16(-INFINITY), 0xff80);
    assert_int_equal(llmem_f32_to_bf16(bits_f32(0x7f7fffffu)), 0x7f80); /* overflows to inf */
    assert_int_equal(llmem_f32_to_bf16(bits_f32(0x00000001u)), 0x0000); /* tiny subnormal */
    assert_int_equal(llmem_f32_to_bf16(bits_f32(0x00018000u)), 0x0002); /* subnormal tie */
    uint16_t nan = llmem_f32_to_bf16(bits_f32(0x7f800001u)); /* a NaN with payload only low */
    assert_true((nan & 0x7f80) == 0x7f80 && (nan & 0x7f) != 0);
    assert_true(isnan(llmem_bf16_to_f32(nan)));
    assert_true(isnan(llmem_bf16_to_f32(llmem_f32_to_bf16(NAN))));
    assert_true(llmem_bf16_to_f32(0x3f80) == 1.0f);
    assert_true(llmem_bf16_to_f32(0xff80) == -INFINITY);
    for (uint32_t b = 0; b < 0x10000u; b++) {
        float f = llmem_bf16_to_f32((uint16_t)b);
        if (isnan(f))
            continue;
        assert_int_equal(llmem_f32_to_bf16(f), b);
    }
}

/* ---- sizes and arguments --------------------------------------------------------------------- */

static void test_sizes_match_plan(void **state) {
    (void)state;
    static const int dims[] = {32, 64, 128, 256, 512, 1024};
    struct rng r = {42};
    for (int f = 0; f < LLMEM_KV_FORMAT_COUNT; f++) {
        const struct llmem_kv_format_info *info = llmem_kv_format_info((enum llmem_kv_format)f);
        for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++) {
            int d = dims[di];
            for (int rot = 0; rot <= 1; rot++) {
                struct llmem_kv_codec c = make_codec((enum llmem_kv_format)f, d, rot);
                assert_int_equal(c.head_dim, d);
                assert_int_equal(c.key_bytes, (size_t)(d / 32) * (size_t)info->key_group_bytes);
                assert_int_equal(c.value_bytes, (size_t)(d / 32) * (size_t)info->value_group_bytes);
                assert_int_equal(c.rotate_keys, f == LLMEM_KV_FORMAT_Q4 && rot);
                assert_int_equal(c.rotate_values,
                                 (f == LLMEM_KV_FORMAT_Q4 && rot) || f == LLMEM_KV_FORMAT_TQ);
                /* encoding writes every byte of the row and nothing past it */
                float x[MAX_D];
                make_row(&r, DATA_GAUSS, d, x);
                for (int value = 0; value <= 1; value++) {
                    size_t bytes = value ? c.value_bytes : c.key_bytes;
                    uint8_t a[MAX_D * 4 + 64], b[MAX_D * 4 + 64];
                    memset(a, 0x00, sizeof(a));
                    memset(b, 0xff, sizeof(b));
                    if (value) {
                        llmem_kv_encode_value(&c, x, a);
                        llmem_kv_encode_value(&c, x, b);
                    } else {
                        llmem_kv_encode_key(&c, x, a);
                        llmem_kv_encode_key(&c, x, b);
                    }
                    assert_memory_equal(a, b, bytes);
                    for (size_t i = bytes; i < bytes + 64; i++)
                        assert_true(a[i] == 0x00 && b[i] == 0xff);
                }
            }
        }
    }
}

static void expect_einval(enum llmem_kv_format f, int d, int rotate, const char *phrase) {
    struct llmem_kv_codec c;
    int rc = llmem_kv_codec_init(&c, f, d, rotate, 1);
    if (rc != LLMEM_EINVAL)
        fail_msg("%s head_dim %d rotate %d: %d, expected LLMEM_EINVAL", fmt_name(f), d, rotate, rc);
    if (strstr(llmem_last_error(), phrase) == NULL ||
        strstr(llmem_last_error(), "llmem_kv_codec_init") != llmem_last_error())
        fail_msg("message \"%s\" lacks \"%s\"", llmem_last_error(), phrase);
}

static void test_invalid_head_dim(void **state) {
    (void)state;
    static const int bad[] = {0, -32, -1, 16, 31, 48, 100, 1056, 2048};
    for (int f = 0; f < LLMEM_KV_FORMAT_COUNT; f++)
        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
            for (int rot = 0; rot <= 1; rot++)
                expect_einval((enum llmem_kv_format)f, bad[i], rot, "multiple of 32");
    /* multiples of 32 that are not powers of two: only the rotating formats refuse them */
    static const int odd[] = {96, 160, 192, 480, 992};
    for (size_t i = 0; i < sizeof(odd) / sizeof(odd[0]); i++) {
        int d = odd[i];
        expect_einval(LLMEM_KV_FORMAT_Q4, d, 1, "power of two");
        expect_einval(LLMEM_KV_FORMAT_TQ, d, 0, "power of two");
        expect_einval(LLMEM_KV_FORMAT_TQ, d, 1, "power of two");
        static const enum llmem_kv_format fine[] = {LLMEM_KV_FORMAT_F32, LLMEM_KV_FORMAT_F16,
                                                    LLMEM_KV_FORMAT_BF16, LLMEM_KV_FORMAT_Q8};
        for (size_t k = 0; k < 4; k++)
            for (int rot = 0; rot <= 1; rot++)
                (void)make_codec(fine[k], d, rot);
        struct llmem_kv_codec c = make_codec(LLMEM_KV_FORMAT_Q4, d, 0);
        assert_false(c.rotate_keys || c.rotate_values);
        /* and such a codec round-trips like any other */
        struct rng r = {7};
        float x[MAX_D], y[MAX_D];
        uint8_t buf[MAX_D * 4];
        make_row(&r, DATA_GAUSS, d, x);
        llmem_kv_encode_key(&c, x, buf);
        llmem_kv_decode_key(&c, buf, y);
        for (int j = 0; j < d; j++)
            assert_true(fabsf(x[j] - y[j]) < 0.5f);
    }
    expect_einval((enum llmem_kv_format)LLMEM_KV_FORMAT_COUNT, 128, 0, "unknown KV format");
    expect_einval((enum llmem_kv_format)(-1), 128, 0, "unknown KV format");
}

/* ---- round-trip error ------------------------------------------------------------------------ */

/* Relative RMS error bounds, asserted: [format][data kind][0 keys, 1 values]; measured values are
 * in the table at the top of src/kv/codec.c. */
struct bound {
    enum llmem_kv_format format;
    int rotate;
    float gauss[2];
    float outlier[2];
};
static const struct bound bounds[] = {
    {LLMEM_KV_FORMAT_F32, 0, {0, 0}, {0, 0}},
    {LLMEM_KV_FORMAT_F16, 0, {2.5e-4f, 2.5e-4f}, {2.5e-4f, 2.5e-4f}},
    {LLMEM_KV_FORMAT_BF16, 0, {2.0e-3f, 2.0e-3f}, {2.0e-3f, 2.0e-3f}},
    {LLMEM_KV_FORMAT_Q8, 0, {6.5e-3f, 6.5e-3f}, {1.4e-2f, 1.4e-2f}},
    {LLMEM_KV_FORMAT_Q4, 1, {9.0e-2f, 9.0e-2f}, {8.0e-2f, 8.0e-2f}},
    {LLMEM_KV_FORMAT_Q4, 0, {9.0e-2f, 9.0e-2f}, {1.35e-1f, 1.35e-1f}},
    {LLMEM_KV_FORMAT_TQ, 0, {5.5e-3f, 1.9e-1f}, {8.5e-3f, 1.85e-1f}},
};

/* ‖x − x̂‖ / ‖x‖ over N_ROWS rows, x̂ brought back to the original domain; also the largest
 * element error relative to max(|x|, 2^-14) (the f16 normal range). */
/* Encodes and decodes one row, undoing the rotation: x̂ in the original domain. */
static void roundtrip(const struct llmem_kv_codec *c, int value, const float *x, float *y) {
    uint8_t buf[MAX_D * 4];
    if (value) {
        llmem_kv_encode_value(c, x, buf);
        llmem_kv_decode_value(c, buf, y);
        if (c->rotate_values)
            llmem_kv_rotate_inverse(c, y);
    } else {
        llmem_kv_encode_key(c, x, buf);
        llmem_kv_decode_key(c, buf, y);
        if (c->rotate_keys)
            llmem_kv_rotate_inverse(c, y);
    }
}

static double roundtrip_error(const struct llmem_kv_codec *c, int value, enum data_kind kind,
                              uint64_t seed, double *max_rel) {
    struct rng r = {seed};
    double num = 0, den = 0;
    *max_rel = 0;
    for (int row = 0; row < N_ROWS; row++) {
        float x[MAX_D], y[MAX_D];
        make_row(&r, kind, c->head_dim, x);
        roundtrip(c, value, x, y);
        for (int i = 0; i < c->head_dim; i++) {
            double e = (double)x[i] - (double)y[i];
            num += e * e;
            den += (double)x[i] * (double)x[i];
            double rel = fabs(e) / fmax(fabs((double)x[i]), 0x1p-14);
            *max_rel = fmax(*max_rel, rel);
        }
    }
    return sqrt(num / den);
}

static void test_roundtrip_error(void **state) {
    (void)state;
    print_message("    format         kind     K/V   d=64       d=128      d=256      bound\n");
    for (size_t b = 0; b < sizeof(bounds) / sizeof(bounds[0]); b++) {
        const struct bound *bd = &bounds[b];
        for (int kind = 0; kind <= 1; kind++) {
            for (int value = 0; value <= 1; value++) {
                float limit = kind == DATA_GAUSS ? bd->gauss[value] : bd->outlier[value];
                char line[256];
                int len = snprintf(
                    line, sizeof(line), "    %-4s%-11s%-9s%-6s", fmt_name(bd->format),
                    bd->format == LLMEM_KV_FORMAT_Q4 ? (bd->rotate ? " rotate" : " plain") : "",
                    data_names[kind], value ? "V" : "K");
                for (int di = 0; di < N_HEAD_DIMS; di++) {
                    struct llmem_kv_codec c = make_codec(bd->format, head_dims[di], bd->rotate);
                    double max_rel;
                    double err = roundtrip_error(&c, value, (enum data_kind)kind,
                                                 0x1000u + (uint64_t)di, &max_rel);
                    len += snprintf(line + len, sizeof(line) - (size_t)len, "%-11.3e", err);
                    if (err > (double)limit)
                        fail_msg("%s rotate=%d %s %s d=%d: relative RMS error %.4e > %.4e",
                                 fmt_name(bd->format), bd->rotate, data_names[kind],
                                 value ? "values" : "keys", head_dims[di], err, (double)limit);
                    /* the plain formats are also bounded element by element */
                    if (bd->format == LLMEM_KV_FORMAT_F32)
                        assert_true(max_rel == 0.0);
                    if (bd->format == LLMEM_KV_FORMAT_F16)
                        assert_true(max_rel <= 0x1p-11);
                    if (bd->format == LLMEM_KV_FORMAT_BF16)
                        assert_true(max_rel <= 0x1p-8);
                }
                snprintf(line + len, sizeof(line) - (size_t)len, "%.2e\n", (double)limit);
                print_message("%s", line);
            }
        }
    }
}

static void test_rotation_helps_q4_outliers(void **state) {
    (void)state;
    for (int di = 0; di < N_HEAD_DIMS; di++) {
        struct llmem_kv_codec rot = make_codec(LLMEM_KV_FORMAT_Q4, head_dims[di], 1);
        struct llmem_kv_codec plain = make_codec(LLMEM_KV_FORMAT_Q4, head_dims[di], 0);
        for (int value = 0; value <= 1; value++) {
            double m;
            double e_rot = roundtrip_error(&rot, value, DATA_OUTLIER, 99, &m);
            double e_plain = roundtrip_error(&plain, value, DATA_OUTLIER, 99, &m);
            print_message("    q4 outliers d=%d %s: rotated %.4f, plain %.4f (%.2fx)\n",
                          head_dims[di], value ? "V" : "K", e_rot, e_plain, e_plain / e_rot);
            assert_true(e_rot < e_plain);
            assert_true(e_rot * 1.5 < e_plain);
        }
    }
}

/* ---- rotation -------------------------------------------------------------------------------- */

static double norm(const float *x, int n) {
    double s = 0;
    for (int i = 0; i < n; i++)
        s += (double)x[i] * (double)x[i];
    return sqrt(s);
}

static double dot(const float *a, const float *b, int n) {
    double s = 0;
    for (int i = 0; i < n; i++)
        s += (double)a[i] * (double)b[i];
    return s;
}

static void test_rotation_orthonormal(void **state) {
    (void)state;
    static const int dims[] = {32, 64, 128, 256, 512, 1024};
    struct rng r = {2024};
    for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++) {
        int d = dims[di];
        struct llmem_kv_codec c = make_codec(LLMEM_KV_FORMAT_Q4, d, 1);
        for (int trial = 0; trial < 20; trial++) {
            float x[MAX_D], q[MAX_D], y[MAX_D], z[MAX_D], rq[MAX_D];
            make_row(&r, trial % 2 ? DATA_OUTLIER : DATA_GAUSS, d, x);
            make_row(&r, DATA_GAUSS, d, q);
            memcpy(y, x, sizeof(float) * (size_t)d);
            llmem_kv_rotate(&c, y);
            double nx = norm(x, d);
            assert_true(fabs(norm(y, d) - nx) <= 1e-6 * nx);
            /* Rᵀ R x = x and R Rᵀ x = x */
            memcpy(z, y, sizeof(float) * (size_t)d);
            llmem_kv_rotate_inverse(&c, z);
            double e = 0;
            for (int i = 0; i < d; i++)
                e += ((double)z[i] - x[i]) * ((double)z[i] - x[i]);
            assert_true(sqrt(e) <= 1e-6 * nx);
            memcpy(z, x, sizeof(float) * (size_t)d);
            llmem_kv_rotate_inverse(&c, z);
            llmem_kv_rotate(&c, z);
            e = 0;
            for (int i = 0; i < d; i++)
                e += ((double)z[i] - x[i]) * ((double)z[i] - x[i]);
            assert_true(sqrt(e) <= 1e-6 * nx);
            /* (Rq)·(Rx) = q·x */
            memcpy(rq, q, sizeof(float) * (size_t)d);
            llmem_kv_rotate(&c, rq);
            assert_true(fabs(dot(rq, y, d) - dot(q, x, d)) <= 1e-6 * norm(q, d) * nx);
        }
    }
}

/* R = H·D/√d exactly: the fast transform against the explicit matrix. */
static void test_rotation_is_hadamard(void **state) {
    (void)state;
    int d = 64;
    struct llmem_kv_codec c = make_codec(LLMEM_KV_FORMAT_TQ, d, 0);
    struct rng r = {5};
    float x[MAX_D], y[MAX_D];
    make_row(&r, DATA_GAUSS, d, x);
    memcpy(y, x, sizeof(float) * (size_t)d);
    llmem_kv_rotate(&c, y);
    for (int i = 0; i < d; i++) {
        double s = 0;
        for (int j = 0; j < d; j++) {
            int h = __builtin_popcount((unsigned)(i & j)) & 1 ? -1 : 1;
            s += h * (double)c.signs[j] * x[j];
        }
        s /= sqrt((double)d);
        assert_true(fabs(s - y[i]) <= 1e-6);
    }
    /* the signs: ±1, about half negative, fixed by the seed, different across seeds */
    struct llmem_kv_codec c2 = make_codec(LLMEM_KV_FORMAT_TQ, d, 0), c3;
    assert_int_equal(llmem_kv_codec_init(&c3, LLMEM_KV_FORMAT_TQ, d, 0, 0x5eee), LLMEM_OK);
    int neg = 0, same_as_other_seed = 0;
    for (int i = 0; i < MAX_D; i++) {
        assert_true(c.signs[i] == 1.0f || c.signs[i] == -1.0f);
        assert_true(c.signs[i] == c2.signs[i]);
        neg += c.signs[i] < 0;
        same_as_other_seed += c.signs[i] == c3.signs[i];
    }
    assert_true(neg > 400 && neg < 624);
    assert_true(same_as_other_seed < 624);
    /* seed 0 is as good as any other */
    struct llmem_kv_codec c0;
    assert_int_equal(llmem_kv_codec_init(&c0, LLMEM_KV_FORMAT_TQ, 256, 0, 0), LLMEM_OK);
    neg = 0;
    for (int i = 0; i < MAX_D; i++)
        neg += c0.signs[i] < 0;
    assert_true(neg > 400 && neg < 624);
    /* a larger head uses the same first signs */
    struct llmem_kv_codec big = make_codec(LLMEM_KV_FORMAT_TQ, 1024, 0);
    assert_memory_equal(big.signs, c.signs, sizeof(c.signs));
}

/* ---- fused operations ------------------------------------------------------------------------ */

static const char *isa_name(enum llmem_kv_isa isa) {
    return isa == LLMEM_KV_ISA_AVX512 ? "avx512" : isa == LLMEM_KV_ISA_AVX2 ? "avx2" : "scalar";
}

/* For every instruction set available: dot_key = Σ q·decode_key and axpy_value = acc + w·decode
 * within f32 rounding, for every format and size, with rows at odd addresses too. */
static void test_dot_axpy_match_decode(void **state) {
    (void)state;
    enum llmem_kv_isa best = llmem_kv_isa_best();
    uint32_t feat = llmem_sys_isa_features();
    char names[LLMEM_SYS_ARCH_MAX];
    print_message("    cpu: %s\n", llmem_sys_isa_string(feat, names, sizeof(names)));
    if ((feat & LLMEM_ISA_AVX512F) && (feat & LLMEM_ISA_AVX512BW) && (feat & LLMEM_ISA_AVX512VL) &&
        (feat & LLMEM_ISA_AVX2) && (feat & LLMEM_ISA_FMA) && (feat & LLMEM_ISA_F16C))
        assert_int_equal(best, LLMEM_KV_ISA_AVX512);
    else if ((feat & LLMEM_ISA_AVX2) && (feat & LLMEM_ISA_FMA) && (feat & LLMEM_ISA_F16C))
        assert_int_equal(best, LLMEM_KV_ISA_AVX2);
    else
        assert_int_equal(best, LLMEM_KV_ISA_SCALAR);
    assert_int_equal(llmem_kv_kernels()->isa, best); /* the default is the best */
    for (int isa = LLMEM_KV_ISA_SCALAR; isa <= (int)best; isa++) {
        assert_int_equal(llmem_kv_codec_set_isa((enum llmem_kv_isa)isa), isa);
        assert_int_equal(llmem_kv_kernels()->isa, isa);
        print_message("    kernels: %s\n", llmem_kv_kernels()->name);
        for (int f = 0; f < LLMEM_KV_FORMAT_COUNT; f++) {
            for (int di = 0; di < N_HEAD_DIMS; di++) {
                int d = head_dims[di];
                struct llmem_kv_codec c = make_codec((enum llmem_kv_format)f, d, 1);
                struct rng r = {0xabcdu + (uint64_t)(f * 16 + di)};
                for (int trial = 0; trial < 32; trial++) {
                    float x[MAX_D], q[MAX_D], dec[MAX_D], acc[MAX_D], acc0[MAX_D];
                    uint8_t storage[MAX_D * 4 + 8];
                    uint8_t *row = storage + trial % 8; /* any byte address */
                    make_row(&r, trial % 2 ? DATA_OUTLIER : DATA_GAUSS, d, x);
                    make_row(&r, DATA_GAUSS, d, q);
                    make_row(&r, DATA_GAUSS, d, acc0);
                    float w = rng_gauss(&r);

                    llmem_kv_encode_key(&c, x, row);
                    llmem_kv_decode_key(&c, row, dec);
                    double ref = 0, mag = 0;
                    for (int i = 0; i < d; i++) {
                        ref += (double)q[i] * dec[i];
                        mag += fabs((double)q[i] * dec[i]);
                    }
                    float got = llmem_kv_dot_key(&c, row, q);
                    if (fabs(got - ref) > d * 0x1p-24 * mag + 1e-30)
                        fail_msg("%s %s d=%d: dot_key %.9g, decoded dot %.9g", isa_name(isa),
                                 fmt_name(c.format), d, (double)got, ref);

                    llmem_kv_encode_value(&c, x, row);
                    llmem_kv_decode_value(&c, row, dec);
                    memcpy(acc, acc0, sizeof(float) * (size_t)d);
                    llmem_kv_axpy_value(&c, row, w, acc);
                    for (int i = 0; i < d; i++) {
                        double want = (double)acc0[i] + (double)w * dec[i];
                        double tol = 0x1p-23 * (fabs((double)acc0[i]) + fabs((double)w * dec[i]));
                        if (fabs(acc[i] - want) > tol)
                            fail_msg("%s %s d=%d: axpy_value[%d] %.9g, expected %.9g",
                                     isa_name(isa), fmt_name(c.format), d, i, (double)acc[i], want);
                    }
                }
            }
        }
    }
    llmem_kv_codec_force_scalar(0);
    assert_int_equal(llmem_kv_kernels()->isa, best);
}

/* The vector kernels agree with the portable ones on the same stored rows, for every format (a
 * CPU with vector kernels: the group "simd"). */
static void test_simd_matches_scalar(void **state) {
    (void)state;
    enum llmem_kv_isa best = llmem_kv_isa_best();
    assert_true(best != LLMEM_KV_ISA_SCALAR);
    static const int dims[] = {32, 64, 96, 128, 256, 1024};
    for (int f = 0; f < LLMEM_KV_FORMAT_COUNT; f++) {
        for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++) {
            int d = dims[di];
            int pow2 = (d & (d - 1)) == 0;
            if (f == LLMEM_KV_FORMAT_TQ && !pow2)
                continue;
            struct llmem_kv_codec c = make_codec((enum llmem_kv_format)f, d, pow2);
            struct rng r = {77 + (uint64_t)d};
            for (int trial = 0; trial < 16; trial++) {
                float x[MAX_D], q[MAX_D], acc0[MAX_D], acc_s[MAX_D], kdec[MAX_D], vdec[MAX_D];
                uint8_t kstore[MAX_D * 4 + 8], vstore[MAX_D * 4 + 8];
                uint8_t *key = kstore + trial % 8, *val = vstore + (trial + 3) % 8;
                make_row(&r, trial % 2 ? DATA_OUTLIER : DATA_GAUSS, d, x);
                make_row(&r, DATA_GAUSS, d, q);
                make_row(&r, DATA_GAUSS, d, acc0);
                float w = rng_gauss(&r);
                llmem_kv_encode_key(&c, x, key);
                llmem_kv_encode_value(&c, x, val);
                llmem_kv_decode_key(&c, key, kdec);
                llmem_kv_decode_value(&c, val, vdec);
                double mag = 0;
                for (int i = 0; i < d; i++)
                    mag += fabs((double)q[i] * kdec[i]);

                llmem_kv_codec_force_scalar(1);
                float dot_s = llmem_kv_dot_key(&c, key, q);
                memcpy(acc_s, acc0, sizeof(float) * (size_t)d);
                llmem_kv_axpy_value(&c, val, w, acc_s);
                for (int isa = LLMEM_KV_ISA_AVX2; isa <= (int)best; isa++) {
                    llmem_kv_codec_set_isa((enum llmem_kv_isa)isa);
                    float dot_v = llmem_kv_dot_key(&c, key, q);
                    if (fabs((double)dot_v - dot_s) > 2 * d * 0x1p-24 * mag)
                        fail_msg("%s %s d=%d: dot_key %.9g, scalar %.9g", isa_name(isa),
                                 fmt_name(c.format), d, (double)dot_v, (double)dot_s);
                    float acc_v[MAX_D];
                    memcpy(acc_v, acc0, sizeof(float) * (size_t)d);
                    llmem_kv_axpy_value(&c, val, w, acc_v);
                    for (int i = 0; i < d; i++) {
                        double tol = 0x1p-22 * (fabs((double)acc0[i]) + fabs((double)w * vdec[i]));
                        if (fabs((double)acc_v[i] - acc_s[i]) > tol)
                            fail_msg("%s %s d=%d: axpy_value[%d] %.9g, scalar %.9g", isa_name(isa),
                                     fmt_name(c.format), d, i, (double)acc_v[i], (double)acc_s[i]);
                    }
                }
            }
        }
    }
    llmem_kv_codec_force_scalar(0);
}

/* Attention's identity: scores on rotated keys with the rotated query, values accumulated in the
 * rotated domain and rotated back once. */
static void test_attention_in_rotated_domain(void **state) {
    (void)state;
    int d = 128, n = 64;
    struct llmem_kv_codec c = make_codec(LLMEM_KV_FORMAT_Q4, d, 1);
    struct llmem_kv_codec t = make_codec(LLMEM_KV_FORMAT_TQ, d, 1);
    struct rng r = {31337};
    float q[MAX_D], rq[MAX_D], x[MAX_D], dec[MAX_D];
    make_row(&r, DATA_GAUSS, d, q);
    memcpy(rq, q, sizeof(q));
    llmem_kv_rotate(&c, rq);
    float acc[MAX_D] = {0};
    double want[MAX_D] = {0};
    uint8_t buf[MAX_D * 4];
    for (int k = 0; k < n; k++) {
        make_row(&r, DATA_OUTLIER, d, x);
        llmem_kv_encode_key(&c, x, buf);
        llmem_kv_decode_key(&c, buf, dec);
        llmem_kv_rotate_inverse(&c, dec); /* the key as attention sees it */
        float s = llmem_kv_dot_key(&c, buf, rq);
        assert_true(fabs(s - dot(q, dec, d)) <= 1e-5 * norm(q, d) * norm(dec, d));
        float w = 1.0f / (float)n;
        llmem_kv_encode_value(&t, x, buf);
        llmem_kv_axpy_value(&t, buf, w, acc);
        llmem_kv_decode_value(&t, buf, dec);
        llmem_kv_rotate_inverse(&t, dec);
        for (int i = 0; i < d; i++)
            want[i] += (double)w * dec[i];
    }
    llmem_kv_rotate_inverse(&t, acc);
    for (int i = 0; i < d; i++)
        assert_true(fabs(acc[i] - want[i]) <= 1e-5);
}

/* ---- degenerate groups ----------------------------------------------------------------------- */

static int quantized(enum llmem_kv_format f) {
    return f == LLMEM_KV_FORMAT_Q8 || f == LLMEM_KV_FORMAT_Q4 || f == LLMEM_KV_FORMAT_TQ;
}

static void test_degenerate_groups(void **state) {
    (void)state;
    int d = 128;
    for (int f = 0; f < LLMEM_KV_FORMAT_COUNT; f++) {
        for (int rot = 0; rot <= 1; rot++) {
            struct llmem_kv_codec c = make_codec((enum llmem_kv_format)f, d, rot);
            for (int value = 0; value <= 1; value++) {
                int rotated = value ? c.rotate_values : c.rotate_keys;
                float x[MAX_D], y[MAX_D], clean[MAX_D];

                /* all zeros: exactly zero back */
                memset(x, 0, sizeof(x));
                roundtrip(&c, value, x, y);
                for (int i = 0; i < d; i++)
                    assert_true(y[i] == 0.0f);

                /* constant groups, and a zero group next to a busy one */
                if (!rotated) {
                    static const float consts[] = {0.37f, -5.5f, 1000.0f, 3e-3f};
                    for (size_t k = 0; k < 4; k++) {
                        for (int i = 0; i < d; i++)
                            x[i] = consts[k];
                        roundtrip(&c, value, x, y);
                        for (int i = 0; i < d; i++)
                            if (!(fabsf(y[i] - consts[k]) <= 0x1p-8f * fabsf(consts[k])))
                                fail_msg("%s %s constant %g → %g", fmt_name(c.format),
                                         value ? "V" : "K", (double)consts[k], (double)y[i]);
                    }
                    struct rng r = {3};
                    make_row(&r, DATA_GAUSS, d, x);
                    for (int i = 32; i < 64; i++)
                        x[i] = 0.0f;
                    roundtrip(&c, value, x, y);
                    for (int i = 32; i < 64; i++)
                        assert_true(y[i] == 0.0f);
                }

                /* huge and tiny finite values: quantized formats clamp the scale, stay finite */
                static const float scales[] = {1e30f, 1e6f, 7e4f, 1e-30f, 1e-6f};
                for (size_t k = 0; k < sizeof(scales) / sizeof(scales[0]); k++) {
                    struct rng r = {11 + k};
                    make_row(&r, DATA_GAUSS, d, x);
                    for (int i = 0; i < d; i++)
                        x[i] *= scales[k];
                    roundtrip(&c, value, x, y);
                    if (quantized(c.format))
                        for (int i = 0; i < d; i++)
                            assert_true(isfinite(y[i]));
                }

                /* inf and NaN: no trap; quantized rows decode to finite numbers; groups of a
                 * format without rotation that hold neither are untouched */
                static const float poison[] = {INFINITY, -INFINITY, NAN};
                for (size_t k = 0; k < 3; k++) {
                    for (int pattern = 0; pattern < 3; pattern++) {
                        struct rng r = {21};
                        make_row(&r, DATA_GAUSS, d, x);
                        roundtrip(&c, value, x, clean);
                        if (pattern == 0)
                            x[5] = poison[k]; /* one element */
                        else if (pattern == 1)
                            for (int i = 0; i < 32; i++) /* a whole group */
                                x[i] = poison[k];
                        else
                            for (int i = 0; i < d; i++) /* everything */
                                x[i] = poison[k];
                        roundtrip(&c, value, x, y);
                        uint8_t buf[MAX_D * 4];
                        float acc[MAX_D] = {0}, q[MAX_D];
                        for (int i = 0; i < d; i++)
                            q[i] = 1.0f;
                        llmem_kv_encode_key(&c, x, buf);
                        (void)llmem_kv_dot_key(&c, buf, q);
                        llmem_kv_encode_value(&c, x, buf);
                        llmem_kv_axpy_value(&c, buf, 0.5f, acc);
                        if (quantized(c.format))
                            for (int i = 0; i < d; i++)
                                assert_true(isfinite(y[i]));
                        if (!rotated && pattern < 2)
                            for (int i = 32; i < d; i++)
                                assert_true(y[i] == clean[i]);
                        if (c.format == LLMEM_KV_FORMAT_Q8 && !rotated && pattern == 0 &&
                            isnan(poison[k]))
                            assert_true(y[5] == 0.0f);
                    }
                }
            }
        }
    }
}

/* The tile kernel equals row-by-row accumulation, for every format, tile length and group. */
static void test_tile_kernel_matches(void **state) {
    (void)state;
    struct rng r = {0x7171};
    const int d = 128, T_max = 16;
    for (int isa = 0; isa <= (int)llmem_kv_isa_best(); isa++)
        for (int f = 0; f < LLMEM_KV_FORMAT_COUNT; f++) {
            llmem_kv_codec_set_isa((enum llmem_kv_isa)isa);
            struct llmem_kv_codec c = make_codec((enum llmem_kv_format)f, d, 1);
            size_t stride = c.value_bytes + 24; /* rows further apart than their size */
            uint8_t *rows = calloc((size_t)T_max, stride);
            float x[128], w[6 * 16], acc[6 * 130], ref[6 * 130];
            for (int t = 0; t < T_max; t++) {
                make_row(&r, DATA_GAUSS, d, x);
                llmem_kv_encode_value(&c, x, rows + (size_t)t * stride);
            }
            for (int G = 1; G <= 6; G++) {
                for (int T = 1; T <= T_max; T += 5) {
                    for (int i = 0; i < G * T; i++)
                        w[i] = (float)rng_uniform(&r);
                    for (int i = 0; i < 6 * 130; i++)
                        acc[i] = ref[i] = (float)i * 0.01f;
                    llmem_kv_axpy_value_tile(&c, rows, stride, T, w, G, acc, 130);
                    for (int t = 0; t < T; t++)
                        for (int g = 0; g < G; g++)
                            llmem_kv_axpy_value(&c, rows + (size_t)t * stride, w[g * T + t],
                                                ref + g * 130);
                    for (int i = 0; i < 6 * 130; i++)
                        assert_true(fabsf(acc[i] - ref[i]) <= 1e-5f * (1.0f + fabsf(ref[i])));
                }
            }
            free(rows);
        }
    llmem_kv_codec_force_scalar(0);
}

/* The GQA group kernels equal the per-head ones, for every instruction set, format and group
 * size. */
static void test_group_kernels_match(void **state) {
    (void)state;
    struct rng r = {0x9a9a};
    const int d = 128;
    for (int isa = 0; isa <= (int)llmem_kv_isa_best(); isa++)
        for (int f = 0; f < LLMEM_KV_FORMAT_COUNT; f++) {
            llmem_kv_codec_set_isa((enum llmem_kv_isa)isa);
            struct llmem_kv_codec c = make_codec((enum llmem_kv_format)f, d, 1);
            float x[128], q[8 * 128], s[8], w[8], acc[8 * 130], ref[8 * 130];
            uint8_t key[1024], value[1024];
            make_row(&r, DATA_GAUSS, d, x);
            llmem_kv_encode_key(&c, x, key);
            llmem_kv_encode_value(&c, x, value);
            for (int i = 0; i < 8 * d; i++)
                q[i] = rng_gauss(&r);
            for (int G = 1; G <= 8; G++) {
                llmem_kv_dot_key_group(&c, key, q, G, s);
                for (int g = 0; g < G; g++) {
                    float one = llmem_kv_dot_key(&c, key, q + g * d);
                    assert_true(fabsf(s[g] - one) <= 1e-5f * (1.0f + fabsf(one)));
                    w[g] = rng_gauss(&r);
                }
                for (int i = 0; i < 8 * 130; i++)
                    acc[i] = ref[i] = (float)i * 0.01f;
                llmem_kv_axpy_value_group(&c, value, w, G, acc, 130);
                for (int g = 0; g < G; g++)
                    llmem_kv_axpy_value(&c, value, w[g], ref + g * 130);
                for (int i = 0; i < 8 * 130; i++)
                    assert_true(fabsf(acc[i] - ref[i]) <= 1e-5f * (1.0f + fabsf(ref[i])));
            }
        }
    llmem_kv_codec_force_scalar(0);
}

static const char *no_vector_kernels(void) {
    return llmem_kv_isa_best() == LLMEM_KV_ISA_SCALAR ? "no vector kernels on this CPU" : NULL;
}

static const char *no_float16(void) {
#if defined(__FLT16_MAX__)
    return NULL;
#else
    return "the compiler has no _Float16";
#endif
}

int main(int argc, char **argv) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f16_known_values),
        cmocka_unit_test(test_f16_exhaustive),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_sizes_match_plan),
        cmocka_unit_test(test_invalid_head_dim),
        cmocka_unit_test(test_roundtrip_error),
        cmocka_unit_test(test_rotation_helps_q4_outliers),
        cmocka_unit_test(test_rotation_orthonormal),
        cmocka_unit_test(test_rotation_is_hadamard),
        cmocka_unit_test(test_dot_axpy_match_decode),
        cmocka_unit_test(test_attention_in_rotated_domain),
        cmocka_unit_test(test_degenerate_groups),
        cmocka_unit_test(test_group_kernels_match),
        cmocka_unit_test(test_tile_kernel_matches),
    };
    const struct CMUnitTest simd[] = {cmocka_unit_test(test_simd_matches_scalar)};
    const struct CMUnitTest float16[] = {cmocka_unit_test(test_f16_matches_compiler)};
    const struct tu_group groups[] = {
        TU_GROUP("kvcodec", tests, NULL),
        TU_GROUP("simd", simd, no_vector_kernels),
        TU_GROUP("float16", float16, no_float16),
    };
    return tu_main(argc, argv, groups, sizeof(groups) / sizeof(groups[0]));
}
