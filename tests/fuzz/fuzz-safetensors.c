/*
 * tests/fuzz/fuzz-safetensors.c — libFuzzer target for model/: the safetensors header parser,
 * config.json → geometry, and the shard index, on arbitrary bytes. The first input byte picks
 * which file the rest of the input becomes. Any crash, sanitizer report, leak or hang is a bug;
 * a clean status with one error line is the expected outcome for garbage.
 *
 * Built as a libFuzzer program with -DLLMEM_FUZZ=ON (`make fuzz`, or by hand from the repository
 * root:
 *   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DLLMEM_FUZZ=ON -DLLMEM_CUDA=OFF
 *   cmake --build build-fuzz --target fuzz-safetensors
 *   cp -r tests/fuzz/corpus/fuzz-safetensors /tmp/corpus
 *   ./build-fuzz/tests/fuzz-safetensors -max_len=8192 -max_total_time=60 /tmp/corpus
 * ), and in every build as a replay of tests/fuzz/corpus/fuzz-safetensors (ctest fuzz-safetensors).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "llmem/model.h"
#include "llmem/config.h"
#include "llmem/safetensors.h"

static char dir[256];

static void write_file(const char *name, const uint8_t *data, size_t size) {
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (f == NULL)
        abort();
    if (size > 0 && fwrite(data, 1, size, f) != size)
        abort();
    fclose(f);
}

static void remove_file(const char *name) {
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    unlink(path);
}

/* A valid one-tensor shard, for the index mode. */
static void write_shard(const char *name, const char *tensor) {
    char header[256];
    int n = snprintf(header, sizeof(header),
                     "{\"%s\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}",
                     tensor);
    uint8_t buf[512] = {(uint8_t)n};
    memcpy(buf + 8, header, (size_t)n);
    write_file(name, buf, 8 + (size_t)n + 8);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (dir[0] == '\0') {
        snprintf(dir, sizeof(dir), "/tmp/llmem-fuzz-XXXXXX");
        if (mkdtemp(dir) == NULL)
            abort();
        write_shard("a.safetensors", "x");
        write_shard("b.safetensors", "y");
    }
    if (size < 1)
        return 0;
    int mode = data[0] % 3;
    data++, size--;

    if (mode == 0) {
        write_file("model.safetensors", data, size);
        char path[512];
        snprintf(path, sizeof(path), "%s/model.safetensors", dir);
        struct llmem_safetensors *st = NULL;
        if (llmem_safetensors_load(path, &st) == 0) {
            for (int i = 0; i < st->n_tensors; i++) {
                const struct llmem_st_tensor *t = &st->tensors[i];
                if (t->offset_end > st->files[0].file_bytes - st->files[0].data_offset ||
                    t->offset_end - t->offset_begin != t->n_bytes ||
                    llmem_safetensors_find(st, t->name) != t)
                    abort();
            }
        }
        llmem_safetensors_free(st);
        remove_file("model.safetensors");
    } else if (mode == 1) {
        write_file("config.json", data, size);
        struct llmem_model_geometry g;
        if (llmem_model_geometry_load_config(dir, &g) == 0 &&
            (g.n_layers <= 0 || g.head_dim <= 0 || g.n_heads % g.n_kv_heads != 0))
            abort();
    } else {
        write_file("model.safetensors.index.json", data, size);
        struct llmem_safetensors *st = NULL;
        llmem_safetensors_load_dir(dir, &st);
        llmem_safetensors_free(st);
    }
    return 0;
}
