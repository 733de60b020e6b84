/*
 * tests/test-gguf.c — the GGUF reader (model/gguf.h): the fixtures of tests/data/gguf read as
 * gguf-py reads them (facts.json, written by make_fixtures.py), the typed getters, the geometry
 * and configuration from GGUF metadata, and hostile files made from a valid one — each refused
 * with one error line naming the key or tensor, never a crash.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/json.h"
#include "llmem/config.h"
#include "model/gguf.h"
#include "quant/quant.h"
#include "testutil.h"

#define GGUF_DATA LLMEM_TEST_DATA "/gguf"

/* ---- helpers -------------------------------------------------------------------------------- */

static cJSON *facts(void) {
    cJSON *root = NULL;
    assert_int_equal(llmem_json_parse_file(GGUF_DATA "/facts.json", 1 << 20, &root), LLMEM_OK);
    return root;
}

static int64_t jint(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    assert_non_null(v);
    assert_true(cJSON_IsNumber(v));
    return (int64_t)v->valuedouble;
}

static uint8_t *read_all(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)n);
    assert_non_null(b);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *size = (size_t)n;
    return b;
}

/* The position of the first occurrence of the GGUF string s (its u64 length, then its bytes):
 * where its bytes start. */
static size_t find_str(const uint8_t *b, size_t size, const char *s) {
    uint64_t len = strlen(s);
    for (size_t i = 8; i + len <= size; i++) {
        if (memcmp(b + i, s, len) == 0 && memcmp(b + i - 8, &len, 8) == 0)
            return i;
    }
    fail_msg("'%s' not found", s);
    return 0;
}

static void put_u32(uint8_t *b, size_t at, uint32_t v) {
    memcpy(b + at, &v, 4);
}

static void put_u64(uint8_t *b, size_t at, uint64_t v) {
    memcpy(b + at, &v, 8);
}

static uint64_t get_u64(const uint8_t *b, size_t at) {
    uint64_t v;
    memcpy(&v, b + at, 8);
    return v;
}

/* Where a tensor info's fields are: n_dims, dims, type, offset. */
struct ti_pos {
    size_t n_dims, dims, type, offset;
};

static struct ti_pos tensor_info(const uint8_t *b, size_t size, const char *name) {
    struct ti_pos p;
    p.n_dims = find_str(b, size, name) + strlen(name);
    uint32_t n;
    memcpy(&n, b + p.n_dims, 4);
    p.dims = p.n_dims + 4;
    p.type = p.dims + 8 * n;
    p.offset = p.type + 4;
    return p;
}

/* Parses the bytes; on failure checks the status, one error line, and that it names `phrase`. */
static void expect_refused(const uint8_t *b, size_t size, int want, const char *phrase) {
    struct llmem_gguf *g = NULL;
    tu_expect_failure(llmem_gguf_parse(b, size, "hostile.gguf", &g), want, phrase);
    assert_null(g);
}

/* ---- the fixtures against gguf-py ----------------------------------------------------------- */

static void check_value(const struct llmem_gguf *g, const char *key, const cJSON *want) {
    const struct llmem_gguf_kv *kv = llmem_gguf_find_key(g, key);
    assert_non_null(kv);
    int type = (int)jint(want, "type");
    assert_int_equal(kv->type, type);
    const cJSON *value = cJSON_GetObjectItemCaseSensitive(want, "value");
    switch (type) {
    case LLMEM_GGUF_U8:
    case LLMEM_GGUF_U16:
    case LLMEM_GGUF_U32:
    case LLMEM_GGUF_U64: {
        uint64_t v = 0;
        assert_int_equal(llmem_gguf_get_u64(g, key, &v), LLMEM_OK);
        /* doubles hold the JSON number: compare through the printed text for the big ones */
        char text[32];
        snprintf(text, sizeof(text), "%" PRIu64, v);
        char *printed = cJSON_PrintUnformatted(value);
        if (v < ((uint64_t)1 << 53))
            assert_int_equal((double)v, value->valuedouble);
        else
            assert_true(strtod(printed, NULL) == (double)v);
        free(printed);
        break;
    }
    case LLMEM_GGUF_I8:
    case LLMEM_GGUF_I16:
    case LLMEM_GGUF_I32: {
        int32_t v = 0;
        assert_int_equal(llmem_gguf_get_i32(g, key, &v), LLMEM_OK);
        assert_int_equal(v, (int64_t)value->valuedouble);
        break;
    }
    case LLMEM_GGUF_I64: {
        int64_t v;
        memcpy(&v, kv->value, 8);
        assert_true((double)v == value->valuedouble);
        break;
    }
    case LLMEM_GGUF_F32:
    case LLMEM_GGUF_F64: {
        double v = 0;
        assert_int_equal(llmem_gguf_get_f64(g, key, &v), LLMEM_OK);
        double w = cJSON_IsString(value) ? strtod(value->valuestring, NULL) : value->valuedouble;
        assert_true(v == w);
        break;
    }
    case LLMEM_GGUF_BOOL: {
        int v = -1;
        assert_int_equal(llmem_gguf_get_bool(g, key, &v), LLMEM_OK);
        assert_int_equal(v, cJSON_IsTrue(value));
        break;
    }
    case LLMEM_GGUF_STRING: {
        struct llmem_gguf_str s;
        assert_int_equal(llmem_gguf_get_string(g, key, &s), LLMEM_OK);
        assert_int_equal(s.len, strlen(value->valuestring));
        assert_memory_equal(s.ptr, value->valuestring, s.len);
        break;
    }
    case LLMEM_GGUF_ARRAY: {
        const struct llmem_gguf_kv *a = NULL;
        int elem = (int)jint(want, "elem_type");
        assert_int_equal(llmem_gguf_get_array(g, key, elem, &a), LLMEM_OK);
        assert_ptr_equal(a, kv);
        assert_int_equal(a->n, (uint64_t)jint(want, "n"));
        const cJSON *first = cJSON_GetObjectItemCaseSensitive(want, "first");
        uint64_t i = 0;
        const cJSON *e = NULL;
        cJSON_ArrayForEach(e, first) {
            if (elem == LLMEM_GGUF_STRING) {
                struct llmem_gguf_str s = llmem_gguf_array_str(a, i);
                assert_int_equal(s.len, strlen(e->valuestring));
                assert_memory_equal(s.ptr, e->valuestring, s.len);
            } else if (elem == LLMEM_GGUF_F32 || elem == LLMEM_GGUF_F64) {
                assert_true(llmem_gguf_array_float(a, i) == e->valuedouble);
            } else if (elem == LLMEM_GGUF_BOOL) {
                assert_int_equal(a->value[i], cJSON_IsTrue(e));
            } else {
                int64_t v;
                assert_int_equal(llmem_gguf_array_int(a, i, &v), LLMEM_OK);
                assert_true((double)v == e->valuedouble);
            }
            i++;
        }
        break;
    }
    default: fail_msg("key %s: type %d", key, type);
    }
}

static void check_file(const cJSON *f) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", GGUF_DATA,
             cJSON_GetObjectItemCaseSensitive(f, "file")->valuestring);
    struct llmem_gguf *g = NULL;
    assert_int_equal(llmem_gguf_open(path, &g), LLMEM_OK);
    assert_int_equal(g->size, jint(f, "bytes"));
    assert_int_equal(g->version, jint(f, "version"));
    assert_int_equal(g->alignment, jint(f, "alignment"));
    assert_int_equal(g->data_offset, jint(f, "data_offset"));

    const cJSON *kv = cJSON_GetObjectItemCaseSensitive(f, "kv");
    assert_int_equal(g->n_kv, cJSON_GetArraySize(kv));
    const cJSON *e = NULL;
    cJSON_ArrayForEach(e, kv) check_value(g, e->string, e);

    const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(f, "tensors");
    assert_int_equal(g->n_tensors, cJSON_GetArraySize(tensors));
    int64_t i = 0, n_bytes = 0, n_elements = 0;
    cJSON_ArrayForEach(e, tensors) {
        const char *name = cJSON_GetObjectItemCaseSensitive(e, "name")->valuestring;
        const struct llmem_gguf_tensor *t = llmem_gguf_find_tensor(g, name);
        assert_non_null(t);
        assert_ptr_equal(t, &g->tensors[i]); /* iteration is in file order */
        assert_string_equal(t->name, name);
        assert_int_equal(t->type, jint(e, "type"));
        const cJSON *dims = cJSON_GetObjectItemCaseSensitive(e, "dims");
        assert_int_equal(t->n_dims, cJSON_GetArraySize(dims));
        for (int d = 0; d < t->n_dims; d++)
            assert_int_equal(t->dims[d], (int64_t)cJSON_GetArrayItem(dims, d)->valuedouble);
        assert_int_equal(t->n_elements, jint(e, "n_elements"));
        assert_int_equal(t->n_bytes, jint(e, "n_bytes"));
        assert_int_equal(t->offset, jint(e, "offset"));
        assert_ptr_equal(t->data, g->base + g->data_offset + t->offset);
        n_bytes += t->n_bytes;
        n_elements += t->n_elements;
        i++;
    }
    assert_int_equal(g->n_bytes, n_bytes);
    assert_int_equal(g->n_elements, n_elements);
    assert_null(llmem_gguf_find_tensor(g, "no.such.tensor"));
    assert_null(llmem_gguf_find_key(g, "no.such.key"));

    /* The same bytes parsed from a buffer. */
    size_t size = 0;
    uint8_t *b = read_all(path, &size);
    struct llmem_gguf *h = NULL;
    assert_int_equal(llmem_gguf_parse(b, size, path, &h), LLMEM_OK);
    assert_int_equal(h->n_tensors, g->n_tensors);
    assert_int_equal(h->n_bytes, g->n_bytes);
    llmem_gguf_free(h);
    free(b);
    llmem_gguf_free(g);

    /* The geometry, through the path a model directory takes. */
    const cJSON *want = cJSON_GetObjectItemCaseSensitive(f, "geometry");
    struct llmem_model_geometry geom;
    assert_int_equal(llmem_model_geometry_load(path, &geom), LLMEM_OK);
    assert_string_equal(geom.arch, cJSON_GetObjectItemCaseSensitive(want, "arch")->valuestring);
    assert_int_equal(geom.n_layers, jint(want, "n_layers"));
    assert_int_equal(geom.hidden_size, jint(want, "hidden_size"));
    assert_int_equal(geom.n_heads, jint(want, "n_heads"));
    assert_int_equal(geom.n_kv_heads, jint(want, "n_kv_heads"));
    assert_int_equal(geom.head_dim, jint(want, "head_dim"));
    assert_int_equal(geom.intermediate_size, jint(want, "intermediate_size"));
    assert_int_equal(geom.vocab_size, jint(want, "vocab_size"));
    assert_int_equal(geom.max_context, jint(want, "max_context"));
    assert_int_equal(geom.tied_embeddings, jint(want, "tied_embeddings"));
    assert_int_equal(geom.attention_bias, jint(want, "attention_bias"));
    assert_int_equal(geom.qk_norm, jint(want, "qk_norm"));
    assert_int_equal(geom.sliding_window, 0);
    assert_int_equal(geom.weights_bytes, n_bytes);
    assert_int_equal(geom.n_params, n_elements);
    struct llmem_model_geometry again;
    assert_int_equal(llmem_model_geometry_load_config(path, &again), LLMEM_OK);
    assert_memory_equal(&again, &geom, sizeof(geom));
}

static void test_fixtures(void **state) {
    (void)state;
    cJSON *root = facts();
    assert_int_equal(cJSON_GetArraySize(root), 3);
    const cJSON *f = NULL;
    cJSON_ArrayForEach(f, root) check_file(f);
    cJSON_Delete(root);
    assert_int_equal(tu_error_lines, 0);
}

/* pycoder at Q4_K_M against its safetensors: the same parameters, K-quant types. */
static void test_pycoder(void **state) {
    (void)state;
    struct llmem_model_geometry gg, st;
    assert_int_equal(llmem_model_geometry_load(GGUF_DATA "/pycoder-q4_k_m.gguf", &gg), LLMEM_OK);
    assert_int_equal(llmem_model_geometry_load(LLMEM_SOURCE_DIR "/models/pycoder", &st), LLMEM_OK);
    assert_string_equal(gg.name, "pycoder");
    assert_int_equal(gg.n_params, st.n_params);
    assert_true(gg.weights_bytes < st.weights_bytes / 2);
    assert_int_equal(gg.quantized, 1); /* a device plans a dequantization slice for it */
    assert_int_equal(st.quantized, 0);
    assert_int_equal(llmem_geometry_kv_bytes_per_token(&gg),
                     llmem_geometry_kv_bytes_per_token(&st));
    struct llmem_gguf *g = NULL;
    assert_int_equal(llmem_gguf_open(GGUF_DATA "/pycoder-q4_k_m.gguf", &g), LLMEM_OK);
    int n_q4k = 0, n_q6k = 0;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        n_q4k += g->tensors[i].type == LLMEM_QTYPE_Q4_K;
        n_q6k += g->tensors[i].type == LLMEM_QTYPE_Q6_K;
    }
    assert_true(n_q4k > 0 && n_q6k > 0);
    llmem_gguf_free(g);

    struct llmem_model_config cfg;
    assert_int_equal(llmem_model_config_load(GGUF_DATA "/pycoder-q4_k_m.gguf", &cfg), LLMEM_OK);
    assert_int_equal(cfg.geom.n_layers, 6);
    assert_true(cfg.rms_norm_eps == (double)1e-5f);
    assert_true(cfg.rope_theta == 10000.0);
    assert_string_equal(cfg.rope_type, "default");
    assert_int_equal(cfg.rope_interleaved, 1);
    assert_int_equal(cfg.rope_freqs, 0);
    assert_string_equal(cfg.hidden_act, "silu");
    assert_non_null(cfg.layer_sliding);
    llmem_model_config_free(&cfg);
    assert_int_equal(tu_error_lines, 0);
}

static void test_config_qwen(void **state) {
    (void)state;
    struct llmem_model_config cfg;
    assert_int_equal(llmem_model_config_load(GGUF_DATA "/tiny-qwen3.gguf", &cfg), LLMEM_OK);
    assert_string_equal(cfg.geom.arch, "qwen3");
    assert_string_equal(cfg.geom.name, "tiny-qwen3");
    assert_true(cfg.rope_theta == 1000000.0);
    assert_true(cfg.rms_norm_eps == (double)1e-6f);
    assert_int_equal(cfg.rope_interleaved, 0);
    assert_int_equal(cfg.bos_id, 1);
    assert_int_equal(cfg.n_eos, 1);
    assert_int_equal(cfg.eos_ids[0], 2);
    llmem_model_config_free(&cfg);
    assert_int_equal(tu_error_lines, 0);
}

/* ---- typed getters -------------------------------------------------------------------------- */

static void test_getters(void **state) {
    (void)state;
    struct llmem_gguf *g = NULL;
    assert_int_equal(llmem_gguf_open(GGUF_DATA "/tiny-qwen3.gguf", &g), LLMEM_OK);
    uint32_t u32 = 0;
    int32_t i32 = 0;
    uint64_t u64 = 0;
    float f32 = 0;
    int b = 0;
    struct llmem_gguf_str s;
    const struct llmem_gguf_kv *a = NULL;

    /* integer widths a writer may use */
    assert_int_equal(llmem_gguf_get_u32(g, "qwen3.context_length", &u32), LLMEM_OK); /* u64 */
    assert_int_equal(u32, 4096);
    assert_int_equal(llmem_gguf_get_u32(g, "test.u8", &u32), LLMEM_OK);
    assert_int_equal(u32, 200);
    assert_int_equal(llmem_gguf_get_i32(g, "test.i8", &i32), LLMEM_OK);
    assert_int_equal(i32, -100);
    assert_int_equal(llmem_gguf_get_i32(g, "test.u16", &i32), LLMEM_OK);
    assert_int_equal(i32, 60000);
    assert_int_equal(llmem_gguf_get_u64(g, "test.u64", &u64), LLMEM_OK);
    assert_true(u64 == ((uint64_t)1 << 63) + 5);
    assert_int_equal(llmem_gguf_get_f32(g, "test.f32", &f32), LLMEM_OK);
    assert_true(f32 == 0.25f);
    assert_int_equal(llmem_gguf_get_bool(g, "test.bool", &b), LLMEM_OK);
    assert_int_equal(b, 1);
    assert_int_equal(llmem_gguf_get_string(g, "test.string", &s), LLMEM_OK);
    assert_int_equal(s.len, strlen("héllo"));

    /* absent: not logged */
    assert_int_equal(llmem_gguf_get_u32(g, "no.such.key", &u32), LLMEM_ENOENT);
    assert_int_equal(tu_error_lines, 0);

    /* the wrong type, or out of range: the key, the type it has, the type expected */
    tu_expect_failure(llmem_gguf_get_u32(g, "test.i8", &u32), LLMEM_EFORMAT,
                      "'test.i8': -100 (type i8) is out of range for u32");
    tu_expect_failure(llmem_gguf_get_u32(g, "test.u64", &u32), LLMEM_EFORMAT,
                      "'test.u64': 9223372036854775813 (type u64) is out of range for u32");
    tu_expect_failure(llmem_gguf_get_i32(g, "test.u32", &i32), LLMEM_EFORMAT, "test.u32");
    tu_expect_failure(llmem_gguf_get_u64(g, "test.i64", &u64), LLMEM_EFORMAT, "test.i64");
    tu_expect_failure(llmem_gguf_get_u32(g, "test.f32", &u32), LLMEM_EFORMAT,
                      "key 'test.f32' has type f32, expected u32");
    tu_expect_failure(llmem_gguf_get_f32(g, "test.string", &f32), LLMEM_EFORMAT,
                      "key 'test.string' has type string, expected f32 or f64");
    tu_expect_failure(llmem_gguf_get_bool(g, "test.u8", &b), LLMEM_EFORMAT,
                      "key 'test.u8' has type u8, expected bool");
    tu_expect_failure(llmem_gguf_get_string(g, "test.array_string", &s), LLMEM_EFORMAT,
                      "key 'test.array_string' has type array of string, expected string");
    tu_expect_failure(llmem_gguf_get_array(g, "test.array_i32", LLMEM_GGUF_STRING, &a),
                      LLMEM_EFORMAT,
                      "'test.array_i32' has type array of i32, expected array of "
                      "string");
    tu_expect_failure(llmem_gguf_get_array(g, "test.u8", -1, &a), LLMEM_EFORMAT,
                      "has type u8, expected array of any");

    /* arrays */
    assert_int_equal(llmem_gguf_get_array(g, "test.array_string", LLMEM_GGUF_STRING, &a), LLMEM_OK);
    assert_int_equal(a->n, 3);
    assert_int_equal(llmem_gguf_array_str(a, 1).len, 0);
    s = llmem_gguf_array_str(a, 2);
    assert_int_equal(s.len, 3);
    assert_memory_equal(s.ptr, "ccc", 3);
    int64_t v = 0;
    assert_int_equal(llmem_gguf_get_array(g, "test.array_i32", -1, &a), LLMEM_OK);
    assert_int_equal(llmem_gguf_array_int(a, 1, &v), LLMEM_OK);
    assert_int_equal(v, -2);
    assert_string_equal(llmem_gguf_type_name(LLMEM_GGUF_F64), "f64");
    assert_string_equal(llmem_gguf_type_name(99), "unknown");
    llmem_gguf_free(g);
    assert_int_equal(tu_error_lines, 0);
}

/* ---- hostile files -------------------------------------------------------------------------- */

/* Every prefix of the header and tensor infos, and a cut inside every tensor's data. */
static void test_truncated(void **state) {
    (void)state;
    const char *files[] = {GGUF_DATA "/tiny-qwen2.gguf", GGUF_DATA "/tiny-qwen3.gguf"};
    for (size_t f = 0; f < 2; f++) {
        size_t size = 0;
        uint8_t *full = read_all(files[f], &size);
        struct llmem_gguf *g = NULL;
        assert_int_equal(llmem_gguf_parse(full, size, "x", &g), LLMEM_OK);
        size_t data = (size_t)g->data_offset;
        for (size_t n = 0; n < data; n++) {
            /* a copy of exactly n bytes, so that ASan sees a read past them */
            uint8_t *b = malloc(n > 0 ? n : 1);
            memcpy(b, full, n);
            expect_refused(b, n, LLMEM_EFORMAT, "hostile.gguf");
            free(b);
        }
        for (int64_t i = 0; i < g->n_tensors; i++) {
            size_t n = data + (size_t)g->tensors[i].offset + (size_t)g->tensors[i].n_bytes - 1;
            uint8_t *b = malloc(n);
            memcpy(b, full, n);
            char phrase[128];
            snprintf(phrase, sizeof(phrase), "tensor '%s': bytes", g->tensors[i].name);
            struct llmem_gguf *h = NULL;
            int st = llmem_gguf_parse(b, n, "hostile.gguf", &h);
            assert_int_equal(st, LLMEM_EFORMAT);
            assert_int_equal(tu_error_lines, 1);
            assert_non_null(strstr(llmem_last_error(), "past the end of the data section"));
            tu_error_lines = 0;
            free(b);
        }
        llmem_gguf_free(g);
        free(full);
    }
}

static void test_hostile_header(void **state) {
    (void)state;
    size_t size = 0;
    uint8_t *b = read_all(GGUF_DATA "/tiny-qwen2.gguf", &size);
    uint8_t *m = malloc(size);

    memcpy(m, b, size);
    m[0] = 'X';
    expect_refused(m, size, LLMEM_EFORMAT, "not a GGUF file (bad magic)");
    const uint32_t versions[] = {1, 99, 0, 0x03000000};
    const char *vphrase[] = {"GGUF version 1 is not", "GGUF version 99 is not", "version 0",
                             "big-endian"};
    for (int i = 0; i < 4; i++) {
        memcpy(m, b, size);
        put_u32(m, 4, versions[i]);
        expect_refused(m, size, LLMEM_EFORMAT, vphrase[i]);
    }
    memcpy(m, b, size);
    put_u64(m, 8, (uint64_t)1 << 62);
    expect_refused(m, size, LLMEM_EFORMAT, "tensor infos cannot fit");
    memcpy(m, b, size);
    put_u64(m, 16, UINT64_MAX);
    expect_refused(m, size, LLMEM_EFORMAT, "key/values cannot fit");
    /* a version 2 file reads the same */
    memcpy(m, b, size);
    put_u32(m, 4, 2);
    struct llmem_gguf *g = NULL;
    assert_int_equal(llmem_gguf_parse(m, size, "v2", &g), LLMEM_OK);
    assert_int_equal(g->version, 2);
    llmem_gguf_free(g);
    free(m);
    free(b);
}

static void test_hostile_kv(void **state) {
    (void)state;
    size_t size = 0, size3 = 0;
    uint8_t *b = read_all(GGUF_DATA "/tiny-qwen2.gguf", &size);
    uint8_t *b3 = read_all(GGUF_DATA "/tiny-qwen3.gguf", &size3);
    uint8_t *m = malloc(size3 > size ? size3 : size);

    /* the first key's name length past the end */
    memcpy(m, b, size);
    put_u64(m, 24, (uint64_t)1 << 40);
    expect_refused(m, size, LLMEM_EFORMAT, "key #0: its name runs past the end");
    put_u64(m, 24, 0);
    expect_refused(m, size, LLMEM_EFORMAT, "key #0 has an empty name");
    /* a string value's length past the end */
    memcpy(m, b, size);
    size_t arch = find_str(m, size, "general.architecture") + strlen("general.architecture");
    put_u64(m, arch + 4, size);
    expect_refused(m, size, LLMEM_EFORMAT,
                   "key 'general.architecture': the string runs past the end");
    /* an unknown value type */
    memcpy(m, b, size);
    put_u32(m, arch, 13);
    expect_refused(m, size, LLMEM_EFORMAT, "key 'general.architecture': unknown value type 13");
    /* a duplicate key (bos renamed eos) */
    memcpy(m, b, size);
    memcpy(m + find_str(m, size, "tokenizer.ggml.bos_token_id"), "tokenizer.ggml.eos", 18);
    expect_refused(m, size, LLMEM_EFORMAT, "key 'tokenizer.ggml.eos_token_id' appears twice");
    /* general.alignment: not a power of two, zero, of the wrong type */
    size_t al = find_str(b, size, "general.alignment") + strlen("general.alignment");
    const uint32_t aligns[] = {48, 0, 3};
    for (int i = 0; i < 3; i++) {
        memcpy(m, b, size);
        put_u32(m, al + 4, aligns[i]);
        expect_refused(m, size, LLMEM_EFORMAT, "key 'general.alignment'");
    }
    memcpy(m, b, size);
    put_u32(m, al, LLMEM_GGUF_F32);
    expect_refused(m, size, LLMEM_EFORMAT, "key 'general.alignment' has type f32, expected u32");
    /* the token list: an element's length past the end, too many strings */
    memcpy(m, b, size);
    size_t tok = find_str(m, size, "t5");
    put_u64(m, tok - 8, (uint64_t)-2);
    expect_refused(m, size, LLMEM_EFORMAT,
                   "key 'tokenizer.ggml.tokens': string 5 of 64 runs past the end");
    memcpy(m, b, size);
    size_t toks = find_str(m, size, "tokenizer.ggml.tokens") + strlen("tokenizer.ggml.tokens");
    put_u64(m, toks + 8, (uint64_t)1 << 60);
    expect_refused(m, size, LLMEM_EFORMAT,
                   "key 'tokenizer.ggml.tokens': 1152921504606846976 strings");

    /* qwen3's test keys: nested array, elements past the end, a bool of 2 */
    size_t ai = find_str(b3, size3, "test.array_i32") + strlen("test.array_i32");
    memcpy(m, b3, size3);
    put_u32(m, ai + 4, LLMEM_GGUF_ARRAY);
    expect_refused(m, size3, LLMEM_EFORMAT, "key 'test.array_i32': arrays of arrays");
    memcpy(m, b3, size3);
    put_u32(m, ai + 4, 77);
    expect_refused(m, size3, LLMEM_EFORMAT, "key 'test.array_i32': array of unknown element type");
    memcpy(m, b3, size3);
    put_u64(m, ai + 8, (uint64_t)1 << 62);
    expect_refused(m, size3, LLMEM_EFORMAT, "key 'test.array_i32': 4611686018427387904 elements");
    memcpy(m, b3, size3);
    m[find_str(m, size3, "test.bool") + strlen("test.bool") + 4] = 2;
    expect_refused(m, size3, LLMEM_EFORMAT, "key 'test.bool': bool value 2");
    free(m);
    free(b3);
    free(b);
}

static void test_hostile_tensors(void **state) {
    (void)state;
    size_t size = 0;
    uint8_t *b = read_all(GGUF_DATA "/tiny-qwen2.gguf", &size);
    uint8_t *m = malloc(size);
    const char *emb = "token_embd.weight", *norm = "blk.0.attn_norm.weight";
    struct ti_pos e = tensor_info(b, size, emb), n = tensor_info(b, size, norm);

    memcpy(m, b, size);
    put_u32(m, e.n_dims, 5);
    expect_refused(m, size, LLMEM_EFORMAT, "tensor 'token_embd.weight': 5 dimensions");
    memcpy(m, b, size);
    put_u32(m, e.n_dims, 0);
    expect_refused(m, size, LLMEM_EFORMAT, "tensor 'token_embd.weight': 0 dimensions");
    memcpy(m, b, size);
    put_u64(m, e.dims + 8, 0);
    expect_refused(m, size, LLMEM_EFORMAT, "tensor 'token_embd.weight': dimension 1 is 0");
    memcpy(m, b, size);
    put_u64(m, e.dims, (uint64_t)1 << 40);
    put_u64(m, e.dims + 8, (uint64_t)1 << 40);
    expect_refused(m, size, LLMEM_EFORMAT,
                   "tensor 'token_embd.weight': the element count overflows");
    memcpy(m, b, size);
    put_u64(m, n.dims, (uint64_t)1 << 62); /* f32: the bytes overflow, the count does not */
    expect_refused(m, size, LLMEM_EFORMAT, "tensor 'blk.0.attn_norm.weight': the byte size");
    memcpy(m, b, size);
    put_u64(m, e.dims, 48); /* q8_0 rows of 48 */
    expect_refused(m, size, LLMEM_EFORMAT,
                   "tensor 'token_embd.weight': row length 48 is not a multiple of the q8_0 block");
    const uint32_t bad_types[] = {4, 31, 1000, 0x80000000u};
    for (int i = 0; i < 4; i++) {
        memcpy(m, b, size);
        put_u32(m, e.type, bad_types[i]);
        expect_refused(m, size, LLMEM_EFORMAT, "tensor 'token_embd.weight': unknown ggml type");
    }
    memcpy(m, b, size);
    put_u64(m, n.offset, get_u64(b, n.offset) + 4);
    expect_refused(m, size, LLMEM_EFORMAT, "tensor 'blk.0.attn_norm.weight': offset");
    assert_non_null(strstr(llmem_last_error(), "is not a multiple of the alignment (64)"));
    memcpy(m, b, size);
    put_u64(m, n.offset, (uint64_t)1 << 40);
    expect_refused(m, size, LLMEM_EFORMAT, "tensor 'blk.0.attn_norm.weight': bytes");
    memcpy(m, b, size);
    put_u64(m, n.offset, UINT64_MAX - 63);
    expect_refused(m, size, LLMEM_EFORMAT, "past the end of the data section");
    memcpy(m, b, size);
    put_u64(m, n.offset, 0);
    expect_refused(m, size, LLMEM_EFORMAT, "overlaps");
    /* a duplicate name: attn_k renamed attn_q */
    memcpy(m, b, size);
    memcpy(m + find_str(m, size, "blk.0.attn_k.weight"), "blk.0.attn_q.weight", 19);
    expect_refused(m, size, LLMEM_EFORMAT, "tensor 'blk.0.attn_q.weight' appears twice");
    /* a name with a NUL */
    memcpy(m, b, size);
    m[find_str(m, size, emb) + 3] = '\0';
    expect_refused(m, size, LLMEM_EFORMAT,
                   "tensor #0: name 'tok' holds the control character 0x00");
    memcpy(m, b, size);
    m[find_str(m, size, "general.architecture") + 7] = '\n';
    expect_refused(m, size, LLMEM_EFORMAT,
                   "key #0: name 'general' holds the control character 0x0a");
    free(m);
    free(b);
}

/* The geometry from hostile metadata, through files, as `llmem plan` reads them. */
static void test_hostile_geometry(void **state) {
    const char *dir = *state;
    size_t size = 0;
    uint8_t *b = read_all(GGUF_DATA "/tiny-qwen2.gguf", &size);
    uint8_t *m = malloc(size);
    struct llmem_model_geometry geom;
    char *p;

    /* a key the geometry needs, of the wrong type */
    memcpy(m, b, size);
    put_u32(m, find_str(m, size, "qwen2.block_count") + strlen("qwen2.block_count"),
            LLMEM_GGUF_F32);
    p = tu_write_file(dir, "a.gguf", m, (long)size);
    tu_expect_failure(llmem_model_geometry_load(p, &geom), LLMEM_EFORMAT,
                      "key 'qwen2.block_count' has type f32, expected u64");
    free(p);
    /* missing */
    memcpy(m, b, size);
    m[find_str(m, size, "qwen2.block_count") + 6] = 'B';
    p = tu_write_file(dir, "a.gguf", m, (long)size);
    tu_expect_failure(llmem_model_geometry_load(p, &geom), LLMEM_EFORMAT,
                      "missing key 'qwen2.block_count'");
    free(p);
    /* out of range */
    memcpy(m, b, size);
    put_u32(m, find_str(m, size, "qwen2.block_count") + strlen("qwen2.block_count") + 4, 0);
    p = tu_write_file(dir, "a.gguf", m, (long)size);
    tu_expect_failure(llmem_model_geometry_load(p, &geom), LLMEM_EFORMAT,
                      "key 'qwen2.block_count': 0 is out of range");
    free(p);
    /* head_count_kv that does not divide head_count (2) */
    memcpy(m, b, size);
    put_u32(m,
            find_str(m, size, "qwen2.attention.head_count_kv") +
                strlen("qwen2.attention.head_count_kv") + 4,
            3);
    p = tu_write_file(dir, "a.gguf", m, (long)size);
    tu_expect_failure(llmem_model_geometry_load(p, &geom), LLMEM_EFORMAT,
                      "qwen2.attention.head_count_kv");
    free(p);
    /* another architecture */
    memcpy(m, b, size);
    size_t arch = find_str(m, size, "qwen2");
    m[arch + 4] = '9';
    p = tu_write_file(dir, "a.gguf", m, (long)size);
    tu_expect_failure(llmem_model_geometry_load(p, &geom), LLMEM_EUNSUPPORTED,
                      "general.architecture 'qwen9' is not supported");
    free(p);
    /* the token list disagrees with token_embd.weight */
    memcpy(m, b, size);
    put_u64(m, tensor_info(m, size, "token_embd.weight").dims + 8, 63);
    p = tu_write_file(dir, "a.gguf", m, (long)size);
    tu_expect_failure(llmem_model_geometry_load(p, &geom), LLMEM_EFORMAT,
                      "key 'tokenizer.ggml.tokens' lists 64 tokens but tensor 'token_embd.weight' "
                      "has 63 rows");
    free(p);
    /* no token_embd.weight */
    memcpy(m, b, size);
    m[find_str(m, size, "token_embd.weight")] = 'T';
    p = tu_write_file(dir, "a.gguf", m, (long)size);
    tu_expect_failure(llmem_model_geometry_load(p, &geom), LLMEM_EFORMAT,
                      "missing tensor 'token_embd.weight'");
    free(p);
    /* a broken container through the same path */
    memcpy(m, b, size);
    put_u32(m, 4, 1);
    p = tu_write_file(dir, "a.gguf", m, (long)size);
    tu_expect_failure(llmem_model_geometry_load(p, &geom), LLMEM_EFORMAT, "a.gguf: GGUF version 1");
    free(p);
    /* detected by magic without the suffix */
    p = tu_write_file(dir, "model.bin", b, (long)size);
    assert_int_equal(llmem_model_geometry_load(p, &geom), LLMEM_OK);
    assert_string_equal(geom.name, "tiny-qwen2");
    free(p);
    /* short, empty, not a regular file */
    p = tu_write_file(dir, "short.gguf", b, 10);
    tu_expect_failure(llmem_model_geometry_load(p, &geom), LLMEM_EFORMAT,
                      "shorter than its header");
    free(p);
    char fifo[4096];
    snprintf(fifo, sizeof(fifo), "%s/fifo.gguf", dir);
    assert_int_equal(mkfifo(fifo, 0600), 0);
    struct llmem_gguf *g = NULL;
    tu_expect_failure(llmem_gguf_open(fifo, &g), LLMEM_EFORMAT, "fifo.gguf");
    assert_int_equal(llmem_gguf_is_gguf(fifo), 1); /* by its name: opening it says why not */
    tu_expect_failure(llmem_model_geometry_load(fifo, &geom), LLMEM_EFORMAT, "not a regular file");
    snprintf(fifo, sizeof(fifo), "%s/fifo", dir);
    assert_int_equal(mkfifo(fifo, 0600), 0);
    assert_int_equal(llmem_gguf_is_gguf(fifo), 0); /* never opened: it could block */
    assert_int_equal(llmem_gguf_is_gguf(dir), 0);
    tu_expect_failure(llmem_gguf_open("/nonexistent/x.gguf", &g), LLMEM_ENOENT, "x.gguf");
    tu_expect_failure(llmem_model_geometry_load("/nonexistent/x.gguf", &geom), LLMEM_ENOENT,
                      "/nonexistent/x.gguf");
    free(m);
    free(b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_fixtures, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_pycoder, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_config_qwen, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_getters, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_truncated, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_hostile_header, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_hostile_kv, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_hostile_tensors, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_hostile_geometry, tu_setup_dir, tu_teardown_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
