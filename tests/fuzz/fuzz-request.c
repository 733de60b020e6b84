/*
 * tests/fuzz/fuzz-request.c — libFuzzer target for server/openai.c: the body of a POST to
 * /v1/completions or /v1/chat/completions (llmem_srv_request_parse: UTF-8, JSON, every field's
 * type and range, the chat messages and their content parts) on arbitrary bytes. The first input
 * byte picks the endpoint, the rest is the body. Any crash, sanitizer report, leak or hang is a
 * bug; a 4xx with a message is the expected outcome for garbage, and its error document must
 * render.
 *
 * Built as a libFuzzer program with -DLLMEM_FUZZ=ON (`make fuzz`), and in every build as a replay
 * of tests/fuzz/corpus/fuzz-request (ctest fuzz-request).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1)
        return 0;
    enum srv_kind kind = data[0] % 2 ? SRV_CHAT : SRV_COMPLETIONS;
    data++, size--;
    /* The body as the server hands it on: its own copy, exactly len bytes (no terminator). */
    char *body = malloc(size > 0 ? size : 1);
    if (body == NULL)
        abort();
    memcpy(body, data, size);
    const struct srv_model model = {.name = "pycoder", .vocab = 4096, .context = 2048};
    struct srv_request req;
    struct srv_error err;
    memset(&err, 0, sizeof(err));
    if (llmem_srv_request_parse(kind, body, size, &model, &req, &err) == 0) {
        if (req.kind != kind || req.n_stop < 0 || req.n_stop > SRV_MAX_STOP || req.logprobs < -1 ||
            req.logprobs > LLMEM_MAX_TOP_LOGPROBS || req.max_tokens < 0)
            abort();
        if (kind == SRV_COMPLETIONS) {
            if ((req.prompt_text == NULL) == (req.prompt_ids == NULL && req.n_prompt_ids == 0))
                abort();
            for (int64_t i = 0; i < req.n_prompt_ids; i++)
                if (req.prompt_ids[i] < 0 || req.prompt_ids[i] >= model.vocab)
                    abort();
        } else {
            if (req.n_messages < 1 || req.n_messages > SRV_MAX_MESSAGES)
                abort();
            for (int i = 0; i < req.n_messages; i++)
                if (req.messages[i].role == NULL || req.messages[i].content == NULL)
                    abort();
        }
        for (int i = 0; i < req.n_stop; i++)
            if (req.stop[i] == NULL)
                abort();
        llmem_srv_check_prompt(kind, req.n_prompt_ids, req.max_tokens, &model, &err);
    } else {
        if (err.http < 400 || err.http > 599 || err.type == NULL || err.message[0] == '\0')
            abort();
        free(llmem_srv_error_json(&err));
    }
    llmem_srv_request_free(&req);
    free(body);
    return 0;
}
