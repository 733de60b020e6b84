/*
 * tests/test-server.c — the server's pure parts, without a network: request parsing and
 * validation (every field, its type and range, its default), the prompt against the context,
 * the OpenAI response shapes (completion, chat, streaming chunks, usage, logprobs, errors,
 * models), the Prometheus exposition and the /health document.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "llmem/plan.h"
#include "llmem/server.h"
#include "server/server_int.h"
#include "testutil.h"

static const struct srv_model model = {
    .name = "pycoder", .vocab = 4096, .context = 2048, .tools = 1};

static int parse(enum srv_kind kind, const char *body, struct srv_request *r, struct srv_error *e) {
    memset(e, 0, sizeof(*e));
    return llmem_srv_request_parse(kind, body, strlen(body), &model, r, e);
}

static void test_utf8(void **state) {
    (void)state;
    static const struct {
        const char *s;
        int ok;
    } cases[] = {
        {"plain ascii", 1},
        {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", 1}, /* é € 😀 */
        {"\xc3", 0},                                      /* truncated */
        {"\xc0\xaf", 0},                                  /* overlong '/' */
        {"\xe0\x80\xaf", 0},                              /* overlong, 3 bytes */
        {"\xed\xa0\x80", 0},                              /* a surrogate */
        {"\xf4\x90\x80\x80", 0},                          /* above U+10FFFF */
        {"\xff", 0},
        {"a\x80z", 0}, /* a lone continuation byte */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        assert_int_equal(llmem_srv_utf8_valid(cases[i].s, strlen(cases[i].s)), cases[i].ok);
    assert_int_equal(llmem_srv_utf8_valid("a\0b", 3), 1); /* NUL is a character */
}

static void test_parse_completion(void **state) {
    (void)state;
    struct srv_request r;
    struct srv_error e;
    /* every field */
    assert_int_equal(
        parse(SRV_COMPLETIONS,
              "{\"model\": \"pycoder\", \"prompt\": \"def f():\", \"max_tokens\": 7, "
              "\"temperature\": 0.5, \"top_p\": 0.9, \"top_k\": 40, \"min_p\": 0.05, "
              "\"seed\": 42, \"stop\": [\"\\n\\n\", \"x\"], \"n\": 1, \"logprobs\": 3, "
              "\"stream\": true, \"stream_options\": {\"include_usage\": true}, "
              "\"ignore_eos\": true, \"echo\": false, \"best_of\": 1, "
              "\"presence_penalty\": 0.5, \"frequency_penalty\": -0.25, "
              "\"repetition_penalty\": 1.1, \"logit_bias\": {\"7\": -100, \"12\": 3.5}, "
              "\"user\": \"u\", \"unknown\": [1]}",
              &r, &e),
        0);
    assert_true(r.sampling.presence_penalty == 0.5 && r.sampling.frequency_penalty == -0.25 &&
                r.sampling.repetition_penalty == 1.1);
    assert_int_equal(r.sampling.n_logit_bias, 2);
    assert_true(r.sampling.logit_bias[0].id == 7 && r.sampling.logit_bias[0].bias == -100.0f);
    assert_true(r.sampling.logit_bias[1].id == 12 && r.sampling.logit_bias[1].bias == 3.5f);
    assert_int_equal(r.kind, SRV_COMPLETIONS);
    assert_string_equal(r.prompt_text, "def f():");
    assert_null(r.prompt_ids);
    assert_int_equal(r.max_tokens, 7);
    assert_true(r.sampling.temperature == 0.5 && r.sampling.top_p == 0.9);
    assert_int_equal(r.sampling.top_k, 40);
    assert_true(r.sampling.min_p == 0.05);
    assert_int_equal(r.sampling.seed, 42);
    assert_true(r.have_seed);
    assert_int_equal(r.n_stop, 2);
    assert_string_equal(r.stop[0], "\n\n");
    assert_int_equal(r.logprobs, 3);
    assert_true(r.stream && r.include_usage && r.ignore_eos);
    llmem_srv_request_free(&r);

    /* defaults: OpenAI's 16 tokens, temperature 1, top_p 1, no logprobs, a server-picked seed */
    assert_int_equal(parse(SRV_COMPLETIONS, "{\"prompt\": \"x\"}", &r, &e), 0);
    assert_int_equal(r.max_tokens, 16);
    assert_true(r.sampling.temperature == 1.0 && r.sampling.top_p == 1.0);
    assert_int_equal(r.sampling.top_k, 0);
    assert_int_equal(r.logprobs, -1);
    assert_false(r.have_seed || r.stream || r.include_usage || r.ignore_eos);
    assert_int_equal(r.n_stop, 0);
    llmem_srv_request_free(&r);

    /* prompts as token ids, a one-prompt batch, a single stop string, top_k -1 (off) */
    assert_int_equal(parse(SRV_COMPLETIONS,
                           "{\"prompt\": [1, 2, 4095], \"stop\": \"end\", \"top_k\": -1}", &r, &e),
                     0);
    assert_int_equal(r.n_prompt_ids, 3);
    assert_int_equal(r.prompt_ids[2], 4095);
    assert_int_equal(r.n_stop, 1);
    assert_int_equal(r.sampling.top_k, 0);
    llmem_srv_request_free(&r);
    assert_int_equal(parse(SRV_COMPLETIONS, "{\"prompt\": [[5, 6]]}", &r, &e), 0);
    assert_int_equal(r.n_prompt_ids, 2);
    llmem_srv_request_free(&r);
    assert_int_equal(
        parse(SRV_COMPLETIONS, "{\"prompt\": [\"only\"], \"max_tokens\": null}", &r, &e), 0);
    assert_string_equal(r.prompt_text, "only");
    assert_int_equal(r.max_tokens, 16);
    llmem_srv_request_free(&r);
}

/* A NUL ("\u0000") in a prompt or a message is kept with the text around it: (pointer, length)
 * covers every byte, as cJSON's C string alone would not. */
static void test_parse_nul(void **state) {
    (void)state;
    struct srv_request r;
    struct srv_error e;
    assert_int_equal(parse(SRV_COMPLETIONS,
                           "{\"prompt\": \"def foo():\\u0000 return 1\", \"k\": \"\\u0000\"}", &r,
                           &e),
                     0);
    assert_int_equal(r.prompt_len, 20);
    assert_memory_equal(r.prompt_text, "def foo():\0 return 1", 20);
    llmem_srv_request_free(&r);
    /* first, last, beside other escapes (é, 😀 as a surrogate pair), in a batch of one */
    assert_int_equal(
        parse(SRV_COMPLETIONS, "{\"prompt\": [\"\\u0000d\\u00e9f\\ud83d\\ude00\\n\\u0000\"]}", &r, &e),
        0);
    assert_int_equal(r.prompt_len, 11);
    assert_memory_equal(r.prompt_text, "\0d\xc3\xa9" "f\xf0\x9f\x98\x80\n\0", 11);
    llmem_srv_request_free(&r);
    /* without a NUL the length is the string's */
    assert_int_equal(parse(SRV_COMPLETIONS, "{\"prompt\": \"a\\\"b\"}", &r, &e), 0);
    assert_int_equal(r.prompt_len, 3);
    llmem_srv_request_free(&r);
    /* chat: a content string, and text parts joined */
    assert_int_equal(parse(SRV_CHAT,
                           "{\"messages\": [{\"role\": \"user\", \"content\": \"\\u0000x\\u0000\"}, "
                           "{\"role\": \"assistant\", \"content\": [{\"type\": \"text\", \"text\": "
                           "\"a\\u0000\"}, {\"type\": \"text\", \"text\": \"\\u0000b\"}]}]}",
                           &r, &e),
                     0);
    assert_int_equal(r.n_messages, 2);
    assert_int_equal(r.messages[0].content_len, 3);
    assert_memory_equal(r.messages[0].content, "\0x\0", 3);
    assert_int_equal(r.messages[1].content_len, 5);
    assert_memory_equal(r.messages[1].content, "a\0\n\0b", 5);
    llmem_srv_request_free(&r);
}

static void test_parse_chat(void **state) {
    (void)state;
    struct srv_request r;
    struct srv_error e;
    assert_int_equal(
        parse(SRV_CHAT,
              "{\"messages\": [{\"role\": \"developer\", \"content\": \"be brief\"}, {\"role\": "
              "\"user\", \"content\": [{\"type\": \"text\", \"text\": \"a\"}, {\"type\": "
              "\"text\", \"text\": \"b\"}]}, {\"role\": \"assistant\", \"content\": null}], "
              "\"max_tokens\": 100, \"max_completion_tokens\": 9, \"logprobs\": true, "
              "\"top_logprobs\": 4, \"response_format\": {\"type\": \"text\"}, \"tools\": []}",
              &r, &e),
        0);
    assert_int_equal(r.n_messages, 3);
    assert_string_equal(r.messages[0].role, "system");
    assert_string_equal(r.messages[1].content, "a\nb");
    assert_string_equal(r.messages[2].content, "");
    assert_int_equal(r.max_tokens, 9); /* max_completion_tokens wins */
    assert_int_equal(r.logprobs, 4);
    llmem_srv_request_free(&r);
    /* chat defaults: up to the context; logprobs true alone: no alternatives */
    assert_int_equal(parse(SRV_CHAT,
                           "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
                           "\"logprobs\": true}",
                           &r, &e),
                     0);
    assert_int_equal(r.max_tokens, 0);
    assert_int_equal(r.logprobs, 0);
    llmem_srv_request_free(&r);
}

/* Each bad body: its HTTP status, the param named and the code. */
static void test_parse_errors(void **state) {
    (void)state;
    static const struct {
        enum srv_kind kind;
        const char *body;
        int http;
        const char *param, *code;
    } cases[] = {
        {SRV_COMPLETIONS, "", 400, NULL, "invalid_json"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\"} trailing", 400, NULL, "invalid_json"},
        {SRV_COMPLETIONS, "\"a string\"", 400, NULL, "invalid_json"},
        {SRV_COMPLETIONS, "{\"prompt\": \"\xc3\x28\"}", 400, NULL, "invalid_encoding"},
        {SRV_COMPLETIONS, "{}", 400, "prompt", "missing_required_parameter"},
        {SRV_COMPLETIONS, "{\"prompt\": true}", 400, "prompt", "invalid_type"},
        {SRV_COMPLETIONS, "{\"prompt\": [1, 2.5]}", 400, "prompt", "invalid_type"},
        {SRV_COMPLETIONS, "{\"prompt\": [4096]}", 400, "prompt", "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": [-1]}", 400, "prompt", "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": [\"a\", \"b\"]}", 400, "prompt", "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"model\": \"other\"}", 404, "model",
         "model_not_found"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"max_tokens\": -1}", 400, "max_tokens",
         "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"max_tokens\": 2049}", 400, "max_tokens",
         "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"max_tokens\": 1e300}", 400, "max_tokens",
         "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"max_tokens\": [1]}", 400, "max_tokens",
         "invalid_type"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"temperature\": 2.5}", 400, "temperature",
         "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"temperature\": null, \"top_p\": 1.5}", 400,
         "top_p", "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"top_k\": 1.5}", 400, "top_k", "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"min_p\": -0.1}", 400, "min_p", "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"seed\": true}", 400, "seed", "invalid_type"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"stop\": {}}", 400, "stop", "invalid_type"},
        {SRV_COMPLETIONS,
         "{\"prompt\": \"x\", \"stop\": [\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\","
         "\"10\",\"11\",\"12\",\"13\",\"14\",\"15\",\"16\",\"17\"]}",
         400, "stop", "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"n\": 0}", 400, "n", "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"n\": 17}", 400, "n", "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"n\": 2, \"stream\": true}", 400, "n",
         "unsupported_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"n\": \"1\"}", 400, "n", "invalid_type"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"logprobs\": 21}", 400, "logprobs",
         "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"logprobs\": true}", 400, "logprobs",
         "invalid_type"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"stream\": 1}", 400, "stream", "invalid_type"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"stream_options\": {}}", 400, "stream_options",
         "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"stream\": true, \"stream_options\": 3}", 400,
         "stream_options", "invalid_type"},
        {SRV_COMPLETIONS,
         "{\"prompt\": \"x\", \"stream\": true, \"stream_options\": {\"include_usage\": 1}}", 400,
         "stream_options.include_usage", "invalid_type"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"echo\": true}", 400, "echo", "unsupported_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"best_of\": 2}", 400, "best_of",
         "unsupported_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"suffix\": \"s\"}", 400, "suffix",
         "unsupported_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"frequency_penalty\": 2.5}", 400,
         "frequency_penalty", "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"presence_penalty\": \"high\"}", 400,
         "presence_penalty", "invalid_type"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"repetition_penalty\": 0}", 400,
         "repetition_penalty", "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"logit_bias\": [1]}", 400, "logit_bias",
         "invalid_type"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"logit_bias\": {\"abc\": 5}}", 400, "logit_bias",
         "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"logit_bias\": {\"-1\": 5}}", 400, "logit_bias",
         "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"logit_bias\": {\"99999999\": 5}}", 400,
         "logit_bias", "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"logit_bias\": {\"1\": 101}}", 400, "logit_bias",
         "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"logit_bias\": {\"1\": \"5\"}}", 400, "logit_bias",
         "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"ignore_eos\": \"y\"}", 400, "ignore_eos",
         "invalid_type"},
        {SRV_CHAT, "{}", 400, "messages", "missing_required_parameter"},
        {SRV_CHAT, "{\"messages\": {}}", 400, "messages", "invalid_type"},
        {SRV_CHAT, "{\"messages\": []}", 400, "messages", "invalid_value"},
        {SRV_CHAT, "{\"messages\": [7]}", 400, "messages", "invalid_type"},
        {SRV_CHAT, "{\"messages\": [{\"content\": \"x\"}]}", 400, "messages", "invalid_value"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}", 400, "messages",
         "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{\"function\": {}}]}]}", 400,
         "messages", "invalid_value"},
        /* tools */
        {SRV_COMPLETIONS,
         "{\"prompt\": \"x\", \"tools\": [{\"type\": \"function\", \"function\": "
         "{\"name\": \"f\"}}]}",
         400, "tools", "unsupported_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": "
         "\"function\", \"function\": {\"name\": \"f\"}}], \"tool_choice\": {\"type\": "
         "\"function\", \"function\": {\"name\": \"g\"}}}",
         400, "tool_choice", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tool_choice\": "
         "\"required\"}",
         400, "tool_choice", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": "
         "\"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": \"string\", "
         "\"pattern\": \"a\"}}}], \"tool_choice\": \"required\"}",
         400, "tools", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": "
         "\"function\", \"function\": {\"name\": \"f\"}}], \"tool_choice\": \"maybe\"}",
         400, "tool_choice", "invalid_value"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\"}]}", 400, "messages",
         "missing_required_parameter"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}", 400,
         "messages", "invalid_value"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"logprobs\": 2}",
         400, "logprobs", "invalid_type"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"logprobs\": true, "
         "\"top_logprobs\": 30}",
         400, "top_logprobs", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"top_logprobs\": 1}", 400,
         "top_logprobs", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_completion_tokens\": "
         "0}",
         400, "max_completion_tokens", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": "
         "\"function\"}]}",
         400, "tools", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"response_format\": "
         "{\"type\": \"json_schema\"}}",
         400, "response_format", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"response_format\": "
         "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": {\"minimum\": 1}}}}",
         400, "response_format", "invalid_value"},
        /* a NUL in a field that names something: never read as the prefix before it */
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"stop\": \"a\\u0000b\"}", 400, "stop",
         "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"stop\": [\"ok\", \"\\u0000\"]}", 400, "stop",
         "invalid_value"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"model\": \"pycoder\\u0000x\"}", 404, "model",
         "model_not_found"},
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"suffix\": \"\\u0000s\"}", 400, "suffix",
         "unsupported_value"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\\u0000x\", \"content\": \"x\"}]}", 400,
         "messages", "invalid_value"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\\u0000\", \"content\": \"x\"}]}", 400,
         "messages", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\\u0000\", "
         "\"text\": \"x\"}]}]}",
         400, "messages", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"response_format\": "
         "{\"type\": \"text\\u0000\"}}",
         400, "response_format", "invalid_type"},
        /* ... nor in a key, a schema's strings, a tool's parameters or a named tool_choice */
        {SRV_COMPLETIONS, "{\"prompt\": \"x\", \"k\\u0000ey\": 1}", 400, "k", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"response_format\": "
         "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": {\"const\": "
         "\"a\\u0000b\"}}}}",
         400, "response_format", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": "
         "\"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": "
         "\"object\", \"properties\": {\"a\": {\"enum\": [\"x\\u0000\"]}}}}}]}",
         400, "tools", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": "
         "\"function\", \"function\": {\"name\": \"f\"}}], \"tool_choice\": {\"type\": "
         "\"function\", \"function\": {\"name\": \"f\\u0000zz\"}}}",
         400, "tool_choice", "invalid_value"},
        /* two tools of one name; a tool message without its call's id */
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": "
         "\"function\", \"function\": {\"name\": \"f\"}}, {\"type\": \"function\", "
         "\"function\": {\"name\": \"f\"}}]}",
         400, "tools", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"tool\", "
         "\"content\": \"42\"}]}",
         400, "messages", "invalid_value"},
        /* stop strings beside a grammar that keeps the output whole */
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"stop\": \":\", "
         "\"response_format\": {\"type\": \"json_object\"}}",
         400, "stop", "invalid_value"},
        {SRV_CHAT,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"stop\": [\"city\"], "
         "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}], "
         "\"tool_choice\": \"required\"}",
         400, "stop", "invalid_value"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct srv_request r;
        struct srv_error e;
        int rc = parse(cases[i].kind, cases[i].body, &r, &e);
        if (rc != -1 || e.http != cases[i].http || (cases[i].param == NULL) != (e.param == NULL) ||
            (cases[i].param != NULL && strcmp(cases[i].param, e.param) != 0) || e.code == NULL ||
            strcmp(cases[i].code, e.code) != 0)
            fail_msg("case %zu %s: rc %d, http %d, param %s, code %s: %s", i, cases[i].body, rc,
                     e.http, e.param ? e.param : "(null)", e.code ? e.code : "(null)", e.message);
        assert_true(strlen(e.message) > 8);
        assert_string_equal(e.type, "invalid_request_error");
        llmem_srv_request_free(&r); /* a failed parse leaves nothing behind but what free frees */
    }
    /* a NUL byte after the document is text after it, not its end */
    static const char nul_after[] = "{\"prompt\": \"x\"}\0 trailing";
    struct srv_request r0;
    struct srv_error e0;
    memset(&e0, 0, sizeof(e0));
    assert_int_equal(llmem_srv_request_parse(SRV_COMPLETIONS, nul_after, sizeof(nul_after) - 1,
                                             &model, &r0, &e0),
                     -1);
    assert_string_equal(e0.code, "invalid_json");
    llmem_srv_request_free(&r0);
    /* a tool nesting deeper than its indented rendering should grow (quadratically): refused */
    char deep[2048];
    int d = snprintf(deep, sizeof(deep),
                     "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": "
                     "[{\"type\": \"function\", \"function\": {\"name\": \"f\", "
                     "\"parameters\": {\"type\": \"object\", \"x\": ");
    for (int i = 0; i < 40; i++)
        d += snprintf(deep + d, sizeof(deep) - (size_t)d, "[");
    for (int i = 0; i < 40; i++)
        d += snprintf(deep + d, sizeof(deep) - (size_t)d, "]");
    snprintf(deep + d, sizeof(deep) - (size_t)d, "}}}]}");
    assert_int_equal(parse(SRV_CHAT, deep, &r0, &e0), -1);
    assert_string_equal(e0.param, "tools");
    assert_non_null(strstr(e0.message, "levels deep; at most 32"));
    llmem_srv_request_free(&r0);
    /* a body of more JSON values than the server plans parse trees for: refused before it is
     * parsed (the strings' commas and brackets are not values) */
    struct srv_model few = model;
    few.max_values = 70;
    char ids[1024];
    int ia = snprintf(ids, sizeof(ids), "{\"prompt\": [1");
    for (int i = 1; i < 62; i++)
        ia += snprintf(ids + ia, sizeof(ids) - (size_t)ia, ",%d", i);
    snprintf(ids + ia, sizeof(ids) - (size_t)ia, "], \"stop\": \"[,,,,{{{\"}");
    memset(&e0, 0, sizeof(e0));
    assert_int_equal(llmem_srv_request_parse(SRV_COMPLETIONS, ids, strlen(ids), &few, &r0, &e0), 0);
    llmem_srv_request_free(&r0);
    snprintf(ids + ia, sizeof(ids) - (size_t)ia, ",1,2,3,4,5,6,7,8]}");
    memset(&e0, 0, sizeof(e0));
    assert_int_equal(llmem_srv_request_parse(SRV_COMPLETIONS, ids, strlen(ids), &few, &r0, &e0),
                     -1);
    assert_int_equal(e0.http, 400);
    assert_non_null(strstr(e0.message, "holds 72 JSON values; at most 70"));
    llmem_srv_request_free(&r0);
    /* more choices than the server's queue holds could never all start: refused by name */
    struct srv_model small = model;
    small.max_choices = 2;
    memset(&e0, 0, sizeof(e0));
    static const char three[] = "{\"prompt\": \"x\", \"n\": 3}";
    assert_int_equal(
        llmem_srv_request_parse(SRV_COMPLETIONS, three, sizeof(three) - 1, &small, &r0, &e0), -1);
    assert_string_equal(e0.param, "n");
    assert_non_null(
        strstr(e0.message, "it must be 1 to 2 (this server's --max-queue and --max-sequences)"));
    llmem_srv_request_free(&r0);
    /* a schema whose grammar outgrows what the plan holds for a request's (an enum of 40,000
     * strings): refused by name before anything is queued */
    char *big = malloc(40000 * 11 + 256);
    assert_non_null(big);
    int at = sprintf(big, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
                          "\"response_format\": {\"type\": \"json_schema\", \"json_schema\": "
                          "{\"schema\": {\"enum\": [");
    for (int i = 0; i < 40000; i++)
        at += sprintf(big + at, "%s\"v%07d\"", i > 0 ? "," : "", i);
    strcpy(big + at, "]}}}}");
    struct srv_request r;
    struct srv_error e;
    assert_int_equal(parse(SRV_CHAT, big, &r, &e), -1);
    assert_int_equal(e.http, 400);
    assert_string_equal(e.param, "response_format");
    assert_non_null(strstr(e.message, "too large"));
    llmem_srv_request_free(&r);
    free(big);
}

static void test_check_prompt(void **state) {
    (void)state;
    struct srv_error e;
    assert_int_equal(llmem_srv_check_prompt(SRV_COMPLETIONS, 1, 16, &model, &e), 0);
    assert_int_equal(llmem_srv_check_prompt(SRV_COMPLETIONS, 2047, 0, &model, &e), 0);
    assert_int_equal(llmem_srv_check_prompt(SRV_CHAT, 2048, 0, &model, &e), -1);
    assert_string_equal(e.code, "context_length_exceeded");
    assert_string_equal(e.param, "messages");
    assert_non_null(strstr(e.message, "2048"));
    assert_int_equal(llmem_srv_check_prompt(SRV_COMPLETIONS, 0, 16, &model, &e), -1);
    assert_string_equal(e.param, "prompt");
    /* the prompt and max_tokens together: the whole window, not one token more */
    assert_int_equal(llmem_srv_check_prompt(SRV_CHAT, 2000, 48, &model, &e), 0);
    assert_int_equal(llmem_srv_check_prompt(SRV_CHAT, 2000, 49, &model, &e), -1);
    assert_string_equal(e.code, "context_length_exceeded");
    assert_string_equal(e.param, "max_tokens");
    assert_non_null(
        strstr(e.message, "2000 in the messages and 49 for the completion ask for 2049"));
}

/* ---- rendering ------------------------------------------------------------------------------- */

/* Token i's text is "<i>". */
static char *fake_piece(void *arg, int32_t id) {
    (void)arg;
    char *s = malloc(16);
    snprintf(s, 16, "<%d>", id);
    return s;
}

static const char *const declared[] = {"get", "f", "g"}; /* the tools a call may name */

/* A real tokenizer's pieces and bytes, as the server gives them. */
static char *tok_piece(void *arg, int32_t id) {
    char *text = NULL;
    size_t len = 0;
    return llmem_tokenizer_decode(arg, &id, 1, 0, &text, &len) == LLMEM_OK ? text : strdup("");
}

static int tok_bytes(void *arg, int32_t id, char *buf, size_t cap, size_t *len) {
    return llmem_tokenizer_token_bytes(arg, id, buf, cap, len) == LLMEM_OK ? 0 : -1;
}

static struct srv_render render(enum srv_kind kind, int logprobs) {
    return (struct srv_render){.kind = kind,
                               .id = "cmpl-1",
                               .model = "pycoder",
                               .created = 1700000000,
                               .logprobs = logprobs,
                               .piece = fake_piece,
                               .tool_names = declared,
                               .n_tools = 3};
}

static cJSON *parsed(char *text) {
    assert_non_null(text);
    cJSON *root = cJSON_Parse(text);
    assert_non_null(root);
    free(text);
    return root;
}

static void test_render_completion(void **state) {
    (void)state;
    struct srv_token toks[2] = {{.id = 5,
                                 .logprob = -0.25f,
                                 .n_top = 2,
                                 .top_ids = {5, 9},
                                 .top_logprobs = {-0.25f, -1.5f}},
                                {.id = 12,
                                 .logprob = -0.5f,
                                 .n_top = 2,
                                 .top_ids = {12, 12},
                                 .top_logprobs = {-0.5f, -0.5f}}};
    struct srv_render r = render(SRV_COMPLETIONS, 2);
    const struct srv_choice ab = {"ab", 2, toks, 2, "length"};
    cJSON *o = parsed(llmem_srv_render_response(&r, &ab, 1, 3, 2));
    assert_string_equal(cJSON_GetObjectItem(o, "id")->valuestring, "cmpl-1");
    assert_string_equal(cJSON_GetObjectItem(o, "object")->valuestring, "text_completion");
    assert_int_equal(cJSON_GetObjectItem(o, "created")->valuedouble, 1700000000);
    assert_string_equal(cJSON_GetObjectItem(o, "model")->valuestring, "pycoder");
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0);
    assert_int_equal(cJSON_GetObjectItem(c, "index")->valueint, 0);
    assert_string_equal(cJSON_GetObjectItem(c, "text")->valuestring, "ab");
    assert_string_equal(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "length");
    const cJSON *lp = cJSON_GetObjectItem(c, "logprobs");
    assert_string_equal(cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "tokens"), 1)->valuestring,
                        "<12>");
    assert_true(cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "token_logprobs"), 0)->valuedouble ==
                -0.25);
    const cJSON *top0 = cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "top_logprobs"), 0);
    assert_int_equal(cJSON_GetArraySize(top0), 2);
    assert_true(cJSON_GetObjectItem(top0, "<9>")->valuedouble == -1.5);
    /* a duplicate alternative is one key */
    assert_int_equal(
        cJSON_GetArraySize(cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "top_logprobs"), 1)), 1);
    /* text offsets: where each token's text starts */
    assert_int_equal(cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "text_offset"), 1)->valueint, 3);
    const cJSON *u = cJSON_GetObjectItem(o, "usage");
    assert_int_equal(cJSON_GetObjectItem(u, "prompt_tokens")->valueint, 3);
    assert_int_equal(cJSON_GetObjectItem(u, "completion_tokens")->valueint, 2);
    assert_int_equal(cJSON_GetObjectItem(u, "total_tokens")->valueint, 5);
    cJSON_Delete(o);

    /* without logprobs: null; a text with quotes and a newline survives */
    r = render(SRV_COMPLETIONS, -1);
    const struct srv_choice hi = {"say \"hi\"\n", 9, NULL, 0, "stop"};
    o = parsed(llmem_srv_render_response(&r, &hi, 1, 1, 1));
    c = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(c, "logprobs")));
    assert_string_equal(cJSON_GetObjectItem(c, "text")->valuestring, "say \"hi\"\n");
    cJSON_Delete(o);
}

/* The message's content as a C string (the test's contents hold no NUL). */
static int content_is(const struct srv_request *r, int i, const char *role, const char *text) {
    const struct llmem_chat_message *m = &r->messages[i];
    return strcmp(m->role, role) == 0 && m->content_len == strlen(text) &&
           memcmp(m->content, text, m->content_len) == 0;
}

/* Tools written as each family's template writes them: Hermes-style (chatml) in the system
 * message with <tool_call> blocks, Llama 3.1's in the first user message with ipython results;
 * a forced call's grammar; the answer read back as tool_calls. */
static void test_tool_conventions(void **state) {
    (void)state;
    static const char body[] =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"weather?\"}, {\"role\": "
        "\"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"c1\", \"type\": "
        "\"function\", \"function\": {\"name\": \"get\", \"arguments\": \"{\\\"city\\\":"
        "\\\"Oslo\\\"}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": "
        "\"-3 C\"}], \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get\", "
        "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": "
        "\"string\"}}, \"required\": [\"city\"]}}}], \"tool_choice\": \"required\"}";
    struct srv_request r;
    struct srv_error e;
    assert_int_equal(parse(SRV_CHAT, body, &r, &e), 0); /* chatml: Hermes-style */
    assert_int_equal(r.n_messages, 4);
    assert_string_equal(r.messages[0].role, "system");
    assert_non_null(strstr(r.messages[0].content,
                           "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get\", "));
    assert_true(content_is(&r, 2, "assistant",
                           "<tool_call>\n{\"name\": \"get\", \"arguments\": {\"city\": "
                           "\"Oslo\"}}\n</tool_call>"));
    assert_true(content_is(&r, 3, "user", "<tool_response>\n-3 C\n</tool_response>"));
    assert_non_null(r.grammar);
    llmem_srv_request_free(&r);

    struct srv_model llama = model;
    llama.tool_format = LLMEM_TOOL_FORMAT_LLAMA3;
    memset(&e, 0, sizeof(e));
    assert_int_equal(llmem_srv_request_parse(SRV_CHAT, body, strlen(body), &llama, &r, &e), 0);
    assert_int_equal(r.n_messages, 4);
    assert_true(content_is(&r, 0, "system",
                           "Environment: ipython\nCutting Knowledge Date: December 2023\nToday "
                           "Date: 26 Jul 2024\n\n"));
    assert_string_equal(r.messages[1].role, "user");
    assert_true(strncmp(r.messages[1].content, "Given the following functions", 29) == 0);
    assert_non_null(strstr(r.messages[1].content,
                           ".Do not use variables.\n\n{\n    \"type\": \"function\",\n    "
                           "\"function\": {\n        \"name\": \"get\",\n"));
    assert_non_null(strstr(r.messages[1].content, "\"required\": [\n                \"city\"\n"
                                                  "            ]\n        }\n    }\n}\n\nweather?"));
    assert_true(content_is(&r, 2, "assistant",
                           "{\"name\": \"get\", \"parameters\": {\"city\": \"Oslo\"}}"));
    assert_true(content_is(&r, 3, "ipython", "-3 C"));
    assert_non_null(r.grammar);
    llmem_srv_request_free(&r);
    /* Llama 3 puts the tools in a first user message: a conversation without one is refused */
    static const char no_user[] =
        "{\"messages\": [{\"role\": \"assistant\", \"content\": \"hi\"}], \"tools\": "
        "[{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]}";
    memset(&e, 0, sizeof(e));
    assert_int_equal(
        llmem_srv_request_parse(SRV_CHAT, no_user, strlen(no_user), &llama, &r, &e), -1);
    assert_int_equal(e.http, 400);
    assert_string_equal(e.param, "messages");
    llmem_srv_request_free(&r);

    /* the answers read back: Llama 3's whole answer, Hermes-style blocks after content */
    struct srv_render rr = render(SRV_CHAT, -1);
    rr.tools = 1;
    rr.tool_format = LLMEM_TOOL_FORMAT_LLAMA3;
    const char *call = "{\"name\": \"get\", \"parameters\": {\"city\": \"Oslo\"}}";
    const struct srv_choice ans = {call, strlen(call), NULL, 0, "stop"};
    cJSON *o = parsed(llmem_srv_render_response(&rr, &ans, 1, 10, 9));
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0);
    const cJSON *m = cJSON_GetObjectItem(c, "message");
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(m, "content")));
    const cJSON *f =
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(m, "tool_calls"), 0), "function");
    assert_string_equal(cJSON_GetObjectItem(f, "name")->valuestring, "get");
    assert_string_equal(cJSON_GetObjectItem(f, "arguments")->valuestring, "{\"city\":\"Oslo\"}");
    assert_string_equal(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "tool_calls");
    cJSON_Delete(o);
    const char *plain = "It is cold.";
    const struct srv_choice text = {plain, strlen(plain), NULL, 0, "stop"};
    rr = render(SRV_CHAT, -1);
    rr.tools = 1;
    rr.tool_format = LLMEM_TOOL_FORMAT_LLAMA3;
    o = parsed(llmem_srv_render_response(&rr, &text, 1, 10, 3));
    c = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0);
    assert_string_equal(
        cJSON_GetObjectItem(cJSON_GetObjectItem(c, "message"), "content")->valuestring, plain);
    assert_string_equal(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "stop");
    cJSON_Delete(o);
    const char *hermes = "Let me look.\n<tool_call>\n{\"name\": \"get\", \"arguments\": "
                         "{\"city\": \"Oslo\"}}\n</tool_call>";
    const struct srv_choice h = {hermes, strlen(hermes), NULL, 0, "stop"};
    rr = render(SRV_CHAT, -1);
    rr.tools = 1;
    o = parsed(llmem_srv_render_response(&rr, &h, 1, 10, 20));
    m = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0), "message");
    assert_string_equal(cJSON_GetObjectItem(m, "content")->valuestring, "Let me look.");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(m, "tool_calls")), 1);
    cJSON_Delete(o);
    /* a call of a function the request did not declare is no call: the text is the content */
    rr = render(SRV_CHAT, -1);
    rr.tools = 1;
    rr.n_tools = 2; /* "get" and "f" */
    const char *other = "<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>";
    const struct srv_choice un = {other, strlen(other), NULL, 0, "stop"};
    o = parsed(llmem_srv_render_response(&rr, &un, 1, 10, 20));
    c = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0);
    m = cJSON_GetObjectItem(c, "message");
    assert_string_equal(cJSON_GetObjectItem(m, "content")->valuestring, other);
    assert_null(cJSON_GetObjectItem(m, "tool_calls"));
    assert_string_equal(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "stop");
    cJSON_Delete(o);
}

/* Mistral v0.3's convention: requests as an OpenAI client sends them (arguments as JSON text,
 * any ids), parsed and rendered with tok-mistral-tools' template, byte for byte as transformers
 * renders the same conversations (render.json, made by make_mistral_tools.py); a forced call's
 * grammar; the answer read back. */
static void test_tool_convention_mistral(void **state) {
    (void)state;
    struct llmem_tokenizer *tok = NULL;
    assert_int_equal(llmem_tokenizer_load(LLMEM_TEST_DATA "/tok/tok-mistral-tools", &tok),
                     LLMEM_OK);
    enum llmem_chat_template t = LLMEM_CHAT_NONE;
    assert_int_equal(llmem_tokenizer_chat_template(tok, &t), LLMEM_OK);
    assert_int_equal(t, LLMEM_CHAT_MISTRAL);
    char *json = tu_read_file(LLMEM_TEST_DATA "/tok/tok-mistral-tools/render.json");
    cJSON *cases = cJSON_Parse(json);
    assert_non_null(cases);
    struct srv_model mistral = model;
    mistral.tool_format = LLMEM_TOOL_FORMAT_MISTRAL;
    const cJSON *c;
    cJSON_ArrayForEach(c, cases) {
        /* the calls' arguments as the JSON text OpenAI's clients send */
        cJSON *req = cJSON_CreateObject();
        cJSON *msgs = cJSON_Duplicate(cJSON_GetObjectItem(c, "messages"), 1), *m;
        cJSON_ArrayForEach(m, msgs) {
            const cJSON *call;
            cJSON_ArrayForEach(call, cJSON_GetObjectItem(m, "tool_calls")) {
                cJSON *f = cJSON_GetObjectItem(call, "function");
                char *args = cJSON_PrintUnformatted(cJSON_GetObjectItem(f, "arguments"));
                cJSON_ReplaceItemInObject(f, "arguments", cJSON_CreateString(args));
                free(args);
            }
        }
        cJSON_AddItemToObject(req, "messages", msgs);
        cJSON_AddItemToObject(req, "tools", cJSON_Duplicate(cJSON_GetObjectItem(c, "tools"), 1));
        char *body = cJSON_PrintUnformatted(req);
        struct srv_request r;
        struct srv_error e = {0};
        assert_int_equal(llmem_srv_request_parse(SRV_CHAT, body, strlen(body), &mistral, &r, &e),
                         0);
        char *text = NULL;
        assert_int_equal(llmem_chat_render(tok, t, r.messages, r.n_messages, 1, &text, NULL),
                         LLMEM_OK);
        assert_string_equal(text, cJSON_GetObjectItem(c, "rendered")->valuestring);
        free(text), free(body);
        cJSON_Delete(req);
        llmem_srv_request_free(&r);
    }
    cJSON_Delete(cases);
    free(json);

    /* an OpenAI-style id is cut to its last 9 characters; a tool message needs its call's id */
    static const char ids[] =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": "
        "\"assistant\", \"tool_calls\": [{\"id\": \"call_0123456789\", \"type\": "
        "\"function\", \"function\": {\"name\": \"f\", \"arguments\": \"{}\"}}]}, "
        "{\"role\": \"tool\", \"tool_call_id\": \"call_0123456789\", \"content\": \"1\"}]}";
    struct srv_request r;
    struct srv_error e = {0};
    assert_int_equal(llmem_srv_request_parse(SRV_CHAT, ids, strlen(ids), &mistral, &r, &e), 0);
    assert_true(content_is(&r, 1, "tool_calls",
                           "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}, \"id\": "
                           "\"123456789\"}]"));
    assert_true(content_is(&r, 2, "tool_results",
                           "[TOOL_RESULTS] {\"content\": 1, \"call_id\": "
                           "\"123456789\"}[/TOOL_RESULTS]"));
    llmem_srv_request_free(&r);
    static const char no_id[] =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"tool\", "
        "\"content\": \"1\"}]}";
    memset(&e, 0, sizeof(e));
    assert_int_equal(llmem_srv_request_parse(SRV_CHAT, no_id, strlen(no_id), &mistral, &r, &e), -1);
    assert_int_equal(e.http, 400);
    assert_string_equal(e.param, "messages");
    llmem_srv_request_free(&r);

    /* a forced call: its grammar takes [TOOL_CALLS] and the array; the answer read back */
    static const char forced[] =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": "
        "\"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": "
        "\"object\", \"properties\": {\"n\": {\"type\": \"integer\"}}, \"required\": "
        "[\"n\"]}}}], \"tool_choice\": \"required\"}";
    memset(&e, 0, sizeof(e));
    assert_int_equal(llmem_srv_request_parse(SRV_CHAT, forced, strlen(forced), &mistral, &r, &e),
                     0);
    assert_non_null(r.grammar);
    assert_string_equal(r.messages[0].role, "available_tools");
    llmem_srv_request_free(&r);
    struct srv_render rr = render(SRV_CHAT, -1);
    rr.tools = 1;
    rr.tool_format = LLMEM_TOOL_FORMAT_MISTRAL;
    const char *call = "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"n\": 3}}, "
                       "{\"name\": \"g\", \"arguments\": {}}]";
    const struct srv_choice ans = {call, strlen(call), NULL, 0, "stop"};
    cJSON *o = parsed(llmem_srv_render_response(&rr, &ans, 1, 10, 9));
    const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0);
    const cJSON *msg = cJSON_GetObjectItem(ch, "message");
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(msg, "content")));
    const cJSON *calls = cJSON_GetObjectItem(msg, "tool_calls");
    assert_int_equal(cJSON_GetArraySize(calls), 2);
    const cJSON *c0 = cJSON_GetArrayItem(calls, 0);
    assert_int_equal(strlen(cJSON_GetObjectItem(c0, "id")->valuestring), 9);
    const cJSON *f = cJSON_GetObjectItem(c0, "function");
    assert_string_equal(cJSON_GetObjectItem(f, "name")->valuestring, "f");
    assert_string_equal(cJSON_GetObjectItem(f, "arguments")->valuestring, "{\"n\":3}");
    assert_string_equal(cJSON_GetObjectItem(ch, "finish_reason")->valuestring, "tool_calls");
    cJSON_Delete(o);
    llmem_tokenizer_free(tok);
}

/* A tools answer streamed a byte at a time: content goes out as it comes (never a tail that may
 * begin <tool_call>), each Hermes-style call once its block closes; a Llama 3 call whole at the
 * end, other Llama 3 answers as content. */
static void test_tool_pieces(void **state) {
    (void)state;
    static const char hermes[] = "Let me <b>look</b>.\n<tool_call>\n{\"name\": \"a\", "
                                 "\"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": "
                                 "\"b\", \"arguments\": {\"x\": 1}}\n</tool_call>";
    static const struct {
        enum llmem_tool_format format;
        const char *text, *content;
        int calls, calls_at_end;
    } cases[] = {
        {LLMEM_TOOL_FORMAT_HERMES, hermes, "Let me <b>look</b>.", 2, 1}, /* (b closes last) */
        {LLMEM_TOOL_FORMAT_HERMES, "no calls <tool_c", "no calls <tool_c", 0, 0},
        {LLMEM_TOOL_FORMAT_LLAMA3, " {\"name\": \"a\", \"parameters\": {}}", "", 1, 1},
        {LLMEM_TOOL_FORMAT_LLAMA3, "Hello {x}", "Hello {x}", 0, 0},
        {LLMEM_TOOL_FORMAT_MISTRAL, "[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {}}]", "", 1,
         1},
        {LLMEM_TOOL_FORMAT_MISTRAL, "[TOOLS are [x]", "[TOOLS are [x]", 0, 0},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const char *t = cases[c].text;
        const size_t len = strlen(t);
        char content[256] = "";
        size_t from = 0, start, end;
        int calls = 0, calls_at_end = 0;
        for (size_t known = 1; known <= len; known++) {
            const int done = known == len;
            enum srv_piece p;
            while ((p = llmem_srv_tool_piece(cases[c].format, t, known, from, done, &start,
                                             &end)) != SRV_PIECE_NONE) {
                assert_true(start >= from && end > start && end <= known);
                from = start;
                if (p == SRV_PIECE_CONTENT) {
                    strncat(content, t + from, end - from);
                } else {
                    calls++, calls_at_end += done;
                    if (cases[c].format == LLMEM_TOOL_FORMAT_HERMES) /* one whole block */
                        assert_true(strncmp(t + from, "<tool_call>", 11) == 0 &&
                                    strncmp(t + end - 12, "</tool_call>", 12) == 0);
                }
                from = end;
            }
        }
        if (strcmp(content, cases[c].content) != 0 || calls != cases[c].calls ||
            calls_at_end != cases[c].calls_at_end)
            fail_msg("case %zu: content '%s', %d calls (%d at the end)", c, content, calls,
                     calls_at_end);
    }
}

static void test_render_chat(void **state) {
    (void)state;
    struct srv_token tok = {
        .id = 7, .logprob = -0.125f, .n_top = 1, .top_ids = {7}, .top_logprobs = {-0.125f}};
    struct srv_render r = render(SRV_CHAT, 1);
    r.id = "chatcmpl-1";
    const struct srv_choice hello = {"hello", 5, &tok, 1, "stop"};
    cJSON *o = parsed(llmem_srv_render_response(&r, &hello, 1, 10, 1));
    assert_string_equal(cJSON_GetObjectItem(o, "object")->valuestring, "chat.completion");
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0);
    const cJSON *m = cJSON_GetObjectItem(c, "message");
    assert_string_equal(cJSON_GetObjectItem(m, "role")->valuestring, "assistant");
    assert_string_equal(cJSON_GetObjectItem(m, "content")->valuestring, "hello");
    const cJSON *entry =
        cJSON_GetArrayItem(cJSON_GetObjectItem(cJSON_GetObjectItem(c, "logprobs"), "content"), 0);
    assert_string_equal(cJSON_GetObjectItem(entry, "token")->valuestring, "<7>");
    assert_true(cJSON_GetObjectItem(entry, "logprob")->valuedouble == -0.125);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(entry, "bytes")), 3);
    assert_int_equal(cJSON_GetArrayItem(cJSON_GetObjectItem(entry, "bytes"), 0)->valueint, '<');
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(entry, "top_logprobs")), 1);
    cJSON_Delete(o);

    /* a token that is a piece of a character: its text U+FFFD, its bytes its own */
    struct llmem_tokenizer *tk = NULL;
    assert_int_equal(llmem_tokenizer_load(LLMEM_SOURCE_DIR "/models/pycoder", &tk), LLMEM_OK);
    int32_t piece_id = -1;
    char b[16];
    size_t bn = 0;
    for (int32_t id = 0; id < llmem_tokenizer_vocab_size(tk) && piece_id < 0; id++)
        if (llmem_tokenizer_token_bytes(tk, id, b, sizeof(b), &bn) == LLMEM_OK && bn == 1 &&
            (unsigned char)b[0] >= 0xC2)
            piece_id = id;
    assert_true(piece_id >= 0);
    struct srv_token pt = {.id = piece_id, .logprob = -1.0f};
    struct srv_render rb = render(SRV_CHAT, 0);
    rb.piece = tok_piece, rb.bytes = tok_bytes, rb.piece_arg = tk;
    const struct srv_choice one = {"x", 1, &pt, 1, "stop"};
    o = parsed(llmem_srv_render_response(&rb, &one, 1, 10, 1));
    entry = cJSON_GetArrayItem(
        cJSON_GetObjectItem(
            cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0),
                                "logprobs"),
            "content"),
        0);
    assert_string_equal(cJSON_GetObjectItem(entry, "token")->valuestring, "\xef\xbf\xbd");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(entry, "bytes")), 1);
    assert_int_equal(cJSON_GetArrayItem(cJSON_GetObjectItem(entry, "bytes"), 0)->valueint,
                     (unsigned char)b[0]);
    cJSON_Delete(o);
    llmem_tokenizer_free(tk);

    /* chunks: the first carries the role, later ones only content, the last the reason */
    r.logprobs = -1;
    r.include_usage = 1;
    o = parsed(llmem_srv_render_chunk(&r, "", 0, NULL, 0, NULL, 1));
    assert_string_equal(cJSON_GetObjectItem(o, "object")->valuestring, "chat.completion.chunk");
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(o, "usage")));
    const cJSON *d =
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0), "delta");
    assert_string_equal(cJSON_GetObjectItem(d, "role")->valuestring, "assistant");
    assert_string_equal(cJSON_GetObjectItem(d, "content")->valuestring, "");
    cJSON_Delete(o);
    o = parsed(llmem_srv_render_chunk(&r, "lo", 2, NULL, 0, NULL, 0));
    d = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0), "delta");
    assert_null(cJSON_GetObjectItem(d, "role"));
    assert_string_equal(cJSON_GetObjectItem(d, "content")->valuestring, "lo");
    cJSON_Delete(o);
    o = parsed(llmem_srv_render_chunk(&r, "", 0, NULL, 0, "length", 0));
    c = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(c, "delta")), 0);
    assert_string_equal(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "length");
    cJSON_Delete(o);
    o = parsed(llmem_srv_render_usage_chunk(&r, 4, 6));
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(o, "choices")), 0);
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(o, "usage"), "total_tokens")->valueint,
                     10);
    cJSON_Delete(o);
}

static void test_render_error_and_models(void **state) {
    (void)state;
    struct srv_error e;
    assert_int_equal(llmem_srv_fail(&e, 507, "insufficient_memory", NULL, "insufficient_memory",
                                    "needs %d blocks", 12),
                     -1);
    cJSON *o = parsed(llmem_srv_error_json(&e));
    const cJSON *err = cJSON_GetObjectItem(o, "error");
    assert_string_equal(cJSON_GetObjectItem(err, "message")->valuestring, "needs 12 blocks");
    assert_string_equal(cJSON_GetObjectItem(err, "type")->valuestring, "insufficient_memory");
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(err, "param")));
    assert_string_equal(cJSON_GetObjectItem(err, "code")->valuestring, "insufficient_memory");
    assert_int_equal(cJSON_GetArraySize(err), 4);
    cJSON_Delete(o);

    o = parsed(llmem_srv_render_models(&model, 5));
    assert_string_equal(cJSON_GetObjectItem(o, "object")->valuestring, "list");
    const cJSON *m = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "data"), 0);
    assert_string_equal(cJSON_GetObjectItem(m, "id")->valuestring, "pycoder");
    assert_string_equal(cJSON_GetObjectItem(m, "object")->valuestring, "model");
    assert_int_equal(cJSON_GetObjectItem(m, "max_model_len")->valueint, 2048);
    cJSON_Delete(o);
}

/* ---- /metrics and /health -------------------------------------------------------------------- */

static void sample_metrics(struct llmem_engine_metrics *m) {
    memset(m, 0, sizeof(*m));
    static const double bounds[LLMEM_HIST_BUCKETS] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                      0.5,   1,    2.5,   5,    10,  30};
    memcpy(m->ttft.bounds, bounds, sizeof(bounds));
    memcpy(m->inter_token.bounds, bounds, sizeof(bounds));
    for (int i = 0; i < LLMEM_HIST_BUCKETS; i++)
        m->ttft.counts[i] = i >= 4 ? 3 : 0;
    m->ttft.count = 4; /* one above the last bound */
    m->ttft.sum = 40.5;
    m->mem_active = 100, m->mem_peak = 200, m->mem_cache = 7, m->mem_limit = 1000;
    m->kv_blocks_used = 11, m->kv_blocks_free = 21, m->bank.ram.bytes = 4096, m->bank.ram.hit_blocks = 3;
    m->bank.guard_warnings = 2, m->bank.guard_criticals = 1, m->guard_level = LLMEM_GUARD_WARNING;
    m->requests_ok = 5, m->requests_cancelled = 1, m->requests_refused = 2;
    m->prompt_tokens = 50, m->generated_tokens = 60, m->running = 1, m->waiting = 2;
    m->preemptions = 9;
    m->steps = 12, m->step_seconds = 0.75, m->forward_seconds = 0.5;
}

static void expect_line(const char *text, const char *line) {
    char needle[256];
    snprintf(needle, sizeof(needle), "\n%s\n", line);
    if (strstr(text, needle) == NULL)
        fail_msg("no line '%s' in:\n%s", line, text);
}

static void test_metrics(void **state) {
    (void)state;
    struct llmem_engine_metrics m;
    sample_metrics(&m);
    struct srv_counters c = {.rejected = 4, .invalid = 6, .disconnected = 1};
    char *text = llmem_srv_render_metrics(&m, &c);
    assert_non_null(text);
    expect_line(text, "llmem_mem_active_bytes 100");
    expect_line(text, "llmem_mem_peak_bytes 200");
    expect_line(text, "llmem_mem_cache_bytes 7");
    expect_line(text, "llmem_mem_limit_bytes 1000");
    expect_line(text, "llmem_kv_blocks_used 11");
    expect_line(text, "llmem_kv_blocks_free 21");
    expect_line(text, "llmem_bank_bytes 4096");
    expect_line(text, "llmem_bank_hits_total 3");
    expect_line(text, "llmem_guard_actions_total{level=\"warning\"} 2");
    expect_line(text, "llmem_guard_actions_total{level=\"critical\"} 1");
    expect_line(text, "llmem_guard_level 1");
    expect_line(text, "llmem_requests_total{outcome=\"ok\"} 5");
    expect_line(text, "llmem_requests_total{outcome=\"refused\"} 2");
    expect_line(text, "llmem_requests_total{outcome=\"rejected\"} 4");
    expect_line(text, "llmem_requests_total{outcome=\"invalid\"} 6");
    expect_line(text, "llmem_prompt_tokens_total 50");
    expect_line(text, "llmem_generation_tokens_total 60");
    expect_line(text, "llmem_requests_running 1");
    expect_line(text, "llmem_requests_waiting 2");
    expect_line(text, "llmem_preemptions_total 9");
    expect_line(text, "llmem_scheduler_steps_total 12");
    expect_line(text, "llmem_scheduler_step_seconds_total 0.75");
    expect_line(text, "llmem_forward_seconds_total 0.5");
    expect_line(text, "# TYPE llmem_ttft_seconds histogram");
    expect_line(text, "llmem_ttft_seconds_bucket{le=\"0.05\"} 0");
    expect_line(text, "llmem_ttft_seconds_bucket{le=\"0.1\"} 3");
    expect_line(text, "llmem_ttft_seconds_bucket{le=\"30\"} 3");
    expect_line(text, "llmem_ttft_seconds_bucket{le=\"+Inf\"} 4");
    expect_line(text, "llmem_ttft_seconds_sum 40.5");
    expect_line(text, "llmem_ttft_seconds_count 4");
    expect_line(text, "# TYPE llmem_requests_total counter");
    expect_line(text, "# TYPE llmem_mem_active_bytes gauge");
    /* the exposition format: every line is a comment or "llmem_name[{labels}] value" */
    for (const char *p = text; *p;) {
        const char *end = strchr(p, '\n');
        assert_non_null(end);
        if (*p != '#') {
            assert_true(strncmp(p, "llmem_", 6) == 0);
            const char *sp = memchr(p, ' ', (size_t)(end - p));
            assert_non_null(sp);
            char *num_end = NULL;
            strtod(sp + 1, &num_end);
            assert_true(num_end == end);
        }
        p = end + 1;
    }
    free(text);
}

static void test_health(void **state) {
    (void)state;
    struct llmem_plan_params pp = {.target = LLMEM_PLAN_HOST,
                                   .total_bytes = (int64_t)48 << 30,
                                   .weights_bytes = 21313949792,
                                   .kv_bytes_per_token = 65536,
                                   .model_max_context = 262144,
                                   .util = 0.5};
    struct llmem_plan plan;
    assert_int_equal(llmem_plan_compute(&pp, &plan), 0);
    struct llmem_mem_stats st = {0};
    st.active_bytes = 10, st.peak_bytes = 20, st.cache_bytes = 5;
    st.memory_limit_bytes = plan.allocation_limit_bytes, st.cache_limit_bytes = 99;
    struct llmem_engine_metrics m;
    sample_metrics(&m);
    m.refusing = 1;
    struct srv_counters c = {0};
    struct srv_health h = {.model = "big",
                           .plan = &plan,
                           .limits_line = "memory limit 24.0G",
                           .mem = &st,
                           .kv_format = "q8",
                           .kv_layout = "paged",
                           .chat_template = "chatml"};
    cJSON *o = parsed(llmem_srv_render_health(&h, &m, &c));
    assert_string_equal(cJSON_GetObjectItem(o, "status")->valuestring, "refusing");
    const cJSON *lim = cJSON_GetObjectItem(o, "limits");
    assert_true(cJSON_GetObjectItem(lim, "allocation_limit_bytes")->valuedouble ==
                (double)plan.allocation_limit_bytes);
    assert_true(cJSON_GetObjectItem(lim, "trip_bytes")->valuedouble == (double)plan.trip_bytes);
    assert_true(cJSON_GetObjectItem(lim, "ceiling_bytes")->valuedouble ==
                (double)((int64_t)48 << 30));
    assert_string_equal(cJSON_GetObjectItem(lim, "applied")->valuestring, "memory limit 24.0G");
    assert_true(cJSON_GetObjectItem(cJSON_GetObjectItem(o, "plan"), "context_window_resolved")
                    ->valuedouble == (double)plan.context_window_resolved);
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(o, "memory"), "cache_bytes")->valueint,
                     5);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(o, "kv"), "format")->valuestring,
                        "q8");
    const cJSON *g = cJSON_GetObjectItem(o, "guard");
    assert_string_equal(cJSON_GetObjectItem(g, "state")->valuestring, "warning");
    assert_int_equal(cJSON_GetObjectItem(g, "criticals")->valueint, 1);
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(g, "refusing")));
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(o, "bank"), "hit_blocks")->valueint,
                     3);
    assert_int_equal(
        cJSON_GetObjectItem(cJSON_GetObjectItem(o, "requests"), "preemptions")->valueint, 9);
    cJSON_Delete(o);
}

/* Buffers: growth across many appends, printf. */
/* The server's configuration: a Bearer key is one word of printable characters. */
static void test_config_api_key(void **state) {
    (void)state;
    struct llmem_server_config c;
    llmem_server_config_default(&c);
    c.model_name = "m";
    c.port = 0;
    const char *bad[] = {" ", "   ", "two words", "tab\tkey", "new\nline", "del\x7f"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        c.api_key = bad[i];
        tu_count_errors(LLMEM_LOG_ERROR);
        assert_int_equal(llmem_server_config_check(&c), LLMEM_EINVAL);
        assert_non_null(strstr(llmem_last_error(), "API key"));
        tu_count_errors_stop();
    }
    c.api_key = "s3cret-K3y_!";
    assert_int_equal(llmem_server_config_check(&c), LLMEM_OK);
    c.api_key = "";
    assert_int_equal(llmem_server_config_check(&c), LLMEM_OK); /* none, on loopback */
    /* negative sizes and an unknown template are refused, not read as the defaults */
    for (int k = 0; k < 4; k++) {
        struct llmem_server_config d = c;
        if (k == 0)
            d.max_queue = -5;
        else if (k == 1)
            d.max_body_bytes = -1;
        else if (k == 2)
            d.body_timeout_s = -1;
        else
            d.chat_template = (enum llmem_chat_template)42;
        tu_count_errors(LLMEM_LOG_ERROR);
        assert_int_equal(llmem_server_config_check(&d), LLMEM_EINVAL);
        tu_count_errors_stop();
    }
}

static void test_buf(void **state) {
    (void)state;
    struct srv_buf b = {0};
    for (int i = 0; i < 1000; i++)
        llmem_srv_buf_printf(&b, "%d,", i);
    assert_false(b.failed);
    assert_int_equal(strncmp(b.data, "0,1,2,", 6), 0);
    assert_int_equal(b.data[b.len], '\0');
    assert_non_null(strstr(b.data, ",999,"));
    llmem_srv_buf_free(&b);
    assert_null(b.data);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_utf8),
        cmocka_unit_test(test_parse_completion),
        cmocka_unit_test(test_parse_chat),
        cmocka_unit_test(test_parse_errors),
        cmocka_unit_test(test_parse_nul),
        cmocka_unit_test(test_check_prompt),
        cmocka_unit_test(test_render_completion),
        cmocka_unit_test(test_render_chat),
        cmocka_unit_test(test_render_error_and_models),
        cmocka_unit_test(test_tool_conventions),
        cmocka_unit_test(test_tool_convention_mistral),
        cmocka_unit_test(test_tool_pieces),
        cmocka_unit_test(test_metrics),
        cmocka_unit_test(test_health),
        cmocka_unit_test(test_buf),
        cmocka_unit_test(test_config_api_key),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
