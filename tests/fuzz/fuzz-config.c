/*
 * tests/fuzz/fuzz-config.c — libFuzzer target for model/config.c: a model's config.json read whole
 * (llmem_model_config_load: the geometry, the RoPE numbers and scaling, the sliding-window layers)
 * on arbitrary bytes. The input is the file as it is. Any crash, sanitizer report, leak or hang is
 * a bug; a clean status with one error line is the expected outcome for garbage. What loads must
 * agree with itself and with llmem_model_geometry_load_config.
 *
 * Built as a libFuzzer program with -DLLMEM_FUZZ=ON (`make fuzz`), and in every build as a replay
 * of tests/fuzz/corpus/fuzz-config (ctest fuzz-config).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "llmem/config.h"
#include "llmem/status.h"

static char dir[256];

static void quiet(enum llmem_log_level level, const char *line, void *user) {
    (void)level, (void)line, (void)user;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    llmem_log_set_callback(quiet, NULL, LLMEM_LOG_ERROR);
    snprintf(dir, sizeof(dir), "/tmp/llmem-fuzz-config-XXXXXX");
    if (mkdtemp(dir) == NULL)
        abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char path[512];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    FILE *f = fopen(path, "wb");
    if (f == NULL)
        abort();
    if (size > 0 && fwrite(data, 1, size, f) != size)
        abort();
    fclose(f);

    struct llmem_model_config cfg;
    struct llmem_model_geometry g;
    int full = llmem_model_config_load(dir, &cfg);
    int geom = llmem_model_geometry_load_config(dir, &g);
    if (full == LLMEM_OK) {
        const struct llmem_model_geometry *c = &cfg.geom;
        if (c->n_layers <= 0 || c->head_dim <= 0 || c->n_kv_heads <= 0 ||
            c->n_heads % c->n_kv_heads != 0)
            abort();
        /* The full read is the geometry's and more: whatever it accepts, the geometry accepts. */
        if (geom != LLMEM_OK || g.n_layers != c->n_layers || g.n_heads != c->n_heads ||
            g.n_kv_heads != c->n_kv_heads || g.head_dim != c->head_dim)
            abort();
        llmem_model_config_free(&cfg);
    }
    unlink(path);
    return 0;
}
