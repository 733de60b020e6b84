/*
 * tests/fuzz/fuzz-tokenizer.c — libFuzzer target for the tokenizer loaders, the files a user's
 * model brings: a model directory's tokenizer.json and tokenizer_config.json (tok/load.c), and a
 * GGUF file's tokenizer.ggml.* metadata (tok/gguf_load.c). The first byte picks the input (% 3):
 * 0 the rest is tokenizer.json; 1 tokenizer.json, a NUL, then tokenizer_config.json; 2 a GGUF
 * file. The files are written into a directory of the process's own and loaded as `llmem run`
 * loads them. A tokenizer that loads is then used: every token's bytes (the first 4096), a few
 * texts encoded and decoded, their ids decoded again as a stream (the pieces must add up to the
 * whole decode), the chat template's family and a rendering with it. A crash, a sanitizer report,
 * a leak, a hang or a stream that disagrees with the whole decode is a bug; a refusal with a
 * message is the expected outcome for garbage.
 *
 * Built as a libFuzzer program with -DLLMEM_FUZZ=ON (`make fuzz`, or by hand from the repository
 * root:
 *   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DLLMEM_FUZZ=ON -DLLMEM_CUDA=OFF
 *   cmake --build build-fuzz --target fuzz-tokenizer
 *   cp -r tests/fuzz/corpus/fuzz-tokenizer /tmp/corpus
 *   ./build-fuzz/tests/fuzz-tokenizer -max_len=8192 -max_total_time=60 /tmp/corpus
 * ), and in every build as a replay of tests/fuzz/corpus/fuzz-tokenizer (ctest fuzz-tokenizer).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_stream.h"
#include "llmem/tokenizer.h"

static char dir[256], tok_json[300], tok_config[300], gguf[300];

static void quiet(enum llmem_log_level level, const char *line, void *user) {
    (void)level, (void)line, (void)user;
}

static void cleanup(void) {
    unlink(tok_json), unlink(tok_config), unlink(gguf);
    rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    llmem_log_set_callback(quiet, NULL, LLMEM_LOG_ERROR);
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof(dir), "%s/llmem-fuzz-tokenizer-XXXXXX", tmp != NULL ? tmp : "/tmp");
    if (mkdtemp(dir) == NULL)
        abort();
    snprintf(tok_json, sizeof(tok_json), "%s/tokenizer.json", dir);
    snprintf(tok_config, sizeof(tok_config), "%s/tokenizer_config.json", dir);
    snprintf(gguf, sizeof(gguf), "%s/model.gguf", dir);
    atexit(cleanup);
    return 0;
}

static void put(const char *path, const uint8_t *data, size_t size) {
    FILE *f = fopen(path, "wb");
    if (f == NULL || (size > 0 && fwrite(data, 1, size, f) != size) || fclose(f) != 0)
        abort();
}

static void use(const struct llmem_tokenizer *tok) {
    const int32_t vocab = llmem_tokenizer_vocab_size(tok);
    char buf[256];
    for (int32_t id = 0; id < vocab && id < 4096; id++) {
        size_t len = 0;
        const int st = llmem_tokenizer_token_bytes(tok, id, buf, sizeof(buf), &len);
        if (st != LLMEM_OK && st != LLMEM_ERANGE &&
            st != LLMEM_EINVAL) /* (EINVAL: an id no token has) */
            abort();
        (void)llmem_tokenizer_is_special(tok, id);
    }
    const int32_t bos = llmem_tokenizer_bos(tok), eos = llmem_tokenizer_eos(tok);
    if (bos >= vocab || eos >= vocab)
        abort();
    static const char *const texts[] = {"Hello, world!", " def f(x):\n\treturn x  ",
                                        "h\xc3\xa9llo \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x99\x82",
                                        "<|im_start|>user\nhi<|im_end|>", ""};
    for (size_t t = 0; t < sizeof(texts) / sizeof(texts[0]); t++) {
        int32_t *ids = NULL;
        int64_t n = 0;
        if (llmem_tokenizer_encode(tok, texts[t], strlen(texts[t]), &ids, &n) != LLMEM_OK)
            continue; /* (a tokenizer may have no way to spell a character) */
        char *text = NULL;
        size_t len = 0;
        if (llmem_tokenizer_decode(tok, ids, n, 0, &text, &len) != LLMEM_OK)
            abort(); /* its own ids */
        check_stream(tok, ids, n, text, len);
        free(text);
        free(ids);
    }
    enum llmem_chat_template family;
    if (llmem_tokenizer_chat_template(tok, &family) == LLMEM_OK && family != LLMEM_CHAT_NONE) {
        const struct llmem_chat_message m[] = {{"system", "Be brief.", 0}, {"user", "Hi", 0}};
        char *text = NULL;
        if (llmem_chat_render(tok, family, m, 2, 1, &text, NULL) == LLMEM_OK)
            free(text);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1)
        return 0;
    const int mode = data[0] % 3;
    data++, size--;
    unlink(tok_json), unlink(tok_config), unlink(gguf);
    const char *load = dir;
    if (mode == 2) {
        put(gguf, data, size);
        load = gguf;
    } else {
        const uint8_t *nul = mode == 1 ? memchr(data, '\0', size) : NULL;
        const size_t first = nul != NULL ? (size_t)(nul - data) : size;
        put(tok_json, data, first);
        if (nul != NULL)
            put(tok_config, nul + 1, size - first - 1);
    }
    struct llmem_tokenizer *tok = NULL;
    if (llmem_tokenizer_load(load, &tok) == LLMEM_OK) {
        use(tok);
        llmem_tokenizer_free(tok);
    }
    return 0;
}
