/*
 * tok/nfc.c — Unicode normalization form C (the NFC normalizer of Qwen's tokenizers).
 *
 * The algorithm of UAX #15: full canonical decomposition (tables generated from the Unicode
 * Character Database by scripts/gen_nfc_tables.py, Hangul syllables by arithmetic), canonical
 * ordering of combining marks by their combining class, then canonical composition of each
 * unblocked pair with a primary composite. Text made only of code points below U+0300 is already
 * in NFC and is copied as it is, so ASCII and Latin text pays one scan.
 */
#include <stdlib.h>
#include <string.h>

#include "tok/tok_int.h"

struct nfc_ccc {
    uint32_t cp;
    uint8_t ccc;
};
struct nfc_decomp {
    uint32_t cp;
    uint16_t off; /* into nfc_pool */
    uint8_t n;
};
struct nfc_comp {
    uint32_t a, b, c; /* a + b compose to c */
};

#include "tok/nfc_tables.h"

#define N_CCC    (sizeof(nfc_ccc) / sizeof(nfc_ccc[0]))
#define N_DECOMP (sizeof(nfc_decomp) / sizeof(nfc_decomp[0]))
#define N_COMP   (sizeof(nfc_comp) / sizeof(nfc_comp[0]))

/* Hangul syllables (UAX #15, §3.12 of the standard). */
#define S_BASE  0xAC00
#define L_BASE  0x1100
#define V_BASE  0x1161
#define T_BASE  0x11A7
#define L_COUNT 19
#define V_COUNT 21
#define T_COUNT 28
#define N_COUNT (V_COUNT * T_COUNT)
#define S_COUNT (L_COUNT * N_COUNT)

static unsigned ccc_of(uint32_t cp) {
    if (cp < 0x300)
        return 0;
    size_t lo = 0, hi = N_CCC;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (nfc_ccc[mid].cp < cp)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < N_CCC && nfc_ccc[lo].cp == cp ? nfc_ccc[lo].ccc : 0;
}

static const struct nfc_decomp *decomp_of(uint32_t cp) {
    size_t lo = 0, hi = N_DECOMP;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (nfc_decomp[mid].cp < cp)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < N_DECOMP && nfc_decomp[lo].cp == cp ? &nfc_decomp[lo] : NULL;
}

/* The primary composite of a + b, 0 when there is none. */
static uint32_t compose(uint32_t a, uint32_t b) {
    if (a >= L_BASE && a < L_BASE + L_COUNT && b >= V_BASE && b < V_BASE + V_COUNT)
        return S_BASE + ((a - L_BASE) * V_COUNT + (b - V_BASE)) * T_COUNT;
    if (a >= S_BASE && a < S_BASE + S_COUNT && (a - S_BASE) % T_COUNT == 0 && b > T_BASE &&
        b < T_BASE + T_COUNT)
        return a + (b - T_BASE);
    size_t lo = 0, hi = N_COMP;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        const struct nfc_comp *c = &nfc_comp[mid];
        if (c->a < a || (c->a == a && c->b < b))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < N_COMP && nfc_comp[lo].a == a && nfc_comp[lo].b == b ? nfc_comp[lo].c : 0;
}

struct cps {
    uint32_t *p;
    size_t n, cap;
};

static int cps_push(struct cps *v, uint32_t cp) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? 2 * v->cap : 64;
        uint32_t *p = realloc(v->p, cap * sizeof(*p));
        if (p == NULL)
            return LLMEM_ENOMEM;
        v->p = p, v->cap = cap;
    }
    v->p[v->n++] = cp;
    return LLMEM_OK;
}

int llmem_tok_nfc(struct tok_buf *out, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n && (u[i] < 0x80 || (u[i] >= 0xC2 && u[i] <= 0xCB))) /* below U+0300 */
        i += u[i] < 0x80 ? 1 : 2;
    if (i >= n)
        return llmem_tok_buf_add(out, s, n);

    struct cps v = {0};
    int status = LLMEM_OK;
    /* Decompose. */
    for (i = 0; i < n && status == LLMEM_OK;) {
        uint32_t cp = 0;
        size_t cl = llmem_tok_utf8_char(u + i, n - i, &cp);
        if (cl == 0) /* not reached: the text was checked */
            cp = 0xFFFD, cl = 1;
        i += cl;
        if (cp >= S_BASE && cp < S_BASE + S_COUNT) {
            uint32_t si = cp - S_BASE;
            status = cps_push(&v, L_BASE + si / N_COUNT);
            if (status == LLMEM_OK)
                status = cps_push(&v, V_BASE + (si % N_COUNT) / T_COUNT);
            if (status == LLMEM_OK && si % T_COUNT != 0)
                status = cps_push(&v, T_BASE + si % T_COUNT);
            continue;
        }
        const struct nfc_decomp *d = cp < 0xC0 ? NULL : decomp_of(cp);
        if (d == NULL) {
            status = cps_push(&v, cp);
            continue;
        }
        for (unsigned k = 0; k < d->n && status == LLMEM_OK; k++)
            status = cps_push(&v, nfc_pool[d->off + k]);
    }
    /* Canonical order: marks sorted by combining class, stable, between starters. */
    for (size_t k = 1; status == LLMEM_OK && k < v.n; k++) {
        unsigned c = ccc_of(v.p[k]);
        if (c == 0)
            continue;
        for (size_t j = k; j > 0; j--) {
            unsigned prev = ccc_of(v.p[j - 1]);
            if (prev <= c)
                break;
            uint32_t t = v.p[j];
            v.p[j] = v.p[j - 1];
            v.p[j - 1] = t;
        }
    }
    /* Compose each character with the last starter when nothing between blocks it. */
    size_t r = 0;
    long starter = -1;
    unsigned last_ccc = 0;
    for (size_t k = 0; status == LLMEM_OK && k < v.n; k++) {
        uint32_t cp = v.p[k];
        unsigned c = ccc_of(cp);
        if (starter >= 0) {
            int adjacent = (size_t)starter == r - 1;
            if (adjacent || (c != 0 && last_ccc < c)) {
                uint32_t composite = compose(v.p[starter], cp);
                if (composite != 0) {
                    v.p[starter] = composite;
                    continue;
                }
            }
        }
        if (c == 0)
            starter = (long)r;
        last_ccc = c;
        v.p[r++] = cp;
    }
    for (size_t k = 0; status == LLMEM_OK && k < r; k++)
        status = llmem_tok_utf8_put(out, v.p[k]);
    free(v.p);
    return status;
}
