/*
 * tests/test-grammar.c — constrained decoding (engine/grammar.c): schemas compiled or refused
 * with the keyword named, strings the grammar takes and those it does not, the tokens it allows
 * next over a real vocabulary (one mask's walk split over threads: the same mask), and outputs
 * sampled from random logits under a grammar (they always parse as JSON and hold what the schema
 * asks), also when the budget only allows closing.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "testutil.h"

#include "engine/grammar_int.h"
#include "llmem/grammar.h"
#include "llmem/pool.h"
#include "llmem/sampler.h"
#include "llmem/status.h"
#include "llmem/tokenizer.h"

static struct llmem_tokenizer *tok;
static struct llmem_grammar_vocab *vocab;

static struct llmem_grammar *compile(const char *schema) {
    char why[256];
    struct llmem_grammar *g = NULL;
    int st = llmem_grammar_compile(schema, schema != NULL ? strlen(schema) : 0, why, sizeof(why),
                                   &g);
    if (st != LLMEM_OK)
        fail_msg("%s: %s", schema != NULL ? schema : "json_object", why);
    return g;
}

/* 1 when the grammar takes text whole (complete at its end), 0 when it refuses or is not done. */
static int takes(const struct llmem_grammar *g, const char *text) {
    struct llmem_grammar_state *s = NULL;
    assert_int_equal(llmem_grammar_state_create(g, vocab, &s), LLMEM_OK);
    int ok = llmem_grammar_accept_bytes(s, text, strlen(text)) == LLMEM_OK &&
             llmem_grammar_complete(s);
    llmem_grammar_state_free(s);
    return ok;
}

static const char person[] =
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":5},"
    "\"age\":{\"type\":\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\","
    "\"b\"]},\"maxItems\":2},\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"ok\"]}";

static void test_strings(void **state) {
    (void)state;
    struct llmem_grammar *any = compile(NULL); /* json_object */
    assert_true(takes(any, "{}"));
    assert_true(takes(any, "{\"a\": [1, -2.5e+3, \"x\\u00e9\\n\", true, null], \"b\": {}}"));
    assert_true(takes(any, "{\n  \"k\": \"caf\xc3\xa9\"\n}"));
    assert_false(takes(any, "[1]"));           /* an object */
    assert_false(takes(any, "{\"a\" 1}"));
    assert_false(takes(any, "{\"a\": 01}"));   /* no leading zero */
    assert_false(takes(any, "{\"a\": \"\xc3\"}")); /* a cut character */
    assert_false(takes(any, "{\"a\": \"\x01\"}")); /* a control character */
    assert_false(takes(any, "{\"a\":1"));      /* not complete */
    llmem_grammar_free(any);

    struct llmem_grammar *g = compile(person);
    assert_true(takes(g, "{\"name\": \"bob\", \"ok\": true}"));
    assert_true(takes(g, "{\"name\":\"bob\",\"age\":-3,\"tags\":[\"a\",\"b\"],\"ok\":false}"));
    assert_true(takes(g, "{\"name\": \"\", \"tags\": [], \"ok\": true}"));
    assert_false(takes(g, "{\"ok\": true}"));                              /* name required */
    assert_false(takes(g, "{\"name\": \"abcdef\", \"ok\": true}"));        /* maxLength */
    assert_false(takes(g, "{\"name\": \"a\", \"age\": 1.5, \"ok\": true}")); /* an integer */
    assert_false(takes(g, "{\"name\": \"a\", \"tags\": [\"c\"], \"ok\": true}"));
    assert_false(takes(g, "{\"name\": \"a\", \"tags\": [\"a\",\"a\",\"a\"], \"ok\": true}"));
    assert_false(takes(g, "{\"name\": \"a\", \"ok\": true, \"x\": 1}")); /* no other keys */
    assert_false(takes(g, "{\"ok\": true, \"name\": \"a\"}")); /* in the schema's order */
    llmem_grammar_free(g);

    /* $ref and recursion, anyOf, const, type lists, bounded strings, maps */
    g = compile("{\"$defs\":{\"n\":{\"anyOf\":[{\"type\":\"null\"},{\"type\":\"object\","
                "\"properties\":{\"v\":{\"const\":7},\"next\":{\"$ref\":\"#/$defs/n\"}},"
                "\"required\":[\"v\",\"next\"]}]}},\"$ref\":\"#/$defs/n\"}");
    assert_true(takes(g, "null"));
    assert_true(takes(g, "{\"v\":7,\"next\":{\"v\":7,\"next\":null}}"));
    assert_false(takes(g, "{\"v\":8,\"next\":null}"));
    llmem_grammar_free(g);
    g = compile("{\"type\":[\"string\",\"null\"],\"minLength\":2,\"maxLength\":3}");
    assert_true(takes(g, "\"ab\"") && takes(g, "\"abc\"") && takes(g, "null"));
    assert_false(takes(g, "\"a\"") || takes(g, "\"abcd\""));
    llmem_grammar_free(g);
    g = compile("{\"type\":\"object\",\"additionalProperties\":{\"type\":\"boolean\"}}");
    assert_true(takes(g, "{}") && takes(g, "{\"x\": true, \"y\": false}"));
    assert_false(takes(g, "{\"x\": 1}"));
    llmem_grammar_free(g);
    g = compile("{\"type\":\"array\",\"items\":{\"type\":\"number\"},\"minItems\":2}");
    assert_true(takes(g, "[1, 2]") && takes(g, "[1,2,3,4,5]"));
    assert_false(takes(g, "[1]") || takes(g, "[]"));
    /* every number a finite double: 16 digits of integer part and of fraction, 2 of exponent */
    assert_true(takes(g, "[1e99, -0.5E-12, 9999999999999999.9999999999999999e+99]"));
    assert_false(takes(g, "[1, 1e100]") || takes(g, "[1, 12345678901234567]") ||
                 takes(g, "[1, 0.12345678901234567]") || takes(g, "[1, 01]"));
    llmem_grammar_free(g);

    /* a call of one of two tools, as each family writes it */
    const char city[] = "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},"
                        "\"required\":[\"city\"]}";
    const struct llmem_grammar_tool tools[2] = {{"get", city, sizeof(city) - 1},
                                                {"now", NULL, 0}};
    char why[256];
    assert_int_equal(llmem_grammar_compile_tools(tools, 2, LLMEM_TOOL_FORMAT_HERMES, why,
                                                 sizeof(why), &g),
                     LLMEM_OK);
    assert_true(takes(g, "<tool_call>\n{\"name\": \"get\", \"arguments\": {\"city\": \"Oslo\"}}"
                         "\n</tool_call>"));
    assert_true(takes(g, "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"));
    assert_false(takes(g, "<tool_call>\n{\"name\": \"get\", \"arguments\": {}}\n</tool_call>"));
    assert_false(takes(g, "{\"name\": \"get\", \"parameters\": {\"city\": \"Oslo\"}}"));
    llmem_grammar_free(g);
    assert_int_equal(llmem_grammar_compile_tools(tools, 2, LLMEM_TOOL_FORMAT_LLAMA3, why,
                                                 sizeof(why), &g),
                     LLMEM_OK);
    assert_true(takes(g, "{\"name\": \"get\", \"parameters\": {\"city\": \"Oslo\"}}"));
    assert_true(takes(g, "{\"name\": \"now\", \"parameters\": {\"x\": [1]}}"));
    assert_false(takes(g, "{\"name\": \"get\", \"arguments\": {\"city\": \"Oslo\"}}"));
    assert_false(takes(g, "{\"name\": \"other\", \"parameters\": {}}"));
    llmem_grammar_free(g);
    assert_int_equal(
        llmem_grammar_compile_tools(tools, 2, LLMEM_TOOL_FORMAT_MISTRAL, why, sizeof(why), &g),
        LLMEM_OK);
    assert_true(
        takes(g, "[TOOL_CALLS] [{\"name\": \"get\", \"arguments\": {\"city\": \"Oslo\"}}]"));
    assert_true(takes(g, "[TOOL_CALLS][{\"name\": \"now\", \"arguments\": {}}]"));
    assert_false(takes(g, "[{\"name\": \"now\", \"arguments\": {}}]"));
    assert_false(takes(g, "[TOOL_CALLS] {\"name\": \"now\", \"arguments\": {}}"));
    llmem_grammar_free(g);
}

/* Mistral's [TOOL_CALLS] is a special token, yet its tools' grammar can start with it (the
 * vocabulary's trie holds it) and never with another special one (the EOS). */
static void test_mistral_control_token(void **state) {
    (void)state;
    struct llmem_tokenizer *mt = NULL;
    struct llmem_grammar_vocab *mv = NULL;
    assert_int_equal(llmem_tokenizer_load(LLMEM_TEST_DATA "/tok/tok-mistral-tools", &mt), LLMEM_OK);
    assert_int_equal(llmem_grammar_vocab_create(mt, &mv), LLMEM_OK);
    const int32_t calls = llmem_tokenizer_token_id(mt, "[TOOL_CALLS]");
    assert_true(calls >= 0 && llmem_tokenizer_is_special(mt, calls));
    const struct llmem_grammar_tool tool = {"now", NULL, 0};
    char why[256];
    struct llmem_grammar *g = NULL;
    assert_int_equal(
        llmem_grammar_compile_tools(&tool, 1, LLMEM_TOOL_FORMAT_MISTRAL, why, sizeof(why), &g),
        LLMEM_OK);
    struct llmem_grammar_state *s = NULL;
    assert_int_equal(llmem_grammar_state_create(g, mv, &s), LLMEM_OK);
    const int32_t n = llmem_grammar_vocab_size(mv);
    uint8_t *allowed = malloc((size_t)n);
    assert_non_null(allowed);
    assert_true(llmem_grammar_allowed(s, 0, allowed) > 0);
    assert_true(allowed[calls]);
    assert_false(allowed[llmem_tokenizer_eos(mt)]);
    free(allowed);
    llmem_grammar_state_free(s);
    llmem_grammar_free(g);
    llmem_grammar_vocab_free(mv);
    llmem_tokenizer_free(mt);
}

/* What is refused, and that the reason names it. */
static void test_refused(void **state) {
    (void)state;
    const struct {
        const char *schema, *names;
    } bad[] = {
        {"{\"type\":\"string\",\"pattern\":\"a+\"}", "pattern"},
        {"{\"type\":\"string\",\"format\":\"date\"}", "format"},
        {"{\"type\":\"integer\",\"minimum\":3}", "minimum"},
        {"{\"allOf\":[{}]}", "allOf"},
        {"{\"type\":\"thing\"}", "thing"},
        {"{\"$ref\":\"#/$defs/missing\"}", "missing"},
        {"{\"$ref\":\"#\"}", "no finite value"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":[\"b\"]}", "'b'"},
        {"{\"type\":\"array\",\"maxItems\":100000}", "maxItems"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{}},\"additionalProperties\":true}",
         "additionalProperties"},
        {"false", "false"},
        {"[1,2", "not JSON"},
        {"{\"enum\":[]}", "enum"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char why[256];
        struct llmem_grammar *g = NULL;
        assert_int_equal(llmem_grammar_compile(bad[i].schema, strlen(bad[i].schema), why,
                                               sizeof(why), &g),
                         LLMEM_EINVAL);
        assert_null(g);
        if (strstr(why, bad[i].names) == NULL)
            fail_msg("%s: '%s' does not name %s", bad[i].schema, why, bad[i].names);
    }
    /* a tool whose name no model could write, or a format that is none */
    static const char *const names[] = {"", "say \"hi\"", "back\\slash", "tab\t"};
    for (int i = 0; i < 5; i++) {
        char why[256];
        struct llmem_grammar *g = NULL;
        const struct llmem_grammar_tool t = {i < 4 ? names[i] : "f", NULL, 0};
        assert_int_equal(llmem_grammar_compile_tools(
                             &t, 1, i < 4 ? LLMEM_TOOL_FORMAT_HERMES : (enum llmem_tool_format)9,
                             why, sizeof(why), &g),
                         LLMEM_EINVAL);
        assert_null(g);
        assert_non_null(strstr(why, i < 4 ? "name" : "tool format 9"));
    }
}

/* The plan's bounds on a request's grammar: a schema whose tables would outgrow them is refused
 * as too large, and a matcher whose parses outgrow their stack bytes fails (status ENOMEM)
 * instead of growing on. */
/* Thirty rules each of four alternatives that all refer to the next: 4^30 ways to the same parse
 * stacks, each reached once (a matcher that walked every way would not finish). */
static void test_alternatives_meet(void **state) {
    (void)state;
    enum { LEVELS = 30 };
    char schema[8192];
    int at = snprintf(schema, sizeof(schema), "{\"$defs\":{");
    for (int i = 0; i < LEVELS; i++) {
        at += snprintf(schema + at, sizeof(schema) - (size_t)at, "\"r%d\":{\"anyOf\":[", i);
        for (int k = 0; k < 4; k++)
            at += snprintf(schema + at, sizeof(schema) - (size_t)at, "%s{\"$ref\":\"#/$defs/r%d\"}",
                           k > 0 ? "," : "", i + 1);
        at += snprintf(schema + at, sizeof(schema) - (size_t)at, "]},");
    }
    snprintf(schema + at, sizeof(schema) - (size_t)at,
             "\"r%d\":{\"type\":\"string\"}},\"$ref\":\"#/$defs/r0\"}", LEVELS);
    struct llmem_grammar *g = compile(schema);
    assert_true(takes(g, "\"ab\"") && takes(g, "\"\""));
    assert_false(takes(g, "1") || takes(g, "\"ab"));
    struct llmem_grammar_state *s = NULL;
    assert_int_equal(llmem_grammar_state_create(g, vocab, &s), LLMEM_OK);
    uint8_t *allowed = malloc((size_t)llmem_grammar_vocab_size(vocab));
    assert_non_null(allowed);
    assert_true(llmem_grammar_allowed(s, 8, allowed) > 0);
    assert_int_equal(llmem_grammar_accept_bytes(s, "\"x", 2), LLMEM_OK);
    assert_true(llmem_grammar_allowed(s, 8, allowed) > 0);
    assert_int_equal(llmem_grammar_state_status(s), LLMEM_OK);
    free(allowed);
    llmem_grammar_state_free(s);
    llmem_grammar_free(g);
}

static void test_planned_bytes(void **state) {
    (void)state;
    /* an enum of 40,000 strings of 8 characters: 12 bytes an element outgrow a megabyte */
    const int n = 40000;
    char *big = malloc((size_t)n * 11 + 64), why[256];
    assert_non_null(big);
    int at = sprintf(big, "{\"enum\":[");
    for (int i = 0; i < n; i++)
        at += sprintf(big + at, "%s\"v%07d\"", i > 0 ? "," : "", i);
    strcpy(big + at, "]}");
    struct llmem_grammar *g = NULL;
    assert_int_equal(llmem_grammar_compile(big, strlen(big), why, sizeof(why), &g), LLMEM_EINVAL);
    assert_null(g);
    assert_non_null(strstr(why, "too large"));
    free(big);
    g = compile(person);
    assert_true(llmem_grammar_bytes(g) <= LLMEM_GRAMMAR_MAX_BYTES);
    llmem_grammar_free(g);

    /* nested arrays each read ten ways (of any length, or the first to ninth of at most nine
     * items): 10^depth parses alive at once */
    g = compile("{\"$defs\":{\"n\":{\"anyOf\":[{\"type\":\"array\",\"items\":{\"$ref\":"
                "\"#/$defs/n\"}},{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/n\"},"
                "\"maxItems\":9}]}},\"$ref\":\"#/$defs/n\"}");
    struct llmem_grammar_state *s = NULL;
    assert_int_equal(llmem_grammar_state_create(g, vocab, &s), LLMEM_OK);
    int depth = 0, st = LLMEM_OK;
    while (depth < 64 && (st = llmem_grammar_accept_bytes(s, "[", 1)) == LLMEM_OK)
        depth++;
    printf("  nested arrays: the stacks outgrow their bytes at depth %d\n", depth);
    assert_int_equal(st, LLMEM_ENOMEM);
    assert_int_equal(llmem_grammar_state_status(s), LLMEM_ENOMEM);
    assert_true(depth >= 8);
    uint8_t *allowed = malloc((size_t)llmem_grammar_vocab_size(vocab));
    assert_non_null(allowed);
    assert_int_equal(llmem_grammar_allowed(s, 0, allowed), 0);
    llmem_grammar_state_free(s);
    /* a depth short of that: a mask's walk outgrows the bytes alike alone and split over
     * threads (a lent walker has the matcher's bound): the same status either way */
    struct llmem_pool *pool = NULL;
    struct llmem_grammar_walkers *ws = NULL;
    assert_int_equal(llmem_pool_create(2, &pool), LLMEM_OK);
    assert_int_equal(llmem_grammar_walkers_create(2, &ws), LLMEM_OK);
    int status[2];
    for (int split = 0; split < 2; split++) {
        assert_int_equal(llmem_grammar_state_create(g, vocab, &s), LLMEM_OK);
        for (int d = 0; d + 1 < depth; d++)
            assert_int_equal(llmem_grammar_accept_bytes(s, "[", 1), LLMEM_OK);
        (void)llmem_grammar_allowed_on(s, 0, allowed, split ? ws : NULL, split ? pool : NULL);
        status[split] = llmem_grammar_state_status(s);
        llmem_grammar_state_free(s);
    }
    printf("  a mask's walk at depth %d: status %d alone, %d split\n", depth - 1, status[0],
           status[1]);
    assert_int_equal(status[0], status[1]);
    llmem_grammar_walkers_free(ws);
    llmem_pool_destroy(pool);
    free(allowed);
    llmem_grammar_free(g);
}

/* Outputs sampled from random logits under a grammar: valid JSON holding what the schema asks,
 * for each of 50 seeds, with a roomy budget and with one that only allows closing. */
/* Up to max tokens drawn by s from random logits (x the generator's state; the end id's logit
 * eos_logit unless NaN), until the end id: their text (malloc'ed). */
static char *draw(struct llmem_sampler *s, float *logits, int max, float eos_logit, uint64_t *x) {
    const int32_t vocab_n = llmem_tokenizer_vocab_size(tok), eos = llmem_tokenizer_eos(tok);
    int32_t *ids = malloc((size_t)(max > 0 ? max : 1) * sizeof(int32_t));
    assert_non_null(ids);
    int n = 0;
    while (n < max) {
        for (int32_t i = 0; i < vocab_n; i++) {
            *x = *x * 6364136223846793005ull + 1442695040888963407ull;
            logits[i] = (float)((*x >> 40) % 1000) / 100.0f;
        }
        if (!isnan(eos_logit))
            logits[eos] = eos_logit;
        const int32_t id = llmem_sampler_sample(s, logits);
        llmem_sampler_accept(s, id);
        if (id == eos)
            break;
        ids[n++] = id;
    }
    char *text = NULL;
    assert_int_equal(llmem_tokenizer_decode(tok, ids, n, 0, &text, NULL), LLMEM_OK);
    free(ids);
    return text;
}

#define TIGHT_FEWEST 16 /* the fewest of pycoder's tokens that spell test_tight_budget's shortest output */

static void test_sampled_outputs(void **state) {
    (void)state;
    struct llmem_grammar *g = compile(person);
    const int32_t vocab_n = llmem_tokenizer_vocab_size(tok);
    const int32_t eos = llmem_tokenizer_eos(tok);
    float *logits = malloc((size_t)vocab_n * sizeof(float));
    assert_non_null(logits);
    uint64_t x = 1;
    int short_done = 0;
    for (int seed = 0; seed < 50; seed++) {
        for (int budget = 0; budget < 2; budget++) {
            struct llmem_sampling p;
            llmem_sampling_default(&p);
            p.temperature = 1.0, p.seed = (uint64_t)seed;
            p.grammar = g, p.grammar_vocab = vocab, p.end_ids = &eos, p.n_end_ids = 1;
            p.max_tokens = budget == 0 ? 400 : 40;
            struct llmem_sampler *s = NULL;
            assert_int_equal(llmem_sampler_create(&p, vocab_n, &s), LLMEM_OK);
            char *text = draw(s, logits, (int)p.max_tokens, 12.0f, &x); /* EOS likely */
            cJSON *o = cJSON_Parse(text);
            if (o == NULL || !cJSON_IsString(cJSON_GetObjectItem(o, "name")) ||
                !cJSON_IsBool(cJSON_GetObjectItem(o, "ok")))
                fail_msg("seed %d, budget %lld: '%s' is not a person", seed,
                         (long long)p.max_tokens, text);
            short_done += budget == 1;
            cJSON_Delete(o);
            free(text);
            llmem_sampler_free(s);
        }
    }
    printf("  100 outputs parse and hold name and ok (50 within 40 tokens)\n");
    assert_int_equal(short_done, 50);
    llmem_grammar_free(g);

    /* the end id where the output is complete at once, or (end_last: ignore_eos) only where
     * nothing else may come: an integer's first token, or all 16 digits it may have */
    g = compile("{\"type\":\"integer\"}");
    for (int last = 0; last < 2; last++) {
        struct llmem_sampling p;
        llmem_sampling_default(&p);
        p.temperature = 1.0, p.seed = 3;
        p.grammar = g, p.grammar_vocab = vocab, p.end_ids = &eos, p.n_end_ids = 1;
        p.end_last = last;
        struct llmem_sampler *s = NULL;
        assert_int_equal(llmem_sampler_create(&p, vocab_n, &s), LLMEM_OK);
        char *text = draw(s, logits, 64, 1000.0f, &x); /* EOS whenever allowed */
        const size_t sign = text[0] == '-', digits = strspn(text + sign, "0123456789");
        if (sign + digits != strlen(text) || digits == 0 || (digits == 16) != last)
            fail_msg("end_last %d: '%s'", last, text);
        free(text);
        llmem_sampler_free(s);
    }
    llmem_grammar_free(g);
    free(logits);
}

/* A budget below the shortest completion's bytes (23: {"point":{"x":0,"y":0}}) but not below the
 * fewest tokens that spell it (16): random draws still end in a whole, valid object, since the mask
 * keeps to prefixes of that completion which the tokens left can still spell. */
static void test_tight_budget(void **state) {
    (void)state;
    struct llmem_grammar *g =
        compile("{\"type\":\"object\",\"properties\":{\"point\":{\"type\":\"object\","
                "\"properties\":{\"x\":{\"type\":\"number\"},\"y\":{\"type\":\"number\"}},"
                "\"required\":[\"x\",\"y\"]}},\"required\":[\"point\"]}");
    const int32_t vocab_n = llmem_tokenizer_vocab_size(tok);
    const int32_t eos = llmem_tokenizer_eos(tok);
    float *logits = malloc((size_t)vocab_n * sizeof(float));
    assert_non_null(logits);
    uint64_t x = 7;
    for (int budget = TIGHT_FEWEST; budget <= 22; budget++)
        for (int seed = 0; seed < 20; seed++) {
            struct llmem_sampling p;
            llmem_sampling_default(&p);
            p.temperature = 1.0, p.seed = (uint64_t)seed;
            p.grammar = g, p.grammar_vocab = vocab, p.end_ids = &eos, p.n_end_ids = 1;
            p.max_tokens = budget;
            struct llmem_sampler *s = NULL;
            assert_int_equal(llmem_sampler_create(&p, vocab_n, &s), LLMEM_OK);
            char *text = draw(s, logits, budget, NAN, &x); /* no end favoured */
            cJSON *o = cJSON_Parse(text), *pt = cJSON_GetObjectItem(o, "point");
            if (!cJSON_IsNumber(cJSON_GetObjectItem(pt, "x")) ||
                !cJSON_IsNumber(cJSON_GetObjectItem(pt, "y")))
                fail_msg("budget %d, seed %d: '%s' is not a point", budget, seed, text);
            cJSON_Delete(o);
            free(text);
            llmem_sampler_free(s);
        }
    printf("  budgets %d to 22 tokens for a 23-byte shortest output: 20 draws each, all valid\n",
           TIGHT_FEWEST);
    free(logits);
    llmem_grammar_free(g);
}

/* The tokens allowed at the start of a json_object output all begin with '{' or whitespace, and
 * a complete output allows nothing more (an end is the sampler's). */
static void test_allowed(void **state) {
    (void)state;
    struct llmem_grammar *g = compile(NULL);
    struct llmem_grammar_state *s = NULL;
    assert_int_equal(llmem_grammar_state_create(g, vocab, &s), LLMEM_OK);
    const int32_t n = llmem_grammar_vocab_size(vocab);
    uint8_t *allowed = malloc((size_t)n);
    assert_non_null(allowed);
    int64_t k = llmem_grammar_allowed(s, 0, allowed);
    assert_true(k > 0);
    for (int32_t id = 0; id < n; id++) {
        char b[256];
        size_t len = 0;
        if (!allowed[id])
            continue;
        assert_int_equal(llmem_tokenizer_token_bytes(tok, id, b, sizeof(b), &len), LLMEM_OK);
        assert_true(len > 0 && strchr("{ \t\n\r", b[0]) != NULL);
    }
    assert_int_equal(llmem_grammar_accept_bytes(s, "{}", 2), LLMEM_OK);
    assert_true(llmem_grammar_complete(s) && llmem_grammar_must_end(s));
    assert_int_equal(llmem_grammar_allowed(s, 0, allowed), 0);
    assert_int_equal(llmem_grammar_accept_bytes(s, "x", 1), LLMEM_EINVAL);
    free(allowed);
    llmem_grammar_state_free(s);
    llmem_grammar_free(g);
}

/* Strings of a bounded length (a parse set a character: the walk follows them as a chain). */
static const char bounded[] =
    "{\"type\":\"object\",\"properties\":{\"s\":{\"type\":\"string\",\"maxLength\":7},"
    "\"t\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"minLength\":2,"
    "\"maxLength\":3}}},\"required\":[\"s\",\"t\"]}";

/* Strings of any length (their bodies are where a walk skips the trie's subtrees of plain
 * characters). */
static const char strings[] =
    "{\"type\":\"object\",\"properties\":{\"s\":{\"type\":\"string\"},\"t\":{\"type\":"
    "\"array\",\"items\":{\"type\":\"string\"}}},\"required\":[\"s\",\"t\"]}";

/* A mask is exactly the tokens the grammar takes next: along random outputs, every token tried
 * on a matcher moved past the output so far; with or without a budget, the masks of a walk that
 * skips the subtrees of plain characters inside strings are those of a walk over every node. */
static void test_masks_exact(void **state) {
    (void)state;
    const char *schemas[] = {strings, NULL, bounded};
    const int32_t n = llmem_grammar_vocab_size(vocab);
    uint8_t *a = malloc((size_t)n), *b = malloc((size_t)n);
    char *text = malloc(1 << 16);
    assert_non_null(a), assert_non_null(b), assert_non_null(text);
    struct llmem_grammar_vocab *whole = NULL; /* (walked node by node) */
    assert_int_equal(llmem_grammar_vocab_create(tok, &whole), LLMEM_OK);
    llmem_grammar_vocab_no_plain(whole);
    uint64_t x = 11;
    int checked = 0, compared = 0;
    for (int k = 0; k < 3; k++) {
        struct llmem_grammar *g = compile(schemas[k]);
        for (int out = 0; out < 3; out++) {
            struct llmem_grammar_state *s = NULL, *w = NULL;
            assert_int_equal(llmem_grammar_state_create(g, vocab, &s), LLMEM_OK);
            assert_int_equal(llmem_grammar_state_create(g, whole, &w), LLMEM_OK);
            size_t len = 0;
            for (int t = 0; t < 24; t++) {
                /* budgets: none, loose, binding and below the shortest completion */
                const int64_t budgets[] = {0, 30 - t, 12 - t / 2, 3};
                for (int i = 0; i < 4; i++, compared++) {
                    const int64_t na = llmem_grammar_allowed(s, budgets[i], a);
                    assert_int_equal(llmem_grammar_allowed(w, budgets[i], b), na);
                    assert_memory_equal(a, b, (size_t)n);
                }
                const int64_t na = llmem_grammar_allowed(s, 0, a);
                if (na == 0)
                    break;
                if (t % 3 == 1) { /* every token, from the output so far */
                    int64_t takes_n = 0;
                    for (int32_t id = 0; id < n; id++) {
                        char tb[256];
                        size_t tl = 0;
                        int ok = 0;
                        if (!llmem_tokenizer_is_special(tok, id) &&
                            llmem_tokenizer_token_bytes(tok, id, tb, sizeof(tb), &tl) == LLMEM_OK &&
                            tl > 0) {
                            struct llmem_grammar_state *r = NULL;
                            assert_int_equal(llmem_grammar_state_create(g, vocab, &r), LLMEM_OK);
                            ok = llmem_grammar_accept_bytes(r, text, len) == LLMEM_OK &&
                                 llmem_grammar_accept_bytes(r, tb, tl) == LLMEM_OK;
                            llmem_grammar_state_free(r);
                        }
                        if (ok != a[id])
                            fail_msg("after '%.*s': token %d ('%.*s') %s", (int)len, text, id,
                                     (int)tl, tb, ok ? "taken but not allowed" : "allowed");
                        takes_n += ok;
                    }
                    assert_int_equal(takes_n, na);
                    checked++;
                }
                const int64_t nb = llmem_grammar_allowed(s, 30 - t, b); /* within the budget */
                assert_true(nb <= na);
                for (int32_t id = 0; id < n; id++)
                    assert_true(!b[id] || a[id]);
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                int64_t pick = (int64_t)((x >> 33) % (uint64_t)(nb > 0 ? nb : na));
                const uint8_t *m = nb > 0 ? b : a;
                int32_t id = 0;
                while (!m[id] || pick-- > 0)
                    id++;
                size_t tl = 0;
                assert_int_equal(llmem_tokenizer_token_bytes(tok, id, text + len, 256, &tl),
                                 LLMEM_OK);
                len += tl;
                assert_int_equal(llmem_grammar_accept(s, id), LLMEM_OK);
                assert_int_equal(llmem_grammar_accept(w, id), LLMEM_OK);
            }
            llmem_grammar_state_free(s), llmem_grammar_state_free(w);
        }
        llmem_grammar_free(g);
    }
    printf("  %d masks checked token by token, %d the whole trie's\n", checked, compared);
    llmem_grammar_vocab_free(whole);
    free(a), free(b), free(text);
}

/* One mask's walk split over a pool's threads gives the serial walk's mask, count and
 * (through the budget) the same later masks: two matchers of a grammar, one walking alone, one
 * with walkers, moved past the same random allowed tokens, budgets now and then. */
static void test_split_walk(void **state) {
    (void)state;
    struct llmem_pool *pool = NULL;
    struct llmem_grammar_walkers *ws = NULL;
    assert_int_equal(llmem_pool_create(3, &pool), LLMEM_OK);
    assert_int_equal(llmem_grammar_walkers_create(3, &ws), LLMEM_OK);
    const char *schemas[] = {person, NULL, "{\"type\":\"array\",\"items\":{\"type\":\"number\"}}",
                             strings};
    const int32_t n = llmem_grammar_vocab_size(vocab);
    uint8_t *a = malloc((size_t)n), *b = malloc((size_t)n);
    assert_non_null(a), assert_non_null(b);
    uint64_t x = 7;
    int steps = 0;
    for (int k = 0; k < 4; k++) {
        struct llmem_grammar *g = compile(schemas[k]);
        struct llmem_grammar_state *one = NULL, *many = NULL;
        assert_int_equal(llmem_grammar_state_create(g, vocab, &one), LLMEM_OK);
        assert_int_equal(llmem_grammar_state_create(g, vocab, &many), LLMEM_OK);
        for (int t = 0; t < 60; t++, steps++) {
            const int64_t budget = t % 7 == 6 ? 40 - t / 2 : 0;
            const int64_t na = llmem_grammar_allowed(one, budget, a);
            const int64_t nb = llmem_grammar_allowed_on(many, budget, b, ws, pool);
            assert_int_equal(na, nb);
            assert_memory_equal(a, b, (size_t)n);
            if (na == 0)
                break;
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            int64_t pick = (int64_t)((x >> 33) % (uint64_t)na);
            int32_t id = 0;
            while (!a[id] || pick-- > 0)
                id++;
            assert_int_equal(llmem_grammar_accept(one, id), LLMEM_OK);
            assert_int_equal(llmem_grammar_accept(many, id), LLMEM_OK);
        }
        llmem_grammar_state_free(one), llmem_grammar_state_free(many);
        llmem_grammar_free(g);
    }
    printf("  %d masks split over 3 threads, each the serial walk's\n", steps);
    free(a), free(b);
    llmem_grammar_walkers_free(ws);
    llmem_pool_destroy(pool);
}

/* One step of a draw from random logits, forced where `force` ≥ 0 (its logit far above the rest,
 * which a mask can still take away): the token drawn, accepted. */
static int32_t lazy_step(struct llmem_sampler *s, float *logits, int32_t force, uint64_t *x) {
    const int32_t vocab_n = llmem_tokenizer_vocab_size(tok), eos = llmem_tokenizer_eos(tok);
    for (int32_t i = 0; i < vocab_n; i++) {
        *x = *x * 6364136223846793005ull + 1442695040888963407ull;
        logits[i] = (float)((*x >> 40) % 1000) / 100.0f;
    }
    logits[eos] = -INFINITY;
    if (force >= 0)
        logits[force] = 1000.0f;
    const int32_t id = llmem_sampler_sample(s, logits);
    llmem_sampler_accept(s, id);
    return id;
}

static size_t utf8_chars(const char *s) {
    size_t n = 0;
    for (; *s; s++)
        n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

/* The ids of text (pycoder's BPE), at most 8. */
static int ids_of(const char *text, int32_t *out) {
    int32_t *ids = NULL;
    int64_t n = 0;
    assert_int_equal(llmem_tokenizer_encode(tok, text, strlen(text), &ids, &n), LLMEM_OK);
    assert_true(n >= 1 && n <= 8);
    memcpy(out, ids, (size_t)n * sizeof(int32_t));
    free(ids);
    return (int)n;
}

/* A sampler at temperature 1 under tool's grammar for a part of the output, triggered as the
 * server triggers it for `format` (Hermes-style: "<tool_call>", again after each call; Llama 3:
 * '{' at the start); *g the grammar, freed by the caller. */
static struct llmem_sampler *lazy_sampler(const struct llmem_grammar_tool *tool,
                                          enum llmem_tool_format format, uint64_t seed,
                                          int64_t max_tokens, struct llmem_grammar **g) {
    static int32_t eos;
    eos = llmem_tokenizer_eos(tok);
    char why[256];
    assert_int_equal(llmem_grammar_compile_tools(tool, 1, format, why, sizeof(why), g), LLMEM_OK);
    struct llmem_sampling p;
    llmem_sampling_default(&p);
    p.temperature = 1.0, p.seed = seed;
    p.grammar = *g, p.grammar_vocab = vocab, p.end_ids = &eos, p.n_end_ids = 1;
    p.max_tokens = max_tokens;
    const int hermes = format == LLMEM_TOOL_FORMAT_HERMES;
    p.grammar_trigger = hermes ? "<tool_call>" : "{";
    p.trigger_at_start = !hermes, p.rearm = hermes;
    struct llmem_sampler *s = NULL;
    assert_int_equal(llmem_sampler_create(&p, llmem_tokenizer_vocab_size(tok), &s), LLMEM_OK);
    return s;
}

/* A tools grammar for a part of the output (auto tool choice): free text until the convention's
 * marker, the call under the grammar from it on (a token it does not allow is masked, however
 * likely), free again after a Hermes-style call closes; Llama 3's marker counts only at the
 * start, so an answer that opens otherwise stays free. */
static void test_lazy_tools(void **state) {
    (void)state;
    static const char params[] = "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":"
                                 "\"string\",\"maxLength\":8}},\"required\":[\"city\"],"
                                 "\"additionalProperties\":false}";
    const struct llmem_grammar_tool tool = {"get_weather", params, sizeof(params) - 1};
    float *logits = malloc((size_t)llmem_tokenizer_vocab_size(tok) * sizeof(float));
    assert_non_null(logits);
    int32_t opener[8], bang[8];
    const int n_opener = ids_of("<tool_call>", opener);
    ids_of("!!", bang);
    uint64_t x = 5;
    for (int seed = 0; seed < 20; seed++) {
        struct llmem_grammar *g = NULL;
        struct llmem_sampler *s =
            lazy_sampler(&tool, LLMEM_TOOL_FORMAT_HERMES, (uint64_t)seed, 120, &g);
        int32_t ids[200];
        int n = 0;
        ids[n++] = lazy_step(s, logits, bang[0], &x); /* free: taken */
        assert_int_equal(ids[0], bang[0]);
        for (int i = 0; i < 3; i++)
            ids[n++] = lazy_step(s, logits, -1, &x);
        for (int i = 0; i < n_opener; i++)
            ids[n++] = lazy_step(s, logits, opener[i], &x);
        const int32_t masked = lazy_step(s, logits, bang[0], &x); /* the call's first: not "!!" */
        assert_int_not_equal(masked, bang[0]);
        ids[n++] = masked;
        char *text = NULL;
        for (;;) { /* until the call has closed */
            assert_true(n < 120);
            ids[n++] = lazy_step(s, logits, -1, &x);
            assert_int_equal(llmem_tokenizer_decode(tok, ids, n, 0, &text, NULL), LLMEM_OK);
            const int closed = strstr(text, "</tool_call>") != NULL;
            if (!closed)
                free(text);
            if (closed)
                break;
        }
        ids[n++] = lazy_step(s, logits, bang[0], &x); /* free again */
        assert_int_equal(ids[n - 1], bang[0]);
        const char *body = strstr(text, "<tool_call>") + strlen("<tool_call>");
        const char *end = strstr(body, "</tool_call>");
        cJSON *call = cJSON_ParseWithLength(body, (size_t)(end - body));
        const cJSON *args = cJSON_GetObjectItem(call, "arguments");
        const cJSON *city = cJSON_GetObjectItem(args, "city");
        if (!cJSON_IsString(cJSON_GetObjectItem(call, "name")) ||
            strcmp(cJSON_GetObjectItem(call, "name")->valuestring, "get_weather") != 0 ||
            !cJSON_IsString(city) || utf8_chars(city->valuestring) > 8 ||
            cJSON_GetArraySize((cJSON *)args) != 1)
            fail_msg("seed %d: '%s' holds no valid call", seed, text);
        cJSON_Delete(call);
        free(text);
        llmem_sampler_free(s);
        llmem_grammar_free(g);
    }

    /* Llama 3: an answer that opens with '{' is the call; one that opens otherwise stays free */
    int32_t brace[8];
    ids_of("{", brace);
    for (int open = 0; open < 2; open++) {
        struct llmem_grammar *g = NULL;
        struct llmem_sampler *s = lazy_sampler(&tool, LLMEM_TOOL_FORMAT_LLAMA3, 9, 80, &g);
        if (!open)
            assert_int_equal(lazy_step(s, logits, bang[0], &x), bang[0]);
        assert_int_equal(lazy_step(s, logits, brace[0], &x), brace[0]);
        const int32_t next = lazy_step(s, logits, bang[0], &x);
        assert_true(open ? next != bang[0] : next == bang[0]);
        llmem_sampler_free(s);
        llmem_grammar_free(g);
    }
    free(logits);
}

static int setup(void **state) {
    (void)state;
    if (llmem_tokenizer_load(LLMEM_SOURCE_DIR "/models/pycoder", &tok) != LLMEM_OK ||
        llmem_grammar_vocab_create(tok, &vocab) != LLMEM_OK)
        return -1;
    return 0;
}

static int teardown(void **state) {
    (void)state;
    llmem_grammar_vocab_free(vocab);
    llmem_tokenizer_free(tok);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_strings),         cmocka_unit_test(test_mistral_control_token),
        cmocka_unit_test(test_refused),         cmocka_unit_test(test_alternatives_meet),
        cmocka_unit_test(test_planned_bytes),   cmocka_unit_test(test_allowed),
        cmocka_unit_test(test_sampled_outputs), cmocka_unit_test(test_tight_budget),
        cmocka_unit_test(test_masks_exact),     cmocka_unit_test(test_split_walk),
        cmocka_unit_test(test_lazy_tools),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
