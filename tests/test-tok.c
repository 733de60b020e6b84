/*
 * tests/test-tok.c — tok/: every reference tokenizer — of the models (tests/data/models/<name>,
 * pycoder's in models/pycoder: the cases of their reference.json) and the tokenizer-only fixtures
 * of tests/data/tok/<name>/ (cases.json) — must give the ids and decoded text that Hugging Face
 * `tokenizers` gave for each case, exactly; round
 * trips on random text, added tokens inside text, the streaming detokenizer against the full
 * decode, chat templates (recognition and the exact rendering of each family), the speed of
 * encoding a megabyte, and the load errors (status and the phrase of the one error line).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "core/clock.h"
#include "core/file.h"
#include "core/json.h"
#include "llmem/status.h"
#include "llmem/tokenizer.h"
#include "testutil.h"
#include "tok/tok_int.h"

#define TOK_DATA LLMEM_TEST_DATA "/tok"
#define MODELS   LLMEM_TEST_DATA "/models"

static const char *const all_tokenizers[] = {
    "pycoder",
    "tiny-llama3",
    "tiny-qwen2",
    "tiny-qwen3",
    "tok-gpt2",
    "tok-ignore-merges",
    "tok-metaspace",
    "tiny-mistral-swa",
    "tok-metaspace-split",
    "tok-bytelevel-prefix",
    "tok-nfc",
};
#define N_TOKENIZERS (sizeof(all_tokenizers) / sizeof(all_tokenizers[0]))

/* The tokenizers whose decode inverts encode on any valid UTF-8 text. */
static const char *const invertible[] = {
    "pycoder",  "tiny-llama3",       "tiny-qwen2",       "tiny-qwen3",
    "tok-gpt2", "tok-ignore-merges", "tiny-mistral-swa",
};
#define N_INVERTIBLE (sizeof(invertible) / sizeof(invertible[0]))

/* ---- helpers -------------------------------------------------------------------------------- */

/* tok-<name> is a tokenizer-only fixture of TOK_DATA; any other name is a model's tokenizer. */
static int is_model(const char *name) {
    return strncmp(name, "tok-", 4) != 0;
}

static const char *tok_dir(const char *name, char *buf, size_t size) {
    if (strcmp(name, "pycoder") == 0)
        snprintf(buf, size, "%s/models/pycoder", LLMEM_SOURCE_DIR);
    else
        snprintf(buf, size, "%s/%s", is_model(name) ? MODELS : TOK_DATA, name);
    return buf;
}

static struct llmem_tokenizer *load(const char *name) {
    char dir[1024];
    tok_dir(name, dir, sizeof(dir));
    struct llmem_tokenizer *tok = NULL;
    int status = llmem_tokenizer_load(dir, &tok);
    if (status != LLMEM_OK) {
        print_error("%s: %s: %s\n", name, llmem_status_name(status), llmem_last_error());
        fail();
    }
    return tok;
}

/* {"cases": [{text, ids, decoded}], "decode_cases": [{ids, text}]}: a fixture's cases.json, or
 * made from a model's reference.json — its tokenizer_cases, and for the trained model (whose
 * reference has none) each generation's prompt with its ids and continuation with its text. */
static cJSON *load_cases(const char *name) {
    char path[1024];
    cJSON *root = NULL;
    if (!is_model(name)) {
        snprintf(path, sizeof(path), "%s/%s/cases.json", TOK_DATA, name);
        assert_int_equal(llmem_json_parse_file(path, 1 << 24, &root), LLMEM_OK);
        return root;
    }
    snprintf(path, sizeof(path), "%s/%s/reference.json", MODELS, name);
    cJSON *ref = NULL;
    assert_int_equal(llmem_json_parse_file(path, 1 << 24, &ref), LLMEM_OK);
    root = cJSON_CreateObject();
    cJSON *cases = cJSON_DetachItemFromObject(ref, "tokenizer_cases");
    cJSON *decode_cases = cJSON_AddArrayToObject(root, "decode_cases");
    if (cases == NULL) {
        cases = cJSON_CreateArray();
        const cJSON *g = NULL;
        cJSON_ArrayForEach(g, cJSON_GetObjectItem(ref, "generations")) {
            const cJSON *prompt = cJSON_GetObjectItem(g, "prompt");
            cJSON *c = cJSON_CreateObject();
            cJSON_AddStringToObject(c, "text", prompt->valuestring);
            cJSON_AddItemToObject(c, "ids",
                                  cJSON_Duplicate(cJSON_GetObjectItem(g, "prompt_ids"), 1));
            cJSON_AddStringToObject(c, "decoded", prompt->valuestring);
            cJSON_AddItemToArray(cases, c);
            c = cJSON_CreateObject();
            cJSON_AddItemToObject(c, "ids",
                                  cJSON_Duplicate(cJSON_GetObjectItem(g, "greedy_ids"), 1));
            cJSON_AddStringToObject(c, "text", cJSON_GetObjectItem(g, "greedy_text")->valuestring);
            cJSON_AddItemToArray(decode_cases, c);
        }
    }
    cJSON_AddItemToObject(root, "cases", cases);
    cJSON_Delete(ref);
    return root;
}

static int32_t *json_ids(const cJSON *arr, int64_t *n) {
    *n = cJSON_GetArraySize(arr);
    int32_t *ids = malloc((size_t)(*n + 1) * sizeof(*ids));
    assert_non_null(ids);
    int64_t i = 0;
    const cJSON *e = NULL;
    cJSON_ArrayForEach(e, arr) ids[i++] = (int32_t)e->valuedouble;
    return ids;
}

/* A case's text: `key`, or `key`_hex where the text holds a NUL (which cJSON strings cannot). */
static char *case_text(const cJSON *c, const char *key, size_t *len) {
    char hex_key[64];
    snprintf(hex_key, sizeof(hex_key), "%s_hex", key);
    const cJSON *hex = cJSON_GetObjectItem(c, hex_key);
    if (hex == NULL) {
        const char *s = cJSON_GetObjectItem(c, key)->valuestring;
        *len = strlen(s);
        return strdup(s);
    }
    size_t n = strlen(hex->valuestring) / 2;
    char *p = malloc(n + 1);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++) {
        unsigned v = 0;
        assert_int_equal(sscanf(hex->valuestring + 2 * i, "%2x", &v), 1);
        p[i] = (char)v;
    }
    p[n] = '\0';
    *len = n;
    return p;
}

/* The streamed pieces of ids, concatenated (pieces are NUL-terminated: for texts without NUL). */
static char *stream_decode(const struct llmem_tokenizer *tok, const int32_t *ids, int64_t n,
                           int skip_special) {
    struct llmem_detok *d = NULL;
    assert_int_equal(llmem_detok_create(tok, skip_special, &d), LLMEM_OK);
    size_t cap = 64, len = 0;
    char *all = malloc(cap);
    assert_non_null(all);
    all[0] = '\0';
    for (int64_t i = 0; i <= n; i++) {
        char *piece = NULL;
        if (i < n)
            assert_int_equal(llmem_detok_push(d, ids[i], &piece), LLMEM_OK);
        else
            assert_int_equal(llmem_detok_finish(d, &piece), LLMEM_OK);
        assert_non_null(piece);
        size_t pn = strlen(piece);
        while (len + pn + 1 > cap)
            cap *= 2;
        all = realloc(all, cap);
        assert_non_null(all);
        memcpy(all + len, piece, pn + 1);
        len += pn;
        free(piece);
    }
    llmem_detok_free(d);
    return all;
}

static void print_ids(const char *what, const int32_t *ids, int64_t n) {
    fprintf(stderr, "  %s:", what);
    for (int64_t i = 0; i < n; i++)
        fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, "\n");
}

/* ---- the reference cases -------------------------------------------------------------------- */

static void check_tokenizer(const char *name) {
    struct llmem_tokenizer *tok = load(name);
    cJSON *root = load_cases(name);
    int n_cases = 0, n_bad = 0;
    const cJSON *c = NULL;
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(root, "cases")) {
        size_t text_len = 0, decoded_len = 0;
        char *text = case_text(c, "text", &text_len);
        char *decoded = case_text(c, "decoded", &decoded_len);
        int64_t n_want = 0, n = 0;
        int32_t *want = json_ids(cJSON_GetObjectItem(c, "ids"), &n_want);
        int32_t *ids = NULL;
        assert_int_equal(llmem_tokenizer_encode(tok, text, text_len, &ids, &n), LLMEM_OK);
        int ok = n == n_want && memcmp(ids, want, (size_t)n * sizeof(*ids)) == 0;
        if (!ok) {
            fprintf(stderr, "%s: encode \"%s\" differs\n", name, text);
            print_ids("want", want, n_want);
            print_ids("got ", ids, n);
        }
        char *out = NULL;
        size_t out_len = 0;
        assert_int_equal(llmem_tokenizer_decode(tok, want, n_want, 0, &out, &out_len), LLMEM_OK);
        if (out_len != decoded_len || memcmp(out, decoded, out_len) != 0) {
            fprintf(stderr, "%s: decode of \"%s\": want \"%s\", got \"%s\"\n", name, text, decoded,
                    out);
            ok = 0;
        }
        char *streamed = stream_decode(tok, want, n_want, 0);
        if (memchr(out, '\0', out_len) == NULL && strcmp(streamed, out) != 0) {
            fprintf(stderr, "%s: streamed decode of \"%s\": \"%s\" != \"%s\"\n", name, text,
                    streamed, out);
            ok = 0;
        }
        n_cases++;
        n_bad += !ok;
        free(text);
        free(decoded);
        free(streamed);
        free(out);
        free(ids);
        free(want);
    }
    int n_decode = 0;
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(root, "decode_cases")) {
        const char *text = cJSON_GetObjectItem(c, "text")->valuestring;
        int64_t n = 0;
        int32_t *ids = json_ids(cJSON_GetObjectItem(c, "ids"), &n);
        char *out = NULL;
        assert_int_equal(llmem_tokenizer_decode(tok, ids, n, 0, &out, NULL), LLMEM_OK);
        char *streamed = stream_decode(tok, ids, n, 0);
        if (strcmp(out, text) != 0 || strcmp(streamed, text) != 0) {
            fprintf(stderr, "%s: decode: want \"%s\", got \"%s\" (streamed \"%s\")\n", name, text,
                    out, streamed);
            n_bad++;
        }
        n_decode++;
        free(streamed);
        free(out);
        free(ids);
    }
    print_message("%-20s %2d encode+decode cases, %d decode cases: %s\n", name, n_cases, n_decode,
                  n_bad ? "FAIL" : "ok");
    cJSON_Delete(root);
    llmem_tokenizer_free(tok);
    assert_true(n_cases > 0);
    assert_int_equal(n_bad, 0);
}

static void test_reference_cases(void **state) {
    (void)state;
    for (size_t i = 0; i < N_TOKENIZERS; i++)
        check_tokenizer(all_tokenizers[i]);
}

/* ---- random round trips --------------------------------------------------------------------- */

static uint64_t rng_state = 0x853c49e6748fea9bULL;

static uint32_t rng(void) {
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rng_state >> 33);
}

static size_t put_utf8(char *p, uint32_t cp) {
    if (cp < 0x80) {
        p[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        p[0] = (char)(0xC0 | (cp >> 6)), p[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        p[0] = (char)(0xE0 | (cp >> 12)), p[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        p[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    p[0] = (char)(0xF0 | (cp >> 18)), p[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    p[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), p[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Random valid UTF-8 of about n characters: mostly ASCII, some Latin, CJK, emoji, controls. */
static size_t random_text(char *p, size_t n) {
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t r = rng() % 100, cp;
        if (r < 60)
            cp = 0x20 + rng() % 0x5F;
        else if (r < 70)
            cp = " \t\n\r"[rng() % 4];
        else if (r < 80)
            cp = 0xA0 + rng() % 0x160;
        else if (r < 88)
            cp = 0x4E00 + rng() % 0x5000;
        else if (r < 94)
            cp = 0x1F300 + rng() % 0x300;
        else if (r < 97)
            cp = 1 + rng() % 0x1F;
        else {
            do
                cp = 1 + rng() % 0x10FFFF;
            while (cp >= 0xD800 && cp <= 0xDFFF);
        }
        len += put_utf8(p + len, cp);
    }
    p[len] = '\0';
    return len;
}

static void test_round_trip_random(void **state) {
    (void)state;
    char text[4 * 200 + 1];
    for (size_t t = 0; t < N_INVERTIBLE; t++) {
        struct llmem_tokenizer *tok = load(invertible[t]);
        for (int iter = 0; iter < 300; iter++) {
            size_t len = random_text(text, 1 + rng() % 200);
            int32_t *ids = NULL;
            int64_t n = 0;
            assert_int_equal(llmem_tokenizer_encode(tok, text, len, &ids, &n), LLMEM_OK);
            char *out = NULL;
            size_t out_len = 0;
            assert_int_equal(llmem_tokenizer_decode(tok, ids, n, 0, &out, &out_len), LLMEM_OK);
            if (out_len != len || memcmp(out, text, len) != 0) {
                print_error("%s: round trip of %zu bytes differs\n", invertible[t], len);
                fail();
            }
            char *streamed = stream_decode(tok, ids, n, 0);
            assert_string_equal(streamed, out);
            free(streamed);
            free(out);
            free(ids);
        }
        llmem_tokenizer_free(tok);
    }
}

/* Encoding in batches of the first step's pieces gives the ids of the whole text: batches of 1,
 * 7 and 64 bytes against none, on every tokenizer, random texts of up to 800 bytes. */
static void test_encode_batches(void **state) {
    (void)state;
    char text[4 * 200 + 1];
    const size_t batch = llmem_tok_encode_batch;
    for (size_t t = 0; t < N_TOKENIZERS; t++) {
        struct llmem_tokenizer *tok = load(all_tokenizers[t]);
        for (int iter = 0; iter < 100; iter++) {
            size_t len = random_text(text, 1 + rng() % 200);
            int32_t *want = NULL;
            int64_t n_want = 0;
            llmem_tok_encode_batch = SIZE_MAX;
            assert_int_equal(llmem_tokenizer_encode(tok, text, len, &want, &n_want), LLMEM_OK);
            static const size_t sizes[] = {1, 7, 64};
            for (size_t k = 0; k < 3; k++) {
                int32_t *ids = NULL;
                int64_t n = 0;
                llmem_tok_encode_batch = sizes[k];
                assert_int_equal(llmem_tokenizer_encode(tok, text, len, &ids, &n), LLMEM_OK);
                if (n != n_want || memcmp(ids, want, (size_t)n * sizeof(int32_t)) != 0)
                    fail_msg("%s: batches of %zu bytes change the ids of '%.*s'", all_tokenizers[t],
                             sizes[k], (int)len, text);
                free(ids);
            }
            free(want);
        }
        llmem_tokenizer_free(tok);
    }
    llmem_tok_encode_batch = batch;
}

/* encode_max: a text of exactly max ids encodes, one id more is refused; and a text far past the
 * limit is refused without its ids being made, on every tokenizer (those without a pre-tokenizer,
 * whose whole text is one BPE piece, by its length against the longest token). */
static void test_encode_max(void **state) {
    (void)state;
    const size_t big = 4 << 20;
    char *huge = malloc(big);
    assert_non_null(huge);
    for (size_t i = 0; i < big; i++)
        huge[i] = "abc def ghi"[i % 11];
    for (size_t t = 0; t < N_TOKENIZERS; t++) {
        struct llmem_tokenizer *tok = load(all_tokenizers[t]);
        static const char text[] = "def fibonacci(n):\n    return n if n < 2 else fib(n - 1)";
        int32_t *ids = NULL;
        int64_t n = 0;
        assert_int_equal(llmem_tokenizer_encode(tok, text, strlen(text), &ids, &n), LLMEM_OK);
        free(ids);
        assert_int_equal(llmem_tokenizer_encode_max(tok, text, strlen(text), n, &ids, &n),
                         LLMEM_OK);
        free(ids);
        tu_count_errors(LLMEM_LOG_ERROR);
        tu_expect_failure(llmem_tokenizer_encode_max(tok, text, strlen(text), n - 1, &ids, &n),
                          LLMEM_ERANGE, "more than");
        tu_expect_failure(llmem_tokenizer_encode_max(tok, huge, big, 100, &ids, &n), LLMEM_ERANGE,
                          "more than 100 tokens");
        tu_count_errors_stop();
        llmem_tokenizer_free(tok);
    }
    free(huge);
}

static void check_random_ids(const struct llmem_tokenizer *tok);

/* Random bytes: invalid UTF-8 is refused, valid stretches round trip; random ids always decode to
 * valid UTF-8. */
static void test_random_bytes(void **state) {
    (void)state;
    struct llmem_tokenizer *tok = load("tiny-qwen2");
    char bytes[64];
    int n_invalid = 0, n_valid = 0;
    for (int iter = 0; iter < 2000; iter++) {
        size_t len = 1 + rng() % sizeof(bytes);
        for (size_t i = 0; i < len; i++)
            bytes[i] = (char)(rng() % (iter % 2 ? 256 : 0xC0));
        int32_t *ids = NULL;
        int64_t n = 0;
        int status = llmem_tokenizer_encode(tok, bytes, len, &ids, &n);
        if (status == LLMEM_EINVAL) {
            n_invalid++;
            assert_null(ids);
            continue;
        }
        assert_int_equal(status, LLMEM_OK);
        n_valid++;
        char *out = NULL;
        size_t out_len = 0;
        assert_int_equal(llmem_tokenizer_decode(tok, ids, n, 0, &out, &out_len), LLMEM_OK);
        assert_int_equal(out_len, len);
        assert_memory_equal(out, bytes, len);
        free(out);
        free(ids);
    }
    assert_true(n_invalid > 0 && n_valid > 0);
    tu_error_lines = 0;
    llmem_tokenizer_free(tok);
    /* Random ids (byte tokens cut inside characters among them) on every reference tokenizer. */
    for (size_t t = 0; t < N_TOKENIZERS; t++) {
        tok = load(all_tokenizers[t]);
        check_random_ids(tok);
        llmem_tokenizer_free(tok);
    }
}

static void check_random_ids(const struct llmem_tokenizer *tok) {
    int32_t vocab = llmem_tokenizer_vocab_size(tok);
    for (int iter = 0; iter < 300; iter++) {
        int32_t ids[16];
        int64_t n = 1 + rng() % 16;
        for (int64_t i = 0; i < n; i++)
            ids[i] = (int32_t)(rng() % (uint32_t)vocab);
        char *out = NULL;
        size_t out_len = 0;
        assert_int_equal(llmem_tokenizer_decode(tok, ids, n, 0, &out, &out_len), LLMEM_OK);
        char *streamed = stream_decode(tok, ids, n, 0);
        if (memchr(out, '\0', out_len) == NULL && strcmp(streamed, out) != 0) {
            print_error("stream \"%s\" != decode \"%s\"\n", streamed, out);
            print_ids("ids", ids, n);
            fail();
        }
        free(streamed);
        /* valid UTF-8: encode accepts it */
        int32_t *again = NULL;
        int64_t n_again = 0;
        assert_int_equal(llmem_tokenizer_encode(tok, out, out_len, &again, &n_again), LLMEM_OK);
        free(again);
        free(out);
    }
}

/* ---- added tokens, specials, lookups -------------------------------------------------------- */

static void test_added_tokens(void **state) {
    (void)state;
    struct llmem_tokenizer *tok = load("tiny-qwen2");
    int32_t im_start = llmem_tokenizer_token_id(tok, "<|im_start|>");
    int32_t im_end = llmem_tokenizer_token_id(tok, "<|im_end|>");
    assert_true(im_start >= 0 && im_end >= 0);
    assert_true(llmem_tokenizer_is_special(tok, im_start));
    assert_false(llmem_tokenizer_is_special(tok, 100));
    assert_int_equal(llmem_tokenizer_token_id(tok, "no such token"), -1);
    assert_int_equal(llmem_tokenizer_bos(tok), llmem_tokenizer_token_id(tok, "<|begin_of_text|>"));
    assert_int_equal(llmem_tokenizer_eos(tok), llmem_tokenizer_token_id(tok, "<|end_of_text|>"));

    const char *text = "say<|im_start|>user\nhi<|im_end|><|im_end|>x<|im_start";
    int32_t *ids = NULL;
    int64_t n = 0;
    assert_int_equal(llmem_tokenizer_encode(tok, text, strlen(text), &ids, &n), LLMEM_OK);
    int n_start = 0, n_end = 0;
    for (int64_t i = 0; i < n; i++)
        n_start += ids[i] == im_start, n_end += ids[i] == im_end;
    assert_int_equal(n_start, 1);
    assert_int_equal(n_end, 2);
    /* The pieces between added tokens are encoded on their own. */
    int32_t *part = NULL;
    int64_t n_part = 0;
    assert_int_equal(llmem_tokenizer_encode(tok, "say", 3, &part, &n_part), LLMEM_OK);
    assert_true(n_part < n);
    assert_memory_equal(ids, part, (size_t)n_part * sizeof(*ids));
    assert_int_equal(ids[n_part], im_start);
    free(part);

    char *out = NULL;
    assert_int_equal(llmem_tokenizer_decode(tok, ids, n, 0, &out, NULL), LLMEM_OK);
    assert_string_equal(out, text);
    free(out);
    assert_int_equal(llmem_tokenizer_decode(tok, ids, n, 1, &out, NULL), LLMEM_OK);
    assert_string_equal(out, "sayuser\nhix<|im_start");
    char *streamed = stream_decode(tok, ids, n, 1);
    assert_string_equal(streamed, out);
    free(streamed);
    free(out);
    free(ids);

    /* Byte fallback: a character outside the vocabulary becomes its <0xNN> tokens. */
    llmem_tokenizer_free(tok);
    tok = load("tiny-mistral-swa");
    const char *snow = "\xE2\x98\x83"; /* U+2603 */
    assert_int_equal(llmem_tokenizer_encode(tok, snow, 3, &ids, &n), LLMEM_OK);
    assert_int_equal(n, 4); /* ▁ and three bytes */
    assert_int_equal(ids[1], llmem_tokenizer_token_id(tok, "<0xE2>"));
    assert_int_equal(ids[3], llmem_tokenizer_token_id(tok, "<0x83>"));
    /* A character cut short decodes to U+FFFD; the stream holds a run of byte tokens until a
     * token ends it (a later byte can turn the whole run into U+FFFD), or until the end. */
    assert_int_equal(llmem_tokenizer_decode(tok, ids, 3, 0, &out, NULL), LLMEM_OK);
    assert_string_equal(out, "\xEF\xBF\xBD\xEF\xBF\xBD");
    free(out);
    struct llmem_detok *d = NULL;
    assert_int_equal(llmem_detok_create(tok, 0, &d), LLMEM_OK);
    char *piece = NULL;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(llmem_detok_push(d, ids[i], &piece), LLMEM_OK);
        assert_string_equal(piece, "");
        free(piece);
    }
    assert_int_equal(llmem_detok_push(d, ids[3], &piece), LLMEM_OK);
    assert_string_equal(piece, "");
    free(piece);
    assert_int_equal(llmem_detok_push(d, llmem_tokenizer_eos(tok), &piece), LLMEM_OK);
    assert_string_equal(piece, "\xE2\x98\x83</s>");
    free(piece);
    assert_int_equal(llmem_detok_finish(d, &piece), LLMEM_OK);
    assert_string_equal(piece, "");
    free(piece);
    llmem_detok_free(d);
    assert_int_equal(llmem_detok_create(tok, 0, &d), LLMEM_OK);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(llmem_detok_push(d, ids[i], &piece), LLMEM_OK);
        free(piece);
    }
    assert_int_equal(llmem_detok_finish(d, &piece), LLMEM_OK);
    assert_string_equal(piece, snow);
    free(piece);
    llmem_detok_free(d);
    free(ids);
    llmem_tokenizer_free(tok);
}

/* ---- chat templates ------------------------------------------------------------------------- */

/* A model directory with tiny-qwen2's tokenizer and the given tokenizer_config.json. */
static char *model_with_config(const char *dir, const char *name, const char *config) {
    char path[1024], sub[1024];
    snprintf(sub, sizeof(sub), "%s/%s", dir, name);
    assert_int_equal(mkdir(sub, 0755), 0);
    snprintf(path, sizeof(path), "%s/tiny-qwen2/tokenizer.json", MODELS);
    char *data = NULL;
    size_t len = 0;
    assert_int_equal(llmem_file_read(path, 1 << 24, &data, &len), LLMEM_OK);
    free(tu_write_file(sub, "tokenizer.json", data, (long)len));
    free(data);
    if (config != NULL)
        free(tu_write_file(sub, "tokenizer_config.json", config, -1));
    return strdup(sub);
}

static struct llmem_tokenizer *load_dir(const char *dir) {
    struct llmem_tokenizer *tok = NULL;
    int status = llmem_tokenizer_load(dir, &tok);
    if (status != LLMEM_OK) {
        print_error("%s: %s\n", llmem_status_name(status), llmem_last_error());
        fail();
    }
    return tok;
}

static void expect_render(const struct llmem_tokenizer *tok, enum llmem_chat_template t,
                          const struct llmem_chat_message *m, int n, int gen, const char *want) {
    char *text = NULL;
    assert_int_equal(llmem_chat_render(tok, t, m, n, gen, &text, NULL), LLMEM_OK);
    assert_string_equal(text, want);
    free(text);
}

/* Abbreviated forms of the real templates: recognition goes by their markers. */
#define QWEN25_CONFIG                                                                              \
    "{\"bos_token\": null, \"eos_token\": \"<|im_end|>\", \"chat_template\": \"{%- if "            \
    "messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\\\n' + messages[0]['content'] + "  \
    "'<|im_end|>\\\\n' }}{%- else %}{{- '<|im_start|>system\\\\nYou are Qwen, created by Alibaba " \
    "Cloud. You are a helpful assistant.<|im_end|>\\\\n' }}{%- endif %}\"}"
#define CHATML_CONFIG                                                                              \
    "{\"eos_token\": {\"content\": \"<|im_end|>\", \"lstrip\": false}, \"chat_template\": \"{% "   \
    "for message in messages %}{{'<|im_start|>' + message['role'] + '\\\\n' + message['content'] " \
    "+ '<|im_end|>' + '\\\\n'}}{% endfor %}\"}"
#define LLAMA3_CONFIG                                                                              \
    "{\"bos_token\": \"<|begin_of_text|>\", \"chat_template\": [{\"name\": \"tool_use\", "         \
    "\"template\": \"x\"}, {\"name\": \"default\", \"template\": \"{% set content = "              \
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\\\n\\\\n'+ message['content'] " \
    "| trim + '<|eot_id|>' %}\"}]}"
#define MISTRAL_CONFIG                                                                             \
    "{\"bos_token\": \"<s>\", \"eos_token\": \"</s>\", \"chat_template\": \"{{ bos_token }}{% "    \
    "for "                                                                                         \
    "message in messages %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endfor %}\"}"

static void test_chat_templates(void **state) {
    const char *dir = *state;
    const struct llmem_chat_message conv[] = {
        {"user", "Hi there", 0},
        {"assistant", "Hello!", 0},
        {"user", "  How are you?\n", 0},
    };
    const struct llmem_chat_message with_system[] = {
        {"system", "Be brief.", 0},
        {"user", "Hi", 0},
        {"assistant", "Hello", 0},
        {"user", "Bye", 0},
    };
    enum llmem_chat_template t = LLMEM_CHAT_NONE;

    /* Qwen2.5: the default system message when none is given. */
    char *sub = model_with_config(dir, "qwen25", QWEN25_CONFIG);
    struct llmem_tokenizer *tok = load_dir(sub);
    assert_int_equal(llmem_tokenizer_chat_template(tok, &t), LLMEM_OK);
    assert_int_equal(t, LLMEM_CHAT_CHATML);
    expect_render(tok, t, conv, 3, 1,
                  "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                  "assistant.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>"
                  "assistant\nHello!<|im_end|>\n<|im_start|>user\n  How are you?\n<|im_end|>\n"
                  "<|im_start|>assistant\n");
    expect_render(tok, t, with_system, 2, 0,
                  "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
    /* The rendered text encodes with its markers as the special ids. */
    char *rendered = NULL;
    assert_int_equal(llmem_chat_render(tok, t, conv, 3, 1, &rendered, NULL), LLMEM_OK);
    int32_t *ids = NULL;
    int64_t n_ids = 0, n_start = 0;
    assert_int_equal(llmem_tokenizer_encode(tok, rendered, strlen(rendered), &ids, &n_ids),
                     LLMEM_OK);
    for (int64_t i = 0; i < n_ids; i++)
        n_start += ids[i] == llmem_tokenizer_token_id(tok, "<|im_start|>");
    assert_int_equal(n_start, 5); /* system, three messages, the prompt */
    char *back = NULL;
    assert_int_equal(llmem_tokenizer_decode(tok, ids, n_ids, 0, &back, NULL), LLMEM_OK);
    assert_string_equal(back, rendered);
    free(back);
    free(ids);
    free(rendered);
    /* A content holding NULs is rendered whole (content_len counts them), not cut at the first. */
    {
        static const char body[] = "\0def f():\0 return 1";
        const struct llmem_chat_message nul[] = {{"user", body, sizeof(body) - 1}};
        static const char want[] = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
                                   "You are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                                   "\0def f():\0 return 1<|im_end|>\n<|im_start|>assistant\n";
        size_t len = 0;
        assert_int_equal(llmem_chat_render(tok, t, nul, 1, 1, &rendered, &len), LLMEM_OK);
        assert_int_equal(len, sizeof(want) - 1);
        assert_memory_equal(rendered, want, sizeof(want) - 1);
        free(rendered);
    }
    int32_t stops[4];
    assert_int_equal(llmem_chat_stop_ids(tok, t, stops, 4), 1);
    assert_int_equal(stops[0], llmem_tokenizer_token_id(tok, "<|im_end|>"));
    assert_int_equal(llmem_tokenizer_eos(tok), stops[0]);
    assert_int_equal(llmem_tokenizer_bos(tok), -1);
    llmem_tokenizer_free(tok);
    free(sub);

    /* Generic ChatML: no default system message. */
    sub = model_with_config(dir, "chatml", CHATML_CONFIG);
    tok = load_dir(sub);
    assert_int_equal(llmem_tokenizer_chat_template(tok, &t), LLMEM_OK);
    assert_int_equal(t, LLMEM_CHAT_CHATML);
    expect_render(tok, t, conv, 1, 1,
                  "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n");
    llmem_tokenizer_free(tok);
    free(sub);

    /* Llama 3, the "default" entry of a template list; contents are trimmed. */
    sub = model_with_config(dir, "llama3", LLAMA3_CONFIG);
    tok = load_dir(sub);
    assert_int_equal(llmem_tokenizer_chat_template(tok, &t), LLMEM_OK);
    assert_int_equal(t, LLMEM_CHAT_LLAMA3);
    expect_render(tok, t, with_system, 2, 1,
                  "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief."
                  "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n");
    expect_render(tok, t, conv, 3, 0,
                  "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there"
                  "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>");
    llmem_tokenizer_free(tok);
    free(sub);

    /* Mistral: the system message goes before the first user message; roles alternate. */
    sub = model_with_config(dir, "mistral", MISTRAL_CONFIG);
    tok = load_dir(sub);
    assert_int_equal(llmem_tokenizer_chat_template(tok, &t), LLMEM_OK);
    assert_int_equal(t, LLMEM_CHAT_MISTRAL);
    expect_render(tok, t, with_system, 4, 1,
                  "<s>[INST] Be brief.\n\nHi [/INST]Hello</s>[INST] Bye [/INST]");
    expect_render(tok, t, conv, 2, 0, "<s>[INST] Hi there [/INST]Hello!</s>");
    tu_expect_failure(llmem_chat_render(tok, t, conv + 1, 2, 1, &(char *){NULL}, NULL),
                      LLMEM_EINVAL, "alternate");
    llmem_tokenizer_free(tok);
    free(sub);

    /* The published Mistral variants, told apart by their spacing (template texts abridged to
     * the lines that render plain conversations). */
    static const char v01[] =
        "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] "
        "%}{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}"
        "{%- endif %}{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == "
        "'user' %}{%- if loop.first and system_message is defined %}{{- ' [INST] ' + "
        "system_message + '\\n\\n' + message['content'] + ' [/INST]' }}{%- else %}{{- ' [INST] ' + "
        "message['content'] + ' [/INST]' }}{%- endif %}{%- elif message['role'] == 'assistant' %}"
        "{{- ' ' + message['content'] + eos_token}}{%- endif %}{%- endfor %}";
    static const char v03[] =
        "{%- for message in loop_messages %}{%- if message[\"role\"] == \"user\" %}{%- if "
        "loop.last "
        "and system_message is defined %}{{- \"[INST] \" + system_message + \"\\n\\n\" + "
        "message[\"content\"] + \"[/INST]\" }}{%- else %}{{- \"[INST] \" + message[\"content\"] + "
        "\"[/INST]\" }}{%- endif %}{%- elif message[\"role\"] == \"assistant\" %}{{- \" \" + "
        "message[\"content\"]|trim + eos_token}}{%- endif %}{%- endfor %}";
    static const struct {
        const char *name, *template_text, *want;
    } variants[] = {
        {"mistral-v01", v01, "<s> [INST] Be brief.\n\nHi [/INST] Hello</s> [INST] Bye [/INST]"},
        {"mistral-v03", v03, "<s>[INST] Hi[/INST] Hello</s>[INST] Be brief.\n\nBye[/INST]"},
    };
    for (size_t i = 0; i < sizeof(variants) / sizeof(variants[0]); i++) {
        cJSON *cfg = cJSON_CreateObject();
        cJSON_AddStringToObject(cfg, "bos_token", "<s>");
        cJSON_AddStringToObject(cfg, "eos_token", "</s>");
        cJSON_AddStringToObject(cfg, "chat_template", variants[i].template_text);
        char *cfg_text = cJSON_Print(cfg);
        sub = model_with_config(dir, variants[i].name, cfg_text);
        tok = load_dir(sub);
        assert_int_equal(llmem_tokenizer_chat_template(tok, &t), LLMEM_OK);
        assert_int_equal(t, LLMEM_CHAT_MISTRAL);
        expect_render(tok, t, with_system, 4, 1, variants[i].want);
        llmem_tokenizer_free(tok);
        free(sub);
        free(cfg_text);
        cJSON_Delete(cfg);
    }

    /* chat_template.jinja wins over the config. */
    sub = model_with_config(dir, "jinja", MISTRAL_CONFIG);
    free(tu_write_file(sub, "chat_template.jinja",
                       "{% for m in messages %}<|start_header_id|>{{ m.role }}{% endfor %}", -1));
    tok = load_dir(sub);
    assert_int_equal(llmem_tokenizer_chat_template(tok, &t), LLMEM_OK);
    assert_int_equal(t, LLMEM_CHAT_LLAMA3);
    llmem_tokenizer_free(tok);
    free(sub);

    /* No template; an unknown one; names. */
    sub = model_with_config(dir, "none", "{\"bos_token\": \"<|begin_of_text|>\"}");
    tok = load_dir(sub);
    assert_int_equal(llmem_tokenizer_chat_template(tok, &t), LLMEM_OK);
    assert_int_equal(t, LLMEM_CHAT_NONE);
    tu_expect_failure(llmem_chat_render(tok, LLMEM_CHAT_NONE, conv, 1, 1, &(char *){NULL}, NULL),
                      LLMEM_EINVAL, "--chat-template");
    const struct llmem_chat_message bad_role[] = {{"tool", "x", 0}};
    tu_expect_failure(
        llmem_chat_render(tok, LLMEM_CHAT_CHATML, bad_role, 1, 1, &(char *){NULL}, NULL),
        LLMEM_EINVAL, "role 'tool'");
    /* An override renders ChatML without Qwen's default system message. */
    expect_render(tok, LLMEM_CHAT_CHATML, conv, 1, 0, "<|im_start|>user\nHi there<|im_end|>\n");
    llmem_tokenizer_free(tok);
    free(sub);

    sub = model_with_config(dir, "unknown",
                            "{\"chat_template\": \"{% for m in messages %}### {{ m.role }}: {{ "
                            "m.content }}{% endfor %}\"}");
    tok = load_dir(sub);
    tu_expect_failure(llmem_tokenizer_chat_template(tok, &t), LLMEM_EUNSUPPORTED,
                      "unrecognized chat template");
    llmem_tokenizer_free(tok);
    free(sub);

    for (int i = LLMEM_CHAT_CHATML; i <= LLMEM_CHAT_MISTRAL; i++) {
        assert_int_equal(
            llmem_chat_template_parse(llmem_chat_template_name((enum llmem_chat_template)i), &t),
            LLMEM_OK);
        assert_int_equal(t, i);
    }
    assert_string_equal(llmem_chat_template_name(LLMEM_CHAT_NONE), "none");
    tu_expect_failure(llmem_chat_template_parse("vicuna", &t), LLMEM_EINVAL, "chatml");
}

/* ---- errors --------------------------------------------------------------------------------- */

static void expect_load_failure(const char *dir, const char *name, const char *json, int want,
                                const char *phrase) {
    char sub[1024];
    snprintf(sub, sizeof(sub), "%s/%s", dir, name);
    assert_int_equal(mkdir(sub, 0755), 0);
    free(tu_write_file(sub, "tokenizer.json", json, -1));
    struct llmem_tokenizer *tok = (struct llmem_tokenizer *)&sub; /* must be reset to NULL */
    tu_expect_failure(llmem_tokenizer_load(sub, &tok), want, phrase);
    assert_null(tok);
}

#define BPE_MODEL                                                                                  \
    "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, "                  \
    "\"merges\": [\"a b\"]}"

static void test_load_errors(void **state) {
    const char *dir = *state;
    struct llmem_tokenizer *tok = NULL;
    char missing[1024];
    snprintf(missing, sizeof(missing), "%s/nothing-here", dir);
    tu_expect_failure(llmem_tokenizer_load(missing, &tok), LLMEM_ENOENT, "tokenizer.json");

    expect_load_failure(dir, "malformed", "{\"model\": {", LLMEM_EFORMAT, "invalid JSON");
    expect_load_failure(dir, "no-model", "{\"version\": \"1.0\"}", LLMEM_EFORMAT,
                        "missing 'model'");
    expect_load_failure(dir, "unigram",
                        "{\"model\": {\"type\": \"Unigram\", \"vocab\": [[\"a\", 0.0]]}}",
                        LLMEM_EUNSUPPORTED, "model type 'Unigram'");
    expect_load_failure(dir, "wordpiece", "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}",
                        LLMEM_EUNSUPPORTED, "'WordPiece'");
    expect_load_failure(dir, "pretok",
                        "{" BPE_MODEL ", \"pre_tokenizer\": {\"type\": "
                        "\"Whitespace\"}}",
                        LLMEM_EUNSUPPORTED, "pre-tokenizer 'Whitespace'");
    expect_load_failure(dir, "split-behavior",
                        "{" BPE_MODEL ", \"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": "
                        "{\"Regex\": \"a\"}, \"behavior\": \"Removed\", \"invert\": false}}",
                        LLMEM_EUNSUPPORTED, "behavior 'Removed'");
    expect_load_failure(dir, "bad-regex",
                        "{" BPE_MODEL ", \"pre_tokenizer\": {\"type\": \"Sequence\", "
                        "\"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": "
                        "\"(a|b\"}, \"behavior\": \"Isolated\", \"invert\": false}]}}",
                        LLMEM_EFORMAT, "not a valid regex");
    expect_load_failure(dir, "normalizer", "{" BPE_MODEL ", \"normalizer\": {\"type\": \"NFKC\"}}",
                        LLMEM_EUNSUPPORTED, "normalizer 'NFKC'");
    expect_load_failure(dir, "decoder", "{" BPE_MODEL ", \"decoder\": {\"type\": \"WordPiece\"}}",
                        LLMEM_EUNSUPPORTED, "decoder 'WordPiece'");
    expect_load_failure(dir, "bad-merge",
                        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, "
                        "\"merges\": [[\"a\", \"b\"]]}}",
                        LLMEM_EFORMAT, "merges[0]");
    expect_load_failure(dir, "bad-vocab",
                        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": \"zero\"}, "
                        "\"merges\": []}}",
                        LLMEM_EFORMAT, "'model.vocab' entry \"a\"");
    expect_load_failure(dir, "dropout",
                        "{\"model\": {\"type\": \"BPE\", \"dropout\": 0.1, \"vocab\": {}, "
                        "\"merges\": []}}",
                        LLMEM_EUNSUPPORTED, "dropout");

    expect_load_failure(dir, "single-word",
                        "{" BPE_MODEL ", \"added_tokens\": [{\"id\": 3, \"content\": \"<x>\", "
                        "\"single_word\": true}]}",
                        LLMEM_EUNSUPPORTED, "single_word");
    expect_load_failure(dir, "replace-regex",
                        "{" BPE_MODEL ", \"normalizer\": {\"type\": \"Replace\", \"pattern\": "
                        "{\"Regex\": \" +\"}, \"content\": \" \"}}",
                        LLMEM_EUNSUPPORTED, "Regex pattern");
    /* ids index the tables: one far from the rest would size them by itself */
    expect_load_failure(dir, "sparse-ids",
                        "{" BPE_MODEL ", \"added_tokens\": [{\"id\": 67108863, \"content\": "
                        "\"<big>\"}]}",
                        LLMEM_EFORMAT, "ids go up to 67108863 for 3 vocabulary entries");
    expect_load_failure(dir, "unknown-merge-token",
                        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, "
                        "\"merges\": [\"a a b\"]}}",
                        LLMEM_EFORMAT, "two tokens");

    /* Ids between the vocabulary's tokens that no token has (3 and 4, before an added 5) decode
     * to nothing, whole and streamed, as tokenizers decodes them; past the last id, an error */
    {
        char gap[1024];
        snprintf(gap, sizeof(gap), "%s/gap", dir);
        assert_int_equal(mkdir(gap, 0755), 0);
        free(tu_write_file(gap, "tokenizer.json",
                           "{" BPE_MODEL ", \"added_tokens\": [{\"id\": 5, \"content\": "
                           "\"<x>\", \"special\": true}]}",
                           -1));
        struct llmem_tokenizer *g = load_dir(gap);
        char *with = NULL, *without = NULL;
        assert_int_equal(
            llmem_tokenizer_decode(g, (const int32_t[]){0, 3, 1, 4}, 4, 0, &with, NULL), LLMEM_OK);
        assert_int_equal(llmem_tokenizer_decode(g, (const int32_t[]){0, 1}, 2, 0, &without, NULL),
                         LLMEM_OK);
        assert_string_equal(with, without);
        free(with), free(without);
        struct llmem_detok *d = NULL;
        assert_int_equal(llmem_detok_create(g, 0, &d), LLMEM_OK);
        char *piece = NULL;
        assert_int_equal(llmem_detok_push(d, 3, &piece), LLMEM_OK);
        assert_string_equal(piece != NULL ? piece : "", "");
        free(piece);
        llmem_detok_free(d);
        tu_expect_failure(llmem_tokenizer_decode(g, (const int32_t[]){6}, 1, 0, &with, NULL),
                          LLMEM_EINVAL, "id 6");
        llmem_tokenizer_free(g);
    }

    /* An empty vocabulary loads and encodes to nothing; without a decoder tokens join with
     * spaces, as tokenizers does. */
    char sub[1024];
    snprintf(sub, sizeof(sub), "%s/empty", dir);
    assert_int_equal(mkdir(sub, 0755), 0);
    free(tu_write_file(sub, "tokenizer.json",
                       "{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}}", -1));
    tok = load_dir(sub);
    int32_t *ids = NULL;
    int64_t n = 0;
    assert_int_equal(llmem_tokenizer_vocab_size(tok), 0);
    assert_int_equal(llmem_tokenizer_encode(tok, "abc", 3, &ids, &n), LLMEM_OK);
    assert_int_equal(n, 0);
    free(ids);
    llmem_tokenizer_free(tok);

    /* A tiny BPE with both merge spellings works. */
    snprintf(sub, sizeof(sub), "%s/tiny", dir);
    assert_int_equal(mkdir(sub, 0755), 0);
    free(tu_write_file(sub, "tokenizer.json",
                       "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2, "
                       "\"c\": 3, \"abc\": 4}, \"merges\": [\"a b\", [\"ab\", \"c\"]]}, "
                       "\"decoder\": {\"type\": \"Fuse\"}}",
                       -1));
    tok = load_dir(sub);
    assert_int_equal(llmem_tokenizer_encode(tok, "abcab", 5, &ids, &n), LLMEM_OK);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], 4);
    assert_int_equal(ids[1], 2);
    char *joined = NULL;
    assert_int_equal(llmem_tokenizer_decode(tok, ids, n, 0, &joined, NULL), LLMEM_OK);
    assert_string_equal(joined, "abcab");
    free(joined);
    free(ids);
    llmem_tokenizer_free(tok);
    snprintf(sub, sizeof(sub), "%s/no-decoder", dir);
    assert_int_equal(mkdir(sub, 0755), 0);
    free(tu_write_file(sub, "tokenizer.json",
                       "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2, "
                       "\"c\": 3, \"abc\": 4}, \"merges\": [\"a b\", [\"ab\", \"c\"]]}}",
                       -1));
    tok = load_dir(sub);
    const int32_t pair[] = {4, 2};
    assert_int_equal(llmem_tokenizer_decode(tok, pair, 2, 0, &joined, NULL), LLMEM_OK);
    assert_string_equal(joined, "abc ab");
    free(joined);

    /* Bad input to encode and decode. */
    tu_expect_failure(llmem_tokenizer_encode(tok, "a\xC3(b", 4, &ids, &n), LLMEM_EINVAL,
                      "not valid UTF-8");
    assert_null(ids);
    tu_expect_failure(llmem_tokenizer_encode(tok, "\xED\xA0\x80", 3, &ids, &n), LLMEM_EINVAL,
                      "not valid UTF-8");
    const int32_t bad_ids[] = {0, 5};
    char *text = NULL;
    tu_expect_failure(llmem_tokenizer_decode(tok, bad_ids, 2, 0, &text, NULL), LLMEM_EINVAL,
                      "id 5");
    assert_null(text);
    llmem_tokenizer_free(tok);
    llmem_tokenizer_free(NULL);
    llmem_detok_free(NULL);
}

/* ---- NFC ------------------------------------------------------------------------------------ */

/* llmem_tok_nfc against Python's unicodedata.normalize("NFC", s) on random strings of combining
 * marks, Hangul jamo and syllables, singletons and composition exclusions
 * (tests/data/tok/nfc.json). */
/* A NUL is a byte like any other: with a byte-level BPE it is the byte token of 0x00 ("Ā"), and
 * the text after it is encoded too. */
static void test_nul_byte(void **state) {
    (void)state;
    struct llmem_tokenizer *tok = load("tiny-qwen2");
    int32_t nul_id = llmem_tokenizer_token_id(tok, "\xc4\x80"); /* Ā: byte 0x00 */
    assert_true(nul_id >= 0);
    static const char text[] = "def foo():\0 return 1";
    int32_t *ids = NULL, *head = NULL, *tail = NULL;
    int64_t n = 0, n_head = 0, n_tail = 0;
    assert_int_equal(llmem_tokenizer_encode(tok, text, sizeof(text) - 1, &ids, &n), LLMEM_OK);
    assert_int_equal(llmem_tokenizer_encode(tok, "def foo():", 10, &head, &n_head), LLMEM_OK);
    assert_int_equal(llmem_tokenizer_encode(tok, " return 1", 9, &tail, &n_tail), LLMEM_OK);
    assert_int_equal(n, n_head + 1 + n_tail);
    assert_memory_equal(ids, head, (size_t)n_head * sizeof(*ids));
    assert_int_equal(ids[n_head], nul_id);
    assert_memory_equal(ids + n_head + 1, tail, (size_t)n_tail * sizeof(*ids));
    free(ids);
    /* a NUL first */
    assert_int_equal(llmem_tokenizer_encode(tok, "\0def", 4, &ids, &n), LLMEM_OK);
    assert_true(n >= 2);
    assert_int_equal(ids[0], nul_id);
    char *back = NULL;
    size_t back_len = 0;
    assert_int_equal(llmem_tokenizer_decode(tok, ids, n, 0, &back, &back_len), LLMEM_OK);
    assert_int_equal(back_len, 4);
    assert_memory_equal(back, "\0def", 4);
    free(back);
    free(ids);
    free(head);
    free(tail);
    llmem_tokenizer_free(tok);
}

static void test_nfc(void **state) {
    (void)state;
    cJSON *root = NULL;
    assert_int_equal(llmem_json_parse_file(TOK_DATA "/nfc.json", 1 << 22, &root), LLMEM_OK);
    int n = 0, n_bad = 0;
    const cJSON *v = NULL;
    cJSON_ArrayForEach(v, cJSON_GetObjectItem(root, "vectors")) {
        const char *in = cJSON_GetArrayItem(v, 0)->valuestring;
        const char *want = cJSON_GetArrayItem(v, 1)->valuestring;
        struct tok_buf out = {0};
        assert_int_equal(llmem_tok_buf_reserve(&out, 0), LLMEM_OK);
        assert_int_equal(llmem_tok_nfc(&out, in, strlen(in)), LLMEM_OK);
        if (strcmp(out.p, want) != 0) {
            fprintf(stderr, "NFC of \"%s\": want \"%s\", got \"%s\"\n", in, want, out.p);
            n_bad++;
        }
        n++;
        llmem_tok_buf_free(&out);
    }
    print_message("NFC: %d vectors (Unicode %s)\n", n,
                  cJSON_GetObjectItem(root, "unicode")->valuestring);
    cJSON_Delete(root);
    assert_true(n > 400);
    assert_int_equal(n_bad, 0);
}

/* ---- speed ---------------------------------------------------------------------------------- */

static void time_encode(const char *name, const char *text, size_t len, const char *what) {
    struct llmem_tokenizer *tok = load(name);
    int32_t *ids = NULL;
    int64_t n = 0;
    double t0 = llmem_clock_s();
    assert_int_equal(llmem_tokenizer_encode(tok, text, len, &ids, &n), LLMEM_OK);
    double t1 = llmem_clock_s();
    char *out = NULL;
    size_t out_len = 0;
    assert_int_equal(llmem_tokenizer_decode(tok, ids, n, 0, &out, &out_len), LLMEM_OK);
    double t2 = llmem_clock_s();
    /* cut in batches (64 KiB of the first step's pieces at a time), the ids of the whole */
    const size_t batch = llmem_tok_encode_batch;
    llmem_tok_encode_batch = SIZE_MAX;
    int32_t *whole = NULL;
    int64_t n_whole = 0;
    assert_int_equal(llmem_tokenizer_encode(tok, text, len, &whole, &n_whole), LLMEM_OK);
    llmem_tok_encode_batch = batch;
    assert_int_equal(n_whole, n);
    assert_memory_equal(whole, ids, (size_t)n * sizeof(int32_t));
    free(whole);
    print_message("%-20s %s: %zu bytes → %lld ids, encode %.3f s, decode %.3f s\n", name, what, len,
                  (long long)n, t1 - t0, t2 - t1);
    assert_int_equal(out_len, len);
    assert_memory_equal(out, text, len);
    free(out);
    free(ids);
    llmem_tokenizer_free(tok);
}

static void test_encode_megabyte(void **state) {
    (void)state;
    size_t cap = (1 << 20) + 1024, len = 0;
    char *text = malloc(cap);
    assert_non_null(text);
    while (len < (1 << 20)) /* prose-like: random words of random letters, some punctuation */
        len += random_text(text + len, 1 + rng() % 10), text[len++] = ' ';
    text[len] = '\0';
    time_encode("tiny-llama3", text, len, "1 MiB random text");
    time_encode("tiny-mistral-swa", text, len, "1 MiB random text");
    len = 0; /* English-like: common words, punctuation and newlines */
    static const char *const words[] = {
        "the",   "of",    "and",   "to",       "in",    "is",      "that", "for",  "it",   "as",
        "was",   "with",  "be",    "by",       "on",    "not",     "he",   "I",    "this", "are",
        "or",    "his",   "from",  "at",       "which", "but",     "have", "an",   "had",  "they",
        "you",   "were",  "their", "one",      "all",   "we",      "can",  "her",  "has",  "there",
        "been",  "if",    "more",  "when",     "will",  "would",   "who",  "so",   "no",   "memory",
        "token", "model", "cache", "planned,", "runs.", "(small)", "2024", "x=1;", "\n",
    };
    while (len < (1 << 20)) {
        const char *w = words[rng() % (sizeof(words) / sizeof(words[0]))];
        size_t wl = strlen(w);
        memcpy(text + len, w, wl);
        len += wl;
        text[len++] = ' ';
    }
    text[len] = '\0';
    time_encode("tiny-llama3", text, len, "1 MiB of English words");
    time_encode("tiny-mistral-swa", text, len, "1 MiB of English words");
    /* One piece of a megabyte: no spaces, so BPE sees a single word. */
    for (size_t i = 0; i < len; i++)
        text[i] = "abcdefghij"[rng() % 10];
    time_encode("tiny-mistral-swa", text, len, "1 MiB without spaces");
    time_encode("tiny-qwen2", text, len, "1 MiB without spaces");
    /* Long runs of whitespace: the split regex must stay linear on them. */
    for (size_t i = 0; i < len; i++)
        text[i] = i % 100000 == 99999 ? 'x' : " \t"[(i / 50000) % 2];
    time_encode("tiny-llama3", text, len, "1 MiB of whitespace");
    time_encode("tok-gpt2", text, len, "1 MiB of whitespace");
    free(text);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_reference_cases, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test(test_encode_batches),
        cmocka_unit_test(test_encode_max),
        cmocka_unit_test_setup_teardown(test_round_trip_random, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_random_bytes, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_added_tokens, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_chat_templates, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_load_errors, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_nul_byte, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_nfc, tu_setup_dir, tu_teardown_dir),
        cmocka_unit_test_setup_teardown(test_encode_megabyte, tu_setup_dir, tu_teardown_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
