/*
 * tests/e2e/e2e-mlx.c — MLX quantized model directories (mlx-lm's `convert -q`) through the binary:
 * llmem runs them as the models holding their exactly dequantized weights, plans them, and
 * refuses a broken one with one line that names what is wrong.
 *
 * The fixtures are tests/data/mlx/ (made by its make_mlx.py, a port of MLX's quantize): 4 bits
 * with bf16 scales, 8 bits with f16 scales, f32 with per-module entries (8-bit groups of 128
 * and 64, 4-bit groups of 32 and 128, a module left unquantized), and a tied model. The
 * reference model is made here from each fixture's files: every quantized matrix dequantized by
 * quant/dequant.c (checked against hand-worked groups in tests/test-quant.c, and here against
 * the original weights the fixture was quantized from), every other tensor as f32, written as
 * an f32 safetensors directory with the original model's config.json.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/npy.h"
#include "llmem/safetensors.h"
#include "quant/quant.h"
#include "testutil.h"

#define DATA LLMEM_SOURCE_DIR "/tests/data"

static const struct {
    const char *name, *source;
} fixtures[] = {
    {"tiny-mistral-swa-4bit", "tiny-mistral-swa"},
    {"tiny-mistral-swa-8bit-f16", "tiny-mistral-swa"},
    {"tiny-mistral-swa-mixed", "tiny-mistral-swa"},
    {"tiny-qwen2-4bit", "tiny-qwen2"},
    {"tiny-qwen3-moe-4bit", "tiny-qwen3-moe"},
};

/* ---- reading tensors --------------------------------------------------------------------------
 */

struct model_file {
    struct llmem_safetensors *st;
    char *bytes; /* the whole (single) file */
};

static void model_open(const char *dir, struct model_file *m) {
    assert_int_equal(llmem_safetensors_load_dir(dir, &m->st), LLMEM_OK);
    assert_int_equal(m->st->n_files, 1);
    FILE *f = fopen(m->st->files[0].path, "rb");
    assert_non_null(f);
    m->bytes = malloc((size_t)m->st->files[0].file_bytes);
    assert_non_null(m->bytes);
    assert_int_equal(fread(m->bytes, 1, (size_t)m->st->files[0].file_bytes, f),
                     (size_t)m->st->files[0].file_bytes);
    fclose(f);
}

static void model_close(struct model_file *m) {
    llmem_safetensors_free(m->st);
    free(m->bytes);
}

static const void *data_of(const struct model_file *m, const struct llmem_st_tensor *t) {
    return m->bytes + m->st->files[0].data_offset + t->offset_begin;
}

static float *floats_of(const struct model_file *m, const struct llmem_st_tensor *t) {
    float *v = malloc((size_t)t->n_elements * sizeof(float));
    assert_non_null(v);
    int type = t->dtype == LLMEM_DTYPE_F32   ? LLMEM_QTYPE_F32
               : t->dtype == LLMEM_DTYPE_F16 ? LLMEM_QTYPE_F16
                                             : LLMEM_QTYPE_BF16;
    assert_true(t->dtype == LLMEM_DTYPE_F32 || t->dtype == LLMEM_DTYPE_F16 ||
                t->dtype == LLMEM_DTYPE_BF16);
    assert_int_equal(llmem_quant_dequantize_row(type, data_of(m, t), v, t->n_elements), LLMEM_OK);
    return v;
}

static const struct llmem_st_tensor *find_suffixed(const struct model_file *m, const char *name,
                                                   size_t stem, const char *suffix) {
    char buf[256];
    snprintf(buf, sizeof(buf), "%.*s%s", (int)stem, name, suffix);
    return llmem_safetensors_find(m->st, buf);
}

/* Tensor t of the fixture as f32 [n_elements of the original]: a quantized module's weight
 * dequantized row by row (bits and group from the shapes of the codes, the scales and the
 * original), else converted. *n gets its element count. The dequantized values are checked
 * against the original's: within one quantization step (MLX's top code clamps when the rounding
 * of the group's edge moved its grid), plus the stored scale's rounding times the largest code,
 * plus the rounding of the scales' dtype. */
/* The original of the fixture's tensor `name` as f32, and its shape: the tensor of that name, or
 * for mlx-lm's stacked experts (…mlp.switch_mlp.P.weight) the original's one tensor per expert
 * (…mlp.experts.E.P.weight) stacked [experts, rows, cols]. */
static float *original_of(const struct model_file *orig, const char *name, int *n_dims,
                          int64_t shape[3]) {
    const struct llmem_st_tensor *o = llmem_safetensors_find(orig->st, name);
    if (o != NULL) {
        *n_dims = o->n_dims;
        for (int d = 0; d < o->n_dims; d++)
            shape[d] = o->shape[d];
        return floats_of(orig, o);
    }
    const char *at = strstr(name, ".switch_mlp.");
    assert_non_null(at);
    char expert[256];
    float *v = NULL;
    int64_t E = 0, each = 0;
    for (;; E++) {
        snprintf(expert, sizeof(expert), "%.*s.experts.%lld.%s", (int)(at - name), name,
                 (long long)E, at + strlen(".switch_mlp."));
        if ((o = llmem_safetensors_find(orig->st, expert)) == NULL)
            break;
        each = o->n_elements;
        assert_non_null(v = realloc(v, (size_t)((E + 1) * each) * sizeof(float)));
        float *one = floats_of(orig, o);
        memcpy(v + E * each, one, (size_t)each * sizeof(float));
        free(one);
        shape[1] = o->shape[0], shape[2] = o->shape[1];
    }
    assert_true(E > 0);
    *n_dims = 3;
    shape[0] = E;
    return v;
}

static float *tensor_f32(const struct model_file *m, const struct model_file *orig,
                         const struct llmem_st_tensor *t, int64_t *n, int *quantized,
                         int *n_dims, int64_t shape[3]) {
    size_t len = strlen(t->name);
    const struct llmem_st_tensor *s = NULL, *b = NULL;
    if (len > 7 && strcmp(t->name + len - 7, ".weight") == 0) {
        s = find_suffixed(m, t->name, len - 7, ".scales");
        b = find_suffixed(m, t->name, len - 7, ".biases");
    }
    float *ref = original_of(orig, t->name, n_dims, shape);
    *quantized = s != NULL;
    if (s == NULL) {
        free(ref);
        *n = t->n_elements;
        return floats_of(m, t);
    }
    assert_non_null(b);
    assert_int_equal(t->dtype, LLMEM_DTYPE_U32);
    /* a stacked tensor's experts as rows one after another */
    const int64_t cols = shape[*n_dims - 1], rows = *n_dims == 3 ? shape[0] * shape[1] : shape[0];
    const int64_t width = t->shape[t->n_dims - 1], groups = s->shape[s->n_dims - 1];
    const int bits = (int)(width * 32 / cols), group = (int)(cols / groups);
    const int st = s->dtype == LLMEM_DTYPE_F32   ? LLMEM_QTYPE_F32
                   : s->dtype == LLMEM_DTYPE_F16 ? LLMEM_QTYPE_F16
                                                 : LLMEM_QTYPE_BF16;
    const int type = llmem_qtype_mlx(bits, group, st);
    assert_true(type > 0);
    float *v = malloc((size_t)(rows * cols) * sizeof(float));
    float *sc = floats_of(m, s);
    assert_non_null(v);
    const size_t ssize = st == LLMEM_QTYPE_F32 ? 4 : 2;
    for (int64_t r = 0; r < rows; r++)
        assert_int_equal(llmem_quant_dequantize_mlx_row(
                             type, (const char *)data_of(m, t) + r * cols * bits / 8,
                             (const char *)data_of(m, s) + (size_t)(r * (cols / group)) * ssize,
                             (const char *)data_of(m, b) + (size_t)(r * (cols / group)) * ssize,
                             v + r * cols, cols),
                         LLMEM_OK);
    /* the stored scale's rounding to its dtype (the codes were chosen with the f32 scale), times
     * the largest code */
    const float rel = st == LLMEM_QTYPE_BF16 ? 0x1p-8f : st == LLMEM_QTYPE_F16 ? 0x1p-11f : 0.0f;
    for (int64_t i = 0; i < rows * cols; i++) {
        float step = fabsf(sc[(i / cols) * (cols / group) + (i % cols) / group]);
        float tol = step * (1.01f + (float)((1 << bits) - 1) * rel) + 1e-2f * fabsf(ref[i]);
        if (!(fabsf(v[i] - ref[i]) <= tol + 1e-6f))
            fail_msg("%s[%lld]: %g dequantized, %g originally (step %g)", t->name, (long long)i,
                     (double)v[i], (double)ref[i], (double)step);
    }
    free(sc);
    free(ref);
    *n = rows * cols;
    return v;
}

/* Writes dir/model.safetensors: the fixture's model as f32, shaped as the original. Returns the
 * number of quantized matrices. */
static int write_dequantized(const char *fixture, const char *source, const char *dir) {
    struct model_file m, orig;
    model_open(fixture, &m);
    model_open(source, &orig);
    float **values = calloc((size_t)m.st->n_tensors, sizeof(*values));
    int64_t *counts = calloc((size_t)m.st->n_tensors, sizeof(*counts));
    assert_true(values != NULL && counts != NULL);
    struct tu_st_writer w = {0};
    int n_quantized = 0;
    for (int i = 0; i < m.st->n_tensors; i++) {
        const struct llmem_st_tensor *t = &m.st->tensors[i];
        size_t len = strlen(t->name);
        if (len > 7 && (strcmp(t->name + len - 7, ".scales") == 0 ||
                        strcmp(t->name + len - 7, ".biases") == 0))
            continue;
        int q, n_dims;
        int64_t shape[3];
        values[i] = tensor_f32(&m, &orig, t, &counts[i], &q, &n_dims, shape);
        n_quantized += q;
        tu_st_add_shape(&w, t->name, n_dims, shape);
    }
    char path[1024];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    tu_st_open(&w, path);
    for (int i = 0; i < m.st->n_tensors; i++) {
        if (values[i] == NULL)
            continue;
        tu_st_write(&w, values[i], counts[i]);
        free(values[i]);
    }
    tu_st_close(&w);
    free(values);
    free(counts);
    model_close(&m);
    model_close(&orig);
    return n_quantized;
}

/* ---- the tests --------------------------------------------------------------------------------
 */

/* `llmem logits` of each MLX directory equals, bit for bit, that of the f32 model holding its
 * dequantized weights (the quantized matrices through the exact path: groups dequantized into the
 * f32 panel, then the f32 kernel; the embedding rows likewise). */
static void test_logits_equal_dequantized(void **state) {
    (void)state;
    for (size_t k = 0; k < sizeof(fixtures) / sizeof(fixtures[0]); k++) {
        char fixture[512], source[512], from[600];
        snprintf(fixture, sizeof(fixture), "%s/mlx/%s", DATA, fixtures[k].name);
        snprintf(source, sizeof(source), "%s/models/%s", DATA, fixtures[k].source);
        char *dir = tu_mkdtemp();
        int n_quantized = write_dequantized(fixture, source, dir);
        assert_true(n_quantized >= 10);
        snprintf(from, sizeof(from), "%s/config.json", source);
        tu_copy_into(from, dir);
        snprintf(from, sizeof(from), "%s/tokenizer.json", fixture);
        tu_copy_into(from, dir);

        char ids[1024];
        int at = 0;
        for (int i = 0; i < 40; i++)
            at += snprintf(ids + at, sizeof(ids) - (size_t)at, "%s%d", i ? "," : "",
                           (i * 977 + 13) % 700);
        char out_q[1024], out_f[1024];
        snprintf(out_q, sizeof(out_q), "%s/q.npy", dir);
        snprintf(out_f, sizeof(out_f), "%s/f.npy", dir);
        struct tu_run r = tu_llmem("logits", fixture, "--ids", ids, "--out", out_q, "--threads",
                                   "2", "--no-spill", NULL);
        if (r.exit_code != 0)
            fail_msg("%s: %s", fixtures[k].name, r.err);
        tu_run_free(&r);
        r = tu_llmem("logits", dir, "--ids", ids, "--out", out_f, "--threads", "2", "--no-spill",
                     NULL);
        assert_int_equal(r.exit_code, 0);
        tu_run_free(&r);
        float *a = NULL, *b = NULL;
        int64_t ra, ca, rb, cb;
        assert_int_equal(llmem_npy_read_f32(out_q, &a, &ra, &ca), LLMEM_OK);
        assert_int_equal(llmem_npy_read_f32(out_f, &b, &rb, &cb), LLMEM_OK);
        assert_int_equal(ra, 40);
        assert_true(rb == ra && cb == ca);
        assert_memory_equal(a, b, (size_t)(ra * ca) * sizeof(float));
        free(a);
        free(b);
        tu_rmtree(dir);
        free(dir);
    }
}

/* mlx-lm's stacked experts unquantized: tiny-qwen3-moe written with each layer's experts in
 * …mlp.switch_mlp.{gate,up,down}_proj [experts, rows, cols] (f32) gives the logits of its one
 * tensor per expert (bf16), bit for bit. */
static void test_switch_mlp_stacked(void **state) {
    (void)state;
    const char *source = DATA "/models/tiny-qwen3-moe";
    struct model_file orig;
    model_open(source, &orig);
    char *dir = tu_mkdtemp();
    struct tu_st_writer w = {0};
    const struct llmem_st_tensor *order[512];
    int n = 0;
    for (int i = 0; i < orig.st->n_tensors; i++) {
        const char *name = orig.st->tensors[i].name;
        const char *at = strstr(name, ".experts.");
        char stacked[256];
        if (at != NULL) { /* expert 0 stands for the stack */
            if (strncmp(at, ".experts.0.", strlen(".experts.0.")) != 0)
                continue;
            snprintf(stacked, sizeof(stacked), "%.*s.switch_mlp.%s", (int)(at - name), name,
                     at + strlen(".experts.0."));
            int n_dims;
            int64_t shape[3];
            free(original_of(&orig, stacked, &n_dims, shape));
            tu_st_add_shape(&w, stacked, n_dims, shape);
        } else {
            tu_st_add_shape(&w, name, orig.st->tensors[i].n_dims, orig.st->tensors[i].shape);
        }
        assert_true(n < 512);
        order[n++] = &orig.st->tensors[i];
    }
    char path[1024];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    tu_st_open(&w, path);
    for (int i = 0; i < n; i++) {
        const char *name = order[i]->name, *at = strstr(name, ".experts.");
        float *v;
        int64_t count = order[i]->n_elements;
        if (at != NULL) {
            char stacked[256];
            snprintf(stacked, sizeof(stacked), "%.*s.switch_mlp.%s", (int)(at - name), name,
                     at + strlen(".experts.0."));
            int n_dims;
            int64_t shape[3];
            v = original_of(&orig, stacked, &n_dims, shape);
            count = shape[0] * shape[1] * shape[2];
        } else {
            v = floats_of(&orig, order[i]);
        }
        tu_st_write(&w, v, count);
        free(v);
    }
    tu_st_close(&w);
    model_close(&orig);
    char from[600];
    snprintf(from, sizeof(from), "%s/config.json", source);
    tu_copy_into(from, dir);
    snprintf(from, sizeof(from), "%s/tokenizer.json", source);
    tu_copy_into(from, dir);
    char out_a[1024], out_b[1024];
    snprintf(out_a, sizeof(out_a), "%s/a.npy", dir);
    snprintf(out_b, sizeof(out_b), "%s/b.npy", dir);
    const char *ids = "5,77,300,12,899,4,4,61,250,3";
    /* (f32: the copy's f32 weights would not round the activations as bf16 ones do at fast) */
    struct tu_run r = tu_llmem("logits", source, "--ids", ids, "--out", out_a, "--no-spill",
                               "--precision", "f32", NULL);
    assert_int_equal(r.exit_code, 0);
    tu_run_free(&r);
    r = tu_llmem("logits", dir, "--ids", ids, "--out", out_b, "--no-spill", "--precision", "f32",
                 NULL);
    if (r.exit_code != 0)
        fail_msg("%s", r.err);
    tu_run_free(&r);
    float *a = NULL, *b = NULL;
    int64_t ra, ca, rb, cb;
    assert_int_equal(llmem_npy_read_f32(out_a, &a, &ra, &ca), LLMEM_OK);
    assert_int_equal(llmem_npy_read_f32(out_b, &b, &rb, &cb), LLMEM_OK);
    assert_true(ra == 10 && rb == ra && cb == ca);
    assert_memory_equal(a, b, (size_t)(ra * ca) * sizeof(float));
    free(a);
    free(b);
    tu_rmtree(dir);
    free(dir);
}

/* `llmem run` generates from an MLX directory, and `llmem plan` plans the files' bytes and counts
 * the original model's 556,672 parameters. */
static void test_run_and_plan(void **state) {
    (void)state;
    const char *dir = DATA "/mlx/tiny-mistral-swa-4bit";
    struct tu_run r = tu_llmem("run", dir, "-p", "hello world", "-n", "12", "--ignore-eos",
                               "--threads", "2", "--no-spill", "--json", NULL);
    if (r.exit_code != 0)
        fail_msg("%s", r.err);
    assert_non_null(strstr(r.out, "\"finish_reason\":"));
    tu_run_free(&r);
    r = tu_llmem("plan", "--total", "48G", dir, "--json", NULL);
    assert_int_equal(r.exit_code, 0);
    struct llmem_safetensors *st = NULL;
    assert_int_equal(llmem_safetensors_load_dir(dir, &st), LLMEM_OK);
    char want[64];
    snprintf(want, sizeof(want), "%lld", (long long)st->n_bytes);
    assert_non_null(strstr(r.out, want));
    /* the parameters are the original model's (the codes' values; not the scales and biases) */
    assert_non_null(strstr(r.out, "556672"));
    llmem_safetensors_free(st);
    tu_run_free(&r);
}

/* A copy of the 4-bit fixture with one edit (a string of its config.json or of its safetensors
 * header replaced by one of the same length) is refused with one line holding `phrase`. */
static void expect_refused(const char *file, const char *from, const char *to, const char *phrase) {
    const char *src = DATA "/mlx/tiny-mistral-swa-4bit";
    char *dir = tu_mkdtemp();
    const char *names[] = {"config.json", "model.safetensors", "tokenizer.json"};
    for (size_t i = 0; i < 3; i++) {
        char path[600];
        snprintf(path, sizeof(path), "%s/%s", src, names[i]);
        FILE *f = fopen(path, "rb");
        assert_non_null(f);
        fseek(f, 0, SEEK_END);
        long len = ftell(f);
        fseek(f, 0, SEEK_SET);
        char *buf = malloc((size_t)len + 1);
        assert_non_null(buf);
        assert_int_equal(fread(buf, 1, (size_t)len, f), (size_t)len);
        buf[len] = '\0';
        fclose(f);
        if (strcmp(names[i], file) == 0) {
            assert_int_equal(strlen(from), strlen(to));
            char *at = NULL;
            for (long j = 0; j + (long)strlen(from) <= len && at == NULL; j++)
                if (memcmp(buf + j, from, strlen(from)) == 0)
                    at = buf + j;
            assert_non_null(at);
            memcpy(at, to, strlen(to));
        }
        free(tu_write_file(dir, names[i], buf, len));
        free(buf);
    }
    struct tu_run r = tu_llmem("run", dir, "-p", "x", "-n", "2", "--no-spill", NULL);
    assert_int_not_equal(r.exit_code, 0);
    if (strstr(r.err, phrase) == NULL)
        fail_msg("wanted '%s' in: %s", phrase, r.err);
    tu_run_free(&r);
    tu_rmtree(dir);
    free(dir);
}

static void test_refusals(void **state) {
    (void)state;
    expect_refused("config.json", "\"bits\": 4", "\"bits\": 3",
                   "'quantization.bits' is 3; llmem reads MLX's 4- and 8-bit weights");
    expect_refused("config.json", "\"group_size\": 64", "\"group_size\": 48",
                   "'quantization.group_size' is 48; MLX's groups are 32, 64 or 128");
    expect_refused("config.json", "\"mode\": \"affine\"", "\"mode\": \"mxfp4\" ",
                   "'quantization.mode' is mxfp4");
    expect_refused("model.safetensors", "model.layers.0.self_attn.q_proj.scales",
                   "model.layers.0.self_attn.q_proj.scalez",
                   "tensor 'model.layers.0.self_attn.q_proj.scales' is missing");
    expect_refused("model.safetensors", "model.layers.1.mlp.up_proj.biases",
                   "model.layers.1.mlp.up_proj.biasez",
                   "tensor 'model.layers.1.mlp.up_proj.biases' is missing");
    expect_refused("model.safetensors", "\"shape\":[128,2]", "\"shape\":[64,4] ",
                   "has shape [64, 4]; the config says [128, 2] (4-bit, groups of 64, of a [128, "
                   "128] matrix)");
    expect_refused("model.safetensors", "\"shape\":[128,16]", "\"shape\":[64,32] ",
                   "has shape [64, 32]; the config says [128, 16]");
    expect_refused("config.json", "\"bits\": 4", "\"bits\": 8",
                   "tensor 'model.embed_tokens.weight' has shape [700, 16]; the config says [700, "
                   "32] (8-bit, groups of 64, of a [700, 128] matrix)");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_logits_equal_dequantized),
        cmocka_unit_test(test_switch_mlp_stacked),
        cmocka_unit_test(test_run_and_plan),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
