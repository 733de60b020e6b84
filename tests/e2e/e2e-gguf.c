/*
 * tests/e2e/e2e-gguf.c — GGUF files through the binary: llmem runs a quantized file as the model
 * holding its exactly dequantized weights, tokenizes as the tokenizer.json the file was made
 * from, and refuses what it cannot run with one line.
 *
 * At --precision fast (the default) the quantized weights multiply by integer dot products with
 * the activations quantized to 8 bits per block: its drift from the exact f32 path is measured
 * and bounded here, and KV banked at one precision is never served to the other.
 *
 * The reference model is made here from the file itself: every tensor dequantized by
 * quant/dequant.c (bit-exact with ggml's dequantize_row_*, tests/test-quant.c), the q and k rows
 * of the llama architecture put back from GGUF's interleaved-pair layout, written as an f32
 * safetensors directory with the config and tokenizer of models/pycoder (the file's source).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "core/npy.h"
#include "model/gguf.h"
#include "quant/quant.h"
#include "testutil.h"

#define PYCODER      LLMEM_SOURCE_DIR "/models/pycoder"
#define PYCODER_GGUF LLMEM_SOURCE_DIR "/tests/data/gguf/pycoder-q4_k_m.gguf"

/* Writes dir/model.safetensors: every tensor of g as f32, exactly dequantized, q and k rows of
 * `heads` / `kv_heads` heads put back from pairs side by side to halves where `permuted` (llama).
 */
static void write_dequantized(const struct llmem_gguf *g, const char *dir, int permuted,
                              int64_t head_dim, int64_t heads, int64_t kv_heads) {
    struct tu_st_writer w = {0};
    char name[160], path[1024];
    for (int64_t i = 0; i < g->n_tensors; i++) {
        const struct llmem_gguf_tensor *t = &g->tensors[i];
        if (strcmp(t->name, "rope_freqs.weight") == 0)
            continue; /* the f32 model computes Llama 3's rope scaling from its config */
        assert_true(llmem_gguf_hf_name(t->name, name, sizeof(name)));
        tu_st_add(&w, name, t->n_dims == 1 ? t->dims[0] : t->dims[1],
                  t->n_dims == 1 ? 0 : t->dims[0]);
    }
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    tu_st_open(&w, path);
    for (int64_t i = 0; i < g->n_tensors; i++) {
        const struct llmem_gguf_tensor *t = &g->tensors[i];
        if (strcmp(t->name, "rope_freqs.weight") == 0)
            continue;
        float *v = malloc((size_t)t->n_elements * sizeof(float));
        float *out = malloc((size_t)t->n_elements * sizeof(float));
        assert_true(v != NULL && out != NULL);
        assert_int_equal(llmem_quant_dequantize_row(t->type, t->data, v, t->n_elements), LLMEM_OK);
        memcpy(out, v, (size_t)t->n_elements * sizeof(float));
        int q = strstr(t->name, "attn_q.weight") != NULL;
        int k = strstr(t->name, "attn_k.weight") != NULL;
        if (permuted && (q || k)) { /* GGUF row 2j + s of a head is Hugging Face's row s·half + j */
            const int64_t cols = t->dims[0], half = head_dim / 2;
            for (int64_t h = 0; h < (q ? heads : kv_heads); h++)
                for (int64_t j = 0; j < half; j++)
                    for (int64_t s = 0; s < 2; s++)
                        memcpy(out + (h * head_dim + s * half + j) * cols,
                               v + (h * head_dim + 2 * j + s) * cols, (size_t)cols * sizeof(float));
        }
        tu_st_write(&w, out, t->n_elements);
        free(v);
        free(out);
    }
    tu_st_close(&w);
}

/* `llmem logits` of the GGUF file at path, at --precision f32, equals that of the f32 model holding
 * its dequantized weights (with the config and tokenizer of src, the directory it was made from):
 * bit for bit, or within tol where the file's rope scaling comes as rope_freqs.weight (the f32
 * model computes it from its config). Returns the largest difference. */
static double check_dequantized(const char *path, const char *src, double tol) {
    struct llmem_gguf *g = NULL;
    assert_int_equal(llmem_gguf_open(path, &g), LLMEM_OK);
    struct llmem_model_geometry geom;
    assert_int_equal(llmem_gguf_geometry(g, &geom, "test"), LLMEM_OK);
    char *dir = tu_mkdtemp();
    write_dequantized(g, dir, strcmp(geom.arch, "llama") == 0, geom.head_dim, geom.n_heads,
                      geom.n_kv_heads);
    llmem_gguf_free(g);
    char from[1024];
    snprintf(from, sizeof(from), "%s/config.json", src);
    tu_copy_into(from, dir);
    snprintf(from, sizeof(from), "%s/tokenizer.json", src);
    tu_copy_into(from, dir);

    enum { N = 48 };
    char ids[1024];
    int at = 0;
    for (int i = 0; i < N; i++)
        at += snprintf(ids + at, sizeof(ids) - (size_t)at, "%s%lld", i ? "," : "",
                       (long long)((i * 977 + 13) % geom.vocab_size));
    char out_q[1024], out_f[1024];
    snprintf(out_q, sizeof(out_q), "%s/q.npy", dir);
    snprintf(out_f, sizeof(out_f), "%s/f.npy", dir);
    struct tu_run r = tu_llmem("logits", path, "--ids", ids, "--out", out_q, "--threads", "2",
                               "--no-spill", "--precision", "f32", NULL);
    assert_int_equal(r.exit_code, 0);
    tu_run_free(&r);
    r = tu_llmem("logits", dir, "--ids", ids, "--out", out_f, "--threads", "2", "--no-spill", NULL);
    assert_int_equal(r.exit_code, 0);
    tu_run_free(&r);
    float *a = NULL, *b = NULL;
    int64_t ra, ca, rb, cb;
    assert_int_equal(llmem_npy_read_f32(out_q, &a, &ra, &ca), LLMEM_OK);
    assert_int_equal(llmem_npy_read_f32(out_f, &b, &rb, &cb), LLMEM_OK);
    assert_int_equal(ra, N);
    assert_int_equal(ca, geom.vocab_size);
    assert_true(rb == ra && cb == ca);
    double worst = 0;
    for (int64_t i = 0; i < ra * ca; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        worst = d > worst ? d : worst;
    }
    if (tol == 0)
        assert_memory_equal(a, b, (size_t)(ra * ca) * sizeof(float));
    assert_true(worst <= tol);
    free(a);
    free(b);
    tu_rmtree(dir);
    free(dir);
    return worst;
}

/* pycoder at Q4_K_M (Q4_K and Q6_K blocks, F32 norms), made by llama-quantize: the blocks, the
 * pairs' rope layout and the rest of the pass are exact. */
static void test_logits_equal_dequantized(void **state) {
    (void)state;
    check_dequantized(PYCODER_GGUF, PYCODER, 0);
}

/* The same for the files `llmem quantize` writes: pycoder at the other types (Q8_0, Q6_K, Q5_K_M
 * — Q5_K with Q6_K —, Q4_0 — with a Q6_K output), and Llama 3 (rope_freqs.weight), Qwen2 (biases)
 * and Qwen3 (q/k norms) models. */
static void test_quantized_files(void **state) {
    (void)state;
    const struct {
        const char *src, *type;
        double tol;
    } cases[] = {
        {PYCODER, "q8_0", 0},
        {PYCODER, "q6_k", 0},
        {PYCODER, "q5_k_m", 0},
        {PYCODER, "q4_0", 0},
        {LLMEM_SOURCE_DIR "/tests/data/models/tiny-llama3", "q4_k_m", 1e-4},
        {LLMEM_SOURCE_DIR "/tests/data/models/tiny-qwen2", "q8_0", 0},
        {LLMEM_SOURCE_DIR "/tests/data/models/tiny-qwen3", "q4_k_m", 0},
    };
    char *dir = tu_mkdtemp();
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char out[1024];
        snprintf(out, sizeof(out), "%s/m%zu.gguf", dir, i);
        struct tu_run r = tu_llmem("quantize", cases[i].src, out, "--type", cases[i].type, NULL);
        assert_int_equal(r.exit_code, 0);
        tu_run_free(&r);
        double worst = check_dequantized(out, cases[i].src, cases[i].tol);
        printf("  %s at %s: max |logit - dequantized f32's| %.3g\n", strrchr(cases[i].src, '/') + 1,
               cases[i].type, worst);
    }
    tu_rmtree(dir);
    free(dir);
}

/* Bounds of the fast path's drift (test_fast_drift), about twice what is measured: max |Δlogit|
 * 1.42, KL mean 7.5e-3 and max 7.3e-2, top-1 261 of 277, greedy: the first 9 tokens equal. The
 * kernels give the same bits on every ISA and thread count, so these do not move with the
 * machine. */
#define DRIFT_MAX_DLOGIT    3.0
#define DRIFT_MEAN_KL       1.5e-2
#define DRIFT_MAX_KL        0.15
#define DRIFT_TOP1          0.9
#define DRIFT_GREEDY_PREFIX 5

/* The ids of a run's --json output, appended to ids[*n] (at most cap). */
static void append_ids(const struct tu_run *r, int32_t *ids, int *n, int cap) {
    cJSON *out = tu_json_stdout(r);
    const cJSON *arr = cJSON_GetObjectItem(out, "ids"), *v;
    assert_true(cJSON_IsArray(arr));
    cJSON_ArrayForEach(v, arr) {
        if (*n < cap)
            ids[(*n)++] = v->valueint;
    }
    cJSON_Delete(out);
}

static float *logits_at(const char *precision, const char *ids, const char *dir, int64_t *rows,
                        int64_t *cols) {
    char out[1024];
    snprintf(out, sizeof(out), "%s/%s.npy", dir, precision);
    struct tu_run r = tu_llmem("logits", PYCODER_GGUF, "--ids", ids, "--out", out, "--threads", "2",
                               "--no-spill", "--precision", precision, NULL);
    assert_int_equal(r.exit_code, 0);
    tu_run_free(&r);
    float *a = NULL;
    assert_int_equal(llmem_npy_read_f32(out, &a, rows, cols), LLMEM_OK);
    return a;
}

/* --precision fast against f32 on pycoder Q4_K_M: the greedy continuations of a prompt, and the
 * teacher-forced logits of the prompt and the f32 continuation (max |Δlogit|, KL(f32 ‖ fast) of
 * the softmaxes, top-1 agreement), within bounds measured with margin (the drift is that of
 * 8-bit activations: ~1/254 of each block's largest value, relative). */
#define DRIFT_GEN 256
static void test_fast_drift(void **state) {
    (void)state;
    const char *prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n";
    int32_t gen[2][DRIFT_GEN];
    int n_gen[2] = {0, 0};
    const char *prec[2] = {"f32", "fast"};
    for (int p = 0; p < 2; p++) {
        struct tu_run r =
            tu_llmem("run", PYCODER_GGUF, "-p", prompt, "-n", "256", "--ignore-eos", "--threads",
                     "2", "--no-spill", "--json", "--precision", prec[p], NULL);
        assert_int_equal(r.exit_code, 0);
        append_ids(&r, gen[p], &n_gen[p], DRIFT_GEN);
        tu_run_free(&r);
        assert_int_equal(n_gen[p], DRIFT_GEN);
    }
    int same_prefix = 0, same = 0;
    while (same_prefix < DRIFT_GEN && gen[0][same_prefix] == gen[1][same_prefix])
        same_prefix++;
    for (int i = 0; i < DRIFT_GEN; i++)
        same += gen[0][i] == gen[1][i];

    struct tu_run t = tu_llmem("tokenize", PYCODER_GGUF, "--text", prompt, NULL);
    assert_int_equal(t.exit_code, 0);
    char *ids = malloc(strlen(t.out) + DRIFT_GEN * 8 + 8);
    assert_non_null(ids);
    size_t at = strcspn(t.out, "\n");
    memcpy(ids, t.out, at);
    tu_run_free(&t);
    for (int i = 0; i < DRIFT_GEN - 1; i++)
        at += (size_t)sprintf(ids + at, ",%d", gen[0][i]);
    ids[at] = '\0';

    char *dir = tu_mkdtemp();
    int64_t ra, ca, rb, cb;
    float *a = logits_at("f32", ids, dir, &ra, &ca);
    float *b = logits_at("fast", ids, dir, &rb, &cb);
    assert_true(ra == rb && ca == cb && ra > DRIFT_GEN);
    double max_d = 0.0, max_kl = 0.0, sum_kl = 0.0;
    int64_t top_same = 0;
    for (int64_t i = 0; i < ra; i++) {
        const float *x = a + i * ca, *y = b + i * ca;
        double mx = x[0], my = y[0];
        int64_t ax = 0, ay = 0;
        for (int64_t k = 0; k < ca; k++) {
            double d = fabs((double)x[k] - (double)y[k]);
            max_d = d > max_d ? d : max_d;
            if (x[k] > mx)
                mx = x[k], ax = k;
            if (y[k] > my)
                my = y[k], ay = k;
        }
        top_same += ax == ay;
        double zx = 0.0, zy = 0.0;
        for (int64_t k = 0; k < ca; k++) {
            zx += exp(x[k] - mx);
            zy += exp(y[k] - my);
        }
        double kl = 0.0;
        for (int64_t k = 0; k < ca; k++) {
            double lp = x[k] - mx - log(zx), lq = y[k] - my - log(zy);
            kl += exp(lp) * (lp - lq);
        }
        max_kl = kl > max_kl ? kl : max_kl;
        sum_kl += kl;
    }
    printf("  fast vs f32: max |dlogit| %.4f, KL mean %.2e max %.2e, top-1 %lld/%lld; greedy: "
           "first %d of %d tokens equal, %d equal in all\n",
           max_d, sum_kl / (double)ra, max_kl, (long long)top_same, (long long)ra, same_prefix,
           DRIFT_GEN, same);
    assert_true(max_d < DRIFT_MAX_DLOGIT);
    assert_true(sum_kl / (double)ra < DRIFT_MEAN_KL);
    assert_true(max_kl < DRIFT_MAX_KL);
    assert_true((double)top_same >= DRIFT_TOP1 * (double)ra);
    assert_true(same_prefix >= DRIFT_GREEDY_PREFIX);
    free(a);
    free(b);
    free(ids);
    tu_rmtree(dir);
    free(dir);
}

static int reused_tokens(const struct tu_run *r) {
    cJSON *out = tu_json_stdout(r);
    const cJSON *st = cJSON_GetObjectItem(out, "stats");
    int n = cJSON_GetObjectItem(st, "reused_disk_tokens")->valueint +
            cJSON_GetObjectItem(st, "reused_ram_tokens")->valueint;
    cJSON_Delete(out);
    return n;
}

/* The precision is part of the bank's model identity: KV banked at f32 is reused at f32 by a
 * second process and never served to a run at fast (and the other way round), for quantized
 * weights (the GGUF file) and bf16 ones (the safetensors directory). */
static void test_bank_keeps_precisions_apart(void **state) {
    (void)state;
    const char *models[] = {PYCODER_GGUF, PYCODER};
    for (int m = 0; m < 2; m++) {
        char *dir = tu_mkdtemp();
        char ids[8192];
        int at = 0;
        for (int i = 0; i < 700; i++)
            at += snprintf(ids + at, sizeof(ids) - (size_t)at, "%s%d", i ? "," : "",
                           20 + (i * 37) % 3900);
        const char *order[] = {"f32", "f32", "fast", "fast", "f32"};
        const int want_reuse[] = {0, 1, 0, 1, 1};
        for (int i = 0; i < 5; i++) {
            struct tu_run r = tu_llmem("run", models[m], "--ids", ids, "-n", "4", "--ignore-eos",
                                       "--json", "--stats", "--threads", "2", "--bank-dir", dir,
                                       "--precision", order[i], NULL);
            assert_int_equal(r.exit_code, 0);
            int reused = reused_tokens(&r);
            tu_run_free(&r);
            if (want_reuse[i])
                assert_int_equal(reused, 688); /* (700 − 1) / 16 × 16 */
            else
                assert_int_equal(reused, 0);
        }
        tu_rmtree(dir);
        free(dir);
    }
}

/* The file's tokenizer (tokenizer.ggml.*) gives the ids of the tokenizer.json it was made from,
 * and `llmem run` on the file generates text. */
static void test_tokenize_and_run(void **state) {
    (void)state;
    const char *texts[] = {"def fibonacci(n):\n    return n", "  two  spaces\tand a tab\n\n",
                           "unicode: héllo wörld ✓ 日本", "x = [1, 22, 333, 4444]"};
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        struct tu_run a = tu_llmem("tokenize", PYCODER_GGUF, "--text", texts[i], NULL);
        struct tu_run b = tu_llmem("tokenize", PYCODER, "--text", texts[i], NULL);
        assert_int_equal(a.exit_code, 0);
        assert_int_equal(b.exit_code, 0);
        assert_string_equal(a.out, b.out);
        tu_run_free(&a);
        tu_run_free(&b);
    }
    struct tu_run r = tu_llmem("run", PYCODER_GGUF, "-p", "def add(a, b):", "-n", "16",
                               "--ignore-eos", "--threads", "2", "--no-spill", "--json", NULL);
    assert_int_equal(r.exit_code, 0);
    assert_non_null(strstr(r.out, "\"finish_reason\":"));
    tu_run_free(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_logits_equal_dequantized),
        cmocka_unit_test(test_quantized_files),
        cmocka_unit_test(test_tokenize_and_run),
        cmocka_unit_test(test_fast_drift),
        cmocka_unit_test(test_bank_keeps_precisions_apart),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
