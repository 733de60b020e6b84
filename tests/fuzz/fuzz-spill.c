/*
 * tests/fuzz/fuzz-spill.c — libFuzzer target for bank/spill_file.c: a chunk file of the spill
 * store as the store reads it back (llmem_spill_load_file: the header decoded and checked against
 * itself and the file's size, the whole file read and its checksum verified; then
 * llmem_spill_read_tokens) on arbitrary bytes. The input is the file as it is; then, when it is
 * long enough to hold a header, the same file once more with its checksum made to agree, so that
 * what lies past the checksum is reached too. Any crash, sanitizer report, leak or hang is a bug;
 * a refusal with a reason is the expected outcome for garbage.
 *
 * Built as a libFuzzer program with -DLLMEM_FUZZ=ON (`make fuzz`), and in every build as a replay
 * of tests/fuzz/corpus/fuzz-spill (ctest fuzz-spill).
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bank/spill_int.h"
#include "core/hash.h"

static char dir[256];
static struct llmem_spill store; /* only the directory: no manifest, no writer, malloc buffers */
static const uint8_t key[32] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    snprintf(dir, sizeof(dir), "/tmp/llmem-fuzz-spill-XXXXXX");
    if (mkdtemp(dir) == NULL)
        abort();
    store.dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (store.dir_fd < 0)
        abort();
    return 0;
}

static void check(const uint8_t *data, size_t size, const char *name, const char *path) {
    FILE *f = fopen(path, "wb");
    if (f == NULL)
        abort();
    if (size > 0 && fwrite(data, 1, size, f) != size)
        abort();
    fclose(f);

    struct header h;
    uint8_t *buf = NULL;
    int64_t bytes = 0;
    char why[256] = "";
    enum reason r = llmem_spill_load_file(&store, name, &h, &buf, &bytes, why, sizeof(why));
    if (r == CHUNK_OK) {
        if (buf == NULL || bytes != (int64_t)size ||
            bytes != (int64_t)h.header_tokens_bytes + h.payload_bytes || h.n_tokens < 1 ||
            h.n_blocks > LLMEM_SPILL_CHUNK_BLOCKS || memcmp(buf, data, size) != 0)
            abort();
        int32_t tokens[64];
        int64_t n = llmem_spill_read_tokens(&store, key, tokens, 64);
        if (n != (h.n_tokens < 64 ? h.n_tokens : 64) ||
            memcmp(tokens, data + HEADER_BYTES, (size_t)n * 4) != 0)
            abort();
    } else if (buf != NULL || why[0] == '\0') {
        abort();
    }
    free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char name[NAME_LEN + 1], path[512];
    llmem_spill_chunk_name(key, name);
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    check(data, size, name, path);
    if (size >= HEADER_BYTES) {
        uint8_t *fixed = malloc(size);
        if (fixed == NULL)
            abort();
        memcpy(fixed, data, size);
        memset(fixed + OFF_CHECKSUM, 0, 16);
        uint8_t sum[16];
        llmem_digest(fixed, size, sum);
        memcpy(fixed + OFF_CHECKSUM, sum, 16);
        if (memcmp(fixed, data, size) != 0)
            check(fixed, size, name, path);
        free(fixed);
    }
    unlink(path);
    return 0;
}
