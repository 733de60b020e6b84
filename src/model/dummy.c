/*
 * model/dummy.c — a model's weights made in memory from config.json alone
 * (LLMEM_MODEL_LOAD_DUMMY, as vLLM's --load-format dummy): for benchmarks of shapes whose files
 * nobody has, or that a disk cannot hold.
 *
 * The tensors are those of a bf16 checkpoint of the configuration, with the Hugging Face names
 * model.c binds (a mixture's experts stacked as transformers holds them), laid out one after the
 * other in one anonymous mapping that stands for the file: every matrix seeded random (splitmix64
 * from the tensor's index: the same values on every load), every norm weight 1 and bias 0. The
 * table's parameters and bytes are exactly llmem_geometry_param_count's and twice that.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/log.h"
#include "core/rng.h"
#include "llmem/plan.h"
#include "model/model_int.h"

#define DUMMY_FUNC "llmem_model_load"

/* Appends a bf16 tensor of the given shape after the last one. */
static int add(struct llmem_safetensors *st, const char *name, int n_dims, int64_t d0, int64_t d1,
               int64_t d2) {
    struct llmem_st_tensor *t = realloc(st->tensors, (size_t)(st->n_tensors + 1) * sizeof(*t));
    if (t == NULL)
        return LLMEM_ENOMEM;
    st->tensors = t;
    t = &st->tensors[st->n_tensors];
    memset(t, 0, sizeof(*t));
    t->name = strdup(name);
    if (t->name == NULL)
        return LLMEM_ENOMEM;
    const int64_t dims[3] = {d0, d1, d2};
    t->dtype = LLMEM_DTYPE_BF16;
    t->n_dims = n_dims;
    t->n_elements = 1;
    for (int i = 0; i < n_dims; i++) {
        t->shape[i] = dims[i];
        t->n_elements *= dims[i];
    }
    t->n_bytes = 2 * t->n_elements;
    t->offset_begin = st->n_tensors > 0 ? st->tensors[st->n_tensors - 1].offset_end : 0;
    t->offset_end = t->offset_begin + t->n_bytes;
    st->n_tensors++;
    return LLMEM_OK;
}

/* The tensors of cfg's model, in the order of a layer's parts. */
static int list_tensors(const struct llmem_model_config *cfg, struct llmem_safetensors *st) {
    const struct llmem_model_geometry *g = &cfg->geom;
    const int64_t h = g->hidden_size, hd = g->head_dim, q = g->n_heads * hd;
    const int64_t kv = g->n_kv_heads * hd, ff = g->intermediate_size;
    int s = add(st, "model.embed_tokens.weight", 2, g->vocab_size, h, 0);
    if (s == LLMEM_OK && !g->tied_embeddings)
        s = add(st, "lm_head.weight", 2, g->vocab_size, h, 0);
    if (s == LLMEM_OK)
        s = add(st, "model.norm.weight", 1, h, 0, 0);
    for (int64_t l = 0; s == LLMEM_OK && l < g->n_layers; l++) {
        char name[160];
#define ADD(suffix, ...)                                                                           \
    (snprintf(name, sizeof(name), "model.layers.%" PRId64 ".%s", l, suffix),                       \
     add(st, name, __VA_ARGS__))
        s = ADD("input_layernorm.weight", 1, h, 0, 0);
        s = s ? s : ADD("post_attention_layernorm.weight", 1, h, 0, 0);
        s = s ? s : ADD("self_attn.q_proj.weight", 2, q, h, 0);
        s = s ? s : ADD("self_attn.k_proj.weight", 2, kv, h, 0);
        s = s ? s : ADD("self_attn.v_proj.weight", 2, kv, h, 0);
        s = s ? s : ADD("self_attn.o_proj.weight", 2, h, q, 0);
        if (g->attention_bias) {
            s = s ? s : ADD("self_attn.q_proj.bias", 1, q, 0, 0);
            s = s ? s : ADD("self_attn.k_proj.bias", 1, kv, 0, 0);
            s = s ? s : ADD("self_attn.v_proj.bias", 1, kv, 0, 0);
        }
        if (g->qk_norm) {
            s = s ? s : ADD("self_attn.q_norm.weight", 1, hd, 0, 0);
            s = s ? s : ADD("self_attn.k_norm.weight", 1, hd, 0, 0);
        }
        if (cfg->layer_moe != NULL && cfg->layer_moe[l]) {
            const int64_t E = g->n_experts, fe = g->expert_intermediate;
            s = s ? s : ADD("mlp.gate.weight", 2, E, h, 0);
            s = s ? s : ADD("mlp.experts.gate_up_proj", 3, E, 2 * fe, h);
            s = s ? s : ADD("mlp.experts.down_proj", 3, E, h, fe);
        } else {
            s = s ? s : ADD("mlp.gate_proj.weight", 2, ff, h, 0);
            s = s ? s : ADD("mlp.up_proj.weight", 2, ff, h, 0);
            s = s ? s : ADD("mlp.down_proj.weight", 2, h, ff, 0);
        }
#undef ADD
    }
    if (s != LLMEM_OK)
        LLMEM_ERROR_AS(DUMMY_FUNC, "out of memory");
    return s;
}

int llmem_model_dummy_check(const struct llmem_model_geometry *g) {
    const int64_t n = llmem_geometry_param_count(g);
    if (n > LLMEM_MODEL_DUMMY_MAX_PARAMS) {
        LLMEM_ERROR_AS(DUMMY_FUNC,
                       "%s: the configuration's model has %s%.3g parameters; random weights "
                       "are made for at most 2^44 (1.76e+13)",
                       g->source, n == INT64_MAX ? "more than " : "", (double)n);
        return LLMEM_ERANGE;
    }
    return LLMEM_OK;
}

int llmem_model_dummy_table(const struct llmem_model_config *cfg, struct llmem_safetensors **out) {
    int status = llmem_model_dummy_check(&cfg->geom);
    if (status != LLMEM_OK)
        return status;
    struct llmem_safetensors *st = llmem_st_table_new(DUMMY_FUNC);
    if (st == NULL)
        return LLMEM_ENOMEM;
    st->files = calloc(1, sizeof(*st->files));
    if (st->files == NULL || (st->files[0].path = strdup(cfg->geom.source)) == NULL) {
        llmem_safetensors_free(st);
        LLMEM_ERROR_AS(DUMMY_FUNC, "out of memory");
        return LLMEM_ENOMEM;
    }
    st->n_files = 1;
    status = list_tensors(cfg, st);
    if (status == LLMEM_OK) {
        st->files[0].file_bytes = st->tensors[st->n_tensors - 1].offset_end;
        status = llmem_st_table_finish(st, DUMMY_FUNC);
    }
    if (status != LLMEM_OK) {
        llmem_safetensors_free(st);
        return status;
    }
    *out = st;
    return LLMEM_OK;
}

/* A vector's value: norm weights 1, biases 0 (bf16 bits). */
static uint16_t vector_value(const char *name) {
    return strstr(name, "norm") != NULL ? 0x3F80 : 0;
}

void llmem_model_dummy_values(const struct llmem_st_tensor *t, int index, int64_t first,
                              int64_t count, uint16_t *out) {
    if (t->n_dims == 1) {
        const uint16_t x = vector_value(t->name);
        for (int64_t j = 0; j < count; j++)
            out[j] = x;
        return;
    }
    /* ±[2^-6, 2^-4): a sign, exponent 121 or 122, 7 random mantissa bits; four a draw, draw d
     * the generator's output from the tensor's seed advanced d times */
    const uint64_t gamma = 0x9E3779B97F4A7C15ull;
    uint64_t state = gamma * (uint64_t)(index + 1) + gamma * (uint64_t)(first / 4);
    int64_t k = first % 4, j = 0;
    while (j < count) {
        uint64_t r = llmem_splitmix64_next(&state) >> (16 * k);
        for (; k < 4 && j < count; k++, j++, r >>= 16)
            out[j] = (uint16_t)((r & 0x8000) | (0x79 + ((r >> 7) & 1)) << 7 | (r & 0x7F));
        k = 0;
    }
}

struct matrix_job {
    const struct llmem_st_tensor *t;
    int index;
    int64_t first, stride, width; /* row r's values: first + r · stride, width of them */
    int64_t row0, row1;           /* the rows this job makes */
    uint16_t *out;
};

static void *matrix_rows(void *p) {
    const struct matrix_job *j = p;
    for (int64_t r = j->row0; r < j->row1; r++)
        llmem_model_dummy_values(j->t, j->index, j->first + r * j->stride, j->width,
                                 j->out + r * j->width);
    return NULL;
}

void llmem_model_dummy_matrix(const struct llmem_model *m, const struct llmem_weight *w,
                              int64_t row, int64_t rows, int64_t col, int64_t cols, uint16_t *out) {
    const struct llmem_safetensors *st = m->st;
    const int64_t at = (int64_t)((const char *)w->data - (const char *)m->maps[0]);
    int i = 0; /* the tensor w lies in (the table is sorted by name, not by offset) */
    while (i < st->n_tensors &&
           !(at >= st->tensors[i].offset_begin && at < st->tensors[i].offset_end))
        i++;
    LLMEM_ASSERT(i < st->n_tensors && w->dtype == LLMEM_DTYPE_BF16);
    /* the rows dealt out to the cores, as llmem_model_dummy_fill deals out tensors (a matrix of
     * a 70B model takes a core seconds) */
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int n = cores < 1 ? 1 : cores > 16 ? 16 : (int)cores;
    if (rows * cols < ((int64_t)1 << 20))
        n = 1;
    struct matrix_job jobs[16];
    pthread_t threads[16];
    int started = 1;
    for (int k = 0; k < n; k++)
        jobs[k] = (struct matrix_job){&st->tensors[i],
                                      i,
                                      (at - st->tensors[i].offset_begin) / 2 + row * w->cols + col,
                                      w->cols,
                                      cols,
                                      rows * k / n,
                                      rows * (k + 1) / n,
                                      out};
    for (int k = 1; k < n; k++) {
        if (pthread_create(&threads[k], NULL, matrix_rows, &jobs[k]) != 0)
            break; /* the rest made below */
        started++;
    }
    for (int k = started; k < n; k++)
        matrix_rows(&jobs[k]);
    matrix_rows(&jobs[0]);
    for (int k = 1; k < started; k++)
        pthread_join(threads[k], NULL);
}

struct fill_job {
    const struct llmem_safetensors *st;
    void *data;
    int vectors_only;
    int n_threads, thread;
    _Atomic int64_t *done;
    llmem_progress_fn progress; /* called by thread 0 only */
    void *arg;
};

static void *fill_thread(void *p) {
    const struct fill_job *j = p;
    for (int i = j->thread; i < j->st->n_tensors; i += j->n_threads) {
        const struct llmem_st_tensor *t = &j->st->tensors[i];
        if (j->vectors_only && t->n_dims > 1)
            continue;
        llmem_model_dummy_values(t, i, 0, t->n_elements,
                                 (uint16_t *)((char *)j->data + t->offset_begin));
        const int64_t bytes = j->st->tensors[i].n_bytes;
        const int64_t done = atomic_fetch_add(j->done, bytes) + bytes;
        if (j->thread == 0 && j->progress != NULL)
            j->progress(j->arg, done, j->st->n_bytes);
    }
    return NULL;
}

void llmem_model_dummy_fill(const struct llmem_safetensors *st, void *data, int vectors_only,
                            llmem_progress_fn progress, void *arg) {
    /* the tensors dealt out to the cores (page faults and the draws both scale) */
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int n = cores < 1 ? 1 : cores > 16 ? 16 : (int)cores;
    _Atomic int64_t done = 0;
    struct fill_job jobs[16];
    pthread_t threads[16];
    int started = 1;
    for (int t = 0; t < n; t++)
        jobs[t] = (struct fill_job){st, data, vectors_only, n, t, &done, progress, arg};
    for (int t = 1; t < n; t++) {
        if (pthread_create(&threads[t], NULL, fill_thread, &jobs[t]) != 0)
            break; /* the rest filled below */
        started++;
    }
    for (int t = started; t < n; t++) /* threads that could not start: their share here */
        fill_thread(&jobs[t]);
    fill_thread(&jobs[0]);
    for (int t = 1; t < started; t++)
        pthread_join(threads[t], NULL);
    if (progress != NULL)
        progress(arg, st->n_bytes, st->n_bytes);
}
