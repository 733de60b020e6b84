/*
 * model/model_gguf.c — a GGUF file loaded for inference: its configuration from the metadata
 * (gguf_config.c), the file mapped read-only (or read into memory with LLMEM_MODEL_LOAD_NO_MMAP)
 * and its tensors bound to the layers in place, quantized ones as their ggml blocks.
 *
 * GGUF names and lays out the tensors of these architectures as llama.cpp's converter writes
 * them: dims innermost first (a matrix [rows, cols] is ne = {cols, rows}), and for llama the q
 * and k rows permuted for RoPE on interleaved pairs, which the forward pass runs as such
 * (rope_interleaved) rather than permuting them back. Llama 3's rope scaling comes as
 * rope_freqs.weight, a divisor of each pair's inverse frequency, as ggml applies it.
 *
 *   safetensors (model.c)                     GGUF
 *   model.embed_tokens.weight                 token_embd.weight
 *   lm_head.weight                            output.weight (absent: tied)
 *   model.norm.weight                         output_norm.weight
 *   model.layers.N.input_layernorm            blk.N.attn_norm
 *   …self_attn.{q,k,v,o}_proj                 blk.N.attn_{q,k,v,output}
 *   …self_attn.{q,k,v}_proj.bias              blk.N.attn_{q,k,v}.bias
 *   …self_attn.{q,k}_norm                     blk.N.attn_{q,k}_norm
 *   …post_attention_layernorm                 blk.N.ffn_norm
 *   …mlp.{gate,up,down}_proj                  blk.N.ffn_{gate,up,down}
 *   …mlp.gate (a mixture's router)            blk.N.ffn_gate_inp
 *   …mlp.experts.E.{gate,up,down}_proj        blk.N.ffn_{gate,up,down}_exps, expert E the
 *                                             E-th slice of the stacked tensor
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/file.h"
#include "core/log.h"
#include "model/gguf.h"
#include "model/model_int.h"
#include "quant/quant.h"

#define LOAD_FUNC       "llmem_model_load"
#define LOAD_ERROR(...) LLMEM_ERROR_AS(LOAD_FUNC, __VA_ARGS__)

static const struct llmem_gguf_tensor *find(const struct llmem_model *m, const char *name,
                                            int required) {
    const struct llmem_gguf_tensor *t = llmem_gguf_find_tensor(m->gguf, name);
    if (t == NULL && required)
        LOAD_ERROR("%s: tensor '%s' is missing", m->gguf->path, name);
    return t;
}

/* t's shape is [d0] (n_dims 1) or the matrix [d0 rows, d1 cols] (ne = {d1, d0}), and its type
 * one llmem reads. */
static int check(const struct llmem_model *m, const struct llmem_gguf_tensor *t, int n_dims,
                 int64_t d0, int64_t d1) {
    int ok = n_dims == 1 ? t->n_dims == 1 && t->dims[0] == d0
                         : t->n_dims == 2 && t->dims[0] == d1 && t->dims[1] == d0;
    if (!ok) {
        LOAD_ERROR("%s: tensor '%s' has ne {%" PRId64 ", %" PRId64 "}; the metadata says {%" PRId64
                   ", %" PRId64 "}",
                   m->gguf->path, t->name, t->dims[0], t->n_dims > 1 ? t->dims[1] : 1,
                   n_dims == 1 ? d0 : d1, n_dims == 1 ? (int64_t)1 : d0);
        return LLMEM_EFORMAT;
    }
    const struct llmem_qtype_info *info = llmem_qtype_info(t->type);
    if (info == NULL || !info->readable) {
        LOAD_ERROR("%s: tensor '%s' is of type %s, which llmem does not run (it runs f32, f16, "
                   "bf16, q8_0, q4_0, q4_1, q5_0, q5_1 and q2_K to q6_K)",
                   m->gguf->path, t->name, llmem_qtype_name(t->type));
        return LLMEM_EUNSUPPORTED;
    }
    return LLMEM_OK;
}

static int bind_matrix(struct llmem_model *m, const char *name, int64_t rows, int64_t cols,
                       struct llmem_weight *w) {
    const struct llmem_gguf_tensor *t = find(m, name, 1);
    if (t == NULL)
        return LLMEM_ENOENT;
    int status = check(m, t, 2, rows, cols);
    if (status != LLMEM_OK)
        return status;
    *w = (struct llmem_weight){
        .data = t->data, .dtype = LLMEM_DTYPE_F32, .rows = rows, .cols = cols};
    switch (t->type) {
    case LLMEM_QTYPE_F32: break;
    case LLMEM_QTYPE_F16: w->dtype = LLMEM_DTYPE_F16; break;
    case LLMEM_QTYPE_BF16: w->dtype = LLMEM_DTYPE_BF16; break;
    default: w->quant = t->type;
    }
    return LLMEM_OK;
}

/* An f32 copy of a vector of n values (dequantized exactly whatever its type). */
static int bind_vector(struct llmem_model *m, const char *name, int64_t n, int required,
                       float **out) {
    *out = NULL;
    const struct llmem_gguf_tensor *t = find(m, name, required);
    if (t == NULL)
        return required ? LLMEM_ENOENT : LLMEM_OK;
    int status = check(m, t, 1, n, 0);
    if (status != LLMEM_OK)
        return status;
    float *v = llmem_mem_alloc(m->mem, (size_t)n * sizeof(float), LLMEM_TAG_WEIGHTS);
    if (v == NULL)
        return LLMEM_ENOMEM;
    llmem_quant_dequantize_row(t->type, t->data, v, n);
    m->vector_bytes += n * (int64_t)sizeof(float);
    *out = v;
    return LLMEM_OK;
}

/* Layer i's router (blk.i.ffn_gate_inp, [n_experts, hidden]) and experts, each a slice of the
 * stacked blk.i.ffn_{gate,up}_exps (ne {hidden, width, n_experts}) and ffn_down_exps
 * (ne {width, hidden, n_experts}). */
static int bind_moe(struct llmem_model *m, int64_t i, struct model_layer *L) {
    const struct llmem_model_geometry *g = &m->cfg.geom;
    const int64_t E = g->n_experts, fe = g->expert_intermediate, h = g->hidden_size;
    char name[96];
    snprintf(name, sizeof(name), "blk.%" PRId64 ".ffn_gate_inp.weight", i);
    int status = bind_matrix(m, name, E, h, &L->router);
    if (status != LLMEM_OK || (status = llmem_model_layer_experts(m, L)) != LLMEM_OK)
        return status;
    static const char *const parts[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
    for (int p = 0; p < 3; p++) {
        const int64_t rows = p < 2 ? fe : h, cols = p < 2 ? h : fe;
        snprintf(name, sizeof(name), "blk.%" PRId64 ".%s.weight", i, parts[p]);
        const struct llmem_gguf_tensor *t = find(m, name, 1);
        if (t == NULL)
            return LLMEM_ENOENT;
        if (t->n_dims != 3 || t->dims[0] != cols || t->dims[1] != rows || t->dims[2] != E) {
            LOAD_ERROR("%s: tensor '%s' is not ne {%" PRId64 ", %" PRId64 ", %" PRId64
                       "} as the metadata says (row length, rows, experts)",
                       m->gguf->path, name, cols, rows, E);
            return LLMEM_EFORMAT;
        }
        const struct llmem_qtype_info *info = llmem_qtype_info(t->type);
        if (info == NULL || !info->readable) {
            LOAD_ERROR("%s: tensor '%s' is of type %s, which llmem does not run", m->gguf->path,
                       name, llmem_qtype_name(t->type));
            return LLMEM_EUNSUPPORTED;
        }
        struct llmem_weight w = {.dtype = LLMEM_DTYPE_F32, .rows = rows, .cols = cols};
        switch (t->type) {
        case LLMEM_QTYPE_F32: break;
        case LLMEM_QTYPE_F16: w.dtype = LLMEM_DTYPE_F16; break;
        case LLMEM_QTYPE_BF16: w.dtype = LLMEM_DTYPE_BF16; break;
        default: w.quant = t->type;
        }
        const int64_t expert_bytes = rows * llmem_weight_row_bytes(&w);
        for (int64_t e = 0; e < E; e++) {
            L->experts[p * E + e] = w;
            L->experts[p * E + e].data = (const char *)t->data + e * expert_bytes;
        }
    }
    return LLMEM_OK;
}

static int bind_layer(struct llmem_model *m, int64_t i) {
    const struct llmem_model_geometry *g = &m->cfg.geom;
    struct model_layer *L = &m->layers[i];
    const int64_t q_dim = g->n_heads * g->head_dim, kv_dim = g->n_kv_heads * g->head_dim;
    char name[96];
    int status;
#define NAME(suffix) (snprintf(name, sizeof(name), "blk.%" PRId64 ".%s", i, suffix), name)
    if ((status = bind_matrix(m, NAME("attn_q.weight"), q_dim, g->hidden_size, &L->wq)) ||
        (status = bind_matrix(m, NAME("attn_k.weight"), kv_dim, g->hidden_size, &L->wk)) ||
        (status = bind_matrix(m, NAME("attn_v.weight"), kv_dim, g->hidden_size, &L->wv)) ||
        (status = bind_matrix(m, NAME("attn_output.weight"), g->hidden_size, q_dim, &L->wo)) ||
        (status = bind_vector(m, NAME("attn_norm.weight"), g->hidden_size, 1, &L->attn_norm)) ||
        (status = bind_vector(m, NAME("ffn_norm.weight"), g->hidden_size, 1, &L->mlp_norm)))
        return status;
    if (g->attention_bias && ((status = bind_vector(m, NAME("attn_q.bias"), q_dim, 1, &L->bq)) ||
                              (status = bind_vector(m, NAME("attn_k.bias"), kv_dim, 1, &L->bk)) ||
                              (status = bind_vector(m, NAME("attn_v.bias"), kv_dim, 1, &L->bv))))
        return status;
    if (g->qk_norm &&
        ((status = bind_vector(m, NAME("attn_q_norm.weight"), g->head_dim, 1, &L->q_norm)) ||
         (status = bind_vector(m, NAME("attn_k_norm.weight"), g->head_dim, 1, &L->k_norm))))
        return status;
    if (m->cfg.layer_moe != NULL && m->cfg.layer_moe[i])
        return bind_moe(m, i, L);
    if ((status = bind_matrix(m, NAME("ffn_gate.weight"), g->intermediate_size, g->hidden_size,
                              &L->w_gate)) ||
        (status = bind_matrix(m, NAME("ffn_up.weight"), g->intermediate_size, g->hidden_size,
                              &L->w_up)))
        return status;
    status = bind_matrix(m, NAME("ffn_down.weight"), g->hidden_size, g->intermediate_size,
                         &L->w_down);
#undef NAME
    return status;
}

/* The whole file in anonymous memory (LLMEM_MODEL_LOAD_NO_MMAP), then parsed in place. */
static int read_whole(struct llmem_model *m, const char *path) {
    int fd;
    int status = llmem_file_open_regular(path, LOAD_FUNC, &fd);
    if (status != LLMEM_OK)
        return status;
    off_t size = lseek(fd, 0, SEEK_END);
    size_t mapped = 0;
    void *p = size > 0 ? llmem_model_read_into_memory(fd, (size_t)size, path, &mapped) : MAP_FAILED;
    close(fd);
    if (p == MAP_FAILED) {
        if (size <= 0)
            LOAD_ERROR("%s: the file is empty", path);
        return size <= 0 ? LLMEM_EFORMAT : LLMEM_EIO;
    }
    m->gguf_copy = p;
    m->gguf_copy_bytes = mapped;
    return llmem_gguf_parse(p, (size_t)size, path, &m->gguf);
}

int llmem_model_load_gguf(struct llmem_model *m, const char *path, int flags,
                          llmem_progress_fn progress, void *progress_arg) {
    int status =
        (flags & LLMEM_MODEL_LOAD_NO_MMAP) ? read_whole(m, path) : llmem_gguf_open(path, &m->gguf);
    if (status != LLMEM_OK ||
        (status = llmem_gguf_config(m->gguf, &m->cfg, LOAD_FUNC)) != LLMEM_OK ||
        (status = llmem_model_check_supported(m)) != LLMEM_OK)
        return status;
    void *base = m->gguf_copy != NULL ? m->gguf_copy : (void *)m->gguf->base;
    size_t bytes = m->gguf_copy != NULL ? m->gguf_copy_bytes : m->gguf->size;
    if ((status = llmem_mem_track(m->mem, base, bytes, LLMEM_TAG_WEIGHTS)) != LLMEM_OK)
        return status;
    m->gguf_tracked = base;
    if (m->gguf_copy == NULL)
        llmem_model_fault_in(base, bytes, 0, (int64_t)bytes, progress, progress_arg);

    struct llmem_model_geometry *g = &m->cfg.geom;
    if ((status = bind_matrix(m, "token_embd.weight", g->vocab_size, g->hidden_size, &m->embed)))
        return status;
    if (g->tied_embeddings)
        m->lm_head = m->embed;
    else if ((status = bind_matrix(m, "output.weight", g->vocab_size, g->hidden_size,
                                   &m->lm_head)) != LLMEM_OK)
        return status;
    if ((status = bind_vector(m, "output_norm.weight", g->hidden_size, 1, &m->final_norm)))
        return status;
    m->layers = calloc((size_t)g->n_layers, sizeof(*m->layers));
    m->inv_freq =
        llmem_mem_alloc(m->mem, (size_t)g->head_dim / 2 * sizeof(float), LLMEM_TAG_WEIGHTS);
    if (m->layers == NULL || m->inv_freq == NULL) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    llmem_rope_inv_freq(&m->cfg, m->inv_freq);
    if (m->cfg.rope_freqs) { /* Llama 3: each pair's frequency divided by its factor, as ggml */
        float *factors = NULL;
        if ((status = bind_vector(m, "rope_freqs.weight", g->head_dim / 2, 1, &factors)))
            return status;
        for (int64_t i = 0; i < g->head_dim / 2; i++) {
            if (!(isfinite(factors[i]) && factors[i] > 0.0f)) {
                LOAD_ERROR("%s: rope_freqs.weight[%" PRId64
                           "] is %g: a factor must be positive and finite",
                           path, i, (double)factors[i]);
                llmem_mem_free(m->mem, factors);
                return LLMEM_EFORMAT;
            }
            m->inv_freq[i] /= factors[i];
        }
        llmem_mem_free(m->mem, factors);
        m->vector_bytes -= g->head_dim / 2 * (int64_t)sizeof(float);
    }
    for (int64_t i = 0; i < g->n_layers; i++)
        if ((status = bind_layer(m, i)) != LLMEM_OK)
            return status;
    for (int64_t i = 0; i < m->gguf->n_tensors; i++)
        if ((status = llmem_model_check_layer_of(path, m->gguf->tensors[i].name, "blk.",
                                                 g->n_layers)) != LLMEM_OK)
            return status;
    return LLMEM_OK;
}
