/*
 * tok/load.c — tokenizer.json (+ tokenizer_config.json, chat_template.jinja) → struct
 * llmem_tokenizer.
 *
 * Every construct of the file is either understood completely or refused: an unknown model,
 * normalizer, pre-tokenizer or decoder type, or an option that changes the output and is not
 * implemented (Split behaviours other than Isolated, BPE dropout, subword prefixes), is
 * LLMEM_EUNSUPPORTED with one error line naming the construct and its JSON path; a missing or
 * mistyped field is LLMEM_EFORMAT naming the field. Nothing is silently ignored that would change
 * the ids (post_processor, padding and truncation only matter when special tokens are added, which
 * llmem_tokenizer_encode never does).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/file.h"
#include "core/json.h"
#include "core/log.h"
#include "model/gguf.h"
#include "tok/tok_int.h"

#define LOAD_FUNC       "llmem_tokenizer_load"
#define LOAD_ERROR(...) LLMEM_ERROR_AS(LOAD_FUNC, __VA_ARGS__)
#define TOK_MAX_BYTES   ((int64_t)512 << 20)
#define CFG_MAX_BYTES   ((int64_t)16 << 20)
#define MAX_VOCAB       ((int64_t)1 << 26)
#define MAX_ID_GAP      65536 /* ids allowed past twice the entries (added tokens, reserved) */
#define PATH_MAX_LEN    4096

struct loader {
    struct llmem_tokenizer *tok;
    const char *path; /* tokenizer.json, for messages */
};

static int str_dup(struct tok_str *s, const char *p, size_t n) {
    s->p = malloc(n + 1);
    if (s->p == NULL) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    memcpy(s->p, p, n);
    s->p[n] = '\0';
    s->n = n;
    return LLMEM_OK;
}

/* A string member; *out NULL when absent or null (and not required). */
static int get_str(const struct loader *l, const cJSON *obj, const char *where, const char *key,
                   int required, const char **out) {
    *out = NULL;
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (item == NULL || cJSON_IsNull(item)) {
        if (!required)
            return LLMEM_OK;
        LOAD_ERROR("%s: missing '%s.%s'", l->path, where, key);
        return LLMEM_EFORMAT;
    }
    if (!cJSON_IsString(item)) {
        LOAD_ERROR("%s: '%s.%s' must be a string", l->path, where, key);
        return LLMEM_EFORMAT;
    }
    *out = item->valuestring;
    return LLMEM_OK;
}

/* A boolean member; *out keeps its default when absent or null. */
static int get_bool(const struct loader *l, const cJSON *obj, const char *where, const char *key,
                    int *out) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (item == NULL || cJSON_IsNull(item))
        return LLMEM_OK;
    if (!cJSON_IsBool(item)) {
        LOAD_ERROR("%s: '%s.%s' must be true or false", l->path, where, key);
        return LLMEM_EFORMAT;
    }
    *out = cJSON_IsTrue(item);
    return LLMEM_OK;
}

static int get_int(const struct loader *l, const cJSON *obj, const char *where, const char *key,
                   int64_t min, int64_t max, int64_t *out) {
    int64_t v = 0;
    int status = llmem_json_get_int(obj, key, &v);
    if (status == LLMEM_ENOENT)
        return LLMEM_ENOENT;
    if (status != LLMEM_OK || v < min || v > max) {
        LOAD_ERROR("%s: '%s.%s' must be an integer in [%lld, %lld]", l->path, where, key,
                   (long long)min, (long long)max);
        return LLMEM_EFORMAT;
    }
    *out = v;
    return LLMEM_OK;
}

/* The "type" of a component object. */
static int get_type(const struct loader *l, const cJSON *obj, const char *where,
                    const char **type) {
    if (!cJSON_IsObject(obj)) {
        LOAD_ERROR("%s: '%s' must be an object or null", l->path, where);
        return LLMEM_EFORMAT;
    }
    return get_str(l, obj, where, "type", 1, type);
}

/* A pattern object {"String": s} or {"Regex": r}; *is_regex tells which. */
static int get_pattern(const struct loader *l, const cJSON *obj, const char *where,
                       const char **pattern, int *is_regex) {
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(obj, "pattern");
    if (!cJSON_IsObject(pat)) {
        LOAD_ERROR("%s: '%s.pattern' must be an object {\"String\"|\"Regex\": ...}", l->path,
                   where);
        return LLMEM_EFORMAT;
    }
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(pat, "String");
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(pat, "Regex");
    if (cJSON_IsString(s)) {
        *pattern = s->valuestring, *is_regex = 0;
        return LLMEM_OK;
    }
    if (cJSON_IsString(r)) {
        *pattern = r->valuestring, *is_regex = 1;
        return LLMEM_OK;
    }
    LOAD_ERROR("%s: '%s.pattern' must hold a \"String\" or a \"Regex\"", l->path, where);
    return LLMEM_EFORMAT;
}

/* ---- regexes -------------------------------------------------------------------------------- */

const char llmem_tok_gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* A field that must be one character (Metaspace's replacement, Strip's content): LLMEM_EFORMAT
 * (logged, naming where.key) otherwise, an empty or NUL-led string included. */
static int one_char(const struct loader *l, const char *where, const char *key, const char *s) {
    uint32_t cp;
    if (s[0] == '\0' ||
        llmem_tok_utf8_char((const unsigned char *)s, strlen(s), &cp) != strlen(s)) {
        LOAD_ERROR("%s: '%s.%s' must be one character", l->path, where, key);
        return LLMEM_EFORMAT;
    }
    return LLMEM_OK;
}

static int compile_regex(const struct loader *l, const char *where, const char *pattern,
                         int literal, pcre2_code **out) {
    int err = 0;
    PCRE2_SIZE at = 0;
    uint32_t flags = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    pcre2_code *re =
        pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, flags, &err, &at, NULL);
    if (re == NULL) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof(msg));
        LOAD_ERROR("%s: '%s' is not a valid regex (at offset %zu: %s): %s", l->path, where,
                   (size_t)at, (const char *)msg, pattern);
        return LLMEM_EFORMAT;
    }
    /* JIT when this build of PCRE2 has it; pcre2_match falls back to the interpreter. */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    *out = re;
    return LLMEM_OK;
}

/* ---- model ---------------------------------------------------------------------------------- */

static int add_vocab(struct loader *l, const cJSON *vocab, int64_t max_added_id) {
    struct llmem_tokenizer *tok = l->tok;
    if (!cJSON_IsObject(vocab)) {
        LOAD_ERROR("%s: 'model.vocab' must be an object of string → id", l->path);
        return LLMEM_EFORMAT;
    }
    int64_t max_id = max_added_id;
    size_t n = 0;
    const cJSON *e = NULL;
    cJSON_ArrayForEach(e, vocab) {
        int64_t id = 0;
        if (llmem_json_int(e, &id) != LLMEM_OK || id < 0 || id >= MAX_VOCAB) {
            LOAD_ERROR("%s: 'model.vocab' entry \"%s\" must be an id in [0, %lld)", l->path,
                       e->string, (long long)MAX_VOCAB);
            return LLMEM_EFORMAT;
        }
        if (id > max_id)
            max_id = id;
        n++;
    }
    /* the tables are indexed by id: a few entries with ids far apart would size them by the
     * largest (real vocabularies are dense, at most a few reserved ids left out) */
    if (max_id >= 2 * (int64_t)n + MAX_ID_GAP) {
        LOAD_ERROR("%s: ids go up to %lld for %zu vocabulary entries: an id space that sparse is "
                   "refused",
                   l->path, (long long)max_id, n);
        return LLMEM_EFORMAT;
    }
    tok->n_vocab = (int32_t)(max_id + 1);
    size_t n_alloc = tok->n_vocab > 0 ? (size_t)tok->n_vocab : 1; /* an empty vocabulary is valid */
    tok->pieces = calloc(n_alloc, sizeof(*tok->pieces));
    tok->kind = calloc(n_alloc, 1);
    tok->added_of = malloc(n_alloc * sizeof(*tok->added_of));
    if (tok->pieces == NULL || tok->kind == NULL || tok->added_of == NULL ||
        llmem_tok_strmap_init(&tok->vocab, n, tok->pieces) != LLMEM_OK) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    memset(tok->added_of, 0xFF, n_alloc * sizeof(*tok->added_of));
    cJSON_ArrayForEach(e, vocab) {
        int32_t id = (int32_t)e->valuedouble;
        if (tok->pieces[id].p != NULL) {
            LOAD_ERROR("%s: 'model.vocab' gives id %d to both \"%s\" and \"%s\"", l->path, id,
                       tok->pieces[id].p, e->string);
            return LLMEM_EFORMAT;
        }
        int status = str_dup(&tok->pieces[id], e->string, strlen(e->string));
        if (status != LLMEM_OK)
            return status;
        tok->kind[id] = TOK_KIND_VOCAB;
        llmem_tok_strmap_put(&tok->vocab, id);
    }
    return LLMEM_OK;
}

/* One merge, "a b" or ["a", "b"], → the two parts. */
static int merge_parts(const struct loader *l, const cJSON *m, int64_t rank, const char **a,
                       size_t *na, const char **b, size_t *nb) {
    if (cJSON_IsString(m)) {
        const char *s = m->valuestring;
        const char *sp = strchr(s, ' ');
        if (sp == NULL || strchr(sp + 1, ' ') != NULL) {
            LOAD_ERROR("%s: 'model.merges[%lld]' \"%s\" must be two tokens separated by one space",
                       l->path, (long long)rank, s);
            return LLMEM_EFORMAT;
        }
        *a = s, *na = (size_t)(sp - s), *b = sp + 1, *nb = strlen(sp + 1);
        return LLMEM_OK;
    }
    if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 && cJSON_IsString(m->child) &&
        cJSON_IsString(m->child->next)) {
        *a = m->child->valuestring, *na = strlen(*a);
        *b = m->child->next->valuestring, *nb = strlen(*b);
        return LLMEM_OK;
    }
    LOAD_ERROR("%s: 'model.merges[%lld]' must be \"a b\" or [\"a\", \"b\"]", l->path,
               (long long)rank);
    return LLMEM_EFORMAT;
}

static int add_merges(struct loader *l, const cJSON *merges) {
    struct llmem_tokenizer *tok = l->tok;
    if (merges == NULL || cJSON_IsNull(merges))
        return LLMEM_OK;
    if (!cJSON_IsArray(merges)) {
        LOAD_ERROR("%s: 'model.merges' must be an array", l->path);
        return LLMEM_EFORMAT;
    }
    int n = cJSON_GetArraySize(merges);
    if (llmem_tok_mergemap_init(&tok->merges, (size_t)n) != LLMEM_OK) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    struct tok_buf joined = {0};
    int status = LLMEM_OK;
    int64_t rank = 0;
    const cJSON *m = NULL;
    cJSON_ArrayForEach(m, merges) {
        const char *a, *b;
        size_t na, nb;
        status = merge_parts(l, m, rank, &a, &na, &b, &nb);
        if (status != LLMEM_OK)
            break;
        status = llmem_tok_merge_add(tok, a, na, b, nb, (int32_t)rank, &joined);
        if (status == LLMEM_ENOMEM) {
            LOAD_ERROR("out of memory");
            break;
        }
        if (status != LLMEM_OK) {
            LOAD_ERROR("%s: 'model.merges[%lld]' (\"%.*s\" + \"%.*s\") names a token that is not "
                       "in the vocabulary",
                       l->path, (long long)rank, (int)na, a, (int)nb, b);
            status = LLMEM_EFORMAT;
            break;
        }
        rank++;
    }
    tok->n_merges = (int32_t)rank;
    llmem_tok_buf_free(&joined);
    return status;
}

static int load_model(struct loader *l, const cJSON *root, int64_t max_added_id) {
    struct llmem_tokenizer *tok = l->tok;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (model == NULL || cJSON_IsNull(model)) {
        LOAD_ERROR("%s: missing 'model'", l->path);
        return LLMEM_EFORMAT;
    }
    if (!cJSON_IsObject(model)) {
        LOAD_ERROR("%s: 'model' must be an object", l->path);
        return LLMEM_EFORMAT;
    }
    const char *type = NULL;
    int status = get_str(l, model, "model", "type", 0, &type);
    if (status != LLMEM_OK)
        return status;
    if (type == NULL) /* older files omit the type; BPE is the one with merges */
        type = cJSON_GetObjectItemCaseSensitive(model, "merges") != NULL ? "BPE" : "(none)";
    if (strcmp(type, "BPE") != 0) {
        LOAD_ERROR("%s: model type '%s' is not supported (only BPE)", l->path, type);
        return LLMEM_EUNSUPPORTED;
    }
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (dropout != NULL && !cJSON_IsNull(dropout)) {
        LOAD_ERROR("%s: 'model.dropout' (BPE dropout) is not supported", l->path);
        return LLMEM_EUNSUPPORTED;
    }
    static const char *const affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        const char *s = NULL;
        status = get_str(l, model, "model", affixes[i], 0, &s);
        if (status != LLMEM_OK)
            return status;
        if (s != NULL && s[0] != '\0') {
            LOAD_ERROR("%s: 'model.%s' is not supported", l->path, affixes[i]);
            return LLMEM_EUNSUPPORTED;
        }
    }
    if ((status = get_bool(l, model, "model", "byte_fallback", &tok->byte_fallback)) ||
        (status = get_bool(l, model, "model", "ignore_merges", &tok->ignore_merges)) ||
        (status = get_bool(l, model, "model", "fuse_unk", &tok->fuse_unk)))
        return status;
    status = add_vocab(l, cJSON_GetObjectItemCaseSensitive(model, "vocab"), max_added_id);
    if (status != LLMEM_OK)
        return status;
    status = add_merges(l, cJSON_GetObjectItemCaseSensitive(model, "merges"));
    if (status != LLMEM_OK)
        return status;
    const char *unk = NULL;
    status = get_str(l, model, "model", "unk_token", 0, &unk);
    if (status != LLMEM_OK)
        return status;
    tok->unk_id = -1;
    if (unk != NULL) {
        tok->unk_id = llmem_tok_strmap_get(&tok->vocab, unk, strlen(unk));
        if (tok->unk_id < 0) {
            LOAD_ERROR("%s: 'model.unk_token' \"%s\" is not in the vocabulary", l->path, unk);
            return LLMEM_EFORMAT;
        }
    }
    llmem_tok_index_bytes(tok);
    return LLMEM_OK;
}

/* ---- added tokens --------------------------------------------------------------------------- */

/* The largest id of added_tokens (−1 when none), checked before the vocabulary is sized. */
static int added_max_id(const struct loader *l, const cJSON *added, int64_t *max_id) {
    *max_id = -1;
    if (added == NULL || cJSON_IsNull(added))
        return LLMEM_OK;
    if (!cJSON_IsArray(added)) {
        LOAD_ERROR("%s: 'added_tokens' must be an array", l->path);
        return LLMEM_EFORMAT;
    }
    const cJSON *a = NULL;
    int i = 0;
    cJSON_ArrayForEach(a, added) {
        int64_t id = 0;
        char where[64];
        snprintf(where, sizeof(where), "added_tokens[%d]", i++);
        if (!cJSON_IsObject(a)) {
            LOAD_ERROR("%s: '%s' must be an object", l->path, where);
            return LLMEM_EFORMAT;
        }
        int status = get_int(l, a, where, "id", 0, MAX_VOCAB - 1, &id);
        if (status == LLMEM_ENOENT) {
            LOAD_ERROR("%s: missing '%s.id'", l->path, where);
            return LLMEM_EFORMAT;
        }
        if (status != LLMEM_OK)
            return status;
        if (id > *max_id)
            *max_id = id;
    }
    return LLMEM_OK;
}

static int load_added(struct loader *l, const cJSON *added) {
    struct llmem_tokenizer *tok = l->tok;
    if (added == NULL || cJSON_IsNull(added))
        return llmem_tok_index_added(tok); /* (none: nothing to allocate) */
    int n = cJSON_GetArraySize(added);
    tok->added = calloc((size_t)n + 1, sizeof(*tok->added));
    if (tok->added == NULL) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    const cJSON *a = NULL;
    cJSON_ArrayForEach(a, added) {
        char where[64];
        snprintf(where, sizeof(where), "added_tokens[%d]", tok->n_added);
        struct tok_added *t = &tok->added[tok->n_added];
        const char *content = NULL;
        int64_t id = 0;
        int single_word = 0;
        int status = get_str(l, a, where, "content", 1, &content);
        if (status == LLMEM_OK)
            status = get_int(l, a, where, "id", 0, MAX_VOCAB - 1, &id);
        if (status == LLMEM_OK && (status = get_bool(l, a, where, "special", &t->special)) == 0 &&
            (status = get_bool(l, a, where, "lstrip", &t->lstrip)) == 0 &&
            (status = get_bool(l, a, where, "rstrip", &t->rstrip)) == 0)
            status = get_bool(l, a, where, "single_word", &single_word);
        if (status != LLMEM_OK)
            return status;
        if (single_word) {
            LOAD_ERROR("%s: '%s.single_word' (\"%s\") is not supported", l->path, where, content);
            return LLMEM_EUNSUPPORTED;
        }
        if (content[0] == '\0') {
            LOAD_ERROR("%s: '%s.content' is empty", l->path, where);
            return LLMEM_EFORMAT;
        }
        if ((status = str_dup(&t->content, content, strlen(content))) != LLMEM_OK)
            return status;
        t->id = (int32_t)id;
        tok->kind[id] = t->special ? TOK_KIND_SPECIAL : TOK_KIND_ADDED;
        tok->added_of[id] = tok->n_added;
        tok->n_added++;
    }
    if (llmem_tok_index_added(tok) != LLMEM_OK) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    return LLMEM_OK;
}

/* ---- normalizer ----------------------------------------------------------------------------- */

/* A Sequence's members (obj[key], an array), each added by `add` one level deeper, with its
 * position in `where` for messages. */
static int add_sequence(struct loader *l, const cJSON *obj, const char *where, const char *key,
                        int depth, int (*add)(struct loader *, const cJSON *, const char *, int)) {
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsArray(list)) {
        LOAD_ERROR("%s: '%s.%s' must be an array", l->path, where, key);
        return LLMEM_EFORMAT;
    }
    int i = 0, status = LLMEM_OK;
    const cJSON *e = NULL;
    cJSON_ArrayForEach(e, list) {
        char sub[96];
        snprintf(sub, sizeof(sub), "%s.%s[%d]", where, key, i++);
        if ((status = add(l, e, sub, depth + 1)) != LLMEM_OK)
            return status;
    }
    return LLMEM_OK;
}

static int add_norm(struct loader *l, const cJSON *obj, const char *where, int depth) {
    struct llmem_tokenizer *tok = l->tok;
    if (obj == NULL || cJSON_IsNull(obj))
        return LLMEM_OK;
    const char *type = NULL;
    int status = get_type(l, obj, where, &type);
    if (status != LLMEM_OK)
        return status;
    if (strcmp(type, "Sequence") == 0 && depth == 0)
        return add_sequence(l, obj, where, "normalizers", depth, add_norm);
    struct tok_norm norm = {0};
    if (strcmp(type, "Prepend") == 0) {
        const char *s = NULL;
        if ((status = get_str(l, obj, where, "prepend", 1, &s)) != LLMEM_OK)
            return status;
        norm.kind = TOK_NORM_PREPEND;
        if ((status = str_dup(&norm.a, s, strlen(s))) != LLMEM_OK)
            return status;
    } else if (strcmp(type, "Replace") == 0) {
        const char *pat = NULL, *content = NULL;
        int is_regex = 0;
        if ((status = get_pattern(l, obj, where, &pat, &is_regex)) != LLMEM_OK ||
            (status = get_str(l, obj, where, "content", 1, &content)) != LLMEM_OK)
            return status;
        if (is_regex) {
            LOAD_ERROR("%s: '%s' Replace with a Regex pattern is not supported", l->path, where);
            return LLMEM_EUNSUPPORTED;
        }
        if (pat[0] == '\0') {
            LOAD_ERROR("%s: '%s.pattern' is empty", l->path, where);
            return LLMEM_EFORMAT;
        }
        norm.kind = TOK_NORM_REPLACE;
        if ((status = str_dup(&norm.a, pat, strlen(pat))) != LLMEM_OK)
            return status;
        if ((status = str_dup(&norm.b, content, strlen(content))) != LLMEM_OK) {
            free(norm.a.p);
            return status;
        }
    } else if (strcmp(type, "NFC") == 0) {
        norm.kind = TOK_NORM_NFC;
    } else {
        LOAD_ERROR("%s: normalizer '%s' (%s) is not supported (NFC, Prepend, Replace or a Sequence "
                   "of them)",
                   l->path, type, where);
        return LLMEM_EUNSUPPORTED;
    }
    struct tok_norm *norms = realloc(tok->norms, ((size_t)tok->n_norms + 1) * sizeof(*norms));
    if (norms == NULL) {
        free(norm.a.p);
        free(norm.b.p);
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    tok->norms = norms;
    tok->norms[tok->n_norms++] = norm;
    return LLMEM_OK;
}

/* ---- pre-tokenizer -------------------------------------------------------------------------- */

static int push_pre(struct loader *l, struct tok_pre *pre) {
    struct llmem_tokenizer *tok = l->tok;
    struct tok_pre *pres = realloc(tok->pres, ((size_t)tok->n_pres + 1) * sizeof(*pres));
    if (pres == NULL) {
        if (pre->re != NULL)
            pcre2_code_free(pre->re);
        free(pre->repl.p);
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    tok->pres = pres;
    tok->pres[tok->n_pres++] = *pre;
    return LLMEM_OK;
}

static int add_pre(struct loader *l, const cJSON *obj, const char *where, int depth) {
    if (obj == NULL || cJSON_IsNull(obj))
        return LLMEM_OK;
    const char *type = NULL;
    int status = get_type(l, obj, where, &type);
    if (status != LLMEM_OK)
        return status;
    struct tok_pre pre = {0};
    if (strcmp(type, "Sequence") == 0 && depth == 0)
        return add_sequence(l, obj, where, "pretokenizers", depth, add_pre);
    if (strcmp(type, "Split") == 0) {
        const char *pat = NULL, *behavior = NULL;
        int is_regex = 0, invert = 0;
        if ((status = get_pattern(l, obj, where, &pat, &is_regex)) != LLMEM_OK ||
            (status = get_str(l, obj, where, "behavior", 1, &behavior)) != LLMEM_OK ||
            (status = get_bool(l, obj, where, "invert", &invert)) != LLMEM_OK)
            return status;
        if (strcmp(behavior, "Isolated") != 0 || invert) {
            LOAD_ERROR("%s: '%s' Split with behavior '%s'%s is not supported (only Isolated, "
                       "invert false)",
                       l->path, where, behavior, invert ? " and invert true" : "");
            return LLMEM_EUNSUPPORTED;
        }
        char what[128];
        snprintf(what, sizeof(what), "%s.pattern", where);
        pre.kind = TOK_PRE_SPLIT;
        if ((status = compile_regex(l, what, pat, !is_regex, &pre.re)) != LLMEM_OK)
            return status;
        return push_pre(l, &pre);
    }
    if (strcmp(type, "ByteLevel") == 0) {
        int use_regex = 1;
        pre.kind = TOK_PRE_BYTELEVEL;
        pre.add_prefix_space = 1;
        if ((status = get_bool(l, obj, where, "add_prefix_space", &pre.add_prefix_space)) ||
            (status = get_bool(l, obj, where, "use_regex", &use_regex)))
            return status;
        if (use_regex &&
            (status = compile_regex(l, where, llmem_tok_gpt2_pattern, 0, &pre.re)) != 0)
            return status;
        l->tok->byte_level = 1;
        return push_pre(l, &pre);
    }
    if (strcmp(type, "Metaspace") == 0) {
        const char *repl = NULL, *scheme = NULL;
        int add_prefix_space = -1;
        pre.kind = TOK_PRE_METASPACE;
        pre.split = 1;
        if ((status = get_str(l, obj, where, "replacement", 1, &repl)) ||
            (status = get_str(l, obj, where, "prepend_scheme", 0, &scheme)) ||
            (status = get_bool(l, obj, where, "add_prefix_space", &add_prefix_space)) ||
            (status = get_bool(l, obj, where, "split", &pre.split)) ||
            (status = one_char(l, where, "replacement", repl)))
            return status;
        if (scheme == NULL)
            pre.prepend = add_prefix_space == 0 ? TOK_PREPEND_NEVER : TOK_PREPEND_ALWAYS;
        else if (strcmp(scheme, "always") == 0)
            pre.prepend = TOK_PREPEND_ALWAYS;
        else if (strcmp(scheme, "first") == 0)
            pre.prepend = TOK_PREPEND_FIRST;
        else if (strcmp(scheme, "never") == 0)
            pre.prepend = TOK_PREPEND_NEVER;
        else {
            LOAD_ERROR("%s: '%s.prepend_scheme' must be always, first or never, not '%s'", l->path,
                       where, scheme);
            return LLMEM_EFORMAT;
        }
        if ((status = str_dup(&pre.repl, repl, strlen(repl))) != LLMEM_OK)
            return status;
        return push_pre(l, &pre);
    }
    LOAD_ERROR("%s: pre-tokenizer '%s' (%s) is not supported (Split, ByteLevel, Metaspace or a "
               "Sequence of them)",
               l->path, type, where);
    return LLMEM_EUNSUPPORTED;
}

/* ---- decoder -------------------------------------------------------------------------------- */

static int add_dec(struct loader *l, const cJSON *obj, const char *where, int depth) {
    struct llmem_tokenizer *tok = l->tok;
    if (obj == NULL || cJSON_IsNull(obj))
        return LLMEM_OK;
    const char *type = NULL;
    int status = get_type(l, obj, where, &type);
    if (status != LLMEM_OK)
        return status;
    tok->has_decoder = 1;
    if (strcmp(type, "Sequence") == 0 && depth == 0)
        return add_sequence(l, obj, where, "decoders", depth, add_dec);
    struct tok_dec dec = {0};
    const char *a = NULL, *b = NULL;
    if (strcmp(type, "ByteLevel") == 0) {
        dec.kind = TOK_DEC_BYTELEVEL;
    } else if (strcmp(type, "ByteFallback") == 0) {
        dec.kind = TOK_DEC_BYTEFALLBACK;
        tok->dec_byte_fallback = 1;
    } else if (strcmp(type, "Fuse") == 0) {
        dec.kind = TOK_DEC_FUSE;
    } else if (strcmp(type, "Metaspace") == 0) {
        const char *scheme = NULL;
        int add_prefix_space = 1;
        dec.kind = TOK_DEC_METASPACE;
        if ((status = get_str(l, obj, where, "replacement", 1, &a)) ||
            (status = get_str(l, obj, where, "prepend_scheme", 0, &scheme)) ||
            (status = get_bool(l, obj, where, "add_prefix_space", &add_prefix_space)) ||
            (status = one_char(l, where, "replacement", a)))
            return status;
        dec.prepend = scheme != NULL ? strcmp(scheme, "never") != 0 : add_prefix_space;
    } else if (strcmp(type, "Replace") == 0) {
        int is_regex = 0;
        dec.kind = TOK_DEC_REPLACE;
        if ((status = get_pattern(l, obj, where, &a, &is_regex)) ||
            (status = get_str(l, obj, where, "content", 1, &b)))
            return status;
        if (is_regex || a[0] == '\0') {
            LOAD_ERROR("%s: '%s' Replace decoder needs a non-empty String pattern", l->path, where);
            return LLMEM_EUNSUPPORTED;
        }
    } else if (strcmp(type, "Strip") == 0) {
        int64_t start = 0, stop = 0;
        dec.kind = TOK_DEC_STRIP;
        if ((status = get_str(l, obj, where, "content", 1, &a)) != LLMEM_OK)
            return status;
        status = get_int(l, obj, where, "start", 0, 1 << 20, &start);
        if (status == LLMEM_OK || status == LLMEM_ENOENT)
            status = get_int(l, obj, where, "stop", 0, 1 << 20, &stop);
        if ((status != LLMEM_OK && status != LLMEM_ENOENT) ||
            (status = one_char(l, where, "content", a)) != LLMEM_OK)
            return status;
        dec.start = (int)start, dec.stop = (int)stop;
    } else {
        LOAD_ERROR("%s: decoder '%s' (%s) is not supported (ByteLevel, Metaspace, Replace, "
                   "ByteFallback, Fuse, Strip)",
                   l->path, type, where);
        return LLMEM_EUNSUPPORTED;
    }
    if ((a != NULL && (status = str_dup(&dec.a, a, strlen(a))) != LLMEM_OK) ||
        (b != NULL && (status = str_dup(&dec.b, b, strlen(b))) != LLMEM_OK)) {
        free(dec.a.p);
        return status;
    }
    struct tok_dec *decs = realloc(tok->decs, ((size_t)tok->n_decs + 1) * sizeof(*decs));
    if (decs == NULL) {
        free(dec.a.p);
        free(dec.b.p);
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    tok->decs = decs;
    tok->decs[tok->n_decs++] = dec;
    return LLMEM_OK;
}

/* ---- tokenizer_config.json ------------------------------------------------------------------ */

/* bos_token / eos_token: a string or {"content": string}. */
static int config_token(const char *path, const cJSON *cfg, const char *key, char **out) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (item == NULL || cJSON_IsNull(item))
        return LLMEM_OK;
    if (cJSON_IsObject(item))
        item = cJSON_GetObjectItemCaseSensitive(item, "content");
    if (!cJSON_IsString(item)) {
        LOAD_ERROR("%s: '%s' must be a string or {\"content\": string}", path, key);
        return LLMEM_EFORMAT;
    }
    *out = strdup(item->valuestring);
    if (*out == NULL) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    return LLMEM_OK;
}

/* chat_template: a string, or a list of {name, template} of which "default" is taken. */
static int config_template(const char *path, const cJSON *cfg, char **out) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
    if (item == NULL || cJSON_IsNull(item))
        return LLMEM_OK;
    const char *text = NULL;
    if (cJSON_IsString(item)) {
        text = item->valuestring;
    } else if (cJSON_IsArray(item)) {
        const cJSON *e = NULL;
        cJSON_ArrayForEach(e, item) {
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(e, "name");
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(e, "template");
            if (!cJSON_IsString(name) || !cJSON_IsString(t)) {
                LOAD_ERROR("%s: 'chat_template' entries must be {\"name\": string, \"template\": "
                           "string}",
                           path);
                return LLMEM_EFORMAT;
            }
            if (strcmp(name->valuestring, "default") == 0)
                text = t->valuestring;
        }
        if (text == NULL)
            return LLMEM_OK; /* no default template: as if there were none */
    } else {
        LOAD_ERROR("%s: 'chat_template' must be a string or a list of {name, template}", path);
        return LLMEM_EFORMAT;
    }
    *out = strdup(text);
    if (*out == NULL) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    return LLMEM_OK;
}

/* Anything by that name counts: a FIFO or a directory there is refused by the read, naming it,
 * rather than passed over in silence. */
static int file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

static int load_config(struct llmem_tokenizer *tok, const char *model_dir) {
    char path[PATH_MAX_LEN];
    int status = llmem_path_join(path, sizeof(path), model_dir, "tokenizer_config.json");
    if (status != LLMEM_OK)
        return status;
    if (file_exists(path)) {
        cJSON *cfg = NULL;
        if ((status = llmem_json_parse_file(path, CFG_MAX_BYTES, &cfg)) != LLMEM_OK)
            return status;
        if (!cJSON_IsObject(cfg)) {
            LOAD_ERROR("%s: must be a JSON object", path);
            status = LLMEM_EFORMAT;
        }
        if (status == LLMEM_OK)
            status = config_token(path, cfg, "bos_token", &tok->bos_text);
        if (status == LLMEM_OK)
            status = config_token(path, cfg, "eos_token", &tok->eos_text);
        if (status == LLMEM_OK)
            status = config_template(path, cfg, &tok->chat_template);
        cJSON_Delete(cfg);
        if (status != LLMEM_OK)
            return status;
    }
    /* chat_template.jinja wins over the config's template, as in transformers. */
    if ((status = llmem_path_join(path, sizeof(path), model_dir, "chat_template.jinja")) != 0)
        return status;
    if (file_exists(path)) {
        char *text = NULL;
        size_t len = 0;
        if ((status = llmem_file_read(path, CFG_MAX_BYTES, &text, &len)) != LLMEM_OK)
            return status;
        free(tok->chat_template);
        tok->chat_template = text;
    }
    tok->bos_id =
        tok->bos_text ? llmem_tok_piece_id(tok, tok->bos_text, strlen(tok->bos_text)) : -1;
    tok->eos_id =
        tok->eos_text ? llmem_tok_piece_id(tok, tok->eos_text, strlen(tok->eos_text)) : -1;
    return LLMEM_OK;
}

/* ---- public --------------------------------------------------------------------------------- */

int llmem_tokenizer_load(const char *model_dir, struct llmem_tokenizer **out) {
    LLMEM_ASSERT(model_dir != NULL && out != NULL);
    *out = NULL;
    if (llmem_gguf_is_gguf(model_dir))
        return llmem_tok_load_gguf(model_dir, out);
    char path[PATH_MAX_LEN];
    int status = llmem_path_join(path, sizeof(path), model_dir, "tokenizer.json");
    if (status != LLMEM_OK)
        return status;
    struct llmem_tokenizer *tok = calloc(1, sizeof(*tok));
    if (tok == NULL) {
        LOAD_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    tok->unk_id = tok->bos_id = tok->eos_id = -1;
    cJSON *root = NULL;
    if ((status = llmem_json_parse_file(path, TOK_MAX_BYTES, &root)) != LLMEM_OK)
        goto out;
    struct loader l = {tok, path};
    if (!cJSON_IsObject(root)) {
        LOAD_ERROR("%s: must be a JSON object", path);
        status = LLMEM_EFORMAT;
        goto out;
    }
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    int64_t max_added_id = -1;
    if ((status = added_max_id(&l, added, &max_added_id)) != LLMEM_OK ||
        (status = load_model(&l, root, max_added_id)) != LLMEM_OK ||
        (status = load_added(&l, added)) != LLMEM_OK ||
        (status = add_norm(&l, cJSON_GetObjectItemCaseSensitive(root, "normalizer"), "normalizer",
                           0)) != LLMEM_OK ||
        (status = add_pre(&l, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"),
                          "pre_tokenizer", 0)) != LLMEM_OK ||
        (status = add_dec(&l, cJSON_GetObjectItemCaseSensitive(root, "decoder"), "decoder", 0)) !=
            LLMEM_OK ||
        (status = load_config(tok, model_dir)) != LLMEM_OK)
        goto out;
    *out = tok;
    tok = NULL;
out:
    cJSON_Delete(root);
    llmem_tokenizer_free(tok);
    return status;
}

void llmem_tokenizer_free(struct llmem_tokenizer *tok) {
    if (tok == NULL)
        return;
    for (int32_t i = 0; tok->pieces != NULL && i < tok->n_vocab; i++)
        free(tok->pieces[i].p);
    free(tok->pieces);
    free(tok->kind);
    free(tok->added_of);
    llmem_tok_strmap_free(&tok->vocab);
    llmem_tok_mergemap_free(&tok->merges);
    for (int i = 0; i < tok->n_added; i++)
        free(tok->added[i].content.p);
    free(tok->added);
    for (int b = 0; b < 256; b++)
        free(tok->added_by_byte[b]);
    for (int i = 0; i < tok->n_norms; i++) {
        free(tok->norms[i].a.p);
        free(tok->norms[i].b.p);
    }
    free(tok->norms);
    for (int i = 0; i < tok->n_pres; i++) {
        if (tok->pres[i].re != NULL)
            pcre2_code_free(tok->pres[i].re);
        free(tok->pres[i].repl.p);
    }
    free(tok->pres);
    for (int i = 0; i < tok->n_decs; i++) {
        free(tok->decs[i].a.p);
        free(tok->decs[i].b.p);
    }
    free(tok->decs);
    free(tok->bos_text);
    free(tok->eos_text);
    free(tok->chat_template);
    free(tok->score_rank);
    free(tok);
}

/* ---- shared with tok/vocab.c ---------------------------------------------------------------- */

static int cmp_added_len(const void *pa, const void *pb, void *ctx) {
    const struct tok_added *added = ctx;
    size_t na = added[*(const int32_t *)pa].content.n, nb = added[*(const int32_t *)pb].content.n;
    return na < nb ? 1 : na > nb ? -1 : 0;
}

int llmem_tok_index_added(struct llmem_tokenizer *tok) {
    tok->max_token_bytes = 1;
    for (int32_t i = 0; tok->pieces != NULL && i < tok->n_vocab; i++)
        if (tok->pieces[i].n > tok->max_token_bytes)
            tok->max_token_bytes = tok->pieces[i].n;
    for (int i = 0; i < tok->n_added; i++)
        if (tok->added[i].content.n > tok->max_token_bytes)
            tok->max_token_bytes = tok->added[i].content.n;
    int counts[256] = {0};
    for (int i = 0; i < tok->n_added; i++)
        counts[(unsigned char)tok->added[i].content.p[0]]++;
    /* Per first byte, the candidates longest first: the first that matches is the longest. */
    for (int b = 0; b < 256; b++) {
        if (counts[b] == 0)
            continue;
        int32_t *list = malloc(((size_t)counts[b] + 1) * sizeof(*list));
        if (list == NULL)
            return LLMEM_ENOMEM;
        int k = 0;
        for (int i = 0; i < tok->n_added; i++)
            if ((unsigned char)tok->added[i].content.p[0] == b)
                list[k++] = i;
        qsort_r(list, (size_t)k, sizeof(*list), cmp_added_len, tok->added);
        list[k] = -1;
        tok->added_by_byte[b] = list;
    }
    return LLMEM_OK;
}

void llmem_tok_index_bytes(struct llmem_tokenizer *tok) {
    for (unsigned b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof(name), "<0x%02X>", b);
        tok->byte_ids[b] = llmem_tok_strmap_get(&tok->vocab, name, 6);
        char ch[2];
        uint32_t cp = llmem_tok_byte_cp(b); /* below U+0800: one or two bytes of UTF-8 */
        size_t n = 1;
        if (cp < 0x80) {
            ch[0] = (char)cp;
        } else {
            ch[0] = (char)(0xC0 | (cp >> 6)), ch[1] = (char)(0x80 | (cp & 0x3F));
            n = 2;
        }
        tok->bytelevel_ids[b] = llmem_tok_strmap_get(&tok->vocab, ch, n);
    }
}

int llmem_tok_merge_add(struct llmem_tokenizer *tok, const char *a, size_t na, const char *b,
                        size_t nb, int32_t rank, struct tok_buf *joined) {
    joined->n = 0;
    if (llmem_tok_buf_add(joined, a, na) != LLMEM_OK || llmem_tok_buf_add(joined, b, nb) != 0)
        return LLMEM_ENOMEM;
    int32_t ia = llmem_tok_strmap_get(&tok->vocab, a, na);
    int32_t ib = llmem_tok_strmap_get(&tok->vocab, b, nb);
    int32_t ij = llmem_tok_strmap_get(&tok->vocab, joined->p, joined->n);
    if (ia < 0 || ib < 0 || ij < 0)
        return LLMEM_ENOENT;
    llmem_tok_mergemap_put(&tok->merges, ia, ib, rank, ij);
    return LLMEM_OK;
}

/* ---- lookups -------------------------------------------------------------------------------- */

int32_t llmem_tok_piece_id(const struct llmem_tokenizer *tok, const char *s, size_t n) {
    for (int i = 0; i < tok->n_added; i++)
        if (tok->added[i].content.n == n && memcmp(tok->added[i].content.p, s, n) == 0)
            return tok->added[i].id;
    return llmem_tok_strmap_get(&tok->vocab, s, n);
}

int32_t llmem_tokenizer_vocab_size(const struct llmem_tokenizer *tok) {
    return tok->n_vocab;
}

int32_t llmem_tokenizer_bos(const struct llmem_tokenizer *tok) {
    return tok->bos_id;
}

int32_t llmem_tokenizer_eos(const struct llmem_tokenizer *tok) {
    return tok->eos_id;
}

int32_t llmem_tokenizer_token_id(const struct llmem_tokenizer *tok, const char *piece) {
    LLMEM_ASSERT(tok != NULL && piece != NULL);
    return llmem_tok_piece_id(tok, piece, strlen(piece));
}

int llmem_tokenizer_is_special(const struct llmem_tokenizer *tok, int32_t id) {
    return id >= 0 && id < tok->n_vocab && tok->kind[id] == TOK_KIND_SPECIAL;
}
