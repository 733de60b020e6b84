/*
 * engine/grammar.c — constrained decoding (llmem/grammar.h).
 *
 * A schema compiles into a grammar over bytes: rules of alternatives, each a sequence of byte sets
 * and references to rules, ending in END (the alternatives of a rule separated by ALT). Repetition
 * is right recursion, bounded counts are unrolled, so no rule is left recursive.
 *
 * A matcher holds a set of stacks (the parses still alive). A stack lists positions in the
 * elements, the top last: the top is a byte set, those below it where each enclosing sequence
 * goes on. A byte moves every stack whose top set holds it past that set, then expands the new
 * top: END pops, a reference pushes each of its rule's alternatives (the continuation below
 * them, left out when it is an END: the tail of a right recursion does not grow the stack). An
 * empty stack is a complete output.
 *
 * The allowed tokens: a walk of the vocabulary's trie of token bytes, advancing the set of
 * stacks a byte at a time and leaving a branch as soon as no stack survives. Inside a string,
 * where every plain character leads the set back to itself, a subtree of plain characters alone
 * is allowed whole without being walked (its tokens are one range of ids); inside a string of a
 * bounded length, where every plain character leads each set to the next of a chain, such a
 * subtree is allowed whole where its tokens all end within the chain, else walked along it. The shortest
 * completion of a stack is the sum of each of its positions' shortest way to its sequence's end
 * (a fixpoint over the rules, computed once): with too few tokens left, only tokens that shorten
 * it by their whole length are allowed. A walk may be split over a pool's threads: the trie's
 * subtrees (the largest split by their first bytes) are tasks, each thread walking them from the
 * current set with a walker of its own (its sets and its loop), writing the tokens it allows
 * into the shared mask (each token is in one subtree) — the serial walk's mask.
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include "core/hash.h"
#include "core/log.h"
#include "engine/grammar_int.h"
#include "llmem/grammar.h"
#include "llmem/pool.h"
#include "llmem/size.h"
#include "llmem/status.h"
#include "llmem/tokenizer.h"

/* ---- the grammar ---------------------------------------------------------------------------- */

enum { G_END, G_ALT, G_REF, G_SET };

struct gel {
    uint8_t type;
    uint8_t meets; /* G_REF: the rule's alternatives may be pushed on the same stack from two
                    * references (mark_meets) */
    uint32_t v;    /* G_REF: the rule; G_SET: the set */
};

#define WS_INDENT     20   /* spaces or tabs after a newline between two tokens of the JSON */
#define STACK_MAX     512  /* positions of one stack; a deeper parse is dropped */
#define REPEAT_MAX    256  /* counts a schema may bound (items, string length) */
#define TOKEN_MAX     256  /* bytes of the longest token the matcher walks */
#define EXPAND_MAX    1024 /* references expanded in a row without a byte between */
#define NUM_DIGITS    16   /* digits of a number's integer part and of its fraction, at most */
#define CANON_MAX     4096 /* bytes of a shortest completion a tight budget spells token by token */
#define MASK_CACHE    8    /* masks a matcher keeps, by the stacks they were made for */
/* A walk split over threads: a trie node whose subtree holds more than 1/WTASK_SPLIT of the
 * vocabulary (a space and a letter, in a byte-level BPE) is split into its own tokens and its
 * children's subtrees, down to WTASK_DEPTH bytes */
#define WTASK_SPLIT   64
#define WTASK_DEPTH   3
#define UNREACHABLE   (INT32_MAX / 4)
#define MISTRAL_CALLS "[TOOL_CALLS]" /* the control token a Mistral tool call opens with */

struct llmem_grammar {
    struct gel *el;
    int32_t n_el, cap_el;
    int32_t *rule_at; /* the rule's first element; -1 while not yet defined */
    int32_t n_rules, cap_rules;
    uint8_t (*sets)[32];
    int32_t n_sets, cap_sets;
    int32_t root;
    int32_t *min_len; /* (n_el) the fewest bytes from an element to its sequence's end */
};

/* A sequence under construction (one rule's alternatives). */
struct seq {
    struct gel *el;
    int32_t n, cap;
};

struct builder {
    struct llmem_grammar *g;
    char *why;
    size_t why_size;
    int failed; /* LLMEM_EINVAL or LLMEM_ENOMEM once something failed */
    const cJSON *root;
    struct {
        const cJSON *node;
        int32_t rule;
    } memo[LLMEM_GRAMMAR_MAX_RULES];
    int n_memo;
    int32_t ws, value, string, chars, ch, number, integer, object_any, array_any;
    int depth;
};

static int fail_enomem(struct builder *b) {
    if (!b->failed)
        snprintf(b->why, b->why_size, "out of memory");
    b->failed = LLMEM_ENOMEM;
    return -1;
}

static int refuse(struct builder *b, const char *fmt, const char *what) {
    if (!b->failed)
        snprintf(b->why, b->why_size, fmt, what);
    b->failed = LLMEM_EINVAL;
    return -1;
}

static int grow(void **p, int32_t *cap, int32_t need, size_t size) {
    if (need <= *cap)
        return 0;
    int32_t c = *cap > 0 ? *cap : 16;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, (size_t)c * size);
    if (q == NULL)
        return -1;
    *p = q, *cap = c;
    return 0;
}

/* The bytes of g's tables with n more elements. */
static int64_t table_bytes(const struct llmem_grammar *g, int64_t n) {
    return (g->n_el + n) * (int64_t)(sizeof(*g->el) + sizeof(*g->min_len)) +
           (int64_t)g->n_rules * (int64_t)sizeof(*g->rule_at) + (int64_t)g->n_sets * 32;
}

/* Whether n more elements keep the grammar within LLMEM_GRAMMAR_MAX_BYTES (else refused). */
static int fits(struct builder *b, int64_t n) {
    if (table_bytes(b->g, n) <= LLMEM_GRAMMAR_MAX_BYTES)
        return 1;
    char max[16];
    llmem_size_format_short(LLMEM_GRAMMAR_MAX_BYTES, max, sizeof(max));
    refuse(b,
           "the schema is too large (its grammar would take more than the %s a request's "
           "grammar is planned)",
           max);
    return 0;
}

static void seq_push(struct builder *b, struct seq *s, uint8_t type, uint32_t v) {
    if (!fits(b, s->n + 1))
        return;
    if (grow((void **)&s->el, &s->cap, s->n + 1, sizeof(*s->el)) != 0) {
        fail_enomem(b);
        return;
    }
    s->el[s->n++] = (struct gel){.type = type, .v = v};
}

static int32_t new_rule(struct builder *b) {
    struct llmem_grammar *g = b->g;
    if (g->n_rules >= LLMEM_GRAMMAR_MAX_RULES)
        return refuse(b, "the schema is too large (more than %s rules)", "4096");
    if (grow((void **)&g->rule_at, &g->cap_rules, g->n_rules + 1, sizeof(*g->rule_at)) != 0)
        return fail_enomem(b);
    g->rule_at[g->n_rules] = -1;
    return g->n_rules++;
}

/* The rule's alternatives from s (freed), ALT between them as s holds them, END last. */
static int32_t define(struct builder *b, int32_t rule, struct seq *s) {
    struct llmem_grammar *g = b->g;
    if (rule >= 0 && !b->failed && fits(b, s->n + 1) &&
        grow((void **)&g->el, &g->cap_el, g->n_el + s->n + 1, sizeof(*g->el)) == 0) {
        g->rule_at[rule] = g->n_el;
        if (s->n > 0) /* (an empty rule, ε, has no elements) */
            memcpy(g->el + g->n_el, s->el, (size_t)s->n * sizeof(*s->el));
        g->n_el += s->n;
        g->el[g->n_el++] = (struct gel){.type = G_END};
    } else if (!b->failed) {
        fail_enomem(b);
    }
    free(s->el);
    *s = (struct seq){0};
    return b->failed ? -1 : rule;
}

static int32_t set_of(struct builder *b, const uint8_t bits[32]) {
    struct llmem_grammar *g = b->g;
    for (int32_t i = 0; i < g->n_sets; i++)
        if (memcmp(g->sets[i], bits, 32) == 0)
            return i;
    if (grow((void **)&g->sets, &g->cap_sets, g->n_sets + 1, sizeof(*g->sets)) != 0)
        return fail_enomem(b);
    memcpy(g->sets[g->n_sets], bits, 32);
    return g->n_sets++;
}

/* The bytes lo … hi as a set (pairs of a range string: "az09"). */
static void push_ranges(struct builder *b, struct seq *s, const char *ranges) {
    uint8_t bits[32] = {0};
    for (const unsigned char *r = (const unsigned char *)ranges; r[0] && r[1]; r += 2)
        for (int c = r[0]; c <= r[1]; c++)
            bits[c >> 3] |= (uint8_t)(1u << (c & 7));
    int32_t set = set_of(b, bits);
    if (set >= 0)
        seq_push(b, s, G_SET, (uint32_t)set);
}

static void push_lit(struct builder *b, struct seq *s, const char *text, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const char r[3] = {text[i], text[i], 0};
        push_ranges(b, s, r);
    }
}

#define LIT(s, text) push_lit(b, s, text, sizeof(text) - 1)

static void push_ref(struct builder *b, struct seq *s, int32_t rule) {
    if (rule >= 0)
        seq_push(b, s, G_REF, (uint32_t)rule);
}

static void push_alt(struct builder *b, struct seq *s) {
    seq_push(b, s, G_ALT, 0);
}

/* ---- JSON's own rules ----------------------------------------------------------------------- */

static void json_rules(struct builder *b) {
    struct seq s = {0};
    /* ws: nothing, or a space or newline then up to WS_INDENT spaces or tabs: a model's
     * pretty-printing fits, and a random one's runs of blank lines do not eat its tokens (two
     * alternatives, as few parses alive as any whitespace rule allows) */
    int32_t indent = -1;
    for (int i = 0; i < WS_INDENT; i++) {
        int32_t r = new_rule(b);
        push_alt(b, &s); /* ε first */
        push_ranges(b, &s, "  \t\t");
        push_ref(b, &s, indent);
        indent = define(b, r, &s);
    }
    int32_t ws = new_rule(b);
    push_alt(b, &s); /* ε first */
    push_ranges(b, &s, "  \n\n");
    push_ref(b, &s, indent);
    b->ws = define(b, ws, &s);
    /* a string's character: UTF-8 as RFC 3629 allows it, or an escape */
    int32_t esc = new_rule(b), ch = new_rule(b), chars = new_rule(b);
    push_ranges(b, &s, "\"\"\\\\//bbffnnrrtt");
    push_alt(b, &s);
    LIT(&s, "u");
    for (int i = 0; i < 4; i++)
        push_ranges(b, &s, "09afAF");
    define(b, esc, &s);
    push_ranges(b, &s, " !#[]\x7f");
    push_alt(b, &s);
    push_ranges(b, &s, "\xc2\xdf"), push_ranges(b, &s, "\x80\xbf");
    push_alt(b, &s);
    LIT(&s, "\xe0"), push_ranges(b, &s, "\xa0\xbf"), push_ranges(b, &s, "\x80\xbf");
    push_alt(b, &s);
    push_ranges(b, &s, "\xe1\xec\xee\xef"), push_ranges(b, &s, "\x80\xbf"),
        push_ranges(b, &s, "\x80\xbf");
    push_alt(b, &s);
    LIT(&s, "\xed"), push_ranges(b, &s, "\x80\x9f"), push_ranges(b, &s, "\x80\xbf");
    push_alt(b, &s);
    LIT(&s, "\xf0"), push_ranges(b, &s, "\x90\xbf"), push_ranges(b, &s, "\x80\xbf"),
        push_ranges(b, &s, "\x80\xbf");
    push_alt(b, &s);
    push_ranges(b, &s, "\xf1\xf3");
    for (int i = 0; i < 3; i++)
        push_ranges(b, &s, "\x80\xbf");
    push_alt(b, &s);
    LIT(&s, "\xf4"), push_ranges(b, &s, "\x80\x8f"), push_ranges(b, &s, "\x80\xbf"),
        push_ranges(b, &s, "\x80\xbf");
    push_alt(b, &s);
    LIT(&s, "\\"), push_ref(b, &s, esc);
    b->ch = define(b, ch, &s);
    push_alt(b, &s); /* chars: ε | ch chars */
    push_ref(b, &s, b->ch), push_ref(b, &s, chars);
    b->chars = define(b, chars, &s);
    b->string = new_rule(b);
    LIT(&s, "\""), push_ref(b, &s, b->chars), LIT(&s, "\"");
    define(b, b->string, &s);
    /* numbers: every one a finite double, as JSON parsers read them (an integer part and a
     * fraction of up to NUM_DIGITS digits each, an exponent of up to 2: |x| < 10^(16 + 99)) */
    int32_t upto[NUM_DIGITS]; /* upto[k]: at most k digits */
    upto[0] = new_rule(b);
    define(b, upto[0], &s); /* (ε) */
    for (int k = 1; k < NUM_DIGITS; k++) {
        upto[k] = new_rule(b);
        push_alt(b, &s);
        push_ranges(b, &s, "09"), push_ref(b, &s, upto[k - 1]);
        define(b, upto[k], &s);
    }
    int32_t intpart = new_rule(b);
    LIT(&s, "0");
    push_alt(b, &s);
    push_ranges(b, &s, "19"), push_ref(b, &s, upto[NUM_DIGITS - 1]);
    define(b, intpart, &s);
    int32_t sign = new_rule(b);
    push_alt(b, &s);
    LIT(&s, "-");
    define(b, sign, &s);
    b->integer = new_rule(b);
    push_ref(b, &s, sign), push_ref(b, &s, intpart);
    define(b, b->integer, &s);
    int32_t frac = new_rule(b), exp = new_rule(b);
    push_alt(b, &s);
    LIT(&s, "."), push_ranges(b, &s, "09"), push_ref(b, &s, upto[NUM_DIGITS - 1]);
    define(b, frac, &s);
    push_alt(b, &s);
    push_ranges(b, &s, "eeEE"), push_ranges(b, &s, "++--"), push_ranges(b, &s, "09"),
        push_ref(b, &s, upto[1]);
    push_alt(b, &s);
    push_ranges(b, &s, "eeEE"), push_ranges(b, &s, "09"), push_ref(b, &s, upto[1]);
    define(b, exp, &s);
    b->number = new_rule(b);
    push_ref(b, &s, b->integer), push_ref(b, &s, frac), push_ref(b, &s, exp);
    define(b, b->number, &s);
    /* any value, object and array */
    b->value = new_rule(b), b->object_any = new_rule(b), b->array_any = new_rule(b);
    int32_t obj_more = new_rule(b), arr_more = new_rule(b);
    push_ref(b, &s, b->object_any);
    push_alt(b, &s), push_ref(b, &s, b->array_any);
    push_alt(b, &s), push_ref(b, &s, b->string);
    push_alt(b, &s), push_ref(b, &s, b->number);
    push_alt(b, &s), LIT(&s, "true");
    push_alt(b, &s), LIT(&s, "false");
    push_alt(b, &s), LIT(&s, "null");
    define(b, b->value, &s);
    LIT(&s, "{"), push_ref(b, &s, b->ws), LIT(&s, "}");
    push_alt(b, &s);
    LIT(&s, "{"), push_ref(b, &s, b->ws), push_ref(b, &s, b->string), push_ref(b, &s, b->ws);
    LIT(&s, ":"), push_ref(b, &s, b->ws), push_ref(b, &s, b->value), push_ref(b, &s, b->ws);
    push_ref(b, &s, obj_more);
    define(b, b->object_any, &s);
    LIT(&s, "}");
    push_alt(b, &s);
    LIT(&s, ","), push_ref(b, &s, b->ws), push_ref(b, &s, b->string), push_ref(b, &s, b->ws);
    LIT(&s, ":"), push_ref(b, &s, b->ws), push_ref(b, &s, b->value), push_ref(b, &s, b->ws);
    push_ref(b, &s, obj_more);
    define(b, obj_more, &s);
    LIT(&s, "["), push_ref(b, &s, b->ws), LIT(&s, "]");
    push_alt(b, &s);
    LIT(&s, "["), push_ref(b, &s, b->ws), push_ref(b, &s, b->value), push_ref(b, &s, b->ws);
    push_ref(b, &s, arr_more);
    define(b, b->array_any, &s);
    LIT(&s, "]");
    push_alt(b, &s);
    LIT(&s, ","), push_ref(b, &s, b->ws), push_ref(b, &s, b->value), push_ref(b, &s, b->ws);
    push_ref(b, &s, arr_more);
    define(b, arr_more, &s);
}

/* ---- schemas -------------------------------------------------------------------------------- */

static int32_t schema_rule(struct builder *b, const cJSON *schema);

/* A JSON value's text as a literal alternative. */
static void push_json(struct builder *b, struct seq *s, const cJSON *v) {
    char *text = cJSON_PrintUnformatted(v);
    if (text == NULL) {
        fail_enomem(b);
        return;
    }
    push_lit(b, s, text, strlen(text));
    cJSON_free(text);
}

static int is_annotation(const char *k) {
    static const char *const ok[] = {"title",   "description", "$schema", "examples",
                                     "default", "$id",         "$comment", "strict",
                                     "$defs",   "definitions", "deprecated", "readOnly",
                                     "writeOnly"};
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++)
        if (strcmp(k, ok[i]) == 0)
            return 1;
    return 0;
}

static int get_count(struct builder *b, const cJSON *schema, const char *key, int64_t dflt,
                     int64_t *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(schema, key);
    *out = dflt;
    if (v == NULL)
        return 0;
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0) || v->valuedouble != floor(v->valuedouble))
        return refuse(b, "'%s' must be a whole number ≥ 0", key);
    if (v->valuedouble > REPEAT_MAX)
        return refuse(b, "'%s' is above 256, the most the grammar unrolls", key);
    *out = (int64_t)v->valuedouble;
    return 0;
}

/* `item` min … max times (max < 0: no bound), separated by sep (a rule, or -1) and followed by
 * `close` (a literal): the rules after k items, k = 1 …; returns the rule after the first. */
static int32_t repeat_rules(struct builder *b, int32_t item, int32_t sep_ws, const char *close,
                            int64_t min, int64_t max) {
    /* after[k] for k = 1 … last, where last = max (bounded) or min (then self-recursive) */
    const int64_t last = max >= 0 ? max : (min > 1 ? min : 1);
    int32_t first;
    struct seq s = {0};
    int32_t *after = malloc((size_t)(last + 1) * sizeof(*after));
    if (after == NULL)
        return fail_enomem(b);
    for (int64_t k = 1; k <= last; k++)
        after[k] = new_rule(b);
    for (int64_t k = 1; k <= last && !b->failed; k++) {
        int any = 0;
        if (k >= min) {
            push_lit(b, &s, close, strlen(close));
            any = 1;
        }
        if (max < 0 || k < max) {
            if (any)
                push_alt(b, &s);
            LIT(&s, ",");
            push_ref(b, &s, sep_ws), push_ref(b, &s, item);
            push_ref(b, &s, after[k < last ? k + 1 : last]);
        }
        define(b, after[k], &s);
    }
    first = b->failed ? -1 : after[1];
    free(after);
    return first;
}

static int32_t object_rule(struct builder *b, const cJSON *schema) {
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(schema, "properties");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(schema, "required");
    const cJSON *add = cJSON_GetObjectItemCaseSensitive(schema, "additionalProperties");
    if (props != NULL && !cJSON_IsObject(props))
        return refuse(b, "'%s' must be an object", "properties");
    if (req != NULL && !cJSON_IsArray(req))
        return refuse(b, "'%s' must be an array of names", "required");
    const cJSON *r;
    cJSON_ArrayForEach(r, req) {
        if (!cJSON_IsString(r))
            return refuse(b, "'%s' must be an array of names", "required");
        if (cJSON_GetObjectItemCaseSensitive(props, r->valuestring) == NULL)
            return refuse(b, "'required' names '%s', which is not among the properties",
                          r->valuestring);
    }
    struct seq s = {0};
    if (props == NULL || props->child == NULL) { /* a map, or any object */
        if (add == NULL || cJSON_IsTrue(add))
            return b->object_any;
        if (cJSON_IsFalse(add)) {
            int32_t rule = new_rule(b);
            LIT(&s, "{"), push_ref(b, &s, b->ws), LIT(&s, "}");
            return define(b, rule, &s);
        }
        int32_t value = schema_rule(b, add), rule = new_rule(b), member = new_rule(b);
        push_ref(b, &s, b->string), push_ref(b, &s, b->ws), LIT(&s, ":");
        push_ref(b, &s, b->ws), push_ref(b, &s, value), push_ref(b, &s, b->ws);
        define(b, member, &s);
        int32_t more = repeat_rules(b, member, b->ws, "}", 0, -1);
        LIT(&s, "{"), push_ref(b, &s, b->ws), LIT(&s, "}");
        push_alt(b, &s);
        LIT(&s, "{"), push_ref(b, &s, b->ws), push_ref(b, &s, member), push_ref(b, &s, more);
        return define(b, rule, &s);
    }
    if (add != NULL && !cJSON_IsFalse(add))
        return refuse(b, "'%s' other than false beside 'properties' is not supported",
                      "additionalProperties");
    /* member i, then S(i, first) for i = n … 0: the members from i on, in order, the optional
     * ones left out or not; `first`: no comma before the next */
    const int n = cJSON_GetArraySize(props);
    int32_t *members = malloc((size_t)n * sizeof(*members));
    int32_t *tail = malloc((size_t)(2 * n + 2) * sizeof(*tail));
    if (members == NULL || tail == NULL) {
        free(members), free(tail);
        return fail_enomem(b);
    }
    int i = 0;
    const cJSON *p;
    cJSON_ArrayForEach(p, props) {
        int32_t value = schema_rule(b, p), m = new_rule(b);
        cJSON *key = cJSON_CreateString(p->string);
        if (key == NULL) {
            fail_enomem(b);
        } else {
            push_json(b, &s, key);
            cJSON_Delete(key);
        }
        push_ref(b, &s, b->ws), LIT(&s, ":"), push_ref(b, &s, b->ws);
        push_ref(b, &s, value), push_ref(b, &s, b->ws);
        members[i++] = define(b, m, &s);
    }
    for (int k = 0; k < 2; k++) { /* S(n, ·): nothing more */
        tail[2 * n + k] = new_rule(b);
        push_alt(b, &s);
        define(b, tail[2 * n + k], &s);
    }
    i = n - 1;
    for (p = cJSON_GetArrayItem(props, n - 1); i >= 0 && !b->failed; i--) {
        const cJSON *prop = cJSON_GetArrayItem(props, i);
        int required = 0;
        cJSON_ArrayForEach(r, req) required |= strcmp(r->valuestring, prop->string) == 0;
        for (int first = 0; first < 2; first++) {
            int32_t rule = new_rule(b);
            if (!first)
                LIT(&s, ","), push_ref(b, &s, b->ws);
            push_ref(b, &s, members[i]), push_ref(b, &s, tail[2 * (i + 1)]);
            if (!required)
                push_alt(b, &s), push_ref(b, &s, tail[2 * (i + 1) + first]);
            tail[2 * i + first] = define(b, rule, &s);
        }
    }
    int32_t rule = new_rule(b);
    LIT(&s, "{"), push_ref(b, &s, b->ws), push_ref(b, &s, tail[1]), LIT(&s, "}");
    free(members), free(tail);
    return define(b, rule, &s);
}

static int32_t array_rule(struct builder *b, const cJSON *schema) {
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(schema, "items");
    int64_t min, max;
    if (get_count(b, schema, "minItems", 0, &min) || get_count(b, schema, "maxItems", -1, &max))
        return -1;
    if (max >= 0 && max < min)
        return refuse(b, "'%s' is below minItems", "maxItems");
    int32_t value = items != NULL ? schema_rule(b, items) : b->value;
    struct seq s = {0};
    int32_t item = new_rule(b), rule = new_rule(b);
    push_ref(b, &s, value), push_ref(b, &s, b->ws);
    define(b, item, &s);
    if (max == 0) {
        LIT(&s, "["), push_ref(b, &s, b->ws), LIT(&s, "]");
        return define(b, rule, &s);
    }
    int32_t more = repeat_rules(b, item, b->ws, "]", min, max);
    if (min == 0) {
        LIT(&s, "["), push_ref(b, &s, b->ws), LIT(&s, "]");
        push_alt(b, &s);
    }
    LIT(&s, "["), push_ref(b, &s, b->ws), push_ref(b, &s, item), push_ref(b, &s, more);
    return define(b, rule, &s);
}

static int32_t string_rule(struct builder *b, const cJSON *schema) {
    int64_t min, max;
    if (get_count(b, schema, "minLength", 0, &min) || get_count(b, schema, "maxLength", -1, &max))
        return -1;
    if (min == 0 && max < 0)
        return b->string;
    if (max >= 0 && max < min)
        return refuse(b, "'%s' is below minLength", "maxLength");
    /* opt[k]: at most k more characters, then the quote */
    struct seq s = {0};
    int32_t next = -1;
    if (max < 0) {
        next = new_rule(b);
        push_ref(b, &s, b->chars), LIT(&s, "\"");
        define(b, next, &s);
    } else {
        for (int64_t k = 0; k <= max - min; k++) {
            int32_t r = new_rule(b);
            LIT(&s, "\"");
            if (k > 0)
                push_alt(b, &s), push_ref(b, &s, b->ch), push_ref(b, &s, next);
            next = define(b, r, &s);
        }
    }
    int32_t rule = new_rule(b);
    LIT(&s, "\"");
    for (int64_t k = 0; k < min; k++)
        push_ref(b, &s, b->ch);
    push_ref(b, &s, next);
    return define(b, rule, &s);
}

static int32_t type_rule(struct builder *b, const cJSON *schema, const char *type) {
    if (strcmp(type, "string") == 0)
        return string_rule(b, schema);
    if (strcmp(type, "number") == 0)
        return b->number;
    if (strcmp(type, "integer") == 0)
        return b->integer;
    if (strcmp(type, "object") == 0)
        return object_rule(b, schema);
    if (strcmp(type, "array") == 0)
        return array_rule(b, schema);
    struct seq s = {0};
    int32_t rule = new_rule(b);
    if (strcmp(type, "boolean") == 0)
        LIT(&s, "true"), push_alt(b, &s), LIT(&s, "false");
    else if (strcmp(type, "null") == 0)
        LIT(&s, "null");
    else {
        free(s.el);
        return refuse(b, "type '%s' is not a JSON Schema type", type);
    }
    return define(b, rule, &s);
}

/* The schema a $ref names (within the root document). */
static const cJSON *resolve(struct builder *b, const char *ref) {
    if (strcmp(ref, "#") == 0)
        return b->root;
    const char *name = NULL;
    const cJSON *defs = NULL;
    if (strncmp(ref, "#/$defs/", 8) == 0)
        defs = cJSON_GetObjectItemCaseSensitive(b->root, "$defs"), name = ref + 8;
    else if (strncmp(ref, "#/definitions/", 14) == 0)
        defs = cJSON_GetObjectItemCaseSensitive(b->root, "definitions"), name = ref + 14;
    const cJSON *target = name != NULL ? cJSON_GetObjectItemCaseSensitive(defs, name) : NULL;
    if (target == NULL)
        refuse(b, "'$ref' '%s' names no definition of this schema", ref);
    return target;
}

static int32_t schema_rule(struct builder *b, const cJSON *schema) {
    if (b->failed)
        return -1;
    if (cJSON_IsTrue(schema))
        return b->value;
    if (!cJSON_IsObject(schema))
        return refuse(b, "a schema must be an object or true, not %s",
                      cJSON_IsFalse(schema) ? "false" : "another JSON value");
    for (int i = 0; i < b->n_memo; i++) /* compiled, or being compiled (recursion) */
        if (b->memo[i].node == schema)
            return b->memo[i].rule;
    if (++b->depth > 64) {
        b->depth--;
        return refuse(b, "the schema nests deeper than %s levels", "64");
    }
    int32_t rule = new_rule(b);
    if (rule < 0 || b->n_memo == LLMEM_GRAMMAR_MAX_RULES) {
        b->depth--;
        return rule < 0 ? -1 : refuse(b, "the schema is too large (more than %s rules)", "4096");
    }
    b->memo[b->n_memo].node = schema, b->memo[b->n_memo++].rule = rule;
    static const char *const known[] = {
        "type",      "properties", "required",  "additionalProperties", "items",   "minItems",
        "maxItems",  "enum",       "const",     "anyOf",                "oneOf",   "$ref",
        "minLength", "maxLength"};
    const cJSON *k;
    cJSON_ArrayForEach(k, schema) {
        int ok = is_annotation(k->string);
        for (size_t i = 0; !ok && i < sizeof(known) / sizeof(known[0]); i++)
            ok = strcmp(k->string, known[i]) == 0;
        if (!ok) {
            b->depth--;
            return refuse(b, "'%s' is not supported in a schema", k->string);
        }
    }
    struct seq s = {0};
    const cJSON *ref = cJSON_GetObjectItemCaseSensitive(schema, "$ref");
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(schema, "enum");
    const cJSON *cn = cJSON_GetObjectItemCaseSensitive(schema, "const");
    const cJSON *any = cJSON_GetObjectItemCaseSensitive(schema, "anyOf");
    if (any == NULL)
        any = cJSON_GetObjectItemCaseSensitive(schema, "oneOf");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(schema, "type");
    if (ref != NULL) {
        const cJSON *target = cJSON_IsString(ref) ? resolve(b, ref->valuestring) : NULL;
        if (!cJSON_IsString(ref))
            refuse(b, "'%s' must be a string", "$ref");
        push_ref(b, &s, target != NULL ? schema_rule(b, target) : -1);
    } else if (cn != NULL) {
        push_json(b, &s, cn);
    } else if (en != NULL) {
        if (!cJSON_IsArray(en) || en->child == NULL)
            refuse(b, "'%s' must be a non-empty array", "enum");
        const cJSON *v;
        cJSON_ArrayForEach(v, en) {
            if (v != en->child)
                push_alt(b, &s);
            push_json(b, &s, v);
        }
    } else if (any != NULL) {
        if (!cJSON_IsArray(any) || any->child == NULL)
            refuse(b, "'%s' must be a non-empty array of schemas", any->string);
        const cJSON *v;
        cJSON_ArrayForEach(v, any) {
            if (v != any->child)
                push_alt(b, &s);
            push_ref(b, &s, schema_rule(b, v));
        }
    } else if (cJSON_IsString(type)) {
        push_ref(b, &s, type_rule(b, schema, type->valuestring));
    } else if (cJSON_IsArray(type) && type->child != NULL) {
        const cJSON *v;
        cJSON_ArrayForEach(v, type) {
            if (!cJSON_IsString(v))
                refuse(b, "'%s' must name types", "type");
            if (v != type->child)
                push_alt(b, &s);
            push_ref(b, &s, cJSON_IsString(v) ? type_rule(b, schema, v->valuestring) : -1);
        }
    } else if (type != NULL) {
        refuse(b, "'%s' must be a type's name or a list of them", "type");
    } else if (cJSON_GetObjectItemCaseSensitive(schema, "properties") != NULL) {
        push_ref(b, &s, object_rule(b, schema));
    } else if (cJSON_GetObjectItemCaseSensitive(schema, "items") != NULL) {
        push_ref(b, &s, array_rule(b, schema));
    } else {
        push_ref(b, &s, b->value);
    }
    b->depth--;
    return define(b, rule, &s);
}

/* ---- the fewest bytes to an end ------------------------------------------------------------- */

static int32_t add_sat(int32_t a, int32_t b) {
    return a >= UNREACHABLE || b >= UNREACHABLE ? UNREACHABLE : a + b;
}

static int compute_min_len(struct llmem_grammar *g) {
    int32_t *rule_min = malloc((size_t)g->n_rules * sizeof(*rule_min));
    g->min_len = malloc((size_t)g->n_el * sizeof(*g->min_len));
    if (rule_min == NULL || g->min_len == NULL) {
        free(rule_min);
        return LLMEM_ENOMEM;
    }
    for (int32_t r = 0; r < g->n_rules; r++)
        rule_min[r] = UNREACHABLE;
    for (int changed = 1; changed;) {
        changed = 0;
        for (int32_t i = g->n_el - 1; i >= 0; i--) {
            const struct gel *e = &g->el[i];
            g->min_len[i] = e->type == G_END || e->type == G_ALT ? 0
                            : e->type == G_SET ? add_sat(1, g->min_len[i + 1])
                                               : add_sat(rule_min[e->v], g->min_len[i + 1]);
        }
        for (int32_t r = 0; r < g->n_rules; r++) {
            int32_t best = UNREACHABLE;
            for (int32_t i = g->rule_at[r];; i++) {
                if (i == g->rule_at[r] || g->el[i - 1].type == G_ALT)
                    best = g->min_len[i] < best ? g->min_len[i] : best;
                if (g->el[i].type == G_END)
                    break;
            }
            if (best < rule_min[r])
                rule_min[r] = best, changed = 1;
        }
    }
    free(rule_min);
    return LLMEM_OK;
}

/* Marks the references to a rule whose alternatives expand may push on the same stack twice. A
 * reference that ends its sequence pushes them in its place (the stack below, then the
 * alternative), any other one above the element after it: two references to the rule push the
 * same stack only if one of them ends its sequence (two others differ in the element below). */
static int mark_meets(struct llmem_grammar *g) {
    uint8_t *refs = calloc((size_t)g->n_rules, 1), *tails = calloc((size_t)g->n_rules, 1);
    if (refs == NULL || tails == NULL) {
        free(refs), free(tails);
        return LLMEM_ENOMEM;
    }
    for (int32_t i = 0; i < g->n_el; i++)
        if (g->el[i].type == G_REF) {
            const uint32_t r = g->el[i].v;
            refs[r] += refs[r] < 2;
            tails[r] |= g->el[i + 1].type == G_END || g->el[i + 1].type == G_ALT;
        }
    for (int32_t i = 0; i < g->n_el; i++)
        g->el[i].meets = g->el[i].type == G_REF && refs[g->el[i].v] == 2 && tails[g->el[i].v];
    free(refs), free(tails);
    return LLMEM_OK;
}

void llmem_grammar_free(struct llmem_grammar *g) {
    if (g == NULL)
        return;
    free(g->el), free(g->rule_at), free(g->sets), free(g->min_len);
    free(g);
}

int64_t llmem_grammar_bytes(const struct llmem_grammar *g) {
    return table_bytes(g, 0);
}

/* The tables cut to what they hold (llmem_grammar_bytes is then what they take). */
static void shrink(struct llmem_grammar *g) {
    void *p;
    if ((p = realloc(g->el, (size_t)g->n_el * sizeof(*g->el))) != NULL)
        g->el = p, g->cap_el = g->n_el;
    if ((p = realloc(g->rule_at, (size_t)g->n_rules * sizeof(*g->rule_at))) != NULL)
        g->rule_at = p, g->cap_rules = g->n_rules;
    if (g->n_sets > 0 && (p = realloc(g->sets, (size_t)g->n_sets * 32)) != NULL)
        g->sets = p, g->cap_sets = g->n_sets;
}

/* A compilation: the documents (schemas, NULL: json_object), each of the tools' the parameters of
 * one tool (names set: then the root is a call of one of them as `format` writes it), else the
 * one schema. */
static int compile(const char *const *docs, const size_t *lens, const char *const *names, int n,
                   enum llmem_tool_format format, char *why, size_t why_size,
                   struct llmem_grammar **out) {
    LLMEM_ASSERT(why != NULL && why_size > 0 && out != NULL && n >= 1);
    *out = NULL;
    why[0] = '\0';
    cJSON **doc = calloc((size_t)n, sizeof(*doc));
    struct builder *b = calloc(1, sizeof(*b));
    struct llmem_grammar *g = calloc(1, sizeof(*g));
    if (doc == NULL || b == NULL || g == NULL) {
        free(doc), free(b), free(g);
        snprintf(why, why_size, "out of memory");
        return LLMEM_ENOMEM;
    }
    b->g = g, b->why = why, b->why_size = why_size;
    json_rules(b);
    struct seq s = {0};
    g->root = new_rule(b);
    /* tools: the calls, alternatives, in a rule of their own that the root refers to (a matcher
     * starts on the root's first alternative) */
    const int32_t body = names != NULL ? new_rule(b) : g->root;
    const int hermes = format == LLMEM_TOOL_FORMAT_HERMES,
              mistral = format == LLMEM_TOOL_FORMAT_MISTRAL;
    for (int i = 0; i < n && !b->failed; i++) {
        if (docs[i] != NULL && (doc[i] = cJSON_ParseWithLength(docs[i], lens[i])) == NULL) {
            refuse(b, "%s is not JSON", names != NULL ? "a tool's parameters" : "the schema");
            break;
        }
        b->root = doc[i], b->n_memo = 0; /* each document's $refs are its own */
        int32_t top = doc[i] != NULL ? schema_rule(b, doc[i]) : b->object_any;
        if (names == NULL) {
            push_ref(b, &s, top);
            continue;
        }
        /* {"name": NAME, "arguments": ARGS} ("parameters" for Llama 3; Mistral's in an array
         * after its token), whitespace between as JSON allows */
        cJSON *name = cJSON_CreateString(names[i]);
        if (name == NULL) {
            fail_enomem(b);
            break;
        }
        if (i > 0)
            push_alt(b, &s);
        if (hermes)
            LIT(&s, "<tool_call>\n");
        if (mistral)
            LIT(&s, MISTRAL_CALLS), push_ref(b, &s, b->ws), LIT(&s, "["), push_ref(b, &s, b->ws);
        LIT(&s, "{"), push_ref(b, &s, b->ws), LIT(&s, "\"name\""), push_ref(b, &s, b->ws);
        LIT(&s, ":"), push_ref(b, &s, b->ws), push_json(b, &s, name);
        push_ref(b, &s, b->ws), LIT(&s, ","), push_ref(b, &s, b->ws);
        if (hermes || mistral)
            LIT(&s, "\"arguments\"");
        else
            LIT(&s, "\"parameters\"");
        push_ref(b, &s, b->ws), LIT(&s, ":"), push_ref(b, &s, b->ws), push_ref(b, &s, top);
        push_ref(b, &s, b->ws), LIT(&s, "}");
        if (hermes)
            LIT(&s, "\n</tool_call>");
        if (mistral)
            push_ref(b, &s, b->ws), LIT(&s, "]");
        cJSON_Delete(name);
    }
    define(b, body, &s);
    if (names != NULL) {
        push_ref(b, &s, body);
        define(b, g->root, &s);
    }
    for (int32_t r = 0; !b->failed && r < g->n_rules; r++)
        if (g->rule_at[r] < 0)
            fail_enomem(b); /* (every rule made is defined; a failure left one undefined) */
    int status = b->failed;
    if (status == LLMEM_OK &&
        ((status = compute_min_len(g)) != LLMEM_OK || (status = mark_meets(g)) != LLMEM_OK))
        snprintf(why, why_size, "out of memory");
    if (status == LLMEM_OK && g->min_len[g->rule_at[g->root]] >= UNREACHABLE) {
        snprintf(why, why_size, "the schema admits no finite value");
        status = LLMEM_EINVAL;
    }
    free(b);
    for (int i = 0; i < n; i++)
        cJSON_Delete(doc[i]);
    free(doc);
    if (status != LLMEM_OK) {
        llmem_grammar_free(g);
        return status;
    }
    shrink(g);
    *out = g;
    return LLMEM_OK;
}

int llmem_grammar_compile(const char *schema, size_t len, char *why, size_t why_size,
                          struct llmem_grammar **out) {
    return compile(&schema, &len, NULL, 1, LLMEM_TOOL_FORMAT_HERMES, why, why_size, out);
}

int llmem_grammar_compile_tools(const struct llmem_grammar_tool *tools, int n,
                                enum llmem_tool_format format, char *why, size_t why_size,
                                struct llmem_grammar **out) {
    LLMEM_ASSERT(tools != NULL && n >= 1 && n <= LLMEM_GRAMMAR_MAX_TOOLS && why != NULL &&
                 why_size > 0);
    const char *docs[LLMEM_GRAMMAR_MAX_TOOLS], *names[LLMEM_GRAMMAR_MAX_TOOLS];
    size_t lens[LLMEM_GRAMMAR_MAX_TOOLS];
    if ((unsigned)format > LLMEM_TOOL_FORMAT_MISTRAL) {
        snprintf(why, why_size, "tool format %d is not one of enum llmem_tool_format", format);
        return LLMEM_EINVAL;
    }
    for (int i = 0; i < n; i++) {
        docs[i] = tools[i].parameters, lens[i] = tools[i].len, names[i] = tools[i].name;
        /* a name is written into the grammar as a JSON string's characters: one that needs an
         * escape, or none, names no function a model could call */
        const char *c = names[i];
        for (; c != NULL && *c != '\0' && *c != '"' && *c != '\\' && (unsigned char)*c >= ' '; c++)
            ;
        if (names[i] == NULL || names[i][0] == '\0' || *c != '\0') {
            snprintf(why, why_size,
                     "tool %d's name is empty or holds a quote, a backslash or a "
                     "control character",
                     i);
            return LLMEM_EINVAL;
        }
    }
    return compile(docs, lens, names, n, format, why, why_size, out);
}

/* ---- the vocabulary ------------------------------------------------------------------------- */

struct tnode {
    int32_t child, sibling;   /* the first child, the next sibling; −1: none */
    int32_t tok_first, tok_n; /* the tokens that end here: ids[tok_first, + tok_n) */
    int32_t sub_end;          /* and those of its whole subtree: ids[tok_first, sub_end) */
    uint16_t deepest;         /* the longest token's length in its subtree (from the root) */
    uint8_t byte;
    uint8_t plain; /* its byte and every byte below it plain (a string's own characters) */
};

/* A part of a mask's walk for one thread (llmem_grammar_allowed_on): trie node `node`, reached
 * from the root by path[0, len) (its own byte last), its tokens and, unless self, the walk below
 * it. */
struct wtask {
    int32_t node;
    uint8_t path[WTASK_DEPTH];
    uint8_t len, self;
};

struct llmem_grammar_vocab {
    int32_t n_vocab;
    struct tnode *nodes; /* node 0 the root */
    int32_t n_nodes, cap_nodes;
    struct wtask *tasks; /* the walk's parts, the largest first */
    int32_t n_tasks;
    int32_t *ids; /* tokens grouped by their node */
    int32_t *len; /* (n_vocab) each token's bytes; −1: not walked (special, empty, too long) */
    int64_t *off; /* (n_vocab) where they start in bytes */
    char *bytes;
    int64_t n_bytes, cap_bytes;
};

void llmem_grammar_vocab_free(struct llmem_grammar_vocab *v) {
    if (v == NULL)
        return;
    free(v->nodes), free(v->ids), free(v->len), free(v->off), free(v->bytes), free(v->tasks);
    free(v);
}

/* node's child for byte, made when its newest child is another: tokens inserted in the order of
 * their bytes share with the one before the path of their common prefix, so that newest child
 * is the only one to look at. */
static int32_t child_of(struct llmem_grammar_vocab *v, int32_t node, uint8_t byte) {
    const int32_t c = v->nodes[node].child;
    if (c >= 0 && v->nodes[c].byte == byte)
        return c;
    if (grow((void **)&v->nodes, &v->cap_nodes, v->n_nodes + 1, sizeof(*v->nodes)) != 0)
        return -1;
    struct tnode *n = &v->nodes[v->n_nodes];
    *n = (struct tnode){.child = -1, .sibling = v->nodes[node].child, .byte = byte};
    v->nodes[node].child = v->n_nodes;
    return v->n_nodes++;
}

int32_t llmem_grammar_vocab_size(const struct llmem_grammar_vocab *v) {
    return v->n_vocab;
}

const char *llmem_grammar_vocab_token(const struct llmem_grammar_vocab *v, int32_t id,
                                      size_t *len) {
    if (id < 0 || id >= v->n_vocab || v->len[id] <= 0)
        return NULL;
    *len = (size_t)v->len[id];
    return v->bytes + v->off[id];
}

/* A byte that stands for itself inside a JSON string (printable ASCII but for '"' and '\\', and
 * DEL): where every one of them moves a walk's sets alike (a string's body, a chain), the
 * tokens of a subtree of such bytes alone are allowed without a walk (struct tnode.plain). */
static const uint8_t PLAIN[32] = {0,    0,    0,    0,    0xfb, 0xff, 0xff, 0xff,
                                  0xff, 0xff, 0xff, 0xef, 0xff, 0xff, 0xff, 0xff};

static int plain_byte(uint8_t c) {
    return PLAIN[c >> 3] >> (c & 7) & 1;
}

/* A token's bytes, for sorting the vocabulary by them. */
struct tok_ref {
    const char *p;
    int32_t len, id;
};

static int by_bytes(const void *a, const void *b) {
    const struct tok_ref *x = a, *y = b;
    const int c = memcmp(x->p, y->p, (size_t)(x->len < y->len ? x->len : y->len));
    return c != 0 ? c : (x->len > y->len) - (x->len < y->len);
}

struct wtask_size {
    struct wtask t;
    int64_t size;
};

static int by_size(const void *a, const void *b) {
    const struct wtask_size *x = a, *y = b;
    return (x->size < y->size) - (x->size > y->size);
}

/* Adds node c (at depth len, reached by path) as tasks: itself with its subtree, or (large, not too
 * deep) itself alone and each child's subtree. */
static int add_tasks(const struct llmem_grammar_vocab *v, const int64_t *sub, int32_t c,
                     uint8_t *path, int len, struct wtask_size **list, int32_t *n, int32_t *cap) {
    path[len - 1] = v->nodes[c].byte;
    const int split =
        sub[c] > v->n_vocab / WTASK_SPLIT && len < WTASK_DEPTH && v->nodes[c].child >= 0;
    if (grow((void **)list, cap, *n + 1, sizeof(**list)) != 0)
        return -1;
    struct wtask_size *e = &(*list)[(*n)++];
    memset(e, 0, sizeof(*e));
    e->t.node = c, e->t.len = (uint8_t)len, e->t.self = (uint8_t)split;
    memcpy(e->t.path, path, (size_t)len);
    e->size = split ? v->nodes[c].tok_n : sub[c];
    for (int32_t k = split ? v->nodes[c].child : -1; k >= 0; k = v->nodes[k].sibling)
        if (add_tasks(v, sub, k, path, len + 1, list, n, cap) != 0)
            return -1;
    return 0;
}

/* The walk's parts (struct wtask), the largest first, so that a pool's threads finish together. */
static int make_tasks(struct llmem_grammar_vocab *v) {
    int64_t *sub = malloc((size_t)v->n_nodes * sizeof(*sub)); /* tokens in each subtree */
    if (sub == NULL)
        return -1;
    for (int32_t i = v->n_nodes - 1; i >= 0; i--) { /* (a child comes after its parent) */
        sub[i] = v->nodes[i].tok_n;
        for (int32_t k = v->nodes[i].child; k >= 0; k = v->nodes[k].sibling)
            sub[i] += sub[k];
    }
    struct wtask_size *list = NULL;
    int32_t n = 0, cap = 0;
    uint8_t path[WTASK_DEPTH];
    int status = 0;
    for (int32_t c = v->nodes[0].child; status == 0 && c >= 0; c = v->nodes[c].sibling)
        status = add_tasks(v, sub, c, path, 1, &list, &n, &cap);
    free(sub);
    if (status == 0 && n > 0 && (v->tasks = malloc((size_t)n * sizeof(*v->tasks))) == NULL)
        status = -1;
    if (status == 0) {
        if (n > 1) /* (no tasks at all where the vocabulary holds only special tokens) */
            qsort(list, (size_t)n, sizeof(*list), by_size);
        for (int32_t i = 0; i < n; i++)
            v->tasks[i] = list[i].t;
        v->n_tasks = n;
    }
    free(list);
    return status;
}

int llmem_grammar_vocab_create(const struct llmem_tokenizer *tok,
                               struct llmem_grammar_vocab **out) {
    LLMEM_ASSERT(tok != NULL && out != NULL);
    const int32_t n = llmem_tokenizer_vocab_size(tok);
    struct llmem_grammar_vocab *v = calloc(1, sizeof(*v));
    int32_t *node_of = v != NULL ? malloc((size_t)n * sizeof(*node_of)) : NULL;
    int ok = v != NULL && node_of != NULL;
    if (ok) {
        v->n_vocab = n;
        v->len = malloc((size_t)n * sizeof(*v->len));
        v->ids = malloc((size_t)n * sizeof(*v->ids));
        v->off = malloc((size_t)n * sizeof(*v->off));
        ok = v->len != NULL && v->ids != NULL && v->off != NULL &&
             grow((void **)&v->nodes, &v->cap_nodes, 1024, sizeof(*v->nodes)) == 0;
    }
    if (ok) {
        v->nodes[0] = (struct tnode){.child = -1, .sibling = -1};
        v->n_nodes = 1;
    }
    /* every token's bytes, then the tokens in the order of their bytes into the trie */
    char bytes[TOKEN_MAX];
    const int32_t calls = llmem_tokenizer_token_id(tok, MISTRAL_CALLS);
    for (int32_t id = 0; ok && id < n; id++) {
        size_t len = 0;
        node_of[id] = -1;
        v->len[id] = -1;
        if ((llmem_tokenizer_is_special(tok, id) && id != calls) ||
            llmem_tokenizer_token_bytes(tok, id, bytes, sizeof(bytes), &len) != LLMEM_OK ||
            len == 0)
            continue;
        if (v->n_bytes + (int64_t)len > v->cap_bytes) {
            int64_t cap = v->cap_bytes > 0 ? 2 * v->cap_bytes : 1 << 16;
            char *p = realloc(v->bytes, (size_t)(cap + TOKEN_MAX));
            ok = p != NULL;
            if (ok)
                v->bytes = p, v->cap_bytes = cap;
        }
        if (ok) {
            memcpy(v->bytes + v->n_bytes, bytes, len);
            v->off[id] = v->n_bytes;
            v->n_bytes += (int64_t)len;
            v->len[id] = (int32_t)len;
        }
    }
    struct tok_ref *order = ok ? malloc((size_t)n * sizeof(*order)) : NULL;
    int32_t m = 0;
    ok = ok && order != NULL;
    for (int32_t id = 0; ok && id < n; id++)
        if (v->len[id] > 0)
            order[m++] = (struct tok_ref){v->bytes + v->off[id], v->len[id], id};
    if (ok)
        qsort(order, (size_t)m, sizeof(*order), by_bytes);
    for (int32_t k = 0; ok && k < m; k++) {
        int32_t node = 0;
        for (int32_t i = 0; i < order[k].len && node >= 0; i++)
            node = child_of(v, node, (uint8_t)order[k].p[i]);
        ok = node >= 0;
        node_of[order[k].id] = node;
    }
    free(order);
    /* each node's tokens together (a counting sort by node) */
    for (int32_t id = 0; ok && id < n; id++)
        if (node_of[id] >= 0)
            v->nodes[node_of[id]].tok_n++;
    int32_t at = 0;
    for (int32_t i = 0; ok && i < v->n_nodes; i++)
        v->nodes[i].tok_first = at, at += v->nodes[i].tok_n, v->nodes[i].tok_n = 0;
    for (int32_t id = 0; ok && id < n; id++)
        if (node_of[id] >= 0) {
            struct tnode *t = &v->nodes[node_of[id]];
            v->ids[t->tok_first + t->tok_n++] = id;
        }
    free(node_of);
    /* the subtrees' token ranges and plain bytes (nodes are numbered in the order of a walk: a
     * subtree's nodes, and so its tokens, are consecutive; a child after its parent) */
    for (int32_t i = ok ? v->n_nodes - 1 : -1; i >= 0; i--) {
        struct tnode *t = &v->nodes[i];
        t->sub_end = t->tok_first + t->tok_n;
        t->plain = (uint8_t)plain_byte(t->byte);
        t->deepest = t->tok_n > 0 ? (uint16_t)v->len[v->ids[t->tok_first]] : 0;
        for (int32_t k = t->child; k >= 0; k = v->nodes[k].sibling) {
            const struct tnode *u = &v->nodes[k];
            t->sub_end = u->sub_end > t->sub_end ? u->sub_end : t->sub_end;
            t->deepest = u->deepest > t->deepest ? u->deepest : t->deepest;
            t->plain &= u->plain;
        }
    }
    ok = ok && make_tasks(v) == 0;
    void *p; /* the trie and the bytes cut to what they hold */
    if (ok && (p = realloc(v->nodes, (size_t)v->n_nodes * sizeof(*v->nodes))) != NULL)
        v->nodes = p, v->cap_nodes = v->n_nodes;
    if (ok && v->n_bytes > 0 && (p = realloc(v->bytes, (size_t)v->n_bytes)) != NULL)
        v->bytes = p, v->cap_bytes = v->n_bytes;
    if (!ok) {
        llmem_grammar_vocab_free(v);
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    *out = v;
    return LLMEM_OK;
}

void llmem_grammar_vocab_no_plain(struct llmem_grammar_vocab *v) {
    for (int32_t i = 0; i < v->n_nodes; i++)
        v->nodes[i].plain = 0;
}

/* ---- the matcher ---------------------------------------------------------------------------- */

/* A set of stacks: stack i is pos[at[i], at[i + 1]), its top last. */
struct stacks {
    int32_t *pos, *at;
    int32_t n, n_pos, cap_pos, cap_at;
};

/* A mask made for a set of stacks (an output inside a string or a number comes back to the same
 * set after every token: its mask is made once), with the largest shortest completion after any
 * token it allows (whether a budget's limit binds). */
struct mask_entry {
    uint64_t key;   /* the set's hash; 0: empty */
    struct stacks set;
    uint8_t *mask;  /* (n_vocab) */
    int64_t n;      /* tokens allowed */
    int32_t after;  /* max over them of the shortest completion after it */
    uint64_t used;
};

/* What moves sets of stacks: a matcher's own (its current set, cached masks' sets and walks),
 * or a walker lent for a part of a mask's walk on another thread (llmem_grammar_walkers). */
struct walker {
    struct stacks *level; /* (TOKEN_MAX + 1) the walk's sets, one a depth */
    int32_t *scratch;     /* (STACK_MAX) a stack being built */
    /* a walk's set that bytes lead back to (inside a string: every plain character), copied
     * here once found: which bytes do (known: tried), and its distance */
    struct stacks loop;
    const struct stacks *loop_src; /* the level it was copied from, while that level holds it */
    int loop_on, loop_root;        /* (loop_root: the walk's first set is the loop's) */
    uint8_t loop_known[32], loop_back[32];
    int32_t loop_distance;
    /* a chain of sets each of which every plain byte takes to the next (a string of a bounded
     * length: one set a character), chain[0, chain_n), with their distances; cyclic: the last
     * leads back to itself (then it stands for every later one); closed: no plain byte moves the
     * last (chain_at) */
    struct stacks *chain; /* (TOKEN_MAX + 1) */
    int32_t *chain_dist;  /* (TOKEN_MAX + 1) */
    int chain_n, chain_cyclic, chain_closed;
    int64_t held;        /* bytes the stack sets hold, at most LLMEM_GRAMMAR_STACK_BYTES */
    int failed;          /* out of memory (or of the stacks' planned bytes) while moving */
    int depth;           /* expand's nesting: references without bytes between are dropped
                          * past EXPAND_MAX (a schema that refers to itself at once) */
    /* the stacks expand reached that more than one way may lead to (its shared ones) since the
     * set moved last (advance), each expanded once: a schema whose alternatives meet again
     * without a byte between (anyOf of the same $ref, nested) would otherwise walk every way to
     * them, 2^depth; seen_slot indexes them by hash (open addressing, 1 + the stack's index, 0
     * empty; seen_cap a power of two) */
    struct stacks seen;
    int32_t *seen_slot;
    int32_t seen_cap;
};

struct llmem_grammar_state {
    const struct llmem_grammar *g;
    const struct llmem_grammar_vocab *v;
    struct stacks cur;
    struct mask_entry cache[MASK_CACHE];
    uint64_t clock;
    struct walker w;
    struct stacks tmp[2]; /* canonical()'s sets */
    uint8_t *canon;  /* (CANON_MAX) the shortest completion's bytes, when the budget is tight */
    int32_t *fewest; /* (CANON_MAX + 1) the fewest tokens that spell canon[k, n) */
};

static void stacks_clear(struct stacks *s) {
    s->n = 0, s->n_pos = 0;
}

static void stacks_free(struct stacks *s) {
    free(s->pos), free(s->at);
}

/* grow for a stack set's array, within the matcher's planned bytes for them. */
static int stacks_grow(struct walker *w, int32_t **p, int32_t *cap, int32_t need) {
    if (need <= *cap)
        return 0;
    int32_t c = *cap > 0 ? *cap : 16;
    while (c < need)
        c *= 2;
    const int64_t more = (int64_t)(c - *cap) * (int64_t)sizeof(**p);
    int32_t *q = w->held + more <= LLMEM_GRAMMAR_STACK_BYTES ? realloc(*p, (size_t)c * 4) : NULL;
    if (q == NULL)
        return -1;
    *p = q, *cap = c, w->held += more;
    return 0;
}

static int same_stack(const struct stacks *s, int32_t i, const int32_t *p, int32_t n) {
    return s->at[i + 1] - s->at[i] == n && memcmp(s->pos + s->at[i], p, (size_t)n * 4) == 0;
}

/* Adds a stack, the caller knowing the set does not hold it. */
static int stacks_push(struct walker *w, struct stacks *s, const int32_t *p, int32_t n) {
    /* pos is never NULL once a set holds a stack, even an empty one (pos + 0 must be valid) */
    if (s->n == 0 && (stacks_grow(w, &s->at, &s->cap_at, 1) != 0 ||
                      stacks_grow(w, &s->pos, &s->cap_pos, 1) != 0))
        return w->failed = LLMEM_ENOMEM;
    if (s->n == 0)
        s->at[0] = 0;
    if (stacks_grow(w, &s->pos, &s->cap_pos, s->n_pos + n) != 0 ||
        stacks_grow(w, &s->at, &s->cap_at, s->n + 2) != 0)
        return w->failed = LLMEM_ENOMEM;
    if (n > 0)
        memcpy(s->pos + s->n_pos, p, (size_t)n * 4);
    s->n_pos += n;
    s->at[++s->n] = s->n_pos;
    return LLMEM_OK;
}

/* Adds a stack unless the set holds it. */
static int stacks_add(struct walker *w, struct stacks *s, const int32_t *p, int32_t n) {
    for (int32_t i = 0; i < s->n; i++)
        if (same_stack(s, i, p, n))
            return LLMEM_OK;
    return stacks_push(w, s, p, n);
}

static uint32_t stack_hash(const int32_t *p, int32_t n) {
    uint32_t h = 2166136261u; /* FNV-1a over the positions */
    for (int32_t i = 0; i < n; i++)
        h = (h ^ (uint32_t)p[i]) * 16777619u;
    return h;
}

/* Where the probe for stack p[0, n) starts in seen_slot. */
static int32_t seen_home(const struct walker *w, const int32_t *p, int32_t n) {
    return (int32_t)(stack_hash(p, n) & (uint32_t)(w->seen_cap - 1));
}

/* The slot of walker's seen stack p[0, n): the one holding it, or the empty one it would take. */
static int32_t seen_find(const struct walker *w, const int32_t *p, int32_t n) {
    int32_t k = seen_home(w, p, n);
    while (w->seen_slot[k] != 0 && !same_stack(&w->seen, w->seen_slot[k] - 1, p, n))
        k = (k + 1) & (w->seen_cap - 1);
    return k;
}

/* Whether expand reached p[0, n) before since the last seen_clear; records it if not. Out of the
 * stacks' bytes, says yes (nothing more is expanded; w->failed tells). */
static int seen_before(struct walker *w, const int32_t *p, int32_t n) {
    if (w->seen_cap < 2 * (w->seen.n + 1)) { /* at most half full: grown, and every stack again */
        const int32_t cap = w->seen_cap;
        if (stacks_grow(w, &w->seen_slot, &w->seen_cap, 2 * cap > 64 ? 2 * cap : 64) != 0) {
            w->failed = LLMEM_ENOMEM;
            return 1;
        }
        memset(w->seen_slot, 0, (size_t)w->seen_cap * sizeof(*w->seen_slot));
        for (int32_t i = 0; i < w->seen.n; i++)
            w->seen_slot[seen_find(w, w->seen.pos + w->seen.at[i],
                                   w->seen.at[i + 1] - w->seen.at[i])] = i + 1;
    }
    const int32_t k = seen_find(w, p, n);
    if (w->seen_slot[k] != 0)
        return 1;
    if (stacks_push(w, &w->seen, p, n) != LLMEM_OK)
        return 1;
    w->seen_slot[k] = w->seen.n;
    return 0;
}

/* Forgets the seen stacks, emptying only the slots they took (each found by its index: a slot
 * emptied before may lie on its probe's way). */
static void seen_clear(struct walker *w) {
    for (int32_t i = 0; i < w->seen.n; i++) {
        int32_t k = seen_home(w, w->seen.pos + w->seen.at[i], w->seen.at[i + 1] - w->seen.at[i]);
        while (w->seen_slot[k] != i + 1)
            k = (k + 1) & (w->seen_cap - 1);
        w->seen_slot[k] = 0;
    }
    stacks_clear(&w->seen);
}

/* dst = src (dst cleared first). */
static void stacks_copy(struct walker *w, struct stacks *dst, const struct stacks *src) {
    stacks_clear(dst);
    for (int32_t i = 0; i < src->n; i++)
        stacks_add(w, dst, src->pos + src->at[i], src->at[i + 1] - src->at[i]);
}

static int has_byte(const uint8_t bits[32], uint8_t c) {
    return bits[c >> 3] >> (c & 7) & 1;
}

static void add_byte(uint8_t bits[32], uint8_t c) {
    bits[c >> 3] |= (uint8_t)(1u << (c & 7));
}

/* The stack p[0, n) (in w->scratch) with its top expanded to byte sets, into out. shared: the
 * stack may be reached more than one way in this expansion (pushed by a reference that meets
 * another, or an empty alternative pushed: what is left when it is popped, its parent's
 * continuation, may be left by others); any other comes from its parent alone, which was
 * expanded once, so only the shared ones are remembered. The stacks advance starts from (one a
 * stack of the set moved) are not: one that another's expansion reaches as well is expanded
 * again, work repeated once for each such start, never doubled level after level. */
static void expand(const struct llmem_grammar *g, struct walker *w, struct stacks *out, int32_t *p,
                   int32_t n, int shared) {
    while (n > 0 && (g->el[p[n - 1]].type == G_END || g->el[p[n - 1]].type == G_ALT))
        n--; /* a finished sequence: on with the one below */
    if (n == 0 || g->el[p[n - 1]].type == G_SET) {
        stacks_add(w, out, p, n);
        return;
    }
    if (n >= STACK_MAX || w->depth >= EXPAND_MAX)
        return; /* too deep: this parse is dropped */
    if (shared && seen_before(w, p, n))
        return; /* what it expands to is in out already */
    w->depth++;
    const int32_t top = p[n - 1], rule = (int32_t)g->el[top].v;
    const int tail = g->el[top + 1].type == G_END || g->el[top + 1].type == G_ALT;
    const int32_t base = tail ? n - 1 : n; /* the continuation stays unless nothing follows */
    for (int32_t i = g->rule_at[rule];; i++) {
        if (i == g->rule_at[rule] || g->el[i - 1].type == G_ALT) {
            p[n - 1] = top + 1;
            p[base] = i;
            expand(g, w, out, p, base + 1,
                   g->el[top].meets || g->el[i].type == G_END || g->el[i].type == G_ALT);
            p[n - 1] = top; /* (restored for the next alternative) */
        }
        if (g->el[i].type == G_END)
            break;
    }
    w->depth--;
}

/* out = in moved past byte c. */
static void advance(const struct llmem_grammar *g, struct walker *w, const struct stacks *in,
                    uint8_t c, struct stacks *out) {
    stacks_clear(out);
    seen_clear(w);
    for (int32_t i = 0; i < in->n; i++) {
        const int32_t n = in->at[i + 1] - in->at[i];
        if (n == 0)
            continue;
        const int32_t *p = in->pos + in->at[i];
        const uint8_t *set = g->sets[g->el[p[n - 1]].v];
        if (!has_byte(set, c))
            continue;
        memcpy(w->scratch, p, (size_t)n * 4);
        w->scratch[n - 1]++;
        expand(g, w, out, w->scratch, n, 0);
    }
}

/* The fewest bytes to an end over the set's stacks. */
static int32_t distance(const struct llmem_grammar *g, const struct stacks *s) {
    int32_t best = UNREACHABLE;
    for (int32_t i = 0; i < s->n; i++) {
        int32_t d = 0;
        for (int32_t k = s->at[i]; k < s->at[i + 1]; k++)
            d = add_sat(d, g->min_len[s->pos[k]]);
        best = d < best ? d : best;
    }
    return best;
}

static int has_empty(const struct stacks *s) {
    for (int32_t i = 0; i < s->n; i++)
        if (s->at[i + 1] == s->at[i])
            return 1;
    return 0;
}

static int walker_init(struct walker *w) {
    memset(w, 0, sizeof(*w));
    w->level = calloc(TOKEN_MAX + 1, sizeof(*w->level));
    w->chain = calloc(TOKEN_MAX + 1, sizeof(*w->chain));
    w->chain_dist = malloc((TOKEN_MAX + 1) * sizeof(*w->chain_dist));
    w->scratch = malloc(STACK_MAX * sizeof(*w->scratch));
    return w->level != NULL && w->chain != NULL && w->chain_dist != NULL && w->scratch != NULL ? 0
                                                                                               : -1;
}

static void walker_free(struct walker *w) {
    for (int i = 0; w->level != NULL && i <= TOKEN_MAX; i++)
        stacks_free(&w->level[i]);
    for (int i = 0; w->chain != NULL && i <= TOKEN_MAX; i++)
        stacks_free(&w->chain[i]);
    stacks_free(&w->loop), stacks_free(&w->seen);
    free(w->seen_slot), free(w->level), free(w->chain), free(w->chain_dist), free(w->scratch);
}

int llmem_grammar_state_create(const struct llmem_grammar *g, const struct llmem_grammar_vocab *v,
                               struct llmem_grammar_state **out) {
    LLMEM_ASSERT(g != NULL && v != NULL && out != NULL);
    struct llmem_grammar_state *st = calloc(1, sizeof(*st));
    if (st != NULL)
        st->g = g, st->v = v;
    if (st == NULL || walker_init(&st->w) != 0) {
        llmem_grammar_state_free(st);
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    st->w.scratch[0] = g->rule_at[g->root];
    expand(g, &st->w, &st->cur, st->w.scratch, 1, 0);
    if (st->w.failed) {
        llmem_grammar_state_free(st);
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    *out = st;
    return LLMEM_OK;
}

void llmem_grammar_state_free(struct llmem_grammar_state *st) {
    if (st == NULL)
        return;
    stacks_free(&st->cur);
    for (int i = 0; i < MASK_CACHE; i++)
        stacks_free(&st->cache[i].set), free(st->cache[i].mask);
    walker_free(&st->w);
    stacks_free(&st->tmp[0]), stacks_free(&st->tmp[1]);
    free(st->canon), free(st->fewest);
    free(st);
}

/* A walker lent to a pool's thread, and its part of a walk's results. */
struct lent {
    struct walker w;
    uint64_t walk; /* the walk its first set is for */
    int64_t n;
    int32_t after;
};

struct llmem_grammar_walkers {
    int n;
    uint64_t walks;
    struct lent *lent;
};

int llmem_grammar_walkers_create(int n, struct llmem_grammar_walkers **out) {
    LLMEM_ASSERT(n >= 1 && out != NULL);
    struct llmem_grammar_walkers *ws = calloc(1, sizeof(*ws));
    int ok = ws != NULL && (ws->lent = calloc((size_t)n, sizeof(*ws->lent))) != NULL;
    for (int i = 0; ok && i < n; i++) {
        ok = walker_init(&ws->lent[i].w) == 0;
        ws->n = i + 1; /* (freed below even half made) */
    }
    if (!ok) {
        llmem_grammar_walkers_free(ws);
        LLMEM_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    *out = ws;
    return LLMEM_OK;
}

void llmem_grammar_walkers_free(struct llmem_grammar_walkers *ws) {
    if (ws == NULL)
        return;
    for (int i = 0; ws->lent != NULL && i < ws->n; i++)
        walker_free(&ws->lent[i].w);
    free(ws->lent), free(ws);
}

int64_t llmem_grammar_walkers_bytes(int n) {
    return (int64_t)n *
           ((int64_t)sizeof(struct lent) + 2 * (TOKEN_MAX + 1) * (int64_t)sizeof(struct stacks) +
            (TOKEN_MAX + 1) * 4 + STACK_MAX * 4 + LLMEM_GRAMMAR_STACK_BYTES);
}

int64_t llmem_grammar_request_bytes(int64_t n_vocab) {
    const int64_t state = (int64_t)sizeof(struct llmem_grammar_state) +
                          2 * (TOKEN_MAX + 1) * (int64_t)sizeof(struct stacks) +
                          (TOKEN_MAX + 1) * 4 + STACK_MAX * 4 + CANON_MAX + (CANON_MAX + 1) * 4;
    return LLMEM_GRAMMAR_MAX_BYTES + LLMEM_GRAMMAR_STACK_BYTES + state + (MASK_CACHE + 1) * n_vocab;
}

int llmem_grammar_state_status(const struct llmem_grammar_state *st) {
    return st->w.failed;
}

int llmem_grammar_complete(const struct llmem_grammar_state *st) {
    return has_empty(&st->cur);
}

int llmem_grammar_must_end(const struct llmem_grammar_state *st) {
    for (int32_t i = 0; i < st->cur.n; i++)
        if (st->cur.at[i + 1] != st->cur.at[i])
            return 0;
    return 1;
}

static int same_set(const struct stacks *a, const struct stacks *b) {
    return a->n == b->n && a->n_pos == b->n_pos &&
           memcmp(a->pos, b->pos, (size_t)a->n_pos * sizeof(*a->pos)) == 0 &&
           (a->n == 0 || memcmp(a->at, b->at, (size_t)(a->n + 1) * sizeof(*a->at)) == 0);
}

/* How the plain bytes move `set`: PLAIN_ALL every one alike, somewhere (each of its stacks' tops
 * holds all of them or none, and one holds them all), PLAIN_NONE nowhere (no top holds one),
 * PLAIN_SOME otherwise. */
enum { PLAIN_NONE, PLAIN_SOME, PLAIN_ALL };
static int plain_moves(const struct llmem_grammar *g, const struct stacks *set) {
    int some = 0, all_of = 0;
    for (int32_t i = 0; i < set->n; i++) {
        if (set->at[i + 1] == set->at[i])
            continue; /* (complete: no byte passes it) */
        const uint8_t *bits = g->sets[g->el[set->pos[set->at[i + 1] - 1]].v];
        int all = 1, none = 1;
        for (int j = 0; j < 32; j++)
            all &= (bits[j] & PLAIN[j]) == PLAIN[j], none &= (bits[j] & PLAIN[j]) == 0;
        some |= !none, all_of |= all;
        if (!all && !none)
            return PLAIN_SOME;
    }
    return !some ? PLAIN_NONE : all_of ? PLAIN_ALL : PLAIN_SOME;
}

/* Makes `set`, which byte c led back to itself, the walk's loop: copied; where c is plain and
 * every plain byte moves it alike, they all lead back; its other bytes are learnt as they come. */
static void start_loop(const struct llmem_grammar *g, struct walker *w, const struct stacks *set,
                       uint8_t c) {
    stacks_copy(w, &w->loop, set);
    if (w->failed)
        return;
    w->loop_on = 1;
    w->loop_src = set;
    w->loop_root = same_set(&w->loop, &w->level[0]);
    memset(w->loop_known, 0, sizeof(w->loop_known));
    memset(w->loop_back, 0, sizeof(w->loop_back));
    w->loop_distance = distance(g, &w->loop);
    add_byte(w->loop_known, c), add_byte(w->loop_back, c);
    if (plain_byte(c) && plain_moves(g, &w->loop) == PLAIN_ALL)
        for (int j = 0; j < 32; j++)
            w->loop_known[j] |= PLAIN[j], w->loop_back[j] |= PLAIN[j];
}

/* A walk's start from w->level[0], no chain yet: the first set is the loop at once where a
 * plain byte leads back to it (inside a string), so that its plain bytes are not moved. */
static void walk_start(const struct llmem_grammar *g, struct walker *w) {
    w->loop_on = 0, w->loop_src = NULL, w->chain_n = 0;
    advance(g, w, &w->level[0], 'a', &w->level[1]);
    if (!w->failed && w->level[1].n > 0 && same_set(&w->level[1], &w->level[0]))
        start_loop(g, w, &w->level[0], 'a');
}

/* Whether `set` is the walk's loop (its copy, the level it was copied from, or the first set). */
static int is_loop(const struct walker *w, const struct stacks *set) {
    return w->loop_on &&
           (set == &w->loop || set == w->loop_src || (w->loop_root && set == &w->level[0]));
}

/* The set `set` moved past byte c: into w->level[depth + 1], or w->loop itself where c leads
 * back to it (found once a walk: after that no bytes are moved for it). */
static const struct stacks *step(const struct llmem_grammar *g, struct walker *w,
                                 const struct stacks *set, int depth, uint8_t c) {
    const int on_loop = is_loop(w, set);
    if (on_loop && has_byte(w->loop_known, c) && has_byte(w->loop_back, c))
        return set;
    struct stacks *next = &w->level[depth + 1];
    if (next == w->loop_src)
        w->loop_src = NULL; /* (overwritten now) */
    advance(g, w, set, c, next);
    if (w->failed || next->n == 0)
        return next;
    if (!w->loop_on && same_set(next, set)) { /* a loop: kept, its bytes learnt as they come */
        start_loop(g, w, set, c);
        return w->loop_on ? &w->loop : next;
    }
    if (on_loop) {
        add_byte(w->loop_known, c);
        if (same_set(next, set)) {
            add_byte(w->loop_back, c);
            return set;
        }
    }
    /* (a set equal to the loop's, reached another way, walks on as the loop) */
    return w->loop_on && same_set(next, &w->loop) ? &w->loop : next;
}

/* Where `set` stands in the walk's chain (made from it when it is in none and every plain byte
 * moves it alike); −1: it is in none and cannot start one. The chain ends at the vocabulary's
 * longest token, where a set is moved otherwise, or where its sets would take half the walker's
 * stack bytes; closed: no plain byte is taken past its end. */
static int chain_at(const struct llmem_grammar_state *st, struct walker *w,
                    const struct stacks *set) {
    const struct llmem_grammar *g = st->g;
    for (int j = 0; j < w->chain_n; j++)
        if (same_set(&w->chain[j], set))
            return j;
    if (plain_moves(g, set) != PLAIN_ALL || w->held > LLMEM_GRAMMAR_STACK_BYTES / 2)
        return -1;
    stacks_copy(w, &w->chain[0], set);
    w->chain_dist[0] = distance(g, set);
    w->chain_n = 1, w->chain_cyclic = 0, w->chain_closed = 0;
    while (!w->failed && w->chain_n <= st->v->nodes[0].deepest &&
           w->held <= LLMEM_GRAMMAR_STACK_BYTES / 2) {
        const struct stacks *last = &w->chain[w->chain_n - 1];
        const int moves = plain_moves(g, last);
        if (moves != PLAIN_ALL) {
            w->chain_closed = moves == PLAIN_NONE;
            break;
        }
        struct stacks *next = &w->chain[w->chain_n];
        advance(g, w, last, 'a', next);
        if (next->n == 0 || same_set(next, last)) {
            w->chain_closed = next->n == 0, w->chain_cyclic = next->n > 0;
            break;
        }
        w->chain_dist[w->chain_n++] = distance(g, next);
    }
    if (w->failed)
        w->chain_n = 0;
    return w->failed ? -1 : 0;
}

/* The tokens of trie node c's subtree (plain bytes alone), c's own ending on the chain's set j:
 * allowed where within the limit; the depths past the chain's end hold none. */
static int64_t chain_walk(const struct llmem_grammar_vocab *v, const struct walker *w, int32_t c,
                          int j, int32_t limit, uint8_t *allowed, int32_t *after) {
    const struct tnode *t = &v->nodes[c];
    const int32_t d = w->chain_dist[j];
    int64_t n = 0;
    if (t->tok_n > 0 && (limit < 0 || d <= limit)) {
        for (int32_t k = 0; k < t->tok_n; k++)
            allowed[v->ids[t->tok_first + k]] = 1;
        n = t->tok_n;
        *after = d > *after ? d : *after;
    }
    const int next = j + 1 < w->chain_n ? j + 1 : w->chain_cyclic ? j : -1;
    if (next == j && limit >= 0 && d > limit)
        return n; /* (the chain stays on its last set, beyond the limit: nothing below) */
    for (int32_t k = next >= 0 ? t->child : -1; k >= 0; k = v->nodes[k].sibling)
        n += chain_walk(v, w, k, next, limit, allowed, after);
    return n;
}

/* The walk below trie node `node`, whose set is `set`. With a budget (limit ≥ 0), a token is
 * allowed only where the bytes still needed after it are at most limit (fixed: limit tokens are
 * left after it, each at least a byte) or, when shrinking (the end is already out of reach at a
 * byte a token), at most limit less its own length (it lies on a shortest way). */
static int64_t walk(const struct llmem_grammar_state *st, struct walker *w,
                    const struct stacks *set, int32_t node, int depth, int32_t limit, int shrinking,
                    uint8_t *allowed, int32_t *after);

/* walk's part for child c of a node whose set is `set` (c at depth + 1): c's tokens and, with
 * below, the walk under it. */
static int64_t walk_child(const struct llmem_grammar_state *st, struct walker *w,
                          const struct stacks *set, int32_t c, int depth, int32_t limit,
                          int shrinking, int below, uint8_t *allowed, int32_t *after) {
    const struct llmem_grammar_vocab *v = st->v;
    const struct stacks *next = step(st->g, w, set, depth, v->nodes[c].byte);
    if (next->n == 0 || w->failed)
        return 0;
    const struct tnode *t = &v->nodes[c];
    if (below && !shrinking && t->plain) {
        /* a chain's set (a string's body, which leads back to itself, or a string of a bounded
         * length): the tokens below at relative depth r end on its set j + r; all allowed at
         * once where every one of those is there and within the limit, else node by node
         * along the chain (no set moved) */
        const int j = chain_at(st, w, next), r_max = t->deepest - (depth + 1);
        int all = j >= 0 && (w->chain_cyclic || j + r_max < w->chain_n);
        int32_t most = 0;
        for (int r = 0; all && r <= r_max; r++) {
            const int32_t dr = w->chain_dist[j + r < w->chain_n ? j + r : w->chain_n - 1];
            all = limit < 0 || dr <= limit;
            most = dr > most ? dr : most;
        }
        if (all) {
            for (int32_t k = t->tok_first; k < t->sub_end; k++)
                allowed[v->ids[k]] = 1;
            if (t->sub_end > t->tok_first && most > *after)
                *after = most;
            return t->sub_end - t->tok_first;
        }
        if (j >= 0 && (w->chain_closed || w->chain_cyclic))
            return chain_walk(v, w, c, j, limit, allowed, after);
    }
    const int32_t d =
        t->tok_n > 0 ? (next == &w->loop ? w->loop_distance : distance(st->g, next)) : 0;
    const int ok = limit < 0 || d <= (shrinking ? limit - (depth + 1) : limit);
    int64_t n = 0;
    for (int32_t k = 0; ok && k < t->tok_n; k++, n++)
        allowed[v->ids[t->tok_first + k]] = 1;
    if (ok && t->tok_n > 0 && d > *after)
        *after = d;
    if (below && depth + 1 < TOKEN_MAX)
        n += walk(st, w, next, c, depth + 1, limit, shrinking, allowed, after);
    return n;
}

static int64_t walk(const struct llmem_grammar_state *st, struct walker *w,
                    const struct stacks *set, int32_t node, int depth, int32_t limit, int shrinking,
                    uint8_t *allowed, int32_t *after) {
    int64_t n = 0;
    for (int32_t c = st->v->nodes[node].child; c >= 0; c = st->v->nodes[c].sibling)
        n += walk_child(st, w, set, c, depth, limit, shrinking, 1, allowed, after);
    return n;
}

static uint64_t set_key(const struct stacks *s) {
    uint64_t h = llmem_hash64(s->pos, (size_t)s->n_pos * sizeof(*s->pos), (uint64_t)s->n + 1);
    h = s->n > 0 ? llmem_hash64(s->at, (size_t)(s->n + 1) * sizeof(*s->at), h) : h;
    return h != 0 ? h : 1;
}

/* A walk split over a pool's threads (walk_part: a task of the vocabulary's, on the thread's lent
 * walker). */
struct split_walk {
    const struct llmem_grammar_state *st;
    struct llmem_grammar_walkers *ws;
    uint8_t *allowed;
};

static void walk_part(void *arg, int task, int thread) {
    const struct split_walk *p = arg;
    const struct llmem_grammar_state *st = p->st;
    struct lent *l = &p->ws->lent[thread];
    struct walker *w = &l->w;
    if (l->walk != p->ws->walks) { /* the thread's first task of this walk */
        l->walk = p->ws->walks, l->n = 0, l->after = 0;
        w->failed = 0;
        stacks_copy(w, &w->level[0], &st->cur);
        walk_start(st->g, w);
    }
    const struct wtask *t = &st->v->tasks[task];
    const struct stacks *set = &w->level[0];
    for (int d = 0; d + 1 < t->len && set->n > 0 && !w->failed; d++) /* (its ancestors) */
        set = step(st->g, w, set, d, t->path[d]);
    if (set->n > 0 && !w->failed)
        l->n += walk_child(st, w, set, t->node, t->len - 1, -1, 0, !t->self, p->allowed, &l->after);
}

/* The walk without a limit from st->w.level[0] (the current set), into allowed (cleared), on the
 * pool's threads where walkers are lent for them. */
static int64_t walk_all(struct llmem_grammar_state *st, uint8_t *allowed, int32_t *after,
                        struct llmem_grammar_walkers *ws, struct llmem_pool *pool) {
    memset(allowed, 0, (size_t)st->v->n_vocab);
    *after = 0;
    if (ws == NULL || pool == NULL || llmem_pool_threads(pool) < 2 ||
        llmem_pool_threads(pool) > ws->n || st->v->n_tasks == 0) {
        walk_start(st->g, &st->w);
        return walk(st, &st->w, &st->w.level[0], 0, 0, -1, 0, allowed, after);
    }
    ws->walks++;
    struct split_walk p = {st, ws, allowed};
    llmem_pool_run(pool, st->v->n_tasks, walk_part, &p);
    int64_t n = 0;
    for (int i = 0; i < ws->n; i++) {
        const struct lent *l = &ws->lent[i];
        if (l->walk != ws->walks)
            continue;
        n += l->n;
        *after = l->after > *after ? l->after : *after;
        if (l->w.failed)
            st->w.failed = LLMEM_ENOMEM;
    }
    return n;
}

/* The walk without a limit from the current set, into allowed: from the cache, or made and kept
 * there (the least recently used entry making room). *after as the entry's. */
static int64_t walk_cached(struct llmem_grammar_state *st, uint8_t *allowed, int32_t *after,
                           struct llmem_grammar_walkers *ws, struct llmem_pool *pool) {
    const int32_t nv = st->v->n_vocab;
    const uint64_t key = set_key(&st->cur);
    struct mask_entry *e = &st->cache[0];
    for (int i = 0; i < MASK_CACHE; i++) {
        struct mask_entry *x = &st->cache[i];
        if (x->key == key && same_set(&x->set, &st->cur)) {
            x->used = ++st->clock;
            memcpy(allowed, x->mask, (size_t)nv);
            *after = x->after;
            return x->n;
        }
        e = x->used < e->used ? x : e;
    }
    const int64_t n = walk_all(st, allowed, after, ws, pool);
    if (e->mask == NULL && (e->mask = malloc((size_t)nv)) == NULL)
        return n; /* (not kept) */
    stacks_copy(&st->w, &e->set, &st->cur);
    if (st->w.failed) {
        e->key = 0;
        return n;
    }
    memcpy(e->mask, allowed, (size_t)nv);
    e->key = key, e->n = n, e->after = *after, e->used = ++st->clock;
    return n;
}

/* The child of trie node `node` for byte c; −1: none. */
static int32_t child(const struct llmem_grammar_vocab *v, int32_t node, uint8_t c) {
    for (int32_t k = v->nodes[node].child; k >= 0; k = v->nodes[k].sibling)
        if (v->nodes[k].byte == c)
            return k;
    return -1;
}

/* The shortest completion from the current set (d bytes), into st->canon: at each byte the
 * smallest that takes the distance down by one. From the set its first bytes lead to, the same
 * rule spells the rest of it, so a budget that follows it stays on it. Its length, or −1 when it
 * is longer than CANON_MAX (or memory ran out). */
static int32_t canonical(struct llmem_grammar_state *st, int32_t d) {
    const struct llmem_grammar *g = st->g;
    if (d > CANON_MAX)
        return -1;
    if (st->canon == NULL && (st->canon = malloc(CANON_MAX)) == NULL)
        return -1;
    struct stacks *a = &st->tmp[0], *b = &st->tmp[1];
    stacks_copy(&st->w, a, &st->cur);
    for (int32_t k = 0; k < d; k++) {
        uint8_t any[32] = {0}; /* the bytes the stacks' tops take */
        for (int32_t i = 0; i < a->n; i++)
            if (a->at[i + 1] > a->at[i])
                for (int j = 0; j < 32; j++)
                    any[j] |= g->sets[g->el[a->pos[a->at[i + 1] - 1]].v][j];
        int c = 0;
        for (; c < 256; c++) {
            if (!has_byte(any, (uint8_t)c))
                continue;
            advance(st->g, &st->w, a, (uint8_t)c, b);
            if (st->w.failed)
                return -1;
            if (b->n > 0 && distance(g, b) == d - k - 1)
                break;
        }
        if (c == 256)
            return -1; /* (the distance is exact: not reached) */
        st->canon[k] = (uint8_t)c;
        struct stacks t = *a;
        *a = *b, *b = t;
    }
    return d;
}

/* A budget too tight for a byte a token (the shortest completion's d bytes exceed the tokens
 * left): the tokens that spell a prefix of the shortest completion and leave a rest that the
 * fewest tokens still spell within the budget (where none can, those on a fewest-token way:
 * the output is then cut). −1 when the completion is too long for this (the caller walks). */
static int64_t tight(struct llmem_grammar_state *st, int32_t d, int64_t remaining,
                     uint8_t *allowed) {
    const struct llmem_grammar_vocab *v = st->v;
    const int32_t n = canonical(st, d);
    if (n < 0 || (st->fewest == NULL &&
                  (st->fewest = malloc((CANON_MAX + 1) * sizeof(*st->fewest))) == NULL))
        return -1;
    int32_t *best = st->fewest;
    best[n] = 0;
    for (int32_t k = n - 1; k >= 0; k--) {
        best[k] = UNREACHABLE;
        for (int32_t j = k, node = 0; j < n && j - k < TOKEN_MAX; j++) {
            if ((node = child(v, node, st->canon[j])) < 0)
                break;
            if (v->nodes[node].tok_n > 0 && best[j + 1] + 1 < best[k])
                best[k] = best[j + 1] + 1;
        }
    }
    const int64_t fits = best[0] > remaining ? best[0] : remaining;
    memset(allowed, 0, (size_t)v->n_vocab);
    int64_t count = 0;
    for (int32_t j = 0, node = 0; j < n && j < TOKEN_MAX; j++) {
        if ((node = child(v, node, st->canon[j])) < 0)
            break;
        const struct tnode *t = &v->nodes[node];
        for (int32_t k = 0; best[j + 1] + 1 <= fits && k < t->tok_n; k++, count++)
            allowed[v->ids[t->tok_first + k]] = 1;
    }
    return count;
}

int64_t llmem_grammar_allowed(struct llmem_grammar_state *st, int64_t remaining, uint8_t *allowed) {
    return llmem_grammar_allowed_on(st, remaining, allowed, NULL, NULL);
}

int64_t llmem_grammar_allowed_on(struct llmem_grammar_state *st, int64_t remaining,
                                 uint8_t *allowed, struct llmem_grammar_walkers *ws,
                                 struct llmem_pool *pool) {
    const struct llmem_grammar_vocab *v = st->v;
    if (st->w.failed) { /* (nothing more: the caller ends the output as an error) */
        memset(allowed, 0, (size_t)v->n_vocab);
        return 0;
    }
    const int32_t d = distance(st->g, &st->cur);
    const int shrinking = remaining > 0 && d > remaining;
    if (shrinking) {
        const int64_t n = tight(st, d, remaining, allowed);
        if (n >= 0)
            return n;
    }
    const int32_t limit = remaining <= 0   ? -1
                          : shrinking      ? d
                          : remaining - 1 < UNREACHABLE ? (int32_t)(remaining - 1)
                                                        : UNREACHABLE;
    stacks_copy(&st->w, &st->w.level[0], &st->cur);
    int32_t after = 0;
    const int64_t n = walk_cached(st, allowed, &after, ws, pool);
    if (limit < 0 || (!shrinking && after <= limit))
        return n; /* the budget binds no token */
    memset(allowed, 0, (size_t)v->n_vocab);
    after = 0;
    walk_start(st->g, &st->w);
    return walk(st, &st->w, &st->w.level[0], 0, 0, limit, shrinking, allowed, &after);
}

int llmem_grammar_accept_bytes(struct llmem_grammar_state *st, const char *bytes, size_t n) {
    struct stacks *a = &st->w.level[0], *b = &st->w.level[1];
    stacks_copy(&st->w, a, &st->cur);
    for (size_t i = 0; i < n; i++) {
        advance(st->g, &st->w, a, (uint8_t)bytes[i], b);
        if (b->n == 0 || st->w.failed)
            return st->w.failed ? LLMEM_ENOMEM : LLMEM_EINVAL;
        struct stacks t = *a;
        *a = *b, *b = t;
    }
    struct stacks t = st->cur;
    st->cur = *a, *a = t;
    return LLMEM_OK;
}

int llmem_grammar_accept(struct llmem_grammar_state *st, int32_t id) {
    const struct llmem_grammar_vocab *v = st->v;
    if (id < 0 || id >= v->n_vocab || v->len[id] <= 0)
        return LLMEM_EINVAL;
    return llmem_grammar_accept_bytes(st, v->bytes + v->off[id], (size_t)v->len[id]);
}
