/*
 * tests/fuzz/fuzz-schema.c — libFuzzer target for engine/grammar.c: a JSON Schema compiled into a
 * grammar (llmem_grammar_compile, as the server does for response_format) on arbitrary bytes, and
 * where it compiles, the matcher moved over the same bytes. Any crash, sanitizer report, leak or
 * hang is a bug; a refusal with its one line is the expected outcome for garbage.
 *
 * Built as a libFuzzer program with -DLLMEM_FUZZ=ON (`make fuzz`), and in every build as a replay
 * of tests/fuzz/corpus/fuzz-schema (ctest fuzz-schema).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "llmem/grammar.h"
#include "llmem/status.h"
#include "llmem/tokenizer.h"

static struct llmem_grammar_vocab *vocab;

static void quiet(enum llmem_log_level level, const char *line, void *user) {
    (void)level, (void)line, (void)user;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    llmem_log_set_callback(quiet, NULL, LLMEM_LOG_ERROR);
    struct llmem_tokenizer *tok = NULL;
    if (llmem_tokenizer_load(LLMEM_FUZZ_DATA "/models/tiny-qwen3", &tok) != LLMEM_OK ||
        llmem_grammar_vocab_create(tok, &vocab) != LLMEM_OK)
        abort();
    llmem_tokenizer_free(tok);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char why[256];
    struct llmem_grammar *g = NULL;
    if (llmem_grammar_compile((const char *)data, size, why, sizeof(why), &g) != LLMEM_OK) {
        if (why[0] == '\0')
            abort(); /* a refusal always says why */
        return 0;
    }
    struct llmem_grammar_state *s = NULL;
    uint8_t *allowed = malloc((size_t)llmem_grammar_vocab_size(vocab));
    if (allowed == NULL || llmem_grammar_state_create(g, vocab, &s) != LLMEM_OK)
        abort();
    (void)llmem_grammar_accept_bytes(s, (const char *)data, size < 64 ? size : 64);
    (void)llmem_grammar_allowed(s, 4, allowed);
    llmem_grammar_state_free(s);
    free(allowed);
    llmem_grammar_free(g);
    return 0;
}
