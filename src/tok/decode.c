/*
 * tok/decode.c — ids → text, and the streaming detokenizer.
 *
 * Decoding follows Hugging Face `tokenizers`: the ids become their token strings (added tokens
 * their content, special ones dropped with skip_special), then the decoder steps run in order over
 * the list of strings (ByteLevel: characters back to bytes, then one lossy UTF-8 string;
 * Metaspace; Replace; ByteFallback: runs of <0xNN> back to bytes, U+FFFD per token when they are
 * not valid UTF-8; Fuse; Strip), and the result is concatenated. Without a decoder the strings are
 * joined with spaces, as `tokenizers` does.
 *
 * The streaming detokenizer keeps two offsets into the ids fed so far (the method of
 * text-generation-inference): `prefix` starts the window it decodes, `read` ends the part already
 * written out. Each push decodes ids[prefix:] and writes what follows the text of
 * ids[prefix:read] unless it ends with U+FFFD (a character still incomplete). Decoding a window
 * rather than everything keeps each push O(window), and decoding from `prefix` keeps the
 * first-token rules of Metaspace and Strip identical in both decodes, so the pieces add up to the
 * full decode.
 */
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "tok/tok_int.h"

/* ---- lists of strings ----------------------------------------------------------------------- */

struct strs {
    struct tok_buf *v;
    size_t n, cap;
};

static struct tok_buf *strs_add(struct strs *l) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 16;
        struct tok_buf *v = realloc(l->v, cap * sizeof(*v));
        if (v == NULL)
            return NULL;
        l->v = v, l->cap = cap;
    }
    struct tok_buf *b = &l->v[l->n++];
    memset(b, 0, sizeof(*b));
    if (tok_buf_reserve(b, 0) != LLMEM_OK) {
        l->n--;
        return NULL;
    }
    return b;
}

static void strs_free(struct strs *l) {
    for (size_t i = 0; i < l->n; i++)
        tok_buf_free(&l->v[i]);
    free(l->v);
    l->v = NULL;
    l->n = l->cap = 0;
}

static void strs_swap(struct strs *a, struct strs *b) {
    struct strs t = *a;
    *a = *b;
    *b = t;
}

/* ---- decoder steps (in → out; out is empty on entry) ---------------------------------------- */

static int dec_byte_level(const struct strs *in, struct strs *out) {
    struct tok_buf bytes = {0};
    int status = LLMEM_OK;
    for (size_t i = 0; i < in->n && status == LLMEM_OK; i++) {
        const struct tok_buf *t = &in->v[i];
        size_t mark = bytes.n;
        int mapped = 1;
        for (size_t k = 0; k < t->n && mapped;) {
            uint32_t cp;
            size_t cl = tok_utf8_char((const unsigned char *)t->p + k, t->n - k, &cp);
            int b = cl ? tok_cp_byte(cp) : -1;
            if (b < 0) {
                mapped = 0;
                break;
            }
            unsigned char c = (unsigned char)b;
            status = tok_buf_add(&bytes, &c, 1);
            if (status != LLMEM_OK)
                break;
            k += cl;
        }
        if (status == LLMEM_OK && !mapped) { /* a token outside the map keeps its own bytes */
            bytes.n = mark;
            status = tok_buf_add(&bytes, t->p, t->n);
        }
    }
    struct tok_buf *o = status == LLMEM_OK ? strs_add(out) : NULL;
    if (o == NULL || tok_utf8_lossy(o, bytes.p, bytes.n) != LLMEM_OK)
        status = LLMEM_ENOMEM;
    tok_buf_free(&bytes);
    return status;
}

static int dec_metaspace(const struct tok_dec *d, const struct strs *in, struct strs *out) {
    for (size_t i = 0; i < in->n; i++) {
        const struct tok_buf *t = &in->v[i];
        struct tok_buf *o = strs_add(out);
        if (o == NULL)
            return LLMEM_ENOMEM;
        for (size_t k = 0; k < t->n;) {
            if (t->n - k >= d->a.n && memcmp(t->p + k, d->a.p, d->a.n) == 0) {
                if (!(i == 0 && d->prepend) && tok_buf_add(o, " ", 1) != LLMEM_OK)
                    return LLMEM_ENOMEM;
                k += d->a.n;
            } else {
                if (tok_buf_add(o, t->p + k, 1) != LLMEM_OK)
                    return LLMEM_ENOMEM;
                k++;
            }
        }
    }
    return LLMEM_OK;
}

static int dec_replace(const struct tok_dec *d, const struct strs *in, struct strs *out) {
    for (size_t i = 0; i < in->n; i++) {
        const struct tok_buf *t = &in->v[i];
        struct tok_buf *o = strs_add(out);
        if (o == NULL)
            return LLMEM_ENOMEM;
        for (size_t k = 0; k < t->n;) {
            if (t->n - k >= d->a.n && memcmp(t->p + k, d->a.p, d->a.n) == 0) {
                if (tok_buf_add(o, d->b.p, d->b.n) != LLMEM_OK)
                    return LLMEM_ENOMEM;
                k += d->a.n;
            } else {
                if (tok_buf_add(o, t->p + k, 1) != LLMEM_OK)
                    return LLMEM_ENOMEM;
                k++;
            }
        }
    }
    return LLMEM_OK;
}

static int hex_digit(char c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/* The byte of a "<0xNN>" token, −1 for any other token. */
static int byte_token(const struct tok_buf *t) {
    if (t->n != 6 || memcmp(t->p, "<0x", 3) != 0 || t->p[5] != '>')
        return -1;
    int hi = hex_digit(t->p[3]), lo = hex_digit(t->p[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

static int flush_bytes(struct tok_buf *bytes, size_t n_tokens, struct strs *out) {
    if (n_tokens == 0)
        return LLMEM_OK;
    struct tok_buf *o = strs_add(out);
    if (o == NULL)
        return LLMEM_ENOMEM;
    if (tok_utf8_check(bytes->p, bytes->n) == bytes->n) {
        if (tok_buf_add(o, bytes->p, bytes->n) != LLMEM_OK)
            return LLMEM_ENOMEM;
    } else {
        for (size_t k = 0; k < n_tokens; k++)
            if (tok_utf8_put(o, 0xFFFD) != LLMEM_OK)
                return LLMEM_ENOMEM;
    }
    bytes->n = 0;
    return LLMEM_OK;
}

static int dec_byte_fallback(const struct strs *in, struct strs *out) {
    struct tok_buf bytes = {0};
    size_t n_tokens = 0;
    int status = tok_buf_reserve(&bytes, 16);
    for (size_t i = 0; i < in->n && status == LLMEM_OK; i++) {
        int b = byte_token(&in->v[i]);
        if (b >= 0) {
            unsigned char c = (unsigned char)b;
            status = tok_buf_add(&bytes, &c, 1);
            n_tokens++;
            continue;
        }
        status = flush_bytes(&bytes, n_tokens, out);
        n_tokens = 0;
        struct tok_buf *o = status == LLMEM_OK ? strs_add(out) : NULL;
        if (o == NULL || tok_buf_add(o, in->v[i].p, in->v[i].n) != LLMEM_OK)
            status = LLMEM_ENOMEM;
    }
    if (status == LLMEM_OK)
        status = flush_bytes(&bytes, n_tokens, out);
    tok_buf_free(&bytes);
    return status;
}

static int dec_fuse(const struct strs *in, struct strs *out) {
    struct tok_buf *o = strs_add(out);
    if (o == NULL)
        return LLMEM_ENOMEM;
    for (size_t i = 0; i < in->n; i++)
        if (tok_buf_add(o, in->v[i].p, in->v[i].n) != LLMEM_OK)
            return LLMEM_ENOMEM;
    return LLMEM_OK;
}

static int dec_strip(const struct tok_dec *d, const struct strs *in, struct strs *out) {
    const struct tok_str *c = &d->a;
    for (size_t i = 0; i < in->n; i++) {
        const struct tok_buf *t = &in->v[i];
        size_t s = 0, e = t->n;
        for (int k = 0; k < d->start && e - s >= c->n && memcmp(t->p + s, c->p, c->n) == 0; k++)
            s += c->n;
        for (int k = 0; k < d->stop && e - s >= c->n && memcmp(t->p + e - c->n, c->p, c->n) == 0;
             k++)
            e -= c->n;
        struct tok_buf *o = strs_add(out);
        if (o == NULL || tok_buf_add(o, t->p + s, e - s) != LLMEM_OK)
            return LLMEM_ENOMEM;
    }
    return LLMEM_OK;
}

/* ---- decode --------------------------------------------------------------------------------- */

static const struct tok_str *token_text(const struct llmem_tokenizer *tok, int32_t id) {
    int32_t a = tok->added_of[id];
    return a >= 0 ? &tok->added[a].content : &tok->pieces[id];
}

/* Checks the ids; logs as `func`. */
static int check_ids(const struct llmem_tokenizer *tok, const int32_t *ids, int64_t n,
                     const char *func) {
    for (int64_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= tok->n_vocab || token_text(tok, id)->p == NULL) {
            LLMEM_ERROR_AS(func, "id %d (at %lld) is not in the vocabulary of %d tokens", id,
                           (long long)i, tok->n_vocab);
            return LLMEM_EINVAL;
        }
    }
    return LLMEM_OK;
}

/* Decodes checked ids into out (appended, NUL-terminated). Only LLMEM_ENOMEM can fail. */
static int decode_into(const struct llmem_tokenizer *tok, const int32_t *ids, int64_t n,
                       int skip_special, struct tok_buf *out) {
    struct strs a = {0}, b = {0};
    int status = LLMEM_OK;
    for (int64_t i = 0; i < n && status == LLMEM_OK; i++) {
        if (skip_special && tok->kind[ids[i]] == TOK_KIND_SPECIAL)
            continue;
        const struct tok_str *t = token_text(tok, ids[i]);
        struct tok_buf *s = strs_add(&a);
        if (s == NULL || tok_buf_add(s, t->p, t->n) != LLMEM_OK)
            status = LLMEM_ENOMEM;
    }
    for (int k = 0; k < tok->n_decs && status == LLMEM_OK; k++) {
        const struct tok_dec *d = &tok->decs[k];
        switch (d->kind) {
        case TOK_DEC_BYTELEVEL: status = dec_byte_level(&a, &b); break;
        case TOK_DEC_METASPACE: status = dec_metaspace(d, &a, &b); break;
        case TOK_DEC_REPLACE: status = dec_replace(d, &a, &b); break;
        case TOK_DEC_BYTEFALLBACK: status = dec_byte_fallback(&a, &b); break;
        case TOK_DEC_FUSE: status = dec_fuse(&a, &b); break;
        case TOK_DEC_STRIP: status = dec_strip(d, &a, &b); break;
        }
        strs_swap(&a, &b);
        strs_free(&b);
    }
    struct tok_buf joined = {0};
    for (size_t i = 0; i < a.n && status == LLMEM_OK; i++) {
        if (!tok->has_decoder && i > 0)
            status = tok_buf_add(&joined, " ", 1);
        if (status == LLMEM_OK)
            status = tok_buf_add(&joined, a.v[i].p, a.v[i].n);
    }
    if (status == LLMEM_OK) /* every step keeps text valid; this only guards the contract */
        status = tok_utf8_lossy(out, joined.p, joined.n);
    tok_buf_free(&joined);
    strs_free(&a);
    strs_free(&b);
    return status;
}

int llmem_tokenizer_decode(const struct llmem_tokenizer *tok, const int32_t *ids, int64_t n,
                           int skip_special, char **text, size_t *len) {
    LLMEM_ASSERT(tok != NULL && (ids != NULL || n == 0) && text != NULL);
    *text = NULL;
    if (len != NULL)
        *len = 0;
    int status = check_ids(tok, ids, n, __func__);
    if (status != LLMEM_OK)
        return status;
    struct tok_buf out = {0};
    if ((status = decode_into(tok, ids, n, skip_special, &out)) != LLMEM_OK) {
        tok_buf_free(&out);
        LLMEM_ERROR("out of memory decoding %lld ids", (long long)n);
        return status;
    }
    *text = out.p;
    if (len != NULL)
        *len = out.n;
    return LLMEM_OK;
}

/* ---- streaming ------------------------------------------------------------------------------ */

struct llmem_detok {
    const struct llmem_tokenizer *tok;
    int skip_special;
    int32_t *ids; /* (n) every id fed (special ones left out with skip_special) */
    size_t n, cap;
    size_t prefix, read; /* the window starts at prefix; ids[prefix:read] are written out */
    size_t prefix_len;   /* bytes of the decode of ids[prefix:read] */
};

int llmem_detok_create(const struct llmem_tokenizer *tok, int skip_special,
                       struct llmem_detok **out) {
    LLMEM_ASSERT(tok != NULL && out != NULL);
    struct llmem_detok *d = calloc(1, sizeof(*d));
    if (d == NULL) {
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    d->tok = tok;
    d->skip_special = skip_special;
    *out = d;
    return LLMEM_OK;
}

void llmem_detok_free(struct llmem_detok *d) {
    if (d == NULL)
        return;
    free(d->ids);
    free(d);
}

static int ends_incomplete(const struct tok_buf *t) {
    return t->n >= 3 && memcmp(t->p + t->n - 3, "\xEF\xBF\xBD", 3) == 0;
}

/* Writes the text past the window's written part; at_end: also what is incomplete. */
static int detok_step(struct llmem_detok *d, int at_end, char **piece, const char *func) {
    struct tok_buf text = {0};
    int status = decode_into(d->tok, d->ids + d->prefix, (int64_t)(d->n - d->prefix), 0, &text);
    struct tok_buf outp = {0};
    if (status == LLMEM_OK)
        status = tok_buf_reserve(&outp, 0);
    if (status == LLMEM_OK && text.n > d->prefix_len && (at_end || !ends_incomplete(&text))) {
        status = tok_buf_add(&outp, text.p + d->prefix_len, text.n - d->prefix_len);
        if (status == LLMEM_OK && !at_end) {
            /* The new window: what was just completed. */
            struct tok_buf pre = {0};
            d->prefix = d->read;
            d->read = d->n;
            status = decode_into(d->tok, d->ids + d->prefix, (int64_t)(d->read - d->prefix), 0,
                                 &pre);
            d->prefix_len = pre.n;
            tok_buf_free(&pre);
        }
    }
    if (status == LLMEM_OK && at_end && text.n > d->prefix_len) {
        /* Everything is written: later pushes continue after it. */
        d->read = d->n;
        d->prefix_len = text.n;
    }
    tok_buf_free(&text);
    if (status != LLMEM_OK) {
        tok_buf_free(&outp);
        LLMEM_ERROR_AS(func, "out of memory");
        return status;
    }
    *piece = outp.p;
    return LLMEM_OK;
}

int llmem_detok_push(struct llmem_detok *d, int32_t id, char **piece) {
    LLMEM_ASSERT(d != NULL && piece != NULL);
    *piece = NULL;
    int status = check_ids(d->tok, &id, 1, __func__);
    if (status != LLMEM_OK)
        return status;
    if (!(d->skip_special && d->tok->kind[id] == TOK_KIND_SPECIAL)) {
        if (d->n == d->cap) {
            size_t cap = d->cap ? 2 * d->cap : 64;
            int32_t *p = realloc(d->ids, cap * sizeof(*p));
            if (p == NULL) {
                LLMEM_ERROR("out of memory");
                return LLMEM_ENOMEM;
            }
            d->ids = p, d->cap = cap;
        }
        d->ids[d->n++] = id;
    }
    return detok_step(d, 0, piece, __func__);
}

int llmem_detok_finish(struct llmem_detok *d, char **piece) {
    LLMEM_ASSERT(d != NULL && piece != NULL);
    *piece = NULL;
    return detok_step(d, 1, piece, __func__);
}
