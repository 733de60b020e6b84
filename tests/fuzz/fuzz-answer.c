/*
 * tests/fuzz/fuzz-answer.c — libFuzzer target for server/openai.c's reading of a model's answer,
 * whose bytes a user steers through the prompt: the tool calls in it (tool_calls, through
 * llmem_srv_render_response) and the stream's split of it into content and calls as it comes
 * (llmem_srv_tool_piece, each piece through llmem_srv_render_chunk). The first input byte picks
 * the tool format (% 3) and how many bytes come at a time (/ 3 % 8 + 1); the rest is the answer
 * (UTF-8 without NUL, as the server's decode hands it on; other inputs are skipped). Any crash,
 * sanitizer report, leak or hang is a bug, and so is a response that is not JSON, a call of an
 * undeclared function, or a stream whose pieces do not tile the answer.
 *
 * Built as a libFuzzer program with -DLLMEM_FUZZ=ON (`make fuzz`), and in every build as a replay
 * of tests/fuzz/corpus/fuzz-answer (ctest fuzz-answer).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "server/server_int.h"

static const char *const tools[] = {"get_weather", "a"};

/* out parses as JSON (else abort), and each tool call in its choice names a declared tool;
 * returns the calls. */
static int check(char *out) {
    if (out == NULL)
        abort(); /* (no allocation fails here) */
    cJSON *o = cJSON_Parse(out);
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(o, "choices"), 0);
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(c, "message");
    if (m == NULL)
        m = cJSON_GetObjectItemCaseSensitive(c, "delta");
    if (o == NULL || m == NULL || !llmem_srv_utf8_valid(out, strlen(out)))
        abort();
    const cJSON *call;
    int n = 0;
    cJSON_ArrayForEach(call, cJSON_GetObjectItemCaseSensitive(m, "tool_calls")) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(call, "function");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(f, "name");
        if (!cJSON_IsString(name) ||
            !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(f, "arguments")))
            abort();
        int declared = 0;
        for (size_t i = 0; i < sizeof(tools) / sizeof(tools[0]); i++)
            declared |= strcmp(name->valuestring, tools[i]) == 0;
        if (!declared)
            abort();
        n++;
    }
    cJSON_Delete(o);
    free(out);
    return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1)
        return 0;
    const enum llmem_tool_format format = (enum llmem_tool_format)(data[0] % 3);
    const size_t step = (size_t)(data[0] / 3 % 8) + 1;
    const char *text = (const char *)data + 1;
    const size_t len = size - 1;
    if (!llmem_srv_utf8_valid(text, len) || memchr(text, '\0', len) != NULL)
        return 0;
    struct srv_render r = {.kind = SRV_CHAT,
                           .id = "chatcmpl-fuzz",
                           .model = "pycoder",
                           .logprobs = -1,
                           .tools = 1,
                           .tool_names = tools,
                           .n_tools = 2,
                           .tool_format = format,
                           .call_seed = 1};
    const struct srv_choice choice = {text, len, NULL, 0, "stop"};
    check(llmem_srv_render_response(&r, &choice, 1, 1, 1));

    /* the stream: the answer known `step` bytes more at a time (whole characters, as the
     * server's streamed decode hands them on), every piece out as it may go */
    r.called = 0, r.n_calls = 0;
    size_t from = 0;
    for (size_t known = 0;;) {
        known = known + step < len ? known + step : len;
        while (known < len && ((uint8_t)text[known] & 0xc0) == 0x80)
            known++;
        const int done = known == len;
        size_t start, end;
        enum srv_piece p;
        while ((p = llmem_srv_tool_piece(format, text, known, from, done, &start, &end)) !=
               SRV_PIECE_NONE) {
            if (start < from || end <= start || end > known)
                abort();
            for (size_t i = from; i < start; i++) /* (skipped: whitespace before a call) */
                if (text[i] != ' ' && text[i] != '\n')
                    abort();
            r.tools = p == SRV_PIECE_CALLS;
            check(llmem_srv_render_chunk(&r, text + start, end - start, NULL, 0, NULL, from == 0));
            from = end;
        }
        if (done)
            break;
    }
    if (from != len) { /* what is left at the end: whitespace alone */
        for (size_t i = from; i < len; i++)
            if (text[i] != ' ' && text[i] != '\n')
                abort();
    }
    return 0;
}
