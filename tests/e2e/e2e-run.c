/*
 * tests/e2e/e2e-run.c — the built binary running models: `llmem run` against transformers' greedy
 * output for pycoder (ids and text), --json and --stats, `llmem tokenize`, `llmem logits` against
 * transformers' logits, `llmem chat` with a template, a model refused by its plan, and bad input
 * (missing, truncated or corrupt files, an unknown architecture, a missing tensor, a shape that
 * disagrees with the config, a broken tokenizer.json), each a clear error.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/file.h"
#include "core/json.h"
#include "core/npy.h"
#include "llmem/dtype.h"
#include "llmem/safetensors.h"
#include "llmem/tokenizer.h"
#include "testutil.h"

#define PYCODER LLMEM_SOURCE_DIR "/models/pycoder"
#define REFS    LLMEM_TEST_DATA "/models/pycoder"

static cJSON *reference(void) {
    cJSON *root = NULL;
    assert_int_equal(llmem_json_parse_file(REFS "/reference.json", 1 << 24, &root), 0);
    return root;
}

static void ids_csv(const cJSON *ids, char *buf, size_t size) {
    size_t len = 0;
    const cJSON *id = NULL;
    cJSON_ArrayForEach(id, ids) {
        len += (size_t)snprintf(buf + len, size - len, "%s%d", len ? "," : "", id->valueint);
        assert_true(len < size);
    }
}

/* Two JSON arrays of ids, equal. */
static void assert_ids_equal(const cJSON *ids, const cJSON *want) {
    assert_int_equal(cJSON_GetArraySize(ids), cJSON_GetArraySize(want));
    for (int i = 0; i < cJSON_GetArraySize(ids); i++)
        assert_int_equal(cJSON_GetArrayItem(ids, i)->valueint,
                         cJSON_GetArrayItem(want, i)->valueint);
}

/* --text-file and --prompt-file read every byte of the file, NULs included: the ids are the
 * tokenizer's of the whole text, and the run continues them as it continues those ids. */
static void test_files_keep_nul(void **state) {
    (void)state;
    static const char text[] = "\0def foo():\0 return 1";
    char *dir = tu_mkdtemp(), path[1024];
    snprintf(path, sizeof(path), "%s/prompt.txt", dir);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, sizeof(text) - 1, f), sizeof(text) - 1);
    assert_int_equal(fclose(f), 0);
    struct llmem_tokenizer *tok = NULL;
    assert_int_equal(llmem_tokenizer_load(PYCODER, &tok), LLMEM_OK);
    int32_t *ids = NULL;
    int64_t n = 0;
    assert_int_equal(llmem_tokenizer_encode(tok, text, sizeof(text) - 1, &ids, &n), LLMEM_OK);
    char want[1024] = "";
    for (int64_t i = 0; i < n; i++)
        snprintf(want + strlen(want), sizeof(want) - strlen(want), "%s%d", i ? "," : "", ids[i]);

    struct tu_run r = tu_llmem("tokenize", PYCODER, "--text-file", path, "--json", NULL);
    assert_int_equal(r.exit_code, 0);
    cJSON *out = tu_json_stdout(&r);
    char got[1024];
    ids_csv(cJSON_GetObjectItem(out, "ids"), got, sizeof(got));
    assert_string_equal(got, want);
    cJSON_Delete(out);
    tu_run_free(&r);

    r = tu_llmem("run", PYCODER, "--prompt-file", path, "-n", "6", "--ignore-eos", "--json", NULL);
    struct tu_run r2 =
        tu_llmem("run", PYCODER, "--ids", want, "-n", "6", "--ignore-eos", "--json", NULL);
    assert_int_equal(r.exit_code, 0);
    assert_int_equal(r2.exit_code, 0);
    assert_string_equal(r.out, r2.out);
    tu_run_free(&r);
    tu_run_free(&r2);
    free(ids);
    llmem_tokenizer_free(tok);
    unlink(path);
    rmdir(dir);
    free(dir);
}

/* The top-1 margin of row `row` of generation i's reference logits. */
static double ref_margin(int i, int64_t row) {
    char path[512];
    snprintf(path, sizeof(path), REFS "/ref_logits_%d.npy", i);
    float *l = NULL;
    int64_t rows, cols;
    assert_int_equal(llmem_npy_read_f32(path, &l, &rows, &cols), 0);
    assert_true(row < rows);
    double a = -INFINITY, b = -INFINITY;
    for (int64_t v = 0; v < cols; v++) {
        double x = l[row * cols + v];
        if (x > a)
            b = a, a = x;
        else if (x > b)
            b = x;
    }
    free(l);
    return a - b;
}

/* llmem run --json gives transformers' greedy ids and text for every pycoder prompt at
 * --precision f32; at fast (the default: bf16 activations where the CPU has AVX512-BF16) the same
 * ids, or ids that leave the reference only where its own top-1 margin is under 0.05 logits
 * (pycoder's continuations pass margins of 0.011–0.018; their drift: test-forward). */
static void test_run_greedy_matches(void **state) {
    (void)state;
    cJSON *ref = reference();
    const cJSON *g = NULL;
    int gen = 0;
    cJSON_ArrayForEach(g, cJSON_GetObjectItem(ref, "generations")) {
        const cJSON *greedy = cJSON_GetObjectItem(g, "greedy_ids");
        char n[16];
        snprintf(n, sizeof(n), "%d", cJSON_GetArraySize(greedy));
        const char *prompt = cJSON_GetObjectItem(g, "prompt")->valuestring;
        struct tu_run r = tu_llmem("run", PYCODER, "-p", prompt, "-n", n, "--ignore-eos", "--json",
                                   "--threads", "2", NULL);
        assert_int_equal(r.exit_code, 0);
        cJSON *out = tu_json_stdout(&r);
        const cJSON *ids = cJSON_GetObjectItem(out, "ids");
        int equal = 0;
        while (equal < cJSON_GetArraySize(greedy) &&
               cJSON_GetArrayItem(ids, equal)->valueint ==
                   cJSON_GetArrayItem(greedy, equal)->valueint)
            equal++;
        printf("  prompt %d at fast precision: %d of %d greedy ids equal\n", gen, equal,
               cJSON_GetArraySize(greedy));
        if (equal < cJSON_GetArraySize(greedy))
            assert_true(ref_margin(gen, cJSON_GetArraySize(cJSON_GetObjectItem(g, "prompt_ids")) -
                                            1 + equal) < 0.05);
        cJSON_Delete(out);
        tu_run_free(&r);

        r = tu_llmem("run", PYCODER, "-p", prompt, "-n", n, "--ignore-eos", "--json", "--threads",
                     "2", "--precision", "f32", NULL);
        assert_int_equal(r.exit_code, 0);
        out = tu_json_stdout(&r);
        assert_ids_equal(cJSON_GetObjectItem(out, "ids"), greedy);
        assert_string_equal(cJSON_GetObjectItem(out, "text")->valuestring,
                            cJSON_GetObjectItem(g, "greedy_text")->valuestring);
        /* the plan line and the limits applied are on stderr, never on stdout */
        assert_non_null(strstr(r.err, "limits applied: memory limit"));
        cJSON_Delete(out);
        tu_run_free(&r);

        /* the same prompt as ids, streamed as text: the same text and a newline */
        char csv[4096];
        ids_csv(cJSON_GetObjectItem(g, "prompt_ids"), csv, sizeof(csv));
        r = tu_llmem("run", PYCODER, "--ids", csv, "-n", n, "--ignore-eos", "--precision", "f32",
                     NULL);
        assert_int_equal(r.exit_code, 0);
        size_t len = strlen(r.out);
        assert_true(len > 0 && r.out[len - 1] == '\n');
        r.out[len - 1] = '\0';
        assert_string_equal(r.out, cJSON_GetObjectItem(g, "greedy_text")->valuestring);
        tu_run_free(&r);
        gen++;
    }
    cJSON_Delete(ref);
}

/* The first generation of refs/reference.json through the binary on dir at f32 with an f32 cache
 * and `extra` more arguments (NULL-terminated, at most 4): its greedy ids, the reference's. */
static void reference_greedy(const char *dir, const char *refs, const char *const *extra,
                             const char *label) {
    char path[600];
    snprintf(path, sizeof(path), "%s/reference.json", refs);
    cJSON *ref = NULL;
    assert_int_equal(llmem_json_parse_file(path, 1 << 24, &ref), 0);
    const cJSON *g = cJSON_GetArrayItem(cJSON_GetObjectItem(ref, "generations"), 0);
    const cJSON *greedy = cJSON_GetObjectItem(g, "greedy_ids");
    char csv[4096], n[16];
    ids_csv(cJSON_GetObjectItem(g, "prompt_ids"), csv, sizeof(csv));
    snprintf(n, sizeof(n), "%d", cJSON_GetArraySize(greedy));
    const char *args[20] = {"run",          dir,      "--ids",       csv,   "-n",          n,
                            "--ignore-eos", "--json", "--kv-format", "f32", "--precision", "f32"};
    int argc = 12;
    for (int i = 0; extra != NULL && extra[i] != NULL; i++)
        args[argc++] = extra[i];
    struct tu_run r = tu_llmem_argv(argc, args);
    assert_int_equal(r.exit_code, 0);
    cJSON *out = tu_json_stdout(&r);
    assert_ids_equal(cJSON_GetObjectItem(out, "ids"), greedy);
    printf("  %s: %d greedy ids equal\n", label, cJSON_GetArraySize(greedy));
    cJSON_Delete(out);
    tu_run_free(&r);
    cJSON_Delete(ref);
}

/* The mixtures of experts through the binary: greedy ids equal to their references (f32 KV). */
static void test_moe_greedy(void **state) {
    (void)state;
    reference_greedy(LLMEM_TEST_DATA "/models/tiny-qwen3-moe",
                     LLMEM_TEST_DATA "/models/tiny-qwen3-moe", NULL, "tiny-qwen3-moe");
    reference_greedy(LLMEM_TEST_DATA "/models/tiny-mixtral", LLMEM_TEST_DATA "/models/tiny-mixtral",
                     NULL, "tiny-mixtral");
}

/* --tensor-parallel N through the binary (the CPU's ranks: the split's results): pycoder over 2
 * and 4 ranks and tiny-qwen3-moe over 2 give the references' greedy ids at f32; a degree llmem
 * does not split over, a split the heads do not allow and one that would cut a quantized matrix's
 * blocks are refused by name. */
static void test_tensor_parallel(void **state) {
    (void)state;
    const char *two[] = {"--tensor-parallel", "2", "--threads", "2", NULL};
    const char *four[] = {"--tensor-parallel", "4", "--threads", "2", NULL};
    reference_greedy(PYCODER, REFS, two, "pycoder over 2 ranks");
    reference_greedy(PYCODER, REFS, four, "pycoder over 4 ranks");
    reference_greedy(LLMEM_TEST_DATA "/models/tiny-qwen3-moe",
                     LLMEM_TEST_DATA "/models/tiny-qwen3-moe", two, "tiny-qwen3-moe over 2 ranks");
    struct tu_run r = tu_llmem("run", PYCODER, "-p", "x", "--tensor-parallel", "8", NULL);
    assert_int_equal(r.exit_code, 1);
    assert_non_null(strstr(r.err, "its 4 query heads do not split over 8"));
    tu_run_free(&r);
    r = tu_llmem("run", PYCODER, "-p", "x", "--tensor-parallel", "3", NULL);
    assert_int_equal(r.exit_code, 2);
    assert_non_null(strstr(r.err, "--tensor-parallel: 3 ranks"));
    tu_run_free(&r);
    /* pycoder's Q4_K matrices of 256 columns: shares of 128 would cut their blocks */
    r = tu_llmem("run", LLMEM_TEST_DATA "/gguf/pycoder-q4_k_m.gguf", "-p", "x", "--tensor-parallel",
                 "2", NULL);
    assert_int_equal(r.exit_code, 1);
    assert_non_null(strstr(r.err, "does not split into shares of 128 columns"));
    tu_run_free(&r);
}

/* --load-format dummy: a directory with only config.json and the tokenizer runs, the same ids
 * each time; without it the missing weights are named; a bad value is a usage error. */
static void test_load_format_dummy(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    const char *files[] = {"config.json", "tokenizer.json", "tokenizer_config.json"};
    for (size_t i = 0; i < 3; i++) {
        char src[512], *text = NULL;
        size_t len = 0;
        snprintf(src, sizeof(src), "%s/models/tiny-qwen3-moe/%s", LLMEM_TEST_DATA, files[i]);
        assert_int_equal(llmem_file_read(src, 1 << 24, &text, &len), LLMEM_OK);
        free(tu_write_file(dir, files[i], text, (long)len));
        free(text);
    }
    char *first = NULL;
    for (int i = 0; i < 2; i++) {
        struct tu_run r = tu_llmem("run", dir, "--load-format", "dummy", "-p", "def f(x):", "-n",
                                   "6", "--ignore-eos", "--json", NULL);
        assert_int_equal(r.exit_code, 0);
        cJSON *out = tu_json_stdout(&r);
        char *ids = cJSON_PrintUnformatted(cJSON_GetObjectItem(out, "ids"));
        assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(out, "ids")), 6);
        if (first == NULL)
            first = ids;
        else
            assert_string_equal(ids, first), free(ids);
        cJSON_Delete(out);
        tu_run_free(&r);
    }
    free(first);
    struct tu_run r = tu_llmem("run", dir, "-p", "x", "-n", "1", NULL);
    assert_int_not_equal(r.exit_code, 0);
    assert_non_null(strstr(r.err, "safetensors"));
    tu_run_free(&r);
    r = tu_llmem("run", dir, "--load-format", "npz", "-p", "x", NULL);
    assert_int_equal(r.exit_code, 2);
    assert_non_null(strstr(r.err, "--load-format: 'npz' is not auto or dummy"));
    tu_run_free(&r);
    tu_rmtree(dir);
    free(dir);

    /* a model of more ids than its tokenizer has (pycoder's 4,096 beside 65,536 random rows, where
     * nearly every row's largest logit is past the tokens): the logits end at the tokenizer's
     * ids, so every token drawn has text, greedy and sampled */
    dir = tu_mkdtemp();
    static const char config[] =
        "{\"model_type\": \"llama\", \"hidden_size\": 128, \"intermediate_size\": 128, "
        "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, "
        "\"head_dim\": 32, \"vocab_size\": 65536, \"max_position_embeddings\": 512, "
        "\"rms_norm_eps\": 1e-5, \"tie_word_embeddings\": true}";
    free(tu_write_file(dir, "config.json", config, (long)strlen(config)));
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(llmem_file_read(PYCODER "/tokenizer.json", 1 << 24, &text, &len), LLMEM_OK);
    free(tu_write_file(dir, "tokenizer.json", text, (long)len));
    free(text);
    for (int sampled = 0; sampled <= 1; sampled++) {
        r = tu_llmem("run", dir, "--load-format", "dummy", "-p", "def f", "-n", "32",
                     "--ignore-eos", "--json", "--temperature", sampled ? "2" : "0", NULL);
        assert_int_equal(r.exit_code, 0);
        cJSON *out = tu_json_stdout(&r);
        const cJSON *ids = cJSON_GetObjectItem(out, "ids"), *id;
        assert_int_equal(cJSON_GetArraySize(ids), 32);
        cJSON_ArrayForEach(id, ids) assert_true(id->valueint >= 0 && id->valueint < 4096);
        cJSON_Delete(out);
        tu_run_free(&r);
    }
    r = tu_llmem("run", dir, "--load-format", "dummy", "--ids", "1,4096", "-n", "1", NULL);
    assert_int_not_equal(r.exit_code, 0); /* an id past the tokens: outside the vocabulary */
    tu_run_free(&r);
    tu_rmtree(dir);
    free(dir);
}

static void test_run_stats_json(void **state) {
    (void)state;
    struct tu_run r = tu_llmem("run", PYCODER, "-p", "import os\n", "-n", "16", "--stats", "--json",
                               "--temperature", "0.8", "--top-p", "0.9", "--seed", "3",
                               "--kv-format", "q8", "--kv-layout", "contiguous", NULL);
    assert_int_equal(r.exit_code, 0);
    cJSON *out = tu_json_stdout(&r);
    const cJSON *stats = cJSON_GetObjectItem(out, "stats");
    assert_non_null(stats);
    assert_int_equal(cJSON_GetObjectItem(stats, "prompt_tokens")->valueint, 3);
    assert_int_equal(cJSON_GetObjectItem(stats, "reused_ram_tokens")->valueint, 0);
    assert_true(cJSON_GetObjectItem(stats, "ttft_ms")->valuedouble > 0);
    assert_true(cJSON_GetObjectItem(stats, "prefill_tokens_per_s")->valuedouble > 0);
    const cJSON *mem = cJSON_GetObjectItem(stats, "memory");
    const char *tags[] = {"weights", "kv", "scratch", "cache"};
    for (int i = 0; i < 4; i++) {
        const cJSON *t = cJSON_GetObjectItem(mem, tags[i]);
        assert_non_null(cJSON_GetObjectItem(t, "planned_bytes"));
        assert_non_null(cJSON_GetObjectItem(t, "measured_peak_bytes"));
    }
    assert_true(cJSON_GetObjectItem(cJSON_GetObjectItem(mem, "weights"), "measured_peak_bytes")
                    ->valuedouble >= 11540992);
    /* the same seed gives the same sample */
    struct tu_run r2 = tu_llmem("run", PYCODER, "-p", "import os\n", "-n", "16", "--json",
                                "--temperature", "0.8", "--top-p", "0.9", "--seed", "3",
                                "--kv-format", "q8", "--kv-layout", "contiguous", NULL);
    cJSON *out2 = tu_json_stdout(&r2);
    assert_string_equal(cJSON_GetObjectItem(out, "text")->valuestring,
                        cJSON_GetObjectItem(out2, "text")->valuestring);
    cJSON_Delete(out);
    cJSON_Delete(out2);
    tu_run_free(&r);
    tu_run_free(&r2);
}

static void test_tokenize_and_logits(void **state) {
    (void)state;
    cJSON *ref = reference();
    const cJSON *g = cJSON_GetArrayItem(cJSON_GetObjectItem(ref, "generations"), 0);
    struct tu_run r = tu_llmem("tokenize", PYCODER, "--text",
                               cJSON_GetObjectItem(g, "prompt")->valuestring, "--json", NULL);
    assert_int_equal(r.exit_code, 0);
    cJSON *out = tu_json_stdout(&r);
    char got[4096], want[4096];
    ids_csv(cJSON_GetObjectItem(out, "ids"), got, sizeof(got));
    ids_csv(cJSON_GetObjectItem(g, "prompt_ids"), want, sizeof(want));
    assert_string_equal(got, want);
    cJSON_Delete(out);
    tu_run_free(&r);

    /* teacher-forced logits of prompt + continuation, against transformers (f32) */
    char ids[8192];
    ids_csv(cJSON_GetObjectItem(g, "prompt_ids"), ids, sizeof(ids));
    size_t len = strlen(ids);
    ids[len++] = ',';
    ids_csv(cJSON_GetObjectItem(g, "greedy_ids"), ids + len, sizeof(ids) - len);
    char *dir = tu_mkdtemp(), path[512];
    snprintf(path, sizeof(path), "%s/logits.npy", dir);
    r = tu_llmem("logits", PYCODER, "--ids", ids, "--out", path, "--kv-format", "f32",
                 "--precision", "f32", "--max-batch-tokens", "16", NULL);
    assert_int_equal(r.exit_code, 0);
    float *a = NULL, *b = NULL;
    int64_t ar, ac, br, bc;
    assert_int_equal(llmem_npy_read_f32(path, &a, &ar, &ac), 0);
    assert_int_equal(llmem_npy_read_f32(REFS "/ref_logits_0.npy", &b, &br, &bc), 0);
    assert_int_equal(ar, br);
    assert_int_equal(ac, bc);
    double worst = 0;
    for (int64_t i = 0; i < ar * ac; i++)
        worst = fmax(worst, fabs((double)a[i] - (double)b[i]));
    printf("  llmem logits vs transformers: %lld × %lld, max |Δ| %.2e\n", (long long)ar,
           (long long)ac, worst);
    assert_true(worst <= 1e-4);
    free(a);
    free(b);
    tu_run_free(&r);
    tu_rmtree(dir);
    free(dir);
    cJSON_Delete(ref);
}

static void test_chat(void **state) {
    (void)state;
    const char *args[] = {"chat", PYCODER, "--chat-template", "chatml", "-n", "8", "--stats"};
    struct tu_run r = tu_llmem_input("def add(a, b):\nclass Foo:\n", 7, args);
    assert_int_equal(r.exit_code, 0);
    /* the second turn takes the whole first turn (prompt and answer, in full blocks) from the
     * session bank: 31 + 8 tokens, of which 38 have KV, are 2 blocks */
    const char *first = strstr(r.err, "prompt 31 tokens (0 from the session bank");
    assert_non_null(first);
    const char *second = strstr(first + 1, "llmem stats:");
    assert_non_null(second);
    assert_non_null(strstr(second, "(32 from the session bank: 32 from RAM, 0 from disk)"));
    /* two answers, one line each at least */
    int lines = 0;
    for (const char *p = r.out; *p; p++)
        lines += *p == '\n';
    assert_true(lines >= 2);
    tu_run_free(&r);
    /* a line that is not UTF-8 is said so and skipped; the session goes on to the next */
    r = tu_llmem_input("caf\xe9\ndef add(a, b):\n", 7, args);
    assert_int_equal(r.exit_code, 0);
    assert_non_null(strstr(r.err, "that line is not valid UTF-8 (byte 4); type it again"));
    assert_non_null(strstr(r.err, "prompt 31 tokens"));
    tu_run_free(&r);
    /* a NUL in a line is a byte of the message like any other: the line is not cut there (the
     * first turn, 31 tokens without it, gains the NUL's token; "def add(a," alone is fewer), and
     * the next turn still continues the conversation from the session bank */
    static const char nul_lines[] = "def add(a,\0 b):\nclass Foo:\n";
    r = tu_llmem_input_len(nul_lines, sizeof(nul_lines) - 1, 7, args);
    assert_int_equal(r.exit_code, 0);
    first = strstr(r.err, "prompt 32 tokens (0 from the session bank");
    if (first == NULL)
        fail_msg("the line with a NUL was not taken whole:\n%s", r.err);
    assert_non_null(strstr(first, "(32 from the session bank: 32 from RAM, 0 from disk)"));
    tu_run_free(&r);
    /* pycoder's tokenizer has no template: without --chat-template that is a clear error */
    r = tu_llmem_input("hi\n", 2, args);
    assert_int_equal(r.exit_code, 1);
    assert_non_null(strstr(r.err, "has no chat template; pass --chat-template"));
    tu_run_free(&r);
    const char *bad[] = {"chat", PYCODER, "--chat-template", "vicuna"};
    r = tu_llmem_input("hi\n", 4, bad);
    assert_int_equal(r.exit_code, 2);
    assert_non_null(strstr(r.err, "chatml"));
    tu_run_free(&r);
}

static void test_refused_by_plan(void **state) {
    (void)state;
    struct tu_run r = tu_llmem("run", PYCODER, "-p", "x", "--budget", "8M", NULL);
    assert_int_equal(r.exit_code, 3);
    assert_non_null(strstr(r.err, "refused before loading"));
    assert_non_null(strstr(r.err, "MODEL DOES NOT FIT"));
    assert_string_equal(r.out, "");
    tu_run_free(&r);
}

/* The process's resident memory stays inside the plan: a 1,400-token prompt and 600 generated
 * tokens on a small machine (about 64M: tu_budget_for) keep the peak RSS (VmHWM, mapped weights,
 * the allocator and everything outside it) below the trip; on a 35M machine, where the runtime
 * baseline leaves too little, the run is refused before loading and says why. */
static void test_resident_within_plan(void **state) {
    (void)state;
    char budget[32];
    tu_budget_for(PYCODER, 1, 0, budget, sizeof(budget));
    char *dir = tu_mkdtemp();
    char text[16384];
    size_t at = 0;
    for (int i = 0; at + 64 < sizeof(text) && i < 100; i++)
        at += (size_t)snprintf(text + at, sizeof(text) - at, "def f%d(x):\n    return x + %d\n", i,
                               i);
    char *prompt = tu_write_file(dir, "prompt.txt", text, (long)at);
    const char *args[] = {"run",          PYCODER,      "--prompt-file", prompt, "-n",        "600",
                          "--ignore-eos", "--no-spill", "--budget",      budget, "--threads", "2",
                          "--stats",      "--json"};
    struct tu_run r = tu_llmem_argv(14, args);
    assert_int_equal(r.exit_code, 0);
    cJSON *o = tu_json_stdout(&r);
    const cJSON *stats = cJSON_GetObjectItem(o, "stats");
    assert_true(cJSON_GetObjectItem(stats, "prompt_tokens")->valuedouble > 1000);
    const cJSON *m = cJSON_GetObjectItem(stats, "memory");
    double peak = cJSON_GetObjectItem(m, "resident_peak_bytes")->valuedouble;
    double trip = cJSON_GetObjectItem(m, "trip_bytes")->valuedouble;
    double baseline = cJSON_GetObjectItem(m, "runtime_baseline_bytes")->valuedouble;
    printf("  resident peak %.1f MiB below the trip %.1f MiB (baseline %.1f MiB)\n", peak / 1048576,
           trip / 1048576, baseline / 1048576);
    assert_true(baseline > 1e6);
    assert_true(peak > 0 && (TU_ASAN || peak < trip)); /* ASan's shadow memory is not planned */
    cJSON_Delete(o);
    tu_run_free(&r);

    args[9] = "35M";
    r = tu_llmem_argv(14, args);
    assert_int_equal(r.exit_code, 3);
    assert_non_null(strstr(r.err, "refused before loading"));
    assert_non_null(strstr(r.err, "the runtime baseline"));
    tu_run_free(&r);
    free(prompt);
    tu_rmtree(dir);
    free(dir);
}

/* Limits the plan calls unsafe (§3.1) are refused before loading, exit 3, naming the broken
 * inequality: --memory-limit and --util 1 put the allocation limit at the ceiling, --util 0.96
 * the trip above it. */
static void test_refused_unsafe_limits(void **state) {
    (void)state;
    const char *cases[][2] = {{"--memory-limit", "1000T"}, {"--util", "1"}, {"--util", "0.96"}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct tu_run r =
            tu_llmem("run", PYCODER, "-p", "x", "-n", "1", cases[i][0], cases[i][1], NULL);
        if (r.exit_code != 3 || strstr(r.err, "refused before loading") == NULL ||
            strstr(r.err, "< ceiling") == NULL || strstr(r.err, "does not hold") == NULL)
            fail_msg("%s %s: exit %d, stderr: %s", cases[i][0], cases[i][1], r.exit_code, r.err);
        assert_string_equal(r.out, "");
        tu_run_free(&r);
    }
    /* inside the band it runs */
    struct tu_run r = tu_llmem("run", PYCODER, "-p", "x", "-n", "1", "--util", "0.5", NULL);
    assert_int_equal(r.exit_code, 0);
    assert_null(strstr(r.err, "does not hold"));
    tu_run_free(&r);
}

/* A context above the model's maximum is clamped, with one warning line naming both. */
static void test_context_clamp_warns(void **state) {
    (void)state;
    struct tu_run r =
        tu_llmem("run", PYCODER, "-p", "x", "-n", "1", "--context", "1099511627776", NULL);
    assert_int_equal(r.exit_code, 0);
    if (strstr(r.err, "requested context 1099511627776 is above the model's maximum; using 2048") ==
        NULL)
        fail_msg("no warning: %s", r.err);
    assert_non_null(strstr(r.err, "context 2048\n"));
    tu_run_free(&r);
    r = tu_llmem("run", PYCODER, "-p", "x", "-n", "1", "--context", "1024", NULL);
    assert_int_equal(r.exit_code, 0);
    assert_null(strstr(r.err, "requested context"));
    tu_run_free(&r);
}

/* More ids than the context window: the window is named, not the KV pool's internals. */
static void test_logits_past_context(void **state) {
    (void)state;
    char ids[512] = "1";
    for (int i = 1; i < 65; i++)
        strcat(ids, ",1");
    char *dir = tu_mkdtemp(), path[512];
    snprintf(path, sizeof(path), "%s/logits.npy", dir);
    struct tu_run r =
        tu_llmem("logits", PYCODER, "--ids", ids, "--out", path, "--context", "64", NULL);
    assert_int_equal(r.exit_code, 1);
    if (strstr(r.err, "65 ids exceed the context window of 64 tokens") == NULL ||
        strstr(r.err, "paged pool") != NULL)
        fail_msg("unexpected: %s", r.err);
    tu_run_free(&r);
    ids[strlen(ids) - 2] = '\0'; /* 64 ids fit */
    r = tu_llmem("logits", PYCODER, "--ids", ids, "--out", path, "--context", "64", NULL);
    assert_int_equal(r.exit_code, 0);
    tu_run_free(&r);
    tu_rmtree(dir);
    free(dir);
}

/* A zero budget or memory limit is a usage error, not a silent "auto". */
static void test_zero_sizes_refused(void **state) {
    (void)state;
    const char *flags[] = {"--budget", "--memory-limit"};
    for (size_t i = 0; i < sizeof(flags) / sizeof(flags[0]); i++) {
        struct tu_run r = tu_llmem("run", PYCODER, "-p", "x", "-n", "1", flags[i], "0", NULL);
        char want[64];
        snprintf(want, sizeof(want), "%s: the size must be positive", flags[i]);
        if (r.exit_code != 2 || strstr(r.err, want) == NULL)
            fail_msg("%s 0: exit %d, stderr: %s", flags[i], r.exit_code, r.err);
        assert_string_equal(r.out, "");
        tu_run_free(&r);
    }
}

/* ---- bad input --------------------------------------------------------------------------------
 */

static char *read_all(const char *path, long *n) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    *n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)*n + 1);
    assert_int_equal(fread(buf, 1, (size_t)*n, f), (size_t)*n);
    buf[*n] = '\0';
    fclose(f);
    return buf;
}

/* A copy of pycoder in a temporary directory, for breaking one file. */
static char *copy_pycoder(void) {
    char *dir = tu_mkdtemp();
    const char *files[] = {"config.json", "generation_config.json", "model.safetensors",
                           "tokenizer.json", "tokenizer_config.json"};
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
        char src[512];
        snprintf(src, sizeof(src), "%s/%s", PYCODER, files[i]);
        long n = 0;
        char *buf = read_all(src, &n);
        free(tu_write_file(dir, files[i], buf, n));
        free(buf);
    }
    return dir;
}

/* Replaces the first occurrence of `from` in dir/name with `to` (same length keeps offsets). */
static void edit(const char *dir, const char *name, const char *from, const char *to) {
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    long n = 0;
    char *buf = read_all(path, &n);
    char *hit = memmem(buf, (size_t)n, from, strlen(from));
    assert_non_null(hit);
    size_t fl = strlen(from), tl = strlen(to);
    char *out = malloc((size_t)n + tl + 1);
    size_t pre = (size_t)(hit - buf);
    memcpy(out, buf, pre);
    memcpy(out + pre, to, tl);
    memcpy(out + pre + tl, hit + fl, (size_t)n - pre - fl);
    free(tu_write_file(dir, name, out, (long)((size_t)n - fl + tl)));
    free(out);
    free(buf);
}

static void expect_failure(const char *dir, const char *needle) {
    struct tu_run r = tu_llmem("run", dir, "-p", "def", "-n", "2", NULL);
    if (r.exit_code != 1 || strstr(r.err, needle) == NULL)
        printf("exit %d, stderr:\n%s\n(expected '%s')\n", r.exit_code, r.err, needle);
    assert_int_equal(r.exit_code, 1);
    assert_non_null(strstr(r.err, needle));
    assert_string_equal(r.out, "");
    tu_run_free(&r);
    tu_rmtree(dir);
    free((char *)dir);
}

/* A model whose final norm holds NaN: every logit is NaN, and the run says so instead of printing
 * token 0 again and again. */
static void test_nan_weights(void **state) {
    (void)state;
    char *dir = copy_pycoder();
    struct llmem_safetensors *st = NULL;
    assert_int_equal(llmem_safetensors_load_dir(dir, &st), LLMEM_OK);
    const struct llmem_st_tensor *t = llmem_safetensors_find(st, "model.norm.weight");
    assert_non_null(t);
    char path[512];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, st->files[t->file_index].data_offset + t->offset_begin, SEEK_SET), 0);
    for (int64_t i = 0; i < t->n_elements; i++) {
        const uint16_t bf16_nan = 0x7FC0, f16_nan = 0x7E00;
        const uint32_t f32_nan = 0x7FC00000u;
        if (t->dtype == LLMEM_DTYPE_F32)
            assert_int_equal(fwrite(&f32_nan, 4, 1, f), 1);
        else
            assert_int_equal(fwrite(t->dtype == LLMEM_DTYPE_BF16 ? &bf16_nan : &f16_nan, 2, 1, f),
                             1);
    }
    fclose(f);
    llmem_safetensors_free(st);
    /* served: a 500 that says why, and the server goes on */
    struct tu_server srv;
    const char *args[] = {dir, "--threads", "1"};
    tu_serve_start(&srv, 3, args);
    char url[256];
    snprintf(url, sizeof(url), "%s/v1/completions", srv.url);
    for (int i = 0; i < 2; i++) {
        struct tu_http h = tu_http("POST", url, "{\"prompt\": \"def\", \"max_tokens\": 2}");
        assert_int_equal(h.status, 500);
        assert_non_null(strstr(h.body, "not finite"));
        tu_http_free(&h);
    }
    assert_int_equal(tu_serve_stop(&srv), 0);
    expect_failure(dir, "not finite");
}

static void test_bad_input(void **state) {
    (void)state;
    struct tu_run r = tu_llmem("run", "/nonexistent/model", "-p", "x", NULL);
    assert_int_equal(r.exit_code, 1);
    assert_non_null(strstr(r.err, "/nonexistent/model"));
    tu_run_free(&r);

    /* truncated weights: the header promises more bytes than the file has */
    char *dir = copy_pycoder(), path[512];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    assert_int_equal(truncate(path, 1 << 20), 0);
    expect_failure(dir, "model.safetensors");

    /* a corrupt header (its JSON broken) */
    dir = copy_pycoder();
    edit(dir, "model.safetensors", "\"dtype\"", "\"dtypf\"");
    expect_failure(dir, "model.safetensors");

    /* a missing tensor (renamed in the header, same length) */
    dir = copy_pycoder();
    edit(dir, "model.safetensors", "model.norm.weight", "model.norX.weight");
    expect_failure(dir, "tensor 'model.norm.weight' is missing");

    /* a shape that disagrees with the config */
    dir = copy_pycoder();
    edit(dir, "config.json", "\"intermediate_size\": 768", "\"intermediate_size\": 512");
    expect_failure(dir, "has shape [768, 256]; the config says [512, 256]");

    /* an unknown architecture */
    dir = copy_pycoder();
    edit(dir, "config.json", "\"model_type\": \"llama\"", "\"model_type\": \"gpt2\"");
    expect_failure(dir, "'gpt2' is not supported");

    /* a broken tokenizer.json */
    dir = copy_pycoder();
    snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
    assert_int_equal(truncate(path, 1000), 0);
    expect_failure(dir, "tokenizer.json");

    /* an unsupported tokenizer model */
    dir = copy_pycoder();
    edit(dir, "tokenizer.json", "\"type\": \"BPE\"", "\"type\": \"Unigram\"");
    expect_failure(dir, "Unigram");

    /* a tokenizer whose vocabulary holds only its special tokens: the prompt encodes to
     * nothing, and the run says so */
    dir = copy_pycoder();
    snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
    long len = 0;
    char *text = read_all(path, &len);
    cJSON *tj = cJSON_Parse(text);
    cJSON *model = cJSON_GetObjectItem(tj, "model");
    cJSON_ReplaceItemInObject(model, "vocab", cJSON_CreateObject());
    cJSON_ReplaceItemInObject(model, "merges", cJSON_CreateArray());
    char *emptied = cJSON_PrintUnformatted(tj);
    free(tu_write_file(dir, "tokenizer.json", emptied, -1));
    cJSON_free(emptied);
    cJSON_Delete(tj);
    free(text);
    r = tu_llmem("run", dir, "-p", "def", "-n", "2", NULL);
    assert_int_equal(r.exit_code, 2);
    assert_non_null(strstr(r.err, "the prompt encodes to no tokens"));
    tu_run_free(&r);
    tu_rmtree(dir);
    free(dir);

    /* bad option values */
    r = tu_llmem("run", PYCODER, "--ids", "1,x,3", NULL);
    assert_int_equal(r.exit_code, 2);
    assert_non_null(strstr(r.err, "--ids"));
    tu_run_free(&r);
    r = tu_llmem("run", PYCODER, "--ids", "1,2", "--kv-format", "q3", NULL);
    assert_int_equal(r.exit_code, 2);
    tu_run_free(&r);
    r = tu_llmem("run", PYCODER, "--ids", "999999", NULL);
    assert_int_equal(r.exit_code, 1);
    assert_non_null(strstr(r.err, "outside the vocabulary"));
    tu_run_free(&r);

    /* a malformed environment variable fails the run with one line that names it, rather than
     * being read as its default */
    setenv("LLMEM_DECODE_AHEAD", "abc", 1);
    r = tu_llmem("run", PYCODER, "-p", "x", "-n", "2", NULL);
    unsetenv("LLMEM_DECODE_AHEAD");
    assert_int_equal(r.exit_code, 1);
    assert_string_equal(r.out, "");
    assert_non_null(strstr(r.err, "LLMEM_DECODE_AHEAD='abc' is not accepted: expected 0 or 1"));
    tu_run_free(&r);
    /* a stop string that is not UTF-8 could never match the text: refused, not ignored */
    r = tu_llmem("run", PYCODER, "-p", "def", "-n", "2", "--stop", "\xff\xfe", NULL);
    assert_int_equal(r.exit_code, 1);
    assert_non_null(strstr(r.err, "not valid UTF-8"));
    tu_run_free(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_run_greedy_matches),
        cmocka_unit_test(test_run_stats_json),
        cmocka_unit_test(test_moe_greedy),
        cmocka_unit_test(test_tensor_parallel),
        cmocka_unit_test(test_load_format_dummy),
        cmocka_unit_test(test_tokenize_and_logits),
        cmocka_unit_test(test_chat),
        cmocka_unit_test(test_refused_by_plan),
        cmocka_unit_test(test_resident_within_plan),
        cmocka_unit_test(test_refused_unsafe_limits),
        cmocka_unit_test(test_context_clamp_warns),
        cmocka_unit_test(test_logits_past_context),
        cmocka_unit_test(test_zero_sizes_refused),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_nan_weights),
        cmocka_unit_test(test_files_keep_nul),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
