/*
 * model/model_dir.c — a model directory's tensor table and geometry.
 *
 * The tensors come from `model.safetensors` when it exists (as transformers prefers it), else from
 * the shards named by `model.safetensors.index.json`. For a sharded model, each shard's header is
 * read once; the index must be an object with a non-empty "weight_map" of tensor → shard file
 * name, where a shard is a plain file name inside the directory (no '/', so an index can never
 * point outside it); every shard must exist, every tensor the index lists must be in the shard it
 * names, and no tensor may be in two shards. Tensors a shard holds beyond the index are kept (as
 * transformers loads them too). Only headers are read, through safetensors.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/file.h"
#include "core/json.h"
#include "core/log.h"
#include "model/gguf.h"
#include "model/model_int.h"
#include "llmem/config.h"
#include "llmem/safetensors.h"

#define INDEX_MAX_BYTES ((int64_t)64 << 20)
#define MODEL_PATH_MAX  4096

static int file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

/* ---- sharded models ------------------------------------------------------------------------- */

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The index of shard `name` in the sorted, unique list. */
static int shard_index(const char *const *shards, int n_shards, const char *name) {
    const char *const *hit = bsearch(&name, shards, (size_t)n_shards, sizeof(*shards), cmp_str);
    return hit != NULL ? (int)(hit - shards) : -1;
}

static int is_plain_file_name(const char *name) {
    return name[0] != '\0' && strchr(name, '/') == NULL && strcmp(name, ".") != 0 &&
           strcmp(name, "..") != 0;
}

static int load_sharded(const char *dir, const char *index_path, struct llmem_safetensors *st,
                        const char *func) {
    cJSON *root = NULL;
    int status = llmem_json_parse_file(index_path, INDEX_MAX_BYTES, &root);
    if (status != LLMEM_OK)
        return status;
    const char **shards = NULL;
    if (!cJSON_IsObject(root)) {
        LLMEM_ERROR_AS(func, "%s: not a JSON object", index_path);
        status = LLMEM_EFORMAT;
        goto out_json;
    }
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (map == NULL || cJSON_IsNull(map)) {
        LLMEM_ERROR_AS(func, "%s: missing 'weight_map'", index_path);
        status = LLMEM_EFORMAT;
        goto out_json;
    }
    if (!cJSON_IsObject(map)) {
        LLMEM_ERROR_AS(func, "%s: 'weight_map' is not an object", index_path);
        status = LLMEM_EFORMAT;
        goto out_json;
    }
    int n_entries = cJSON_GetArraySize(map);
    if (n_entries == 0) {
        LLMEM_ERROR_AS(func, "%s: 'weight_map' is empty", index_path);
        status = LLMEM_EFORMAT;
        goto out_json;
    }
    shards = malloc((size_t)n_entries * sizeof(*shards));
    if (shards == NULL) {
        LLMEM_ERROR_AS(func, "%s: out of memory", index_path);
        status = LLMEM_ENOMEM;
        goto out_json;
    }
    int n_shards = 0;
    const cJSON *entry = NULL;
    cJSON_ArrayForEach(entry, map) {
        const char *tensor = entry->string != NULL ? entry->string : "";
        if (!cJSON_IsString(entry)) {
            LLMEM_ERROR_AS(func, "%s: weight_map entry '%.200s' is not a string", index_path,
                           tensor);
            status = LLMEM_EFORMAT;
            goto out_shards;
        }
        if (!is_plain_file_name(entry->valuestring)) {
            LLMEM_ERROR_AS(func,
                           "%s: weight_map entry '%.200s' names '%.200s', which is not a file name "
                           "in the model directory",
                           index_path, tensor, entry->valuestring);
            status = LLMEM_EFORMAT;
            goto out_shards;
        }
        shards[n_shards++] = entry->valuestring;
    }
    qsort(shards, (size_t)n_shards, sizeof(*shards), cmp_str);
    int n_unique = 0;
    for (int i = 0; i < n_shards; i++)
        if (n_unique == 0 || strcmp(shards[n_unique - 1], shards[i]) != 0)
            shards[n_unique++] = shards[i];

    /* Read every shard's header, in sorted order, so that file_index = index in `shards`. */
    for (int i = 0; i < n_unique; i++) {
        char path[MODEL_PATH_MAX];
        status = llmem_path_join(path, sizeof(path), dir, shards[i]);
        if (status != LLMEM_OK)
            goto out_shards;
        if (!file_exists(path)) {
            LLMEM_ERROR_AS(func, "%s: shard '%s' listed in the index is missing (%s)", index_path,
                           shards[i], path);
            status = LLMEM_ENOENT;
            goto out_shards;
        }
        status = llmem_st_table_add_file(st, path, func);
        if (status != LLMEM_OK)
            goto out_shards;
    }
    status = llmem_st_table_finish(st, func);
    if (status != LLMEM_OK)
        goto out_shards;

    cJSON_ArrayForEach(entry, map) {
        const struct llmem_st_tensor *t = llmem_safetensors_find(st, entry->string);
        int want = shard_index(shards, n_unique, entry->valuestring);
        if (t == NULL) {
            LLMEM_ERROR_AS(func,
                           "%s: tensor '%.200s' listed in the index is missing from shard '%s'",
                           index_path, entry->string, entry->valuestring);
            status = LLMEM_EFORMAT;
            goto out_shards;
        }
        if (t->file_index != want) {
            LLMEM_ERROR_AS(func, "%s: tensor '%.200s' is listed in shard '%s' but stored in %s",
                           index_path, entry->string, entry->valuestring,
                           st->files[t->file_index].path);
            status = LLMEM_EFORMAT;
            goto out_shards;
        }
    }
out_shards:
    free(shards);
out_json:
    cJSON_Delete(root);
    return status;
}

/* ---- the directory -------------------------------------------------------------------------- */

int llmem_safetensors_load_dir(const char *model_dir, struct llmem_safetensors **out) {
    static const char func[] = "llmem_safetensors_load_dir";
    int status = llmem_model_dir_check(model_dir, func);
    if (status != LLMEM_OK)
        return status;
    char single[MODEL_PATH_MAX], index[MODEL_PATH_MAX];
    status = llmem_path_join(single, sizeof(single), model_dir, "model.safetensors");
    if (status == LLMEM_OK)
        status = llmem_path_join(index, sizeof(index), model_dir, "model.safetensors.index.json");
    if (status != LLMEM_OK)
        return status;

    struct llmem_safetensors *st = llmem_st_table_new(func);
    if (st == NULL)
        return LLMEM_ENOMEM;
    if (file_exists(single)) {
        status = llmem_st_table_add_file(st, single, func);
        if (status == LLMEM_OK)
            status = llmem_st_table_finish(st, func);
    } else if (file_exists(index)) {
        status = load_sharded(model_dir, index, st, func);
    } else {
        LLMEM_ERROR_AS(func, "no model.safetensors or model.safetensors.index.json in %s",
                       model_dir);
        status = LLMEM_ENOENT;
    }
    if (status == LLMEM_OK && st->n_tensors == 0) {
        LLMEM_ERROR_AS(func, "%s: the safetensors headers list no tensors", model_dir);
        status = LLMEM_EFORMAT;
    }
    if (status != LLMEM_OK) {
        llmem_safetensors_free(st);
        return status;
    }
    *out = st;
    return LLMEM_OK;
}

/* ---- parameters ----------------------------------------------------------------------------- */

/* The bits of the MLX-quantized module `module` (its name without the suffix), 0 if it is not:
 * its entry in the config's `quantization`, else the default when its weight is U32 codes with
 * a `.scales` tensor beside it. */
static int module_bits(const struct llmem_safetensors *st, const struct llmem_model_config *cfg,
                       const char *module, size_t len) {
    for (int i = 0; i < cfg->n_quant_overrides; i++)
        if (strlen(cfg->quant_overrides[i].module) == len &&
            memcmp(cfg->quant_overrides[i].module, module, len) == 0)
            return cfg->quant_overrides[i].bits;
    char name[256];
    snprintf(name, sizeof(name), "%.*s.scales", (int)len, module);
    return llmem_safetensors_find(st, name) != NULL ? cfg->quant_bits : 0;
}

int64_t llmem_model_count_params(const struct llmem_safetensors *st,
                                 const struct llmem_model_config *cfg) {
    if (cfg == NULL || cfg->quant_bits == 0)
        return st->n_elements;
    int64_t n = 0;
    for (int i = 0; i < st->n_tensors; i++) {
        const struct llmem_st_tensor *t = &st->tensors[i];
        size_t len = strlen(t->name);
        int bits = 0;
        if (len > 7 && len < 240 &&
            (strcmp(t->name + len - 7, ".weight") == 0 ||
             strcmp(t->name + len - 7, ".scales") == 0 ||
             strcmp(t->name + len - 7, ".biases") == 0))
            bits = module_bits(st, cfg, t->name, len - 7);
        if (bits == 0)
            n += t->n_elements;
        else if (strcmp(t->name + len - 7, ".weight") == 0 && t->dtype == LLMEM_DTYPE_U32)
            n += t->n_elements * (32 / bits); /* the values the codes hold; scales and biases are
                                               * not parameters of the model */
    }
    return n;
}

int64_t llmem_model_expert_bytes(const struct llmem_safetensors *st) {
    int64_t bytes = 0;
    for (int i = 0; i < st->n_tensors; i++)
        if (strstr(st->tensors[i].name, ".experts.") != NULL ||
            strstr(st->tensors[i].name, ".switch_mlp.") != NULL)
            bytes += st->tensors[i].n_bytes;
    return bytes;
}

/* A GGUF file's geometry: the header and tensor infos alone (the data is mapped, never read). */
int llmem_model_gguf_geometry(const char *path, struct llmem_model_geometry *geom,
                              struct llmem_model_config *cfg, const char *func) {
    struct llmem_gguf *g = NULL;
    int status = llmem_gguf_open(path, &g);
    if (status != LLMEM_OK)
        return status;
    if (cfg != NULL)
        status = llmem_gguf_config(g, cfg, func);
    else
        status = llmem_gguf_geometry(g, geom, func);
    llmem_gguf_free(g);
    return status;
}

int llmem_model_geometry_load_dummy(const char *model_dir, struct llmem_model_geometry *geom) {
    struct llmem_model_geometry g;
    int status = llmem_model_geometry_load_config(model_dir, &g);
    if (status != LLMEM_OK || (status = llmem_model_dummy_check(&g)) != LLMEM_OK)
        return status;
    g.n_params = llmem_geometry_param_count(&g);
    g.weights_bytes = 2 * g.n_params;
    g.quantized = 0;
    g.expert_bytes = g.n_experts > 0 ? 2 * g.n_moe_layers * g.n_experts * 3 * g.hidden_size *
                                           g.expert_intermediate
                                     : 0;
    *geom = g;
    return LLMEM_OK;
}

int llmem_model_geometry_load(const char *model_dir, struct llmem_model_geometry *geom) {
    if (llmem_gguf_is_gguf(model_dir))
        return llmem_model_gguf_geometry(model_dir, geom, NULL, __func__);
    struct llmem_model_geometry g;
    int status = llmem_model_geometry_load_config(model_dir, &g);
    if (status != LLMEM_OK)
        return status;
    struct llmem_safetensors *st = NULL;
    status = llmem_safetensors_load_dir(model_dir, &st);
    if (status != LLMEM_OK)
        return status;
    g.n_params = st->n_elements;
    g.weights_bytes = st->n_bytes;
    g.expert_bytes = g.n_experts > 0 ? llmem_model_expert_bytes(st) : 0;
    for (int i = 0; i < st->n_tensors; i++)
        if (st->tensors[i].dtype == LLMEM_DTYPE_U32) { /* MLX codes: count what they hold */
            g.quantized = 1;
            struct llmem_model_config cfg;
            memset(&cfg, 0, sizeof(cfg));
            if (llmem_model_config_load(model_dir, &cfg) == LLMEM_OK)
                g.n_params = llmem_model_count_params(st, &cfg);
            llmem_model_config_free(&cfg);
            break;
        }
    if (!g.tied_embeddings && llmem_safetensors_find(st, "lm_head.weight") == NULL &&
        llmem_safetensors_find(st, "model.embed_tokens.weight") != NULL) {
        LLMEM_WARN("%s: no lm_head.weight although tie_word_embeddings is not true; the "
                   "embeddings are used as lm_head (tied)",
                   model_dir);
        g.tied_embeddings = 1;
    }
    llmem_safetensors_free(st);
    *geom = g;
    return LLMEM_OK;
}
