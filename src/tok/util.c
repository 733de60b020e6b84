/*
 * tok/util.c — the small tools of tok/: a growable buffer, UTF-8 checks and lossy conversion,
 * the GPT-2 byte map, and the two hash tables (strings → ids, id pairs → merges), both open
 * addressing with linear probing at a load factor of at most 1/2, hashed by llmem_hash64.
 */
#include <stdlib.h>
#include <string.h>

#include "core/hash.h"
#include "tok/tok_int.h"

/* ---- buffer --------------------------------------------------------------------------------- */

int llmem_tok_buf_reserve(struct tok_buf *b, size_t extra) {
    if (b->n + extra + 1 <= b->cap)
        return LLMEM_OK;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->n + extra + 1)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (p == NULL)
        return LLMEM_ENOMEM;
    b->p = p;
    b->cap = cap;
    b->p[b->n] = '\0';
    return LLMEM_OK;
}

int llmem_tok_buf_add(struct tok_buf *b, const void *p, size_t n) {
    if (llmem_tok_buf_reserve(b, n) != LLMEM_OK)
        return LLMEM_ENOMEM;
    if (n > 0)
        memcpy(b->p + b->n, p, n);
    b->n += n;
    b->p[b->n] = '\0';
    return LLMEM_OK;
}

void llmem_tok_buf_free(struct tok_buf *b) {
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

/* ---- UTF-8 ---------------------------------------------------------------------------------- */

size_t llmem_tok_utf8_char(const unsigned char *p, size_t n, uint32_t *cp) {
    if (n == 0)
        return 0;
    unsigned c = p[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    size_t len;
    uint32_t v, min;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2, v = c & 0x1F, min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3, v = c & 0x0F, min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4, v = c & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return 0;
        v = (v << 6) | (p[i] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
        return 0;
    *cp = v;
    return len;
}

size_t llmem_tok_utf8_check(const char *p, size_t n) {
    const unsigned char *u = (const unsigned char *)p;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        size_t len = llmem_tok_utf8_char(u + i, n - i, &cp);
        if (len == 0)
            return i;
        i += len;
    }
    return n;
}

int llmem_tok_utf8_put(struct tok_buf *b, uint32_t cp) {
    unsigned char s[4];
    size_t n;
    if (cp < 0x80) {
        s[0] = (unsigned char)cp, n = 1;
    } else if (cp < 0x800) {
        s[0] = (unsigned char)(0xC0 | (cp >> 6));
        s[1] = (unsigned char)(0x80 | (cp & 0x3F)), n = 2;
    } else if (cp < 0x10000) {
        s[0] = (unsigned char)(0xE0 | (cp >> 12));
        s[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        s[2] = (unsigned char)(0x80 | (cp & 0x3F)), n = 3;
    } else {
        s[0] = (unsigned char)(0xF0 | (cp >> 18));
        s[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
        s[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        s[3] = (unsigned char)(0x80 | (cp & 0x3F)), n = 4;
    }
    return llmem_tok_buf_add(b, s, n);
}

/* The length of the longest prefix of p that starts a valid sequence but is cut short or broken
 * (1 to 3): the "maximal subpart" that one U+FFFD replaces. */
static size_t maximal_subpart(const unsigned char *p, size_t n) {
    unsigned c = p[0];
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF)
        len = 2;
    else if (c >= 0xE0 && c <= 0xEF)
        len = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4)
        len = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    else
        return 1;
    size_t i = 1;
    if (i < n && p[i] >= lo && p[i] <= hi) {
        i++;
        while (i < len && i < n && (p[i] & 0xC0) == 0x80)
            i++;
    }
    return i;
}

int llmem_tok_utf8_lossy(struct tok_buf *b, const char *p, size_t n) {
    const unsigned char *u = (const unsigned char *)p;
    size_t i = 0;
    while (i < n) {
        size_t ok = i + llmem_tok_utf8_check(p + i, n - i);
        if (llmem_tok_buf_add(b, p + i, ok - i) != LLMEM_OK)
            return LLMEM_ENOMEM;
        if (ok >= n)
            break;
        if (llmem_tok_utf8_put(b, 0xFFFD) != LLMEM_OK)
            return LLMEM_ENOMEM;
        i = ok + maximal_subpart(u + ok, n - ok);
    }
    return llmem_tok_buf_reserve(b, 0);
}

/* ---- the GPT-2 byte map --------------------------------------------------------------------- */

uint32_t llmem_tok_byte_cp(unsigned b) {
    if (b <= 0x20)
        return 0x100 + b;
    if (b >= 0x7F && b <= 0xA0)
        return 0x100 + 33 + (b - 0x7F);
    if (b == 0xAD)
        return 0x100 + 33 + 34;
    return b;
}

int llmem_tok_cp_byte(uint32_t cp) {
    if ((cp >= 0x21 && cp <= 0x7E) || (cp >= 0xA1 && cp <= 0xAC) || (cp >= 0xAE && cp <= 0xFF))
        return (int)cp;
    if (cp >= 0x100 && cp <= 0x120)
        return (int)(cp - 0x100);
    if (cp >= 0x121 && cp <= 0x142)
        return (int)(cp - 0x121 + 0x7F);
    if (cp == 0x143)
        return 0xAD;
    return -1;
}

/* ---- strings → ids -------------------------------------------------------------------------- */

#define HASH_SEED 0x6c6c6d656d746f6bULL

static size_t table_cap(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n + 2)
        cap *= 2;
    return cap;
}

int llmem_tok_strmap_init(struct tok_strmap *m, size_t n, const struct tok_str *keys) {
    size_t cap = table_cap(n);
    m->slots = malloc(cap * sizeof(*m->slots));
    if (m->slots == NULL)
        return LLMEM_ENOMEM;
    memset(m->slots, 0xFF, cap * sizeof(*m->slots));
    m->mask = cap - 1;
    m->keys = keys;
    return LLMEM_OK;
}

void llmem_tok_strmap_put(struct tok_strmap *m, int32_t id) {
    const struct tok_str *k = &m->keys[id];
    size_t i = (size_t)llmem_hash64(k->p, k->n, HASH_SEED) & m->mask;
    for (;; i = (i + 1) & m->mask) {
        int32_t s = m->slots[i];
        if (s < 0 || (m->keys[s].n == k->n && memcmp(m->keys[s].p, k->p, k->n) == 0)) {
            m->slots[i] = id;
            return;
        }
    }
}

int32_t llmem_tok_strmap_get(const struct tok_strmap *m, const char *s, size_t n) {
    if (m->slots == NULL)
        return -1;
    size_t i = (size_t)llmem_hash64(s, n, HASH_SEED) & m->mask;
    for (;; i = (i + 1) & m->mask) {
        int32_t id = m->slots[i];
        if (id < 0)
            return -1;
        if (m->keys[id].n == n && memcmp(m->keys[id].p, s, n) == 0)
            return id;
    }
}

void llmem_tok_strmap_free(struct tok_strmap *m) {
    free(m->slots);
    m->slots = NULL;
}

/* ---- id pairs → merges ---------------------------------------------------------------------- */

int llmem_tok_mergemap_init(struct tok_mergemap *m, size_t n) {
    size_t cap = table_cap(n);
    m->slots = malloc(cap * sizeof(*m->slots));
    if (m->slots == NULL)
        return LLMEM_ENOMEM;
    for (size_t i = 0; i < cap; i++)
        m->slots[i].key = UINT64_MAX;
    m->mask = cap - 1;
    return LLMEM_OK;
}

static size_t merge_slot(const struct tok_mergemap *m, uint64_t key) {
    size_t i = (size_t)llmem_hash64(&key, sizeof(key), HASH_SEED) & m->mask;
    while (m->slots[i].key != UINT64_MAX && m->slots[i].key != key)
        i = (i + 1) & m->mask;
    return i;
}

void llmem_tok_mergemap_put(struct tok_mergemap *m, int32_t left, int32_t right, int32_t rank,
                            int32_t id) {
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    struct tok_merge *s = &m->slots[merge_slot(m, key)];
    s->key = key;
    s->rank = rank;
    s->id = id;
}

int32_t llmem_tok_merge_get(const struct tok_mergemap *m, int32_t left, int32_t right,
                            int32_t *id) {
    if (m->slots == NULL)
        return -1;
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    const struct tok_merge *s = &m->slots[merge_slot(m, key)];
    if (s->key != key)
        return -1;
    *id = s->id;
    return s->rank;
}

void llmem_tok_mergemap_free(struct tok_mergemap *m) {
    free(m->slots);
    m->slots = NULL;
}
