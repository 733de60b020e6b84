/*
 * tests/e2e/e2e-serve.c — `llmem serve models/pycoder` on a free loopback port, driven with curl
 * (and a raw socket for a client that goes away): completions and chat, non-streaming and
 * streaming, greedy text equal to `llmem run`'s, logprobs, 16 concurrent clients equal to single
 * requests, a disconnect that frees its KV (streaming) or cancels its request (non-streaming),
 * bank hits for a shared system prompt, the cache clear, /health and /metrics, bad requests (each
 * a 4xx with an OpenAI error object, the server serving on), the API key, a full queue (503),
 * --util against `llmem plan`, and a burst of long requests on a small memory budget (each
 * completes or gets 507; the allocator's peak stays under its limit), and each allocation a
 * request reaches failing in turn (a 200 with the greedy text or a clean 5xx; it serves on).
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/json.h"
#include "engine/hooks.h"
#include "llmem/engine.h"
#include "llmem/mem.h"
#include "llmem/server.h"
#include "llmem/tokenizer.h"
#include "testutil.h"
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#define PYCODER LLMEM_SOURCE_DIR "/models/pycoder"
#define REFS    LLMEM_TEST_DATA "/models/pycoder"

static struct tu_server srv; /* chatml, the defaults: shared by the tests of the first group */

static void url_of(const struct tu_server *s, const char *path, char *buf, size_t size) {
    snprintf(buf, size, "%s%s", s->url, path);
}

static struct tu_http post(const struct tu_server *s, const char *path, const char *body) {
    char url[256];
    url_of(s, path, url, sizeof(url));
    return tu_http("POST", url, body);
}

static struct tu_http get(const struct tu_server *s, const char *path) {
    char url[256];
    url_of(s, path, url, sizeof(url));
    return tu_http("GET", url, NULL);
}

static char *json_escape(const char *s) {
    cJSON *str = cJSON_CreateString(s);
    char *out = cJSON_PrintUnformatted(str);
    cJSON_Delete(str);
    return out;
}

/* `llmem run MODEL -p PROMPT -n N --ignore-eos --json`'s text (malloc'ed). */
static char *run_text(const char *prompt, int n) {
    char num[16];
    snprintf(num, sizeof(num), "%d", n);
    struct tu_run r =
        tu_llmem("run", PYCODER, "-p", prompt, "-n", num, "--ignore-eos", "--json", NULL);
    assert_int_equal(r.exit_code, 0);
    cJSON *out = tu_json_stdout(&r);
    char *text = strdup(cJSON_GetObjectItem(out, "text")->valuestring);
    cJSON_Delete(out);
    tu_run_free(&r);
    return text;
}

/* A greedy completion request's text (malloc'ed); the response's shape checked on the way. */
static char *complete(const struct tu_server *s, const char *prompt_json, int n) {
    char body[8192];
    snprintf(body, sizeof(body),
             "{\"model\": \"pycoder\", \"prompt\": %s, \"max_tokens\": %d, \"temperature\": 0, "
             "\"ignore_eos\": true}",
             prompt_json, n);
    struct tu_http h = post(s, "/v1/completions", body);
    assert_int_equal(h.status, 200);
    cJSON *root = tu_http_json(&h);
    assert_string_equal(cJSON_GetObjectItem(root, "object")->valuestring, "text_completion");
    assert_string_equal(cJSON_GetObjectItem(root, "model")->valuestring, "pycoder");
    assert_true(strncmp(cJSON_GetObjectItem(root, "id")->valuestring, "cmpl-", 5) == 0);
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
    assert_int_equal(cJSON_GetObjectItem(c, "index")->valueint, 0);
    assert_string_equal(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "length");
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(c, "logprobs")));
    const cJSON *u = cJSON_GetObjectItem(root, "usage");
    assert_int_equal(cJSON_GetObjectItem(u, "completion_tokens")->valueint, n);
    assert_int_equal(cJSON_GetObjectItem(u, "total_tokens")->valueint,
                     cJSON_GetObjectItem(u, "prompt_tokens")->valueint + n);
    char *text = strdup(cJSON_GetObjectItem(c, "text")->valuestring);
    cJSON_Delete(root);
    tu_http_free(&h);
    return text;
}

/* A greedy request's usage.prompt_tokens and text (malloc'ed). */
static int64_t prompt_tokens_of(const char *path, const char *body, char **text) {
    struct tu_http h = post(&srv, path, body);
    if (h.status != 200)
        print_error("%s -> %d: %s\n", body, h.status, h.body);
    assert_int_equal(h.status, 200);
    cJSON *root = tu_http_json(&h);
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
    const cJSON *t = cJSON_GetObjectItem(c, "text");
    if (t == NULL)
        t = cJSON_GetObjectItem(cJSON_GetObjectItem(c, "message"), "content");
    *text = strdup(t->valuestring);
    int64_t n = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "usage"), "prompt_tokens")->valueint;
    cJSON_Delete(root);
    tu_http_free(&h);
    return n;
}

/* A NUL (\u0000) in a prompt or a message is a character like any other: the prompt is the
 * tokenizer's ids of all its bytes, neither cut at the NUL nor "empty" when it starts with one. */
static void test_nul_in_prompt(void **state) {
    (void)state;
    struct llmem_tokenizer *tok = NULL;
    assert_int_equal(llmem_tokenizer_load(PYCODER, &tok), LLMEM_OK);
    static const struct {
        const char *json; /* the prompt as a JSON string */
        const char *bytes;
        size_t len;
    } cases[] = {
        {"\"def foo():\\u0000 return 1\"", "def foo():\0 return 1", 20},
        {"\"\\u0000def\"", "\0def", 4},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        int32_t *ids = NULL;
        int64_t n = 0;
        assert_int_equal(llmem_tokenizer_encode(tok, cases[k].bytes, cases[k].len, &ids, &n),
                         LLMEM_OK);
        char list[1024] = "[", body[2048];
        for (int64_t i = 0; i < n; i++)
            snprintf(list + strlen(list), sizeof(list) - strlen(list), "%s%d", i ? "," : "",
                     ids[i]);
        strcat(list, "]");
        const char *fmt = "{\"model\": \"pycoder\", \"prompt\": %s, \"max_tokens\": 6, "
                          "\"temperature\": 0, \"ignore_eos\": true}";
        char *by_text = NULL, *by_ids = NULL;
        snprintf(body, sizeof(body), fmt, cases[k].json);
        assert_int_equal(prompt_tokens_of("/v1/completions", body, &by_text), n);
        snprintf(body, sizeof(body), fmt, list);
        assert_int_equal(prompt_tokens_of("/v1/completions", body, &by_ids), n);
        assert_string_equal(by_text, by_ids);
        free(by_text);
        free(by_ids);
        free(ids);
    }
    /* chat: a content string and a text part, each starting with a NUL and holding another */
    static const char content[] = "\0def add(a, b):\0 return";
    const struct llmem_chat_message msgs[] = {{"user", content, sizeof(content) - 1}};
    char *rendered = NULL;
    size_t len = 0;
    assert_int_equal(llmem_chat_render(tok, LLMEM_CHAT_CHATML, msgs, 1, 1, &rendered, &len),
                     LLMEM_OK);
    int32_t *ids = NULL;
    int64_t n = 0;
    assert_int_equal(llmem_tokenizer_encode(tok, rendered, len, &ids, &n), LLMEM_OK);
    static const char *const chats[] = {
        "{\"model\": \"pycoder\", \"messages\": [{\"role\": \"user\", \"content\": "
        "\"\\u0000def add(a, b):\\u0000 return\"}], \"max_tokens\": 4, \"temperature\": 0}",
        "{\"model\": \"pycoder\", \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": "
        "\"text\", \"text\": \"\\u0000def add(a, b):\\u0000 return\"}]}], \"max_tokens\": 4, "
        "\"temperature\": 0}",
    };
    for (int k = 0; k < 2; k++) {
        char *text = NULL;
        assert_int_equal(prompt_tokens_of("/v1/chat/completions", chats[k], &text), n);
        free(text);
    }
    free(ids);
    free(rendered);
    llmem_tokenizer_free(tok);
}

static int group_setup(void **state) {
    (void)state;
    const char *args[] = {PYCODER, "--chat-template", "chatml", "--threads", "2"};
    tu_serve_start(&srv, 5, args);
    return 0;
}

static int group_teardown(void **state) {
    (void)state;
    assert_int_equal(tu_serve_stop(&srv), 0); /* SIGTERM stops it cleanly */
    return 0;
}

/* ---- completions ----------------------------------------------------------------------------- */

/* Greedy completions equal `llmem run` for every reference prompt, as text and as token ids. */
static void test_completions_match_run(void **state) {
    (void)state;
    cJSON *ref = NULL;
    assert_int_equal(llmem_json_parse_file(REFS "/reference.json", 1 << 24, &ref), 0);
    const cJSON *g = NULL;
    cJSON_ArrayForEach(g, cJSON_GetObjectItem(ref, "generations")) {
        const char *prompt = cJSON_GetObjectItem(g, "prompt")->valuestring;
        char *want = run_text(prompt, 40);
        char *esc = json_escape(prompt);
        char *got = complete(&srv, esc, 40);
        assert_string_equal(got, want);
        free(got);
        char *ids = cJSON_PrintUnformatted(cJSON_GetObjectItem(g, "prompt_ids"));
        got = complete(&srv, ids, 40);
        assert_string_equal(got, want);
        free(got);
        free(ids);
        free(esc);
        free(want);
    }
    cJSON_Delete(ref);
}

/* stream: true gives the same text in chunks, a finish chunk, the usage, then [DONE]. */
static void test_completions_stream(void **state) {
    (void)state;
    const char *prompt = "import os\nimport sys\n\n\ndef main():\n";
    char *want = run_text(prompt, 32);
    char *esc = json_escape(prompt), body[4096];
    snprintf(body, sizeof(body),
             "{\"prompt\": %s, \"max_tokens\": 32, \"temperature\": 0, \"ignore_eos\": true, "
             "\"stream\": true, \"stream_options\": {\"include_usage\": true}}",
             esc);
    struct tu_http h = post(&srv, "/v1/completions", body);
    assert_int_equal(h.status, 200);
    assert_non_null(strstr(h.headers, "text/event-stream"));
    cJSON *ev[128];
    int n = tu_sse_events(h.body, ev, 128);
    assert_true(n >= 3);
    char text[4096] = "";
    for (int i = 0; i < n - 2; i++) {
        const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(ev[i], "choices"), 0);
        assert_true(cJSON_IsNull(cJSON_GetObjectItem(c, "finish_reason")));
        assert_true(cJSON_IsNull(cJSON_GetObjectItem(ev[i], "usage")));
        strcat(text, cJSON_GetObjectItem(c, "text")->valuestring);
    }
    assert_string_equal(text, want);
    const cJSON *last = cJSON_GetArrayItem(cJSON_GetObjectItem(ev[n - 2], "choices"), 0);
    assert_string_equal(cJSON_GetObjectItem(last, "finish_reason")->valuestring, "length");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(ev[n - 1], "choices")), 0);
    const cJSON *u = cJSON_GetObjectItem(ev[n - 1], "usage");
    assert_int_equal(cJSON_GetObjectItem(u, "prompt_tokens")->valueint, 9);
    assert_int_equal(cJSON_GetObjectItem(u, "completion_tokens")->valueint, 32);
    for (int i = 0; i < n; i++)
        cJSON_Delete(ev[i]);
    tu_http_free(&h);
    free(esc);
    free(want);
}

/* A stop string ends the text before it (finish_reason stop); logprobs have one entry per token,
 * the greedy token being the most likely. */
static void test_stop_and_logprobs(void **state) {
    (void)state;
    struct tu_http h = post(&srv, "/v1/completions",
                            "{\"prompt\": \"def fibonacci(n):\\n\", \"max_tokens\": 64, "
                            "\"temperature\": 0, \"stop\": [\"\\n\\n\", \"return\"]}");
    assert_int_equal(h.status, 200);
    cJSON *root = tu_http_json(&h);
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
    assert_string_equal(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "stop");
    const char *text = cJSON_GetObjectItem(c, "text")->valuestring;
    assert_null(strstr(text, "return"));
    assert_null(strstr(text, "\n\n"));
    cJSON_Delete(root);
    tu_http_free(&h);

    h = post(&srv, "/v1/completions",
             "{\"prompt\": \"class Stack:\\n\", \"max_tokens\": 8, \"temperature\": 0, "
             "\"logprobs\": 3, \"ignore_eos\": true}");
    assert_int_equal(h.status, 200);
    root = tu_http_json(&h);
    c = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
    const cJSON *lp = cJSON_GetObjectItem(c, "logprobs");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "tokens")), 8);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "text_offset")), 8);
    for (int i = 0; i < 8; i++) {
        double l = cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "token_logprobs"), i)->valuedouble;
        const cJSON *top = cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "top_logprobs"), i);
        assert_true(l <= 0);
        assert_true(cJSON_GetArraySize(top) >= 1 && cJSON_GetArraySize(top) <= 3);
        const cJSON *t = NULL;
        cJSON_ArrayForEach(t, top) assert_true(t->valuedouble <= l + 1e-6); /* greedy: the max */
        const char *tok = cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "tokens"), i)->valuestring;
        assert_non_null(cJSON_GetObjectItem(top, tok));
    }
    cJSON_Delete(root);
    tu_http_free(&h);
}

/* logit_bias and the penalties through the server: +100 on one token makes a sampled
 * continuation that token over and over; a frequency penalty changes a greedy continuation that
 * repeats itself, and the same request twice gives the same text. */
static void test_logit_bias_and_penalties(void **state) {
    (void)state;
    struct tu_http h = post(&srv, "/v1/completions",
                            "{\"prompt\": \"def f(x):\\n\", \"max_tokens\": 4, \"temperature\": "
                            "0.9, \"seed\": 5, \"ignore_eos\": true, \"logit_bias\": {\"300\": "
                            "100}}");
    assert_int_equal(h.status, 200);
    cJSON *root = tu_http_json(&h);
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
    const char *text = cJSON_GetObjectItem(c, "text")->valuestring;
    size_t len = strlen(text);
    assert_true(len > 0 && len % 4 == 0);
    for (size_t i = len / 4; i < len; i++)
        assert_int_equal(text[i], text[i % (len / 4)]);
    cJSON_Delete(root);
    tu_http_free(&h);

    const char *body = "{\"prompt\": \"# a\\n# a\\n# a\\n\", \"max_tokens\": 24, \"temperature\": "
                       "0, \"ignore_eos\": true%s}";
    char with[256], without[256];
    snprintf(without, sizeof(without), body, "");
    snprintf(with, sizeof(with), body, ", \"frequency_penalty\": 2, \"presence_penalty\": 1");
    char *texts[3];
    const char *bodies[3] = {without, with, with};
    for (int i = 0; i < 3; i++) {
        h = post(&srv, "/v1/completions", bodies[i]);
        assert_int_equal(h.status, 200);
        root = tu_http_json(&h);
        c = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
        texts[i] = strdup(cJSON_GetObjectItem(c, "text")->valuestring);
        cJSON_Delete(root);
        tu_http_free(&h);
    }
    assert_string_not_equal(texts[0], texts[1]);
    assert_string_equal(texts[1], texts[2]);
    for (int i = 0; i < 3; i++)
        free(texts[i]);
}

/* response_format: JSON schema outputs on pycoder, sampled at temperature 1 over 10 seeds for
 * each route (and json_object mode), parse and hold what the schema asks, also with a budget of
 * 30 tokens (finish_reason "length", still closed); an unsupported schema is a 400 naming the
 * field. */
static void test_response_format(void **state) {
    (void)state;
    static const char schema[] =
        "{\"type\": \"json_schema\", \"json_schema\": {\"name\": \"p\", \"strict\": true, "
        "\"schema\": {\"type\": \"object\", \"properties\": {\"name\": {\"type\": "
        "\"string\", \"maxLength\": 12}, \"n\": {\"type\": \"integer\"}, \"kind\": {\"enum\": "
        "[\"a\", \"b\"]}}, \"required\": [\"name\", \"n\", \"kind\"], "
        "\"additionalProperties\": false}}}";
    for (int route = 0; route < 2; route++)
        for (int seed = 0; seed < 10; seed++) {
            char body[2048];
            const int budget = seed % 2 == 0 ? 30 : 200;
            const char *rf = seed == 9 ? "{\"type\": \"json_object\"}" : schema;
            if (route == 0)
                snprintf(body, sizeof(body),
                         "{\"prompt\": \"def f(x):\\n\", \"max_tokens\": %d, \"temperature\": 1, "
                         "\"seed\": %d, \"response_format\": %s}",
                         budget, seed, rf);
            else
                snprintf(body, sizeof(body),
                         "{\"messages\": [{\"role\": \"user\", \"content\": \"A person\"}], "
                         "\"max_tokens\": %d, \"temperature\": 1, \"seed\": %d, "
                         "\"response_format\": %s}",
                         budget, seed, rf);
            struct tu_http h = post(&srv, route == 0 ? "/v1/completions" : "/v1/chat/completions",
                                    body);
            assert_int_equal(h.status, 200);
            cJSON *root = tu_http_json(&h);
            const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
            const cJSON *t = route == 0 ? cJSON_GetObjectItem(c, "text")
                                        : cJSON_GetObjectItem(cJSON_GetObjectItem(c, "message"),
                                                              "content");
            assert_true(cJSON_IsString(t));
            cJSON *o = cJSON_Parse(t->valuestring);
            if (!cJSON_IsObject(o) ||
                (seed != 9 && (!cJSON_IsString(cJSON_GetObjectItem(o, "name")) ||
                               !cJSON_IsNumber(cJSON_GetObjectItem(o, "n")) ||
                               !cJSON_IsString(cJSON_GetObjectItem(o, "kind")))))
                fail_msg("route %d seed %d: '%s' does not hold the schema's fields", route, seed,
                         t->valuestring);
            cJSON_Delete(o);
            cJSON_Delete(root);
            tu_http_free(&h);
        }
    struct tu_http h = post(&srv, "/v1/completions",
                            "{\"prompt\": \"x\", \"response_format\": {\"type\": \"json_schema\", "
                            "\"json_schema\": {\"name\": \"p\", \"schema\": {\"type\": \"string\", "
                            "\"pattern\": \"a+\"}}}}");
    assert_int_equal(h.status, 400);
    assert_non_null(strstr(h.body, "\"param\":\"response_format\""));
    assert_non_null(strstr(h.body, "'pattern' is not supported"));
    tu_http_free(&h);
    h = post(&srv, "/v1/completions",
             "{\"prompt\": \"x\", \"response_format\": {\"type\": \"yaml\"}}");
    assert_int_equal(h.status, 400);
    assert_non_null(strstr(h.body, "json_schema"));
    tu_http_free(&h);
}

/* tools: a required call (and one named) comes back as tool_calls whose arguments hold what the
 * function's schema asks, the same streamed (reassembled from the deltas) as answered whole; a
 * conversation that carries an assistant's call and the tool's result goes on. */
static void test_tools(void **state) {
    (void)state;
    static const char tools[] =
        "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
        "\"description\": \"The weather of a city\", \"parameters\": {\"type\": \"object\", "
        "\"properties\": {\"city\": {\"type\": \"string\", \"maxLength\": 16}, \"unit\": "
        "{\"enum\": [\"c\", \"f\"]}}, \"required\": [\"city\", \"unit\"], "
        "\"additionalProperties\": false}}}, {\"type\": \"function\", \"function\": {\"name\": "
        "\"now\"}}]";
    for (int seed = 0; seed < 6; seed++) {
        char body[2048], args[2][512];
        const char *choice = seed % 2 ? "{\"type\": \"function\", \"function\": {\"name\": "
                                        "\"get_weather\"}}"
                                      : "\"required\"";
        for (int stream = 0; stream < 2; stream++) {
            snprintf(body, sizeof(body),
                     "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather in Paris?\"}], "
                     "%s, \"tool_choice\": %s, \"temperature\": 1, \"seed\": %d, \"max_tokens\": "
                     "%d, \"stream\": %s}",
                     tools, choice, seed, seed < 3 ? 120 : 60, stream ? "true" : "false");
            struct tu_http h = post(&srv, "/v1/chat/completions", body);
            assert_int_equal(h.status, 200);
            const cJSON *calls = NULL, *finish = NULL;
            cJSON *root = NULL, *fin = NULL;
            if (!stream) {
                root = tu_http_json(&h);
                const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
                calls = cJSON_GetObjectItem(cJSON_GetObjectItem(c, "message"), "tool_calls");
                finish = cJSON_GetObjectItem(c, "finish_reason");
            } else { /* the chunk with tool_calls, and the finish reason after it */
                for (char *line = strstr(h.body, "data: {"); line != NULL;
                     line = strstr(line + 1, "data: {")) {
                    cJSON *chunk = cJSON_Parse(line + 6);
                    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(chunk, "choices"), 0);
                    const cJSON *tc = cJSON_GetObjectItem(cJSON_GetObjectItem(c, "delta"),
                                                          "tool_calls");
                    const cJSON *fr = cJSON_GetObjectItem(c, "finish_reason");
                    if (tc != NULL && root == NULL) {
                        root = chunk, calls = tc;
                    } else if (cJSON_IsString(fr) && fin == NULL) {
                        fin = chunk, finish = fr;
                    } else {
                        cJSON_Delete(chunk);
                    }
                }
            }
            if (!cJSON_IsArray(calls) || cJSON_GetArraySize(calls) != 1)
                fail_msg("seed %d, stream %d: no call in %s", seed, stream, h.body);
            const cJSON *f = cJSON_GetObjectItem(cJSON_GetArrayItem(calls, 0), "function");
            const char *name = cJSON_GetObjectItem(f, "name")->valuestring;
            cJSON *a = cJSON_Parse(cJSON_GetObjectItem(f, "arguments")->valuestring);
            const cJSON *unit = cJSON_GetObjectItem(a, "unit");
            /* required: either function (now's arguments: any object); named: get_weather */
            if (strcmp(name, "now") == 0 && seed % 2 == 0) {
                assert_true(cJSON_IsObject(a));
            } else if (strcmp(name, "get_weather") != 0 ||
                       !cJSON_IsString(cJSON_GetObjectItem(a, "city")) || !cJSON_IsString(unit) ||
                       strlen(unit->valuestring) != 1)
                fail_msg("seed %d: %s, arguments '%s'", seed, name,
                         cJSON_GetObjectItem(f, "arguments")->valuestring);
            snprintf(args[stream], sizeof(args[stream]), "%s",
                     cJSON_GetObjectItem(f, "arguments")->valuestring);
            assert_string_equal(finish->valuestring, "tool_calls");
            cJSON_Delete(a);
            cJSON_Delete(root);
            cJSON_Delete(fin);
            tu_http_free(&h);
        }
        assert_string_equal(args[0], args[1]); /* the same call, whole or streamed */
    }
    char body[2048];
    snprintf(body, sizeof(body),
             "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather?\"}, {\"role\": "
             "\"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"call_1\", \"type\": "
             "\"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": "
             "\"{\\\"city\\\": \\\"Paris\\\", \\\"unit\\\": \\\"c\\\"}\"}}]}, {\"role\": "
             "\"tool\", \"tool_call_id\": \"call_1\", \"content\": \"21\"}], %s, \"max_tokens\": 8, "
             "\"temperature\": 0}",
             tools);
    struct tu_http h = post(&srv, "/v1/chat/completions", body);
    assert_int_equal(h.status, 200);
    tu_http_free(&h);
}

/* tools with tool_choice auto, Llama 3's convention: an answer opening with '{' (the bias makes
 * it open so) is the call, generated under the tools' grammar from there on — a declared function
 * and arguments that hold to its schema, whatever the model would write — and an answer that
 * opens otherwise is content. */
static void test_auto_tool_calls(void **state) {
    (void)state;
    const char *args[] = {PYCODER, "--chat-template", "llama3", "--threads", "2"};
    struct tu_server s;
    tu_serve_start(&s, 5, args);
    struct tu_run t = tu_llmem("tokenize", PYCODER, "--text", "{", NULL);
    assert_int_equal(t.exit_code, 0);
    const int brace = atoi(t.out);
    tu_run_free(&t);
    static const char tools[] =
        "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
        "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": "
        "\"string\", \"maxLength\": 12}, \"unit\": {\"enum\": [\"c\", \"f\"]}}, \"required\": "
        "[\"city\", \"unit\"], \"additionalProperties\": false}}}]";
    int calls_seen = 0;
    for (int seed = 0; seed < 8; seed++) {
        char body[2048], bias[64] = "";
        if (seed < 6)
            snprintf(bias, sizeof(bias), ", \"logit_bias\": {\"%d\": 100}", brace);
        snprintf(body, sizeof(body),
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather in Oslo?\"}], "
                 "%s, \"tool_choice\": \"auto\", \"temperature\": 1, \"seed\": %d, "
                 "\"max_tokens\": 80%s}",
                 tools, seed, bias);
        struct tu_http h = post(&s, "/v1/chat/completions", body);
        assert_int_equal(h.status, 200);
        cJSON *root = tu_http_json(&h);
        const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
        const cJSON *calls = cJSON_GetObjectItem(cJSON_GetObjectItem(c, "message"), "tool_calls");
        const char *finish = cJSON_GetObjectItem(c, "finish_reason")->valuestring;
        if (seed < 6 && cJSON_GetArraySize(calls) != 1)
            fail_msg("seed %d: no call in %s", seed, h.body);
        if (cJSON_IsArray(calls)) {
            const cJSON *f = cJSON_GetObjectItem(cJSON_GetArrayItem(calls, 0), "function");
            cJSON *a = cJSON_Parse(cJSON_GetObjectItem(f, "arguments")->valuestring);
            const cJSON *unit = cJSON_GetObjectItem(a, "unit");
            if (strcmp(cJSON_GetObjectItem(f, "name")->valuestring, "get_weather") != 0 ||
                !cJSON_IsString(cJSON_GetObjectItem(a, "city")) || !cJSON_IsString(unit) ||
                (strcmp(unit->valuestring, "c") != 0 && strcmp(unit->valuestring, "f") != 0) ||
                cJSON_GetArraySize(a) != 2 || strcmp(finish, "tool_calls") != 0)
                fail_msg("seed %d: %s", seed, h.body);
            cJSON_Delete(a);
            calls_seen++;
        }
        cJSON_Delete(root);
        tu_http_free(&h);
    }
    assert_true(calls_seen >= 6);
    assert_int_equal(tu_serve_stop(&s), 0);
}

/* ---- chat ------------------------------------------------------------------------------------ */

static const char chat_body[] =
    "{\"model\": \"pycoder\", \"messages\": [{\"role\": \"system\", \"content\": \"You write "
    "Python.\"}, {\"role\": \"user\", \"content\": \"def add(a, b):\"}], \"max_tokens\": 24, "
    "\"temperature\": 0, \"ignore_eos\": true%s}";

/* Chat renders ChatML and continues it exactly as `llmem run` continues the rendered text;
 * streaming gives the role first, then the same content. */
static void test_chat(void **state) {
    (void)state;
    char *want = run_text("<|im_start|>system\nYou write Python.<|im_end|>\n"
                          "<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n",
                          24);
    char body[2048];
    snprintf(body, sizeof(body), chat_body, "");
    struct tu_http h = post(&srv, "/v1/chat/completions", body);
    assert_int_equal(h.status, 200);
    cJSON *root = tu_http_json(&h);
    assert_string_equal(cJSON_GetObjectItem(root, "object")->valuestring, "chat.completion");
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
    const cJSON *m = cJSON_GetObjectItem(c, "message");
    assert_string_equal(cJSON_GetObjectItem(m, "role")->valuestring, "assistant");
    assert_string_equal(cJSON_GetObjectItem(m, "content")->valuestring, want);
    assert_int_equal(
        cJSON_GetObjectItem(cJSON_GetObjectItem(root, "usage"), "completion_tokens")->valueint, 24);
    cJSON_Delete(root);
    tu_http_free(&h);

    snprintf(body, sizeof(body), chat_body,
             ", \"stream\": true, \"logprobs\": true, \"top_logprobs\": 2");
    h = post(&srv, "/v1/chat/completions", body);
    assert_int_equal(h.status, 200);
    cJSON *ev[128];
    int n = tu_sse_events(h.body, ev, 128);
    const cJSON *d0 =
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(ev[0], "choices"), 0), "delta");
    assert_string_equal(cJSON_GetObjectItem(d0, "role")->valuestring, "assistant");
    char text[4096] = "";
    int tokens = 0;
    for (int i = 0; i < n; i++) {
        assert_string_equal(cJSON_GetObjectItem(ev[i], "object")->valuestring,
                            "chat.completion.chunk");
        const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(ev[i], "choices"), 0);
        const cJSON *content = cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "delta"), "content");
        if (cJSON_IsString(content))
            strcat(text, content->valuestring);
        const cJSON *lp = cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "logprobs"), "content");
        const cJSON *t = NULL;
        cJSON_ArrayForEach(t, lp) {
            tokens++;
            assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(t, "top_logprobs")), 2);
        }
        if (i == n - 1)
            assert_string_equal(cJSON_GetObjectItem(ch, "finish_reason")->valuestring, "length");
    }
    assert_string_equal(text, want);
    assert_int_equal(tokens, 24);
    for (int i = 0; i < n; i++)
        cJSON_Delete(ev[i]);
    tu_http_free(&h);
    free(want);
}

/* ---- many clients ---------------------------------------------------------------------------- */

/* 16 clients at once (one curl, 16 parallel transfers) get what each got alone. */
static void test_concurrent_equal_single(void **state) {
    (void)state;
    enum { N = 16 };
    char *alone[N];
    char *dir = tu_mkdtemp();
    const char *args[8 * N + 8];
    char bodies[N][256], outs[N][512], url[256];
    url_of(&srv, "/v1/completions", url, sizeof(url));
    int k = 0;
    args[k++] = "-sS";
    args[k++] = "-Z";
    args[k++] = "--parallel-max";
    args[k++] = "16";
    for (int i = 0; i < N; i++) {
        char prompt[64];
        snprintf(prompt, sizeof(prompt), "\"def task_%d(items):\\n\"", i);
        alone[i] = complete(&srv, prompt, 48);
        snprintf(bodies[i], sizeof(bodies[i]),
                 "{\"prompt\": %s, \"max_tokens\": 48, \"temperature\": 0, \"ignore_eos\": true%s}",
                 prompt, i % 2 ? ", \"stream\": true" : "");
        snprintf(outs[i], sizeof(outs[i]), "%s/%d.out", dir, i);
        if (i > 0)
            args[k++] = "--next";
        args[k++] = "-H";
        args[k++] = "Content-Type: application/json";
        args[k++] = "-d";
        args[k++] = bodies[i];
        args[k++] = "-o";
        args[k++] = outs[i];
        args[k++] = url;
    }
    double before = tu_metric(&srv, "llmem_scheduler_steps_total");
    struct tu_run r = tu_exec("curl", NULL, k, args);
    assert_int_equal(r.exit_code, 0);
    tu_run_free(&r);
    for (int i = 0; i < N; i++) {
        FILE *f = fopen(outs[i], "rb");
        assert_non_null(f);
        static char buf[1 << 16];
        size_t len = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[len] = '\0';
        char text[4096] = "";
        if (i % 2) {
            cJSON *ev[128];
            int n = tu_sse_events(buf, ev, 128);
            for (int e = 0; e < n; e++) {
                const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(ev[e], "choices"), 0);
                strcat(text, cJSON_GetObjectItem(c, "text")->valuestring);
                cJSON_Delete(ev[e]);
            }
        } else {
            cJSON *root = cJSON_Parse(buf);
            assert_non_null(root);
            const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
            snprintf(text, sizeof(text), "%s", cJSON_GetObjectItem(c, "text")->valuestring);
            cJSON_Delete(root);
        }
        assert_string_equal(text, alone[i]);
        free(alone[i]);
    }
    /* they ran batched: far fewer steps than 16 requests × 48 tokens one by one */
    assert_true(tu_metric(&srv, "llmem_scheduler_steps_total") - before < N * 48);
    tu_rmtree(dir);
    free(dir);
}

/* A client that closes its socket mid-stream cancels its request: the scheduler frees its KV
 * (the only blocks left in use are the bank's) and counts a cancelled request. */
static void test_disconnect_frees_kv(void **state) {
    (void)state;
    double cancelled = tu_metric(&srv, "llmem_requests_total{outcome=\"cancelled\"}");
    int fd = tu_http_connect(srv.url, 120);
    assert_true(fd >= 0);
    const char body[] = "{\"prompt\": \"def main():\\n\", \"max_tokens\": 1900, \"temperature\": "
                        "0, \"ignore_eos\": true, \"stream\": true}";
    char req[1024];
    int len = snprintf(req, sizeof(req),
                       "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                       "application/json\r\nContent-Length: %zu\r\n\r\n%s",
                       strlen(body), body);
    assert_int_equal(write(fd, req, (size_t)len), len);
    /* read until the first token's chunk has arrived */
    char buf[8192];
    size_t got = 0;
    while (got < sizeof(buf) - 1) {
        ssize_t n = read(fd, buf + got, sizeof(buf) - 1 - got);
        assert_true(n > 0);
        got += (size_t)n;
        buf[got] = '\0';
        if (strstr(buf, "data: {") != NULL)
            break;
    }
    assert_non_null(strstr(buf, "200 OK"));
    close(fd);
    /* the scheduler notices at its next step; wait for it (no time is asserted) */
    tu_wait_idle(&srv);
    assert_true(tu_metric(&srv, "llmem_requests_total{outcome=\"cancelled\"}") >= cancelled + 1);
    assert_true(tu_metric(&srv, "llmem_client_disconnects_total") >= 1);
    assert_true(tu_metric(&srv, "llmem_generation_tokens_total") > 0);
    assert_int_equal(tu_metric(&srv, "llmem_kv_blocks_used"), tu_metric(&srv, "llmem_bank_blocks"));
}

/* A client that closes its socket while its non-streaming answer is being generated cancels the
 * request as a streaming one does: it is counted cancelled and a disconnect, and generation stops
 * long before max_tokens (the bound is the whole request; no time is asserted). */
static void test_disconnect_plain_cancels(void **state) {
    (void)state;
    enum { MAX_TOKENS = 1900 };
    double cancelled = tu_metric(&srv, "llmem_requests_total{outcome=\"cancelled\"}");
    double ok = tu_metric(&srv, "llmem_requests_total{outcome=\"ok\"}");
    double gone = tu_metric(&srv, "llmem_client_disconnects_total");
    double generated = tu_metric(&srv, "llmem_generation_tokens_total");
    int fd = tu_http_connect(srv.url, 120);
    assert_true(fd >= 0);
    char body[256], req[1024];
    snprintf(body, sizeof(body),
             "{\"prompt\": \"def main():\\n\", \"max_tokens\": %d, \"temperature\": 0, "
             "\"ignore_eos\": true, \"stream\": false}",
             MAX_TOKENS);
    int len = snprintf(req, sizeof(req),
                       "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                       "application/json\r\nContent-Length: %zu\r\n\r\n%s",
                       strlen(body), body);
    assert_int_equal(write(fd, req, (size_t)len), len);
    /* close once the request is generating */
    for (int i = 0; i < 600 && tu_metric(&srv, "llmem_generation_tokens_total") == generated; i++)
        usleep(5 * 1000);
    close(fd);
    tu_wait_idle(&srv);
    double n = tu_metric(&srv, "llmem_generation_tokens_total") - generated;
    print_message("  generated %.0f of %d tokens before the cancel\n", n, MAX_TOKENS);
    assert_true(tu_metric(&srv, "llmem_requests_total{outcome=\"cancelled\"}") == cancelled + 1);
    assert_true(tu_metric(&srv, "llmem_requests_total{outcome=\"ok\"}") == ok);
    assert_true(tu_metric(&srv, "llmem_client_disconnects_total") == gone + 1);
    assert_true(n > 0 && n < MAX_TOKENS);
    assert_int_equal(tu_metric(&srv, "llmem_kv_blocks_used"), tu_metric(&srv, "llmem_bank_blocks"));
}

/* Requests that share a long system prompt take its blocks from the session bank. */
static void test_shared_prefix_bank_hits(void **state) {
    (void)state;
    char system[8192] = "You are a careful Python reviewer. ";
    for (int i = 0; i < 40; i++)
        snprintf(system + strlen(system), sizeof(system) - strlen(system),
                 "Rule %d: keep function %d short and name it well. ", i, i);
    double hits = tu_metric(&srv, "llmem_bank_hits_total");
    double reused = tu_metric(&srv, "llmem_prompt_tokens_reused_total");
    for (int i = 0; i < 4; i++) {
        char body[16384];
        snprintf(body, sizeof(body),
                 "{\"messages\": [{\"role\": \"system\", \"content\": \"%s\"}, {\"role\": "
                 "\"user\", \"content\": \"def check_%d(x):\"}], \"max_tokens\": 8, "
                 "\"temperature\": 0}",
                 system, i);
        struct tu_http h = post(&srv, "/v1/chat/completions", body);
        assert_int_equal(h.status, 200);
        tu_http_free(&h);
    }
    double new_hits = tu_metric(&srv, "llmem_bank_hits_total") - hits;
    printf("  shared system prompt: %.0f bank blocks hit, %.0f prompt tokens reused\n", new_hits,
           tu_metric(&srv, "llmem_prompt_tokens_reused_total") - reused);
    assert_true(new_hits >= 3 * 16); /* three requests after the first reuse ≥ 16 blocks each */
    assert_true(tu_metric(&srv, "llmem_prompt_tokens_reused_total") - reused >= 3 * 256);
}

/* n: 4 choices of a long prompt, sampled with a seed: four answers (indexed, each with its
 * finish reason, usage counting the prompt once and every choice's tokens), the same again for
 * the same seed, and the prompt prefilled once — the other three take all but its last partial
 * block from the session bank. */
static void test_n_choices(void **state) {
    (void)state;
    char prompt[4096] = "# utilities\n";
    for (int i = 0; i < 30; i++)
        snprintf(prompt + strlen(prompt), sizeof(prompt) - strlen(prompt),
                 "def helper_%d(x):\n    return x + %d\n", i, i);
    char body[8192];
    snprintf(body, sizeof(body),
             "{\"prompt\": \"%s\", \"n\": 4, \"max_tokens\": 8, \"temperature\": 1, "
             "\"seed\": 11, \"ignore_eos\": true}",
             prompt);
    char *texts[2][4];
    for (int round = 0; round < 2; round++) {
        double reused = tu_metric(&srv, "llmem_prompt_tokens_reused_total");
        double prompted = tu_metric(&srv, "llmem_prompt_tokens_total");
        struct tu_http h = post(&srv, "/v1/completions", body);
        assert_int_equal(h.status, 200);
        cJSON *root = tu_http_json(&h);
        const cJSON *choices = cJSON_GetObjectItem(root, "choices");
        assert_int_equal(cJSON_GetArraySize(choices), 4);
        const cJSON *usage = cJSON_GetObjectItem(root, "usage");
        const int64_t p = (int64_t)cJSON_GetObjectItem(usage, "prompt_tokens")->valuedouble;
        assert_int_equal((int64_t)cJSON_GetObjectItem(usage, "completion_tokens")->valuedouble,
                         32);
        for (int i = 0; i < 4; i++) {
            const cJSON *c = cJSON_GetArrayItem(choices, i);
            assert_int_equal(cJSON_GetObjectItem(c, "index")->valueint, i);
            assert_string_equal(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "length");
            texts[round][i] = strdup(cJSON_GetObjectItem(c, "text")->valuestring);
        }
        tu_wait_idle(&srv);
        const double got = tu_metric(&srv, "llmem_prompt_tokens_reused_total") - reused;
        printf("  n 4, round %d: %lld prompt tokens, %.0f of the 4 × %lld reused\n", round,
               (long long)p, got, (long long)p);
        assert_true(tu_metric(&srv, "llmem_prompt_tokens_total") - prompted == 4.0 * (double)p);
        if (round == 0) /* the three followers take all but the last partial block */
            assert_true(got >= 3.0 * (double)(p - 16));
        cJSON_Delete(root);
        tu_http_free(&h);
    }
    int distinct = 0;
    for (int i = 0; i < 4; i++) {
        assert_string_equal(texts[0][i], texts[1][i]); /* the same seed, the same choices */
        distinct += i > 0 && strcmp(texts[0][i], texts[0][0]) != 0;
    }
    assert_true(distinct > 0); /* each choice its own draws */
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 4; i++)
            free(texts[r][i]);
}

/* ---- the other routes ------------------------------------------------------------------------ */

static void test_models_health_metrics(void **state) {
    (void)state;
    struct tu_http h = get(&srv, "/v1/models");
    assert_int_equal(h.status, 200);
    cJSON *root = tu_http_json(&h);
    const cJSON *m = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "data"), 0);
    assert_string_equal(cJSON_GetObjectItem(m, "id")->valuestring, "pycoder");
    assert_string_equal(cJSON_GetObjectItem(m, "object")->valuestring, "model");
    cJSON_Delete(root);
    tu_http_free(&h);
    h = get(&srv, "/v1/models/pycoder");
    assert_int_equal(h.status, 200);
    tu_http_free(&h);
    h = get(&srv, "/v1/models/gpt-4");
    assert_int_equal(h.status, 404);
    tu_http_free(&h);

    h = get(&srv, "/health");
    assert_int_equal(h.status, 200);
    root = tu_http_json(&h);
    assert_string_equal(cJSON_GetObjectItem(root, "status")->valuestring, "ok");
    const cJSON *plan = cJSON_GetObjectItem(root, "plan");
    const cJSON *lim = cJSON_GetObjectItem(root, "limits");
    assert_int_equal(cJSON_GetObjectItem(plan, "max_sequences")->valueint, 16);
    assert_true(cJSON_GetObjectItem(lim, "allocation_limit_bytes")->valuedouble ==
                cJSON_GetObjectItem(plan, "allocation_limit_bytes")->valuedouble);
    /* the allocator's limit is the process's less the runtime baseline (measured, > 0) */
    assert_true(cJSON_GetObjectItem(lim, "runtime_baseline_bytes")->valuedouble > 1e6);
    assert_true(cJSON_GetObjectItem(lim, "memory_limit_bytes")->valuedouble +
                    cJSON_GetObjectItem(lim, "runtime_baseline_bytes")->valuedouble ==
                cJSON_GetObjectItem(lim, "allocation_limit_bytes")->valuedouble);
    assert_true(cJSON_GetObjectItem(lim, "trip_bytes")->valuedouble >
                cJSON_GetObjectItem(lim, "allocation_limit_bytes")->valuedouble);
    const cJSON *mem = cJSON_GetObjectItem(root, "memory");
    assert_true(cJSON_GetObjectItem(mem, "resident_peak_bytes")->valuedouble >=
                cJSON_GetObjectItem(mem, "resident_bytes")->valuedouble);
    assert_true(cJSON_GetObjectItem(mem, "resident_bytes")->valuedouble > 1e6);
    assert_true(cJSON_GetObjectItem(mem, "peak_bytes")->valuedouble <=
                cJSON_GetObjectItem(mem, "limit_bytes")->valuedouble);
    assert_true(cJSON_GetObjectItem(mem, "active_bytes")->valuedouble > 11e6); /* weights */
    assert_non_null(cJSON_GetObjectItem(mem, "cache_bytes"));
    const cJSON *kv = cJSON_GetObjectItem(root, "kv");
    assert_string_equal(cJSON_GetObjectItem(kv, "format")->valuestring, "f16");
    assert_string_equal(cJSON_GetObjectItem(kv, "layout")->valuestring, "paged");
    assert_int_equal(cJSON_GetObjectItem(kv, "blocks_used")->valueint +
                         cJSON_GetObjectItem(kv, "blocks_free")->valueint,
                     16 * 2048 / 16);
    assert_non_null(cJSON_GetObjectItem(cJSON_GetObjectItem(root, "bank"), "bytes"));
    assert_string_equal(
        cJSON_GetObjectItem(cJSON_GetObjectItem(root, "guard"), "state")->valuestring, "clear");
    assert_string_equal(cJSON_GetObjectItem(root, "chat_template")->valuestring, "chatml");
    cJSON_Delete(root);
    tu_http_free(&h);

    h = get(&srv, "/metrics");
    assert_int_equal(h.status, 200);
    assert_non_null(strstr(h.headers, "text/plain; version=0.0.4"));
    static const char *const names[] = {"llmem_mem_active_bytes ",
                                        "llmem_mem_peak_bytes ",
                                        "llmem_mem_cache_bytes ",
                                        "llmem_mem_limit_bytes ",
                                        "llmem_kv_blocks_used ",
                                        "llmem_kv_blocks_free ",
                                        "llmem_bank_bytes ",
                                        "llmem_bank_hits_total ",
                                        "llmem_guard_actions_total{level=\"warning\"} ",
                                        "llmem_guard_actions_total{level=\"critical\"} ",
                                        "llmem_requests_total{outcome=\"ok\"} ",
                                        "llmem_prompt_tokens_total ",
                                        "llmem_generation_tokens_total ",
                                        "llmem_requests_running ",
                                        "llmem_requests_waiting ",
                                        "llmem_preemptions_total ",
                                        "# TYPE llmem_ttft_seconds histogram",
                                        "llmem_ttft_seconds_bucket{le=\"+Inf\"} ",
                                        "llmem_ttft_seconds_sum ",
                                        "llmem_ttft_seconds_count ",
                                        "# TYPE llmem_inter_token_seconds histogram",
                                        "llmem_inter_token_seconds_bucket{le=\"0.005\"} "};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (strstr(h.body, names[i]) == NULL)
            fail_msg("/metrics lacks '%s':\n%s", names[i], h.body);
    /* every sample line is "llmem_… value" */
    for (const char *p = h.body; *p; p = strchr(p, '\n') + 1) {
        if (*p != '#')
            assert_true(strncmp(p, "llmem_", 6) == 0);
        assert_non_null(strchr(p, '\n'));
    }
    tu_http_free(&h);
    assert_true(tu_metric(&srv, "llmem_mem_peak_bytes") <=
                tu_metric(&srv, "llmem_mem_limit_bytes"));
    assert_true(tu_metric(&srv, "llmem_ttft_seconds_count") >= 1);
}

/* POST /admin/cache/clear empties the bank: no KV block stays in use. */
static void test_cache_clear(void **state) {
    (void)state;
    struct tu_http h = post(&srv, "/v1/completions",
                            "{\"prompt\": \"def fibonacci(n):\\n\", \"max_tokens\": 40, "
                            "\"temperature\": 0, \"ignore_eos\": true}");
    assert_int_equal(h.status, 200);
    tu_http_free(&h);
    assert_true(tu_metric(&srv, "llmem_bank_blocks") > 0);
    h = post(&srv, "/admin/cache/clear", NULL);
    assert_int_equal(h.status, 200);
    cJSON *root = tu_http_json(&h);
    assert_true(cJSON_GetObjectItem(root, "released_bytes")->valuedouble > 0);
    cJSON_Delete(root);
    tu_http_free(&h);
    assert_int_equal(tu_metric(&srv, "llmem_bank_blocks"), 0);
    assert_int_equal(tu_metric(&srv, "llmem_kv_blocks_used"), 0);
}

/* ---- bad requests ---------------------------------------------------------------------------- */

static void expect_error(const char *path, const char *body, long len, int status,
                         const char *param, const char *code) {
    char url[256];
    url_of(&srv, path, url, sizeof(url));
    struct tu_http h = tu_http_argv("POST", url, body, len, 0, NULL);
    if (h.status != status)
        fail_msg("%s %.200s: HTTP %d, expected %d: %s", path, body, h.status, status, h.body);
    cJSON *root = tu_http_json(&h);
    const cJSON *e = cJSON_GetObjectItem(root, "error");
    assert_non_null(e);
    assert_true(cJSON_IsString(cJSON_GetObjectItem(e, "message")));
    assert_true(strlen(cJSON_GetObjectItem(e, "message")->valuestring) > 10);
    assert_true(cJSON_IsString(cJSON_GetObjectItem(e, "type")));
    const cJSON *p = cJSON_GetObjectItem(e, "param"), *c = cJSON_GetObjectItem(e, "code");
    if (param != NULL)
        assert_string_equal(p->valuestring, param);
    else
        assert_true(cJSON_IsNull(p) || cJSON_IsString(p));
    if (code != NULL)
        assert_string_equal(c->valuestring, code);
    cJSON_Delete(root);
    tu_http_free(&h);
}

static void test_bad_requests(void **state) {
    (void)state;
    double invalid = tu_metric(&srv, "llmem_requests_total{outcome=\"invalid\"}");
    const char *C = "/v1/completions", *CH = "/v1/chat/completions";
    expect_error(C, "{\"prompt\": \"x\",", -1, 400, NULL, "invalid_json");
    expect_error(C, "not json", -1, 400, NULL, "invalid_json");
    expect_error(C, "[1, 2]", -1, 400, NULL, "invalid_json");
    expect_error(C, "", -1, 400, NULL, "invalid_json");
    expect_error(C, "{\"prompt\": \"a\xff\xfe\"}", -1, 400, NULL, "invalid_encoding");
    expect_error(C, "{\"prompt\": \"\xed\xa0\x80\"}", -1, 400, NULL, "invalid_encoding");
    expect_error(C, "{\"prompt\": \"x\", \"max_tokens\": -5}", -1, 400, "max_tokens", NULL);
    expect_error(C, "{\"prompt\": \"x\", \"max_tokens\": 0}", -1, 400, "max_tokens", NULL);
    expect_error(C, "{\"prompt\": \"x\", \"max_tokens\": 1e15}", -1, 400, "max_tokens", NULL);
    expect_error(C, "{\"prompt\": \"x\", \"max_tokens\": \"10\"}", -1, 400, "max_tokens",
                 "invalid_type");
    expect_error(C, "{\"prompt\": \"x\", \"max_tokens\": 2.5}", -1, 400, "max_tokens", NULL);
    expect_error(C, "{\"prompt\": \"x\", \"temperature\": \"hot\"}", -1, 400, "temperature",
                 "invalid_type");
    expect_error(C, "{\"prompt\": \"x\", \"temperature\": -1}", -1, 400, "temperature", NULL);
    expect_error(C, "{\"prompt\": \"x\", \"temperature\": 1e308}", -1, 400, "temperature", NULL);
    expect_error(C, "{\"prompt\": \"x\", \"top_p\": 0}", -1, 400, "top_p", NULL);
    expect_error(C, "{\"prompt\": \"x\", \"top_k\": -7}", -1, 400, "top_k", NULL);
    expect_error(C, "{\"prompt\": \"x\", \"min_p\": 2}", -1, 400, "min_p", NULL);
    expect_error(C, "{\"prompt\": \"x\", \"seed\": \"s\"}", -1, 400, "seed", "invalid_type");
    expect_error(C, "{\"prompt\": \"x\", \"stream\": \"yes\"}", -1, 400, "stream", "invalid_type");
    expect_error(C, "{\"prompt\": \"x\", \"stop\": 3}", -1, 400, "stop", "invalid_type");
    expect_error(C, "{\"prompt\": \"x\", \"stop\": [\"a\", 1]}", -1, 400, "stop", NULL);
    expect_error(C, "{\"prompt\": \"x\", \"n\": 17}", -1, 400, "n", NULL);
    expect_error(C, "{\"prompt\": \"x\", \"logprobs\": 99}", -1, 400, "logprobs", NULL);
    expect_error(C, "{\"prompt\": \"x\", \"echo\": true}", -1, 400, "echo", NULL);
    expect_error(C, "{\"prompt\": \"x\", \"stream_options\": {\"include_usage\": true}}", -1, 400,
                 "stream_options", NULL);
    expect_error(C, "{\"prompt\": 42}", -1, 400, "prompt", "invalid_type");
    expect_error(C, "{\"prompt\": []}", -1, 400, "prompt", NULL);
    expect_error(C, "{\"prompt\": [1, -2]}", -1, 400, "prompt", NULL);
    expect_error(C, "{\"prompt\": [1, 99999]}", -1, 400, "prompt", NULL);
    expect_error(C, "{\"prompt\": [\"a\", \"b\"]}", -1, 400, "prompt", NULL);
    expect_error(C, "{\"max_tokens\": 3}", -1, 400, "prompt", "missing_required_parameter");
    expect_error(C, "{\"prompt\": \"\"}", -1, 400, "prompt", NULL);
    expect_error(C, "{\"prompt\": \"x\", \"model\": \"gpt-4\"}", -1, 404, "model",
                 "model_not_found");
    expect_error(C, "{\"prompt\": \"x\", \"model\": 7}", -1, 400, "model", "invalid_type");
    /* a prompt longer than the context window */
    static char big[40000];
    strcpy(big, "{\"prompt\": [");
    for (int i = 0; i < 2100; i++)
        strcat(big, i ? ",42" : "42");
    strcat(big, "]}");
    expect_error(C, big, -1, 400, "prompt", "context_length_exceeded");
    /* chat */
    expect_error(CH, "{\"messages\": \"hi\"}", -1, 400, "messages", "invalid_type");
    expect_error(CH, "{\"messages\": []}", -1, 400, "messages", NULL);
    expect_error(CH, "{\"messages\": [{\"role\": \"wizard\", \"content\": \"x\"}]}", -1, 400,
                 "messages", NULL);
    expect_error(CH, "{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", -1, 400, "messages",
                 NULL);
    expect_error(CH,
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
                 "\"top_logprobs\": 2}",
                 -1, 400, "top_logprobs", NULL);
    expect_error(CH,
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
                 "\"max_completion_tokens\": -1}",
                 -1, 400, "max_completion_tokens", NULL);
    /* a body over the limit (4 MiB) */
    size_t huge_len = (size_t)5 << 20;
    char *huge = malloc(huge_len + 1);
    memset(huge, ' ', huge_len);
    huge[huge_len] = '\0';
    memcpy(huge, "{\"prompt\": \"", 12);
    memcpy(huge + huge_len - 2, "\"}", 2);
    expect_error(C, huge, (long)huge_len, 413, NULL, "request_too_large");
    free(huge);
    /* routes and methods */
    struct tu_http h = get(&srv, "/v1/nothing");
    assert_int_equal(h.status, 404);
    tu_http_free(&h);
    h = get(&srv, "/v1/completions");
    assert_int_equal(h.status, 405);
    assert_non_null(strstr(h.headers, "Allow: POST"));
    tu_http_free(&h);
    /* every one of them was counted, and the server serves on */
    assert_true(tu_metric(&srv, "llmem_requests_total{outcome=\"invalid\"}") - invalid >= 40);
    char *text = complete(&srv, "\"def ok():\"", 4);
    free(text);
    assert_int_equal(tu_metric(&srv, "llmem_requests_total{outcome=\"failed\"}"), 0);
}

/* ---- other servers --------------------------------------------------------------------------- */

/* --api-key: every route but /health needs the Bearer key; without --chat-template, pycoder
 * (no template of its own) refuses chat with a clear 400. */
static void test_api_key_and_no_template(void **state) {
    (void)state;
    const char *args[] = {PYCODER, "--api-key", "s3cret", "--threads", "2"};
    struct tu_server s;
    tu_serve_start(&s, 5, args);
    char url[256];
    url_of(&s, "/v1/models", url, sizeof(url));
    struct tu_http h = tu_http("GET", url, NULL);
    assert_int_equal(h.status, 401);
    assert_non_null(strstr(h.headers, "WWW-Authenticate: Bearer"));
    cJSON *root = tu_http_json(&h);
    assert_string_equal(
        cJSON_GetObjectItem(cJSON_GetObjectItem(root, "error"), "code")->valuestring,
        "invalid_api_key");
    cJSON_Delete(root);
    tu_http_free(&h);
    const char *wrong[] = {"-H", "Authorization: Bearer s3creT"};
    const char *right[] = {"-H", "Authorization: Bearer s3cret"};
    h = tu_http_argv("GET", url, NULL, 0, 2, wrong);
    assert_int_equal(h.status, 401);
    tu_http_free(&h);
    h = tu_http_argv("GET", url, NULL, 0, 2, right);
    assert_int_equal(h.status, 200);
    tu_http_free(&h);
    url_of(&s, "/metrics", url, sizeof(url));
    h = tu_http("GET", url, NULL);
    assert_int_equal(h.status, 401);
    tu_http_free(&h);
    url_of(&s, "/v1/completions", url, sizeof(url));
    h = tu_http("POST", url, "{\"prompt\": \"x\"}");
    assert_int_equal(h.status, 401);
    tu_http_free(&h);
    url_of(&s, "/health", url, sizeof(url));
    h = tu_http("GET", url, NULL);
    assert_int_equal(h.status, 200);
    tu_http_free(&h);
    url_of(&s, "/v1/chat/completions", url, sizeof(url));
    h = tu_http_argv("POST", url, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", -1,
                     2, right);
    assert_int_equal(h.status, 400);
    assert_non_null(strstr(h.body, "has no chat template"));
    assert_non_null(strstr(h.body, "--chat-template"));
    tu_http_free(&h);
    assert_int_equal(tu_serve_stop(&s), 0);

    /* a bind beyond loopback without a key is refused before the model loads */
    struct tu_run r = tu_llmem("serve", PYCODER, "--host", "0.0.0.0", "--port", "0", NULL);
    assert_int_equal(r.exit_code, 2);
    assert_non_null(strstr(r.err, "needs an API key"));
    assert_null(strstr(r.err, "engine budget")); /* nothing was planned or loaded */
    tu_run_free(&r);
}

/* --max-queue 1 with one sequence: requests beyond the running one and the one waiting get 503
 * with Retry-After; the others complete. */
static void test_queue_full(void **state) {
    (void)state;
    const char *args[] = {PYCODER, "--max-queue", "1", "--max-sequences", "1", "--threads", "2"};
    struct tu_server s;
    tu_serve_start(&s, 7, args);
    char url[256], *dir = tu_mkdtemp(), outs[6][512];
    url_of(&s, "/v1/completions", url, sizeof(url));
    const char *cargs[8 * 6 + 8];
    int k = 0;
    cargs[k++] = "-sS";
    cargs[k++] = "-Z";
    for (int i = 0; i < 6; i++) {
        snprintf(outs[i], sizeof(outs[i]), "%s/%d", dir, i);
        if (i > 0)
            cargs[k++] = "--next";
        cargs[k++] = "-i";
        cargs[k++] = "-d";
        cargs[k++] = "{\"prompt\": \"def main():\", \"max_tokens\": 600, \"temperature\": 0, "
                     "\"ignore_eos\": true}";
        cargs[k++] = "-o";
        cargs[k++] = outs[i];
        cargs[k++] = url;
    }
    struct tu_run r = tu_exec("curl", NULL, k, cargs);
    assert_int_equal(r.exit_code, 0);
    tu_run_free(&r);
    int ok = 0, busy = 0;
    for (int i = 0; i < 6; i++) {
        struct tu_run cat = tu_exec("cat", NULL, 1, (const char *[]){outs[i]});
        if (strstr(cat.out, "HTTP/1.1 200") != NULL) {
            ok++;
        } else {
            assert_non_null(strstr(cat.out, "HTTP/1.1 503"));
            assert_non_null(strstr(cat.out, "Retry-After: 1"));
            assert_non_null(strstr(cat.out, "\"queue_full\""));
            busy++;
        }
        tu_run_free(&cat);
    }
    assert_true(ok >= 2);
    assert_true(busy >= 1);
    assert_true(tu_metric(&s, "llmem_requests_total{outcome=\"rejected\"}") == busy);
    assert_int_equal(tu_serve_stop(&s), 0);
    tu_rmtree(dir);
    free(dir);
}

/* A size in the form the plan and the limits line print it ("11.8G") after `key`. */
static void size_after(const char *text, const char *key, char *out, size_t size) {
    const char *p = strstr(text, key);
    if (p == NULL)
        fail_msg("no '%s' in:\n%s", key, text);
    p += strlen(key);
    size_t n = strcspn(p, " ,");
    assert_true(n < size);
    memcpy(out, p, n);
    out[n] = '\0';
}

/* --util 0.5: serve applies, prints and reports on /health the allocation limit and the trip
 * that `llmem plan --util 0.5` computes; run and chat apply and print the same. */
static void test_util_matches_plan(void **state) {
    (void)state;
    struct tu_run plan = tu_llmem("plan", PYCODER, "--util", "0.5", "--json", NULL);
    assert_int_equal(plan.exit_code, 0);
    cJSON *pj = tu_json_stdout(&plan);
    struct tu_run human = tu_llmem("plan", PYCODER, "--util", "0.5", NULL);
    char plan_limit[32], plan_trip[32], serve_limit[32], serve_trip[32];
    size_after(human.out, "allocation limit ", plan_limit, sizeof(plan_limit));
    size_after(human.out, "< trip ", plan_trip, sizeof(plan_trip));

    const char *args[] = {PYCODER, "--util", "0.5", "--threads", "2"};
    struct tu_server s;
    tu_serve_start(&s, 5, args);
    char *err = tu_serve_stderr(&s);
    const char *line = strstr(err, "limits applied: ");
    assert_non_null(line);
    size_after(line, "memory limit ", serve_limit, sizeof(serve_limit));
    size_after(line, "trip ", serve_trip, sizeof(serve_trip));
    assert_string_equal(serve_limit, plan_limit);
    assert_string_equal(serve_trip, plan_trip);
    assert_non_null(strstr(line, "util 0.50"));
    free(err);
    /* llmem run and llmem chat apply and print the same */
    const char *run_args[] = {"run", PYCODER, "--util", "0.5", "--threads",
                              "2",   "-p",    "x",      "-n",  "1"};
    const char *chat_args[] = {"chat",      PYCODER, "--util",          "0.5",
                               "--threads", "2",     "--chat-template", "chatml"};
    struct tu_run runs[2] = {tu_llmem_argv(10, run_args), tu_llmem_input("", 8, chat_args)};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(runs[i].exit_code, 0);
        const char *applied = strstr(runs[i].err, "limits applied: ");
        assert_non_null(applied);
        char limit[32], trip[32];
        size_after(applied, "memory limit ", limit, sizeof(limit));
        size_after(applied, "trip ", trip, sizeof(trip));
        assert_string_equal(limit, plan_limit);
        assert_string_equal(trip, plan_trip);
        tu_run_free(&runs[i]);
    }

    char url[256];
    url_of(&s, "/health", url, sizeof(url));
    struct tu_http h = tu_http("GET", url, NULL);
    cJSON *health = tu_http_json(&h);
    const cJSON *lim = cJSON_GetObjectItem(health, "limits");
    assert_true(cJSON_GetObjectItem(lim, "allocation_limit_bytes")->valuedouble ==
                cJSON_GetObjectItem(pj, "allocation_limit_bytes")->valuedouble);
    assert_true(cJSON_GetObjectItem(lim, "trip_bytes")->valuedouble ==
                cJSON_GetObjectItem(pj, "trip_bytes")->valuedouble);
    assert_true(cJSON_GetObjectItem(lim, "memory_limit_bytes")->valuedouble ==
                cJSON_GetObjectItem(pj, "allocation_limit_bytes")->valuedouble -
                    cJSON_GetObjectItem(lim, "runtime_baseline_bytes")->valuedouble);
    assert_true(cJSON_GetObjectItem(lim, "util")->valuedouble == 0.5);
    cJSON_Delete(health);
    tu_http_free(&h);
    assert_int_equal(tu_serve_stop(&s), 0);
    cJSON_Delete(pj);
    tu_run_free(&plan);
    tu_run_free(&human);
}

/* A small machine (about 64M; more where the baseline is larger: tu_budget_for) whose plan holds
 * with the server's runtime baseline (its code, tokenizer, threads and, with --max-body 64K, the
 * request bodies it admits at once): the KV pool holds a few full 512-token windows. A burst of 64
 * requests of ~480 tokens each: every one completes or is refused with 507, the server never fails,
 * the allocator's peak stays within its limit, and the process's peak resident memory (VmHWM) stays
 * below the trip. */
static void test_memory_burst(void **state) {
    (void)state;
    char budget[32];
    const char *args[] = {
        PYCODER,      "--budget",  tu_budget_for(PYCODER, 16, 4, budget, sizeof(budget)),
        "--max-body", "64K",       "--context",
        "512",        "--threads", "2"};
    struct tu_server s;
    tu_serve_start(&s, 9, args);
    char url[256], *dir = tu_mkdtemp();
    url_of(&s, "/v1/completions", url, sizeof(url));
    enum { N = 64 };
    static char bodies[N][4096], outs[N][512];
    const char *cargs[8 * N + 8];
    int k = 0;
    cargs[k++] = "-sS";
    cargs[k++] = "-Z";
    cargs[k++] = "--parallel-max";
    cargs[k++] = "64";
    for (int i = 0; i < N; i++) {
        int at = snprintf(bodies[i], sizeof(bodies[i]), "{\"prompt\": \"");
        for (int l = 0; l < 20; l++)
            at += snprintf(bodies[i] + at, sizeof(bodies[i]) - (size_t)at,
                           "def f%d_%d(x):\\n    return x * %d\\n", i, l, l);
        snprintf(bodies[i] + at, sizeof(bodies[i]) - (size_t)at,
                 "\", \"max_tokens\": 200, \"temperature\": 0, \"ignore_eos\": true%s}",
                 i % 4 == 0 ? ", \"stream\": true" : "");
        snprintf(outs[i], sizeof(outs[i]), "%s/%d", dir, i);
        if (i > 0)
            cargs[k++] = "--next";
        cargs[k++] = "-d";
        cargs[k++] = bodies[i];
        cargs[k++] = "-w";
        cargs[k++] = "%{http_code}\\n";
        cargs[k++] = "-o";
        cargs[k++] = outs[i];
        cargs[k++] = url;
    }
    struct tu_run r = tu_exec("curl", NULL, k, cargs);
    assert_int_equal(r.exit_code, 0);
    int ok = 0, refused = 0;
    for (const char *p = r.out; *p; p = strchr(p, '\n') + 1) {
        int code = atoi(p);
        if (code == 200)
            ok++;
        else if (code == 507)
            refused++;
        else
            fail_msg("a request got HTTP %d", code);
    }
    tu_run_free(&r);
    assert_int_equal(ok + refused, N);
    /* a 507 carries the engine's explanation */
    for (int i = 0; i < N; i++) {
        struct tu_run cat = tu_exec("cat", NULL, 1, (const char *[]){outs[i]});
        if (strstr(cat.out, "insufficient_memory") != NULL)
            assert_non_null(strstr(cat.out, "\"type\":\"insufficient_memory\""));
        else if (i % 4 == 0)
            assert_non_null(strstr(cat.out, "data: [DONE]"));
        else
            assert_non_null(strstr(cat.out, "\"completion_tokens\":200"));
        tu_run_free(&cat);
    }
    tu_wait_idle(&s);
    printf("  64 long requests on a 64M machine: %d completed, %d refused (507), "
           "%.0f preemptions, peak %.0f of limit %.0f bytes\n",
           ok, refused, tu_metric(&s, "llmem_preemptions_total"),
           tu_metric(&s, "llmem_mem_peak_bytes"), tu_metric(&s, "llmem_mem_limit_bytes"));
    assert_true(tu_metric(&s, "llmem_mem_peak_bytes") <= tu_metric(&s, "llmem_mem_limit_bytes"));
    assert_int_equal(tu_metric(&s, "llmem_requests_total{outcome=\"failed\"}"), 0);
    struct tu_http h = get(&s, "/health");
    assert_int_equal(h.status, 200);
    cJSON *health = tu_http_json(&h);
    double rss_peak =
        cJSON_GetObjectItem(cJSON_GetObjectItem(health, "memory"), "resident_peak_bytes")
            ->valuedouble;
    const cJSON *lim = cJSON_GetObjectItem(health, "limits");
    double trip = cJSON_GetObjectItem(lim, "trip_bytes")->valuedouble;
    printf("  resident peak %.1f MiB below the trip %.1f MiB (baseline %.1f MiB)\n",
           rss_peak / 1048576, trip / 1048576,
           cJSON_GetObjectItem(lim, "runtime_baseline_bytes")->valuedouble / 1048576);
    assert_true(rss_peak > 0 && (TU_ASAN || rss_peak < trip)); /* ASan's shadow is not planned */
    cJSON_Delete(health);
    tu_http_free(&h);
    assert_int_equal(tu_serve_stop(&s), 0);
    tu_rmtree(dir);
    free(dir);
}

/* ---- the library, in this process ----------------------------------------------------------- */

static int pressure; /* 1: the fake guard source reads critical memory pressure */

static void fake_guard(void *arg, struct llmem_guard_reading *r) {
    (void)arg;
    if (__atomic_load_n(&pressure, __ATOMIC_SEQ_CST))
        r->resident_bytes = r->ceiling_bytes; /* ≥ 0.95 × the ceiling: critical */
    else
        r->resident_bytes = 0, r->psi_some = r->psi_full = 0;
}

/* llmem_server_start/stop on an engine whose guard reads fake pressure: a critical refuses new
 * requests with 507 insufficient_memory and the engine's reason, and when it clears the server
 * serves again; stopping with a stream in flight ends that stream with an error event. */
/* A connection to the server at url with the headers of a completion request of `length` body
 * bytes and the first `sent` bytes of `body` written. */
static int body_socket(const char *url, const char *body, size_t length, size_t sent) {
    int fd = tu_http_connect(url, 60);
    assert_true(fd >= 0);
    char head[256];
    snprintf(head, sizeof(head),
             "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
             "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
             length);
    assert_int_equal(tu_http_send(fd, head, -1), 0);
    assert_int_equal(tu_http_send(fd, body, (long)sent), 0);
    return fd;
}

/* The rest of the body from `sent` on, then the response (the socket closed). */
static struct tu_http body_finish(int fd, const char *body, size_t length, size_t sent) {
    assert_int_equal(tu_http_send(fd, body + sent, (long)(length - sent)), 0);
    struct tu_http h;
    char why[256];
    assert_int_equal(tu_http_read(fd, &h, why, sizeof(why)), 0);
    close(fd);
    return h;
}

/* The request bodies the server holds at once stay within LLMEM_SERVER_BODIES_IN_FLIGHT times the
 * largest body (what its runtime reserve plans for): with two bodies of 4,000 of 4,096 bytes
 * half received, a third is answered 503 server_busy with Retry-After; the two complete, and once
 * they have, a body is taken again. */
static void test_bodies_in_flight(void **state) {
    (void)state;
    struct llmem_server_config sc;
    llmem_server_config_default(&sc);
    sc.max_body_bytes = 4096;
    assert_true(llmem_server_runtime_reserve(&sc, 1) >=
                3 * LLMEM_SERVER_BODIES_IN_FLIGHT * sc.max_body_bytes);
    struct llmem_engine *e = NULL;
    struct llmem_server *s = NULL;
    struct tu_server view;
    tu_library_serve(PYCODER, NULL, &sc, &e, &s, &view);
    const char *url = view.url;
    enum { LEN = 4000, HALF = 3000 };
    static char body[LEN + 1];
    const char json[] = "{\"prompt\": \"def f():\", \"max_tokens\": 2, \"temperature\": 0}";
    memset(body, ' ', LEN); /* JSON allows the whitespace before the value */
    memcpy(body + LEN - strlen(json), json, strlen(json));
    int fds[3];
    for (int i = 0; i < 3; i++) {
        fds[i] = body_socket(url, body, LEN, HALF);
        usleep(200 * 1000); /* each half read before the next one arrives */
    }
    struct tu_http h = body_finish(fds[2], body, LEN, HALF);
    assert_int_equal(h.status, 503);
    assert_non_null(strstr(h.body, "server_busy"));
    assert_non_null(strstr(h.headers, "Retry-After"));
    tu_http_free(&h);
    for (int i = 0; i < 2; i++) {
        h = body_finish(fds[i], body, LEN, HALF);
        assert_int_equal(h.status, 200);
        tu_http_free(&h);
    }
    h = body_finish(body_socket(url, body, LEN, HALF), body, LEN, HALF);
    assert_int_equal(h.status, 200);
    tu_http_free(&h);
    llmem_server_stop(s);
    llmem_engine_close(e);
}

/* Whether the server closed fd (a read gives end of file or a reset), waiting up to ms. */
static int closed_by_server(int fd, int ms) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, ms) <= 0)
        return 0;
    char b[256];
    ssize_t n = recv(fd, b, sizeof(b), 0);
    return n == 0 || (n < 0 && errno == ECONNRESET);
}

/* Clients that stop sending their bodies, or trickle them, cannot hold the bodies' budget: a
 * pause of a third of body_timeout_s, or a body still coming after it, closes the connection and
 * releases its bytes, and a whole body is taken again. */
static void test_slow_bodies_closed(void **state) {
    (void)state;
    struct llmem_server_config sc;
    llmem_server_config_default(&sc);
    sc.max_body_bytes = 4096;
    sc.body_timeout_s = 3;
    struct llmem_engine *e = NULL;
    struct llmem_server *s = NULL;
    struct tu_server view;
    tu_library_serve(PYCODER, NULL, &sc, &e, &s, &view);
    enum { LEN = 4000, HALF = 3000 };
    static char body[LEN + 1];
    const char json[] = "{\"prompt\": \"def f():\", \"max_tokens\": 2, \"temperature\": 0}";
    memset(body, ' ', LEN);
    memcpy(body + LEN - strlen(json), json, strlen(json));
    /* two stalled halves hold the budget, a third body is refused for now */
    int stalled[2] = {body_socket(view.url, body, LEN, HALF),
                      body_socket(view.url, body, LEN, HALF)};
    usleep(300 * 1000);
    struct tu_http h = body_finish(body_socket(view.url, body, LEN, HALF), body, LEN, HALF);
    assert_int_equal(h.status, 503);
    tu_http_free(&h);
    /* a trickle: a byte every 400 ms is no pause, but the body is not whole in time */
    int trickle = body_socket(view.url, body, LEN, 10);
    int closed = 0;
    for (int i = 0; i < 20 && !closed; i++) {
        usleep(400 * 1000);
        closed = send(trickle, " ", 1, MSG_NOSIGNAL) != 1 || closed_by_server(trickle, 0);
    }
    assert_true(closed || closed_by_server(trickle, 2000));
    close(trickle);
    for (int i = 0; i < 2; i++) { /* the stalled ones: closed after their pause */
        assert_true(closed_by_server(stalled[i], 3000));
        close(stalled[i]);
    }
    h = body_finish(body_socket(view.url, body, LEN, HALF), body, LEN, HALF);
    assert_int_equal(h.status, 200);
    tu_http_free(&h);
    llmem_server_stop(s);
    llmem_engine_close(e);
}

static void test_library_507_and_stop(void **state) {
    (void)state;
    struct llmem_engine *e = NULL;
    struct llmem_server *s = NULL;
    struct tu_server view;
    tu_library_serve(PYCODER, fake_guard, NULL, &e, &s, &view);
    assert_true(llmem_server_port(s) > 0);
    const char body[] = "{\"prompt\": \"def f():\", \"max_tokens\": 4, \"temperature\": 0}";

    struct tu_http h = post(&view, "/v1/completions", body);
    assert_int_equal(h.status, 200);
    tu_http_free(&h);
    __atomic_store_n(&pressure, 1, __ATOMIC_SEQ_CST);
    for (int stream = 0; stream < 2; stream++) {
        h = post(&view, "/v1/completions",
                 stream ? "{\"prompt\": \"x\", \"max_tokens\": 4, \"stream\": true}" : body);
        assert_int_equal(h.status, 507); /* a stream that never started is an error response */
        cJSON *root = tu_http_json(&h);
        const cJSON *err = cJSON_GetObjectItem(root, "error");
        assert_string_equal(cJSON_GetObjectItem(err, "type")->valuestring, "insufficient_memory");
        assert_non_null(
            strstr(cJSON_GetObjectItem(err, "message")->valuestring, "critical memory pressure"));
        cJSON_Delete(root);
        tu_http_free(&h);
    }
    h = get(&view, "/health");
    cJSON *health = tu_http_json(&h);
    assert_string_equal(cJSON_GetObjectItem(health, "status")->valuestring, "refusing");
    assert_string_equal(
        cJSON_GetObjectItem(cJSON_GetObjectItem(health, "guard"), "state")->valuestring,
        "critical");
    cJSON_Delete(health);
    tu_http_free(&h);
    assert_true(tu_metric(&view, "llmem_requests_total{outcome=\"refused\"}") == 2);
    assert_true(tu_metric(&view, "llmem_guard_actions_total{level=\"critical\"}") >= 1);
    __atomic_store_n(&pressure, 0, __ATOMIC_SEQ_CST);
    for (int i = 0; i < 100; i++) { /* the guard looks at least once a second */
        h = post(&view, "/v1/completions", body);
        int status = h.status;
        tu_http_free(&h);
        if (status == 200)
            break;
        assert_int_equal(status, 507);
        usleep(100 * 1000);
    }
    assert_true(tu_metric(&view, "llmem_requests_total{outcome=\"ok\"}") == 2);

    /* a long stream, read by curl in the background; stop the server under it */
    char out[] = "/tmp/llmem-stream-XXXXXX", url[256];
    int fd = mkstemp(out);
    assert_true(fd >= 0);
    url_of(&view, "/v1/completions", url, sizeof(url));
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd, 1);
        execlp("curl", "curl", "-sN", "-d",
               "{\"prompt\": \"def main():\", \"max_tokens\": 1900, \"temperature\": 0, "
               "\"ignore_eos\": true, \"stream\": true}",
               url, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 600; i++) {
        char buf[64] = "";
        if (pread(fd, buf, sizeof(buf) - 1, 0) > 0 && strstr(buf, "data: ") != NULL)
            break;
        usleep(20 * 1000);
    }
    llmem_server_stop(s);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail_msg("curl ended with status %d", status);
    static char text[1 << 20];
    ssize_t n = pread(fd, text, sizeof(text) - 1, 0);
    assert_true(n > 0);
    text[n] = '\0';
    close(fd);
    unlink(out);
    assert_non_null(strstr(text, "\"code\":\"server_shutting_down\""));
    const char *tail = text + strlen(text) - strlen("data: [DONE]\n\n");
    assert_string_equal(tail, "data: [DONE]\n\n");
    llmem_engine_close(e);
}

/* ---- out of memory everywhere ---------------------------------------------------------------- */

#define OOM_TOKENS 8

static void quiet(enum llmem_log_level level, const char *line, void *user) {
    (void)level, (void)line, (void)user;
}

/* The request of the sweep: greedy, a prompt of some length and logprobs, so that it meets the
 * engine's scratch, KV and sampling allocations. */
static void oom_body(char *buf, size_t size, int stream) {
    snprintf(
        buf, size,
        "{\"prompt\": \"import os\\nimport sys\\n\\n\\ndef read_lines(path):\\n    with "
        "open(path) as f:\\n        return [line.rstrip() for line in f]\\n\\n\\ndef "
        "main():\\n    for path in sys.argv[1:]:\\n\", \"max_tokens\": %d, \"temperature\": 0, "
        "\"ignore_eos\": true, \"logprobs\": 2, \"stream\": %s}",
        OOM_TOKENS, stream ? "true" : "false");
}

struct oom_tally {
    int ok, stream_error, http_5xx, http_507;
};

/* One greedy request's answer with a fault armed: a 200 with the whole greedy text (or, streaming,
 * an SSE body that ends in an error event and [DONE]), or a 5xx with an OpenAI error object. */
static void oom_request(const struct tu_server *s, int stream, const char *want,
                        struct oom_tally *t) {
    char body[1024];
    oom_body(body, sizeof(body), stream);
    struct tu_http h = post(s, "/v1/completions", body);
    if (h.status != 200) {
        if (h.status < 500)
            fail_msg("HTTP %d under a fault:\n%s", h.status, h.body);
        cJSON *root = tu_http_json(&h);
        assert_true(tu_is_error_object(root));
        cJSON_Delete(root);
        if (h.status == 507)
            t->http_507++;
        else
            t->http_5xx++;
    } else if (!stream) {
        cJSON *root = tu_http_json(&h);
        const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
        assert_string_equal(cJSON_GetObjectItem(c, "text")->valuestring, want);
        assert_string_equal(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "length");
        assert_int_equal(
            cJSON_GetObjectItem(cJSON_GetObjectItem(root, "usage"), "completion_tokens")->valueint,
            OOM_TOKENS);
        cJSON_Delete(root);
        t->ok++;
    } else {
        assert_non_null(strstr(h.headers, "text/event-stream"));
        cJSON *ev[64];
        int n = tu_sse_events(h.body, ev, 64);
        assert_true(n >= 1);
        if (cJSON_GetObjectItem(ev[n - 1], "error") != NULL) {
            assert_true(tu_is_error_object(ev[n - 1]));
            for (int i = 0; i < n - 1; i++) /* the chunks before it are chunks */
                assert_non_null(cJSON_GetObjectItem(ev[i], "choices"));
            t->stream_error++;
        } else {
            char text[1024] = "";
            for (int i = 0; i < n - 1; i++) {
                const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(ev[i], "choices"), 0);
                strncat(text, cJSON_GetObjectItem(c, "text")->valuestring,
                        sizeof(text) - strlen(text) - 1);
            }
            assert_string_equal(text, want);
            const cJSON *last = cJSON_GetArrayItem(cJSON_GetObjectItem(ev[n - 1], "choices"), 0);
            assert_string_equal(cJSON_GetObjectItem(last, "finish_reason")->valuestring, "length");
            t->ok++;
        }
        for (int i = 0; i < n; i++)
            cJSON_Delete(ev[i]);
    }
    tu_http_free(&h);
}

/* The greedy text of the request above, with no fault armed (malloc'ed). */
static char *oom_text(const struct tu_server *s) {
    char body[1024];
    oom_body(body, sizeof(body), 0);
    struct tu_http h = post(s, "/v1/completions", body);
    assert_int_equal(h.status, 200);
    cJSON *root = tu_http_json(&h);
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
    char *text = strdup(cJSON_GetObjectItem(c, "text")->valuestring);
    cJSON_Delete(root);
    tu_http_free(&h);
    return text;
}

/* A fresh engine (its guard reading no pressure) and a server over it, on a free port. */
static void oom_open(struct llmem_engine **e, struct llmem_server **s, struct tu_server *view) {
    tu_library_serve(PYCODER, fake_guard, NULL, e, s, view);
}

/* On a fresh engine and server (so that the request makes the allocations a warm engine has
 * cached: its scratch buffers, its KV blocks, the allocator's bookkeeping), arms the n-th
 * allocation from now to fail (count 1), or it and every one after it (LLMEM_MEM_FAULT_PERSIST),
 * sends one request and disarms; then the server serves the same greedy text as without a fault,
 * and stopping and closing free everything. 1 when the fault did not fire during the request
 * (every allocation it makes comes before the n-th). */
static int oom_probe(int64_t n, int64_t count, int stream, const char *want, struct oom_tally *t) {
    struct llmem_engine *e = NULL;
    struct llmem_server *s = NULL;
    struct tu_server view;
    oom_open(&e, &s, &view);
    llmem_mem_fault_inject_count(n, count);
    oom_request(&view, stream, want, t);
    int pending = llmem_mem_fault_pending();
    llmem_mem_fault_inject(0);
    /* the request, answered or failed, holds no KV block once it is over */
    tu_wait_idle(&view);
    assert_int_equal(tu_metric(&view, "llmem_kv_blocks_used"),
                     tu_metric(&view, "llmem_bank_blocks"));
    char *again = oom_text(&view);
    assert_string_equal(again, want);
    free(again);
    llmem_server_stop(s);
    llmem_engine_close(e);
    return pending;
}

/* The sweep of one mode: every n up to `reach` (the first n that one request no longer reaches),
 * or about 100 of them with a stride; every other one streaming as well. It ends at the first n
 * whose fault the request no longer reaches. Returns how many values of n it tried. */
static int64_t oom_sweep(int64_t reach, int64_t count, const char *want, struct oom_tally *t) {
    int64_t stride = reach / 100 + 1, swept = 0;
    for (int64_t n = 1;; n += stride) {
        int pending = oom_probe(n, count, 0, want, t);
        if (swept++ % 2 == 0)
            pending &= oom_probe(n, count, 1, want, t);
        if (pending)
            break;
        assert_true(n < 4 * reach);
    }
    return swept;
}

/* The n-th allocation (in any allocator of the process) failing during a completion request on
 * an in-process engine and server, for every n the request reaches, gives a 200 with the greedy
 * text or a clean 5xx/507 with an OpenAI error object (never a hang, a crash or a broken
 * response), and the server serves on unchanged (the sanitizer build checks that nothing leaks).
 * A warm engine serves a request from buffers it has cached, so each probe runs on a fresh one.
 * The allocator absorbs a single refused raw allocation by releasing its cache and retrying, so
 * the single-shot sweep mostly sees 200s; the persistent sweep (every allocation from the n-th
 * on fails until disarmed) reaches the error paths, and must see clean errors as well as 200s. */
static void test_out_of_memory_everywhere(void **state) {
    (void)state;
    struct llmem_engine *e = NULL;
    struct llmem_server *s = NULL;
    struct tu_server view;
    oom_open(&e, &s, &view);
    char *want = oom_text(&view);
    llmem_server_stop(s);
    llmem_engine_close(e);
    llmem_log_set_callback(quiet, NULL, LLMEM_LOG_ERROR);

    /* How many allocations one request reaches: the smallest n whose fault stays pending, found
     * by doubling and then bisecting (each probe a checked request of its own). */
    struct oom_tally once = {0}, persist = {0};
    int64_t lo = 0, hi = 1; /* n = lo fires (0: none tried), n = hi stays pending */
    while (!oom_probe(hi, 1, 0, want, &once)) {
        lo = hi;
        hi *= 2;
        assert_true(hi < (1 << 20));
    }
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        if (oom_probe(mid, 1, 0, want, &once))
            hi = mid;
        else
            lo = mid;
    }
    assert_true(hi > 1); /* the request does reach the allocators */
    int64_t swept_once = oom_sweep(hi, 1, want, &once);
    int64_t swept_persist = oom_sweep(hi, LLMEM_MEM_FAULT_PERSIST, want, &persist);
    llmem_log_set_callback(NULL, NULL, LLMEM_LOG_WARN);
    printf("  one request reaches %" PRId64 " allocations\n", hi - 1);
    printf("  single-shot, %" PRId64 " values of n: %d ok, %d streams ending in an error, %d 507, "
           "%d other 5xx\n",
           swept_once, once.ok, once.stream_error, once.http_507, once.http_5xx);
    printf("  persistent, %" PRId64 " values of n: %d ok, %d streams ending in an error, %d 507, "
           "%d other 5xx\n",
           swept_persist, persist.ok, persist.stream_error, persist.http_507, persist.http_5xx);
    /* every allocation from the first on refused cannot be absorbed: the error paths ran */
    assert_true(persist.http_507 + persist.http_5xx > 0);
    assert_true(persist.ok > 0);
    free(want);
}

int main(void) {
    const struct CMUnitTest shared[] = {
        cmocka_unit_test(test_completions_match_run),
        cmocka_unit_test(test_completions_stream),
        cmocka_unit_test(test_stop_and_logprobs),
        cmocka_unit_test(test_logit_bias_and_penalties),
        cmocka_unit_test(test_response_format),
        cmocka_unit_test(test_n_choices),
        cmocka_unit_test(test_tools),
        cmocka_unit_test(test_chat),
        cmocka_unit_test(test_nul_in_prompt),
        cmocka_unit_test(test_concurrent_equal_single),
        cmocka_unit_test(test_disconnect_frees_kv),
        cmocka_unit_test(test_disconnect_plain_cancels),
        cmocka_unit_test(test_shared_prefix_bank_hits),
        cmocka_unit_test(test_models_health_metrics),
        cmocka_unit_test(test_bad_requests),
        cmocka_unit_test(test_cache_clear),
    };
    const struct CMUnitTest own[] = {
        cmocka_unit_test(test_api_key_and_no_template),
        cmocka_unit_test(test_auto_tool_calls),
        cmocka_unit_test(test_queue_full),
        cmocka_unit_test(test_util_matches_plan),
        cmocka_unit_test(test_memory_burst),
        cmocka_unit_test(test_bodies_in_flight),
        cmocka_unit_test(test_slow_bodies_closed),
        cmocka_unit_test(test_library_507_and_stop),
        cmocka_unit_test(test_out_of_memory_everywhere),
    };
    int failed =
        cmocka_run_group_tests_name("e2e-serve (one server)", shared, group_setup, group_teardown);
    failed += cmocka_run_group_tests_name("e2e-serve (own servers)", own, NULL, NULL);
    return failed;
}
