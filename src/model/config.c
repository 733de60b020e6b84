/*
 * model/config.c — a Hugging Face config.json → struct llmem_model_geometry (SPEC §2.5).
 *
 * Families: llama, mistral, qwen2, qwen3, chosen by model_type (the nested text_config's first,
 * then the top level's), by architectures ("LlamaForCausalLM" ...) only when there is no
 * model_type (transformers, too, picks the model class from model_type). When a `text_config`
 * object is present (multimodal wrappers), the geometry is read from it.
 *
 * Rules: head_dim defaults to hidden_size / num_attention_heads (which must then divide),
 * num_key_value_heads to num_attention_heads (and must divide it); qwen2 always has q/k/v biases,
 * qwen3 always q/k norms, the others read attention_bias. sliding_window counts only when some
 * layer slides: layer_types has "sliding_attention"; else use_sliding_window is true (for qwen2/3
 * also some layer at or above max_window_layers, default 28, as transformers derives it); else, for
 * mistral, whenever sliding_window is set. rope_theta / rope_scaling / rope_parameters are checked
 * for type by the geometry, and read into the full configuration (struct llmem_model_config) that
 * the forward pass runs on, with rms_norm_eps, hidden_act and the token ids of config.json.
 *
 * Guarantees: every integer is read exactly (no double rounding) and bounded so that the planner's
 * 64-bit products of them cannot overflow; a missing, mistyped or out-of-range field gives one
 * error line naming config.json's path and the field.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/file.h"
#include "core/json.h"
#include "core/log.h"
#include "llmem/model.h"
#include "llmem/config.h"
#include "model/gguf.h"
#include "model/model_int.h"
#include "plan/moe_work.h"

#define CONFIG_FUNC       "llmem_model_geometry_load_config"
#define CONFIG_ERROR(...) LLMEM_ERROR_AS(CONFIG_FUNC, __VA_ARGS__)
#define CONFIG_MAX_BYTES  ((int64_t)16 << 20)
#define CONFIG_PATH_MAX   4096

static const struct {
    const char *model_type;
    const char *architecture;
} families[] = {
    {"llama", "LlamaForCausalLM"},
    {"mistral", "MistralForCausalLM"},
    {"qwen2", "Qwen2ForCausalLM"},
    {"qwen3", "Qwen3ForCausalLM"},
    {"qwen3_moe", "Qwen3MoeForCausalLM"},
    {"mixtral", "MixtralForCausalLM"},
};
#define N_FAMILIES (sizeof(families) / sizeof(families[0]))

struct config {
    const char *path;   /* config.json, for messages */
    const cJSON *root;  /* the document */
    const cJSON *text;  /* root, or root.text_config */
    const char *prefix; /* "" or "text_config.", for messages */
};

static const char *json_type_name(const cJSON *item) {
    if (cJSON_IsBool(item))
        return "a boolean";
    if (cJSON_IsNumber(item))
        return "a number";
    if (cJSON_IsString(item))
        return "a string";
    if (cJSON_IsArray(item))
        return "an array";
    if (cJSON_IsObject(item))
        return "an object";
    if (cJSON_IsNull(item))
        return "null";
    return "invalid";
}

/* ---- typed fields --------------------------------------------------------------------------- */

/* An integer field of the text config within [min, max]. Absent (or null) and not required:
 * LLMEM_ENOENT, not logged. */
static int config_int(const struct config *c, const char *key, int required, int64_t min,
                      int64_t max, int64_t *out) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(c->text, key);
    int64_t v = 0;
    int status = llmem_json_int(item, &v);
    if (status == LLMEM_ENOENT) {
        if (!required)
            return LLMEM_ENOENT;
        CONFIG_ERROR("%s: missing '%s%s'", c->path, c->prefix, key);
        return LLMEM_EFORMAT;
    }
    if (status == LLMEM_EFORMAT) {
        CONFIG_ERROR("%s: '%s%s' must be an integer, not %s", c->path, c->prefix, key,
                     json_type_name(item));
        return LLMEM_EFORMAT;
    }
    if (status != LLMEM_OK) {
        double d = item->valuedouble;
        if (isfinite(d) && d == floor(d))
            CONFIG_ERROR("%s: '%s%s' is %g, outside [%" PRId64 ", %" PRId64 "]", c->path, c->prefix,
                         key, d, min, max);
        else
            CONFIG_ERROR("%s: '%s%s' must be an integer, not %g", c->path, c->prefix, key, d);
        return LLMEM_EFORMAT;
    }
    if (v < min || v > max) {
        CONFIG_ERROR("%s: '%s%s' is %" PRId64 ", outside [%" PRId64 ", %" PRId64 "]", c->path,
                     c->prefix, key, v, min, max);
        return LLMEM_EFORMAT;
    }
    *out = v;
    return LLMEM_OK;
}

/* A boolean field of `obj`; *out keeps its value when absent or null. */
static int config_bool(const struct config *c, const cJSON *obj, const char *key, int *out) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (item == NULL || cJSON_IsNull(item))
        return LLMEM_OK;
    if (!cJSON_IsBool(item)) {
        CONFIG_ERROR("%s: '%s%s' must be true or false, not %s", c->path,
                     obj == c->root ? "" : c->prefix, key, json_type_name(item));
        return LLMEM_EFORMAT;
    }
    *out = cJSON_IsTrue(item);
    return LLMEM_OK;
}

/* A string field of `obj`; NULL when absent or null. */
static int config_string(const struct config *c, const cJSON *obj, const char *key,
                         const char **out) {
    *out = NULL;
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (item == NULL || cJSON_IsNull(item))
        return LLMEM_OK;
    if (!cJSON_IsString(item)) {
        CONFIG_ERROR("%s: '%s%s' must be a string, not %s", c->path,
                     obj == c->root ? "" : c->prefix, key, json_type_name(item));
        return LLMEM_EFORMAT;
    }
    *out = item->valuestring;
    return LLMEM_OK;
}

/* ---- architecture --------------------------------------------------------------------------- */

static const char *family_of_type(const char *model_type) {
    for (size_t i = 0; model_type != NULL && i < N_FAMILIES; i++)
        if (strcmp(model_type, families[i].model_type) == 0)
            return families[i].model_type;
    return NULL;
}

/* The family of the first known entry of `architectures` in obj; NULL when none. */
static int family_of_architectures(const struct config *c, const cJSON *obj, const char **family,
                                   const char **first) {
    const cJSON *archs = cJSON_GetObjectItemCaseSensitive(obj, "architectures");
    if (archs == NULL || cJSON_IsNull(archs))
        return LLMEM_OK;
    if (!cJSON_IsArray(archs)) {
        CONFIG_ERROR("%s: '%sarchitectures' must be an array of strings", c->path,
                     obj == c->root ? "" : c->prefix);
        return LLMEM_EFORMAT;
    }
    const cJSON *a = NULL;
    cJSON_ArrayForEach(a, archs) {
        if (!cJSON_IsString(a)) {
            CONFIG_ERROR("%s: '%sarchitectures' must be an array of strings", c->path,
                         obj == c->root ? "" : c->prefix);
            return LLMEM_EFORMAT;
        }
        if (*first == NULL)
            *first = a->valuestring;
        for (size_t i = 0; *family == NULL && i < N_FAMILIES; i++)
            if (strcmp(a->valuestring, families[i].architecture) == 0)
                *family = families[i].model_type;
    }
    return LLMEM_OK;
}

/* The family: the first supported model_type (text_config's, then the top level's); without any
 * model_type, the first supported entry of architectures. */
static int config_arch(const struct config *c, const char **arch) {
    const char *text_type = NULL, *root_type = NULL, *first = NULL, *by_arch = NULL;
    int status = config_string(c, c->text, "model_type", &text_type);
    if (status == LLMEM_OK && c->text != c->root)
        status = config_string(c, c->root, "model_type", &root_type);
    if (status == LLMEM_OK)
        status = family_of_architectures(c, c->text, &by_arch, &first);
    if (status == LLMEM_OK && c->text != c->root)
        status = family_of_architectures(c, c->root, &by_arch, &first);
    if (status != LLMEM_OK)
        return status;

    const char *seen = text_type != NULL ? text_type : root_type;
    *arch = family_of_type(text_type);
    if (*arch == NULL)
        *arch = family_of_type(root_type);
    if (*arch == NULL && seen == NULL)
        *arch = by_arch;
    if (*arch != NULL)
        return LLMEM_OK;
    if (seen == NULL && first == NULL) {
        CONFIG_ERROR("%s: missing 'model_type' (and no 'architectures')", c->path);
        return LLMEM_EFORMAT;
    }
    CONFIG_ERROR("%s: %s '%.100s' is not supported (llmem reads llama, mistral, "
                 "qwen2, qwen3, qwen3_moe, mixtral)",
                 c->path, seen != NULL ? "model_type" : "architecture",
                 seen != NULL ? seen : first);
    return LLMEM_EUNSUPPORTED;
}

/* ---- RoPE (checked, not recorded) ----------------------------------------------------------- */

static int rope_positive(const struct config *c, const cJSON *obj, const char *where,
                         const char *key) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (item == NULL || cJSON_IsNull(item))
        return LLMEM_OK;
    if (!cJSON_IsNumber(item) || !isfinite(item->valuedouble) || item->valuedouble <= 0) {
        CONFIG_ERROR("%s: '%s%s%s' must be a positive number", c->path, where, *where ? "." : "",
                     key);
        return LLMEM_EFORMAT;
    }
    return LLMEM_OK;
}

/* One rope_scaling / rope_parameters object: rope_theta and factor positive, the type a string. */
static int rope_object(const struct config *c, const cJSON *obj, const char *where) {
    static const char *const numbers[] = {"rope_theta", "factor"};
    static const char *const strings[] = {"rope_type", "type"};
    for (size_t i = 0; i < 2; i++) {
        int status = rope_positive(c, obj, where, numbers[i]);
        if (status != LLMEM_OK)
            return status;
        const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, strings[i]);
        if (item != NULL && !cJSON_IsNull(item) && !cJSON_IsString(item)) {
            CONFIG_ERROR("%s: '%s.%s' must be a string, not %s", c->path, where, strings[i],
                         json_type_name(item));
            return LLMEM_EFORMAT;
        }
    }
    return LLMEM_OK;
}

static int config_rope(const struct config *c) {
    char where[64];
    int status = rope_positive(c, c->text, "", "rope_theta");
    if (status != LLMEM_OK)
        return status;
    static const char *const keys[] = {"rope_scaling", "rope_parameters"};
    for (size_t k = 0; k < 2; k++) {
        const cJSON *obj = cJSON_GetObjectItemCaseSensitive(c->text, keys[k]);
        if (obj == NULL || cJSON_IsNull(obj))
            continue;
        snprintf(where, sizeof(where), "%s%s", c->prefix, keys[k]);
        if (!cJSON_IsObject(obj)) {
            CONFIG_ERROR("%s: '%s' must be an object or null, not %s", c->path, where,
                         json_type_name(obj));
            return LLMEM_EFORMAT;
        }
        status = rope_object(c, obj, where);
        if (status != LLMEM_OK)
            return status;
        /* rope_parameters may also be keyed by layer type ({"full_attention": {...}, ...}). */
        const cJSON *child = NULL;
        cJSON_ArrayForEach(child, obj) {
            if (!cJSON_IsObject(child))
                continue;
            snprintf(where, sizeof(where), "%s%s.%.20s", c->prefix, keys[k],
                     child->string != NULL ? child->string : "");
            status = rope_object(c, child, where);
            if (status != LLMEM_OK)
                return status;
        }
    }
    return LLMEM_OK;
}

/* The RoPE numbers: rope_theta at the top level or in rope_parameters (10000 when absent); the
 * scaling from rope_parameters (transformers 5) or rope_scaling, its type spelled rope_type or
 * type. A rope_parameters object keyed by layer type is read at its full_attention entry. */
static void config_rope_values(const struct config *c, struct llmem_model_config *cfg) {
    const cJSON *params = cJSON_GetObjectItemCaseSensitive(c->text, "rope_parameters");
    if (cJSON_IsObject(params)) {
        const cJSON *full = cJSON_GetObjectItemCaseSensitive(params, "full_attention");
        if (cJSON_IsObject(full))
            params = full;
    } else {
        params = NULL;
    }
    const cJSON *scaling = cJSON_GetObjectItemCaseSensitive(c->text, "rope_scaling");
    if (!cJSON_IsObject(scaling))
        scaling = params;
    const cJSON *theta = cJSON_GetObjectItemCaseSensitive(c->text, "rope_theta");
    if (!cJSON_IsNumber(theta) && params != NULL)
        theta = cJSON_GetObjectItemCaseSensitive(params, "rope_theta");
    cfg->rope_theta = cJSON_IsNumber(theta) ? theta->valuedouble : 10000.0;
    snprintf(cfg->rope_type, sizeof(cfg->rope_type), "default");
    cfg->rope_factor = 1.0;
    cfg->rope_low_freq_factor = 1.0;
    cfg->rope_high_freq_factor = 4.0;
    cfg->rope_original_max_context = 8192;
    if (scaling == NULL)
        return;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(scaling, "rope_type");
    if (!cJSON_IsString(type))
        type = cJSON_GetObjectItemCaseSensitive(scaling, "type");
    if (cJSON_IsString(type))
        snprintf(cfg->rope_type, sizeof(cfg->rope_type), "%s", type->valuestring);
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(scaling, "factor");
    if (cJSON_IsNumber(v))
        cfg->rope_factor = v->valuedouble;
    if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(scaling, "low_freq_factor")))
        cfg->rope_low_freq_factor = v->valuedouble;
    if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(scaling, "high_freq_factor")))
        cfg->rope_high_freq_factor = v->valuedouble;
    /* Out of [1, MAX_CONTEXT] (where it would not even convert) it is ignored, as a non-number. */
    if (cJSON_IsNumber(
            v = cJSON_GetObjectItemCaseSensitive(scaling, "original_max_position_embeddings")) &&
        v->valuedouble >= 1 && v->valuedouble <= (double)MAX_CONTEXT)
        cfg->rope_original_max_context = (int64_t)v->valuedouble;
}

/* bos_token_id and eos_token_id (an integer or a list of them); −1 / none when absent. */
static int config_token_ids(const struct config *c, struct llmem_model_config *cfg) {
    cfg->bos_id = -1;
    cfg->n_eos = 0;
    int64_t v = 0;
    int status = config_int(c, "bos_token_id", 0, 0, MAX_VOCAB, &v);
    if (status == LLMEM_OK)
        cfg->bos_id = (int32_t)v;
    else if (status != LLMEM_ENOENT)
        return status;
    const cJSON *eos = cJSON_GetObjectItemCaseSensitive(c->text, "eos_token_id");
    if (cJSON_IsArray(eos)) {
        const cJSON *e = NULL;
        cJSON_ArrayForEach(e, eos) {
            if (llmem_json_int(e, &v) != LLMEM_OK || v < 0 || v >= MAX_VOCAB) {
                CONFIG_ERROR("%s: '%seos_token_id' must hold token ids", c->path, c->prefix);
                return LLMEM_EFORMAT;
            }
            if (cfg->n_eos < LLMEM_MAX_EOS)
                cfg->eos_ids[cfg->n_eos++] = (int32_t)v;
        }
        return LLMEM_OK;
    }
    status = config_int(c, "eos_token_id", 0, 0, MAX_VOCAB, &v);
    if (status == LLMEM_OK)
        cfg->eos_ids[cfg->n_eos++] = (int32_t)v;
    return status == LLMEM_ENOENT ? LLMEM_OK : status;
}

/* The numbers the forward pass needs beyond the geometry. */
static int config_runtime(const struct config *c, struct llmem_model_config *cfg) {
    config_rope_values(c, cfg);
    cfg->rms_norm_eps = 1e-6;
    const cJSON *eps = cJSON_GetObjectItemCaseSensitive(c->text, "rms_norm_eps");
    if (eps != NULL && !cJSON_IsNull(eps)) {
        if (!cJSON_IsNumber(eps) || !(eps->valuedouble > 0 && eps->valuedouble < 1)) {
            CONFIG_ERROR("%s: '%srms_norm_eps' must be a number in (0, 1)", c->path, c->prefix);
            return LLMEM_EFORMAT;
        }
        cfg->rms_norm_eps = eps->valuedouble;
    }
    const char *act = NULL;
    int status = config_string(c, c->text, "hidden_act", &act);
    if (status == LLMEM_OK && act == NULL)
        status = config_string(c, c->text, "hidden_activation", &act);
    if (status != LLMEM_OK)
        return status;
    snprintf(cfg->hidden_act, sizeof(cfg->hidden_act), "%s", act != NULL ? act : "silu");
    return config_token_ids(c, cfg);
}

/* ---- MLX quantization ----------------------------------------------------------------------- */

/* bits and group_size of a `quantization` object (the top level's or a module's): 4 or 8 bits,
 * groups of 32, 64 or 128 (MLX's affine formats llmem reads), mode affine when given. */
static int quant_params(const struct config *c, const cJSON *obj, const char *where, int *bits,
                        int *group) {
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(obj, "bits");
    const cJSON *g = cJSON_GetObjectItemCaseSensitive(obj, "group_size");
    const cJSON *mode = cJSON_GetObjectItemCaseSensitive(obj, "mode");
    if (mode != NULL && !cJSON_IsNull(mode) &&
        (!cJSON_IsString(mode) || strcmp(mode->valuestring, "affine") != 0)) {
        CONFIG_ERROR("%s: '%s.mode' is %s; llmem reads MLX's affine quantization", c->path, where,
                     cJSON_IsString(mode) ? mode->valuestring : json_type_name(mode));
        return LLMEM_EUNSUPPORTED;
    }
    int64_t vb = 0, vg = 0;
    if (llmem_json_int(b, &vb) != LLMEM_OK || llmem_json_int(g, &vg) != LLMEM_OK) {
        CONFIG_ERROR("%s: '%s' needs integer 'bits' and 'group_size'", c->path, where);
        return LLMEM_EFORMAT;
    }
    if (vb != 4 && vb != 8) {
        CONFIG_ERROR("%s: '%s.bits' is %" PRId64 "; llmem reads MLX's 4- and 8-bit weights",
                     c->path, where, vb);
        return LLMEM_EUNSUPPORTED;
    }
    if (vg != 32 && vg != 64 && vg != 128) {
        CONFIG_ERROR("%s: '%s.group_size' is %" PRId64 "; MLX's groups are 32, 64 or 128", c->path,
                     where, vg);
        return LLMEM_EUNSUPPORTED;
    }
    *bits = (int)vb;
    *group = (int)vg;
    return LLMEM_OK;
}

/* config.json's `quantization` (mlx-lm's convert -q): checked always, kept in cfg when given. */
static int config_quantization(const struct config *c, struct llmem_model_config *cfg) {
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(c->root, "quantization");
    if (q == NULL || cJSON_IsNull(q))
        return LLMEM_OK;
    if (!cJSON_IsObject(q)) {
        CONFIG_ERROR("%s: 'quantization' must be an object, not %s", c->path, json_type_name(q));
        return LLMEM_EFORMAT;
    }
    int bits, group;
    int status = quant_params(c, q, "quantization", &bits, &group);
    if (status != LLMEM_OK)
        return status;
    int n = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, q) n += cJSON_IsObject(e) || cJSON_IsBool(e);
    struct llmem_model_quant_override *o = NULL;
    if (n > 0 && (o = calloc((size_t)n, sizeof(*o))) == NULL) {
        CONFIG_ERROR("%s: out of memory", c->path);
        return LLMEM_ENOMEM;
    }
    int i = 0;
    cJSON_ArrayForEach(e, q) {
        if (!cJSON_IsObject(e) && !cJSON_IsBool(e))
            continue; /* group_size, bits, mode and keys mlx-lm may add */
        char where[256];
        snprintf(where, sizeof(where), "quantization.%.200s", e->string);
        if (strlen(e->string) >= sizeof(o[i].module)) {
            CONFIG_ERROR("%s: '%s': the module path is too long", c->path, where);
            status = LLMEM_EFORMAT;
            break;
        }
        snprintf(o[i].module, sizeof(o[i].module), "%s", e->string);
        if (cJSON_IsTrue(e)) {
            o[i].bits = bits;
            o[i].group_size = group;
        } else if (cJSON_IsObject(e) &&
                   (status = quant_params(c, e, where, &o[i].bits, &o[i].group_size)) != LLMEM_OK)
            break;
        i++;
    }
    if (status != LLMEM_OK || cfg == NULL) {
        free(o);
        return status;
    }
    cfg->quant_bits = bits;
    cfg->quant_group_size = group;
    cfg->quant_overrides = o;
    cfg->n_quant_overrides = n;
    return LLMEM_OK;
}

/* ---- sliding window ------------------------------------------------------------------------- */

/* Mistral and Mixtral slide whenever sliding_window is set. */
static int mistral_like(const char *arch) {
    return strcmp(arch, "mistral") == 0 || strcmp(arch, "mixtral") == 0;
}

static int config_sliding_window(const struct config *c, const char *arch, int64_t n_layers,
                                 int64_t *out, uint8_t *layers) {
    int64_t slide_from = 0; /* without layer_types, layers from here on slide */
    int64_t window = 0;
    int status = config_int(c, "sliding_window", 0, 1, MAX_CONTEXT, &window);
    if (status != LLMEM_OK && status != LLMEM_ENOENT)
        return status;
    int has_window = status == LLMEM_OK;

    int use = -1; /* use_sliding_window: -1 absent */
    status = config_bool(c, c->text, "use_sliding_window", &use);
    if (status != LLMEM_OK)
        return status;

    int sliding = 0; /* some layer slides */
    const char *why = NULL;
    const cJSON *types = cJSON_GetObjectItemCaseSensitive(c->text, "layer_types");
    if (types != NULL && !cJSON_IsNull(types)) {
        if (!cJSON_IsArray(types)) {
            CONFIG_ERROR("%s: '%slayer_types' must be an array of strings, not %s", c->path,
                         c->prefix, json_type_name(types));
            return LLMEM_EFORMAT;
        }
        int n = cJSON_GetArraySize(types);
        if ((int64_t)n != n_layers) {
            CONFIG_ERROR("%s: '%slayer_types' has %d entries for %" PRId64 " layers", c->path,
                         c->prefix, n, n_layers);
            return LLMEM_EFORMAT;
        }
        sliding = 0;
        int i = 0;
        const cJSON *t = NULL;
        cJSON_ArrayForEach(t, types) {
            if (!cJSON_IsString(t)) {
                CONFIG_ERROR("%s: '%slayer_types[%d]' must be a string, not %s", c->path, c->prefix,
                             i, json_type_name(t));
                return LLMEM_EFORMAT;
            }
            if (strcmp(t->valuestring, "sliding_attention") == 0) {
                sliding = 1;
                if (layers != NULL)
                    layers[i] = 1;
            } else if (strcmp(t->valuestring, "full_attention") != 0) {
                CONFIG_ERROR("%s: '%slayer_types[%d]' is '%.40s'; llmem supports full_attention "
                             "and sliding_attention",
                             c->path, c->prefix, i, t->valuestring);
                return LLMEM_EUNSUPPORTED;
            }
            i++;
        }
        why = "layer_types has sliding_attention";
    } else if (use >= 0) {
        /* Without a window there is nothing to slide over (transformers then attends fully). */
        sliding = use && has_window;
        if (sliding && !mistral_like(arch)) {
            /* qwen2/qwen3: only the layers at or above max_window_layers slide. */
            int64_t max_window_layers = 28;
            status = config_int(c, "max_window_layers", 0, 0, MAX_LAYERS, &max_window_layers);
            if (status != LLMEM_OK && status != LLMEM_ENOENT)
                return status;
            sliding = max_window_layers < n_layers;
            slide_from = max_window_layers;
        }
    } else {
        sliding = mistral_like(arch) && has_window;
    }
    if (sliding && !has_window) {
        CONFIG_ERROR("%s: %s but '%ssliding_window' is not set", c->path, why, c->prefix);
        return LLMEM_EFORMAT;
    }
    if (layers != NULL && (types == NULL || cJSON_IsNull(types)))
        for (int64_t i = slide_from; sliding && i < n_layers; i++)
            layers[i] = 1;
    *out = sliding ? window : 0;
    return LLMEM_OK;
}

/* ---- name and source ------------------------------------------------------------------------ */

static int utf8_continuation(char ch) {
    return ((unsigned char)ch & 0xC0) == 0x80;
}

/* Copies the n bytes at src into dst[size], cut short at a UTF-8 character boundary. */
void llmem_model_copy_head(char *dst, size_t size, const char *src, size_t n) {
    if (n >= size) {
        n = size - 1;
        while (n > 0 && utf8_continuation(src[n]))
            n--;
    }
    memcpy(dst, src, n);
    dst[n] = '\0';
}

/* Copies src into dst[size]; when too long, "..." and the end of src (from a character start). */
void llmem_model_copy_tail(char *dst, size_t size, const char *src) {
    size_t len = strlen(src);
    if (len < size) {
        memcpy(dst, src, len + 1);
        return;
    }
    size_t start = len - (size - 4);
    while (start < len && utf8_continuation(src[start]))
        start++;
    snprintf(dst, size, "...%s", src + start);
}

/* The directory's base name ("models/pycoder/" → "pycoder"; "." → the real directory's name). */
static void dir_name(const char *dir, char *dst, size_t size) {
    char *resolved = NULL;
    for (int pass = 0; pass < 2; pass++) {
        size_t end = strlen(dir);
        while (end > 1 && dir[end - 1] == '/')
            end--;
        size_t start = end;
        while (start > 0 && dir[start - 1] != '/')
            start--;
        size_t n = end - start;
        int vague = n == 0 || (n == 1 && dir[start] == '.') ||
                    (n == 2 && dir[start] == '.' && dir[start + 1] == '.');
        if (!vague || pass == 1) {
            llmem_model_copy_head(dst, size, dir + start, n);
            break;
        }
        resolved = realpath(dir, NULL);
        if (resolved == NULL) {
            llmem_model_copy_head(dst, size, dir + start, n);
            break;
        }
        dir = resolved;
    }
    free(resolved);
}

/* ---- mixture of experts --------------------------------------------------------------------- */

#define MAX_EXPERTS ((int64_t)1 << 16)

/* The experts of qwen3_moe (num_experts, or transformers 5's num_local_experts; top
 * num_experts_per_tok; moe_intermediate_size wide; in the layers l with (l + 1) %
 * decoder_sparse_step == 0 that mlp_only_layers does not name) and mixtral (num_local_experts,
 * intermediate_size wide, every layer). With moe, the per-layer flags (*moe, n_layers bytes, 1:
 * experts; NULL for a dense model) and whether the top k's weights are renormalized. */
static int config_moe(const struct config *c, const char *arch, struct llmem_model_geometry *g,
                      uint8_t **moe, int *norm_topk) {
    const int qwen = strcmp(arch, "qwen3_moe") == 0, mixtral = strcmp(arch, "mixtral") == 0;
    if (moe != NULL)
        *moe = NULL;
    if (!qwen && !mixtral)
        return LLMEM_OK;
    int norm = mixtral; /* Mixtral always renormalizes the top k; Qwen3-MoE when norm_topk_prob */
    int status = qwen ? config_bool(c, c->text, "norm_topk_prob", &norm) : LLMEM_OK;
    if (status != LLMEM_OK)
        return status;
    if (norm_topk != NULL)
        *norm_topk = norm;
    int64_t n = 0;
    status = qwen ? config_int(c, "num_experts", 0, 0, MAX_EXPERTS, &n) : LLMEM_ENOENT;
    if (status == LLMEM_ENOENT)
        status = config_int(c, "num_local_experts", 1, 0, MAX_EXPERTS, &n);
    if (status != LLMEM_OK)
        return status;
    if (n == 0) /* no experts: every layer dense */
        return LLMEM_OK;
    int64_t k = 0, width = g->intermediate_size, step = 1;
    const int64_t most = n < LLMEM_MOE_MAX_K ? n : LLMEM_MOE_MAX_K;
    if ((status = config_int(c, "num_experts_per_tok", 1, 1, most, &k)) != LLMEM_OK ||
        (qwen && (status = config_int(c, "moe_intermediate_size", 1, 1, MAX_INTERMEDIATE,
                                      &width)) != LLMEM_OK))
        return status;
    if (qwen) {
        status = config_int(c, "decoder_sparse_step", 0, 1, MAX_LAYERS, &step);
        if (status != LLMEM_OK && status != LLMEM_ENOENT)
            return status;
    }
    uint8_t *flags = calloc((size_t)g->n_layers, 1);
    if (flags == NULL) {
        CONFIG_ERROR("out of memory");
        return LLMEM_ENOMEM;
    }
    for (int64_t l = 0; l < g->n_layers; l++)
        flags[l] = (l + 1) % step == 0;
    const cJSON *dense = qwen ? cJSON_GetObjectItemCaseSensitive(c->text, "mlp_only_layers") : NULL;
    if (dense != NULL && !cJSON_IsNull(dense)) {
        if (!cJSON_IsArray(dense)) {
            CONFIG_ERROR("%s: '%smlp_only_layers' must be an array of layer indices, not %s",
                         c->path, c->prefix, json_type_name(dense));
            free(flags);
            return LLMEM_EFORMAT;
        }
        const cJSON *e = NULL;
        cJSON_ArrayForEach(e, dense) {
            int64_t l = -1;
            if (llmem_json_int(e, &l) != LLMEM_OK || l < 0 || l >= g->n_layers) {
                CONFIG_ERROR("%s: '%smlp_only_layers' holds %s; its entries are layer indices "
                             "from 0 to %" PRId64,
                             c->path, c->prefix, cJSON_IsNumber(e) ? "a number out of range"
                                                                   : json_type_name(e),
                             g->n_layers - 1);
                free(flags);
                return LLMEM_EFORMAT;
            }
            flags[l] = 0;
        }
    }
    g->n_experts = n;
    g->n_experts_used = k;
    g->expert_intermediate = width;
    g->n_moe_layers = 0;
    for (int64_t l = 0; l < g->n_layers; l++)
        g->n_moe_layers += flags[l];
    if (g->n_moe_layers == 0)
        g->n_experts = g->n_experts_used = g->expert_intermediate = 0;
    if (moe != NULL && g->n_moe_layers > 0)
        *moe = flags;
    else
        free(flags);
    return LLMEM_OK;
}

/* ---- the geometry --------------------------------------------------------------------------- */

/* With cfg, also the per-layer flags (*layers: sliding; cfg->layer_moe) and the router's rule. */
static int config_geometry(const struct config *c, struct llmem_model_geometry *g,
                           uint8_t **layers, struct llmem_model_config *cfg) {
    const char *arch = NULL;
    int status = config_arch(c, &arch);
    if (status != LLMEM_OK)
        return status;
    snprintf(g->arch, sizeof(g->arch), "%s", arch);

    if ((status = config_int(c, "hidden_size", 1, 1, MAX_HIDDEN, &g->hidden_size)) ||
        (status = config_int(c, "num_hidden_layers", 1, 1, MAX_LAYERS, &g->n_layers)) ||
        (status = config_int(c, "num_attention_heads", 1, 1, MAX_HEADS, &g->n_heads)) ||
        (status = config_int(c, "vocab_size", 1, 1, MAX_VOCAB, &g->vocab_size)) ||
        (status =
             config_int(c, "intermediate_size", 1, 1, MAX_INTERMEDIATE, &g->intermediate_size)) ||
        (status = config_int(c, "max_position_embeddings", 1, 1, MAX_CONTEXT, &g->max_context)))
        return status;

    status = config_int(c, "num_key_value_heads", 0, 1, g->n_heads, &g->n_kv_heads);
    if (status == LLMEM_ENOENT)
        g->n_kv_heads = g->n_heads;
    else if (status != LLMEM_OK)
        return status;
    if (g->n_heads % g->n_kv_heads != 0) {
        CONFIG_ERROR("%s: num_attention_heads (%" PRId64 ") is not a multiple of "
                     "num_key_value_heads (%" PRId64 ")",
                     c->path, g->n_heads, g->n_kv_heads);
        return LLMEM_EFORMAT;
    }

    status = config_int(c, "head_dim", 0, 1, MAX_HEAD_DIM, &g->head_dim);
    if (status == LLMEM_ENOENT) {
        if (g->hidden_size % g->n_heads != 0) {
            CONFIG_ERROR("%s: no 'head_dim', and hidden_size (%" PRId64 ") is not divisible by "
                         "num_attention_heads (%" PRId64 ")",
                         c->path, g->hidden_size, g->n_heads);
            return LLMEM_EFORMAT;
        }
        g->head_dim = g->hidden_size / g->n_heads;
    } else if (status != LLMEM_OK) {
        return status;
    }
    if (g->n_heads * g->head_dim > MAX_ATTN_WIDTH) {
        CONFIG_ERROR("%s: num_attention_heads × head_dim = %" PRId64 " × %" PRId64
                     " is more than %" PRId64,
                     c->path, g->n_heads, g->head_dim, MAX_ATTN_WIDTH);
        return LLMEM_EFORMAT;
    }

    /* Tied embeddings: the text config's value, else the top level's (multimodal wrappers keep it
     * there), else false as in transformers. */
    g->tied_embeddings = 0;
    if (c->text != c->root &&
        (status = config_bool(c, c->root, "tie_word_embeddings", &g->tied_embeddings)) != LLMEM_OK)
        return status;
    if ((status = config_bool(c, c->text, "tie_word_embeddings", &g->tied_embeddings)) != LLMEM_OK)
        return status;

    g->attention_bias = 0;
    if ((status = config_bool(c, c->text, "attention_bias", &g->attention_bias)) != LLMEM_OK)
        return status;
    if (strcmp(arch, "qwen2") == 0)
        g->attention_bias = 1; /* Qwen2 projections always carry q/k/v biases */
    g->qk_norm = strcmp(arch, "qwen3") == 0 || strcmp(arch, "qwen3_moe") == 0;
    if ((status = config_moe(c, arch, g, cfg != NULL ? &cfg->layer_moe : NULL,
                             cfg != NULL ? &cfg->moe_norm_topk : NULL)) != LLMEM_OK)
        return status;

    if ((status = config_rope(c)) != LLMEM_OK)
        return status;
    if (layers != NULL) {
        *layers = calloc((size_t)g->n_layers, 1);
        if (*layers == NULL) {
            CONFIG_ERROR("out of memory");
            return LLMEM_ENOMEM;
        }
    }
    return config_sliding_window(c, arch, g->n_layers, &g->sliding_window,
                                 layers != NULL ? *layers : NULL);
}

/* The check that every reader of a model directory starts with (model_int.h): here, with the
 * first file that is read from it, so that model_dir.c, which reads the geometry from here, is
 * the only one of the pair that calls the other. */
int llmem_model_dir_check(const char *dir, const char *func) {
    struct stat st;
    if (stat(dir, &st) != 0) {
        int err = errno;
        if (err == ENOENT || err == ENOTDIR) {
            LLMEM_ERROR_AS(func, "model directory '%s' does not exist", dir);
            return LLMEM_ENOENT;
        }
        LLMEM_ERROR_AS(func, "model directory '%s': %s", dir, strerror(err));
        return LLMEM_EIO;
    }
    if (!S_ISDIR(st.st_mode)) {
        LLMEM_ERROR_AS(func, "'%s' is not a model directory (not a directory)", dir);
        return LLMEM_EINVAL;
    }
    return LLMEM_OK;
}

/* Reads config.json; with cfg, also the runtime numbers and the per-layer sliding flags. */
static int config_load(const char *model_dir, struct llmem_model_geometry *geom,
                       struct llmem_model_config *cfg) {
    int status = llmem_model_dir_check(model_dir, CONFIG_FUNC);
    if (status != LLMEM_OK)
        return status;
    char path[CONFIG_PATH_MAX];
    status = llmem_path_join(path, sizeof(path), model_dir, "config.json");
    if (status != LLMEM_OK)
        return status;
    struct stat st;
    if (stat(path, &st) != 0) {
        CONFIG_ERROR("no config.json in %s", model_dir);
        return LLMEM_ENOENT;
    }
    cJSON *root = NULL;
    status = llmem_json_parse_file(path, CONFIG_MAX_BYTES, &root);
    if (status != LLMEM_OK)
        return status;

    struct config c = {.path = path, .root = root, .text = root, .prefix = ""};
    struct llmem_model_geometry g;
    memset(&g, 0, sizeof(g));
    if (!cJSON_IsObject(root)) {
        CONFIG_ERROR("%s: not a JSON object", path);
        status = LLMEM_EFORMAT;
        goto out_json;
    }
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    if (text != NULL && !cJSON_IsNull(text)) {
        if (!cJSON_IsObject(text)) {
            CONFIG_ERROR("%s: 'text_config' must be an object, not %s", path, json_type_name(text));
            status = LLMEM_EFORMAT;
            goto out_json;
        }
        c.text = text;
        c.prefix = "text_config.";
    }
    uint8_t *layers = NULL;
    status = config_geometry(&c, &g, cfg != NULL ? &layers : NULL, cfg);
    if (status == LLMEM_OK && cfg != NULL)
        status = config_runtime(&c, cfg);
    if (status == LLMEM_OK)
        status = config_quantization(&c, cfg);
    if (status != LLMEM_OK) {
        free(layers);
        if (cfg != NULL) {
            free(cfg->layer_moe);
            cfg->layer_moe = NULL;
            free(cfg->quant_overrides);
            cfg->quant_overrides = NULL;
        }
        goto out_json;
    }
    dir_name(model_dir, g.name, sizeof(g.name));
    llmem_model_copy_tail(g.source, sizeof(g.source), model_dir);
    *geom = g;
    if (cfg != NULL)
        cfg->layer_sliding = layers;
out_json:
    cJSON_Delete(root);
    return status;
}

int llmem_model_geometry_load_config(const char *model_dir, struct llmem_model_geometry *geom) {
    if (llmem_gguf_is_gguf(model_dir))
        return llmem_model_gguf_geometry(model_dir, geom, NULL, __func__);
    return config_load(model_dir, geom, NULL);
}

int llmem_model_config_load(const char *model_dir, struct llmem_model_config *cfg) {
    if (llmem_gguf_is_gguf(model_dir))
        return llmem_model_gguf_geometry(model_dir, NULL, cfg, __func__);
    struct llmem_model_config c;
    memset(&c, 0, sizeof(c));
    int status = config_load(model_dir, &c.geom, &c);
    if (status == LLMEM_OK)
        *cfg = c;
    return status;
}

void llmem_model_config_free(struct llmem_model_config *cfg) {
    if (cfg == NULL)
        return;
    free(cfg->layer_sliding);
    cfg->layer_sliding = NULL;
    free(cfg->layer_moe);
    cfg->layer_moe = NULL;
    free(cfg->quant_overrides);
    cfg->quant_overrides = NULL;
    cfg->n_quant_overrides = 0;
}
