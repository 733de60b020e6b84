/*
 * tests/fuzz/fuzz-gguf.c — libFuzzer target for model/gguf.c and model/gguf_config.c: the input
 * is a whole GGUF file, parsed from memory (llmem_gguf_parse: no disk), then every key read
 * through its typed getter and every array element through its accessor, every tensor looked up
 * by name, and the geometry and the full configuration derived from it. Any crash, sanitizer
 * report, leak or hang is a bug, as is an accepted file that breaks the reader's guarantees (a
 * tensor outside the data, a lookup that misses); a clean status with one error line is the
 * expected outcome for garbage.
 *
 * Built as a libFuzzer program with -DLLMEM_FUZZ=ON (`make fuzz`, or by hand from the repository
 * root:
 *   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DLLMEM_FUZZ=ON -DLLMEM_CUDA=OFF
 *   cmake --build build-fuzz --target fuzz-gguf
 *   cp -r tests/fuzz/corpus/fuzz-gguf /tmp/corpus
 *   ./build-fuzz/tests/fuzz-gguf -max_len=8192 -max_total_time=60 /tmp/corpus
 * ), and in every build as a replay of tests/fuzz/corpus/fuzz-gguf (ctest fuzz-gguf).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "llmem/config.h"
#include "model/gguf.h"

static void read_values(const struct llmem_gguf *g) {
    for (int64_t i = 0; i < g->n_kv; i++) {
        const struct llmem_gguf_kv *kv = &g->kv[i];
        if (llmem_gguf_find_key(g, kv->key) != kv)
            abort();
        uint32_t u32;
        int32_t i32;
        uint64_t u64;
        float f32;
        double f64;
        int b;
        struct llmem_gguf_str s;
        const struct llmem_gguf_kv *a = NULL;
        /* every getter on every key: the right one succeeds, the others refuse cleanly */
        llmem_gguf_get_u32(g, kv->key, &u32);
        llmem_gguf_get_i32(g, kv->key, &i32);
        llmem_gguf_get_u64(g, kv->key, &u64);
        llmem_gguf_get_f32(g, kv->key, &f32);
        llmem_gguf_get_f64(g, kv->key, &f64);
        llmem_gguf_get_bool(g, kv->key, &b);
        if (llmem_gguf_get_string(g, kv->key, &s) == 0 &&
            (s.ptr < (const char *)g->base || s.len > g->size ||
             (size_t)(s.ptr - (const char *)g->base) > g->size - s.len))
            abort();
        if (llmem_gguf_get_array(g, kv->key, -1, &a) != 0)
            continue;
        for (uint64_t j = 0; j < a->n; j++) {
            int64_t v;
            switch (a->elem_type) {
            case LLMEM_GGUF_STRING:
                s = llmem_gguf_array_str(a, j);
                if (s.len > g->size || (size_t)(s.ptr - (const char *)g->base) > g->size - s.len)
                    abort();
                break;
            case LLMEM_GGUF_F32:
            case LLMEM_GGUF_F64: (void)llmem_gguf_array_float(a, j); break;
            case LLMEM_GGUF_BOOL:
                if (a->value[j] > 1)
                    abort();
                break;
            default: (void)llmem_gguf_array_int(a, j, &v); break;
            }
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* A copy of exactly the input, so that a read past it is a sanitizer report. */
    uint8_t *copy = malloc(size > 0 ? size : 1);
    if (copy == NULL)
        abort();
    if (size > 0)
        memcpy(copy, data, size);
    struct llmem_gguf *g = NULL;
    if (llmem_gguf_parse(copy, size, "fuzz.gguf", &g) != 0) {
        free(copy);
        return 0;
    }
    int64_t bytes = 0;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        const struct llmem_gguf_tensor *t = &g->tensors[i];
        if (llmem_gguf_find_tensor(g, t->name) != t || t->n_bytes <= 0 ||
            (const uint8_t *)t->data < g->base + g->data_offset ||
            (size_t)((const uint8_t *)t->data - g->base) + (size_t)t->n_bytes > g->size)
            abort();
        bytes += t->n_bytes;
    }
    if (bytes != g->n_bytes)
        abort();
    read_values(g);

    struct llmem_model_geometry geom;
    if (llmem_gguf_geometry(g, &geom, "fuzz") == 0 &&
        (geom.n_layers <= 0 || geom.head_dim <= 0 || geom.n_kv_heads <= 0 ||
         geom.n_heads % geom.n_kv_heads != 0 || geom.vocab_size <= 0 ||
         geom.weights_bytes != g->n_bytes))
        abort();
    struct llmem_model_config cfg;
    if (llmem_gguf_config(g, &cfg, "fuzz") == 0) {
        if (cfg.layer_sliding == NULL || cfg.bos_id >= cfg.geom.vocab_size ||
            !(cfg.rms_norm_eps > 0 && cfg.rms_norm_eps < 1))
            abort();
        llmem_model_config_free(&cfg);
    }
    llmem_gguf_free(g);
    free(copy);
    return 0;
}
