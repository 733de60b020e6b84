/*
 * tok/vocab.c — a GGUF vocabulary (tokenizer.ggml.*, as plain data) → struct llmem_tokenizer.
 *
 * The vocabulary is turned into the very pipeline a tokenizer.json of the same family describes,
 * so that nothing downstream knows where it came from: "gpt2" models get the Split regex of their
 * `pre` name, ByteLevel and the ByteLevel decoder (with NFC first for Qwen2), the merges table by
 * rank; "llama" models get the normalizer Prepend("▁") + Replace(" " → "▁") of the Llama 2 and
 * Mistral tokenizer.json files, byte fallback, the decoder Replace("▁" → " "), ByteFallback, Fuse,
 * Strip(1 leading space), and score ranks in place of merges (encode.c then merges by score, as
 * SentencePiece and llama.cpp's llm_tokenizer_spm do). Control, unknown and user-defined tokens
 * become added tokens. Every field is checked before use; see tok/vocab.h for what is refused.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "tok/tok_int.h"
#include "tok/vocab.h"

#define VOCAB_FUNC       "llmem_tokenizer_from_vocab"
#define VOCAB_ERROR(...) LLMEM_ERROR_AS(VOCAB_FUNC, __VA_ARGS__)
#define MAX_VOCAB        ((int64_t)1 << 26)
#define MAX_MERGES       ((int64_t)1 << 28)

/* ---- the pre-tokenizers of the families ----------------------------------------------------- */

/* As the families' tokenizer.json files spell them (llama.cpp spells the (?i:…) part as
 * character classes for its own regex engine). */
static const char LLAMA3_PATTERN[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char QWEN2_PATTERN[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
/* llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: four splits in turn. */
static const char *const DEFAULT_PATTERNS[] = {
    "[\\p{P}\\$\\+<=>\\^~\\|]+",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    "\\p{N}+",
    "[0-9][0-9][0-9]",
};

enum pre_family { PRE_DEFAULT, PRE_LLAMA3, PRE_QWEN2, PRE_GPT2 };

static const struct {
    const char *name;
    enum pre_family family;
} PRE_NAMES[] = {
    {"default", PRE_DEFAULT}, {"llama-bpe", PRE_LLAMA3},       {"llama3", PRE_LLAMA3},
    {"llama-v3", PRE_LLAMA3}, {"falcon3", PRE_LLAMA3},         {"pixtral", PRE_LLAMA3},
    {"qwen2", PRE_QWEN2},     {"deepseek-r1-qwen", PRE_QWEN2}, {"gpt-2", PRE_GPT2},
};
#define N_PRE_NAMES (sizeof(PRE_NAMES) / sizeof(PRE_NAMES[0]))

static const char SPACE_MARK[] = "\xE2\x96\x81"; /* ▁ U+2581 */

/* ---- helpers -------------------------------------------------------------------------------- */

static int dup_bytes(struct tok_str *s, const char *p, size_t n) {
    s->p = malloc(n + 1);
    if (s->p == NULL)
        return LLMEM_ENOMEM;
    if (n > 0)
        memcpy(s->p, p, n);
    s->p[n] = '\0';
    s->n = n;
    return LLMEM_OK;
}

/* A token's text for messages: at most 40 bytes, bytes outside printable ASCII as \xNN. */
static const char *show(const char *p, size_t n, char *buf, size_t size) {
    size_t k = 0;
    for (size_t i = 0; i < n && k + 5 < size; i++) {
        unsigned char c = (unsigned char)p[i];
        if (i == 40) {
            k += (size_t)snprintf(buf + k, size - k, "...");
            break;
        }
        if (c >= 0x20 && c < 0x7F && c != '"' && c != '\\')
            buf[k++] = (char)c;
        else
            k += (size_t)snprintf(buf + k, size - k, "\\x%02X", c);
    }
    buf[k < size ? k : size - 1] = '\0';
    return buf;
}

static int compile(const char *pattern, pcre2_code **out) {
    int err = 0;
    PCRE2_SIZE at = 0;
    *out = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err,
                         &at, NULL);
    if (*out == NULL) { /* the patterns are constants: only memory can run out */
        VOCAB_ERROR("out of memory compiling a pre-tokenizer regex");
        return LLMEM_ENOMEM;
    }
    (void)pcre2_jit_compile(*out, PCRE2_JIT_COMPLETE);
    return LLMEM_OK;
}

static int push_pre(struct llmem_tokenizer *tok, enum tok_pre_kind kind, const char *pattern) {
    struct tok_pre pre = {.kind = kind};
    if (pattern != NULL && compile(pattern, &pre.re) != LLMEM_OK)
        return LLMEM_ENOMEM;
    struct tok_pre *pres = realloc(tok->pres, ((size_t)tok->n_pres + 1) * sizeof(*pres));
    if (pres == NULL) {
        if (pre.re != NULL)
            pcre2_code_free(pre.re);
        VOCAB_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    tok->pres = pres;
    tok->pres[tok->n_pres++] = pre;
    if (kind == TOK_PRE_BYTELEVEL)
        tok->byte_level = 1;
    return LLMEM_OK;
}

static int push_norm(struct llmem_tokenizer *tok, enum tok_norm_kind kind, const char *a,
                     const char *b) {
    struct tok_norm norm = {.kind = kind};
    struct tok_norm *norms = realloc(tok->norms, ((size_t)tok->n_norms + 1) * sizeof(*norms));
    if (norms == NULL)
        goto out_nomem;
    tok->norms = norms;
    if ((a != NULL && dup_bytes(&norm.a, a, strlen(a)) != LLMEM_OK) ||
        (b != NULL && dup_bytes(&norm.b, b, strlen(b)) != LLMEM_OK)) {
        free(norm.a.p);
        goto out_nomem;
    }
    tok->norms[tok->n_norms++] = norm;
    return LLMEM_OK;
out_nomem:
    VOCAB_ERROR("out of memory");
    return LLMEM_ENOMEM;
}

static int push_dec(struct llmem_tokenizer *tok, enum tok_dec_kind kind, const char *a,
                    const char *b) {
    struct tok_dec dec = {.kind = kind};
    struct tok_dec *decs = realloc(tok->decs, ((size_t)tok->n_decs + 1) * sizeof(*decs));
    if (decs == NULL)
        goto out_nomem;
    tok->decs = decs;
    if ((a != NULL && dup_bytes(&dec.a, a, strlen(a)) != LLMEM_OK) ||
        (b != NULL && dup_bytes(&dec.b, b, strlen(b)) != LLMEM_OK)) {
        free(dec.a.p);
        goto out_nomem;
    }
    if (kind == TOK_DEC_STRIP)
        dec.start = 1;
    if (kind == TOK_DEC_BYTEFALLBACK)
        tok->dec_byte_fallback = 1;
    tok->decs[tok->n_decs++] = dec;
    tok->has_decoder = 1;
    return LLMEM_OK;
out_nomem:
    VOCAB_ERROR("out of memory");
    return LLMEM_ENOMEM;
}

/* ---- the tokens ----------------------------------------------------------------------------- */

static int check_fields(const struct llmem_tok_vocab *v, int spm) {
    if (v->n_tokens <= 0 || v->n_tokens > MAX_VOCAB || v->tokens == NULL) {
        VOCAB_ERROR("the vocabulary must hold 1 to %lld tokens (tokenizer.ggml.tokens has %lld)",
                    (long long)MAX_VOCAB, (long long)(v->tokens != NULL ? v->n_tokens : 0));
        return LLMEM_EFORMAT;
    }
    if (spm && v->scores == NULL) {
        VOCAB_ERROR("tokenizer model 'llama' needs tokenizer.ggml.scores, which is missing");
        return LLMEM_EFORMAT;
    }
    if (!spm && v->merges == NULL) {
        VOCAB_ERROR("tokenizer model 'gpt2' needs tokenizer.ggml.merges, which is missing");
        return LLMEM_EFORMAT;
    }
    if (v->merges != NULL && (v->n_merges < 0 || v->n_merges > MAX_MERGES)) {
        VOCAB_ERROR("tokenizer.ggml.merges: %lld merges (at most %lld)", (long long)v->n_merges,
                    (long long)MAX_MERGES);
        return LLMEM_EFORMAT;
    }
    for (int64_t i = 0; v->scores != NULL && i < v->n_tokens; i++) {
        if (!isfinite(v->scores[i])) {
            VOCAB_ERROR("tokenizer.ggml.scores[%lld] is not a finite number", (long long)i);
            return LLMEM_EFORMAT;
        }
    }
    for (int64_t i = 0; v->token_types != NULL && i < v->n_tokens; i++) {
        if (v->token_types[i] < LLMEM_TOK_TYPE_UNDEFINED ||
            v->token_types[i] > LLMEM_TOK_TYPE_BYTE) {
            VOCAB_ERROR("tokenizer.ggml.token_type[%lld] is %d, not a token type (0 to 6)",
                        (long long)i, v->token_types[i]);
            return LLMEM_EFORMAT;
        }
    }
    const struct {
        const char *key;
        int64_t id;
    } ids[] = {{"bos_token_id", v->bos_id},
               {"eos_token_id", v->eos_id},
               {"unknown_token_id", v->unk_id},
               {"padding_token_id", v->pad_id}};
    for (size_t i = 0; i < sizeof(ids) / sizeof(ids[0]); i++) {
        if (ids[i].id < -1 || ids[i].id >= v->n_tokens) {
            VOCAB_ERROR("tokenizer.ggml.%s %lld is out of range (%lld tokens)", ids[i].key,
                        (long long)ids[i].id, (long long)v->n_tokens);
            return LLMEM_EFORMAT;
        }
    }
    if (v->chat_template != NULL && memchr(v->chat_template, '\0', v->chat_template_len) != NULL) {
        VOCAB_ERROR("tokenizer.chat_template holds a NUL byte");
        return LLMEM_EFORMAT;
    }
    return LLMEM_OK;
}

static int add_tokens(struct llmem_tokenizer *tok, const struct llmem_tok_vocab *v) {
    size_t n = (size_t)v->n_tokens;
    tok->n_vocab = (int32_t)n;
    tok->pieces = calloc(n, sizeof(*tok->pieces));
    tok->kind = calloc(n, 1);
    tok->added_of = malloc(n * sizeof(*tok->added_of));
    tok->added = calloc(n, sizeof(*tok->added));
    if (tok->pieces == NULL || tok->kind == NULL || tok->added_of == NULL || tok->added == NULL ||
        llmem_tok_strmap_init(&tok->vocab, n, tok->pieces) != LLMEM_OK) {
        VOCAB_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    memset(tok->added_of, 0xFF, n * sizeof(*tok->added_of));
    char shown[200];
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        const struct llmem_tok_bytes *t = &v->tokens[id];
        if (t->n == 0 || t->p == NULL) {
            VOCAB_ERROR("tokenizer.ggml.tokens[%d] is empty", id);
            return LLMEM_EFORMAT;
        }
        int32_t other = llmem_tok_strmap_get(&tok->vocab, t->p, t->n);
        if (other >= 0) {
            VOCAB_ERROR("tokenizer.ggml.tokens[%d] and [%d] are both \"%s\"", other, id,
                        show(t->p, t->n, shown, sizeof(shown)));
            return LLMEM_EFORMAT;
        }
        if (dup_bytes(&tok->pieces[id], t->p, t->n) != LLMEM_OK) {
            VOCAB_ERROR("out of memory");
            return LLMEM_ENOMEM;
        }
        tok->kind[id] = TOK_KIND_VOCAB;
        llmem_tok_strmap_put(&tok->vocab, id);
        int32_t type = v->token_types != NULL ? v->token_types[id] : LLMEM_TOK_TYPE_NORMAL;
        if (type != LLMEM_TOK_TYPE_CONTROL && type != LLMEM_TOK_TYPE_UNKNOWN &&
            type != LLMEM_TOK_TYPE_USER_DEFINED)
            continue;
        struct tok_added *a = &tok->added[tok->n_added];
        if (dup_bytes(&a->content, t->p, t->n) != LLMEM_OK) {
            VOCAB_ERROR("out of memory");
            return LLMEM_ENOMEM;
        }
        a->id = id;
        a->special = type != LLMEM_TOK_TYPE_USER_DEFINED;
        tok->kind[id] = a->special ? TOK_KIND_SPECIAL : TOK_KIND_ADDED;
        tok->added_of[id] = tok->n_added++;
    }
    if (llmem_tok_index_added(tok) != LLMEM_OK) {
        VOCAB_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    llmem_tok_index_bytes(tok);
    return LLMEM_OK;
}

static int add_merges(struct llmem_tokenizer *tok, const struct llmem_tok_vocab *v) {
    if (llmem_tok_mergemap_init(&tok->merges, (size_t)v->n_merges) != LLMEM_OK) {
        VOCAB_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    struct tok_buf joined = {0};
    int status = LLMEM_OK;
    char shown[200];
    for (int64_t i = 0; i < v->n_merges && status == LLMEM_OK; i++) {
        const struct llmem_tok_bytes *m = &v->merges[i];
        /* llama.cpp splits at the first space after the first byte. */
        const char *sp = m->n > 1 && m->p != NULL ? memchr(m->p + 1, ' ', m->n - 1) : NULL;
        if (sp == NULL || sp + 1 == m->p + m->n) {
            VOCAB_ERROR("tokenizer.ggml.merges[%lld] \"%s\" is not two tokens separated by a space",
                        (long long)i, show(m->p, m->p != NULL ? m->n : 0, shown, sizeof(shown)));
            status = LLMEM_EFORMAT;
            break;
        }
        size_t na = (size_t)(sp - m->p);
        status = llmem_tok_merge_add(tok, m->p, na, sp + 1, m->n - na - 1, (int32_t)i, &joined);
        if (status == LLMEM_ENOMEM) {
            VOCAB_ERROR("out of memory");
        } else if (status != LLMEM_OK) {
            VOCAB_ERROR("tokenizer.ggml.merges[%lld] \"%s\" names a token that is not in the "
                        "vocabulary",
                        (long long)i, show(m->p, m->n, shown, sizeof(shown)));
            status = LLMEM_EFORMAT;
        }
    }
    tok->n_merges = (int32_t)v->n_merges;
    llmem_tok_buf_free(&joined);
    return status;
}

/* SentencePiece merges the pair whose result scores highest: the ids ranked by descending score,
 * so that encode.c's heap, lowest rank first, pops the same pair. */
static int cmp_score(const void *pa, const void *pb, void *ctx) {
    const float *scores = ctx;
    float a = scores[*(const int32_t *)pa], b = scores[*(const int32_t *)pb];
    return a > b ? -1 : a < b ? 1 : 0;
}

static int add_score_ranks(struct llmem_tokenizer *tok, const float *scores) {
    size_t n = (size_t)tok->n_vocab;
    int32_t *order = malloc(n * sizeof(*order));
    tok->score_rank = malloc(n * sizeof(*tok->score_rank));
    if (order == NULL || tok->score_rank == NULL) {
        free(order);
        VOCAB_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    for (size_t i = 0; i < n; i++)
        order[i] = (int32_t)i;
    qsort_r(order, n, sizeof(*order), cmp_score, (void *)scores);
    int32_t rank = 0;
    for (size_t i = 0; i < n; i++) {
        if (i > 0 && scores[order[i]] != scores[order[i - 1]])
            rank++;
        tok->score_rank[order[i]] = rank;
    }
    free(order);
    return LLMEM_OK;
}

/* ---- the pipelines -------------------------------------------------------------------------- */

static int set_gpt2(struct llmem_tokenizer *tok, const struct llmem_tok_vocab *v, int *add_bos) {
    enum pre_family family = PRE_DEFAULT;
    if (v->pre == NULL) {
        LLMEM_WARN("tokenizer.ggml.pre is missing: using llama.cpp's 'default' pre-tokenizer, "
                   "which may not be the model's own");
    } else {
        size_t i = 0;
        while (i < N_PRE_NAMES && strcmp(v->pre, PRE_NAMES[i].name) != 0)
            i++;
        if (i == N_PRE_NAMES) {
            VOCAB_ERROR("pre-tokenizer '%s' is not supported (llama-bpe, llama3, llama-v3, "
                        "falcon3, pixtral, qwen2, deepseek-r1-qwen, gpt-2, default)",
                        v->pre);
            return LLMEM_EUNSUPPORTED;
        }
        family = PRE_NAMES[i].family;
    }
    int status = LLMEM_OK;
    *add_bos = 0;
    switch (family) {
    case PRE_LLAMA3:
        tok->ignore_merges = 1;
        *add_bos = 1;
        if ((status = push_pre(tok, TOK_PRE_SPLIT, LLAMA3_PATTERN)) != LLMEM_OK)
            return status;
        break;
    case PRE_QWEN2:
        if ((status = push_norm(tok, TOK_NORM_NFC, NULL, NULL)) != LLMEM_OK ||
            (status = push_pre(tok, TOK_PRE_SPLIT, QWEN2_PATTERN)) != LLMEM_OK)
            return status;
        break;
    case PRE_DEFAULT:
        for (size_t i = 0; i < sizeof(DEFAULT_PATTERNS) / sizeof(DEFAULT_PATTERNS[0]); i++)
            if ((status = push_pre(tok, TOK_PRE_SPLIT, DEFAULT_PATTERNS[i])) != LLMEM_OK)
                return status;
        break;
    case PRE_GPT2:
        return (status = push_pre(tok, TOK_PRE_BYTELEVEL, llmem_tok_gpt2_pattern)) != LLMEM_OK
                   ? status
                   : push_dec(tok, TOK_DEC_BYTELEVEL, NULL, NULL);
    }
    if ((status = push_pre(tok, TOK_PRE_BYTELEVEL, NULL)) != LLMEM_OK)
        return status;
    return push_dec(tok, TOK_DEC_BYTELEVEL, NULL, NULL);
}

static int set_spm(struct llmem_tokenizer *tok, const struct llmem_tok_vocab *v) {
    int prefix = v->add_space_prefix != 0;
    int status = LLMEM_OK;
    tok->byte_fallback = 1;
    if ((prefix && (status = push_norm(tok, TOK_NORM_PREPEND, SPACE_MARK, NULL)) != LLMEM_OK) ||
        (status = push_norm(tok, TOK_NORM_REPLACE, " ", SPACE_MARK)) != LLMEM_OK ||
        (status = push_dec(tok, TOK_DEC_REPLACE, SPACE_MARK, " ")) != LLMEM_OK ||
        (status = push_dec(tok, TOK_DEC_BYTEFALLBACK, NULL, NULL)) != LLMEM_OK ||
        (status = push_dec(tok, TOK_DEC_FUSE, NULL, NULL)) != LLMEM_OK ||
        (prefix && (status = push_dec(tok, TOK_DEC_STRIP, " ", NULL)) != LLMEM_OK))
        return status;
    return add_score_ranks(tok, v->scores);
}

/* The text of a special id for chat rendering; NULL when absent or holding a NUL. */
static int special_text(const struct llmem_tokenizer *tok, int32_t id, char **out) {
    *out = NULL;
    if (id < 0 || memchr(tok->pieces[id].p, '\0', tok->pieces[id].n) != NULL)
        return LLMEM_OK;
    *out = strdup(tok->pieces[id].p);
    if (*out == NULL) {
        VOCAB_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    return LLMEM_OK;
}

/* ---- public --------------------------------------------------------------------------------- */

int llmem_tokenizer_from_vocab(const struct llmem_tok_vocab *v, struct llmem_tokenizer **out) {
    LLMEM_ASSERT(v != NULL && out != NULL);
    *out = NULL;
    int spm = 0;
    if (v->model != NULL && strcmp(v->model, "llama") == 0) {
        spm = 1;
    } else if (v->model == NULL || strcmp(v->model, "gpt2") != 0) {
        VOCAB_ERROR("tokenizer model '%s' is not supported (gpt2 or llama)",
                    v->model != NULL ? v->model : "(none)");
        return LLMEM_EUNSUPPORTED;
    }
    int status = check_fields(v, spm);
    if (status != LLMEM_OK)
        return status;
    struct llmem_tokenizer *tok = calloc(1, sizeof(*tok));
    if (tok == NULL) {
        VOCAB_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    int default_add_bos = 1;
    if ((status = add_tokens(tok, v)) != LLMEM_OK ||
        (v->merges != NULL && (status = add_merges(tok, v)) != LLMEM_OK) ||
        (status = spm ? set_spm(tok, v) : set_gpt2(tok, v, &default_add_bos)) != LLMEM_OK)
        goto out;
    /* llama.cpp's defaults: SentencePiece's <unk> <s> </s> at 0, 1, 2 (where the vocabulary has
     * them); none for gpt2. */
    int32_t n = tok->n_vocab;
    tok->bos_id = (int32_t)(v->bos_id >= 0 ? v->bos_id : spm && n > 1 ? 1 : -1);
    tok->eos_id = (int32_t)(v->eos_id >= 0 ? v->eos_id : spm && n > 2 ? 2 : -1);
    tok->unk_id = (int32_t)(v->unk_id >= 0 ? v->unk_id : spm ? 0 : -1);
    tok->add_bos = v->add_bos >= 0 ? v->add_bos != 0 : default_add_bos;
    tok->add_eos = v->add_eos >= 0 ? v->add_eos != 0 : 0;
    if ((status = special_text(tok, tok->bos_id, &tok->bos_text)) != LLMEM_OK ||
        (status = special_text(tok, tok->eos_id, &tok->eos_text)) != LLMEM_OK)
        goto out;
    if (v->chat_template != NULL) {
        tok->chat_template = malloc(v->chat_template_len + 1);
        if (tok->chat_template == NULL) {
            VOCAB_ERROR("out of memory");
            status = LLMEM_ENOMEM;
            goto out;
        }
        memcpy(tok->chat_template, v->chat_template, v->chat_template_len);
        tok->chat_template[v->chat_template_len] = '\0';
    }
    *out = tok;
    tok = NULL;
out:
    llmem_tokenizer_free(tok);
    return status;
}

int llmem_tokenizer_add_bos(const struct llmem_tokenizer *tok) {
    return tok->add_bos;
}

int llmem_tokenizer_add_eos(const struct llmem_tokenizer *tok) {
    return tok->add_eos;
}
