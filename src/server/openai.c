/*
 * server/openai.c — the OpenAI API as this server speaks it: a request body checked field by
 * field into generation parameters, and the response shapes (completion, chat completion, their
 * streaming chunks, usage, the model list, the error object).
 *
 * Validation is strict about what would otherwise be silently wrong: a field of the wrong type,
 * a value out of its range, a parameter this engine does not implement (n > 1, echo, tools) is a
 * 400 naming the field; fields it does not know are ignored, as OpenAI's clients send some by
 * default. Defaults follow OpenAI: max_tokens 16 for completions, up to the context for chat;
 * temperature 1 when absent (0 is greedy); top_p 1; presence and frequency penalties in [−2, 2],
 * repetition_penalty (vLLM's) above 0, logit_bias by token id in [−100, 100].
 */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/json.h"
#include "core/rng.h"
#include "server/server_int.h"

/* ---- text ------------------------------------------------------------------------------------ */

static int buf_reserve(struct srv_buf *b, size_t more) {
    if (b->failed)
        return -1;
    if (b->len + more + 1 <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + more + 1)
        cap *= 2;
    char *d = realloc(b->data, cap);
    if (d == NULL) {
        b->failed = 1;
        return -1;
    }
    b->data = d;
    b->cap = cap;
    return 0;
}

void llmem_srv_buf_append(struct srv_buf *b, const char *s, size_t n) {
    if (buf_reserve(b, n) != 0)
        return;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

void llmem_srv_buf_printf(struct srv_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || buf_reserve(b, (size_t)n) != 0)
        return;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void llmem_srv_buf_free(struct srv_buf *b) {
    free(b->data);
    memset(b, 0, sizeof(*b));
}

int llmem_srv_utf8_valid(const char *str, size_t n) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        unsigned cp, min;
        if ((c & 0xE0) == 0xC0)
            len = 2, cp = c & 0x1F, min = 0x80;
        else if ((c & 0xF0) == 0xE0)
            len = 3, cp = c & 0x0F, min = 0x800;
        else if ((c & 0xF8) == 0xF0)
            len = 4, cp = c & 0x07, min = 0x10000;
        else
            return 0;
        if (i + len > n)
            return 0;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80)
                return 0;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        i += len;
    }
    return 1;
}

/* ---- errors ---------------------------------------------------------------------------------- */

static int vfail(struct srv_error *e, int http, const char *type, const char *param,
                 const char *code, const char *fmt, va_list ap) {
    e->http = http;
    e->type = type;
    e->param = param;
    e->code = code;
    vsnprintf(e->message, sizeof(e->message), fmt, ap);
    return -1;
}

int llmem_srv_fail(struct srv_error *e, int http, const char *type, const char *param,
                   const char *code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail(e, http, type, param, code, fmt, ap);
    va_end(ap);
    return -1;
}

/* A 400 invalid_request_error about `param`. */
static int bad(struct srv_error *e, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int bad(struct srv_error *e, const char *param, const char *code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail(e, 400, "invalid_request_error", param, code, fmt, ap);
    va_end(ap);
    return -1;
}

char *llmem_srv_error_json(const struct srv_error *e) {
    cJSON *root = cJSON_CreateObject();
    cJSON *o = cJSON_AddObjectToObject(root, "error");
    char *text = NULL;
    if (o != NULL && llmem_json_add_string(o, "message", e->message) == 0 &&
        llmem_json_add_string(o, "type", e->type != NULL ? e->type : "server_error") == 0 &&
        (e->param != NULL ? llmem_json_add_string(o, "param", e->param)
                          : llmem_json_add_null(o, "param")) == 0 &&
        (e->code != NULL ? llmem_json_add_string(o, "code", e->code)
                         : llmem_json_add_null(o, "code")) == 0)
        text = llmem_json_print(root, 0);
    cJSON_Delete(root);
    return text;
}

/* ---- typed fields ---------------------------------------------------------------------------- */

/* Each returns 0 when the key is absent or null, 1 with the value, -1 with err filled. */

static int field_int(const cJSON *o, const char *key, int64_t *v, struct srv_error *e) {
    switch (llmem_json_get_int(o, key, v)) {
    case LLMEM_OK: return 1;
    case LLMEM_ENOENT: return 0;
    case LLMEM_ERANGE: return bad(e, key, "invalid_value", "'%s' must be an integer", key);
    default: return bad(e, key, "invalid_type", "Invalid type for '%s': expected an integer", key);
    }
}

static int field_num(const cJSON *o, const char *key, double *v, struct srv_error *e) {
    switch (llmem_json_get_double(o, key, v)) {
    case LLMEM_OK: return 1;
    case LLMEM_ENOENT: return 0;
    default: return bad(e, key, "invalid_type", "Invalid type for '%s': expected a number", key);
    }
}

static int field_bool(const cJSON *o, const char *key, int *v, struct srv_error *e) {
    switch (llmem_json_get_bool(o, key, v)) {
    case LLMEM_OK: return 1;
    case LLMEM_ENOENT: return 0;
    default: return bad(e, key, "invalid_type", "Invalid type for '%s': expected a boolean", key);
    }
}

static int field_str(const cJSON *o, const char *key, const char **v, struct srv_error *e) {
    switch (llmem_json_get_string(o, key, v)) {
    case LLMEM_OK: return 1;
    case LLMEM_ENOENT: return 0;
    default: return bad(e, key, "invalid_type", "Invalid type for '%s': expected a string", key);
    }
}

/* A number field within [lo, hi] (lo_open: lo itself excluded). */
static int field_range(const cJSON *o, const char *key, double lo, int lo_open, double hi,
                       double *v, struct srv_error *e) {
    int got = field_num(o, key, v, e);
    if (got == 1 && (!isfinite(*v) || *v < lo || (lo_open && *v == lo) || *v > hi))
        return bad(e, key, "invalid_value", "'%s' is %g; it must be in %c%g, %g]", key, *v,
                   lo_open ? '(' : '[', lo, hi);
    return got;
}

/* ---- strings that hold a NUL ----------------------------------------------------------------- */

/* cJSON decodes "\u0000" into a NUL byte of a C string, so such a string reads short. The body's
 * strings (keys included) are measured here in document order, the order in which cJSON builds
 * its tree, and the ones longer than their C string are kept as spans. The body has parsed, so
 * its escapes are well-formed. */

static int hex4(const char *p) {
    int v = 0;
    for (int k = 0; k < 4; k++) {
        char c = p[k];
        v = v * 16 + (c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                             : c - 'A' + 10);
    }
    return v;
}

/* The decoded length of the string whose text starts at body[*at] (after the quote); *at ends
 * after its closing quote. */
static size_t string_len(const char *body, size_t len, size_t *at) {
    size_t i = *at, n = 0;
    while (i < len && body[i] != '"') {
        if (body[i] != '\\') {
            i++, n++;
            continue;
        }
        if (i + 1 < len && body[i + 1] != 'u') {
            i += 2, n++;
            continue;
        }
        if (i + 6 > len)
            break;
        int cp = hex4(body + i + 2);
        i += 6;
        if (cp >= 0xD800 && cp <= 0xDBFF && i + 6 <= len && body[i] == '\\' && body[i + 1] == 'u') {
            i += 6, n += 4; /* a surrogate pair: one 4-byte character */
            continue;
        }
        n += cp < 0x80 ? 1 : cp < 0x800 ? 2 : 3;
    }
    *at = i + 1;
    return n;
}

/* At least as many as the JSON values the body holds (its parse tree's nodes): one, and one
 * more a comma and an opening bracket or brace outside strings. */
static int64_t count_values(const char *body, size_t len) {
    int64_t n = 1;
    int in_string = 0;
    for (size_t i = 0; i < len; i++) {
        const char c = body[i];
        if (in_string) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_string = 0;
        } else {
            n += c == ',' || c == '[' || c == '{';
            in_string = c == '"';
        }
    }
    return n;
}

struct string_walk {
    const char *body;
    size_t len, at;
};

/* The next string's decoded length; -1 when the body has no more. (Outside strings only
 * structure, numbers and literals come, none with a quote.) */
static int64_t next_string(struct string_walk *w) {
    while (w->at < w->len && w->body[w->at] != '"')
        w->at++;
    if (w->at >= w->len)
        return -1;
    w->at++;
    return (int64_t)string_len(w->body, w->len, &w->at);
}

static int add_span(struct srv_request *r, const char *s, size_t n) {
    struct srv_span *sp = realloc(r->spans, (size_t)(r->n_spans + 1) * sizeof(*sp));
    if (sp == NULL)
        return -1;
    r->spans = sp;
    r->spans[r->n_spans++] = (struct srv_span){s, n};
    return 0;
}

/* Walks the tree in document order beside the body's strings. */
static int measure(const cJSON *item, struct string_walk *w, struct srv_request *r,
                   struct srv_error *e) {
    if (item->string != NULL) {
        int64_t n = next_string(w);
        if (n < 0)
            return llmem_srv_fail(e, 500, "server_error", NULL, NULL,
                                  "the request body's strings could not be measured");
        if ((size_t)n != strlen(item->string)) /* no key names anything with a NUL in it */
            return bad(e, item->string, "invalid_value", "the key \"%.64s\\u0000…\" holds U+0000",
                       item->string);
    }
    if (cJSON_IsString(item)) {
        int64_t n = next_string(w);
        size_t c = strlen(item->valuestring);
        if (n < 0 || (size_t)n < c)
            return llmem_srv_fail(e, 500, "server_error", NULL, NULL,
                                  "the request body's strings could not be measured");
        if ((size_t)n > c && add_span(r, item->valuestring, (size_t)n) != 0)
            return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    for (const cJSON *c = item->child; c != NULL; c = c->next)
        if (measure(c, w, r, e) != 0)
            return -1;
    return 0;
}

/* A string of the request with its NULs. */
static size_t str_len(const struct srv_request *r, const char *s) {
    for (int i = 0; i < r->n_spans; i++)
        if (r->spans[i].s == s)
            return r->spans[i].n;
    return strlen(s);
}

/* Whether a string of the request holds a NUL: a field that names something (a role, a model, a
 * stop string, a type) is then never read as the prefix before it. */
static int has_nul(const struct srv_request *r, const char *s) {
    return str_len(r, s) != strlen(s);
}

/* Whether a string anywhere under item holds a NUL: a schema's const, enum or pattern would be
 * compiled from its C string, cut short. */
static int tree_has_nul(const struct srv_request *r, const cJSON *item) {
    if (cJSON_IsString(item) && has_nul(r, item->valuestring))
        return 1;
    for (const cJSON *c = item->child; c != NULL; c = c->next)
        if (tree_has_nul(r, c))
            return 1;
    return 0;
}

/* How deep item nests (a scalar: 1). */
static int depth_of(const cJSON *item) {
    int d = 0;
    for (const cJSON *c = item->child; c != NULL; c = c->next) {
        const int k = depth_of(c);
        d = k > d ? k : d;
    }
    return d + 1;
}

/* ---- the prompt and the messages ------------------------------------------------------------- */

static int ids_from_array(const cJSON *arr, const struct srv_model *m, struct srv_request *r,
                          struct srv_error *e) {
    int n = cJSON_GetArraySize(arr);
    if (n == 0)
        return bad(e, "prompt", "invalid_value", "'prompt' is empty");
    r->prompt_ids = malloc((size_t)n * sizeof(int32_t));
    if (r->prompt_ids == NULL)
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    const cJSON *it = NULL;
    cJSON_ArrayForEach(it, arr) {
        int64_t v = 0;
        if (llmem_json_int(it, &v) != LLMEM_OK)
            return bad(e, "prompt", "invalid_type",
                       "'prompt' must be a string or an array of token ids (integers)");
        if (v < 0 || v >= m->vocab)
            return bad(e, "prompt", "invalid_value",
                       "token %" PRId64 " of 'prompt' is %" PRId64
                       ", outside the vocabulary (0 to %" PRId64 ")",
                       r->n_prompt_ids, v, m->vocab - 1);
        r->prompt_ids[r->n_prompt_ids++] = (int32_t)v;
    }
    return 0;
}

static int parse_prompt(const cJSON *root, const struct srv_model *m, struct srv_request *r,
                        struct srv_error *e) {
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    if (p == NULL || cJSON_IsNull(p))
        return bad(e, "prompt", "missing_required_parameter", "'prompt' is required");
    if (cJSON_IsString(p)) {
        r->prompt_text = p->valuestring;
        r->prompt_len = str_len(r, p->valuestring);
        return 0;
    }
    if (!cJSON_IsArray(p))
        return bad(e, "prompt", "invalid_type",
                   "Invalid type for 'prompt': expected a string or an array of token ids");
    const cJSON *first = cJSON_GetArrayItem(p, 0);
    if (first != NULL && (cJSON_IsString(first) || cJSON_IsArray(first))) {
        /* a batch of prompts: this server answers one prompt per request */
        if (cJSON_GetArraySize(p) != 1)
            return bad(e, "prompt", "invalid_value",
                       "'prompt' holds %d prompts; this server takes one per request",
                       cJSON_GetArraySize(p));
        if (cJSON_IsString(first)) {
            r->prompt_text = first->valuestring;
            r->prompt_len = str_len(r, first->valuestring);
            return 0;
        }
        return ids_from_array(first, m, r, e);
    }
    return ids_from_array(p, m, r, e);
}

static int own(struct srv_request *r, char *s) {
    char **o = realloc(r->owned, (size_t)(r->n_owned + 1) * sizeof(*o));
    if (o == NULL) {
        free(s);
        return -1;
    }
    r->owned = o;
    r->owned[r->n_owned++] = s;
    return 0;
}

/* A message's content: a string, or an array of {"type": "text", "text": …} parts (joined with
 * newlines); null only for an assistant. */
static int message_content(const cJSON *msg, const char *role, int i, struct srv_request *r,
                           const char **out, size_t *out_len, struct srv_error *e) {
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(msg, "content");
    *out_len = 0;
    if (c == NULL || cJSON_IsNull(c)) {
        if (strcmp(role, "assistant") == 0) {
            *out = "";
            return 0;
        }
        return bad(e, "messages", "missing_required_parameter",
                   "messages[%d] (%s) has no 'content'", i, role);
    }
    if (cJSON_IsString(c)) {
        *out = c->valuestring;
        *out_len = str_len(r, c->valuestring);
        return 0;
    }
    if (!cJSON_IsArray(c))
        return bad(e, "messages", "invalid_type",
                   "messages[%d].content must be a string or an array of text parts", i);
    struct srv_buf b = {0};
    const cJSON *part = NULL;
    int k = 0;
    cJSON_ArrayForEach(part, c) {
        const char *type = NULL, *text = NULL;
        if (!cJSON_IsObject(part) || llmem_json_get_string(part, "type", &type) != LLMEM_OK ||
            strcmp(type, "text") != 0 || has_nul(r, type) ||
            llmem_json_get_string(part, "text", &text) != LLMEM_OK) {
            llmem_srv_buf_free(&b);
            return bad(e, "messages", "invalid_value",
                       "messages[%d].content[%d] is not a text part ({\"type\": \"text\", "
                       "\"text\": …}); this server reads text only",
                       i, k);
        }
        if (k++ > 0)
            llmem_srv_buf_append(&b, "\n", 1);
        llmem_srv_buf_append(&b, text, str_len(r, text));
    }
    if (b.data == NULL)
        llmem_srv_buf_append(&b, "", 0);
    if (b.failed) {
        llmem_srv_buf_free(&b);
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    if (own(r, b.data) != 0)
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    *out = b.data;
    *out_len = b.len;
    return 0;
}

/* v as Python's json.dumps writes it (transformers' tojson: ", " and ": " between items, or
 * with indent > 0 each item on a line of its own, indented), onto b. */
static void py_json(struct srv_buf *b, const cJSON *v, int indent, int depth) {
    const int obj = cJSON_IsObject(v);
    if (!obj && !cJSON_IsArray(v)) {
        char *s = cJSON_PrintUnformatted(v);
        b->failed |= s == NULL;
        if (s != NULL)
            llmem_srv_buf_append(b, s, strlen(s));
        cJSON_free(s);
        return;
    }
    llmem_srv_buf_append(b, obj ? "{" : "[", 1);
    const cJSON *c;
    cJSON_ArrayForEach(c, v) {
        if (c != v->child)
            llmem_srv_buf_append(b, indent > 0 ? "," : ", ", indent > 0 ? 1 : 2);
        if (indent > 0)
            llmem_srv_buf_printf(b, "\n%*s", indent * (depth + 1), "");
        if (obj) {
            cJSON *key = cJSON_CreateString(c->string);
            py_json(b, key, 0, 0);
            cJSON_Delete(key);
            b->failed |= key == NULL;
            llmem_srv_buf_append(b, ": ", 2);
        }
        py_json(b, c, indent, depth + 1);
    }
    if (indent > 0 && v->child != NULL)
        llmem_srv_buf_printf(b, "\n%*s", indent * depth, "");
    llmem_srv_buf_append(b, obj ? "}" : "]", 1);
}

/* Appends a string literal. */
#define APPEND_LIT(b, text) llmem_srv_buf_append(b, text, sizeof(text) - 1)

/* A call id as Mistral's template takes it: 9 characters (the last 9 of a longer one). */
static void mistral_id(struct srv_buf *b, const char *id) {
    const size_t n = strlen(id);
    llmem_srv_buf_append(b, n > 9 ? id + n - 9 : id, n > 9 ? 9 : n);
}

/* The tool turns of a conversation as the model's family writes them. Hermes-style (Qwen2.5's
 * template): a tool's result is a user turn "<tool_response>\n…\n</tool_response>"; an
 * assistant's tool_calls follow its content as "<tool_call>\n{"name": …, "arguments": …}
 * \n</tool_call>" blocks. Llama 3.1: a tool's result is an ipython turn; an assistant's call (one
 * a message) is its whole content, {"name": …, "parameters": …}. Mistral (v0.3's template): the
 * calls are a tool_calls turn "[TOOL_CALLS] [{"name": …, "arguments": …, "id": …}, …]" (the
 * content left out), a result a tool_results turn "[TOOL_RESULTS] {"content": …, "call_id": …}
 * [/TOOL_RESULTS]", the ids 9 characters. */
static int tool_turn(const cJSON *msg, const char **role, int i, enum llmem_tool_format format,
                     struct srv_request *r, const char **content, size_t *len,
                     struct srv_error *e) {
    const cJSON *calls = cJSON_GetObjectItemCaseSensitive(msg, "tool_calls");
    const int tool = strcmp(*role, "tool") == 0;
    const int hermes = format == LLMEM_TOOL_FORMAT_HERMES,
              mistral = format == LLMEM_TOOL_FORMAT_MISTRAL;
    if (!tool && (calls == NULL || cJSON_IsNull(calls)))
        return 0;
    if (!tool && (strcmp(*role, "assistant") != 0 || !cJSON_IsArray(calls)))
        return bad(e, "messages", "invalid_value",
                   "messages[%d].tool_calls must be an array on an assistant message", i);
    const char *call_id = NULL;
    if (tool &&
        (llmem_json_get_string(msg, "tool_call_id", &call_id) != LLMEM_OK || has_nul(r, call_id)))
        return bad(e, "messages", "invalid_value",
                   "messages[%d] is a tool message without a 'tool_call_id' string", i);
    if (tool && format == LLMEM_TOOL_FORMAT_LLAMA3) {
        *role = "ipython";
        return 0;
    }
    if (format == LLMEM_TOOL_FORMAT_LLAMA3 && cJSON_GetArraySize(calls) != 1)
        return bad(e, "messages", "invalid_value",
                   "messages[%d].tool_calls holds %d calls; Llama 3 writes one a message", i,
                   cJSON_GetArraySize(calls));
    struct srv_buf b = {0};
    if (tool && mistral) {
        APPEND_LIT(&b, "[TOOL_RESULTS] {\"content\": ");
        llmem_srv_buf_append(&b, *content, *len);
        APPEND_LIT(&b, ", \"call_id\": \"");
        mistral_id(&b, call_id);
        APPEND_LIT(&b, "\"}[/TOOL_RESULTS]");
        *role = "tool_results";
    } else if (tool) {
        llmem_srv_buf_append(&b, "<tool_response>\n", 16);
        llmem_srv_buf_append(&b, *content, *len);
        llmem_srv_buf_append(&b, "\n</tool_response>", 17);
        *role = "user";
    } else {
        if (hermes)
            llmem_srv_buf_append(&b, *content, *len);
        if (mistral) {
            APPEND_LIT(&b, "[TOOL_CALLS] [");
            *role = "tool_calls";
        }
        const cJSON *c;
        cJSON_ArrayForEach(c, calls) {
            const cJSON *f = cJSON_GetObjectItemCaseSensitive(c, "function");
            const char *name = NULL, *args = NULL;
            if (!cJSON_IsObject(f) || llmem_json_get_string(f, "name", &name) != LLMEM_OK ||
                llmem_json_get_string(f, "arguments", &args) != LLMEM_OK) {
                llmem_srv_buf_free(&b);
                return bad(e, "messages", "invalid_value",
                           "messages[%d].tool_calls holds a call without a function's name and "
                           "arguments",
                           i);
            }
            const char *id = "";
            if (mistral && llmem_json_get_string(c, "id", &id) != LLMEM_OK) {
                llmem_srv_buf_free(&b);
                return bad(e, "messages", "invalid_value",
                           "messages[%d].tool_calls holds a call without an 'id' string", i);
            }
            cJSON *call = cJSON_CreateObject(), *a = cJSON_Parse(args);
            const char *key = hermes || mistral ? "arguments" : "parameters";
            int ok = call != NULL && llmem_json_add_string(call, "name", name) == 0;
            if (ok && a != NULL)
                cJSON_AddItemToObject(call, key, a), a = NULL;
            else if (ok)
                ok = llmem_json_add_string(call, key, args) == 0;
            if (hermes && b.len > 0)
                llmem_srv_buf_append(&b, "\n", 1);
            if (hermes)
                llmem_srv_buf_append(&b, "<tool_call>\n", 12);
            if (mistral && c != calls->child)
                llmem_srv_buf_append(&b, ", ", 2);
            const size_t at = b.len;
            if (ok)
                py_json(&b, call, 0, 0);
            if (mistral && ok && !b.failed && b.len > at) { /* the object with its id last */
                b.len--;
                APPEND_LIT(&b, ", \"id\": \"");
                mistral_id(&b, id);
                APPEND_LIT(&b, "\"}");
            }
            if (hermes)
                llmem_srv_buf_append(&b, "\n</tool_call>", 13);
            cJSON_Delete(call), cJSON_Delete(a);
            if (!ok) {
                llmem_srv_buf_free(&b);
                return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
            }
        }
        if (mistral)
            APPEND_LIT(&b, "]");
    }
    if (b.failed || b.data == NULL) {
        llmem_srv_buf_free(&b);
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    if (own(r, b.data) != 0) /* (which frees it) */
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    *content = b.data;
    *len = b.len;
    return 0;
}

static int parse_messages(const cJSON *root, const struct srv_model *m, struct srv_request *r,
                          struct srv_error *e) {
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(root, "messages");
    if (msgs == NULL || cJSON_IsNull(msgs))
        return bad(e, "messages", "missing_required_parameter", "'messages' is required");
    if (!cJSON_IsArray(msgs))
        return bad(e, "messages", "invalid_type",
                   "Invalid type for 'messages': expected an array of messages");
    int n = cJSON_GetArraySize(msgs);
    if (n == 0)
        return bad(e, "messages", "invalid_value", "'messages' is empty");
    if (n > SRV_MAX_MESSAGES)
        return bad(e, "messages", "invalid_value", "'messages' holds %d messages; at most %d", n,
                   SRV_MAX_MESSAGES);
    r->messages = calloc((size_t)n, sizeof(*r->messages));
    if (r->messages == NULL)
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    const cJSON *msg = NULL;
    cJSON_ArrayForEach(msg, msgs) {
        int i = r->n_messages;
        const char *role = NULL;
        if (!cJSON_IsObject(msg))
            return bad(e, "messages", "invalid_type", "messages[%d] is not an object", i);
        if (llmem_json_get_string(msg, "role", &role) != LLMEM_OK)
            return bad(e, "messages", "invalid_value", "messages[%d] has no 'role' string", i);
        if (has_nul(r, role))
            return bad(e, "messages", "invalid_value",
                       "messages[%d] has a role holding a NUL (\\u0000); this server takes "
                       "system, user and assistant messages",
                       i);
        if (strcmp(role, "developer") == 0)
            role = "system"; /* OpenAI's newer name for the system message */
        if (strcmp(role, "system") != 0 && strcmp(role, "user") != 0 &&
            strcmp(role, "assistant") != 0 && strcmp(role, "tool") != 0)
            return bad(e, "messages", "invalid_value",
                       "messages[%d] has role '%s'; this server takes system, user, assistant "
                       "and tool messages",
                       i, role);
        const char *content = NULL;
        size_t content_len = 0;
        if (message_content(msg, role, i, r, &content, &content_len, e) != 0 ||
            tool_turn(msg, &role, i, m->tool_format, r, &content, &content_len, e) != 0)
            return -1;
        r->messages[r->n_messages++] = (struct llmem_chat_message){role, content, content_len};
    }
    return 0;
}

/* ---- tools ----------------------------------------------------------------------------------- */

static const char tools_head[] =
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\n<tools>";
static const char tools_tail[] =
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>";

/* Llama 3.1's: the system header names the environment and the dates, and the tools go into the
 * first user message with the instruction to answer a call as JSON. */
static const char llama3_system_head[] =
    "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";
static const char llama3_tools_head[] =
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\nRespond in the format {\"name\": "
    "function name, \"parameters\": dictionary of argument name and its value}.Do not use "
    "variables.\n\n";

/* A message's content replaced by b's (owned by r), or 500 when b failed. */
static int set_content(struct srv_request *r, struct llmem_chat_message *m, struct srv_buf *b,
                       struct srv_error *e) {
    if (b->failed || b->data == NULL) {
        llmem_srv_buf_free(b);
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    if (own(r, b->data) != 0) /* (which frees it) */
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    m->content = b->data, m->content_len = b->len;
    return 0;
}

/* The tools as Llama 3.1's template writes them: the system message (made when there is none)
 * opens with the environment and the dates; the first user message after it with the
 * instruction and each tool as indented JSON. */
static int render_tools_llama3(const cJSON *tools, struct srv_request *r, struct srv_error *e) {
    const int sys = r->n_messages > 0 && strcmp(r->messages[0].role, "system") == 0;
    if (r->n_messages <= sys || strcmp(r->messages[sys].role, "user") != 0)
        return bad(e, "messages", "invalid_value",
                   "Llama 3 puts the tools in the first user message: messages[%d] must be a "
                   "user message",
                   sys);
    struct llmem_chat_message *msgs =
        sys ? r->messages : realloc(r->messages, (size_t)(r->n_messages + 1) * sizeof(*msgs));
    if (msgs == NULL)
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    r->messages = msgs;
    if (!sys) {
        memmove(msgs + 1, msgs, (size_t)r->n_messages * sizeof(*msgs));
        r->n_messages++;
        msgs[0] = (struct llmem_chat_message){"system", "", 0};
    }
    struct srv_buf b = {0};
    llmem_srv_buf_append(&b, llama3_system_head, sizeof(llama3_system_head) - 1);
    llmem_srv_buf_append(&b, msgs[0].content, msgs[0].content_len);
    if (set_content(r, &msgs[0], &b, e) != 0)
        return -1;
    b = (struct srv_buf){0};
    llmem_srv_buf_append(&b, llama3_tools_head, sizeof(llama3_tools_head) - 1);
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        py_json(&b, t, 4, 0);
        llmem_srv_buf_append(&b, "\n\n", 2);
    }
    llmem_srv_buf_append(&b, msgs[1].content, msgs[1].content_len);
    return set_content(r, &msgs[1], &b, e);
}

/* The tools as Mistral v0.3's template writes them: "[AVAILABLE_TOOLS] [" then each tool as
 * {"type": "function", "function": {…}} with the function's members in their order (a string
 * member as "key": "value", unescaped, as the template writes it; "return" left out), then
 * "][/AVAILABLE_TOOLS]" — an available_tools turn before the last user message (and before any
 * earlier one equal to it, as the template compares them). */
static int render_tools_mistral(const cJSON *tools, struct srv_request *r, struct srv_error *e) {
    int last = -1, n_at = 0;
    for (int i = 0; i < r->n_messages; i++)
        if (strcmp(r->messages[i].role, "user") == 0)
            last = i;
    if (last < 0)
        return 0; /* (no user message: the template writes no tools) */
    const struct llmem_chat_message *lu = &r->messages[last];
    char *at = calloc((size_t)r->n_messages, 1); /* the user messages equal to the last */
    if (at == NULL)
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    for (int i = 0; i <= last; i++) {
        const struct llmem_chat_message *m = &r->messages[i];
        at[i] = strcmp(m->role, "user") == 0 && m->content_len == lu->content_len &&
                memcmp(m->content, lu->content, lu->content_len) == 0;
        n_at += at[i];
    }
    struct srv_buf b = {0};
    APPEND_LIT(&b, "[AVAILABLE_TOOLS] [");
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        if (t != tools->child)
            llmem_srv_buf_append(&b, ", ", 2);
        APPEND_LIT(&b, "{\"type\": \"function\", \"function\": {");
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(t, "function"), *v;
        int k = 0;
        cJSON_ArrayForEach(v, f) {
            if (strcmp(v->string, "return") == 0)
                continue;
            llmem_srv_buf_printf(&b, "%s\"%s\": ", k++ > 0 ? ", " : "", v->string);
            if (cJSON_IsString(v))
                llmem_srv_buf_printf(&b, "\"%s\"", v->valuestring);
            else
                py_json(&b, v, 0, 0);
        }
        APPEND_LIT(&b, "}}");
    }
    APPEND_LIT(&b, "][/AVAILABLE_TOOLS]");
    struct llmem_chat_message *out = malloc((size_t)(r->n_messages + n_at) * sizeof(*out));
    if (b.failed || b.data == NULL || out == NULL) {
        llmem_srv_buf_free(&b), free(out), free(at);
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    if (own(r, b.data) != 0) { /* (which frees it) */
        free(out), free(at);
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    int k = 0;
    for (int i = 0; i < r->n_messages; i++) {
        if (at[i])
            out[k++] = (struct llmem_chat_message){"available_tools", b.data, b.len};
        out[k++] = r->messages[i];
    }
    free(at);
    free(r->messages);
    r->messages = out;
    r->n_messages = k;
    return 0;
}

/* The tools' signatures into the system message (the first, or one made first), as Qwen2.5's
 * template writes them. */
static int render_tools(const cJSON *tools, struct srv_request *r, struct srv_error *e) {
    struct srv_buf b = {0};
    const int sys = r->n_messages > 0 && strcmp(r->messages[0].role, "system") == 0;
    if (sys) {
        const size_t len = r->messages[0].content_len; /* (parse_messages sets every length) */
        if (len > 0 && len < ((size_t)1 << 40))
            llmem_srv_buf_append(&b, r->messages[0].content, len);
        llmem_srv_buf_append(&b, "\n\n", 2);
    }
    llmem_srv_buf_append(&b, tools_head, sizeof(tools_head) - 1);
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        llmem_srv_buf_append(&b, "\n", 1);
        py_json(&b, t, 0, 0);
    }
    llmem_srv_buf_append(&b, tools_tail, sizeof(tools_tail) - 1);
    struct llmem_chat_message *msgs =
        sys ? r->messages : realloc(r->messages, (size_t)(r->n_messages + 1) * sizeof(*msgs));
    if (b.failed || msgs == NULL) {
        llmem_srv_buf_free(&b);
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    r->messages = msgs;
    if (own(r, b.data) != 0)
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    if (!sys) {
        memmove(msgs + 1, msgs, (size_t)r->n_messages * sizeof(*msgs));
        r->n_messages++;
    }
    msgs[0] = (struct llmem_chat_message){"system", b.data, b.len};
    return 0;
}

/* tools, tool_choice and parallel_tool_calls (chat): the functions checked (a name each, their
 * parameters a schema the grammar compiles), rendered into the system message unless the choice
 * is none; a required or named call is generated under the tools' grammar. */
static int parse_tools(const cJSON *root, const struct srv_model *m, struct srv_request *r,
                       struct srv_error *e) {
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(root, "tools");
    const cJSON *choice = cJSON_GetObjectItemCaseSensitive(root, "tool_choice");
    int parallel = 1;
    if (field_bool(root, "parallel_tool_calls", &parallel, e) < 0)
        return -1;
    const int n = cJSON_IsArray(tools) ? cJSON_GetArraySize(tools) : 0;
    if (tools != NULL && !cJSON_IsNull(tools) && !cJSON_IsArray(tools))
        return bad(e, "tools", "invalid_type", "Invalid type for 'tools': expected an array");
    const char *mode = "auto", *named = NULL;
    if (choice != NULL && !cJSON_IsNull(choice)) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(choice, "function");
        if (cJSON_IsString(choice) && !has_nul(r, choice->valuestring) &&
            (strcmp(choice->valuestring, "none") == 0 || strcmp(choice->valuestring, "auto") == 0 ||
             strcmp(choice->valuestring, "required") == 0))
            mode = choice->valuestring;
        else if (cJSON_IsObject(choice) && llmem_json_get_string(f, "name", &named) == LLMEM_OK &&
                 !has_nul(r, named))
            mode = "named";
        else
            return bad(e, "tool_choice", "invalid_value",
                       "'tool_choice' must be none, auto, required or {\"type\": \"function\", "
                       "\"function\": {\"name\": …}}");
    }
    if (n == 0) {
        if (strcmp(mode, "required") == 0 || named != NULL)
            return bad(e, "tool_choice", "invalid_value", "'tool_choice' needs 'tools'");
        return 0;
    }
    if (r->kind != SRV_CHAT)
        return bad(e, "tools", "unsupported_value", "'tools' need /v1/chat/completions");
    if (!m->tools)
        return bad(e, "tools", "unsupported_value",
                   "'tools' need a chat template with a tool-call convention (chatml, "
                   "llama3 or mistral with [TOOL_CALLS]); this model's has none llmem knows");
    if (n > LLMEM_GRAMMAR_MAX_TOOLS)
        return bad(e, "tools", "invalid_value", "'tools' holds %d functions; at most %d", n,
                   LLMEM_GRAMMAR_MAX_TOOLS);
    struct llmem_grammar_tool gt[LLMEM_GRAMMAR_MAX_TOOLS];
    char *texts[LLMEM_GRAMMAR_MAX_TOOLS] = {NULL};
    int k = 0, found = named == NULL, status = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *params = cJSON_GetObjectItemCaseSensitive(f, "parameters");
        const char *type = NULL, *name = NULL;
        if (!cJSON_IsObject(t) || llmem_json_get_string(t, "type", &type) != LLMEM_OK ||
            strcmp(type, "function") != 0 || !cJSON_IsObject(f) ||
            llmem_json_get_string(f, "name", &name) != LLMEM_OK || *name == '\0' ||
            has_nul(r, name) || strlen(name) > 64 || (params != NULL && !cJSON_IsObject(params))) {
            status = bad(e, "tools", "invalid_value",
                         "tools[%d] is not {\"type\": \"function\", \"function\": {\"name\": …, "
                         "\"parameters\": {…}}} with a name of 1 to 64 characters",
                         k);
            break;
        }
        for (int i = 0; i < k && status == 0; i++)
            if (strcmp(gt[i].name, name) == 0)
                status = bad(e, "tools", "invalid_value",
                             "tools[%d] and tools[%d] are both named '%s'; a name must be unique",
                             i, k, name);
        if (status == 0 && depth_of(t) > SRV_MAX_TOOL_DEPTH) /* (rendered indented: depth²) */
            status = bad(e, "tools", "invalid_value", "tools[%d] nests %d levels deep; at most %d",
                         k, depth_of(t), SRV_MAX_TOOL_DEPTH);
        if (status == 0 && params != NULL && tree_has_nul(r, params))
            status = bad(e, "tools", "invalid_value",
                         "tools[%d]'s parameters hold a string with U+0000 (\\u0000), which "
                         "they cannot constrain to",
                         k);
        if (status != 0)
            break;
        const int take = named == NULL || strcmp(named, name) == 0;
        found |= take;
        gt[k] = (struct llmem_grammar_tool){name, NULL, 0};
        r->tool_names[k] = name;
        if (!take) {
            k++;
            continue;
        }
        texts[k] = params != NULL ? cJSON_PrintUnformatted(params) : NULL;
        if (params != NULL && texts[k] == NULL) {
            status = llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
            break;
        }
        gt[k] = (struct llmem_grammar_tool){name, texts[k], texts[k] ? strlen(texts[k]) : 0};
        k++;
    }
    /* the tools taken (all, or the named one), packed */
    int taken = 0;
    for (int i = 0; status == 0 && i < k; i++)
        if (named == NULL || strcmp(gt[i].name, named) == 0)
            gt[taken++] = gt[i];
    if (status == 0 && !found)
        status = bad(e, "tool_choice", "invalid_value",
                     "'tool_choice' names function '%.64s', which is not among the tools", named);
    char why[256];
    int st = LLMEM_OK;
    /* the calls under the tools' grammar: the whole output where one is required; in auto from
     * the convention's marker on (the text before it free), and for Hermes-style calls again
     * after each one closes */
    if (status == 0 && strcmp(mode, "none") != 0) {
        if (r->grammar != NULL)
            status = bad(e, "response_format", "invalid_value",
                         "'response_format' and tool calls cannot both constrain the output "
                         "(leave one out, or give tool_choice none)");
        else if ((st = llmem_grammar_compile_tools(gt, taken, m->tool_format, why, sizeof(why),
                                                   &r->grammar)) == LLMEM_ENOMEM)
            status = llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
        else if (st != LLMEM_OK)
            status = bad(e, "tools", "invalid_value", "a tool's parameters are not supported: %s",
                         why);
        r->sampling.grammar = r->grammar;
        if (status == 0 && strcmp(mode, "auto") == 0) {
            const enum llmem_tool_format f = m->tool_format;
            r->sampling.grammar_trigger = f == LLMEM_TOOL_FORMAT_HERMES    ? "<tool_call>"
                                          : f == LLMEM_TOOL_FORMAT_MISTRAL ? "[TOOL_CALLS]"
                                                                           : "{";
            r->sampling.trigger_at_start = f == LLMEM_TOOL_FORMAT_LLAMA3;
            r->sampling.rearm = f == LLMEM_TOOL_FORMAT_HERMES;
        }
    }
    for (int i = 0; i < LLMEM_GRAMMAR_MAX_TOOLS; i++)
        cJSON_free(texts[i]);
    if (status != 0 || strcmp(mode, "none") == 0)
        return status;
    r->n_tools = n;
    r->tool_mode = strcmp(mode, "auto") == 0 ? SRV_TOOLS_AUTO : SRV_TOOLS_REQUIRED;
    (void)parallel; /* one call or more may come in auto; a forced call is one */
    return m->tool_format == LLMEM_TOOL_FORMAT_LLAMA3    ? render_tools_llama3(tools, r, e)
           : m->tool_format == LLMEM_TOOL_FORMAT_MISTRAL ? render_tools_mistral(tools, r, e)
                                                         : render_tools(tools, r, e);
}

/* ---- the request ----------------------------------------------------------------------------- */

/* Fields this engine does not implement: allowed only at their neutral values. */
static int unsupported(const cJSON *root, const struct srv_request *r, struct srv_error *e) {
    int v = 0;
    int64_t i = 0;
    const char *s = NULL;
    int got;
    if ((got = field_bool(root, "echo", &v, e)) < 0)
        return -1;
    if (got && v)
        return bad(e, "echo", "unsupported_value", "'echo' is not supported");
    if ((got = field_int(root, "best_of", &i, e)) < 0)
        return -1;
    if (got && i != 1)
        return bad(e, "best_of", "unsupported_value", "'best_of' must be 1 on this server");
    if ((got = field_str(root, "suffix", &s, e)) < 0)
        return -1;
    if (got && (*s || has_nul(r, s)))
        return bad(e, "suffix", "unsupported_value", "'suffix' is not supported");
    return 0;
}

/* response_format: {"type": "text"}, {"type": "json_object"} (any JSON object) or
 * {"type": "json_schema", "json_schema": {"name": …, "schema": {…}, "strict": …}}: the output
 * constrained to the schema (llmem/grammar.h), compiled here. */
static int parse_response_format(const cJSON *root, struct srv_request *r, struct srv_error *e) {
    const cJSON *rf = cJSON_GetObjectItemCaseSensitive(root, "response_format");
    if (rf == NULL || cJSON_IsNull(rf))
        return 0;
    const char *type = NULL;
    if (!cJSON_IsObject(rf) || llmem_json_get_string(rf, "type", &type) != LLMEM_OK ||
        has_nul(r, type))
        return bad(e, "response_format", "invalid_type",
                   "'response_format' must be an object with a 'type'");
    if (strcmp(type, "text") == 0)
        return 0;
    char why[256], *text = NULL;
    int status;
    if (strcmp(type, "json_object") == 0) {
        status = llmem_grammar_compile(NULL, 0, why, sizeof(why), &r->grammar);
    } else if (strcmp(type, "json_schema") == 0) {
        const cJSON *js = cJSON_GetObjectItemCaseSensitive(rf, "json_schema");
        const cJSON *schema = cJSON_GetObjectItemCaseSensitive(js, "schema");
        if (!cJSON_IsObject(js) || schema == NULL)
            return bad(e, "response_format", "invalid_value",
                       "'response_format.json_schema.schema' is missing");
        if (tree_has_nul(r, schema))
            return bad(e, "response_format", "invalid_value",
                       "the schema holds a string with U+0000 (\\u0000), which it cannot "
                       "constrain to");
        if ((text = cJSON_PrintUnformatted(schema)) == NULL)
            return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
        status = llmem_grammar_compile(text, strlen(text), why, sizeof(why), &r->grammar);
        cJSON_free(text);
    } else {
        return bad(e, "response_format", "invalid_value",
                   "'response_format.type' is '%.40s'; it must be text, json_object or "
                   "json_schema",
                   type);
    }
    if (status == LLMEM_ENOMEM)
        return llmem_srv_fail(e, 500, "server_error", NULL, NULL, "out of memory");
    if (status != LLMEM_OK)
        return bad(e, "response_format", "invalid_value", "the schema is not supported: %s", why);
    r->sampling.grammar = r->grammar;
    return 0;
}

/* Stop strings are matched as C strings in text that never holds a NUL (the detokenizer's pieces
 * are C strings), so one with a NUL could never match as given: refused rather than cut short. */
static int stop_nul(struct srv_error *e) {
    return bad(e, "stop", "invalid_value",
               "a 'stop' string holds a NUL (\\u0000); stop strings cannot contain one");
}

static int parse_stop(const cJSON *root, struct srv_request *r, struct srv_error *e) {
    const cJSON *stop = cJSON_GetObjectItemCaseSensitive(root, "stop");
    if (stop == NULL || cJSON_IsNull(stop))
        return 0;
    if (cJSON_IsString(stop)) {
        if (has_nul(r, stop->valuestring))
            return stop_nul(e);
        if (*stop->valuestring)
            r->stop[r->n_stop++] = stop->valuestring;
        return 0;
    }
    if (!cJSON_IsArray(stop))
        return bad(e, "stop", "invalid_type",
                   "Invalid type for 'stop': expected a string or an array of strings");
    if (cJSON_GetArraySize(stop) > SRV_MAX_STOP)
        return bad(e, "stop", "invalid_value", "'stop' holds %d strings; at most %d",
                   cJSON_GetArraySize(stop), SRV_MAX_STOP);
    const cJSON *s = NULL;
    cJSON_ArrayForEach(s, stop) {
        if (!cJSON_IsString(s))
            return bad(e, "stop", "invalid_type",
                       "Invalid type for 'stop': expected a string or an array of strings");
        if (has_nul(r, s->valuestring))
            return stop_nul(e);
        if (*s->valuestring)
            r->stop[r->n_stop++] = s->valuestring;
    }
    return 0;
}

/* logit_bias: {"token id": bias in [−100, 100], …}, at most LLMEM_MAX_LOGIT_BIAS entries. */
static int parse_logit_bias(const cJSON *root, const struct srv_model *m, struct srv_request *r,
                            struct srv_error *e) {
    const cJSON *lb = cJSON_GetObjectItemCaseSensitive(root, "logit_bias");
    if (lb == NULL || cJSON_IsNull(lb))
        return 0;
    if (!cJSON_IsObject(lb))
        return bad(e, "logit_bias", "invalid_type",
                   "Invalid type for 'logit_bias': expected an object of token ids to numbers");
    const int n = cJSON_GetArraySize(lb);
    if (n > LLMEM_MAX_LOGIT_BIAS)
        return bad(e, "logit_bias", "invalid_value", "'logit_bias' holds %d entries; at most %d",
                   n, LLMEM_MAX_LOGIT_BIAS);
    if (n == 0)
        return 0;
    if ((r->logit_bias = malloc((size_t)n * sizeof(*r->logit_bias))) == NULL)
        return llmem_srv_fail(e, 500, "server_error", NULL, "out_of_memory", "out of memory");
    const cJSON *it = NULL;
    cJSON_ArrayForEach(it, lb) {
        char *end = NULL;
        long long id = strtoll(it->string, &end, 10);
        if (it->string[0] < '0' || it->string[0] > '9' || *end != '\0' || id >= m->vocab ||
            has_nul(r, it->string))
            return bad(e, "logit_bias", "invalid_value",
                       "'logit_bias' key '%.40s' is not a token id (0 to %" PRId64 ")",
                       it->string, m->vocab - 1);
        if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble) || it->valuedouble < -100 ||
            it->valuedouble > 100)
            return bad(e, "logit_bias", "invalid_value",
                       "'logit_bias' of token %lld must be a number in [-100, 100]", id);
        r->logit_bias[r->n_logit_bias++] =
            (struct llmem_logit_bias){.id = (int32_t)id, .bias = (float)it->valuedouble};
    }
    r->sampling.logit_bias = r->logit_bias;
    r->sampling.n_logit_bias = r->n_logit_bias;
    return 0;
}

static int parse_sampling(const cJSON *root, const struct srv_model *m, struct srv_request *r,
                          struct srv_error *e) {
    struct llmem_sampling *s = &r->sampling;
    double d = 0;
    int64_t i = 0;
    int got;
    s->temperature = 1.0; /* OpenAI's default */
    if ((got = field_range(root, "temperature", 0, 0, 2, &d, e)) < 0)
        return -1;
    if (got)
        s->temperature = d;
    if ((got = field_range(root, "top_p", 0, 1, 1, &d, e)) < 0)
        return -1;
    if (got)
        s->top_p = d;
    if ((got = field_range(root, "min_p", 0, 0, 1, &d, e)) < 0)
        return -1;
    if (got)
        s->min_p = d;
    if ((got = field_int(root, "top_k", &i, e)) < 0)
        return -1;
    if (got && (i < -1 || i > INT32_MAX))
        return bad(e, "top_k", "invalid_value",
                   "'top_k' is %" PRId64 "; it must be -1 or 0 (off) or a positive count", i);
    if (got)
        s->top_k = i < 0 ? 0 : i;
    if ((got = field_int(root, "seed", &i, e)) < 0)
        return -1;
    if (got)
        s->seed = (uint64_t)i;
    r->have_seed = got;
    /* OpenAI's penalties in [−2, 2]; repetition_penalty (vLLM's, transformers') above 0 */
    if ((got = field_range(root, "presence_penalty", -2, 0, 2, &d, e)) < 0)
        return -1;
    if (got)
        s->presence_penalty = d;
    if ((got = field_range(root, "frequency_penalty", -2, 0, 2, &d, e)) < 0)
        return -1;
    if (got)
        s->frequency_penalty = d;
    if ((got = field_range(root, "repetition_penalty", 0, 1, 100, &d, e)) < 0)
        return -1;
    if (got)
        s->repetition_penalty = d;
    if (parse_response_format(root, r, e) != 0)
        return -1;
    return parse_logit_bias(root, m, r, e);
}

static int parse_logprobs(const cJSON *root, struct srv_request *r, struct srv_error *e) {
    int64_t k = 0;
    int got, on = 0;
    r->logprobs = -1;
    if (r->kind == SRV_COMPLETIONS) {
        if ((got = field_int(root, "logprobs", &k, e)) < 0)
            return -1;
        if (!got)
            return 0;
    } else {
        if ((got = field_bool(root, "logprobs", &on, e)) < 0)
            return -1;
        int have_top = field_int(root, "top_logprobs", &k, e);
        if (have_top < 0)
            return -1;
        if (have_top && !on)
            return bad(e, "top_logprobs", "invalid_value", "'top_logprobs' needs 'logprobs': true");
        if (!on)
            return 0;
        if (!have_top)
            k = 0;
    }
    const char *key = r->kind == SRV_COMPLETIONS ? "logprobs" : "top_logprobs";
    if (k < 0 || k > LLMEM_MAX_TOP_LOGPROBS)
        return bad(e, key, "invalid_value", "'%s' is %" PRId64 "; it must be in [0, %d]", key, k,
                   LLMEM_MAX_TOP_LOGPROBS);
    r->logprobs = (int)k;
    return 0;
}

int llmem_srv_request_parse(enum srv_kind kind, const char *body, size_t len,
                            const struct srv_model *m, struct srv_request *r, struct srv_error *e) {
    memset(r, 0, sizeof(*r));
    r->kind = kind;
    llmem_sampling_default(&r->sampling);
    r->logprobs = -1;
    if (!llmem_srv_utf8_valid(body, len))
        return bad(e, NULL, "invalid_encoding", "the request body is not valid UTF-8");
    const int64_t values = count_values(body, len);
    if (m->max_values > 0 && values > m->max_values)
        return bad(e, NULL, "invalid_value",
                   "the request body holds %" PRId64 " JSON values; at most %" PRId64
                   " (a prompt of as many token ids)",
                   values, m->max_values);
    char msg[256];
    if (llmem_json_parse_msg(body, len, "the request body", &r->root, msg, sizeof(msg)) != LLMEM_OK)
        return bad(e, NULL, "invalid_json", "%s", msg);
    const cJSON *root = r->root;
    if (!cJSON_IsObject(root))
        return bad(e, NULL, "invalid_json", "the request body must be a JSON object");
    struct string_walk walk = {body, len, 0};
    if (measure(root, &walk, r, e) != 0)
        return -1;

    const char *model = NULL;
    int got;
    if ((got = field_str(root, "model", &model, e)) < 0)
        return -1;
    if (got && (strcmp(model, m->name) != 0 || has_nul(r, model)))
        return llmem_srv_fail(e, 404, "invalid_request_error", "model", "model_not_found",
                              "The model '%s%s' does not exist; this server serves '%s'", model,
                              has_nul(r, model) ? "\\u0000…" : "", m->name);
    int64_t n = 1;
    if (field_int(root, "n", &n, e) < 0)
        return -1;
    const int max_n = m->max_choices > 0 && m->max_choices < SRV_MAX_N ? m->max_choices : SRV_MAX_N;
    if (n < 1 || n > max_n)
        return bad(e, "n", "invalid_value", "'n' is %" PRId64 "; it must be 1 to %d%s", n, max_n,
                   max_n < SRV_MAX_N ? " (this server's --max-queue and --max-sequences)" : "");
    r->n = (int)n;
    if (unsupported(root, r, e) != 0)
        return -1;
    if (field_bool(root, "stream", &r->stream, e) < 0)
        return -1;
    if (r->stream && r->n > 1)
        return bad(e, "n", "unsupported_value", "'n' above 1 with 'stream' is not supported");
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(root, "stream_options");
    if (so != NULL && !cJSON_IsNull(so)) {
        if (!cJSON_IsObject(so))
            return bad(e, "stream_options", "invalid_type",
                       "Invalid type for 'stream_options': expected an object");
        if (!r->stream)
            return bad(e, "stream_options", "invalid_value",
                       "'stream_options' is only allowed when 'stream' is true");
        if (field_bool(so, "include_usage", &r->include_usage, e) < 0) {
            e->param = "stream_options.include_usage";
            return -1;
        }
    }

    /* max_tokens: chat prefers max_completion_tokens */
    const char *mt_key = "max_tokens";
    int64_t mt = 0;
    got = 0;
    if (kind == SRV_CHAT && (got = field_int(root, "max_completion_tokens", &mt, e)) < 0)
        return -1;
    if (got)
        mt_key = "max_completion_tokens";
    else if ((got = field_int(root, "max_tokens", &mt, e)) < 0)
        return -1;
    if (got && mt < 1)
        return bad(e, mt_key, "invalid_value", "'%s' is %" PRId64 "; it must be at least 1", mt_key,
                   mt);
    if (got && mt > m->context)
        return bad(e, mt_key, "invalid_value",
                   "'%s' is %" PRId64 "; the context window is %" PRId64 " tokens", mt_key, mt,
                   m->context);
    r->max_tokens = got ? mt : kind == SRV_COMPLETIONS ? 16 : 0;

    if (parse_sampling(root, m, r, e) != 0 || parse_stop(root, r, e) != 0 ||
        parse_logprobs(root, r, e) != 0)
        return -1;
    if (field_bool(root, "ignore_eos", &r->ignore_eos, e) < 0)
        return -1;
    if ((kind == SRV_COMPLETIONS ? parse_prompt(root, m, r, e) : parse_messages(root, m, r, e)) !=
            0 ||
        parse_tools(root, m, r, e) != 0)
        return -1;
    /* a stop string would cut the output a grammar keeps whole (valid JSON, a complete call) */
    if (r->n_stop > 0 && r->sampling.grammar != NULL && r->sampling.grammar_trigger == NULL)
        return bad(e, "stop", "invalid_value",
                   "'stop' cannot be combined with %s: a stop string would cut the output it "
                   "keeps whole",
                   r->tool_mode == SRV_TOOLS_REQUIRED ? "a required tool call"
                                                      : "'response_format'");
    return 0;
}

void llmem_srv_request_free(struct srv_request *r) {
    if (r == NULL)
        return;
    cJSON_Delete(r->root);
    free(r->spans);
    free(r->prompt_ids);
    free(r->messages);
    free(r->logit_bias);
    llmem_grammar_free(r->grammar);
    for (int i = 0; i < r->n_owned; i++)
        free(r->owned[i]);
    free(r->owned);
    memset(r, 0, sizeof(*r));
}

int llmem_srv_check_prompt(enum srv_kind kind, int64_t n_prompt, int64_t max_tokens,
                           const struct srv_model *m, struct srv_error *e) {
    const char *param = kind == SRV_CHAT ? "messages" : "prompt";
    if (n_prompt <= 0)
        return bad(e, param, "invalid_value", "the prompt is empty (no tokens)");
    if (n_prompt >= m->context)
        return bad(e, param, "context_length_exceeded",
                   "This model's maximum context length is %" PRId64
                   " tokens; the prompt has %" PRId64
                   " tokens, which leaves no room for a completion",
                   m->context, n_prompt);
    if (max_tokens > m->context - n_prompt)
        return bad(e, "max_tokens", "context_length_exceeded",
                   "This model's maximum context length is %" PRId64 " tokens; %" PRId64
                   " in the %s and %" PRId64 " for the completion ask for %" PRId64
                   ": lower max_tokens or shorten the %s",
                   m->context, n_prompt, param, max_tokens, n_prompt + max_tokens, param);
    return 0;
}

/* ---- responses ------------------------------------------------------------------------------- */

/* A log-probability as the shortest decimal that reads back as the same float. */
static cJSON *logprob_number(float v) {
    if (!isfinite(v))
        return cJSON_CreateNull();
    char num[32];
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(num, sizeof(num), "%.*g", prec, (double)v);
        if (strtof(num, NULL) == v)
            break;
    }
    return cJSON_CreateRaw(num);
}

static int add_logprob(cJSON *o, const char *key, float v) {
    cJSON *n = logprob_number(v);
    if (n == NULL)
        return -1;
    cJSON_AddItemToObject(o, key, n);
    return 0;
}

static cJSON *new_response(const struct srv_render *r, int chunk) {
    cJSON *o = cJSON_CreateObject();
    if (o == NULL)
        return NULL;
    const char *object = r->kind == SRV_CHAT ? (chunk ? "chat.completion.chunk" : "chat.completion")
                                             : "text_completion";
    if (llmem_json_add_string(o, "id", r->id) || llmem_json_add_string(o, "object", object) ||
        llmem_json_add_int(o, "created", r->created) ||
        llmem_json_add_string(o, "model", r->model)) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

static int add_usage(cJSON *o, int64_t prompt, int64_t completion) {
    cJSON *u = cJSON_AddObjectToObject(o, "usage");
    return u == NULL || llmem_json_add_int(u, "prompt_tokens", prompt) ||
           llmem_json_add_int(u, "completion_tokens", completion) ||
           llmem_json_add_int(u, "total_tokens", prompt + completion);
}

/* OpenAI's "bytes": the token's own (a piece of a character is not its text's U+FFFD), or, where
 * the renderer has no way to them, its text's. */
static int add_bytes(cJSON *o, const struct srv_render *r, int32_t id, const char *text) {
    cJSON *arr = cJSON_AddArrayToObject(o, "bytes");
    if (arr == NULL)
        return -1;
    char raw[1024];
    size_t n_raw = 0;
    const int own = r->bytes != NULL && r->bytes(r->piece_arg, id, raw, sizeof(raw), &n_raw) == 0;
    const unsigned char *p = (const unsigned char *)(own ? raw : text);
    const size_t len = own ? n_raw : strlen(text);
    for (size_t i = 0; i < len; i++) {
        cJSON *n = cJSON_CreateNumber(p[i]);
        if (n == NULL)
            return -1;
        cJSON_AddItemToArray(arr, n);
    }
    return 0;
}

/* chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null} */
static cJSON *chat_logprobs(struct srv_render *r, const struct srv_token *toks, int64_t n) {
    cJSON *lp = cJSON_CreateObject(), *content = cJSON_AddArrayToObject(lp, "content");
    int bad_ = content == NULL || llmem_json_add_null(lp, "refusal");
    for (int64_t i = 0; !bad_ && i < n; i++) {
        cJSON *entry = cJSON_CreateObject();
        char *text = r->piece(r->piece_arg, toks[i].id);
        bad_ = entry == NULL || text == NULL;
        if (!bad_) {
            cJSON_AddItemToArray(content, entry);
            bad_ = llmem_json_add_string(entry, "token", text) ||
                   add_logprob(entry, "logprob", toks[i].logprob) ||
                   add_bytes(entry, r, toks[i].id, text);
        } else {
            cJSON_Delete(entry);
        }
        free(text);
        cJSON *top = bad_ ? NULL : cJSON_AddArrayToObject(entry, "top_logprobs");
        bad_ = bad_ || top == NULL;
        for (int k = 0; !bad_ && k < toks[i].n_top; k++) {
            cJSON *t = cJSON_CreateObject();
            char *tt = r->piece(r->piece_arg, toks[i].top_ids[k]);
            bad_ = t == NULL || tt == NULL;
            if (!bad_) {
                cJSON_AddItemToArray(top, t);
                bad_ = llmem_json_add_string(t, "token", tt) ||
                       add_logprob(t, "logprob", toks[i].top_logprobs[k]) ||
                       add_bytes(t, r, toks[i].top_ids[k], tt);
            } else {
                cJSON_Delete(t);
            }
            free(tt);
        }
    }
    if (bad_) {
        cJSON_Delete(lp);
        return NULL;
    }
    return lp;
}

/* completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"} */
static cJSON *completion_logprobs(struct srv_render *r, const struct srv_token *toks, int64_t n) {
    cJSON *lp = cJSON_CreateObject();
    cJSON *tokens = cJSON_AddArrayToObject(lp, "tokens");
    cJSON *token_lp = cJSON_AddArrayToObject(lp, "token_logprobs");
    cJSON *top = cJSON_AddArrayToObject(lp, "top_logprobs");
    cJSON *offsets = cJSON_AddArrayToObject(lp, "text_offset");
    int bad_ = tokens == NULL || token_lp == NULL || top == NULL || offsets == NULL;
    for (int64_t i = 0; !bad_ && i < n; i++) {
        char *text = r->piece(r->piece_arg, toks[i].id);
        cJSON *s = text != NULL ? cJSON_CreateString(text) : NULL;
        cJSON *l = logprob_number(toks[i].logprob);
        cJSON *off = cJSON_CreateNumber((double)r->text_offset);
        cJSON *d = cJSON_CreateObject();
        bad_ = s == NULL || l == NULL || off == NULL || d == NULL;
        if (text != NULL)
            r->text_offset += (int64_t)strlen(text);
        free(text);
        if (bad_) {
            cJSON_Delete(s), cJSON_Delete(l), cJSON_Delete(off), cJSON_Delete(d);
            break;
        }
        cJSON_AddItemToArray(tokens, s);
        cJSON_AddItemToArray(token_lp, l);
        cJSON_AddItemToArray(offsets, off);
        cJSON_AddItemToArray(top, d);
        for (int k = 0; !bad_ && k < toks[i].n_top; k++) {
            char *tt = r->piece(r->piece_arg, toks[i].top_ids[k]);
            bad_ = tt == NULL;
            if (!bad_ && cJSON_GetObjectItemCaseSensitive(d, tt) == NULL)
                bad_ = add_logprob(d, tt, toks[i].top_logprobs[k]);
            free(tt);
        }
    }
    if (bad_) {
        cJSON_Delete(lp);
        return NULL;
    }
    return lp;
}

/* One choice: index, text | message | delta, logprobs, finish_reason. */
/* One call of an answer as OpenAI's tool_calls entry (chunk: with its index k), its id drawn from
 * r->call_seed ("call_" and 16 hex digits; Mistral's 9 letters and digits, as its template takes
 * them); NULL when `call` is not {"name": …, "arguments" or "parameters": …} or out of memory. */
static cJSON *call_of(const struct srv_render *r, const cJSON *call, int k, int chunk) {
    static const char alnum[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(call, "name");
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(call, "arguments");
    if (args == NULL) /* (Llama 3's key; either is read from any family) */
        args = cJSON_GetObjectItemCaseSensitive(call, "parameters");
    char *a = cJSON_IsString(args) ? strdup(args->valuestring)
              : args != NULL       ? cJSON_PrintUnformatted(args)
                                   : strdup("{}");
    cJSON *o = cJSON_CreateObject(), *f = o != NULL ? cJSON_AddObjectToObject(o, "function") : NULL;
    char id[40];
    uint64_t h = llmem_splitmix64(r->call_seed + (uint64_t)(r->n_calls + k));
    if (r->tool_format == LLMEM_TOOL_FORMAT_MISTRAL) {
        for (int i = 0; i < 9; i++, h /= 62)
            id[i] = alnum[h % 62];
        id[9] = '\0';
    } else {
        snprintf(id, sizeof(id), "call_%016" PRIx64, h);
    }
    int declared = 0; /* a call of a function the request did not declare is no call */
    for (int i = 0; cJSON_IsString(name) && i < r->n_tools && !declared; i++)
        declared = strcmp(r->tool_names[i], name->valuestring) == 0;
    const int ok = declared && a != NULL && f != NULL &&
                   (!chunk || llmem_json_add_int(o, "index", r->n_calls + k) == 0) &&
                   llmem_json_add_string(o, "id", id) == 0 &&
                   llmem_json_add_string(o, "type", "function") == 0 &&
                   llmem_json_add_string(f, "name", name->valuestring) == 0 &&
                   llmem_json_add_string(f, "arguments", a) == 0;
    free(a);
    if (!ok)
        cJSON_Delete(o);
    return ok ? o : NULL;
}

/* The tool calls in an answer's text, as OpenAI's tool_calls (chunk: each with its index); NULL
 * when it holds none that parses (the text is then all content) or out of memory. Hermes-style:
 * "<tool_call>\n{"name": …, "arguments": …}\n</tool_call>" blocks, the text before the first the
 * content (*content_len). Llama 3.1: the whole answer one {"name": …, "parameters": …} object
 * (after an optional <|python_tag|>), no content. Mistral: "[TOOL_CALLS]" then an array of
 * {"name": …, "arguments": …}, the text before it the content. */
static cJSON *tool_calls(struct srv_render *r, const char *text, size_t len, size_t *content_len,
                         int chunk) {
    static const char open_tag[] = "<tool_call>", close_tag[] = "</tool_call>";
    static const char python_tag[] = "<|python_tag|>", mistral_tag[] = "[TOOL_CALLS]";
    const int hermes = r->tool_format == LLMEM_TOOL_FORMAT_HERMES;
    const int mistral = r->tool_format == LLMEM_TOOL_FORMAT_MISTRAL;
    const char *at = hermes    ? memmem(text, len, open_tag, sizeof(open_tag) - 1)
                     : mistral ? memmem(text, len, mistral_tag, sizeof(mistral_tag) - 1)
                               : text;
    if (at == NULL)
        return NULL;
    if (r->tool_format == LLMEM_TOOL_FORMAT_LLAMA3 && len >= sizeof(python_tag) - 1 &&
        memcmp(text, python_tag, sizeof(python_tag) - 1) == 0)
        at += sizeof(python_tag) - 1;
    cJSON *calls = cJSON_CreateArray();
    size_t head = hermes || mistral ? (size_t)(at - text) : 0;
    if (mistral && calls != NULL) { /* one array of calls */
        const char *body = at + sizeof(mistral_tag) - 1;
        cJSON *list = cJSON_ParseWithLength(body, (size_t)(text + len - body));
        const cJSON *array = cJSON_IsArray(list) ? list : NULL, *c;
        int k = 0;
        cJSON_ArrayForEach(c, array) {
            cJSON *o = call_of(r, c, k++, chunk);
            if (o == NULL) {
                cJSON_Delete(calls);
                calls = NULL;
                break;
            }
            cJSON_AddItemToArray(calls, o);
        }
        if (calls != NULL && k == 0)
            cJSON_Delete(calls), calls = NULL;
        cJSON_Delete(list);
        at = NULL;
    }
    for (int k = 0; calls != NULL && at != NULL; k++) {
        const char *body = hermes ? at + sizeof(open_tag) - 1 : at, *end = text + len;
        const char *close =
            hermes ? memmem(body, (size_t)(end - body), close_tag, sizeof(close_tag) - 1) : NULL;
        cJSON *call = cJSON_ParseWithLength(body, (size_t)((close ? close : end) - body));
        cJSON *o = call_of(r, call, k, chunk);
        cJSON_Delete(call);
        if (o == NULL) { /* not a call: the whole text is content */
            cJSON_Delete(calls);
            return NULL;
        }
        cJSON_AddItemToArray(calls, o);
        at = close != NULL ? memmem(close, (size_t)(end - close), open_tag, sizeof(open_tag) - 1)
                           : NULL;
    }
    if (calls == NULL)
        return NULL;
    while (head > 0 && (text[head - 1] == '\n' || text[head - 1] == ' '))
        head--;
    *content_len = head;
    return calls;
}

enum srv_piece llmem_srv_tool_piece(enum llmem_tool_format format, const char *text, size_t len,
                                    size_t from, int done, size_t *start, size_t *end) {
    static const char open_tag[] = "<tool_call>", close_tag[] = "</tool_call>";
    const char *rest = text + from;
    const size_t n = len - from;
    *start = *end = from;
    if (n == 0)
        return SRV_PIECE_NONE;
    if (format != LLMEM_TOOL_FORMAT_HERMES) {
        /* a call is the whole answer: one that opens with '{' (or the python tag), Mistral's
         * with [TOOL_CALLS], waits */
        static const char mistral_tag[] = "[TOOL_CALLS]";
        size_t i = 0;
        while (from == 0 && i < n && (rest[i] == ' ' || rest[i] == '\n'))
            i++;
        const size_t m = n - i < sizeof(mistral_tag) - 1 ? n - i : sizeof(mistral_tag) - 1;
        const int maybe = from == 0 && (i == n || (format == LLMEM_TOOL_FORMAT_MISTRAL
                                                       ? memcmp(rest + i, mistral_tag, m) == 0
                                                       : rest[i] == '{' || rest[i] == '<'));
        if (maybe && !done)
            return SRV_PIECE_NONE;
        *end = len;
        return maybe ? SRV_PIECE_CALLS : SRV_PIECE_CONTENT;
    }
    const char *at = memmem(rest, n, open_tag, sizeof(open_tag) - 1);
    if (at == rest) { /* a block: out whole once it closes (or the answer ends) */
        const char *close = memmem(rest, n, close_tag, sizeof(close_tag) - 1);
        if (close == NULL && !done)
            return SRV_PIECE_NONE;
        *end = close != NULL ? (size_t)(close - text) + sizeof(close_tag) - 1 : len;
        return SRV_PIECE_CALLS;
    }
    /* content up to the block; while the answer goes on, not a tail that may begin one */
    size_t stop = at != NULL ? (size_t)(at - rest) : n;
    for (size_t k = sizeof(open_tag) - 2; at == NULL && !done && k > 0; k--)
        if (k <= n && memcmp(rest + n - k, open_tag, k) == 0) {
            stop = n - k;
            break;
        }
    /* the whitespace before a block is not content, and at the open end it may be */
    size_t c = stop;
    while ((at != NULL || !done) && c > 0 && (rest[c - 1] == '\n' || rest[c - 1] == ' '))
        c--;
    if (c == 0 && at != NULL) /* only whitespace before the block: skipped */
        return llmem_srv_tool_piece(format, text, len, from + stop, done, start, end);
    *end = from + c;
    return c > 0 ? SRV_PIECE_CONTENT : SRV_PIECE_NONE;
}

static cJSON *choice(struct srv_render *r, const char *text, size_t len,
                     const struct srv_token *toks, int64_t n_toks, const char *finish_reason,
                     int chunk, int first, int index) {
    size_t content_len = len;
    cJSON *calls = r->tools && r->kind == SRV_CHAT && len > 0
                       ? tool_calls(r, text, len, &content_len, chunk)
                       : NULL;
    r->called |= calls != NULL;
    r->n_calls += calls != NULL ? cJSON_GetArraySize(calls) : 0;
    if (finish_reason != NULL && r->called &&
        (strcmp(finish_reason, "stop") == 0 || strcmp(finish_reason, "length") == 0))
        finish_reason = "tool_calls"; /* (the calls parsed: whole) */
    cJSON *c = cJSON_CreateObject();
    int bad_ = c == NULL || llmem_json_add_int(c, "index", index);
    char *t = malloc(len + 1);
    bad_ = bad_ || t == NULL;
    if (!bad_) {
        memcpy(t, text, len);
        t[len] = '\0';
        if (r->kind == SRV_COMPLETIONS) {
            bad_ = llmem_json_add_string(c, "text", t);
        } else {
            cJSON *m = cJSON_AddObjectToObject(c, chunk ? "delta" : "message");
            bad_ = m == NULL;
            if (!bad_ && (!chunk || first))
                bad_ = llmem_json_add_string(m, "role", "assistant");
            t[content_len] = '\0';
            if (!bad_ && calls != NULL)
                bad_ = content_len > 0 ? llmem_json_add_string(m, "content", t)
                                       : llmem_json_add_null(m, "content");
            else if (!bad_ && (!chunk || len > 0 || first || n_toks > 0))
                bad_ = llmem_json_add_string(m, "content", t);
            if (!bad_ && calls != NULL)
                cJSON_AddItemToObject(m, "tool_calls", calls), calls = NULL;
        }
    }
    cJSON_Delete(calls);
    free(t);
    if (!bad_) {
        if (r->logprobs >= 0 && (n_toks > 0 || !chunk)) {
            cJSON *lp = r->kind == SRV_CHAT ? chat_logprobs(r, toks, n_toks)
                                            : completion_logprobs(r, toks, n_toks);
            bad_ = lp == NULL;
            if (!bad_)
                cJSON_AddItemToObject(c, "logprobs", lp);
        } else {
            bad_ = llmem_json_add_null(c, "logprobs");
        }
    }
    if (!bad_)
        bad_ = finish_reason != NULL ? llmem_json_add_string(c, "finish_reason", finish_reason)
                                     : llmem_json_add_null(c, "finish_reason");
    if (bad_) {
        cJSON_Delete(c);
        return NULL;
    }
    return c;
}

static char *finish(cJSON *o, int bad_) {
    char *s = bad_ || o == NULL ? NULL : llmem_json_print(o, 0);
    cJSON_Delete(o);
    return s;
}

char *llmem_srv_render_response(struct srv_render *r, const struct srv_choice *choices, int n,
                                int64_t prompt_tokens, int64_t completion_tokens) {
    cJSON *o = new_response(r, 0);
    cJSON *arr = o != NULL ? cJSON_AddArrayToObject(o, "choices") : NULL;
    int bad_ = arr == NULL;
    for (int i = 0; i < n && !bad_; i++) {
        const struct srv_choice *x = &choices[i];
        r->text_offset = 0, r->called = 0; /* each choice on its own */
        r->call_seed += i > 0 ? 0x9e3779b97f4a7c15ull : 0;
        cJSON *c = choice(r, x->text, x->len, x->toks, x->n_toks, x->finish_reason, 0, 0, i);
        bad_ = c == NULL;
        if (c != NULL)
            cJSON_AddItemToArray(arr, c);
    }
    return finish(o, bad_ || add_usage(o, prompt_tokens, completion_tokens));
}

char *llmem_srv_render_chunk(struct srv_render *r, const char *text, size_t len,
                             const struct srv_token *toks, int64_t n_toks,
                             const char *finish_reason, int first) {
    cJSON *o = new_response(r, 1);
    cJSON *choices = o != NULL ? cJSON_AddArrayToObject(o, "choices") : NULL;
    cJSON *c =
        choices != NULL ? choice(r, text, len, toks, n_toks, finish_reason, 1, first, 0) : NULL;
    if (c != NULL)
        cJSON_AddItemToArray(choices, c);
    /* with include_usage every chunk has a usage field, null until the last (as OpenAI) */
    return finish(o, c == NULL || (r->include_usage && llmem_json_add_null(o, "usage")));
}

char *llmem_srv_render_usage_chunk(const struct srv_render *r, int64_t prompt_tokens,
                                   int64_t completion_tokens) {
    cJSON *o = new_response(r, 1);
    return finish(o, o == NULL || cJSON_AddArrayToObject(o, "choices") == NULL ||
                         add_usage(o, prompt_tokens, completion_tokens));
}

static cJSON *model_object(const struct srv_model *m, int64_t created) {
    cJSON *md = cJSON_CreateObject();
    if (md == NULL || llmem_json_add_string(md, "id", m->name) ||
        llmem_json_add_string(md, "object", "model") ||
        llmem_json_add_int(md, "created", created) ||
        llmem_json_add_string(md, "owned_by", "llmem") ||
        llmem_json_add_int(md, "max_model_len", m->context)) {
        cJSON_Delete(md);
        return NULL;
    }
    return md;
}

char *llmem_srv_render_models(const struct srv_model *m, int64_t created) {
    cJSON *o = cJSON_CreateObject();
    int bad_ = o == NULL || llmem_json_add_string(o, "object", "list");
    cJSON *data = !bad_ ? cJSON_AddArrayToObject(o, "data") : NULL;
    cJSON *md = data != NULL ? model_object(m, created) : NULL;
    if (md != NULL)
        cJSON_AddItemToArray(data, md);
    return finish(o, md == NULL);
}

char *llmem_srv_render_model(const struct srv_model *m, int64_t created) {
    cJSON *md = model_object(m, created);
    return finish(md, md == NULL);
}
