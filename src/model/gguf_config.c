/*
 * model/gguf_config.c — a GGUF file's metadata and tensor table → struct llmem_model_geometry
 * and struct llmem_model_config, as config.c and model_dir.c make them from a model directory.
 *
 * What maps to what ({arch} = general.architecture: llama — also what Mistral and Mixtral files
 * use —, qwen2, qwen3, qwen3moe; any other is refused by name):
 *
 *   geometry / config field     GGUF                                       when absent
 *   ------------------------    -----------------------------------------  -----------------
 *   arch                        general.architecture                       required
 *   name                        general.name                               the file's name
 *   source                      the path
 *   n_layers                    {arch}.block_count                         required
 *   hidden_size                 {arch}.embedding_length                    required
 *   n_heads                     {arch}.attention.head_count                required
 *   n_kv_heads                  {arch}.attention.head_count_kv             n_heads
 *   head_dim                    {arch}.attention.key_length                hidden / n_heads
 *   intermediate_size           {arch}.feed_forward_length                 required
 *   vocab_size                  token_embd.weight's rows (= the length of tokenizer.ggml.tokens
 *                               when that is present)                      required (tensor)
 *   max_context                 {arch}.context_length                      required
 *   tied_embeddings             no output.weight tensor
 *   attention_bias              a blk.0.attn_q.bias tensor
 *   qk_norm                     a blk.0.attn_q_norm.weight tensor
 *   sliding_window              0 (not written for these architectures)
 *   n_params / weights_bytes    Σ tensor elements / Σ tensor bytes (exactly the file's)
 *   n_experts                   {arch}.expert_count                        0 (dense)
 *   n_experts_used              {arch}.expert_used_count                   required with experts
 *   expert_intermediate         {arch}.expert_feed_forward_length          feed_forward_length
 *   n_moe_layers, layer_moe     the layers with a blk.N.ffn_gate_inp.weight (the router)
 *   expert_bytes                Σ bytes of the blk.N.ffn_{gate,up,down}_exps tensors
 *   moe_norm_topk               {arch}.expert_weights_norm                 1 (llama.cpp's
 *                                                                          Mixtral and Qwen3-MoE)
 *   rms_norm_eps                {arch}.attention.layer_norm_rms_epsilon     1e-6
 *   rope_theta                  {arch}.rope.freq_base                      10000
 *   rope_type                   {arch}.rope.scaling.type ("none" → default) "default"
 *   rope_factor                 {arch}.rope.scaling.factor, else {arch}.rope.scale_linear  1
 *   rope_original_max_context   {arch}.rope.scaling.original_context_length 8192
 *   rope_freqs                  a rope_freqs.weight tensor (Llama 3.x: per-pair factors)
 *   rope_interleaved            1 for llama (its Q/K rows are permuted for interleaved RoPE),
 *                               0 for qwen2 / qwen3
 *   hidden_act                  "silu"
 *   bos_id                      tokenizer.ggml.bos_token_id                −1
 *   eos_ids                     tokenizer.ggml.eos_token_id, then tokenizer.ggml.eot_token_id
 *
 * {arch}.rope.dimension_count, when present, must equal head_dim (partial rotary is not run);
 * {arch}.attention.value_length must equal key_length. Integers are bounded as config.c bounds
 * config.json's, so the planner's products cannot overflow; a missing, mistyped or out-of-range
 * key gives one line naming the file and the key.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "model/gguf.h"
#include "model/model_int.h"
#include "plan/moe_work.h"

static const char *const archs[] = {"llama", "qwen2", "qwen3", "qwen3moe"};

struct meta {
    const struct llmem_gguf *g;
    const char *func;
    const char *arch;
};

/* {arch}.suffix into buf. */
static const char *arch_key(const struct meta *m, const char *suffix, char *buf, size_t size) {
    snprintf(buf, size, "%s.%s", m->arch, suffix);
    return buf;
}

/* An integer key in [min, max]; LLMEM_ENOENT (logged when required) when absent. */
static int meta_int(const struct meta *m, const char *suffix, int required, int64_t min,
                    int64_t max, int64_t *out) {
    char key[96];
    arch_key(m, suffix, key, sizeof(key));
    uint64_t v = 0;
    const struct llmem_gguf_kv *kv = llmem_gguf_find_key(m->g, key);
    int status = LLMEM_ENOENT;
    if (kv != NULL) {
        /* a signed type with a negative value is out of range as well */
        int32_t s = 0;
        if (kv->type == LLMEM_GGUF_I8 || kv->type == LLMEM_GGUF_I16 || kv->type == LLMEM_GGUF_I32) {
            status = llmem_gguf_get_i32(m->g, key, &s);
            v = status == LLMEM_OK && s < 0 ? UINT64_MAX : (uint64_t)(int64_t)s;
        } else {
            status = llmem_gguf_get_u64(m->g, key, &v);
        }
    }
    if (status == LLMEM_ENOENT && required) {
        LLMEM_ERROR_AS(m->func, "%s: missing key '%s'", m->g->path, key);
        return LLMEM_EFORMAT;
    }
    if (status != LLMEM_OK)
        return status; /* a wrong type was logged */
    if (v < (uint64_t)min || v > (uint64_t)max) {
        LLMEM_ERROR_AS(m->func,
                       "%s: key '%s': %" PRIu64 " is out of range [%" PRId64 ", %" PRId64 "]",
                       m->g->path, key, v, min, max);
        return LLMEM_EFORMAT;
    }
    *out = (int64_t)v;
    return LLMEM_OK;
}

/* A float key in (lo, hi), or def when absent. */
static int meta_float(const struct meta *m, const char *suffix, double lo, double hi, double def,
                      double *out) {
    char key[96];
    arch_key(m, suffix, key, sizeof(key));
    double v = def;
    int status = llmem_gguf_get_f64(m->g, key, &v);
    if (status == LLMEM_ENOENT) {
        *out = def;
        return LLMEM_OK;
    }
    if (status != LLMEM_OK)
        return status;
    if (!(v > lo && v < hi)) {
        LLMEM_ERROR_AS(m->func, "%s: key '%s': %g is out of range (%g, %g)", m->g->path, key, v, lo,
                       hi);
        return LLMEM_EFORMAT;
    }
    *out = v;
    return LLMEM_OK;
}

static int meta_arch(struct meta *m) {
    struct llmem_gguf_str s;
    int status = llmem_gguf_get_string(m->g, "general.architecture", &s);
    if (status == LLMEM_ENOENT) {
        LLMEM_ERROR_AS(m->func, "%s: missing key 'general.architecture'", m->g->path);
        return LLMEM_EFORMAT;
    }
    if (status != LLMEM_OK)
        return status;
    for (size_t i = 0; i < sizeof(archs) / sizeof(archs[0]); i++) {
        if (s.len == strlen(archs[i]) && memcmp(s.ptr, archs[i], s.len) == 0) {
            m->arch = archs[i];
            return LLMEM_OK;
        }
    }
    char shown[64];
    llmem_model_copy_head(shown, sizeof(shown), s.ptr, (size_t)s.len);
    for (char *c = shown; *c != '\0'; c++)
        if ((unsigned char)*c < 0x20)
            *c = '?';
    LLMEM_ERROR_AS(m->func,
                   "%s: general.architecture '%s' is not supported (llama, qwen2, qwen3, qwen3moe "
                   "are)",
                   m->g->path, shown);
    return LLMEM_EUNSUPPORTED;
}

/* The file's base name without ".gguf". */
static void file_name(const char *path, char *dst, size_t size) {
    const char *base = strrchr(path, '/');
    base = base != NULL ? base + 1 : path;
    size_t n = strlen(base);
    if (n > 5 && strcmp(base + n - 5, ".gguf") == 0)
        n -= 5;
    llmem_model_copy_head(dst, size, base, n);
}

/* token_embd.weight (hidden, vocab) → vocab, checked against tokenizer.ggml.tokens. */
static int meta_vocab(const struct meta *m, struct llmem_model_geometry *g) {
    const char *path = m->g->path;
    const struct llmem_gguf_tensor *emb = llmem_gguf_find_tensor(m->g, "token_embd.weight");
    if (emb == NULL) {
        LLMEM_ERROR_AS(m->func, "%s: missing tensor 'token_embd.weight'", path);
        return LLMEM_EFORMAT;
    }
    if (emb->n_dims != 2 || emb->dims[0] != g->hidden_size || emb->dims[1] > MAX_VOCAB) {
        LLMEM_ERROR_AS(m->func,
                       "%s: tensor 'token_embd.weight' has shape [%" PRId64 ", %" PRId64
                       "] (%d dims), expected [%" PRId64 " (embedding_length), vocab ≤ %" PRId64
                       "]",
                       path, emb->dims[0], emb->dims[1], emb->n_dims, g->hidden_size, MAX_VOCAB);
        return LLMEM_EFORMAT;
    }
    g->vocab_size = emb->dims[1];
    const struct llmem_gguf_kv *tokens = llmem_gguf_find_key(m->g, "tokenizer.ggml.tokens");
    if (tokens == NULL)
        return LLMEM_OK;
    int status = llmem_gguf_get_array(m->g, "tokenizer.ggml.tokens", LLMEM_GGUF_STRING, &tokens);
    if (status != LLMEM_OK)
        return status;
    if (tokens->n != (uint64_t)g->vocab_size) {
        LLMEM_ERROR_AS(m->func,
                       "%s: key 'tokenizer.ggml.tokens' lists %" PRIu64
                       " tokens but tensor 'token_embd.weight' has %" PRId64 " rows",
                       path, tokens->n, g->vocab_size);
        return LLMEM_EFORMAT;
    }
    return LLMEM_OK;
}

/* blk.N.ffn_gate_inp.weight: layer N's router, present where the layer has experts. */
static int has_router(const struct meta *m, int64_t layer) {
    char name[64];
    snprintf(name, sizeof(name), "blk.%" PRId64 ".ffn_gate_inp.weight", layer);
    return llmem_gguf_find_tensor(m->g, name) != NULL;
}

/* The experts: their count, how many a token runs, their width, the layers that hold them and
 * their bytes. */
static int meta_moe(const struct meta *m, struct llmem_model_geometry *g) {
    int64_t n = 0;
    int status = meta_int(m, "expert_count", 0, 0, (int64_t)1 << 16, &n);
    if (status == LLMEM_ENOENT || (status == LLMEM_OK && n == 0))
        return LLMEM_OK;
    if (status != LLMEM_OK ||
        (status = meta_int(m, "expert_used_count", 1, 1, n < LLMEM_MOE_MAX_K ? n : LLMEM_MOE_MAX_K,
                           &g->n_experts_used)) != LLMEM_OK)
        return status;
    status = meta_int(m, "expert_feed_forward_length", 0, 1, MAX_INTERMEDIATE,
                      &g->expert_intermediate);
    if (status == LLMEM_ENOENT)
        g->expert_intermediate = g->intermediate_size;
    else if (status != LLMEM_OK)
        return status;
    g->n_experts = n;
    for (int64_t l = 0; l < g->n_layers; l++)
        g->n_moe_layers += has_router(m, l);
    for (int64_t i = 0; i < m->g->n_tensors; i++)
        if (strstr(m->g->tensors[i].name, "_exps.") != NULL)
            g->expert_bytes += m->g->tensors[i].n_bytes;
    if (g->n_moe_layers == 0)
        g->n_experts = g->n_experts_used = g->expert_intermediate = 0;
    return LLMEM_OK;
}

static int meta_geometry(struct meta *m, const char *path_for_name,
                         struct llmem_model_geometry *out) {
    struct llmem_model_geometry g;
    memset(&g, 0, sizeof(g));
    int status = meta_arch(m);
    if (status != LLMEM_OK)
        return status;
    snprintf(g.arch, sizeof(g.arch), "%s", m->arch);
    if ((status = meta_int(m, "block_count", 1, 1, MAX_LAYERS, &g.n_layers)) ||
        (status = meta_int(m, "embedding_length", 1, 1, MAX_HIDDEN, &g.hidden_size)) ||
        (status = meta_int(m, "attention.head_count", 1, 1, MAX_HEADS, &g.n_heads)) ||
        (status =
             meta_int(m, "feed_forward_length", 1, 1, MAX_INTERMEDIATE, &g.intermediate_size)) ||
        (status = meta_int(m, "context_length", 1, 1, MAX_CONTEXT, &g.max_context)))
        return status;
    status = meta_int(m, "attention.head_count_kv", 0, 1, g.n_heads, &g.n_kv_heads);
    if (status == LLMEM_ENOENT)
        g.n_kv_heads = g.n_heads;
    else if (status != LLMEM_OK)
        return status;
    if (g.n_heads % g.n_kv_heads != 0) {
        LLMEM_ERROR_AS(m->func,
                       "%s: key '%s.attention.head_count' (%" PRId64 ") is not a multiple of "
                       "'%s.attention.head_count_kv' (%" PRId64 ")",
                       m->g->path, m->arch, g.n_heads, m->arch, g.n_kv_heads);
        return LLMEM_EFORMAT;
    }
    status = meta_int(m, "attention.key_length", 0, 1, MAX_HEAD_DIM, &g.head_dim);
    if (status == LLMEM_ENOENT) {
        if (g.hidden_size % g.n_heads != 0) {
            LLMEM_ERROR_AS(m->func,
                           "%s: no key '%s.attention.key_length', and embedding_length (%" PRId64
                           ") is not divisible by head_count (%" PRId64 ")",
                           m->g->path, m->arch, g.hidden_size, g.n_heads);
            return LLMEM_EFORMAT;
        }
        g.head_dim = g.hidden_size / g.n_heads;
    } else if (status != LLMEM_OK) {
        return status;
    }
    int64_t value_length = 0;
    status = meta_int(m, "attention.value_length", 0, 1, MAX_HEAD_DIM, &value_length);
    if (status != LLMEM_OK && status != LLMEM_ENOENT)
        return status;
    if (status == LLMEM_OK && value_length != g.head_dim) {
        LLMEM_ERROR_AS(m->func,
                       "%s: key '%s.attention.value_length' (%" PRId64
                       ") differs from key_length (%" PRId64 ")",
                       m->g->path, m->arch, value_length, g.head_dim);
        return LLMEM_EFORMAT;
    }
    if (g.n_heads * g.head_dim > MAX_ATTN_WIDTH) {
        LLMEM_ERROR_AS(m->func,
                       "%s: head_count × key_length = %" PRId64 " × %" PRId64
                       " is more than %" PRId64,
                       m->g->path, g.n_heads, g.head_dim, MAX_ATTN_WIDTH);
        return LLMEM_EFORMAT;
    }
    if ((status = meta_vocab(m, &g)) != LLMEM_OK)
        return status;

    g.tied_embeddings = llmem_gguf_find_tensor(m->g, "output.weight") == NULL;
    g.attention_bias = llmem_gguf_find_tensor(m->g, "blk.0.attn_q.bias") != NULL;
    g.qk_norm = llmem_gguf_find_tensor(m->g, "blk.0.attn_q_norm.weight") != NULL;
    g.sliding_window = 0;
    if ((status = meta_moe(m, &g)) != LLMEM_OK)
        return status;
    g.n_params = m->g->n_elements;
    g.weights_bytes = m->g->n_bytes;
    for (int64_t i = 0; i < m->g->n_tensors; i++) {
        const int t = m->g->tensors[i].type;
        g.quantized |= t != LLMEM_QTYPE_F32 && t != LLMEM_QTYPE_F16 && t != LLMEM_QTYPE_BF16;
    }

    struct llmem_gguf_str name;
    status = llmem_gguf_get_string(m->g, "general.name", &name);
    if (status == LLMEM_OK && name.len > 0)
        llmem_model_copy_head(g.name, sizeof(g.name), name.ptr, (size_t)name.len);
    else if (status == LLMEM_OK || status == LLMEM_ENOENT)
        file_name(path_for_name, g.name, sizeof(g.name));
    else
        return status;
    for (char *c = g.name; *c != '\0'; c++) /* a name is printed: no control characters */
        if ((unsigned char)*c < 0x20 || *c == 0x7f)
            *c = '?';
    llmem_model_copy_tail(g.source, sizeof(g.source), path_for_name);
    *out = g;
    return LLMEM_OK;
}

int llmem_gguf_geometry(const struct llmem_gguf *g, struct llmem_model_geometry *geom,
                        const char *func) {
    struct meta m = {.g = g, .func = func};
    return meta_geometry(&m, g->path, geom);
}

/* ---- the full configuration ----------------------------------------------------------------- */

static int meta_token(const struct meta *m, const char *key, int64_t vocab, int32_t *out) {
    uint32_t v;
    int status = llmem_gguf_get_u32(m->g, key, &v);
    if (status != LLMEM_OK)
        return status;
    if ((int64_t)v >= vocab) {
        LLMEM_ERROR_AS(m->func,
                       "%s: key '%s': token %" PRIu32 " is not below the vocabulary (%" PRId64 ")",
                       m->g->path, key, v, vocab);
        return LLMEM_EFORMAT;
    }
    *out = (int32_t)v;
    return LLMEM_OK;
}

static int meta_rope(const struct meta *m, struct llmem_model_config *c) {
    int status;
    if ((status = meta_float(m, "rope.freq_base", 0, 1e30, 10000.0, &c->rope_theta)) ||
        (status = meta_float(m, "attention.layer_norm_rms_epsilon", 0, 1, 1e-6, &c->rms_norm_eps)))
        return status;
    snprintf(c->rope_type, sizeof(c->rope_type), "default");
    c->rope_factor = 1.0;
    c->rope_low_freq_factor = 1.0;
    c->rope_high_freq_factor = 4.0;
    c->rope_original_max_context = 8192;
    char key[96];
    struct llmem_gguf_str type = {0};
    status = llmem_gguf_get_string(m->g, arch_key(m, "rope.scaling.type", key, sizeof(key)), &type);
    if (status == LLMEM_OK) {
        if (!(type.len == 4 && memcmp(type.ptr, "none", 4) == 0))
            llmem_model_copy_head(c->rope_type, sizeof(c->rope_type), type.ptr, (size_t)type.len);
    } else if (status != LLMEM_ENOENT) {
        return status;
    }
    double factor = 0;
    status = meta_float(m, "rope.scale_linear", 0, 1e6, 0, &factor);
    if (status == LLMEM_OK)
        status = meta_float(m, "rope.scaling.factor", 0, 1e6, factor, &factor);
    if (status != LLMEM_OK)
        return status;
    if (factor > 0) {
        c->rope_factor = factor;
        if (strcmp(c->rope_type, "default") == 0 && type.ptr == NULL)
            snprintf(c->rope_type, sizeof(c->rope_type), "linear");
    }
    int64_t orig = 0;
    status = meta_int(m, "rope.scaling.original_context_length", 0, 1, MAX_CONTEXT, &orig);
    if (status == LLMEM_OK)
        c->rope_original_max_context = orig;
    else if (status != LLMEM_ENOENT)
        return status;
    int64_t rot = 0;
    status = meta_int(m, "rope.dimension_count", 0, 1, MAX_HEAD_DIM, &rot);
    if (status == LLMEM_OK && rot != c->geom.head_dim) {
        LLMEM_ERROR_AS(m->func,
                       "%s: key '%s.rope.dimension_count' (%" PRId64
                       ") differs from head_dim (%" PRId64
                       "): partial rotary embeddings are not supported",
                       m->g->path, m->arch, rot, c->geom.head_dim);
        return LLMEM_EUNSUPPORTED;
    }
    if (status != LLMEM_OK && status != LLMEM_ENOENT)
        return status;
    c->rope_freqs = llmem_gguf_find_tensor(m->g, "rope_freqs.weight") != NULL;
    c->rope_interleaved = strcmp(m->arch, "llama") == 0;
    return LLMEM_OK;
}

int llmem_gguf_config(const struct llmem_gguf *g, struct llmem_model_config *cfg,
                      const char *func) {
    struct llmem_model_config c;
    memset(&c, 0, sizeof(c));
    struct meta m = {.g = g, .func = func};
    int status = meta_geometry(&m, g->path, &c.geom);
    if (status == LLMEM_OK)
        status = meta_rope(&m, &c);
    if (status != LLMEM_OK)
        return status;
    snprintf(c.hidden_act, sizeof(c.hidden_act), "silu");
    c.bos_id = -1;
    status = meta_token(&m, "tokenizer.ggml.bos_token_id", c.geom.vocab_size, &c.bos_id);
    if (status != LLMEM_OK && status != LLMEM_ENOENT)
        return status;
    static const char *const eos_keys[] = {"tokenizer.ggml.eos_token_id",
                                           "tokenizer.ggml.eot_token_id"};
    for (size_t i = 0; i < sizeof(eos_keys) / sizeof(eos_keys[0]); i++) {
        int32_t id;
        status = meta_token(&m, eos_keys[i], c.geom.vocab_size, &id);
        if (status == LLMEM_ENOENT)
            continue;
        if (status != LLMEM_OK)
            return status;
        if (c.n_eos == 0 || c.eos_ids[0] != id)
            c.eos_ids[c.n_eos++] = id;
    }
    c.layer_sliding = calloc((size_t)c.geom.n_layers, 1);
    if (c.geom.n_experts > 0)
        c.layer_moe = calloc((size_t)c.geom.n_layers, 1);
    if (c.layer_sliding == NULL || (c.geom.n_experts > 0 && c.layer_moe == NULL)) {
        llmem_model_config_free(&c);
        LLMEM_ERROR_AS(func, "%s: out of memory", g->path);
        return LLMEM_ENOMEM;
    }
    for (int64_t l = 0; c.layer_moe != NULL && l < c.geom.n_layers; l++)
        c.layer_moe[l] = (uint8_t)has_router(&m, l);
    c.moe_norm_topk = 1;
    char key[96];
    status = llmem_gguf_get_bool(g, arch_key(&m, "expert_weights_norm", key, sizeof(key)),
                                 &c.moe_norm_topk);
    if (status != LLMEM_OK && status != LLMEM_ENOENT) {
        llmem_model_config_free(&c);
        return status;
    }
    *cfg = c;
    return LLMEM_OK;
}
