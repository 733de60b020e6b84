/*
 * plan/catalog.c — built-in geometries of popular architectures, as published in their
 * config.json files, so `llmem plan llama-3.1-8b` works with no files. n_params is the count of
 * unique parameters (a tied lm_head counted once) and equals llmem_geometry_param_count; weights
 * are priced at 2 bytes per parameter (the bf16 checkpoints these models ship).
 */
#include <strings.h>

#include "llmem/plan.h"

/* the mixture-of-experts fields of a dense model */
#define DENSE 0, 0, 0, 0, 0

static const struct llmem_model_geometry catalog[] = {
    /* name, arch, source, layers, hidden, heads, kv heads, head_dim, intermediate, vocab,
     * max context, sliding window, tied, attention bias, qk norm, parameters, weight bytes,
     * quantized, and for a mixture of experts: experts, experts a token runs, expert width, MoE
     * layers, experts' bytes */
    {"llama-3.2-1b", "llama", "meta-llama/Llama-3.2-1B", 16, 2048, 32, 8, 64, 8192, 128256, 131072,
     0, 1, 0, 0, 1235814400LL, 2471628800LL, 0, DENSE},
    {"llama-3.2-3b", "llama", "meta-llama/Llama-3.2-3B", 28, 3072, 24, 8, 128, 8192, 128256, 131072,
     0, 1, 0, 0, 3212749824LL, 6425499648LL, 0, DENSE},
    {"llama-3.1-8b", "llama", "meta-llama/Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256,
     131072, 0, 0, 0, 0, 8030261248LL, 16060522496LL, 0, DENSE},
    {"llama-3.1-70b", "llama", "meta-llama/Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256,
     131072, 0, 0, 0, 0, 70553706496LL, 141107412992LL, 0, DENSE},
    {"llama-3.3-70b", "llama", "meta-llama/Llama-3.3-70B-Instruct", 80, 8192, 64, 8, 128, 28672,
     128256, 131072, 0, 0, 0, 0, 70553706496LL, 141107412992LL, 0, DENSE},
    {"tinyllama-1.1b", "llama", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", 22, 2048, 32, 4, 64, 5632,
     32000, 2048, 0, 0, 0, 0, 1100048384LL, 2200096768LL, 0, DENSE},
    {"mistral-7b-v0.3", "mistral", "mistralai/Mistral-7B-v0.3", 32, 4096, 32, 8, 128, 14336, 32768,
     32768, 0, 0, 0, 0, 7248023552LL, 14496047104LL, 0, DENSE},
    {"mistral-nemo-12b", "mistral", "mistralai/Mistral-Nemo-Base-2407", 40, 5120, 32, 8, 128, 14336,
     131072, 1024000, 0, 0, 0, 0, 12247782400LL, 24495564800LL, 0, DENSE},
    {"mistral-small-24b", "mistral", "mistralai/Mistral-Small-24B-Base-2501", 40, 5120, 32, 8, 128,
     32768, 131072, 32768, 0, 0, 0, 0, 23572403200LL, 47144806400LL, 0, DENSE},
    {"qwen2.5-0.5b", "qwen2", "Qwen/Qwen2.5-0.5B-Instruct", 24, 896, 14, 2, 64, 4864, 151936, 32768,
     0, 1, 1, 0, 494032768LL, 988065536LL, 0, DENSE},
    {"qwen2.5-1.5b", "qwen2", "Qwen/Qwen2.5-1.5B-Instruct", 28, 1536, 12, 2, 128, 8960, 151936,
     32768, 0, 1, 1, 0, 1543714304LL, 3087428608LL, 0, DENSE},
    {"qwen2.5-3b", "qwen2", "Qwen/Qwen2.5-3B-Instruct", 36, 2048, 16, 2, 128, 11008, 151936, 32768,
     0, 1, 1, 0, 3085938688LL, 6171877376LL, 0, DENSE},
    {"qwen2.5-7b", "qwen2", "Qwen/Qwen2.5-7B-Instruct", 28, 3584, 28, 4, 128, 18944, 152064, 32768,
     0, 0, 1, 0, 7615616512LL, 15231233024LL, 0, DENSE},
    {"qwen2.5-14b", "qwen2", "Qwen/Qwen2.5-14B-Instruct", 48, 5120, 40, 8, 128, 13824, 152064,
     32768, 0, 0, 1, 0, 14770033664LL, 29540067328LL, 0, DENSE},
    {"qwen2.5-32b", "qwen2", "Qwen/Qwen2.5-32B-Instruct", 64, 5120, 40, 8, 128, 27648, 152064,
     32768, 0, 0, 1, 0, 32763876352LL, 65527752704LL, 0, DENSE},
    {"qwen2.5-72b", "qwen2", "Qwen/Qwen2.5-72B-Instruct", 80, 8192, 64, 8, 128, 29568, 152064,
     32768, 0, 0, 1, 0, 72706203648LL, 145412407296LL, 0, DENSE},
    {"qwen3-0.6b", "qwen3", "Qwen/Qwen3-0.6B", 28, 1024, 16, 8, 128, 3072, 151936, 40960, 0, 1, 0,
     1, 596049920LL, 1192099840LL, 0, DENSE},
    {"qwen3-1.7b", "qwen3", "Qwen/Qwen3-1.7B", 28, 2048, 16, 8, 128, 6144, 151936, 40960, 0, 1, 0,
     1, 1720574976LL, 3441149952LL, 0, DENSE},
    {"qwen3-4b", "qwen3", "Qwen/Qwen3-4B", 36, 2560, 32, 8, 128, 9728, 151936, 40960, 0, 1, 0, 1,
     4022468096LL, 8044936192LL, 0, DENSE},
    {"qwen3-8b", "qwen3", "Qwen/Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936, 40960, 0, 0, 0, 1,
     8190735360LL, 16381470720LL, 0, DENSE},
    {"qwen3-14b", "qwen3", "Qwen/Qwen3-14B", 40, 5120, 40, 8, 128, 17408, 151936, 40960, 0, 0, 0, 1,
     14768307200LL, 29536614400LL, 0, DENSE},
    {"qwen3-32b", "qwen3", "Qwen/Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936, 40960, 0, 0, 0, 1,
     32762123264LL, 65524246528LL, 0, DENSE},
    {"qwen3-30b-a3b", "qwen3_moe", "Qwen/Qwen3-30B-A3B", 48, 2048, 32, 4, 128, 6144, 151936, 40960,
     0, 0, 0, 1, 30532122624LL, 61064245248LL, 0, 128, 8, 768, 48, 57982058496LL},
    {"qwen3-235b-a22b", "qwen3_moe", "Qwen/Qwen3-235B-A22B", 94, 4096, 64, 4, 128, 12288, 151936,
     40960, 0, 0, 0, 1, 235093634560LL, 470187269120LL, 0, 128, 8, 1536, 94, 454192791552LL},
    {"mixtral-8x7b", "mixtral", "mistralai/Mixtral-8x7B-v0.1", 32, 4096, 32, 8, 128, 14336, 32000,
     32768, 0, 0, 0, 0, 46702792704LL, 93405585408LL, 0, 8, 2, 14336, 32, 90194313216LL},
};

size_t llmem_catalog_count(void) {
    return sizeof(catalog) / sizeof(catalog[0]);
}

const struct llmem_model_geometry *llmem_catalog_get(size_t index) {
    return index < llmem_catalog_count() ? &catalog[index] : NULL;
}

const struct llmem_model_geometry *llmem_catalog_find(const char *name) {
    for (size_t i = 0; name != NULL && i < llmem_catalog_count(); i++)
        if (strcasecmp(catalog[i].name, name) == 0)
            return &catalog[i];
    return NULL;
}
