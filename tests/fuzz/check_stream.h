/*
 * tests/fuzz/check_stream.h — what the tokenizer fuzz targets (fuzz-tok, fuzz-tokenizer) check of
 * a streamed decode: the pieces of ids fed one at a time, the finish included, add up to the
 * whole decode of the same ids (full, full_len). Aborts otherwise (a decode holding a NUL is not
 * compared: the pieces are NUL-terminated strings).
 */
#ifndef LLMEM_FUZZ_CHECK_STREAM_H
#define LLMEM_FUZZ_CHECK_STREAM_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "llmem/tokenizer.h"

static void check_stream(const struct llmem_tokenizer *tok, const int32_t *ids, int64_t n,
                         const char *full, size_t full_len) {
    struct llmem_detok *d = NULL;
    if (llmem_detok_create(tok, 0, &d) != LLMEM_OK)
        abort();
    size_t at = 0;
    for (int64_t i = 0; i <= n; i++) {
        char *piece = NULL;
        int st = i < n ? llmem_detok_push(d, ids[i], &piece) : llmem_detok_finish(d, &piece);
        if (st != LLMEM_OK)
            abort();
        size_t pn = strlen(piece);
        if (memchr(full, '\0', full_len) == NULL &&
            (at + pn > full_len || memcmp(full + at, piece, pn) != 0))
            abort();
        at += pn;
        free(piece);
    }
    llmem_detok_free(d);
}

#endif
