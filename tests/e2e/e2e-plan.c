/*
 * tests/e2e/e2e-plan.c — `llmem plan` through the built binary: the reference numbers of SPEC §2.4
 * via --json, the model directory and catalog paths, the SVG, the exit codes, and clear single
 * errors for missing directories, broken configs and hostile safetensors headers.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/json.h"
#include "testutil.h"

#define GiB (1LL << 30)
#define REF "--weights", "21313949792", "--kv-bytes-per-token", "65536", "--max-context", "262144"

static int64_t get_int(const cJSON *o, const char *key) {
    int64_t v = 0;
    if (llmem_json_get_int(o, key, &v) != 0)
        fail_msg("missing integer '%s'", key);
    return v;
}

static int get_bool(const cJSON *o, const char *key) {
    int v = 0;
    if (llmem_json_get_bool(o, key, &v) != 0)
        fail_msg("missing bool '%s'", key);
    return v;
}

static int count_lines(const char *s) {
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

static void test_reference_numbers_json(void **state) {
    (void)state;
    struct tu_run run = tu_llmem("plan", "--total", "48G", REF, "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *o = tu_json_stdout(&run);
    assert_int_equal(get_int(o, "usable_bytes"), 36 * GiB);
    assert_int_equal(get_int(o, "runtime_transients_bytes"), 3 * GiB);
    assert_int_equal(get_int(o, "bank_floor_bytes"), 1 * GiB);
    assert_int_equal(get_int(o, "context_window_resolved"), 196608);
    assert_true(get_bool(o, "machine_bound"));
    assert_int_equal(get_int(o, "bank_idle_max_bytes"), 14119530400LL);
    assert_int_equal(get_int(o, "bank_steady_bytes"), 1234628512LL);
    const char *describe = NULL;
    assert_int_equal(llmem_json_get_string(o, "describe", &describe), 0);
    assert_string_equal(describe, "48G host: engine budget 36.0G, weights 19.9G, context 196608"
                                  " (machine-bound), session bank up to 13.1G (yields to 1.1G"
                                  " under long-context load)");
    /* every key the plan promises */
    const char *keys[] = {"available",
                          "unavailable_reason",
                          "total_bytes",
                          "usable_bytes",
                          "usable_source",
                          "weights_bytes",
                          "kv_bytes_per_token",
                          "kv_bytes_per_token_effective",
                          "kv_format",
                          "runtime_transients_bytes",
                          "bank_floor_bytes",
                          "model_fits",
                          "context_window_fit",
                          "context_window_resolved",
                          "machine_bound",
                          "overcommitted",
                          "kv_reserve_bytes",
                          "bank_idle_max_bytes",
                          "bank_steady_bytes",
                          "headroom_bytes",
                          "pool_tokens",
                          "max_full_window_sequences",
                          "ceiling_bytes",
                          "allocation_limit_bytes",
                          "trip_bytes",
                          "util",
                          "band_low",
                          "band_high",
                          "notes",
                          "describe"};
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
        if (cJSON_GetObjectItemCaseSensitive(o, keys[i]) == NULL)
            fail_msg("missing key %s", keys[i]);
    assert_null(cJSON_GetObjectItemCaseSensitive(o, "bank_dynamic_ceiling_bytes"));
    cJSON_Delete(o);
    tu_run_free(&run);

    run = tu_llmem("plan", "--total", "48G", REF, "--kv-format", "q8", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    o = tu_json_stdout(&run);
    assert_int_equal(get_int(o, "context_window_resolved"), 262144);
    assert_int_equal(get_int(o, "kv_bytes_per_token_effective"), 34816);
    cJSON_Delete(o);
    tu_run_free(&run);

    run = tu_llmem("plan", "--total=128G", REF, "--json", NULL);
    o = tu_json_stdout(&run);
    assert_int_equal(get_int(o, "usable_bytes"), 96 * GiB);
    assert_int_equal(get_int(o, "context_window_resolved"), 262144);
    assert_int_equal(get_int(o, "bank_idle_max_bytes"), 48 * GiB);
    assert_int_equal(get_int(o, "bank_steady_bytes"), 48 * GiB);
    cJSON_Delete(o);
    tu_run_free(&run);
}

static void test_usable_by_machine_size(void **state) {
    (void)state;
    const struct {
        const char *total;
        int64_t usable;
    } cases[] = {{"8G", 7730941132LL},
                 {"16G", 12 * GiB},
                 {"48G", 36 * GiB},
                 {"128G", 96 * GiB},
                 {"512G", 192 * GiB}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct tu_run run =
            tu_llmem("plan", "--total", cases[i].total, "--weights", "1G", "--kv-bytes-per-token",
                     "65536", "--max-context", "262144", "--json", NULL);
        cJSON *o = tu_json_stdout(&run);
        assert_int_equal(get_int(o, "usable_bytes"), cases[i].usable);
        cJSON_Delete(o);
        tu_run_free(&run);
    }
}

static void test_every_kv_format(void **state) {
    (void)state;
    const struct {
        const char *name;
        int64_t bytes;
    } cases[] = {{"f32", 131072}, {"f16", 65536}, {"bf16", 65536},
                 {"q8", 34816},   {"q4", 20480},  {"tq", 25600}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct tu_run run =
            tu_llmem("plan", "--total", "48G", REF, "--kv-format", cases[i].name, "--json", NULL);
        cJSON *o = tu_json_stdout(&run);
        assert_int_equal(get_int(o, "kv_bytes_per_token_effective"), cases[i].bytes);
        const char *fmt = NULL;
        assert_int_equal(llmem_json_get_string(o, "kv_format", &fmt), 0);
        assert_string_equal(fmt, cases[i].name);
        cJSON_Delete(o);
        tu_run_free(&run);
    }
}

static void test_util_band_trap(void **state) {
    (void)state;
    struct tu_run run =
        tu_llmem("plan", "--total", "96G", "--ceiling", "72G", "--util", "0.9", "--weights", "40G",
                 "--kv-bytes-per-token", "131072", "--max-context", "1048576", "--json", NULL);
    cJSON *o = tu_json_stdout(&run);
    assert_true(get_bool(o, "band_empty"));
    assert_true(get_bool(o, "trip_above_ceiling"));
    assert_int_equal(get_int(o, "ceiling_bytes"), 72 * GiB);
    char *notes = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(o, "notes"));
    assert_non_null(strstr(notes, "util band is empty"));
    assert_non_null(strstr(notes, "raise the ceiling or shrink the footprint"));
    assert_non_null(strstr(notes, "soft valve would never fire"));
    free(notes);
    cJSON_Delete(o);
    tu_run_free(&run);

    /* The human output says it in the limits and util lines. */
    run = tu_llmem("plan", "--total", "96G", "--ceiling", "72G", "--util", "0.9", "--weights",
                   "40G", "--kv-bytes-per-token", "131072", "--max-context", "1048576", NULL);
    assert_non_null(strstr(run.out, "BROKEN"));
    assert_non_null(strstr(run.out, ": EMPTY"));
    assert_int_equal(run.exit_code, 3);
    assert_non_null(strstr(run.err, "trip 91.2G < ceiling 72.0G does not hold"));
    tu_run_free(&run);
}

/* A limit the plan calls unsafe exits 3 and says which inequality breaks; a safe one exits 0. */
static void test_unsafe_limits_exit(void **state) {
    (void)state;
    const char *cases[][2] = {{"--memory-limit", "1000T"}, {"--util", "1"}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct tu_run run =
            tu_llmem("plan", LLMEM_SOURCE_DIR "/models/pycoder", cases[i][0], cases[i][1], NULL);
        assert_non_null(strstr(run.out, "BROKEN"));
        if (run.exit_code != 3 || strstr(run.err, "the limits are unsafe: trip ") == NULL ||
            strstr(run.err, "< ceiling") == NULL || count_lines(run.err) != 1)
            fail_msg("%s %s: exit %d, stderr: %s", cases[i][0], cases[i][1], run.exit_code,
                     run.err);
        tu_run_free(&run);
    }
    struct tu_run run = tu_llmem("plan", "--total", "48G", REF, "--util", "0.8", NULL);
    assert_int_equal(run.exit_code, 0);
    assert_non_null(strstr(run.out, ": holds"));
    assert_string_equal(run.err, "");
    tu_run_free(&run);
}

static void test_working_set(void **state) {
    (void)state;
    struct tu_run run =
        tu_llmem("plan", "--total", "48G", REF, "--working-set", "4G", "--json", NULL);
    cJSON *o = tu_json_stdout(&run);
    assert_int_equal(get_int(o, "bank_dynamic_ceiling_bytes"), 14119530400LL - 4 * GiB);
    cJSON_Delete(o);
    tu_run_free(&run);
}

static void test_model_dir_and_catalog(void **state) {
    (void)state;
    struct tu_run run = tu_llmem("plan", LLMEM_SOURCE_DIR "/models/pycoder", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *o = tu_json_stdout(&run);
    assert_true(get_bool(o, "model_fits"));
    assert_int_equal(get_int(o, "context_window_resolved"), 2048);
    assert_int_equal(get_int(o, "kv_bytes_per_token"), 6 * 2 * 2 * 64 * 2);
    cJSON *model = cJSON_GetObjectItemCaseSensitive(o, "model");
    assert_int_equal(get_int(model, "n_layers"), 6);
    assert_true(get_int(o, "weights_bytes") > 11000000);
    cJSON_Delete(o);
    tu_run_free(&run);

    /* On a small budget with an explicit context. */
    run = tu_llmem("plan", LLMEM_SOURCE_DIR "/models/pycoder", "--budget", "32M", "--context",
                   "1024", "--baseline", "0", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    o = tu_json_stdout(&run);
    assert_int_equal(get_int(o, "context_window_resolved"), 1024);
    assert_true(get_int(o, "context_raw") >= 1024); /* the requested window fits the budget */
    assert_true(get_bool(o, "model_fits"));
    cJSON_Delete(o);
    tu_run_free(&run);

    /* Human output: describe line, the table, the verdict. */
    run = tu_llmem("plan", "llama-3.1-8b", "--total", "64G", NULL);
    assert_int_equal(run.exit_code, 0);
    assert_non_null(strstr(run.out, "64G host: engine budget 48.0G, weights 15.0G"));
    assert_non_null(strstr(run.out, "KV reserve"));
    assert_non_null(strstr(run.out, "verdict  fits"));
    tu_run_free(&run);

    run = tu_llmem("plan", "--list", NULL);
    assert_int_equal(run.exit_code, 0);
    assert_true(count_lines(run.out) >= 16);
    assert_non_null(strstr(run.out, "qwen3-32b"));
    tu_run_free(&run);
}

static void test_model_does_not_fit(void **state) {
    (void)state;
    struct tu_run run = tu_llmem("plan", "llama-3.1-70b", "--total", "64G", "--json", NULL);
    assert_int_equal(run.exit_code, 3);
    cJSON *o = tu_json_stdout(&run);
    assert_false(get_bool(o, "model_fits"));
    assert_int_equal(get_int(o, "context_window_resolved"), 4096);
    const char *describe = NULL;
    llmem_json_get_string(o, "describe", &describe);
    assert_non_null(strstr(describe, "MODEL DOES NOT FIT"));
    cJSON_Delete(o);
    tu_run_free(&run);

    run = tu_llmem("plan", "llama-3.1-8b", "--total", "64G", "--context", "131072", "--kv-format",
                   "f32", NULL);
    assert_int_equal(run.exit_code, 3);
    assert_non_null(strstr(run.out, "OVERCOMMITTED"));
    tu_run_free(&run);
}

static void test_cuda_target_by_numbers(void **state) {
    (void)state;
    /* Planning a device this machine may not have: --total stands for its memory. */
    struct tu_run run =
        tu_llmem("plan", "llama-3.1-8b", "--backend", "cuda", "--total", "141G", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *o = tu_json_stdout(&run);
    const char *target = NULL, *describe = NULL;
    assert_int_equal(llmem_json_get_string(o, "target", &target), 0);
    assert_string_equal(target, "cuda");
    assert_int_equal(llmem_json_get_string(o, "describe", &describe), 0);
    assert_true(strncmp(describe, "141G cuda: engine budget 105.8G", 31) == 0);
    /* the prefill chunk llmem run would take there: the largest up to 8192 whose workspace
     * fits the transient reserve that 512 tokens commit anyway */
    assert_int_equal(get_int(o, "max_batch_tokens"), 8192);
    const int64_t transients = get_int(o, "runtime_transients_bytes");
    cJSON_Delete(o);
    tu_run_free(&run);

    run = tu_llmem("plan", "llama-3.1-8b", "--backend", "cuda", "--total", "141G",
                   "--max-batch-tokens", "512", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    o = tu_json_stdout(&run);
    assert_int_equal(get_int(o, "max_batch_tokens"), 512);
    assert_int_equal(get_int(o, "runtime_transients_bytes"), transients);
    cJSON_Delete(o);
    tu_run_free(&run);

    /* a host keeps SPEC's 512 */
    run = tu_llmem("plan", "llama-3.1-8b", "--total", "141G", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    o = tu_json_stdout(&run);
    assert_int_equal(get_int(o, "max_batch_tokens"), 512);
    cJSON_Delete(o);
    tu_run_free(&run);
}

static void test_svg(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char path[4200];
    snprintf(path, sizeof(path), "%s/plan.svg", dir);
    struct tu_run run = tu_llmem("plan", "--total", "48G", REF, "--svg", path, "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *o = tu_json_stdout(&run);
    cJSON_Delete(o);
    tu_run_free(&run);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char buf[16384];
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    buf[n] = '\0';
    fclose(f);
    assert_true(strncmp(buf, "<svg", 4) == 0);
    assert_non_null(strstr(buf, "weights 19.9G"));
    assert_non_null(strstr(buf, "trip"));
    assert_non_null(strstr(buf, "ceiling"));
    assert_non_null(strstr(buf, "</svg>"));
    tu_rmtree(dir);
    free(dir);
}

static void test_usage_errors(void **state) {
    (void)state;
    const struct {
        const char *args[6];
        const char *phrase;
    } cases[] = {
        {{"plan", "--total", "-5G", "--weights", "1G"}, "negative"},
        {{"plan", "--budget", "12X", "llama-3.1-8b"}, "--budget"},
        {{"plan", "--util", "1.5", "llama-3.1-8b"}, "--util"},
        {{"plan", "--budget", "0", "llama-3.1-8b"}, "--budget: the size must be positive"},
        {{"plan", "--memory-limit", "0", "llama-3.1-8b"},
         "--memory-limit: the size must be positive"},
        {{"plan", "--total", "0", "llama-3.1-8b"}, "--total: the size must be positive"},
        {{"plan", "--ceiling", "0", "llama-3.1-8b"}, "--ceiling: the size must be positive"},
        {{"plan", "--total", "48G", "--ceiling", "64G", "llama-3.1-8b"},
         "--ceiling 64.0G is above the given memory total 48.0G"},
        {{"plan", "--context", "1", "llama-3.1-8b"}, "--context"},
        {{"plan", "--kv-format", "q5", "llama-3.1-8b"}, "q5"},
        {{"plan", "--bogus", "llama-3.1-8b"}, "unknown option"},
        {{"plan", "--context"}, "needs a value"},
        {{"plan"}, "give a MODEL"},
        {{"plan", "llama-3.1-8b", "--weights", "1G"}, "instead of MODEL"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int n = 0;
        while (n < 6 && cases[i].args[n] != NULL)
            n++;
        struct tu_run run = tu_llmem_argv(n, cases[i].args);
        assert_int_equal(run.exit_code, 2);
        if (strstr(run.err, cases[i].phrase) == NULL)
            fail_msg("case %zu: '%s' not in: %s", i, cases[i].phrase, run.err);
        assert_string_equal(run.out, "");
        tu_run_free(&run);
    }
}

/* A model directory whose files are broken fails with one line on stderr, exit 1. */
static void expect_clean_failure(const char *dir, const char *phrase) {
    struct tu_run run = tu_llmem("plan", dir, "--json", NULL);
    assert_int_equal(run.exit_code, 1);
    assert_string_equal(run.out, "");
    if (strstr(run.err, phrase) == NULL || count_lines(run.err) != 1)
        fail_msg("expected one line with '%s', got: %s", phrase, run.err);
    tu_run_free(&run);
}

static const char good_config[] =
    "{\"model_type\": \"llama\", \"hidden_size\": 64, \"num_hidden_layers\": 2,"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"intermediate_size\": 128,"
    " \"vocab_size\": 100, \"max_position_embeddings\": 1024, \"tie_word_embeddings\": true}";

static void write_safetensors(const char *dir, const char *header, uint64_t declared_len,
                              size_t data_bytes) {
    size_t hl = strlen(header);
    size_t total = 8 + hl + data_bytes;
    unsigned char *buf = calloc(1, total);
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(declared_len >> (8 * i));
    memcpy(buf + 8, header, hl);
    free(tu_write_file(dir, "model.safetensors", buf, (long)total));
    free(buf);
}

static void test_broken_models(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char missing[4200];
    snprintf(missing, sizeof(missing), "%s/not-there", dir);
    expect_clean_failure(missing, "not-there");

    /* no config.json */
    expect_clean_failure(dir, "config.json");

    /* bad JSON */
    free(tu_write_file(dir, "config.json", "{\"hidden_size\": 64,", -1));
    expect_clean_failure(dir, "config.json");

    /* a missing field */
    free(
        tu_write_file(dir, "config.json",
                      "{\"model_type\": \"llama\", \"hidden_size\": 64, \"num_attention_heads\": 4,"
                      " \"intermediate_size\": 128, \"vocab_size\": 100,"
                      " \"max_position_embeddings\": 1024}",
                      -1));
    expect_clean_failure(dir, "num_hidden_layers");

    /* a good config, then hostile safetensors headers */
    free(tu_write_file(dir, "config.json", good_config, -1));
    expect_clean_failure(dir, "model.safetensors");

    free(tu_write_file(dir, "model.safetensors", "abc", 3)); /* shorter than 8 bytes */
    expect_clean_failure(dir, "model.safetensors");

    const char *hdr = "{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}";
    write_safetensors(dir, hdr, (uint64_t)1 << 62, 8); /* absurd length */
    expect_clean_failure(dir, "model.safetensors");
    write_safetensors(dir, hdr, strlen(hdr) + 100, 8); /* length past the end */
    expect_clean_failure(dir, "model.safetensors");
    write_safetensors(dir, "{\"w\": [}", 8, 0); /* bad JSON */
    expect_clean_failure(dir, "model.safetensors");
    const char *past = "{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 800]}}";
    write_safetensors(dir, past, strlen(past), 8); /* offsets past the end */
    expect_clean_failure(dir, "model.safetensors");

    /* and a valid one plans */
    write_safetensors(dir, hdr, strlen(hdr), 8);
    struct tu_run run = tu_llmem("plan", dir, "--total", "16G", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *o = tu_json_stdout(&run);
    assert_int_equal(get_int(o, "weights_bytes"), 8);
    cJSON_Delete(o);
    tu_run_free(&run);

    expect_clean_failure("no-such-model-name", "unknown model");
    tu_rmtree(dir);
    free(dir);
}

/* `llmem plan FILE.gguf` reads the header alone: the weights are exactly the file's tensor bytes
 * (as gguf-py counts them in tests/data/gguf/facts.json), the geometry that of the model. */
/* --weight-type plans a model as the GGUF file `llmem quantize` makes of it: pycoder at q4_k_m
 * plans exactly the tensor bytes of the Q4_K_M file llama-quantize made (tests/data/gguf); on a
 * 24G machine Llama-3.1-8B does not fit in bf16, the plan names q8_0 as the largest type that
 * does, and at q4_k_m it fits with a window of tens of thousands of tokens. */
static void test_weight_type(void **state) {
    (void)state;
    struct tu_run a = tu_llmem("plan", LLMEM_SOURCE_DIR "/models/pycoder", "--weight-type",
                               "q4_k_m", "--json", NULL);
    struct tu_run b =
        tu_llmem("plan", LLMEM_SOURCE_DIR "/tests/data/gguf/pycoder-q4_k_m.gguf", "--json", NULL);
    assert_int_equal(a.exit_code, 0);
    assert_int_equal(b.exit_code, 0);
    cJSON *oa = tu_json_stdout(&a), *ob = tu_json_stdout(&b);
    assert_int_equal(get_int(oa, "weights_bytes"), get_int(ob, "weights_bytes"));
    cJSON_Delete(oa);
    cJSON_Delete(ob);
    tu_run_free(&a);
    tu_run_free(&b);

    a = tu_llmem("plan", "llama-3.1-8b", "--total", "24G", "--json", NULL);
    assert_int_equal(a.exit_code, 3);
    oa = tu_json_stdout(&a);
    assert_false(get_bool(oa, "model_fits"));
    assert_string_equal(cJSON_GetObjectItem(oa, "fits_at_weight_type")->valuestring, "q8_0");
    cJSON_Delete(oa);
    tu_run_free(&a);
    a = tu_llmem("plan", "llama-3.1-8b", "--total", "24G", "--weight-type", "q4_k_m", "--json",
                 NULL);
    assert_int_equal(a.exit_code, 0);
    oa = tu_json_stdout(&a);
    assert_true(get_bool(oa, "model_fits"));
    assert_int_equal(get_int(oa, "weights_bytes"), 4912898048LL); /* llama.cpp: 4.58 GiB */
    assert_true(get_int(oa, "context_window_resolved") >= 65536);
    cJSON_Delete(oa);
    tu_run_free(&a);
    a = tu_llmem("plan", LLMEM_SOURCE_DIR "/tests/data/gguf/pycoder-q4_k_m.gguf", "--weight-type",
                 "q8_0", NULL);
    assert_int_equal(a.exit_code, 2);
    assert_non_null(strstr(a.err, "is a GGUF file"));
    tu_run_free(&a);
}

/* A mixture of experts: the experts line, the active parameters and bytes in --json, and a
 * directory planned from config.json alone (--load-format dummy) as its bf16 checkpoint. */
static void test_moe(void **state) {
    (void)state;
    struct tu_run a = tu_llmem("plan", "qwen3-30b-a3b", "--total", "128G", NULL);
    assert_int_equal(a.exit_code, 0);
    assert_non_null(strstr(a.out, "8 of 128 a token in 48 of the layers: 3.35B active params"));
    tu_run_free(&a);
    a = tu_llmem("plan", "qwen3-30b-a3b", "--total", "128G", "--json", NULL);
    assert_int_equal(a.exit_code, 0);
    cJSON *o = tu_json_stdout(&a);
    const cJSON *model = cJSON_GetObjectItem(o, "model");
    assert_non_null(model);
    assert_int_equal(get_int(model, "n_experts"), 128);
    assert_int_equal(get_int(model, "active_params"), 3353032704LL);
    assert_int_equal(get_int(model, "active_bytes"), 2 * 3353032704LL);
    cJSON_Delete(o);
    tu_run_free(&a);

    const char *dir = LLMEM_SOURCE_DIR "/tests/data/models/tiny-qwen3-moe";
    a = tu_llmem("plan", dir, "--json", NULL);
    struct tu_run b = tu_llmem("plan", dir, "--load-format", "dummy", "--json", NULL);
    assert_int_equal(a.exit_code, 0);
    assert_int_equal(b.exit_code, 0);
    cJSON *oa = tu_json_stdout(&a), *ob = tu_json_stdout(&b);
    assert_int_equal(get_int(oa, "weights_bytes"), get_int(ob, "weights_bytes"));
    assert_int_equal(get_int(cJSON_GetObjectItem(oa, "model"), "active_bytes"),
                     get_int(cJSON_GetObjectItem(ob, "model"), "active_bytes"));
    cJSON_Delete(oa);
    cJSON_Delete(ob);
    tu_run_free(&a);
    tu_run_free(&b);

    /* on a device: the experts the budget cannot hold stay on the host, as few layers as fit;
     * --experts-on-host forces a count, and 0 does not fit; a host plan places nothing */
    a = tu_llmem("plan", "qwen3-30b-a3b", "--backend", "cuda", "--total", "140G", "--budget",
                 "40G", "--json", NULL);
    assert_int_equal(a.exit_code, 0);
    o = tu_json_stdout(&a);
    const cJSON *e = cJSON_GetObjectItem(o, "experts");
    assert_non_null(e);
    const int64_t host = get_int(e, "host_layers");
    assert_true(host > 0 && host < 48);
    assert_int_equal(get_int(e, "moe_layers"), 48);
    assert_int_equal(get_int(o, "weights_bytes"), get_int(e, "device_weights_bytes"));
    assert_int_equal(get_int(e, "device_read_bytes") + get_int(e, "host_read_bytes"),
                     2 * 3353032704LL);
    cJSON_Delete(o);
    tu_run_free(&a);
    char n[32];
    snprintf(n, sizeof(n), "%lld", (long long)host + 4);
    a = tu_llmem("plan", "qwen3-30b-a3b", "--backend", "cuda", "--total", "140G", "--budget",
                 "40G", "--experts-on-host", n, NULL);
    assert_int_equal(a.exit_code, 0);
    char want[96];
    snprintf(want, sizeof(want), "the experts of the first %lld of 48 MoE layers on the host",
             (long long)host + 4);
    assert_non_null(strstr(a.out, want));
    assert_non_null(strstr(a.out, "--experts-on-host"));
    tu_run_free(&a);
    a = tu_llmem("plan", "qwen3-30b-a3b", "--backend", "cuda", "--total", "140G", "--budget",
                 "40G", "--experts-on-host", "0", NULL);
    assert_int_not_equal(a.exit_code, 0);
    assert_non_null(strstr(a.out, "every MoE layer's experts on the device"));
    tu_run_free(&a);
    a = tu_llmem("plan", "qwen3-30b-a3b", "--total", "40G", "--json", NULL);
    o = tu_json_stdout(&a);
    assert_null(cJSON_GetObjectItem(o, "experts"));
    cJSON_Delete(o);
    tu_run_free(&a);
    a = tu_llmem("plan", "qwen3-30b-a3b", "--experts-on-host", "x", NULL);
    assert_int_equal(a.exit_code, 2);
    tu_run_free(&a);
}

static double get_double(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(o, key);
    assert_true(cJSON_IsNumber(v));
    return v->valuedouble;
}

/* The decode estimate: a token's reads at the bandwidths, where each lives. A device's weights at
 * --device-bandwidth, experts left on the host at --bandwidth, the KV of the full window on top;
 * a machine planned by numbers without them names what it needs; this host is measured. */
static void test_decode_estimate(void **state) {
    (void)state;
    struct tu_run a = tu_llmem("plan", "qwen3-30b-a3b", "--backend", "cuda", "--total", "140G",
                               "--device-bandwidth", "4800", "--json", NULL);
    assert_int_equal(a.exit_code, 0);
    cJSON *o = tu_json_stdout(&a);
    const cJSON *d = cJSON_GetObjectItem(o, "decode");
    assert_non_null(d);
    const double dev = (double)get_int(d, "device_read_bytes"),
                 kv = (double)get_int(d, "kv_read_bytes_full_window");
    assert_int_equal(get_int(d, "device_read_bytes"), 2 * 3353032704LL); /* every expert placed */
    assert_int_equal(get_int(d, "host_read_bytes"), 0);
    assert_int_equal((int64_t)kv, get_int(o, "context_window_resolved") * 98304);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(d, "host_bandwidth_gbps")));
    assert_float_equal(get_double(d, "tokens_per_s"), 4800e9 / dev, 1e-9 * 4800e9 / dev);
    assert_float_equal(get_double(d, "tokens_per_s_full_window"), 4800e9 / (dev + kv),
                       1e-9 * 4800e9 / dev);
    cJSON_Delete(o);
    tu_run_free(&a);

    a = tu_llmem("plan", "qwen3-30b-a3b", "--backend", "cuda", "--total", "24G",
                 "--device-bandwidth", "4800", "--bandwidth", "50", "--json", NULL);
    assert_int_equal(a.exit_code, 0);
    o = tu_json_stdout(&a);
    d = cJSON_GetObjectItem(o, "decode");
    const cJSON *e = cJSON_GetObjectItem(o, "experts");
    assert_true(get_int(e, "host_layers") > 0);
    assert_int_equal(get_int(d, "host_read_bytes"), get_int(e, "host_read_bytes"));
    assert_int_equal(get_int(d, "device_read_bytes"), get_int(e, "device_read_bytes"));
    const double want = 1.0 / ((double)get_int(d, "device_read_bytes") / 4800e9 +
                               (double)get_int(d, "host_read_bytes") / 50e9);
    assert_float_equal(get_double(d, "tokens_per_s"), want, 1e-9 * want);
    cJSON_Delete(o);
    tu_run_free(&a);

    a = tu_llmem("plan", "qwen3-30b-a3b", "--backend", "cuda", "--total", "24G",
                 "--device-bandwidth", "4800", NULL);
    assert_int_equal(a.exit_code, 0);
    assert_non_null(strstr(a.out, "an estimate needs --bandwidth GBPS"));
    tu_run_free(&a);
    a = tu_llmem("plan", "--weights", "4G", "--kv-bytes-per-token", "131072", "--total", "16G",
                 "--bandwidth", "40", NULL);
    assert_int_equal(a.exit_code, 0);
    assert_non_null(strstr(a.out, "a token reads 4.0G at 40 GB/s (--bandwidth)"));
    tu_run_free(&a);
    a = tu_llmem("plan", "qwen3-30b-a3b", "--bandwidth", "0", NULL);
    assert_int_equal(a.exit_code, 2);
    assert_non_null(strstr(a.err, "--bandwidth"));
    tu_run_free(&a);

    a = tu_llmem("plan", LLMEM_SOURCE_DIR "/tests/data/models/tiny-qwen3-moe", "--json", NULL);
    assert_int_equal(a.exit_code, 0);
    o = tu_json_stdout(&a);
    d = cJSON_GetObjectItem(o, "decode");
    assert_true(get_double(d, "host_bandwidth_gbps") > 0); /* measured: no speed asserted */
    assert_true(get_double(d, "tokens_per_s") >= get_double(d, "tokens_per_s_full_window"));
    cJSON_Delete(o);
    tu_run_free(&a);
}

/* --tensor-parallel N plans one device's part: Llama 3.1 70B at bf16 does not fit one 140G
 * device with a 32K context, and fits each of two; a degree or a shape that does not split, or a
 * host plan, is a usage error. */
static void test_tensor_parallel(void **state) {
    (void)state;
    struct tu_run a = tu_llmem("plan", "llama-3.1-70b", "--backend", "cuda", "--total", "140G",
                               "--context", "32768", "--json", NULL);
    assert_int_equal(a.exit_code, 3);
    cJSON *o = tu_json_stdout(&a);
    const int64_t whole = get_int(o, "weights_bytes");
    cJSON_Delete(o);
    tu_run_free(&a);
    a = tu_llmem("plan", "llama-3.1-70b", "--backend", "cuda", "--total", "140G", "--context",
                 "32768", "--tensor-parallel", "2", "--json", NULL);
    assert_int_equal(a.exit_code, 0);
    o = tu_json_stdout(&a);
    assert_int_equal(get_int(o, "tensor_parallel"), 2);
    const cJSON *part = cJSON_GetObjectItem(o, "device_part");
    assert_int_equal(get_int(part, "n_heads"), 32);
    assert_int_equal(get_int(part, "n_kv_heads"), 4);
    assert_int_equal(get_int(o, "weights_bytes"), get_int(part, "weights_bytes"));
    assert_true(get_int(o, "weights_bytes") > whole / 2 &&
                get_int(o, "weights_bytes") < whole / 2 + (1 << 22)); /* (norms on both) */
    assert_int_equal(get_int(cJSON_GetObjectItem(o, "model"), "n_heads"), 64);
    assert_int_equal(get_int(o, "kv_bytes_per_token"), 327680 / 2);
    cJSON_Delete(o);
    tu_run_free(&a);
    a = tu_llmem("plan", "llama-3.1-70b", "--backend", "cuda", "--total", "140G",
                 "--tensor-parallel", "2", NULL);
    assert_int_equal(a.exit_code, 0);
    assert_non_null(strstr(a.out, "parallel 2 devices, each 32 of the 64 query heads"));
    tu_run_free(&a);
    const char *bad[][6] = {{"--backend", "cuda", "--total", "140G", "--tensor-parallel", "3"},
                            {"--backend", "cuda", "--total", "140G", "--tensor-parallel", "16"},
                            {"--total", "140G", "--tensor-parallel", "2", "--json", "--json"}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        a = tu_llmem("plan", "llama-3.1-70b", bad[i][0], bad[i][1], bad[i][2], bad[i][3], bad[i][4],
                     bad[i][5], NULL);
        assert_int_equal(a.exit_code, 2);
        assert_non_null(strstr(a.err, "--tensor-parallel"));
        tu_run_free(&a);
    }
    a = tu_llmem("plan", "qwen2.5-7b", "--backend", "cuda", "--total", "40G", "--tensor-parallel",
                 "8", NULL); /* 28 query heads */
    assert_int_equal(a.exit_code, 2);
    assert_non_null(strstr(a.err, "28 query heads do not split over 8 devices"));
    tu_run_free(&a);
}

static void test_gguf(void **state) {
    (void)state;
    cJSON *facts = NULL;
    assert_int_equal(llmem_json_parse_file(LLMEM_TEST_DATA "/gguf/facts.json", 1 << 20, &facts), 0);
    const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(facts, "pycoder"), "tensors");
    int64_t bytes = 0;
    const cJSON *t = NULL;
    cJSON_ArrayForEach(t, tensors) bytes += get_int(t, "n_bytes");
    cJSON_Delete(facts);

    struct tu_run run = tu_llmem("plan", LLMEM_TEST_DATA "/gguf/pycoder-q4_k_m.gguf", "--total",
                                 "16G", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *o = tu_json_stdout(&run);
    assert_int_equal(get_int(o, "weights_bytes"), bytes);
    assert_true(get_bool(o, "model_fits"));
    assert_int_equal(get_int(o, "context_window_resolved"), 2048);
    assert_int_equal(get_int(o, "kv_bytes_per_token"), 6 * 2 * 2 * 64 * 2);
    cJSON *model = cJSON_GetObjectItemCaseSensitive(o, "model");
    assert_int_equal(get_int(model, "n_layers"), 6);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(model, "name")->valuestring, "pycoder");
    cJSON_Delete(o);
    tu_run_free(&run);

    /* The human output names the file's model; a broken file is one clear line. */
    run = tu_llmem("plan", LLMEM_TEST_DATA "/gguf/tiny-qwen3.gguf", "--total", "16G", NULL);
    assert_int_equal(run.exit_code, 0);
    assert_non_null(strstr(run.out, "tiny-qwen3 (qwen3)"));
    tu_run_free(&run);
    char *dir = tu_mkdtemp();
    free(tu_write_file(dir, "bad.gguf",
                       "GGUF\x03\0\0\0\xff\xff\xff\xff\xff\xff\xff\x7f"
                       "\0\0\0\0\0\0\0\0",
                       24));
    char path[4096];
    snprintf(path, sizeof(path), "%s/bad.gguf", dir);
    expect_clean_failure(path, "tensor infos cannot fit");
    tu_rmtree(dir);
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reference_numbers_json),
        cmocka_unit_test(test_usable_by_machine_size),
        cmocka_unit_test(test_every_kv_format),
        cmocka_unit_test(test_util_band_trap),
        cmocka_unit_test(test_unsafe_limits_exit),
        cmocka_unit_test(test_working_set),
        cmocka_unit_test(test_model_dir_and_catalog),
        cmocka_unit_test(test_model_does_not_fit),
        cmocka_unit_test(test_cuda_target_by_numbers),
        cmocka_unit_test(test_svg),
        cmocka_unit_test(test_usage_errors),
        cmocka_unit_test(test_broken_models),
        cmocka_unit_test(test_tensor_parallel),
        cmocka_unit_test(test_gguf),
        cmocka_unit_test(test_weight_type),
        cmocka_unit_test(test_moe),
        cmocka_unit_test(test_decode_estimate),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
