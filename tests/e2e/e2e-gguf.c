/*
 * tests/e2e/e2e-gguf.c — GGUF files through the binary: llmem runs a quantized file as the model
 * holding its exactly dequantized weights, tokenizes as the tokenizer.json the file was made
 * from, and refuses what it cannot run with one line.
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

/* `llmem logits` of the GGUF file at path equals that of the f32 model holding its dequantized
 * weights (with the config and tokenizer of src, the directory it was made from): bit for bit,
 * or within tol where the file's rope scaling comes as rope_freqs.weight (the f32 model computes
 * it from its config). Returns the largest difference. */
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
                               "--no-spill", NULL);
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

/* What llmem does not run is refused with one line: a file whose tensors are of a type it does
 * not read, and the CUDA backend (its kernels for the block types are not written yet). */
static void test_refusals(void **state) {
    (void)state;
    struct tu_run r = tu_llmem("run", PYCODER_GGUF, "-p", "x", "--backend", "cuda", NULL);
    assert_int_not_equal(r.exit_code, 0);
    assert_non_null(strstr(r.err, "GGUF files run on the CPU"));
    tu_run_free(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_logits_equal_dequantized),
        cmocka_unit_test(test_quantized_files),
        cmocka_unit_test(test_tokenize_and_run),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
