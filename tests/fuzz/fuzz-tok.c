/*
 * tests/fuzz/fuzz-tok.c — libFuzzer target for tok/: encode and decode on arbitrary bytes with the
 * reference tokenizers of tests/data (models/ and tok/). The first input byte picks the tokenizer
 * and the mode: encode the rest as text (invalid UTF-8 must be refused cleanly; valid text that the
 * tokenizer inverts must come back from decode unchanged, and encoding it in batches of a few
 * bytes must give the same ids), or read it as ids to decode and stream
 * (the stream must add up to the full decode). Any crash, sanitizer report, leak or hang is a bug.
 *
 * Built as a libFuzzer program with -DLLMEM_FUZZ=ON (`make fuzz`, or by hand from the repository
 * root:
 *   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DLLMEM_FUZZ=ON -DLLMEM_CUDA=OFF
 *   cmake --build build-fuzz --target fuzz-tok
 *   cp -r tests/fuzz/corpus/fuzz-tok /tmp/corpus
 *   ./build-fuzz/tests/fuzz-tok -max_len=4096 -max_total_time=60 /tmp/corpus
 * ), and in every build as a replay of tests/fuzz/corpus/fuzz-tok (ctest fuzz-tok).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_stream.h"
#include "llmem/tokenizer.h"
#include "tok/tok_int.h"

#ifndef LLMEM_FUZZ_DATA
#define LLMEM_FUZZ_DATA "tests/data"
#endif

static const char *const names[] = {"models/tiny-qwen2", "models/tiny-mistral-swa", "tok/tok-gpt2",
                                    "tok/tok-metaspace-split", "tok/tok-nfc"};
#define N_NAMES 5
static const int inverts[N_NAMES] = {1, 1, 1, 0, 0};
static struct llmem_tokenizer *toks[N_NAMES];

static void quiet(enum llmem_log_level level, const char *line, void *user) {
    (void)level, (void)line, (void)user;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    llmem_log_set_callback(quiet, NULL, LLMEM_LOG_ERROR);
    for (int i = 0; i < N_NAMES; i++) {
        char dir[512];
        snprintf(dir, sizeof(dir), "%s/%s", LLMEM_FUZZ_DATA, names[i]);
        if (llmem_tokenizer_load(dir, &toks[i]) != LLMEM_OK)
            abort();
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1)
        return 0;
    int which = data[0] % N_NAMES, decode_mode = (data[0] / N_NAMES) % 2;
    const struct llmem_tokenizer *tok = toks[which];
    data++, size--;
    if (!decode_mode) {
        int32_t *ids = NULL;
        int64_t n = 0;
        if (llmem_tokenizer_encode(tok, (const char *)data, size, &ids, &n) != LLMEM_OK)
            return 0;
        /* in batches of a few bytes of the first step's pieces: the same ids */
        const size_t batch = llmem_tok_encode_batch;
        llmem_tok_encode_batch = 1 + size % 13;
        int32_t *again = NULL;
        int64_t n_again = 0;
        if (llmem_tokenizer_encode(tok, (const char *)data, size, &again, &n_again) != LLMEM_OK ||
            n_again != n || memcmp(again, ids, (size_t)n * sizeof(*ids)) != 0)
            abort();
        llmem_tok_encode_batch = batch;
        free(again);
        char *text = NULL;
        size_t len = 0;
        if (llmem_tokenizer_decode(tok, ids, n, 0, &text, &len) != LLMEM_OK)
            abort();
        /* Mistral's decoder turns a typed "▁" into a space and a typed "<0x41>" (an added token)
         * into its byte, and its Prepend normalizer adds "▁" after each added token, as in
         * `tokenizers`: such text does not come back. */
        int typed = memmem(data, size, "\xE2\x96\x81", 3) != NULL || memmem(data, size, "<0x", 3);
        for (int64_t i = 0; i < n && !typed; i++)
            typed = llmem_tokenizer_is_special(tok, ids[i]);
        if (inverts[which] && !(which == 1 && typed) &&
            (len != size || memcmp(text, data, size) != 0))
            abort();
        free(text);
        free(ids);
        return 0;
    }
    int64_t n = (int64_t)(size / 2);
    int32_t *ids = malloc((size_t)(n + 1) * sizeof(*ids));
    if (ids == NULL)
        abort();
    int32_t vocab = llmem_tokenizer_vocab_size(tok);
    for (int64_t i = 0; i < n; i++)
        ids[i] = (int32_t)((data[2 * i] | data[2 * i + 1] << 8) % (vocab + 1)) - (i == 0 ? 1 : 0);
    char *text = NULL;
    size_t len = 0;
    if (llmem_tokenizer_decode(tok, ids, n, 0, &text, &len) == LLMEM_OK) {
        check_stream(tok, ids, n, text, len);
        free(text);
    }
    free(ids);
    return 0;
}
