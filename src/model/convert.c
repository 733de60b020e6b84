/*
 * model/convert.c — a Hugging Face model directory (bf16/f16/f32 safetensors) into a GGUF file
 * that llama.cpp loads, quantized as llama-quantize quantizes: what convert_hf_to_gguf.py and
 * then llama-quantize would write, in one pass over the weights.
 *
 * Metadata: general.architecture (llama — Mistral's model_type too, and Mixtral's with experts —,
 * qwen2, qwen3, qwen3moe), general.name, general.file_type, general.quantization_version = 2, the
 * {arch}.* geometry keys (a mixture's expert_count, expert_used_count, expert_feed_forward_length
 * and expert_weights_norm among them), and the tokenizer as gguf-py's SpecialVocab and convert_hf_to_gguf's get_vocab_base write it:
 *  - byte-level BPE → model "gpt2": tokens by id, padded to config.json's vocab_size with
 *    "[PADi]" (UNUSED); CONTROL for special added tokens, USER_DEFINED for other added ones; merges
 *    "a b" (a space inside a part written as U+0120's successor, as gguf-py does); pre
 *    "llama-bpe" / "qwen2" / "gpt-2" recognized from the Split regex (or ByteLevel's own), any
 *    other regex refused by name;
 *  - BPE with byte_fallback (Mistral, Llama 2) → model "llama": BYTE for <0xNN>, CONTROL for the
 *    special ids, NORMAL else, SentencePiece's scores (−id for NORMAL, 0 otherwise);
 *  - bos/eos/unk/padding ids from tokenizer_config.json's *_token (looked up among the added
 *    tokens), else config.json's *_token_id; add_bos_token / add_eos_token from tokenizer_config,
 *    else from a TemplateProcessing post-processor, else false (written, so that llama.cpp's
 *    default of adding BOS for Llama 3 names does not differ from tokenizer.json);
 *    tokenizer.chat_template from tokenizer_config.json or chat_template.jinja.
 *
 * Tensors, in llama-quantize's order (the ones outside layers by name, then layer by layer, by
 * name): HF names → GGUF names (model_gguf.c's table; a MoE layer's router as ffn_gate_inp and its
 * experts stacked into ffn_{gate,up,down}_exps [E, rows, cols], add_experts); llama's q/k rows permuted per head from
 * halves to interleaved pairs (row s·half + j → 2j + s); Llama 3's rope scaling as the F32 tensor
 * rope_freqs.weight (convert_hf_to_gguf's factors: 1 above the high-frequency wavelength, factor
 * below the low one, 1 / ((1 − smooth) / factor + smooth) between, in float32 as torch computes
 * them). Types: llmem_gguf_tensor_type, llama_tensor_get_type's rules for these architectures;
 * each chunk of rows is converted to f32 exactly and quantized with quant/'s reference
 * quantizers, which are ggml's bit for bit. Memory: one chunk of rows (≤ 16 MiB of f32) at a time.
 */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/file.h"
#include "core/json.h"
#include "core/log.h"
#include "llmem/config.h"
#include "llmem/pool.h"
#include "llmem/safetensors.h"
#include "llmem/status.h"
#include "model/gguf.h"
#include "model/model_int.h"
#include "quant/quant.h"

#define FUNC        "llmem_gguf_convert"
#define ERR(...)    LLMEM_ERROR_AS(FUNC, __VA_ARGS__)
#define CHUNK_BYTES ((int64_t)16 << 20)

/* ---- file types and the per-tensor rules ---------------------------------------------------- */

static const struct {
    const char *name;
    int ftype;
    int base; /* the default ggml type */
} ftypes[] = {
    {"q8_0", LLMEM_GGUF_FTYPE_Q8_0, LLMEM_QTYPE_Q8_0},
    {"q4_0", LLMEM_GGUF_FTYPE_Q4_0, LLMEM_QTYPE_Q4_0},
    {"q4_k_m", LLMEM_GGUF_FTYPE_Q4_K_M, LLMEM_QTYPE_Q4_K},
    {"q5_k_m", LLMEM_GGUF_FTYPE_Q5_K_M, LLMEM_QTYPE_Q5_K},
    {"q6_k", LLMEM_GGUF_FTYPE_Q6_K, LLMEM_QTYPE_Q6_K},
    {"f16", LLMEM_GGUF_FTYPE_F16, LLMEM_QTYPE_F16},
    {"bf16", LLMEM_GGUF_FTYPE_BF16, LLMEM_QTYPE_BF16},
};
#define N_FTYPES (sizeof(ftypes) / sizeof(ftypes[0]))

int llmem_gguf_ftype_parse(const char *name) {
    for (size_t i = 0; i < N_FTYPES; i++)
        if (strcasecmp(name, ftypes[i].name) == 0)
            return ftypes[i].ftype;
    return -1;
}

const char *llmem_gguf_ftype_name(int ftype) {
    for (size_t i = 0; i < N_FTYPES; i++)
        if (ftypes[i].ftype == ftype)
            return ftypes[i].name;
    return "unknown";
}

static int ftype_base(int ftype) {
    for (size_t i = 0; i < N_FTYPES; i++)
        if (ftypes[i].ftype == ftype)
            return ftypes[i].base;
    return -1;
}

static int64_t block_of(int type) {
    return llmem_qtype_info(type)->block_elems;
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* llama-quant.cpp's use_more_bits: the first and last eighth of the layers and every third
 * between. */
static int use_more_bits(int64_t i, int64_t n) {
    return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

int llmem_gguf_tensor_type(int ftype, const char *name, int n_dims, int64_t ne0, int64_t n_layers,
                           int tied, int *fallback) {
    *fallback = 0;
    const int base = ftype_base(ftype);
    LLMEM_ASSERT(base >= 0);
    /* tensor_allows_quantization: 1-D tensors, norms and non-weights keep their type (F32 as the
     * converter writes them). */
    if (n_dims < 2 || !ends_with(name, "weight") || strstr(name, "_norm.weight") != NULL ||
        strstr(name, "ffn_gate_inp.weight") != NULL) /* (and a MoE router) */
        return LLMEM_QTYPE_F32;
    if (base == LLMEM_QTYPE_F16 || base == LLMEM_QTYPE_BF16)
        return base; /* not a quantized type: no rules (convert_hf_to_gguf --outtype) */
    int type = base;
    int layer = -1;
    sscanf(name, "blk.%d.", &layer);
    const int output = strcmp(name, "output.weight") == 0;
    const int embd = strcmp(name, "token_embd.weight") == 0;
    if (output || (tied && embd)) {
        if (ne0 % block_of(base) != 0)
            type = LLMEM_QTYPE_Q8_0;
        else if (base != LLMEM_QTYPE_Q8_0)
            type = LLMEM_QTYPE_Q6_K;
    } else if (embd) {
        /* the default type */
    } else if (strstr(name, "attn_v.weight") != NULL) {
        /* i_attention_wv counts attn_v tensors in llama-quantize's order: the layer index */
        if ((ftype == LLMEM_GGUF_FTYPE_Q4_K_M || ftype == LLMEM_GGUF_FTYPE_Q5_K_M) &&
            use_more_bits(layer, n_layers))
            type = LLMEM_QTYPE_Q6_K;
    } else if (strstr(name, "ffn_down") != NULL) {
        if ((ftype == LLMEM_GGUF_FTYPE_Q4_K_M || ftype == LLMEM_GGUF_FTYPE_Q5_K_M) &&
            use_more_bits(layer, n_layers))
            type = LLMEM_QTYPE_Q6_K;
    }
    /* tensor_type_fallback: a row length that is not a whole number of blocks */
    if (ne0 % block_of(type) != 0) {
        *fallback = 1;
        switch (type) {
        case LLMEM_QTYPE_Q4_K: type = LLMEM_QTYPE_Q5_0; break;
        case LLMEM_QTYPE_Q5_K: type = LLMEM_QTYPE_Q5_1; break;
        case LLMEM_QTYPE_Q6_K: type = LLMEM_QTYPE_Q8_0; break;
        default: /* Q8_0, Q4_0: llama-quantize has no fallback and stops */
            *fallback = 2;
            type = LLMEM_QTYPE_F16;
        }
        if (ne0 % block_of(type) != 0)
            type = LLMEM_QTYPE_F16;
    }
    return type;
}

int64_t llmem_gguf_weights_bytes(const struct llmem_model_geometry *g, int ftype) {
    const int64_t h = g->hidden_size, q = g->n_heads * g->head_dim;
    const int64_t kv = g->n_kv_heads * g->head_dim, ff = g->intermediate_size;
    const int64_t E = g->n_experts > 0 ? g->n_experts : 0, fe = g->expert_intermediate;
    /* the layers with experts, taken as the last ones (their place only moves ffn_down's type) */
    const int64_t first_moe = E > 0 ? g->n_layers - g->n_moe_layers : g->n_layers;
    /* GGUF's ne: {row length, rows, experts}; a second dimension of 0 marks a vector. `mlp`: 0 in
     * every layer, 1 in a dense layer, 2 in a layer with experts */
    struct {
        const char *name;
        int64_t ne0, ne1, ne2;
        int per_layer, present, mlp;
    } t[] = {
        {"token_embd.weight", h, g->vocab_size, 1, 0, 1, 0},
        {"output.weight", h, g->vocab_size, 1, 0, !g->tied_embeddings, 0},
        {"output_norm.weight", h, 0, 1, 0, 1, 0},
        {"attn_norm.weight", h, 0, 1, 1, 1, 0},
        {"attn_q.weight", h, q, 1, 1, 1, 0},
        {"attn_k.weight", h, kv, 1, 1, 1, 0},
        {"attn_v.weight", h, kv, 1, 1, 1, 0},
        {"attn_output.weight", q, h, 1, 1, 1, 0},
        {"attn_q.bias", q, 0, 1, 1, g->attention_bias, 0},
        {"attn_k.bias", kv, 0, 1, 1, g->attention_bias, 0},
        {"attn_v.bias", kv, 0, 1, 1, g->attention_bias, 0},
        {"attn_q_norm.weight", g->head_dim, 0, 1, 1, g->qk_norm, 0},
        {"attn_k_norm.weight", g->head_dim, 0, 1, 1, g->qk_norm, 0},
        {"ffn_norm.weight", h, 0, 1, 1, 1, 0},
        {"ffn_gate.weight", h, ff, 1, 1, 1, 1},
        {"ffn_up.weight", h, ff, 1, 1, 1, 1},
        {"ffn_down.weight", ff, h, 1, 1, 1, 1},
        {"ffn_gate_inp.weight", h, E, 1, 1, E > 0, 2},
        {"ffn_gate_exps.weight", h, fe, E, 1, E > 0, 2},
        {"ffn_up_exps.weight", h, fe, E, 1, E > 0, 2},
        {"ffn_down_exps.weight", fe, h, E, 1, E > 0, 2},
    };
    int64_t bytes = 0;
    for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) {
        if (!t[i].present)
            continue;
        for (int64_t l = 0; l < (t[i].per_layer ? g->n_layers : 1); l++) {
            if ((t[i].mlp == 1 && l >= first_moe) || (t[i].mlp == 2 && l < first_moe))
                continue;
            char name[96];
            if (t[i].per_layer)
                snprintf(name, sizeof(name), "blk.%lld.%s", (long long)l, t[i].name);
            else
                snprintf(name, sizeof(name), "%s", t[i].name);
            int fallback;
            int n_dims = t[i].ne1 > 0 ? (t[i].ne2 > 1 ? 3 : 2) : 1;
            int type = llmem_gguf_tensor_type(ftype, name, n_dims, t[i].ne0, g->n_layers,
                                              g->tied_embeddings, &fallback);
            bytes += llmem_qtype_bytes(type, t[i].ne0 * (n_dims >= 2 ? t[i].ne1 * t[i].ne2 : 1));
        }
    }
    return bytes;
}

/* ---- tensors -------------------------------------------------------------------------------- */

/* GGUF's names of these architectures' tensors and Hugging Face's: the model's, then a layer's
 * (below "blk.N." and "model.layers.N."), in the order list_tensors needs them: the nine every
 * layer has, the three q/k/v biases, the two q/k norms. */
static const char *const top_names[][2] = {{"token_embd.weight", "model.embed_tokens.weight"},
                                           {"output_norm.weight", "model.norm.weight"},
                                           {"output.weight", "lm_head.weight"}};
static const char *const layer_names[][2] = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"attn_q.weight", "self_attn.q_proj.weight"},
    {"attn_k.weight", "self_attn.k_proj.weight"},
    {"attn_v.weight", "self_attn.v_proj.weight"},
    {"attn_output.weight", "self_attn.o_proj.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"ffn_gate.weight", "mlp.gate_proj.weight"},
    {"ffn_up.weight", "mlp.up_proj.weight"},
    {"ffn_down.weight", "mlp.down_proj.weight"},
    {"attn_q.bias", "self_attn.q_proj.bias"},
    {"attn_k.bias", "self_attn.k_proj.bias"},
    {"attn_v.bias", "self_attn.v_proj.bias"},
    {"attn_q_norm.weight", "self_attn.q_norm.weight"},
    {"attn_k_norm.weight", "self_attn.k_norm.weight"},
};
#define N_LAYER_NAMES (sizeof(layer_names) / sizeof(layer_names[0]))

int llmem_gguf_hf_name(const char *gguf, char *out, size_t size) {
    for (size_t i = 0; i < sizeof(top_names) / sizeof(top_names[0]); i++)
        if (strcmp(gguf, top_names[i][0]) == 0)
            return snprintf(out, size, "%s", top_names[i][1]) > 0;
    int blk, at = 0;
    if (sscanf(gguf, "blk.%d.%n", &blk, &at) != 1 || at == 0)
        return 0;
    for (size_t i = 0; i < N_LAYER_NAMES; i++)
        if (strcmp(gguf + at, layer_names[i][0]) == 0)
            return snprintf(out, size, "model.layers.%d.%s", blk, layer_names[i][1]) > 0;
    return 0;
}

/* A run of `rows` rows of a source tensor from row `row` (a MoE stack is one run an expert). */
struct conv_piece {
    const struct llmem_st_tensor *src;
    int64_t row, rows;
};

struct conv_tensor {
    char gguf[96];
    const struct llmem_st_tensor *src; /* the first piece's; NULL: rope_freqs (computed) */
    struct conv_piece *pieces;         /* (n_pieces) the rows in file order */
    int n_pieces;
    int64_t rows, cols;                /* cols = ne0; 1-D: rows 1; a stack: each expert's rows */
    int64_t experts;                   /* ne2 of a stack of experts; else 1 */
    int n_dims;
    int64_t permute_heads; /* > 0: llama q/k rows permuted, head_dim rows a head */
    int type;
    int fallback;
};

static int layer_of(const char *name) {
    int l = -1;
    sscanf(name, "blk.%d.", &l);
    return l;
}

/* llama_model_loader's weight_name_comparer: by layer (none first), then by name. */
static int tensor_order(const void *a, const void *b) {
    const struct conv_tensor *x = a, *y = b;
    int lx = layer_of(x->gguf), ly = layer_of(y->gguf);
    if (lx != ly)
        return lx < ly ? -1 : 1;
    return strcmp(x->gguf, y->gguf);
}

struct conv {
    const char *dir;
    struct llmem_model_config cfg;
    const char *arch; /* GGUF's */
    int llama;        /* q/k permuted */
    struct llmem_safetensors *st;
    struct conv_tensor *t;
    int n_t;
    int dummy; /* the tensors of llmem_model_dummy_table, made as they are read */
    int *fds;  /* (st->n_files; dummy: none) */
    struct llmem_pool *pool;
    float rope_freqs[512];
};

/* A source of floats: one of the dtypes llmem quantize reads. */
static int readable(const struct conv *c, const struct llmem_st_tensor *s) {
    if (s->dtype == LLMEM_DTYPE_BF16 || s->dtype == LLMEM_DTYPE_F16 || s->dtype == LLMEM_DTYPE_F32)
        return 1;
    ERR("%s: tensor '%s' is of dtype %s; llmem quantize reads bf16, f16 and f32", c->dir, s->name,
        llmem_dtype_name(s->dtype));
    return 0;
}

static int add_tensor(struct conv *c, const char *gguf, const char *hf, int required,
                      int64_t permute_heads) {
    const struct llmem_st_tensor *s = llmem_safetensors_find(c->st, hf);
    if (s == NULL) {
        if (required)
            ERR("%s: tensor '%s' is missing", c->dir, hf);
        return required ? LLMEM_EFORMAT : LLMEM_OK;
    }
    if (!readable(c, s))
        return LLMEM_EUNSUPPORTED;
    if (s->n_dims != 1 && s->n_dims != 2) {
        ERR("%s: tensor '%s' has %d dimensions", c->dir, hf, s->n_dims);
        return LLMEM_EFORMAT;
    }
    struct conv_tensor *t = &c->t[c->n_t++];
    memset(t, 0, sizeof(*t));
    snprintf(t->gguf, sizeof(t->gguf), "%s", gguf);
    t->src = s;
    t->n_dims = s->n_dims;
    t->rows = s->n_dims == 2 ? s->shape[0] : 1;
    t->cols = s->n_dims == 2 ? s->shape[1] : s->shape[0];
    t->experts = 1;
    t->permute_heads = permute_heads;
    if (permute_heads > 0 && t->rows % (permute_heads * c->cfg.geom.head_dim) != 0) {
        ERR("%s: tensor '%s' has %" PRId64 " rows, not %" PRId64 " heads of %" PRId64, c->dir, hf,
            t->rows, permute_heads, c->cfg.geom.head_dim);
        return LLMEM_EFORMAT;
    }
    return LLMEM_OK;
}

/* Layer l's router and experts: blk.l.ffn_gate_inp.weight and the stacks
 * blk.l.ffn_{gate,up,down}_exps.weight ([E, rows, cols]), from one tensor per expert as the Hub
 * stores them (Qwen3-MoE's mlp.experts.N.*_proj, Mixtral's block_sparse_moe.experts.N.w1/w3/w2),
 * or from transformers' stacked experts.gate_up_proj [E, 2·inter, hidden] and
 * experts.down_proj [E, hidden, inter]. */
static int add_experts(struct conv *c, int64_t l) {
    const struct llmem_model_geometry *g = &c->cfg.geom;
    const int64_t E = g->n_experts, fe = g->expert_intermediate, h = g->hidden_size;
    char block[96], name[200], gguf[96];
    snprintf(block, sizeof(block), "model.layers.%" PRId64 ".mlp", l);
    snprintf(name, sizeof(name), "%s.gate.weight", block);
    if (llmem_safetensors_find(c->st, name) == NULL)
        snprintf(block, sizeof(block), "model.layers.%" PRId64 ".block_sparse_moe", l);
    snprintf(name, sizeof(name), "%s.gate.weight", block);
    snprintf(gguf, sizeof(gguf), "blk.%" PRId64 ".ffn_gate_inp.weight", l);
    int st = add_tensor(c, gguf, name, 1, 0);
    if (st != LLMEM_OK)
        return st;
    static const char *const parts[3] = {"gate", "up", "down"};
    static const char *const names[2][3] = {{"gate_proj", "up_proj", "down_proj"},
                                            {"w1", "w3", "w2"}};
    const int family = strstr(block, "block_sparse_moe") != NULL;
    char gate_up[200], down[200];
    snprintf(gate_up, sizeof(gate_up), "%s.experts.gate_up_proj", block);
    snprintf(down, sizeof(down), "%s.experts.down_proj", block);
    const struct llmem_st_tensor *stacked[2] = {llmem_safetensors_find(c->st, gate_up),
                                                llmem_safetensors_find(c->st, down)};
    for (int p = 0; p < 3; p++) {
        const int64_t rows = p < 2 ? fe : h, cols = p < 2 ? h : fe;
        struct conv_tensor *t = &c->t[c->n_t++];
        memset(t, 0, sizeof(*t));
        snprintf(t->gguf, sizeof(t->gguf), "blk.%" PRId64 ".ffn_%s_exps.weight", l, parts[p]);
        t->rows = rows, t->cols = cols, t->experts = E, t->n_dims = 3;
        if ((t->pieces = calloc((size_t)E, sizeof(*t->pieces))) == NULL) {
            ERR("out of memory");
            return LLMEM_ENOMEM;
        }
        t->n_pieces = (int)E;
        for (int64_t e = 0; e < E; e++) {
            const struct llmem_st_tensor *s = stacked[p == 2];
            int64_t row = 0;
            if (stacked[0] != NULL && stacked[1] != NULL) { /* [E, rows, cols] as rows */
                const int64_t per = p < 2 ? 2 * fe : h;
                if (s->n_dims != 3 || s->shape[0] != E || s->shape[1] != per ||
                    s->shape[2] != cols) {
                    ERR("%s: tensor '%s' is not [%" PRId64 ", %" PRId64 ", %" PRId64 "]", c->dir,
                        s->name, E, per, cols);
                    return LLMEM_EFORMAT;
                }
                row = e * per + (p == 1 ? fe : 0);
            } else {
                snprintf(name, sizeof(name), "%s.experts.%" PRId64 ".%s.weight", block, e,
                         names[family][p]);
                if ((s = llmem_safetensors_find(c->st, name)) == NULL) {
                    ERR("%s: tensor '%s' is missing", c->dir, name);
                    return LLMEM_EFORMAT;
                }
                if (s->n_dims != 2 || s->shape[0] != rows || s->shape[1] != cols) {
                    ERR("%s: tensor '%s' is not [%" PRId64 ", %" PRId64 "]", c->dir, name, rows,
                        cols);
                    return LLMEM_EFORMAT;
                }
            }
            if (!readable(c, s))
                return LLMEM_EUNSUPPORTED;
            t->pieces[e] = (struct conv_piece){s, row, rows};
        }
        t->src = t->pieces[0].src;
    }
    return LLMEM_OK;
}

static int list_tensors(struct conv *c) {
    const struct llmem_model_geometry *g = &c->cfg.geom;
    c->t = calloc((size_t)(g->n_layers * 16 + 8), sizeof(*c->t));
    if (c->t == NULL) {
        ERR("out of memory");
        return LLMEM_ENOMEM;
    }
    int st;
    if ((st = add_tensor(c, top_names[0][0], top_names[0][1], 1, 0)) ||
        (st = add_tensor(c, top_names[1][0], top_names[1][1], 1, 0)))
        return st;
    if (!g->tied_embeddings &&
        (st = add_tensor(c, top_names[2][0], top_names[2][1], 1, 0)) != LLMEM_OK)
        return st;
    for (int64_t l = 0; l < g->n_layers; l++)
        for (size_t i = 0; i < N_LAYER_NAMES; i++) {
            int required = i < 9 || (i < 12 && g->attention_bias) || (i >= 12 && g->qk_norm);
            int64_t heads = 0;
            if (c->llama && i == 1)
                heads = g->n_heads;
            if (c->llama && i == 2)
                heads = g->n_kv_heads;
            char gn[96], hn[160];
            snprintf(gn, sizeof(gn), "blk.%" PRId64 ".%s", l, layer_names[i][0]);
            snprintf(hn, sizeof(hn), "model.layers.%" PRId64 ".%s", l, layer_names[i][1]);
            const int moe = c->cfg.layer_moe != NULL && c->cfg.layer_moe[l];
            if (!required || (moe && i >= 6 && i < 9)) /* a MoE layer: no dense MLP */
                continue;
            if ((st = add_tensor(c, gn, hn, 1, heads)) != LLMEM_OK ||
                (moe && i == 5 && (st = add_experts(c, l)) != LLMEM_OK))
                return st;
        }
    if (strcmp(c->cfg.rope_type, "llama3") == 0) {
        struct conv_tensor *t = &c->t[c->n_t++];
        memset(t, 0, sizeof(*t));
        snprintf(t->gguf, sizeof(t->gguf), "rope_freqs.weight");
        t->rows = 1;
        t->cols = g->head_dim / 2;
        t->n_dims = 1;
    }
    qsort(c->t, (size_t)c->n_t, sizeof(*c->t), tensor_order);
    return LLMEM_OK;
}

/* convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3, in float32. */
static void llama3_rope_freqs(const struct llmem_model_config *cfg, float *out) {
    const int64_t dim = cfg->geom.head_dim;
    const float base = (float)cfg->rope_theta, factor = (float)cfg->rope_factor;
    const float low = (float)cfg->rope_low_freq_factor, high = (float)cfg->rope_high_freq_factor;
    const float old = (float)cfg->rope_original_max_context;
    const float low_wavelen = old / low, high_wavelen = old / high;
    for (int64_t i = 0; i < dim / 2; i++) {
        float freq = 1.0f / powf(base, (float)(2 * i) / (float)dim);
        float wavelen = (float)(2.0 * M_PI) / freq;
        if (wavelen < high_wavelen)
            out[i] = 1.0f;
        else if (wavelen > low_wavelen)
            out[i] = factor;
        else {
            float smooth = (old / wavelen - low) / (high - low);
            out[i] = 1.0f / ((1.0f - smooth) / factor + smooth);
        }
    }
}

/* ---- the tokenizer -------------------------------------------------------------------------- */

enum { TT_NORMAL = 1, TT_CONTROL = 3, TT_USER_DEFINED = 4, TT_UNUSED = 5, TT_BYTE = 6 };

static const char llama3_regex[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char qwen2_regex[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* The pre-tokenizer's name in llama.cpp, from tokenizer.json's pre_tokenizer; NULL when it is
 * none of them (*why says what it is). */
static const char *pre_name(const cJSON *pre, const char **why) {
    *why = "none";
    if (!cJSON_IsObject(pre))
        return NULL;
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(pre, "pretokenizers");
    const cJSON *one = pre, *item;
    int n = cJSON_IsArray(list) ? cJSON_GetArraySize(list) : 1;
    for (int i = 0; i < n; i++) {
        item = cJSON_IsArray(list) ? cJSON_GetArrayItem(list, i) : one;
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(item, "type");
        if (!cJSON_IsString(type))
            continue;
        if (strcmp(type->valuestring, "Split") == 0) {
            const cJSON *pat = cJSON_GetObjectItemCaseSensitive(item, "pattern");
            const cJSON *re = cJSON_GetObjectItemCaseSensitive(pat, "Regex");
            *why = "a Split regex llama.cpp has no name for";
            if (!cJSON_IsString(re))
                return NULL;
            if (strcmp(re->valuestring, llama3_regex) == 0)
                return "llama-bpe";
            if (strcmp(re->valuestring, qwen2_regex) == 0)
                return "qwen2";
            return NULL;
        }
        if (strcmp(type->valuestring, "ByteLevel") == 0 &&
            cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(item, "use_regex")))
            return "gpt-2";
    }
    *why = "no Split regex";
    return NULL;
}

struct vocab {
    int64_t n;
    char **tok;     /* (n) owned */
    int32_t *types; /* (n) */
    float *scores;  /* (n) model "llama" */
    struct llmem_gguf_str *strs;
    int64_t n_merges;
    char **merges;
    int32_t bos, eos, unk, pad;
    int add_bos, add_eos;
    char *chat_template;
};

static void vocab_free(struct vocab *v) {
    for (int64_t i = 0; v->tok && i < v->n; i++)
        free(v->tok[i]);
    for (int64_t i = 0; v->merges && i < v->n_merges; i++)
        free(v->merges[i]);
    free(v->tok);
    free(v->types);
    free(v->scores);
    free(v->strs);
    free(v->merges);
    free(v->chat_template);
}

/* A special token's text in tokenizer_config.json (a string or {"content": …}), or NULL. */
static const char *config_token(const cJSON *tc, const char *key) {
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(tc, key);
    if (cJSON_IsObject(e))
        e = cJSON_GetObjectItemCaseSensitive(e, "content");
    return cJSON_IsString(e) ? e->valuestring : NULL;
}

static int32_t added_id(const cJSON *added, const char *content) {
    const cJSON *a;
    if (content == NULL)
        return -1;
    cJSON_ArrayForEach(a, added) {
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(a, "content");
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(a, "id");
        if (cJSON_IsString(c) && cJSON_IsNumber(id) && strcmp(c->valuestring, content) == 0)
            return (int32_t)id->valuedouble;
    }
    return -1;
}

/* "a b" from the pair [a, b], a space inside a part written as U+0120 (chr(ord(' ') + 256)), as
 * gguf-py encodes merges given as pairs. */
static char *merge_text(const char *a, const char *b) {
    char *out = malloc(2 * (strlen(a) + strlen(b)) + 2), *p = out;
    if (out == NULL)
        return NULL;
    for (int part = 0; part < 2; part++) {
        if (part == 1)
            *p++ = ' ';
        for (const char *x = part ? b : a; *x; x++) {
            if (*x == ' ') {
                *p++ = (char)0xC4;
                *p++ = (char)0xA0;
            } else
                *p++ = *x;
        }
    }
    *p = 0;
    return out;
}

static int read_vocab(struct conv *c, struct vocab *v, const char **model, const char **pre) {
    char path[4096];
    cJSON *tj = NULL, *tc = NULL, *cj = NULL;
    int st = llmem_path_join(path, sizeof(path), c->dir, "tokenizer.json");
    if (st == LLMEM_OK)
        st = llmem_json_parse_file(path, (int64_t)1 << 30, &tj);
    if (st != LLMEM_OK)
        return st;
    if (llmem_path_join(path, sizeof(path), c->dir, "tokenizer_config.json") == LLMEM_OK &&
        access(path, F_OK) == 0 && (st = llmem_json_parse_file(path, 64 << 20, &tc)) != LLMEM_OK)
        goto out;
    if ((st = llmem_path_join(path, sizeof(path), c->dir, "config.json")) != LLMEM_OK ||
        (st = llmem_json_parse_file(path, 64 << 20, &cj)) != LLMEM_OK)
        goto out;
    st = LLMEM_EFORMAT;
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(tj, "model");
    const cJSON *mtype = cJSON_GetObjectItemCaseSensitive(m, "type");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(m, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(m, "merges");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(tj, "added_tokens");
    if (!cJSON_IsString(mtype) || strcmp(mtype->valuestring, "BPE") != 0 ||
        !cJSON_IsObject(vocab)) {
        ERR("%s/tokenizer.json: the model is not BPE (llmem quantize writes BPE vocabularies)",
            c->dir);
        st = LLMEM_EUNSUPPORTED;
        goto out;
    }
    const int spm = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(m, "byte_fallback"));
    const char *why = NULL;
    *model = spm ? "llama" : "gpt2";
    *pre = spm ? "default" : pre_name(cJSON_GetObjectItemCaseSensitive(tj, "pre_tokenizer"), &why);
    if (*pre == NULL) {
        ERR("%s/tokenizer.json: the pre-tokenizer has %s (llmem quantize knows llama.cpp's "
            "llama-bpe, qwen2 and gpt-2)",
            c->dir, why);
        st = LLMEM_EUNSUPPORTED;
        goto out;
    }
    /* tokens by id */
    int64_t n = c->cfg.geom.vocab_size;
    const cJSON *e;
    cJSON_ArrayForEach(e, vocab) {
        if (cJSON_IsNumber(e) && e->valuedouble + 1 > (double)n)
            n = (int64_t)e->valuedouble + 1;
    }
    cJSON_ArrayForEach(e, added) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        if (cJSON_IsNumber(id) && id->valuedouble + 1 > (double)n)
            n = (int64_t)id->valuedouble + 1;
    }
    if (n > ((int64_t)1 << 24)) {
        ERR("%s/tokenizer.json: a token id of %" PRId64 " is out of range", c->dir, n - 1);
        goto out;
    }
    v->n = n;
    v->tok = calloc((size_t)n, sizeof(*v->tok));
    v->types = calloc((size_t)n, sizeof(*v->types));
    v->scores = calloc((size_t)n, sizeof(*v->scores));
    v->strs = calloc((size_t)n, sizeof(*v->strs));
    if (!v->tok || !v->types || !v->scores || !v->strs)
        goto oom;
    cJSON_ArrayForEach(e, vocab) {
        if (!cJSON_IsNumber(e) || e->valuedouble < 0) {
            ERR("%s/tokenizer.json: token '%.40s' has no id", c->dir, e->string);
            goto out;
        }
        int64_t id = (int64_t)e->valuedouble;
        free(v->tok[id]);
        if ((v->tok[id] = strdup(e->string)) == NULL)
            goto oom;
        v->types[id] = TT_NORMAL;
    }
    /* the special ids (tokenizer_config first, config.json after, as SpecialVocab) */
    static const char *const kinds[] = {"bos", "eos", "unk", "pad"};
    int32_t *ids[] = {&v->bos, &v->eos, &v->unk, &v->pad};
    for (int k = 0; k < 4; k++) {
        char key[32];
        snprintf(key, sizeof(key), "%s_token", kinds[k]);
        *ids[k] = added_id(added, config_token(tc, key));
        if (*ids[k] < 0) {
            snprintf(key, sizeof(key), "%s_token_id", kinds[k]);
            const cJSON *x = cJSON_GetObjectItemCaseSensitive(cj, key);
            if (cJSON_IsArray(x))
                x = cJSON_GetArrayItem(x, 0);
            if (cJSON_IsNumber(x) && x->valuedouble >= 0 && x->valuedouble < (double)n)
                *ids[k] = (int32_t)x->valuedouble;
        }
    }
    cJSON_ArrayForEach(e, added) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (!cJSON_IsNumber(id) || id->valuedouble < 0 || !cJSON_IsString(content)) {
            ERR("%s/tokenizer.json: an added token has no id or content", c->dir);
            goto out;
        }
        int64_t i = (int64_t)id->valuedouble;
        free(v->tok[i]);
        if ((v->tok[i] = strdup(content->valuestring)) == NULL)
            goto oom;
        int special = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(e, "special"));
        v->types[i] = special ? TT_CONTROL : spm ? TT_NORMAL : TT_USER_DEFINED;
    }
    for (int64_t i = 0; i < n; i++) {
        if (v->tok[i] == NULL) {
            char pad[32];
            snprintf(pad, sizeof(pad), "[PAD%" PRId64 "]", i);
            if ((v->tok[i] = strdup(pad)) == NULL)
                goto oom;
            v->types[i] = TT_UNUSED;
        } else if (spm) { /* LlamaHfVocab's types, SentencePiece's scores */
            const char *s = v->tok[i];
            if (strlen(s) == 6 && strncmp(s, "<0x", 3) == 0 && s[5] == '>' &&
                isxdigit((unsigned char)s[3]) && isxdigit((unsigned char)s[4]))
                v->types[i] = TT_BYTE;
            else if (i == v->bos || i == v->eos || i == v->unk)
                v->types[i] = TT_CONTROL;
            v->scores[i] = v->types[i] == TT_NORMAL ? -(float)i : 0.0f;
        }
        v->strs[i] = (struct llmem_gguf_str){v->tok[i], strlen(v->tok[i])};
    }
    /* merges */
    if (!spm) {
        v->n_merges = cJSON_IsArray(merges) ? cJSON_GetArraySize(merges) : 0;
        if (v->n_merges == 0) {
            ERR("%s/tokenizer.json: a byte-level BPE without merges", c->dir);
            goto out;
        }
        if ((v->merges = calloc((size_t)v->n_merges, sizeof(*v->merges))) == NULL)
            goto oom;
        int64_t i = 0;
        cJSON_ArrayForEach(e, merges) {
            if (cJSON_IsString(e))
                v->merges[i] = strdup(e->valuestring);
            else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 &&
                     cJSON_IsString(cJSON_GetArrayItem(e, 0)) &&
                     cJSON_IsString(cJSON_GetArrayItem(e, 1)))
                v->merges[i] = merge_text(cJSON_GetArrayItem(e, 0)->valuestring,
                                          cJSON_GetArrayItem(e, 1)->valuestring);
            else {
                ERR("%s/tokenizer.json: merge %" PRId64 " is neither \"a b\" nor [a, b]", c->dir,
                    i);
                goto out;
            }
            if (v->merges[i++] == NULL)
                goto oom;
        }
    }
    /* add_bos / add_eos: a TemplateProcessing post-processor, then tokenizer_config */
    v->add_bos = v->add_eos = 0;
    const cJSON *pp = cJSON_GetObjectItemCaseSensitive(tj, "post_processor");
    const cJSON *procs = cJSON_GetObjectItemCaseSensitive(pp, "processors");
    const cJSON *proc;
    for (int i = 0; i < (cJSON_IsArray(procs) ? cJSON_GetArraySize(procs) : 1); i++) {
        proc = cJSON_IsArray(procs) ? cJSON_GetArrayItem(procs, i) : pp;
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(proc, "type");
        const cJSON *single = cJSON_GetObjectItemCaseSensitive(proc, "single");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "TemplateProcessing") != 0 ||
            !cJSON_IsArray(single) || cJSON_GetArraySize(single) < 2)
            continue;
        int ns = cJSON_GetArraySize(single);
        for (int end = 0; end < 2; end++) {
            const cJSON *sp = cJSON_GetObjectItemCaseSensitive(
                cJSON_GetArrayItem(single, end ? ns - 1 : 0), "SpecialToken");
            const cJSON *id = cJSON_GetObjectItemCaseSensitive(sp, "id");
            int32_t tid = cJSON_IsString(id) ? added_id(added, id->valuestring) : -1;
            if (tid >= 0 && end == 0)
                v->add_bos = tid == v->bos;
            if (tid >= 0 && end == 1)
                v->add_eos = tid == v->eos;
        }
    }
    if (cJSON_IsBool(cJSON_GetObjectItemCaseSensitive(tc, "add_bos_token")))
        v->add_bos = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(tc, "add_bos_token"));
    if (cJSON_IsBool(cJSON_GetObjectItemCaseSensitive(tc, "add_eos_token")))
        v->add_eos = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(tc, "add_eos_token"));
    /* the chat template */
    const cJSON *tmpl = cJSON_GetObjectItemCaseSensitive(tc, "chat_template");
    if (cJSON_IsString(tmpl)) {
        if ((v->chat_template = strdup(tmpl->valuestring)) == NULL)
            goto oom;
    } else if (llmem_path_join(path, sizeof(path), c->dir, "chat_template.jinja") == LLMEM_OK &&
               access(path, F_OK) == 0) {
        size_t len;
        if ((st = llmem_file_read(path, 16 << 20, &v->chat_template, &len)) != LLMEM_OK)
            goto out;
    }
    st = LLMEM_OK;
    goto out;
oom:
    ERR("out of memory");
    st = LLMEM_ENOMEM;
out:
    cJSON_Delete(tj);
    cJSON_Delete(tc);
    cJSON_Delete(cj);
    return st;
}

/* ---- metadata ------------------------------------------------------------------------------- */

static int write_metadata(struct conv *c, struct llmem_gguf_writer *w, int ftype,
                          const char *name) {
    const struct llmem_model_geometry *g = &c->cfg.geom;
    struct vocab v = {0};
    const char *model = NULL, *pre = NULL;
    int st = read_vocab(c, &v, &model, &pre);
    if (st != LLMEM_OK) {
        vocab_free(&v);
        return st;
    }
    char key[128];
#define K(suffix) (snprintf(key, sizeof(key), "%s.%s", c->arch, suffix), key)
    if ((st = llmem_gguf_writer_add_str(w, "general.architecture", c->arch, strlen(c->arch))) ||
        (st = llmem_gguf_writer_add_str(w, "general.name", name, strlen(name))) ||
        (st = llmem_gguf_writer_add_u32(w, "general.file_type", (uint32_t)ftype)) ||
        (st = llmem_gguf_writer_add_u32(w, "general.quantization_version", 2)) ||
        (st = llmem_gguf_writer_add_u32(w, K("context_length"), (uint32_t)g->max_context)) ||
        (st = llmem_gguf_writer_add_u32(w, K("embedding_length"), (uint32_t)g->hidden_size)) ||
        (st = llmem_gguf_writer_add_u32(w, K("block_count"), (uint32_t)g->n_layers)) ||
        (st = llmem_gguf_writer_add_u32(w, K("feed_forward_length"),
                                        (uint32_t)g->intermediate_size)) ||
        (st = llmem_gguf_writer_add_u32(w, K("attention.head_count"), (uint32_t)g->n_heads)) ||
        (st =
             llmem_gguf_writer_add_u32(w, K("attention.head_count_kv"), (uint32_t)g->n_kv_heads)) ||
        (st = llmem_gguf_writer_add_f32(w, K("rope.freq_base"), (float)c->cfg.rope_theta)) ||
        (st = llmem_gguf_writer_add_f32(w, K("attention.layer_norm_rms_epsilon"),
                                        (float)c->cfg.rms_norm_eps)) ||
        (st = llmem_gguf_writer_add_u32(w, K("attention.key_length"), (uint32_t)g->head_dim)) ||
        (st = llmem_gguf_writer_add_u32(w, K("attention.value_length"), (uint32_t)g->head_dim)))
        goto out;
    if (g->n_experts > 0 &&
        ((st = llmem_gguf_writer_add_u32(w, K("expert_count"), (uint32_t)g->n_experts)) ||
         (st = llmem_gguf_writer_add_u32(w, K("expert_used_count"), (uint32_t)g->n_experts_used)) ||
         (st = llmem_gguf_writer_add_u32(w, K("expert_feed_forward_length"),
                                         (uint32_t)g->expert_intermediate)) ||
         (st = llmem_gguf_writer_add_bool(w, K("expert_weights_norm"), c->cfg.moe_norm_topk))))
        goto out;
    if ((st = llmem_gguf_writer_add_u32(w, K("vocab_size"), (uint32_t)v.n)) ||
        (c->llama &&
         (st = llmem_gguf_writer_add_u32(w, K("rope.dimension_count"), (uint32_t)g->head_dim))))
        goto out;
    if (strcmp(c->cfg.rope_type, "linear") == 0 &&
        ((st = llmem_gguf_writer_add_str(w, K("rope.scaling.type"), "linear", 6)) ||
         (st = llmem_gguf_writer_add_f32(w, K("rope.scaling.factor"), (float)c->cfg.rope_factor))))
        goto out;
#undef K
    if ((st = llmem_gguf_writer_add_str(w, "tokenizer.ggml.model", model, strlen(model))) ||
        (st = llmem_gguf_writer_add_str(w, "tokenizer.ggml.pre", pre, strlen(pre))) ||
        (st = llmem_gguf_writer_add_str_array(w, "tokenizer.ggml.tokens", v.strs, (uint64_t)v.n)))
        goto out;
    if (strcmp(model, "llama") == 0 &&
        (st = llmem_gguf_writer_add_array(w, "tokenizer.ggml.scores", LLMEM_GGUF_F32, v.scores,
                                          (uint64_t)v.n)))
        goto out;
    if ((st = llmem_gguf_writer_add_array(w, "tokenizer.ggml.token_type", LLMEM_GGUF_I32, v.types,
                                          (uint64_t)v.n)))
        goto out;
    if (v.n_merges > 0) {
        struct llmem_gguf_str *ms = malloc((size_t)v.n_merges * sizeof(*ms));
        if (ms == NULL) {
            ERR("out of memory");
            st = LLMEM_ENOMEM;
            goto out;
        }
        for (int64_t i = 0; i < v.n_merges; i++)
            ms[i] = (struct llmem_gguf_str){v.merges[i], strlen(v.merges[i])};
        st = llmem_gguf_writer_add_str_array(w, "tokenizer.ggml.merges", ms, (uint64_t)v.n_merges);
        free(ms);
        if (st)
            goto out;
    }
    static const char *const id_keys[] = {
        "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id"};
    const int32_t ids[] = {v.bos, v.eos, v.unk, v.pad};
    for (int k = 0; k < 4; k++)
        if (ids[k] >= 0 && (st = llmem_gguf_writer_add_u32(w, id_keys[k], (uint32_t)ids[k])))
            goto out;
    if ((st = llmem_gguf_writer_add_bool(w, "tokenizer.ggml.add_bos_token", v.add_bos)) ||
        (st = llmem_gguf_writer_add_bool(w, "tokenizer.ggml.add_eos_token", v.add_eos)))
        goto out;
    if (v.chat_template != NULL)
        st = llmem_gguf_writer_add_str(w, "tokenizer.chat_template", v.chat_template,
                                       strlen(v.chat_template));
out:
    vocab_free(&v);
    return st;
}

/* ---- tensor data ---------------------------------------------------------------------------- */

static void to_f32(enum llmem_dtype dt, const void *src, float *dst, int64_t n) {
    if (dt == LLMEM_DTYPE_F32)
        memcpy(dst, src, (size_t)n * sizeof(float));
    else
        llmem_quant_dequantize_row(dt == LLMEM_DTYPE_BF16 ? LLMEM_QTYPE_BF16 : LLMEM_QTYPE_F16, src,
                                   dst, n);
}

/* Rows of whole heads: row s·half + j of each head → row 2j + s. */
static void permute_rows(const float *in, float *out, int64_t rows, int64_t cols,
                         int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < rows / head_dim; h++)
        for (int64_t j = 0; j < half; j++)
            for (int64_t s = 0; s < 2; s++)
                memcpy(out + (h * head_dim + 2 * j + s) * cols,
                       in + (h * head_dim + s * half + j) * cols, (size_t)cols * sizeof(float));
}

struct quant_job {
    int type;
    const float *src;
    uint8_t *dst;
    int64_t rows, cols, row_bytes;
    int failed;
};

#define JOB_ROWS 16

static void quant_task(void *arg, int task, int thread) {
    struct quant_job *j = arg;
    (void)thread;
    for (int64_t r = (int64_t)task * JOB_ROWS; r < j->rows && r < (task + 1) * JOB_ROWS; r++)
        if (llmem_quant_quantize_row(j->type, j->src + r * j->cols, j->dst + r * j->row_bytes,
                                     j->cols) != LLMEM_OK)
            j->failed = 1;
}

static int write_rows(struct conv *c, struct llmem_gguf_writer *w, const struct conv_tensor *t,
                      const struct conv_piece *pc, void *raw, float *f, float *g, uint8_t *q,
                      int64_t *done, int64_t total, llmem_gguf_progress_fn progress, void *arg);

static int write_tensor(struct conv *c, struct llmem_gguf_writer *w, const struct conv_tensor *t,
                        void *raw, float *f, float *g, uint8_t *q, int64_t *done, int64_t total,
                        llmem_gguf_progress_fn progress, void *arg) {
    if (t->src == NULL) /* rope_freqs */
        return llmem_gguf_writer_write(w, c->rope_freqs, (size_t)t->cols * sizeof(float));
    const struct conv_piece whole = {t->src, 0, t->rows};
    const int n = t->n_pieces > 0 ? t->n_pieces : 1;
    int st = LLMEM_OK;
    for (int i = 0; i < n && st == LLMEM_OK; i++)
        st = write_rows(c, w, t, t->n_pieces > 0 ? &t->pieces[i] : &whole, raw, f, g, q, done,
                        total, progress, arg);
    return st;
}

/* One piece of t's rows, converted and quantized a chunk at a time. */
static int write_rows(struct conv *c, struct llmem_gguf_writer *w, const struct conv_tensor *t,
                      const struct conv_piece *pc, void *raw, float *f, float *g, uint8_t *q,
                      int64_t *done, int64_t total, llmem_gguf_progress_fn progress, void *arg) {
    const struct llmem_st_tensor *src = pc->src;
    const int64_t es = llmem_dtype_size(src->dtype);
    const int64_t hd = c->cfg.geom.head_dim;
    int64_t step = CHUNK_BYTES / (t->cols * 4);
    if (t->permute_heads > 0)
        step = step / hd * hd;
    if (step < 1)
        step = 1;
    if (t->permute_heads > 0 && step < hd)
        step = hd; /* the buffers hold at least one head (sized so by the caller) */
    const int64_t row_bytes = llmem_qtype_bytes(t->type, t->cols);
    for (int64_t r = 0; r < pc->rows; r += step) {
        int64_t nr = pc->rows - r < step ? pc->rows - r : step;
        int64_t n = nr * t->cols;
        int64_t off = c->st->files[src->file_index].data_offset + src->offset_begin +
                      (pc->row + r) * t->cols * es;
        int st = LLMEM_OK;
        if (c->dummy)
            llmem_model_dummy_values(src, (int)(src - c->st->tensors), (pc->row + r) * t->cols, n,
                                     raw);
        else
            st = llmem_file_pread(c->fds[src->file_index], c->st->files[src->file_index].path, raw,
                                  (size_t)(n * es), off);
        if (st != LLMEM_OK)
            return st;
        to_f32(t->src->dtype, raw, f, n);
        const float *rows = f;
        if (t->permute_heads > 0) {
            permute_rows(f, g, nr, t->cols, hd);
            rows = g;
        }
        struct quant_job job = {t->type, rows, q, nr, t->cols, row_bytes, 0};
        llmem_pool_run(c->pool, (int)((nr + JOB_ROWS - 1) / JOB_ROWS), quant_task, &job);
        if (job.failed) {
            ERR("%s: tensor '%s': cannot write type %s", c->dir, t->gguf,
                llmem_qtype_name(t->type));
            return LLMEM_EINVAL;
        }
        if ((st = llmem_gguf_writer_write(w, q, (size_t)(nr * row_bytes))) != LLMEM_OK)
            return st;
        *done += n * es;
        if (progress)
            progress(arg, *done, total);
    }
    return LLMEM_OK;
}

/* ---- the conversion ------------------------------------------------------------------------- */

/* LLMEM_EINVAL (logged) when out cannot be the file written: empty, a directory, or one of dir's
 * own files (the model it reads, which the finished file would replace). */
static int check_output(const char *dir, const char *out) {
    struct stat o;
    if (out[0] == '\0' || (stat(out, &o) == 0 && S_ISDIR(o.st_mode))) {
        ERR("the output '%s' is %s, not a file's path", out, out[0] ? "a directory" : "empty");
        return LLMEM_EINVAL;
    }
    DIR *d = opendir(dir);
    if (d == NULL || stat(out, &o) != 0) { /* no such output yet: nothing of dir's to replace */
        if (d != NULL)
            closedir(d);
        return LLMEM_OK;
    }
    int st = LLMEM_OK;
    struct stat e;
    for (struct dirent *de; st == LLMEM_OK && (de = readdir(d)) != NULL;)
        if (fstatat(dirfd(d), de->d_name, &e, 0) == 0 && S_ISREG(e.st_mode) &&
            e.st_dev == o.st_dev && e.st_ino == o.st_ino) {
            ERR("the output '%s' is the model's own %s: writing it would destroy the model", out,
                de->d_name);
            st = LLMEM_EINVAL;
        }
    closedir(d);
    return st;
}

int llmem_gguf_convert(const char *dir, const char *out, int ftype, const char *name, int n_threads,
                       int dummy, llmem_gguf_progress_fn progress, void *progress_arg) {
    struct conv c = {.dir = dir, .dummy = dummy};
    struct llmem_gguf_writer *w = NULL;
    void *raw = NULL;
    float *f = NULL, *g = NULL;
    uint8_t *q = NULL;
    int st;
    LLMEM_ASSERT(ftype_base(ftype) >= 0);
    if ((st = check_output(dir, out)) != LLMEM_OK ||
        (st = llmem_model_config_load(dir, &c.cfg)) != LLMEM_OK)
        return st;
    const struct llmem_model_geometry *geom = &c.cfg.geom;
    if (strcmp(geom->arch, "llama") == 0 || strcmp(geom->arch, "mistral") == 0) {
        c.arch = "llama";
        c.llama = 1;
    } else if (strcmp(geom->arch, "qwen2") == 0 || strcmp(geom->arch, "qwen3") == 0) {
        c.arch = geom->arch;
    } else if (strcmp(geom->arch, "qwen3_moe") == 0) {
        c.arch = "qwen3moe";
        if (geom->n_moe_layers < geom->n_layers)
            LLMEM_WARN("%s: %" PRId64 " of the %" PRId64 " layers have a dense MLP "
                       "(mlp_only_layers, decoder_sparse_step): llmem reads such a file, "
                       "llama.cpp's qwen3moe expects experts in every layer",
                       dir, geom->n_layers - geom->n_moe_layers, geom->n_layers);
    } else if (strcmp(geom->arch, "mixtral") == 0) { /* llama.cpp's llama with experts */
        c.arch = "llama";
        c.llama = 1;
    } else {
        ERR("%s: architecture '%s' is not one llmem quantize writes (llama, mistral, qwen2, "
            "qwen3, qwen3_moe, mixtral)",
            dir, geom->arch);
        st = LLMEM_EUNSUPPORTED;
        goto out;
    }
    if (strcmp(c.cfg.rope_type, "default") != 0 && strcmp(c.cfg.rope_type, "llama3") != 0 &&
        strcmp(c.cfg.rope_type, "linear") != 0) {
        ERR("%s: rope type '%s' is not written (default, linear, llama3)", dir, c.cfg.rope_type);
        st = LLMEM_EUNSUPPORTED;
        goto out;
    }
    if (strcmp(c.cfg.hidden_act, "silu") != 0) {
        ERR("%s: hidden_act '%s' is not supported (silu)", dir, c.cfg.hidden_act);
        st = LLMEM_EUNSUPPORTED;
        goto out;
    }
    if (geom->head_dim % 2 != 0 || geom->head_dim / 2 > 512) {
        ERR("%s: head_dim %" PRId64 " is not supported", dir, geom->head_dim);
        st = LLMEM_EUNSUPPORTED;
        goto out;
    }
    if (geom->sliding_window > 0)
        LLMEM_WARN("%s: the sliding window (%" PRId64 " tokens) is not written: GGUF's llama "
                   "architecture has no key for it, and llama.cpp attends to the whole context",
                   dir, geom->sliding_window);
    if ((st = dummy ? llmem_model_dummy_table(&c.cfg, &c.st)
                    : llmem_safetensors_load_dir(dir, &c.st)) != LLMEM_OK)
        goto out;
    if (llmem_safetensors_find(c.st, "lm_head.weight") == NULL)
        c.cfg.geom.tied_embeddings = 1;
    if ((st = list_tensors(&c)) != LLMEM_OK)
        goto out;
    if (strcmp(c.cfg.rope_type, "llama3") == 0)
        llama3_rope_freqs(&c.cfg, c.rope_freqs);
    if ((st = llmem_pool_create(n_threads, &c.pool)) != LLMEM_OK)
        goto out;
    c.fds = malloc((size_t)c.st->n_files * sizeof(int));
    if (c.fds == NULL) {
        ERR("out of memory");
        st = LLMEM_ENOMEM;
        goto out;
    }
    for (int i = 0; i < c.st->n_files; i++)
        c.fds[i] = -1;
    for (int i = 0; !dummy && i < c.st->n_files; i++)
        if ((st = llmem_file_open_regular(c.st->files[i].path, FUNC, &c.fds[i])) != LLMEM_OK)
            goto out;

    /* types, and the largest chunk */
    int64_t total = 0, max_elems = 0, n_fallback = 0, n_stop = 0;
    const int tied = llmem_safetensors_find(c.st, "lm_head.weight") == NULL;
    for (int i = 0; i < c.n_t; i++) {
        struct conv_tensor *t = &c.t[i];
        t->type = llmem_gguf_tensor_type(ftype, t->gguf, t->n_dims, t->cols, geom->n_layers, tied,
                                         &t->fallback);
        if (t->fallback) {
            LLMEM_INFO("%s: row length %" PRId64 " is not a multiple of the rule's block: %s",
                       t->gguf, t->cols, llmem_qtype_name(t->type));
            n_fallback++;
            n_stop += t->fallback == 2;
        }
        for (int k = 0; t->src != NULL && k < (t->n_pieces > 0 ? t->n_pieces : 1); k++)
            total += t->n_pieces > 0
                         ? t->pieces[k].rows * t->cols * llmem_dtype_size(t->pieces[k].src->dtype)
                         : t->src->n_bytes;
        int64_t step = CHUNK_BYTES / (t->cols * 4);
        if (t->permute_heads > 0 && step < geom->head_dim)
            step = geom->head_dim;
        if (step < 1)
            step = 1;
        if (step > t->rows)
            step = t->rows;
        if (step * t->cols > max_elems)
            max_elems = step * t->cols;
    }
    if (n_fallback > 0)
        LLMEM_WARN(
            "%s: %" PRId64 " of %d tensors have rows that are not whole blocks of their "
            "rule's type and fall back as llama-quantize does (LLMEM_VERBOSE=1 lists them)%s",
            dir, n_fallback, c.n_t,
            n_stop > 0 ? "; some are Q8_0/Q4_0 rows that are not a multiple of 32, where "
                         "llama-quantize stops: they are written F16"
                       : "");
    raw = malloc((size_t)max_elems * 4);
    f = malloc((size_t)max_elems * sizeof(float));
    g = malloc((size_t)max_elems * sizeof(float));
    q = malloc((size_t)max_elems * 4 + 64);
    if (raw == NULL || f == NULL || g == NULL || q == NULL) {
        ERR("out of memory");
        st = LLMEM_ENOMEM;
        goto out;
    }

    char base[256];
    if (name == NULL) {
        const char *s = dir + strlen(dir);
        while (s > dir && s[-1] == '/')
            s--;
        const char *b = s;
        while (b > dir && b[-1] != '/')
            b--;
        snprintf(base, sizeof(base), "%.*s", (int)(s - b), b);
        name = base;
    }
    if ((st = llmem_gguf_writer_open(out, &w)) != LLMEM_OK ||
        (st = write_metadata(&c, w, ftype, name)) != LLMEM_OK)
        goto out;
    for (int i = 0; i < c.n_t; i++) {
        const struct conv_tensor *t = &c.t[i];
        int64_t dims[3] = {t->cols, t->rows, t->experts};
        if ((st = llmem_gguf_writer_add_tensor(w, t->gguf, t->type, t->n_dims, dims)))
            goto out;
    }
    int64_t done = 0;
    for (int i = 0; i < c.n_t; i++)
        if ((st = write_tensor(&c, w, &c.t[i], raw, f, g, q, &done, total, progress,
                               progress_arg)) != LLMEM_OK)
            goto out;
    st = llmem_gguf_writer_close(w);
out:
    llmem_gguf_writer_free(w);
    if (c.fds != NULL)
        for (int i = 0; i < c.st->n_files; i++)
            if (c.fds[i] >= 0)
                close(c.fds[i]);
    free(c.fds);
    free(raw);
    free(f);
    free(g);
    free(q);
    for (int i = 0; c.t != NULL && i < c.n_t; i++)
        free(c.t[i].pieces);
    free(c.t);
    llmem_pool_destroy(c.pool);
    llmem_safetensors_free(c.st);
    llmem_model_config_free(&c.cfg);
    return st;
}
