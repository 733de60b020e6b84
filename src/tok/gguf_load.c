/*
 * tok/gguf_load.c — the tokenizer of a GGUF file: its tokenizer.ggml.* keys (and
 * tokenizer.chat_template) read with model/gguf.h into a struct llmem_tok_vocab, built by
 * llmem_tokenizer_from_vocab (vocab.c).
 */
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "model/gguf.h"
#include "tok/tok_int.h"
#include "tok/vocab.h"

#define LOAD_FUNC       "llmem_tokenizer_load"
#define LOAD_ERROR(...) LLMEM_ERROR_AS(LOAD_FUNC, __VA_ARGS__)

/* An optional u32 key into *id (left as it is when absent). */
static int get_id(const struct llmem_gguf *g, const char *key, int64_t *id) {
    uint32_t v;
    int status = llmem_gguf_get_u32(g, key, &v);
    if (status == LLMEM_OK)
        *id = v;
    return status == LLMEM_ENOENT ? LLMEM_OK : status;
}

static int get_flag(const struct llmem_gguf *g, const char *key, int *flag) {
    int status = llmem_gguf_get_bool(g, key, flag);
    return status == LLMEM_ENOENT ? LLMEM_OK : status;
}

/* A string key as a NUL-terminated copy (malloc'ed); *out NULL when absent and not required. */
static int get_cstring(const struct llmem_gguf *g, const char *key, int required, char **out) {
    *out = NULL;
    struct llmem_gguf_str s;
    int status = llmem_gguf_get_string(g, key, &s);
    if (status == LLMEM_ENOENT && !required)
        return LLMEM_OK;
    if (status == LLMEM_ENOENT)
        LOAD_ERROR("%s: no '%s' key: the file carries no tokenizer", g->path, key);
    if (status != LLMEM_OK)
        return status;
    if (memchr(s.ptr, '\0', (size_t)s.len) != NULL) {
        LOAD_ERROR("%s: '%s' holds a NUL byte", g->path, key);
        return LLMEM_EFORMAT;
    }
    if ((*out = malloc((size_t)s.len + 1)) == NULL) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    memcpy(*out, s.ptr, (size_t)s.len);
    (*out)[s.len] = '\0';
    return LLMEM_OK;
}

/* A string array as (pointer, length) pairs into the file (malloc'ed array); n 0 when absent. */
static int get_strings(const struct llmem_gguf *g, const char *key, struct llmem_tok_bytes **out,
                       int64_t *n) {
    *out = NULL;
    *n = 0;
    const struct llmem_gguf_kv *kv;
    int status = llmem_gguf_get_array(g, key, LLMEM_GGUF_STRING, &kv);
    if (status != LLMEM_OK)
        return status == LLMEM_ENOENT ? LLMEM_OK : status;
    if ((*out = malloc((size_t)(kv->n > 0 ? kv->n : 1) * sizeof(**out))) == NULL) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    for (uint64_t i = 0; i < kv->n; i++) {
        struct llmem_gguf_str s = llmem_gguf_array_str(kv, i);
        (*out)[i] = (struct llmem_tok_bytes){s.ptr, (size_t)s.len};
    }
    *n = (int64_t)kv->n;
    return LLMEM_OK;
}

int llmem_tok_load_gguf(const char *path, struct llmem_tokenizer **out) {
    struct llmem_gguf *g = NULL;
    int status = llmem_gguf_open(path, &g);
    if (status != LLMEM_OK)
        return status;
    struct llmem_tok_vocab v = {.bos_id = -1,
                                .eos_id = -1,
                                .unk_id = -1,
                                .pad_id = -1,
                                .add_bos = -1,
                                .add_eos = -1,
                                .add_space_prefix = -1};
    char *model = NULL, *pre = NULL, *chat = NULL;
    struct llmem_tok_bytes *tokens = NULL, *merges = NULL;
    float *scores = NULL;
    int32_t *types = NULL;
    const struct llmem_gguf_kv *kv;
    if ((status = get_cstring(g, "tokenizer.ggml.model", 1, &model)) != LLMEM_OK ||
        (status = get_cstring(g, "tokenizer.ggml.pre", 0, &pre)) != LLMEM_OK ||
        (status = get_cstring(g, "tokenizer.chat_template", 0, &chat)) != LLMEM_OK ||
        (status = get_strings(g, "tokenizer.ggml.tokens", &tokens, &v.n_tokens)) != LLMEM_OK ||
        (status = get_strings(g, "tokenizer.ggml.merges", &merges, &v.n_merges)) != LLMEM_OK)
        goto out;
    if ((status = llmem_gguf_get_array(g, "tokenizer.ggml.scores", LLMEM_GGUF_F32, &kv)) ==
        LLMEM_OK) {
        if (kv->n != (uint64_t)v.n_tokens) {
            LOAD_ERROR("%s: tokenizer.ggml.scores has %llu values for %lld tokens", path,
                       (unsigned long long)kv->n, (long long)v.n_tokens);
            status = LLMEM_EFORMAT;
            goto out;
        }
        if ((scores = malloc((size_t)(kv->n > 0 ? kv->n : 1) * sizeof(float))) == NULL)
            goto oom;
        for (uint64_t i = 0; i < kv->n; i++)
            scores[i] = (float)llmem_gguf_array_float(kv, i);
    } else if (status != LLMEM_ENOENT) {
        goto out;
    }
    if ((status = llmem_gguf_get_array(g, "tokenizer.ggml.token_type", -1, &kv)) == LLMEM_OK) {
        if (kv->n != (uint64_t)v.n_tokens) {
            LOAD_ERROR("%s: tokenizer.ggml.token_type has %llu values for %lld tokens", path,
                       (unsigned long long)kv->n, (long long)v.n_tokens);
            status = LLMEM_EFORMAT;
            goto out;
        }
        if ((types = malloc((size_t)(kv->n > 0 ? kv->n : 1) * sizeof(int32_t))) == NULL)
            goto oom;
        for (uint64_t i = 0; i < kv->n; i++) {
            int64_t t;
            if (llmem_gguf_array_int(kv, i, &t) != LLMEM_OK || t < INT32_MIN || t > INT32_MAX) {
                LOAD_ERROR("%s: tokenizer.ggml.token_type[%llu] is not a token type", path,
                           (unsigned long long)i);
                status = LLMEM_EFORMAT;
                goto out;
            }
            types[i] = (int32_t)t;
        }
    } else if (status != LLMEM_ENOENT) {
        goto out;
    }
    if ((status = get_id(g, "tokenizer.ggml.bos_token_id", &v.bos_id)) != LLMEM_OK ||
        (status = get_id(g, "tokenizer.ggml.eos_token_id", &v.eos_id)) != LLMEM_OK ||
        (status = get_id(g, "tokenizer.ggml.unknown_token_id", &v.unk_id)) != LLMEM_OK ||
        (status = get_id(g, "tokenizer.ggml.padding_token_id", &v.pad_id)) != LLMEM_OK ||
        (status = get_flag(g, "tokenizer.ggml.add_bos_token", &v.add_bos)) != LLMEM_OK ||
        (status = get_flag(g, "tokenizer.ggml.add_eos_token", &v.add_eos)) != LLMEM_OK ||
        (status = get_flag(g, "tokenizer.ggml.add_space_prefix", &v.add_space_prefix)) != LLMEM_OK)
        goto out;
    v.model = model;
    v.pre = pre;
    v.tokens = tokens;
    v.merges = v.n_merges > 0 ? merges : NULL;
    v.scores = scores;
    v.token_types = types;
    v.chat_template = chat;
    v.chat_template_len = chat != NULL ? strlen(chat) : 0;
    status = llmem_tokenizer_from_vocab(&v, out);
    goto out;
oom:
    LOAD_ERROR("out of memory");
    status = LLMEM_ENOMEM;
out:
    free(model), free(pre), free(chat), free(tokens), free(merges), free(scores), free(types);
    llmem_gguf_free(g);
    return status;
}
