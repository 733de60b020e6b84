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
 * full decode; a Strip of the fused text strips only a window that begins the text (its start
 * can reach past the window's first token). A run of ByteFallback byte tokens is held until it
 * ends, since a later byte can turn the whole run into U+FFFD.
 */
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "tok/tok_int.h"

/* ---- lists of strings: one buffer, the end of each string ----------------------------------- */

struct strs {
    struct tok_buf text;
    size_t *ends; /* (n) string i is text[ends[i − 1] (or 0), ends[i]) */
    size_t n, cap;
};

/* Ends the string being written at the end of text. */
static int strs_end(struct strs *l) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        size_t *e = realloc(l->ends, cap * sizeof(*e));
        if (e == NULL)
            return LLMEM_ENOMEM;
        l->ends = e, l->cap = cap;
    }
    l->ends[l->n++] = l->text.n;
    return LLMEM_OK;
}

static int strs_push(struct strs *l, const char *p, size_t n) {
    return llmem_tok_buf_add(&l->text, p, n) != LLMEM_OK ? LLMEM_ENOMEM : strs_end(l);
}

static const char *strs_at(const struct strs *l, size_t i, size_t *n) {
    size_t s = i > 0 ? l->ends[i - 1] : 0;
    *n = l->ends[i] - s;
    return l->text.p + s;
}

static void strs_clear(struct strs *l) {
    l->text.n = 0;
    l->n = 0;
}

static void strs_free(struct strs *l) {
    llmem_tok_buf_free(&l->text);
    free(l->ends);
}

static void strs_swap(struct strs *a, struct strs *b) {
    struct strs t = *a;
    *a = *b;
    *b = t;
}

/* ---- decoder steps (in → out; out is empty on entry) ---------------------------------------- */

static int dec_byte_level(const struct strs *in, struct strs *out) {
    struct tok_buf bytes = {0};
    int status = llmem_tok_buf_reserve(&bytes, in->text.n);
    for (size_t i = 0; i < in->n && status == LLMEM_OK; i++) {
        size_t n;
        const char *t = strs_at(in, i, &n);
        size_t mark = bytes.n;
        int mapped = 1;
        for (size_t k = 0; k < n;) {
            uint32_t cp;
            size_t cl = llmem_tok_utf8_char((const unsigned char *)t + k, n - k, &cp);
            int b = cl ? llmem_tok_cp_byte(cp) : -1;
            if (b < 0) {
                mapped = 0;
                break;
            }
            bytes.p[bytes.n++] = (char)b; /* never more bytes than the text had */
            k += cl;
        }
        if (!mapped) { /* a token outside the map keeps its own bytes */
            bytes.n = mark;
            status = llmem_tok_buf_add(&bytes, t, n);
        }
    }
    if (status == LLMEM_OK)
        status = llmem_tok_utf8_lossy(&out->text, bytes.p, bytes.n);
    if (status == LLMEM_OK)
        status = strs_end(out);
    llmem_tok_buf_free(&bytes);
    return status;
}

/* Each string with pattern a replaced by b (Replace), or by a space, dropped in the first string
 * when `drop_first` (Metaspace). */
static int dec_replace(const struct tok_str *a, const struct tok_str *b, int drop_first,
                       const struct strs *in, struct strs *out) {
    for (size_t i = 0; i < in->n; i++) {
        size_t n;
        const char *t = strs_at(in, i, &n);
        for (size_t k = 0; k < n;) {
            const char *hit = n - k >= a->n ? memmem(t + k, n - k, a->p, a->n) : NULL;
            size_t end = hit ? (size_t)(hit - t) : n;
            if (llmem_tok_buf_add(&out->text, t + k, end - k) != LLMEM_OK)
                return LLMEM_ENOMEM;
            if (hit == NULL)
                break;
            if (!(i == 0 && drop_first) && llmem_tok_buf_add(&out->text, b->p, b->n) != LLMEM_OK)
                return LLMEM_ENOMEM;
            k = end + a->n;
        }
        if (strs_end(out) != LLMEM_OK)
            return LLMEM_ENOMEM;
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
static int byte_token(const char *t, size_t n) {
    if (n != 6 || memcmp(t, "<0x", 3) != 0 || t[5] != '>')
        return -1;
    int hi = hex_digit(t[3]), lo = hex_digit(t[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

static int flush_bytes(struct tok_buf *bytes, size_t n_tokens, struct strs *out) {
    if (n_tokens == 0)
        return LLMEM_OK;
    if (llmem_tok_utf8_check(bytes->p, bytes->n) == bytes->n) {
        if (strs_push(out, bytes->p, bytes->n) != LLMEM_OK)
            return LLMEM_ENOMEM;
    } else {
        for (size_t k = 0; k < n_tokens; k++)
            if (strs_push(out, "\xEF\xBF\xBD", 3) != LLMEM_OK)
                return LLMEM_ENOMEM;
    }
    bytes->n = 0;
    return LLMEM_OK;
}

static int dec_byte_fallback(const struct strs *in, struct strs *out) {
    struct tok_buf bytes = {0};
    size_t n_tokens = 0;
    int status = llmem_tok_buf_reserve(&bytes, 16);
    for (size_t i = 0; i < in->n && status == LLMEM_OK; i++) {
        size_t n;
        const char *t = strs_at(in, i, &n);
        int b = byte_token(t, n);
        if (b >= 0) {
            unsigned char c = (unsigned char)b;
            status = llmem_tok_buf_add(&bytes, &c, 1);
            n_tokens++;
            continue;
        }
        status = flush_bytes(&bytes, n_tokens, out);
        n_tokens = 0;
        if (status == LLMEM_OK)
            status = strs_push(out, t, n);
    }
    if (status == LLMEM_OK)
        status = flush_bytes(&bytes, n_tokens, out);
    llmem_tok_buf_free(&bytes);
    return status;
}

static int dec_fuse(const struct strs *in, struct strs *out) {
    return strs_push(out, in->text.p, in->text.n);
}

/* (lead 0: the first string keeps its start: a window's fused text that does not begin the text) */
static int dec_strip(const struct tok_dec *d, int lead, const struct strs *in, struct strs *out) {
    const struct tok_str *c = &d->a;
    for (size_t i = 0; i < in->n; i++) {
        size_t n;
        const char *t = strs_at(in, i, &n);
        size_t s = 0, e = n;
        const int start = i > 0 || lead ? d->start : 0;
        for (int k = 0; k < start && e - s >= c->n && memcmp(t + s, c->p, c->n) == 0; k++)
            s += c->n;
        for (int k = 0; k < d->stop && e - s >= c->n && memcmp(t + e - c->n, c->p, c->n) == 0; k++)
            e -= c->n;
        if (strs_push(out, t + s, e - s) != LLMEM_OK)
            return LLMEM_ENOMEM;
    }
    return LLMEM_OK;
}

/* ---- decode --------------------------------------------------------------------------------- */

static const struct tok_str *token_text(const struct llmem_tokenizer *tok, int32_t id) {
    int32_t a = tok->added_of[id];
    return a >= 0 ? &tok->added[a].content : &tok->pieces[id];
}

/* Checks the ids; logs as `func`. An id inside the vocabulary's range that no token has (a gap in
 * its ids) decodes to nothing, as tokenizers decodes it. */
static int check_ids(const struct llmem_tokenizer *tok, const int32_t *ids, int64_t n,
                     const char *func) {
    for (int64_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= tok->n_vocab) {
            LLMEM_ERROR_AS(func, "id %d (at %lld) is not in the vocabulary of %d tokens", id,
                           (long long)i, tok->n_vocab);
            return LLMEM_EINVAL;
        }
    }
    return LLMEM_OK;
}

/* Decodes checked ids into out (appended, NUL-terminated). text_start: the ids begin the text
 * (else they are a streaming window after it starts, where a Strip after Fuse leaves the start of
 * the window's text alone: the whole text's start was stripped in the first window). Only
 * LLMEM_ENOMEM can fail. */
static int decode_into(const struct llmem_tokenizer *tok, const int32_t *ids, int64_t n,
                       int skip_special, int text_start, struct tok_buf *out) {
    struct strs a = {0}, b = {0};
    int fused = 0;
    static const struct tok_str space = {" ", 1};
    int status = llmem_tok_buf_reserve(&a.text, 0);
    for (int64_t i = 0; i < n && status == LLMEM_OK; i++) {
        const struct tok_str *t = token_text(tok, ids[i]);
        if ((skip_special && tok->kind[ids[i]] == TOK_KIND_SPECIAL) || t->p == NULL)
            continue;
        status = strs_push(&a, t->p, t->n);
    }
    for (int k = 0; k < tok->n_decs && status == LLMEM_OK; k++) {
        const struct tok_dec *d = &tok->decs[k];
        strs_clear(&b);
        if ((status = llmem_tok_buf_reserve(&b.text, 0)) != LLMEM_OK)
            break;
        switch (d->kind) {
        case TOK_DEC_BYTELEVEL: status = dec_byte_level(&a, &b); break;
        case TOK_DEC_METASPACE: status = dec_replace(&d->a, &space, d->prepend, &a, &b); break;
        case TOK_DEC_REPLACE: status = dec_replace(&d->a, &d->b, 0, &a, &b); break;
        case TOK_DEC_BYTEFALLBACK: status = dec_byte_fallback(&a, &b); break;
        case TOK_DEC_FUSE: status = dec_fuse(&a, &b), fused = 1; break;
        case TOK_DEC_STRIP: status = dec_strip(d, text_start || !fused, &a, &b); break;
        }
        strs_swap(&a, &b);
    }
    if (status == LLMEM_OK && tok->has_decoder) { /* the steps keep text valid; this guards */
        status = llmem_tok_utf8_lossy(out, a.text.p, a.text.n);
    } else if (status == LLMEM_OK) { /* no decoder: the strings joined with spaces */
        struct tok_buf joined = {0};
        for (size_t i = 0; i < a.n && status == LLMEM_OK; i++) {
            size_t len;
            const char *t = strs_at(&a, i, &len);
            if (i > 0)
                status = llmem_tok_buf_add(&joined, " ", 1);
            if (status == LLMEM_OK)
                status = llmem_tok_buf_add(&joined, t, len);
        }
        if (status == LLMEM_OK)
            status = llmem_tok_utf8_lossy(out, joined.p, joined.n);
        llmem_tok_buf_free(&joined);
    }
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
    if ((status = decode_into(tok, ids, n, skip_special, 1, &out)) != LLMEM_OK) {
        llmem_tok_buf_free(&out);
        LLMEM_ERROR("out of memory decoding %lld ids", (long long)n);
        return status;
    }
    *text = out.p;
    if (len != NULL)
        *len = out.n;
    return LLMEM_OK;
}

int llmem_tokenizer_token_bytes(const struct llmem_tokenizer *tok, int32_t id, char *buf,
                                size_t cap, size_t *len) {
    LLMEM_ASSERT(tok != NULL && buf != NULL && len != NULL);
    *len = 0;
    if (id < 0 || id >= tok->n_vocab || token_text(tok, id)->p == NULL)
        return LLMEM_EINVAL;
    const struct tok_str *t = token_text(tok, id);
    struct tok_buf a = {0}, b = {0};
    int status = llmem_tok_buf_add(&a, t->p, t->n);
    for (int k = 0; k < tok->n_decs && status == LLMEM_OK && tok->added_of[id] < 0; k++) {
        const struct tok_dec *d = &tok->decs[k];
        b.n = 0;
        switch (d->kind) {
        case TOK_DEC_BYTELEVEL: /* each character its byte (a token outside the map: as is) */
            for (size_t i = 0; i < a.n && status == LLMEM_OK;) {
                uint32_t cp;
                size_t cl = llmem_tok_utf8_char((const unsigned char *)a.p + i, a.n - i, &cp);
                int byte = cl ? llmem_tok_cp_byte(cp) : -1;
                if (byte < 0) {
                    b.n = 0;
                    status = llmem_tok_buf_add(&b, a.p, a.n);
                    break;
                }
                unsigned char c = (unsigned char)byte;
                status = llmem_tok_buf_add(&b, &c, 1);
                i += cl;
            }
            break;
        case TOK_DEC_METASPACE:
        case TOK_DEC_REPLACE: { /* a token is never first here: Metaspace keeps its space */
            static const struct tok_str space = {" ", 1};
            const struct tok_str *to = d->kind == TOK_DEC_METASPACE ? &space : &d->b;
            for (size_t i = 0; i < a.n && status == LLMEM_OK;) {
                const char *hit = a.n - i >= d->a.n ? memmem(a.p + i, a.n - i, d->a.p, d->a.n)
                                                    : NULL;
                size_t end = hit ? (size_t)(hit - a.p) : a.n;
                status = llmem_tok_buf_add(&b, a.p + i, end - i);
                if (hit == NULL || status != LLMEM_OK)
                    break;
                status = llmem_tok_buf_add(&b, to->p, to->n);
                i = end + d->a.n;
            }
            break;
        }
        case TOK_DEC_BYTEFALLBACK: {
            int byte = byte_token(a.p, a.n);
            unsigned char c = (unsigned char)byte;
            status = byte >= 0 ? llmem_tok_buf_add(&b, &c, 1) : llmem_tok_buf_add(&b, a.p, a.n);
            break;
        }
        case TOK_DEC_FUSE:
        case TOK_DEC_STRIP: /* the whole text's, not a token's */
            status = llmem_tok_buf_add(&b, a.p, a.n);
            break;
        }
        struct tok_buf swap = a;
        a = b, b = swap;
    }
    if (status == LLMEM_OK && a.n > cap)
        status = LLMEM_ERANGE;
    if (status == LLMEM_OK) {
        if (a.n > 0)
            memcpy(buf, a.p, a.n);
        *len = a.n;
    }
    llmem_tok_buf_free(&a);
    llmem_tok_buf_free(&b);
    return status;
}

/* ---- streaming ------------------------------------------------------------------------------ */

struct llmem_detok {
    const struct llmem_tokenizer *tok;
    int skip_special;
    int32_t *ids; /* (n) every id fed (special ones left out with skip_special) */
    size_t n, cap;
    size_t prefix, read; /* the window starts at prefix; ids[prefix:read] are written out */
    size_t prefix_len;   /* bytes of the decode of ids[prefix:read] */
    char prefix_last;    /* its last byte */
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

/* With a ByteFallback decoder, whether the last id is a <0xNN> byte token: a run of them decodes
 * all or nothing (U+FFFD per token when the run is not valid UTF-8), so the run is written only
 * once a token that ends it arrives (or at the end), which delays a lone byte token (a newline
 * spelled <0x0A>) by one token. */
static int in_byte_run(const struct llmem_detok *d) {
    if (!d->tok->dec_byte_fallback || d->n == 0)
        return 0;
    const struct tok_str *t = token_text(d->tok, d->ids[d->n - 1]);
    return byte_token(t->p, t->n) >= 0;
}

/* The window's ids (NULL before the first id: no offset on a null pointer). */
static const int32_t *window(const struct llmem_detok *d) {
    return d->ids != NULL ? d->ids + d->prefix : NULL;
}

/* Writes the text past the window's written part; at_end: also what is incomplete. */
static int detok_step(struct llmem_detok *d, int at_end, char **piece, const char *func) {
    struct tok_buf text = {0};
    int status =
        decode_into(d->tok, window(d), (int64_t)(d->n - d->prefix), 0, d->prefix == 0, &text);
    struct tok_buf outp = {0};
    if (status == LLMEM_OK)
        status = llmem_tok_buf_reserve(&outp, 0);
    int hold = !at_end && (ends_incomplete(&text) || in_byte_run(d));
    /* The written part must stay a prefix of the window's text (defensive: the decoders keep it).
     */
    if (status == LLMEM_OK &&
        (text.n < d->prefix_len ||
         (d->prefix_len > 0 && text.p[d->prefix_len - 1] != d->prefix_last) ||
         (text.n > d->prefix_len && ((unsigned char)text.p[d->prefix_len] & 0xC0) == 0x80)))
        hold = !at_end;
    if (status == LLMEM_OK && text.n > d->prefix_len && !hold) {
        status = llmem_tok_buf_add(&outp, text.p + d->prefix_len, text.n - d->prefix_len);
        if (status == LLMEM_OK && !at_end) {
            /* The new window: what was just completed. */
            struct tok_buf pre = {0};
            d->prefix = d->read;
            d->read = d->n;
            status = decode_into(d->tok, window(d), (int64_t)(d->read - d->prefix), 0,
                                 d->prefix == 0, &pre);
            d->prefix_len = pre.n;
            d->prefix_last = pre.n > 0 ? pre.p[pre.n - 1] : 0;
            llmem_tok_buf_free(&pre);
        }
    }
    if (status == LLMEM_OK && at_end && text.n > d->prefix_len) {
        /* Everything is written: later pushes continue after it. */
        d->read = d->n;
        d->prefix_len = text.n;
        d->prefix_last = text.p[text.n - 1];
    }
    llmem_tok_buf_free(&text);
    if (status != LLMEM_OK) {
        llmem_tok_buf_free(&outp);
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
    if (!(d->skip_special && d->tok->kind[id] == TOK_KIND_SPECIAL) &&
        token_text(d->tok, id)->p != NULL) {
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
