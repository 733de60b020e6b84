/*
 * tests/e2e/e2e-bench.c — `llmem-bench mem`, `kv`, `decode`, `serve` and `grammar` through the
 * built benchmark program: the JSON shape (one object; per pattern its three throughputs; per
 * layout × format an attention point, per format an accuracy, per layout × mode an append cost; a
 * mixture's bytes read per decode token; a serving run's tokens and rates; the masks' times). Speed
 * is not asserted here: numbers go to docs/BENCHMARKS.md.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/json.h"
#include "testutil.h"

static void test_bench_mem_json(void **state) {
    (void)state;
    struct tu_run run = tu_llmem_bench("mem", "--steps", "3", "--reps", "1", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *root = tu_json_stdout(&run);
    const cJSON *patterns = cJSON_GetObjectItemCaseSensitive(root, "patterns");
    assert_int_equal(cJSON_GetArraySize(patterns), 2);
    const char *names[2] = {"inference", "random"};
    for (int i = 0; i < 2; i++) {
        const cJSON *p = cJSON_GetArrayItem(patterns, i);
        const char *name = NULL;
        assert_int_equal(llmem_json_get_string(p, "name", &name), 0);
        assert_string_equal(name, names[i]);
        const char *keys[] = {"llmem_ops_per_s", "malloc_ops_per_s", "mmap_ops_per_s"};
        for (int k = 0; k < 3; k++) {
            double v = 0;
            assert_int_equal(llmem_json_get_double(p, keys[k], &v), 0);
            assert_true(v > 0);
        }
    }
    cJSON_Delete(root);
    tu_run_free(&run);
}

static double get_double(const cJSON *obj, const char *key) {
    double v = -1;
    assert_int_equal(llmem_json_get_double(obj, key, &v), 0);
    return v;
}

static void test_bench_kv_json(void **state) {
    (void)state;
    /* The smallest run: every layout and format, one tiny point, one repetition. */
    struct tu_run run = tu_llmem_bench("kv", "--ctx", "48", "--batch", "2", "--reps", "1", "--bw-size",
                                  "1M", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *root = tu_json_stdout(&run);
    const cJSON *machine = cJSON_GetObjectItemCaseSensitive(root, "machine");
    assert_true(cJSON_IsObject(machine));
    assert_true(get_double(root, "bandwidth_read_gbps") > 0);
    assert_true(get_double(root, "bandwidth_copy_gbps") > 0);

    const char *layouts[] = {"paged", "contiguous", "blocks", "ragged"};
    const char *formats[] = {"f16", "bf16", "f32", "q8", "q4", "tq"};
    /* K + V bytes of one token of one layer: 8 KV heads × 4 groups of 32 × (K + V group bytes) */
    const int64_t token_bytes[] = {8 * 4 * 128, 8 * 4 * 128, 8 * 4 * 256,
                                   8 * 4 * 68,  8 * 4 * 40,  8 * 4 * 50};
    const cJSON *attention = cJSON_GetObjectItemCaseSensitive(root, "attention");
    assert_int_equal(cJSON_GetArraySize(attention), 24);
    int seen[4][6] = {{0}};
    const cJSON *p;
    cJSON_ArrayForEach(p, attention) {
        const char *layout = NULL, *format = NULL;
        int64_t ctx = 0, batch = 0, kv_bytes = 0;
        assert_int_equal(llmem_json_get_string(p, "layout", &layout), 0);
        assert_int_equal(llmem_json_get_string(p, "format", &format), 0);
        assert_int_equal(llmem_json_get_int(p, "ctx", &ctx), 0);
        assert_int_equal(llmem_json_get_int(p, "batch", &batch), 0);
        assert_int_equal(llmem_json_get_int(p, "kv_bytes", &kv_bytes), 0);
        assert_int_equal(ctx, 48);
        assert_int_equal(batch, 2);
        int l = 0, f = 0;
        while (l < 4 && strcmp(layouts[l], layout) != 0)
            l++;
        while (f < 6 && strcmp(formats[f], format) != 0)
            f++;
        assert_true(l < 4 && f < 6);
        seen[l][f]++;
        assert_int_equal(kv_bytes, 2 * 48 * token_bytes[f]);
        assert_true(get_double(p, "seconds") > 0);
        assert_true(get_double(p, "gbps") > 0);
        assert_true(get_double(p, "fraction_of_bandwidth") > 0);
    }
    for (int l = 0; l < 4; l++)
        for (int f = 0; f < 6; f++)
            assert_int_equal(seen[l][f], 1);

    const cJSON *accuracy = cJSON_GetObjectItemCaseSensitive(root, "accuracy");
    assert_int_equal(cJSON_GetArraySize(accuracy), 6);
    cJSON_ArrayForEach(p, accuracy) {
        const char *format = NULL;
        assert_int_equal(llmem_json_get_string(p, "format", &format), 0);
        double err = get_double(p, "rel_error");
        assert_true(err >= 0 && err < 1);
        if (strcmp(format, "f32") == 0)
            assert_true(err == 0);
    }

    const cJSON *append = cJSON_GetObjectItemCaseSensitive(root, "append");
    assert_int_equal(cJSON_GetArraySize(append), 4 * 3);
    cJSON_ArrayForEach(p, append) {
        const char *mode = NULL;
        int64_t grow_events = -1;
        assert_int_equal(llmem_json_get_string(p, "mode", &mode), 0);
        assert_true(get_double(p, "ns_per_token") > 0);
        assert_true(get_double(p, "ns_per_token_cold") > 0);
        assert_int_equal(llmem_json_get_int(p, "grow_events", &grow_events), 0);
        assert_true(grow_events >= 0);
    }
    double overhead = 0;
    assert_int_equal(llmem_json_get_double(root, "paging_overhead", &overhead), 0);
    const char *kernels = NULL;
    assert_int_equal(llmem_json_get_string(root, "kernels", &kernels), 0);
    assert_true(strcmp(kernels, "scalar") == 0 || strcmp(kernels, "avx2") == 0 ||
                strcmp(kernels, "avx512") == 0);
    cJSON_Delete(root);
    tu_run_free(&run);

    /* the portable kernels on request */
    run = tu_llmem_bench("kv", "--ctx", "48", "--batch", "1", "--reps", "1", "--bw-size", "1M",
                    "--kv-format", "q4", "--kv-layout", "paged", "--isa", "scalar", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    root = tu_json_stdout(&run);
    assert_int_equal(llmem_json_get_string(root, "kernels", &kernels), 0);
    assert_string_equal(kernels, "scalar");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(root, "attention")), 1);
    cJSON_Delete(root);
    tu_run_free(&run);
}

/* `decode` on a mixture of experts from its config.json alone (--load-format dummy): it counts
 * the k experts a token runs in the bytes a decode step reads, not all of them. */
static void test_bench_decode_moe_dummy(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    const char *files[] = {"config.json", "tokenizer.json", "tokenizer_config.json"};
    for (int i = 0; i < 3; i++) {
        char from[512];
        snprintf(from, sizeof(from), "%s/models/tiny-qwen3-moe/%s", LLMEM_TEST_DATA, files[i]);
        tu_copy_into(from, dir);
    }
    struct tu_run run =
        tu_llmem_bench("decode", dir, "--load-format", "dummy", "--prompt", "8", "--gen", "4",
                       "--reps", "1", "--threads", "1", "--bw-size", "1M", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *root = tu_json_stdout(&run);
    /* hidden 96, 4 layers: attention 2·(128 + 64)·96 a layer; three MoE layers run 4 of 8
     * experts of width 64 (3·96·64 each) and the 8-row router, the dense one 3·96·192; lm_head
     * (tied) 900·96; two bytes a parameter */
    const int64_t want = 2 * (4 * 2 * (128 + 64) * 96 + 3 * (96 * (8 + 3 * 4 * 64)) +
                              3 * 96 * 192 + 900 * 96);
    int64_t got = 0;
    assert_int_equal(llmem_json_get_int(root, "decode_weight_bytes_per_token", &got), 0);
    assert_int_equal(got, want);
    const cJSON *pt = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(root, "points"), 0);
    assert_true(get_double(pt, "decode_tokens_per_s") > 0);
    cJSON_Delete(root);
    tu_run_free(&run);
    tu_rmtree(dir);
    free(dir);
}

/* `serve` on pycoder: every request's tokens counted, and both rates (the whole run's, prefill
 * included, and the generation's alone: the clients over the time between tokens). */
static void test_bench_serve_json(void **state) {
    (void)state;
    struct tu_run run =
        tu_llmem_bench("serve", LLMEM_SOURCE_DIR "/models/pycoder", "--clients", "2", "--requests",
                       "4", "--prompt-tokens", "8", "--max-tokens", "6", "--shared-prefix", "0",
                       "--threads", "1", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *root = tu_json_stdout(&run);
    const cJSON *r = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(root, "runs"), 0);
    assert_non_null(r);
    int64_t tokens = 0, failed = -1;
    assert_int_equal(llmem_json_get_int(r, "generated_tokens", &tokens), 0);
    assert_int_equal(llmem_json_get_int(r, "failed", &failed), 0);
    assert_int_equal(tokens, 4 * 6);
    assert_int_equal(failed, 0);
    const double all = get_double(r, "tokens_per_s"), decode = get_double(r, "decode_tokens_per_s");
    const double itl = get_double(r, "inter_token_ms");
    assert_true(all > 0 && itl >= 0);
    /* 2 clients ÷ ITL (none when a loaded machine delivered each request's tokens at once) */
    if (itl > 0)
        assert_true(decode > 1999.0 / itl && decode < 2001.0 / itl);
    else
        assert_true(decode == 0);
    cJSON_Delete(root);
    tu_run_free(&run);
}

/* `grammar` on pycoder's vocabulary: every output's masks timed (5 outputs of at most 16
 * tokens: at least one mask each, at most 16), the percentiles in order; a bad schema is named. */
static void test_bench_grammar_json(void **state) {
    (void)state;
    struct tu_run run = tu_llmem_bench("grammar", LLMEM_SOURCE_DIR "/models/pycoder", "--outputs",
                                       "5", "--tokens", "16", "--threads", "2", "--json", NULL);
    assert_int_equal(run.exit_code, 0);
    cJSON *root = tu_json_stdout(&run);
    int64_t vocab = 0, masks = 0;
    assert_int_equal(llmem_json_get_int(root, "vocab", &vocab), 0);
    assert_int_equal(llmem_json_get_int(root, "masks", &masks), 0);
    assert_int_equal(vocab, 4096);
    assert_true(masks >= 5 && masks <= 5 * 16);
    const double p50 = get_double(root, "p50_ms"), p99 = get_double(root, "p99_ms");
    assert_true(p50 >= 0 && p50 <= p99 && p99 <= get_double(root, "max_ms"));
    cJSON_Delete(root);
    tu_run_free(&run);
    char *dir = tu_mkdtemp();
    char *bad = tu_write_file(dir, "schema.json", "{\"type\": \"frobnicate\"}", -1);
    run = tu_llmem_bench("grammar", LLMEM_SOURCE_DIR "/models/pycoder", "--schema", bad, NULL);
    assert_int_equal(run.exit_code, 1);
    assert_non_null(strstr(run.err, "the schema"));
    tu_run_free(&run);
    free(bad);
    tu_rmtree(dir);
    free(dir);
}

static void test_bench_usage(void **state) {
    (void)state;
    struct tu_run run = tu_llmem_bench("nothing", NULL);
    assert_int_equal(run.exit_code, 2);
    assert_non_null(strstr(run.err, "unknown benchmark"));
    tu_run_free(&run);
    /* the list of benchmarks */
    run = tu_llmem_bench("--help", NULL);
    assert_int_equal(run.exit_code, 0);
    const char *names[] = {"mem", "kv", "attn", "matmul", "decode", "bank", "serve"};
    for (int i = 0; i < 7; i++)
        assert_non_null(strstr(run.out, names[i]));
    tu_run_free(&run);
    run = tu_llmem_bench(NULL);
    assert_int_equal(run.exit_code, 2);
    assert_non_null(strstr(run.err, "usage: llmem-bench"));
    tu_run_free(&run);
    /* llmem itself has no benchmarks: it names the program that has them */
    run = tu_llmem("bench", "mem", NULL);
    assert_true(run.exit_code != 0);
    assert_non_null(strstr(run.err, "llmem-bench"));
    assert_string_equal(run.out, "");
    tu_run_free(&run);
    run = tu_llmem_bench("mem", "--reps", "0", NULL);
    assert_int_equal(run.exit_code, 2);
    tu_run_free(&run);
    run = tu_llmem_bench("kv", "--ctx", "0", NULL);
    assert_int_equal(run.exit_code, 2);
    tu_run_free(&run);
    run = tu_llmem_bench("kv", "--kv-format", "f16,f12", NULL);
    assert_int_equal(run.exit_code, 2);
    assert_non_null(strstr(run.err, "f12"));
    tu_run_free(&run);
    run = tu_llmem_bench("kv", "--isa", "avx9", NULL);
    assert_int_equal(run.exit_code, 2);
    assert_non_null(strstr(run.err, "avx9"));
    tu_run_free(&run);
    /* attn: the GPU's; bad shapes and formats are named, the CPU is sent to llmem-bench kv */
    run = tu_llmem_bench("attn", "--backend", "cuda", "--shapes", "64x", NULL);
    assert_int_equal(run.exit_code, 2);
    assert_non_null(strstr(run.err, "64x"));
    tu_run_free(&run);
    run = tu_llmem_bench("attn", "--backend", "cuda", "--formats", "bf16,f12", NULL);
    assert_int_equal(run.exit_code, 2);
    assert_non_null(strstr(run.err, "f12"));
    tu_run_free(&run);
    run = tu_llmem_bench("attn", NULL);
    assert_int_equal(run.exit_code, 2);
    assert_non_null(strstr(run.err, "llmem-bench kv"));
    tu_run_free(&run);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bench_mem_json),         cmocka_unit_test(test_bench_kv_json),
        cmocka_unit_test(test_bench_decode_moe_dummy), cmocka_unit_test(test_bench_serve_json),
        cmocka_unit_test(test_bench_grammar_json),     cmocka_unit_test(test_bench_usage),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
