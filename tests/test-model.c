/*
 * tests/test-model.c — model/: safetensors headers (the real pycoder file, hand-made valid files
 * and hostile ones), sharded directories, and config.json → geometry for every supported family.
 *
 * Every failing call must return the right status and log exactly one error line with a
 * recognizable phrase; the log callback below counts the lines.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "llmem/mem.h"
#include "llmem/model.h"
#include "llmem/tokenizer.h"
#include "llmem/plan.h"
#include "llmem/status.h"
#include "llmem/config.h"
#include "llmem/dtype.h"
#include "llmem/safetensors.h"
#include "core/file.h"
#include "model/model_int.h"
#include "testutil.h"

#define PYCODER_DIR LLMEM_SOURCE_DIR "/models/pycoder"
#define MODELS_DIR  LLMEM_TEST_DATA "/models"

/* pycoder's header, computed once with python3 from the file (json.loads of the header). */
#define PYCODER_HEADER_BYTES 6040
#define PYCODER_N_TENSORS    56
#define PYCODER_N_PARAMS     5770496
#define PYCODER_WEIGHT_BYTES 11540992

/* ---- writing test files --------------------------------------------------------------------- */

/* dir/name: an 8-byte little-endian `length` (not necessarily the header's), the header text,
 * then data_bytes zero bytes. */
static char *write_st_raw(const char *dir, const char *name, uint64_t length, const char *header,
                          size_t data_bytes) {
    size_t hl = strlen(header);
    size_t total = 8 + hl + data_bytes;
    unsigned char *buf = calloc(1, total);
    assert_non_null(buf);
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(length >> (8 * i));
    memcpy(buf + 8, header, hl);
    char *path = tu_write_file(dir, name, buf, (long)total);
    free(buf);
    return path;
}

static char *write_st(const char *dir, const char *name, const char *header, size_t data_bytes) {
    return write_st_raw(dir, name, strlen(header), header, data_bytes);
}

/* Loads a one-file table with this header and data size; the table is freed. */
static int load_header(const char *dir, const char *header, size_t data_bytes) {
    char *path = write_st(dir, "t.safetensors", header, data_bytes);
    struct llmem_safetensors *st = NULL;
    int status = llmem_safetensors_load(path, &st);
    if (status == LLMEM_OK)
        assert_non_null(st);
    llmem_safetensors_free(st);
    free(path);
    return status;
}

static char *make_subdir(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *path = malloc(n);
    assert_non_null(path);
    snprintf(path, n, "%s/%s", dir, name);
    assert_int_equal(mkdir(path, 0755), 0);
    return path;
}

/* A small valid Llama config; tests edit it field by field. */
static const char base_config[] =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\","
    " \"hidden_size\": 64, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
    " \"num_key_value_heads\": 2, \"intermediate_size\": 128, \"vocab_size\": 100,"
    " \"max_position_embeddings\": 512, \"rope_theta\": 10000.0, \"tie_word_embeddings\": false}";

/* Writes dir/config.json: `base` with each (key, JSON value) pair applied — a NULL value removes
 * the key. The list ends with a NULL key. */
static void write_config(const char *dir, const char *base, ...) {
    cJSON *root = cJSON_Parse(base);
    assert_non_null(root);
    va_list ap;
    va_start(ap, base);
    for (const char *key = va_arg(ap, const char *); key != NULL; key = va_arg(ap, const char *)) {
        const char *value = va_arg(ap, const char *);
        cJSON_DeleteItemFromObjectCaseSensitive(root, key);
        if (value != NULL) {
            cJSON *item = cJSON_Parse(value);
            assert_non_null(item);
            cJSON_AddItemToObject(root, key, item);
        }
    }
    va_end(ap);
    char *text = cJSON_PrintUnformatted(root);
    assert_non_null(text);
    free(tu_write_file(dir, "config.json", text, -1));
    free(text);
    cJSON_Delete(root);
}

static struct llmem_model_geometry load_config_ok(const char *dir) {
    struct llmem_model_geometry g;
    memset(&g, 0xAB, sizeof(g));
    int status = llmem_model_geometry_load_config(dir, &g);
    if (status != LLMEM_OK) {
        print_error("load_config(%s): %s: %s\n", dir, llmem_status_name(status),
                    llmem_last_error());
        fail();
    }
    assert_int_equal(tu_error_lines, 0);
    return g;
}

static void assert_same_geometry(const struct llmem_model_geometry *a,
                                 const struct llmem_model_geometry *b) {
    assert_string_equal(a->name, b->name);
    assert_string_equal(a->arch, b->arch);
    assert_string_equal(a->source, b->source);
    const int64_t x[] = {a->n_layers,       a->hidden_size,       a->n_heads,        a->n_kv_heads,
                         a->head_dim,       a->intermediate_size, a->vocab_size,     a->max_context,
                         a->sliding_window, a->tied_embeddings,   a->attention_bias, a->qk_norm,
                         a->n_params,       a->weights_bytes};
    const int64_t y[] = {b->n_layers,       b->hidden_size,       b->n_heads,        b->n_kv_heads,
                         b->head_dim,       b->intermediate_size, b->vocab_size,     b->max_context,
                         b->sliding_window, b->tied_embeddings,   b->attention_bias, b->qk_norm,
                         b->n_params,       b->weights_bytes};
    for (size_t i = 0; i < sizeof(x) / sizeof(x[0]); i++)
        assert_int_equal(x[i], y[i]);
}

/* ---- safetensors: real and valid files ------------------------------------------------------ */

static void test_pycoder_header(void **state) {
    (void)state;
    struct llmem_safetensors *st = NULL;
    assert_int_equal(llmem_safetensors_load(PYCODER_DIR "/model.safetensors", &st), LLMEM_OK);
    assert_int_equal(st->n_files, 1);
    assert_int_equal(st->files[0].header_bytes, PYCODER_HEADER_BYTES);
    assert_int_equal(st->files[0].data_offset, 8 + PYCODER_HEADER_BYTES);
    assert_int_equal(st->files[0].file_bytes, 8 + PYCODER_HEADER_BYTES + PYCODER_WEIGHT_BYTES);
    assert_int_equal(st->n_tensors, PYCODER_N_TENSORS);
    assert_int_equal(st->n_elements, PYCODER_N_PARAMS);
    assert_int_equal(st->n_bytes, PYCODER_WEIGHT_BYTES);
    for (int i = 1; i < st->n_tensors; i++)
        assert_true(strcmp(st->tensors[i - 1].name, st->tensors[i].name) < 0);

    const struct llmem_st_tensor *t = llmem_safetensors_find(st, "model.embed_tokens.weight");
    assert_non_null(t);
    assert_int_equal(t->dtype, LLMEM_DTYPE_BF16);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->shape[0], 4096);
    assert_int_equal(t->shape[1], 256);
    assert_int_equal(t->n_elements, 4096 * 256);
    assert_int_equal(t->offset_begin, 0);
    assert_int_equal(t->offset_end, 2097152);
    assert_int_equal(t->n_bytes, 2097152);
    assert_int_equal(t->file_index, 0);

    t = llmem_safetensors_find(st, "model.layers.0.mlp.down_proj.weight");
    assert_non_null(t);
    assert_int_equal(t->shape[0], 256);
    assert_int_equal(t->shape[1], 768);
    assert_int_equal(t->offset_begin, 2097664);
    assert_int_equal(t->offset_end, 2490880);

    assert_null(llmem_safetensors_find(st, "lm_head.weight")); /* tied */
    assert_null(llmem_safetensors_find(st, "model.embed_tokens"));
    llmem_safetensors_free(st);
    llmem_safetensors_free(NULL);
}

static void test_dtypes(void **state) {
    (void)state;
    enum llmem_dtype d;
    assert_int_equal(llmem_dtype_parse("BF16", &d), LLMEM_OK);
    assert_int_equal(d, LLMEM_DTYPE_BF16);
    assert_int_equal(llmem_dtype_size(d), 2);
    assert_int_equal(llmem_dtype_parse("F8_E4M3", &d), LLMEM_OK);
    assert_int_equal(llmem_dtype_size(d), 1);
    assert_int_equal(llmem_dtype_parse("bf16", &d), LLMEM_ENOENT);
    assert_int_equal(llmem_dtype_parse("F4", &d), LLMEM_ENOENT);
    for (int i = 0; i < LLMEM_DTYPE_COUNT; i++) {
        enum llmem_dtype back;
        assert_int_equal(llmem_dtype_parse(llmem_dtype_name((enum llmem_dtype)i), &back), LLMEM_OK);
        assert_int_equal(back, i);
        assert_true(llmem_dtype_size((enum llmem_dtype)i) >= 1);
    }
    assert_string_equal(llmem_dtype_name(LLMEM_DTYPE_COUNT), "?");
    assert_int_equal(llmem_dtype_size(LLMEM_DTYPE_COUNT), 0);
    assert_int_equal(tu_error_lines, 0);
}

static void test_handmade_valid(void **state) {
    const char *dir = *state;
    /* Metadata, a scalar, an empty tensor placed at the end, F32 and U8, unordered offsets. */
    const char *header =
        "{\"__metadata__\": {\"format\": \"pt\"},"
        " \"b\": {\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [8, 32]},"
        " \"a\": {\"dtype\": \"U8\", \"shape\": [], \"data_offsets\": [0, 1]},"
        " \"empty\": {\"dtype\": \"BF16\", \"shape\": [0, 7], \"data_offsets\": [32, 32]},"
        " \"c\": {\"dtype\": \"F16\", \"shape\": [1], \"data_offsets\": [1, 3]}}  ";
    char *path = write_st(dir, "ok.safetensors", header, 32);
    struct llmem_safetensors *st = NULL;
    assert_int_equal(llmem_safetensors_load(path, &st), LLMEM_OK);
    assert_int_equal(st->n_tensors, 4);
    assert_string_equal(st->tensors[0].name, "a");
    assert_string_equal(st->tensors[3].name, "empty");
    assert_int_equal(st->n_elements, 1 + 6 + 0 + 1);
    assert_int_equal(st->n_bytes, 1 + 24 + 0 + 2);
    const struct llmem_st_tensor *a = llmem_safetensors_find(st, "a");
    assert_int_equal(a->n_dims, 0);
    assert_int_equal(a->n_elements, 1);
    const struct llmem_st_tensor *b = llmem_safetensors_find(st, "b");
    assert_int_equal(b->dtype, LLMEM_DTYPE_F32);
    assert_int_equal(st->files[0].data_offset + b->offset_begin, 8 + (int64_t)strlen(header) + 8);
    assert_string_equal(st->files[0].path, path);
    llmem_safetensors_free(st);
    free(path);
    assert_int_equal(load_header(dir, "{}", 0), LLMEM_OK); /* no tensors is a valid file */
    assert_int_equal(tu_error_lines, 0);
}

/* ---- safetensors: hostile files ------------------------------------------------------------- */

static void test_hostile_prefix(void **state) {
    const char *dir = *state;
    struct llmem_safetensors *st = NULL;

    tu_expect_failure(llmem_safetensors_load("/nonexistent/x.safetensors", &st), LLMEM_ENOENT,
                      "No such file");
    free(tu_write_file(dir, "empty.safetensors", "", 0));
    tu_expect_failure(llmem_safetensors_load(dir, &st), LLMEM_EFORMAT, "not a regular file");

    char path[4096];
    snprintf(path, sizeof(path), "%s/empty.safetensors", dir);
    tu_expect_failure(llmem_safetensors_load(path, &st), LLMEM_EFORMAT, "too short");
    free(tu_write_file(dir, "five.safetensors", "\x10\0\0\0\0", 5));
    snprintf(path, sizeof(path), "%s/five.safetensors", dir);
    tu_expect_failure(llmem_safetensors_load(path, &st), LLMEM_EFORMAT, "truncated");

    const struct {
        uint64_t length;
        const char *phrase;
    } cases[] = {
        {0, "header length is 0"},
        {(uint64_t)1 << 63, "exceeds the limit"},
        {(uint64_t)1 << 40, "exceeds the limit"},
        {UINT64_MAX, "exceeds the limit"},
        {((uint64_t)100 << 20) + 1, "exceeds the limit"},
        {1000, "runs past the end of the file"},
        {3, "invalid JSON"}, /* "{\"a" */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char *p = write_st_raw(dir, "len.safetensors", cases[i].length, "{\"a\": 1}", 100);
        tu_expect_failure(llmem_safetensors_load(p, &st), LLMEM_EFORMAT, cases[i].phrase);
        free(p);
    }
    assert_null(st);
}

static void test_hostile_headers(void **state) {
    const char *dir = *state;
    const struct {
        const char *header;
        size_t data_bytes;
        const char *phrase;
    } cases[] = {
        {"{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]", 4,
         "invalid JSON"},
        {"not json at all", 4, "invalid JSON"},
        {"[1, 2, 3]", 4, "not a JSON object"},
        {"\"a string\"", 4, "not a JSON object"},
        {"{\"a\": [1]}", 4, "tensor 'a': entry is not an object"},
        {"{\"__metadata__\": [1]}", 0, "'__metadata__' is not an object"},
        {"{\"__metadata__\": {\"format\": 1}}", 0, "'__metadata__' entry 'format'"},
        /* dtype */
        {"{\"w\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", 4, "tensor 'w': missing 'dtype'"},
        {"{\"w\": {\"dtype\": 4, \"shape\": [1], \"data_offsets\": [0, 4]}}", 4,
         "'dtype' is not a string"},
        {"{\"w\": {\"dtype\": \"Q4_K\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4,
         "tensor 'w': unknown dtype 'Q4_K'"},
        {"{\"w\": {\"dtype\": \"bf16\", \"shape\": [1], \"data_offsets\": [0, 2]}}", 2,
         "unknown dtype 'bf16'"},
        /* shape */
        {"{\"w\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}", 4, "missing 'shape'"},
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": 4, \"data_offsets\": [0, 4]}}", 4,
         "'shape' is not an array"},
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}", 4,
         "tensor 'w': shape[0] is not a non-negative integer"},
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": [1, 2.5], \"data_offsets\": [0, 4]}}", 4,
         "shape[1] is not a non-negative integer"},
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": [\"1\"], \"data_offsets\": [0, 4]}}", 4,
         "shape[0] is not a non-negative integer"},
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": [1e300], \"data_offsets\": [0, 4]}}", 4,
         "shape[0] is not a non-negative integer"},
        {"{\"w\": {\"dtype\": \"U8\", \"shape\": [1,1,1,1,1,1,1,1,1], \"data_offsets\": [0, 1]}}",
         1, "shape has 9 dimensions, at most 8"},
        {"{\"w\": {\"dtype\": \"U8\", \"shape\": [4294967296, 4294967296], "
         "\"data_offsets\": [0, 1]}}",
         1, "overflows 64 bits"},
        {"{\"w\": {\"dtype\": \"U8\", \"shape\": [4294967296, 4294967296, 0], "
         "\"data_offsets\": [0, 0]}}",
         1, "overflows 64 bits"},
        {"{\"w\": {\"dtype\": \"F64\", \"shape\": [4503599627370496, 512], "
         "\"data_offsets\": [0, 8]}}",
         8, "overflows 64 bits"}, /* 2^61 elements × 8 bytes */
        {"{\"w\": {\"dtype\": \"F64\", \"shape\": [1152921504606846976], "
         "\"data_offsets\": [0, 8]}}",
         8, "shape[0] is not a non-negative integer"}, /* 2^60: beyond exact JSON integers */
        /* offsets */
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": [1]}}", 4, "missing 'data_offsets'"},
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}}", 4,
         "'data_offsets' is not two non-negative integers"},
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4, 8]}}", 8,
         "'data_offsets' is not two non-negative integers"},
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [-4, 0]}}", 4,
         "'data_offsets' is not two non-negative integers"},
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": {\"a\": 0}}}", 4,
         "'data_offsets' is not two non-negative integers"},
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 1e300]}}", 4,
         "'data_offsets' is not two non-negative integers"},
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 4]}}", 8,
         "data_offsets [8, 4] begin after they end"},
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}", 7,
         "run past the end of the data section (7 bytes)"},
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": [1024], "
         "\"data_offsets\": [0, 9007199254740991]}}",
         4, "run past the end of the data section"},
        {"{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 4]}}", 8,
         "size mismatch"},
        {"{\"w\": {\"dtype\": \"BF16\", \"shape\": [3, 2], \"data_offsets\": [0, 24]}}", 24,
         "hold 24 bytes but BF16 [3, 2] is 12 bytes"},
        /* the table */
        {"{\"x\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
         " \"y\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}",
         12, "tensors 'x' [0, 8) and 'y' [4, 12) overlap"},
        {"{\"x\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]},"
         " \"y\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [8, 9]}}",
         16, "overlap"},
        {"{\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
         " \"y\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
         4, "overlap"},
        {"{\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
         " \"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
         8, "the key \"x\" appears twice in one object"},
        {"{\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
         " \"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
         4, "the key \"x\" appears twice"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int status = load_header(dir, cases[i].header, cases[i].data_bytes);
        if (status != LLMEM_EFORMAT || strstr(llmem_last_error(), cases[i].phrase) == NULL ||
            tu_error_lines != 1) {
            print_error("case %zu: %s\n  status %s, %d error lines, last error: %s\n"
                        "  wanted: %s\n",
                        i, cases[i].header, llmem_status_name(status), tu_error_lines,
                        llmem_last_error(), cases[i].phrase);
            fail();
        }
        /* Every message names the file. */
        assert_non_null(strstr(llmem_last_error(), "t.safetensors"));
        tu_error_lines = 0;
    }
}

/* ---- sharded directories -------------------------------------------------------------------- */

static const char shard1[] =
    "{\"__metadata__\": {\"format\": \"pt\"},"
    " \"model.embed_tokens.weight\": {\"dtype\": \"BF16\", \"shape\": [100, 64], "
    "\"data_offsets\": [0, 12800]},"
    " \"model.norm.weight\": {\"dtype\": \"F32\", \"shape\": [64], \"data_offsets\": [12800, "
    "13056]}}";
static const char shard2[] = "{\"lm_head.weight\": {\"dtype\": \"BF16\", \"shape\": [100, 64], "
                             "\"data_offsets\": [0, 12800]}}";
static const char index_json[] =
    "{\"metadata\": {\"total_size\": 25856}, \"weight_map\": {"
    "\"lm_head.weight\": \"model-00002-of-00002.safetensors\","
    "\"model.embed_tokens.weight\": \"model-00001-of-00002.safetensors\","
    "\"model.norm.weight\": \"model-00001-of-00002.safetensors\"}}";

static void write_sharded(const char *dir) {
    free(write_st(dir, "model-00001-of-00002.safetensors", shard1, 13056));
    free(write_st(dir, "model-00002-of-00002.safetensors", shard2, 12800));
    free(tu_write_file(dir, "model.safetensors.index.json", index_json, -1));
}

static void test_sharded_valid(void **state) {
    const char *dir = *state;
    write_sharded(dir);
    struct llmem_safetensors *st = NULL;
    assert_int_equal(llmem_safetensors_load_dir(dir, &st), LLMEM_OK);
    assert_int_equal(st->n_files, 2);
    assert_int_equal(st->n_tensors, 3);
    assert_int_equal(st->n_bytes, 13056 + 12800);
    assert_int_equal(st->n_elements, 6400 + 64 + 6400);
    const struct llmem_st_tensor *t = llmem_safetensors_find(st, "lm_head.weight");
    assert_non_null(t);
    assert_non_null(strstr(st->files[t->file_index].path, "model-00002-of-00002.safetensors"));
    t = llmem_safetensors_find(st, "model.norm.weight");
    assert_non_null(strstr(st->files[t->file_index].path, "model-00001-of-00002.safetensors"));
    assert_int_equal(st->files[t->file_index].data_offset, 8 + (int64_t)strlen(shard1));
    llmem_safetensors_free(st);

    /* The geometry of a sharded model sums every shard. */
    write_config(dir, base_config, NULL);
    struct llmem_model_geometry g;
    assert_int_equal(llmem_model_geometry_load(dir, &g), LLMEM_OK);
    assert_int_equal(g.weights_bytes, 13056 + 12800);
    assert_int_equal(g.n_params, 6400 + 64 + 6400);
    assert_int_equal(g.tied_embeddings, 0);
    assert_int_equal(tu_error_lines, 0);
}

static void test_sharded_hostile(void **state) {
    const char *dir = *state;
    struct llmem_safetensors *st = NULL;

    tu_expect_failure(llmem_safetensors_load_dir(dir, &st), LLMEM_ENOENT,
                      "no model.safetensors or model.safetensors.index.json in");
    char missing[4096];
    snprintf(missing, sizeof(missing), "%s/nope", dir);
    tu_expect_failure(llmem_safetensors_load_dir(missing, &st), LLMEM_ENOENT, "does not exist");

    /* A listed shard that is missing. */
    free(write_st(dir, "model-00001-of-00002.safetensors", shard1, 13056));
    free(tu_write_file(dir, "model.safetensors.index.json", index_json, -1));
    tu_expect_failure(llmem_safetensors_load_dir(dir, &st), LLMEM_ENOENT,
                      "shard 'model-00002-of-00002.safetensors' listed in the index is missing");

    /* A tensor of the index that its shard does not hold. */
    free(write_st(dir, "model-00002-of-00002.safetensors", "{}", 0));
    tu_expect_failure(llmem_safetensors_load_dir(dir, &st), LLMEM_EFORMAT,
                      "tensor 'lm_head.weight' listed in the index is missing from shard "
                      "'model-00002-of-00002.safetensors'");

    /* A tensor stored in another shard than the index says. */
    free(write_st(dir, "model-00002-of-00002.safetensors", shard2, 12800));
    free(tu_write_file(dir, "model.safetensors.index.json",
                       "{\"weight_map\": {"
                       "\"lm_head.weight\": \"model-00001-of-00002.safetensors\","
                       "\"model.norm.weight\": \"model-00002-of-00002.safetensors\"}}",
                       -1));
    tu_expect_failure(llmem_safetensors_load_dir(dir, &st), LLMEM_EFORMAT,
                      "is listed in shard 'model-00001-of-00002.safetensors' but stored in");

    /* A tensor in two shards. */
    free(write_st(dir, "model-00002-of-00002.safetensors", shard1, 13056));
    free(tu_write_file(dir, "model.safetensors.index.json", index_json, -1));
    tu_expect_failure(llmem_safetensors_load_dir(dir, &st), LLMEM_EFORMAT,
                      "appears twice (duplicate name): in");

    /* A broken shard is reported with its own path. */
    free(write_st_raw(dir, "model-00002-of-00002.safetensors", 1 << 20, "{}", 0));
    tu_expect_failure(llmem_safetensors_load_dir(dir, &st), LLMEM_EFORMAT,
                      "model-00002-of-00002.safetensors: header length 1048576 runs past");

    /* Malformed indexes. */
    const struct {
        const char *index;
        int status;
        const char *phrase;
    } cases[] = {
        {"{\"weight_map\": ", LLMEM_EFORMAT, "invalid JSON"},
        {"[]", LLMEM_EFORMAT, "not a JSON object"},
        {"{\"metadata\": {}}", LLMEM_EFORMAT, "missing 'weight_map'"},
        {"{\"weight_map\": []}", LLMEM_EFORMAT, "'weight_map' is not an object"},
        {"{\"weight_map\": {}}", LLMEM_EFORMAT, "'weight_map' is empty"},
        {"{\"weight_map\": {\"a\": 3}}", LLMEM_EFORMAT, "weight_map entry 'a' is not a string"},
        {"{\"weight_map\": {\"a\": \"../model.safetensors\"}}", LLMEM_EFORMAT,
         "which is not a file name in the model directory"},
        {"{\"weight_map\": {\"a\": \"/etc/passwd\"}}", LLMEM_EFORMAT, "not a file name"},
        {"{\"weight_map\": {\"a\": \"\"}}", LLMEM_EFORMAT, "not a file name"},
        {"{\"weight_map\": {\"a\": \"..\"}}", LLMEM_EFORMAT, "not a file name"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        free(tu_write_file(dir, "model.safetensors.index.json", cases[i].index, -1));
        tu_expect_failure(llmem_safetensors_load_dir(dir, &st), cases[i].status, cases[i].phrase);
    }

    /* A single file wins over the index; an empty one has no tensors. */
    free(write_st(dir, "model.safetensors", "{}", 0));
    tu_expect_failure(llmem_safetensors_load_dir(dir, &st), LLMEM_EFORMAT, "list no tensors");
    assert_null(st);
}

/* ---- geometry: the real models -------------------------------------------------------------- */

static void test_pycoder_geometry(void **state) {
    (void)state;
    struct llmem_model_geometry g;
    assert_int_equal(llmem_model_geometry_load(PYCODER_DIR, &g), LLMEM_OK);
    assert_string_equal(g.name, "pycoder");
    assert_string_equal(g.arch, "llama");
    if (strlen(PYCODER_DIR) < sizeof(g.source))
        assert_string_equal(g.source, PYCODER_DIR);
    assert_int_equal(g.n_layers, 6);
    assert_int_equal(g.hidden_size, 256);
    assert_int_equal(g.n_heads, 4);
    assert_int_equal(g.n_kv_heads, 2);
    assert_int_equal(g.head_dim, 64);
    assert_int_equal(g.intermediate_size, 768);
    assert_int_equal(g.vocab_size, 4096);
    assert_int_equal(g.max_context, 2048);
    assert_int_equal(g.sliding_window, 0);
    assert_int_equal(g.tied_embeddings, 1);
    assert_int_equal(g.attention_bias, 0);
    assert_int_equal(g.qk_norm, 0);
    assert_int_equal(g.n_params, PYCODER_N_PARAMS);
    assert_int_equal(g.weights_bytes, PYCODER_WEIGHT_BYTES);
    assert_int_equal(g.quantized, 0);
    struct llmem_model_geometry q; /* MLX codes: quantized, for the device's plan */
    assert_int_equal(llmem_model_geometry_load(LLMEM_TEST_DATA "/mlx/tiny-qwen2-4bit", &q),
                     LLMEM_OK);
    assert_int_equal(q.quantized, 1);
    assert_int_equal(g.n_params, llmem_geometry_param_count(&g));
    /* 6 layers × 2 × 2 kv heads × 64 × 2 bytes */
    assert_int_equal(llmem_geometry_kv_bytes_per_token(&g), 6 * 2 * 2 * 64 * 2);

    /* A trailing slash changes nothing but the source. */
    struct llmem_model_geometry h;
    assert_int_equal(llmem_model_geometry_load(PYCODER_DIR "/", &h), LLMEM_OK);
    assert_string_equal(h.name, "pycoder");
    assert_int_equal(h.n_params, g.n_params);
    assert_int_equal(tu_error_lines, 0);
}

static void test_reference_configs(void **state) {
    (void)state;
    /* config.json alone: the weights beside it are not read */
    struct llmem_model_geometry g = load_config_ok(PYCODER_DIR);
    assert_int_equal(g.n_layers, 6);
    assert_int_equal(g.n_params, 0);
    assert_int_equal(g.weights_bytes, 0);

    /* Llama 3 rope scaling under rope_parameters, untied, GQA 8/2, explicit head_dim. */
    g = load_config_ok(MODELS_DIR "/tiny-llama3");
    assert_string_equal(g.name, "tiny-llama3");
    assert_string_equal(g.arch, "llama");
    assert_int_equal(g.n_layers, 4);
    assert_int_equal(g.hidden_size, 256);
    assert_int_equal(g.n_heads, 8);
    assert_int_equal(g.n_kv_heads, 2);
    assert_int_equal(g.head_dim, 32);
    assert_int_equal(g.intermediate_size, 688);
    assert_int_equal(g.vocab_size, 1024);
    assert_int_equal(g.max_context, 4096);
    assert_int_equal(g.tied_embeddings, 0);
    assert_int_equal(g.attention_bias, 0);
    assert_int_equal(g.sliding_window, 0);

    /* Qwen2: no head_dim (192 / 6), biases, tied, sliding_window null and flag false. */
    g = load_config_ok(MODELS_DIR "/tiny-qwen2");
    assert_string_equal(g.arch, "qwen2");
    assert_int_equal(g.n_layers, 3);
    assert_int_equal(g.hidden_size, 192);
    assert_int_equal(g.n_heads, 6);
    assert_int_equal(g.n_kv_heads, 2);
    assert_int_equal(g.head_dim, 32);
    assert_int_equal(g.intermediate_size, 512);
    assert_int_equal(g.vocab_size, 800);
    assert_int_equal(g.tied_embeddings, 1);
    assert_int_equal(g.attention_bias, 1);
    assert_int_equal(g.qk_norm, 0);
    assert_int_equal(g.sliding_window, 0);
}

/* ---- geometry: config.json rules ------------------------------------------------------------ */

static void test_config_missing(void **state) {
    const char *dir = *state;
    struct llmem_model_geometry g;
    char path[4096];
    snprintf(path, sizeof(path), "%s/no-such-model", dir);
    tu_expect_failure(llmem_model_geometry_load(path, &g), LLMEM_ENOENT, "model directory '");
    tu_expect_failure(llmem_model_geometry_load_config(path, &g), LLMEM_ENOENT, "does not exist");
    free(tu_write_file(dir, "file", "x", -1));
    snprintf(path, sizeof(path), "%s/file", dir);
    tu_expect_failure(llmem_model_geometry_load(path, &g), LLMEM_EINVAL, "not a directory");

    tu_expect_failure(llmem_model_geometry_load(dir, &g), LLMEM_ENOENT, "no config.json in");
    free(tu_write_file(dir, "config.json", "{\"hidden_size\": 64,", -1));
    tu_expect_failure(llmem_model_geometry_load(dir, &g), LLMEM_EFORMAT, "invalid JSON");
    free(tu_write_file(dir, "config.json", "[64]", -1));
    tu_expect_failure(llmem_model_geometry_load(dir, &g), LLMEM_EFORMAT, "not a JSON object");

    /* A valid config without weights. */
    write_config(dir, base_config, NULL);
    tu_expect_failure(llmem_model_geometry_load(dir, &g), LLMEM_ENOENT,
                      "no model.safetensors or model.safetensors.index.json in");
}

static void copy_pycoder_file(const char *dir, const char *name) {
    char src[4096];
    snprintf(src, sizeof(src), "%s/%s", PYCODER_DIR, name);
    FILE *f = fopen(src, "rb");
    assert_non_null(f);
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    free(tu_write_file(dir, name, buf, (long)n));
}

/* A FIFO in place of a model's file is refused at once, naming it, rather than waiting in open()
 * for a writer that never comes. alarm() turns a regression into a failure, not a hang. */
static void test_fifo_files(void **state) {
    const char *dir = *state;
    char path[4096];
    copy_pycoder_file(dir, "config.json");
    copy_pycoder_file(dir, "tokenizer.json");
    copy_pycoder_file(dir, "tokenizer_config.json");
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    assert_int_equal(mkfifo(path, 0600), 0);
    alarm(20);
    struct llmem_safetensors *st = NULL;
    tu_expect_failure(llmem_safetensors_load(path, &st), LLMEM_EFORMAT,
                      "model.safetensors: a FIFO, not a regular file");
    tu_expect_failure(llmem_safetensors_load_dir(dir, &st), LLMEM_EFORMAT,
                      "model.safetensors: a FIFO, not a regular file");
    struct llmem_mem_config mc = {.cache_limit_bytes = -1};
    struct llmem_mem *mem = NULL;
    assert_int_equal(llmem_mem_create(&mc, &mem), LLMEM_OK);
    struct llmem_model *m = NULL;
    tu_expect_failure(llmem_model_load(dir, mem, 0, NULL, NULL, &m), LLMEM_EFORMAT,
                      "model.safetensors: a FIFO, not a regular file");
    llmem_mem_destroy(mem);
    struct llmem_model_geometry g;
    tu_expect_failure(llmem_model_geometry_load(dir, &g), LLMEM_EFORMAT,
                      "model.safetensors: a FIFO, not a regular file");

    snprintf(path, sizeof(path), "%s/config.json", dir);
    assert_int_equal(unlink(path), 0);
    assert_int_equal(mkfifo(path, 0600), 0);
    tu_expect_failure(llmem_model_geometry_load(dir, &g), LLMEM_EFORMAT,
                      "config.json: a FIFO, not a regular file");
    tu_expect_failure(llmem_model_geometry_load_config(dir, &g), LLMEM_EFORMAT,
                      "config.json: a FIFO, not a regular file");

    struct llmem_tokenizer *tok = NULL;
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", dir);
    assert_int_equal(unlink(path), 0);
    assert_int_equal(mkfifo(path, 0600), 0);
    tu_expect_failure(llmem_tokenizer_load(dir, &tok), LLMEM_EFORMAT,
                      "tokenizer_config.json: a FIFO, not a regular file");
    snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
    assert_int_equal(unlink(path), 0);
    assert_int_equal(mkfifo(path, 0600), 0);
    tu_expect_failure(llmem_tokenizer_load(dir, &tok), LLMEM_EFORMAT,
                      "tokenizer.json: a FIFO, not a regular file");
    alarm(0);
}

static void test_config_required_fields(void **state) {
    const char *dir = *state;
    static const char *const fields[] = {"hidden_size",         "num_hidden_layers",
                                         "num_attention_heads", "intermediate_size",
                                         "vocab_size",          "max_position_embeddings"};
    struct llmem_model_geometry g;
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
        char phrase[128];
        snprintf(phrase, sizeof(phrase), "config.json: missing '%s'", fields[i]);
        write_config(dir, base_config, fields[i], NULL, NULL);
        tu_expect_failure(llmem_model_geometry_load_config(dir, &g), LLMEM_EFORMAT, phrase);
        write_config(dir, base_config, fields[i], "null", NULL);
        tu_expect_failure(llmem_model_geometry_load_config(dir, &g), LLMEM_EFORMAT, phrase);
    }
    write_config(dir, base_config, "model_type", NULL, "architectures", NULL, NULL);
    tu_expect_failure(llmem_model_geometry_load_config(dir, &g), LLMEM_EFORMAT,
                      "missing 'model_type'");
}

static void test_config_bad_values(void **state) {
    const char *dir = *state;
    const struct {
        const char *key, *value;
        int status;
        const char *phrase;
    } cases[] = {
        {"hidden_size", "\"256\"", LLMEM_EFORMAT, "'hidden_size' must be an integer, not a string"},
        {"num_hidden_layers", "true", LLMEM_EFORMAT, "must be an integer, not a boolean"},
        {"vocab_size", "[100]", LLMEM_EFORMAT, "'vocab_size' must be an integer, not an array"},
        {"intermediate_size", "127.5", LLMEM_EFORMAT, "must be an integer, not 127.5"},
        {"num_hidden_layers", "2000000", LLMEM_EFORMAT,
         "'num_hidden_layers' is 2000000, outside [1, 65536]"},
        {"num_hidden_layers", "1e30", LLMEM_EFORMAT, "'num_hidden_layers' is 1e+30, outside"},
        {"num_hidden_layers", "0", LLMEM_EFORMAT, "'num_hidden_layers' is 0, outside"},
        {"num_attention_heads", "0", LLMEM_EFORMAT, "'num_attention_heads' is 0, outside"},
        {"hidden_size", "-64", LLMEM_EFORMAT, "'hidden_size' is -64, outside"},
        {"vocab_size", "4294967296", LLMEM_EFORMAT, "'vocab_size' is 4294967296, outside"},
        {"max_position_embeddings", "-1", LLMEM_EFORMAT, "'max_position_embeddings' is -1"},
        {"num_key_value_heads", "3", LLMEM_EFORMAT,
         "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"},
        {"num_key_value_heads", "8", LLMEM_EFORMAT, "'num_key_value_heads' is 8, outside [1, 4]"},
        {"num_key_value_heads", "0", LLMEM_EFORMAT, "'num_key_value_heads' is 0"},
        {"head_dim", "0", LLMEM_EFORMAT, "'head_dim' is 0, outside"},
        {"head_dim", "-16", LLMEM_EFORMAT, "'head_dim' is -16, outside"},
        {"head_dim", "65537", LLMEM_EFORMAT, "'head_dim' is 65537, outside [1, 65536]"},
        {"hidden_size", "66", LLMEM_EFORMAT,
         "no 'head_dim', and hidden_size (66) is not divisible by num_attention_heads (4)"},
        {"tie_word_embeddings", "\"yes\"", LLMEM_EFORMAT,
         "'tie_word_embeddings' must be true or false, not a string"},
        {"attention_bias", "1", LLMEM_EFORMAT, "'attention_bias' must be true or false"},
        {"model_type", "\"gemma2\"", LLMEM_EUNSUPPORTED, "model_type 'gemma2' is not supported"},
        {"model_type", "\"qwen2_moe\"", LLMEM_EUNSUPPORTED, "model_type 'qwen2_moe'"},
        {"model_type", "7", LLMEM_EFORMAT, "'model_type' must be a string, not a number"},
        {"architectures", "\"LlamaForCausalLM\"", LLMEM_EFORMAT,
         "'architectures' must be an array of strings"},
        {"text_config", "[]", LLMEM_EFORMAT, "'text_config' must be an object, not an array"},
        /* RoPE, both spellings */
        {"rope_theta", "-1", LLMEM_EFORMAT, "'rope_theta' must be a positive number"},
        {"rope_theta", "\"1e4\"", LLMEM_EFORMAT, "'rope_theta' must be a positive number"},
        {"rope_scaling", "\"llama3\"", LLMEM_EFORMAT,
         "'rope_scaling' must be an object or null, not a string"},
        {"rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 0}", LLMEM_EFORMAT,
         "'rope_scaling.factor' must be a positive number"},
        {"rope_scaling", "{\"type\": 3}", LLMEM_EFORMAT, "'rope_scaling.type' must be a string"},
        {"rope_parameters", "[10000]", LLMEM_EFORMAT, "'rope_parameters' must be an object"},
        {"rope_parameters", "{\"rope_theta\": \"x\"}", LLMEM_EFORMAT,
         "'rope_parameters.rope_theta' must be a positive number"},
        {"rope_parameters", "{\"full_attention\": {\"rope_theta\": 0}}", LLMEM_EFORMAT,
         "'rope_parameters.full_attention.rope_theta' must be a positive number"},
        /* sliding window */
        {"sliding_window", "0", LLMEM_EFORMAT, "'sliding_window' is 0, outside"},
        {"sliding_window", "\"4096\"", LLMEM_EFORMAT, "'sliding_window' must be an integer"},
        {"use_sliding_window", "\"no\"", LLMEM_EFORMAT, "'use_sliding_window' must be true or"},
        {"layer_types", "\"full_attention\"", LLMEM_EFORMAT, "'layer_types' must be an array"},
        {"layer_types", "[\"full_attention\"]", LLMEM_EFORMAT,
         "'layer_types' has 1 entries for 2 layers"},
        {"layer_types", "[\"full_attention\", 1]", LLMEM_EFORMAT,
         "'layer_types[1]' must be a string"},
        {"layer_types", "[\"full_attention\", \"linear_attention\"]", LLMEM_EUNSUPPORTED,
         "'layer_types[1]' is 'linear_attention'"},
        {"layer_types", "[\"full_attention\", \"sliding_attention\"]", LLMEM_EFORMAT,
         "layer_types has sliding_attention but 'sliding_window' is not set"},
    };
    struct llmem_model_geometry g;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        write_config(dir, base_config, cases[i].key, cases[i].value, NULL);
        int status = llmem_model_geometry_load_config(dir, &g);
        if (status != cases[i].status || strstr(llmem_last_error(), cases[i].phrase) == NULL ||
            tu_error_lines != 1) {
            print_error("case %zu: %s = %s\n  status %s, %d error lines, last error: %s\n"
                        "  wanted: %s\n",
                        i, cases[i].key, cases[i].value, llmem_status_name(status), tu_error_lines,
                        llmem_last_error(), cases[i].phrase);
            fail();
        }
        assert_non_null(strstr(llmem_last_error(), "config.json"));
        tu_error_lines = 0;
    }
    write_config(dir, base_config, "num_attention_heads", "65536", "num_key_value_heads", "1",
                 "head_dim", "64", NULL);
    tu_expect_failure(llmem_model_geometry_load_config(dir, &g), LLMEM_EFORMAT,
                      "num_attention_heads × head_dim = 65536 × 64 is more than 1048576");
}

static void test_config_rope_spellings(void **state) {
    const char *dir = *state;
    /* Old spelling: rope_theta + rope_scaling (Llama 3.1). */
    write_config(dir, base_config, "rope_theta", "500000.0", "rope_scaling",
                 "{\"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,"
                 " \"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"}",
                 NULL);
    struct llmem_model_geometry a = load_config_ok(dir);
    /* New spelling: rope_parameters only. */
    write_config(dir, base_config, "rope_theta", NULL, "rope_parameters",
                 "{\"rope_theta\": 500000.0, \"factor\": 8.0, \"rope_type\": \"llama3\"}", NULL);
    struct llmem_model_geometry b = load_config_ok(dir);
    /* Per layer type, and no RoPE fields at all. */
    write_config(dir, base_config, "rope_theta", NULL, "rope_parameters",
                 "{\"full_attention\": {\"rope_theta\": 1e6, \"rope_type\": \"default\"}}", NULL);
    struct llmem_model_geometry c = load_config_ok(dir);
    write_config(dir, base_config, "rope_theta", NULL, "rope_scaling", "null", NULL);
    struct llmem_model_geometry d = load_config_ok(dir);
    const struct llmem_model_geometry *others[] = {&b, &c, &d};
    for (int i = 0; i < 3; i++)
        assert_same_geometry(&a, others[i]);
}

static void test_config_families(void **state) {
    const char *dir = *state;
    /* head_dim: fallback, and explicit (Qwen3 0.6B style: head_dim × heads ≠ hidden). */
    write_config(dir, base_config, "num_key_value_heads", NULL, NULL);
    struct llmem_model_geometry g = load_config_ok(dir);
    assert_int_equal(g.head_dim, 16);
    assert_int_equal(g.n_kv_heads, 4);
    assert_int_equal(g.attention_bias, 0);
    assert_int_equal(g.qk_norm, 0);

    write_config(dir, base_config, "model_type", "\"qwen3\"", "architectures",
                 "[\"Qwen3ForCausalLM\"]", "head_dim", "32", "attention_bias", "false", NULL);
    g = load_config_ok(dir);
    assert_string_equal(g.arch, "qwen3");
    assert_int_equal(g.head_dim, 32);
    assert_int_equal(g.qk_norm, 1);
    assert_int_equal(g.attention_bias, 0);

    /* Qwen2 has q/k/v biases whatever attention_bias says (the key does not exist there). */
    write_config(dir, base_config, "model_type", "\"qwen2\"", "attention_bias", "false", NULL);
    g = load_config_ok(dir);
    assert_string_equal(g.arch, "qwen2");
    assert_int_equal(g.attention_bias, 1);
    assert_int_equal(g.qk_norm, 0);

    write_config(dir, base_config, "attention_bias", "true", "tie_word_embeddings", "true", NULL);
    g = load_config_ok(dir);
    assert_int_equal(g.attention_bias, 1);
    assert_int_equal(g.tied_embeddings, 1);
    write_config(dir, base_config, "tie_word_embeddings", NULL, NULL);
    assert_int_equal(load_config_ok(dir).tied_embeddings, 0);

    /* Family from architectures alone; a known model_type wins over unknown architectures. */
    write_config(dir, base_config, "model_type", NULL, "architectures",
                 "[\"SomethingElse\", \"MistralForCausalLM\"]", NULL);
    assert_string_equal(load_config_ok(dir).arch, "mistral");
    write_config(dir, base_config, "architectures", "[\"MyLlama\"]", NULL);
    assert_string_equal(load_config_ok(dir).arch, "llama");
    struct llmem_model_geometry bad;
    write_config(dir, base_config, "model_type", NULL, "architectures", "[\"GPT2LMHeadModel\"]",
                 NULL);
    tu_expect_failure(llmem_model_geometry_load_config(dir, &bad), LLMEM_EUNSUPPORTED,
                      "architecture 'GPT2LMHeadModel' is not supported");
}

/* Mixtures of experts: qwen3_moe's keys (num_experts or num_local_experts, mlp_only_layers,
 * decoder_sparse_step, norm_topk_prob) and mixtral's, read into the geometry and per-layer flags;
 * bad values refused by name. */
static void test_config_moe(void **state) {
    const char *dir = *state;
    write_config(dir, base_config, "model_type", "\"qwen3_moe\"", "num_experts", "8",
                 "num_experts_per_tok", "2", "moe_intermediate_size", "32", "mlp_only_layers",
                 "[0]", "norm_topk_prob", "true", NULL);
    struct llmem_model_geometry g = load_config_ok(dir);
    assert_string_equal(g.arch, "qwen3_moe");
    assert_int_equal(g.qk_norm, 1);
    assert_int_equal(g.n_experts, 8);
    assert_int_equal(g.n_experts_used, 2);
    assert_int_equal(g.expert_intermediate, 32);
    assert_int_equal(g.n_moe_layers, g.n_layers - 1);
    struct llmem_model_config cfg;
    assert_int_equal(llmem_model_config_load(dir, &cfg), LLMEM_OK);
    assert_int_equal(cfg.layer_moe[0], 0);
    assert_int_equal(cfg.layer_moe[1], 1);
    assert_int_equal(cfg.moe_norm_topk, 1);
    llmem_model_config_free(&cfg);
    /* transformers 5's spelling; every second layer sparse */
    write_config(dir, base_config, "model_type", "\"qwen3_moe\"", "num_local_experts", "4",
                 "num_experts_per_tok", "1", "moe_intermediate_size", "32",
                 "decoder_sparse_step", "2", NULL);
    g = load_config_ok(dir);
    assert_int_equal(g.n_experts, 4);
    assert_int_equal(g.n_moe_layers, g.n_layers / 2);
    write_config(dir, base_config, "model_type", "\"mixtral\"", "num_local_experts", "8",
                 "num_experts_per_tok", "2", NULL);
    g = load_config_ok(dir);
    assert_int_equal(g.expert_intermediate, g.intermediate_size);
    assert_int_equal(g.n_moe_layers, g.n_layers);
    assert_int_equal(llmem_model_config_load(dir, &cfg), LLMEM_OK);
    assert_int_equal(cfg.moe_norm_topk, 1);
    llmem_model_config_free(&cfg);

    struct llmem_model_geometry bad;
    write_config(dir, base_config, "model_type", "\"mixtral\"", "num_local_experts", "8",
                 "num_experts_per_tok", "9", NULL);
    tu_expect_failure(llmem_model_geometry_load_config(dir, &bad), LLMEM_EFORMAT,
                      "'num_experts_per_tok' is 9, outside [1, 8]");
    write_config(dir, base_config, "model_type", "\"qwen3_moe\"", "num_experts", "8",
                 "num_experts_per_tok", "2", NULL);
    tu_expect_failure(llmem_model_geometry_load_config(dir, &bad), LLMEM_EFORMAT,
                      "missing 'moe_intermediate_size'");
    write_config(dir, base_config, "model_type", "\"qwen3_moe\"", "num_experts", "8",
                 "num_experts_per_tok", "2", "moe_intermediate_size", "32", "mlp_only_layers",
                 "[99]", NULL);
    tu_expect_failure(llmem_model_geometry_load_config(dir, &bad), LLMEM_EFORMAT,
                      "'mlp_only_layers' holds a number out of range");
}

/* LLMEM_MODEL_LOAD_DUMMY: from config.json alone, the tensors of a bf16 checkpoint — exactly
 * llmem_model_geometry_load_dummy's parameters and bytes, the same values on every load, norm
 * weights 1 — for a dense model and a mixture of experts. */
static void test_dummy_load(void **state) {
    const char *dir = *state;
    const char *models[] = {"tiny-llama3", "tiny-qwen2", "tiny-qwen3-moe", "tiny-mixtral"};
    for (size_t i = 0; i < sizeof(models) / sizeof(models[0]); i++) {
        char src[512];
        snprintf(src, sizeof(src), "%s/%s/config.json", MODELS_DIR, models[i]);
        char *text = NULL;
        size_t len = 0;
        assert_int_equal(llmem_file_read(src, 1 << 20, &text, &len), LLMEM_OK);
        free(tu_write_file(dir, "config.json", text, (long)len));
        free(text);
        struct llmem_model_geometry g, from_files;
        assert_int_equal(llmem_model_geometry_load_dummy(dir, &g), LLMEM_OK);
        snprintf(src, sizeof(src), "%s/%s", MODELS_DIR, models[i]);
        assert_int_equal(llmem_model_geometry_load(src, &from_files), LLMEM_OK);
        assert_int_equal(g.n_params, from_files.n_params); /* the checkpoints are bf16 */
        assert_int_equal(g.weights_bytes, 2 * g.n_params);
        assert_int_equal(g.expert_bytes, from_files.expert_bytes);

        struct llmem_mem_config mc = {.cache_limit_bytes = -1};
        struct llmem_mem *mem = NULL;
        assert_int_equal(llmem_mem_create(&mc, &mem), LLMEM_OK);
        struct llmem_model *a = NULL, *b = NULL;
        assert_int_equal(llmem_model_load(dir, mem, LLMEM_MODEL_LOAD_DUMMY, NULL, NULL, &a),
                         LLMEM_OK);
        assert_int_equal(llmem_model_load(dir, mem, LLMEM_MODEL_LOAD_DUMMY, NULL, NULL, &b),
                         LLMEM_OK);
        const struct llmem_model_geometry *ga = &llmem_model_get_config(a)->geom;
        assert_int_equal(ga->n_params, g.n_params);
        assert_int_equal(ga->weights_bytes, g.weights_bytes);
        assert_int_equal(ga->expert_bytes, g.expert_bytes);
        /* the same values both times; matrices within ±2^-4, not all equal; norms 1 */
        const int64_t n = a->embed.rows * a->embed.cols;
        assert_memory_equal(a->embed.data, b->embed.data, (size_t)(2 * n));
        assert_memory_equal(a->layers[0].wq.data, b->layers[0].wq.data,
                            (size_t)(2 * a->layers[0].wq.rows * a->layers[0].wq.cols));
        const uint16_t *e = a->embed.data;
        int varied = 0;
        for (int64_t j = 0; j < n; j++) {
            const uint32_t bits = (uint32_t)e[j] << 16;
            float f;
            memcpy(&f, &bits, 4);
            assert_true(fabsf(f) >= 0.015625f && fabsf(f) < 0.0625f);
            varied |= e[j] != e[0];
        }
        assert_true(varied);
        assert_true(a->final_norm[0] == 1.0f && a->layers[0].mlp_norm[1] == 1.0f);
        /* any range of a tensor made alone (llmem quantize's chunks) is that range of the whole */
        const struct llmem_st_tensor *t =
            llmem_safetensors_find(a->st, "model.embed_tokens.weight");
        assert_non_null(t);
        uint16_t piece[37];
        for (int64_t first = 0; first + 37 <= n; first += 1001) {
            llmem_model_dummy_values(t, (int)(t - a->st->tensors), first, 37, piece);
            assert_memory_equal(piece, e + first, sizeof(piece));
        }
        llmem_model_free(a);
        llmem_model_free(b);
        assert_int_equal(llmem_mem_active(mem), 0);
        llmem_mem_destroy(mem);
    }
}

/* A configuration far past what random weights are made for is refused by its size, in the
 * geometry and in the load alike (the bytes and offsets would overflow). */
static void test_dummy_too_large(void **state) {
    const char *dir = *state;
    write_config(dir, base_config, "hidden_size", "1048576", "num_attention_heads", "1024",
                 "num_key_value_heads", "1024", "intermediate_size", "4194304", "num_hidden_layers",
                 "65536", "vocab_size", "16777216", NULL);
    struct llmem_model_geometry g;
    tu_expect_failure(llmem_model_geometry_load_dummy(dir, &g), LLMEM_ERANGE,
                      "random weights are made for at most 2^44");
    struct llmem_mem_config mc = {.cache_limit_bytes = -1};
    struct llmem_mem *mem = NULL;
    assert_int_equal(llmem_mem_create(&mc, &mem), LLMEM_OK);
    struct llmem_model *m = NULL;
    tu_expect_failure(llmem_model_load(dir, mem, LLMEM_MODEL_LOAD_DUMMY, NULL, NULL, &m),
                      LLMEM_ERANGE, "random weights are made for at most 2^44");
    assert_int_equal(llmem_mem_active(mem), 0);
    llmem_mem_destroy(mem);
}

/* Weights holding more layers than config.json declares are refused by the first tensor of a
 * layer past them: running the first layers alone would be a silently different model. */
static void test_layers_past_config(void **state) {
    const char *dir = *state;
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(llmem_file_read(PYCODER_DIR "/config.json", 1 << 20, &text, &len), LLMEM_OK);
    write_config(dir, text, "num_hidden_layers", "3", NULL);
    char link[4096];
    snprintf(link, sizeof(link), "%s/model.safetensors", dir);
    assert_int_equal(symlink(PYCODER_DIR "/model.safetensors", link), 0);
    struct llmem_mem_config mc = {.cache_limit_bytes = -1};
    struct llmem_mem *mem = NULL;
    assert_int_equal(llmem_mem_create(&mc, &mem), LLMEM_OK);
    struct llmem_model *m = NULL;
    tu_expect_failure(llmem_model_load(dir, mem, 0, NULL, NULL, &m), LLMEM_EFORMAT,
                      "belongs to a layer past the 3 the configuration declares");
    assert_int_equal(llmem_mem_active(mem), 0);
    write_config(dir, text, NULL); /* its own 6 layers: loads */
    free(text);
    assert_int_equal(llmem_model_load(dir, mem, 0, NULL, NULL, &m), LLMEM_OK);
    llmem_model_free(m);
    llmem_mem_destroy(mem);
}

static void test_config_text_config(void **state) {
    const char *dir = *state;
    /* A multimodal wrapper: the text model's fields under text_config, tie at the top. */
    const char *text =
        "{\"model_type\": \"mistral\", \"hidden_size\": 128, \"num_hidden_layers\": 3,"
        " \"num_attention_heads\": 8, \"num_key_value_heads\": 2, \"head_dim\": 32,"
        " \"intermediate_size\": 256, \"vocab_size\": 1000, \"max_position_embeddings\": 8192,"
        " \"sliding_window\": null, \"rope_parameters\": {\"rope_theta\": 1e6}}";
    char wrapper[2048];
    snprintf(wrapper, sizeof(wrapper),
             "{\"architectures\": [\"Mistral3ForConditionalGeneration\"],"
             " \"model_type\": \"mistral3\", \"tie_word_embeddings\": true,"
             " \"vision_config\": {\"hidden_size\": 1024}, \"text_config\": %s}",
             text);
    free(tu_write_file(dir, "config.json", wrapper, -1));
    struct llmem_model_geometry g = load_config_ok(dir);
    assert_string_equal(g.arch, "mistral");
    assert_int_equal(g.hidden_size, 128);
    assert_int_equal(g.n_layers, 3);
    assert_int_equal(g.n_heads, 8);
    assert_int_equal(g.n_kv_heads, 2);
    assert_int_equal(g.head_dim, 32);
    assert_int_equal(g.vocab_size, 1000);
    assert_int_equal(g.max_context, 8192);
    assert_int_equal(g.tied_embeddings, 1);
    assert_int_equal(g.sliding_window, 0);

    /* The text model's type may be at the top only; its fields must be in text_config. */
    snprintf(wrapper, sizeof(wrapper),
             "{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"text_config\": {"
             "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"intermediate_size\": 128,"
             " \"vocab_size\": 100, \"max_position_embeddings\": 512}}");
    free(tu_write_file(dir, "config.json", wrapper, -1));
    struct llmem_model_geometry bad;
    tu_expect_failure(llmem_model_geometry_load_config(dir, &bad), LLMEM_EFORMAT,
                      "config.json: missing 'text_config.hidden_size'");
}

static void test_config_sliding_window(void **state) {
    const char *dir = *state;
    /* Mistral sets sliding_window without a flag; null means none. */
    write_config(dir, base_config, "model_type", "\"mistral\"", "sliding_window", "4096", NULL);
    assert_int_equal(load_config_ok(dir).sliding_window, 4096);
    write_config(dir, base_config, "model_type", "\"mistral\"", "sliding_window", "null", NULL);
    assert_int_equal(load_config_ok(dir).sliding_window, 0);
    write_config(dir, base_config, "model_type", "\"mistral\"", "sliding_window", "4096",
                 "use_sliding_window", "false", NULL);
    assert_int_equal(load_config_ok(dir).sliding_window, 0);

    /* Llama / Qwen: the window counts only with the flag or sliding layer types. */
    write_config(dir, base_config, "sliding_window", "4096", NULL);
    assert_int_equal(load_config_ok(dir).sliding_window, 0);
    write_config(dir, base_config, "model_type", "\"qwen2\"", "sliding_window", "131072",
                 "use_sliding_window", "false", "max_window_layers", "0", NULL);
    assert_int_equal(load_config_ok(dir).sliding_window, 0);
    write_config(dir, base_config, "model_type", "\"qwen2\"", "sliding_window", "1024",
                 "use_sliding_window", "true", "max_window_layers", "1", NULL);
    assert_int_equal(load_config_ok(dir).sliding_window, 1024);
    /* ... and only when some layer is at or above max_window_layers (default 28). */
    write_config(dir, base_config, "model_type", "\"qwen2\"", "sliding_window", "1024",
                 "use_sliding_window", "true", NULL);
    assert_int_equal(load_config_ok(dir).sliding_window, 0);
    write_config(dir, base_config, "model_type", "\"qwen3\"", "sliding_window", "null",
                 "use_sliding_window", "true", NULL);
    assert_int_equal(load_config_ok(dir).sliding_window, 0);

    /* layer_types decide when present. */
    write_config(dir, base_config, "sliding_window", "512", "layer_types",
                 "[\"sliding_attention\", \"full_attention\"]", NULL);
    assert_int_equal(load_config_ok(dir).sliding_window, 512);
    write_config(dir, base_config, "model_type", "\"qwen2\"", "sliding_window", "512",
                 "use_sliding_window", "true", "max_window_layers", "0", "layer_types",
                 "[\"full_attention\", \"full_attention\"]", NULL);
    assert_int_equal(load_config_ok(dir).sliding_window, 0);
}

static void test_geometry_name_source_tied(void **state) {
    const char *dir = *state;
    /* A long directory name with two-byte characters where the name and the source are cut. */
    char long_name[200];
    memset(long_name, 'x', sizeof(long_name));
    long_name[sizeof(long_name) - 1] = '\0';
    memcpy(long_name + 106, "\xc3\xa9", 2); /* the source keeps the last 92 bytes: 107.. */
    memcpy(long_name + 126, "\xc3\xa9", 2); /* the name keeps the first 127 bytes: ..126 */
    char *model = make_subdir(dir, long_name);
    write_config(model, base_config, NULL);
    /* Weights without lm_head.weight: tied whatever the config says. */
    free(write_st(model, "model.safetensors",
                  "{\"model.embed_tokens.weight\": {\"dtype\": \"BF16\", \"shape\": [100, 64], "
                  "\"data_offsets\": [0, 12800]}}",
                  12800));
    struct llmem_model_geometry g;
    assert_int_equal(llmem_model_geometry_load(model, &g), LLMEM_OK);
    assert_int_equal(tu_error_lines, 0);
    assert_int_equal(g.tied_embeddings, 1);
    assert_int_equal(g.n_params, 6400);
    assert_int_equal(g.weights_bytes, 12800);
    assert_int_equal(strlen(g.name), 126);
    assert_int_equal(strncmp(g.name, long_name, 126), 0);
    assert_int_equal(strlen(g.source), 3 + 91);
    assert_int_equal(strncmp(g.source, "...", 3), 0);
    assert_string_equal(g.source + 3, long_name + 108);

    /* "." names the directory itself. */
    char cwd[4096];
    assert_non_null(getcwd(cwd, sizeof(cwd)));
    assert_int_equal(chdir(model), 0);
    assert_int_equal(llmem_model_geometry_load(".", &g), LLMEM_OK);
    assert_int_equal(chdir(cwd), 0);
    assert_int_equal(strncmp(g.name, long_name, 126), 0);
    assert_string_equal(g.source, ".");
    free(model);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_pycoder_header, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_dtypes, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_handmade_valid, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_hostile_prefix, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_hostile_headers, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_sharded_valid, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_sharded_hostile, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_pycoder_geometry, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_reference_configs, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_config_missing, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_fifo_files, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_config_required_fields, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_config_bad_values, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_config_rope_spellings, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_config_families, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_config_moe, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_dummy_load, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_dummy_too_large, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_layers_past_config, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_config_text_config, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_config_sliding_window, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_geometry_name_source_tied, tu_setup_dir,
                                        tu_teardown_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
