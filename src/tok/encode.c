/*
 * tok/encode.c — text → ids: added tokens, normalizer, pre-tokenizer, BPE.
 *
 * The text is first cut at added tokens (leftmost-longest match on the raw text); each stretch
 * between them is normalized (NFC, Prepend, Replace), cut into pieces by the pre-tokenizer steps in
 * order (Split by a PCRE2 regex, ByteLevel, Metaspace), and each piece goes through BPE.
 *
 * BPE is the merge-by-rank algorithm of Hugging Face `tokenizers`: the piece starts as one symbol
 * per character (a character outside the vocabulary becomes its <0xNN> byte tokens with
 * byte_fallback, else the unknown token, else nothing); a min-heap holds the candidate pairs
 * ordered by (rank, position), and the lowest is merged until none is left, a popped pair being
 * skipped when either side has changed since it was pushed. A piece of n characters costs
 * O(n log n), so long pieces (a megabyte without spaces) stay fast. With ignore_merges, a piece
 * that is itself in the vocabulary is emitted whole. A vocabulary with scores in place of merges
 * (a GGUF "llama" model) merges by score instead, as SentencePiece does (spm() below).
 */
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "tok/tok_int.h"

#define ENCODE_FUNC "llmem_tokenizer_encode"

size_t llmem_tok_encode_batch = (size_t)64 << 10;

/* ---- output and pieces ---------------------------------------------------------------------- */

struct ids {
    int32_t *p;
    int64_t n, cap;
    int64_t max; /* LLMEM_ERANGE past it */
};

static int ids_push(struct ids *v, int32_t id) {
    if (v->n == v->max)
        return LLMEM_ERANGE;
    if (v->n == v->cap) {
        int64_t cap = v->cap ? 2 * v->cap : 64;
        int32_t *p = realloc(v->p, (size_t)cap * sizeof(*p));
        if (p == NULL)
            return LLMEM_ENOMEM;
        v->p = p, v->cap = cap;
    }
    v->p[v->n++] = id;
    return LLMEM_OK;
}

/* Pieces: spans of one text buffer. */
struct pieces {
    struct tok_buf text;
    size_t *ends; /* (n) end offset of piece i; piece i starts at ends[i − 1] (or 0) */
    size_t n, cap;
};

static int pieces_end(struct pieces *ps) {
    if (ps->n > 0 && ps->ends[ps->n - 1] == ps->text.n)
        return LLMEM_OK; /* no empty pieces */
    if (ps->n == ps->cap) {
        size_t cap = ps->cap ? 2 * ps->cap : 64;
        size_t *p = realloc(ps->ends, cap * sizeof(*p));
        if (p == NULL)
            return LLMEM_ENOMEM;
        ps->ends = p, ps->cap = cap;
    }
    ps->ends[ps->n++] = ps->text.n;
    return LLMEM_OK;
}

static void pieces_reset(struct pieces *ps) {
    ps->text.n = 0;
    ps->n = 0;
}

static void pieces_free(struct pieces *ps) {
    llmem_tok_buf_free(&ps->text);
    free(ps->ends);
}

/* ---- BPE ------------------------------------------------------------------------------------ */

struct sym {
    int32_t id;
    int32_t prev, next; /* −1 at the ends */
    int32_t alive;
    int32_t start, len; /* by score: the symbol's bytes in the piece */
};

struct cand {
    int32_t rank;
    int32_t pos;         /* the left symbol */
    int32_t id;          /* the merged id */
    int32_t left, right; /* the pair's ids when pushed: a popped pair is stale if they changed */
};

struct encoder {
    const struct llmem_tokenizer *tok;
    struct ids out;
    struct pieces a, b; /* the pieces, before and after a step */
    struct tok_buf norm, tmp, src0; /* src0: the first step's input, when it copies it */
    pcre2_match_data *md;
    struct sym *syms;
    size_t n_syms_cap;
    struct cand *heap;
    size_t n_heap, heap_cap;
};

/* The heap is 4-ary: half the depth of a binary heap, and the four children share a cache line
 * or two, which matters when a megabyte-long word puts a million candidates in it. */
#define HEAP_ARITY 4

static int cand_less(const struct cand *x, const struct cand *y) {
    return x->rank != y->rank ? x->rank < y->rank : x->pos < y->pos;
}

static int heap_push(struct encoder *e, struct cand c) {
    if (e->n_heap == e->heap_cap) {
        size_t cap = e->heap_cap ? 2 * e->heap_cap : 256;
        struct cand *p = realloc(e->heap, cap * sizeof(*p));
        if (p == NULL)
            return LLMEM_ENOMEM;
        e->heap = p, e->heap_cap = cap;
    }
    size_t i = e->n_heap++;
    while (i > 0) {
        size_t parent = (i - 1) / HEAP_ARITY;
        if (!cand_less(&c, &e->heap[parent]))
            break;
        e->heap[i] = e->heap[parent];
        i = parent;
    }
    e->heap[i] = c;
    return LLMEM_OK;
}

static struct cand heap_pop(struct encoder *e) {
    struct cand top = e->heap[0];
    struct cand last = e->heap[--e->n_heap];
    size_t i = 0, n = e->n_heap;
    for (;;) {
        size_t first = HEAP_ARITY * i + 1, best = first;
        if (first >= n)
            break;
        size_t end = first + HEAP_ARITY < n ? first + HEAP_ARITY : n;
        for (size_t c = first + 1; c < end; c++)
            if (cand_less(&e->heap[c], &e->heap[best]))
                best = c;
        if (!cand_less(&e->heap[best], &last))
            break;
        e->heap[i] = e->heap[best];
        i = best;
    }
    if (n > 0)
        e->heap[i] = last;
    return top;
}

static int push_pair(struct encoder *e, int32_t pos) {
    int32_t next = e->syms[pos].next, id = 0;
    if (next < 0)
        return LLMEM_OK;
    int32_t rank = llmem_tok_merge_get(&e->tok->merges, e->syms[pos].id, e->syms[next].id, &id);
    if (rank < 0)
        return LLMEM_OK;
    return heap_push(e, (struct cand){rank, pos, id, e->syms[pos].id, e->syms[next].id});
}

static int add_sym(struct encoder *e, size_t *n, int32_t id) {
    if (*n == e->n_syms_cap) {
        size_t cap = e->n_syms_cap ? 2 * e->n_syms_cap : 256;
        struct sym *p = realloc(e->syms, cap * sizeof(*p));
        if (p == NULL)
            return LLMEM_ENOMEM;
        e->syms = p, e->n_syms_cap = cap;
    }
    e->syms[*n] = (struct sym){id, (int32_t)*n - 1, (int32_t)*n + 1, 1, 0, 0};
    (*n)++;
    return LLMEM_OK;
}

/* ---- merging by score (SentencePiece) -------------------------------------------------------- */

/* The pair (pos, next) when their bytes together are a token: ranked by that token's score. */
static int push_scored_pair(struct encoder *e, const char *s, int32_t pos) {
    int32_t next = e->syms[pos].next;
    if (next < 0)
        return LLMEM_OK;
    const struct sym *l = &e->syms[pos], *r = &e->syms[next];
    int32_t id = llmem_tok_strmap_get(&e->tok->vocab, s + l->start, (size_t)(l->len + r->len));
    if (id < 0)
        return LLMEM_OK;
    return heap_push(e, (struct cand){e->tok->score_rank[id], pos, id, l->len, r->len});
}

/* One piece by SentencePiece's BPE (llama.cpp's llm_tokenizer_spm): one symbol per character;
 * the adjacent pair whose concatenation is the best-scoring token merges first (leftmost on a
 * tie), until no pair is a token; a symbol left outside the vocabulary becomes its <0xNN> byte
 * tokens (the unknown token for a byte without one). A popped pair is stale when either side has
 * grown since it was pushed (symbols only grow). */
static int spm(struct encoder *e, const char *s, size_t len) {
    const struct llmem_tokenizer *tok = e->tok;
    int st;
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        size_t cl = llmem_tok_utf8_char((const unsigned char *)s + i, len - i, &cp);
        if (cl == 0)
            cl = 1; /* not reached: the text was checked */
        if (add_sym(e, &n, -1) != LLMEM_OK)
            return LLMEM_ENOMEM;
        e->syms[n - 1].start = (int32_t)i;
        e->syms[n - 1].len = (int32_t)cl;
        i += cl;
    }
    e->syms[n - 1].next = -1;
    e->n_heap = 0;
    for (size_t i = 0; i + 1 < n; i++)
        if (push_scored_pair(e, s, (int32_t)i) != LLMEM_OK)
            return LLMEM_ENOMEM;
    while (e->n_heap > 0) {
        struct cand c = heap_pop(e);
        struct sym *left = &e->syms[c.pos];
        if (!left->alive || left->next < 0 || left->len != c.left)
            continue;
        struct sym *right = &e->syms[left->next];
        if (right->len != c.right)
            continue;
        left->id = c.id;
        left->len += right->len;
        right->alive = 0;
        left->next = right->next;
        if (right->next >= 0)
            e->syms[right->next].prev = c.pos;
        if (left->prev >= 0 && push_scored_pair(e, s, left->prev) != LLMEM_OK)
            return LLMEM_ENOMEM;
        if (push_scored_pair(e, s, c.pos) != LLMEM_OK)
            return LLMEM_ENOMEM;
    }
    for (int32_t i = 0; i >= 0; i = e->syms[i].next) {
        const struct sym *y = &e->syms[i];
        int32_t id =
            y->id >= 0 ? y->id : llmem_tok_strmap_get(&tok->vocab, s + y->start, (size_t)y->len);
        if (id >= 0) {
            if ((st = ids_push(&e->out, id)) != LLMEM_OK)
                return st;
            continue;
        }
        for (int32_t k = 0; k < y->len; k++) {
            int32_t b = tok->byte_ids[(unsigned char)s[y->start + k]];
            if (b < 0)
                b = tok->unk_id;
            if (b >= 0 && (st = ids_push(&e->out, b)) != LLMEM_OK)
                return st;
        }
    }
    return LLMEM_OK;
}

/* ---- merging by rank (BPE) ------------------------------------------------------------------ */

static int bpe(struct encoder *e, const char *s, size_t len) {
    const struct llmem_tokenizer *tok = e->tok;
    int st;
    if (len == 0)
        return LLMEM_OK;
    if (tok->score_rank != NULL)
        return spm(e, s, len);
    if (tok->ignore_merges) {
        int32_t id = llmem_tok_strmap_get(&tok->vocab, s, len);
        if (id >= 0)
            return ids_push(&e->out, id);
    }
    size_t n = 0;
    int last_unk = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        size_t cl = llmem_tok_utf8_char((const unsigned char *)s + i, len - i, &cp);
        if (cl == 0)
            cl = 1; /* not reached: the text was checked */
        int32_t id = llmem_tok_strmap_get(&tok->vocab, s + i, cl);
        if (id >= 0) {
            if (add_sym(e, &n, id) != LLMEM_OK)
                return LLMEM_ENOMEM;
            last_unk = 0;
        } else {
            int all = tok->byte_fallback;
            for (size_t k = 0; all && k < cl; k++)
                all = tok->byte_ids[(unsigned char)s[i + k]] >= 0;
            if (all) {
                for (size_t k = 0; k < cl; k++)
                    if (add_sym(e, &n, tok->byte_ids[(unsigned char)s[i + k]]) != LLMEM_OK)
                        return LLMEM_ENOMEM;
                last_unk = 0;
            } else if (tok->unk_id >= 0 && !(tok->fuse_unk && last_unk)) {
                if (add_sym(e, &n, tok->unk_id) != LLMEM_OK)
                    return LLMEM_ENOMEM;
                last_unk = 1;
            }
        }
        i += cl;
    }
    if (n == 0)
        return LLMEM_OK;
    e->syms[n - 1].next = -1;
    e->n_heap = 0;
    for (size_t i = 0; i + 1 < n; i++)
        if (push_pair(e, (int32_t)i) != LLMEM_OK)
            return LLMEM_ENOMEM;
    while (e->n_heap > 0) {
        struct cand c = heap_pop(e);
        struct sym *left = &e->syms[c.pos];
        if (!left->alive || left->next < 0)
            continue;
        struct sym *right = &e->syms[left->next];
        if (left->id != c.left || right->id != c.right)
            continue;
        left->id = c.id;
        right->alive = 0;
        left->next = right->next;
        if (right->next >= 0)
            e->syms[right->next].prev = c.pos;
        if (left->prev >= 0 && push_pair(e, left->prev) != LLMEM_OK)
            return LLMEM_ENOMEM;
        if (push_pair(e, c.pos) != LLMEM_OK)
            return LLMEM_ENOMEM;
    }
    for (int32_t i = 0; i >= 0; i = e->syms[i].next)
        if ((st = ids_push(&e->out, e->syms[i].id)) != LLMEM_OK)
            return st;
    return LLMEM_OK;
}

/* ---- normalizer ----------------------------------------------------------------------------- */

/* Replaces every occurrence of pat in b by rep. */
static int replace_all(struct tok_buf *b, struct tok_buf *tmp, const struct tok_str *pat,
                       const struct tok_str *rep) {
    tmp->n = 0;
    size_t i = 0;
    while (i < b->n) {
        const char *hit = b->n - i >= pat->n ? memmem(b->p + i, b->n - i, pat->p, pat->n) : NULL;
        size_t end = hit ? (size_t)(hit - b->p) : b->n;
        if (llmem_tok_buf_add(tmp, b->p + i, end - i) != LLMEM_OK)
            return LLMEM_ENOMEM;
        if (hit == NULL)
            break;
        if (llmem_tok_buf_add(tmp, rep->p, rep->n) != LLMEM_OK)
            return LLMEM_ENOMEM;
        i = end + pat->n;
    }
    struct tok_buf t = *b;
    *b = *tmp;
    *tmp = t;
    return LLMEM_OK;
}

static int normalize(struct encoder *e, const char *s, size_t len) {
    const struct llmem_tokenizer *tok = e->tok;
    e->norm.n = 0;
    if (llmem_tok_buf_add(&e->norm, s, len) != LLMEM_OK)
        return LLMEM_ENOMEM;
    for (int i = 0; i < tok->n_norms; i++) {
        const struct tok_norm *nm = &tok->norms[i];
        if (nm->kind == TOK_NORM_PREPEND) {
            if (e->norm.n == 0)
                continue;
            e->tmp.n = 0;
            if (llmem_tok_buf_add(&e->tmp, nm->a.p, nm->a.n) != LLMEM_OK ||
                llmem_tok_buf_add(&e->tmp, e->norm.p, e->norm.n) != LLMEM_OK)
                return LLMEM_ENOMEM;
            struct tok_buf t = e->norm;
            e->norm = e->tmp;
            e->tmp = t;
        } else if (nm->kind == TOK_NORM_NFC) {
            e->tmp.n = 0;
            if (llmem_tok_nfc(&e->tmp, e->norm.p, e->norm.n) != LLMEM_OK)
                return LLMEM_ENOMEM;
            struct tok_buf t = e->norm;
            e->norm = e->tmp;
            e->tmp = t;
        } else if (replace_all(&e->norm, &e->tmp, &nm->a, &nm->b) != LLMEM_OK) {
            return LLMEM_ENOMEM;
        }
    }
    return LLMEM_OK;
}

/* ---- pre-tokenizer steps -------------------------------------------------------------------- */

/* Where a step stands in its input when it stops after a batch of pieces (the first step
 * only, see encode_stretch): the next match's start, the end of the last piece, and whether the
 * whole input is done. */
struct cursor {
    size_t at, last;
    int done;
};

/* Cuts [s, s + len) at the matches of re, keeping both the matches and the text between them;
 * from cur on, stopping once out holds `batch` bytes (SIZE_MAX: the whole input). */
static int split_regex(struct encoder *e, const pcre2_code *re, const char *s, size_t len,
                       struct pieces *out, struct cursor *cur, size_t batch) {
    size_t at = cur->at, last = cur->last;
    while (at < len) {
        if (out->text.n >= batch) {
            cur->at = at, cur->last = last;
            return LLMEM_OK;
        }
        int rc = pcre2_match(re, (PCRE2_SPTR)s, len, at, PCRE2_NO_UTF_CHECK, e->md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH)
            break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof(msg));
            LLMEM_ERROR_AS(ENCODE_FUNC, "regex match failed: %s", (const char *)msg);
            return LLMEM_EINVAL;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) { /* an empty match: step over one character */
            at = ms + 1;
            while (at < len && ((unsigned char)s[at] & 0xC0) == 0x80)
                at++;
            continue;
        }
        if (ms > last && (llmem_tok_buf_add(&out->text, s + last, ms - last) || pieces_end(out)))
            return LLMEM_ENOMEM;
        if (llmem_tok_buf_add(&out->text, s + ms, me - ms) || pieces_end(out))
            return LLMEM_ENOMEM;
        last = at = me;
    }
    if (len > last && (llmem_tok_buf_add(&out->text, s + last, len - last) || pieces_end(out)))
        return LLMEM_ENOMEM;
    cur->at = cur->last = len;
    cur->done = 1;
    return LLMEM_OK;
}

static int byte_level(struct encoder *e, const struct tok_pre *pre, const char *s, size_t len,
                      struct pieces *out, struct cursor *cur, size_t batch) {
    /* The optional space and regex cut first (into tmp pieces), then the byte map. The first
     * step's input (cut in batches) is kept in src0 between them. */
    struct tok_buf *in = batch == SIZE_MAX ? &e->tmp : &e->src0;
    struct pieces cut = {0};
    int status = LLMEM_OK;
    if (cur->at == 0 && cur->last == 0) {
        in->n = 0;
        if (pre->add_prefix_space && (len == 0 || s[0] != ' ')) {
            if (llmem_tok_buf_add(in, " ", 1) != LLMEM_OK)
                return LLMEM_ENOMEM;
        }
        if (llmem_tok_buf_add(in, s, len) != LLMEM_OK)
            return LLMEM_ENOMEM;
    }
    if (pre->re != NULL) {
        status = split_regex(e, pre->re, in->p, in->n, &cut, cur, batch);
    } else if (llmem_tok_buf_add(&cut.text, in->p, in->n) != LLMEM_OK || pieces_end(&cut)) {
        status = LLMEM_ENOMEM;
    } else {
        cur->done = 1;
    }
    for (size_t i = 0, start = 0; status == LLMEM_OK && i < cut.n; start = cut.ends[i++]) {
        for (size_t k = start; k < cut.ends[i] && status == LLMEM_OK; k++)
            status =
                llmem_tok_utf8_put(&out->text, llmem_tok_byte_cp((unsigned char)cut.text.p[k]));
        if (status == LLMEM_OK)
            status = pieces_end(out);
    }
    pieces_free(&cut);
    return status;
}

static int metaspace(const struct tok_pre *pre, const char *s, size_t len, int at_start,
                     struct pieces *out, struct cursor *cur, size_t batch) {
    const struct tok_str *r = &pre->repl;
    size_t base = out->text.n;
    /* with split every space begins a piece: a batch ends before one, past `batch` bytes */
    const size_t from = cur->at;
    size_t to = len;
    if (pre->split && batch != SIZE_MAX && len - from > batch) {
        const char *sp = memchr(s + from + batch, ' ', len - from - batch);
        to = sp != NULL ? (size_t)(sp - s) : len;
    }
    cur->at = cur->last = to;
    cur->done = to == len;
    const int prepend = from == 0 && (pre->prepend == TOK_PREPEND_ALWAYS ||
                                      (pre->prepend == TOK_PREPEND_FIRST && at_start));
    s += from, len = to - from;
    if (prepend && !(len > 0 && s[0] == ' ') && !(len >= r->n && memcmp(s, r->p, r->n) == 0)) {
        if (llmem_tok_buf_add(&out->text, r->p, r->n) != LLMEM_OK)
            return LLMEM_ENOMEM;
    }
    for (size_t i = 0; i < len; i++) {
        int st = s[i] == ' ' ? llmem_tok_buf_add(&out->text, r->p, r->n)
                             : llmem_tok_buf_add(&out->text, s + i, 1);
        if (st != LLMEM_OK)
            return LLMEM_ENOMEM;
    }
    if (!pre->split)
        return pieces_end(out);
    /* MergedWithNext: every replacement starts a new piece. */
    size_t end = out->text.n;
    for (size_t i = base + 1; i + r->n <= end; i++) {
        if (memcmp(out->text.p + i, r->p, r->n) == 0) {
            size_t keep = out->text.n;
            out->text.n = i;
            int st = pieces_end(out);
            out->text.n = keep;
            if (st != LLMEM_OK)
                return st;
            i += r->n - 1;
        }
    }
    return pieces_end(out);
}

/* One pre-tokenizer step over s[0, len) into out, from cur on (batch: see split_regex). */
static int pre_step(struct encoder *e, const struct tok_pre *pre, const char *s, size_t len,
                    int at_start, struct pieces *out, struct cursor *cur, size_t batch) {
    if (pre->kind == TOK_PRE_SPLIT)
        return split_regex(e, pre->re, s, len, out, cur, batch);
    if (pre->kind == TOK_PRE_BYTELEVEL)
        return byte_level(e, pre, s, len, out, cur, batch);
    return metaspace(pre, s, len, at_start, out, cur, batch);
}

/* One stretch of text between added tokens. at_start: it begins the text. */
static int encode_stretch(struct encoder *e, const char *s, size_t len, int at_start) {
    const struct llmem_tokenizer *tok = e->tok;
    int status = normalize(e, s, len);
    if (status != LLMEM_OK || e->norm.n == 0)
        return status;
    /* The first step cuts the normalized text a batch of pieces at a time, and each batch goes
     * through the other steps and BPE before the next is cut: what is held at once is a batch's
     * pieces, not the whole text's (a text far longer than any context, refused once its ids
     * pass the limit, costs the memory of one batch). Every step cuts each of its input's
     * pieces on its own, so batches give the pieces the whole text gives. */
    struct cursor first = {0};
    while (!first.done) {
        const int first_batch = first.at == 0 && first.last == 0;
        pieces_reset(&e->a);
        if (tok->n_pres == 0) { /* one piece: too long for the ids left is known at once */
            if (tok->max_token_bytes > 0 &&
                e->norm.n / tok->max_token_bytes > (size_t)(e->out.max - e->out.n))
                return LLMEM_ERANGE;
            if (llmem_tok_buf_add(&e->a.text, e->norm.p, e->norm.n) != LLMEM_OK ||
                pieces_end(&e->a))
                return LLMEM_ENOMEM;
            first.done = 1;
        } else if ((status = pre_step(e, &tok->pres[0], e->norm.p, e->norm.n, at_start, &e->a,
                                      &first, llmem_tok_encode_batch)) != LLMEM_OK) {
            return status;
        }
        for (int k = 1; k < tok->n_pres; k++) {
            pieces_reset(&e->b);
            for (size_t i = 0, start = 0; i < e->a.n; start = e->a.ends[i++]) {
                struct cursor whole = {0};
                if ((status = pre_step(e, &tok->pres[k], e->a.text.p + start, e->a.ends[i] - start,
                                       at_start && first_batch && i == 0, &e->b, &whole,
                                       SIZE_MAX)) != LLMEM_OK)
                    return status;
            }
            struct pieces t = e->a;
            e->a = e->b;
            e->b = t;
        }
        for (size_t i = 0, start = 0; i < e->a.n; start = e->a.ends[i++])
            if ((status = bpe(e, e->a.text.p + start, e->a.ends[i] - start)) != LLMEM_OK)
                return status;
    }
    return LLMEM_OK;
}

/* ---- added tokens --------------------------------------------------------------------------- */

static int is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/* The added token starting at text[i] (longest), or NULL. */
static const struct tok_added *added_at(const struct llmem_tokenizer *tok, const char *text,
                                        size_t len, size_t i) {
    const int32_t *list = tok->added_by_byte[(unsigned char)text[i]];
    for (; list != NULL && *list >= 0; list++) {
        const struct tok_added *a = &tok->added[*list];
        if (a->content.n <= len - i && memcmp(text + i, a->content.p, a->content.n) == 0)
            return a;
    }
    return NULL;
}

static int encode_text(struct encoder *e, const char *text, size_t len) {
    const struct llmem_tokenizer *tok = e->tok;
    size_t start = 0;
    for (size_t i = 0; i < len;) {
        const struct tok_added *a = tok->n_added ? added_at(tok, text, len, i) : NULL;
        if (a == NULL) {
            i++;
            continue;
        }
        size_t end = i, next = i + a->content.n;
        while (a->lstrip && end > start && is_space(text[end - 1]))
            end--;
        while (a->rstrip && next < len && is_space(text[next]))
            next++;
        int status = encode_stretch(e, text + start, end - start, start == 0);
        if (status == LLMEM_OK)
            status = ids_push(&e->out, a->id);
        if (status != LLMEM_OK)
            return status;
        i = start = next;
    }
    return encode_stretch(e, text + start, len - start, start == 0);
}

int llmem_tokenizer_encode(const struct llmem_tokenizer *tok, const char *text, size_t len,
                           int32_t **ids, int64_t *n) {
    return llmem_tokenizer_encode_max(tok, text, len, INT64_MAX, ids, n);
}

int llmem_tokenizer_encode_max(const struct llmem_tokenizer *tok, const char *text, size_t len,
                               int64_t max_ids, int32_t **ids, int64_t *n) {
    LLMEM_ASSERT(tok != NULL && (text != NULL || len == 0) && ids != NULL && n != NULL &&
                 max_ids >= 0);
    *ids = NULL;
    *n = 0;
    size_t bad = llmem_tok_utf8_check(text, len);
    if (bad < len) {
        LLMEM_ERROR("text is not valid UTF-8 (byte %zu of %zu is 0x%02X)", bad, len,
                    (unsigned char)text[bad]);
        return LLMEM_EINVAL;
    }
    struct encoder e = {.tok = tok, .out = {.max = max_ids}};
    int status = LLMEM_OK;
    for (int k = 0; k < tok->n_pres && e.md == NULL; k++) {
        if (tok->pres[k].re != NULL) {
            e.md = pcre2_match_data_create_from_pattern(tok->pres[k].re, NULL);
            if (e.md == NULL)
                status = LLMEM_ENOMEM;
        }
    }
    if (status == LLMEM_OK)
        status = encode_text(&e, text, len);
    if (status == LLMEM_ENOMEM)
        LLMEM_ERROR("out of memory encoding %zu bytes", len);
    else if (status == LLMEM_ERANGE)
        LLMEM_ERROR("the text has more than %lld tokens", (long long)max_ids);
    pcre2_match_data_free(e.md);
    pieces_free(&e.a);
    pieces_free(&e.b);
    llmem_tok_buf_free(&e.norm);
    llmem_tok_buf_free(&e.tmp);
    llmem_tok_buf_free(&e.src0);
    free(e.syms);
    free(e.heap);
    if (status != LLMEM_OK) {
        free(e.out.p);
        return status;
    }
    if (e.out.p == NULL && (e.out.p = malloc(sizeof(int32_t))) == NULL) {
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    *ids = e.out.p;
    *n = e.out.n;
    return LLMEM_OK;
}
